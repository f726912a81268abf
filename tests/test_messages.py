"""Message payload codecs: round trips, validation, and every malformed-payload path."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import eggroll_dist.protocol as protocol_package
from eggroll_dist.protocol.errors import (
    ErrorCode,
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
)
from eggroll_dist.protocol.frames import FrameDecoder, encode_frame
from eggroll_dist.protocol.messages import (
    LATEST_SNAPSHOT,
    MAX_CHUNKS_PER_REQUEST,
    MAX_ERROR_MESSAGE_BYTES,
    NO_SNAPSHOT,
    Auth,
    Challenge,
    Claim,
    Error,
    FitnessRange,
    FitnessRequest,
    Heartbeat,
    Hello,
    Job,
    JobRequest,
    Log,
    LogLevel,
    Message,
    MsgType,
    Result,
    Sample,
    SampleText,
    SnapshotChunk,
    SnapshotRequest,
    Step,
    Validate,
    Validation,
    Wait,
    Welcome,
    clip_utf8,
    decode_message,
    encode_message,
    iter_snapshot_chunks,
)
from eggroll_dist.protocol.ternary import pack_ternary, packed_size

# --- strategies -------------------------------------------------------------------------

u8 = st.integers(0, 2**8 - 1)
u16 = st.integers(0, 2**16 - 1)
u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
i64 = st.integers(-(2**63), 2**63 - 1)
bytes32 = st.binary(min_size=32, max_size=32)


def text(max_bytes: int) -> st.SearchStrategy[str]:
    # At most 4 UTF-8 bytes per character keeps every draw within the limit.
    return st.text(max_size=max_bytes // 4)


@st.composite
def packed_fitness(draw: st.DrawFn, max_count: int = 60) -> tuple[int, bytes]:
    values = draw(st.lists(st.sampled_from([-1, 0, 1]), max_size=max_count))
    return len(values), pack_ternary(values)


@st.composite
def results(draw: st.DrawFn) -> Result:
    count, data = draw(packed_fitness())
    return Result(draw(u64), draw(u32), draw(i64), draw(u64), draw(u64), count, data)


@st.composite
def steps(draw: st.DrawFn) -> Step:
    count, data = draw(packed_fitness())
    return Step(draw(u64), count, data)


@st.composite
def fitness_ranges(draw: st.DrawFn) -> FitnessRange:
    pairs = draw(st.integers(0, 23))
    rows = draw(st.integers(0, 4))
    packed = [
        pack_ternary(draw(st.lists(st.sampled_from([-1, 0, 1]), min_size=pairs, max_size=pairs)))
        for _ in range(rows)
    ]
    first = draw(st.integers(0, 2**64 - 1 - max(rows - 1, 0)))
    return FitnessRange.from_steps(first, pairs, packed)


@st.composite
def snapshot_chunks(draw: st.DrawFn) -> SnapshotChunk:
    data = draw(st.binary(max_size=64))
    offset = draw(st.integers(0, 2**64 - 1 - len(data)))
    total = draw(st.integers(offset + len(data), 2**64 - 1))
    return SnapshotChunk(draw(u64), total, offset, data)


@st.composite
def jobs(draw: st.DrawFn) -> Job:
    count = 2 * draw(st.integers(1, (2**32 - 1) // 2))
    first = 2 * draw(st.integers(0, (2**64 - count) // 2))
    return Job(draw(u64), draw(u32), first, count, draw(st.integers(0, MAX_CHUNKS_PER_REQUEST - 1)))


@st.composite
def held_out(draw: st.DrawFn) -> tuple[int, float, float, int]:
    """(tokens, loss_16, bits_per_token, text_bytes) of one metric: all 0 without tokens."""
    tokens = draw(u64)
    if tokens == 0:
        return 0, 0.0, 0.0, 0
    loss = draw(st.floats(0, 1e9, allow_nan=False))
    return tokens, loss, draw(st.floats(0, 64, allow_nan=False)), draw(u64)


@st.composite
def validations(draw: st.DrawFn) -> Validation:
    tokens, loss, bits, size = draw(held_out())
    s_tokens, s_loss, s_bits, s_size = draw(held_out())
    prompts = draw(st.integers(0, 4096))
    reward = draw(st.floats(-1e6, 1e6, allow_nan=False)) if prompts else 0.0
    return Validation(
        draw(u64), tokens, loss, bits, size, s_tokens, s_loss, s_bits, s_size, prompts, reward
    )


STRATEGIES: dict[type[Message], st.SearchStrategy[Message]] = {
    Hello: st.builds(Hello, u8, text(128), text(32), text(256), bytes32),
    Challenge: st.builds(Challenge, bytes32),
    Auth: st.builds(Auth, bytes32),
    Welcome: st.builds(
        Welcome,
        st.binary(min_size=16, max_size=16),
        st.binary(max_size=200),
        u64,
        st.integers(-1, 2**63 - 1),
        u32,
    ),
    JobRequest: st.builds(JobRequest, u64, u64, u64, st.integers(1, MAX_CHUNKS_PER_REQUEST)),
    Job: jobs(),
    Wait: st.builds(Wait, u32),
    Result: results(),
    Step: steps(),
    FitnessRequest: st.builds(FitnessRequest, u64, st.integers(1, 2**32 - 1)),
    FitnessRange: fitness_ranges(),
    SnapshotRequest: st.builds(SnapshotRequest, u64),
    SnapshotChunk: snapshot_chunks(),
    Heartbeat: st.builds(Heartbeat, u64),
    Validate: st.builds(Validate, u64),
    Validation: validations(),
    Sample: st.builds(
        Sample,
        u64,
        u64,
        u32,
        st.integers(0, 1024),
        st.integers(1, 1024),
        st.integers(0, 100_000),
        st.integers(0, 1000),
        st.integers(0, 1 << 20),
        st.integers(0, 100_000),
        st.integers(0, 100_000),
    ),
    SampleText: st.builds(SampleText, u64, u64, st.binary(max_size=300), st.binary(max_size=300)),
    Log: st.builds(Log, st.sampled_from(LogLevel), text(4096)),
    Error: st.builds(Error, st.sampled_from(ErrorCode), text(1024)),
    Claim: st.builds(
        Claim, u64, u32, st.lists(st.binary(min_size=4, max_size=4), max_size=64).map(b"".join)
    ),
}
any_message = st.one_of(*STRATEGIES.values())


def assert_malformed(msg_type: int, payload: bytes) -> RemoteProtocolError:
    with pytest.raises(RemoteProtocolError) as info:
        decode_message(msg_type, payload)
    assert info.value.error_code == ErrorCode.MALFORMED
    return info.value


# --- round trips ------------------------------------------------------------------------


def test_every_type_has_a_strategy() -> None:
    assert sorted(cls.TYPE for cls in STRATEGIES) == sorted(MsgType)
    assert [int(t) for t in MsgType] == list(range(1, 22))


@pytest.mark.parametrize("cls", list(STRATEGIES), ids=lambda c: c.__name__)
def test_round_trip_per_message(cls: type[Message]) -> None:
    @settings(max_examples=40, deadline=None)
    @given(message=STRATEGIES[cls])
    def check(message: Message) -> None:
        payload = message.encode()
        assert type(message).decode(payload) == message
        assert decode_message(message.TYPE, payload) == message
        decoder = FrameDecoder()
        decoder.feed(encode_message(message))
        frame = decoder.next_frame()
        assert frame is not None and frame.msg_type == message.TYPE
        assert decode_message(frame.msg_type, frame.payload) == message

    check()


@settings(max_examples=150, deadline=None)
@given(message=any_message, data=st.data())
def test_truncated_and_overlong_payloads_are_malformed(
    message: Message, data: st.DataObject
) -> None:
    payload = message.encode()
    if isinstance(message, SnapshotChunk):
        # The data field runs to the end of the payload, so only a cut header is detectable.
        cut = data.draw(st.integers(0, 23))
        assert_malformed(message.TYPE, payload[:cut])
        if message.offset + len(message.data) == message.total_bytes:
            assert_malformed(message.TYPE, payload + b"\x00")
        return
    if isinstance(message, Claim):
        # The ids run to the end too: a cut header, or a cut id, is detectable.
        assert_malformed(message.TYPE, payload[: data.draw(st.integers(0, 11))])
        assert_malformed(message.TYPE, payload + bytes(data.draw(st.integers(1, 3))))
        return
    if payload:
        cut = data.draw(st.integers(0, len(payload) - 1))
        assert_malformed(message.TYPE, payload[:cut])
    extra = data.draw(st.binary(min_size=1, max_size=5))
    assert_malformed(message.TYPE, payload + extra)


@pytest.mark.parametrize("msg_type", [0, 22, 100, 255])
def test_unknown_type(msg_type: int) -> None:
    with pytest.raises(RemoteProtocolError) as info:
        decode_message(msg_type, b"")
    assert info.value.error_code == ErrorCode.UNKNOWN_TYPE


def test_worked_example_job_request_frame() -> None:
    frame = encode_message(JobRequest(5, 0x0123456789ABCDEF, 42, 4))
    assert frame.hex() == (
        "45474752020500000000001c09133b8c00000000000000050123456789abcdef000000000000002a00000004"
    )


# --- field layout and validation --------------------------------------------------------


def test_fixed_layouts() -> None:
    assert Job(7, 3, 10, 4).encode() == struct.pack(">QIQII", 7, 3, 10, 4, 0)
    assert Job(7, 3, 10, 4, 2).encode() == struct.pack(">QIQII", 7, 3, 10, 4, 2)
    assert Wait(250).encode() == b"\x00\x00\x00\xfa"
    assert Heartbeat(1).encode() == bytes(7) + b"\x01"
    assert Error(ErrorCode.AUTH_FAILED, "no").encode() == b"\x00\x08\x00\x02no"
    assert Log(LogLevel.WARNING, "é").encode() == b"\x02\x00\x02\xc3\xa9"
    welcome = Welcome(bytes(range(16)), b"{}", 3, -1, 8)
    assert welcome.encode() == bytes(range(16)) + struct.pack(">QqII", 3, -1, 8, 2) + b"{}"
    hello = Hello(1, "w", "numpy", "cpu", bytes(32))
    assert hello.encode() == b"\x01" + bytes(32) + b"\x00\x01w\x00\x05numpy\x00\x03cpu"


def test_sample_layout_and_bounds() -> None:
    sample = Sample(800, 7, 3, 32, 64, 600, 80, 0, 200, 0)
    assert sample.encode() == struct.pack(">QQIHHIIIII", 800, 7, 3, 32, 64, 600, 80, 0, 200, 0)
    assert len(sample.encode()) == 44
    for field, bad in (
        ("new_tokens", 0),
        ("new_tokens", 1025),
        ("prompt_tokens", 1025),
        ("temperature", 100_001),
        ("min_p", 1001),
        ("top_k", (1 << 20) + 1),
        ("presence_penalty", 100_001),
        ("frequency_penalty", -1),
    ):
        values = {**{f: getattr(sample, f) for f in Sample.__slots__}, field: bad}
        with pytest.raises(LocalProtocolError, match=field):
            Sample(**values)
        if bad >= 0:  # the same value on the wire is MALFORMED: checked before it is used
            assert_malformed(MsgType.SAMPLE, struct.pack(">QQIHHIIIII", *values.values()))
    text = SampleText(5, 7, b"Once", "é\x1b".encode())
    assert text.encode() == struct.pack(">QQ", 5, 7) + b"\x00\x04Once\x00\x03\xc3\xa9\x1b"
    assert SampleText.decode(text.encode()) == text
    SampleText(0, 0, b"p" * 16384, b"t" * 16384)
    with pytest.raises(LocalProtocolError, match="text is 16385 bytes"):
        SampleText(0, 0, b"", b"t" * 16385)
    with pytest.raises(LocalProtocolError, match="prompt is 16385 bytes"):
        SampleText(0, 0, b"p" * 16385, b"")
    oversize = struct.pack(">QQ", 0, 0) + b"\x00\x00" + b"\x40\x01" + b"t" * 16385
    assert_malformed(MsgType.SAMPLE_TEXT, oversize)
    assert_malformed(MsgType.SAMPLE_TEXT, struct.pack(">QQ", 0, 0) + b"\x00\x05abc")


def test_claim_carries_whole_u32_ids_big_endian() -> None:
    claim = Claim.from_ids(3, 1, np.array([[1, 2], [70000, 0xFFFFFFFF]]))
    assert claim.encode() == struct.pack(">QIIIII", 3, 1, 1, 2, 70000, 0xFFFFFFFF)
    assert Claim.decode(claim.encode()).ids().tolist() == [1, 2, 70000, 0xFFFFFFFF]
    assert Claim(0, 0, b"").ids().size == 0
    assert_malformed(MsgType.CLAIM, struct.pack(">QI", 0, 0) + b"\x00\x01\x02")  # not whole
    with pytest.raises(LocalProtocolError, match=r"0\.\.2\*\*32"):
        Claim.from_ids(0, 0, [-1])
    with pytest.raises(LocalProtocolError, match=r"0\.\.2\*\*32"):
        Claim.from_ids(0, 0, [1 << 32])


def test_invalid_utf8_is_malformed() -> None:
    payload = b"\x01" + bytes(32) + b"\x00\x02\xff\xfe" + b"\x00\x00" * 2
    assert_malformed(MsgType.HELLO, payload)
    assert_malformed(MsgType.LOG, b"\x01\x00\x01\x80")


def test_string_limits() -> None:
    Hello(1, "n" * 128, "b" * 32, "d" * 256, bytes(32))
    with pytest.raises(LocalProtocolError) as info:
        Hello(1, "n" * 129, "", "", bytes(32))
    assert info.value.error_code == ErrorCode.MALFORMED
    with pytest.raises(LocalProtocolError):
        Hello(1, "", "é" * 17, "", bytes(32))  # 34 UTF-8 bytes > 32
    with pytest.raises(LocalProtocolError):
        Log(LogLevel.INFO, "x" * 4097)
    with pytest.raises(LocalProtocolError):
        Error(ErrorCode.INTERNAL, "x" * 1025)
    with pytest.raises(LocalProtocolError):
        Log(LogLevel.INFO, "\ud800")  # lone surrogate: not encodable
    # The same limits hold on decode.
    long_name = b"\x01" + bytes(32) + b"\x00\x81" + b"n" * 129 + b"\x00\x00" * 2
    assert_malformed(MsgType.HELLO, long_name)


def test_fixed_size_byte_fields() -> None:
    for build in (
        lambda: Challenge(bytes(31)),
        lambda: Auth(bytes(33)),
        lambda: Hello(1, "", "", "", bytes(16)),
        lambda: Welcome(bytes(15), b"", 0, -1, 1),
    ):
        with pytest.raises(LocalProtocolError):
            build()
    with pytest.raises(LocalProtocolError):
        Challenge("x" * 32)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "build",
    [
        lambda: JobRequest(-1),
        lambda: JobRequest(2**64),
        lambda: Wait(2**32),
        lambda: Job(0, 0, 1, 2),  # odd first member
        lambda: Job(0, 0, 2, 3),  # odd member count
        lambda: Job(0, 0, 0, 0),  # empty
        lambda: Job(0, 0, 2**64 - 2, 4),  # range past u64
        lambda: Job(0, 0, 0, 2, MAX_CHUNKS_PER_REQUEST),  # more JOBs than a request gets
        lambda: JobRequest(0, 0, 0, 0),  # no chunk wanted
        lambda: JobRequest(0, 0, 0, MAX_CHUNKS_PER_REQUEST + 1),
        lambda: Result(0, 0, 2**63, 0, 0, 0, b""),
        lambda: Result(0, 0, 0, 0, 0, 6, b"\x00"),  # too few fitness bytes
        lambda: Result(0, 0, 0, 0, 0, 6, b"\x00\x03"),  # non-canonical last byte
        lambda: Step(0, 5, b"\xf3"),  # byte 243
        lambda: Welcome(bytes(16), b"", 0, -2, 1),
        lambda: FitnessRequest(0, 0),
        lambda: FitnessRange(0, 2, 5, b"\x00"),
        lambda: SnapshotChunk(0, 10, 8, b"abc"),
        lambda: Log(4, "x"),
        lambda: Error(0, "x"),
        lambda: Error(99, "x"),
        lambda: Heartbeat(1.5),
        lambda: Validation(0, 10, 1.0, float("nan")),
        lambda: Validation(0, 10, 1.0, -0.5),
        lambda: Validation(0, 10, 1.0, 2.0, 2**64),
        lambda: Validation(0, 0, 1.0, 2.0),  # scores without tokens
        lambda: Validation(0, 10, 1.0, 2.0, 10, 0, 0.0, 0.0, 5),  # stream bytes, no tokens
        lambda: Validation(0, 10, 1.0, 2.0, 10, 0, 0.0, 1.5, 0),  # stream bits, no tokens
        lambda: Validation(0, 10, 1.0, 2.0, 10, 8, float("inf"), 1.5, 8),
        lambda: Validation(0, 10, 1.0, 2.0, 10, 0, 0.0, 0.0, 0, 4, float("nan")),
        lambda: Validation(0, 10, 1.0, 2.0, 10, 0, 0.0, 0.0, 0, 0, 0.5),  # reward, no prompts
    ],
)
def test_construction_rejects_invalid_fields(build: object) -> None:
    with pytest.raises(LocalProtocolError) as info:
        build()  # type: ignore[operator]
    assert info.value.error_code == ErrorCode.MALFORMED


def test_decode_rejects_invalid_fields() -> None:
    assert_malformed(MsgType.JOB, struct.pack(">QIQI", 0, 0, 1, 2))
    assert_malformed(MsgType.JOB, struct.pack(">QIQI", 0, 0, 0, 3))
    assert_malformed(MsgType.RESULT, struct.pack(">QIqQQI", 0, 0, 0, 0, 0, 5) + b"\xf3")
    assert_malformed(MsgType.RESULT, struct.pack(">QIqQQI", 0, 0, 0, 0, 0, 6) + b"\x00\x03")
    assert_malformed(MsgType.RESULT, struct.pack(">QIqQQI", 0, 0, 0, 0, 0, 10) + b"\x00")
    assert_malformed(MsgType.STEP, struct.pack(">QI", 0, 6) + b"\x00\x05")
    assert_malformed(MsgType.FITNESS_RANGE, struct.pack(">QII", 0, 2, 6) + bytes([0, 0, 0, 3]))
    assert_malformed(MsgType.FITNESS_RANGE, struct.pack(">QII", 0, 2, 6) + bytes(3))
    assert_malformed(MsgType.FITNESS_REQUEST, struct.pack(">QI", 0, 0))
    assert_malformed(MsgType.WELCOME, bytes(16) + struct.pack(">QqII", 0, -2, 1, 0))
    assert_malformed(MsgType.WELCOME, bytes(16) + struct.pack(">QqII", 0, -1, 1, 5) + b"{}")
    assert_malformed(MsgType.SNAPSHOT_CHUNK, struct.pack(">QQQ", 0, 2, 1) + b"ab")
    assert_malformed(MsgType.LOG, b"\x04\x00\x00")
    assert_malformed(MsgType.ERROR, b"\x00\x00\x00\x00")
    assert_malformed(MsgType.ERROR, b"\x00\x10\x00\x00")


def test_validation_layout_and_bits_per_byte() -> None:
    both = Validation(40, 1000, 70.0, 4.5, 1500, 1000, 68.0, 4.25, 1500)
    assert both.encode() == struct.pack(
        ">QQddQQddQQd", 40, 1000, 70.0, 4.5, 1500, 1000, 68.0, 4.25, 1500, 0, 0.0
    )
    assert len(both.encode()) == 88
    # A reward run adds the held-out prompts' mean reward (it may be negative).
    rewarded = Validation(40, 1000, 70.0, 4.5, 1500, 0, 0.0, 0.0, 0, 64, -0.25)
    assert Validation.decode(rewarded.encode()) == rewarded
    assert rewarded.encode()[72:] == struct.pack(">Qd", 64, -0.25)
    assert both.bits_per_byte == 4.5 * (1000 / 1500)
    assert both.stream_bits_per_byte == 4.25 * (1000 / 1500)
    same = Validation(1, 3, 1.0, 0.1, 3, 3, 1.0, 0.7, 3)  # one byte per token
    assert (same.bits_per_byte, same.stream_bits_per_byte) == (0.1, 0.7)
    # A model without recurrent state: no stream metric; tokens that decode to no bytes.
    windows_only = Validation(40, 1000, 70.0, 4.5)
    assert windows_only.stream_tokens == 0 and windows_only.stream_bits_per_byte is None
    assert windows_only.bits_per_byte is None
    assert Validation.decode(windows_only.encode()) == windows_only
    # The receiver checks the rules too: stream scores without stream tokens are malformed.
    assert_malformed(
        MsgType.VALIDATION, struct.pack(">QQddQQddQ", 1, 10, 1.0, 2.0, 10, 0, 0.0, 3.0, 0)
    )
    assert_malformed(MsgType.VALIDATION, struct.pack(">QQdd", 1, 10, 1.0, 2.0))  # short


def test_integer_fields_normalized_to_int() -> None:
    job = Job(np.uint64(4), np.int32(1), np.int64(2), np.uint32(6))
    assert type(job.step) is int and type(job.member_count) is int
    assert job == Job(4, 1, 2, 6)
    assert (job.first_pair, job.pair_count) == (1, 3)
    assert Log(2, "x").level is LogLevel.WARNING
    assert Error(8, "x").code is ErrorCode.AUTH_FAILED
    assert Challenge(bytearray(32)).nonce == bytes(32)


def test_messages_are_frozen() -> None:
    with pytest.raises(AttributeError):
        JobRequest(1).replica_step = 2  # type: ignore[misc]


# --- helpers ----------------------------------------------------------------------------


def test_result_and_step_fitness_helpers() -> None:
    values = np.random.default_rng(0).integers(-1, 2, size=163_840, dtype=np.int8)
    result = Result.from_values(
        step=3, chunk=1, loss_sum=-10, weights_changed=5, replica_digest=2**64 - 1, fitness=values
    )
    assert result.pair_count == 163_840 and len(result.fitness) == packed_size(163_840)
    np.testing.assert_array_equal(Result.decode(result.encode()).fitness_values(), values)
    step = Step.from_values(3, values[:7])
    assert step == Step(3, 7, pack_ternary(values[:7]))
    np.testing.assert_array_equal(step.fitness_values(), values[:7])


def test_fitness_range_helpers() -> None:
    rng = np.random.default_rng(1)
    rows = rng.integers(-1, 2, size=(3, 11), dtype=np.int8)
    packed = [pack_ternary(r) for r in rows]
    message = FitnessRange.from_steps(40, 11, packed)
    assert (message.first_step, message.step_count, message.pairs_per_step) == (40, 3, 11)
    assert message.split() == packed
    np.testing.assert_array_equal(message.fitness_values(), rows)
    assert FitnessRange.from_steps(0, 11, []).fitness_values().shape == (0, 11)
    most = FitnessRange.max_steps_per_frame(163_840)
    assert most == (16 * 2**20 - 16) // 32_768
    assert len(FitnessRange.from_steps(0, 163_840, [bytes(32_768)] * most).encode()) <= 16 * 2**20
    assert FitnessRange.max_steps_per_frame(0) == 2**32 - 1


def test_snapshot_chunks_reassemble() -> None:
    blob = bytes(range(256)) * 41
    chunks = list(iter_snapshot_chunks(9, blob, chunk_bytes=1000))
    assert len(chunks) == 11
    assert all(c.step == 9 and c.total_bytes == len(blob) for c in chunks)
    assert b"".join(c.data for c in chunks) == blob
    assert [c.is_last for c in chunks] == [False] * 10 + [True]
    for chunk in chunks:
        assert SnapshotChunk.decode(chunk.encode()) == chunk
    assert list(iter_snapshot_chunks(1, b"")) == [SnapshotChunk(1, 0, 0, b"")]
    assert [len(c.data) for c in iter_snapshot_chunks(1, bytes(2 << 20))] == [1 << 20] * 2
    with pytest.raises(ValueError):
        list(iter_snapshot_chunks(1, b"x", chunk_bytes=0))


def test_snapshot_request_latest() -> None:
    assert SnapshotRequest(LATEST_SNAPSHOT).encode() == b"\xff" * 8
    assert Welcome(bytes(16), b"", 0, NO_SNAPSHOT, 1).snapshot_step == -1


def test_clip_utf8_and_error_from_exception() -> None:
    assert clip_utf8("abc", 10) == "abc"
    assert clip_utf8("ééé", 5) == "éé"
    exc = RemoteProtocolError(ErrorCode.BAD_CRC, "é" * 2000)
    error = Error.from_exception(exc)
    assert error.code is ErrorCode.BAD_CRC
    assert len(error.message.encode()) <= MAX_ERROR_MESSAGE_BYTES
    unknown = Error.from_exception(ProtocolError(999, "future"))
    assert unknown.code is ErrorCode.INTERNAL


def test_exception_hierarchy() -> None:
    exc = LocalProtocolError(ErrorCode.ILLEGAL_STATE, "nope")
    assert isinstance(exc, ProtocolError) and isinstance(exc, Exception)
    assert exc.error_code is ErrorCode.ILLEGAL_STATE and exc.message == "nope"
    assert "ILLEGAL_STATE" in str(exc)
    assert issubclass(RemoteProtocolError, ProtocolError)
    assert [int(c) for c in ErrorCode] == list(range(1, 16))


def test_frame_of_message_has_type_in_header() -> None:
    frame = encode_message(Heartbeat(7))
    assert frame == encode_frame(MsgType.HEARTBEAT, struct.pack(">Q", 7))


def spec_hex_blocks() -> list[bytes]:
    """Byte strings of the worked examples (code blocks) in SPEC.md."""
    text = (Path(protocol_package.__file__).parent / "SPEC.md").read_text(encoding="utf-8")
    section = text.split("## 7. Worked examples", 1)[1]
    blocks = re.findall(r"```\n(.*?)```", section, flags=re.DOTALL)
    out = []
    for block in blocks:
        hex_bytes = []
        for line in block.splitlines():
            # Lines are hex bytes followed by a description; stop at the first non-byte.
            for token in line.split():
                if not re.fullmatch(r"[0-9a-f]{2}", token):
                    break
                hex_bytes.append(token)
        out.append(bytes.fromhex("".join(hex_bytes)))
    return out


def test_spec_worked_examples_match_the_code() -> None:
    result = Result.from_values(
        step=3,
        chunk=1,
        loss_sum=-2,
        weights_changed=10,
        replica_digest=0x0123456789ABCDEF,
        fitness=[1, -1, 0, 1, 1, 0, 0, 1],
    )
    assert spec_hex_blocks() == [
        encode_frame(7, b"abc"),
        encode_message(JobRequest(5, 0x0123456789ABCDEF, 42, 4)),
        encode_message(result),
        encode_message(Error(ErrorCode.ILLEGAL_STATE, "no")),
    ]
