"""The integer replica state of a Hugging Face model (shared/hf_state.py): no torch needed."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from eggroll_dist.shared import hf_dir as hd
from eggroll_dist.shared import hf_state as hs
from eggroll_dist.shared.noise import noise_block

CANDIDATES = [
    ("transformer.wte", (50, 16)),
    ("transformer.h.0.attn.c_attn", (48, 16)),
    ("transformer.h.0.mlp.c_fc", (64, 16)),
    ("transformer.h.1.mlp.c_proj", (16, 64)),
    ("lm_head", (50, 16)),
]


def _spec(pairs: int = 6, rank: int = 2, **kw: object) -> hs.HFSpec:
    targets = hs.select_targets(CANDIDATES, rank=rank)
    return hs.HFSpec(targets, rank=rank, seed=7, pairs=pairs, **kw)  # type: ignore[arg-type]


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
    with pytest.raises(hs.HFStateError, match=message) as info:
        hs.select_targets(CANDIDATES, patterns, rank)
    assert "\n" not in str(info.value)


def test_no_block_layers_is_refused() -> None:
    with pytest.raises(hs.HFStateError, match="inside a block"):
        hs.select_targets([("lm_head", (8, 4))])


def test_factors_come_from_the_noise_stream() -> None:
    spec = _spec()
    t = spec.targets[1]
    a, b = hs.pair_factors(spec, 3, t, np.array([4]))
    rows, cols = t.shape
    flat = noise_block(7, 3, np.array([4]), t.tensor_id, 0, (rows + cols) * 2, "uniform")[0]
    assert np.array_equal(a[0].ravel(), flat[: rows * 2])
    assert np.array_equal(b[0].ravel(), flat[rows * 2 :])
    # members 8 and 9 are pair 4, with opposite signs and the same B
    am, bm = hs.member_factors(spec, 3, t, 8, 2)
    assert np.array_equal(am[0], a[0]) and np.array_equal(am[1], -a[0])
    assert np.array_equal(bm[0], b[0]) and np.array_equal(bm[1], b[0])


@pytest.mark.parametrize("noise", ["uniform", "gaussian"])
def test_z_batched_equals_pair_by_pair(noise: str) -> None:
    spec = _spec(pairs=9, rank=3, noise=noise)
    rng = np.random.default_rng(1)
    for t in spec.targets:
        f = _fitness(rng, spec.pairs, 1)[0]
        assert np.array_equal(hs.z_matrix(spec, 5, t, f), hs.z_by_pairs(spec, 5, t, f))


def test_z_blocks_of_pairs_are_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _spec(pairs=7)
    f = _fitness(np.random.default_rng(2), spec.pairs, 1)[0]
    t = spec.targets[0]
    whole = hs.z_matrix(spec, 0, t, f)
    monkeypatch.setattr(hs, "PAIR_BLOCK", 2)
    assert np.array_equal(hs.z_matrix(spec, 0, t, f), whole)


def test_replay_is_exact_and_the_digest_sees_one_flip() -> None:
    spec = _spec(rate=3)
    log = _fitness(np.random.default_rng(3), spec.pairs, 4)
    one = hs.replay(hs.HFState.initial(spec), log)
    two = hs.replay(hs.HFState.initial(spec), [f.copy() for f in log])
    assert one.step == 4
    assert one.digest() == two.digest()
    for t in spec.targets:
        assert np.array_equal(one.acc[t.name], two.acc[t.name])
        assert one.acc[t.name].dtype == np.int64
    # replay from a midpoint reaches the same state
    mid = hs.replay(hs.HFState.initial(spec), log[:2])
    assert hs.replay(mid, log[2:]).digest() == one.digest()
    # acc = rate * sum of the steps' Z
    t = spec.targets[2]
    total = sum(hs.z_by_pairs(spec, s, t, f) for s, f in enumerate(log))
    assert np.array_equal(one.acc[t.name], 3 * total)
    flipped = [f.copy() for f in log]
    k = int(np.flatnonzero(flipped[1])[0])
    flipped[1][k] = -flipped[1][k]
    assert hs.replay(hs.HFState.initial(spec), flipped).digest() != one.digest()


def test_digest_covers_the_spec_and_the_step() -> None:
    spec = _spec()
    state = hs.HFState.initial(spec)
    other = hs.HFState.initial(_spec(sigma=2e-3))
    assert state.digest() != other.digest()
    assert state.digest() != hs.HFState(spec, 1, state.acc).digest()
    assert len(state.digest_hex()) == 16


def test_bad_fitness_and_spec() -> None:
    spec = _spec()
    with pytest.raises(hs.HFStateError, match="shape"):
        hs.apply_step(hs.HFState.initial(spec), np.zeros(3, dtype=np.int8))
    with pytest.raises(hs.HFStateError, match="int8"):
        hs.apply_step(hs.HFState.initial(spec), np.full(spec.pairs, 2, dtype=np.int8))
    with pytest.raises(hs.HFStateError, match="rate"):
        _spec(rate=0)
    with pytest.raises(hs.HFStateError, match="float64"):
        _spec(pairs=1 << 50)


def test_without_the_extra_one_line_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from eggroll_dist.worker import hf_model  # imports no torch itself

    monkeypatch.setitem(sys.modules, "torch", None)  # as on a host without PyTorch
    with pytest.raises(hf_model.HFModelError) as info:
        hf_model.require_hf()
    message = str(info.value)
    assert "pip install 'eggroll-distributed[hf]'" in message and "torch" in message
    assert "\n" not in message


def test_checkpoint_round_trip_and_refusals() -> None:
    spec = _spec()
    state = hs.replay(hs.HFState.initial(spec), _fitness(np.random.default_rng(4), spec.pairs, 2))
    data = hs.encode_state(state)
    back = hs.decode_state(data, spec)
    assert back.step == 2 and back.digest() == state.digest()
    for t in spec.targets:
        assert np.array_equal(back.acc[t.name], state.acc[t.name])
    with pytest.raises(hs.HFStateError, match="CRC"):
        hs.decode_state(data[:-20] + bytes(20), spec)
    with pytest.raises(hs.HFStateError, match="CRC"):
        hs.decode_state(data[:100], spec)
    with pytest.raises(hs.HFStateError, match="another run"):
        hs.decode_state(data, _spec(rate=2))
    with pytest.raises(hs.HFStateError, match="magic"):
        hs.decode_state(b"EGGCKPT\0" + data[8:], spec)


def test_model_dir_digests(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "README.md").write_text("not loaded")
    pinned = hd.model_dir_digests(tmp_path)
    assert sorted(pinned) == ["config.json", "model.safetensors", "tokenizer.json"]
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
        hd.model_dir_digests(tmp_path)
    with pytest.raises(hd.ModelDirError, match="no config"):
        hd.model_dir_digests(tmp_path / "..")
