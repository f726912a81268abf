"""Exact integer arithmetic on the CPU through floating point: matrix products through
float32 BLAS and floor division through float64, plus the int8 clip every model uses.

`np.matmul` on integer dtypes skips BLAS (about 100x slower) and `int8 @ int8` wraps
silently. float32 represents every integer up to 2**24 exactly, and BLAS only ever adds
partial sums that are bounded by the full sum of absolute products, so a float32 GEMM of
integer-valued operands is exact while K * max|a| * max|b| <= 2**24.
Beyond that bound the K dimension is split into blocks that each stay within it, and the
blocks are summed in int64.
"""

from __future__ import annotations

import numpy as np

F32_EXACT = 1 << 24


def block_size(max_abs_a: int, max_abs_b: int) -> int:
    """The largest K for which a float32 GEMM of such operands is exact."""
    return max(1, F32_EXACT // max(1, max_abs_a * max_abs_b))


def exact_matmul(a: np.ndarray, b: np.ndarray, max_abs_a: int, max_abs_b: int) -> np.ndarray:
    """a @ b for integer-valued a (M x K) and b (K x N) with |a| <= max_abs_a, |b| <= max_abs_b.

    Returns int32 when the result provably fits, else int64. The bounds are trusted, not
    measured: callers pass the bounds their value ranges guarantee (127 for int8 weights).
    """
    k = a.shape[-1]
    kb = block_size(max_abs_a, max_abs_b)
    out_dtype = np.int32 if k * max_abs_a * max_abs_b < 1 << 31 else np.int64
    a32 = a if a.dtype == np.float32 else a.astype(np.float32)
    b32 = b if b.dtype == np.float32 else b.astype(np.float32)
    if k <= kb:
        return (a32 @ b32).astype(out_dtype)
    total = np.zeros((*a.shape[:-1], b.shape[-1]), dtype=np.int64)
    for lo in range(0, k, kb):
        total += (a32[..., lo : lo + kb] @ b32[lo : lo + kb]).astype(np.int64)
    return total.astype(out_dtype, copy=False)


def floor_div(a: np.ndarray, b: int | np.ndarray) -> np.ndarray:
    """floor(a / b) for int32 a and positive b, exactly, without slow integer division.

    A power-of-two divisor is an arithmetic shift. Otherwise float64 division is correctly
    rounded, and its error (< |a / b| * 2**-53) is smaller than the distance 1/b from a
    non-integer quotient to the next integer while |a| < 2**53, so floor() is exact.
    """
    if isinstance(b, int) and b & (b - 1) == 0:
        return a >> (b.bit_length() - 1)
    return np.floor(a / np.asarray(b, dtype=np.float64)).astype(np.int32)


def clip8(x: np.ndarray) -> np.ndarray:
    """Clip in place to the int8 range [-127, 127] (never -128: negation stays in range)."""
    return np.clip(x, -127, 127, out=x)


def frozen(values: list[int] | np.ndarray, dtype: type = np.int64) -> np.ndarray:
    """A cached table as a read-only array, so that no caller can change it for the others."""
    table = np.array(values, dtype=dtype)
    table.flags.writeable = False
    return table
