"""The trust rules on their own (coordinator/trust.py): machine groups, digest quorum, waivers,
stalls and convictions, driven with a fake clock, in-memory workers and an in-memory ledger."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from eggroll_dist.coordinator.events import (
    ChunkChecked,
    DataDigestAgreed,
    DigestMismatch,
    DigestsDisagree,
    Nondeterministic,
    Outvoted,
    Requeued,
    SharedIdentity,
    Stalled,
    Unchecked,
    Undecided,
)
from eggroll_dist.coordinator.jobs import STALL_S, ChunkTimer, Outcome, StepJobs
from eggroll_dist.coordinator.trust import DIGEST_WINDOW, UNDECIDED_GRACE_S, Distrusted, Trust
from eggroll_dist.protocol import ErrorCode, pack_ternary
from eggroll_dist.protocol.errors import ADDRESS_OUTVOTED

STEP = 7
MEMBERS = 10  # per chunk: 5 pairs


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass(eq=False)
class Worker:
    """A connected worker as the rules see it (the core's `Peer` has these and more)."""

    id: int
    address: str
    machine: str = ""
    name: str = ""
    data_digest: bytes = b""
    ready: bool = True
    waiting: bool = False
    worked: float = 100.0
    stalled: bool = False
    outvoted: str = ""

    @property
    def host(self) -> str:
        return self.machine or self.address_host

    @property
    def address_host(self) -> str:
        return self.address.rsplit(":", 1)[0]


@dataclass
class Ledger:
    digests: dict[int, int] = field(default_factory=dict)
    data_digest: bytes | None = None
    suspects: list[str] = field(default_factory=list)

    def set_data_digest(self, digest: bytes) -> None:
        self.data_digest = digest

    def record_digest(self, step: int, digest: int) -> None:
        self.digests[step] = digest

    @property
    def suspect_hosts(self) -> set[str]:
        return set(self.suspects)

    def add_suspect_host(self, host: str) -> None:
        self.suspects.append(host)


class Run:
    """The rules with the core's part played by hand: who is connected, the open step."""

    def __init__(self, suspects: tuple[str, ...] = ()) -> None:
        self.clock = FakeClock()
        self.ledger = Ledger(suspects=list(suspects))
        self.peers: dict[int, Worker] = {}
        self.trust = Trust(self.ledger, self.peers, self.clock)
        self.jobs = self.open_step()

    def open_step(self, verify: tuple[int, ...] = ()) -> StepJobs:
        self.jobs = StepJobs(
            STEP,
            4,
            MEMBERS,
            self.clock,
            ChunkTimer(fixed_s=30.0),
            verify=verify,
            group=self.trust.group,
        )
        return self.jobs

    def join(self, address: str, machine: str = "", **fields: object) -> Worker:
        worker = Worker(len(self.peers) + 1, address, machine, name=address, **fields)
        self.peers[worker.id] = worker
        self.events = self.trust.join(worker)
        return worker

    def leave(self, worker: Worker) -> None:
        del self.peers[worker.id]
        self.trust.leave(worker, self.jobs)

    def score(self, worker: Worker, chunk: int, seed: int) -> Outcome:
        """`worker` is leased `chunk` and returns the fitness drawn from `seed`."""
        assert self.jobs.lease(worker.id) == chunk
        fitness = pack_ternary(np.random.default_rng(seed).integers(-1, 2, size=MEMBERS // 2))
        return self.jobs.complete_chunk(
            worker.id, STEP, chunk, fitness, MEMBERS // 2, 0, verify=self.trust.suspect(worker)
        )


def test_votes_are_cast_by_machine_while_two_machines_are_connected() -> None:
    run = Run()
    a1, a2 = run.join("10.0.0.1:5000"), run.join("10.0.0.1:5001")
    # One machine: each connection its own group (a run on one host still checks itself).
    assert run.trust.group(a1.id) != run.trust.group(a2.id)
    b = run.join("10.0.0.2:5000")
    assert run.trust.group(a1.id) == run.trust.group(a2.id) == ("10.0.0.1",)
    assert run.trust.group(b.id) == ("10.0.0.2",)
    run.leave(b)
    assert run.trust.group(a1.id) == ("10.0.0.1", str(a1.id))


def test_a_certificate_stands_for_its_machine_and_one_shared_is_said_once() -> None:
    run = Run()
    first = run.join("10.0.0.1:5000", machine="cn:alice")
    assert run.events == []
    run.join("10.0.0.2:5000", machine="cn:bob")
    run.join("10.0.0.3:5000", machine="cn:alice")  # alice's certificate on another host
    assert run.events == [SharedIdentity("cn:alice", ("10.0.0.1", "10.0.0.3"))]
    assert run.trust.group(first.id) == ("cn:alice",)
    run.join("10.0.0.4:5000", machine="cn:alice")
    assert run.events == []  # said once an identity


def test_a_digest_is_agreed_by_two_groups_and_a_different_report_is_refused() -> None:
    run = Run()
    trust = run.trust
    a1, a2 = run.join("10.0.0.1:5000"), run.join("10.0.0.1:5001")
    b = run.join("10.0.0.2:5000")
    assert trust.check_digest(a1, 3, 0xAB, STEP) == []
    assert trust.check_digest(a2, 3, 0xAB, STEP) == []
    assert 3 not in run.ledger.digests  # one machine's connections never confirm each other
    assert trust.check_digest(b, 3, 0xAB, STEP) == []
    assert run.ledger.digests == {3: 0xAB} and 3 not in trust.tallies
    with pytest.raises(Distrusted) as lie:
        trust.check_digest(b, 3, 0xCD, STEP)
    assert lie.value.code is ErrorCode.DIVERGED
    assert lie.value.events == [DigestMismatch("10.0.0.2:5000", 3)]
    # Two groups that disagree: said once a step; a report older than the window is dropped.
    assert trust.check_digest(a1, 4, 1, STEP) == []
    assert trust.check_digest(b, 4, 2, STEP) == [DigestsDisagree(4, 2)]
    assert trust.check_digest(a2, 4, 3, STEP) == []
    assert trust.check_digest(a1, 0, 1, STEP + DIGEST_WINDOW + 1) == [] and 0 not in trust.tallies


def test_the_data_digest_is_agreed_by_two_groups_unless_the_operator_gave_it() -> None:
    run = Run()
    digest = b"\x42" * 32
    a = run.join("10.0.0.1:5000", data_digest=digest)
    assert run.trust.check_data_digest(a) == [] and run.ledger.data_digest is None
    b = run.join("10.0.0.2:5000", data_digest=digest)
    assert run.trust.check_data_digest(b) == [DataDigestAgreed(digest, 2)]
    assert run.ledger.data_digest == digest and run.trust.data_votes == {}
    other = run.join("10.0.0.3:5000", data_digest=b"\x00" * 32)
    with pytest.raises(Distrusted) as refused:
        run.trust.check_data_digest(other)
    assert refused.value.code is ErrorCode.DATA_MISMATCH


def test_a_digest_vote_counts_while_its_worker_is_connected() -> None:
    run = Run()
    a, b = run.join("10.0.0.1:5000"), run.join("10.0.0.2:5000")
    run.trust.check_digest(a, 3, 0xAB, STEP)
    assert run.trust.provisional(a, 3) is None  # not the only worker
    run.leave(b)
    assert run.trust.provisional(a, 3) == 0xAB  # the sole worker's report
    run.leave(a)
    assert run.trust.tallies == {3: {}}


def test_a_check_is_waived_once_every_connected_group_has_voted() -> None:
    run = Run()
    a, b = run.join("10.0.0.1:5000"), run.join("10.0.0.2:5000")
    run.open_step(verify=(0,))
    assert run.score(a, 0, 1) is Outcome.VOTED
    assert run.trust.waive(run.jobs, STEP) == []  # b's machine can check it
    run.leave(b)  # now every connected group has voted on it
    assert run.trust.waive(run.jobs, STEP) == [ChunkChecked("waived", STEP, (0,))]
    assert 0 in run.jobs.results and not run.jobs.checks


def test_a_dispute_is_never_waived_and_is_said_undecided_once() -> None:
    run = Run()
    a, b = run.join("10.0.0.1:5000"), run.join("10.0.0.2:5000")
    run.open_step(verify=(0,))
    assert run.score(a, 0, 1) is Outcome.VOTED
    assert run.score(b, 0, 2) is Outcome.DISPUTED
    said = run.trust.waive(run.jobs, STEP)
    assert said == [Undecided(STEP, 0, ("10.0.0.1", "10.0.0.2"))]
    assert run.trust.waive(run.jobs, STEP) == [] and 0 not in run.jobs.results
    assert run.clock.now + UNDECIDED_GRACE_S in run.trust.stall_times()  # the core wakes then
    run.clock.now += UNDECIDED_GRACE_S
    assert run.trust.waive(run.jobs, STEP) == [run.trust.halt] and run.trust.halt is not None
    assert run.trust.waive(run.jobs, STEP) == [] and 0 not in run.jobs.results
    run.trust.next_step(STEP + 1)
    assert run.trust.undecided_said == {}


def test_a_machine_joining_within_the_grace_decides_an_undecided_dispute() -> None:
    """Workers start in some order: a dispute between the first two is decided by a third
    that joins within UNDECIDED_GRACE_S, and the run does not stop."""
    run = Run()
    a, b = run.join("10.0.0.1:5000"), run.join("10.0.0.2:5000")
    run.open_step(verify=(0,))
    assert run.score(a, 0, 1) is Outcome.VOTED
    assert run.score(b, 0, 2) is Outcome.DISPUTED
    assert run.trust.waive(run.jobs, STEP) == [Undecided(STEP, 0, ("10.0.0.1", "10.0.0.2"))]
    run.clock.now += UNDECIDED_GRACE_S - 1.0
    c = run.join("10.0.0.3:5000")
    assert run.trust.waive(run.jobs, STEP) == []  # c can vote: no longer undecided
    run.score(c, 0, 1)
    run.clock.now += 2.0
    assert run.trust.waive(run.jobs, STEP) == [] and run.trust.halt is None


def test_a_silent_checker_stalls_after_stall_s_and_the_check_is_waived_without_it() -> None:
    run = Run()
    a, b = run.join("10.0.0.1:5000"), run.join("10.0.0.2:5000")
    run.open_step(verify=(0,))
    run.clock.now = a.worked = 250.0  # a returns a result (the core marks it working)
    assert run.score(a, 0, 1) is Outcome.VOTED
    assert run.trust.stall_times() == [250.0 + STALL_S, 100.0 + STALL_S]
    run.clock.now = b.worked + STALL_S - 1.0
    assert run.trust.waive(run.jobs, STEP) == []  # slow is not stalled
    b.waiting = True  # told to WAIT, it holds no lease for a reason: not stalled
    run.clock.now = b.worked + STALL_S
    assert run.trust.waive(run.jobs, STEP) == []
    b.waiting = False  # neither working nor waiting for work
    assert run.trust.able(run.jobs) == ({("10.0.0.1",)}, [b])
    assert run.trust.waive(run.jobs, STEP) == [
        Stalled("10.0.0.2:5000", "10.0.0.2:5000", STEP, round(STALL_S)),
        ChunkChecked("waived", STEP, (0,)),
    ]
    assert b.stalled and 0 in run.jobs.results


def test_an_outvoted_machine_is_convicted_with_all_its_connections() -> None:
    run = Run()
    liar, liar2 = run.join("10.0.0.9:5000"), run.join("10.0.0.9:5001")
    b, c = run.join("10.0.0.2:5000"), run.join("10.0.0.3:5000")
    run.open_step(verify=(0,))
    assert run.score(liar, 0, 9) is Outcome.VOTED
    assert run.jobs.lease(liar2.id) == 1  # its machine's other worker holds a chunk
    assert run.score(b, 0, 1) is Outcome.DISPUTED
    assert run.score(c, 0, 1) is Outcome.ACCEPTED  # two machines to one
    assert run.trust.convict(run.jobs, STEP) == [
        Outvoted("10.0.0.9:5000", "10.0.0.9:5000", STEP, 0),
        Requeued("outvoted", (1,), STEP),
        Outvoted("10.0.0.9:5001", "10.0.0.9:5001", STEP, 0),
    ]
    assert "chunk 0 of step 7 lost a vote" in liar.outvoted
    assert liar2.outvoted == ADDRESS_OUTVOTED
    assert not (b.outvoted or c.outvoted)
    assert run.ledger.suspects == ["10.0.0.9"] and run.trust.suspect_hosts == {"10.0.0.9"}
    assert run.jobs.queue[0] == 1  # its chunk goes back first
    # From now on every result from that machine waits for another machine's check.
    again = run.join("10.0.0.9:5002")
    assert run.trust.suspect(again) and not run.trust.suspect(b)
    assert run.trust.convict(run.jobs, STEP) == []  # each conviction once


def test_a_suspect_machine_is_read_from_the_ledger() -> None:
    run = Run(suspects=("10.0.0.9",))
    suspect = run.join("10.0.0.9:5000", machine="cn:x")  # its old address still counts
    run.join("10.0.0.2:5000")
    assert run.trust.suspect(suspect)
    assert run.score(suspect, 0, 1) is Outcome.VOTED  # not drawn for a check, still checked


def test_a_dispute_no_machine_can_decide_names_non_determinism_once() -> None:
    """Two machines whose results differ, with no third to decide: waiting would not end it
    (a reward that is not deterministic sets honest machines apart), so it is named, once,
    with both workers and the chunk, and the run is to stop."""
    run = Run()
    a, b = run.join("10.0.0.1:5000"), run.join("10.0.0.2:5000")
    run.open_step(verify=(2,))
    run.jobs.queue.rotate(-2)  # chunk 2 first
    assert run.score(a, 2, 1) is Outcome.VOTED
    assert run.score(b, 2, 2) is Outcome.DISPUTED
    assert run.trust.halt is None
    run.clock.now += 1.0
    said = run.trust.waive(run.jobs, STEP)
    assert said == [Undecided(STEP, 2, ("10.0.0.1", "10.0.0.2"))] and run.trust.halt is None
    run.clock.now += UNDECIDED_GRACE_S
    (halt,) = run.trust.waive(run.jobs, STEP)
    assert isinstance(halt, Nondeterministic) and halt is run.trust.halt
    assert (halt.step, halt.chunk, halt.undecided) == (STEP, 2, True)
    assert halt.workers == (a.name, b.name)
    assert halt.message.startswith(
        f"workers {a.name} and {b.name} computed different fitness for chunk 2 of step {STEP} "
        "and no third machine can decide; "
    )
    assert "Python's hash()" in halt.message and "make it deterministic" in halt.message
    assert run.trust.waive(run.jobs, STEP) == []  # said once


def score_key(run: Run, worker: Worker, chunk: int, seed: int) -> list:
    """`worker` scores `chunk` (a check copy or the queue's next) with the fitness of `seed`;
    the events of noting a dispute, then of convicting."""
    run.score(worker, chunk, seed)
    return run.trust.note_dispute(run.jobs, STEP, chunk) + run.trust.convict(run.jobs, STEP)


def test_one_liar_explains_every_dispute_and_is_convicted_without_a_halt() -> None:
    run = Run()
    liar, b, c = (run.join(f"10.0.0.{i}:5000") for i in (9, 2, 3))
    run.open_step(verify=(0, 1, 2, 3))
    for chunk, first, second in ((0, liar, b), (1, b, liar)):
        score_key(run, first, chunk, 100 if first is liar else 1)
        score_key(run, second, chunk, 100 if second is liar else 1)
    assert run.trust.disputes[(STEP, 0)][0] == {"10.0.0.9", "10.0.0.2"}
    events = score_key(run, c, 0, 1)  # c decides chunk 0: the liar alone differs
    assert [type(e) for e in events] == [Outvoted]
    assert run.trust.disputes[(STEP, 0)][0] == {"10.0.0.9"} and run.trust.halt is None


def test_disputes_no_one_machine_explains_name_non_determinism() -> None:
    """Three honest machines with a reward that is not deterministic: c sides with a against
    b on one chunk, then a and c differ on another. No machine is alone in both: not one
    machine's fault, but the run's."""
    run = Run()
    a, b, c = (run.join(f"10.0.0.{i}:5000") for i in (1, 2, 3))
    run.open_step(verify=(0, 1, 2, 3))
    score_key(run, a, 0, 1)
    score_key(run, b, 0, 2)
    assert [type(e) for e in score_key(run, c, 0, 1)] == [Outvoted]  # b loses this one
    score_key(run, a, 1, 3)
    events = score_key(run, c, 1, 4)
    assert [type(e) for e in events] == [Nondeterministic]
    halt = events[0]
    assert not halt.undecided and halt.workers == (a.name, b.name, c.name)
    assert f"chunks of step {STEP} and no one machine differs" in halt.message
    # Old disputes go with the digest window.
    run.trust.next_step(STEP + DIGEST_WINDOW + 1)
    assert run.trust.disputes == {}


def test_a_convicts_results_no_machine_can_check_are_said_to_wait_once() -> None:
    """A machine that lost a vote, alone in the run: its results are never waived, and the
    run says once why the step waits instead of waiting silently."""
    run = Run(suspects=("10.0.0.9",))
    liar = run.join("10.0.0.9:5000")
    assert run.score(liar, 0, 1) is Outcome.VOTED
    said = run.trust.waive(run.jobs, STEP)
    assert said == [Unchecked(STEP, (0,), ("10.0.0.9",))]
    assert run.trust.waive(run.jobs, STEP) == [] and 0 not in run.jobs.results
    honest = run.join("10.0.0.2:5000")  # another machine checks it
    assert run.score(honest, 0, 1) is Outcome.ACCEPTED
