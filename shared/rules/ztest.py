"""The z-test rule (nano-egg's, stateless), and the thresholds every rule built on it uses.

Under random fitness signs Z has standard deviation sqrt(P * E[a^2] * E[b^2]), so
Z / that is a z-score. A weight moves by sign(Z) (then clips to [-127, 127]) where the
two-sided z-test at level alpha_t passes:

    |Z| >= T  with T the least integer such that 256 * T^2 >= k^2 * P * E[a^2] * E[b^2]
    k = the least whole number of 1/16ths whose two-sided normal tail is <= alpha_t

Everything is exact integer or rational arithmetic: the normal tail is the pinned table
below (not libm), alpha_t is a Fraction, E[v^2] is exact (noise.second_moment). Z == 0
never moves a weight (nano-egg moves it by -1 at alpha = 1, a quirk we do not keep).
"""

from __future__ import annotations

from fractions import Fraction
from math import isqrt
from typing import TYPE_CHECKING

import numpy as np

from ..noise import second_moment
from ..perturb import Specs, StateSpec, Tensors

if TYPE_CHECKING:
    from ..config import RunConfig, UpdateConfig

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


def move(w: np.ndarray, direction: np.ndarray) -> np.ndarray:
    """int8 weights moved by -1, 0 or +1 each, clipped to [-127, 127]."""
    return np.clip(w.astype(np.int16) + direction, -127, 127).astype(np.int8)


def state_specs(cfg: RunConfig, specs: Specs) -> tuple[StateSpec, ...]:
    return ()  # stateless


def update(
    cfg: RunConfig, step: int, specs: Specs, params: Tensors, state: Tensors, z: Tensors
) -> tuple[Tensors, Tensors]:
    """Move each weight by sign(Z) where |Z| passes the step's threshold."""
    threshold = move_threshold(cfg.pairs, alpha_at(cfg.update, step), cfg.es.noise)
    new = {
        name: move(params[name], np.where(np.abs(zt) >= threshold, np.sign(zt), 0))
        for name, zt in z.items()
    }
    return new, {}
