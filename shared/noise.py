"""Counter-based noise: every random-looking number a replica depends on comes from here.

Bit-level specification (ported as-is to CUDA; pinned by golden vectors in the tests).
All key arithmetic is on unsigned 64-bit integers modulo 2**64, all element arithmetic
on unsigned 32-bit integers modulo 2**32.

    mix64(z):   z ^= z >> 30; z *= 0xBF58476D1CE4E5B9
                z ^= z >> 27; z *= 0x94D049BB133111EB
                z ^= z >> 31                          (the splitmix64 finaliser)
    combine(h, v) = mix64(h ^ mix64(v + 0x9E3779B97F4A7C15))
    key(domain, w1, ..., wn) = combine(...combine(combine(domain, w1), w2)..., wn)

    fmix32(x):  x ^= x >> 16; x *= 0x85EBCA6B
                x ^= x >> 13; x *= 0xC2B2AE35
                x ^= x >> 16                          (the MurmurHash3 finaliser)
    bits(key, index) = fmix32(lo32(key) ^ fmix32(index ^ hi32(key)))

Keys are hash-combined, never added: d-eggs derived seeds as `seed + pair + offset`, which
made member p's layer-1 noise equal member p+1000's layer-0 noise. With `combine`, two
different words give unrelated keys. Both halves of the 64-bit key enter every element,
so two keys that share their low 32 bits still give unrelated vectors.

Noise for a pair's tensor: `noise(run_seed, step, pair, tensor_id, index)` =
`value(bits(key(NOISE, run_seed, step, pair, tensor_id), index))` where `value` is

    uniform (default, d-eggs):  m = (h >> 1) & 15;  value = +m if h & 1 else -m
                                in [-15, 15]; P(0) = 1/16; E[v^2] = 155/2
    gaussian:                   d = byte0(h) + byte1(h) + byte2(h) + byte3(h) - 510
                                value = sign(d) * ((|d| * 7) >> 6)
                                in [-55, 55]; an Irwin-Hall(4) bell, std ~16

Initial weights use the gaussian values of `key(INIT, init_seed, tensor_id)` at the
tensor's flat index; data windows use `key(DATA, data_seed, step, pair)`; text sampling
draws the 64-bit `key(SAMPLE, seed, sample, position)` per generated token.
"""

from __future__ import annotations

from fractions import Fraction
from functools import cache

import numpy as np

MASK64 = (1 << 64) - 1
GOLDEN64 = 0x9E3779B97F4A7C15

# Domain tags keep the uses of the hash apart (ASCII of the name).
DOMAIN_NOISE = 0x6E6F697365  # "noise"
DOMAIN_INIT = 0x696E6974  # "init"
DOMAIN_DATA = 0x64617461  # "data"
DOMAIN_SAMPLE = 0x73616D706C65  # "sample"
DOMAIN_PROMPT = 0x70726F6D7074  # "prompt": which prompts a step continues, and their seed
DOMAIN_ROUND = 0x726F756E64  # "round": the hf family's stochastic rounding (shared/hf.py)

NOISE_KINDS = ("uniform", "gaussian")

_U64 = np.uint64
_U32 = np.uint32


def mix64(z: int) -> int:
    """splitmix64 finaliser on a Python int (mod 2**64)."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def combine(h: int, v: int) -> int:
    """Hash-combine a 64-bit word into a 64-bit key."""
    return mix64((h & MASK64) ^ mix64(v + GOLDEN64))


def hash_key(domain: int, *words: int) -> int:
    """`combine` folded over the words, starting from the domain tag."""
    h = domain
    for w in words:
        h = combine(h, w)
    return h


def _mix64_array(z: np.ndarray) -> np.ndarray:
    z = z ^ (z >> _U64(30))
    z = z * _U64(0xBF58476D1CE4E5B9)
    z = z ^ (z >> _U64(27))
    z = z * _U64(0x94D049BB133111EB)
    return z ^ (z >> _U64(31))


def combine_array(h: int | np.ndarray, v: np.ndarray) -> np.ndarray:
    """`combine` elementwise over uint64 arrays (numpy wraps uint64 multiplies mod 2**64)."""
    with np.errstate(over="ignore"):
        v64 = np.asarray(v, dtype=_U64) + _U64(GOLDEN64)
        return _mix64_array(np.asarray(h, dtype=_U64) ^ _mix64_array(v64))


def fmix32(x: np.ndarray) -> np.ndarray:
    """MurmurHash3 finaliser on a uint32 array."""
    x = x ^ (x >> _U32(16))
    x = x * _U32(0x85EBCA6B)
    x = x ^ (x >> _U32(13))
    x = x * _U32(0xC2B2AE35)
    return x ^ (x >> _U32(16))


def element_bits(keys: np.ndarray, start: int, count: int) -> np.ndarray:
    """bits(key, index) for each key (rows) and index in [start, start + count) (columns)."""
    keys = np.asarray(keys, dtype=_U64).reshape(-1, 1)
    lo = (keys & _U64(0xFFFFFFFF)).astype(_U32)
    hi = (keys >> _U64(32)).astype(_U32)
    index = np.arange(start, start + count, dtype=_U32).reshape(1, -1)
    return fmix32(lo ^ fmix32(index ^ hi))


def bits_to_values(h: np.ndarray, kind: str) -> np.ndarray:
    """Map 32-bit hashes to int8 noise values of the given distribution."""
    if kind == "uniform":
        m = ((h >> _U32(1)) & _U32(15)).astype(np.int8)
        return np.where((h & _U32(1)).astype(bool), m, -m)
    if kind == "gaussian":
        b = h.view(np.uint8).reshape(*h.shape, 4).astype(np.int16)
        d = b.sum(axis=-1, dtype=np.int16) - np.int16(510)
        mag = ((np.abs(d).astype(np.int32) * 7) >> 6).astype(np.int8)
        return np.where(d < 0, -mag, mag)
    raise ValueError(f"unknown noise kind {kind!r} (expected one of {NOISE_KINDS})")


def noise_keys(run_seed: int, step: int, pairs: np.ndarray, tensor_id: int) -> np.ndarray:
    """key(NOISE, run_seed, step, pair, tensor_id) for an array of pair indices."""
    base = hash_key(DOMAIN_NOISE, run_seed, step)
    return combine_array(combine_array(base, pairs), np.full(len(pairs), tensor_id, _U64))


def noise_block(
    run_seed: int, step: int, pairs: np.ndarray, tensor_id: int, start: int, count: int, kind: str
) -> np.ndarray:
    """int8 noise, shape (len(pairs), count): indices [start, start + count) of each pair."""
    keys = noise_keys(run_seed, step, np.asarray(pairs, dtype=_U64), tensor_id)
    return bits_to_values(element_bits(keys, start, count), kind)


def noise(
    run_seed: int, step: int, pair: int, tensor_id: int, index: int, kind: str = "uniform"
) -> int:
    """One noise value: the scalar form of the specification (for tests and ports)."""
    return int(noise_block(run_seed, step, np.array([pair]), tensor_id, index, 1, kind)[0, 0])


def init_values(init_seed: int, tensor_id: int, size: int) -> np.ndarray:
    """Initial weights of a tensor: gaussian-like int8 values, flat."""
    key = hash_key(DOMAIN_INIT, init_seed, tensor_id)
    return bits_to_values(element_bits(np.array([key], dtype=_U64), 0, size)[0], "gaussian")


def window_offsets(data_seed: int, step: int, pairs: np.ndarray, span: int) -> np.ndarray:
    """Start of each pair's data window: key(DATA, data_seed, step, pair) mod span."""
    base = hash_key(DOMAIN_DATA, data_seed, step)
    keys = combine_array(base, np.asarray(pairs, dtype=_U64))
    return (keys % _U64(span)).astype(np.int64)


@cache
def second_moment(kind: str) -> Fraction:
    """E[v^2] of a noise distribution, exactly (the z-test threshold needs it)."""
    if kind == "uniform":
        return Fraction(sum(m * m for m in range(16)), 16)
    if kind == "gaussian":
        # Distribution of the sum of four independent uniform bytes, by exact convolution.
        counts = np.ones(256, dtype=np.int64)
        for _ in range(3):
            counts = np.convolve(counts, np.ones(256, dtype=np.int64))
        d = np.arange(len(counts)) - 510
        values = (np.abs(d) * 7) >> 6
        return Fraction(int((counts * values * values).sum()), 1 << 32)
    raise ValueError(f"unknown noise kind {kind!r} (expected one of {NOISE_KINDS})")


def max_abs(kind: str) -> int:
    """Largest |value| a noise distribution produces (exact-matmul bounds use it)."""
    return {"uniform": 15, "gaussian": 55}[kind]
