"""The open step's chunk queue: leases, re-queues, backups, first result wins."""

from __future__ import annotations

import numpy as np

from eggroll_dist.coordinator.jobs import INEXACT_AGREEMENT, STALL_S, ChunkTimer, Outcome, StepJobs
from eggroll_dist.protocol import pack_ternary, unpack_ternary


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _jobs(chunks: int = 4, members: int = 10, timer: ChunkTimer | None = None, group=None):
    """A step of `chunks`; `group`: whose vote a worker casts (by default its own)."""
    clock = FakeClock()
    timer = timer or ChunkTimer(fixed_s=30.0)
    extra = {} if group is None else {"group": group}
    return StepJobs(7, chunks, members, clock, timer, **extra), clock


def _fit(seed: int, pairs: int = 5) -> bytes:
    return pack_ternary(np.random.default_rng(seed).integers(-1, 2, size=pairs))


def test_leases_in_order_then_nothing_without_chunk_times() -> None:
    jobs, _ = _jobs()
    assert [jobs.lease(w) for w in "abcd"] == [0, 1, 2, 3]
    assert jobs.lease("e") is None  # no chunk time observed yet: no backups
    assert jobs.member_range(2) == (20, 10)


def test_first_result_wins_and_duplicates_are_compared() -> None:
    jobs, _ = _jobs(chunks=2)
    jobs.lease("a")
    jobs.lease("b")
    assert jobs.complete_chunk("a", 7, 0, _fit(1), 5, 10) is Outcome.ACCEPTED
    assert jobs.complete_chunk("a", 7, 0, _fit(1), 5, 10) is Outcome.DUPLICATE
    assert jobs.complete_chunk("a", 7, 0, _fit(2), 5, 10) is Outcome.MISMATCH
    assert jobs.complete_chunk("b", 6, 1, _fit(1), 5, 10) is Outcome.STALE
    assert jobs.complete_chunk("b", 7, 9, _fit(1), 5, 10) is Outcome.OUT_OF_RANGE
    assert jobs.complete_chunk("b", 7, 1, _fit(1, 4), 4, 10) is Outcome.BAD_SIZE
    assert not jobs.complete
    assert jobs.complete_chunk("b", 7, 1, _fit(3), 5, 5) is Outcome.ACCEPTED
    assert jobs.complete and jobs.loss_sum == 15


def test_disconnect_requeues_at_once_and_first() -> None:
    jobs, _ = _jobs()
    for w in "abcd":
        jobs.lease(w)
    assert jobs.release_worker("b") == [1]
    assert jobs.lease("e") == 1
    assert jobs.release_worker("zzz") == []


def test_a_chunk_whose_last_live_lease_leaves_goes_back_beside_an_expired_one() -> None:
    """a's lease expired (it may still answer), b took the chunk again and leaves: with no
    live lease left the chunk goes back, or no one would ever be leased it."""
    jobs, clock = _jobs(chunks=1)
    assert jobs.lease("a") == 0
    clock.now += 31.0
    assert jobs.expire() == [0]
    assert jobs.lease("b") == 0
    assert jobs.release_worker("b") == [0]
    assert jobs.lease("c") == 0


def test_deadline_requeues_and_late_result_still_counts() -> None:
    jobs, clock = _jobs(chunks=2)
    jobs.lease("a")
    jobs.lease("b")
    assert jobs.next_deadline() == 130.0
    clock.now = 129.0
    assert jobs.expire() == []
    clock.now = 131.0
    assert jobs.expire() == [0, 1]
    assert jobs.expire() == []  # once per lease
    assert jobs.lease("c") == 0
    assert jobs.complete_chunk("a", 7, 0, _fit(1), 5, 1) is Outcome.ACCEPTED  # the slow one
    assert jobs.complete_chunk("c", 7, 0, _fit(1), 5, 1) is Outcome.DUPLICATE
    assert jobs.lease("d") == 1


def test_backups_go_to_idle_workers_for_slow_chunks_only() -> None:
    jobs, clock = _jobs(chunks=3, timer=ChunkTimer(fixed_s=60.0))
    for w in "abc":
        jobs.lease(w)
    clock.now += 2.0
    jobs.complete_chunk("a", 7, 0, _fit(1), 5, 1)  # a chunk takes ~2 s
    assert jobs.lease("a") is None  # chunks 1, 2 have run 2 s: not slow yet (>= 3 s)
    clock.now += 1.5
    assert jobs.lease("a") == 1  # the longest-running one, a backup copy
    assert jobs.lease("d") == 2
    assert jobs.lease("e") is None  # each chunk has two leases now


def test_the_next_deadline_is_when_every_live_lease_of_a_chunk_is_past_its_own() -> None:
    """A chunk with a backup copy is re-queued only once both leases are past their
    deadlines: the first lease's alone is no time to wake up at (it would be a busy loop)."""
    timer = ChunkTimer()
    for _ in range(5):
        timer.observe(10.0)  # leases last 30 s, backups start after 15 s
    jobs, clock = _jobs(chunks=1, timer=timer)
    assert jobs.lease("a") == 0
    clock.now += 20.0
    assert jobs.lease("b") == 0  # a backup copy, its deadline 30 s later
    clock.now += 11.0  # a's deadline is past
    assert jobs.expire() == [] and jobs.next_deadline() == clock.now + 19.0


def test_adaptive_timeout() -> None:
    timer = ChunkTimer()
    assert timer.timeout_s() == timer.initial_s
    for s in (1.0, 2.0, 3.0):
        timer.observe(s)
    assert timer.timeout_s() == 6.0 and timer.backup_after_s() == 3.0
    timer.observe(0.01)
    timer.observe(0.01)
    assert timer.timeout_s() == 5.0  # floor


def test_each_worker_is_timed_by_its_own_pace() -> None:
    """A GPU worker's quick chunks set the backups' pace but not a CPU worker's deadline:
    its first lease, on the shared pace, expires and the GPU finishes the chunk; the CPU's
    late copy still times it, and in the next step its leases last three of its chunks."""
    timer = ChunkTimer()
    jobs, clock = _jobs(chunks=5, timer=timer)
    for c in range(4):  # the GPU: 0.5 s a chunk
        assert jobs.lease("gpu") == c
        clock.now += 0.5
        assert jobs.complete_chunk("gpu", 7, c, _fit(c), 5, 1) is Outcome.ACCEPTED
    assert jobs.lease("cpu") == 4
    assert jobs.next_deadline() == clock.now + 5.0  # the floor: 3 x 0.5 s is less
    clock.now += 6.0
    assert jobs.expire() == [4]
    assert jobs.lease("gpu") == 4
    assert jobs.complete_chunk("gpu", 7, 4, _fit(4), 5, 1) is Outcome.ACCEPTED
    clock.now += 24.0  # the CPU's copy, 30 s after its lease
    assert jobs.complete_chunk("cpu", 7, 4, _fit(4), 5, 1) is Outcome.DUPLICATE
    step = StepJobs(8, 5, 10, clock, timer)
    assert step.lease("cpu") == 0
    assert step.next_deadline() == clock.now + 90.0  # 3 x its own 30 s
    assert step.lease("gpu") == 1
    assert step.next_deadline() == clock.now + 5.0  # the GPU's own deadline
    assert timer.backup_after_s() == 1.0  # the median of all: 0.5 s (x 1.5, at least 1 s)
    assert timer.timeout_s("new") == 5.0  # a worker never timed: everyone's median


def test_the_timer_forgets_the_least_recently_timed_workers() -> None:
    timer = ChunkTimer(max_workers=2)
    for worker, seconds in (("a", 10.0), ("b", 20.0), ("a", 10.0), ("c", 30.0)):
        timer.observe(seconds, worker)
    assert list(timer.by_worker) == ["a", "c"]
    assert timer.timeout_s("a") == 30.0  # its own 10 s
    assert timer.timeout_s("b") == 45.0  # forgotten: everyone's median, 15 s


def test_step_fitness_concatenates_chunks_in_order() -> None:
    for members in (10, 8):  # 5 pairs per chunk (whole bytes) and 4 (repacked)
        pairs = members // 2
        jobs, _ = _jobs(chunks=3, members=members)
        values = np.random.default_rng(members).integers(-1, 2, size=3 * pairs)
        assert [jobs.lease("w") for _ in range(3)] == [0, 1, 2]
        for c in (2, 0, 1):
            part = pack_ternary(values[c * pairs : (c + 1) * pairs])
            assert jobs.complete_chunk("w", 7, c, part, pairs, 0) is Outcome.ACCEPTED
        assert np.array_equal(unpack_ternary(jobs.step_fitness(), 3 * pairs), values)


def test_results_count_only_from_lease_holders_with_a_possible_loss() -> None:
    jobs, clock = _jobs(chunks=3)
    jobs.loss_range = (0, 100)
    assert jobs.lease("a") == 0
    assert jobs.complete_chunk("x", 7, 0, _fit(1), 5, 10) is Outcome.UNLEASED
    assert jobs.complete_chunk("x", 7, 1, _fit(1), 5, 10) is Outcome.UNLEASED  # queued chunk
    assert jobs.complete_chunk("a", 7, 0, _fit(1), 5, 101) is Outcome.BAD_LOSS
    assert jobs.complete_chunk("a", 7, 0, _fit(1), 5, -1) is Outcome.BAD_LOSS
    assert jobs.complete_chunk("a", 7, 0, _fit(1), 5, 100) is Outcome.ACCEPTED
    assert jobs.complete_chunk("x", 7, 0, _fit(1), 5, 100) is Outcome.UNLEASED  # not a backup
    assert jobs.results == {0: _fit(1)} and jobs.loss_sum == 100
    # An expired lease still lets its holder's late result count (first valid result wins).
    assert jobs.lease("b") == 1
    clock.now += 31.0
    assert jobs.expire() == [1]
    assert jobs.complete_chunk("b", 7, 1, _fit(2), 5, 7) is Outcome.ACCEPTED


def test_no_worker_holds_more_than_max_leases() -> None:
    jobs, _ = _jobs(chunks=6)
    jobs.max_leases = 2
    assert [jobs.lease("a") for _ in range(3)] == [0, 1, None]
    assert jobs.lease("b") == 2
    assert jobs.complete_chunk("a", 7, 0, _fit(1), 5, 1) is Outcome.ACCEPTED
    assert jobs.lease("a") == 3  # one lease done: room for the next
    assert jobs.release_worker("a") == [1, 3]


def _settle(jobs: StepJobs, worker: str, chunk: int, seed: int) -> Outcome:
    return jobs.complete_chunk(worker, 7, chunk, _fit(seed), 5, seed)


def test_a_checked_chunk_waits_for_an_equal_result_from_another_worker() -> None:
    jobs, _ = _jobs(chunks=2, group=lambda worker: worker[0])  # a and a2: one machine
    jobs.verify.add(0)
    assert jobs.lease("a") == 0
    assert _settle(jobs, "a", 0, 1) is Outcome.VOTED
    assert not jobs.complete and list(jobs.checks) == [0]
    assert jobs.lease("a") == 1  # not its own check: the queue
    assert jobs.lease("a2") is None  # a's other connection: a's vote again
    assert jobs.lease("b") == 0  # a check before anything else
    assert _settle(jobs, "a", 1, 2) is Outcome.ACCEPTED  # unchecked: one result settles
    assert _settle(jobs, "b", 0, 1) is Outcome.ACCEPTED
    assert jobs.complete and jobs.loss_sum == 3 and jobs.take_outvoted() == []


def test_results_that_differ_are_decided_by_a_third_worker() -> None:
    jobs, clock = _jobs(chunks=2, timer=ChunkTimer())
    for w in "ab":
        jobs.lease(w)
    clock.now += 1
    assert _settle(jobs, "b", 1, 2) is Outcome.ACCEPTED  # b's pace is known: a is slow
    clock.now += 10
    assert jobs.lease("c") == 0  # a backup of a's chunk
    assert _settle(jobs, "c", 0, 9) is Outcome.ACCEPTED
    assert _settle(jobs, "a", 0, 1) is Outcome.DISPUTED  # one word against another
    assert not jobs.complete and list(jobs.checks) == [0]
    assert jobs.lease("a") is None and jobs.lease("c") is None  # both have spoken
    assert jobs.lease("d") == 0
    assert _settle(jobs, "d", 0, 1) is Outcome.ACCEPTED  # two votes to one
    assert jobs.take_outvoted() == [("c", 0)]
    assert jobs.results[0] == _fit(1) and jobs.losses[0] == 1
    assert _settle(jobs, "c", 0, 1) is Outcome.MISMATCH  # one vote a worker, whatever it says


def test_an_outvoted_workers_other_results_go_back() -> None:
    jobs, _ = _jobs(chunks=3)
    for w in "abc":
        jobs.lease(w)
    assert _settle(jobs, "c", 2, 5) is Outcome.ACCEPTED  # c alone settles chunk 2
    jobs.verify.add(0)
    assert _settle(jobs, "a", 0, 1) is Outcome.VOTED
    assert jobs.lease("c") == 0
    assert _settle(jobs, "c", 0, 9) is Outcome.DISPUTED
    assert jobs.lease("b") == 0  # beside its own chunk 1
    assert _settle(jobs, "b", 0, 1) is Outcome.ACCEPTED
    assert _settle(jobs, "b", 1, 3) is Outcome.ACCEPTED
    assert jobs.take_outvoted() == [("c", 0)]
    assert jobs.drop_worker("c") == [2]  # what it alone said is unsaid
    assert 2 not in jobs.results and list(jobs.queue) == [2] and not jobs.complete
    assert jobs.lease("a") == 2


def test_a_check_may_be_waived_on_its_one_result_but_a_dispute_never() -> None:
    jobs, _ = _jobs(chunks=2)
    jobs.verify.update((0, 1))
    jobs.lease("a")
    jobs.lease("b")
    assert _settle(jobs, "a", 0, 1) is Outcome.VOTED
    assert _settle(jobs, "b", 1, 2) is Outcome.VOTED
    assert jobs.lease("a") == 1 and _settle(jobs, "a", 1, 8) is Outcome.DISPUTED
    assert jobs.waivable() == [0]  # disputed chunk 1 waits for a third
    jobs.waive([0])
    assert 0 in jobs.results and 1 not in jobs.results and jobs.waivable() == []


def test_a_run_whose_fitness_is_not_exact_compares_nothing() -> None:
    jobs, clock = _jobs(chunks=2, timer=ChunkTimer())
    jobs.exact = False
    jobs.lease("a")
    jobs.lease("b")
    clock.now += 1
    assert _settle(jobs, "b", 1, 2) is Outcome.ACCEPTED
    clock.now += 10
    assert jobs.lease("c") == 0  # a backup
    assert _settle(jobs, "a", 0, 1) is Outcome.ACCEPTED
    assert _settle(jobs, "c", 0, 3) is Outcome.COPY
    assert jobs.results[0] == _fit(1) and jobs.take_outvoted() == []


def test_an_inexact_run_agrees_on_most_pairs_and_outvotes_a_sign_flipper() -> None:
    """Hugging Face results (float32 beside bfloat16) agree when at least the agreement
    share of their pairs is equal, whatever their loss sums; a worker that flips the signs
    agrees with nobody and loses the vote."""
    pairs = 16
    jobs = StepJobs(7, 2, 2 * pairs, FakeClock(), ChunkTimer(fixed_s=30.0), exact=False)
    jobs.agreement, jobs.verify = INEXACT_AGREEMENT, {0, 1}
    honest = np.random.default_rng(0).choice([-1, 1], size=pairs)
    near = honest.copy()
    near[: int(pairs * (1 - INEXACT_AGREEMENT))] *= -1  # the most pairs that may differ
    far = near.copy()
    far[int(pairs * (1 - INEXACT_AGREEMENT))] *= -1  # one more

    def result(worker: str, values: np.ndarray, loss: int, chunk: int = 0) -> Outcome:
        assert jobs.lease(worker) == chunk
        return jobs.complete_chunk(worker, 7, chunk, pack_ternary(values), pairs, loss)

    assert result("fp32", honest, 100) is Outcome.VOTED
    assert result("liar", -honest, 100) is Outcome.DISPUTED
    assert result("bf16", near, 101) is Outcome.ACCEPTED  # agrees with fp32: two to one
    assert jobs.results[0] == pack_ternary(honest) and jobs.losses[0] == 100
    assert jobs.take_outvoted() == [("liar", 0)]
    assert result("fp32", honest, 100, chunk=1) is Outcome.VOTED
    assert result("bf16", far, 100, chunk=1) is Outcome.DISPUTED  # one pair too many


def test_a_group_votes_once_whatever_its_connections_say() -> None:
    """Two connections of one machine (one group): the second cannot confirm the first,
    nor reconnecting under a new name make a second vote."""
    jobs, _ = _jobs(chunks=1, group=lambda worker: worker[0])
    jobs.verify.add(0)
    assert jobs.lease("h1") == 0
    assert _settle(jobs, "h1", 0, 9) is Outcome.VOTED
    assert jobs.lease("h2") is None  # h has voted on the only chunk
    jobs.holders[0].add("h2")  # were it leased anyway (as a backup before the vote)
    assert _settle(jobs, "h2", 0, 9) is Outcome.DUPLICATE and 0 not in jobs.results
    assert jobs.lease("a") == 0
    assert _settle(jobs, "a", 0, 1) is Outcome.DISPUTED  # one group against another
    assert jobs.lease("b") == 0
    assert _settle(jobs, "b", 0, 1) is Outcome.ACCEPTED
    assert jobs.take_outvoted() == [("h1", 0)]


def test_a_late_result_for_a_requeued_chunk_moves_it_to_the_checks() -> None:
    """A lease expires, the chunk goes back to the queue, then its result comes: the chunk
    leaves the queue for the checks (never in both), and its worker cannot take it again."""
    jobs, clock = _jobs(chunks=1)
    jobs.verify.add(0)
    assert jobs.lease("a") == 0
    clock.now += 31
    assert jobs.expire() == [0] and list(jobs.queue) == [0]
    assert _settle(jobs, "a", 0, 1) is Outcome.VOTED
    assert list(jobs.queue) == [] and list(jobs.checks) == [0]
    assert jobs.lease("a") is None
    assert jobs.lease("b") == 0


def test_a_check_whose_lease_expired_may_be_leased_again_to_the_same_worker() -> None:
    """The checker dropped its copy (a failed reward, say) and asks again: past the
    deadline its lease no longer bars it, or a run of two machines would wait forever."""
    jobs, clock = _jobs(chunks=1)
    jobs.verify.add(0)
    jobs.lease("a")
    assert _settle(jobs, "a", 0, 1) is Outcome.VOTED
    assert jobs.lease("b") == 0 and jobs.lease("b") is None
    clock.now += 31
    assert jobs.expire() == [0]
    assert jobs.lease("b") == 0
    assert _settle(jobs, "b", 0, 1) is Outcome.ACCEPTED


def test_a_lease_unanswered_past_the_stall_time_makes_its_worker_overdue() -> None:
    """Overdue at the later of the deadline and STALL_S, expired or not, settled by
    another worker or not; its own result, however late, ends it; so does leaving."""
    jobs, clock = _jobs(chunks=3, timer=ChunkTimer(fixed_s=30.0))
    assert [jobs.lease(w) for w in "abc"] == [0, 1, 2]
    clock.now += 31.0
    assert jobs.expire() == [0, 1, 2] and jobs.overdue() == set()
    assert jobs.next_overdue() == 100.0 + STALL_S
    jobs.lease("d")  # chunk 0 again
    assert jobs.complete_chunk("d", 7, 0, _fit(1), 5, 10) is Outcome.ACCEPTED
    clock.now = 100.0 + STALL_S
    assert jobs.overdue() == {"a", "b", "c"}  # a's chunk settled without it: still overdue
    assert jobs.complete_chunk("b", 7, 1, _fit(2), 5, 10) is Outcome.ACCEPTED
    jobs.release_worker("c")
    assert jobs.overdue() == {"a"}
    assert jobs.complete_chunk("a", 7, 0, _fit(1), 5, 10) is Outcome.DUPLICATE
    assert jobs.overdue() == set() and jobs.next_overdue() is None


def test_a_long_deadline_is_its_own_overdue_time() -> None:
    jobs, clock = _jobs(timer=ChunkTimer(fixed_s=2 * STALL_S))
    jobs.lease("a")
    clock.now += STALL_S
    assert jobs.overdue() == set()
    clock.now += STALL_S
    assert jobs.overdue() == {"a"}


def test_a_result_blind_to_the_claims_is_a_copy_and_the_check_still_waits() -> None:
    """A run checked by claims: a backup's own text (another device) differs from the first
    result's without reading it, so it neither disputes nor confirms; the check goes on."""
    jobs, clock = _jobs(chunks=2, timer=ChunkTimer())
    jobs.verify.add(0)
    for w in "ab":
        jobs.lease(w)
    clock.now += 1
    assert _settle(jobs, "b", 1, 2) is Outcome.ACCEPTED  # b's pace is known: a is slow
    clock.now += 10
    assert jobs.lease("c") == 0  # a backup of a's chunk, before any result of it
    assert _settle(jobs, "a", 0, 1) is Outcome.VOTED
    outcome = jobs.complete_chunk("c", 7, 0, _fit(9), 5, 9, blind=True)
    assert outcome is Outcome.COPY and not jobs.complete
    assert list(jobs.checks) == [0] and jobs.lease("d") == 0  # still waits for a check
    assert _settle(jobs, "d", 0, 1) is Outcome.ACCEPTED and jobs.complete
    # the first result of a chunk is blind to nothing: it votes
    fresh, _ = _jobs(chunks=1)
    fresh.lease("a")
    assert fresh.complete_chunk("a", 7, 0, _fit(0), 5, 1, blind=True) is Outcome.ACCEPTED
