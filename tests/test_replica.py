"""Replica digest and the checkpoint file format."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from eggroll_dist.shared.config import preset
from eggroll_dist.shared.replica import (
    CheckpointError,
    ReplicaState,
    checkpoint_bytes,
    decode_checkpoint,
    encode_checkpoint,
    load_checkpoint,
    save_checkpoint,
)


def test_digest_depends_on_every_weight_and_the_step() -> None:
    state = ReplicaState.initial(preset("tiny"))
    d = state.digest()
    assert d == ReplicaState.initial(preset("tiny")).digest()
    assert len(state.digest_hex()) == 16
    params = {k: v.copy() for k, v in state.params.items()}
    params["head"][3, 4] ^= 1
    assert ReplicaState(state.config, 0, params).digest() != d
    assert ReplicaState(state.config, 1, state.params).digest() != d


def test_checkpoint_round_trip(tmp_path: Path) -> None:
    state = ReplicaState.initial(preset("tiny"))
    state = ReplicaState(state.config, 17, state.params)
    path = tmp_path / "s.ckpt"
    save_checkpoint(path, state)
    loaded = load_checkpoint(path)
    assert loaded.step == 17 and loaded.config == state.config
    assert loaded.digest() == state.digest()
    assert all(np.array_equal(loaded.params[k], v) for k, v in state.params.items())
    assert not list(tmp_path.glob(".*tmp*"))  # the temporary file was renamed


def test_corrupt_checkpoints_are_rejected(tmp_path: Path) -> None:
    blob = bytearray(encode_checkpoint(ReplicaState.initial(preset("tiny"))))
    with pytest.raises(CheckpointError, match="bad magic"):
        decode_checkpoint(b"NOTACKPT" + bytes(blob[8:]))
    flipped = bytearray(blob)
    flipped[len(flipped) // 2] ^= 0x40
    with pytest.raises(CheckpointError, match="CRC"):
        decode_checkpoint(bytes(flipped))
    with pytest.raises(CheckpointError):
        decode_checkpoint(bytes(blob[:-100]))
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "missing.ckpt")


def test_checkpoint_bytes_is_the_exact_size() -> None:
    for name in ("tiny", "egg-paper"):
        state = ReplicaState.initial(preset(name))
        assert checkpoint_bytes(state.config) == len(encode_checkpoint(state))
