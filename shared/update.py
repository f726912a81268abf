"""A step's update: the exact Z of every weight from the committed fitness, then the
config's rule (shared/rules/) and the adaptive-noise overlays (shared/perturb.py).

For every matrix (and the embedding), over the P pairs k with the + member's noise
a_k (out), b_k (in), as the members saw it (scaled where noise scales apply):

    Z = sum_k F_k a_k b_k^T            an exact GEMM over pairs: (F * A)^T B
    for vectors: Z = sum_k F_k u1_k u2_k

Every rule starts from the same Z, so a device that computes Z itself can hand it to
`update_from_z` and keep the rest of the update here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .matmul import exact_matmul
from .model import ARCHS, param_specs
from .noise import max_abs
from .perturb import (
    NoiseScales,
    StateSpec,
    noise_scales,
    overlay_specs,
    pair_noise,
    update_overlays,
)
from .rules import RULES

if TYPE_CHECKING:
    from .config import RunConfig

PAIR_BLOCK = 4096  # pairs whose noise is held at once while accumulating Z


def accumulate_z(
    cfg: RunConfig, step: int, fitness: np.ndarray, scales: NoiseScales | None = None
) -> dict[str, np.ndarray]:
    """Z for every tensor, from the whole population's fitness (int8, one per pair), with the
    noise the members were evaluated with (`scales`: see `perturb.noise_scales`)."""
    specs = param_specs(cfg.model)
    vmax = max_abs(cfg.es.noise)  # scaled noise is never larger
    z: dict[str, np.ndarray] = {s.name: np.zeros(s.shape, dtype=np.int64) for s in specs}
    active = np.flatnonzero(fitness)  # pairs with F = 0 contribute nothing
    for lo in range(0, len(active), PAIR_BLOCK):
        pairs = active[lo : lo + PAIR_BLOCK]
        f = fitness[pairs].astype(np.float32)
        noise = pair_noise(cfg, specs, step, pairs, scales)
        for name, a in noise.a.items():
            fa_t = (a.astype(np.float32) * f[:, None]).T  # (out, P)
            z[name] += exact_matmul(fa_t, noise.b[name], vmax, vmax)
        for name, u in noise.u.items():
            z[name] += exact_matmul(f[None, :], u, 1, vmax * vmax)[0]
    return z


@dataclass(frozen=True)
class Updated:
    params: dict[str, np.ndarray]
    opt: dict[str, np.ndarray]
    changed: int  # int8 weights that moved


def state_specs(cfg: RunConfig) -> tuple[StateSpec, ...]:
    """The replica state beside the weights: the rule's, then the adaptive-noise overlays,
    in digest and checkpoint order."""
    specs = param_specs(cfg.model)
    rule = RULES[cfg.update.rule].state_specs(cfg, specs)
    return rule + (overlay_specs(specs) if cfg.es.adaptive_noise else ())


def initial_opt_state(cfg: RunConfig) -> dict[str, np.ndarray]:
    return {s.name: np.full(s.shape, s.initial, dtype=s.dtype) for s in state_specs(cfg)}


def update_from_z(
    cfg: RunConfig,
    step: int,
    params: dict[str, np.ndarray],
    opt: dict[str, np.ndarray],
    z: dict[str, np.ndarray],
) -> Updated:
    """Apply Z (from `accumulate_z`, or a device that computed the same) by the config's rule,
    then move the adaptive-noise overlays if the config has them."""
    specs = param_specs(cfg.model)
    new, new_opt = RULES[cfg.update.rule].update(cfg, step, specs, params, opt, z)
    changed = sum(int(np.count_nonzero(w != params[name])) for name, w in new.items())
    if cfg.es.adaptive_noise:
        new_opt = {**new_opt, **update_overlays(specs, params, new, opt)}
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
    own = getattr(ARCHS[cfg.model.arch], "apply_update", None)
    if own is not None:  # an architecture with its own update (shared/hf.py's accumulators)
        new, changed = own(cfg, step, params, fitness)
        return Updated(new, opt, changed)
    z = accumulate_z(cfg, step, fitness, noise_scales(cfg, param_specs(cfg.model), opt))
    return update_from_z(cfg, step, params, opt, z)
