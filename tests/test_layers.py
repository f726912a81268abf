"""The dependency rules of the four code folders, read from their imports (AST, no import).

- protocol/ and shared/ import nothing of ours outside themselves, and no asyncio or socket;
- coordinator/ and worker/ never import each other;
- the pure cores (the run core, the worker session, the job queue) import no asyncio/socket;
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
PURE = (
    "coordinator/run.py",
    "coordinator/events.py",
    "coordinator/jobs.py",
    "coordinator/trust.py",
    "worker/session.py",
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
    return found


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
    }.items():
        path = tmp_path / rel
        path.parent.mkdir(exist_ok=True)
        path.write_text(source)
        assert violations(path, tmp_path), rel
    assert violations(ROOT / "coordinator/run.py", ROOT) == []
