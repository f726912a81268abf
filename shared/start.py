"""Every run's replica at step 0: the init seed's weights, or those of a pinned checkpoint.

`model.init_from` names a checkpoint or snapshot whose replica digest the config pins
(`model.init_digest`, filled in by shared/pinned.py when the config is loaded); only its
weights are taken, the optimizer state starts afresh.
"""

from __future__ import annotations

from pathlib import Path

from .config import RunConfig
from .pinned import read_start, resolve
from .replica import ReplicaState


def initial_state(
    cfg: RunConfig, base: Path | None = None, path: Path | None = None
) -> ReplicaState:
    """The replica at step 0: init_seed's weights, or the weights of `model.init_from`
    (under `base`, or at `path`: a save directory's copy) when its replica digest is the one
    the config pins."""
    if not cfg.model.init_from:
        return ReplicaState.initial(cfg)
    start = read_start(cfg, path or resolve(cfg.model.init_from, base or Path(".")))
    fresh = ReplicaState.initial(cfg)
    return ReplicaState(cfg, 0, {k: v.copy() for k, v in start.params.items()}, fresh.opt)
