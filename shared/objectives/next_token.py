"""The next-token objective: a member's fitness is its loss on the data's windows.

Each member reads seq_len + 1 tokens of the train split per step (shared/window.py); its
integer loss is in 1/16 bit (shared/loss.py). A chunk's sum crosses the wire as RESULT's
loss_sum, and the step's mean is reported in bits per token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..loss import token_loss

if TYPE_CHECKING:
    from ..config import RunConfig
    from .goal_file import GoalFile

WINDOWS = True  # each member reads seq_len + 1 tokens of the train split
SCORE = "loss_bits"


def check(cfg: RunConfig) -> str | None:
    """The reward's settings are refused here: they would silently do nothing."""
    for name in ("reward", "rewards", "prompts"):
        if getattr(cfg.fitness, name):
            return (
                f"fitness.{name} is set but fitness.objective is 'next_token': "
                "set objective = 'reward' to train for it"
            )
    return None


def files(cfg: RunConfig) -> list[GoalFile]:
    return []  # the data is checked by its own digest (shared/data.py)


def inline_code(cfg: RunConfig) -> str | None:
    return None


def member_tokens(cfg: RunConfig, members: int) -> int:
    """Tokens `members` members score in a step: seq_len each."""
    return members * cfg.es.seq_len


def mean_score(cfg: RunConfig, total: int) -> float:
    """A step's mean loss in bits per token from its chunks' integer losses (1/16 bit)."""
    return total / 16 / (cfg.es.population * cfg.es.seq_len)


def loss_range(cfg: RunConfig) -> tuple[int, int]:
    """Inclusive bounds of one chunk's loss sum, for checking what a worker reports.

    A token's integer loss only falls as its target logit rises and only rises as the
    others do, so it lies between the loss of a row with the target at the top and every
    other logit at the bottom, and the reverse.
    """
    v = cfg.model.vocab_size
    best = np.full((1, v), -128, dtype=np.int32)
    best[0, 0] = 127
    worst = np.full((1, v), 127, dtype=np.int32)
    worst[0, 0] = -128
    target = np.zeros(1, dtype=np.int64)
    lo, hi = int(token_loss(best, target)[0]), int(token_loss(worst, target)[0])
    tokens = cfg.es.chunk_size * cfg.es.seq_len
    return tokens * lo, tokens * hi
