"""structlog set-up for worker commands: a human line on a TTY, JSON lines otherwise."""

from __future__ import annotations

import logging
import os
import sys

import structlog


class _Stderr:
    """stderr that drops writes once the reader is gone (a closed pipe must not turn every
    log call into an exception, least of all during shutdown)."""

    def write(self, text: str) -> int:
        try:
            return sys.stderr.write(text)
        except (OSError, ValueError):
            return 0

    def flush(self) -> None:
        try:
            sys.stderr.flush()
        except (OSError, ValueError):
            pass


def configure_logging(log_format: str = "auto") -> None:
    """`auto` picks text on a terminal and JSON lines otherwise; NO_COLOR is respected."""
    if log_format == "auto":
        log_format = "text" if sys.stderr.isatty() else "json"
    processors: list = [
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if log_format == "json":
        processors.append(structlog.processors.JSONRenderer())
    else:
        colors = sys.stderr.isatty() and "NO_COLOR" not in os.environ
        processors.append(structlog.dev.ConsoleRenderer(colors=colors))
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=structlog.PrintLoggerFactory(_Stderr()),
        cache_logger_on_first_use=False,
    )
