"""What every message shares: the type numbers, field checks, the payload reader and the
`Message` base with its default codec.

Every message validates its fields on construction, so an illegal message cannot be
built to be sent (LocalProtocolError, code MALFORMED). `decode` turns any defect in a
received payload (truncation, trailing bytes, bad UTF-8, out-of-range fields, bad ternary
bytes) into RemoteProtocolError(MALFORMED). Integers are big-endian; strings are a u16
byte length followed by UTF-8. Fixed-size fields come first in every payload, so the
offsets in SPEC.md are constant. The underscore names serve the message modules of this
package only.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import struct
from enum import IntEnum
from typing import Any, ClassVar, Self

from .errors import ErrorCode, LocalProtocolError, ProtocolError, RemoteProtocolError
from .ternary import TernaryError, check_packed

__all__ = ["Message", "MsgType", "clip_utf8"]


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
    CLAIM = 21


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
# The base of every message.


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(field.name for field in dataclasses.fields(cls))


class Message:
    """Base of all messages: `TYPE`, `encode()` (payload only) and `decode(payload)`.

    The default codec is the dataclass fields in declaration order: all packed by `_FIXED`,
    or, where `_TAIL` is set, all but the last, which is bytes running to the payload's end.
    A message whose wire order differs, or that carries strings, overrides `encode` and
    `_read`.
    """

    __slots__ = ()
    TYPE: ClassVar[MsgType]
    _FIXED: ClassVar[struct.Struct]
    _TAIL: ClassVar[bool] = False

    def encode(self) -> bytes:
        values = [getattr(self, name) for name in _field_names(type(self))]
        if self._TAIL:
            return self._FIXED.pack(*values[:-1]) + values[-1]
        return self._FIXED.pack(*values)

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
        fixed = reader.fields(cls._FIXED)
        return cls(*fixed, reader.rest()) if cls._TAIL else cls(*fixed)
