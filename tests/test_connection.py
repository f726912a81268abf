"""Connection state machine: handshake, READY traffic, illegal messages, errors."""

from __future__ import annotations

import numpy as np
import pytest

from eggroll_dist.protocol import messages
from eggroll_dist.protocol.connection import (
    TRANSITIONS,
    WELCOME_MAX_PAYLOAD_BYTES,
    Connection,
    Direction,
    Role,
    State,
)
from eggroll_dist.protocol.errors import (
    ErrorCode,
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
)
from eggroll_dist.protocol.frames import HEADER, HEADER_SIZE, MAGIC, PROTOCOL_VERSION, encode_frame
from eggroll_dist.protocol.messages import (
    LATEST_SNAPSHOT,
    LogLevel,
    Message,
    MsgType,
    encode_message,
    iter_snapshot_chunks,
)
from eggroll_dist.protocol.security import auth_mac, verify_mac
from eggroll_dist.protocol.ternary import pack_ternary

TOKEN = b"shared-token"
NONCE = bytes(range(32))
HELLO = messages.Hello(1, "w0", "numpy", "cpu", bytes(32))
WELCOME = messages.Welcome(bytes(16), b'{"pairs": 8}', 0, -1, 8)


def deliver(sender_bytes: bytes, receiver: Connection, bytewise: bool = False) -> Message:
    """Feed one frame to the receiver and return the single event it yields."""
    pieces = (
        [sender_bytes[i : i + 1] for i in range(len(sender_bytes))] if bytewise else [sender_bytes]
    )
    events = []
    for piece in pieces:
        receiver.receive_data(piece)
        while (event := receiver.next_event()) is not None:
            events.append(event)
    assert len(events) == 1
    return events[0]


def handshake(bytewise: bool = False) -> tuple[Connection, Connection]:
    worker, coordinator = Connection(Role.WORKER), Connection(Role.COORDINATOR)
    assert worker.state is State.START and coordinator.state is State.START

    assert deliver(worker.send(HELLO), coordinator, bytewise) == HELLO
    assert (worker.state, coordinator.state) == (State.HELLO_SENT, State.HELLO_RECEIVED)

    challenge = deliver(coordinator.send(messages.Challenge(NONCE)), worker, bytewise)
    assert isinstance(challenge, messages.Challenge)
    assert (worker.state, coordinator.state) == (State.CHALLENGED, State.CHALLENGE_SENT)

    auth = deliver(
        worker.send(messages.Auth(auth_mac(TOKEN, challenge.nonce))), coordinator, bytewise
    )
    assert isinstance(auth, messages.Auth) and verify_mac(TOKEN, NONCE, auth.mac)
    assert (worker.state, coordinator.state) == (State.AUTH_SENT, State.AUTHENTICATED)

    assert deliver(coordinator.send(WELCOME), worker, bytewise) == WELCOME
    assert (worker.state, coordinator.state) == (State.READY, State.READY)
    return worker, coordinator


@pytest.mark.parametrize("bytewise", [False, True])
def test_handshake_then_job_result_step(bytewise: bool) -> None:
    worker, coordinator = handshake(bytewise)

    assert deliver(
        worker.send(messages.JobRequest(0)), coordinator, bytewise
    ) == messages.JobRequest(0)
    assert deliver(coordinator.send(messages.Wait(100)), worker, bytewise) == messages.Wait(100)
    job = messages.Job(step=0, chunk=1, first_member=8, member_count=8)
    assert deliver(coordinator.send(job), worker, bytewise) == job

    fitness = np.array([1, -1, 0, 1], dtype=np.int8)
    result = messages.Result.from_values(
        step=0, chunk=1, loss_sum=-42, weights_changed=0, replica_digest=123, fitness=fitness
    )
    got = deliver(worker.send(result), coordinator, bytewise)
    assert got == result and isinstance(got, messages.Result)
    np.testing.assert_array_equal(got.fitness_values(), fitness)

    step = messages.Step.from_values(0, np.array([0, 1, 1, -1, 1, -1, 0, 1], dtype=np.int8))
    assert deliver(coordinator.send(step), worker, bytewise) == step
    assert deliver(
        worker.send(messages.JobRequest(1)), coordinator, bytewise
    ) == messages.JobRequest(1)
    assert worker.state is State.READY and coordinator.state is State.READY


def test_catch_up_snapshot_log_and_heartbeat_traffic() -> None:
    worker, coordinator = handshake()
    request = messages.FitnessRequest(first_step=0, max_steps=10)
    assert deliver(worker.send(request), coordinator) == request
    span = messages.FitnessRange.from_steps(0, 8, [pack_ternary([1] * 8), pack_ternary([-1] * 8)])
    assert deliver(coordinator.send(span), worker) == span

    latest = messages.SnapshotRequest(LATEST_SNAPSHOT)
    assert deliver(worker.send(latest), coordinator) == latest
    for chunk in iter_snapshot_chunks(2, b"state" * 100, chunk_bytes=128):
        assert deliver(coordinator.send(chunk), worker) == chunk
    assert deliver(
        coordinator.send(messages.SnapshotRequest(2)), worker
    ) == messages.SnapshotRequest(2)
    piece = messages.SnapshotChunk(2, 3, 0, b"abc")
    assert deliver(worker.send(piece), coordinator) == piece

    assert deliver(worker.send(messages.Log(LogLevel.INFO, "hi")), coordinator) == messages.Log(
        1, "hi"
    )
    sample = messages.Sample(2, 9, 0, 32, 64, 600, 80, 0, 200, 0)
    assert deliver(coordinator.send(sample), worker) == sample
    written = messages.SampleText(2, 9, b"The ", b"eggs")
    assert deliver(worker.send(written), coordinator) == written
    assert deliver(worker.send(messages.Heartbeat(5)), coordinator) == messages.Heartbeat(5)
    assert deliver(coordinator.send(messages.Heartbeat(6)), worker) == messages.Heartbeat(6)


def test_heartbeat_is_illegal_until_the_handshake_is_done() -> None:
    # An unauthenticated peer must not be able to keep its connection alive.
    worker, coordinator = Connection(Role.WORKER), Connection(Role.COORDINATOR)
    deliver(worker.send(HELLO), coordinator)
    with pytest.raises(LocalProtocolError):
        worker.send(messages.Heartbeat(1))
    coordinator.receive_data(encode_message(messages.Heartbeat(1)))
    with pytest.raises(RemoteProtocolError) as info:
        coordinator.next_event()
    assert info.value.error_code == ErrorCode.ILLEGAL_STATE


def test_frames_are_refused_by_header_before_the_payload_is_buffered() -> None:
    # A pre-auth HELLO header announcing 16 MiB: refused at the header, nothing buffered.
    coordinator = Connection(Role.COORDINATOR)
    coordinator.receive_data(HEADER.pack(MAGIC, PROTOCOL_VERSION, MsgType.HELLO, 0, 2**24, 0))
    with pytest.raises(RemoteProtocolError) as info:
        coordinator.next_event()
    assert info.value.error_code == ErrorCode.FRAME_TOO_LARGE
    assert "HELLO" in info.value.message and "4096" in info.value.message
    # A type that is illegal in this state: refused at the header as well.
    coordinator = Connection(Role.COORDINATOR)
    coordinator.receive_data(HEADER.pack(MAGIC, PROTOCOL_VERSION, MsgType.RESULT, 0, 10**6, 0))
    with pytest.raises(RemoteProtocolError) as info:
        coordinator.next_event()
    assert info.value.error_code == ErrorCode.ILLEGAL_STATE
    # After the handshake the protocol maximum applies.
    worker, coordinator = handshake()
    big = messages.SnapshotChunk(2, 3 * 2**20, 0, bytes(2**20))
    assert deliver(worker.send(big), coordinator) == big


def test_welcome_is_bounded_on_the_worker_side() -> None:
    worker = Connection(Role.WORKER)
    worker.send(HELLO)
    worker.receive_data(encode_message(messages.Challenge(NONCE)))
    worker.next_event()
    worker.send(messages.Auth(bytes(32)))
    too_big = WELCOME_MAX_PAYLOAD_BYTES + 1
    worker.receive_data(HEADER.pack(MAGIC, PROTOCOL_VERSION, MsgType.WELCOME, 0, too_big, 0))
    with pytest.raises(RemoteProtocolError) as info:
        worker.next_event()
    assert info.value.error_code == ErrorCode.FRAME_TOO_LARGE


def test_heartbeat_before_hello_is_illegal_on_receive() -> None:
    coordinator = Connection(Role.COORDINATOR)
    coordinator.receive_data(encode_message(messages.Heartbeat(0)))
    with pytest.raises(RemoteProtocolError) as info:
        coordinator.next_event()
    assert info.value.error_code == ErrorCode.ILLEGAL_STATE


@pytest.mark.parametrize(
    ("role", "message"),
    [
        (Role.WORKER, messages.JobRequest(0)),
        (Role.WORKER, messages.Auth(bytes(32))),
        (Role.WORKER, messages.Challenge(NONCE)),  # coordinator's message
        (Role.COORDINATOR, messages.Challenge(NONCE)),  # before HELLO arrived
        (Role.COORDINATOR, messages.Welcome(bytes(16), b"", 0, -1, 1)),
        (Role.COORDINATOR, messages.Job(0, 0, 0, 2)),
        (Role.COORDINATOR, messages.Hello(1, "", "", "", bytes(32))),
    ],
)
def test_illegal_send_raises_local_error_and_keeps_state(role: Role, message: Message) -> None:
    conn = Connection(role)
    with pytest.raises(LocalProtocolError) as info:
        conn.send(message)
    assert info.value.error_code == ErrorCode.ILLEGAL_STATE
    assert conn.state is State.START
    assert not conn.bytes_sent


def test_illegal_sends_in_ready() -> None:
    worker, coordinator = handshake()
    sample = messages.Sample(0, 0, 0, 1, 1, 0, 0, 0, 0, 0)
    for message in (
        messages.Job(0, 0, 0, 2),
        messages.Step(0, 0, b""),
        messages.Wait(1),
        HELLO,
        messages.Challenge(NONCE),
        sample,
    ):
        with pytest.raises(LocalProtocolError):
            worker.send(message)
    text = messages.SampleText(0, 0, b"", b"x")
    for message in (
        messages.JobRequest(0),
        messages.Log(1, "x"),
        messages.FitnessRequest(0, 1),
        HELLO,
        WELCOME,
        text,
    ):
        with pytest.raises(LocalProtocolError):
            coordinator.send(message)
    assert worker.state is State.READY and coordinator.state is State.READY


@pytest.mark.parametrize(
    ("role", "message"),
    [
        (Role.COORDINATOR, messages.JobRequest(0)),  # before the handshake
        (Role.COORDINATOR, messages.Auth(bytes(32))),  # AUTH before HELLO
        (Role.COORDINATOR, messages.Challenge(NONCE)),  # wrong direction
        (Role.WORKER, messages.Job(0, 0, 0, 2)),
        (Role.WORKER, messages.Welcome(bytes(16), b"", 0, -1, 1)),  # WELCOME before CHALLENGE
        (Role.WORKER, messages.Hello(1, "", "", "", bytes(32))),  # wrong direction
    ],
)
def test_illegal_receive_raises_remote_error_and_closes(role: Role, message: Message) -> None:
    conn = Connection(role)
    conn.receive_data(encode_message(message))
    with pytest.raises(RemoteProtocolError) as info:
        conn.next_event()
    assert info.value.error_code == ErrorCode.ILLEGAL_STATE
    assert conn.state is State.CLOSED
    # The error sticks.
    with pytest.raises(RemoteProtocolError):
        conn.next_event()
    with pytest.raises(RemoteProtocolError):
        conn.receive_data(b"more")


def test_illegal_receives_in_ready() -> None:
    cases = [
        ("coordinator", messages.Job(0, 0, 0, 2)),
        ("coordinator", WELCOME),
        ("coordinator", HELLO),
        ("worker", messages.JobRequest(0)),
        ("worker", messages.Log(1, "x")),
        ("worker", messages.SampleText(0, 0, b"", b"x")),
        ("coordinator", messages.Sample(0, 0, 0, 1, 1, 0, 0, 0, 0, 0)),
        ("worker", messages.Challenge(NONCE)),
    ]
    for side, message in cases:
        worker, coordinator = handshake()
        conn = coordinator if side == "coordinator" else worker
        conn.receive_data(encode_message(message))
        with pytest.raises(RemoteProtocolError) as info:
            conn.next_event()
        assert info.value.error_code == ErrorCode.ILLEGAL_STATE
        assert conn.state is State.CLOSED


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (b"EGGX" + encode_message(HELLO)[4:], ErrorCode.BAD_MAGIC),
        (encode_message(HELLO)[:4] + b"\x09" + encode_message(HELLO)[5:], ErrorCode.BAD_VERSION),
        (encode_message(HELLO)[:-1] + b"\xff", ErrorCode.BAD_CRC),
        (encode_frame(99, b""), ErrorCode.UNKNOWN_TYPE),
        (encode_frame(MsgType.HELLO, HELLO.encode()[:-1]), ErrorCode.MALFORMED),
        (encode_frame(MsgType.HELLO, HELLO.encode() + b"x"), ErrorCode.MALFORMED),
        (encode_frame(MsgType.HELLO, HELLO.encode(), flags=1), ErrorCode.MALFORMED),
    ],
)
def test_bad_input_to_connection(data: bytes, code: ErrorCode) -> None:
    conn = Connection(Role.COORDINATOR)
    conn.receive_data(data)
    with pytest.raises(RemoteProtocolError) as info:
        conn.next_event()
    assert info.value.error_code == code
    assert conn.state is State.CLOSED
    # The peer learns why.
    reply = conn.error_frame(info.value)
    peer = Connection(Role.WORKER)
    error = deliver(reply, peer)
    assert isinstance(error, messages.Error) and error.code == code
    assert peer.state is State.CLOSED


def test_oversize_frame_rejected_on_both_sides() -> None:
    worker, coordinator = Connection(Role.WORKER, 64), Connection(Role.COORDINATOR, 64)
    big = messages.Hello(1, "n" * 100, "", "", bytes(32))
    with pytest.raises(LocalProtocolError) as info:
        worker.send(big)
    assert info.value.error_code == ErrorCode.FRAME_TOO_LARGE
    assert worker.state is State.START
    coordinator.receive_data(encode_message(big)[:HEADER_SIZE])
    with pytest.raises(RemoteProtocolError) as remote:
        coordinator.next_event()
    assert remote.value.error_code == ErrorCode.FRAME_TOO_LARGE


@pytest.mark.parametrize("stage", range(5))
def test_error_in_any_state_closes_both_sides(stage: int) -> None:
    worker, coordinator = Connection(Role.WORKER), Connection(Role.COORDINATOR)
    steps = [
        lambda: deliver(worker.send(HELLO), coordinator),
        lambda: deliver(coordinator.send(messages.Challenge(NONCE)), worker),
        lambda: deliver(worker.send(messages.Auth(auth_mac(TOKEN, NONCE))), coordinator),
        lambda: deliver(coordinator.send(WELCOME), worker),
    ]
    for advance in steps[:stage]:
        advance()
    error = messages.Error(ErrorCode.SHUTTING_DOWN, "bye")
    sender, receiver = (coordinator, worker) if stage % 2 else (worker, coordinator)
    assert deliver(sender.send(error), receiver) == error
    assert sender.state is State.CLOSED and receiver.state is State.CLOSED
    # Nothing is legal after CLOSED, in either direction.
    with pytest.raises(LocalProtocolError):
        sender.send(messages.Heartbeat(0))
    with pytest.raises(LocalProtocolError):
        sender.send(error)
    receiver.receive_data(encode_message(messages.Heartbeat(0)))
    with pytest.raises(RemoteProtocolError) as info:
        receiver.next_event()
    assert info.value.error_code == ErrorCode.ILLEGAL_STATE


def test_send_error_always_allowed() -> None:
    worker, _ = handshake()
    first = worker.send_error(ErrorCode.DATA_MISMATCH, "digest differs")
    assert worker.state is State.CLOSED
    second = worker.send_error(ErrorCode.INTERNAL, "x" * 5000)  # clipped to the limit
    peer = Connection(Role.COORDINATOR)
    peer.receive_data(first)
    event = peer.next_event()
    assert event == messages.Error(ErrorCode.DATA_MISMATCH, "digest differs")
    assert messages.Error.decode(second[HEADER_SIZE:]).message == "x" * 1024
    assert worker.error_frame(ProtocolError(999, "from the future"))


def test_byte_counters() -> None:
    worker, coordinator = handshake()
    frame = worker.send(messages.JobRequest(3))
    deliver(frame, coordinator)
    assert worker.bytes_sent[MsgType.JOB_REQUEST] == len(frame) == HEADER_SIZE + 28
    assert coordinator.bytes_received[MsgType.JOB_REQUEST] == len(frame)
    assert worker.messages_sent[MsgType.HELLO] == 1
    assert coordinator.messages_received[MsgType.AUTH] == 1
    assert sum(worker.bytes_sent.values()) == sum(coordinator.bytes_received.values())
    assert sum(coordinator.bytes_sent.values()) == sum(worker.bytes_received.values())


def test_can_send() -> None:
    worker, coordinator = Connection(Role.WORKER), Connection(Role.COORDINATOR)
    assert worker.can_send(MsgType.HELLO) and not worker.can_send(MsgType.JOB_REQUEST)
    assert not coordinator.can_send(MsgType.STEP)
    worker, coordinator = handshake()
    assert coordinator.can_send(MsgType.STEP) and not coordinator.can_send(MsgType.WELCOME)


def test_transition_table_is_mirrored() -> None:
    """In READY, a message one role may send is exactly one the other may receive."""
    other = {Role.WORKER: Role.COORDINATOR, Role.COORDINATOR: Role.WORKER}
    for role, state, direction, msg_type in TRANSITIONS:
        if state is State.READY:
            flipped = Direction.RECEIVE if direction is Direction.SEND else Direction.SEND
            assert (other[role], State.READY, flipped, msg_type) in TRANSITIONS
    assert not any(state is State.CLOSED for _, state, _, _ in TRANSITIONS)
    for role in Role:
        for state in State:
            if state is not State.CLOSED:
                for direction in Direction:
                    assert TRANSITIONS[role, state, direction, MsgType.ERROR] is State.CLOSED
