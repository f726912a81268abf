"""The single-process trainer: deterministic digests, replay of the fitness log, the CLI."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import structlog
from click.testing import CliRunner
from helpers import TRAIN_RUN, trained_digest

from eggroll_dist.protocol.ternary import unpack_ternary
from eggroll_dist.shared.config import ESConfig, ModelConfig, RunConfig, ValidationConfig
from eggroll_dist.shared.data import load_data_dir
from eggroll_dist.shared.fitness_log import FitnessLog
from eggroll_dist.shared.replica import ReplicaState, load_checkpoint
from eggroll_dist.shared.replica import replay as replay_steps
from eggroll_dist.worker import train as train_module
from eggroll_dist.worker.backend.numpy_backend import NumpyBackend
from eggroll_dist.worker.reward import RewardError
from eggroll_dist.worker.train import SNAPSHOTS_KEPT, train

SMALL = RunConfig(
    model=ModelConfig(n_layer=1, d_model=16),
    es=ESConfig(population=32, chunk_size=8, seq_len=12),
    validation=ValidationConfig(every_steps=3, max_tokens=600),
    steps=6,
)


def replay(state: ReplicaState, packed: list[bytes]) -> ReplicaState:
    """The replica after the logged (packed) fitness of each step."""
    return replay_steps(state, [unpack_ternary(p, state.config.pairs) for p in packed])


@pytest.fixture(scope="module")
def data_dir(words_data: Path) -> Path:
    return words_data


def test_same_run_twice_gives_the_same_digest_and_replay_reproduces_it(data_dir: Path) -> None:
    dataset = load_data_dir(data_dir)
    a = train(SMALL, NumpyBackend(dataset, ReplicaState.initial(SMALL)), 6)
    b = train(SMALL, NumpyBackend(dataset, ReplicaState.initial(SMALL), batch_members=6), 6)
    assert a.state.digest() == b.state.digest()
    assert a.fitness == b.fitness
    assert a.state.step == 6 and [c["step"] for c in a.curve] == [3, 6]  # every 3, the end
    replayed = replay(ReplicaState.initial(SMALL), a.fitness)
    assert replayed.digest() == a.state.digest()
    # Replaying a different fitness sequence does not.
    other = replay(ReplicaState.initial(SMALL), a.fitness[::-1])
    assert other.digest() != a.state.digest()


def test_chunk_results_do_not_depend_on_who_evaluates_them(data_dir: Path) -> None:
    dataset = load_data_dir(data_dir)
    one = NumpyBackend(dataset, ReplicaState.initial(SMALL))
    two = NumpyBackend(dataset, ReplicaState.initial(SMALL), batch_members=2)
    for chunk in range(SMALL.chunks):
        r1 = one.evaluate_chunk(0, chunk * 8, 8)
        r2 = two.evaluate_chunk(0, chunk * 8, 8)
        assert r1.fitness.tobytes() == r2.fitness.tobytes() and r1.loss_sum == r2.loss_sum
    with pytest.raises(ValueError, match="replica is at step 0"):
        one.evaluate_chunk(1, 0, 8)
    with pytest.raises(ValueError, match="bad member range"):
        one.evaluate_chunk(0, 3, 8)


def _cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("eggroll-train")
    return subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True, timeout=300)


def test_cli_runs_writes_summary_and_save_dir(data_dir: Path, tmp_path: Path) -> None:
    config = tmp_path / "small.toml"
    config.write_text(TRAIN_RUN)
    summaries = []
    for i in range(2):
        summary = tmp_path / f"summary{i}.json"
        save = tmp_path / f"run{i}"
        done = _cli(
            "--data-dir",
            data_dir,
            "--config",
            config,
            "--summary-json",
            summary,
            "--save-dir",
            save,
            "--log-format",
            "json",
        )
        assert done.returncode == 0, done.stderr
        summaries.append(json.loads(summary.read_text()))
        assert "held-out" in done.stderr and "replica digest" in done.stderr
    s = summaries[0]
    for key in (
        "steps",
        "valid_bits_per_token",
        "baselines",
        "replica_digest",
        "member_tokens_per_second",
        "seconds",
    ):
        assert key in s
    assert s["steps"] == 6 and set(s["baselines"]) == {"unigram", "bigram", "gzip9"}
    # Both held-out metrics over the same tokens, per token and per byte (bytes: equal).
    assert s["valid_tokens"] == s["valid_stream_tokens"] > 0
    assert s["valid_bits_per_byte"] == s["valid_bits_per_token"]
    assert s["valid_stream_bits_per_byte"] == s["valid_stream_bits_per_token"]
    assert s["valid_stream_bits_per_token"] != s["valid_bits_per_token"]
    assert s["curve"][-1] == {"step": 6, **{k[6:]: v for k, v in s.items() if k[:6] == "valid_"}}
    assert "long streams" in done.stderr
    assert summaries[0]["replica_digest"] == summaries[1]["replica_digest"]
    # The save dir holds the run: replaying its fitness log reaches the same digest.
    log = FitnessLog.open(tmp_path / "run0" / "fitness.log")
    state = replay(ReplicaState.initial(SMALL), log.read(0, log.steps))
    assert state.digest_hex() == s["replica_digest"]
    snap = load_checkpoint(tmp_path / "run0" / "snapshots" / "step-00000006.ckpt")
    assert snap.digest_hex() == s["replica_digest"]
    lines = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    assert [ln["step"] for ln in lines if ln["event"] == "step"] == [1, 2, 3, 4, 5, 6]
    (last,) = [ln for ln in lines if ln["event"] == "validation" and ln["step"] == 6]
    assert last["stream_bits"] == round(s["valid_stream_bits_per_token"], 4)
    assert last["valid_bits_per_byte"] == round(s["valid_bits_per_byte"], 4)


def test_sigterm_stops_after_the_chunk_keeping_every_step_and_a_snapshot(
    spawn, data_dir: Path, tmp_path: Path
) -> None:
    """SIGTERM mid-run: exit 0 with one line saying what is kept; the fitness log holds the
    steps committed, a snapshot the last (with the newest of --snapshot-every's), and the
    same command continues to the digest of a run never stopped."""
    config = tmp_path / "small.toml"
    config.write_text(TRAIN_RUN)
    save = tmp_path / "run"
    flags = ("--data-dir", data_dir, "--config", config, "--save-dir", save)
    run = spawn("eggroll-train", *flags, "--steps", "100000", "--snapshot-every", "2")
    run.wait_for(lambda e: e.get("event") == "step" and e["step"] >= 7, 60, "step 7")
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait(60) == 0, "\n".join(run.lines[-20:])
    steps = FitnessLog.open(save / "fitness.log").steps
    assert f"stopped at step {steps} (SIGTERM): steps 1..{steps} are kept" in run.lines[-1]
    snapshots = sorted(p.name for p in (save / "snapshots").iterdir())
    evens = [s for s in range(2, steps + 1, 2)]
    kept = sorted({*evens, steps})[-SNAPSHOTS_KEPT:]
    assert snapshots == [f"step-{s:08d}.ckpt" for s in kept]
    assert load_checkpoint(save / "snapshots" / snapshots[-1]).step == steps
    done = _cli(*flags, "--steps", steps + 2, "--summary-json", tmp_path / "s.json")
    assert done.returncode == 0, done.stderr
    digest = json.loads((tmp_path / "s.json").read_text())["replica_digest"]
    assert int(digest, 16) == trained_digest(data_dir, config, steps + 2)


def test_a_second_train_on_the_same_new_save_dir_is_refused_in_one_line(
    spawn, data_dir: Path, tmp_path: Path
) -> None:
    """A new run holds its save directory's writer lock from its start, as a resumed one
    does: a second eggroll-train on the same directory is refused in one line and writes
    nothing, and the first goes on undisturbed."""
    config = tmp_path / "small.toml"
    config.write_text(TRAIN_RUN)
    save = tmp_path / "run"
    flags = ("--data-dir", data_dir, "--config", config, "--save-dir", save)
    first = spawn("eggroll-train", *flags, "--steps", "100000", "--snapshot-every", "0")
    first.wait_for(lambda e: e.get("event") == "step" and e["step"] >= 1, 60, "step 1")
    second = _cli(*flags, "--steps", "1")
    assert second.returncode == 1 and "Traceback" not in second.stderr
    errors = [line for line in second.stderr.splitlines() if line.startswith("Error:")]
    assert errors == [
        f"Error: process {first.proc.pid} is writing to {save}: wait for it to end, or use "
        "another --save-dir"
    ]
    assert not (save / "summary.json").exists() and not list((save / "snapshots").iterdir())
    first.proc.send_signal(signal.SIGTERM)
    assert first.wait(60) == 0, "\n".join(first.lines[-20:])
    steps = FitnessLog.open(save / "fitness.log", repair=False).steps
    snapshot = load_checkpoint(save / "snapshots" / f"step-{steps:08d}.ckpt")
    assert snapshot.digest() == trained_digest(data_dir, config, steps)


def test_a_new_run_refused_before_it_writes_leaves_its_directory_as_it_was(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lock is taken before the goal is checked: a goal that fails then leaves no
    directory (or lock file) behind, and an empty directory given stays empty."""
    config = tmp_path / "small.toml"
    config.write_text(TRAIN_RUN)

    def failing(*args: object) -> None:
        raise RewardError("the reward does not import")

    monkeypatch.setattr(train_module, "make_objective", failing)
    empty = tmp_path / "empty"
    empty.mkdir()
    for save in (tmp_path / "absent", empty):
        args = ["--data-dir", data_dir, "--config", config, "--save-dir", save]
        result = CliRunner().invoke(train_module.main, list(map(str, args)))
        assert result.exit_code == 1
        assert result.output.splitlines()[-1] == "Error: the reward does not import"
    assert not (tmp_path / "absent").exists() and list(empty.iterdir()) == []


def test_cli_errors_are_one_line(data_dir: Path, tmp_path: Path) -> None:
    done = _cli("--data-dir", tmp_path / "nothing", "--steps", "1")
    assert done.returncode == 1
    assert "Traceback" not in done.stderr and "eggroll-data prepare" in done.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text("[es]\npopulation = 7\n")
    done = _cli("--data-dir", data_dir, "--config", bad)
    assert done.returncode == 1 and "must be even" in done.stderr
    assert "Traceback" not in done.stderr
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("keep me")
    done = _cli("--data-dir", data_dir, "--config", bad.with_name("none.toml"), "--save-dir", busy)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert (busy / "x").read_text() == "keep me"


def test_vocab_mismatch_is_reported(data_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "data"
    shutil.copytree(data_dir, copy)
    config = tmp_path / "v.toml"
    config.write_text(TRAIN_RUN.replace("d_model = 16", "d_model = 16\nvocab_size = 300"))
    done = _cli("--data-dir", copy, "--config", config)
    assert done.returncode == 1 and "holds bytes (256 tokens)" in done.stderr


def test_member_noise_and_windows_are_shared_within_a_pair(data_dir: Path) -> None:
    from eggroll_dist.shared.window import pair_windows

    dataset = load_data_dir(data_dir)
    w = pair_windows(SMALL, dataset.train, 3, np.arange(4))
    assert w.shape == (4, SMALL.es.seq_len + 1)
    assert np.array_equal(w, pair_windows(SMALL, dataset.train, 3, np.arange(4)))
    assert not np.array_equal(w, pair_windows(SMALL, dataset.train, 4, np.arange(4)))


def test_long_steps_log_progress_and_every_step_an_eta(
    data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(train_module, "PROGRESS_S", 0.0)  # every chunk counts as "long"
    backend = NumpyBackend(load_data_dir(data_dir), ReplicaState.initial(SMALL), threads=1)
    with structlog.testing.capture_logs() as events:
        train(SMALL, backend, 2)
    progress = [e["chunks_done"] for e in events if e["event"] == "evaluating"]
    assert progress[: SMALL.chunks] == [f"{c + 1}/{SMALL.chunks}" for c in range(SMALL.chunks)]
    steps = [e for e in events if e["event"] == "step"]
    assert [e["step"] for e in steps] == [1, 2] and steps[-1]["eta_s"] == 0
    # with two threads the chunks go two at a time, and so does the progress
    backend = NumpyBackend(load_data_dir(data_dir), ReplicaState.initial(SMALL), threads=2)
    with structlog.testing.capture_logs() as events:
        train(SMALL, backend, 1)
    progress = [e["chunks_done"] for e in events if e["event"] == "evaluating"]
    assert progress == [f"{c}/{SMALL.chunks}" for c in range(2, SMALL.chunks + 1, 2)]


def test_a_population_too_large_is_one_line_and_leaves_no_save_dir(
    data_dir: Path, tmp_path: Path
) -> None:
    """A population whose step could never reach the workers is refused as the config is
    read: one line, no traceback, and nothing in --save-dir to refuse the corrected run."""
    huge = tmp_path / "huge.toml"
    huge.write_text(TRAIN_RUN.replace("population = 32", "population = 4000000000000"))
    save = tmp_path / "run"
    done = _cli("--data-dir", data_dir, "--config", huge, "--save-dir", save, "--steps", "1")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert "es.population=4,000,000,000,000 is above 134,217,728" in done.stderr
    assert not save.exists()
