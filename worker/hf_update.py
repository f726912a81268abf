"""The hf family's update rule (shared/hf.py's docstring) in PyTorch, where the weights live.

`shared.hf.apply_update` is the reference (NumPy, what `replay` runs); this is the same rule
on the model's device, so that a GPU worker updates its bfloat16 weights in place instead of
copying the state back and forth. Every step is one that gives the same bits on a CPU and a
GPU:

- Z: the pairs' factors are made on the device (`worker.torch_noise`) and multiplied as
  float64, exact in any summation order (every partial sum is an integer below 2**53);
- w32 = float32(W) is a widening, exact; z32 = float32(Z) rounds to nearest even;
- z32 * alpha32 and w32 + that product are two separate float32 kernels, each result
  rounded to nearest even (eager PyTorch never fuses them into a multiply-add);
- the rounding noise is `worker.torch_noise.element_bits`, equal to `shared.noise`'s, and
  the rounding itself is integer arithmetic on uint32 values held in int64 (torch has no
  uint32), masked after every operation that could leave [0, 2**32);
- float32 to float16 is one conversion rounded to nearest even (NaN made canonical).

A target is processed in blocks of rows, so the extra device memory is Z (8 bytes per
weight of one target) and a few int64 temporaries of ROW_ELEMENTS.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..shared import hf
from ..shared.config import RunConfig
from ..shared.hf_dir import require_hf
from .torch_noise import element_bits, pair_factors

__all__ = ["apply_update", "state_dtypes", "update_bits", "z_tensor"]

_M32 = 0xFFFFFFFF
ROW_ELEMENTS = 1 << 22  # weights rounded at once
FACTOR_ELEMENTS = 1 << 22  # noise values of the pairs' factors made at once


def state_dtypes(weight_dtype: str) -> tuple[Any, Any]:
    """(the float dtype, the integer dtype of its bits) of a `model.weight_dtype` (a config
    not pinned yet: float32)."""
    torch, _ = require_hf()
    floats = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    ints = {"bfloat16": torch.int16, "float16": torch.int16, "float32": torch.int32}
    return floats[weight_dtype or "float32"], ints[weight_dtype or "float32"]


def z_tensor(cfg: RunConfig, step: int, target: hf.Target, fitness: np.ndarray, device: Any) -> Any:
    """Z = sum_k F_k A_k B_k^T (float64 (out, in), exact integers) on `device`: equal to
    `shared.hf.z_matrix`."""
    torch, _ = require_hf()
    rows, cols = target.shape
    r = cfg.model.rank
    z = torch.zeros((rows, cols), dtype=torch.float64, device=device)
    active = np.flatnonzero(fitness)
    per = max(1, min(hf.PAIR_BLOCK, FACTOR_ELEMENTS // ((rows + cols) * r)))
    for lo in range(0, len(active), per):
        pairs = active[lo : lo + per]
        ((a, b),) = pair_factors(cfg, step, [target], pairs, device)
        f = torch.from_numpy(fitness[pairs].astype(np.float64)).to(device)
        a, b = a.double() * f[:, None, None], b.double()
        # (out, P*r) @ (P*r, in): the pairs' rank-r factors side by side
        z += a.permute(1, 0, 2).reshape(rows, -1) @ b.permute(1, 0, 2).reshape(cols, -1).T
    return z


def _wrap(v: Any, width: int, dtype: Any) -> Any:
    """Non-negative int64 values below 2**width as the signed integers of the same bits."""
    return (v - ((v >> (width - 1)) << width)).to(dtype)


def update_bits(bits: Any, z: Any, alpha: float, weight_dtype: str, key: int, start: int) -> Any:
    """The update rule on a block of stored bits (int16 or int32, C-contiguous) given its Z
    (float64, same shape); `start`: the flat index of its first element in the target."""
    torch, _ = require_hf()
    floating, _ = state_dtypes(weight_dtype)
    w32 = bits.view(floating).to(torch.float32)  # exact
    alpha32 = torch.tensor(float(np.float32(alpha)), dtype=torch.float32, device=bits.device)
    product = z.to(torch.float32) * alpha32
    s = w32 + product
    b = s.view(torch.int32).to(torch.int64) & _M32
    b = torch.where(torch.isnan(s), torch.full_like(b, hf.CANONICAL_NAN32), b)
    if weight_dtype == "float32":
        new = _wrap(b, 32, torch.int32)
    else:
        k = hf.ROUND_BITS[weight_dtype]
        keys = np.array([key], dtype=np.uint64)
        u = element_bits(keys, start, bits.numel(), bits.device)[0].reshape(bits.shape)
        b = (b + (u & ((1 << k) - 1))) & (_M32 ^ ((1 << k) - 1))
        if weight_dtype == "bfloat16":
            new = _wrap(b >> 16, 16, torch.int16)
        else:
            half = _wrap(b, 32, torch.int32).view(torch.float32).to(torch.float16)
            nan = torch.full_like(bits, hf.CANONICAL_NAN16)
            new = torch.where(torch.isnan(half), nan, half.view(torch.int16))
    return torch.where(z == 0, bits, new)


def apply_update(
    cfg: RunConfig,
    step: int,
    fitness: np.ndarray,
    read: Callable[[hf.Target], Any],
    write: Callable[[hf.Target, Any], None],
) -> int:
    """Step `step`'s update of every target, as `shared.hf.apply_update`: `read(target)`
    gives its bits (int16 or int32, (out, in), C-contiguous, on the device the work runs
    on), `write(target, bits)` takes the new ones (only for a target that changed).
    Returns how many weights changed."""
    fitness = np.asarray(fitness)
    if fitness.shape != (cfg.pairs,):
        raise ValueError(f"fitness has shape {fitness.shape}, expected ({cfg.pairs},)")
    if fitness.dtype != np.int8 or np.any(np.abs(fitness) > 1):
        raise hf.HFError("fitness must be int8 values in {-1, 0, 1}")
    if not np.any(fitness):
        return 0
    alpha, dtype = hf.weight_scale(cfg), cfg.model.weight_dtype
    changed = 0
    for t in hf.targets(cfg.model):
        bits = read(t)
        z = z_tensor(cfg, step, t, fitness, bits.device)
        key, cols = hf.round_key(cfg, step, t), t.shape[1]
        rows = max(1, ROW_ELEMENTS // cols)
        new = bits.clone()
        for lo in range(0, t.shape[0], rows):
            hi = min(lo + rows, t.shape[0])
            new[lo:hi] = update_bits(bits[lo:hi], z[lo:hi], alpha, dtype, key, lo * cols)
        del z
        moved = int((new != bits).sum())
        if moved:
            write(t, new)
        changed += moved
    return changed
