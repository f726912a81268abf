"""The integer replica state of a Hugging Face causal LM fine-tuned by EGGROLL (torch-free).

A Hugging Face model's weights are floats, and floats differ between a CPU and a GPU. The
replica state is therefore not the weights but, for each target matrix, an integer
accumulator of the exact updates; the base weights are the model directory's, pinned by
their digests. Everything here is NumPy on integers, so every replica computes the same
bytes from the same fitness log, whatever device evaluates the members.

**Targets.** The matrices that learn are chosen among the model's linear layers (nn.Linear,
and GPT-2's Conv1D) by module-name globs (`fnmatch`, case-sensitive, against the full
dotted name). With no pattern: every linear layer inside a block, i.e. whose name has a
numeric component (`transformer.h.3.mlp.c_fc`, `model.layers.0.self_attn.q_proj`), which
leaves out the LM head. A target's shape is (out, in) in nn.Linear's convention (Conv1D's
weight is its transpose). Its noise stream (`tensor_id`) is a hash of its name, so a
target's noise does not depend on which other targets a run selects.

**Noise.** Pair k at step s perturbs a target with rank-r factors A_k (out, r) and
B_k (in, r) drawn from `shared.noise.noise_block(seed, s, [k], tensor_id, ...)`: indices
[0, out*r) of the stream are A in C order, [out*r, out*r + in*r) are B in C order. Member
m belongs to pair k = m >> 1 and sees, for every target,

    W_m = base + alpha * acc + sign_m * sigma * A_k B_k^T,   sign_m = +1 (m even), -1 (odd)

(`alpha` and `sigma` are floats that only the evaluation reads.)

**Update.** After step s with committed fitness F (int8 in {-1, 0, 1}, one per pair):

    Z   = sum_k F_k A_k B_k^T           exact integers, int64
    acc = acc + rate * Z

Z is computed as one float64 GEMM (F * A_all) @ B_all^T over the pairs' concatenated
factors: every product and every partial sum is an integer below 2**53 (checked, see
`z_bound`), so float64 arithmetic is exact in any summation order and the result equals
the pair-by-pair integer sum bit for bit.

**Digest.** BLAKE2b-64 of b"eggroll-hf-replica/1" | spec digest (32 B) | step (u64 BE) |
for each target in spec order: its accumulator as little-endian int64 bytes (C order).
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from fnmatch import fnmatchcase

import numpy as np

from .noise import NOISE_KINDS, max_abs, noise_block

__all__ = [
    "F64_EXACT",
    "HFSpec",
    "HFState",
    "HFStateError",
    "Target",
    "apply_step",
    "decode_state",
    "encode_state",
    "member_factors",
    "pair_factors",
    "replay",
    "select_targets",
    "target_id",
    "z_bound",
    "z_by_pairs",
    "z_matrix",
]

F64_EXACT = 1 << 53  # every integer of magnitude up to this is a float64
_BLOCK = re.compile(r"(^|\.)\d+\.")  # a numeric component: a block of a ModuleList
PAIR_BLOCK = 1024  # pairs whose factors are held at once while accumulating Z


class HFStateError(ValueError):
    """A spec that cannot describe a run (patterns matching nothing, a bad rank...); one line."""


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
    block). HFStateError when nothing matches, a pattern matches nothing, or `rank` does
    not fit a target."""
    if rank < 1:
        raise HFStateError(f"rank {rank} must be at least 1")
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
            raise HFStateError(
                f"target pattern {p!r} matches no linear layer of the model (they are named "
                f"like {sample or 'nothing: the model has none'})"
            )
    if not chosen:
        raise HFStateError("no linear layer of the model is inside a block: name the targets")
    out = []
    for name, (rows, cols) in chosen:
        if rank > min(rows, cols):
            raise HFStateError(
                f"rank {rank} is above the size of target {name} ({rows} x {cols}): "
                f"use at most {min(rows, cols)}"
            )
        out.append(Target(name, (int(rows), int(cols)), target_id(name)))
    return tuple(out)


@dataclass(frozen=True)
class HFSpec:
    """What the integer state depends on, and the two floats its evaluation reads."""

    targets: tuple[Target, ...]
    rank: int
    seed: int
    pairs: int  # the population is 2 * pairs members
    noise: str = "uniform"  # shared.noise kind of A and B
    rate: int = 1  # acc += rate * Z
    sigma: float = 1e-3  # perturbation scale (evaluation only)
    alpha: float = 1e-6  # weight per accumulator unit (evaluation only)
    meta: dict[str, str] = field(default_factory=dict)  # e.g. model-dir digests

    def __post_init__(self) -> None:
        if self.noise not in NOISE_KINDS:
            raise HFStateError(f"noise {self.noise!r} must be one of {NOISE_KINDS}")
        if self.pairs < 1:
            raise HFStateError(f"pairs {self.pairs} must be at least 1")
        if self.rate < 1:
            raise HFStateError(f"rate {self.rate} must be a positive integer")
        if not self.targets:
            raise HFStateError("a spec needs at least one target")
        for t in self.targets:
            if not 1 <= self.rank <= min(t.shape):
                raise HFStateError(f"rank {self.rank} does not fit target {t.name} {t.shape}")
        if z_bound(self) * self.rate >= 1 << 62:
            raise HFStateError("pairs * rank * rate is too large for exact int64 updates")

    def canonical_bytes(self) -> bytes:
        data = asdict(self)
        data["targets"] = [[t.name, list(t.shape), t.tensor_id] for t in self.targets]
        data["sigma"], data["alpha"] = float.hex(self.sigma), float.hex(self.alpha)
        return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()

    def digest(self) -> bytes:
        return hashlib.sha256(self.canonical_bytes()).digest()


def z_bound(spec: HFSpec) -> int:
    """The largest |Z| entry a step can produce: pairs * rank * max|v|^2 (checked < 2**53)."""
    v = max_abs(spec.noise)
    bound = spec.pairs * spec.rank * v * v
    if bound >= F64_EXACT:
        raise HFStateError("pairs * rank is too large for an exact float64 Z")
    return bound


def pair_factors(
    spec: HFSpec, step: int, target: Target, pairs: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """int8 A (P, out, r) and B (P, in, r) of the given pairs for one target (+ member)."""
    pairs = np.asarray(pairs, dtype=np.int64)
    rows, cols = target.shape
    r = spec.rank
    v = noise_block(spec.seed, step, pairs, target.tensor_id, 0, (rows + cols) * r, spec.noise)
    a = v[:, : rows * r].reshape(len(pairs), rows, r)
    b = v[:, rows * r :].reshape(len(pairs), cols, r)
    return a, b


def member_factors(
    spec: HFSpec, step: int, target: Target, first: int, count: int
) -> tuple[np.ndarray, np.ndarray]:
    """A (count, out, r) with each member's sign folded in, and B (count, in, r), int8, for
    members [first, first + count)."""
    members = np.arange(first, first + count, dtype=np.int64)
    if count < 1 or first < 0 or first + count > 2 * spec.pairs:
        raise HFStateError(f"members [{first}, {first + count}) outside the population")
    pairs, where = np.unique(members >> 1, return_inverse=True)
    a, b = pair_factors(spec, step, target, pairs)
    sign = np.where(members % 2 == 0, 1, -1).astype(np.int8)
    return a[where] * sign[:, None, None], b[where]


def z_matrix(spec: HFSpec, step: int, target: Target, fitness: np.ndarray) -> np.ndarray:
    """Z = sum_k F_k A_k B_k^T (int64, (out, in)) as float64 GEMMs, exact (module docstring)."""
    fitness = _check_fitness(spec, fitness)
    z_bound(spec)
    rows, cols = target.shape
    z = np.zeros((rows, cols), dtype=np.float64)
    active = np.flatnonzero(fitness)
    for lo in range(0, len(active), PAIR_BLOCK):
        pairs = active[lo : lo + PAIR_BLOCK]
        a, b = pair_factors(spec, step, target, pairs)
        fa = a.astype(np.float64) * fitness[pairs].astype(np.float64)[:, None, None]
        # (out, P*r) @ (P*r, in): the pairs' rank-r factors side by side
        fa = fa.transpose(1, 0, 2).reshape(rows, -1)
        bt = b.astype(np.float64).transpose(1, 0, 2).reshape(cols, -1).T
        z += fa @ bt  # partial sums stay below 2**53: exact in any order
    return z.astype(np.int64)


def z_by_pairs(spec: HFSpec, step: int, target: Target, fitness: np.ndarray) -> np.ndarray:
    """The same Z pair by pair in int64 (the reference `z_matrix` must equal)."""
    fitness = _check_fitness(spec, fitness)
    z = np.zeros(target.shape, dtype=np.int64)
    for k in np.flatnonzero(fitness):
        a, b = pair_factors(spec, step, target, np.array([k]))
        z += int(fitness[k]) * (a[0].astype(np.int64) @ b[0].astype(np.int64).T)
    return z


def _check_fitness(spec: HFSpec, fitness: np.ndarray) -> np.ndarray:
    fitness = np.asarray(fitness)
    if fitness.shape != (spec.pairs,):
        raise HFStateError(f"fitness has shape {fitness.shape}, expected ({spec.pairs},)")
    if fitness.dtype != np.int8 or np.any(np.abs(fitness) > 1):
        raise HFStateError("fitness must be int8 values in {-1, 0, 1}")
    return fitness


@dataclass
class HFState:
    """The accumulators after `step` committed updates (int64, (out, in) per target)."""

    spec: HFSpec
    step: int
    acc: dict[str, np.ndarray]

    @classmethod
    def initial(cls, spec: HFSpec) -> HFState:
        return cls(spec, 0, {t.name: np.zeros(t.shape, dtype=np.int64) for t in spec.targets})

    def digest(self) -> int:
        h = hashlib.blake2b(digest_size=8)
        h.update(b"eggroll-hf-replica/1")
        h.update(self.spec.digest())
        h.update(struct.pack(">Q", self.step))
        for t in self.spec.targets:
            h.update(np.ascontiguousarray(self.acc[t.name], dtype="<i8").tobytes())
        return int.from_bytes(h.digest(), "big")

    def digest_hex(self) -> str:
        return f"{self.digest():016x}"


def apply_step(state: HFState, fitness: np.ndarray) -> HFState:
    """The state after `state.step`'s committed fitness (a new state; the input is kept)."""
    spec = state.spec
    acc = {}
    for t in spec.targets:
        acc[t.name] = state.acc[t.name] + spec.rate * z_matrix(spec, state.step, t, fitness)
    return HFState(spec, state.step + 1, acc)


def replay(state: HFState, fitness: Iterable[np.ndarray]) -> HFState:
    """Apply committed steps' fitness (one int8 array per step) in order."""
    for values in fitness:
        state = apply_step(state, values)
    return state


# --- checkpoints ---------------------------------------------------------------------------
#
# File (integers big-endian): magic b"EGGHFCK\0" | format (u32, 1) | spec length S (u32) |
# the spec's canonical bytes | step (u64) | target count N (u32) | N times: u16 name length,
# name (UTF-8), out (u32), in (u32), the accumulator as little-endian int64 (C order) |
# state digest (u64) | CRC-32 (zlib) of everything before it. The reader is given the run's
# spec and refuses a file of another.

CKPT_MAGIC = b"EGGHFCK\0"
CKPT_FORMAT = 1


def encode_state(state: HFState) -> bytes:
    spec_bytes = state.spec.canonical_bytes()
    parts = [CKPT_MAGIC, struct.pack(">II", CKPT_FORMAT, len(spec_bytes)), spec_bytes]
    parts.append(struct.pack(">QI", state.step, len(state.spec.targets)))
    for t in state.spec.targets:
        name = t.name.encode()
        parts += [struct.pack(">H", len(name)), name, struct.pack(">II", *t.shape)]
        parts.append(np.ascontiguousarray(state.acc[t.name], dtype="<i8").tobytes())
    parts.append(struct.pack(">Q", state.digest()))
    body = b"".join(parts)
    return body + struct.pack(">I", zlib.crc32(body))


def decode_state(data: bytes, spec: HFSpec) -> HFState:
    """The state a checkpoint holds, verified (CRC, spec, layout, digest); HFStateError."""
    if data[: len(CKPT_MAGIC)] != CKPT_MAGIC:
        raise HFStateError("not a Hugging Face eggroll checkpoint (bad magic)")
    if len(data) < len(CKPT_MAGIC) + 12 or zlib.crc32(data[:-4]) != _u(">I", data[-4:]):
        raise HFStateError("checkpoint is truncated or corrupt (CRC mismatch)")
    pos = len(CKPT_MAGIC)
    version, spec_len = struct.unpack_from(">II", data, pos)
    if version != CKPT_FORMAT:
        raise HFStateError(f"checkpoint format {version} cannot be read here (reads 1)")
    pos += 8
    if data[pos : pos + spec_len] != spec.canonical_bytes():
        raise HFStateError("checkpoint belongs to another run (its spec differs)")
    pos += spec_len
    step, count = struct.unpack_from(">QI", data, pos)
    pos += 12
    if count != len(spec.targets):
        raise HFStateError(f"checkpoint has {count} targets, the spec {len(spec.targets)}")
    acc = {}
    for t in spec.targets:
        (name_len,) = struct.unpack_from(">H", data, pos)
        name = data[pos + 2 : pos + 2 + name_len].decode("utf-8", errors="replace")
        pos += 2 + name_len
        shape = struct.unpack_from(">II", data, pos)
        pos += 8
        if name != t.name or shape != t.shape:
            raise HFStateError(f"checkpoint target {name!r} {shape} does not fit the spec")
        n = shape[0] * shape[1] * 8
        acc[name] = np.frombuffer(data[pos : pos + n], dtype="<i8").astype(np.int64)
        acc[name] = acc[name].reshape(shape)
        pos += n
    state = HFState(spec, step, acc)
    if pos + 12 != len(data) or _u(">Q", data[pos : pos + 8]) != state.digest():
        raise HFStateError("checkpoint digest mismatch: accumulators do not match their digest")
    return state


def _u(fmt: str, raw: bytes) -> int:
    return int(struct.unpack(fmt, raw)[0])
