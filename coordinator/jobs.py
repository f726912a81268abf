"""The open step's chunk queue, leases and checks: pure code with an injected clock, no I/O.

A step's population is split into `chunks` chunks of `chunk_members` members. Chunks are
leased to the first worker that asks; a lease past its deadline, or whose worker left, puts
the chunk back in the queue; once the queue is empty, idle workers get backup copies of the
longest-running chunks.

A chunk's result is settled by its first valid result, except where another worker must
confirm it: chunks drawn for a check (`verify`), results from workers under suspicion, and
chunks whose results differ. The fitness is a pure function of the replica at the step, so
honest results are byte-identical. Votes are counted by `group` (the core's, worked out
when counted: a worker's address where the run spans several), one per group and chunk,
so one machine's connections cannot confirm each other. A result another group must
confirm waits for an equal one (a check copy, leased before the queue to a group with no
result or lease for that chunk); where results differ the chunk is disputed until one has
the votes of two groups and more than any other; the workers whose results lost are
`outvoted` (the core drops them and their votes). The core decides which checks to waive
(`waivable`, `waive`): a dispute never.
Runs whose fitness is not bit-exact across devices (`exact=False`: Hugging Face models,
float32 on a CPU, bfloat16 on a GPU) compare results by `agreement`: two agree when at least
that share of their pairs' fitness is equal (the loss sums are not compared), and the first
of them stands for both; without an `agreement` they settle on the first result and compare
nothing.

A result counts only from a worker that was leased that chunk of this step, and only with
a loss sum the chunk could produce; a worker holds at most `max_leases` live leases (as many
as a JOB_REQUEST may ask for at once), so no one can hoard a step.
"""

from __future__ import annotations

import enum
import statistics
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field

import numpy as np

from ..protocol.messages import MAX_CHUNKS_PER_REQUEST
from ..protocol.ternary import pack_ternary, unpack_ternary

Clock = Callable[[], float]

# A lease unanswered this long (or past its deadline, if later) marks its worker overdue: a
# check does not wait for it (a hung GPU whose process still heartbeats). Never less, so a
# liar's fast results, which shorten the deadlines of workers not yet timed, cannot make an
# honest checker overdue.
STALL_S = 300.0

# The share of a chunk's pairs two results of an inexact run (Hugging Face models) must have
# equal to agree. Measured on the tests' tiny GPT-2 and Llama (16 pairs a chunk, 24 to 48
# chunks, next-token loss), float32 against bfloat16 evaluation on a CPU agreed on 0.875 to
# 1.0 of the pairs (mean 0.98 and 0.995), a sign-flipping liar on at most 0.06, random
# fitness on at most 0.625 (mean 0.31). A reward's sampled completions part at the first
# token the two dtypes pick apart: there honest workers agreed on only 0.31 to 0.69, no more
# than random fitness, so reward runs of such models are checked through their completions
# instead (claims.py) and compared exactly.
INEXACT_AGREEMENT = 0.75


class Outcome(enum.Enum):
    ACCEPTED = "accepted"  # settled the chunk: its fitness counts
    VOTED = "voted"  # kept: the chunk waits for a second worker's equal result
    DISPUTED = "disputed"  # differs from another worker's: further workers decide
    DUPLICATE = "duplicate"  # equal to the chunk's settled result (a backup or check copy)
    OUTVOTED = "outvoted"  # differs from the result a majority settled the chunk on
    MISMATCH = "mismatch"  # the sender's second result for the chunk, and a different one
    COPY = "copy"  # a later copy not compared: inexact fitness, or blind to the claims
    STALE = "stale"  # for another step
    OUT_OF_RANGE = "out_of_range"  # no such chunk
    BAD_SIZE = "bad_size"  # wrong number of fitness values for the chunk
    UNLEASED = "unleased"  # the sender was never leased this chunk
    BAD_LOSS = "bad_loss"  # a loss sum no chunk of this run can produce


Key = tuple[bytes, int]  # a result: its packed fitness and loss sum


@dataclass
class Lease:
    chunk: int
    worker: Hashable
    started: float
    deadline: float
    overdue_at: float  # unanswered by then, its worker is overdue (`StepJobs.overdue`)
    expired: bool = False  # past its deadline and re-queued; its result still counts


@dataclass
class ChunkTimer:
    """Lease deadlines: a fixed timeout, or adapted to the chunk times seen so far, each
    worker's own where it has any (a CPU worker beside GPU workers is not judged by their
    pace); backups start after the median of all workers' times."""

    fixed_s: float | None = None
    initial_s: float = 120.0  # before any chunk has been timed
    factor: float = 3.0
    floor_s: float = 5.0
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=64))
    by_worker: OrderedDict[Hashable, deque[float]] = field(default_factory=OrderedDict)
    max_workers: int = 4096  # the least recently timed are forgotten past this many

    def observe(self, seconds: float, worker: Hashable = None) -> None:
        self.recent.append(seconds)
        if worker is None:
            return
        own = self.by_worker.pop(worker, None) or deque(maxlen=16)
        own.append(seconds)
        self.by_worker[worker] = own
        if len(self.by_worker) > self.max_workers:
            self.by_worker.popitem(last=False)

    def backup_after_s(self) -> float:
        """How long a lease must have run before an idle worker gets a backup copy."""
        if not self.recent:
            return float("inf")  # no idea how long a chunk takes yet: no backups
        return max(1.0, 1.5 * statistics.median(self.recent))

    def timeout_s(self, worker: Hashable = None) -> float:
        if self.fixed_s is not None:
            return self.fixed_s
        times = self.by_worker.get(worker) or self.recent
        if not times:
            return self.initial_s
        return max(self.floor_s, self.factor * statistics.median(times))


class StepJobs:
    """Chunks of one step: queued, leased, checked, settled."""

    def __init__(
        self,
        step: int,
        chunks: int,
        chunk_members: int,
        clock: Clock,
        timer: ChunkTimer,
        *,
        loss_range: tuple[int, int] | None = None,
        max_leases: int = MAX_CHUNKS_PER_REQUEST,
        verify: Iterable[int] = (),
        exact: bool = True,
        agreement: float | None = None,
        group: Callable[[Hashable], Hashable] = lambda worker: worker,
    ) -> None:
        self.step = step
        self.chunks = chunks
        self.chunk_members = chunk_members
        self.clock = clock
        self.timer = timer
        self.queue: deque[int] = deque(range(chunks))  # no result and no live lease yet
        self.checks: deque[int] = deque()  # unsettled, with results: waiting for another
        self.leases: dict[int, list[Lease]] = {}
        self.holders: dict[int, set[Hashable]] = {}  # chunk -> every worker ever leased it
        self.live: Counter[Hashable] = Counter()  # worker -> leases not done nor expired
        self.group = group  # worker -> whose vote it casts
        self.loss_range = loss_range  # inclusive bounds of one chunk's loss sum
        self.max_leases = max_leases
        self.exact = exact
        self.agreement = agreement  # inexact runs: the share of equal pairs that agrees
        self.verify = set(verify)  # chunks whose first result another worker must confirm
        self.votes: dict[int, dict[Key, list[Hashable]]] = {}  # chunk -> result -> workers
        self.results: dict[int, bytes] = {}  # chunk -> packed fitness it is settled on
        self.losses: dict[int, int] = {}  # chunk -> the loss sum it is settled on
        self.outvoted: list[tuple[Hashable, int]] = []  # (worker, chunk): for the core
        # (chunk, worker) -> a lease whose chunk was settled without it: its late copy still
        # tells how long that worker takes, and while none comes it may become overdue (one
        # entry per lease: bounded)
        self.finished_leases: dict[tuple[int, Hashable], Lease] = {}
        self.requeued = {"disconnect": 0, "deadline": 0, "outvoted": 0}
        self.opened = clock()
        self.first_lease: float | None = None

    @property
    def complete(self) -> bool:
        return len(self.results) == self.chunks

    @property
    def loss_sum(self) -> int:
        return sum(self.losses.values())

    def member_range(self, chunk: int) -> tuple[int, int]:
        return chunk * self.chunk_members, self.chunk_members

    def voted(self, chunk: int) -> set[Hashable]:
        """Groups with a result for `chunk`."""
        return {self.group(w) for ws in self.votes.get(chunk, {}).values() for w in ws}

    def voters(self, chunk: int) -> set[Hashable]:
        """Groups with a result for `chunk` or a live lease on it: none of them is leased
        it again (past its deadline a lease's worker may have dropped it: it may retry)."""
        live = {self.group(x.worker) for x in self.leases.get(chunk, ()) if not x.expired}
        return self.voted(chunk) | live

    def workers(self) -> set[Hashable]:
        """Every worker leased a chunk of the step."""
        return set().union(*self.holders.values())

    def _groups(self, workers: list[Hashable]) -> int:
        return len({self.group(w) for w in workers})

    def lease(self, worker: Hashable, queued_only: bool = False) -> int | None:
        """The chunk `worker` should evaluate next, or None when there is nothing to do (or
        the worker already holds `max_leases` live leases): a check its group may make
        first, then the queue; `queued_only`: never a backup copy of a chunk someone else
        holds."""
        now = self.clock()
        if self.live[worker] >= self.max_leases:
            return None
        for chunk in self.checks:
            if self.group(worker) not in self.voters(chunk):
                self.checks.remove(chunk)
                return self._add_lease(chunk, worker, now)
        while self.queue:
            chunk = self.queue.popleft()
            if chunk not in self.results:
                return self._add_lease(chunk, worker, now)
        if queued_only:
            return None
        # Backups near the end of the step: the longest-running chunk that has a single
        # lease, held by someone else for clearly longer than a chunk usually takes.
        slow = now - self.timer.backup_after_s()
        candidates = [
            (held[0].started, chunk)
            for chunk, held in self.leases.items()
            if len(held) == 1
            and held[0].started <= slow
            and self.group(worker) not in self.voters(chunk)
            and chunk not in self.results
        ]
        if not candidates:
            return None
        return self._add_lease(min(candidates)[1], worker, now)

    def _add_lease(self, chunk: int, worker: Hashable, now: float) -> int:
        if self.first_lease is None:
            self.first_lease = now
        timeout = self.timer.timeout_s(worker)
        lease = Lease(chunk, worker, now, now + timeout, now + max(timeout, STALL_S))
        self.leases.setdefault(chunk, []).append(lease)
        self.holders.setdefault(chunk, set()).add(worker)
        self.live[worker] += 1
        return chunk

    def complete_chunk(
        self,
        worker: Hashable,
        step: int,
        chunk: int,
        fitness: bytes,
        pair_count: int,
        loss_sum: int,
        verify: bool = False,
        blind: bool = False,
    ) -> Outcome:
        """Record a RESULT; `verify`: another worker must confirm it (a suspect sender);
        `blind`: in a run checked by claims, its lease was sent none of the chunk's results
        (a backup, or a lease before any came), so it cannot confirm them: with other
        results in, it counts as a copy and the chunk still waits for a check."""
        if step != self.step:
            return Outcome.STALE
        if not 0 <= chunk < self.chunks:
            return Outcome.OUT_OF_RANGE
        if pair_count != self.chunk_members // 2:
            return Outcome.BAD_SIZE
        if worker not in self.holders.get(chunk, ()):
            return Outcome.UNLEASED
        if self.loss_range is not None and not (
            self.loss_range[0] <= loss_sum <= self.loss_range[1]
        ):
            return Outcome.BAD_LOSS
        group = self.group(worker)
        self._lease_done(chunk, worker)
        votes = self.votes.setdefault(chunk, {})
        key = self._like(votes, (fitness, loss_sum))
        said = next((k for k, ws in votes.items() if group in map(self.group, ws)), None)
        if said is not None:  # a group has one vote a chunk
            self._want_check(chunk)  # this worker's lease is over: another group checks it
            return Outcome.DUPLICATE if said == key else Outcome.MISMATCH
        if blind and any(votes.values()):  # another device's own text differs: no vote
            self._want_check(chunk)
            return Outcome.COPY
        settled = (self.results[chunk], self.losses[chunk]) if chunk in self.results else None
        if settled is not None and not self.compares:
            return Outcome.COPY
        votes.setdefault(key, []).append(worker)
        if verify:
            self.verify.add(chunk)
        if settled is not None:
            if key == settled:
                return Outcome.DUPLICATE
            if self._groups(votes[settled]) >= 2:
                self.outvoted.append((worker, chunk))
                return Outcome.OUTVOTED
            del self.results[chunk], self.losses[chunk]  # one worker's word against another's
        return self._decide(chunk)

    @property
    def compares(self) -> bool:
        """Whether results of a chunk are compared (else the first one settles it)."""
        return self.exact or self.agreement is not None

    def _like(self, votes: dict[Key, list[Hashable]], key: Key) -> Key:
        """The result `key` counts as: in an inexact run, the first result of the chunk it
        agrees with (`agreement`), else itself."""
        if self.exact or self.agreement is None:
            return key
        pairs = self.chunk_members // 2
        mine = unpack_ternary(key[0], pairs)
        for other in votes:
            if np.mean(unpack_ternary(other[0], pairs) == mine) >= self.agreement:
                return other
        return key

    def _lease_done(self, chunk: int, worker: Hashable) -> None:
        """`worker`'s result for `chunk` is in: its lease ends, and times it."""
        held = self.leases.get(chunk, [])
        mine = [x for x in held if x.worker == worker]
        finished = self.finished_leases.pop((chunk, worker), None)
        started = mine[0].started if mine else finished.started if finished else None
        if mine:
            rest = [x for x in held if x.worker != worker]
            if rest:
                self.leases[chunk] = rest
            else:
                del self.leases[chunk]
            self.live.subtract(x.worker for x in mine if not x.expired)
        if started is not None:
            self.timer.observe(self.clock() - started, worker)

    def _decide(self, chunk: int) -> Outcome:
        """Settle `chunk` on a result with enough votes and more than any other, or wait."""
        votes = self.votes[chunk]
        if len(votes) > 1:
            self.verify.add(chunk)  # disputed: whatever remains needs a second worker
        counts = sorted((self._groups(ws) for ws in votes.values()), reverse=True)
        key = max(votes, key=lambda k: self._groups(votes[k]))
        needed = 2 if chunk in self.verify else 1
        if counts[0] >= needed and (len(counts) == 1 or counts[0] > counts[1]):
            self._settle(chunk, key)
            self.outvoted += [(w, chunk) for k, ws in votes.items() if k != key for w in ws]
            return Outcome.ACCEPTED
        self._want_check(chunk)
        return Outcome.DISPUTED if len(votes) > 1 else Outcome.VOTED

    def _want_check(self, chunk: int) -> None:
        """An unsettled chunk with results and no live lease waits for another group (out
        of the queue, where a lease that expired before its result came may have put it)."""
        live = any(not x.expired for x in self.leases.get(chunk, ()))
        if live or chunk in self.results or chunk in self.checks:
            return
        if chunk in self.queue:
            self.queue.remove(chunk)
        self.checks.append(chunk)

    def _settle(self, chunk: int, key: Key) -> None:
        self.results[chunk], self.losses[chunk] = key
        held = self.leases.pop(chunk, [])
        self.live.subtract(x.worker for x in held if not x.expired)
        for x in held:
            self.finished_leases.setdefault((chunk, x.worker), x)
        if chunk in self.queue:
            self.queue.remove(chunk)
        if chunk in self.checks:
            self.checks.remove(chunk)

    def take_outvoted(self) -> list[tuple[Hashable, int]]:
        """The (worker, chunk) pairs outvoted since last asked."""
        taken, self.outvoted = self.outvoted, []
        return taken

    def drop_worker(self, worker: Hashable) -> list[int]:
        """An outvoted worker: its leases go, and so do its votes; chunks it alone settled
        are unsettled, and chunks left with no result go back first. Returns the chunks
        that need work again."""
        requeued = self.release_worker(worker, "outvoted")
        unsettled = []
        for chunk, votes in self.votes.items():
            for key in [k for k, ws in votes.items() if worker in ws]:
                votes[key].remove(worker)
                if not votes[key]:
                    del votes[key]
                    if chunk in self.results and key == (self.results[chunk], self.losses[chunk]):
                        del self.results[chunk], self.losses[chunk]
                        unsettled.append(chunk)
            if chunk in self.results or any(not x.expired for x in self.leases.get(chunk, ())):
                continue
            if votes:
                self._decide(chunk)
            elif chunk not in self.queue:
                if chunk in self.checks:
                    self.checks.remove(chunk)
                self.queue.appendleft(chunk)
        self.requeued["outvoted"] += len(unsettled)  # never among the released: settled
        return sorted(requeued + unsettled)

    def waivable(self) -> list[int]:
        """Checks that may be waived: those with one result (a dispute never is)."""
        return [chunk for chunk in self.checks if len(self.votes[chunk]) == 1]

    def waive(self, chunks: Iterable[int]) -> None:
        """Settle these checks on their one result."""
        for chunk in list(chunks):
            self._settle(chunk, next(iter(self.votes[chunk])))

    def release_worker(self, worker: Hashable, reason: str = "disconnect") -> list[int]:
        """Drop a departed (or outvoted) worker's leases; chunks left with no live lease go
        back first, counted under `reason`."""
        self.live.pop(worker, None)
        for key in [k for k in self.finished_leases if k[1] == worker]:
            del self.finished_leases[key]
        requeued = []
        for chunk in list(self.leases):
            held = [lease for lease in self.leases[chunk] if lease.worker != worker]
            if len(held) == len(self.leases[chunk]):
                continue
            if held:
                self.leases[chunk] = held
            else:
                del self.leases[chunk]
            # No live lease left (the others' expired): it goes back, or nobody gets it.
            if all(x.expired for x in held) and self._put_back(chunk, first=True):
                requeued.append(chunk)
        self.requeued[reason] += len(requeued)
        return requeued

    def _put_back(self, chunk: int, first: bool = False) -> bool:
        """An unsettled chunk whose leases ended: to the checks if it has results, else
        the queue; whether it went back."""
        if chunk in self.results or chunk in self.queue or chunk in self.checks:
            return False
        if self.votes.get(chunk):
            self.checks.append(chunk)
        elif first:
            self.queue.appendleft(chunk)
        else:
            self.queue.append(chunk)
        return True

    def expire(self) -> list[int]:
        """Re-queue chunks whose live leases are all past their deadline; a late result
        from such a lease still counts."""
        now = self.clock()
        requeued = []
        for chunk, held in self.leases.items():
            live = [lease for lease in held if not lease.expired]
            if live and all(lease.deadline <= now for lease in live):
                for lease in live:
                    lease.expired = True
                    self.live[lease.worker] -= 1
                if self._put_back(chunk):
                    requeued.append(chunk)
        self.requeued["deadline"] += len(requeued)
        return requeued

    def next_deadline(self) -> float | None:
        """When `expire` could next have something to do: when every live lease of some
        chunk is past its deadline."""
        due = [
            max(x.deadline for x in live)
            for held in self.leases.values()
            if (live := [x for x in held if not x.expired])
        ]
        return min(due, default=None)

    def _unanswered(self) -> Iterable[Lease]:
        """Every lease of the step whose worker has sent no result for its chunk yet."""
        for held in self.leases.values():
            yield from held
        yield from self.finished_leases.values()

    def overdue(self) -> set[Hashable]:
        """Workers holding a lease unanswered past its `overdue_at`: hung, or slower than
        any check should wait for. A result for that chunk, however late, ends it."""
        now = self.clock()
        return {x.worker for x in self._unanswered() if x.overdue_at <= now}

    def next_overdue(self) -> float | None:
        """When a worker not yet overdue next becomes so."""
        now = self.clock()
        return min((x.overdue_at for x in self._unanswered() if x.overdue_at > now), default=None)

    def step_fitness(self) -> bytes:
        """The whole population's packed fitness, chunks in order (the step is complete)."""
        pairs = self.chunk_members // 2
        if pairs % 5 == 0:  # chunk packings are whole bytes: concatenate
            return b"".join(self.results[c] for c in range(self.chunks))
        values = np.concatenate(
            [unpack_ternary(self.results[c], pairs) for c in range(self.chunks)]
        )
        return pack_ternary(values)
