"""worker/torch_noise.py: the counter-based noise made by PyTorch equals `shared.noise`'s bit
for bit (on the CPU here; the GPU runs the same integer operations)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from eggroll_dist.shared import noise  # noqa: E402
from eggroll_dist.worker import torch_noise as tn  # noqa: E402

KEYS = np.array(
    [
        0,
        1,
        0xFFFFFFFF,
        1 << 32,
        (1 << 64) - 1,
        noise.hash_key(noise.DOMAIN_NOISE, 7, 3),
        noise.hash_key(noise.DOMAIN_ROUND, 0, 0, 12345),
    ],
    dtype=np.uint64,
)


@pytest.mark.parametrize(
    ("start", "count"),
    [(0, 1), (0, 1000), (12345, 77), ((1 << 31) - 3, 9), ((1 << 32) - 5, 11)],
)
def test_element_bits_equal_numpys(start: int, count: int) -> None:
    want = noise.element_bits(KEYS, start, count)
    got = tn.element_bits(KEYS, start, count, "cpu")
    assert got.dtype == torch.int64 and got.shape == (len(KEYS), count)
    assert int(got.min()) >= 0 and int(got.max()) < 1 << 32  # uint32 values
    assert np.array_equal(got.numpy().astype(np.uint32), want)


@pytest.mark.parametrize("kind", noise.NOISE_KINDS)
def test_values_equal_numpys(kind: str) -> None:
    for start in (0, 999, (1 << 32) - 100):
        bits = noise.element_bits(KEYS, start, 300)
        want = noise.bits_to_values(bits, kind)
        got = tn.noise_values(tn.element_bits(KEYS, start, 300, "cpu"), kind)
        assert got.dtype == torch.int8
        assert np.array_equal(got.numpy(), want)
    # the pair noise the members see, as shared.noise.noise_block makes it
    pairs = np.arange(5, dtype=np.uint64)
    keys = noise.noise_keys(7, 3, pairs, 42)
    got = tn.noise_values(tn.element_bits(keys, 0, 64, "cpu"), kind).numpy()
    assert np.array_equal(got, noise.noise_block(7, 3, pairs, 42, 0, 64, kind))


def test_an_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown noise kind"):
        tn.noise_values(tn.element_bits(KEYS, 0, 4, "cpu"), "cauchy")
