"""The objectives: what a chunk's fitness measures, and the registry that picks one by name.

An objective is one module in this folder (next_token.py, reward.py) with
    SCORE                        the name of a step's mean score ("loss_bits", "reward")
    WINDOWS                      whether members read the train split's windows
    check(cfg)                   None, or one line naming its first invalid setting
    files(cfg)                   the goal files it reads (`GoalFile`), pinned by the config
    inline_code(cfg)             code the config itself carries (a lambda reward), or None:
                                 a worker runs none that a coordinator sends
    member_tokens(cfg, members)  the tokens `members` members score or write in a step
    mean_score(cfg, total)       a step's mean score from the sum of its chunks' integers
    loss_range(cfg)              inclusive bounds of one chunk's integer sum
and one line in `OBJECTIVES`. How a worker evaluates a chunk for it is worker/objective.py.
Like the architectures and rules, these modules import the config only for annotations,
so that shared/config.py may ask the registry for its checks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from . import next_token, reward
from .goal_file import GoalFile

if TYPE_CHECKING:
    from ..config import RunConfig

__all__ = ["OBJECTIVES", "GoalFile", "Objective", "objective_of"]


class Objective(Protocol):
    """What an objective module provides (see the module docstring)."""

    SCORE: str
    WINDOWS: bool

    def check(self, cfg: RunConfig) -> str | None: ...

    def files(self, cfg: RunConfig) -> list[GoalFile]: ...

    def inline_code(self, cfg: RunConfig) -> str | None: ...

    def member_tokens(self, cfg: RunConfig, members: int) -> int: ...

    def mean_score(self, cfg: RunConfig, total: int) -> float: ...

    def loss_range(self, cfg: RunConfig) -> tuple[int, int]: ...


OBJECTIVES: dict[str, Objective] = {"next_token": next_token, "reward": reward}


def objective_of(cfg: RunConfig) -> Objective:
    """The run's objective (its name is checked when the config is loaded)."""
    return OBJECTIVES[cfg.fitness.objective]
