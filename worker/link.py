"""One connection to the coordinator, from HELLO until it closes: the worker's I/O half.

One task reads frames into a queue and the serve loop hands them to the pure session
(`session.py`) in order, carrying out its commands one at a time with an `Executor`; backend
calls go through the replica façade (`replica.py`), whose single thread keeps heartbeats and
frames flowing while a long chunk runs. What ends the connection comes back as an `Outcome`
(why, to reconnect), or as WorkerFatal when no retry can help (another protocol on the port, a
certificate refused).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ssl
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
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
    Sample,
    Step,
    iter_snapshot_chunks,
)
from ..shared.config import RunConfig
from ..shared.hf_dir import ModelDirError
from ..shared.pinned import GoalError
from ..shared.replica import ReplicaState
from . import session as flow
from . import session_types as cmd
from .backend import BackendUnavailable, ChunkResult, Validation
from .reward import RewardError
from .session_types import Ended, Identity, PeerViolation, Phase, ReplicaView, WorkerFatal

__all__ = ["Executor", "Later", "Link", "LinkOptions", "Outcome", "ReplicaCalls", "describe"]

log = structlog.get_logger("eggroll.worker")

READ_BYTES = 1 << 16
TLS_REFUSALS = 3  # closes before any frame in a row (a TLS refusal, or a TLS coordinator)
# OpenSSL's reasons, in the handshake, when the peer's answer is no TLS record (a
# plain-TCP coordinator): worker/client.py gives up on them.
PLAIN_REPLIES = ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG")
TLS_RECORDS = b"\x14\x15\x16\x17"  # TLS record types: change cipher, alert, handshake, data
CLOSE_TIMEOUT_S = 2.0


class ReplicaCalls(ReplicaView, Protocol):
    """What the executor asks of the replica: `replica.Replica`, whose calls run on its
    backend thread, or one whose calls run at once (the in-memory flow tests)."""

    def drop(self) -> None: ...
    async def start(self, config: RunConfig, run_id: bytes) -> None: ...
    async def evaluate(
        self,
        step: int,
        chunks: list[tuple[int, int]],
        claims: Sequence[Sequence[np.ndarray]] = (),
    ) -> list[ChunkResult]: ...
    async def apply(self, fitness: list[np.ndarray]) -> None: ...
    async def encode(self) -> tuple[int, bytes]: ...
    async def decode(self, blob: bytes) -> tuple[ReplicaState | None, str]: ...
    async def load(self, state: ReplicaState) -> None: ...
    async def validate(self) -> Validation: ...
    async def start_validation(self) -> concurrent.futures.Future[Validation]: ...
    async def sample(self, request: Sample) -> tuple[bytes, bytes]: ...


@dataclass(frozen=True)
class Later:
    """A command's result that came after the command (validation's scores): handed to the
    session between commands, as a message is."""

    result: concurrent.futures.Future
    then: Callable[[Any], list[cmd.Command]]  # the session's result call


class Executor:
    """Carries out the session's commands one at a time: messages go out through `send`,
    the rest is asked of the replica, and each result goes back to the session (which may
    answer with more commands). A result that comes later goes to `later` (the link's
    inbox); without it, it is awaited at once. The link and the in-memory flow tests both
    use this."""

    def __init__(
        self,
        session: flow.Session,
        replica: ReplicaCalls,
        send: Callable[[Message], Awaitable[None]],
        clock: Callable[[], float] = time.monotonic,
        later: Callable[[Later], None] | None = None,
    ) -> None:
        self.session = session
        self.replica = replica
        self.send = send
        self.clock = clock
        self.later = later

    async def carry_out(self, commands: list[cmd.Command]) -> None:
        session, replica = self.session, self.replica
        for command in commands:
            t0 = self.clock()
            match command:
                case cmd.Send(msg=msg):
                    await self.send(msg)
                case cmd.Evaluate(jobs=jobs, claims=claims):
                    chunks = [(job.first_member, job.member_count) for job in jobs]
                    try:
                        results = await replica.evaluate(jobs[0].step, chunks, claims)
                    except RewardError as exc:
                        await self.carry_out(session.evaluation_failed(jobs, str(exc)))
                        continue
                    await self.carry_out(session.evaluated(jobs, results, self.clock() - t0))
                case cmd.Apply(fitness=fitness):
                    await replica.apply(fitness)
                case cmd.DropReplica():
                    replica.drop()
                case cmd.StartReplica(config=config, run_id=run_id):
                    try:
                        await replica.start(config, run_id)
                    except BackendUnavailable as exc:  # e.g. a model this device cannot run
                        raise WorkerFatal(
                            f"this worker's backend cannot run the run's config: {exc}",
                            ErrorCode.CONFIG_MISMATCH,
                            tell=True,
                        ) from None
                    except (GoalError, RewardError, ModelDirError) as exc:  # a prompt too long
                        raise WorkerFatal(str(exc), ErrorCode.CONFIG_MISMATCH, tell=True) from None
                case cmd.DecodeSnapshot(blob=blob, step=step):
                    state, error = await replica.decode(blob)
                    await self.carry_out(session.snapshot_decoded(step, state, error))
                case cmd.InstallSnapshot(state=state):
                    await replica.load(state)
                case cmd.ExportSnapshot(requested=requested):
                    step, blob = await replica.encode()
                    for chunk in iter_snapshot_chunks(step, blob):
                        await self.send(chunk)
                    log.info("snapshot sent", step=step, requested=requested, bytes=len(blob))
                case cmd.RunValidation(step=step):
                    scores = await replica.start_validation()  # the weights of `step` copied

                    def then(v: Validation, step: int = step, t0: float = t0) -> list[cmd.Command]:
                        return session.validated(step, v, self.clock() - t0)

                    if scores.done():  # scored in order
                        await self.carry_out(then(scores.result()))
                    elif self.later is None:
                        await self.carry_out(then(await asyncio.wrap_future(scores)))
                    else:  # training goes on; the scores come back through the inbox
                        self._when_done(Later(scores, then))
                case cmd.RunSample(request=request):
                    prompt, text = await replica.sample(request)
                    seconds = self.clock() - t0
                    await self.carry_out(session.sampled(request, prompt, text, seconds))

    def _when_done(self, item: Later) -> None:
        """Hand `item` to `later` on this loop once its result is in (it comes on the
        scoring thread)."""
        loop, later = asyncio.get_running_loop(), self.later
        assert later is not None
        item.result.add_done_callback(lambda _: loop.call_soon_threadsafe(later, item))


@dataclass(frozen=True)
class LinkOptions:
    """What one connection needs to know of its worker."""

    identity: Identity
    tls: bool = False  # over TLS: a close before any frame is how a certificate is refused
    heartbeat_s: float = 5.0
    reply_timeout_s: float = 60.0
    hello_timeout_s: float = 10.0  # a coordinator answers HELLO at once
    tls_refusals: int = 0  # TLS closes before any frame, in a row, before this connection


@dataclass(frozen=True)
class Outcome:
    """How a connection ended: why (one line), how long it was up after WELCOME (0: never
    welcomed), whether the coordinator sent anything, whether it closed a TLS connection
    before any frame (how it refuses a certificate), whether it said this worker's own
    replica or fitness was wrong (DIVERGED; the replica was dropped), and whether a step
    this worker scored was committed and sent to it."""

    reason: str
    ready_s: float = 0.0
    heard: bool = False
    tls_refused: bool = False
    diverged: bool = False
    confirmed: bool = False


class Link:
    """One connection to the coordinator, from HELLO until it closes."""

    def __init__(
        self,
        options: LinkOptions,
        replica: ReplicaCalls,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        on_welcome: Callable[[], None] = lambda: None,
    ) -> None:
        self.options = options
        self.on_welcome = on_welcome  # the handshake is done (the client counts these)
        self.replica = replica
        self.reader = reader
        self.writer = writer
        self.conn = Connection(Role.WORKER)
        self.session = flow.Session(options.identity, replica)
        self.inbox: asyncio.Queue[Message | Later | Ended | WorkerFatal] = asyncio.Queue()
        self.executor = Executor(self.session, replica, self._send, later=self.inbox.put_nowait)
        self.ready_at: float | None = None  # when WELCOME arrived
        self.bytes_read = 0
        self.tls_refused = False  # closed over TLS before any frame
        self.diverged = False  # ended by DIVERGED for its own replica or fitness
        self.last_sent = time.monotonic()
        self._reader_task: asyncio.Task[None] | None = None

    async def run(self) -> Outcome:
        """Serve until the connection ends; returns how. Raises WorkerFatal."""
        reason = await self._run()
        ready_s = 0.0 if self.ready_at is None else time.monotonic() - self.ready_at
        return Outcome(
            reason,
            ready_s,
            bool(self.bytes_read),
            self.tls_refused,
            self.diverged,
            self.session.confirmed,
        )

    async def _run(self) -> str:
        self._reader_task = asyncio.create_task(self._read_loop())
        heartbeat = asyncio.create_task(self._heartbeat_loop())
        try:
            await self._serve()
            raise AssertionError("unreachable: _serve only ends by raising")
        except Ended as exc:
            if exc.drop_replica:
                self.replica.drop()
            self.diverged = exc.own
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
                await asyncio.wait_for(self.writer.wait_closed(), CLOSE_TIMEOUT_S)

    async def _serve(self) -> None:
        session, carry_out = self.session, self.executor.carry_out
        await carry_out(session.start())
        while True:
            msg = await self._next()
            if isinstance(msg, Later):
                await carry_out(msg.then(msg.result.result()))
            elif msg is not None:
                await carry_out(session.receive(msg))
                if self.ready_at is None and session.welcomed:
                    self.ready_at = time.monotonic()
                    self.on_welcome()
            if self.inbox.empty():  # act on what has arrived first (a STEP changes the ask)
                await carry_out(session.advance())

    async def _next(self) -> Message | Later | None:
        """Next message (or a result that came later); None when a WAIT has run out (time to
        ask again)."""
        session = self.session
        waiting = session.phase is Phase.WAITING and session.retry_at is not None
        timeout = (
            max(0.0, session.retry_at - time.monotonic())  # type: ignore[operator]
            if waiting
            else self.options.reply_timeout_s
        )
        silent = not self.bytes_read and bool(self.conn.messages_sent)
        if silent:
            timeout = self.options.hello_timeout_s
        if not self.inbox.empty():
            item = self.inbox.get_nowait()
        else:
            try:
                item = await asyncio.wait_for(self.inbox.get(), timeout)
            except TimeoutError:
                if silent and not self.bytes_read:
                    raise WorkerFatal(
                        f"{self.options.identity.coordinator} accepted the connection but said "
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

    # --- I/O ---------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        try:
            while True:
                data = await self.reader.read(READ_BYTES)
                if not data:
                    self.inbox.put_nowait(self._closed(silent_plain=True))
                    return
                if not self.bytes_read and not MAGIC.startswith(data[: len(MAGIC)]):
                    self.inbox.put_nowait(self._not_a_coordinator(data))
                    return
                self.bytes_read += len(data)
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
            if exc.error_code is ErrorCode.BAD_VERSION:  # its frames: another release
                self.inbox.put_nowait(
                    WorkerFatal(
                        f"the coordinator speaks another protocol ({exc}): run the same "
                        "eggroll-distributed version everywhere",
                        ErrorCode.BAD_VERSION,
                    )
                )
                return
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
                self.inbox.put_nowait(Ended(f"connection lost: {describe(exc)}"))
        except ConnectionResetError as exc:
            # Over TLS, a reset before any frame is a refusal too: TLS 1.3 checks our
            # certificate after our side of the handshake, and a coordinator that closes
            # with our HELLO unread resets the connection, its alert lost with it.
            self.inbox.put_nowait(self._closed(f"connection lost: {describe(exc)}"))
        except OSError as exc:
            self.inbox.put_nowait(Ended(f"connection lost: {describe(exc)}"))

    def _not_a_coordinator(self, first: bytes) -> WorkerFatal:
        """The peer's first bytes are no frame: it is some other service (a web server, the
        coordinator's metrics endpoint); retrying will not change that."""
        where = self.options.identity.coordinator
        if first[:1] in TLS_RECORDS and first[1:2] == b"\x03":
            return WorkerFatal(
                f"{where} answered in TLS: the coordinator serves TLS (started with "
                "--tls-cert): give this worker --tls-ca with the CA that signed it"
            )
        if first.startswith(b"HTTP/"):
            what = "answered in HTTP: it is a web server (the metrics endpoint?)"
        else:
            what = f"does not speak the eggroll protocol (it sent {first[:16]!r})"
        return WorkerFatal(
            f"{where} {what}, not an eggroll coordinator: give the coordinator's own port "
            f"(default {DEFAULT_PORT})"
        )

    def _closed(
        self, otherwise: str = "the coordinator closed the connection", silent_plain: bool = False
    ) -> Ended | WorkerFatal:
        """Why the coordinator closed (or reset) the connection: `otherwise`, except that
        over TLS a close before any frame is how it refuses this worker's certificate, and
        without TLS a clean close before any byte (`silent_plain`) is how a TLS coordinator
        ends a handshake that never began: after a few in a row, give up."""
        if not self.options.tls and silent_plain and not self.bytes_read:
            # A TLS coordinator ends a plain handshake so; so does a tunnel or a load
            # balancer whose coordinator is down: say the likely cause, and go on trying.
            self.tls_refused = True  # counted as the TLS refusals are
            if self.options.tls_refusals + 1 >= TLS_REFUSALS:
                return Ended(
                    f"{otherwise} before saying anything, {TLS_REFUSALS} times or more in a "
                    "row: if it serves TLS (started with --tls-cert), give this worker "
                    "--tls-ca with the CA that signed it"
                )
            return Ended(otherwise)
        if not self.options.tls or self.conn.messages_received:
            return Ended(otherwise)
        self.tls_refused = True
        refusals = (0 if self.bytes_read else self.options.tls_refusals) + 1  # bytes reset it
        if refusals >= TLS_REFUSALS:
            return WorkerFatal(
                f"TLS: the coordinator closed {refusals} connections in a row before "
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
        period = self.options.heartbeat_s
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
                await asyncio.wait_for(asyncio.shield(self._reader_task), CLOSE_TIMEOUT_S)
        while not self.inbox.empty():
            item = self.inbox.get_nowait()
            if isinstance(item, WorkerFatal):  # the reader's verdict (a refusal) stands
                raise item
            if isinstance(item, Ended):
                return str(item)
            if isinstance(item, Error):
                try:
                    self.session.receive(item)
                except Ended as ended:
                    if ended.drop_replica:
                        self.replica.drop()
                    self.diverged = ended.own
                    return str(ended)
        return f"connection lost: {describe(exc)}"


def describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    text = getattr(exc, "strerror", None) or str(exc)
    return text or type(exc).__name__
