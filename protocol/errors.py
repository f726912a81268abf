"""Protocol exceptions and the error codes carried by ERROR frames.

A `ProtocolError` always carries an `ErrorCode`, so whoever catches it can tell the peer
why the connection ends. `LocalProtocolError` means we tried to send something illegal
(a bug on our side); `RemoteProtocolError` means the peer sent something bad.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = [
    "ErrorCode",
    "LocalProtocolError",
    "ProtocolError",
    "RemoteProtocolError",
    "TernaryError",
]


class ErrorCode(IntEnum):
    """u16 code of an ERROR message; the meaning of each is specified in SPEC.md."""

    BAD_MAGIC = 1
    BAD_VERSION = 2
    BAD_CRC = 3
    FRAME_TOO_LARGE = 4
    UNKNOWN_TYPE = 5
    MALFORMED = 6
    ILLEGAL_STATE = 7
    AUTH_FAILED = 8
    CONFIG_MISMATCH = 9
    DATA_MISMATCH = 10
    TOO_OLD = 11
    SHUTTING_DOWN = 12
    INTERNAL = 13
    DIVERGED = 14  # the replica's digest differs from the agreed one: drop it and resync
    BUSY = 15  # the coordinator serves no more connections (from this address): retry later


# The message of the SHUTTING_DOWN error that ends a run which reached its last step: the
# worker stops for good instead of reconnecting.
RUN_COMPLETE = "run complete"

# The message of the DIVERGED error that refuses the other workers of a machine one of whose
# workers was outvoted: they resync too, but their own replica and fitness were not found
# wrong (a worker counts only its own divergences toward giving up).
ADDRESS_OUTVOTED = "another worker at this address was outvoted: resync"

# The message of the DIVERGED error that closes every connection when the run rewinds (SPEC
# §8 Rewinds): the worker reconnects at once, keeping its replica unless WELCOME shows it
# ahead of the run; not a divergence of its own.
RUN_REWOUND = "the run rewound: reconnect"


class ProtocolError(Exception):
    """A violation of the wire protocol; `error_code` says which kind."""

    def __init__(self, error_code: ErrorCode | int, message: str = "") -> None:
        try:
            code: ErrorCode | int = ErrorCode(error_code)
        except ValueError:
            # A code from a newer peer stays a plain int rather than failing here.
            code = int(error_code)
        # args mirror the constructor, so the exception pickles and copies intact.
        super().__init__(code, message)
        self.error_code = code
        self.message = message

    def __str__(self) -> str:
        name = _code_name(self.error_code)
        return f"{name}: {self.message}" if self.message else name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({_code_name(self.error_code)}, {self.message!r})"


class LocalProtocolError(ProtocolError):
    """We tried to send something the protocol does not allow."""


class RemoteProtocolError(ProtocolError):
    """The peer sent something the protocol does not allow."""


class TernaryError(ValueError):
    """Values or bytes that are not a canonical ternary packing."""


def _code_name(code: ErrorCode | int) -> str:
    return code.name if isinstance(code, ErrorCode) else f"code {int(code)}"
