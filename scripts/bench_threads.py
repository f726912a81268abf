"""Benchmark the NumPy backend's BLAS pool size: one chunk (`tiny` preset by default)
evaluated with one thread, with the default (usable cores / workers on the host) and with
a pool as large as the host (what every process had before the backend sized its pool),
by one worker alone and by several workers at once on this host; then one step's chunks in
one process (eggroll-train), one after the other or side by side (`evaluate_chunks`).

    python scripts/bench_threads.py [--preset tiny] [--workers 2] [--repeats 3] [--members 512]

Prints seconds per chunk (best of the repeats, the slowest worker's when several run) and
each setting's ratio to one thread measured in the same run, with the load average before
and after: on a shared machine the numbers move with it.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time

import numpy as np

from eggroll_dist.shared.config import preset
from eggroll_dist.shared.data import DataMeta, Dataset, token_dtype
from eggroll_dist.shared.replica import ReplicaState
from eggroll_dist.worker.backend.numpy_backend import NumpyBackend, default_threads


def synthetic_dataset(vocab: int, tokens: int = 1 << 20) -> Dataset:
    rng = np.random.default_rng(0)
    dtype = token_dtype(vocab)
    train = rng.integers(1, vocab, size=tokens).astype(dtype)
    valid = rng.integers(1, vocab, size=4096).astype(dtype)
    meta = DataMeta(1, vocab, len(train), len(valid), "0" * 64, "bench", 1, 1, {})
    pieces = [i.to_bytes(2, "big") if vocab > 256 else bytes([i]) for i in range(vocab)]
    return Dataset(train, valid, pieces, meta, bytes(32))


def chunk_seconds(
    name: str, threads: int, members: int, repeats: int, start: mp.Barrier | None
) -> float:
    """Best time of one chunk of `members` members of preset `name` at step 0."""
    cfg = preset(name)
    backend = NumpyBackend(synthetic_dataset(cfg.model.vocab_size), ReplicaState.initial(cfg))
    backend.threads = threads
    backend.evaluate_chunk(0, 0, members)  # warm-up: caches, pool start
    if start is not None:
        start.wait()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        backend.evaluate_chunk(0, 0, members)
        best = min(best, time.perf_counter() - t)
    return best


def step_chunks_seconds(name: str, threads: int, repeats: int, side_by_side: bool) -> float:
    """Best time of all chunks of one step of preset `name` in one process with `threads`
    threads: one after the other (BLAS threads inside each chunk), or side by side
    (`evaluate_chunks`: a thread per chunk, one BLAS thread each)."""
    cfg = preset(name)
    backend = NumpyBackend(synthetic_dataset(cfg.model.vocab_size), ReplicaState.initial(cfg))
    backend.threads = threads
    size = cfg.es.chunk_size
    chunks = [(c * size, size) for c in range(cfg.chunks)]

    def run() -> None:
        if side_by_side:
            backend.evaluate_chunks(0, chunks)
        else:
            for first, count in chunks:
                backend.evaluate_chunk(0, first, count)

    run()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t)
    return best


def _worker(args: tuple[str, int, int, int, mp.Barrier]) -> float:
    return chunk_seconds(*args)


def concurrent_seconds(name: str, workers: int, threads: int, members: int, repeats: int) -> float:
    """The slowest of `workers` processes evaluating chunks at the same time."""
    ctx = mp.get_context("spawn")
    start = ctx.Manager().Barrier(workers)
    with ctx.Pool(workers) as pool:
        return max(pool.map(_worker, [(name, threads, members, repeats, start)] * workers))


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--members", type=int, default=512)
    args = ap.parse_args()
    host = os.cpu_count() or 1
    os.environ.pop("EGGROLL_WORKERS_PER_HOST", None)
    alone = default_threads()
    os.environ["EGGROLL_WORKERS_PER_HOST"] = str(args.workers)
    shared = default_threads()
    print(f"load average before: {load()}   (cores: {host})")
    print(f"{args.preset} preset, one chunk of {args.members} members, best of {args.repeats}")

    rows = []
    one = chunk_seconds(args.preset, 1, args.members, args.repeats, None)
    rows.append(("1 worker, 1 thread", one, one))
    rows.append(
        (
            f"1 worker, default ({alone} threads)",
            chunk_seconds(args.preset, alone, args.members, args.repeats, None),
            one,
        )
    )
    many = concurrent_seconds(args.preset, args.workers, 1, args.members, args.repeats)
    rows.append((f"{args.workers} workers, 1 thread each", many, many))
    if shared != 1:
        rows.append(
            (
                f"{args.workers} workers, default ({shared} threads each)",
                concurrent_seconds(args.preset, args.workers, shared, args.members, args.repeats),
                many,
            )
        )
    rows.append(
        (
            f"{args.workers} workers, host-sized pool ({host} threads each, before)",
            concurrent_seconds(args.preset, args.workers, host, args.members, args.repeats),
            many,
        )
    )
    for name, seconds, reference in rows:
        print(f"{name:<52} {seconds:8.3f} s/chunk   ratio to 1 thread {seconds / reference:5.2f}")

    # One process, one step (what eggroll-train does): chunks in turn or side by side.
    chunks = preset(args.preset).chunks
    print(f"one process, the {chunks} chunks of one step, {alone} threads, best of {args.repeats}")
    turn = step_chunks_seconds(args.preset, alone, args.repeats, side_by_side=False)
    side = step_chunks_seconds(args.preset, alone, args.repeats, side_by_side=True)
    print(f"{'one after the other (BLAS threads in each chunk)':<52} {turn:8.3f} s/step")
    print(
        f"{'side by side (a thread per chunk, 1 BLAS thread)':<52} {side:8.3f} s/step"
        f"   speed-up {turn / side:5.2f}"
    )
    print(f"load average after:  {load()}")


if __name__ == "__main__":
    main()
