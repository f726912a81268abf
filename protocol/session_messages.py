"""Session messages: the handshake (HELLO, CHALLENGE, AUTH, WELCOME), the job flow
(JOB_REQUEST, JOB, WAIT, RESULT, STEP) and what either side may send at any time
(HEARTBEAT, LOG, ERROR)."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import ClassVar, Self

import numpy as np
import numpy.typing as npt

from .codec import (
    _U8,
    _U16,
    _U32,
    _U64,
    Message,
    MsgType,
    _bytes_field,
    _encode_str,
    _enum_field,
    _fitness_field,
    _i64,
    _int_field,
    _invalid,
    _Reader,
    _str_field,
    _u8,
    _u32,
    _u64,
    clip_utf8,
)
from .errors import ErrorCode, ProtocolError
from .ternary import pack_ternary, unpack_ternary

__all__ = [
    "DIGEST_BYTES",
    "MAC_BYTES",
    "MAX_BACKEND_BYTES",
    "MAX_CHUNKS_PER_REQUEST",
    "MAX_CLAIMS_PER_CHUNK",
    "MAX_DEVICE_BYTES",
    "MAX_ERROR_MESSAGE_BYTES",
    "MAX_LOG_TEXT_BYTES",
    "MAX_WORKER_NAME_BYTES",
    "NONCE_BYTES",
    "NO_SNAPSHOT",
    "RUN_ID_BYTES",
    "Auth",
    "Challenge",
    "Claim",
    "Error",
    "Heartbeat",
    "Hello",
    "Job",
    "JobRequest",
    "Log",
    "LogLevel",
    "Result",
    "Step",
    "Wait",
    "Welcome",
]


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
NO_SNAPSHOT = -1  # WELCOME snapshot_step when no snapshot exists
# Chunks a worker may ask for at once (JOB_REQUEST max_chunks), and so the live leases it
# may hold: a fast device scores several chunks in one pass.
MAX_CHUNKS_PER_REQUEST = 16
MAX_CLAIMS_PER_CHUNK = 3  # distinct results of one chunk whose CLAIMs a checker is sent


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


@dataclass(frozen=True, slots=True)
class Wait(Message):
    """C->W: no work now; ask again after retry_after_ms."""

    TYPE: ClassVar[MsgType] = MsgType.WAIT
    _FIXED: ClassVar[struct.Struct] = _U32

    retry_after_ms: int

    def __post_init__(self) -> None:
        _u32(self, "retry_after_ms")


@dataclass(frozen=True, slots=True)
class Result(Message):
    """W->C: ternary fitness of one chunk, with the evaluating replica's digest.

    `fitness` holds the packed bytes (packed_size(pair_count) of them); use
    `fitness_values()` for the int8 array.
    """

    TYPE: ClassVar[MsgType] = MsgType.RESULT
    _FIXED: ClassVar[struct.Struct] = struct.Struct(">QIqQQI")
    _TAIL: ClassVar[bool] = True

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


@dataclass(frozen=True, slots=True)
class Claim(Message):
    """Both ways, in runs whose results are checked through their completions (a Hugging
    Face model's reward): W->C right before a RESULT, the token ids the chunk's members
    wrote, member-major, whose rewards that RESULT's fitness comes from; C->W right before
    a JOB, a result of that chunk to check, one CLAIM per result (in order of arrival).

    `tokens` holds u32 ids, big-endian; the receiver checks their count against the run's
    config (members x prompts x completion tokens) before it keeps them."""

    TYPE: ClassVar[MsgType] = MsgType.CLAIM
    _FIXED: ClassVar[struct.Struct] = struct.Struct(">QI")
    _TAIL: ClassVar[bool] = True

    step: int
    chunk: int
    tokens: bytes

    def __post_init__(self) -> None:
        _u64(self, "step")
        _u32(self, "chunk")
        if len(_bytes_field(self, "tokens")) % 4:
            raise _invalid(f"tokens is {len(self.tokens)} bytes, not a whole number of u32 ids")

    @classmethod
    def from_ids(cls, step: int, chunk: int, ids: npt.ArrayLike) -> Self:
        """From token ids (any shape; each 0..2**32 - 1), flattened in C order."""
        values = np.asarray(ids).reshape(-1)
        if values.size and (values.min() < 0 or values.max() > 0xFFFFFFFF):
            raise _invalid("token ids must be 0..2**32 - 1")
        return cls(step, chunk, values.astype(">u4").tobytes())

    def ids(self) -> npt.NDArray[np.int64]:
        """The token ids, flat (int64)."""
        return np.frombuffer(self.tokens, dtype=">u4").astype(np.int64)


@dataclass(frozen=True, slots=True)
class Step(Message):
    """C->W: step committed; packed fitness of the whole population of that step."""

    TYPE: ClassVar[MsgType] = MsgType.STEP
    _FIXED: ClassVar[struct.Struct] = struct.Struct(">QI")
    _TAIL: ClassVar[bool] = True

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


@dataclass(frozen=True, slots=True)
class Heartbeat(Message):
    """Both ways: liveness; sent_ms is the sender's clock in milliseconds."""

    TYPE: ClassVar[MsgType] = MsgType.HEARTBEAT
    _FIXED: ClassVar[struct.Struct] = _U64

    sent_ms: int

    def __post_init__(self) -> None:
        _u64(self, "sent_ms")


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
