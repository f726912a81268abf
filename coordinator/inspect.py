"""`eggroll-inspect SAVE_DIR`: what a save directory (layout: store.py) holds, read-only,
so it is safe on a live run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from ..shared.cli import command
from ..shared.config import ConfigError, from_dict
from ..shared.fitness_log import FitnessLog, FitnessLogError
from ..shared.replica import CheckpointError, load_checkpoint
from .store import StoreError, read_digests


def inspect_run(save_dir: Path, last: int = 5) -> dict[str, Any]:
    """A summary of the run in `save_dir` (raises click.ClickException if there is none)."""
    try:
        run = json.loads((save_dir / "run.json").read_text())
        config = from_dict(run["config"])
    except FileNotFoundError:
        raise click.ClickException(f"{save_dir} holds no run (no run.json)") from None
    except (ValueError, KeyError, ConfigError) as exc:
        raise click.ClickException(f"{save_dir}/run.json is unreadable: {exc}") from None
    log_ok, log_error, steps = True, None, 0
    try:
        log = FitnessLog.open(save_dir / "fitness.log", repair=False)  # verifies every CRC
        steps = log.steps
        if log.config_digest != config.digest():
            log_ok, log_error = False, "fitness.log belongs to another run config"
    except FitnessLogError as exc:
        log_ok, log_error = False, str(exc)
    try:
        agreed, _ = read_digests(save_dir / "digests.log")
    except StoreError as exc:
        agreed, log_ok, log_error = {}, False, str(exc)
    digests = {s: f"{d:016x}" for s, d in agreed.items()}
    snapshots = []
    for path in sorted((save_dir / "snapshots").glob("step-*.ckpt")):
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
        "run_id": run.get("run_id"),
        "config_digest": config.digest().hex(),
        "data_digest": run.get("data_digest"),
        "step": steps,
        "pairs_per_step": config.pairs,
        "replica_digest": digests.get(steps),  # the state after every committed step
        "digests": {str(s): digests[s] for s in sorted(digests) if s > steps - last},
        "snapshots": snapshots,
        "log_ok": log_ok,
        "log_error": log_error,
    }


@command()
@click.argument("save_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@click.option("--last", default=5, show_default=True, help="How many recent digests to show.")
def main(save_dir: Path, as_json: bool, last: int) -> None:
    """Show a run's steps, digests, snapshots and fitness-log integrity."""
    info = inspect_run(save_dir, last)
    if as_json:
        click.echo(json.dumps(info, indent=2))
    else:
        click.echo(
            f"run {info['run_id']}  config {info['config_digest'][:16]}  "
            f"data {str(info['data_digest'])[:16]}"
        )
        state = "ok" if info["log_ok"] else f"BROKEN: {info['log_error']}"
        click.echo(f"steps committed: {info['step']}  fitness log: {state}")
        click.echo(f"replica digest after step {info['step']}: {info['replica_digest'] or '?'}")
        for step, digest in info["digests"].items():
            click.echo(f"  state at step {step:>8}: {digest}")
        for snap in info["snapshots"]:
            status = f"step {snap['step']} {snap['digest']}" if snap["ok"] else snap["error"]
            click.echo(f"snapshot {Path(snap['file']).name}: {status} ({snap['bytes']:,} B)")
    if not info["log_ok"]:
        raise SystemExit(1)
