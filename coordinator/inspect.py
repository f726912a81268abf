"""`eggroll-inspect SAVE_DIR`: what a save directory (layout: shared/save_dir.py) holds,
read-only, so it is safe on a live run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from ..shared.cli import OneLineError, cannot_write, command
from ..shared.config import preset_of
from ..shared.fitness_log import intact_steps
from ..shared.logs import echo
from ..shared.replica import CheckpointError, load_checkpoint
from ..shared.save_dir import SaveDir, SaveDirError
from .curve import read_curve
from .plot import PlotError, draw
from .plot import check_available as check_plot


def history(save_dir: Path, steps: int | None = None) -> dict[str, Any]:
    """Train loss, held-out bits and step times: the last of each in the curve the save dir
    records (coordinator/curve.py), or summary.json's where it is as new (eggroll-train's
    are unrounded), up to step `steps` (a log cut short no longer holds the later ones).
    None where it records none (a run from before history.log whose coordinator logged
    them to its stderr only)."""
    found: dict[str, Any] = {
        "source": None,
        "train_loss_bits": None,
        "train_reward": None,  # a reward run's, with its held-out prompts' reward
        "held_out_reward": None,
        "valid_bits_per_token": None,
        "valid_stream_bits_per_token": None,
        "valid_step": None,
        "step_s_mean": None,
        "step_s_last": None,
        "steps_timed": 0,
    }
    try:
        curve = read_curve(save_dir)
        if steps is not None:
            curve.steps = [r for r in curve.steps if r["step"] <= steps]
            curve.validations = [r for r in curve.validations if r["step"] <= steps]
        times = [float(r["step_s"]) for r in curve.steps if r.get("step_s") is not None]
        if curve.steps:
            found.update(
                train_loss_bits=curve.steps[-1].get("loss_bits"),
                train_reward=curve.steps[-1].get("reward"),
            )
        if curve.validations:
            last = curve.validations[-1]
            found.update(held_out_reward=last.get("held_out_reward"))
            found.update(
                valid_bits_per_token=last.get("valid_bits"),
                valid_stream_bits_per_token=last.get("stream_bits"),
                valid_step=last["step"],
            )
        summary = curve.summary
        done = (summary or {}).get("steps") or 0
        if summary is not None and curve.last_step <= done and (steps is None or done <= steps):
            times = times or [float(t) for t in summary.get("step_seconds", [])]
            if summary.get("train_loss_bits") is not None:
                found.update(train_loss_bits=summary["train_loss_bits"])
            if summary.get("valid_bits_per_token") is not None:
                found.update(
                    valid_bits_per_token=summary["valid_bits_per_token"],
                    valid_stream_bits_per_token=summary.get("valid_stream_bits_per_token"),
                    valid_step=summary.get("steps"),
                )
    except (OSError, ValueError, TypeError, AttributeError, KeyError) as exc:
        found.update(source=f"unreadable: {exc}")
        return found
    found.update(source=" + ".join(curve.sources) or None)
    if times:
        found.update(
            step_s_mean=sum(times) / len(times), step_s_last=times[-1], steps_timed=len(times)
        )
    return found


def inspect_run(save_dir: Path, last: int = 5) -> dict[str, Any]:
    """A summary of the run in `save_dir` (SaveDirError if it holds none)."""
    run_dir = SaveDir.open(save_dir)
    config = run_dir.config
    log_ok, log_error, steps, torn = True, None, 0, 0
    try:
        log = run_dir.fitness_log(torn_ok=True)  # verifies every CRC
        steps, torn = log.steps, log.torn_bytes
    except SaveDirError as exc:  # a corrupt record: the steps before it still stand
        log_ok, log_error = False, str(exc)
        steps = intact_steps(run_dir.layout.fitness_log) or 0
    try:
        agreed = run_dir.digests()
    except SaveDirError as exc:
        agreed, log_ok, log_error = {}, False, str(exc)
    digests = {s: f"{d:016x}" for s, d in agreed.items()}
    snapshots = []
    for path in run_dir.layout.snapshot_files():
        entry: dict[str, Any] = {"file": str(path), "bytes": path.stat().st_size}
        try:
            state = load_checkpoint(path)
            entry.update(step=state.step, digest=state.digest_hex(), ok=True)
            digests.setdefault(state.step, state.digest_hex())
        except CheckpointError as exc:
            entry.update(ok=False, error=str(exc))
        snapshots.append(entry)
    return {
        "save_dir": str(save_dir),
        "run_id": run_dir.run.get("run_id"),
        "preset": preset_of(config),
        "config_digest": config.digest().hex(),
        "data_digest": run_dir.run.get("data_digest"),
        "step": steps,
        "pairs_per_step": config.pairs,
        "replica_digest": digests.get(steps),  # the state after every committed step
        "digests": {str(s): digests[s] for s in sorted(digests) if steps - last < s <= steps},
        "snapshots": snapshots,
        "log_ok": log_ok,
        "log_error": log_error,
        # A crash mid-append (or an append under way): not a step; cut at the next start.
        "torn_tail_bytes": torn,
        "history": history(save_dir, steps),
    }


def _plot(save_dir: Path, info: dict[str, Any], path: Path) -> None:
    """Draw the curve into `path` and say so on stderr (stdout may be --json's)."""
    title = f"{save_dir.name}: preset {info['preset'] or 'none (own config)'}, {info['step']} steps"
    try:
        curve = read_curve(save_dir)
        drawn = draw(curve, path, title)
    except PlotError as exc:
        raise click.ClickException(f"{exc} ({save_dir})") from None
    except OSError as exc:
        raise cannot_write(exc, path) from None
    points = len(drawn.get("held-out", ([], []))[0])
    baselines = "" if curve.baselines else "; baselines unknown (no --data-dir)"
    echo(f"plot of {info['step']} steps, {points} held-out scores in {path}{baselines}", err=True)


def _number(value: Any, form: str) -> str:
    return "unknown" if value is None else format(value, form)


def _history_line(info: dict[str, Any]) -> str:
    h = info["history"]
    head = f"preset {info['preset'] or 'none (own config)'}"
    if h["source"] is None:
        return (
            f"{head}; train loss, held-out bits and step times unknown: the save dir keeps "
            "none (a run from before history.log; its coordinator logged them to stderr)"
        )
    valid = _number(h["valid_bits_per_token"], ".3f")
    if h["valid_step"] is not None:
        valid += f" (step {h['valid_step']})"
    streams = h["valid_stream_bits_per_token"]
    valid += " bits/token" + ("" if streams is None else f", {streams:.3f} over long streams")
    train = f"last train loss {_number(h['train_loss_bits'], '.3f')} bits/token"
    if h["train_reward"] is not None:
        train = f"last train reward {h['train_reward']:.4f}, held-out reward "
        train += _number(h["held_out_reward"], ".4f")
    # A reward run without data scores no held-out text: its reward is its held-out score.
    if h["valid_bits_per_token"] is not None or h["held_out_reward"] is None:
        train += f", held-out {valid}"
    return (
        f"{head}; {train}, step time {_number(h['step_s_mean'], '.2f')} s mean "
        f"/ {_number(h['step_s_last'], '.2f')} s last over {h['steps_timed']} steps "
        f"(from {h['source']})"
    )


@command()
@click.argument("save_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@click.option("--last", default=5, show_default=True, help="How many recent digests to show.")
@click.option(
    "--plot",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    metavar="PNG",
    help="Draw the train loss and held-out scores over the steps, against the baselines, "
    "into this PNG file. Needs the plot extra.",
)
def main(save_dir: Path, as_json: bool, last: int, plot: Path | None) -> None:
    """Show a run's steps, digests, snapshots and fitness-log integrity."""
    try:
        if plot is not None:
            check_plot()
        info = inspect_run(save_dir, last)
    except PlotError as exc:
        raise OneLineError(str(exc)) from None
    except SaveDirError as exc:
        raise click.ClickException(str(exc)) from None
    if plot is not None:
        _plot(save_dir, info, plot)
    if as_json:
        click.echo(json.dumps(info, indent=2))
    else:
        click.echo(
            f"run {info['run_id']}  config {info['config_digest'][:16]}  "
            f"data {(info['data_digest'] or 'none')[:16]}"
        )
        click.echo(_history_line(info))
        state = "ok" if info["log_ok"] else f"BROKEN: {info['log_error']}"
        if info["torn_tail_bytes"]:
            state += (
                f"; its tail is torn ({info['torn_tail_bytes']} bytes of an unfinished "
                "append, not a step: cut when the run starts again)"
            )
        intact = " (the records before the corrupt one)" if not info["log_ok"] else ""
        click.echo(f"steps committed: {info['step']}{intact}  fitness log: {state}")
        click.echo(f"replica digest after step {info['step']}: {info['replica_digest'] or '?'}")
        for step, digest in info["digests"].items():
            click.echo(f"  state at step {step:>8}: {digest}")
        for snap in info["snapshots"]:
            status = f"step {snap['step']} {snap['digest']}" if snap["ok"] else snap["error"]
            click.echo(f"snapshot {Path(snap['file']).name}: {status} ({snap['bytes']:,} B)")
    if not info["log_ok"]:
        raise SystemExit(1)
