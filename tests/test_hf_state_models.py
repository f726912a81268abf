"""The hf family's compact state on real models: the base read from the safetensors files is
the loaded model's weights, sharded files read as one, and workers evaluating in float32 or
bfloat16 hold the same state (the rule itself: tests/test_hf_state.py, which needs no torch)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from eggroll_dist.shared import hf as hs
from eggroll_dist.shared import hf_dir as hd
from eggroll_dist.shared.config import ESConfig, ModelConfig, RunConfig, UpdateConfig

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_models import save_model  # noqa: E402

from eggroll_dist.shared.pinned import pin  # noqa: E402
from eggroll_dist.shared.replica import (  # noqa: E402
    ReplicaState,
    checkpoint_bytes,
    encode_checkpoint,
    replay,
)
from eggroll_dist.shared.start import initial_state  # noqa: E402
from eggroll_dist.worker import hf_model as hm  # noqa: E402


@pytest.fixture(scope="module", params=[("llama", "bfloat16"), ("gpt2", "float32")])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    family, dtype = request.param
    return save_model(tmp_path_factory.mktemp(f"{family}-{dtype}"), family, 0.3, dtype)


def _pinned(path: Path, pairs: int = 3) -> RunConfig:
    cfg = RunConfig(
        model=ModelConfig(arch="hf", path=str(path), rank=2),
        es=ESConfig(population=2 * pairs, chunk_size=2 * pairs, sigma=0.05, seq_len=8),
        update=UpdateConfig(lr=2.0),
    )
    return pin(cfg, Path("."))


@pytest.mark.parametrize("evaluation", ["float32", "bfloat16"])
def test_the_base_is_the_loaded_models_weights(model: Path, evaluation: str) -> None:
    cfg = _pinned(model)
    assert cfg.model.weight_dtype == ("bfloat16" if "bfloat16" in model.name else "float32")
    base = initial_state(cfg, Path("."))
    assert base.step == 0 and set(base.params) == {t.name for t in hs.targets(cfg.model)}
    lm = hm.PopulationLM(hm.load_causal_lm(model, evaluation), cfg)
    for name, bits in base.params.items():
        assert bits.dtype == np.dtype(hs.WEIGHT_DTYPES[cfg.model.weight_dtype])
        w = lm._weight(name).detach()
        assert torch.equal(w, torch.from_numpy(bits).view(lm.state_dtype).to(w.dtype))


def test_sharded_files_read_as_one(model: Path, tmp_path: Path) -> None:
    loaded = hm.load_causal_lm(model)
    cfg = _pinned(model)
    loaded.to(getattr(torch, cfg.model.weight_dtype)).save_pretrained(
        tmp_path, max_shard_size="20KB"
    )
    assert (tmp_path / hd.INDEX_FILE).is_file()
    a = hd.base_state(cfg, model)
    b = hd.base_state(cfg, tmp_path)
    assert all(np.array_equal(a.params[n], b.params[n]) for n in a.params)


def test_float32_and_bfloat16_workers_hold_the_same_state(model: Path, words_data: Path) -> None:
    """Two CPU workers, one evaluating in float32 and one in bfloat16, apply the same fitness
    log: the same bits, the same digest, the reference replay's; a snapshot holds the
    model's own bytes per target weight."""
    from eggroll_dist.shared.data import load_data_dir
    from eggroll_dist.worker.backend.torch_backend import TorchBackend

    cfg = _pinned(model)
    dataset = load_data_dir(words_data)
    workers = [
        TorchBackend(dataset, initial_state(cfg, Path(".")), model, "cpu", dtype, 6)
        for dtype in ("float32", "bfloat16")
    ]
    assert workers[0].lm.holds_state == (cfg.model.weight_dtype == "float32")
    assert workers[1].lm.holds_state == (cfg.model.weight_dtype == "bfloat16")
    rng = np.random.default_rng(5)
    log = []
    before: list[ReplicaState] = []
    for step in range(3):
        if step == 1:  # a snapshot taken after a step: later steps leave it alone
            before = [w.state for w in workers]
            kept = [{n: b.copy() for n, b in s.params.items()} for s in before]
        # each worker would propose its own fitness: one of theirs is committed
        fitness = workers[step % 2].evaluate_chunk(step, 0, cfg.es.population).fitness
        fitness = np.where(fitness == 0, rng.integers(-1, 2, cfg.pairs), fitness).astype(np.int8)
        log.append(fitness)
        moved = [w.apply_step(fitness) for w in workers]
        assert moved[0] == moved[1] > 0
        assert workers[0].digest() == workers[1].digest()
    want = replay(initial_state(cfg, Path(".")), log)
    for state, params in zip(before, kept, strict=True):
        assert all(np.array_equal(state.params[n], params[n]) for n in params)
    for w in workers:
        assert w.step == 3 and w.digest() == want.digest()
        state = w.state
        assert all(np.array_equal(state.params[n], want.params[n]) for n in want.params)
        for name, bits in want.params.items():  # the evaluated weights are the state's
            weight = w.lm._weight(name).detach()
            assert torch.equal(
                weight, torch.from_numpy(bits).view(w.lm.state_dtype).to(weight.dtype)
            )
    weights = sum(t.shape[0] * t.shape[1] for t in hs.targets(cfg.model))
    size = hs.WEIGHT_DTYPES[cfg.model.weight_dtype](0).itemsize
    assert sum(b.nbytes for b in want.params.values()) == size * weights
    blob = encode_checkpoint(workers[1].state)
    assert len(blob) == checkpoint_bytes(cfg) < size * weights + 64 * 1024
    # a worker given a state loads it: the other one's, bit for bit
    workers[0].load_state(ReplicaState(cfg, 3, want.params))
    assert workers[0].digest() == want.digest()


def test_nan_payloads_survive_a_wider_evaluation(model: Path, words_data: Path) -> None:
    """A float32 evaluation of bfloat16 weights: NaNs whose bits a conversion back would
    rewrite (payloads, signs, signalling ones) stay the state's, as the replay keeps them."""
    from eggroll_dist.shared.data import load_data_dir
    from eggroll_dist.worker.backend.torch_backend import TorchBackend

    cfg = _pinned(model)
    if cfg.model.weight_dtype == "float32":
        pytest.skip("float32 weights: the evaluation dtype is the state's")
    start = initial_state(cfg, Path("."))
    name = hs.targets(cfg.model)[0].name
    start.params[name].reshape(-1)[:3] = [0x7FC1, -0x3F, 0x7F81]  # bfloat16 NaNs
    worker = TorchBackend(load_data_dir(words_data), start, model, "cpu", "float32", 6)
    log = [np.array([1, -1, 0], dtype=np.int8), np.array([0, 1, 1], dtype=np.int8)]
    for fitness in log:
        worker.apply_step(fitness)
    want = replay(start, log)
    assert np.array_equal(worker.state.params[name], want.params[name])
    assert worker.digest() == want.digest()
