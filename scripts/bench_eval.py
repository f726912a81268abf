"""Benchmark the NumPy backend's chunk evaluation against this machine's float32 GEMM.

Prints member-tokens/s for the `tiny` and `egg-paper` layer sizes, the useful int8
multiply-accumulates per second (the model's GEMM work: 12 D^2 per layer + V D for the head,
per member-token), and the ratio of that rate to float32 GEMM measured in the same run:
at the same matrix shapes and on one large square GEMM (the machine's peak).

    python scripts/bench_eval.py [--members 512] [--seq-len 20] [--repeats 3]

Target (egg-paper sizes): int8 MAC rate >= 25% of the float32 GEMM rate at the same shapes.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from eggroll_dist.shared.config import ESConfig, RunConfig, preset
from eggroll_dist.shared.data import DataMeta, Dataset
from eggroll_dist.shared.replica import ReplicaState
from eggroll_dist.worker.backend.numpy_backend import NumpyBackend


def macs_per_member_token(cfg: RunConfig) -> int:
    d, v = cfg.model.d_model, cfg.model.vocab_size
    return cfg.model.n_layer * 12 * d * d + v * d


def gemm_rate(shapes: list[tuple[int, int, int, int]], repeats: int) -> float:
    """float32 GEMM multiply-accumulates per second over (M, K, N, weight) shapes."""
    rng = np.random.default_rng(0)
    total_macs, total_s = 0.0, 0.0
    for m, k, n, weight in shapes:
        a = rng.integers(-127, 128, size=(m, k)).astype(np.float32)
        b = rng.integers(-127, 128, size=(k, n)).astype(np.float32)
        a @ b  # warm-up
        best = min(_timed(lambda a=a, b=b: a @ b) for _ in range(repeats))
        total_macs += weight * m * k * n
        total_s += weight * best
    return total_macs / total_s


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def synthetic_dataset(vocab: int, tokens: int = 1 << 20) -> Dataset:
    rng = np.random.default_rng(0)
    train = rng.integers(1, vocab, size=tokens).astype(np.uint8)
    valid = rng.integers(1, vocab, size=4096).astype(np.uint8)
    meta = DataMeta(1, vocab, len(train), len(valid), "0" * 64, "bench", 1, 1, {})
    return Dataset(train, valid, [bytes([i]) for i in range(vocab)], meta, bytes(32))


def bench(name: str, members: int, seq_len: int, repeats: int) -> dict[str, float]:
    base = preset(name)
    es = ESConfig(
        **{**base.es.__dict__, "population": members, "chunk_size": members, "seq_len": seq_len}
    )
    cfg = base.replace(es=es)
    backend = NumpyBackend(
        synthetic_dataset(cfg.model.vocab_size), ReplicaState.initial(cfg), batch_members=members
    )
    backend.evaluate_chunk(0, 0, members)  # warm-up (page faults, allocator)
    seconds = min(_timed(lambda: backend.evaluate_chunk(0, 0, members)) for _ in range(repeats))
    member_tokens = members * seq_len
    macs = member_tokens * macs_per_member_token(cfg)
    d, v = cfg.model.d_model, cfg.model.vocab_size
    layers = cfg.model.n_layer
    # The model's GEMMs per token: 4 (D x D) + D -> 4D + 4D -> D per layer, and the head.
    shapes = [
        (members, d, d, 4 * layers),
        (members, d, 4 * d, layers),
        (members, 4 * d, d, layers),
        (members, d, v, 1),
    ]
    same_shapes = gemm_rate(shapes, repeats)
    return {
        "member_tokens_per_s": member_tokens / seconds,
        "int8_macs_per_s": macs / seconds,
        "f32_same_shapes": same_shapes,
        "chunk_s": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", type=int, default=512)
    parser.add_argument("--seq-len", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    peak = gemm_rate([(2048, 2048, 2048, 1)], args.repeats)
    print(f"float32 GEMM peak (2048^3): {peak / 1e9:.1f} G MAC/s")
    print(
        f"chunk: {args.members} members x {args.seq_len} tokens (seq_len shortened for time;"
        " the cost per member-token does not depend on it)"
    )
    for name in ("tiny", "egg-paper"):
        r = bench(name, args.members, args.seq_len, args.repeats)
        same = r["int8_macs_per_s"] / r["f32_same_shapes"]
        print(
            f"{name:>10}: {r['member_tokens_per_s']:>10,.0f} member-tokens/s  "
            f"{r['int8_macs_per_s'] / 1e9:6.2f} G int8 MAC/s  "
            f"= {100 * same:5.1f}% of float32 GEMM at the same shapes "
            f"({r['f32_same_shapes'] / 1e9:.1f} G MAC/s), "
            f"{100 * r['int8_macs_per_s'] / peak:5.1f}% of peak  [chunk {r['chunk_s']:.2f} s]"
        )
        if name == "egg-paper":
            print(f"target >= 25% at egg-paper sizes: {'PASS' if same >= 0.25 else 'FAIL'}")


if __name__ == "__main__":
    main()
