"""The hf family's replica state is the target weights in the dtype of the model's files:
the update rule (shared/hf.py) computed by NumPy and by PyTorch gives the same bits, the
base is read from the safetensors files, and workers evaluating in float32 or bfloat16 hold
the same state."""

from __future__ import annotations

import json
import struct
import warnings
from pathlib import Path

import numpy as np
import pytest

from eggroll_dist.shared import hf as hs
from eggroll_dist.shared import hf_dir as hd
from eggroll_dist.shared.config import ESConfig, ModelConfig, RunConfig, UpdateConfig

CANDIDATES = [
    ("transformer.h.0.attn.c_attn", (48, 16)),
    ("transformer.h.0.mlp.c_fc", (64, 16)),
    ("transformer.h.1.mlp.c_proj", (16, 64)),
]
DTYPES = ["bfloat16", "float16", "float32"]


def _cfg(dtype: str, rank: int = 2, pairs: int = 6, seed: int = 7, lr: float = 4.0) -> RunConfig:
    matrices = hs.matrices_of(hs.select_targets(CANDIDATES, rank=rank))
    return RunConfig(
        model=ModelConfig(arch="hf", path="m", rank=rank, matrices=matrices, weight_dtype=dtype),
        es=ESConfig(population=2 * pairs, chunk_size=2 * pairs, sigma=0.01, run_seed=seed),
        update=UpdateConfig(lr=lr),
    )


def _bits(w: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values as the bits of `dtype` (bfloat16 truncated: any bfloat16 will do)."""
    w = w.astype(np.float32)
    if dtype == "bfloat16":
        return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.int16)
    if dtype == "float16":
        return w.astype(np.float16).view(np.int16)
    return w.view(np.int32)


def _params(cfg: RunConfig, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        t.name: _bits(rng.standard_normal(t.shape) * 0.02, cfg.model.weight_dtype)
        for t in hs.targets(cfg.model)
    }


# --- the rule, in NumPy ---------------------------------------------------------------------


def test_float32_is_one_multiply_then_one_add() -> None:
    cfg = _cfg("float32")
    params = _params(cfg)
    f = np.array([1, -1, 0, 1, 1, -1], dtype=np.int8)
    new, changed = hs.apply_update(cfg, 3, params, f)
    alpha = np.float32(hs.weight_scale(cfg))
    for t in hs.targets(cfg.model):
        z = hs.z_by_pairs(cfg, 3, t, f)
        w = params[t.name].view(np.float32)
        want = np.where(z == 0, w, w + z.astype(np.float32) * alpha)
        assert np.array_equal(new[t.name].view(np.float32), want)
    assert changed == sum(int(np.count_nonzero(new[n] != params[n])) for n in params) > 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_stochastic_rounding_picks_a_neighbour_with_the_right_odds(dtype: str) -> None:
    """Updates far below half a unit in the last place still move some weights, about as
    many as the fraction they are of a unit, and each to one of the two neighbours."""
    n = 1 << 16
    bits = _bits(np.full(n, 1.0), dtype)  # 1.0: its unit above is 2**-7 or 2**-10
    unit = 2.0**-7 if dtype == "bfloat16" else 2.0**-10
    alpha = unit / 64  # z * alpha = a tenth of a unit at z = 6.4: try z = 16, 0.25 units
    z = np.full(n, 16.0)
    new = hs.update_bits(bits, z, alpha, dtype, key=12345)
    values = hs.widen(new, dtype).astype(np.float64)
    assert set(np.unique(values)) <= {1.0, 1.0 + unit}
    moved = float(np.mean(values > 1.0))
    assert abs(moved - 0.25) < 4 * np.sqrt(0.25 * 0.75 / n)
    # negative updates round the magnitude of a negative weight the same way
    neg = hs.update_bits(_bits(np.full(n, -1.0), dtype), z, -alpha, dtype, key=12345)
    assert np.array_equal(hs.widen(neg, dtype), -hs.widen(new, dtype))
    # round to nearest would have lost every update
    assert np.all(np.float32(1.0) + np.float32(16 * alpha) == np.float32(1.0 + 16 * alpha))


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_z_moves_nothing_negative_zero_included(dtype: str) -> None:
    cfg = _cfg(dtype)
    params = _params(cfg)
    name = hs.targets(cfg.model)[0].name
    params[name][0, :4] = _bits(np.array([-0.0, 0.0, -0.0, 1.0]), dtype)
    same, changed = hs.apply_update(cfg, 0, params, np.zeros(cfg.pairs, np.int8))
    assert changed == 0 and all(np.array_equal(same[n], params[n]) for n in params)
    z = np.zeros(params[name].shape)
    kept = hs.update_bits(params[name], z, hs.weight_scale(cfg), dtype, 1)
    assert np.array_equal(kept, params[name])  # -0.0 stays -0.0


def _special_bits(dtype: str, shape: tuple[int, int]) -> np.ndarray:
    """Random bit patterns of `dtype` led by its edge values: zeros of both signs,
    infinities, NaNs with payloads, subnormals, the largest finite values."""
    kind = hs.WEIGHT_DTYPES[dtype]
    info = np.iinfo(kind)
    rng = np.random.default_rng(5)
    bits = rng.integers(info.min, info.max, size=shape, endpoint=True, dtype=kind)
    edges = {
        "bfloat16": [0, -0x8000, 0x7F80, -0x80, 0x7FC1, -0x3F, 1, 0x7F7F, -0x81],
        "float16": [0, -0x8000, 0x7C00, -0x400, 0x7E01, -0x1FF, 1, 0x3FF, 0x7BFF],
        "float32": [0, -(2**31), 0x7F800000, -0x800000, 0x7FC00001, 1, 0x7FFFFF, 0x7F7FFFFF],
    }[dtype]
    bits.reshape(-1)[: len(edges)] = np.array(edges, dtype=np.int64).astype(kind)
    return bits


@pytest.mark.parametrize("dtype", DTYPES)
def test_edge_values_follow_the_rule_quietly(dtype: str) -> None:
    """Infinities and NaNs in the weights, and products past float32's range, are the rule's
    own cases: a replay computes them without a floating-point warning."""
    bits = _special_bits(dtype, (64, 64))
    z = np.random.default_rng(1).integers(-(10**6), 10**6, size=bits.shape).astype(np.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for alpha in (1e-3, 1e30):
            new = hs.update_bits(bits, z, alpha, dtype, key=9)
            assert np.all(new[np.isnan(hs.widen(bits, dtype))] != 0)  # NaN stays NaN


# --- NumPy == PyTorch -----------------------------------------------------------------------


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_rule_equals_numpy_on_edge_values(device: str, dtype: str) -> None:
    """The same bits for infinities, NaNs, subnormals, overflow and underflow of the
    product, and for a transposed (non-contiguous) block of bits."""
    torch = pytest.importorskip("torch")
    from eggroll_dist.worker import hf_update as hu

    device = _device(device)
    bits = _special_bits(dtype, (96, 64))
    rng = np.random.default_rng(2)
    z = rng.integers(-(10**7), 10**7, size=bits.shape).astype(np.float64)
    z[rng.random(bits.shape) < 0.1] = 0
    z[0, :4] = [1, -1, 2**24 + 1, -(2**24 + 3)]  # float32(Z) rounds to nearest even
    for alpha in (1e-3, 1e-30, 1e-45, 3.0, 1e30):
        want = hs.update_bits(bits, z.astype(np.int64), alpha, dtype, key=77)
        for block in (bits, np.asfortranarray(bits)):
            got = hu.update_bits(
                torch.from_numpy(block).to(device), torch.from_numpy(z).to(device),
                alpha, dtype, 77, 0,
            )  # fmt: skip
            assert np.array_equal(got.cpu().numpy(), want), (alpha, block.flags.c_contiguous)


def _device(name: str) -> str:
    """`name`, or a skip where PyTorch or that device is missing."""
    torch = pytest.importorskip("torch")
    if name == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return name


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rank", "seed"), [(1, 0), (2, 7), (4, 2**63 + 5)])
def test_torch_rule_equals_numpy_bit_for_bit(
    device: str, dtype: str, rank: int, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    device = _device(device)
    import torch

    from eggroll_dist.worker import hf_update as hu

    monkeypatch.setattr(hu, "ROW_ELEMENTS", 100)  # several row blocks per target
    monkeypatch.setattr(hu, "FACTOR_ELEMENTS", 300)  # several blocks of pairs
    cfg = _cfg(dtype, rank=rank, seed=seed)
    params = _params(cfg, seed=rank)
    held = {n: torch.from_numpy(b.copy()).to(device) for n, b in params.items()}
    rng = np.random.default_rng(rank)
    log = [rng.integers(-1, 2, size=cfg.pairs).astype(np.int8) for _ in range(3)]
    log.insert(1, np.zeros(cfg.pairs, np.int8))  # nothing moves
    log.append(np.ones(cfg.pairs, np.int8))
    for step, f in enumerate(log):
        params, changed = hs.apply_update(cfg, step, params, f)
        moved = hu.apply_update(
            cfg, step, f, lambda t: held[t.name], lambda t, b: held.__setitem__(t.name, b)
        )
        assert moved == changed and (changed > 0) == bool(np.any(f))
        for name, bits in params.items():
            assert held[name].dtype == torch.from_numpy(bits).dtype
            assert held[name].device.type == device
            assert np.array_equal(held[name].cpu().numpy(), bits), (step, name)


def test_torch_z_equals_numpy() -> None:
    pytest.importorskip("torch")
    from eggroll_dist.worker import hf_update as hu

    cfg = _cfg("bfloat16", rank=3)
    f = np.array([1, 0, -1, 1, -1, 1], dtype=np.int8)
    for t in hs.targets(cfg.model):
        z = hu.z_tensor(cfg, 2, t, f, "cpu").numpy()
        assert np.array_equal(z.astype(np.int64), hs.z_matrix(cfg, 2, t, f))


# --- the base, from the safetensors files ---------------------------------------------------


def _tensor_file(path: Path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    """A safetensors file written by hand: {name: (dtype, shape, data)}."""
    header, data = {}, b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {
            "dtype": dtype,
            "shape": shape,
            "data_offsets": [len(data), len(data) + len(raw)],
        }
        data += raw
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def test_the_reader_bounds_every_size(tmp_path: Path) -> None:
    f = tmp_path / "model.safetensors"
    _tensor_file(f, {"a.weight": ("BF16", [2, 3], bytes(12))})
    header, start = hd._header(f)
    assert header["a.weight"]["shape"] == [2, 3] and start == f.stat().st_size - 12
    good = f.read_bytes()
    for bad, why in [
        (good[:5], "too short"),
        (struct.pack("<Q", 1 << 40) + good[8:], "header of"),
        (good[:-1], "malformed"),  # its data runs past the file's end
        (good[:8] + b"[" + good[9:], "bad header"),
        (struct.pack("<Q", 200_000) + b"[" * 100_000 + b"]" * 100_000, "bad header"),
    ]:
        f.write_bytes(bad)
        with pytest.raises(hd.ModelDirError, match=why) as info:
            hd._header(f)
        assert "\n" not in str(info.value)
    _tensor_file(f, {"a.weight": ("BF16", [2, 3], bytes(10))})  # 10 bytes for 6 values
    with pytest.raises(hd.ModelDirError, match="malformed"):
        hd._header(f)


def test_an_index_names_only_pinned_shards(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    _tensor_file(tmp_path / "model-1.safetensors", {"h.0.q.weight": ("F32", [1], bytes(4))})
    index = tmp_path / hd.INDEX_FILE
    index.write_text(json.dumps({"weight_map": {"h.0.q.weight": "model-1.safetensors"}}))
    assert hd._weight_files(tmp_path) == {"h.0.q.weight": tmp_path / "model-1.safetensors"}
    # a file no digest covers (model.files pins *.safetensors) must not give the base
    (tmp_path / "weights.bin").write_bytes((tmp_path / "model-1.safetensors").read_bytes())
    for shard, why in [("weights.bin", "not .safetensors"), ("../x.safetensors", "outside")]:
        index.write_text(json.dumps({"weight_map": {"h.0.q.weight": shard}}))
        with pytest.raises(hd.ModelDirError, match=why):
            hd._weight_files(tmp_path)


def test_target_dtypes_are_pinned_or_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    two = ["h.0.q 2 2", "h.0.k 2 2"]
    _tensor_file(
        tmp_path / "model.safetensors",
        {"h.0.q.weight": ("BF16", [2, 2], bytes(8)), "h.0.k.weight": ("F32", [2, 2], bytes(16))},
    )
    assert hd.target_dtype(tmp_path, two[:1]) == "bfloat16"
    with pytest.raises(hd.ModelDirError, match="stored in two dtypes"):
        hd.target_dtype(tmp_path, two)
    _tensor_file(tmp_path / "model.safetensors", {"h.0.q.weight": ("F64", [2, 2], bytes(32))})
    with pytest.raises(hd.ModelDirError, match="trains bfloat16, float16 or float32"):
        hd.target_dtype(tmp_path, two[:1])
    with pytest.raises(hd.ModelDirError, match=r"no weight of target h\.0\.k"):
        hd.target_dtype(tmp_path, two[1:])
