"""Progress of long work: a bar on a terminal, a line now and then anywhere else.

Preparing a large data directory, training a BPE, a joiner's replay of the fitness log and a
snapshot transfer can each take minutes. A `Progress` follows one such piece of work. When
stderr is a terminal it draws one bar there, redrawn in place at most every BAR_S seconds
and left whole at the end. Anywhere else (a log file, JSON lines read by a program) it hands
a line to its `say` callback each time another tenth of the work is done or EVERY_S seconds
have passed, whichever comes first: a log shows the work moving without being flooded.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

EVERY_S = 5.0  # a log line at least this often while the work goes on
EVERY_FRACTION = 0.1  # and at each tenth of it
BAR_S = 0.2  # a terminal's bar is redrawn at most this often
BAR_WIDTH = 24
YEAR_S = 365 * 86400.0


def duration_text(seconds: float) -> str:
    """'42s', '9m32s', '2h05m', '3d04h': two units at most, so a long ETA stays readable."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400:,}d{s % 86400 // 3600:02d}h"


def _amount(n: int, unit: str) -> str:
    if unit == "B":
        return f"{n / 1e6:,.1f} MB"
    return f"{n:,} {unit}".rstrip()


def _terminal() -> TextIO | None:
    try:
        return sys.stderr if sys.stderr.isatty() else None
    except (AttributeError, ValueError):  # no stderr, or a closed one
        return None


class Progress:
    """One piece of long work, `total` units of `unit` ("B" counts bytes, shown in MB; None:
    the total is not known). `bar` is the terminal stream to draw on ("auto": stderr if it
    is a terminal; None: log lines only). `say` hears the Progress at each log line and
    reads `line()` or `fields()`. No line is said in the first `quiet_s` seconds, so that
    work which is usually quick (a snapshot on a fast link) fills no log. `clock` is
    injectable for tests and pure cores."""

    def __init__(
        self,
        what: str,
        total: int | None = None,
        unit: str = "",
        *,
        say: Callable[[Progress], None] | None = None,
        bar: TextIO | str | None = "auto",
        quiet_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what = what
        self.total = total if total is None or total > 0 else None
        self.unit = unit
        self.done = 0
        self._say = say
        self._bar = _terminal() if bar == "auto" else bar
        self._clock = clock
        self._quiet_s = quiet_s
        self.started = clock()
        self._said_at = self.started  # the last log line or bar drawn
        self._said_done = 0
        self.lines = 0  # log lines said so far
        self._drawn = False  # the bar is on the terminal

    @property
    def on_terminal(self) -> bool:
        return self._bar is not None and not isinstance(self._bar, str)

    def advance(self, n: int = 1) -> None:
        self.update(self.done + n)

    def update(self, done: int) -> None:
        """The work has reached `done` units: draw or say it if it is time to."""
        self.done = done
        now = self._clock()
        if now - self.started < self._quiet_s:
            return
        if self.on_terminal:
            if now - self._said_at >= BAR_S:
                self._draw(now)
            return
        step = EVERY_FRACTION * self.total if self.total else None
        if now - self._said_at >= EVERY_S or (step and done - self._said_done >= step):
            self._line(now)

    def finish(self, say: bool = True) -> None:
        """The work is done: the bar is drawn whole and ended; in a log, a last line (unless
        `say` is off, for callers that log a summary of their own). A total that was an
        estimate (the size of the files read) becomes what was done."""
        if self.total is not None and self.done:
            self.total = self.done
        now = self._clock()
        if self.on_terminal:
            if self._drawn or not self._quiet_s:
                self._draw(now)
                self._write("\n")
        elif say and (self.lines or now - self.started >= self._quiet_s):
            self._line(now)

    # --- what is shown ----------------------------------------------------------------

    def seconds(self) -> float:
        return self._clock() - self.started

    def percent(self) -> int | None:
        return None if not self.total else min(100, 100 * self.done // self.total)

    def eta_s(self) -> float | None:
        """Seconds left at the pace so far (None: no total, or nothing done yet)."""
        if not self.total or not self.done:
            return None
        return max(self.total - self.done, 0) * self.seconds() / self.done

    def fields(self) -> dict[str, Any]:
        """The state as log fields: work, done, total, unit, percent, seconds, eta_s."""
        eta = self.eta_s()
        return {
            "work": self.what,
            "done": self.done,
            "total": self.total,
            "unit": self.unit or None,
            "percent": self.percent(),
            "seconds": round(self.seconds(), 1),
            "eta_s": None if eta is None else round(eta, 1),
        }

    def line(self) -> str:
        """'replay 1,280/5,000 steps (25%), 3s, ETA 9s'; 'read 12.3 MB, 4s' with no total."""
        if self.total and self.unit == "B":
            head = f"{self.done / 1e6:,.1f}/{self.total / 1e6:,.1f} MB ({self.percent()}%)"
        elif self.total:
            head = f"{self.done:,}/{_amount(self.total, self.unit)} ({self.percent()}%)"
        else:
            head = _amount(self.done, self.unit)
        text = f"{self.what} {head}, {duration_text(self.seconds())}"
        eta = self.eta_s()
        if eta is not None and self.done < (self.total or 0):
            text += f", ETA {duration_text(eta)}"
        return text

    def _line(self, now: float) -> None:
        self._said_at, self._said_done = now, self.done
        self.lines += 1
        if self._say is not None:
            self._say(self)

    def _draw(self, now: float) -> None:
        self._said_at, self._drawn = now, True
        if self.total:
            filled = min(BAR_WIDTH, BAR_WIDTH * self.done // self.total)
            bar = "[" + "#" * filled + "-" * (BAR_WIDTH - filled) + "] "
        else:
            bar = ""
        # Clear the line, draw, and return to its start: a log line written meanwhile
        # overwrites the bar instead of running on after it.
        self._write(f"\r\x1b[K{bar}{self.line()}\r")

    def _write(self, text: str) -> None:
        assert self._bar is not None and not isinstance(self._bar, str)
        try:
            self._bar.write(text)
            self._bar.flush()
        except (OSError, ValueError):  # a terminal gone: the work goes on without its bar
            self._bar = None
