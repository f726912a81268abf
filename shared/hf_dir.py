"""A Hugging Face model directory: its files, their digests, and its linear layers.

A run on a Hugging Face model starts from the base weights of a local directory, so the
directory is part of what every replica must agree on: the run records the SHA-256 of each
file that loading reads, and a worker whose copy differs is refused with one line naming the
file. The files that count are those at the top level matching `MODEL_FILES`; weights must
be safetensors (pickled `.bin` weights are never loaded).

Digests, sizes and the target weights themselves need no torch: a small safetensors reader
(`read_targets`) gives each target's bit patterns as a NumPy array, the replica state at
step 0 (`base_state`) and the dtype the config pins (`target_dtype`). Which modules are
linear layers needs torch: `linear_layers` builds the model on PyTorch's meta device (no
memory for weights) to list them, so a coordinator that pins an hf run needs the `hf` extra
but never loads the weights.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from fnmatch import fnmatchcase
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .hf import WEIGHT_DTYPES, HFError, Target, matrices_of, select_targets, targets

if TYPE_CHECKING:
    from .config import RunConfig
    from .replica import ReplicaState

__all__ = [
    "INSTALL",
    "MODEL_FILES",
    "ModelDirError",
    "base_state",
    "check_model_dir",
    "linear_layers",
    "model_dir_digests",
    "model_folder",
    "parameter_count",
    "pinned_files",
    "pinned_matrices",
    "read_targets",
    "require_hf",
    "target_dtype",
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
        if f.name.endswith(".safetensors"):
            header, _ = _header(f)
            total += sum(math.prod(entry["shape"]) for entry in header.values())
    return total


# --- the target weights, read from the safetensors files (no torch) ------------------------

MAX_HEADER = 100 << 20  # bytes of a safetensors JSON header
INDEX_FILE = "model.safetensors.index.json"
# safetensors dtype -> model.weight_dtype, and the bytes of one value
SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2}
_ITEMSIZE |= {"F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def _header(f: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's tensors {name: {dtype, shape, data_offsets}} and where its data
    starts; every size is bounded by the file's before it is trusted (ModelDirError)."""
    size = f.stat().st_size
    with f.open("rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise ModelDirError(f"{f} is not a safetensors file (too short)")
        length = int.from_bytes(head, "little")
        if length > min(MAX_HEADER, size - 8):
            raise ModelDirError(f"{f} is not a safetensors file (header of {length} bytes)")
        try:
            header = json.loads(handle.read(length))
        except (ValueError, RecursionError):  # deep nesting exhausts the parser's stack
            raise ModelDirError(f"{f} is not a safetensors file (bad header)") from None
    if not isinstance(header, dict):
        raise ModelDirError(f"{f} is not a safetensors file (bad header)")
    header.pop("__metadata__", None)
    room = size - 8 - length
    for name, entry in header.items():
        if not _entry_fits(entry, room):
            raise ModelDirError(f"{f} is not a safetensors file (tensor {name!r} is malformed)")
    return header, 8 + length


def _entry_fits(entry: Any, room: int) -> bool:
    """Whether a header entry is well formed and its bytes lie inside the file's data (and,
    for a dtype known here, are as many as its shape needs)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("dtype"), str):
        return False
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        return False
    if not isinstance(offsets, list) or len(offsets) != 2:
        return False
    lo, hi = offsets
    if not (type(lo) is int and type(hi) is int and 0 <= lo <= hi <= room):
        return False
    size = _ITEMSIZE.get(entry["dtype"])
    return size is None or hi - lo == math.prod(shape) * size


def _weight_files(path: Path) -> dict[str, Path]:
    """{tensor name: the safetensors file holding it}: the shards model.safetensors.index.json
    maps, else every top-level .safetensors file's tensors."""
    index = path / INDEX_FILE
    if index.is_file():
        if index.stat().st_size > MAX_HEADER:
            raise ModelDirError(f"{index} is {index.stat().st_size:,} bytes: not an index")
        try:
            weight_map = json.loads(index.read_bytes())["weight_map"]
        except (ValueError, KeyError, TypeError):
            raise ModelDirError(f"{index} is not a safetensors index (no weight_map)") from None
        if not isinstance(weight_map, dict):
            raise ModelDirError(f"{index} is not a safetensors index (no weight_map)")
        out = {}
        for name, shard in weight_map.items():
            if not isinstance(shard, str) or "/" in shard or shard.startswith("."):
                raise ModelDirError(f"{index} names a shard {shard!r} outside the folder")
            if not shard.endswith(".safetensors"):  # the pinned files are *.safetensors
                raise ModelDirError(f"{index} names a shard {shard!r} that is not .safetensors")
            out[name] = path / shard
        return out
    return {name: f for f in _files(path) if f.suffix == ".safetensors" for name in _header(f)[0]}


def _tensor_of(name: str, files: dict[str, Path]) -> str:
    """The tensor that holds module `name`'s weight: `name.weight`, or the same without the
    base model's prefix (checkpoints saved from the bare model, as GPT-2's first)."""
    for key in (f"{name}.weight", f"{name.partition('.')[2]}.weight"):
        if key in files:
            return key
    raise ModelDirError(f"the model's files hold no weight of target {name} ({name}.weight)")


def _target_entries(path: Path, chosen: Sequence[Target]) -> dict[str, tuple[Path, dict, int]]:
    """{target: (file, header entry, data start)} for every target."""
    files = _weight_files(Path(path))
    headers: dict[Path, tuple[dict[str, Any], int]] = {}
    out = {}
    for t in chosen:
        key = _tensor_of(t.name, files)
        f = files[key]
        if f not in headers:
            if not f.is_file():
                raise ModelDirError(f"model file {f} is missing (the index names it)")
            headers[f] = _header(f)
        header, start = headers[f]
        if key not in header:
            raise ModelDirError(f"model file {f} has no tensor {key} (the index says it has)")
        out[t.name] = (f, header[key], start)
    return out


def target_dtype(path: Path, matrices: Sequence[str]) -> str:
    """The config's `model.weight_dtype`: the dtype every target ("name out in") has in the
    directory's safetensors files; ModelDirError for another dtype or targets of two."""
    chosen = [Target(e.split(" ")[0], (0, 0), 0) for e in matrices]
    found: dict[str, str] = {}
    for name, (f, entry, _) in _target_entries(Path(path), chosen).items():
        dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ModelDirError(
                f"target {name} is stored as {entry['dtype']} in {f.name}: the hf family "
                "trains bfloat16, float16 or float32 weights"
            )
        found.setdefault(dtype, name)
    if len(found) > 1:
        (a, first), (b, second) = list(found.items())[:2]
        raise ModelDirError(
            f"the targets are stored in two dtypes ({first} {a}, {second} {b}): name "
            "targets of one dtype (model.targets)"
        )
    return next(iter(found), "float32")


def read_targets(
    path: Path, chosen: Sequence[Target], dtype: str, transposed: set[str]
) -> dict[str, np.ndarray]:
    """Each target's weights from the safetensors files as bit patterns of `dtype` (int16
    or int32), (out, in): a target in `transposed` (GPT-2's Conv1D) is stored (in, out).
    ModelDirError when a target's dtype or shape is not the run's."""
    want = np.dtype(WEIGHT_DTYPES[dtype]).newbyteorder("<")
    entries = _target_entries(Path(path), chosen)
    out = {}
    for t in chosen:
        f, entry, start = entries[t.name]
        stored = SAFETENSORS_DTYPES.get(entry["dtype"], entry["dtype"])
        if stored != dtype:
            raise ModelDirError(
                f"target {t.name} is {stored} in {f.name}; the run's targets are {dtype}"
            )
        rows, cols = t.shape
        shape = (cols, rows) if t.name in transposed else (rows, cols)
        if tuple(entry["shape"]) != shape:
            raise ModelDirError(
                f"target {t.name} is {tuple(entry['shape'])} in {f.name}, not the run's {shape}"
            )
        lo, hi = entry["data_offsets"]
        with f.open("rb") as handle:
            handle.seek(start + lo)
            data = bytearray(hi - lo)
            if handle.readinto(data) != len(data):
                raise ModelDirError(f"model file {f} is truncated")
        bits = np.frombuffer(data, dtype=want).reshape(shape)
        bits = bits.T if t.name in transposed else bits
        out[t.name] = np.ascontiguousarray(bits, dtype=want.newbyteorder("="))
    return out


def base_state(cfg: RunConfig, model_dir: Path) -> ReplicaState:
    """The replica at step 0 of an hf run: its targets' weights as the model directory's
    files hold them. The caller checks the files against the run's digests (`model.files`,
    `check_model_dir`) where it has not just pinned them."""
    from .replica import ReplicaState
    from .update import initial_opt_state

    chosen = targets(cfg.model)
    transposed = transposed_targets(Path(model_dir), {t.name for t in chosen})
    params = read_targets(Path(model_dir), chosen, cfg.model.weight_dtype, transposed)
    return ReplicaState(cfg, 0, params, initial_opt_state(cfg))


# --- the model's linear layers (PyTorch and transformers, imported only here) ---------------


_imported_resident: list[int] = []  # the process's resident bytes once they were imported


def require_hf() -> tuple[Any, Any]:
    """(torch, transformers), or ModelDirError naming the extra to install."""
    try:
        import torch
        import transformers
    except ImportError as exc:
        raise ModelDirError(
            f"Hugging Face models need PyTorch and transformers ({exc.name} is missing): {INSTALL}"
        ) from None
    if not _imported_resident:  # what this installation's imports cost (worker/hf_estimate.py)
        _imported_resident.append(resident_bytes())
    return torch, transformers


def imported_resident() -> int | None:
    """The process's resident bytes when torch and transformers were first imported by
    `require_hf` (None: not yet, or unknown)."""
    return _imported_resident[0] if _imported_resident and _imported_resident[0] else None


def resident_bytes() -> int:
    """The process's resident set (VmRSS) in bytes; 0 where it cannot be read."""
    return proc_kib_field(Path("/proc/self/status"), "VmRSS") or 0


def mem_available() -> int | None:
    """The host's MemAvailable in bytes (None where the kernel does not say): it counts the
    page cache a load can reclaim (the files just hashed)."""
    return proc_kib_field(Path("/proc/meminfo"), "MemAvailable")


def proc_kib_field(path: Path, key: str) -> int | None:
    """A "Key:  N kB" line of a /proc file, in bytes (None: no such line, or unreadable)."""
    try:
        for line in path.read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


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


def meta_model(path: Path) -> Any:
    """The directory's causal LM built on the meta device (no memory for weights);
    ModelDirError for a model that is not a causal LM."""
    torch, transformers = require_hf()
    config = read_config(path)
    try:
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(config)
    except ValueError as exc:
        kind = getattr(config, "model_type", "?")
        raise ModelDirError(
            f"{path} holds a {kind!r} model, which is not a causal LM: {first_line(exc)}"
        ) from None


def pinned_matrices(path: Path, patterns: Sequence[str], rank: int) -> tuple[str, ...]:
    """The config's `model.matrices` ("name out in") of the directory's model, built on the
    meta device; ModelDirError for a model that is not a causal LM, targets that match
    nothing or a rank that does not fit."""
    model = meta_model(path)
    layers = linear_layers(model)
    try:
        chosen = select_targets([(name, shape) for name, _, shape, _ in layers], patterns, rank)
    except HFError as exc:
        raise ModelDirError(str(exc)) from None
    refuse_tied(model, {t.name: m for t in chosen for name, m, _, _ in layers if name == t.name})
    return matrices_of(chosen)


def transposed_targets(path: Path, names: set[str]) -> set[str]:
    """Which of the named modules store their weight (in, out): GPT-2's Conv1D layers."""
    return {name for name, _, _, t in linear_layers(meta_model(path)) if t and name in names}


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
