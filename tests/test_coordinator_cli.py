"""eggroll-coordinator as a user meets it: env vars, clear errors, clean stop."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import TINY_RUN, Peer, start_coordinator

from eggroll_dist.coordinator.store import RunStore
from eggroll_dist.protocol import (
    Job,
    JobRequest,
    Result,
    SnapshotRequest,
    Step,
    Welcome,
    iter_snapshot_chunks,
    unpack_ternary,
)
from eggroll_dist.shared.config import load_config, preset
from eggroll_dist.shared.data import load_data_dir
from eggroll_dist.shared.replica import ReplicaState, encode_checkpoint
from eggroll_dist.worker.backend.numpy_backend import NumpyBackend

EXE = str(Path(sys.executable).with_name("eggroll-coordinator"))


def test_flags_come_from_environment_variables(spawn, tmp_path: Path) -> None:
    env_dir = tmp_path / "from-env"
    os.environ["EGGROLL_SAVE_DIR"] = str(env_dir)
    try:
        coord = spawn(
            "eggroll-coordinator",
            "--port",
            "0",
            "--host",
            "127.0.0.1",
            "--metrics-port",
            "0",
            "--log-format",
            "json",
        )
        listening = coord.wait_for(lambda e: e.get("event") == "listening", 30)
    finally:
        del os.environ["EGGROLL_SAVE_DIR"]
    assert listening["save_dir"] == str(env_dir) and listening["step"] == 0
    coord.proc.send_signal(signal.SIGTERM)
    assert coord.wait(30) == 0  # SIGTERM stops it cleanly
    coord.wait_for(lambda e: e.get("event") == "stopped", 5)
    assert (env_dir / "run.json").exists() and (env_dir / "fitness.log").exists()


def test_a_stop_right_after_a_commit_waits_for_the_final_snapshot(
    spawn, tmp_path: Path, words_data: Path
) -> None:
    """SIGTERM just after step 1 is committed, before the only worker has asked for a job
    at it: the coordinator asks it for the final snapshot when it gets there."""
    config = tmp_path / "run.toml"
    config.write_text(TINY_RUN)
    save = tmp_path / "run"
    coord, port = start_coordinator(spawn, save, config)
    dataset = load_data_dir(words_data)
    backend = NumpyBackend(dataset, ReplicaState.initial(load_config(config)))
    worker = Peer(port)
    try:
        assert isinstance(worker.join("", dataset.digest, "w"), Welcome)
        digest = backend.state.digest()
        worker.send(JobRequest(0, digest))
        while not isinstance(msg := worker.receive(), Step):
            if isinstance(msg, Job):
                r = backend.evaluate_chunk(0, msg.first_member, msg.member_count)
                worker.send(
                    Result.from_values(
                        step=0,
                        chunk=msg.chunk,
                        loss_sum=r.loss_sum,
                        weights_changed=0,
                        replica_digest=digest,
                        fitness=r.fitness,
                    )
                )
                worker.send(JobRequest(0, digest))
        changed = backend.apply_step(unpack_ternary(msg.fitness, msg.pair_count))
        coord.proc.send_signal(signal.SIGTERM)
        coord.wait_for(lambda e: e.get("event") == "stopping", 10)
        worker.send(JobRequest(1, backend.state.digest(), changed))
        asked = worker.until(SnapshotRequest)
        assert isinstance(asked, SnapshotRequest) and asked.step == 1, asked
        for chunk in iter_snapshot_chunks(1, encode_checkpoint(backend.state)):
            worker.send(chunk)
        assert coord.wait(30) == 0
    finally:
        worker.close()
    stopped = coord.wait_for(lambda e: e.get("event") == "stopped", 5)
    assert stopped["latest_snapshot"] == 1 and (save / "snapshots" / "step-00000001.ckpt").exists()


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [EXE, *args, "--log-format", "json", "--metrics-port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_port_in_use_leaves_the_save_dir_untouched(tmp_path: Path) -> None:
    save = tmp_path / "run"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        done = _run(
            "--save-dir", str(save), "--preset", "tiny", "--host", "127.0.0.1", "--port", port
        )
    assert done.returncode == 1 and "is in use" in done.stderr
    assert "Traceback" not in done.stderr
    # Nothing was written, so the corrected command may start the run with any preset.
    assert not save.exists()


def test_a_different_config_on_resume_is_one_clear_line(tmp_path: Path) -> None:
    save = tmp_path / "run"
    RunStore.open(save, preset("tiny")).close()
    done = _run(
        "--save-dir", str(save), "--preset", "egg-paper", "--host", "127.0.0.1", "--port", "0"
    )
    assert done.returncode == 1 and "holds a run with config digest" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "args,message",
    [
        (["--preset", "huge"], "unknown preset"),
        (["--config", "/nonexistent.toml"], "does not exist"),
    ],
)
def test_bad_config_is_one_clear_line(tmp_path: Path, args: list[str], message: str) -> None:
    done = _run("--save-dir", str(tmp_path / "run"), *args)
    assert done.returncode == 1 and message in done.stderr and "Traceback" not in done.stderr
