"""Update rules: how a step's fitness moves the int8 weights (at most one step each).

`ztest` (nano-egg, stateless) and `momentum` (an integer accumulator per weight, replica
state). Both start from the same exact Z per weight.

For every matrix (and the embedding) with the + member's noise a_k (out), b_k (in):

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
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from math import isqrt

import numpy as np

from .config import RunConfig, UpdateConfig
from .matmul import exact_matmul
from .model import pair_noise, param_specs
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


def accumulate_z(cfg: RunConfig, step: int, fitness: np.ndarray) -> dict[str, np.ndarray]:
    """Z for every tensor, from the whole population's fitness (int8, one per pair)."""
    vmax = max_abs(cfg.es.noise)
    z: dict[str, np.ndarray] = {
        s.name: np.zeros(s.shape, dtype=np.int64) for s in param_specs(cfg.model)
    }
    active = np.flatnonzero(fitness)  # pairs with F = 0 contribute nothing
    for lo in range(0, len(active), PAIR_BLOCK):
        pairs = active[lo : lo + PAIR_BLOCK]
        f = fitness[pairs].astype(np.float32)
        noise = pair_noise(cfg, step, pairs)
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


@dataclass(frozen=True)
class Updated:
    params: dict[str, np.ndarray]
    opt: dict[str, np.ndarray]
    changed: int  # int8 weights that moved


MOMENTUM_LIMIT = (1 << 31) - 1


def momentum_gain(shift: int) -> Fraction:
    """Var(M) / Var(Z) at stationarity: 1 / (1 - beta**2) with beta = 1 - 2**-shift."""
    return Fraction(1 << (2 * shift), (1 << (shift + 1)) - 1)


def state_specs(cfg: RunConfig) -> tuple[StateSpec, ...]:
    """The optimizer state of the config's update rule, in digest and checkpoint order."""
    if cfg.update.rule == "momentum":
        return tuple(
            StateSpec(f"momentum.{s.name}", s.shape, np.int32) for s in param_specs(cfg.model)
        )
    return ()


def initial_opt_state(cfg: RunConfig) -> dict[str, np.ndarray]:
    return {s.name: np.zeros(s.shape, dtype=s.dtype) for s in state_specs(cfg)}


def _move(w: np.ndarray, direction: np.ndarray) -> np.ndarray:
    return np.clip(w.astype(np.int16) + direction, -127, 127).astype(np.int8)


def update_from_z(
    cfg: RunConfig,
    step: int,
    params: dict[str, np.ndarray],
    opt: dict[str, np.ndarray],
    z: dict[str, np.ndarray],
) -> Updated:
    """Apply Z (from `accumulate_z`, or a device that computed the same) by the config's rule."""
    alpha, rule = alpha_at(cfg.update, step), cfg.update.rule
    new: dict[str, np.ndarray] = {}
    new_opt: dict[str, np.ndarray] = {}
    changed = 0
    if rule == "ztest":
        threshold = move_threshold(cfg.pairs, alpha, cfg.es.noise)
        for name, zt in z.items():
            new[name] = _move(params[name], np.where(np.abs(zt) >= threshold, np.sign(zt), 0))
    elif rule == "momentum":
        shift = cfg.update.momentum_shift
        threshold = move_threshold(cfg.pairs, alpha, cfg.es.noise, momentum_gain(shift))
        for name, zt in z.items():
            m = opt[f"momentum.{name}"].astype(np.int64)
            m = np.clip(m - np.sign(m) * (np.abs(m) >> shift) + zt, -MOMENTUM_LIMIT, MOMENTUM_LIMIT)
            direction = np.where(np.abs(m) >= threshold, np.sign(m), 0)
            new[name] = _move(params[name], direction)
            new_opt[f"momentum.{name}"] = (m - direction * threshold).astype(np.int32)
    else:
        raise ValueError(f"update rule {rule!r} is not implemented")
    for name, w in new.items():
        changed += int(np.count_nonzero(w != params[name]))
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
    return update_from_z(cfg, step, params, opt, accumulate_z(cfg, step, fitness))
