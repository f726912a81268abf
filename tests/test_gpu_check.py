"""scripts/gpu_check.py's parts that need no GPU: its help, the preflight's one line on a
machine without a device, and the wheelhouse a GPU machine without network installs from."""

from __future__ import annotations

import subprocess
import sys
import time
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


def test_a_part_past_its_deadline_ends_with_everything_it_started(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_check

    pid_file = tmp_path / "child.pid"
    tree = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(60)\n"
    )
    monkeypatch.setattr(gpu_check, "part_command", lambda *_: [sys.executable, "-c", tree])
    assert gpu_check.run_part("mixed", 5, tmp_path, None) == 124
    assert "mixed      FAIL" in capsys.readouterr().out
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and Path(f"/proc/{child}").exists():
        status = Path(f"/proc/{child}/stat").read_text().split()[2]
        if status == "Z":  # a zombie: dead, waiting for a parent that is gone too
            break
        time.sleep(0.1)
    else:
        assert not Path(f"/proc/{child}").exists(), "the part's child outlived its deadline"


def test_each_command_fits_nine_minutes() -> None:
    """--help promises two commands of at most 9 minutes: the verdict's deadlines, and the
    bench's with its install and preflight, add up to no more."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_check

    parts = gpu_check.VERDICT
    assert sum(parts.values()) <= 9 * 60
    assert parts["install"] + parts["preflight"] + sum(gpu_check.BENCH.values()) <= 9 * 60
    assert parts["install"] + sum(gpu_check.HF.values()) <= 9 * 60


def test_the_bench_counts_every_gemm_and_weighs_cublas_by_time() -> None:
    """bench_gpu's useful MACs per member-token are the presets' GEMMs (EGG: 12 D^2 a layer +
    V D; the former: + 8 D^2 for the embedding MLP, its tied head V D), and cuBLAS's rate on
    the same shapes is their MACs over the sum of their times, not a mean of rates."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_gpu import gemm_shapes, same_shape_rate, useful_macs

    from eggroll_dist.shared.config import preset

    egg, former = preset("egg-paper").model, preset("d-eggs").model
    assert useful_macs(preset("egg-paper")) == egg.n_layer * 12 * 256**2 + egg.vocab_size * 256
    assert useful_macs(preset("d-eggs")) == (former.n_layer * 12 + 8) * 256**2 + 8192 * 256
    assert (8192, 256) in gemm_shapes(preset("d-eggs"))
    shapes = [(256, 256), (256, 256), (1024, 256)]  # 2 x 65,536 MACs at rate 1, 262,144 at 8
    rates = {(256, 256): 1.0, (1024, 256): 8.0}
    assert same_shape_rate(shapes, rates) == 6 * 65536 / (2 * 65536 + 262144 / 8)  # 2.4
