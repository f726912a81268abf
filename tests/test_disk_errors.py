"""A full disk or a failing write: the commands stop in one line and leave nothing that looks
complete, a retry with room succeeds, and logging drops lines (saying so once) instead of
stopping, stalling or looping the process; logged exceptions say why in every log mode.

The full disks are real: small tmpfs mounts (root only, as in CI; skipped elsewhere). The
faults that a mount cannot place (an append of the fitness log, EIO, a torn line) are
injected in-process.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from helpers import TRAIN_RUN, command, digest_at

from eggroll_dist.shared import logs
from eggroll_dist.shared.data import (
    META_FILE,
    DataError,
    byte_pieces,
    load_data_dir,
    write_decoding,
)
from eggroll_dist.shared.fitness_log import FitnessLog
from eggroll_dist.worker import train as train_module
from eggroll_dist.worker.data.build import prepare_data_dir
from eggroll_dist.worker.local import _copy_output

STEPS = 6
CONFIG = TRAIN_RUN
ENOSPC_TEXT = "[Errno 28] No space left on device"


# --- real full file systems ------------------------------------------------------------------


@pytest.fixture
def mount(tmp_path: Path) -> Iterator[Callable[[Path, int], Path]]:
    """mount(DIR, KiB): a tmpfs of that size at DIR (made if needed), unmounted at the end;
    called again for DIR, it resizes that tmpfs. Skips where mounting is not allowed."""
    mounted: list[Path] = []

    def umount(path: Path) -> None:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)
        mounted.remove(path)

    def do_mount(path: Path, kib: int) -> Path:
        if os.geteuid() != 0:
            pytest.skip("mounting a small tmpfs needs root (CI runs the tests as root)")
        # Mounted already: resized in place, its files kept (room made on the same disk).
        options = f"remount,size={kib}k" if path in mounted else f"size={kib}k"
        path.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        if path not in mounted:
            mounted.append(path)
        return path

    yield do_mount
    for path in list(mounted):
        umount(path)


def _run(*args: str | Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [command(args[0]), *map(str, args[1:])],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("Error:")]


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(CONFIG)
    return path


def _train(data: Path, config: Path, save_dir: Path) -> subprocess.CompletedProcess:
    return _run(
        "eggroll-train",
        *("--data-dir", data, "--config", config, "--save-dir", save_dir),
        *("--log-format", "json", "--sample-every", "0"),
    )


def test_train_on_a_full_disk_stops_in_one_line_and_the_retry_reaches_the_digest(
    words_data: Path, config: Path, tmp_path: Path, mount: Callable[[Path, int], Path]
) -> None:
    reference = _train(words_data, config, tmp_path / "undisturbed")
    assert reference.returncode == 0, reference.stderr
    digest = digest_at(tmp_path / "undisturbed", STEPS)

    # 16 KiB: run.json and fitness.log fit (a page each), the 12 KiB snapshot does not.
    disk = mount(tmp_path / "disk", 16)
    save_dir = disk / "run"
    done = _train(words_data, config, save_dir)
    assert done.returncode == 1
    snapshot = save_dir / "snapshots" / f"step-{STEPS:08d}.ckpt"
    kept = f"{STEPS} steps are kept in {save_dir}: the same command continues them once there is"
    kept += " room"
    assert _errors(done.stderr) == [f"Error: cannot write {snapshot}: {ENOSPC_TEXT}; {kept}"]
    assert done.stderr.rstrip().endswith(kept)  # the last words, no traceback after
    assert "Traceback" not in done.stderr
    assert list((save_dir / "snapshots").iterdir()) == []  # no half-written snapshot
    assert FitnessLog.open(save_dir / "fitness.log", repair=False).steps == STEPS

    # Room made: the same command on the same directory runs and reaches the same digest.
    mount(disk, 256)
    again = _train(words_data, config, save_dir)
    assert again.returncode == 0, again.stderr
    assert digest_at(save_dir, STEPS) == digest
    assert json.loads((save_dir / "summary.json").read_text())["replica_digest"] == (
        f"{digest:016x}"
    )


def test_prepare_on_a_full_disk_leaves_no_directory_that_looks_complete(
    tmp_path: Path, mount: Callable[[Path, int], Path]
) -> None:
    disk = mount(tmp_path / "disk", 64)
    out = disk / "data"
    # A complete small data directory first: the failed prepare must not leave its
    # meta.json vouching for files of another build.
    prepare_data_dir([b"alpha beta gamma " * 40, b"delta epsilon " * 40], out, "test:small")
    load_data_dir(out)

    done = _run("eggroll-data", "prepare", "--builtin", "--out", out)
    assert done.returncode == 1
    assert _errors(done.stderr) == [f"Error: cannot write {out / 'input.bin'}: {ENOSPC_TEXT}"]
    assert "Traceback" not in done.stderr
    assert not (out / META_FILE).exists()
    assert sorted(p.name for p in out.iterdir()) == []  # nothing half-written, space freed
    with pytest.raises(DataError):
        load_data_dir(out)

    mount(disk, 8192)  # room made: the built-in corpus takes about 2.5 MB
    again = _run("eggroll-data", "prepare", "--builtin", "--out", out)
    assert again.returncode == 0, again.stderr
    assert load_data_dir(out).meta.source.startswith("builtin:")


def test_sample_to_a_full_stdout_fails_in_one_line(words_data: Path, config: Path) -> None:
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")
    save_dir = Path(config).parent / "run"
    assert _train(words_data, config, save_dir).returncode == 0
    for extra in ([], ["--json", "--count", "20"]):
        with open("/dev/full", "w") as full:
            done = subprocess.run(
                [command("eggroll-sample"), str(save_dir), "--data-dir", str(words_data), *extra],
                stdout=full,
                stderr=subprocess.PIPE,
                text=True,
                timeout=120,
            )
        assert done.returncode == 1
        assert _errors(done.stderr) == [f"Error: cannot write stdout: {ENOSPC_TEXT}"]
        assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr


# --- injected faults: eggroll-train's fitness log ------------------------------------------


def test_train_with_a_failing_fitness_log_append_keeps_its_steps_and_continues(
    words_data: Path, config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_dir = tmp_path / "run"
    append = FitnessLog.append

    def failing(self: FitnessLog, step: int, packed: bytes) -> None:
        if step == 3:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        append(self, step, packed)

    monkeypatch.setattr(FitnessLog, "append", failing)
    args = ["--data-dir", str(words_data), "--config", str(config), "--save-dir", str(save_dir)]
    result = CliRunner().invoke(train_module.main, [*args, "--log-format", "json"])
    assert result.exit_code == 1
    line = (
        f"Error: cannot write {save_dir / 'fitness.log'}: [Errno 5] Input/output error; "
        f"3 steps are kept in {save_dir}: the same command continues them once there is room"
    )
    assert line in result.output.splitlines()
    assert FitnessLog.open(save_dir / "fitness.log", repair=False).steps == 3

    monkeypatch.setattr(FitnessLog, "append", append)
    result = CliRunner().invoke(train_module.main, [*args, "--log-format", "json"])
    assert result.exit_code == 0, result.output
    reference = tmp_path / "reference"
    assert _train(words_data, config, reference).returncode == 0
    assert digest_at(save_dir, STEPS) == digest_at(reference, STEPS)


# --- logging on a failing disk ----------------------------------------------------------------


@pytest.fixture
def fresh_sinks(monkeypatch: pytest.MonkeyPatch) -> None:
    """stdout and stderr sinks with no failure behind them (they are per process)."""
    monkeypatch.setattr(logs, "STDERR", logs.LineSink("stderr", logs.STDERR._write, False, None))
    monkeypatch.setattr(logs, "STDOUT", logs.LineSink("stdout", logs.STDOUT._write, False))


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_log_file_drops_lines_on_enospc_says_so_once_and_resumes(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    fresh_sinks: None,
) -> None:
    clock = _Clock()
    monkeypatch.setattr(logs.time, "monotonic", clock)
    real_write = os.write
    calls = {"n": 0, "failing": False, "short": False}

    def write(fd: int, data: bytes) -> int:
        calls["n"] += 1
        if calls["short"]:  # half a line reaches the disk, then it is full
            calls["short"], calls["failing"] = False, True
            return real_write(fd, data[: len(data) // 2])
        if calls["failing"]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(logs.os, "write", write)
    path = tmp_path / "coordinator.log"
    log = logs.LogFile(path)
    assert log.write(json.dumps({"event": "step", "step": 1}))
    calls["short"] = True
    assert not log.write(json.dumps({"event": "step", "step": 2}))  # torn, then ENOSPC
    tried = calls["n"]
    for step in range(3, 1003):  # within RETRY_S: dropped without a single write call
        assert not log.write(json.dumps({"event": "step", "step": step}))
    assert calls["n"] == tried
    warning = capsys.readouterr().err.splitlines()
    assert warning == [
        f"warning: logging degraded: cannot write {path}: {ENOSPC_TEXT}; its lines are "
        "dropped until it can be written again"
    ]
    clock.now += logs.RETRY_S  # one try, still full: one call, no second warning
    assert not log.write(json.dumps({"event": "step", "step": 1003}))
    assert calls["n"] == tried + 1 and capsys.readouterr().err == ""

    calls["failing"] = False  # room made
    clock.now += logs.RETRY_S
    assert log.write(json.dumps({"event": "step", "step": 1004}))
    log.close()
    lines = path.read_text().splitlines()
    second = json.dumps({"event": "step", "step": 2})
    assert len(lines) == 4 and second.startswith(lines[1]) and lines[1] != second  # torn
    events = [json.loads(line) for line in (lines[0], *lines[2:])]  # the torn line is ended
    assert events[0] == {"event": "step", "step": 1}
    # The note of what was lost (the torn line among them), then logging goes on.
    assert events[-2]["event"] == "log lines lost" and events[-2]["lines"] == 1002
    assert events[-2]["error"] == ENOSPC_TEXT
    assert events[-1] == {"event": "step", "step": 1004}


def test_worker_output_on_a_full_disk_is_drained_and_said_once(
    tmp_path: Path, mount: Callable[[Path, int], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    disk = mount(tmp_path / "disk", 4)
    (disk / "fill").write_bytes(b"x" * 4096)
    # Far more than a pipe holds: a copier that stopped reading would leave it blocked.
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys\nfor i in range(40000): print('line', i)"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    thread = _copy_output(proc, disk / "worker-0.log", "local-0")
    assert proc.wait(60) == 0
    thread.join(30)
    assert not thread.is_alive()
    err = capsys.readouterr().err
    assert err.count("logging degraded") == 1 and ENOSPC_TEXT in err


def _eio(*args: object) -> None:
    raise OSError(errno.EIO, os.strerror(errno.EIO))


class _FailingStream:
    def __init__(self) -> None:
        self.fail = True
        self.text = ""

    def write(self, text: str) -> int:
        if self.fail:
            _eio()
        self.text += text
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


@pytest.mark.parametrize("log_format", ["json", "text"])
def test_console_on_eio_never_raises_and_counts_what_it_lost(
    log_format: str, monkeypatch: pytest.MonkeyPatch, fresh_sinks: None
) -> None:
    import structlog

    clock = _Clock()
    monkeypatch.setattr(logs.time, "monotonic", clock)
    stream = _FailingStream()
    monkeypatch.setattr(sys, "stderr", stream)
    logs.configure_logging(log_format)
    try:
        log = structlog.get_logger()
        for step in range(5):
            log.info("step", step=step)  # EIO: dropped, never raised
        logs.echo("progress", err=True)
        stream.fail = False
        clock.now += logs.RETRY_S
        log.info("step", step=5)
    finally:
        structlog.reset_defaults()
    lines = stream.text.splitlines()
    assert len(lines) == 2 and "step" in lines[1]
    if log_format == "json":
        assert json.loads(lines[0])["event"] == "log lines lost"
        assert json.loads(lines[0])["lines"] == 6
    else:
        assert lines[0] == "[6 log lines lost: cannot write stderr: [Errno 5] Input/output error]"


# --- exceptions in the log ---------------------------------------------------------------------

LOG_EXCEPTION = (
    "import errno, os, sys, structlog\n"
    "from eggroll_dist.shared.logs import configure_logging\n"
    "configure_logging(sys.argv[1])\n"
    "try:\n"
    "    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))\n"
    "except OSError:\n"
    "    structlog.get_logger().exception('session failed', worker='w1')\n"
)


def _log_exception(log_format: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", LOG_EXCEPTION, log_format],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "NO_COLOR": "1"},
    )
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_json_lines_carry_the_exception() -> None:
    (line,) = _log_exception("json").splitlines()
    event = json.loads(line)
    assert event["event"] == "session failed" and event["level"] == "error"
    assert "exc_info" not in event
    exc = event["exception"]
    assert exc["type"] == "OSError" and exc["message"] == ENOSPC_TEXT
    assert exc["traceback"].startswith("Traceback (most recent call last):")
    assert exc["traceback"].rstrip().endswith(f"OSError: {ENOSPC_TEXT}")


def test_text_lines_print_the_exception() -> None:
    text = _log_exception("text")
    assert "session failed" in text and "worker=w1" in text
    assert "Traceback (most recent call last):" in text
    assert f"OSError: {ENOSPC_TEXT}" in text


def test_exception_fields_name_our_own_classes_fully() -> None:
    from eggroll_dist.shared.data import DataError as Error

    event = logs.exception_fields(None, "error", {"event": "x", "exc_info": Error("bad")})
    assert event["exception"]["type"] == "eggroll_dist.shared.data.DataError"
    assert event["exception"]["message"] == "bad"
    # exc_info=True outside an except block: nothing to add, and no stray key left.
    assert logs.exception_fields(None, "error", {"event": "x", "exc_info": True}) == {"event": "x"}


def test_copier_thread_is_a_daemon() -> None:
    """eggroll-local must be able to exit while a worker's output is still being copied."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"], stdout=subprocess.PIPE, text=True)
    thread = _copy_output(proc, Path(os.devnull), "local-0")
    assert isinstance(thread, threading.Thread) and thread.daemon
    proc.wait(30)
    thread.join(10)


def test_import_in_place_on_a_full_disk_keeps_the_source_and_can_run_again(
    tmp_path: Path, mount: Callable[[Path, int], Path]
) -> None:
    disk = mount(tmp_path / "disk", 64)
    src = disk / "deggs"
    src.mkdir()
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 256, 40_000, dtype=np.uint8)
    ids[::500] = 0  # document starts
    (src / "input.bin").write_bytes(ids.tobytes())
    write_decoding(src / "decoding.bin", byte_pieces())
    # 40 KB of input leave no room for its 38 KB train part beside it.
    done = _run("eggroll-data", "import", src)
    assert done.returncode == 1
    assert _errors(done.stderr) == [f"Error: cannot write {src / 'input.bin'}: {ENOSPC_TEXT}"]
    assert (src / "input.bin").read_bytes() == ids.tobytes()  # the source, untouched
    assert sorted(p.name for p in src.iterdir()) == ["decoding.bin", "input.bin"]

    mount(disk, 256)
    again = _run("eggroll-data", "import", src)
    assert again.returncode == 0, again.stderr
    data = load_data_dir(src)
    assert len(data.train) + len(data.valid) == len(ids)


def test_local_run_with_its_logs_on_a_full_disk_says_so_once_per_file_and_finishes(
    words_data: Path, config: Path, tmp_path: Path, mount: Callable[[Path, int], Path]
) -> None:
    save_dir = tmp_path / "local"
    logs_dir = mount(save_dir / "logs", 4)
    (logs_dir / "fill").write_bytes(b"x" * 4096)
    done = _run(
        "eggroll-local",
        *("--config", config, "--data-dir", words_data, "--save-dir", save_dir),
        *("--steps", "3", "--workers", "2", "--metrics-port", "0", "--sample-every", "0"),
    )
    assert done.returncode == 0, done.stderr
    warnings = [line for line in done.stderr.splitlines() if "logging degraded" in line]
    names = sorted(line.split("cannot write ")[1].split(":")[0] for line in warnings)
    expected = ["coordinator.log", "worker-0.log", "worker-1.log"]
    assert names == [str(save_dir / "logs" / name) for name in expected]
    assert all(ENOSPC_TEXT in line for line in warnings)
    assert "done: 3 steps" in done.stdout


def test_a_failure_before_the_first_step_leaves_nothing(
    words_data: Path, config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_dir = tmp_path / "run"

    def failing(*args: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(FitnessLog, "create", failing)
    args = ["--data-dir", str(words_data), "--config", str(config), "--save-dir", str(save_dir)]
    result = CliRunner().invoke(train_module.main, args)
    assert result.exit_code == 1
    assert not save_dir.exists()  # nothing that a later run would take for a run


def test_train_continues_a_run_in_its_save_directory(
    words_data: Path, config: Path, tmp_path: Path
) -> None:
    save_dir = tmp_path / "run"
    first = _run(
        "eggroll-train",
        *("--data-dir", words_data, "--config", config, "--save-dir", save_dir),
        *("--steps", "2", "--sample-every", "0"),
    )
    assert first.returncode == 0, first.stderr
    again = _train(words_data, config, save_dir)  # the config's STEPS in all
    assert again.returncode == 0, again.stderr
    assert '"event": "resuming"' in again.stderr and '"step": 2' in again.stderr
    reference = tmp_path / "reference"
    assert _train(words_data, config, reference).returncode == 0
    assert digest_at(save_dir, STEPS) == digest_at(reference, STEPS)
    summary = json.loads((save_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS
    assert summary["replica_digest"] == f"{digest_at(reference, STEPS):016x}"

    other = _run(
        "eggroll-train",
        *("--data-dir", words_data, "--preset", "tiny", "--save-dir", save_dir),
    )
    assert other.returncode != 0
    (line,) = _errors(other.stderr)
    assert f"--save-dir {save_dir} holds a run with config digest" in line
