"""Fitness shaping: one ternary value per antithetic pair, from the pair's two losses.

F_k = sign(loss(2k+1) - loss(2k)): +1 when the + member (even id) scored the lower loss.
Two optional d-eggs filters, both computed over one chunk and in exact integers so that a
chunk evaluated twice (a straggler backup) gives byte-identical fitness:

- chunk mean filter: add sign(m) * floor(|m| ** 1.2) to every diff, where m is the chunk's
  mean diff truncated toward zero; |m| ** 1.2 is the integer 5th root of |m| ** 6.
- adaptive threshold: fitness 0 where |diff| < 0.1 * mean |diff| over the chunk.
"""

from __future__ import annotations

import numpy as np

from .config import FitnessConfig, RunConfig
from .model import ARCHS
from .objectives import objective_of


def _iroot(x: int, n: int) -> int:
    """floor(x ** (1/n)) for a non-negative int, exactly."""
    r = round(x ** (1.0 / n)) if x else 0  # a float guess, corrected below
    while r**n > x:
        r -= 1
    while (r + 1) ** n <= x:
        r += 1
    return r


def pair_fitness(member_loss: np.ndarray, cfg: FitnessConfig) -> np.ndarray:
    """Ternary fitness (int8, one per pair) from per-member integer losses (even length)."""
    loss = np.asarray(member_loss, dtype=np.int64)
    diff = loss[1::2] - loss[0::2]
    n = len(diff)
    if cfg.chunk_mean_filter and n:
        total = int(diff.sum())
        mean = abs(total) // n
        bias = _iroot(mean**6, 5)
        diff = diff + (bias if total >= 0 else -bias)
    fit = np.sign(diff).astype(np.int8)
    if cfg.adaptive_threshold and n:
        total_abs = int(np.abs(diff).sum())
        fit[10 * n * np.abs(diff) < total_abs] = 0
    return fit


# The objective's own arithmetic (shared/objectives/), asked for the run's objective.


def member_tokens(cfg: RunConfig, members: int) -> int:
    """Tokens `members` members score (or write, for a reward) in a step."""
    return objective_of(cfg).member_tokens(cfg, members)


def mean_score(cfg: RunConfig, score_sum: int) -> float:
    """A step's mean score (bits per token, or a reward run's mean reward per completion)
    from the sum of its chunks' loss_sum."""
    return objective_of(cfg).mean_score(cfg, score_sum)


def chunk_loss_range(cfg: RunConfig) -> tuple[int, int]:
    """Inclusive bounds of one chunk's loss_sum, for checking what a worker reports."""
    return objective_of(cfg).loss_range(cfg)


def checked_by_claims(cfg: RunConfig) -> bool:
    """Whether a chunk's result comes with its completions (protocol CLAIM), which a second
    worker checks token by token before it scores their text: a reward run of a model whose
    fitness is not exact across devices (a Hugging Face model's sampled text)."""
    return cfg.fitness.objective == "reward" and not ARCHS[cfg.model.arch].EXACT
