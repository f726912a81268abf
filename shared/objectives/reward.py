"""The reward objective: members continue the step's prompts and a reward scores the text.

With `fitness.objective = "reward"` a member is not scored on the data's windows: it
continues the step's prompts (shared/prompts.py; shared/sample.py's exact integer sampling,
seeded by step and prompt, so both members of a pair and every member of the population
read the same prompts with the same randomness), a reward function scores each completion,
and

    F_k = sign(R(2k) - R(2k+1)),   R(m) = fsum of member m's rewards over the step's prompts

+1 when the + member (even id) earned more, 0 on a tie. fsum is exactly rounded, so R is
the same number on every machine. The rewards are floats and never enter the replica: only
the ternary fitness does, as with the loss.

The reward is `fitness.reward = "score.py:function"` (a file pinned by its sha256, read
relative to the config's folder or a worker's --goal-dir) or "builtin:NAME" for the
functions in `BUILTIN_REWARDS`; the prompts are a file, also pinned, or "data" for the
beginnings of the data's documents.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from .goal_file import GoalFile

if TYPE_CHECKING:
    from ..config import RunConfig

WINDOWS = False  # members continue prompts; the data is read for held-out scores only
SCORE = "reward"
BUILTIN = "builtin:"
DATA_PROMPTS = "data"
# Each reward lies within ±MAX_REWARD, and a chunk's sum crosses the wire (RESULT's
# loss_sum) as an integer in REWARD_UNITs, which stays inside int64 (`check` bounds
# chunk_size * prompts_per_step).
MAX_REWARD = 1e6
REWARD_UNIT = 1e-6


# --- built-in rewards: for demos and tests ---------------------------------------------


def letter_e(text: str) -> float:
    """The share of the letter e among the completion's characters (0 for an empty one)."""
    return text.lower().count("e") / len(text) if text else 0.0


def brackets(text: str) -> float:
    """1 for a completion that opens at least one bracket and closes every one it opens, in
    order; otherwise the share of its brackets that are matched."""
    pairs, stack, matched, total = {")": "(", "]": "[", "}": "{"}, [], 0, 0
    for ch in text:
        if ch in "([{":
            stack.append(ch)
            total += 1
        elif ch in pairs:
            total += 1
            if stack and stack[-1] == pairs[ch]:
                stack.pop()
                matched += 2
    if total == 0:
        return 0.0
    return 1.0 if matched == total else matched / total


BUILTIN_REWARDS: dict[str, Callable[[str], float]] = {"letter_e": letter_e, "brackets": brackets}


def reward_target(spec: str) -> tuple[str, str]:
    """'score.py:function' -> ('score.py', 'function'); 'builtin:NAME' -> ('', NAME);
    ValueError with one line for anything else."""
    if spec.startswith(BUILTIN):
        name = spec[len(BUILTIN) :]
        if name not in BUILTIN_REWARDS:
            known = ", ".join(BUILTIN + n for n in BUILTIN_REWARDS)
            raise ValueError(f"fitness.reward={spec!r} is not a built-in reward (known: {known})")
        return "", name
    path, sep, function = spec.rpartition(":")
    if not sep or not path or not function.isidentifier() or not path.endswith(".py"):
        raise ValueError(
            f"fitness.reward={spec!r} must be 'file.py:function' or one of "
            f"{', '.join(BUILTIN + n for n in BUILTIN_REWARDS)}"
        )
    return path, function


# --- the objective -----------------------------------------------------------------------


def check(cfg: RunConfig) -> str | None:
    """None, or one line naming the first invalid reward setting."""
    f = cfg.fitness
    if not f.reward:
        return "fitness.objective='reward' needs fitness.reward ('file.py:function')"
    if not f.prompts:
        return "fitness.objective='reward' needs fitness.prompts (a file or 'data')"
    if f.chunk_mean_filter or f.adaptive_threshold:
        return (
            "fitness.chunk_mean_filter and adaptive_threshold shape loss differences: "
            "turn them off for objective='reward'"
        )
    for name, lo, hi in (
        ("prompts_per_step", 1, 1024),
        ("completion_tokens", 1, 4096),
        ("temperature", 0, 100_000),
        ("min_p", 0, 1000),
        ("held_out_prompts", 0, 4096),
    ):
        value = getattr(f, name)
        if not lo <= value <= hi:
            return f"fitness.{name}={value} must be {lo}..{hi}"
    # A chunk's reward sum crosses the wire in millionths of at most 1e6 each.
    if cfg.es.chunk_size * f.prompts_per_step >= 9_000_000:
        return "es.chunk_size * fitness.prompts_per_step must be below 9,000,000 completions"
    try:
        reward_target(f.reward)
    except ValueError as exc:
        return str(exc)
    return None


def files(cfg: RunConfig) -> list[GoalFile]:
    """The reward's source (unless built in) and the prompts file (unless "data")."""
    f, out = cfg.fitness, []
    path, _ = reward_target(f.reward)
    if path:
        out.append(GoalFile("fitness.reward_sha256", path, f.reward_sha256, "reward file"))
    if f.prompts != DATA_PROMPTS:
        out.append(GoalFile("fitness.prompts_sha256", f.prompts, f.prompts_sha256, "prompts file"))
    return out


def member_tokens(cfg: RunConfig, members: int) -> int:
    """The tokens `members` members generate in a step: prompts_per_step completions each."""
    f = cfg.fitness
    return members * f.prompts_per_step * f.completion_tokens


def mean_score(cfg: RunConfig, total: int) -> float:
    """A step's mean reward per completion from its chunks' sums in millionths."""
    return total * REWARD_UNIT / (cfg.es.population * cfg.fitness.prompts_per_step)


def loss_range(cfg: RunConfig) -> tuple[int, int]:
    """Inclusive bounds of one chunk's reward sum in millionths (each within ±MAX_REWARD)."""
    bound = cfg.es.chunk_size * cfg.fitness.prompts_per_step * round(MAX_REWARD / REWARD_UNIT)
    return -bound, bound


# --- fitness from rewards -------------------------------------------------------------------


def reward_fitness(rewards: np.ndarray) -> np.ndarray:
    """Ternary fitness (int8, one per pair) from rewards (members, prompts), members in
    pairs (+, -): sign of the difference of the pair's exactly summed rewards."""
    totals = [math.fsum(row) for row in np.asarray(rewards, dtype=np.float64).tolist()]
    plus, minus = totals[0::2], totals[1::2]
    return np.array([(p > m) - (p < m) for p, m in zip(plus, minus, strict=True)], dtype=np.int8)


def reward_units(rewards: np.ndarray) -> int:
    """A chunk's reward sum in millionths, the integer RESULT carries for reporting."""
    return round(math.fsum(np.asarray(rewards, dtype=np.float64).ravel().tolist()) / REWARD_UNIT)
