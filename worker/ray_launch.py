"""`eggroll-ray HOST[:PORT] [-- worker flags]`: one eggroll-worker per GPU of a Ray cluster.

For users whose machines are already a Ray cluster (`ray start`, KubeRay, a SLURM job that
starts Ray). Ray places one actor per worker (a GPU each, or CPUs for NumPy workers), the
actor runs `eggroll-worker` as its child with the GPU Ray gave it, and this command
supervises them as deploy/run-workers.sh does on one host. The coordinator stays where it
is, outside Ray: Ray only places and watches workers.

What a worker's end means (`ended`, by the table of worker/exits.py) and whether it is
made good (`loss`) are pure, tested without Ray; `Supervisor` acts on them.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from ..protocol import DEFAULT_PORT
from ..protocol.messages import MAX_WORKER_NAME_BYTES
from ..protocol.security import TokenError, load_token
from ..shared.cli import OneLineError, command, token_file_option
from ..shared.logs import readable
from .cli import parse_address
from .exits import FAULTY, KILLED, LOST, LOST_KIND, STOPPED, Tally, exit_policy, killed_by
from .session_types import COMPUTES_DIFFERENTLY, FINISHED

PROG = "eggroll-ray"
# The driver's EGGROLL_* settings reach the workers, as run-workers.sh's do, except these:
# the token is handed over explicitly, the others are this command's own.
_NOT_PASSED = ("EGGROLL_TOKEN", "EGGROLL_TOKEN_FILE", "EGGROLL_NAME", "EGGROLL_STOP_TIMEOUT_S")
SIGNAL_AGAIN_S = 1.5  # a second signal sooner is the same one (a group and its leader)
MAX_BUFFERED_LINES = 10_000  # a worker's lines held between two polls by the driver
START_S = 15.0  # a placed actor starts its eggroll-worker (a Popen) within this


def say(text: str) -> None:
    click.echo(f"{PROG}: {text}", err=True)


@dataclass(frozen=True)
class Ended:
    """What a worker's end means: its exit `code` for this command, and whether the others
    stop (`stop_all`)."""

    message: str
    stop_all: bool
    code: int


def ended(name: str, status: int | None, last: str = "", asked: bool = False) -> Ended:
    """A worker's exit status (negative: killed by that signal; LOST: its actor died), when
    this command `asked` it to stop or not, judged by `exit_policy` (worker/exits.py): a
    failure every worker would share (2, 1, any other: a bad flag, missing data, a refused
    token) stops them all, as deploy/run-workers.sh does; a finished run (0), a worker that
    computes differently (3), one killed by a signal not ours (the OOM killer) or lost with
    its node ends alone."""
    verdict = exit_policy(status, asked)
    if verdict.kind == LOST_KIND:
        message = f"{name} was lost with its Ray node or actor; the others go on"
    elif verdict.kind == STOPPED:
        done = ": the run is complete" if FINISHED in last else ""
        message = f"{name} stopped{done}"
    elif verdict.kind == KILLED:
        signum = killed_by(status)
        assert signum is not None
        how = signal.Signals(signum).name if signum in signal.valid_signals() else signum
        message = f"{name} was killed by {how}"
    elif verdict.kind == FAULTY:
        message = (
            f"{name} exited with status {COMPUTES_DIFFERENTLY}: it computes differently from "
            "the run (a faulty GPU?); the others go on"
        )
    else:
        said = f" (its last line: {last})" if last else ""
        message = f"{name} exited with status {status}{said}"
    return Ended(message, verdict.stop_all, verdict.code)


def worker_names(places: list[tuple[str, str, list[str]]], base: str | None) -> list[str]:
    """Names by node: BASE-gpuG for a worker on GPU G (Ray's GPU id on that node), else
    BASE-cpuK for the K-th CPU worker of its node; BASE is the node's short host name unless
    given, so that two nodes' workers never share a name."""
    seen: Counter[str] = Counter()
    names = []
    for node, host, gpus in places:
        stem = base if base is not None else host
        if gpus:
            name = f"{stem}-gpu{','.join(gpus)}"
        else:
            name = f"{stem}-cpu{seen[node]}"
        seen[node] += 1
        names.append(name)
    if len(set(names)) != len(names):  # one --name for several nodes
        names = [f"{n}-{i}" for i, n in enumerate(names)]
    return names


def replacement_name(
    place: tuple[str, str, list[str]], base: str | None, on_node: int, n: int
) -> str:
    """The n-th replacement's name: after where Ray put it (its node, its GPU or its count
    of CPU workers there, `on_node` with itself), numbered as a replacement so that it
    never takes a live worker's name."""
    _, host, gpus = place
    stem = base if base is not None else host
    where = f"gpu{','.join(gpus)}" if gpus else f"cpu{on_node - 1}"
    return f"{stem}-{where}-r{n}"


def workers_on_node(nodes: list[str], live: Iterable[int], node: str) -> int:
    """Live workers (by index into `nodes`) on `node`, and one more: a newcomer's count."""
    return 1 + sum(nodes[i] == node for i in live)


class WorkerProcess:
    """A Ray actor holding one eggroll-worker child, which shares the actor's process group
    and goes with it when the actor dies (its node lost, its driver killed; the tests kill
    an actor and watch its quiet child go). Async, so that `stop` runs while `wait` is
    pending. The child's lines wait in the actor until the
    driver takes them (Ray's own relay of actor output drops lines it thinks repeated and
    those still in flight when the driver ends)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.relay: threading.Thread | None = None
        self.lines: deque[str] = deque(maxlen=MAX_BUFFERED_LINES)
        self.dropped = 0
        self.lock = threading.Lock()

    async def place(self) -> tuple[str, str, list[str]]:
        import ray

        host = socket.gethostname().split(".")[0]
        gpus = [str(g) for g in ray.get_gpu_ids()]
        return ray.get_runtime_context().get_node_id(), host, gpus

    async def start(self, args: list[str], env: dict[str, str]) -> None:
        exe = shutil.which("eggroll-worker", path=os.path.dirname(sys.executable))
        if exe is None:
            raise RuntimeError(f"no eggroll-worker beside {sys.executable} on this Ray node")
        # The driver's settings and token, none of this Ray node's own.
        inherited = {k: v for k, v in os.environ.items() if not k.startswith("EGGROLL_")}
        self.proc = subprocess.Popen(
            [exe, *args],
            env={**inherited, **env},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        self.relay = threading.Thread(target=self._relay, daemon=True)
        self.relay.start()

    def _relay(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            with self.lock:
                if len(self.lines) == MAX_BUFFERED_LINES:
                    self.dropped += 1
                self.lines.append(line.decode("utf-8", "replace").rstrip("\n"))

    async def take(self) -> tuple[list[str], int]:
        """The lines printed since the last call, and how many were dropped meanwhile."""
        with self.lock:
            lines, dropped = list(self.lines), self.dropped
            self.lines.clear()
            self.dropped = 0
        return lines, dropped

    async def wait(self) -> int:
        """The child's exit status, once it has exited and every line of it is taken in."""
        assert self.proc is not None and self.relay is not None
        loop = asyncio.get_running_loop()
        status = await loop.run_in_executor(None, self.proc.wait)
        await loop.run_in_executor(None, self.relay.join, 10)
        return status

    async def stop(self, timeout_s: float) -> None:
        """SIGTERM (a clean stop), then SIGKILL after `timeout_s`."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.terminate()
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(loop.run_in_executor(None, self.proc.wait), timeout_s)
        except TimeoutError:
            self.proc.kill()


class _Stop:
    """SIGINT/SIGTERM asks for a clean stop; another one, SIGNAL_AGAIN_S later or more,
    kills at once (sooner, it is the same signal sent to a process group and its leader)."""

    def __init__(self) -> None:
        self.asked: str | None = None
        self.at = 0.0
        self.again = False

    def __call__(self, signum: int, frame: object) -> None:
        now = time.monotonic()
        if self.asked is None:
            self.asked, self.at = signal.Signals(signum).name, now
        elif now - self.at >= SIGNAL_AGAIN_S:
            self.again = True


def _reachable(address: str) -> str | None:
    """Why a plain HOST:PORT cluster address cannot be reached, or None: Ray itself retries
    an unreachable one for minutes."""
    if address in ("auto", "local") or "://" in address:
        return None
    try:
        host, port = parse_address(address, 6379)
        socket.create_connection((host, port), timeout=10).close()
    except (OSError, ValueError) as exc:
        return str(exc) or type(exc).__name__
    return None


def _cannot_join(address: str, why: str) -> click.ClickException:
    return click.ClickException(
        f"cannot join the Ray cluster at {address!r}: {why} (start one with `ray start "
        "--head`, or give --ray-address local for one on this machine)"
    )


def _connect(ray: Any, address: str) -> None:
    why = _reachable(address)
    if why is not None:
        raise _cannot_join(address, why)
    try:
        if address == "local":  # a Ray of its own on this machine, for this command only
            ray.init(address="local", include_dashboard=False, log_to_driver=False)
        else:  # the workers' lines come through WorkerProcess.take, not Ray's relay
            ray.init(address=address, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise _cannot_join(address, first) from None


def _plan(ray: Any, device: str, workers: int | None, cpus_per_worker: float) -> int:
    """The number of workers: as asked (an autoscaler may add the nodes they need), else one
    per GPU (or per `cpus_per_worker` CPUs) the cluster holds now."""
    if workers is not None:
        return workers
    resources = ray.cluster_resources()
    if device == "gpu":
        n = int(resources.get("GPU", 0))
        if n == 0:
            raise click.ClickException(
                "the Ray cluster has no GPU now: give --workers N to wait for GPU nodes, or "
                "--device cpu for NumPy workers"
            )
        return n
    n = int(resources.get("CPU", 0) // cpus_per_worker)
    if n == 0:
        raise click.ClickException(
            f"the Ray cluster has {resources.get('CPU', 0):g} CPUs now, under "
            f"--cpus-per-worker {cpus_per_worker:g}: give --workers N to wait for more"
        )
    return n


@command()
@click.argument("coordinator", metavar="HOST[:PORT]", envvar="EGGROLL_COORDINATOR")
@click.argument("worker_args", nargs=-1, type=click.UNPROCESSED, metavar="[-- WORKER FLAGS]")
@click.option(
    "--ray-address",
    envvar="EGGROLL_RAY_ADDRESS",
    default="auto",
    show_default=True,
    help="Ray cluster to join: auto (the cluster this machine is part of, or $RAY_ADDRESS), "
    "HOST:PORT, ray://HOST:PORT, or local (a Ray of its own on this machine).",
)
@click.option(
    "--device",
    envvar="EGGROLL_RAY_DEVICE",
    type=click.Choice(["gpu", "cpu"]),
    default="gpu",
    show_default=True,
    help="gpu: one worker per GPU (CuPy, --backend auto); cpu: NumPy workers on CPUs.",
)
@click.option(
    "--workers",
    envvar="EGGROLL_RAY_WORKERS",
    type=click.IntRange(min=1),
    default=None,
    help="Number of workers [default: one per GPU of the cluster, or per --cpus-per-worker "
    "CPUs with --device cpu].",
)
@click.option(
    "--cpus-per-worker",
    envvar="EGGROLL_RAY_CPUS_PER_WORKER",
    type=click.FloatRange(min=0.01),
    default=1.0,
    show_default=True,
    help="CPUs Ray reserves for each worker; with --device cpu also the NumPy threads "
    "(rounded down, at least 1).",
)
@click.option(
    "--name",
    envvar="EGGROLL_RAY_NAME",
    default=None,
    help="Base of the worker names (NAME-gpu0, ... or NAME-cpu0, ...; with workers on "
    "several nodes, NAME-gpu0-0, NAME-gpu0-1, ... numbered across them) [default: each "
    "node's short host name].",
)
@token_file_option(
    "File holding the coordinator's token, read here (mode 600; or the EGGROLL_TOKEN "
    "variable); the workers get it in their environment, not on their command line."
)
@click.option(
    "--start-timeout-s",
    envvar="EGGROLL_RAY_START_TIMEOUT_S",
    type=click.FloatRange(min=1),
    default=300.0,
    show_default=True,
    help="Seconds to wait for Ray to place every worker (an autoscaler may add nodes).",
)
@click.option(
    "--replace-lost",
    envvar="EGGROLL_RAY_REPLACE_LOST",
    type=click.IntRange(min=0),
    default=3,
    show_default=True,
    help="Workers to start again, wherever Ray finds room (within --start-timeout-s), after "
    "their actor or Ray node was lost, or they stopped on a signal not ours before the run's "
    "end (a preempted node, say); 0: none.",
)
@click.option(
    "--stop-timeout-s",
    type=click.FloatRange(min=1),
    default=30.0,
    show_default=True,
    help="Seconds a worker gets to stop after SIGTERM before it is killed.",
)
def main(
    coordinator: str,
    worker_args: tuple[str, ...],
    ray_address: str,
    device: str,
    workers: int | None,
    cpus_per_worker: float,
    name: str | None,
    token_file: Path | None,
    start_timeout_s: float,
    replace_lost: int,
    stop_timeout_s: float,
) -> None:
    """Run one eggroll-worker per GPU of a Ray cluster (or NumPy workers on its CPUs), all
    serving the coordinator at HOST[:PORT], and supervise them until they end.

    Flags after `--` go to every worker (see eggroll-worker --help), e.g. `-- --data-dir
    /shared/data`: the data directory must exist on every node. The workers run the
    eggroll-worker installed beside the Python of each Ray node, and get the EGGROLL_*
    variables set here. Each line a worker prints comes prefixed with its name. SIGINT or
    SIGTERM stops every worker cleanly (exit 0); a second one, 1.5 s later or more, kills
    them. A worker that exits with 1 or 2 stops the others, and its status is this
    command's; one that exits with 3 (it computes differently) or is killed by a signal
    ends alone; one lost with its actor or node, or stopped by a signal not ours before the
    run's end (a preempted node), is started again elsewhere, up to --replace-lost times in
    all, else ends alone.
    """
    try:
        parse_address(coordinator, DEFAULT_PORT)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="HOST[:PORT]") from None
    for flag in ("--name", "--token-file"):
        if any(a == flag or a.startswith(flag + "=") for a in worker_args):
            raise OneLineError(f"give {flag} to {PROG} itself, not after `--`")
    if name is not None and len(name.encode()) > MAX_WORKER_NAME_BYTES - 16:
        raise click.BadParameter(f"over {MAX_WORKER_NAME_BYTES - 16} bytes", param_hint="--name")
    try:
        token = load_token(token_file).decode("utf-8")
    except TokenError as exc:
        raise OneLineError(str(exc)) from None
    except UnicodeDecodeError:
        raise OneLineError("the token is not UTF-8 text, which Ray workers need") from None
    try:
        import ray
    except ImportError:
        raise click.ClickException(
            "Ray is not installed: pip install 'eggroll-distributed[ray]'"
        ) from None

    try:
        _connect(ray, ray_address)
    except KeyboardInterrupt:
        raise click.ClickException("interrupted while joining the Ray cluster") from None
    stop = _Stop()  # after ray.init, which may set handlers of its own
    old = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        status = _launch(
            ray,
            coordinator,
            list(worker_args),
            device,
            workers,
            cpus_per_worker,
            name,
            token,
            (start_timeout_s, stop_timeout_s),
            stop,
            replace_lost,
        )
    finally:
        ray.shutdown()
        for s, handler in old.items():
            signal.signal(s, handler)
    sys.exit(status)


def _launch(
    ray: Any,
    coordinator: str,
    worker_args: list[str],
    device: str,
    workers: int | None,
    cpus_per_worker: float,
    name: str | None,
    token: str,
    timeouts: tuple[float, float],
    stop: _Stop,
    replace_lost: int = 0,
) -> int:
    start_timeout_s, stop_timeout_s = timeouts
    n = _plan(ray, device, workers, cpus_per_worker)
    cls = ray.remote(WorkerProcess).options(
        num_gpus=1 if device == "gpu" else 0, num_cpus=cpus_per_worker, max_restarts=0
    )
    actors = [cls.remote() for _ in range(n)]
    refs = [a.place.remote() for a in actors]
    deadline = time.monotonic() + start_timeout_s
    while len(ray.wait(refs, num_returns=n, timeout=0.5)[0]) < n:
        if stop.asked:
            say(f"{stop.asked}: stopped before every worker was placed")
            return 0
        if time.monotonic() > deadline:
            raise click.ClickException(
                f"Ray placed fewer than {n} workers within {start_timeout_s:g} s: does the "
                "cluster hold them, or do other jobs? (--workers, --start-timeout-s)"
            )
    try:
        places = ray.get(refs)
    except ray.exceptions.RayError as exc:  # an actor that could not be made on its node
        raise click.ClickException(f"a worker could not be placed: {_last_line(exc)}") from None
    names = worker_names(places, name)
    per_node = Counter(node for node, _, _ in places)
    env = {k: v for k, v in os.environ.items() if _passed(k)}
    if token:
        env["EGGROLL_TOKEN"] = token  # in the environment, never on a command line

    def start(actor: Any, worker_name: str, workers_on_node: int) -> Any:
        worker_env = {**env, "EGGROLL_WORKERS_PER_HOST": str(workers_on_node)}
        args = [coordinator, "--name", worker_name]
        if device == "cpu":
            worker_env["EGGROLL_THREADS"] = str(max(1, int(cpus_per_worker)))
            args += ["--backend", "numpy"]
        return actor.start.remote(args + worker_args, worker_env)

    starts = [
        start(a, worker_name, per_node[node])
        for a, worker_name, (node, _, _) in zip(actors, names, places, strict=True)
    ]
    try:
        ray.get(starts)
    except ray.exceptions.RayError as exc:  # no eggroll-worker on a node
        raise click.ClickException(f"a worker could not start: {_last_line(exc)}") from None
    say(f"started {n} workers for {coordinator}: {', '.join(names)}")
    nodes = [node for node, _, _ in places]
    spare = Replacements(replace_lost, cls.remote, start, start_timeout_s, name, nodes)
    return _supervise(ray, actors, names, stop, stop_timeout_s, spare)


def _passed(var: str) -> bool:
    return (
        var.startswith("EGGROLL_")
        and not var.startswith("EGGROLL_RAY_")
        and (var not in _NOT_PASSED)
    )


def _last_line(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None) or exc
    text = str(cause).strip()
    return text.splitlines()[-1] if text else type(cause).__name__


@dataclass
class Replacements:
    """Workers lost with their actor or node that may be started again: how many more
    (`left`), a new actor for Ray to place (`make`), a worker started in it (`start`: actor,
    name, workers on its node; the ref of the start), how long Ray may take to find room,
    and the base of the names (worker_names'). `nodes`: each worker's node, by index."""

    left: int
    make: Callable[[], Any]
    start: Callable[[Any, str, int], Any]
    timeout_s: float
    base: str | None = None
    nodes: list[str] = field(default_factory=list)


@dataclass
class _Replacing:
    """A replacement on its way: its actor, the deadline of its placing (then of its start),
    the worker it stands in for (`lost`) and how that one ended (LOST, or 0: stopped on a
    signal not ours), and where it goes once placed."""

    actor: Any
    deadline: float
    lost: str
    status: int | None
    name: str = ""
    node: str = ""


class Loss(enum.Enum):
    """What a worker's end is beyond its exit status (`loss`)."""

    NONE = "none"  # an ordinary end, which `ended` judges
    REPLACED = "replaced"  # a loss made good: another worker starts in its place
    FORGOTTEN = "forgotten"  # a loss once the run is complete: nothing is left to do
    FINAL = "final"  # a loss not made good, which `ended` judges


def loss(
    status: int | None,
    *,
    asked: bool,
    said_finished: bool,
    lines_read: bool,
    complete: bool,
    can_replace: bool,
) -> Loss:
    """A worker's end is a loss when its actor or node was lost (LOST), or when it stopped
    cleanly (0) on a signal this command did not send (`asked`) before the run's end
    (`said_finished`): most often its node shutting down (a preempted node's SIGTERM can
    reach the worker before Ray sees the node lost). Without its last lines (`lines_read`),
    which may say the run is complete, such a stop is not known to be one. A loss is
    forgotten once the run is `complete`, made good while `can_replace` (replacements left,
    no stop asked), else final; its actor is killed in every case."""
    signalled = status == 0 and not asked and not said_finished and lines_read
    if status is not LOST and not signalled:
        return Loss.NONE
    if complete:
        return Loss.FORGOTTEN
    return Loss.REPLACED if can_replace else Loss.FINAL


class Supervisor:
    """eggroll-ray's watch over its workers: it relays their lines, acts on their ends
    (`ended`, `loss`) and starts lost ones again (`spare`) until none is left. A `tick` is
    one round and never blocks for long: the workers' lines and a second signal wait on no
    replacement."""

    def __init__(
        self,
        ray: Any,
        actors: list[Any],
        names: list[str],
        stop: _Stop,
        stop_timeout_s: float,
        spare: Replacements | None = None,
    ) -> None:
        self.ray, self.actors, self.names = ray, actors, names
        self.stop, self.stop_timeout_s, self.spare = stop, stop_timeout_s, spare
        self.tally = Tally()
        self.tty = sys.stdout.isatty()  # the workers' JSON lines are shown as text there
        self.last = [""] * len(actors)  # each worker's last line
        self.pending: dict[Any, int] = {a.wait.remote(): i for i, a in enumerate(actors)}
        self.placing: dict[Any, _Replacing] = {}  # by the ref of its placing
        self.starting: dict[Any, _Replacing] = {}  # by the ref of its start
        self.stopping: float | None = None  # when this command asked the workers to stop
        self.made = 0  # replacements placed (they are numbered by it)
        self.complete = False  # a worker said the run is done (none to replace)

    @property
    def busy(self) -> bool:
        """Workers running, or replacements on their way."""
        return bool(self.pending or self.placing or self.starting)

    @property
    def closed(self) -> bool:
        """No new workers: a stop is asked, or the run is complete."""
        return bool(self.stop.asked) or self.stopping is not None or self.complete

    def run(self) -> int:
        """Tick until no worker is left, or a second signal; this command's exit status."""
        while self.busy and self.tick():
            pass
        left = [r.actor for r in (*self.placing.values(), *self.starting.values())]
        for a in self.actors + left:
            with contextlib.suppress(Exception):  # any left after a second signal: their
                self.ray.kill(a)  # children go with them
        return self.tally.status

    def tick(self) -> bool:
        """One round: stop the workers once a signal came, tend the replacements, relay the
        workers' lines and act on their ends. False when the watch must end at once (a
        second signal, or workers that outlast their stop)."""
        if self.stop.asked and self.stopping is None:
            say(f"{self.stop.asked}: stopping {len(self.pending)} workers")
            self._stop_all()
        overdue = (
            self.stopping is not None
            and time.monotonic() > self.stopping + self.stop_timeout_s + 30
        )
        if self.stop.again or overdue:
            say("killing the workers left" if self.stop.again else "workers did not stop: killing")
            self.tally.add(ended("", LOST))
            return False
        if self.placing or self.starting:
            self._tend_replacements()
        if not self.pending:
            time.sleep(0.5)
            return True
        refs = list(self.pending)
        ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=0.5)
        unread = self._relay(sorted(self.pending.values()))
        for ref in ready:
            self._on_end(self.pending.pop(ref), ref, unread)
        return True

    def _on_end(self, i: int, ref: Any, unread: set[int]) -> None:
        """Worker i has ended (`ref`: its wait): replace it, or judge its end."""
        try:
            status = self.ray.get(ref)
        except self.ray.exceptions.RayError:
            status = LOST
        fate = loss(
            status,
            asked=self.stopping is not None,
            said_finished=FINISHED in self.last[i],
            lines_read=i not in unread,
            complete=self.complete,
            can_replace=self.spare is not None and self.spare.left > 0 and not self.closed,
        )
        if fate is not Loss.NONE:
            with contextlib.suppress(Exception):  # lost is final: a partitioned actor
                self.ray.kill(self.actors[i])  # that comes back must not run a second worker
        if fate is Loss.FORGOTTEN:
            say(f"{self.names[i]} ended after the run completed")
            return
        if fate is Loss.REPLACED:
            self._replace(i, status)
            return
        end = ended(self.names[i], status, self.last[i], asked=self.stopping is not None)
        self.tally.add(end)
        self.complete = self.complete or (status == 0 and FINISHED in self.last[i])
        if end.stop_all and self.busy:
            say(f"{end.message}; stopping the others")
            self._stop_all()
        else:
            say(end.message)

    def _replace(self, i: int, status: int | None) -> None:
        """Ask Ray to place a worker in place of worker i, lost or stopped (`status`)."""
        spare = self.spare
        assert spare is not None
        spare.left -= 1
        actor = spare.make()
        deadline = time.monotonic() + spare.timeout_s
        self.placing[actor.place.remote()] = _Replacing(actor, deadline, self.names[i], status)
        how = "was lost with its Ray node or actor" if status is LOST else "stopped"
        say(
            f"{self.names[i]} {how}; starting another in its place ({spare.left} replacements left)"
        )

    def _tend_replacements(self) -> None:
        """Start those Ray has placed, register those started; give up on those past their
        deadline, and on all of them once a stop is asked; drop them once the run is
        complete (their losses no longer matter)."""
        if self.closed:
            self._drop_replacements()
            return
        ready, _ = self.ray.wait(list(self.placing), num_returns=len(self.placing), timeout=0)
        for ref in ready:
            self._placed(self.placing.pop(ref), ref)
        ready, _ = self.ray.wait(list(self.starting), num_returns=len(self.starting), timeout=0)
        for ref in ready:
            self._started(self.starting.pop(ref), ref)
        assert self.spare is not None
        now = time.monotonic()
        for waiting, why in (
            (self.placing, f"Ray found no room within {self.spare.timeout_s:g} s"),
            (self.starting, f"it did not start within {START_S:g} s"),
        ):
            for ref, r in list(waiting.items()):
                if now > r.deadline:
                    del waiting[ref]
                    self._give_up(r, why)

    def _drop_replacements(self) -> None:
        dropped = [*self.placing.values(), *self.starting.values()]
        self.placing.clear()
        self.starting.clear()
        for r in dropped:
            if self.complete:
                with contextlib.suppress(Exception):
                    self.ray.kill(r.actor)
            else:
                self._give_up(r, "a stop was asked")

    def _placed(self, r: _Replacing, ref: Any) -> None:
        """Ray found room for a replacement: start its worker, named after where it is."""
        spare = self.spare
        assert spare is not None
        try:
            r.node, host, gpus = self.ray.get(ref)
        except self.ray.exceptions.RayError as exc:
            self._give_up(r, f"it could not be placed ({_last_line(exc)})")
            return
        self.made += 1
        on_node = workers_on_node(spare.nodes, self.pending.values(), r.node)
        on_node += sum(s.node == r.node for s in self.starting.values())  # starting beside it
        r.name = replacement_name((r.node, host, gpus), spare.base, on_node, self.made)
        r.deadline = time.monotonic() + START_S
        self.starting[spare.start(r.actor, r.name, on_node)] = r

    def _started(self, r: _Replacing, ref: Any) -> None:
        """A replacement's worker started: watch it as one of the workers."""
        assert self.spare is not None
        try:
            self.ray.get(ref)
        except self.ray.exceptions.RayError as exc:
            self._give_up(r, f"it could not start ({_last_line(exc)})")
            return
        self.actors.append(r.actor)
        self.names.append(r.name)
        self.last.append("")
        self.spare.nodes.append(r.node)
        self.pending[r.actor.wait.remote()] = len(self.actors) - 1
        say(f"{r.name} started in place of {r.lost}")

    def _give_up(self, r: _Replacing, why: str) -> None:
        """A loss not made good: it ends as the lost worker did."""
        with contextlib.suppress(Exception):
            self.ray.kill(r.actor)
        say(f"no worker in place of {r.lost}: {why}")
        self.tally.add(ended(r.lost, r.status))

    def _relay(self, ids: list[int]) -> set[int]:
        """Print the workers' new lines; the ids whose lines could not be taken."""
        takes = {self.actors[i].take.remote(): i for i in ids}
        unread = set()
        for ref, i in takes.items():
            try:
                lines, dropped = self.ray.get(ref, timeout=10)
            except self.ray.exceptions.RayError:
                unread.add(i)  # a lost actor (its end says so), or one that did not answer
                continue
            if dropped:
                say(f"{self.names[i]}: {dropped} lines dropped (the driver fell behind)")
            for line in lines:  # JSON lines from the worker; text on a terminal
                click.echo(f"[{self.names[i]}] {readable(line) if self.tty else line}")
                if line.strip():
                    self.last[i] = line[:500]
        return unread

    def _stop_all(self) -> None:
        for i in self.pending.values():
            self.actors[i].stop.remote(self.stop_timeout_s)
        self.stopping = time.monotonic()


def _supervise(
    ray: Any,
    actors: list[Any],
    names: list[str],
    stop: _Stop,
    stop_timeout_s: float,
    spare: Replacements | None = None,
) -> int:
    """Watch the workers until none is left (`Supervisor`); this command's exit status."""
    return Supervisor(ray, actors, names, stop, stop_timeout_s, spare).run()
