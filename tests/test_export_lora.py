"""eggroll-export --lora: a Hugging Face run's change of its target matrices as a PEFT LoRA
adapter. peft.PeftModel.from_pretrained loads it on the base model; merged, it gives the
merged export's weights up to each target's reported truncation error (and its logits at
full rank); the errors are printed and stored; refusals are one line. Tiny GPT-2 (Conv1D)
and Llama (nn.Linear) models are built here and tuned for a few steps in real processes."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
safetensors_torch = pytest.importorskip("safetensors.torch")

from click.testing import CliRunner, Result  # noqa: E402
from helpers import command  # noqa: E402
from hf_models import save_model  # noqa: E402

from eggroll_dist.shared.save_dir import SaveDir  # noqa: E402
from eggroll_dist.worker.export import main as export_main  # noqa: E402

# Few steps of few pairs on tiny models; an adapter of rank min(out, in) over the targets
# (FULL_RANK) holds any change exactly, stochastic rounding's included.
RUNS = {
    "gpt2": ("--population", "8", "--rank", "2", "--steps", "3"),
    "llama": ("--population", "8", "--rank", "1", "--steps", "2"),
}
FULL_RANK = {"gpt2": 32, "llama": 16}  # min(out, in) over the targets
IDS = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 8, 61, 120]])


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, words_data: Path) -> Path:
    """A folder with tiny `gpt2` and `llama` models and a short perplexity run of each
    (`gpt2-run`, `llama-run`), whose config records the model path `gpt2` / `llama`."""
    root = tmp_path_factory.mktemp("lora")
    for family, flags in RUNS.items():
        save_model(root / family, family, initializer_range=0.3)
        done = subprocess.run(
            [
                *(command("eggroll-tune"), family, "--reward", "perplexity"),
                *("--data-dir", str(words_data), "--sigma", "0.05", "--lr", "2"),
                *("--seq-len", "16", "--valid-tokens", "64", "--validate-every", "0"),
                *("--threads", "1", "--save-dir", f"{family}-run", *flags),
            ],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=root,
        )
        assert done.returncode == 0, done.stderr[-3000:]
    return root


def _export(root: Path, *args: str | Path) -> Result:
    """eggroll-export in this process, from `root` (the runs' recorded model paths are
    relative to it)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        return CliRunner().invoke(export_main, [str(a) for a in args])


def _one_line_error(result: Result, message: str) -> None:
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert len(lines) == 1 and lines[0].startswith("Error: ") and message in lines[0], lines


def _model(path: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _logits(model: Any) -> Any:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def _lora(root: Path, family: str, out: Path, rank: int) -> tuple[dict[str, float], Any]:
    """Export the run's adapter at `rank`; (the errors it printed, the base model with the
    adapter loaded by PEFT and merged)."""
    result = _export(root, f"{family}-run", "--lora", rank, "--out", out)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert all(line.strip() for line in lines) and "Loading weights" not in result.output
    printed = {}
    for line in lines[:-1]:  # one line per target, then what was written
        name, _, error = line.partition(" (")
        printed[name] = float(error.rpartition("relative error ")[2])
    assert lines[-1].startswith(f"wrote {out}: step ") and f"rank-{rank} LoRA adapter" in lines[-1]
    merged = peft.PeftModel.from_pretrained(_model(root / family), out).merge_and_unload()
    return printed, merged


@pytest.fixture(scope="module")
def merged(runs: Path) -> dict[str, Any]:
    """The merged export of each run, loaded by transformers."""
    models = {}
    for family in RUNS:
        out = runs / f"{family}-merged"
        result = _export(runs, f"{family}-run", "--out", out)
        assert result.exit_code == 0, result.output
        # one line: transformers' progress bars used to leave blank lines on a terminal
        assert len(result.output.splitlines()) == 1 and "Loading weights" not in result.output
        models[family] = _model(out)
    return models


@pytest.mark.parametrize("family", sorted(RUNS))
def test_a_full_rank_adapter_gives_the_merged_model(
    runs: Path, merged: dict[str, Any], family: str, tmp_path: Path
) -> None:
    rank, out = FULL_RANK[family], tmp_path / "lora"
    printed, model = _lora(runs, family, out, rank)
    cfg = SaveDir.open(runs / f"{family}-run").config
    targets = [entry.split(" ") for entry in cfg.model.matrices]
    names = [name for name, _, _ in targets]
    assert sorted(p.name for p in out.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "eggroll_lora.json",
    ]
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == rank and config["lora_alpha"] == rank
    assert config["target_modules"] == names and config["base_model_name_or_path"] == family
    assert config["fan_in_fan_out"] is (family == "gpt2")  # GPT-2's Conv1D stores (in, out)
    tensors = safetensors_torch.load_file(out / "adapter_model.safetensors")
    expected = {}
    for name, rows, cols in targets:
        expected[f"base_model.model.{name}.lora_A.weight"] = (rank, int(cols))
        expected[f"base_model.model.{name}.lora_B.weight"] = (int(rows), rank)
    assert {k: tuple(t.shape) for k, t in tensors.items()} == expected
    # the errors: printed, in eggroll_lora.json and in the safetensors header, all ~0
    record = json.loads((out / "eggroll_lora.json").read_text())
    errors = {name: t["relative_error"] for name, t in record["targets"].items()}
    assert list(printed) == names and list(errors) == names
    assert all(printed[n] == pytest.approx(errors[n], rel=1e-2, abs=1e-12) for n in names)
    assert max(errors.values()) < 1e-6 and min(t["norm"] for t in record["targets"].values()) > 0
    with open(out / "adapter_model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert json.loads(header["__metadata__"]["eggroll_lora"]) == record
    assert record["rank"] == rank and record["step"] == SaveDir.open(runs / f"{family}-run").steps
    # PEFT's merged model is the merged export: the logits agree in fp32
    want = _logits(merged[family])
    assert (want - _logits(_model(runs / family))).abs().max() > 1e-2  # the run moved them
    torch.testing.assert_close(_logits(model), want, rtol=0, atol=1e-4)


def test_a_truncated_adapter_misses_by_its_reported_errors(
    runs: Path, merged: dict[str, Any], tmp_path: Path
) -> None:
    printed, model = _lora(runs, "gpt2", tmp_path / "lora", 4)
    record = json.loads((tmp_path / "lora" / "eggroll_lora.json").read_text())["targets"]
    base = dict(_model(runs / "gpt2").named_modules())
    ours, theirs = dict(model.named_modules()), dict(merged["gpt2"].named_modules())
    for name, entry in record.items():
        change = (theirs[name].weight - base[name].weight).detach().double()
        missed = (theirs[name].weight.double() - ours[name].weight.double()).detach()
        measured = float(missed.norm() / change.norm())
        assert 0.05 < entry["relative_error"] < 1, entry  # a real truncation
        assert measured == pytest.approx(entry["relative_error"], abs=1e-5)
        assert printed[name] == pytest.approx(entry["relative_error"], rel=1e-2)
        assert entry["norm"] == pytest.approx(float(change.norm()), rel=1e-4)
    # The logits are about linear in the change at this size: the adapter misses the merged
    # model's logits by about the largest fraction of the change it leaves out.
    want, base_logits = _logits(merged["gpt2"]), _logits(_model(runs / "gpt2"))
    worst = max(entry["relative_error"] for entry in record.values())
    assert (_logits(model) - want).norm() <= 1.5 * worst * (base_logits - want).norm()


def test_no_change_is_an_adapter_of_zeros_with_no_error(runs: Path, tmp_path: Path) -> None:
    result = _export(runs, "llama-run", "--step", "0", "--lora", 2, "--out", tmp_path / "zero")
    assert result.exit_code == 0, result.output
    assert "largest relative error 0 " in result.output  # step 0: the base model
    record = json.loads((tmp_path / "zero" / "eggroll_lora.json").read_text())["targets"]
    assert all(t["relative_error"] == 0 and t["norm"] == 0 for t in record.values())
    zero = peft.PeftModel.from_pretrained(_model(runs / "llama"), tmp_path / "zero")
    torch.testing.assert_close(
        _logits(zero.merge_and_unload()), _logits(_model(runs / "llama")), rtol=0, atol=0
    )


def test_refusals_are_one_line(runs: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = _export(runs, "gpt2-run", "--lora", 33, "--out", out)
    _one_line_error(result, "--lora 33 is above the size of target transformer.h.0.attn.c_attn")
    assert not out.exists()
    # another model's config.json: the adapter would name modules of another architecture
    shutil.copytree(runs / "llama", tmp_path / "other")
    result = _export(runs, "gpt2-run", "--lora", 2, "--model-dir", tmp_path / "other", "--out", out)
    _one_line_error(result, "config.json differs from the run's")
    # --out is never written over silently, for an adapter or a merged model
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    for flags in (("--lora", "2"), ()):
        result = _export(runs, "gpt2-run", *flags, "--out", out)
        _one_line_error(result, f"--out {out} is not empty")
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    result = _export(runs, "gpt2-run", "--lora", "2", "--out", out, "--force")
    assert result.exit_code == 0, result.output
    assert (out / "notes.txt").read_text() == "mine" and (out / "adapter_config.json").is_file()
