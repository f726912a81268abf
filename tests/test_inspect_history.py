"""eggroll-inspect shows the preset, the last train loss, the held-out bits and step times
from what the save dir keeps (history.log, which every writer keeps: a hand-started
coordinator too), and says so when it keeps none."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from helpers import TINY_RUN, command, start_coordinator, start_worker

from eggroll_dist.coordinator.inspect import history
from eggroll_dist.shared.config import preset, preset_of, resolve_config
from eggroll_dist.shared.fitness_log import FitnessLog

SMALL = """
[model]
n_layer = 1
d_model = 32
[es]
population = 128
chunk_size = 64
seq_len = 16
[validation]
every_steps = 0
max_tokens = 256
"""


def _inspect(save_dir: Path, *args: str) -> str:
    done = subprocess.run(
        [command("eggroll-inspect"), str(save_dir), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_presets_are_recognised() -> None:
    assert preset_of(preset("tiny")) == "tiny" and preset_of(preset("egg-paper")) == "egg-paper"


def test_a_train_run_shows_loss_held_out_bits_and_step_times(
    words_data: Path, tmp_path: Path
) -> None:
    config, save_dir = tmp_path / "small.toml", tmp_path / "run"
    config.write_text(SMALL)
    done = subprocess.run(
        [
            *(command("eggroll-train"), "--data-dir", str(words_data), "--config", str(config)),
            *("--steps", "2", "--save-dir", str(save_dir), "--log-format", "json"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads((save_dir / "summary.json").read_text())
    h = json.loads(_inspect(save_dir, "--json"))["history"]
    assert h["train_loss_bits"] == summary["train_loss_bits"]
    assert h["valid_bits_per_token"] == summary["valid_bits_per_token"] and h["valid_step"] == 2
    assert h["steps_timed"] == 2 and h["step_s_last"] == summary["step_seconds"][-1]
    line = _inspect(save_dir).splitlines()[1]
    assert line.startswith("preset none (own config); last train loss ")
    assert f"held-out {summary['valid_bits_per_token']:.3f} (step 2)" in line
    streams = summary["valid_stream_bits_per_token"]
    assert h["valid_stream_bits_per_token"] == streams
    assert f"bits/token, {streams:.3f} over long streams, step time" in line


def test_a_coordinator_log_gives_loss_and_times(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    lines = [
        {"event": "step", "step": 1, "loss_bits": 7.5, "step_s": 0.5},
        {"event": "validation", "step": 1, "valid_bits": 7.25, "stream_bits": 7.125},
        {"event": "step", "step": 2, "loss_bits": 7.0, "step_s": 1.5},
    ]
    text = "\n".join(json.dumps(e) for e in lines) + '\n{"event": "st'  # a torn last line
    (tmp_path / "logs" / "coordinator.log").write_text(text)
    h = history(tmp_path)
    assert h["train_loss_bits"] == 7.0 and h["valid_bits_per_token"] == 7.25
    assert h["valid_stream_bits_per_token"] == 7.125
    assert h["step_s_mean"] == 1.0 and h["step_s_last"] == 1.5 and h["steps_timed"] == 2


def test_a_save_dir_without_history_says_unknown(tmp_path: Path) -> None:
    cfg = resolve_config("tiny", None)
    (tmp_path / "run.json").write_text(json.dumps({"config": cfg.to_dict()}))
    FitnessLog.create(tmp_path / "fitness.log", cfg.pairs, cfg.digest())
    line = _inspect(tmp_path).splitlines()[1]
    assert line.startswith("preset tiny; train loss, held-out bits and step times unknown")


def test_a_hand_started_coordinator_keeps_loss_held_out_bits_and_step_times(
    spawn: Callable[..., Any], words_data: Path, tmp_path: Path
) -> None:
    config, save_dir = tmp_path / "tiny.toml", tmp_path / "run"
    config.write_text(TINY_RUN.replace("every_steps = 0", "every_steps = 2"))
    coord, port = start_coordinator(spawn, save_dir, config, "--max-steps", "4")
    start_worker(spawn, port, words_data)
    assert coord.wait(60) == 0
    steps = [e for e in coord.events if e.get("event") == "step"]
    valid = [e for e in coord.events if e.get("event") == "validation"]
    assert [e["step"] for e in steps] == [1, 2, 3, 4] and valid
    h = json.loads(_inspect(save_dir, "--json"))["history"]
    assert h["source"] == "history.log"
    assert h["train_loss_bits"] == steps[-1]["loss_bits"]
    assert h["valid_bits_per_token"] == valid[-1]["valid_bits"]
    assert h["valid_step"] == valid[-1]["step"]
    assert h["steps_timed"] == 4 and h["step_s_last"] == steps[-1]["step_s"]
    line = _inspect(save_dir).splitlines()[1]
    assert "unknown" not in line and "(from history.log)" in line


def test_a_corrupt_fitness_log_shows_the_steps_before_it_and_no_later_curve(
    spawn: Callable[..., Any], words_data: Path, tmp_path: Path
) -> None:
    """A record corrupt in the middle: the steps before it are what the run holds, so the
    digests shown (within --last) and the curve stop there, before and after the
    `truncate` the error suggests."""
    config, save_dir = tmp_path / "tiny.toml", tmp_path / "run"
    config.write_text(TINY_RUN.replace("every_steps = 0", "every_steps = 2"))
    coord, port = start_coordinator(spawn, save_dir, config, "--max-steps", "8")
    start_worker(spawn, port, words_data)
    assert coord.wait(60) == 0
    # An agreed digest for every step, as a run with several workers keeps them.
    (save_dir / "digests.log").write_text("".join(f"{s} {s:016x}\n" for s in range(1, 9)))
    path = save_dir / "fitness.log"
    log = FitnessLog.open(path)
    at = path.stat().st_size - 3 * log.record_size  # record 5 of 8
    data = bytearray(path.read_bytes())
    data[at + 2 : at + 6] = b"\xff\xff\xff\xff"
    path.write_bytes(bytes(data))

    done = subprocess.run(
        [command("eggroll-inspect"), str(save_dir), "--last", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    lines = done.stdout.splitlines()
    assert "steps committed: 5 (the records before the corrupt one)" in lines[2], lines
    assert "record 5 is corrupt" in lines[2] and "truncate -s" in lines[2]
    shown = [ln for ln in lines if ln.strip().startswith("state at step")]
    assert [int(ln.split()[3].rstrip(":")) for ln in shown] == [4, 5], lines
    info = json.loads(
        subprocess.run(
            [command("eggroll-inspect"), str(save_dir), "--json"], capture_output=True, text=True
        ).stdout
    )
    assert info["step"] == 5 and info["history"]["valid_step"] == 4

    keep = int(lines[2].split("truncate -s ")[1].split()[0])
    with open(path, "r+b") as f:
        f.truncate(keep)
    info = json.loads(_inspect(save_dir, "--json"))
    assert (
        info["log_ok"] and info["step"] == 5 and list(info["digests"]) == ["1", "2", "3", "4", "5"]
    )
    assert info["history"]["valid_step"] == 4 and info["history"]["steps_timed"] == 5


def test_a_coordinator_run_scores_its_last_step_whatever_the_interval(
    spawn: Callable[..., Any], words_data: Path, tmp_path: Path
) -> None:
    """--max-steps 3 with a validation every 2 steps: the curve still ends with a held-out
    score of step 3, for history.log, --plot and the trackers."""
    config, save_dir = tmp_path / "tiny.toml", tmp_path / "run"
    config.write_text(TINY_RUN.replace("every_steps = 0", "every_steps = 2"))
    coord, port = start_coordinator(spawn, save_dir, config, "--max-steps", "3")
    start_worker(spawn, port, words_data)
    assert coord.wait(60) == 0
    valid = [e["step"] for e in coord.events if e.get("event") == "validation"]
    assert valid == [2, 3]
    assert json.loads(_inspect(save_dir, "--json"))["history"]["valid_step"] == 3
