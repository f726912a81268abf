"""What a worker's exit status means to the command that supervises it: whether the other
workers go on, and what that command's own exit status becomes.

eggroll-local and eggroll-ray judge each end with `exit_policy` and sum them up with
`Tally`; deploy/run-workers.sh follows the same table in bash, and deploy/README.md ("When a
worker exits") states it. This module is the table's source of truth: change the three
together.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Protocol

from .session_types import COMPUTES_DIFFERENTLY

LOST = None  # the status of a worker whose Ray actor died with its node (eggroll-ray)
SHELL_SIGNAL = 128  # a shell reports a death by signal N as 128 + N
_MAX_SIGNAL = 64  # SIGRTMAX on Linux: 128 + N above this is an ordinary exit status

# What an end is (`Verdict.kind`).
STOPPED = "stopped"  # 0: the run is complete, or a clean stop (ours, or a signal's)
FAULTY = "faulty"  # COMPUTES_DIFFERENTLY: outvoted again and again (a faulty device?)
KILLED = "killed"  # by a signal: the OOM killer, a kill -9
LOST_KIND = "lost"  # with its Ray actor or node
FAILED = "failed"  # 2 (a bad flag, the run's config or data refused it) or any other


@dataclass(frozen=True)
class Verdict:
    """One worker's end: what it is (`kind`), whether the others stop (`stop_all`), and the
    supervisor's exit status should this end decide it (`code`)."""

    kind: str
    stop_all: bool
    code: int


def killed_by(status: int | None) -> int | None:
    """The signal that killed a worker of this exit status (negative as Python's Popen
    gives it, or 128 + N as a shell does), else None."""
    if status is None or status == 0:
        return None
    if status < 0:
        return -status
    if SHELL_SIGNAL < status <= SHELL_SIGNAL + _MAX_SIGNAL:
        return status - SHELL_SIGNAL
    return None


def exit_policy(status: int | None, asked: bool = False) -> Verdict:
    """The verdict on a worker that ended with `status` (LOST: its Ray actor died), when the
    supervisor had `asked` every worker to stop or not.

    A failure every worker would share (2: a bad flag, a config or data the run refuses, a
    refused token; 1 and any other: bad data, a crash) stops the others, and its status is
    the supervisor's. A run complete or a clean stop (0), a worker that computes
    differently (3), one killed by a signal (128 + N; our own SIGTERM while stopping counts
    as a clean stop) or lost with its node (1) ends alone: the others are fine. Once a stop
    is asked, no end stops anything more."""
    if status is LOST:
        return Verdict(LOST_KIND, False, 1)
    if status == 0:
        return Verdict(STOPPED, False, 0)
    signum = killed_by(status)
    if signum is not None:
        if asked and signum == signal.SIGTERM:  # ours, before its handlers were in place
            return Verdict(STOPPED, False, 0)
        return Verdict(KILLED, False, SHELL_SIGNAL + signum)
    if status == COMPUTES_DIFFERENTLY:
        return Verdict(FAULTY, False, status)
    return Verdict(FAILED, not asked, status)


class _End(Protocol):
    @property
    def stop_all(self) -> bool: ...

    @property
    def code(self) -> int: ...


class Tally:
    """The supervisor's exit status: that of the worker whose end stopped the others, else
    the first non-zero one in the order they ended, else 0."""

    def __init__(self) -> None:
        self.cause: int | None = None
        self.first = 0

    def add(self, end: _End) -> None:
        if end.stop_all and self.cause is None:
            self.cause = end.code
        if self.first == 0:
            self.first = end.code

    @property
    def status(self) -> int:
        return self.cause if self.cause is not None else self.first
