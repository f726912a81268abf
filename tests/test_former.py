"""The former: golden tables and integer operations, the rank-1 forward against an explicit
per-member reference with every perturbed weight materialised, causality, generation."""

from __future__ import annotations

import hashlib
import math
from math import isqrt

import numpy as np
import pytest

from eggroll_dist.shared import former
from eggroll_dist.shared.config import ConfigError, ESConfig, ModelConfig, RunConfig, preset
from eggroll_dist.shared.former import (
    FormerGenerator,
    FormerModel,
    attention,
    gelu_table,
    renorm,
    rope,
    rope_table,
    softmax_table,
)
from eggroll_dist.shared.loss import token_loss, true_bits, zipf_bias
from eggroll_dist.shared.model import init_params, param_specs
from eggroll_dist.shared.noise import init_values, noise_block
from eggroll_dist.shared.perturb import MemberNoise, member_noise, pair_noise
from eggroll_dist.shared.sample import SampleSettings, generate

# GELU[j + 128] for j = -36..127 (below -35 every entry is 0).
GELU_FROM_MINUS_36 = (
    0, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -2, -2, -2, -2,
    -2, -2, -2, -2, -3, -3, -3, -3, -3, -3, -3, -3, -2, -2, -2, -2,
    -2, -1, -1, 0, 0, 1, 1, 2, 2, 3, 4, 5, 6, 6, 7, 8,
    9, 10, 11, 12, 13, 15, 16, 17, 18, 19, 20, 21, 22, 24, 25, 26,
    27, 28, 29, 30, 31, 32, 33, 34, 36, 37, 38, 39, 40, 41, 42, 43,
    44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59,
    60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75,
    76, 77, 78, 79, 80, 81, 82, 83, 84, 85, 86, 87, 88, 89, 90, 91,
    92, 93, 94, 95, 96, 97, 98, 99, 100, 101, 102, 103, 104, 105, 106, 107,
    108, 109, 110, 111, 112, 113, 114, 115, 116, 117, 118, 119, 120, 121, 122, 123,
    124, 125, 126, 127,
)  # fmt: skip

# SOFTMAX[e] for e = 0..72 (beyond 72 every entry is 0).
SOFTMAX_GOLDEN = (
    262144, 220435, 185363, 155871, 131072, 110217, 92681, 77935, 65536, 55108, 46340, 38967,
    32768, 27554, 23170, 19483, 16384, 13777, 11585, 9741, 8192, 6888, 5792, 4870,
    4096, 3444, 2896, 2435, 2048, 1722, 1448, 1217, 1024, 861, 724, 608,
    512, 430, 362, 304, 256, 215, 181, 152, 128, 107, 90, 76,
    64, 53, 45, 38, 32, 26, 22, 19, 16, 13, 11, 9,
    8, 6, 5, 4, 4, 3, 2, 2, 2, 1, 1, 1,
    1,
)  # fmt: skip

# sha256 of rope_table(64, 64): cos then sin, little-endian int32, row-major.
ROPE_64_64_SHA256 = "d27d77e06d54c7dc985a6018fa77cd0b54f0f606b949d28122a09552c08c2fdb"


def _config(
    d_model: int = 8,
    n_layer: int = 2,
    vocab: int = 16,
    seq_len: int = 6,
    noise: str = "uniform",
    sigma_shift: int = 2,
    head_bias: str = "none",
) -> RunConfig:
    return RunConfig(
        model=ModelConfig(
            arch="former",
            vocab_size=vocab,
            n_layer=n_layer,
            d_model=d_model,
            init_seed=3,
            head_bias=head_bias,
        ),
        es=ESConfig(
            population=8, chunk_size=8, seq_len=seq_len, sigma_shift=sigma_shift, noise=noise
        ),
    )


def _random_vectors(cfg: RunConfig, params: dict[str, np.ndarray], seed: int) -> None:
    """Non-trivial gains and biases, so that their noise path is exercised too."""
    rng = np.random.default_rng(seed)
    for spec in param_specs(cfg.model):
        if spec.kind == "vector":
            params[spec.name] = rng.integers(-40, 41, size=spec.shape).astype(np.int8)


# -------------------------------------------------------------------------------- tables


def test_softmax_table_is_golden_and_exact() -> None:
    table = softmax_table()
    assert len(table) == 256
    assert not table.flags.writeable  # cached and shared: nobody may change it
    assert tuple(table[:73].tolist()) == SOFTMAX_GOLDEN
    assert not table[73:].any()
    for e, c in enumerate(table[:73].tolist()):  # c = floor(2**18 * 2**(-e/4))
        assert c**4 <= 1 << (72 - e) < (c + 1) ** 4


def test_gelu_table_is_golden_and_matches_erf() -> None:
    table = gelu_table()
    assert len(table) == 256
    assert not table[: 128 - 36].any()
    assert tuple(table[128 - 36 :].tolist()) == GELU_FROM_MINUS_36
    for j in range(-128, 128):
        exact = j * 0.5 * (1 + math.erf(j / 16 / math.sqrt(2)))  # 16 * gelu(j / 16)
        assert abs(abs(exact - math.floor(exact)) - 0.5) > 1e-6  # no tie: float rounding agrees
        assert table[j + 128] == math.floor(exact + 0.5)


def test_rope_table_is_golden_and_matches_cos_sin() -> None:
    cos, sin = rope_table(64, 64)
    assert cos.shape == sin.shape == (64, 32) and cos.dtype == np.int32
    digest = hashlib.sha256(cos.astype("<i4").tobytes() + sin.astype("<i4").tobytes())
    assert digest.hexdigest() == ROPE_64_64_SHA256
    assert (cos[0] == 1 << 14).all() and not sin[0].any()
    assert cos[1, :4].tolist() == [8852, 11989, 13861, 14949]  # 2**14 cos(10000**(-i/32))
    assert sin[1, :4].tolist() == [13787, 11167, 8735, 6706]
    assert cos[63, :4].tolist() == [16153, -16267, -10565, 2232]
    assert sin[63, :4].tolist() == [2742, -1952, -12523, 16231]
    t = np.arange(64)[:, None]
    theta = 10000.0 ** (-2 * np.arange(32) / 64)
    assert np.abs(cos - (1 << 14) * np.cos(t * theta)).max() <= 0.5 + 1e-9
    assert np.abs(sin - (1 << 14) * np.sin(t * theta)).max() <= 0.5 + 1e-9
    # A longer table extends the shorter one (the generation window reads the same values).
    long_cos, long_sin = rope_table(200, 64)
    assert np.array_equal(long_cos[:64], cos) and np.array_equal(long_sin[:64], sin)


# ------------------------------------------------------------------- integer operations


def test_renorm_scales_the_peak_to_127_rounding_half_up() -> None:
    v = np.array([[10, -5, 0, 3], [-381, 1, 0, 0], [0, 0, 0, 0], [1, -1, 1, -1]])
    want = [
        [127, -63, 0, 38],  # -5 * 12.7 = -63.5 -> -63 (half up); 3 * 12.7 = 38.1 -> 38
        [-127, 0, 0, 0],  # -381 * 127/381 = -127; 1/3 -> 0
        [0, 0, 0, 0],  # peak 0 counts as 1
        [127, -127, 127, -127],
    ]
    assert renorm(v.astype(np.int32)).tolist() == want


def test_rope_rotates_pairs_with_floor_half_up() -> None:
    cos = np.array([[1 << 14], [0], [1 << 13]], dtype=np.int32)  # 1, 0, 0.5
    sin = np.array([[0], [1 << 14], [0]], dtype=np.int32)  # 0, 1, 0
    v = np.array([[3, 5], [3, 5], [3, -3]], dtype=np.int32).reshape(1, 3, 1, 2)
    out = rope(v, cos, sin).reshape(3, 2).tolist()
    assert out[0] == [3, 5]  # position 0: identity
    assert out[1] == [-5, 3]  # a quarter turn
    assert out[2] == [2, -1]  # 1.5 -> 2 and -1.5 -> -1: round half up, by a floor shift


def test_attention_is_the_lut_softmax_mean() -> None:
    # One head of dimension 2, two positions. Query 1 scores key 0 at 0 and key 1 at 256:
    # one table step apart, weights SOFTMAX[1] = 220435 and SOFTMAX[0] = 262144.
    q = np.array([[0, 0], [16, 0]]).reshape(1, 2, 1, 2)
    k = np.array([[0, 0], [16, 0]]).reshape(1, 2, 1, 2)
    v = np.array([[100, -100], [0, 10]]).reshape(1, 2, 1, 2)
    out = attention(q, k, v).reshape(2, 2).tolist()
    assert out[0] == [100, -100]  # position 0 sees only itself: causal
    # (220435 * 100) / 482579 = 45.68 -> 46; (-22043500 + 2621440) / 482579 = -40.25 -> -40
    assert out[1] == [46, -40]
    # A key far below the top gets weight 0: (16129 - 0) >> 8 = 63 -> SOFTMAX[63] = 4.
    q2 = np.array([[0, 0], [127, 0]]).reshape(1, 2, 1, 2)
    k2 = np.array([[0, 0], [127, 0]]).reshape(1, 2, 1, 2)
    out2 = attention(q2, k2, v).reshape(2, 2).tolist()
    assert out2[1] == [0, 10]  # (400 * 2 + 262148) // 524296 = 0; 2621040 / 262148 -> 10


def test_norm_and_mm_floor_on_hand_inputs() -> None:
    cfg = _config(d_model=4, n_layer=1, vocab=4, sigma_shift=0)
    params = init_params(cfg.model)
    params["ln_f"] = np.array([5, 5, 5, 5], dtype=np.int8)
    params["ln_f_bias"] = np.array([0, 1, 0, -1], dtype=np.int8)
    model = FormerModel(cfg, params)
    x = np.array([[[7, -7, 1, 1], [1, -1, 0, 0]]], dtype=np.int32)
    # mean |x| = 16 // 4 = 4: 35 // 4 = 8, -35 // 4 = -9 (floor, not -8), 5 // 4 = 1;
    # second row: 2 // 4 = 0, taken as 1.
    assert model._norm(x, "ln_f", None).tolist() == [[[8, -8, 1, 0], [5, -4, 0, -1]]]

    emb = np.zeros((4, 4), dtype=np.int8)
    emb[0, 0], emb[1, 0], emb[2, 0] = 1, -1, -1
    params["emb"] = emb
    model = FormerModel(cfg, params)
    h = np.array([[[32, 0, 0, 0], [33, 0, 0, 0]]], dtype=np.int32)
    # divisor 16 * isqrt(4) = 32: 32 // 32 = 1, -32 // 32 = -1, -33 // 32 = -2 (floor)
    assert model.head(h)[0, :, :3].tolist() == [[1, -1, -1], [1, -2, -2]]
    # Rank-1 noise, shift 4 + 0: x . b = 96, a = (-1, 0, 2, 0): (96 * -1) >> 4 = -6,
    # (96 * 2) >> 4 = 12; (32 - 6) // 32 = 0, (-32 + 12) // 32 = -1, (33*-1+12)//32 = -1.
    noise = MemberNoise(
        {"emb": np.array([[-1, 0, 2, 0]], dtype=np.int32)},
        {"emb": np.array([[3, 0, 0, 0]], dtype=np.float32)},
        {},
    )
    assert model.head(h, noise)[0, :, :3].tolist() == [[0, -1, -1], [0, -2, -1]]


# ------------------------------------------------------------------------- parameters


def test_deggs_layout_and_parameter_count() -> None:
    m = ModelConfig(arch="former", vocab_size=8192, n_layer=4, d_model=256)
    specs = param_specs(m)
    assert m.heads == 4
    assert sum(math.prod(s.shape) for s in specs) == 5_778_944  # as d-eggs counts it
    assert [s.tensor_id for s in specs] == list(range(len(specs)))
    names = {s.name: s for s in specs}
    assert names["emb"].shape == (8192, 256) and names["emb"].kind == "matrix"
    assert "head" not in names  # tied: the head is the embedding
    assert names["layers.3.down"].shape == (256, 1024)
    assert {s.init for s in specs} == {"gaussian", "small", "sixteen", "zero"}
    assert [s.name for s in specs if s.init == "small"] == ["emb"]
    assert ModelConfig(d_model=64).heads == 1 and ModelConfig(d_model=192).heads == 3
    assert ModelConfig(d_model=8).heads == 1 and ModelConfig(d_model=96, n_head=3).heads == 3
    with pytest.raises(ConfigError, match="heads of an even size"):
        RunConfig(model=ModelConfig(arch="former", d_model=12, n_head=4))  # heads of 3
    with pytest.raises(ConfigError, match="heads of an even size"):
        RunConfig(model=ModelConfig(arch="former", d_model=96, n_head=5))


def test_init_and_pair_noise_follow_the_hashed_streams() -> None:
    cfg = _config(noise="gaussian")
    a, b = init_params(cfg.model), init_params(cfg.model)
    for spec in param_specs(cfg.model):
        assert a[spec.name].dtype == np.int8 and a[spec.name].shape == spec.shape
        assert np.array_equal(a[spec.name], b[spec.name])
    pn = pair_noise(cfg, param_specs(cfg.model), 7, np.array([2, 9]))
    wq = next(s for s in param_specs(cfg.model) if s.name == "layers.1.wq")
    block = noise_block(0, 7, np.array([2, 9]), wq.tensor_id, 0, 16, "gaussian")
    assert np.array_equal(pn.a["layers.1.wq"], block[:, :8])
    assert np.array_equal(pn.b["layers.1.wq"], block[:, 8:])
    assert not np.array_equal(pn.a["layers.0.wq"], pn.a["layers.1.wq"])  # hashed, not added


def test_the_embedding_starts_at_an_eighth_rounded_toward_zero() -> None:
    cfg = _config(d_model=64, vocab=2048)
    spec = next(s for s in param_specs(cfg.model) if s.name == "emb")
    bell = init_values(cfg.model.init_seed, spec.tensor_id, 2048 * 64).astype(np.int64)
    emb = init_params(cfg.model)["emb"].astype(np.int64).reshape(-1)
    assert np.array_equal(emb, np.sign(bell) * (np.abs(bell) // 8))
    assert 1.5 < emb.std() < 2.5 < 14 < bell.std()
    assert abs(emb.mean()) < 0.05  # toward zero: no floor bias


def test_the_initial_former_tiny_starts_at_its_head_bias() -> None:
    """The tied embedding is the head: small, so without a head bias the model starts
    within 0.05 bits of log2(vocab) (at the other matrices' scale the random logits cost
    about half a bit), and with the preset's Zipf bias within 0.05 bits of the bias alone."""
    tiny = preset("former-tiny")
    cfg = tiny.replace(model=ModelConfig(**{**tiny.model.__dict__, "head_bias": "none"}))
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, 2048, size=(8, cfg.es.seq_len + 1))
    params = init_params(cfg.model)

    def mean_bits(cfg: RunConfig, params: dict[str, np.ndarray], tokens: np.ndarray) -> float:
        _, bits = FormerModel(cfg, params).forward(tokens, float_bits=True)
        return bits.sum() / tokens[:, 1:].size

    assert 10.95 < mean_bits(cfg, params, tokens) < 11.05
    spec = next(s for s in param_specs(cfg.model) if s.name == "emb")
    bell = init_values(cfg.model.init_seed, spec.tensor_id, 2048 * 64).reshape(2048, 64)
    assert mean_bits(cfg, {**params, "emb": bell}, tokens) > 11.3
    # Tokens drawn by Zipf's law: the preset scores them as its bias alone would.
    zipf = 1 / np.arange(1, 2048)
    drawn = 1 + rng.choice(2047, size=(8, tiny.es.seq_len + 1), p=zipf / zipf.sum())
    bias = np.broadcast_to(zipf_bias(2048).astype(np.int64), (drawn[:, 1:].size, 2048))
    alone = true_bits(bias, drawn[:, 1:].reshape(-1)).mean()
    assert alone < 9.5  # 1/rank: far below uniform's 11 bits on such tokens
    assert abs(mean_bits(tiny, init_params(tiny.model), drawn) - alone) < 0.05


def test_the_zipf_head_bias_is_golden_and_one_over_rank() -> None:
    table = zipf_bias(2048)
    assert table.dtype == np.int8 and not table.flags.writeable
    # 64 - floor(16 log2 v); id 0 (the separator) starts as the rarest id
    assert table[:10].tolist() == [-111, 64, 48, 39, 32, 27, 23, 20, 16, 14]
    assert table[[100, 1000, 2047]].tolist() == [-42, -95, -111]
    ids = np.arange(1, 2048)
    want = np.clip(64 - np.floor(16 * np.log2(ids) + 1e-9), -127, 127)
    assert np.array_equal(table[1:], want)
    long = zipf_bias(8192)  # clipped in the long tail: 2**(191/16) ~ 3922
    assert long[3922] == -126 and long[3923:].tolist() == [-127] * (8192 - 3923)
    cfg = _config(vocab=2048, head_bias="zipf")
    params = init_params(cfg.model)
    assert np.array_equal(params["head_bias"], table)
    assert not init_params(_config(vocab=2048, head_bias="zero").model)["head_bias"].any()
    # Its tensor comes last, so every other tensor keeps its noise stream and start.
    plain = init_params(_config(vocab=2048).model)
    assert list(params)[:-1] == list(plain) and list(params)[-1] == "head_bias"
    assert all(np.array_equal(params[name], w) for name, w in plain.items())


def test_the_head_bias_is_added_to_the_logits_and_clipped() -> None:
    cfg = _config(vocab=24, head_bias="zero")
    params = init_params(cfg.model)
    tokens = np.random.default_rng(6).integers(0, 24, size=(2, cfg.es.seq_len))
    plain = FormerModel(cfg, params).logits(tokens)
    params["head_bias"] = np.where(np.arange(24) % 2, 127, -127).astype(np.int8)
    biased = FormerModel(cfg, params).logits(tokens)
    total = plain + params["head_bias"]
    assert np.array_equal(biased, np.clip(total, -127, 127))
    assert total.max() > 127 and total.min() < -127  # both clips were exercised


# ------------------------------------------------------------------- explicit reference


def _reference_member_losses(cfg, params, noise, k: int, sign: int, tokens) -> list[int]:
    """One member, written out plainly: an explicit perturbed copy of every weight, one
    position at a time with a list of keys and values, Python-int attention."""
    shift = 4 + cfg.es.sigma_shift
    d = cfg.model.d_model
    heads = cfg.model.heads
    dh = d // heads
    cos, sin = rope_table(cfg.es.seq_len, dh)
    gelu, soft = gelu_table(), softmax_table()
    specs = {s.name: s for s in param_specs(cfg.model)}
    weights = {  # 2**shift * W + sign * a b^T, exact int64: the head and input share "emb"
        name: (params[name].astype(np.int64) << shift)
        + sign * np.outer(noise.a[name][k].astype(np.int64), noise.b[name][k])
        for name, s in specs.items()
        if s.kind == "matrix"
    }

    def vector(name):
        delta = (sign * noise.u[name][k].astype(np.int64)) >> shift
        return np.clip(params[name].astype(np.int64) + delta, -127, 127)

    def mm(x, name):
        acc = (weights[name] @ x) >> shift
        return np.clip(acc // (16 * isqrt(specs[name].shape[1])), -127, 127)

    def norm(x, name):
        mav = max(int(np.abs(x).sum()) // d, 1)
        return np.clip((x * vector(name)) // mav + vector(name + "_bias"), -127, 127)

    def rn(v):
        m = max(int(np.abs(v).max()), 1)
        return (254 * v + m) // (2 * m)

    def rot(v, t):
        out = v.copy()
        for h in range(heads):
            for i in range(dh // 2):
                e, o = int(v[h * dh + 2 * i]), int(v[h * dh + 2 * i + 1])
                c, s = int(cos[t, i]), int(sin[t, i])
                out[h * dh + 2 * i] = (e * c - o * s + (1 << 13)) >> 14
                out[h * dh + 2 * i + 1] = (e * s + o * c + (1 << 13)) >> 14
        return out

    def mlp(x, p, ln):
        up = np.clip(mm(norm(x, p + ln), p + "up") + vector(p + "up_bias"), -127, 127)
        return rn(x + mm(gelu[up + 128], p + "down") + vector(p + "down_bias"))

    caches = [([], []) for _ in range(cfg.model.n_layer)]
    losses = []
    for t in range(len(tokens) - 1):
        x = np.clip((weights["emb"][tokens[t]] >> shift) + vector("emb_bias"), -127, 127)
        x = mlp(x, "emb_mlp.", "ln")
        for i, (keys, values) in enumerate(caches):
            p = f"layers.{i}."
            n = norm(x, p + "ln1")
            q = rn(rot(mm(n, p + "wq"), t))
            keys.append(rn(rot(mm(n, p + "wk"), t)))
            values.append(rn(mm(n, p + "wv")))
            out = np.zeros(d, dtype=np.int64)
            for h in range(heads):
                part = slice(h * dh, (h + 1) * dh)
                scores = [int(q[part] @ key[part]) for key in keys]
                w = [int(soft[min((max(scores) - s) >> 8, 255)]) for s in scores]
                for j in range(part.start, part.stop):
                    num = sum(wc * int(val[j]) for wc, val in zip(w, values, strict=True))
                    out[j] = (2 * num + sum(w)) // (2 * sum(w))
            x = rn(x + mm(out, p + "wo"))
            x = mlp(x, p, "ln2")
        logits = mm(norm(x, "ln_f"), "emb")
        if "head_bias" in specs:
            logits = np.clip(logits + vector("head_bias"), -127, 127)
        losses.append(int(token_loss(logits[None, :], np.array([tokens[t + 1]]))[0]))
    return losses


@pytest.mark.parametrize(
    "d_model,noise_kind,sigma_shift,head_bias",
    [
        (8, "uniform", 2, "none"),
        (128, "gaussian", 4, "none"),
        (16, "uniform", 0, "none"),
        (16, "gaussian", 0, "zipf"),  # the bias randomised like the other vectors
    ],
)
def test_rank1_forward_equals_explicit_perturbed_weights(
    d_model: int, noise_kind: str, sigma_shift: int, head_bias: str
) -> None:
    cfg = _config(
        d_model=d_model, vocab=24, noise=noise_kind, sigma_shift=sigma_shift, head_bias=head_bias
    )
    params = init_params(cfg.model)
    _random_vectors(cfg, params, 0)
    pairs = np.array([0, 5, 123])
    pn = pair_noise(cfg, param_specs(cfg.model), 11, pairs)
    tokens = np.random.default_rng(1).integers(0, 24, size=(len(pairs), cfg.es.seq_len + 1))
    model = FormerModel(cfg, params)
    noise = member_noise(pn, params, sigma_shift)
    loss, bits = model.forward(np.repeat(tokens, 2, axis=0), noise, float_bits=True)
    per_position, _ = model.position_losses(np.repeat(tokens, 2, axis=0), noise)
    assert loss.dtype == np.int64 and bits is not None and bits.shape == loss.shape
    for k in range(len(pairs)):
        for j, sign in enumerate((1, -1)):
            want = _reference_member_losses(cfg, params, pn, k, sign, tokens[k])
            assert per_position[2 * k + j].tolist() == want
            assert loss[2 * k + j] == sum(want)
    assert np.any(loss[0::2] != loss[1::2])  # antithetic members differ


def test_unperturbed_forward_equals_zero_noise_reference() -> None:
    cfg = _config(d_model=16)
    params = init_params(cfg.model)
    _random_vectors(cfg, params, 1)
    tokens = np.random.default_rng(2).integers(0, 16, size=(2, cfg.es.seq_len + 1))
    pn = pair_noise(cfg, param_specs(cfg.model), 0, np.arange(2))
    zero = type(pn)(
        pn.pairs,
        {k: v * 0 for k, v in pn.a.items()},
        {k: v * 0 for k, v in pn.b.items()},
        {k: v * 0 for k, v in pn.u.items()},
    )
    loss, _ = FormerModel(cfg, params).forward(tokens)
    for k in range(2):
        assert loss[k] == sum(_reference_member_losses(cfg, params, zero, k, 1, tokens[k]))


def test_extreme_weights_at_width_256_do_not_overflow() -> None:
    """All weights and vectors at +-127, the largest noise: the int32 path still equals the
    int64 reference (an int32 overflow would wrap silently and differ)."""
    cfg = _config(
        d_model=256,
        n_layer=1,
        vocab=32,
        seq_len=3,
        noise="gaussian",
        sigma_shift=0,
        head_bias="zero",
    )
    rng = np.random.default_rng(3)
    params = {}
    for spec in param_specs(cfg.model):
        signs = rng.integers(0, 8, size=spec.shape) > 0  # mostly +127: sums pile up
        params[spec.name] = np.where(signs, 127, -127).astype(np.int8)
    pn = pair_noise(cfg, param_specs(cfg.model), 1, np.array([4]))
    tokens = np.array([[1, 2, 3, 4]])
    loss, _ = FormerModel(cfg, params).forward(
        np.repeat(tokens, 2, axis=0), member_noise(pn, params, 0)
    )
    for j, sign in enumerate((1, -1)):
        assert loss[j] == sum(_reference_member_losses(cfg, params, pn, 0, sign, tokens[0]))


# ---------------------------------------------------------------- determinism, causality


def test_forward_is_deterministic_and_independent_of_blocking(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg = _config(d_model=16, vocab=40, head_bias="zipf")
    params = init_params(cfg.model)
    pn = pair_noise(cfg, param_specs(cfg.model), 3, np.arange(5))
    tokens = np.repeat(np.random.default_rng(4).integers(0, 40, size=(5, 7)), 2, axis=0)
    noise = member_noise(pn, params, cfg.es.sigma_shift)
    first = FormerModel(cfg, params).position_losses(tokens, noise, float_bits=True)
    again = FormerModel(cfg, params).position_losses(tokens, noise, float_bits=True)
    assert first[0].tobytes() == again[0].tobytes() and first[1].tobytes() == again[1].tobytes()
    # Members one by one with the head in spans of part of a row; three members per block
    # with head blocks of two rows or of more rows than the block has.
    for positions, logits in ((1, 40 * 4), (18, 40 * 12), (18, 1 << 22), (6 * 4, 40 * 18)):
        monkeypatch.setattr(former, "BLOCK_POSITIONS", positions)
        monkeypatch.setattr(former, "BLOCK_LOGITS", logits)
        loss, bits = FormerModel(cfg, params).position_losses(tokens, noise, float_bits=True)
        assert loss.tobytes() == first[0].tobytes() and bits.tobytes() == first[1].tobytes()


def test_later_tokens_do_not_change_earlier_losses() -> None:
    cfg = _config(d_model=16, vocab=40, seq_len=8)
    params = init_params(cfg.model)
    noise = member_noise(
        pair_noise(cfg, param_specs(cfg.model), 0, np.arange(2)), params, cfg.es.sigma_shift
    )
    tokens = np.repeat(np.random.default_rng(5).integers(0, 40, size=(2, 9)), 2, axis=0)
    model = FormerModel(cfg, params)
    base, _ = model.position_losses(tokens, noise)
    for j in (3, 6, 8):  # token j is the target of position j - 1 and an input after it
        changed = tokens.copy()
        changed[:, j] = (changed[:, j] + 1) % 40
        loss, _ = model.position_losses(changed, noise)
        assert np.array_equal(loss[:, : j - 1], base[:, : j - 1])
        assert np.any(loss[:, j - 1 :] != base[:, j - 1 :])
    prefix, _ = model.position_losses(tokens[:, :5], noise)  # a shorter window agrees too
    assert np.array_equal(prefix, base[:, :4])


def test_windows_longer_than_the_context_are_refused() -> None:
    cfg = _config(seq_len=4)
    model = FormerModel(cfg, init_params(cfg.model))
    with pytest.raises(ValueError, match="exceed the context"):
        model.forward(np.zeros((1, 6), dtype=np.int64))


# --------------------------------------------------------------------------- generation


def test_generator_steps_equal_the_window_logits_and_slide_past_the_context() -> None:
    cfg = _config(d_model=16, vocab=40, seq_len=5)
    params = init_params(cfg.model)
    gen = FormerGenerator(cfg, params)
    model = FormerModel(cfg, params)
    state, logits = gen.start()
    history = [0]
    assert np.array_equal(logits, model.logits(np.array([history]))[0, -1])
    for tok in [3, 9, 1, 4, 4, 7, 2]:  # beyond seq_len: the window slides
        state, logits = gen.step(state, tok)
        history.append(tok)
        window = history[-cfg.es.seq_len :]
        assert state == window
        assert np.array_equal(logits, model.logits(np.array([window]))[0, -1])
    settings = SampleSettings()
    tokens = list(generate(gen, [1, 2, 3], 3 * cfg.es.seq_len, settings, seed=5))
    assert len(tokens) == 3 * cfg.es.seq_len and all(0 <= t < 40 for t in tokens)
    assert tokens == list(generate(gen, [1, 2, 3], 3 * cfg.es.seq_len, settings, seed=5))
