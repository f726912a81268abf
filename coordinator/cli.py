"""`eggroll-coordinator`: serve a run from a save directory (new or resumed)."""

from __future__ import annotations

import asyncio
import errno
import ssl
import sys
from collections.abc import Callable
from pathlib import Path

import click

from ..protocol import DEFAULT_PORT
from ..protocol.security import (
    TOKEN_ENV,
    TokenError,
    load_token,
    new_token,
    server_tls_context,
    worker_credential,
)
from ..shared.cli import (
    OneLineError,
    command,
    config_options,
    data_dir_option,
    every_option,
    init_from_option,
    log_format_option,
    metrics_port_option,
    pem_option,
    run_config,
    save_dir_option,
    token_file_option,
    tracking_options,
)
from ..shared.config import ConfigError, RunConfig
from ..shared.data import DataError, DataMeta, load_data_dir
from ..shared.logs import configure_logging
from ..shared.pinned import GoalError
from ..shared.run_writer import SNAPSHOTS_KEPT
from ..shared.save_dir import Layout, baselines_record
from ..shared.tracking import Tracker, TrackingError, check_available, open_tracker
from .core_types import RunOptions
from .metrics import Metrics
from .run import Fatal, Halted
from .server import Coordinator, Listener, Options
from .store import RunStore, StoreError


class HaltedError(click.ClickException):
    """Workers' results differ where no machine can decide (`Halted`): one line, exit
    status 3, every committed step kept for the restart that resumes."""

    exit_code = 3


def _data(data_dir: Path | None, hex_digest: str | None) -> tuple[bytes | None, DataMeta | None]:
    """The run's data digest, and the data's meta.json (its baselines) with --data-dir."""
    if data_dir is not None and hex_digest is not None:
        raise ValueError("give --data-dir or --data-digest, not both")
    if data_dir is not None:
        dataset = load_data_dir(data_dir)
        return dataset.digest, dataset.meta
    if hex_digest is not None:
        digest = bytes.fromhex(hex_digest)
        if len(digest) != 32:
            raise ValueError("--data-digest is 64 hex digits (sha256, `eggroll-data info`)")
        return digest, None
    return None, None


def _print_join(host: str, port: int, tls: bool) -> None:
    token = new_token()
    where = host if host not in ("0.0.0.0", "::") else "COORDINATOR_HOST"
    tls_flag = " --tls-ca ca.pem" if tls else ""
    click.echo(
        f"{token}\n\n"
        "# on the coordinator and on every worker host, keep it in a file only you can read:\n"
        f"(umask 077 && echo {token} > eggroll.token)\n"
        "eggroll-coordinator --save-dir ./checkpoints/run1 --token-file eggroll.token\n"
        f"eggroll-worker {where}:{port} --token-file eggroll.token{tls_flag}"
    )


def _hand_out(
    new: bool, enrol: str | None, token_file: Path | None, host: str, port: int, tls: bool
) -> bool:
    """--new-token or --enrol: print what to hand out (and run nothing); False otherwise."""
    if new:
        _print_join(host, port, tls)
    elif enrol is not None:
        _enrol(enrol, token_file, host, port)
    return new or enrol is not None


def _enrol(name: str, token_file: Path | None, host: str, port: int) -> None:
    """Print the credential of worker `name` and the command that uses it."""
    try:
        token = load_token(token_file)
    except (TokenError, OSError) as exc:
        raise OneLineError(str(exc)) from None
    if not token:
        raise OneLineError(
            "--enrol derives the credential from the run's token: give --token-file or "
            "EGGROLL_TOKEN"
        )
    credential = worker_credential(token, name)
    if credential is None:
        raise OneLineError(f"--enrol {name!r}: a name is 1 to 64 letters, digits, '.', '_', '-'")
    where = host if host not in ("0.0.0.0", "::") else "COORDINATOR_HOST"
    click.echo(
        f"{credential.decode()}\n\n"
        f"# on the worker host of {name}, in a file only its user can read:\n"
        f"(umask 077 && echo {credential.decode()} > {name}.credential)\n"
        f"eggroll-worker {where}:{port} --name {name} --token-file {name}.credential"
    )


def _run(
    open_store: Callable[[], RunStore],
    options: Options,
    metrics: Metrics,
    start_tracking: Callable[[RunStore], Tracker | None],
) -> None:
    """Bind the port, then open the save directory, start tracking and serve it: a port in
    use leaves nothing written, and the corrected command (another preset too) starts
    afresh."""

    async def serve() -> None:
        listener = await Listener.bind(options)
        store = open_store()
        tracker = None
        try:
            tracker = start_tracking(store)
            await Coordinator(store, options, metrics, tracker=tracker).run(listener)
        finally:
            if tracker is not None:
                tracker.close()
            store.close()

    try:
        import uvloop
    except ImportError:  # uvloop is optional on platforms without it
        asyncio.run(serve())
    else:
        uvloop.run(serve())


def _security(
    token_file: Path | None,
    tls_cert: Path | None,
    tls_key: Path | None,
    tls_client_ca: Path | None,
    machine_identity: str,
) -> tuple[bytes, ssl.SSLContext | None]:
    """The token and the TLS context; flags that do not go together are a usage error."""
    token = load_token(token_file)
    tls = None
    if tls_cert is not None or tls_key is not None:
        if tls_cert is None or tls_key is None:
            raise click.UsageError("--tls-cert and --tls-key go together")
        tls = server_tls_context(tls_cert, tls_key, tls_client_ca)
    if machine_identity == "certificate" and (tls is None or tls_client_ca is None):
        raise click.UsageError(
            "--machine-identity certificate needs mutual TLS: --tls-cert, --tls-key and "
            "--tls-client-ca"
        )
    return token, tls


def _given_config(
    save_dir: Path, preset_name: str | None, config_path: str | None, init_from: Path | None
) -> tuple[RunConfig | None, Path | None]:
    """The config and goal folder given for a new run; (None, None) to resume one."""
    try:
        given, base = None, None
        if preset_name or config_path or init_from or not Layout(save_dir).run_file.exists():
            # a new run without flags: the default preset
            given, base = run_config(preset_name, config_path, init_from)
    except (ConfigError, GoalError) as exc:
        raise click.ClickException(str(exc)) from None
    return given, base


def _serve_metrics(metrics_port: int, metrics_host: str) -> Metrics:
    """The run's metrics, served over HTTP unless --metrics-port is 0."""
    metrics = Metrics()
    if metrics_port:  # before the save directory, which a failure here must leave alone
        try:
            metrics.serve(metrics_port, metrics_host)
        except OSError as exc:
            raise click.ClickException(
                f"cannot serve metrics on {metrics_host}:{metrics_port} ({exc.strerror}): pass "
                "another --metrics-port, or 0 to turn metrics off"
            ) from None
    return metrics


def _tracking(
    save_dir: Path, meta: DataMeta | None, tensorboard: Path | None, wandb_project: str | None
) -> Callable[[RunStore], Tracker | None]:
    """What starts the run's tracking once its save directory is open."""
    baselines = None if meta is None else (meta.baselines, meta.baselines_per_byte)

    def start_tracking(store: RunStore) -> Tracker | None:
        if baselines is not None:
            store.record_history(baselines_record(*baselines))  # for eggroll-inspect --plot
        return open_tracker(
            tensorboard,
            wandb_project,
            start_step=store.steps,
            run_id=store.run_id.hex(),
            name=save_dir.name,
            config={"run_id": store.run_id.hex(), **store.config.to_dict()},
            baselines=baselines,
        )

    return start_tracking


def _serve(
    open_store: Callable[[], RunStore],
    options: Options,
    metrics: Metrics,
    start_tracking: Callable[[RunStore], Tracker | None],
) -> None:
    """`_run`, its failures told in one line each."""
    host, port = options.host, options.port
    try:
        _run(open_store, options, metrics, start_tracking)
    except (Fatal, StoreError) as exc:
        raise click.ClickException(str(exc)) from None
    except Halted as exc:
        raise HaltedError(str(exc)) from None
    except TrackingError as exc:
        raise OneLineError(str(exc)) from None
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise click.ClickException(
                f"port {port} on {host} is in use: stop the other process or pass --port"
            ) from None
        raise click.ClickException(f"cannot listen on {host}:{port}: {exc.strerror}") from None


@command()
@save_dir_option(None, "Run directory: created for a new run, resumed when it holds one.")
@click.option(
    "--host",
    default="0.0.0.0",
    show_default=True,
    help="Address to listen on. Without a token only 127.0.0.1 is used (protected mode).",
)
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
@every_option(
    "--snapshot-every", 100, "Snapshot the replica state every K steps (0: only at the end)."
)
@every_option(
    "--sample-every",
    0,
    "Log a sample of the model's writing every N steps, written by an idle worker (0: never).",
)
@click.option(
    "--keep-snapshots",
    type=click.IntRange(min=1),
    default=SNAPSHOTS_KEPT,
    show_default=True,
    help="Snapshots kept in the save directory, the newest (older ones are deleted).",
)
@click.option(
    "--final-snapshot-timeout-s",
    type=click.FloatRange(min=0.0),
    default=120.0,
    show_default=True,
    help="At --max-steps, how long to wait for a worker to send the final snapshot (a "
    "restarted finished run whose snapshot is gone waits this long for a worker to rebuild "
    "it); then it stops without it, exit 0: the fitness log holds every step.",
)
@click.option(
    "--chunk-timeout-s",
    "--chunk-timeout",
    type=click.FloatRange(min=0.1),
    default=None,
    help="Seconds before a leased chunk is leased again (default: 3x the median of the "
    "worker's own chunk times, everyone's before its first, at least 5 s).",
)
@click.option(
    "--rewind-steps",
    type=click.IntRange(min=0),
    default=300,
    show_default=True,
    help="How far back (in steps) a worker's conviction may undo its unconfirmed results: "
    "the run cuts its fitness log back to the first step holding one and evaluates again "
    "from there (older ones stay, logged); with --max-steps the last this many steps are "
    "all checked. 0: never rewind.",
)
@click.option(
    "--verify-fraction",
    type=click.FloatRange(0.0, 1.0),
    default=0.05,
    show_default=True,
    help="Share of each step's chunks, drawn at random, that a second worker scores too: "
    "another machine's while workers on two are connected (one vote per machine and chunk, "
    "see --machine-identity; a machine alone in the run is trusted). A worker whose fitness "
    "loses the vote is dropped with its results of the step, and every result from its "
    "machine is checked from then on. 1: every chunk twice, so that no result counts "
    "without a second machine's; 0: off.",
)
@metrics_port_option("Serve Prometheus metrics at http://METRICS_HOST:PORT/metrics (0: off).")
@click.option(
    "--metrics-host",
    default="127.0.0.1",
    show_default=True,
    help="Address of the metrics endpoint (it has no token: open it to a trusted network only).",
)
@token_file_option(
    f"File holding the shared secret workers must present (mode 600; or ${TOKEN_ENV}). "
    "Without one, only this machine may connect."
)
@click.option(
    "--new-token",
    is_flag=True,
    help="Print a fresh token and the commands that use it, then exit.",
)
@click.option(
    "--enrol",
    "enrol_name",
    metavar="NAME",
    default=None,
    help="Print the credential of the worker NAME (derived from the token), to give that "
    "worker instead of the token, with --name NAME; then exit. Its connections count as one "
    "machine in the checks, whatever their addresses.",
)
@pem_option("--tls-cert", "Serve TLS with this certificate (PEM; with --tls-key).")
@pem_option("--tls-key", "The private key of --tls-cert (PEM).")
@pem_option("--tls-client-ca", "Require worker certificates signed by this CA (mutual TLS).")
@click.option(
    "--machine-identity",
    type=click.Choice(["address", "certificate"]),
    default="address",
    show_default=True,
    help="What stands for a worker's machine in the checks: its IP address, or (with "
    "--tls-client-ca) its certificate (its plain common name, else its issuer and serial), "
    "for machines behind one NAT or with several addresses. Give each machine a "
    "certificate of its own: machines sharing one count as one.",
)
@data_dir_option(
    None,
    "The run's data directory, if this host has it: workers must hold the same data "
    "(and its baselines go into history.log and the tracked curves).",
    exists=True,
)
@click.option(
    "--data-digest",
    default=None,
    help="The run's data digest (hex, `eggroll-data info`), instead of --data-dir. Without "
    "either, the digest two workers agree on.",
)
@click.option(
    "--max-connections",
    type=click.IntRange(min=1),
    default=256,
    show_default=True,
    help="Connections served at once.",
)
@click.option(
    "--max-connections-per-address",
    type=click.IntRange(min=1),
    default=32,
    show_default=True,
    help="Connections served at once from one IP address.",
)
@click.option(
    "--handshake-timeout-s",
    type=click.FloatRange(min=0.1),
    default=10.0,
    show_default=True,
    help="A connection must authenticate within this.",
)
@click.option(
    "--write-timeout-s",
    type=click.FloatRange(min=0.1),
    default=30.0,
    show_default=True,
    help="A worker that does not read what it is sent for this long is dropped.",
)
@init_from_option
@tracking_options
@log_format_option
def main(
    save_dir: Path | None,
    host: str,
    port: int,
    preset_name: str | None,
    config_path: str | None,
    max_steps: int | None,
    snapshot_every: int,
    sample_every: int,
    keep_snapshots: int,
    final_snapshot_timeout_s: float,
    chunk_timeout_s: float | None,
    rewind_steps: int,
    verify_fraction: float,
    metrics_port: int,
    metrics_host: str,
    token_file: Path | None,
    new_token: bool,
    enrol_name: str | None,
    tls_cert: Path | None,
    tls_key: Path | None,
    tls_client_ca: Path | None,
    machine_identity: str,
    data_dir: Path | None,
    data_digest: str | None,
    init_from: Path | None,
    max_connections: int,
    max_connections_per_address: int,
    handshake_timeout_s: float,
    write_timeout_s: float,
    tensorboard: Path | None,
    wandb_project: str | None,
    log_format: str,
) -> None:
    """Coordinate an EGGROLL run: lease chunks to workers, commit each step durably.

    Every flag can also be set as EGGROLL_<FLAG> (e.g. EGGROLL_SAVE_DIR); the token comes
    from --token-file or EGGROLL_TOKEN, never from a command line. Exit status: 0 at
    --max-steps or on SIGINT/SIGTERM; 1 when the save directory cannot be used; 2 for a
    setting that cannot work; 3 when workers' fitness for a chunk differs and no machine
    can decide (a reward that is not deterministic): fix it and start again to resume.
    """
    if _hand_out(new_token, enrol_name, token_file, host, port, tls_cert is not None):
        return
    if save_dir is None:
        raise click.UsageError("Missing option '--save-dir'.")
    configure_logging(log_format)
    try:
        check_available(tensorboard is not None, wandb_project is not None)
        token, tls = _security(token_file, tls_cert, tls_key, tls_client_ca, machine_identity)
        digest, meta = _data(data_dir, data_digest)
    except (TokenError, OSError, ValueError, DataError, TrackingError) as exc:
        raise OneLineError(str(exc)) from None
    given, base = _given_config(save_dir, preset_name, config_path, init_from)
    options = Options(
        host=host,
        port=port,
        tls=tls,
        machine_by_certificate=machine_identity == "certificate",
        run=RunOptions(
            token=token,
            data_digest=digest,
            max_steps=max_steps,
            snapshot_every=snapshot_every,
            sample_every=sample_every,
            chunk_timeout_s=chunk_timeout_s,
            verify_fraction=verify_fraction,
            rewind_steps=rewind_steps,
        ),
        max_connections=max_connections,
        max_connections_per_address=max_connections_per_address,
        handshake_timeout_s=handshake_timeout_s,
        write_timeout_s=write_timeout_s,
        keep_snapshots=keep_snapshots,
        final_snapshot_timeout_s=final_snapshot_timeout_s,
    )
    metrics = _serve_metrics(metrics_port, metrics_host)
    tracking = _tracking(save_dir, meta, tensorboard, wandb_project)
    _serve(lambda: RunStore.open(save_dir, given, base), options, metrics, tracking)
    sys.exit(0)
