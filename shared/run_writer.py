"""The one writer of a save directory (the layout of shared/save_dir.py), and summary.json.

The coordinator's `RunStore` (coordinator/store.py) and `eggroll-train --save-dir`
(worker/train.py) both write through `RunWriter`: the writer lock held for the writer's
life, run.json and the start file of a new run, the fitness log (created, or opened with a
torn tail cut off and checked to belong to the run's config), the newest snapshots, and
summary.json. What only a coordinator does (digests.log, degraded writes, suspect hosts,
the format upgrade) stays in the store; how eggroll-train reports a failure stays in train.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .atomic_file import fsync_dir, naming, write_atomic
from .config import RunConfig, config_difference
from .fitness_log import FitnessLog, FitnessLogError
from .logs import os_error_text
from .pinned import GoalError
from .save_dir import (
    LOCK_FILE,
    Layout,
    SaveDirError,
    new_run,
    read_run,
    take_lock,
    write_run,
    write_start,
)

SNAPSHOTS_KEPT = 3  # the newest snapshots a save directory keeps, unless told otherwise
_STALE_TMP = ".*.tmp"  # write_atomic's temporary files, left by a crash


def config_mismatch(root: Path, stored: RunConfig, given: RunConfig) -> str:
    """The one line that refuses to continue a run with another config."""
    return (
        f"--save-dir {root} holds a run with config digest {stored.digest().hex()[:16]}, "
        f"the given config has {given.digest().hex()[:16]} ({config_difference(stored, given)}"
        "): start it with the run's own --preset/--config (a coordinator also takes none), "
        "or use a new --save-dir"
    )


class RunWriter:
    """A save directory held for writing: `take` holds its lock, then `load` opens the run
    there or `create` makes a new one. Every refusal is SaveDirError (SaveDirBusy for a
    directory another writer holds), one line; a failed write is the OSError, naming its
    file. `close` gives the lock up."""

    def __init__(self, layout: Layout, lock_fd: int, made_dir: bool, made_lock: bool) -> None:
        self.layout = layout
        self._lock_fd: int | None = lock_fd
        self._made_dir = made_dir  # the directory was absent: `discard` removes it
        self._made_lock = made_lock
        self.found_run = layout.run_file.exists()  # under the lock: no writer is making one
        self.created = False  # `create` began writing a new run here
        self.run: dict[str, Any] = {}  # run.json, once loaded or created
        self.config: RunConfig | None = None
        self.fitness_log: FitnessLog | None = None
        self.snapshot_steps: list[int] = []  # those of committed steps, ascending

    @classmethod
    def take(cls, path: str | Path) -> RunWriter:
        """Hold the writer lock of the save directory at `path`, made (with its parents) if
        it is absent, readable by its owner only. SaveDirBusy while another writer holds
        it; OSError when the directory or its lock file cannot be made."""
        layout = Layout(Path(path))
        made_dir = not layout.root.exists()
        layout.root.parent.mkdir(parents=True, exist_ok=True)
        # Its owner's alone: the fitness log and snapshots are the run (a digest, a replica).
        layout.root.mkdir(mode=0o700, exist_ok=True)
        made_lock = not layout.lock.exists()
        fd = take_lock(layout)
        assert fd is not None  # created when missing
        return cls(layout, fd, made_dir, made_lock)

    @classmethod
    def open(cls, path: str | Path, config: RunConfig | None, goal_dir: Path) -> RunWriter:
        """The run in `path` opened for writing, or a new one made there with `config` (None:
        the run must exist); a new run's starting replica is copied in from `goal_dir`."""
        writer = cls.take(path)
        try:
            if config is not None and not writer.found_run:
                writer.create(config, goal_dir, new_run(config))
            else:
                writer.load(config)
        except BaseException:
            writer.close()
            raise
        return writer

    @property
    def root(self) -> Path:
        return self.layout.root

    def others(self) -> list[Path]:
        """What the directory holds besides the lock (a new run wants none of it)."""
        return [p for p in self.root.iterdir() if p.name != LOCK_FILE]

    def load(self, config: RunConfig | None, data_digest: bytes | None = None) -> None:
        """Open the run found here: run.json read, its config checked against `config` and
        its data digest against `data_digest` (each None: any), the fitness log opened with
        a torn last record cut off. Nothing here changes before run.json's checks passed."""
        try:
            run, stored = read_run(self.layout)
        except SaveDirError as exc:
            remedy = "; restore it or use a new --save-dir" if self.found_run else ""
            raise SaveDirError(f"{exc}{remedy}") from None
        if config is not None and config.digest() != stored.digest():
            raise SaveDirError(config_mismatch(self.root, stored, config))
        recorded = run.get("data_digest")
        if data_digest is not None and recorded is not None and recorded != data_digest.hex():
            raise SaveDirError(
                f"{self.root} was trained on data {recorded[:16]}, --data-dir holds "
                f"{data_digest.hex()[:16]}: give the run's data directory"
            )
        self._remove_stale()
        self._open_log(stored)
        self.layout.snapshots.mkdir(exist_ok=True)
        self.run, self.config = run, stored
        self.snapshot_steps = [s for s in self.layout.snapshot_steps() if s <= self.steps]

    def create(self, config: RunConfig, goal_dir: Path, run: dict[str, Any]) -> None:
        """Make a new run here: its starting replica (model.init_from, under `goal_dir`),
        run.json (`run`, from save_dir.new_run) and an empty fitness log."""
        self.created = True
        self._remove_stale()
        self.layout.snapshots.mkdir(exist_ok=True)
        fsync_dir(self.root)
        try:
            write_start(self.layout, config, goal_dir)
        except GoalError as exc:
            raise SaveDirError(str(exc)) from None
        write_run(self.layout, run)
        self._open_log(config)
        self.run, self.config = run, config

    def _open_log(self, config: RunConfig) -> None:
        path = self.layout.fitness_log
        try:
            with naming(path):
                if path.exists():
                    log = FitnessLog.open(path)  # cuts a torn last record off
                else:
                    log = FitnessLog.create(path, config.pairs, config.digest())
        except FitnessLogError as exc:
            raise SaveDirError(str(exc)) from None
        if log.config_digest != config.digest() or log.pairs != config.pairs:
            raise SaveDirError(f"{path} belongs to another run config")
        self.fitness_log = log

    def _remove_stale(self) -> None:
        """The temporary files of a writer that crashed (we hold the lock: none is alive)."""
        for stale in [*self.root.glob(_STALE_TMP), *self.layout.snapshots.glob(_STALE_TMP)]:
            stale.unlink(missing_ok=True)

    @property
    def steps(self) -> int:
        """Steps committed."""
        return 0 if self.fitness_log is None else self.fitness_log.steps

    def steps_on_disk(self) -> int:
        """Steps the fitness log holds, read again (a torn last record cut): after a failed
        append the open log's tail is unknown. 0 when there is none that reads."""
        try:
            return FitnessLog.open(self.layout.fitness_log).steps
        except (OSError, FitnessLogError):
            return 0

    def save_snapshot(self, step: int, blob: bytes, keep: int = SNAPSHOTS_KEPT) -> None:
        """Store the snapshot of `step` atomically and keep only the newest `keep`. A failed
        write raises its OSError and leaves no file of it behind (a snapshot only shortens a
        replay: the run's state is the fitness log's)."""
        path = self.layout.snapshot(step)
        try:
            write_atomic(path, blob)
        except OSError:
            # write_atomic removed its temporary file; a failure after the rename (the
            # directory's fsync) leaves a whole file, removed too: the snapshot is dropped.
            if step not in self.snapshot_steps:
                with contextlib.suppress(OSError):
                    path.unlink(missing_ok=True)
            raise
        self.snapshot_steps = sorted({*self.snapshot_steps, step})
        while len(self.snapshot_steps) > keep:
            old = self.snapshot_steps.pop(0)
            # an old snapshot left over costs room, not state; a later start prunes it
            with contextlib.suppress(OSError):
                self.layout.snapshot(old).unlink(missing_ok=True)

    def write_summary(self, summary: dict[str, Any]) -> None:
        """summary.json, for eggroll-inspect (`run_summary` builds it)."""
        write_summary(self.layout.summary, summary)

    def discard(self) -> str:
        """Undo a new run that failed before its first step, in a directory that was absent
        or empty: the files `create` wrote (run.json last: without it nothing reads as a
        run), the lock file and the directory if this writer made them; then close. '' when
        done, else what is left, for the error line."""
        layout = self.layout
        try:
            if self.created:
                for path in (
                    layout.summary,
                    layout.history,
                    *layout.snapshot_files(),
                    layout.fitness_log,
                    layout.start,
                ):
                    path.unlink(missing_ok=True)
                layout.run_file.unlink(missing_ok=True)
                with contextlib.suppress(FileNotFoundError):
                    layout.snapshots.rmdir()
            if self._made_lock:
                layout.lock.unlink(missing_ok=True)  # while held: see take_lock
            self.close()
            if self._made_dir:
                layout.root.rmdir()
        except OSError as exc:
            self.close()
            error = os_error_text(exc)
            return f"could not clear {self.root} ({error}): remove it before running again"
        return ""

    def close(self) -> None:
        """Give the lock up (the fitness log holds no open file)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


# --- summary.json ----------------------------------------------------------------------------


def run_summary(
    *,
    steps: int,
    preset: str | None,
    config_digest: str,
    replica_digest: str,
    held_out: Mapping[str, Any],
    baselines: Mapping[str, float],
    baselines_per_byte: Mapping[str, float],
    seconds: float,
    train_losses: list[float] | None = None,
    train_rewards: list[float] | None = None,
    member_tokens: int | None = None,
    member_tokens_per_second: float | None = None,
    steps_per_second: float | None = None,
    curve: list[dict[str, Any]] | None = None,
    step_seconds: list[float] | None = None,
    save_dir: Path | None = None,
    snapshot: Path | None = None,
) -> dict[str, Any]:
    """summary.json of eggroll-train, eggroll-tune and eggroll-local, one schema. Keys in
    this order; those after `baselines_per_byte` only where the command has them (an
    argument left None), except where said:

        steps                     steps committed in all (the run's, not this command's)
        preset                    the preset named, or null
        config_digest             the run config's digest, hex
        replica_digest            the replica digest at `steps`, 16 hex
        valid_NAME                each entry of the held-out report (Validation.report():
                                  bits_per_token, bits_per_byte, loss_16, tokens, the same
                                  prefixed stream_, and held_out_reward of a reward
                                  objective; null: not measured); a `step` entry is left out
        baselines                 the data's baselines, bits per token ("unigram", ...)
        baselines_per_byte        the same in bits per byte
        train_loss_bits           the last step's mean loss, bits per token; null when none
                                  was measured (a reward run). Present with train_losses
        train_losses              each step's mean loss (when there is one)
        train_reward              the last step's mean reward (with train_rewards)
        train_rewards             each step's mean reward (when there is one)
        member_tokens             tokens the population evaluated in this command
        member_tokens_per_second  that per second of evaluation and update
        steps_per_second          steps this command committed per second
        seconds                   this command's wall time (always present)
        curve                     each validation: {"step", and the report's names}
        step_seconds              each step's seconds, rounded to 0.1 ms
        save_dir                  the save directory
        snapshot                  the snapshot the held-out report was measured on
    """
    summary: dict[str, Any] = {
        "steps": steps,
        "preset": preset,
        "config_digest": config_digest,
        "replica_digest": replica_digest,
        **{f"valid_{k}": value for k, value in held_out.items() if k != "step"},
        "baselines": baselines,
        "baselines_per_byte": baselines_per_byte,
    }
    if train_losses is not None:
        summary["train_loss_bits"] = train_losses[-1] if train_losses else None
        if train_losses:
            summary["train_losses"] = train_losses
    if train_rewards:
        summary.update(train_reward=train_rewards[-1], train_rewards=train_rewards)
    optional = {
        "member_tokens": member_tokens,
        "member_tokens_per_second": member_tokens_per_second,
        "steps_per_second": steps_per_second,
    }
    summary.update((k, v) for k, v in optional.items() if v is not None)
    summary["seconds"] = seconds
    if curve is not None:
        summary["curve"] = curve
    if step_seconds is not None:
        summary["step_seconds"] = [round(t, 4) for t in step_seconds]
    if save_dir is not None:
        summary["save_dir"] = str(save_dir)
    if snapshot is not None:
        summary["snapshot"] = str(snapshot)
    return summary


def write_summary(path: Path, summary: dict[str, Any]) -> None:
    """Write a summary atomically as indented JSON: whole or not at all."""
    write_atomic(path, (json.dumps(summary, indent=2) + "\n").encode())
