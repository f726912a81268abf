"""Hugging Face model names (`ORG/NAME`) found in the local hub cache; nothing is downloaded.

`eggroll-tune Qwen/Qwen2.5-0.5B-Instruct` fine-tunes the snapshot that `hf download` (or
`huggingface-cli download`) left in the hub cache, read as any model directory. The cache is
where huggingface_hub puts it (`hub_cache_dir`), laid out as it lays it out: a repo in
`models--ORG--NAME/`, `refs/main` holding the commit of `snapshots/<commit>/`, whose files
are often links into `blobs/`. huggingface_hub itself is not needed.

A name that is also a local path is that path: a local directory always wins, and a path
that is not a name (`./model`, `/srv/model`, `model`) keeps the errors of a model directory.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "CachedModel",
    "HubCacheError",
    "find_cached",
    "hub_cache_dir",
    "is_repo_id",
    "local_or_cached",
]

# huggingface_hub's repo ids with an owner: word characters, '-' and '.', no '--' or '..'
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")
_REVISION = re.compile(r"[\w.-]{1,128}")


class HubCacheError(ValueError):
    """A model name not in the cache, or a cached copy that cannot be used; one line."""


@dataclass(frozen=True)
class CachedModel:
    """A model's snapshot in the hub cache."""

    name: str  # ORG/NAME
    path: Path  # snapshots/<revision>/
    revision: str  # the snapshot's commit
    ref: str | None  # "main" when refs/main chose it; None: the only or newest snapshot


def _expand(value: str, home: Path) -> Path:
    """`value` with a leading `~` as `home` (what os.path.expanduser does, without the env)."""
    if value == "~" or value.startswith("~/"):
        return home / value[2:]
    return Path(value)


def hub_cache_dir(env: Mapping[str, str], home: Path) -> Path:
    """The hub cache as huggingface_hub finds it: HF_HUB_CACHE (or its older name
    HUGGINGFACE_HUB_CACHE), else HF_HOME/hub, else XDG_CACHE_HOME/huggingface/hub, else
    ~/.cache/huggingface/hub. An empty variable counts as unset."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(name):
            return _expand(env[name], home)
    if env.get("HF_HOME"):
        return _expand(env["HF_HOME"], home) / "hub"
    xdg = _expand(env["XDG_CACHE_HOME"], home) if env.get("XDG_CACHE_HOME") else home / ".cache"
    return xdg / "huggingface" / "hub"


def is_repo_id(name: str) -> bool:
    """Whether `name` reads as a hub model id `ORG/NAME`."""
    return (
        _REPO_ID.fullmatch(name) is not None
        and ".." not in name
        and "--" not in name
        and not name.endswith((".", "-"))
    )


def _not_cached(name: str, cache: Path) -> HubCacheError:
    folder = f"models--{name.replace('/', '--')}"
    return HubCacheError(
        f"{name} is neither a local directory nor in the Hugging Face cache {cache} (no "
        f"{folder}; nothing is downloaded): on a machine with network run `hf download {name}` "
        f"(or `huggingface-cli download {name}`) and copy its {folder} folder into {cache} (or "
        "set HF_HOME or HF_HUB_CACHE to the cache you copied), or give the model's directory"
    )


def _snapshot_of_ref(repo: Path, ref: Path) -> tuple[str, str | None]:
    """(revision, "main") that refs/main names, or the only or newest snapshot's (None)."""
    if ref.is_file():
        try:
            revision = ref.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise HubCacheError(f"{ref} cannot be read: {exc}") from None
        if not _REVISION.fullmatch(revision) or revision.strip(".") == "":
            raise HubCacheError(f"{ref} does not hold a commit hash (it holds {revision[:60]!r})")
        return revision, "main"
    snapshots = [p for p in (repo / "snapshots").glob("*") if p.is_dir()]
    if not snapshots:
        raise HubCacheError(
            f"{repo} has no snapshot (an incomplete download?): download the model again"
        )
    return max(snapshots, key=lambda p: (p.stat().st_mtime, p.name)).name, None


def find_cached(name: str, cache: Path) -> CachedModel:
    """The snapshot of model `name` in the hub cache at `cache`: the commit refs/main names,
    else the only (or most recent) snapshot; HubCacheError when it is not there or has no
    config.json."""
    repo = cache / f"models--{name.replace('/', '--')}"
    if not repo.is_dir():
        raise _not_cached(name, cache)
    revision, ref = _snapshot_of_ref(repo, repo / "refs" / "main")
    path = repo / "snapshots" / revision
    if not path.is_dir():
        raise HubCacheError(
            f"{repo}/refs/main names revision {revision}, but snapshots/{revision} is not "
            "there (an incomplete copy of the cache?): download the model again"
        )
    if not (path / "config.json").is_file():  # a link into blobs/ that is broken counts too
        raise HubCacheError(
            f"the cached snapshot {path} has no config.json (an incomplete download?): "
            "download the model again"
        )
    return CachedModel(name, path, revision, ref)


def local_or_cached(given: Path) -> tuple[Path, CachedModel | None]:
    """The model directory that `eggroll-tune MODEL_DIR` names: `given` itself when it
    exists or is no hub name, else its snapshot in the hub cache (an absolute path) found
    from this process's environment. HubCacheError when a name is not cached."""
    if given.exists() or not is_repo_id(given.as_posix()):
        return given, None
    try:
        home = Path.home()
    except RuntimeError:  # no HOME and no passwd entry: only the variables can name it
        home = Path("~")
    found = find_cached(given.as_posix(), hub_cache_dir(os.environ, home))
    return found.path.absolute(), found
