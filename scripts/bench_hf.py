"""Benchmark a Hugging Face causal LM's population batch: member-tokens/s and peak memory of
EGGROLL members (worker/hf_model.py, low-rank hooks) against the same model's plain batched
inference on the same rows.

Three runs over the same prompts, rows and completion length (greedy, so every run writes
the same number of tokens):
  population   `PopulationLM.complete` with members [0, population): base matmuls shared,
               each member's rank-r correction added by the hooks
  unperturbed  the same generation loop with the hooks idle (what the corrections cost)
  generate     transformers' `model.generate` on the same left-padded rows (plain inference)
Peak memory is CUDA's max_memory_allocated per run on a GPU; on a CPU, the process's peak
resident size after each run (monotonic: it shows growth only).

    python scripts/bench_hf.py MODEL_DIR [--population 64] [--rank 8] [--prompts 4]
        [--tokens 32] [--device cpu|cuda] [--dtype float32|bfloat16] [--repeats 2]
    python scripts/bench_hf.py --tiny gpt2|llama [--hidden 256] [--layers 4] ...
        (a model built from a config with random weights in a temporary directory)
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

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


def tiny_model(family: str, hidden: int, layers: int, where: Path) -> Path:
    """A random model of the family saved with a byte-level tokenizer (nothing downloaded)."""
    torch, transformers = hm.require_hf()
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
    if family == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=vocab,
            n_positions=512,
            n_embd=hidden,
            n_layer=layers,
            n_head=hidden // 64,
            **ids,
        )
    else:
        config = transformers.LlamaConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=hidden * 4,
            num_hidden_layers=layers,
            num_attention_heads=hidden // 64,
            num_key_value_heads=max(1, hidden // 256),
            max_position_embeddings=512,
            **ids,
        )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(where)
    tokenizer.save_pretrained(where)
    return where


def measure(run: Callable[[], Any], device: str, repeats: int) -> tuple[float, float]:
    """(best seconds, peak MiB) of `run`."""
    torch, _ = hm.require_hf()
    best = float("inf")
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    if device.startswith("cuda"):
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return best, peak


def main() -> None:
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
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    torch, _ = hm.require_hf()
    with tempfile.TemporaryDirectory() as tmp:
        if args.tiny:
            model_dir = tiny_model(args.tiny, args.hidden, args.layers, Path(tmp))
        elif args.model_dir is None:
            p.error("give MODEL_DIR or --tiny")
        else:
            model_dir = args.model_dir
        model = hm.load_causal_lm(model_dir, args.dtype, args.device)
        tokenizer = hm.load_tokenizer(model_dir)
        spec = hm.spec_for(model, args.rank, seed=1, pairs=args.population // 2, sigma=1e-4)
        lm = hm.PopulationLM(model, spec)
        prompts = [tokenizer.encode(t) for t in (PROMPTS * 8)[: args.prompts]]
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        rows = args.population * args.prompts
        tokens = rows * args.tokens
        params = sum(w.numel() for w in model.parameters())
        targets = sum(t.shape[0] * t.shape[1] for t in spec.targets)
        print(
            f"{model_dir.name}: {params / 1e6:.1f}M parameters, {len(spec.targets)} targets "
            f"({targets / 1e6:.1f}M), population {args.population}, rank {args.rank}, "
            f"{args.prompts} prompts x {args.tokens} tokens, {args.device} {args.dtype}"
        )

        def population() -> None:
            lm.complete(0, (0, args.population), prompts, args.tokens, pad_id=pad)

        def unperturbed() -> None:
            lm.complete(0, None, prompts * args.population, args.tokens, pad_id=pad)

        width = max(len(q) for q in prompts)
        ids = torch.full((rows, width), pad, dtype=torch.long)
        mask = torch.zeros((rows, width), dtype=torch.long)
        for i, q in enumerate(prompts * args.population):
            ids[i, width - len(q) :] = torch.tensor(q)
            mask[i, width - len(q) :] = 1
        ids, mask = ids.to(args.device), mask.to(args.device)

        def generate() -> None:
            with torch.no_grad():
                model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=args.tokens,
                    min_new_tokens=args.tokens,
                    do_sample=False,
                    pad_token_id=pad,
                )

        results = {}
        for name, run in (
            ("generate", generate),
            ("unperturbed", unperturbed),
            ("population", population),
        ):
            seconds, peak = measure(run, args.device, args.repeats)
            results[name] = tokens / seconds
            print(f"{name:12s} {tokens / seconds:12.0f} member-tokens/s  peak {peak:9.1f} MiB")
        ratio = results["population"] / results["generate"]
        print(f"population / generate: {ratio:.2f}")
        print(f"population / unperturbed: {results['population'] / results['unperturbed']:.2f}")
        print(f"(factors per member: {np.mean([sum(t.shape) for t in spec.targets]):.0f} x r)")


if __name__ == "__main__":
    main()
