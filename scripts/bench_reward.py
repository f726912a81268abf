"""Benchmark a reward run's evaluation: completions per second, the share of a step spent
inside the reward, and the population's generation against plain batched generation.

The reference, measured in the same run: the unperturbed model generating the same number
of completions (same prompts, same length, rows batched the same way). The ratio says what
the members' rank-1 perturbations cost over inference, EGGROLL's headline comparison.

    python scripts/bench_reward.py [--data-dir data] [--preset tiny] [--population 2048]
        [--prompts-per-step 8] [--completion-tokens 32] [--reward builtin:letter_e]
        [--repeats 2] [--threads N]

When CuPy sees a GPU, the CuPy backend generates the same step's completions too (members
and chunks as the NumPy backend's, the same tokens checked), and its rate is printed beside
the NumPy backend's with their ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

from eggroll_dist.shared.config import ESConfig, FitnessConfig, RunConfig, preset
from eggroll_dist.shared.data import Dataset, load_data_dir
from eggroll_dist.shared.prompts import generation_seed, settings, step_prompts
from eggroll_dist.shared.replica import ReplicaState
from eggroll_dist.shared.sample import Completions, generate_rows
from eggroll_dist.worker.backend import cuda_usable
from eggroll_dist.worker.backend.numpy_backend import NumpyBackend
from eggroll_dist.worker.objective import Reward, make_objective


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", type=Path, default=Path("data"))
    p.add_argument("--preset", default="tiny")
    p.add_argument("--population", type=int, default=2048)
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--completion-tokens", type=int, default=32)
    p.add_argument("--reward", default="builtin:letter_e")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    base = preset(args.preset)
    chunk = min(base.es.chunk_size, args.population)
    cfg = base.replace(
        es=dataclasses.replace(base.es, population=args.population, chunk_size=chunk),
        fitness=FitnessConfig(
            objective="reward",
            reward=args.reward,
            prompts="data",
            prompts_per_step=args.prompts_per_step,
            completion_tokens=args.completion_tokens,
        ),
    )
    assert isinstance(cfg.es, ESConfig)
    dataset = load_data_dir(args.data_dir)
    backend = NumpyBackend(dataset, ReplicaState.initial(cfg), threads=args.threads)
    objective = make_objective(cfg, dataset, Path("."))
    assert isinstance(objective, Reward)
    chunks = [(c * chunk, chunk) for c in range(cfg.chunks)]
    objective.evaluate_chunks(backend, 0, chunks[:1])  # warm-up: tables, the reward's process
    objective.reward_seconds = objective.generate_seconds = 0.0
    objective.completions = 0
    t0 = time.perf_counter()
    for _ in range(args.repeats):  # step 0 again: the work of any step
        objective.evaluate_chunks(backend, 0, chunks)
    total = time.perf_counter() - t0
    completions = objective.completions
    # The reference: the unperturbed model writes the same completions, batched the same way.
    chosen = step_prompts(cfg, objective.prompts, 0)
    model = backend.model
    ref_s = 0.0
    for _ in range(args.repeats):
        for _first, count in chunks:
            for length in sorted({len(q.tokens) for q in chosen}):
                group = [q for q in chosen if len(q.tokens) == length]
                rows = np.tile(np.array([q.tokens for q in group]), (count, 1))
                samples = np.tile(np.array([q.index for q in group]), count)
                t = time.perf_counter()
                with threadpool_limits(backend.threads):  # as the backend computes
                    generate_rows(
                        model.decoder(None, len(rows)),
                        rows,
                        cfg.fitness.completion_tokens,
                        settings(cfg),
                        generation_seed(cfg, 0),
                        samples,
                    )
                ref_s += time.perf_counter() - t
    objective.close()
    gen_tokens = completions * cfg.fitness.completion_tokens
    print(f"config: {args.preset}, population {cfg.es.population}, {cfg.chunks} chunks, "
          f"{args.prompts_per_step} prompts x {args.completion_tokens} tokens, "
          f"{backend.threads} threads, reward {args.reward}")  # fmt: skip
    print(f"completions/s:            {completions / total:,.0f}")
    print(f"generated member-tok/s:   {gen_tokens / total:,.0f}")
    print(f"share inside the reward:  {objective.reward_seconds / total:.1%}")
    print(f"share generating:         {objective.generate_seconds / total:.1%}")
    print(f"unperturbed generation:   {gen_tokens / ref_s:,.0f} tok/s (reference)")
    print(f"ratio to the reference:   {ref_s / objective.generate_seconds:.2f}")
    if cuda_usable():
        print_cupy(
            cfg,
            dataset,
            backend,
            chosen,
            chunks,
            args.repeats,
            gen_tokens / objective.generate_seconds,
        )


def cupy_generation(
    cfg: object,
    dataset: object,
    numpy_backend: NumpyBackend,
    request: Completions,
    chunks: list[tuple[int, int]],
    repeats: int,
) -> float:
    """Member-tokens per second of the CuPy backend generating the step's completions; its
    first chunk (compiles, graphs) is checked against the NumPy backend's tokens."""
    import cupy

    from eggroll_dist.worker.backend.cupy_backend import factory

    gpu = factory().build(dataset, numpy_backend.state)
    first = gpu.complete(0, chunks[0], request)
    if not np.array_equal(first, numpy_backend.complete(0, chunks[0], request)):
        raise SystemExit("the CuPy backend's tokens differ from the NumPy backend's")
    cupy.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        for chunk in chunks:
            gpu.complete(0, chunk, request)
    cupy.cuda.Device().synchronize()
    tokens = repeats * sum(c for _, c in chunks) * len(request.prompts) * request.new_tokens
    return tokens / (time.perf_counter() - t0)


def print_cupy(
    cfg: RunConfig,
    dataset: Dataset,
    backend: NumpyBackend,
    chosen: list,
    chunks: list[tuple[int, int]],
    repeats: int,
    numpy_rate: float,
) -> None:
    """The CuPy backend's generation of the same completions, beside NumPy's rate."""
    request = Completions(
        tuple(q.tokens for q in chosen),
        tuple(q.index for q in chosen),
        generation_seed(cfg, 0),
        settings(cfg),
        cfg.fitness.completion_tokens,
    )
    cupy_rate = cupy_generation(cfg, dataset, backend, request, chunks, repeats)
    print(f"NumPy generation:         {numpy_rate:,.0f} member-tok/s")
    print(f"CuPy generation:          {cupy_rate:,.0f} member-tok/s "
          f"({cupy_rate / numpy_rate:.1f}x NumPy)")  # fmt: skip


if __name__ == "__main__":
    main()
