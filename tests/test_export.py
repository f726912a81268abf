"""eggroll-export: a replica as safetensors + config.json (+ tokenizer.json), read back to
the same replica digest, and accepted by eggroll-sample as a source."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import safetensors
from click.testing import CliRunner, Result
from helpers import digest_at

from eggroll_dist.protocol.ternary import pack_ternary, unpack_ternary
from eggroll_dist.shared.config import ESConfig, ModelConfig, RunConfig, UpdateConfig
from eggroll_dist.shared.data import load_data_dir
from eggroll_dist.shared.fitness_log import FitnessLog
from eggroll_dist.shared.model import param_specs
from eggroll_dist.shared.replica import save_checkpoint
from eggroll_dist.shared.save_dir import Layout, SaveDir, new_run, write_run
from eggroll_dist.worker.data.build import prepare_tokenized_data_dir
from eggroll_dist.worker.export import main as export_main
from eggroll_dist.worker.export_format import ExportError, load_export
from eggroll_dist.worker.sample import main as sample_main

STEPS = 5


def _config(vocab: int = 256) -> RunConfig:
    return RunConfig(
        model=ModelConfig(vocab_size=vocab, n_layer=1, d_model=16),
        es=ESConfig(population=16, chunk_size=8, seq_len=8),
        update=UpdateConfig(rule="momentum", momentum_shift=2),  # a rule with state
    )


def _save_dir(root: Path, cfg: RunConfig, data_digest: bytes | None = None) -> Path:
    """A run of STEPS committed steps of random fitness, with a snapshot at step 2."""
    layout = Layout(root)
    layout.snapshots.mkdir(parents=True)
    write_run(layout, new_run(cfg, data_digest))
    log = FitnessLog.create(layout.fitness_log, cfg.pairs, cfg.digest())
    rng = np.random.default_rng(3)
    for step in range(STEPS):
        log.append(step, pack_ternary(rng.integers(-1, 2, cfg.pairs).astype(np.int8)))
    save_checkpoint(layout.snapshot(2), SaveDir.open(root).state_at(2, unpack_ternary))
    return root


def _export(*args: str | Path) -> Result:
    return CliRunner().invoke(export_main, [str(a) for a in args])


def test_an_export_round_trip_gives_the_same_replica(tmp_path: Path) -> None:
    cfg = _config()
    save = _save_dir(tmp_path / "run", cfg)
    out = tmp_path / "export"
    result = _export(save, "--out", out)
    assert result.exit_code == 0, result.output
    digest = f"{digest_at(save, STEPS):016x}"  # the last step by default
    assert f"step {STEPS} (snapshot 2 + 3 steps replayed), replica {digest}" in result.stdout
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    record = json.loads((out / "config.json").read_text())
    assert record["step"] == STEPS and record["replica_digest"] == digest
    assert record["architecture"] == "egg" and record["vocab"] == {
        "size": 256,
        "kind": "bytes",
        "tokenizer": None,
    }
    assert record["config_digest"] == cfg.digest().hex() and record["update_rule"] == "momentum"
    # Any safetensors reader opens it: the weights int8, the momentum int32, by name.
    names = [s.name for s in param_specs(cfg.model)]
    with safetensors.safe_open(str(out / "model.safetensors"), framework="np") as f:
        assert f.metadata()["replica_digest"] == digest and f.metadata()["step"] == str(STEPS)
        keys = set(f.keys())
        assert keys == set(names) | {f"momentum.{n}" for n in names}
        assert f.get_tensor("emb").dtype == np.int8
        assert f.get_tensor("momentum.emb").dtype == np.int32
    loaded = load_export(out)
    assert loaded.digest_hex() == digest and loaded.step == STEPS and loaded.config == cfg
    # An earlier step, and a checkpoint file as the source.
    assert _export(save, "--step", "3", "--out", tmp_path / "e3").exit_code == 0
    assert load_export(tmp_path / "e3").digest() == digest_at(save, 3)
    ckpt = Layout(save).snapshot(2)
    assert _export(ckpt, "--out", tmp_path / "e2").exit_code == 0
    assert load_export(tmp_path / "e2").digest() == digest_at(save, 2)


def test_eggroll_sample_reads_an_export(tmp_path: Path, words_data: Path) -> None:
    save = _save_dir(tmp_path / "run", _config())
    out = tmp_path / "export"
    assert _export(save, "--out", out).exit_code == 0
    args = ["--data-dir", str(words_data), "--prompt", "the", "--tokens", "6", "--json"]
    from_export = CliRunner().invoke(sample_main, [str(out), *args])
    from_run = CliRunner().invoke(sample_main, [str(save), "--step", str(STEPS), *args])
    assert from_export.exit_code == 0, from_export.output
    assert from_export.stdout == from_run.stdout
    assert f"step {STEPS} (export export)" in from_export.stderr


def test_a_damaged_export_is_refused(tmp_path: Path) -> None:
    save = _save_dir(tmp_path / "run", _config())
    out = tmp_path / "export"
    assert _export(save, "--out", out).exit_code == 0
    record = json.loads((out / "config.json").read_text())
    record["step"] = 4  # the tensors are those of step 5
    (out / "config.json").write_text(json.dumps(record))
    with pytest.raises(ExportError, match="not of one export"):
        load_export(out)


def test_a_bpe_export_carries_its_tokenizer(
    tmp_path: Path, words_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "the", "of", "and"]
    docs = [" ".join(rng.choice(words) for _ in range(300)).encode() for _ in range(30)]
    data = tmp_path / "bpe"
    prepare_tokenized_data_dir(lambda: iter(docs), data, "test:bpe", None, vocab_size=300)
    meta = load_data_dir(data).meta
    save = _save_dir(tmp_path / "run", _config(meta.vocab_size), bytes.fromhex(meta.sha256))
    out = tmp_path / "export"
    monkeypatch.chdir(tmp_path)
    result = _export(save, "--out", out)  # no ./data: where is the tokenizer?
    assert result.exit_code == 1 and "needs the tokenizer of its data directory" in result.output
    result = _export(save, "--out", out, "--data-dir", words_data)  # bytes, not the run's
    assert result.exit_code == 1 and "the model reads a 284-token vocabulary" in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert len(errors) == 1 and "Traceback" not in result.output
    result = _export(save, "--out", out, "--data-dir", data)
    assert result.exit_code == 0, result.output
    assert (out / "tokenizer.json").read_bytes() == (data / "tokenizer.json").read_bytes()
    vocab = json.loads((out / "config.json").read_text())["vocab"]
    assert vocab == {"size": meta.vocab_size, "kind": "bpe", "tokenizer": "tokenizer.json"}
    assert json.loads((out / "config.json").read_text())["data_digest"] == meta.sha256


def test_out_is_never_written_over_silently_and_lora_needs_an_hf_run(tmp_path: Path) -> None:
    save = _save_dir(tmp_path / "run", _config())
    out = tmp_path / "export"
    out.mkdir()  # empty: fine
    assert _export(save, "--out", out).exit_code == 0
    before = (out / "model.safetensors").read_bytes()
    for args in (("--step", "3"), ("--lora", "2")):
        result = _export(save, *args, "--out", out)
        lines = result.output.strip().splitlines()
        assert result.exit_code == 1 and len(lines) == 1, result.output
        assert lines[0] == (
            f"Error: --out {out} is not empty: name a new or empty directory, or add --force "
            "to write over files of the same names"
        )
    assert (out / "model.safetensors").read_bytes() == before
    result = _export(save, "--lora", "2", "--out", tmp_path / "lora")
    lines = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert result.exit_code == 1 and len(lines) == 1 and "Traceback" not in result.output
    assert "--lora exports a Hugging Face run (model.arch='hf')" in lines[0]
    assert "model.arch='egg' run" in lines[0] and not (tmp_path / "lora").exists()
    assert _export(save, "--step", "3", "--out", out, "--force").exit_code == 0
    assert load_export(out).digest() == digest_at(save, 3)
