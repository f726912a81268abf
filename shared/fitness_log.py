"""The fitness log: the training run itself, one record per committed step, append-only.

Replaying the log from step 0 reproduces the replica bit for bit (`shared.replica.replay`). The
payload of a record is the step's ternary-packed fitness, opaque here. Layout, big-endian:

    header (52 bytes): magic b"EGGFLOG\\0" | format u32 (1) | pairs per step u32 |
                       config digest (32 B) | CRC-32 of the preceding 48 bytes (u32)
    record k:          step u64 (== k) | length u32 | payload | CRC-32 of step..payload

Every record has the same size, so step k is at a fixed offset. `append` fsyncs before it
returns: a step is committed once its record is on disk. A torn last record (a crash in the
middle of an append, never acknowledged) is cut off when the log is opened; a bad record
anywhere else is corruption and an error.
"""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path

MAGIC = b"EGGFLOG\0"
FORMAT_VERSION = 1
HEADER = struct.Struct(">8sII32s")
HEADER_SIZE = HEADER.size + 4
RECORD_HEAD = struct.Struct(">QI")


class FitnessLogError(ValueError):
    """A fitness log that is corrupt or belongs to another run."""


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

    @classmethod
    def create(cls, path: str | Path, pairs: int, config_digest: bytes) -> FitnessLog:
        path = Path(path)
        head = HEADER.pack(MAGIC, FORMAT_VERSION, pairs, config_digest)
        with open(path, "xb") as f:
            f.write(head + struct.pack(">I", zlib.crc32(head)))
            f.flush()
            os.fsync(f.fileno())
        return cls(path, pairs, config_digest, 0, 0)

    @classmethod
    def open(cls, path: str | Path, repair: bool = True) -> FitnessLog:
        """Open and verify a log; with `repair`, cut off a torn last record."""
        path = Path(path)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise FitnessLogError(f"fitness log {path} does not exist") from None
        if len(data) < HEADER_SIZE:
            raise FitnessLogError(f"fitness log {path} is too short to hold a header")
        magic, version, pairs, digest = HEADER.unpack_from(data)
        (crc,) = struct.unpack_from(">I", data, HEADER.size)
        if magic != MAGIC or zlib.crc32(data[: HEADER.size]) != crc:
            raise FitnessLogError(f"{path} is not a fitness log (bad magic or header CRC)")
        if version != FORMAT_VERSION:
            raise FitnessLogError(f"fitness log {path} has format {version}, expected 1")
        log = cls(path, pairs, digest, 0, 0)
        body = len(data) - HEADER_SIZE
        whole, torn = divmod(body, log.record_size)
        for k in range(whole):
            log._parse_record(data, HEADER_SIZE + k * log.record_size, k)
        if torn:
            if not repair:
                raise FitnessLogError(f"fitness log {path} ends in a torn record")
            with open(path, "r+b") as f:
                f.truncate(HEADER_SIZE + whole * log.record_size)
                os.fsync(f.fileno())
        log.steps, log.repaired_bytes = whole, torn
        return log

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
        record = RECORD_HEAD.pack(step, len(packed)) + packed
        with open(self.path, "ab") as f:
            f.write(record + struct.pack(">I", zlib.crc32(record)))
            f.flush()
            os.fsync(f.fileno())
        self.steps += 1

    def read(self, first: int, count: int) -> list[bytes]:
        """The packed fitness of steps [first, first + count), verified."""
        if first < 0 or count < 0 or first + count > self.steps:
            raise FitnessLogError(f"steps [{first}, {first + count}) are not all in the log")
        with open(self.path, "rb") as f:
            f.seek(HEADER_SIZE + first * self.record_size)
            data = f.read(count * self.record_size)
        return [self._parse_record(data, k * self.record_size, first + k) for k in range(count)]
