"""What the run core reports: events that happened in the run, for the shell to record.

The core (`run.py`) neither measures nor logs; it returns these beside its commands, and the
server's executor (`server.py`) records them: `record.py` decides how each is measured
(`metrics.py`) and logged (shared/logs.py names the events eggroll-local reads). Plain frozen
data, no behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..protocol import ErrorCode, Validation

__all__ = [
    "CatchupServed",
    "ChunkAccepted",
    "ChunkChecked",
    "ChunkTimed",
    "Committed",
    "DataDigestAgreed",
    "DigestMismatch",
    "DigestsDisagree",
    "Event",
    "FileDegraded",
    "Joined",
    "Leased",
    "Left",
    "NoSnapshotSource",
    "Nondeterministic",
    "Outvoted",
    "Overprovisioned",
    "Progress",
    "Rejected",
    "Requeued",
    "ResultDropped",
    "RewindOutside",
    "Rewound",
    "Sampled",
    "SnapshotDropped",
    "SnapshotRejected",
    "SnapshotStored",
    "Stalled",
    "Unchecked",
    "Undecided",
    "Validated",
    "WorkerError",
    "WorkerLog",
]


@dataclass(frozen=True)
class Event:
    """Something that happened in the run; the shell decides how it is measured and logged."""


@dataclass(frozen=True)
class Joined(Event):
    worker: str
    address: str
    workers: int  # past the handshake, this one included
    machine: str = ""  # its certificate's identity, where that stands for its machine


@dataclass(frozen=True)
class SharedIdentity(Event):
    """One certificate identity connected from several addresses at once (said once)."""

    machine: str
    addresses: tuple[str, ...]


@dataclass(frozen=True)
class Overprovisioned(Event):
    """A worker joined past one per chunk: the workers beyond the step's chunks wait, or
    score check and backup copies (said once, as their number passes the chunks)."""

    workers: int
    chunks: int
    chunk_size: int  # members a chunk: a population of workers x this keeps them all busy


@dataclass(frozen=True)
class NameShared(Event):
    """A worker joined under the name of one connected already: the logs and metrics of the
    two cannot be told apart (each is still its own worker to the run)."""

    worker: str
    address: str
    other: str  # the address of the one that has the name


@dataclass(frozen=True)
class Left(Event):
    worker: str
    workers: int
    namesakes: int = 0  # connected workers still using its name: they keep its series


@dataclass(frozen=True)
class Rejected(Event):
    """A peer is refused with ERROR(code)."""

    worker: str
    code: ErrorCode
    reason: str


@dataclass(frozen=True)
class DataDigestAgreed(Event):
    digest: bytes
    workers: int


@dataclass(frozen=True)
class DigestMismatch(Event):
    """A replica digest differs from the step's agreed one (the worker is refused)."""

    worker: str
    step: int


@dataclass(frozen=True)
class DigestsDisagree(Event):
    """Workers report different digests for a step none has agreed yet (once per step)."""

    step: int
    digests: int


@dataclass(frozen=True)
class Leased(Event):
    worker: str
    step: int
    chunk: int


@dataclass(frozen=True)
class ChunkTimed(Event):
    """A worker's RESULT for the open step, `seconds` after its lease."""

    worker: str
    seconds: float
    member_tokens: int


@dataclass(frozen=True)
class ChunkAccepted(Event):
    worker: str
    step: int
    chunk: int


@dataclass(frozen=True)
class ChunkChecked(Event):
    """Checks by a second worker: "agreed" (it confirmed the result), "disputed" (results
    differ: further workers decide), "waived" (no other machine connected could check)."""

    result: str
    step: int
    chunks: tuple[int, ...]


@dataclass(frozen=True)
class Outvoted(Event):
    """A worker's result lost a vote: its results of the step are dropped, every result
    from its machine is checked from now on, and it is refused at its next message."""

    worker: str
    address: str
    step: int
    chunk: int


@dataclass(frozen=True)
class Rewound(Event):
    """A conviction undid steps `first`..`end`-1 (rewind.py): the fitness log holds `first`
    steps again, `chunks` suspect results were among them, the tail is kept in `kept`."""

    first: int
    end: int
    chunks: int
    why: str
    kept: str


@dataclass(frozen=True)
class RewindOutside(Event):
    """A convicted machine's unconfirmed results of steps `first`..`last` lie beyond the
    rewind horizon (--rewind-steps): they stay."""

    first: int
    last: int
    chunks: int
    why: str


@dataclass(frozen=True)
class Stalled(Event):
    """A worker held up a check and has done no work for `seconds` (a lease unanswered
    past its overdue time, or no RESULT while not waiting for a job): the check was
    waived without it. Reported once until its next RESULT."""

    worker: str
    address: str
    step: int
    seconds: int


@dataclass(frozen=True)
class Undecided(Event):
    """Results for a chunk differ, and every machine connected (and not stalled) has
    voted on it: the step waits for another machine to join and decide it."""

    step: int
    chunk: int
    hosts: tuple[str, ...]  # the machines (addresses or certificates) whose results differ


@dataclass(frozen=True)
class Unchecked(Event):
    """Results of a machine that lost a vote, which no connected machine can check: they are
    never taken unchecked, so the step waits for a worker on another machine to join."""

    step: int
    chunks: tuple[int, ...]
    hosts: tuple[str, ...]  # the convicted machines whose results wait


@dataclass(frozen=True)
class Nondeterministic(Event):
    """Honest-looking machines compute different fitness for the same chunk and no machine
    can decide (`undecided`), or no one machine differs in every dispute of the recent
    steps: the likeliest cause is a reward or objective that is not a pure function of its
    inputs. The coordinator stops, every committed step kept; `message` is its one line."""

    step: int
    chunk: int
    workers: tuple[str, ...]  # the workers whose results differ (names, else machines)
    undecided: bool
    message: str


@dataclass(frozen=True)
class ResultDropped(Event):
    """A RESULT not used; `refused`: its worker is refused for it (the refusal is logged)."""

    reason: str  # an `Outcome` value, or "diverged"
    worker: str
    step: int
    chunk: int
    refused: bool = False


@dataclass(frozen=True)
class Requeued(Event):
    reason: str  # "disconnect" or "deadline"
    chunks: tuple[int, ...]
    step: int


@dataclass(frozen=True)
class Progress(Event):
    """A long step's progress: `step` is the one being worked on, counted from 1."""

    step: int
    chunks_done: int
    chunks: int
    seconds: int


@dataclass(frozen=True)
class Committed(Event):
    """Step `step` (counted from 0, as STEP carries it) is durable; `seconds` from its first
    lease, `loss_bits` the population's mean bits per token, or for a reward run `reward`
    its mean reward per completion (and `loss_bits` NaN)."""

    step: int
    seconds: float
    loss_bits: float
    member_tokens: int
    changed: int  # int8 weights changed by the update before it (0: unknown)
    workers: int
    requeued: int  # chunk re-queues during the step
    reward: float | None = None


@dataclass(frozen=True)
class CatchupServed(Event):
    worker: str
    first_step: int
    steps: int


@dataclass(frozen=True)
class NoSnapshotSource(Event):
    """A final snapshot is wanted, and no worker is at the step to send it."""

    step: int


@dataclass(frozen=True)
class SnapshotRejected(Event):
    worker: str
    reason: str


@dataclass(frozen=True)
class SnapshotDropped(Event):
    """A snapshot a worker uploaded could not be stored (nothing of it is left); the run
    goes on and the next snapshot step tries again."""

    step: int
    worker: str
    path: str
    error: str
    free_bytes: int | None  # free space where it was written (None: unknown)


@dataclass(frozen=True)
class FileDegraded(Event):
    """A write to digests.log, run.json or history.log failed; the first two keep their
    content in memory and write it again at the next chance, history.log drops the record
    (reported once per spell of failures)."""

    path: str
    error: str
    free_bytes: int | None


@dataclass(frozen=True)
class SnapshotStored(Event):
    step: int
    worker: str
    bytes: int
    digest: str  # hex


@dataclass(frozen=True)
class Validated(Event):
    """The held-out score asked for arrived (the VALIDATION message holds every number)."""

    worker: str
    scores: Validation


@dataclass(frozen=True)
class Sampled(Event):
    """The sample asked for arrived; prompt and text escaped to one line each."""

    step: int
    worker: str
    prompt: str
    text: str


@dataclass(frozen=True)
class WorkerLog(Event):
    worker: str
    level: int
    text: str


@dataclass(frozen=True)
class WorkerLogsDropped(Event):
    """A worker sent LOG lines faster than the coordinator's log takes them: these were
    dropped (said with its next line that goes through)."""

    worker: str
    lines: int


@dataclass(frozen=True)
class WorkerError(Event):
    worker: str
    code: int
    text: str
