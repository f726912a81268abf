"""A reward that is not a pure function of its inputs, against a real coordinator: the run
stops at its first checked chunk with one line that names the likely cause (exit status 3),
every committed step kept, and once the reward is deterministic the same save directory
resumes and finishes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import free_port, start_coordinator, start_worker

from eggroll_dist.shared.save_dir import SaveDir

# Python's hash() of a str differs from process to process unless PYTHONHASHSEED is fixed:
# each worker's reward process gives its own scores (the common mistake, made on purpose).
HASHED = "def score(text):\n    return hash(text) % 1000 / 1000\n"


def reward_run(tmp: Path) -> Path:
    """A small reward run (4 chunks of 8 members a step) scored by HASHED."""
    (tmp / "score.py").write_text(HASHED)
    path = tmp / "run.toml"
    path.write_text(
        "[model]\nn_layer = 1\nd_model = 16\n"
        "[es]\npopulation = 32\nchunk_size = 8\nseq_len = 8\n"
        '[fitness]\nobjective = "reward"\nreward = "score.py:score"\nprompts = "data"\n'
        "prompts_per_step = 4\ncompletion_tokens = 12\nheld_out_prompts = 8\n"
        "[validation]\nevery_steps = 0\nmax_tokens = 200\n"
    )
    return path


def serve(
    spawn: Callable[..., Any], save: Path, config: Path, data: Path, *flags: str
) -> tuple[Any, list[Any]]:
    """A coordinator that checks every chunk, and two workers with the goal files."""
    coord, port = start_coordinator(
        spawn, save, config, "--verify-fraction", "1", *flags, port=free_port()
    )
    workers = [
        start_worker(spawn, port, data, f"w{i}", "--goal-dir", str(config.parent)) for i in range(2)
    ]
    return coord, workers


def test_a_reward_that_is_not_deterministic_stops_the_run_with_one_line(
    spawn: Callable[..., Any], words_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config, save = reward_run(tmp_path), tmp_path / "run"
    monkeypatch.setenv("PYTHONHASHSEED", "0")  # deterministic: two steps are committed
    coord, workers = serve(spawn, save, config, words_data, "--max-steps", "2")
    assert coord.wait(120) == 0
    for w in workers:
        w.stop()
    assert SaveDir.open(save).steps == 2

    monkeypatch.delenv("PYTHONHASHSEED")  # each process its own: honest workers disagree
    coord, workers = serve(spawn, save, config, words_data, "--max-steps", "4")
    assert coord.wait(120) == 3
    last = coord.lines[-1]  # the one line a person (or systemd's log) sees
    assert last.startswith("Error: workers w0 and w1 computed different fitness for chunk ")
    assert "of step 2 and no third machine can decide" in last
    assert "Python's hash()" in last and "make it deterministic" in last
    assert not any("Traceback" in line for line in coord.lines)
    stopped = coord.wait_for(lambda e: e.get("event") == "results differ: the run stops")
    assert stopped["workers"] == "w0,w1" and stopped["step"] == 2
    for w in workers:
        w.stop()
    assert SaveDir.open(save).steps == 2  # no committed step lost

    monkeypatch.setenv("PYTHONHASHSEED", "0")  # fixed: the same save directory resumes
    coord, workers = serve(spawn, save, config, words_data, "--max-steps", "3")
    assert coord.wait(120) == 0
    assert SaveDir.open(save).steps == 3
