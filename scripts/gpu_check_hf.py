"""The Hugging Face parts of `scripts/gpu_check.py hf`, each run in its own process on the
GPU machine (nothing to carry but the checkout and the wheelhouse: the model is built there
with random weights):

  hf-exact  the PyTorch tests of the hf replica on the device (tests/test_hf_state.py and
            tests/test_torch_noise.py: the update rule, Z and the noise on CUDA against
            NumPy, bit for bit), then the device-made factors of a 0.5B-class Llama's
            targets against `shared.hf.member_factors`, and greedy completions with the
            decode step captured as a CUDA graph against the same steps run eagerly
  hf-tune   that Llama (width 896, 24 layers) saved in bfloat16; `eggroll-tune` for STEPS
            steps on CUDA (its member-tokens/s and peak GPU memory beside its own
            `--estimate`); then its fitness log replayed on the CPU by the NumPy reference
            from the model's files: the digests must be equal
  hf-bench  scripts/bench_hf.py on the same shape, bfloat16, population 64, rank 8, 4
            prompts x 32 tokens: transformers' generate, our plain decode, the population

    python scripts/gpu_check_hf.py exact|tune|bench LOG_DIR
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

HIDDEN, LAYERS = 896, 24  # the blocks of a 0.5B-class model
STEPS = 4
TUNE_FLAGS = ["--population", "64", "--rank", "8", "--prompts-per-step", "4"]
TUNE_FLAGS += ["--completion-tokens", "32", "--reward", "builtin:letter_e"]
EXACT_TESTS = ["tests/test_hf_state.py", "tests/test_torch_noise.py"]


def _cuda() -> object | None:
    import torch

    return torch if torch.cuda.is_available() else None


def model(log_dir: Path) -> Path:
    """The random Llama of HIDDEN x LAYERS, saved in bfloat16 under LOG_DIR (made once)."""
    import torch
    import transformers
    from bench_hf import tiny_model

    out = log_dir / "hf-model"
    if (out / "config.json").is_file():
        return out
    built = tiny_model("llama", HIDDEN, LAYERS, log_dir / "hf-build")
    lm = transformers.AutoModelForCausalLM.from_pretrained(built, dtype=torch.bfloat16)
    lm.save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(built).save_pretrained(out)
    return out


def exact(log_dir: Path) -> int:
    torch = _cuda()
    if torch is None:
        print("no CUDA device")
        return 2
    tests = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *EXACT_TESTS]
    if subprocess.run(tests, cwd=ROOT).returncode:
        print("FAIL: the hf replica's tests on CUDA")
        return 1
    from bench_hf import run_config

    from eggroll_dist.shared import hf
    from eggroll_dist.worker import hf_model as hm
    from eggroll_dist.worker import torch_noise

    path = model(log_dir)
    cfg = run_config(path, 64, 8)
    targets = hf.targets(cfg.model)
    made = torch_noise.member_factors(cfg, 3, targets, 0, 64, "cuda", host=False)
    for t, (a, b) in zip(targets, made, strict=True):
        ra, rb = hf.member_factors(cfg, 3, t, 0, 64)
        if not (np.array_equal(a.cpu().numpy(), ra) and np.array_equal(b.cpu().numpy(), rb)):
            print(f"FAIL: the device factors of {t.name} differ from NumPy's")
            return 1
    print(f"device factors of {len(targets)} targets x 64 members equal NumPy's")
    lm = hm.PopulationLM(hm.load_causal_lm(path, "bfloat16", "cuda"), cfg)
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]
    eager = lm.complete(0, (0, 16), prompts, 16, graph=False)
    graph = lm.complete(0, (0, 16), prompts, 16, graph=True)
    again = lm.complete(0, (0, 16), prompts, 16, graph=True)
    if not (np.array_equal(eager, graph) and np.array_equal(graph, again)):
        print(f"FAIL: graph decode differs from eager on {int((eager != graph).sum())} tokens")
        return 1
    print("the CUDA-graph decode writes the eager decode's tokens, twice")
    return 0


def tune(log_dir: Path) -> int:
    torch = _cuda()
    if torch is None:
        print("no CUDA device")
        return 2
    from eggroll_dist.protocol.ternary import unpack_ternary
    from eggroll_dist.shared.hf_dir import base_state
    from eggroll_dist.shared.replica import load_checkpoint
    from eggroll_dist.shared.save_dir import SaveDir

    path, save = model(log_dir), log_dir / "hf-run"
    prompts = log_dir / "prompts.txt"  # a reward run samples from prompts
    prompts.write_text("".join(f"Write a sentence about the number {i}.\n" for i in range(32)))
    base = [sys.executable, "-c", "from eggroll_dist.worker.tune import main; main()"]
    estimate = subprocess.run(  # its own process: the estimate loads nothing
        [*base, str(path), "--estimate", *TUNE_FLAGS, "--prompts", str(prompts)],
        capture_output=True,
        text=True,
    )
    print(estimate.stdout.strip())
    from eggroll_dist.worker.tune import main as tune_main

    summary_file = log_dir / "hf-summary.json"
    flags = [
        str(path),
        *TUNE_FLAGS,
        "--prompts",
        str(prompts),
        "--steps",
        str(STEPS),
        "--save-dir",
        str(save),
    ]
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    try:  # in this process, so that its peak GPU memory can be read
        tune_main([*flags, "--summary-json", str(summary_file)], standalone_mode=False)
    except SystemExit as exc:
        if exc.code:
            print(f"FAIL: eggroll-tune exited {exc.code}")
            return 1
    gib = 2**30
    peak = torch.cuda.max_memory_reserved() / gib, torch.cuda.max_memory_allocated() / gib
    print(f"peak GPU memory: {peak[0]:.2f} GiB reserved, {peak[1]:.2f} GiB allocated")
    summary = json.loads(summary_file.read_text())
    print(f"eggroll-tune: {STEPS} steps in {time.perf_counter() - t0:.1f} s, summary {summary}")
    run = SaveDir.open(save)
    final = load_checkpoint(run.layout.snapshot(STEPS))
    cpu = run.replay_from(base_state(final.config, path), STEPS, unpack_ternary)
    same = cpu.digest() == final.digest()
    print(f"GPU digest {final.digest_hex()}, NumPy replay {cpu.digest_hex()}: {same}")
    return 0 if same else 1


def bench(log_dir: Path) -> int:
    if _cuda() is None:
        print("no CUDA device")
        return 2
    args = ["--tiny", "llama", "--hidden", str(HIDDEN), "--layers", str(LAYERS)]
    args += ["--device", "cuda", "--dtype", "bfloat16", "--population", "64", "--rank", "8"]
    args += ["--prompts", "4", "--tokens", "32", "--repeats", "3"]
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_hf.py"), *args]).returncode


PARTS = {"exact": exact, "tune": tune, "bench": bench}

if __name__ == "__main__":
    sys.exit(PARTS[sys.argv[1]](Path(sys.argv[2]).resolve()))
