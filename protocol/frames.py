"""Frame layer: the 16-byte header, encoding, and a restartable streaming decoder.

Header (big-endian): magic b"EGGR", version u8, message type u8, flags u16, payload
length u32, CRC-32 of the payload u32. The decoder validates magic, version and length
as soon as the header is complete, before any payload is buffered (and hands type, flags
and length to an optional `check_header`, which may refuse the frame too), and the CRC once
the payload is in.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from .errors import ErrorCode, LocalProtocolError, RemoteProtocolError

__all__ = [
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "DEFAULT_PORT",
    "HEADER",
    "HEADER_SIZE",
    "MAGIC",
    "PROTOCOL_VERSION",
    "Frame",
    "FrameDecoder",
    "encode_frame",
]

MAGIC = b"EGGR"
PROTOCOL_VERSION = 2  # 2: JOB_REQUEST asks for several chunks, JOB says how many follow
DEFAULT_PORT = 12345  # the coordinator's TCP port unless told otherwise
HEADER = struct.Struct(">4sBBHII")
HEADER_SIZE = HEADER.size  # 16
DEFAULT_MAX_PAYLOAD_BYTES = 16 * 2**20

# Consumed bytes are dropped from the front of the buffer only once this many have
# accumulated (and they are at least half the buffer), so compaction stays amortized O(1).
_COMPACT_MIN_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class Frame:
    """One decoded frame: message type, header flags and the raw payload."""

    msg_type: int
    flags: int
    payload: bytes


def encode_frame(msg_type: int, payload: bytes, flags: int = 0) -> bytes:
    """Return header + payload for one frame."""
    if not 0 <= msg_type <= 0xFF:
        raise LocalProtocolError(ErrorCode.MALFORMED, f"message type {msg_type} is not a u8")
    if not 0 <= flags <= 0xFFFF:
        raise LocalProtocolError(ErrorCode.MALFORMED, f"flags {flags} are not a u16")
    size = len(payload)
    if size > 0xFFFFFFFF:
        raise LocalProtocolError(ErrorCode.FRAME_TOO_LARGE, f"payload of {size} bytes")
    header = HEADER.pack(MAGIC, PROTOCOL_VERSION, msg_type, flags, size, zlib.crc32(payload))
    return header + payload


class FrameDecoder:
    """Incremental decoder: `feed` bytes as they arrive, take frames with `next_frame`.

    Any protocol error raises `RemoteProtocolError` and leaves the decoder dead: every
    later `feed` or `next_frame` raises the same error again.
    """

    def __init__(
        self,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        check_header: Callable[[int, int, int], None] | None = None,
    ) -> None:
        if not 0 <= max_payload_bytes <= 0xFFFFFFFF:
            raise ValueError("max_payload_bytes must fit in a u32")
        self.max_payload_bytes = max_payload_bytes
        # (type, flags, length) -> None, or raises RemoteProtocolError; called once per frame
        # as soon as its header is in.
        self.check_header = check_header
        self._buf = bytearray()
        self._pos = 0  # start of unconsumed data in _buf
        self._header: tuple[int, int, int, int] | None = None  # type, flags, length, crc
        self._error: RemoteProtocolError | None = None

    @property
    def buffered_bytes(self) -> int:
        """Bytes received but not yet returned as part of a frame."""
        return len(self._buf) - self._pos

    @property
    def dead(self) -> bool:
        return self._error is not None

    def feed(self, data: bytes) -> None:
        if self._error is not None:
            raise self._error
        self._buf += data

    def next_frame(self) -> Frame | None:
        """Return the next complete frame, or None if more data is needed."""
        if self._error is not None:
            raise self._error
        try:
            return self._next_frame()
        except RemoteProtocolError as exc:
            self._error = exc
            # Release the buffer: a dead decoder must not pin a large payload in memory.
            self._buf = bytearray()
            self._pos = 0
            raise

    def __iter__(self) -> Iterator[Frame]:
        while (frame := self.next_frame()) is not None:
            yield frame

    def _next_frame(self) -> Frame | None:
        buf, pos = self._buf, self._pos
        available = len(buf) - pos
        if self._header is None:
            if available < HEADER_SIZE:
                # Fail fast on a wrong magic prefix instead of waiting for 16 bytes.
                prefix = bytes(buf[pos : pos + min(available, len(MAGIC))])
                if not MAGIC.startswith(prefix):
                    raise RemoteProtocolError(ErrorCode.BAD_MAGIC, _bad_magic(prefix))
                return None
            magic, version, msg_type, flags, length, crc = HEADER.unpack_from(buf, pos)
            if magic != MAGIC:
                raise RemoteProtocolError(ErrorCode.BAD_MAGIC, _bad_magic(magic))
            if version != PROTOCOL_VERSION:
                raise RemoteProtocolError(
                    ErrorCode.BAD_VERSION,
                    f"protocol version {version}, expected {PROTOCOL_VERSION}",
                )
            if length > self.max_payload_bytes:
                raise RemoteProtocolError(
                    ErrorCode.FRAME_TOO_LARGE,
                    f"payload of {length} bytes exceeds the limit of {self.max_payload_bytes}",
                )
            if self.check_header is not None:
                self.check_header(msg_type, flags, length)
            self._header = (msg_type, flags, length, crc)
        msg_type, flags, length, crc = self._header
        end = pos + HEADER_SIZE + length
        if len(buf) < end:
            return None
        with memoryview(buf) as view:
            body = view[pos + HEADER_SIZE : end]
            actual = zlib.crc32(body)
            payload = bytes(body)
            body.release()
        if actual != crc:
            raise RemoteProtocolError(
                ErrorCode.BAD_CRC, f"payload CRC {actual:#010x}, header says {crc:#010x}"
            )
        self._header = None
        self._consume(end)
        return Frame(msg_type, flags, payload)

    def _consume(self, end: int) -> None:
        if end == len(self._buf):
            self._buf.clear()
            self._pos = 0
        elif end >= _COMPACT_MIN_BYTES and 2 * end >= len(self._buf):
            del self._buf[:end]
            self._pos = 0
        else:
            self._pos = end


# A TLS record of the handshake: content type 22, then major version 3.
TLS_HANDSHAKE = b"\x16\x03"


def _bad_magic(prefix: bytes) -> str:
    """Why the first bytes are no frame, naming the usual cause: a peer speaking TLS to a
    side that does not (one of the two started without its TLS flags)."""
    if prefix.startswith(TLS_HANDSHAKE):
        return (
            f"bad magic {prefix!r}: the peer speaks TLS and this side plain TCP (give both "
            "sides their TLS flags, or neither)"
        )
    return f"bad magic {prefix!r}"
