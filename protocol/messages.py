"""Protocol messages: the registry from type number to class, the decoder and encoder,
and every message name in one place.

The classes live by what they carry: `session_messages` (handshake, job flow, heartbeat,
log, error) and `replica_messages` (fitness catch-up, snapshots, validation, samples), both
on the shared base in `codec`.
"""

from __future__ import annotations

from .codec import Message, MsgType, clip_utf8
from .errors import ErrorCode, RemoteProtocolError
from .frames import encode_frame
from .replica_messages import (
    LATEST_SNAPSHOT,
    MAX_SAMPLE_TEXT_BYTES,
    MAX_SAMPLE_TOKENS,
    SNAPSHOT_CHUNK_BYTES,
    FitnessRange,
    FitnessRequest,
    Sample,
    SampleText,
    SnapshotChunk,
    SnapshotRequest,
    Validate,
    Validation,
    iter_snapshot_chunks,
)
from .session_messages import (
    DIGEST_BYTES,
    MAC_BYTES,
    MAX_BACKEND_BYTES,
    MAX_CHUNKS_PER_REQUEST,
    MAX_DEVICE_BYTES,
    MAX_ERROR_MESSAGE_BYTES,
    MAX_LOG_TEXT_BYTES,
    MAX_WORKER_NAME_BYTES,
    NO_SNAPSHOT,
    NONCE_BYTES,
    RUN_ID_BYTES,
    Auth,
    Challenge,
    Error,
    Heartbeat,
    Hello,
    Job,
    JobRequest,
    Log,
    LogLevel,
    Result,
    Step,
    Wait,
    Welcome,
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
    "clip_utf8",
    "decode_message",
    "encode_message",
    "iter_snapshot_chunks",
    "message_class",
]


# ---------------------------------------------------------------------------------------
# Registry.

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
