"""What a population member sees: the parameters' layout, each pair's noise, the noise's
scales, and the one perturbed matrix product every architecture calls.

EGGROLL (https://arxiv.org/abs/2511.16652) perturbs a matrix W (out, in) with a rank-1
`a b^T` per member instead of a full-rank matrix. Member m belongs to antithetic pair
k = m >> 1: the even member adds the pair's noise, the odd one subtracts it (a carries the
sign). Every value comes from the counter-based noise of shared/noise.py, one stream per
tensor (its `tensor_id`): indices [0, out) of a matrix's stream are a, [out, out + in) are b;
a vector parameter p of n elements reads u1 = [0, n) and u2 = [n, 2n) and gets full-rank
noise u1 * u2.

    MM(x, W)  = clip((x @ W^T + (((x . b) * a) >> (4 + sigma_shift))) // (16 * isqrt(in)))
    EMB row t = EMB[t] + ((a[t] * b) >> (4 + sigma_shift))       the embedding's rows
    vector p  = clip(p + ((sign * u1 * u2) >> (4 + sigma_shift)))

`perturbed_mm` computes MM without ever forming a member's weights: the base GEMM x @ W^T is
shared by all members, and the member's correction is one dot product x . b and one scaled
vector a. Both are exact integers (float32 BLAS only where the sums provably stay below
2**24, see matmul.py). worker/backend/gemm.cu computes the same MM on the GPU bit for bit.

Noise scales (factors f in 1/64 units, 0..64) fade a member's noise per row of a matrix (a,
the out index), per column (b, the in index) or per vector element (u1 * u2), as
sign(v) * ((|v| * f) >> 6), which keeps a pair's members exact mirrors. The forward pass and
the update read the same scaled values. Two settings make them:

- Adaptive noise (es.adaptive_noise, d-eggs' overlay mode 1, with any rule): one int8 overlay
  per matrix row (`overlay.rows.<tensor>`), per matrix column (`overlay.cols.<tensor>`) and
  per vector element (`overlay.<tensor>`), all 64 at the start, replica state beside the
  weights. f = clip(ov, 0, 64). After each update, for every row, column and element: any of
  its weights changed -> ov = min(ov + 5, 127), else ov = max(ov - 1, -127). Unlike d-eggs,
  Z is accumulated from the same scaled noise the members were evaluated with.
- Token noise (es.token_noise_rows = K > 0) perturbs only the token rows (the embedding's, an
  EGG head's, a head bias's elements) with ids below K: the others get f = 0, so their votes
  are zero and they keep their initial values (but for AdamW's weight decay).
  `eggroll-data prepare --tokenizer bpe` ranks ids by training frequency, so these are the K
  commonest tokens: with few votes per step, a rare token's row gets almost no evidence and
  its z-test moves are mostly false ones, a random walk that inflates rare tokens'
  probability; holding those rows still leaves the votes to the rows they can move.

Where both apply the factors multiply as (f_overlay * f_token) >> 6. The z-test thresholds
assume full-scale noise, so faded noise only makes them stricter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from math import isqrt
from typing import TYPE_CHECKING

import numpy as np

from .matmul import F32_EXACT, clip8, exact_matmul, floor_div, frozen
from .noise import max_abs, noise_block

if TYPE_CHECKING:
    from .config import RunConfig

TOKEN_TENSORS = ("emb", "head", "head_bias")  # rows (matrices) or elements that are token ids
OVERLAY_START, OVERLAY_UP, OVERLAY_DOWN, OVERLAY_MAX = 64, 5, 1, 127

# ------------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class ParamSpec:
    """One int8 weight tensor of an architecture."""

    name: str
    shape: tuple[int, ...]  # matrices are (out, in); the embedding is (vocab, D)
    kind: str  # "matrix": rank-1 noise a (out) b (in); "vector": full-rank u1 * u2 noise
    # "gaussian" (int8 bell, std ~16), "small" (the bell / 8 toward zero, std ~2), "sixteen"
    # (1.0 in fixed point), "zero", "zipf" (`shared.loss.zipf_bias`)
    init: str
    tensor_id: int  # the noise stream of this tensor
    # the replica's integer type: int8 weights; the hf family's weights' bit patterns
    dtype: type = np.int8


Specs = Sequence[ParamSpec]  # an architecture's tensors, in noise-stream order
Tensors = dict[str, np.ndarray]  # a replica's weights, or its state beside them, by name


@dataclass(frozen=True)
class StateSpec:
    """One tensor of replica state beside the weights (an update rule's, or an overlay)."""

    name: str
    shape: tuple[int, ...]
    dtype: type
    initial: int = 0  # every element's value at step 0


# -------------------------------------------------------------------------------- noise


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
    cfg: RunConfig,
    specs: Specs,
    step: int,
    pairs: np.ndarray,
    scales: NoiseScales | None = None,
) -> PairNoise:
    """Regenerate every tensor's noise for these pairs: indices [0, out) are a, then b.
    With `scales` (adaptive or token noise) each value is scaled by its row, column or
    element's factor; the forward pass and the update both use the scaled values."""
    es = cfg.es
    a, b, u = {}, {}, {}
    for spec in specs:
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

    def rows(self, lo: int, hi: int) -> MemberNoise:
        """Members [lo, hi) only."""
        return MemberNoise(
            {k: v[lo:hi] for k, v in self.a.items()},
            {k: v[lo:hi] for k, v in self.b.items()},
            {k: v[lo:hi] for k, v in self.vectors.items()},
        )


def member_noise(noise: PairNoise, params: dict[str, np.ndarray], sigma_shift: int) -> MemberNoise:
    """Both members of every pair, with the antithetic sign folded in."""
    sign = np.tile(np.array([1, -1], dtype=np.int32), len(noise.pairs))[:, None]  # (M, 1)
    shift = 4 + sigma_shift
    a = {k: np.repeat(v.astype(np.int32), 2, axis=0) * sign for k, v in noise.a.items()}
    b = {k: np.repeat(v.astype(np.float32), 2, axis=0) for k, v in noise.b.items()}
    vectors = {}
    for name, u in noise.u.items():
        delta = (np.repeat(u.astype(np.int32), 2, axis=0) * sign) >> shift
        vectors[name] = np.clip(params[name].astype(np.int32) + delta, -127, 127)
    return MemberNoise(a, b, vectors)


# ------------------------------------------------------------------------------- scales


@cache
def token_row_factors(vocab_size: int, rows: int) -> np.ndarray:
    """Token noise factors (1/64 units) of rows 0..vocab_size-1: 64 below `rows`, else 0."""
    return frozen(np.where(np.arange(vocab_size) < rows, 64, 0), np.int32)


def overlay_specs(specs: Specs) -> tuple[StateSpec, ...]:
    """The adaptive-noise overlays of these tensors, in digest and checkpoint order."""
    out: list[StateSpec] = []
    for s in specs:
        if s.kind == "matrix":
            out += [
                StateSpec(f"overlay.rows.{s.name}", s.shape[:1], np.int8, OVERLAY_START),
                StateSpec(f"overlay.cols.{s.name}", s.shape[1:], np.int8, OVERLAY_START),
            ]
        else:
            out.append(StateSpec(f"overlay.{s.name}", s.shape, np.int8, OVERLAY_START))
    return tuple(out)


def noise_scales(cfg: RunConfig, specs: Specs, state: dict[str, np.ndarray]) -> NoiseScales | None:
    """The forward and update noise factors (1/64 units): the replica's overlays (adaptive
    noise) and the token rows' fixed factors (token noise), multiplied where both apply as
    (f_overlay * f_token) >> 6; None without either. `state` is the replica's state beside
    the weights (it holds the overlays)."""
    es = cfg.es
    if not es.adaptive_noise and not es.token_noise_rows:
        return None
    rows, cols, elements = {}, {}, {}
    if es.adaptive_noise:

        def factor(name: str) -> np.ndarray:
            return np.clip(state[name].astype(np.int32), 0, OVERLAY_START)

        for s in specs:
            if s.kind == "matrix":
                rows[s.name] = factor(f"overlay.rows.{s.name}")
                cols[s.name] = factor(f"overlay.cols.{s.name}")
            else:
                elements[s.name] = factor(f"overlay.{s.name}")
    if es.token_noise_rows:
        tokens = token_row_factors(cfg.model.vocab_size, es.token_noise_rows)
        for s in specs:
            if s.name in TOKEN_TENSORS:
                into = rows if s.kind == "matrix" else elements  # a's rows; a bias's elements
                into[s.name] = (into[s.name] * tokens) >> 6 if s.name in into else tokens
    return NoiseScales(rows, cols, elements)


def _overlay_step(overlay: np.ndarray, moved: np.ndarray) -> np.ndarray:
    ov = overlay.astype(np.int16)
    up = np.minimum(ov + OVERLAY_UP, OVERLAY_MAX)
    down = np.maximum(ov - OVERLAY_DOWN, -OVERLAY_MAX)
    return np.where(moved, up, down).astype(np.int8)


def update_overlays(
    specs: Specs,
    old: dict[str, np.ndarray],
    new: dict[str, np.ndarray],
    state: dict[str, np.ndarray],
) -> dict[str, np.ndarray]:
    """The overlays after an update that took the weights from `old` to `new`."""
    out = {}
    for s in specs:
        moved = new[s.name] != old[s.name]
        if s.kind == "matrix":
            for axis, key in ((1, "rows"), (0, "cols")):
                name = f"overlay.{key}.{s.name}"
                out[name] = _overlay_step(state[name], moved.any(axis=axis))
        else:
            out[f"overlay.{s.name}"] = _overlay_step(state[f"overlay.{s.name}"], moved)
    return out


# ------------------------------------------------------------------ the perturbed product


def perturbed_mm(
    x: np.ndarray, wt: np.ndarray, noise: MemberNoise | None, name: str, cfg: RunConfig
) -> np.ndarray:
    """MM(x, W) for x (M, ..., in) with |x| <= 127, member m's rows first: the shared base
    GEMM plus member m's rank-1 correction, scaled and clipped (the module docstring).

    `wt` is W^T (in, out) in float32 (integers, so the BLAS GEMM is exact; matmul.py). int32
    bounds (in <= 4096 as d_model <= 1024): |x W^T| <= 127**2 * 4096 < 2**26;
    |x . b| <= 127 * 55 * 4096 < 2**25 and |(x . b) * a| <= 2**25 * 55 < 2**31."""
    k = x.shape[-1]
    xf = x.astype(np.float32)
    acc = exact_matmul(xf.reshape(-1, k), wt, 127, 127).reshape(*x.shape[:-1], -1)
    if noise is not None:
        m = x.shape[0]
        # x . b per member and row: a batched GEMV of integers, exact in float32 while
        # k * 127 * max|b| <= 2**24 (see matmul.py), else in float64.
        exact32 = k * 127 * max_abs(cfg.es.noise) <= F32_EXACT
        dtype = np.float32 if exact32 else np.float64
        rows = xf.reshape(m, -1, k).astype(dtype, copy=False)  # (M, R, in)
        xb = rows @ noise.b[name][:, :, None].astype(dtype, copy=False)  # (M, R, 1)
        correction = (xb.astype(np.int32) * noise.a[name][:, None, :]) >> (4 + cfg.es.sigma_shift)
        acc += correction.reshape(acc.shape)  # (M, R, out) -> (M, ..., out)
    return clip8(floor_div(acc, 16 * isqrt(k)))


def perturbed_rows(
    table: np.ndarray, ids: np.ndarray, noise: MemberNoise | None, name: str, cfg: RunConfig
) -> np.ndarray:
    """Rows ids (M, ...) of a matrix that members perturb, as int32 (M, ..., D), unclipped:
    EMB[t] + ((a[t] * b) >> shift), the rows of the same rank-1 perturbation MM applies."""
    x = table[ids].astype(np.int32)  # (M, ..., D)
    if noise is not None:
        m = len(ids)
        flat = ids.reshape(m, -1)  # (M, R)
        a_tok = noise.a[name][np.arange(m)[:, None], flat]  # (M, R): the member's a at row t
        b = noise.b[name].astype(np.int32)[:, None, :]  # (M, 1, D)
        x += ((a_tok[:, :, None] * b) >> (4 + cfg.es.sigma_shift)).reshape(x.shape)
    return x


# model.arch "hf"'s own
HF_SETTINGS = ("path", "targets", "rank", "files", "matrices", "weight_dtype")
# FAMILY, EXACT and OWN_TOKENIZER of every int8 architecture (shared/model.py): integers
# only, so every device computes the same bytes; the data's vocabulary is the model's.
INT8 = ("int8", True, False)


def int8_settings(cfg: RunConfig) -> str | None:
    """None, or one line naming a setting that an int8 architecture cannot have: those of
    Hugging Face models (shared/hf.py), whose noise is a float es.sigma, not es.sigma_shift."""
    m = cfg.model
    default = type(m)()
    for key in HF_SETTINGS:
        if getattr(m, key) != getattr(default, key):
            return f"model.{key} is a setting of model.arch='hf', not of {m.arch!r}"
    if cfg.es.sigma != 0:
        return "es.sigma is a setting of model.arch='hf': int8 models use es.sigma_shift"
    return None
