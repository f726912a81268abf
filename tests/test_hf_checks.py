"""Checked Hugging Face results, in real processes on a tiny GPT-2: a PyTorch worker
evaluating in float32 and one in bfloat16 agree on enough pairs of every chunk to confirm
each other, and a worker that flips its fitness signs is outvoted by them."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import Proc
from helpers import command, start_coordinator, start_worker
from hf_models import save_model

from eggroll_dist.shared.save_dir import SaveDir

# Enough steps that the liar, the last to load its model, gets chunks to lie about
# whichever worker leases first (a step has two chunks for three workers).
STEPS = 20

# A real PyTorch worker whose backend evaluates in `DTYPE` whatever its device, and flips
# every fitness sign when `FLIP` (replaying the log, it applies the run's steps like anyone).
WORKER = """
import sys
from eggroll_dist.worker.backend import ChunkResult, torch_backend
from eggroll_dist.worker.cli import main
DTYPE, FLIP = sys.argv.pop(1), sys.argv.pop(1) == "flip"
cls = torch_backend.TorchBackend
init, evaluate = cls.__init__, cls.evaluate_chunks
def init_in(self, dataset, state, path, device, dtype, *rest):
    init(self, dataset, state, path, device, DTYPE, *rest)
def flipped(self, step, chunks):
    return [ChunkResult(-r.fitness, r.loss_sum) for r in evaluate(self, step, chunks)]
cls.__init__ = init_in
if FLIP:
    cls.evaluate_chunks = flipped
sys.exit(main())
"""


def test_float32_and_bfloat16_workers_agree_and_a_sign_flipper_is_outvoted(
    spawn: Callable[..., Any], words_data: Path, tmp_path: Path
) -> None:
    save_model(tmp_path / "model", "gpt2", initializer_range=0.3)
    printed = subprocess.run(
        [command("eggroll-tune"), "model", "--reward", "perplexity", "--data-dir", words_data,
         "--population", "64", "--chunk-size", "32", "--rank", "2", "--sigma", "0.05",
         "--lr", "2", "--print-config"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert printed.returncode == 0, printed.stderr
    config, save = tmp_path / "run.toml", tmp_path / "run"
    config.write_text(printed.stdout)
    coord, port = start_coordinator(
        spawn, save, config, "--verify-fraction", "1", "--max-steps", str(STEPS)
    )
    goal = ("--backend", "torch", "--goal-dir", str(tmp_path), "--threads", "1")
    start_worker(spawn, port, words_data, "fp32", *goal)

    def worker(name: str, dtype: str, flip: str) -> Proc:
        flags = ("--data-dir", str(words_data), "--name", name, "--log-format", "json")
        args = [sys.executable, "-c", WORKER, dtype, flip, f"127.0.0.1:{port}", *flags, *goal]
        return Proc(args, name)

    bf16, liar = worker("bf16", "bfloat16", "honest"), worker("liar", "float32", "flip")
    try:
        outvoted = coord.wait_for(lambda e: e.get("event") == "worker outvoted", 240, "outvoted")
        assert outvoted["worker"] == "liar"
        assert coord.wait(300) == 0
    finally:
        bf16.stop()
        liar.stop()
    losers = {e["worker"] for e in coord.events if e.get("event") == "worker outvoted"}
    assert losers == {"liar"}  # the two dtypes never lost a vote to each other
    assert coord.count(lambda e: e.get("event") == "results differ: the run stops") == 0
    assert SaveDir.open(save).steps == STEPS
