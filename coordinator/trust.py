"""The run's trust rules (protocol/SPEC.md §8): whose vote counts, when votes agree, when a
check is waived, and who is convicted. Pure code with an injected clock: no asyncio, no
sockets, no logging; what the run agreed is kept through the `Ledger` it is handed (the
store), and every call returns the events it caused (`events.py`).

- Groups: a vote is cast by a worker's group, its machine (its address, `worker:NAME` for
  a worker enrolled with a credential, or its certificate's identity with
  --machine-identity certificate) while workers of two machines are connected, else its
  connection (a run on one machine). A machine's connections never confirm each other,
  nor one that comes back; groups are worked out when votes are counted, so all of them
  count the same way.
- Quorum: the run's data digest (unless the operator gave it) and each step's replica
  digest are agreed when two groups report them; a report that differs from an agreed
  digest is its worker's divergence (`Distrusted`), never the run's. Tallies are kept
  DIGEST_WINDOW steps past the open step, one report per worker and step.
- Waivers: a check (jobs.py) waits for another group's equal result; it is waived on its
  one result only when every connected group has voted on it or has stalled. A worker
  stalls when it has neither returned a result nor asked for work at the open step for
  STALL_S and holds a lease unanswered past its overdue time, or none while not waiting
  for one. A dispute is never waived: when every group able to vote has, it is
  `Undecided` until another machine joins.
- Convictions: the group of a worker whose result lost a vote goes (every connection of
  its machine, and its votes of the step); its machine is suspect from then on (kept in
  run.json), so every result from it waits for another group's check.
- Non-determinism: an `Undecided` dispute that no machine joining within UNDECIDED_GRACE_S
  decides, or disputes of the last DIGEST_WINDOW steps that
  no one machine explains (no machine is alone against agreeing others in every one), is
  named `Nondeterministic` (`halt`): honest machines that disagree run a reward or
  objective that is not a pure function of its inputs, and waiting would not end it. The
  core's shell stops the run on it, every committed step kept.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Protocol

from ..protocol import ErrorCode
from ..protocol.errors import ADDRESS_OUTVOTED
from .events import (
    ChunkChecked,
    DataDigestAgreed,
    DigestMismatch,
    DigestsDisagree,
    Event,
    Nondeterministic,
    Outvoted,
    Requeued,
    SharedIdentity,
    Stalled,
    Unchecked,
    Undecided,
)
from .jobs import STALL_S, Clock, StepJobs

__all__ = ["DIGEST_WINDOW", "Distrusted", "Group", "Ledger", "Member", "Trust"]

# Steps a digest tally is kept after the run moves past it: a worker that lags the others (a
# CPU beside GPUs reports the steps it reaches late) still has its digests compared.
DIGEST_WINDOW = 64
# Seconds a dispute no connected machine can decide waits before the run stops on it: a
# machine that is joining (the workers of a run start in some order) decides it instead.
UNDECIDED_GRACE_S = 20.0

Group = tuple[str, ...]  # whose vote a worker casts: (machine,) or (machine, connection)

# The likely cause when honest machines disagree, and what to do (the run's one line).
NONDETERMINISM = (
    "a reward or objective that is not a pure function of its inputs (a clock, random "
    "numbers, Python's hash()) gives this: make it deterministic (or, if one machine is "
    "faulty, start a worker on another) and restart the coordinator: it resumes where it "
    "stopped"
)


class Member(Protocol):
    """What the rules read and mark of a connected worker (core_types.py's `Peer`)."""

    id: int
    name: str
    address: str
    machine: str
    data_digest: bytes
    ready: bool  # past the handshake
    waiting: bool  # told to WAIT
    worked: float  # when it last did or asked for work at the open step
    stalled: bool  # reported as stalled, until its next RESULT
    outvoted: str  # why it is refused at its next message

    @property
    def host(self) -> str: ...

    @property
    def address_host(self) -> str: ...


class Ledger(Protocol):
    """What the run has agreed, kept across restarts (store.py's `RunStore`)."""

    digests: dict[int, int]  # step -> agreed replica digest

    @property
    def data_digest(self) -> bytes | None: ...

    def set_data_digest(self, digest: bytes) -> None: ...

    def record_digest(self, step: int, digest: int) -> None: ...

    @property
    def suspect_hosts(self) -> set[str]: ...

    def add_suspect_host(self, host: str) -> None: ...


class Distrusted(Exception):
    """A worker's report contradicts what the run agreed: the core refuses it with `code`.
    `events` are what happened on the way."""

    def __init__(self, code: ErrorCode, message: str, *events: Event) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.events = list(events)


class Trust:
    """The trust state of a run. `peers` is the core's own table of connected workers,
    read (and marked: outvoted, stalled) here; `step` arguments are the open step."""

    def __init__(self, ledger: Ledger, peers: Mapping[int, Member], clock: Clock) -> None:
        self.ledger = ledger
        self.peers = peers
        self.clock = clock
        self.data_votes: dict[bytes, set[int]] = {}  # unsettled data digest -> workers
        # step -> digest -> workers that reported it, for steps not yet agreed
        self.tallies: dict[int, dict[int, set[int]]] = {}
        self.disagreed: set[int] = set()  # steps in the tallies whose disagreement was reported
        # Where a worker was outvoted: every result checked (kept in run.json across restarts)
        self.suspect_hosts: set[str] = ledger.suspect_hosts
        self.ready_hosts: Counter[str] = Counter()  # connected workers per machine
        self.shared_said: set[str] = set()  # identities seen from two addresses (bounded:
        # one entry per certificate identity, which the CA issues)
        self.departed: dict[int, str] = {}  # the machine of each worker gone in this step
        # chunks of the step reported `Undecided`, and when: the run stops on one that is
        # still undecided UNDECIDED_GRACE_S later (a machine joining may decide it)
        self.undecided_said: dict[int, float] = {}
        self.unchecked_said = False  # a convict's results waiting for a checker, said
        # (step, chunk) -> the machines each of which alone could be wrong in its dispute,
        # and the workers whose results differed: DIGEST_WINDOW steps of disputes at most
        self.disputes: dict[tuple[int, int], tuple[frozenset[str], tuple[str, ...]]] = {}
        self.halt: Nondeterministic | None = None  # the run must stop: said once
        self.convicted: list[Group] = []  # groups that lost a vote, until the core takes them

    # ------------------------------------------------------------------ machines

    def join(self, peer: Member) -> list[Event]:
        """`peer` is past the handshake: its machine counts among the connected."""
        out = self._shared_identity(peer)
        self.ready_hosts[peer.host] += 1
        return out

    def leave(self, peer: Member, jobs: StepJobs) -> None:
        """`peer` is gone: its machine counts one connection less, and its votes on digests
        go (a vote counts while its worker is connected); its votes on chunks still count as
        its machine's."""
        if peer.ready:
            self.ready_hosts[peer.host] -= 1
            self.ready_hosts += Counter()  # drop the addresses left with none
        if peer.id in jobs.workers():
            self.departed[peer.id] = peer.host  # its votes of the step still count as its
        for votes in self.tallies.values():
            _forget(votes, peer.id)
        _forget(self.data_votes, peer.id)

    def next_step(self, step: int) -> None:
        """The step before `step` is committed: forget its departed and undecided, and
        tallies past the window."""
        self.departed.clear()
        self.undecided_said.clear()
        self.unchecked_said = False
        for old in [s for s in self.tallies if s < step - DIGEST_WINDOW]:
            del self.tallies[old]  # DIGEST_WINDOW + 1 steps of tallies at most, a vote a worker
        self.disagreed = {s for s in self.disagreed if s >= step - DIGEST_WINDOW}
        for key in [k for k in self.disputes if k[0] < step - DIGEST_WINDOW]:
            del self.disputes[key]

    def rewound(self, step: int) -> None:
        """The run rewound to `step` (rewind.py): tallies and disputes of undone steps go,
        and with every worker about to reconnect, so do the open step's departed."""
        self.next_step(step)
        for old in [s for s in self.tallies if s > step]:
            del self.tallies[old]
        self.disagreed = {s for s in self.disagreed if s <= step}
        for key in [k for k in self.disputes if k[0] >= step]:
            del self.disputes[key]

    def host(self, worker: int) -> str:
        peer = self.peers.get(worker)
        return peer.host if peer is not None else self.departed[worker]

    def group(self, worker: int) -> Group:
        """Whose vote a worker casts (on a chunk, a digest): its machine's (address, or
        certificate with --machine-identity certificate) while workers of two are
        connected (a machine's connections never confirm each other, nor one that comes
        back), else each connection its own (a run on one machine). Worked out when the
        votes are counted, so all of them count the same way."""
        host = self.host(worker)
        return (host,) if len(self.ready_hosts) > 1 else (host, str(worker))

    def suspect(self, peer: Member) -> bool:
        """Whether every result from `peer` waits for another group's check: its machine,
        or its address (recorded while addresses stood for machines), was outvoted."""
        return not self.suspect_hosts.isdisjoint({peer.host, peer.address_host})

    def _shared_identity(self, peer: Member) -> list[Event]:
        """A certificate identity connected from two addresses at once: one certificate (or
        common name) on several machines, which then count as one in the checks. Said once
        an identity; a machine with two addresses is the case to tell from it."""
        if not peer.machine or peer.machine in self.shared_said:
            return []
        hosts = {p.address_host for p in self.peers.values() if p.ready and p.host == peer.host}
        if not hosts - {peer.address_host}:
            return []
        self.shared_said.add(peer.machine)
        return [SharedIdentity(peer.machine, tuple(sorted(hosts)))]

    # ------------------------------------------------------------------ digests

    def check_data_digest(self, peer: Member) -> list[Event]:
        """The operator's digest, or the one two workers agree on, is the run's."""
        run_digest, mine = self.ledger.data_digest, peer.data_digest
        if run_digest is not None:
            if run_digest != mine:
                raise Distrusted(
                    ErrorCode.DATA_MISMATCH,
                    f"worker data digest {mine.hex()[:16]} differs from the run's "
                    f"{run_digest.hex()[:16]}: give the worker the run's data directory",
                )
            return []
        voters = self.data_votes.setdefault(mine, set())
        voters.add(peer.id)
        if len({self.group(v) for v in voters}) < 2:
            return []
        self.ledger.set_data_digest(mine)
        self.data_votes.clear()
        return [DataDigestAgreed(mine, len(voters))]

    def check_digest(self, peer: Member, step: int, digest: int, open_step: int) -> list[Event]:
        """Tally a report; DIVERGED when it differs from the step's agreed digest."""
        agreed = self.ledger.digests.get(step)
        if agreed is not None:
            if agreed != digest:
                raise Distrusted(
                    ErrorCode.DIVERGED,
                    f"replica digest at step {step} differs from the run's agreed one: resync",
                    DigestMismatch(peer.name, step),
                )
            return []
        if step < open_step - DIGEST_WINDOW:
            return []  # its tally is gone: a report this old is never agreed now
        # One report per worker and step, so a peer cannot grow the tally without bound.
        votes = self.tallies.setdefault(step, {})
        _forget(votes, peer.id)
        voters = votes.setdefault(digest, set())
        voters.add(peer.id)
        if len({self.group(v) for v in voters}) >= 2:
            self.agree(step, digest)
        elif len(votes) > 1 and step not in self.disagreed:  # once a step, late reports too
            self.disagreed.add(step)
            return [DigestsDisagree(step, len(votes))]
        return []

    def agree(self, step: int, digest: int) -> None:
        self.ledger.record_digest(step, digest)
        del self.tallies[step]

    def provisional(self, peer: Member, step: int) -> int | None:
        """The digest `peer` reported for `step` if it is the run's only worker, else None."""
        if sum(1 for p in self.peers.values() if p.ready) != 1:
            return None
        for digest, voters in self.tallies.get(step, {}).items():
            if peer.id in voters:
                return digest
        return None

    # ------------------------------------------------------------------ checks

    def waive(self, jobs: StepJobs, step: int) -> list[Event]:
        """Settle on its one result a check that no connected worker could make: every
        connected group has voted on it (the run's only machine), or is stalled. A checker
        that is slow, even past its lease's deadline, is waited for (being slow says nothing
        of whether another worker lies, and a liar could make honest leases expire early),
        but not forever: a worker that has neither returned a result nor asked for a job at
        the open step for STALL_S, and holds a lease unanswered past its overdue time (at
        least STALL_S) or none while not waiting for one (hung while it heartbeats, or stuck
        short of the open step), counts as gone until it works again. One machine's hung
        GPU must not halt the others' run."""
        if not jobs.checks:
            return []
        groups, stalled = self.able(jobs)
        out: list[Event] = []
        now = self.clock()
        for chunk in self.undecided(jobs, groups):  # reported once a step
            workers = [w for ws in jobs.votes[chunk].values() for w in ws]
            if chunk not in self.undecided_said:
                self.undecided_said[chunk] = now
                hosts = {self.host(w) for w in workers}
                out.append(Undecided(step, chunk, tuple(sorted(hosts))))
            if now >= self.undecided_said[chunk] + UNDECIDED_GRACE_S:
                out += self._stop(step, chunk, self._names(workers), undecided=True)
        # A convicted machine's result is never waived: alone in the run after a rewind,
        # it would commit its lies again. It waits for another machine, and says so once.
        waived, held, convicts = [], [], set()
        for c in (c for c in jobs.waivable() if groups <= jobs.voted(c)):
            hosts = self._hosts(jobs, c) & self.suspect_hosts
            (held if hosts else waived).append(c)
            convicts |= hosts
        if held and not self.unchecked_said:
            self.unchecked_said = True
            out.append(Unchecked(step, tuple(held), tuple(sorted(convicts))))
        if not waived:
            return out
        for p in stalled:  # reported once a spell, where it held up a check
            group = self.group(p.id)
            if not p.stalled and any(group not in jobs.voted(c) for c in waived):
                p.stalled = True
                out.append(Stalled(p.name, p.address, step, round(now - p.worked)))
        jobs.waive(waived)
        return [*out, ChunkChecked("waived", step, tuple(waived))]

    def _hosts(self, jobs: StepJobs, chunk: int) -> set[str]:
        return {self.host(w) for ws in jobs.votes.get(chunk, {}).values() for w in ws}

    def able(self, jobs: StepJobs) -> tuple[set[Group], list[Member]]:
        """The groups a check waits for (`waive`), and the connected workers that stalled."""
        overdue, now = jobs.overdue(), self.clock()
        groups, stalled = set(), []
        for p in self.peers.values():
            if not p.ready or p.outvoted:
                continue
            # Silent STALL_S, and then holding a lease past its overdue time, or none while
            # not waiting for one. Silence alone is not enough: one chunk dropped (a reward
            # that failed) must not make a worker that goes on working stalled.
            if now >= p.worked + STALL_S and (  # the sum `stall_times` wakes the core at
                p.id in overdue or (not p.waiting and not jobs.live[p.id])
            ):
                stalled.append(p)
            else:
                groups.add(self.group(p.id))
        return groups, stalled

    def stall_times(self) -> list[float]:
        """When each connected worker would stall, silent from now on, and when an
        undecided chunk's grace ends."""
        grace = [t + UNDECIDED_GRACE_S for t in self.undecided_said.values()]
        return [p.worked + STALL_S for p in self.peers.values() if p.ready] + grace

    def undecided(self, jobs: StepJobs, groups: set[Group]) -> list[int]:
        """Disputed chunks on which every group in `groups` has voted: only another machine
        can decide them (with two machines in the run, a third)."""
        votes = jobs.votes
        return [c for c in jobs.checks if len(votes[c]) > 1 and groups <= jobs.voted(c)]

    # ------------------------------------------------------------------ non-determinism

    def note_dispute(self, jobs: StepJobs, step: int, chunk: int) -> list[Event]:
        """Record which machines could each alone explain `chunk`'s differing results (call
        before `convict`, which drops the loser's votes). When no machine is in every
        dispute's set of the last DIGEST_WINDOW steps, no one machine explains them: a
        liar or a faulty device is alone against the others' agreement, chunk after chunk,
        while a non-deterministic reward sets honest machines against each other."""
        votes = jobs.votes.get(chunk, {})
        if len(votes) < 2:
            return []
        by_group = {self.group(w): key for key, ws in votes.items() for w in ws}
        alone = set()
        for group, key in by_group.items():
            others = {k for g, k in by_group.items() if g != group}
            if len(others) == 1 and key not in others:  # it alone against agreeing others
                alone.add(group[0])  # its machine (a run on one machine: that machine)
        workers = [w for ws in votes.values() for w in ws]
        self.disputes[(step, chunk)] = (frozenset(alone), self._names(workers))
        if frozenset.intersection(*(a for a, _ in self.disputes.values())):
            return []
        names = sorted({n for _, ns in self.disputes.values() for n in ns})
        return self._stop(step, chunk, tuple(names), undecided=False)

    def _names(self, workers: list[int]) -> tuple[str, ...]:
        """The workers' names (their machines' once they have left), for the run's line."""
        peers = self.peers
        return tuple(sorted({peers[w].name if w in peers else self.host(w) for w in workers}))

    def _stop(
        self, step: int, chunk: int, workers: tuple[str, ...], undecided: bool
    ) -> list[Event]:
        """Name the non-determinism once: the shell stops the run on `halt`."""
        if self.halt is not None:
            return []
        who = _listed(workers)
        if undecided:
            what = (
                f"workers {who} computed different fitness for chunk {chunk} of step {step} "
                "and no third machine can decide"
            )
        else:
            steps = sorted({s for s, _ in self.disputes})
            span = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}..{steps[-1]}"
            what = (
                f"workers {who} computed different fitness for chunks of {span} and no one "
                "machine differs from the others in every dispute"
            )
        self.halt = Nondeterministic(step, chunk, workers, undecided, f"{what}; {NONDETERMINISM}")
        return [self.halt]

    def take_convicted(self) -> list[Group]:
        """The groups convicted since last asked (their committed results are suspect)."""
        taken, self.convicted = self.convicted, []
        return taken

    def convict(self, jobs: StepJobs, step: int) -> list[Event]:
        """Workers whose results lost a vote: dropped with their results of the step, their
        address checked from now on, refused at their next message."""
        out: list[Event] = []
        while taken := jobs.take_outvoted():  # dropping votes may settle more chunks
            for loser, chunk in taken:
                # Its group goes: every connection of its machine, its votes (gone or not).
                group = self.group(loser)
                if group not in self.convicted:
                    self.convicted.append(group)  # its committed results are undone (rewind.py)
                workers = jobs.workers() | set(self.peers)
                for worker in sorted(w for w in workers if self.group(w) == group):
                    requeued = jobs.drop_worker(worker)
                    if requeued:
                        out.append(Requeued("outvoted", tuple(requeued), step))
                    host = self.host(worker)
                    if host not in self.suspect_hosts:
                        self.ledger.add_suspect_host(host)
                        self.suspect_hosts = self.ledger.suspect_hosts  # bounded as stored
                    peer = self.peers.get(worker)
                    if peer is None:
                        continue
                    # The loser hears why; its machine's other workers resync too, told
                    # apart (ADDRESS_OUTVOTED): they count no divergence of their own.
                    first = not peer.outvoted
                    if worker == loser:
                        peer.outvoted = (
                            f"fitness for chunk {chunk} of step {step} lost a vote to "
                            "other workers': resync"
                        )
                    elif first:
                        peer.outvoted = ADDRESS_OUTVOTED
                    peer.waiting = False
                    if first:
                        out.append(Outvoted(peer.name, peer.address, step, chunk))
        return out


def _listed(names: tuple[str, ...]) -> str:
    """'a', 'a and b', 'a, b and c'."""
    if len(names) < 2:
        return "".join(names)
    return f"{', '.join(names[:-1])} and {names[-1]}"


def _forget(votes: dict, peer_id: int) -> None:
    """Take `peer_id` out of every voter set of `votes`, dropping the sets left empty."""
    for key in [k for k, voters in votes.items() if peer_id in voters]:
        votes[key].discard(peer_id)
        if not votes[key]:
            del votes[key]
