"""The session flow of protocol/SPEC.md §8, in memory: the coordinator's run core and worker
sessions joined by `Connection` pairs over a fake network, with a fake clock. No sockets, no
threads; the replicas are real NumPy backends of a tiny model, so digests must agree.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import structlog
from helpers import UNIT_CFG, Network, Worker, digest_at, sends, sync_replica, words_data_dir

from eggroll_dist.coordinator import trust as trust_module
from eggroll_dist.coordinator.core_types import Want
from eggroll_dist.coordinator.events import (
    ChunkAccepted,
    Joined,
    Leased,
    NameShared,
    Outvoted,
    Overprovisioned,
    SharedIdentity,
    Stalled,
    Undecided,
    WorkerLog,
    WorkerLogsDropped,
)
from eggroll_dist.coordinator.jobs import STALL_S
from eggroll_dist.coordinator.metrics import CHECK_RESULTS
from eggroll_dist.coordinator.run import (
    Refused,
    RunCore,
    Sampled,
)
from eggroll_dist.coordinator.store import RunStore
from eggroll_dist.protocol import (
    PROTOCOL_VERSION,
    ErrorCode,
    Message,
    iter_snapshot_chunks,
    messages,
    pack_ternary,
    unpack_ternary,
)
from eggroll_dist.protocol.errors import ADDRESS_OUTVOTED
from eggroll_dist.shared.config import ESConfig, RunConfig, ValidationConfig
from eggroll_dist.shared.data import Dataset, load_data_dir
from eggroll_dist.shared.logs import (
    EVENT_FIELDS,
    PROGRESS,
    SAMPLE,
    SHOWN_EVENTS,
    STEP,
    VALIDATION,
    held_out_text,
)
from eggroll_dist.shared.replica import (
    ReplicaState,
    decode_checkpoint,
    encode_checkpoint,
    replay,
)
from eggroll_dist.shared.sample import TrainingSamples
from eggroll_dist.shared.vocab import NEWLINE_MARK, escape
from eggroll_dist.worker import session as session_module
from eggroll_dist.worker.backend import ChunkResult, HeldOut
from eggroll_dist.worker.backend import Validation as Score
from eggroll_dist.worker.backend.numpy_backend import NumpyBackend
from eggroll_dist.worker.session_types import (
    Ended,
    ExportSnapshot,
    PeerViolation,
    Phase,
    RunSample,
    RunValidation,
)

# 16 members in 2 chunks of 8; validation only when a test asks for it.
CFG = UNIT_CFG.replace(validation=ValidationConfig(every_steps=0, max_tokens=64))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Dataset:
    return load_data_dir(words_data_dir(tmp_path_factory.mktemp("data"), docs=20, words=200))


@pytest.fixture
def store(tmp_path: Path) -> Iterator[RunStore]:
    s = RunStore.open(tmp_path / "run", CFG)
    yield s
    s.close()


def kinds(messages: list[Message]) -> list[str]:
    return [m.TYPE.name for m in messages]


# --- Handshake ----------------------------------------------------------------------------


def test_handshake_welcome_then_job_request(store: RunStore, dataset: Dataset) -> None:
    net = Network(store, dataset, token=b"s3cret")
    w = net.join("w1", token=b"s3cret")
    net.run()
    assert kinds(w.sent) == ["HELLO", "AUTH", "JOB_REQUEST"]
    welcome = w.got[1]
    assert isinstance(welcome, messages.Welcome)
    assert (welcome.run_id, welcome.current_step, welcome.snapshot_step) == (store.run_id, 0, -1)
    assert store.data_digest is None  # one worker alone settles nothing (see below)
    assert kinds(w.got) == ["CHALLENGE", "WELCOME", "JOB"]
    assert w.session.phase is Phase.EVALUATING  # the job is held by the test's mark


@pytest.mark.parametrize(
    ("join", "code"),
    [
        ({"token": b"wrong"}, ErrorCode.AUTH_FAILED),
        ({"data_digest": b"\x01" * 32}, ErrorCode.DATA_MISMATCH),
    ],
)
def test_handshake_refusals_are_permanent(
    store: RunStore, dataset: Dataset, join: dict, code: ErrorCode
) -> None:
    if code is ErrorCode.DATA_MISMATCH:
        join["token"] = b"s3cret"
    net = Network(store, dataset, token=b"s3cret", data_digest=dataset.digest)  # the operator's
    w = net.join("w", **join)
    net.run()
    assert (w.name, code) in net.refused
    assert w.fatal is not None and w.fatal.code is code and not w.fatal.tell


def test_bad_version_is_refused(store: RunStore, dataset: Dataset) -> None:
    core = Network(store, dataset).core
    peer = core.connect("mem:old")
    with pytest.raises(Refused) as refused:
        core.receive(
            peer, messages.Hello(PROTOCOL_VERSION + 1, "old", "numpy", "cpu", dataset.digest)
        )
    assert refused.value.code is ErrorCode.BAD_VERSION


def test_a_config_the_worker_cannot_run_is_refused_by_the_worker(
    store: RunStore, dataset: Dataset
) -> None:
    net = Network(store, dataset)
    w = net.join("w", vocab_size=dataset.meta.vocab_size + 1)
    net.run()
    assert w.fatal is not None and w.fatal.code is ErrorCode.CONFIG_MISMATCH
    assert "vocabulary" in str(w.fatal)
    assert net.core.peers == {}  # the ERROR reached the coordinator's side


# --- Jobs, results and commit -------------------------------------------------------------


def test_two_workers_train_and_every_replica_agrees(store: RunStore, dataset: Dataset) -> None:
    net = Network(store, dataset)
    a, b = net.join("a"), net.join("b")
    net.run()  # both through the handshake, each holding one chunk of step 0
    net.train(3)
    assert store.steps == 3 and store.fitness_log.steps == 3
    want = digest_at(store.path, 3)
    assert a.replica.digest == b.replica.digest == want
    assert store.digests[3] == want
    # Both evaluated chunks; each RESULT went out with the replica's digest of its step.
    assert all(any(isinstance(m, messages.Result) for m in w.sent) for w in (a, b))


@pytest.fixture
def store4(tmp_path: Path) -> Iterator[RunStore]:
    """A run of 4 chunks a step."""
    s = RunStore.open(tmp_path / "run", CFG.replace(es=ESConfig(32, 8, 8)))
    yield s
    s.close()


def test_a_worker_scores_several_chunks_per_request(store4: RunStore, dataset: Dataset) -> None:
    """A backend that scores 4 chunks at once asks for 4 and gets them as one request's
    JOBs (`more` counting down), evaluates them in one call, and sends a RESULT for each."""
    net = Network(store4, dataset)
    w = net.join("w", replica=sync_replica(dataset, threads=4))
    calls: list[int] = []
    evaluate = w.replica.evaluate

    async def counting(step: int, chunks: list[tuple[int, int]]) -> object:
        calls.append(len(chunks))
        return await evaluate(step, chunks)

    w.replica.evaluate = counting  # type: ignore[method-assign]
    net.train(2)
    requests = [m for m in w.sent if isinstance(m, messages.JobRequest)]
    assert requests and all(r.max_chunks == 4 for r in requests)
    jobs = [m for m in w.got if isinstance(m, messages.Job)]
    assert [j.more for j in jobs[:4]] == [3, 2, 1, 0]
    assert calls[:2] == [4, 4]  # each step's four chunks in one backend call
    results = [r.chunk for r in w.sent if isinstance(r, messages.Result) and r.step == 0]
    assert sorted(results) == [0, 1, 2, 3]
    assert w.replica.digest == digest_at(store4.path, 2)


def test_a_step_is_shared_among_the_workers_at_it(store4: RunStore, dataset: Dataset) -> None:
    """With two connected workers, a request for 4 of 4 chunks gets its share, 2 (at step
    0 the first one asked alone)."""
    net = Network(store4, dataset)
    a = net.join("a", replica=sync_replica(dataset, threads=4))
    b = net.join("b", replica=sync_replica(dataset, threads=4))
    net.run()  # both through the handshake
    net.train(2)
    jobs = [m for w in (a, b) for m in w.got if isinstance(m, messages.Job) and m.step == 1]
    assert jobs and max(j.more for j in jobs) == 1  # requests answered with two JOBs
    assert a.replica.digest == b.replica.digest == digest_at(store4.path, 2)


@pytest.mark.parametrize(
    "then",
    [
        messages.Step.from_values(0, np.zeros(CFG.pairs, dtype=np.int8)),  # a STEP among them
        messages.Wait(10),  # a WAIT among them
        messages.Job(0, 1, 8, 8, 0),  # not counting down (1 -> 0 skips nothing: 2 -> 0)
        messages.Job(0, 0, 0, 8, 1),  # a chunk twice
        messages.Job(1, 1, 8, 8, 1),  # another step
    ],
    ids=["step", "wait", "count", "twice", "other-step"],
)
def test_a_requests_jobs_must_come_together(
    store: RunStore, dataset: Dataset, then: Message
) -> None:
    """SPEC §8: a request's JOBs count down without anything between them; anything else
    is a protocol violation, never a batch of two requests' chunks."""
    net = Network(store, dataset)
    w = net.join("w", replica=sync_replica(dataset, threads=4))
    net.run()
    s = w.session
    s.phase = Phase.REQUESTED  # as after its next JOB_REQUEST
    assert s.receive(messages.Job(0, 0, 0, 8, 2)) == [] and s.phase is Phase.REQUESTED
    assert s.advance() == []  # the request is still being answered: no second one
    with pytest.raises(PeerViolation):
        s.receive(then)


def test_a_worker_asking_again_gets_no_more_than_its_share(
    store4: RunStore, dataset: Dataset
) -> None:
    """A worker that asks again while it holds its share of the step gets WAIT."""
    net = Network(store4, dataset)
    net.join("a", replica=sync_replica(dataset, threads=4)).hold_jobs = True
    net.join("b").hold_jobs = True
    net.run()
    core = net.core
    peer = next(p for p in core.peers.values() if p.name == "a")
    held = core.jobs.live[peer.id]
    assert held >= 2  # its share of 4 chunks between 2 workers (it asked first, alone)
    digest = ReplicaState.initial(store4.config).digest()
    again = sends(core.receive(peer.id, messages.JobRequest(0, digest, 0, 4)))
    assert [type(o.msg).__name__ for o in again] == ["Wait"] and core.jobs.live[peer.id] == held


def test_workers_past_one_a_chunk_are_reported_once(store: RunStore, dataset: Dataset) -> None:
    net = Network(store, dataset)  # 2 chunks of 8 members
    for name in "abcd":
        net.join(name)
    net.run()
    (said,) = [e for e in net.events if isinstance(e, Overprovisioned)]
    assert (said.workers, said.chunks, said.chunk_size) == (3, 2, 8)


def test_a_second_worker_of_the_same_name_is_reported(store: RunStore, dataset: Dataset) -> None:
    net = Network(store, dataset)
    net.join("w1")
    net.join("w2")
    net.join("w1", host="other")
    net.run()
    (said,) = [e for e in net.events if isinstance(e, NameShared)]
    assert said.worker == "w1" and said.address == "other:w1" and said.other == "mem:w1"
    net.train(1)  # both still work for the run


def test_a_workers_log_lines_are_kept_within_an_allowance(
    store: RunStore, dataset: Dataset
) -> None:
    """A worker flooding LOG lines gets LOG_BURST through at once and LOG_PER_S a second
    after that; the rest are dropped and counted with its next line that goes through."""
    from eggroll_dist.coordinator.core_types import LOG_BURST, LOG_PER_S

    net = Network(store, dataset)
    w = net.join("chatty")
    net.run()

    def say(n: int) -> list:
        out = []
        for i in range(n):
            out += net.core.receive(w.peer, messages.Log(messages.LogLevel.INFO, f"line {i}"))
        return out

    first = say(LOG_BURST + 80)
    assert [type(e) for e in first] == [WorkerLog] * LOG_BURST
    net.clock.now += 2 / LOG_PER_S  # room for two more
    later = say(5)
    assert isinstance(later[0], WorkerLogsDropped) and later[0].lines == 80
    assert [type(e) for e in later[1:]] == [WorkerLog, WorkerLog]
    dropped = [e for e in say(1) if isinstance(e, WorkerLogsDropped)]
    assert dropped == []  # nothing through, nothing said: the 3 of `later` wait for the next


def test_commit_is_logged_before_any_step_is_sent(store: RunStore, dataset: Dataset) -> None:
    net = Network(store, dataset)
    w = net.join("w")
    logged_at_step = []
    original = w.deliver

    def deliver(data: bytes) -> None:
        before = len(w.got)
        original(data)
        for msg in w.got[before:]:
            if isinstance(msg, messages.Step):
                logged_at_step.append((msg.step, store.fitness_log.steps))

    w.deliver = deliver  # type: ignore[method-assign]
    net.train(2)
    assert logged_at_step == [(0, 1), (1, 2)]
    assert (
        store.fitness_log.read(0, 1)[0]
        == next(m for m in w.got if isinstance(m, messages.Step)).fitness
    )


def test_wait_then_retry_and_a_job_pushed_during_the_wait(
    store: RunStore, dataset: Dataset
) -> None:
    net = Network(store, dataset)
    a, b, c = net.join("a"), net.join("b"), net.join("c")
    net.run()  # a and b lease the two chunks (and hold them); c is told to WAIT
    assert isinstance(c.got[-1], messages.Wait) and c.session.phase is Phase.WAITING
    # The WAIT runs out: c asks again and waits again (no chunk, no timing for backups).
    net.advance(WAIT_S)
    assert kinds(c.sent).count("JOB_REQUEST") == 2 and c.session.phase is Phase.WAITING
    # a leaves: its chunk is re-queued at once and pushed to c, unasked.
    (lost,) = a.held
    a.close("gone")
    assert isinstance(c.inbox[-1], messages.Job) and c.inbox[-1].chunk == lost.chunk
    assert net.metrics.chunks_requeued.labels("disconnect")._value.get() == 1
    net.train(1)
    assert store.steps == 1
    assert c.replica.digest == b.replica.digest == digest_at(store.path, 1)


def test_stale_job_request_is_left_unanswered_or_answered_with_fitness(
    store: RunStore, dataset: Dataset
) -> None:
    net = Network(store, dataset)
    w = net.join("w")
    net.train(2)
    core, peer = net.core, w.peer
    # A JOB_REQUEST from step 1 after STEP 1 was sent to it: the STEP answers it.
    assert core.receive(peer, messages.JobRequest(1, digest_at(store.path, 1), 0)) == []
    # From before this connection's first STEP: the missing steps come as FITNESS_RANGE.
    late = net.join("late")
    net.run()
    late_peer = late.peer
    core.peers[late_peer].broadcast_from = 2
    (reply,) = sends(core.receive(late_peer, messages.JobRequest(0, digest_at(store.path, 0), 0)))
    assert isinstance(reply.msg, messages.FitnessRange) and reply.msg.first_step == 0
    assert reply.msg.step_count == 2


def test_a_replica_ahead_of_the_run_or_with_another_digest_diverged(
    store: RunStore, dataset: Dataset
) -> None:
    net = Network(store, dataset)
    w, _ = net.join("w"), net.join("v")  # two workers: step 1's digest is agreed
    net.train(1)
    with pytest.raises(Refused) as ahead:
        net.receive(w.peer, messages.JobRequest(5, 0, 0))
    assert ahead.value.code is ErrorCode.DIVERGED
    with pytest.raises(Refused) as other:
        net.receive(w.peer, messages.JobRequest(1, store.digests[1] ^ 1, 0))
    assert other.value.code is ErrorCode.DIVERGED
    assert net.metrics.digest_mismatches._value.get() == 1


def test_diverged_worker_drops_its_replica_and_rejoins_from_step_0(
    store: RunStore, dataset: Dataset
) -> None:
    net = Network(store, dataset)
    w, _ = net.join("w"), net.join("v")
    net.train(2)
    w.replica.digest ^= 1  # a replica that no longer agrees: its RESULT says so
    w.finish_held()
    net.run()
    assert (w.name, ErrorCode.DIVERGED) in net.refused
    assert w.ended is not None and "diverged" in w.ended
    assert w.replica.backend is None  # dropped: it starts again from step 0
    again = net.join("w-again", replica=w.replica)
    net.run()
    assert again.replica.step == 2 and again.replica.digest == digest_at(store.path, 2)


def test_results_are_dropped_for_another_step_a_bad_chunk_or_a_duplicate(
    store: RunStore, dataset: Dataset
) -> None:
    net = Network(store, dataset)
    a = net.join("a")
    a.hold_jobs = True
    net.run()
    (job,) = a.held
    backend = NumpyBackend(dataset, ReplicaState.initial(CFG))
    r = backend.evaluate_chunk(0, job.first_member, job.member_count)
    digest = backend.digest()

    def result(step: int, chunk: int, fitness: np.ndarray) -> messages.Result:
        return messages.Result.from_values(
            step=step, chunk=chunk, loss_sum=r.loss_sum, weights_changed=0,
            replica_digest=digest, fitness=fitness,
        )  # fmt: skip

    dropped = net.metrics.results_dropped
    net.receive(a.peer, result(0, job.chunk, r.fitness))
    net.receive(a.peer, result(0, job.chunk, r.fitness))  # an identical copy
    net.receive(a.peer, result(0, job.chunk, -r.fitness))  # a copy that differs
    net.receive(a.peer, result(0, 7, r.fitness))  # no such chunk
    net.receive(a.peer, result(3, 1 - job.chunk, r.fitness))  # for another step
    net.receive(a.peer, result(0, 1 - job.chunk, r.fitness[:2]))  # wrong pair count
    counts = {k: dropped.labels(k)._value.get() for k in ("duplicate", "mismatch")}
    assert counts == {"duplicate": 1, "mismatch": 1}
    assert dropped.labels("out_of_range")._value.get() == 1
    assert dropped.labels("bad_size")._value.get() == 1
    assert dropped.labels("stale")._value.get() == 1
    assert store.steps == 0  # chunk 1 is still open


def test_a_step_overtaking_a_running_chunk_and_a_straggler_backup(
    store: RunStore, dataset: Dataset
) -> None:
    net = Network(store, dataset)
    net.stop_at = 1
    slow = net.join("slow")
    slow.hold_jobs = True
    net.run()  # slow leases chunk 0 and evaluates it for a long time
    fast = net.join("fast")
    net.run()  # fast does chunk 1; then nothing is queued and no backup is due yet
    assert store.steps == 0 and fast.session.phase is Phase.WAITING
    # Chunk times are known now: a lease this old gets a backup copy on the next ask.
    net.advance(5.0)
    assert store.steps == 1  # fast's copy of chunk 0 won: step committed
    assert slow.busy() and isinstance(slow.inbox[0], messages.Step)
    slow.finish_held()  # the STEP was read meanwhile: the result is not sent
    assert not any(isinstance(m, messages.Result) for m in slow.sent)
    net.run()
    assert slow.replica.digest == fast.replica.digest == digest_at(store.path, 1)
    assert isinstance(slow.sent[-1], messages.JobRequest) and slow.sent[-1].replica_step == 1


def test_an_expired_lease_is_leased_again_and_the_first_result_wins(
    store: RunStore, dataset: Dataset
) -> None:
    net = Network(store, dataset, chunk_timeout_s=30.0)
    slow, other = net.join("slow"), net.join("other")
    net.run()  # each holds one chunk
    net.advance(31.0)  # both leases pass their deadline: both chunks go back in the queue
    assert net.metrics.chunks_requeued.labels("deadline")._value.get() == 2
    assert list(net.core.jobs.queue) == [slow.held[0].chunk, other.held[0].chunk]
    net.train(1)  # the late results still count (first valid result wins)
    assert store.steps == 1
    assert slow.replica.digest == other.replica.digest == digest_at(store.path, 1)


# --- Catch-up and snapshots -----------------------------------------------------------------


def test_catch_up_in_batches(
    store: RunStore, dataset: Dataset, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(session_module, "FITNESS_STEPS_PER_REQUEST", 2)
    rng = np.random.default_rng(1)
    for step in range(5):
        store.fitness_log.append(step, pack_ternary(rng.integers(-1, 2, CFG.pairs, np.int8)))
    net = Network(store, dataset)
    w = net.join("w")
    w.hold_jobs = True
    net.run()
    requests = [m for m in w.sent if isinstance(m, messages.FitnessRequest)]
    assert [(r.first_step, r.max_steps) for r in requests] == [(0, 2), (2, 2), (4, 2)]
    assert isinstance(w.sent[-1], messages.JobRequest) and w.sent[-1].replica_step == 5
    assert w.replica.digest == digest_at(store.path, 5)


def test_a_long_replay_logs_its_progress(
    store: RunStore, dataset: Dataset, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(session_module, "FITNESS_STEPS_PER_REQUEST", 2)
    monkeypatch.setattr(session_module, "QUIET_S", 0.0)  # as if each batch took a while
    rng = np.random.default_rng(2)
    for step in range(20):
        store.fitness_log.append(step, pack_ternary(rng.integers(-1, 2, CFG.pairs, np.int8)))
    net = Network(store, dataset)
    w = net.join("w")
    w.hold_jobs = True
    with structlog.testing.capture_logs() as events:
        net.run()
    shown = [e for e in events if e["event"] == "catching up"]
    # Not a terminal: a line per tenth of the replay; "caught up" says the end.
    assert [(e["done"], e["total"], e["percent"]) for e in shown] == [
        (n, 20, 5 * n) for n in range(2, 20, 2)
    ]
    assert shown[0]["work"] == "replay" and shown[0]["unit"] == "steps"
    assert [e["event"] for e in events].count("caught up") == 1
    assert w.replica.digest == digest_at(store.path, 20)


def test_late_join_loads_the_snapshot_then_the_log_tail(store: RunStore, dataset: Dataset) -> None:
    net = Network(store, dataset, snapshot_every=2)
    net.join("a")
    net.train(3)
    assert store.latest_snapshot == 2
    late = net.join("late")
    net.run()
    assert kinds(late.sent)[:4] == ["HELLO", "AUTH", "SNAPSHOT_REQUEST", "FITNESS_REQUEST"]
    assert late.sent[3].first_step == 2  # only the tail after the snapshot
    assert late.replica.step == 3 and late.replica.digest == digest_at(store.path, 3)


def test_a_corrupt_snapshot_is_replaced_by_the_fitness_log(
    store: RunStore, dataset: Dataset
) -> None:
    net = Network(store, dataset, snapshot_every=2)
    net.join("a")
    net.train(2)
    path = store.snapshot_path(2)
    blob = bytearray(path.read_bytes())
    blob[100] ^= 0xFF
    path.write_bytes(bytes(blob))
    late = net.join("late")
    net.run()
    requests = [m for m in late.sent if isinstance(m, messages.FitnessRequest)]
    assert requests[0].first_step == 0  # the whole log, from the initial state
    assert late.replica.step == 2 and late.replica.digest == digest_at(store.path, 2)


def test_the_coordinator_keeps_only_a_snapshot_that_agrees(
    store: RunStore, dataset: Dataset
) -> None:
    net = Network(store, dataset)
    w = net.join("w")
    net.train(1)
    core = net.core
    core.snapshot.step = 1
    out = core._ask_snapshot(core.peers[w.peer])
    assert out and isinstance(out[0].msg, messages.SnapshotRequest)
    good = encode_checkpoint(w.replica.backend.state)
    bad = bytearray(good)
    bad[-1] ^= 1  # CRC no longer matches
    for chunk in iter_snapshot_chunks(1, bytes(bad)):
        net.carry_out(core.receive(w.peer, chunk))
    assert store.latest_snapshot is None and core.snapshot.asked is None
    # Asked again, the worker's real state is kept.
    net.carry_out(core._ask_snapshot(core.peers[w.peer]))
    w.carry_out([ExportSnapshot(1)])
    assert store.latest_snapshot == 1 and core.snapshot.step is None


def test_a_worker_that_moved_on_sends_its_current_state(store: RunStore, dataset: Dataset) -> None:
    net = Network(store, dataset)
    w = net.join("w")
    net.train(1)
    net.core.snapshot.step = 1
    net.carry_out(net.core._ask_snapshot(net.core.peers[w.peer]))
    net.train(1)  # the worker moves on before it answers
    assert store.latest_snapshot in (1, 2)
    state = decode_checkpoint(store.snapshot_path(store.latest_snapshot).read_bytes())
    assert state.digest() == store.digests[state.step]


def test_unexpected_snapshot_chunks(store: RunStore, dataset: Dataset) -> None:
    net = Network(store, dataset)
    w = idle_worker(net)
    with pytest.raises(Refused) as refused:
        net.core.receive(w.peer, messages.SnapshotChunk(0, 10, 0, b"x"))  # nobody asked
    assert refused.value.code is ErrorCode.ILLEGAL_STATE
    assert w.session.receive(messages.SnapshotChunk(0, 10, 0, b"x")) == []  # ignored by the worker


# --- Validation and liveness ---------------------------------------------------------------


def test_validation_is_asked_of_one_worker_at_the_step(
    store: RunStore, dataset: Dataset, tmp_path: Path
) -> None:
    cfg = RunConfig(
        model=CFG.model, es=CFG.es, validation=ValidationConfig(every_steps=2, max_tokens=64)
    )
    run = RunStore.open(tmp_path / "validated", cfg)
    try:
        with structlog.testing.capture_logs() as events:
            net = Network(run, dataset)
            a, b = net.join("a"), net.join("b")
            net.train(2)
            net.run()
        asked = [w for w in (a, b) if any(isinstance(m, messages.Validate) for m in w.got)]
        assert len(asked) == 1
        (answer,) = [m for m in asked[0].sent if isinstance(m, messages.Validation)]
        assert answer.step == 2 and answer.tokens > 0
        # Both metrics, as the worker's backend computed them, over the same tokens.
        assert asked[0].replica.backend is not None
        want = asked[0].replica.backend.validate()
        assert want.streams is not None
        assert (answer.tokens, answer.text_bytes, answer.bits_per_token) == (
            want.windows.tokens,
            want.windows.text_bytes,
            want.windows.bits_per_token,
        )
        assert (answer.stream_tokens, answer.stream_text_bytes, answer.stream_loss_16) == (
            want.streams.tokens,
            want.streams.text_bytes,
            want.streams.loss_16,
        )
        assert answer.stream_bits_per_token == want.streams.bits_per_token
        assert answer.stream_tokens == answer.tokens  # the same tokens, read differently
        metrics = net.metrics
        assert metrics.valid_step._value.get() == 2
        assert metrics.valid_bits._value.get() == answer.bits_per_token
        # The byte vocabulary: bits per byte are bits per token.
        assert metrics.valid_bits_per_byte._value.get() == answer.bits_per_token
        assert metrics.valid_stream_bits._value.get() == answer.stream_bits_per_token
        assert metrics.valid_stream_bits_per_byte._value.get() == answer.stream_bits_per_token
        # eggroll-local prints the coordinator's event (shared/logs.py's contract).
        (shown,) = [e for e in events if e["event"] == VALIDATION and "worker" in e]
        assert set(EVENT_FIELDS[VALIDATION]) <= shown.keys() and shown["step"] == 2
        assert shown["stream_bits"] == round(answer.stream_bits_per_token, 4)
        assert shown["valid_bits_per_byte"] == round(answer.bits_per_token, 4)
        assert "long streams" in held_out_text(shown)
    finally:
        run.close()


def test_a_model_without_streams_reports_windows_only(
    dataset: Dataset, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def windows_only(backend: NumpyBackend) -> Score:
        return Score(HeldOut(64, 0, 80.0, 5.0), None)  # no state to carry, no bytes known

    monkeypatch.setattr(NumpyBackend, "validate", windows_only)
    cfg = CFG.replace(validation=ValidationConfig(every_steps=1, max_tokens=64))
    run = RunStore.open(tmp_path / "windows-only", cfg)
    try:
        with structlog.testing.capture_logs() as events:
            net = Network(run, dataset)
            w = net.join("w")
            net.train(1)
            net.run()
        (answer,) = [m for m in w.sent if isinstance(m, messages.Validation)]
        assert (answer.tokens, answer.stream_tokens, answer.stream_text_bytes) == (64, 0, 0)
        assert answer.bits_per_byte is None and answer.stream_bits_per_byte is None
        metrics = net.metrics
        assert metrics.valid_bits._value.get() == 5.0
        for gauge in (
            metrics.valid_bits_per_byte,
            metrics.valid_stream_bits,
            metrics.valid_stream_bits_per_byte,
        ):
            assert math.isnan(gauge._value.get())
        (shown,) = [e for e in events if e["event"] == VALIDATION and "worker" in e]
        assert shown["valid_bits"] == 5.0
        assert shown["stream_bits"] is shown["valid_bits_per_byte"] is None
        assert held_out_text(shown) == "5.000 bits/token"
    finally:
        run.close()


def test_validate_for_a_step_the_replica_has_left_gets_no_answer(
    store: RunStore, dataset: Dataset
) -> None:
    net = Network(store, dataset)
    net.join("first")
    net.train(1)
    w = idle_worker(net)
    assert w.replica.step == 1
    assert w.session.receive(messages.Validate(0)) == []
    assert w.session.receive(messages.Validate(1)) == [RunValidation(1)]


# --- Samples while training ---------------------------------------------------------------


def sample_texts(w: Worker) -> list[messages.SampleText]:
    return [m for m in w.sent if isinstance(m, messages.SampleText)]


def two_busy_workers(net: Network) -> list[Worker]:
    """Two workers in the run from step 0, each holding one of a step's two chunks."""
    busy = []
    for name in ("busy-1", "busy-2"):
        busy.append(net.join(name))
        net.run()
    return busy


def what_eggroll_sample_writes(store: RunStore, dataset: Dataset, step: int) -> tuple[str, str]:
    """The text `eggroll-sample SAVE_DIR --step S --seed S` writes, escaped to one line."""
    state = replay(
        ReplicaState.initial(CFG),
        [unpack_ternary(p, CFG.pairs) for p in store.fitness_log.read(0, step)],
    )
    prompt, text = TrainingSamples(0, dataset.valid, dataset.decoding).write(state)
    return escape(prompt, keep_newlines=False), escape(text, keep_newlines=False)


def test_the_sample_is_asked_of_a_waiting_worker_not_the_busy_ones(
    store: RunStore, dataset: Dataset
) -> None:
    with structlog.testing.capture_logs() as events:
        net = Network(store, dataset, sample_every=1)
        busy = two_busy_workers(net)
        net.train(1)  # step 1 wants a sample; its two chunks are held by the busy workers
        net.run()
        assert all(w.busy() for w in busy)
        assert not any(isinstance(m, messages.Sample) for w in busy for m in w.got)
        idle = net.join("idle")
        net.run()
    assert idle.session.phase is Phase.WAITING  # told to WAIT, and asked to write meanwhile
    (asked,) = [m for m in idle.got if isinstance(m, messages.Sample)]
    assert (asked.step, asked.seed, asked.prompt_index) == (1, 1, 0)
    assert (asked.prompt_tokens, asked.new_tokens) == (32, 64)
    assert (asked.temperature, asked.min_p, asked.presence_penalty) == (600, 80, 200)
    (answer,) = sample_texts(idle)
    assert (answer.step, answer.seed) == (1, 1) and answer.text
    prompt, text = what_eggroll_sample_writes(store, dataset, 1)
    assert net.latest(Sampled) == Sampled(1, "idle", prompt, text)
    (logged,) = [e for e in events if e["event"] == SAMPLE]
    assert set(EVENT_FIELDS[SAMPLE]) <= logged.keys() and logged["text"] == text
    assert net.metrics.sample._value["step"] == "1"


def test_the_only_worker_is_asked_after_its_chunk(store: RunStore, dataset: Dataset) -> None:
    net = Network(store, dataset, sample_every=2)
    w = net.join("only")
    net.train(2)
    net.run()
    assert w.busy() and not sample_texts(w)  # asked with its chunk of step 2, still on it
    assert kinds(w.got[-2:]) == ["JOB", "SAMPLE"]
    net.train(1)
    (answer,) = sample_texts(w)
    assert answer.step == 2
    first = w.sent.index(answer)
    assert any(
        isinstance(m, messages.Result) and m.step == 2 for m in w.sent[:first]
    )  # chunk first
    latest = net.latest(Sampled)
    assert latest is not None and latest.step == 2
    net.train(1)  # step 3: no sample due
    assert len(sample_texts(w)) == 1


def test_a_sample_asked_of_a_worker_that_leaves_is_asked_of_another(
    store: RunStore, dataset: Dataset
) -> None:
    net = Network(store, dataset, sample_every=1)
    w = net.join("only")
    net.train(1)
    net.run()
    assert net.core.sample.asked == (w.peer, 1)
    w.close("gone")
    other = net.join("other")
    net.train(1)
    assert [m.step for m in sample_texts(other)][:1] == [1]
    latest = net.latest(Sampled)
    assert latest is not None and latest.worker == "other"


def test_the_run_ends_after_the_final_steps_sample(store: RunStore, dataset: Dataset) -> None:
    net = Network(store, dataset, sample_every=2, max_steps=2)
    w = net.join("only")
    net.train(2)
    net.run()
    core = net.core
    latest = net.latest(Sampled)
    assert core.done and latest is not None and latest.step == 2
    core.sample.asked = (w.peer, 2)  # as if its answer were still on its way
    assert not core.done
    net.receive(w.peer, messages.SampleText(2, 2, b"prompt", b"text"))
    assert core.done


def test_only_the_asked_worker_for_the_asked_step_writes_the_sample(
    store: RunStore, dataset: Dataset
) -> None:
    net = Network(store, dataset, sample_every=1)
    busy = two_busy_workers(net)
    net.train(1)
    net.run()
    net.receive(busy[0].peer, messages.SampleText(1, 1, b"forged", b"text"))  # not asked
    assert net.latest(Sampled) is None
    idle = net.join("idle")
    net.run()
    assert net.latest(Sampled) is not None
    net.receive(idle.peer, messages.SampleText(1, 1, b"again", b"text"))  # answered already
    net.receive(idle.peer, messages.SampleText(0, 0, b"old", b"text"))
    latest = net.latest(Sampled)
    assert latest is not None and latest.prompt != "again"


def test_sample_text_is_logged_on_one_line_without_control_characters(
    store: RunStore, dataset: Dataset
) -> None:
    net = Network(store, dataset, sample_every=1)
    w = net.join("only")
    net.train(1)
    net.run()
    assert net.core.sample.asked == (w.peer, 1)
    net.receive(w.peer, messages.SampleText(1, 1, b"a\nb", b"\x1b]0;title\x07\x9b2J\xff\r\n"))
    latest = net.latest(Sampled)
    assert latest is not None and latest.prompt == f"a{NEWLINE_MARK}b"
    assert latest.text.isprintable() and NEWLINE_MARK in latest.text
    assert "\ufffd" in latest.text  # bytes that are not UTF-8


def test_a_sample_for_a_step_the_replica_has_left_gets_no_answer(
    store: RunStore, dataset: Dataset
) -> None:
    net = Network(store, dataset)
    net.join("first")
    net.train(1)
    w = idle_worker(net)
    assert w.replica.step == 1
    stale = messages.Sample(0, 0, 0, 32, 64, 600, 80, 0, 200, 0)
    current = messages.Sample(1, 1, 0, 32, 64, 600, 80, 0, 200, 0)
    assert w.session.receive(stale) == []
    assert w.session.receive(current) == [RunSample(current)]


def test_no_samples_unless_asked_for(store: RunStore, dataset: Dataset) -> None:
    net = Network(store, dataset)
    a, b = net.join("a"), net.join("b")
    net.train(3)
    net.run()
    assert not any(isinstance(m, messages.Sample) for w in (a, b) for m in w.got)


def test_heartbeats_change_nothing_and_shutdown_is_not_permanent(
    store: RunStore, dataset: Dataset
) -> None:
    net = Network(store, dataset)
    w = net.join("w")
    net.run()
    assert net.core.receive(w.peer, messages.Heartbeat(0)) == []
    assert w.session.receive(messages.Heartbeat(0)) == []  # in any phase, even while evaluating
    with pytest.raises(Ended, match="shutting down") as ended:
        w.session.receive(messages.Error(ErrorCode.SHUTTING_DOWN, "bye"))
    assert not ended.value.drop_replica


def idle_worker(net: Network) -> Worker:
    """A worker told to WAIT: the open step's two chunks are held by two others."""
    for name in ("busy-1", "busy-2", "idle"):
        w = net.join(name)
        net.run()
    assert w.session.phase is Phase.WAITING
    return w


WAIT_S = 1.0  # the core's WAIT, in seconds


def test_the_log_events_eggroll_local_reads_carry_their_fields(
    store: RunStore, dataset: Dataset
) -> None:
    with structlog.testing.capture_logs() as events:
        net = Network(store, dataset, snapshot_every=1, chunk_timeout_s=30.0)
        a = net.join("a")
        net.join("b")
        net.run()
        net.advance(31.0)  # chunks requeued
        net.train(1)  # a snapshot is stored
        a.close("gone")  # worker left
    steps = [e for e in events if e["event"] == STEP]
    assert steps and all(set(EVENT_FIELDS[STEP]) <= e.keys() for e in steps)
    assert set(SHOWN_EVENTS) <= {e["event"] for e in events}


# --- Trust: quorum digests, leases, data digest, snapshot and validation ties -------------


def test_a_digest_needs_two_reporters_and_a_lone_false_report_changes_nothing(
    store: RunStore, dataset: Dataset
) -> None:
    core = Network(store, dataset).core
    liar, one, two = (core.connect(f"mem:{n}") for n in ("liar", "one", "two"))
    for peer in (liar, one, two):
        core.peers[peer].ready = True
    truth = digest_at(store.path, 0)
    core.receive(liar, messages.JobRequest(0, truth ^ 0xDEAD, 0))  # first, and alone: not agreed
    assert 0 not in store.digests
    core.receive(one, messages.JobRequest(0, truth, 0))
    assert 0 not in store.digests  # one against one
    core.receive(two, messages.JobRequest(0, truth, 0))
    assert store.digests[0] == truth  # two reporters agree
    with pytest.raises(Refused) as lie:
        core.receive(liar, messages.JobRequest(0, truth ^ 0xDEAD, 0))
    assert lie.value.code is ErrorCode.DIVERGED  # the minority is the liar's divergence
    assert "dead" not in lie.value.message  # and the agreed digest is not revealed


@pytest.mark.parametrize("window", [trust_module.DIGEST_WINDOW, 4])
def test_a_lagging_workers_digest_is_agreed_within_the_window(
    store: RunStore, dataset: Dataset, monkeypatch: pytest.MonkeyPatch, window: int
) -> None:
    """A worker that reports step 3 when the run is at 12 (a CPU worker beside faster ones)
    agrees it with the report the fast worker made then; past the window the tally is gone,
    and the tallies kept span the window."""
    monkeypatch.setattr(trust_module, "DIGEST_WINDOW", window)
    net = Network(store, dataset)
    net.join("fast")
    net.train(12)
    core = net.core
    slow = core.connect("mem:slow")
    core.peers[slow].ready = True
    core.receive(slow, messages.JobRequest(3, digest_at(store.path, 3), 0))
    assert store.digests.get(3) == (digest_at(store.path, 3) if window > 9 else None)
    assert min(core.trust.tallies) == max(0, 12 - window)


def test_a_late_disagreement_is_reported_once_a_step(store: RunStore, dataset: Dataset) -> None:
    """A worker that lags reports steps older than one already found in dispute: each step's
    disagreement is reported once, in whatever order the steps come."""
    net = Network(store, dataset)
    net.join("fast")
    net.train(12)
    odd = net.core.connect("mem:odd")
    net.core.peers[odd].ready = True
    with structlog.testing.capture_logs() as events:
        for step in (10, 5, 5):
            net.receive(odd, messages.JobRequest(step, digest_at(store.path, step) ^ 1, 0))
    assert [e["step"] for e in events if e["event"] == "digests disagree"] == [10, 5]


def test_rival_digests_without_a_majority_are_reported_not_agreed(
    store: RunStore, dataset: Dataset
) -> None:
    net = Network(store, dataset)
    core = net.core
    one, two = core.connect("mem:one"), core.connect("mem:two")
    for peer in (one, two):
        core.peers[peer].ready = True
    with structlog.testing.capture_logs() as events:
        net.receive(one, messages.JobRequest(0, 111, 0))
        net.receive(two, messages.JobRequest(0, 222, 0))
    assert 0 not in store.digests
    assert [e["event"] for e in events if e["log_level"] == "warning"] == ["digests disagree"]
    assert net.metrics.digest_mismatches._value.get() == 1


def test_the_sole_worker_is_agreed_by_the_snapshot_it_uploads(
    store: RunStore, dataset: Dataset
) -> None:
    net = Network(store, dataset, snapshot_every=2)
    w = net.join("w")
    net.train(3)
    assert store.latest_snapshot == 2 and store.digests[2] == digest_at(store.path, 2)
    assert 3 not in store.digests  # reported by one worker, no snapshot: not agreed
    assert w.replica.digest == digest_at(store.path, 3)


class Liar:
    """A replica whose fitness is made up (every value changed) while `lying`: a fault or a
    lie."""

    def __init__(self, replica: Any) -> None:
        self.replica = replica
        self.lying = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.replica, name)

    async def evaluate(
        self, step: int, chunks: list[tuple[int, int]], claims: Any = ()
    ) -> list[ChunkResult]:
        results = await self.replica.evaluate(step, chunks)
        if not self.lying:
            return results
        return [ChunkResult(np.where(r.fitness == 1, -1, 1), r.loss_sum) for r in results]


def checks(net: Network) -> dict[str, float]:
    return {k: net.metrics.chunk_checks.labels(k)._value.get() for k in CHECK_RESULTS}


def fitness_log(store: RunStore) -> list[bytes]:
    return store.fitness_log.read(0, store.steps)


def plain_run(tmp_path: Path, dataset: Dataset, steps: int) -> list[bytes]:
    """The same run's fitness log, one worker and no checks."""
    other = RunStore.open(tmp_path / "plain", CFG.replace(es=ESConfig(32, 8, 8)))
    try:
        net = Network(other, dataset)
        net.join("alone")
        net.train(steps)
        return fitness_log(other)
    finally:
        other.close()


def test_every_chunk_checked_by_a_worker_elsewhere_trains_the_same_run(
    store4: RunStore, dataset: Dataset, tmp_path: Path
) -> None:
    net = Network(store4, dataset, verify_fraction=1.0)
    a, b = net.join("a", host="10.0.0.1"), net.join("b", host="10.0.0.2")
    net.run()
    net.train(3)
    assert checks(net) == {"agreed": 4 * 3, "disputed": 0, "waived": 0}
    assert fitness_log(store4) == plain_run(tmp_path, dataset, 3)
    assert a.replica.digest == b.replica.digest == store4.digests[3]


def test_the_only_worker_has_its_checks_waived(store4: RunStore, dataset: Dataset) -> None:
    net = Network(store4, dataset, verify_fraction=1.0)
    net.join("alone")
    net.train(2)
    assert checks(net) == {"agreed": 0, "disputed": 0, "waived": 4 * 2}


def test_a_slow_checker_is_waited_for_and_one_that_leaves_is_not(
    store4: RunStore, dataset: Dataset
) -> None:
    """Every chunk checked, two machines: b sits on its chunks past their deadline. a
    scores them, but the checks only b could make wait for it (a slow worker says nothing
    of whether another lies); once b leaves, they are waived and the step commits."""
    net = Network(store4, dataset, verify_fraction=1.0, chunk_timeout_s=30.0)
    net.join("a", host="10.0.0.1")
    slow = net.join("b", host="10.0.0.2")
    slow.hold_jobs = True
    net.run()  # both through the handshake, each holding chunks of step 0
    net.stop_at = 100  # a's run from now on
    net.advance(31.0)
    net.advance(31.0)
    assert store4.steps == 0 and net.core.jobs.checks
    net.disconnect(slow)
    net.run()
    assert store4.steps >= 1 and checks(net)["waived"] >= 4


def test_a_checker_stalled_past_the_stall_time_holds_up_no_check(
    store4: RunStore, dataset: Dataset, tmp_path: Path
) -> None:
    """Every chunk checked, two machines: b's GPU hangs on its chunks while its process
    stays connected. a scores everything; its checks wait for b, but not past STALL_S:
    then they are waived, b is reported stalled once, and the run goes on. When b's
    result comes at last it counts again, and checks its share."""
    net = Network(store4, dataset, verify_fraction=1.0, chunk_timeout_s=30.0)
    net.join("a", host="10.0.0.1")
    hung = net.join("b", host="10.0.0.2")
    hung.hold_jobs = True
    net.run()
    net.stop_at = 1  # a's run: step 0
    net.advance(STALL_S - 1.0)
    assert store4.steps == 0 and net.core.jobs.checks and not net.latest(Stalled)
    net.advance(1.0)
    assert store4.steps == 1 and checks(net)["waived"] == 4
    net.train(2)  # b stays hung: its checks are not waited for again
    assert store4.steps == 3 and checks(net)["waived"] == 4 * 3
    assert [e.worker for e in net.events if isinstance(e, Stalled)] == ["b"]
    assert net.metrics.workers_stalled._value.get() == 1
    hung.finish_held()  # its chunk of step 0, long settled: it syncs and works again
    net.run()
    net.train(2)
    assert checks(net)["agreed"] >= 4 * 2 and hung.alive
    assert fitness_log(store4) == plain_run(tmp_path, dataset, store4.steps)


def test_a_waiver_comes_at_the_wake_up_the_stall_time_asks_for(
    store4: RunStore, dataset: Dataset
) -> None:
    """Woken only by its deadlines, as the server's watcher does, the core waives a hung
    checker's checks at the very time it stalls ((w + 300) - w is not always 300)."""
    net = Network(store4, dataset, verify_fraction=1.0, chunk_timeout_s=30.0)
    net.clock.now = 1000.1
    net.join("a", host="10.0.0.1")
    hung = net.join("b", host="10.0.0.2")
    hung.hold_jobs = True
    net.run()
    net.stop_at = 1
    net.advance(1.0)
    stalls = net.core.peers[hung.peer].worked + STALL_S
    while store4.steps == 0 and (wake := net.core.next_deadline()) is not None:
        net.clock.now = wake
        net.carry_out(net.core.expire())
    assert store4.steps == 1 and net.clock.now == stalls


def test_one_hung_gpu_of_a_machine_does_not_halt_its_run(
    store4: RunStore, dataset: Dataset
) -> None:
    """One machine, two GPU workers (each its own vote): one hangs while it heartbeats.
    The other's checks wait for it STALL_S, then are waived."""
    net = Network(store4, dataset, verify_fraction=1.0)
    net.join("gpu0")
    hung = net.join("gpu1")
    hung.hold_jobs = True
    net.run()
    net.stop_at = 1
    net.advance(STALL_S / 2)
    assert store4.steps == 0
    net.advance(STALL_S / 2)
    assert store4.steps == 1 and checks(net)["waived"] == 4


def test_a_worker_that_asks_for_work_is_not_stalled_however_long_it_waited(
    store4: RunStore, dataset: Dataset, tmp_path: Path
) -> None:
    """b waits 300 s and more for a job (asking again now and then) while the other
    machine sits on a chunk. At the commit, b has yet to apply the step and ask again when
    the other, quicker, lies on the next step's chunks, all drawn for checks: b is not
    stalled, so they wait for its check."""
    net = Network(store4, dataset, chunk_timeout_s=1000.0)
    replica = Liar(sync_replica(dataset, threads=4))  # 4 chunks a request
    replica.lying = False
    liar = net.join("liar", host="10.0.0.9", replica=replica)
    liar.hold_jobs = True
    net.run()  # the liar leases every chunk of step 0, and sits on them
    b = net.join("b", host="10.0.0.2")
    net.run()
    assert net.core.peers[b.peer].waiting  # nothing to lease, no backups (nothing timed)
    for _ in range(31):
        net.advance(10.0)  # b asks again now and then
    net.core.options = dataclasses.replace(net.core.options, verify_fraction=1.0)
    net.stop_at = 100
    liar.finish_held()  # step 0, honest: committed (nothing drawn for a check then)
    replica.lying = True
    while liar.handle_one():  # the liar applies step 0 and lies on step 1 before b moves
        pass
    assert store4.steps == 1 and checks(net)["waived"] == 0 and not net.latest(Stalled)
    net.join("c", host="10.0.0.3")
    net.train(1)
    assert net.core.trust.suspect_hosts == {"10.0.0.9"}
    assert fitness_log(store4) == plain_run(tmp_path, dataset, store4.steps)


def test_a_worker_that_dropped_a_chunk_but_works_on_is_not_stalled(
    store4: RunStore, dataset: Dataset
) -> None:
    """b never answers a chunk (its reward failed on it, say) but goes on asking for work:
    its lease is overdue, yet it is not stalled, so the checks only it can make wait."""
    net = Network(store4, dataset, verify_fraction=1.0, chunk_timeout_s=30.0)
    net.join("a", host="10.0.0.1")
    b = net.join("b", host="10.0.0.2")
    b.hold_jobs = True  # the chunk it leases is never answered
    net.run()  # both through the handshake, each holding chunks of step 0
    net.stop_at = 100  # a's run from now on
    asking = messages.JobRequest(0, b.replica.digest, 0)
    for _ in range(12):
        net.advance(30.0)
        net.receive(b.peer, asking)  # still working: it asks for more
    assert b.peer in net.core.jobs.overdue()
    assert not net.latest(Stalled) and checks(net)["waived"] == 0 and store4.steps == 0


def test_a_liars_fast_results_do_not_make_an_honest_checker_stalled(
    store4: RunStore, dataset: Dataset, tmp_path: Path
) -> None:
    """A liar answers at once, so a worker not yet timed gets leases with the shortest
    deadline: the honest checker's leases expire within seconds, while it still scores.
    A worker is never stalled sooner than STALL_S: the lies wait for its checks, which
    dispute them, and a third machine outvotes the liar."""
    net = Network(store4, dataset, verify_fraction=1.0)
    net.stop_at = 1
    first = net.join("a", host="10.0.0.1")
    first.hold_jobs = True
    net.run()  # a holds a chunk: the liar's results wait for a check
    net.join("liar", host="10.0.0.9", replica=Liar(sync_replica(dataset)))
    net.run()
    honest = net.join("b", host="10.0.0.2")
    honest.hold_jobs = True
    net.run()  # b leases a check of a lie, with the deadline the liar's times make
    net.disconnect(first)
    net.run()
    assert honest.held and net.core.jobs.timer.timeout_s() == net.core.jobs.timer.floor_s
    for _ in range(6):
        net.advance(10.0)  # its leases expire; it is still scoring
    assert store4.steps == 0 and checks(net)["waived"] == 0
    honest.finish_held()
    net.run()
    assert checks(net)["disputed"] >= 1
    net.join("c", host="10.0.0.3")
    net.train(2)
    assert fitness_log(store4) == plain_run(tmp_path, dataset, store4.steps)
    assert net.core.trust.suspect_hosts == {"10.0.0.9"}


def test_a_lying_worker_is_outvoted_and_cannot_steer_the_run(
    store4: RunStore, dataset: Dataset, tmp_path: Path
) -> None:
    """Every chunk checked: the liar's results lose to two honest workers' (at other
    addresses), it is refused (DIVERGED) at its next message, and the run is the one
    honest workers make alone."""
    net = Network(store4, dataset, verify_fraction=1.0)
    liar = net.join("liar", host="10.0.0.9", replica=Liar(sync_replica(dataset)))
    net.join("a", host="10.0.0.1")
    net.join("b", host="10.0.0.2")
    net.run()
    net.train(3)
    net.advance(1.0)  # it asks again (or heartbeats): the answer is DIVERGED
    assert ("liar", ErrorCode.DIVERGED) in net.refused and not liar.alive
    assert net.metrics.workers_outvoted._value.get() == 1
    assert checks(net)["disputed"] >= 1
    assert fitness_log(store4) == plain_run(tmp_path, dataset, 3)
    outvoted = net.latest(Outvoted)
    assert outvoted is not None and outvoted.worker == "liar" and outvoted.step == 0
    assert net.core.trust.suspect_hosts == {"10.0.0.9"}
    # Kept in run.json: a restarted coordinator checks every result from there too.
    assert json.loads((store4.path / "run.json").read_text())["suspect_hosts"] == ["10.0.0.9"]
    assert RunCore(store4).trust.suspect_hosts == {"10.0.0.9"}


def test_a_dispute_no_connected_machine_can_decide_is_reported_until_one_joins(
    store4: RunStore, dataset: Dataset, tmp_path: Path
) -> None:
    """Two machines, one of them lying: their results differ and neither can outvote the
    other. Each such chunk is reported once, and counted on a gauge; the core names it
    for the shell to stop the run, and a third machine that joins decides."""
    net = Network(store4, dataset, verify_fraction=1.0)
    net.join("liar", host="10.0.0.9", replica=Liar(sync_replica(dataset)))
    net.join("a", host="10.0.0.1")
    net.run()
    net.stop_at = 1
    for _ in range(3):
        net.advance(10.0)
    undecided = [e for e in net.events if isinstance(e, Undecided)]
    assert store4.steps == 0 and undecided
    assert len({e.chunk for e in undecided}) == len(undecided)  # once a chunk
    assert all(e.hosts == ("10.0.0.1", "10.0.0.9") and e.step == 0 for e in undecided)
    assert net.core.status().undecided == len(undecided)
    assert net.core.halted is not None and net.core.halted.chunk == undecided[0].chunk
    net.join("b", host="10.0.0.2")
    net.train(2)
    assert net.core.status().undecided == 0
    assert fitness_log(store4) == plain_run(tmp_path, dataset, store4.steps)


def test_a_machine_cannot_confirm_its_own_result_by_coming_back(
    store4: RunStore, dataset: Dataset, tmp_path: Path
) -> None:
    """A liar's results wait for checks; it leaves and comes back from the same address
    under another name: it gets none of those checks (its address has voted), the honest
    workers outvote it, and its address is checked from then on."""
    net = Network(store4, dataset, verify_fraction=1.0)
    a, b = net.join("a", host="10.0.0.1"), net.join("b", host="10.0.0.2")
    a.hold_jobs = b.hold_jobs = True
    liar = net.join("liar", host="10.0.0.9", replica=Liar(sync_replica(dataset)))
    net.stop_at = 100
    net.run()
    voted = {c for c, votes in net.core.jobs.votes.items() if votes}
    assert voted and store4.steps == 0
    net.disconnect(liar)
    again = net.join("again", host="10.0.0.9", replica=Liar(sync_replica(dataset)))
    net.run()
    leased = {e.chunk for e in net.events if isinstance(e, Leased) and e.worker == "again"}
    assert not leased & voted
    a.finish_held()
    b.finish_held()
    net.train(2)
    assert net.core.trust.suspect_hosts == {"10.0.0.9"}
    assert fitness_log(store4) == plain_run(tmp_path, dataset, store4.steps)
    assert again.alive or ("again", ErrorCode.DIVERGED) in net.refused


def test_a_machine_that_came_first_still_votes_once(
    store4: RunStore, dataset: Dataset, tmp_path: Path
) -> None:
    """Two connections of one machine lease chunks before anyone else has joined (when
    each connection still votes alone), then answer with made-up fitness once workers on
    two other machines are there: votes are counted when counted, so the two are one
    machine's vote, and the honest workers outvote it."""
    net = Network(store4, dataset, verify_fraction=1.0)
    liars = [net.join(n, host="10.0.0.9", replica=Liar(sync_replica(dataset))) for n in "hk"]
    for liar in liars:
        liar.hold_jobs = True
    net.run()
    assert all(liar.held for liar in liars)
    net.join("a", host="10.0.0.1")
    net.join("b", host="10.0.0.2")
    net.run()
    net.stop_at = 100
    for liar in liars:
        liar.finish_held()
    net.train(2)
    assert fitness_log(store4) == plain_run(tmp_path, dataset, store4.steps)
    assert net.core.trust.suspect_hosts == {"10.0.0.9"}


def test_an_outvoted_machines_other_connections_lose_their_votes_too(
    store4: RunStore, dataset: Dataset, tmp_path: Path
) -> None:
    """Two connections of one machine make up their fitness; only one of its chunks is
    drawn for a check, so the other's lie settles alone. The checked one is outvoted, and
    with it every vote its machine cast in the step: the step is the honest one."""
    net = Network(store4, dataset)
    h, k = (net.join(n, host="10.0.0.9", replica=Liar(sync_replica(dataset))) for n in "hk")
    a, b = net.join("a", host="10.0.0.1"), net.join("b", host="10.0.0.2")
    for w in (h, k, a, b):
        w.hold_jobs = True
    net.run()  # one chunk each
    idle = net.join("idle", host="10.0.0.9")  # the machine's third connection: no chunk
    (checked,) = (e.chunk for e in net.events if isinstance(e, Leased) and e.worker == "h")
    net.core.jobs.verify = {checked}
    net.stop_at = 100
    for w in (k, h, a, b):  # k's lie settles its chunk alone; h's waits for a check
        w.finish_held()
        net.run()
    net.train(1)
    assert fitness_log(store4) == plain_run(tmp_path, dataset, store4.steps)
    assert {e.worker for e in net.events if isinstance(e, Outvoted)} == {"h", "k", "idle"}
    net.advance(1.0)
    assert not idle.alive
    # The loser is told its fitness lost; the others that their machine's did (they count
    # no divergence of their own toward giving up).
    assert h.ended is not None and "lost a vote" in h.ended
    assert all(w.ended is not None and ADDRESS_OUTVOTED in w.ended for w in (k, idle))


@pytest.mark.parametrize("by_certificate", [True, False])
def test_machines_behind_one_nat_are_apart_by_their_certificates(
    store4: RunStore, dataset: Dataset, tmp_path: Path, by_certificate: bool
) -> None:
    """A liar and an honest machine behind one NAT (one address), another honest machine
    elsewhere. Told apart by their certificates, the liar is outvoted alone and only its
    identity becomes suspect; by address, the NAT is one machine whose results differ from
    the other's, and the run waits for a third."""
    net = Network(store4, dataset, verify_fraction=1.0)
    ids = {n: f"cn:{n}" if by_certificate else "" for n in ("liar", "a", "c")}
    liar = net.join(
        "liar", host="10.0.0.9", machine=ids["liar"], replica=Liar(sync_replica(dataset))
    )
    a = net.join("a", host="10.0.0.9", machine=ids["a"])
    net.join("c", host="10.0.0.3", machine=ids["c"])
    net.run()
    if not by_certificate:
        net.stop_at = 1
        for _ in range(3):
            net.advance(10.0)
        assert store4.steps == 0 and any(isinstance(e, Undecided) for e in net.events)
        return
    net.train(3)
    net.advance(1.0)
    assert not liar.alive and a.alive
    assert fitness_log(store4) == plain_run(tmp_path, dataset, store4.steps)
    assert net.core.trust.suspect_hosts == {"cn:liar"}
    assert {e.worker for e in net.events if isinstance(e, Outvoted)} == {"liar"}
    joined = {e.worker: e.machine for e in net.events if isinstance(e, Joined)}
    assert joined == {"liar": "cn:liar", "a": "cn:a", "c": "cn:c"}


def test_one_certificate_from_two_addresses_is_said_once(
    store4: RunStore, dataset: Dataset
) -> None:
    net = Network(store4, dataset)
    net.join("a1", host="10.0.0.1", machine="cn:a")
    net.join("a2", host="10.0.0.1", machine="cn:a")  # one machine, two connections: fine
    net.join("b", host="10.0.0.2", machine="cn:b")
    net.run()
    assert not [e for e in net.events if isinstance(e, SharedIdentity)]
    net.join("a3", host="10.0.0.7", machine="cn:a")
    net.join("a4", host="10.0.0.8", machine="cn:a")
    net.run()
    shared = [e for e in net.events if isinstance(e, SharedIdentity)]
    assert shared == [SharedIdentity("cn:a", ("10.0.0.1", "10.0.0.7"))]


def test_a_machine_left_alone_agrees_its_digests_again(store: RunStore, dataset: Dataset) -> None:
    """A worker on a second machine joins and leaves: the first machine's two connections
    count apart again, so their digests are agreed and snapshots go on."""
    net = Network(store, dataset)
    net.join("a1", host="10.0.0.1")
    net.join("a2", host="10.0.0.1")
    visitor = net.join("cpu", host="10.0.0.2")
    net.train(1)
    net.disconnect(visitor)
    net.train(2)
    assert store.steps in store.digests


@pytest.mark.parametrize(
    ("suspect", "machine"),
    [
        ("10.0.0.9", ""),
        ("cn:s", "cn:s"),
        ("10.0.0.9", "cn:s"),  # caught while addresses stood for machines
    ],
)
def test_every_result_from_an_outvoted_address_is_checked(
    store4: RunStore, dataset: Dataset, tmp_path: Path, suspect: str, machine: str
) -> None:
    """No chunk drawn for a check, but where a worker was outvoted, another worker's equal
    result must confirm every result from its machine (its address, or its certificate;
    an address recorded before certificates stood for machines still counts): none
    settles a chunk alone."""
    net = Network(store4, dataset)
    net.core.trust.suspect_hosts.add(suspect)
    net.join("suspect", host="10.0.0.9", machine=machine)
    net.join("a", host="10.0.0.1", machine=machine and "cn:a")
    net.run()
    net.train(2)
    settled_by = {e.worker for e in net.events if isinstance(e, ChunkAccepted)}
    assert settled_by == {"a"} and checks(net)["agreed"] >= 1
    assert fitness_log(store4) == plain_run(tmp_path, dataset, 2)


def test_results_only_for_a_lease_and_with_a_possible_loss(
    store: RunStore, dataset: Dataset
) -> None:
    net = Network(store, dataset)
    a = net.join("a")
    a.hold_jobs = True
    net.run()
    (job,) = a.held
    core = net.core
    other = 1 - job.chunk

    def result(chunk: int, loss_sum: int) -> messages.Result:
        return messages.Result.from_values(
            step=0, chunk=chunk, loss_sum=loss_sum, weights_changed=0,
            replica_digest=digest_at(store.path, 0),
            fitness=np.ones(CFG.es.chunk_size // 2, np.int8),
        )  # fmt: skip

    with pytest.raises(Refused, match="not leased") as unleased:
        core.receive(a.peer, result(other, 0))
    assert unleased.value.code is ErrorCode.ILLEGAL_STATE
    with pytest.raises(Refused, match="impossible") as impossible:
        core.receive(a.peer, result(job.chunk, core.loss_range[1] + 1))
    assert impossible.value.code is ErrorCode.MALFORMED
    assert store.steps == 0 and not core.jobs.results


def test_the_data_digest_is_the_operators_or_two_workers_agree(
    store: RunStore, dataset: Dataset
) -> None:
    net = Network(store, dataset)
    net.join("odd", data_digest=b"\x42" * 32)
    net.join("a")
    net.run()
    assert store.data_digest is None  # one vote each: nothing settled, nobody bricked
    late = net.join("b")
    net.run()
    assert store.data_digest == dataset.digest and late.fatal is None
    wrong = net.join("wrong", data_digest=b"\x42" * 32)
    net.run()
    assert wrong.fatal is not None and wrong.fatal.code is ErrorCode.DATA_MISMATCH
    assert "4242424242424242" in str(wrong.fatal)


def test_one_machines_connections_settle_no_digest_once_there_are_two(
    store: RunStore, dataset: Dataset
) -> None:
    """Digests count a vote per address once workers at two have joined: two connections
    of one machine with made-up data settle nothing; two machines agreeing do."""
    net = Network(store, dataset)
    net.join("far", host="10.0.0.2")
    for name in ("x", "y"):
        net.join(name, host="10.0.0.1", data_digest=b"\x42" * 32)
    net.run()
    assert store.data_digest is None
    net.join("near", host="10.0.0.3")
    net.run()
    assert store.data_digest == dataset.digest


def test_a_snapshot_must_be_the_requested_step_and_size(store: RunStore, dataset: Dataset) -> None:
    net = Network(store, dataset)
    w = net.join("w")
    net.train(1)
    core = net.core
    core.snapshot.step = 1
    (ask,) = core._ask_snapshot(core.peers[w.peer])
    assert ask.msg == messages.SnapshotRequest(1)
    with pytest.raises(Refused, match="step 1 was asked for"):
        core.receive(w.peer, messages.SnapshotChunk(1, 2**40, 0, b"x" * 64))
    core.snapshot = Want(step=1)  # the transfer given up: ask again
    core._ask_snapshot(core.peers[w.peer])
    with pytest.raises(Refused, match="step 1 was asked for"):
        core.receive(w.peer, messages.SnapshotChunk(0, core.checkpoint_size, 0, b"x" * 64))


def test_only_the_worker_asked_sets_the_held_out_score(store: RunStore, dataset: Dataset) -> None:
    net = Network(store, dataset)
    w = net.join("w")
    net.train(1)
    net.receive(w.peer, messages.Validation(1, 100, 30.0, 1.5))  # nobody asked
    assert net.metrics.valid_step._value.get() != 1


def test_a_long_step_logs_its_progress_every_ten_seconds(store: RunStore, dataset: Dataset) -> None:
    net = Network(store, dataset, chunk_timeout_s=600.0)
    for name in ("a", "b"):
        net.join(name)
    net.run()  # each holds one chunk of step 0: the step stays open
    assert net.core.next_deadline() == pytest.approx(net.clock.now + 10.0)
    with structlog.testing.capture_logs() as events:
        net.advance(5.0)
        net.advance(5.0)
        net.advance(9.0)
        net.advance(1.0)
    shown = [e for e in events if e["event"] == PROGRESS]
    assert [(e["step"], e["chunks_done"], e["chunks"], e["seconds"]) for e in shown] == [
        (1, 0, 2, 10),
        (1, 0, 2, 20),
    ]
    assert set(EVENT_FIELDS[PROGRESS]) <= shown[0].keys()


def test_a_long_snapshot_download_logs_its_progress(store: RunStore, dataset: Dataset) -> None:
    net = Network(store, dataset, snapshot_every=2)
    net.join("a")
    net.train(2)
    late = net.join("late")
    net.run()  # it joins (and loads the snapshot at network speed)
    blob = store.snapshot_path(2).read_bytes()
    session = late.session  # now a slow download of the same snapshot, chunk by chunk:
    session._download = session_module._Download(net.clock.now)  # as after SNAPSHOT_REQUEST
    session.phase = Phase.LOADING_SNAPSHOT
    with structlog.testing.capture_logs() as events:
        for chunk in iter_snapshot_chunks(2, blob, chunk_bytes=len(blob) // 4 + 1):
            net.clock.now += 6.0
            session.receive(chunk)
    shown = [e for e in events if e["event"] == "downloading snapshot"]
    quarter = len(blob) // 4 + 1
    # A line at each tenth (here each quarter) of a transfer that takes a while, not in its
    # first seconds; the last chunk ends it.
    assert [e["done"] for e in shown] == [2 * quarter, 3 * quarter]
    assert shown[0]["total"] == len(blob) and shown[0]["percent"] == 200 * quarter // len(blob)


def test_digest_and_data_votes_stay_bounded_by_the_workers_connected(
    store: RunStore, dataset: Dataset
) -> None:
    net = Network(store, dataset)
    odd = net.join("odd", data_digest=b"\x42" * 32)
    net.run()
    core = net.core
    assert core.trust.data_votes == {b"\x42" * 32: {odd.peer}}
    for digest in range(1000):  # a report per request, each different
        core.receive(odd.peer, messages.JobRequest(0, digest, 0))
    assert core.trust.tallies == {0: {999: {odd.peer}}}  # one report per worker and step
    odd.close("gone")
    assert core.trust.tallies == {0: {}} and core.trust.data_votes == {}
