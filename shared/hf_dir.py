"""A Hugging Face model directory's files and their digests (torch-free).

A run on a Hugging Face model starts from the base weights of a local directory, so the
directory is part of what every replica must agree on: the run records the SHA-256 of each
file that loading reads, and a worker whose copy differs is refused with one line naming the
file. The files that count are those at the top level matching `MODEL_FILES`; weights must
be safetensors (pickled `.bin` weights are never loaded).
"""

from __future__ import annotations

import hashlib
import json
import math
from fnmatch import fnmatchcase
from pathlib import Path

__all__ = [
    "MODEL_FILES",
    "ModelDirError",
    "check_model_dir",
    "model_dir_digests",
    "parameter_count",
]

MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.*",
)


class ModelDirError(ValueError):
    """A model directory that is missing a file, or differs from the run's; one line."""


def _files(path: Path) -> list[Path]:
    if not path.is_dir():
        raise ModelDirError(f"{path} is not a directory (expected a Hugging Face model directory)")
    if not (path / "config.json").is_file():
        raise ModelDirError(f"{path} is not a Hugging Face model directory: it has no config.json")
    files = sorted(
        f
        for f in path.iterdir()
        if f.is_file() and any(fnmatchcase(f.name, p) for p in MODEL_FILES)
    )
    if not any(f.name.endswith(".safetensors") for f in files):
        pickled = any(f.suffix == ".bin" for f in path.iterdir())
        hint = " (it has .bin weights: save them with safe_serialization=True)" if pickled else ""
        raise ModelDirError(f"{path} has no .safetensors weights{hint}")
    return files


def _loaded(name: str) -> bool:
    return any(fnmatchcase(name, p) for p in MODEL_FILES)


def model_dir_digests(path: Path) -> dict[str, str]:
    """{file name: SHA-256 hex} of every file of the directory that loading reads."""
    out = {}
    for f in _files(Path(path)):
        with f.open("rb") as handle:
            out[f.name] = hashlib.file_digest(handle, "sha256").hexdigest()
    return out


def check_model_dir(path: Path, pinned: dict[str, str]) -> None:
    """ModelDirError naming the first file that is missing, extra or different."""
    have = model_dir_digests(Path(path))
    for name in sorted(pinned.keys() | have.keys()):
        if name not in have:
            raise ModelDirError(f"model file {Path(path) / name} is missing (the run has it)")
        if name not in pinned:
            raise ModelDirError(f"model file {Path(path) / name} is not the run's (remove it)")
        if have[name] != pinned[name]:
            raise ModelDirError(
                f"model file {Path(path) / name} differs from the run's "
                f"(sha256 {have[name][:12]}..., the run's {pinned[name][:12]}...)"
            )


def parameter_count(path: Path) -> int:
    """How many weights the directory's safetensors files hold, read from their headers
    only (so a model too big for a device is refused before anything is allocated)."""
    total = 0
    for f in _files(Path(path)):
        if not f.name.endswith(".safetensors"):
            continue
        with f.open("rb") as handle:
            head = handle.read(8)
            if len(head) < 8:
                raise ModelDirError(f"{f} is not a safetensors file (too short)")
            size = int.from_bytes(head, "little")
            if size > 100 << 20:
                raise ModelDirError(f"{f} is not a safetensors file (header of {size} bytes)")
            try:
                header = json.loads(handle.read(size))
            except ValueError:
                raise ModelDirError(f"{f} is not a safetensors file (bad header)") from None
        for name, entry in header.items():
            if name != "__metadata__":
                total += math.prod(entry["shape"])
    return total
