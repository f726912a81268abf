"""The one writer of a save directory (shared/run_writer.py), which the coordinator's store
and eggroll-train share: the lock, a new run made and an old one opened, the newest
snapshots, a failed new run undone, and the one summary.json schema."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from eggroll_dist.coordinator.store import RunStore, StoreError
from eggroll_dist.shared import save_dir as save_dir_module
from eggroll_dist.shared.config import ESConfig, ModelConfig, RunConfig, ValidationConfig
from eggroll_dist.shared.fitness_log import FitnessLog, packed_size
from eggroll_dist.shared.run_writer import (
    SNAPSHOTS_KEPT,
    RunWriter,
    config_mismatch,
    run_summary,
)
from eggroll_dist.shared.save_dir import (
    Layout,
    SaveDirBusy,
    SaveDirError,
    new_run,
    take_lock,
    write_run,
)

CFG = RunConfig(
    model=ModelConfig(n_layer=1, d_model=16),
    es=ESConfig(population=16, chunk_size=8, seq_len=8),
    validation=ValidationConfig(every_steps=0, max_tokens=256),
    steps=3,
)
OTHER = CFG.replace(es=ESConfig(population=32, chunk_size=8, seq_len=8))


def _append(writer: RunWriter, steps: int) -> None:
    assert writer.fitness_log is not None
    for step in range(writer.steps, writer.steps + steps):
        writer.fitness_log.append(step, bytes(packed_size(CFG.pairs)))


def test_a_new_run_is_made_under_the_lock_and_opened_again(tmp_path: Path) -> None:
    root = tmp_path / "a" / "run"
    writer = RunWriter.open(root, CFG, tmp_path)
    assert writer.created and not writer.found_run and writer.steps == 0
    me = os.getpid()  # the lock is held by this process's writer
    busy = f"process {me} is writing to {root}: wait for it to end, or use another --save-dir"
    with pytest.raises(SaveDirBusy) as refused:
        RunWriter.take(root)
    assert str(refused.value) == busy
    with pytest.raises(StoreError, match=f"process {me} is writing to {root}"):
        RunStore.open(root, None)
    _append(writer, 2)
    run_id = writer.run["run_id"]
    writer.close()

    again = RunWriter.open(root, None, tmp_path)  # None: the stored config
    assert again.found_run and not again.created
    assert again.run["run_id"] == run_id and again.config == CFG and again.steps == 2
    again.close()


def test_one_config_mismatch_line_for_both_writers(tmp_path: Path) -> None:
    root = tmp_path / "run"
    RunWriter.open(root, CFG, tmp_path).close()
    line = config_mismatch(root, CFG, OTHER)
    assert line.startswith(f"--save-dir {root} holds a run with config digest ")
    writer = RunWriter.take(root)
    with pytest.raises(SaveDirError) as refused:
        writer.load(OTHER)
    assert str(refused.value) == line
    writer.close()
    with pytest.raises(StoreError) as refused_store:
        RunStore.open(root, OTHER)
    assert str(refused_store.value) == line


def test_a_run_of_other_data_or_a_foreign_log_is_refused_before_any_write(
    tmp_path: Path,
) -> None:
    root = tmp_path / "run"
    layout = Layout(root)
    root.mkdir()
    write_run(layout, new_run(CFG, b"\x01" * 32))
    FitnessLog.create(layout.fitness_log, OTHER.pairs, OTHER.digest())
    writer = RunWriter.take(root)
    with pytest.raises(SaveDirError, match=r"was trained on data 0101.*give the run's data"):
        writer.load(CFG, b"\x02" * 32)
    assert not layout.snapshots.exists()  # nothing made before every check passed
    with pytest.raises(SaveDirError, match="belongs to another run config"):
        writer.load(CFG, b"\x01" * 32)
    writer.close()


def test_a_torn_fitness_log_tail_is_cut_when_the_run_is_opened(tmp_path: Path) -> None:
    root = tmp_path / "run"
    writer = RunWriter.open(root, CFG, tmp_path)
    _append(writer, 2)
    writer.close()
    whole = Layout(root).fitness_log.read_bytes()
    Layout(root).fitness_log.write_bytes(whole + b"\x00" * 7)  # a crash mid-append
    again = RunWriter.open(root, CFG, tmp_path)
    assert again.steps == 2 and again.fitness_log is not None
    assert again.fitness_log.repaired_bytes == 7
    assert Layout(root).fitness_log.read_bytes() == whole
    again.close()


def test_snapshots_keep_the_newest(tmp_path: Path) -> None:
    writer = RunWriter.open(tmp_path / "run", CFG, tmp_path)
    _append(writer, 6)
    for step in range(1, 7):
        writer.save_snapshot(step, b"snapshot %d" % step)
    assert writer.snapshot_steps == [4, 5, 6] and SNAPSHOTS_KEPT == 3
    assert writer.layout.snapshot_steps() == [4, 5, 6]
    writer.save_snapshot(6, b"again", keep=1)
    assert writer.layout.snapshot_steps() == [6]
    assert writer.layout.snapshot(6).read_bytes() == b"again"
    writer.close()


def test_a_failed_new_run_is_undone_and_the_directory_taken_again(tmp_path: Path) -> None:
    absent = tmp_path / "absent"
    writer = RunWriter.open(absent, CFG, tmp_path)
    _append(writer, 1)
    writer.save_snapshot(1, b"x")
    assert writer.discard() == ""
    assert not absent.exists()

    empty = tmp_path / "empty"
    empty.mkdir()
    writer = RunWriter.open(empty, CFG, tmp_path)
    assert writer.discard() == "" and list(empty.iterdir()) == []
    RunWriter.open(empty, CFG, tmp_path).close()  # free again


def test_a_lock_file_removed_under_a_waiting_writer_is_not_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer that opened the lock file just before its holder gave its new run up (and
    removed the file) must not lock that removed file: a third would lock the new one."""
    root = tmp_path / "run"
    root.mkdir()
    holder = RunWriter.take(root)
    layout = Layout(root)
    stale = os.open(layout.lock, os.O_RDWR)  # opened while it was held
    real_open = os.open
    handed = []

    def open_stale_first(path: object, *args: object) -> int:
        if Path(str(path)) == layout.lock and not handed:
            handed.append(stale)
            holder.discard()  # unlinks the file it holds, then lets go
            return stale
        return real_open(path, *args)

    monkeypatch.setattr(save_dir_module.os, "open", open_stale_first)
    fd = take_lock(layout)
    monkeypatch.undo()
    assert fd is not None and handed == [stale]
    assert os.fstat(fd).st_ino == os.stat(layout.lock).st_ino
    with pytest.raises(SaveDirBusy):
        take_lock(layout)
    os.close(fd)


def test_the_summary_schema_of_a_training_command() -> None:
    held_out = {"step": 4, "bits_per_token": 5.0, "tokens": 10, "held_out_reward": 0.5}
    summary = run_summary(
        steps=4,
        preset="tiny",
        config_digest="cd",
        replica_digest="rd",
        held_out=held_out,
        baselines={"unigram": 6.0},
        baselines_per_byte={"unigram": 6.0},
        seconds=2.0,
        train_losses=[],
        train_rewards=[0.25, 0.5],
        member_tokens=100,
        member_tokens_per_second=50.0,
        curve=[held_out],
        step_seconds=[0.123456, 0.5],
    )
    assert list(summary) == [
        "steps",
        "preset",
        "config_digest",
        "replica_digest",
        "valid_bits_per_token",
        "valid_tokens",
        "valid_held_out_reward",
        "baselines",
        "baselines_per_byte",
        "train_loss_bits",
        "train_reward",
        "train_rewards",
        "member_tokens",
        "member_tokens_per_second",
        "seconds",
        "curve",
        "step_seconds",
    ]
    assert summary["train_loss_bits"] is None and summary["train_reward"] == 0.5
    assert summary["step_seconds"] == [0.1235, 0.5]


def test_the_summary_schema_of_a_local_run(tmp_path: Path) -> None:
    summary = run_summary(
        steps=7,
        preset=None,
        config_digest="cd",
        replica_digest="rd",
        held_out={"bits_per_token": 5.0},
        baselines={},
        baselines_per_byte={},
        seconds=3.0,
        steps_per_second=2.0,
        save_dir=tmp_path,
        snapshot=tmp_path / "snapshots" / "step-00000007.ckpt",
    )
    assert summary == {
        "steps": 7,
        "preset": None,
        "config_digest": "cd",
        "replica_digest": "rd",
        "valid_bits_per_token": 5.0,
        "baselines": {},
        "baselines_per_byte": {},
        "steps_per_second": 2.0,
        "seconds": 3.0,
        "save_dir": str(tmp_path),
        "snapshot": str(tmp_path / "snapshots" / "step-00000007.ckpt"),
    }
    assert list(summary)[-4:] == ["steps_per_second", "seconds", "save_dir", "snapshot"]


def test_a_new_save_directory_is_its_owners_alone(tmp_path: Path) -> None:
    writer = RunWriter.open(tmp_path / "deep" / "run", CFG, tmp_path)
    writer.close()
    assert (tmp_path / "deep" / "run").stat().st_mode & 0o777 == 0o700
