"""The command-line options every command spells the same way (click decorators)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import click

F = TypeVar("F", bound=Callable[..., object])


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
            help=f"Named run config{what}: tiny (default), egg-paper.",
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
