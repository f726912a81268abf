"""Frame header encoding and the streaming FrameDecoder."""

from __future__ import annotations

import itertools
import random
import struct
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eggroll_dist.protocol.errors import ErrorCode, LocalProtocolError, RemoteProtocolError
from eggroll_dist.protocol.frames import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    HEADER_SIZE,
    PROTOCOL_VERSION,
    Frame,
    FrameDecoder,
    encode_frame,
)

frames_strategy = st.lists(
    st.tuples(st.integers(0, 255), st.binary(max_size=300), st.integers(0, 0xFFFF)),
    max_size=8,
)


def decode_all(decoder: FrameDecoder) -> list[Frame]:
    return list(decoder)


def feed_in_pieces(pieces: list[bytes], max_payload_bytes: int = 1 << 20) -> list[Frame]:
    decoder = FrameDecoder(max_payload_bytes)
    out: list[Frame] = []
    for piece in pieces:
        decoder.feed(piece)
        out.extend(decode_all(decoder))
    assert decoder.buffered_bytes == 0
    return out


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(data)) for c in cuts})
    edges = [0, *points, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(edges)]


def test_encode_frame_exact_bytes() -> None:
    expected = (
        b"EGGR\x02\x07\x00\x00\x00\x00\x00\x03" + zlib.crc32(b"abc").to_bytes(4, "big") + b"abc"
    )
    assert encode_frame(7, b"abc") == expected


def test_header_layout() -> None:
    frame = encode_frame(200, b"x" * 70000, flags=0x1234)
    assert len(frame) == HEADER_SIZE + 70000
    magic, version, msg_type, flags, length, crc = struct.unpack(">4sBBHII", frame[:16])
    assert (magic, version, msg_type, flags, length) == (
        b"EGGR",
        PROTOCOL_VERSION,
        200,
        0x1234,
        70000,
    )
    assert crc == zlib.crc32(b"x" * 70000)


@pytest.mark.parametrize(("msg_type", "flags"), [(-1, 0), (256, 0), (1, -1), (1, 0x10000)])
def test_encode_frame_rejects_out_of_range_header_fields(msg_type: int, flags: int) -> None:
    with pytest.raises(LocalProtocolError):
        encode_frame(msg_type, b"", flags)


@settings(max_examples=60, deadline=None)
@given(frames=frames_strategy, cuts=st.lists(st.integers(0, 3000), max_size=12))
def test_decoder_same_frames_whole_bytewise_and_split(
    frames: list[tuple[int, bytes, int]], cuts: list[int]
) -> None:
    expected = [Frame(t, f, p) for t, p, f in frames]
    stream = b"".join(encode_frame(t, p, f) for t, p, f in frames)
    assert feed_in_pieces([stream]) == expected
    assert feed_in_pieces([stream[i : i + 1] for i in range(len(stream))]) == expected
    assert feed_in_pieces(split_at(stream, cuts)) == expected


def test_trailing_partial_frame_stays_buffered() -> None:
    first, second = encode_frame(1, b"hello"), encode_frame(2, b"world" * 10)
    decoder = FrameDecoder()
    decoder.feed(first + second[:20])
    assert decoder.next_frame() == Frame(1, 0, b"hello")
    assert decoder.next_frame() is None
    assert decoder.buffered_bytes == 20
    decoder.feed(second[20:30])
    assert decoder.next_frame() is None
    decoder.feed(second[30:])
    assert decoder.next_frame() == Frame(2, 0, b"world" * 10)
    assert decoder.next_frame() is None
    assert decoder.buffered_bytes == 0


def test_many_frames_across_compaction_threshold() -> None:
    rng = random.Random(7)
    payloads = [rng.randbytes(rng.randrange(0, 5000)) for _ in range(200)]
    stream = b"".join(encode_frame(i % 256, p) for i, p in enumerate(payloads))
    pieces = split_at(stream, [rng.randrange(len(stream)) for _ in range(300)])
    got = feed_in_pieces(pieces)
    assert [f.payload for f in got] == payloads


def test_empty_payload_and_exact_limit() -> None:
    decoder = FrameDecoder(max_payload_bytes=10)
    decoder.feed(encode_frame(3, b"") + encode_frame(4, b"0123456789"))
    assert decode_all(decoder) == [Frame(3, 0, b""), Frame(4, 0, b"0123456789")]


def expect_error(data: bytes, code: ErrorCode, max_payload_bytes: int = 1 << 20) -> None:
    decoder = FrameDecoder(max_payload_bytes)
    decoder.feed(data)
    with pytest.raises(RemoteProtocolError) as info:
        decoder.next_frame()
    assert info.value.error_code == code
    # The decoder is dead: feeding or reading again raises the same error.
    with pytest.raises(RemoteProtocolError) as again:
        decoder.feed(encode_frame(1, b""))
    assert again.value.error_code == code
    with pytest.raises(RemoteProtocolError):
        decoder.next_frame()
    assert decoder.dead


def test_bad_magic() -> None:
    expect_error(b"EGGX" + encode_frame(1, b"abc")[4:], ErrorCode.BAD_MAGIC)


def test_bad_magic_detected_before_full_header() -> None:
    expect_error(b"GET / HTTP", ErrorCode.BAD_MAGIC)
    expect_error(b"X", ErrorCode.BAD_MAGIC)


def test_bad_version() -> None:
    frame = bytearray(encode_frame(1, b"abc"))
    frame[4] = PROTOCOL_VERSION + 1
    expect_error(bytes(frame), ErrorCode.BAD_VERSION)


def test_bad_crc() -> None:
    frame = bytearray(encode_frame(1, b"abc"))
    frame[-1] ^= 0x01
    expect_error(bytes(frame), ErrorCode.BAD_CRC)
    frame = bytearray(encode_frame(1, b"abc"))
    frame[12] ^= 0x80
    expect_error(bytes(frame), ErrorCode.BAD_CRC)


def test_oversize_length_rejected_from_header_alone() -> None:
    # Only the header arrives: the length alone must trigger the error, without waiting
    # for (or buffering) the announced payload.
    header = struct.pack(">4sBBHII", b"EGGR", PROTOCOL_VERSION, 8, 0, 0xFFFFFFFF, 0)
    decoder = FrameDecoder()
    decoder.feed(header)
    with pytest.raises(RemoteProtocolError) as info:
        decoder.next_frame()
    assert info.value.error_code == ErrorCode.FRAME_TOO_LARGE
    assert decoder.buffered_bytes == 0
    expect_error(encode_frame(1, b"x" * 11), ErrorCode.FRAME_TOO_LARGE, max_payload_bytes=10)
    assert FrameDecoder().max_payload_bytes == DEFAULT_MAX_PAYLOAD_BYTES == 16 * 2**20


def test_error_after_good_frames_keeps_earlier_frames() -> None:
    decoder = FrameDecoder()
    decoder.feed(encode_frame(1, b"ok") + b"BAD!" + bytes(12))
    assert decoder.next_frame() == Frame(1, 0, b"ok")
    with pytest.raises(RemoteProtocolError) as info:
        decoder.next_frame()
    assert info.value.error_code == ErrorCode.BAD_MAGIC


def test_large_frame_in_small_pieces() -> None:
    payload = random.Random(1).randbytes(3 * 2**20)
    stream = encode_frame(13, payload)
    decoder = FrameDecoder()
    frames = []
    for i in range(0, len(stream), 65536):
        decoder.feed(stream[i : i + 65536])
        frames.extend(decode_all(decoder))
    assert frames == [Frame(13, 0, payload)]
