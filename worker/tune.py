"""`eggroll-tune MODEL_DIR`: fine-tune a Hugging Face causal LM with EGGROLL in one process.

The flags make the run config of the `hf` family (shared/hf.py): the model directory, the
objective (a reward over completions of prompts, or the data's perplexity), the population,
the noise's rank and scale. The run then goes exactly as eggroll-train's (worker/train.py,
the same save directory, resume and summary) on the PyTorch backend. `--print-config` writes
the same run as a TOML config instead, for `eggroll-coordinator --config` and workers started
with `--backend torch`, whose replicas reach the same digests.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import click
import structlog
from click.core import ParameterSource

from ..shared.cli import (
    OneLineError,
    command,
    data_dir_option,
    log_format_option,
    max_minutes_option,
    reward_timeout_option,
    save_dir_option,
    steps_option,
    summary_json_option,
    threads_option,
    tracking_options,
)
from ..shared.config import (
    ConfigError,
    DataConfig,
    ESConfig,
    FitnessConfig,
    ModelConfig,
    RunConfig,
    UpdateConfig,
    ValidationConfig,
)
from ..shared.data import DataError, Dataset
from ..shared.hf_dir import ModelDirError, mem_available, require_hf
from ..shared.logs import configure_logging
from ..shared.pinned import GoalError, pin, resolve
from ..shared.prompts import read_prompts
from ..shared.tracking import TrackingError, check_available
from .backend import BackendFactory, BackendUnavailable, get_backend
from .hf_estimate import Estimate, EstimateError, estimate_run, human
from .hf_model import load_tokenizer
from .hub_cache import HubCacheError, local_or_cached
from .train import TrainOptions, run_data, run_training

PERPLEXITY = "perplexity"

log = structlog.get_logger("eggroll.tune")


@dataclass(frozen=True)
class TuneSettings:
    """The flags of eggroll-tune that make its run config."""

    model_dir: Path
    # FILE.py[:FUNCTION], builtin:NAME, a lambda, or PERPLEXITY; several: a weighted sum,
    # each NAME:WEIGHT
    reward: tuple[str, ...]
    prompts: Path | None
    population: int
    chunk_size: int | None  # None: the whole population
    rank: int
    sigma: float
    lr: float
    targets: tuple[str, ...]
    seed: int
    seq_len: int
    prompts_per_step: int
    completion_tokens: int
    temperature: float
    valid_tokens: int
    validate_every: int


def tune_config(t: TuneSettings) -> RunConfig:
    """The run config of the flags (not yet pinned); ConfigError with one line. How many
    steps to train is not part of it (as eggroll-train's --steps): the same command with
    more steps continues the run in its save directory."""
    perplexity = PERPLEXITY in t.reward
    if perplexity and len(t.reward) > 1:
        raise ConfigError("--reward perplexity is not combined with other rewards: give it alone")
    if not perplexity and t.prompts is None:
        given = " ".join(t.reward) or "builtin:letter_e"
        raise ConfigError(f"--reward {given} needs --prompts FILE (one prompt a line)")
    if perplexity and t.prompts is not None:
        raise ConfigError("--reward perplexity scores the data (--data-dir): drop --prompts")
    fitness = (
        FitnessConfig()
        if perplexity
        else FitnessConfig(
            objective="reward",
            reward=t.reward[0] if len(t.reward) == 1 else "",
            rewards=t.reward if len(t.reward) > 1 else (),
            prompts=str(t.prompts),
            prompts_per_step=t.prompts_per_step,
            completion_tokens=t.completion_tokens,
            temperature=round(t.temperature * 1000),
        )
    )
    return RunConfig(
        model=ModelConfig(arch="hf", path=str(t.model_dir), targets=t.targets, rank=t.rank),
        es=ESConfig(
            population=t.population,
            chunk_size=t.chunk_size or t.population,
            seq_len=t.seq_len,
            sigma=t.sigma,
            run_seed=t.seed,
        ),
        fitness=fitness,
        update=UpdateConfig(lr=t.lr),
        data=DataConfig(data_seed=t.seed),
        validation=ValidationConfig(every_steps=t.validate_every, max_tokens=t.valid_tokens),
    )


def config_toml(cfg: RunConfig, steps: int) -> str:
    """The settings of an hf run config as TOML (the pinned digests are left out: whoever
    loads it pins them again from its own files)."""
    pinned = {("model", "files"), ("model", "matrices")}
    pinned |= {("fitness", k) for k in ("reward_sha256", "prompts_sha256", "rewards_sha256")}
    lines = [f"# eggroll-coordinator --config FILE --max-steps {steps}"]
    defaults = RunConfig().to_dict()
    for section, values in cfg.to_dict().items():
        if not isinstance(values, dict):
            continue
        default = defaults[section]
        changed = {
            k: v
            for k, v in values.items()
            if (section, k) not in pinned and (v != default.get(k) or k == "arch")
        }
        if changed:
            lines.append(f"\n[{section}]")
            lines += [f"{k} = {json.dumps(v)}" for k, v in changed.items()]
    return "\n".join(lines) + "\n"


@command()
@click.argument("model_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--reward",
    multiple=True,
    help="What to maximise (required unless --estimate): FILE.py:FUNCTION or FILE.py "
    "(its score(text), else its reward(prompts, completions, ...)), 'lambda text: ...', "
    "builtin:letter_e or builtin:brackets, with --prompts; repeated, a weighted sum of "
    "NAME:WEIGHT parts (--reward builtin:letter_e:0.3 --reward score.py:0.7); or "
    "'perplexity': the data's next-token loss, with --data-dir.",
)
@click.option(
    "--prompts",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help='Prompts file (one per line, or JSON lines with a "prompt" key); every 8th is held out.',
)
@click.option(
    "--population", type=click.IntRange(min=2), default=32, show_default=True, help="Members."
)
@click.option(
    "--chunk-size",
    type=click.IntRange(min=2),
    default=None,
    help="Members per chunk, a worker's unit of work [default: the population].",
)
@click.option("--rank", type=int, default=8, show_default=True, help="Rank of the noise.")
@click.option(
    "--sigma",
    type=click.FloatRange(min=0, max=1, min_open=True),
    default=0.01,
    show_default=True,
    help="Standard deviation of a member's perturbation of each target weight.",
)
@click.option(
    "--lr",
    type=click.FloatRange(min=2**-16, max=16),
    default=1.0,
    show_default=True,
    help="Step size: one step moves the weights by lr * sigma * the mean of the pairs' "
    "fitness-signed noise.",
)
@click.option(
    "--target",
    "targets",
    multiple=True,
    metavar="GLOB",
    help="Module names of the matrices that learn (repeatable; fnmatch globs such as "
    "'*.mlp.*') [default: every linear layer of the blocks].",
)
@steps_option(50, "Steps in all: the same command with more continues a run in --save-dir.")
@click.option(
    "--seed",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Seed of the run's noise and of its data's order.",
)
@save_dir_option(
    None, "Keep the fitness log and snapshots here; the same command run again continues."
)
@data_dir_option(
    Path("data"),
    "Data directory (eggroll-data prepare) whose text the perplexity objective and "
    "the held-out score read, tokenized with the model's tokenizer. A reward run goes "
    "without when the default is absent: its held-out score is the reward's alone.",
)
@click.option(
    "--seq-len",
    type=click.IntRange(min=1),
    default=32,
    show_default=True,
    help="Tokens each pair scores per step (perplexity).",
)
@click.option(
    "--prompts-per-step",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    help="Prompts every member continues each step (with --prompts).",
)
@click.option(
    "--completion-tokens",
    type=click.IntRange(min=1),
    default=32,
    show_default=True,
    help="Tokens generated per prompt (with --prompts).",
)
@click.option(
    "--temperature",
    type=click.FloatRange(min=0, max=100),
    default=1.0,
    show_default=True,
    help="Sampling temperature of the completions (0: greedy).",
)
@click.option(
    "--valid-tokens",
    type=click.IntRange(min=0),
    default=4096,
    show_default=True,
    help="Held-out tokens scored at each validation.",
)
@click.option(
    "--validate-every",
    type=click.IntRange(min=0),
    default=25,
    show_default=True,
    help="Score the held-out data every N steps, and at the end (0: at the end only).",
)
@summary_json_option
@max_minutes_option("Stop after the step during which this much wall time has passed.")
@click.option(
    "--print-config",
    is_flag=True,
    help="Print the run as a TOML config (for eggroll-coordinator --config) and exit.",
)
@click.option(
    "--estimate",
    is_flag=True,
    help="Print the GPU, host and snapshot memory the run needs, the device and its free "
    "memory, and whether it fits (exit 0), or not (exit 1); reads MODEL_DIR/config.json "
    "only: no weights needed.",
)
@reward_timeout_option
@tracking_options
@log_format_option
@threads_option
def main(
    model_dir: Path,
    reward: tuple[str, ...],
    prompts: Path | None,
    population: int,
    chunk_size: int | None,
    rank: int,
    sigma: float,
    lr: float,
    targets: tuple[str, ...],
    steps: int,
    seed: int,
    save_dir: Path | None,
    data_dir: Path,
    seq_len: int,
    prompts_per_step: int,
    completion_tokens: int,
    temperature: float,
    valid_tokens: int,
    validate_every: int,
    summary_json: Path | None,
    max_minutes: float | None,
    print_config: bool,
    estimate: bool,
    reward_timeout: float,
    tensorboard: Path | None,
    wandb_project: str | None,
    log_format: str,
    threads: int | None,
) -> None:
    """Fine-tune the Hugging Face causal LM in MODEL_DIR with EGGROLL, in one process.
    MODEL_DIR is a model directory, or a name ORG/NAME in the local Hugging Face cache."""
    configure_logging(log_format)
    if not reward and not estimate:
        raise click.UsageError("Missing option '--reward'.")
    model_dir = resolve_model_dir(model_dir)
    settings = TuneSettings(
        model_dir=model_dir,
        reward=reward,
        prompts=prompts,
        population=population,
        chunk_size=chunk_size,
        rank=rank,
        sigma=sigma,
        lr=lr,
        targets=targets,
        seed=seed,
        seq_len=seq_len,
        prompts_per_step=prompts_per_step,
        completion_tokens=completion_tokens,
        temperature=temperature,
        valid_tokens=valid_tokens,
        validate_every=validate_every,
    )
    try:
        if estimate:
            _print_estimate(settings, threads)  # exits
        cfg = tune_config(settings)
        if print_config:
            _print_config(cfg, model_dir, steps)
            return
        check_available(tensorboard is not None, wandb_project is not None)
        base = Path.cwd()
        cfg, factory, dataset = _prepare(cfg, base, data_dir, threads)
    except (ConfigError, GoalError, DataError, BackendUnavailable) as exc:
        raise click.ClickException(str(exc)) from None
    except TrackingError as exc:
        raise OneLineError(str(exc)) from None
    options = TrainOptions(
        steps,
        save_dir,
        summary_json,
        max_minutes,
        sample_every=0,
        tensorboard=tensorboard,
        wandb_project=wandb_project,
        reward_timeout=reward_timeout,
    )
    run_training(cfg, base, dataset, factory, options)


def _prepare(
    cfg: RunConfig, base: Path, data_dir: Path, threads: int | None
) -> tuple[RunConfig, BackendFactory, Dataset | None]:
    """The backend, the run's memory checked before anything is hashed or loaded, the
    config pinned, and the data (None: a reward run without it)."""
    factory = get_backend("torch", threads=threads, goal_dir=base, confined=False)
    _refuse_unfit(cfg, base, factory.device)
    cfg = pin(cfg, base)
    given = click.get_current_context().get_parameter_source("data_dir")
    return cfg, factory, run_data(cfg, data_dir, given is not ParameterSource.DEFAULT)


def resolve_model_dir(given: Path) -> Path:
    """MODEL_DIR as a directory: itself, or a name's snapshot in the hub cache (said in the
    log, with its revision: the run pins its files as any directory's)."""
    try:
        path, cached = local_or_cached(given)
    except HubCacheError as exc:
        raise click.ClickException(str(exc)) from None
    if cached is not None:
        log.info(
            "model from the Hugging Face cache",
            model=cached.name,
            path=str(path),
            revision=cached.revision,
            chosen_by="refs/main" if cached.ref else "the newest snapshot",
        )
    return path


# --- the memory a run needs (worker/hf_estimate.py) ---------------------------------------


def _measure(cfg: RunConfig, base: Path, device: str, prompts: bool = True) -> Estimate:
    """The estimate of a run config (not pinned) on `device` (without `prompts`, of prompts
    of the estimate's default length); EstimateError, ModelDirError or GoalError with one
    line when it cannot be made."""
    model = resolve(cfg.model.path, base)
    lengths = _prompt_lengths(cfg, base, model) if prompts else []
    return estimate_run(model, cfg, device, lengths)


def _prompt_lengths(cfg: RunConfig, base: Path, model: Path) -> list[int]:
    """The tokens of each prompt of a reward run's prompts file (none: no file), by the
    model's tokenizer, or in UTF-8 bytes where it has none (at least a byte-level
    tokenizer's tokens)."""
    path = resolve(cfg.fitness.prompts, base)
    if cfg.fitness.objective != "reward" or not path.is_file():
        return []
    texts = [text for text, _ in read_prompts(path)]
    try:
        tokenizer = load_tokenizer(model)
    except ModelDirError:
        return [len(text.encode("utf-8")) for text in texts]
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def _free_memory(device: str) -> tuple[int | None, int | None, str]:
    """(free GPU bytes, available host bytes, the device's name)."""
    if device != "cuda":
        return None, mem_available(), "cpu"
    torch, _ = require_hf()
    free, _total = torch.cuda.mem_get_info()
    return int(free), mem_available(), f"cuda ({torch.cuda.get_device_name()})"


def _print_estimate(settings: TuneSettings, threads: int | None) -> None:
    """`--estimate`: the estimate's lines, the device's free memory and whether it fits;
    exits 0 when it does, 1 when not. A run without --reward is taken as a reward run."""
    if not settings.reward:
        settings = replace(settings, reward=("builtin:letter_e",))
    given = settings.prompts is not None
    if PERPLEXITY not in settings.reward and not given:
        settings = replace(settings, prompts=Path("prompts.txt"))  # never read: a name
    try:
        cfg = tune_config(settings)
        factory = get_backend("torch", threads=threads, goal_dir=Path.cwd(), confined=False)
        est = _measure(cfg, Path.cwd(), factory.device, prompts=given)
    except (ConfigError, GoalError, ModelDirError, BackendUnavailable, EstimateError) as exc:
        raise click.ClickException(str(exc)) from None
    free_gpu, free_host, name = _free_memory(factory.device)
    for line in est.lines():
        click.echo(line)
    gpu = f"{human(free_gpu)} free; " if free_gpu is not None else ""
    host = f"host {human(free_host)} available" if free_host is not None else "host: unknown"
    click.echo(f"{'device':<10}{name}: {gpu}{host}")
    short = est.shortfall(free_gpu, free_host)
    click.echo(f"{'fits':<10}" + ("yes" if short is None else f"no: {short}"))
    raise SystemExit(0 if short is None else 1)


def _refuse_unfit(cfg: RunConfig, base: Path, device: str) -> None:
    """ConfigError when the run cannot fit this machine's free memory (module
    worker/hf_estimate.py). A run the estimate cannot describe (an unknown model type, a
    directory or prompts that do not read) goes on: pinning it says what is wrong."""
    try:
        est = _measure(cfg, base, device)
    except (GoalError, ModelDirError, EstimateError) as exc:
        log.debug("no memory estimate", reason=str(exc))
        return
    short = est.shortfall(*_free_memory(device)[:2])
    if short is not None:
        raise ConfigError(f"{short} (eggroll-tune --estimate lists the parts)")


def _print_config(cfg: RunConfig, model_dir: Path, steps: int) -> None:
    """`--print-config`: the run as TOML on stdout, and a note where workers would not find
    the model."""
    if model_dir.is_absolute() or ".." in model_dir.parts:
        click.echo(
            f"note: workers look for {model_dir} under their --goal-dir, so a run for "
            "them names MODEL_DIR relative to this folder (copy a cached model there with "
            "cp -rL: its files are links)",
            err=True,
        )
    click.echo(config_toml(cfg, steps), nl=False)
