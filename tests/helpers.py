"""What several test files share: the in-memory flow harness (the run core and worker sessions
joined by `Connection` pairs, driven by both shells' real executors), the console scripts of
the installation under test, a small run config, and the replica digest at a step.

The harness is h11's ConnectionPair widened to a network: `Network` holds the run core behind
the coordinator's `Executor` and real `Link`s whose writer delivers to a worker; each `Worker`
runs the link's serve loop one message at a time through the worker's `Executor`, with a
replica whose backend calls run at once. Nothing suspends but a held job (`Worker.held`): the
executor's coroutine stops inside `evaluate` until the test lets the job finish, exactly where
the real shell would wait for its backend thread.
"""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from eggroll_dist.coordinator.core_types import Output, RunOptions
from eggroll_dist.coordinator.events import Event
from eggroll_dist.coordinator.link import Link
from eggroll_dist.coordinator.metrics import Metrics
from eggroll_dist.coordinator.run import Refused, RunCore
from eggroll_dist.coordinator.server import Executor as CoordinatorExecutor
from eggroll_dist.coordinator.store import RunStore
from eggroll_dist.protocol import (
    PROTOCOL_VERSION,
    Connection,
    ErrorCode,
    Message,
    Role,
    auth_mac,
    messages,
    unpack_ternary,
)
from eggroll_dist.shared.config import (
    ESConfig,
    ModelConfig,
    RunConfig,
    ValidationConfig,
    load_config,
)
from eggroll_dist.shared.data import Dataset, load_data_dir
from eggroll_dist.shared.replica import ReplicaState
from eggroll_dist.shared.save_dir import SaveDir
from eggroll_dist.worker.backend import BackendFactory
from eggroll_dist.worker.backend.numpy_backend import NumpyBackend
from eggroll_dist.worker.data.build import prepare_data_dir
from eggroll_dist.worker.link import Executor as WorkerExecutor
from eggroll_dist.worker.replica import Replica
from eggroll_dist.worker.session import Session
from eggroll_dist.worker.session_types import Ended, Identity, Phase, WorkerFatal
from eggroll_dist.worker.train import train

T = TypeVar("T")

# --- processes -------------------------------------------------------------------------------

# A small run: eight chunks of 64 members a step, no validation; a step takes a moment.
SMALL_RUN = """
[model]
n_layer = 1
d_model = 32
[es]
population = 512
chunk_size = 64
seq_len = 48
[validation]
every_steps = 0
max_tokens = 480
"""


# A one-process run of six steps with two validations, for the commands that write.
TRAIN_RUN = """
steps = 6
[model]
n_layer = 1
d_model = 16
[es]
population = 32
chunk_size = 8
seq_len = 12
[validation]
every_steps = 3
max_tokens = 600
"""

# A tiny run: four chunks of 8 members a step, a step in milliseconds.
TINY_RUN = """
[model]
n_layer = 1
d_model = 16
[es]
population = 32
chunk_size = 8
seq_len = 8
[validation]
every_steps = 0
max_tokens = 200
"""


# A run in one process: 16 members in 2 chunks of 8, a layer of 16, validation at the end only.
UNIT_CFG = RunConfig(
    model=ModelConfig(n_layer=1, d_model=16),
    es=ESConfig(population=16, chunk_size=8, seq_len=8),
    validation=ValidationConfig(every_steps=0, max_tokens=256),
)


def command(name: str) -> str:
    """A console script of the installation under test."""
    return str(Path(sys.executable).with_name(name))


def words_data_dir(out: Path, docs: int = 40, words: int = 400) -> Path:
    """A byte-level data directory in `out` of `docs` documents, each `words` words drawn
    (seeded) from ten: some structure to learn."""
    rng = random.Random(0)
    vocab = ["alpha", "beta", "gamma", "delta", "the", "of", "and", "eggroll", "int8", "worker"]
    texts = [" ".join(rng.choice(vocab) for _ in range(words)).encode() for _ in range(docs)]
    prepare_data_dir(texts, out, "test:words", valid_fraction=0.2)
    return out


def running(pid: int) -> bool:
    """Whether `pid` runs (a zombie has ended: its parent has not reaped it yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


_PORTS_GIVEN: set[int] = set()


def free_port() -> int:
    """A loopback port free now, below the kernel's ephemeral range: no `bind(0)` and no
    outgoing connection can take it before the server it is meant for binds it (one from
    `bind(0)`, closed and handed on, could be). Never the same one twice in a session."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for port in random.sample(range(max(1024, low - 12000), low), 500):
        if port in _PORTS_GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _PORTS_GIVEN.add(port)
        return port
    raise RuntimeError("no free loopback port below the ephemeral range")


def start_coordinator(
    spawn: Callable[..., Any], save_dir: Path, config: Path, *extra: str | Path, port: int = 0
) -> tuple[Any, int]:
    """eggroll-coordinator on loopback, logging JSON; returns it and the port it listens on
    once it says so. `extra` flags come last, so they win."""
    coord = spawn(
        "eggroll-coordinator",
        *("--save-dir", save_dir, "--config", config, "--host", "127.0.0.1"),
        *("--port", str(port), "--metrics-port", "0", "--log-format", "json"),
        *extra,
    )
    listening = coord.wait_for(lambda e: e.get("event") == "listening", 30, "listening line")
    return coord, listening["port"]


def start_worker(
    spawn: Callable[..., Any], port: int, data_dir: Path, name: str = "honest", *extra: str
) -> Any:
    """eggroll-worker for the coordinator on `port`, logging JSON, retrying within a second."""
    return spawn(
        "eggroll-worker",
        f"127.0.0.1:{port}",
        *("--data-dir", data_dir, "--name", name, "--log-format", "json", "--max-retry-s", "1"),
        *extra,
    )


def inspect_run(save_dir: Path) -> dict[str, Any]:
    """What `eggroll-inspect --json` says of a save directory."""
    done = subprocess.run(
        [command("eggroll-inspect"), str(save_dir), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def digest_at(save_dir: Path, step: int) -> int:
    """The replica digest after `step` steps of the run in `save_dir`: its fitness log
    replayed from the initial state, trusting no snapshot (read only, so the run may still
    be open)."""
    return SaveDir.open(save_dir).state_at(step, unpack_ternary, snapshots=False).digest()


def trained_digest(data_dir: Path, config: Path, steps: int) -> int:
    """The replica digest after `steps` steps of the same run trained in this process, with
    no coordinator: what a distributed run must end at, whatever happened to it."""
    cfg = load_config(config)
    backend = NumpyBackend(load_data_dir(data_dir), ReplicaState.initial(cfg))
    return train(cfg, backend, steps).state.digest()


class Peer:
    """A hand-driven worker (or anything else) speaking the protocol over a real socket."""

    def __init__(self, port: int, *, timeout_s: float = 10.0) -> None:
        self.conn = Connection(Role.WORKER)
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
        self.inbox: list[Message] = []

    def close(self) -> None:
        self.sock.close()

    def send(self, msg: Message) -> None:
        self.sock.sendall(self.conn.send(msg))

    def receive(self) -> Message | None:
        """The next message, or None when the coordinator closed the connection."""
        while not self.inbox:
            try:
                data = self.sock.recv(1 << 16)
            except ConnectionResetError:
                return None
            if not data:
                return None
            self.conn.receive_data(data)
            while (msg := self.conn.next_event()) is not None:
                self.inbox.append(msg)
        return self.inbox.pop(0)

    def until(self, kind: type) -> Message | None:
        """Messages until one of `kind` (returned), an ERROR (returned) or the end (None)."""
        while (msg := self.receive()) is not None:
            if isinstance(msg, kind | messages.Error):
                return msg
        return None

    def join(
        self, token: str, data_digest: bytes, name: str = "intruder"
    ) -> messages.Welcome | messages.Error:
        self.send(messages.Hello(PROTOCOL_VERSION, name, "numpy", "cpu", data_digest))
        challenge = self.until(messages.Challenge)
        assert isinstance(challenge, messages.Challenge), challenge
        self.send(messages.Auth(auth_mac(token.encode(), challenge.nonce)))
        welcome = self.until(messages.Welcome)
        assert welcome is not None
        return welcome


# --- the in-memory flow harness ----------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class _Hold:
    """Awaited, it hands control back to whoever drives the coroutine: a job still running."""

    def __await__(self) -> Any:
        yield


def run_now(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine that never waits (an executor whose I/O is all in memory)."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise AssertionError("the coroutine waited for something")


async def _inline(fn: Callable[..., T], *args: Any) -> T:
    """The coordinator executor's `offload`, without a thread."""
    return fn(*args)


def numpy_factory(threads: int = 1) -> BackendFactory:
    """The NumPy backend with `threads` BLAS threads: it asks for that many chunks at once."""
    return BackendFactory(
        "numpy", "cpu", lambda data, state: NumpyBackend(data, state, threads=threads)
    )


NUMPY = numpy_factory()


def sync_replica(dataset: Dataset, threads: int = 1) -> Replica:
    """A worker's replica whose backend calls run at once, on the caller's thread."""
    return Replica(dataset, numpy_factory(threads), threaded=False)


class _Wire:
    """The coordinator's end of an in-memory link: the writer (and transport) a `Link` writes
    to, delivering every frame to the worker at once."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.transport = self

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def set_write_buffer_limits(self, high: int) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0  # everything is delivered at once: `Link.drain` never waits

    def write(self, data: bytes) -> None:
        self.worker.deliver(data)

    def abort(self) -> None:
        pass

    def close(self) -> None:
        pass  # the worker ends the link itself when it reads the ERROR written before


class _Holding:
    """The replica as the worker's executor sees it: a job at or past the network's mark (or
    any job, with `hold_jobs`) is held, as if still running, until the test lets it end."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def __getattr__(self, name: str) -> Any:
        return getattr(self.worker.replica, name)

    async def evaluate(self, step: int, chunks: list[tuple[int, int]], claims: Any = ()) -> Any:
        w = self.worker
        if w.hold_jobs or step >= w.net.stop_at:
            first_member = chunks[0][0]
            job = next(
                m
                for m in reversed(w.got)
                if isinstance(m, messages.Job) and (m.step, m.first_member) == (step, first_member)
            )
            w.held.append(job)
            while w.held:
                await _Hold()  # the shell runs nothing else until the job is done
        return await w.replica.evaluate(step, chunks)


class Worker:
    """One worker: its session and executor, its end of the link, and what it has received
    but not handled yet."""

    def __init__(self, net: Network, name: str, identity: Identity, replica: Replica) -> None:
        self.net = net
        self.name = name
        self.replica = replica
        self.session = Session(identity, replica, clock=net.clock)
        self.executor = WorkerExecutor(self.session, _Holding(self), self._send, net.clock)  # type: ignore[arg-type]
        self.conn = Connection(Role.WORKER)
        self.peer = 0
        self.inbox: list[Message] = []
        self.sent: list[Message] = []  # everything this worker sent
        self.got: list[Message] = []  # everything it received
        self.held: list[messages.Job] = []  # the job evaluating "slowly"
        self.hold_jobs = False  # hold every job, whatever its step
        self.ended: str | None = None  # why the connection ended
        self.joined: tuple[bytes, str, str, dict[str, Any]] = (b"", "mem", "", {})
        self.fatal: WorkerFatal | None = None
        self._pending: Coroutine[Any, Any, None] | None = None  # stopped at a held job

    @property
    def alive(self) -> bool:
        return self.ended is None and self.fatal is None

    def busy(self) -> bool:
        return self._pending is not None

    async def _send(self, msg: Message) -> None:
        if self.conn.closed:
            return  # the coordinator closed it (an ERROR waits in the inbox)
        self.sent.append(msg)
        self.net.to_coordinator(self, self.conn.send(msg))

    def deliver(self, data: bytes) -> None:
        """Bytes arrive: decoded at once (as the read loop does), handled later."""
        self.conn.receive_data(data)
        while (msg := self.conn.next_event()) is not None:
            if isinstance(msg, messages.Step):
                self.session.step_frame_seen(msg.step)
            self.got.append(msg)
            self.inbox.append(msg)

    def _drive(self, coro: Coroutine[Any, Any, None]) -> None:
        try:
            coro.send(None)
        except StopIteration:
            self._pending = None
        else:
            self._pending = coro

    def start(self) -> None:
        self.carry_out(self.session.start())

    def carry_out(self, commands: list[Any]) -> None:
        """Carry out session commands with the worker's executor, as the link does."""
        self._drive(self.executor.carry_out(commands))

    async def _turn(self, msg: Message | None) -> None:
        """One pass of the link's serve loop: handle `msg` (None: a WAIT ran out), then ask
        for what comes next if nothing else has arrived; a connection that ends is closed."""
        try:
            if msg is not None:
                await self.executor.carry_out(self.session.receive(msg))
            if not self.inbox:
                await self.executor.carry_out(self.session.advance())
        except Ended as exc:
            if exc.drop_replica:
                self.replica.drop()
            self.close(str(exc))
            if str(exc) == "the run rewound" and self.net.rejoin_rewound:
                self.net.rejoin(self)  # as the worker's shell reconnects
        except WorkerFatal as exc:
            if exc.tell and exc.code is not None:
                self.net.to_coordinator(self, self.conn.send_error(exc.code, str(exc)))
            self.fatal = exc
            self.net.disconnect(self)

    def handle_one(self) -> bool:
        """Handle the next received message, as the link's serve loop does; False when
        there was nothing to do (or the worker is busy with a held job)."""
        if not self.alive or self.busy() or not self.inbox:
            return False
        self._drive(self._turn(self.inbox.pop(0)))
        return True

    def retry(self) -> None:
        """The WAIT has run out: ask again."""
        self.session.retry_due()
        if not self.busy():
            self._drive(self._turn(None))

    def finish_held(self) -> None:
        """The slow job ends; messages that arrived meanwhile are handled next."""
        self.hold_jobs = False
        self.held.clear()
        if self._pending is not None:
            self._drive(self._pending)

    def close(self, reason: str) -> None:
        self.ended = reason
        self.net.disconnect(self)


class _Recording(CoordinatorExecutor):
    """The coordinator's executor, keeping every event it records for the tests to read."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.events: list[Event] = []

    def record(self, events: list[Event]) -> None:
        self.events += events
        super().record(events)


class Network:
    """The run core and its workers over in-memory links (h11's ConnectionPair, widened)."""

    def __init__(
        self, store: RunStore, dataset: Dataset, *, metrics: Metrics | None = None, **options: Any
    ) -> None:
        self.clock = FakeClock()
        self.store = store
        self.dataset = dataset
        self.core = RunCore(store, RunOptions(**options), self.clock)
        self.metrics = metrics or Metrics()  # a registry of its own
        self.metrics.observe(self.core.status, store.run_id, store.config.digest())
        self.links: dict[int, Link] = {}
        self.executor = _Recording(self.core, self.metrics, self.links, offload=_inline)
        self.workers: list[Worker] = []
        self.refused: list[tuple[str, ErrorCode]] = []
        # Jobs of this step and later are held (a worker "evaluating" them is busy) until
        # `train` moves the mark: that is how a test lets the run settle between steps.
        self.stop_at = 0
        self.rejoin_rewound = True  # a worker the run's rewind closed connects again

    @property
    def events(self) -> list[Event]:
        return self.executor.events

    def latest(self, kind: type[T]) -> T | None:
        """The last event of `kind` the coordinator recorded."""
        return next((e for e in reversed(self.events) if isinstance(e, kind)), None)

    def join(
        self,
        name: str,
        *,
        replica: Replica | None = None,
        token: bytes = b"",
        host: str = "mem",
        machine: str = "",
        **me: Any,
    ) -> Worker:
        identity = Identity(
            name=name,
            token=token,
            backend="numpy",
            device="cpu",
            data_digest=me.pop("data_digest", self.dataset.digest),
            vocab_size=me.pop("vocab_size", self.dataset.meta.vocab_size),
            train_tokens=len(self.dataset.train),
        )
        w = Worker(self, name, identity, replica or sync_replica(self.dataset))
        w.joined = (token, host, machine, me)
        w.peer = self.core.connect(f"{host}:{name}", machine)
        self.links[w.peer] = Link(w.peer, f"{host}:{name}", _Wire(w), self.metrics, 30.0)  # type: ignore[arg-type]
        self.workers.append(w)
        w.start()
        return w

    def rejoin(self, w: Worker) -> Worker:
        """`w` connects again with its replica (the shell keeps it across connections)."""
        token, host, machine, me = w.joined
        again = self.join(w.name, replica=w.replica, token=token, host=host, machine=machine, **me)
        again.hold_jobs = w.hold_jobs
        return again

    def worker(self, peer: int) -> Worker:
        return next(w for w in self.workers if w.peer == peer)

    def to_coordinator(self, w: Worker, data: bytes) -> None:
        link = self.links.get(w.peer)
        if link is None:
            return
        self.executor.traffic(received=len(data))
        link.conn.receive_data(data)
        while w.peer in self.links and (msg := link.conn.next_event()) is not None:
            link.count_in()
            try:
                self.carry_out(self.core.receive(w.peer, msg))
            except Refused as exc:
                self.refused.append((w.name, exc.code))
                self.executor.refuse(link, exc)
                self.drop(w)
                return

    def carry_out(self, outputs: list[Output]) -> None:
        run_now(self.executor.carry_out(outputs))

    def receive(self, peer: int, msg: Message) -> list[Output]:
        """Hand the core one message as if it came over `peer`'s link, and carry out what
        it returns; a refusal's events are recorded and the refusal raised."""
        try:
            outputs = self.core.receive(peer, msg)
        except Refused as exc:
            self.executor.record(exc.events)
            raise
        self.carry_out(outputs)
        return outputs

    def drop(self, w: Worker) -> None:
        """The coordinator's end closes (after a refusal)."""
        if self.links.pop(w.peer, None) is not None:
            self.carry_out(self.core.peer_left(w.peer))

    def disconnect(self, w: Worker) -> None:
        self.drop(w)

    def run(self, max_rounds: int = 10_000) -> None:
        """Let every worker handle what it has received until nothing moves."""
        for _ in range(max_rounds):
            self.release()
            if not any(w.handle_one() for w in list(self.workers)):
                return
        raise AssertionError("the flow did not settle")

    def advance(self, seconds: float) -> None:
        """Time passes: leases expire, WAITs run out."""
        self.clock.now += seconds
        self.carry_out(self.core.expire())
        for w in self.workers:
            s = w.session
            if w.alive and s.phase is Phase.WAITING and s.retry_at <= self.clock.now:  # type: ignore[operator]
                w.retry()
        self.run()

    def release(self) -> None:
        """Evaluate the jobs held at the mark once the mark has moved past them."""
        for w in self.workers:
            if w.alive and w.held and not w.hold_jobs and w.held[0].step < self.stop_at:
                w.finish_held()

    def train(self, steps: int) -> None:
        """Run until `steps` more steps are committed (workers waiting get nudged)."""
        target = self.stop_at = self.core.step + steps
        for _ in range(100):
            self.release()
            self.run()
            if self.core.step >= target:
                return
            self.advance(1.0)
        raise AssertionError(f"stuck at step {self.core.step}")


def sends(outputs: list[Output]) -> list[Output]:
    """The commands among what the run core returned (its events left out)."""
    return [o for o in outputs if not isinstance(o, Event)]
