"""The worker's side of a run: connect, handshake, catch up, evaluate jobs, reconnect.

The session flow is protocol/SPEC.md §8. Per connection, one task reads frames into a
queue and one task handles them in order, so the replica is touched by one backend call
at a time. Backend calls (evaluate a chunk, apply a step, encode a snapshot) run on one
daemon thread: heartbeats and incoming frames keep flowing while a long chunk runs, calls
stay in order on one device context, and a stopping worker need not wait for the chunk.

The replica (the backend and its state) outlives connections: it is kept across
reconnects while the coordinator's run id stays the same.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import queue
import random
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import structlog

from eggroll_dist.protocol import (
    LATEST_SNAPSHOT,
    PROTOCOL_VERSION,
    Auth,
    Challenge,
    Connection,
    Error,
    ErrorCode,
    FitnessRange,
    FitnessRequest,
    Heartbeat,
    Hello,
    Job,
    JobRequest,
    Message,
    MsgType,
    RemoteProtocolError,
    Result,
    Role,
    SnapshotChunk,
    SnapshotRequest,
    Step,
    Validate,
    Validation,
    Wait,
    Welcome,
    auth_mac,
    clip_utf8,
    iter_snapshot_chunks,
    unpack_ternary,
)
from eggroll_dist.shared.config import ConfigError, RunConfig, from_canonical_bytes
from eggroll_dist.shared.data import Dataset
from eggroll_dist.shared.replica import (
    CheckpointError,
    ReplicaState,
    decode_checkpoint,
    encode_checkpoint,
)
from eggroll_dist.worker.backend import Backend, BackendFactory, get_backend

__all__ = [
    "DEFAULT_PORT",
    "FATAL_CODES",
    "MAX_WORKER_NAME_BYTES",
    "WorkerClient",
    "WorkerFatal",
    "default_worker_name",
]

log = structlog.get_logger("eggroll.worker")

DEFAULT_PORT = 12345
# SPEC §8: these mean the worker can never join this run as it is; reconnecting won't help.
FATAL_CODES = frozenset(
    {
        ErrorCode.BAD_VERSION,
        ErrorCode.AUTH_FAILED,
        ErrorCode.DATA_MISMATCH,
        ErrorCode.CONFIG_MISMATCH,
    }
)
INITIAL_RETRY_S = 0.2
# A connection that stayed up this long resets the backoff; one dropped sooner (a coordinator
# that accepts and then fails at once) keeps growing it.
STABLE_CONNECTION_S = 10.0
MAX_WORKER_NAME_BYTES = 128
# Steps asked for per FITNESS_REQUEST: one progress line per batch while catching up.
FITNESS_STEPS_PER_REQUEST = 256
_READ_BYTES = 1 << 16
_CLOSE_TIMEOUT_S = 2.0

T = TypeVar("T")


async def _cancel_until_done(task: asyncio.Task, timeout_s: float = 10.0) -> None:
    """Cancel a task and wait for it to end. On Python 3.11, asyncio.wait_for can swallow a
    cancellation that races with its inner future completing (CPython gh-86296), so one
    cancel() is not enough: cancel again until the task is done (bounded)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not task.done() and loop.time() < deadline:
        task.cancel()
        await asyncio.wait({task}, timeout=0.1)
    if task.done() and not task.cancelled():
        task.exception()  # retrieved, so asyncio does not warn about it
    elif not task.done():
        log.warning("a session task did not stop", seconds=timeout_s)


class WorkerFatal(Exception):
    """The worker cannot take part in this run (SPEC §8 permanent errors); str() is one line
    that says what to do. `code` is the ERROR code behind it, if any."""

    def __init__(self, message: str, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        self.code = code


def default_worker_name() -> str:
    return clip_utf8(f"{socket.gethostname()}-{os.getpid()}", MAX_WORKER_NAME_BYTES)


class _BackendThread(concurrent.futures.Executor):
    """One daemon thread for every backend call.

    One thread keeps calls in order and on one device context; a daemon thread lets the
    process exit on SIGTERM without waiting for a chunk that nobody will read.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="eggroll-backend", daemon=True)
        self._thread.start()

    def submit(
        self, fn: Callable[..., T], /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[T]:
        if self._closed:
            raise RuntimeError("the backend thread is shut down")
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._jobs.put((future, fn, args, kwargs))
        return future

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args, kwargs = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # handed to the awaiting coroutine
                future.set_exception(exc)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._closed = True
        self._jobs.put(None)
        if wait:
            self._thread.join()


class _Ended(Exception):
    """This connection is over; reconnect. The message (one line) says why."""


class _PeerViolation(Exception):
    """The coordinator sent well-formed frames that break the session flow of SPEC §8."""


@dataclass
class _Download:
    """A snapshot arriving as SNAPSHOT_CHUNKs (offsets ascending, total fixed)."""

    started: float
    step: int | None = None
    total: int | None = None
    received: int = 0
    parts: list[bytes] = field(default_factory=list)


class WorkerClient:
    """Connects to a coordinator and serves it until `stop()`, reconnecting on its own.

    `run()` returns after `stop()` and raises WorkerFatal for the permanent errors of
    SPEC §8 (and for a run config this worker cannot run). Everything else (refused or
    lost connections, protocol errors, SHUTTING_DOWN, DIVERGED) leads to a reconnect
    with full-jitter exponential backoff: 0.2 s doubling up to `max_retry_s`.
    """

    def __init__(
        self,
        host: str,
        port: int,
        dataset: Dataset,
        *,
        backend: BackendFactory | None = None,
        name: str | None = None,
        token: bytes | str = b"",
        max_retry_s: float = 30.0,
        heartbeat_s: float = 5.0,
        reply_timeout_s: float = 60.0,
        connect_timeout_s: float = 10.0,
    ) -> None:
        self.host = host
        self.port = port
        self.dataset = dataset
        self.backend_factory = backend or get_backend("numpy")
        self.name = default_worker_name() if name is None else name
        if len(self.name.encode("utf-8")) > MAX_WORKER_NAME_BYTES:
            raise ValueError(
                f"worker name is {len(self.name.encode('utf-8'))} bytes of UTF-8; "
                f"the limit is {MAX_WORKER_NAME_BYTES}"
            )
        self.token = token.encode("utf-8") if isinstance(token, str) else bytes(token)
        self.max_retry_s = max_retry_s
        self.heartbeat_s = heartbeat_s
        self.reply_timeout_s = reply_timeout_s
        self.connect_timeout_s = connect_timeout_s
        # The replica, kept across reconnects while the run id stays the same.
        self.backend: Backend | None = None
        self.run_id: bytes | None = None
        self.replica_digest = 0  # digest of backend.state, refreshed after every change
        self.weights_changed = 0  # by the update that produced the replica; 0 when unknown
        self.connections = 0  # handshakes completed
        self._stop = asyncio.Event()
        self._rng = random.Random()  # backoff jitter only; nothing a replica depends on
        self._executor: _BackendThread | None = None

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def stop(self) -> None:
        """Ask `run()` to close the connection and return (call from the event loop)."""
        self._stop.set()

    async def run(self) -> None:
        """Serve the coordinator until `stop()`; raises WorkerFatal on a permanent error."""
        self._executor = _BackendThread()
        session: asyncio.Task[tuple[str, float]] | None = None
        attempt = 0
        try:
            while not self._stop.is_set():
                session = asyncio.create_task(self._connect_and_serve())
                stopper = asyncio.create_task(self._stop.wait())
                await asyncio.wait({session, stopper}, return_when=asyncio.FIRST_COMPLETED)
                stopper.cancel()
                if not session.done():
                    break  # stopped; the finally below closes the connection
                reason, ready_s = session.result()  # WorkerFatal propagates from here
                session = None
                if ready_s >= STABLE_CONNECTION_S:
                    attempt = 0  # it worked for a while: start the backoff afresh
                delay = self._rng.uniform(
                    0.0, min(self.max_retry_s, INITIAL_RETRY_S * 2 ** min(attempt, 32))
                )
                attempt += 1
                log.warning("reconnecting", reason=reason, attempt=attempt, in_s=round(delay, 2))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), delay)
        finally:
            if session is not None:
                await _cancel_until_done(session)
            self._executor.shutdown(wait=False)
            self._executor = None

    async def _connect_and_serve(self) -> tuple[str, float]:
        """One connection; returns why it ended and how long it was up after WELCOME."""
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port), self.connect_timeout_s
            )
        except (OSError, TimeoutError) as exc:
            return f"cannot connect to {self.host}:{self.port}: {_describe(exc)}", 0.0
        sock = writer.get_extra_info("socket")
        if sock is not None:
            # Small request/reply frames: no Nagle delay. Keepalive finds a dead peer.
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        session = _Session(self, reader, writer)
        reason = await session.run()
        ready_s = 0.0 if session.ready_at is None else time.monotonic() - session.ready_at
        return reason, ready_s

    # --- the replica -----------------------------------------------------------------

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a backend call on the backend thread."""
        assert self._executor is not None, "backend calls happen inside run()"
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _new_replica(self, state: ReplicaState) -> Backend:
        backend = await self._call(self.backend_factory.build, self.dataset, state)
        self.backend = backend
        self.replica_digest = await self._call(backend.digest)
        self.weights_changed = 0
        return backend

    def _drop_replica(self) -> None:
        self.backend = None
        self.run_id = None


class _Session:
    """One connection to the coordinator, from HELLO until it closes."""

    def __init__(
        self, client: WorkerClient, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.client = client
        self.reader = reader
        self.writer = writer
        self.conn = Connection(Role.WORKER)
        self.inbox: asyncio.Queue[Message | _Ended] = asyncio.Queue()
        self.ready_at: float | None = None  # when WELCOME arrived
        self.last_sent = time.monotonic()
        self.config: RunConfig | None = None
        self.committed = 0  # steps the coordinator has committed, as far as we know
        self.newest_step_frame = 0  # 1 + newest STEP read off the socket (maybe not handled yet)
        # The request whose answer is due (JobRequest or FitnessRequest), or None. Only the
        # newest request counts: one overtaken by a STEP may get no answer (SPEC §8).
        self.awaiting: type[Message] | None = None
        self.retry_at: float | None = None  # after WAIT: when to ask again
        self.download: _Download | None = None
        self.catchup: tuple[int, float] | None = None  # (from step, start time) while behind
        self._reader_task: asyncio.Task[None] | None = None

    @property
    def backend(self) -> Backend:
        assert self.client.backend is not None
        return self.client.backend

    async def run(self) -> str:
        """Serve until the connection ends; returns why. Raises WorkerFatal."""
        self._reader_task = asyncio.create_task(self._read_loop())
        heartbeat: asyncio.Task[None] | None = None
        try:
            welcome = await self._handshake()
            self.ready_at = time.monotonic()
            self.client.connections += 1
            heartbeat = asyncio.create_task(self._heartbeat_loop())
            await self._serve(welcome)
            raise AssertionError("unreachable: _serve only ends by raising")
        except _Ended as exc:
            return str(exc)
        except _PeerViolation as exc:
            self._send_error(ErrorCode.MALFORMED, str(exc))
            return f"protocol error from the coordinator: {exc}"
        except OSError as exc:
            # A write failed: the reader may hold the coordinator's ERROR saying why.
            return await self._why_closed(exc)
        finally:
            for task in (heartbeat, self._reader_task):
                if task is not None:
                    task.cancel()
            self.writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.writer.wait_closed(), _CLOSE_TIMEOUT_S)

    # --- I/O ---------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        try:
            while True:
                data = await self.reader.read(_READ_BYTES)
                if not data:
                    self.inbox.put_nowait(_Ended("the coordinator closed the connection"))
                    return
                self.conn.receive_data(data)
                while (msg := self.conn.next_event()) is not None:
                    if isinstance(msg, Step):
                        # Lets a running evaluation learn that its step is already done.
                        self.newest_step_frame = max(self.newest_step_frame, msg.step + 1)
                    self.inbox.put_nowait(msg)
                    if isinstance(msg, Error):
                        return
        except RemoteProtocolError as exc:
            # SPEC §5: tell the peer why before the connection ends.
            with contextlib.suppress(OSError, RuntimeError):
                self.writer.write(self.conn.error_frame(exc))
            self.inbox.put_nowait(_Ended(f"protocol error from the coordinator: {exc}"))
        except OSError as exc:
            self.inbox.put_nowait(_Ended(f"connection lost: {_describe(exc)}"))

    async def _send(self, msg: Message) -> None:
        if self.conn.closed:
            raise ConnectionResetError("the connection is closed")
        self.writer.write(self.conn.send(msg))
        self.last_sent = time.monotonic()
        await self.writer.drain()

    def _send_error(self, code: ErrorCode, message: str) -> None:
        with contextlib.suppress(OSError, RuntimeError):
            self.writer.write(self.conn.send_error(code, message))

    async def _heartbeat_loop(self) -> None:
        period = self.client.heartbeat_s
        while True:
            await asyncio.sleep(max(0.05, self.last_sent + period - time.monotonic()))
            if time.monotonic() - self.last_sent < period:
                continue
            if not self.conn.can_send(MsgType.HEARTBEAT):
                return
            try:
                await self._send(Heartbeat(int(time.time() * 1000)))
            except OSError:
                return  # the reader reports the lost connection

    def _unwrap(self, item: Message | _Ended) -> Message:
        if isinstance(item, _Ended):
            raise item
        if isinstance(item, Error):
            raise _Ended(self._on_error(item))
        return item

    async def _receive(self, timeout: float) -> Message:
        try:
            item = await asyncio.wait_for(self.inbox.get(), timeout)
        except TimeoutError:
            raise _Ended(f"no answer from the coordinator for {timeout:g} s") from None
        return self._unwrap(item)

    async def _why_closed(self, exc: OSError) -> str:
        if self._reader_task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._reader_task), _CLOSE_TIMEOUT_S)
        while not self.inbox.empty():
            item = self.inbox.get_nowait()
            if isinstance(item, _Ended):
                return str(item)
            if isinstance(item, Error):
                return self._on_error(item)
        return f"connection lost: {_describe(exc)}"

    def _on_error(self, error: Error) -> str:
        """Reason to reconnect for an ERROR from the coordinator; raises WorkerFatal."""
        code = error.code
        said = f" ({error.message})" if error.message else ""
        if code in FATAL_CODES:
            raise WorkerFatal(self._fatal_text(code, said), code)
        if code is ErrorCode.DIVERGED:
            self.client._drop_replica()
            log.warning("replica dropped", reason=f"the coordinator says it diverged{said}")
            return f"replica diverged from the run{said}; it starts again from step 0"
        if code is ErrorCode.SHUTTING_DOWN:
            return "the coordinator is shutting down"
        return f"the coordinator ended the connection with {code.name}{said}"

    def _fatal_text(self, code: ErrorCode, said: str) -> str:
        c = self.client
        if code is ErrorCode.AUTH_FAILED:
            return (
                f"the coordinator at {c.host}:{c.port} rejected this worker's token "
                f"(AUTH_FAILED): pass the coordinator's token with --token or EGGROLL_TOKEN"
            )
        if code is ErrorCode.DATA_MISMATCH:
            return (
                f"this worker's data (sha256 {c.dataset.digest.hex()[:16]}...) is not the run's "
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

    # --- handshake ---------------------------------------------------------------------

    async def _handshake(self) -> Welcome:
        c = self.client
        factory = c.backend_factory
        await self._send(
            Hello(PROTOCOL_VERSION, c.name, factory.name, factory.device, c.dataset.digest)
        )
        challenge = await self._expect(Challenge)
        await self._send(Auth(auth_mac(c.token, challenge.nonce)))
        return await self._expect(Welcome)

    async def _expect(self, cls: type[T]) -> T:
        # The state machine lets only the expected message, HEARTBEAT or ERROR through.
        while True:
            msg = await self._receive(self.client.reply_timeout_s)
            if isinstance(msg, cls):
                return msg

    def _refuse(self, message: str) -> WorkerFatal:
        """Tell the coordinator this worker cannot run the run's config, and give up."""
        self._send_error(ErrorCode.CONFIG_MISMATCH, message)
        return WorkerFatal(message, ErrorCode.CONFIG_MISMATCH)

    async def _adopt(self, welcome: Welcome) -> None:
        """Check the run config and keep, or start afresh, the replica (SPEC §8 catch-up)."""
        c = self.client
        try:
            config = from_canonical_bytes(welcome.config_bytes)
        except ConfigError as exc:
            raise self._refuse(
                f"the run config from {c.host}:{c.port} is not valid for this worker version: {exc}"
            ) from None
        if config.pairs != welcome.pairs_per_step:
            raise self._refuse(
                f"WELCOME says {welcome.pairs_per_step} pairs per step, the run config has "
                f"{config.pairs}"
            )
        vocab = c.dataset.meta.vocab_size
        if vocab != config.model.vocab_size:
            raise self._refuse(
                f"the run's model has a vocabulary of {config.model.vocab_size}, this "
                f"worker's data has {vocab}: point --data-dir at the run's data"
            )
        if len(c.dataset.train) <= config.es.seq_len:
            raise self._refuse(
                f"this worker's input.bin has {len(c.dataset.train)} tokens, the run's "
                f"es.seq_len={config.es.seq_len} needs more: point --data-dir at the run's data"
            )
        self.config = config
        backend = c.backend
        if backend is not None:
            if c.run_id != welcome.run_id or backend.config.digest() != config.digest():
                log.info("new run: the replica starts again from step 0", run=welcome.run_id.hex())
                c._drop_replica()
            elif backend.step > welcome.current_step:
                # Steps the run has not committed: the replica cannot be trusted.
                log.warning(
                    "replica dropped",
                    reason=f"at step {backend.step}, the run has {welcome.current_step}",
                )
                c._drop_replica()
        if c.backend is None:
            await c._new_replica(ReplicaState.initial(config))
        c.run_id = welcome.run_id
        self.committed = welcome.current_step
        log.info(
            "connected",
            coordinator=f"{c.host}:{c.port}",
            run=welcome.run_id.hex(),
            run_step=welcome.current_step,
            replica_step=self.backend.step,
            snapshot_step=welcome.snapshot_step,
        )
        if welcome.snapshot_step > self.backend.step:
            self.catchup = (self.backend.step, time.monotonic())
            self.download = _Download(time.monotonic())
            await self._send(SnapshotRequest(LATEST_SNAPSHOT))

    # --- the job loop --------------------------------------------------------------------

    async def _serve(self, welcome: Welcome) -> None:
        await self._adopt(welcome)
        await self._advance()
        while True:
            msg = await self._next()
            if msg is not None:
                await self._handle(msg)
            await self._advance()

    async def _next(self) -> Message | None:
        """Next message; None when a WAIT has run out (time to ask again)."""
        if not self.inbox.empty():
            return self._unwrap(self.inbox.get_nowait())
        waiting = self.retry_at is not None and not self.awaiting and self.download is None
        if not waiting:
            return await self._receive(self.client.reply_timeout_s)
        assert self.retry_at is not None
        try:
            item = await asyncio.wait_for(
                self.inbox.get(), max(0.0, self.retry_at - time.monotonic())
            )
        except TimeoutError:
            self.retry_at = None
            return None
        return self._unwrap(item)

    async def _advance(self) -> None:
        """Ask for what comes next unless an answer, a snapshot or a WAIT is outstanding."""
        if self.awaiting or self.download is not None or self.retry_at is not None:
            return
        if not self.inbox.empty():
            return  # act on what has arrived first (a queued STEP changes what to ask)
        backend = self.backend
        if backend.step < self.committed:
            if self.catchup is None:
                self.catchup = (backend.step, time.monotonic())
            await self._send(FitnessRequest(backend.step, self._fitness_batch()))
            self.awaiting = FitnessRequest
        else:
            if self.catchup is not None:
                start, t0 = self.catchup
                self.catchup = None
                log.info(
                    "caught up",
                    from_step=start,
                    to_step=backend.step,
                    seconds=round(time.monotonic() - t0, 3),
                    digest=f"{self.client.replica_digest:016x}",
                )
            await self._send(
                JobRequest(backend.step, self.client.replica_digest, self.client.weights_changed)
            )
            self.awaiting = JobRequest

    def _fitness_batch(self) -> int:
        assert self.config is not None
        return max(
            1, min(FITNESS_STEPS_PER_REQUEST, FitnessRange.max_steps_per_frame(self.config.pairs))
        )

    async def _handle(self, msg: Message) -> None:
        if isinstance(msg, Job):
            await self._on_job(msg)
        elif isinstance(msg, Wait):
            self.awaiting = None
            self.retry_at = time.monotonic() + msg.retry_after_ms / 1000
        elif isinstance(msg, Step):
            await self._on_step(msg)
        elif isinstance(msg, FitnessRange):
            await self._on_fitness_range(msg)
        elif isinstance(msg, SnapshotRequest):
            await self._send_snapshot(msg.step)
        elif isinstance(msg, SnapshotChunk):
            await self._on_snapshot_chunk(msg)
        elif isinstance(msg, Validate):
            await self._on_validate(msg)
        # HEARTBEAT: nothing to do; receiving it already proved the coordinator alive.

    async def _on_job(self, job: Job) -> None:
        backend = self.backend
        assert self.config is not None
        if job.step != backend.step or self.download is not None:
            # Only a replica at the job's step may evaluate it. An older job answers a request
            # that a STEP overtook (a newer request is on its way); a newer one means this
            # replica is behind, and _advance catches up.
            log.info("job skipped", step=job.step, chunk=job.chunk, replica_step=backend.step)
            if job.step > backend.step:
                self.committed = max(self.committed, job.step)
                self.awaiting = None
            return
        self.awaiting = None
        self.retry_at = None
        population = self.config.es.population
        if job.first_member + job.member_count > population:
            raise _PeerViolation(
                f"JOB members [{job.first_member}, {job.first_member + job.member_count}) lie "
                f"outside the population of {population}"
            )
        t0 = time.monotonic()
        result = await self.client._call(
            backend.evaluate_chunk, job.step, job.first_member, job.member_count
        )
        seconds = time.monotonic() - t0
        if self.newest_step_frame > job.step:
            # The step was committed meanwhile (another worker's copy won): nobody needs it.
            log.info("chunk dropped", step=job.step, chunk=job.chunk, reason="step committed")
            return
        await self._send(
            Result.from_values(
                step=job.step,
                chunk=job.chunk,
                loss_sum=result.loss_sum,
                weights_changed=self.client.weights_changed,
                replica_digest=self.client.replica_digest,
                fitness=result.fitness,
            )
        )
        tokens = job.member_count * self.config.es.seq_len
        log.info(
            "chunk done",
            step=job.step,
            chunk=job.chunk,
            members=job.member_count,
            seconds=round(seconds, 3),
            member_tok_s=round(tokens / max(seconds, 1e-9)),
        )

    async def _on_step(self, msg: Step) -> None:
        backend = self.backend
        if msg.step < backend.step:
            return  # already applied (from a FITNESS_RANGE)
        self.committed = max(self.committed, msg.step + 1)
        self.retry_at = None  # SPEC §8: a STEP ends a WAIT
        if msg.step > backend.step or self.download is not None:
            # Behind: catch up with FITNESS_REQUEST, unless one is already out.
            if self.awaiting is JobRequest:
                self.awaiting = None
            return
        # SPEC §8: after applying a STEP the worker sends JOB_REQUEST, whatever it asked
        # before (the coordinator may leave a request from the old step unanswered).
        self.awaiting = None
        assert self.config is not None
        if msg.pair_count != self.config.pairs:
            raise _PeerViolation(
                f"STEP {msg.step} has {msg.pair_count} pairs, the run has {self.config.pairs}"
            )
        fitness = unpack_ternary(msg.fitness, msg.pair_count)
        t0 = time.monotonic()
        changed = await self.client._call(backend.apply_step, fitness)
        self.client.weights_changed = changed
        self.client.replica_digest = await self.client._call(backend.digest)
        # `step` counts the updates applied, so `digest` is the one reported for that step.
        log.info(
            "step applied",
            step=backend.step,
            changed=changed,
            digest=f"{self.client.replica_digest:016x}",
            seconds=round(time.monotonic() - t0, 3),
        )

    async def _on_fitness_range(self, msg: FitnessRange) -> None:
        assert self.config is not None
        pairs = self.config.pairs
        if msg.pairs_per_step != pairs:
            raise _PeerViolation(
                f"FITNESS_RANGE has {msg.pairs_per_step} pairs per step, the run has {pairs}"
            )
        end = msg.first_step + msg.step_count
        self.committed = max(self.committed, end)
        backend = self.backend
        if self.download is not None:
            return  # the snapshot comes first; the fitness is asked for again after it
        if msg.first_step < backend.step and end <= backend.step:
            return  # answers a request a STEP overtook: nothing new, a newer answer is due
        self.awaiting = None
        if msg.first_step > backend.step:
            raise _PeerViolation(
                f"FITNESS_RANGE starts at step {msg.first_step}, the replica needs step "
                f"{backend.step}"
            )
        todo = msg.split()[backend.step - msg.first_step :]
        if not todo:
            return
        start, t0 = backend.step, time.monotonic()
        for packed in todo:
            # One call per step: a stop or a heartbeat never waits for a whole batch.
            changed = await self.client._call(backend.apply_step, unpack_ternary(packed, pairs))
            self.client.weights_changed = changed
        self.client.replica_digest = await self.client._call(backend.digest)
        log.info(
            "replayed",
            from_step=start,
            to_step=backend.step,
            run_step=self.committed,
            seconds=round(time.monotonic() - t0, 3),
        )

    async def _on_validate(self, msg: Validate) -> None:
        """Score the replica on valid.bin if it is still at the asked step (SPEC §8)."""
        backend = self.backend
        if msg.step != backend.step or self.download is not None:
            return
        t0 = time.monotonic()
        v = await self.client._call(backend.validate)
        await self._send(Validation(msg.step, v.tokens, v.loss_16, v.bits_per_token))
        log.info(
            "validation",
            step=msg.step,
            valid_bits=round(v.bits_per_token, 4),
            tokens=v.tokens,
            seconds=round(time.monotonic() - t0, 3),
        )

    # --- snapshots -----------------------------------------------------------------------

    async def _send_snapshot(self, requested: int) -> None:
        # SPEC §8: a worker that has moved on sends its current state; it carries its step.
        state = self.backend.state
        blob = await self.client._call(encode_checkpoint, state)
        for chunk in iter_snapshot_chunks(state.step, blob):
            await self._send(chunk)
        log.info("snapshot sent", step=state.step, requested=requested, bytes=len(blob))

    async def _on_snapshot_chunk(self, chunk: SnapshotChunk) -> None:
        d = self.download
        if d is None:
            log.info("unexpected snapshot chunk ignored", step=chunk.step, offset=chunk.offset)
            return
        if d.step is None:
            if chunk.offset != 0:
                raise _PeerViolation(f"first SNAPSHOT_CHUNK starts at offset {chunk.offset}")
            d.step, d.total = chunk.step, chunk.total_bytes
        elif (chunk.step, chunk.total_bytes, chunk.offset) != (d.step, d.total, d.received):
            raise _PeerViolation(
                f"SNAPSHOT_CHUNK (step {chunk.step}, total {chunk.total_bytes}, offset "
                f"{chunk.offset}) does not continue step {d.step}, total {d.total} at {d.received}"
            )
        d.parts.append(chunk.data)
        d.received += len(chunk.data)
        if not chunk.is_last:
            return
        self.download = None
        blob = b"".join(d.parts)
        d.parts.clear()
        try:
            state = await self.client._call(decode_checkpoint, blob)
            self._check_snapshot(state, d.step)
        except CheckpointError as exc:
            # The fitness log is the run itself: replay it instead of trusting this blob.
            log.warning("snapshot rejected; replaying the fitness log instead", reason=str(exc))
            return
        if state.step <= self.backend.step:
            log.info("snapshot not newer than the replica", step=state.step)
            return
        await self.client._call(self.backend.load_state, state)
        self.client.weights_changed = 0  # unknown after a snapshot; 0 as at step 0
        self.client.replica_digest = await self.client._call(self.backend.digest)
        log.info(
            "snapshot loaded",
            step=state.step,
            bytes=len(blob),
            seconds=round(time.monotonic() - d.started, 3),
            digest=f"{self.client.replica_digest:016x}",
        )

    def _check_snapshot(self, state: ReplicaState, step: int | None) -> None:
        assert self.config is not None
        if state.step != step:
            raise CheckpointError(f"snapshot holds step {state.step}, its chunks said {step}")
        if state.config.digest() != self.config.digest():
            raise CheckpointError("snapshot was made with another run config")
        if state.step > self.committed:
            raise CheckpointError(
                f"snapshot at step {state.step} is past the run's {self.committed} steps"
            )


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    text = getattr(exc, "strerror", None) or str(exc)
    return text or type(exc).__name__
