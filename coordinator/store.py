"""The save directory, written: everything the coordinator keeps, crash-safe.

The layout (run.json, fitness.log, digests.log, history.log, snapshots/, .lock) and its
names and writers are shared/save_dir.py's; the lock, run.json, the fitness log and the
snapshots are written through shared/run_writer.py's `RunWriter`, as eggroll-train's are.
This module adds what only a coordinator keeps: digests.log, history.log, suspect hosts,
the format upgrade, and its policy for writes that fail.
Steps committed = records in fitness.log. A snapshot only shortens catch-up; losing one
loses nothing.

A write that fails after the start follows the policy table of shared/save_dir.py: the
fitness log's append raises (the run core stops the coordinator); a snapshot's raises
`SnapshotWriteError` with nothing of it left behind; digests.log and run.json degrade: the
value stays in memory, the failure waits in `take_failures()` for the core to report, and
the file is written again at the next chance. history.log (the curve that eggroll-inspect
reads) degrades too: a record that cannot be written is dropped, reported the same way.
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

from ..shared.atomic_file import fsync_dir, write_atomic
from ..shared.config import RunConfig
from ..shared.replica import CheckpointError, load_checkpoint
from ..shared.run_writer import SNAPSHOTS_KEPT, RunWriter
from ..shared.save_dir import (
    RUN_FORMAT,
    HistoryLog,
    Layout,
    SaveDirBusy,
    SaveDirError,
    digest_line,
    read_digests,
    write_run,
)

MAX_SUSPECT_HOSTS = 1024  # addresses kept in run.json where a worker was outvoted
MAX_REWINDS = 64  # the newest rewinds recorded in run.json
REWOUND = "rewound"  # the save directory's folder of undone fitness-log tails and snapshots


class StoreError(Exception):
    """A save directory that cannot be used; the message says what to do."""


@dataclass(frozen=True)
class WriteFailure:
    """A write to the save directory that failed and was given up: the file, the error and
    the free space left where it was written (None: unknown)."""

    path: Path
    error: str
    free_bytes: int | None


class SnapshotWriteError(Exception):
    """A snapshot could not be stored; nothing of it is left in snapshots/."""

    def __init__(self, failure: WriteFailure) -> None:
        super().__init__(f"{failure.path}: {failure.error}")
        self.failure = failure


def write_failure(path: Path, exc: OSError) -> WriteFailure:
    """What an operator needs to know of a failed write: which file, why, how much room."""
    try:
        free: int | None = shutil.disk_usage(path.parent).free
    except OSError:
        free = None
    return WriteFailure(path, exc.strerror or str(exc), free)


class RunStore:
    """The coordinator's run: a `RunWriter` (the lock, run.json, the fitness log, snapshots)
    and what only a coordinator keeps beside it (digests.log, history.log, suspect hosts)."""

    def __init__(self, writer: RunWriter) -> None:
        assert writer.config is not None and writer.fitness_log is not None  # loaded
        self.writer = writer
        self.path = writer.root
        self.layout = writer.layout
        self._run = writer.run
        self.fitness_log = writer.fitness_log
        self.config = writer.config
        self._digests_good = 0  # digests.log's length in whole lines, set by _load_digests
        self.digests_cut = 0  # bytes of a torn last line cut off digests.log at open
        self.digests = self._load_digests()
        self._digests_fd: int | None = None  # digests.log, opened for appending on first use
        self._digests_failing = False  # the last digests.log write failed (reported once)
        self._digests_off = False  # a torn line could not be cut: no more appends this run
        self._run_dirty = False  # run.json in memory is newer than on disk
        self._run_failing = False  # its last write failed (reported once)
        self._failures: list[WriteFailure] = []  # degraded writes not yet reported
        self.history = HistoryLog(self.layout.history)
        self._history_failing = False  # its last append failed (reported once)
        self.bad_snapshots: list[tuple[Path, str]] = []  # found at open: path, why
        # A snapshot is stored on a thread while the run core may rewind on the loop: each
        # holds this lock, and a snapshot checked before a rewind (`lineage`) is not stored.
        self._snapshots_lock = threading.Lock()
        self.lineage = 0  # rewinds in this process: a snapshot is checked against one
        self._finish_rewind()  # one a crash interrupted
        writer.snapshot_steps = self._scan_snapshots()

    @classmethod
    def open(
        cls, path: str | Path, config: RunConfig | None, goal_dir: Path | None = None
    ) -> RunStore:
        """Open the run in `path`, or start one there with `config` (None: must exist); a
        new run's starting replica (model.init_from) is copied in from under `goal_dir`."""
        path = Path(path)
        try:
            writer = RunWriter.open(path, config, goal_dir or Path("."))
        except SaveDirBusy as exc:  # the holder may be a coordinator or eggroll-train
            raise StoreError(str(exc)) from None
        except SaveDirError as exc:
            raise StoreError(str(exc)) from None
        except OSError as exc:
            raise StoreError(f"cannot use --save-dir {path}: {exc}") from None
        try:
            writer.run = cls._upgrade(writer.layout, writer.run)  # once everything checked out
            return cls(writer)
        except (StoreError, OSError) as exc:
            writer.close()
            raise StoreError(str(exc)) from None

    @staticmethod
    def _upgrade(layout: Layout, run: dict) -> dict:
        """The run in RUN_FORMAT. Format 1 recorded replica digest 1 (shared/replica.py):
        its agreed digests no longer match any replica, so they are set aside (kept as
        digests-1.log) and the workers agree again."""
        if run.get("format", 1) >= RUN_FORMAT:
            return run
        if layout.digests_log.exists():
            layout.digests_log.rename(layout.root / "digests-1.log")
        run = {**run, "format": RUN_FORMAT}
        write_run(layout, run)
        return run

    def sync_digests(self) -> None:
        """Flush digests.log to the disk; a failure degrades it (see `record_digest`)."""
        if self._digests_fd is None:
            return
        try:
            os.fdatasync(self._digests_fd)
        except OSError as exc:
            self._digests_failed(exc)

    def close(self) -> None:
        if self._run_dirty:
            self.flush_run()  # one last try: a failure was reported already
        if self._digests_fd is not None:
            self.sync_digests()
            os.close(self._digests_fd)
            self._digests_fd = None
        self.history.close()
        self.writer.close()

    def take_failures(self) -> list[WriteFailure]:
        """The degraded writes (digests.log, run.json, history.log) not yet reported, each
        reported once per spell of failures; the list is emptied."""
        failures, self._failures = self._failures, []
        return failures

    # ------------------------------------------------------------------ run metadata

    @property
    def run_id(self) -> bytes:
        return bytes.fromhex(self._run["run_id"])

    @property
    def steps(self) -> int:
        """Steps committed."""
        return self.fitness_log.steps

    @property
    def data_digest(self) -> bytes | None:
        digest = self._run.get("data_digest")
        return bytes.fromhex(digest) if digest else None

    def set_data_digest(self, digest: bytes) -> None:
        """The run's data digest, kept in memory at once and written to run.json atomically;
        a failed write leaves the old run.json whole and is tried again by `flush_run`."""
        self._run["data_digest"] = digest.hex()
        self._run_dirty = True
        self.flush_run()

    @property
    def suspect_hosts(self) -> set[str]:
        """Addresses where a worker was outvoted (`add_suspect_host`)."""
        return set(self._run.get("suspect_hosts", []))

    def add_suspect_host(self, host: str) -> None:
        """An address where a worker was outvoted: kept in run.json, written as the data
        digest is, so that a restarted coordinator goes on checking every result from it.
        The newest MAX_SUSPECT_HOSTS are kept (each needs a lost vote: few)."""
        hosts = self._run.setdefault("suspect_hosts", [])
        if host in hosts:
            return
        hosts.append(host)
        del hosts[:-MAX_SUSPECT_HOSTS]
        self._run_dirty = True
        self.flush_run()

    def flush_run(self) -> None:
        """Write run.json if memory is newer. A failure is reported once (`take_failures`):
        committed state does not depend on it (a restart agrees the data digest again)."""
        if not self._run_dirty:
            return
        try:
            write_run(self.layout, self._run)
        except OSError as exc:
            if not self._run_failing:
                self._failures.append(write_failure(self.layout.run_file, exc))
                self._run_failing = True
            return
        self._run_dirty = self._run_failing = False

    def record_history(self, record: dict) -> None:
        """Append a record of the curve to history.log (a committed step, a held-out score,
        a sample, the baselines). No commit waits for it: a failed write drops the record
        and is reported once per spell of failures."""
        error = self.history.append(record)
        if error is not None and not self._history_failing:
            self._failures.append(write_failure(self.layout.history, error))
        self._history_failing = error is not None

    # ------------------------------------------------------------------------ digests

    def _load_digests(self) -> dict[int, int]:
        path = self.layout.digests_log
        try:
            digests, good = read_digests(path)
        except SaveDirError as exc:
            raise StoreError(str(exc)) from None
        if path.exists() and path.stat().st_size != good:
            self.digests_cut = path.stat().st_size - good
            with open(path, "r+b") as f:  # cut a torn last line before appending more
                f.truncate(good)
                os.fsync(f.fileno())
        self._digests_good = good
        return digests

    def record_digest(self, step: int, digest: int) -> None:
        """Remember the agreed digest of the replica state at `step`. The line reaches the
        disk before the next snapshot is stored (the snapshot is checked against it) and at
        close; one lost in a crash is agreed again by the workers, and a torn one is cut at
        open, so a per-step fsync would buy nothing. For the same reason a failed write
        degrades the file rather than the run: the digest stays in memory, the torn line is
        cut back, and the next digest tries again."""
        self.digests[step] = digest
        if self._digests_off:
            return
        line = digest_line(step, digest)
        try:
            if self._digests_fd is None:
                path = self.layout.digests_log
                new = not path.exists()
                self._digests_fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                if new:
                    fsync_dir(self.path)
            written = os.write(self._digests_fd, line)
            if written != len(line):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # a short write
        except OSError as exc:
            self._digests_failed(exc)
            return
        self._digests_good += len(line)
        self._digests_failing = False

    def _digests_failed(self, exc: OSError) -> None:
        """A digests.log write failed: cut it back to its whole lines so later appends keep
        it readable (a torn line mid-file would stop the next start); if even that fails,
        append nothing more this run (a torn last line is cut at the next open)."""
        if not self._digests_failing:
            self._failures.append(write_failure(self.layout.digests_log, exc))
            self._digests_failing = True
        if self._digests_fd is None:
            return
        try:
            os.ftruncate(self._digests_fd, self._digests_good)  # needs no free space
        except OSError:
            os.close(self._digests_fd)
            self._digests_fd = None
            self._digests_off = True

    # ------------------------------------------------------------------------ rewinds

    @property
    def rewinds(self) -> list[dict]:
        """The run's rewinds, oldest first (run.json): first step undone, end, chunks, why."""
        return list(self._run.get("rewinds", []))

    def rewind(self, to: int, chunks: int, why: str) -> Path:
        """Undo steps `to`.. of the fitness log (SPEC §8 Rewinds): the tail kept in
        rewound/, run.json told (a crash midway is finished at the next open), the log cut
        and fsync'd, digests and snapshots past `to` set aside. Returns the tail's file.
        An OSError before the cut leaves the run as it was; one after it is finished at the
        next open, so the caller stops (as after a failed append)."""
        end = self.steps
        folder = self.path / REWOUND
        folder.mkdir(mode=0o700, exist_ok=True)
        kept = _free_name(folder, f"fitness-{to}-{end - 1}", ".log")
        write_atomic(kept, self.fitness_log.tail_bytes(to))
        entry = {"from": to, "to": end, "chunks": chunks, "why": why, "tail": kept.name}
        rewinds = [*self._run.get("rewinds", []), entry][-MAX_REWINDS:]
        # The cut below is finished at open if cut short. Memory changes only once this is
        # written: a failure leaves nothing that a later flush could write as begun.
        write_run(self.layout, {**self._run, "rewinds": rewinds, "rewind_pending": to})
        self._run.update(rewinds=rewinds, rewind_pending=to)
        # Waits for a snapshot being written (rare: a rewind), so none of an undone step
        # lands in snapshots/ after the cut has moved them out.
        with self._snapshots_lock:
            self.lineage += 1
            self._cut(to)
        return kept

    def _finish_rewind(self) -> None:
        """Finish a rewind that run.json records as begun."""
        to = self._run.get("rewind_pending")
        if to is None:
            return
        self._cut(to)

    def _cut(self, to: int) -> None:
        if self.steps > to:
            self.fitness_log.truncate(to)
        self._drop_digests_past(to)
        folder = self.path / REWOUND
        moved = [s for s in self.layout.snapshot_steps() if s > to]
        for step in moved:
            folder.mkdir(mode=0o700, exist_ok=True)
            os.replace(self.snapshot_path(step), _free_name(folder, f"step-{step}", ".ckpt"))
        self.writer.snapshot_steps = [s for s in self.writer.snapshot_steps if s <= to]
        fsync_dir(self.layout.snapshots)
        if moved:
            fsync_dir(folder)  # both ends of each rename
        self._run.pop("rewind_pending", None)
        # Not degraded as other run.json writes are: one still naming the rewind would cut
        # the steps committed after it at the next open. A failure raises (the core stops).
        self._run_dirty = True
        write_run(self.layout, self._run)
        self._run_dirty = self._run_failing = False

    def _drop_digests_past(self, steps: int) -> None:
        """Agreed digests of steps past `steps` belong to undone steps: digests.log is
        written again without them."""
        if all(step <= steps for step in self.digests):
            return
        self.digests = {s: d for s, d in self.digests.items() if s <= steps}
        if self._digests_fd is not None:
            os.close(self._digests_fd)
            self._digests_fd = None
        data = b"".join(digest_line(s, d) for s, d in sorted(self.digests.items()))
        write_atomic(self.layout.digests_log, data)
        self._digests_good = len(data)

    # ---------------------------------------------------------------------- snapshots

    def snapshot_path(self, step: int) -> Path:
        return self.layout.snapshot(step)

    def _scan_snapshots(self) -> list[int]:
        """The snapshots of committed steps, the newest verified: one that cannot be read
        (or is not of this run, or disagrees with the agreed digest) is left out and kept
        in `bad_snapshots` for the log, and the next older one is verified instead, so that
        joiners are served a good one. Older ones are checked by the worker that loads one."""
        steps = [s for s in self.layout.snapshot_steps() if s <= self.steps]
        while steps:
            path = self.snapshot_path(steps[-1])
            problem = self._snapshot_problem(steps[-1])
            if not problem:
                break
            self.bad_snapshots.append((path, problem))
            steps.pop()
        return steps

    def _snapshot_problem(self, step: int) -> str:
        try:
            state = load_checkpoint(self.snapshot_path(step))
        except (CheckpointError, OSError) as exc:
            return str(exc)
        if state.config.digest() != self.config.digest() or state.step != step:
            return "it belongs to another run"
        agreed = self.digests.get(step)
        if agreed is not None and agreed != state.digest():
            return f"its digest {state.digest_hex()} is not the agreed {agreed:016x}"
        return ""

    @property
    def snapshot_steps(self) -> list[int]:
        """The snapshots offered to joiners, ascending (those verified at open and since)."""
        return self.writer.snapshot_steps

    @property
    def latest_snapshot(self) -> int | None:
        return self.snapshot_steps[-1] if self.snapshot_steps else None

    def save_snapshot(
        self, step: int, blob: bytes, keep: int = SNAPSHOTS_KEPT, lineage: int | None = None
    ) -> bool:
        """Store a verified snapshot atomically and keep only the newest `keep`; False when
        the run rewound since it was checked (`lineage`, read then): it may be of an undone
        step, and is not stored. A failed write raises SnapshotWriteError and leaves no file
        of it behind (a snapshot only shortens catch-up: the caller drops it, the run goes
        on). Safe on a thread while the core rewinds."""
        with self._snapshots_lock:
            if lineage is not None and lineage != self.lineage:
                return False
            self.sync_digests()  # the digests it was checked against are on disk first
            try:
                self.writer.save_snapshot(step, blob, keep)
            except OSError as exc:
                raise SnapshotWriteError(write_failure(self.snapshot_path(step), exc)) from None
        return True

    def forget_snapshot(self, step: int) -> None:
        """A stored snapshot that cannot be read: offer it no more this run (the file is
        left for the operator to look at; workers replay the fitness log instead)."""
        self.writer.snapshot_steps = [s for s in self.snapshot_steps if s != step]


def _free_name(folder: Path, stem: str, suffix: str) -> Path:
    """`folder/stem+suffix`, or with -2, -3, ... where that is taken (rewound twice)."""
    path, n = folder / f"{stem}{suffix}", 1
    while path.exists():
        n += 1
        path = folder / f"{stem}-{n}{suffix}"
    return path
