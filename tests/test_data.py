"""Data-file formats, the data directory loader and the held-out baselines."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eggroll_dist.shared.data import (
    DECODING_FILE,
    FORMAT_VERSION,
    INPUT_FILE,
    META_FILE,
    VALID_FILE,
    DataError,
    DataMeta,
    byte_pieces,
    concat_documents,
    data_digest,
    load_data_dir,
    read_decoding,
    read_meta,
    read_tokens,
    token_dtype,
    tokens_digest,
    write_decoding,
    write_meta,
    write_tokens,
)
from eggroll_dist.worker.data.baselines import (
    BIGRAM_LAMBDAS,
    baselines,
    bigram_bits,
    choose_bigram_lambda,
    gzip_bits,
    unigram_bits,
)

# --- token files ---------------------------------------------------------------------


def test_token_dtype_follows_d_eggs() -> None:
    assert token_dtype(256) == np.uint8
    for vocab in (8192, 255, 257, 2):
        assert token_dtype(vocab) == np.dtype("<u4")
    with pytest.raises(DataError):
        token_dtype(0)


def test_byte_tokens_round_trip(tmp_path: Path) -> None:
    tokens = np.arange(1000) % 256
    write_tokens(tmp_path / "t.bin", tokens, 256)
    assert (tmp_path / "t.bin").read_bytes() == bytes(tokens.astype(np.uint8))
    back = read_tokens(tmp_path / "t.bin", 256)
    assert back.dtype == np.uint8
    np.testing.assert_array_equal(back, tokens)


def test_uint32_tokens_round_trip_little_endian(tmp_path: Path) -> None:
    write_tokens(tmp_path / "t.bin", [1, 258, 8191], 8192)
    assert (tmp_path / "t.bin").read_bytes() == b"\x01\0\0\0\x02\x01\0\0\xff\x1f\0\0"
    back = read_tokens(tmp_path / "t.bin", 8192)
    assert back.dtype == np.uint32
    assert back.tolist() == [1, 258, 8191]


@settings(max_examples=30, deadline=None)
@given(
    vocab=st.sampled_from([256, 8192, 2**20]),
    data=st.data(),
)
def test_tokens_round_trip_property(tmp_path_factory, vocab: int, data) -> None:
    ids = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=200))
    path = tmp_path_factory.mktemp("tok") / "t.bin"
    write_tokens(path, ids, vocab)
    assert read_tokens(path, vocab).tolist() == ids


@pytest.mark.parametrize(
    "tokens, vocab",
    [([0, 256], 256), ([-1, 3], 256), ([8192], 8192), ([], 8192), ([[1, 2]], 8192)],
)
def test_write_rejects_bad_tokens(tmp_path: Path, tokens: list, vocab: int) -> None:
    with pytest.raises(DataError):
        write_tokens(tmp_path / "t.bin", tokens, vocab)
    assert list(tmp_path.iterdir()) == []  # nothing half-written


def test_write_rejects_float_tokens(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="integers"):
        write_tokens(tmp_path / "t.bin", np.array([1.0, 2.0]), 256)


def test_read_rejects_ids_outside_vocab(tmp_path: Path) -> None:
    write_tokens(tmp_path / "t.bin", [5, 4000], 8192)
    with pytest.raises(DataError, match="4000 >= vocab_size 1000"):
        read_tokens(tmp_path / "t.bin", 1000)


def test_read_rejects_odd_size_and_empty(tmp_path: Path) -> None:
    (tmp_path / "odd.bin").write_bytes(b"\x01\0\0\0\x02\0\0")
    with pytest.raises(DataError, match="not a multiple of 4"):
        read_tokens(tmp_path / "odd.bin", 8192)
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(DataError, match="empty"):
        read_tokens(tmp_path / "empty.bin", 256)


def test_read_missing_file_gives_hint(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"does not exist.*eggroll-data prepare"):
        read_tokens(tmp_path / "input.bin", 256)


# --- decoding.bin --------------------------------------------------------------------


def test_decoding_round_trip_multibyte_and_empty(tmp_path: Path) -> None:
    pieces = [b"", "héllo".encode(), "🥚".encode(), b" the", bytes([200]), b""]
    write_decoding(tmp_path / "d.bin", pieces)
    blob = (tmp_path / "d.bin").read_bytes()
    assert blob[:4] == (6).to_bytes(4, "little")
    assert blob[4:8] == (0).to_bytes(4, "little")
    assert blob[8:12] == (6).to_bytes(4, "little") and blob[12:18] == "héllo".encode()
    assert read_decoding(tmp_path / "d.bin") == pieces


def test_byte_pieces_round_trip(tmp_path: Path) -> None:
    pieces = byte_pieces()
    assert len(pieces) == 256 and pieces[0] == b"\0" and pieces[255] == b"\xff"
    write_decoding(tmp_path / "d.bin", pieces)
    assert (tmp_path / "d.bin").stat().st_size == 4 + 256 * 5
    assert read_decoding(tmp_path / "d.bin") == pieces


@settings(max_examples=50, deadline=None)
@given(pieces=st.lists(st.binary(max_size=20), max_size=30))
def test_decoding_round_trip_property(tmp_path_factory, pieces: list[bytes]) -> None:
    path = tmp_path_factory.mktemp("dec") / "d.bin"
    write_decoding(path, pieces)
    assert read_decoding(path) == pieces


def test_decoding_rejects_truncation_and_trailing_bytes(tmp_path: Path) -> None:
    path = tmp_path / "d.bin"
    write_decoding(path, [b"ab", b"cde"])
    blob = path.read_bytes()
    for cut in (0, 3, len(blob) - 1, 4 + 4 + 2 + 2):
        path.write_bytes(blob[:cut])
        with pytest.raises(DataError, match="truncated"):
            read_decoding(path)
    path.write_bytes(blob + b"x")
    with pytest.raises(DataError, match="after its 2 tokens"):
        read_decoding(path)


def test_decoding_missing_file(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="eggroll-data prepare"):
        read_decoding(tmp_path / DECODING_FILE)


# --- meta.json -----------------------------------------------------------------------


def _meta(**changes) -> DataMeta:
    meta = DataMeta(
        format_version=FORMAT_VERSION,
        vocab_size=256,
        train_tokens=10,
        valid_tokens=4,
        sha256="ab" * 32,
        source="unit",
        documents=3,
        valid_documents=1,
        baselines={"unigram": 7.5, "bigram": 6.25, "gzip9": 40.0},
    )
    return replace(meta, **changes)


def test_meta_round_trip(tmp_path: Path) -> None:
    write_meta(tmp_path / META_FILE, _meta())
    assert read_meta(tmp_path / META_FILE) == _meta()
    raw = json.loads((tmp_path / META_FILE).read_text())
    assert raw["baselines"] == {"unigram": 7.5, "bigram": 6.25, "gzip9": 40.0}


def test_meta_ignores_unknown_keys() -> None:
    raw = json.loads(_meta().to_json())
    raw["tokenizer"] = "bytes"
    assert DataMeta.from_json(json.dumps(raw)) == _meta()


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda r: r.pop("sha256"), "lacks sha256"),
        (lambda r: r.update(format_version=99), "format_version 99"),
        (lambda r: r.update(sha256="xyz"), "64 hex digits"),
        (lambda r: r.update(train_tokens=-1), "train_tokens"),
        (lambda r: r.update(vocab_size="256"), "vocab_size"),
        (lambda r: r.update(baselines={"unigram": "x"}), "baselines"),
    ],
)
def test_meta_rejects_bad_fields(mutate, message: str) -> None:
    raw = json.loads(_meta().to_json())
    mutate(raw)
    with pytest.raises(DataError, match=message):
        DataMeta.from_json(json.dumps(raw))


def test_meta_rejects_bad_json(tmp_path: Path) -> None:
    (tmp_path / META_FILE).write_text("{not json")
    with pytest.raises(DataError, match="not valid JSON"):
        read_meta(tmp_path / META_FILE)


# --- data directory ------------------------------------------------------------------


def _make_dir(root: Path, train, valid, vocab: int = 256) -> DataMeta:
    train = np.asarray(train)
    valid = np.asarray(valid)
    root.mkdir(parents=True, exist_ok=True)
    write_tokens(root / INPUT_FILE, train, vocab)
    write_tokens(root / VALID_FILE, valid, vocab)
    pieces = byte_pieces() if vocab == 256 else [f"<{i}>".encode() for i in range(vocab)]
    write_decoding(root / DECODING_FILE, pieces)
    meta = _meta(
        vocab_size=vocab,
        train_tokens=len(train),
        valid_tokens=len(valid),
        sha256=tokens_digest(train, valid, vocab).hex(),
    )
    write_meta(root / META_FILE, meta)
    return meta


def test_load_data_dir_bytes(tmp_path: Path) -> None:
    meta = _make_dir(tmp_path, np.arange(300) % 256, [0, 1, 2, 3])
    data = load_data_dir(tmp_path)
    assert data.meta == meta
    assert data.train.dtype == np.uint8 and len(data.train) == 300
    assert data.valid.tolist() == [0, 1, 2, 3]
    assert data.decoding == byte_pieces()
    assert data.digest == data_digest(tmp_path / INPUT_FILE, tmp_path / VALID_FILE)
    assert len(data.digest) == 32
    with pytest.raises(ValueError):
        data.train[0] = 1  # replicas must agree: arrays are read-only


def test_load_data_dir_uint32(tmp_path: Path) -> None:
    _make_dir(tmp_path, [8191, 0, 17, 4096], [5, 6], vocab=8192)
    data = load_data_dir(tmp_path)
    assert data.train.dtype == np.uint32
    assert data.train.tolist() == [8191, 0, 17, 4096]
    assert len(data.decoding) == 8192


def test_data_digest_definition(tmp_path: Path) -> None:
    _make_dir(tmp_path, [1, 2, 3], [4, 5])
    expected = hashlib.sha256(
        (3).to_bytes(8, "big") + bytes([1, 2, 3]) + (2).to_bytes(8, "big") + bytes([4, 5])
    ).digest()
    assert data_digest(tmp_path / INPUT_FILE, tmp_path / VALID_FILE) == expected
    assert load_data_dir(tmp_path).meta.sha256 == expected.hex()
    # Moving a token across the split changes the digest.
    _make_dir(tmp_path, [1, 2], [3, 4, 5])
    assert data_digest(tmp_path / INPUT_FILE, tmp_path / VALID_FILE) != expected


@pytest.mark.parametrize("name", [INPUT_FILE, VALID_FILE, DECODING_FILE, META_FILE])
def test_load_missing_file_gives_hint(tmp_path: Path, name: str) -> None:
    _make_dir(tmp_path, [1, 2, 3], [4, 5])
    (tmp_path / name).unlink()
    with pytest.raises(DataError) as err:
        load_data_dir(tmp_path)
    message = str(err.value)
    assert f"has no {name}" in message
    assert f"eggroll-data prepare --builtin --out {tmp_path}" in message


def test_load_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"does not exist.*eggroll-data prepare"):
        load_data_dir(tmp_path / "nope")


def test_load_detects_size_mismatch(tmp_path: Path) -> None:
    _make_dir(tmp_path, [1, 2, 3], [4, 5])
    (tmp_path / VALID_FILE).write_bytes(bytes([4, 5, 6]))
    with pytest.raises(DataError, match=r"3 bytes but meta\.json says 2 tokens"):
        load_data_dir(tmp_path, verify=False)


def test_load_detects_digest_mismatch(tmp_path: Path) -> None:
    _make_dir(tmp_path, [1, 2, 3], [4, 5])
    (tmp_path / INPUT_FILE).write_bytes(bytes([1, 2, 9]))  # same size, other bytes
    with pytest.raises(DataError, match="sha256"):
        load_data_dir(tmp_path)
    data = load_data_dir(tmp_path, verify=False)  # the caller asked not to hash
    assert data.train.tolist() == [1, 2, 9]


def test_load_detects_decoding_size_mismatch(tmp_path: Path) -> None:
    _make_dir(tmp_path, [1, 2, 3], [4, 5])
    write_decoding(tmp_path / DECODING_FILE, [b"a", b"b"])
    with pytest.raises(DataError, match="has 2 tokens but vocab_size is 256"):
        load_data_dir(tmp_path)


def test_atomic_write_leaves_no_temp_files(tmp_path: Path) -> None:
    _make_dir(tmp_path, [1, 2, 3], [4, 5])
    _make_dir(tmp_path, [1, 2, 3, 4], [4, 5])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [INPUT_FILE, VALID_FILE, DECODING_FILE, META_FILE]
    )


# --- baselines -----------------------------------------------------------------------


def _entropy_bits(p: np.ndarray) -> float:
    p = p[p > 0]
    return float(-(p * np.log2(p)).sum())


def test_unigram_matches_entropy_of_iid_source() -> None:
    rng = np.random.default_rng(1234)
    p = rng.dirichlet(np.full(256, 0.3))
    train = rng.choice(256, size=200_000, p=p)
    valid = rng.choice(256, size=200_000, p=p)
    bits = unigram_bits(train, valid, 256)
    assert abs(bits - _entropy_bits(p)) < 0.02


def _markov_text(n: int, seed: int) -> np.ndarray:
    # Each symbol strongly predicts the next: a bigram model should beat the unigram.
    rng = np.random.default_rng(seed)
    nxt = rng.integers(0, 256, size=(256, 3))
    out = np.empty(n, dtype=np.int64)
    out[0] = 0
    choices = rng.integers(0, 3, size=n)
    for i in range(1, n):
        out[i] = nxt[out[i - 1], choices[i]]
    return out


def test_bigram_beats_unigram_on_structured_data() -> None:
    stream = _markov_text(55_000, 1)
    train, valid = stream[:50_000], stream[50_000:]
    uni = unigram_bits(train, valid, 256)
    bi = bigram_bits(train, valid, 256)
    assert bi < uni - 1.0
    assert bi > math.log2(3) - 0.2  # cannot beat the chain's own entropy by much


def _bigram_reference(train, valid, vocab: int, lam: float) -> float:
    train, valid = list(map(int, train)), list(map(int, valid))
    uni = [(train.count(v) + 1) / (len(train) + vocab) for v in range(vocab)]
    pairs: dict[tuple[int, int], int] = {}
    ctx: dict[int, int] = {}
    for a, b in itertools.pairwise(train):
        pairs[a, b] = pairs.get((a, b), 0) + 1
        ctx[a] = ctx.get(a, 0) + 1
    total = -math.log2(uni[valid[0]])
    for a, b in itertools.pairwise(valid):
        if a in ctx:
            p = lam * pairs.get((a, b), 0) / ctx[a] + (1 - lam) * uni[b]
        else:
            p = uni[b]
        total -= math.log2(p)
    return total / len(valid)


@pytest.mark.parametrize("vocab", [256, 8192])
def test_bigram_matches_reference_formula(vocab: int) -> None:
    rng = np.random.default_rng(7)
    train = rng.integers(0, 40, size=500) * (vocab // 256)
    valid = np.concatenate([rng.integers(0, 60, size=100) * (vocab // 256), [vocab - 1]])
    got = bigram_bits(train, valid, vocab, lam=0.8)
    assert got == pytest.approx(_bigram_reference(train, valid, vocab, 0.8), rel=1e-12)
    assert math.isfinite(bigram_bits(train, valid, vocab))


def test_bigram_lambda_is_from_the_grid() -> None:
    lam = choose_bigram_lambda(_markov_text(20_000, 3), 256)
    assert lam in BIGRAM_LAMBDAS
    assert lam >= 0.9  # a strong chain needs little unigram backoff
    assert choose_bigram_lambda(np.array([1]), 256) == 0.9


def test_gzip_bits_and_baselines() -> None:
    text = b"the quick brown fox jumps over the lazy dog. " * 50
    train = concat_documents([text, text[::-1]])
    valid = concat_documents([text])
    g = gzip_bits(valid, 256)
    assert 0 < g < 8
    b = baselines(train, valid, 256)
    assert set(b) == {"unigram", "bigram", "gzip9"}
    assert b["bigram"] < b["unigram"] and b["gzip9"] == g


def test_concat_documents_marks_each_start_with_zero() -> None:
    tokens = concat_documents([b"ab", b"", b"c"])
    assert tokens.tolist() == [0, 97, 98, 0, 0, 99]
    assert tokens.dtype == np.uint8
