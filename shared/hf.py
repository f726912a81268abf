"""The `hf` model family: a Hugging Face causal LM fine-tuned by EGGROLL (torch-free side).

A Hugging Face model's weights are floats, and float arithmetic may differ between a CPU and
a GPU. The replica state is the target weights themselves, held as the bit patterns of the
dtype they have in the model directory's safetensors files (`model.weight_dtype`, pinned
with the files' digests by `shared.hf_dir`): int16 for bfloat16 and float16, int32 for
float32, (out, in) as nn.Linear stores them. Step 0 is the files' weights
(`shared.hf_dir.base_state`), and every step changes them by an elementwise rule of IEEE
float32 operations and integer arithmetic that a CPU and a GPU compute bit for bit alike
(NumPy here, PyTorch in worker/hf_update.py), so every replica holds the same bytes after
the same fitness log, whatever device evaluates the members. The weights are the family's
`ParamSpec`s, so checkpoints, snapshots, digests and replay are `shared.replica`'s, as for
the int8 models; a snapshot holds the model's own bytes per target weight.

**Targets.** The matrices that learn are chosen among the model's linear layers (nn.Linear,
and GPT-2's Conv1D) by module-name globs (`model.targets`, fnmatch, case-sensitive, against
the full dotted name). With no pattern: every linear layer inside a block, i.e. whose name
has a numeric component (`transformer.h.3.mlp.c_fc`, `model.layers.0.self_attn.q_proj`),
which leaves out the LM head. The config pins the chosen ones as `model.matrices`, each
"name out in" in nn.Linear's (out, in) convention (Conv1D's weight is its transpose). A
target's noise stream (`tensor_id`) is a hash of its name, so its noise does not depend on
which other targets a run selects.

**Noise.** Pair k at step s perturbs a target with rank-r factors A_k (out, r) and
B_k (in, r) from `shared.noise.noise_block(run_seed, s, [k], tensor_id, ...)`: indices
[0, out*r) of the stream are A in C order, [out*r, out*r + in*r) are B in C order. With m2
the noise's E[v^2], eps_k = A_k B_k^T / (m2 sqrt(r)) has entries of unit variance, and
member m (pair k = m >> 1) sees, for every target,

    W_m = W + sign_m * es.sigma * eps_k,   sign_m = +1 (m even), -1 (odd)

**Update.** After step s with committed fitness F (int8 in {-1, 0, 1}, one per pair), for
each target with stored bits W:

    Z       = sum_k F_k A_k B_k^T          exact integers
    alpha32 = float32(weight_scale(cfg))   lr * sigma / (pairs * m2 * sqrt(r)), rounded once
    w32     = float32(W)                   the exact widening of the stored dtype
    z32     = float32(Z)                   round to nearest even
    s       = w32 + z32 * alpha32          a float32 multiply, then a float32 add, each
                                           rounded to nearest even (never a fused
                                           multiply-add); a NaN s is taken as 0x7FC00000

so that one step moves W by lr * sigma * mean_k(F_k eps_k). Then s is rounded to the stored
dtype. float32 keeps s. bfloat16 and float16 round stochastically with counter-based noise,
so that updates below half a unit in the last place are not all lost: with
u = the low k bits of `bits(key(ROUND, run_seed, s, tensor_id), i)` (`shared.noise`; i the
element's flat index in (out, in) C order, modulo 2**32), k = 16 for bfloat16 and 13 for
float16, and b the uint32 pattern of s,

    b = (b + u) mod 2**32 & ~(2**k - 1)    the magnitude rounds up with probability equal
                                           to the dropped fraction, for either sign

bfloat16 keeps b >> 16; float16 converts the float32 of b to float16 with round to nearest
even (exact in float16's normal range; below it, in the subnormals, the stochastic rounding
to 10 bits is rounded again, to nearest), a NaN as 0x7E00. Every element whose Z is 0 keeps
its bits (so a step whose fitness is all zero moves nothing, -0.0 included).

Z is computed as one float64 GEMM (F * A_all) @ B_all^T over the pairs' concatenated
factors: every product and every partial sum is an integer below 2**53 (the config checks
pairs * rank * max|v|^2), so float64 arithmetic is exact in any summation order and the
result equals the pair-by-pair integer sum bit for bit. Every other step is an IEEE
operation with one correctly rounded result, or integer arithmetic: a device that follows
the rule gets the same bits.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from functools import cache
from typing import TYPE_CHECKING

import numpy as np

from .noise import DOMAIN_ROUND, element_bits, hash_key, max_abs, noise_block, second_moment
from .perturb import ParamSpec

if TYPE_CHECKING:
    from .config import ModelConfig, RunConfig

__all__ = [
    "F64_EXACT",
    "WEIGHT_DTYPES",
    "HFError",
    "Target",
    "apply_update",
    "check",
    "matrices_of",
    "member_factors",
    "member_scale",
    "pair_factors",
    "round_key",
    "select_targets",
    "specs",
    "target_id",
    "targets",
    "update_bits",
    "weight_scale",
    "widen",
    "z_bound",
    "z_by_pairs",
    "z_matrix",
]

F64_EXACT = 1 << 53  # every integer of magnitude up to this is a float64
_BLOCK = re.compile(r"(^|\.)\d+\.")  # a numeric component: a block of a ModuleList
PAIR_BLOCK = 1024  # pairs whose factors are held at once while accumulating Z
# The targets of a 70B-class model fit; a config naming more is not one a coordinator made
# from a real model, and a worker refuses it before allocating anything.
MAX_TARGET_WEIGHTS = 1 << 37
_DIGITS = re.compile("[0-9]{1,7}")
# Mixture-of-experts layers see only some tokens of a batch, so rows are not member-major.
_EXPERTS = re.compile(r"(^|\.)experts?\.")
# model.weight_dtype -> the integer type of its bit patterns in the replica state
WEIGHT_DTYPES = {"bfloat16": np.int16, "float16": np.int16, "float32": np.int32}
ROUND_BITS = {"bfloat16": 16, "float16": 13}  # float32 bits that stochastic rounding drops
CANONICAL_NAN32 = 0x7FC00000
CANONICAL_NAN16 = 0x7E00


class HFError(ValueError):
    """Targets that cannot describe a run (patterns matching nothing, a bad rank...); one
    line."""


@dataclass(frozen=True)
class Target:
    """One target matrix: its module name, (out, in) shape and noise stream."""

    name: str
    shape: tuple[int, int]
    tensor_id: int


def target_id(name: str) -> int:
    """A target's noise stream: the first 8 bytes of BLAKE2b of its name, as u64."""
    digest = hashlib.blake2b(b"eggroll-hf-target/1|" + name.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def select_targets(
    candidates: Sequence[tuple[str, tuple[int, int]]],
    patterns: Sequence[str] = (),
    rank: int = 1,
) -> tuple[Target, ...]:
    """The targets among a model's linear layers (name, (out, in)), in the model's order.

    `patterns`: fnmatch globs on the full module name (empty: every linear layer in a
    block). HFError when nothing matches, a pattern matches nothing, or `rank` does not fit
    a target."""
    if rank < 1:
        raise HFError(f"rank {rank} must be at least 1")
    chosen = []
    for name, shape in candidates:
        if patterns:
            hit = any(fnmatchcase(name, p) for p in patterns)
        else:
            hit = _BLOCK.search(name) is not None
        if hit:
            chosen.append((name, shape))
    for p in patterns:
        if not any(fnmatchcase(name, p) for name, _ in candidates):
            sample = ", ".join(name for name, _ in candidates[:3])
            raise HFError(
                f"target pattern {p!r} matches no linear layer of the model (they are named "
                f"like {sample or 'nothing: the model has none'})"
            )
    if not chosen:
        raise HFError("no linear layer of the model is inside a block: name the targets")
    experts = [name for name, _ in chosen if _EXPERTS.search(name)]
    if experts:
        raise HFError(
            f"target {experts[0]} is a mixture-of-experts layer, which sees only some tokens: "
            "name targets that leave the experts out (e.g. '*.self_attn.*')"
        )
    out = []
    for name, (rows, cols) in chosen:
        if rank > min(rows, cols):
            raise HFError(
                f"rank {rank} is above the size of target {name} ({rows} x {cols}): "
                f"use at most {min(rows, cols)}"
            )
        out.append(Target(name, (int(rows), int(cols)), target_id(name)))
    return tuple(out)


def matrices_of(chosen: Sequence[Target]) -> tuple[str, ...]:
    """The config's pinned `model.matrices`: "name out in" per target."""
    return tuple(f"{t.name} {t.shape[0]} {t.shape[1]}" for t in chosen)


@cache
def targets(m: ModelConfig) -> tuple[Target, ...]:
    """The targets a config pins (`model.matrices`), in order."""
    out = []
    for entry in m.matrices:
        name, rows, cols = entry.split(" ")
        out.append(Target(name, (int(rows), int(cols)), target_id(name)))
    return tuple(out)


# --- the architecture seam (shared/model.py) -------------------------------------------------


def specs(m: ModelConfig) -> tuple[ParamSpec, ...]:
    """Each target's weights as bit patterns of `model.weight_dtype`; the base ("base") is
    the model directory's (`shared.hf_dir.base_state`), not a function of the config alone."""
    dtype = WEIGHT_DTYPES.get(m.weight_dtype, np.int32)
    return tuple(
        ParamSpec(t.name, t.shape, "matrix", "base", t.tensor_id, dtype) for t in targets(m)
    )


FAMILY = "hf"
EXACT = False  # float evaluation: a CPU and a GPU score members differently
OWN_TOKENIZER = True  # the tokenizer saved beside the model


def check(cfg: RunConfig) -> str | None:
    """None, or one line naming the first invalid setting of a Hugging Face run."""
    return _check_model(cfg.model) or _check_run(cfg)


def _check_model(m: ModelConfig) -> str | None:
    if not m.path:
        return "model.arch='hf' needs model.path, the Hugging Face model directory"
    if m.weight_dtype and m.weight_dtype not in WEIGHT_DTYPES:
        return (
            f"model.weight_dtype={m.weight_dtype!r} must be 'bfloat16', 'float16' or 'float32' "
            "(the dtype of the target weights in the model's files)"
        )
    if m.matrices and not m.weight_dtype:
        return (
            "this Hugging Face run config was made by an earlier release, whose replica state "
            "was int64 accumulators (it has model.matrices but no model.weight_dtype): this "
            "release cannot continue it; start a new run, or use that release"
        )
    if not 1 <= m.rank <= 4096:
        return f"model.rank={m.rank} must be 1..4096"
    seen, total = set(), 0
    for entry in m.matrices:
        parts = entry.split(" ")
        if len(parts) != 3 or not parts[0] or not all(_DIGITS.fullmatch(p) for p in parts[1:]):
            return f"model.matrices entry {entry!r} must be 'name out in'"
        rows, cols = int(parts[1]), int(parts[2])
        if not (1 <= rows <= 1 << 20 and 1 <= cols <= 1 << 20):
            return f"model.matrices entry {entry!r}: out and in must be 1..2**20"
        total += rows * cols
        if total > MAX_TARGET_WEIGHTS:
            return f"model.matrices hold more than {MAX_TARGET_WEIGHTS:,} weights in all"
        if m.rank > min(rows, cols):
            return (
                f"model.rank={m.rank} is above the size of target {parts[0]} ({rows} x {cols}): "
                f"use at most {min(rows, cols)}"
            )
        if parts[0] in seen:
            return f"model.matrices names {parts[0]} twice"
        seen.add(parts[0])
    for entry in m.files:
        digest, _, name = entry.partition(" ")
        if len(digest) != 64 or not name or "/" in name or name.startswith("."):
            return f"model.files entry {entry!r} must be 'sha256 name' (a file of the folder)"
    return None


def _check_run(cfg: RunConfig) -> str | None:
    """The settings a Hugging Face run reads, and those it cannot have."""
    es, f = cfg.es, cfg.fitness
    if not (0 < es.sigma <= 1 and math.isfinite(es.sigma)):
        return (
            f"es.sigma={es.sigma} must be in (0, 1]: the perturbation's standard deviation per "
            "weight of a Hugging Face model (e.g. 0.01)"
        )
    for on, name in (
        (es.adaptive_noise, "es.adaptive_noise"),
        (es.token_noise_rows, "es.token_noise_rows"),
        (f.chunk_mean_filter, "fitness.chunk_mean_filter"),
        (f.adaptive_threshold, "fitness.adaptive_threshold"),
        (cfg.update.rule != "ztest", "update.rule"),
        (cfg.model.init_from, "model.init_from"),
    ):
        if on:
            return f"{name} is not available for model.arch='hf'"
    if f.prompts == "data":
        return "fitness.prompts='data' is not available for model.arch='hf': give a prompts file"
    # Z is summed as float64: every partial sum must stay an exact integer.
    if z_bound(cfg.pairs, cfg.model.rank, es.noise) >= F64_EXACT:
        return "es.population * model.rank is too large for an exact update"
    return None


def _numpy_refused(cfg: RunConfig, params: object) -> None:
    raise ValueError(
        "model.arch='hf' is evaluated on PyTorch: run the worker with --backend torch "
        "(pip install 'eggroll-distributed[hf]')"
    )


MODEL = GENERATOR = _numpy_refused


# --- noise, scales and the update -----------------------------------------------------------


def z_bound(pairs: int, rank: int, noise: str) -> int:
    """The largest |Z| entry a step can produce: pairs * rank * max|v|^2."""
    v = max_abs(noise)
    return pairs * rank * v * v


def member_scale(cfg: RunConfig) -> float:
    """Weight per unit of a member's A B^T: sigma / (m2 sqrt(r)) (evaluation only)."""
    return cfg.es.sigma / (float(second_moment(cfg.es.noise)) * math.sqrt(cfg.model.rank))


def weight_scale(cfg: RunConfig) -> float:
    """`alpha`, the weight per unit of Z (the update rule rounds it to float32 once)."""
    return cfg.update.lr * member_scale(cfg) / cfg.pairs


def pair_factors(
    cfg: RunConfig, step: int, target: Target, pairs: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """int8 A (P, out, r) and B (P, in, r) of the given pairs for one target (+ member)."""
    pairs = np.asarray(pairs, dtype=np.int64)
    rows, cols = target.shape
    r = cfg.model.rank
    v = noise_block(
        cfg.es.run_seed, step, pairs, target.tensor_id, 0, (rows + cols) * r, cfg.es.noise
    )
    a = v[:, : rows * r].reshape(len(pairs), rows, r)
    b = v[:, rows * r :].reshape(len(pairs), cols, r)
    return a, b


def member_factors(
    cfg: RunConfig, step: int, target: Target, first: int, count: int
) -> tuple[np.ndarray, np.ndarray]:
    """A (count, out, r) with each member's sign folded in, and B (count, in, r), int8, for
    members [first, first + count)."""
    if count < 1 or first < 0 or first + count > cfg.es.population:
        raise HFError(f"members [{first}, {first + count}) outside the population")
    members = np.arange(first, first + count, dtype=np.int64)
    pairs, where = np.unique(members >> 1, return_inverse=True)
    a, b = pair_factors(cfg, step, target, pairs)
    sign = np.where(members % 2 == 0, 1, -1).astype(np.int8)
    return a[where] * sign[:, None, None], b[where]


def z_matrix(cfg: RunConfig, step: int, target: Target, fitness: np.ndarray) -> np.ndarray:
    """Z = sum_k F_k A_k B_k^T (int64, (out, in)) as float64 GEMMs, exact (module docstring)."""
    fitness = _check_fitness(cfg, fitness)
    rows, cols = target.shape
    z = np.zeros((rows, cols), dtype=np.float64)
    active = np.flatnonzero(fitness)
    for lo in range(0, len(active), PAIR_BLOCK):
        pairs = active[lo : lo + PAIR_BLOCK]
        a, b = pair_factors(cfg, step, target, pairs)
        fa = a.astype(np.float64) * fitness[pairs].astype(np.float64)[:, None, None]
        # (out, P*r) @ (P*r, in): the pairs' rank-r factors side by side
        fa = fa.transpose(1, 0, 2).reshape(rows, -1)
        bt = b.astype(np.float64).transpose(1, 0, 2).reshape(cols, -1).T
        z += fa @ bt  # partial sums stay below 2**53: exact in any order
    return z.astype(np.int64)


def z_by_pairs(cfg: RunConfig, step: int, target: Target, fitness: np.ndarray) -> np.ndarray:
    """The same Z pair by pair in int64 (the reference `z_matrix` must equal)."""
    fitness = _check_fitness(cfg, fitness)
    z = np.zeros(target.shape, dtype=np.int64)
    for k in np.flatnonzero(fitness):
        a, b = pair_factors(cfg, step, target, np.array([k]))
        z += int(fitness[k]) * (a[0].astype(np.int64) @ b[0].astype(np.int64).T)
    return z


def _check_fitness(cfg: RunConfig, fitness: np.ndarray) -> np.ndarray:
    fitness = np.asarray(fitness)
    if fitness.shape != (cfg.pairs,):
        raise HFError(f"fitness has shape {fitness.shape}, expected ({cfg.pairs},)")
    if fitness.dtype != np.int8 or np.any(np.abs(fitness) > 1):
        raise HFError("fitness must be int8 values in {-1, 0, 1}")
    return fitness


def round_key(cfg: RunConfig, step: int, target: Target) -> int:
    """key(ROUND, run_seed, step, tensor_id): the stochastic rounding's noise stream."""
    return hash_key(DOMAIN_ROUND, cfg.es.run_seed, step, target.tensor_id)


def widen(bits: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values of a state's bit patterns (exact)."""
    if dtype == "bfloat16":
        return (bits.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
    if dtype == "float16":
        return bits.view(np.float16).astype(np.float32)
    return bits.view(np.float32)


def update_bits(
    bits: np.ndarray, z: np.ndarray, alpha: float, dtype: str, key: int, start: int = 0
) -> np.ndarray:
    """The update rule (module docstring) on stored bits (int16 or int32) given Z (exact
    integers, int64 or float64, the same shape); `start`: the flat index of the first
    element, which the rounding noise is drawn at."""
    w32 = widen(bits, dtype)
    with np.errstate(over="ignore", invalid="ignore"):  # infinities and NaNs are the rule's
        product = z.astype(np.float32) * np.float32(alpha)
        s = w32 + product  # two float32 operations, each rounded: never fused in NumPy
    b = np.where(np.isnan(s), np.uint32(CANONICAL_NAN32), s.view(np.uint32))
    if dtype == "float32":
        new = b.view(np.int32)
    else:
        k = ROUND_BITS[dtype]
        at = start % (1 << 32)  # indices are uint32: they wrap
        u = element_bits(np.array([key], dtype=np.uint64), at, b.size)[0].reshape(b.shape)
        b = (b + (u & np.uint32((1 << k) - 1))) & np.uint32(0xFFFFFFFF ^ ((1 << k) - 1))
        if dtype == "bfloat16":
            new = (b >> np.uint32(16)).astype(np.uint16).view(np.int16)
        else:
            with np.errstate(over="ignore"):  # beyond float16's range: infinity
                half = b.view(np.float32).astype(np.float16)
            new = np.where(np.isnan(half), np.int16(CANONICAL_NAN16), half.view(np.int16))
    return np.where(z == 0, bits, new).astype(bits.dtype)


def apply_update(
    cfg: RunConfig, step: int, params: dict[str, np.ndarray], fitness: np.ndarray
) -> tuple[dict[str, np.ndarray], int]:
    """The weights (bit patterns) after step `step`'s committed fitness, and how many
    changed: the reference every device's update must equal."""
    fitness = _check_fitness(cfg, fitness)
    alpha, dtype = weight_scale(cfg), cfg.model.weight_dtype
    new, changed = dict(params), 0
    if not np.any(fitness):
        return new, 0
    for t in targets(cfg.model):
        old = params[t.name]
        z = z_matrix(cfg, step, t, fitness)
        new[t.name] = update_bits(old, z, alpha, dtype, round_key(cfg, step, t))
        changed += int(np.count_nonzero(new[t.name] != old))
    return new, changed
