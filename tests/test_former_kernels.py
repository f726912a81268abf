"""Every kernel of former.cu equals its piece of the NumPy reference (shared/former.py), byte
for byte, on (member, position) rows: several positions per member, partial tiles, odd
divisors, clipping at both ends, a vocabulary over several head tiles.

Runs where tests/test_gpu_kernels.py runs (kernel_target.py): the CPU build of the kernels in
every thread order by default, a GPU with EGGROLL_KERNEL_TARGET=cupy.
"""

from __future__ import annotations

import sys
from math import isqrt
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_target import (
    CPU_BUILD_MISSING,
    VARIANTS,
    array_module,
    cdiv,
    dev,
    kernels,
    poisoned,
    to_host,
)

from eggroll_dist.shared.config import ESConfig, ModelConfig, RunConfig
from eggroll_dist.shared.former import (
    FormerModel,
    attention,
    gelu_table,
    renorm,
    rope,
    rope_table,
    softmax_table,
)
from eggroll_dist.shared.loss import exp2_table, log2_thresholds, logit_histogram, token_loss
from eggroll_dist.shared.model import init_params, param_specs
from eggroll_dist.shared.perturb import member_noise, pair_noise
from eggroll_dist.worker.backend.cupy_backend import TILE_M, TILE_N, Kernels
from eggroll_dist.worker.backend.cupy_former import ATTENTION_THREADS, attention_kernel

pytestmark = pytest.mark.skipif(bool(CPU_BUILD_MISSING), reason=str(CPU_BUILD_MISSING))
xp = array_module()
i32 = np.int32
GEMM_SUFFIXES = ("_tc", "_dp4a")
T = 5  # positions per member: rows of one member straddle the GEMM tiles' edges


@pytest.fixture(scope="module", params=VARIANTS)
def k(request: pytest.FixtureRequest) -> Kernels:
    return kernels(request.param)


def cfg_for(d: int = 36, heads: int = 3, vocab: int = 300, head_bias: str = "zipf") -> RunConfig:
    return RunConfig(
        model=ModelConfig(
            arch="former", n_layer=1, d_model=d, n_head=heads, vocab_size=vocab,
            head_bias=head_bias,
        ),
        es=ESConfig(
            population=64, chunk_size=64, seq_len=T, sigma_shift=3, noise="gaussian", run_seed=4
        ),  # the kernels get the shift 4 + 3
    )  # fmt: skip


def batch(cfg: RunConfig, n_pairs: int = 14):
    """Pairs (28 members, 140 rows: two row tiles), their weights, noise and windows."""
    pairs = np.arange(3, 3 + n_pairs, dtype=np.int64)
    params = init_params(cfg.model)
    pn = pair_noise(cfg, param_specs(cfg.model), 2, pairs)
    mn = member_noise(pn, params, cfg.es.sigma_shift)
    rng = np.random.default_rng(6)
    tokens = rng.integers(0, cfg.model.vocab_size, size=(n_pairs, T + 1)).astype(np.int32)
    return params, pn, mn, tokens, FormerModel(cfg, params)


def rows_of(a: np.ndarray) -> np.ndarray:
    """(M, T, n) -> (M T, n): the kernels' (member, position) rows."""
    return a.reshape(-1, a.shape[-1])


def test_embed_is_the_tied_streams_row_plus_the_bias(k: Kernels) -> None:
    cfg = cfg_for()
    params, pn, mn, tokens, model = batch(cfg)
    m, d, v = 2 * len(tokens), cfg.model.d_model, cfg.model.vocab_size
    x = poisoned((m * T, d), np.int8)
    k(
        "former_embed",
        (m * T,),
        (128,),
        *(dev(tokens), i32(T), dev(params["emb"]), dev(pn.a["emb"]), dev(pn.b["emb"])),
        *(dev(mn.vectors["emb_bias"].astype(np.int8)), i32(d), i32(v), i32(7), x),
    )
    want = model._embed(np.repeat(tokens[:, :T], 2, axis=0), mn)
    assert np.array_equal(to_host(x), rows_of(want))


def test_norm_with_the_members_gain_bias_and_dots(k: Kernels) -> None:
    cfg = cfg_for()
    _, pn, mn, _, model = batch(cfg)
    m, d = 2 * len(pn.pairs), cfg.model.d_model
    rng = np.random.default_rng(8)
    x = rng.integers(-127, 128, size=(m, T, d)).astype(np.int8)
    x[0, 0], x[1, 2] = 0, 127  # mav 0 -> 1, and the largest products
    name = "layers.0.ln1"
    gain = mn.vectors[name].astype(np.int8)
    bias = (mn.vectors[name + "_bias"] + 90).clip(-127, 127).astype(np.int8)  # clips both ways
    mn.vectors[name + "_bias"] = bias.astype(np.int32)
    want = rows_of(model._norm(x.astype(np.int32), name, mn))
    h = poisoned((m * T, d), np.int8)
    dots = [poisoned(m * T, np.int32) for _ in range(2)]
    wq, wk = (pn.b[f"layers.0.{w}"] for w in ("wq", "wk"))
    k(
        "mav_norm",
        (cdiv(m * T, 8),),
        (256,),
        *(dev(rows_of(x)), dev(gain), dev(bias), i32(m * T), i32(T), i32(d), h),
        *(dev(wq), dots[0], dev(wk), dots[1]),
    )
    assert np.array_equal(to_host(h), want)
    for b, got in ((wq, dots[0]), (wk, dots[1])):
        b_rows = np.repeat(b, 2 * T, axis=0).astype(np.int64)
        assert np.array_equal(to_host(got), (want.astype(np.int64) * b_rows).sum(axis=1))
    xb = poisoned(m * T, np.int32)
    k("rowdot", (cdiv(m * T, 8),), (256,), dev(rows_of(x)), dev(wq), i32(m * T), i32(T), i32(d), xb)
    want_xb = (rows_of(x).astype(np.int64) * np.repeat(wq, 2 * T, axis=0)).sum(axis=1)
    assert np.array_equal(to_host(xb), want_xb)


def former_mm(k: Kernels, suffix: str, x, name: str, params, pn, *, bias=None,
              gelu=None) -> np.ndarray:  # fmt: skip
    """One former_mm launch over rows x (R, K); returns its int8 outputs on the host."""
    n_out, k_in = params[name].shape
    r = len(x)
    xb = (x.astype(np.int64) * np.repeat(pn.b[name], 2 * T, axis=0)).sum(axis=1)
    out = poisoned((r, n_out), np.int8)
    k(
        "former_mm" + suffix,
        (cdiv(n_out, TILE_N), cdiv(r, TILE_M)),
        (256,),
        *(dev(x), dev(params[name]), dev(xb.astype(np.int32)), dev(pn.a[name]), i32(r)),
        *(i32(n_out), i32(k_in), i32(T), i32(7), i32(16 * isqrt(k_in))),
        *(xp.zeros(0, dtype=xp.int8) if bias is None else dev(bias),),
        *(xp.zeros(0, dtype=xp.int32) if gelu is None else dev(gelu), out),
    )
    return to_host(out)


# width 36: divisors 96 and 192 (multiply-high); 64: 128 and 256 (a shift), heads of 32
@pytest.mark.parametrize("d", [36, 64])
@pytest.mark.parametrize("suffix", GEMM_SUFFIXES)
def test_mm_epilogues_plain_and_gelu(k: Kernels, suffix: str, d: int) -> None:
    cfg = cfg_for(d=d, heads=2 if d == 64 else 3)
    params, pn, mn, _, model = batch(cfg)
    m, d = 2 * len(pn.pairs), cfg.model.d_model
    rng = np.random.default_rng(9)
    x = rng.integers(-127, 128, size=(m, T, d)).astype(np.int8)
    x[0] = 127  # MM clips high, the bias adds past it
    plain = model._mm(x.astype(np.int32), "layers.0.wq", mn)
    assert np.array_equal(former_mm(k, suffix, rows_of(x), "layers.0.wq", params, pn),
                          rows_of(plain))  # fmt: skip
    # the MLP's up projection: GELU[clip(MM + up_bias) + 128]
    up_bias = mn.vectors["layers.0.up_bias"] + rng.integers(-60, 61, size=(m, 4 * d))
    up_bias = up_bias.clip(-127, 127)
    up = model._mm(model._norm(x.astype(np.int32), "layers.0.ln2", mn), "layers.0.up", mn)
    normed = rows_of(model._norm(x.astype(np.int32), "layers.0.ln2", mn)).astype(np.int8)
    want = gelu_table()[(up + up_bias[:, None, :]).clip(-127, 127) + 128]
    got = former_mm(k, suffix, normed, "layers.0.up", params, pn,
                    bias=up_bias.astype(np.int8), gelu=gelu_table())  # fmt: skip
    assert np.array_equal(got, rows_of(want))
    # the MLP's down projection over the 4D hidden: MM alone (the renorm adds x and the bias)
    hidden = rng.integers(-3, 128, size=(m, T, 4 * d)).astype(np.int8)
    down = model._mm(hidden.astype(np.int32), "layers.0.down", mn)
    got = former_mm(k, suffix, rows_of(hidden), "layers.0.down", params, pn)
    assert np.array_equal(got, rows_of(down))


# width 36 (whole words), 10, 6 and 1,022 (rows not whole words: byte by byte; 6 with heads
# of 2), 1,024: the widest row, 8 words a lane
@pytest.mark.parametrize("d, heads", [(36, 1), (36, 3), (10, 1), (6, 3), (1022, 1), (1024, 16)])
def test_renorm_with_rope_or_residual_and_bias(k: Kernels, d: int, heads: int) -> None:
    """R(RoPE(MM)) for q and k; R(MM), R(x + MM) for v and o; R(x + MM + bias) for down,
    in place in x. MM outputs are clipped int8, so |x + MM + bias| <= 381."""
    rng = np.random.default_rng(10)
    m = 9
    mm = rng.integers(-127, 128, size=(m, T, d)).astype(np.int8)
    x = rng.integers(-127, 128, size=(m, T, d)).astype(np.int8)
    bias = rng.integers(-127, 128, size=(m, d)).astype(np.int8)
    mm[0], x[0] = 0, 0  # the max is 0 -> 1
    mm[1, 1, :4], x[1, 1, :4] = [127, -127, 1, -1], [127, -127, 0, 0]
    bias[1, :4] = [127, -127, 0, 0]  # 381 and -381: the largest sums
    mm[2] = 127  # RoPE's largest pairs
    cos, sin = rope_table(T, d // heads)
    wide = mm.astype(np.int32)
    rotated = rope(wide.reshape(m, T, heads, d // heads), cos, sin).reshape(m, T, d)
    null8, null32 = xp.zeros(0, dtype=xp.int8), xp.zeros(0, dtype=xp.int32)
    cases = (
        ("rope", rotated, null8, null8, (dev(cos), dev(sin))),
        ("plain", wide, null8, null8, (null32, null32)),
        ("residual", wide + x, dev(rows_of(x)), null8, (null32, null32)),
        ("bias", wide + x + bias[:, None, :], dev(rows_of(x)), dev(bias), (null32, null32)),
    )
    for case, v, res, b, tables in cases:
        got = res if len(res) else poisoned((m * T, d), np.int8)  # the residual: in place
        k(
            "former_renorm",
            (cdiv(m * T, 8),),
            (256,),
            *(dev(rows_of(mm)), res, b, i32(m * T), i32(T), i32(d), i32(d // heads), *tables),
            got,
        )
        assert np.array_equal(to_host(got), rows_of(renorm(v))), case


@pytest.mark.parametrize(
    "t, heads, dh, m",
    [
        (T, 3, 12, 4),
        (130, 1, 6, 4),
        (1030, 1, 2, 3),
        (64, 4, 64, 2),
        (100, 2, 64, 2),
        (40, 2, 128, 3),
        (12, 1, 130, 3),
        (7, 1, 300, 3),
        (9, 1, 1024, 3),
    ],
    ids=[
        *("short", "long", "tiles", "d-eggs", "partial"),
        *("head128", "head130", "head300", "head1024"),
    ],
)
def test_causal_table_softmax_attention(k: Kernels, t: int, heads: int, dh: int, m: int) -> None:
    """Tiles of 32 queries by 32 keys up to a head of 64 (d-eggs' two tiles of queries, the
    second over two tiles of keys), fewer rows for wider heads (16 at 128, 8 at 130, 4 at
    300, 2 at 1,024); a last tile cut short (100 positions), heads not a whole number of
    words (6, 2, 130: bytes one by one), 1,030 positions: 33 tiles of keys for the last
    queries. Members: the first all 127 (every score equal), the last with one column
    alternating, the others random (near one-hot weights: a wrong score moves the output)."""
    rng = np.random.default_rng(11)
    q, kk, v = (rng.integers(-127, 128, size=(m, t, heads, dh)).astype(np.int8) for _ in "qkv")
    q[0], kk[0] = 127, 127  # every score equal: every weight 2**18
    q[-1, :, :, 0], kk[-1, :, :, 0] = 127, -127 * (np.arange(t) % 2)[:, None]
    want = attention(*(a.astype(np.int32) for a in (q, kk, v)))
    out = poisoned((m * t, heads * dh), np.int8)
    k(
        attention_kernel(dh),
        (m, heads),
        (ATTENTION_THREADS,),
        *(dev(q.reshape(m * t, -1)), dev(kk.reshape(m * t, -1)), dev(v.reshape(m * t, -1))),
        *(i32(t), i32(heads * dh), i32(dh), dev(softmax_table().astype(np.int32)), out),
    )
    assert np.array_equal(to_host(out), want.reshape(m * t, -1))


@pytest.mark.parametrize("dh", [64, 300])
def test_attention_rounds_exact_halves_and_extreme_values(k: Kernels, dh: int) -> None:
    """Every score equal (q = k = 0: every weight 2**18), so each output is the mean of
    the values so far rounded half up: quotients land exactly on integers and halves, where
    the kernel's float estimate must be set right by its integer step; values at -128 and
    127 (the int8 ends)."""
    t, m = 70, 2
    rng = np.random.default_rng(13)
    q = np.zeros((m, t, 1, dh), dtype=np.int8)
    v = rng.choice(np.array([-128, -127, -1, 0, 1, 126, 127], dtype=np.int8), size=q.shape)
    v[0, :, 0, 0] = np.arange(t) % 2  # means 1/2, 1/3, 2/4, ...: halves and below
    want = attention(*(a.astype(np.int32) for a in (q, q, v)))
    out = poisoned((m * t, dh), np.int8)
    k(
        attention_kernel(dh),
        (m, 1),
        (ATTENTION_THREADS,),
        *(dev(q.reshape(m * t, -1)), dev(q.reshape(m * t, -1)), dev(v.reshape(m * t, -1))),
        *(i32(t), i32(dh), i32(dh), dev(softmax_table().astype(np.int32)), out),
    )
    assert np.array_equal(to_host(out), want.reshape(m * t, -1))


@pytest.mark.parametrize("suffix", GEMM_SUFFIXES)
@pytest.mark.parametrize(
    "head_bias, d, vocab",
    [
        ("zipf", 36, 300),
        ("none", 36, 300),
        ("none", 64, 300),
        ("zipf", 36, 304),
        ("zipf", 64, 304),
        ("none", 64, 304),
    ],
    ids=["zipf", "none", "pow2", "rows16", "rows16-pow2", "rows16-no-bias"],
)
@pytest.mark.parametrize("counts", [False, True], ids=["loss", "held-out"])
def test_head_fused_with_the_loss(
    k: Kernels, suffix: str, head_bias: str, d: int, vocab: int, counts: bool
) -> None:
    """The member's integer loss summed over its positions; held out: the even members'
    logit counts per position instead, from which the host finishes both losses. Width 64
    divides by 128, a power of two (a shift); a vocabulary of 304 (a multiple of 16, the
    last tile 48 columns) takes the epilogue through shared memory."""
    cfg = cfg_for(d=d, heads=2 if d == 64 else 3, vocab=vocab, head_bias=head_bias)
    params, pn, mn, tokens, model = batch(cfg)
    m, d, v = 2 * len(tokens), cfg.model.d_model, cfg.model.vocab_size
    rng = np.random.default_rng(12)
    h = rng.integers(-127, 128, size=(m, T, d)).astype(np.int8)
    h[2] = 127  # logits clip at both ends of the tables
    h[3] = -127
    logits = model.head(h.astype(np.int32), mn).reshape(-1, v)
    targets = np.repeat(tokens[:, 1:], 2, axis=0).reshape(-1)
    want = token_loss(logits, targets).reshape(m, T).sum(axis=1)
    xb = (rows_of(h).astype(np.int64) * np.repeat(pn.b["emb"], 2 * T, axis=0)).sum(axis=1)
    total, target, loss = (poisoned(m * T, np.uint64), poisoned(m * T, np.int32),
                           poisoned(m, np.int64))  # fmt: skip
    total[...] = 0
    hist = xp.zeros((m // 2 * T, 256), dtype=xp.int32) if counts else xp.zeros(0, dtype=xp.int32)
    bias = mn.vectors["head_bias"].astype(np.int8) if head_bias != "none" else None
    k(
        "former_head" + suffix,
        (cdiv(v, TILE_N), cdiv(m * T, TILE_M)),
        (256,),
        *(dev(rows_of(h)), dev(params["emb"]), dev(xb.astype(np.int32)), dev(pn.a["emb"])),
        *(i32(m * T), i32(v), i32(d), i32(T), i32(7), i32(16 * isqrt(d))),
        *(xp.zeros(0, dtype=xp.int8) if bias is None else dev(bias), dev(tokens)),
        *(dev(exp2_table()), total, target, hist),
    )
    target_logits = logits[np.arange(m * T), targets]
    if counts:  # the even members' rows: pair p's position t at p T + t
        even = (np.arange(m * T) // T) % 2 == 0
        assert np.array_equal(to_host(hist), logit_histogram(logits[even]))
        assert np.array_equal(to_host(target)[: m // 2 * T], target_logits[even])
        assert not to_host(total).any()
        return
    assert np.array_equal(to_host(target), target_logits)
    k(
        "former_loss",
        (cdiv(m, 256),),
        (256,),
        *(total, target, i32(m), i32(T), dev(log2_thresholds()), loss),
    )
    assert np.array_equal(to_host(loss), want)
