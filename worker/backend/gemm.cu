// gemm.cu (perturb.py's MM, shared/update.py's Z): the int8 GEMM core every
// architecture's matrix kernels share, the MM epilogues with their kernels, and the update's
// Z GEMM. After common.cuh; egg.cu and former.cu build on it.

// ------------------------------------------------------------- the int8 GEMM core
// acc = x (M x K) . w (N x K)^T over K words [kw_begin, kw_end) for one 128 x 64 output tile
// per block of 256 threads (8 warps), zero-padded past M, N and kw_end (K % 4 == 0).
// K moves through shared memory in stages of 64 bytes, three buffers deep: two stages are in
// flight (cp.async) while the warps multiply the third, one barrier per stage. Fragments come
// from shared memory by ldmatrix. The asynchronous 16-byte copies need every row 16-byte
// aligned (K % 16 == 0 and aligned bases); otherwise each piece is four guarded 4-byte loads.
// Each thread owns 32 accumulators; tile_pos says where accumulator i sits in the tile:
//   tensor cores: warp w holds rows 32 (w % 4) + [0, 32) and columns 32 (w / 4) + [0, 32) as
//                 2 x 4 m16n8 fragments (i = 16 mi + 4 nj + d), d in the mma layout;
//   dp4a twin:    thread t holds column t % 64 of rows t / 64 + 4 i.
#define TILE_M 128
#define TILE_N 64
#define STAGE_W 16          // K words (4 int8 each) per stage: two m16n8k32 steps
#define ROW_W (STAGE_W + 4)  // +4 words per row: ldmatrix's 8 rows hit 32 distinct banks
#define STAGES 3            // shared-memory buffers: two stages load while one multiplies
#define ACC 32

template <bool TC>
__device__ __forceinline__ void tile_pos(int i, int& r, int& c) {
  int tid = threadIdx.x;
  if (TC) {
    int warp = tid >> 5, g = (tid & 31) >> 2, t = tid & 3, d = i & 3;
    r = (warp & 3) * 32 + (i >> 4) * 16 + g + 8 * (d >> 1);
    c = (warp >> 2) * 32 + ((i >> 2) & 3) * 8 + 2 * t + (d & 1);
  } else {
    r = (tid >> 6) + 4 * i;
    c = tid & 63;
  }
}

// Accumulator i's output (m, n) in the M x N result; false past its edges.
template <bool TC>
__device__ __forceinline__ bool tile_out(int i, int M, int N, int& m, int& n) {
  int r, c;
  tile_pos<TC>(i, r, c);
  m = blockIdx.y * TILE_M + r;
  n = blockIdx.x * TILE_N + c;
  return m < M && n < N;
}

// Four K words of `row` from word kw on, each guarded: zero past `rows` and past kw_end (the
// load path of rows that are not 16-byte aligned).
__device__ __forceinline__ uint4 load_piece(const u32* base, int rows, int row, int kwords,
                                            int kw, int kw_end) {
  uint4 v = make_uint4(0u, 0u, 0u, 0u);
  if (row < rows && kw < kw_end) {
    const u32* p = base + (long long)row * kwords + kw;
    v.x = p[0];
    if (kw + 1 < kw_end) v.y = p[1];
    if (kw + 2 < kw_end) v.z = p[2];
    if (kw + 3 < kw_end) v.w = p[3];
  }
  return v;
}

// acc += the stage in X (TILE_M rows) and W (TILE_N rows), STAGE_W words each.
template <bool TC>
__device__ __forceinline__ void stage_mma(const u32 (*X)[ROW_W], const u32 (*W)[ROW_W],
                                          int acc[ACC]) {
  int tid = threadIdx.x;
  if (TC) {
    int warp = tid >> 5, lane = tid & 31;
    // this lane's row of the ldmatrix loads: A (x) rows 32 (warp % 4) + [0, 32), B (w) rows
    // 32 (warp / 4) + [0, 32), as ldsm_x4 wants them for whole fragments
    int arow = (warp & 3) * 32 + 8 * ((lane >> 3) & 1) + (lane & 7), aword = 4 * (lane >> 4);
    int brow = (warp >> 2) * 32 + 8 * (lane >> 4) + (lane & 7), bword = 4 * ((lane >> 3) & 1);
#pragma unroll
    for (int ks = 0; ks < STAGE_W; ks += 8) {
      u32 af[2][4], bf[4][2];
#pragma unroll
      for (int mi = 0; mi < 2; mi++) ldsm_x4(af[mi], X[arow + 16 * mi] + ks + aword);
#pragma unroll
      for (int np = 0; np < 2; np++) {
        u32 r[4];
        ldsm_x4(r, W[brow + 16 * np] + ks + bword);
        bf[2 * np][0] = r[0];
        bf[2 * np][1] = r[1];
        bf[2 * np + 1][0] = r[2];
        bf[2 * np + 1][1] = r[3];
      }
#pragma unroll
      for (int mi = 0; mi < 2; mi++)
#pragma unroll
        for (int nj = 0; nj < 4; nj++) mma_s8_16832(acc + 16 * mi + 4 * nj, af[mi], bf[nj]);
    }
  } else {
    int r0 = tid >> 6, c = tid & 63;
#pragma unroll 4
    for (int k = 0; k < STAGE_W; k++) {
      int wv = (int)W[c][k];
#pragma unroll
      for (int i = 0; i < ACC; i++) acc[i] = dp4a_s8((int)X[r0 + 4 * i][k], wv, acc[i]);
    }
  }
}

// This thread's three pieces of the stage at word kw into X, W: rows lr and lr + 64 of x,
// row lr of w, words lq.. of the stage. Asynchronous on the 16-byte path, plain loads else.
template <bool VEC>
__device__ __forceinline__ void load_stage(u32 (*X)[ROW_W], u32 (*W)[ROW_W], const u32* xw,
                                           const u32* ww, int M, int N, int m0, int n0,
                                           int kwords, int kw, int kw_end) {
  int lr = threadIdx.x >> 2, lq = (threadIdx.x & 3) * 4;
  u32* dst[3] = {&X[lr][lq], &X[lr + 64][lq], &W[lr][lq]};
  const u32* base[3] = {xw, xw, ww};
  int rows[3] = {M, M, N}, row[3] = {m0 + lr, m0 + lr + 64, n0 + lr};
#pragma unroll
  for (int i = 0; i < 3; i++) {
    if (VEC) {
      bool in = row[i] < rows[i] && kw + lq < kw_end;
      cp_async16(dst[i], in ? base[i] + (long long)row[i] * kwords + kw + lq : base[i],
                 in ? 16 : 0);
    } else {
      *(uint4*)dst[i] = load_piece(base[i], rows[i], row[i], kwords, kw + lq, kw_end);
    }
  }
}

// The main loop, its load path fixed at compile time (VEC: cp.async 16-byte pieces).
template <bool TC, bool VEC>
__device__ __forceinline__ void tile_loop(u32 (*xs)[TILE_M][ROW_W], u32 (*ws)[TILE_N][ROW_W],
                                          const u32* xw, const u32* ww, int M, int N, int K,
                                          int kw_begin, int kw_end, int acc[ACC]) {
  int kwords = K / 4, m0 = blockIdx.y * TILE_M, n0 = blockIdx.x * TILE_N;
  int n_stages = (kw_end - kw_begin + STAGE_W - 1) / STAGE_W;
#pragma unroll
  for (int i = 0; i < ACC; i++) acc[i] = 0;
  // STAGES - 1 stages in flight ahead of the one being multiplied; one group per stage
  for (int s = 0; s < STAGES - 1; s++) {
    if (s < n_stages)
      load_stage<VEC>(xs[s], ws[s], xw, ww, M, N, m0, n0, kwords, kw_begin + s * STAGE_W,
                      kw_end);
    cp_commit();
  }
  for (int s = 0; s < n_stages; s++) {
    cp_wait<STAGES - 2>();  // stage s has landed for this thread,
    __syncthreads();        // for all threads; and stage s - 1's buffer is no longer read
    int ahead = s + STAGES - 1;
    if (ahead < n_stages)
      load_stage<VEC>(xs[ahead % STAGES], ws[ahead % STAGES], xw, ww, M, N, m0, n0, kwords,
                      kw_begin + ahead * STAGE_W, kw_end);
    cp_commit();
    stage_mma<TC>(xs[s % STAGES], ws[s % STAGES], acc);
  }
}

// The GEMM's shared memory, one block for all its users in a kernel: tile_gemm's stages,
// then the epilogue's staged sums (stage_sums) once the main loop is done with them.
#define GEMM_SMEM_WORDS (STAGES * (TILE_M + TILE_N) * ROW_W)
__device__ __forceinline__ u32* gemm_smem() {
  __shared__ __align__(16) u32 smem[GEMM_SMEM_WORDS];
  return smem;
}

template <bool TC>
__device__ void tile_gemm(const i8* x, const i8* w, int M, int N, int K, int kw_begin,
                          int kw_end, int acc[ACC]) {
  u32 (*xs)[TILE_M][ROW_W] = (u32 (*)[TILE_M][ROW_W])gemm_smem();
  u32 (*ws)[TILE_N][ROW_W] = (u32 (*)[TILE_N][ROW_W])(gemm_smem() + STAGES * TILE_M * ROW_W);
  const u32* xw = (const u32*)x;
  const u32* ww = (const u32*)w;
  if ((K & 15) == 0 && (((unsigned long long)x | (unsigned long long)w) & 15) == 0)
    tile_loop<TC, true>(xs, ws, xw, ww, M, N, K, kw_begin, kw_end, acc);
  else
    tile_loop<TC, false>(xs, ws, xw, ww, M, N, K, kw_begin, kw_end, acc);
  __syncthreads();  // the buffers are free for the kernel's next tile_gemm
}

// MM(x, W) of the reference for one output, from the base GEMM's accumulator, the member's
// signed rank-1 dot product sxb = sign * xb[m] and its pair's a[n]:
// clip(floor((acc + ((sxb * a) >> shift)) / div)).
template <bool POW2>
__device__ __forceinline__ int egg_mm(int acc, int sxb, int a, int shift, Divisor div) {
  int q = floor_div<POW2>(acc + ((sxb * a) >> shift), div);
  return CLIP8(q);
}

__device__ __forceinline__ int signed_xb(const int* xb, int m) {
  return (m & 1) ? -xb[m] : xb[m];
}

// An epilogue in its variant, fixed at compile time: byte pairs where they apply (below), and
// the floor division a shift where the divisor is a power of two.
#define EPILOGUE(fn, pairs, pow2, ...)  \
  do {                                  \
    if ((pairs) && (pow2))              \
      fn<TC, true, true>(__VA_ARGS__);  \
    else if (pairs)                     \
      fn<TC, true, false>(__VA_ARGS__); \
    else if (pow2)                      \
      fn<TC, false, true>(__VA_ARGS__); \
    else                                \
      fn<TC, false, false>(__VA_ARGS__); \
  } while (0)

// The epilogues work on W adjacent outputs of one row: on the tensor-core layout accumulators
// i and i + 1 are columns n and n + 1, so with an even row length and even bases (PAIRS) each
// int8 input and output moves as one 16-bit access, half the memory instructions.
template <bool PAIRS>
__device__ __forceinline__ void load_bytes(const i8* p, int v[2]) {
  if (PAIRS) {
    char2 t = *(const char2*)p;
    v[0] = t.x;
    v[1] = t.y;
  } else {
    v[0] = *p;
  }
}

template <bool PAIRS>
__device__ __forceinline__ void store_bytes(i8* p, const int v[2]) {
  if (PAIRS)
    *(char2*)p = make_char2((signed char)v[0], (signed char)v[1]);
  else
    *p = (i8)v[0];
}

__device__ __forceinline__ bool even_bases(const void* a, const void* b, const void* c,
                                           const void* d, const void* e, const void* f) {
  return ((unsigned long long)a | (unsigned long long)b | (unsigned long long)c |
          (unsigned long long)d | (unsigned long long)e | (unsigned long long)f) %
             2 ==
         0;
}

// The epilogues through shared memory (where every row length is a multiple of 16 and every
// base 16-byte aligned): the tile's sums are staged as st[r][c], then each thread finishes
// 16 adjacent outputs of a row, each int8 input and output moving 16 bytes per access and
// the row's rank-1 factor read once. STAGE_ROW pads a row by 8 words: the tensor-core
// layout's 8-byte writes then hit distinct banks. 128 rows take 36 KB of gemm_smem.
#define STAGE_ROW (TILE_N + 8)
static_assert(TILE_M * STAGE_ROW <= GEMM_SMEM_WORDS, "the staged tile fits gemm_smem");
// Rows [64 h, 64 h + 64) of the tile into st[0, 64) (h = -1: all 128 rows into st).
template <bool TC>
__device__ __forceinline__ void stage_sums(const int acc[ACC], int h, int (*st)[STAGE_ROW]) {
#pragma unroll
  for (int i = 0; i < ACC; i += TC ? 2 : 1) {
    int r, c;
    tile_pos<TC>(i, r, c);
    if (h >= 0 && (r >> 6) != h) continue;
    int* dst = &st[h >= 0 ? r & 63 : r][c];
    if (TC)  // accumulators i, i + 1 are columns c, c + 1 of one row, c even
      *(int2*)dst = make_int2(acc[i], acc[i + 1]);
    else
      *dst = acc[i];
  }
}

// All the tile's sums staged in gemm_smem (after tile_gemm's closing barrier), visible to
// every thread of the block when this returns.
template <bool TC>
__device__ __forceinline__ int (*stage_tile(const int acc[ACC]))[STAGE_ROW] {
  int (*st)[STAGE_ROW] = (int (*)[STAGE_ROW])gemm_smem();
  stage_sums<TC>(acc, -1, st);
  __syncthreads();
  return st;
}

__device__ __forceinline__ bool aligned16(const void* a, const void* b, const void* c) {
  return (((unsigned long long)a | (unsigned long long)b | (unsigned long long)c) & 15) == 0;
}

// 16 int8 kept packed in 4 words while a piece is finished (a 16-byte access each way): byte
// k is lane_of(q, k); results are packed into words as they are made (pack_into).
__device__ __forceinline__ uint4 load16(const i8* p) { return *(const uint4*)p; }
__device__ __forceinline__ void store16(i8* p, const u32 w[4]) {
  *(uint4*)p = make_uint4(w[0], w[1], w[2], w[3]);
}
__device__ __forceinline__ int lane_of(const uint4& q, int k) {
  u32 w = (k >> 2) == 0 ? q.x : (k >> 2) == 1 ? q.y : (k >> 2) == 2 ? q.z : q.w;
  return (signed char)(w >> (8 * (k & 3)));
}
__device__ __forceinline__ int sum_of(const int4& s, int j) {
  return j == 0 ? s.x : j == 1 ? s.y : j == 2 ? s.z : s.w;
}
__device__ __forceinline__ void pack_into(u32 w[4], int k, int v) {
  w[k >> 2] |= (u32)(v & 0xff) << (8 * (k & 3));
}

// Outputs n .. n + 15 of row m from its staged sums: out = clip(res + MM) (res given) or MM.
template <bool POW2>
__device__ __forceinline__ void mm_piece16(const int* sums, int m, int n, int N, const int* xb,
                                           const i8* a, int shift, Divisor q, const i8* res,
                                           i8* out) {
  long long o = (long long)m * N + n;
  int sxb = signed_xb(xb, m);
  uint4 av = load16(a + (long long)(m >> 1) * N + n);
  uint4 rv = res ? load16(res + o) : make_uint4(0u, 0u, 0u, 0u);
  u32 ow[4] = {0u, 0u, 0u, 0u};
#pragma unroll
  for (int k0 = 0; k0 < 16; k0 += 4) {
    int4 s4 = *(const int4*)(sums + k0);
#pragma unroll
    for (int k = k0; k < k0 + 4; k++) {
      int v = egg_mm<POW2>(sum_of(s4, k - k0), sxb, lane_of(av, k), shift, q);
      if (res) v = CLIP8(lane_of(rv, k) + v);
      pack_into(ow, k, v);
    }
  }
  store16(out + o, ow);
}

// Each thread takes columns 16 (t % 4) .. + 15 of tile rows t / 4 and t / 4 + 64.
template <bool TC, bool POW2>
__device__ __forceinline__ void mm_epilogue16(const int acc[ACC], const int* xb, const i8* a,
                                              int M, int N, int shift, Divisor q,
                                              const i8* res, i8* out) {
  int (*st)[STAGE_ROW] = stage_tile<TC>(acc);
  int c = (threadIdx.x & 3) * 16, n = blockIdx.x * TILE_N + c;
#pragma unroll
  for (int h = 0; h < 2; h++) {
    int r = (threadIdx.x >> 2) + 64 * h, m = blockIdx.y * TILE_M + r;
    if (m < M && n < N) mm_piece16<POW2>(&st[r][c], m, n, N, xb, a, shift, q, res, out);
  }
}

// out = clip(res + MM(x, W)) where res is given (the residual of W2), else MM(x, W).
template <bool TC, bool PAIRS, bool POW2>
__device__ __forceinline__ void mm_epilogue(const int acc[ACC], const int* xb, const i8* a,
                                            int M, int N, int shift, Divisor q, const i8* res,
                                            i8* out) {
  const int W = PAIRS ? 2 : 1;
#pragma unroll
  for (int i = 0; i < ACC; i += W) {
    int m, n;
    if (!tile_out<TC>(i, M, N, m, n)) continue;  // PAIRS: N even, so n + 1 < N too
    long long o = (long long)m * N + n;
    int sxb = signed_xb(xb, m), av[2], rv[2] = {0, 0}, v[2];
    load_bytes<PAIRS>(a + (long long)(m >> 1) * N + n, av);
    if (res) load_bytes<PAIRS>(res + o, rv);
#pragma unroll
    for (int e = 0; e < W; e++) {
      v[e] = egg_mm<POW2>(acc[i + e], sxb, av[e], shift, q);
      if (res) v[e] = CLIP8(rv[e] + v[e]);
    }
    store_bytes<PAIRS>(out + o, v);
  }
}

// x (M, K), w (N, K), xb (M), a (P, N), res/out (M, N); res may be out itself.
// Launch: grid (ceil(N / TILE_N), ceil(M / TILE_M)), block (256).
template <bool TC>
__device__ void mm_body(const i8* x, const i8* w, const int* xb, const i8* a, int M, int N,
                        int K, int shift, int div, const i8* res, i8* out) {
  int acc[ACC];
  tile_gemm<TC>(x, w, M, N, K, 0, K / 4, acc);
  Divisor q = make_divisor(div);
  if (N % 16 == 0 && aligned16(a, res, out)) {
    if (q.pow2)
      mm_epilogue16<TC, true>(acc, xb, a, M, N, shift, q, res, out);
    else
      mm_epilogue16<TC, false>(acc, xb, a, M, N, shift, q, res, out);
    return;
  }
  bool pairs = TC && N % 2 == 0 && even_bases(a, res, out, a, a, a);
  EPILOGUE(mm_epilogue, pairs, q.pow2, acc, xb, a, M, N, shift, q, res, out);
}

// The update's GEMM: z += x (M x K) . w (N x K)^T, raw int64 (M, N), split over K: block z
// of the grid sums K words [z k_split, (z + 1) k_split) in int32 and adds its tile into z with
// integer atomics (exact and order-free), so a small output still fills the device and any
// population sums exactly. k_split is a multiple of STAGE_W that keeps a block's sums in
// int32 (the backend's z_split); z starts zeroed (zero_i32).
// Launch: grid (ceil(N / TILE_N), ceil(M / TILE_M), ceil(K / 4 / k_split)), block (256).
template <bool TC>
__device__ void zgemm_body(const i8* x, const i8* w, int M, int N, int K, int k_split,
                           long long* z) {
  int acc[ACC];
  int kw_begin = blockIdx.z * k_split, kw_end = min(K / 4, kw_begin + k_split);
  tile_gemm<TC>(x, w, M, N, K, kw_begin, kw_end, acc);
#pragma unroll
  for (int i = 0; i < ACC; i++) {
    int m, n;
    if (tile_out<TC>(i, M, N, m, n) && acc[i]) add_i64(z + (long long)m * N + n, acc[i]);
  }
}

// z[0, n) = 0. Launch: grid (ceil(n / 256)), block (256).
extern "C" __global__ void zero_i32(int* z, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) z[i] = 0;
}

// Tensor-core kernels (suffix _tc) and their __dp4a twins (suffix _dp4a): same arguments,
// same launch shape, same results. 256 threads a block (__launch_bounds__: no spills).
#define MM_PARAMS                                                                         \
  const i8 *x, const i8 *w, const int *xb, const i8 *a, int M, int N, int K, int shift, \
      int div, const i8 *res, i8 *out
#define ZGEMM_PARAMS const i8 *x, const i8 *w, int M, int N, int K, int k_split, long long *z

extern "C" __global__ void __launch_bounds__(256) mm_tc(MM_PARAMS) {
  mm_body<true>(x, w, xb, a, M, N, K, shift, div, res, out);
}
extern "C" __global__ void __launch_bounds__(256) mm_dp4a(MM_PARAMS) {
  mm_body<false>(x, w, xb, a, M, N, K, shift, div, res, out);
}
extern "C" __global__ void __launch_bounds__(256) zgemm_tc(ZGEMM_PARAMS) { zgemm_body<true>(x, w, M, N, K, k_split, z); }
extern "C" __global__ void __launch_bounds__(256) zgemm_dp4a(ZGEMM_PARAMS) { zgemm_body<false>(x, w, M, N, K, k_split, z); }
