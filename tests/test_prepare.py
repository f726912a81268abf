"""`eggroll-data`: documents, the deterministic split, the built-in corpus and the CLI."""

from __future__ import annotations

import gzip
import json
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner, Result

from eggroll_dist.shared.data import (
    DECODING_FILE,
    INPUT_FILE,
    META_FILE,
    VALID_FILE,
    DataError,
    byte_pieces,
    load_data_dir,
)
from eggroll_dist.worker.data import documents
from eggroll_dist.worker.data.build import goes_to_valid, split_documents
from eggroll_dist.worker.data.builtin import stdlib_modules
from eggroll_dist.worker.data.cli import main
from eggroll_dist.worker.data.documents import (
    DOC_TARGET_BYTES,
    SPLIT_ABOVE_BYTES,
    file_documents,
    split_text,
)

# --- documents -----------------------------------------------------------------------


def _paragraphs(n: int, size: int = 1000) -> list[str]:
    return [f"paragraph {i} " + "word " * (size // 5) for i in range(n)]


def test_small_text_is_one_document() -> None:
    text = "a\n\nb\n\n" * 100
    assert split_text(text) == [text]


def test_large_text_splits_on_blank_lines_into_16k_documents() -> None:
    paras = _paragraphs(200)
    docs = split_text("\n\n".join(paras))
    assert len(docs) > 4
    sizes = [len(d.encode()) for d in docs]
    assert all(s >= DOC_TARGET_BYTES - 2 for s in sizes[:-1])
    assert all(s <= DOC_TARGET_BYTES + 1100 for s in sizes)
    # Nothing is lost or reordered: the paragraphs come back in order.
    assert [p for d in docs for p in d.split("\n\n")] == paras


def test_huge_paragraph_falls_back_to_lines_then_characters() -> None:
    lines = "\n".join(f"line {i} " + "x" * 100 for i in range(2000))  # ~220 KiB, no blank line
    docs = split_text("intro\n\n" + lines)
    assert len(docs) > 4
    assert all(len(d.encode()) <= SPLIT_ABOVE_BYTES for d in docs)
    one_line = "y" * (3 * SPLIT_ABOVE_BYTES)
    pieces = split_text(one_line)
    assert "".join(pieces) == one_line
    assert all(len(p) == DOC_TARGET_BYTES for p in pieces)


def test_file_documents_cleans_text(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes(b"\xef\xbb\xbfhe\x00llo\r\nworld \xe2\x82\xac")
    assert file_documents(tmp_path / "a.txt") == ["hello\nworld €".encode()]
    (tmp_path / "blank.txt").write_text(" \n\n ")
    assert file_documents(tmp_path / "blank.txt") == []


def test_file_documents_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        file_documents(tmp_path / "missing.txt")
    with pytest.raises(DataError, match="is a directory"):
        file_documents(tmp_path)
    (tmp_path / "latin.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(DataError, match="not UTF-8"):
        file_documents(tmp_path / "latin.txt")


# --- split ---------------------------------------------------------------------------


def test_split_is_a_pure_function_of_the_text() -> None:
    docs = [f"document number {i}".encode() for i in range(5000)]
    valid = [d for d in docs if goes_to_valid(d, 0.05)]
    assert valid == [d for d in docs if goes_to_valid(d, 0.05)]
    assert 0.03 < len(valid) / len(docs) < 0.07
    assert len([d for d in docs if goes_to_valid(d, 0.5)]) > 2000


def test_split_keeps_order_and_both_sides_non_empty() -> None:
    docs = [f"doc {i}".encode() for i in range(200)]
    train, valid = split_documents(docs, 0.1)
    assert train and valid and len(train) + len(valid) == 200
    assert train == [d for d in docs if d in train] and valid == [d for d in docs if d in valid]
    train, valid = split_documents(docs[:2], 0.0001)  # nothing hashes into valid
    assert train == [docs[0]] and valid == [docs[1]]
    train, valid = split_documents(docs[:2], 0.9999)  # everything hashes into valid
    assert train == [docs[0]] and valid == [docs[1]]
    with pytest.raises(DataError, match="at least 2"):
        split_documents(docs[:1])


# --- CLI with synthetic text ---------------------------------------------------------


def _write_corpus(root: Path) -> list[Path]:
    root.mkdir(parents=True, exist_ok=True)
    files = []
    for i in range(30):
        path = root / f"f{i:02d}.txt"
        path.write_text(f"file {i}: " + "the cat sat on the mat. " * (20 + i))
        files.append(path)
    return files


def _prepare(args: list[str]) -> Result:
    return CliRunner().invoke(main, ["prepare", *args])


def test_prepare_files_writes_a_loadable_directory(tmp_path: Path) -> None:
    files = _write_corpus(tmp_path / "text")
    out = tmp_path / "data"
    result = _prepare([*map(str, files), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert f"wrote {out}" in result.stdout
    data = load_data_dir(out)
    meta = data.meta
    assert meta.vocab_size == 256 and meta.documents == 30
    assert 1 <= meta.valid_documents < 30
    assert meta.source == ", ".join(p.name for p in files)
    assert data.decoding == byte_pieces()
    # Every document is byte 0 followed by its text.
    stream = np.concatenate([data.train, data.valid])
    assert int((stream == 0).sum()) == 30
    texts = {p.read_bytes() for p in files}
    for tokens in (data.train, data.valid):
        assert tokens[0] == 0
        docs = bytes(tokens).split(b"\x00")[1:]
        assert all(d in texts for d in docs)
    b = meta.baselines
    assert 0 < b["bigram"] < b["unigram"] and b["gzip9"] > 0


def test_prepare_is_deterministic(tmp_path: Path) -> None:
    files = [str(p) for p in _write_corpus(tmp_path / "text")]
    outs = [tmp_path / "a", tmp_path / "b"]
    for out in outs:
        assert _prepare([*files, "--out", str(out)]).exit_code == 0
    for name in (INPUT_FILE, VALID_FILE, DECODING_FILE, META_FILE):
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes()
    assert load_data_dir(outs[0]).digest == load_data_dir(outs[1]).digest


def test_prepare_replaces_an_existing_directory(tmp_path: Path) -> None:
    files = [str(p) for p in _write_corpus(tmp_path / "text")]
    out = tmp_path / "data"
    assert _prepare([*files, "--out", str(out)]).exit_code == 0
    assert _prepare([*files[:10], "--out", str(out)]).exit_code == 0
    assert load_data_dir(out).meta.documents == 10
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [INPUT_FILE, VALID_FILE, DECODING_FILE, META_FILE]
    )


def _assert_one_line_error(result: Result, text: str, code: int) -> None:
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and text in errors[0], result.output


def test_prepare_usage_errors_are_one_line(tmp_path: Path) -> None:
    out = str(tmp_path / "data")
    result = _prepare(["--out", out])
    _assert_one_line_error(result, "give text files, or --builtin", 2)
    assert result.output.count("\n") == 1
    (tmp_path / "a.txt").write_text("x")
    result = _prepare([str(tmp_path / "a.txt"), "--builtin", "--out", out])
    _assert_one_line_error(result, "not both", 2)
    assert result.output.count("\n") == 1


def test_prepare_input_errors_are_one_line(tmp_path: Path) -> None:
    out = tmp_path / "data"
    missing = tmp_path / "missing.txt"
    _assert_one_line_error(_prepare([str(missing), "--out", str(out)]), str(missing), 1)
    (tmp_path / "empty.txt").write_text("")
    _assert_one_line_error(
        _prepare([str(tmp_path / "empty.txt"), "--out", str(out)]), "no text found", 1
    )
    (tmp_path / "one.txt").write_text("just one short document")
    _assert_one_line_error(
        _prepare([str(tmp_path / "one.txt"), "--out", str(out)]), "at least 2", 1
    )
    (tmp_path / "latin.txt").write_bytes("café".encode("latin-1"))
    _assert_one_line_error(
        _prepare([str(tmp_path / "latin.txt"), "--out", str(out)]), "not UTF-8", 1
    )
    assert not out.exists()  # nothing half-built


def _eggroll_data() -> str | None:
    beside = Path(sys.executable).parent / "eggroll-data"
    return str(beside) if beside.exists() else shutil.which("eggroll-data")


def test_real_process_missing_file_exits_with_one_line(tmp_path: Path) -> None:
    exe = _eggroll_data()
    if exe is None:
        pytest.skip("the eggroll-data entry point is not installed")
    missing = tmp_path / "missing.txt"
    proc = subprocess.run(
        [exe, "prepare", str(missing), "--out", str(tmp_path / "data")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr == f"Error: input file {missing} does not exist\n"


def test_info_prints_meta_and_errors_in_one_line(tmp_path: Path) -> None:
    files = [str(p) for p in _write_corpus(tmp_path / "text")]
    out = tmp_path / "data"
    assert _prepare([*files, "--out", str(out)]).exit_code == 0
    result = CliRunner().invoke(main, ["info", str(out)])
    assert result.exit_code == 0, result.output
    meta = load_data_dir(out).meta
    assert f"{meta.sha256} (verified)" in result.output
    assert "bigram bits/token" in result.output
    result = CliRunner().invoke(main, ["info", str(tmp_path / "nope")])
    _assert_one_line_error(result, "eggroll-data prepare --builtin", 1)
    (out / INPUT_FILE).write_bytes(b"\x01" * meta.train_tokens)
    _assert_one_line_error(CliRunner().invoke(main, ["info", str(out)]), "sha256", 1)


# --- JSON lines ----------------------------------------------------------------------


def _documents() -> list[str]:
    docs = [
        f"doc {i}: caf\u00e9 \u20ac\r\n" + "the cat sat on the mat. " * (20 + i) for i in range(30)
    ]
    docs.append("\n\n".join(_paragraphs(100)))  # over 64 KiB: cut like a text file
    docs.append("  \n ")  # whitespace only: dropped like an empty text file
    return docs


def _write_jsonl(path: Path, lines: list[str]) -> Path:
    data = ("\n".join(lines) + "\n").encode()
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return path


@pytest.mark.parametrize("tokenizer", [[], ["--tokenizer", "bpe", "--vocab-size", "300"]])
def test_jsonl_gives_the_documents_of_text_files(tmp_path: Path, tokenizer: list[str]) -> None:
    docs = _documents()
    txt = []
    for i, doc in enumerate(docs):
        txt.append(tmp_path / f"d{i:02d}.txt")
        txt[-1].write_bytes(doc.encode())
    lines = [json.dumps({"id": i, "text": doc}) for i, doc in enumerate(docs)]
    lines.insert(5, "   ")  # a blank line is skipped
    jsonl = _write_jsonl(tmp_path / "c.jsonl", lines)
    gz = _write_jsonl(tmp_path / "c.jsonl.gz", lines)
    digests = []
    for name, inputs in (("txt", txt), ("jsonl", [jsonl]), ("gz", [gz])):
        out = tmp_path / name
        result = _prepare([*map(str, inputs), *tokenizer, "--out", str(out)])
        assert result.exit_code == 0, result.output
        digests.append(load_data_dir(out).digest)
    assert digests[0] == digests[1] == digests[2]
    if not tokenizer:  # the bytes are the text, not its JSON
        assert (tmp_path / "jsonl" / INPUT_FILE).read_bytes()[1:4] == b"doc"


@pytest.mark.parametrize(
    ("line", "why"),
    [
        ('{"text": "a" "b"}', "not valid JSON"),
        ('["a list"]', "not a JSON object"),
        ('{"body": "no text"}', 'no "text" field'),
        ('{"text": 3}', 'the "text" field is int, not text'),
        ('{"text": "\\ud800"}', "the text holds an unpaired surrogate"),
    ],
)
def test_jsonl_bad_line_is_one_line_error_naming_file_and_line(
    tmp_path: Path, line: str, why: str
) -> None:
    for name in ("c.jsonl", "c.jsonl.gz"):
        path = _write_jsonl(tmp_path / name, ['{"text": "one"}', "", line, '{"text": "two"}'])
        for tokenizer in ([], ["--tokenizer", "bpe"]):
            result = _prepare([str(path), *tokenizer, "--out", str(tmp_path / "data")])
            _assert_one_line_error(result, f"{path}:3: {why}", 1)
    assert not (tmp_path / "data" / META_FILE).exists()


def test_a_jsonl_line_past_the_bound_is_refused_unread(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(documents, "MAX_JSONL_LINE_BYTES", 1 << 20)
    path = _write_jsonl(tmp_path / "c.jsonl", ['{"text": "one"}', "{" + " " * (1 << 20) + "}"])
    with pytest.raises(DataError, match=rf"{path}:2: a line over 1 MiB"):
        list(documents.jsonl_documents(path))


def test_truncated_gzip_is_one_line_error(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"text": "one"}\n' * 100)[:-10])
    result = _prepare([str(path), "--out", str(tmp_path / "data")])
    _assert_one_line_error(result, f"input file {path} is not a whole gzip file", 1)


def test_text_field_picks_the_field(tmp_path: Path) -> None:
    lines = [json.dumps({"text": i, "body": f"body {i} " * 50}) for i in range(20)]
    path = _write_jsonl(tmp_path / "c.jsonl", lines)
    out = tmp_path / "data"
    result = _prepare([str(path), "--text-field", "body", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert load_data_dir(out).meta.documents == 20
    assert (out / INPUT_FILE).read_bytes()[:6] == b"\x00body "
    # The variable sets it as well.
    result = CliRunner().invoke(
        main,
        ["prepare", str(path), "--out", str(tmp_path / "env")],
        env={"EGGROLL_TEXT_FIELD": "body"},
    )
    assert result.exit_code == 0, result.output
    assert load_data_dir(tmp_path / "env").digest == load_data_dir(out).digest


# --- the built-in corpus -------------------------------------------------------------


def test_stdlib_walk_skips_tests_and_is_sorted() -> None:
    modules = [name for _, name in stdlib_modules()]
    assert "json.decoder" in modules and "ast" in modules
    parts = [set(name.split(".")) for name in modules]
    assert not any(p & {"test", "tests", "idle_test", "site-packages"} for p in parts)
    assert modules == [name for _, name in stdlib_modules()]


@pytest.fixture(scope="module")
def builtin_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Result]:
    out = tmp_path_factory.mktemp("builtin") / "data"
    result = CliRunner().invoke(main, ["prepare", "--builtin", "--out", str(out)])
    return out, result


def test_builtin_corpus(builtin_dir: tuple[Path, Result]) -> None:
    out, result = builtin_dir
    assert result.exit_code == 0, result.output
    data = load_data_dir(out)
    meta = data.meta
    assert meta.train_tokens > 1_000_000 and meta.valid_tokens > 0
    assert meta.source == f"builtin:python-{platform.python_version()}-docs"
    b = meta.baselines
    assert 0 < b["gzip9"] and b["bigram"] < b["unigram"] < 8
    assert "gathered" in result.stderr and "baselines on valid" in result.stderr
    assert result.stdout.count("\n") == 1  # the one-line summary
    # Byte 0 only ever separates documents: the text has no NULs.
    assert int((data.train == 0).sum()) + int((data.valid == 0).sum()) == meta.documents


def test_an_out_that_cannot_be_written_is_refused_before_the_work(tmp_path: Path) -> None:
    """A read-only or impossible --out is one line at once, not after the corpus is read."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    result = CliRunner().invoke(main, ["prepare", "--builtin", "--out", str(blocker / "d")])
    assert result.exit_code == 1
    assert f"cannot write {blocker / 'd'}" in result.output, result.output
    assert "gathering" not in result.output and "Traceback" not in result.output
