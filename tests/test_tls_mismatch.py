"""One side with TLS, the other without: the worker says which flag is missing instead of
reconnecting with misleading reasons (a TLS worker at a plain coordinator leaves in one line;
a plain worker keeps trying, a tunnel's closes look the same), and a plain coordinator says
a peer spoke TLS."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from helpers import TINY_RUN, start_coordinator, start_worker


def _coordinator(spawn: Callable[..., Any], tmp_path: Path, *tls: Path | str) -> tuple[Any, int]:
    """eggroll-coordinator of a tiny run (TLS with `tls` flags); it and its port."""
    config = tmp_path / "tiny.toml"
    config.write_text(TINY_RUN)
    return start_coordinator(spawn, tmp_path / "run", config, *tls)


def test_a_plain_worker_at_a_tls_coordinator_is_told_to_give_tls_ca(
    spawn: Callable[..., Any], words_data: Path, tmp_path: Path, tls_certs: dict
) -> None:
    ca = tls_certs["ca"]
    _, port = _coordinator(spawn, tmp_path, "--tls-cert", ca["srv.pem"], "--tls-key", ca["srv.key"])
    worker = start_worker(spawn, port, words_data)
    said = worker.wait_for(
        lambda e: e.get("event") == "reconnecting" and "if it serves TLS" in e.get("reason", ""),
        90,
        "a reconnect naming TLS",
    )
    assert "--tls-ca" in said["reason"], said  # and it goes on trying (a tunnel may close so)
    assert worker.proc.poll() is None


def test_a_tls_worker_at_a_plain_coordinator_is_told_it_serves_plain_tcp(
    spawn: Callable[..., Any], words_data: Path, tmp_path: Path, tls_certs: dict
) -> None:
    coord, port = _coordinator(spawn, tmp_path)
    worker = start_worker(spawn, port, words_data, "w", "--tls-ca", str(tls_certs["ca"]["ca.pem"]))
    assert worker.wait(90) == 2, "\n".join(worker.lines[-10:])
    assert "answered without TLS: it serves plain TCP" in worker.lines[-1], worker.lines[-1]
    said = coord.wait_for(lambda e: e.get("event") == "protocol error", 30, "protocol error")
    assert "the peer speaks TLS and this side plain TCP" in said["error"], said


class _AlertReader:
    """The read side of a TLS server that answered a plain HELLO with a TLS alert record."""

    def __init__(self) -> None:
        self.sent = False

    async def read(self, n: int) -> bytes:
        if self.sent:
            return b""
        self.sent = True
        return b"\x15\x03\x03\x00\x02\x02\x46"  # alert, TLS 1.2: fatal, protocol_version


async def test_a_tls_alert_in_answer_to_hello_names_the_missing_tls_ca() -> None:
    from eggroll_dist.worker.link import Link, LinkOptions
    from eggroll_dist.worker.session_types import Identity, WorkerFatal

    identity = Identity("w", b"t" * 32, "numpy", "cpu", b"\0" * 32, 256, 1000, "c:1")
    link = Link(LinkOptions(identity), None, _AlertReader(), None)  # type: ignore[arg-type]
    await link._read_loop()
    (item,) = [link.inbox.get_nowait() for _ in range(link.inbox.qsize())]
    assert isinstance(item, WorkerFatal) and "c:1 answered in TLS" in str(item)
    assert "--tls-ca" in str(item)


def test_a_refused_connection_to_another_machine_names_the_loopback_only_coordinator() -> None:
    from types import SimpleNamespace

    from eggroll_dist.worker.client import WorkerClient

    refused = ConnectionRefusedError(111, "Connection refused")
    far = WorkerClient._hint(SimpleNamespace(host="10.0.0.5"), refused)  # type: ignore[arg-type]
    assert "listens on 127.0.0.1 only" in far and "--token-file" in far
    for host in ("127.0.0.1", "localhost", "::1"):
        assert WorkerClient._hint(SimpleNamespace(host=host), refused) == ""  # type: ignore[arg-type]
    assert WorkerClient._hint(SimpleNamespace(host="10.0.0.5"), TimeoutError()) == ""  # type: ignore[arg-type]
