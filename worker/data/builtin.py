"""The built-in corpus: text every machine with Python has, no download needed.

The ``pydoc_data.topics`` texts (one document per topic, sorted by name), then one document
per standard-library module holding its module, class and function docstrings, read by
parsing the sources with ``ast`` (nothing is imported). It depends on the Python build, so
meta.json records the Python version in its source.
"""

from __future__ import annotations

import ast
import os
import platform
import sysconfig
import warnings
from collections.abc import Iterator
from pathlib import Path

from .documents import clean_text

BUILTIN_CAP_BYTES = 8 * 1024 * 1024
# Standard-library folders that hold tests, third-party code or no Python sources.
_SKIP_DIRS = frozenset(
    {"test", "tests", "idle_test", "__pycache__", "site-packages", "dist-packages", "lib-dynload"}
)


def builtin_source() -> str:
    """meta.json source of the built-in corpus; it names the Python version it came from."""
    return f"builtin:python-{platform.python_version()}-docs"


def _topic_documents() -> list[bytes]:
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions package pydoc_data separately
        return []
    docs = (clean_text(topics[key]) for key in sorted(topics))
    return [d.encode("utf-8") for d in docs if d.strip()]


def _docstrings(node: ast.AST, prefix: str) -> Iterator[str]:
    """Class and function docstrings under `node`, in source order, with qualified names."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            name = f"{prefix}{child.name}"
            doc = ast.get_docstring(child, clean=True)
            if doc and doc.strip():
                kind = "class" if isinstance(child, ast.ClassDef) else "def"
                yield f"{kind} {name}\n{doc}"
            yield from _docstrings(child, f"{name}.")
        else:
            # Definitions nested in if/try blocks (platform variants) count too.
            yield from _docstrings(child, prefix)


def _module_document(path: Path, module: str) -> str | None:
    try:
        source = path.read_bytes()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. SyntaxWarning for invalid escapes
            tree = ast.parse(source, filename=str(path))
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError, RecursionError):
        return None  # unreadable or not Python 3: not part of the corpus
    parts = [module]
    doc = ast.get_docstring(tree, clean=True)
    if doc and doc.strip():
        parts.append(doc)
    parts.extend(_docstrings(tree, ""))
    return "\n\n".join(parts) if len(parts) > 1 else None


def stdlib_modules(stdlib_dir: Path | str | None = None) -> Iterator[tuple[Path, str]]:
    """(path, dotted module name) of every stdlib .py file, in sorted order, tests skipped."""
    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    for dirpath, dirnames, filenames in os.walk(root):
        # Sorting in place fixes os.walk's order; pruning skips tests and installed packages.
        dirnames[:] = sorted(
            d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("config-")
        )
        rel = Path(dirpath).relative_to(root)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            parts = [*rel.parts, name[:-3]]
            if parts[-1] == "__init__":
                parts.pop()
            yield Path(dirpath) / name, ".".join(parts) or "__init__"


def builtin_documents(cap_bytes: int = BUILTIN_CAP_BYTES) -> list[bytes]:
    """The built-in corpus, at most `cap_bytes` of text: the first documents that fit."""
    docs = _topic_documents()
    for path, module in stdlib_modules():
        text = _module_document(path, module)
        if text is not None:
            docs.append(clean_text(text).encode("utf-8"))
    kept: list[bytes] = []
    total = 0
    for doc in docs:
        total += 1 + len(doc)
        if total > cap_bytes:
            break
        kept.append(doc)
    return kept
