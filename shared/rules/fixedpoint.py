"""Fixed-point arithmetic for update rules: values in units of 2**-16, every operation an
exact integer one, so that every backend computes the same bits.

A config's float becomes an integer once, exactly: `fixed16(x)` = round(x * 2**16) (Python's
round of a float, half to even). `sshift` shifts toward zero, so a rule built from it is odd
in its inputs (flipping every fitness sign mirrors the whole state exactly). `isqrt_array`
is floor(sqrt(v)) exactly.
"""

from __future__ import annotations

import numpy as np

ONE = 1 << 16  # fixed-point 1.0


def fixed16(x: float) -> int:
    """A config float as an integer in units of 2**-16: round half to even, exact."""
    return round(x * ONE)


def sshift(x: np.ndarray, shift: int) -> np.ndarray:
    """sign(x) * (|x| >> shift): a shift that rounds toward zero, odd in x."""
    return np.sign(x) * (np.abs(x) >> shift)


def isqrt_array(v: np.ndarray) -> np.ndarray:
    """floor(sqrt(v)) for int64 0 <= v < 2**52, exactly: float64 holds v exactly and its
    correctly rounded sqrt is off the floor by at most one, which the two checks fix."""
    s = np.sqrt(v.astype(np.float64)).astype(np.int64)
    s -= s * s > v
    s += (s + 1) * (s + 1) <= v
    return s
