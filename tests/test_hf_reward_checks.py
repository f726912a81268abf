"""Checked Hugging Face reward runs, in real processes on a tiny GPT-2: each result comes
with its members' completions (CLAIM), and a checker reads them with its own copy of those
members. A float32 and a bfloat16 worker confirm each other's results; a worker that flips
the fitness of honest completions, or that claims completions its members did not write, is
outvoted."""

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
from hf_models import save_model, trained

from eggroll_dist.shared.save_dir import SaveDir

STEPS = 12

# A real PyTorch worker whose backend evaluates in DTYPE whatever its device. LIE "flip":
# honest completions, every fitness sign flipped; "swap": each member's claimed completions
# are another member's (member 2k+2's for 2k), their fitness computed honestly.
WORKER = """
import sys
import numpy as np
from eggroll_dist.worker import objective
from eggroll_dist.worker.backend import ChunkResult, torch_backend
from eggroll_dist.worker.cli import main
DTYPE, LIE = sys.argv.pop(1), sys.argv.pop(1)
cls = torch_backend.TorchBackend
init, complete, evaluate = cls.__init__, cls.complete, objective.Reward.evaluate_chunks
def init_in(self, dataset, state, path, device, dtype, *rest):
    init(self, dataset, state, path, device, DTYPE, *rest)
def flipped(self, backend, step, chunks, claims=()):
    out = evaluate(self, backend, step, chunks, claims)
    return [ChunkResult(-r.fitness, r.loss_sum, r.tokens) for r in out]
def swapped(self, step, members, request):
    return np.roll(complete(self, step, members, request), -2, axis=0)
cls.__init__ = init_in
if LIE == "flip":
    objective.Reward.evaluate_chunks = flipped
if LIE == "swap":
    cls.complete = swapped
sys.exit(main())
"""


def _reward_run(tmp_path: Path, words_data: Path) -> Path:
    """A reward run's config for a tiny GPT-2 trained for a moment (peaked distributions, as a
    real model's): letter e over 8 sampled tokens."""
    trained(save_model(tmp_path / "model", "gpt2"))
    prompts = tmp_path / "prompts.txt"
    words = ("eggs", "rolls", "tea", "rain", "trees", "the sea", "bread", "seeds", "geese")
    prompts.write_text("".join(f"Tell me about {w}.\n" for w in words))
    printed = subprocess.run(
        [command("eggroll-tune"), "model", "--reward", "builtin:letter_e", "--prompts",
         "prompts.txt", "--prompts-per-step", "2", "--completion-tokens", "8",
         "--data-dir", words_data, "--population", "32", "--chunk-size", "16", "--rank", "2",
         "--sigma", "0.05", "--lr", "2", "--print-config"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert printed.returncode == 0, printed.stderr
    config = tmp_path / "run.toml"
    config.write_text(printed.stdout)
    return config


@pytest.mark.parametrize("lie", ["flip", "swap"])
def test_a_reward_liar_is_outvoted_by_float32_and_bfloat16_workers(
    spawn: Callable[..., Any], words_data: Path, tmp_path: Path, lie: str
) -> None:
    config, save = _reward_run(tmp_path, words_data), tmp_path / "run"
    coord, port = start_coordinator(
        spawn, save, config, "--verify-fraction", "1", "--max-steps", str(STEPS)
    )
    goal = ("--backend", "torch", "--goal-dir", str(tmp_path), "--threads", "1")
    fp32 = start_worker(spawn, port, words_data, "fp32", *goal)

    def worker(name: str, dtype: str, how: str) -> Proc:
        flags = ("--data-dir", str(words_data), "--name", name, "--log-format", "json")
        args = [sys.executable, "-c", WORKER, dtype, how, f"127.0.0.1:{port}", *flags, *goal]
        return Proc(args, name)

    bf16, liar = worker("bf16", "bfloat16", "honest"), worker("liar", "float32", lie)
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
    # The honest workers read the liar's claims: swapped completions are refuted token by
    # token; flipped fitness of honest completions is confirmed text, then outvoted.
    refuted = sum(p.count(lambda e: e.get("event") == "claim refuted") for p in (fp32, bf16))
    assert (refuted > 0) == (lie == "swap")
    # No CLAIM was refused: each had its RESULT and the run's size.
    refused = [e for e in coord.events if e.get("event") == "rejecting worker"]
    assert not [e for e in refused if e.get("code") == "MALFORMED"], refused
