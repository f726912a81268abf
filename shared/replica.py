"""Replica state (weights and optimizer state at a step), its 64-bit digest, and the
checkpoint file format.

The state at step s is a pure function of (run config, fitness of steps 0..s-1): `replay`
says so in code, and the digest proves two replicas agree. It is BLAKE2b-64 of

    b"eggroll-replica/2" | config digest (32 B) | step (u64 BE) |
    for each tensor in param_specs order, then each state tensor in state_specs order:
        the BLAKE2b-256 of each DIGEST_LEAF-byte piece of its bytes (C order,
        little-endian: int8 weights, the hf family's weights' bit patterns (int16 for
        bfloat16 and float16, int32 for float32), the rule's state)

A tree of one level, so that a device hashes the leaves where the tensors live, in
parallel, and hands back 32 bytes a leaf instead of the state (worker/backend/digest.cu).
Checkpoints of formats 1 and 2 carry digest 1: BLAKE2b-64 of b"eggroll-replica/1", the
config digest, the step and the tensors' bytes themselves in the same order.

Checkpoint file (all integers big-endian):

    offset  size  field
    0       8     magic b"EGGCKPT\\0"
    8       4     format version (3; 2, the same with digest 1, and 1, weights only, load)
    12      4     config length C
    16      C     canonical run-config bytes
    16+C    8     step
    24+C    4     tensor count N
            ...   N times: u16 name length, name (UTF-8), u8 ndim, ndim x u32 shape,
                  u8 dtype, u64 byte count, the bytes (C order, little-endian)
                  N = the weights in param_specs order, then the optimizer state in
                  state_specs order; dtype 1 = int8, 2 = int16, 3 = int32, 4 = int64
            8     replica digest (u64)
            4     CRC-32 (zlib) of everything before it

Files are written atomically (temporary file in the same directory, fsync, rename, fsync
of the directory), so a crash leaves either the old file or the new one.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .atomic_file import write_atomic
from .config import ConfigError, RunConfig, from_canonical_bytes
from .model import init_params, param_specs
from .update import apply_update, initial_opt_state, state_specs

MAGIC = b"EGGCKPT\0"
FORMAT_VERSION = 3
DIGEST_LEAF = 1 << 16  # bytes of a tensor per leaf of the digest
_DTYPES = {1: np.dtype(np.int8), 2: np.dtype("<i2"), 3: np.dtype("<i4"), 4: np.dtype("<i8")}
_DTYPE_CODES = {dtype: code for code, dtype in _DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint that is corrupt, truncated, or belongs to another run config."""


@dataclass
class ReplicaState:
    """Weights after `step` committed updates (int8; the hf family's target weights as bit
    patterns), and the update rule's state (none for `ztest`; `update.state_specs` says
    what)."""

    config: RunConfig
    step: int
    params: dict[str, np.ndarray]
    opt: dict[str, np.ndarray] = field(default_factory=dict)

    @classmethod
    def initial(cls, config: RunConfig) -> ReplicaState:
        return cls(config, 0, init_params(config.model), initial_opt_state(config))

    def digest(self) -> int:
        leaves = b"".join(leaf_digests(tensor) for tensor in self.tensors())
        return digest_of_leaves(self.config.digest(), self.step, leaves)

    def tensors(self) -> list[np.ndarray]:
        """Every tensor in digest and checkpoint order, little-endian and C-contiguous."""
        params = [(self.params[s.name], s.dtype) for s in param_specs(self.config.model)]
        state = [(self.opt[s.name], s.dtype) for s in state_specs(self.config)]
        return [np.ascontiguousarray(t, dtype=_le(dtype)) for t, dtype in params + state]

    def digest_hex(self) -> str:
        return f"{self.digest():016x}"


def replay(state: ReplicaState, fitness: Iterable[np.ndarray]) -> ReplicaState:
    """Apply committed steps' fitness (int8 in {-1, 0, 1}, one array per step, all pairs) to
    a state: the replica every worker reaches, whatever its backend (no data needed)."""
    cfg, params, opt, step = state.config, state.params, state.opt, state.step
    for values in fitness:
        updated = apply_update(cfg, step, params, opt, values)
        params, opt = updated.params, updated.opt
        step += 1
    return ReplicaState(cfg, step, params, opt)


def leaf_digests(tensor: np.ndarray) -> bytes:
    """The BLAKE2b-256 of each DIGEST_LEAF-byte piece of a tensor's bytes, concatenated."""
    data = memoryview(tensor.reshape(-1)).cast("B")
    return b"".join(
        hashlib.blake2b(data[lo : lo + DIGEST_LEAF], digest_size=32).digest()
        for lo in range(0, max(len(data), 1), DIGEST_LEAF)
    )


def digest_of_leaves(config_digest: bytes, step: int, leaves: bytes) -> int:
    """The replica digest from every tensor's leaf digests in order."""
    h = hashlib.blake2b(digest_size=8)
    h.update(b"eggroll-replica/2")
    h.update(config_digest)
    h.update(struct.pack(">Q", step))
    h.update(leaves)
    return int.from_bytes(h.digest(), "big")


def _digest_1(state: ReplicaState, config_digest: bytes) -> int:
    """Digest 1, which checkpoints of formats 1 and 2 carry."""
    h = hashlib.blake2b(digest_size=8)
    h.update(b"eggroll-replica/1")
    h.update(config_digest)
    h.update(struct.pack(">Q", state.step))
    for spec in param_specs(state.config.model):
        h.update(np.ascontiguousarray(state.params[spec.name], dtype=_le(spec.dtype)).tobytes())
    for spec in state_specs(state.config):
        h.update(np.ascontiguousarray(state.opt[spec.name], dtype=_le(spec.dtype)).tobytes())
    return int.from_bytes(h.digest(), "big")


def _le(dtype: type) -> np.dtype:
    return np.dtype(dtype).newbyteorder("<")


def _tensors(state: ReplicaState) -> list[tuple[str, np.ndarray]]:
    """Every tensor a checkpoint holds, in file order."""
    out = [(s.name, state.params[s.name]) for s in param_specs(state.config.model)]
    out += [(s.name, state.opt[s.name]) for s in state_specs(state.config)]
    return out


def encode_checkpoint(state: ReplicaState) -> bytes:
    cfg = state.config.canonical_bytes()
    tensors = _tensors(state)
    parts = [
        MAGIC,
        struct.pack(">II", FORMAT_VERSION, len(cfg)),
        cfg,
        struct.pack(">QI", state.step, len(tensors)),
    ]
    for tensor_name, tensor in tensors:
        data = np.ascontiguousarray(tensor, dtype=_le(tensor.dtype.type))
        name = tensor_name.encode()
        parts += [
            struct.pack(">H", len(name)),
            name,
            struct.pack(">B", data.ndim),
            struct.pack(f">{data.ndim}I", *data.shape),
            struct.pack(">BQ", _DTYPE_CODES[data.dtype], data.nbytes),
            memoryview(data.reshape(-1)).cast("B"),  # no copy: the join is the only one
        ]
    parts.append(struct.pack(">Q", state.digest()))
    crc = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
    # one copy of the state in all: a snapshot of a large model must not need three
    return b"".join([*parts, struct.pack(">I", crc)])


def checkpoint_bytes(config: RunConfig) -> int:
    """The exact size of every checkpoint of this run: what a peer may send or ask us to
    hold for a snapshot, and not a byte more."""
    size = len(MAGIC) + 8 + len(config.canonical_bytes()) + 12
    specs = [(s.name, s.shape, s.dtype) for s in param_specs(config.model)]
    specs += [(s.name, s.shape, s.dtype) for s in state_specs(config)]
    for name, shape, dtype in specs:
        n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        size += 2 + len(name.encode()) + 1 + 4 * len(shape) + 9 + n
    return size + 8 + 4


class _Reader:
    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise CheckpointError("checkpoint is truncated")
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def unpack(self, fmt: str) -> tuple:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))


def _truncation(data: bytes, version: int) -> str:
    """Why a checkpoint of the current format is short, by the size its own config gives
    ('': not short, or too damaged to tell: the CRC then says it is corrupt)."""
    (cfg_len,) = struct.unpack(">I", data[len(MAGIC) + 4 : len(MAGIC) + 8])
    head = len(MAGIC) + 8
    if version == 1 or cfg_len > 1 << 16:  # formats 2 and 3 share their layout
        return ""
    if len(data) < head + cfg_len:
        return f"{len(data):,} bytes, cut off inside its config"
    try:
        config = from_canonical_bytes(data[head : head + cfg_len])
    except ConfigError:
        return ""
    size = checkpoint_bytes(config)
    return f"{len(data):,} of its {size:,} bytes" if len(data) < size else ""


def decode_checkpoint(data: bytes) -> ReplicaState:
    """Parse and verify a checkpoint (CRC, layout, config, digest)."""
    if len(data) < len(MAGIC) + 12 or data[: len(MAGIC)] != MAGIC:
        raise CheckpointError("not an eggroll checkpoint (bad magic)")
    (version,) = struct.unpack(">I", data[len(MAGIC) : len(MAGIC) + 4])
    if version not in (1, 2, FORMAT_VERSION):  # before the CRC: a newer layout may move it
        raise CheckpointError(
            f"checkpoint format {version} cannot be read here (this version reads formats "
            f"1 to {FORMAT_VERSION}): load it with the release that wrote it"
        )
    short = _truncation(data, version)
    if short:
        raise CheckpointError(f"checkpoint is truncated ({short}): a copy or write cut off")
    body, (crc,) = data[:-4], struct.unpack(">I", data[-4:])
    if zlib.crc32(body) != crc:
        raise CheckpointError("checkpoint CRC mismatch: the file is corrupt")
    r = _Reader(body)
    r.take(len(MAGIC))
    version, cfg_len = r.unpack(">II")
    raw_config = r.take(cfg_len)
    try:
        config = from_canonical_bytes(raw_config)
    except ConfigError as exc:
        raise CheckpointError(f"checkpoint holds an invalid config: {exc}") from None
    step, count = r.unpack(">QI")
    specs = {s.name: (s.shape, _le(s.dtype)) for s in param_specs(config.model)}
    specs |= {s.name: (s.shape, _le(s.dtype)) for s in state_specs(config)}
    if count != len(specs):
        raise CheckpointError(f"checkpoint has {count} tensors, the config needs {len(specs)}")
    tensors = {}
    for _ in range(count):
        (name_len,) = r.unpack(">H")
        name = r.take(name_len).decode("utf-8", errors="replace")
        (ndim,) = r.unpack(">B")
        shape = r.unpack(f">{ndim}I")
        dtype_code, nbytes = r.unpack(">BQ")
        want_shape, want_dtype = specs.get(name, (None, None))
        if tuple(shape) != want_shape or _DTYPES.get(dtype_code) != want_dtype or name in tensors:
            raise CheckpointError(f"checkpoint tensor {name!r} {shape} does not fit the config")
        if nbytes != int(np.prod(shape)) * want_dtype.itemsize:
            raise CheckpointError(f"checkpoint tensor {name!r} has a wrong byte count")
        data = np.frombuffer(r.take(nbytes), dtype=want_dtype).reshape(shape)
        tensors[name] = data.astype(want_dtype.newbyteorder("="))
    (digest,) = r.unpack(">Q")
    if r.pos != len(body):
        raise CheckpointError("checkpoint has trailing bytes")
    params = {s.name: tensors[s.name] for s in param_specs(config.model)}
    opt = {s.name: tensors[s.name] for s in state_specs(config)}
    state = ReplicaState(config, step, params, opt)
    # Format 1 was written before the config grew fields: its digest covers the config
    # bytes as stored, which re-encoding would change.
    if version == 1:
        stored = _digest_1(state, hashlib.sha256(raw_config).digest())
    elif version == 2:
        stored = _digest_1(state, config.digest())
    else:
        stored = state.digest()
    if stored != digest:
        raise CheckpointError("checkpoint digest mismatch: weights do not match their digest")
    return state


def save_checkpoint(path: str | Path, state: ReplicaState) -> None:
    write_atomic(path, encode_checkpoint(state))


def load_checkpoint(path: str | Path) -> ReplicaState:
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist") from None
    return decode_checkpoint(data)
