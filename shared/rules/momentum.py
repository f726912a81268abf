"""The momentum rule: the z-test's evidence kept across steps instead of thrown away.

Sub-threshold Z accumulates, with decay, in an int32 M per weight (shift d =
update.momentum_shift, beta = 1 - 2**-d):

    M = M - sign(M) * (|M| >> d) + Z                  then clipped to +-(2**31 - 1)
    where |M| >= T_M:  w += sign(M) (clipped to [-127, 127]);  M -= sign(M) * T_M

Under random fitness M has the stationary variance Var(Z) / (1 - beta**2), so T_M is the
z-test threshold for that variance: the least integer with
256 * T_M**2 * (2**(d+1) - 1) >= k**2 * P * E[a^2] * E[b^2] * 2**(2d). A move spends T_M of
the accumulated evidence (sigma-delta style), so a steady signal moves a weight again only
once it has built up again. M (`momentum.<tensor>`) is in the replica digest and the
checkpoints.
"""

from __future__ import annotations

from fractions import Fraction
from typing import TYPE_CHECKING

import numpy as np

from ..perturb import Specs, StateSpec, Tensors
from .fixedpoint import sshift
from .ztest import alpha_at, move, move_threshold

if TYPE_CHECKING:
    from ..config import RunConfig

MOMENTUM_LIMIT = (1 << 31) - 1


def momentum_gain(shift: int) -> Fraction:
    """Var(M) / Var(Z) at stationarity: 1 / (1 - beta**2) with beta = 1 - 2**-shift."""
    return Fraction(1 << (2 * shift), (1 << (shift + 1)) - 1)


def state_specs(cfg: RunConfig, specs: Specs) -> tuple[StateSpec, ...]:
    return tuple(StateSpec(f"momentum.{s.name}", s.shape, np.int32) for s in specs)


def update(
    cfg: RunConfig, step: int, specs: Specs, params: Tensors, state: Tensors, z: Tensors
) -> tuple[Tensors, Tensors]:
    """The rule of the module docstring, vectorised over each tensor."""
    shift = cfg.update.momentum_shift
    alpha = alpha_at(cfg.update, step)
    threshold = move_threshold(cfg.pairs, alpha, cfg.es.noise, momentum_gain(shift))
    new: Tensors = {}
    new_state: Tensors = {}
    for name, zt in z.items():
        m = state[f"momentum.{name}"].astype(np.int64)
        m = np.clip(m - sshift(m, shift) + zt, -MOMENTUM_LIMIT, MOMENTUM_LIMIT)
        direction = np.where(np.abs(m) >= threshold, np.sign(m), 0)
        new[name] = move(params[name], direction)
        new_state[f"momentum.{name}"] = (m - direction * threshold).astype(np.int32)
    return new, new_state
