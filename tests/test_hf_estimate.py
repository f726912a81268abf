"""eggroll-tune's memory estimate (worker/hf_estimate.py): an 8B Llama's shape from its
config.json alone fits one 80 GB GPU, a run that cannot fit is refused before anything loads
with a line naming the setting to lower, the shapes of the tiny test models give their real
targets, parameter counts and snapshot sizes, and the host estimate is within 15% of the
peak resident memory of a real eggroll-tune run. A GPU peak cannot be measured on a CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from helpers import command  # noqa: E402
from hf_models import save_model  # noqa: E402

from eggroll_dist.shared.hf import select_targets  # noqa: E402
from eggroll_dist.shared.hf_dir import parameter_count, pinned_matrices  # noqa: E402
from eggroll_dist.worker.hf_estimate import (  # noqa: E402
    EstimateError,
    estimate,
    estimate_run,
    read_shape,
    workload,
)
from eggroll_dist.worker.hf_model import load_tokenizer  # noqa: E402
from eggroll_dist.worker.tune import TuneSettings, main, tune_config  # noqa: E402

LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
PROMPTS = "the quick\na bird\nevery good\nthe lazy\nfox\nhand\ntwo in\neggs are\nbush\nworth\n"
TINY_RUN = (
    "--reward", "builtin:letter_e", "--prompts", "prompts.txt", "--population", "32",
    "--rank", "2", "--completion-tokens", "8", "--prompts-per-step", "4",
    "--valid-tokens", "256", "--threads", "1",
)  # fmt: skip


def settings(model: Path, **changes: object) -> TuneSettings:
    """eggroll-tune's defaults for a reward run, with `changes`."""
    values: dict[str, object] = dict(
        model_dir=model, reward=("builtin:letter_e",), prompts=Path("prompts.txt"),
        population=32, chunk_size=None, rank=8, sigma=0.01, lr=1.0, targets=(), seed=0,
        seq_len=32, prompts_per_step=8, completion_tokens=32, temperature=1.0,
        valid_tokens=4096, validate_every=25,
    )  # fmt: skip
    values.update(changes)
    return TuneSettings(**values)  # type: ignore[arg-type]


@pytest.fixture
def llama_8b(tmp_path: Path) -> Path:
    """A directory holding only Llama-3.1-8B's config.json: no weights, no tokenizer."""
    (tmp_path / "llama-8b").mkdir()
    (tmp_path / "llama-8b" / "config.json").write_text(json.dumps(LLAMA_8B))
    return tmp_path / "llama-8b"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny GPT-2 and Llama of tests/hf_models.py, and a prompts file."""
    root = tmp_path_factory.mktemp("estimate")
    save_model(root / "gpt2", "gpt2")
    save_model(root / "llama", "llama")
    (root / "prompts.txt").write_text(PROMPTS)
    return root


def test_an_8b_llama_with_population_64_fits_one_80gb_gpu(llama_8b: Path) -> None:
    cfg = tune_config(settings(llama_8b, population=64, rank=8))
    est = estimate_run(llama_8b, cfg, "cuda", [48] * 80)  # 80 prompts of 48 tokens
    shape = read_shape(llama_8b)
    model_bytes = shape.parameters * 2
    assert 8.0e9 < shape.parameters < 8.1e9  # Llama-3.1-8B: 8.03 B
    assert est.part("weights") == model_bytes  # bfloat16 on a GPU
    assert est.part("reserve") > 0
    assert model_bytes < est.gpu_bytes < 80e9
    assert est.host_bytes <= 2.2 * model_bytes
    # the host holds the state, the targets' bfloat16 weights, once: 6.98 B of them
    assert est.part("state") == sum(o * i for _, (o, i) in shape.linear[:-1]) * 2
    assert est.shortfall(80 * 10**9, 128 * 2**30) is None
    assert est.shortfall(16 * 2**30, None) is not None  # the weights alone do not fit
    lines = est.lines()
    assert [line.split()[0] for line in lines] == ["model", "run", "GPU", "host", "snapshot"]


def test_longer_completions_need_more_and_a_run_too_big_names_the_setting(
    llama_8b: Path,
) -> None:
    small = estimate_run(llama_8b, tune_config(settings(llama_8b, population=64)), "cuda")
    cfg = tune_config(
        settings(llama_8b, population=4096, prompts_per_step=16, completion_tokens=1024)
    )
    big = estimate_run(llama_8b, cfg, "cuda")
    assert big.part("KV caches and graphs") > 4 * small.part("KV caches and graphs")
    assert big.part("weights") == small.part("weights")
    line = big.shortfall(80 * 10**9, 128 * 2**30)
    assert line is not None and "GPU memory" in line
    assert "--prompts-per-step" in line and "--completion-tokens" in line
    # the weights alone past a GPU's memory: a smaller model, whatever the settings
    line = small.shortfall(8 * 2**30, None)
    assert line is not None and "a smaller model" in line


def test_eggroll_tune_refuses_a_run_that_cannot_fit_before_loading(tmp_path: Path) -> None:
    """A model whose weights fit anywhere, with completions whose KV caches fit nowhere; the
    directory has no weights, so a run that went as far as loading would fail otherwise."""
    config = dict(LLAMA_8B, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                  num_attention_heads=8, head_dim=64, vocab_size=32000,
                  max_position_embeddings=16384)  # fmt: skip
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    (tmp_path / "prompts.txt").write_text(PROMPTS)
    done = subprocess.run(
        [command("eggroll-tune"), "model", "--reward", "builtin:letter_e", "--prompts",
         "prompts.txt", "--population", "64", "--prompts-per-step", "128",
         "--completion-tokens", "4096", "--steps", "1"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: the run needs about"), lines
    assert "--completion-tokens" in lines[0]


def test_estimate_prints_the_parts_and_its_exit_status_says_whether_it_fits(
    llama_8b: Path,
) -> None:
    runner = CliRunner()
    done = runner.invoke(main, [str(llama_8b), "--estimate", "--population", "64", "--rank", "8"])
    assert done.exit_code in (0, 1), done.output
    keys = [line.split()[0] for line in done.output.splitlines()]
    assert keys[:2] == ["model", "run"] and keys[-3:] == ["snapshot", "device", "fits"]
    fits = done.output.splitlines()[-1].split()[1]
    assert fits == ("yes" if done.exit_code == 0 else "no:")
    # a run that fits nowhere exits 1 and says which setting to lower
    done = runner.invoke(
        main,
        [str(llama_8b), "--estimate", "--population", "64", "--prompts-per-step", "256",
         "--completion-tokens", "4096"],
    )  # fmt: skip
    assert done.exit_code == 1
    assert done.output.splitlines()[-1].startswith("fits      no: the run needs about")


def test_help_documents_estimate_and_a_run_still_needs_a_reward(tmp_path: Path) -> None:
    runner = CliRunner()
    text = " ".join(runner.invoke(main, ["--help"]).output.split())
    assert "--estimate" in text and "whether it fits" in text
    done = runner.invoke(main, [str(tmp_path), "--population", "8"])
    assert done.exit_code == 2 and "Missing option '--reward'" in done.output


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_shape_gives_the_models_targets_weights_and_snapshot_size(
    tiny: Path, family: str
) -> None:
    model = tiny / family
    shape = read_shape(model)
    assert shape.parameters == parameter_count(model)
    for patterns in [(), ("*.mlp.*",)]:
        chosen = select_targets(shape.linear, patterns, 2)
        assert [f"{t.name} {t.shape[0]} {t.shape[1]}" for t in chosen] == list(
            pinned_matrices(model, patterns, 2)
        )
    with pytest.raises(EstimateError, match="rank 99 is above"):
        estimate_run(model, tune_config(settings(model, rank=99)), "cpu")


def test_an_unknown_model_type_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 8}))
    with pytest.raises(EstimateError, match="no memory estimate for model_type 'bert'"):
        read_shape(tmp_path)


def test_the_estimate_grows_with_the_batch_and_not_with_the_population_past_it(
    llama_8b: Path,
) -> None:
    shape = read_shape(llama_8b)
    chosen = select_targets(shape.linear, (), 8)

    def gpu(**changes: object) -> int:
        work = workload(tune_config(settings(llama_8b, **changes)), "cuda", [64] * 80)
        return estimate(shape, work, chosen, 0).gpu_bytes

    assert gpu(population=16) < gpu(population=64) == gpu(population=4096)
    assert gpu(prompts_per_step=4) < gpu(prompts_per_step=8) < gpu(prompts_per_step=16)


# eggroll-tune in a child that writes its own peak resident size (VmHWM) as it exits. Not
# the child's rusage: a forked child's ru_maxrss starts at its parent's size (Linux keeps
# the pre-exec high-water mark), which a test process grown by other tests would dominate.
PEAK = """
import atexit, sys
from pathlib import Path
def peak():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            Path(out).write_text(line.split()[1])
out, sys.argv = sys.argv[1], ["eggroll-tune", *sys.argv[2:]]
atexit.register(peak)
from eggroll_dist.worker.tune import main
main()
"""


def peak_rss(args: list[str], cwd: Path) -> int:
    """The peak resident memory of eggroll-tune run to its end with `args`, in bytes."""
    out = cwd / "peak-kib"
    out.unlink(missing_ok=True)
    done = subprocess.run(
        [sys.executable, "-c", PEAK, str(out), *args], cwd=cwd, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return int(out.read_text()) * 1024  # VmHWM is in kB


@pytest.mark.skipif(sys.platform != "linux", reason="VmHWM is read from /proc")
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_host_estimate_is_within_15_percent_of_a_real_runs_peak(
    tiny: Path, tmp_path: Path, family: str
) -> None:
    """Tiny models are the fixed part of the process (imports, tokenizer, the run's
    machinery), which the estimate measures where it runs: `eggroll-tune --estimate` and the
    run, each in a fresh process of this installation. The snapshot's size is exact."""
    run = tmp_path / "run"
    peak = peak_rss([family, *TINY_RUN, "--steps", "2", "--save-dir", str(run)], tiny)
    printed = subprocess.run(
        [command("eggroll-tune"), family, *TINY_RUN, "--estimate"],
        cwd=tiny, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert printed.returncode == 0, printed.stderr
    host = _bytes(_line(printed.stdout, "host").split(":")[0])
    assert abs(host - peak) <= 0.15 * peak, (host, peak)
    (snapshot,) = (run / "snapshots").iterdir()
    snap = _line(printed.stdout, "snapshot").split(" each")[0]
    assert abs(_bytes(snap) - snapshot.stat().st_size) <= 0.05 * 1024  # printed to 0.1 KiB
    cfg = tune_config(
        settings(Path(family), population=32, rank=2, completion_tokens=8,
                 prompts_per_step=4, valid_tokens=256)
    )  # fmt: skip
    tokenizer = load_tokenizer(tiny / family)
    lengths = [
        len(tokenizer.encode(line, add_special_tokens=False)) for line in PROMPTS.splitlines()
    ]
    assert estimate_run(tiny / family, cfg, "cpu", lengths).snapshot_bytes == (
        snapshot.stat().st_size
    )


def _line(text: str, key: str) -> str:
    """What `eggroll-tune --estimate` printed after `key`."""
    (line,) = [ln for ln in text.splitlines() if ln.split(maxsplit=1)[:1] == [key]]
    return line[len(key) :].strip()


def _bytes(human: str) -> float:
    """'387.1 MiB' as bytes."""
    value, unit = human.split()
    return float(value) * {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[unit]


def test_the_estimate_imports_no_torch() -> None:
    """eggroll-tune estimates before anything loads; a coordinator may have no torch."""
    code = (
        "import sys, eggroll_dist.worker.hf_estimate; "
        "print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr
