"""The run core: the coordinator's side of protocol/SPEC.md §8 as pure code.

No asyncio, no sockets, no metrics, no logging. `RunCore` owns the open step's jobs, the chunk
timer, the trust rules (`trust.py`: machine groups, digest quorum, waivers, convictions) and
the snapshot, validation and sample wants, and keeps one `Peer` record per connected worker.
Each incoming message goes to `receive(peer, msg)`; time passing goes to `expire()`, a lost
connection to `peer_left(peer)`. Every call returns, in order, the commands to carry out (send
this message to that peer, serve a stored snapshot, store a received one; these, `Peer`,
`Want`, `RunOptions` and `Status` are in `core_types.py`) and the events (`events.py`: a step
committed, a chunk re-queued, a held-out score in), which the shell (`server.py`) records in
the metrics and the log (`record.py`). A peer is refused by raising `Refused`, which carries
the ERROR code the shell sends before it closes the connection, and the events that led to it.
Store effects go through the `RunStore` it is handed: the fitness log append (fsync'd) happens
here, before any STEP is returned, so a step is durable before any worker hears of it. Snapshot
bytes are read, decoded and written by the shell, off its loop.

Rules, in the order of SPEC §8 (each handler below names the one it implements):

- Handshake: HELLO's protocol version, then the AUTH MAC, then the data digest: the one the
  operator gave (--data-dir, --data-digest), else the one two groups agree on (until then
  every worker is admitted and none can settle it alone); WELCOME carries the run id,
  config, open step S, snapshot step.
- Digests (quorum): a step's replica digest is agreed when two groups report it (trust.py:
  two machines while workers of two are connected, else two connections);
  only agreed digests are stored. A report that differs from the agreed digest is that
  worker's divergence (DIVERGED), never the run's. With one worker in the run, its report
  is agreed by the snapshot it uploads, whose digest the coordinator recomputes.
- Jobs: a JOB_REQUEST at s > S, or with a digest that differs from the agreed one, is
  refused with DIVERGED. At s < S it is answered with FITNESS_RANGE unless every STEP from s
  on has already been sent (those answer it). At s == S it gets a JOB, or WAIT; a worker
  told to WAIT gets a JOB pushed when a chunk is re-queued.
- Results: only for a chunk leased to that worker, with a loss sum the chunk can produce
  (else the worker is refused); the first valid result of a chunk settles it, except for
  checks (jobs.py): a share of each step's chunks drawn at random (--verify-fraction),
  every result from an address where a worker was outvoted, and chunks whose results
  differ wait for an equal result from another group (a machine while workers of two are
  connected); a group whose result loses a vote has its votes of the step dropped,
  and its workers are refused with DIVERGED at their next message (a replica may be what is
  wrong). A check is waived only when every connected group has voted on it or has
  stalled (trust.py: work unanswered or not done for STALL_S). When the last
  chunk is settled, the step is committed: log append + fsync, then STEP to everyone. An
  append that fails raises `Fatal`: the coordinator stops.
- Snapshots and validation: each is a `Want` (a step) served by the first worker that asks
  for a job at that step; one snapshot transfer at a time, only for a step whose digest is
  agreed (or the sole worker's), only the requested step, exactly the checkpoint size; a
  held-out score counts only from the worker asked, for the step asked.
- The coordinator's own failures are never the worker's: a snapshot the shell cannot store
  is dropped (`snapshot_dropped`: a warning, the run and the worker's session go on, the
  next snapshot step tries again), and a session that fails on this side
  (`failed_here`) leaves what it was asked unasked until the next opportunity, so a
  reconnecting worker is not asked for the same thing and bounced in a loop. A digests.log
  or run.json write that fails degrades to memory (`store_events` reports it once);
  shared/save_dir.py's table gives the policy for every file.
- Samples (--sample-every): a want too, but served by a worker with nothing to evaluate
  (told to WAIT), so text is never written on the step's critical path; the run's only
  worker at the step is asked after the chunk it was just leased. A sample counts only from
  the worker asked, for the step asked; one not yet asked for when the step is committed
  is wanted at the next step.
- Liveness: a departed worker's leases are re-queued at once, expired ones by `expire()`.

To add a request/reply pair (as VALIDATE/VALIDATION): a `Want` on the core, an `_ask` of it
in `_on_job_request`, a handler in `_HANDLERS` that counts only its `answered` reply, and an
event for the shell to record.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable

from ..protocol import (
    MAX_CHUNKS_PER_REQUEST,
    ErrorCode,
    Message,
    MsgType,
    messages,
)
from ..protocol.errors import RUN_REWOUND
from ..shared.fitness import checked_by_claims, chunk_loss_range, member_tokens
from ..shared.model import ARCHS
from ..shared.objectives import objective_of
from ..shared.replica import ReplicaState, checkpoint_bytes
from ..shared.vocab import escape
from .asks import OpenAsks
from .claims import Claims, too_large
from .core_types import (
    Close,
    Fatal,
    Halted,
    Output,
    Peer,
    Refused,
    RunOptions,
    Send,
    ServeSnapshot,
    Status,
    StoreSnapshot,
    Want,
)
from .events import (
    CatchupServed,
    ChunkAccepted,
    ChunkChecked,
    ChunkTimed,
    Event,
    FileDegraded,
    Leased,
    Left,
    Nondeterministic,
    NoSnapshotSource,
    Progress,
    Rejected,
    Requeued,
    ResultDropped,
    RewindOutside,
    Rewound,
    Sampled,
    SnapshotDropped,
    SnapshotRejected,
    SnapshotStored,
    Validated,
    WorkerError,
)
from .handshake import on_auth, on_hello
from .jobs import INEXACT_AGREEMENT, ChunkTimer, Clock, Outcome, StepJobs
from .reports import committed, sample_request, worker_log
from .rewind import Provenance, plan, sources
from .store import RunStore, WriteFailure
from .trust import Distrusted, Group, Trust

__all__ = ["CATCHUP_STEPS", "WAIT_MS", "Fatal", "Halted", "Refused", "RunCore"]

CATCHUP_STEPS = 4096  # most steps per FITNESS_RANGE (also bounded by the frame size)
WAIT_MS = 1000  # how long an idle worker waits before asking again (unless pushed a job)
PROGRESS_S = 10.0  # a step open this long (since its first lease) logs its progress this often
_DEFAULT_OPTIONS = RunOptions()  # frozen: one instance serves every default


class RunCore:
    def __init__(
        self, store: RunStore, options: RunOptions = _DEFAULT_OPTIONS, clock: Clock = time.monotonic
    ) -> None:
        self.store = store
        self.cfg = store.config
        self.config_bytes = self.cfg.canonical_bytes()
        self.options = options
        self.loss_range = chunk_loss_range(self.cfg)
        self.checkpoint_size = checkpoint_bytes(self.cfg)
        data_digest = options.data_digest
        if data_digest is not None:
            if store.data_digest not in (None, data_digest):
                raise Fatal(
                    f"{store.path}/run.json holds data digest {store.data_digest.hex()[:16]}, "
                    f"the operator gave {data_digest.hex()[:16]}: give the run's data"
                )
            if store.data_digest is None:
                store.set_data_digest(data_digest)
        self.clock = clock
        self.timer = ChunkTimer(fixed_s=options.chunk_timeout_s)
        self._draw = random.SystemRandom()  # which chunks are checked: no worker can tell
        # A Hugging Face model's fitness differs across devices (bfloat16 on GPUs): its loss
        # is compared pair by pair (jobs.INEXACT_AGREEMENT); a reward's is made exact by
        # checking the claimed text (claims.py); every other run's is a pure function of the
        # replica, compared byte for byte.
        exact = ARCHS[self.cfg.model.arch].EXACT
        self.claims = Claims(self.cfg) if checked_by_claims(self.cfg) else None
        if self.claims is not None and (problem := too_large(self.cfg)):
            raise Fatal(problem)
        self.exact = exact or self.claims is not None
        loss = objective_of(self.cfg).SCORE == "loss_bits"
        self.agreement = None if self.exact or not loss else INEXACT_AGREEMENT
        self.peers: dict[int, Peer] = {}
        self.trust = Trust(store, self.peers, clock)  # groups, quorum, waivers, convictions
        self._ids = itertools.count(1)
        self.provenance = Provenance(options.rewind_steps)  # who gave what, for rewinds
        self.jobs = self._open_step(store.steps)
        self.snapshot = Want()  # a state worth keeping; asked of one worker at a time
        self.validation = OpenAsks()  # held-out scores; asks stay open side by side
        self.sample = Want()  # a sample of the model's writing
        self.snapshot_failed: int | None = None  # the last step whose snapshot was dropped
        self._progress_said = 0.0  # when a step's progress was last reported
        self.finished = False  # --max-steps reached: no more leases
        self.weights_changed: int | None = None  # reported by the last worker at the open step
        if options.max_steps is not None and store.steps >= options.max_steps:
            self._finish()

    @property
    def step(self) -> int:
        """The open step = steps committed."""
        return self.store.steps

    @property
    def done(self) -> bool:
        """--max-steps reached, its final snapshot stored, its held-out score and its sample
        (when one is due at the final step) in: time to stop."""
        if not self.finished or (
            self.step
            and self.store.latest_snapshot != self.step
            and self.snapshot_failed != self.step  # dropped: waiting would not bring it
        ):
            return False
        return not self.sample.pending(self.step) and not self.validation.pending(self.step)

    @property
    def halted(self) -> Nondeterministic | None:
        """Results differ where no machine can decide, or no one machine explains them (a
        reward or objective that is not deterministic): the run must stop (trust.py)."""
        return self.trust.halt

    def ready_count(self) -> int:
        return sum(1 for p in self.peers.values() if p.ready)

    def status(self) -> Status:
        trust, jobs = self.trust, self.jobs
        undecided = len(trust.undecided(jobs, trust.able(jobs)[0])) if jobs.checks else 0
        return Status(self.step, self.ready_count(), self.weights_changed, undecided)

    def name(self, peer_id: int) -> str:
        """The worker's name, for the log ("?" before HELLO or once it has left)."""
        peer = self.peers.get(peer_id)
        return peer.name if peer is not None else "?"

    # ------------------------------------------------------------------ connections

    def connect(self, address: str, machine: str = "") -> int:
        """A new connection; returns its peer id. `machine`: what stands for its machine in
        the checks, when not its address (a certificate's identity)."""
        peer = Peer(next(self._ids), address, machine=machine)
        self.peers[peer.id] = peer
        return peer.id

    def peer_left(self, peer_id: int) -> list[Output]:
        peer = self.peers.pop(peer_id, None)
        if peer is None:
            return []
        self.trust.leave(peer, self.jobs)
        if self.claims is not None:
            self.claims.forget(peer_id)
        out: list[Output] = []
        if peer.ready or peer.replica_step is not None:
            namesakes = sum(1 for p in self.peers.values() if p.ready and p.name == peer.name)
            out.append(Left(peer.name, self.ready_count(), namesakes))
        self.snapshot.retry(peer_id)  # another worker is asked
        self.validation.drop(peer_id)  # its scores of earlier steps will not come
        if self.sample.drop(peer_id) is not None:
            self.sample.step = self.step  # another worker writes it
        requeued = self.jobs.release_worker(peer_id)
        if requeued:
            out.append(Requeued("disconnect", tuple(requeued), self.step))
        waived = self.trust.waive(self.jobs, self.step)  # it may have been the only checker
        out += waived + self._push_jobs()
        return out + self._commit() if waived and self.jobs.complete else out

    def expire(self) -> list[Output]:
        """Re-queue chunks past their deadline and push them to idle workers; report how far
        a long step has come every PROGRESS_S."""
        now = self.clock()
        out: list[Output] = []
        due = self._progress_due()
        if due is not None and now >= due:
            self._progress_said = now
            seconds = round(now - (self.jobs.first_lease or now))
            out.append(Progress(self.step + 1, len(self.jobs.results), self.jobs.chunks, seconds))
        requeued = self.jobs.expire()
        if requeued:
            out.append(Requeued("deadline", tuple(requeued), self.step))
        waived = self.trust.waive(self.jobs, self.step)  # a checker may have stalled
        if requeued or waived:
            out += waived + self._push_jobs()
        return out + self._commit() if waived and self.jobs.complete else out

    def next_deadline(self) -> float | None:
        """When `expire` could next have something to do."""
        times = [self.jobs.next_deadline(), self._progress_due()]
        if self.jobs.checks:  # when a checker they wait for could next stall
            now = self.clock()
            times += [self.jobs.next_overdue(), *self.trust.stall_times()]
            times = [t for t in times if t is None or t > now]
        return min((t for t in times if t is not None), default=None)

    def _progress_due(self) -> float | None:
        started = self.jobs.first_lease
        if started is None or self.jobs.complete:
            return None
        return max(started, self._progress_said) + PROGRESS_S

    def receive(self, peer_id: int, msg: Message) -> list[Output]:
        """Act on one message from a peer; raises Refused when the peer must go."""
        handler = _HANDLERS.get(msg.TYPE)
        if handler is None:  # the connection's state machine lets no other type through
            raise Refused(ErrorCode.ILLEGAL_STATE, f"unexpected {msg.TYPE.name}")
        peer = self.peers[peer_id]
        if peer.outvoted:
            raise self.refuse(peer, ErrorCode.DIVERGED, peer.outvoted)
        try:
            out = handler(self, peer, msg)
        except Distrusted as exc:  # a report against what the run agreed (trust.py)
            raise self.refuse(peer, exc.code, exc.message, *exc.events) from None
        return out + self.store_events()  # a digest agreed, a data digest set

    def store_events(self) -> list[Event]:
        """The save-directory writes that degraded (digests.log, run.json) since last asked,
        each reported once per spell of failures (shared/save_dir.py's policy)."""
        return [
            FileDegraded(str(f.path), f.error, f.free_bytes) for f in self.store.take_failures()
        ]

    def failed_here(self, peer_id: int) -> None:
        """The session with `peer_id` failed on the coordinator's side (a bug, a file that
        cannot be read or written), not the worker's: what it was asked for is dropped, not
        asked again of the next worker (or of it, reconnecting) until its next opportunity,
        so one failure cannot bounce workers in a loop. Call before `peer_left`."""
        step = self.snapshot.drop(peer_id)
        if step is not None:
            self.snapshot_failed = step
            if self.snapshot.step is not None and self.snapshot.step <= step:
                self.snapshot.step = None
        self.validation.drop(peer_id)
        self.sample.drop(peer_id)  # the next sample step asks again

    def refuse(self, peer: Peer, code: ErrorCode, message: str, *before: Event) -> Refused:
        return Refused(code, message, [*before, Rejected(peer.name, code, message)])

    # ------------------------------------------------------------------ jobs

    def _on_job_request(self, peer: Peer, msg: messages.JobRequest) -> list[Output]:
        step = msg.replica_step
        if step > self.step:
            raise self.refuse(
                peer,
                ErrorCode.DIVERGED,
                f"replica is at step {step}, the run has committed {self.step}",
            )
        out: list[Output] = list(self.trust.check_digest(peer, step, msg.replica_digest, self.step))
        peer.replica_step = step
        if step < self.step:
            if step >= peer.broadcast_from:
                return out  # the STEPs it lacks are on their way; it asks again after them
            return out + self._fitness_range(peer, step, CATCHUP_STEPS)
        peer.worked = self.clock()  # at the open step, asking for work: not stalled
        if self.store.digests.get(step) == msg.replica_digest or len(self.peers) == 1:
            self.weights_changed = msg.weights_changed  # from an agreed replica only
        out += self._ask_snapshot(peer)
        out += self._ask(self.validation, peer, lambda p, s: messages.Validate(s))
        if self.finished:
            out.append(Send(peer.id, messages.Wait(WAIT_MS)))
            idle = True
        else:
            out += self._lease_to(peer, self._share(msg.max_chunks))
            idle = peer.waiting
        if self._may_sample(peer, idle):
            out += self._ask(self.sample, peer, lambda p, s: sample_request(s))
        return out

    def _share(self, asked: int) -> int:
        """Chunks for one JOB_REQUEST: what the worker asked for, at most its fair share of
        the step among the connected workers (so that the first one to apply a step does not
        take all of the next while the others are about to ask)."""
        workers = sum(1 for p in self.peers.values() if p.ready)
        return max(1, min(asked, -(-self.cfg.chunks // max(workers, 1))))

    def _lease_to(self, peer: Peer, want: int = 1, pushed: bool = False) -> list[Output]:
        """Up to `want` chunks to `peer`, within its share of live leases (a worker that asks
        again while it holds them gets no more); WAIT if none, unless `pushed` (unasked: a
        waiting worker's retry time stands)."""
        want = min(want, self._share(MAX_CHUNKS_PER_REQUEST) - self.jobs.live[peer.id])
        chunks: list[int] = []
        while len(chunks) < want:  # a backup copy only as the first (and then only) chunk
            chunk = self.jobs.lease(peer.id, queued_only=bool(chunks))
            if chunk is None:
                break
            chunks.append(chunk)
        if not chunks:
            peer.waiting = True
            return [] if pushed else [Send(peer.id, messages.Wait(WAIT_MS))]
        peer.waiting = False
        out: list[Output] = []
        if self.claims is not None:  # the results to check, before the request's JOBs
            for chunk in chunks:
                sent = self.claims.to_check(self.step, chunk, self.jobs.votes.get(chunk, {}))
                peer.claims_seen[self.step, chunk] = len(sent)
                out += [Send(peer.id, c) for c in sent]
        for i, chunk in enumerate(chunks):
            first, count = self.jobs.member_range(chunk)
            peer.job_started[chunk] = (self.clock(), len(chunks))
            out.append(Leased(peer.name, self.step, chunk))
            out.append(
                Send(peer.id, messages.Job(self.step, chunk, first, count, len(chunks) - 1 - i))
            )
        return out

    def _push_jobs(self) -> list[Output]:
        """Re-queued chunks go straight to idle workers that are at the open step."""
        out: list[Output] = []
        for peer in self.peers.values():
            if not self.jobs.queue and not self.jobs.checks:
                break
            if peer.waiting and peer.ready and not peer.outvoted and peer.replica_step == self.step:
                out += self._lease_to(peer, pushed=True)
        return out

    def _on_result(self, peer: Peer, msg: messages.Result) -> list[Output]:
        out: list[Output] = []
        started = peer.job_started.pop(msg.chunk, None)
        if started is not None and msg.step == self.step:
            at, together = started  # chunks scored in one pass share its time
            seconds = max((self.clock() - at) / together, 1e-9)
            tokens = member_tokens(self.cfg, self.cfg.es.chunk_size)
            out.append(ChunkTimed(peer.name, seconds, tokens))
        if msg.step == self.step:
            try:
                out += self.trust.check_digest(peer, msg.step, msg.replica_digest, self.step)
            except Distrusted as exc:
                refused = self.refuse(peer, exc.code, exc.message, *out, *exc.events)
                refused.events.append(
                    ResultDropped("diverged", peer.name, msg.step, msg.chunk, True)
                )
                raise refused from None
        claim = self._claim_of(peer, msg)
        blind = claim is not None and not peer.claims_seen.pop((msg.step, msg.chunk), 0)
        outcome = self.jobs.complete_chunk(
            *(peer.id, msg.step, msg.chunk, msg.fitness, msg.pair_count, msg.loss_sum),
            verify=self.trust.suspect(peer),
            blind=blind,
        )
        kept = (Outcome.ACCEPTED, Outcome.VOTED, Outcome.DISPUTED)
        checked = msg.chunk in self.jobs.verify  # a chunk settled unchecked needs no claims
        if self.claims is not None and claim is not None and outcome in kept and checked:
            self.claims.attach(msg.chunk, (msg.fitness, msg.loss_sum), claim)
        if self.claims is not None and msg.chunk in self.jobs.results:
            self.claims.settled(msg.chunk)
        if outcome not in (Outcome.STALE, Outcome.OUT_OF_RANGE, Outcome.BAD_SIZE):
            peer.worked, peer.stalled = self.clock(), False  # work for the open step
        dropped = ResultDropped(outcome.value, peer.name, msg.step, msg.chunk)
        if outcome is Outcome.UNLEASED:
            raise self.refuse(
                peer,
                ErrorCode.ILLEGAL_STATE,
                f"RESULT for chunk {msg.chunk} of step {msg.step}, which was not leased to "
                "this worker",
                *out,
                ResultDropped(outcome.value, peer.name, msg.step, msg.chunk, True),
            )
        if outcome is Outcome.BAD_LOSS:
            raise self.refuse(
                peer,
                ErrorCode.MALFORMED,
                f"RESULT loss sum {msg.loss_sum} is impossible for a chunk of this run "
                f"(range {self.loss_range[0]}..{self.loss_range[1]})",
                *out,
                ResultDropped(outcome.value, peer.name, msg.step, msg.chunk, True),
            )
        if outcome is Outcome.ACCEPTED:
            out.append(ChunkAccepted(peer.name, msg.step, msg.chunk))
            if len(self.jobs.votes[msg.chunk]) > 1 or msg.chunk in self.jobs.verify:
                out.append(ChunkChecked("agreed", msg.step, (msg.chunk,)))
        elif outcome is Outcome.DISPUTED:
            out.append(ChunkChecked("disputed", msg.step, (msg.chunk,)))
        elif outcome is not Outcome.VOTED:
            out.append(dropped)
        if outcome in (Outcome.ACCEPTED, Outcome.DISPUTED, Outcome.OUTVOTED):
            out += self.trust.note_dispute(self.jobs, self.step, msg.chunk)  # before convict
        out += self.trust.convict(self.jobs, self.step)
        if convicted := self.trust.take_convicted():
            rewound, said = self._rewind(convicted)
            out += said
            if rewound:
                return out  # every worker reconnects: the open step starts afresh
        out += self.trust.waive(self.jobs, self.step) + self._push_jobs()
        return out + self._commit() if self.jobs.complete else out

    def _claim_of(self, peer: Peer, msg: messages.Result) -> bytes | None:
        """The CLAIM a RESULT of the open step stands behind, in a run checked by claims;
        such a RESULT without one is refused."""
        if self.claims is None or msg.step != self.step:
            return None
        if peer.id not in self.jobs.holders.get(msg.chunk, ()):
            return None  # not its chunk: refused as such
        claim = self.claims.take(peer.id, msg.chunk)
        if claim is None:
            raise self.refuse(
                peer,
                ErrorCode.MALFORMED,
                f"RESULT for chunk {msg.chunk} without a CLAIM of its completions: this run "
                "checks results through their text (a worker of an older version?)",
            )
        return claim

    def _on_claim(self, peer: Peer, msg: messages.Claim) -> list[Output]:
        if self.claims is None:
            raise self.refuse(peer, ErrorCode.ILLEGAL_STATE, "CLAIM in a run checked without")
        # a lease of this step it has not answered yet: one pending claim each
        held = peer.id in self.jobs.holders.get(msg.chunk, ()) and msg.chunk in peer.job_started
        problem = self.claims.problem(msg, held)
        if problem is not None:
            raise self.refuse(peer, ErrorCode.MALFORMED, problem)
        self.claims.put(peer.id, msg)
        return []

    def _commit(self) -> list[Output]:
        """Make the open step durable, then broadcast it and open the next one."""
        step, jobs = self.step, self.jobs
        packed = jobs.step_fitness()
        try:
            self.store.fitness_log.append(step, packed)  # fsync'd: committed from here on
        except OSError as exc:
            # What reached the disk is unknown: stop, and let a restart repair the tail.
            # The fitness log is the run: the one file whose loss stops it.
            raise Fatal(
                f"cannot commit step {step} to {self.store.fitness_log.path}: "
                f"{exc.strerror or exc}; the coordinator stops (restart it once the disk is "
                "fixed: it repairs the log's tail and resumes)"
            ) from None
        self.store.flush_run()  # run.json, if an earlier write of it failed
        settled = {c: (jobs.results[c], jobs.losses[c]) for c in jobs.results}
        self.provenance.record(step, sources(jobs.votes, settled, self.trust.host, jobs.group))
        message = messages.Step(step, self.cfg.pairs, packed)
        # reported before any STEP goes out
        now, workers = self.clock(), self.ready_count()
        out: list[Output] = [committed(self.cfg, step, jobs, now, self.weights_changed, workers)]
        for peer in self.peers.values():
            if peer.ready and not peer.outvoted:
                peer.waiting = False
                peer.job_started.clear()
                out.append(Send(peer.id, message))
        self.jobs = self._open_step(self.step)
        self.trust.next_step(self.step)
        every = self.options.snapshot_every
        if every and self.step % every == 0:
            self.snapshot.step = self.step
        every = self.cfg.validation.every_steps
        if every and self.step % every == 0:
            self.validation.step = self.step
        every = self.options.sample_every
        if self.sample.step is not None or (every and self.step % every == 0):
            self.sample.step = self.step  # one not yet asked for is written at this step
        max_steps = self.options.max_steps
        if max_steps is not None and self.step >= max_steps:
            self._finish()
        return out

    def _rewind(self, convicted: list[Group]) -> tuple[bool, list[Output]]:
        """Undo the committed steps holding unconfirmed results of `convicted` within the
        horizon (rewind.py; SPEC §8 Rewinds): whether any were. Every connected
        worker is closed with RUN_REWOUND and reconnects to the shortened run."""
        machines = ", ".join(sorted({g[0] for g in convicted}))
        why = f"{machines} lost a vote at step {self.step}"
        rewind, outside = plan(self.provenance, convicted, self.step, why)
        out: list[Output] = [RewindOutside(o.first, o.last, o.chunks, o.why) for o in outside]
        if rewind is None:
            return False, out
        try:
            kept = self.store.rewind(rewind.to, rewind.chunks, why)
        except OSError as exc:  # the log may be cut or not: a restart finishes it
            raise Fatal(
                f"cannot rewind {self.store.fitness_log.path} to step {rewind.to}: "
                f"{exc.strerror or exc}; the coordinator stops (restart it: it finishes the "
                "rewind and resumes)"
            ) from None
        out.append(Rewound(rewind.to, rewind.end, rewind.chunks, why, str(kept)))
        self.provenance.forget_from(rewind.to)
        self.trust.rewound(rewind.to)
        for want in (self.snapshot, self.validation, self.sample):
            want.step = want.asked = None
        self.snapshot_failed, self.weights_changed = None, None
        self.finished = False
        self.jobs = self._open_step(self.step)
        for peer in self.peers.values():
            if peer.ready:
                peer.outvoted = RUN_REWOUND  # anything it sends before the close is refused
                out.append(Close(peer.id, ErrorCode.DIVERGED, RUN_REWOUND))
        return True, out

    def _finish(self) -> None:
        """--max-steps reached: stop leasing and want the final snapshot, and the final
        held-out score where the run scores any (the curve ends at the run's last step)."""
        self.finished = True
        if self.step and self.store.latest_snapshot != self.step:
            self.snapshot.step = self.step
        if (
            self.step
            and self.cfg.validation.every_steps
            and self.step % self.cfg.validation.every_steps
        ):
            self.validation.step = self.step

    def _open_step(self, step: int) -> StepJobs:
        if self.claims is not None:
            self.claims.start(step)
        share = self.options.verify_fraction if self.exact or self.agreement else 0.0
        last, horizon = self.options.max_steps, self.options.rewind_steps
        if share and horizon and last is not None and step >= last - horizon:
            share = 1.0  # the run's final horizon is checked in full (SPEC §8 Rewinds)
        return StepJobs(
            step,
            self.cfg.chunks,
            self.cfg.es.chunk_size,
            self.clock,
            self.timer,
            loss_range=self.loss_range,
            verify=[c for c in range(self.cfg.chunks) if self._draw.random() < share],
            exact=self.exact,
            agreement=self.agreement,
            group=self.trust.group,
        )

    def _on_fitness_request(self, peer: Peer, msg: messages.FitnessRequest) -> list[Output]:
        return self._fitness_range(peer, msg.first_step, msg.max_steps)

    def _fitness_range(self, peer: Peer, first: int, max_steps: int) -> list[Output]:
        limit = min(
            max_steps, CATCHUP_STEPS, messages.FitnessRange.max_steps_per_frame(self.cfg.pairs)
        )
        count = max(0, min(limit, self.step - first))
        packed = self.store.fitness_log.read(first, count) if count else []
        reply = Send(peer.id, messages.FitnessRange.from_steps(first, self.cfg.pairs, packed))
        return [CatchupServed(peer.name, first, count), reply] if count else [reply]

    # ------------------------------------------------------------------ wants

    def _ask(self, want: Want, peer: Peer, request: Callable[[Peer, int], Message]) -> list[Output]:
        """Ask `peer` for what `want` wants if its replica is at that step (SPEC §8)."""
        if not want.at(peer):
            return []
        return [Send(peer.id, request(peer, want.ask(peer)))]

    # ------------------------------------------------------------------ snapshots

    def want_snapshot(self) -> list[Output]:
        """Ask a worker at the open step for its state (the final snapshot on shutdown)."""
        if self.step == 0 or self.store.latest_snapshot == self.step:
            return []  # the initial state is a pure function of the config
        if self.snapshot_failed == self.step:
            return []  # this step's snapshot was dropped: the next step is the next chance
        self.snapshot.step = self.step
        if self.snapshot.asked is not None:
            return []
        for peer in self.peers.values():
            if out := self._ask_snapshot(peer):
                return out
        return [NoSnapshotSource(self.step)]

    def _ask_snapshot(self, peer: Peer) -> list[Output]:
        # One transfer at a time, and only of a state the run agrees on (worth keeping).
        step = self.snapshot.step
        if self.snapshot.asked is not None or step is None or peer.replica_step != step:
            return []
        if self.store.digests.get(step) is None and self.trust.provisional(peer, step) is None:
            return []
        return self._ask(self.snapshot, peer, self._snapshot_request)

    def _snapshot_request(self, peer: Peer, step: int) -> messages.SnapshotRequest:
        peer.snapshot, peer.snapshot_total = bytearray(), 0
        return messages.SnapshotRequest(step)

    def _on_snapshot_request(self, peer: Peer, msg: messages.SnapshotRequest) -> list[Output]:
        step = self.store.latest_snapshot
        if step is None:
            raise self.refuse(peer, ErrorCode.ILLEGAL_STATE, "the run has no snapshot yet")
        return [ServeSnapshot(peer.id, step)]

    def snapshot_gone(self, peer_id: int, step: int) -> Refused:
        """The snapshot to serve was pruned meanwhile by a newer one: the worker asks again."""
        return self.refuse(
            self.peers[peer_id], ErrorCode.INTERNAL, f"snapshot {step} is no longer available"
        )

    def _on_snapshot_chunk(self, peer: Peer, msg: messages.SnapshotChunk) -> list[Output]:
        if peer.snapshot is None or msg.offset != len(peer.snapshot):
            raise self.refuse(peer, ErrorCode.ILLEGAL_STATE, "unexpected snapshot chunk")
        asked = self.snapshot.asked
        requested = asked[1] if asked is not None and asked[0] == peer.id else None
        if msg.step != requested or msg.total_bytes != self.checkpoint_size:
            raise self.refuse(
                peer,
                ErrorCode.ILLEGAL_STATE,
                f"snapshot of step {msg.step}, {msg.total_bytes} bytes: step "
                f"{requested} was asked for, {self.checkpoint_size} bytes",
            )
        peer.snapshot += msg.data
        if len(peer.snapshot) > msg.total_bytes:
            raise self.refuse(peer, ErrorCode.MALFORMED, "snapshot longer than announced")
        if len(peer.snapshot) < msg.total_bytes:
            return []
        blob, peer.snapshot = bytes(peer.snapshot), None
        return [StoreSnapshot(peer.id, blob)]

    def snapshot_decoded(
        self, peer_id: int, state: ReplicaState | None, error: str = ""
    ) -> SnapshotRejected | None:
        """Whether a received snapshot may be stored (SPEC §8: committed, digest agrees):
        None when it may, and `snapshot_stored` follows the write; else why not, and the
        transfer is over."""
        peer = self.peers.get(peer_id)
        reason = error
        if state is not None:
            step = state.step
            agreed = self.store.digests.get(step)
            if agreed is None and peer is not None:  # the sole worker's, checked by its state
                agreed = self.trust.provisional(peer, step)
            asked = self.snapshot.asked
            if (
                state.config.digest() != self.cfg.digest()
                or asked is None
                or step != asked[1]
                or agreed is None
                or agreed != state.digest()
            ):
                reason = "config, step or digest does not match the run"
            elif step not in self.store.digests:
                self.trust.agree(step, agreed)
        if not reason:
            return None
        self.snapshot.retry(peer_id)  # only now may another worker be asked
        return SnapshotRejected(self.name(peer_id), reason)

    def snapshot_dropped(self, peer_id: int, step: int, failure: WriteFailure) -> SnapshotDropped:
        """The shell could not store the snapshot of `step` (a full disk): it is dropped and
        not asked for again (of this worker or another) until the next snapshot step. The
        worker did nothing wrong: its session goes on."""
        self.snapshot.drop(peer_id)
        if self.snapshot.step is not None and self.snapshot.step <= step:
            self.snapshot.step = None
        self.snapshot_failed = step
        return SnapshotDropped(
            step, self.name(peer_id), str(failure.path), failure.error, failure.free_bytes
        )

    def snapshot_stored(self, peer_id: int, state: ReplicaState, size: int) -> SnapshotStored:
        wanted = self.snapshot.step
        if wanted is not None and state.step >= wanted:
            self.snapshot.step = None
        self.snapshot.drop(peer_id)  # only now may another worker be asked
        return SnapshotStored(state.step, self.name(peer_id), size, state.digest_hex())

    # ------------------------------------------------------------------ validation

    def _on_validation(self, peer: Peer, msg: messages.Validation) -> list[Output]:
        if not self.validation.answered(peer.id, msg.step):
            return []  # only the worker asked sets the run's held-out score
        return [Validated(peer.name, msg)]

    # ------------------------------------------------------------------ samples

    def _may_sample(self, peer: Peer, idle: bool) -> bool:
        """Whether `peer`, at the wanted step, may write the sample now: it has nothing to
        evaluate, or it is the only worker at the step (it answers after its chunk)."""
        step = self.sample.step
        if step is None or idle:
            return True
        others = [p.replica_step for p in self.peers.values() if p is not peer and p.ready]
        # Another worker at (or just reaching) the step will be told to WAIT.
        return not any(s is not None and s >= step - 1 for s in others)

    def _on_sample_text(self, peer: Peer, msg: messages.SampleText) -> list[Output]:
        if msg.seed != msg.step or not self.sample.answered(peer.id, msg.step):
            return []  # only the worker asked writes the run's sample
        # Model bytes: decoded with replacement characters, then one line with every control
        # character escaped, so no worker can write terminal escapes into an operator's log.
        prompt, text = (
            escape(b.decode("utf-8", errors="replace"), keep_newlines=False)
            for b in (msg.prompt, msg.text)
        )
        return [Sampled(msg.step, peer.name, prompt, text)]

    # ------------------------------------------------------------------ the rest

    def _on_heartbeat(self, peer: Peer, msg: messages.Heartbeat) -> list[Output]:
        return []

    def _on_log(self, peer: Peer, msg: messages.Log) -> list[Output]:
        return list(worker_log(peer, msg, self.clock()))

    def _on_error(self, peer: Peer, msg: messages.Error) -> list[Output]:
        return [WorkerError(peer.name, int(msg.code), msg.message)]


# Incoming message type -> handler. The connection's state machine (protocol/connection.py)
# has already checked that the type is legal in the connection's state.
_HANDLERS: dict[MsgType, Callable[[RunCore, Peer, Message], list[Output]]] = {
    MsgType.HELLO: on_hello,
    MsgType.AUTH: on_auth,
    MsgType.JOB_REQUEST: RunCore._on_job_request,
    MsgType.RESULT: RunCore._on_result,
    MsgType.CLAIM: RunCore._on_claim,
    MsgType.FITNESS_REQUEST: RunCore._on_fitness_request,
    MsgType.SNAPSHOT_REQUEST: RunCore._on_snapshot_request,
    MsgType.SNAPSHOT_CHUNK: RunCore._on_snapshot_chunk,
    MsgType.VALIDATION: RunCore._on_validation,
    MsgType.SAMPLE_TEXT: RunCore._on_sample_text,
    MsgType.HEARTBEAT: RunCore._on_heartbeat,
    MsgType.LOG: RunCore._on_log,
    MsgType.ERROR: RunCore._on_error,
}  # type: ignore[dict-item]
