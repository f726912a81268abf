"""The worker's side of one connection (protocol/SPEC.md §8) as pure code.

No asyncio, no sockets, no backend calls. `Session` reads the replica through `ReplicaView`
(plain attributes) and answers every event with a list of commands for the shell's
`Executor` (`link.py`) to carry out in order: send a message, evaluate a job, apply steps,
drop or start the replica, decode or install a snapshot, export one, validate, write a
sample. A command's result comes back as a call (`evaluated`, `snapshot_decoded`,
`validated`, `sampled`), which may return more commands. The shell carries out one command
at a time, so the session never sees a message while a command of its own is in flight; a
validation's scores come back later, between commands, as a message does (RunValidation:
its copy of the weights is scored while the worker trains on).

Rule 1: everything that decides what the worker asks for, waits for or ignores lives in this
file; the shell only moves bytes and runs what it is told.

Theory of operation. After the handshake (HELLO, CHALLENGE, AUTH, WELCOME), the worker has
at most one thing outstanding, named by its phase:

    LOADING_SNAPSHOT  SNAPSHOT_REQUEST sent; chunks arrive, then the blob is decoded
    CATCHING_UP       FITNESS_REQUEST sent; a FITNESS_RANGE is due
    REQUESTED         JOB_REQUEST sent; a JOB or WAIT is due, or a STEP overtakes it
    WAITING           WAIT received; ask again at `retry_at` unless a JOB or STEP comes
    EVALUATING        a JOB handed to the shell; its RESULT follows `evaluated`
    IDLE              nothing outstanding: `advance()` asks for what comes next

`advance()` asks FITNESS_REQUEST while the replica is behind the steps the run has
committed (as far as this worker knows) and JOB_REQUEST once it is level. Only the newest
request counts: a JOB or FITNESS_RANGE for a step the replica has left answers a request a
STEP overtook, and is ignored. A STEP for the replica's step is applied at once (and ends a
WAIT); one for a later step means the replica is behind, so it catches up. While a snapshot
loads, STEP and FITNESS_RANGE only raise what the worker knows the run has committed.

To add a request/reply pair the coordinator starts (as VALIDATE/VALIDATION): a handler in
the running rows of `_TABLE` that returns a command, the command class, a result call that
returns the reply to send, and the command's case in `link.Executor` (a replica call).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import structlog

from ..protocol import (
    LATEST_SNAPSHOT,
    MAX_CHUNKS_PER_REQUEST,
    MAX_CLAIMS_PER_CHUNK,
    PROTOCOL_VERSION,
    ErrorCode,
    LogLevel,
    Message,
    MsgType,
    auth_mac,
    messages,
    unpack_ternary,
)
from ..protocol.errors import ADDRESS_OUTVOTED, RUN_COMPLETE, RUN_REWOUND
from ..shared.config import ConfigError, RunConfig, from_canonical_bytes
from ..shared.fitness import checked_by_claims, member_tokens
from ..shared.model import ARCHS
from ..shared.progress import Progress
from ..shared.replica import ReplicaState, checkpoint_bytes
from .backend import ChunkResult, HeldOut
from .backend import Validation as Score
from .session_types import (
    FATAL_CODES,
    FINISHED,
    FITNESS_STEPS_PER_REQUEST,
    QUIET_S,
    Apply,
    Command,
    DecodeSnapshot,
    DropReplica,
    Ended,
    Evaluate,
    ExportSnapshot,
    Identity,
    InstallSnapshot,
    PeerViolation,
    Phase,
    ReplicaView,
    RunFinished,
    RunSample,
    RunValidation,
    Send,
    StartReplica,
    WorkerFatal,
)

__all__ = ["Session"]

log = structlog.get_logger("eggroll.worker")


@dataclass
class _Download:
    """A snapshot arriving as SNAPSHOT_CHUNKs (offsets ascending, total fixed)."""

    started: float
    step: int | None = None
    total: int | None = None
    received: int = 0
    parts: list[bytes] = field(default_factory=list)
    progress: Progress | None = None  # from the first chunk, which gives the size


class Session:
    def __init__(
        self, me: Identity, replica: ReplicaView, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.me = me
        self.replica = replica
        self.clock = clock
        self.phase = Phase.HELLO_SENT
        self.config: RunConfig | None = None
        self.committed = 0  # steps the coordinator has committed, as far as we know
        self.newest_step_frame = 0  # 1 + newest STEP read off the socket (maybe not handled)
        self.retry_at: float | None = None  # WAITING: when to ask again
        self._download: _Download | None = None
        self._catchup: tuple[int, float] | None = None  # (from step, start time) while behind
        self._last_failure = ""  # the reward's last failure on a chunk
        self._batch: list[messages.Job] = []  # JOBs of the request so far, while more are due
        self._claims: dict[int, list[np.ndarray]] = {}  # chunk -> results to check (CLAIMs)
        self._more: int | None = None  # the last JOB's `more`, while the request's JOBs come
        self._batch_step = -1
        self._replay: tuple[int, Progress] | None = None  # (from step, its progress) likewise
        self._nonce = b""
        self._scored = -1  # the step of the last chunks this worker evaluated
        # A STEP came for a step this worker scored: its results and replica were not
        # found wrong in it (an outvoted or diverged worker gets no more STEPs).
        self.confirmed = False

    @property
    def welcomed(self) -> bool:
        return self.config is not None

    # --- events ----------------------------------------------------------------------------

    def start(self) -> list[Command]:
        me = self.me
        return [
            Send(messages.Hello(PROTOCOL_VERSION, me.name, me.backend, me.device, me.data_digest))
        ]

    def receive(self, msg: Message) -> list[Command]:
        """Act on one message; raises Ended, WorkerFatal or PeerViolation."""
        if msg.TYPE is MsgType.HEARTBEAT:
            return []  # receiving it already proved the coordinator alive
        if isinstance(msg, messages.Error):
            raise self._on_error(msg)
        if (
            self._more is not None and msg.TYPE is not MsgType.JOB
        ):  # SPEC §8: a request's JOBs are contiguous
            raise PeerViolation(f"{msg.TYPE.name} among the JOBs of one request")
        handler = _TABLE[self.phase].get(msg.TYPE)
        if handler is None:
            raise PeerViolation(f"unexpected {msg.TYPE.name} while {self.phase.value}")
        return handler(self, msg)

    def step_frame_seen(self, step: int) -> None:
        """A STEP was read off the socket (called before it is handled, while a chunk may
        run): a running evaluation of that step is no longer needed."""
        self.newest_step_frame = max(self.newest_step_frame, step + 1)

    def retry_due(self) -> None:
        """The WAIT has run out: ask again."""
        if self.phase is Phase.WAITING:
            self.phase, self.retry_at = Phase.IDLE, None

    def advance(self) -> list[Command]:
        """Ask for what comes next unless an answer, a snapshot or a WAIT is outstanding."""
        if self.phase is not Phase.IDLE:
            return []
        replica = self.replica
        if replica.step < self.committed:
            if self._catchup is None:
                self._catchup = (replica.step, self.clock())
            self._replay_progress(replica.step)
            self.phase = Phase.CATCHING_UP
            return [Send(messages.FitnessRequest(replica.step, self._fitness_batch()))]
        if self._replay is not None:
            self._replay[1].finish(say=False)  # "caught up" says the rest
            self._replay = None
        if self._catchup is not None:
            start, t0 = self._catchup
            self._catchup = None
            log.info(
                "caught up",
                from_step=start,
                to_step=replica.step,
                seconds=round(self.clock() - t0, 3),
                digest=f"{replica.digest:016x}",
            )
        self.phase = Phase.REQUESTED
        return [
            Send(
                messages.JobRequest(
                    replica.step, replica.digest, replica.weights_changed, replica.parallel_chunks
                )
            )
        ]

    def _replay_progress(self, step: int) -> None:
        """The replay of the fitness log, from where it began to the steps committed so far
        (a bar on a terminal, a line now and then in a log)."""
        if self._replay is None or step < self._replay[0]:  # a dropped replica starts again
            progress = Progress(
                "replay",
                self.committed - step,
                "steps",
                say=lambda p: log.info("catching up", **p.fields()),
                quiet_s=QUIET_S,
                clock=self.clock,
            )
            self._replay = (step, progress)
        first, progress = self._replay
        progress.total = self.committed - first
        progress.update(step - first)

    # --- results of commands -----------------------------------------------------------

    def evaluated(
        self, jobs: tuple[messages.Job, ...], results: list[ChunkResult], seconds: float
    ) -> list[Command]:
        self.phase = Phase.IDLE
        self._last_failure = ""
        step = jobs[0].step
        chunks = [job.chunk for job in jobs]
        if self.newest_step_frame > step:
            # The step was committed meanwhile (another worker's copy won): nobody needs it.
            log.info("chunk dropped", step=step, chunks=chunks, reason="step committed")
            return []
        assert self.config is not None
        members = sum(job.member_count for job in jobs)
        tokens = member_tokens(self.config, members)
        log.info(
            "chunk done",
            step=step,
            chunk=chunks[0] if len(chunks) == 1 else chunks,
            members=members,
            seconds=round(seconds, 3),
            member_tok_s=round(tokens / max(seconds, 1e-9)),
        )
        replica, out = self.replica, []
        for job, result in zip(jobs, results, strict=True):
            if result.tokens is not None:  # what the fitness comes from, checked by others
                out.append(Send(messages.Claim.from_ids(job.step, job.chunk, result.tokens)))
            out.append(
                Send(
                    messages.Result.from_values(
                        step=job.step,
                        chunk=job.chunk,
                        loss_sum=result.loss_sum,
                        weights_changed=replica.weights_changed,
                        replica_digest=replica.digest,
                        fitness=result.fitness,
                    )
                )
            )
        return out

    def evaluation_failed(self, jobs: tuple[messages.Job, ...], error: str) -> list[Command]:
        """The run's reward failed on chunks: drop them (the coordinator leases them again)
        and say why in both logs; a failure on the next request too leaves the run."""
        if self._last_failure:  # two requests in a row, whatever the completions were
            raise WorkerFatal(f"the reward failed twice: {error}", ErrorCode.INTERNAL, tell=True)
        self._last_failure = error
        self.phase = Phase.IDLE
        step, chunks = jobs[0].step, [job.chunk for job in jobs]
        log.error("chunk failed", step=step, chunks=chunks, error=error)
        names = ", ".join(map(str, chunks))
        text = f"chunk {names} of step {step} failed: {error}"
        return [Send(messages.Log(LogLevel.ERROR, text[:1000]))]  # LOG carries 4096 bytes of UTF-8

    def snapshot_decoded(
        self, step: int, state: ReplicaState | None, error: str = ""
    ) -> list[Command]:
        """Check a decoded snapshot against the run; a bad one is replaced by the log."""
        assert self.config is not None
        if state is not None:
            if state.step != step:
                error = f"snapshot holds step {state.step}, its chunks said {step}"
            elif state.config.digest() != self.config.digest():
                error = "snapshot was made with another run config"
            elif state.step > self.committed:
                error = f"snapshot at step {state.step} is past the run's {self.committed} steps"
        if error or state is None:
            # The fitness log is the run itself: replay it instead of trusting this blob.
            log.warning("snapshot rejected; replaying the fitness log instead", reason=error)
            return []
        if state.step <= self.replica.step:
            log.info("snapshot not newer than the replica", step=state.step)
            return []
        return [InstallSnapshot(state)]

    def validated(self, step: int, v: Score, seconds: float) -> list[Command]:
        w, s = (m or HeldOut(0, 0, 0.0, 0.0) for m in (v.windows, v.streams))  # 0 tokens: none
        log.info(
            "validation",
            step=step,
            **v.log_fields(),
            tokens=w.tokens,
            seconds=round(seconds, 3),
        )
        message = messages.Validation(
            step,
            tokens=w.tokens,
            loss_16=w.loss_16,
            bits_per_token=w.bits_per_token,
            text_bytes=w.text_bytes,
            stream_tokens=s.tokens,
            stream_loss_16=s.loss_16,
            stream_bits_per_token=s.bits_per_token,
            stream_text_bytes=s.text_bytes,
            reward_prompts=v.reward_prompts,
            reward=v.reward or 0.0,
        )
        return [Send(message)]

    def sampled(
        self, request: messages.Sample, prompt: bytes, text: bytes, seconds: float
    ) -> list[Command]:
        log.info(
            "sample written",
            step=request.step,
            tokens=request.new_tokens,
            seconds=round(seconds, 3),
        )
        return [Send(messages.SampleText(request.step, request.seed, prompt, text))]

    # --- handshake -------------------------------------------------------------------------

    def _on_challenge(self, msg: messages.Challenge) -> list[Command]:
        self.phase = Phase.AUTH_SENT
        return [Send(messages.Auth(auth_mac(self.me.token, msg.nonce)))]

    def _on_welcome(self, msg: messages.Welcome) -> list[Command]:
        """Check the run config and keep, or start afresh, the replica (SPEC §8 catch-up)."""
        config = self._check_config(msg)
        self.config = config
        self.committed = msg.current_step
        out: list[Command] = []
        replica, step = self.replica, self.replica.step
        if replica.config_digest is not None:
            if replica.run_id != msg.run_id or replica.config_digest != config.digest():
                log.info("new run: the replica starts again from step 0", run=msg.run_id.hex())
                out.append(DropReplica("new run"))
            elif replica.step > msg.current_step:
                # Steps the run has not committed: the replica cannot be trusted.
                reason = f"at step {replica.step}, the run has {msg.current_step}"
                log.warning("replica dropped", reason=reason)
                out.append(DropReplica(reason))
        if replica.config_digest is None or out:
            out.append(StartReplica(config, msg.run_id))
            step = 0
        log.info(
            "connected",
            coordinator=self.me.coordinator,
            run=msg.run_id.hex(),
            run_step=msg.current_step,
            replica_step=step,
            snapshot_step=msg.snapshot_step,
        )
        if msg.snapshot_step > step:
            self._catchup = (step, self.clock())
            self._download = _Download(self.clock())
            self.phase = Phase.LOADING_SNAPSHOT
            out.append(Send(messages.SnapshotRequest(LATEST_SNAPSHOT)))
        else:
            self.phase = Phase.IDLE
        return out

    def _check_config(self, msg: messages.Welcome) -> RunConfig:
        me = self.me
        try:
            config = from_canonical_bytes(msg.config_bytes)
        except ConfigError as exc:
            raise self._refuse(
                f"the run config from {me.coordinator} is not valid for this worker version: {exc}"
            ) from None
        if config.pairs != msg.pairs_per_step:
            raise self._refuse(
                f"WELCOME says {msg.pairs_per_step} pairs per step, the run config has "
                f"{config.pairs}"
            )
        problem = me.serves(config)
        if problem is not None:
            raise self._refuse(problem)
        if not ARCHS[config.model.arch].OWN_TOKENIZER:  # it reads the data's tokens
            if me.vocab_size != config.model.vocab_size:
                raise self._refuse(
                    f"the run's model has a vocabulary of {config.model.vocab_size}, this "
                    f"worker's data has {me.vocab_size}: point --data-dir at the run's data"
                )
            if me.train_tokens <= config.es.seq_len:
                raise self._refuse(
                    f"this worker's input.bin has {me.train_tokens} tokens, the run's "
                    f"es.seq_len={config.es.seq_len} needs more: point --data-dir at the "
                    "run's data"
                )
        # Its goal files (reward, prompts, start, model) are checked as the replica starts,
        # off the event loop (`Replica.start`).
        return config

    def _refuse(self, message: str) -> WorkerFatal:
        """This worker cannot run the run's config: tell the coordinator, and give up."""
        return WorkerFatal(message, ErrorCode.CONFIG_MISMATCH, tell=True)

    # --- running -----------------------------------------------------------------------------

    def _on_job(self, job: messages.Job) -> list[Command]:
        step = self.replica.step
        if job.step != step:
            # Only a replica at the job's step may evaluate it. An older job answers a request
            # that a STEP overtook (a newer request is on its way); a newer one means this
            # replica is behind, and advance() catches up.
            log.info("job skipped", step=job.step, chunk=job.chunk, replica_step=step)
            if job.step > step:
                self.committed = max(self.committed, job.step)
            return self._batch_done(job)
        assert self.config is not None
        population = self.config.es.population
        if job.first_member + job.member_count > population:
            raise PeerViolation(
                f"JOB members [{job.first_member}, {job.first_member + job.member_count}) lie "
                f"outside the population of {population}"
            )
        if any(j.chunk == job.chunk for j in self._batch):
            raise PeerViolation(f"chunk {job.chunk} twice in the JOBs of one request")
        self._batch.append(job)
        return self._batch_done(job)

    def _batch_done(self, job: messages.Job) -> list[Command]:
        """After a JOB: wait for the request's next one (`more`), or evaluate what it gave."""
        if self._more is not None and job.more != self._more - 1:
            raise PeerViolation(f"a request's JOBs count down from {self._more}, then {job.more}")
        if job.step != self._batch_step and self._more is not None:
            raise PeerViolation(f"JOBs of one request for steps {self._batch_step}, {job.step}")
        if job.more:
            self._more, self._batch_step = job.more, job.step
            self.phase = Phase.REQUESTED  # the request is still being answered
            return []
        self._more = None
        batch, self._batch = tuple(self._batch), []
        claims, self._claims = self._claims, {}
        if not batch:  # every JOB skipped: nothing to evaluate; advance() asks again
            if self.phase in (Phase.REQUESTED, Phase.CATCHING_UP):
                self.phase = Phase.IDLE
            return []
        self.phase, self.retry_at = Phase.EVALUATING, None
        self._scored = batch[0].step
        if not claims:
            return [Evaluate(batch)]
        return [Evaluate(batch, tuple(tuple(claims.get(job.chunk, ())) for job in batch))]

    def _on_claim(self, msg: messages.Claim) -> list[Command]:
        """A result to check before the chunk's JOB (SPEC §21 CLAIM): its size is checked
        against the run's config before it is kept, at most MAX_CLAIMS_PER_CHUNK a chunk."""
        cfg = self.config
        assert cfg is not None
        if not checked_by_claims(cfg):
            raise PeerViolation("CLAIM in a run whose results are not checked through claims")
        if msg.step != self.replica.step:
            return []  # its JOB is skipped too
        f = cfg.fitness
        ids = cfg.es.chunk_size * f.prompts_per_step * f.completion_tokens
        if len(msg.tokens) != 4 * ids:
            raise PeerViolation(f"CLAIM of {len(msg.tokens) // 4} token ids; a chunk writes {ids}")
        held = self._claims.setdefault(msg.chunk, [])
        if len(held) >= MAX_CLAIMS_PER_CHUNK or len(self._claims) > MAX_CHUNKS_PER_REQUEST:
            raise PeerViolation(f"more CLAIMs than one request's JOBs check (chunk {msg.chunk})")
        shape = (cfg.es.chunk_size, f.prompts_per_step, f.completion_tokens)
        held.append(msg.ids().reshape(shape))
        return []

    def _skip_job(self, job: messages.Job) -> list[Command]:
        log.info("job skipped", step=job.step, chunk=job.chunk, reason="loading a snapshot")
        return []

    def _on_wait(self, msg: messages.Wait) -> list[Command]:
        self.phase = Phase.WAITING
        self.retry_at = self.clock() + msg.retry_after_ms / 1000
        return []

    def _on_step(self, msg: messages.Step) -> list[Command]:
        step = self.replica.step
        if msg.step < step:
            return []  # already applied (from a FITNESS_RANGE)
        self.committed = max(self.committed, msg.step + 1)
        if msg.step > step:
            # Behind: catch up with FITNESS_REQUEST, unless one is already out. A STEP also
            # ends a WAIT (SPEC §8).
            if self.phase in (Phase.REQUESTED, Phase.WAITING):
                self.phase, self.retry_at = Phase.IDLE, None
            return []
        # SPEC §8: after applying a STEP the worker sends JOB_REQUEST, whatever it asked
        # before (the coordinator may leave a request from the old step unanswered).
        assert self.config is not None
        if msg.pair_count != self.config.pairs:
            raise PeerViolation(
                f"STEP {msg.step} has {msg.pair_count} pairs, the run has {self.config.pairs}"
            )
        self.phase, self.retry_at = Phase.IDLE, None
        self.confirmed |= msg.step == self._scored
        return [Apply([unpack_ternary(msg.fitness, msg.pair_count)])]

    def _note_step(self, msg: messages.Step) -> list[Command]:
        self.committed = max(self.committed, msg.step + 1)
        return []

    def _on_fitness_range(self, msg: messages.FitnessRange) -> list[Command]:
        end = self._note_range(msg)
        step = self.replica.step
        if msg.first_step < step and end <= step:
            return []  # answers a request a STEP overtook: nothing new, a newer answer is due
        if msg.first_step > step:
            raise PeerViolation(
                f"FITNESS_RANGE starts at step {msg.first_step}, the replica needs step {step}"
            )
        if self.phase in (Phase.REQUESTED, Phase.CATCHING_UP):
            self.phase = Phase.IDLE
        pairs = msg.pairs_per_step
        todo = msg.split()[step - msg.first_step :]
        return [Apply([unpack_ternary(packed, pairs) for packed in todo])] if todo else []

    def _note_range(self, msg: messages.FitnessRange) -> int:
        assert self.config is not None
        if msg.pairs_per_step != self.config.pairs:
            raise PeerViolation(
                f"FITNESS_RANGE has {msg.pairs_per_step} pairs per step, "
                f"the run has {self.config.pairs}"
            )
        end = msg.first_step + msg.step_count
        self.committed = max(self.committed, end)
        return end

    def _ignore_range(self, msg: messages.FitnessRange) -> list[Command]:
        self._note_range(msg)  # the snapshot comes first; the fitness is asked for after it
        return []

    def _on_snapshot_request(self, msg: messages.SnapshotRequest) -> list[Command]:
        # SPEC §8: a worker that has moved on sends its current state; it carries its step.
        return [ExportSnapshot(msg.step)]

    def _on_snapshot_chunk(self, chunk: messages.SnapshotChunk) -> list[Command]:
        d = self._download
        assert d is not None
        if d.step is None:
            if chunk.offset != 0:
                raise PeerViolation(f"first SNAPSHOT_CHUNK starts at offset {chunk.offset}")
            assert self.config is not None
            size = checkpoint_bytes(self.config)
            if chunk.total_bytes != size:  # never hold more than a snapshot of this run
                raise PeerViolation(
                    f"snapshot of {chunk.total_bytes} bytes; this run's checkpoints have {size}"
                )
            d.step, d.total = chunk.step, chunk.total_bytes
            d.progress = Progress(
                "snapshot download",
                d.total,
                "B",
                say=lambda p: log.info("downloading snapshot", step=d.step, **p.fields()),
                quiet_s=QUIET_S,
                clock=self.clock,
            )
        elif (chunk.step, chunk.total_bytes, chunk.offset) != (d.step, d.total, d.received):
            raise PeerViolation(
                f"SNAPSHOT_CHUNK (step {chunk.step}, total {chunk.total_bytes}, offset "
                f"{chunk.offset}) does not continue step {d.step}, total {d.total} at {d.received}"
            )
        d.parts.append(chunk.data)
        d.received += len(chunk.data)
        assert d.progress is not None
        if not chunk.is_last:
            d.progress.update(d.received)  # a long transfer is not a silent one
            return []
        d.progress.done = d.received
        d.progress.finish(say=False)  # "snapshot loaded" follows
        self._download, self.phase = None, Phase.IDLE
        blob = b"".join(d.parts)
        d.parts.clear()
        return [DecodeSnapshot(blob, d.step)]

    def _stray_chunk(self, chunk: messages.SnapshotChunk) -> list[Command]:
        log.info("unexpected snapshot chunk ignored", step=chunk.step, offset=chunk.offset)
        return []

    def _on_validate(self, msg: messages.Validate) -> list[Command]:
        """Score the replica if it is still at the asked step (SPEC §8); else no answer."""
        return [RunValidation(msg.step)] if msg.step == self.replica.step else []

    def _on_sample(self, msg: messages.Sample) -> list[Command]:
        """Write the sample if the replica is still at the asked step (SPEC §8); else no
        answer: the text of another step is not what was asked for."""
        return [RunSample(msg)] if msg.step == self.replica.step else []

    def _ignore(self, msg: Message) -> list[Command]:
        return []

    # --- errors ------------------------------------------------------------------------------

    def _on_error(self, error: messages.Error) -> Ended:
        """Why to reconnect after an ERROR from the coordinator; raises WorkerFatal."""
        code = error.code
        said = f" ({error.message})" if error.message else ""
        if code in FATAL_CODES:
            raise WorkerFatal(self._fatal_text(code, said), code)
        if code is ErrorCode.DIVERGED and error.message == RUN_REWOUND:
            # Steps were undone: WELCOME says how many the run holds now, and a replica
            # ahead of them is dropped there; one at or behind them is still the run's.
            log.warning("run rewound", reason="the coordinator undid steps; reconnecting")
            return Ended("the run rewound")
        if code is ErrorCode.DIVERGED:
            log.warning("replica dropped", reason=f"the coordinator says it diverged{said}")
            own = error.message != ADDRESS_OUTVOTED
            text = f"replica diverged from the run{said}; it starts again from step 0"
            return Ended(text, drop_replica=True, own=own)
        if code is ErrorCode.SHUTTING_DOWN:
            if error.message == RUN_COMPLETE:
                raise RunFinished(f"the run at {self.me.coordinator} {FINISHED}")
            return Ended("the coordinator is shutting down")
        return Ended(f"the coordinator ended the connection with {code.name}{said}")

    def _fatal_text(self, code: ErrorCode, said: str) -> str:
        me = self.me
        if code is ErrorCode.AUTH_FAILED:
            return (
                f"the coordinator at {me.coordinator} rejected this worker's token "
                f"(AUTH_FAILED): pass the coordinator's token with --token-file or EGGROLL_TOKEN"
            )
        if code is ErrorCode.DATA_MISMATCH:
            return (
                f"this worker's data (sha256 {me.data_digest.hex()[:16]}...) is not the run's "
                f"data (DATA_MISMATCH{said}): point --data-dir at the same files the run uses"
            )
        if code is ErrorCode.BAD_VERSION:
            return (
                f"the coordinator does not speak protocol version {PROTOCOL_VERSION} "
                f"(BAD_VERSION{said}): run the same eggroll-distributed version everywhere"
            )
        return (
            f"the coordinator says this worker cannot run its config (CONFIG_MISMATCH{said}): "
            f"run the same eggroll-distributed version everywhere"
        )

    def _fitness_batch(self) -> int:
        assert self.config is not None
        return max(
            1,
            min(
                FITNESS_STEPS_PER_REQUEST,
                messages.FitnessRange.max_steps_per_frame(self.config.pairs),
            ),
        )


Handler = Callable[[Session, Message], list[Command]]

# What each message does in each phase; a type missing from a row is a protocol violation.
# HEARTBEAT and ERROR are handled the same in every phase (see `receive`). The connection's
# state machine (protocol/connection.py) has already checked the handshake order.
_RUNNING: dict[MsgType, Handler] = {
    MsgType.JOB: Session._on_job,
    MsgType.WAIT: Session._on_wait,
    MsgType.STEP: Session._on_step,
    MsgType.FITNESS_RANGE: Session._on_fitness_range,
    MsgType.SNAPSHOT_REQUEST: Session._on_snapshot_request,
    MsgType.SNAPSHOT_CHUNK: Session._stray_chunk,
    MsgType.VALIDATE: Session._on_validate,
    MsgType.SAMPLE: Session._on_sample,
    MsgType.CLAIM: Session._on_claim,
}  # type: ignore[dict-item]
_TABLE: dict[Phase, dict[MsgType, Handler]] = {
    Phase.HELLO_SENT: {MsgType.CHALLENGE: Session._on_challenge},  # type: ignore[dict-item]
    Phase.AUTH_SENT: {MsgType.WELCOME: Session._on_welcome},  # type: ignore[dict-item]
    Phase.LOADING_SNAPSHOT: {
        MsgType.SNAPSHOT_CHUNK: Session._on_snapshot_chunk,
        MsgType.JOB: Session._skip_job,
        MsgType.WAIT: Session._ignore,
        MsgType.STEP: Session._note_step,
        MsgType.FITNESS_RANGE: Session._ignore_range,
        MsgType.SNAPSHOT_REQUEST: Session._on_snapshot_request,
        MsgType.VALIDATE: Session._ignore,
        MsgType.SAMPLE: Session._ignore,
        MsgType.CLAIM: Session._ignore,
    },  # type: ignore[dict-item]
    Phase.IDLE: _RUNNING,
    Phase.CATCHING_UP: _RUNNING,
    Phase.REQUESTED: _RUNNING,
    Phase.WAITING: _RUNNING,
    Phase.EVALUATING: {},  # the shell delivers nothing while a job runs
}
