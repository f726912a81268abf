"""Rewinds (protocol/SPEC.md §8): a convicted machine's unconfirmed results are undone.

The pure rule (coordinator/rewind.py), the save directory's cut (coordinator/store.py), and
the run core with in-memory workers: a liar whose lies were committed unchecked is caught
later, and the run ends with the fitness log an honest run makes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import UNIT_CFG, Network, sync_replica, words_data_dir

from eggroll_dist.coordinator.events import RewindOutside, Rewound
from eggroll_dist.coordinator.rewind import Provenance, Source, plan
from eggroll_dist.coordinator.store import REWOUND, RunStore
from eggroll_dist.shared.config import ESConfig, ValidationConfig
from eggroll_dist.shared.data import Dataset, load_data_dir
from eggroll_dist.shared.fitness_log import FitnessLog
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

    async def evaluate(self, step: int, chunks: list[tuple[int, int]]) -> list[ChunkResult]:
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
