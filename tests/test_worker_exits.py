"""A worker never waits in silence: a finished run, a peer that is not a coordinator and a
host name that does not resolve each end it with one line, within a bounded time."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from helpers import SMALL_RUN, command, start_coordinator, start_worker

from eggroll_dist.shared.data import load_data_dir
from eggroll_dist.worker.client import WorkerClient, WorkerFatal


def _worker(address: str, data_dir: Path, *extra: str, timeout: float):
    """Run eggroll-worker to its end: (exit code, stderr lines, seconds)."""
    t0 = time.monotonic()
    done = subprocess.run(
        [
            command("eggroll-worker"),
            address,
            "--data-dir",
            str(data_dir),
            "--log-format",
            "text",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        # one try of a second per lookup: a slow resolver must not outlast the test's bounds
        env={**os.environ, "RES_OPTIONS": "timeout:1 attempts:1"},
    )
    return done.returncode, done.stderr.strip().splitlines(), time.monotonic() - t0


def test_workers_exit_0_when_the_run_is_complete(spawn, words_data: Path, tmp_path: Path) -> None:
    config = tmp_path / "fast.toml"
    config.write_text(SMALL_RUN)
    coord, port = start_coordinator(spawn, tmp_path / "run", config, "--max-steps", "2")
    worker = start_worker(spawn, port, words_data)
    assert coord.wait(120) == 0
    t0 = time.monotonic()
    assert worker.wait(30) == 0
    assert time.monotonic() - t0 < 30
    stopped = worker.wait_for(lambda e: e.get("event") == "stopped", 5)
    assert "is complete" in stopped["reason"]
    assert worker.count(lambda e: e.get("event") == "reconnecting") == 0


@contextmanager
def loopback_peer(answer: bytes | None) -> Iterator[int]:
    """A peer on loopback, its port: it reads what each connection sends first, answers
    `answer` and closes; or, with None, keeps every connection open and never writes."""
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()
    held: list[socket.socket] = []

    def serve() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            if answer is None:
                held.append(conn)
                continue
            with conn:
                conn.settimeout(5)
                conn.recv(4096)
                conn.sendall(answer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        thread.join(5)
        for conn in held:
            conn.close()
        server.close()


@pytest.fixture
def http_responder() -> Iterator[int]:
    """A tiny HTTP server that answers whatever it is sent with a 400, as web servers do."""
    with loopback_peer(b"HTTP/1.0 400 Bad Request\r\nContent-Length: 0\r\n\r\n") as port:
        yield port


def test_an_http_peer_is_named_at_once(http_responder: int, words_data: Path) -> None:
    code, lines, seconds = _worker(f"127.0.0.1:{http_responder}", words_data, timeout=30)
    assert code == 2, lines
    assert seconds < 20
    assert "answered in HTTP" in lines[-1] and "12345" in lines[-1]
    assert not any("reconnecting" in line for line in lines)


@pytest.fixture
def silent_listener() -> Iterator[int]:
    """A peer that never answers: a web server waiting for a request line. (`python -m
    http.server` is not that for sure: HELLO's length bytes, which follow the host name and
    pid in the worker's name, are a newline now and then; that completes a request line and
    draws an error page.)"""
    with loopback_peer(None) as port:
        yield port


def test_a_silent_peer_is_named_after_the_hello_deadline(
    silent_listener: int, words_data: Path
) -> None:
    client = WorkerClient(
        "127.0.0.1",
        silent_listener,
        load_data_dir(words_data),
        hello_timeout_s=1.0,
        max_retry_s=0.2,
    )
    t0 = time.monotonic()
    with pytest.raises(WorkerFatal, match="said nothing for 1 s after HELLO"):
        asyncio.run(asyncio.wait_for(client.run(), 20))
    assert time.monotonic() - t0 < 10


def test_an_unresolvable_host_name_gives_up_with_a_hint(words_data: Path) -> None:
    code, lines, seconds = _worker(
        "no-such-host.invalid", words_data, "--max-retry-s", "0.1", timeout=60
    )
    assert code == 2, lines
    assert seconds < 45
    assert "cannot resolve the host name 'no-such-host.invalid'" in lines[-1]
    assert "IP address" in lines[-1]
