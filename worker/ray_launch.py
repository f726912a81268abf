"""`eggroll-ray HOST[:PORT] [-- worker flags]`: one eggroll-worker per GPU of a Ray cluster.

For users whose machines are already a Ray cluster (`ray start`, KubeRay, a SLURM job that
starts Ray). Ray places one actor per worker (a GPU each, or CPUs for NumPy workers), the
actor runs `eggroll-worker` as its child with the GPU Ray gave it, and this command
supervises them as deploy/run-workers.sh does on one host. The coordinator stays where it
is, outside Ray: Ray only places and watches workers.

The policy for a worker that ends (`ended`) is a pure function, tested without Ray.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import click

from ..protocol import DEFAULT_PORT
from ..protocol.messages import MAX_WORKER_NAME_BYTES
from ..protocol.security import TokenError, load_token
from ..shared.cli import OneLineError, command
from .cli import parse_address

PROG = "eggroll-ray"
EXIT_FAULTY = 3  # a worker that computes differently from the run (worker/cli.py)
_TOKEN_VARS = ("EGGROLL_TOKEN", "EGGROLL_TOKEN_FILE")
LOST = None  # the status of a worker whose actor died with its node


def say(text: str) -> None:
    click.echo(f"{PROG}: {text}", err=True)


@dataclass(frozen=True)
class Ended:
    """What a worker's end means for the others: `stop_all` ends the launch with `status`."""

    message: str
    stop_all: bool


def ended(name: str, status: int | None, last: str = "") -> Ended:
    """A worker's exit: a finished run (0) ends each worker on its own; a worker that computes
    differently (3) or whose node was lost ends alone, since the others are fine; any other
    status (a bad flag, missing data, a refused token) would end every worker the same way,
    so all stop, as deploy/run-workers.sh does."""
    if status == 0:
        return Ended(f"{name} stopped: the run is complete", False)
    if status is LOST:
        return Ended(f"{name} was lost with its Ray node or actor; the others go on", False)
    if status == EXIT_FAULTY:
        return Ended(
            f"{name} exited with status 3: it computes differently from the run (a faulty "
            "GPU?); the others go on",
            False,
        )
    said = f" (its last line: {last})" if last else ""
    return Ended(f"{name} exited with status {status}{said}", True)


def first_failure(statuses: list[int | None]) -> int:
    """The launch's exit status: 0 when every worker ended with 0, else the first worker's
    non-zero status (1 for a lost one)."""
    for status in statuses:
        if status != 0:
            return 1 if status is LOST else status
    return 0


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


class WorkerProcess:
    """A Ray actor holding one eggroll-worker child; async, so that `stop` runs while `wait`
    is pending. An actor that dies (its node lost, its driver killed) takes the child with
    it: Ray kills the child processes of a worker process that exits."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.last = ""  # the child's last line, for the driver's message when it fails
        self.relay: threading.Thread | None = None

    async def place(self) -> tuple[str, str, list[str]]:
        import ray

        host = socket.gethostname().split(".")[0]
        gpus = [str(g) for g in ray.get_gpu_ids()]
        return ray.get_runtime_context().get_node_id(), host, gpus

    async def start(self, name: str, args: list[str], env: dict[str, str]) -> None:
        exe = shutil.which("eggroll-worker", path=os.path.dirname(sys.executable))
        if exe is None:
            raise RuntimeError(f"no eggroll-worker beside {sys.executable} on this Ray node")
        # The token is the driver's: none inherited by this Ray node's processes counts.
        inherited = {k: v for k, v in os.environ.items() if k not in _TOKEN_VARS}
        self.proc = subprocess.Popen(
            [exe, *args],
            env={**inherited, **env},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        self.relay = threading.Thread(target=self._relay, args=(name,), daemon=True)
        self.relay.start()

    def _relay(self, name: str) -> None:
        """The child's lines, each prefixed with its name (Ray passes them on to the driver)."""
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            text = line.decode("utf-8", "replace").rstrip("\n")
            print(f"[{name}] {text}", flush=True)
            if text.strip():
                self.last = text[:500]

    async def wait(self) -> tuple[int, str]:
        """The child's exit status and last line, once it has exited and said all."""
        assert self.proc is not None and self.relay is not None
        loop = asyncio.get_running_loop()
        status = await loop.run_in_executor(None, self.proc.wait)
        await loop.run_in_executor(None, self.relay.join, 10)
        return status, self.last

    async def stop(self, timeout_s: float) -> int:
        """SIGTERM (a clean stop), then SIGKILL after `timeout_s`; the exit status."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.terminate()
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(loop.run_in_executor(None, self.proc.wait), timeout_s)
        except TimeoutError:
            self.proc.kill()
            return await loop.run_in_executor(None, self.proc.wait)


class _Stop:
    """SIGINT/SIGTERM asks for a clean stop; a second one kills at once."""

    def __init__(self) -> None:
        self.asked: str | None = None
        self.again = False

    def __call__(self, signum: int, frame: object) -> None:
        if self.asked is not None:
            self.again = True
        self.asked = signal.Signals(signum).name


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


def _connect(ray: Any, address: str) -> None:
    why = _reachable(address)
    if why is not None:
        raise click.ClickException(
            f"cannot join the Ray cluster at {address!r}: {why} (start one with `ray start "
            "--head`, or give --ray-address local for one on this machine)"
        )
    try:
        if address == "local":  # a Ray of its own on this machine, for this command only
            ray.init(address="local", include_dashboard=False, log_to_driver=True)
        else:
            ray.init(address=address, log_to_driver=True)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise click.ClickException(
            f"cannot join the Ray cluster at {address!r}: {first} (start one with `ray start "
            "--head`, or give --ray-address local for one on this machine)"
        ) from None


def _plan(ray: Any, device: str, workers: int | None, cpus_per_worker: float) -> int:
    """The number of workers: as asked, else one per GPU (or per `cpus_per_worker` CPUs) of
    the cluster; refused when the cluster cannot hold them."""
    resources = ray.cluster_resources()
    if device == "gpu":
        room = int(resources.get("GPU", 0))
        if room == 0:
            raise click.ClickException(
                "the Ray cluster has no GPU; give --device cpu for NumPy workers"
            )
        what = f"{room} GPUs"
    else:
        room = int(resources.get("CPU", 0) // cpus_per_worker)
        what = f"{resources.get('CPU', 0):g} CPUs, {cpus_per_worker:g} a worker"
    n = room if workers is None else workers
    if n > room or n == 0:
        raise click.ClickException(f"{n} workers asked, the Ray cluster holds {room} ({what})")
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
    help="Base of the worker names (NAME-gpu0, ... or NAME-cpu0, ...) [default: each node's "
    "short host name].",
)
@click.option(
    "--token-file",
    type=click.Path(dir_okay=False),
    default=None,
    envvar="EGGROLL_TOKEN_FILE",
    help="File holding the coordinator's token, read here (mode 600; or the EGGROLL_TOKEN "
    "variable); the workers get it in their environment, not on their command line.",
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
    token_file: str | None,
    start_timeout_s: float,
    stop_timeout_s: float,
) -> None:
    """Run one eggroll-worker per GPU of a Ray cluster (or NumPy workers on its CPUs), all
    serving the coordinator at HOST[:PORT], and supervise them until they end.

    Flags after `--` go to every worker (see eggroll-worker --help), e.g. `-- --data-dir
    /shared/data`: the data directory must exist on every node. The workers run the
    eggroll-worker installed beside the Python of each Ray node. Each line a worker prints
    comes prefixed with its name. SIGINT or SIGTERM stops every worker cleanly (exit 0); a
    second signal kills them. A worker that exits non-zero stops the others (its status is
    this command's), except status 3 (it computes differently) or a lost node, which end only
    that worker.
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
        token = load_token(token_file)
    except TokenError as exc:
        raise OneLineError(str(exc)) from None
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
            )
        finally:
            ray.shutdown()
    finally:
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
    token: bytes,
    timeouts: tuple[float, float],
    stop: _Stop,
) -> int:
    start_timeout_s, stop_timeout_s = timeouts
    n = _plan(ray, device, workers, cpus_per_worker)
    actor = ray.remote(WorkerProcess)
    gpus = 1 if device == "gpu" else 0
    actors = [
        actor.options(num_gpus=gpus, num_cpus=cpus_per_worker, max_restarts=0).remote()
        for _ in range(n)
    ]
    refs = [a.place.remote() for a in actors]
    deadline = time.monotonic() + start_timeout_s
    while len(ray.wait(refs, num_returns=n, timeout=0.5)[0]) < n:
        if stop.asked:
            say(f"{stop.asked}: stopped before every worker was placed")
            return 0
        if time.monotonic() > deadline:
            raise click.ClickException(
                f"Ray placed fewer than {n} workers within {start_timeout_s:g} s: are its "
                "resources held by other jobs? (--workers, --start-timeout-s)"
            )
    places = ray.get(refs)
    names = worker_names(places, name)
    per_node = Counter(node for node, _, _ in places)
    env = {"EGGROLL_TOKEN": token.decode()} if token else {}
    starts = []
    for a, worker_name, (node, _, _) in zip(actors, names, places, strict=True):
        worker_env = {**env, "EGGROLL_WORKERS_PER_HOST": str(per_node[node])}
        args = [coordinator, "--name", worker_name]
        if device == "cpu":
            worker_env["EGGROLL_THREADS"] = str(max(1, int(cpus_per_worker)))
            args += ["--backend", "numpy"]
        starts.append(a.start.remote(worker_name, args + worker_args, worker_env))
    try:
        ray.get(starts)
    except ray.exceptions.RayError as exc:  # no eggroll-worker on a node
        cause = getattr(exc, "cause", None) or exc
        raise click.ClickException(f"a worker could not start: {cause}") from None
    say(f"started {n} workers for {coordinator}: {', '.join(names)}")

    statuses: list[int | None] = [0] * n
    pending = {a.wait.remote(): i for i, a in enumerate(actors)}
    stopping: float | None = None  # when the stop began

    def stop_all() -> float:
        for i in pending.values():
            actors[i].stop.remote(stop_timeout_s)
        return time.monotonic()

    while pending:
        if stop.asked and stopping is None:
            say(f"{stop.asked}: stopping {len(pending)} workers")
            stopping = stop_all()
        if stop.again or (stopping and time.monotonic() > stopping + stop_timeout_s + 30):
            say("killing the workers left" if stop.again else "workers did not stop: killing")
            for i in pending.values():
                statuses[i] = LOST
            break
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=0.5)
        for ref in ready:
            i = pending.pop(ref)
            last = ""
            try:
                statuses[i], last = ray.get(ref)
            except ray.exceptions.RayError:
                statuses[i] = LOST
            end = ended(names[i], statuses[i], last)
            if stopping is not None:
                continue
            if end.stop_all and pending:
                say(f"{end.message}; stopping the others")
                stopping = stop_all()
            else:
                say(end.message)
    for a in actors:  # any left after a second signal: Ray kills their children too
        with contextlib.suppress(Exception):
            ray.kill(a)
    return first_failure(statuses)
