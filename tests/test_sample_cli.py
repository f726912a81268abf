"""`eggroll-sample` on a real save directory, and the samples in the eggroll-train log."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner, Result

from eggroll_dist.protocol.ternary import unpack_ternary
from eggroll_dist.shared.config import ESConfig, ModelConfig, RunConfig, ValidationConfig
from eggroll_dist.shared.data import (
    DataMeta,
    load_data_dir,
    tokens_digest,
    write_decoding,
    write_meta,
    write_tokens,
)
from eggroll_dist.shared.replica import ReplicaState, save_checkpoint
from eggroll_dist.shared.sample import TrainingSamples
from eggroll_dist.shared.save_dir import Layout, SaveDir
from eggroll_dist.shared.vocab import escape
from eggroll_dist.worker.backend.numpy_backend import NumpyBackend
from eggroll_dist.worker.data.build import prepare_data_dir
from eggroll_dist.worker.sample import main
from eggroll_dist.worker.train import train

TOML = """
steps = 4
[model]
n_layer = 1
d_model = 16
[es]
population = 32
chunk_size = 8
seq_len = 12
[validation]
every_steps = 0
max_tokens = 600
"""
SMALL = RunConfig(
    model=ModelConfig(n_layer=1, d_model=16),
    es=ESConfig(population=32, chunk_size=8, seq_len=12),
    validation=ValidationConfig(every_steps=0, max_tokens=600),
    steps=4,
)


@pytest.fixture(scope="module")
def run(words_data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """A 4-step run saved by eggroll-train with a sample every 2 steps, and its log."""
    root = tmp_path_factory.mktemp("run")
    (root / "small.toml").write_text(TOML)
    exe = Path(sys.executable).with_name("eggroll-train")
    args = ["--data-dir", words_data, "--config", root / "small.toml", "--save-dir", root / "save"]
    done = subprocess.run(
        [str(exe), *map(str, args), "--sample-every", "2", "--log-format", "json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    events = [json.loads(ln) for ln in done.stderr.splitlines() if ln.startswith("{")]
    return root / "save", [e for e in events if e["event"] == "sample"]


def _sample(*args: str | Path) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args])


def _json(*args: str | Path) -> list[dict]:
    result = _sample(*args, "--json")
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in result.stdout.splitlines()]


def test_training_log_samples_are_what_eggroll_sample_writes(run, words_data: Path) -> None:
    save, samples = run
    assert [s["step"] for s in samples] == [2, 4]
    for s in samples:
        # Step 2 has no snapshot (replayed from the log), step 4 is the final snapshot.
        step = str(s["step"])
        (record,) = _json(save, "--data-dir", words_data, "--step", step, "--seed", step)
        assert escape(record["prompt"], keep_newlines=False) == s["prompt"]
        assert escape(record["text"], keep_newlines=False) == s["text"]
        assert len(record["tokens"]) == 64 and record["step"] == s["step"]
        assert record["prompt_tokens"] == list(load_data_dir(words_data).valid[1:13])


def test_same_tokens_twice_and_after_a_replay_of_the_fitness_log(run, words_data, tmp_path):
    save, _ = run
    args = ["--data-dir", words_data, "--prompt", "the eggroll", "--count", "3", "--seed", "9"]
    first = _json(save, *args)
    assert first == _json(save, *args)  # the same inputs, twice
    assert len({tuple(r["tokens"]) for r in first}) == 3  # three different samples
    # No snapshot at all: the state is replayed from the fitness log, and samples agree.
    bare = tmp_path / "bare"
    shutil.copytree(save, bare)
    shutil.rmtree(bare / "snapshots")
    (bare / "snapshots").mkdir()
    replayed = _json(bare, *args)
    assert [r["tokens"] for r in replayed] == [r["tokens"] for r in first]
    assert replayed[0]["replica_digest"] == first[0]["replica_digest"]
    # The checkpoint file alone gives the same.
    ckpt = save / "snapshots" / "step-00000004.ckpt"
    assert [r["tokens"] for r in _json(ckpt, *args)] == [r["tokens"] for r in first]
    assert _json(save, *args, "--step", "3")[0]["tokens"] != first[0]["tokens"]


def test_terminal_output_streams_escaped_text(run, words_data: Path) -> None:
    save, _ = run
    hostile = "\x1b[2J\x1b]0;\x07\rok"  # clear screen, set title, carriage return
    result = _sample(save, "--data-dir", words_data, "--prompt", hostile, "--tokens", "200")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert out.startswith("\\x1b[2J\\x1b]0;\\x07\\x0dok")
    assert not any(chr(c) in out for c in [*range(9), *range(11, 32), *range(127, 160)])
    assert "step 4 (snapshot 4)" in result.stderr and "temperature 0.6" in result.stderr
    (record,) = _json(save, "--data-dir", words_data, "--prompt", hostile, "--tokens", "200")
    assert out == escape(record["prompt"] + record["text"]) + "\n"


def test_a_prompt_longer_than_the_context_is_cut_and_said_so(run, words_data: Path) -> None:
    save, _ = run
    long_prompt = "0123456789" * 3
    result = _sample(save, "--data-dir", words_data, "--prompt", long_prompt, "--tokens", "5")
    assert result.exit_code == 0, result.output
    assert "prompt cut to its last 12 of 30 tokens" in result.stderr  # the context is 12
    (record,) = _json(save, "--data-dir", words_data, "--prompt", long_prompt, "--tokens", "5")
    assert record["prompt"] == long_prompt[-12:]
    (short,) = _json(save, "--data-dir", words_data, "--prompt", long_prompt[-12:], "--tokens", "5")
    assert short["tokens"] == record["tokens"]


def test_settings_flags_reach_the_sampler(run, words_data: Path) -> None:
    save, _ = run
    base = [save, "--data-dir", words_data, "--prompt", "", "--tokens", "30"]
    greedy = _json(*base, "--temperature", "0", "--seed", "1")[0]
    assert greedy["tokens"] == _json(*base, "--temperature", "0", "--seed", "2")[0]["tokens"]
    assert greedy["settings"]["temperature"] == "0" and greedy["prompt_tokens"] == []
    flags = ["--top-k", "1", "--min-p", "0"]  # top-k 1 ranks by the penalized logits
    assert _json(*base, *flags, "--seed", "5")[0]["tokens"] == greedy["tokens"]
    wild = _json(*base, "--temperature", "3", "--min-p", "0", "--frequency-penalty", "0.5")
    assert wild[0]["tokens"] != greedy["tokens"]
    assert wild[0]["settings"]["frequency_penalty"] == "0.5"


def _other_vocabulary(root: Path) -> tuple[Path, Path]:
    """A 300-token data directory without the bytes >= 0x80, and a model for it."""
    pieces = [b"\x00"] + [bytes([c]) for c in range(1, 128)]
    pieces += [bytes([97 + i % 26, 97 + i // 26 % 26]) for i in range(300 - len(pieces))]
    data = root / "data300"
    data.mkdir()
    rng = np.random.default_rng(0)
    train_ids, valid_ids = rng.integers(0, 300, 5000), rng.integers(0, 300, 500)
    write_tokens(data / "input.bin", train_ids, 300)
    write_tokens(data / "valid.bin", valid_ids, 300)
    write_decoding(data / "decoding.bin", pieces)
    digest = tokens_digest(train_ids, valid_ids, 300).hex()
    write_meta(data / "meta.json", DataMeta(1, 300, 5000, 500, digest, "test", 1, 1))
    cfg = SMALL.replace(model=ModelConfig(vocab_size=300, n_layer=1, d_model=16))
    save_checkpoint(root / "m300.ckpt", ReplicaState.initial(cfg))
    return data, root / "m300.ckpt"


def test_errors_are_one_clear_line(run, words_data: Path, tmp_path: Path) -> None:
    save, _ = run
    data300, model300 = _other_vocabulary(tmp_path)
    (tmp_path / "p.txt").write_text("hi")
    cases = [
        ((save, "--data-dir", words_data, "--step", "9"), "--step 9 is not in"),
        ((save, "--data-dir", words_data, "--step", "-1"), "--step -1 is not in"),
        ((tmp_path / "nope", "--data-dir", words_data), "does not exist"),
        ((tmp_path, "--data-dir", words_data), "no run.json"),
        ((save, "--data-dir", tmp_path / "none"), "does not exist"),
        (
            (save, "--data-dir", words_data, "--prompt", "a", "--prompt-file", tmp_path / "p.txt"),
            "not both",
        ),
        ((save, "--data-dir", words_data, "--temperature", "hot"), "--temperature must be"),
        (
            (save, "--data-dir", words_data, "--prompt-file", tmp_path / "missing.txt"),
            "cannot read --prompt-file",
        ),
        (
            (save / "snapshots" / "step-00000004.ckpt", "--data-dir", words_data, "--step", "2"),
            "holds step 4, not 2",
        ),
        # A byte model given another vocabulary, and the reverse.
        ((save, "--data-dir", data300), "the model reads bytes (256 tokens) but"),
        ((model300, "--data-dir", words_data), "the model reads a 300-token vocabulary but"),
        # Text the vocabulary cannot express.
        (
            (model300, "--data-dir", data300, "--prompt", "abc é"),
            "prompt byte 4 (0xc3) is outside the vocabulary",
        ),
    ]
    for args, message in cases:
        result = _sample(*args)
        assert result.exit_code == 1, (args, result.output)
        assert message in result.output and "Traceback" not in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1
    ok = _json(model300, "--data-dir", data300, "--prompt", "abcab", "--tokens", "5")[0]
    assert ok["prompt_tokens"] == [154, 130, 98] and len(ok["tokens"]) == 5  # "ab" "ca" "b"


def test_sample_every_zero_writes_no_samples(words_data: Path) -> None:
    dataset = load_data_dir(words_data)
    state = ReplicaState.initial(SMALL)
    off = TrainingSamples(0, dataset.valid, dataset.decoding)
    assert train(SMALL, NumpyBackend(dataset, state), 2, samples=off).samples == []
    every = TrainingSamples(1, dataset.valid, dataset.decoding)
    result = train(SMALL, NumpyBackend(dataset, state), 2, samples=every)
    assert [s["step"] for s in result.samples] == [1, 2]
    assert result.samples[0]["prompt"] == bytes(dataset.valid[1:13]).decode()


def test_the_data_dir_defaults_to_data_and_must_be_the_runs(
    run, words_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save, _ = run
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").symlink_to(words_data)
    args = ["--prompt", "the", "--tokens", "5"]
    assert _json(save, *args) == _json(save, *args, "--data-dir", words_data)
    # Other text of the same vocabulary: refused in one line naming both digests.
    other = tmp_path / "other"
    prepare_data_dir([b"other text %d " % i * 50 for i in range(20)], other, "test:other")
    result = _sample(save, *args, "--data-dir", other)
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1
    theirs, ours = load_data_dir(other).meta.sha256[:16], load_data_dir(words_data).meta.sha256
    assert f"{other} holds data {theirs}, the run was trained on {ours[:16]}" in result.output


def test_a_corrupt_newest_snapshot_gives_way_to_an_older_one(
    run, words_data: Path, tmp_path: Path
) -> None:
    save, _ = run
    args = ["--data-dir", words_data, "--prompt", "the", "--tokens", "8"]
    (good,) = _json(save, *args)
    copy = tmp_path / "copy"
    shutil.copytree(save, copy)
    layout = Layout(copy)
    save_checkpoint(layout.snapshot(2), SaveDir.open(copy).state_at(2, unpack_ternary))
    newest = layout.snapshot(4)
    newest.write_bytes(newest.read_bytes()[:-10])  # a copy cut short
    result = _sample(copy, *args, "--json")
    assert result.exit_code == 0, result.output
    assert f"warning: {newest} cannot be used (checkpoint is truncated" in result.stderr
    (record,) = [json.loads(line) for line in result.stdout.splitlines()]
    assert record["tokens"] == good["tokens"] and record["step"] == 4
    assert record["replica_digest"] == good["replica_digest"]
    # The file itself as the source: one line that names it and says what is wrong.
    result = _sample(newest, *args)
    assert result.exit_code == 1 and f"{newest}: checkpoint is truncated" in result.output
