"""The dependency rules of the four code folders, read from their imports (AST, no import).

- protocol/ and shared/ import nothing of ours outside themselves, and no asyncio or socket;
- coordinator/ and worker/ never import each other;
- the pure cores (the run core, its trust rules, the worker session, the job queue) import
  no asyncio/socket, and read no files (no file-system module, no open(), no goal files);
- every import of our own code is relative, the same way in all four folders.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("protocol", "shared", "coordinator", "worker")
IO_MODULES = {"asyncio", "socket"}
# The pure cores read no files either: no file-system modules, no `open`, and none of
# shared/'s modules that read a run's files (the goal files, the save directory) at
# run time (as types, under TYPE_CHECKING, they are fine).
FILE_MODULES = {"pathlib", "os", "shutil", "tempfile", "io", "shared.pinned", "shared.save_dir"}
PURE = (
    "coordinator/run.py",
    "coordinator/core_types.py",
    "coordinator/events.py",
    "coordinator/jobs.py",
    "coordinator/trust.py",
    "worker/session.py",
    "worker/session_types.py",
)


def imports(path: Path, root: Path = ROOT) -> Iterator[tuple[str, int, int]]:
    """(module imported, relative level, line) for every import in a file; a relative
    import is given as the dotted name under `eggroll_dist` it resolves to."""
    rel = path.relative_to(root)
    package = list(rel.parts[:-1])  # the folder, e.g. ["worker", "backend"]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, 0, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                yield node.module or "", 0, node.lineno
                continue
            base = package[: len(package) - (node.level - 1)]
            if node.level - 1 > len(package):
                raise AssertionError(f"{rel}:{node.lineno} imports past the top")
            names = [node.module] if node.module else [a.name for a in node.names]
            for name in names:
                yield ".".join([*base, name]), node.level, node.lineno


def ours(module: str) -> str | None:
    """Which of our folders a resolved module belongs to, if any."""
    top = module.removeprefix("eggroll_dist.").split(".")[0]
    return top if top in PACKAGES else None


def files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def violations(path: Path, root: Path = ROOT) -> list[str]:
    rel = path.relative_to(root)
    me = rel.parts[0]
    found = []
    typing_only = _typing_only(path)
    for module, level, line in imports(path, root):
        where = f"{rel}:{line} imports {module}"
        top = module.split(".")[0]
        folder = ours(module) if level else None
        if level == 0 and top == "eggroll_dist":
            found.append(f"{where}: use a relative import")
            folder = ours(module)
        if me in ("protocol", "shared"):
            if folder is not None and folder != me:
                found.append(f"{where}: {me}/ imports nothing of ours outside itself")
            if top in IO_MODULES:
                found.append(f"{where}: {me}/ does no I/O")
        if {me, folder} == {"coordinator", "worker"}:
            found.append(f"{where}: coordinator/ and worker/ never import each other")
        if rel.as_posix() in PURE and top in IO_MODULES:
            found.append(f"{where}: a pure core does no I/O")
        if rel.as_posix() in PURE and line not in typing_only and _file_module(module):
            found.append(f"{where}: a pure core reads no files")
    if rel.as_posix() in PURE:
        found += [f"{rel}:{line} calls open(): a pure core reads no files" for line in _opens(path)]
    return found


def _file_module(module: str) -> bool:
    name = module.removeprefix("eggroll_dist.")
    return any(name == m or name.startswith(m + ".") for m in FILE_MODULES)


def _opens(path: Path) -> list[int]:
    """Lines that call the builtin open() or a `.open(` / `.read_bytes(` of a path."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if (isinstance(f, ast.Name) and f.id == "open") or (
            isinstance(f, ast.Attribute) and f.attr in ("read_bytes", "read_text", "open")
        ):
            found.append(node.lineno)
    return found


def _typing_only(path: Path) -> set[int]:
    """Lines of the imports under `if TYPE_CHECKING:` (annotations, never run)."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            for inner in node.body:
                lines.update(sub.lineno for sub in ast.walk(inner) if hasattr(sub, "lineno"))
    return lines


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_follow_the_layers(package: str) -> None:
    paths = files(package)
    assert paths
    assert [v for path in paths for v in violations(path)] == []


def test_the_checker_sees_a_forbidden_import(tmp_path: Path) -> None:
    for rel, source in {
        "shared/x.py": "import asyncio\n",
        "protocol/y.py": "from ..shared import config\n",
        "coordinator/z.py": "from ..worker.session import Session\n",
        "worker/w.py": "from eggroll_dist.shared import data\n",
        "worker/session.py": "from pathlib import Path\n",
        "coordinator/run.py": "from ..shared.pinned import check_files\n",
        "coordinator/jobs.py": "def f(p):\n    return open(p).read()\n",
    }.items():
        path = tmp_path / rel
        path.parent.mkdir(exist_ok=True)
        path.write_text(source)
        assert violations(path, tmp_path), rel
    assert violations(ROOT / "coordinator/run.py", ROOT) == []
