"""deploy/run-workers.sh: one worker per GPU against a real coordinator, stopped by a
signal; dry runs; GPU selection; no GPU; a worker that cannot start; a stuck worker; each
worker exit status acted on as worker/exits.py's exit_policy says."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers import free_port

from eggroll_dist.worker.exits import exit_policy

SCRIPT = Path(__file__).resolve().parents[1] / "deploy" / "run-workers.sh"
WORKER = Path(sys.executable).with_name("eggroll-worker")
SHORT_HOST = socket.gethostname().split(".")[0]

CONFIG = """
[model]
n_layer = 1
d_model = 16
[es]
population = 64
chunk_size = 16
seq_len = 8
[validation]
every_steps = 0
max_tokens = 480
"""

THREE_GPUS = """#!/bin/sh
echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-00000000-0000-0000-0000-000000000000)"
echo "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-11111111-1111-1111-1111-111111111111)"
echo "  MIG 1g.10gb     Device  0: (UUID: MIG-22222222-2222-2222-2222-222222222222)"
echo "GPU 2: NVIDIA H100 80GB HBM3 (UUID: GPU-33333333-3333-3333-3333-333333333333)"
"""

# Records what run-workers.sh gave each worker, then becomes the real worker (same pid).
# The GPU named by FAIL_GPU gets an empty data directory, so that worker cannot start.
WRAPPER = """#!/usr/bin/env bash
echo "$CUDA_VISIBLE_DEVICES workers_per_host=$EGGROLL_WORKERS_PER_HOST $*" >> {calls}
echo $$ >> {pids}
if [[ -n ${{FAIL_GPU:-}} && $CUDA_VISIBLE_DEVICES == "$FAIL_GPU" ]]; then
    set -- "$@" --data-dir {empty}
fi
if [[ -n ${{FAULTY_GPU:-}} && $CUDA_VISIBLE_DEVICES == "$FAULTY_GPU" ]]; then
    exit 3  # as a worker that computes differently from the run exits
fi
exec {worker} "$@"
"""


class Script:
    """run-workers.sh as a subprocess, its output lines collected as they come."""

    def __init__(self, args: list[str | Path], env: dict[str, str]):
        self.proc = subprocess.Popen(
            [str(SCRIPT), *map(str, args)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._open = 2
        for stream in (self.proc.stdout, self.proc.stderr):
            threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._open -= 1
            self._cond.notify_all()

    def wait_line(self, match: Callable[[str], bool], timeout: float, what: str) -> str:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.lines:
                    if match(line):
                        return line
                left = deadline - time.monotonic()
                if left <= 0 or self._open == 0:
                    raise AssertionError(f"no {what} within {timeout} s:\n" + self.output())
                self._cond.wait(min(left, 0.5))

    def finish(self, timeout: float) -> int:
        """Exit status, once the process has exited and its output is all read."""
        try:
            status = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"run-workers.sh still running after {timeout} s:\n" + self.output()
            ) from None
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._open and time.monotonic() < deadline:
                self._cond.wait(0.5)
        return status

    def output(self) -> str:
        """The last lines, without the per-chunk and per-step ones."""
        with self._cond:
            quiet = [s for s in self.lines if '"chunk done"' not in s and '"step applied"' not in s]
            return "\n".join(quiet[-60:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def worker_events(lines: list[str], label: str) -> list[dict]:
    """The JSON log events of the worker whose lines carry the prefix [gpu<label>]."""
    prefix = f"[gpu{label}] "
    events = []
    for line in lines:
        if line.startswith(prefix):
            try:
                events.append(json.loads(line[len(prefix) :]))
            except ValueError:
                pass
    return events


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def bin_dir(tmp_path: Path) -> Path:
    """A directory for PATH with a fake nvidia-smi that lists three GPUs."""
    path = tmp_path / "bin"
    path.mkdir()
    write_executable(path / "nvidia-smi", THREE_GPUS)
    return path


@pytest.fixture
def wrapper(tmp_path: Path) -> Iterator[Path]:
    """The EGGROLL_WORKER_BIN for run-workers.sh; `calls` and `pids` appear beside it."""
    empty = tmp_path / "empty-data"
    empty.mkdir()
    path = tmp_path / "worker-wrapper"
    text = WRAPPER.format(
        calls=tmp_path / "calls", pids=tmp_path / "pids", empty=empty, worker=WORKER
    )
    write_executable(path, text)
    yield path
    for pid in recorded_pids(tmp_path):  # only after a failed test: leave no worker behind
        cmdline = Path(f"/proc/{pid}/cmdline")
        if cmdline.exists() and b"eggroll-worker" in cmdline.read_bytes():
            os.kill(pid, signal.SIGKILL)


def write_executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


def recorded_pids(tmp_path: Path) -> list[int]:
    pids = tmp_path / "pids"
    return [int(p) for p in pids.read_text().split()] if pids.exists() else []


def recorded_calls(tmp_path: Path) -> dict[str, list[str]]:
    """CUDA_VISIBLE_DEVICES -> the arguments each worker was started with."""
    calls = tmp_path / "calls"
    lines = calls.read_text().splitlines() if calls.exists() else []
    return {line.split(" ")[0]: line.split(" ")[1:] for line in lines}


def script_env(path_dirs: list[Path], **extra: str) -> dict[str, str]:
    """This environment without CUDA_VISIBLE_DEVICES and EGGROLL_* settings, plus `extra`.

    PATH is `path_dirs` and then this PATH without any directory holding an nvidia-smi.
    """
    env = {
        k: v
        for k, v in os.environ.items()
        if k != "CUDA_VISIBLE_DEVICES" and not k.startswith("EGGROLL_")
    }
    system = [d for d in env.get("PATH", "").split(os.pathsep) if d]
    system = [d for d in system if not (Path(d) / "nvidia-smi").exists()]
    env["PATH"] = os.pathsep.join([*map(str, path_dirs), *system])
    env.update(extra)
    return env


def run_script(*args: str | Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(SCRIPT), *map(str, args)], env=env, capture_output=True, text=True, timeout=30
    )


def test_one_worker_per_gpu_joins_and_stops_on_sigterm(
    spawn, words_data: Path, tmp_path: Path, bin_dir: Path, wrapper: Path, monkeypatch
) -> None:
    config = tmp_path / "run.toml"
    config.write_text(CONFIG)
    monkeypatch.setenv("EGGROLL_METRICS_PORT", "0")  # no fixed port for a test coordinator
    coord = spawn(
        "eggroll-coordinator",
        "--save-dir",
        tmp_path / "run",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--log-format",
        "json",
        "--config",
        config,
    )
    port = coord.wait_for(lambda e: e.get("event") == "listening", 30, "listening line")["port"]

    flags = ["--backend", "numpy", "--data-dir", words_data, "--log-format", "json"]
    # A worker that ignores SIGTERM is killed after 10 s: the test fails then, not hangs.
    env = script_env([bin_dir], EGGROLL_WORKER_BIN=str(wrapper), EGGROLL_STOP_TIMEOUT_S="10")
    script = Script([f"127.0.0.1:{port}", *flags, "--max-retry-s", "1"], env)
    try:
        names = {f"{SHORT_HOST}-gpu{i}" for i in range(3)}
        for name in sorted(names):
            coord.wait_for(
                lambda e, name=name: e.get("event") == "worker joined" and e["worker"] == name,
                60,
                f"{name} joining",
            )
        joined = [e["worker"] for e in coord.events if e.get("event") == "worker joined"]
        assert sorted(joined) == sorted(names)

        # Each worker saw its own GPU, its name, and the flags unchanged.
        calls = recorded_calls(tmp_path)
        assert sorted(calls) == ["0", "1", "2"]
        for gpu, args in calls.items():
            # Three workers share the host's cores (a NumPy backend sizes its pool by it).
            assert args[:3] == ["workers_per_host=3", "--name", f"{SHORT_HOST}-gpu{gpu}"]
            assert args[3:] == [f"127.0.0.1:{port}", *map(str, flags), "--max-retry-s", "1"]
        # Its log lines carry its prefix.
        for gpu in "012":
            line = script.wait_line(
                lambda line, gpu=gpu: line.startswith(f"[gpu{gpu}] ") and "worker starting" in line,
                10,
                f"gpu{gpu}'s starting line",
            )
            assert json.loads(line.partition(" ")[2])["name"] == f"{SHORT_HOST}-gpu{gpu}"

        pids = recorded_pids(tmp_path)
        assert len(pids) == 3 and all(alive(pid) for pid in pids)
        script.proc.send_signal(signal.SIGTERM)
        assert script.finish(30) == 0, script.output()
    finally:
        script.stop()

    # The script reaped every worker before exiting; each stopped cleanly and said so.
    assert not [pid for pid in pids if alive(pid)]
    for gpu in "012":
        assert any(e.get("event") == "stopped" for e in worker_events(script.lines, gpu)), gpu
    assert any("stopping the workers" in line for line in script.lines)
    for name in names:
        coord.wait_for(
            lambda e, name=name: e.get("event") == "worker left" and e.get("worker") == name,
            20,
            f"{name} leaving",
        )


def test_dry_run_prints_one_command_per_gpu(tmp_path: Path, bin_dir: Path, wrapper: Path) -> None:
    env = script_env([bin_dir], EGGROLL_WORKER_BIN=str(wrapper))
    done = run_script(
        "10.0.0.5:4000", "--backend", "numpy", "--dry-run", "--data-dir", "a b", env=env
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines == [
        f"CUDA_VISIBLE_DEVICES={i} EGGROLL_WORKERS_PER_HOST=3 {wrapper} --name {SHORT_HOST}-gpu{i} "
        "10.0.0.5:4000 --backend numpy --data-dir a\\ b"
        for i in range(3)
    ]
    assert not (tmp_path / "calls").exists()  # nothing ran

    done = run_script("10.0.0.5", "--dry-run", "--name", "rack7", env=env)
    assert [line.split()[0:4] for line in done.stdout.splitlines()] == [
        [f"CUDA_VISIBLE_DEVICES={i}", "EGGROLL_WORKERS_PER_HOST=3", str(wrapper), "--name"]
        for i in range(3)
    ]
    assert [line.split()[4] for line in done.stdout.splitlines()] == [
        "rack7-gpu0",
        "rack7-gpu1",
        "rack7-gpu2",
    ]

    done = run_script("--help", env=env)
    assert done.returncode == 0 and "Usage:" in done.stdout and "--dry-run" in done.stdout


@pytest.mark.parametrize(
    ("visible", "expected"),
    [
        ("2,5", [("2", "gpu2"), ("5", "gpu5")]),
        (" 3 ", [("3", "gpu3")]),
        ("GPU-aaaa,MIG-bbbb", [("GPU-aaaa", "gpu0"), ("MIG-bbbb", "gpu1")]),
    ],
)
def test_cuda_visible_devices_selects_the_gpus(
    bin_dir: Path, visible: str, expected: list[tuple[str, str]]
) -> None:
    env = script_env([bin_dir], CUDA_VISIBLE_DEVICES=visible, EGGROLL_WORKER_BIN="w")
    done = run_script("h", "--dry-run", env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"CUDA_VISIBLE_DEVICES={gpu} EGGROLL_WORKERS_PER_HOST={len(expected)} w "
        f"--name {SHORT_HOST}-{label} h"
        for gpu, label in expected
    ]


@pytest.mark.parametrize("case", ["smi fails", "smi lists none", "no smi", "empty visible"])
def test_no_gpu_is_one_clear_line(tmp_path: Path, wrapper: Path, case: str) -> None:
    smi = tmp_path / "smi"
    smi.mkdir()
    extra = {"EGGROLL_WORKER_BIN": str(wrapper)}
    if case == "smi fails":
        fails = '#!/bin/sh\necho "NVIDIA-SMI has failed: couldn\'t reach the driver"\nexit 9\n'
        write_executable(smi / "nvidia-smi", fails)
    elif case == "smi lists none":
        write_executable(smi / "nvidia-smi", "#!/bin/sh\nexit 0\n")
    elif case == "empty visible":
        write_executable(smi / "nvidia-smi", THREE_GPUS)  # CUDA_VISIBLE_DEVICES wins
        extra["CUDA_VISIBLE_DEVICES"] = ""
    done = run_script("10.0.0.5", "--backend", "numpy", env=script_env([smi], **extra))
    assert done.returncode == 1
    assert done.stdout == ""
    [line] = done.stderr.splitlines()
    assert "no GPU found" in line and "--backend numpy" in line
    assert not (tmp_path / "calls").exists()


def test_worker_that_cannot_start_stops_the_others(
    words_data: Path, tmp_path: Path, bin_dir: Path, wrapper: Path
) -> None:
    port = free_port()  # nobody listens on it: the good workers keep retrying
    flags = ["--backend", "numpy", "--data-dir", words_data, "--log-format", "json"]
    env = script_env([bin_dir], EGGROLL_WORKER_BIN=str(wrapper), FAIL_GPU="1")
    script = Script([f"127.0.0.1:{port}", *flags, "--max-retry-s", "1"], env)
    try:
        status = script.finish(30)
    finally:
        script.stop()
    assert status != 0, script.output()
    failed = [line for line in script.lines if "failed with status" in line]
    assert len(failed) == 1 and "GPU 1" in failed[0], script.output()
    assert any(line.startswith("[gpu1] Error:") for line in script.lines), script.output()
    pids = recorded_pids(tmp_path)
    assert len(pids) == 3 and not [pid for pid in pids if alive(pid)]


def test_a_worker_that_computes_differently_leaves_the_others_running(
    words_data: Path, tmp_path: Path, bin_dir: Path, wrapper: Path
) -> None:
    """Exit status 3 is one worker's fault (a faulty GPU?): the others keep running."""
    port = free_port()  # nobody listens on it: the good workers keep retrying
    flags = ["--backend", "numpy", "--data-dir", words_data, "--log-format", "json"]
    env = script_env([bin_dir], EGGROLL_WORKER_BIN=str(wrapper), FAULTY_GPU="1")
    script = Script([f"127.0.0.1:{port}", *flags, "--max-retry-s", "1"], env)
    try:
        script.wait_line(lambda line: "computes differently" in line, 30, "the faulty GPU")
        time.sleep(1.0)  # time enough to have stopped the others, were that the reaction
        pids = recorded_pids(tmp_path)
        assert len(pids) == 3 and len([pid for pid in pids if alive(pid)]) == 2, script.output()
        assert not [line for line in script.lines if "stopping the other workers" in line]
        script.proc.send_signal(signal.SIGTERM)
        assert script.finish(30) == 3, script.output()
    finally:
        script.stop()


def test_worker_ignoring_sigterm_is_killed_after_the_stop_timeout(
    tmp_path: Path, bin_dir: Path
) -> None:
    stubborn = tmp_path / "stubborn-worker"
    pids = tmp_path / "pids"
    write_executable(
        stubborn, f"#!/usr/bin/env bash\necho $$ >> {pids}\ntrap '' TERM\necho up\nexec sleep 60\n"
    )
    env = script_env(
        [bin_dir],
        CUDA_VISIBLE_DEVICES="0,1",
        EGGROLL_WORKER_BIN=str(stubborn),
        EGGROLL_STOP_TIMEOUT_S="1",
    )
    script = Script(["127.0.0.1:1"], env)
    try:
        for gpu in "01":
            script.wait_line(lambda line, gpu=gpu: line == f"[gpu{gpu}] up", 10, f"gpu{gpu} up")
        script.proc.send_signal(signal.SIGTERM)
        assert script.finish(10) == 128 + signal.SIGKILL, script.output()
    finally:
        script.stop()
    killed = [line for line in script.lines if "after SIGTERM: killing it" in line]
    assert len(killed) == 2 and "GPU 0" in killed[0] and "GPU 1" in killed[1]
    assert not [pid for pid in recorded_pids(tmp_path) if alive(pid)]


# GPU 0's worker ends with the status the test gives (negative: killed by that signal);
# GPU 1's runs until the SIGTERM of a stop (which counts as a clean stop).
ENDING = """#!/usr/bin/env bash
if [[ $CUDA_VISIBLE_DEVICES == 1 ]]; then
    echo up
    exec sleep 600
fi
if (({status} < 0)); then
    kill -s $((-{status})) $$
fi
exit {status}
"""


@pytest.mark.parametrize("status", [0, 1, 2, 3, -signal.SIGKILL, -signal.SIGTERM])
def test_each_exit_status_is_acted_on_as_exit_policy_says(
    tmp_path: Path, bin_dir: Path, status: int
) -> None:
    """The script follows the table of eggroll-local and eggroll-ray: whether the others
    go on, and its own exit status."""
    verdict = exit_policy(status)
    ending = tmp_path / "ending-worker"
    write_executable(ending, ENDING.format(status=status))
    env = script_env([bin_dir], CUDA_VISIBLE_DEVICES="0,1", EGGROLL_WORKER_BIN=str(ending))
    script = Script(["127.0.0.1:1"], env)
    try:
        line = script.wait_line(lambda line: "worker for GPU 0" in line, 30, "GPU 0's end")
        if verdict.stop_all:
            assert line.endswith("; stopping the other workers"), script.output()
        else:
            assert line.endswith("; the other workers keep running"), script.output()
            script.wait_line(lambda line: line == "[gpu1] up", 30, "gpu1 up")
            script.proc.send_signal(signal.SIGTERM)
        assert script.finish(30) == verdict.code, script.output()
    finally:
        script.stop()
