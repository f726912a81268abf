"""Benchmark the CuPy backend against this GPU's best int8 GEMM rate, measured in the same run.

Prints, for each preset (default `d-eggs` first, the former: 4 layers, width 256, T = 64,
vocabulary 8192, adaptive noise and AdamW, at its own 327,680; then `egg-paper`: 6 layers,
width 256, T = 100, at populations 32,768 and 262,144): member-tokens/s of a whole-population
evaluation (all chunks of a step, as the worker's evaluate_chunks runs them), where one
forward pass's time and the update's go (each kernel's launches timed one by one), the
update time per step (the captured graph plus the copy of the weights and state back), and
the useful int8 MACs per second of the GEMMs (every 2-D weight a member-token goes through,
the former's tied head included: EGG 12 D^2 per layer + V D; former 12 D^2 per layer + 8 D^2
for the embedding MLP + V D) as a fraction of two ceilings measured in the same run:
- cuBLAS on the same shapes: gemmEx (int8 in, int32 out, via CuPy) on each of the preset's
  GEMM shapes at 65,536 rows, combined as the time cuBLAS would take for the same GEMMs
  (bare, without the epilogues, norms and attention around them);
- the chip's int8 rate: the best of gemmEx and torch._int_mm (when torch is installed) on
  8192^3, for scale (K = 256 is too thin for it: cuBLAS gets a fraction of it on these shapes).

    python scripts/bench_gpu.py [--presets d-eggs egg-paper] [--populations N ...]
                                [--seq-len T] [--repeats 2] [--batch-members 65536]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from eggroll_dist.shared.config import ESConfig, RunConfig, preset
from eggroll_dist.shared.data import DataMeta, Dataset
from eggroll_dist.shared.replica import ReplicaState

GEMM_SIZE = 8192
D_EGGS_RTX4090 = 545e3  # d-eggs' member-tokens/s on one RTX 4090, for scale


def synthetic_dataset(vocab: int, tokens: int = 1 << 22) -> Dataset:
    rng = np.random.default_rng(0)
    dtype = np.uint8 if vocab <= 256 else np.uint16
    train = rng.integers(1, vocab, size=tokens).astype(dtype)
    valid = rng.integers(1, vocab, size=4096).astype(dtype)
    meta = DataMeta(1, vocab, len(train), len(valid), "0" * 64, "bench", 1, 1, {})
    pieces = [i.to_bytes(2 if vocab > 256 else 1, "big") for i in range(vocab)]
    return Dataset(train, valid, pieces, meta, bytes(32))


def cuda_sync() -> None:
    import cupy

    cupy.cuda.Device().synchronize()


@dataclass(frozen=True)
class Device:
    """What the bench asks of a device: a CuPy backend (dataset, state, members per forward
    pass), a drain of its queue, and a timer of single launches (launch_profile's; None: CUDA
    events). The tests stand the CPU build of the kernels in for it."""

    backend: Callable[[Dataset, ReplicaState, int], Any]
    sync: Callable[[], None] = cuda_sync
    timer: tuple | None = None


def cuda_device() -> Device:
    import cupy

    from eggroll_dist.worker.backend.cupy_backend import CupyBackend, cupy_module

    def backend(data: Dataset, state: ReplicaState, batch: int) -> CupyBackend:
        stream = cupy.cuda.Stream(non_blocking=True)
        return CupyBackend(
            data, state, xp=cupy, module_factory=cupy_module, stream=stream, batch_members=batch
        )

    return Device(backend)


def gpu_seconds(
    fn: Callable[[], object], repeats: int, sync: Callable[[], None] = cuda_sync
) -> float:
    """Best wall time of fn() with the device drained before and after (after one warm-up)."""
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return best


def cublas_int8_rate(repeats: int, m: int = GEMM_SIZE, n: int = GEMM_SIZE, k: int = GEMM_SIZE):
    """int8 MAC/s of cuBLAS gemmEx on an m x n x k product (A^T B layout, int32 accumulate)."""
    import cupy
    from cupy_backends.cuda.libs import cublas

    a = cupy.random.randint(-127, 128, size=(n, k), dtype=cupy.int8)
    b = cupy.random.randint(-127, 128, size=(m, k), dtype=cupy.int8)
    c = cupy.empty((m, n), dtype=cupy.int32)
    one, zero = np.ones(1, np.int32), np.zeros(1, np.int32)
    handle = cupy.cuda.device.get_cublas_handle()
    r_8i, r_32i, compute_32i, algo = 3, 10, 72, -1  # CUDA_R_8I, CUDA_R_32I, ..., default

    def gemm() -> None:
        cublas.gemmEx(
            handle,
            cublas.CUBLAS_OP_T,
            cublas.CUBLAS_OP_N,
            *(n, m, k, one.ctypes.data, a.data.ptr, r_8i, k, b.data.ptr, r_8i, k),
            *(zero.ctypes.data, c.data.ptr, r_32i, n, compute_32i, algo),
        )

    return m * n * k / gpu_seconds(gemm, repeats)


def torch_int8_rate(repeats: int) -> float:
    import torch

    n = GEMM_SIZE
    a = torch.randint(-127, 128, (n, n), dtype=torch.int8, device="cuda")
    b = torch.randint(-127, 128, (n, n), dtype=torch.int8, device="cuda").t()  # column-major

    def mm() -> None:
        torch._int_mm(a, b)

    mm()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        mm()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return n**3 / best


DEFAULT_POPULATIONS = {"egg-paper": [32768, 262144]}  # else the preset's own


def gemm_shapes(cfg: RunConfig) -> list[tuple[int, int]]:
    """(N, K) of every GEMM one member-token goes through in a forward pass: each 2-D weight
    but the embedding table, which the former's tied head uses as (V, D)."""
    from eggroll_dist.shared.model import param_specs

    specs = param_specs(cfg.model)
    shapes = [(s.shape[0], s.shape[1]) for s in specs if len(s.shape) == 2 and s.name != "emb"]
    if cfg.model.arch == "former":
        shapes.append((cfg.model.vocab_size, cfg.model.d_model))
    return shapes


def useful_macs(cfg: RunConfig) -> int:
    """The GEMMs' multiply-adds per member-token."""
    return sum(n * k for n, k in gemm_shapes(cfg))


def same_shape_rate(shapes: list[tuple[int, int]], rates: dict[tuple[int, int], float]) -> float:
    """MAC/s of the GEMMs `shapes` (one each) at the per-shape `rates`: their multiply-adds
    over the sum of their times."""
    return sum(n * k for n, k in shapes) / sum(n * k / rates[(n, k)] for n, k in shapes)


def bench_population(
    name: str,
    population: int,
    seq_len: int | None,
    repeats: int,
    batch: int = 65536,
    device: Device | None = None,
) -> dict:
    device = device or cuda_device()
    base = preset(name)
    seq_len = seq_len or base.es.seq_len
    chunk = min(base.es.chunk_size, population)
    es = ESConfig(
        **{**base.es.__dict__, "population": population, "chunk_size": chunk, "seq_len": seq_len}
    )
    cfg = base.replace(es=es)
    data = synthetic_dataset(cfg.model.vocab_size)
    backend = device.backend(data, ReplicaState.initial(cfg), min(population, batch))
    chunks = [(c * chunk, chunk) for c in range(population // chunk)]
    eval_s = gpu_seconds(lambda: backend.evaluate_chunks(0, chunks), repeats, device.sync)
    rng = np.random.default_rng(0)
    fitness = rng.choice(np.array([-1, 0, 1], dtype=np.int8), size=cfg.pairs)
    update = []
    for _ in range(repeats + 1):  # the first apply captures the graph
        t = time.perf_counter()
        backend.apply_step(fitness)
        update.append(time.perf_counter() - t)
        backend.load_state(ReplicaState(cfg, 0, backend.state.params, backend.state.opt))
    # the update's device part alone: the captured graph (Z GEMMs, noise, apply kernels)
    graph_s = gpu_seconds(backend._update_graph, repeats, device.sync)
    member_tokens = len(chunks) * chunk * seq_len  # whole chunks only
    worker_s, worker_members, worker_batch = worker_path(backend, chunks, repeats, device)
    return {
        "worker_member_tokens_per_s": worker_members * seq_len / worker_s,
        "worker_batch": worker_batch,
        "profile": forward_profile(backend, backend.batch_members // 2, device.timer),
        "update_profile": launch_profile(backend, backend._update_sequence, device.timer),
        "batch": backend.batch_members,
        "member_tokens_per_s": member_tokens / eval_s,
        "macs_per_s": member_tokens * useful_macs(cfg) / eval_s,
        "eval_s": eval_s,
        "update_s": min(update[1:]),
        "graph_s": graph_s,
        "first_update_s": update[0],
    }


def worker_path(
    best: Any, chunks: list[tuple[int, int]], repeats: int, device: Device, requests: int = 4
) -> tuple[float, int, int]:
    """The worker's own path: a backend of the worker's default batch, asked for the chunks
    one lease request carries (as worker/replica.py asks), `requests` requests in a row (or
    the whole population, if less). Returns (seconds, members, batch)."""
    from eggroll_dist.protocol.messages import MAX_CHUNKS_PER_REQUEST
    from eggroll_dist.worker.backend.cupy_backend import BATCH_MEMBERS
    from eggroll_dist.worker.backend.cupy_former import batch_members

    cfg = best.config
    batch = BATCH_MEMBERS
    if cfg.model.arch == "former":
        batch = batch_members(cfg, batch)
    backend = best
    if batch != best.batch_members:
        backend = device.backend(best.dataset, best.state, batch)
    group = max(1, min(backend.parallel_chunks, MAX_CHUNKS_PER_REQUEST))
    leases = [chunks[i : i + group] for i in range(0, len(chunks), group)][:requests]

    def evaluate() -> None:
        for lease in leases:
            backend.evaluate_chunks(0, lease)

    seconds = gpu_seconds(evaluate, repeats, device.sync)
    members = sum(count for lease in leases for _, count in lease)
    return seconds, members, backend.batch_members


def cuda_event_timer() -> tuple[Callable[[Callable[[], None]], object], Callable[[object], float]]:
    """Time one launch between two CUDA events on the current stream: (start, seconds)."""
    import cupy

    def start(launch: Callable[[], None]) -> object:
        begin, end = cupy.cuda.Event(), cupy.cuda.Event()
        begin.record()
        launch()
        end.record()
        return begin, end

    def seconds(handle: object) -> float:
        begin, end = handle  # type: ignore[misc]
        end.synchronize()
        return cupy.cuda.get_elapsed_time(begin, end) / 1e3

    return start, seconds


def launch_profile(
    backend: object, sequence: Callable[[], None], timer: tuple | None = None
) -> list[tuple[str, int, float]]:
    """(kernel, launches, seconds) of sequence(), the backend's launches run one by one (not
    as a captured graph) and each timed on its own, slowest kernel first. A launch shorter
    than the host's cost of making one (some microseconds) reads as that cost.
    timer: (start, seconds) as cuda_event_timer gives, the default."""
    start, seconds = timer or cuda_event_timer()
    kernels = backend.kernels  # type: ignore[attr-defined]
    launched: list[tuple[str, object]] = []

    def timed(name: str, fn: Callable) -> Callable:
        return lambda grid, block, args: launched.append(
            (name, start(lambda: fn(grid, block, args)))
        )

    original = kernels._fn
    kernels._fn = {name: timed(name, fn) for name, fn in original.items()}
    try:
        with backend._scope():  # type: ignore[attr-defined]
            sequence()
    finally:
        kernels._fn = original
    totals: dict[str, list] = {}
    for name, handle in launched:
        entry = totals.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += seconds(handle)
    return sorted(((n, c, t) for n, (c, t) in totals.items()), key=lambda row: -row[2])


def forward_profile(
    backend: object, n_pairs: int, timer: tuple | None = None
) -> list[tuple[str, int, float]]:
    """launch_profile of one forward pass of n_pairs pairs: where a pass's time goes."""
    gpu: Any = backend
    bufs = gpu.launch.buffers(gpu, n_pairs)
    return launch_profile(gpu, lambda: gpu.launch.sequence(gpu, bufs), timer)


def print_profile(title: str, rows: list[tuple[str, int, float]]) -> None:
    total = sum(t for _, _, t in rows)
    print(f"  {title}, launch by launch: {1e3 * total:.1f} ms")
    for kernel, count, t in rows:
        print(f"    {kernel:<22} {count:6d} launches {1e3 * t:9.2f} ms {100 * t / total:5.1f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # d-eggs first: under gpu_check's deadline, the former's figure is not the one cut short
    parser.add_argument("--presets", nargs="+", default=["d-eggs", "egg-paper"])
    parser.add_argument(
        "--populations", type=int, nargs="+", help="default: 32768 262144 for egg-paper, "
        "else the preset's own"
    )  # fmt: skip
    parser.add_argument("--seq-len", type=int, help="default: the preset's")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--batch-members", type=int, default=65536, help="members per forward pass (graph)"
    )
    args = parser.parse_args()
    from eggroll_dist.worker.backend.cupy_backend import describe_device

    print(f"device: {describe_device()}")
    ceilings = {}
    for name, fn in (("cublas gemmEx", cublas_int8_rate), ("torch._int_mm", torch_int8_rate)):
        try:
            ceilings[name] = fn(args.repeats)
            print(f"int8 ceiling {name} {GEMM_SIZE}^3: {2 * ceilings[name] / 1e12:8.1f} TOPS")
        except Exception as exc:  # torch absent, or a cuBLAS that refuses the layout
            print(f"int8 ceiling {name}: unavailable ({type(exc).__name__}: {exc})")
    ceiling = max(ceilings.values(), default=0.0)
    rates: dict[tuple[int, int], float] = {}  # cuBLAS on each GEMM shape, at 65536 rows
    for name in args.presets:
        for n, k in sorted(set(gemm_shapes(preset(name))) - set(rates)):
            try:
                rates[(n, k)] = cublas_int8_rate(args.repeats, 65536, n, k)
            except Exception as exc:  # a cuBLAS that refuses the layout: the rest still runs
                print(f"cublas gemmEx int8, the shape 65536x{n}x{k}: unavailable ({exc})")
                continue
            print(
                f"cublas gemmEx int8, the shape 65536x{n}x{k}: {2 * rates[n, k] / 1e12:7.1f} TOPS"
            )
    runs = [
        (name, population)
        for name in args.presets
        for population in args.populations
        or DEFAULT_POPULATIONS.get(name, [preset(name).es.population])
    ]
    for name, population in runs:
        r = bench_population(name, population, args.seq_len, args.repeats, args.batch_members)
        share = f"{100 * r['macs_per_s'] / ceiling:5.2f}%" if ceiling else "n/a"
        shapes = gemm_shapes(preset(name))
        cublas = same_shape_rate(shapes, rates) if set(shapes) <= set(rates) else 0.0
        of_cublas = (
            f"{100 * r['macs_per_s'] / cublas:.0f}% of cuBLAS on the same shapes "
            f"({2 * cublas / 1e12:.1f} TOPS)"
            if cublas
            else "cuBLAS on the same shapes unavailable"
        )
        best, worker = r["member_tokens_per_s"], r["worker_member_tokens_per_s"]
        update_share = r["update_s"] / (r["eval_s"] + r["update_s"])
        print(
            f"{name} population {population:>7}: best path {best / 1e6:.2f} M member-tokens/s "
            f"= {best / D_EGGS_RTX4090:.1f}x d-eggs' {D_EGGS_RTX4090 / 1e3:.0f}k on an RTX 4090; "
            f"the worker's path (batch {r['worker_batch']}, the chunks of one lease request) "
            f"{worker / 1e6:.2f} M = {100 * worker / best:.0f}% of best; the update "
            f"{100 * update_share:.1f}% of a step; useful int8 {2 * r['macs_per_s'] / 1e12:.1f} "
            f"TOPS = {of_cublas}"
        )
        print(
            f"{name} population {population:>7} (batch {r['batch']}): "
            f"{r['member_tokens_per_s'] / 1e6:8.2f} M member-tokens/s  "
            f"{2 * r['macs_per_s'] / 1e12:7.2f} TOPS useful int8 = {share} of the 8192^3 ceiling  "
            f"[eval {r['eval_s']:.3f} s, update {1e3 * r['update_s']:.1f} ms per step "
            f"({1e3 * r['graph_s']:.1f} ms of it the device graph), "
            f"first update with graph capture {1e3 * r['first_update_s']:.1f} ms]"
        )
        print_profile(f"{name}: one forward pass of {r['batch']} members", r["profile"])
        print_profile(f"{name}: the update", r["update_profile"])


if __name__ == "__main__":
    main()
