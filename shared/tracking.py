"""Experiment tracking: a run's curves in TensorBoard event files and in a W&B run.

Optional and off by default (`--tensorboard DIR`, `--wandb-project NAME`; the packages are the
`track` extra). The coordinator's shell and eggroll-train hand a `Tracker` the records they
already log and keep in history.log (shared/logs.py's step, validation and sample events,
the values the Prometheus metrics get); it turns each into scalars under one set of tags,
the same in both sinks, and the sample into text.

A resumed run continues the same curves and never writes a step twice: the tracker drops
every record of a step at or below the one the run was opened at (the last committed step),
TensorBoard's `purge_step` drops whatever a crashed writer left beyond it, and W&B resumes
the run named by the save directory's run id. Tracking never stops a run: a sink that fails
is said once in the log and skipped from then on.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import structlog

from .logs import HELD_OUT_FIELDS, SAMPLE, STEP, VALIDATION

log = structlog.get_logger("eggroll.tracking")

INSTALL = "pip install 'eggroll-distributed[track]'"

# Takes a record of the run's curve, a log line's event and fields: {"event": STEP, ...}
# (history.log and a Tracker take them).
CurveSink = Callable[[dict[str, Any]], None]

# A record's field -> its tag, in TensorBoard and W&B alike.
STEP_TAGS = {
    "loss_bits": "train/loss_bits_per_token",
    "step_s": "perf/step_seconds",
    "member_tok_s": "perf/member_tokens_per_second",
    "workers": "run/workers",
    "requeued": "run/requeued_chunks",
    "changed": "run/weights_changed",
    "reward": "train/reward",  # a reward run's mean reward, instead of the loss
}
VALID_TAGS = dict(
    zip(
        HELD_OUT_FIELDS,
        (
            "valid/bits_per_token",
            "valid/bits_per_byte",
            "valid/stream_bits_per_token",
            "valid/stream_bits_per_byte",
        ),
        strict=True,
    ),
    held_out_reward="valid/reward",  # a reward run's held-out prompts
)
BASELINES = ("unigram", "bigram", "gzip9")
SAMPLE_TAG = "sample"


def baseline_tags(per_token: dict[str, float], per_byte: dict[str, float]) -> dict[str, float]:
    """The data's baselines as scalars, logged with every held-out score so that each chart
    of held-out bits has them as flat lines to compare with."""
    out = {}
    for unit, values in (("token", per_token), ("byte", per_byte)):
        for name in BASELINES:
            if name in values:
                out[f"baseline/{name}_bits_per_{unit}"] = float(values[name])
    return out


def scalars(record: dict[str, Any], baselines: dict[str, float]) -> dict[str, float]:
    """A step or validation record's scalars by tag (a value not measured is left out);
    `baselines` (`baseline_tags`) go with each held-out score."""
    event = record.get("event")
    if event == STEP:
        fields = STEP_TAGS
    elif event == VALIDATION:
        fields = VALID_TAGS
    else:
        return {}
    out = {tag: float(record[k]) for k, tag in fields.items() if record.get(k) is not None}
    return {**out, **baselines} if event == VALIDATION else out


class TrackingError(Exception):
    """Tracking asked for and impossible (a package missing, W&B refusing): one line."""


def check_available(tensorboard: bool, wandb: bool) -> None:
    """Raise TrackingError at once, before a run starts, when a package asked for cannot be
    imported."""
    wanted = [("--tensorboard", "tensorboardX", tensorboard), ("--wandb-project", "wandb", wandb)]
    for flag, module, on in wanted:
        if not on:
            continue
        try:
            importlib.import_module(module)
        except ImportError:
            raise TrackingError(f"{flag} needs the {module} package: {INSTALL}") from None


class Sink(Protocol):
    name: str

    def scalars(self, step: int, values: dict[str, float]) -> None: ...
    def sample(self, step: int, prompt: str, text: str) -> None: ...
    def close(self) -> None: ...


class TensorBoardSink:
    """Event files in `logdir`, a file per session, written by tensorboardX."""

    name = "tensorboard"

    def __init__(self, logdir: Path, start_step: int) -> None:
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(
            str(logdir),
            # Events of steps after the start that a crashed session left are dropped.
            purge_step=start_step + 1 if start_step else None,
            flush_secs=10,
            # Two sessions may start within a second, and the file name holds seconds.
            filename_suffix=f".{os.getpid()}",
        )
        # Charts that draw the held-out bits and the train loss over the baselines.
        per_token = ["^valid/.*_bits_per_token$", "^baseline/.*_bits_per_token$"]
        per_byte = ["^valid/.*_bits_per_byte$", "^baseline/.*_bits_per_byte$"]
        train = ["^train/", "^baseline/.*_bits_per_token$"]
        self.writer.add_custom_scalars(
            {
                "held-out vs baselines": {
                    "bits per token": ["Multiline", per_token],
                    "bits per byte": ["Multiline", per_byte],
                    "train loss": ["Multiline", train],
                }
            }
        )

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)

    def sample(self, step: int, prompt: str, text: str) -> None:
        # An indented block: markdown shows the model's text as it is.
        self.writer.add_text(SAMPLE_TAG, f"    prompt: {prompt}\n    text:   {text}", step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A W&B run (offline too: WANDB_MODE=offline), resumed when `run_id` names one."""

    name = "wandb"

    def __init__(self, project: str, run_id: str | None, name: str | None, config: dict) -> None:
        import wandb

        self.wandb = wandb
        try:
            self.run = wandb.init(
                project=project,
                id=run_id,
                name=name,
                resume="allow" if run_id else None,
                config=config,
                # The run's own log already goes to stderr: no second copy of the console.
                settings=wandb.Settings(console="off"),
            )
        except Exception as exc:  # W&B raises many kinds: no key, no network, bad project
            raise TrackingError(
                f"cannot start a W&B run in project {project!r}: {exc}; log in (wandb login) "
                "or set WANDB_MODE=offline"
            ) from None

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def sample(self, step: int, prompt: str, text: str) -> None:
        table = self.wandb.Table(columns=["step", "prompt", "text"], data=[[step, prompt, text]])
        self.run.log({SAMPLE_TAG: table}, step=step)

    def close(self) -> None:
        self.run.finish()


class Tracker:
    """The run's curves, fanned out to its sinks. `record` takes a step, validation or
    sample record and never raises."""

    def __init__(
        self, sinks: list[Sink], start_step: int, baselines: dict[str, float] | None = None
    ) -> None:
        self.sinks = sinks
        self.start_step = start_step
        self.baselines = baselines or {}
        self._failed: set[int] = set()  # ids of the sinks that failed

    def record(self, record: dict[str, Any]) -> None:
        step = record.get("step")
        if not isinstance(step, int) or step <= self.start_step:
            return  # an earlier session's step (or no step's): never written twice
        values = scalars(record, self.baselines)
        for sink in self.sinks:
            if values:
                self._call(sink, sink.scalars, step, values)
            if record.get("event") == SAMPLE:
                self._call(sink, sink.sample, step, record["prompt"], record["text"])

    def _call(self, sink: Sink, method: Callable[..., None], *args: Any) -> None:
        if id(sink) in self._failed:
            return
        try:
            method(*args)
        except Exception as exc:  # a tracking service's failure must never cost the run
            self._failed.add(id(sink))
            log.warning(
                "tracking failed",
                sink=sink.name,
                error=str(exc),
                hint="the run goes on without it",
            )

    def close(self) -> None:
        for sink in self.sinks:
            self._call(sink, sink.close)


def open_tracker(
    tensorboard: Path | None,
    wandb_project: str | None,
    *,
    start_step: int,
    run_id: str | None = None,
    name: str | None = None,
    config: dict[str, Any] | None = None,
    baselines: tuple[dict[str, float], dict[str, float]] | None = None,
) -> Tracker | None:
    """The tracker a command's flags ask for (None: neither), continuing after `start_step`
    committed steps; `run_id` names the W&B run (the save directory's, so that a resumed run
    continues it), `baselines` are the data's, per token and per byte. TrackingError when a
    package is missing or W&B refuses."""
    check_available(tensorboard is not None, wandb_project is not None)
    sinks: list[Sink] = []
    if tensorboard is not None:
        try:
            sinks.append(TensorBoardSink(tensorboard, start_step))
        except OSError as exc:
            raise TrackingError(f"cannot write --tensorboard {tensorboard}: {exc}") from None
    if wandb_project is not None:
        per_token, per_byte = baselines or ({}, {})
        wandb_config = {**(config or {}), "baselines": per_token, "baselines_per_byte": per_byte}
        try:
            sinks.append(WandbSink(wandb_project, run_id, name, wandb_config))
        except TrackingError:
            for sink in sinks:
                sink.close()
            raise
    if not sinks:
        return None
    return Tracker(sinks, start_step, baseline_tags(*baselines) if baselines else None)
