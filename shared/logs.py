"""Logging of every command: structlog set up once, and the coordinator's log-event contract.

A human line on a terminal, JSON lines otherwise. `eggroll-local` runs the coordinator as a
subprocess and reads its JSON lines: the events it reads, and the fields each must carry,
are named here (`EVENT_FIELDS`) and checked against the coordinator in the tests.
"""

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


def held_out_fields(
    bits: float,
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
    from the HELD_OUT_FIELDS of an event (a part not measured is left out)."""
    text = f"{fields['valid_bits']:.3f} bits/token"
    if fields.get("valid_bits_per_byte") is not None:
        text += f", {fields['valid_bits_per_byte']:.3f} bits/byte"
    if fields.get("stream_bits") is not None:
        text += f"; long streams {fields['stream_bits']:.3f} bits/token"
        if fields.get("stream_bits_per_byte") is not None:
            text += f", {fields['stream_bits_per_byte']:.3f} bits/byte"
    return text


def baselines_text(per_token: dict, per_byte: dict) -> str:
    """'unigram 4.694, bigram 3.805, gzip -9 2.634 bits/token (2.930, 1.986, 2.634 bits/byte)':
    the data's baselines, per byte too where meta.json has them."""
    names = ("unigram", "bigram", "gzip9")
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


def configure_logging(log_format: str = "auto") -> None:
    """`auto` picks text on a terminal and JSON lines otherwise; NO_COLOR is respected.

    Text that came from a peer (worker names, log lines) can hold control characters: the
    text renderer gets them escaped (`\\x1b`), so nobody can write terminal escapes into an
    operator's terminal; JSON escapes them by itself.
    """
    if log_format == "auto":
        log_format = "text" if sys.stderr.isatty() else "json"
    renderer = (
        structlog.processors.JSONRenderer()
        if log_format == "json"
        else structlog.dev.ConsoleRenderer(
            colors=sys.stderr.isatty() and "NO_COLOR" not in os.environ, sort_keys=False
        )
    )
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            *([] if log_format == "json" else [_escape_controls]),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=structlog.PrintLoggerFactory(_Stderr()),
        cache_logger_on_first_use=False,
    )
