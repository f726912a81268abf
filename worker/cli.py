"""`eggroll-worker HOST[:PORT]`: hold a replica, evaluate chunks for a coordinator.

Every option can also be set from the environment (EGGROLL_PORT, EGGROLL_DATA_DIR,
EGGROLL_BACKEND, EGGROLL_NAME, EGGROLL_TOKEN, EGGROLL_LOG_FORMAT, EGGROLL_BATCH_MEMBERS,
EGGROLL_MAX_RETRY_S), and the coordinator address from EGGROLL_COORDINATOR, which suits
service files and containers. Exit codes: 0 after SIGINT/SIGTERM, 1 for a local problem
(missing data, bad option), 2 when the coordinator refuses the worker for good (wrong
token, other data, other protocol version, a config it cannot run).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from pathlib import Path

import click
import structlog

from eggroll_dist.shared.data import DataError, load_data_dir
from eggroll_dist.worker.backend import BackendUnavailable, get_backend
from eggroll_dist.worker.client import (
    DEFAULT_PORT,
    MAX_WORKER_NAME_BYTES,
    WorkerClient,
    WorkerFatal,
    default_worker_name,
)
from eggroll_dist.worker.log import configure_logging

log = structlog.get_logger("eggroll.worker")


class RefusedError(click.ClickException):
    """The coordinator refused this worker for good: one line, exit status 2."""

    exit_code = 2


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
    await client.run()


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("coordinator", metavar="HOST[:PORT]", envvar="EGGROLL_COORDINATOR")
@click.option(
    "--port",
    type=click.IntRange(1, 65535),
    default=DEFAULT_PORT,
    show_default=True,
    envvar="EGGROLL_PORT",
    show_envvar=True,
    help="Coordinator port; a port in HOST:PORT wins.",
)
@click.option(
    "--data-dir",
    type=click.Path(path_type=Path),
    default=Path("."),
    show_default="the current directory",
    envvar="EGGROLL_DATA_DIR",
    show_envvar=True,
    help="Directory with input.bin, valid.bin, decoding.bin, meta.json (eggroll-data prepare).",
)
@click.option(
    "--backend",
    type=click.Choice(["auto", "numpy", "cupy"]),
    default="auto",
    show_default=True,
    envvar="EGGROLL_BACKEND",
    show_envvar=True,
    help="Compute backend; auto is cupy when CuPy sees a CUDA GPU, else numpy.",
)
@click.option(
    "--name",
    default=None,
    envvar="EGGROLL_NAME",
    show_envvar=True,
    help="Name in the coordinator's logs and metrics [default: HOSTNAME-PID].",
)
@click.option(
    "--token",
    default="",
    envvar="EGGROLL_TOKEN",
    show_envvar=True,
    help="Shared secret, the coordinator's --token (prefer the variable: ps shows options).",
)
@click.option(
    "--log-format",
    type=click.Choice(["auto", "text", "json"]),
    default="auto",
    show_default=True,
    envvar="EGGROLL_LOG_FORMAT",
    show_envvar=True,
    help="auto: text on a terminal, JSON lines otherwise.",
)
@click.option(
    "--batch-members",
    type=click.IntRange(min=2),
    default=1024,
    show_default=True,
    envvar="EGGROLL_BATCH_MEMBERS",
    show_envvar=True,
    help="Members per forward sub-batch: lower it if memory runs short.",
)
@click.option(
    "--max-retry-s",
    type=click.FloatRange(min=0.1),
    default=30.0,
    show_default=True,
    envvar="EGGROLL_MAX_RETRY_S",
    show_envvar=True,
    help="Longest wait between reconnect attempts, in seconds.",
)
def main(
    coordinator: str,
    port: int,
    data_dir: Path,
    backend: str,
    name: str | None,
    token: str,
    log_format: str,
    batch_members: int,
    max_retry_s: float,
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
    name = default_worker_name() if name is None else name
    if len(name.encode("utf-8")) > MAX_WORKER_NAME_BYTES:
        raise click.BadParameter(
            f"{len(name.encode('utf-8'))} bytes of UTF-8; the limit is {MAX_WORKER_NAME_BYTES}",
            param_hint="--name",
        )
    try:
        factory = get_backend(backend, batch_members)
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
        max_retry_s=max_retry_s,
    )
    log.info(
        "worker starting",
        name=name,
        coordinator=f"{host}:{port}",
        backend=factory.name,
        device=factory.device,
        data_dir=str(data_dir),
        data_sha256=dataset.digest.hex()[:16],
        vocab=dataset.meta.vocab_size,
    )
    try:
        asyncio.run(_serve(client))
    except WorkerFatal as exc:
        raise RefusedError(str(exc)) from None
    except KeyboardInterrupt:
        pass  # platforms without loop signal handlers: Ctrl-C is a normal stop too
    log.info("stopped")
