"""Compile the CuPy backend's kernel module (worker/backend/'s CUDA files, one source) the way
cupy.RawModule does, without a GPU or CuPy.

NVRTC (the nvidia-cuda-nvrtc-cu12 wheel, through ctypes) with the backend's options plus
what CuPy adds itself, for each architecture asked (default sm_80 and sm_90). NVRTC has
no host headers, so this catches what `nvcc --ptx` lets through. Prints, per kernel, the
registers, shared memory and spills ptxas reports, and fails on a compile error or a spill.

With --sass, also disassembles each cubin (cuobjdump from the nvidia-cuda-cuobjdump wheel)
and fails unless every tensor-core kernel contains IMMA and every __dp4a twin IDP.4A. For the
tensor-core kernels it prints a static performance model read from the SASS:
- slots/IMMA: instructions per IMMA in each main loop (a backward branch whose body holds
  IMMA), both load paths; every instruction counted once, an upper bound on issue slots.
  Fails above IMMA_BUDGET.
- epi/out: instructions after the last main loop per output a thread owns, summed over the
  epilogue's compiled variants (byte pairs or single bytes; a shift or a multiply-high).
- occupancy: resident warps per SM from registers and shared memory (of 64).
- probe_*: kernels compiled with the module for --sass only, each the main loop and one
  epilogue variant: the path every preset takes (through shared memory, the division a
  shift), whose instructions per output a kernel holding every variant hides. Fails above
  EPILOGUE_BUDGET. Their registers and occupancy are the probe's, not the kernel's.
- and fails if the kernel holds more reciprocals (MUFU.RCP) than it makes magic numbers (one
  per kernel, two for the former's: the divisor and the rows per member): more is the mark
  of a software division per output.
For the former's attention, instructions per IDP.4A in its score loop and per multiply-add
in its weighted-sum loop (innermost loops; every instruction counted once). Fails above
ATTENTION_BUDGET for former_attention (heads up to 64 bytes, every preset's); printed for
former_attention_wide, whose several tile sizes make the loops it picks a guess.

    python scripts/nvrtc_check.py [--arch 80 90] [--sass]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from eggroll_dist.worker.backend.cubins import (
    CUPY_ADDED,
    NvrtcMissing,
    compile_cubin,
    load_nvrtc,
    site_file,
)
from eggroll_dist.worker.backend.cupy_kernels import (
    BLOCK,
    NVRTC_OPTIONS,
    SOURCE_FILES,
    TENSOR_CORE_KERNELS,
    TILE_M,
    TILE_N,
    kernel_source,
)

ROOT = Path(__file__).resolve().parent.parent
IMMA_BUDGET = 12.0  # instructions per IMMA in a tensor-core main loop
# make_divisor's reciprocals: 1 a kernel, 2 for the former's (the divisor, rows per member)
FORMER_KERNELS = ("former_mm_tc", "former_head_tc", "probe_former_mm", "probe_former_head")
MAGIC_NUMBERS = dict.fromkeys(FORMER_KERNELS, 2)
EPILOGUE_BUDGET = 48.0  # instructions per output on the presets' epilogue path (probe_*)
OUTPUTS_PER_THREAD = TILE_M * TILE_N // BLOCK
# The probes: each kernel's main loop and its presets' epilogue variant, nothing else.
PROBES = r"""
extern "C" __global__ void __launch_bounds__(256) probe_mm(MM_PARAMS) {
  int acc[ACC];
  tile_gemm<true>(x, w, M, N, K, 0, K / 4, acc);
  mm_epilogue16<true, true>(acc, xb, a, M, N, shift, make_divisor(div), res, out);
}
extern "C" __global__ void __launch_bounds__(256) probe_gate(GATE_PARAMS) {
  int acc_h[ACC], acc_s[ACC];
  tile_gemm<true>(h, wf, M, D, D, 0, D / 4, acc_h);
  tile_gemm<true>(s, uf, M, D, D, 0, D / 4, acc_s);
  Divisor q = make_divisor(div);
  two_sums_epilogue16<true>(acc_h, acc_s, M, D,
                            GatePiece<true>{xbh, xbs, af, au, s, bias, D, shift, q, f, g});
}
extern "C" __global__ void __launch_bounds__(256) probe_cand(CAND_PARAMS) {
  int acc_h[ACC], acc_g[ACC];
  tile_gemm<true>(h, wh, M, D, D, 0, D / 4, acc_h);
  tile_gemm<true>(g, uh, M, D, D, 0, D / 4, acc_g);
  Divisor q = make_divisor(div);
  two_sums_epilogue16<true>(acc_h, acc_g, M, D,
                            CandPiece<true>{xbh, xbg, ah, au, bias, f, D, shift, q, s, x});
}
extern "C" __global__ void __launch_bounds__(256) probe_former_mm(FORMER_MM_PARAMS) {
  __shared__ int gelus[256];
  for (int i = threadIdx.x; i < 256; i += blockDim.x) gelus[i] = gelu[i];
  int acc[ACC];
  tile_gemm<true>(x, w, R, N, K, 0, K / 4, acc);
  former_mm_epilogue16<true, true>(acc, xb, a, R, N, make_divisor(per), shift,
                                   make_divisor(div), bias, gelus, out8);
}
extern "C" __global__ void __launch_bounds__(256) probe_former_head(FORMER_HEAD_PARAMS) {
  __shared__ int exp2s[256];
  for (int i = threadIdx.x; i < 256; i += blockDim.x) exp2s[i] = exp2_table[i];
  int acc[ACC];
  tile_gemm<true>(x, w, R, V, K, 0, K / 4, acc);
  former_head_epilogue16<true, true>(acc, xb, a, R, V, per, make_divisor(per), shift,
                                     make_divisor(div), bias, tokens, exp2s, total, target);
}
"""
PROBE_KERNELS = ("probe_mm", "probe_gate", "probe_cand", "probe_former_mm", "probe_former_head")
ATTENTION_BUDGET = 2.0  # instructions per IDP.4A (scores), per multiply-add (weighted sums)
# Per multiprocessor: registers, shared memory (bytes) a block may use in all, warps.
SM_LIMITS = {"80": (65536, 164 * 1024, 64), "90": (65536, 228 * 1024, 64)}
INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def _site_file(pattern: str) -> Path:
    found = site_file(pattern)
    if found is None:
        raise SystemExit(f"not found in site-packages: {pattern} (pip install the CUDA wheels)")
    return found


def resources(log: str) -> dict[str, dict[str, int]]:
    """Per kernel: registers, smem bytes, spill stores + loads, from ptxas's -v report."""
    out: dict[str, dict[str, int]] = {}
    current = None
    for line in log.splitlines():
        if m := re.search(r"Function properties for (\w+)", line):
            current = out.setdefault(m.group(1), {"regs": 0, "smem": 0, "spill": 0})
        elif current is not None and (m := re.search(r"(\d+) bytes spill stores, (\d+)", line)):
            current["spill"] = int(m.group(1)) + int(m.group(2))
        elif current is not None and (m := re.search(r"Used (\d+) registers", line)):
            current["regs"] = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            current["smem"] = int(s.group(1)) if s else 0
    return out


def sass_by_kernel(cubin: bytes, workdir: Path) -> dict[str, str]:
    tool = shutil.which("cuobjdump") or str(_site_file("nvidia/cu*/bin/cuobjdump"))
    disasm = shutil.which("nvdisasm") or str(_site_file("nvidia/cu*/bin/nvdisasm"))
    path = workdir / "module.cubin"
    path.write_bytes(cubin)
    env = {**os.environ, "NVDISASM_PATH": disasm}  # cuobjdump runs nvdisasm
    text = subprocess.run(
        [tool, "--dump-sass", str(path)], capture_output=True, text=True, check=True, env=env
    ).stdout
    parts = re.split(r"^\s*Function : (\w+)\s*$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def instructions(sass: str) -> list[tuple[int, str]]:
    """(address, text) of each instruction of one kernel's SASS."""
    return [(int(m.group(1), 16), m.group(2)) for m in INSN.finditer(sass)]


def loop_spans(insns: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """(first, last) index of each loop: a branch back to an earlier instruction, its body."""
    index = {addr: i for i, (addr, _) in enumerate(insns)}
    spans = []
    for i, (addr, op) in enumerate(insns):
        branch = re.search(r"\bBRA(?:\.\w+)*\s+0x([0-9a-f]+)", op)
        if branch and int(branch.group(1), 16) < addr and int(branch.group(1), 16) in index:
            spans.append((index[int(branch.group(1), 16)], i))
    return spans


def perf_model(sass: str) -> dict[str, float]:
    """The static model of one tensor-core kernel (see the module docstring)."""
    insns = instructions(sass)
    loops = []
    for first, last in loop_spans(insns):
        imma = sum("IMMA" in o for _, o in insns[first : last + 1])
        if imma:
            loops.append((last, (last - first + 1) / imma))
    end = max((i for i, _ in loops), default=len(insns))
    return {
        "slots_per_imma": max((r for _, r in loops), default=float("inf")),
        "epilogue_per_output": (len(insns) - end - 1) / OUTPUTS_PER_THREAD,
        "reciprocals": sum("MUFU.RCP" in o for _, o in insns),
    }


def innermost_loops(sass: str) -> list[list[str]]:
    """The bodies of the loops that hold no other loop."""
    insns = instructions(sass)
    spans = loop_spans(insns)
    inner = [(a, b) for a, b in spans if not any(a <= c and d <= b and (c, d) != (a, b)
                                                 for c, d in spans)]  # fmt: skip
    return [[op for _, op in insns[a : b + 1]] for a, b in inner]


def attention_model(sass: str) -> dict[str, float]:
    """Instructions per IDP.4A in the score loop (the loop with the most) and per
    multiply-add (a plain IMAD) in the weighted-sum loop (the IMAD-richest loop without
    IDP.4A or a global load); infinite where no such loop is found."""
    loops = innermost_loops(sass)
    sums = [b for b in loops if not any("IDP.4A" in op or "LDG" in op for op in b)]
    scores = max(loops, key=lambda body: sum("IDP.4A" in op for op in body), default=[])
    adds = max(sums, key=lambda body: sum(op.split()[0] == "IMAD" for op in body), default=[])
    idp = sum("IDP.4A" in op for op in scores)
    imad = sum(op.split()[0] == "IMAD" for op in adds)
    return {
        "per_idp": len(scores) / idp if idp else float("inf"),
        "per_mac": len(adds) / imad if imad else float("inf"),
    }


def resident_warps(arch: str, regs: int, smem: int) -> int:
    """Warps per SM that fit by registers (allocated per warp in 256s) and shared memory
    (plus the 1 KB the driver reserves per block)."""
    reg_file, smem_sm, warps = SM_LIMITS.get(arch, SM_LIMITS["90"])
    per_warp = -(-max(regs, 1) * 32 // 256) * 256
    blocks = min(reg_file // (per_warp * BLOCK // 32), smem_sm // (smem + 1024))
    return min(blocks * BLOCK // 32, warps)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", nargs="+", default=["80", "90"])
    parser.add_argument("--sass", action="store_true", help="check IMMA / IDP.4A in the SASS")
    args = parser.parse_args()
    try:
        nvrtc = load_nvrtc()
    except NvrtcMissing as exc:
        raise SystemExit(str(exc)) from None
    failed = False
    for cu in [Path("+".join(SOURCE_FILES))]:  # one module
        source = kernel_source() + (PROBES if args.sass else "")
        table: dict[str, dict[str, str]] = {}
        for arch in args.arch:
            options = [*NVRTC_OPTIONS, *CUPY_ADDED, f"-arch=sm_{arch}", "--ptxas-options=-v"]
            got = compile_cubin(nvrtc, source, cu.name, options)
            ok, log, cubin = got.ok, got.log, got.cubin
            if not ok:
                print(f"FAIL {cu.name} sm_{arch}: NVRTC error\n{log}")
                failed = True
                continue
            usage = resources(log)
            for kernel, r in usage.items():
                cell = f"{r['regs']:3d} regs {r['smem']:5d} B smem {r['spill']} spill"
                table.setdefault(kernel, {})[arch] = cell
                if r["spill"]:
                    print(f"FAIL {cu.name} sm_{arch} {kernel}: {r['spill']} bytes spilled")
                    failed = True
            if args.sass:
                with tempfile.TemporaryDirectory() as tmp:
                    sass = sass_by_kernel(cubin, Path(tmp))
                for kernel, code in sass.items():
                    imma, dp4a = code.count("IMMA"), code.count("IDP.4A")
                    table.setdefault(kernel, {})[f"sass{arch}"] = f"IMMA {imma} IDP.4A {dp4a}"
                    tensor_cores = kernel in TENSOR_CORE_KERNELS or kernel in PROBE_KERNELS
                    if tensor_cores and int(arch) < 80:
                        continue  # no int8 mma below sm_80: those GPUs run the _dp4a twins
                    if tensor_cores and not imma:
                        print(f"FAIL {cu.name} sm_{arch} {kernel}: no IMMA instruction")
                        failed = True
                    elif tensor_cores:
                        pm, r = perf_model(code), usage[kernel]
                        warps = resident_warps(arch, r["regs"], r["smem"])
                        table[kernel][f"model{arch}"] = (
                            f"{pm['slots_per_imma']:4.1f} slots/IMMA "
                            f"{pm['epilogue_per_output']:5.1f} epi/out {warps:2d}/64 warps"
                        )
                        if pm["slots_per_imma"] > IMMA_BUDGET:
                            print(
                                f"FAIL {cu.name} sm_{arch} {kernel}: main loop at "
                                f"{pm['slots_per_imma']:.1f} instructions per IMMA "
                                f"(budget {IMMA_BUDGET:g})"
                            )
                            failed = True
                        if kernel in PROBE_KERNELS and pm["epilogue_per_output"] > EPILOGUE_BUDGET:
                            print(
                                f"FAIL {cu.name} sm_{arch} {kernel}: epilogue at "
                                f"{pm['epilogue_per_output']:.1f} instructions per output "
                                f"(budget {EPILOGUE_BUDGET:g})"
                            )
                            failed = True
                        if pm["reciprocals"] > MAGIC_NUMBERS.get(kernel, 1):
                            print(
                                f"FAIL {cu.name} sm_{arch} {kernel}: {pm['reciprocals']} "
                                "reciprocals (a software division per output?)"
                            )
                            failed = True
                    if kernel in ("former_attention", "former_attention_wide"):
                        am = attention_model(code)
                        table[kernel][f"model{arch}"] = (
                            f"{am['per_idp']:4.2f} per IDP.4A (scores) "
                            f"{am['per_mac']:4.2f} per multiply-add (sums)"
                        )
                        if kernel == "former_attention" and max(am.values()) > ATTENTION_BUDGET:
                            print(
                                f"FAIL {cu.name} sm_{arch} {kernel}: attention loops at "
                                f"{am['per_idp']:.2f} / {am['per_mac']:.2f} instructions "
                                f"(budget {ATTENTION_BUDGET:g})"
                            )
                            failed = True
                    if kernel.endswith("_dp4a") and (imma or not dp4a):
                        print(f"FAIL {cu.name} sm_{arch} {kernel}: not an IDP.4A kernel")
                        failed = True
        print(f"{cu.name}: NVRTC options {' '.join([*NVRTC_OPTIONS, *CUPY_ADDED])}")
        for kernel in sorted(table):
            cells = "  ".join(
                f"sm_{k}: {v}" if k.isdigit() else v for k, v in table[kernel].items()
            )
            print(f"  {kernel:<17} {cells}")
    print("nvrtc check:", "FAILED" if failed else "ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
