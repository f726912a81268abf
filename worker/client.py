"""The worker's I/O shell: connect, reconnect with backoff, read frames, heartbeat, and carry
out what the pure session (`session.py`) asks for.

Per connection, one task reads frames into a queue and the serve loop hands them to the
session in order, carrying out its commands one at a time; backend calls go through the
replica façade (`replica.py`), whose single thread keeps heartbeats and frames flowing while
a long chunk runs. The replica outlives connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
import ssl
import time

import structlog

from ..protocol import (
    DEFAULT_PORT,
    MAGIC,
    Connection,
    Error,
    ErrorCode,
    Heartbeat,
    Message,
    MsgType,
    RemoteProtocolError,
    Role,
    Step,
    clip_utf8,
    iter_snapshot_chunks,
)
from ..protocol.messages import MAX_WORKER_NAME_BYTES
from ..shared.data import Dataset
from . import session as flow
from .backend import Backend, BackendFactory, get_backend
from .replica import Replica
from .session import Ended, PeerViolation, Phase, WorkerFatal

__all__ = ["WorkerClient", "WorkerFatal", "default_worker_name"]

log = structlog.get_logger("eggroll.worker")

INITIAL_RETRY_S = 0.2
# A connection that stayed up this long resets the backoff; one dropped sooner (a coordinator
# that accepts and then fails at once) keeps growing it.
STABLE_CONNECTION_S = 10.0
_READ_BYTES = 1 << 16
TLS_REFUSALS = 3  # TLS connections closed before any frame, in a row, before giving up
RESOLVE_ATTEMPTS = 8  # host-name lookups failed in a row before giving up (~25 s of backoff)
_CLOSE_TIMEOUT_S = 2.0


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


def default_worker_name() -> str:
    return clip_utf8(f"{socket.gethostname()}-{os.getpid()}", MAX_WORKER_NAME_BYTES)


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
        tls: ssl.SSLContext | None = None,
        max_retry_s: float = 30.0,
        heartbeat_s: float = 5.0,
        reply_timeout_s: float = 60.0,
        connect_timeout_s: float = 10.0,
        hello_timeout_s: float = 10.0,
    ) -> None:
        self.host = host
        self.port = port
        self.tls = tls
        self.tls_refusals = 0  # TLS connections closed in a row before any frame
        self.dataset = dataset
        factory = backend or get_backend("numpy")
        self.name = default_worker_name() if name is None else name
        self.identity = flow.Identity.of(self.name, token, factory, dataset, f"{host}:{port}")
        self.replica = Replica(dataset, factory)
        self.max_retry_s = max_retry_s
        self.heartbeat_s = heartbeat_s
        self.reply_timeout_s = reply_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.hello_timeout_s = hello_timeout_s  # a coordinator answers HELLO at once
        self.connections = 0  # handshakes completed
        self.resolve_failures = 0  # host-name lookups failed in a row
        self._stop = asyncio.Event()
        self._rng = random.Random()  # backoff jitter only; nothing a replica depends on

    @property
    def backend(self) -> Backend | None:
        return self.replica.backend

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def stop(self) -> None:
        """Ask `run()` to close the connection and return (call from the event loop)."""
        self._stop.set()

    async def run(self) -> None:
        """Serve the coordinator until `stop()`; raises WorkerFatal on a permanent error."""
        self.replica.open()
        link: asyncio.Task[tuple[str, float]] | None = None
        attempt = 0
        try:
            while not self._stop.is_set():
                link = asyncio.create_task(self._connect_and_serve())
                stopper = asyncio.create_task(self._stop.wait())
                await asyncio.wait({link, stopper}, return_when=asyncio.FIRST_COMPLETED)
                stopper.cancel()
                if not link.done():
                    break  # stopped; the finally below closes the connection
                reason, ready_s = link.result()  # WorkerFatal propagates from here
                link = None
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
            if link is not None:
                await _cancel_until_done(link)
            self.replica.close()

    async def _connect_and_serve(self) -> tuple[str, float]:
        """One connection; returns why it ended and how long it was up after WELCOME."""
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port, ssl=self.tls),
                self.connect_timeout_s,
            )
        except ssl.SSLCertVerificationError as exc:
            # The coordinator is not who the CA vouches for: retrying will not change that.
            raise WorkerFatal(
                f"TLS: the certificate of {self.host}:{self.port} is not trusted "
                f"({exc.verify_message}): check --tls-ca and the host name"
            ) from None
        except (OSError, TimeoutError) as exc:
            self._count_resolve_failure(exc)
            return f"cannot connect to {self.host}:{self.port}: {_describe(exc)}", 0.0
        self.resolve_failures = 0
        sock = writer.get_extra_info("socket")
        if sock is not None:
            # Small request/reply frames: no Nagle delay. Keepalive finds a dead peer.
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        link = _Link(self, reader, writer)
        reason = await link.run()
        ready_s = 0.0 if link.ready_at is None else time.monotonic() - link.ready_at
        return reason, ready_s

    def _count_resolve_failure(self, exc: BaseException) -> None:
        """Give up on a host name that does not resolve RESOLVE_ATTEMPTS times in a row: a
        typo does not fix itself, and retrying forever would hide it."""
        if not isinstance(exc, socket.gaierror):
            self.resolve_failures = 0
            return
        self.resolve_failures += 1
        if self.resolve_failures >= RESOLVE_ATTEMPTS:
            raise WorkerFatal(
                f"cannot resolve the host name {self.host!r} ({_describe(exc)}), "
                f"{self.resolve_failures} tries in a row: check its spelling and this host's "
                "DNS, or give the coordinator's IP address"
            )


class _Link:
    """One connection to the coordinator, from HELLO until it closes."""

    def __init__(
        self, client: WorkerClient, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.client = client
        self.replica = client.replica
        self.reader = reader
        self.writer = writer
        self.conn = Connection(Role.WORKER)
        self.session = flow.Session(client.identity, client.replica)
        self.inbox: asyncio.Queue[Message | Ended | WorkerFatal] = asyncio.Queue()
        self.ready_at: float | None = None  # when WELCOME arrived
        self.bytes_read = 0
        self.last_sent = time.monotonic()
        self._reader_task: asyncio.Task[None] | None = None

    async def run(self) -> str:
        """Serve until the connection ends; returns why. Raises WorkerFatal."""
        self._reader_task = asyncio.create_task(self._read_loop())
        heartbeat = asyncio.create_task(self._heartbeat_loop())
        try:
            await self._serve()
            raise AssertionError("unreachable: _serve only ends by raising")
        except Ended as exc:
            if exc.drop_replica:
                self.replica.drop()
            return str(exc)
        except WorkerFatal as exc:
            if exc.tell and exc.code is not None:
                self._send_error(exc.code, str(exc))
            raise
        except PeerViolation as exc:
            self._send_error(ErrorCode.MALFORMED, str(exc))
            return f"protocol error from the coordinator: {exc}"
        except OSError as exc:
            # A write failed: the reader may hold the coordinator's ERROR saying why.
            return await self._why_closed(exc)
        finally:
            for task in (heartbeat, self._reader_task):
                task.cancel()
            self.writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.writer.wait_closed(), _CLOSE_TIMEOUT_S)

    async def _serve(self) -> None:
        session = self.session
        await self._carry_out(session.start())
        while True:
            msg = await self._next()
            if msg is not None:
                await self._carry_out(session.receive(msg))
                if self.ready_at is None and session.welcomed:
                    self.ready_at = time.monotonic()
                    self.client.connections += 1
            if self.inbox.empty():  # act on what has arrived first (a STEP changes the ask)
                await self._carry_out(session.advance())

    async def _next(self) -> Message | None:
        """Next message; None when a WAIT has run out (time to ask again)."""
        session = self.session
        waiting = session.phase is Phase.WAITING and session.retry_at is not None
        timeout = (
            max(0.0, session.retry_at - time.monotonic())  # type: ignore[operator]
            if waiting
            else self.client.reply_timeout_s
        )
        silent = not self.bytes_read and bool(self.conn.messages_sent)
        if silent:
            timeout = self.client.hello_timeout_s
        if not self.inbox.empty():
            item = self.inbox.get_nowait()
        else:
            try:
                item = await asyncio.wait_for(self.inbox.get(), timeout)
            except TimeoutError:
                if silent and not self.bytes_read:
                    raise WorkerFatal(
                        f"{self.client.identity.coordinator} accepted the connection but said "
                        f"nothing for {timeout:g} s after HELLO: it is not an eggroll coordinator "
                        "(a web server, such as the metrics endpoint, waits like this); give "
                        f"the coordinator's own port (default {DEFAULT_PORT})"
                    ) from None
                if not waiting:
                    raise Ended(f"no answer from the coordinator for {timeout:g} s") from None
                session.retry_due()
                return None
        if isinstance(item, Ended | WorkerFatal):
            raise item
        return item

    async def _carry_out(self, commands: list[flow.Command]) -> None:
        session, replica = self.session, self.replica
        for command in commands:
            t0 = time.monotonic()
            match command:
                case flow.Send(msg=msg):
                    await self._send(msg)
                case flow.Evaluate(job=job):
                    result = await replica.evaluate(job.step, job.first_member, job.member_count)
                    await self._carry_out(session.evaluated(job, result, time.monotonic() - t0))
                case flow.Apply(fitness=fitness):
                    await replica.apply(fitness)
                case flow.DropReplica():
                    replica.drop()
                case flow.StartReplica(config=config, run_id=run_id):
                    await replica.start(config, run_id)
                case flow.DecodeSnapshot(blob=blob, step=step):
                    state, error = await replica.decode(blob)
                    await self._carry_out(session.snapshot_decoded(step, state, error))
                case flow.InstallSnapshot(state=state):
                    await replica.load(state)
                case flow.ExportSnapshot(requested=requested):
                    step, blob = await replica.encode()
                    for chunk in iter_snapshot_chunks(step, blob):
                        await self._send(chunk)
                    log.info("snapshot sent", step=step, requested=requested, bytes=len(blob))
                case flow.RunValidation(step=step):
                    score = await replica.validate()
                    await self._carry_out(session.validated(step, score, time.monotonic() - t0))
                case flow.RunSample(request=request):
                    prompt, text = await replica.sample(request)
                    seconds = time.monotonic() - t0
                    await self._carry_out(session.sampled(request, prompt, text, seconds))

    # --- I/O ---------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        try:
            while True:
                data = await self.reader.read(_READ_BYTES)
                if not data:
                    self.inbox.put_nowait(self._closed())
                    return
                if not self.bytes_read and not MAGIC.startswith(data[: len(MAGIC)]):
                    self.inbox.put_nowait(self._not_a_coordinator(data))
                    return
                self.bytes_read += len(data)
                self.client.tls_refusals = 0
                self.conn.receive_data(data)
                while (msg := self.conn.next_event()) is not None:
                    if isinstance(msg, Step):
                        self.session.step_frame_seen(msg.step)
                    self.inbox.put_nowait(msg)
                    if isinstance(msg, Error):
                        return
        except RemoteProtocolError as exc:
            # SPEC §5: tell the peer why before the connection ends.
            with contextlib.suppress(OSError, RuntimeError):
                self.writer.write(self.conn.error_frame(exc))
            self.inbox.put_nowait(Ended(f"protocol error from the coordinator: {exc}"))
        except ssl.SSLError as exc:
            if "ALERT" in (exc.reason or ""):  # the coordinator refused our certificate
                self.inbox.put_nowait(
                    WorkerFatal(
                        f"TLS: the coordinator refused this worker ({exc.reason}): give "
                        "--tls-cert/--tls-key signed by the CA it trusts"
                    )
                )
            else:
                self.inbox.put_nowait(Ended(f"connection lost: {_describe(exc)}"))
        except OSError as exc:
            self.inbox.put_nowait(Ended(f"connection lost: {_describe(exc)}"))

    def _not_a_coordinator(self, first: bytes) -> WorkerFatal:
        """The peer's first bytes are no frame: it is some other service (a web server, the
        coordinator's metrics endpoint); retrying will not change that."""
        where = self.client.identity.coordinator
        if first.startswith(b"HTTP/"):
            what = "answered in HTTP: it is a web server (the metrics endpoint?)"
        else:
            what = f"does not speak the eggroll protocol (it sent {first[:16]!r})"
        return WorkerFatal(
            f"{where} {what}, not an eggroll coordinator: give the coordinator's own port "
            f"(default {DEFAULT_PORT})"
        )

    def _closed(self) -> Ended | WorkerFatal:
        """Why the coordinator closed the connection. Over TLS, a close before any frame is
        how it refuses this worker's certificate: after a few in a row, give up."""
        client = self.client
        if client.tls is None or self.conn.messages_received:
            return Ended("the coordinator closed the connection")
        client.tls_refusals += 1
        if client.tls_refusals >= TLS_REFUSALS:
            return WorkerFatal(
                f"TLS: the coordinator closed {client.tls_refusals} connections in a row before "
                "saying anything: it does not accept this worker's certificate (give "
                "--tls-cert/--tls-key signed by the CA it trusts)"
            )
        return Ended("the coordinator closed the TLS connection before the handshake")

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
                if self.conn.closed:
                    return
                continue  # HELLO not sent yet
            try:
                await self._send(Heartbeat(int(time.time() * 1000)))
            except OSError:
                return  # the reader reports the lost connection

    async def _why_closed(self, exc: OSError) -> str:
        if self._reader_task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._reader_task), _CLOSE_TIMEOUT_S)
        while not self.inbox.empty():
            item = self.inbox.get_nowait()
            if isinstance(item, Ended):
                return str(item)
            if isinstance(item, Error):
                try:
                    self.session.receive(item)
                except Ended as ended:
                    if ended.drop_replica:
                        self.replica.drop()
                    return str(ended)
        return f"connection lost: {_describe(exc)}"


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    text = getattr(exc, "strerror", None) or str(exc)
    return text or type(exc).__name__
