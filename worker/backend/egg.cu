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

// ---------------------------------------------------------- noise (shared/noise.py spec)

__device__ __forceinline__ u64 mix64(u64 z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
__device__ __forceinline__ u64 combine(u64 h, u64 v) {
  return mix64(h ^ mix64(v + 0x9E3779B97F4A7C15ull));
}
__device__ __forceinline__ u32 fmix32(u32 x) {
  x = (x ^ (x >> 16)) * 0x85EBCA6Bu;
  x = (x ^ (x >> 13)) * 0xC2B2AE35u;
  return x ^ (x >> 16);
}
// key(NOISE, run_seed, step, pair, tensor_id), given base = key(NOISE, run_seed, step).
__device__ __forceinline__ u64 pair_key(u64 base, u64 pair, u64 tensor_id) {
  return combine(combine(base, pair), tensor_id);
}
// kind 0 = uniform in [-15, 15], 1 = gaussian-like in [-55, 55].
__device__ __forceinline__ int noise_value(u64 key, u32 index, int kind) {
  u32 h = fmix32((u32)key ^ fmix32(index ^ (u32)(key >> 32)));
  if (kind == 0) {
    int m = (h >> 1) & 15;
    return (h & 1) ? m : -m;
  }
  int d = int(h & 255) + int((h >> 8) & 255) + int((h >> 16) & 255) + int(h >> 24) - 510;
  int mag = ((d < 0 ? -d : d) * 7) >> 6;
  return d < 0 ? -mag : mag;
}

// Noise scales (perturb.py): index j's factor in 1/64 is 0 from keep on (token noise), else
// clip(overlay[j], 0, 64) with an adaptive-noise overlay, else 64 (full scale).
__device__ __forceinline__ int noise_factor(const i8* overlay, int j, int keep) {
  if (j >= keep) return 0;
  if (!overlay) return 64;
  int f = overlay[j];
  return f < 0 ? 0 : (f > 64 ? 64 : f);
}
// sign(v) ((|v| f) >> 6): symmetric, so a pair's members stay exact mirrors.
__device__ __forceinline__ int scale_noise(int v, int f) {
  int mag = ((v < 0 ? -v : v) * f) >> 6;
  return v < 0 ? -mag : mag;
}

// out[r, j] = noise(pairs[r], tensor_id, start + j) scaled by index j's factor (noise_factor
// of overlay, null without adaptive noise, and keep), r < rows (P).
// Launch: grid (rows, ceil(count / 256)), block (256). The pair's key is computed once per
// block by thread 0 and shared.
extern "C" __global__ void noise_rows(const u64* base, const long long* pairs, u64 tensor_id,
                                      u32 start, int count, int keep, int kind,
                                      const i8* overlay, i8* out) {
  __shared__ u64 key;
  if (threadIdx.x == 0) key = pair_key(*base, (u64)pairs[blockIdx.x], tensor_id);
  __syncthreads();
  int j = blockIdx.y * blockDim.x + threadIdx.x;
  if (j < count) {
    int f = noise_factor(overlay, j, keep);
    out[(long long)blockIdx.x * count + j] = (i8)(f ? scale_noise(noise_value(key, start + j, kind), f) : 0);
  }
}

// The transposed noise of a slab of pairs for the update GEMM: out[j, q] = fitness[p] *
// noise(p, tensor_id, start + j) scaled as noise_rows scales it, p = first + q, for p < pairs
// (fitness null: weight 1), 0 for pairs <= p (zero padding of the GEMM's K), q < width.
// Launch: grid (ceil(width / 128), ceil(count / 64)), block (128): a thread owns one pair
// (one key) and 64 indices.
extern "C" __global__ void noise_cols(const u64* base, u64 tensor_id, u32 start, int count,
                                      int keep, int kind, const i8* overlay, const i8* fitness,
                                      int pairs, int first, int width, i8* out) {
  int q = blockIdx.x * blockDim.x + threadIdx.x;
  if (q >= width) return;
  int p = first + q;
  int f = p < pairs ? (fitness ? fitness[p] : 1) : 0;
  u64 key = pair_key(*base, (u64)p, tensor_id);
  int j_end = min(count, (int)(blockIdx.y + 1) * 64);
  for (int j = blockIdx.y * 64; j < j_end; j++) {
    int scale = f ? noise_factor(overlay, j, keep) : 0;
    out[(long long)j * width + q] =
        (i8)(scale ? f * scale_noise(noise_value(key, start + j, kind), scale) : 0);
  }
}

// The windows of a forward pass from the train split resident on the device:
// tokens[p, j] = train[start + j] for j < cols (seq_len + 1), start = key(DATA, data_seed,
// step, pairs[p]) mod span (shared/window.py: noise.window_offsets; data_key is
// key(DATA, data_seed, step)); train's tokens are `width` bytes each (1, 2 or 4, little-
// endian). Launch: grid (P), block (128).
extern "C" __global__ void gather_windows(const u64* data_key, const long long* pairs,
                                          const unsigned char* train, int width, long long span,
                                          int cols, int* tokens) {
  __shared__ long long start;
  if (threadIdx.x == 0) start = (long long)(combine(*data_key, (u64)pairs[blockIdx.x]) % (u64)span);
  __syncthreads();
  for (int j = threadIdx.x; j < cols; j += blockDim.x) {
    const unsigned char* t = train + (start + j) * width;
    u32 v = t[0];
    if (width > 1) v |= (u32)t[1] << 8;
    if (width > 2) v |= (u32)t[2] << 16 | (u32)t[3] << 24;
    tokens[(long long)blockIdx.x * cols + j] = (int)v;
  }
}

// u1 u2 of element j of a vector parameter's stream (indices j and n + j), scaled by its
// factor (noise_factor).
__device__ __forceinline__ int vector_noise(u64 key, int j, int n, int kind, const i8* overlay,
                                            int keep) {
  int f = noise_factor(overlay, j, keep);
  return f ? scale_noise(noise_value(key, j, kind) * noise_value(key, n + j, kind), f) : 0;
}

// A vector parameter as member m sees it: clip(param + ((sign * u) >> shift)), u the pair's
// vector_noise. out is (M, n). Launch: grid (M, ceil(n / 256)), block (256).
extern "C" __global__ void member_vector(const u64* base, const long long* pairs,
                                         u64 tensor_id, int n, int keep, int kind,
                                         const i8* overlay, const i8* param, int shift, i8* out) {
  __shared__ u64 key;
  int m = blockIdx.x;
  if (threadIdx.x == 0) key = pair_key(*base, (u64)pairs[m >> 1], tensor_id);
  __syncthreads();
  int j = blockIdx.y * blockDim.x + threadIdx.x;
  if (j < n) {
    int u = vector_noise(key, j, n, kind, overlay, keep);
    int v = param[j] + (((m & 1) ? -u : u) >> shift);
    out[(long long)m * n + j] = (i8)CLIP8(v);
  }
}

// Z[j] += sum_p fitness[p] u_p[j] (vector_noise) over pairs [y per, (y + 1) per) for block
// row y, for a vector parameter of length n; z (int64) starts zeroed (zero_i32) and the block
// rows add with integer atomics (exact in any order), so a short vector still spreads over
// the device. A block's own sum is int32: the backend keeps per * max|u| below 2**31.
// Launch: grid (ceil(n / 256), ceil(pairs / per)), block (256); the backend makes per whole
// tiles of 256 pairs, each block walking its pairs a tile at a time, a tile's keys computed
// once (one per thread) and shared.
extern "C" __global__ void vector_z(const u64* base, u64 tensor_id, int n, int keep, int kind,
                                    const i8* overlay, const i8* fitness, int pairs, int per,
                                    long long* z) {
  __shared__ u64 keys[256];
  __shared__ int fit[256];
  int j = blockIdx.x * blockDim.x + threadIdx.x;
  int begin = blockIdx.y * per, end = min(pairs, begin + per);
  int f = j < n ? noise_factor(overlay, j, keep) : 0;  // the element's scale (vector_noise)
  int acc = 0;
  for (int p0 = begin; p0 < end; p0 += 256) {
    int p = p0 + threadIdx.x;
    fit[threadIdx.x] = p < end ? fitness[p] : 0;
    keys[threadIdx.x] = pair_key(*base, (u64)p, tensor_id);
    __syncthreads();
    int tile = min(256, end - p0);
    if (f)
      for (int q = 0; q < tile; q++)
        if (fit[q])
          acc += fit[q] * scale_noise(
                              noise_value(keys[q], j, kind) * noise_value(keys[q], n + j, kind), f);
    __syncthreads();
  }
  if (j < n && acc) add_i64(z + j, acc);
}

// --------------------------------------------------------------- the forward pass

// x[m] = clip(EMB[tok] + ((sign * a_emb[pair, tok] * b_emb[pair, :]) >> shift)) for the token
// at column t (+ *pos where given: a replayed held-out step's device-side position) of the
// member's pair window, and every layer's state row reset where tok == 0.
// tokens (P, t_cols) int32; a_emb (P, V); b_emb (P, D); states (L, M, D).
// Launch: grid (M), block (128).
extern "C" __global__ void embed(const int* tokens, int t_cols, int t, const int* pos,
                                 const i8* emb, const i8* a_emb, const i8* b_emb, int M, int D,
                                 int V, int shift, i8* states, int n_layer, i8* x) {
  int m = blockIdx.x;
  long long pair = m >> 1;
  if (pos) t += *pos;
  int tok = tokens[pair * t_cols + t];
  int a = a_emb[pair * V + tok];
  if (m & 1) a = -a;
  for (int n = threadIdx.x; n < D; n += blockDim.x) {
    int v = emb[(long long)tok * D + n] + ((a * b_emb[pair * D + n]) >> shift);
    x[(long long)m * D + n] = (i8)CLIP8(v);
    if (tok == 0)
      for (int l = 0; l < n_layer; l++) states[((long long)l * M + m) * D + n] = 0;
  }
}

// The mean-absolute-value norm of row r of x (R, D) with its member's vectors w and bias
// (members', (R / per, D); bias may be null), the member being r / per:
// out[r, n] = clip(floor(x[r, n] w[n] / max(sum_k |x[r, k]| // D, 1)) + bias[n]), and with it
// the rank-1 dot products of the normed row that the next GEMMs need: xb1[r] = out[r, :] .
// b1[pair, :] (and xb2 with b2) where b1 (b2) is given, so out is not read back.
// D % 4 == 0, rows read and written as 32-bit words.
// Launch: grid (ceil(R / 8)), block (256): one warp per row, butterfly and shuffle sums.
extern "C" __global__ void mav_norm(const i8* x, const i8* w, const i8* bias, int R, int per,
                                    int D, i8* out, const i8* b1, int* xb1, const i8* b2,
                                    int* xb2) {
  int row = blockIdx.x * 8 + (threadIdx.x >> 5);
  int lane = threadIdx.x & 31;
  if (row >= R) return;  // warp-uniform: the whole warp leaves together
  int words = D / 4;
  long long member = row / per;
  const u32* xr = (const u32*)(x + (long long)row * D);
  const u32* wr = (const u32*)(w + member * D);
  const u32* br = bias ? (const u32*)(bias + member * D) : 0;
  u32* orow = (u32*)(out + (long long)row * D);
  int total = 0;
  for (int k = lane; k < words; k += 32) {
    u32 v = xr[k];
    for (int j = 0; j < 4; j++) {
      int e = (signed char)(v >> (8 * j));
      total += e < 0 ? -e : e;
    }
  }
  for (int off = 16; off > 0; off >>= 1) total += __shfl_xor_sync(0xffffffffu, total, off);
  u32 mav = small_divisor(max(total / D, 1));  // |x w| <= 2**14, the divisor <= 128
  const u32* b1r = b1 ? (const u32*)(b1 + (member >> 1) * D) : 0;
  const u32* b2r = b2 ? (const u32*)(b2 + (member >> 1) * D) : 0;
  int d1 = 0, d2 = 0;
  for (int k = lane; k < words; k += 32) {
    u32 xv = xr[k], wv = wr[k], bv = br ? br[k] : 0u, hv = 0;
    for (int j = 0; j < 4; j++) {
      int q = floor_small((signed char)(xv >> (8 * j)) * (signed char)(wv >> (8 * j)), mav);
      q += (signed char)(bv >> (8 * j));
      hv |= (u32)(CLIP8(q) & 0xff) << (8 * j);
    }
    orow[k] = hv;
    if (b1r) d1 = dp4a_s8((int)hv, (int)b1r[k], d1);
    if (b2r) d2 = dp4a_s8((int)hv, (int)b2r[k], d2);
  }
  for (int off = 16; off > 0; off >>= 1) {
    d1 += __shfl_down_sync(0xffffffffu, d1, off);
    d2 += __shfl_down_sync(0xffffffffu, d2, off);
  }
  if (lane == 0 && xb1) xb1[row] = d1;
  if (lane == 0 && xb2) xb2[row] = d2;
}

// The rank-1 dot product of each row: xb[r] = x[r, :] . b[pair, :], the row's member being
// r / per and its pair member >> 1; K % 4 == 0.
// Launch: grid (ceil(R / 8)), block (256): one warp per row, dp4a over words, a shuffle tree.
extern "C" __global__ void rowdot(const i8* x, const i8* b, int R, int per, int K, int* xb) {
  int row = blockIdx.x * 8 + (threadIdx.x >> 5);
  int lane = threadIdx.x & 31;
  if (row >= R) return;
  const int* xr = (const int*)(x + (long long)row * K);
  const int* br = (const int*)(b + (long long)(row / per >> 1) * K);
  int acc = 0;
  for (int k = lane; k < K / 4; k += 32) acc = dp4a_s8(xr[k], br[k], acc);
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
  if (lane == 0) xb[row] = acc;
}

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

// The pre-activation the gate and the candidate share, for the W outputs from accumulator i
// of row m at offsets o (members' arrays) and ao (pairs' a): clip(MM(h, W) + MM(u, U) + b),
// acc_w / acc_u the GEMMs' accumulators, xbw / xbu and aw / au their rank-1 factors.
template <bool PAIRS, bool POW2>
__device__ __forceinline__ void two_mm(const int acc_w[ACC], const int acc_u[ACC], int i, int m,
                                       long long o, long long ao, const int* xbw, const i8* aw,
                                       const int* xbu, const i8* au, const i8* bias, int shift,
                                       Divisor q, int out[2]) {
  int sw = signed_xb(xbw, m), su = signed_xb(xbu, m), a1[2], a2[2], bv[2];
  load_bytes<PAIRS>(aw + ao, a1);
  load_bytes<PAIRS>(au + ao, a2);
  load_bytes<PAIRS>(bias + o, bv);
#pragma unroll
  for (int e = 0; e < (PAIRS ? 2 : 1); e++) {
    int v = egg_mm<POW2>(acc_w[i + e], sw, a1[e], shift, q) +
            egg_mm<POW2>(acc_u[i + e], su, a2[e], shift, q);
    out[e] = CLIP8(v + bv[e]);
  }
}

// The gate of a layer: f = clip(MM(h, Wf) + MM(s, Uf) + bf_m), g = ((f + 127) s) >> 8.
template <bool TC, bool PAIRS, bool POW2>
__device__ __forceinline__ void gate_epilogue(const int acc_h[ACC], const int acc_s[ACC],
                                              const int* xbh, const i8* af, const i8* s,
                                              const int* xbs, const i8* au, int M, int D,
                                              int shift, Divisor q, const i8* bias, i8* f,
                                              i8* g) {
  const int W = PAIRS ? 2 : 1;
#pragma unroll
  for (int i = 0; i < ACC; i += W) {
    int m, n;
    if (!tile_out<TC>(i, M, D, m, n)) continue;
    long long o = (long long)m * D + n, ao = (long long)(m >> 1) * D + n;
    int sv[2], fv[2], gv[2];
    two_mm<PAIRS, POW2>(acc_h, acc_s, i, m, o, ao, xbh, af, xbs, au, bias, shift, q, fv);
    load_bytes<PAIRS>(s + o, sv);
#pragma unroll
    for (int e = 0; e < W; e++) gv[e] = ((fv[e] + 127) * sv[e]) >> 8;
    store_bytes<PAIRS>(f + o, fv);
    store_bytes<PAIRS>(g + o, gv);
  }
}

// The gate's and the candidate's epilogues through shared memory: both GEMMs' sums staged
// half a tile (64 rows) at a time, 36 KB for the two, and each thread then finishes 16
// adjacent outputs of one row by `piece` (GatePiece, CandPiece).
template <bool TC, class Piece>
__device__ __forceinline__ void two_sums_epilogue16(const int acc1[ACC], const int acc2[ACC],
                                                    int M, int D, const Piece& piece) {
  int (*s1)[STAGE_ROW] = (int (*)[STAGE_ROW])gemm_smem();
  int (*s2)[STAGE_ROW] = s1 + 64;
  int rr = threadIdx.x >> 2, c = (threadIdx.x & 3) * 16, n = blockIdx.x * TILE_N + c;
#pragma unroll
  for (int h = 0; h < 2; h++) {
    stage_sums<TC>(acc1, h, s1);
    stage_sums<TC>(acc2, h, s2);
    __syncthreads();
    int m = blockIdx.y * TILE_M + 64 * h + rr;
    if (m < M && n < D) piece(s1[rr] + c, s2[rr] + c, m, n);
    __syncthreads();  // read before the next half is staged
  }
}

// The gate's and the candidate's shared start for outputs n .. n + 15 of row m (offsets o
// in the members' arrays, ao in the pairs' a): out[k] = clip(MM(h, W) + MM(u, U) + b), from
// the two GEMMs' staged sums s1, s2, their rank-1 factors xb1 / a1 and xb2 / a2, the bias.
template <bool POW2>
__device__ __forceinline__ void two_mm16(const int* s1, const int* s2, int m, long long o,
                                         long long ao, const int* xb1, const i8* a1,
                                         const int* xb2, const i8* a2, const i8* bias,
                                         int shift, Divisor q, u32 out[4]) {
  int sx1 = signed_xb(xb1, m), sx2 = signed_xb(xb2, m);
  uint4 av1 = load16(a1 + ao), av2 = load16(a2 + ao), bv = load16(bias + o);
#pragma unroll
  for (int k0 = 0; k0 < 16; k0 += 4) {
    int4 p1 = *(const int4*)(s1 + k0), p2 = *(const int4*)(s2 + k0);
#pragma unroll
    for (int k = k0; k < k0 + 4; k++) {
      int v = egg_mm<POW2>(sum_of(p1, k - k0), sx1, lane_of(av1, k), shift, q) +
              egg_mm<POW2>(sum_of(p2, k - k0), sx2, lane_of(av2, k), shift, q);
      pack_into(out, k, CLIP8(v + lane_of(bv, k)));
    }
  }
}

template <bool POW2>
struct GatePiece {
  const int *xbh, *xbs;
  const i8 *af, *au, *s, *bias;
  int D, shift;
  Divisor q;
  i8 *f, *g;
  __device__ __forceinline__ void operator()(const int* sh, const int* ss, int m, int n) const {
    long long o = (long long)m * D + n, ao = (long long)(m >> 1) * D + n;
    u32 fw[4] = {0u, 0u, 0u, 0u}, gw[4] = {0u, 0u, 0u, 0u};
    two_mm16<POW2>(sh, ss, m, o, ao, xbh, af, xbs, au, bias, shift, q, fw);
    uint4 fv = make_uint4(fw[0], fw[1], fw[2], fw[3]), sv = load16(s + o);
#pragma unroll
    for (int k = 0; k < 16; k++) pack_into(gw, k, ((lane_of(fv, k) + 127) * lane_of(sv, k)) >> 8);
    store16(f + o, fw);
    store16(g + o, gw);
  }
};

template <bool POW2>
struct CandPiece {
  const int *xbh, *xbg;
  const i8 *ah, *au, *bias, *f;
  int D, shift;
  Divisor q;
  i8 *s, *x;
  __device__ __forceinline__ void operator()(const int* sh, const int* sg, int m, int n) const {
    long long o = (long long)m * D + n, ao = (long long)(m >> 1) * D + n;
    u32 cw[4] = {0u, 0u, 0u, 0u}, sw[4] = {0u, 0u, 0u, 0u}, xw[4] = {0u, 0u, 0u, 0u};
    two_mm16<POW2>(sh, sg, m, o, ao, xbh, ah, xbg, au, bias, shift, q, cw);
    uint4 cv = make_uint4(cw[0], cw[1], cw[2], cw[3]);
    uint4 fv = load16(f + o), sv = load16(s + o), xv = load16(x + o);
#pragma unroll
    for (int k = 0; k < 16; k++) {
      int sk = lane_of(sv, k);
      sk += ((lane_of(fv, k) + 127) * (lane_of(cv, k) - sk)) >> 8;
      pack_into(sw, k, sk);
      pack_into(xw, k, CLIP8(lane_of(xv, k) + sk));
    }
    store16(s + o, sw);
    store16(x + o, xw);
  }
};

// h, s (M, D); wf, uf (D, D); bias (M, D) the members' bf; f, g out (M, D).
// Launch: grid (ceil(D / TILE_N), ceil(M / TILE_M)), block (256).
template <bool TC>
__device__ void gate_body(const i8* h, const i8* wf, const int* xbh, const i8* af,
                          const i8* s, const i8* uf, const int* xbs, const i8* au, int M,
                          int D, int shift, int div, const i8* bias, i8* f, i8* g) {
  int acc_h[ACC], acc_s[ACC];
  tile_gemm<TC>(h, wf, M, D, D, 0, D / 4, acc_h);
  tile_gemm<TC>(s, uf, M, D, D, 0, D / 4, acc_s);
  Divisor q = make_divisor(div);
  if (D % 16 == 0 && aligned16(af, au, s) && aligned16(bias, f, g)) {
    if (q.pow2)
      two_sums_epilogue16<TC>(acc_h, acc_s, M, D,
                              GatePiece<true>{xbh, xbs, af, au, s, bias, D, shift, q, f, g});
    else
      two_sums_epilogue16<TC>(acc_h, acc_s, M, D,
                              GatePiece<false>{xbh, xbs, af, au, s, bias, D, shift, q, f, g});
    return;
  }
  bool pairs = TC && D % 2 == 0 && even_bases(af, au, s, bias, f, g);
  EPILOGUE(gate_epilogue, pairs, q.pow2, acc_h, acc_s, xbh, af, s, xbs, au, M, D, shift, q,
           bias, f, g);
}

// The candidate and the new state: c = clip(MM(h, Wh) + MM(g, Uh) + bh_m),
// s += ((f + 127) (c - s)) >> 8, x = clip(x + s). s and x are updated in place.
template <bool TC, bool PAIRS, bool POW2>
__device__ __forceinline__ void cand_epilogue(const int acc_h[ACC], const int acc_g[ACC],
                                              const int* xbh, const i8* ah, const int* xbg,
                                              const i8* au, int M, int D, int shift, Divisor q,
                                              const i8* bias, const i8* f, i8* s, i8* x) {
  const int W = PAIRS ? 2 : 1;
#pragma unroll
  for (int i = 0; i < ACC; i += W) {
    int m, n;
    if (!tile_out<TC>(i, M, D, m, n)) continue;
    long long o = (long long)m * D + n, ao = (long long)(m >> 1) * D + n;
    int cv[2], fv[2], sv[2], xv[2];
    two_mm<PAIRS, POW2>(acc_h, acc_g, i, m, o, ao, xbh, ah, xbg, au, bias, shift, q, cv);
    load_bytes<PAIRS>(f + o, fv);
    load_bytes<PAIRS>(s + o, sv);
    load_bytes<PAIRS>(x + o, xv);
#pragma unroll
    for (int e = 0; e < W; e++) {
      sv[e] += ((fv[e] + 127) * (cv[e] - sv[e])) >> 8;
      xv[e] = CLIP8(xv[e] + sv[e]);
    }
    store_bytes<PAIRS>(s + o, sv);
    store_bytes<PAIRS>(x + o, xv);
  }
}

// Launch: grid (ceil(D / TILE_N), ceil(M / TILE_M)), block (256).
template <bool TC>
__device__ void cand_body(const i8* h, const i8* wh, const int* xbh, const i8* ah,
                          const i8* g, const i8* uh, const int* xbg, const i8* au, int M,
                          int D, int shift, int div, const i8* bias, const i8* f, i8* s,
                          i8* x) {
  int acc_h[ACC], acc_g[ACC];
  tile_gemm<TC>(h, wh, M, D, D, 0, D / 4, acc_h);
  tile_gemm<TC>(g, uh, M, D, D, 0, D / 4, acc_g);
  Divisor q = make_divisor(div);
  if (D % 16 == 0 && aligned16(ah, au, bias) && aligned16(f, s, x)) {
    if (q.pow2)
      two_sums_epilogue16<TC>(acc_h, acc_g, M, D,
                              CandPiece<true>{xbh, xbg, ah, au, bias, f, D, shift, q, s, x});
    else
      two_sums_epilogue16<TC>(acc_h, acc_g, M, D,
                              CandPiece<false>{xbh, xbg, ah, au, bias, f, D, shift, q, s, x});
    return;
  }
  bool pairs = TC && D % 2 == 0 && even_bases(ah, au, bias, f, s, x);
  EPILOGUE(cand_epilogue, pairs, q.pow2, acc_h, acc_g, xbh, ah, xbg, au, M, D, shift, q, bias,
           f, s, x);
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
#define GATE_PARAMS                                                                   \
  const i8 *h, const i8 *wf, const int *xbh, const i8 *af, const i8 *s, const i8 *uf, \
      const int *xbs, const i8 *au, int M, int D, int shift, int div, const i8 *bias,  \
      i8 *f, i8 *g
#define CAND_PARAMS                                                                   \
  const i8 *h, const i8 *wh, const int *xbh, const i8 *ah, const i8 *g, const i8 *uh, \
      const int *xbg, const i8 *au, int M, int D, int shift, int div, const i8 *bias,  \
      const i8 *f, i8 *s, i8 *x
#define ZGEMM_PARAMS const i8 *x, const i8 *w, int M, int N, int K, int k_split, long long *z

extern "C" __global__ void __launch_bounds__(256) mm_tc(MM_PARAMS) {
  mm_body<true>(x, w, xb, a, M, N, K, shift, div, res, out);
}
extern "C" __global__ void __launch_bounds__(256) mm_dp4a(MM_PARAMS) {
  mm_body<false>(x, w, xb, a, M, N, K, shift, div, res, out);
}
extern "C" __global__ void __launch_bounds__(256) gate_tc(GATE_PARAMS) {
  gate_body<true>(h, wf, xbh, af, s, uf, xbs, au, M, D, shift, div, bias, f, g);
}
extern "C" __global__ void __launch_bounds__(256) gate_dp4a(GATE_PARAMS) {
  gate_body<false>(h, wf, xbh, af, s, uf, xbs, au, M, D, shift, div, bias, f, g);
}
extern "C" __global__ void __launch_bounds__(256) cand_tc(CAND_PARAMS) {
  cand_body<true>(h, wh, xbh, ah, g, uh, xbg, au, M, D, shift, div, bias, f, s, x);
}
extern "C" __global__ void __launch_bounds__(256) cand_dp4a(CAND_PARAMS) {
  cand_body<false>(h, wh, xbh, ah, g, uh, xbg, au, M, D, shift, div, bias, f, s, x);
}
extern "C" __global__ void __launch_bounds__(256) zgemm_tc(ZGEMM_PARAMS) { zgemm_body<true>(x, w, M, N, K, k_split, z); }
extern "C" __global__ void __launch_bounds__(256) zgemm_dp4a(ZGEMM_PARAMS) { zgemm_body<false>(x, w, M, N, K, k_split, z); }

// ------------------------------------------------------------------------- the loss

// floor(16 log2(total)) for 0 < total < 2**53: the exponent, then the mantissa's sixteenth
// by the reference's thresholds log2_th (15, int64).
__device__ __forceinline__ long long log2_16(long long total, const long long* log2_th) {
  int e = 63 - __clzll(total);
  u64 mant = e > 31 ? (u64)total >> (e - 31) : (u64)total << (31 - e);
  int j = 0;
  while (j < 15 && log2_th[j] <= (long long)mant) j++;
  return 16LL * e + j;
}

// loss[m] += floor(16 log2(sum_j EXP2[l[m, j] + 128])) - 64 - (l[m, target] + 128), the
// target being column t of the member's pair window. exp2_table (256) int32, log2_th (15) int64
// are the reference's tables. Launch: grid (ceil(M / 8)), block (256): one warp per row.
extern "C" __global__ void token_loss(const i8* logits, const int* tokens, int t_cols, int t,
                                      int M, int V, const int* exp2_table, const long long* log2_th,
                                      long long* loss) {
  int row = blockIdx.x * 8 + (threadIdx.x >> 5);
  int lane = threadIdx.x & 31;
  if (row >= M) return;
  const i8* l = logits + (long long)row * V;
  long long total = 0;
  for (int j = lane; j < V; j += 32) total += exp2_table[l[j] + 128];
  for (int off = 16; off > 0; off >>= 1) total += __shfl_xor_sync(0xffffffffu, total, off);
  if (lane == 0) {  // total >= 16 V > 0
    int target = tokens[(long long)(row >> 1) * t_cols + t];
    loss[row] += log2_16(total, log2_th) - 64 - (l[target] + 128);
  }
}

// Held-out scores (the unperturbed model, each window or stream a pair of identical
// members) at step s = t + *pos, predicting column s + 1: for the even row 2 p,
// hist[s, p, l + 128] += 1 for each logit l of the row and target[s, p] = the logit of the
// next token; hist (steps, P, 256) starts zeroed. The host finishes both losses from these
// counts (shared/loss.py). Launch: grid (ceil(M / 8)), block (256).
extern "C" __global__ void token_histogram(const i8* logits, const int* tokens, int t_cols, int t,
                                           const int* pos, int M, int V, int* hist,
                                           int* target) {
  int row = blockIdx.x * 8 + (threadIdx.x >> 5);
  int lane = threadIdx.x & 31;
  if (row >= M || (row & 1)) return;  // warp-uniform
  long long p = row >> 1, P = M >> 1, s = t + *pos;
  const i8* l = logits + (long long)row * V;
  int* counts = hist + (s * P + p) * 256;
  for (int j = lane; j < V; j += 32) atomicAdd(counts + l[j] + 128, 1);
  if (lane == 0) target[s * P + p] = l[tokens[p * t_cols + s + 1]];
}

// *p += 1: a replayed held-out step moves its device-side position on. Launch: (1), (1).
extern "C" __global__ void bump_i32(int* p) { *p += 1; }

// ------------------------------------------------------------------ the ztest apply

// The apply kernels' count of changed weights: a block sums its warps' ballots in shared
// memory, then adds once to *changed; with adaptive noise each weight's flag also goes to
// moved_mask (the overlays' update reads it). Every thread of the block calls both (no
// early exit).
__device__ __forceinline__ void start_count(u32* block_changed) {
  if (threadIdx.x == 0) *block_changed = 0;
  __syncthreads();
}
__device__ __forceinline__ void count_changed(int moved, int i, int n, i8* moved_mask,
                                              u32* block_changed, u64* changed) {
  if (moved_mask && i < n) moved_mask[i] = (i8)moved;
  u32 ballot = __ballot_sync(0xffffffffu, moved);
  if ((threadIdx.x & 31) == 0) atomicAdd(block_changed, (u32)__popc(ballot));
  if (__syncthreads_or(moved) && threadIdx.x == 0) atomicAdd(changed, (u64)*block_changed);
}

// w = clip(w + sign(z)) where |z| >= *threshold, in place; *changed += weights that changed.
// Launch: grid (ceil(n / 256)), block (256).
extern "C" __global__ void ztest_apply(const long long* z, const long long* threshold, int n, i8* w,
                                       u64* changed, i8* moved_mask) {
  __shared__ u32 block_changed;
  start_count(&block_changed);
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  int moved = 0;
  if (i < n) {
    long long zi = z[i];
    long long az = zi < 0 ? -zi : zi;
    int old = w[i];
    int v = old + (az >= *threshold ? (zi > 0) - (zi < 0) : 0);
    v = CLIP8(v);
    w[i] = (i8)v;
    moved = v != old;
  }
  count_changed(moved, i, n, moved_mask, &block_changed, changed);
}

// ---------------------------------------------------------------- the momentum apply

// shared/rules/momentum.py per weight, in place: M = clip(M - sign(M) (|M| >> shift) + z,
// +-(2**31 - 1)); where |M| >= *threshold, w = clip(w + sign(M)) and M -= sign(M) *
// *threshold; *changed += weights that changed. Launch: grid (ceil(n / 256)), block (256).
extern "C" __global__ void momentum_apply(const long long* z, const long long* threshold, int shift,
                                          int n, int* m, i8* w, u64* changed, i8* moved_mask) {
  __shared__ u32 block_changed;
  start_count(&block_changed);
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  int moved = 0;
  if (i < n) {
    long long mi = m[i];
    long long mag = mi < 0 ? -mi : mi;
    long long decay = mi < 0 ? -(mag >> shift) : (mag >> shift);
    long long v = mi - decay + z[i];
    const long long limit = 2147483647LL;
    v = v > limit ? limit : (v < -limit ? -limit : v);
    long long t = *threshold;
    int dir = (v >= t || -v >= t) ? (v > 0) - (v < 0) : 0;
    int old = w[i];
    int nw = CLIP8(old + dir);
    w[i] = (i8)nw;
    m[i] = (int)(v - dir * t);
    moved = nw != old;
  }
  count_changed(moved, i, n, moved_mask, &block_changed, changed);
}

// ------------------------------------------------------------------- the adamw apply

// shared/rules/adamw.py per weight, in place (its docstring has every operation): the
// moments m (int32) and v (int64), the accumulator acc (int32), at most one move of w.
// scalars = {LR_t, K_t}, this step's (device memory: the launch is captured once);
// b1, b2, wd in 2**-16, gs the gradient shift, decay 1 for matrices (decoupled weight
// decay), 0 for vectors. Launch: grid (ceil(n / 256)), block (256).
__device__ __forceinline__ long long sshift64(long long x, int s) {
  return x < 0 ? -((-x) >> s) : x >> s;
}

extern "C" __global__ void adamw_apply(const long long* z, const long long* scalars, long long b1,
                                       long long b2, long long wd, int gs, int decay, int n,
                                       int* m, long long* v, int* acc, i8* w, u64* changed,
                                       i8* moved_mask) {
  __shared__ u32 block_changed;
  start_count(&block_changed);
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  int moved = 0;
  if (i < n) {
    const long long one = 1LL << 16, r_limit = 1LL << 30, acc_limit = 2147483647LL;
    long long g = sshift64(z[i], gs);
    long long mi = sshift64((long long)m[i] * b1 + g * (one - b1), 16);
    long long vi = (v[i] * b2 + g * g * (one - b2)) >> 16;  // v >= 0
    long long root = (long long)sqrt((double)vi);  // v < 2**40: off by one at most, fixed
    root -= root * root > vi;
    root += (root + 1) * (root + 1) <= vi;
    long long am = mi < 0 ? -mi : mi;
    long long u = (am << 16) / (root + 1);
    if (mi < 0) u = -u;
    long long r = sshift64(u * scalars[1], 16);
    r = r > r_limit ? r_limit : (r < -r_limit ? -r_limit : r);
    int wi = w[i];
    if (decay) r -= wd * wi;
    long long a = acc[i] + sshift64(scalars[0] * r, 16);
    int rise = a >= one, fall = a <= -one;
    int dir = (rise && wi < 127) - (fall && wi > -127);
    a -= dir * one;
    if (rise && wi == 127) a = one;
    else if (fall && wi == -127) a = -one;
    a = a > acc_limit ? acc_limit : (a < -acc_limit ? -acc_limit : a);
    w[i] = (i8)(wi + dir);
    m[i] = (int)mi;
    v[i] = vi;
    acc[i] = (int)a;
    moved = dir != 0;
  }
  count_changed(moved, i, n, moved_mask, &block_changed, changed);
}

// ------------------------------------------------------------- the adaptive-noise overlays

// perturb.update_overlays for one tensor after its apply kernel: the overlay of each row (and
// column) whose weights moved (moved_mask, (rows, cols) int8 flags) rises by 5 up to 127, the
// others fall by 1 down to -127. A vector is rows = n, cols = 1, ov_cols null.
// Launch: grid (ceil((rows + cols) / 256)), block (256): a thread per row, then per column.
extern "C" __global__ void overlay_step(const i8* moved_mask, int rows, int cols, i8* ov_rows,
                                        i8* ov_cols) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  int any = 0;
  i8* ov;
  if (i < rows) {
    const i8* row = moved_mask + (long long)i * cols;
    for (int c = 0; c < cols && !any; c++) any = row[c];
    ov = ov_rows + i;
  } else if (i < rows + cols && ov_cols) {
    int c = i - rows;
    for (int r = 0; r < rows && !any; r++) any = moved_mask[(long long)r * cols + c];
    ov = ov_cols + c;
  } else {
    return;
  }
  int v = *ov;
  *ov = (i8)(any ? min(v + 5, 127) : max(v - 1, -127));
}
