"""A save directory read back: the state at step S (newest snapshot at or below S, then the
fitness log replayed), read-only opening, and clear errors for what is not a save directory."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from helpers import UNIT_CFG

from eggroll_dist.coordinator.store import RunStore
from eggroll_dist.protocol.ternary import pack_ternary, unpack_ternary
from eggroll_dist.shared.config import ESConfig
from eggroll_dist.shared.data import load_data_dir
from eggroll_dist.shared.fitness_log import FitnessLog
from eggroll_dist.shared.replica import ReplicaState, replay, save_checkpoint
from eggroll_dist.shared.save_dir import (
    RUN_FORMAT,
    HistoryLog,
    Layout,
    SaveDir,
    SaveDirBusy,
    SaveDirError,
    new_run,
    read_history,
    snapshot_name,
    take_lock,
    write_run,
)
from eggroll_dist.worker.train import main as train_main

CFG = UNIT_CFG.replace(steps=3)
STEPS = 6


def _fitness(steps: int) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.integers(-1, 2, CFG.pairs).astype(np.int8) for _ in range(steps)]


def _straight(fitness: list[np.ndarray], step: int) -> ReplicaState:
    return replay(ReplicaState.initial(CFG), fitness[:step])


@pytest.fixture
def run_dir(tmp_path: Path) -> tuple[Path, list[np.ndarray]]:
    """A save directory of STEPS committed steps written with the layout's writers."""
    layout = Layout(tmp_path / "run")
    layout.snapshots.mkdir(parents=True)
    write_run(layout, new_run(CFG))
    log = FitnessLog.create(layout.fitness_log, CFG.pairs, CFG.digest())
    fitness = _fitness(STEPS)
    for step, values in enumerate(fitness):
        log.append(step, pack_ternary(values))
    return layout.root, fitness


def _tree(root: Path) -> dict[str, tuple[int, bytes]]:
    """Every path under `root` with its modification time and bytes."""
    return {
        str(p.relative_to(root)): (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else b"")
        for p in sorted(root.rglob("*"))
    }


def test_state_at_every_step_is_a_straight_replay(run_dir: tuple[Path, list]) -> None:
    root, fitness = run_dir
    run = SaveDir.open(root)
    assert run.config == CFG and run.steps == STEPS and run.snapshot_steps() == []
    digests = [run.state_at(step, unpack_ternary).digest() for step in range(STEPS + 1)]
    assert digests == [_straight(fitness, step).digest() for step in range(STEPS + 1)]
    assert len(set(digests)) == STEPS + 1


def test_the_newest_snapshot_at_or_below_the_step_is_used(run_dir: tuple[Path, list]) -> None:
    root, fitness = run_dir
    layout = Layout(root)
    for step in (2, 4):
        save_checkpoint(layout.snapshot(step), _straight(fitness, step))
    save_checkpoint(layout.snapshots / snapshot_name(STEPS + 3), ReplicaState.initial(CFG))
    (layout.snapshots / "step-3.ckpt").write_bytes(b"not a canonical name")
    run = SaveDir.open(root)
    assert run.snapshot_steps() == [2, 4]  # beyond the log and odd names do not count
    replayed: list[int] = []
    state = run.state_at(5, unpack_ternary, replayed.append)
    assert run.base_of(5) == 4 and replayed == [1]
    assert state.digest() == _straight(fitness, 5).digest()
    replayed.clear()
    assert run.state_at(4, unpack_ternary, replayed.append).step == 4 and replayed == []
    assert run.base_of(1) is None
    assert run.state_at(3, unpack_ternary).digest() == _straight(fitness, 3).digest()
    replayed.clear()
    plain = run.state_at(5, unpack_ternary, replayed.append, snapshots=False)
    assert replayed == [5] and plain.digest() == state.digest()


def test_a_snapshot_of_another_run_is_refused(run_dir: tuple[Path, list]) -> None:
    root, _ = run_dir
    other = CFG.replace(es=ESConfig(population=32, chunk_size=8, seq_len=8))
    save_checkpoint(Layout(root).snapshot(2), ReplicaState.initial(other))
    with pytest.raises(SaveDirError, match="belongs to another run"):
        SaveDir.open(root).state_at(3, unpack_ternary)


def test_reading_creates_and_changes_nothing(run_dir: tuple[Path, list]) -> None:
    root, _ = run_dir
    Layout(root).snapshots.rmdir()
    with open(Layout(root).fitness_log, "ab") as f:
        f.write(b"\x00" * 5)  # a torn last record, as a live coordinator's append may leave
    before = _tree(root)
    run = SaveDir.open(root)
    assert run.layout.snapshot_steps() == [] and run.digests() == {}
    with pytest.raises(SaveDirError, match="torn record"):
        run.state_at(2, unpack_ternary)  # never repaired here
    assert _tree(root) == before
    assert not (root / ".lock").exists() and not (root / "snapshots").exists()


def test_a_live_coordinators_directory_reads_the_same(tmp_path: Path) -> None:
    store = RunStore.open(tmp_path / "run", CFG)
    fitness = _fitness(3)
    for step, values in enumerate(fitness):
        store.fitness_log.append(step, pack_ternary(values))
        store.record_digest(step + 1, _straight(fitness, step + 1).digest())
    store.sync_digests()
    run = SaveDir.open(store.path)
    assert run.run["run_id"] == store.run_id.hex() and run.steps == 3
    assert run.digests() == {s: run.state_at(s, unpack_ternary).digest() for s in (1, 2, 3)}
    store.close()


def test_not_a_save_directory_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SaveDirError, match="does not exist"):
        SaveDir.open(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(SaveDirError, match="not a directory"):
        SaveDir.open(tmp_path / "file")
    with pytest.raises(SaveDirError, match=r"holds no run \(no run.json\)"):
        SaveDir.open(tmp_path)
    for text in ("{", "[]", '{"config": {"model": {"n_layer": -1}}}', "{}"):
        (tmp_path / "run.json").write_text(text)
        with pytest.raises(SaveDirError, match=r"run\.json is unreadable"):
            SaveDir.open(tmp_path)


def test_a_step_outside_the_run_or_a_foreign_log_is_refused(run_dir: tuple[Path, list]) -> None:
    root, _ = run_dir
    run = SaveDir.open(root)
    for step in (-1, STEPS + 1):
        with pytest.raises(SaveDirError, match=f"step {step} is not in .*steps 0..{STEPS}"):
            run.state_at(step, unpack_ternary)
    other = CFG.replace(steps=4)
    write_run(Layout(root), new_run(other))
    with pytest.raises(SaveDirError, match="belongs to another run config"):
        SaveDir.open(root).state_at(1, unpack_ternary)


def test_a_run_without_a_fitness_log_has_no_steps(tmp_path: Path) -> None:
    write_run(Layout(tmp_path), new_run(CFG))
    run = SaveDir.open(tmp_path)
    assert run.steps == 0 and run.snapshot_steps() == []
    assert run.state_at(0, unpack_ternary).digest() == ReplicaState.initial(CFG).digest()


def test_eggroll_train_leaves_a_save_directory_that_reads_back(
    words_data: Path, tmp_path: Path
) -> None:
    config, save = tmp_path / "small.toml", tmp_path / "save"
    config.write_text(
        "steps = 3\n[model]\nn_layer = 1\nd_model = 16\n"
        "[es]\npopulation = 16\nchunk_size = 8\nseq_len = 8\n"
        "[validation]\nevery_steps = 0\nmax_tokens = 256\n"
    )
    args = ["--data-dir", words_data, "--config", config, "--save-dir", save]
    result = CliRunner().invoke(train_main, [*map(str, args), "--sample-every", "0"])
    assert result.exit_code == 0, result.output
    run = SaveDir.open(save)
    stored = json.loads(run.layout.run_file.read_text())
    assert stored["format"] == RUN_FORMAT and len(stored["run_id"]) == 32
    assert stored["data_digest"] == load_data_dir(words_data).meta.sha256  # for eggroll-sample
    summary = json.loads(run.layout.summary.read_text())
    assert run.config == CFG and run.steps == 3 and run.snapshot_steps() == [3]
    assert run.state_at(3, unpack_ternary).digest_hex() == summary["replica_digest"]
    fitness = [unpack_ternary(p, CFG.pairs) for p in run.fitness_log().read(0, 3)]
    assert run.state_at(2, unpack_ternary).digest() == _straight(fitness, 2).digest()


def test_one_writer_at_a_time(tmp_path: Path) -> None:
    layout = Layout(tmp_path)
    assert take_lock(layout, create=False) is None and not layout.lock.exists()
    held = take_lock(layout)
    assert held is not None and layout.lock.exists()
    with pytest.raises(SaveDirBusy, match=f"process {os.getpid()} is writing"):
        take_lock(layout, create=False)
    os.close(held)
    again = take_lock(layout, create=False)
    assert again is not None
    os.close(again)


@pytest.mark.parametrize("torn", [b'{"event":"st', b'{"event":"sample","text":"' + b"x" * 9000])
def test_history_log_cuts_a_torn_line_before_it_appends(tmp_path: Path, torn: bytes) -> None:
    path = tmp_path / "history.log"
    whole = b'{"event":"step","step":1}\n'
    path.write_bytes(whole + torn)  # a crash mid-line; the long one spans pages
    history = HistoryLog(path)
    assert history.append({"event": "step", "step": 2}) is None
    history.close()
    assert path.read_bytes() == whole + b'{"event":"step","step":2}\n'
    assert [r["step"] for r in read_history(path)] == [1, 2]
    assert read_history(tmp_path / "none.log") == []
