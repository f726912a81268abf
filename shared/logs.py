"""Logging of every command: structlog set up once, and the coordinator's log-event contract.

A human line on a terminal, JSON lines otherwise. `eggroll-local` runs the coordinator as a
subprocess and reads its JSON lines: the events it reads, and the fields each must carry,
are named here (`EVENT_FIELDS`) and checked against the coordinator in the tests.

An exception logged with `log.exception(...)` (or `exc_info=`) is in the line in both modes:
JSON lines carry `exception` (its type, message and traceback), text prints the traceback.

Logging never stops a process. A console or log file that cannot be written (a full disk,
EIO, a closed pipe) is a `LineSink` that drops lines: it says so once on stderr, tries
again at most every `RETRY_S` seconds (no loop, no stall), and once a line goes through
again it first writes how many were lost.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TextIO

import structlog

RETRY_S = 10.0  # a failed console or log file is tried again at most this often


def os_error_text(exc: OSError) -> str:
    """'[Errno 28] No space left on device': an OSError without its file name."""
    if exc.errno is None:
        return str(exc)
    return f"[Errno {exc.errno}] {exc.strerror or os.strerror(exc.errno)}"


def _warn_stderr(text: str) -> None:
    """A warning line on stderr, in the form the rest of it takes (a JSON line in JSON mode),
    through its own sink: if stderr fails too, the line is dropped and counted there."""
    if STDERR.json_note:
        line = json.dumps({"event": text, "level": "warning", "timestamp": _now()})
    else:
        line = f"warning: {text}"
    STDERR.write(line + "\n")


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


class LineSink:
    """Somewhere log lines go (stderr, stdout, a log file) that may fail to take them.

    `write` never raises: while the target fails, lines are dropped and counted, and the
    next try waits `RETRY_S` seconds (each try is one write call, so a full disk costs
    nothing and a stuck reader is never waited for in a loop). The first failure is said
    once through `warn` (stderr by default; pass None where stderr itself is the target,
    as nothing could carry it). When a line goes through again, a note of how many were
    lost goes first, as a JSON line or as text (`json_note`).
    """

    def __init__(
        self,
        name: str,
        write: Callable[[str], None],
        json_note: bool,
        warn: Callable[[str], None] | None = _warn_stderr,
    ) -> None:
        self.name = name
        self._write = write
        self.json_note = json_note
        self._warn = warn
        self._lock = threading.Lock()  # threads of one process log to the same sink
        self.failed_at: float | None = None
        self.error = ""  # the last failure, for the note
        self.dropped = 0
        self.warned = False

    @property
    def degraded(self) -> bool:
        return self.failed_at is not None

    def write(self, text: str) -> bool:
        """Write `text` (whole lines); False when it was dropped."""
        with self._lock:
            if self.failed_at is not None:
                if time.monotonic() - self.failed_at < RETRY_S:
                    self.dropped += 1
                    return False
                text = self._note() + text
            try:
                self._write(text)
            except (OSError, ValueError) as exc:  # ValueError: the stream was closed
                self._failed(exc)
                return False
            self.failed_at, self.dropped = None, 0
            return True

    def _failed(self, exc: OSError | ValueError) -> None:
        self.failed_at = time.monotonic()
        self.dropped += 1
        self.error = os_error_text(exc) if isinstance(exc, OSError) else str(exc)
        if not self.warned and self._warn is not None:
            self.warned = True
            self._warn(
                f"logging degraded: cannot write {self.name}: {self.error}; its lines are "
                f"dropped until it can be written again"
            )

    def _note(self) -> str:
        if self.json_note:
            return (
                json.dumps(
                    {
                        "event": "log lines lost",
                        "lines": self.dropped,
                        "error": self.error,
                        "level": "warning",
                        "timestamp": _now(),
                    }
                )
                + "\n"
            )
        return f"[{self.dropped} log lines lost: cannot write {self.name}: {self.error}]\n"


def _stream_writer(stream: Callable[[], TextIO]) -> Callable[[str], None]:
    """Write and flush to the stream `stream()` returns at the time (tests swap sys.stderr)."""

    def write(text: str) -> None:
        out = stream()
        out.write(text)
        out.flush()

    return write


class LogFile:
    """A log file that eggroll-local writes lines into: appended whole, unbuffered (one
    write call per line), behind a `LineSink`, so a full disk costs lines and says so on
    stderr once, never the process. A line cut short by the disk is ended before the next
    one goes in, so each line of the file still parses alone."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        self._torn = False
        self.sink = LineSink(str(path), self._append, json_note=True)

    def _append(self, text: str) -> None:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        data = (b"\n" if self._torn else b"") + text.encode("utf-8", "replace")
        wrote = False
        while data:
            try:
                n = os.write(self._fd, data)
            except InterruptedError:
                continue
            except OSError:
                self._torn = self._torn or wrote  # the file now ends inside a line
                raise
            if n == 0:  # no progress and no error: a full disk by another name; never spin
                self._torn = self._torn or wrote
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            wrote = True
            data = data[n:]
        self._torn = False

    def write(self, line: str) -> bool:
        """Append one line (a newline is added if missing); False when it was dropped."""
        return self.sink.write(line if line.endswith("\n") else line + "\n")

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):  # nothing is lost: every write was whole
                os.close(self._fd)
            self._fd = None


# stdout and stderr as sinks: a full disk or closed pipe behind them drops lines, never
# raises into the command. stderr's own failure cannot be said anywhere, so it warns nobody.
STDERR = LineSink("stderr", _stream_writer(lambda: sys.stderr), json_note=False, warn=None)
STDOUT = LineSink("stdout", _stream_writer(lambda: sys.stdout), json_note=False)


def echo(message: str, err: bool = False) -> bool:
    """A line of progress output (click.echo's place) that a full disk cannot break: see
    `LineSink`. Only for output that may be lost; output that is the command's result must
    fail the command instead."""
    return (STDERR if err else STDOUT).write(message + "\n")


class _Stderr:
    """structlog's output: stderr as a `LineSink` (a full disk or a closed pipe must not turn
    every log call into an exception, least of all during shutdown). structlog prints the
    line and its newline in two writes (under its lock): they are joined here, so the sink
    takes, drops and counts whole lines."""

    def __init__(self) -> None:
        self._pending = ""

    def write(self, text: str) -> int:
        self._pending += text
        end = self._pending.rfind("\n") + 1
        if end:
            lines, self._pending = self._pending[:end], self._pending[end:]
            STDERR.write(lines)
        return len(text)

    def flush(self) -> None:
        pass  # whole lines are flushed by the sink


# The coordinator's events that eggroll-local (worker/local.py) acts on, with their fields.
LISTENING = "listening"  # the server is up: the port it bound, the open step
STEP = "step"  # a step was committed
SAMPLE = "sample"  # a worker wrote a sample (prompt and text escaped, one line each)
VALIDATION = "validation"  # the held-out score of the unperturbed model at a step
PROGRESS = "step progress"  # a step still open after a while: how many chunks are in
# A validation's scores (None where not measured): windows from a zero state, then long
# streams with the state carried, each per token and per byte of the held-out text.
HELD_OUT_FIELDS = ("valid_bits", "valid_bits_per_byte", "stream_bits", "stream_bits_per_byte")
EVENT_FIELDS: dict[str, tuple[str, ...]] = {
    LISTENING: ("port", "step"),
    STEP: ("step", "loss_bits", "step_s", "member_tok_s", "workers", "requeued"),
    SAMPLE: ("step", "worker", "prompt", "text"),
    VALIDATION: ("step", *HELD_OUT_FIELDS),
    PROGRESS: ("step", "chunks_done", "chunks", "seconds"),
}
# Further events eggroll-local shows as they come (with every warning and error).
SHOWN_EVENTS = ("worker joined", "worker left", "snapshot stored", "chunks requeued")


def readable(line: str) -> str:
    """A JSON log line as a person reads it on a terminal ('warning: reconnecting reason=...
    attempt=2'); any other line as it is."""
    try:
        event = json.loads(line)
    except ValueError:
        return line
    if not isinstance(event, dict) or "event" not in event:
        return line
    level = event.pop("level", "info")
    event.pop("timestamp", None)
    head = f"{event.pop('event')}" if level == "info" else f"{level}: {event.pop('event')}"
    rest = " ".join(
        f"{k}={v!r}" if isinstance(v, str) and " " in v else f"{k}={v}" for k, v in event.items()
    )
    return (head + " " + rest).rstrip().translate(_CONTROLS)


def held_out_fields(
    bits: float | None,
    bits_per_byte: float | None,
    stream_bits: float | None,
    stream_bits_per_byte: float | None,
) -> dict[str, float | None]:
    """The HELD_OUT_FIELDS of a validation event, rounded to 4 places."""
    values = (bits, bits_per_byte, stream_bits, stream_bits_per_byte)
    return {
        k: None if v is None else round(v, 4) for k, v in zip(HELD_OUT_FIELDS, values, strict=True)
    }


def held_out_text(fields: dict) -> str:
    """'4.374 bits/token, 4.374 bits/byte; long streams 4.357 bits/token, 4.357 bits/byte'
    from the HELD_OUT_FIELDS of an event (a part not measured is left out; a run without
    data measures none)."""
    if fields.get("valid_bits") is None:
        return "no text scores (no data)"
    text = f"{fields['valid_bits']:.3f} bits/token"
    if fields.get("valid_bits_per_byte") is not None:
        text += f", {fields['valid_bits_per_byte']:.3f} bits/byte"
    if fields.get("stream_bits") is not None:
        text += f"; long streams {fields['stream_bits']:.3f} bits/token"
        if fields.get("stream_bits_per_byte") is not None:
            text += f", {fields['stream_bits_per_byte']:.3f} bits/byte"
    return text


def baselines_text(per_token: dict, per_byte: dict, bytes_only: bool = False) -> str:
    """'unigram 4.694, bigram 3.805, gzip -9 2.634 bits/token (2.930, 1.986, 2.634 bits/byte)':
    the data's baselines, per byte too where meta.json has them. `bytes_only`: per byte
    alone, for a model whose tokens are not the data's (its bits per token compare with
    no baseline of the data's)."""
    names = ("unigram", "bigram", "gzip9")
    if bytes_only and all(n in per_byte for n in names):
        text = ", ".join(f"{n.replace('gzip9', 'gzip -9')} {per_byte[n]:.3f}" for n in names)
        return text + " bits/byte"
    text = ", ".join(f"{n.replace('gzip9', 'gzip -9')} {per_token[n]:.3f}" for n in names)
    text += " bits/token"
    if all(n in per_byte for n in names):
        text += " (" + ", ".join(f"{per_byte[n]:.3f}" for n in names) + " bits/byte)"
    return text


_CONTROLS = {c: f"\\x{c:02x}" for c in [*range(0x20), *range(0x7F, 0xA0)]}


def _escape_controls(logger: object, method: str, event: dict) -> dict:
    """Escape C0/C1 control characters in every string value (text output only)."""
    for key, value in event.items():
        if isinstance(value, str) and not value.isprintable():
            event[key] = value.translate(_CONTROLS)
    return event


def _exception_type(exc_type: type) -> str:
    """'OSError', or 'eggroll_dist.coordinator.run.Fatal' for a class outside builtins."""
    if exc_type.__module__ == "builtins":
        return exc_type.__qualname__
    return f"{exc_type.__module__}.{exc_type.__qualname__}"


def exception_fields(logger: object, method: str, event: dict) -> dict:
    """Turn `exc_info` (True, an exception, or a sys.exc_info() tuple) into an `exception`
    field: {type, message, traceback}. A line that says `exc_info: true` and nothing else
    would leave an operator unable to tell a full disk from a bug (JSON output only; the
    text renderer prints the traceback itself)."""
    exc_info = event.pop("exc_info", None)
    if not exc_info:
        return event
    if isinstance(exc_info, BaseException):
        exc_info = (type(exc_info), exc_info, exc_info.__traceback__)
    elif not isinstance(exc_info, tuple):
        exc_info = sys.exc_info()
    exc_type, exc, tb = exc_info
    if exc_type is None or exc is None:  # exc_info=True outside an except block
        return event
    event["exception"] = {
        "type": _exception_type(exc_type),
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(exc_type, exc, tb)),
    }
    return event


def configure_logging(log_format: str = "auto") -> None:
    """`auto` picks text on a terminal and JSON lines otherwise; NO_COLOR is respected.

    Text that came from a peer (worker names, log lines) can hold control characters: the
    text renderer gets them escaped (`\\x1b`), so nobody can write terminal escapes into an
    operator's terminal; JSON escapes them by itself.
    """
    if log_format == "auto":
        log_format = "text" if sys.stderr.isatty() else "json"
    STDERR.json_note = log_format == "json"  # its notes take the form of its lines
    renderer = (
        structlog.processors.JSONRenderer()
        if log_format == "json"
        else structlog.dev.ConsoleRenderer(
            colors=sys.stderr.isatty() and "NO_COLOR" not in os.environ,
            sort_keys=False,
            # The plain traceback: the same text whatever else is installed (rich would box it).
            exception_formatter=structlog.dev.plain_traceback,
        )
    )
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            *([exception_fields] if log_format == "json" else [_escape_controls]),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=structlog.PrintLoggerFactory(_Stderr()),
        cache_logger_on_first_use=False,
    )
