"""Benchmark held-out validation on the NumPy backend: both metrics against the window metric
alone (what validation computed before the stream metric), measured in the same run.

    python scripts/bench_validation.py [--preset tiny] [--data-dir data] [--repeats 5]
                                       [--threads N]

Without --data-dir the held-out split is synthetic (the cost does not depend on the tokens).
Prints the best and median wall seconds of each, the best CPU seconds, and the ratio of the
CPU seconds to those of windows alone.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from eggroll_dist.shared.config import preset
from eggroll_dist.shared.data import DataMeta, Dataset, load_data_dir
from eggroll_dist.shared.replica import ReplicaState
from eggroll_dist.shared.window import validation_streams, validation_windows
from eggroll_dist.worker.backend.numpy_backend import NumpyBackend


def synthetic_dataset(vocab: int, tokens: int) -> Dataset:
    rng = np.random.default_rng(0)
    valid = rng.integers(1, vocab, size=tokens).astype(np.uint8 if vocab <= 256 else np.uint16)
    meta = DataMeta(1, vocab, len(valid), len(valid), "0" * 64, "bench", 1, 1, {})
    return Dataset(valid, valid, [bytes([i % 256]) for i in range(vocab)], meta, bytes(32))


def timings(fn, repeats: int) -> tuple[float, float, float]:
    """Best and median wall seconds, and the best CPU seconds of this process (steadier on a
    machine shared with other work)."""
    fn()  # warm-up
    wall, cpu = [], []
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return min(wall), statistics.median(wall), min(cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--data-dir", type=Path, default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="BLAS threads")
    args = parser.parse_args()
    cfg = preset(args.preset)
    if args.data_dir is not None:
        dataset = load_data_dir(args.data_dir)
    else:
        size = (cfg.validation.max_tokens or 1 << 16) + 1
        dataset = synthetic_dataset(cfg.model.vocab_size, size)
    backend = NumpyBackend(dataset, ReplicaState.initial(cfg), threads=args.threads)
    windows = validation_windows(cfg, dataset.valid)
    lengths = np.full(len(windows), cfg.es.seq_len)
    streams, stream_lengths = validation_streams(cfg, dataset.valid)

    def windows_only() -> None:
        with backend._compute():
            backend._score(windows, lengths, 512)

    def streams_only() -> None:
        with backend._compute():
            backend._score(streams, stream_lengths, 512)

    v = backend.validate()
    print(
        f"{args.preset}: {v.windows.tokens:,} held-out tokens; {len(windows)} windows of "
        f"{cfg.es.seq_len}, {len(streams)} streams of {stream_lengths[0]:,}; "
        f"{backend.threads} BLAS threads"
    )
    ref = timings(windows_only, args.repeats)
    results = {
        "windows (reference)": ref,
        "streams": timings(streams_only, args.repeats),
        "validate (both)": timings(backend.validate, args.repeats),
    }
    for name, (best, median, cpu) in results.items():
        print(
            f"  {name:<20} wall best {best:7.3f} s  median {median:7.3f} s  "
            f"CPU {cpu:7.3f} s  ratio to windows (CPU) {cpu / ref[2]:5.2f}"
        )


if __name__ == "__main__":
    main()
