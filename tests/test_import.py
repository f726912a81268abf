"""`eggroll-data import`: a d-eggs data directory, written by hand from its documented layout."""

from __future__ import annotations

import json
import random
import struct
from array import array
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner, Result

from eggroll_dist.shared.data import (
    DECODING_FILE,
    INPUT_FILE,
    META_FILE,
    VALID_FILE,
    load_data_dir,
    text_bytes,
)
from eggroll_dist.worker.data.cli import main
from eggroll_dist.worker.data.import_deggs import import_cut
from eggroll_dist.worker.train import main as train_main

VOCAB = 300


def _pieces() -> list[bytes]:
    """A small vocabulary: id 0 the separator, then bytes, then a few multi-byte tokens."""
    return [b"\x00", *(bytes([b]) for b in range(1, 256)), *(f"w{i} ".encode() for i in range(44))]


def _write_deggs(root: Path, ids: list[int], pieces: list[bytes]) -> None:
    """The d-eggs layout: input.bin as `array('I').tofile` writes it (little-endian uint32 on
    x86), decoding.bin as u32 count, then u32 length + bytes per token."""
    root.mkdir(parents=True, exist_ok=True)
    tokens = array("I", ids)
    if tokens.itemsize != 4 or struct.pack("=I", 1) != struct.pack("<I", 1):
        pytest.skip("the d-eggs layout is written here on a little-endian host")
    with open(root / INPUT_FILE, "wb") as f:
        tokens.tofile(f)
    blob = struct.pack("<I", len(pieces))
    for piece in pieces:
        blob += struct.pack("<I", len(piece)) + piece
    (root / DECODING_FILE).write_bytes(blob)


def _documents(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    ids: list[int] = []
    for _ in range(count):
        ids.append(0)
        ids.extend(
            rng.choice([*range(97, 123), *range(256, VOCAB)]) for _ in range(rng.randint(20, 200))
        )
    return ids


def _import(args: list[str]) -> Result:
    return CliRunner().invoke(main, ["import", *args])


def test_import_deggs_directory_in_place(tmp_path: Path) -> None:
    ids = _documents(0, 200)
    root = tmp_path / "deggs"
    _write_deggs(root, ids, _pieces())
    result = _import([str(root)])
    assert result.exit_code == 0, result.output
    assert "bits/byte" in result.stdout
    data = load_data_dir(root)
    meta = data.meta
    assert meta.vocab_size == VOCAB and data.decoding == _pieces()
    # Nothing lost or reordered; valid.bin is the tail, starting a document.
    assert data.train.tolist() + data.valid.tolist() == ids
    assert data.valid[0] == 0
    assert 0.03 < meta.valid_tokens / len(ids) < 0.07
    assert meta.documents == 200
    assert meta.valid_documents == int((data.valid == 0).sum())
    assert meta.valid_bytes == text_bytes(data.valid, data.decoding)
    # Ids drawn uniformly from 70 of the 300: the unigram baseline finds about log2(70).
    assert abs(meta.baselines["unigram"] - np.log2(70)) < 0.2
    assert set(meta.baselines_per_byte) == {"unigram", "bigram", "gzip9"}
    # A second import would cut input.bin again: refused.
    result = _import([str(root)])
    assert result.exit_code == 1 and "imported before" in result.output


def test_import_into_another_directory_leaves_the_source(tmp_path: Path) -> None:
    ids = _documents(1, 50)
    src, out = tmp_path / "deggs", tmp_path / "data"
    _write_deggs(src, ids, _pieces())
    before = (src / INPUT_FILE).read_bytes()
    result = _import([str(src), "--out", str(out), "--valid-fraction", "0.2"])
    assert result.exit_code == 0, result.output
    assert (src / INPUT_FILE).read_bytes() == before
    assert not (src / VALID_FILE).exists() and not (src / META_FILE).exists()
    data = load_data_dir(out)
    assert data.train.tolist() + data.valid.tolist() == ids
    assert 0.1 < data.meta.valid_tokens / len(ids) < 0.3


def test_import_refuses_an_id_outside_the_vocabulary(tmp_path: Path) -> None:
    ids = _documents(2, 30)
    ids[777] = VOCAB + 5
    ids[900] = VOCAB
    root = tmp_path / "deggs"
    _write_deggs(root, ids, _pieces())
    result = _import([str(root)])
    assert result.exit_code == 1
    lines = result.output.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error:")
    assert f"token 777 (byte offset {777 * 4:,}) is id {VOCAB + 5}" in lines[0]
    assert f"vocabulary size {VOCAB}" in lines[0]
    assert not (root / VALID_FILE).exists() and not (root / META_FILE).exists()


def test_import_refuses_broken_directories(tmp_path: Path) -> None:
    root = tmp_path / "deggs"
    root.mkdir()
    result = _import([str(root)])
    assert result.exit_code == 1 and "has no input.bin" in result.output
    _write_deggs(root, _documents(3, 5), _pieces())
    with open(root / INPUT_FILE, "ab") as f:
        f.write(b"\x01")  # not a whole number of uint32 ids
    result = _import([str(root)])
    assert result.exit_code == 1 and "not a non-zero multiple of 4" in result.output


def test_byte_vocabulary_import_reads_uint8(tmp_path: Path) -> None:
    text = b"".join(b"\x00" + f"document {i} ".encode() * 30 for i in range(40))
    root = tmp_path / "deggs"
    root.mkdir()
    (root / INPUT_FILE).write_bytes(text)
    _write_deggs_decoding = struct.pack("<I", 256) + b"".join(
        struct.pack("<I", 1) + bytes([b]) for b in range(256)
    )
    (root / DECODING_FILE).write_bytes(_write_deggs_decoding)
    result = _import([str(root)])
    assert result.exit_code == 0, result.output
    meta = load_data_dir(root).meta
    assert meta.vocab_size == 256 and meta.documents == 40
    assert meta.valid_bytes == meta.valid_tokens
    assert meta.baselines_per_byte == meta.baselines


def test_cut_without_separators_is_by_fraction() -> None:
    tokens = np.arange(1, 1001, dtype=np.uint32)
    assert import_cut(tokens, 0.05) == 950
    assert import_cut(tokens[:2], 0.05) == 1
    with_docs = tokens.copy()
    with_docs[[0, 400, 930, 990]] = 0
    assert import_cut(with_docs, 0.05) == 930  # the document start nearest to 950
    with_docs[[400, 930, 990]] = 5
    assert import_cut(with_docs, 0.05) == 950  # one document: cut by fraction


def test_an_imported_deggs_directory_trains_the_former(tmp_path: Path) -> None:
    """The whole path a d-eggs user takes: their files in, `eggroll-train` with the former."""
    root = tmp_path / "deggs"
    _write_deggs(root, _documents(1, 300), _pieces())
    assert _import([str(root)]).exit_code == 0
    config = tmp_path / "former.toml"
    config.write_text(
        f"[model]\narch = 'former'\nvocab_size = {VOCAB}\nd_model = 16\nn_layer = 1\n"
        "[es]\npopulation = 16\nchunk_size = 8\nseq_len = 8\n"
        "[validation]\nmax_tokens = 256\n"
    )
    summary = tmp_path / "summary.json"
    result = CliRunner().invoke(
        train_main,
        [
            "--data-dir",
            str(root),
            "--config",
            str(config),
            "--steps",
            "3",
            "--summary-json",
            str(summary),
            "--sample-every",
            "0",
        ],
    )
    assert result.exit_code == 0, result.output
    s = json.loads(summary.read_text())
    assert s["steps"] == 3 and 0 < s["valid_bits_per_token"] < 2 * np.log2(VOCAB)
