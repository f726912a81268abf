"""The CPU build of CUDA kernels (tests/cudaemu) exposes the kernel bugs parity tests rely on
it to expose: barriers not every thread reaches, collectives after lanes exited, missing
barriers (results that depend on thread order), undefined behaviour, wrong argument types."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cudaemu
from kernel_target import CPU_BUILD_MISSING

pytestmark = pytest.mark.skipif(bool(CPU_BUILD_MISSING), reason=str(CPU_BUILD_MISSING))

BUGS = r"""
extern "C" __global__ void divergent_barrier(int* out) {
  if (threadIdx.x < 16) __syncthreads();
  out[threadIdx.x] = 1;
}
extern "C" __global__ void shuffle_after_exit(const int* x, int* out) {
  if (threadIdx.x >= 20) return;
  int v = __shfl_down_sync(0xffffffffu, x[threadIdx.x], 1);
  if (threadIdx.x == 0) out[0] = v;
}
// Reverses each block of 256 through shared memory, without the barrier between the writes
// and the reads of other threads' values.
extern "C" __global__ void missing_barrier(const int* x, int* out) {
  __shared__ int s[256];
  int i = blockIdx.x * 256 + threadIdx.x;
  s[threadIdx.x] = x[i];
  out[i] = s[255 - threadIdx.x];
}
extern "C" __global__ void wide_shift(const int* x, int* out) {
  out[threadIdx.x] = 1 << x[threadIdx.x];
}
"""
NAMES = ("divergent_barrier", "shuffle_after_exit", "missing_barrier", "wide_shift")


@pytest.fixture(scope="module")
def mod() -> cudaemu.RawModule:
    return cudaemu.RawModule(BUGS, name_expressions=NAMES)


def test_barrier_not_reached_by_every_thread(mod: cudaemu.RawModule) -> None:
    with pytest.raises(cudaemu.LaunchError, match="wait at __syncthreads"):
        mod.get_function("divergent_barrier")((1,), (32,), (np.zeros(32, np.int32),))


def test_warp_collective_after_lanes_exited(mod: cudaemu.RawModule) -> None:
    with pytest.raises(cudaemu.LaunchError, match="deadlock"):
        mod.get_function("shuffle_after_exit")(
            (1,), (32,), (np.arange(32, dtype=np.int32), np.zeros(1, np.int32))
        )


def test_missing_barrier_shows_as_a_wrong_or_order_dependent_result(
    mod: cudaemu.RawModule,
) -> None:
    x = np.arange(1024, dtype=np.int32)
    want = x.reshape(4, 256)[:, ::-1].ravel()
    right = []
    for order in cudaemu.ORDERS:
        out = np.zeros(1024, np.int32)
        mod.get_function("missing_barrier")((4,), (256,), (x, out), order=order, seed=1)
        right.append(np.array_equal(out, want))
    assert not all(right)


def test_argument_types_are_checked_before_launch(mod: cudaemu.RawModule) -> None:
    kernel = mod.get_function("wide_shift")
    x = np.zeros(32, np.int32)
    with pytest.raises(TypeError, match="kernel expects i4, got int64"):
        kernel((1,), (32,), (np.zeros(32, np.int64), x))
    with pytest.raises(TypeError, match="read-only"):
        readonly = np.zeros(32, np.int32)
        readonly.flags.writeable = False
        kernel((1,), (32,), (x, readonly))
    with pytest.raises(TypeError, match="1 arguments for 2"):
        kernel((1,), (32,), (x,))


def test_undefined_behaviour_aborts_under_the_sanitizer() -> None:
    """A shift by 32 is undefined (PTX clamps, x86 masks the count); the UBSan build says so."""
    script = textwrap.dedent(
        f"""
        import sys
        import numpy as np
        sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
        import cudaemu
        from test_cudaemu import BUGS, NAMES
        mod = cudaemu.RawModule(BUGS, name_expressions=NAMES, sanitize=True)
        x = np.full(32, 32, np.int32)
        mod.get_function("wide_shift")((1,), (32,), (x, np.zeros(32, np.int32)))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode != 0
    assert "shift exponent 32 is too large" in proc.stderr
