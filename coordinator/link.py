"""The I/O half of one worker connection: framing out, counting bytes, bounded draining.

A `Link` writes what the run core returns through the connection's state machine, counts
the bytes for the metrics, and waits for a peer to read only once more than
`WRITE_HIGH_BYTES` are queued for it, at most `write_timeout_s`: a peer that does not read
is dropped, so no peer can make the coordinator buffer without bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import Counter
from dataclasses import dataclass, field

import structlog

from ..protocol import Connection, ErrorCode, LocalProtocolError, Message, Role
from .metrics import Metrics

log = structlog.get_logger("eggroll.coordinator")

WRITE_HIGH_BYTES = 1 << 20  # queued for one peer beyond this, wait for it to read


@dataclass(eq=False)
class Link:
    peer: int
    address: str
    writer: asyncio.StreamWriter
    metrics: Metrics
    write_timeout_s: float
    conn: Connection = field(default_factory=lambda: Connection(Role.COORDINATOR))
    counted_in: Counter = field(default_factory=Counter)  # bytes received, per type, counted
    bytes_out: int = 0  # written, for the run core's per-step traffic figures

    def __post_init__(self) -> None:
        sock = self.writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # drain() waits only above this: `drain` bounds that wait with the write timeout.
        self.writer.transport.set_write_buffer_limits(high=WRITE_HIGH_BYTES)

    @property
    def host(self) -> str:
        return self.address.rsplit(":", 1)[0]

    def write(self, msg: Message) -> int:
        """Frame and queue `msg`; returns the bytes queued (0 once the connection closes)."""
        try:
            data = self.conn.send(msg)
        except LocalProtocolError:
            return 0  # closing: the connection's state machine allows nothing more
        self.writer.write(data)
        self.metrics.network_bytes.labels("out", msg.TYPE.name).inc(len(data))
        return len(data)

    def write_error(self, code: ErrorCode, message: str) -> int:
        with contextlib.suppress(Exception):
            data = self.conn.send_error(code, message)
            self.writer.write(data)
            self.metrics.network_bytes.labels("out", "ERROR").inc(len(data))
            return len(data)
        return 0

    def count_in(self) -> None:
        """Add the bytes of newly decoded messages to the per-type network counter."""
        for msg_type, total in self.conn.bytes_received.items():
            new = total - self.counted_in[msg_type]
            if new:
                self.metrics.network_bytes.labels("in", msg_type.name).inc(new)
                self.counted_in[msg_type] = total

    async def drain(self, name: str) -> None:
        """Wait for the peer to read, if enough is queued; drop it if it does not."""
        if self.writer.transport.get_write_buffer_size() <= WRITE_HIGH_BYTES:
            return  # drain() would not wait: below the transport's high-water mark
        try:
            await asyncio.wait_for(self.writer.drain(), self.write_timeout_s)
        except TimeoutError:
            log.warning(
                "worker not reading, dropping it",
                worker=name,
                queued_bytes=self.writer.transport.get_write_buffer_size(),
                seconds=self.write_timeout_s,
            )
            self.writer.transport.abort()
            raise ConnectionResetError("peer not reading") from None
