"""Undoing a convicted machine's results (protocol/SPEC.md §8, Rewinds): pure code, no I/O.

A replica's state is a pure function of the run config and the fitness log, so a lie found
late can be undone exactly: cut the log back to the first step that holds one and evaluate
again from there. `Provenance` remembers, for each committed step within the horizon (the
last `horizon` steps), who gave each chunk's result and whether a second group confirmed
it; `plan` turns a conviction into a `Rewind` (or none, or steps left outside the horizon).

A voter is (machine, connection id); a convicted group is trust.py's `Group`: `(machine,)`
in a run of several machines, `(machine, connection)` in a run on one machine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

Voter = tuple[str, int]  # (machine, connection id) of a worker that gave a chunk's result
MAX_EXPIRED = 4096  # machines whose unconfirmed results left the horizon, remembered


@dataclass(frozen=True)
class Source:
    """Who gave a committed chunk's result, and whether two groups agreed on it."""

    voters: tuple[Voter, ...]
    confirmed: bool


@dataclass(frozen=True)
class Rewind:
    """Cut the fitness log back to `to` steps (steps to..end-1 undone)."""

    to: int
    end: int  # steps committed before the rewind
    chunks: int  # suspect results within the horizon
    why: str


@dataclass(frozen=True)
class Outside:
    """Suspect results of a convicted machine that lie beyond the horizon: they stay."""

    first: int
    last: int
    chunks: int
    why: str


def convicts(group: tuple[str, ...], voter: Voter) -> bool:
    """Whether `voter` belongs to the convicted `group` (its machine, or its connection)."""
    return voter[0] == group[0] and (len(group) == 1 or group[1] == str(voter[1]))


class Provenance:
    """Sources of the last `horizon` committed steps' chunks (0: none kept, no rewinds)."""

    def __init__(self, horizon: int) -> None:
        self.horizon = horizon
        self.steps: dict[int, dict[int, Source]] = {}  # step -> chunk -> source
        # machine -> (first step, last step, chunks) of its unconfirmed results forgotten
        self.expired: dict[str, tuple[int, int, int]] = {}

    def record(self, step: int, sources: dict[int, Source]) -> None:
        """Step `step` is committed with these sources; steps past the horizon go."""
        if self.horizon <= 0:
            return
        self.steps[step] = sources
        for old in [s for s in self.steps if s <= step - self.horizon]:
            self._expire(old, self.steps.pop(old))

    def _expire(self, step: int, sources: dict[int, Source]) -> None:
        for source in sources.values():
            if source.confirmed:
                continue
            for machine in {m for m, _ in source.voters}:
                first, _, count = self.expired.pop(machine, (step, step, 0))
                self.expired[machine] = (first, step, count + 1)
        while len(self.expired) > MAX_EXPIRED:
            del self.expired[next(iter(self.expired))]

    def forget_from(self, step: int) -> None:
        """Steps from `step` on are undone."""
        for s in [s for s in self.steps if s >= step]:
            del self.steps[s]

    def suspects(self, group: tuple[str, ...]) -> list[tuple[int, int]]:
        """(step, chunk) of every kept result `group` gave that no second group confirmed."""
        return sorted(
            (step, chunk)
            for step, sources in self.steps.items()
            for chunk, source in sources.items()
            if not source.confirmed and any(convicts(group, v) for v in source.voters)
        )

    def unconfirmed(self) -> dict[int, list[int]]:
        """Step -> chunks whose result no second group confirmed."""
        out = {
            step: sorted(c for c, src in sources.items() if not src.confirmed)
            for step, sources in sorted(self.steps.items())
        }
        return {step: chunks for step, chunks in out.items() if chunks}


def plan(
    provenance: Provenance, groups: Iterable[tuple[str, ...]], end: int, why: str
) -> tuple[Rewind | None, list[Outside]]:
    """What convicting `groups` undoes when `end` steps are committed: a rewind to the first
    step holding one of their unconfirmed results within the horizon (None: no such result),
    and, per machine, its unconfirmed results already outside the horizon (they stay)."""
    suspect: set[tuple[int, int]] = set()
    outside: list[Outside] = []
    for group in groups:
        suspect.update(provenance.suspects(group))
        gone = provenance.expired.get(group[0])
        if gone is not None:
            first, last, count = gone
            outside.append(Outside(first, last, count, f"{why} ({group[0]})"))
    if not suspect:
        return None, outside
    return Rewind(min(s for s, _ in suspect), end, len(suspect), why), outside


def sources(
    votes: dict[int, dict[tuple[bytes, int], list[int]]],
    settled: dict[int, tuple[bytes, int]],
    host: Callable[[int], str],
    group: Callable[[int], tuple[str, ...]],
) -> dict[int, Source]:
    """The sources of a complete step's chunks: `votes` and `settled` are jobs.py's (chunk ->
    result -> workers; chunk -> the result it settled on); `host` and `group` are trust.py's."""
    out = {}
    for chunk, key in settled.items():
        workers = votes.get(chunk, {}).get(key, [])
        voters = tuple(sorted({(host(w), w) for w in workers}))
        out[chunk] = Source(voters, len({group(w) for w in workers}) >= 2)
    return out
