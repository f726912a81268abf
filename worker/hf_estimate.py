"""The memory a Hugging Face run needs, from its model's `config.json` alone (no weights read).

`estimate_run` reads the model's shape (widths, layers, heads, vocabulary, the dtype of its
files) through `shared.hf_dir`, lists the linear layers that shape implies (Llama-like
models and GPT-2, named as transformers names them, so `model.targets` globs pick the same
targets as on the real model) and returns an `Estimate`: the bytes on the GPU, on the host
and in a snapshot. Nothing here imports torch: eggroll-tune calls it before anything loads,
to print it (`--estimate`) or to refuse a run that cannot fit.

**The design it models** (worker/hf_model.py, hf_engine.py, hf_update.py). The replica
state is the target weights in the dtype of the model's files (s bytes each); the update
runs on the device. A pass evaluates `batch` members (the PyTorch backend's batch_members,
at most the chunk and the population): rows = batch x rows_per_member (the prompts per
step, or one window for the next-token loss). Factor buffers of all targets stay on the
device for up to FACTOR_SETS member counts (a batch and a remainder). Completions read the
prompts in one prefill, then decode on a static KV cache whose step is a CUDA graph; the
engine keeps up to PLANS such plans (one per rows and cache length, lengths rounded up to
CACHE_STEP), each with its cache and, on a GPU, its graph's memory pool.

GPU bytes (e: the evaluation dtype's bytes, bfloat16 on a GPU; P: the model's parameters):

    weights      P x e
    factors      (batch + remainder) x sum over targets of (out + in) x rank x e
    plans        n x the population's plan, + the held-out prompts' plan while n < PLANS;
                 n = min(PLANS, the prompts' distinct cache lengths, x 2 with a
                 remainder); a plan of `rows` rows and the longest prompt's length:
                   cache  layers x 2 x rows x kv_heads x head_dim x length x e
                   pool   rows x (vocab x (e + GEN_LOGIT_BYTES) + act_width x e), GPU only
    transient    the largest of:
                   making factors   batch x sum (out + in) x rank x FACTOR_INT8_BYTES
                                    + NOISE_TEMP_BYTES x the noise made at once: as many
                                    targets' as CHUNK elements hold, one at least
                   a prefill        rows x prompt x act_width x e + rows x vocab x (e +
                                    GEN_LOGIT_BYTES) (the last position's logits only)
                   a loss pass      rows x tokens x (act_width x e + vocab x (e +
                                    NLL_LOGIT_BYTES)): the next-token objective's batch,
                                    and the validation's VALID_ROWS windows of es.seq_len
                   the update       the largest target's out x in x (8 + s + 1) (Z in
                                    float64, the new bits, the comparison) + the larger of
                                    a block of ROW_ELEMENTS rounded (UPDATE_ROUND_BYTES
                                    each) and FACTOR_ELEMENTS of the pairs' factors made
                                    (NOISE_TEMP_BYTES + UPDATE_FACTOR_BYTES each)
    reserve      CUDA_RESERVE
    act_width    ACT_HIDDEN x hidden + ACT_INTER x intermediate (SDPA's fused attention
                 keeps no tokens x tokens scores)

Host bytes:

    process      the process's resident size when it estimates (at least IMPORT_BYTES, what
                 importing torch and transformers costs) + RUN_BYTES, + CUDA_HOST_BYTES on
                 a GPU
    state        target weights x s: the host copy (the snapshot's and the digest's)
    transient    the largest of: loading (P x the files' bytes: the memory-mapped files
                 read into the model, + P x e when the evaluation dtype differs from the
                 files' on a GPU), a snapshot being written (SNAPSHOT_COPIES x its bytes),
                 a state refresh (a second host copy while a newer one is pulled)
    On a CPU run the GPU's parts but the reserve are the host's too (one transient: the
    largest of both lists).

Snapshot bytes are `shared.replica.checkpoint_bytes` of the run's config with the matrices
the shape implies, the state dtype, and a placeholder of the same length for every digest
`shared.pinned.pin` fills in: the size of the run's snapshot files, byte for byte.

**The constants** are below, in one place. The process's fixed part is measured where it
runs, since it depends on the installation (Python, torch's build, the packages present): its
resident size once torch and transformers were imported (`shared.hf_dir.require_hf`, which
eggroll-tune calls before it estimates). RUN_BYTES, what a run adds to that, is measured: a
2-step eggroll-tune reward run on each tiny model of `tests/hf_models.py`, population 32, on
a CPU (torch 2.13 CPU build, transformers 5.24, Python 3.11), peaked (VmHWM) 103 to 122 MiB
above that size, in two installations whose import sizes differ by 50 MiB; IMPORT_BYTES is
that import's size (238 MiB), for a caller that estimates before importing
them. Those models' own memory is under 5 MiB. The others are not measured (no GPU was at hand),
and are the figures to correct once one is: CUDA_HOST_BYTES is what the CUDA libraries and context
add to a process's resident set; CUDA_RESERVE the CUDA context, cuBLAS workspace and the
caching allocator's fragmentation; ACT_HIDDEN and ACT_INTER the (rows, tokens, width)
tensors alive at a block's peak (residual, norm, attention and the members' corrections;
the MLP's gate, up, their corrections and product); NOISE_TEMP_BYTES six int64
intermediates per noise element made (`worker/torch_noise.py`); FACTOR_INT8_BYTES the
pairs' int8 values, the members' copies and the signed copies; UPDATE_ROUND_BYTES twelve
int64 temporaries per weight rounded, UPDATE_FACTOR_BYTES the float64 factors, F * A
included (`worker/hf_update.py`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, NamedTuple

from ..shared.config import RunConfig
from ..shared.hf import HFError, Target, matrices_of, select_targets
from ..shared.hf_dir import MODEL_FILES, imported_resident, model_folder
from ..shared.objectives import objective_of
from ..shared.prompts import HELD_OUT_EVERY
from ..shared.replica import checkpoint_bytes
from ..shared.run_writer import SNAPSHOTS_KEPT
from .hf_engine import CACHE_STEP, PLANS
from .hf_update import FACTOR_ELEMENTS, ROW_ELEMENTS
from .torch_noise import CHUNK

__all__ = [
    "BATCH_MEMBERS",
    "EVAL_DTYPE",
    "Estimate",
    "EstimateError",
    "ModelShape",
    "Part",
    "Workload",
    "estimate",
    "estimate_run",
    "human",
    "model_shape",
    "read_shape",
    "workload",
]

MiB, GiB = 1 << 20, 1 << 30

# --- the constants of the model of memory (module docstring) ---------------------------------
IMPORT_BYTES = 238 * MiB  # measured: `import torch, transformers` (CPU build), resident
RUN_BYTES = 120 * MiB  # measured: a tiny run's peak above its resident size after them
CUDA_HOST_BYTES = 2 * GiB  # assumed: the CUDA libraries and context in the host's RSS
CUDA_RESERVE = 2 * GiB  # assumed: context, cuBLAS workspace, allocator fragmentation
ACT_HIDDEN = 6  # (rows, tokens, hidden) tensors alive at a block's peak
ACT_INTER = 4  # (rows, tokens, intermediate) tensors alive in the MLP
GEN_LOGIT_BYTES = 32  # per (row, vocab entry) choosing a token: float64 softmax, cdf, min_p
NLL_LOGIT_BYTES = 8  # per (row, token, vocab entry): a float32 copy and its log-softmax
NOISE_TEMP_BYTES = 48  # per noise element being made: six int64 intermediates
FACTOR_INT8_BYTES = 3  # per factor element being made: pairs' values, members', signed
UPDATE_ROUND_BYTES = 96  # per weight of a block of rows being rounded: twelve int64 values
UPDATE_FACTOR_BYTES = 24  # per factor element of the update: float64 A, F * A and B
SNAPSHOT_COPIES = 1  # shared.replica.encode_checkpoint joins the state's bytes once
VALID_ROWS = 64  # windows per validation pass (TorchBackend.validate)
BATCH_MEMBERS = 64  # the PyTorch backend's members per pass (worker/backend get_backend)
DEFAULT_PROMPT_TOKENS = 256  # the prompt length assumed when no prompts file is given
# the evaluation dtype per device, as worker/backend/torch_backend.py's factory chooses it
EVAL_DTYPE = {"cuda": "bfloat16", "cpu": "float32"}
DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}

# model types whose modules are named as Llama's (model.layers.N.self_attn.q_proj ...)
LLAMA_LIKE = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "olmo", "olmo2", "granite"}
)


class EstimateError(ValueError):
    """A model directory whose shape the estimate cannot read; one line."""


@dataclass(frozen=True)
class ModelShape:
    """What the memory of a model depends on, from its config.json."""

    model_type: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    positions: int
    dtype: str  # of the files: the state's dtype
    parameters: int
    linear: tuple[tuple[str, tuple[int, int]], ...]  # (name, (out, in)), in module order


def read_shape(model_dir: Path) -> ModelShape:
    """The shape in `model_dir`/config.json (ModelDirError when it is not a model directory,
    EstimateError when config.json does not describe a model the estimate knows)."""
    path = model_folder(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise EstimateError(f"{path} does not read: {exc}") from None
    if not isinstance(config, dict):
        raise EstimateError(f"{path} is not a JSON object")
    return model_shape(config, str(path))


def model_shape(config: dict[str, Any], where: str = "config.json") -> ModelShape:
    """The shape of a config.json's contents (a Llama-like model or GPT-2)."""
    kind = str(config.get("model_type", ""))
    try:
        if kind == "gpt2":
            return _gpt2(config)
        if kind in LLAMA_LIKE:
            return _llama(config, kind)
    except (KeyError, TypeError, ValueError) as exc:
        raise EstimateError(f"{where} lacks a size the estimate needs ({exc})") from None
    known = ", ".join(sorted({"gpt2", *LLAMA_LIKE}))
    raise EstimateError(f"{where}: no memory estimate for model_type {kind!r} (known: {known})")


def _dtype(config: dict[str, Any]) -> str:
    name = config.get("torch_dtype") or config.get("dtype") or "float32"
    name = str(name).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype {name!r}")
    return name


def _llama(c: dict[str, Any], kind: str) -> ModelShape:
    h, inter, n, heads = (
        int(c["hidden_size"]),
        int(c["intermediate_size"]),
        int(c["num_hidden_layers"]),
        int(c["num_attention_heads"]),
    )
    kv = int(c.get("num_key_value_heads") or heads)
    hd = int(c.get("head_dim") or h // heads)
    vocab = int(c["vocab_size"])
    tied = bool(c.get("tie_word_embeddings", kind.startswith("gemma")))
    qkv_bias = bool(c.get("attention_bias", False)) or kind == "qwen2"
    o_bias, mlp_bias = bool(c.get("attention_bias", False)), bool(c.get("mlp_bias", False))
    linear: list[tuple[str, tuple[int, int]]] = []
    for i in range(n):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        linear += [
            (a + "q_proj", (heads * hd, h)),
            (a + "k_proj", (kv * hd, h)),
            (a + "v_proj", (kv * hd, h)),
            (a + "o_proj", (h, heads * hd)),
            (m + "gate_proj", (inter, h)),
            (m + "up_proj", (inter, h)),
            (m + "down_proj", (h, inter)),
        ]
    linear.append(("lm_head", (vocab, h)))
    biases = n * ((heads + 2 * kv) * hd * qkv_bias + h * o_bias + (2 * inter + h) * mlp_bias)
    norms = (2 * n + 1) * h
    weights = sum(o * i for name, (o, i) in linear if name != "lm_head" or not tied)
    return ModelShape(
        kind, h, inter, n, heads, kv, hd, vocab, int(c.get("max_position_embeddings") or 0),
        _dtype(c), vocab * h + weights + biases + norms, tuple(linear),
    )  # fmt: skip


def _gpt2(c: dict[str, Any]) -> ModelShape:
    h, n, heads = int(c["n_embd"]), int(c["n_layer"]), int(c["n_head"])
    inter = int(c.get("n_inner") or 4 * h)
    vocab, positions = int(c["vocab_size"]), int(c.get("n_positions") or 1024)
    linear: list[tuple[str, tuple[int, int]]] = []
    for i in range(n):
        b = f"transformer.h.{i}."
        linear += [
            (b + "attn.c_attn", (3 * h, h)),
            (b + "attn.c_proj", (h, h)),
            (b + "mlp.c_fc", (inter, h)),
            (b + "mlp.c_proj", (h, inter)),
        ]
    linear.append(("lm_head", (vocab, h)))
    tied = bool(c.get("tie_word_embeddings", True))
    block = sum(o * i + o for name, (o, i) in linear[:4]) + 4 * h  # + biases, two layer norms
    head = 0 if tied else vocab * h
    params = (vocab + positions) * h + n * block + 2 * h + head
    return ModelShape(
        "gpt2", h, inter, n, heads, heads, h // heads, vocab, positions, _dtype(c), params,
        tuple(linear),
    )  # fmt: skip


@dataclass(frozen=True)
class Workload:
    """What a run asks of one process: its passes' sizes, its device and dtype."""

    device: str  # "cuda" or "cpu"
    eval_dtype: str
    population: int
    rank: int
    batch: int  # members per pass
    remainder: int  # members of a chunk's last, smaller pass (0: none)
    rows_per_member: int  # prompts per step (reward), 1 (next-token loss)
    prompt_tokens: int  # the longest prompt (reward) or es.seq_len (next-token loss)
    new_tokens: int  # completion tokens (0: the next-token loss, no generation)
    cache_lengths: int  # the distinct cache lengths the prompts lead to (CACHE_STEP apart)
    held_out_rows: int  # held-out prompts the unperturbed model continues at once
    valid_rows: int  # windows of es.seq_len a validation pass scores (0: none)
    seq_len: int


def workload(
    cfg: RunConfig,
    device: str,
    prompt_lengths: Sequence[int] = (),
    batch_members: int = BATCH_MEMBERS,
    context: int = 0,
) -> Workload:
    """The workload of an hf run config on `device` ("cuda" or "cpu"): `prompt_lengths` the
    tokens of each prompt of the prompts file (none: every prompt DEFAULT_PROMPT_TOKENS
    long), `context` the model's positions (0: unknown)."""
    es, f = cfg.es, cfg.fitness
    batch = min(batch_members - batch_members % 2, es.chunk_size, es.population)
    reward = f.objective == "reward"
    lengths = list(prompt_lengths) or [DEFAULT_PROMPT_TOKENS]
    if context:  # a longer prompt is refused by the run: it never reaches a pass
        lengths = [min(n, max(1, context - f.completion_tokens)) for n in lengths]
    buckets = {-(-(n + f.completion_tokens) // CACHE_STEP) for n in lengths}
    held = f.held_out_prompts
    if prompt_lengths:  # every HELD_OUT_EVERY-th prompt is held out
        held = min(held, len(prompt_lengths) // HELD_OUT_EVERY)
    return Workload(
        device=device,
        eval_dtype=EVAL_DTYPE[device],
        population=es.population,
        rank=cfg.model.rank,
        batch=batch,
        remainder=es.chunk_size % batch,
        rows_per_member=f.prompts_per_step if reward else 1,
        prompt_tokens=max(lengths) if reward else es.seq_len,
        new_tokens=f.completion_tokens if reward else 0,
        cache_lengths=len(buckets),
        held_out_rows=held if reward else 0,
        valid_rows=min(VALID_ROWS, -(-cfg.validation.max_tokens // es.seq_len)),
        seq_len=es.seq_len,
    )


class Part(NamedTuple):
    """One part of an estimate: its name, bytes, a note, and whether the batch's settings
    change it (else only the model, its targets or the machine do)."""

    name: str
    bytes: int
    note: str = ""
    batch: bool = False


@dataclass(frozen=True)
class Estimate:
    """Bytes on the GPU (no parts on a CPU run), on the host and in one snapshot."""

    about: tuple[str, ...]  # the model and the run, a line each
    device: str
    gpu: tuple[Part, ...]
    host: tuple[Part, ...]
    snapshot_bytes: int
    lower: str  # the settings that shrink the batch's parts, for a refusal

    @property
    def gpu_bytes(self) -> int:
        return sum(p.bytes for p in self.gpu)

    @property
    def host_bytes(self) -> int:
        return sum(p.bytes for p in self.host)

    def part(self, name: str) -> int:
        """The bytes of a part by name (0 when there is none)."""
        return sum(p.bytes for p in self.gpu + self.host if p.name == name)

    def lines(self) -> list[str]:
        """The estimate as lines for a terminal."""

        def parts(items: Sequence[Part]) -> str:
            return ", ".join(
                f"{p.name} {human(p.bytes)}" + (f" ({p.note})" if p.note else "")
                for p in items
                if p.bytes
            )

        out = [f"{key:<10}{line}" for key, line in zip(("model", "run"), self.about, strict=True)]
        if self.gpu:
            out.append(f"{'GPU':<10}{human(self.gpu_bytes)}: {parts(self.gpu)}")
        out.append(f"{'host':<10}{human(self.host_bytes)}: {parts(self.host)}")
        kept = self.snapshot_bytes * SNAPSHOTS_KEPT
        out.append(
            f"{'snapshot':<10}{human(self.snapshot_bytes)} each, the newest {SNAPSHOTS_KEPT} "
            f"kept: {human(kept)} on disk"
        )
        return out

    def shortfall(self, free_gpu: int | None, free_host: int | None) -> str | None:
        """None when the run fits the free memory given (None: unknown, taken to fit), else
        one line saying what does not fit and which setting to lower."""
        for where, parts, free, bigger in (
            ("GPU", self.gpu, free_gpu, "a GPU with more memory"),
            ("host", self.host, free_host, "a machine with more memory"),
        ):
            need = sum(p.bytes for p in parts)
            if not parts or free is None or need <= free:
                continue
            fixed = sum(p.bytes for p in parts if not p.batch)
            hint = f"use a smaller model or {bigger}" if fixed > free else self.lower
            if where == "host" and fixed > free and self.gpu:
                hint = f"use a smaller model, fewer --target matrices or {bigger}"
            return (
                f"the run needs about {human(need)} of {where} memory, more than the "
                f"{human(free)} free: {hint}"
            )
        return None


def estimate(
    shape: ModelShape, work: Workload, targets: Sequence[Target], snapshot: int
) -> Estimate:
    """The estimate of a workload on a model of this shape training these targets (the
    module docstring's arithmetic)."""
    e, s = DTYPE_BYTES[work.eval_dtype], DTYPE_BYTES[shape.dtype]
    cuda = work.device == "cuda"
    side = sum(sum(t.shape) for t in targets) * work.rank  # factor elements per member
    factors = (work.batch + work.remainder) * side * e
    plans, plan_note = _plans(shape, work, e, cuda)
    transient = max(_transients(shape, work, targets, e, s, side), key=lambda p: p.bytes)
    state = sum(t.shape[0] * t.shape[1] for t in targets) * s
    gpu = [
        Part("weights", shape.parameters * e),
        Part("factors", factors, f"{work.batch} members", batch=True),
        Part("KV caches and graphs", plans, plan_note, batch=True),
    ]
    converted = shape.parameters * e if cuda and e != s else 0
    host_transients = [
        Part("loading", shape.parameters * s + converted),
        Part("snapshot writing", snapshot * SNAPSHOT_COPIES),
        Part("state refresh", state, "a second copy while a newer one is pulled"),
    ]
    process = process_bytes() + (CUDA_HOST_BYTES if cuda else 0)
    host = [Part("process", process), Part("state", state, f"{shape.dtype} targets")]
    if cuda:
        gpu += [transient, Part("reserve", CUDA_RESERVE)]
        host.append(max(host_transients, key=lambda p: p.bytes))
    else:  # the evaluation's memory is the host's: one transient for both lists
        host += [*gpu, max([*host_transients, transient], key=lambda p: p.bytes)]
        gpu = []
    return Estimate(
        _about(shape, work, targets), work.device, tuple(gpu), tuple(host), snapshot,
        _lower(work, factors, plans),
    )  # fmt: skip


def _plans(shape: ModelShape, work: Workload, e: int, cuda: bool) -> tuple[int, str]:
    """The decode plans' bytes: up to PLANS caches (and graph pools on a GPU), one per
    (rows, cache length, member count) the run's calls have, the held-out prompts' too."""
    if not work.new_tokens:
        return 0, ""
    length = -(-(work.prompt_tokens + work.new_tokens) // CACHE_STEP) * CACHE_STEP

    def plan(rows: int) -> int:
        cache = shape.layers * 2 * rows * shape.kv_heads * shape.head_dim * length * e
        pool = rows * (shape.vocab * (e + GEN_LOGIT_BYTES) + _width(shape) * e)
        return cache + (pool if cuda else 0)

    big = plan(work.batch * work.rows_per_member)
    count = min(PLANS, work.cache_lengths * (2 if work.remainder else 1))
    held = plan(work.held_out_rows) if count < PLANS and work.held_out_rows else 0
    note = f"{count} of {human(big)}" + (f" and held-out {human(held)}" if held else "")
    return count * big + held, note


def _width(shape: ModelShape) -> int:
    """Values per row and token alive at a block's peak."""
    return ACT_HIDDEN * shape.hidden + ACT_INTER * shape.intermediate


def _transients(
    shape: ModelShape, work: Workload, targets: Sequence[Target], e: int, s: int, side: int
) -> list[Part]:
    """The passes' short-lived peaks, and the update's (module docstring)."""
    rows = work.batch * work.rows_per_member
    pairs = -(-work.batch // 2) + 1  # a batch may start at an odd member
    # stream_values makes whole targets' noise, as many as CHUNK elements hold (one at least)
    made = max(min(CHUNK, pairs * side), pairs * max(sum(t.shape) for t in targets) * work.rank)
    making = work.batch * side * FACTOR_INT8_BYTES + made * NOISE_TEMP_BYTES
    out = [Part("making factors", making, batch=True)]

    def prefill(n: int) -> int:
        return n * work.prompt_tokens * _width(shape) * e + n * shape.vocab * (e + GEN_LOGIT_BYTES)

    def loss(n: int, tokens: int) -> int:
        return n * tokens * (_width(shape) * e + shape.vocab * (e + NLL_LOGIT_BYTES))

    if work.new_tokens:
        out.append(Part("prefill", prefill(rows), f"{rows} rows", batch=True))
        out.append(Part("held-out prefill", prefill(work.held_out_rows), batch=True))
    else:
        out.append(Part("loss pass", loss(rows, work.seq_len), f"{rows} rows", batch=True))
    out.append(Part("validation pass", loss(work.valid_rows, work.seq_len), batch=True))
    big = max(targets, key=lambda t: t.shape[0] * t.shape[1])
    pairs_all = work.population // 2
    out_, in_ = big.shape
    rounding = min(out_, max(1, ROW_ELEMENTS // in_)) * in_ * UPDATE_ROUND_BYTES
    noise = min(FACTOR_ELEMENTS, pairs_all * (out_ + in_) * work.rank)
    z = out_ * in_ * (8 + s + 1) + max(rounding, noise * (NOISE_TEMP_BYTES + UPDATE_FACTOR_BYTES))
    out.append(Part("update", z, f"{big.name}"))
    return out


def _about(shape: ModelShape, work: Workload, targets: Sequence[Target]) -> tuple[str, str]:
    weights = sum(t.shape[0] * t.shape[1] for t in targets)
    model = (
        f"{shape.model_type}, {_count(shape.parameters)} weights in {shape.dtype}; "
        f"{len(targets)} targets ({_count(weights)} weights), rank {work.rank}"
    )
    tokens = (
        f"prompts of {work.prompt_tokens} + {work.new_tokens} new tokens"
        if work.new_tokens
        else f"windows of {work.seq_len} tokens"
    )
    run = (
        f"{work.device} in {work.eval_dtype}: {work.batch} members a pass x "
        f"{work.rows_per_member} rows, {tokens}"
    )
    return model, run


def _count(n: int) -> str:
    """A count in thousands, millions or billions, 3 significant digits."""
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return str(n)


def _lower(work: Workload, factors: int, plans: int) -> str:
    """The eggroll-tune flags that shrink the batch's parts, the likeliest first."""
    flags = ["--prompts-per-step", "--completion-tokens"] if work.new_tokens else ["--seq-len"]
    if factors > plans:
        flags.insert(0, "--rank")
    if work.batch == work.population:  # the population bounds the batch
        flags.insert(0, "--population")
    return "lower " + ", ".join(flags[:-1]) + " or " + flags[-1]


# --- the run: config.json, its targets and the snapshot's bytes ------------------------------


def estimate_run(
    model_dir: Path,
    cfg: RunConfig,
    device: str,
    prompt_lengths: Sequence[int] = (),
    batch_members: int = BATCH_MEMBERS,
) -> Estimate:
    """The estimate of an hf run config (not pinned) whose model is in `model_dir`, its
    prompts `prompt_lengths` tokens long (`workload`). EstimateError when the shape is
    unknown or the targets do not fit the model."""
    shape = read_shape(model_dir)
    try:
        targets = select_targets(shape.linear, cfg.model.targets, cfg.model.rank)
    except HFError as exc:
        raise EstimateError(str(exc)) from None
    work = workload(cfg, device, prompt_lengths, batch_members, shape.positions)
    snapshot = snapshot_bytes(cfg, model_dir, targets, shape.dtype)
    return estimate(shape, work, targets, snapshot)


ZERO_DIGEST = "0" * 64


def snapshot_bytes(cfg: RunConfig, model_dir: Path, targets: Sequence[Target], dtype: str) -> int:
    """`checkpoint_bytes` of the config as `shared.pinned.pin` would make it: these targets
    as its matrices in `dtype`, and a digest of the same length for every file it pins."""
    names = sorted(
        f.name
        for f in Path(model_dir).iterdir()
        if f.is_file() and any(fnmatchcase(f.name, p) for p in MODEL_FILES)
    )
    digests: dict[str, Any] = {}
    for goal in objective_of(cfg).files(cfg):
        key = goal.key.split(".")[1]
        many = isinstance(getattr(cfg.fitness, key), tuple)  # one digest per file, in order
        digests[key] = (*digests.get(key, ()), ZERO_DIGEST) if many else ZERO_DIGEST
    fitness = replace(cfg.fitness, **digests)
    model = replace(
        cfg.model,
        matrices=matrices_of(targets),
        files=tuple(f"{ZERO_DIGEST} {name}" for name in names),
        weight_dtype=dtype,
    )
    return checkpoint_bytes(cfg.replace(model=model, fitness=fitness))


def process_bytes() -> int:
    """The process's fixed part: its resident size once torch and transformers were imported
    (`shared.hf_dir.require_hf`; before that, IMPORT_BYTES) + RUN_BYTES."""
    return (imported_resident() or IMPORT_BYTES) + RUN_BYTES


def human(n: int) -> str:
    """Bytes in binary units, 3 significant digits or so."""
    for unit, size in (("TiB", 1 << 40), ("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
