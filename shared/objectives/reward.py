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

The reward is `fitness.reward`: "score.py:function" (a file pinned by its sha256, read
relative to the config's folder or a worker's --goal-dir), "score.py" (its `score`, else its
`reward`), "builtin:NAME" for the functions in `BUILTIN_REWARDS`, or an inline
"lambda text: ..." (or "lambda prompts, completions, **fields: [...]"), pinned by its text
in the config. `fitness.rewards` combines several, each "REWARD:WEIGHT": a completion
scores the fsum of weight * reward over the parts in config order, and each file part is
pinned in `fitness.rewards_sha256`. The prompts are a file, also pinned, or "data" for the
beginnings of the data's documents.
"""

from __future__ import annotations

import ast
import math
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from .goal_file import GoalFile

if TYPE_CHECKING:
    from ..config import FitnessConfig, RunConfig

WINDOWS = False  # members continue prompts; the data is read for held-out scores only
SCORE = "reward"
BUILTIN = "builtin:"
# A Python function given to the API (worker/api.py): called in that process only, pinned
# by the sha256 of its code in fitness.reward_sha256. No worker or command can load it.
PYTHON = "python:"
DATA_PROMPTS = "data"
# Each reward lies within ±MAX_REWARD, and a chunk's sum crosses the wire (RESULT's
# loss_sum) as an integer in REWARD_UNITs, which stays inside int64 (`check` bounds
# chunk_size * prompts_per_step).
MAX_CHUNK_TOKENS = 1 << 26  # completion tokens of one chunk (512 MiB as int64)
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


def is_lambda(spec: str) -> bool:
    """Whether the reward is inline code ("lambda text: ..."), not a file or a built-in."""
    return re.match(r"\s*lambda[\s:]", spec) is not None


def lambda_problem(spec: str) -> str | None:
    """None for a lambda of one text or of (prompts, completions, **fields), else one line.
    Only parsed here: it runs in the reward's own process (worker/reward.py)."""
    shown = spec if len(spec) <= 60 else spec[:60] + "..."
    try:
        body = ast.parse(spec.strip(), mode="eval").body
    except SyntaxError as exc:
        return f"the reward {shown!r} does not parse: {exc.msg}"
    if not isinstance(body, ast.Lambda):
        return f"the reward {shown!r} is not one lambda expression"
    a = body.args
    positional, extra = len(a.posonlyargs) + len(a.args), a.vararg or a.kwonlyargs
    if extra or (positional, a.kwarg is not None) not in ((1, False), (2, True)):
        return (
            f"the reward {shown!r} must take one text (lambda text: ...) or a batch "
            "(lambda prompts, completions, **fields: [...])"
        )
    return None


def reward_target(spec: str) -> tuple[str, str]:
    """'score.py:function' -> ('score.py', 'function'); 'score.py' -> ('score.py', '') (its
    `score`, else `reward`); 'builtin:NAME' -> ('', NAME); a lambda -> ('', ''); ValueError
    with one line for anything else."""
    if is_lambda(spec):
        problem = lambda_problem(spec)
        if problem:
            raise ValueError(problem)
        return "", ""
    if spec.startswith(PYTHON) and spec[len(PYTHON) :]:
        return "", ""
    if spec.startswith(BUILTIN):
        name = spec[len(BUILTIN) :]
        if name not in BUILTIN_REWARDS:
            known = ", ".join(BUILTIN + n for n in BUILTIN_REWARDS)
            raise ValueError(f"fitness.reward={spec!r} is not a built-in reward (known: {known})")
        return "", name
    if spec.endswith(".py"):
        return spec, ""
    path, sep, function = spec.rpartition(":")
    if not sep or not path or not function.isidentifier() or not path.endswith(".py"):
        raise ValueError(
            f"fitness.reward={spec!r} must be 'file.py:function', 'file.py', 'lambda text: "
            f"...' or one of {', '.join(BUILTIN + n for n in BUILTIN_REWARDS)}"
        )
    return path, function


class RewardPart(NamedTuple):
    """One reward of a run: as written (without its weight), its file ("" for a built-in
    or a lambda), its weight (None: the run's only reward) and its file's pinned digest."""

    spec: str
    path: str
    weight: float | None
    sha256: str


def split_weight(part: str) -> tuple[str, float]:
    """'REWARD:WEIGHT' -> (REWARD, WEIGHT); ValueError with one line unless the weight is a
    number other than 0 within ±MAX_REWARD (so weight * reward stays finite)."""
    spec, _, text = part.rpartition(":")
    try:
        weight = float(text)
    except ValueError:
        weight = math.nan
    if not spec or not 0 < abs(weight) <= MAX_REWARD:  # NaN fails too
        raise ValueError(
            f"fitness.rewards part {part!r} must end in ':WEIGHT', a number other than 0 "
            f"within ±{MAX_REWARD:g} (e.g. 'builtin:letter_e:0.3')"
        )
    return spec, weight


def reward_parts(f: FitnessConfig) -> list[RewardPart]:
    """The run's rewards with their weights and pinned digests (one part, weight None,
    without `fitness.rewards`); ValueError with one line for a part that is not valid."""
    if not f.rewards:
        path, _ = reward_target(f.reward)
        pinned = path or f.reward.startswith(PYTHON)  # a file's bytes, or a function's code
        return [RewardPart(f.reward, path, None, f.reward_sha256 if pinned else "")]
    parts: list[RewardPart] = []
    for part in f.rewards:
        if is_lambda(part) and lambda_problem(part.rpartition(":")[0]) and not lambda_problem(part):
            raise ValueError(
                f"fitness.rewards part {part!r} has no weight: a lambda part ends in ':WEIGHT' "
                "too (e.g. 'lambda text: 0.5:1')"
            )
        spec, weight = split_weight(part)
        if any(p.spec == spec for p in parts):
            raise ValueError(f"fitness.rewards names {spec!r} twice: give it one weight")
        parts.append(RewardPart(spec, reward_target(spec)[0], weight, ""))
    pins = iter(f.rewards_sha256)  # one per file part, in order, once the config is pinned
    full = len(f.rewards_sha256) == sum(1 for p in parts if p.path)
    return [p._replace(sha256=next(pins)) if p.path and full else p for p in parts]


# --- the objective -----------------------------------------------------------------------


def check(cfg: RunConfig) -> str | None:
    """None, or one line naming the first invalid reward setting."""
    f = cfg.fitness
    if f.reward and f.rewards:
        return "fitness.reward and fitness.rewards (a weighted combination): set one of them"
    if not f.reward and not f.rewards:
        return "fitness.objective='reward' needs fitness.reward ('file.py:function') or rewards"
    if len(f.rewards) == 1:
        return "fitness.rewards combines two or more rewards: name a single one as fitness.reward"
    if any(part.startswith(PYTHON) for part in f.rewards):
        return "a Python function is a run's only reward (fitness.reward), not a part of rewards"
    if f.reward.startswith(PYTHON) and not f.reward_sha256:
        return (
            f"fitness.reward={f.reward!r} is a function of the Python API, which pins its code "
            "(fitness.reward_sha256): give a file, a built-in or a lambda here"
        )
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
    # What a worker holds for one chunk's completions (members x prompts x tokens): a
    # config from a coordinator must not make it allocate what no machine has.
    generated = cfg.es.chunk_size * f.prompts_per_step * f.completion_tokens
    if generated > MAX_CHUNK_TOKENS:
        return (
            f"es.chunk_size * fitness.prompts_per_step * fitness.completion_tokens is "
            f"{generated:,} tokens a chunk; the limit is {MAX_CHUNK_TOKENS:,}"
        )
    # A chunk's reward sum crosses the wire in millionths of at most 1e6 each.
    if cfg.es.chunk_size * f.prompts_per_step >= 9_000_000:
        return "es.chunk_size * fitness.prompts_per_step must be below 9,000,000 completions"
    try:
        parts = reward_parts(f)
    except ValueError as exc:
        return str(exc)
    files = sum(1 for p in parts if p.path) if f.rewards else 0
    if f.rewards_sha256 and len(f.rewards_sha256) != files:
        return f"fitness.rewards_sha256 must hold one digest per file of fitness.rewards ({files})"
    return None


def files(cfg: RunConfig) -> list[GoalFile]:
    """Every reward file (a combination's in order) and the prompts file (unless "data")."""
    f, out = cfg.fitness, []
    key = "fitness.rewards_sha256" if f.rewards else "fitness.reward_sha256"
    for part in reward_parts(f):
        if part.path:
            out.append(GoalFile(key, part.path, part.sha256, "reward file"))
    if f.prompts != DATA_PROMPTS:
        out.append(GoalFile("fitness.prompts_sha256", f.prompts, f.prompts_sha256, "prompts file"))
    return out


def inline_code(cfg: RunConfig) -> str | None:
    """The first reward the config carries as code rather than names (a lambda, or the
    Python API's function): fine in the process that wrote it, refused by a worker."""
    specs = [p.rpartition(":")[0] for p in cfg.fitness.rewards] or [cfg.fitness.reward]
    return next((s for s in specs if is_lambda(s) or s.startswith(PYTHON)), None)


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
