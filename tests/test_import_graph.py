"""No import circle inside any code folder, read from the imports (AST, no import).

An import circle means no module of it can be read on its own, and that its modules cannot
be understood or tested in any order. Imports under `if TYPE_CHECKING:` are annotations
only, never executed, and are left out (shared/config.py asks the architecture and rule
registries for their checks; the modules below it name its types only in annotations).
Imports inside functions count: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("protocol", "shared", "coordinator", "worker")
NAMESPACE = "eggroll_dist"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking_only(tree: ast.Module) -> set[int]:
    """Line numbers of the imports inside `if TYPE_CHECKING:` blocks."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in (
            "TYPE_CHECKING",
            "typing.TYPE_CHECKING",
        ):
            for inner in node.body:
                for sub in ast.walk(inner):
                    if isinstance(sub, ast.Import | ast.ImportFrom):
                        lines.add(sub.lineno)
    return lines


def edges(path: Path, root: Path, known: set[str]) -> set[str]:
    """The modules of `known` that this file imports when it runs."""
    me = module_name(path, root)
    package = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_only(tree)
    out: set[str] = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name.removeprefix(NAMESPACE + ".") for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                stem = ".".join([*base, *(node.module.split(".") if node.module else [])])
            else:
                stem = (node.module or "").removeprefix(NAMESPACE + ".")
            # `from . import egg` imports the module egg; `from .model import ARCHS` the
            # module model
            targets = [f"{stem}.{a.name}" for a in node.names if f"{stem}.{a.name}" in known]
            targets = targets or [stem]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != me:
                out.add(target)
    return out


def graph(root: Path, package: str) -> dict[str, set[str]]:
    paths = sorted((root / package).rglob("*.py"))
    assert paths, f"no modules in {package}/"
    known = {module_name(p, root) for p in paths}
    return {module_name(p, root): edges(p, root, known) for p in paths}


def circle(g: dict[str, set[str]]) -> list[str] | None:
    """One import circle of the graph, as its modules in order, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(g.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(g):
        if start not in state and (found := visit(start)):
            return found
    return None


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_circle(package: str) -> None:
    found = circle(graph(ROOT, package))
    assert found is None, " -> ".join(found or [])


def test_the_checker_sees_a_circle_and_skips_annotations(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    (shared / "rules").mkdir(parents=True)
    (shared / "__init__.py").write_text("")
    (shared / "config.py").write_text("from .model import ARCHS\n")
    (shared / "model.py").write_text("from . import egg\n")
    (shared / "egg.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .config import RunConfig\n"
    )
    (shared / "rules" / "__init__.py").write_text("from . import adamw\n")
    (shared / "rules" / "adamw.py").write_text("from ..perturb import ParamSpec\n")
    (shared / "perturb.py").write_text("def f():\n    from .rules import RULES\n")
    g = graph(tmp_path, "shared")
    assert g["shared.model"] == {"shared.egg"}
    assert g["shared.egg"] == set()
    assert g["shared.rules.adamw"] == {"shared.perturb"}
    found = circle(g)
    assert found is not None and found[0] == found[-1]
    assert set(found) == {"shared.perturb", "shared.rules", "shared.rules.adamw"}
    (shared / "perturb.py").write_text("")
    assert circle(graph(tmp_path, "shared")) is None
