"""The worker's session flow (SPEC §8) against a scripted coordinator on loopback.

The fake coordinator is the sans-I/O Connection(Role.COORDINATOR) on an asyncio server;
each test plays the coordinator's side message by message. Expected replica digests come
from `replay`, the single-process reference.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest
import structlog
from helpers import words_data_dir

from eggroll_dist.protocol import (
    LATEST_SNAPSHOT,
    PROTOCOL_VERSION,
    Connection,
    ErrorCode,
    Message,
    RemoteProtocolError,
    Role,
    encode_message,
    iter_snapshot_chunks,
    messages,
    pack_ternary,
    verify_mac,
)
from eggroll_dist.protocol.errors import ADDRESS_OUTVOTED
from eggroll_dist.protocol.ternary import unpack_ternary
from eggroll_dist.shared.config import ESConfig, ModelConfig, RunConfig
from eggroll_dist.shared.data import Dataset, load_data_dir
from eggroll_dist.shared.replica import ReplicaState, decode_checkpoint, encode_checkpoint
from eggroll_dist.shared.replica import replay as replay_steps
from eggroll_dist.worker.backend import (
    Backend,
    BackendFactory,
    BackendUnavailable,
    ChunkResult,
    cuda_usable,
    get_backend,
)
from eggroll_dist.worker.backend.numpy_backend import NumpyBackend
from eggroll_dist.worker.client import DIVERGED_ATTEMPTS, WorkerClient, WorkerFatal
from eggroll_dist.worker.link import TLS_REFUSALS, Link, LinkOptions
from eggroll_dist.worker.replica import Replica
from eggroll_dist.worker.session_types import Ended, Identity

CFG = RunConfig(
    model=ModelConfig(n_layer=1, d_model=16), es=ESConfig(population=16, chunk_size=8, seq_len=8)
)
PAIRS = CFG.pairs
RUN_ID = bytes(range(16))
TIMEOUT_S = 5.0  # every single wait in these tests
M = TypeVar("M", bound=Message)


def replay(state: ReplicaState, packed: list[bytes]) -> ReplicaState:
    """The replica after the logged (packed) fitness of each step."""
    return replay_steps(state, [unpack_ternary(p, state.config.pairs) for p in packed])


def fitness(step: int) -> np.ndarray:
    """A fixed, step-dependent ternary fitness vector for the whole population."""
    return np.array([(i * 5 + step * 3) % 3 - 1 for i in range(PAIRS)], dtype=np.int8)


PACKED = [pack_ternary(fitness(s)) for s in range(4)]
INITIAL = ReplicaState.initial(CFG)


def state_at(step: int) -> ReplicaState:
    return replay(INITIAL, PACKED[:step])


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return words_data_dir(tmp_path_factory.mktemp("data"), docs=20, words=200)


@pytest.fixture(scope="module")
def dataset(data_dir: Path) -> Dataset:
    return load_data_dir(data_dir)


# --- the scripted coordinator -------------------------------------------------------------


class Peer:
    """The coordinator's end of one worker connection."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.conn = Connection(Role.COORDINATOR)

    async def recv(self, heartbeats: bool = False) -> Message | None:
        """Next message (HEARTBEATs only if asked); None when the worker closed the connection."""
        while True:
            msg = self.conn.next_event()
            if msg is None:
                data = await asyncio.wait_for(self.reader.read(1 << 16), TIMEOUT_S)
                if not data:
                    return None
                self.conn.receive_data(data)
            elif heartbeats or not isinstance(msg, messages.Heartbeat):
                return msg

    async def expect(self, cls: type[M]) -> M:
        msg = await self.recv()
        assert isinstance(msg, cls), f"expected {cls.__name__}, got {msg!r}"
        return msg

    async def send(self, msg: Message) -> None:
        self.writer.write(self.conn.send(msg))
        await self.writer.drain()

    async def send_error(self, code: ErrorCode, text: str = "") -> None:
        self.writer.write(self.conn.send_error(code, text))
        await self.writer.drain()
        self.close()

    async def handshake(
        self,
        current_step: int = 0,
        snapshot_step: int = -1,
        run_id: bytes = RUN_ID,
        token: bytes = b"",
        config_bytes: bytes | None = None,
    ) -> messages.Hello:
        hello = await self.expect(messages.Hello)
        nonce = os.urandom(32)
        await self.send(messages.Challenge(nonce))
        auth = await self.expect(messages.Auth)
        assert verify_mac(token, nonce, auth.mac)
        config = CFG.canonical_bytes() if config_bytes is None else config_bytes
        await self.send(messages.Welcome(run_id, config, current_step, snapshot_step, PAIRS))
        return hello

    async def closed(self) -> bool:
        """Whether the worker closes the connection (after anything but heartbeats)."""
        try:
            return await self.recv() is None
        except (ConnectionError, RemoteProtocolError):
            return True

    def close(self) -> None:
        self.writer.close()


class FakeCoordinator:
    def __init__(self) -> None:
        self.peers: asyncio.Queue[Peer] = asyncio.Queue()
        self.all: list[Peer] = []
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self, port: int = 0) -> None:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", port)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = Peer(reader, writer)
        self.all.append(peer)
        await self.peers.put(peer)

    async def next_peer(self) -> Peer:
        return await asyncio.wait_for(self.peers.get(), TIMEOUT_S)

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()
        for peer in self.all:
            peer.close()
        await self.server.wait_closed()


@pytest.fixture
async def coordinator() -> AsyncIterator[FakeCoordinator]:
    fake = FakeCoordinator()
    await fake.start()
    yield fake
    await fake.close()


def make_client(fake: FakeCoordinator, dataset: Dataset, **kwargs: object) -> WorkerClient:
    kwargs.setdefault("name", "w1")
    kwargs.setdefault("max_retry_s", 0.05)
    kwargs.setdefault("backend", get_backend("numpy", 8, threads=1))  # a chunk per request
    return WorkerClient("127.0.0.1", fake.port, dataset, **kwargs)  # type: ignore[arg-type]


async def wait_until(condition: Callable[[], bool]) -> None:
    """Poll a condition the event loop makes true, for at most TIMEOUT_S."""
    async with asyncio.timeout(TIMEOUT_S):
        while not condition():
            await asyncio.sleep(0.01)


@asynccontextmanager
async def running(client: WorkerClient) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(client.run())
    try:
        yield task
    finally:
        client.stop()
        await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), TIMEOUT_S)


# --- tests ----------------------------------------------------------------------------------


async def test_job_then_step(coordinator: FakeCoordinator, dataset: Dataset) -> None:
    client = make_client(coordinator, dataset, token="s3cret")
    async with running(client):
        peer = await coordinator.next_peer()
        hello = await peer.handshake(token=b"s3cret")
        assert (hello.protocol_version, hello.worker_name, hello.backend, hello.device) == (
            PROTOCOL_VERSION,
            "w1",
            "numpy",
            "cpu",
        )
        assert hello.data_digest == dataset.digest
        assert await peer.expect(messages.JobRequest) == messages.JobRequest(0, INITIAL.digest(), 0)

        await peer.send(messages.Job(0, 1, 8, 8))
        result = await peer.expect(messages.Result)
        reference = NumpyBackend(dataset, INITIAL).evaluate_chunk(0, 8, 8)
        assert (result.step, result.chunk, result.pair_count) == (0, 1, 4)
        assert result.fitness_values().tolist() == reference.fitness.tolist()
        assert result.loss_sum == reference.loss_sum
        assert (result.replica_digest, result.weights_changed) == (INITIAL.digest(), 0)

        assert await peer.expect(messages.JobRequest) == messages.JobRequest(0, INITIAL.digest(), 0)
        await peer.send(messages.Wait(60_000))
        await peer.send(
            messages.Job(0, 0, 0, 8)
        )  # a re-queued chunk, pushed unasked during the WAIT
        assert (await peer.expect(messages.Result)).chunk == 0
        assert await peer.expect(messages.JobRequest) == messages.JobRequest(0, INITIAL.digest(), 0)
        # The step commits; that request stays unanswered (the STEP overtook it), and the
        # worker asks again once it has applied the step.
        await peer.send(messages.Step.from_values(0, fitness(0)))
        request = await peer.expect(messages.JobRequest)
        changed = NumpyBackend(dataset, INITIAL).apply_step(fitness(0))
        assert request == messages.JobRequest(1, state_at(1).digest(), changed)
        assert client.backend is not None and client.backend.step == 1


async def test_long_chunk_heartbeats_and_a_step_that_overtakes_it(
    coordinator: FakeCoordinator, dataset: Dataset
) -> None:
    release = threading.Event()

    class Held(NumpyBackend):
        def evaluate_chunks(
            self, step: int, chunks: Sequence[tuple[int, int]]
        ) -> list[ChunkResult]:
            assert release.wait(TIMEOUT_S)
            return super().evaluate_chunks(step, chunks)

    held = BackendFactory("numpy", "cpu", lambda data, state: Held(data, state, threads=1))
    client = make_client(coordinator, dataset, backend=held, heartbeat_s=0.02)
    async with running(client):
        peer = await coordinator.next_peer()
        await peer.handshake()
        await peer.expect(messages.JobRequest)
        await peer.send(messages.Job(0, 0, 0, 8))
        for _ in range(3):  # the connection stays alive while the chunk runs
            assert isinstance(await peer.recv(heartbeats=True), messages.Heartbeat)
        # Another worker's copy of the chunk completed the step: its result is not needed.
        await peer.send(messages.Step.from_values(0, fitness(0)))
        release.set()
        # Usually no RESULT comes first. If the chunk ended before the STEP was read, a stale
        # RESULT and a JOB_REQUEST for step 0 may (the coordinator drops or ignores them).
        # Then the replica moves on to step 1.
        request = await peer.recv()
        for _ in range(2):
            stale_result = isinstance(request, messages.Result) and request.step == 0
            stale_request = isinstance(request, messages.JobRequest) and request.replica_step == 0
            if not (stale_result or stale_request):
                break
            request = await peer.recv()
        assert isinstance(request, messages.JobRequest)
        assert (request.replica_step, request.replica_digest) == (1, state_at(1).digest())


async def test_a_pass_far_longer_than_usual_is_reported_then_warned_about(
    dataset: Dataset,
) -> None:
    """A pass of chunks still running is reported now and then; once it has run far longer
    than this replica's usual pass, as on a hung device, the report is a warning."""
    release = threading.Event()
    release.set()

    class Held(NumpyBackend):
        def evaluate_chunks(
            self, step: int, chunks: Sequence[tuple[int, int]]
        ) -> list[ChunkResult]:
            assert release.wait(TIMEOUT_S)
            return super().evaluate_chunks(step, chunks)

    held = BackendFactory("numpy", "cpu", lambda data, state: Held(data, state, threads=1))
    replica = Replica(dataset, held, watch_s=0.02, hung_s=0.3)
    replica.open()
    try:
        await replica.start(CFG, RUN_ID)
        await replica.evaluate(0, [(0, 8)])  # the usual pass: quick
        release.clear()
        with structlog.testing.capture_logs() as logs:
            running = asyncio.create_task(replica.evaluate(0, [(8, 8)]))
            await wait_until(lambda: any(e["log_level"] == "warning" for e in logs))
            release.set()
            await running
        said = [e for e in logs if e["event"] == "still evaluating"]
        assert said[0]["log_level"] == "info" and "usual_s" in said[0]
        assert said[-1]["log_level"] == "warning" and "hung" in said[-1]["hint"]
    finally:
        replica.close()


async def test_catch_up_from_the_fitness_log(
    coordinator: FakeCoordinator, dataset: Dataset
) -> None:
    async with running(make_client(coordinator, dataset)):
        peer = await coordinator.next_peer()
        await peer.handshake(current_step=3)
        request = await peer.expect(messages.FitnessRequest)
        assert request.first_step == 0 and request.max_steps >= 1
        # The answer may hold fewer steps than asked: the worker asks again from where it is.
        await peer.send(messages.FitnessRange.from_steps(0, PAIRS, PACKED[0:2]))
        assert (await peer.expect(messages.FitnessRequest)).first_step == 2
        await peer.send(messages.FitnessRange.from_steps(2, PAIRS, PACKED[2:3]))
        request = await peer.expect(messages.JobRequest)
        assert (request.replica_step, request.replica_digest) == (3, state_at(3).digest())


async def test_stale_job_request_and_a_step_from_the_future(
    coordinator: FakeCoordinator, dataset: Dataset
) -> None:
    async with running(make_client(coordinator, dataset)):
        peer = await coordinator.next_peer()
        await peer.handshake(current_step=0)
        assert (await peer.expect(messages.JobRequest)).replica_step == 0
        # The run moved on meanwhile: the coordinator answers with the missing steps.
        await peer.send(messages.FitnessRange.from_steps(0, PAIRS, PACKED[0:1]))
        request = await peer.expect(messages.JobRequest)
        assert (request.replica_step, request.replica_digest) == (1, state_at(1).digest())
        # A JOB for an older step is not evaluated (no RESULT follows), and a STEP beyond the
        # replica ends the WAIT at once: the worker catches up through FITNESS_REQUEST.
        await peer.send(messages.Job(0, 0, 0, 8))
        await peer.send(messages.Wait(60_000))
        await peer.send(messages.Step.from_values(2, fitness(2)))
        assert (await peer.expect(messages.FitnessRequest)).first_step == 1
        await peer.send(messages.FitnessRange.from_steps(1, PAIRS, PACKED[1:3]))
        request = await peer.expect(messages.JobRequest)
        assert (request.replica_step, request.replica_digest) == (3, state_at(3).digest())


async def test_catch_up_from_a_snapshot(coordinator: FakeCoordinator, dataset: Dataset) -> None:
    client = make_client(coordinator, dataset)
    async with running(client):
        peer = await coordinator.next_peer()
        await peer.handshake(current_step=3, snapshot_step=2)
        assert (await peer.expect(messages.SnapshotRequest)).step == LATEST_SNAPSHOT
        blob = encode_checkpoint(state_at(2))
        chunks = list(iter_snapshot_chunks(2, blob, chunk_bytes=len(blob) // 4 + 1))
        assert len(chunks) >= 4
        for chunk in chunks:
            await peer.send(chunk)
        assert (await peer.expect(messages.FitnessRequest)).first_step == 2
        await peer.send(messages.FitnessRange.from_steps(2, PAIRS, PACKED[2:3]))
        request = await peer.expect(messages.JobRequest)
        assert (request.replica_step, request.replica_digest) == (3, state_at(3).digest())


async def test_a_corrupt_snapshot_falls_back_to_the_fitness_log(
    coordinator: FakeCoordinator, dataset: Dataset
) -> None:
    async with running(make_client(coordinator, dataset)):
        peer = await coordinator.next_peer()
        await peer.handshake(current_step=2, snapshot_step=2)
        await peer.expect(messages.SnapshotRequest)
        blob = bytearray(encode_checkpoint(state_at(2)))
        blob[len(blob) // 2] ^= 0xFF
        for chunk in iter_snapshot_chunks(2, bytes(blob), chunk_bytes=1000):
            await peer.send(chunk)
        assert (await peer.expect(messages.FitnessRequest)).first_step == 0
        await peer.send(messages.FitnessRange.from_steps(0, PAIRS, PACKED[0:2]))
        request = await peer.expect(messages.JobRequest)
        assert (request.replica_step, request.replica_digest) == (2, state_at(2).digest())


async def test_worker_streams_its_state_on_request(
    coordinator: FakeCoordinator, dataset: Dataset
) -> None:
    async with running(make_client(coordinator, dataset)):
        peer = await coordinator.next_peer()
        await peer.handshake(current_step=1)
        await peer.expect(messages.FitnessRequest)
        await peer.send(messages.FitnessRange.from_steps(0, PAIRS, PACKED[0:1]))
        request = await peer.expect(messages.JobRequest)
        await peer.send(messages.SnapshotRequest(1))
        parts = []
        while True:
            chunk = await peer.expect(messages.SnapshotChunk)
            assert chunk.step == 1 and chunk.offset == sum(map(len, parts))
            parts.append(chunk.data)
            if chunk.is_last:
                break
        state = decode_checkpoint(b"".join(parts))
        assert state.step == 1 and state.digest() == request.replica_digest
        assert state.digest() == state_at(1).digest()


async def test_reconnect_keeps_the_replica(coordinator: FakeCoordinator, dataset: Dataset) -> None:
    client = make_client(coordinator, dataset)
    async with running(client):
        peer = await coordinator.next_peer()
        await peer.handshake(current_step=2)
        await peer.expect(messages.FitnessRequest)
        await peer.send(messages.FitnessRange.from_steps(0, PAIRS, PACKED[0:2]))
        first = await peer.expect(messages.JobRequest)
        assert (first.replica_step, first.replica_digest) == (2, state_at(2).digest())

        peer.close()  # the connection drops
        peer = await coordinator.next_peer()
        await peer.handshake(current_step=2)
        assert await peer.expect(messages.JobRequest) == first  # no catch-up needed

        await peer.send_error(ErrorCode.SHUTTING_DOWN, "bye")  # a coordinator restart
        peer = await coordinator.next_peer()
        await peer.handshake(current_step=2)
        assert await peer.expect(messages.JobRequest) == first
        assert client.connections == 3


async def test_diverged_or_another_run_starts_from_step_zero(
    coordinator: FakeCoordinator, dataset: Dataset
) -> None:
    async with running(make_client(coordinator, dataset)):
        peer = await coordinator.next_peer()
        await peer.handshake(current_step=1)
        await peer.expect(messages.FitnessRequest)
        await peer.send(messages.FitnessRange.from_steps(0, PAIRS, PACKED[0:1]))
        assert (await peer.expect(messages.JobRequest)).replica_step == 1

        await peer.send_error(ErrorCode.DIVERGED, "digest differs")
        peer = await coordinator.next_peer()
        await peer.handshake(current_step=1)
        assert (
            await peer.expect(messages.FitnessRequest)
        ).first_step == 0  # the replica was dropped
        await peer.send(messages.FitnessRange.from_steps(0, PAIRS, PACKED[0:1]))
        assert (await peer.expect(messages.JobRequest)).replica_step == 1

        peer.close()
        peer = await coordinator.next_peer()
        await peer.handshake(current_step=0, run_id=b"\xee" * 16)  # a new run
        assert await peer.expect(messages.JobRequest) == messages.JobRequest(0, INITIAL.digest(), 0)


async def test_a_worker_that_diverges_again_after_every_resync_ends(
    coordinator: FakeCoordinator, dataset: Dataset
) -> None:
    """DIVERGED three times in a row, each after the replica was rebuilt from the run's
    log: its arithmetic differs from the run's, and resyncing again would not help."""
    client = make_client(coordinator, dataset)
    run = asyncio.create_task(client.run())
    for _ in range(DIVERGED_ATTEMPTS):
        peer = await coordinator.next_peer()
        await peer.handshake()
        await peer.expect(messages.JobRequest)
        await peer.send_error(ErrorCode.DIVERGED, "digest differs")
    with pytest.raises(WorkerFatal, match="computes differently") as raised:
        await asyncio.wait_for(run, TIMEOUT_S)
    assert "\n" not in str(raised.value)
    assert coordinator.peers.empty()  # it did not come back


async def test_a_step_it_scored_committed_between_divergences_keeps_it_going(
    coordinator: FakeCoordinator, dataset: Dataset
) -> None:
    """A STEP for a step this worker scored says its results and replica were right then:
    the count of divergences in a row starts again."""
    async with running(make_client(coordinator, dataset)):
        for diverged in range(2 * DIVERGED_ATTEMPTS - 2):
            peer = await coordinator.next_peer()
            await peer.handshake()
            await peer.expect(messages.JobRequest)
            if diverged == DIVERGED_ATTEMPTS - 1:  # the first two were in a row
                await peer.send(messages.Job(0, 0, 0, 8))
                await peer.expect(messages.Result)
                await peer.expect(messages.JobRequest)
                await peer.send(messages.Step.from_values(0, fitness(0)))
                assert (await peer.expect(messages.JobRequest)).replica_step == 1
            await peer.send_error(ErrorCode.DIVERGED, "digest differs")
        peer = await coordinator.next_peer()  # still there
        await peer.handshake()
        assert await peer.expect(messages.JobRequest) == messages.JobRequest(0, INITIAL.digest(), 0)


async def test_a_divergence_of_another_worker_at_its_address_does_not_count(
    coordinator: FakeCoordinator, dataset: Dataset
) -> None:
    """Refused because another worker of its machine was outvoted: it resyncs, however
    often, and never gives up for it."""
    async with running(make_client(coordinator, dataset)):
        for _ in range(DIVERGED_ATTEMPTS + 1):
            peer = await coordinator.next_peer()
            await peer.handshake()
            await peer.expect(messages.JobRequest)
            await peer.send_error(ErrorCode.DIVERGED, ADDRESS_OUTVOTED)
        peer = await coordinator.next_peer()  # still there
        await peer.handshake()
        assert await peer.expect(messages.JobRequest) == messages.JobRequest(0, INITIAL.digest(), 0)


async def test_protocol_error_from_the_coordinator(
    coordinator: FakeCoordinator, dataset: Dataset
) -> None:
    async with running(make_client(coordinator, dataset)):
        peer = await coordinator.next_peer()
        await peer.handshake()
        await peer.expect(messages.JobRequest)
        peer.writer.write(b"JUNK" * 8)
        told = await peer.expect(messages.Error)  # the worker explains before it hangs up
        assert told.code is ErrorCode.BAD_MAGIC and await peer.closed()
        peer = await coordinator.next_peer()  # and comes back
        await peer.handshake()
        await peer.expect(messages.JobRequest)


async def test_reconnects_until_the_coordinator_is_up(
    coordinator: FakeCoordinator, dataset: Dataset
) -> None:
    port = coordinator.port
    await coordinator.close()  # nothing listens on the port now
    client = make_client(coordinator, dataset)
    with structlog.testing.capture_logs() as logs:
        async with running(client):
            await wait_until(lambda: any(e["event"] == "reconnecting" for e in logs))
            assert "cannot connect" in logs[0]["reason"]
            fake = FakeCoordinator()
            await fake.start(port)
            try:
                peer = await fake.next_peer()
                await peer.handshake()
                assert await peer.expect(messages.JobRequest) == messages.JobRequest(
                    0, INITIAL.digest(), 0
                )
            finally:
                await fake.close()


async def test_a_coordinator_of_another_protocol_version_ends_the_worker(
    coordinator: FakeCoordinator, dataset: Dataset
) -> None:
    """Its frames carry another version byte: one line, no reconnecting."""
    client = make_client(coordinator, dataset)
    run = asyncio.create_task(client.run())
    peer = await coordinator.next_peer()
    await peer.expect(messages.Hello)
    frame = bytearray(encode_message(messages.Challenge(os.urandom(32))))
    frame[4] = PROTOCOL_VERSION - 1  # the header's version byte
    peer.writer.write(bytes(frame))
    await peer.writer.drain()
    with pytest.raises(WorkerFatal, match="another protocol") as raised:
        await asyncio.wait_for(run, TIMEOUT_S)
    assert raised.value.code is ErrorCode.BAD_VERSION and "\n" not in str(raised.value)
    assert coordinator.peers.empty()  # it did not come back


@pytest.mark.parametrize("code", [ErrorCode.DATA_MISMATCH, ErrorCode.AUTH_FAILED])
async def test_permanent_errors_end_the_worker(
    coordinator: FakeCoordinator, dataset: Dataset, code: ErrorCode
) -> None:
    client = make_client(coordinator, dataset)
    run = asyncio.create_task(client.run())
    peer = await coordinator.next_peer()
    await peer.expect(messages.Hello)
    await peer.send(messages.Challenge(os.urandom(32)))
    await peer.expect(messages.Auth)
    await peer.send_error(code, "no")
    with pytest.raises(WorkerFatal) as raised:
        await asyncio.wait_for(run, TIMEOUT_S)
    assert raised.value.code is code
    assert "\n" not in str(raised.value) and code.name in str(raised.value)
    assert coordinator.peers.empty()  # it did not come back


@pytest.mark.parametrize(
    ("config_bytes", "match"),
    [
        (b'{"format": 1, "model": {"arch": "rnn"}}', r"model\.arch"),
        (
            CFG.replace(es=ESConfig(population=16, chunk_size=8, seq_len=60000)).canonical_bytes(),
            "seq_len",
        ),
        (CFG.replace(model=ModelConfig(vocab_size=512)).canonical_bytes(), "vocabulary"),
    ],
    ids=["unknown-arch", "data-too-short", "other-vocabulary"],
)
async def test_a_config_the_worker_cannot_run_is_refused(
    coordinator: FakeCoordinator, dataset: Dataset, config_bytes: bytes, match: str
) -> None:
    client = make_client(coordinator, dataset)
    run = asyncio.create_task(client.run())
    peer = await coordinator.next_peer()
    await peer.handshake(config_bytes=config_bytes)
    assert (await peer.expect(messages.Error)).code is ErrorCode.CONFIG_MISMATCH
    with pytest.raises(WorkerFatal, match=match) as raised:
        await asyncio.wait_for(run, TIMEOUT_S)
    assert raised.value.code is ErrorCode.CONFIG_MISMATCH and "\n" not in str(raised.value)


async def test_a_config_the_backend_cannot_build_is_refused(
    coordinator: FakeCoordinator, dataset: Dataset
) -> None:
    """A device that cannot run the model (as the CuPy backend refuses the former) tells the
    coordinator CONFIG_MISMATCH and gives up, in one line."""

    def build(data: Dataset, state: ReplicaState) -> Backend:
        raise BackendUnavailable("the CuPy backend has kernels for the egg model only")

    client = make_client(coordinator, dataset, backend=BackendFactory("gpu", "cuda:0", build))
    run = asyncio.create_task(client.run())
    peer = await coordinator.next_peer()
    await peer.handshake()
    assert (await peer.expect(messages.Error)).code is ErrorCode.CONFIG_MISMATCH
    with pytest.raises(WorkerFatal, match="egg model only") as raised:
        await asyncio.wait_for(run, TIMEOUT_S)
    assert raised.value.code is ErrorCode.CONFIG_MISMATCH and "\n" not in str(raised.value)


async def test_stop_closes_the_connection(coordinator: FakeCoordinator, dataset: Dataset) -> None:
    client = make_client(coordinator, dataset)
    run = asyncio.create_task(client.run())
    peer = await coordinator.next_peer()
    await peer.handshake()
    await peer.expect(messages.JobRequest)
    client.stop()
    await asyncio.wait_for(run, TIMEOUT_S)
    assert await peer.closed()


# --- the command ------------------------------------------------------------------------------


def worker_command() -> str:
    return str(Path(sys.executable).with_name("eggroll-worker"))


async def run_cli(*args: str, timeout: float = 30.0) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        worker_command(),
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    assert proc.returncode is not None
    return proc.returncode, (out + err).decode()


async def test_cli_missing_data_is_one_line(tmp_path: Path) -> None:
    rc, output = await run_cli("127.0.0.1", "--data-dir", str(tmp_path), "--log-format", "json")
    assert rc == 1
    lines = output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "eggroll-data" in lines[0]


async def test_cli_cupy_backend_without_gpu_is_one_line_exit_2(data_dir: Path) -> None:
    if cuda_usable():
        pytest.skip("this host has a usable CUDA GPU")
    rc, output = await run_cli("127.0.0.1", "--data-dir", str(data_dir), "--backend", "cupy")
    assert rc == 2
    lines = output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: --backend cupy needs CuPy")


async def test_cli_refused_worker_exits_2_with_one_line(
    coordinator: FakeCoordinator, data_dir: Path
) -> None:
    cli = asyncio.create_task(
        run_cli(
            f"127.0.0.1:{coordinator.port}", "--data-dir", str(data_dir), "--log-format", "json"
        )
    )
    peer = await coordinator.next_peer()
    await peer.expect(messages.Hello)
    await peer.send(messages.Challenge(os.urandom(32)))
    await peer.expect(messages.Auth)
    await peer.send_error(ErrorCode.AUTH_FAILED)
    rc, output = await cli
    assert rc == 2 and "Traceback" not in output
    last = output.strip().splitlines()[-1]
    assert last.startswith("Error: ") and "EGGROLL_TOKEN" in last


async def test_cli_sigterm_closes_and_exits_0(coordinator: FakeCoordinator, data_dir: Path) -> None:
    proc = await asyncio.create_subprocess_exec(
        worker_command(),
        "127.0.0.1",
        "--data-dir",
        str(data_dir),
        "--log-format",
        "json",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "EGGROLL_PORT": str(coordinator.port), "EGGROLL_NAME": "env-name"},
    )
    try:
        peer = await asyncio.wait_for(coordinator.next_peer(), 30)
        hello = await peer.handshake()
        assert hello.worker_name == "env-name"  # options come from EGGROLL_* too
        await peer.expect(messages.JobRequest)
        proc.send_signal(signal.SIGTERM)
        assert await peer.closed()
        _, err = await asyncio.wait_for(proc.communicate(), TIMEOUT_S)
        assert proc.returncode == 0, err.decode()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


class _ResetReader:
    """The read side of a connection its peer reset before sending anything."""

    async def read(self, n: int) -> bytes:
        raise ConnectionResetError(104, "Connection reset by peer")


@pytest.mark.parametrize(
    ("tls", "before", "verdict"),
    [
        (False, 0, "connection lost: "),  # a plain reset: the network, retried
        (True, 0, "the coordinator closed the TLS connection before the handshake"),
        (True, TLS_REFUSALS - 1, "does not accept this worker's certificate"),
    ],
)
async def test_a_reset_before_any_frame_over_tls_is_a_refusal(
    tls: bool, before: int, verdict: str
) -> None:
    """Some OpenSSL builds deliver a coordinator's refusal of the worker's certificate as a
    reset (TLS 1.3 checks it after the worker's side of the handshake), not as an alert.
    Over TLS, a reset before any frame counts as a refusal: the TLS_REFUSALS-th in a row
    ends the worker (WorkerFatal); without TLS it is a lost connection, tried again."""
    identity = Identity("w", b"t" * 32, "numpy", "cpu", b"\0" * 32, 256, 1000)
    options = LinkOptions(identity, tls=tls, tls_refusals=before)
    link = Link(options, None, _ResetReader(), None)  # type: ignore[arg-type]
    await link._read_loop()
    (item,) = [link.inbox.get_nowait() for _ in range(link.inbox.qsize())]
    fatal = before == TLS_REFUSALS - 1
    assert isinstance(item, WorkerFatal if fatal else Ended) and verdict in str(item)
    assert link.tls_refused is tls
