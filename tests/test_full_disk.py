"""A full (or failing) disk under the save directory: the policy table of shared/save_dir.py.

The fitness log is the run: an append that fails stops the coordinator at once. Everything
else degrades: a snapshot that cannot be stored is dropped with one warning (path, error,
free space), the run and the uploading worker's session go on, and the next snapshot step
tries again; digests.log keeps its digests in memory, and history.log drops a record. In
memory first (faults injected into the store), then real processes on a small tmpfs (root
only: CI runs as root).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from helpers import (
    TINY_RUN,
    Network,
    free_port,
    inspect_run,
    start_worker,
    trained_digest,
)

from eggroll_dist.coordinator import store as store_module
from eggroll_dist.coordinator.events import FileDegraded, SnapshotDropped, SnapshotStored
from eggroll_dist.coordinator.run import Fatal
from eggroll_dist.coordinator.store import RunStore
from eggroll_dist.protocol import Hello, SnapshotRequest
from eggroll_dist.shared import run_writer as run_writer_module
from eggroll_dist.shared.atomic_file import write_atomic
from eggroll_dist.shared.config import RunConfig, load_config
from eggroll_dist.shared.data import Dataset, load_data_dir
from eggroll_dist.shared.fitness_log import HEADER_SIZE, RECORD_HEAD, packed_size
from eggroll_dist.shared.save_dir import read_digests, read_history

PAGE = 4096  # tmpfs gives out whole pages


@pytest.fixture
def tiny_config(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(TINY_RUN)
    return path


@pytest.fixture
def dataset(words_data: Path) -> Dataset:
    return load_data_dir(words_data)


def open_store(path: Path, config: Path) -> RunStore:
    return RunStore.open(path, load_config(config))


def failing_snapshot_writes(monkeypatch: pytest.MonkeyPatch, code: int) -> Callable[[bool], None]:
    """Make the store's snapshot writes fail with `code` after writing half the file (the
    store must remove it); returns a switch that turns the fault on or off."""
    state = {"on": True}

    def write(path: str | Path, data: bytes | memoryview) -> None:
        path = Path(path)
        if not state["on"] or path.parent.name != "snapshots":
            write_atomic(path, data)
            return
        path.write_bytes(bytes(data[: len(data) // 2]))  # what a torn write could leave
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(run_writer_module, "write_atomic", write)  # the store writes through it
    return lambda on: state.update(on=on)


def undisturbed(tmp_path: Path, config: Path, dataset: Dataset, steps: int) -> int:
    """The replica digest of the same run in memory with nothing failing."""
    store = open_store(tmp_path / "undisturbed", config)
    try:
        net = Network(store, dataset, snapshot_every=2)
        w = net.join("w")
        net.train(steps)
        return w.replica.digest
    finally:
        store.close()


# --- in memory: faults injected into the store -----------------------------------------------


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_a_snapshot_that_cannot_be_stored_is_dropped_and_the_run_goes_on(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    tiny_config: Path,
    dataset: Dataset,
    code: int,
) -> None:
    want = undisturbed(tmp_path, tiny_config, dataset, 7)
    fault = failing_snapshot_writes(monkeypatch, code)
    store = open_store(tmp_path / "run", tiny_config)
    try:
        with structlog.testing.capture_logs() as logs:
            net = Network(store, dataset, snapshot_every=2)
            a, b = net.join("a"), net.join("b")
            net.train(7)
        assert store.steps == 7 and a.replica.digest == b.replica.digest == want
        # One failure per snapshot step, each one warning that says where, why, how much room.
        drops = [e for e in net.events if isinstance(e, SnapshotDropped)]
        assert [d.step for d in drops] == [2, 4, 6]
        for d in drops:
            assert d.path == str(store.snapshot_path(d.step))
            assert d.error == os.strerror(code)
            assert isinstance(d.free_bytes, int) and d.free_bytes >= 0
        warnings = [e for e in logs if e["log_level"] == "warning"]
        assert [e["event"] for e in warnings] == ["snapshot dropped"] * 3
        assert all({"path", "error", "free_bytes"} <= e.keys() for e in warnings)
        # No loop: each snapshot step asked one worker once; nobody was refused or rejoined.
        asked = [m.step for w in (a, b) for m in w.got if isinstance(m, SnapshotRequest)]
        assert sorted(asked) == [2, 4, 6]
        assert net.refused == [] and a.alive and b.alive
        assert [sum(isinstance(m, Hello) for m in w.sent) for w in (a, b)] == [1, 1]
        assert list(store.layout.snapshots.iterdir()) == []  # nothing half-written left
        assert store.latest_snapshot is None
        # The disk has room again: the next snapshot step stores one.
        fault(False)
        net.train(1)
        assert store.latest_snapshot == 8 and store.snapshot_path(8).is_file()
        assert any(isinstance(e, SnapshotStored) and e.step == 8 for e in net.events)
    finally:
        store.close()


def test_the_run_ends_at_max_steps_when_its_final_snapshot_is_dropped(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_config: Path, dataset: Dataset
) -> None:
    failing_snapshot_writes(monkeypatch, errno.ENOSPC)
    store = open_store(tmp_path / "run", tiny_config)
    try:
        net = Network(store, dataset, snapshot_every=0, max_steps=3)
        w = net.join("w")
        net.train(3)
        assert net.core.finished and net.core.done  # no wait for a snapshot that cannot come
        assert [e.step for e in net.events if isinstance(e, SnapshotDropped)] == [3]
        assert net.core.want_snapshot() == []  # shutdown does not ask for it again
        assert w.alive and net.refused == []
    finally:
        store.close()


def test_a_session_failing_on_the_coordinators_side_is_not_asked_again(
    tmp_path: Path, tiny_config: Path, dataset: Dataset
) -> None:
    store = open_store(tmp_path / "run", tiny_config)
    try:
        net = Network(store, dataset, snapshot_every=0)
        w = net.join("w")
        core = net.core
        net.train(2)
        core.snapshot.step = 2
        assert core._ask_snapshot(core.peers[w.peer])  # the request, never delivered
        assert core.snapshot.asked == (w.peer, 2)
        # The server's session for it fails on this side (a bug, a file): it reconnects.
        core.failed_here(w.peer)
        net.carry_out(core.peer_left(w.peer))
        again = net.join("w-again")
        net.run()
        assert not any(isinstance(m, SnapshotRequest) for m in again.got)
        assert core.snapshot.step is None and core.snapshot.asked is None
    finally:
        store.close()


def test_digests_log_writes_that_fail_degrade_to_memory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_config: Path, dataset: Dataset
) -> None:
    want = undisturbed(tmp_path, tiny_config, dataset, 6)
    store = open_store(tmp_path / "run", tiny_config)
    real_write = os.write
    failing = {"on": False}

    def write(fd: int, data: bytes) -> int:
        if failing["on"] and fd == store._digests_fd:
            return real_write(fd, data[:5])  # a short write: the disk filled mid-line
        return real_write(fd, data)

    monkeypatch.setattr(store_module.os, "write", write)
    try:
        net = Network(store, dataset, snapshot_every=0)
        a, b = net.join("a"), net.join("b")
        net.train(2)
        failing["on"] = True
        with structlog.testing.capture_logs() as logs:
            net.train(2)
        failing["on"] = False
        net.train(2)
        assert store.steps == 6 and a.replica.digest == b.replica.digest == want
        degraded = [e for e in net.events if isinstance(e, FileDegraded)]
        assert len(degraded) == 1 and degraded[0].path == str(store.layout.digests_log)
        assert degraded[0].error == os.strerror(errno.ENOSPC)
        assert [e["event"] for e in logs if e["log_level"] == "warning"] == [
            "save directory write failed"
        ]
        # The torn lines were cut back: the file reads whole, and later lines were written.
        on_disk, _ = read_digests(store.layout.digests_log)
        assert on_disk.items() <= store.digests.items() and max(on_disk) == 6
        assert set(store.digests) - set(on_disk)  # agreed meanwhile: kept in memory only
    finally:
        store.close()


def test_history_log_writes_that_fail_drop_records_and_the_run_goes_on(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_config: Path, dataset: Dataset
) -> None:
    want = undisturbed(tmp_path, tiny_config, dataset, 6)
    store = open_store(tmp_path / "run", tiny_config)
    real_write = os.write
    failing = {"on": False}

    def write(fd: int, data: bytes) -> int:
        if failing["on"] and fd == store.history._fd:
            return real_write(fd, data[:5])  # a short write: the disk filled mid-line
        return real_write(fd, data)

    monkeypatch.setattr(store_module.os, "write", write)
    try:
        net = Network(store, dataset, snapshot_every=0)
        a, b = net.join("a"), net.join("b")
        net.train(2)
        failing["on"] = True
        with structlog.testing.capture_logs() as logs:
            net.train(2)
        failing["on"] = False
        net.train(2)
        assert store.steps == 6 and a.replica.digest == b.replica.digest == want
        degraded = [e for e in net.events if isinstance(e, FileDegraded)]
        assert len(degraded) == 1 and degraded[0].path == str(store.layout.history)
        assert degraded[0].error == os.strerror(errno.ENOSPC)
        warnings = [e for e in logs if e["log_level"] == "warning"]
        assert [e["event"] for e in warnings] == ["save directory write failed"]
        assert "curve" in warnings[0]["hint"] and warnings[0]["path"] == degraded[0].path
        # The torn lines were cut back: every line reads, the records of steps 3 and 4 are
        # lost, and the next ones were written.
        lines = store.layout.history.read_text().splitlines()
        records = read_history(store.layout.history)
        assert len(lines) == len(records)
        assert [r["step"] for r in records if r["event"] == "step"] == [1, 2, 5, 6]
    finally:
        store.close()


def test_a_fitness_log_append_that_fails_stops_the_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_config: Path, dataset: Dataset
) -> None:
    store = open_store(tmp_path / "run", tiny_config)
    try:
        net = Network(store, dataset)
        net.join("w")
        net.train(1)

        def full(step: int, packed: bytes) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(store.fitness_log, "append", full)
        with pytest.raises(Fatal) as fatal:
            net.train(1)
        message = str(fatal.value)
        assert "\n" not in message
        assert str(store.layout.fitness_log) in message and "No space left" in message
    finally:
        store.close()


# --- real processes, the save directory on a small tmpfs ---------------------------------------


class Tmpfs:
    def __init__(self, path: Path) -> None:
        self.path = path

    def mount(self, size: int) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(self.path)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs: {done.stderr.strip()}")

    def resize(self, size: int) -> None:
        subprocess.run(
            ["mount", "-o", f"remount,size={size}", str(self.path)], check=True, timeout=30
        )

    def used(self) -> int:
        st = os.statvfs(self.path)
        return (st.f_blocks - st.f_bfree) * st.f_frsize


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Tmpfs]:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    fs = Tmpfs(tmp_path / "disk")
    yield fs
    if os.path.ismount(fs.path):
        subprocess.run(["umount", "-l", str(fs.path)], check=False, timeout=30)


def coordinator(
    spawn: Callable[..., Any], save_dir: Path, config: Path, log_format: str, *extra: str
) -> tuple[Any, int]:
    """eggroll-coordinator on loopback in either log format; it and its port, once up."""
    port = free_port()
    coord = spawn(
        "eggroll-coordinator",
        *("--save-dir", save_dir, "--config", config, "--host", "127.0.0.1"),
        *("--port", str(port), "--metrics-port", "0", "--log-format", log_format),
        *extra,
    )
    wait_line(coord, re.compile(r"listening"), 30)
    return coord, port


def wait_line(proc: Any, pattern: re.Pattern[str], timeout: float) -> str:
    """The first output line of `proc` that `pattern` finds, waiting up to `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        for line in list(proc.lines):
            if pattern.search(line):
                return line
        if time.monotonic() > deadline or (proc.proc.poll() is not None and not proc.lines):
            raise AssertionError(f"{proc.name}: no {pattern.pattern!r}:\n" + "\n".join(proc.lines))
        time.sleep(0.02)


def lines_with(proc: Any, *words: str) -> list[str]:
    return [line for line in proc.lines if all(w in line for w in words)]


@pytest.mark.parametrize("log_format", ["json", "text"])
def test_snapshots_fail_on_a_full_tmpfs_and_the_run_completes(
    spawn: Callable[..., Any],
    tmpfs: Tmpfs,
    words_data: Path,
    tiny_config: Path,
    log_format: str,
) -> None:
    steps, every = 12, 4
    # run.json, fitness.log and digests.log take a page each; one page is left, and a
    # snapshot (about 12 KiB) needs three.
    tmpfs.mount(4 * PAGE)
    save_dir = tmpfs.path / "run"
    coord, port = coordinator(
        spawn,
        save_dir,
        tiny_config,
        log_format,
        *("--max-steps", str(steps), "--snapshot-every", str(every)),
    )
    start_worker(spawn, port, words_data, "w")
    assert coord.wait(120) == 0
    dropped = lines_with(coord, "snapshot dropped")
    assert len(dropped) == steps // every  # once per snapshot step: no loop
    for line in dropped:
        assert "snapshots/step-" in line and "No space left on device" in line
        assert "free_bytes" in line
    assert lines_with(coord, "session failed") == []
    assert len(lines_with(coord, "worker joined")) == 1  # the worker never had to rejoin
    assert list((save_dir / "snapshots").iterdir()) == []  # nothing half-written
    info = inspect_run(save_dir)
    assert info["step"] == steps and info["log_ok"]
    assert int(info["replica_digest"], 16) == trained_digest(words_data, tiny_config, steps)


def fitness_log_near_a_page_end(
    save_dir: Path, config: Path, dataset: Dataset, room_for: int
) -> int:
    """A save directory whose fitness log has room in its last page for `room_for` more
    records, trained in memory; returns its steps."""
    cfg: RunConfig = load_config(config)
    record = RECORD_HEAD.size + packed_size(cfg.pairs) + 4
    steps = (PAGE - HEADER_SIZE) // record - room_for
    store = RunStore.open(save_dir, cfg)
    try:
        net = Network(store, dataset, snapshot_every=0)
        net.join("w")
        net.train(steps)
    finally:
        store.close()
    return steps


@pytest.mark.parametrize("log_format", ["json", "text"])
def test_a_full_fitness_log_stops_the_coordinator_and_a_restart_resumes(
    spawn: Callable[..., Any],
    tmpfs: Tmpfs,
    tmp_path: Path,
    words_data: Path,
    tiny_config: Path,
    dataset: Dataset,
    log_format: str,
) -> None:
    before = fitness_log_near_a_page_end(tmp_path / "seed", tiny_config, dataset, room_for=2)
    steps = before + 5
    tmpfs.mount(64 * PAGE)
    save_dir = tmpfs.path / "run"
    shutil.copytree(tmp_path / "seed", save_dir)
    tmpfs.resize(tmpfs.used())  # not one page free: the fitness log's next page is refused
    flags = ("--max-steps", str(steps), "--snapshot-every", "0")
    coord, port = coordinator(spawn, save_dir, tiny_config, log_format, *flags)
    worker = start_worker(spawn, port, words_data, "w")
    line = wait_line(coord, re.compile("commit failed"), 120)
    seen = time.monotonic()
    assert coord.wait(5) != 0
    # at once: not after the 5 s drain or the 10 s wait for a final snapshot
    assert time.monotonic() - seen < 3.0
    assert str(save_dir / "fitness.log") in line and "No space left on device" in line
    assert lines_with(coord, "session failed") == []
    worker.stop()
    # Room is made; the same command again resumes and reaches the undisturbed digest.
    tmpfs.resize(64 * PAGE)
    again, port = coordinator(spawn, save_dir, tiny_config, log_format, *flags)
    start_worker(spawn, port, words_data, "w")
    assert again.wait(120) == 0
    info = inspect_run(save_dir)
    assert info["step"] == steps and info["log_ok"]
    assert int(info["replica_digest"], 16) == trained_digest(words_data, tiny_config, steps)
