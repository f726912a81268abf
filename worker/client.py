"""The worker's I/O shell: connect and reconnect with backoff; each connection's frames,
heartbeats and the pure session's (`session.py`) commands are a `Link`'s.

One connection at a time is a `Link` (`link.py`); this module dials, gives up on what no
retry can fix (a host name that never resolves), and reconnects with jittered backoff. The
replica (`replica.py`) outlives connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import random
import socket
import ssl
from pathlib import Path

import structlog

from ..protocol import (
    clip_utf8,
)
from ..protocol.messages import MAX_WORKER_NAME_BYTES
from ..shared.data import Dataset
from .backend import Backend, BackendFactory, get_backend
from .link import PLAIN_REPLIES, Link, LinkOptions, Outcome, describe
from .replica import Replica
from .session_types import COMPUTES_DIFFERENTLY, Identity, WorkerFatal

__all__ = ["WorkerClient", "WorkerFatal", "default_worker_name"]

log = structlog.get_logger("eggroll.worker")

INITIAL_RETRY_S = 0.2
# A connection that stayed up this long resets the backoff; one dropped sooner (a coordinator
# that accepts and then fails at once) keeps growing it.
STABLE_CONNECTION_S = 10.0
RESOLVE_ATTEMPTS = 8  # host-name lookups failed in a row before giving up (~25 s of backoff)
# DIVERGED this many times in a row, with no step this worker scored committed in between:
# a replica rebuilt from the run's own log still disagrees, so this worker's arithmetic
# differs from the run's (another version, a faulty device); resyncing again will not help.
DIVERGED_ATTEMPTS = 3


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
        goal_dir: Path | None = None,
        reward_timeout_s: float = 120.0,
    ) -> None:
        self.host = host
        self.port = port
        self.tls = tls
        self.tls_refusals = 0  # TLS connections closed in a row before any frame
        self.dataset = dataset
        factory = backend or get_backend("numpy")
        self.name = default_worker_name() if name is None else name
        where = f"{host}:{port}"
        self.identity = Identity.of(self.name, token, factory, dataset, where)
        self.replica = Replica(
            dataset, factory, goal_dir=goal_dir, reward_timeout_s=reward_timeout_s
        )
        self.max_retry_s = max_retry_s
        self.heartbeat_s = heartbeat_s
        self.reply_timeout_s = reply_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.hello_timeout_s = hello_timeout_s  # a coordinator answers HELLO at once
        self.connections = 0  # handshakes completed
        self.resolve_failures = 0  # host-name lookups failed in a row
        self.diverged = 0  # DIVERGED in a row (see DIVERGED_ATTEMPTS)
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
            if isinstance(exc, ssl.SSLError) and (exc.reason or "") in PLAIN_REPLIES:
                # Its answer to our handshake was no TLS record: it serves plain TCP.
                raise WorkerFatal(
                    f"TLS: {self.host}:{self.port} answered without TLS: it serves plain TCP "
                    "(drop --tls-ca from this worker, or start the coordinator with "
                    "--tls-cert/--tls-key)"
                ) from None
            self._count_resolve_failure(exc)
            # A coordinator that refuses a certificate accepts TCP: refusals must come in a
            # row, not across restarts of a coordinator that was down in between.
            self.tls_refusals = 0
            return (
                f"cannot connect to {self.host}:{self.port}: {describe(exc)}{self._hint(exc)}",
                0.0,
            )
        self.resolve_failures = 0
        sock = writer.get_extra_info("socket")
        if sock is not None:
            # Small request/reply frames: no Nagle delay. Keepalive finds a dead peer.
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        options = LinkOptions(
            identity=self.identity,
            tls=self.tls is not None,
            heartbeat_s=self.heartbeat_s,
            reply_timeout_s=self.reply_timeout_s,
            hello_timeout_s=self.hello_timeout_s,
            tls_refusals=self.tls_refusals,
        )
        outcome = await Link(options, self.replica, reader, writer, self._welcomed).run()
        if outcome.heard:
            self.tls_refusals = 0
        if outcome.tls_refused:
            self.tls_refusals += 1
        self._count_divergence(outcome)
        return outcome.reason, outcome.ready_s

    def _hint(self, exc: BaseException) -> str:
        """The likely cause of a refused connection to another machine: a coordinator
        started without a token listens on loopback only."""
        if not isinstance(exc, ConnectionRefusedError) or _is_loopback(self.host):
            return ""
        return (
            " (is a coordinator running there? One started without --token-file listens on "
            "127.0.0.1 only: give it --token-file, and this worker the same token)"
        )

    def _welcomed(self) -> None:
        self.connections += 1

    def _count_divergence(self, outcome: Outcome) -> None:
        if outcome.confirmed:
            self.diverged = 0
        self.diverged += outcome.diverged
        if self.diverged >= DIVERGED_ATTEMPTS:
            raise WorkerFatal(
                f"the coordinator found this worker's replica or fitness wrong {self.diverged} "
                "times in a row, each time after it was rebuilt from the run's log: this "
                "worker computes differently from the others (another eggroll-distributed "
                "version or backend, or a faulty device); compare `pip show "
                "eggroll-distributed` and the backend with a worker that agrees",
                status=COMPUTES_DIFFERENTLY,
            )

    def _count_resolve_failure(self, exc: BaseException) -> None:
        """Give up on a host name that does not resolve RESOLVE_ATTEMPTS times in a row: a
        typo does not fix itself, and retrying forever would hide it."""
        if not isinstance(exc, socket.gaierror):
            self.resolve_failures = 0
            return
        self.resolve_failures += 1
        if self.resolve_failures >= RESOLVE_ATTEMPTS:
            raise WorkerFatal(
                f"cannot resolve the host name {self.host!r} ({describe(exc)}), "
                f"{self.resolve_failures} tries in a row: check its spelling and this host's "
                "DNS, or give the coordinator's IP address"
            )


def _is_loopback(host: str) -> bool:
    """Whether `host` names this machine (a loopback name or address)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
