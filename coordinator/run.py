"""The run core: the coordinator's side of protocol/SPEC.md §8 as pure code.

No asyncio, no sockets. `RunCore` owns the open step's jobs, the chunk timer, digest
agreement and the snapshot and validation wants, and keeps one `Peer` record per connected
worker. Each incoming message goes to `receive(peer, msg)`; time passing goes to
`expire()`, a lost connection to `peer_left(peer)`. Every call returns the commands to carry
out (send this message to that peer, serve a stored snapshot, store a received one) and
refuses a peer by raising `Refused`, which carries the ERROR code the shell sends before it
closes the connection. Store effects go through the `RunStore` it is handed: the fitness log
append (fsync'd) happens here, before any STEP is returned, so a step is durable before any
worker hears of it. Snapshot bytes are read, decoded and written by the shell, off its loop.

Rules, in the order of SPEC §8 (each handler below names the one it implements):

- Handshake: HELLO's protocol version, then the AUTH MAC, then the data digest: the one the
  operator gave (--data-dir, --data-digest), else the one two workers agree on (until then
  every worker is admitted and none can settle it alone); WELCOME carries the run id,
  config, open step S, snapshot step.
- Digests (quorum): a step's replica digest is agreed when two distinct workers report it;
  only agreed digests are stored. A report that differs from the agreed digest is that
  worker's divergence (DIVERGED), never the run's. With one worker in the run, its report
  is agreed by the snapshot it uploads, whose digest the coordinator recomputes.
- Jobs: a JOB_REQUEST at s > S, or with a digest that differs from the agreed one, is
  refused with DIVERGED. At s < S it is answered with FITNESS_RANGE unless every STEP from s
  on has already been sent (those answer it). At s == S it gets a JOB, or WAIT; a worker
  told to WAIT gets a JOB pushed when a chunk is re-queued.
- Results: only for a chunk leased to that worker, with a loss sum the chunk can produce
  (else the worker is refused); the first valid result of a chunk wins; the rest are
  dropped and counted. When the last chunk is in, the step is committed: log append +
  fsync, then STEP to everyone. An append that fails raises `Fatal`: the coordinator stops.
- Snapshots and validation: each is a "want" (a step) served by the first worker that asks
  for a job at that step; one snapshot transfer at a time, only for a step whose digest is
  agreed (or the sole worker's), only the requested step, exactly the checkpoint size; a
  held-out score counts only from the worker asked, for the step asked.
- Samples (--sample-every): a want too, but served by a worker with nothing to evaluate
  (told to WAIT), so text is never written on the step's critical path; the run's only
  worker at the step is asked after the chunk it was just leased. A sample counts only from
  the worker asked, for the step asked; one not yet asked for when the step is committed
  is wanted at the next step.
- Liveness: a departed worker's leases are re-queued at once, expired ones by `expire()`.

To add a request/reply pair (as VALIDATE/VALIDATION): a want on the core, a
`_maybe_request_*` called from `_on_job_request`, and a handler in `_HANDLERS`.
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from ..protocol import (
    PROTOCOL_VERSION,
    Auth,
    Challenge,
    Error,
    ErrorCode,
    FitnessRange,
    FitnessRequest,
    Heartbeat,
    Hello,
    Job,
    JobRequest,
    Log,
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
    verify_mac,
)
from ..shared.fitness import chunk_loss_range
from ..shared.logs import PROGRESS, SAMPLE, STEP, VALIDATION, held_out_fields
from ..shared.replica import ReplicaState, checkpoint_bytes
from ..shared.sample import NEW_TOKENS, PROMPT_TOKENS, SampleSettings
from ..shared.vocab import escape
from .jobs import ChunkTimer, Clock, Outcome, StepJobs
from .metrics import Metrics
from .store import RunStore

__all__ = [
    "CATCHUP_STEPS",
    "WAIT_MS",
    "Command",
    "Fatal",
    "Peer",
    "Refused",
    "RunCore",
    "Send",
    "ServeSnapshot",
    "StoreSnapshot",
]

log = structlog.get_logger("eggroll.coordinator")

CATCHUP_STEPS = 4096  # most steps per FITNESS_RANGE (also bounded by the frame size)
WAIT_MS = 1000  # how long an idle worker waits before asking again (unless pushed a job)
PROGRESS_S = 10.0  # a step open this long (since its first lease) logs its progress this often


class Fatal(Exception):
    """The run cannot go on safely (a failed fitness-log append): stop the coordinator.
    str() is one line that says what happened and what to do."""


class Refused(Exception):
    """The peer breaks a rule of the run: send ERROR(code, message) and close."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


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


Command = Send | ServeSnapshot | StoreSnapshot


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
    job_started: dict[int, float] = field(default_factory=dict)  # chunk -> lease time


class RunCore:
    def __init__(
        self,
        store: RunStore,
        *,
        token: bytes = b"",
        data_digest: bytes | None = None,
        max_steps: int | None = None,
        snapshot_every: int = 100,
        sample_every: int = 0,
        chunk_timeout_s: float | None = None,
        metrics: Metrics | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        self.store = store
        self.cfg = store.config
        self.config_bytes = self.cfg.canonical_bytes()
        self.token = token
        self.max_steps = max_steps
        self.loss_range = chunk_loss_range(self.cfg)
        self.checkpoint_size = checkpoint_bytes(self.cfg)
        if data_digest is not None:
            if store.data_digest not in (None, data_digest):
                raise Fatal(
                    f"{store.path}/run.json holds data digest {store.data_digest.hex()[:16]}, "
                    f"the operator gave {data_digest.hex()[:16]}: give the run's data"
                )
            if store.data_digest is None:
                store.set_data_digest(data_digest)
        self.data_votes: dict[bytes, set[int]] = {}  # unsettled data digest -> workers
        # step -> digest -> workers that reported it, for steps not yet agreed
        self.tallies: dict[int, dict[int, set[int]]] = {}
        self.disagreed_step = -1  # last step whose digest disagreement was logged
        self.snapshot_every = snapshot_every
        self.clock = clock
        self.timer = ChunkTimer(fixed_s=chunk_timeout_s)
        self.peers: dict[int, Peer] = {}
        self._ids = itertools.count(1)
        self.jobs = self._open_step(store.steps)
        self.snapshot_wanted: int | None = None  # step whose state should be snapshotted
        self.snapshot_source: int | None = None  # the peer sending one
        self.snapshot_requested: int | None = None  # the step it was asked for
        self.validation_wanted: int | None = None  # step whose held-out score is wanted
        self.validation_asked: tuple[int, int] | None = None  # (peer, step) asked for it
        self._progress_said = 0.0  # when a step's progress was last logged
        self.sample_every = sample_every  # 0: no samples
        self.sample_wanted: int | None = None  # step whose sample is wanted
        self.sample_asked: tuple[int, int] | None = None  # (peer, step) asked for it
        self.latest_sample: dict[str, object] | None = None  # step, worker, prompt, text
        self.finished = False  # --max-steps reached: no more leases
        self.weights_changed: int | None = None  # reported by the last worker at the open step
        self.net_in = self.net_out = 0  # bytes, counted by the shell
        self._net_marks = (0, 0)  # network byte totals at the last commit
        self.metrics = metrics or Metrics()
        self.metrics.observe(self)
        if max_steps is not None and store.steps >= max_steps:
            self._finish()

    @property
    def step(self) -> int:
        """The open step = steps committed."""
        return self.store.steps

    @property
    def done(self) -> bool:
        """--max-steps reached, its final snapshot stored and its sample (when one is due at
        the final step) written: time to stop."""
        if not self.finished or (self.step and self.store.latest_snapshot != self.step):
            return False
        asked = self.sample_asked
        return self.sample_wanted != self.step and (asked is None or asked[1] != self.step)

    def ready_count(self) -> int:
        return sum(1 for p in self.peers.values() if p.ready)

    # ------------------------------------------------------------------ connections

    def connect(self, address: str) -> int:
        """A new connection; returns its peer id."""
        peer = Peer(next(self._ids), address)
        self.peers[peer.id] = peer
        return peer.id

    def peer_left(self, peer_id: int) -> list[Command]:
        peer = self.peers.pop(peer_id, None)
        if peer is None:
            return []
        if peer.ready or peer.replica_step is not None:
            log.info("worker left", worker=peer.name, workers=self.ready_count())
            self.metrics.worker_left(peer.name)
        if self.snapshot_source == peer_id:
            self.snapshot_source = self.snapshot_requested = None
        if self.sample_asked is not None and self.sample_asked[0] == peer_id:
            self.sample_asked, self.sample_wanted = None, self.step  # another worker writes it
        for votes in self.tallies.values():
            _forget(votes, peer_id)
        _forget(self.data_votes, peer_id)  # a vote counts while its worker is connected
        requeued = self.jobs.release_worker(peer_id)
        if not requeued:
            return []
        self.metrics.chunks_requeued.labels("disconnect").inc(len(requeued))
        log.info("chunks requeued", reason="disconnect", chunks=requeued, step=self.step)
        return self._push_jobs()

    def expire(self) -> list[Command]:
        """Re-queue chunks past their deadline and push them to idle workers; log how far a
        long step has come every PROGRESS_S."""
        now = self.clock()
        due = self._progress_due()
        if due is not None and now >= due:
            self._progress_said = now
            log.info(
                PROGRESS,
                step=self.step + 1,
                chunks_done=len(self.jobs.results),
                chunks=self.jobs.chunks,
                seconds=round(now - (self.jobs.first_lease or now)),
            )
        requeued = self.jobs.expire()
        if not requeued:
            return []
        self.metrics.chunks_requeued.labels("deadline").inc(len(requeued))
        log.info("chunks requeued", reason="deadline", chunks=requeued, step=self.step)
        return self._push_jobs()

    def next_deadline(self) -> float | None:
        """When `expire` could next have something to do."""
        times = [t for t in (self.jobs.next_deadline(), self._progress_due()) if t is not None]
        return min(times, default=None)

    def _progress_due(self) -> float | None:
        started = self.jobs.first_lease
        if started is None or self.jobs.complete:
            return None
        return max(started, self._progress_said) + PROGRESS_S

    def traffic(self, received: int = 0, sent: int = 0) -> None:
        self.net_in += received
        self.net_out += sent

    def receive(self, peer_id: int, msg: Message) -> list[Command]:
        """Act on one message from a peer; raises Refused when the peer must go."""
        handler = _HANDLERS.get(msg.TYPE)
        if handler is None:  # the connection's state machine lets no other type through
            raise Refused(ErrorCode.ILLEGAL_STATE, f"unexpected {msg.TYPE.name}")
        return handler(self, self.peers[peer_id], msg)

    def refuse(self, peer: Peer, code: ErrorCode, message: str) -> Refused:
        self.metrics.protocol_errors.labels(code.name).inc()
        log.warning("rejecting worker", worker=peer.name, code=code.name, reason=message)
        return Refused(code, message)

    # ------------------------------------------------------------------ handshake

    def _on_hello(self, peer: Peer, msg: Hello) -> list[Command]:
        peer.name, peer.data_digest = msg.worker_name, msg.data_digest
        if msg.protocol_version != PROTOCOL_VERSION:
            raise self.refuse(
                peer,
                ErrorCode.BAD_VERSION,
                f"coordinator speaks protocol "
                f"{PROTOCOL_VERSION}, worker {msg.protocol_version}: upgrade the older one",
            )
        peer.nonce = secrets.token_bytes(32)
        return [Send(peer.id, Challenge(peer.nonce))]

    def _on_auth(self, peer: Peer, msg: Auth) -> list[Command]:
        if not verify_mac(self.token, peer.nonce, msg.mac):
            raise self.refuse(
                peer,
                ErrorCode.AUTH_FAILED,
                "wrong token: give the coordinator's token (--token-file or EGGROLL_TOKEN)",
            )
        self._check_data_digest(peer)
        snapshot = self.store.latest_snapshot
        welcome = Welcome(
            self.store.run_id,
            self.config_bytes,
            self.step,
            -1 if snapshot is None else snapshot,
            self.cfg.pairs,
        )
        peer.ready = True
        peer.broadcast_from = self.step
        log.info("worker joined", worker=peer.name, peer=peer.address, workers=self.ready_count())
        return [Send(peer.id, welcome)]

    def _check_data_digest(self, peer: Peer) -> None:
        """The operator's digest, or the one two workers agree on, is the run's."""
        run_digest, mine = self.store.data_digest, peer.data_digest
        if run_digest is not None:
            if run_digest != mine:
                raise self.refuse(
                    peer,
                    ErrorCode.DATA_MISMATCH,
                    f"worker data digest {mine.hex()[:16]} differs from the run's "
                    f"{run_digest.hex()[:16]}: give the worker the run's data directory",
                )
            return
        voters = self.data_votes.setdefault(mine, set())
        voters.add(peer.id)
        if len(voters) >= 2:
            self.store.set_data_digest(mine)
            self.data_votes.clear()
            log.info("data digest agreed", digest=mine.hex()[:16], workers=len(voters))

    # ------------------------------------------------------------------ digests

    def _check_digest(self, peer: Peer, step: int, digest: int) -> None:
        """Tally a report; DIVERGED when it differs from the step's agreed digest."""
        agreed = self.store.digests.get(step)
        if agreed is not None:
            if agreed != digest:
                self.metrics.digest_mismatches.inc()
                raise self.refuse(
                    peer,
                    ErrorCode.DIVERGED,
                    f"replica digest at step {step} differs from the run's agreed one: resync",
                )
            return
        if step < self.step - 2:
            return  # workers have moved on: a report this old is never agreed now
        # One report per worker and step, so a peer cannot grow the tally without bound.
        votes = self.tallies.setdefault(step, {})
        _forget(votes, peer.id)
        voters = votes.setdefault(digest, set())
        voters.add(peer.id)
        if len(voters) >= 2:
            self._agree(step, digest)
        elif len(votes) > 1 and step > self.disagreed_step:
            self.disagreed_step = step
            self.metrics.digest_mismatches.inc()
            log.warning(
                "digests disagree",
                step=step,
                digests=len(votes),
                hint="no two workers agree on the replica: a backend or version differs",
            )

    def _agree(self, step: int, digest: int) -> None:
        self.store.record_digest(step, digest)
        del self.tallies[step]

    def _provisional(self, peer: Peer, step: int) -> int | None:
        """The digest `peer` reported for `step` if it is the run's only worker, else None."""
        if self.ready_count() != 1:
            return None
        for digest, voters in self.tallies.get(step, {}).items():
            if peer.id in voters:
                return digest
        return None

    # ------------------------------------------------------------------ jobs

    def _on_job_request(self, peer: Peer, msg: JobRequest) -> list[Command]:
        step = msg.replica_step
        if step > self.step:
            raise self.refuse(
                peer,
                ErrorCode.DIVERGED,
                f"replica is at step {step}, the run has committed {self.step}",
            )
        self._check_digest(peer, step, msg.replica_digest)
        peer.replica_step = step
        if step < self.step:
            if step >= peer.broadcast_from:
                return []  # the STEPs it lacks are on their way; it asks again after them
            return [self._fitness_range(peer, step, CATCHUP_STEPS)]
        if self.store.digests.get(step) == msg.replica_digest or len(self.peers) == 1:
            self.weights_changed = msg.weights_changed  # from an agreed replica only
        out = self._maybe_request_snapshot(peer) + self._maybe_request_validation(peer)
        if self.finished:
            reply, idle = Send(peer.id, Wait(WAIT_MS)), True
        else:
            reply = self._lease_to(peer)
            idle = peer.waiting
        return [*out, reply, *self._maybe_request_sample(peer, idle)]

    def _lease_to(self, peer: Peer) -> Send:
        chunk = self.jobs.lease(peer.id)
        if chunk is None:
            peer.waiting = True
            return Send(peer.id, Wait(WAIT_MS))
        peer.waiting = False
        first, count = self.jobs.member_range(chunk)
        self.metrics.chunks_leased.inc()
        peer.job_started[chunk] = self.clock()
        return Send(peer.id, Job(self.step, chunk, first, count))

    def _push_jobs(self) -> list[Command]:
        """Re-queued chunks go straight to idle workers that are at the open step."""
        out: list[Command] = []
        for peer in self.peers.values():
            if not self.jobs.queue:
                break
            if peer.waiting and peer.ready and peer.replica_step == self.step:
                out.append(self._lease_to(peer))
        return out

    def _on_result(self, peer: Peer, msg: Result) -> list[Command]:
        started = peer.job_started.pop(msg.chunk, None)
        if started is not None and msg.step == self.step:
            seconds = max(self.clock() - started, 1e-9)
            tokens = self.cfg.es.chunk_size * self.cfg.es.seq_len
            self.metrics.worker_chunk(peer.name, seconds, tokens)
        if msg.step == self.step:
            try:
                self._check_digest(peer, msg.step, msg.replica_digest)
            except Refused:
                self.metrics.results_dropped.labels("diverged").inc()
                raise
        outcome = self.jobs.complete_chunk(
            peer.id, msg.step, msg.chunk, msg.fitness, msg.pair_count, msg.loss_sum
        )
        if outcome is Outcome.UNLEASED:
            self.metrics.results_dropped.labels(outcome.value).inc()
            raise self.refuse(
                peer,
                ErrorCode.ILLEGAL_STATE,
                f"RESULT for chunk {msg.chunk} of step {msg.step}, which was not leased to "
                "this worker",
            )
        if outcome is Outcome.BAD_LOSS:
            self.metrics.results_dropped.labels(outcome.value).inc()
            raise self.refuse(
                peer,
                ErrorCode.MALFORMED,
                f"RESULT loss sum {msg.loss_sum} is impossible for a chunk of this run "
                f"(range {self.loss_range[0]}..{self.loss_range[1]})",
            )
        if outcome is not Outcome.ACCEPTED:
            self.metrics.results_dropped.labels(outcome.value).inc()
            level = log.error if outcome is Outcome.MISMATCH else log.info
            level(
                "result dropped",
                reason=outcome.value,
                worker=peer.name,
                step=msg.step,
                chunk=msg.chunk,
            )
            return []
        self.metrics.chunks_completed.inc()
        return self._commit() if self.jobs.complete else []

    def _commit(self) -> list[Command]:
        """Make the open step durable, then broadcast it and open the next one."""
        step, jobs = self.step, self.jobs
        packed = jobs.step_fitness()
        try:
            self.store.fitness_log.append(step, packed)  # fsync'd: committed from here on
        except OSError as exc:
            # What reached the disk is unknown: stop, and let a restart repair the tail.
            raise Fatal(
                f"cannot commit step {step} to {self.store.fitness_log.path}: "
                f"{exc.strerror or exc}; the coordinator stops (restart it once the disk is "
                "fixed: it repairs the log's tail and resumes)"
            ) from None
        message = Step(step, self.cfg.pairs, packed)
        out: list[Command] = []
        for peer in self.peers.values():
            if peer.ready:
                peer.waiting = False
                peer.job_started.clear()
                out.append(Send(peer.id, message))
        self._log_step(step, jobs)
        self.jobs = self._open_step(self.step)
        for old in [s for s in self.tallies if s < self.step - 2]:
            del self.tallies[old]  # reports this old are never agreed: workers moved on
        if self.snapshot_every and self.step % self.snapshot_every == 0:
            self.snapshot_wanted = self.step
        every = self.cfg.validation.every_steps
        if every and self.step % every == 0:
            self.validation_wanted = self.step
        if self.sample_wanted is not None or (
            self.sample_every and self.step % self.sample_every == 0
        ):
            self.sample_wanted = self.step  # one not yet asked for is written at this step
        if self.max_steps is not None and self.step >= self.max_steps:
            self._finish()
        return out

    def _finish(self) -> None:
        """--max-steps reached: stop leasing and want the final snapshot."""
        self.finished = True
        if self.step and self.store.latest_snapshot != self.step:
            self.snapshot_wanted = self.step

    def _open_step(self, step: int) -> StepJobs:
        return StepJobs(
            step,
            self.cfg.chunks,
            self.cfg.es.chunk_size,
            self.clock,
            self.timer,
            loss_range=self.loss_range,
        )

    def _log_step(self, step: int, jobs: StepJobs) -> None:
        net_in0, net_out0 = self._net_marks
        # From the step's first lease: time spent waiting for workers is not step time.
        seconds = max(self.clock() - (jobs.first_lease or jobs.opened), 1e-9)
        tokens = self.cfg.es.population * self.cfg.es.seq_len
        loss_bits = jobs.loss_sum / 16 / tokens
        self.metrics.committed(seconds, loss_bits, tokens)
        log.info(
            STEP,
            step=step + 1,
            member_tokens=tokens,
            loss_bits=round(loss_bits, 4),
            step_s=round(seconds, 3),
            changed=self.weights_changed or 0,
            member_tok_s=round(tokens / seconds),
            workers=self.ready_count(),
            net_in=self.net_in - net_in0,
            net_out=self.net_out - net_out0,
            requeued=sum(jobs.requeued.values()),
        )
        self._net_marks = (self.net_in, self.net_out)

    def _on_fitness_request(self, peer: Peer, msg: FitnessRequest) -> list[Command]:
        return [self._fitness_range(peer, msg.first_step, msg.max_steps)]

    def _fitness_range(self, peer: Peer, first: int, max_steps: int) -> Send:
        limit = min(max_steps, CATCHUP_STEPS, FitnessRange.max_steps_per_frame(self.cfg.pairs))
        count = max(0, min(limit, self.step - first))
        packed = self.store.fitness_log.read(first, count) if count else []
        self.metrics.catchup_steps.inc(count)
        return Send(peer.id, FitnessRange.from_steps(first, self.cfg.pairs, packed))

    # ------------------------------------------------------------------ snapshots

    def want_snapshot(self) -> list[Command]:
        """Ask a worker at the open step for its state (the final snapshot on shutdown)."""
        if self.step == 0 or self.store.latest_snapshot == self.step:
            return []  # the initial state is a pure function of the config
        self.snapshot_wanted = self.step
        if self.snapshot_source is not None:
            return []
        for peer in self.peers.values():
            if peer.replica_step == self.step and (out := self._maybe_request_snapshot(peer)):
                return out
        log.info("no worker at the current step for a final snapshot", step=self.step)
        return []

    def _maybe_request_snapshot(self, peer: Peer) -> list[Command]:
        wanted = self.snapshot_wanted
        if wanted is None or self.snapshot_source is not None or peer.replica_step != wanted:
            return []
        if self.store.digests.get(wanted) is None and self._provisional(peer, wanted) is None:
            return []  # only a state the run agrees on is worth keeping
        self.snapshot_source, self.snapshot_requested = peer.id, wanted
        peer.snapshot, peer.snapshot_total = bytearray(), 0
        return [Send(peer.id, SnapshotRequest(wanted))]

    def _on_snapshot_request(self, peer: Peer, msg: SnapshotRequest) -> list[Command]:
        step = self.store.latest_snapshot
        if step is None:
            raise self.refuse(peer, ErrorCode.ILLEGAL_STATE, "the run has no snapshot yet")
        return [ServeSnapshot(peer.id, step)]

    def snapshot_gone(self, peer_id: int, step: int) -> Refused:
        """The snapshot to serve was pruned meanwhile by a newer one: the worker asks again."""
        return self.refuse(
            self.peers[peer_id], ErrorCode.INTERNAL, f"snapshot {step} is no longer available"
        )

    def snapshot_served(self, peer_id: int, step: int, size: int) -> None:
        self.metrics.snapshot_transfers.labels("out").inc()
        log.info("snapshot sent", worker=self.peers[peer_id].name, step=step, bytes=size)

    def _on_snapshot_chunk(self, peer: Peer, msg: SnapshotChunk) -> list[Command]:
        if peer.snapshot is None or msg.offset != len(peer.snapshot):
            raise self.refuse(peer, ErrorCode.ILLEGAL_STATE, "unexpected snapshot chunk")
        if msg.step != self.snapshot_requested or msg.total_bytes != self.checkpoint_size:
            raise self.refuse(
                peer,
                ErrorCode.ILLEGAL_STATE,
                f"snapshot of step {msg.step}, {msg.total_bytes} bytes: step "
                f"{self.snapshot_requested} was asked for, {self.checkpoint_size} bytes",
            )
        peer.snapshot += msg.data
        if len(peer.snapshot) > msg.total_bytes:
            raise self.refuse(peer, ErrorCode.MALFORMED, "snapshot longer than announced")
        if len(peer.snapshot) < msg.total_bytes:
            return []
        blob, peer.snapshot = bytes(peer.snapshot), None
        return [StoreSnapshot(peer.id, blob)]

    def snapshot_decoded(self, peer_id: int, state: ReplicaState | None, error: str = "") -> bool:
        """Whether a received snapshot may be stored (SPEC §8: committed, digest agrees).
        On False the transfer is over; on True, `snapshot_stored` follows the write."""
        peer = self.peers.get(peer_id)
        name = peer.name if peer is not None else "?"
        reason = error
        if state is not None:
            step = state.step
            agreed = self.store.digests.get(step)
            if agreed is None and peer is not None:
                agreed = self._provisional(peer, step)  # the sole worker's, checked by its state
            if (
                state.config.digest() != self.cfg.digest()
                or step != self.snapshot_requested
                or agreed is None
                or agreed != state.digest()
            ):
                reason = "config, step or digest does not match the run"
            elif step not in self.store.digests:
                self._agree(step, agreed)
        if reason:
            log.warning("snapshot rejected", worker=name, reason=reason)
            self._release_snapshot_source(peer_id)
            return False
        return True

    def snapshot_stored(self, peer_id: int, state: ReplicaState, size: int) -> None:
        name = self.peers[peer_id].name if peer_id in self.peers else "?"
        self.metrics.snapshot_stored()
        log.info(
            "snapshot stored",
            step=state.step,
            worker=name,
            bytes=size,
            digest=state.digest_hex(),
        )
        if self.snapshot_wanted is not None and state.step >= self.snapshot_wanted:
            self.snapshot_wanted = None
        self._release_snapshot_source(peer_id)

    def _release_snapshot_source(self, peer_id: int) -> None:
        # Only now may another worker be asked: one snapshot at a time.
        if self.snapshot_source == peer_id:
            self.snapshot_source = self.snapshot_requested = None

    # ------------------------------------------------------------------ validation

    def _maybe_request_validation(self, peer: Peer) -> list[Command]:
        """Ask one worker at the wanted step for its held-out score (SPEC §8)."""
        if self.validation_wanted is None or peer.replica_step != self.validation_wanted:
            return []
        step, self.validation_wanted = self.validation_wanted, None
        self.validation_asked = (peer.id, step)
        return [Send(peer.id, Validate(step))]

    def _on_validation(self, peer: Peer, msg: Validation) -> list[Command]:
        if self.validation_asked != (peer.id, msg.step):
            return []  # only the worker asked sets the run's held-out score
        self.validation_asked = None
        self.metrics.validated(msg)
        streams = msg.stream_tokens > 0  # 0: the model carries no state along a stream
        log.info(
            VALIDATION,
            step=msg.step,
            **held_out_fields(
                msg.bits_per_token,
                msg.bits_per_byte,
                msg.stream_bits_per_token if streams else None,
                msg.stream_bits_per_byte,
            ),
            tokens=msg.tokens,
            worker=peer.name,
        )
        return []

    # ------------------------------------------------------------------ samples

    def _maybe_request_sample(self, peer: Peer, idle: bool) -> list[Command]:
        """Ask `peer` for the wanted sample (SPEC §8) if it has nothing to evaluate, or if it
        is the only worker at the step (it answers after its chunk)."""
        step = self.sample_wanted
        if step is None or peer.replica_step != step:
            return []
        others = [p.replica_step for p in self.peers.values() if p is not peer and p.ready]
        if not idle and any(s is not None and s >= step - 1 for s in others):
            return []  # another worker at (or just reaching) the step will be told to WAIT
        self.sample_wanted = None
        self.sample_asked = (peer.id, step)
        settings = SampleSettings()
        request = Sample(
            step=step,
            seed=step,  # as eggroll-train: `eggroll-sample SAVE_DIR --step S --seed S`
            prompt_index=0,
            prompt_tokens=PROMPT_TOKENS,
            new_tokens=NEW_TOKENS,
            temperature=settings.temperature,
            min_p=settings.min_p,
            top_k=settings.top_k,
            presence_penalty=settings.presence_penalty,
            frequency_penalty=settings.frequency_penalty,
        )
        return [Send(peer.id, request)]

    def _on_sample_text(self, peer: Peer, msg: SampleText) -> list[Command]:
        if self.sample_asked != (peer.id, msg.step) or msg.seed != msg.step:
            return []  # only the worker asked writes the run's sample
        self.sample_asked = None
        # Model bytes: decoded with replacement characters, then one line with every control
        # character escaped, so no worker can write terminal escapes into an operator's log.
        prompt, text = (
            escape(b.decode("utf-8", errors="replace"), keep_newlines=False)
            for b in (msg.prompt, msg.text)
        )
        self.latest_sample = {"step": msg.step, "worker": peer.name, "prompt": prompt, "text": text}
        self.metrics.sampled(msg.step, peer.name, prompt, text)
        log.info(SAMPLE, step=msg.step, worker=peer.name, prompt=prompt, text=text)
        return []

    # ------------------------------------------------------------------ the rest

    def _on_heartbeat(self, peer: Peer, msg: Heartbeat) -> list[Command]:
        return []

    def _on_log(self, peer: Peer, msg: Log) -> list[Command]:
        log.info("worker log", worker=peer.name, level=int(msg.level), text=msg.text)
        return []

    def _on_error(self, peer: Peer, msg: Error) -> list[Command]:
        log.warning("worker error", worker=peer.name, code=int(msg.code), text=msg.message)
        return []


def _forget(votes: dict, peer_id: int) -> None:
    """Take `peer_id` out of every voter set of `votes`, dropping the sets left empty."""
    for key in [k for k, voters in votes.items() if peer_id in voters]:
        votes[key].discard(peer_id)
        if not votes[key]:
            del votes[key]


# Incoming message type -> handler. The connection's state machine (protocol/connection.py)
# has already checked that the type is legal in the connection's state.
_HANDLERS: dict[MsgType, Callable[[RunCore, Peer, Message], list[Command]]] = {
    MsgType.HELLO: RunCore._on_hello,
    MsgType.AUTH: RunCore._on_auth,
    MsgType.JOB_REQUEST: RunCore._on_job_request,
    MsgType.RESULT: RunCore._on_result,
    MsgType.FITNESS_REQUEST: RunCore._on_fitness_request,
    MsgType.SNAPSHOT_REQUEST: RunCore._on_snapshot_request,
    MsgType.SNAPSHOT_CHUNK: RunCore._on_snapshot_chunk,
    MsgType.VALIDATION: RunCore._on_validation,
    MsgType.SAMPLE_TEXT: RunCore._on_sample_text,
    MsgType.HEARTBEAT: RunCore._on_heartbeat,
    MsgType.LOG: RunCore._on_log,
    MsgType.ERROR: RunCore._on_error,
}  # type: ignore[dict-item]
