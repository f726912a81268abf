"""Print the numbers a refactor must not change, as sorted JSON lines, through the CLIs only.

Trains 24 tiny runs (EGG and former models, the ztest / momentum / adamw rules, adaptive and
token noise, the fitness filters, the next-token and reward objectives, and tiny random
Hugging Face GPT-2 and Llama models) with `eggroll-train` and `eggroll-tune`, and prints one
line per run: its config digest (16 hex), its replica digest, the sha256 of its save
directory's `fitness.log`, and every held-out number of its summary (and the train curve).
Then one line per built-in preset with its config digest (`eggroll-coordinator` creates the
run, `eggroll-inspect` reads it), and one line per data directory `eggroll-data` prepared.

The code is driven only through its console entry points, resolved from the installed
distribution's metadata (so `PYTHONPATH=/some/other/install` checks that code instead), in
subprocesses of this interpreter. The tiny Hugging Face models come from tests/hf_models.py.
Runs and their paths are deterministic, so two checkouts print the same lines exactly when
they compute the same numbers:

    python scripts/digest_check.py > before.jsonl       # on the old code
    python scripts/digest_check.py > after.jsonl        # on the new code
    diff before.jsonl after.jsonl

Options: --jobs N (runs side by side, default 2), --keep DIR (work there and keep it),
--only SUBSTRING (only the runs whose name contains it). Exit status 1 if any command failed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"  # hf_models.py: the tiny Hugging Face models
DIST = "eggroll-distributed"
TIMEOUT_S = 600.0

# --- the console entry points --------------------------------------------------------------


def _entry_points() -> dict[str, str]:
    """Console-script name -> 'module:attr' of the distribution first on sys.path (the one
    PYTHONPATH points at, else the installed one)."""
    dist = metadata.distribution(DIST)
    return {ep.name: ep.value for ep in dist.entry_points if ep.group == "console_scripts"}


ENTRY_POINTS: dict[str, str] = {}


def cli(name: str, *args: str | Path) -> list[str]:
    """The argv that runs console script `name` with this interpreter (and its environment)."""
    module, _, attr = ENTRY_POINTS[name].partition(":")
    code = (
        f"import sys; sys.argv[0] = {name!r}; import importlib; "
        f"obj = importlib.import_module({module!r})\n"
        f"for part in {attr.split('.')!r}: obj = getattr(obj, part)\n"
        "obj()"
    )
    return [sys.executable, "-c", code, *map(str, args)]


def child_env() -> dict[str, str]:
    """This environment without EGGROLL_* settings, one thread per library, offline."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EGGROLL_", "WANDB_"))}
    env.update(
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        OPENBLAS_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONHASHSEED="0",
    )
    return env


class CommandFailed(RuntimeError):
    pass


def run(argv: Sequence[str], cwd: Path, timeout: float = TIMEOUT_S) -> str:
    """Run a command in `cwd`; its stdout, or CommandFailed with the tail of its output."""
    done = subprocess.run(
        list(argv), cwd=cwd, env=child_env(), capture_output=True, text=True, timeout=timeout
    )
    if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-800:]
        raise CommandFailed(f"exit {done.returncode}: {tail}")
    return done.stdout


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- the inputs: data, prompts, a reward file, tiny Hugging Face models -------------------------

WORDS = ["alpha", "beta", "gamma", "delta", "the", "of", "and", "eggroll", "int8", "worker"]
EXTRA = ["(e)", "[x]", "{y}", "eggs", "here", "every", "seven"]  # letters and brackets to reward

PROMPTS = [
    "the quick",
    "a bird",
    "every good",
    "the lazy",
    "fox",
    "hand",
    "two in",
    "eggs are",
    "bush",
    "worth",
    "alpha beta",
    "gamma (",
    "delta [",
    "the {",
    "of and",
    "eggroll",
    "int8 worker",
    "here we",
    "seven",
    "gamma gamma",
    "beta the",
    "worker of",
    "and then",
    "the end",
]

SCORE_PY = '''"""A continuous reward: the mean of (code point mod 7) / 6 over the completion."""


def score(text: str) -> float:
    return sum(ord(c) % 7 for c in text) / (6 * len(text)) if text else 0.0
'''

HF_MODELS = """
import sys
from pathlib import Path

sys.path.insert(0, sys.argv[1])
from hf_models import save_model

for family in ("gpt2", "llama"):
    save_model(Path(family), family, initializer_range=0.3)
"""


def prepare_inputs(work: Path, hf: bool) -> list[dict[str, Any]]:
    """Write the corpus, prompts and reward file, prepare the data directories (bytes and a
    small BPE) with eggroll-data, build the Hugging Face models; one line per data dir."""
    rng = random.Random(0)
    with (work / "docs.jsonl").open("w") as f:
        for _ in range(40):
            text = " ".join(rng.choice(WORDS + EXTRA) for _ in range(400))
            f.write(json.dumps({"text": text}) + "\n")
    (work / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    (work / "score.py").write_text(SCORE_PY)
    common = ("docs.jsonl", "--valid-fraction", "0.2")
    bpe = ("--tokenizer", "bpe", "--vocab-size", "300")
    run(cli("eggroll-data", "prepare", *common, "--out", "bytes"), work)
    run(cli("eggroll-data", "prepare", *common, *bpe, "--out", "bpe"), work)
    if hf:
        run([sys.executable, "-c", HF_MODELS, str(TESTS)], work)
    lines = []
    for name in ("bytes", "bpe"):
        files = sorted(p for p in (work / name).iterdir() if p.is_file())
        lines.append(
            {"kind": "data", "name": name, "files": {p.name: sha256_file(p) for p in files}}
        )
    for name in ("gpt2", "llama") if hf else ():
        files = sorted(p for p in (work / name).iterdir() if p.is_file())
        lines.append(
            {"kind": "hf_model", "name": name, "files": {p.name: sha256_file(p) for p in files}}
        )
    return lines


# --- the 24 runs ------------------------------------------------------------------------------


def toml(steps: int, sections: dict[str, dict[str, Any]]) -> str:
    """A TOML run config of plain values."""

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return repr(v)

    out = [f"steps = {steps}"]
    for section, values in sections.items():
        out.append(f"[{section}]")
        out += [f"{k} = {value(v)}" for k, v in values.items()]
    return "\n".join(out) + "\n"


def merge(*parts: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for part in parts:
        for section, values in part.items():
            out.setdefault(section, {}).update(values)
    return out


# TRAIN_RUN of tests/helpers.py: a one-layer EGG of width 16, 32 members, two validations.
EGG = {
    "model": {"n_layer": 1, "d_model": 16},
    "es": {"population": 32, "chunk_size": 8, "seq_len": 12},
    "validation": {"every_steps": 3, "max_tokens": 600},
}
FORMER = merge(EGG, {"model": {"arch": "former"}})
BPE = {"model": {"vocab_size": 300}}
GAUSS = {"es": {"noise": "gaussian", "sigma_shift": 3}}
MOMENTUM = {"update": {"rule": "momentum", "momentum_shift": 2}}
ADAMW = {"update": {"rule": "adamw", "lr": 0.5, "lr_halve_steps": 2, "lr_halvings": 2}}
FILTERS = {"fitness": {"chunk_mean_filter": True, "adaptive_threshold": True}}
ADAPTIVE = {"es": {"adaptive_noise": True}}


def reward(name: str, prompts: str, **more: Any) -> dict[str, dict[str, Any]]:
    """The reward objective, with few and short completions."""
    fitness = {
        "objective": "reward",
        "reward": name,
        "prompts": prompts,
        "prompts_per_step": 2,
        "completion_tokens": 8,
        "held_out_prompts": 3,
        **more,
    }
    return {"fitness": fitness, "es": {"population": 16, "seq_len": 16}}


LETTER_E = reward("builtin:letter_e", "data")


@dataclass(frozen=True)
class Run:
    name: str
    tool: str  # "eggroll-train" (a TOML config) or "eggroll-tune" (its flags)
    data: str = "bytes"
    steps: int = 6
    config: dict[str, dict[str, Any]] = field(default_factory=dict)
    flags: tuple[str, ...] = ()  # eggroll-tune's, after MODEL_DIR (the first)
    hf: bool = False


def _train(name: str, *parts: dict[str, dict[str, Any]], data: str = "bytes") -> Run:
    return Run(name, "eggroll-train", data, 6, merge(*parts))


HF_TUNE_COMMON = ("--population", "8", "--rank", "2", "--sigma", "0.05", "--lr", "2")
HF_TUNE_COMMON += ("--valid-tokens", "96", "--validate-every", "2", "--seed", "3")


def _hf(name: str, family: str, fitness: dict[str, Any], **es: Any) -> Run:
    config = {
        "model": {"arch": "hf", "path": family, "rank": 2},
        "es": {"population": 8, "chunk_size": 4, "seq_len": 12, "sigma": 0.05, **es},
        "fitness": fitness,
        "update": {"lr": 2.0},
        "validation": {"every_steps": 2, "max_tokens": 96},
    }
    if not fitness:
        del config["fitness"]
    return Run(name, "eggroll-train", "bytes", 3, config, hf=True)


RUNS: list[Run] = [
    # EGG (model.arch = "egg"), byte data unless named bpe
    _train("egg-ztest", EGG),
    _train(
        "egg-ztest-gauss-2layer-const-alpha",
        EGG,
        GAUSS,
        {"model": {"n_layer": 2, "d_model": 32}, "update": {"alpha": 0.5}},
    ),
    _train(
        "egg-ztest-filters-seeds",
        EGG,
        FILTERS,
        {"model": {"init_seed": 7}, "es": {"run_seed": 5}, "data": {"data_seed": 3}},
    ),
    _train("egg-momentum-gauss", EGG, GAUSS, MOMENTUM),
    _train("egg-momentum-token-noise", EGG, MOMENTUM, {"es": {"token_noise_rows": 96}}),
    _train("egg-momentum-adaptive", EGG, MOMENTUM, ADAPTIVE, {"update": {"momentum_shift": 1}}),
    _train("egg-adamw", EGG, ADAMW),
    _train("egg-adamw-adaptive-filters", EGG, ADAMW, ADAPTIVE, FILTERS, GAUSS),
    _train(
        "egg-bpe-momentum-token-noise",
        EGG,
        BPE,
        MOMENTUM,
        {"es": {"token_noise_rows": 64}},
        data="bpe",
    ),
    _train("egg-reward-letter-e-data", EGG, LETTER_E),
    _train(
        "egg-reward-file-momentum",
        EGG,
        MOMENTUM,
        reward("score.py:score", "prompts.txt", temperature=700, min_p=50),
    ),
    _train(
        "egg-reward-brackets-adamw-greedy",
        EGG,
        ADAMW,
        reward("builtin:brackets", "prompts.txt", temperature=0),
    ),
    # former (d-eggs' transformer)
    _train("former-ztest", FORMER),
    _train(
        "former-ztest-2head-token-noise",
        FORMER,
        {"model": {"n_head": 2}, "es": {"token_noise_rows": 32}},
    ),
    _train(
        "former-momentum-gauss-bias-zero", FORMER, GAUSS, MOMENTUM, {"model": {"head_bias": "zero"}}
    ),
    _train(
        "former-bpe-momentum-zipf-token-noise",  # former-tiny in small
        FORMER,
        BPE,
        GAUSS,
        {"model": {"head_bias": "zipf"}, "es": {"token_noise_rows": 64}},
        {"update": {"rule": "momentum", "momentum_shift": 1}},
        data="bpe",
    ),
    _train(
        "former-adamw-adaptive-filters-2layer",  # d-eggs in small
        FORMER,
        ADAMW,
        ADAPTIVE,
        FILTERS,
        {"model": {"n_layer": 2, "n_head": 2}, "update": {"lr_halvings": 1}},
    ),
    _train(
        "former-bpe-adamw-adaptive-zipf",
        FORMER,
        BPE,
        ADAMW,
        ADAPTIVE,
        {"model": {"head_bias": "zipf"}, "es": {"token_noise_rows": 48}},
        data="bpe",
    ),
    _train("former-reward-letter-e-data", FORMER, LETTER_E, MOMENTUM),
    _train(
        "former-bpe-reward-file-adamw",
        FORMER,
        BPE,
        ADAMW,
        reward("score.py:score", "prompts.txt"),
        data="bpe",
    ),
    # Hugging Face (model.arch = "hf"): eggroll-tune's flags, and TOML configs for eggroll-train
    Run(
        "hf-gpt2-tune-reward-letter-e",
        "eggroll-tune",
        steps=3,
        flags=(
            "gpt2",
            "--reward",
            "builtin:letter_e",
            "--prompts",
            "prompts.txt",
            *HF_TUNE_COMMON,
            "--completion-tokens",
            "8",
            "--prompts-per-step",
            "2",
        ),
        hf=True,
    ),
    Run(
        "hf-llama-tune-perplexity",
        "eggroll-tune",
        steps=3,
        flags=(
            "llama",
            "--reward",
            "perplexity",
            *HF_TUNE_COMMON,
            "--seq-len",
            "12",
            "--target",
            "*.mlp.*",
        ),
        hf=True,
    ),
    _hf("hf-gpt2-train-next-token-gauss", "gpt2", {}, noise="gaussian", run_seed=1),
    _hf(
        "hf-llama-train-reward-file",
        "llama",
        {
            "objective": "reward",
            "reward": "score.py:score",
            "prompts": "prompts.txt",
            "prompts_per_step": 2,
            "completion_tokens": 6,
            "held_out_prompts": 3,
            "temperature": 800,
        },
    ),
]

# Besides the held-out numbers (valid_*) and the curve: the train losses or rewards per step.
TRAIN_KEYS = ("train_losses", "train_rewards")


def run_one(run_: Run, work: Path) -> dict[str, Any]:
    """Train one run in its own save directory; its line."""
    save, summary = Path("runs") / run_.name, Path("runs") / f"{run_.name}.summary.json"
    line: dict[str, Any] = {"kind": "run", "name": run_.name, "tool": run_.tool}
    common = ["--data-dir", run_.data, "--steps", str(run_.steps), "--threads", "1"]
    common += ["--save-dir", str(save), "--summary-json", str(summary), "--log-format", "json"]
    try:
        if run_.tool == "eggroll-tune":
            printed = run(
                cli("eggroll-tune", *run_.flags, "--steps", run_.steps, "--print-config"), work
            )
            line["print_config_sha256"] = hashlib.sha256(printed.encode()).hexdigest()
            run(cli("eggroll-tune", *run_.flags, *common), work)
        else:
            # Beside the prompts, reward file and models: a config's paths are relative to it.
            config = Path(f"{run_.name}.toml")
            (work / config).write_text(toml(run_.steps, run_.config))
            run(cli("eggroll-train", "--config", config, *common), work)
    except (CommandFailed, subprocess.TimeoutExpired) as exc:
        print(f"{run_.name}: {exc}", file=sys.stderr)
        return {**line, "error": str(exc).split(":", 1)[0]}
    s = json.loads((work / summary).read_text())
    line.update(
        config_digest=s["config_digest"][:16],
        replica_digest=s["replica_digest"],
        steps=s["steps"],
        fitness_log_sha256=sha256_file(work / save / "fitness.log"),
        held_out={k[len("valid_") :]: v for k, v in s.items() if k.startswith("valid_")},
        curve=s["curve"],
        train={k: s[k] for k in TRAIN_KEYS if k in s},
    )
    return line


# --- the presets ------------------------------------------------------------------------------


def preset_names(work: Path) -> list[str]:
    """Every built-in preset, as eggroll-train lists them when asked for an unknown one."""
    argv = cli("eggroll-train", "--preset", "no-such-preset!", "--data-dir", "bytes")
    done = subprocess.run(argv, cwd=work, env=child_env(), capture_output=True, text=True)
    found = re.search(r"known: ([^)]*)\)", done.stderr)
    if found is None:
        raise CommandFailed(f"no preset list in: {done.stderr[-500:]}")
    return [name.strip() for name in found.group(1).split(",")]


def preset_line(name: str, work: Path) -> dict[str, Any]:
    """The preset's config digest: eggroll-coordinator starts a run of it (stopped as soon
    as it listens) and eggroll-inspect reads the save directory's config."""
    save = Path("presets") / name
    argv = cli(
        "eggroll-coordinator",
        *("--save-dir", save, "--preset", name, "--host", "127.0.0.1", "--port", "0"),
        *("--metrics-port", "0", "--log-format", "json"),
    )
    proc = subprocess.Popen(
        argv, cwd=work, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for text in proc.stdout:
            lines.append(text)
            if '"listening"' in text:
                proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    try:
        info = json.loads(run(cli("eggroll-inspect", save, "--json"), work))
    except (CommandFailed, json.JSONDecodeError) as exc:
        print(f"preset {name}: {exc}\n{''.join(lines[-10:])}", file=sys.stderr)
        return {"kind": "preset", "name": name, "error": "inspect failed"}
    return {"kind": "preset", "name": name, "config_digest": info["config_digest"][:16]}


# --- main -------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=2, help="runs side by side (default 2)")
    parser.add_argument("--keep", type=Path, help="work in this (new) folder and keep it")
    parser.add_argument("--only", default="", help="only the runs whose name contains this")
    args = parser.parse_args()
    ENTRY_POINTS.update(_entry_points())
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="digest-check-") as tmp:
        work = Path(tmp)
        if args.keep is not None:
            work = args.keep.resolve()
            work.mkdir(parents=True)
        for folder in ("runs", "presets"):
            (work / folder).mkdir()
        # Which code runs: the modules' folder, and the entry point of eggroll-train.
        code = "import eggroll_dist.shared as s; print(s.__file__)"
        where = run([sys.executable, "-c", code], work).strip()
        train = ENTRY_POINTS["eggroll-train"]
        print(f"eggroll_dist.shared: {where}; eggroll-train: {train}", file=sys.stderr)
        runs = [r for r in RUNS if args.only in r.name]
        lines = prepare_inputs(work, hf=any(r.hf for r in runs))
        # The longest (hf) runs first, so that the side-by-side runs end together.
        ordered = sorted(runs, key=lambda r: (not r.hf, r.name))
        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            lines += pool.map(lambda r: run_one(r, work), ordered)
        if not args.only:
            lines += [preset_line(name, work) for name in preset_names(work)]
    for line in sorted(lines, key=lambda x: (x["kind"], x["name"])):
        print(json.dumps(line, sort_keys=True, separators=(",", ":")))
    failed = [x["name"] for x in lines if "error" in x]
    print(
        f"{len(runs)} runs, {len(lines)} lines in {time.monotonic() - start:.0f} s"
        + (f"; FAILED: {', '.join(failed)}" if failed else ""),
        file=sys.stderr,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
