"""Rewinds (protocol/SPEC.md §8): a convicted machine's unconfirmed results are undone.

The pure rule (coordinator/rewind.py), the save directory's cut (coordinator/store.py), and
the run core with in-memory workers: a liar whose lies were committed unchecked is caught
later, and the run ends with the fitness log an honest run makes."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import UNIT_CFG, Network, sync_replica, words_data_dir
from prometheus_client import CollectorRegistry

from eggroll_dist.coordinator import store as store_module
from eggroll_dist.coordinator.curve import read_curve
from eggroll_dist.coordinator.events import RewindOutside, Rewound
from eggroll_dist.coordinator.metrics import Metrics
from eggroll_dist.coordinator.record import record
from eggroll_dist.coordinator.rewind import Provenance, Source, plan
from eggroll_dist.coordinator.store import REWOUND, RunStore
from eggroll_dist.shared.config import ESConfig, ValidationConfig
from eggroll_dist.shared.data import Dataset, load_data_dir
from eggroll_dist.shared.fitness_log import FitnessLog
from eggroll_dist.shared.logs import STEP, VALIDATION
from eggroll_dist.shared.save_dir import Layout
from eggroll_dist.worker.backend import ChunkResult

CFG = UNIT_CFG.replace(
    validation=ValidationConfig(every_steps=0, max_tokens=64), es=ESConfig(32, 8, 8)
)
LIAR = ("10.0.0.9", 7)
HONEST = ("10.0.0.1", 3)


def test_provenance_finds_the_first_step_holding_an_unconfirmed_result() -> None:
    p = Provenance(horizon=4)
    p.record(0, {0: Source((LIAR,), False), 1: Source((HONEST,), False)})
    p.record(1, {0: Source((LIAR, HONEST), True), 1: Source((HONEST,), False)})
    p.record(2, {0: Source((HONEST,), False), 1: Source((LIAR,), False)})
    rewind, outside = plan(p, [("10.0.0.9",)], 3, "why")
    assert (rewind.to, rewind.end, rewind.chunks) == (0, 3, 2) and not outside
    # A run on one machine convicts a connection: only its own results are suspect.
    assert plan(p, [("10.0.0.9", "8")], 3, "why") == (None, [])
    assert plan(p, [("10.0.0.9", "7")], 3, "why")[0].to == 0
    # Results another group confirmed are final.
    assert p.suspects(("10.0.0.1",)) == [(0, 1), (1, 1), (2, 0)]


def test_results_past_the_horizon_stay_and_are_said() -> None:
    p = Provenance(horizon=2)
    for step in range(5):
        liar_chunk = Source((LIAR,), step == 4)  # its last result was confirmed
        p.record(step, {0: liar_chunk, 1: Source((HONEST,), True)})
    rewind, outside = plan(p, [("10.0.0.9",)], 5, "why")
    assert rewind is not None and rewind.to == 3 and rewind.chunks == 1
    assert [(o.first, o.last, o.chunks) for o in outside] == [(0, 2, 3)]
    p.forget_from(3)
    assert plan(p, [("10.0.0.9",)], 3, "why")[0] is None
    assert plan(Provenance(0), [("10.0.0.9",)], 3, "why") == (None, [])


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Dataset:
    return load_data_dir(words_data_dir(tmp_path_factory.mktemp("data"), docs=20, words=200))


@pytest.fixture
def store(tmp_path: Path) -> Iterator[RunStore]:
    s = RunStore.open(tmp_path / "run", CFG)
    yield s
    s.close()


def _fill(store: RunStore, steps: int) -> list[bytes]:
    size = -(-CFG.pairs // 5)
    records = [bytes([s % 243]) * size for s in range(steps)]
    for step, packed in enumerate(records):
        store.fitness_log.append(step, packed)
        store.record_digest(step + 1, 0x1000 + step)
    return records


def test_the_store_cuts_the_log_and_keeps_the_tail(store: RunStore, tmp_path: Path) -> None:
    records = _fill(store, 6)
    for step in (2, 5):
        store.save_snapshot(step, b"x")
    kept = store.rewind(3, chunks=2, why="liar lost a vote")
    assert store.steps == 3 and store.fitness_log.read(0, 3) == records[:3]
    assert kept == tmp_path / "run" / REWOUND / "fitness-3-5.log"
    tail = kept.read_bytes()
    assert len(tail) == 52 + 3 * store.fitness_log.record_size  # header + steps 3..5
    assert max(store.digests) == 3 and store.snapshot_steps == [2]
    assert (tmp_path / "run" / REWOUND / "step-5.ckpt").exists()
    assert store.rewinds[-1]["from"] == 3 and store.rewinds[-1]["to"] == 6
    store.close()
    again = RunStore.open(tmp_path / "run", None)  # it all reached the disk
    try:
        assert again.steps == 3 and max(again.digests) == 3 and "rewind_pending" not in again._run
    finally:
        again.close()


def test_a_rewind_a_crash_cut_short_is_finished_at_open(store: RunStore, tmp_path: Path) -> None:
    records = _fill(store, 5)
    store._cut = lambda to: None  # type: ignore[method-assign]  # the crash: run.json says
    store.rewind(2, chunks=1, why="liar")  # the rewind began, nothing was cut
    store.close()
    assert FitnessLog.open(tmp_path / "run" / "fitness.log").steps == 5
    again = RunStore.open(tmp_path / "run", None)
    try:
        assert again.steps == 2 and again.fitness_log.read(0, 2) == records[:2]
        assert max(again.digests) == 2 and "rewind_pending" not in again._run
    finally:
        again.close()


class Liar:
    """A replica whose fitness is made up (every value changed) while `lying`."""

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


def _honest_log(tmp_path: Path, dataset: Dataset, steps: int) -> list[bytes]:
    other = RunStore.open(tmp_path / "plain", CFG)
    try:
        net = Network(other, dataset)
        net.join("alone")
        net.train(steps)
        return other.fitness_log.read(0, other.steps)
    finally:
        other.close()


def test_a_liar_caught_late_leaves_no_lie_in_the_log(
    store: RunStore, dataset: Dataset, tmp_path: Path
) -> None:
    """The liar's lies of steps 0 and 1 are committed unchecked; caught at step 2 (every
    chunk checked from then on), the run goes back to step 0 and ends as an honest run."""
    net = Network(store, dataset, verify_fraction=0.0, rewind_steps=8)
    liar = net.join("liar", host="10.0.0.9", replica=Liar(sync_replica(dataset, threads=4)))
    net.run()
    net.train(2)  # alone: its lies are committed
    assert store.steps == 2
    net.join("b", host="10.0.0.2")
    net.join("c", host="10.0.0.3")
    net.run()  # b and c catch up while the liar sits on step 2's chunks
    net.core.options = net.core.options.__class__(
        **{**net.core.options.__dict__, "verify_fraction": 1.0}
    )
    net.core.jobs.verify.update(range(CFG.chunks))  # the open step's chunks too
    net.stop_at = 4
    net.run()  # the liar's results of step 2 go in, and lose to b's and c's
    rewound = net.latest(Rewound)
    assert rewound is not None and (rewound.first, rewound.end) == (0, 2)
    assert rewound.chunks == 2 * CFG.chunks and not net.latest(RewindOutside)
    assert liar.ended is not None and store.steps == 4
    assert store.fitness_log.read(0, store.steps) == _honest_log(tmp_path, dataset, store.steps)


def test_a_rewind_whose_last_run_json_write_fails_stops_rather_than_cut_again(
    store: RunStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # run.json still saying a rewind is under way would make the next open cut the steps
    # committed after it: the write that clears it must not degrade to memory.
    records = _fill(store, 5)
    real, calls = store_module.write_run, []

    def write_run(layout: Any, run: dict) -> None:
        calls.append(run.get("rewind_pending"))
        if len(calls) > 1:
            raise OSError(28, "No space left on device")
        real(layout, run)

    monkeypatch.setattr(store_module, "write_run", write_run)
    with pytest.raises(OSError):
        store.rewind(2, chunks=1, why="liar")
    monkeypatch.setattr(store_module, "write_run", real)
    store.writer.close()  # the coordinator stops (Fatal); a restart finishes the rewind
    again = RunStore.open(tmp_path / "run", None)
    try:
        assert again.steps == 2 and "rewind_pending" not in again._run
        again.fitness_log.append(2, records[2])  # the run goes on after the restart
        again.writer.close()  # and crashes: nothing is cut again at the next open
        third = RunStore.open(tmp_path / "run", None)
        assert third.steps == 3
        third.close()
    finally:
        again.close()


def test_a_snapshot_checked_before_a_rewind_is_not_stored(store: RunStore) -> None:
    _fill(store, 5)
    lineage = store.lineage  # the shell reads it where the snapshot of step 4 is checked
    store.rewind(2, chunks=1, why="liar")
    assert not store.save_snapshot(4, b"x", lineage=lineage)  # of an undone step
    assert store.snapshot_steps == [] and not store.snapshot_path(4).exists()
    assert store.save_snapshot(2, b"x", lineage=store.lineage)


def test_a_rewind_waits_for_a_snapshot_being_written(
    store: RunStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The shell writes a snapshot on a thread while the core may rewind on its loop: the
    # rewind must not move snapshots out while one of an undone step is being written.
    _fill(store, 5)
    writing, go_on = threading.Event(), threading.Event()
    real = store.writer.save_snapshot

    def slow(step: int, blob: bytes, keep: int = 3) -> None:
        writing.set()
        go_on.wait()
        real(step, blob, keep)

    monkeypatch.setattr(store.writer, "save_snapshot", slow)
    saver = threading.Thread(target=store.save_snapshot, args=(4, b"x", 3, store.lineage))
    saver.start()
    writing.wait()
    rewinder = threading.Thread(target=store.rewind, args=(2, 1, "liar"))
    rewinder.start()
    rewinder.join(1.0)  # finished by now unless it waits for the snapshot: either way
    go_on.set()
    saver.join()
    rewinder.join()
    assert store.steps == 2 and store.snapshot_steps == []
    assert not store.snapshot_path(4).exists()
    assert (store.path / REWOUND / "step-4.ckpt").exists()


def test_the_curve_leaves_out_the_points_a_rewind_undid(tmp_path: Path) -> None:
    # Before the rewind: steps 1..5 committed, held-out scores at 2 and 4, a sample at 4;
    # the rewind to 2 steps undoes every point past 2; step 3 is committed again after it.
    points: list[dict] = []
    for step in range(1, 6):
        points.append({"event": STEP, "step": step, "loss_bits": 9.0})
    points += [{"event": VALIDATION, "step": s, "valid_bits": 8.0} for s in (2, 4)]
    record(Metrics(CollectorRegistry()), Rewound(2, 5, 1, "liar", "kept"), curve=points.append)
    points.append({"event": STEP, "step": 3, "loss_bits": 7.0})
    layout = Layout(tmp_path)
    layout.history.write_text("".join(json.dumps(p) + "\n" for p in points))
    curve = read_curve(tmp_path)
    assert [(r["step"], r["loss_bits"]) for r in curve.steps] == [(1, 9.0), (2, 9.0), (3, 7.0)]
    assert [r["step"] for r in curve.validations] == [2]  # not the undone step 4's
