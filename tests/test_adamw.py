"""The adamw rule: every fixed-point operation against Python integers, exactly."""

from __future__ import annotations

import itertools
import math
from decimal import Decimal, localcontext
from fractions import Fraction
from functools import cache

import numpy as np
import pytest

from eggroll_dist.shared.config import (
    ConfigError,
    ESConfig,
    ModelConfig,
    RunConfig,
    UpdateConfig,
)
from eggroll_dist.shared.model import init_params, param_specs
from eggroll_dist.shared.noise import max_abs
from eggroll_dist.shared.rules.adamw import (
    ACC_LIMIT,
    R_LIMIT,
    bias_correction,
    grad_shift,
    lr_at,
)
from eggroll_dist.shared.rules.fixedpoint import ONE, fixed16, isqrt_array
from eggroll_dist.shared.update import (
    accumulate_z,
    apply_update,
    initial_opt_state,
    state_specs,
    update_from_z,
)


def _cfg(population: int = 40, **update: object) -> RunConfig:
    return RunConfig(
        model=ModelConfig(vocab_size=16, n_layer=1, d_model=8),
        es=ESConfig(population=population, chunk_size=population // 2, seq_len=4),
        update=UpdateConfig(rule="adamw", **update),  # type: ignore[arg-type]
    )


_k = cache(bias_correction)  # the reference calls it once per weight


def _sshift(x: int, s: int) -> int:
    return (1 if x > 0 else -1 if x < 0 else 0) * (abs(x) >> s)


def reference_weight(
    up: UpdateConfig, step: int, gs: int, matrix: bool, z: int, w: int, m: int, v: int, acc: int
) -> tuple[int, int, int, int]:
    """One weight's adamw step in Python ints, written from the spec, line by line."""
    b1, b2 = round(up.beta1 * 2**16), round(up.beta2 * 2**16)
    wd, lr = round(up.weight_decay * 2**16), round(up.lr * 2**16)
    lr >>= min(step // up.lr_halve_steps, up.lr_halvings)
    k = _k(up, step)
    g = _sshift(z, gs)
    m = _sshift(m * b1 + g * (2**16 - b1), 16)
    v = (v * b2 + g * g * (2**16 - b2)) >> 16
    u = (1 if m > 0 else -1 if m < 0 else 0) * ((abs(m) << 16) // (math.isqrt(v) + 1))
    r = max(-(2**30), min(2**30, _sshift(u * k, 16)))
    d = wd * w if matrix else 0
    acc += _sshift(lr * (r - d), 16)
    if acc >= 2**16:
        if w < 127:
            w, acc = w + 1, acc - 2**16
        else:
            acc = 2**16
    elif acc <= -(2**16):
        if w > -127:
            w, acc = w - 1, acc + 2**16
        else:
            acc = -(2**16)
    return w, m, v, max(-(2**31 - 1), min(2**31 - 1, acc))


def reference_update(cfg: RunConfig, step: int, params, opt, z):
    """The whole rule as a per-weight loop over Python ints."""
    gs, up = grad_shift(cfg), cfg.update
    new, new_opt = {}, {}
    for spec in param_specs(cfg.model):
        n = spec.name
        cols = [
            x.reshape(-1).tolist()
            for x in (z[n], params[n], opt[f"adamw.m.{n}"], opt[f"adamw.v.{n}"])
        ]
        accs = opt[f"adamw.acc.{n}"].reshape(-1).tolist()
        out = [
            reference_weight(up, step, gs, spec.kind == "matrix", zi, wi, mi, vi, ai)
            for zi, wi, mi, vi, ai in zip(*cols, accs, strict=True)
        ]
        new[n] = np.array([o[0] for o in out], dtype=np.int8).reshape(spec.shape)
        for i, part in enumerate(("m", "v", "acc"), start=1):
            new_opt[f"adamw.{part}.{n}"] = np.array([o[i] for o in out]).reshape(spec.shape)
    return new, new_opt


def _assert_same(got, want_params, want_opt) -> None:
    for name, w in want_params.items():
        assert np.array_equal(got.params[name], w), name
    for name, s in want_opt.items():
        assert got.opt[name].dtype == initial_opt_state_dtype(name)
        assert np.array_equal(got.opt[name].astype(np.int64), s), name


def initial_opt_state_dtype(name: str) -> np.dtype:
    return np.dtype(np.int64 if name.startswith("adamw.v.") else np.int32)


def test_the_config_floats_become_exact_integers() -> None:
    up = UpdateConfig()
    assert (fixed16(up.beta1), fixed16(up.beta2)) == (58982, 62259)  # 58982.4, 62259.2
    assert (fixed16(up.weight_decay), fixed16(up.lr)) == (655, 32768)  # 655.36, 0.5
    assert fixed16(0.5 / 65536) == 0 and fixed16(1.5 / 65536) == 2  # half to even
    # d-eggs' schedule: 0.5 below step 100, 0.25 below 200, 0.125 from there on
    assert [lr_at(up, s) for s in (0, 99, 100, 199, 200, 10**6)] == [
        32768,
        32768,
        16384,
        16384,
        8192,
        8192,
    ]
    assert lr_at(UpdateConfig(lr=1.0, lr_halve_steps=10, lr_halvings=0), 500) == ONE


def test_the_gradient_shift_keeps_g_below_2_to_the_20() -> None:
    for pairs, noise in (
        (20, "uniform"),
        (1024, "uniform"),
        (163840, "uniform"),
        (1 << 20, "gaussian"),
    ):
        cfg = RunConfig(es=ESConfig(population=2 * pairs, chunk_size=2 * pairs, noise=noise))
        bound = pairs * max_abs(noise) ** 2
        gs = grad_shift(cfg)
        assert bound >> gs < 1 << 20 and (gs == 0 or bound >> (gs - 1) >= 1 << 20)
    assert grad_shift(RunConfig(es=ESConfig(population=2048, chunk_size=512))) == 0
    d_eggs = RunConfig(es=ESConfig(population=327680, chunk_size=40960))
    assert grad_shift(d_eggs) == 6  # 163840 * 225 < 2**26


def _k_decimal(b1: int, b2: int, t: int) -> int:
    """round half up of 2**16 * sqrt(1 - b2**t) / (1 - b1**t), to 120 digits."""
    with localcontext() as ctx:
        ctx.prec = 120
        x = 1 - (Decimal(b2) / 65536) ** t
        y = 1 - (Decimal(b1) / 65536) ** t
        value = 65536 * x.sqrt() / y
        return int((value + Decimal("0.5")).to_integral_value(rounding="ROUND_FLOOR"))


@pytest.mark.parametrize(
    "betas", [(0.9, 0.95), (0.0, 0.5), (0.5, 0.0), (0.999, 0.999), (0.99, 0.9)]
)
def test_bias_correction_is_the_exact_rounded_value(betas: tuple[float, float]) -> None:
    up = UpdateConfig(beta1=betas[0], beta2=betas[1])
    b1, b2 = fixed16(betas[0]), fixed16(betas[1])
    steps = [*range(0, 400), 1000, 5000, 13757, 13758, 20000]
    for step in steps:
        assert bias_correction(up, step) == _k_decimal(b1, b2, step + 1), step
    assert bias_correction(up, 10**6) == ONE


def test_bias_correction_of_the_first_steps_by_hand() -> None:
    up = UpdateConfig()
    # t = 1: sqrt(1 - b2) / (1 - b1) = sqrt(3277 / 65536) / (6554 / 65536) = 2.23601...
    assert bias_correction(up, 0) == 146538
    exact = Fraction(3277, 65536) / Fraction(6554, 65536) ** 2  # K**2
    assert (146538 - Fraction(1, 2)) ** 2 <= exact * 2**32 < (146538 + Fraction(1, 2)) ** 2
    # beta1 < beta2: the first moment's correction fades first, so K dips below 1 (at t = 20)
    # and rises back to 1, where it stays once rounded
    ks = [bias_correction(up, s) for s in range(300)]
    low = ks.index(min(ks))
    assert low == 19 and ks[low] == 59756 and ks[-1] == ONE
    assert all(a > b for a, b in itertools.pairwise(ks[: low + 1]))
    assert all(a <= b for a, b in itertools.pairwise(ks[low:]))


def test_isqrt_array_is_exact_near_squares_and_at_the_bound() -> None:
    rng = np.random.default_rng(0)
    roots = np.concatenate(
        [np.arange(0, 3000), rng.integers(0, 1 << 26, 3000), [(1 << 26) - 1, (1 << 26) - 2]]
    ).astype(np.int64)
    values = np.concatenate([roots * roots + d for d in (-1, 0, 1)])
    values = np.concatenate([values[values >= 0], [(1 << 52) - 1, (1 << 52) - 2, 1 << 51]])
    values = np.concatenate([values, rng.integers(0, 1 << 52, 5000)])
    got = isqrt_array(values)
    assert got.dtype == np.int64
    assert got.tolist() == [math.isqrt(int(v)) for v in values]


def test_one_weight_for_a_few_steps_golden() -> None:
    """Pinned numbers (a CUDA port must reproduce them): Z = 1000 every step on a matrix
    weight at 10, defaults. Step 0 by hand: g = 1000; m = 6554000 >> 16 = 100;
    v = 3277000000 >> 16 = 50003; isqrt = 223; u = 6553600 // 224 = 29257;
    r = 29257 * 146538 >> 16 = 65418; s = 32768 * (65418 - 6550) >> 16 = 29434."""
    up = UpdateConfig()
    state = (10, 0, 0, 0)
    seq = []
    for step in range(6):
        state = reference_weight(up, step, 0, True, 1000, *state)
        seq.append(state)
    assert seq == [
        (10, 100, 50003, 29434),
        (10, 190, 97505, 58847),
        (11, 271, 142632, 22773),  # acc crossed 2**16: one step up, 2**16 spent
        (11, 343, 185503, 51828),
        (12, 408, 226230, 15309),
        (12, 467, 264920, 44017),
    ]
    # the vectorised rule gives the same sequence
    cfg = _cfg()
    params = {n: np.full(w.shape, 10, np.int8) for n, w in init_params(cfg.model).items()}
    opt = initial_opt_state(cfg)
    z = {n: np.full(w.shape, 1000, np.int64) for n, w in params.items()}
    for step in range(6):
        upd = update_from_z(cfg, step, params, opt, z)
        params, opt = upd.params, upd.opt
        got = (
            int(params["head"][0, 0]),
            int(opt["adamw.m.head"][0, 0]),
            int(opt["adamw.v.head"][0, 0]),
            int(opt["adamw.acc.head"][0, 0]),
        )
        assert got == seq[step], step


def _random_state(cfg: RunConfig, rng: np.random.Generator):
    """Weights and adamw state across their whole ranges, saturation included."""
    params, opt = {}, {}
    for spec in param_specs(cfg.model):
        n, shape = spec.name, spec.shape
        params[n] = rng.choice([-127, -126, -1, 0, 1, 5, 126, 127], size=shape).astype(np.int8)
        opt[f"adamw.m.{n}"] = rng.integers(-(1 << 20) + 1, 1 << 20, shape).astype(np.int32)
        opt[f"adamw.v.{n}"] = rng.integers(0, 1 << 40, shape).astype(np.int64)
        opt[f"adamw.v.{n}"].reshape(-1)[:3] = 0
        opt[f"adamw.acc.{n}"] = rng.choice(
            [0, ONE - 1, ONE, -ONE, 3 * ONE, -ACC_LIMIT, ACC_LIMIT], size=shape
        ).astype(np.int32)
    return params, opt


@pytest.mark.parametrize("step", [0, 1, 150, 5000])
@pytest.mark.parametrize(
    "update", [{}, {"beta1": 0.999, "beta2": 0.0, "lr": 16.0, "weight_decay": 1.0}]
)
def test_the_vectorised_rule_equals_the_per_weight_reference(step: int, update: dict) -> None:
    cfg = _cfg(**update)
    rng = np.random.default_rng(step)
    params, opt = _random_state(cfg, rng)
    bound = cfg.pairs * max_abs(cfg.es.noise) ** 2
    z = {n: rng.integers(-bound, bound + 1, w.shape) for n, w in params.items()}
    for n in z:  # the extremes
        z[n].reshape(-1)[:2] = (bound, -bound)
    got = update_from_z(cfg, step, params, opt, z)
    want_params, want_opt = reference_update(cfg, step, params, opt, z)
    _assert_same(got, want_params, want_opt)
    moved = sum(int(np.count_nonzero(w != params[n])) for n, w in want_params.items())
    assert got.changed == moved > 0


def test_real_steps_equal_the_reference_and_state_stays_in_its_bounds() -> None:
    cfg = _cfg()
    params, opt = init_params(cfg.model), initial_opt_state(cfg)
    rng = np.random.default_rng(5)
    for step in range(4):
        fitness = rng.integers(-1, 2, cfg.pairs).astype(np.int8)
        z = accumulate_z(cfg, step, fitness)
        got = apply_update(cfg, step, params, opt, fitness)
        _assert_same(got, *reference_update(cfg, step, params, opt, z))
        params, opt = got.params, got.opt
    for name, s in opt.items():
        limit = {"m": 1 << 20, "v": 1 << 40, "acc": ACC_LIMIT + 1}[name.split(".")[1]]
        assert np.abs(s.astype(np.int64)).max() < limit
    assert R_LIMIT == 1 << 30


def test_flipping_every_sign_mirrors_the_state_exactly() -> None:
    """The rule is odd in (Z, w, m, acc): no floor bias toward -infinity."""
    cfg = _cfg()
    rng = np.random.default_rng(9)
    params, opt = _random_state(cfg, rng)
    z = {n: rng.integers(-9000, 9000, w.shape) for n, w in params.items()}
    neg_opt = {k: (v if ".v." in k else -v) for k, v in opt.items()}
    a = update_from_z(cfg, 3, params, opt, z)
    b = update_from_z(
        cfg, 3, {n: -w for n, w in params.items()}, neg_opt, {n: -x for n, x in z.items()}
    )
    for n, w in a.params.items():
        assert np.array_equal(b.params[n], -w)
    for k, v in a.opt.items():
        assert np.array_equal(b.opt[k], v if ".v." in k else -v)


def test_weight_decay_spares_vector_parameters() -> None:
    """With Z = 0 only the decay acts: matrices shrink toward 0, norm gains and biases stay."""
    cfg = _cfg()
    params, opt = init_params(cfg.model), initial_opt_state(cfg)
    z = {n: np.zeros(w.shape, np.int64) for n, w in params.items()}
    start = params
    for step in range(40):
        up = update_from_z(cfg, step, params, opt, z)
        params, opt = up.params, up.opt
    for spec in param_specs(cfg.model):
        w0, w = start[spec.name].astype(np.int16), params[spec.name].astype(np.int16)
        if spec.kind == "vector":
            assert np.array_equal(w, w0) and not opt[f"adamw.acc.{spec.name}"].any()
        else:
            assert (np.abs(w) <= np.abs(w0)).all() and (np.sign(w) * np.sign(w0) >= 0).all()
            assert (np.abs(w) < np.abs(w0))[np.abs(w0) >= 16].all()  # 40 steps moved these


def test_state_layout() -> None:
    cfg = _cfg()
    specs = state_specs(cfg)
    names = [s.name for s in specs]
    assert names[:3] == ["adamw.m.emb", "adamw.v.emb", "adamw.acc.emb"]
    assert len(names) == 3 * len(param_specs(cfg.model))
    assert {np.dtype(s.dtype) for s in specs} == {np.dtype(np.int32), np.dtype(np.int64)}
    assert all(not v.any() for v in initial_opt_state(cfg).values())


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("beta1", 1.0, "beta1"),
        ("beta2", -0.1, "beta2"),
        ("beta1", float("nan"), "beta1"),
        ("lr", 0.0, "update.lr"),
        ("lr", 17.0, "update.lr"),
        ("weight_decay", 1.5, "weight_decay"),
        ("lr_halve_steps", 0, "lr_halve_steps"),
        ("lr_halvings", 17, "lr_halvings"),
    ],
)
def test_bad_adamw_settings_are_one_clear_line(key: str, value: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        _cfg(**{key: value})
    assert "\n" not in str(info.value)
