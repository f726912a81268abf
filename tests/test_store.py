"""The coordinator's save directory: create, resume, refuse a different config, lock."""

from __future__ import annotations

from pathlib import Path

import pytest

from eggroll_dist.coordinator.store import RunStore, StoreError
from eggroll_dist.shared.config import ESConfig, preset
from eggroll_dist.shared.fitness_log import packed_size


def test_create_resume_and_metadata(tmp_path: Path) -> None:
    cfg = preset("tiny")
    store = RunStore.open(tmp_path / "run", cfg)
    run_id = store.run_id
    assert store.steps == 0 and store.data_digest is None and store.latest_snapshot is None
    store.fitness_log.append(0, bytes(packed_size(cfg.pairs)))
    store.set_data_digest(b"\x01" * 32)
    store.record_digest(1, 0xABC)
    store.save_snapshot(1, b"blob", keep=2)
    store.close()
    again = RunStore.open(tmp_path / "run", None)  # no flags: the stored config
    assert again.run_id == run_id and again.config == cfg and again.steps == 1
    assert again.data_digest == b"\x01" * 32 and again.digests == {1: 0xABC}
    assert again.latest_snapshot == 1
    again.close()
    RunStore.open(tmp_path / "run", cfg).close()  # the same flags again are fine


def test_different_config_is_refused(tmp_path: Path) -> None:
    RunStore.open(tmp_path / "run", preset("tiny")).close()
    other = preset("tiny").replace(es=ESConfig(population=1024, chunk_size=256))
    with pytest.raises(StoreError, match="holds a run with config digest"):
        RunStore.open(tmp_path / "run", other)


def test_missing_run_and_lock(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="holds no run"):
        RunStore.open(tmp_path / "empty", None)
    store = RunStore.open(tmp_path / "run", preset("tiny"))
    with pytest.raises(StoreError, match="another coordinator"):
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
