"""The ztest update: Z as a GEMM equals the explicit per-pair sum; exact thresholds."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from eggroll_dist.shared.config import ESConfig, ModelConfig, RunConfig, UpdateConfig
from eggroll_dist.shared.model import init_params, param_specs
from eggroll_dist.shared.noise import second_moment
from eggroll_dist.shared.perturb import pair_noise
from eggroll_dist.shared.rules.momentum import momentum_gain
from eggroll_dist.shared.rules.ztest import TAIL_2POW32, alpha_at, move_threshold, z_sixteenths
from eggroll_dist.shared.update import accumulate_z, apply_update, initial_opt_state, update_from_z


def _cfg(noise: str = "uniform", population: int = 40) -> RunConfig:
    return RunConfig(
        model=ModelConfig(vocab_size=16, n_layer=1, d_model=8),
        es=ESConfig(population=population, chunk_size=population // 2, seq_len=4, noise=noise),
    )


@pytest.mark.parametrize("noise", ["uniform", "gaussian"])
def test_z_gemm_equals_explicit_per_pair_sum(noise: str) -> None:
    cfg = _cfg(noise)
    rng = np.random.default_rng(0)
    fitness = rng.integers(-1, 2, size=cfg.pairs).astype(np.int8)
    z = accumulate_z(cfg, 3, fitness)
    pn = pair_noise(cfg, param_specs(cfg.model), 3, np.arange(cfg.pairs))
    for spec in param_specs(cfg.model):
        want = np.zeros(spec.shape, dtype=np.int64)
        for k in range(cfg.pairs):
            if spec.kind == "matrix":
                a = pn.a[spec.name][k].astype(np.int64)
                want += int(fitness[k]) * np.outer(a, pn.b[spec.name][k].astype(np.int64))
            else:
                want += int(fitness[k]) * pn.u[spec.name][k].astype(np.int64)
        assert np.array_equal(z[spec.name], want), spec.name


def test_z_accumulates_across_pair_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _cfg(population=64)
    fitness = np.random.default_rng(1).integers(-1, 2, size=cfg.pairs).astype(np.int8)
    whole = accumulate_z(cfg, 0, fitness)
    monkeypatch.setattr("eggroll_dist.shared.update.PAIR_BLOCK", 5)
    blocked = accumulate_z(cfg, 0, fitness)
    for name in whole:
        assert np.array_equal(whole[name], blocked[name])


def test_equal_fitness_gives_no_update() -> None:
    cfg = _cfg()
    params = init_params(cfg.model)
    up = apply_update(cfg, 5, params, {}, np.zeros(cfg.pairs, dtype=np.int8))
    new, changed = up.params, up.changed
    assert changed == 0
    assert all(np.array_equal(new[k], params[k]) for k in params)


def test_update_moves_by_one_where_the_test_passes() -> None:
    cfg = _cfg()
    params = init_params(cfg.model)
    fitness = np.random.default_rng(2).integers(-1, 2, size=cfg.pairs).astype(np.int8)
    step = 50
    up = apply_update(cfg, step, params, {}, fitness)
    new, changed = up.params, up.changed
    z = accumulate_z(cfg, step, fitness)
    threshold = move_threshold(cfg.pairs, alpha_at(cfg.update, step), cfg.es.noise)
    total = 0
    for name, w in params.items():
        move = np.where(np.abs(z[name]) >= threshold, np.sign(z[name]), 0)
        want = np.clip(w.astype(np.int16) + move, -127, 127)
        assert np.array_equal(new[name], want)
        assert np.abs(new[name].astype(np.int16) - w).max() <= 1
        total += int(np.count_nonzero(want != w))
    assert changed == total > 0


def test_alpha_schedule() -> None:
    up = UpdateConfig(alpha=4.0, alpha_decay_steps=1000)
    assert alpha_at(up, 0) == 1
    assert alpha_at(up, 1000) == Fraction(1, 16)
    assert alpha_at(up, 100) == Fraction(1000, 15 * 100 + 1000)
    assert alpha_at(UpdateConfig(alpha=0.25), 12345) == Fraction(1, 4)


def test_tail_table_matches_the_normal_distribution() -> None:
    for k, tail in enumerate(TAIL_2POW32):
        assert abs(tail - 2**32 * math.erfc(k / 16 / math.sqrt(2))) <= 1


def test_z_threshold_and_move_threshold() -> None:
    assert z_sixteenths(Fraction(1)) == 0
    # alpha = 0.05 -> z = 1.96 -> 31.36 sixteenths -> the least k with tail <= 0.05 is 32
    assert z_sixteenths(Fraction(1, 20)) == 32
    assert move_threshold(1000, Fraction(1), "uniform") == 0
    pairs, alpha = 16384, Fraction(1, 20)
    t = move_threshold(pairs, alpha, "uniform")
    exact = 32 / 16 * math.sqrt(pairs) * float(second_moment("uniform"))
    assert t - 1 < exact <= t
    # The least integer: T**2 * 256 >= k**2 * P * m**2 and (T - 1) fails.
    var = second_moment("uniform") ** 2 * pairs * 32 * 32
    assert 256 * t * t >= var > 256 * (t - 1) ** 2


def test_update_rejects_wrong_fitness_shape() -> None:
    cfg = _cfg()
    with pytest.raises(ValueError, match="fitness has shape"):
        apply_update(cfg, 0, init_params(cfg.model), {}, np.zeros(3, dtype=np.int8))


def _momentum_cfg(shift: int = 2) -> RunConfig:
    cfg = _cfg("gaussian")
    return cfg.replace(update=UpdateConfig(rule="momentum", momentum_shift=shift))


def test_momentum_is_the_specified_integer_recurrence() -> None:
    """Per weight, by hand in Python ints: decay, add Z, move past T_M, spend T_M."""
    cfg = _momentum_cfg(shift=2)
    params = init_params(cfg.model)
    opt = initial_opt_state(cfg)
    rng = np.random.default_rng(3)
    for step in range(4):
        fitness = rng.integers(-1, 2, size=cfg.pairs).astype(np.int8)
        z = accumulate_z(cfg, step, fitness)
        t = move_threshold(cfg.pairs, alpha_at(cfg.update, step), "gaussian", momentum_gain(2))
        up = apply_update(cfg, step, params, opt, fitness)
        for name, w in params.items():
            m_old, w_new = opt[f"momentum.{name}"].reshape(-1), up.params[name].reshape(-1)
            m_new = up.opt[f"momentum.{name}"].reshape(-1)
            for i, (m, zi, wi) in enumerate(
                zip(
                    m_old.tolist(),
                    z[name].reshape(-1).tolist(),
                    w.reshape(-1).tolist(),
                    strict=True,
                )
            ):
                sign = (m > 0) - (m < 0)
                m = max(-(2**31 - 1), min(2**31 - 1, m - sign * (abs(m) >> 2) + zi))
                d = ((m > 0) - (m < 0)) if abs(m) >= t else 0
                assert int(w_new[i]) == max(-127, min(127, wi + d))
                assert int(m_new[i]) == m - d * t
        params, opt = up.params, up.opt
    assert any(np.count_nonzero(v) for v in opt.values())


def test_momentum_threshold_scales_with_the_accumulated_variance() -> None:
    assert momentum_gain(1) == Fraction(4, 3)  # 1 / (1 - (1/2)**2)
    assert momentum_gain(3) == Fraction(64, 15)  # 1 / (1 - (7/8)**2)
    alpha = Fraction(1, 20)
    plain = move_threshold(4096, alpha, "gaussian")
    for shift in (1, 3, 6):
        t = move_threshold(4096, alpha, "gaussian", momentum_gain(shift))
        assert abs(t - plain * math.sqrt(float(momentum_gain(shift)))) <= 2


def test_momentum_moves_a_weight_that_a_steady_small_signal_never_moves() -> None:
    """The same sub-threshold Z every step: ztest never moves, momentum does."""
    cfg = _momentum_cfg(shift=3)
    params = {n: np.zeros_like(w) for n, w in init_params(cfg.model).items()}
    t_plain = move_threshold(cfg.pairs, alpha_at(cfg.update, 10), "gaussian")
    z = {n: np.full(w.shape, t_plain // 2, dtype=np.int64) for n, w in params.items()}
    plain = update_from_z(cfg.replace(update=UpdateConfig()), 10, params, {}, z)
    assert plain.changed == 0
    opt = initial_opt_state(cfg)
    moved = 0
    for _ in range(20):
        up = update_from_z(cfg, 10, params, opt, z)
        params, opt, moved = up.params, up.opt, moved + up.changed
    assert moved > 0 and all((w >= 0).all() for w in params.values())
