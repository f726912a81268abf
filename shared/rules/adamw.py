"""The adamw rule: d-eggs' quantised AdamW (moments, a per-weight accumulator, at most one
+-1 move per step, its learning-rate schedule) in fixed point (fixedpoint.py), with bias
correction and no decay on vector parameters.

Per weight, with int32 m and acc and int64 v (all start at 0), ONE = 2**16:

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

B1 = fixed16(beta1), B2 = fixed16(beta2), WD = fixed16(weight_decay), LR = fixed16(lr);
LR_t = LR >> min(step // lr_halve_steps, lr_halvings) (d-eggs: 0.5, 0.25, then 0.125).
Adam is scale invariant, so gs only keeps g**2 and its products inside int64; the +1 under
the division is Adam's epsilon, one unit of g. The bias correction of update t = step + 1,
computed with the quantised betas b = B / 2**16, is

    K_t = round(2**16 * sqrt(1 - b2**t) / (1 - b1**t))    (half up, exactly in integers)

which is 2**16 once max(b1, b2)**t <= 2**-20 (`bias_correction`). The bounds on the right
and beta <= 0.999 (K_t < 2**26), lr <= 16 keep every product below 2**63. The state is
`adamw.m.<tensor>`, `adamw.v.<tensor>`, `adamw.acc.<tensor>` in parameter order.
"""

from __future__ import annotations

from functools import cache
from math import isqrt
from typing import TYPE_CHECKING

import numpy as np

from ..noise import max_abs
from ..perturb import Specs, StateSpec, Tensors
from .fixedpoint import ONE, fixed16, isqrt_array, sshift

if TYPE_CHECKING:
    from ..config import RunConfig, UpdateConfig

R_LIMIT = 1 << 30  # |bias-corrected normalised update| cap, in 2**-16 (16384 weight steps)
ACC_LIMIT = (1 << 31) - 1


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


def state_specs(cfg: RunConfig, specs: Specs) -> tuple[StateSpec, ...]:
    out: list[StateSpec] = []
    for s in specs:
        out += [
            StateSpec(f"adamw.m.{s.name}", s.shape, np.int32),
            StateSpec(f"adamw.v.{s.name}", s.shape, np.int64),
            StateSpec(f"adamw.acc.{s.name}", s.shape, np.int32),
        ]
    return tuple(out)


def update(
    cfg: RunConfig, step: int, specs: Specs, params: Tensors, state: Tensors, z: Tensors
) -> tuple[Tensors, Tensors]:
    """The rule of the module docstring, vectorised over each tensor."""
    up = cfg.update
    b1, b2, wd = fixed16(up.beta1), fixed16(up.beta2), fixed16(up.weight_decay)
    lr, k, gs = lr_at(up, step), bias_correction(up, step), grad_shift(cfg)
    new: Tensors = {}
    new_state: Tensors = {}
    for spec in specs:
        name = spec.name
        w = params[name].astype(np.int64)
        m = state[f"adamw.m.{name}"].astype(np.int64)
        v = state[f"adamw.v.{name}"]
        acc = state[f"adamw.acc.{name}"].astype(np.int64)
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
        new_state[f"adamw.m.{name}"] = m.astype(np.int32)
        new_state[f"adamw.v.{name}"] = v
        new_state[f"adamw.acc.{name}"] = np.clip(acc, -ACC_LIMIT, ACC_LIMIT).astype(np.int32)
    return new, new_state
