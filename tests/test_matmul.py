"""Exact integer GEMM through float32 BLAS, at and beyond the 2**24 bound."""

from __future__ import annotations

import numpy as np

from eggroll_dist.shared.matmul import F32_EXACT, block_size, exact_matmul


def _int64_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return a.astype(np.int64) @ b.astype(np.int64)


def test_exact_at_the_bound() -> None:
    k = F32_EXACT // (127 * 127)  # 1040: K * 127 * 127 <= 2**24
    assert block_size(127, 127) == k
    a = np.full((3, k), 127, dtype=np.int8)
    b = np.full((k, 2), -127, dtype=np.int8)
    b[::7] = 127
    got = exact_matmul(a, b, 127, 127)
    assert got.dtype == np.int32
    assert np.array_equal(got, _int64_matmul(a, b))


def test_exact_beyond_the_bound_where_plain_float32_is_wrong() -> None:
    k = 2049  # K * 127 * 127 = 33,048,321: odd and > 2**24, not representable in float32
    a = np.full((2, k), 127, dtype=np.int8)
    b = np.full((k, 3), 127, dtype=np.int8)
    want = _int64_matmul(a, b)
    naive = (a.astype(np.float32) @ b.astype(np.float32)).astype(np.int64)
    assert not np.array_equal(naive, want)  # why the guard exists
    assert np.array_equal(exact_matmul(a, b, 127, 127), want)


def test_random_large_operands_and_int64_results() -> None:
    rng = np.random.default_rng(0)
    a = rng.integers(-3025, 3026, size=(5, 300_000), dtype=np.int32)
    b = rng.integers(-55, 56, size=(300_000, 4), dtype=np.int32)
    got = exact_matmul(a, b, 3025, 55)
    assert got.dtype == np.int64  # 300k * 3025 * 55 > 2**31
    assert np.array_equal(got, _int64_matmul(a, b))


def test_float32_inputs_are_used_as_is() -> None:
    rng = np.random.default_rng(1)
    a = rng.integers(-127, 128, size=(64, 256)).astype(np.float32)
    b = rng.integers(-127, 128, size=(256, 32)).astype(np.float32)
    assert np.array_equal(exact_matmul(a, b, 127, 127), _int64_matmul(a, b))
