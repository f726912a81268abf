"""The command-line options every command spells the same way (click decorators)."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import click

from .config import PRESETS, RunConfig, resolve_config
from .logs import os_error_text
from .pinned import pin

F = TypeVar("F", bound=Callable[..., object])

METRICS_PORT = 12346  # the coordinator's Prometheus endpoint
DATA_DIR_HELP = (
    "Directory with input.bin, valid.bin, decoding.bin, meta.json (eggroll-data prepare)."
)


class OneLineError(click.ClickException):
    """A setting that can never work as given (a refused worker, a bad token file, a usage
    mistake): one line without click's usage text, exit status 2."""

    exit_code = 2


def cannot_write(exc: OSError, where: str | Path) -> click.ClickException:
    """The one line of a command whose write failed (a full disk, EIO): 'cannot write PATH:
    [Errno 28] No space left on device', exit status 1. PATH is the file the error names
    (shared.atomic_file names the file being replaced, not its temporary), else `where`."""
    path = exc.filename if exc.filename is not None else where
    return click.ClickException(f"cannot write {path}: {os_error_text(exc)}")


def _option(
    flag: str, kind: click.ParamType, default: Any, help: str, metavar: str | None = None
) -> Callable[[F], F]:
    """An option whose default, where it has one, shows in --help."""
    shown = None if default is None else True  # None: click's own rule (nothing to show)
    return click.option(
        flag, type=kind, default=default, show_default=shown, metavar=metavar, help=help
    )


def config_options(what: str = "") -> Callable[[F], F]:
    """`--preset NAME` and `--config FILE` (passed as preset_name, config_path); `what` ends
    the help text (e.g. " for a new run")."""

    def decorate(f: F) -> F:
        f = click.option(
            "--config",
            "config_path",
            default=None,
            type=click.Path(dir_okay=False),
            envvar="EGGROLL_CONFIG",
            show_envvar=True,
            help=f"TOML run config{what} (overrides --preset).",
        )(f)
        return click.option(
            "--preset",
            "preset_name",
            default=None,
            envvar="EGGROLL_PRESET",
            show_envvar=True,
            help=f"Named run config{what}: {', '.join(PRESETS)} (default: tiny).",
        )(f)

    return decorate


def log_format_option(f: F) -> F:
    """`--log-format auto|text|json` (passed as log_format)."""
    return click.option(
        "--log-format",
        type=click.Choice(["auto", "text", "json"]),
        default="auto",
        show_default=True,
        envvar="EGGROLL_LOG_FORMAT",
        show_envvar=True,
        help="auto: text on a terminal, JSON lines otherwise.",
    )(f)


def _version() -> str:
    try:
        return importlib.metadata.version("eggroll-distributed")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


class _EnvCommand(click.Command):
    """A command whose every option without an explicit variable reads EGGROLL_<FLAG> (so
    --data-dir reads EGGROLL_DATA_DIR), and whose --help names each variable."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for param in self.params:
            if isinstance(param, click.Option) and param.expose_value:
                long = [o for o in param.opts if o.startswith("--")]
                if param.envvar is None and long:  # named after the flag: --data-dir
                    param.envvar = "EGGROLL_" + long[0][2:].replace("-", "_").upper()
                param.show_envvar = True


class _EnvGroup(click.Group):
    command_class = _EnvCommand


def command(group: bool = False) -> Callable[[F], Any]:
    """`click.command` (or group) of every eggroll command: -h/--help, --version, and each
    option also from an EGGROLL_* variable shown in --help."""

    def decorate(f: F) -> Any:
        f = click.version_option(_version(), "--version", message="%(prog)s %(version)s")(f)
        return click.command(
            cls=_EnvGroup if group else _EnvCommand,
            context_settings={"help_option_names": ["-h", "--help"]},
        )(f)

    return decorate


def threads_option(f: F) -> F:
    """`--threads N` (passed as threads): CPU threads of the NumPy backend."""
    return click.option(
        "--threads",
        type=click.IntRange(min=1),
        default=None,
        envvar="EGGROLL_THREADS",
        show_envvar=True,
        show_default="usable cores / EGGROLL_WORKERS_PER_HOST",
        help="CPU threads of the NumPy backend (per worker); eggroll-train shares them among "
        "the chunks it evaluates side by side.",
    )(f)


def init_from_option(f: F) -> F:
    """`--init-from FILE` (passed as init_from): start a new run from a trained replica."""
    return _option(
        "--init-from",
        click.Path(dir_okay=False, path_type=Path),
        None,
        "Start a new run from this checkpoint or snapshot's weights (fine-tuning, e.g. with a "
        "reward); the run config records it and its replica digest.",
    )(f)


def reward_timeout_option(f: F) -> F:
    """`--reward-timeout SECONDS` (passed as reward_timeout): the reward's time per chunk."""
    return _option(
        "--reward-timeout",
        click.FloatRange(min=0, min_open=True),
        120.0,
        "Seconds the reward function may take on one chunk's completions before it is "
        "stopped (reward runs).",
    )(f)


def data_dir_option(
    default: Path | None, help: str, *, exists: bool = False, file_okay: bool = False
) -> Callable[[F], F]:
    """`--data-dir DIR` (passed as data_dir): a data directory of `eggroll-data prepare`."""
    kind = click.Path(file_okay=file_okay, exists=exists, path_type=Path)
    return _option("--data-dir", kind, default, help)


def save_dir_option(default: Path | None, help: str) -> Callable[[F], F]:
    """`--save-dir DIR` (passed as save_dir): the run directory, resumed when it holds a run."""
    return _option("--save-dir", click.Path(file_okay=False, path_type=Path), default, help)


def steps_option(default: int | None, help: str) -> Callable[[F], F]:
    """`--steps N` (passed as steps): the steps of the run in all."""
    return _option("--steps", click.IntRange(min=1), default, help)


def every_option(flag: str, default: int, help: str) -> Callable[[F], F]:
    """An every-N-steps option such as `--snapshot-every` (0 turns it off)."""
    return _option(flag, click.IntRange(min=0), default, help)


def metrics_port_option(help: str) -> Callable[[F], F]:
    """`--metrics-port PORT` (passed as metrics_port): the coordinator's Prometheus endpoint."""
    return _option("--metrics-port", click.IntRange(0, 65535), METRICS_PORT, help)


def summary_json_option(f: F) -> F:
    """`--summary-json FILE` (passed as summary_json): where the run summary goes."""
    kind = click.Path(dir_okay=False, path_type=Path)
    return _option("--summary-json", kind, None, "Write the run summary here as JSON.")(f)


def max_minutes_option(help: str) -> Callable[[F], F]:
    """`--max-minutes M` (passed as max_minutes): a wall-time limit of the run."""
    return _option("--max-minutes", click.FloatRange(min=0, min_open=True), None, help)


def token_file_option(help: str) -> Callable[[F], F]:
    """`--token-file FILE` (passed as token_file): the file holding the run's token."""
    return _option("--token-file", click.Path(dir_okay=False, path_type=Path), None, help)


def pem_option(flag: str, help: str) -> Callable[[F], F]:
    """A TLS file option such as `--tls-cert` (an existing PEM file, or None)."""
    return _option(flag, click.Path(dir_okay=False, exists=True, path_type=Path), None, help)


def run_config(
    preset_name: str | None, config_path: str | None, init_from: Path | None = None
) -> tuple[RunConfig, Path]:
    """The run config a command starts or continues, with its goal files pinned, and the
    folder they are read under (the config file's; the current one for a preset).
    ConfigError or GoalError with one line."""
    cfg = resolve_config(preset_name, config_path)
    base = Path(config_path).parent if config_path else Path.cwd()
    if init_from is not None:
        cfg = cfg.replace(model=replace(cfg.model, init_from=str(init_from.resolve())))
    return pin(cfg, base), base


def tracking_options(f: F) -> F:
    """`--tensorboard DIR` and `--wandb-project NAME` (passed as tensorboard, wandb_project):
    experiment tracking, off unless asked for (shared/tracking.py)."""
    f = _option(
        "--wandb-project",
        click.STRING,
        None,
        "Log the curves to this W&B project (the run resumes with its save directory; "
        "WANDB_MODE=offline keeps it local). Needs the track extra.",
        metavar="NAME",
    )(f)
    return _option(
        "--tensorboard",
        click.Path(file_okay=False, path_type=Path),
        None,
        "Write TensorBoard event files of the curves into this directory. Needs the track extra.",
        metavar="DIR",
    )(f)
