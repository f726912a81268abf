"""Shared fixtures: a small data directory, and real subprocesses whose log lines tests wait on."""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# Test files share `helpers.py` (pytest's importlib mode puts no test folder on the path).
sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import command, words_data_dir


@pytest.fixture(scope="session")
def words_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small byte-level data directory with some structure to learn."""
    return words_data_dir(tmp_path_factory.mktemp("words"))


class Proc:
    """A real subprocess; its stderr (JSON log lines) is collected for waiting on."""

    def __init__(self, args: list[str], name: str):
        self.name = name
        self.proc = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[str] = []
        self.events: list[dict[str, Any]] = []
        self._cond = threading.Condition()
        self._eof = False
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip())
                try:
                    event = json.loads(line)
                    if isinstance(event, dict):
                        self.events.append(event)
                except ValueError:
                    pass
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def wait_for(
        self, match: Callable[[dict[str, Any]], bool], timeout: float = 60.0, what: str = "event"
    ) -> dict[str, Any]:
        """The first logged event that matches, waiting for it up to `timeout` seconds."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for event in self.events:
                    if match(event):
                        return event
                left = deadline - time.monotonic()
                if left <= 0 or self._eof:
                    raise AssertionError(
                        f"{self.name}: no {what} within {timeout} s; log tail:\n"
                        + "\n".join(self.lines[-25:])
                    )
                self._cond.wait(min(left, 0.5))

    def count(self, match: Callable[[dict[str, Any]], bool]) -> int:
        with self._cond:
            return sum(1 for e in self.events if match(e))

    def wait(self, timeout: float = 60.0) -> int:
        """Its exit code, once its last lines are read too (a test reads them next)."""
        code = self.proc.wait(timeout)
        deadline = time.monotonic() + 10  # a child that inherited its stdout may hold it
        with self._cond:
            while not self._eof and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
        return code

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


@pytest.fixture
def spawn() -> Iterator[Callable[..., Proc]]:
    """Start real processes; every one is stopped when the test ends."""
    procs: list[Proc] = []

    def start(name: str, *args: str | Path) -> Proc:
        p = Proc([command(name), *map(str, args)], name)
        procs.append(p)
        return p

    yield start
    for p in reversed(procs):
        p.stop()


def make_ca_and_certs(out: Path, name: str) -> dict[str, Path]:
    """A CA, and a server certificate (for 127.0.0.1 and localhost) and a client certificate
    signed by it: the five openssl commands deploy/README.md shows."""
    out.mkdir(parents=True, exist_ok=True)
    p = {k: out / f"{name}-{k}" for k in ("ca.key", "ca.pem", "srv.key", "srv.pem", "cli.key")}
    p["cli.pem"] = out / f"{name}-cli.pem"
    ext = out / f"{name}-san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")

    def run(args: str) -> None:
        subprocess.run(["openssl", *shlex.split(args)], check=True, capture_output=True)

    key = "-newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes"
    run(f"req -x509 {key} -keyout {p['ca.key']} -out {p['ca.pem']} -days 2 -subj /CN={name}")
    for who in ("srv", "cli"):
        csr = out / f"{name}-{who}.csr"
        run(f"req {key} -keyout {p[who + '.key']} -out {csr} -subj /CN={who}")
        run(
            f"x509 -req -in {csr} -CA {p['ca.pem']} -CAkey {p['ca.key']} -CAcreateserial "
            f"-out {p[who + '.pem']} -days 2 -extfile {ext}"
        )
    return p


@pytest.fixture(scope="session")
def tls_certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Path]]:
    """Two unrelated CAs ("ca" and "other"), each with a server and a client certificate."""
    out = tmp_path_factory.mktemp("tls")
    return {name: make_ca_and_certs(out, name) for name in ("ca", "other")}
