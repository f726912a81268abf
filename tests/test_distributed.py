"""Real coordinator and worker processes on loopback: the distributed run equals the
single-process one, and losing a worker or the coordinator loses nothing."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import (
    SMALL_RUN,
    command,
    inspect_run,
    start_coordinator,
    start_worker,
    trained_digest,
)

from eggroll_dist.shared.vocab import escape

# Four chunks a step, each long enough (~0.3 s here) that a kill lands inside one.
SLOW = """
[model]
n_layer = 1
d_model = 32
[es]
population = 256
chunk_size = 64
seq_len = 384
[validation]
every_steps = 0
max_tokens = 4096
"""


@pytest.fixture
def slow_config(tmp_path: Path) -> Path:
    path = tmp_path / "slow.toml"
    path.write_text(SLOW)
    return path


@pytest.fixture
def fast_config(tmp_path: Path) -> Path:
    path = tmp_path / "fast.toml"
    path.write_text(SMALL_RUN)
    return path


def committed(step: int):
    return lambda e: e.get("event") == "step" and e.get("step", 0) >= step


def test_local_run_equals_single_process(words_data: Path, tmp_path: Path) -> None:
    save_dir, summary = tmp_path / "run", tmp_path / "summary.json"
    done = subprocess.run(
        [
            command("eggroll-local"),
            "--workers",
            "2",
            "--steps",
            "30",
            "--preset",
            "tiny",
            "--data-dir",
            str(words_data),
            "--save-dir",
            str(save_dir),
            "--summary-json",
            str(summary),
            "--metrics-port",
            "0",
            "--sample-every",
            "10",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "held-out" in done.stdout and "unigram" in done.stdout
    assert "sample at step " in done.stdout
    assert "ETA 0s\n" in done.stdout  # the last step line: nothing left
    train_summary = tmp_path / "train.json"
    single = subprocess.run(
        [
            command("eggroll-train"),
            "--data-dir",
            str(words_data),
            "--preset",
            "tiny",
            "--steps",
            "30",
            "--summary-json",
            str(train_summary),
            "--log-format",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert single.returncode == 0, single.stderr
    trained = json.loads(train_summary.read_text())
    want = trained["replica_digest"]
    info = inspect_run(save_dir)
    assert info["step"] == 30 and info["log_ok"]
    assert info["replica_digest"] == want
    local = json.loads(summary.read_text())
    assert local["replica_digest"] == want
    # The same replica, so the same held-out scores: both metrics, per token and per byte.
    held_out = sorted(k for k in trained if k.startswith("valid_"))
    assert len(held_out) == 8 and "valid_stream_bits_per_byte" in held_out
    assert {k: local[k] for k in held_out} == {k: trained[k] for k in held_out}
    assert "long streams" in done.stdout
    # Samples written by a worker are what eggroll-sample writes at that step, seed = step.
    log = (save_dir / "logs" / "coordinator.log").read_text().splitlines()
    samples = [e for e in map(json.loads, log) if e["event"] == "sample"]
    assert all(10 <= s["step"] <= 30 for s in samples)
    assert samples[-1]["step"] == 30  # the run ends once the final step's sample is in
    for s in samples:
        step = str(s["step"])
        args = ["--data-dir", str(words_data), "--step", step, "--seed", step, "--json"]
        written = subprocess.run(
            [command("eggroll-sample"), str(save_dir), *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert written.returncode == 0, written.stderr
        record = json.loads(written.stdout)
        assert escape(record["prompt"], keep_newlines=False) == s["prompt"]
        assert escape(record["text"], keep_newlines=False) == s["text"]


def test_worker_sigkill_mid_step_loses_nothing(
    spawn, words_data: Path, tmp_path: Path, slow_config: Path
) -> None:
    steps = 6
    save_dir = tmp_path / "run"
    coord, port = start_coordinator(spawn, save_dir, slow_config, "--max-steps", str(steps))
    # The victim alone, one thread: a chunk per request, and a free chunk always there for it
    # (another worker could have taken the step's last ones and left it waiting).
    victim = start_worker(spawn, port, words_data, "victim", "--threads", "1")
    coord.wait_for(committed(2), 120, "step 2")
    victim.wait_for(
        lambda e: e.get("event") == "chunk done" and e.get("step", 0) >= 2,
        60,
        "a chunk done by the victim",
    )
    # It asked for its next chunk at once; a moment later it holds that lease, mid-chunk.
    time.sleep(0.1)
    victim.kill()
    start_worker(spawn, port, words_data, "steady", "--threads", "1")
    coord.wait_for(
        lambda e: e.get("event") == "chunks requeued" and e.get("reason") == "disconnect",
        30,
        "a re-queue on disconnect",
    )
    assert coord.wait(180) == 0
    info = inspect_run(save_dir)
    assert info["step"] == steps
    assert int(info["replica_digest"], 16) == trained_digest(words_data, slow_config, steps)


def test_coordinator_sigkill_resume_loses_nothing(
    spawn, words_data: Path, tmp_path: Path, fast_config: Path
) -> None:
    steps = 8
    save_dir = tmp_path / "run"
    coord, port = start_coordinator(spawn, save_dir, fast_config, "--max-steps", str(steps))
    workers = [start_worker(spawn, port, words_data, f"w{i}") for i in range(2)]
    coord.wait_for(committed(3), 120, "step 3")
    coord.kill()
    # Same save dir and port, no config flags: the run resumes; the workers come back alone.
    again, _ = start_coordinator(spawn, save_dir, fast_config, "--max-steps", str(steps), port=port)
    resumed_at = again.wait_for(lambda e: e.get("event") == "listening")["step"]
    assert resumed_at >= 3
    again.wait_for(lambda e: e.get("event") == "worker joined", 60, "a worker rejoining")
    assert again.wait(180) == 0
    for w in workers:  # the restart killed no worker: each stops only when the run is complete
        assert w.wait(30) == 0
        assert "complete" in w.wait_for(lambda e: e.get("event") == "stopped", 5)["reason"]
    info = inspect_run(save_dir)
    assert info["step"] == steps and info["log_ok"]
    assert int(info["replica_digest"], 16) == trained_digest(words_data, fast_config, steps)


def test_late_join_loads_snapshot_and_contributes(
    spawn, words_data: Path, tmp_path: Path, fast_config: Path
) -> None:
    steps = 10
    save_dir = tmp_path / "run"
    coord, port = start_coordinator(
        spawn, save_dir, fast_config, "--max-steps", str(steps), "--snapshot-every", "3"
    )
    start_worker(spawn, port, words_data, "early")
    coord.wait_for(
        lambda e: e.get("event") == "snapshot stored" and e["step"] >= 3, 120, "a snapshot"
    )
    coord.wait_for(committed(4), 120, "step 4")
    late = start_worker(spawn, port, words_data, "late")
    loaded = late.wait_for(lambda e: e.get("event") == "snapshot loaded", 60, "snapshot load")
    assert loaded["step"] >= 3
    late.wait_for(lambda e: e.get("event") == "chunk done", 120, "a chunk from the late worker")
    assert coord.wait(180) == 0
    assert coord.count(lambda e: e.get("code") == "DIVERGED") == 0
    info = inspect_run(save_dir)
    want = trained_digest(words_data, fast_config, steps)
    assert info["step"] == steps and int(info["replica_digest"], 16) == want
    applied = [e for e in late.events if e.get("event") == "step applied"]
    assert applied and all(
        e["digest"] == info["digests"].get(str(e["step"]), e["digest"]) for e in applied
    )


def test_local_run_stops_its_children_on_sigterm(
    words_data: Path, tmp_path: Path, fast_config: Path
) -> None:
    save_dir = tmp_path / "run"
    local = subprocess.Popen(
        [
            command("eggroll-local"),
            "--workers",
            "2",
            "--steps",
            "1000",
            "--config",
            str(fast_config),
            "--data-dir",
            str(words_data),
            "--save-dir",
            str(save_dir),
            "--metrics-port",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert local.stdout is not None
        for line in local.stdout:  # bounded: the process is killed in `finally` otherwise
            if line.startswith("step"):
                break
        local.send_signal(signal.SIGTERM)
        assert local.wait(60) == 130
    finally:
        if local.poll() is None:
            local.kill()
    leftovers = [
        p
        for p in Path("/proc").glob("[0-9]*")
        if str(save_dir).encode() in _cmdline(p)
        or f"--data-dir\0{words_data}\0".encode() in _cmdline(p)
    ]
    assert leftovers == []
    assert inspect_run(save_dir)["log_ok"]  # whatever was committed is intact


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""
