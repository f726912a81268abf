"""Ternary fitness packing: five values in {-1, 0, +1} per byte.

Trit mapping 0->0, +1->1, -1->2; byte = t0 + 3 t1 + 9 t2 + 27 t3 + 81 t4, so valid bytes
are 0..242. A remainder of count % 5 values goes into a short last byte whose missing
high digits are 0. Exactly one byte string encodes each value sequence, so duplicate
results compare byte-identical.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from .errors import TernaryError

__all__ = [
    "MAX_PACKED_BYTE",
    "TernaryError",
    "check_packed",
    "check_packed_rows",
    "pack_ternary",
    "packed_size",
    "unpack_ternary",
]

MAX_PACKED_BYTE = 242  # 3**5 - 1

# _DIGITS[b] holds the five values (as int8 -1/0/+1) encoded by byte b, lowest digit first.
_DIGITS = np.array([[(code // 3**i) % 3 for i in range(5)] for code in range(3**5)], dtype=np.int8)
_DIGITS[_DIGITS == 2] = -1
_DIGITS.setflags(write=False)


def packed_size(count: int) -> int:
    """Bytes needed for `count` values: ceil(count / 5)."""
    if count < 0:
        raise TernaryError(f"count must be >= 0, got {count}")
    return -(-count // 5)


def pack_ternary(values: npt.ArrayLike) -> bytes:
    """Pack a 1-D sequence of -1/0/+1 integers into canonical ternary bytes."""
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise TernaryError(f"expected a 1-D sequence, got shape {arr.shape}")
    count = arr.shape[0]
    if count == 0:
        return b""
    if arr.dtype.kind not in "iub":
        raise TernaryError(f"expected integers, got dtype {arr.dtype}")
    if arr.dtype != np.int8:
        if arr.min() < -1 or arr.max() > 1:
            raise TernaryError("values must be in {-1, 0, 1}")
        arr = arr.astype(np.int8)
    elif arr.min() < -1 or arr.max() > 1:
        raise TernaryError("values must be in {-1, 0, 1}")
    rows = packed_size(count)
    trits = np.zeros(rows * 5, dtype=np.uint8)
    # As uint8, -1 is 255; min(., 2) maps it to trit 2 and leaves 0 and 1 alone.
    np.minimum(arr.view(np.uint8), 2, out=trits[:count])
    t = trits.reshape(rows, 5).T
    # Horner's rule in uint8: the largest intermediate is 242, so nothing wraps.
    out = t[4] * np.uint8(3)
    out += t[3]
    out *= 3
    out += t[2]
    out *= 3
    out += t[1]
    out *= 3
    out += t[0]
    return out.tobytes()


def check_packed(data: bytes, count: int) -> None:
    """Raise TernaryError unless `data` is the canonical packing of `count` values."""
    expected = packed_size(count)
    if len(data) != expected:
        raise TernaryError(f"{count} values need {expected} bytes, got {len(data)}")
    if expected == 0:
        return
    raw = np.frombuffer(data, dtype=np.uint8)
    if int(raw.max()) > MAX_PACKED_BYTE:
        raise TernaryError(f"byte above {MAX_PACKED_BYTE} in ternary data")
    _check_last_byte(int(raw[-1]), count)


def check_packed_rows(data: bytes, rows: int, count: int) -> None:
    """Like `check_packed` for `rows` packings of `count` values each, concatenated."""
    size = packed_size(count)
    if rows < 0:
        raise TernaryError(f"rows must be >= 0, got {rows}")
    if len(data) != rows * size:
        raise TernaryError(f"{rows} x {count} values need {rows * size} bytes, got {len(data)}")
    if rows == 0 or size == 0:
        return
    raw = np.frombuffer(data, dtype=np.uint8).reshape(rows, size)
    if int(raw.max()) > MAX_PACKED_BYTE:
        raise TernaryError(f"byte above {MAX_PACKED_BYTE} in ternary data")
    _check_last_byte(int(raw[:, -1].max()), count)


def unpack_ternary(data: bytes, count: int) -> npt.NDArray[np.int8]:
    """Unpack `count` values (int8 array of -1/0/+1) from canonical ternary bytes."""
    check_packed(data, count)
    raw = np.frombuffer(data, dtype=np.uint8)
    return np.take(_DIGITS, raw, axis=0).reshape(-1)[:count]


def _check_last_byte(last: int, count: int) -> None:
    used = count % 5
    if used and last >= 3**used:
        raise TernaryError(f"last byte {last} sets digits beyond the {used} value(s) it holds")
