"""The coordinator's save directory: create, resume, refuse a different config, lock."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from eggroll_dist.coordinator.store import RunStore, StoreError
from eggroll_dist.protocol.ternary import pack_ternary
from eggroll_dist.shared.config import ESConfig, RunConfig, preset
from eggroll_dist.shared.fitness_log import packed_size
from eggroll_dist.shared.replica import ReplicaState, encode_checkpoint, replay
from eggroll_dist.shared.save_dir import Layout, digest_line


def test_create_resume_and_metadata(tmp_path: Path) -> None:
    cfg = preset("tiny")
    store = RunStore.open(tmp_path / "run", cfg)
    run_id = store.run_id
    assert store.steps == 0 and store.data_digest is None and store.latest_snapshot is None
    store.fitness_log.append(0, bytes(packed_size(cfg.pairs)))
    store.set_data_digest(b"\x01" * 32)
    state = _state_after(cfg, 1)
    store.record_digest(1, state.digest())
    store.save_snapshot(1, encode_checkpoint(state), keep=2)
    store.close()
    again = RunStore.open(tmp_path / "run", None)  # no flags: the stored config
    assert again.run_id == run_id and again.config == cfg and again.steps == 1
    assert again.data_digest == b"\x01" * 32 and again.digests == {1: state.digest()}
    assert again.latest_snapshot == 1 and again.bad_snapshots == []
    again.close()
    RunStore.open(tmp_path / "run", cfg).close()  # the same flags again are fine


def _state_after(cfg: RunConfig, steps: int) -> ReplicaState:
    """The state after `steps` steps of all-zero fitness (what a zeroed log records)."""
    return replay(ReplicaState.initial(cfg), [np.zeros(cfg.pairs, np.int8)] * steps)


def test_a_bad_newest_snapshot_is_left_out_for_the_older_one(tmp_path: Path) -> None:
    cfg = preset("tiny")
    store = RunStore.open(tmp_path / "run", cfg)
    for step in range(3):
        store.fitness_log.append(step, pack_ternary(np.zeros(cfg.pairs, np.int8)))
    for step in (1, 2, 3):
        store.save_snapshot(step, encode_checkpoint(_state_after(cfg, step)), keep=3)
    store.close()
    newest, middle = store.snapshot_path(3), store.snapshot_path(2)
    newest.write_bytes(newest.read_bytes()[:1000])  # cut short
    data = bytearray(middle.read_bytes())
    data[5000] ^= 1  # bit rot
    middle.write_bytes(bytes(data))
    again = RunStore.open(tmp_path / "run", None)
    assert again.snapshot_steps == [1] and again.latest_snapshot == 1
    assert [(p, why.split(" (")[0]) for p, why in again.bad_snapshots] == [
        (newest, "checkpoint is truncated"),
        (middle, "checkpoint CRC mismatch: the file is corrupt"),
    ]
    assert newest.exists() and middle.exists()  # left for the operator
    again.close()


def test_different_config_is_refused(tmp_path: Path) -> None:
    RunStore.open(tmp_path / "run", preset("tiny")).close()
    other = preset("tiny").replace(es=ESConfig(population=1024, chunk_size=256))
    with pytest.raises(StoreError, match="holds a run with config digest"):
        RunStore.open(tmp_path / "run", other)


def test_missing_run_and_lock(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="holds no run"):
        RunStore.open(tmp_path / "empty", None)
    store = RunStore.open(tmp_path / "run", preset("tiny"))
    with pytest.raises(StoreError, match=f"process {os.getpid()} is writing to"):
        RunStore.open(tmp_path / "run", None)
    store.close()


def test_snapshots_keep_the_newest(tmp_path: Path) -> None:
    store = RunStore.open(tmp_path / "run", preset("tiny"))
    for step in range(5):
        store.fitness_log.append(step, bytes(packed_size(store.config.pairs)))
    for step in (1, 2, 3, 4):
        store.save_snapshot(step, b"x", keep=2)
    assert store.snapshot_steps == [3, 4]
    assert sorted(p.name for p in (tmp_path / "run" / "snapshots").iterdir()) == [
        "step-00000003.ckpt",
        "step-00000004.ckpt",
    ]
    store.close()


def test_digests_log_is_strict_and_a_torn_last_line_is_cut(tmp_path: Path) -> None:
    store = RunStore.open(tmp_path / "run", preset("tiny"))
    store.record_digest(1, 0xABC)
    store.record_digest(2, 0xDEF)
    store.close()
    path = tmp_path / "run" / "digests.log"
    good = path.read_bytes()
    for torn in (b"3 000000000", b"3 000000000\n", b"3 0000\0\0\0\0\n", b"3 00000000000000zz\n"):
        path.write_bytes(good + torn)
        again = RunStore.open(tmp_path / "run", None)
        assert again.digests == {1: 0xABC, 2: 0xDEF}
        assert path.read_bytes() == good  # cut, so the next append starts a fresh line
        again.close()
    path.write_bytes(b"1 0000000000000abc\nnot a digest\n" + good)
    with pytest.raises(StoreError, match=r"line 2 is malformed.*delete it"):
        RunStore.open(tmp_path / "run", None)


def test_stale_temporary_files_are_removed(tmp_path: Path) -> None:
    RunStore.open(tmp_path / "run", preset("tiny")).close()
    stale = [tmp_path / "run" / ".run.json.9.ab.tmp", tmp_path / "run/snapshots/.x.1.cd.tmp"]
    for p in stale:
        p.write_bytes(b"half a snapshot")
    RunStore.open(tmp_path / "run", None).close()
    assert not any(p.exists() for p in stale)


def test_unusable_save_dir_is_one_clear_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(StoreError, match="cannot use --save-dir"):
        RunStore.open(tmp_path / "file" / "run", preset("tiny"))
    (tmp_path / "run" / ".lock").mkdir(parents=True)  # the lock cannot be opened
    with pytest.raises(StoreError, match="cannot use --save-dir"):
        RunStore.open(tmp_path / "run", preset("tiny"))


def test_a_refused_start_leaves_a_format_1_run_as_it_was(tmp_path: Path) -> None:
    """A format-1 run whose fitness log belongs to another config is refused before
    anything in it changes: digests.log and run.json's format stay."""
    RunStore.open(tmp_path / "run", preset("tiny")).close()
    RunStore.open(tmp_path / "other", preset("former-tiny")).close()
    layout = Layout(tmp_path / "run")
    run = json.loads(layout.run_file.read_text())
    layout.run_file.write_text(json.dumps({**run, "format": 1}))
    layout.digests_log.write_bytes(digest_line(0, 0x0123456789ABCDEF))
    layout.fitness_log.write_bytes(Layout(tmp_path / "other").fitness_log.read_bytes())
    with pytest.raises(StoreError, match="belongs to another run config"):
        RunStore.open(tmp_path / "run", None)
    assert json.loads(layout.run_file.read_text())["format"] == 1
    assert layout.digests_log.read_bytes() == digest_line(0, 0x0123456789ABCDEF)
    assert not (tmp_path / "run" / "digests-1.log").exists()


def test_a_run_of_digest_1_is_upgraded(tmp_path: Path) -> None:
    """A run written before the replica digest became a tree: its agreed digests are set
    aside (kept as digests-1.log) and run.json says format 2; the fitness log stays."""
    RunStore.open(tmp_path / "run", preset("tiny")).close()
    layout = Layout(tmp_path / "run")
    run = json.loads(layout.run_file.read_text())
    layout.run_file.write_text(json.dumps({**run, "format": 1}))
    layout.digests_log.write_bytes(digest_line(0, 0x0123456789ABCDEF))
    store = RunStore.open(tmp_path / "run", None)
    assert store.digests == {}
    store.close()
    assert json.loads(layout.run_file.read_text())["format"] == 2
    assert (tmp_path / "run" / "digests-1.log").read_bytes() == digest_line(0, 0x0123456789ABCDEF)
