"""Hugging Face runs end to end, in real processes on tiny GPT-2 and Llama models built here:
eggroll-tune moves a reward and a loss, the fitness log replays to the same weights from
the model's files, a coordinator with two PyTorch workers on a bfloat16 model (killed and
restarted midway) reaches eggroll-tune's digest, eggroll-export writes a model transformers
loads whose targets are the replica's bits, and bad inputs are one line."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from helpers import command, digest_at, start_coordinator, start_worker  # noqa: E402
from hf_models import save_model  # noqa: E402

from eggroll_dist.protocol.ternary import unpack_ternary  # noqa: E402
from eggroll_dist.shared.hf_dir import linear_layers  # noqa: E402
from eggroll_dist.shared.replica import load_checkpoint  # noqa: E402
from eggroll_dist.shared.save_dir import SaveDir  # noqa: E402
from eggroll_dist.worker.hf_model import PopulationLM, load_causal_lm  # noqa: E402

PROMPTS = "the quick\na bird\nevery good\nthe lazy\nfox\nhand\ntwo in\neggs are\nbush\nworth\n"
# A run that moves letter_e's reward on the tiny GPT-2 within a few dozen steps (one CPU core
# takes about a second a step).
REWARD_RUN = (
    "--reward", "builtin:letter_e", "--prompts", "prompts.txt", "--population", "32",
    "--rank", "2", "--sigma", "0.05", "--lr", "2", "--completion-tokens", "8",
    "--prompts-per-step", "4", "--valid-tokens", "256", "--threads", "1",
)  # fmt: skip


def run_cli(*args: str | Path, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [command(str(args[0])), *map(str, args[1:])],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )


@pytest.fixture(scope="module")
def gpt2_run(tmp_path_factory: pytest.TempPathFactory, words_data: Path) -> Path:
    """A folder with a tiny GPT-2 (`model`), prompts, and a 30-step reward run (`run`)."""
    root = tmp_path_factory.mktemp("hf")
    save_model(root / "model", "gpt2", initializer_range=0.3)
    (root / "prompts.txt").write_text(PROMPTS)
    done = run_cli(
        "eggroll-tune", "model", *REWARD_RUN, "--steps", "30", "--validate-every", "10",
        "--data-dir", words_data, "--save-dir", "run", "--summary-json", "summary.json",
        cwd=root,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return root


def test_a_reward_moves_within_a_few_dozen_steps(gpt2_run: Path) -> None:
    summary = json.loads((gpt2_run / "summary.json").read_text())
    rewards = summary["train_rewards"]
    assert len(rewards) == 30
    first, last = np.mean(rewards[:5]), np.mean(rewards[-5:])
    assert last > first + 0.05, rewards
    held = [point["held_out_reward"] for point in summary["curve"]]
    assert held[-1] > held[0], held  # the unperturbed model, on prompts never trained on


def test_the_fitness_log_replays_to_the_same_weights(gpt2_run: Path) -> None:
    run = SaveDir.open(gpt2_run / "run")
    run.model_dir = gpt2_run / "model"  # its step 0: the model's files
    snapshot = load_checkpoint(run.layout.snapshot(30))
    replayed = run.state_at(30, unpack_ternary, snapshots=False)
    base = run.state_at(0, unpack_ternary, snapshots=False)
    assert replayed.digest() == snapshot.digest()
    assert replayed.params.keys() == snapshot.params.keys()
    for name, bits in snapshot.params.items():  # a float32 model: its weights' bits
        assert bits.dtype == np.int32 and np.array_equal(replayed.params[name], bits)
    assert any(np.any(bits != base.params[n]) for n, bits in snapshot.params.items())
    summary = json.loads((gpt2_run / "summary.json").read_text())
    assert f"{replayed.digest():016x}" == summary["replica_digest"]


def test_the_same_command_with_more_steps_continues(
    gpt2_run: Path, words_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("model", "prompts.txt", "run"):
        src = gpt2_run / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, tmp_path / name)
    more = run_cli(
        "eggroll-tune", "model", *REWARD_RUN, "--steps", "32", "--validate-every", "10",
        "--data-dir", words_data, "--save-dir", "run", cwd=tmp_path,
    )  # fmt: skip
    assert more.returncode == 0, more.stderr[-3000:]
    run = SaveDir.open(tmp_path / "run")
    assert run.steps == 32  # two more steps, after the 30 kept
    monkeypatch.chdir(tmp_path)  # the runs' model path, `model`, is read from here
    assert digest_at(tmp_path / "run", 30) == digest_at(gpt2_run / "run", 30)
    snapshot = load_checkpoint(run.layout.snapshot(32))
    assert snapshot.digest() == digest_at(tmp_path / "run", 32)


def test_export_loads_in_transformers_and_generates(gpt2_run: Path) -> None:
    out = gpt2_run / "merged"
    done = run_cli("eggroll-export", "run", "--out", out, cwd=gpt2_run)
    assert done.returncode == 0, done.stderr
    merged = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    # its targets are the replica's weights at the last step, bit for bit
    state = load_checkpoint(SaveDir.open(gpt2_run / "run").layout.snapshot(30))
    lm = PopulationLM(load_causal_lm(gpt2_run / "model"), state.config, state)
    layers = {name: m for name, m, _, _ in linear_layers(merged)}
    for name in lm.modules:
        w = layers[name].weight
        w = (w.T if lm.transposed[name] else w).detach().float().contiguous()
        assert torch.equal(w.view(torch.int32), torch.from_numpy(state.params[name]))
        assert torch.equal(w, lm._weight(name).detach())
    ids = torch.tensor([tokenizer.encode("the quick")])
    text = merged.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    assert text.shape == (1, ids.shape[1] + 4)


def test_perplexity_falls_on_a_llama(tmp_path: Path, words_data: Path) -> None:
    save_model(tmp_path / "model", "llama", initializer_range=0.3)
    done = run_cli(
        "eggroll-tune", "model", "--reward", "perplexity", "--data-dir", words_data,
        "--population", "32", "--rank", "2", "--sigma", "0.05", "--lr", "2", "--steps", "30",
        "--seq-len", "16", "--valid-tokens", "512", "--validate-every", "0", "--threads", "1",
        "--summary-json", "summary.json", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    losses = json.loads((tmp_path / "summary.json").read_text())["train_losses"]
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.1, losses


def test_two_torch_workers_reach_tunes_digest_through_a_coordinator_kill(
    spawn: Callable[..., Any],
    gpt2_run: Path,
    words_data: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same run as eggroll-tune's on a bfloat16 model, written by --print-config, over a
    coordinator and two PyTorch workers; the coordinator is killed (SIGKILL) after step 2 and
    restarted: the replica digest at the end is eggroll-tune's, and its snapshots hold two
    bytes per target weight."""
    save_model(tmp_path / "model", "gpt2", initializer_range=0.3, dtype="bfloat16")
    shutil.copy(gpt2_run / "prompts.txt", tmp_path / "prompts.txt")
    steps, flags = 5, (*REWARD_RUN, "--population", "16", "--chunk-size", "8")
    printed = run_cli(
        "eggroll-tune", "model", *flags, "--steps", steps, "--print-config", cwd=tmp_path
    )
    assert printed.returncode == 0, printed.stderr
    (tmp_path / "run.toml").write_text(printed.stdout)
    alone = run_cli(
        "eggroll-tune", "model", *flags, "--steps", steps, "--data-dir", words_data,
        "--save-dir", "alone", cwd=tmp_path,
    )  # fmt: skip
    assert alone.returncode == 0, alone.stderr[-3000:]

    save_dir, config = tmp_path / "run", tmp_path / "run.toml"
    coord, port = start_coordinator(spawn, save_dir, config, "--max-steps", str(steps))
    goal = ("--backend", "torch", "--goal-dir", str(tmp_path), "--threads", "1")
    workers = [start_worker(spawn, port, words_data, f"w{i}", *goal) for i in range(2)]
    coord.wait_for(lambda e: e.get("event") == "step" and e.get("step", 0) >= 2, 240, "step 2")
    coord.kill()
    again, _ = start_coordinator(spawn, save_dir, config, "--max-steps", str(steps), port=port)
    # The workers come back by themselves (the steps left may all go to the first one back).
    again.wait_for(lambda e: e.get("event") == "worker joined", 120, "a worker rejoining")
    assert again.wait(300) == 0
    assert all(w.proc.poll() in (None, 0) for w in workers)  # none failed
    run, tuned = SaveDir.open(save_dir), SaveDir.open(tmp_path / "alone")
    assert run.config.digest() == tuned.config.digest()
    assert run.config.model.weight_dtype == "bfloat16"
    monkeypatch.chdir(tmp_path)  # the runs' model path, `model`, is read from here
    assert digest_at(save_dir, steps) == digest_at(tmp_path / "alone", steps)
    snapshot = load_checkpoint(tuned.layout.snapshot(steps))
    assert all(bits.dtype == np.int16 for bits in snapshot.params.values())
    assert snapshot.digest() == digest_at(save_dir, steps)


def test_a_worker_with_another_model_copy_is_refused(
    spawn: Callable[..., Any], gpt2_run: Path, words_data: Path, tmp_path: Path
) -> None:
    printed = run_cli("eggroll-tune", "model", *REWARD_RUN, "--print-config", cwd=gpt2_run)
    (tmp_path / "run.toml").write_text(printed.stdout)
    for name in ("model", "prompts.txt"):
        src = gpt2_run / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, tmp_path / name)
    coord, port = start_coordinator(spawn, tmp_path / "run", tmp_path / "run.toml")
    other = tmp_path / "other"
    shutil.copytree(tmp_path, other, ignore=shutil.ignore_patterns("run", "other"))
    config = json.loads((other / "model" / "config.json").read_text())
    (other / "model" / "config.json").write_text(json.dumps({**config, "n_positions": 32}))
    worker = start_worker(
        spawn, port, words_data, "w", "--backend", "torch", "--goal-dir", str(other)
    )
    assert worker.wait(90) == 2
    assert "config.json differs from the run's" in worker.lines[-1]
    coord.wait_for(lambda e: e.get("event") == "worker error", 30, "worker error")


def test_a_config_whose_matrices_are_not_the_models_is_refused(gpt2_run: Path) -> None:
    """A worker checks the pinned matrices against its own model before allocating them."""
    from dataclasses import replace

    from eggroll_dist.shared.pinned import GoalError, check_model

    cfg = SaveDir.open(gpt2_run / "run").config
    check_model(cfg, gpt2_run / "model")
    huge = replace(
        cfg.model, matrices=(*cfg.model.matrices[:-1], "transformer.h.1.mlp.c_proj 32 9999")
    )
    with pytest.raises(GoalError, match="other target matrices than the run's"):
        check_model(cfg.replace(model=huge), gpt2_run / "model")


def test_backends_and_commands_refuse_the_other_family(
    spawn: Callable[..., Any], gpt2_run: Path, words_data: Path, tmp_path: Path
) -> None:
    from helpers import TINY_RUN

    config = tmp_path / "tiny.toml"
    config.write_text(TINY_RUN)
    _, port = start_coordinator(spawn, tmp_path / "run", config)
    worker = start_worker(spawn, port, words_data, "w", "--backend", "torch")
    assert worker.wait(60) == 2
    assert "which the torch backend does not evaluate" in worker.lines[-1]
    printed = run_cli("eggroll-tune", "model", *REWARD_RUN, "--print-config", cwd=gpt2_run)
    (gpt2_run / "hf.toml").write_text(printed.stdout)
    local = run_cli("eggroll-local", "--config", "hf.toml", "--data-dir", words_data, cwd=gpt2_run)
    assert (
        local.returncode == 1 and "fine-tune a Hugging Face model with eggroll-tune" in local.stderr
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("missing",), "missing is not a directory"),
        (("empty",), "it has no config.json"),
        (("bert",), "which is not a causal LM"),
        (("notok",), "has no tokenizer"),
        (("model", "--target", "*.q_proj"), "target pattern '*.q_proj' matches no linear layer"),
        (("model", "--rank", "0"), "model.rank=0 must be 1..4096"),
        (("model", "--rank", "33"), "rank 33 is above the size of target"),
    ],
)
def test_bad_inputs_say_one_line(
    gpt2_run: Path, tmp_path: Path, args: tuple[str, ...], message: str
) -> None:
    (tmp_path / "empty").mkdir()
    transformers.BertModel(
        transformers.BertConfig(
            vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=32,
        )
    ).save_pretrained(tmp_path / "bert")  # fmt: skip
    shutil.copytree(gpt2_run / "model", tmp_path / "model")
    shutil.copytree(gpt2_run / "model", tmp_path / "notok")
    for f in (tmp_path / "notok").glob("tokenizer*"):
        f.unlink()
    shutil.copy(gpt2_run / "prompts.txt", tmp_path)
    done = run_cli(
        "eggroll-tune", args[0], *REWARD_RUN, *args[1:], "--steps", "1", cwd=tmp_path, timeout=120
    )
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and message in lines[0], lines


def test_the_done_line_sets_a_models_own_bits_beside_byte_baselines_only(
    gpt2_run: Path, words_data: Path
) -> None:
    """Bits per token of the model's own tokens compare with no per-token baseline of the
    data: the done line gives the data's baselines per byte alone."""
    done = run_cli(
        "eggroll-tune", "model", *REWARD_RUN, "--steps", "1", "--data-dir", words_data,
        cwd=gpt2_run,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    line = next(ln for ln in done.stderr.splitlines() if ln.startswith("done:"))
    baselines = line.split("(baselines: ")[1]
    assert "bits/byte)" in baselines and "bits/token" not in baselines, line


def test_the_readmes_example_model_visibly_learns(tmp_path: Path, words_data: Path) -> None:
    """The README's first Hugging Face run, as written (the data aside): a random GPT-2
    made by scripts/examples/hf/tiny_model.py learns to write the letter e within 30 steps
    (0.029 to 0.45 where it was measured)."""
    import sys

    root = Path(__file__).resolve().parents[1]
    example = root / "scripts" / "examples" / "hf"
    made = subprocess.run(
        [sys.executable, example / "tiny_model.py", tmp_path / "tiny-gpt2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert made.returncode == 0 and made.stderr.strip() == "", made.stderr
    done = run_cli(
        "eggroll-tune", tmp_path / "tiny-gpt2", "--reward", "builtin:letter_e", "--prompts",
        example / "prompts.txt", "--population", "32", "--rank", "2", "--sigma", "0.05",
        "--lr", "2", "--completion-tokens", "8", "--steps", "30", "--data-dir", words_data,
        "--summary-json", tmp_path / "s.json",
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    rewards = json.loads((tmp_path / "s.json").read_text())["train_rewards"]
    assert rewards[0] < 0.1 and np.mean(rewards[-3:]) > 0.3, rewards


def test_a_reward_run_without_data_scores_its_held_out_prompts_and_continues(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reward run in a folder without ./data (--data-dir left at its default) reads no
    text: its held-out score is the reward's, it draws no baselines, and it continues."""
    save_model(tmp_path / "model", "gpt2", initializer_range=0.3)
    (tmp_path / "prompts.txt").write_text(PROMPTS)
    flags = (
        "--reward", "builtin:letter_e", "--prompts", "prompts.txt", "--population", "8",
        "--rank", "2", "--sigma", "0.05", "--lr", "2", "--completion-tokens", "4",
        "--prompts-per-step", "2", "--validate-every", "2", "--threads", "1",
    )  # fmt: skip
    done = run_cli(
        "eggroll-tune", "model", *flags, "--steps", "3", "--save-dir", "run",
        "--summary-json", "s.json", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "no data directory" in done.stderr, done.stderr[-3000:]
    line = next(ln for ln in done.stderr.splitlines() if ln.startswith("done:"))
    assert "held-out reward" in line and "no data" in line and "(baselines:" not in line, line
    summary = json.loads((tmp_path / "s.json").read_text())
    assert [p["step"] for p in summary["curve"]] == [2, 3]
    assert all(p["held_out_reward"] is not None for p in summary["curve"])
    assert summary["valid_bits_per_token"] is None and summary["baselines"] == {}
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["data_digest"] is None
    history = (tmp_path / "run" / "history.log").read_text()
    assert "baselines" not in history
    more = run_cli(
        "eggroll-tune", "model", *flags, "--steps", "4", "--save-dir", "run", cwd=tmp_path
    )
    assert more.returncode == 0, more.stderr[-3000:]
    assert SaveDir.open(tmp_path / "run").steps == 4
    monkeypatch.chdir(tmp_path)  # the run's model path, `model`, is read from here
    assert f"{digest_at(tmp_path / 'run', 3):016x}" == summary["replica_digest"]
    inspect = run_cli("eggroll-inspect", "run", cwd=tmp_path)
    assert inspect.returncode == 0 and "held-out reward" in inspect.stdout, inspect.stdout
    missing = run_cli(
        "eggroll-tune", "model", *flags, "--steps", "1", "--data-dir", "missing", cwd=tmp_path
    )
    lines = missing.stderr.strip().splitlines()
    assert missing.returncode == 1 and len(lines) == 1, lines
    assert "data directory missing does not exist" in lines[0], lines


def test_a_torch_worker_stopped_mid_chunk_exits_0(
    spawn: Callable[..., Any], gpt2_run: Path, words_data: Path, tmp_path: Path
) -> None:
    """SIGTERM while PyTorch is inside a chunk is a clean stop (exit 0): the interpreter's
    finalization under the running backend thread aborted with 134, which supervisors
    took for a crash."""
    import signal

    for name in ("model", "prompts.txt"):
        src = gpt2_run / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, tmp_path / name)
    flags = (*REWARD_RUN, "--population", "64", "--completion-tokens", "32")
    printed = run_cli("eggroll-tune", "model", *flags, "--print-config", cwd=tmp_path)
    assert printed.returncode == 0, printed.stderr
    (tmp_path / "run.toml").write_text(printed.stdout)
    coord, port = start_coordinator(spawn, tmp_path / "run", tmp_path / "run.toml")
    goal = ("--backend", "torch", "--goal-dir", str(tmp_path), "--threads", "1")
    worker = start_worker(spawn, port, words_data, "w", *goal)
    coord.wait_for(lambda e: e.get("event") == "step" and e.get("step", 0) >= 1, 240, "step 1")
    worker.proc.send_signal(signal.SIGTERM)  # it is scoring step 2's chunk by now
    assert worker.wait(60) == 0, "\n".join(worker.lines[-5:])
