"""Replica messages: bringing a worker's replica up to date (FITNESS_REQUEST,
FITNESS_RANGE, SNAPSHOT_REQUEST, SNAPSHOT_CHUNK) and asking it for held-out scores
(VALIDATE, VALIDATION) and samples (SAMPLE, SAMPLE_TEXT)."""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar, Self

import numpy as np
import numpy.typing as npt

from .codec import (
    _U16,
    _U64,
    Message,
    MsgType,
    _bytes_field,
    _int_field,
    _invalid,
    _Reader,
    _u32,
    _u64,
)
from .frames import DEFAULT_MAX_PAYLOAD_BYTES
from .ternary import TernaryError, check_packed_rows, packed_size, unpack_ternary

__all__ = [
    "LATEST_SNAPSHOT",
    "MAX_SAMPLE_TEXT_BYTES",
    "MAX_SAMPLE_TOKENS",
    "SNAPSHOT_CHUNK_BYTES",
    "FitnessRange",
    "FitnessRequest",
    "Sample",
    "SampleText",
    "SnapshotChunk",
    "SnapshotRequest",
    "Validate",
    "Validation",
    "bits_per_byte",
    "iter_snapshot_chunks",
]

LATEST_SNAPSHOT = 2**64 - 1  # SNAPSHOT_REQUEST step meaning "the newest snapshot you have"
SNAPSHOT_CHUNK_BYTES = 1 << 20
# SAMPLE bounds: a sample is a glance at the model, and its reply must stay small.
MAX_SAMPLE_TOKENS = 1024
MAX_SAMPLE_TEXT_BYTES = 16384
MAX_SAMPLE_TEMPERATURE = 100_000  # thousandths
MAX_SAMPLE_PENALTY = 100_000  # thousandths of a bit
MAX_SAMPLE_TOP_K = 1 << 20


def bits_per_byte(bits_per_token: float, tokens: int, text_bytes: int) -> float | None:
    """Total bits over the bytes of text the `tokens` targets decode to (None: no bytes).
    The ratio first, so that one byte per token gives bits per token exactly."""
    if not text_bytes:
        return None
    return bits_per_token * (tokens / text_bytes)


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


@dataclass(frozen=True, slots=True)
class FitnessRange(Message):
    """C->W: packed fitness of step_count consecutive steps, concatenated.

    Each step takes packed_size(pairs_per_step) bytes; `split()` returns them per step.
    """

    TYPE: ClassVar[MsgType] = MsgType.FITNESS_RANGE
    _FIXED: ClassVar[struct.Struct] = struct.Struct(">QII")
    _TAIL: ClassVar[bool] = True

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


@dataclass(frozen=True, slots=True)
class SnapshotRequest(Message):
    """Both ways. C->W: stream your state at `step`. W->C: send a snapshot, where
    step == LATEST_SNAPSHOT asks for the newest one."""

    TYPE: ClassVar[MsgType] = MsgType.SNAPSHOT_REQUEST
    _FIXED: ClassVar[struct.Struct] = _U64

    step: int

    def __post_init__(self) -> None:
        _u64(self, "step")


@dataclass(frozen=True, slots=True)
class SnapshotChunk(Message):
    """Both ways: bytes [offset, offset + len(data)) of a snapshot of total_bytes."""

    TYPE: ClassVar[MsgType] = MsgType.SNAPSHOT_CHUNK
    _FIXED: ClassVar[struct.Struct] = struct.Struct(">QQQ")
    _TAIL: ClassVar[bool] = True

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


@dataclass(frozen=True, slots=True)
class Validate(Message):
    """C->W: score your unperturbed replica at `step` on the held-out split."""

    TYPE: ClassVar[MsgType] = MsgType.VALIDATE
    _FIXED: ClassVar[struct.Struct] = _U64

    step: int

    def __post_init__(self) -> None:
        _u64(self, "step")


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
        """Window bits per byte of the held-out text; None where the tokens decode to none."""
        return bits_per_byte(self.bits_per_token, self.tokens, self.text_bytes)

    @property
    def stream_bits_per_byte(self) -> float | None:
        return bits_per_byte(self.stream_bits_per_token, self.stream_tokens, self.stream_text_bytes)


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
