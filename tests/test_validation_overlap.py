"""Validation off the training path: a copy of step s's weights is scored while the backend
evaluates and applies later steps, with the numbers of an in-order validation at s (both
backends: NumPy, and CuPy's own code on the CPU build of its kernels), a fallback to the
in-order validation where there is no room for a copy, and in a real run the coordinator
committing later steps before the VALIDATION of an earlier one arrives."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import structlog

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import Proc
from helpers import TINY_RUN, start_coordinator
from kernel_target import CPU_BUILD_MISSING, VARIANTS, array_module, module_factory
from test_cupy_backend import dataset, reduced

from eggroll_dist.coordinator.asks import OpenAsks
from eggroll_dist.coordinator.core_types import Peer
from eggroll_dist.shared.config import RunConfig
from eggroll_dist.shared.replica import ReplicaState
from eggroll_dist.worker.backend import held_out
from eggroll_dist.worker.backend.cupy_backend import CupyBackend
from eggroll_dist.worker.backend.numpy_backend import NumpyBackend

PRESETS = ["tiny", "egg-paper", "former-tiny"]
STEPS = 4


def numpy_backend(cfg: RunConfig, data: SimpleNamespace) -> NumpyBackend:
    return NumpyBackend(data, ReplicaState.initial(cfg))


def cupy_backend(cfg: RunConfig, data: SimpleNamespace) -> CupyBackend:
    return CupyBackend(
        data,
        ReplicaState.initial(cfg),
        xp=array_module(),
        module_factory=module_factory(VARIANTS[-1]),
        batch_members=6,
    )


def train_while_scoring(backend: Any, cfg: RunConfig, data: SimpleNamespace) -> None:
    """At each step a copy of the weights is taken and scored on another thread: at odd
    steps while the backend evaluates the step and applies it, at even ones only once the
    update has moved the live weights. Its scores are the in-order validation's at that
    step (an untouched NumPy replica that moves in step)."""
    ref = numpy_backend(cfg, data)
    chunks = [(c * cfg.es.chunk_size, cfg.es.chunk_size) for c in range(cfg.chunks)]
    with ThreadPoolExecutor(1) as pool:
        for step in range(STEPS):
            want = ref.validate()
            score = backend.validation_copy()
            assert score is not None
            scored = pool.submit(score) if step % 2 else None
            results = backend.evaluate_chunks(step, chunks)
            fitness = np.concatenate([r.fitness for r in results])
            backend.apply_step(fitness)  # the live weights move on
            assert (scored or pool.submit(score)).result() == want
            assert want.windows is not None and want.windows.tokens > 0
            ref.apply_step(fitness)
    assert backend.validate() == ref.validate()  # and in order, as before


@pytest.mark.parametrize("name", PRESETS)
def test_numpy_scores_a_copy_while_it_trains(name: str) -> None:
    cfg = reduced(name)
    data = dataset(cfg)
    train_while_scoring(numpy_backend(cfg, data), cfg, data)


@pytest.mark.skipif(bool(CPU_BUILD_MISSING), reason=str(CPU_BUILD_MISSING))
@pytest.mark.parametrize("name", PRESETS)
def test_cupy_scores_a_copy_while_it_trains(name: str) -> None:
    """The first copy is scored at once (its passes allocate), the later ones by the twin
    on its own thread while the backend goes on."""
    cfg = reduced(name)
    data = dataset(cfg)
    backend = cupy_backend(cfg, data)
    train_while_scoring(backend, cfg, data)
    copy = backend._held_out_copy
    assert copy is not None and copy.warm and copy.twin is not None
    assert copy.twin._held_out_graphs  # its own passes, on its own buffers


class _NoRoom(np.ndarray):
    """Weights whose copy does not fit."""

    def copy(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise MemoryError


def test_numpy_without_room_for_a_copy_says_so() -> None:
    cfg = reduced("tiny")
    data = dataset(cfg)
    backend = numpy_backend(cfg, data)
    params = backend.state.params
    name = next(iter(params))
    params[name] = params[name].view(_NoRoom)
    with structlog.testing.capture_logs() as logs:
        assert backend.validation_copy() is None
    assert [e["event"] for e in logs] == ["validation runs in order"]
    assert "no room on the host" in logs[0]["reason"]
    assert backend.validate() == numpy_backend(cfg, data).validate()


@pytest.mark.skipif(bool(CPU_BUILD_MISSING), reason=str(CPU_BUILD_MISSING))
def test_cupy_without_room_for_a_twin_validates_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """No room on the device: one log line, then in-order validation every time, with the
    same numbers."""
    cfg = reduced("tiny")
    data = dataset(cfg)
    backend = cupy_backend(cfg, data)

    def no_room(b: CupyBackend) -> CupyBackend:
        raise MemoryError("out of memory allocating 1 GiB")

    monkeypatch.setattr(held_out, "_twin", no_room)
    with structlog.testing.capture_logs() as logs:
        assert backend.validation_copy() is None
        assert backend.validation_copy() is None
    assert [e["event"] for e in logs] == ["validation runs in order"]
    assert "no room on the device" in logs[0]["reason"]
    assert backend.validate() == numpy_backend(cfg, data).validate()


def test_open_asks_keep_each_step_until_its_answer() -> None:
    """A worker asked for step 10 and then 20 answers both, in either order; a stranger's
    answer and a repeat do not count; a worker that leaves is awaited no more."""
    asks, peer, other = OpenAsks(), Peer(1, "a:1"), Peer(2, "b:1")
    for step in (10, 20):
        peer.replica_step = asks.step = step
        assert asks.at(peer) and asks.ask(peer) == step
    assert asks.pending(10) and asks.pending(20)
    assert not asks.answered(other.id, 10)
    assert asks.answered(peer.id, 20) and not asks.answered(peer.id, 20)
    assert asks.answered(peer.id, 10) and not asks.pending(10)
    peer.replica_step = asks.step = 30
    asks.ask(peer)
    assert asks.drop(peer.id) == 30 and not asks.pending(30)
    assert not asks.answered(peer.id, 30)


# A worker whose first copy is scored only once its replica is three steps past it: with
# validation in order, the replica could not move on and the scores would come at the
# deadline, after which nothing later was committed first.
SLOW = """
import sys, time
from eggroll_dist.worker.backend import numpy_backend
from eggroll_dist.worker.cli import main
real = numpy_backend.NumpyBackend.validation_copy
first = []
def copy(self):
    score, step = real(self), self.step
    if first:
        return score
    first.append(step)
    def slow():
        deadline = time.monotonic() + 60
        while self.step < step + 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        return score()
    return slow
numpy_backend.NumpyBackend.validation_copy = copy
sys.exit(main())
"""


def test_steps_are_committed_while_a_validation_is_scored(
    spawn, tmp_path: Path, words_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EGGROLL_TOKEN", "overlap-test-token-0123456789")
    config = tmp_path / "run.toml"
    config.write_text(TINY_RUN.replace("every_steps = 0", "every_steps = 4"))
    coord, port = start_coordinator(spawn, tmp_path / "run", config, "--max-steps", "12")
    flags = ("--data-dir", str(words_data), "--name", "slow", "--log-format", "json")
    worker = Proc([sys.executable, "-c", SLOW, f"127.0.0.1:{port}", *flags], "slow")
    try:
        coord.wait_for(lambda e: e.get("event") == "validation" and e["step"] == 12, 120, "12")
    finally:
        worker.stop()
        coord.stop()
    order = [
        (e["event"], e["step"]) for e in coord.events if e.get("event") in ("step", "validation")
    ]
    at = order.index(("validation", 4))
    assert {("step", s) for s in (5, 6, 7)} <= set(order[:at])  # committed before it came
    # Every held-out score, under its own step, once.
    assert [s for kind, s in order if kind == "validation"] == [4, 8, 12]
