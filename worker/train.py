"""`eggroll-train`: the whole run in one process (egg.c style), same chunks as distributed.

The population of each step is evaluated chunk by chunk exactly as workers would, the
fitness of all pairs is packed, logged and applied. With --save-dir the run leaves the
same files a coordinator does (run.json, fitness.log, history.log, snapshots/;
shared/save_dir.py), so it can be inspected and replayed, and the same command run again
continues it: from the newest snapshot and the fitness log, up to --steps in all. The run
writes through the save directory's one writer (shared/run_writer.py, the coordinator's
too), holding its lock from start to end: a second writer is refused in one line. A failed
write stops the run in one line and keeps every committed step; history.log only degrades,
as the coordinator's does. SIGINT or SIGTERM stops it after the chunk under way (a second
one at once): the steps committed are kept, with a snapshot of the last, and it exits 0.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import numpy as np
import structlog
from click.core import ParameterSource

from ..protocol.ternary import pack_ternary, unpack_ternary
from ..shared.atomic_file import naming
from ..shared.cli import (
    DATA_DIR_HELP,
    OneLineError,
    cannot_write,
    command,
    config_options,
    data_dir_option,
    every_option,
    init_from_option,
    log_format_option,
    max_minutes_option,
    reward_timeout_option,
    run_config,
    save_dir_option,
    steps_option,
    summary_json_option,
    threads_option,
    tracking_options,
)
from ..shared.config import ConfigError, RunConfig, preset_of
from ..shared.data import DataError, DataMeta, Dataset, load_data_dir
from ..shared.fitness import mean_score, member_tokens
from ..shared.fitness_log import FitnessLog
from ..shared.hf_dir import ModelDirError
from ..shared.logs import (
    SAMPLE,
    STEP,
    VALIDATION,
    baselines_text,
    configure_logging,
    echo,
    held_out_text,
    os_error_text,
)
from ..shared.model import ARCHS
from ..shared.objectives import objective_of
from ..shared.objectives.reward import DATA_PROMPTS
from ..shared.pinned import GoalError, resolve
from ..shared.replica import ReplicaState, encode_checkpoint
from ..shared.run_writer import SNAPSHOTS_KEPT, RunWriter, run_summary, write_summary
from ..shared.sample import TrainingSamples
from ..shared.save_dir import (
    RUN_FILE,
    HistoryLog,
    Layout,
    SaveDir,
    SaveDirBusy,
    SaveDirError,
    baselines_record,
    new_run,
)
from ..shared.start import initial_state
from ..shared.tracking import (
    CurveSink,
    Tracker,
    TrackingError,
    check_available,
    open_tracker,
)
from ..shared.vocab import escape
from ..shared.window import data_too_short
from .backend import (
    Backend,
    BackendFactory,
    BackendUnavailable,
    Validation,
    get_backend,
    reference_backend,
)
from .data.build import vocabulary_mismatch
from .objective import NextToken, Objective, make_objective
from .reward import RewardError
from .source import replay_progress
from .stop_signal import stop_on_signals

log = structlog.get_logger("eggroll.train")
NO_TOKENS = np.zeros(0, dtype=np.uint8)  # the held-out split of a run without data

PROGRESS_S = 10.0  # a step that takes longer than this logs its progress this often
STOP_HINT = "after the chunk under way; the steps committed are kept (again: at once)"


@dataclass(frozen=True)
class TrainOptions:
    """What eggroll-train and eggroll-tune ask of a run beyond its config, data and backend."""

    steps: int  # in all: a run in save_dir continues up to this many
    save_dir: Path | None = None
    summary_json: Path | None = None
    max_minutes: float | None = None  # then the step under way finishes and validates
    sample_every: int = 100  # 0: never
    snapshot_every: int = 100  # with save_dir; 0: only at the end
    tensorboard: Path | None = None
    wandb_project: str | None = None
    reward_timeout: float = 120.0
    preset: str | None = None  # the preset named, for the start line and the summary
    config_path: str | None = None
    # The Python API's: each step's, validation's and sample's record as it is made, and a
    # reward given as a function (fitness.reward "python:NAME"), called in this process.
    on_record: Callable[[dict[str, Any]], None] | None = None
    reward_function: Callable[..., Any] | None = None
    stop: Callable[[], str] | None = None  # why to stop after the chunk under way ("": go on)

    @property
    def max_seconds(self) -> float | None:
        return None if self.max_minutes is None else self.max_minutes * 60


@dataclass
class TrainResult:
    state: ReplicaState
    seconds: float = 0.0
    train_seconds: float = 0.0  # evaluation + update, without validation
    member_tokens: int = 0
    curve: list[dict[str, Any]] = field(default_factory=list)  # validations
    samples: list[dict[str, Any]] = field(default_factory=list)  # step, prompt, text
    # each step's mean score, under its objective's SCORE: "loss_bits" (bits per token) or
    # "reward" (mean reward per completion)
    scores: dict[str, list[float]] = field(default_factory=dict)
    step_seconds: list[float] = field(default_factory=list)
    fitness: list[bytes] = field(default_factory=list)  # packed, per step
    validation: Validation | None = None  # the latest
    stopped: str = ""  # the signal that stopped the run early ("" if it was not)
    summary: dict[str, Any] | None = None  # summary.json's, once the run is done


def _point(curve: CurveSink | None, event: str, **fields: Any) -> None:
    """An info line of the log that is a point of the curve too (as the coordinator's)."""
    log.info(event, **fields)
    if curve is not None:
        curve({"event": event, **fields})


def _validate(
    backend: Backend, result: TrainResult, curve: CurveSink | None, objective: Objective
) -> Validation:
    v = result.validation = backend.validate()
    reward = objective.held_out(backend)
    extra = {} if reward is None else {"held_out_reward": reward}
    result.curve.append({"step": backend.step, **v.report(), **extra})
    _point(
        curve,
        VALIDATION,
        step=backend.step,
        **v.log_fields(),
        **{k: round(x, 4) for k, x in extra.items()},
        tokens=0 if v.windows is None else v.windows.tokens,
    )
    return v


def _sample(
    samples: TrainingSamples,
    backend: Backend,
    result: TrainResult,
    curve: CurveSink | None,
    objective: Objective,
) -> None:
    state = backend.state
    # A reward run shows what the reward scores (a held-out prompt's completion), else a
    # held-out document's continuation.
    prompt, text = objective.sample(backend, samples.request(state.step))
    result.samples.append({"step": state.step, "prompt": prompt, "text": text})
    # Escaped: model text must not reach a terminal's control sequences (one line each).
    _point(
        curve,
        SAMPLE,
        step=state.step,
        prompt=escape(prompt, keep_newlines=False),
        text=escape(text, keep_newlines=False),
    )


def train(
    cfg: RunConfig,
    backend: Backend,
    steps: int,
    fitness_log: FitnessLog | None = None,
    samples: TrainingSamples | None = None,
    max_seconds: float | None = None,
    curve: CurveSink | None = None,
    objective: Objective | None = None,
    stop: Callable[[], str] = lambda: "",
    committed: Callable[[Backend], None] = lambda backend: None,
) -> TrainResult:
    """Run `steps` steps from the backend's state (fewer if `max_seconds` of wall time run
    out first: the step under way finishes); validate every K steps and at the end, and
    write a sample every `samples.every` steps. `curve` gets each step's, validation's and
    sample's log line as a record too. The objective defaults to the loss. `stop` says why
    to stop now (a signal's name; "" to go on): the step under way is dropped after its
    current chunks, and the run ends unvalidated. `committed` hears of each step applied."""
    objective = objective or NextToken()
    score_name = objective_of(cfg).SCORE
    result = TrainResult(backend.state)
    tokens_per_step = member_tokens(cfg, cfg.es.population)
    every = cfg.validation.every_steps
    start = time.perf_counter()
    for done in range(steps):
        step = backend.step
        t0 = time.perf_counter()
        fitness, loss_sum = _evaluate_step(cfg, backend, objective, step, stop, result)
        if result.stopped:
            break  # nothing of this step was written: the run is at its last commit
        packed = pack_ternary(fitness)
        if fitness_log is not None:
            with naming(fitness_log.path):  # a failed append names no file by itself
                fitness_log.append(step, packed)
        changed = backend.apply_step(fitness)
        dt = time.perf_counter() - t0
        result.train_seconds += dt
        result.step_seconds.append(dt)
        result.member_tokens += tokens_per_step
        result.fitness.append(packed)
        committed(backend)
        score = mean_score(cfg, loss_sum)
        result.scores.setdefault(score_name, []).append(score)
        _point(
            curve,
            STEP,
            step=step + 1,
            **{score_name: round(score, 4)},
            changed=changed,
            member_tok_s=round(tokens_per_step / dt),
            step_s=round(dt, 4),  # as summary.json's step_seconds
            workers=1,  # the coordinator's fields: one process, no chunk ever re-queued
            requeued=0,
            eta_s=round(result.train_seconds / (done + 1) * (steps - done - 1)),
        )
        if every and backend.step % every == 0 and done + 1 < steps:
            _validate(backend, result, curve, objective)
        if samples and samples.every and backend.step % samples.every == 0:
            _sample(samples, backend, result, curve, objective)
        if max_seconds is not None and time.perf_counter() - start >= max_seconds:
            log.info("time budget spent", step=backend.step, seconds=round(max_seconds))
            break
        result.stopped = stop()
        if result.stopped:
            break
    if not result.stopped:
        _validate(backend, result, curve, objective)
    result.state = backend.state
    result.seconds = time.perf_counter() - start
    return result


def _evaluate_step(
    cfg: RunConfig,
    backend: Backend,
    objective: Objective,
    step: int,
    stop: Callable[[], str],
    result: TrainResult,
) -> tuple[np.ndarray, int]:
    """Every chunk of `step`, as many at once as the backend gains by: the step's fitness
    and loss sum. A stop asked meanwhile is set in `result.stopped` after the chunks under
    way, and the step is left unfinished."""
    t0 = said = time.perf_counter()
    fitness = np.empty(cfg.pairs, dtype=np.int8)
    loss_sum = 0
    size, group = cfg.es.chunk_size, max(1, backend.parallel_chunks)
    for lo in range(0, cfg.chunks, group):
        chunks = [(c * size, size) for c in range(lo, min(lo + group, cfg.chunks))]
        results = objective.evaluate_chunks(backend, step, chunks)
        for (first, _), res in zip(chunks, results, strict=True):
            fitness[first // 2 : (first + size) // 2] = res.fitness
            loss_sum += res.loss_sum
        result.stopped = stop()
        if result.stopped:
            break
        if time.perf_counter() - said >= PROGRESS_S:  # a long step is not a silent one
            said = time.perf_counter()
            log.info(
                "evaluating",
                step=step + 1,
                chunks_done=f"{lo + len(chunks)}/{cfg.chunks}",
                seconds=round(said - t0),
            )
    return fitness, loss_sum


def _summary(
    cfg: RunConfig, preset_name: str | None, result: TrainResult, meta: DataMeta | None
) -> dict:
    return run_summary(
        steps=result.state.step,
        preset=preset_name,
        config_digest=cfg.digest().hex(),
        replica_digest=result.state.digest_hex(),
        held_out=result.curve[-1],
        baselines={} if meta is None else meta.baselines,
        baselines_per_byte={} if meta is None else meta.baselines_per_byte,
        seconds=result.seconds,
        train_losses=result.scores.get("loss_bits", []),
        train_rewards=result.scores.get("reward", []),
        member_tokens=result.member_tokens,
        member_tokens_per_second=result.member_tokens / max(result.train_seconds, 1e-9),
        curve=result.curve,
        step_seconds=result.step_seconds,
    )


@command()
@data_dir_option(Path("data"), DATA_DIR_HELP)
@config_options()
@steps_option(None, "Steps to train (default: the config's).")
@summary_json_option
@save_dir_option(
    None,
    "Keep the fitness log and the final snapshot here; a run already there continues "
    "up to --steps.",
)
@max_minutes_option(
    "Stop after the step during which this much wall time has passed (then validate)."
)
@every_option(
    "--sample-every", 100, "Log a sample of the model's writing every N steps (0 = never)."
)
@every_option(
    "--snapshot-every",
    100,
    "With --save-dir: snapshot the replica every K steps, keeping the newest "
    f"{SNAPSHOTS_KEPT}, so a resume replays at most K steps (0: only at the end).",
)
@init_from_option
@reward_timeout_option
@tracking_options
@log_format_option
@threads_option
def main(
    data_dir: Path,
    preset_name: str | None,
    config_path: str | None,
    steps: int | None,
    summary_json: Path | None,
    save_dir: Path | None,
    max_minutes: float | None,
    sample_every: int,
    snapshot_every: int,
    init_from: Path | None,
    reward_timeout: float,
    tensorboard: Path | None,
    wandb_project: str | None,
    log_format: str,
    threads: int | None,
) -> None:
    """Train an int8 EGG model with EGGROLL in one process, on the CPU."""
    configure_logging(log_format)
    try:
        check_available(tensorboard is not None, wandb_project is not None)
    except TrackingError as exc:
        raise OneLineError(str(exc)) from None
    try:
        cfg, base = run_config(preset_name, config_path, init_from)
    except (ConfigError, GoalError) as exc:
        raise click.ClickException(str(exc)) from None
    given = click.get_current_context().get_parameter_source("data_dir")
    dataset, factory = run_inputs(
        cfg, base, data_dir, threads, given is not ParameterSource.DEFAULT
    )
    options = TrainOptions(
        steps or cfg.steps,
        save_dir,
        summary_json,
        max_minutes,
        sample_every,
        snapshot_every,
        tensorboard,
        wandb_project,
        reward_timeout,
        preset_name,
        config_path,
    )
    run_training(cfg, base, dataset, factory, options)


def run_inputs(
    cfg: RunConfig, base: Path, data_dir: Path, threads: int | None, given: bool = True
) -> tuple[Dataset | None, BackendFactory]:
    """The data (None: a run that goes without, `run_data`) and the backend a one-process
    run of `cfg` needs, checked against each other; click.ClickException with one line."""
    try:
        dataset = run_data(cfg, data_dir, given)
        factory = get_backend(
            reference_backend(cfg), threads=threads, goal_dir=base, confined=False
        )
    except (DataError, BackendUnavailable) as exc:
        raise click.ClickException(str(exc)) from None
    # A model with its own tokenizer reads the data's text with it (or goes without data).
    if dataset is not None and not ARCHS[cfg.model.arch].OWN_TOKENIZER:
        mismatch = vocabulary_mismatch(data_dir, dataset.meta.vocab_size, cfg.model.vocab_size)
        if mismatch is not None:
            raise click.ClickException(mismatch)
        short = data_too_short(cfg, len(dataset.train), len(dataset.valid))
        if short is not None:
            raise click.ClickException(f"data in {data_dir}: {short}")
    return dataset, factory


def run_data(cfg: RunConfig, data_dir: Path, given: bool = True) -> Dataset | None:
    """The data directory's data; None for a run that reads no text when the directory
    was not `given` (a default) and does not exist: a reward on the model's own tokens
    whose prompts are a file. DataError otherwise, with one line."""
    needs = (
        not ARCHS[cfg.model.arch].OWN_TOKENIZER  # int8 models: their vocabulary is the data's
        or objective_of(cfg).WINDOWS
        or cfg.fitness.prompts == DATA_PROMPTS
    )
    if needs or given or data_dir.exists():
        return load_data_dir(data_dir)
    log.info(
        "no data directory",
        data_dir=str(data_dir),
        note="the held-out score is the reward's on the held-out prompts alone; no text "
        "scores or baselines",
    )
    return None


def run_training(
    cfg: RunConfig,
    base: Path,
    dataset: Dataset | None,
    factory: BackendFactory,
    options: TrainOptions,
) -> TrainResult:
    """The run of a command (eggroll-train, eggroll-tune) in this process, up to `steps` in
    all; every failure is one line (click.ClickException). A save directory's writer lock is
    held from before the run is read or made until the command ends."""
    writer = None if options.save_dir is None else _take_save_dir(options.save_dir)
    try:
        return _run(cfg, base, dataset, factory, writer, options)
    except Exception as exc:
        error = _failure_line(exc, options)
        kept = "" if writer is None else _after_failure(writer, isinstance(exc, OSError))
        if error is None:
            raise
        error.message += kept
        raise error from None
    finally:
        if writer is not None:
            writer.close()


def _take_save_dir(save_dir: Path) -> RunWriter:
    """The save directory held for writing: a run there to continue, or room for a new one
    (absent or empty: nothing of anything else is mistaken for a run, or overwritten)."""
    try:
        writer = RunWriter.take(save_dir)
    except SaveDirBusy as exc:
        raise click.ClickException(str(exc)) from None
    except OSError as exc:
        raise cannot_write(exc, save_dir) from None
    try:
        foreign = not writer.found_run and bool(writer.others())
    except OSError as exc:
        writer.close()
        raise cannot_write(exc, save_dir) from None
    if foreign:
        left = writer.discard()  # the lock file, if this made it
        raise click.ClickException(
            f"--save-dir {save_dir} is not empty and holds no run ({RUN_FILE}); "
            "pick a new directory" + (f"; {left}" if left else "")
        )
    return writer


def _failure_line(exc: Exception, options: TrainOptions) -> click.ClickException | None:
    """The one line of a failure (None: not one of ours, raised as it is)."""
    if isinstance(exc, SaveDirError | GoalError | RewardError | ModelDirError):
        return click.ClickException(str(exc))
    if isinstance(exc, TrackingError):  # before the run wrote anything
        return OneLineError(str(exc))
    if isinstance(exc, OSError):
        return cannot_write(exc, options.save_dir or options.summary_json or ".")
    return None


def _after_failure(writer: RunWriter, write_failed: bool) -> str:
    """What a failed run leaves in its save directory, as the end of its error line.
    Committed steps are the fitness log's, and after a failed write (a full disk, EIO) the
    same command run again once there is room continues from them to the digest of an
    undisturbed run. A new run that failed before its first step (a write, a reward that
    raises) is cleared instead, so that nothing half-made is mistaken for a run and the
    corrected command starts afresh; one that wrote nothing yet leaves the directory as it
    found it."""
    if writer.found_run:
        kept = f"; the steps of {writer.root} are kept: run again once there is room"
        return kept if write_failed else ""
    committed = writer.steps_on_disk() if writer.created else 0
    if writer.created and not write_failed and committed:
        return ""  # its files are whole, at its last commit
    if committed:
        return (
            f"; {committed} steps are kept in {writer.root}: "
            "the same command continues them once there is room"
        )
    left = writer.discard()
    return f"; {left}" if left else ""


def _run(
    cfg: RunConfig,
    base: Path,
    dataset: Dataset | None,
    factory: BackendFactory,
    writer: RunWriter | None,
    options: TrainOptions,
) -> TrainResult:
    """Train and write what main was asked to; a failed write raises OSError naming its file,
    a save directory that cannot be continued SaveDirError, tracking that cannot start
    TrackingError before anything is written, a goal that fails GoalError or RewardError."""
    # An hf run's step 0 is its model's target weights, read from its files: not read
    # twice when the run continues (every other start is checked here either way).
    hf_run = ARCHS[cfg.model.arch].FAMILY == "hf"
    state = None if hf_run else initial_state(cfg, base)
    digest = None if dataset is None else dataset.digest
    run = new_run(cfg, digest)  # eggroll-sample checks the data digest
    if writer is not None and writer.found_run:
        state = _resume(writer, cfg, base, digest)
        run = writer.run
    elif state is None:
        state = initial_state(cfg, base)
    # The model and the goal first: a prompt too long or a reward that does not import
    # stops the command before it writes anything.
    backend = factory.build(dataset, state)
    objective = make_objective(
        cfg, dataset, base, options.reward_timeout, backend.codec, options.reward_function
    )
    layout = None if writer is None else writer.layout
    try:
        curve = _open_curve(cfg, dataset, layout, options, state.step, run)
    except BaseException:
        objective.close()
        raise
    try:
        if writer is not None:
            if not writer.found_run:
                writer.create(cfg, base, run)
            if dataset is not None:  # for eggroll-inspect --plot
                meta = dataset.meta
                curve(baselines_record(meta.baselines, meta.baselines_per_byte))
        _log_start(cfg, options, factory)
        # Without data a run's samples are its reward's (a held-out prompt's completion).
        valid, pieces = (NO_TOKENS, []) if dataset is None else (dataset.valid, dataset.decoding)
        samples = TrainingSamples(options.sample_every, valid, pieces)

        def committed(backend: Backend) -> None:
            every = options.snapshot_every
            if writer is not None and every and backend.step % every == 0:
                _keep_snapshot(writer, backend.state)

        # The first SIGINT or SIGTERM stops after the chunk under way, a second one at once
        # (KeyboardInterrupt: the committed steps are kept, without a snapshot of the last).
        with stop_on_signals(log, STOP_HINT) as signalled:
            asked = options.stop

            def stop() -> str:
                return signalled() or (asked() if asked is not None else "")

            result = train(
                cfg,
                backend,
                max(0, options.steps - state.step),
                None if writer is None else writer.fitness_log,
                samples,
                options.max_seconds,
                curve,
                objective,
                stop,
                committed,
            )
    finally:
        curve.close()
        objective.close()
    result.summary = _finish(cfg, dataset, writer, options, result)
    return result


def _open_curve(
    cfg: RunConfig,
    dataset: Dataset | None,
    layout: Layout | None,
    options: TrainOptions,
    step: int,
    run: dict[str, Any],
) -> _Curve:
    """history.log and the tracker (TrackingError when it cannot start)."""
    run_id = None if layout is None else run.get("run_id")  # the W&B run's, across resumes
    meta = None if dataset is None else dataset.meta
    tracker = open_tracker(
        options.tensorboard,
        options.wandb_project,
        start_step=step,
        run_id=run_id,
        name=None if layout is None else layout.root.name,
        config={"run_id": run_id, **cfg.to_dict()},
        baselines=None if meta is None else (meta.baselines, meta.baselines_per_byte),
    )
    history = None if layout is None else HistoryLog(layout.history)
    return _Curve(history, tracker, options.on_record)


def _log_start(cfg: RunConfig, options: TrainOptions, factory: BackendFactory) -> None:
    m = cfg.model
    model = (
        {"model": m.path, "targets": len(m.matrices), "rank": m.rank}
        if m.path  # a model directory's (shared/hf.py)
        else {
            "preset": options.preset or preset_of(cfg) or "none (own config)",
            "layers": m.n_layer,
            "width": m.d_model,
        }
    )
    log.info(
        "start",
        **model,
        population=cfg.es.population,
        chunks=cfg.chunks,
        seq_len=cfg.es.seq_len,
        steps=options.steps,
        threads=factory.threads,
        config_digest=cfg.digest().hex()[:16],
    )


def _finish(
    cfg: RunConfig,
    dataset: Dataset | None,
    writer: RunWriter | None,
    options: TrainOptions,
    result: TrainResult,
) -> dict[str, Any] | None:
    """The last snapshot, the summary and the closing line (or the line of a stop); the
    summary (None after a stop)."""
    if writer is not None and result.state.step not in writer.snapshot_steps:
        _keep_snapshot(writer, result.state)
    if result.stopped:
        kept = (
            f"steps 1..{result.state.step} are kept in {writer.root}, with a snapshot of the "
            "last: the same command continues them"
            if writer is not None
            else "nothing is kept (no --save-dir)"
        )
        echo(f"stopped at step {result.state.step} ({result.stopped}): {kept}", err=True)
        return None
    meta = None if dataset is None else dataset.meta
    summary = _summary(cfg, options.preset or preset_of(cfg), result, meta)
    if writer is not None:  # for eggroll-inspect
        writer.write_summary(summary)
    if options.summary_json is not None:
        write_summary(options.summary_json, summary)
    echo(
        f"done: {summary['steps']} steps in {summary['seconds']:.1f} s, "
        f"held-out {_held_out_line(cfg, result, meta)}, "
        f"{summary['member_tokens_per_second']:,.0f} member-tokens/s, "
        f"replica digest {summary['replica_digest']}",
        err=True,
    )
    return summary


def _held_out_line(cfg: RunConfig, result: TrainResult, meta: DataMeta | None) -> str:
    """The done line's held-out scores: the text's beside the data's baselines, or a run
    without data's held-out reward alone."""
    if meta is None:
        reward = result.curve[-1].get("held_out_reward")
        score = "unknown" if reward is None else f"{reward:.4f}"
        return f"reward {score} (the run has no data: no text scores or baselines)"
    own = ARCHS[cfg.model.arch].OWN_TOKENIZER  # its bits/token are in its own tokens
    baselines = baselines_text(meta.baselines, meta.baselines_per_byte, own)
    return f"{held_out_text(result.validation.log_fields())} (baselines: {baselines})"


def _keep_snapshot(writer: RunWriter, state: ReplicaState) -> None:
    """A snapshot of `state`, and only the newest SNAPSHOTS_KEPT: a resume starts from the
    newest and replays the log from there."""
    writer.save_snapshot(state.step, encode_checkpoint(state), SNAPSHOTS_KEPT)


class _Curve:
    """Where eggroll-train's step, validation and sample records go besides its log: the
    save directory's history.log (a failed write drops the record and warns once per spell
    of failures, as the coordinator's does) and the tracker."""

    def __init__(
        self,
        history: HistoryLog | None,
        tracker: Tracker | None,
        listener: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.history = history
        self.tracker = tracker
        self.listener = listener
        self._failing = False

    def __call__(self, point: dict[str, Any]) -> None:
        if self.history is not None:
            error = self.history.append(point)
            if error is not None and not self._failing:
                log.warning(
                    "save directory write failed",
                    path=str(self.history.path),
                    error=os_error_text(error),
                    hint="the run goes on: records of the curve (eggroll-inspect's history "
                    "and plot) are dropped until a write succeeds",
                )
            self._failing = error is not None
        if self.tracker is not None:
            self.tracker.record(point)
        if self.listener is not None:
            self.listener(dict(point))

    def close(self) -> None:
        if self.history is not None:
            self.history.close()
        if self.tracker is not None:
            self.tracker.close()


def _resume(
    writer: RunWriter, cfg: RunConfig, base: Path, data_digest: bytes | None
) -> ReplicaState:
    """The run in the save directory, to continue: run.json checked against the config and
    the data (None: a run without data checks none), its fitness log opened for appending
    (a torn last record cut off), and the replica state at its last committed step (an hf
    run's step 0 from its model directory under `base`)."""
    writer.load(cfg, data_digest)
    fitness_log, stored = writer.fitness_log, writer.config
    assert fitness_log is not None and stored is not None  # loaded
    if fitness_log.repaired_bytes:
        log.warning(
            "fitness log tail repaired",
            path=str(fitness_log.path),
            bytes_cut=fitness_log.repaired_bytes,
            steps=fitness_log.steps,
            hint="a step that was being written when the run stopped is redone",
        )
    replaying = replay_progress(lambda text: log.info("resuming", progress=text))
    run = SaveDir(writer.layout, writer.run, stored)
    if cfg.model.path:
        run.model_dir = resolve(cfg.model.path, base)
    state = run.state_at(fitness_log.steps, unpack_ternary, replaying)
    log.info("resuming", save_dir=str(writer.root), step=state.step)
    return state
