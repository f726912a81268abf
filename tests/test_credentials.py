"""One vote per machine by credential: a worker enrolled by name (`eggroll-coordinator --enrol
NAME`) proves that name, and its connections are one machine in the checks whatever their
addresses. Against a real coordinator, a Sybil holding one credential and connecting from
two addresses cannot outvote two honest credentials on one address."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import Proc
from helpers import (
    TINY_RUN,
    command,
    digest_at,
    start_coordinator,
    start_worker,
    trained_digest,
)

from eggroll_dist.protocol.security import auth_mac, verify_mac, worker_credential

TOKEN = b"credential-tests-token-0123456789"
STEPS = 30  # long enough for the Sybil, joining late, to vote


def test_a_credential_proves_its_name_and_not_the_token() -> None:
    alice = worker_credential(TOKEN, "alice")
    assert alice is not None and len(alice) == 64 and alice != TOKEN
    assert alice == worker_credential(TOKEN, "alice")  # the coordinator derives it again
    assert alice != worker_credential(TOKEN, "bob")
    assert alice != worker_credential(TOKEN + b"x", "alice")  # another run's token
    nonce = b"\1" * 32
    assert verify_mac(alice, nonce, auth_mac(alice, nonce))
    assert not verify_mac(worker_credential(TOKEN, "bob"), nonce, auth_mac(alice, nonce))
    for bad in ("", "a b", "x" * 65, "é"):
        assert worker_credential(TOKEN, bad) is None
    assert worker_credential(b"", "alice") is None  # protected mode: no credentials


def enrol(name: str, where: Path) -> Path:
    """`eggroll-coordinator --enrol NAME`'s credential in a file only its owner reads."""
    done = subprocess.run(
        [command("eggroll-coordinator"), "--enrol", name],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    credential = done.stdout.splitlines()[0]
    assert credential.encode() == worker_credential(TOKEN, name)
    assert f"--name {name} --token-file {name}.credential" in done.stdout
    path = where / f"{name}.credential"
    path.write_text(credential + "\n")
    path.chmod(0o600)
    return path


# A real worker that binds its connection to the address SOURCE and flips every fitness it
# reports (replaying the log, it applies the run's steps like anyone).
SYBIL = """
import asyncio, sys
import numpy as np
from eggroll_dist.worker.backend import ChunkResult, numpy_backend
from eggroll_dist.worker.cli import main
SOURCE = sys.argv.pop(1)
connect = asyncio.open_connection
asyncio.open_connection = lambda *a, **k: connect(*a, local_addr=(SOURCE, 0), **k)
real = numpy_backend.NumpyBackend.evaluate_chunks
def lie(self, step, chunks):
    made_up = lambda r: ChunkResult(np.where(r.fitness == 1, -1, 1).astype(np.int8), r.loss_sum)
    return [made_up(r) for r in real(self, step, chunks)]
numpy_backend.NumpyBackend.evaluate_chunks = lie
sys.exit(main())
"""


def test_a_sybil_with_two_addresses_and_one_credential_loses_every_vote(
    spawn: Callable[..., Any],
    tmp_path: Path,
    words_data: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("EGGROLL_TOKEN", TOKEN.decode())  # the coordinator's (and --enrol's)
    config, save = tmp_path / "run.toml", tmp_path / "run"
    config.write_text(TINY_RUN)
    files = {name: enrol(name, tmp_path) for name in ("h1", "h2", "sybil")}
    monkeypatch.delenv("EGGROLL_TOKEN")  # workers hold their credentials only
    coord, port = start_coordinator(
        spawn, save, config, "--verify-fraction", "1", "--max-steps", str(STEPS),
        "--token-file", _token_file(tmp_path),
    )  # fmt: skip

    def sybil(source: str) -> Proc:
        flags = ("--data-dir", str(words_data), "--name", "sybil", "--log-format", "json")
        more = ("--max-retry-s", "1", "--token-file", str(files["sybil"]))
        args = [sys.executable, "-c", SYBIL, source, f"127.0.0.1:{port}", *flags, *more]
        return Proc(args, f"sybil@{source}")

    for name in ("h1", "h2"):
        start_worker(spawn, port, words_data, name, "--token-file", str(files[name]))
    coord.wait_for(lambda e: e.get("event") == "step", 60, "a first step")
    sybils = [sybil(source) for source in ("127.0.0.2", "127.0.0.3")]
    try:
        outvoted = coord.wait_for(lambda e: e.get("event") == "worker outvoted", 60, "outvoted")
        assert outvoted["worker"] == "sybil"
        assert coord.wait(180) == 0
    finally:
        for s in sybils:
            s.stop()
    joined = [e for e in coord.events if e.get("event") == "worker joined"]
    assert {e["machine"] for e in joined} == {"worker:h1", "worker:h2", "worker:sybil"}
    shared = coord.wait_for(lambda e: e.get("event") == "one certificate from several addresses")
    assert shared["machine"] == "worker:sybil"
    losers = {e["worker"] for e in coord.events if e.get("event") == "worker outvoted"}
    assert losers == {"sybil"}
    # Every step is the honest workers': the run ends where one process alone ends.
    assert digest_at(save, STEPS) == trained_digest(words_data, config, STEPS)


def _token_file(where: Path) -> Path:
    path = where / "run.token"
    path.write_text(TOKEN.decode() + "\n")
    path.chmod(0o600)
    return path
