"""The fitness log: the training run itself, one record per committed step, append-only.

Replaying the log from step 0 reproduces the replica bit for bit (`shared.replica.replay`). The
payload of a record is the step's ternary-packed fitness, opaque here. Layout, big-endian:

    header (52 bytes): magic b"EGGFLOG\\0" | format u32 (1) | pairs per step u32 |
                       config digest (32 B) | CRC-32 of the preceding 48 bytes (u32)
    record k:          step u64 (== k) | length u32 | payload | CRC-32 of step..payload

Every record has the same size, so step k is at a fixed offset. `append` fsyncs before it
returns: a step is committed once its record is on disk, and an append that fails leaves the
log refusing further appends (the caller must stop: the file's tail is unknown). A torn last
record (a crash in the middle of an append, never acknowledged) is cut off when the log is
opened: a partial record, or a full-size last record that fails its check and holds an
all-zero 512-byte sector (a file whose size reached the disk before its data, as etcd's WAL
also assumes). A bad record anywhere else is corruption and an error that says what to do.
"""

from __future__ import annotations

import itertools
import os
import struct
import zlib
from pathlib import Path

from .atomic_file import fsync_dir

MAGIC = b"EGGFLOG\0"
SECTOR = 512
_VERIFY_RECORDS = 4096  # records read per block while verifying at open
FORMAT_VERSION = 1
HEADER = struct.Struct(">8sII32s")
HEADER_SIZE = HEADER.size + 4
RECORD_HEAD = struct.Struct(">QI")


class FitnessLogError(ValueError):
    """A fitness log that is corrupt or belongs to another run; `intact`: for a corrupt
    record, how many records before it verify (the steps the log still holds)."""

    def __init__(self, message: str, intact: int | None = None) -> None:
        super().__init__(message)
        self.intact = intact


def packed_size(pairs: int) -> int:
    return -(-pairs // 5)


class FitnessLog:
    """An open fitness log file (for appending, reading, or both)."""

    def __init__(self, path: Path, pairs: int, config_digest: bytes, steps: int, repaired: int):
        self.path = path
        self.pairs = pairs
        self.config_digest = config_digest
        self.record_size = RECORD_HEAD.size + packed_size(pairs) + 4
        self.steps = steps  # records on disk = steps committed
        self.repaired_bytes = repaired  # bytes of a torn last record cut off at open
        self.torn_bytes = 0  # bytes of a torn last record left in place (torn_ok)
        self.failed = False  # an append failed: the tail is unknown until reopened

    @classmethod
    def create(cls, path: str | Path, pairs: int, config_digest: bytes) -> FitnessLog:
        path = Path(path)
        head = HEADER.pack(MAGIC, FORMAT_VERSION, pairs, config_digest)
        with open(path, "xb") as f:
            f.write(head + struct.pack(">I", zlib.crc32(head)))
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(path.parent)  # the new name survives a crash too
        return cls(path, pairs, config_digest, 0, 0)

    @classmethod
    def open(cls, path: str | Path, repair: bool = True, torn_ok: bool = False) -> FitnessLog:
        """Open and verify a log, reading it in blocks; with `repair`, cut off a torn last
        record (see the module docstring). Without it a torn last record is an error, or
        with `torn_ok` left in place and counted in `torn_bytes` (a reader of a live run)."""
        path = Path(path)
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            raise FitnessLogError(f"fitness log {path} does not exist") from None
        with f:
            head = f.read(HEADER_SIZE)
            if len(head) < HEADER_SIZE:
                raise FitnessLogError(f"fitness log {path} is too short to hold a header")
            magic, version, pairs, digest = HEADER.unpack_from(head)
            (crc,) = struct.unpack_from(">I", head, HEADER.size)
            if magic != MAGIC or zlib.crc32(head[: HEADER.size]) != crc:
                raise FitnessLogError(f"{path} is not a fitness log (bad magic or header CRC)")
            if version != FORMAT_VERSION:
                raise FitnessLogError(f"fitness log {path} has format {version}, expected 1")
            log = cls(path, pairs, digest, 0, 0)
            size = os.fstat(f.fileno()).st_size
            whole, torn = divmod(size - HEADER_SIZE, log.record_size)
            for first in range(0, whole, _VERIFY_RECORDS):
                count = min(_VERIFY_RECORDS, whole - first)
                block = f.read(count * log.record_size)
                for k in range(count):
                    at = k * log.record_size
                    try:
                        log._parse_record(block, at, first + k)
                    except FitnessLogError:
                        last = first + k == whole - 1
                        offset = HEADER_SIZE + (first + k) * log.record_size
                        record = block[at : at + log.record_size]
                        if not (last and _has_zero_sector(record, offset)):
                            raise FitnessLogError(log._corrupt(first + k), first + k) from None
                        whole, torn = whole - 1, torn + log.record_size
        if torn and not repair and torn_ok:
            log.steps, log.torn_bytes = whole, torn
            return log
        if torn:
            if not repair:
                raise FitnessLogError(f"fitness log {path} ends in a torn record")
            with open(path, "r+b") as f:
                f.truncate(HEADER_SIZE + whole * log.record_size)
                os.fsync(f.fileno())
        log.steps, log.repaired_bytes = whole, torn
        return log

    def _corrupt(self, step: int) -> str:
        keep = HEADER_SIZE + step * self.record_size
        return (
            f"fitness log {self.path}: record {step} is corrupt (bad step, length or CRC). "
            f"Restore it from a backup, or keep the first {step} steps and lose the rest "
            f"with `truncate -s {keep} {self.path}` (workers then resync by replaying)"
        )

    def _parse_record(self, data: bytes, at: int, step: int) -> bytes:
        """Verify the record at offset `at` of `data` is step `step`; return its payload."""
        found, length = RECORD_HEAD.unpack_from(data, at)
        end = at + RECORD_HEAD.size + length
        if found != step or length != packed_size(self.pairs) or end + 4 > len(data):
            raise FitnessLogError(f"fitness log {self.path}: record {step} is malformed")
        (crc,) = struct.unpack_from(">I", data, end)
        if zlib.crc32(data[at:end]) != crc:
            raise FitnessLogError(f"fitness log {self.path}: record {step} fails its CRC")
        return data[at + RECORD_HEAD.size : end]

    def append(self, step: int, packed: bytes) -> None:
        """Durably append the record of `step` (must be the next step)."""
        if step != self.steps:
            raise FitnessLogError(f"appending step {step}, but the log holds {self.steps} steps")
        if len(packed) != packed_size(self.pairs):
            raise FitnessLogError(
                f"step {step} fitness is {len(packed)} bytes, expected {packed_size(self.pairs)}"
            )
        if self.failed:
            raise FitnessLogError(f"fitness log {self.path}: an earlier append failed")
        record = RECORD_HEAD.pack(step, len(packed)) + packed
        try:
            with open(self.path, "ab") as f:
                f.write(record + struct.pack(">I", zlib.crc32(record)))
                f.flush()
                os.fsync(f.fileno())
        except OSError:
            # What reached the disk is unknown and may not be retried: a failed fsync can
            # drop the dirty pages and report success next time (PostgreSQL's "fsyncgate").
            # Only reopening (which repairs the tail) makes the log usable again.
            self.failed = True
            raise
        self.steps += 1

    def tail_bytes(self, first: int) -> bytes:
        """The header and the raw records of steps `first`.. (a rewound tail's record)."""
        with open(self.path, "rb") as f:
            head = f.read(HEADER_SIZE)
            f.seek(HEADER_SIZE + first * self.record_size)
            return head + f.read((self.steps - first) * self.record_size)

    def truncate(self, steps: int) -> None:
        """Durably cut the log back to its first `steps` records (a rewind: the steps
        after them are undone). A failure leaves the log refusing appends, as `append`'s."""
        if not 0 <= steps <= self.steps:
            raise FitnessLogError(f"cannot cut the log to {steps} steps: it holds {self.steps}")
        try:
            with open(self.path, "r+b") as f:
                f.truncate(HEADER_SIZE + steps * self.record_size)
                os.fsync(f.fileno())
        except OSError:
            self.failed = True
            raise
        self.steps = steps

    def read(self, first: int, count: int) -> list[bytes]:
        """The packed fitness of steps [first, first + count), verified."""
        if first < 0 or count < 0 or first + count > self.steps:
            raise FitnessLogError(f"steps [{first}, {first + count}) are not all in the log")
        with open(self.path, "rb") as f:
            f.seek(HEADER_SIZE + first * self.record_size)
            data = f.read(count * self.record_size)
        return [self._parse_record(data, k * self.record_size, first + k) for k in range(count)]


def _has_zero_sector(record: bytes, offset: int) -> bool:
    """Whether the part of `record` (at file `offset`) inside any one 512-byte sector of the
    file is all zero: what a write that reached the disk by halves leaves."""
    cuts = [0, *range(SECTOR - offset % SECTOR, len(record), SECTOR), len(record)]
    return any(not any(record[a:b]) for a, b in itertools.pairwise(cuts) if b > a)


def intact_steps(path: str | Path) -> int | None:
    """How many records from the start of the fitness log at `path` verify: its steps, or
    for a log broken by a corrupt record those before it (None: no step can be read)."""
    try:
        return FitnessLog.open(path, repair=False, torn_ok=True).steps
    except FitnessLogError as exc:
        return exc.intact
    except OSError:
        return None
