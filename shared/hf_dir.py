"""A Hugging Face model directory: its files, their digests, and its linear layers.

A run on a Hugging Face model starts from the base weights of a local directory, so the
directory is part of what every replica must agree on: the run records the SHA-256 of each
file that loading reads, and a worker whose copy differs is refused with one line naming the
file. The files that count are those at the top level matching `MODEL_FILES`; weights must
be safetensors (pickled `.bin` weights are never loaded).

Digests and sizes need no torch. Which modules are linear layers does: `linear_layers`
builds the model on PyTorch's meta device (no memory for weights) to list them, so a
coordinator that pins an hf run needs the `hf` extra but never loads the weights.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from .hf import HFError, matrices_of, select_targets

__all__ = [
    "INSTALL",
    "MODEL_FILES",
    "ModelDirError",
    "check_model_dir",
    "linear_layers",
    "model_dir_digests",
    "model_folder",
    "parameter_count",
    "pinned_files",
    "pinned_matrices",
    "require_hf",
]

INSTALL = "pip install 'eggroll-distributed[hf]'"
# the files one of which a saved tokenizer has
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

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


def model_folder(path: str | Path) -> Path:
    """`path` as a Path; ModelDirError unless it is a folder with a config.json."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise ModelDirError(f"{path} is not a directory (expected a Hugging Face model directory)")
    if not (path / "config.json").is_file():
        raise ModelDirError(f"{path} is not a Hugging Face model directory: it has no config.json")
    return path


def _files(path: Path) -> list[Path]:
    path = model_folder(path)
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


def pinned_files(path: Path) -> tuple[str, ...]:
    """The config's `model.files`: "sha256 name" per file loading reads, sorted by name
    (ModelDirError for a directory without a tokenizer)."""
    digests = model_dir_digests(path)
    if not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        raise ModelDirError(
            f"{path} has no tokenizer: none of {', '.join(TOKENIZER_FILES)} is there "
            "(save it beside the model with tokenizer.save_pretrained)"
        )
    return tuple(f"{digest} {name}" for name, digest in digests.items())


def check_model_dir(path: Path, files: Sequence[str]) -> None:
    """ModelDirError naming the first file that is missing, extra or different from the
    config's "sha256 name" entries."""
    pinned = {name: digest for digest, name in (entry.split(" ", 1) for entry in files)}
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


# --- the model's linear layers (PyTorch and transformers, imported only here) ---------------


def require_hf() -> tuple[Any, Any]:
    """(torch, transformers), or ModelDirError naming the extra to install."""
    try:
        import torch
        import transformers
    except ImportError as exc:
        raise ModelDirError(
            f"Hugging Face models need PyTorch and transformers ({exc.name} is missing): {INSTALL}"
        ) from None
    return torch, transformers


def causal_architecture(architecture: str) -> bool:
    """Whether a config's `architectures` entry names a causal LM class."""
    return architecture.endswith(("ForCausalLM", "LMHeadModel"))


def first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def read_config(path: Path) -> Any:
    """The directory's transformers config; ModelDirError when it is not a causal LM's."""
    _, transformers = require_hf()
    _files(Path(path))
    try:
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelDirError(f"{path}/config.json does not read: {first_line(exc)}") from None
    other = [a for a in getattr(config, "architectures", None) or [] if not causal_architecture(a)]
    if other:
        raise ModelDirError(f"{path} holds a {other[0]}, which is not a causal LM")
    return config


def linear_layers(model: Any) -> list[tuple[str, Any, tuple[int, int], bool]]:
    """(name, module, (out, in), transposed) of every linear layer, in module order:
    nn.Linear, and GPT-2's Conv1D whose weight is stored (in, out) (`transposed`)."""
    torch, _ = require_hf()
    from transformers.pytorch_utils import Conv1D

    out = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            out.append((name, module, (module.out_features, module.in_features), False))
        elif isinstance(module, Conv1D):
            rows, cols = module.weight.shape[1], module.weight.shape[0]
            out.append((name, module, (int(rows), int(cols)), True))
    return out


def pinned_matrices(path: Path, patterns: Sequence[str], rank: int) -> tuple[str, ...]:
    """The config's `model.matrices` ("name out in") of the directory's model, built on the
    meta device; ModelDirError for a model that is not a causal LM, targets that match
    nothing or a rank that does not fit."""
    torch, transformers = require_hf()
    config = read_config(path)
    try:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
    except ValueError as exc:
        kind = getattr(config, "model_type", "?")
        raise ModelDirError(
            f"{path} holds a {kind!r} model, which is not a causal LM: {first_line(exc)}"
        ) from None
    layers = linear_layers(model)
    try:
        chosen = select_targets([(name, shape) for name, _, shape, _ in layers], patterns, rank)
    except HFError as exc:
        raise ModelDirError(str(exc)) from None
    refuse_tied(model, {t.name: m for t in chosen for name, m, _, _ in layers if name == t.name})
    return matrices_of(chosen)


def refuse_tied(model: Any, modules: dict[str, Any]) -> None:
    """ModelDirError when a target's weight is also another module's (tied embeddings): the
    state's weights would move that module too, which its noise never perturbed."""
    owners: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), []).append(name.rpartition(".")[0])
    for name, module in modules.items():
        others = [o for o in owners.get(id(module.weight), []) if o != name]
        if others:
            raise ModelDirError(
                f"target {name} shares its weight with {others[0]} (tied weights): "
                "leave it out of the target patterns"
            )
