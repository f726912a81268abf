"""The save directory: everything the coordinator keeps, crash-safe.

    run.json         run id, run config, data digest (rewritten atomically)
    fitness.log      one fsync'd record per committed step: the run itself
    digests.log      "step digest" lines: the agreed replica digest at each step
    snapshots/       step-00000100.ckpt ...: replica states streamed from workers
    .lock            held while a coordinator runs on this directory

Steps committed = records in fitness.log. A snapshot only shortens catch-up; losing one
loses nothing.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
import time
from pathlib import Path

from ..shared.atomic_file import fsync_dir, write_atomic
from ..shared.config import ConfigError, RunConfig, from_dict
from ..shared.fitness_log import FitnessLog, FitnessLogError

RUN_FORMAT = 1


_DIGEST_LINE = re.compile(rb"(0|[1-9][0-9]{0,18}) ([0-9a-f]{16})")
_STALE_TMP = ".*.tmp"  # write_atomic's temporary files, left by a crash


def read_digests(path: Path) -> tuple[dict[int, int], int]:
    """Agreed digests from digests.log ("step digest-hex" lines) and the byte length of its
    good lines. A malformed or unterminated last line is a torn append and is left out; a
    malformed line before it is StoreError."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return {}, 0
    digests: dict[int, int] = {}
    good = 0
    lines = data.split(b"\n")  # the last item is b"" when the file ends in a newline
    for number, line in enumerate(lines[:-1], 1):
        match = _DIGEST_LINE.fullmatch(line)
        if match is None:
            if number == len(lines) - 1 and not lines[-1]:
                break  # the last line, torn
            raise StoreError(
                f"{path} line {number} is malformed; the file is a check that workers "
                "rebuild, so delete it (or that line) and start again"
            )
        digests[int(match[1])] = int(match[2], 16)
        good += len(line) + 1
    return digests, good


class StoreError(Exception):
    """A save directory that cannot be used; the message says what to do."""


class RunStore:
    def __init__(self, path: Path, run: dict, log: FitnessLog, config: RunConfig, lock_fd: int):
        self.path = path
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
        try:
            (path / "snapshots").mkdir(parents=True, exist_ok=True)
            fsync_dir(path)
            lock_fd = os.open(path / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise StoreError(f"cannot use --save-dir {path}: {exc.strerror}") from None
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock_fd)
            raise StoreError(f"another coordinator is running on {path}") from None
        try:
            for stale in [*path.glob(_STALE_TMP), *(path / "snapshots").glob(_STALE_TMP)]:
                stale.unlink(missing_ok=True)  # we hold the lock: no writer is alive
            run, stored = cls._load_or_create_run(path, config)
            log_path = path / "fitness.log"
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
    def _load_or_create_run(path: Path, config: RunConfig | None) -> tuple[dict, RunConfig]:
        run_file = path / "run.json"
        if not run_file.exists():
            if config is None:
                raise StoreError(f"{path} holds no run (no run.json)")
            run = {
                "format": RUN_FORMAT,
                "run_id": secrets.token_hex(16),
                "created": time.time(),
                "config": config.to_dict(),
                "data_digest": None,
            }
            write_atomic(run_file, json.dumps(run, indent=2).encode())
            return run, config
        try:
            run = json.loads(run_file.read_text())
            stored = from_dict(run["config"])
        except (ValueError, KeyError, ConfigError) as exc:
            raise StoreError(
                f"{run_file} is unreadable ({exc}); restore it or use a new --save-dir"
            ) from None
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
        write_atomic(self.path / "run.json", json.dumps(self._run, indent=2).encode())

    # ------------------------------------------------------------------------ digests

    def _load_digests(self) -> dict[int, int]:
        path = self.path / "digests.log"
        digests, good = read_digests(path)
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
            path = self.path / "digests.log"
            new = not path.exists()
            self._digests_fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            if new:
                fsync_dir(self.path)
        os.write(self._digests_fd, b"%d %016x\n" % (step, digest))

    # ---------------------------------------------------------------------- snapshots

    def snapshot_path(self, step: int) -> Path:
        return self.path / "snapshots" / f"step-{step:08d}.ckpt"

    def _scan_snapshots(self) -> list[int]:
        steps = []
        for p in (self.path / "snapshots").glob("step-*.ckpt"):
            try:
                steps.append(int(p.stem.split("-")[1]))
            except ValueError:
                continue
        return sorted(s for s in steps if s <= self.steps)

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
