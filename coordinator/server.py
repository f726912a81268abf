"""The coordinator server: the lifecycle and the sockets around the pure run core.

Every rule of protocol/SPEC.md §8 lives in `run.py`. This file starts the listener, runs one
read task per worker connection (bytes -> `Connection` -> `RunCore.receive` -> write what it
returns), reads and writes snapshot files off the event loop, and shuts down in order: stop
accepting, ask for a last snapshot, tell every worker, wait a bounded time, cancel the rest.
All run state is touched from the event loop only, so no locks are needed.

Every peer is bounded: a cap on connections (in all and per address), a deadline for the
handshake, and bounded writes (`link.py`). A failed commit (`Fatal`) stops the coordinator
at once: nothing after it is trusted to reach the disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import ssl
import time
from dataclasses import dataclass

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
from ..protocol.security import is_loopback
from ..shared.logs import LISTENING
from ..shared.replica import CheckpointError, decode_checkpoint
from .link import Link
from .metrics import Metrics
from .run import Command, Fatal, Refused, RunCore, Send, ServeSnapshot, StoreSnapshot
from .store import RunStore

log = structlog.get_logger("eggroll.coordinator")

READ_BYTES = 1 << 16


@dataclass
class Options:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    token: bytes = b""  # none: protected mode, loopback peers only
    tls: ssl.SSLContext | None = None
    data_digest: bytes | None = None  # from the operator (--data-dir, --data-digest)
    max_steps: int | None = None
    snapshot_every: int = 100  # 0: only the final snapshot
    sample_every: int = 0  # 0: no samples
    keep_snapshots: int = 3
    chunk_timeout_s: float | None = None  # None: adapted to observed chunk times
    final_snapshot_timeout_s: float = 120.0
    drain_timeout_s: float = 5.0
    idle_timeout_s: float = 60.0  # a connection silent this long is dropped
    handshake_timeout_s: float = 10.0  # from accept to WELCOME
    write_timeout_s: float = 30.0  # a peer must read what it is sent within this
    max_connections: int = 256
    max_connections_per_address: int = 32


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
        self.metrics = metrics or Metrics()
        self.core = RunCore(
            store,
            token=options.token,
            data_digest=options.data_digest,
            max_steps=options.max_steps,
            snapshot_every=options.snapshot_every,
            sample_every=options.sample_every,
            chunk_timeout_s=options.chunk_timeout_s,
            metrics=self.metrics,
            clock=clock,
        )
        self.links: dict[int, Link] = {}
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

    async def run(self) -> None:
        """Serve until stopped by a signal or by reaching --max-steps, then shut down.
        Raises Fatal after a failed commit."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.request_stop)
        if self.store.fitness_log.repaired_bytes:
            log.warning(
                "fitness log tail repaired",
                bytes_cut=self.store.fitness_log.repaired_bytes,
                steps=self.step,
                hint="a step that was being written when the coordinator stopped is redone",
            )
        host = self.opt.host
        if not self.opt.token and not is_loopback(host):
            log.warning(
                "protected mode: no token, so only this machine may connect",
                listening_on="127.0.0.1",
                asked_for=host,
                hint="to serve the network, give a token with --token-file FILE or "
                "EGGROLL_TOKEN (eggroll-coordinator --new-token makes one)",
            )
            host = "127.0.0.1"
        self._server = await asyncio.start_server(
            self._handle, host, self.opt.port, reuse_address=True, ssl=self.opt.tls
        )
        port = self._server.sockets[0].getsockname()[1]
        log.info(
            LISTENING,
            host=host,
            tls=self.opt.tls is not None,
            port=port,
            step=self.step,
            run_id=self.store.run_id.hex(),
            config_digest=self.store.config.digest().hex()[:16],
            save_dir=str(self.store.path),
        )
        self._check_finish()
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

    def request_stop(self) -> None:
        if not self.stopping.is_set():
            self.stopping.set()
            log.info("stopping", step=self.step)

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
        message = RUN_COMPLETE if self.core.finished else "coordinator shutting down"
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
        """Ask a worker at the current step for its state and wait a bounded time for it."""
        self._snapshot_stored.clear()
        commands = self.core.want_snapshot()
        if not commands and self.core.snapshot_source is None:
            return
        await self._carry_out(commands)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                while self.store.latest_snapshot != self.step:
                    await self._snapshot_stored.wait()
                    self._snapshot_stored.clear()
        if self.store.latest_snapshot != self.step:
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
                writer.close()
            self._handlers.discard(task)
            return
        link = Link(
            self.core.connect(address), address, writer, self.metrics, self.opt.write_timeout_s
        )
        self.links[link.peer] = link
        try:
            await self._serve(link, reader)
        except Fatal as exc:
            self.fatal = exc
            log.critical("commit failed", error=str(exc))
            self.request_stop()
        except Refused as exc:
            self.core.traffic(sent=link.write_error(exc.code, exc.message))
        except ProtocolError as exc:
            self.metrics.protocol_errors.labels(exc.error_code.name).inc()
            log.warning(
                "protocol error",
                worker=self._name(link),
                peer=address,
                code=exc.error_code.name,
                error=exc.message,
            )
            with contextlib.suppress(Exception):
                writer.write(link.conn.error_frame(exc))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except Exception:  # a bug must cost one connection, never the run
            log.exception("session failed", worker=self._name(link), peer=address)
            self.core.traffic(sent=link.write_error(ErrorCode.INTERNAL, "coordinator error"))
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
                    worker=self._name(link),
                    seconds=self.opt.idle_timeout_s,
                )
                return
            if not data:
                return
            self.core.traffic(received=len(data))
            link.conn.receive_data(data)
            while not link.conn.closed and (msg := link.conn.next_event()) is not None:
                link.count_in()
                await self._carry_out(self.core.receive(link.peer, msg))
                # One reply at a time for a peer that does not read (e.g. a flood of
                # FITNESS_REQUESTs): memory stays bounded, and it is dropped if it stalls.
                await link.drain(self._name(link))

    def _name(self, link: Link) -> str:
        peer = self.core.peers.get(link.peer)
        return peer.name if peer is not None else "?"

    def _write(self, link: Link, msg: Message) -> None:
        self.core.traffic(sent=link.write(msg))

    # ------------------------------------------------------------------ commands

    async def _carry_out(self, commands: list[Command]) -> None:
        for command in commands:
            link = self.links.get(command.peer)
            if link is None:
                continue  # that connection is gone
            match command:
                case Send(msg=msg):
                    self._write(link, msg)
                case ServeSnapshot(step=step):
                    await self._serve_snapshot(link, step)
                case StoreSnapshot(blob=blob):
                    await self._store_snapshot(link, blob)
        self._changed.set()
        self._check_finish()

    async def _serve_snapshot(self, link: Link, step: int) -> None:
        """Stream the file a piece at a time: one peer never pins a whole snapshot."""
        try:
            f = await asyncio.to_thread(open, self.store.snapshot_path(step), "rb")
        except OSError:  # pruned just now by a newer snapshot: the worker asks again
            raise self.core.snapshot_gone(link.peer, step) from None
        with f:
            size = await asyncio.to_thread(lambda: os.fstat(f.fileno()).st_size)
            offset = 0
            while True:
                piece = await asyncio.to_thread(f.read, SNAPSHOT_CHUNK_BYTES)
                if not piece and offset:
                    break
                self._write(link, SnapshotChunk(step, size, offset, piece))
                offset += len(piece)
                await link.drain(self._name(link))
                if offset >= size:
                    break
        self.core.snapshot_served(link.peer, step, size)

    async def _store_snapshot(self, link: Link, blob: bytes) -> None:
        try:
            state = await asyncio.to_thread(decode_checkpoint, blob)
        except CheckpointError as exc:
            self.core.snapshot_decoded(link.peer, None, str(exc))
            return
        if not self.core.snapshot_decoded(link.peer, state):
            return
        await asyncio.to_thread(self.store.save_snapshot, state.step, blob, self.opt.keep_snapshots)
        self.core.snapshot_stored(link.peer, state, len(blob))
        self._snapshot_stored.set()
