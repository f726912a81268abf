"""The coordinator server: the lifecycle and the sockets around the pure run core.

Every rule of protocol/SPEC.md §8 lives in `run.py` (the trust rules in `trust.py`). This file
starts the listener, runs one read task per worker connection (bytes -> `Connection` ->
`RunCore.receive` -> carry out what it returns), and shuts down in order: stop accepting, ask
for a last snapshot, tell every worker, wait a bounded time, cancel the rest. What the core
returns is carried out by one `Executor`, which the in-memory flow tests drive too: it writes
messages, reads and writes snapshot files off the event loop, and records the core's events
(`record.py`: the metrics and the log, and the run's curve, each committed step, held-out score
and sample, in the save directory's history.log and the experiment tracker, if any).
All run state is touched from the event loop only, so no locks are needed.

Every peer is bounded: a cap on connections (in all and per address), a deadline for the
handshake, and bounded writes (`link.py`). A failed commit (`Fatal`) stops the coordinator
at once: nothing after it is trusted to reach the disk. Any other file of the save directory
that cannot be written costs a warning, never the run or the worker's session (the policy
table is in shared/save_dir.py): a snapshot that cannot be stored is dropped, and a session
that fails on this side tells the core (`failed_here`) so no worker is bounced in a loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from ..protocol import (
    DEFAULT_PORT,
    Connection,
    ErrorCode,
    Message,
    ProtocolError,
    Role,
    SnapshotChunk,
)
from ..protocol.errors import RUN_COMPLETE
from ..protocol.messages import SNAPSHOT_CHUNK_BYTES
from ..protocol.security import IDENTITY_PREFIXES, certificate_identity, is_loopback
from ..shared.logs import LISTENING
from ..shared.progress import Progress
from ..shared.replica import CheckpointError, decode_checkpoint
from ..shared.run_writer import SNAPSHOTS_KEPT
from ..shared.tracking import Tracker
from . import events
from .core_types import Close, Output, RunOptions, Send, ServeSnapshot, StoreSnapshot
from .jobs import Clock
from .link import Link
from .metrics import Metrics
from .record import record
from .run import Fatal, Halted, Refused, RunCore
from .store import RunStore, SnapshotWriteError

__all__ = ["Coordinator", "Executor", "Listener", "Options"]

log = structlog.get_logger("eggroll.coordinator")

READ_BYTES = 1 << 16
BUSY_READ_BYTES, BUSY_READ_S = 4096, 1.0  # what a refused connection may still send
TRANSFER_QUIET_S = 2.0  # a snapshot sent quicker than this logs no progress lines

# Runs a blocking call (file I/O, checkpoint decoding) off the event loop.
Offload = Callable[..., Awaitable[Any]]


@dataclass
class Options:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    tls: ssl.SSLContext | None = None
    # Mutual TLS: a worker's certificate identity, not its address, stands for its machine
    # in the checks (workers behind one NAT are machines apart, with a certificate each).
    machine_by_certificate: bool = False
    run: RunOptions = field(default_factory=RunOptions)  # the run's course, for the core
    keep_snapshots: int = SNAPSHOTS_KEPT
    final_snapshot_timeout_s: float = 120.0
    drain_timeout_s: float = 5.0
    idle_timeout_s: float = 60.0  # a connection silent this long is dropped
    handshake_timeout_s: float = 10.0  # from accept to WELCOME
    write_timeout_s: float = 30.0  # a peer must read what it is sent within this
    max_connections: int = 256
    max_connections_per_address: int = 32


class Executor:
    """Carries out what the run core returns, for the server and the in-memory flow tests
    alike: messages go out through the peers' `Link`s, snapshots are streamed from and
    written to the store with `offload` (a thread in the server), and events are recorded
    (the curve's in history.log and `tracker` too). It also counts the bytes on every link,
    for each committed step's line."""

    def __init__(
        self,
        core: RunCore,
        metrics: Metrics,
        links: dict[int, Link],
        *,
        keep_snapshots: int = SNAPSHOTS_KEPT,
        offload: Offload = asyncio.to_thread,
        tracker: Tracker | None = None,
    ) -> None:
        self.core = core
        self.tracker = tracker
        self.store = core.store
        self.metrics = metrics
        self.links = links
        self.keep_snapshots = keep_snapshots
        self.offload = offload
        self.net_in = self.net_out = 0  # bytes on all links
        self._net_marks = (0, 0)  # the totals at the last commit

    def traffic(self, received: int = 0, sent: int = 0) -> None:
        self.net_in += received
        self.net_out += sent

    def record(self, happened: list[events.Event]) -> None:
        for event in happened:
            net = (0, 0)
            if isinstance(event, events.Committed):
                net = (self.net_in - self._net_marks[0], self.net_out - self._net_marks[1])
                self._net_marks = (self.net_in, self.net_out)
            record(self.metrics, event, net, self._curve)
        if degraded := self.core.store_events():  # a history.log write just now
            self.record(degraded)

    def _curve(self, point: dict[str, Any]) -> None:
        self.store.record_history(point)
        if self.tracker is not None:
            self.tracker.record(point)

    def write(self, link: Link, msg: Message) -> None:
        self.traffic(sent=link.write(msg))

    def refuse(self, link: Link, refused: Refused) -> None:
        """Record why the peer is refused and send it ERROR (the caller closes)."""
        self.record(refused.events)
        self.traffic(sent=link.write_error(refused.code, refused.message))

    async def carry_out(self, outputs: list[Output]) -> None:
        for output in outputs:
            if isinstance(output, events.Event):
                self.record([output])
                continue
            link = self.links.get(output.peer)
            if link is None:
                continue  # that connection is gone
            match output:
                case Send(msg=msg):
                    self.write(link, msg)
                case ServeSnapshot(step=step):
                    await self._serve_snapshot(link, step)
                case StoreSnapshot(blob=blob):
                    await self._store_snapshot(link, blob)
                case Close(code=code, message=message):
                    # ERROR, then the close: its session ends at the end of its stream
                    self.traffic(sent=link.write_error(code, message))
                    link.writer.close()

    async def _serve_snapshot(self, link: Link, step: int) -> None:
        """Stream the file a piece at a time: one peer never pins a whole snapshot."""
        offload = self.offload
        try:
            f = await offload(open, self.store.snapshot_path(step), "rb")
        except OSError:  # pruned just now by a newer snapshot: the worker asks again
            self.store.forget_snapshot(step)  # or unreadable: never offered again this run
            raise self.core.snapshot_gone(link.peer, step) from None
        name = self.core.name(link.peer)
        with f:
            size = await offload(lambda: os.fstat(f.fileno()).st_size)
            # Lines only: several transfers may run at once, and bars would garble.
            progress = Progress(
                "snapshot upload",
                size,
                "B",
                say=lambda p: log.info("sending snapshot", worker=name, step=step, **p.fields()),
                bar=None,
                quiet_s=TRANSFER_QUIET_S,
            )
            offset = 0
            while True:
                try:
                    piece = await offload(f.read, SNAPSHOT_CHUNK_BYTES)
                except OSError:
                    # The coordinator's disk: the worker, told INTERNAL, rejoins and is
                    # offered an older snapshot (or none) rather than this one in a loop.
                    self.store.forget_snapshot(step)
                    raise self.core.snapshot_gone(link.peer, step) from None
                if not piece and offset:
                    break
                self.write(link, SnapshotChunk(step, size, offset, piece))
                offset += len(piece)
                progress.update(offset)
                await link.drain(name)
                if offset >= size:
                    break
        self.metrics.snapshot_transfers.labels("out").inc()
        log.info("snapshot sent", worker=name, step=step, bytes=size)

    async def _store_snapshot(self, link: Link, blob: bytes) -> None:
        try:
            state = await self.offload(decode_checkpoint, blob)
        except CheckpointError as exc:
            state, error = None, str(exc)
        else:
            error = ""
        rejected = self.core.snapshot_decoded(link.peer, state, error)
        if rejected is not None or state is None:
            self.record([rejected] if rejected is not None else [])
            return
        lineage = self.store.lineage  # what it was checked against: a rewind may follow
        save = self.store.save_snapshot
        try:
            stored = await self.offload(save, state.step, blob, self.keep_snapshots, lineage)
        except SnapshotWriteError as exc:  # the coordinator's disk, not the worker's fault
            self.record([self.core.snapshot_dropped(link.peer, state.step, exc.failure)])
        else:
            if not stored:  # its worker was closed by the rewind: nothing is awaited of it
                reason = "the run rewound while it was being stored"
                self.record([events.SnapshotRejected(self.core.name(link.peer), reason)])
            else:
                self.record([self.core.snapshot_stored(link.peer, state, len(blob))])
        self.record(self.core.store_events())  # digests.log, flushed before the snapshot


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Listener:
    """The coordinator's port, bound before the save directory is touched (a port in use
    must leave nothing behind, so that the corrected command starts afresh) and accepting
    connections only once the coordinator is built (`serve`). OSError when it cannot be
    bound."""

    def __init__(self) -> None:
        self.server: asyncio.Server | None = None
        self.host = ""
        self.asked_for = ""  # the host asked for, when protected mode serves loopback instead
        self._handler: Handler | None = None

    @classmethod
    async def bind(cls, options: Options) -> Listener:
        listener = cls()
        host = options.host
        if not options.run.token and not is_loopback(host):
            listener.asked_for, host = host, "127.0.0.1"  # said when serving starts
        listener.host = host
        listener.server = await asyncio.start_server(
            listener._accept,
            host,
            options.port,
            reuse_address=True,
            ssl=options.tls,
            start_serving=False,
        )
        return listener

    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.sockets[0].getsockname()[1]

    async def serve(self, handler: Handler) -> None:
        assert self.server is not None
        if self.asked_for:  # once the run is open: a run that cannot open says only why
            log.warning(
                "protected mode: no token, so only this machine may connect",
                listening_on=self.host,
                asked_for=self.asked_for,
                hint="to serve the network, give a token with --token-file FILE or "
                "EGGROLL_TOKEN (eggroll-coordinator --new-token makes one)",
            )
        self._handler = handler
        await self.server.start_serving()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert self._handler is not None  # nothing is accepted before `serve`
        await self._handler(reader, writer)


class Coordinator:
    def __init__(
        self,
        store: RunStore,
        options: Options,
        metrics: Metrics | None = None,
        clock: Clock = time.monotonic,
        tracker: Tracker | None = None,
    ) -> None:
        self.store = store
        self.opt = options
        self.metrics = metrics or Metrics()
        self.core = RunCore(store, options.run, clock)
        self.metrics.observe(self.core.status, store.run_id, store.config.digest())
        self.links: dict[int, Link] = {}
        self.executor = Executor(
            self.core,
            self.metrics,
            self.links,
            keep_snapshots=options.keep_snapshots,
            tracker=tracker,
        )
        self.stopping = asyncio.Event()
        self._changed = asyncio.Event()  # something happened that may move a deadline
        self._snapshot_stored = asyncio.Event()
        self._finish_timer: asyncio.TimerHandle | None = None
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task] = set()
        self.fatal: Fatal | None = None  # set when a commit failed: the run must stop

    @property
    def step(self) -> int:
        return self.core.step

    # ------------------------------------------------------------------ lifecycle

    async def run(self, listener: Listener | None = None) -> None:
        """Serve on `listener` (bound here if None) until stopped by a signal or by reaching
        --max-steps, then shut down. Raises Fatal after a failed commit, Halted when results
        differ where no machine can decide (trust.py)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.request_stop)
        if self.store.fitness_log.repaired_bytes:
            log.warning(
                "fitness log tail repaired",
                path=str(self.store.fitness_log.path),
                bytes_cut=self.store.fitness_log.repaired_bytes,
                steps=self.step,
                hint="a step that was being written when the coordinator stopped is redone",
            )
        if self.store.digests_cut:
            log.warning(
                "digests log tail repaired",
                path=str(self.store.layout.digests_log),
                bytes_cut=self.store.digests_cut,
                hint="a digest line being written when the coordinator stopped; workers agree "
                "it again",
            )
        for path, problem in self.store.bad_snapshots:
            log.warning(
                "snapshot unusable",
                path=str(path),
                error=problem,
                serving=self.store.latest_snapshot,
                hint="joiners get an older snapshot (or none) and replay the fitness log; "
                "the file is left for you to look at",
            )
        kept = [h for h in self.core.trust.suspect_hosts if h.startswith(IDENTITY_PREFIXES)]
        if kept and not self.opt.machine_by_certificate:
            log.warning(
                "suspect certificates not applied",
                certificates=len(kept),
                hint="run.json names machines caught lying by their certificates: only "
                "--machine-identity certificate checks them",
            )
        listener = listener or await Listener.bind(self.opt)
        self._server = listener.server
        await listener.serve(self._handle)
        log.info(
            LISTENING,
            host=listener.host,
            tls=self.opt.tls is not None,
            port=listener.port,
            step=self.step,
            run_id=self.store.run_id.hex(),
            config_digest=self.store.config.digest().hex()[:16],
            save_dir=str(self.store.path),
        )
        self.executor.record(self.core.store_events())  # e.g. run.json at start
        self._check_finish()
        self._say_finished_wait(listener)
        deadlines = asyncio.create_task(self._watch_deadlines())
        try:
            await self.stopping.wait()
        finally:
            deadlines.cancel()
            if self._finish_timer is not None:
                self._finish_timer.cancel()
            await self._shutdown()
        if self.fatal is not None:
            raise self.fatal
        if self.core.halted is not None:
            raise Halted(self.core.halted.message)

    def request_stop(self) -> None:
        if not self.stopping.is_set():
            self.stopping.set()
            log.info("stopping", step=self.step)

    def _say_finished_wait(self, listener: Listener) -> None:
        """A run restarted past --max-steps whose final snapshot (or held-out score) is
        missing, a snapshot deleted or unusable: only a worker can rebuild it, so say so
        rather than wait in silence."""
        core = self.core
        if not core.finished or core.done:
            return
        wanted = "snapshot" if core.snapshot.pending(self.step) else "held-out score"
        log.warning(
            "run finished: waiting for a worker",
            step=self.step,
            wants=f"final {wanted}",
            seconds=self.opt.final_snapshot_timeout_s,
            hint=f"every step is in the fitness log; a worker (eggroll-worker "
            f"{listener.host}:{listener.port}) rebuilds the final {wanted} from it, else the "
            "coordinator stops without it when the time is up (exit 0, nothing lost)",
        )

    def _check_finish(self) -> None:
        """--max-steps: stop once the final snapshot is in, or after a bounded wait for it."""
        if self.core.done:
            self.stopping.set()
        elif self.core.finished and self._finish_timer is None:
            self._finish_timer = asyncio.get_running_loop().call_later(
                self.opt.final_snapshot_timeout_s, self.request_stop
            )

    async def _shutdown(self) -> None:
        """Stop accepting, get a last snapshot if cheap, tell workers, drain, cancel."""
        assert self._server is not None
        self._server.close()
        if self.fatal is not None:  # nothing more may be written: drop every peer
            for link in list(self.links.values()):
                link.writer.transport.abort()
            return
        if not self.core.finished and self.store.latest_snapshot != self.step:
            await self._final_snapshot(timeout_s=10.0)
        if self.core.finished and not self.core.done and self.store.latest_snapshot != self.step:
            self._no_final_snapshot()
        message = RUN_COMPLETE if self.core.finished else "coordinator shutting down"
        if self.core.halted is not None:  # the workers wait for the restart that resumes
            message = "coordinator stopped: workers' results differ (see its log)"
        for link in list(self.links.values()):
            with contextlib.suppress(Exception):
                link.writer.write(link.conn.send_error(ErrorCode.SHUTTING_DOWN, message))
                link.writer.close()
        if self._handlers:
            _, pending = await asyncio.wait(self._handlers, timeout=self.opt.drain_timeout_s)
            for task in pending:
                task.cancel(msg="coordinator shutdown: drain timeout exceeded")
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._server.wait_closed(), self.opt.drain_timeout_s)
        log.info("stopped", steps=self.step, latest_snapshot=self.store.latest_snapshot)

    async def _final_snapshot(self, timeout_s: float) -> None:
        """Ask a worker at the current step for its state and wait a bounded time for it. A
        worker not at the step yet (it was applying the step just committed) is asked when it
        gets there, at its next JOB_REQUEST."""
        self._snapshot_stored.clear()
        await self._carry_out(self.core.want_snapshot())
        if not self.core.snapshot.pending(self.step) or not self.core.ready_count():
            return  # nothing to ask for, or nobody to ask
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                while self.store.latest_snapshot != self.step:
                    if not self.core.snapshot.pending(self.step):
                        # A step committed meanwhile: want that one. A dropped snapshot is
                        # not wanted again: no use waiting for it.
                        await self._carry_out(self.core.want_snapshot())
                        if not self.core.snapshot.pending(self.step):
                            break
                    with contextlib.suppress(TimeoutError):  # now and then: asked yet?
                        await asyncio.wait_for(self._snapshot_stored.wait(), 0.2)
                    self._snapshot_stored.clear()
        if self.store.latest_snapshot != self.step:
            self._no_final_snapshot()

    def _no_final_snapshot(self) -> None:
        log.warning(
            "no final snapshot",
            step=self.step,
            hint="nothing is lost: the fitness log holds every step",
        )

    async def _watch_deadlines(self) -> None:
        """Re-queue expired leases at their deadline; woken when a lease may have changed."""
        while True:
            deadline = self.core.next_deadline()
            timeout = None if deadline is None else max(0.0, deadline - self.core.clock())
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout)
            await self._carry_out(self.core.expire())

    # --------------------------------------------------------------- connections

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        peer = writer.get_extra_info("peername")
        address = f"{peer[0]}:{peer[1]}" if peer else "?"
        busy = self._over_cap(peer[0] if peer else "?")
        if busy:
            self.metrics.protocol_errors.labels("BUSY").inc()
            with contextlib.suppress(Exception):
                writer.write(Connection(Role.COORDINATOR).send_error(ErrorCode.BUSY, busy))
                # Its HELLO read first (bounded): a close with it unread resets the
                # connection, and a TLS worker would take that for a certificate refusal.
                await asyncio.wait_for(reader.read(BUSY_READ_BYTES), BUSY_READ_S)
            with contextlib.suppress(Exception):
                writer.close()
            self._handlers.discard(task)
            return
        machine = ""
        if self.opt.machine_by_certificate:  # verified in the handshake (CERT_REQUIRED)
            tls = writer.get_extra_info("ssl_object")
            machine = certificate_identity(tls.getpeercert() if tls is not None else None) or ""
            if not machine:  # never the address instead: the two kinds of key must not mix
                log.error(
                    "a worker's certificate names no identity: connection closed", peer=address
                )
                writer.close()
                self._handlers.discard(task)
                return
        link = Link(
            self.core.connect(address, machine),
            address,
            writer,
            self.metrics,
            self.opt.write_timeout_s,
        )
        self.links[link.peer] = link
        try:
            await self._serve(link, reader)
        except Fatal as exc:
            self.fatal = exc
            log.critical("commit failed", error=str(exc))
            self.request_stop()
        except Refused as exc:
            self.executor.refuse(link, exc)
        except ProtocolError as exc:
            self.metrics.protocol_errors.labels(exc.error_code.name).inc()
            log.warning(
                "protocol error",
                worker=self.core.name(link.peer),
                peer=address,
                code=exc.error_code.name,
                error=exc.message,
            )
            with contextlib.suppress(Exception):
                writer.write(link.conn.error_frame(exc))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except Exception:  # a bug must cost one connection, never the run
            log.exception("session failed", worker=self.core.name(link.peer), peer=address)
            self.core.failed_here(link.peer)  # not the worker's fault: ask it nothing again
            self.executor.traffic(sent=link.write_error(ErrorCode.INTERNAL, "coordinator error"))
        finally:
            self.links.pop(link.peer, None)
            await self._carry_out(self.core.peer_left(link.peer))
            with contextlib.suppress(Exception):
                writer.close()
                await writer.wait_closed()
            self._handlers.discard(task)

    def _over_cap(self, host: str) -> str:
        """Why a new connection from `host` is turned away ("" if it is not)."""
        if len(self.links) >= self.opt.max_connections:
            return f"the coordinator serves at most {self.opt.max_connections} connections"
        same = sum(1 for link in self.links.values() if link.host == host)
        if same >= self.opt.max_connections_per_address:
            return f"at most {self.opt.max_connections_per_address} connections per address"
        return ""

    async def _serve(self, link: Link, reader: asyncio.StreamReader) -> None:
        loop = asyncio.get_running_loop()
        handshake_end = loop.time() + self.opt.handshake_timeout_s
        while not link.conn.closed:
            ready = self.core.peers[link.peer].ready
            timeout = self.opt.idle_timeout_s if ready else handshake_end - loop.time()
            try:
                data = await asyncio.wait_for(reader.read(READ_BYTES), max(timeout, 0.0))
            except TimeoutError:  # workers heartbeat every few seconds: this one is gone
                if not ready:
                    raise Refused(ErrorCode.AUTH_FAILED, "handshake not done in time") from None
                log.warning(
                    "worker silent, dropping it",
                    worker=self.core.name(link.peer),
                    seconds=self.opt.idle_timeout_s,
                )
                return
            if not data:
                return
            self.executor.traffic(received=len(data))
            link.conn.receive_data(data)
            while not link.conn.closed and (msg := link.conn.next_event()) is not None:
                link.count_in()
                await self._carry_out(self.core.receive(link.peer, msg))
                # One reply at a time for a peer that does not read (e.g. a flood of
                # FITNESS_REQUESTs): memory stays bounded, and it is dropped if it stalls.
                await link.drain(self.core.name(link.peer))

    async def _carry_out(self, outputs: list[Output]) -> None:
        await self.executor.carry_out(outputs)
        if any(isinstance(o, StoreSnapshot) for o in outputs):
            self._snapshot_stored.set()  # `_final_snapshot` checks which step it was
        self._changed.set()
        self._check_finish()
        if self.core.halted is not None:  # said once, by the core's event: stop
            self.request_stop()
