"""The host's cost of the CuPy backend's launch path, measured without a GPU.

The kernels are replaced by no-op functions (NumPy arrays stand in for device arrays), so
what is timed is the Python side alone: the argument checks and launches of a forward
pass's first run, which captures them, and of later runs, which upload the pairs and
windows and replay the capture (on a GPU one graph launch; here a loop over the recorded
no-ops, an upper bound). Before graphs, every pass paid the first run's cost.

    python scripts/bench_launch.py [--layers 6] [--width 256] [--members 1024] [--repeats 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from eggroll_dist.shared.config import ESConfig, ModelConfig, RunConfig
from eggroll_dist.shared.replica import ReplicaState
from eggroll_dist.worker.backend.cupy_backend import CupyBackend
from eggroll_dist.worker.backend.cupy_egg import launches as forward_launches


class NoOpModule:
    """A module whose every kernel does nothing: the launch path without the device."""

    def get_function(self, name: str):
        return lambda grid, block, args: None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--members", type=int, default=1024, help="members per forward pass")
    parser.add_argument("--seq-len", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_gpu import synthetic_dataset

    cfg = RunConfig(
        model=ModelConfig(n_layer=args.layers, d_model=args.width, vocab_size=256),
        es=ESConfig(population=args.members, chunk_size=args.members, seq_len=args.seq_len),
    )
    backend = CupyBackend(
        synthetic_dataset(256, 1 << 20),
        ReplicaState.initial(cfg),
        xp=np,
        module_factory=lambda source, names: NoOpModule(),
        batch_members=args.members,
    )
    chunk = [(0, args.members)]
    steps = args.seq_len
    launches = forward_launches(args.layers)
    t = time.perf_counter()
    backend.evaluate_chunks(0, chunk)  # captures: every launch checked once
    first = time.perf_counter() - t
    later = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        backend.evaluate_chunks(0, chunk)
        later.append(time.perf_counter() - t)
    print(
        f"{args.layers} layers, width {args.width}, {args.members} members, T = {steps}: "
        f"{launches} kernels a token step"
    )
    print(
        f"checked launches (every pass before graphs): {1e3 * first:8.2f} ms a pass, "
        f"{1e6 * first / steps:7.1f} us a token step, "
        f"{1e6 * first / (steps * launches):5.2f} us a launch"
    )
    best = min(later)
    print(
        f"captured (later passes, uploads + replay of no-ops): {1e3 * best:8.2f} ms a pass, "
        f"{1e6 * best / steps:7.1f} us a token step ({first / best:.1f}x less host time)"
    )


if __name__ == "__main__":
    main()
