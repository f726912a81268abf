"""The coordinator server: sessions, the step lifecycle, commits, snapshots, shutdown.

One asyncio task per worker connection feeds bytes into a sans-I/O `Connection` and acts on
the messages it yields (protocol/SPEC.md §8). All run state lives in this one object and is
only touched from the event loop, so no locks are needed. The order that makes a step
durable: every chunk in -> fitness log append + fsync -> STEP to every worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
import signal
import socket
import time
from collections import Counter
from dataclasses import dataclass, field

import structlog

from eggroll_dist.protocol import (
    PROTOCOL_VERSION,
    Auth,
    Challenge,
    Connection,
    ErrorCode,
    FitnessRange,
    FitnessRequest,
    Heartbeat,
    Hello,
    Job,
    JobRequest,
    Log,
    Message,
    ProtocolError,
    RemoteProtocolError,
    Result,
    Role,
    SnapshotChunk,
    SnapshotRequest,
    State,
    Step,
    Validate,
    Validation,
    Wait,
    Welcome,
    iter_snapshot_chunks,
    verify_mac,
)
from eggroll_dist.protocol import Error as ErrorMsg
from eggroll_dist.shared.replica import CheckpointError, decode_checkpoint

from .jobs import ChunkTimer, Outcome, StepJobs
from .metrics import Metrics
from .store import RunStore

log = structlog.get_logger("eggroll.coordinator")

CATCHUP_STEPS = 4096  # most steps per FITNESS_RANGE (also bounded by the frame size)
WAIT_MS = 1000  # how long an idle worker waits before asking again (unless pushed a job)
READ_BYTES = 1 << 16


@dataclass
class Options:
    host: str = "0.0.0.0"
    port: int = 12345
    token: bytes = b""
    max_steps: int | None = None
    snapshot_every: int = 100  # 0: only the final snapshot
    keep_snapshots: int = 3
    chunk_timeout_s: float | None = None  # None: adapted to observed chunk times
    final_snapshot_timeout_s: float = 120.0
    drain_timeout_s: float = 5.0
    idle_timeout_s: float = 60.0  # a connection silent this long is dropped


@dataclass(eq=False)
class Session:
    """One worker connection."""

    id: int
    peer: str
    writer: asyncio.StreamWriter
    conn: Connection = field(default_factory=lambda: Connection(Role.COORDINATOR))
    name: str = "?"
    nonce: bytes = b""
    data_digest: bytes = b""
    replica_step: int | None = None
    broadcast_from: int = 0  # every STEP from this step on has been sent to this worker
    waiting: bool = False  # told to WAIT; gets a JOB pushed when one frees up
    snapshot: bytearray | None = None  # a snapshot being received from this worker
    job_started: dict[int, float] = field(default_factory=dict)  # chunk -> lease time
    counted_in: Counter = field(default_factory=Counter)  # bytes received, per type, counted


class Coordinator:
    def __init__(
        self,
        store: RunStore,
        options: Options,
        metrics: Metrics | None = None,
        clock=time.monotonic,
    ) -> None:
        self.store = store
        self.opt = options
        self.clock = clock
        self.cfg = store.config
        self.config_bytes = self.cfg.canonical_bytes()
        self.timer = ChunkTimer(fixed_s=options.chunk_timeout_s)
        self.sessions: dict[int, Session] = {}
        self._ids = itertools.count(1)
        self.jobs = self._open_step(store.steps)
        self.snapshot_wanted: int | None = None  # step whose state should be snapshotted
        self.snapshot_source: Session | None = None
        self.validation_wanted: int | None = None  # step whose held-out score is wanted
        self.stopping = asyncio.Event()
        self.finished = False  # --max-steps reached
        self.metrics = metrics or Metrics()
        self.metrics.step.set(store.steps)
        self.metrics.run_info.info(
            {"run_id": store.run_id.hex(), "config_digest": self.cfg.digest().hex()}
        )
        self.net_in = self.net_out = 0
        self._net_marks = (0, 0)  # network byte totals at the last commit
        self._last_changed = 0
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task] = set()
        if self.opt.max_steps is not None and store.steps >= self.opt.max_steps:
            self._finish()

    # ------------------------------------------------------------------ lifecycle

    @property
    def step(self) -> int:
        """The open step = steps committed."""
        return self.store.steps

    async def run(self) -> None:
        """Serve until stopped by a signal or by reaching --max-steps, then shut down."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.request_stop)
        self._server = await asyncio.start_server(
            self._handle, self.opt.host, self.opt.port, reuse_address=True
        )
        port = self._server.sockets[0].getsockname()[1]
        log.info(
            "listening",
            host=self.opt.host,
            port=port,
            step=self.step,
            run_id=self.store.run_id.hex(),
            config_digest=self.cfg.digest().hex()[:16],
            save_dir=str(self.store.path),
        )
        deadlines = asyncio.create_task(self._watch_deadlines())
        try:
            await self.stopping.wait()
        finally:
            deadlines.cancel()
            await self._shutdown()

    def request_stop(self) -> None:
        if not self.stopping.is_set():
            self.stopping.set()
            log.info("stopping", step=self.step)

    async def _shutdown(self) -> None:
        """Stop accepting, get a last snapshot if cheap, tell workers, drain, cancel."""
        assert self._server is not None
        self._server.close()
        if not self.finished and self.store.latest_snapshot != self.step:
            await self._final_snapshot(timeout_s=10.0)
        message = "run complete" if self.finished else "coordinator shutting down"
        for s in list(self.sessions.values()):
            with contextlib.suppress(Exception):
                s.writer.write(s.conn.send_error(ErrorCode.SHUTTING_DOWN, message))
                s.writer.close()
        if self._handlers:
            _, pending = await asyncio.wait(self._handlers, timeout=self.opt.drain_timeout_s)
            for task in pending:
                task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._server.wait_closed(), self.opt.drain_timeout_s)
        log.info("stopped", steps=self.step, latest_snapshot=self.store.latest_snapshot)

    async def _final_snapshot(self, timeout_s: float) -> None:
        """Ask a worker at the current step for its state and wait a bounded time for it."""
        if self.step == 0:
            return  # the initial state is a pure function of the config
        self.snapshot_wanted = self.step
        if self.snapshot_source is None and not any(
            s.replica_step == self.step and self._maybe_request_snapshot(s)
            for s in self.sessions.values()
        ):
            log.info("no worker at the current step for a final snapshot", step=self.step)
            return
        deadline = self.clock() + timeout_s
        while self.store.latest_snapshot != self.step and self.clock() < deadline:
            await asyncio.sleep(0.05)
        if self.store.latest_snapshot != self.step:
            log.warning(
                "no final snapshot",
                step=self.step,
                hint="nothing is lost: the fitness log holds every step",
            )

    def _finish(self) -> None:
        """--max-steps reached: stop leasing, get the final snapshot, then stop."""
        self.finished = True
        if self.store.latest_snapshot == self.step:
            self.stopping.set()
        else:
            self.snapshot_wanted = self.step
            asyncio.get_running_loop().call_later(
                self.opt.final_snapshot_timeout_s, self.request_stop
            )

    # --------------------------------------------------------------- connections

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = writer.get_extra_info("peername")
        session = Session(next(self._ids), f"{peer[0]}:{peer[1]}" if peer else "?", writer)
        self.sessions[session.id] = session
        try:
            while True:
                try:
                    data = await asyncio.wait_for(reader.read(READ_BYTES), self.opt.idle_timeout_s)
                except TimeoutError:  # workers heartbeat every few seconds: this one is gone
                    log.warning(
                        "worker silent, dropping it",
                        worker=session.name,
                        seconds=self.opt.idle_timeout_s,
                    )
                    break
                if not data:
                    break
                self.net_in += len(data)
                session.conn.receive_data(data)
                while (msg := session.conn.next_event()) is not None:
                    self._count_in(session)
                    await self._dispatch(session, msg)
                    if session.conn.state is State.CLOSED:
                        break
                if session.conn.state is State.CLOSED:
                    break
                await writer.drain()
        except ProtocolError as exc:
            self.metrics.protocol_errors.labels(exc.error_code.name).inc()
            log.warning(
                "protocol error",
                worker=session.name,
                peer=session.peer,
                code=exc.error_code.name,
                error=exc.message,
            )
            with contextlib.suppress(Exception):
                writer.write(session.conn.error_frame(exc))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except Exception:  # a bug must cost one connection, never the run
            log.exception("session failed", worker=session.name, peer=session.peer)
            with contextlib.suppress(Exception):
                writer.write(session.conn.send_error(ErrorCode.INTERNAL, "coordinator error"))
        finally:
            self._drop(session)
            with contextlib.suppress(Exception):
                writer.close()
                await writer.wait_closed()
            self._handlers.discard(task)

    def _drop(self, session: Session) -> None:
        if self.sessions.pop(session.id, None) is None:
            return
        if session.conn.state is State.READY or session.replica_step is not None:
            log.info("worker left", worker=session.name, workers=self._ready_count())
            self.metrics.worker_left(session.name)
        self.metrics.workers.set(self._ready_count())
        requeued = self.jobs.release_worker(session.id)
        if requeued:
            self.metrics.chunks_requeued.labels("disconnect").inc(len(requeued))
            log.info("chunks requeued", reason="disconnect", chunks=requeued, step=self.step)
            self._push_jobs()
        if self.snapshot_source is session:
            self.snapshot_source = None

    def _ready_count(self) -> int:
        return sum(1 for s in self.sessions.values() if s.conn.state is State.READY)

    def _send(self, session: Session, msg: Message) -> None:
        data = session.conn.send(msg)
        session.writer.write(data)
        self.net_out += len(data)
        self.metrics.network_bytes.labels("out", msg.TYPE.name).inc(len(data))

    def _count_in(self, session: Session) -> None:
        """Add the bytes of newly decoded messages to the per-type network counter."""
        for msg_type, total in session.conn.bytes_received.items():
            new = total - session.counted_in[msg_type]
            if new:
                self.metrics.network_bytes.labels("in", msg_type.name).inc(new)
                session.counted_in[msg_type] = total

    def _fail(self, session: Session, code: ErrorCode, message: str) -> None:
        """Send ERROR and close (the handler loop sees the CLOSED state and ends)."""
        self.metrics.protocol_errors.labels(code.name).inc()
        log.warning("rejecting worker", worker=session.name, code=code.name, reason=message)
        data = session.conn.send_error(code, message)
        self.net_out += len(data)
        self.metrics.network_bytes.labels("out", "ERROR").inc(len(data))
        session.writer.write(data)

    # ------------------------------------------------------------------ messages

    async def _dispatch(self, s: Session, msg: Message) -> None:
        match msg:
            case Hello():
                self._on_hello(s, msg)
            case Auth():
                self._on_auth(s, msg)
            case JobRequest():
                self._on_job_request(s, msg)
            case Result():
                self._on_result(s, msg)
            case FitnessRequest():
                self._send_fitness(s, msg.first_step, msg.max_steps)
            case SnapshotRequest():
                await self._serve_snapshot(s)
            case SnapshotChunk():
                await self._on_snapshot_chunk(s, msg)
            case Heartbeat():
                pass
            case Validation():
                self._on_validation(s, msg)
            case Log():
                log.info("worker log", worker=s.name, level=int(msg.level), text=msg.text)
            case ErrorMsg():
                log.warning("worker error", worker=s.name, code=int(msg.code), text=msg.message)
            case _:
                raise RemoteProtocolError(ErrorCode.ILLEGAL_STATE, f"unexpected {msg.TYPE.name}")

    def _on_hello(self, s: Session, msg: Hello) -> None:
        s.name, s.data_digest = msg.worker_name, msg.data_digest
        if msg.protocol_version != PROTOCOL_VERSION:
            self._fail(
                s,
                ErrorCode.BAD_VERSION,
                f"coordinator speaks protocol "
                f"{PROTOCOL_VERSION}, worker {msg.protocol_version}: upgrade the older one",
            )
            return
        s.nonce = secrets.token_bytes(32)
        self._send(s, Challenge(s.nonce))

    def _on_auth(self, s: Session, msg: Auth) -> None:
        if not verify_mac(self.opt.token, s.nonce, msg.mac):
            self._fail(s, ErrorCode.AUTH_FAILED, "wrong token: give the coordinator's --token")
            return
        run_digest = self.store.data_digest
        if run_digest is None:
            self.store.set_data_digest(s.data_digest)
            log.info("data digest adopted", digest=s.data_digest.hex()[:16], worker=s.name)
        elif run_digest != s.data_digest:
            self._fail(
                s,
                ErrorCode.DATA_MISMATCH,
                f"worker data digest {s.data_digest.hex()[:16]} differs from the run's "
                f"{run_digest.hex()[:16]}: give the worker the run's data directory",
            )
            return
        snapshot = self.store.latest_snapshot
        self._send(
            s,
            Welcome(
                self.store.run_id,
                self.config_bytes,
                self.step,
                -1 if snapshot is None else snapshot,
                self.cfg.pairs,
            ),
        )
        s.broadcast_from = self.step
        self.metrics.workers.set(self._ready_count())
        log.info("worker joined", worker=s.name, peer=s.peer, workers=self._ready_count())

    def _digest_ok(self, s: Session, step: int, digest: int) -> bool:
        agreed = self.store.digests.get(step)
        if agreed is None:
            self.store.record_digest(step, digest)
            return True
        if agreed == digest:
            return True
        self.metrics.digest_mismatches.inc()
        self._fail(
            s,
            ErrorCode.DIVERGED,
            f"replica digest at step {step} is {digest:016x}, "
            f"the run agreed on {agreed:016x}: resync",
        )
        return False

    def _on_job_request(self, s: Session, msg: JobRequest) -> None:
        step = msg.replica_step
        if step > self.step:
            self._fail(
                s,
                ErrorCode.DIVERGED,
                f"replica is at step {step}, the run has committed {self.step}",
            )
            return
        if not self._digest_ok(s, step, msg.replica_digest):
            return
        s.replica_step = step
        if step < self.step:
            if step >= s.broadcast_from:
                return  # the STEPs it lacks are on their way; it asks again after them
            self._send_fitness(s, step, CATCHUP_STEPS)
            return
        if step == self.step:
            self._last_changed = msg.weights_changed
            self.metrics.weights_changed.set(msg.weights_changed)
        self._maybe_request_snapshot(s)
        self._maybe_request_validation(s)
        if self.finished:
            self._send(s, Wait(WAIT_MS))
            return
        self._lease_to(s)

    def _lease_to(self, s: Session) -> bool:
        chunk = self.jobs.lease(s.id)
        if chunk is None:
            s.waiting = True
            self._send(s, Wait(WAIT_MS))
            return False
        s.waiting = False
        first, count = self.jobs.member_range(chunk)
        self.metrics.chunks_leased.inc()
        s.job_started[chunk] = self.clock()
        self._send(s, Job(self.step, chunk, first, count))
        return True

    def _push_jobs(self) -> None:
        """Re-queued chunks go straight to idle workers that are at the open step."""
        for s in list(self.sessions.values()):
            if not self.jobs.queue:
                break
            if s.waiting and s.replica_step == self.step and s.conn.state is State.READY:
                self._lease_to(s)

    def _on_result(self, s: Session, msg: Result) -> None:
        started = s.job_started.pop(msg.chunk, None)
        if started is not None and msg.step == self.step:
            seconds = max(self.clock() - started, 1e-9)
            tokens = self.cfg.es.chunk_size * self.cfg.es.seq_len
            self.metrics.worker_chunk_seconds.labels(s.name).set(seconds)
            self.metrics.worker_tokens_per_second.labels(s.name).set(tokens / seconds)
            self.metrics.worker_member_tokens.labels(s.name).inc(tokens)
        if msg.step == self.step and not self._digest_ok(s, msg.step, msg.replica_digest):
            self.metrics.results_dropped.labels("diverged").inc()
            return
        outcome = self.jobs.complete_chunk(
            s.id, msg.step, msg.chunk, msg.fitness, msg.pair_count, msg.loss_sum
        )
        if outcome is not Outcome.ACCEPTED:
            self.metrics.results_dropped.labels(outcome.value).inc()
            level = log.error if outcome is Outcome.MISMATCH else log.info
            level(
                "result dropped",
                reason=outcome.value,
                worker=s.name,
                step=msg.step,
                chunk=msg.chunk,
            )
            return
        self.metrics.chunks_completed.inc()
        if self.jobs.complete:
            self._commit()

    def _commit(self) -> None:
        """Make the open step durable, then broadcast it and open the next one."""
        step, jobs = self.step, self.jobs
        packed = jobs.step_fitness()
        self.store.fitness_log.append(step, packed)  # fsync'd: committed from here on
        message = Step(step, self.cfg.pairs, packed)
        for s in self.sessions.values():
            if s.conn.state is State.READY:
                s.waiting = False
                self._send(s, message)
        self._log_step(step, jobs)
        self.jobs = self._open_step(self.step)
        for s in self.sessions.values():
            s.job_started.clear()
        if self.opt.snapshot_every and self.step % self.opt.snapshot_every == 0:
            self.snapshot_wanted = self.step
        every = self.cfg.validation.every_steps
        if every and self.step % every == 0:
            self.validation_wanted = self.step
        if self.opt.max_steps is not None and self.step >= self.opt.max_steps:
            self._finish()

    def _open_step(self, step: int) -> StepJobs:
        return StepJobs(step, self.cfg.chunks, self.cfg.es.chunk_size, self.clock, self.timer)

    def _log_step(self, step: int, jobs: StepJobs) -> None:
        net_in0, net_out0 = self._net_marks
        now = self.clock()
        # From the step's first lease: time spent waiting for workers is not step time.
        seconds = max(now - (jobs.first_lease or jobs.opened), 1e-9)
        tokens = self.cfg.es.population * self.cfg.es.seq_len
        loss_bits = jobs.loss_sum / 16 / tokens
        m = self.metrics
        m.step.set(step + 1)
        m.steps_committed.inc()
        m.step_duration.observe(seconds)
        m.train_loss.set(loss_bits)
        m.member_tokens.inc(tokens)
        m.last_commit.set(time.time())
        log.info(
            "step",
            step=step + 1,
            member_tokens=tokens,
            loss_bits=round(loss_bits, 4),
            step_s=round(seconds, 3),
            changed=self._last_changed,
            member_tok_s=round(tokens / seconds),
            workers=self._ready_count(),
            net_in=self.net_in - net_in0,
            net_out=self.net_out - net_out0,
            requeued=sum(jobs.requeued.values()),
        )
        self._net_marks = (self.net_in, self.net_out)

    def _send_fitness(self, s: Session, first: int, max_steps: int) -> None:
        limit = min(max_steps, CATCHUP_STEPS, FitnessRange.max_steps_per_frame(self.cfg.pairs))
        count = max(0, min(limit, self.step - first))
        packed = self.store.fitness_log.read(first, count) if count else []
        self.metrics.catchup_steps.inc(count)
        self._send(s, FitnessRange.from_steps(first, self.cfg.pairs, packed))

    # ----------------------------------------------------------------- snapshots

    def _maybe_request_snapshot(self, s: Session) -> bool:
        wanted = self.snapshot_wanted
        if wanted is None or self.snapshot_source is not None or s.replica_step != wanted:
            return False
        if self.store.digests.get(wanted) is None:
            return False
        self.snapshot_source = s
        s.snapshot = bytearray()
        self._send(s, SnapshotRequest(wanted))
        return True

    async def _serve_snapshot(self, s: Session) -> None:
        step = self.store.latest_snapshot
        if step is None:
            self._fail(s, ErrorCode.ILLEGAL_STATE, "the run has no snapshot yet")
            return
        try:
            blob = await asyncio.to_thread(self.store.snapshot_path(step).read_bytes)
        except OSError:  # pruned just now by a newer snapshot: the worker asks again
            self._fail(s, ErrorCode.INTERNAL, f"snapshot {step} is no longer available; retry")
            return
        for chunk in iter_snapshot_chunks(step, blob):
            self._send(s, chunk)
            await s.writer.drain()
        self.metrics.snapshot_transfers.labels("out").inc()
        log.info("snapshot sent", worker=s.name, step=step, bytes=len(blob))

    async def _on_snapshot_chunk(self, s: Session, msg: SnapshotChunk) -> None:
        if s.snapshot is None or msg.offset != len(s.snapshot):
            raise RemoteProtocolError(ErrorCode.ILLEGAL_STATE, "unexpected snapshot chunk")
        s.snapshot += msg.data
        if len(s.snapshot) < msg.total_bytes:
            return
        blob, s.snapshot = bytes(s.snapshot), None
        try:
            await self._store_snapshot(s, blob)
        finally:  # only now may another worker be asked: one snapshot at a time
            if self.snapshot_source is s:
                self.snapshot_source = None

    async def _store_snapshot(self, s: Session, blob: bytes) -> None:
        try:
            state = await asyncio.to_thread(decode_checkpoint, blob)
        except CheckpointError as exc:
            log.warning("snapshot rejected", worker=s.name, error=str(exc))
            return
        agreed = self.store.digests.get(state.step)
        if (
            state.config.digest() != self.cfg.digest()
            or state.step > self.step
            or (agreed is not None and agreed != state.digest())
        ):
            log.warning(
                "snapshot rejected",
                worker=s.name,
                step=state.step,
                reason="config, step or digest does not match the run",
            )
            return
        await asyncio.to_thread(self.store.save_snapshot, state.step, blob, self.opt.keep_snapshots)
        self.metrics.snapshot_transfers.labels("in").inc()
        self.metrics.last_snapshot.set(time.time())
        log.info(
            "snapshot stored",
            step=state.step,
            worker=s.name,
            bytes=len(blob),
            digest=state.digest_hex(),
        )
        if self.snapshot_wanted is not None and state.step >= self.snapshot_wanted:
            self.snapshot_wanted = None
        if self.finished and state.step == self.step:
            self.stopping.set()

    # ---------------------------------------------------------------- validation

    def _maybe_request_validation(self, s: Session) -> None:
        """Ask one worker at the wanted step for its held-out score (SPEC §8)."""
        if self.validation_wanted is not None and s.replica_step == self.validation_wanted:
            self._send(s, Validate(self.validation_wanted))
            self.validation_wanted = None

    def _on_validation(self, s: Session, msg: Validation) -> None:
        if msg.step > self.step or self.store.digests.get(msg.step) is None:
            return
        self.metrics.valid_bits.set(msg.bits_per_token)
        self.metrics.valid_step.set(msg.step)
        log.info(
            "validation",
            step=msg.step,
            valid_bits=round(msg.bits_per_token, 4),
            tokens=msg.tokens,
            worker=s.name,
        )

    # ------------------------------------------------------------------ deadlines

    async def _watch_deadlines(self) -> None:
        while True:
            deadline = self.jobs.next_deadline()
            delay = 1.0 if deadline is None else min(1.0, max(0.0, deadline - self.clock()))
            await asyncio.sleep(delay)
            requeued = self.jobs.expire()
            if requeued:
                self.metrics.chunks_requeued.labels("deadline").inc(len(requeued))
                log.info("chunks requeued", reason="deadline", chunks=requeued, step=self.step)
                self._push_jobs()
