"""Sans-I/O connection: the handshake and message-legality state machine for one peer.

Feed received bytes with `receive_data`, take messages with `next_event`, and turn
outgoing messages into bytes with `send`. Which message may go which way in which state
is written down once, in `TRANSITIONS`.

A frame is judged by its header, before its payload is buffered: an unknown type, a type
illegal in the current state, or a length over the state's limit ends the connection. Until
the handshake is done only a few KiB are allowed (`HANDSHAKE_MAX_PAYLOAD_BYTES`; WELCOME,
which carries the run config, `WELCOME_MAX_PAYLOAD_BYTES`), so a peer without the token can
make a coordinator buffer almost nothing.
"""

from __future__ import annotations

from collections import Counter
from enum import Enum

from .errors import ErrorCode, LocalProtocolError, ProtocolError, RemoteProtocolError
from .frames import DEFAULT_MAX_PAYLOAD_BYTES, HEADER_SIZE, FrameDecoder, encode_frame
from .messages import (
    MAX_ERROR_MESSAGE_BYTES,
    Error,
    Message,
    MsgType,
    clip_utf8,
    message_class,
)

__all__ = [
    "HANDSHAKE_MAX_PAYLOAD_BYTES",
    "TRANSITIONS",
    "WELCOME_MAX_PAYLOAD_BYTES",
    "Connection",
    "Direction",
    "Role",
    "State",
]

# HELLO is at most 461 bytes, CHALLENGE and AUTH 32; ERROR fits as well.
HANDSHAKE_MAX_PAYLOAD_BYTES = 4096
# The canonical run config is about 1 KiB; a larger WELCOME is an impostor's.
WELCOME_MAX_PAYLOAD_BYTES = 64 * 1024


class Role(Enum):
    COORDINATOR = "coordinator"
    WORKER = "worker"


class State(Enum):
    START = "start"
    # worker handshake
    HELLO_SENT = "hello_sent"
    CHALLENGED = "challenged"
    AUTH_SENT = "auth_sent"
    # coordinator handshake
    HELLO_RECEIVED = "hello_received"
    CHALLENGE_SENT = "challenge_sent"
    AUTHENTICATED = "authenticated"
    # both
    READY = "ready"
    CLOSED = "closed"


class Direction(Enum):
    SEND = "send"
    RECEIVE = "receive"


def _build_transitions() -> dict[tuple[Role, State, Direction, MsgType], State]:
    W, C = Role.WORKER, Role.COORDINATOR
    SEND, RECV = Direction.SEND, Direction.RECEIVE
    S, T = State, MsgType

    table = {
        # Worker handshake.
        (W, S.START, SEND, T.HELLO): S.HELLO_SENT,
        (W, S.HELLO_SENT, RECV, T.CHALLENGE): S.CHALLENGED,
        (W, S.CHALLENGED, SEND, T.AUTH): S.AUTH_SENT,
        (W, S.AUTH_SENT, RECV, T.WELCOME): S.READY,
        # Coordinator handshake, the mirror image.
        (C, S.START, RECV, T.HELLO): S.HELLO_RECEIVED,
        (C, S.HELLO_RECEIVED, SEND, T.CHALLENGE): S.CHALLENGE_SENT,
        (C, S.CHALLENGE_SENT, RECV, T.AUTH): S.AUTHENTICATED,
        (C, S.AUTHENTICATED, SEND, T.WELCOME): S.READY,
    }
    # READY: what the worker sends the coordinator receives, and the reverse.
    worker_to_coordinator = (
        T.JOB_REQUEST,
        T.RESULT,
        T.FITNESS_REQUEST,
        T.SNAPSHOT_REQUEST,
        T.SNAPSHOT_CHUNK,
        T.HEARTBEAT,
        T.LOG,
        T.VALIDATION,
        T.SAMPLE_TEXT,
        T.CLAIM,
    )
    coordinator_to_worker = (
        T.JOB,
        T.WAIT,
        T.STEP,
        T.FITNESS_RANGE,
        T.SNAPSHOT_REQUEST,
        T.SNAPSHOT_CHUNK,
        T.HEARTBEAT,
        T.VALIDATE,
        T.SAMPLE,
        T.CLAIM,
    )
    for t in worker_to_coordinator:
        table[W, S.READY, SEND, t] = S.READY
        table[C, S.READY, RECV, t] = S.READY
    for t in coordinator_to_worker:
        table[C, S.READY, SEND, t] = S.READY
        table[W, S.READY, RECV, t] = S.READY
    # No HEARTBEAT before the handshake is done: it must not extend an unauthenticated
    # peer's stay.
    # ERROR ends the connection from any open state, either way.
    for role in Role:
        for state in State:
            if state is not S.CLOSED:
                for direction in Direction:
                    table[role, state, direction, T.ERROR] = S.CLOSED
    return table


# (role, state, direction, message type) -> next state. Absent = illegal. Nothing leaves
# CLOSED.
TRANSITIONS: dict[tuple[Role, State, Direction, MsgType], State] = _build_transitions()


class Connection:
    """Protocol state of one connection, seen from `role`'s side.

    `next_event` raises RemoteProtocolError for anything bad from the peer (framing, an
    unknown type, a malformed payload, a message illegal in the current state); the
    connection is then CLOSED and the same error is raised again on every later
    `receive_data`/`next_event`. Reply with `error_frame(exc)` before closing the socket.
    `send` raises LocalProtocolError for a message illegal in the current state; nothing
    is produced and the state is unchanged.

    Both sides use the same payload limit, so `send` refuses what the peer would reject.
    """

    def __init__(self, role: Role, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> None:
        self.role = role
        self.max_payload_bytes = max_payload_bytes
        self._state = State.START
        self._decoder = FrameDecoder(max_payload_bytes, check_header=self._check_header)
        self._remote_error: RemoteProtocolError | None = None
        self._incoming: tuple[type[Message], State] | None = None  # set by _check_header
        # Whole frames (header included) per message type, for metrics.
        self.bytes_sent: Counter[MsgType] = Counter()
        self.bytes_received: Counter[MsgType] = Counter()
        self.messages_sent: Counter[MsgType] = Counter()
        self.messages_received: Counter[MsgType] = Counter()

    @property
    def state(self) -> State:
        return self._state

    @property
    def closed(self) -> bool:
        return self._state is State.CLOSED

    def can_send(self, msg_type: MsgType) -> bool:
        """Whether a message of this type may be sent in the current state."""
        return (self.role, self._state, Direction.SEND, msg_type) in TRANSITIONS

    def receive_data(self, data: bytes) -> None:
        """Buffer bytes received from the peer."""
        if self._remote_error is not None:
            raise self._remote_error
        self._decoder.feed(data)

    def next_event(self) -> Message | None:
        """Next message from the peer, or None until more data arrives."""
        if self._remote_error is not None:
            raise self._remote_error
        try:
            return self._next_event()
        except RemoteProtocolError as exc:
            self._remote_error = exc
            self._state = State.CLOSED
            raise

    def _check_header(self, msg_type: int, flags: int, length: int) -> None:
        """Refuse a frame from its header alone, before its payload is buffered."""
        cls = message_class(msg_type)
        if flags != 0:
            raise RemoteProtocolError(
                ErrorCode.MALFORMED, f"flags {flags:#06x} set; version 1 defines none"
            )
        next_state = TRANSITIONS.get((self.role, self._state, Direction.RECEIVE, cls.TYPE))
        if next_state is None:
            raise RemoteProtocolError(
                ErrorCode.ILLEGAL_STATE,
                f"{cls.TYPE.name} may not reach a {self.role.value} in state {self._state.name}",
            )
        limit = self.max_payload_bytes
        if self._state is not State.READY:
            handshake = HANDSHAKE_MAX_PAYLOAD_BYTES
            limit = WELCOME_MAX_PAYLOAD_BYTES if cls.TYPE is MsgType.WELCOME else handshake
        if length > limit:
            raise RemoteProtocolError(
                ErrorCode.FRAME_TOO_LARGE,
                f"{cls.TYPE.name} payload of {length} bytes exceeds the limit of {limit} "
                f"in state {self._state.name}",
            )
        self._incoming = (cls, next_state)  # the frame's class and where it leads, once in

    def _next_event(self) -> Message | None:
        frame = self._decoder.next_frame()  # its header passed _check_header
        if frame is None:
            return None
        assert self._incoming is not None
        cls, next_state = self._incoming
        message = cls.decode(frame.payload)
        self.bytes_received[cls.TYPE] += HEADER_SIZE + len(frame.payload)
        self.messages_received[cls.TYPE] += 1
        self._state = next_state
        return message

    def send(self, message: Message) -> bytes:
        """Frame bytes for `message`; LocalProtocolError if it is illegal now."""
        if not isinstance(message, Message):
            raise TypeError(f"expected a Message, got {type(message).__name__}")
        msg_type = message.TYPE
        next_state = TRANSITIONS.get((self.role, self._state, Direction.SEND, msg_type))
        if next_state is None:
            raise LocalProtocolError(
                ErrorCode.ILLEGAL_STATE,
                f"a {self.role.value} may not send {msg_type.name} in state {self._state.name}",
            )
        payload = message.encode()
        if len(payload) > self.max_payload_bytes:
            raise LocalProtocolError(
                ErrorCode.FRAME_TOO_LARGE,
                f"{msg_type.name} payload of {len(payload)} bytes exceeds the limit of "
                f"{self.max_payload_bytes}",
            )
        frame = encode_frame(msg_type, payload)
        self._count_sent(msg_type, len(frame))
        self._state = next_state
        return frame

    def send_error(self, code: ErrorCode, message: str = "") -> bytes:
        """ERROR frame; allowed in every state, even CLOSED, and leaves the state CLOSED."""
        error = Error(code, clip_utf8(message, MAX_ERROR_MESSAGE_BYTES))
        frame = encode_frame(MsgType.ERROR, error.encode())
        self._count_sent(MsgType.ERROR, len(frame))
        self._state = State.CLOSED
        return frame

    def error_frame(self, exc: ProtocolError) -> bytes:
        """ERROR frame telling the peer about `exc` (see `send_error`)."""
        code = exc.error_code if isinstance(exc.error_code, ErrorCode) else ErrorCode.INTERNAL
        return self.send_error(code, exc.message)

    def _count_sent(self, msg_type: MsgType, size: int) -> None:
        self.bytes_sent[msg_type] += size
        self.messages_sent[msg_type] += 1
