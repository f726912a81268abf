"""A reward run's generation on the CuPy backend (`CupyBackend.complete`): the tokens of
`NumpyBackend.complete`, written on the device.

Rows are those of the NumPy backend: (pair, prompt, sign) for members, each (pair, prompt)
an entry of the noise kernels' pair list, so row 2 q + s is entry q's member of sign s; the
unperturbed model's rows are its prompts, two to a pair of zero noise and the weights'
vectors (both members of such a pair are the model itself). A pass feeds token 0 and the
prompts column by column, then chooses each new token with `sample_tokens` (generate.cu,
`shared.sample.next_tokens` in integers) and reads it back in: the EGG model's token step
(`cupy_egg.read_step`, the state carried in device buffers) or the former's
(`cupy_former.reader`: one position against each layer's key-value cache until the window
slides, the window whole after). Only the chosen tokens come back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ...shared.noise import DOMAIN_SAMPLE, hash_key
from ...shared.sample import Completions, SampleSettings, exp_table
from . import cupy_egg, cupy_former
from .cupy_kernels import BLOCK

if TYPE_CHECKING:
    from collections.abc import Callable

    from .cupy_backend import CupyBackend

GEN_THREADS = 256  # generate.cu GEN_THREADS: a sampling block


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def complete(
    backend: CupyBackend, step: int, members: tuple[int, int] | None, request: Completions
) -> np.ndarray:
    """Tokens (count, P, N) that members [first, first + count) write for the request's P
    prompts (members None: the unperturbed model, (1, P, N)), as NumpyBackend.complete."""
    n = request.new_tokens
    count = 1 if members is None else members[1]
    out = np.zeros((count, len(request.prompts), n), dtype=np.int64)
    with backend._scope():
        if members is not None:
            backend._put_step_key(step)  # the noise kernels' key(NOISE, run_seed, step)
        for idx, prompts, samples in request.groups():
            g = len(idx)
            if members is None:
                tokens = _generate(backend, None, prompts, samples, request)
                out[0, idx] = tokens[:g]
                continue
            first, count = members
            batch = max(2, _rows(backend) // g // 2 * 2)
            for lo in range(first, first + count, batch):
                hi = min(lo + batch, first + count)
                pairs = np.arange(lo // 2, hi // 2)
                rows = np.tile(np.repeat(prompts, 2, axis=0), (len(pairs), 1))
                row_samples = np.tile(np.repeat(samples, 2), len(pairs))
                tokens = _generate(backend, np.repeat(pairs, g), rows, row_samples, request)
                tokens = tokens.reshape(len(pairs), g, 2, n).transpose(0, 2, 1, 3)
                out[lo - first : hi - first, idx] = tokens.reshape(hi - lo, g, n)
    return out


def _generate(
    backend: CupyBackend,
    entries: np.ndarray | None,
    prompts: np.ndarray,
    samples: np.ndarray,
    request: Completions,
) -> np.ndarray:
    """(M, N) tokens of rows reading prompts (M, L): entries (M / 2,) the pair of each row
    pair (None: the unperturbed model, rows padded to whole pairs)."""
    xp, k, cfg = backend.xp, backend.kernels, backend.config
    rows, length = prompts.shape
    n_pairs = _cdiv(rows, 2) if entries is None else len(entries)
    m, v, n = 2 * n_pairs, cfg.model.vocab_size, request.new_tokens
    pad = m - rows
    reads = 1 + length + max(n - 1, 0)  # token 0, the prompt, every new token but the last
    bufs, read = _reader(backend, n_pairs, reads, entries is None)
    if entries is None:
        for name, vector in bufs["vec"].items():
            vector[...] = backend.w[name]  # every row's vector is the weights' own
    else:
        bufs["pairs"][...] = xp.asarray(entries.astype(np.int64))
        backend.noise(bufs["pairs"], n_pairs, bufs["a"], bufs["b"], bufs["vec"])
    host_prompts = np.zeros((m, max(length, 1)), dtype=np.int32)
    host_prompts[:rows, :length] = prompts
    dev = {
        "prompts": xp.asarray(host_prompts),
        "samples": xp.asarray(np.pad(np.asarray(samples, dtype=np.int64), (0, pad))),
        "settings": xp.asarray(_settings(request.settings)),
        "exp": xp.asarray(exp_table()),
        "counts": xp.zeros((m, v), dtype=xp.int32),
        "out": xp.zeros((m, max(n, 1)), dtype=xp.int32),
    }
    read()  # token 0: a document starts
    i32 = np.int32
    for t in range(length):
        k(
            "gen_feed",
            (_cdiv(m, BLOCK),),
            (BLOCK,),
            *(dev["prompts"], i32(host_prompts.shape[1]), i32(t), i32(m), i32(v)),
            *(dev["counts"], bufs["cur"]),
        )
        read()
    key = np.uint64(hash_key(DOMAIN_SAMPLE, request.seed))
    for position in range(n):
        k(
            "sample_tokens",
            (m,),
            (GEN_THREADS,),
            *(bufs["logits"], i32(v), dev["settings"], key, dev["samples"], i32(position)),
            *(dev["exp"], dev["counts"], bufs["cur"], dev["out"], i32(dev["out"].shape[1])),
        )
        if position + 1 < n:
            read()
    return _host(xp, dev["out"])[:rows, :n].astype(np.int64)  # the pass's one copy back


def _rows(backend: CupyBackend) -> int:
    """Rows per generation pass: the forward's batch, the former's also within its bound
    (its key-value caches and window)."""
    if backend.config.model.arch == "egg":
        return backend.batch_members
    return min(backend.batch_members, cupy_former.generation_rows(backend.config))


def _reader(
    backend: CupyBackend, n_pairs: int, reads: int, zero: bool
) -> tuple[dict[str, Any], Callable[[], None]]:
    """The architecture's buffers for 2 n_pairs rows (bufs["cur"] zero: token 0) and its
    token step, which reads bufs["cur"] and writes bufs["logits"]; zero: no noise."""
    if backend.config.model.arch != "egg":
        return cupy_former.reader(backend, n_pairs, reads, zero)
    bufs = cupy_egg.buffers(backend, n_pairs, steps=1, held_out=zero)
    bufs["cur"] = backend.xp.zeros(2 * n_pairs, dtype=backend.xp.int32)
    backend.zero(bufs["states"])
    return bufs, backend.kernels.capture(lambda: cupy_egg.read_step(backend, bufs))


def _host(xp: object, a: object) -> np.ndarray:
    """A device array's host copy (cupy_backend._host: that module imports this one)."""
    return xp.asnumpy(a) if hasattr(xp, "asnumpy") else np.array(a, copy=True)  # type: ignore[attr-defined]


def _settings(s: SampleSettings) -> np.ndarray:
    """The settings as sample_tokens reads them: temperature, min-p, top-k, penalties."""
    values = (s.temperature, s.min_p, s.top_k, s.presence_penalty, s.frequency_penalty)
    return np.array(values, dtype=np.int64)
