"""The save directory: the one place that names its files, and the reading of one.

    run.json         run id, run config, data digest, suspect addresses (rewritten
                     atomically)
    fitness.log      one fsync'd record per committed step: the run itself
    digests.log      "step digest" lines: the agreed replica digest at each step
    history.log      the curve: a JSON line per committed step, held-out score and sample
                     (the fields of their log lines, shared/logs.py), and the baselines
    snapshots/       step-00000100.ckpt ...: replica states (checkpoint files)
    logs/            eggroll-local's logs: coordinator.log (JSON lines), worker-N.log
    summary.json     the last summary of eggroll-train or eggroll-local
    init.ckpt        a copy of the replica the run started from (model.init_from), if any
    .lock            held by the directory's one writer while it runs (a coordinator or
                     eggroll-train: shared/run_writer.py's RunWriter)

Steps committed = records in fitness.log, and the state at step S is a pure function of
them (`shared.replica.replay`): a snapshot only shortens the replay, losing one loses
nothing. The coordinator's `RunStore` (coordinator/store.py) and `eggroll-train
--save-dir` write a save directory through one writer (shared/run_writer.py) with the names
and writers below; `SaveDir` reads one without creating, repairing or locking anything, so
it is safe on a live run.

When a write fails (a full disk, an I/O error). The fitness log is the run; every other file
is a convenience. A file whose loss would lose or corrupt committed state stops the writer;
any other degrades with one warning line that names the path, the error and the free space,
and the run goes on. A failure on the coordinator's side never fails a worker's session.

    file               when a write fails
    fitness.log        stop at once: one line (path, error), non-zero exit. Started again on
                       the same directory once there is room, the coordinator cuts the torn
                       record off and resumes at the same digest
    snapshots/         that snapshot is dropped (no partial file left), one warning; steps are
                       still committed; asked again at the next snapshot step, not before
                       (the final one too: the run still ends at --max-steps)
    digests.log        degrade: digests stay in memory, a torn line is cut back, the next
                       digest tries again; one warning per spell of failures. A line lost is
                       agreed again by the workers after a restart
    history.log        degrade: that record is dropped and a torn line cut back, the next
                       record tries again; one warning per spell of failures (a point of
                       the curve is lost, nothing of the run)
    run.json           at start: one line, non-zero exit. Later (the data digest, a
                       suspect address): degrade,
                       kept in memory and written again at each commit; one warning (the old
                       file stays whole: it is replaced atomically)
    .lock, *.tmp       at start only: one line, non-zero exit
    logs/, console     degrade: a log line that cannot be written is dropped (shared/logs.py)
    summary.json       degrade: one warning; the run itself is complete
    init.ckpt          at start, with run.json: one line, non-zero exit
    commands           eggroll-train --save-dir, eggroll-data prepare --out, eggroll-sample:
                       one line, non-zero exit, nothing half-written. eggroll-train keeps
                       its committed steps, and the same command continues them

coordinator/store.py, run.py and server.py carry out the coordinator's rows; the deployment
view is deploy/README.md, "When the disk is full".
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .atomic_file import write_atomic
from .config import ConfigError, RunConfig, from_dict
from .fitness_log import FitnessLog, FitnessLogError
from .pinned import GoalError, resolve
from .progress import Progress
from .replica import CheckpointError, ReplicaState, load_checkpoint, replay
from .start import initial_state

RUN_FORMAT = 2  # 2: digests.log holds replica digest 2 (the tree of shared/replica.py)
RUN_FILE = "run.json"
FITNESS_LOG = "fitness.log"
DIGESTS_LOG = "digests.log"
SNAPSHOTS = "snapshots"
LOGS = "logs"
HISTORY_LOG = "history.log"
COORDINATOR_LOG = "coordinator.log"
SUMMARY_FILE = "summary.json"
LOCK_FILE = ".lock"
START_FILE = "init.ckpt"
SNAPSHOT_GLOB = "step-*.ckpt"

_SNAPSHOT_NAME = re.compile(r"step-([0-9]+)\.ckpt")
_DIGEST_LINE = re.compile(rb"(0|[1-9][0-9]{0,18}) ([0-9a-f]{16})")

# A fitness-log record's payload -> the step's fitness (int8 in {-1, 0, 1}, one per pair).
# The payload is opaque to shared/ (see fitness_log.py): callers pass
# protocol.ternary.unpack_ternary.
UnpackFitness = Callable[[bytes, int], np.ndarray]


class SaveDirError(Exception):
    """A save directory that cannot be read, or a step it does not hold; the message says
    why in one line."""


class SaveDirBusy(SaveDirError):
    """Another process holds the save directory's writer lock."""


def snapshot_name(step: int) -> str:
    """The file name of the snapshot of `step` in snapshots/."""
    return f"step-{step:08d}.ckpt"


@dataclass(frozen=True)
class Layout:
    """Where each file of the save directory at `root` lives; nothing is read or created."""

    root: Path

    @property
    def run_file(self) -> Path:
        return self.root / RUN_FILE

    @property
    def fitness_log(self) -> Path:
        return self.root / FITNESS_LOG

    @property
    def digests_log(self) -> Path:
        return self.root / DIGESTS_LOG

    @property
    def history(self) -> Path:
        return self.root / HISTORY_LOG

    @property
    def snapshots(self) -> Path:
        return self.root / SNAPSHOTS

    @property
    def logs(self) -> Path:
        return self.root / LOGS

    @property
    def coordinator_log(self) -> Path:
        return self.logs / COORDINATOR_LOG

    @property
    def summary(self) -> Path:
        return self.root / SUMMARY_FILE

    @property
    def lock(self) -> Path:
        return self.root / LOCK_FILE

    @property
    def start(self) -> Path:
        return self.root / START_FILE

    def worker_log(self, index: int) -> Path:
        return self.logs / f"worker-{index}.log"

    def snapshot(self, step: int) -> Path:
        return self.snapshots / snapshot_name(step)

    def snapshot_files(self) -> list[Path]:
        """Every file named like a snapshot, by name (a damaged or odd one included)."""
        return sorted(self.snapshots.glob(SNAPSHOT_GLOB))

    def snapshot_steps(self) -> list[int]:
        """The steps of the snapshot files present, ascending; names that `snapshot_name`
        does not write are ignored."""
        steps = []
        for path in self.snapshots.glob(SNAPSHOT_GLOB):
            match = _SNAPSHOT_NAME.fullmatch(path.name)
            if match is not None and path.name == snapshot_name(int(match[1])):
                steps.append(int(match[1]))
        return sorted(steps)


# --- writing (the coordinator's store and eggroll-train) ---------------------------------


def new_run(config: RunConfig, data_digest: bytes | None = None) -> dict[str, Any]:
    """The run.json record of a new run: a fresh run id, and the data digest if known (a
    coordinator learns it from its workers)."""
    return {
        "format": RUN_FORMAT,
        "run_id": secrets.token_hex(16),
        "created": time.time(),
        "config": config.to_dict(),
        "data_digest": None if data_digest is None else data_digest.hex(),
    }


def write_start(layout: Layout, config: RunConfig, base: Path) -> None:
    """Copy the replica a run starts from (model.init_from, under `base`) into the save
    directory, so that its steps replay without the original file."""
    if config.model.init_from:
        initial_state(config, base)  # GoalError unless it is the replica the config pins
        write_atomic(layout.start, resolve(config.model.init_from, base).read_bytes())


def write_run(layout: Layout, run: dict[str, Any]) -> None:
    """Write run.json atomically: a crash leaves the old record or the new one."""
    write_atomic(layout.run_file, json.dumps(run, indent=2).encode())


def digest_line(step: int, digest: int) -> bytes:
    """The digests.log line that records the agreed replica digest at `step`."""
    return b"%d %016x\n" % (step, digest)


def take_lock(layout: Layout, create: bool = True) -> int | None:
    """Hold the writer lock (.lock) of the save directory: its file descriptor, held until
    it is closed or the process ends. SaveDirBusy when another writer holds it; None when
    there is no lock file and `create` is off. OSError when the file cannot be opened."""
    if not create and not layout.lock.exists():
        return None
    while True:
        fd = os.open(layout.lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = lock_holder(fd)
            os.close(fd)
            by = "another process" if holder is None else f"process {holder}"
            raise SaveDirBusy(
                f"{by} is writing to {layout.root}: wait for it to end, or use another --save-dir"
            ) from None
        if _is_at(fd, layout.lock):
            return fd
        os.close(fd)  # a writer that gave up its new run removed this file: take the new one


def lock_holder(fd: int, locks: Path = Path("/proc/locks")) -> int | None:
    """The process holding a flock on the open file `fd`, from Linux's lock table (None
    where there is none to read): a busy save directory names who holds it."""
    held = os.fstat(fd)
    where = f"{os.major(held.st_dev):02x}:{os.minor(held.st_dev):02x}:{held.st_ino}"
    try:
        table = locks.read_text()
    except OSError:
        return None
    for line in table.splitlines():  # "1: FLOCK  ADVISORY  WRITE 4242 00:2e:1234 0 EOF"
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == where:
            return int(fields[4]) if fields[4].isdigit() else None
    return None


def _is_at(fd: int, path: Path) -> bool:
    """Whether the open file `fd` is still the one at `path` (not unlinked meanwhile)."""
    try:
        at = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (at.st_dev, at.st_ino)


# history.log's record of the data's baselines (its other records are log events: STEP,
# VALIDATION and SAMPLE of shared/logs.py, with the fields of their log lines).
BASELINES = "baselines"


def baselines_record(per_token: dict[str, float], per_byte: dict[str, float]) -> dict[str, Any]:
    """The history.log record of the data's baselines (meta.json's, bits per token and per
    byte), written at every start so a plot of the curve can draw them."""
    return {"event": BASELINES, "per_token": per_token, "per_byte": per_byte}


def _whole_lines(fd: int, size: int) -> int:
    """The length of a file's whole lines: up to its last newline, read backwards."""
    end = size
    while end > 0:
        start = max(0, end - 4096)
        at = os.pread(fd, end - start, start).rfind(b"\n")
        if at >= 0:
            return start + at + 1
        end = start
    return 0


class HistoryLog:
    """history.log opened for appending, one JSON line per record. It is a convenience (the
    policy table above): `append` never raises. A write that fails is cut back to the file's
    whole lines and its error returned, for the writer to report once; the next append tries
    again. No fsync: a line lost in a crash costs one point of the curve."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        self._good = 0  # the file's length in whole lines

    def append(self, record: dict[str, Any]) -> OSError | None:
        """Append `record`; the OSError of a write that failed (None: written)."""
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        try:
            if self._fd is None:
                self._open()
            assert self._fd is not None
            if os.write(self._fd, line) != len(line):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # a short write
        except OSError as exc:
            self._cut_back()
            return exc
        self._good += len(line)
        return None

    def _open(self) -> None:
        """Open for appending and cut a torn last line (a crash mid-write) off, so the next
        record starts a line of its own."""
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            size = good = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                good = _whole_lines(fd, size)
                os.ftruncate(fd, good)
        except OSError:
            os.close(fd)
            raise
        self._fd, self._good = fd, good

    def _cut_back(self) -> None:
        """Leave only whole lines; if even that fails, close: the next append opens the file
        again and cuts its torn tail then."""
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, self._good)  # needs no free space
        except OSError:
            self.close()

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):  # nothing is lost: every write was whole
                os.close(self._fd)
            self._fd = None


# --- reading ------------------------------------------------------------------------------


def read_run(layout: Layout) -> tuple[dict[str, Any], RunConfig]:
    """run.json as stored (a record without run id or format still reads) and its config."""
    if not layout.run_file.is_file():
        raise SaveDirError(f"{layout.root} holds no run (no {RUN_FILE})")
    try:
        run = json.loads(layout.run_file.read_text())
        return run, from_dict(run["config"])
    except (ValueError, KeyError, TypeError, ConfigError) as exc:
        raise SaveDirError(f"{layout.run_file} is unreadable ({exc})") from None


def read_digests(path: Path) -> tuple[dict[int, int], int]:
    """Agreed digests from digests.log (`digest_line` lines) and the byte length of its good
    lines. A malformed or unterminated last line is a torn append and is left out; a
    malformed line before it is SaveDirError."""
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
            raise SaveDirError(
                f"{path} line {number} is malformed; the file is a check that workers "
                "rebuild, so delete it (or that line) and start again"
            )
        digests[int(match[1])] = int(match[2], 16)
        good += len(line) + 1
    return digests, good


def read_history(path: Path) -> list[dict[str, Any]]:
    """The records of history.log in order; a line that does not parse (a torn last line)
    is left out, and a missing file has none."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return []
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("event"), str):
            records.append(record)
    return records


class SaveDir:
    """A save directory opened for reading: its run record, fitness log and snapshots, and
    the replica state at any committed step. Every error is SaveDirError."""

    def __init__(self, layout: Layout, run: dict[str, Any], config: RunConfig) -> None:
        self.layout = layout
        self.run = run  # run.json as stored
        self.config = config
        self._log: FitnessLog | None = None
        # a Hugging Face run's model directory, whose files are its step 0 (None: the run's
        # model.path, from the working directory)
        self.model_dir: Path | None = None

    @classmethod
    def open(cls, path: str | Path) -> SaveDir:
        """Read run.json of the save directory at `path`; nothing is written."""
        layout = Layout(Path(path))
        if not layout.root.exists():
            raise SaveDirError(f"{layout.root} does not exist")
        if not layout.root.is_dir():
            raise SaveDirError(f"{layout.root} is not a directory: give a save directory")
        run, config = read_run(layout)
        return cls(layout, run, config)

    @property
    def path(self) -> Path:
        return self.layout.root

    def fitness_log(self, torn_ok: bool = False) -> FitnessLog:
        """The fitness log, every record verified, never repaired; opened once. A torn last
        record (a crash mid-append, cut at the writer's next start) is an error here, or
        with `torn_ok` left out of `steps` and counted in `torn_bytes`."""
        if self._log is None:
            try:
                log = FitnessLog.open(self.layout.fitness_log, repair=False, torn_ok=True)
            except FitnessLogError as exc:
                raise SaveDirError(str(exc)) from None
            if log.config_digest != self.config.digest():
                raise SaveDirError(f"{self.layout.fitness_log} belongs to another run config")
            self._log = log
        if self._log.torn_bytes and not torn_ok:
            raise SaveDirError(f"fitness log {self._log.path} ends in a torn record")
        return self._log

    @property
    def steps(self) -> int:
        """Steps committed (0 while there is no fitness log)."""
        return self.fitness_log().steps if self.layout.fitness_log.is_file() else 0

    def digests(self) -> dict[int, int]:
        """The agreed replica digest at each step digests.log records (none in a run of
        format 1, whose digests were of another scheme: a coordinator sets them aside)."""
        if self.run.get("format", 1) < RUN_FORMAT:
            return {}
        return read_digests(self.layout.digests_log)[0]

    def snapshot_steps(self) -> list[int]:
        """The snapshots that count: those of committed steps."""
        committed = self.steps
        return [s for s in self.layout.snapshot_steps() if s <= committed]

    def base_of(self, step: int) -> int | None:
        """The newest snapshot at or below `step` (None: replay from the initial state)."""
        return max((s for s in self.snapshot_steps() if s <= step), default=None)

    def state_at(
        self,
        step: int,
        unpack: UnpackFitness,
        on_replay: Callable[[int], Progress | None] | None = None,
        snapshots: bool = True,
    ) -> ReplicaState:
        """The replica state after `step` committed steps, the one every worker reaches: the
        newest snapshot at or below it (with `snapshots`; else the initial state), then the
        fitness log replayed up to it, each record read by `unpack`. `on_replay` hears how
        many steps are about to be replayed, and may return a Progress to follow them."""
        base = self.base_at(step) if snapshots else self.initial()
        return self.replay_from(base, step, unpack, on_replay)

    def base_at(
        self, step: int, on_bad_snapshot: Callable[[Path, str], None] | None = None
    ) -> ReplicaState:
        """The state a replay up to `step` starts from: the newest snapshot at or below it,
        else the initial state. A snapshot that cannot be read is an error, or with
        `on_bad_snapshot` passed over for an older one (told its path and why): the log
        gives the same state from there. A snapshot of another run is always an error."""
        committed = self.steps
        if not 0 <= step <= committed:
            raise SaveDirError(f"step {step} is not in {self.path}: it has steps 0..{committed}")
        for base in reversed([s for s in self.snapshot_steps() if s <= step]):
            path = self.layout.snapshot(base)
            try:
                state = load_checkpoint(path)
            except CheckpointError as exc:
                if on_bad_snapshot is None:
                    raise SaveDirError(f"{path}: {exc}") from None
                on_bad_snapshot(path, str(exc))
                continue
            if state.config.digest() != self.config.digest() or state.step != base:
                raise SaveDirError(f"snapshot of step {base} in {self.path} belongs to another run")
            return state
        return self.initial()

    def initial(self) -> ReplicaState:
        """The run's state at step 0 (a run that started from a trained replica keeps a
        copy of it: init.ckpt)."""
        try:
            return initial_state(self.config, path=self.layout.start, model_dir=self.model_dir)
        except GoalError as exc:
            raise SaveDirError(str(exc)) from None

    def replay_from(
        self,
        state: ReplicaState,
        step: int,
        unpack: UnpackFitness,
        on_replay: Callable[[int], Progress | None] | None = None,
    ) -> ReplicaState:
        """`state` with the fitness log replayed up to `step` (see `state_at`)."""
        committed = self.steps
        if not state.step <= step <= committed:
            raise SaveDirError(f"step {step} is not in {self.path}: it has steps 0..{committed}")
        if step > state.step:
            count = step - state.step
            progress = None if on_replay is None else on_replay(count)
            try:
                packed = self.fitness_log().read(state.step, count)
            except FitnessLogError as exc:
                raise SaveDirError(str(exc)) from None

            def records() -> Iterator[np.ndarray]:
                for i, p in enumerate(packed):
                    if progress is not None:
                        progress.update(i)  # the steps before this one are applied
                    yield unpack(p, self.config.pairs)

            state = replay(state, records())
            if progress is not None:
                progress.update(count)
                progress.finish()
        return state
