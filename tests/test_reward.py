"""The reward objective: batched generation equals the one-row sampler, members write with
their own noise, a reward that is easy to move rises, and the rewards' floats never reach a
replica (a distributed reward run ends at the single-process digest)."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import command, digest_at, start_coordinator, start_worker

from eggroll_dist.coordinator.curve import read_curve
from eggroll_dist.coordinator.plot import lines
from eggroll_dist.protocol import unpack_ternary
from eggroll_dist.shared.config import (
    ConfigError,
    ESConfig,
    FitnessConfig,
    ModelConfig,
    RunConfig,
    UpdateConfig,
    ValidationConfig,
    load_config,
)
from eggroll_dist.shared.data import load_data_dir
from eggroll_dist.shared.model import build_generator, build_model, param_specs
from eggroll_dist.shared.objectives.reward import reward_fitness
from eggroll_dist.shared.perturb import member_noise, pair_noise
from eggroll_dist.shared.pinned import GoalError, check_files, pin
from eggroll_dist.shared.prompts import Prompts, load_prompts, read_prompts, step_prompts
from eggroll_dist.shared.replica import ReplicaState, save_checkpoint
from eggroll_dist.shared.sample import (
    Completions,
    SampleSettings,
    generate,
    generate_rows,
    next_token,
    next_tokens,
)
from eggroll_dist.shared.save_dir import SaveDir
from eggroll_dist.shared.start import initial_state
from eggroll_dist.worker.backend.numpy_backend import NumpyBackend
from eggroll_dist.worker.objective import make_objective
from eggroll_dist.worker.reward import RewardError, RewardRunner
from eggroll_dist.worker.train import train

SETTINGS = [
    SampleSettings(),
    SampleSettings(temperature=0, presence_penalty=500),
    SampleSettings(temperature=1500, min_p=0, top_k=7, frequency_penalty=300),
    SampleSettings(temperature=300, min_p=200, presence_penalty=0),
]


def small(arch: str) -> RunConfig:
    return RunConfig(
        model=ModelConfig(arch=arch, vocab_size=256, n_layer=1, d_model=32),
        es=ESConfig(population=8, chunk_size=4, seq_len=12),
    )


@pytest.mark.parametrize("settings", SETTINGS)
def test_next_tokens_is_next_token_row_by_row(settings: SampleSettings) -> None:
    rng = np.random.default_rng(1)
    logits = rng.integers(-128, 128, size=(40, 300)).astype(np.int32)
    logits[5] = 3  # a row of ties
    counts = rng.integers(0, 3, size=(40, 300))
    samples = rng.integers(0, 1 << 40, size=40)
    rows = next_tokens(logits, counts, settings, 99, samples, 7)
    one = [next_token(logits[i], counts[i], settings, 99, int(samples[i]), 7) for i in range(40)]
    assert rows.tolist() == one


@pytest.mark.parametrize("arch", ["egg", "former"])
def test_generate_rows_is_generate_for_each_row(arch: str) -> None:
    cfg = small(arch)
    state = ReplicaState.initial(cfg)
    model, gen = build_model(cfg, state.params), build_generator(cfg, state.params)
    prompts = np.array([[65, 66, 67, 68], [70, 0, 72, 73], [1, 2, 3, 4]])  # token 0 inside too
    for settings in SETTINGS:
        rows = generate_rows(model.decoder(None, 3), prompts, 20, settings, 5, np.array([3, 9, 3]))
        for i in range(3):
            one = list(generate(gen, prompts[i].tolist(), 20, settings, 5, sample=[3, 9, 3][i]))
            assert rows[i].tolist() == one


@pytest.mark.parametrize("arch", ["egg", "former"])
def test_each_member_writes_with_its_own_noise(words_data: Path, arch: str) -> None:
    """complete() batches (pair, prompt, sign) rows of every prompt length: each member's
    tokens equal one row decoded alone with that member's perturbation."""
    cfg = small(arch)
    state = ReplicaState.initial(cfg)
    backend = NumpyBackend(load_data_dir(words_data), state, batch_members=4)
    settings = SampleSettings(temperature=1000, min_p=0, presence_penalty=0)
    request = Completions(((65, 66), (70, 71, 72), (1,), (80, 81)), (0, 1, 2, 3), 5, settings, 6)
    out = backend.complete(0, (2, 6), request)
    assert out.shape == (6, 4, 6)
    model, specs = build_model(cfg, state.params), param_specs(cfg.model)
    for member in range(2, 8):
        pair = np.array([member // 2])
        noise = member_noise(pair_noise(cfg, specs, 0, pair), state.params, cfg.es.sigma_shift)
        mine = noise.rows(member % 2, member % 2 + 1)
        for j, prompt in enumerate(request.prompts):
            alone = generate_rows(model.decoder(mine, 1), np.array([prompt]), 6, settings, 5, [j])
            assert out[member - 2, j].tolist() == alone[0].tolist()
    # Both members of a pair write differently (opposite noise), and unperturbed is one row.
    assert not np.array_equal(out[0], out[1])
    assert backend.complete(0, None, request).shape == (1, 4, 6)


def test_pair_fitness_is_the_sign_of_the_summed_rewards() -> None:
    rewards = np.array([[0.5, 0.25], [0.25, 0.5], [1.0, 0.0], [0.0, 0.0], [0.1, 0.2], [0.4, 0.0]])
    assert reward_fitness(rewards).tolist() == [0, 1, -1]
    # fsum: exactly rounded, so the order of the prompts cannot flip a near tie
    tie = np.array([[1e16, 1.0, -1e16], [1.0, 0.0, 0.0]])
    assert reward_fitness(tie).tolist() == [0]


def reward_config(tmp: Path, prompts: str = "data", **fitness: object) -> Path:
    """A small reward run's config file in `tmp` (the reward and prompts beside it)."""
    extra = "".join(f"{k} = {json.dumps(v)}\n" for k, v in fitness.items())
    path = tmp / "run.toml"
    path.write_text(
        "steps = 4\n[model]\nn_layer = 1\nd_model = 32\n"
        "[es]\npopulation = 32\nchunk_size = 8\nseq_len = 16\nsigma_shift = 3\n"
        'noise = "gaussian"\n'
        '[update]\nrule = "momentum"\nmomentum_shift = 2\n'
        f'[fitness]\nobjective = "reward"\nprompts = "{prompts}"\nprompts_per_step = 4\n'
        f"completion_tokens = 12\nheld_out_prompts = 8\n{extra}"
        "[validation]\nevery_steps = 2\nmax_tokens = 320\n"
    )
    return path


def test_a_reward_that_is_easy_to_move_rises(words_data: Path) -> None:
    """The share of the letter e in completions climbs within a few dozen steps of a small
    model trained from scratch, and the held-out next-token score is reported beside it."""
    cfg = RunConfig(
        model=ModelConfig(n_layer=1, d_model=32),
        es=ESConfig(population=128, chunk_size=64, seq_len=16, sigma_shift=2, noise="gaussian"),
        fitness=FitnessConfig(
            objective="reward",
            reward="builtin:letter_e",
            prompts="data",
            prompts_per_step=4,
            completion_tokens=12,
            held_out_prompts=16,
        ),
        update=UpdateConfig(rule="momentum", momentum_shift=2),
        validation=ValidationConfig(every_steps=0, max_tokens=320),
    )
    dataset = load_data_dir(words_data)
    # One BLAS thread: these small GEMMs only lose to thread hand-offs on a busy machine.
    backend = NumpyBackend(dataset, ReplicaState.initial(cfg), threads=1)
    objective = make_objective(cfg, dataset, Path("."))
    try:
        before = objective.held_out(backend)
        result = train(cfg, backend, 30, objective=objective)
    finally:
        objective.close()
    rewards = result.scores["reward"]
    assert before is not None and len(rewards) == 30
    first, last = np.mean(rewards[:3]), np.mean(rewards[-3:])
    assert last > 4 * first and last > 0.1, rewards
    final = result.curve[-1]
    assert final["held_out_reward"] > before + 0.1
    assert final["bits_per_token"] > 0 and final["tokens"] > 0  # reported beside it


def run_cli(*args: str | Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [command(args[0]), *map(str, args[1:])], capture_output=True, text=True, timeout=timeout
    )


def test_local_and_train_reach_the_same_digest(words_data: Path, tmp_path: Path) -> None:
    """Two workers over the coordinator and one process reach the same replica: only the
    ternary fitness enters it. The reward is a file beside the config, found by the
    workers through --goal-dir (eggroll-local passes the config's folder)."""
    (tmp_path / "score.py").write_text(
        "def reward(prompts, completions, **fields):\n"
        "    return [c.count('a') / max(1, len(c)) for c in completions]\n"
    )
    config = reward_config(tmp_path, reward="score.py:reward")
    trained = run_cli(
        "eggroll-train", "--data-dir", words_data, "--config", config,
        "--save-dir", tmp_path / "one", "--sample-every", "2", "--log-format", "json",
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr
    steps = [json.loads(x) for x in trained.stderr.splitlines() if '"event": "step"' in x]
    assert [s["step"] for s in steps] == [1, 2, 3, 4] and all("reward" in s for s in steps)
    summary = json.loads((tmp_path / "one" / "summary.json").read_text())
    assert len(summary["train_rewards"]) == 4 and "valid_held_out_reward" in summary
    drawn = lines(read_curve(tmp_path / "one"))  # what eggroll-inspect --plot draws
    assert drawn["train reward"][0] == [1, 2, 3, 4]
    assert drawn["train reward"][1] == pytest.approx(summary["train_rewards"], abs=1e-4)
    assert drawn["held-out reward"][0] == [2, 4]
    local = run_cli(
        "eggroll-local", "--data-dir", words_data, "--config", config, "--workers", "2",
        "--save-dir", tmp_path / "two", "--metrics-port", "0", "--sample-every", "0",
    )  # fmt: skip
    assert local.returncode == 0, local.stderr + local.stdout
    assert "reward" in local.stdout and "held-out reward" in local.stdout
    assert digest_at(tmp_path / "two", 4) == digest_at(tmp_path / "one", 4)
    assert summary["replica_digest"] == f"{digest_at(tmp_path / 'two', 4):016x}"


def test_init_from_starts_at_a_trained_replica(words_data: Path, tmp_path: Path) -> None:
    """--init-from records the checkpoint and its digest in the run config; step 0 holds
    its weights; the save directory keeps a copy, so its steps replay without the file."""
    base_cfg = small("egg").replace(
        es=ESConfig(population=8, chunk_size=4, seq_len=16),
        validation=ValidationConfig(every_steps=0, max_tokens=320),
    )
    start = ReplicaState.initial(base_cfg)
    start.params["head"][:] = np.clip(start.params["head"].astype(int) + 3, -127, 127)
    save_checkpoint(tmp_path / "start.ckpt", start)
    config = reward_config(tmp_path, reward="builtin:letter_e")
    done = run_cli(
        "eggroll-train", "--data-dir", words_data, "--config", config, "--steps", "2",
        "--init-from", tmp_path / "start.ckpt", "--save-dir", tmp_path / "run",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    run = json.loads((tmp_path / "run" / "run.json").read_text())["config"]
    assert run["model"]["init_from"] == str((tmp_path / "start.ckpt").resolve())
    assert run["model"]["init_digest"] == start.digest_hex()
    (tmp_path / "start.ckpt").rename(tmp_path / "moved.ckpt")  # replay needs only the copy
    inspected = run_cli("eggroll-inspect", tmp_path / "run", "--json")
    assert inspected.returncode == 0, inspected.stderr
    at0 = SaveDir.open(tmp_path / "run").state_at(0, unpack_ternary, snapshots=False)
    assert np.array_equal(at0.params["head"], start.params["head"])
    # A model of another shape cannot start from it.
    wide = tmp_path / "wide.toml"
    wide.write_text(config.read_text().replace("d_model = 32", "d_model = 16"))
    refused = run_cli(
        "eggroll-train", "--data-dir", words_data, "--config", wide,
        "--init-from", tmp_path / "moved.ckpt", "--steps", "1",
    )  # fmt: skip
    assert refused.returncode == 1
    assert "model.d_model=32" in refused.stderr and "Traceback" not in refused.stderr


def test_goal_files_are_pinned(words_data: Path, tmp_path: Path) -> None:
    (tmp_path / "score.py").write_text("def score(text):\n    return len(text)\n")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"q {i}\\na:\n" for i in range(16)))
    config = reward_config(tmp_path, prompts="prompts.txt", reward="score.py:score")
    cfg = pin(load_config(config), tmp_path)
    assert len(cfg.fitness.reward_sha256) == 64 and len(cfg.fitness.prompts_sha256) == 64
    assert cfg.digest() != load_config(config).digest()
    check_files(cfg, tmp_path)  # the same files: fine
    elsewhere = tmp_path / "worker"
    elsewhere.mkdir()
    (elsewhere / "score.py").write_text("def score(text):\n    return -len(text)\n")
    (elsewhere / "prompts.txt").write_bytes(prompts.read_bytes())
    with pytest.raises(GoalError, match=r"reward file .*score\.py .* is not the run's"):
        check_files(cfg, elsewhere)
    loaded = load_prompts(cfg, tmp_path, load_data_dir(words_data))
    assert len(loaded.train) == 14 and [p.index for p in loaded.held_out] == [7, 15]
    assert loaded.train[0].text == "q 0\na:"
    picks = step_prompts(cfg, loaded, 3)
    assert picks == step_prompts(cfg, loaded, 3) and len(picks) == 4
    assert [p.index for p in step_prompts(cfg, loaded, 4)] != [p.index for p in picks]


def test_batched_rewards_get_the_prompts_fields(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": 2 * i}) + "\n"
                            for i in range(8)))  # fmt: skip
    assert read_prompts(path)[3] == ("3+3=", {"answer": 6})
    (tmp_path / "r.py").write_text(
        "def reward(prompts, completions, answer):\n"
        "    return [float(c.strip() == str(a)) for c, a in zip(completions, answer)]\n"
    )
    runner = RewardRunner("r.py:reward", tmp_path, 10)
    try:
        assert runner.score(["1+1=", "2+2="], ["2", "5"], {"answer": [2, 4]}) == [1.0, 0.0]
    finally:
        runner.close()


def bad_reward_run(words_data: Path, tmp_path: Path, *flags: str, **fitness: object):
    config = reward_config(tmp_path, **fitness)
    return run_cli(
        "eggroll-train", "--data-dir", words_data, "--config", config, "--steps", "1",
        "--save-dir", tmp_path / "run", *flags, timeout=120,
    )  # fmt: skip


REWARDS = {
    "raises": (
        "def score(text):\n    if 'a' in text:\n        raise ValueError('no a please')\n"
        "    return 1.0\n",
        r"score\.py:score raised ValueError\('no a please'\) on the completion of prompt '",
    ),
    "nan": ("def score(text):\n    return float('nan')\n", r"returned nan for completion 0"),
    "count": (
        "def reward(prompts, completions):\n    return [1.0]\n",
        r"returned 1 rewards for 32 completions",
    ),
    "text": ("def score(text):\n    return 'good'\n", r"returned str 'good' for completion 0"),
    "sleeps": (
        "import time\ndef score(text):\n    time.sleep(60)\n    return 0.0\n",
        r"did not answer within 1 s while scoring 32 completions: it was stopped",
    ),
}


@pytest.mark.parametrize("case", sorted(REWARDS))
def test_a_failing_reward_stops_with_one_line(words_data: Path, tmp_path: Path, case: str) -> None:
    source, message = REWARDS[case]
    (tmp_path / "score.py").write_text(source)
    function = "reward" if "def reward" in source else "score"
    done = bad_reward_run(
        words_data, tmp_path, "--reward-timeout", "1", reward=f"score.py:{function}"
    )
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: ") and "Traceback" not in done.stderr
    assert re.search(message, last), last
    # Nothing half-made: a new run that failed before its first step leaves no save
    # directory, so the command with the reward fixed starts afresh.
    assert not (tmp_path / "run").exists()
    if case == "raises":
        (tmp_path / "score.py").write_text("def score(text):\n    return 1.0\n")
        fixed = bad_reward_run(words_data, tmp_path, reward="score.py:score")
        assert fixed.returncode == 0, fixed.stderr


@pytest.mark.parametrize(
    ("fitness", "files", "message"),
    [
        ({"reward": "missing.py:score"}, {}, r"reward file .*missing\.py does not exist"),
        (
            {"reward": "score.py:nothing"},
            {"score.py": "def score(text):\n    return 0.0\n"},
            r"reward file .*score\.py has no function 'nothing'",
        ),
        ({"reward": "builtin:nope"}, {}, r"'builtin:nope' is not a built-in reward"),
        (
            {"reward": "builtin:letter_e", "prompts": "empty.txt"},
            {"empty.txt": "\n\n"},
            r"empty\.txt holds 0 prompts; at least 8 are needed",
        ),
        (
            {"reward": "builtin:letter_e", "prompts": "long.txt"},
            {"long.txt": "short\n" * 7 + "x" * 40 + "\n"},
            r"long\.txt prompt 8 is 40 tokens, longer than the model's context of 16",
        ),
        (
            {"reward": "builtin:letter_e", "prompts": "bad.jsonl"},
            {"bad.jsonl": '{"prompt": "a"}\n{"question": "b"}\n'},
            r'bad\.jsonl line 2 has no "prompt" string',
        ),
    ],
)
def test_bad_goal_files_say_one_line(
    words_data: Path, tmp_path: Path, fitness: dict, files: dict, message: str
) -> None:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    done = bad_reward_run(words_data, tmp_path, **fitness)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert re.search(message, done.stderr.strip().splitlines()[-1]), done.stderr


def test_a_huge_prompts_file_is_refused_before_it_is_read(words_data: Path, tmp_path: Path):
    (tmp_path / "huge.txt").write_text("ab\n" * ((1 << 20) + 1))
    done = bad_reward_run(words_data, tmp_path, reward="builtin:letter_e", prompts="huge.txt")
    assert done.returncode == 1
    assert "holds more than 1,048,576 prompts" in done.stderr


def test_reward_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"needs fitness\.reward"):
        RunConfig(fitness=FitnessConfig(objective="reward", prompts="data"))
    with pytest.raises(ConfigError, match="objective is 'next_token'"):
        RunConfig(fitness=FitnessConfig(reward="builtin:letter_e"))
    with pytest.raises(ConfigError, match="turn them off"):
        RunConfig(
            fitness=FitnessConfig(
                objective="reward", reward="x.py:f", prompts="data", chunk_mean_filter=True
            )
        )
    with pytest.raises(ConfigError, match="completion_tokens=0"):
        RunConfig(
            fitness=FitnessConfig(
                objective="reward", reward="x.py:f", prompts="data", completion_tokens=0
            )
        )


def test_initial_state_refuses_another_replica(tmp_path: Path) -> None:
    cfg = small("egg")
    save_checkpoint(tmp_path / "a.ckpt", ReplicaState.initial(cfg))
    pinned = pin(cfg.replace(model=dataclasses.replace(cfg.model, init_from="a.ckpt")), tmp_path)
    assert initial_state(pinned, tmp_path).digest_hex() != ""
    other = ReplicaState.initial(cfg)
    other.params["head"][0, 0] ^= 1
    save_checkpoint(tmp_path / "a.ckpt", other)
    with pytest.raises(GoalError, match=r"holds replica"):
        initial_state(pinned, tmp_path)


def test_prompts_cover_both_splits(words_data: Path) -> None:
    cfg = RunConfig(
        es=ESConfig(population=8, chunk_size=4, seq_len=16),
        fitness=FitnessConfig(objective="reward", reward="builtin:letter_e", prompts="data"),
    )
    prompts: Prompts = load_prompts(cfg, Path("."), load_data_dir(words_data))
    assert prompts.train and prompts.held_out
    assert all(0 < len(p.tokens) <= 16 for p in prompts.train + prompts.held_out)
    assert {p.index >> 32 for p in prompts.held_out} == {1}


def test_a_reward_runner_survives_a_timeout(tmp_path: Path) -> None:
    (tmp_path / "slow.py").write_text(
        "import time\ndef score(text):\n    time.sleep(10 if text == 'slow' else 0)\n"
        "    print('noise on stdout')\n    return len(text)\n"
    )
    # 2 s: the second call starts the runner again (Python and its imports) within it
    runner = RewardRunner("slow.py:score", tmp_path, 2.0)
    try:
        with pytest.raises(RewardError, match=r"did not answer within 2 s"):
            runner.score(["p"], ["slow"], {})
        assert runner.score(["p", "q"], ["ab", "abc"], {}) == [2.0, 3.0]  # started again
    finally:
        runner.close()


def test_a_worker_with_another_reward_is_refused(
    spawn: Callable[..., Any], words_data: Path, tmp_path: Path
) -> None:
    """The run config pins the reward's bytes: a worker whose copy differs leaves with one
    line naming its file, and the coordinator's log says why."""
    (tmp_path / "score.py").write_text("def score(text):\n    return len(text)\n")
    config = reward_config(tmp_path, reward="score.py:score")
    coord, port = start_coordinator(spawn, tmp_path / "run", config)
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "score.py").write_text("def score(text):\n    return -len(text)\n")
    worker = start_worker(spawn, port, words_data, "stale", "--goal-dir", str(other))
    assert worker.wait(60) == 2
    line = worker.lines[-1]
    assert f"reward file {other / 'score.py'}" in line and "is not the run's" in line
    said = coord.wait_for(lambda e: e.get("event") == "worker error", 30, "worker error")
    assert "is not the run's" in said["text"]


def test_a_reward_that_fails_twice_takes_its_worker_out(
    spawn: Callable[..., Any], words_data: Path, tmp_path: Path
) -> None:
    """A reward that raises: the chunk is dropped with one line in both logs, and the same
    failure again makes the worker leave the run with that line."""
    (tmp_path / "score.py").write_text(
        "def score(text):\n    raise RuntimeError('broken reward')\n"
    )
    config = reward_config(tmp_path, reward="score.py:score")
    coord, port = start_coordinator(spawn, tmp_path / "run", config)
    worker = start_worker(spawn, port, words_data, "w", "--goal-dir", str(tmp_path))
    assert worker.wait(90) == 2
    assert "the reward failed twice:" in worker.lines[-1]
    assert "RuntimeError('broken reward')" in worker.lines[-1]
    logged = coord.wait_for(lambda e: e.get("event") == "worker log", 30, "worker log")
    assert "failed: " in logged["text"] and "broken reward" in logged["text"]
    coord.wait_for(lambda e: e.get("event") == "worker error", 30, "worker error")
    assert SaveDir.open(tmp_path / "run").steps == 0  # nothing committed from a failed chunk


def test_init_from_over_the_coordinator_matches_one_process(
    words_data: Path, tmp_path: Path
) -> None:
    """eggroll-local passes --init-from to its coordinator; the workers start from the same
    replica (the config pins its digest) and reach eggroll-train's digest."""
    start = ReplicaState.initial(reward_config_state(tmp_path))
    start.params["head"][:] = np.clip(start.params["head"].astype(int) - 5, -127, 127)
    save_checkpoint(tmp_path / "start.ckpt", start)
    config = reward_config(tmp_path, reward="builtin:letter_e")
    common = ("--data-dir", words_data, "--config", config, "--steps", "2")
    common += ("--init-from", tmp_path / "start.ckpt")
    one = run_cli("eggroll-train", *common, "--save-dir", tmp_path / "one")
    assert one.returncode == 0, one.stderr
    local = ("--workers", "2", "--metrics-port", "0", "--save-dir", tmp_path / "two")
    two = run_cli("eggroll-local", *common, *local)
    assert two.returncode == 0, two.stderr + two.stdout
    assert (tmp_path / "two" / "init.ckpt").read_bytes() == (tmp_path / "start.ckpt").read_bytes()
    assert digest_at(tmp_path / "two", 2) == digest_at(tmp_path / "one", 2)


def reward_config_state(tmp: Path) -> RunConfig:
    """The model of `reward_config`'s runs, for a replica they can start from."""
    return small("egg").replace(es=ESConfig(population=32, chunk_size=8, seq_len=16))


def test_a_worker_reads_goal_files_only_under_its_goal_dir(tmp_path: Path) -> None:
    """A config comes from the coordinator: however it pins them, a worker never runs or
    reads goal files outside its --goal-dir (say, a library module's function)."""
    outside = tmp_path / "lib.py"
    outside.write_text("def getoutput(text):\n    return 0.0\n")
    goal = tmp_path / "goal"
    goal.mkdir()
    for where in (str(outside), "../lib.py"):
        cfg = RunConfig(
            fitness=FitnessConfig(objective="reward", reward=f"{where}:getoutput", prompts="data")
        )
        cfg = pin(cfg, goal)  # the sha256 of the very file: pinned correctly
        with pytest.raises(GoalError, match="outside this worker's goal directory"):
            check_files(cfg, goal)
    # Nor a starting replica outside it, and without --goal-dir no goal file at all.
    save_checkpoint(tmp_path / "start.ckpt", ReplicaState.initial(small("egg")))
    model = dataclasses.replace(small("egg").model, init_from=str(tmp_path / "start.ckpt"))
    cfg = pin(small("egg").replace(model=model), tmp_path)
    check_files(cfg, tmp_path)
    with pytest.raises(GoalError, match="outside this worker's goal directory"):
        check_files(cfg, goal)
    with pytest.raises(GoalError, match="start this worker with --goal-dir"):
        check_files(cfg, None)
    check_files(small("egg"), None)  # a run without goal files needs none


def test_hostile_prompts_files_say_one_line(words_data: Path, tmp_path: Path) -> None:
    cfg = RunConfig(
        es=ESConfig(population=8, chunk_size=4, seq_len=16),
        fitness=FitnessConfig(objective="reward", reward="builtin:letter_e", prompts="p.jsonl"),
    )
    dataset = load_data_dir(words_data)
    for line, message in (
        ('{"prompt": "a", "n": ' + "9" * 5000 + "}", "line 8 is not valid JSON"),
        ('{"prompt": "\\ud800"}', "prompt 8 is not valid Unicode text"),
    ):
        (tmp_path / "p.jsonl").write_text('{"prompt": "a"}\n' * 7 + line + "\n")
        with pytest.raises(GoalError, match=message):
            load_prompts(cfg, tmp_path, dataset)


async def test_a_worker_without_goal_dir_starts_no_run_with_goal_files(
    words_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon's replica checks the goal files as it starts: with no --goal-dir it reads
    none, not even those of its current folder, where the run's pinned copy lies."""
    from helpers import numpy_factory

    from eggroll_dist.worker.replica import Replica

    (tmp_path / "score.py").write_text("def score(text):\n    return 0.0\n")
    cfg = pin(
        RunConfig(
            es=ESConfig(population=8, chunk_size=4, seq_len=16),
            fitness=FitnessConfig(objective="reward", reward="score.py:score", prompts="data"),
        ),
        tmp_path,
    )
    monkeypatch.chdir(tmp_path)
    dataset = load_data_dir(words_data)
    replica = Replica(dataset, numpy_factory(1), threaded=False)
    with pytest.raises(GoalError, match="start this worker with --goal-dir"):
        await replica.start(cfg, b"r" * 16)
    assert replica.backend is None
    with_dir = Replica(dataset, numpy_factory(1), threaded=False, goal_dir=tmp_path)
    await with_dir.start(cfg, b"r" * 16)
    assert with_dir.step == 0
    with_dir.drop()
