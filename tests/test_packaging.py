"""The four folders install as one namespace; bare top-level names are not importable."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import eggroll_dist.protocol


@pytest.mark.parametrize("bare", ["shared", "protocol", "worker", "coordinator"])
def test_bare_names_are_not_importable(bare: str, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", f"import {bare}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and "ModuleNotFoundError" in done.stderr


def test_namespaces_import_from_anywhere(tmp_path: Path) -> None:
    code = (
        "import eggroll_dist.protocol, eggroll_dist.shared, eggroll_dist.worker, "
        "eggroll_dist.coordinator, eggroll_dist.worker.backend; print('ok')"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert done.stdout.strip() == "ok", done.stderr


def test_spec_ships_with_the_protocol_package() -> None:
    spec = Path(eggroll_dist.protocol.__file__).with_name("SPEC.md")
    assert spec.is_file() and "EGGR" in spec.read_text()


def test_license_file_matches_the_metadata() -> None:
    meta = importlib.metadata.metadata("eggroll-distributed")
    assert meta.get_all("License-Expression") == ["MIT"]
    assert meta.get_all("License-File") == ["shared/LICENSE"]
    text = (Path(__file__).resolve().parents[1] / "shared" / "LICENSE").read_text()
    assert text.startswith("MIT License\n")


def test_the_repository_root_holds_only_the_agreed_entries() -> None:
    """The top level is fixed: these entries, dot-files (.ci, .gitignore), nothing else."""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        ["git", "ls-files"], cwd=root, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        pytest.skip("not a git checkout")
    tops = {line.split("/")[0] for line in done.stdout.splitlines() if line}
    agreed = {"pyproject.toml", "README.md", "coordinator", "worker", "protocol", "shared"}
    agreed |= {"deploy", "scripts", "tests", "checkpoints"}
    assert {t for t in tops if not t.startswith(".")} <= agreed


def test_every_package_folder_is_installed() -> None:
    """A folder of ours with an __init__.py that pyproject.toml does not list would work
    in a checkout and be missing from every install."""
    root = Path(__file__).resolve().parents[1]
    tool = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = {tool["package-dir"][name] for name in tool["packages"]}
    folders = {
        init.parent.relative_to(root).as_posix()
        for top in ("coordinator", "protocol", "shared", "worker")
        for init in (root / top).rglob("__init__.py")
    }
    assert folders == listed
