// common.cuh: the types, CLIP8, the Divisor and the hardware helpers every kernel file
// uses. The backend compiles its sources as one module, joined in this order
// (cupy_kernels.SOURCE_FILES): common.cuh, noise.cu, gemm.cu, egg.cu, loss.cu, rules.cu,
// former.cu, digest.cu, generate.cu, former_generate.cu. A file uses only what the files
// before it define; none includes another (NVRTC gets one source and no include path).
//
// Kernels of the CuPy backend: the EGG model's forward pass and the ztest update, in int8
// and int32 only, matching shared/ (noise.py, perturb.py, egg.py, loss.py, update.py and
// rules/ztest.py) bit for bit.
//
// One source, three compilers: NVRTC (cupy.RawModule) on a GPU, NVRTC for the sm_80/sm_90
// resource check in CI, and g++ through the test suite's CPU emulation layer, which defines
// __CUDAEMU__. NVRTC has no host headers, so only built-in types appear here. Each hardware
// instruction is reached through one small helper (dp4a_s8, mma_s8_16832) whose CPU twin the
// emulation layer provides.
//
// Conventions: row-major arrays; a member m belongs to pair m >> 1 and carries the pair's
// noise with sign +1 (even m) or -1 (odd m); int8 rows whose length K is read as 32-bit
// words need K % 4 == 0 and 4-byte aligned rows (the backend checks both). Every kernel's
// launch shape is written above it; the backend's table of signatures mirrors the parameters.

typedef unsigned long long u64;
typedef unsigned int u32;
typedef signed char i8;

#define CLIP8(v) ((v) < -127 ? -127 : ((v) > 127 ? 127 : (v)))

// floor(v / d) for a fixed d >= 1 without a division per element: a multiply-high by d's
// magic number on |v| folded to unsigned (v ^ (v >> 31) is v, or -v - 1 for v < 0, and
// floor(v / d) = -1 - floor((-v - 1) / d) there). Granlund and Montgomery's round-up method,
// exact for every 32-bit unsigned numerator.
// A power of two d = 2**l (pow2) is one arithmetic shift instead: the epilogues take that
// path as a template (floor_div<true>) when the kernel's divisor is one, as every preset's is.
struct Divisor {
  u32 magic;
  int s1, s2;
  bool pow2;
  int l;
};

__device__ __forceinline__ Divisor make_divisor(int d) {
  int l = 32 - __clz(d - 1);  // ceil(log2 d)
  u64 magic = ((((u64)1 << l) - (u64)d) << 32) / (u64)d + 1;
  Divisor q = {(u32)magic, l < 1 ? l : 1, l > 1 ? l - 1 : 0, (d & (d - 1)) == 0, l};
  return q;
}

__device__ __forceinline__ int floor_by(int v, Divisor q) {
  int s = v >> 31;
  u32 u = (u32)(v ^ s);
  u32 t = __umulhi(q.magic, u);
  return (int)((t + ((u - t) >> q.s1)) >> q.s2) ^ s;
}

template <bool POW2>
__device__ __forceinline__ int floor_div(int v, Divisor q) {
  return POW2 ? v >> q.l : floor_by(v, q);
}

// floor(v / d) where |v| d < 2**31 (the norm's products of two int8 and a mean of int8
// magnitudes): one 32-bit multiply-high by m = ceil(2**31 / d) on 2 |v| folded as above, and
// m from a 32-bit division. With e = m d - 2**31 < d, 2u m / 2**32 = u / d + u e / (d 2**31)
// and u e < u d < 2**31, so the floor is exact; m fits 32 bits even for d = 1.
__device__ __forceinline__ u32 small_divisor(int d) { return 0x7FFFFFFFu / (u32)d + 1u; }

__device__ __forceinline__ int floor_small(int v, u32 m) {
  int s = v >> 31;
  return (int)__umulhi(m, (u32)(v ^ s) << 1) ^ s;
}

// ------------------------------------------------------------------ hardware helpers

// *p += v for int64, by the unsigned 64-bit atomic: two's complement sums are exact mod 2**64.
__device__ __forceinline__ void add_i64(long long* p, long long v) {
  atomicAdd((unsigned long long*)p, (unsigned long long)v);
}

// Four int8 products summed into c (IDP.4A).
__device__ __forceinline__ int dp4a_s8(int a, int b, int c) { return __dp4a(a, b, c); }

// d += A (16 x 32, row) B (32 x 8, col) on int8 tensor cores, int32 accumulate (IMMA).
// Fragments as in the PTX ISA: lane = 4 g + t; a[r] holds A[g + 8 (r & 1)][4 t + 16 (r >> 1)
// + 0..3]; b[r] holds B[4 t + 16 r + 0..3][g]; d[i] is D[g + 8 (i >> 1)][2 t + (i & 1)].
__device__ __forceinline__ void mma_s8_16832(int d[4], const u32 a[4], const u32 b[2]) {
#ifdef __CUDAEMU__
  cudaemu_mma_m16n8k32_s8(d, a, b);
#elif __CUDA_ARCH__ < 800
  __trap();  // the _tc kernels are never launched below sm_80 (the backend takes _dp4a)
#else
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// Four 8 x 8 matrices of 16-bit elements from shared memory (LDSM.x4): lane L gives the
// 16-byte row L % 8 of matrix L / 8; lane 4 g + t receives word t of row g of matrix i in
// r[i]. Exactly an m16n8k32 A fragment (or two B fragments) from row-major int8 tiles.
__device__ __forceinline__ void ldsm_x4(u32 r[4], const u32* row) {
#ifdef __CUDAEMU__
  int lane = threadIdx.x & 31;
  for (int i = 0; i < 4; i++) {
    const u32* src = __shfl_sync(0xffffffffu, row, 8 * i + (lane >> 2));
    r[i] = src[lane & 3];
  }
#elif __CUDA_ARCH__ < 800
  __trap();  // only the _tc kernels load fragments, and they need sm_80
#else
  u32 addr = (u32)__cvta_generic_to_shared(row);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
#endif
}

// 16 bytes global -> shared without passing through registers (cp.async), the bytes past
// `bytes` (0 or 16) zero-filled. Completed by cp_wait (this thread's copies) and then a
// barrier (everyone's). The CPU twin copies at once, which is what a waited copy looks like.
__device__ __forceinline__ void cp_async16(u32* dst, const u32* src, int bytes) {
#if defined(__CUDAEMU__) || __CUDA_ARCH__ < 800  // before sm_80: a plain copy
  uint4 v = make_uint4(0u, 0u, 0u, 0u);
  if (bytes) v = *(const uint4*)src;
  *(uint4*)dst = v;
#else
  u32 d = (u32)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(bytes)
               : "memory");
#endif
}
__device__ __forceinline__ void cp_commit() {
#if !defined(__CUDAEMU__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
template <int PENDING>
__device__ __forceinline__ void cp_wait() {  // all but the last PENDING groups have landed
#if !defined(__CUDAEMU__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
#endif
}
