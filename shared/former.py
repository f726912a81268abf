"""The former: d-eggs' int8 transformer, NumPy reference, every number specified in integers.

Activations are int8 in [-127, 127] (16 = 1.0 after a norm), weights int8, accumulation int32
(int64 only where stated), floor shifts and floor division everywhere (never C truncation,
never a float rounding). The CuPy backend mirrors this file and must match it exactly.

    x = clip(EMB[token] + emb_bias)                           # (M, T, D), the tied embedding
    x = MLP(x, "emb_mlp.")                                    # the embedding MLP
    for each layer:
        n = NORM(x, ln1)
        q = R(ROPE(MM(n, wq))); k = R(ROPE(MM(n, wk))); v = R(MM(n, wv))
        x = R(x + MM(ATTN(q, k, v), wo))
        x = MLP(x, ...)
    logits = MM(NORM(x, ln_f), EMB)                           # (M, T, V), the head is EMB
    logits = clip(logits + head_bias)                         # only with model.head_bias

    MLP(x)    = R(x + MM(GELU[clip(MM(NORM(x, ln), up) + up_bias)], down) + down_bias)
    MM(x, W)  = clip((x @ W^T + (((x . b) * a) >> (4 + sigma_shift))) // (16 * isqrt(in)))
    NORM(x)   = clip((x * w) // max(sum|x| // D, 1) + bias)   # mean-absolute-value norm
    R(v)      = (254 * v + m) // (2 * m), m = max(max|v|, 1)  # max-abs to 127, round half up
    ATTN      per head, causal: s_c = q . k_c (c <= t), e_c = min((max_c s_c - s_c) >> 8, 255),
              w_c = SOFTMAX[e_c], out = (2 * sum w_c v_c + sum w_c) // (2 * sum w_c)   (int64)
    ROPE      each head's pairs (e, o) = (v[2i], v[2i+1]) at position t, c/s = ROPE_COS/SIN[t, i]:
              ((e * c - o * s + 2**13) >> 14, (e * s + o * c + 2**13) >> 14)

Tables (each pinned by golden tests):
    SOFTMAX[e] = floor(2**18 * 2**(-e/4)) = isqrt(isqrt(2**(72 - e))), 0 for e > 72
                 (d-eggs: round(2**18 * exp(-e/6)); 2**(-1/4) per step is within 4% of exp(-1/6)
                 and exact in integers)
    GELU[j]    = round_half_up(16 * gelu(j / 16)) for j in -128..127, gelu(z) = z * Phi(z)
    ROPE       = round_half_up(2**14 * cos / sin(t * 10000**(-2i / head_dim)))
GELU and ROPE are computed in `decimal` arithmetic at 60 digits, which is software, the same
on every machine (exp and ln correctly rounded; the series below are plain arithmetic).

Noise and MM are shared/perturb.py's: member m perturbs every matrix W by the rank-1
`a_m b_m^T` (a carries the antithetic sign) and every vector p by `(sign * u1 * u2) >> shift`.
The tied embedding has ONE stream used both ways: its row for the input token is the row of
the perturbed matrix, `EMB[tok] + (a[tok] * b) >> shift`, and the head is MM with the same a, b
(d-eggs perturbed the embedding and the head with two different streams). Both are
`(2**s W + a b^T) >> s` applied exactly, which is what the tests materialise per member.

The head bias (model.head_bias, not in d-eggs) is a vector over the vocabulary with the
vectors' noise: it carries the marginal, so the hidden state does not have to (without it
the final hidden states collapse toward one direction that carries it). Its "zipf" start
(shared.loss.zipf_bias) gives a vocabulary ranked by frequency p(v) ~ 1/v from the outset.

Positions: RoPE positions are 0..seq_len-1 within a window; generation slides a window of at
most seq_len tokens, so no position beyond the table is ever read (d-eggs read past its table).
"""

from __future__ import annotations

from decimal import Context, Decimal, localcontext
from functools import cache
from math import isqrt
from typing import TYPE_CHECKING

import numpy as np

from .loss import token_loss, true_bits
from .matmul import clip8, floor_div, frozen
from .perturb import INT8, MemberNoise, ParamSpec, int8_settings, perturbed_mm, perturbed_rows

if TYPE_CHECKING:
    from .config import ModelConfig, RunConfig

SOFTMAX_BITS = 18  # SOFTMAX[0] = 2**18
SOFTMAX_SHIFT = 8  # score units per softmax table step
ROPE_BITS = 14  # cos and sin in 1/2**14: |v * c| <= 127 * 2**14 keeps ROPE in int32
ROPE_BASE = 10000
# Positions (member rows x tokens) per block of the forward pass, and logits per block of
# the head: bounds the memory of one call whatever the population and vocabulary.
BLOCK_POSITIONS = 8192
BLOCK_LOGITS = 1 << 22

# ---------------------------------------------------------------------------- parameters


@cache
def specs(m: ModelConfig) -> tuple[ParamSpec, ...]:
    """d-eggs' tensors in its order (matrices are (out, in); the attention has no biases):
    the embedding (vocab, D) and its bias, the embedding MLP (norm gain and bias, up (4D, D)
    and its bias, down (D, 4D) and its bias), per layer a norm, Q, K, V, O (D, D) and an MLP
    like the embedding's, then the final norm. At width 256, 4 layers and vocabulary 8192
    that is d-eggs' 5,778,944 weights.

    The embedding starts at an eighth of the other matrices' scale: it is also the head, and
    at their scale its random logits spread by ~1.25 bits, which training first has to undo
    (at 1/8 the initial loss is within 0.01 bits of log2(vocab))."""
    d, f, v = m.d_model, 4 * m.d_model, m.vocab_size

    def mlp(p: str, ln: str) -> list[tuple[str, tuple[int, ...], str, str]]:
        return [
            (p + ln, (d,), "vector", "sixteen"),
            (p + ln + "_bias", (d,), "vector", "zero"),
            (p + "up", (f, d), "matrix", "gaussian"),
            (p + "up_bias", (f,), "vector", "zero"),
            (p + "down", (d, f), "matrix", "gaussian"),
            (p + "down_bias", (d,), "vector", "zero"),
        ]

    layout = [("emb", (v, d), "matrix", "small"), ("emb_bias", (d,), "vector", "zero")]
    layout += mlp("emb_mlp.", "ln")
    for i in range(m.n_layer):
        p = f"layers.{i}."
        layout += [
            (p + "ln1", (d,), "vector", "sixteen"),
            (p + "ln1_bias", (d,), "vector", "zero"),
            (p + "wq", (d, d), "matrix", "gaussian"),
            (p + "wk", (d, d), "matrix", "gaussian"),
            (p + "wv", (d, d), "matrix", "gaussian"),
            (p + "wo", (d, d), "matrix", "gaussian"),
        ]
        layout += mlp(p, "ln2")
    layout += [("ln_f", (d,), "vector", "sixteen"), ("ln_f_bias", (d,), "vector", "zero")]
    if m.head_bias != "none":  # last: the other tensors keep their noise streams
        layout += [("head_bias", (v,), "vector", m.head_bias)]
    return tuple(ParamSpec(n, s, k, i, tid) for tid, (n, s, k, i) in enumerate(layout))


FAMILY, EXACT, OWN_TOKENIZER = INT8  # the int8 family's answers (shared/perturb.py)


def check(cfg: RunConfig) -> str | None:
    """RoPE rotates pairs of a head's dimensions: each head needs an even size."""
    m = cfg.model
    if m.d_model % m.heads or (m.d_model // m.heads) % 2:
        return f"model.d_model={m.d_model} must split into {m.heads} heads of an even size"
    return int8_settings(cfg)


# -------------------------------------------------------------------------------- tables


@cache
def softmax_table() -> np.ndarray:
    """SOFTMAX[e] = floor(2**18 * 2**(-e/4)) for e in 0..255: floor of a fourth root is
    isqrt(isqrt(.)), exact; 2**(72 - e) < 1 gives 0 beyond e = 72."""
    top = 4 * SOFTMAX_BITS
    return frozen([isqrt(isqrt(1 << (top - e))) if e <= top else 0 for e in range(256)])


def _round_half_up(x: Decimal) -> int:
    return int((x + Decimal("0.5")).to_integral_value(rounding="ROUND_FLOOR"))


def _ctx() -> Context:
    return Context(prec=60)


TINY = Decimal(10) ** -70  # series stop once a term is below this (60 digits: noise)


def _pi() -> Decimal:
    """pi by Machin's formula, 16 atan(1/5) - 4 atan(1/239), as plain series arithmetic."""

    def atan_inv(n: int) -> Decimal:
        total, term, k = Decimal(0), Decimal(1) / n, 0
        while term > TINY:
            total += term / (2 * k + 1) * (-1 if k % 2 else 1)
            term /= n * n
            k += 1
        return total

    return 16 * atan_inv(5) - 4 * atan_inv(239)


def _phi(z: Decimal, pi: Decimal) -> Decimal:
    """The standard normal CDF: 1/2 + pdf(z) * sum z**(2n+1) / (1 * 3 * ... * (2n+1)),
    a series whose terms share z's sign (no cancellation) and converges for every z."""
    total, term, n = Decimal(0), z, 0
    while abs(term) > TINY:
        total += term
        n += 1
        term = term * z * z / (2 * n + 1)
    pdf = (-z * z / 2).exp() / (2 * pi).sqrt()
    return Decimal("0.5") + pdf * total


@cache
def gelu_table() -> np.ndarray:
    """GELU[j + 128] = round_half_up(16 * gelu(j / 16)) = round_half_up(j * Phi(j / 16)),
    for int8 j; values in [-3, 127]."""
    with localcontext(_ctx()):
        pi = _pi()
        values = [_round_half_up(j * _phi(Decimal(j) / 16, pi)) for j in range(-128, 128)]
    return frozen(np.clip(values, -127, 127), np.int32)


@cache
def rope_table(positions: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin), each (positions, head_dim // 2) int32 in 1/2**14: entry [t, i] is
    round_half_up(2**14 * cos / sin(t * theta_i)), theta_i = 10000**(-2i / head_dim).

    e**(i theta) is a Taylor series (theta <= 1), its powers complex products; at 60 digits
    the accumulated error stays far below the rounding step for any window length."""
    half = head_dim // 2
    cos = np.zeros((positions, half), dtype=np.int32)
    sin = np.zeros((positions, half), dtype=np.int32)
    scale = 1 << ROPE_BITS
    with localcontext(_ctx()):
        ln_base = Decimal(ROPE_BASE).ln()
        for i in range(half):
            theta = (-ln_base * 2 * i / head_dim).exp()
            c, s, term, k = Decimal(0), Decimal(0), Decimal(1), 0
            while term > TINY:  # term = theta**k / k!, into cos or sin by k mod 4
                if k % 2 == 0:
                    c += term if k % 4 == 0 else -term
                else:
                    s += term if k % 4 == 1 else -term
                k += 1
                term = term * theta / k
            rc, rs = Decimal(1), Decimal(0)  # cos, sin of t * theta
            for t in range(positions):
                cos[t, i] = _round_half_up(rc * scale)
                sin[t, i] = _round_half_up(rs * scale)
                rc, rs = rc * c - rs * s, rs * c + rc * s
    return frozen(cos, np.int32), frozen(sin, np.int32)


# ---------------------------------------------------------------------- integer operations


def renorm(v: np.ndarray) -> np.ndarray:
    """R: scale the last axis to a peak of 127, round half up: (254 v + m) // (2 m).
    |v| <= m, so the result is in [-127, 127]; callers keep |v| <= 2**22 (int32 products)."""
    m = np.maximum(np.abs(v).max(axis=-1, keepdims=True), 1)
    return floor_div(254 * v + m, 2 * m)


def rope(v: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate pairs (2i, 2i+1) of v (M, T, H, dh) by position; cos/sin (T, dh/2).
    |v| <= 127 and |cos|, |sin| <= 2**14: each sum stays under 2**23 in int32."""
    even, odd = v[..., 0::2], v[..., 1::2]
    c, s = cos[:, None, :], sin[:, None, :]
    half = 1 << (ROPE_BITS - 1)
    out = np.empty_like(v)
    out[..., 0::2] = (even * c - odd * s + half) >> ROPE_BITS
    out[..., 1::2] = (even * s + odd * c + half) >> ROPE_BITS
    return out


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int = 0) -> np.ndarray:
    """Causal LUT-softmax attention per head; q (M, Tq, H, dh) at positions start.. start +
    Tq - 1, k and v (M, T, H, dh) at positions 0..T-1, all int8-valued.

    Scores |q . k| <= dh * 127**2 < 2**24 (dh <= 1024): exact in a float32 GEMM and in int32.
    The weighted sums reach T * 2**18 * 127 and are exact int64 (float64 below 2**53)."""
    t, keys = q.shape[1], k.shape[1]
    qh = q.transpose(0, 2, 1, 3).astype(np.float32)  # (M, H, Tq, dh)
    kh = k.transpose(0, 2, 3, 1).astype(np.float32)  # (M, H, dh, T)
    scores = (qh @ kh).astype(np.int32)  # (M, H, Tq, T): query t, key c
    causal = np.tril(np.ones((t, keys), dtype=bool), k=start)  # key c <= start + t
    scores = np.where(causal, scores, np.iinfo(np.int32).min)
    top = scores.max(axis=-1, keepdims=True)
    steps = np.minimum((top.astype(np.int64) - scores) >> SOFTMAX_SHIFT, 255)
    w = softmax_table()[steps]  # int64; masked keys give step 255: weight 0
    num = (w.astype(np.float64) @ v.transpose(0, 2, 1, 3).astype(np.float64)).astype(np.int64)
    den = w.sum(axis=-1, keepdims=True)  # >= 2**18: the top key has step 0
    out = np.floor_divide(2 * num + den, 2 * den)  # round half up; in [-127, 127]
    return out.transpose(0, 2, 1, 3).astype(np.int32)


# ------------------------------------------------------------------------------- model


class FormerModel:
    """Forward pass of the former for a batch of members (or unperturbed rows)."""

    carries_state = False  # reads each window whole: there is no state to carry

    def __init__(self, cfg: RunConfig, params: dict[str, np.ndarray]):
        self.cfg = cfg
        self.params = params
        self.heads = cfg.model.heads
        self.context = cfg.es.seq_len
        self.rope = rope_table(self.context, cfg.model.d_model // self.heads)
        self.gelu = gelu_table()
        # float32 transposes for exact BLAS GEMMs (|x|, |w| <= 127; see matmul.py).
        self.wt = {
            s.name: np.ascontiguousarray(params[s.name].T, dtype=np.float32)
            for s in specs(cfg.model)
            if s.kind == "matrix"
        }

    def _mm(self, x: np.ndarray, name: str, noise: MemberNoise | None) -> np.ndarray:
        return perturbed_mm(x, self.wt[name], noise, name, self.cfg)  # (M, T, out)

    def _vector(self, name: str, noise: MemberNoise | None) -> np.ndarray:
        """The (member's) vector parameter, shaped to broadcast over (M, T, n)."""
        if noise is None:
            return self.params[name].astype(np.int32)
        return noise.vectors[name][:, None, :]

    def _norm(self, x: np.ndarray, name: str, noise: MemberNoise | None) -> np.ndarray:
        """NORM: |x * w| <= 127**2, the bias <= 127: int32 with room."""
        mav = np.maximum(np.abs(x).sum(axis=-1, keepdims=True) // x.shape[-1], 1)
        scaled = floor_div(x * self._vector(name, noise), mav)
        return clip8(scaled + self._vector(name + "_bias", noise))

    def _mlp(self, x: np.ndarray, p: str, ln: str, noise: MemberNoise | None) -> np.ndarray:
        up = clip8(self._mm(self._norm(x, p + ln, noise), p + "up", noise))
        up = clip8(up + self._vector(p + "up_bias", noise))
        hidden = self.gelu[up + 128]
        down = self._mm(hidden, p + "down", noise)
        return renorm(x + down + self._vector(p + "down_bias", noise))  # |.| <= 381

    def _attn(
        self, x: np.ndarray, layer: int, noise: MemberNoise | None, cache: KVCache | None
    ) -> np.ndarray:
        """The attention block over x (M, T, D); with a cache, x are the positions after the
        cache's and attend to its keys and values too, which it keeps."""
        m, t, d = x.shape
        p, start = f"layers.{layer}.", 0 if cache is None else cache.length
        heads = (m, t, self.heads, d // self.heads)
        cos, sin = self.rope[0][start : start + t], self.rope[1][start : start + t]
        n = self._norm(x, p + "ln1", noise)
        q = renorm(rope(self._mm(n, p + "wq", noise).reshape(heads), cos, sin).reshape(m, t, d))
        k = renorm(rope(self._mm(n, p + "wk", noise).reshape(heads), cos, sin).reshape(m, t, d))
        v = renorm(self._mm(n, p + "wv", noise))
        k, v = k.reshape(heads), v.reshape(heads)
        if cache is not None:
            k, v = cache.append(layer, k, v)
        out = attention(q.reshape(heads), k, v, start).reshape(m, t, d)
        return renorm(x + self._mm(out, p + "wo", noise))  # |.| <= 254

    def _embed(self, inputs: np.ndarray, noise: MemberNoise | None) -> np.ndarray:
        x = perturbed_rows(self.params["emb"], inputs, noise, "emb", self.cfg)  # (M, T, D)
        return clip8(x + self._vector("emb_bias", noise))

    def hidden(
        self, inputs: np.ndarray, noise: MemberNoise | None = None, cache: KVCache | None = None
    ) -> np.ndarray:
        """The normed final hidden state (M, T, D) after each of inputs (M, T), T <= seq_len;
        with a cache, inputs follow the positions it holds, and it keeps theirs too."""
        start = 0 if cache is None else cache.length
        if start + inputs.shape[1] > self.context:
            raise ValueError(
                f"{start + inputs.shape[1]} positions exceed the context {self.context}"
            )
        x = self._mlp(self._embed(inputs, noise), "emb_mlp.", "ln", noise)
        for i in range(self.cfg.model.n_layer):
            x = self._mlp(self._attn(x, i, noise, cache), f"layers.{i}.", "ln2", noise)
        if cache is not None:
            cache.length += inputs.shape[1]
        return self._norm(x, "ln_f", noise)

    def cache(self, rows: int) -> KVCache:
        """An empty key-value cache of `rows` rows over the whole context."""
        m = self.cfg.model
        return KVCache(rows, m.n_layer, self.context, self.heads, m.d_model // self.heads)

    def head(self, h: np.ndarray, noise: MemberNoise | None = None) -> np.ndarray:
        """Logits (M, T, V) of hidden states h (M, T, D): MM with the embedding itself,
        plus the head bias if the model has one."""
        logits = self._mm(h, "emb", noise)
        if self.cfg.model.head_bias != "none":
            logits = clip8(logits + self._vector("head_bias", noise))
        return logits

    def logits(self, inputs: np.ndarray, noise: MemberNoise | None = None) -> np.ndarray:
        """Logits (M, T, V) after each of inputs (M, T): base-2 log-odds in 1/16 bit."""
        return self.head(self.hidden(inputs, noise), noise)

    def decoder(self, noise: MemberNoise | None, rows: int) -> FormerDecoder:
        """`rows` rows (members, or unperturbed rows) reading one token at a time."""
        return FormerDecoder(self, noise, rows)

    def position_losses(
        self, tokens: np.ndarray, noise: MemberNoise | None = None, float_bits: bool = False
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Integer loss (M, T) int64 of each position predicting tokens[:, 1:], and if
        asked the exact float64 bits; computed in blocks of members and of positions."""
        m, t = tokens.shape[0], tokens.shape[1] - 1
        v = self.cfg.model.vocab_size
        loss = np.zeros((m, t), dtype=np.int64)
        bits = np.zeros((m, t), dtype=np.float64) if float_bits else None
        members = max(1, BLOCK_POSITIONS // t)
        rows, cols = max(1, BLOCK_LOGITS // (v * t)), min(t, max(1, BLOCK_LOGITS // v))
        for lo in range(0, m, members):
            hi = min(lo + members, m)
            part = None if noise is None else noise.rows(lo, hi)
            h = self.hidden(tokens[lo:hi, :t], part)
            for r in range(lo, hi, rows):  # head blocks: whole rows, or spans of one row
                r_hi = min(r + rows, hi)
                sub = None if part is None else part.rows(r - lo, r_hi - lo)
                for c in range(0, t, cols):
                    c_hi = min(c + cols, t)
                    logits = self.head(h[r - lo : r_hi - lo, c:c_hi], sub).reshape(-1, v)
                    target = tokens[r:r_hi, c + 1 : c_hi + 1].reshape(-1)
                    shape = (r_hi - r, c_hi - c)
                    loss[r:r_hi, c:c_hi] = token_loss(logits, target).reshape(shape)
                    if bits is not None:
                        bits[r:r_hi, c:c_hi] = true_bits(logits, target).reshape(shape)
        return loss, bits

    def forward(
        self, tokens: np.ndarray, noise: MemberNoise | None = None, float_bits: bool = False
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Score rows of tokens (M, T + 1): predict tokens[:, 1:] from the prefix.

        Returns the integer loss per row (sum over T tokens, 1/16 bit units, int64) and,
        if asked, the exact float64 bits per row for reporting (as EggModel.forward)."""
        loss, bits = self.position_losses(tokens, noise, float_bits)
        return loss.sum(axis=1), None if bits is None else bits.sum(axis=1)


class KVCache:
    """Each layer's keys and values (M, T, H, dh) of the first `length` positions of a
    window. Position t's depend only on tokens <= t and on RoPE at t, so while a window
    grows from its start they stay valid and each new position appends its own."""

    def __init__(self, rows: int, layers: int, context: int, heads: int, head_dim: int):
        shape = (layers, rows, context, heads, head_dim)
        self.k = np.zeros(shape, dtype=np.int8)  # renormed: in [-127, 127]
        self.v = np.zeros(shape, dtype=np.int8)
        self.length = 0

    def append(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Keep the new positions' k, v (M, T, H, dh); every position's so far."""
        end = self.length + k.shape[1]
        self.k[layer, :, self.length : end] = k
        self.v[layer, :, self.length : end] = v
        return self.k[layer, :, :end], self.v[layer, :, :end]


class FormerDecoder:
    """Rows that read a token each per call (shared.sample.Decoder). While the history fits
    the context, a read computes only the new position against the cached keys and values.
    Past it the window slides, every position's RoPE angle moves, and each read computes
    the whole window again (quadratic there; generation rarely outruns the context)."""

    def __init__(self, model: FormerModel, noise: MemberNoise | None, rows: int):
        self.model, self.noise = model, noise
        self.history = np.zeros((rows, 0), dtype=np.int64)
        self.kv: KVCache | None = model.cache(rows)

    def read(self, tokens: np.ndarray) -> np.ndarray:
        self.history = np.concatenate([self.history, tokens[:, None]], axis=1)
        if self.kv is not None and self.history.shape[1] <= self.model.context:
            h = self.model.hidden(self.history[:, -1:], self.noise, self.kv)
        else:
            self.kv = None  # slid: the cache's positions are gone for good
            self.history = self.history[:, -self.model.context :]
            h = self.model.hidden(self.history, self.noise)[:, -1:]
        return self.model.head(h, self.noise)[:, 0]


class FormerGenerator:
    """The unperturbed former one token at a time, for `shared.sample.generate`.

    The state is the token history, at most seq_len tokens (the window the model was
    trained on and its RoPE table's length). A one-row FormerDecoder follows it: a step
    that continues the history it last read costs one position (until the window slides);
    any other state is read afresh. Generation starts where a document starts: after token 0.
    """

    def __init__(self, cfg: RunConfig, params: dict[str, np.ndarray]):
        self.model = FormerModel(cfg, params)
        self.vocab_size = cfg.model.vocab_size
        self.context = cfg.es.seq_len
        self._decoder: FormerDecoder | None = None

    def start(self) -> tuple[list[int], np.ndarray]:
        return self.step([], 0)

    def step(self, state: list[int], token: int) -> tuple[list[int], np.ndarray]:
        decoder = self._decoder
        if decoder is None or decoder.history[0].tolist() != state:
            decoder = self._decoder = self.model.decoder(None, 1)
            for tok in state:  # another history: read it afresh
                decoder.read(np.array([tok], dtype=np.int64))
        logits = decoder.read(np.array([token], dtype=np.int64))
        return decoder.history[0].tolist(), logits[0]


MODEL = FormerModel
GENERATOR = FormerGenerator
