"""The EGG model: the rank-1 forward against an explicit per-member `W + a b^T` reference,
and the exact integer log-softmax."""

from __future__ import annotations

from math import isqrt

import numpy as np
import pytest

from eggroll_dist.shared.config import ESConfig, ModelConfig, RunConfig
from eggroll_dist.shared.egg import EggModel
from eggroll_dist.shared.loss import (
    exp2_table,
    floor_log2_16,
    log2_thresholds,
    token_loss,
    true_bits,
)
from eggroll_dist.shared.model import init_params, param_specs
from eggroll_dist.shared.perturb import member_noise, pair_noise


def _small_config(noise: str = "uniform", sigma_shift: int = 2) -> RunConfig:
    return RunConfig(
        model=ModelConfig(vocab_size=16, n_layer=2, d_model=8, init_seed=3),
        es=ESConfig(population=8, chunk_size=8, seq_len=6, sigma_shift=sigma_shift, noise=noise),
    )


def _reference_member_loss(cfg, params, noise, k: int, sign: int, tokens: np.ndarray) -> int:
    """One member, written out plainly with an explicit perturbed copy of every weight."""
    shift = 4 + cfg.es.sigma_shift
    specs = {s.name: s for s in param_specs(cfg.model)}

    def weight(name: str) -> np.ndarray:  # 2**shift * W + sign * a b^T, exact int64
        w = params[name].astype(np.int64) << shift
        return w + sign * np.outer(noise.a[name][k].astype(np.int64), noise.b[name][k])

    def vector(name: str) -> np.ndarray:
        delta = (sign * noise.u[name][k].astype(np.int64)) >> shift
        return np.clip(params[name].astype(np.int64) + delta, -127, 127)

    def mm(x: np.ndarray, name: str) -> np.ndarray:
        acc = (weight(name) @ x) >> shift  # floor((2**s W x + (a b^T) x) / 2**s)
        return np.clip(acc // (16 * isqrt(specs[name].shape[1])), -127, 127)

    def ln(x: np.ndarray, name: str) -> np.ndarray:
        mav = max(int(np.abs(x).sum()) // len(x), 1)
        return np.clip((x * vector(name)) // mav, -127, 127)

    d = cfg.model.d_model
    states = [np.zeros(d, dtype=np.int64) for _ in range(cfg.model.n_layer)]
    total = 0
    emb = weight("emb")
    for t in range(len(tokens) - 1):
        x = np.clip(emb[tokens[t]] >> shift, -127, 127)
        for i in range(cfg.model.n_layer):
            p = f"layers.{i}."
            s = states[i] if tokens[t] != 0 else np.zeros(d, dtype=np.int64)
            h = ln(x, p + "ln1")
            f = np.clip(mm(h, p + "wf") + mm(s, p + "uf") + vector(p + "bf"), -127, 127)
            g = ((f + 127) * s) >> 8
            c = np.clip(mm(h, p + "wh") + mm(g, p + "uh") + vector(p + "bh"), -127, 127)
            s = s + (((f + 127) * (c - s)) >> 8)
            states[i] = s
            x = np.clip(x + s, -127, 127)
            x = np.clip(x + mm(mm(ln(x, p + "ln2"), p + "w1"), p + "w2"), -127, 127)
        logits = mm(ln(x, "ln_out"), "head")
        total += int(token_loss(logits[None, :], np.array([tokens[t + 1]]))[0])
    return total


@pytest.mark.parametrize(
    "noise_kind,sigma_shift", [("uniform", 2), ("gaussian", 4), ("uniform", 0)]
)
def test_rank1_forward_equals_explicit_perturbed_weights(noise_kind: str, sigma_shift: int) -> None:
    cfg = _small_config(noise_kind, sigma_shift)
    params = init_params(cfg.model)
    # Make the vectors non-trivial so their noise path is exercised too.
    rng = np.random.default_rng(0)
    for spec in param_specs(cfg.model):
        if spec.kind == "vector":
            params[spec.name] = rng.integers(-40, 41, size=spec.shape).astype(np.int8)
    pairs = np.array([0, 5, 17, 123])
    pn = pair_noise(cfg, param_specs(cfg.model), 11, pairs)
    tokens = rng.integers(0, 16, size=(len(pairs), cfg.es.seq_len + 1))
    tokens[1, 3] = 0  # a document boundary resets the state
    model = EggModel(cfg, params)
    loss, _ = model.forward(np.repeat(tokens, 2, axis=0), member_noise(pn, params, sigma_shift))
    for k in range(len(pairs)):
        for j, sign in enumerate((1, -1)):
            want = _reference_member_loss(cfg, params, pn, k, sign, tokens[k])
            assert loss[2 * k + j] == want


def test_unperturbed_forward_equals_zero_noise_reference() -> None:
    cfg = _small_config()
    params = init_params(cfg.model)
    tokens = np.random.default_rng(1).integers(0, 16, size=(3, cfg.es.seq_len + 1))
    pn = pair_noise(cfg, param_specs(cfg.model), 0, np.arange(3))
    zero = type(pn)(
        pn.pairs,
        {k: v * 0 for k, v in pn.a.items()},
        {k: v * 0 for k, v in pn.b.items()},
        {k: v * 0 for k, v in pn.u.items()},
    )
    loss, _ = EggModel(cfg, params).forward(tokens)
    for k in range(3):
        assert loss[k] == _reference_member_loss(cfg, params, zero, k, 1, tokens[k])


def test_antithetic_members_differ() -> None:
    cfg = _small_config()
    params = init_params(cfg.model)
    pn = pair_noise(cfg, param_specs(cfg.model), 0, np.arange(4))
    tokens = np.repeat(np.random.default_rng(2).integers(0, 16, size=(4, 7)), 2, axis=0)
    loss, _ = EggModel(cfg, params).forward(tokens, member_noise(pn, params, 2))
    assert np.any(loss[0::2] != loss[1::2])


def test_floor_log2_16_is_exact() -> None:
    rng = np.random.default_rng(0)
    s = np.concatenate(
        [
            np.arange(1, 5000),
            2 ** np.arange(0, 52),
            2 ** np.arange(1, 52) - 1,
            rng.integers(1, 2**40, size=5000),
        ]
    ).astype(np.int64)
    got = floor_log2_16(s)
    for value, k in zip(s.tolist(), got.tolist(), strict=True):
        # k = floor(16 log2 s)  <=>  2**k <= s**16 < 2**(k+1)
        assert 1 << k <= value**16 < 1 << (k + 1)


def test_loss_tables_are_read_only() -> None:
    """Cached and shared by every model in the process: nobody may change them."""
    for table in (exp2_table(), log2_thresholds()):
        assert not table.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            table[0] = 0


def test_token_loss_tracks_true_log_softmax() -> None:
    rng = np.random.default_rng(0)
    logits = rng.integers(-127, 128, size=(2000, 256))
    targets = rng.integers(0, 256, size=2000)
    integer = token_loss(logits, targets) / 16
    exact = true_bits(logits, targets)
    assert np.all(np.abs(integer - exact) < 0.2)
    assert abs(float(np.mean(integer - exact))) < 0.1


def test_init_params_are_int8_in_range_and_deterministic() -> None:
    cfg = _small_config()
    a, b = init_params(cfg.model), init_params(cfg.model)
    for spec in param_specs(cfg.model):
        assert a[spec.name].dtype == np.int8 and a[spec.name].shape == spec.shape
        assert np.array_equal(a[spec.name], b[spec.name])
        assert a[spec.name].min() >= -127
    other = init_params(ModelConfig(vocab_size=16, n_layer=2, d_model=8, init_seed=4))
    assert not np.array_equal(a["emb"], other["emb"])
