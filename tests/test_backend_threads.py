"""The NumPy backend sizes its BLAS pool itself: by default the usable cores divided by the
workers on the host, only while it computes, and the thread count changes no result."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest
from threadpoolctl import threadpool_info

from eggroll_dist.shared.config import load_config
from eggroll_dist.shared.data import load_data_dir
from eggroll_dist.shared.replica import ReplicaState
from eggroll_dist.worker.backend import BackendUnavailable, get_backend
from eggroll_dist.worker.backend.numpy_backend import (
    WORKERS_PER_HOST_VAR,
    NumpyBackend,
    default_threads,
    usable_cores,
)

CONFIG = """
[model]
n_layer = 1
d_model = 64
[es]
population = 64
chunk_size = 32
seq_len = 16
[validation]
every_steps = 0
max_tokens = 480
"""


@pytest.fixture
def backend_args(words_data: Path, tmp_path: Path):
    path = tmp_path / "run.toml"
    path.write_text(CONFIG)
    cfg = load_config(path)
    return load_data_dir(words_data), ReplicaState.initial(cfg)


def blas_threads() -> list[int]:
    return [pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"]


def test_default_is_the_usable_cores_shared_by_the_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cores = usable_cores()
    assert 1 <= cores <= (os.cpu_count() or 1)
    monkeypatch.delenv(WORKERS_PER_HOST_VAR, raising=False)
    assert default_threads() == cores
    monkeypatch.setenv(WORKERS_PER_HOST_VAR, "2")
    assert default_threads() == max(1, cores // 2)
    monkeypatch.setenv(WORKERS_PER_HOST_VAR, str(4 * cores))  # more workers than cores
    assert default_threads() == 1
    for bad in ("0", "two", "-1", "1.5"):
        monkeypatch.setenv(WORKERS_PER_HOST_VAR, bad)
        with pytest.raises(BackendUnavailable, match=f"{WORKERS_PER_HOST_VAR}='{bad}' must be"):
            get_backend("numpy")


def test_factory_and_backend_take_threads(backend_args, monkeypatch) -> None:
    monkeypatch.setenv(WORKERS_PER_HOST_VAR, "1")
    assert get_backend("numpy", 64, threads=3).build(*backend_args).threads == 3
    assert get_backend("numpy").build(*backend_args).threads == usable_cores()
    with pytest.raises(ValueError, match="threads=0 must be >= 1"):
        NumpyBackend(*backend_args, threads=0)


def test_pool_is_limited_while_computing_and_restored_after(backend_args) -> None:
    if not blas_threads():
        pytest.skip("NumPy here has no BLAS library threadpoolctl can see")
    before = blas_threads()
    backend = NumpyBackend(*backend_args, threads=1)
    seen: list[list[int]] = []
    forward = backend.model.forward

    def watched(*args, **kwargs):
        seen.append(blas_threads())
        return forward(*args, **kwargs)

    backend.model.forward = watched  # type: ignore[method-assign]
    backend.evaluate_chunk(0, 0, 32)
    backend.validate()
    assert seen and all(threads == [1] * len(before) for threads in seen)
    assert blas_threads() == before


def test_thread_count_changes_no_result(backend_args) -> None:
    """The GEMMs are exact integer products, so any pool size gives the same bytes."""
    results = []
    for threads in (1, 2, 3):
        backend = NumpyBackend(*backend_args, threads=threads)
        chunks = [backend.evaluate_chunk(0, lo, 32) for lo in (0, 32)]
        fitness = np.concatenate([c.fitness for c in chunks])
        backend.apply_step(fitness)
        results.append(
            (fitness.tobytes(), [c.loss_sum for c in chunks], backend.digest(), backend.validate())
        )
    assert results[0] == results[1] == results[2]


def test_chunks_side_by_side_equal_one_after_the_other(backend_args) -> None:
    """evaluate_chunks runs up to `threads` chunks at once, each on a thread of its own with a
    BLAS pool of one, and returns what evaluate_chunk returns for each, in order."""

    def values(results) -> list[tuple[bytes, int]]:
        return [(r.fitness.tobytes(), r.loss_sum) for r in results]

    ranges = [(0, 16), (16, 16), (32, 32)]
    alone = NumpyBackend(*backend_args, threads=1)
    want = values(alone.evaluate_chunk(0, first, count) for first, count in ranges)
    assert values(alone.evaluate_chunks(0, ranges)) == want

    backend = NumpyBackend(*backend_args, threads=3)
    assert backend.parallel_chunks == 3
    seen: list[tuple[int, list[int]]] = []
    forward = backend.model.forward

    def watched(*args, **kwargs):
        seen.append((threading.get_ident(), blas_threads()))
        return forward(*args, **kwargs)

    backend.model.forward = watched  # type: ignore[method-assign]
    before = blas_threads()
    assert values(backend.evaluate_chunks(0, ranges)) == want
    assert len({ident for ident, _ in seen}) > 1  # really side by side
    assert threading.get_ident() not in {ident for ident, _ in seen}
    if before:
        assert all(pools == [1] * len(before) for _, pools in seen)
        assert blas_threads() == before
    with pytest.raises(ValueError, match="bad member range"):
        backend.evaluate_chunks(0, [(0, 16), (3, 16)])
    with pytest.raises(ValueError, match="replica is at step 0"):
        backend.evaluate_chunks(1, ranges)
