"""Models by name from the local Hugging Face hub cache (worker/hub_cache.py): where the cache
is, which snapshot a name is, and `eggroll-tune ORG/NAME` on a cache laid out here as
huggingface_hub lays it out (files as links into blobs/); nothing is downloaded."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from eggroll_dist.worker.hub_cache import (
    HubCacheError,
    find_cached,
    hub_cache_dir,
    is_repo_id,
    local_or_cached,
)

REVISION = "0123456789abcdef0123456789abcdef01234567"
HF_VARS = ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME")


def lay_out(cache: Path, name: str, model: Path, revision: str = REVISION) -> Path:
    """`model`'s files as a cached snapshot of `name`: blobs/ by sha256, the snapshot's
    files relative links to them, refs/main naming the revision."""
    repo = cache / f"models--{name.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for f in sorted(model.iterdir()):
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copy(f, repo / "blobs" / digest)
        (snapshot / f.name).symlink_to(Path("..", "..", "blobs", digest))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def fake_model(path: Path) -> Path:
    """A folder with the files find_cached looks at (no weights: resolution reads none)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


def test_the_cache_dir_follows_huggingface_hubs_rules(tmp_path: Path) -> None:
    home = tmp_path / "home"
    assert hub_cache_dir({}, home) == home / ".cache/huggingface/hub"
    assert hub_cache_dir({"XDG_CACHE_HOME": "/x"}, home) == Path("/x/huggingface/hub")
    env = {"XDG_CACHE_HOME": "/x", "HF_HOME": "~/hf"}
    assert hub_cache_dir(env, home) == home / "hf/hub"
    assert hub_cache_dir({**env, "HF_HUB_CACHE": "/c"}, home) == Path("/c")  # HF_HUB_CACHE wins
    assert hub_cache_dir({**env, "HUGGINGFACE_HUB_CACHE": "/old"}, home) == Path("/old")
    assert hub_cache_dir({"HF_HUB_CACHE": "", "HF_HOME": "/h"}, home) == Path("/h/hub")


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("Qwen/Qwen2.5-0.5B-Instruct", True),
        ("org/tiny", True),
        ("model", False),
        ("./org/tiny", False),
        ("/srv/model", False),
        ("a/b/c", False),
        ("org/../x", False),
        ("org--x/y", False),
    ],
)
def test_only_org_name_is_a_hub_name(name: str, ok: bool) -> None:
    assert is_repo_id(name) is ok


def test_refs_main_chooses_the_snapshot(tmp_path: Path) -> None:
    snapshot = lay_out(tmp_path, "org/tiny", fake_model(tmp_path / "src"))
    other = snapshot.parent / ("f" * 40)
    fake_model(other)  # newer, but refs/main names the other one
    found = find_cached("org/tiny", tmp_path)
    assert (found.path, found.revision, found.ref) == (snapshot, REVISION, "main")


def test_without_refs_the_newest_snapshot(tmp_path: Path) -> None:
    snapshots = tmp_path / "models--org--tiny" / "snapshots"
    old, new = fake_model(snapshots / ("a" * 40)), fake_model(snapshots / ("b" * 40))
    os.utime(old, (time.time() + 60, time.time() + 60))
    found = find_cached("org/tiny", tmp_path)
    assert (found.path, found.revision, found.ref) == (old, "a" * 40, None)
    shutil.rmtree(old)
    assert find_cached("org/tiny", tmp_path).path == new


def test_a_broken_snapshot_is_one_line(tmp_path: Path) -> None:
    snapshot = lay_out(tmp_path, "org/tiny", fake_model(tmp_path / "src"))
    for blob in (snapshot.parent.parent / "blobs").iterdir():
        blob.unlink()  # config.json is a dangling link now
    with pytest.raises(HubCacheError, match=r"has no config\.json") as err:
        find_cached("org/tiny", tmp_path)
    assert "\n" not in str(err.value)
    (snapshot.parent.parent / "refs" / "main").write_text("f" * 40)
    with pytest.raises(HubCacheError, match=f"but snapshots/{'f' * 40} is not there"):
        find_cached("org/tiny", tmp_path)


def test_a_name_not_cached_says_where_it_looked_and_how(tmp_path: Path) -> None:
    with pytest.raises(HubCacheError) as err:
        find_cached("org/none", tmp_path / "hub")
    text = str(err.value)
    assert "\n" not in text and f"Hugging Face cache {tmp_path / 'hub'}" in text
    assert "nothing is downloaded" in text and "hf download org/none" in text


def test_a_local_directory_of_the_same_name_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in HF_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    snapshot = lay_out(tmp_path / "hf" / "hub", "org/tiny", fake_model(tmp_path / "src"))
    monkeypatch.chdir(tmp_path)
    cached = find_cached("org/tiny", tmp_path / "hf" / "hub")
    assert local_or_cached(Path("org/tiny")) == (snapshot, cached)
    fake_model(tmp_path / "org" / "tiny")
    assert local_or_cached(Path("org/tiny")) == (Path("org/tiny"), None)
    assert local_or_cached(Path("missing")) == (Path("missing"), None)  # a path, not a name


# --- eggroll-tune ORG/NAME, in real processes --------------------------------------------------


def tune(cwd: Path, *args: str | Path, **env: str) -> subprocess.CompletedProcess[str]:
    from helpers import command

    clean = {k: v for k, v in os.environ.items() if k not in HF_VARS}
    return subprocess.run(
        [command("eggroll-tune"), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env={**clean, "HF_HUB_OFFLINE": "1", **env},
    )


@pytest.fixture(scope="module")
def cached(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(HF_HOME, the snapshot) of a tiny GPT-2 cached as `org/tiny`."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from hf_models import save_model

    root = tmp_path_factory.mktemp("hfhome")
    model = save_model(root / "saved", "gpt2", initializer_range=0.3)
    snapshot = lay_out(root / "hf" / "hub", "org/tiny", model)
    shutil.rmtree(model)
    return root / "hf", snapshot


PROMPTS = "the quick\na bird\nevery good\nthe lazy\nfox\nhand\ntwo in\neggs are\nbush\n"
TINY = (
    "--reward", "builtin:letter_e", "--prompts", "prompts.txt", "--population", "8",
    "--rank", "2", "--sigma", "0.05", "--completion-tokens", "4", "--prompts-per-step", "2",
    "--valid-tokens", "64", "--validate-every", "0", "--threads", "1",
)  # fmt: skip


def test_tune_runs_a_cached_model_by_name(
    cached: tuple[Path, Path], tmp_path: Path, words_data: Path
) -> None:
    hf_home, snapshot = cached
    (tmp_path / "prompts.txt").write_text(PROMPTS)
    done = tune(
        tmp_path, "org/tiny", *TINY, "--steps", "2", "--data-dir", words_data,
        "--save-dir", "run", "--summary-json", "summary.json", HF_HOME=str(hf_home),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    found = [line for line in done.stderr.splitlines() if "Hugging Face cache" in line]
    assert len(found) == 1 and str(snapshot) in found[0] and REVISION in found[0], found
    assert (tmp_path / "summary.json").is_file()


def test_print_config_writes_the_snapshots_absolute_path(
    cached: tuple[Path, Path], tmp_path: Path
) -> None:
    hf_home, snapshot = cached
    done = tune(tmp_path, "org/tiny", *TINY, "--print-config", HF_HOME=str(hf_home))
    assert done.returncode == 0, done.stderr
    assert f'path = "{snapshot}"' in done.stdout
    assert "under their --goal-dir" in done.stderr  # workers need a copy under their goal dir
    (tmp_path / "org" / "tiny").mkdir(parents=True)  # a local directory of the name wins
    local = tune(tmp_path, "org/tiny", *TINY, "--print-config", HF_HOME=str(hf_home))
    assert local.returncode == 0 and 'path = "org/tiny"' in local.stdout, local.stderr


def test_hf_hub_cache_wins_and_a_name_not_cached_is_one_line(
    cached: tuple[Path, Path], tmp_path: Path
) -> None:
    hf_home, _ = cached
    elsewhere = tmp_path / "elsewhere"
    done = tune(
        tmp_path, "org/tiny", *TINY, "--print-config",
        HF_HOME=str(hf_home), HF_HUB_CACHE=str(elsewhere),
    )  # fmt: skip
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, lines
    assert lines[0].startswith("Error: ") and f"Hugging Face cache {elsewhere} " in lines[0]
    assert "hf download org/tiny" in lines[0]
