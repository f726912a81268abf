"""`eggroll-coordinator`: serve a run from a save directory (new or resumed)."""

from __future__ import annotations

import asyncio
import errno
import sys
from pathlib import Path

import click

from ..protocol import DEFAULT_PORT
from ..shared.cli import config_options, log_format_option
from ..shared.config import ConfigError, resolve_config
from ..shared.logs import configure_logging
from .metrics import Metrics
from .server import Coordinator, Options
from .store import RunStore, StoreError


def _run(store: RunStore, options: Options, metrics: Metrics) -> None:
    async def serve() -> None:
        await Coordinator(store, options, metrics).run()

    try:
        import uvloop
    except ImportError:  # uvloop is optional on platforms without it
        asyncio.run(serve())
    else:
        uvloop.run(serve())


@click.command(
    context_settings={"help_option_names": ["-h", "--help"], "auto_envvar_prefix": "EGGROLL"}
)
@click.option(
    "--save-dir",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Run directory: created for a new run, resumed when it holds one.",
)
@click.option("--host", default="0.0.0.0", show_default=True, help="Address to listen on.")
@click.option(
    "--port",
    default=DEFAULT_PORT,
    show_default=True,
    type=click.IntRange(0, 65535),
    help="TCP port (0: pick a free one; the 'listening' line says which).",
)
@config_options(" for a new run")
@click.option(
    "--max-steps",
    type=click.IntRange(min=1),
    default=None,
    help="Once this many steps are committed: final snapshot, exit 0.",
)
@click.option(
    "--snapshot-every",
    type=click.IntRange(min=0),
    default=100,
    show_default=True,
    help="Snapshot the replica state every K steps (0: only at the end).",
)
@click.option("--keep-snapshots", type=click.IntRange(min=1), default=3, show_default=True)
@click.option(
    "--chunk-timeout",
    type=click.FloatRange(min=0.1),
    default=None,
    help="Seconds before a leased chunk is leased again (default: adapted to the "
    "chunk times seen, 3x the median, at least 5 s).",
)
@click.option(
    "--metrics-port",
    default=12346,
    show_default=True,
    type=click.IntRange(0, 65535),
    help="Serve Prometheus metrics at http://HOST:PORT/metrics (0: off).",
)
@click.option("--token", default="", help="Shared secret workers must present (HMAC).")
@log_format_option
def main(
    save_dir: Path,
    host: str,
    port: int,
    preset_name: str | None,
    config_path: str | None,
    max_steps: int | None,
    snapshot_every: int,
    keep_snapshots: int,
    chunk_timeout: float | None,
    metrics_port: int,
    token: str,
    log_format: str,
) -> None:
    """Coordinate an EGGROLL run: lease chunks to workers, commit each step durably.

    Every flag can also be set as EGGROLL_<FLAG> (e.g. EGGROLL_SAVE_DIR, EGGROLL_TOKEN).
    """
    configure_logging(log_format)
    try:
        given = resolve_config(preset_name, config_path) if preset_name or config_path else None
        if given is None and not (save_dir / "run.json").exists():
            given = resolve_config(None, None)  # a new run without flags: the default preset
        store = RunStore.open(save_dir, given)
    except (ConfigError, StoreError) as exc:
        raise click.ClickException(str(exc)) from None
    options = Options(
        host=host,
        port=port,
        token=token.encode(),
        max_steps=max_steps,
        snapshot_every=snapshot_every,
        keep_snapshots=keep_snapshots,
        chunk_timeout_s=chunk_timeout,
    )
    metrics = Metrics()
    if metrics_port:
        try:
            metrics.serve(metrics_port, host)
        except OSError as exc:
            store.close()
            raise click.ClickException(
                f"cannot serve metrics on {host}:{metrics_port} ({exc.strerror}): pass another "
                "--metrics-port, or 0 to turn metrics off"
            ) from None
    try:
        _run(store, options, metrics)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise click.ClickException(
                f"port {port} on {host} is in use: stop the other process or pass --port"
            ) from None
        raise click.ClickException(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    finally:
        store.close()
    sys.exit(0)
