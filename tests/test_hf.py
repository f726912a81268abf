"""The hf family's torch-free side (shared/hf.py, shared/hf_dir.py): no torch needed. Its
replica state is `shared.replica`'s, with the target weights' bit patterns for tensors."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from eggroll_dist.shared import hf as hs
from eggroll_dist.shared import hf_dir as hd
from eggroll_dist.shared.config import ConfigError, ESConfig, ModelConfig, RunConfig
from eggroll_dist.shared.noise import noise_block
from eggroll_dist.shared.replica import (
    CheckpointError,
    ReplicaState,
    checkpoint_bytes,
    decode_checkpoint,
    encode_checkpoint,
    replay,
)

CANDIDATES = [
    ("transformer.wte", (50, 16)),
    ("transformer.h.0.attn.c_attn", (48, 16)),
    ("transformer.h.0.mlp.c_fc", (64, 16)),
    ("transformer.h.1.mlp.c_proj", (16, 64)),
    ("lm_head", (50, 16)),
]


def _cfg(
    pairs: int = 6,
    rank: int = 2,
    noise: str = "uniform",
    sigma: float = 0.01,
    dtype: str = "bfloat16",
) -> RunConfig:
    matrices = hs.matrices_of(hs.select_targets(CANDIDATES, rank=rank))
    return RunConfig(
        model=ModelConfig(arch="hf", path="tiny", rank=rank, matrices=matrices, weight_dtype=dtype),
        es=ESConfig(
            population=2 * pairs, chunk_size=2 * pairs, noise=noise, sigma=sigma, run_seed=7
        ),
    )


def _base(cfg: RunConfig, seed: int = 0) -> ReplicaState:
    """A step 0 of random weights (std 0.02) as the config's dtype holds them."""
    rng = np.random.default_rng(seed)
    params = {}
    for t in hs.targets(cfg.model):
        w = (rng.standard_normal(t.shape) * 0.02).astype(np.float32)
        if cfg.model.weight_dtype == "bfloat16":  # truncated: any bfloat16 will do
            params[t.name] = (w.view(np.uint32) >> 16).astype(np.uint16).view(np.int16)
        elif cfg.model.weight_dtype == "float16":
            params[t.name] = w.astype(np.float16).view(np.int16)
        else:
            params[t.name] = w.view(np.int32)
    return ReplicaState(cfg, 0, params)


def _fitness(rng: np.random.Generator, pairs: int, steps: int) -> list[np.ndarray]:
    return [rng.integers(-1, 2, size=pairs).astype(np.int8) for _ in range(steps)]


def test_default_targets_are_the_blocks_linear_layers() -> None:
    names = [t.name for t in hs.select_targets(CANDIDATES)]
    assert names == [
        "transformer.h.0.attn.c_attn",
        "transformer.h.0.mlp.c_fc",
        "transformer.h.1.mlp.c_proj",
    ]
    only = hs.select_targets(CANDIDATES, ["*.mlp.*"])
    assert [t.name for t in only] == names[1:]
    # a target's noise stream depends on its name only
    assert only[0].tensor_id == hs.target_id("transformer.h.0.mlp.c_fc")


@pytest.mark.parametrize(
    ("patterns", "rank", "message"),
    [
        (["*.q_proj"], 1, "matches no linear layer"),
        ([], 0, "at least 1"),
        ([], 17, "above the size of target transformer.h.0.attn.c_attn"),
    ],
)
def test_bad_targets_say_one_line(patterns: list[str], rank: int, message: str) -> None:
    with pytest.raises(hs.HFError, match=message) as info:
        hs.select_targets(CANDIDATES, patterns, rank)
    assert "\n" not in str(info.value)


def test_no_block_layers_is_refused() -> None:
    with pytest.raises(hs.HFError, match="inside a block"):
        hs.select_targets([("lm_head", (8, 4))])


def test_factors_come_from_the_noise_stream() -> None:
    cfg = _cfg()
    t = hs.targets(cfg.model)[1]
    a, b = hs.pair_factors(cfg, 3, t, np.array([4]))
    rows, cols = t.shape
    flat = noise_block(7, 3, np.array([4]), t.tensor_id, 0, (rows + cols) * 2, "uniform")[0]
    assert np.array_equal(a[0].ravel(), flat[: rows * 2])
    assert np.array_equal(b[0].ravel(), flat[rows * 2 :])
    # members 8 and 9 are pair 4, with opposite signs and the same B
    am, bm = hs.member_factors(cfg, 3, t, 8, 2)
    assert np.array_equal(am[0], a[0]) and np.array_equal(am[1], -a[0])
    assert np.array_equal(bm[0], b[0]) and np.array_equal(bm[1], b[0])


@pytest.mark.parametrize("noise", ["uniform", "gaussian"])
def test_z_batched_equals_pair_by_pair(noise: str) -> None:
    cfg = _cfg(pairs=9, rank=3, noise=noise)
    rng = np.random.default_rng(1)
    for t in hs.targets(cfg.model):
        f = _fitness(rng, cfg.pairs, 1)[0]
        assert np.array_equal(hs.z_matrix(cfg, 5, t, f), hs.z_by_pairs(cfg, 5, t, f))


def test_z_blocks_of_pairs_are_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _cfg(pairs=7)
    f = _fitness(np.random.default_rng(2), cfg.pairs, 1)[0]
    t = hs.targets(cfg.model)[0]
    whole = hs.z_matrix(cfg, 0, t, f)
    monkeypatch.setattr(hs, "PAIR_BLOCK", 2)
    assert np.array_equal(hs.z_matrix(cfg, 0, t, f), whole)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_replay_is_exact_and_the_digest_sees_one_flip(dtype: str) -> None:
    cfg = _cfg(dtype=dtype)
    log = _fitness(np.random.default_rng(3), cfg.pairs, 4)
    one = replay(_base(cfg), log)
    two = replay(_base(cfg), [f.copy() for f in log])
    assert one.step == 4
    assert one.digest() == two.digest()
    for t in hs.targets(cfg.model):
        assert np.array_equal(one.params[t.name], two.params[t.name])
        assert one.params[t.name].dtype == (np.int32 if dtype == "float32" else np.int16)
        assert not np.array_equal(one.params[t.name], _base(cfg).params[t.name])
    # replay from a midpoint reaches the same state
    mid = replay(_base(cfg), log[:2])
    assert replay(mid, log[2:]).digest() == one.digest()
    flipped = [f.copy() for f in log]
    k = int(np.flatnonzero(flipped[1])[0])
    flipped[1][k] = -flipped[1][k]
    assert replay(_base(cfg), flipped).digest() != one.digest()


def test_the_initial_state_is_the_model_directorys() -> None:
    with pytest.raises(ValueError, match="starts from the weights of its model directory"):
        ReplicaState.initial(_cfg())


def test_digest_covers_the_config_and_the_step() -> None:
    cfg = _cfg()
    state = _base(cfg)
    assert state.digest() != _base(_cfg(sigma=0.02)).digest()
    assert state.digest() != ReplicaState(cfg, 1, state.params).digest()


def test_bad_fitness_and_configs() -> None:
    cfg = _cfg()
    with pytest.raises(ValueError, match="shape"):
        replay(_base(cfg), [np.zeros(3, dtype=np.int8)])
    with pytest.raises(hs.HFError, match="int8"):
        replay(_base(cfg), [np.full(cfg.pairs, 2, dtype=np.int8)])
    m = cfg.model
    for model, es, message in [
        (replace(m, path=""), cfg.es, "needs model.path"),
        (replace(m, weight_dtype="int8"), cfg.es, "model.weight_dtype='int8' must be"),
        (replace(m, weight_dtype=""), cfg.es, "made by an earlier release, whose replica"),
        (
            replace(m, arch="egg", path="", rank=1, matrices=()),
            cfg.es,
            "model.weight_dtype is a setting",
        ),
        (replace(m, rank=40), cfg.es, "above the size of target"),
        (replace(m, matrices=("x 3",)), cfg.es, "must be 'name out in'"),
        (replace(m, matrices=("x 8 ²",)), cfg.es, "must be 'name out in'"),
        (
            replace(m, matrices=tuple(f"x{i} 1048576 1048576" for i in range(200))),
            cfg.es,
            "more than 137,438,953,472 weights in all",
        ),
        (replace(m, files=("abc config.json",)), cfg.es, "must be 'sha256 name'"),
        (m, replace(cfg.es, sigma=0.0), "es.sigma=0.0 must be in"),
        (m, replace(cfg.es, adaptive_noise=True), "es.adaptive_noise is not available"),
        (m, replace(cfg.es, population=1 << 46, chunk_size=2), "too large for an exact"),
        (replace(m, arch="egg"), cfg.es, "model.path is a setting of model.arch='hf'"),
    ]:
        with pytest.raises(ConfigError, match=message) as info:
            cfg.replace(model=model, es=es)
        assert "\n" not in str(info.value)


def test_a_config_round_trips_through_its_canonical_bytes() -> None:
    from eggroll_dist.shared.config import from_canonical_bytes

    cfg = _cfg()
    back = from_canonical_bytes(cfg.canonical_bytes())
    assert back == cfg and back.digest() == cfg.digest()
    assert isinstance(back.model.matrices, tuple)


def test_without_the_extra_one_line_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # as on a host without PyTorch
    with pytest.raises(hd.ModelDirError) as info:
        hd.require_hf()
    message = str(info.value)
    assert "pip install 'eggroll-distributed[hf]'" in message and "torch" in message
    assert "\n" not in message


def test_checkpoint_round_trip_and_refusals() -> None:
    cfg = _cfg()
    state = replay(_base(cfg), _fitness(np.random.default_rng(4), cfg.pairs, 2))
    data = encode_checkpoint(state)
    assert len(data) == checkpoint_bytes(cfg)  # what a coordinator bounds a snapshot by
    weights = sum(t.shape[0] * t.shape[1] for t in hs.targets(cfg.model))
    wide = _cfg(dtype="float32")  # the same run with float32 targets: 2 bytes more a weight
    assert checkpoint_bytes(wide) - checkpoint_bytes(cfg) == 2 * weights + (
        len(wide.canonical_bytes()) - len(cfg.canonical_bytes())
    )
    back = decode_checkpoint(data)
    assert back.step == 2 and back.digest() == state.digest()
    for t in hs.targets(cfg.model):
        assert np.array_equal(back.params[t.name], state.params[t.name])
        assert back.params[t.name].dtype == np.int16
    with pytest.raises(CheckpointError, match="CRC"):
        decode_checkpoint(data[:-20] + bytes(20))


def test_model_dir_digests(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "README.md").write_text("not loaded")
    pinned = hd.pinned_files(tmp_path)
    assert [p.split(" ")[1] for p in pinned] == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    hd.check_model_dir(tmp_path, pinned)
    (tmp_path / "model.safetensors").write_bytes(b"other weights")
    with pytest.raises(hd.ModelDirError, match=r"model\.safetensors differs") as info:
        hd.check_model_dir(tmp_path, pinned)
    assert "\n" not in str(info.value)
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(hd.ModelDirError, match=r"tokenizer\.json is missing"):
        hd.check_model_dir(tmp_path, pinned)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(hd.ModelDirError, match="safe_serialization"):
        hd.pinned_files(tmp_path)
    with pytest.raises(hd.ModelDirError, match="no config"):
        hd.model_dir_digests(tmp_path / "..")


def test_expert_layers_are_refused() -> None:
    layers = [("model.layers.0.mlp.experts.3.gate_proj", (32, 16)), ("model.layers.0.q", (8, 8))]
    with pytest.raises(hs.HFError, match="mixture-of-experts"):
        hs.select_targets(layers)
    assert [t.name for t in hs.select_targets(layers, ["*.q"])] == ["model.layers.0.q"]


def test_a_workers_model_path_stays_inside_its_goal_dir(tmp_path: Path) -> None:
    from eggroll_dist.shared.pinned import GoalError, model_dir

    cfg = _cfg()
    assert model_dir(cfg, tmp_path) == tmp_path / "tiny"
    for path in ("../tiny", "/etc/tiny", "a/../../tiny", "~/tiny", "~root/tiny"):
        bad = cfg.replace(model=replace(cfg.model, path=path))
        with pytest.raises(GoalError, match="not inside this worker's goal directory"):
            model_dir(bad, tmp_path)
        model_dir(bad, tmp_path, confined=False)  # a local command's own config
    with pytest.raises(GoalError, match="start this worker with --goal-dir"):
        model_dir(cfg, None)
