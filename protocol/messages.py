"""Protocol messages: the registry from type number to class, the decoder and encoder,
and every message name in one place.

The classes live by what they carry: `session_messages` (handshake, job flow, heartbeat,
log, error) and `replica_messages` (fitness catch-up, snapshots, validation, samples), both
on the shared base in `codec`.
"""

from __future__ import annotations

from . import replica_messages, session_messages
from .codec import Message, MsgType, clip_utf8
from .errors import ErrorCode, RemoteProtocolError
from .frames import encode_frame

# Every name of the two message modules, re-exported (see __all__).
from .replica_messages import *  # noqa: F403
from .session_messages import *  # noqa: F403

__all__ = [
    "Message",
    "MsgType",
    "clip_utf8",
    *replica_messages.__all__,
    *session_messages.__all__,
    "decode_message",
    "encode_message",
    "message_class",
]


# ---------------------------------------------------------------------------------------
# Registry.

_CLASSES: dict[int, type[Message]] = {
    cls.TYPE: cls
    for cls in (
        session_messages.Hello,
        session_messages.Challenge,
        session_messages.Auth,
        session_messages.Welcome,
        session_messages.JobRequest,
        session_messages.Job,
        session_messages.Wait,
        session_messages.Result,
        session_messages.Step,
        replica_messages.FitnessRequest,
        replica_messages.FitnessRange,
        replica_messages.SnapshotRequest,
        replica_messages.SnapshotChunk,
        session_messages.Heartbeat,
        session_messages.Log,
        session_messages.Error,
        replica_messages.Validate,
        replica_messages.Validation,
        replica_messages.Sample,
        replica_messages.SampleText,
        session_messages.Claim,
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
