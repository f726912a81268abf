"""Replica state (weights at a step), its 64-bit digest, and the checkpoint file format.

The state at step s is a pure function of (run config, fitness of steps 0..s-1): `replay`
says so in code, and the digest proves two replicas agree. It is BLAKE2b-64 of

    b"eggroll-replica/1" | config digest (32 B) | step (u64 BE) |
    for each tensor in param_specs order: its int8 bytes (C order)

Checkpoint file (all integers big-endian):

    offset  size  field
    0       8     magic b"EGGCKPT\\0"
    8       4     format version (1)
    12      4     config length C
    16      C     canonical run-config bytes
    16+C    8     step
    24+C    4     tensor count N
            ...   N times: u16 name length, name (UTF-8), u8 ndim, ndim x u32 shape,
                  u8 dtype (1 = int8), u64 byte count, the bytes (C order)
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
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .atomic_file import write_atomic
from .config import ConfigError, RunConfig, from_canonical_bytes
from .model import init_params, param_specs
from .update import apply_update

MAGIC = b"EGGCKPT\0"
FORMAT_VERSION = 1
_DTYPES = {1: np.int8}


class CheckpointError(ValueError):
    """A checkpoint that is corrupt, truncated, or belongs to another run config."""


@dataclass
class ReplicaState:
    """int8 weights after `step` committed updates (no optimizer state for `ztest`)."""

    config: RunConfig
    step: int
    params: dict[str, np.ndarray]

    @classmethod
    def initial(cls, config: RunConfig) -> ReplicaState:
        return cls(config, 0, init_params(config.model))

    def digest(self) -> int:
        h = hashlib.blake2b(digest_size=8)
        h.update(b"eggroll-replica/1")
        h.update(self.config.digest())
        h.update(struct.pack(">Q", self.step))
        for spec in param_specs(self.config.model):
            h.update(np.ascontiguousarray(self.params[spec.name]).tobytes())
        return int.from_bytes(h.digest(), "big")

    def digest_hex(self) -> str:
        return f"{self.digest():016x}"


def replay(state: ReplicaState, fitness: Iterable[np.ndarray]) -> ReplicaState:
    """Apply committed steps' fitness (int8 in {-1, 0, 1}, one array per step, all pairs) to
    a state: the replica every worker reaches, whatever its backend (no data needed)."""
    cfg, params, step = state.config, state.params, state.step
    for values in fitness:
        params, _ = apply_update(cfg, step, params, values)
        step += 1
    return ReplicaState(cfg, step, params)


def encode_checkpoint(state: ReplicaState) -> bytes:
    cfg = state.config.canonical_bytes()
    specs = param_specs(state.config.model)
    parts = [
        MAGIC,
        struct.pack(">II", FORMAT_VERSION, len(cfg)),
        cfg,
        struct.pack(">QI", state.step, len(specs)),
    ]
    for spec in specs:
        data = np.ascontiguousarray(state.params[spec.name], dtype=np.int8)
        name = spec.name.encode()
        parts += [
            struct.pack(">H", len(name)),
            name,
            struct.pack(">B", data.ndim),
            struct.pack(f">{data.ndim}I", *data.shape),
            struct.pack(">BQ", 1, data.nbytes),
            data.tobytes(),
        ]
    parts.append(struct.pack(">Q", state.digest()))
    body = b"".join(parts)
    return body + struct.pack(">I", zlib.crc32(body))


def checkpoint_bytes(config: RunConfig) -> int:
    """The exact size of every checkpoint of this run: what a peer may send or ask us to
    hold for a snapshot, and not a byte more."""
    size = len(MAGIC) + 8 + len(config.canonical_bytes()) + 12
    for spec in param_specs(config.model):
        n = int(np.prod(spec.shape, dtype=np.int64))
        size += 2 + len(spec.name.encode()) + 1 + 4 * len(spec.shape) + 9 + n
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


def decode_checkpoint(data: bytes) -> ReplicaState:
    """Parse and verify a checkpoint (CRC, layout, config, digest)."""
    if len(data) < len(MAGIC) + 12 or data[: len(MAGIC)] != MAGIC:
        raise CheckpointError("not an eggroll checkpoint (bad magic)")
    body, (crc,) = data[:-4], struct.unpack(">I", data[-4:])
    if zlib.crc32(body) != crc:
        raise CheckpointError("checkpoint CRC mismatch: the file is corrupt")
    r = _Reader(body)
    r.take(len(MAGIC))
    version, cfg_len = r.unpack(">II")
    if version != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint format {version} is not supported")
    try:
        config = from_canonical_bytes(r.take(cfg_len))
    except ConfigError as exc:
        raise CheckpointError(f"checkpoint holds an invalid config: {exc}") from None
    step, count = r.unpack(">QI")
    specs = {s.name: s for s in param_specs(config.model)}
    if count != len(specs):
        raise CheckpointError(f"checkpoint has {count} tensors, the config needs {len(specs)}")
    params = {}
    for _ in range(count):
        (name_len,) = r.unpack(">H")
        name = r.take(name_len).decode("utf-8", errors="replace")
        (ndim,) = r.unpack(">B")
        shape = r.unpack(f">{ndim}I")
        dtype_code, nbytes = r.unpack(">BQ")
        spec = specs.get(name)
        if spec is None or tuple(shape) != spec.shape or dtype_code not in _DTYPES:
            raise CheckpointError(f"checkpoint tensor {name!r} {shape} does not fit the config")
        if nbytes != int(np.prod(shape)):
            raise CheckpointError(f"checkpoint tensor {name!r} has a wrong byte count")
        params[name] = (
            np.frombuffer(r.take(nbytes), dtype=_DTYPES[dtype_code]).reshape(shape).copy()
        )
    (digest,) = r.unpack(">Q")
    if r.pos != len(body):
        raise CheckpointError("checkpoint has trailing bytes")
    state = ReplicaState(config, step, params)
    if state.digest() != digest:
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
