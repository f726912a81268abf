"""A coordinator whose newest snapshot is damaged verifies it at start and serves joiners
the older good one, instead of a file each joiner rejects before replaying from step 0."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from helpers import TINY_RUN, digest_at, start_coordinator, start_worker

from eggroll_dist.coordinator.store import RunStore
from eggroll_dist.protocol.ternary import pack_ternary, unpack_ternary
from eggroll_dist.shared.config import load_config
from eggroll_dist.shared.replica import encode_checkpoint
from eggroll_dist.shared.save_dir import SaveDir


def test_joiners_get_the_newest_good_snapshot(spawn, tmp_path: Path, words_data: Path) -> None:
    config = tmp_path / "tiny.toml"
    config.write_text(TINY_RUN)
    cfg = load_config(config)
    store = RunStore.open(tmp_path / "run", cfg)
    rng = np.random.default_rng(5)
    for step in range(4):
        store.fitness_log.append(step, pack_ternary(rng.integers(-1, 2, cfg.pairs).astype(np.int8)))
    good = SaveDir.open(store.path).state_at(2, unpack_ternary)
    store.save_snapshot(2, encode_checkpoint(good), keep=3)
    bad = store.snapshot_path(4)
    bad.write_bytes(encode_checkpoint(SaveDir.open(store.path).state_at(4, unpack_ternary))[:-7])
    store.close()
    coord, port = start_coordinator(spawn, store.path, config, "--max-steps", "5")
    (warning,) = [e for e in coord.events if e["event"] == "snapshot unusable"]
    assert warning["path"] == str(bad) and "truncated" in warning["error"]
    assert warning["serving"] == 2
    worker = start_worker(spawn, port, words_data)
    loaded = worker.wait_for(lambda e: e.get("event") == "snapshot loaded", 60)
    assert loaded["step"] == 2 and loaded["digest"] == good.digest_hex()
    assert coord.wait(120) == 0
    assert worker.count(lambda e: e.get("event", "").startswith("snapshot rejected")) == 0
    assert SaveDir.open(store.path).steps == 5
    assert coord.count(lambda e: e.get("event") == "snapshot stored" and e["step"] == 5) == 1
    assert digest_at(store.path, 5) == SaveDir.open(store.path).state_at(5, unpack_ternary).digest()
