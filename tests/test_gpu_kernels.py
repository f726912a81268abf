"""Every kernel but the former's (noise.cu, gemm.cu, egg.cu, loss.cu, rules.cu, digest.cu)
equals the NumPy reference of shared/, byte for byte.

By default the kernels run through their CPU build (tests/cudaemu), once per thread order;
kernel_target.py says how the same tests run on a GPU or under the sanitizer. Shapes are
small but cover partial tiles, odd divisors, clipping at both ends and both noise kinds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
from math import isqrt
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_target import (
    CPU_BUILD_MISSING,
    ON_GPU,
    SANITIZE,
    VARIANTS,
    array_module,
    cdiv,
    dev,
    kernels,
    poisoned,
    to_host,
)

from eggroll_dist.shared.config import ESConfig, ModelConfig, RunConfig, UpdateConfig
from eggroll_dist.shared.egg import EggModel
from eggroll_dist.shared.loss import exp2_table, log2_thresholds, token_loss
from eggroll_dist.shared.model import init_params, param_specs
from eggroll_dist.shared.noise import DOMAIN_DATA, DOMAIN_NOISE, NOISE_KINDS, hash_key
from eggroll_dist.shared.perturb import (
    TOKEN_TENSORS,
    ParamSpec,
    member_noise,
    noise_scales,
    overlay_specs,
    pair_noise,
    update_overlays,
)
from eggroll_dist.shared.update import accumulate_z
from eggroll_dist.shared.window import pair_windows
from eggroll_dist.worker.backend.cupy_backend import PAIR_PAD, vector_split, z_split
from eggroll_dist.worker.backend.cupy_kernels import (
    SIGNATURES,
    STAGE_WORDS,
    TENSOR_CORE_KERNELS,
    TILE_M,
    TILE_N,
    Kernels,
)

pytestmark = pytest.mark.skipif(bool(CPU_BUILD_MISSING), reason=str(CPU_BUILD_MISSING))
xp = array_module()
i32, u32, u64 = np.int32, np.uint32, np.uint64
GEMM_SUFFIXES = ("_tc", "_dp4a")  # the tensor-core kernels and their __dp4a twins


@pytest.fixture(scope="module", params=VARIANTS)
def k(request: pytest.FixtureRequest) -> Kernels:
    return kernels(request.param)


def cfg_for(noise: str = "uniform", d: int = 36, vocab: int = 50) -> RunConfig:
    return RunConfig(
        model=ModelConfig(n_layer=1, d_model=d, vocab_size=vocab),
        es=ESConfig(population=70, chunk_size=70, seq_len=4, noise=noise, run_seed=99),
    )


def key_dev(cfg: RunConfig, step: int):
    return dev(np.array([hash_key(DOMAIN_NOISE, cfg.es.run_seed, step)], dtype=np.uint64))


def zgemm(k: Kernels, suffix: str, x, w, k_split: int, z, zero: bool = True) -> None:
    """z = x w^T through the split-K update GEMM (zeroed first, as the backend does), or
    z += x w^T (zero False: a later slab of pairs)."""
    (m, kk), n = x.shape, w.shape[0]
    assert z.dtype == np.int64  # zeroed as int32 words: two a sum
    if zero:
        k("zero_i32", (cdiv(2 * m * n, 256),), (256,), z.reshape(-1).view(np.int32), i32(2 * m * n))
    grid = (cdiv(n, TILE_N), cdiv(m, TILE_M), cdiv(kk // 4, k_split))
    k("zgemm" + suffix, grid, (256,), x, w, i32(m), i32(n), i32(kk), i32(k_split), z)


# ------------------------------------------------------------------------------ noise


def scaled_cfg(noise: str) -> RunConfig:
    """cfg_for with adaptive noise and token noise (the 20 commonest tokens' rows)."""
    cfg = cfg_for(noise)
    return cfg.replace(es=dataclasses.replace(cfg.es, adaptive_noise=True, token_noise_rows=20))


def random_overlays(cfg: RunConfig) -> dict[str, np.ndarray]:
    """Overlays anywhere in their range: factors clip at 0 and at 64."""
    rng = np.random.default_rng(21)
    return {
        s.name: rng.integers(-127, 128, size=s.shape).astype(np.int8)
        for s in overlay_specs(param_specs(cfg.model))
    }


def overlay_of(overlays: dict, name: str):
    return dev(overlays[name]) if name in overlays else xp.zeros(0, dtype=xp.int8)


@pytest.mark.parametrize("scaled", [False, True], ids=["full", "scaled"])
@pytest.mark.parametrize("noise", NOISE_KINDS)
def test_noise_rows_and_member_vectors(k: Kernels, noise: str, scaled: bool) -> None:
    """Every tensor's noise, and with scales (adaptive overlays, token rows) each value
    scaled by its row's, column's or element's factor."""
    cfg, step = (scaled_cfg if scaled else cfg_for)(noise), 7
    specs = param_specs(cfg.model)
    overlays = random_overlays(cfg) if scaled else {}
    scales = noise_scales(cfg, specs, overlays)
    pairs = np.array([0, 3, 1 << 20, 12345, 35], dtype=np.int64)
    pn = pair_noise(cfg, specs, step, pairs, scales)
    params = init_params(cfg.model)
    params["layers.0.bf"] = np.arange(-18, 18, dtype=np.int8) * 7  # clipping at both ends
    mn = member_noise(pn, params, cfg.es.sigma_shift)
    kind = i32(NOISE_KINDS.index(noise))
    token_rows = cfg.es.token_noise_rows or 1 << 30
    for spec in specs:
        tid = u64(spec.tensor_id)
        if spec.kind == "matrix":
            out, inp = spec.shape
            kept = min(out, token_rows) if spec.name in TOKEN_TENSORS else out
            for start, count, keep, axis, want in (
                (0, out, kept, "rows", pn.a[spec.name]),
                (out, inp, inp, "cols", pn.b[spec.name]),
            ):
                got = poisoned((len(pairs), count), np.int8)
                k(
                    "noise_rows",
                    (len(pairs), cdiv(count, 256)),
                    (256,),
                    *(key_dev(cfg, step), dev(pairs), tid, u32(start), i32(count), i32(keep)),
                    *(kind, overlay_of(overlays, f"overlay.{axis}.{spec.name}"), got),
                )
                assert np.array_equal(to_host(got), want), (spec.name, axis)
            continue
        (n,) = spec.shape
        got = poisoned((2 * len(pairs), n), np.int8)
        k(
            "member_vector",
            (2 * len(pairs), cdiv(n, 256)),
            (256,),
            *(key_dev(cfg, step), dev(pairs), tid, i32(n), i32(n), kind),
            *(overlay_of(overlays, f"overlay.{spec.name}"), dev(params[spec.name])),
            *(i32(4 + cfg.es.sigma_shift), got),
        )
        assert np.array_equal(to_host(got), mn.vectors[spec.name]), spec.name
    # token noise on a vector (a head bias's elements): none from `keep` on
    spec = next(s for s in specs if s.kind == "vector")
    (n,) = spec.shape
    got = poisoned((2 * len(pairs), n), np.int8)
    k(
        "member_vector",
        (2 * len(pairs), cdiv(n, 256)),
        (256,),
        *(key_dev(cfg, step), dev(pairs), u64(spec.tensor_id), i32(n), i32(n // 3), kind),
        *(overlay_of(overlays, f"overlay.{spec.name}"), dev(params[spec.name])),
        *(i32(4 + cfg.es.sigma_shift), got),
    )
    want = np.where(np.arange(n) < n // 3, mn.vectors[spec.name], params[spec.name])
    assert np.array_equal(to_host(got), want)


@pytest.mark.parametrize("scaled", [False, True], ids=["full", "scaled"])
@pytest.mark.parametrize("noise", NOISE_KINDS)
def test_update_noise_gemm_and_vector_z(k: Kernels, noise: str, scaled: bool) -> None:
    """Z of every tensor from the same (scaled) noise the members saw."""
    cfg, step = (scaled_cfg if scaled else cfg_for)(noise), 3
    specs = param_specs(cfg.model)
    overlays = random_overlays(cfg) if scaled else {}
    scales = noise_scales(cfg, specs, overlays)
    rng = np.random.default_rng(5)
    fitness = rng.choice(np.array([-1, 0, 1], dtype=np.int8), size=cfg.pairs)
    want_z = accumulate_z(cfg, step, fitness, scales)
    kind = i32(NOISE_KINDS.index(noise))
    ppad = cdiv(cfg.pairs, PAIR_PAD) * PAIR_PAD
    token_rows = cfg.es.token_noise_rows or 1 << 30
    for spec in specs:
        tid, size = u64(spec.tensor_id), int(np.prod(spec.shape))
        z = poisoned(spec.shape, np.int64)
        rows = spec.shape[0]
        kept = min(rows, token_rows) if spec.name in TOKEN_TENSORS else rows
        if spec.kind == "vector":
            # all pairs in one block row, and pairs split over block rows (atomics); token
            # noise: the elements from `keep` on get no vote
            for per, block_rows, keep in (
                (cdiv(cfg.pairs, 256) * 256, 1, size),
                (16, cdiv(cfg.pairs, 16), size),
                (16, cdiv(cfg.pairs, 16), size // 3),
            ):
                k(
                    "zero_i32",
                    (cdiv(2 * size, 256),),
                    (256,),
                    z.reshape(-1).view(np.int32),
                    i32(2 * size),
                )
                k(
                    "vector_z",
                    (cdiv(size, 256), block_rows),
                    (256,),
                    *(key_dev(cfg, step), tid, i32(size), i32(keep), kind),
                    *(overlay_of(overlays, f"overlay.{spec.name}"), dev(fitness)),
                    *(i32(cfg.pairs), i32(per), z),
                )
                want = np.where(np.arange(size) < keep, want_z[spec.name], 0)
                assert np.array_equal(to_host(z), want), (spec.name, per, keep)
            continue
        out, inp = spec.shape
        pn = pair_noise(cfg, specs, step, np.arange(cfg.pairs), scales)
        want_at = np.zeros((out, ppad), np.int8)
        want_at[:, : cfg.pairs] = (pn.a[spec.name] * fitness[:, None]).T
        # the whole K at once, and two slabs of 32 pairs (the second past the last pair)
        # whose Z GEMMs add into one Z
        for slabs in ([(0, ppad)], [(0, 32), (32, 32)]):
            pieces = []
            for first, width in slabs:
                at = poisoned((out, width), np.int8)
                bt = poisoned((inp, width), np.int8)
                for start, count, keep, axis, weight, dst in (
                    (0, out, kept, "rows", dev(fitness), at),
                    (out, inp, inp, "cols", xp.zeros(0, dtype=xp.int8), bt),
                ):
                    k(
                        "noise_cols",
                        (cdiv(width, 128), cdiv(count, 64)),
                        (128,),
                        *(key_dev(cfg, step), tid, u32(start), i32(count), i32(keep), kind),
                        *(overlay_of(overlays, f"overlay.{axis}.{spec.name}"), weight),
                        *(i32(cfg.pairs), i32(first), i32(width), dst),
                    )
                pieces.append((at, bt))
            assert np.array_equal(np.hstack([to_host(a) for a, _ in pieces]), want_at)
            for suffix in GEMM_SUFFIXES:
                for i, (at, bt) in enumerate(pieces):
                    zgemm(k, suffix, at, bt, STAGE_WORDS, z, zero=i == 0)
                assert np.array_equal(to_host(z), want_z[spec.name]), (spec.name, suffix)


def test_overlay_step_is_the_reference(k: Kernels) -> None:
    """overlay_step after an update that moved some weights: rows and columns (a matrix)
    and elements (a vector) rise where anything moved, fall elsewhere, within +-127."""
    rng = np.random.default_rng(22)
    specs = (
        ParamSpec("m", (70, 300), "matrix", "zero", 0),
        ParamSpec("v", (300,), "vector", "zero", 1),
    )
    old = {s.name: rng.integers(-127, 128, size=s.shape).astype(np.int8) for s in specs}
    new = {name: w.copy() for name, w in old.items()}
    new["m"][rng.random((70, 300)) < 0.002] += 1  # a few rows and columns move
    new["v"][::7] -= 1
    state = {
        s.name: rng.choice(np.array([-127, -126, 0, 64, 123, 126, 127], np.int8), size=s.shape)
        for s in overlay_specs(specs)
    }
    want = update_overlays(specs, old, new, state)
    for spec in specs:
        moved = dev((new[spec.name] != old[spec.name]).astype(np.int8))
        if spec.kind == "matrix":
            rows, cols = spec.shape
            ovs = [dev(state[f"overlay.{a}.m"]) for a in ("rows", "cols")]
        else:
            rows, cols = spec.shape[0], 1
            ovs = [dev(state["overlay.v"]), xp.zeros(0, dtype=xp.int8)]
        k("overlay_step", (cdiv(rows + cols, 256),), (256,), moved, i32(rows), i32(cols), *ovs)
        if spec.kind == "matrix":
            assert np.array_equal(to_host(ovs[0]), want["overlay.rows.m"])
            assert np.array_equal(to_host(ovs[1]), want["overlay.cols.m"])
        else:
            assert np.array_equal(to_host(ovs[0]), want["overlay.v"])


def test_ztest_apply_with_changed_count(k: Kernels) -> None:
    rng = np.random.default_rng(11)
    n = 10_000 + 17
    z = rng.integers(-300, 301, size=n).astype(np.int32)
    z[:50] = 0
    w = rng.integers(-127, 128, size=n).astype(np.int8)
    w[50:100], w[100:150] = 127, -127
    threshold = 77
    want = np.clip(w + np.where(np.abs(z) >= threshold, np.sign(z), 0), -127, 127)
    got, changed, moved = dev(w), xp.zeros(1, dtype=xp.uint64), poisoned(n, np.int8)
    k(
        "ztest_apply",
        (cdiv(n, 256),),
        (256,),
        *(dev(z.astype(np.int64)), dev(np.array([threshold], np.int64)), i32(n), got, changed),
        moved,
    )
    assert np.array_equal(to_host(got), want.astype(np.int8))
    assert np.array_equal(to_host(moved), (want != w).astype(np.int8))
    assert int(to_host(changed)[0]) == np.count_nonzero(want != w)


def test_momentum_apply_is_the_rule(k: Kernels, monkeypatch: pytest.MonkeyPatch) -> None:
    """momentum_apply against shared/rules/momentum.py's `update` itself, at M's limits."""
    from eggroll_dist.shared.rules import momentum

    rng = np.random.default_rng(12)
    n, shift, threshold = 10_000 + 17, 2, 91
    z = rng.integers(-400, 401, size=n).astype(np.int32)
    m = rng.integers(-300, 301, size=n).astype(np.int32)
    m[:20], m[20:40] = (1 << 31) - 1, -((1 << 31) - 1)  # clipped after + z
    z[:20], z[20:40] = 1 << 20, -(1 << 20)
    w = rng.integers(-127, 128, size=n).astype(np.int8)
    w[40:90], w[90:140] = 127, -127
    monkeypatch.setattr(momentum, "move_threshold", lambda *args: threshold)
    cfg = RunConfig(update=UpdateConfig(rule="momentum", momentum_shift=shift))
    new, state = momentum.update(cfg, 0, (), {"x": w}, {"momentum.x": m}, {"x": z})
    got_w, got_m, changed = dev(w), dev(m), xp.zeros(1, dtype=xp.uint64)
    k(
        "momentum_apply",
        (cdiv(n, 256),),
        (256,),
        *(dev(z.astype(np.int64)), dev(np.array([threshold], np.int64)), i32(shift), i32(n)),
        *(got_m, got_w),
        *(changed, xp.zeros(0, dtype=xp.int8)),
    )
    assert np.array_equal(to_host(got_w), new["x"])
    assert np.array_equal(to_host(got_m), state["momentum.x"])
    assert int(to_host(changed)[0]) == np.count_nonzero(new["x"] != w) > 0


@pytest.mark.parametrize("decay", [1, 0], ids=["matrix", "vector"])
def test_adamw_apply_is_the_rule(k: Kernels, decay: int) -> None:
    """adamw_apply against shared/rules/adamw.py's `update` itself: moments near their
    bounds, accumulators at +-ONE and at their limit, weights at +-127."""
    from eggroll_dist.shared.perturb import ParamSpec
    from eggroll_dist.shared.rules import adamw
    from eggroll_dist.shared.rules.fixedpoint import fixed16

    rng = np.random.default_rng(13)
    n, step = 10_000 + 17, 1
    cfg = RunConfig(
        es=ESConfig(population=512, chunk_size=512),
        update=UpdateConfig(rule="adamw", lr=2.0, weight_decay=0.05, beta1=0.8, beta2=0.9),
    )
    gs = adamw.grad_shift(cfg)
    bound = cfg.pairs * 15 * 15  # |Z| of 256 pairs of uniform noise
    z = rng.integers(-bound, bound + 1, size=n).astype(np.int32)
    z[500:520], z[520:540] = bound, -bound
    m = rng.integers(-(1 << 19), (1 << 19) + 1, size=n).astype(np.int32)
    v = rng.integers(0, 1 << 39, size=n).astype(np.int64)
    v[:100] = 0  # the +1 under the division alone
    acc = rng.integers(-(1 << 17), (1 << 17) + 1, size=n).astype(np.int32)
    acc[100:200], acc[200:300] = (1 << 31) - 1, -((1 << 31) - 1)
    w = rng.integers(-127, 128, size=n).astype(np.int8)
    w[300:400], w[400:500] = 127, -127
    kind = "matrix" if decay else "vector"
    spec = ParamSpec("x", (n,), kind, "zero", 0)
    state = {"adamw.m.x": m, "adamw.v.x": v, "adamw.acc.x": acc}
    new, want = adamw.update(cfg, step, (spec,), {"x": w}, state, {"x": z.astype(np.int64)})
    up = cfg.update
    scalars = np.array([adamw.lr_at(up, step), adamw.bias_correction(up, step)], np.int64)
    got = [dev(m), dev(v), dev(acc), dev(w)]
    changed = xp.zeros(1, dtype=xp.uint64)
    betas = (np.int64(fixed16(up.beta1)), np.int64(fixed16(up.beta2)))
    k(
        "adamw_apply",
        (cdiv(n, 256),),
        (256,),
        *(dev(z.astype(np.int64)), dev(scalars), *betas, np.int64(fixed16(up.weight_decay))),
        *(i32(gs), i32(decay), i32(n), *got, changed, xp.zeros(0, dtype=xp.int8)),
    )
    assert np.array_equal(to_host(got[3]), new["x"])
    for arr, key in zip(got[:3], ("adamw.m.x", "adamw.v.x", "adamw.acc.x"), strict=True):
        assert np.array_equal(to_host(arr), want[key]), key
    assert int(to_host(changed)[0]) == np.count_nonzero(new["x"] != w) > 0


# ------------------------------------------------------------------------ forward pass


def member_batch(cfg: RunConfig, n_pairs: int = 35, step: int = 2):
    pairs = np.arange(n_pairs, dtype=np.int64) * 3 + 1
    params = init_params(cfg.model)
    pn = pair_noise(cfg, param_specs(cfg.model), step, pairs)
    return pairs, params, pn, member_noise(pn, params, cfg.es.sigma_shift)


def test_embed_and_state_reset(k: Kernels) -> None:
    cfg = cfg_for()
    pairs, params, pn, mn = member_batch(cfg)
    d, v, m = cfg.model.d_model, cfg.model.vocab_size, 2 * len(pairs)
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, v, size=(len(pairs), 5)).astype(np.int32)
    tokens[::4, 2] = 0  # documents start here: states reset
    states = dev(rng.integers(-127, 128, size=(2, m, d)).astype(np.int8))
    before = to_host(states)
    x = poisoned((m, d), np.int8)
    model = EggModel(cfg, params)
    k(
        "embed",
        (m,),
        (128,),
        *(dev(tokens), i32(5), i32(1), dev(np.array([1], np.int32))),  # column 1 + *pos = 2
        *(dev(params["emb"]), dev(pn.a["emb"]), dev(pn.b["emb"])),
        *(i32(m), i32(d), i32(v), i32(4 + cfg.es.sigma_shift), states, i32(2), x),
    )
    tok = np.repeat(tokens[:, 2], 2)
    assert np.array_equal(to_host(x), model._embed(tok, mn))
    before[:, tok == 0] = 0
    assert np.array_equal(to_host(states), before)


def test_norm_at_every_divisor(k: Kernels) -> None:
    """mav_norm's 32-bit floor division at every divisor the norm can meet (1 to 128: the
    mean magnitude of an int8 row), each row's products spread over the int8 range, -128
    included: the reference's rows exactly."""
    d = 256
    cfg = cfg_for(d=d)
    rng = np.random.default_rng(8)
    rows = []
    for mean in range(1, 128):  # magnitudes mean +- spread, summing to exactly mean * d
        spread = rng.integers(0, min(mean, 127 - mean) + 1, size=d // 2)
        mags = np.concatenate([mean + spread, mean - spread])
        rows.append(mags * rng.choice([-1, 1], size=d))
    rows += [np.zeros(d), np.full(d, -128), np.arange(d) % 256 - 128]  # 0 -> 1, 128, mixed
    x = np.array(rows).astype(np.int8)
    assert {max(int(np.abs(r.astype(int)).sum()) // d, 1) for r in x} == set(range(1, 129))
    w = rng.integers(-128, 128, size=d).astype(np.int8)
    w[:4] = -128, 127, 1, -1
    params = dict(init_params(cfg.model), **{"layers.0.ln1": w})
    want = EggModel(cfg, params)._ln(x.astype(np.int32), "layers.0.ln1", None)
    null8, null32 = xp.zeros(0, dtype=xp.int8), xp.zeros(0, dtype=xp.int32)
    m = len(x)
    h = poisoned((m, d), np.int8)
    k(
        "mav_norm",
        (cdiv(m, 8),),
        (256,),
        *(dev(x), dev(w[None]), null8, i32(m), i32(m), i32(d), h, null8, null32, null8, null32),
    )
    assert np.array_equal(to_host(h), want)


def test_norm_rowdot_and_loss(k: Kernels) -> None:
    cfg = cfg_for()
    pairs, params, pn, mn = member_batch(cfg)
    d, m = cfg.model.d_model, 2 * len(pairs)
    rng = np.random.default_rng(4)
    x = rng.integers(-127, 128, size=(m, d)).astype(np.int8)
    x[0], x[1] = 0, 127  # mav 0 -> 1, and the largest products
    model = EggModel(cfg, params)
    w_ln = mn.vectors["layers.0.ln1"].astype(np.int8)
    want_h = model._ln(x.astype(np.int32), "layers.0.ln1", mn)
    null8, null32 = xp.zeros(0, dtype=xp.int8), xp.zeros(0, dtype=xp.int32)
    # alone, and with the rank-1 dots of the normed rows for one and for two tensors
    for dots in ((), ("layers.0.wf",), ("layers.0.wf", "layers.0.wh")):
        h = poisoned((m, d), np.int8)
        outs = [poisoned(m, np.int32) for _ in dots]
        pairs_in = [(dev(pn.b[n]), o) for n, o in zip(dots, outs, strict=True)]
        extra = [a for pair in pairs_in + [(null8, null32)] * (2 - len(dots)) for a in pair]
        k(
            "mav_norm",
            (cdiv(m, 8),),
            (256,),
            *(dev(x), dev(w_ln), null8, i32(m), i32(1), i32(d), h, *extra),
        )
        assert np.array_equal(to_host(h), want_h), dots
        for name, out in zip(dots, outs, strict=True):
            want = (want_h.astype(np.int64) * np.repeat(pn.b[name], 2, axis=0)).sum(axis=1)
            assert np.array_equal(to_host(out), want.astype(np.int32)), (dots, name)
    for name in ("layers.0.wf", "layers.0.w2"):
        k_in = params[name].shape[1]
        src = rng.integers(-127, 128, size=(m, k_in)).astype(np.int8)
        xb = poisoned(m, np.int32)
        b = dev(pn.b[name])
        k("rowdot", (cdiv(m, 8),), (256,), dev(src), b, i32(m), i32(1), i32(k_in), xb)
        want = (src.astype(np.int64) * np.repeat(pn.b[name], 2, axis=0)).sum(axis=1)
        assert np.array_equal(to_host(xb), want.astype(np.int32)), name
    v = 203
    logits = rng.integers(-127, 128, size=(m, v)).astype(np.int8)
    logits[0], logits[1] = 127, -127
    tokens = rng.integers(0, v, size=(len(pairs), 3)).astype(np.int32)
    loss = dev(np.full(m, 1000, np.int64))  # the kernel accumulates
    k(
        "token_loss",
        (cdiv(m, 8),),
        (256,),
        *(dev(logits), dev(tokens), i32(3), i32(1), i32(m), i32(v)),
        *(dev(exp2_table()), dev(log2_thresholds()), loss),
    )
    want = 1000 + token_loss(logits.astype(np.int64), np.repeat(tokens[:, 1], 2))
    assert np.array_equal(to_host(loss), want)


# (M, N, K): several tiles each way with partial edges; K % 16 == 0 takes the 16-byte loads
# (272: four stages and a partial one), K % 16 != 0 the guarded word loads (100, 36).
GEMM_SHAPES = [(300, 200, 272), (130, 70, 100), (129, 65, 36)]


@pytest.mark.parametrize("suffix", GEMM_SUFFIXES)
def test_gemm_tiles_stages_and_k_splits(k: Kernels, suffix: str) -> None:
    rng = np.random.default_rng(11)
    for m, n, kk in GEMM_SHAPES:
        x = rng.integers(-127, 128, size=(m, kk)).astype(np.int8)
        w = rng.integers(-127, 128, size=(n, kk)).astype(np.int8)
        want = x.astype(np.int64) @ w.astype(np.int64).T
        # one stage per block (many splits, the last partial), two stages, all of K in one
        for k_split in (STAGE_WORDS, 2 * STAGE_WORDS, cdiv(kk // 4, STAGE_WORDS) * STAGE_WORDS):
            z = poisoned((m, n), np.int64)
            zgemm(k, suffix, dev(x), dev(w), k_split, z)
            assert np.array_equal(to_host(z), want), (m, n, kk, k_split)


@pytest.mark.parametrize("suffix", GEMM_SUFFIXES)
def test_z_sums_past_int32_are_exact(k: Kernels, suffix: str) -> None:
    """A Z over 140,000 pairs of 127 x 127 sums to 2.3e9: past int32, exact in int64, each
    block's own sum kept within int32 by z_split (as the backend splits K; vector_z's rows
    by vector_split)."""
    kk = 140_000
    x, w = np.full((1, kk), 127, np.int8), np.full((1, kk), -127, np.int8)
    x[0, :100] = -127  # a sum that is not a multiple of 127**2 * kk
    want = x.astype(np.int64) @ w.astype(np.int64).T
    assert abs(int(want[0, 0])) > 1 << 31
    k_split = z_split(1, 1, kk, 127)
    assert 4 * k_split * 127 * 127 < 1 << 31 and cdiv(kk // 4, k_split) > 1
    z = poisoned((1, 1), np.int64)
    zgemm(k, suffix, dev(x), dev(w), k_split, z)
    assert np.array_equal(to_host(z), want)
    for pairs in (10**5, 10**7):  # all pairs in one block row would overflow at 10**7
        assert vector_split(1, pairs, 55) * 55 * 55 < 1 << 31


def floor_div_reference(v: np.ndarray, d: int) -> np.ndarray:
    return np.floor_divide(v, d)  # floors toward -inf, as the reference does


@pytest.mark.parametrize("suffix", GEMM_SUFFIXES)
@pytest.mark.parametrize(
    "shape", [GEMM_SHAPES[0], (130, 65, 100), (130, 208, 36)], ids=["pairs", "odd-n", "rows16"]
)
def test_mm_epilogue_divides_by_any_divisor(k: Kernels, suffix: str, shape) -> None:
    """The epilogue's floor division equals // for powers of two (a shift) and others (a
    multiply-high), negative sums included; the rank-1 term carries each member's sign. An
    odd N takes the epilogue's byte path, an even one its byte pairs, a multiple of 16 the
    path through shared memory (here with a last tile of 16 columns, the rows partial)."""
    rng = np.random.default_rng(12)
    m, n, kk = shape
    x = rng.integers(-127, 128, size=(m, kk)).astype(np.int8)
    w = rng.integers(-127, 128, size=(n, kk)).astype(np.int8)
    a = rng.integers(-127, 128, size=(m // 2, n)).astype(np.int8)
    xb = rng.integers(-(1 << 20), 1 << 20, size=m).astype(np.int32)
    acc = x.astype(np.int64) @ w.astype(np.int64).T
    sign = np.where(np.arange(m) % 2 == 0, 1, -1)[:, None]
    shift = 5
    rank1 = (xb.astype(np.int64)[:, None] * sign * np.repeat(a, 2, axis=0)) >> shift
    for div in (1, 2, 3, 7, 96, 256, 1000, 65537, (1 << 30) + 3):
        want = np.clip(floor_div_reference(acc + rank1, div), -127, 127)
        out = poisoned((m, n), np.int8)
        k(
            "mm" + suffix,
            (cdiv(n, TILE_N), cdiv(m, TILE_M)),
            (256,),
            *(dev(x), dev(w), dev(xb), dev(a), i32(m), i32(n), i32(kk), i32(shift)),
            *(i32(div), xp.zeros(0, dtype=xp.int8), out),
        )
        assert np.array_equal(to_host(out), want), div


@pytest.mark.parametrize("suffix", GEMM_SUFFIXES)
def test_mm_with_rank1_correction_and_residual(k: Kernels, suffix: str) -> None:
    cfg = cfg_for(d=36, vocab=70)  # K = 36 (a partial stage), N = 70, M = 70: partial tiles
    pairs, params, pn, mn = member_batch(cfg)
    m = 2 * len(pairs)
    model = EggModel(cfg, params)
    rng = np.random.default_rng(6)
    for name in ("layers.0.w1", "layers.0.w2", "head"):
        n_out, k_in = params[name].shape
        x = rng.integers(-127, 128, size=(m, k_in)).astype(np.int8)
        xb = dev((x.astype(np.int64) * np.repeat(pn.b[name], 2, axis=0)).sum(1).astype(np.int32))
        want = model._mm(x.astype(np.int32), name, mn)
        res = rng.integers(-127, 128, size=(m, n_out)).astype(np.int8)
        for residual in (False, True):
            out = dev(res) if residual else poisoned((m, n_out), np.int8)
            k(
                "mm" + suffix,
                (cdiv(n_out, TILE_N), cdiv(m, TILE_M)),
                (256,),
                *(dev(x), dev(params[name]), xb, dev(pn.a[name]), i32(m), i32(n_out)),
                *(i32(k_in), i32(4 + cfg.es.sigma_shift), i32(16 * isqrt(k_in))),
                *(out if residual else xp.zeros(0, dtype=xp.int8), out),
            )
            expect = np.clip(res + want, -127, 127) if residual else want
            assert np.array_equal(to_host(out), expect), (name, residual)


def odd_based(a: np.ndarray):
    """A device copy of `a` whose base address is odd (a view one byte into a buffer)."""
    flat = np.concatenate([np.zeros(1, a.dtype), a.ravel()])
    return xp.asarray(flat)[1:].reshape(a.shape)


@pytest.mark.parametrize("suffix", GEMM_SUFFIXES)
@pytest.mark.parametrize(
    "d, odd, n_pairs", [(68, False, 35), (208, False, 35), (68, True, 35), (64, False, 70)]
)
def test_gate_and_candidate(k: Kernels, suffix: str, d: int, odd: bool, n_pairs: int) -> None:
    # 68: two N tiles, the second partial, word loads over two stages; 208: 16-byte loads
    # over four stages, so both GEMMs of one kernel rotate the three buffers. The epilogues
    # move byte pairs at 68 (even row length and bases), go through shared memory at 208
    # (multiply-high) and 64 (a shift: divisor 128; 140 rows, a second row tile); an
    # odd-based bias takes the byte path.
    cfg = cfg_for(d=d)
    bias = odd_based if odd else dev
    pairs, params, pn, mn = member_batch(cfg, n_pairs)
    d, m = cfg.model.d_model, 2 * len(pairs)
    model = EggModel(cfg, params)
    rng = np.random.default_rng(8)
    h, s, x = (rng.integers(-127, 128, size=(m, d)).astype(np.int8) for _ in range(3))
    p = "layers.0."

    def xb(src: np.ndarray, name: str):
        b = np.repeat(pn.b[name], 2, axis=0)
        return dev((src.astype(np.int64) * b).sum(1).astype(np.int32))

    h32, s32 = h.astype(np.int32), s.astype(np.int32)
    f = np.clip(
        model._mm(h32, p + "wf", mn) + model._mm(s32, p + "uf", mn) + mn.vectors[p + "bf"],
        -127,
        127,
    )
    g = ((f + 127) * s32) >> 8
    c = np.clip(
        model._mm(h32, p + "wh", mn) + model._mm(g, p + "uh", mn) + mn.vectors[p + "bh"],
        -127,
        127,
    )
    s_new = s32 + (((f + 127) * (c - s32)) >> 8)
    x_new = np.clip(x + s_new, -127, 127)
    scalars = (i32(m), i32(d), i32(4 + cfg.es.sigma_shift), i32(16 * isqrt(d)))
    grid = (cdiv(d, TILE_N), cdiv(m, TILE_M))
    f_got, g_got = poisoned((m, d), np.int8), poisoned((m, d), np.int8)
    k(
        "gate" + suffix,
        grid,
        (256,),
        *(dev(h), dev(params[p + "wf"]), xb(h, p + "wf"), dev(pn.a[p + "wf"])),
        *(dev(s), dev(params[p + "uf"]), xb(s, p + "uf"), dev(pn.a[p + "uf"])),
        *(*scalars, bias(mn.vectors[p + "bf"].astype(np.int8)), f_got, g_got),
    )
    assert np.array_equal(to_host(f_got), f)
    assert np.array_equal(to_host(g_got), g)
    s_dev, x_dev = dev(s), dev(x)
    g8 = g.astype(np.int8)
    k(
        "cand" + suffix,
        grid,
        (256,),
        *(dev(h), dev(params[p + "wh"]), xb(h, p + "wh"), dev(pn.a[p + "wh"])),
        *(dev(g8), dev(params[p + "uh"]), xb(g8, p + "uh"), dev(pn.a[p + "uh"])),
        *(*scalars, bias(mn.vectors[p + "bh"].astype(np.int8)), f_got, s_dev, x_dev),
    )
    assert np.array_equal(to_host(s_dev), s_new)
    assert np.array_equal(to_host(x_dev), x_new)


# ------------------------------------------------------------------ launch discipline


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32])
def test_gather_windows_are_the_pairs_windows(k: Kernels, dtype: type) -> None:
    """Tokens of 1, 2 and 4 bytes, windows up to the split's last token."""
    cfg = cfg_for()
    rng = np.random.default_rng(24)
    top = min(np.iinfo(dtype).max, (1 << 20) - 1)  # token ids: below the largest vocabulary
    train = rng.integers(0, top + 1, size=300, dtype=np.int64).astype(dtype)
    pairs = np.array([0, 5, 1 << 33, 77, 12345], dtype=np.int64)
    step = 9
    want = pair_windows(cfg, train, step, pairs)
    key = hash_key(DOMAIN_DATA, cfg.data.data_seed, step)
    got = poisoned((len(pairs), cfg.es.seq_len + 1), np.int32)
    k(
        "gather_windows",
        (len(pairs),),
        (128,),
        *(dev(np.array([key], np.uint64)), dev(pairs), dev(train.view(np.uint8))),
        *(i32(train.itemsize), np.int64(len(train) - cfg.es.seq_len), i32(cfg.es.seq_len + 1)),
        got,
    )
    assert np.array_equal(to_host(got), want.astype(np.int64))


def test_digest_leaves_are_blake2b_256(k: Kernels) -> None:
    """Leaves of every length class: empty, inside one block, one block exactly, one byte
    over, many blocks with a partial last one, at any 8-byte-aligned offset."""
    rng = np.random.default_rng(23)
    data = dev(rng.integers(0, 256, size=3000, dtype=np.uint8).view(np.int8))
    pieces = [(0, 0), (8, 1), (16, 127), (128, 128), (256, 129), (512, 2488), (40, 2000)]
    base = data.data.ptr if hasattr(data.data, "ptr") else data.ctypes.data
    address = dev(np.array([base + o for o, _ in pieces], dtype=np.uint64))
    length = dev(np.array([n for _, n in pieces], dtype=np.int64))
    out = poisoned(4 * len(pieces), np.uint64)
    k("digest_leaves", (1,), (64,), address, length, i32(len(pieces)), out)
    raw = to_host(data).tobytes()
    want = b"".join(hashlib.blake2b(raw[o : o + n], digest_size=32).digest() for o, n in pieces)
    assert to_host(out).astype("<u8").tobytes() == want


@pytest.mark.skipif(ON_GPU, reason="the CPU build exports the C++ signatures")
def test_signature_table_matches_the_source() -> None:
    """The backend's table of parameter dtypes says what the C++ parameters say."""
    import cudaemu

    from eggroll_dist.worker.backend.cupy_kernels import kernel_source

    module = cudaemu.RawModule(kernel_source(), name_expressions=tuple(SIGNATURES))
    for name, spec in SIGNATURES.items():
        params = module.get_function(name).params
        assert len(params) == len(spec), name
        for (kind, size, code), want in zip(params, spec, strict=True):
            dtype = np.dtype(want.lstrip("*"))
            assert bool(kind) == want.startswith("*"), (name, want)
            assert (size, code) == (dtype.itemsize, dtype.kind), (name, want)
    assert set(TENSOR_CORE_KERNELS) <= set(SIGNATURES)


def test_launch_checks_dtypes_and_contiguity(k: Kernels) -> None:
    a = xp.zeros((4, 8), dtype=xp.int8)
    xb = xp.zeros(4, dtype=xp.int32)
    with pytest.raises(TypeError, match="int32 device array"):
        k("rowdot", (1,), (256,), a, a, i32(4), i32(1), i32(8), xp.zeros(4, dtype=xp.int64))
    with pytest.raises(TypeError, match="not C-contiguous"):
        k("rowdot", (1,), (256,), a[:, :4], a, i32(4), i32(1), i32(4), xb)
    with pytest.raises(TypeError, match="NumPy int32 scalar"):
        k("rowdot", (1,), (256,), a, a, i32(4), 1, i32(8), xb)


@pytest.mark.skipif(ON_GPU or SANITIZE, reason="runs the sanitizer build of the CPU kernels")
def test_kernels_under_the_undefined_behaviour_sanitizer(tmp_path: Path) -> None:
    """These tests and the whole-backend ones, kernels built with -fsanitize=undefined (any
    report aborts the run): every kernel in one thread order (the others only reorder the
    same operations), and the held-out passes."""
    env = {**os.environ, "EGGROLL_CUDAEMU_SANITIZE": "1"}
    here = Path(__file__)
    tests = [
        __file__,
        *(str(here.with_name(f)) for f in ("test_former_kernels.py", "test_cupy_backend.py")),
    ]
    # its own temporary root: a second session under the default one would prune this
    # session's directories (pytest keeps the newest three)
    select = ["-k", "ascending or several_passes", "--basetemp", str(tmp_path / "nested")]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests, *select],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "runtime error" not in proc.stdout + proc.stderr
