"""The CuPy backend's own code (CupyBackend) equals the NumPy backend, byte for byte.

Runs on the CPU build of the kernels by default (every thread order), on a GPU with
EGGROLL_KERNEL_TARGET=cupy: whole chunks (fitness and loss sums), several chunks in one
forward pass, and steps applied through the captured update (the replica digest each step).
"""

from __future__ import annotations

import dataclasses
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_target import CPU_BUILD_MISSING, ON_GPU, VARIANTS, array_module, module_factory

from eggroll_dist.shared.config import (
    PRESETS,
    ESConfig,
    FitnessConfig,
    ModelConfig,
    RunConfig,
    UpdateConfig,
)
from eggroll_dist.shared.model import param_specs
from eggroll_dist.shared.replica import DIGEST_LEAF, ReplicaState
from eggroll_dist.shared.sample import Completions, SampleSettings, TrainingSamples
from eggroll_dist.shared.window import validation_streams, validation_windows
from eggroll_dist.worker.backend import BackendUnavailable, cuda_usable, get_backend
from eggroll_dist.worker.backend import cupy_backend as cupy_backend_module
from eggroll_dist.worker.backend.cupy_backend import CupyBackend, Kernels
from eggroll_dist.worker.backend.cupy_egg import launches as forward_launches
from eggroll_dist.worker.backend.cupy_former import batch_members as former_batch
from eggroll_dist.worker.backend.cupy_former import launches as former_launches
from eggroll_dist.worker.backend.numpy_backend import NumpyBackend

pytestmark = pytest.mark.skipif(bool(CPU_BUILD_MISSING), reason=str(CPU_BUILD_MISSING))

CONFIGS = {
    # 1 layer, width 32, 16 members in 2 chunks, 4 tokens per member; the z-test threshold
    # changes every step (the captured update must read it from device memory)
    "uniform": RunConfig(
        model=ModelConfig(n_layer=1, d_model=32, vocab_size=64),
        es=ESConfig(population=16, chunk_size=8, seq_len=4),
        update=UpdateConfig(alpha=4.0, alpha_decay_steps=1),
    ),
    # the momentum rule's M resident on the device beside the weights (the tiny preset's rule)
    "momentum": RunConfig(
        model=ModelConfig(n_layer=1, d_model=32, vocab_size=64, init_seed=5),
        es=ESConfig(population=16, chunk_size=8, seq_len=4, run_seed=3),
        update=UpdateConfig(rule="momentum", momentum_shift=1, alpha=4.0, alpha_decay_steps=1),
    ),
    # token noise: only the 24 commonest tokens' rows of the embedding and head get noise
    # (their a rows zero from there on, in the forward and in the update alike)
    "tokens": RunConfig(
        model=ModelConfig(n_layer=1, d_model=32, vocab_size=64, init_seed=7),
        es=ESConfig(population=16, chunk_size=8, seq_len=4, run_seed=5, token_noise_rows=24),
        update=UpdateConfig(rule="momentum", momentum_shift=1, alpha=4.0, alpha_decay_steps=1),
    ),
    # fixed-point AdamW's moments and accumulator resident on the device, weight decay on
    # the matrices only, the learning rate halved every step
    "adamw": RunConfig(
        model=ModelConfig(n_layer=1, d_model=32, vocab_size=64, init_seed=6),
        es=ESConfig(population=16, chunk_size=8, seq_len=4, run_seed=4),
        update=UpdateConfig(rule="adamw", lr=4.0, lr_halve_steps=1, weight_decay=0.1),
    ),
    # 2 layers, width 36 (a partial K stage), gaussian noise, both fitness filters
    "gaussian": RunConfig(
        model=ModelConfig(n_layer=2, d_model=36, vocab_size=40, init_seed=3),
        es=ESConfig(population=12, chunk_size=6, seq_len=3, noise="gaussian", run_seed=7),
        fitness=FitnessConfig(chunk_mean_filter=True, adaptive_threshold=True),
        update=UpdateConfig(alpha=1.0),
    ),
    # the former: heads of 8, a vocabulary above 256 and not a multiple of the tile, a
    # head bias with token noise (its elements from 40 on get none) and adaptive noise
    # (factors multiply), the momentum rule (its apply kernel flags the moved weights)
    "former": RunConfig(
        model=ModelConfig(
            arch="former", n_layer=1, d_model=32, n_head=4, vocab_size=300, head_bias="zipf"
        ),
        es=ESConfig(
            population=16,
            chunk_size=8,
            seq_len=5,
            run_seed=2,
            token_noise_rows=40,
            adaptive_noise=True,
        ),
        update=UpdateConfig(rule="momentum", momentum_shift=1, alpha=4.0, alpha_decay_steps=1),
    ),
    # d-eggs' settings at width 36 (partial K stages, heads of 12), 2 layers: AdamW, adaptive
    # noise (the overlays resident on the device, moved after each update), its fitness
    # filters; no head bias
    "former-d-eggs": RunConfig(
        model=ModelConfig(arch="former", n_layer=2, d_model=36, n_head=3, vocab_size=70),
        es=ESConfig(population=12, chunk_size=6, seq_len=3, run_seed=8, adaptive_noise=True),
        fitness=FitnessConfig(chunk_mean_filter=True, adaptive_threshold=True),
        update=UpdateConfig(rule="adamw", lr=0.5, weight_decay=0.1),
    ),
    # the EGG model with adaptive noise and token noise together (factors multiply)
    "egg-adaptive": RunConfig(
        model=ModelConfig(n_layer=1, d_model=32, vocab_size=64, init_seed=9),
        es=ESConfig(
            population=16,
            chunk_size=8,
            seq_len=4,
            noise="gaussian",
            run_seed=6,
            adaptive_noise=True,
            token_noise_rows=40,
        ),
        update=UpdateConfig(alpha=4.0, alpha_decay_steps=1),
    ),
}


def count_launches(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the kernels launched through the argument checks from now on."""
    launched: list[str] = []
    checked = Kernels.__call__

    def counting(self: Kernels, name: str, *rest: object) -> None:
        launched.append(name)
        checked(self, name, *rest)

    monkeypatch.setattr(Kernels, "__call__", counting)
    return launched


def dataset(cfg: RunConfig) -> SimpleNamespace:
    rng = np.random.default_rng(1)
    v = cfg.model.vocab_size
    train = rng.integers(0, v, size=4000).astype(np.uint16)
    train[::37] = 0  # document starts reset the layer states
    valid = rng.integers(0, v, size=400).astype(np.uint16)
    pieces = [bytes([i % 256]) * (1 + i % 3) for i in range(v)]  # 1 to 3 bytes per token
    meta = SimpleNamespace(ids_by_frequency=True)  # what es.token_noise_rows assumes
    return SimpleNamespace(train=train, valid=valid, decoding=pieces, meta=meta)


def cupy_backend(cfg: RunConfig, data, variant: str, tensor_cores: bool) -> CupyBackend:
    stream = None
    if ON_GPU:
        import cupy

        stream = cupy.cuda.Stream(non_blocking=True)
    return CupyBackend(
        data,
        ReplicaState.initial(cfg),
        xp=array_module(),
        module_factory=module_factory(variant),
        stream=stream,
        tensor_cores=tensor_cores,
        batch_members=6,  # several sub-batches per chunk
    )


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("tensor_cores", [True, False], ids=["mma", "dp4a"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_chunks_and_steps_equal_the_numpy_backend(
    name: str, tensor_cores: bool, variant: str
) -> None:
    cfg = CONFIGS[name]
    data = dataset(cfg)
    ref = NumpyBackend(data, ReplicaState.initial(cfg))
    gpu = cupy_backend(cfg, data, variant, tensor_cores)
    size = cfg.es.chunk_size
    for step in range(3):
        want = [ref.evaluate_chunk(step, c * size, size) for c in range(cfg.chunks)]
        got = [gpu.evaluate_chunk(step, c * size, size) for c in range(cfg.chunks)]
        for w, g in zip(want, got, strict=True):
            assert g.fitness.dtype == np.int8
            assert g.fitness.tobytes() == w.fitness.tobytes() and g.loss_sum == w.loss_sum
        together = gpu.evaluate_chunks(step, [(c * size, size) for c in range(cfg.chunks)])
        assert [(c.fitness.tobytes(), c.loss_sum) for c in together] == [
            (c.fitness.tobytes(), c.loss_sum) for c in want
        ]
        fitness = np.concatenate([c.fitness for c in want])
        changed = ref.apply_step(fitness)
        assert changed > 0
        assert gpu.apply_step(fitness) == changed  # step 2+ replays the captured update
        assert gpu.step == ref.step == step + 1
        assert gpu.digest() == ref.digest()
    if cfg.es.adaptive_noise:  # steps 2 and 3 ran on scaled noise: overlays below 64
        overlays = [v for name, v in gpu.state.opt.items() if name.startswith("overlay.")]
        assert any((v < 64).any() for v in overlays) and any((v > 64).any() for v in overlays)
    held_out = gpu.validate()
    assert held_out == ref.validate()  # both metrics, per token and per byte
    if cfg.model.arch == "egg":  # the long streams are a recurrent model's metric
        assert held_out.streams is not None and held_out.streams.tokens == held_out.windows.tokens


def reduced(name: str) -> RunConfig:
    """A preset at test size (2 layers, width 36 with heads of 12, 16 members, windows of 4),
    every other setting its own: noise, scales, fitness filters, rule."""
    cfg = PRESETS[name]
    vocab = min(cfg.model.vocab_size, 300)
    model = dataclasses.replace(cfg.model, n_layer=2, d_model=36, n_head=3, vocab_size=vocab)
    token_rows = min(cfg.es.token_noise_rows, vocab // 3)
    es = dataclasses.replace(
        cfg.es, population=16, chunk_size=8, seq_len=4, token_noise_rows=token_rows
    )
    return cfg.replace(model=model, es=es)


@pytest.mark.parametrize("tensor_cores", [True, False], ids=["mma", "dp4a"])
@pytest.mark.parametrize("name", ["tiny", "egg-paper", "former-tiny", "d-eggs"])
def test_every_preset_equals_the_numpy_backend(name: str, tensor_cores: bool) -> None:
    """Each preset's own settings at reduced sizes: chunks, two steps, held-out scores."""
    two_steps_and_held_out(reduced(name), tensor_cores)


@pytest.mark.parametrize("tensor_cores", [True, False], ids=["mma", "dp4a"])
@pytest.mark.parametrize("arch", ["egg", "former"])
def test_power_of_two_divisors_equal_the_numpy_backend(arch: str, tensor_cores: bool) -> None:
    """Width 64, as every preset's widths: each MM divides by a power of two (128, and 256
    for the 4 D inputs), which the epilogues do by a shift; with every row length a
    multiple of 16 (the former's vocabulary 320), through shared memory."""
    cfg = reduced("egg-paper" if arch == "egg" else "d-eggs")
    vocab = 320 if arch == "former" else cfg.model.vocab_size
    model = dataclasses.replace(cfg.model, d_model=64, n_head=2, n_layer=1, vocab_size=vocab)
    cfg = cfg.replace(model=model)
    two_steps_and_held_out(cfg, tensor_cores)


def two_steps_and_held_out(cfg: RunConfig, tensor_cores: bool) -> None:
    data = dataset(cfg)
    ref = NumpyBackend(data, ReplicaState.initial(cfg))
    gpu = cupy_backend(cfg, data, VARIANTS[-1], tensor_cores)
    chunks = [(c * 8, 8) for c in range(2)]
    for step in range(2):
        want = [ref.evaluate_chunk(step, *c) for c in chunks]
        got = gpu.evaluate_chunks(step, chunks)
        assert [(g.fitness.tobytes(), g.loss_sum) for g in got] == [
            (w.fitness.tobytes(), w.loss_sum) for w in want
        ]
        fitness = np.concatenate([w.fitness for w in want])
        assert gpu.apply_step(fitness) == ref.apply_step(fitness)
        assert gpu.digest() == ref.digest()
    assert gpu.validate() == ref.validate()


@pytest.mark.parametrize("name", ["uniform", "former"])
def test_a_forward_pass_is_one_replayed_sequence(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """The first pass of a shape captures its launches (the noise, then for the EGG model
    forward_launches(n_layer) kernels per token step, for the former former_launches(n_layer)
    over all positions at once); later passes replay them: one graph launch a pass and no
    launch through the argument checks."""
    cfg = CONFIGS[name]
    data = dataset(cfg)
    ref = NumpyBackend(data, ReplicaState.initial(cfg))
    gpu = cupy_backend(cfg, data, VARIANTS[0], True)
    launched = count_launches(monkeypatch)
    chunks = [(c * cfg.es.chunk_size, cfg.es.chunk_size) for c in range(cfg.chunks)]
    want = [ref.evaluate_chunk(0, *c) for c in chunks]
    # 8 pairs in forward batches of 3 pairs: 3, 3, 2, so two shapes, each captured once
    per_batch = gpu.batch_members // 2
    batches = -(-cfg.pairs // per_batch)
    shapes = len({min(per_batch, cfg.pairs - lo) for lo in range(0, cfg.pairs, per_batch)})
    assert (batches, shapes) == (3, 2)
    for attempt in range(3):
        launched.clear()
        replays = gpu.kernels.replays
        got = gpu.evaluate_chunks(0, chunks)
        assert [(g.fitness.tobytes(), g.loss_sum) for g in got] == [
            (w.fitness.tobytes(), w.loss_sum) for w in want
        ]
        assert gpu.kernels.replays == replays + batches  # one graph launch a forward batch
        if attempt == 0 and name == "former":  # the captures
            model = [n for n in launched if n not in ("noise_rows", "member_vector")]
            assert model.count("gather_windows") == shapes  # the windows, on the device
            model = [n for n in model if n != "gather_windows"]
            assert len(model) == shapes * former_launches(cfg.model.n_layer)
            assert launched.count("former_embed") == launched.count("former_loss") == shapes
        elif attempt == 0:
            noise = {"noise_rows", "member_vector", "gather_windows"}
            per_step = [n for n in launched if n not in noise and n != "zero_i32"]
            steps = shapes * cfg.es.seq_len
            assert len(per_step) == steps * forward_launches(cfg.model.n_layer)
            assert launched.count("embed") == launched.count("token_loss") == steps
            assert launched.count("zero_i32") == 2 * shapes  # the states and the loss
        else:
            assert launched == []


@pytest.mark.skipif(ON_GPU, reason="times launches by the host clock: the CPU build's")
@pytest.mark.parametrize("name", ["uniform", "former"])
def test_the_bench_profile_times_every_launch(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """scripts/bench_gpu.py's profile runs one forward pass, then the update, launch by
    launch, each launch timed on its own (by the host clock here: the CPU build runs a launch
    to its end): every kernel with its launch count, slowest first, and the backend's own
    launches restored."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from bench_gpu import forward_profile, launch_profile

    cfg = CONFIGS[name]
    gpu = cupy_backend(cfg, dataset(cfg), VARIANTS[0], True)
    ticks = iter(range(1000))

    def start(launch: object) -> int:  # each launch "takes" one tick more than the last
        launch()  # type: ignore[operator]
        return next(ticks)

    original = gpu.kernels._fn
    rows = forward_profile(gpu, 3, timer=(start, lambda tick: float(tick)))
    assert gpu.kernels._fn is original
    counts = {kernel: count for kernel, count, _ in rows}
    noise = counts.pop("noise_rows") + counts.pop("member_vector")
    assert noise > 0 and counts.pop("gather_windows") == 1
    if name == "former":
        assert sum(counts.values()) == former_launches(cfg.model.n_layer)
        assert counts["former_attention"] == cfg.model.n_layer
    else:
        assert counts.pop("zero_i32") == 2  # the states and the loss
        assert sum(counts.values()) == cfg.es.seq_len * forward_launches(cfg.model.n_layer)
    seconds = [t for _, _, t in rows]
    assert seconds == sorted(seconds, reverse=True)
    assert sum(seconds) == sum(range(sum(count for _, count, _ in rows)))  # every launch once
    # the update's sequence the same way, after a step (which allocated its buffers)
    gpu.apply_step(np.zeros(cfg.pairs, dtype=np.int8))
    launched = count_launches(monkeypatch)
    gpu._update_sequence()
    monkeypatch.undo()
    rows = launch_profile(gpu, gpu._update_sequence, timer=(start, lambda tick: float(tick)))
    assert {kernel: count for kernel, count, _ in rows} == Counter(launched)


@pytest.mark.skipif(ON_GPU, reason="the CPU build stands in for the device")
@pytest.mark.parametrize("name", ["tiny", "former-tiny"])
def test_the_gpu_scripts_run_through_the_cpu_build(name: str) -> None:
    """scripts/bench_gpu.py's whole figures (best path, worker's path, update, profiles) and
    gpu_check's chunk check run through the CPU build of the kernels at small sizes, so a GPU
    session's minutes go to measuring, not to the scripts' own bugs (a vocabulary above 256
    tokens once broke both, on a GPU). The chunk check also holds the backend to NumPy."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from bench_gpu import Device, bench_population, synthetic_dataset, worker_path
    from gpu_check import _chunk_check

    def backend(data, state: ReplicaState, batch: int) -> CupyBackend:
        factory = module_factory(VARIANTS[0])
        return CupyBackend(data, state, xp=np, module_factory=factory, batch_members=batch)

    ticks = iter(range(1, 100000))
    timer = (lambda launch: (launch(), next(ticks))[1], float)  # each launch one tick
    device = Device(backend, sync=lambda: None, timer=timer)
    r = bench_population(name, 16, 4, 1, batch=8, device=device)
    assert r["batch"] == 8 and 0 < r["update_s"] and r["eval_s"] > 0
    assert r["member_tokens_per_s"] == 16 * 4 / r["eval_s"]
    assert r["worker_member_tokens_per_s"] > 0
    # the worker's path: its default batch, 16 chunks a lease request (the protocol's bound)
    cfg = PRESETS[name].replace(es=ESConfig(population=80, chunk_size=2, seq_len=4))
    best = backend(synthetic_dataset(cfg.model.vocab_size), ReplicaState.initial(cfg), 8)
    chunks = [(2 * c, 2) for c in range(40)]
    _, members, batch = worker_path(best, chunks, 1, device, requests=2)
    default = cupy_backend_module.BATCH_MEMBERS
    assert members == 2 * 16 * 2
    assert batch == (default if name == "tiny" else former_batch(cfg, default)) > 8
    assert {k for k, _, _ in r["profile"]} >= {"gather_windows", "noise_rows"}
    assert r["update_profile"] and all(count > 0 for _, count, _ in r["update_profile"])
    base = PRESETS[name]  # its noise and rule at width 32, 4 chunks of 8
    cfg = base.replace(
        model=dataclasses.replace(base.model, d_model=32),
        es=dataclasses.replace(base.es, population=32, chunk_size=8, seq_len=4),
    )
    assert _chunk_check(name, cfg, device) == 0


@pytest.mark.parametrize("name", ["uniform", "former"])
def test_held_out_scores_in_several_passes(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Both metrics from the device's logit counts, in passes of at most 40 positions (the
    last one partial), after a step: the NumPy reference's figures exactly. A former pass is
    one graph launch; an EGG pass is a start and one replayed token step per column."""
    monkeypatch.setattr(cupy_backend_module, "HELD_OUT_ROWS", 40)
    cfg = CONFIGS[name]
    data = dataset(cfg)
    ref = NumpyBackend(data, ReplicaState.initial(cfg))
    gpu = cupy_backend(cfg, data, VARIANTS[-1], True)
    fitness = np.concatenate([ref.evaluate_chunk(0, c * 8, 8).fitness for c in range(2)])
    ref.apply_step(fitness)
    gpu.apply_step(fitness)
    replays = gpu.kernels.replays
    assert gpu.validate() == ref.validate()
    largest = max(max(shape) for shape in specs_of(cfg))
    for _, bufs in gpu._held_out_graphs.values():  # every matrix's noise: one zero buffer
        noise = [*bufs["a"].values(), *bufs["b"].values()]
        (base,) = {id(n.base): n.base for n in noise}.values()
        assert base.size == len(bufs["pairs"]) * largest and not base.any()
    metrics = [validation_windows(cfg, data.valid)]
    if name != "former":
        metrics.append(validation_streams(cfg, data.valid)[0])
    want = 0
    for rows in metrics:
        steps = rows.shape[1] - 1
        per = max(1, 40 // steps)
        if name == "former":  # its passes also within the forward batch's bound
            per = min(per, gpu.batch_members // 2)
        passes = -(-len(rows) // per)
        want += passes * (1 if name == "former" else 1 + steps)
    assert gpu.kernels.replays - replays == want


@pytest.mark.parametrize(
    "name, stages, tensor_cores", [("adamw", 1, True), ("former-d-eggs", 2, False)]
)
def test_the_update_in_slabs_of_pairs(
    monkeypatch: pytest.MonkeyPatch, name: str, stages: int, tensor_cores: bool
) -> None:
    """With the update's scratch bounded to one or two stages of pairs, Z comes from
    several slabs adding into Z (150 pairs: slabs of 64, 64 and 22 + 42 padding; or of 128
    and a shorter last one of 22 + 42): the reference's changed counts and digests."""
    cfg = CONFIGS[name]
    cfg = cfg.replace(es=dataclasses.replace(cfg.es, population=300, chunk_size=150))
    rows = max(s[0] for s in specs_of(cfg)) + max(s[1] for s in specs_of(cfg))
    monkeypatch.setattr(cupy_backend_module, "UPDATE_SCRATCH_BYTES", rows * 64 * stages + 1)
    data = dataset(cfg)
    ref = NumpyBackend(data, ReplicaState.initial(cfg))
    gpu = cupy_backend(cfg, data, VARIANTS[-1], tensor_cores)
    assert gpu._slab == 64 * stages and cfg.pairs == 150
    rng = np.random.default_rng(4)
    for _ in range(2):
        fitness = rng.integers(-1, 2, size=cfg.pairs).astype(np.int8)
        assert gpu.apply_step(fitness) == ref.apply_step(fitness) > 0
        assert gpu.digest() == ref.digest()


def specs_of(cfg: RunConfig) -> list[tuple[int, ...]]:
    return [s.shape for s in param_specs(cfg.model) if s.kind == "matrix"]


def test_steps_and_digests_copy_no_state_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """An applied step brings back its changed count, a digest 32 bytes a leaf; the state
    comes back only when asked for (a checkpoint), equal to the reference's."""
    cfg = CONFIGS["former-d-eggs"]  # AdamW's moments and the overlays beside the weights
    data = dataset(cfg)
    ref = NumpyBackend(data, ReplicaState.initial(cfg))
    gpu = cupy_backend(cfg, data, VARIANTS[0], True)
    copied: list[int] = []
    host = cupy_backend_module._host

    def counting(xp: object, a: object) -> np.ndarray:
        out = host(xp, a)
        copied.append(out.nbytes)
        return out

    monkeypatch.setattr(cupy_backend_module, "_host", counting)
    leaves = sum(-(-max(t.nbytes, 1) // DIGEST_LEAF) for t in ref.state.tensors())
    for step in range(2):
        fitness = np.concatenate([ref.evaluate_chunk(step, c * 6, 6).fitness for c in range(2)])
        copied.clear()
        assert gpu.apply_step(fitness) == ref.apply_step(fitness)
        assert gpu.digest() == ref.digest()
        assert sorted(copied) == [8, 32 * leaves]
    state_bytes = sum(t.nbytes for t in ref.state.tensors())
    assert gpu.state.digest() == ref.digest() and sum(copied) > state_bytes


def test_a_train_split_past_the_resident_bound_uploads_its_windows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same fitness, with the windows read on the host and uploaded each pass."""
    monkeypatch.setattr(cupy_backend_module, "RESIDENT_TRAIN_BYTES", 100)
    cfg = CONFIGS["former"]
    data = dataset(cfg)
    ref = NumpyBackend(data, ReplicaState.initial(cfg))
    gpu = cupy_backend(cfg, data, VARIANTS[0], True)
    assert gpu._train is None
    want = [ref.evaluate_chunk(0, c * 8, 8) for c in range(2)]
    got = gpu.evaluate_chunks(0, [(c * 8, 8) for c in range(2)])
    assert [g.fitness.tobytes() for g in got] == [w.fitness.tobytes() for w in want]


def test_a_state_loaded_at_the_same_step_has_its_own_digest() -> None:
    cfg = CONFIGS["momentum"]
    data = dataset(cfg)
    gpu = cupy_backend(cfg, data, VARIANTS[0], True)
    first = gpu.digest()
    other = ReplicaState.initial(
        cfg.replace(model=ModelConfig(n_layer=1, d_model=32, vocab_size=64, init_seed=77))
    )
    other = ReplicaState(cfg, 0, other.params, other.opt)
    gpu.load_state(other)
    assert gpu.digest() == other.digest() != first  # fmt: skip


def test_load_state_and_range_checks() -> None:
    cfg = CONFIGS["uniform"]
    data = dataset(cfg)
    ref = NumpyBackend(data, ReplicaState.initial(cfg))
    ref.apply_step(np.ones(cfg.pairs, dtype=np.int8))
    gpu = cupy_backend(cfg, data, VARIANTS[0], True)
    gpu.load_state(ref.state)
    assert gpu.step == 1 and gpu.digest() == ref.digest()
    got, want = gpu.evaluate_chunk(1, 8, 8), ref.evaluate_chunk(1, 8, 8)
    assert (got.fitness.tobytes(), got.loss_sum) == (want.fitness.tobytes(), want.loss_sum)
    with pytest.raises(ValueError, match="replica is at step 1"):
        gpu.evaluate_chunk(0, 0, 8)
    with pytest.raises(ValueError, match="bad member range"):
        gpu.evaluate_chunk(1, 1, 8)
    with pytest.raises(ValueError, match="fitness has shape"):
        gpu.apply_step(np.ones(3, dtype=np.int8))


def test_unsupported_width_is_a_clear_error() -> None:
    cfg = RunConfig(model=ModelConfig(d_model=30), es=ESConfig(population=4, chunk_size=4))
    with pytest.raises(BackendUnavailable, match="d_model % 4"):
        cupy_backend(cfg, dataset(cfg), VARIANTS[0], True)


def test_a_former_batch_past_the_memory_bound_is_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before any allocation; a config that fits gets batches within the bound."""
    from eggroll_dist.worker.backend import cupy_former

    cfg = CONFIGS["former"]
    need = cupy_former.member_bytes(cfg)
    monkeypatch.setattr(cupy_former, "BATCH_BYTES", 2 * need - 1)
    with pytest.raises(BackendUnavailable, match=r"lower es\.seq_len or model\.d_model") as info:
        cupy_backend(cfg, dataset(cfg), VARIANTS[0], True)
    assert "\n" not in str(info.value)
    monkeypatch.setattr(cupy_former, "BATCH_BYTES", 4 * need + 1)
    assert cupy_backend(cfg, dataset(cfg), VARIANTS[0], True).batch_members == 4


def test_adamw_from_the_uniform_config() -> None:
    """AdamW's moments and accumulator on the device, from another config (same bytes)."""
    cfg = CONFIGS["uniform"].replace(update=UpdateConfig(rule="adamw", lr=4.0))
    data = dataset(cfg)
    ref = NumpyBackend(data, ReplicaState.initial(cfg))
    gpu = cupy_backend(cfg, data, VARIANTS[0], True)
    for step in range(2):
        want = [ref.evaluate_chunk(step, c * 8, 8) for c in range(cfg.chunks)]
        got = [gpu.evaluate_chunk(step, c * 8, 8) for c in range(cfg.chunks)]
        assert [g.fitness.tobytes() for g in got] == [w.fitness.tobytes() for w in want]
        fitness = np.concatenate([c.fitness for c in want])
        assert gpu.apply_step(fitness) == ref.apply_step(fitness)
        assert gpu.digest() == ref.digest()
    assert ref.state.opt and any(v.any() for v in ref.state.opt.values())


@pytest.mark.skipif(ON_GPU or cuda_usable(), reason="this host has a usable CUDA GPU")
def test_backend_selection_without_a_gpu() -> None:
    assert get_backend("auto").name == "numpy"
    with pytest.raises(BackendUnavailable, match="needs CuPy and a usable CUDA GPU") as info:
        get_backend("cupy")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("variant", VARIANTS)
def test_reward_generation_gives_the_numpy_backends_tokens(variant: str) -> None:
    """A reward run's completions (the EGG model's generated on the device, the former's by
    the NumPy reference on the host copy of the device's weights): after device updates the
    tokens are the NumPy backend's, for members and for the unperturbed model."""
    cfg = CONFIGS["uniform"]
    data = dataset(cfg)
    ref = NumpyBackend(data, ReplicaState.initial(cfg))
    gpu = cupy_backend(cfg, data, variant, True)
    fitness = np.tile(np.array([1, -1, 0], dtype=np.int8), cfg.pairs)[: cfg.pairs]
    assert gpu.apply_step(fitness) == ref.apply_step(fitness)
    request = Completions(((1, 2, 3), (5,), (7, 8, 9)), (0, 1, 2), 9, SampleSettings(), 8)
    got = gpu.complete(1, (4, 8), request)
    assert got.shape == (8, 3, 8)
    assert np.array_equal(got, ref.complete(1, (4, 8), request))
    assert np.array_equal(gpu.complete(1, None, request), ref.complete(1, None, request))
    # A sample (the coordinator's SAMPLE, eggroll-train's) writes the NumPy backend's bytes.
    ask = TrainingSamples(0, data.valid, data.decoding).request(1)
    assert gpu.write_sample(ask) == ref.write_sample(ask)


def test_compute_capability_majors_of_two_digits() -> None:
    from eggroll_dist.worker.backend.cupy_backend import compute_major

    assert [compute_major(c) for c in ("75", "80", "86", "90", "100", "120")] == [
        7,
        8,
        8,
        9,
        10,
        12,
    ]


@pytest.mark.parametrize("name", ["momentum", "adamw", "egg-adaptive", "former-d-eggs"])
def test_no_replica_maths_on_the_host(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Evaluation, the update of every rule (Z, the rule, the overlays) and both held-out
    metrics are the device's: with the host's models, noise, update and losses made to raise,
    the backend still gives the reference's fitness, changed counts, digests and scores."""
    from eggroll_dist.shared import egg, former, loss, perturb
    from eggroll_dist.shared import update as host_update
    from eggroll_dist.shared.rules import RULES

    cfg = CONFIGS[name]
    if name == "adamw":
        cfg = CONFIGS["momentum"].replace(update=UpdateConfig(rule="adamw", lr=4.0))
    data = dataset(cfg)
    ref = NumpyBackend(data, ReplicaState.initial(cfg))
    size = cfg.es.chunk_size
    chunks = [(c * size, size) for c in range(cfg.chunks)]
    steps = []
    for step in range(3):
        results = [ref.evaluate_chunk(step, *c) for c in chunks]
        fitness = np.concatenate([r.fitness for r in results])
        steps.append((results, fitness, ref.apply_step(fitness), ref.digest()))
    held_out = ref.validate()
    gpu = cupy_backend(cfg, data, VARIANTS[0], True)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the host computed what the device must")

    for module, names in (
        (host_update, ("apply_update", "accumulate_z", "update_from_z")),
        (perturb, ("pair_noise", "member_noise", "noise_scales", "update_overlays")),
        (loss, ("token_loss", "true_bits", "logit_histogram")),
    ):
        for fn in names:
            monkeypatch.setattr(module, fn, refuse)
    monkeypatch.setattr(RULES[cfg.update.rule], "update", refuse)
    for model in (egg.EggModel, former.FormerModel):
        for method in ("__init__", "forward", "position_losses"):
            monkeypatch.setattr(model, method, refuse)
    monkeypatch.setattr(NumpyBackend, "__init__", refuse)
    monkeypatch.setattr(cupy_backend_module, "pair_windows", refuse)  # gathered on the device
    for step, (results, fitness, changed, digest) in enumerate(steps):
        got = gpu.evaluate_chunks(step, chunks)
        assert [(g.fitness.tobytes(), g.loss_sum) for g in got] == [
            (r.fitness.tobytes(), r.loss_sum) for r in results
        ]
        assert gpu.apply_step(fitness) == changed
        assert gpu.digest() == digest
    assert gpu.validate() == held_out
    assert any(v.any() for v in gpu.state.opt.values())
