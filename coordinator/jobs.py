"""The open step's chunk queue and leases: pure code with an injected clock, no I/O.

A step's population is split into `chunks` chunks of `chunk_members` members. Chunks are
leased to the first worker that asks; a lease past its deadline, or whose worker left, puts
the chunk back in the queue; once the queue is empty, idle workers get backup copies of the
longest-running chunks. The first valid result of a chunk wins; a later copy must be
byte-identical (the fitness is a pure function of the replica at the step).

A result counts only from a worker that was leased that chunk of this step, and only with
a loss sum the chunk could produce; a worker holds at most `max_leases` live leases (as many
as a JOB_REQUEST may ask for at once), so no one can hoard a step.
"""

from __future__ import annotations

import enum
import statistics
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import numpy as np

from ..protocol.messages import MAX_CHUNKS_PER_REQUEST
from ..protocol.ternary import pack_ternary, unpack_ternary

Clock = Callable[[], float]


class Outcome(enum.Enum):
    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"  # a backup copy, identical to the accepted result
    MISMATCH = "mismatch"  # a copy that differs from the accepted result: a determinism bug
    STALE = "stale"  # for another step
    OUT_OF_RANGE = "out_of_range"  # no such chunk
    BAD_SIZE = "bad_size"  # wrong number of fitness values for the chunk
    UNLEASED = "unleased"  # the sender was never leased this chunk
    BAD_LOSS = "bad_loss"  # a loss sum no chunk of this run can produce


@dataclass
class Lease:
    chunk: int
    worker: Hashable
    started: float
    deadline: float
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
    """Chunks of one step: queued, leased, done."""

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
    ) -> None:
        self.step = step
        self.chunks = chunks
        self.chunk_members = chunk_members
        self.clock = clock
        self.timer = timer
        self.queue: deque[int] = deque(range(chunks))
        self.leases: dict[int, list[Lease]] = {}
        self.holders: dict[int, set[Hashable]] = {}  # chunk -> every worker ever leased it
        self.live: Counter[Hashable] = Counter()  # worker -> leases not done nor expired
        self.loss_range = loss_range  # inclusive bounds of one chunk's loss sum
        self.max_leases = max_leases
        self.results: dict[int, bytes] = {}  # chunk -> packed fitness of the first result
        # (chunk, worker) -> start of a lease whose chunk someone else finished first: its
        # late copy still tells how long that worker takes (one entry per lease: bounded)
        self.finished_leases: dict[tuple[int, Hashable], float] = {}
        self.loss_sum = 0
        self.requeued = {"disconnect": 0, "deadline": 0}
        self.opened = clock()
        self.first_lease: float | None = None

    @property
    def complete(self) -> bool:
        return len(self.results) == self.chunks

    def member_range(self, chunk: int) -> tuple[int, int]:
        return chunk * self.chunk_members, self.chunk_members

    def lease(self, worker: Hashable, queued_only: bool = False) -> int | None:
        """The chunk `worker` should evaluate next, or None when there is nothing to do
        (or the worker already holds `max_leases` live leases); `queued_only`: never a
        backup copy of a chunk someone else holds."""
        now = self.clock()
        if self.live[worker] >= self.max_leases:
            return None
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
            if len(held) == 1 and held[0].worker != worker and held[0].started <= slow
        ]
        if not candidates:
            return None
        return self._add_lease(min(candidates)[1], worker, now)

    def _add_lease(self, chunk: int, worker: Hashable, now: float) -> int:
        if self.first_lease is None:
            self.first_lease = now
        deadline = now + self.timer.timeout_s(worker)
        self.leases.setdefault(chunk, []).append(Lease(chunk, worker, now, deadline))
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
    ) -> Outcome:
        """Record a RESULT; only the first valid result of a chunk counts."""
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
        if chunk in self.results:
            if self.results[chunk] != fitness:
                return Outcome.MISMATCH
            started = self.finished_leases.pop((chunk, worker), None)
            if started is not None:  # a late copy still times its worker
                self.timer.observe(self.clock() - started, worker)
            return Outcome.DUPLICATE
        held = self.leases.pop(chunk, [])
        self.live.subtract(lease.worker for lease in held if not lease.expired)
        for lease in held:
            if lease.worker != worker:
                self.finished_leases.setdefault((chunk, lease.worker), lease.started)
        mine = [lease for lease in held if lease.worker == worker]
        if mine:
            self.timer.observe(self.clock() - mine[0].started, worker)
        if chunk in self.queue:
            self.queue.remove(chunk)
        self.results[chunk] = fitness
        self.loss_sum += loss_sum
        return Outcome.ACCEPTED

    def release_worker(self, worker: Hashable) -> list[int]:
        """Drop a departed worker's leases; chunks left with no live lease go back first."""
        self.live.pop(worker, None)
        requeued = []
        for chunk in list(self.leases):
            held = [lease for lease in self.leases[chunk] if lease.worker != worker]
            if len(held) == len(self.leases[chunk]):
                continue
            if held:
                self.leases[chunk] = held
            else:
                del self.leases[chunk]
                if chunk not in self.results and chunk not in self.queue:
                    self.queue.appendleft(chunk)
                    requeued.append(chunk)
        self.requeued["disconnect"] += len(requeued)
        return requeued

    def expire(self) -> list[int]:
        """Re-queue chunks whose live leases are all past their deadline; a late result
        from such a lease still counts (first valid result wins)."""
        now = self.clock()
        requeued = []
        for chunk, held in self.leases.items():
            live = [lease for lease in held if not lease.expired]
            if live and chunk not in self.queue and all(lease.deadline <= now for lease in live):
                for lease in live:
                    lease.expired = True
                    self.live[lease.worker] -= 1
                self.queue.append(chunk)
                requeued.append(chunk)
        self.requeued["deadline"] += len(requeued)
        return requeued

    def next_deadline(self) -> float | None:
        """When `expire` could next have something to do."""
        live = [x.deadline for held in self.leases.values() for x in held if not x.expired]
        return min(live, default=None)

    def step_fitness(self) -> bytes:
        """The whole population's packed fitness, chunks in order (the step is complete)."""
        pairs = self.chunk_members // 2
        if pairs % 5 == 0:  # chunk packings are whole bytes: concatenate
            return b"".join(self.results[c] for c in range(self.chunks))
        values = np.concatenate(
            [unpack_ternary(self.results[c], pairs) for c in range(self.chunks)]
        )
        return pack_ternary(values)
