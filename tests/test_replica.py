"""Replica digest and the checkpoint file format."""

from __future__ import annotations

import hashlib
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from eggroll_dist.shared.config import ESConfig, ModelConfig, RunConfig, UpdateConfig, preset
from eggroll_dist.shared.replica import (
    DIGEST_LEAF,
    FORMAT_VERSION,
    CheckpointError,
    ReplicaState,
    checkpoint_bytes,
    decode_checkpoint,
    encode_checkpoint,
    load_checkpoint,
    replay,
    save_checkpoint,
)


def test_digest_depends_on_every_weight_and_the_step() -> None:
    state = ReplicaState.initial(preset("tiny"))
    d = state.digest()
    assert d == ReplicaState.initial(preset("tiny")).digest()
    assert len(state.digest_hex()) == 16
    params = {k: v.copy() for k, v in state.params.items()}
    params["head"][3, 4] ^= 1
    assert ReplicaState(state.config, 0, params, state.opt).digest() != d
    assert ReplicaState(state.config, 1, state.params, state.opt).digest() != d


def test_checkpoint_round_trip(tmp_path: Path) -> None:
    state = ReplicaState.initial(preset("tiny"))
    state = ReplicaState(state.config, 17, state.params, state.opt)
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
    # A short file says so, not "CRC mismatch": a copy or a write was cut off.
    size = len(blob)
    with pytest.raises(CheckpointError, match=f"truncated \\({size - 100:,} of its {size:,} bytes"):
        decode_checkpoint(bytes(blob[:-100]))
    with pytest.raises(CheckpointError, match=r"truncated .* inside its config"):
        decode_checkpoint(bytes(blob[:40]))
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "missing.ckpt")


def test_checkpoint_bytes_is_the_exact_size() -> None:
    for name in ("tiny", "egg-paper", "former-tiny"):
        state = ReplicaState.initial(preset(name))
        assert checkpoint_bytes(state.config) == len(encode_checkpoint(state))


def _momentum_state(steps: int = 3) -> ReplicaState:
    cfg = RunConfig(
        model=ModelConfig(vocab_size=16, n_layer=1, d_model=8),
        es=ESConfig(population=8, chunk_size=4, seq_len=4, noise="gaussian"),
        update=UpdateConfig(rule="momentum", momentum_shift=2),
    )
    fitness = np.array([1, -1, 0, 1], dtype=np.int8)
    return replay(ReplicaState.initial(cfg), [fitness] * steps)


def test_optimizer_state_is_in_the_digest_and_the_checkpoint() -> None:
    state = _momentum_state()
    assert any(np.count_nonzero(m) for m in state.opt.values())
    blob = encode_checkpoint(state)
    assert len(blob) == checkpoint_bytes(state.config)
    loaded = decode_checkpoint(blob)
    assert loaded.digest() == state.digest()
    assert all(np.array_equal(loaded.opt[k], v) for k, v in state.opt.items())
    opt = {k: v.copy() for k, v in state.opt.items()}
    name = next(iter(opt))
    opt[name].reshape(-1)[0] += 1
    assert ReplicaState(state.config, state.step, state.params, opt).digest() != state.digest()


def test_replay_in_pieces_equals_replay_at_once() -> None:
    """Momentum state carries across replays exactly as across steps."""
    fitness = [np.array([1, -1, 0, 1], dtype=np.int8)] * 5
    whole = _momentum_state(5)
    part = replay(decode_checkpoint(encode_checkpoint(_momentum_state(2))), fitness[2:])
    assert part.digest() == whole.digest()


def test_a_format_1_checkpoint_still_loads() -> None:
    """Written by the previous release (weights only, before the config grew fields)."""
    loaded = load_checkpoint(Path(__file__).parent / "fixtures" / "checkpoint-format1.ckpt")
    assert loaded.step == 3 and loaded.opt == {}
    again = replay(ReplicaState.initial(loaded.config), [np.array([1, -1, 0, 1], np.int8)] * 3)
    assert all(np.array_equal(loaded.params[k], v) for k, v in again.params.items())
    blob = bytearray(encode_checkpoint(loaded))
    blob[8:12] = (FORMAT_VERSION + 1).to_bytes(4, "big")
    with pytest.raises(CheckpointError, match=f"format {FORMAT_VERSION + 1} cannot be read"):
        decode_checkpoint(bytes(blob))


def test_a_format_2_checkpoint_still_loads() -> None:
    """Format 2 has format 3's layout and digest 1 (the tensors' bytes hashed whole)."""
    state = _momentum_state(2)
    body = bytearray(encode_checkpoint(state)[:-12])
    body[8:12] = (2).to_bytes(4, "big")
    h = hashlib.blake2b(digest_size=8)
    for part in (b"eggroll-replica/1", state.config.digest(), struct.pack(">Q", state.step)):
        h.update(part)
    for tensor in state.tensors():
        h.update(tensor.tobytes())
    body += h.digest()
    blob = bytes(body) + struct.pack(">I", zlib.crc32(bytes(body)))
    loaded = decode_checkpoint(blob)
    assert loaded.digest() == state.digest()
    wrong = blob[:-12] + bytes(8)
    with pytest.raises(CheckpointError, match="digest mismatch"):
        decode_checkpoint(wrong + struct.pack(">I", zlib.crc32(wrong)))


def test_the_digest_is_a_tree_of_leaf_hashes() -> None:
    """BLAKE2b-64 over the BLAKE2b-256 of every 64 KiB piece of every tensor: a tensor of
    more than one leaf (the momentum state) changes the digest wherever it changes."""
    cfg = RunConfig(
        model=ModelConfig(d_model=128, vocab_size=256),
        update=UpdateConfig(rule="momentum"),
    )
    state = ReplicaState.initial(cfg)
    leaves = b"".join(
        hashlib.blake2b(t.tobytes()[lo : lo + DIGEST_LEAF], digest_size=32).digest()
        for t in state.tensors()
        for lo in range(0, max(t.nbytes, 1), DIGEST_LEAF)
    )
    want = hashlib.blake2b(
        b"eggroll-replica/2" + cfg.digest() + struct.pack(">Q", 0) + leaves, digest_size=8
    )
    assert state.digest() == int.from_bytes(want.digest(), "big")
    assert any(t.nbytes > DIGEST_LEAF for t in state.tensors())
    before = state.digest()
    big = next(name for name, t in state.opt.items() if t.nbytes > DIGEST_LEAF)
    state.opt[big].reshape(-1)[-1] += 1  # in the last leaf
    assert state.digest() != before
