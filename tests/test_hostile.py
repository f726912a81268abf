"""Hostile peers against a real coordinator on loopback: each attack of the security review
is refused, and an honest worker still finishes the run at the undisturbed replica digest."""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Proc
from helpers import (
    TINY_RUN,
    Peer,
    command,
    digest_at,
    inspect_run,
    start_coordinator,
    start_worker,
    trained_digest,
)

from eggroll_dist.protocol import (
    LATEST_SNAPSHOT,
    Auth,
    Challenge,
    Connection,
    Error,
    ErrorCode,
    FitnessRequest,
    Hello,
    Job,
    JobRequest,
    Message,
    MsgType,
    Result,
    Role,
    SnapshotChunk,
    SnapshotRequest,
    Step,
    Welcome,
)
from eggroll_dist.protocol.frames import HEADER, MAGIC, PROTOCOL_VERSION
from eggroll_dist.shared.config import load_config
from eggroll_dist.shared.data import load_data_dir
from eggroll_dist.shared.replica import ReplicaState
from eggroll_dist.worker.backend.numpy_backend import NumpyBackend
from eggroll_dist.worker.train import train

STEPS = 6
TOKEN = "hostile-tests-token-0123456789"


@pytest.fixture(scope="module")
def config_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hostile") / "run.toml"
    path.write_text(TINY_RUN)  # four chunks of 4 pairs a step: milliseconds
    return path


@pytest.fixture(scope="module")
def undisturbed(config_file: Path, words_data: Path) -> str:
    """The replica digest after STEPS steps with nobody interfering."""
    cfg = load_config(config_file)
    backend = NumpyBackend(load_data_dir(words_data), ReplicaState.initial(cfg))
    return train(cfg, backend, STEPS).state.digest_hex()


@pytest.fixture
def token_env(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("EGGROLL_TOKEN", TOKEN)  # inherited by every spawned process
    return TOKEN


def start_run(spawn, save_dir: Path, config: Path, *extra: str | Path):
    """A coordinator that stops after STEPS steps."""
    return start_coordinator(spawn, save_dir, config, "--max-steps", str(STEPS), *extra)


def final_digest(save_dir: Path) -> str:
    info = inspect_run(save_dir)
    assert info["step"] == STEPS
    return info["digests"][str(STEPS)]


def finishes_undisturbed(coord, save_dir: Path, undisturbed: str) -> None:
    assert coord.wait(120) == 0
    assert final_digest(save_dir) == undisturbed


@pytest.fixture
def peers() -> Iterator[list[Peer]]:
    made: list[Peer] = []
    yield made
    for p in made:
        p.close()


def data_digest(words_data: Path) -> bytes:
    return load_data_dir(words_data).digest


# ----------------------------------------------------------------------------- E1, E13


def test_e1_without_a_token_only_loopback_is_served(
    spawn, tmp_path: Path, config_file: Path, words_data: Path, undisturbed: str, monkeypatch
) -> None:
    monkeypatch.delenv("EGGROLL_TOKEN", raising=False)
    coord, port = start_run(spawn, tmp_path / "run", config_file, "--host", "0.0.0.0")
    listening = coord.wait_for(lambda e: e.get("event") == "listening")
    assert listening["host"] == "127.0.0.1"  # protected mode: never the network
    warning = coord.wait_for(lambda e: "protected mode" in str(e.get("event")))
    assert "--token-file" in json.dumps(warning) and "EGGROLL_TOKEN" in json.dumps(warning)
    start_worker(spawn, port, words_data)
    finishes_undisturbed(coord, tmp_path / "run", undisturbed)


def test_e13_the_token_is_never_on_a_command_line(
    spawn, tmp_path: Path, config_file: Path, words_data: Path, undisturbed: str, monkeypatch
) -> None:
    monkeypatch.delenv("EGGROLL_TOKEN", raising=False)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    coord, port = start_run(
        spawn, tmp_path / "run", config_file, "--host", "127.0.0.1", "--token-file", token_file
    )
    cmdline = Path(f"/proc/{coord.proc.pid}/cmdline").read_bytes()
    assert TOKEN.encode() not in cmdline
    worker = spawn(
        "eggroll-worker",
        f"127.0.0.1:{port}",
        "--data-dir",
        words_data,
        "--token-file",
        token_file,
        "--log-format",
        "json",
    )
    assert TOKEN.encode() not in Path(f"/proc/{worker.proc.pid}/cmdline").read_bytes()
    finishes_undisturbed(coord, tmp_path / "run", undisturbed)
    # A short or world-readable token is one clear line, exit 2.
    token_file.chmod(0o644)
    refused = subprocess.run(
        [
            command("eggroll-coordinator"),
            "--save-dir",
            str(tmp_path / "other"),
            "--token-file",
            str(token_file),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2 and "chmod 600" in refused.stderr
    assert "Traceback" not in refused.stderr


# ---------------------------------------------------------------------------- E2, L5


def test_e2_results_without_a_lease_are_refused(
    spawn, peers, tmp_path: Path, config_file: Path, words_data: Path, undisturbed: str, token_env
) -> None:
    coord, port = start_run(spawn, tmp_path / "run", config_file)
    intruder = Peer(port)
    peers.append(intruder)
    assert isinstance(intruder.join(token_env, data_digest(words_data)), Welcome)
    forged = Result.from_values(
        step=0, chunk=0, loss_sum=0, weights_changed=0, replica_digest=0, fitness=[1] * 4
    )
    intruder.send(forged)
    answer = intruder.until(Step)
    assert isinstance(answer, Error) and "not leased" in answer.message
    assert intruder.receive() is None  # and the connection is closed
    start_worker(spawn, port, words_data)
    finishes_undisturbed(coord, tmp_path / "run", undisturbed)


def test_e2_impossible_loss_is_refused(
    spawn, peers, tmp_path: Path, config_file: Path, words_data: Path, undisturbed: str, token_env
) -> None:
    coord, port = start_run(spawn, tmp_path / "run", config_file)
    intruder = Peer(port)
    peers.append(intruder)
    intruder.join(token_env, data_digest(words_data))
    intruder.send(JobRequest(0))
    job = intruder.until(Job)
    assert isinstance(job, Job), job
    intruder.send(
        Result.from_values(
            step=0,
            chunk=job.chunk,
            loss_sum=-(10**15),
            weights_changed=0,
            replica_digest=0,
            fitness=[1] * 4,
        )
    )
    answer = intruder.until(Step)
    assert isinstance(answer, Error) and "loss" in answer.message
    start_worker(spawn, port, words_data)
    finishes_undisturbed(coord, tmp_path / "run", undisturbed)


# -------------------------------------------------------------------------------- E3


def test_e3_one_false_digest_report_neither_halts_nor_diverges_the_run(
    spawn, peers, tmp_path: Path, config_file: Path, words_data: Path, undisturbed: str, token_env
) -> None:
    coord, port = start_run(spawn, tmp_path / "run", config_file)
    insider = Peer(port)
    peers.append(insider)
    insider.join(token_env, data_digest(words_data))
    stop = threading.Event()

    def lie() -> None:  # answer every STEP at once with a made-up digest of the next state
        while not stop.is_set():
            msg = insider.receive()
            if msg is None:
                return
            if isinstance(msg, Step):
                insider.send(JobRequest(msg.step + 1, 0xDEADBEEF))

    threading.Thread(target=lie, daemon=True).start()
    insider.send(JobRequest(0, ReplicaState.initial(load_config(config_file)).digest()))
    workers = [start_worker(spawn, port, words_data, f"honest{i}") for i in range(2)]
    finishes_undisturbed(coord, tmp_path / "run", undisturbed)
    stop.set()
    for w in workers:
        assert w.count(lambda e: "diverged" in json.dumps(e).lower()) == 0
    digests = (tmp_path / "run" / "digests.log").read_text()
    assert "deadbeef" not in digests  # a minority report is never the run's


# ------------------------------------------------------------------------------- E15

# A real worker whose backend makes up every fitness value it reports (replaying the log,
# it applies the run's steps like anyone).
LIAR = """
import sys
import numpy as np
from eggroll_dist.worker.backend import ChunkResult, numpy_backend
from eggroll_dist.worker.cli import main
real = numpy_backend.NumpyBackend.evaluate_chunks
def lie(self, step, chunks):
    made_up = lambda r: ChunkResult(np.where(r.fitness == 1, -1, 1).astype(np.int8), r.loss_sum)
    return [made_up(r) for r in real(self, step, chunks)]
numpy_backend.NumpyBackend.evaluate_chunks = lie
sys.exit(main())
"""


def test_e15_a_worker_that_makes_up_its_fitness_is_outvoted(
    spawn, tmp_path: Path, config_file: Path, words_data: Path, token_env
) -> None:
    """Every chunk checked: a worker that joins a running run and makes up its fitness
    loses its votes to the two honest workers and is dropped (each time it comes back, until
    it gives up), and the fitness log stays the one the honest workers make alone."""
    save = tmp_path / "run"
    coord, port = start_coordinator(spawn, save, config_file, "--verify-fraction", "1")
    for i in range(2):
        start_worker(spawn, port, words_data, f"honest{i}")
    coord.wait_for(lambda e: e.get("event") == "step" and e["step"] >= 2, 60, "step 2")
    flags = ("--data-dir", str(words_data), "--name", "liar", "--log-format", "json")
    liar = Proc([sys.executable, "-c", LIAR, f"127.0.0.1:{port}", *flags], "liar")
    try:
        outvoted = coord.wait_for(lambda e: e.get("event") == "worker outvoted", 60, "outvoted")
        assert outvoted["worker"] == "liar"
        later = outvoted["step"] + 3
        coord.wait_for(lambda e: e.get("event") == "step" and e["step"] >= later, 60, "steps")
        liar.wait_for(lambda e: e.get("event") == "replica dropped", 30, "DIVERGED")
        # Rebuilt from the run's log, it lies again and is outvoted again: after the third
        # time in a row it stops, saying why, instead of resyncing forever.
        assert liar.wait(120) == 3
        assert "computes differently" in liar.lines[-1]
    finally:
        liar.stop()
        coord.stop()
    assert digest_at(save, later) == trained_digest(words_data, config_file, later)


# -------------------------------------------------------------------------------- E4
# -------------------------------------------------------------------------------- E4


def test_e4_the_data_digest_comes_from_the_operator(
    spawn, peers, tmp_path: Path, config_file: Path, words_data: Path, undisturbed: str, token_env
) -> None:
    coord, port = start_run(spawn, tmp_path / "run", config_file, "--data-dir", words_data)
    intruder = Peer(port)
    peers.append(intruder)
    answer = intruder.join(token_env, b"\x42" * 32)
    assert isinstance(answer, Error) and answer.code == ErrorCode.DATA_MISMATCH
    assert "42424242" in answer.message and data_digest(words_data).hex()[:16] in answer.message
    start_worker(spawn, port, words_data)
    finishes_undisturbed(coord, tmp_path / "run", undisturbed)


def test_e4_without_the_operator_two_workers_must_agree(
    spawn, peers, tmp_path: Path, config_file: Path, words_data: Path, undisturbed: str, token_env
) -> None:
    coord, port = start_run(spawn, tmp_path / "run", config_file)
    intruder = Peer(port)
    peers.append(intruder)
    intruder.join(token_env, b"\x42" * 32)  # first, but alone: adopts nothing
    intruder.close()
    for i in range(2):
        start_worker(spawn, port, words_data, f"honest{i}")
    finishes_undisturbed(coord, tmp_path / "run", undisturbed)
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    # The run may end before the second worker joins: then nothing is settled, and never
    # the first comer's digest.
    assert run["data_digest"] in (None, data_digest(words_data).hex())


# -------------------------------------------------------------------------- E5 (H3, M2)


def test_e5_unauthenticated_peers_get_no_memory_and_no_time(
    spawn, tmp_path: Path, config_file: Path, words_data: Path, undisturbed: str, token_env
) -> None:
    coord, port = start_run(
        spawn, tmp_path / "run", config_file, "--max-connections", "8",
        "--handshake-timeout-s", "1",
    )  # fmt: skip
    # A 16 MiB HELLO is refused from its header, before anything is buffered.
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(HEADER.pack(MAGIC, PROTOCOL_VERSION, MsgType.HELLO, 0, 2**24, 0))
        reply = sock.recv(1 << 16)
        assert reply[5] == MsgType.ERROR
    # Idle connections fill the cap: the next one is turned away at once.
    idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(8)]
    with socket.create_connection(("127.0.0.1", port), timeout=10) as extra:
        assert extra.recv(1 << 16)[5:6] == bytes([MsgType.ERROR])
    # The handshake deadline closes them all, HEARTBEATs or not.
    t0 = time.monotonic()
    for sock in idle:
        sock.settimeout(15)
        while sock.recv(1 << 16):
            pass
        sock.close()
    assert time.monotonic() - t0 < 10
    start_worker(spawn, port, words_data)
    finishes_undisturbed(coord, tmp_path / "run", undisturbed)


# --------------------------------------------------------------------------- E6 (H4)


def test_e6_a_peer_that_never_reads_is_dropped(
    spawn, peers, tmp_path: Path, config_file: Path, words_data: Path, undisturbed: str, token_env
) -> None:
    coord, port = start_run(
        spawn, tmp_path / "run", config_file, "--write-timeout-s", "2", "--snapshot-every", "2"
    )
    start_worker(spawn, port, words_data)
    coord.wait_for(lambda e: e.get("event") == "snapshot stored", 60)
    flooder = Peer(port)
    peers.append(flooder)
    flooder.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    flooder.join(token_env, data_digest(words_data))
    # 2,000 requests in one write, and never a read: each asks for a whole snapshot.
    asks = [FitnessRequest(0, 4096), SnapshotRequest(LATEST_SNAPSHOT)] * 1000
    flooder.sock.sendall(b"".join(flooder.conn.send(m) for m in asks))
    coord.wait_for(lambda e: e.get("worker") == "intruder" and "not reading" in e["event"], 30)
    finishes_undisturbed(coord, tmp_path / "run", undisturbed)


# --------------------------------------------------------------------------- E7 (H1, M1)


def test_e7_unrequested_or_oversized_snapshots_are_refused(
    spawn, peers, tmp_path: Path, config_file: Path, words_data: Path, undisturbed: str, token_env
) -> None:
    coord, port = start_run(spawn, tmp_path / "run", config_file, "--snapshot-every", "2")
    forger = Peer(port)
    peers.append(forger)
    forger.join(token_env, data_digest(words_data))
    forger.send(SnapshotChunk(2, 2**63, 0, b"x" * 1024))  # never asked for
    answer = forger.until(Step)
    assert isinstance(answer, Error) and answer.code == ErrorCode.ILLEGAL_STATE
    start_worker(spawn, port, words_data)
    finishes_undisturbed(coord, tmp_path / "run", undisturbed)
    info = json.loads(
        subprocess.run(
            [command("eggroll-inspect"), str(tmp_path / "run"), "--json"],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
    )
    assert info["snapshots"], "the honest worker's snapshots were stored"
    for snap in info["snapshots"]:  # each one is the run's agreed state at its step
        assert snap["ok"] and snap["digest"] == info["digests"][str(snap["step"])]


# --------------------------------------------------------------------------- E8 (L1)


def test_e8_worker_text_cannot_write_terminal_escapes(
    spawn, peers, tmp_path: Path, config_file: Path, words_data: Path, undisturbed: str, token_env
) -> None:
    coord = spawn(
        "eggroll-coordinator", "--save-dir", tmp_path / "run", "--config", config_file,
        "--port", "0", "--metrics-port", "0", "--max-steps", str(STEPS), "--log-format", "text",
    )  # fmt: skip
    port = None
    deadline = time.monotonic() + 30
    while port is None and time.monotonic() < deadline:
        for line in list(coord.lines):
            if "listening" in line and "port=" in line:
                port = int(line.split("port=")[1].split()[0])
        time.sleep(0.1)
    assert port is not None, coord.lines
    evil = Peer(port)
    peers.append(evil)
    evil.join("wrong-token-but-long-enough", data_digest(words_data), name="\x1b]0;pwned\x07x")
    start_worker(spawn, port, words_data)
    assert coord.wait(120) == 0
    text = "\n".join(coord.lines)
    assert "pwned" in text and "\x1b" not in text and "\x07" not in text


# -------------------------------------------------------------------------------- E9, E10


def _spawn_limited(save: Path, config: Path, fsize: int) -> subprocess.Popen:
    """A coordinator whose files may not grow past `fsize` bytes (RLIMIT_FSIZE)."""

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past it fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    return subprocess.Popen(
        [
            command("eggroll-coordinator"),
            "--save-dir",
            str(save),
            "--config",
            str(config),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--max-steps",
            str(STEPS),
            "--log-format",
            "json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=limit,
    )


def test_e9_append_failure_is_fail_stop(
    spawn, tmp_path: Path, config_file: Path, words_data: Path, undisturbed: str, token_env
) -> None:
    save = tmp_path / "run"
    coord, _ = start_run(spawn, save, config_file)
    coord.stop()  # the save dir exists, with an empty log
    header = (save / "fitness.log").stat().st_size
    record = 8 + 4 + 4 + 4  # step, length, 16 pairs packed in 4 bytes, CRC
    limited = _spawn_limited(save, config_file, header + 3 * record + 10)
    port = None
    assert limited.stdout is not None
    for line in limited.stdout:
        event = json.loads(line)
        if event.get("event") == "listening":
            port = event["port"]
            break
    assert port is not None
    worker = start_worker(spawn, port, words_data)
    out, _ = limited.communicate(timeout=60)
    assert limited.returncode not in (0, None)
    last = out.strip().splitlines()[-1]  # the one line a person (or systemd's log) sees
    assert last.startswith("Error: cannot commit step 3") and "fitness.log" in last
    assert "Traceback" not in out
    # systemd would restart it: the torn tail is cut and the run goes on to the end.
    again, port = start_run(spawn, save, config_file)
    again.wait_for(lambda e: e.get("event") == "listening")
    worker.stop()
    start_worker(spawn, port, words_data, "honest2")
    finishes_undisturbed(again, save, undisturbed)


def test_e10_a_zero_filled_last_record_is_repaired(
    spawn, tmp_path: Path, config_file: Path, words_data: Path, undisturbed: str, token_env
) -> None:
    save = tmp_path / "run"
    coord, port = start_run(spawn, save, config_file)
    start_worker(spawn, port, words_data)
    assert coord.wait(120) == 0
    log = save / "fitness.log"
    data = log.read_bytes()
    record = 8 + 4 + 4 + 4
    log.write_bytes(data[:-record] + bytes(record))  # step 5's record: zeros on disk
    (save / "digests.log").write_bytes((save / "digests.log").read_bytes() + b"9 00000000")
    again, port = start_run(spawn, save, config_file)
    repaired = again.wait_for(lambda e: "repaired" in json.dumps(e), 30)
    assert repaired is not None
    start_worker(spawn, port, words_data, "honest2")
    finishes_undisturbed(again, save, undisturbed)


# ------------------------------------------------------------------------- E11 (M7, H6)


class Impostor:
    """A fake coordinator that accepts any MAC, then sends what the test gives it."""

    def __init__(self, then: list[Message], on_snapshot_request: list[Message] = ()) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.then = then
        self.on_snapshot_request = list(on_snapshot_request)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        sock, _ = self.server.accept()
        conn = Connection(Role.COORDINATOR)
        with sock:
            try:
                while True:
                    data = sock.recv(1 << 16)
                    if not data:
                        return
                    conn.receive_data(data)
                    while (msg := conn.next_event()) is not None:
                        if isinstance(msg, Hello):
                            sock.sendall(conn.send(Challenge(os.urandom(32))))
                        elif isinstance(msg, Auth):
                            for out in self.then:
                                sock.sendall(conn.send(out))
                        elif isinstance(msg, SnapshotRequest):
                            for out in self.on_snapshot_request:
                                sock.sendall(conn.send(out))
            except Exception:
                return


def _worker_against(port: int, data_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            command("eggroll-worker"),
            f"127.0.0.1:{port}",
            "--data-dir",
            str(data_dir),
            "--log-format",
            "json",
            "--max-retry-s",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_e11_an_impostor_cannot_crash_or_swell_a_worker(
    words_data: Path, config_file: Path, token_env
) -> None:
    nested = Impostor([Welcome(bytes(16), b"[" * 60000, 0, -1, 16)])
    done = _worker_against(nested.port, words_data)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "RecursionError" not in done.stderr and "nest too deeply" in done.stderr
    # A snapshot announced far larger than any checkpoint of the run: refused at once.
    cfg = load_config(config_file)
    welcome = Welcome(bytes(16), cfg.canonical_bytes(), 5, 5, cfg.pairs)
    huge = Impostor([welcome], [SnapshotChunk(5, 2**40, 0, bytes(1 << 20))])
    worker = subprocess.Popen(
        [
            command("eggroll-worker"),
            f"127.0.0.1:{huge.port}",
            "--data-dir",
            str(words_data),
            "--log-format",
            "json",
            "--max-retry-s",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert worker.stdout is not None
        for line in worker.stdout:
            if "snapshot of 1099511627776 bytes" in line:
                break
        else:
            raise AssertionError("the worker did not refuse the snapshot")
    finally:
        worker.kill()
        worker.wait(10)


# ------------------------------------------------------------------------------ H6: TLS


def test_tls_run_and_a_worker_with_the_wrong_ca_is_refused(
    spawn, tmp_path: Path, config_file: Path, words_data: Path, undisturbed: str, token_env,
    tls_certs,
) -> None:  # fmt: skip
    ca, other = tls_certs["ca"], tls_certs["other"]
    coord, port = start_run(
        spawn, tmp_path / "run", config_file, "--tls-cert", ca["srv.pem"], "--tls-key",
        ca["srv.key"], "--tls-client-ca", ca["ca.pem"], "--machine-identity", "certificate",
    )  # fmt: skip

    def worker(trust: dict[str, Path], mine: dict[str, Path]) -> list[str]:
        return [
            command("eggroll-worker"), f"127.0.0.1:{port}", "--data-dir", str(words_data),
            "--tls-ca", str(trust["ca.pem"]), "--tls-cert", str(mine["cli.pem"]),
            "--tls-key", str(mine["cli.key"]), "--log-format", "json", "--max-retry-s", "1",
        ]  # fmt: skip

    # The worker does not trust the coordinator's CA: it refuses it, one line, exit 2.
    wrong = subprocess.run(worker(other, ca), capture_output=True, text=True, timeout=60)
    assert wrong.returncode == 2 and "certificate" in wrong.stderr
    assert "Traceback" not in wrong.stderr
    # The coordinator does not trust the worker's certificate: refused as well, however
    # the refusal arrives (an alert, a close or a reset before any frame).
    stranger = subprocess.run(worker(ca, other), capture_output=True, text=True, timeout=60)
    assert stranger.returncode == 2 and "Traceback" not in stranger.stderr
    assert "does not accept this worker's certificate" in stranger.stderr or (
        "refused this worker" in stranger.stderr
    )
    # Plain TCP to a TLS coordinator gets nothing.
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(
            Connection(Role.WORKER).send(
                Hello(PROTOCOL_VERSION, "plain", "numpy", "cpu", bytes(32))
            )
        )
        sock.settimeout(10)
        try:
            assert MAGIC not in sock.recv(1 << 16)
        except (ConnectionResetError, TimeoutError):
            pass
    spawn("eggroll-worker", *worker(ca, ca)[1:])
    # Its machine in the checks is its certificate's (CN=cli), not its address.
    coord.wait_for(
        lambda e: e.get("event") == "worker joined" and e.get("machine") == "cn:cli",
        60,
        "a join by certificate",
    )
    finishes_undisturbed(coord, tmp_path / "run", undisturbed)


def test_machines_by_certificate_need_mutual_tls(tmp_path: Path, config_file: Path) -> None:
    done = subprocess.run(
        [
            command("eggroll-coordinator"), "--save-dir", str(tmp_path / "run"), "--config",
            str(config_file), "--port", "0", "--metrics-port", "0", "--machine-identity",
            "certificate",
        ],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and "needs mutual TLS" in done.stderr
    assert "Traceback" not in done.stderr


# ---------------------------------------------------------------------------- E12, E14


def test_e12_a_second_coordinator_on_the_same_save_dir_is_refused(
    spawn, tmp_path: Path, config_file: Path, words_data: Path, undisturbed: str, token_env
) -> None:
    coord, port = start_run(spawn, tmp_path / "run", config_file)
    second = subprocess.run(
        [
            command("eggroll-coordinator"),
            "--save-dir",
            str(tmp_path / "run"),
            "--port",
            "0",
            "--metrics-port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert second.returncode != 0, second.stderr
    assert f"process {coord.proc.pid} is writing to {tmp_path / 'run'}" in second.stderr
    assert "Traceback" not in second.stderr
    start_worker(spawn, port, words_data)
    finishes_undisturbed(coord, tmp_path / "run", undisturbed)


def test_e14_an_unusable_save_dir_is_one_line(tmp_path: Path, config_file: Path) -> None:
    (tmp_path / "run" / ".lock").mkdir(parents=True)  # what an immutable directory refuses
    (tmp_path / "file").write_text("")
    for save_dir in (tmp_path / "run", tmp_path / "file" / "run"):
        done = subprocess.run(
            [
                command("eggroll-coordinator"),
                "--save-dir",
                str(save_dir),
                "--config",
                str(config_file),
                "--port",
                "0",
                "--metrics-port",
                "0",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 1 and len(lines) == 1 and "cannot use --save-dir" in lines[0]
