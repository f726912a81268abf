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
    return click.option(
        "--init-from",
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        help="Start a new run from this checkpoint or snapshot's weights (fine-tuning, e.g. "
        "with a reward); the run config records it and its replica digest.",
    )(f)


def reward_timeout_option(f: F) -> F:
    """`--reward-timeout SECONDS` (passed as reward_timeout): the reward's time per chunk."""
    return click.option(
        "--reward-timeout",
        type=click.FloatRange(min=0, min_open=True),
        default=120.0,
        show_default=True,
        help="Seconds the reward function may take on one chunk's completions before it is "
        "stopped (reward runs).",
    )(f)


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
    f = click.option(
        "--wandb-project",
        default=None,
        metavar="NAME",
        help="Log the curves to this W&B project (the run resumes with its save directory; "
        "WANDB_MODE=offline keeps it local). Needs the track extra.",
    )(f)
    return click.option(
        "--tensorboard",
        type=click.Path(file_okay=False, path_type=Path),
        default=None,
        metavar="DIR",
        help="Write TensorBoard event files of the curves into this directory. Needs the track "
        "extra.",
    )(f)
