"""Update rules: how a step's Z (shared/update.py) moves the int8 weights, at most one step
each per update.

A rule is one module in this folder with
    state_specs(cfg, specs)   the replica state it keeps beside the weights (`StateSpec`s)
    update(cfg, step, specs, params, state, z) -> (new params, new rule state)
and one line in `RULES`. `update` returns new dicts and leaves its arguments untouched: the
replica's current state may still be read (a snapshot being written). Its state is in the
replica digest and the checkpoints, in the order `state_specs` gives, so it must be a pure
function of the config and the fitness log.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from ..perturb import Specs, StateSpec, Tensors
from . import adamw, momentum, ztest

if TYPE_CHECKING:
    from ..config import RunConfig


class Rule(Protocol):
    """What an update rule module provides (see the package docstring)."""

    def state_specs(self, cfg: RunConfig, specs: Specs) -> tuple[StateSpec, ...]: ...

    def update(
        self, cfg: RunConfig, step: int, specs: Specs, params: Tensors, state: Tensors, z: Tensors
    ) -> tuple[Tensors, Tensors]: ...


RULES: dict[str, Rule] = {"ztest": ztest, "momentum": momentum, "adamw": adamw}
