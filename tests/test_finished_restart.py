"""A finished run (--max-steps reached) restarted after its final snapshot was deleted or
spoilt, against a real coordinator: it says it waits for a worker to rebuild the snapshot,
and ends with exit 0 either way: without one when the wait is up (every step is in the
fitness log), or with the snapshot a worker rebuilt from the log."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import TINY_RUN, digest_at, start_coordinator, start_worker

from eggroll_dist.shared.save_dir import SaveDir

STEPS = 2


@pytest.mark.parametrize("damage", ["deleted", "corrupt"])
def test_a_finished_run_without_its_final_snapshot_says_so_and_exits_0(
    spawn: Callable[..., Any], words_data: Path, tmp_path: Path, damage: str
) -> None:
    config, save = tmp_path / "run.toml", tmp_path / "run"
    config.write_text(TINY_RUN)
    finish = ("--max-steps", str(STEPS))
    coord, port = start_coordinator(spawn, save, config, *finish)
    start_worker(spawn, port, words_data)
    assert coord.wait(60) == 0
    snapshot = save / "snapshots" / f"step-{STEPS:08d}.ckpt"
    assert snapshot.exists()
    if damage == "deleted":
        snapshot.unlink()
    else:
        snapshot.write_bytes(b"\0" * 64)

    # Nobody comes: one line says what it waits for and why, then exit 0, nothing lost.
    coord, port = start_coordinator(spawn, save, config, *finish, "--final-snapshot-timeout-s", "1")
    said = coord.wait_for(lambda e: e.get("event") == "run finished: waiting for a worker")
    assert said["step"] == STEPS and said["wants"] == "final snapshot"
    assert f"eggroll-worker 127.0.0.1:{port}" in said["hint"]
    assert coord.wait(30) == 0
    assert coord.count(lambda e: e.get("event") == "no final snapshot") == 1
    assert SaveDir.open(save).steps == STEPS

    # A worker comes: it replays the log and sends the final snapshot, then both stop.
    coord, port = start_coordinator(spawn, save, config, *finish)
    coord.wait_for(lambda e: e.get("event") == "run finished: waiting for a worker")
    worker = start_worker(spawn, port, words_data, "rebuilder")
    assert coord.wait(60) == 0
    assert worker.wait(30) == 0
    stored = coord.wait_for(lambda e: e.get("event") == "snapshot stored")
    assert stored["step"] == STEPS and stored["digest"] == f"{digest_at(save, STEPS):016x}"
    assert snapshot.exists() and SaveDir.open(save).steps == STEPS
