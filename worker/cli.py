"""`eggroll-worker HOST[:PORT]`: hold a replica, evaluate chunks for a coordinator.

Every option can also be set from the environment (EGGROLL_PORT, EGGROLL_DATA_DIR,
EGGROLL_BACKEND, EGGROLL_NAME, EGGROLL_TOKEN, EGGROLL_LOG_FORMAT, EGGROLL_BATCH_MEMBERS,
EGGROLL_MAX_RETRY_S, EGGROLL_KERNEL_DIR), and the coordinator address from
EGGROLL_COORDINATOR, which suits service files and containers. Exit codes: 0 after
SIGINT/SIGTERM or when the run is complete, 1 for a local problem (missing data, bad
option), 2 when the coordinator refuses the worker for good (wrong token, other data, other
protocol version, a config it cannot run) or cannot be found (a host name that does not
resolve, a port that is not a coordinator's), 3 when it computes differently from the run
(told DIVERGED three times in a row, each time after rebuilding its replica: another
version, or a faulty device).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import ssl
import sys
from pathlib import Path

import click
import structlog

from ..protocol import DEFAULT_PORT
from ..protocol.messages import MAX_WORKER_NAME_BYTES
from ..protocol.security import TokenError, client_tls_context, load_token
from ..shared.cli import (
    DATA_DIR_HELP,
    OneLineError,
    command,
    data_dir_option,
    log_format_option,
    pem_option,
    reward_timeout_option,
    threads_option,
    token_file_option,
)
from ..shared.data import DataError, load_data_dir
from ..shared.logs import configure_logging
from .backend import BackendUnavailable, get_backend
from .backend.cubins import KERNEL_DIR_ENV
from .client import WorkerClient, WorkerFatal, default_worker_name
from .session_types import RunFinished

log = structlog.get_logger("eggroll.worker")


def parse_address(text: str, default_port: int) -> tuple[str, int]:
    """HOST, HOST:PORT, [IPV6] or [IPV6]:PORT; a bare IPv6 address keeps the default port."""
    text = text.strip()
    port_text: str | None = None
    if text.startswith("["):
        host, closed, rest = text[1:].partition("]")
        if not closed or (rest and not rest.startswith(":")):
            raise ValueError(f"{text!r} is not [IPV6] or [IPV6]:PORT")
        port_text = rest[1:] if rest else None
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    else:
        host = text  # a name, an IPv4 address, or a bare IPv6 address
    if not host:
        raise ValueError(f"{text!r} has no host")
    if port_text is None:
        return host, default_port
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"port {port_text!r} in {text!r} must be a number in 1..65535")
    return host, int(port_text)


async def _serve(client: WorkerClient) -> None:
    loop = asyncio.get_running_loop()

    def on_signal(name: str) -> None:
        log.info("stopping", signal=name)
        client.stop()

    for sig in (signal.SIGINT, signal.SIGTERM):
        # Not on every platform; there Ctrl-C arrives as KeyboardInterrupt instead.
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, on_signal, sig.name)
    try:
        await client.run()
    finally:
        # The worker is ending (a finished run, a stop, an error): a stop signal now, such
        # as a launcher stopping every worker as the run ends, must not kill the exit with
        # status 143. Closing the loop would restore the default action; ignore it instead.
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.remove_signal_handler(sig)
                signal.signal(sig, signal.SIG_IGN)


@command()
@click.argument("coordinator", metavar="HOST[:PORT]", envvar="EGGROLL_COORDINATOR")
@click.option(
    "--port",
    type=click.IntRange(1, 65535),
    default=DEFAULT_PORT,
    show_default=True,
    help="Coordinator port; a port in HOST:PORT wins.",
)
@data_dir_option(Path("data"), DATA_DIR_HELP, file_okay=True)
@click.option(
    "--backend",
    type=click.Choice(["auto", "numpy", "cupy", "torch"]),
    default="auto",
    show_default=True,
    help="Compute backend; auto is cupy when CuPy sees a CUDA GPU, else numpy, and torch "
    "(PyTorch, the hf extra) for a Hugging Face model.",
)
@click.option(
    "--name",
    default=None,
    help="Name in the coordinator's logs and metrics [default: HOSTNAME-PID].",
)
@token_file_option(
    "File holding the coordinator's token (mode 600; or the EGGROLL_TOKEN variable)."
)
@pem_option("--tls-ca", "Connect with TLS, trusting this CA for the coordinator's certificate.")
@pem_option(
    "--tls-cert",
    "This worker's certificate, for a coordinator that requires one (with --tls-key).",
)
@pem_option("--tls-key", "The private key of --tls-cert (PEM).")
@log_format_option
@click.option(
    "--batch-members",
    type=click.IntRange(min=2),
    default=None,
    help="Members per forward pass; lower it if memory runs short. Default: the backend's "
    "own (1024 numpy, 32768 cupy, 64 torch, which takes at most 64).",
)
@click.option(
    "--max-retry-s",
    type=click.FloatRange(min=0.1),
    default=30.0,
    show_default=True,
    help="Longest wait between reconnect attempts, in seconds.",
)
@click.option(
    "--goal-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Folder of a run's goal files (reward, prompts, --init-from checkpoint, a Hugging "
    "Face model directory), as the run config names them relative to its own folder.",
)
@click.option(
    "--kernel-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Folder of prebuilt CUDA kernels (python -m eggroll_dist.worker.backend.prebuild "
    "DIR): the CuPy backend loads its device's cubin from there instead of compiling.",
)
@reward_timeout_option
@threads_option
def main(
    coordinator: str,
    port: int,
    data_dir: Path,
    backend: str,
    name: str | None,
    token_file: Path | None,
    tls_ca: Path | None,
    tls_cert: Path | None,
    tls_key: Path | None,
    log_format: str,
    batch_members: int | None,
    max_retry_s: float,
    goal_dir: Path | None,
    reward_timeout: float,
    threads: int | None,
    kernel_dir: Path | None,
) -> None:
    """Serve the coordinator at HOST[:PORT]: evaluate chunks, apply every committed step.

    Reconnects on its own when the coordinator goes away or restarts; stops cleanly on
    SIGINT or SIGTERM.
    """
    configure_logging(log_format)
    try:
        host, port = parse_address(coordinator, port)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="HOST[:PORT]") from None
    name = _check_name(default_worker_name() if name is None else name)
    if kernel_dir is not None:  # the backend reads the variable where it builds its kernels
        os.environ[KERNEL_DIR_ENV] = str(kernel_dir.resolve())
    token, tls = _credentials(token_file, tls_ca, tls_cert, tls_key)
    try:
        factory = get_backend(backend, batch_members, threads, goal_dir)
        dataset = load_data_dir(data_dir)
    except (BackendUnavailable, DataError) as exc:
        error = click.ClickException(str(exc))
        error.exit_code = 2 if isinstance(exc, BackendUnavailable) else 1
        raise error from None
    client = WorkerClient(
        host,
        port,
        dataset,
        backend=factory,
        name=name,
        token=token,
        tls=tls,
        max_retry_s=max_retry_s,
        goal_dir=goal_dir,
        reward_timeout_s=reward_timeout,
    )
    log.info(
        "worker starting",
        name=name,
        coordinator=f"{host}:{port}",
        backend=factory.name,
        device=factory.device,
        threads=factory.threads,
        data_dir=str(data_dir),
        data_sha256=dataset.digest.hex()[:16],
        vocab=dataset.meta.vocab_size,
    )
    _run(client)


def _check_name(name: str) -> str:
    """The worker's name, if the protocol can carry it."""
    if len(name.encode("utf-8")) > MAX_WORKER_NAME_BYTES:
        raise click.BadParameter(
            f"{len(name.encode('utf-8'))} bytes of UTF-8; the limit is {MAX_WORKER_NAME_BYTES}",
            param_hint="--name",
        )
    return name


def _credentials(
    token_file: Path | None, tls_ca: Path | None, tls_cert: Path | None, tls_key: Path | None
) -> tuple[bytes, ssl.SSLContext | None]:
    """The run's token and the TLS context to connect with (None: plain TCP)."""
    try:
        token = load_token(token_file)
        tls = None
        if tls_ca is not None:
            tls = client_tls_context(tls_ca, tls_cert, tls_key)
        elif tls_cert is not None or tls_key is not None:
            raise TokenError("--tls-cert and --tls-key need --tls-ca (the coordinator's CA)")
    except (TokenError, OSError, ValueError) as exc:
        raise OneLineError(str(exc)) from None
    return token, tls


def _run(client: WorkerClient) -> None:
    """Serve until the run ends or a stop; a fatal refusal exits with its own status."""
    try:
        asyncio.run(_serve(client))
    except WorkerFatal as exc:
        error = OneLineError(str(exc))
        error.exit_code = exc.status
        raise error from None
    except RunFinished as exc:
        log.info("stopped", reason=str(exc))
        return
    except KeyboardInterrupt:
        pass  # platforms without loop signal handlers: Ctrl-C is a normal stop too
    log.info("stopped")
    if client.replica.left_running:
        # The backend thread is inside a chunk nobody will read. Finalizing the interpreter
        # under it aborts PyTorch ("terminate called without an active exception", status
        # 134, which supervisors take for a crash): the stop is clean, so end at once.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
