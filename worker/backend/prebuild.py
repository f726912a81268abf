"""`python -m eggroll_dist.worker.backend.prebuild DIR`: the CuPy backend's kernels compiled
ahead of time into a kernel folder (cubins.py), with no GPU, for a worker's --kernel-dir or
EGGROLL_KERNEL_DIR. Needs the NVRTC library (the cuda-check extra, or a CUDA install)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from . import cubins
from .cupy_kernels import NVRTC_OPTIONS, SIGNATURES, kernel_source


def build_kernels(
    out: Path,
    archs: Sequence[str] | None = None,
    say: Callable[[str], None] = lambda _: None,
    source: str | None = None,
) -> Path:
    """The backend's module (`source`: this package's kernel_source()) for each architecture
    ("90"; default: cubins.DEFAULT_ARCHS that NVRTC knows) into `out`; the manifest's path."""
    code = kernel_source() if source is None else source
    return cubins.build(out, code, NVRTC_OPTIONS, tuple(SIGNATURES), archs, say)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m eggroll_dist.worker.backend.prebuild",
        description="Compile the CuPy backend's kernels into cubins (NVRTC, no GPU needed) "
        "for a worker's --kernel-dir or EGGROLL_KERNEL_DIR.",
    )
    parser.add_argument("out", type=Path, help="the kernel folder to write")
    parser.add_argument(
        "--arch",
        nargs="+",
        default=None,
        help="architectures, e.g. 80 90 120 (default: "
        f"{' '.join(cubins.DEFAULT_ARCHS)}, those NVRTC knows)",
    )
    args = parser.parse_args(argv)
    try:
        manifest = build_kernels(args.out, args.arch, say=print)
    except (cubins.NvrtcMissing, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {manifest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
