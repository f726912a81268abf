"""The save directory, written: everything the coordinator keeps, crash-safe.

The layout (run.json, fitness.log, digests.log, snapshots/, .lock) and its names and
writers are shared/save_dir.py's; this module is the one writer that holds the lock.
Steps committed = records in fitness.log. A snapshot only shortens catch-up; losing one
loses nothing.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from ..shared.atomic_file import fsync_dir, write_atomic
from ..shared.config import RunConfig
from ..shared.fitness_log import FitnessLog, FitnessLogError
from ..shared.save_dir import (
    Layout,
    SaveDirError,
    digest_line,
    new_run,
    read_digests,
    read_run,
    write_run,
)

_STALE_TMP = ".*.tmp"  # write_atomic's temporary files, left by a crash


class StoreError(Exception):
    """A save directory that cannot be used; the message says what to do."""


class RunStore:
    def __init__(self, path: Path, run: dict, log: FitnessLog, config: RunConfig, lock_fd: int):
        self.path = path
        self.layout = Layout(path)
        self._run = run
        self.fitness_log = log
        self.config = config
        self._lock_fd = lock_fd
        self.digests = self._load_digests()
        self._digests_fd: int | None = None  # digests.log, opened for appending on first use
        self.snapshot_steps = self._scan_snapshots()

    @classmethod
    def open(cls, path: str | Path, config: RunConfig | None) -> RunStore:
        """Open the run in `path`, or start one there with `config` (None: must exist)."""
        path = Path(path)
        layout = Layout(path)
        try:
            layout.snapshots.mkdir(parents=True, exist_ok=True)
            fsync_dir(path)
            lock_fd = os.open(layout.lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise StoreError(f"cannot use --save-dir {path}: {exc.strerror}") from None
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock_fd)
            raise StoreError(f"another coordinator is running on {path}") from None
        try:
            for stale in [*path.glob(_STALE_TMP), *layout.snapshots.glob(_STALE_TMP)]:
                stale.unlink(missing_ok=True)  # we hold the lock: no writer is alive
            run, stored = cls._load_or_create_run(layout, config)
            log_path = layout.fitness_log
            if log_path.exists():
                log = FitnessLog.open(log_path)
                if log.config_digest != stored.digest() or log.pairs != stored.pairs:
                    raise StoreError(f"{log_path} belongs to another run config")
            else:
                log = FitnessLog.create(log_path, stored.pairs, stored.digest())
        except (FitnessLogError, StoreError) as exc:
            os.close(lock_fd)
            raise StoreError(str(exc)) from None
        except OSError as exc:
            os.close(lock_fd)
            raise StoreError(f"cannot use --save-dir {path}: {exc}") from None
        try:
            return cls(path, run, log, stored, lock_fd)
        except (StoreError, OSError) as exc:
            os.close(lock_fd)
            raise StoreError(str(exc)) from None

    @staticmethod
    def _load_or_create_run(layout: Layout, config: RunConfig | None) -> tuple[dict, RunConfig]:
        path = layout.root
        if not layout.run_file.exists() and config is not None:
            run = new_run(config)
            write_run(layout, run)
            return run, config
        try:
            run, stored = read_run(layout)
        except SaveDirError as exc:
            remedy = "" if not layout.run_file.exists() else "; restore it or use a new --save-dir"
            raise StoreError(f"{exc}{remedy}") from None
        if config is not None and config.digest() != stored.digest():
            raise StoreError(
                f"--save-dir {path} holds a run with config digest {stored.digest().hex()[:16]}, "
                f"the given config has {config.digest().hex()[:16]}: start it with the same "
                "--preset/--config (or none), or use a new --save-dir"
            )
        return run, stored

    def sync_digests(self) -> None:
        if self._digests_fd is not None:
            os.fdatasync(self._digests_fd)

    def close(self) -> None:
        if self._digests_fd is not None:
            self.sync_digests()
            os.close(self._digests_fd)
            self._digests_fd = None
        os.close(self._lock_fd)

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
        self._run["data_digest"] = digest.hex()
        write_run(self.layout, self._run)

    # ------------------------------------------------------------------------ digests

    def _load_digests(self) -> dict[int, int]:
        path = self.layout.digests_log
        try:
            digests, good = read_digests(path)
        except SaveDirError as exc:
            raise StoreError(str(exc)) from None
        if path.exists() and path.stat().st_size != good:
            with open(path, "r+b") as f:  # cut a torn last line before appending more
                f.truncate(good)
                os.fsync(f.fileno())
        return digests

    def record_digest(self, step: int, digest: int) -> None:
        """Remember the agreed digest of the replica state at `step`. The line reaches the
        disk before the next snapshot is stored (the snapshot is checked against it) and at
        close; one lost in a crash is agreed again by the workers, and a torn one is cut at
        open, so a per-step fsync would buy nothing."""
        self.digests[step] = digest
        if self._digests_fd is None:
            path = self.layout.digests_log
            new = not path.exists()
            self._digests_fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            if new:
                fsync_dir(self.path)
        os.write(self._digests_fd, digest_line(step, digest))

    # ---------------------------------------------------------------------- snapshots

    def snapshot_path(self, step: int) -> Path:
        return self.layout.snapshot(step)

    def _scan_snapshots(self) -> list[int]:
        return [s for s in self.layout.snapshot_steps() if s <= self.steps]

    @property
    def latest_snapshot(self) -> int | None:
        return self.snapshot_steps[-1] if self.snapshot_steps else None

    def save_snapshot(self, step: int, blob: bytes, keep: int) -> None:
        """Store a verified snapshot atomically and keep only the newest `keep`."""
        self.sync_digests()  # the digests it was checked against are on disk first
        write_atomic(self.snapshot_path(step), blob)
        self.snapshot_steps = sorted({*self.snapshot_steps, step})
        while len(self.snapshot_steps) > keep:
            old = self.snapshot_steps.pop(0)
            self.snapshot_path(old).unlink(missing_ok=True)
