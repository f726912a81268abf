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
from .loss import token_loss

# A reward run's rewards: each within ±MAX_REWARD, and a chunk's sum crosses the wire (RESULT's
# loss_sum) as an integer in REWARD_UNITs, which stays inside int64 (shared/config.py bounds
# chunk_size * prompts_per_step).
MAX_REWARD = 1e6
REWARD_UNIT = 1e-6


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


def member_tokens(cfg: RunConfig, members: int) -> int:
    """Tokens `members` members score in a step: seq_len each for the loss; for a reward,
    the tokens they generate (prompts_per_step * completion_tokens each)."""
    f = cfg.fitness
    per = f.prompts_per_step * f.completion_tokens if f.objective == "reward" else cfg.es.seq_len
    return members * per


def mean_score(cfg: RunConfig, score_sum: int) -> float:
    """A step's mean loss in bits per token, or for a reward run its mean reward per
    completion, from the sum of its chunks' loss_sum (a reward run's: millionths)."""
    if cfg.fitness.objective == "reward":
        return score_sum * REWARD_UNIT / (cfg.es.population * cfg.fitness.prompts_per_step)
    return score_sum / 16 / (cfg.es.population * cfg.es.seq_len)


def chunk_loss_range(cfg: RunConfig) -> tuple[int, int]:
    """Inclusive bounds of one chunk's loss sum, for checking what a worker reports (a
    reward run: its rewards' sum in millionths, each reward within ±MAX_REWARD).

    A token's integer loss only falls as its target logit rises and only rises as the
    others do, so it lies between the loss of a row with the target at the top and every
    other logit at the bottom, and the reverse.
    """
    if cfg.fitness.objective == "reward":
        bound = cfg.es.chunk_size * cfg.fitness.prompts_per_step * round(MAX_REWARD / REWARD_UNIT)
        return -bound, bound
    v = cfg.model.vocab_size
    best = np.full((1, v), -128, dtype=np.int32)
    best[0, 0] = 127
    worst = np.full((1, v), 127, dtype=np.int32)
    worst[0, 0] = -128
    target = np.zeros(1, dtype=np.int64)
    lo, hi = int(token_loss(best, target)[0]), int(token_loss(worst, target)[0])
    tokens = cfg.es.chunk_size * cfg.es.seq_len
    return tokens * lo, tokens * hi
