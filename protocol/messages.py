"""Protocol messages: one frozen dataclass per message type, payload codecs, registry.

Every message validates its fields on construction, so an illegal message cannot be
built to be sent (LocalProtocolError, code MALFORMED). `decode` turns any defect in a
received payload (truncation, trailing bytes, bad UTF-8, out-of-range fields, bad ternary
bytes) into RemoteProtocolError(MALFORMED). Integers are big-endian; strings are a u16
byte length followed by UTF-8. Fixed-size fields come first in every payload, so the
offsets in SPEC.md are constant.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import operator
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, ClassVar, Self

import numpy as np
import numpy.typing as npt

from .errors import ErrorCode, LocalProtocolError, ProtocolError, RemoteProtocolError
from .frames import DEFAULT_MAX_PAYLOAD_BYTES, encode_frame
from .ternary import (
    TernaryError,
    check_packed,
    check_packed_rows,
    pack_ternary,
    packed_size,
    unpack_ternary,
)

__all__ = [
    "DIGEST_BYTES",
    "LATEST_SNAPSHOT",
    "MAC_BYTES",
    "MAX_BACKEND_BYTES",
    "MAX_CHUNKS_PER_REQUEST",
    "MAX_DEVICE_BYTES",
    "MAX_ERROR_MESSAGE_BYTES",
    "MAX_LOG_TEXT_BYTES",
    "MAX_SAMPLE_TEXT_BYTES",
    "MAX_SAMPLE_TOKENS",
    "MAX_WORKER_NAME_BYTES",
    "NONCE_BYTES",
    "NO_SNAPSHOT",
    "RUN_ID_BYTES",
    "SNAPSHOT_CHUNK_BYTES",
    "Auth",
    "Challenge",
    "Error",
    "FitnessRange",
    "FitnessRequest",
    "Heartbeat",
    "Hello",
    "Job",
    "JobRequest",
    "Log",
    "LogLevel",
    "Message",
    "MsgType",
    "Result",
    "Sample",
    "SampleText",
    "SnapshotChunk",
    "SnapshotRequest",
    "Step",
    "Validate",
    "Validation",
    "Wait",
    "Welcome",
    "auth_mac",
    "clip_utf8",
    "decode_message",
    "encode_message",
    "iter_snapshot_chunks",
    "message_class",
    "verify_mac",
]


class MsgType(IntEnum):
    """u8 message type in the frame header."""

    HELLO = 1
    CHALLENGE = 2
    AUTH = 3
    WELCOME = 4
    JOB_REQUEST = 5
    JOB = 6
    WAIT = 7
    RESULT = 8
    STEP = 9
    FITNESS_REQUEST = 10
    FITNESS_RANGE = 11
    SNAPSHOT_REQUEST = 12
    SNAPSHOT_CHUNK = 13
    HEARTBEAT = 14
    LOG = 15
    ERROR = 16
    VALIDATE = 17
    VALIDATION = 18
    SAMPLE = 19
    SAMPLE_TEXT = 20


class LogLevel(IntEnum):
    DEBUG = 0
    INFO = 1
    WARNING = 2
    ERROR = 3


DIGEST_BYTES = 32  # sha256 of the worker's data files
NONCE_BYTES = 32
MAC_BYTES = 32  # HMAC-SHA256
RUN_ID_BYTES = 16
MAX_WORKER_NAME_BYTES = 128
MAX_BACKEND_BYTES = 32
MAX_DEVICE_BYTES = 256
MAX_LOG_TEXT_BYTES = 4096
MAX_ERROR_MESSAGE_BYTES = 1024
LATEST_SNAPSHOT = 2**64 - 1  # SNAPSHOT_REQUEST step meaning "the newest snapshot you have"
NO_SNAPSHOT = -1  # WELCOME snapshot_step when no snapshot exists
SNAPSHOT_CHUNK_BYTES = 1 << 20
# SAMPLE bounds: a sample is a glance at the model, and its reply must stay small.
# Chunks a worker may ask for at once (JOB_REQUEST max_chunks), and so the live leases it
# may hold: a fast device scores several chunks in one pass.
MAX_CHUNKS_PER_REQUEST = 16
MAX_SAMPLE_TOKENS = 1024
MAX_SAMPLE_TEXT_BYTES = 16384
MAX_SAMPLE_TEMPERATURE = 100_000  # thousandths
MAX_SAMPLE_PENALTY = 100_000  # thousandths of a bit
MAX_SAMPLE_TOP_K = 1 << 20

_U8 = struct.Struct(">B")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")


# ---------------------------------------------------------------------------------------
# Field validation. Each helper checks one field and stores its normalized value (plain
# int, bytes, enum member) back on the frozen instance.


def _invalid(message: str) -> LocalProtocolError:
    return LocalProtocolError(ErrorCode.MALFORMED, message)


def _set(obj: object, name: str, value: object) -> None:
    object.__setattr__(obj, name, value)


def _int_field(obj: object, name: str, lo: int, hi: int) -> int:
    raw = getattr(obj, name)
    try:
        value = operator.index(raw)
    except TypeError:
        raise _invalid(f"{name} must be an integer, got {type(raw).__name__}") from None
    if not lo <= value <= hi:
        raise _invalid(f"{name}={value} is outside [{lo}, {hi}]")
    _set(obj, name, value)
    return value


def _u8(obj: object, name: str) -> int:
    return _int_field(obj, name, 0, 0xFF)


def _u16(obj: object, name: str) -> int:
    return _int_field(obj, name, 0, 0xFFFF)


def _u32(obj: object, name: str) -> int:
    return _int_field(obj, name, 0, 0xFFFFFFFF)


def _u64(obj: object, name: str) -> int:
    return _int_field(obj, name, 0, 2**64 - 1)


def _i64(obj: object, name: str) -> int:
    return _int_field(obj, name, -(2**63), 2**63 - 1)


def _bytes_field(obj: object, name: str, size: int | None = None) -> bytes:
    raw = getattr(obj, name)
    if not isinstance(raw, bytes | bytearray | memoryview):
        raise _invalid(f"{name} must be bytes, got {type(raw).__name__}")
    value = bytes(raw)
    if size is not None and len(value) != size:
        raise _invalid(f"{name} must be {size} bytes, got {len(value)}")
    _set(obj, name, value)
    return value


def _str_field(obj: object, name: str, max_bytes: int) -> None:
    value = getattr(obj, name)
    if not isinstance(value, str):
        raise _invalid(f"{name} must be a str, got {type(value).__name__}")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise _invalid(f"{name} is not encodable as UTF-8") from None
    if size > max_bytes:
        raise _invalid(f"{name} is {size} bytes of UTF-8, the limit is {max_bytes}")


def _enum_field(obj: object, name: str, enum: type[IntEnum]) -> None:
    raw = getattr(obj, name)
    try:
        _set(obj, name, enum(operator.index(raw)))
    except (TypeError, ValueError):
        raise _invalid(f"{name}={raw!r} is not a valid {enum.__name__}") from None


def _fitness_field(obj: object, name: str, count: int) -> None:
    data = _bytes_field(obj, name)
    try:
        check_packed(data, count)
    except TernaryError as exc:
        raise _invalid(f"{name}: {exc}") from None


def _encode_str(value: str) -> bytes:
    data = value.encode("utf-8")
    return _U16.pack(len(data)) + data


def clip_utf8(text: str, max_bytes: int) -> str:
    """Longest prefix of `text` whose UTF-8 encoding fits in `max_bytes`."""
    data = text.encode("utf-8", errors="replace")
    if len(data) <= max_bytes:
        return data.decode("utf-8")
    # Dropping a partial multi-byte character at the cut keeps the result valid UTF-8.
    return data[:max_bytes].decode("utf-8", errors="ignore")


# ---------------------------------------------------------------------------------------
# Payload reader used by every decode.


class _Reader:
    """Sequential reader over one payload; every shortfall raises ValueError."""

    __slots__ = ("_data", "_pos")

    def __init__(self, data: bytes) -> None:
        self._data = data
        self._pos = 0

    def fields(self, layout: struct.Struct) -> tuple[Any, ...]:
        end = self._pos + layout.size
        if end > len(self._data):
            raise ValueError(f"truncated: {len(self._data)} bytes")
        values = layout.unpack_from(self._data, self._pos)
        self._pos = end
        return values

    def raw(self, size: int) -> bytes:
        end = self._pos + size
        if end > len(self._data):
            raise ValueError(f"truncated: {len(self._data)} bytes, need {end}")
        value = bytes(self._data[self._pos : end])
        self._pos = end
        return value

    def string(self) -> str:
        (size,) = self.fields(_U16)
        return self.raw(size).decode("utf-8")  # UnicodeDecodeError is a ValueError

    def rest(self) -> bytes:
        value = bytes(self._data[self._pos :])
        self._pos = len(self._data)
        return value

    def finish(self) -> None:
        if self._pos != len(self._data):
            raise ValueError(f"{len(self._data) - self._pos} trailing bytes")


# ---------------------------------------------------------------------------------------
# Messages.


class Message:
    """Base of all messages: `TYPE`, `encode()` (payload only) and `decode(payload)`."""

    __slots__ = ()
    TYPE: ClassVar[MsgType]

    def encode(self) -> bytes:
        raise NotImplementedError

    @classmethod
    def decode(cls, payload: bytes) -> Self:
        """Parse a payload; any defect raises RemoteProtocolError(MALFORMED)."""
        reader = _Reader(payload)
        try:
            message = cls._read(reader)
            reader.finish()
        except (ValueError, ProtocolError) as exc:
            detail = exc.message if isinstance(exc, ProtocolError) else str(exc)
            raise RemoteProtocolError(
                ErrorCode.MALFORMED, f"malformed {cls.TYPE.name}: {detail}"
            ) from exc
        return message

    @classmethod
    def _read(cls, reader: _Reader) -> Self:
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class Hello(Message):
    """W->C: first message; who the worker is and which data it holds."""

    TYPE: ClassVar[MsgType] = MsgType.HELLO
    _FIXED: ClassVar[struct.Struct] = struct.Struct(f">B{DIGEST_BYTES}s")

    protocol_version: int
    worker_name: str
    backend: str
    device: str
    data_digest: bytes

    def __post_init__(self) -> None:
        _u8(self, "protocol_version")
        _str_field(self, "worker_name", MAX_WORKER_NAME_BYTES)
        _str_field(self, "backend", MAX_BACKEND_BYTES)
        _str_field(self, "device", MAX_DEVICE_BYTES)
        _bytes_field(self, "data_digest", DIGEST_BYTES)

    def encode(self) -> bytes:
        return b"".join(
            (
                self._FIXED.pack(self.protocol_version, self.data_digest),
                _encode_str(self.worker_name),
                _encode_str(self.backend),
                _encode_str(self.device),
            )
        )

    @classmethod
    def _read(cls, reader: _Reader) -> Self:
        version, digest = reader.fields(cls._FIXED)
        name, backend, device = reader.string(), reader.string(), reader.string()
        return cls(version, name, backend, device, digest)


@dataclass(frozen=True, slots=True)
class Challenge(Message):
    """C->W: random nonce the worker must MAC with the shared token."""

    TYPE: ClassVar[MsgType] = MsgType.CHALLENGE

    nonce: bytes

    def __post_init__(self) -> None:
        _bytes_field(self, "nonce", NONCE_BYTES)

    def encode(self) -> bytes:
        return self.nonce

    @classmethod
    def _read(cls, reader: _Reader) -> Self:
        return cls(reader.raw(NONCE_BYTES))


@dataclass(frozen=True, slots=True)
class Auth(Message):
    """W->C: HMAC-SHA256(key=token, msg=nonce); see `auth_mac`."""

    TYPE: ClassVar[MsgType] = MsgType.AUTH

    mac: bytes

    def __post_init__(self) -> None:
        _bytes_field(self, "mac", MAC_BYTES)

    def encode(self) -> bytes:
        return self.mac

    @classmethod
    def _read(cls, reader: _Reader) -> Self:
        return cls(reader.raw(MAC_BYTES))


@dataclass(frozen=True, slots=True)
class Welcome(Message):
    """C->W: handshake accepted; the run the worker joins and where it stands."""

    TYPE: ClassVar[MsgType] = MsgType.WELCOME
    _FIXED: ClassVar[struct.Struct] = struct.Struct(f">{RUN_ID_BYTES}sQqII")

    run_id: bytes
    config_bytes: bytes  # canonical run-config JSON, opaque to the protocol
    current_step: int  # steps committed so far
    snapshot_step: int  # step of the newest snapshot, NO_SNAPSHOT (-1) if none
    pairs_per_step: int

    def __post_init__(self) -> None:
        _bytes_field(self, "run_id", RUN_ID_BYTES)
        _bytes_field(self, "config_bytes")
        _u64(self, "current_step")
        _int_field(self, "snapshot_step", NO_SNAPSHOT, 2**63 - 1)
        _u32(self, "pairs_per_step")
        if len(self.config_bytes) > 0xFFFFFFFF:
            raise _invalid("config_bytes longer than a u32 length allows")

    def encode(self) -> bytes:
        fixed = self._FIXED.pack(
            self.run_id,
            self.current_step,
            self.snapshot_step,
            self.pairs_per_step,
            len(self.config_bytes),
        )
        return fixed + self.config_bytes

    @classmethod
    def _read(cls, reader: _Reader) -> Self:
        run_id, current, snapshot, pairs, config_size = reader.fields(cls._FIXED)
        return cls(run_id, reader.raw(config_size), current, snapshot, pairs)


@dataclass(frozen=True, slots=True)
class JobRequest(Message):
    """W->C: ask for work, reporting the replica: steps applied, its digest, and how many
    weights the last applied update changed (0 before any); and how many chunks the worker
    scores at once (1..MAX_CHUNKS_PER_REQUEST)."""

    TYPE: ClassVar[MsgType] = MsgType.JOB_REQUEST
    _FIXED: ClassVar[struct.Struct] = struct.Struct(">QQQI")

    replica_step: int
    replica_digest: int = 0
    weights_changed: int = 0
    max_chunks: int = 1

    def __post_init__(self) -> None:
        _u64(self, "replica_step")
        _u64(self, "replica_digest")
        _u64(self, "weights_changed")
        chunks = _u32(self, "max_chunks")
        if not 1 <= chunks <= MAX_CHUNKS_PER_REQUEST:
            raise _invalid(f"max_chunks={chunks} must be 1..{MAX_CHUNKS_PER_REQUEST}")

    def encode(self) -> bytes:
        return self._FIXED.pack(
            self.replica_step, self.replica_digest, self.weights_changed, self.max_chunks
        )

    @classmethod
    def _read(cls, reader: _Reader) -> Self:
        return cls(*reader.fields(cls._FIXED))


@dataclass(frozen=True, slots=True)
class Job(Message):
    """C->W: evaluate members [first_member, first_member + member_count) of `step`; `more`
    JOBs answering the same JOB_REQUEST follow this one (0: the last).

    Members come in antithetic pairs (2p, 2p + 1), so both numbers are even.
    """

    TYPE: ClassVar[MsgType] = MsgType.JOB
    _FIXED: ClassVar[struct.Struct] = struct.Struct(">QIQII")

    step: int
    chunk: int
    first_member: int
    member_count: int
    more: int = 0

    def __post_init__(self) -> None:
        _u64(self, "step")
        _u32(self, "chunk")
        first = _u64(self, "first_member")
        count = _u32(self, "member_count")
        if first % 2 or count % 2:
            raise _invalid(f"first_member={first} and member_count={count} must be even")
        if count == 0:
            raise _invalid("member_count must be > 0")
        if first + count > 2**64:
            raise _invalid("member range exceeds u64")
        if _u32(self, "more") >= MAX_CHUNKS_PER_REQUEST:
            raise _invalid(f"more={self.more} must be below {MAX_CHUNKS_PER_REQUEST}")

    @property
    def first_pair(self) -> int:
        return self.first_member // 2

    @property
    def pair_count(self) -> int:
        return self.member_count // 2

    def encode(self) -> bytes:
        return self._FIXED.pack(
            self.step, self.chunk, self.first_member, self.member_count, self.more
        )

    @classmethod
    def _read(cls, reader: _Reader) -> Self:
        return cls(*reader.fields(cls._FIXED))


@dataclass(frozen=True, slots=True)
class Wait(Message):
    """C->W: no work now; ask again after retry_after_ms."""

    TYPE: ClassVar[MsgType] = MsgType.WAIT

    retry_after_ms: int

    def __post_init__(self) -> None:
        _u32(self, "retry_after_ms")

    def encode(self) -> bytes:
        return _U32.pack(self.retry_after_ms)

    @classmethod
    def _read(cls, reader: _Reader) -> Self:
        return cls(*reader.fields(_U32))


@dataclass(frozen=True, slots=True)
class Result(Message):
    """W->C: ternary fitness of one chunk, with the evaluating replica's digest.

    `fitness` holds the packed bytes (packed_size(pair_count) of them); use
    `fitness_values()` for the int8 array.
    """

    TYPE: ClassVar[MsgType] = MsgType.RESULT
    _FIXED: ClassVar[struct.Struct] = struct.Struct(">QIqQQI")

    step: int
    chunk: int
    loss_sum: int
    weights_changed: int  # weights changed by the update that produced the replica
    replica_digest: int
    pair_count: int
    fitness: bytes

    def __post_init__(self) -> None:
        _u64(self, "step")
        _u32(self, "chunk")
        _i64(self, "loss_sum")
        _u64(self, "weights_changed")
        _u64(self, "replica_digest")
        count = _u32(self, "pair_count")
        _fitness_field(self, "fitness", count)

    @classmethod
    def from_values(
        cls,
        *,
        step: int,
        chunk: int,
        loss_sum: int,
        weights_changed: int,
        replica_digest: int,
        fitness: npt.ArrayLike,
    ) -> Self:
        """Build from an unpacked -1/0/+1 fitness array (one value per pair)."""
        values = np.asarray(fitness)
        count = int(values.shape[0]) if values.ndim == 1 else -1
        return cls(
            step, chunk, loss_sum, weights_changed, replica_digest, count, pack_ternary(values)
        )

    def fitness_values(self) -> npt.NDArray[np.int8]:
        return unpack_ternary(self.fitness, self.pair_count)

    def encode(self) -> bytes:
        fixed = self._FIXED.pack(
            self.step,
            self.chunk,
            self.loss_sum,
            self.weights_changed,
            self.replica_digest,
            self.pair_count,
        )
        return fixed + self.fitness

    @classmethod
    def _read(cls, reader: _Reader) -> Self:
        return cls(*reader.fields(cls._FIXED), reader.rest())


@dataclass(frozen=True, slots=True)
class Step(Message):
    """C->W: step committed; packed fitness of the whole population of that step."""

    TYPE: ClassVar[MsgType] = MsgType.STEP
    _FIXED: ClassVar[struct.Struct] = struct.Struct(">QI")

    step: int
    pair_count: int
    fitness: bytes

    def __post_init__(self) -> None:
        _u64(self, "step")
        count = _u32(self, "pair_count")
        _fitness_field(self, "fitness", count)

    @classmethod
    def from_values(cls, step: int, fitness: npt.ArrayLike) -> Self:
        values = np.asarray(fitness)
        count = int(values.shape[0]) if values.ndim == 1 else -1
        return cls(step, count, pack_ternary(values))

    def fitness_values(self) -> npt.NDArray[np.int8]:
        return unpack_ternary(self.fitness, self.pair_count)

    def encode(self) -> bytes:
        return self._FIXED.pack(self.step, self.pair_count) + self.fitness

    @classmethod
    def _read(cls, reader: _Reader) -> Self:
        return cls(*reader.fields(cls._FIXED), reader.rest())


@dataclass(frozen=True, slots=True)
class FitnessRequest(Message):
    """W->C: send committed fitness for steps first_step, first_step + 1, ... (catch-up)."""

    TYPE: ClassVar[MsgType] = MsgType.FITNESS_REQUEST
    _FIXED: ClassVar[struct.Struct] = struct.Struct(">QI")

    first_step: int
    max_steps: int

    def __post_init__(self) -> None:
        _u64(self, "first_step")
        if _u32(self, "max_steps") == 0:
            raise _invalid("max_steps must be > 0")

    def encode(self) -> bytes:
        return self._FIXED.pack(self.first_step, self.max_steps)

    @classmethod
    def _read(cls, reader: _Reader) -> Self:
        return cls(*reader.fields(cls._FIXED))


@dataclass(frozen=True, slots=True)
class FitnessRange(Message):
    """C->W: packed fitness of step_count consecutive steps, concatenated.

    Each step takes packed_size(pairs_per_step) bytes; `split()` returns them per step.
    """

    TYPE: ClassVar[MsgType] = MsgType.FITNESS_RANGE
    _FIXED: ClassVar[struct.Struct] = struct.Struct(">QII")

    first_step: int
    step_count: int
    pairs_per_step: int
    fitness: bytes

    def __post_init__(self) -> None:
        first = _u64(self, "first_step")
        rows = _u32(self, "step_count")
        count = _u32(self, "pairs_per_step")
        data = _bytes_field(self, "fitness")
        if rows and first + rows - 1 > 2**64 - 1:
            raise _invalid("step range exceeds u64")
        try:
            check_packed_rows(data, rows, count)
        except TernaryError as exc:
            raise _invalid(f"fitness: {exc}") from None

    @classmethod
    def from_steps(cls, first_step: int, pairs_per_step: int, packed: Sequence[bytes]) -> Self:
        """Build from per-step packed fitness (each packed_size(pairs_per_step) bytes)."""
        return cls(first_step, len(packed), pairs_per_step, b"".join(packed))

    @staticmethod
    def max_steps_per_frame(
        pairs_per_step: int, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    ) -> int:
        """Most steps one FITNESS_RANGE can carry within the payload limit."""
        size = packed_size(pairs_per_step)
        room = max(0, max_payload_bytes - FitnessRange._FIXED.size)
        return 0xFFFFFFFF if size == 0 else min(0xFFFFFFFF, room // size)

    def split(self) -> list[bytes]:
        """Packed fitness of each step, in order."""
        size = packed_size(self.pairs_per_step)
        data = self.fitness
        return [data[i * size : (i + 1) * size] for i in range(self.step_count)]

    def fitness_values(self) -> npt.NDArray[np.int8]:
        """All values as a (step_count, pairs_per_step) int8 array."""
        rows = [unpack_ternary(part, self.pairs_per_step) for part in self.split()]
        if not rows:
            return np.zeros((0, self.pairs_per_step), dtype=np.int8)
        return np.stack(rows)

    def encode(self) -> bytes:
        fixed = self._FIXED.pack(self.first_step, self.step_count, self.pairs_per_step)
        return fixed + self.fitness

    @classmethod
    def _read(cls, reader: _Reader) -> Self:
        return cls(*reader.fields(cls._FIXED), reader.rest())


@dataclass(frozen=True, slots=True)
class SnapshotRequest(Message):
    """Both ways. C->W: stream your state at `step`. W->C: send a snapshot, where
    step == LATEST_SNAPSHOT asks for the newest one."""

    TYPE: ClassVar[MsgType] = MsgType.SNAPSHOT_REQUEST

    step: int

    def __post_init__(self) -> None:
        _u64(self, "step")

    def encode(self) -> bytes:
        return _U64.pack(self.step)

    @classmethod
    def _read(cls, reader: _Reader) -> Self:
        return cls(*reader.fields(_U64))


@dataclass(frozen=True, slots=True)
class SnapshotChunk(Message):
    """Both ways: bytes [offset, offset + len(data)) of a snapshot of total_bytes."""

    TYPE: ClassVar[MsgType] = MsgType.SNAPSHOT_CHUNK
    _FIXED: ClassVar[struct.Struct] = struct.Struct(">QQQ")

    step: int
    total_bytes: int
    offset: int
    data: bytes

    def __post_init__(self) -> None:
        _u64(self, "step")
        total = _u64(self, "total_bytes")
        offset = _u64(self, "offset")
        data = _bytes_field(self, "data")
        if offset + len(data) > total:
            raise _invalid(f"offset {offset} + {len(data)} bytes runs past total_bytes {total}")

    @property
    def is_last(self) -> bool:
        return self.offset + len(self.data) == self.total_bytes

    def encode(self) -> bytes:
        return self._FIXED.pack(self.step, self.total_bytes, self.offset) + self.data

    @classmethod
    def _read(cls, reader: _Reader) -> Self:
        return cls(*reader.fields(cls._FIXED), reader.rest())


@dataclass(frozen=True, slots=True)
class Heartbeat(Message):
    """Both ways: liveness; sent_ms is the sender's clock in milliseconds."""

    TYPE: ClassVar[MsgType] = MsgType.HEARTBEAT

    sent_ms: int

    def __post_init__(self) -> None:
        _u64(self, "sent_ms")

    def encode(self) -> bytes:
        return _U64.pack(self.sent_ms)

    @classmethod
    def _read(cls, reader: _Reader) -> Self:
        return cls(*reader.fields(_U64))


@dataclass(frozen=True, slots=True)
class Log(Message):
    """W->C: a log line for the coordinator's log (text at most 4096 UTF-8 bytes)."""

    TYPE: ClassVar[MsgType] = MsgType.LOG

    level: LogLevel
    text: str

    def __post_init__(self) -> None:
        _enum_field(self, "level", LogLevel)
        _str_field(self, "text", MAX_LOG_TEXT_BYTES)

    def encode(self) -> bytes:
        return _U8.pack(self.level) + _encode_str(self.text)

    @classmethod
    def _read(cls, reader: _Reader) -> Self:
        (level,) = reader.fields(_U8)
        return cls(level, reader.string())


@dataclass(frozen=True, slots=True)
class Error(Message):
    """Both ways: the sender closes the connection because of `code`."""

    TYPE: ClassVar[MsgType] = MsgType.ERROR

    code: ErrorCode
    message: str

    def __post_init__(self) -> None:
        _enum_field(self, "code", ErrorCode)
        _str_field(self, "message", MAX_ERROR_MESSAGE_BYTES)

    @classmethod
    def from_exception(cls, exc: ProtocolError) -> Self:
        code = exc.error_code if isinstance(exc.error_code, ErrorCode) else ErrorCode.INTERNAL
        return cls(code, clip_utf8(exc.message, MAX_ERROR_MESSAGE_BYTES))

    def encode(self) -> bytes:
        return _U16.pack(self.code) + _encode_str(self.message)

    @classmethod
    def _read(cls, reader: _Reader) -> Self:
        (code,) = reader.fields(_U16)
        return cls(code, reader.string())


@dataclass(frozen=True, slots=True)
class Validate(Message):
    """C->W: score your unperturbed replica at `step` on the held-out split."""

    TYPE: ClassVar[MsgType] = MsgType.VALIDATE

    step: int

    def __post_init__(self) -> None:
        _u64(self, "step")

    def encode(self) -> bytes:
        return _U64.pack(self.step)

    @classmethod
    def _read(cls, reader: _Reader) -> Self:
        return cls(*reader.fields(_U64))


@dataclass(frozen=True, slots=True)
class Validation(Message):
    """W->C: held-out scores of the replica at `step` (float64, reporting only), two metrics
    over the same target tokens: windows of seq_len + 1 tokens from a zero state, and long
    streams with the recurrent state carried (`stream_tokens` 0: the model has none). Each
    gives the tokens predicted, the bytes of text they decode to, the mean integer loss
    (1/16 bit) and true bits per token; bits per byte follow from these. A reward run adds
    the mean reward of `reward_prompts` held-out prompts (0 prompts: none)."""

    TYPE: ClassVar[MsgType] = MsgType.VALIDATION
    _FIXED: ClassVar[struct.Struct] = struct.Struct(">QQddQQddQQd")

    step: int
    tokens: int
    loss_16: float
    bits_per_token: float
    text_bytes: int = 0
    stream_tokens: int = 0
    stream_loss_16: float = 0.0
    stream_bits_per_token: float = 0.0
    stream_text_bytes: int = 0
    reward_prompts: int = 0
    reward: float = 0.0

    def __post_init__(self) -> None:
        names = ("step", "tokens", "text_bytes", "stream_tokens", "stream_text_bytes")
        for name in (*names, "reward_prompts"):
            _u64(self, name)
        if not isinstance(self.reward, float | int) or not math.isfinite(self.reward):
            raise _invalid(f"reward must be a finite number, got {self.reward!r}")
        object.__setattr__(self, "reward", float(self.reward))
        if self.reward_prompts == 0 and self.reward:
            raise _invalid("reward_prompts is 0 but reward is not")
        for name in ("loss_16", "bits_per_token", "stream_loss_16", "stream_bits_per_token"):
            value = getattr(self, name)
            if not isinstance(value, float | int) or not math.isfinite(value) or value < 0:
                raise _invalid(f"{name} must be a finite number >= 0, got {value!r}")
            object.__setattr__(self, name, float(value))
        for prefix in ("", "stream_"):
            if getattr(self, prefix + "tokens") == 0 and (
                getattr(self, prefix + "text_bytes")
                or getattr(self, prefix + "loss_16")
                or getattr(self, prefix + "bits_per_token")
            ):
                raise _invalid(f"{prefix}tokens is 0 but its other fields are not")

    @property
    def bits_per_byte(self) -> float | None:
        """Window bits per byte of the held-out text; None where the tokens decode to none.
        The ratio first, so that one byte per token gives bits per token exactly."""
        if not self.text_bytes:
            return None
        return self.bits_per_token * (self.tokens / self.text_bytes)

    @property
    def stream_bits_per_byte(self) -> float | None:
        if not self.stream_text_bytes:
            return None
        return self.stream_bits_per_token * (self.stream_tokens / self.stream_text_bytes)

    def encode(self) -> bytes:
        return self._FIXED.pack(
            self.step,
            self.tokens,
            self.loss_16,
            self.bits_per_token,
            self.text_bytes,
            self.stream_tokens,
            self.stream_loss_16,
            self.stream_bits_per_token,
            self.stream_text_bytes,
            self.reward_prompts,
            self.reward,
        )

    @classmethod
    def _read(cls, reader: _Reader) -> Self:
        return cls(*reader.fields(cls._FIXED))


@dataclass(frozen=True, slots=True)
class Sample(Message):
    """C->W: write a sample with your unperturbed replica at `step`: continue the first
    `prompt_tokens` tokens of held-out document `prompt_index` by `new_tokens` tokens with
    these settings (thousandths, as the sampler takes them) and `seed`."""

    TYPE: ClassVar[MsgType] = MsgType.SAMPLE
    _FIXED: ClassVar[struct.Struct] = struct.Struct(">QQIHHIIIII")

    step: int
    seed: int
    prompt_index: int
    prompt_tokens: int
    new_tokens: int
    temperature: int
    min_p: int
    top_k: int
    presence_penalty: int
    frequency_penalty: int

    def __post_init__(self) -> None:
        _u64(self, "step")
        _u64(self, "seed")
        _u32(self, "prompt_index")
        _int_field(self, "prompt_tokens", 0, MAX_SAMPLE_TOKENS)
        _int_field(self, "new_tokens", 1, MAX_SAMPLE_TOKENS)
        _int_field(self, "temperature", 0, MAX_SAMPLE_TEMPERATURE)
        _int_field(self, "min_p", 0, 1000)
        _int_field(self, "top_k", 0, MAX_SAMPLE_TOP_K)
        _int_field(self, "presence_penalty", 0, MAX_SAMPLE_PENALTY)
        _int_field(self, "frequency_penalty", 0, MAX_SAMPLE_PENALTY)

    def encode(self) -> bytes:
        return self._FIXED.pack(
            self.step,
            self.seed,
            self.prompt_index,
            self.prompt_tokens,
            self.new_tokens,
            self.temperature,
            self.min_p,
            self.top_k,
            self.presence_penalty,
            self.frequency_penalty,
        )

    @classmethod
    def _read(cls, reader: _Reader) -> Self:
        return cls(*reader.fields(cls._FIXED))


@dataclass(frozen=True, slots=True)
class SampleText(Message):
    """W->C: the sample asked for by SAMPLE(step, seed): the prompt and the continuation
    as the vocabulary's bytes (not necessarily UTF-8; the receiver escapes before display),
    each at most MAX_SAMPLE_TEXT_BYTES."""

    TYPE: ClassVar[MsgType] = MsgType.SAMPLE_TEXT
    _FIXED: ClassVar[struct.Struct] = struct.Struct(">QQ")

    step: int
    seed: int
    prompt: bytes
    text: bytes

    def __post_init__(self) -> None:
        _u64(self, "step")
        _u64(self, "seed")
        for name in ("prompt", "text"):
            size = len(_bytes_field(self, name))
            if size > MAX_SAMPLE_TEXT_BYTES:
                raise _invalid(f"{name} is {size} bytes, the limit is {MAX_SAMPLE_TEXT_BYTES}")

    def encode(self) -> bytes:
        return (
            self._FIXED.pack(self.step, self.seed)
            + _U16.pack(len(self.prompt))
            + self.prompt
            + _U16.pack(len(self.text))
            + self.text
        )

    @classmethod
    def _read(cls, reader: _Reader) -> Self:
        step, seed = reader.fields(cls._FIXED)
        (prompt_size,) = reader.fields(_U16)
        prompt = reader.raw(prompt_size)
        (text_size,) = reader.fields(_U16)
        return cls(step, seed, prompt, reader.raw(text_size))


# ---------------------------------------------------------------------------------------
# Registry and helpers.

_CLASSES: dict[int, type[Message]] = {
    cls.TYPE: cls
    for cls in (
        Hello,
        Challenge,
        Auth,
        Welcome,
        JobRequest,
        Job,
        Wait,
        Result,
        Step,
        FitnessRequest,
        FitnessRange,
        SnapshotRequest,
        SnapshotChunk,
        Heartbeat,
        Log,
        Error,
        Validate,
        Validation,
        Sample,
        SampleText,
    )
}
assert sorted(_CLASSES) == sorted(MsgType), "every MsgType needs exactly one class"


def message_class(msg_type: int) -> type[Message]:
    """Class for a message type; RemoteProtocolError(UNKNOWN_TYPE) if there is none."""
    cls = _CLASSES.get(msg_type)
    if cls is None:
        raise RemoteProtocolError(ErrorCode.UNKNOWN_TYPE, f"unknown message type {msg_type}")
    return cls


def decode_message(msg_type: int, payload: bytes) -> Message:
    """Decode a payload of the given type (UNKNOWN_TYPE / MALFORMED on failure)."""
    return message_class(msg_type).decode(payload)


def encode_message(message: Message) -> bytes:
    """Complete frame (header + payload) for a message."""
    return encode_frame(message.TYPE, message.encode())


def auth_mac(token: bytes, nonce: bytes) -> bytes:
    """HMAC-SHA256 of the challenge nonce, keyed with the shared token."""
    return hmac.new(token, nonce, hashlib.sha256).digest()


def verify_mac(token: bytes, nonce: bytes, mac: bytes) -> bool:
    """Constant-time check of an AUTH mac against the expected one."""
    return hmac.compare_digest(auth_mac(token, nonce), mac)


def iter_snapshot_chunks(
    step: int, blob: bytes, chunk_bytes: int = SNAPSHOT_CHUNK_BYTES
) -> Iterator[SnapshotChunk]:
    """Split a snapshot into SNAPSHOT_CHUNK messages of at most chunk_bytes data each.

    An empty blob still yields one (empty) chunk so the receiver learns total_bytes = 0.
    """
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be > 0")
    total = len(blob)
    offset = 0
    while True:
        piece = blob[offset : offset + chunk_bytes]
        yield SnapshotChunk(step, total, offset, piece)
        offset += len(piece)
        if offset >= total:
            return
