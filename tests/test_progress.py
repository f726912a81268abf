"""Progress of long work: periodic lines in a log, a bar on a terminal, readable durations."""

from __future__ import annotations

import io

import pytest

from eggroll_dist.shared.progress import YEAR_S, Progress, duration_text


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _lines(total: int | None, unit: str = "steps") -> tuple[Progress, list[str], Clock]:
    clock, said = Clock(), []
    progress = Progress(
        "replay", total, unit, say=lambda p: said.append(p.line()), bar=None, clock=clock
    )
    return progress, said, clock


def test_a_log_gets_a_line_per_tenth_of_the_work() -> None:
    progress, said, clock = _lines(1000)
    for _ in range(1000):
        clock.now += 0.001
        progress.advance()
    progress.finish()
    assert len(said) == 11  # ten tenths, then the last line
    assert said[0].startswith("replay 100/1,000 steps (10%), 0s, ETA 1s")
    assert said[-1].startswith("replay 1,000/1,000 steps (100%), 1s")
    assert "ETA" not in said[-1]


def test_a_log_gets_a_line_every_few_seconds_when_the_total_is_unknown() -> None:
    progress, said, clock = _lines(None, "B")
    for _ in range(30):
        clock.now += 1.0
        progress.advance(1_500_000)
    assert said == [f"replay {n * 7.5:.1f} MB, {n * 5}s" for n in range(1, 7)]
    progress.finish(say=False)
    assert len(said) == 6


def test_fields_for_a_structured_log() -> None:
    progress, _, clock = _lines(400)
    clock.now += 2.0
    progress.update(100)
    assert progress.fields() == {
        "work": "replay",
        "done": 100,
        "total": 400,
        "unit": "steps",
        "percent": 25,
        "seconds": 2.0,
        "eta_s": 6.0,
    }


def test_an_estimated_total_ends_at_what_was_done() -> None:
    progress, said, _ = _lines(2_000_000, "B")
    progress.update(1_900_000)
    progress.finish()
    assert said[-1].startswith("replay 1.9/1.9 MB (100%)")


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_one_bar_redrawn_in_place() -> None:
    clock, said, tty = Clock(), [], Tty()
    progress = Progress("read", 100, "B", say=lambda p: said.append(p), bar=tty, clock=clock)
    for _ in range(100):
        clock.now += 0.05
        progress.advance()
    progress.finish()
    out = tty.getvalue()
    assert said == []  # no log lines on a terminal
    assert out.endswith("\n") and out.count("\n") == 1
    draws = out.split("\r\x1b[K")[1:]
    assert 20 <= len(draws) <= 30  # at most every 0.2 s, not at every unit
    assert draws[-1].startswith("[" + "#" * 24 + "] read 0.0/0.0 MB (100%)")


def test_a_terminal_that_fails_leaves_the_work_going() -> None:
    class Gone(Tty):
        def write(self, text: str) -> int:
            raise OSError(5, "Input/output error")

    clock = Clock()
    progress = Progress("read", 10, say=None, bar=Gone(), clock=clock)
    clock.now += 1
    progress.update(5)
    progress.finish()
    assert not progress.on_terminal and progress.done == 5


@pytest.mark.parametrize(
    "seconds,text",
    [
        (0.4, "0s"),
        (42, "42s"),
        (572, "9m32s"),
        (7500, "2h05m"),
        (3 * 86400 + 4 * 3600 + 59, "3d04h"),
        (535_000_000, "6,192d03h"),
    ],
)
def test_durations_read_in_two_units_at_most(seconds: float, text: str) -> None:
    assert duration_text(seconds) == text
    assert YEAR_S == 365 * 86400


def test_quick_work_with_a_quiet_start_says_nothing() -> None:
    clock, said, tty = Clock(), [], Tty()
    for bar in (None, tty):
        progress = Progress("upload", 10, say=said.append, bar=bar, quiet_s=2.0, clock=clock)
        for _ in range(10):
            clock.now += 0.1
            progress.advance()
        progress.finish()
    assert said == [] and tty.getvalue() == ""
    done: list[int] = []
    slow = Progress(
        "upload", 10, say=lambda p: done.append(p.done), bar=None, quiet_s=2.0, clock=clock
    )
    for _ in range(10):
        clock.now += 0.5
        slow.advance()
    assert done == [4, 5, 6, 7, 8, 9, 10]  # from 2 s on, a line per tenth
