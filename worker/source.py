"""The replica a command reads (eggroll-sample, eggroll-export), and the data it needs.

A source is a save directory (the state at a step: the newest readable snapshot at or below
it, then the fitness log replayed), a checkpoint file, or an export directory
(export_format.py). A save directory and an export name the data digest of their run, so
the data directory a command is given can be checked against it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..protocol.ternary import unpack_ternary
from ..shared.data import BYTE_VOCAB_SIZE, DataError, DataMeta
from ..shared.progress import Progress
from ..shared.replica import CheckpointError, ReplicaState, load_checkpoint
from ..shared.save_dir import SaveDir, SaveDirError
from .export_format import ExportError, is_export, load_export, read_export_record


class SourceError(Exception):
    """A save directory, checkpoint, export or step that cannot give a replica."""


@dataclass(frozen=True)
class Source:
    state: ReplicaState
    origin: str  # a few words on where the state came from
    data_digest: str | None  # the run's data digest (hex), where the source records it


def load_source(
    path: Path,
    step: int | None = None,
    *,
    newest_snapshot: bool = True,
    on_replay: Callable[[int], Progress | None] | None = None,
    warn: Callable[[str], None] | None = None,
    model_dir: Path | None = None,
) -> Source:
    """The replica in `path` at `step`. Without a step, a save directory gives its newest
    snapshot's step (`newest_snapshot`) or its last step. `on_replay` hears how many logged
    steps are about to be replayed (and may return a Progress to follow them, as
    `replay_progress` does); `warn` hears of a snapshot that cannot be read, which
    is passed over for an older one (the log gives the same state). `model_dir`: a Hugging
    Face run's model directory, its step 0 (None: the run's model.path from here)."""
    if not path.exists():
        raise SourceError(f"{path} does not exist: give a save directory or a checkpoint file")
    if path.is_file():
        try:
            state = load_checkpoint(path)
        except CheckpointError as exc:
            raise SourceError(f"{path}: {exc}") from None
        _only_step(path, state, step)
        return Source(state, f"checkpoint {path.name}", None)
    if is_export(path):
        try:
            state = load_export(path)
            data_digest = read_export_record(path).get("data_digest")
        except ExportError as exc:
            raise SourceError(str(exc)) from None
        _only_step(path, state, step)
        return Source(state, f"export {path.name}", data_digest)
    try:
        run = SaveDir.open(path)
        run.model_dir = model_dir
        return _from_save_dir(run, step, newest_snapshot, on_replay, warn)
    except SaveDirError as exc:
        raise SourceError(str(exc)) from None


def _only_step(path: Path, state: ReplicaState, step: int | None) -> None:
    if step is not None and step != state.step:
        raise SourceError(
            f"{path} holds step {state.step}, not {step}: give its save directory to replay "
            "other steps"
        )


def _from_save_dir(
    run: SaveDir,
    step: int | None,
    newest_snapshot: bool,
    on_replay: Callable[[int], Progress | None] | None,
    warn: Callable[[str], None] | None,
) -> Source:
    committed = run.steps
    if step is None:
        snapshots = run.snapshot_steps()
        step = snapshots[-1] if snapshots and newest_snapshot else committed
    elif not 0 <= step <= committed:
        raise SourceError(f"--step {step} is not in {run.path}: it has steps 0..{committed}")

    def bad(path: Path, error: str) -> None:
        if warn is not None:
            warn(f"{path} cannot be used ({error}); starting from an older snapshot instead")

    base = run.base_at(step, bad)
    state = run.replay_from(base, step, unpack_ternary, on_replay)
    origin = "initial weights" if base.step == 0 else f"snapshot {base.step}"
    if step > base.step:
        origin += f" + {step - base.step} steps replayed"
    return Source(state, origin, run.run.get("data_digest"))


def check_data_dir(data_dir: Path, meta: DataMeta, vocab: int, data_digest: str | None) -> None:
    """DataError unless `data_dir` (its meta.json: `meta`) is data a model of `vocab` tokens,
    trained on data of `data_digest` (hex; None: not recorded), can be read with."""
    if meta.vocab_size != vocab:

        def kind(v: int) -> str:
            return "bytes (256 tokens)" if v == BYTE_VOCAB_SIZE else f"a {v}-token vocabulary"

        raise DataError(
            f"the model reads {kind(vocab)} but {data_dir} holds {kind(meta.vocab_size)}"
            ": give the data directory the model was trained on with --data-dir"
        )
    if data_digest is not None and meta.sha256 != data_digest:
        raise DataError(
            f"{data_dir} holds data {meta.sha256[:16]}, the run was trained on "
            f"{data_digest[:16]}: give its data directory with --data-dir"
        )


def replay_progress(say: Callable[[str], None]) -> Callable[[int], Progress]:
    """An `on_replay` for a command: says how many steps are replayed, then follows them (a
    bar on a terminal, else a line of `say` now and then: a replay can take hours)."""

    def start(count: int) -> Progress:
        say(f"replaying {count} steps of the fitness log")
        return Progress("replay", count, "steps", say=lambda p: say(p.line()), quiet_s=2.0)

    return start
