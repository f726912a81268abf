"""The run core's data (`run.py`): what it is told (`RunOptions`), what it keeps of each
connected worker (`Peer`) and of each request/reply pair it starts (`Want`), what the shell's
gauges read of it (`Status`), the commands it hands the shell to carry out (`Send`,
`ServeSnapshot`, `StoreSnapshot`), and what it raises (`Refused`, `Fatal`, `Halted`). Plain
data, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..protocol import ErrorCode, Message
from .events import Event

__all__ = [
    "LOG_BURST",
    "LOG_PER_S",
    "Command",
    "Fatal",
    "Halted",
    "Output",
    "Peer",
    "Refused",
    "RunOptions",
    "Send",
    "ServeSnapshot",
    "Status",
    "StoreSnapshot",
    "Want",
]

# --- commands (what the shell carries out) ---------------------------------------------------


LOG_BURST = 20  # LOG lines a worker may send at once (a Peer's allowance)
LOG_PER_S = 1.0  # and then this many a second


@dataclass(frozen=True)
class Send:
    peer: int
    msg: Message


@dataclass(frozen=True)
class ServeSnapshot:
    """Stream the stored snapshot `step` to `peer` as SNAPSHOT_CHUNKs."""

    peer: int
    step: int


@dataclass(frozen=True)
class StoreSnapshot:
    """A snapshot arrived whole from `peer`: decode it, then `snapshot_decoded`."""

    peer: int
    blob: bytes


@dataclass(frozen=True)
class Close:
    """Send `peer` ERROR(code, message) and close its connection (the run rewound)."""

    peer: int
    code: ErrorCode
    message: str


Command = Send | ServeSnapshot | StoreSnapshot | Close

Output = Command | Event


# --- what the core raises ---------------------------------------------------------------------


class Fatal(Exception):
    """The run cannot go on safely (a failed fitness-log append): stop the coordinator.
    str() is one line that says what happened and what to do."""


class Halted(Exception):
    """The run cannot go on as it is set up (results that differ where no machine can decide:
    a reward that is not deterministic): the coordinator stops, every committed step kept,
    and a restart resumes. str() is one line that says why and what to do."""


class Refused(Exception):
    """The peer breaks a rule of the run: send ERROR(code, message) and close. `events` are
    what happened on the way (the refusal itself last but for what a caller adds)."""

    def __init__(self, code: ErrorCode, message: str, events: list[Event] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.events: list[Event] = events if events is not None else []


# --- the core's state ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RunOptions:
    """What the operator decides about a run's course (`eggroll-coordinator` flags)."""

    token: bytes = b""  # the AUTH secret; none: protected mode, loopback peers only
    data_digest: bytes | None = None  # from the operator (--data-dir, --data-digest)
    max_steps: int | None = None
    snapshot_every: int = 100  # 0: only the final snapshot
    sample_every: int = 0  # 0: no samples
    chunk_timeout_s: float | None = None  # None: adapted to observed chunk times
    verify_fraction: float = 0.0  # share of each step's chunks a second worker checks
    rewind_steps: int = 300  # how far back a conviction may undo steps (0: never)


@dataclass(frozen=True)
class Status:
    """What the run's gauges show, read by the shell at scrape time."""

    step: int  # the open step = steps committed
    workers: int  # past the handshake
    weights_changed: int | None  # reported with the open step's agreed replica
    undecided: int = 0  # disputed chunks no connected machine can decide


@dataclass(eq=False)
class Peer:
    """What the run knows of one connected worker."""

    id: int
    address: str
    name: str = "?"
    nonce: bytes = b""
    data_digest: bytes = b""
    ready: bool = False  # WELCOME sent
    replica_step: int | None = None  # from its last JOB_REQUEST
    broadcast_from: int = 0  # every STEP from this step on has been sent to this worker
    waiting: bool = False  # told to WAIT; gets a JOB pushed when one frees up
    snapshot: bytearray | None = None  # a snapshot being received from this worker
    snapshot_total: int = 0  # its size, fixed by the first chunk
    # chunk -> lease time and the chunks leased with it (scored together in one pass)
    job_started: dict[int, tuple[float, int]] = field(default_factory=dict)
    outvoted: str = ""  # why it is refused at its next message (its result lost a vote)
    # (step, chunk) -> how many CLAIMs its lease was sent (runs checked by claims)
    claims_seen: dict[tuple[int, int], int] = field(default_factory=dict)
    # Its WELCOME, last RESULT or last JOB_REQUEST at the open step: when it last did or
    # asked for work (a hung worker does neither)
    worked: float = 0.0
    stalled: bool = False  # reported as stalled (`Stalled`), until its next RESULT
    # Its LOG lines: a bucket of LOG_BURST refilled at LOG_PER_S, and those dropped since
    log_allowance: float = float("inf")  # full at its first line
    log_at: float = 0.0
    logs_dropped: int = 0

    # What stands for its machine in the checks: its certificate's identity (mutual TLS
    # with --machine-identity certificate), else its address without the port
    machine: str = ""

    @property
    def host(self) -> str:
        return self.machine or self.address_host

    @property
    def address_host(self) -> str:
        return self.address.rsplit(":", 1)[0]


@dataclass
class Want:
    """One request/reply pair the core starts (SNAPSHOT_REQUEST, VALIDATE, SAMPLE): the step
    whose answer is wanted, and the (peer, step) asked for it. Only the peer asked, for the
    step asked, answers it."""

    step: int | None = None  # wanted, nobody asked yet
    asked: tuple[int, int] | None = None  # (peer, step) asked, the answer not yet in

    def at(self, peer: Peer) -> bool:
        """Whether `peer`'s replica is at the wanted step."""
        return self.step is not None and peer.replica_step == self.step

    def ask(self, peer: Peer) -> int:
        """`peer` is asked for the wanted step, which is no longer wanted; returns it."""
        assert self.step is not None
        step, self.step = self.step, None
        self.asked = (peer.id, step)
        return step

    def answered(self, peer_id: int, step: int) -> bool:
        """Whether this is the answer asked for; it is awaited no more."""
        if self.asked != (peer_id, step):
            return False
        self.asked = None
        return True

    def drop(self, peer_id: int) -> int | None:
        """`peer_id` will not answer (it left, or its answer failed): the step it was asked
        for, awaited no more; None when it was not asked."""
        if self.asked is None or self.asked[0] != peer_id:
            return None
        step, self.asked = self.asked[1], None
        return step

    def retry(self, peer_id: int) -> None:
        """`peer_id` will not answer: want its step again, unless a later one is wanted."""
        step = self.drop(peer_id)
        if step is not None and self.step is None:
            self.step = step

    def pending(self, step: int) -> bool:
        """Whether an answer for `step` is still wanted or awaited."""
        return self.step == step or (self.asked is not None and self.asked[1] == step)
