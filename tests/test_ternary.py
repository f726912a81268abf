"""Ternary fitness packing: five trits per byte, canonical encoding."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eggroll_dist.protocol.ternary import (
    TernaryError,
    check_packed,
    check_packed_rows,
    pack_ternary,
    packed_size,
    unpack_ternary,
)

trit_lists = st.lists(st.sampled_from([-1, 0, 1]), max_size=64)


def test_reference_example() -> None:
    assert pack_ternary([1, -1, 0, 1, 1, 0, 0, 1]) == bytes([115, 9])
    assert unpack_ternary(bytes([115, 9]), 8).tolist() == [1, -1, 0, 1, 1, 0, 0, 1]


def test_digit_mapping() -> None:
    assert pack_ternary([0, 0, 0, 0, 0]) == bytes([0])
    assert pack_ternary([1, 0, 0, 0, 0]) == bytes([1])
    assert pack_ternary([-1, 0, 0, 0, 0]) == bytes([2])
    assert pack_ternary([0, 0, 0, 0, 1]) == bytes([81])
    assert pack_ternary([-1, -1, -1, -1, -1]) == bytes([242])


def test_all_243_codes_round_trip() -> None:
    for code in range(243):
        values = unpack_ternary(bytes([code]), 5)
        assert values.dtype == np.int8
        assert pack_ternary(values) == bytes([code])
    data = bytes(range(243))
    assert pack_ternary(unpack_ternary(data, 243 * 5)) == data


@pytest.mark.parametrize("code", range(243, 256))
def test_bytes_above_242_rejected(code: int) -> None:
    with pytest.raises(TernaryError):
        unpack_ternary(bytes([0, code, 0]), 15)
    with pytest.raises(TernaryError):
        check_packed(bytes([code]), 5)


@pytest.mark.parametrize("count", [*range(0, 31), 163_840, 163_841, 163_844])
def test_random_arrays_round_trip(count: int) -> None:
    rng = np.random.default_rng(count)
    values = rng.integers(-1, 2, size=count, dtype=np.int8)
    data = pack_ternary(values)
    assert len(data) == packed_size(count)
    check_packed(data, count)
    out = unpack_ternary(data, count)
    assert out.dtype == np.int8
    np.testing.assert_array_equal(out, values)
    # Any integer dtype and plain lists give the same bytes.
    assert pack_ternary(values.astype(np.int64)) == data
    assert pack_ternary(values.astype(np.int16).tolist()) == data


@settings(max_examples=100, deadline=None)
@given(values=trit_lists)
def test_round_trip_property(values: list[int]) -> None:
    data = pack_ternary(values)
    assert len(data) == packed_size(len(values))
    assert max(data, default=0) <= 242
    assert unpack_ternary(data, len(values)).tolist() == values


@pytest.mark.parametrize("remainder", [1, 2, 3, 4])
def test_short_last_byte_must_be_canonical(remainder: int) -> None:
    count = 5 + remainder
    for last in range(243):
        data = bytes([17, last])
        if last < 3**remainder:
            check_packed(data, count)
            assert pack_ternary(unpack_ternary(data, count)) == data
        else:
            with pytest.raises(TernaryError):
                unpack_ternary(data, count)


def test_count_six_rejects_last_byte_three() -> None:
    with pytest.raises(TernaryError):
        unpack_ternary(bytes([0, 3]), 6)


@pytest.mark.parametrize(("size", "count"), [(0, 1), (1, 0), (2, 5), (1, 6), (3, 10)])
def test_wrong_byte_count_rejected(size: int, count: int) -> None:
    with pytest.raises(TernaryError):
        unpack_ternary(bytes(size), count)


@pytest.mark.parametrize(
    "values", [[2], [0, -2], [1, 0, 127], np.array([0.0, 1.0]), [[1, 0], [0, 1]], ["a"]]
)
def test_invalid_values_rejected(values: object) -> None:
    with pytest.raises(TernaryError):
        pack_ternary(values)  # type: ignore[arg-type]


def test_invalid_int8_values_rejected() -> None:
    with pytest.raises(TernaryError):
        pack_ternary(np.array([0, 1, -128], dtype=np.int8))
    with pytest.raises(TernaryError):
        pack_ternary(np.array([0, 255], dtype=np.uint8))


def test_errors_are_value_errors() -> None:
    assert issubclass(TernaryError, ValueError)


def test_packed_size() -> None:
    assert [packed_size(n) for n in range(12)] == [0, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 3]
    assert packed_size(163_840) == 32_768
    with pytest.raises(TernaryError):
        packed_size(-1)


def test_empty() -> None:
    assert pack_ternary([]) == b""
    assert unpack_ternary(b"", 0).shape == (0,)


def test_check_packed_rows() -> None:
    rows = [pack_ternary([1, -1, 0, 1, 1, 0, 1]), pack_ternary([0, 0, 0, 0, 0, -1, -1])]
    check_packed_rows(b"".join(rows), 2, 7)
    check_packed_rows(b"", 0, 7)
    with pytest.raises(TernaryError):
        check_packed_rows(b"".join(rows) + b"\x00", 2, 7)
    with pytest.raises(TernaryError):
        check_packed_rows(rows[0] + bytes([0, 9]), 2, 7)  # non-canonical last row
    with pytest.raises(TernaryError):
        check_packed_rows(bytes([0, 9]) + rows[1], 2, 7)  # non-canonical first row
    with pytest.raises(TernaryError):
        check_packed_rows(bytes([250, 0]) + rows[1], 2, 7)
