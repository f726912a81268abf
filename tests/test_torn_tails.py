"""A save directory whose last fitness record or digest line is torn (a crash mid-append):
eggroll-inspect counts the whole records and says the tail is torn; the coordinator cuts
both tails at start and says so, naming the file and the bytes cut."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner
from helpers import TINY_RUN, start_coordinator

from eggroll_dist.coordinator.inspect import inspect_run
from eggroll_dist.coordinator.inspect import main as inspect_main
from eggroll_dist.coordinator.store import RunStore
from eggroll_dist.shared.config import load_config
from eggroll_dist.shared.fitness_log import packed_size


def _torn_run(tmp_path: Path) -> tuple[Path, Path]:
    config = tmp_path / "tiny.toml"
    config.write_text(TINY_RUN)
    cfg = load_config(config)
    store = RunStore.open(tmp_path / "run", cfg)
    for step in range(3):
        store.fitness_log.append(step, bytes(packed_size(cfg.pairs)))
        store.record_digest(step + 1, 0x1234 + step)
    store.close()
    with open(store.layout.fitness_log, "ab") as f:
        f.write(b"\x00\x00\x00\x00\x00\x00\x00\x03\x00")  # 9 bytes of step 3's record
    with open(store.layout.digests_log, "ab") as f:
        f.write(b"4 00000")
    return store.path, config


def test_inspect_counts_the_whole_records_of_a_torn_log(tmp_path: Path) -> None:
    save, _ = _torn_run(tmp_path)
    info = inspect_run(save)
    assert info["step"] == 3 and info["log_ok"] and info["torn_tail_bytes"] == 9
    result = CliRunner().invoke(inspect_main, [str(save)])
    assert result.exit_code == 0, result.output
    assert "steps committed: 3  fitness log: ok; its tail is torn (9 bytes" in result.output
    as_json = json.loads(CliRunner().invoke(inspect_main, [str(save), "--json"]).output)
    assert as_json["step"] == 3 and as_json["torn_tail_bytes"] == 9


def test_the_coordinator_says_what_it_cuts(spawn, tmp_path: Path) -> None:
    save, config = _torn_run(tmp_path)
    coord, _ = start_coordinator(spawn, save, config)
    cut = {
        e["event"]: e
        for e in coord.events
        if e.get("level") == "warning" and "tail repaired" in e["event"]
    }
    log, digests = cut["fitness log tail repaired"], cut["digests log tail repaired"]
    assert log["path"] == str(save / "fitness.log") and log["bytes_cut"] == 9
    assert digests["path"] == str(save / "digests.log") and digests["bytes_cut"] == 7
    assert inspect_run(save)["torn_tail_bytes"] == 0
