"""The EGG model (nano-egg's integer minGRU language model), NumPy reference.

Everything is integer: int8 weights in [-127, 127], int32 accumulation, floor shifts and
floor division (never C truncation), clip to [-127, 127]. Activations are fixed point with
16 = 1.0. The CuPy backend mirrors this file kernel by kernel and must match it exactly.

    x = EMB[token]                                   # (M, D)  one row per population member
    for each layer (state s starts at 0, and is reset where the input token is 0):
        h = LN1(x)
        f = clip(MM(h, Wf) + MM(s, Uf) + bf)         # gate logits, no sigmoid
        g = ((f + 127) * s) >> 8
        c = clip(MM(h, Wh) + MM(g, Uh) + bh)         # candidate, no tanh
        s = s + (((f + 127) * (c - s)) >> 8)         # new state = layer output
        x = clip(x + s)
        x = clip(x + MM(MM(LN2(x), W1), W2))         # MLP: D -> 4D -> D, no activation
    logits = MM(LN_out(x), HEAD)                     # (M, V), base-2 log-odds in 1/16 bits

    MM(x, W)  = clip((x @ W^T + (((x . b) * a) >> (4 + sigma_shift))) // (16 * isqrt(in)))
    LN(x)     = clip((x * w) // max(sum|x| // D, 1)) # mean-absolute-value norm

Each member m perturbs every matrix W by the rank-1 `a_m b_m^T` (a carries the member's
antithetic sign) without ever forming a per-member weight copy: the base GEMM is shared by
all members and the correction is one dot product and one scaled vector per member. Vector
parameters get full-rank noise `p + ((sign * u1 * u2) >> (4 + sigma_shift))`, clipped.
With adaptive noise (es.adaptive_noise) a, b and u1 * u2 are first scaled by the replica's
per-row, per-column and per-element factors f in 1/64 units: sign(v) * ((|v| * f) >> 6)
(`pair_noise`; the overlays and their rule are in shared/update.py).

Token noise (es.token_noise_rows = K > 0) perturbs only the token rows (the embedding's,
the EGG head's, the former's head bias) with ids below K: the others get a = 0 (u1 * u2 = 0
for the bias), so their votes are zero and they keep their initial values (but for AdamW's
weight decay). `eggroll-data prepare --tokenizer bpe` ranks ids by training frequency, so
these are the K commonest tokens: with few votes per step, a rare token's row gets almost
no evidence and its z-test moves are mostly false ones, a random walk that inflates rare
tokens' probability; holding those rows still leaves the votes to the rows they can move.

Unlike nano-egg, no hidden state is carried across steps: every antithetic pair reads its
own window of seq_len + 1 tokens (chunks move between workers) and starts from zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from math import isqrt

import numpy as np

from .config import ModelConfig, RunConfig
from .matmul import exact_matmul
from .noise import init_values, noise_block

# ---------------------------------------------------------------------------- parameters


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]  # matrices are (out, in); the embedding is (vocab, D)
    kind: str  # "matrix": rank-1 noise a (out) b (in); "vector": full-rank u1 * u2 noise
    # "gaussian" (int8 bell, std ~16), "small" (the bell / 8 toward zero, std ~2), "sixteen"
    # (1.0 in fixed point), "zero", "zipf" (`zipf_bias`)
    init: str
    tensor_id: int  # the noise stream of this tensor


TOKEN_TENSORS = ("emb", "head", "head_bias")  # rows (matrices) or elements that are token ids
ZIPF_TOP = 64  # the commonest token's starting head bias: 4 bits, leaving headroom below 127


def _read_only(table: np.ndarray) -> np.ndarray:
    """A cached table that no caller can change for the others."""
    table.flags.writeable = False
    return table


@cache
def token_row_factors(vocab_size: int, rows: int) -> np.ndarray:
    """Token noise factors (1/64 units) of rows 0..vocab_size-1: 64 below `rows`, else 0."""
    return _read_only(np.where(np.arange(vocab_size) < rows, 64, 0).astype(np.int32))


@cache
def zipf_bias(vocab_size: int) -> np.ndarray:
    """The "zipf" start of a head bias, in the logits' 1/16 bits: id v >= 1 gets
    clip(64 - floor(16 * log2(v)), -127, 127), so that p(v) ~ 1/v (Zipf's law, when id 1 is
    the commonest token); id 0, the document separator wherever it ranks, gets the rarest
    id's value (a separator is far rarer than the commonest tokens)."""
    ids = np.maximum(np.arange(vocab_size, dtype=np.int64), 1)
    ids[0] = vocab_size - 1
    return _read_only(np.clip(ZIPF_TOP - floor_log2_16(ids), -127, 127).astype(np.int8))


def param_specs(m: ModelConfig) -> tuple[ParamSpec, ...]:
    """Every tensor of the config's architecture, in noise-stream (tensor id) order."""
    if m.arch == "former":
        from .former import former_specs  # former.py builds on this module

        return former_specs(m)
    return egg_specs(m)


@cache
def egg_specs(m: ModelConfig) -> tuple[ParamSpec, ...]:
    d, v = m.d_model, m.vocab_size
    layout: list[tuple[str, tuple[int, ...], str, str]] = [("emb", (v, d), "matrix", "gaussian")]
    for i in range(m.n_layer):
        p = f"layers.{i}."
        layout += [
            (p + "ln1", (d,), "vector", "sixteen"),
            (p + "wf", (d, d), "matrix", "gaussian"),
            (p + "uf", (d, d), "matrix", "gaussian"),
            (p + "bf", (d,), "vector", "zero"),
            (p + "wh", (d, d), "matrix", "gaussian"),
            (p + "uh", (d, d), "matrix", "gaussian"),
            (p + "bh", (d,), "vector", "zero"),
            (p + "ln2", (d,), "vector", "sixteen"),
            (p + "w1", (4 * d, d), "matrix", "gaussian"),
            (p + "w2", (d, 4 * d), "matrix", "gaussian"),
        ]
    layout += [("ln_out", (d,), "vector", "sixteen"), ("head", (v, d), "matrix", "gaussian")]
    return tuple(ParamSpec(n, s, k, i, tid) for tid, (n, s, k, i) in enumerate(layout))


def init_params(m: ModelConfig) -> dict[str, np.ndarray]:
    """Initial int8 weights, a pure function of the model config."""
    params = {}
    for spec in param_specs(m):
        size = int(np.prod(spec.shape))
        if spec.init in ("gaussian", "small"):
            values = init_values(m.init_seed, spec.tensor_id, size)
            if spec.init == "small":  # an eighth, rounded toward zero: still symmetric
                values = np.sign(values) * (np.abs(values) >> 3)
        elif spec.init == "zipf":
            values = zipf_bias(m.vocab_size)
        else:
            values = np.full(size, 16 if spec.init == "sixteen" else 0, dtype=np.int8)
        params[spec.name] = np.clip(values, -127, 127).astype(np.int8).reshape(spec.shape)
    return params


# --------------------------------------------------------------------------------- noise


@dataclass(frozen=True)
class PairNoise:
    """The noise of a block of antithetic pairs, shared by forward pass and update.

    matrices: name -> (a (P, out) int8, b (P, in) int8); vectors: name -> u1*u2 (P, n) int16.
    These are the even (+) member's values; the odd member uses -a and -u1*u2.
    """

    pairs: np.ndarray
    a: dict[str, np.ndarray]
    b: dict[str, np.ndarray]
    u: dict[str, np.ndarray]


@dataclass(frozen=True)
class NoiseScales:
    """Noise factors in 1/64 units (0..64), per tensor name: `rows` scale a matrix's a (its
    out index), `cols` its b (its in index), `elements` a vector's u1 * u2. A tensor absent
    from a dict is not scaled there."""

    rows: dict[str, np.ndarray]
    cols: dict[str, np.ndarray]
    elements: dict[str, np.ndarray]


def scale_noise(values: np.ndarray, factor: np.ndarray) -> np.ndarray:
    """sign(v) * ((|v| * f) >> 6): symmetric in v, so a pair's members stay exact mirrors."""
    v = values.astype(np.int32)
    return (np.sign(v) * ((np.abs(v) * factor.astype(np.int32)) >> 6)).astype(values.dtype)


def pair_noise(
    cfg: RunConfig, step: int, pairs: np.ndarray, scales: NoiseScales | None = None
) -> PairNoise:
    """Regenerate every tensor's noise for these pairs: indices [0, out) are a, then b.
    With `scales` (adaptive or token noise) each value is scaled by its row, column or
    element's factor; the forward pass and the update both use the scaled values."""
    es = cfg.es
    a, b, u = {}, {}, {}
    for spec in param_specs(cfg.model):
        if spec.kind == "matrix":
            out, inp = spec.shape
            block = noise_block(es.run_seed, step, pairs, spec.tensor_id, 0, out + inp, es.noise)
            a[spec.name], b[spec.name] = block[:, :out], block[:, out:]
            if scales is not None and spec.name in scales.rows:
                a[spec.name] = scale_noise(a[spec.name], scales.rows[spec.name])
            if scales is not None and spec.name in scales.cols:
                b[spec.name] = scale_noise(b[spec.name], scales.cols[spec.name])
        else:
            (n,) = spec.shape
            block = noise_block(es.run_seed, step, pairs, spec.tensor_id, 0, 2 * n, es.noise)
            u[spec.name] = block[:, :n].astype(np.int16) * block[:, n:].astype(np.int16)
            if scales is not None and spec.name in scales.elements:
                u[spec.name] = scale_noise(u[spec.name], scales.elements[spec.name])
    return PairNoise(np.asarray(pairs), a, b, u)


@dataclass(frozen=True)
class MemberNoise:
    """Per-member perturbations for 2P members (pair k -> members 2k (+) and 2k+1 (-)).

    a: name -> (M, out) int32 with the sign folded in; b: name -> (M, in) float32;
    vectors: name -> (M, n) int32, the member's perturbed vector parameter itself.
    """

    a: dict[str, np.ndarray]
    b: dict[str, np.ndarray]
    vectors: dict[str, np.ndarray]


def member_noise(noise: PairNoise, params: dict[str, np.ndarray], sigma_shift: int) -> MemberNoise:
    sign = np.tile(np.array([1, -1], dtype=np.int32), len(noise.pairs))[:, None]  # (M, 1)
    shift = 4 + sigma_shift
    a = {k: np.repeat(v.astype(np.int32), 2, axis=0) * sign for k, v in noise.a.items()}
    b = {k: np.repeat(v.astype(np.float32), 2, axis=0) for k, v in noise.b.items()}
    vectors = {}
    for name, u in noise.u.items():
        delta = (np.repeat(u.astype(np.int32), 2, axis=0) * sign) >> shift
        vectors[name] = np.clip(params[name].astype(np.int32) + delta, -127, 127)
    return MemberNoise(a, b, vectors)


# ------------------------------------------------------------------------ integer loss


@cache
def _exp2_table() -> np.ndarray:
    """EXP2[i] = floor(16 * 2**(i/16)) = floor(2**(4 + i/16)) for i in 0..255, exactly."""
    table = []
    for i in range(256):
        # Largest c with c**16 <= 2**(64 + i), by integer bisection (no float rounding).
        lo, hi = 1, 1 << 21
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if mid**16 <= 1 << (64 + i) else (lo, mid - 1)
        table.append(lo)
    return _read_only(np.array(table, dtype=np.int32))  # <= 2**20: 2048 of them fit int32


@cache
def _log2_thresholds() -> np.ndarray:
    """TH[j] = ceil(2**31 * 2**(j/16)) for j = 1..15: the mantissa steps of 16*log2."""
    th = []
    for j in range(1, 16):
        lo, hi = 1 << 31, 1 << 32
        while lo < hi:  # smallest c with c**16 >= 2**(31*16 + j)
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if mid**16 >= 1 << (31 * 16 + j) else (mid + 1, hi)
        th.append(lo)
    return _read_only(np.array(th, dtype=np.int64))


def floor_log2_16(s: np.ndarray) -> np.ndarray:
    """floor(16 * log2(s)) for positive int64 s < 2**53, exactly (replaces a 1 GiB table)."""
    _, exp = np.frexp(s.astype(np.float64))  # s = mant * 2**exp with mant in [0.5, 1): exact
    e = exp.astype(np.int64) - 1  # floor(log2 s)
    left = np.maximum(31 - e, 0)
    right = np.maximum(e - 31, 0)
    mant = (s << left) >> right  # s scaled to [2**31, 2**32); truncation keeps floor exact
    return 16 * e + np.searchsorted(_log2_thresholds(), mant, side="right")


def token_loss(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """-log2 p(target) in 1/16 bit per row: LOG2(sum EXP2[l + 128]) - 64 - (l[target] + 128)."""
    shifted = logits + 128
    total = _exp2_table().take(shifted).sum(axis=1, dtype=np.int64)
    target = shifted[np.arange(len(targets)), targets]
    return floor_log2_16(total) - 64 - target


def true_bits(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """The exact -log2 softmax of logits/16 (base 2), in float64: reporting only."""
    z = logits.astype(np.float64) / 16.0
    top = z.max(axis=1)
    log_total = top + np.log2(np.exp2(z - top[:, None]).sum(axis=1))
    return log_total - z[np.arange(len(targets)), targets]


# ------------------------------------------------------------------------------- model


def _clip8(x: np.ndarray) -> np.ndarray:
    return np.clip(x, -127, 127, out=x)


def floor_div(a: np.ndarray, b: int | np.ndarray) -> np.ndarray:
    """floor(a / b) for int32 a and positive b, exactly, without slow integer division.

    A power-of-two divisor is an arithmetic shift. Otherwise float64 division is correctly
    rounded, and its error (< |a / b| * 2**-53) is smaller than the distance 1/b from a
    non-integer quotient to the next integer while |a| < 2**53, so floor() is exact.
    """
    if isinstance(b, int) and b & (b - 1) == 0:
        return a >> (b.bit_length() - 1)
    return np.floor(a / np.asarray(b, dtype=np.float64)).astype(np.int32)


class EggModel:
    """Forward pass of the EGG model for a batch of members (or unperturbed rows)."""

    def __init__(self, cfg: RunConfig, params: dict[str, np.ndarray]):
        self.cfg = cfg
        self.params = params
        self.shift = 4 + cfg.es.sigma_shift
        # float32 transposes for exact BLAS GEMMs (|x|, |w| <= 127; see matmul.py).
        self.wt = {
            s.name: np.ascontiguousarray(params[s.name].T, dtype=np.float32)
            for s in param_specs(cfg.model)
            if s.kind == "matrix" and s.name != "emb"
        }

    def _mm(self, x: np.ndarray, name: str, noise: MemberNoise | None) -> np.ndarray:
        """MM(x, W): shared base GEMM + rank-1 member correction, scaled and clipped."""
        wt = self.wt[name]
        k = wt.shape[0]
        xf = x.astype(np.float32)
        acc = exact_matmul(xf, wt, 127, 127)
        if noise is not None:
            # x . b per member; float64 sums of these integer products are exact.
            xb = (xf * noise.b[name]).sum(axis=1, dtype=np.float64).astype(np.int32)
            acc += (xb[:, None] * noise.a[name]) >> self.shift
        return _clip8(floor_div(acc, 16 * isqrt(k)))

    def _vector(self, name: str, noise: MemberNoise | None) -> np.ndarray:
        return self.params[name].astype(np.int32) if noise is None else noise.vectors[name]

    def _ln(self, x: np.ndarray, name: str, noise: MemberNoise | None) -> np.ndarray:
        d = x.shape[1]
        mav = np.maximum(np.abs(x).sum(axis=1, keepdims=True) // d, 1)
        return _clip8(floor_div(x * self._vector(name, noise), mav))

    def _embed(self, tokens: np.ndarray, noise: MemberNoise | None) -> np.ndarray:
        x = self.params["emb"][tokens].astype(np.int32)
        if noise is not None:
            a_tok = noise.a["emb"][np.arange(len(tokens)), tokens]  # (M,)
            x += (a_tok[:, None] * noise.b["emb"].astype(np.int32)) >> self.shift
        return _clip8(x)

    def initial_state(self, rows: int) -> list[np.ndarray]:
        """The recurrent state before the first token: zero in every layer."""
        d, n_layer = self.cfg.model.d_model, self.cfg.model.n_layer
        return [np.zeros((rows, d), dtype=np.int32) for _ in range(n_layer)]

    def step(
        self, state: list[np.ndarray], tok: np.ndarray, noise: MemberNoise | None = None
    ) -> np.ndarray:
        """Read one token per row, update `state` in place, return the logits (M, V) int32
        that predict the next token. forward() is this step in a loop."""
        x = self._embed(tok, noise)
        reset = tok == 0  # a document starts: forget the previous one
        for i in range(self.cfg.model.n_layer):
            p = f"layers.{i}."
            s = state[i]
            s[reset] = 0
            h = self._ln(x, p + "ln1", noise)
            f = _clip8(
                self._mm(h, p + "wf", noise)
                + self._mm(s, p + "uf", noise)
                + self._vector(p + "bf", noise)
            )
            gate = f + 127
            g = (gate * s) >> 8
            c = _clip8(
                self._mm(h, p + "wh", noise)
                + self._mm(g, p + "uh", noise)
                + self._vector(p + "bh", noise)
            )
            s = s + ((gate * (c - s)) >> 8)
            state[i] = s
            x = _clip8(x + s)
            hidden = self._mm(self._ln(x, p + "ln2", noise), p + "w1", noise)
            x = _clip8(x + self._mm(hidden, p + "w2", noise))
        return self._mm(self._ln(x, "ln_out", noise), "head", noise)

    def window_logits(self, tokens: np.ndarray) -> np.ndarray:
        """Unperturbed logits (M, T, V) after each of tokens[:, :T] for rows (M, T + 1)."""
        state = self.initial_state(tokens.shape[0])
        steps = [self.step(state, tokens[:, t]) for t in range(tokens.shape[1] - 1)]
        return np.stack(steps, axis=1)

    def forward(
        self, tokens: np.ndarray, noise: MemberNoise | None = None, float_bits: bool = False
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Score rows of tokens (M, T + 1): predict tokens[:, 1:] from the prefix.

        Returns the integer loss per row (sum over T tokens, 1/16 bit units, int64) and,
        if asked, the exact float64 bits per row for reporting.
        """
        m, steps = tokens.shape[0], tokens.shape[1] - 1
        state = self.initial_state(m)
        loss = np.zeros(m, dtype=np.int64)
        bits = np.zeros(m, dtype=np.float64) if float_bits else None
        for t in range(steps):
            logits = self.step(state, tokens[:, t], noise)
            target = tokens[:, t + 1]
            loss += token_loss(logits, target)
            if bits is not None:
                bits += true_bits(logits, target)
        return loss, bits


class EggGenerator:
    """The unperturbed EGG model one token at a time, for `shared.sample.generate`.

    Recurrent, so each token costs the same and no position table bounds the output. It
    was trained on windows of seq_len tokens from a zero state, so that is its context:
    the prompt tokens it conditions on. Generation starts where a document starts: after
    token 0, the separator that resets the state.
    """

    def __init__(self, cfg: RunConfig, params: dict[str, np.ndarray]):
        self.model = EggModel(cfg, params)
        self.vocab_size = cfg.model.vocab_size
        self.context = cfg.es.seq_len

    def start(self) -> tuple[list[np.ndarray], np.ndarray]:
        return self.step(self.model.initial_state(1), 0)

    def step(self, state: list[np.ndarray], token: int) -> tuple[list[np.ndarray], np.ndarray]:
        logits = self.model.step(state, np.array([token], dtype=np.int64))
        return state, logits[0]


def build_model(cfg: RunConfig, params: dict[str, np.ndarray]) -> EggModel:
    """The forward pass of the config's architecture (the former's has the same interface)."""
    if cfg.model.arch == "former":
        from .former import FormerModel  # former.py builds on this module

        return FormerModel(cfg, params)  # type: ignore[return-value]
    return EggModel(cfg, params)


def build_generator(cfg: RunConfig, params: dict[str, np.ndarray]) -> EggGenerator:
    """The config's architecture one token at a time, for `shared.sample.generate`."""
    if cfg.model.arch == "former":
        from .former import FormerGenerator

        return FormerGenerator(cfg, params)  # type: ignore[return-value]
    return EggGenerator(cfg, params)
