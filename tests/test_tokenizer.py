"""Tokenized data directories: byte-level BPE, reused tokenizers, block-wise reading and
bits per byte."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner, Result
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from eggroll_dist.shared.data import (
    DECODING_FILE,
    INPUT_FILE,
    META_FILE,
    TOKENIZER_FILE,
    VALID_FILE,
    DataError,
    DataMeta,
    decode_tokens,
    load_data_dir,
    text_bytes,
)
from eggroll_dist.worker.data import build as build_module
from eggroll_dist.worker.data import documents as documents_module
from eggroll_dist.worker.data.build import split_documents
from eggroll_dist.worker.data.builtin import builtin_documents
from eggroll_dist.worker.data.cli import main
from eggroll_dist.worker.data.documents import file_documents, iter_file_documents
from eggroll_dist.worker.data.tokenizer import (
    SEPARATOR,
    bytes_to_unicode,
    encode_documents,
    load_tokenizer,
    renumber,
    tokenizer_pieces,
    train_bpe,
)


def _prepare(args: list[str]) -> Result:
    return CliRunner().invoke(main, ["prepare", *args])


def _documents(tokens: np.ndarray, decoding: list[bytes]) -> list[bytes]:
    """The documents a token stream holds: its text split at the separators (byte 0)."""
    text = decode_tokens(tokens, decoding)
    assert text.startswith(b"\x00")
    return text.split(b"\x00")[1:]


# --- the byte-level alphabet and the tokenizer checks ---------------------------------


def test_byte_alphabet_is_the_libraries() -> None:
    mapping = bytes_to_unicode()
    assert sorted(mapping) == list(range(256))
    assert set(mapping.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    assert mapping[ord("a")] == "a" and mapping[ord(" ")] == "Ġ"


def test_trained_vocabulary_reserves_id_0_and_round_trips() -> None:
    docs = [f"doc {i}: the cat sat on the mat, {SEPARATOR} é€ \t\n".encode() for i in range(50)]
    tok = train_bpe((d.decode() for d in docs), 300)
    pieces = tokenizer_pieces(tok)
    assert len(pieces) == 300 and pieces[0] == b"\x00"
    assert sorted(pieces[1:257]) == [bytes([b]) for b in range(256)]
    for doc, ids in zip(docs, encode_documents(tok, docs, pieces), strict=True):
        # The separator's text inside a document is ordinary text, never id 0.
        assert 0 not in ids
        assert b"".join(pieces[i] for i in ids) == doc


def test_small_vocab_size_is_refused() -> None:
    with pytest.raises(DataError, match="at least 257"):
        train_bpe(iter(["x"]), 256)


def test_foreign_tokenizers_are_checked(tmp_path: Path) -> None:
    plain = Tokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[]))
    plain.save(str(tmp_path / "plain.json"))
    with pytest.raises(DataError, match="id 0 must be a special token"):
        load_tokenizer(tmp_path / "plain.json")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(DataError, match="cannot be read"):
        load_tokenizer(tmp_path / "broken.json")
    with pytest.raises(DataError, match="does not exist"):
        load_tokenizer(tmp_path / "missing.json")


# --- reading a file in blocks gives the documents of reading it whole -----------------


_PIECES = ["a", " ", "\n", "\n\n", "\r", "\r\n", "\x00", "\ufeff", "é", "€", "x" * 40, "y" * 90]


@settings(max_examples=300, deadline=None)
@given(
    parts=st.lists(st.sampled_from(_PIECES), max_size=150),
    bom=st.booleans(),
    block=st.sampled_from([1, 2, 3, 7, 64, 1 << 20]),
)
def test_block_reading_matches_whole_file(
    tmp_path_factory: pytest.TempPathFactory, parts: list[str], bom: bool, block: int
) -> None:
    # Small thresholds exercise every level of the split (blank lines, lines, characters).
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(documents_module, "SPLIT_ABOVE_BYTES", 64)
        mp.setattr(documents_module, "DOC_TARGET_BYTES", 16)
        path = tmp_path_factory.mktemp("blocks") / "t.txt"
        path.write_bytes(("\ufeff" if bom else "").encode() + "".join(parts).encode())
        assert list(iter_file_documents(path, block)) == file_documents(path)


@pytest.mark.parametrize(
    "raw, offset",
    [(b"x" * 100_000 + b"\xc3", 100_000), ("\ufeffabé".encode() + b"\xe9", 7)],
)
def test_block_reading_reports_bad_utf8(tmp_path: Path, raw: bytes, offset: int) -> None:
    path = tmp_path / "bad.txt"
    path.write_bytes(raw)
    for block in (1, 4096):
        with pytest.raises(DataError, match=f"bad byte at offset {offset}\\)"):
            list(iter_file_documents(path, block))
    with pytest.raises(DataError, match=f"bad byte at offset {offset}\\)"):
        file_documents(path)


# --- prepare --tokenizer bpe on the built-in corpus ------------------------------------


@pytest.fixture(scope="module")
def builtin_bpe(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Result]:
    out = tmp_path_factory.mktemp("bpe") / "data"
    result = _prepare(["--builtin", "--tokenizer", "bpe", "--vocab-size", "512", "--out", str(out)])
    return out, result


def test_builtin_bpe_round_trips_every_document(builtin_bpe: tuple[Path, Result]) -> None:
    out, result = builtin_bpe
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [INPUT_FILE, VALID_FILE, DECODING_FILE, META_FILE, TOKENIZER_FILE]
    )
    data = load_data_dir(out)
    assert data.meta.vocab_size == 512 and data.train.dtype == np.uint32
    assert (out / INPUT_FILE).stat().st_size == 4 * data.meta.train_tokens
    # The same documents and split as the byte vocabulary, each decoding to its exact text.
    train_docs, valid_docs = split_documents(builtin_documents())
    assert _documents(data.train, data.decoding) == train_docs
    assert _documents(data.valid, data.decoding) == valid_docs
    assert data.meta.documents == len(train_docs) + len(valid_docs)
    assert data.meta.valid_documents == len(valid_docs)
    # BPE: fewer tokens than bytes.
    assert data.meta.train_tokens < sum(len(d) + 1 for d in train_docs) / 1.5
    assert "training a byte-level BPE of 512 tokens" in result.stderr
    assert "bits/byte" in result.stdout and result.stdout.count("\n") == 1


def test_trained_ids_are_ranked_by_train_frequency(builtin_bpe: tuple[Path, Result]) -> None:
    out, result = builtin_bpe
    data = load_data_dir(out)
    counts = np.bincount(data.train, minlength=512)
    assert data.meta.ids_by_frequency
    assert np.all(counts[2:] <= counts[1:-1]) and counts[1] > 10 * counts[300]
    # tokenizer.json is the renumbered vocabulary: it encodes a document to the ids written
    # for it, and every id's piece is the one decoding.bin holds.
    tok = load_tokenizer(out / TOKENIZER_FILE)
    assert tokenizer_pieces(tok) == data.decoding
    doc = split_documents(builtin_documents())[0][3]
    ids = encode_documents(tok, [doc], data.decoding)[0]
    start = data.train.tobytes().find(np.asarray([0, *ids], np.uint32).tobytes())
    assert start >= 0 and start % 4 == 0
    assert "numbered the tokens by their frequency" in result.stderr


def test_renumbering_keeps_the_pieces() -> None:
    tok = train_bpe(["the cat and the hat and the bat"] * 20, 270)
    size = tok.get_vocab_size(with_added_tokens=True)
    order = [0, *range(size - 1, 0, -1)]
    again = renumber(tok, order)
    old, new = tokenizer_pieces(tok), tokenizer_pieces(again)
    assert new == [old[i] for i in order]
    text = "the hat and the cat"
    assert [new[i] for i in again.encode(text).ids] == [old[i] for i in tok.encode(text).ids]
    assert again.token_to_id(SEPARATOR) == 0


def test_renumbering_in_small_blocks_gives_the_same_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = [str(p) for p in _write_corpus(tmp_path / "text")]
    whole, blocks = tmp_path / "whole", tmp_path / "blocks"
    args = ["--tokenizer", "bpe", "--vocab-size", "300", "--out"]
    assert _prepare([*files, *args, str(whole)]).exit_code == 0
    monkeypatch.setattr(build_module, "RANK_BLOCK_IDS", 1000)
    assert _prepare([*files, *args, str(blocks)]).exit_code == 0
    for name in (INPUT_FILE, VALID_FILE, DECODING_FILE, META_FILE, TOKENIZER_FILE):
        assert (whole / name).read_bytes() == (blocks / name).read_bytes(), name
    data = load_data_dir(blocks)
    assert data.meta.ids_by_frequency and len(data.train) > 3000
    docs = [d for p in files for d in file_documents(p)]
    assert sorted(
        _documents(data.train, data.decoding) + _documents(data.valid, data.decoding)
    ) == sorted(docs)


def test_byte_data_is_not_ranked(tmp_path: Path) -> None:
    files = [str(p) for p in _write_corpus(tmp_path / "text")]
    assert _prepare([*files, "--out", str(tmp_path / "bytes")]).exit_code == 0
    assert not load_data_dir(tmp_path / "bytes").meta.ids_by_frequency


def test_bits_per_byte_are_consistent(builtin_bpe: tuple[Path, Result], tmp_path: Path) -> None:
    out, _ = builtin_bpe
    bpe = load_data_dir(out).meta
    data = load_data_dir(out)
    assert bpe.valid_bytes == text_bytes(data.valid, data.decoding)
    assert set(bpe.baselines_per_byte) == {"unigram", "bigram", "gzip9"}
    for name in ("unigram", "bigram", "gzip9"):
        total = bpe.baselines[name] * bpe.valid_tokens
        assert bpe.baselines_per_byte[name] * bpe.valid_bytes == pytest.approx(total, rel=1e-5)
    # The byte vocabulary of the same corpus: the same valid text, both units coincide, and
    # gzip -9 of that text is the same number of bits per byte.
    byte_out = tmp_path / "bytes"
    assert _prepare(["--builtin", "--out", str(byte_out)]).exit_code == 0
    raw = load_data_dir(byte_out).meta
    assert raw.valid_bytes == raw.valid_tokens == bpe.valid_bytes
    assert raw.baselines_per_byte == raw.baselines
    assert raw.baselines_per_byte["gzip9"] == bpe.baselines_per_byte["gzip9"]
    # A BPE unigram knows more than a byte unigram.
    assert bpe.baselines_per_byte["unigram"] < raw.baselines_per_byte["unigram"]
    result = CliRunner().invoke(main, ["info", str(out)])
    assert "bigram bits/byte" in result.output and "valid bytes" in result.output


def test_old_meta_without_bits_per_byte_loads() -> None:
    raw = {
        "format_version": 1,
        "vocab_size": 256,
        "train_tokens": 10,
        "valid_tokens": 4,
        "sha256": "ab" * 32,
        "source": "old",
        "documents": 3,
        "valid_documents": 1,
        "baselines": {"unigram": 7.5},
    }
    meta = DataMeta.from_json(json.dumps(raw))
    assert meta.baselines_per_byte == {} and meta.valid_bytes == 0
    assert not meta.ids_by_frequency
    with pytest.raises(DataError, match="ids_by_frequency"):
        DataMeta.from_json(json.dumps({**raw, "ids_by_frequency": 1}))
    raw["valid_bytes"] = -1
    with pytest.raises(DataError, match="valid_bytes"):
        DataMeta.from_json(json.dumps(raw))


# --- text files, a reused tokenizer, progress -----------------------------------------


def _write_corpus(root: Path, seed: int = 0) -> list[Path]:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "naïve", "€", SEPARATOR, "the", "of", "\n", "\n\n"]
    root.mkdir(parents=True, exist_ok=True)
    files = []
    for i in range(12):
        path = root / f"f{i:02d}.txt"
        path.write_text(" ".join(rng.choice(words) for _ in range(300 + 40 * i)))
        files.append(path)
    return files


def test_reused_tokenizer_gives_identical_ids(tmp_path: Path) -> None:
    files = [str(p) for p in _write_corpus(tmp_path / "text")]
    first, second = tmp_path / "first", tmp_path / "second"
    result = _prepare([*files, "--tokenizer", "bpe", "--vocab-size", "300", "--out", str(first)])
    assert result.exit_code == 0, result.output
    tokenizer = str(first / TOKENIZER_FILE)
    result = _prepare([*files, "--tokenizer", tokenizer, "--out", str(second)])
    assert result.exit_code == 0, result.output
    for name in (INPUT_FILE, VALID_FILE, DECODING_FILE, META_FILE):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    assert load_tokenizer(second / TOKENIZER_FILE).to_str() == load_tokenizer(tokenizer).to_str()
    data = load_data_dir(second)
    docs = [d for p in files for d in file_documents(p)]
    assert sorted(
        _documents(data.train, data.decoding) + _documents(data.valid, data.decoding)
    ) == sorted(docs)
    # A byte build into the same directory leaves no stale tokenizer.json behind.
    assert _prepare([*files, "--out", str(second)]).exit_code == 0
    assert not (second / TOKENIZER_FILE).exists()


def test_tokenizer_usage_errors_are_one_line(tmp_path: Path) -> None:
    files = [str(p) for p in _write_corpus(tmp_path / "text")]
    out = str(tmp_path / "data")
    result = _prepare([*files, "--vocab-size", "300", "--out", out])
    assert result.exit_code == 2 and "add --tokenizer bpe" in result.output
    result = _prepare([*files, "--tokenizer", "bpe", "--vocab-size", "100", "--out", out])
    assert result.exit_code == 1 and "at least 257" in result.output
    result = _prepare([*files, "--tokenizer", str(tmp_path / "no.json"), "--out", out])
    assert result.exit_code == 1 and "does not exist" in result.output
    assert all(line.startswith("Error:") for line in result.output.splitlines())


def test_large_file_is_read_in_blocks_with_progress(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # ~1.5 MB in one file: two read blocks, many documents, a progress line per tenth.
    rng = random.Random(1)
    words = ["alpha", "beta", "gamma", "delta", "é", "the", "of", "and"]
    paragraphs = (
        " ".join(rng.choice(words) for _ in range(rng.randint(5, 200))) for _ in range(4500)
    )
    path = tmp_path / "big.txt"
    path.write_text("\n\n".join(paragraphs))
    assert path.stat().st_size > 1_200_000
    monkeypatch.setattr(build_module, "ENCODE_BATCH_BYTES", 256 << 10)
    out = tmp_path / "data"
    result = _prepare([str(path), "--tokenizer", "bpe", "--vocab-size", "400", "--out", str(out)])
    assert result.exit_code == 0, result.output
    # Not a terminal: a line at each tenth of each pass (encoded in 256 KiB batches), with
    # the share done, and the last line at 100%.
    for what in ("read", "encoded"):
        lines = [ln for ln in result.stderr.splitlines() if ln.startswith(f"{what} ")]
        assert len(lines) >= 8 and "/2.1 MB (1" in lines[0] and "(100%)" in lines[-1], lines
    assert "merging pairs up to 400 tokens" in result.stderr
    data = load_data_dir(out)
    docs = _documents(data.train, data.decoding) + _documents(data.valid, data.decoding)
    assert sorted(docs) == sorted(file_documents(path))
    assert data.meta.documents == len(docs) > 100


def test_tokenizer_that_changes_the_text_is_refused(tmp_path: Path) -> None:
    files = [str(p) for p in _write_corpus(tmp_path / "text")]
    tok = train_bpe(iter(["some text to train on"]), 270)
    tok.normalizer = normalizers.Lowercase()
    tok.save(str(tmp_path / "lower.json"))
    (tmp_path / "Upper.txt").write_text("Capitals ARE lost by a lowercasing tokenizer")
    out = tmp_path / "data"
    result = _prepare(
        [
            *files,
            str(tmp_path / "Upper.txt"),
            "--tokenizer",
            str(tmp_path / "lower.json"),
            "--out",
            str(out),
        ]
    )
    assert result.exit_code == 1 and "does not give back the text" in result.output
    assert list(out.iterdir()) == []  # no half-written token files left behind


def test_bpe_build_is_deterministic(tmp_path: Path) -> None:
    files = [str(p) for p in _write_corpus(tmp_path / "text", seed=5)]
    outs = [tmp_path / "a", tmp_path / "b"]
    for out in outs:
        result = _prepare([*files, "--tokenizer", "bpe", "--vocab-size", "320", "--out", str(out)])
        assert result.exit_code == 0, result.output
    for name in (INPUT_FILE, VALID_FILE, DECODING_FILE, META_FILE, TOKENIZER_FILE):
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes(), name
