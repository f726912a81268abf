"""The counter-based noise of `shared.noise`, computed by PyTorch where a tensor lives.

The keys (one 64-bit word per pair) are made on the host by `shared.noise` and cross to the
device as int64; the element bits, the only per-weight work, are made on the device. torch
has no unsigned 32-bit arithmetic, so every uint32 value is held in an int64 in
[0, 2**32): a product of two such values wraps modulo 2**64 on every device (two's
complement), which leaves its low 32 bits exact, and the mask after each multiply keeps the
value non-negative, so every right shift is a logical one. The result equals
`shared.noise.element_bits` / `bits_to_values` bit for bit, on a CPU or a GPU.

`pair_factors` / `member_factors` are `shared.hf`'s of the same names made where the model
runs: the keys (one per pair and target) are the only thing that crosses to the device, and
the bits of many targets are made by one kernel sequence (their columns side by side).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..shared import hf
from ..shared.hf import HFError
from ..shared.hf_dir import require_hf
from ..shared.noise import noise_keys

if TYPE_CHECKING:
    from ..shared.config import RunConfig
    from ..shared.hf import Target

__all__ = ["element_bits", "member_factors", "noise_values", "pair_factors", "stream_values"]

_M32 = 0xFFFFFFFF


def _fmix32(x: Any) -> Any:
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _M32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)


def element_bits(keys: np.ndarray, start: int, count: int, device: Any) -> Any:
    """bits(key, index) for each uint64 key (rows) and index in [start, start + count)
    (columns), as an int64 tensor of uint32 values on `device`."""
    torch, _ = require_hf()
    keys = np.asarray(keys, dtype=np.uint64).reshape(-1, 1)
    lo = torch.from_numpy((keys & np.uint64(_M32)).astype(np.int64)).to(device)
    hi = torch.from_numpy((keys >> np.uint64(32)).astype(np.int64)).to(device)
    index = (torch.arange(start, start + count, dtype=torch.int64, device=device) & _M32)[None]
    return _fmix32(lo ^ _fmix32(index ^ hi))


def noise_values(bits: Any, kind: str) -> Any:
    """`shared.noise.bits_to_values` on a tensor of uint32 values (int64): int8 noise."""
    torch, _ = require_hf()
    if kind == "uniform":
        m = (bits >> 1) & 15
        return torch.where((bits & 1).bool(), m, -m).to(torch.int8)
    if kind == "gaussian":
        d = (bits & 255) + ((bits >> 8) & 255) + ((bits >> 16) & 255) + (bits >> 24) - 510
        mag = (d.abs() * 7) >> 6
        return torch.where(d < 0, -mag, mag).to(torch.int8)
    raise ValueError(f"unknown noise kind {kind!r}")


# Elements whose int64 intermediates are held at once while making factors (128 MiB each).
CHUNK = 1 << 24


def stream_values(keys: np.ndarray, sizes: Sequence[int], kind: str, device: Any) -> Any:
    """int8 noise (rows, sum(sizes)): column block j holds indices [0, sizes[j]) of the
    streams of keys[:, j] (uint64, (rows, len(sizes))), side by side."""
    torch, _ = require_hf()
    keys = np.asarray(keys, dtype=np.uint64)
    lo = torch.from_numpy((keys & np.uint64(_M32)).astype(np.int64)).to(device)
    hi = torch.from_numpy((keys >> np.uint64(32)).astype(np.int64)).to(device)
    total = int(sum(sizes))
    width = torch.tensor(list(sizes), dtype=torch.int64, device=device)
    column = torch.repeat_interleave(
        torch.arange(len(sizes), device=device), width, output_size=total
    )  # which key each column reads
    start = torch.cumsum(width, 0) - width
    index = torch.arange(total, dtype=torch.int64, device=device) - start[column]
    bits = _fmix32(lo[:, column] ^ _fmix32(index[None] ^ hi[:, column]))
    return noise_values(bits, kind)


def pair_factors(
    cfg: RunConfig,
    step: int,
    targets: Sequence[Target],
    pairs: np.ndarray,
    device: Any,
    host: bool | None = None,
) -> list[tuple[Any, Any]]:
    """`shared.hf.pair_factors` of each target on `device`: int8 A (P, out, r) and
    B (P, in, r), made in as few kernel sequences as CHUNK allows. `host`: made by
    `shared.hf` with NumPy instead (None: where the device is the CPU, on which NumPy's
    uint32 arithmetic is several times faster than torch's int64)."""
    torch, _ = require_hf()
    if host or (host is None and torch.device(device).type == "cpu"):
        made = [hf.pair_factors(cfg, step, t, np.asarray(pairs, np.int64)) for t in targets]
        return [(torch.from_numpy(a).to(device), torch.from_numpy(b).to(device)) for a, b in made]
    pairs = np.asarray(pairs, dtype=np.uint64)
    r, seed, kind = cfg.model.rank, cfg.es.run_seed, cfg.es.noise
    sizes = [(t.shape[0] + t.shape[1]) * r for t in targets]
    out: list[tuple[Any, Any]] = []
    lo = 0
    while lo < len(targets):  # a run of targets whose bits fit CHUNK (at least one)
        hi, held = lo + 1, sizes[lo]
        while hi < len(targets) and (held + sizes[hi]) * len(pairs) <= CHUNK:
            held += sizes[hi]
            hi += 1
        keys = np.stack([noise_keys(seed, step, pairs, t.tensor_id) for t in targets[lo:hi]], 1)
        values = torch.split(stream_values(keys, sizes[lo:hi], kind, device), sizes[lo:hi], 1)
        for t, v in zip(targets[lo:hi], values, strict=True):
            rows, cols = t.shape
            a = v[:, : rows * r].reshape(len(pairs), rows, r)
            b = v[:, rows * r :].reshape(len(pairs), cols, r)
            out.append((a, b))
        lo = hi
    return out


def member_factors(
    cfg: RunConfig,
    step: int,
    targets: Sequence[Target],
    first: int,
    count: int,
    device: Any,
    host: bool | None = None,
) -> list[tuple[Any, Any]]:
    """`shared.hf.member_factors` of each target on `device`: int8 A (count, out, r) with
    each member's sign folded in, and B (count, in, r), for members [first, first + count).
    Only the pairs' keys cross to the device (`host` as in `pair_factors`)."""
    torch, _ = require_hf()
    if count < 1 or first < 0 or first + count > cfg.es.population:
        raise HFError(f"members [{first}, {first + count}) outside the population")
    pairs = np.arange(first >> 1, ((first + count - 1) >> 1) + 1, dtype=np.int64)
    members = torch.arange(first, first + count, device=device)
    where = (members >> 1) - int(pairs[0])
    sign = (1 - 2 * (members & 1)).to(torch.int8)[:, None, None]
    return [
        (a.index_select(0, where) * sign, b.index_select(0, where))
        for a, b in pair_factors(cfg, step, targets, pairs, device, host)
    ]
