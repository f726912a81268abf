// Kernels of the former's forward pass (shared/former.py), matching it bit for bit. They are
// compiled in one module after the shared sources (common.cuh, noise.cu, gemm.cu, loss.cu)
// and use their divisor, GEMM core and loss helpers.
//
// Rows: member m's T positions are rows m T .. m T + T - 1 of every (R, n) activation, R = M T;
// kernels take per = T. A row's member is r / per, its pair member >> 1, its sign the member's
// parity (even +, odd -). Windows are (P, T + 1) int32 per pair: row r reads the token at
// column t = r % T and predicts the one at t + 1. Vector parameters come per member, (M, n).

// x[r] = clip(EMB[tok] + ((sign * a_emb[pair, tok] * b_emb[pair, :]) >> shift) + bias[m, :]):
// the tied embedding's one noise stream, row tok of the perturbed matrix, plus emb_bias.
// Launch: grid (R), block (128).
extern "C" __global__ void former_embed(const int* tokens, int per, const i8* emb,
                                        const i8* a_emb, const i8* b_emb, const i8* bias,
                                        int D, int V, int shift, i8* x) {
  long long r = blockIdx.x;
  long long m = r / per, pair = m >> 1;
  int tok = tokens[pair * (per + 1) + (r - m * per)];
  int a = a_emb[pair * V + tok];
  if (m & 1) a = -a;
  for (int n = threadIdx.x; n < D; n += blockDim.x) {
    int v = emb[(long long)tok * D + n] + ((a * b_emb[pair * D + n]) >> shift) + bias[m * D + n];
    x[r * D + n] = (i8)CLIP8(v);
  }
}

// The former's MM for one output from its GEMM accumulator: row r's member by the magic
// number of per, the rank-1 correction with the member's sign, clipped (egg_mm).
template <bool POW2>
__device__ __forceinline__ int former_mm_out(int acc, int r, int n, int N, const int* xb,
                                             const i8* a, Divisor per, int shift, Divisor q,
                                             long long& member) {
  member = floor_by(r, per);
  int sxb = (member & 1) ? -xb[r] : xb[r];
  return egg_mm<POW2>(acc, sxb, a[(member >> 1) * N + n], shift, q);
}

// MM(x, W) for rows of x (R, K), W (N, K), with xb (R) the rows' dots with b and a (P, N):
//   gelu given (the MLP's up projection): out8 = GELU[clip(MM + bias[m]) + 128];
//   else out8 = MM, clipped (the renorm adds the residual and bias and rotates from there).
// Launch: grid (ceil(N / TILE_N), ceil(R / TILE_M)), block (256).
template <bool TC, bool POW2>
__device__ __forceinline__ void former_mm_epilogue(const int acc[ACC], const int* xb,
                                                   const i8* a, int R, int N, Divisor rows,
                                                   int shift, Divisor q, const i8* bias,
                                                   const int* gelu, i8* out8) {
#pragma unroll
  for (int i = 0; i < ACC; i++) {
    int r, n;
    if (!tile_out<TC>(i, R, N, r, n)) continue;
    long long m;
    int v = former_mm_out<POW2>(acc[i], r, n, N, xb, a, rows, shift, q, m);
    out8[(long long)r * N + n] = (i8)(gelu ? gelu[CLIP8(v + bias[m * N + n]) + 128] : v);
  }
}

// The same through shared memory (N % 16 == 0, 16-byte aligned bases): the tile's sums
// staged whole, each thread finishes outputs n .. n + 15 of rows t / 4 and t / 4 + 64, the
// row's member and sign once, a and bias in 16-byte loads, out8 in one 16-byte store, GELU
// from a copy in shared memory.
template <bool TC, bool POW2>
__device__ __forceinline__ void former_mm_epilogue16(const int acc[ACC], const int* xb,
                                                     const i8* a, int R, int N, Divisor rows,
                                                     int shift, Divisor q, const i8* bias,
                                                     const int* gelus, i8* out8) {
  int (*st)[STAGE_ROW] = stage_tile<TC>(acc);
  int c = (threadIdx.x & 3) * 16, n = blockIdx.x * TILE_N + c;
#pragma unroll
  for (int h = 0; h < 2; h++) {
    int rr = (threadIdx.x >> 2) + 64 * h, r = blockIdx.y * TILE_M + rr;
    if (r >= R || n >= N) continue;
    long long m = floor_by(r, rows);
    int sxb = (m & 1) ? -xb[r] : xb[r];
    uint4 av = load16(a + (m >> 1) * N + n);
    uint4 bv = gelus ? load16(bias + m * N + n) : make_uint4(0u, 0u, 0u, 0u);
    u32 ow[4] = {0u, 0u, 0u, 0u};
#pragma unroll
    for (int k0 = 0; k0 < 16; k0 += 4) {
      int4 s4 = *(const int4*)(&st[rr][c] + k0);
#pragma unroll
      for (int k = k0; k < k0 + 4; k++) {
        int v = egg_mm<POW2>(sum_of(s4, k - k0), sxb, lane_of(av, k), shift, q);
        pack_into(ow, k, gelus ? (gelus + 128)[CLIP8(v + lane_of(bv, k))] : v);
      }
    }
    store16(out8 + (long long)r * N + n, ow);
  }
}

template <bool TC>
__device__ void former_mm_body(const i8* x, const i8* w, const int* xb, const i8* a, int R,
                               int N, int K, int per, int shift, int div, const i8* bias,
                               const int* gelu, i8* out8) {
  __shared__ int gelus[256];
  if (gelu)
    for (int i = threadIdx.x; i < 256; i += blockDim.x) gelus[i] = gelu[i];
  int acc[ACC];
  tile_gemm<TC>(x, w, R, N, K, 0, K / 4, acc);  // its barriers order the copy too
  Divisor q = make_divisor(div), rows = make_divisor(per);
  u64 bases = (u64)a | (u64)bias | (u64)out8;
  if (N % 16 == 0 && (bases & 15) == 0) {
    const int* table = gelu ? gelus : 0;
    if (q.pow2)
      former_mm_epilogue16<TC, true>(acc, xb, a, R, N, rows, shift, q, bias, table, out8);
    else
      former_mm_epilogue16<TC, false>(acc, xb, a, R, N, rows, shift, q, bias, table, out8);
    return;
  }
  if (q.pow2)
    former_mm_epilogue<TC, true>(acc, xb, a, R, N, rows, shift, q, bias, gelu, out8);
  else
    former_mm_epilogue<TC, false>(acc, xb, a, R, N, rows, shift, q, bias, gelu, out8);
}

// The tied head fused with the loss: the logits l = MM(x, EMB) (+ the member's head bias,
// clipped) of rows x (R, D) are never stored. total[r] += sum over this tile's columns of
// EXP2[l + 128] (u64, zeroed before the launch: integer atomics, exact in any order) and
// target[r] = l at the column of the row's next token. former_loss finishes the rows.
// With hist (held-out scores, each window a pair of identical members), the even members'
// rows count their logits instead: hist[r', l + 128] += 1 (zeroed before), r' = pair T + t,
// and target[r'] = l; the host finishes both losses from the counts (shared/loss.py).
// Launch: grid (ceil(V / TILE_N), ceil(R / TILE_M)), block (256).
template <bool TC, bool POW2>
__device__ __forceinline__ void former_head_epilogue(const int acc[ACC], const int* xb,
                                                     const i8* a, int R, int V, int per,
                                                     Divisor rows, int shift, Divisor q,
                                                     const i8* bias, const int* tokens,
                                                     const int* exp2_table, int* target,
                                                     int* hist, u32* row_sum) {
  int m0 = blockIdx.y * TILE_M;
#pragma unroll
  for (int i = 0; i < ACC; i++) {
    int r, n;
    if (!tile_out<TC>(i, R, V, r, n)) continue;
    long long m;
    int l = former_mm_out<POW2>(acc[i], r, n, V, xb, a, rows, shift, q, m);
    if (bias) l = CLIP8(l + bias[m * V + n]);
    long long t = r - m * per, at = r;
    if (hist) {
      if (m & 1) continue;
      at = (m >> 1) * per + t;
      atomicAdd(hist + at * 256 + l + 128, 1);
    } else {
      atomicAdd(&row_sum[r - m0], (u32)exp2_table[l + 128]);
    }
    if (n == tokens[(m >> 1) * (per + 1) + t + 1]) target[at] = l;
  }
}

// The head's epilogue through shared memory, for the loss (held-out counts keep the one
// above; V % 16 == 0, 16-byte aligned a and bias): the tile's sums staged whole, each thread
// finishes logits n .. n + 15 of rows t / 4 and t / 4 + 64, the row's member, sign, position
// and next token worked out once per 16 logits; EXP2 comes from a copy in shared memory, and
// a row's sum over the tile is its four lanes' sums (one shuffle pair, one global atomic per
// row) instead of an atomic per logit.
template <bool TC, bool POW2>
__device__ __forceinline__ void former_head_epilogue16(
    const int acc[ACC], const int* xb, const i8* a, int R, int V, int per, Divisor rows,
    int shift, Divisor q, const i8* bias, const int* tokens, const int* exp2s, u64* total,
    int* target) {
  int (*st)[STAGE_ROW] = stage_tile<TC>(acc);
  int c = (threadIdx.x & 3) * 16, n = blockIdx.x * TILE_N + c;
#pragma unroll
  for (int h = 0; h < 2; h++) {
    int rr = (threadIdx.x >> 2) + 64 * h, r = blockIdx.y * TILE_M + rr;
    u32 sum = 0;
    if (r < R && n < V) {
      long long m = floor_by(r, rows), t = r - m * per;
      int sxb = (m & 1) ? -xb[r] : xb[r];
      int next = tokens[(m >> 1) * (per + 1) + t + 1] - n;  // its column in this piece
      uint4 av = load16(a + (m >> 1) * V + n);
      uint4 bv = bias ? load16(bias + m * V + n) : make_uint4(0u, 0u, 0u, 0u);
      const int* exp2_at = exp2s + 128;  // indexed by the logit itself
#pragma unroll
      for (int k0 = 0; k0 < 16; k0 += 4) {
        int4 s4 = *(const int4*)(&st[rr][c] + k0);
#pragma unroll
        for (int k = k0; k < k0 + 4; k++) {
          int l = egg_mm<POW2>(sum_of(s4, k - k0), sxb, lane_of(av, k), shift, q);
          if (bias) l = CLIP8(l + lane_of(bv, k));
          sum += (u32)exp2_at[l];
        }
      }
      if ((unsigned)next < 16) {  // the target's logit again: one thread in V / 16 has it
        int l = egg_mm<POW2>(st[rr][c + next], sxb, a[(m >> 1) * V + n + next], shift, q);
        target[r] = bias ? CLIP8(l + bias[m * V + n + next]) : l;
      }
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);  // the row's four lanes: t = 4 rr + 0..3
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    if ((threadIdx.x & 3) == 0 && sum) atomicAdd(total + r, (u64)sum);
  }
}

template <bool TC>
__device__ void former_head_body(const i8* x, const i8* w, const int* xb, const i8* a, int R,
                                 int V, int K, int per, int shift, int div, const i8* bias,
                                 const int* tokens, const int* exp2_table, u64* total,
                                 int* target, int* hist) {
  __shared__ u32 row_sum[TILE_M];  // < 64 columns * 2**20: a tile's sums fit 32 bits
  __shared__ int exp2s[256];
  bool staged = !hist && V % 16 == 0 && (((u64)a | (u64)bias) & 15) == 0;
  for (int i = threadIdx.x; i < TILE_M && !staged; i += blockDim.x) row_sum[i] = 0;
  for (int i = threadIdx.x; i < 256; i += blockDim.x) exp2s[i] = exp2_table[i];
  int acc[ACC];
  tile_gemm<TC>(x, w, R, V, K, 0, K / 4, acc);  // its barriers order the copies too
  Divisor q = make_divisor(div), rows = make_divisor(per);
  if (staged) {
    if (q.pow2)
      former_head_epilogue16<TC, true>(acc, xb, a, R, V, per, rows, shift, q, bias, tokens,
                                       exp2s, total, target);
    else
      former_head_epilogue16<TC, false>(acc, xb, a, R, V, per, rows, shift, q, bias, tokens,
                                        exp2s, total, target);
    return;
  }
  if (q.pow2)
    former_head_epilogue<TC, true>(acc, xb, a, R, V, per, rows, shift, q, bias, tokens, exp2s,
                                   target, hist, row_sum);
  else
    former_head_epilogue<TC, false>(acc, xb, a, R, V, per, rows, shift, q, bias, tokens, exp2s,
                                    target, hist, row_sum);
  __syncthreads();
  int m0 = blockIdx.y * TILE_M;
  for (int i = threadIdx.x; i < TILE_M; i += blockDim.x)
    if (m0 + i < R && row_sum[i]) atomicAdd(total + m0 + i, (u64)row_sum[i]);
}

#define FORMER_MM_PARAMS                                                                     \
  const i8 *x, const i8 *w, const int *xb, const i8 *a, int R, int N, int K, int per,       \
      int shift, int div, const i8 *bias, const int *gelu, i8 *out8
#define FORMER_HEAD_PARAMS                                                                  \
  const i8 *x, const i8 *w, const int *xb, const i8 *a, int R, int V, int K, int per,      \
      int shift, int div, const i8 *bias, const int *tokens, const int *exp2_table,         \
      u64 *total, int *target, int *hist

extern "C" __global__ void __launch_bounds__(256) former_mm_tc(FORMER_MM_PARAMS) {
  former_mm_body<true>(x, w, xb, a, R, N, K, per, shift, div, bias, gelu, out8);
}
extern "C" __global__ void __launch_bounds__(256) former_mm_dp4a(FORMER_MM_PARAMS) {
  former_mm_body<false>(x, w, xb, a, R, N, K, per, shift, div, bias, gelu, out8);
}
extern "C" __global__ void __launch_bounds__(256) former_head_tc(FORMER_HEAD_PARAMS) {
  former_head_body<true>(x, w, xb, a, R, V, K, per, shift, div, bias, tokens, exp2_table, total,
                         target, hist);
}
extern "C" __global__ void __launch_bounds__(256) former_head_dp4a(FORMER_HEAD_PARAMS) {
  former_head_body<false>(x, w, xb, a, R, V, K, per, shift, div, bias, tokens, exp2_table,
                          total, target, hist);
}

// loss[m] = sum over the member's T rows of floor(16 log2(total[r])) - 64 - (target[r] + 128):
// the reference's token_loss per position, summed. Launch: grid (ceil(M / 256)), block (256).
extern "C" __global__ void former_loss(const u64* total, const int* target, int M, int per,
                                       const long long* log2_th, long long* loss) {
  int m = blockIdx.x * blockDim.x + threadIdx.x;
  if (m >= M) return;
  long long sum = 0;
  for (long long r = (long long)m * per; r < (long long)(m + 1) * per; r++)
    sum += log2_16((long long)total[r], log2_th) - 64 - (target[r] + 128);
  loss[m] = sum;
}

// Word w of a row of n bytes at p (bytes 4w .. 4w + 3, zero past n): one load where the row
// is whole aligned words, else byte by byte; and its store.
__device__ __forceinline__ u32 row_word(const i8* p, int w, int n, bool whole) {
  if (whole) return *(const u32*)(p + 4 * w);
  u32 word = 0;
  for (int b = 0; b < 4 && 4 * w + b < n; b++) word |= (u32)(p[4 * w + b] & 0xff) << (8 * b);
  return word;
}
__device__ __forceinline__ void store_row_word(i8* p, int w, int n, bool whole, u32 word) {
  if (whole) {
    *(u32*)(p + 4 * w) = word;
    return;
  }
  for (int b = 0; b < 4 && 4 * w + b < n; b++) p[4 * w + b] = (i8)(word >> (8 * b));
}

// R: out[r] = (254 v + mx) // (2 mx), mx = max(max_n |v|, 1), with v row r of pre (R, D), the
// clipped MM outputs, either rotated by RoPE (q and k: cos, sin (T, dh / 2) in units of
// 2**-14, the pairs (2i, 2i + 1) of each head at position r % per) or plus the residual res
// (R, D) and the member's bias (M, D) where given (|v| <= 381). out may be res (x in place):
// each lane reads its own words before it writes them. Launch: grid (ceil(R / 8)), block
// (256): a warp per row, lane l holding words l + 32 j in registers (D <= 1,024: j < 8), so
// the row is read once; a word's two pairs never straddle it (dh and its offsets are even).
#define RENORM_WORDS 8

// Four blocks an SM (64 registers) on sm_90, measured there; below it 64 registers spill,
// so three. It waits on memory, so rows in flight matter more.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define RENORM_BLOCKS 3
#else
#define RENORM_BLOCKS 4
#endif
extern "C" __global__ void __launch_bounds__(256, RENORM_BLOCKS)
    former_renorm(const i8* pre, const i8* res, const i8* bias, int R, int per, int D, int dh,
                  const int* cos, const int* sin, i8* out) {
  int row = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (row >= R) return;  // warp-uniform
  long long m = row / per, o = (long long)row * D;
  int t = row - m * per, half = dh / 2, top = 0;
  bool whole = ((D | (int)((u64)pre | (u64)res | (u64)bias | (u64)out)) & 3) == 0;
  int v[RENORM_WORDS][4];
#pragma unroll
  for (int j = 0; j < RENORM_WORDS; j++) {
    int w = lane + 32 * j;
    u32 p = 0u, rw = 0u, bw = 0u;
    if (4 * w < D) {
      p = row_word(pre + o, w, D, whole);
      if (res) rw = row_word(res + o, w, D, whole);
      if (bias) bw = row_word(bias + m * D, w, D, whole);
    }
#pragma unroll
    for (int k = 0; k < 4; k++)
      v[j][k] = (int)(signed char)(p >> 8 * k) + (signed char)(rw >> 8 * k) +
                (signed char)(bw >> 8 * k);
    if (cos && 4 * w < D) {
#pragma unroll
      for (int k = 0; k < 4; k += 2) {
        int i = t * half + (4 * w + k) % dh / 2, e = v[j][k], od = v[j][k + 1];
        v[j][k] = e * cos[i] - od * sin[i] + (1 << 13) >> 14;
        v[j][k + 1] = e * sin[i] + od * cos[i] + (1 << 13) >> 14;
      }
    }
#pragma unroll
    for (int k = 0; k < 4; k++) top = max(top, abs(v[j][k]));
  }
  for (int off = 16; off > 0; off >>= 1) top = max(top, __shfl_xor_sync(0xffffffffu, top, off));
  top = max(top, 1);
  // |254 v + top| 2 top <= 510 top**2 < 2**31 (top <= 381 sqrt 2 after RoPE): one 32-bit
  // multiply-high per output, and no 64-bit division per row
  u32 q = small_divisor(2 * top);
#pragma unroll
  for (int j = 0; j < RENORM_WORDS; j++) {
    int w = lane + 32 * j;
    if (4 * w >= D) break;
    u32 word = 0u;
#pragma unroll
    for (int k = 0; k < 4; k++)
      word |= (u32)(floor_small(254 * v[j][k] + top, q) & 0xff) << 8 * k;
    store_row_word(out + o, w, D, whole, word);
  }
}

// The former's attention in tiles of ROWS queries by ROWS keys, every query of a tile at once.
// A tile of Q, K or V is ROWS rows of STRIDE = ATT_TILE_WORDS / ROWS int32 words in shared
// memory: a head's dh bytes, zero after; ROWS is the most rows whose dh fits (32 up to
// dh = 64, 2 at dh = 1,024), so shared memory is bounded for every head size. Thread (qi, g)
// works for query qi of the tile: it scores keys g + GROUPS u and sums words g + GROUPS u of
// its output row (4 outputs each).
#define ATT_THREADS 256
#define ATT_TILE_WORDS 512

struct AttShared {
  __align__(16) int q[ATT_TILE_WORDS + 32 * 4];  // rows of STRIDE + 4: no bank conflicts
  __align__(16) int k[ATT_TILE_WORDS];
  __align__(16) int v[4 * ATT_TILE_WORDS];  // the values one int each: a multiply per output
  int w[32 * 32];                           // (key, query): its score, then its weight
  int table[256];
  int top[ATT_THREADS];
  long long den[ATT_THREADS];
};

// Rows [r0, r0 + n) of one head's slice at src (row stride D, dh bytes) into shared memory as
// words (row stride `stride`) or, `values`, one int per byte; zero past dh and past row n.
template <int ROWS>
__device__ __forceinline__ void att_load(const i8* src, int D, int dh, int r0, int n,
                                         int stride, bool values, int* dst) {
  constexpr int STRIDE = ATT_TILE_WORDS / ROWS;
  bool whole = ((D | dh) & 3) == 0;  // every row starts on a word: one load per word
#pragma unroll
  for (int i = threadIdx.x; i < ATT_TILE_WORDS; i += ATT_THREADS) {
    int r = i / STRIDE, w = i % STRIDE;
    int word = r < n && 4 * w < dh ? row_word(src + (long long)(r0 + r) * D, w, dh, whole) : 0;
    if (values) {
      *(int4*)(dst + 4 * i) = make_int4((signed char)word, (signed char)(word >> 8),
                                         (signed char)(word >> 16), word >> 24);
    } else {
      dst[r * stride + w] = word;
    }
  }
}

// For thread (qi, g), the scores (|s| <= 2**24) of its keys g + GROUPS u with query qi into s.
// From 16 rows a thread scores its PAIRS keys whole; below, the ROWS x ROWS pairs are fewer
// than the threads, so SPLIT adjacent lanes take a slice of the head each and add up by
// shuffles into sh.w[key * ROWS + query] (a barrier, then s from there).
template <int ROWS, int PAIRS, int GROUPS>
__device__ __forceinline__ void att_scores(AttShared& sh, int qi, int g, int words,
                                           int s[PAIRS]) {
  constexpr int STRIDE = ATT_TILE_WORDS / ROWS;
  if (ROWS >= 16) {  // GROUPS * PAIRS == ROWS: every key once
    const int *qrow = sh.q + qi * (STRIDE + 4), *key = sh.k + g * STRIDE;
#pragma unroll
    for (int u = 0; u < PAIRS; u++) s[u] = 0;
    for (int w = 0; w < words; w += 4) {
      int4 qw = *(const int4*)(qrow + w);
#pragma unroll
      for (int u = 0; u < PAIRS; u++) {
        int4 kw = *(const int4*)(key + GROUPS * STRIDE * u + w);
        s[u] = __dp4a(qw.x, kw.x, __dp4a(qw.y, kw.y, __dp4a(qw.z, kw.z, __dp4a(qw.w, kw.w, s[u]))));
      }
    }
    return;
  }
  constexpr int SPLIT = ATT_THREADS / (ROWS * ROWS) < 32 ? ATT_THREADS / (ROWS * ROWS) : 32;
  int pair = threadIdx.x / SPLIT, slice = threadIdx.x % SPLIT, sum = 0;
  const int* qrow = sh.q + (pair % ROWS) * (STRIDE + 4);
  const int* key = sh.k + (pair / ROWS) * STRIDE;
  for (int w = 4 * slice; pair < ROWS * ROWS && w < words; w += 4 * SPLIT) {
    int4 qw = *(const int4*)(qrow + w), kw = *(const int4*)(key + w);
    sum = __dp4a(qw.x, kw.x, __dp4a(qw.y, kw.y, __dp4a(qw.z, kw.z, __dp4a(qw.w, kw.w, sum))));
  }
  for (int off = SPLIT / 2; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (slice == 0 && pair < ROWS * ROWS) sh.w[(pair / ROWS) * ROWS + pair % ROWS] = sum;
  __syncthreads();
  s[0] = g < ROWS ? sh.w[g * ROWS + qi] : 0;  // PAIRS = 1; threads past ROWS keys idle
}

// floor(x / b) for 0 <= x < 512 b < 2**44: a float estimate within 2**-14 of x / b (four
// roundings of 2**-24 each: x, b, 1 / b, the product), then one exact integer step.
__device__ __forceinline__ int att_quotient(long long x, long long b, float inverse) {
  int q = (int)((float)x * inverse);
  long long r = x - (long long)q * b;
  return q - (r < 0) + (r >= b);
}

// Per query tile: a first pass over its key tiles finds each query's top score (with one key
// tile, its scores are kept), a second weighs each tile and adds its share of the sums.
template <int ROWS>
__device__ __forceinline__ void att_tiles(AttShared& sh, const i8* qh, const i8* kh,
                                          const i8* vh, int per, int D, int dh, i8* out) {
  constexpr int STRIDE = ATT_TILE_WORDS / ROWS, GROUPS = ATT_THREADS / ROWS;
  constexpr int PAIRS = ROWS * ROWS >= ATT_THREADS ? ROWS * ROWS / ATT_THREADS : 1;
  constexpr int VWORDS = STRIDE / GROUPS;  // V words a thread sums, 4 outputs each
  int qi = threadIdx.x % ROWS, g = threadIdx.x / ROWS, words = ((dh + 15) >> 4) << 2;
  for (int q0 = 0; q0 < per; q0 += ROWS) {
    // the last tile's barrier on sh.den (below) leaves every buffer free; sh.table, loaded
    // before the first, is read after its first barrier
    int query = q0 + qi, tiles = q0 / ROWS + 1;  // key tiles 0 .. q0 / ROWS
    int s[PAIRS], top = -2147483647 - 1;
    att_load<ROWS>(qh, D, dh, q0, min(ROWS, per - q0), STRIDE + 4, false, sh.q);
    for (int kt = 0; kt < tiles; kt++) {
      if (kt) __syncthreads();  // sh.k is free
      att_load<ROWS>(kh, D, dh, kt * ROWS, min(ROWS, per - kt * ROWS), STRIDE, false, sh.k);
      __syncthreads();
      att_scores<ROWS, PAIRS, GROUPS>(sh, qi, g, words, s);
#pragma unroll
      for (int u = 0; u < PAIRS; u++)
        if (g + GROUPS * u < ROWS && kt * ROWS + g + GROUPS * u <= query) top = max(top, s[u]);
    }
    sh.top[threadIdx.x] = top;
    __syncthreads();
    for (int i = qi; i < ATT_THREADS; i += ROWS) top = max(top, sh.top[i]);
    long long num[4 * VWORDS], den = 0;
#pragma unroll
    for (int i = 0; i < 4 * VWORDS; i++) num[i] = 0;
    for (int kt = 0; kt < tiles; kt++) {
      int n = min(ROWS, per - kt * ROWS);
      if (tiles > 1) {  // the scores again: sh.w held only the last tile's
        __syncthreads();  // sh.k, sh.v and sh.w are free
        att_load<ROWS>(kh, D, dh, kt * ROWS, n, STRIDE, false, sh.k);
        att_load<ROWS>(vh, D, dh, kt * ROWS, n, STRIDE, true, sh.v);
        __syncthreads();
        att_scores<ROWS, PAIRS, GROUPS>(sh, qi, g, words, s);
      } else {
        att_load<ROWS>(vh, D, dh, 0, n, STRIDE, true, sh.v);
      }
#pragma unroll
      for (int u = 0; u < PAIRS; u++) {
        int kj = g + GROUPS * u, at = kj * ROWS + qi, weight = 0;
        if (kj >= ROWS) continue;
        if (kt * ROWS + kj <= query)
          weight = sh.table[min((top - s[u]) >> 8, 255)];  // one tile: s from the first pass
        sh.w[at] = weight;  // a slot only its owner reads or writes until the barrier
        den += weight;
      }
      __syncthreads();  // the tile's weights and values are in
      int acc[4 * VWORDS] = {};  // |sum| <= 32 keys * 2**18 * 128 = 2**30
      const int* val = sh.v + 4 * g;
#pragma unroll 4
      for (int c = 0; c < n; c++, val += 4 * STRIDE) {
        int weight = sh.w[c * ROWS + qi];
#pragma unroll
        for (int u = 0; u < VWORDS; u++) {
          int4 x = *(const int4*)(val + 4 * GROUPS * u);
          acc[4 * u] += weight * x.x;
          acc[4 * u + 1] += weight * x.y;
          acc[4 * u + 2] += weight * x.z;
          acc[4 * u + 3] += weight * x.w;
        }
      }
#pragma unroll
      for (int i = 0; i < 4 * VWORDS; i++) num[i] += acc[i];
    }
    sh.den[threadIdx.x] = den;
    __syncthreads();
    den = 0;
    for (int i = qi; i < ATT_THREADS; i += ROWS) den += sh.den[i];  // >= 2**18: the top key's
    if (query >= per) continue;
    float inverse = 1.0f / (float)(2 * den);
    i8* row = out + (long long)query * D;
#pragma unroll
    for (int u = 0; u < VWORDS; u++) {
      int jw = g + GROUPS * u;
      if (4 * jw >= dh) break;
      int bytes = 0;
#pragma unroll
      for (int b = 0; b < 4; b++) {
        // (2 num + den) // (2 den) in [-128, 127]: shifted by 128 to divide non-negatives
        long long x = 2 * num[4 * u + b] + den + 256 * den;
        bytes |= ((att_quotient(x, 2 * den, inverse) - 128) & 0xff) << (8 * b);
      }
      if (((D | dh) & 3) == 0) {
        *(int*)(row + 4 * jw) = bytes;
      } else {
        for (int b = 0; b < 4 && 4 * jw + b < dh; b++) row[4 * jw + b] = (i8)(bytes >> (8 * b));
      }
    }
  }
}

// Causal attention of member m's head h over its T = per positions, q, k, v, out (R, D) int8:
// for query t, s_c = q_t . k_c (c <= t), e_c = min((max s - s_c) >> 8, 255),
// w_c = SOFTMAX[e_c], out = (2 sum w_c v_c + sum w_c) // (2 sum w_c) in int64.
// Launch: grid (M, heads), block (ATT_THREADS): former_attention for dh <= 64, tiles of 32
// rows; former_attention_wide for 64 < dh <= 1024, fewer rows (a kernel of its own, so that
// its registers do not weigh on the narrow heads' occupancy).
#define ATT_PARAMS \
  const i8 *q, const i8 *k, const i8 *v, int per, int D, int dh, const int *softmax, i8 *out
template <int ROWS>
__device__ __forceinline__ void att_head(AttShared& sh, ATT_PARAMS) {
  long long base = (long long)blockIdx.x * per * D + (long long)blockIdx.y * dh;
  for (int i = threadIdx.x; i < 256; i += ATT_THREADS) sh.table[i] = softmax[i];
  att_tiles<ROWS>(sh, q + base, k + base, v + base, per, D, dh, out + base);
}
extern "C" __global__ void __launch_bounds__(ATT_THREADS, 2) former_attention(ATT_PARAMS) {
  __shared__ AttShared sh;
  att_head<32>(sh, q, k, v, per, D, dh, softmax, out);
}
extern "C" __global__ void __launch_bounds__(ATT_THREADS, 2) former_attention_wide(ATT_PARAMS) {
  __shared__ AttShared sh;
  if (dh <= 128) {
    att_head<16>(sh, q, k, v, per, D, dh, softmax, out);
  } else if (dh <= 256) {
    att_head<8>(sh, q, k, v, per, D, dh, softmax, out);
  } else if (dh <= 512) {
    att_head<4>(sh, q, k, v, per, D, dh, softmax, out);
  } else {
    att_head<2>(sh, q, k, v, per, D, dh, softmax, out);
  }
}
