"""Benchmark a Hugging Face causal LM's population batch: member-tokens/s and peak memory of
EGGROLL members (worker/hf_engine.py: device factors, the fused pass, the static-cache
decode) against the same model's plain batched inference on the same rows.

Three variants over the same prompts, rows (population x prompts) and completion length
(greedy, no stop at end-of-text, so every variant writes rows x tokens member-tokens):
  generate     transformers' `model.generate` on the same left-padded rows
  plain        `PopulationLM.complete` with the population off: our decode engine (one
               prefill, a static cache, on CUDA a replayed CUDA graph per token) on the same
               rows, the reference every figure is given against
  population   `PopulationLM.complete` with members [0, population): the same engine with
               base matmuls shared and each member's rank-r correction added by the fused
               pass; each run is a new step, so its factors are made on the device in the
               call (timed, and also shown on their own)

Speed: one untimed warm-up of each variant, then `--repeats` rounds that run the three one
after the other (so a busy machine slows all of them alike). Each variant's best wall time
gives its member-tokens/s and its ratios to plain and to generate, and the median wall time
is shown beside it. On a CPU the ratio to plain is also taken from the process's CPU seconds
(best of the rounds): with `--threads 1` that is the figure other processes on a shared
machine disturb least. Ratios are to variants measured in the same run. `--no-graph` runs
the engine's decode steps eagerly on CUDA too.

Peak memory: each variant runs once more in a child process of its own, which loads the
model, builds what the variant needs, warms up with 2 tokens, then measures one full run:
on CUDA, max_memory_allocated minus memory_allocated before the run; on a CPU, the peak
resident size (VmHWM, reset through /proc/self/clear_refs) minus the resident size before
the run. CPU children run with glibc's mmap threshold fixed at 64 KiB so that freed tensors
go back to the system rather than stay resident. The analytic sizes of the population's
extra tensors, and of per-member weight copies, are printed beside them.

    python scripts/bench_hf.py MODEL_DIR [--population 64] [--rank 8] [--prompts 4]
        [--tokens 32] [--device cpu|cuda] [--dtype float32|bfloat16] [--repeats 3]
        [--threads N] [--no-memory] [--no-graph]
    python scripts/bench_hf.py --tiny gpt2|llama [--hidden 256] [--layers 4] ...
        (a model built from a config with random weights in a temporary directory)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eggroll_dist.shared import hf
from eggroll_dist.shared.config import ESConfig, ModelConfig, RunConfig
from eggroll_dist.shared.hf_dir import pinned_matrices, require_hf, target_dtype
from eggroll_dist.worker import hf_model as hm

PROMPTS = [
    "The capital of France is",
    "Once upon a time, there was",
    "def fibonacci(n):",
    "Evolution strategies are",
    "The quick brown fox",
    "In a distant galaxy",
    "My favourite recipe uses",
    "The three laws of motion",
]
VARIANTS = ("generate", "plain", "population")
MiB = 2**20


def kv_heads(heads: int) -> int:
    """Grouped-query attention's key/value heads: the largest divisor of `heads` up to a
    quarter of them (14 heads, as at width 896: 2; 16: 4), at least 1."""
    return next(k for k in range(max(1, heads // 4), 0, -1) if heads % k == 0)


def tiny_model(family: str, hidden: int, layers: int, where: Path) -> Path:
    """A random model of the family saved with a byte-level tokenizer (nothing downloaded)."""
    torch, transformers = require_hf()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=["<pad>", "<unk>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(PROMPTS * 50, trainer)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>"
    )
    vocab = len(tokenizer)
    ids = {"bos_token_id": 2, "eos_token_id": 2, "pad_token_id": 0}
    heads = hidden // 64
    if family == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=vocab,
            n_positions=512,
            n_embd=hidden,
            n_layer=layers,
            n_head=heads,
            **ids,
        )
    else:
        config = transformers.LlamaConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=hidden * 4,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads(heads),
            max_position_embeddings=512,
            **ids,
        )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(where)
    tokenizer.save_pretrained(where)
    return where


class Bench:
    """The model, its population wrapper (None for generate alone) and the three variants
    as functions of the number of new tokens."""

    def __init__(self, args: argparse.Namespace, model_dir: Path, population: bool) -> None:
        torch, _ = require_hf()
        self.torch, self.args = torch, args
        self.model = hm.load_causal_lm(model_dir, args.dtype, args.device)
        tokenizer = hm.load_tokenizer(model_dir)
        self.prompts = [tokenizer.encode(t) for t in (PROMPTS * 8)[: args.prompts]]
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.rows = args.population * args.prompts
        self.width = max(len(q) for q in self.prompts)
        with torch.no_grad():  # read every weight: safetensors may map them in lazily
            for w in self.model.parameters():
                w.sum().item()
        gc.collect()
        self.loaded = current_bytes(torch, args.device)
        self.cfg = run_config(model_dir, args.population, args.rank)
        self.targets = hf.targets(self.cfg.model)
        self.lm = hm.PopulationLM(self.model, self.cfg) if population else None
        self.step = 0  # each population run a new step: its factors are made in the call
        gc.collect()
        self.setup = current_bytes(torch, args.device) - self.loaded
        ids = torch.full((self.rows, self.width), self.pad, dtype=torch.long)
        mask = torch.zeros((self.rows, self.width), dtype=torch.long)
        for i, q in enumerate(self.prompts * args.population):
            ids[i, self.width - len(q) :] = torch.tensor(q)
            mask[i, self.width - len(q) :] = 1
        self.ids, self.mask = ids.to(args.device), mask.to(args.device)

    def run(self, variant: str, tokens: int) -> None:
        args, lm = self.args, self.lm
        if variant == "generate":
            with self.torch.no_grad():
                self.model.generate(
                    input_ids=self.ids,
                    attention_mask=self.mask,
                    max_new_tokens=tokens,
                    min_new_tokens=tokens,
                    do_sample=False,
                    pad_token_id=self.pad,
                )
        elif variant == "plain":
            assert lm is not None
            prompts = self.prompts * args.population
            lm.complete(0, None, prompts, tokens, pad_id=self.pad, graph=self.graph)
        else:
            assert lm is not None
            self.step += 1
            members = (0, args.population)
            lm.complete(self.step, members, self.prompts, tokens, pad_id=self.pad, graph=self.graph)
        sync(self.torch, args.device)

    @property
    def graph(self) -> bool | None:
        return False if self.args.no_graph else None

    def factors(self) -> None:
        """Only the population's factors: what `complete` makes before its prefill."""
        assert self.lm is not None
        self.step += 1
        self.lm.engine.factors(self.step, 0, self.args.population)
        sync(self.torch, self.args.device)


def run_config(model_dir: Path, population: int, rank: int) -> RunConfig:
    """An hf run of the directory's model whose targets are its blocks' linear layers (the
    default), one chunk of the whole population."""
    matrices = pinned_matrices(model_dir, (), rank)
    model = ModelConfig(
        arch="hf",
        path=str(model_dir),
        rank=rank,
        matrices=matrices,
        weight_dtype=target_dtype(model_dir, matrices),
    )
    es = ESConfig(population=population, chunk_size=population, sigma=1e-4, run_seed=1)
    return RunConfig(model=model, es=es)


def sync(torch: Any, device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _status(field: str) -> int:
    """A /proc/self/status size in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/self/status has no {field}")


def current_bytes(torch: Any, device: str) -> int:
    """Memory in use now: CUDA's allocated bytes, or the host's resident size."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        return int(torch.cuda.memory_allocated())
    return _status("VmRSS")


def reset_peak(torch: Any, device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return
    with open("/proc/self/clear_refs", "w") as f:  # Linux: 5 resets VmHWM to VmRSS
        f.write("5")
    if _status("VmHWM") > _status("VmRSS") + 4 * MiB:
        raise OSError("the peak resident size did not reset through /proc/self/clear_refs")


def peak_bytes(torch: Any, device: str) -> int:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated())
    return _status("VmHWM")


def timed(run: Callable[[], Any]) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of `run`."""
    t0, c0 = time.perf_counter(), time.process_time()
    run()
    return time.perf_counter() - t0, time.process_time() - c0


def memory_child(args: argparse.Namespace) -> None:
    """One variant's memory, in a process of its own; prints one JSON line."""
    variant = args.memory_child
    bench = Bench(args, args.model_dir, population=variant != "generate")
    torch, device = bench.torch, args.device
    bench.run(variant, 2)  # warm-up on the same rows
    gc.collect()
    reset_peak(torch, device)
    before = current_bytes(torch, device)
    bench.run(variant, args.tokens)
    peak = peak_bytes(torch, device)
    print(json.dumps({"setup": bench.setup, "before": before, "extra": peak - before}))


def measure_memory(args: argparse.Namespace, model_dir: Path, variant: str) -> dict[str, int]:
    command = [sys.executable, os.path.abspath(__file__), str(model_dir)]
    for name in ("population", "rank", "prompts", "tokens", "device", "dtype", "threads"):
        if getattr(args, name) is None:
            continue
        command += [f"--{name}", str(getattr(args, name))]
    command += ["--no-graph"] if args.no_graph else []
    command += ["--memory-child", variant]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="65536")
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"the {variant} memory run failed:\n{done.stderr.strip()}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def analytic(bench: Bench) -> list[tuple[str, int]]:
    """(what, bytes) of the population's extra tensors and their alternatives."""
    args, targets, model = bench.args, bench.targets, bench.model
    size = bench.torch.empty((), dtype=getattr(bench.torch, args.dtype)).element_size()
    members, rank, rows, width = args.population, args.rank, bench.rows, bench.width
    sides = sum(t.shape[0] + t.shape[1] for t in targets)
    weights = sum(t.shape[0] * t.shape[1] for t in targets)
    widest = max(t.shape[0] for t in targets)
    stored = bench.torch.empty((), dtype=getattr(bench.torch, bench.cfg.model.weight_dtype))
    stored = stored.element_size()
    out = [
        (
            f"factors A, B: {members} members x {sides} (out + in, summed over "
            f"{len(targets)} targets) x r {rank}",
            members * sides * rank * size,
        ),
        (
            f"per-member weight copies instead: {members} members x {weights} target weights",
            members * weights * size,
        ),
        (
            f"x @ B at prefill, per target: {rows} rows x {width} positions x r {rank}",
            rows * width * rank * size,
        ),
        (
            f"correction and output + correction at prefill, widest target: 2 x {rows} x "
            f"{width} x {widest}",
            2 * rows * width * widest * size,
        ),
        ("fixed: the replica state, the targets' weights in the files' dtype", weights * stored),
    ]
    config = model.config
    try:
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        length = width + args.tokens
        kv = 2 * config.num_hidden_layers * rows * length * heads * head * size
        out.append((f"for scale, the key-value cache after {length} positions", kv))
    except AttributeError:
        pass
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir", nargs="?", type=Path)
    p.add_argument("--tiny", choices=["gpt2", "llama"])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--population", type=int, default=64)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, help="torch's CPU threads (default: torch's own)")
    p.add_argument("--no-memory", action="store_true", help="skip the memory children")
    p.add_argument("--no-graph", action="store_true", help="no CUDA graph: eager decode steps")
    p.add_argument("--memory-child", choices=VARIANTS, help=argparse.SUPPRESS)
    return p


def model_under_test(
    p: argparse.ArgumentParser, args: argparse.Namespace, tmp: Path
) -> tuple[Path, str]:
    """(model directory, its name in the report): a tiny random model built in `tmp`, or
    MODEL_DIR."""
    if args.tiny:
        if args.hidden < 64 or args.hidden % 64:
            p.error("--hidden must be a multiple of 64 (heads of 64)")
        model_dir = tiny_model(args.tiny, args.hidden, args.layers, tmp)
        return model_dir, f"tiny {args.tiny} (width {args.hidden}, {args.layers} layers, random)"
    if args.model_dir is None:
        p.error("give MODEL_DIR or --tiny")
    return args.model_dir, args.model_dir.name


def print_setup(bench: Bench, name: str) -> None:
    args = bench.args
    params = sum(w.numel() for w in bench.model.parameters())
    targets = sum(t.shape[0] * t.shape[1] for t in bench.targets)
    threads = f", {bench.torch.get_num_threads()} threads" if args.device == "cpu" else ""
    print(
        f"{name}: {params / 1e6:.2f}M parameters, {len(bench.targets)} targets "
        f"({targets / 1e6:.2f}M weights), population {args.population}, rank {args.rank}, "
        f"{args.prompts} prompts (width {bench.width}) x {args.tokens} new tokens = "
        f"{bench.rows} rows, {bench.rows * args.tokens} member-tokens a run; {args.device} "
        f"{args.dtype}{threads}"
    )


def time_variants(bench: Bench) -> tuple[dict[str, list[float]], dict[str, list[float]], float]:
    """(wall seconds, CPU seconds) of each variant per round, and the factors' best time:
    a warm-up of each, then rounds that run the three one after the other."""
    args = bench.args
    for variant in VARIANTS:  # warm-up
        bench.run(variant, args.tokens)
    wall: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(args.repeats):
        for variant in VARIANTS:
            w, c = timed(lambda v=variant: bench.run(v, args.tokens))
            wall[variant].append(w)
            cpu[variant].append(c)
    factors = min(timed(bench.factors)[0] for _ in range(args.repeats))
    return wall, cpu, factors


def print_speed(
    args: argparse.Namespace,
    tokens: int,
    wall: dict[str, list[float]],
    cpu: dict[str, list[float]],
    factors: float,
) -> None:
    on_cpu = args.device == "cpu"
    print(
        f"\nspeed: best of {args.repeats} interleaved rounds; member-tok/s and the ratios from "
        "the best wall times"
        + ("; by CPU: / plain from this process's CPU seconds" if on_cpu else "")
    )
    print(
        f"{'':12s} {'best s':>8s} {'median s':>9s} {'member-tok/s':>13s} {'/ plain':>8s} "
        f"{'/ generate':>11s}" + (f" {'CPU s':>8s} {'by CPU':>7s}" if on_cpu else "")
    )
    best = {v: min(s) for v, s in wall.items()}
    best_cpu = {v: min(s) for v, s in cpu.items()}
    for variant in VARIANTS:
        line = (
            f"{variant:12s} {best[variant]:8.3f} {statistics.median(wall[variant]):9.3f} "
            f"{tokens / best[variant]:13.0f} {best['plain'] / best[variant]:8.2f} "
            f"{best['generate'] / best[variant]:11.2f}"
        )
        if on_cpu:
            line += f" {best_cpu[variant]:8.3f} {best_cpu['plain'] / best_cpu[variant]:7.2f}"
        print(line)
    print(f"the population's factors alone: {factors:.3f} s of its {best['population']:.3f} s")


def print_memory(args: argparse.Namespace, model_dir: Path) -> None:
    how = (
        "max_memory_allocated over the run"
        if args.device.startswith("cuda")
        else "peak resident size over the run"
    )
    print(f"\npeak memory: one child process per variant, {how} minus before it")
    print(f"{'':12s} {'MiB':>8s} {'/ generate':>11s} {'setup MiB':>10s}")
    mem = {v: measure_memory(args, model_dir, v) for v in VARIANTS}
    for variant in VARIANTS:
        m = mem[variant]
        ratio = m["extra"] / max(mem["generate"]["extra"], 1)
        print(f"{variant:12s} {m['extra'] / MiB:8.1f} {ratio:11.2f} {m['setup'] / MiB:10.1f}")
    print(
        "(setup: what building PopulationLM and its initial state added to the loaded "
        "model, before any run)"
    )


def main() -> None:
    p = parser()
    args = p.parse_args()
    if args.threads:
        torch, _ = require_hf()
        torch.set_num_threads(args.threads)
    if args.memory_child:
        memory_child(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, name = model_under_test(p, args, Path(tmp))
        bench = Bench(args, model_dir, population=True)
        print_setup(bench, name)
        wall, cpu, factors = time_variants(bench)
        print_speed(args, bench.rows * args.tokens, wall, cpu, factors)
        if not args.no_memory:
            print_memory(args, model_dir)
        print(f"\nanalytic sizes ({args.dtype})")
        for what, size in analytic(bench):
            print(f"{size / MiB:10.2f} MiB  {what}")


if __name__ == "__main__":
    main()
