"""Every run's replica at step 0: the init seed's weights, those of a pinned checkpoint, or a
Hugging Face model's target weights as its files hold them.

`model.init_from` names a checkpoint or snapshot whose replica digest the config pins
(`model.init_digest`, filled in by shared/pinned.py when the config is loaded); only its
weights are taken, the optimizer state starts afresh. An hf run (shared/hf.py) starts from
its model directory's files (`shared.hf_dir.base_state`), which the config pins by digest.
"""

from __future__ import annotations

from pathlib import Path

from .config import RunConfig
from .hf_dir import ModelDirError, base_state
from .model import ARCHS
from .pinned import GoalError, read_start, resolve
from .replica import ReplicaState


def initial_state(
    cfg: RunConfig,
    base: Path | None = None,
    path: Path | None = None,
    model_dir: Path | None = None,
) -> ReplicaState:
    """The replica at step 0: init_seed's weights, or the weights of `model.init_from`
    (under `base`, or at `path`: a save directory's copy) when its replica digest is the one
    the config pins. An hf run's: the target weights of its model directory, `model_dir` or
    `model.path` under `base` (GoalError when they cannot be read)."""
    if ARCHS[cfg.model.arch].FAMILY == "hf":
        where = model_dir or resolve(cfg.model.path, base or Path("."))
        try:
            return base_state(cfg, where)
        except ModelDirError as exc:
            raise GoalError(str(exc)) from None
    if not cfg.model.init_from:
        return ReplicaState.initial(cfg)
    start = read_start(cfg, path or resolve(cfg.model.init_from, base or Path(".")))
    fresh = ReplicaState.initial(cfg)
    return ReplicaState(cfg, 0, {k: v.copy() for k, v in start.params.items()}, fresh.opt)
