"""Update rules: how a step's fitness moves the int8 weights (at most one step each).

`ztest` (nano-egg, stateless), `momentum` (an integer accumulator per weight, replica
state) and `adamw` (fixed-point AdamW, replica state). All start from the same exact Z per
weight. For every matrix (and the embedding), over the P pairs k with the + member's noise
a_k (out), b_k (in):

    Z = sum_k F_k a_k b_k^T            an exact GEMM over pairs: (F * A)^T B
    for vectors: Z = sum_k F_k u1_k u2_k

Under random fitness signs Z has standard deviation sqrt(P * E[a^2] * E[b^2]), so
Z / that is a z-score. A weight moves by sign(Z) (then clips to [-127, 127]) where the
two-sided z-test at level alpha_t passes:

    |Z| >= T  with T the least integer such that 256 * T^2 >= k^2 * P * E[a^2] * E[b^2]
    k = the least whole number of 1/16ths whose two-sided normal tail is <= alpha_t

Everything is exact integer or rational arithmetic: the normal tail is the pinned table
below (not libm), alpha_t is a Fraction, E[v^2] is exact (noise.second_moment). Z == 0
never moves a weight (nano-egg moves it by -1 at alpha = 1, a quirk we do not keep).

`momentum` keeps what the z-test throws away: sub-threshold Z accumulates, with decay, in an
int32 M per weight (shift d = update.momentum_shift, beta = 1 - 2**-d):

    M = M - sign(M) * (|M| >> d) + Z                  then clipped to +-(2**31 - 1)
    where |M| >= T_M:  w += sign(M) (clipped to [-127, 127]);  M -= sign(M) * T_M

Under random fitness M has the stationary variance Var(Z) / (1 - beta**2), so T_M is the
z-test threshold for that variance: the least integer with
256 * T_M**2 * (2**(d+1) - 1) >= k**2 * P * E[a^2] * E[b^2] * 2**(2d). A move spends T_M of
the accumulated evidence (sigma-delta style), so a steady signal moves a weight again only
once it has built up again. M is in the replica digest and the checkpoints.

`adamw` is d-eggs' quantised AdamW (moments, a per-weight accumulator, at most one +-1 move
per step, its learning-rate schedule) with its state in fixed point, so that every backend
computes the same bits, and with bias correction and no decay on vector parameters. Per
weight, with int32 m and acc and int64 v (all start at 0), ONE = 2**16, and
sshift(x, s) = sign(x) * (|x| >> s), a shift that rounds toward zero so the rule is odd in
(Z, w, m, acc): flipping every fitness sign mirrors the whole state exactly:

    g   = sshift(Z, gs)      gs = max(0, bit_length(P * max|noise|**2) - 20): |g| < 2**20
    m   = sshift(m * B1 + g * (ONE - B1), 16)                                   |m| < 2**20
    v   = (v * B2 + g * g * (ONE - B2)) >> 16                                   v < 2**40
    u   = sign(m) * ((|m| << 16) // (isqrt(v) + 1))          m / (sqrt v + 1) in 2**-16
    r   = clip(sshift(u * K_t, 16), -2**30, 2**30)           bias corrected, in 2**-16
    s   = sshift(LR_t * (r - WD * w), 16)       (WD * w only for matrices and the embedding)
    acc = acc + s
    acc >= ONE:   w < 127: w += 1, acc -= ONE;   else acc = ONE
    acc <= -ONE:  w > -127: w -= 1, acc += ONE;  else acc = -ONE
    acc = clip(acc, -(2**31 - 1), 2**31 - 1)

The config's floats become integers once, exactly: X = round(x * 2**16) (Python's round of
a float, half to even) for B1 = beta1, B2 = beta2, WD = weight_decay and LR = lr;
LR_t = LR >> min(step // lr_halve_steps, lr_halvings) (d-eggs: 0.5, 0.25, then 0.125).
Adam is scale invariant, so gs only keeps g**2 and its products inside int64; the +1 under
the division is Adam's epsilon, one unit of g. isqrt is exact (`isqrt_array`). The bias
correction of update t = step + 1, computed with the quantised betas b = B / 2**16, is

    K_t = round(2**16 * sqrt(1 - b2**t) / (1 - b1**t))    (half up, exactly in integers)

which is 2**16 once max(b1, b2)**t <= 2**-20 (`bias_correction`). The bounds on the right
and beta <= 0.999 (K_t < 2**26), lr <= 16 keep every product below 2**63. The state is
`adamw.m.<tensor>`, `adamw.v.<tensor>`, `adamw.acc.<tensor>` in parameter order.

Adaptive noise (es.adaptive_noise, d-eggs' overlay mode 1, with any rule): one int8 overlay
per matrix row (`overlay.rows.<tensor>`, the out index, a's), per matrix column
(`overlay.cols.<tensor>`, the in index, b's) and per vector element (`overlay.<tensor>`),
all 64 at the start. Each member's noise is scaled by f = clip(ov, 0, 64) / 64 as
sign(v) * ((|v| * f) >> 6) (shared/model.py `pair_noise`): a by its row, b by its column,
u1 * u2 by its element. Unlike d-eggs, Z is accumulated from the same scaled noise the
members were evaluated with. After each update, for every row, column and element:
any of its weights changed -> ov = min(ov + 5, 127), else ov = max(ov - 1, -127). The
overlays follow the rule's state in the digest and the checkpoints. Token noise
(es.token_noise_rows, shared/model.py) scales the token rows' a (and the head bias's
elements) the same way, by fixed factors of 64 or 0, multiplied into the overlays where
both are on. The z-test thresholds assume full-scale noise, so faded noise only makes them
stricter.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from functools import cache
from math import isqrt

import numpy as np

from .config import RunConfig, UpdateConfig
from .matmul import exact_matmul
from .model import TOKEN_TENSORS, NoiseScales, pair_noise, param_specs, token_row_factors
from .noise import max_abs, second_moment

# round(2**32 * P(|N(0, 1)| >= k / 16)) for k = 0..96 (z from 0 to 6). Pinned, because a
# libm erfc may differ in its last bit between machines and replicas must not.
TAIL_2POW32 = (
    4294967296, 4080926149, 3867719198, 3656170899, 3447086415, 3241242438,
    3039378561, 2842189351, 2650317277, 2464346594, 2284798297, 2112126192,
    1946714134, 1788874437, 1638847446, 1496802218, 1362838254, 1236988197,
    1119221380, 1009448125, 907524645, 813258440, 726414024, 646718879,
    573869489, 507537341, 447374784, 393020646, 344105537, 300256757,
    261102759, 226277145, 195422145, 168191596, 144253404, 123291517,
    105007421, 89121196, 75372167, 63519191, 53340619, 44633982,
    37215448, 30919084, 25595971, 21113210, 17352849, 14210766,
    11595536, 9427302, 7636669, 6163641, 4956607, 3971390,
    3170360, 2521621, 1998269, 1577713, 1241080, 972673,
    759499, 590851, 457950, 353626, 272054, 208520,
    159229, 121137, 91814, 69329, 52155, 39088,
    29186, 21710, 16089, 11878, 8737, 6402,
    4673, 3399, 2462, 1777, 1278, 915,
    653, 464, 329, 232, 163, 114,
    80, 55, 38, 26, 18, 12,
    8,
)  # fmt: skip

PAIR_BLOCK = 4096  # pairs whose noise is held at once while accumulating Z


def alpha_at(cfg: UpdateConfig, step: int) -> Fraction:
    """The z-test level of a step: 1 / ((2**alpha - 1) * step / decay + 1), or a constant."""
    if cfg.alpha > 1:
        slope = (1 << int(cfg.alpha)) - 1
        return Fraction(cfg.alpha_decay_steps, slope * step + cfg.alpha_decay_steps)
    return Fraction(cfg.alpha)


def z_sixteenths(alpha: Fraction) -> int:
    """The least k with P(|N| >= k/16) <= alpha (capped at z = 6)."""
    for k, tail in enumerate(TAIL_2POW32):
        if tail * alpha.denominator <= alpha.numerator << 32:
            return k
    return len(TAIL_2POW32) - 1


def move_threshold(
    pairs: int, alpha: Fraction, noise_kind: str, variance_gain: Fraction = Fraction(1)
) -> int:
    """The least |Z| (or |M|, whose variance is `variance_gain` times Z's) that moves a
    weight (see the module docstring)."""
    k = z_sixteenths(alpha)
    var = second_moment(noise_kind) ** 2 * pairs * k * k * variance_gain / 256  # T^2 >= var
    need = -(-var.numerator // var.denominator)  # ceil: T^2 is an integer
    root = isqrt(need)
    return root if root * root == need else root + 1


def accumulate_z(
    cfg: RunConfig, step: int, fitness: np.ndarray, scales: NoiseScales | None = None
) -> dict[str, np.ndarray]:
    """Z for every tensor, from the whole population's fitness (int8, one per pair), with the
    noise the members were evaluated with (`scales`: adaptive noise, see `noise_scales`)."""
    vmax = max_abs(cfg.es.noise)  # scaled noise is never larger
    z: dict[str, np.ndarray] = {
        s.name: np.zeros(s.shape, dtype=np.int64) for s in param_specs(cfg.model)
    }
    active = np.flatnonzero(fitness)  # pairs with F = 0 contribute nothing
    for lo in range(0, len(active), PAIR_BLOCK):
        pairs = active[lo : lo + PAIR_BLOCK]
        f = fitness[pairs].astype(np.float32)
        noise = pair_noise(cfg, step, pairs, scales)
        for name, a in noise.a.items():
            fa_t = (a.astype(np.float32) * f[:, None]).T  # (out, P)
            z[name] += exact_matmul(fa_t, noise.b[name], vmax, vmax)
        for name, u in noise.u.items():
            z[name] += exact_matmul(f[None, :], u, 1, vmax * vmax)[0]
    return z


@dataclass(frozen=True)
class StateSpec:
    """One tensor of optimizer state: replica state beside the weights."""

    name: str
    shape: tuple[int, ...]
    dtype: type
    initial: int = 0  # every element's value at step 0


@dataclass(frozen=True)
class Updated:
    params: dict[str, np.ndarray]
    opt: dict[str, np.ndarray]
    changed: int  # int8 weights that moved


MOMENTUM_LIMIT = (1 << 31) - 1


def momentum_gain(shift: int) -> Fraction:
    """Var(M) / Var(Z) at stationarity: 1 / (1 - beta**2) with beta = 1 - 2**-shift."""
    return Fraction(1 << (2 * shift), (1 << (shift + 1)) - 1)


ONE = 1 << 16  # fixed-point 1.0 of the adamw rule
R_LIMIT = 1 << 30  # |bias-corrected normalised update| cap, in 2**-16 (16384 weight steps)
ACC_LIMIT = (1 << 31) - 1
OVERLAY_START, OVERLAY_UP, OVERLAY_DOWN, OVERLAY_MAX = 64, 5, 1, 127


def fixed16(x: float) -> int:
    """A config float as an integer in units of 2**-16: round half to even, exact."""
    return round(x * ONE)


def grad_shift(cfg: RunConfig) -> int:
    """gs: |Z| <= P * max|noise|**2 < 2**bits, so |Z >> gs| < 2**20."""
    return max(0, (cfg.pairs * max_abs(cfg.es.noise) ** 2).bit_length() - 20)


def lr_at(up: UpdateConfig, step: int) -> int:
    """LR_t in 2**-16 weight steps: lr, halved every lr_halve_steps, at most lr_halvings times."""
    return fixed16(up.lr) >> min(step // up.lr_halve_steps, up.lr_halvings)


@cache
def _bias_settled(b1: int, b2: int) -> int:
    """The least t with max(b1, b2)**t <= 2**-20 (betas in 2**-16), from which
    K_t = sqrt(1 - b2**t) / (1 - b1**t) is within [1 - 2**-20, 1 + 2**-19]: 2**16 rounded."""
    b, t = max(b1, b2), 1
    power = b
    while power << 20 > 1 << (16 * t):
        t, power = t + 1, power * b
    return t


def bias_correction(up: UpdateConfig, step: int) -> int:
    """K_t of update t = step + 1 in 2**-16: round(2**16 * sqrt(1 - b2**t) / (1 - b1**t))
    with the quantised betas, exactly (round half up)."""
    b1, b2, t = fixed16(up.beta1), fixed16(up.beta2), step + 1
    if t >= _bias_settled(b1, b2):
        return ONE
    one = 1 << (16 * t)  # 1.0 in units of 2**-16t: b**t = B**t / one
    # (2**17 K)**2 = 2**34 * (one - B2**t) * one / (one - B1**t)**2; isqrt of its floor
    # is floor(2**17 K), and (floor(2**17 K) + 1) >> 1 = floor(2**16 K + 1/2).
    square = ((one - b2**t) * one << 34) // (one - b1**t) ** 2
    return (isqrt(square) + 1) >> 1


def isqrt_array(v: np.ndarray) -> np.ndarray:
    """floor(sqrt(v)) for int64 0 <= v < 2**52, exactly: float64 holds v exactly and its
    correctly rounded sqrt is off the floor by at most one, which the two checks fix."""
    s = np.sqrt(v.astype(np.float64)).astype(np.int64)
    s -= s * s > v
    s += (s + 1) * (s + 1) <= v
    return s


def sshift(x: np.ndarray, shift: int) -> np.ndarray:
    """sign(x) * (|x| >> shift): a shift that rounds toward zero, odd in x."""
    return np.sign(x) * (np.abs(x) >> shift)


def state_specs(cfg: RunConfig) -> tuple[StateSpec, ...]:
    """The optimizer state of the config's update rule, then the adaptive-noise overlays,
    in digest and checkpoint order."""
    specs: list[StateSpec] = []
    params = param_specs(cfg.model)
    if cfg.update.rule == "momentum":
        specs += [StateSpec(f"momentum.{s.name}", s.shape, np.int32) for s in params]
    elif cfg.update.rule == "adamw":
        for s in params:
            specs += [
                StateSpec(f"adamw.m.{s.name}", s.shape, np.int32),
                StateSpec(f"adamw.v.{s.name}", s.shape, np.int64),
                StateSpec(f"adamw.acc.{s.name}", s.shape, np.int32),
            ]
    if cfg.es.adaptive_noise:
        for s in params:
            if s.kind == "matrix":
                specs += [
                    StateSpec(f"overlay.rows.{s.name}", s.shape[:1], np.int8, OVERLAY_START),
                    StateSpec(f"overlay.cols.{s.name}", s.shape[1:], np.int8, OVERLAY_START),
                ]
            else:
                specs.append(StateSpec(f"overlay.{s.name}", s.shape, np.int8, OVERLAY_START))
    return tuple(specs)


def initial_opt_state(cfg: RunConfig) -> dict[str, np.ndarray]:
    return {s.name: np.full(s.shape, s.initial, dtype=s.dtype) for s in state_specs(cfg)}


def noise_scales(cfg: RunConfig, opt: dict[str, np.ndarray]) -> NoiseScales | None:
    """The forward and update noise factors (1/64 units): the replica's overlays (adaptive
    noise) and the token rows' fixed factors (token noise), multiplied where both apply as
    (f_overlay * f_token) >> 6; None without either."""
    es = cfg.es
    if not es.adaptive_noise and not es.token_noise_rows:
        return None
    rows, cols, elements = {}, {}, {}
    if es.adaptive_noise:

        def factor(name: str) -> np.ndarray:
            return np.clip(opt[name].astype(np.int32), 0, OVERLAY_START)

        for s in param_specs(cfg.model):
            if s.kind == "matrix":
                rows[s.name] = factor(f"overlay.rows.{s.name}")
                cols[s.name] = factor(f"overlay.cols.{s.name}")
            else:
                elements[s.name] = factor(f"overlay.{s.name}")
    if es.token_noise_rows:
        tokens = token_row_factors(cfg.model.vocab_size, es.token_noise_rows)
        for s in param_specs(cfg.model):
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
    cfg: RunConfig,
    old: dict[str, np.ndarray],
    new: dict[str, np.ndarray],
    opt: dict[str, np.ndarray],
) -> dict[str, np.ndarray]:
    """The overlays after an update that took the weights from `old` to `new`."""
    out = {}
    for s in param_specs(cfg.model):
        moved = new[s.name] != old[s.name]
        if s.kind == "matrix":
            for axis, key in ((1, "rows"), (0, "cols")):
                name = f"overlay.{key}.{s.name}"
                out[name] = _overlay_step(opt[name], moved.any(axis=axis))
        else:
            out[f"overlay.{s.name}"] = _overlay_step(opt[f"overlay.{s.name}"], moved)
    return out


def _move(w: np.ndarray, direction: np.ndarray) -> np.ndarray:
    return np.clip(w.astype(np.int16) + direction, -127, 127).astype(np.int8)


def _momentum(
    cfg: RunConfig,
    alpha: Fraction,
    params: dict[str, np.ndarray],
    opt: dict[str, np.ndarray],
    z: dict[str, np.ndarray],
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The momentum rule of the module docstring, vectorised over each tensor."""
    shift = cfg.update.momentum_shift
    threshold = move_threshold(cfg.pairs, alpha, cfg.es.noise, momentum_gain(shift))
    new: dict[str, np.ndarray] = {}
    new_opt: dict[str, np.ndarray] = {}
    for name, zt in z.items():
        m = opt[f"momentum.{name}"].astype(np.int64)
        m = np.clip(m - sshift(m, shift) + zt, -MOMENTUM_LIMIT, MOMENTUM_LIMIT)
        direction = np.where(np.abs(m) >= threshold, np.sign(m), 0)
        new[name] = _move(params[name], direction)
        new_opt[f"momentum.{name}"] = (m - direction * threshold).astype(np.int32)
    return new, new_opt


def _adamw(
    cfg: RunConfig,
    step: int,
    params: dict[str, np.ndarray],
    opt: dict[str, np.ndarray],
    z: dict[str, np.ndarray],
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The adamw rule of the module docstring, vectorised over each tensor."""
    up = cfg.update
    b1, b2, wd = fixed16(up.beta1), fixed16(up.beta2), fixed16(up.weight_decay)
    lr, k, gs = lr_at(up, step), bias_correction(up, step), grad_shift(cfg)
    new: dict[str, np.ndarray] = {}
    new_opt: dict[str, np.ndarray] = {}
    for spec in param_specs(cfg.model):
        name = spec.name
        w = params[name].astype(np.int64)
        m = opt[f"adamw.m.{name}"].astype(np.int64)
        v = opt[f"adamw.v.{name}"]
        acc = opt[f"adamw.acc.{name}"].astype(np.int64)
        g = sshift(z[name], gs)
        m = sshift(m * b1 + g * (ONE - b1), 16)
        v = (v * b2 + g * g * (ONE - b2)) >> 16
        u = np.sign(m) * ((np.abs(m) << 16) // (isqrt_array(v) + 1))
        r = np.clip(sshift(u * k, 16), -R_LIMIT, R_LIMIT)
        if spec.kind == "matrix":  # decoupled decay: not on norm gains and biases
            r = r - wd * w
        acc = acc + sshift(lr * r, 16)
        rise, fall = acc >= ONE, acc <= -ONE
        direction = (rise & (w < 127)).astype(np.int64) - (fall & (w > -127))
        acc = acc - direction * ONE
        acc = np.where(rise & (w == 127), ONE, np.where(fall & (w == -127), -ONE, acc))
        new[name] = (w + direction).astype(np.int8)
        new_opt[f"adamw.m.{name}"] = m.astype(np.int32)
        new_opt[f"adamw.v.{name}"] = v
        new_opt[f"adamw.acc.{name}"] = np.clip(acc, -ACC_LIMIT, ACC_LIMIT).astype(np.int32)
    return new, new_opt


def update_from_z(
    cfg: RunConfig,
    step: int,
    params: dict[str, np.ndarray],
    opt: dict[str, np.ndarray],
    z: dict[str, np.ndarray],
) -> Updated:
    """Apply Z (from `accumulate_z`, or a device that computed the same) by the config's rule,
    then move the adaptive-noise overlays if the config has them."""
    alpha, rule = alpha_at(cfg.update, step), cfg.update.rule
    new: dict[str, np.ndarray] = {}
    new_opt: dict[str, np.ndarray] = {}
    if rule == "ztest":
        threshold = move_threshold(cfg.pairs, alpha, cfg.es.noise)
        for name, zt in z.items():
            new[name] = _move(params[name], np.where(np.abs(zt) >= threshold, np.sign(zt), 0))
    elif rule == "momentum":
        new, new_opt = _momentum(cfg, alpha, params, opt, z)
    elif rule == "adamw":
        new, new_opt = _adamw(cfg, step, params, opt, z)
    else:
        raise ValueError(f"update rule {rule!r} is not implemented")
    changed = sum(int(np.count_nonzero(w != params[name])) for name, w in new.items())
    if cfg.es.adaptive_noise:
        new_opt |= update_overlays(cfg, params, new, opt)
    return Updated(new, new_opt, changed)


def apply_update(
    cfg: RunConfig,
    step: int,
    params: dict[str, np.ndarray],
    opt: dict[str, np.ndarray],
    fitness: np.ndarray,
) -> Updated:
    """The parameters and optimizer state after step `step`'s update."""
    if fitness.shape != (cfg.pairs,):
        raise ValueError(f"fitness has shape {fitness.shape}, expected ({cfg.pairs},)")
    z = accumulate_z(cfg, step, fitness, noise_scales(cfg, opt))
    return update_from_z(cfg, step, params, opt, z)
