"""scripts/gpu_check.py's parts that need no GPU: its help, the preflight's one line on a
machine without a device, and the wheelhouse a GPU machine without network installs from."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.py"


def run(*args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def test_help_documents_the_two_commands() -> None:
    out = run("--help")
    assert out.returncode == 0
    assert "python scripts/gpu_check.py wheelhouse WHEELS" in out.stdout
    assert "python3 scripts/gpu_check.py verdict LOG_DIR --wheels WHEELS" in out.stdout
    assert "python3 scripts/gpu_check.py bench LOG_DIR --wheels WHEELS" in out.stdout
    for part in ("preflight", "parity", "chunk", "mixed", "memcheck", "racecheck", "synccheck"):
        assert part in out.stdout


def test_preflight_without_a_device_is_one_line(tmp_path: Path) -> None:
    # a CuPy that cannot load, as on a machine without CUDA (whether or not CuPy is installed)
    fake = tmp_path / "fake"
    (fake / "cupy").mkdir(parents=True)
    (fake / "cupy" / "__init__.py").write_text("raise ImportError('libcuda.so not found')\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(fake)}
    out = run("verdict", str(tmp_path / "log"), "--only", "preflight", env=env)
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("preflight  NO GPU") and "libcuda.so not found" in lines[0]
    assert lines[1] == "verdict: no GPU here"
    assert "Traceback" not in out.stdout + out.stderr


def test_wheelhouse_builds_under_64_mib(tmp_path: Path) -> None:
    out = run("wheelhouse", str(tmp_path / "wheels"), timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    wheels = {w.name.split("-")[0].lower(): w for w in (tmp_path / "wheels").glob("*.whl")}
    assert {"eggroll_distributed", "structlog", "pytest_asyncio"} <= set(wheels)
    # every wheel installs on CPython 3.12, x86-64 Linux
    for name, wheel in wheels.items():
        tags = wheel.name[: -len(".whl")].split("-")[-3:]
        assert tags[0] in ("py3", "py2.py3", "cp312", "cp310", "cp311"), (name, tags)
        assert tags[2] == "any" or "x86_64" in tags[2], (name, tags)
    assert sum(w.stat().st_size for w in wheels.values()) < 64 << 20
