"""What the worker's session and its shell (worker/link.py) share: how a session ends (its
exceptions and exit statuses), its phases, the commands it returns for the shell to carry
out, what it reads of the replica, and the worker's identity. Pure, like the session.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..protocol import ErrorCode, Message, messages
from ..protocol.messages import MAX_WORKER_NAME_BYTES
from ..shared.config import RunConfig
from ..shared.data import Dataset
from ..shared.replica import ReplicaState
from .backend import BackendFactory

__all__ = [
    "COMPUTES_DIFFERENTLY",
    "FATAL_CODES",
    "FINISHED",
    "FITNESS_STEPS_PER_REQUEST",
    "QUIET_S",
    "Apply",
    "Command",
    "DecodeSnapshot",
    "DropReplica",
    "Ended",
    "Evaluate",
    "ExportSnapshot",
    "Identity",
    "InstallSnapshot",
    "PeerViolation",
    "Phase",
    "ReplicaView",
    "RunFinished",
    "RunSample",
    "RunValidation",
    "Send",
    "StartReplica",
    "WorkerFatal",
]

# SPEC §8: these mean the worker can never join this run as it is; reconnecting won't help.
FATAL_CODES = frozenset(
    {
        ErrorCode.BAD_VERSION,
        ErrorCode.AUTH_FAILED,
        ErrorCode.DATA_MISMATCH,
        ErrorCode.CONFIG_MISMATCH,
    }
)
# Steps asked for per FITNESS_REQUEST: one progress line per batch while catching up.
FITNESS_STEPS_PER_REQUEST = 256
QUIET_S = 2.0  # a replay or snapshot download quicker than this logs no progress lines


class WorkerFatal(Exception):
    """The worker cannot take part in this run (SPEC §8 permanent errors); str() is one line
    that says what to do. `code` is the ERROR code behind it; `tell` says whether the
    coordinator must be sent ERROR(code) first (it is the worker that refuses); `status` is
    the command's exit status: 2, or COMPUTES_DIFFERENTLY where the fault may be this
    worker's device alone (its host's other workers go on)."""

    def __init__(
        self, message: str, code: ErrorCode | None = None, tell: bool = False, status: int = 2
    ) -> None:
        super().__init__(message)
        self.code = code
        self.tell = tell
        self.status = status


COMPUTES_DIFFERENTLY = 3  # exit status: told DIVERGED again and again (a faulty device?)


class RunFinished(Exception):
    """The coordinator ended the run at its last step: nothing is left to do (one line)."""


FINISHED = "is complete: nothing left"  # in RunFinished's line (eggroll-ray looks for it)


class Ended(Exception):
    """This connection is over; reconnect. The message (one line) says why;
    `drop_replica` says the replica must start again from step 0 (DIVERGED); `own` that it
    was this worker's replica or fitness that was found wrong (not another worker's at its
    address)."""

    def __init__(self, message: str, drop_replica: bool = False, own: bool = False) -> None:
        super().__init__(message)
        self.drop_replica = drop_replica
        self.own = own


class PeerViolation(Exception):
    """The coordinator sent well-formed frames that break the session flow of SPEC §8."""


class Phase(enum.Enum):
    HELLO_SENT = "hello sent"  #: waiting for CHALLENGE
    AUTH_SENT = "auth sent"  #: waiting for WELCOME
    IDLE = "idle"  #: nothing outstanding; `advance()` asks for what comes next
    LOADING_SNAPSHOT = "loading snapshot"  #: SNAPSHOT_REQUEST sent, chunks arriving
    CATCHING_UP = "catching up"  #: FITNESS_REQUEST sent
    REQUESTED = "requested"  #: JOB_REQUEST sent
    WAITING = "waiting"  #: told to WAIT until `retry_at`
    EVALUATING = "evaluating"  #: a JOB is with the shell


# --- commands (what the shell carries out) ---------------------------------------------------


@dataclass(frozen=True)
class Send:
    msg: Message


@dataclass(frozen=True)
class Evaluate:
    """Evaluate the jobs of one request together (one backend call); then
    `evaluated(jobs, results, seconds)`."""

    jobs: tuple[messages.Job, ...]
    # Per job, the token ids of each result to check (CLAIMs before its JOB), in order
    claims: tuple[tuple[np.ndarray, ...], ...] = ()


@dataclass(frozen=True)
class Apply:
    """Apply committed steps' fitness (one array of int8 per step) in order."""

    fitness: list[np.ndarray]


@dataclass(frozen=True)
class DropReplica:
    reason: str


@dataclass(frozen=True)
class StartReplica:
    """A fresh replica at step 0 of this run."""

    config: RunConfig
    run_id: bytes


@dataclass(frozen=True)
class DecodeSnapshot:
    """Decode a downloaded blob; then `snapshot_decoded(state or error)`."""

    blob: bytes
    step: int


@dataclass(frozen=True)
class InstallSnapshot:
    state: ReplicaState


@dataclass(frozen=True)
class ExportSnapshot:
    """Stream the replica's current state as SNAPSHOT_CHUNKs."""

    requested: int


@dataclass(frozen=True)
class RunValidation:
    """Score the replica of `step` on valid.bin: its weights copied now, scored while the
    worker goes on with later steps where the backend can (else at once); then
    `validated(step, score, seconds)` once the scores are in, between other commands."""

    step: int


@dataclass(frozen=True)
class RunSample:
    """Write the sample asked for with the unperturbed replica; then
    `sampled(request, prompt, text, seconds)`."""

    request: messages.Sample


Command = (
    Send
    | Evaluate
    | Apply
    | DropReplica
    | StartReplica
    | DecodeSnapshot
    | InstallSnapshot
    | ExportSnapshot
    | RunValidation
    | RunSample
)


class ReplicaView(Protocol):
    """What the session reads of the replica (`worker/replica.py`); step -1: none."""

    step: int
    digest: int
    weights_changed: int
    run_id: bytes | None

    @property
    def config_digest(self) -> bytes | None: ...

    @property
    def parallel_chunks(self) -> int: ...


@dataclass(frozen=True)
class Identity:
    """What the worker says about itself, and what it checks a run config against."""

    name: str
    token: bytes
    backend: str
    device: str
    data_digest: bytes
    vocab_size: int
    train_tokens: int
    coordinator: str = "the coordinator"  # host:port, for messages
    # None, or why its backend does not evaluate a run's model (`BackendFactory.serves`)
    serves: Callable[[RunConfig], str | None] = lambda cfg: None

    def __post_init__(self) -> None:
        size = len(self.name.encode("utf-8"))
        if size > MAX_WORKER_NAME_BYTES:
            raise ValueError(
                f"worker name is {size} bytes of UTF-8; the limit is {MAX_WORKER_NAME_BYTES}"
            )

    @classmethod
    def of(
        cls,
        name: str,
        token: bytes | str,
        factory: BackendFactory,
        data: Dataset,
        where: str,
    ) -> Identity:
        """A worker's identity from its name, token, backend and data."""
        return cls(
            name=name,
            token=token.encode("utf-8") if isinstance(token, str) else bytes(token),
            backend=factory.name,
            device=factory.device,
            data_digest=data.digest,
            vocab_size=data.meta.vocab_size,
            train_tokens=len(data.train),
            coordinator=where,
            serves=factory.serves,
        )
