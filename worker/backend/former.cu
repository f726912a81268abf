// Kernels of the former's forward pass (shared/former.py), matching it bit for bit. They are
// compiled in one module after egg.cu and use its noise, divisor, GEMM core and loss helpers.
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

// MM(x, W) for rows of x (R, K), W (N, K), with xb (R) the rows' dots with b and a (P, N).
//   gelu given (the MLP's up projection): out8 = GELU[clip(MM + bias[m]) + 128];
//   else out32 = MM + res (R, N) + bias[m] where given (the renorm kernel takes it from there).
// Launch: grid (ceil(N / TILE_N), ceil(R / TILE_M)), block (256).
template <bool TC, bool POW2>
__device__ __forceinline__ void former_mm_epilogue(const int acc[ACC], const int* xb,
                                                   const i8* a, int R, int N, Divisor rows,
                                                   int shift, Divisor q, const i8* bias,
                                                   const i8* res, const int* gelu, i8* out8,
                                                   int* out32) {
#pragma unroll
  for (int i = 0; i < ACC; i++) {
    int r, n;
    if (!tile_out<TC>(i, R, N, r, n)) continue;
    long long m, o = (long long)r * N + n;
    int v = former_mm_out<POW2>(acc[i], r, n, N, xb, a, rows, shift, q, m);
    if (gelu) {
      out8[o] = (i8)gelu[CLIP8(v + bias[m * N + n]) + 128];
    } else {
      if (res) v += res[o];
      if (bias) v += bias[m * N + n];
      out32[o] = v;
    }
  }
}

// The same through shared memory (N % 16 == 0, 16-byte aligned bases): the tile's sums
// staged whole, each thread finishes outputs n .. n + 15 of rows t / 4 and t / 4 + 64, the
// row's member and sign once, a, bias and res in 16-byte loads, out32 in 16-byte stores (out8
// in one), GELU from a copy in shared memory.
template <bool TC, bool POW2>
__device__ __forceinline__ void former_mm_epilogue16(const int acc[ACC], const int* xb,
                                                     const i8* a, int R, int N, Divisor rows,
                                                     int shift, Divisor q, const i8* bias,
                                                     const i8* res, const int* gelus,
                                                     i8* out8, int* out32) {
  int (*st)[STAGE_ROW] = stage_tile<TC>(acc);
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  int c = (threadIdx.x & 3) * 16, n = blockIdx.x * TILE_N + c;
#pragma unroll
  for (int h = 0; h < 2; h++) {
    int rr = (threadIdx.x >> 2) + 64 * h, r = blockIdx.y * TILE_M + rr;
    if (r >= R || n >= N) continue;
    long long m = floor_by(r, rows), o = (long long)r * N + n;
    int sxb = (m & 1) ? -xb[r] : xb[r];
    uint4 av = load16(a + (m >> 1) * N + n);
    uint4 bv = bias ? load16(bias + m * N + n) : zero, rv = res ? load16(res + o) : zero;
    u32 ow[4] = {0u, 0u, 0u, 0u};
#pragma unroll
    for (int k0 = 0; k0 < 16; k0 += 4) {
      int4 s4 = *(const int4*)(&st[rr][c] + k0);
      int v[4];
#pragma unroll
      for (int k = k0; k < k0 + 4; k++) {
        v[k - k0] = egg_mm<POW2>(sum_of(s4, k - k0), sxb, lane_of(av, k), shift, q);
        if (gelus)
          pack_into(ow, k, gelus[CLIP8(v[k - k0] + lane_of(bv, k)) + 128]);
        else
          v[k - k0] += lane_of(rv, k) + lane_of(bv, k);
      }
      if (!gelus) *(int4*)(out32 + o + k0) = make_int4(v[0], v[1], v[2], v[3]);
    }
    if (gelus) store16(out8 + o, ow);
  }
}

template <bool TC>
__device__ void former_mm_body(const i8* x, const i8* w, const int* xb, const i8* a, int R,
                               int N, int K, int per, int shift, int div, const i8* bias,
                               const i8* res, const int* gelu, i8* out8, int* out32) {
  __shared__ int gelus[256];
  if (gelu)
    for (int i = threadIdx.x; i < 256; i += blockDim.x) gelus[i] = gelu[i];
  int acc[ACC];
  tile_gemm<TC>(x, w, R, N, K, 0, K / 4, acc);  // its barriers order the copy too
  Divisor q = make_divisor(div), rows = make_divisor(per);
  u64 bases = (u64)a | (u64)bias | (u64)res | (u64)out8 | (u64)out32;
  if (N % 16 == 0 && (bases & 15) == 0) {
    const int* table = gelu ? gelus : 0;
    if (q.pow2)
      former_mm_epilogue16<TC, true>(acc, xb, a, R, N, rows, shift, q, bias, res, table, out8,
                                     out32);
    else
      former_mm_epilogue16<TC, false>(acc, xb, a, R, N, rows, shift, q, bias, res, table, out8,
                                      out32);
    return;
  }
  if (q.pow2)
    former_mm_epilogue<TC, true>(acc, xb, a, R, N, rows, shift, q, bias, res, gelu, out8, out32);
  else
    former_mm_epilogue<TC, false>(acc, xb, a, R, N, rows, shift, q, bias, res, gelu, out8, out32);
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
#pragma unroll
      for (int k0 = 0; k0 < 16; k0 += 4) {
        int4 s4 = *(const int4*)(&st[rr][c] + k0);
#pragma unroll
        for (int k = k0; k < k0 + 4; k++) {
          int l = egg_mm<POW2>(sum_of(s4, k - k0), sxb, lane_of(av, k), shift, q);
          if (bias) l = CLIP8(l + lane_of(bv, k));
          sum += (u32)exp2s[l + 128];
          if (k == next) target[r] = l;
        }
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
      int shift, int div, const i8 *bias, const i8 *res, const int *gelu, i8 *out8, int *out32
#define FORMER_HEAD_PARAMS                                                                  \
  const i8 *x, const i8 *w, const int *xb, const i8 *a, int R, int V, int K, int per,      \
      int shift, int div, const i8 *bias, const int *tokens, const int *exp2_table,         \
      u64 *total, int *target, int *hist

extern "C" __global__ void __launch_bounds__(256) former_mm_tc(FORMER_MM_PARAMS) {
  former_mm_body<true>(x, w, xb, a, R, N, K, per, shift, div, bias, res, gelu, out8, out32);
}
extern "C" __global__ void __launch_bounds__(256) former_mm_dp4a(FORMER_MM_PARAMS) {
  former_mm_body<false>(x, w, xb, a, R, N, K, per, shift, div, bias, res, gelu, out8, out32);
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

// The value at column n of row r before the renorm: in[r, n], or with the RoPE tables (cos,
// sin: (T, dh / 2), 1/2**14) the rotated pair (2i, 2i + 1) of its head at position r % per.
__device__ __forceinline__ int rope_value(const int* row, int n, int t, int dh, const int* cos,
                                          const int* sin) {
  if (!cos) return row[n];
  int half = dh / 2, i = (n % dh) / 2, e = row[n & ~1], o = row[n | 1];
  int c = cos[t * half + i], s = sin[t * half + i];
  return ((n & 1) ? e * s + o * c : e * c - o * s) + (1 << 13) >> 14;
}

// R: out[r] = (254 v + mx) // (2 mx), mx = max(max_n |v|, 1), v the row of in (R, D) int32,
// optionally rotated first (RoPE of q and k). Launch: grid (ceil(R / 8)), block (256): one
// warp per row.
extern "C" __global__ void former_renorm(const int* in, int R, int per, int D, int dh,
                                         const int* cos, const int* sin, i8* out) {
  int row = blockIdx.x * 8 + (threadIdx.x >> 5);
  int lane = threadIdx.x & 31;
  if (row >= R) return;  // warp-uniform
  const int* src = in + (long long)row * D;
  int t = row % per, top = 0;
  for (int n = lane; n < D; n += 32) {
    int v = rope_value(src, n, t, dh, cos, sin);
    top = max(top, v < 0 ? -v : v);
  }
  for (int off = 16; off > 0; off >>= 1) top = max(top, __shfl_xor_sync(0xffffffffu, top, off));
  top = max(top, 1);
  Divisor q = make_divisor(2 * top);
  for (int n = lane; n < D; n += 32)
    out[(long long)row * D + n] = (i8)floor_by(254 * rope_value(src, n, t, dh, cos, sin) + top, q);
}

// The block's maximum (int) and sum (int64) of one value per thread; every thread gets it.
// blockDim.x is a multiple of 32, at most 1024; scratch holds a value per warp.
__device__ __forceinline__ int block_max(int v, int* scratch) {
  for (int off = 16; off > 0; off >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, off));
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  v = scratch[0];
  for (int w = 1; w < (int)(blockDim.x >> 5); w++) v = max(v, scratch[w]);
  __syncthreads();  // scratch is free again
  return v;
}
__device__ __forceinline__ long long block_sum(long long v, long long* scratch) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  v = 0;
  for (int w = 0; w < (int)(blockDim.x >> 5); w++) v += scratch[w];
  __syncthreads();
  return v;
}

#define KEY_TILE 1024      // keys whose scores (then weights) one pass holds in shared memory
#define MAX_HEAD_DIM 1024  // model.d_model's bound: a head's int64 sums live in shared memory

// The score q_t . k_c of one head, dh int8 products.
__device__ __forceinline__ int head_score(const i8* qt, const i8* kc, int dh) {
  int s = 0;
  for (int j = 0; j < dh; j++) s += qt[j] * kc[j];
  return s;
}

// Causal attention of member m's head h over its T = per positions, q, k, v, out (R, D) int8:
// for query t, s_c = q_t . k_c (c <= t), e_c = min((max s - s_c) >> 8, 255),
// w_c = SOFTMAX[e_c], out = (2 sum w_c v_c + sum w_c) // (2 sum w_c) in int64.
// Keys go in tiles of KEY_TILE: a first pass finds the top score, a second weighs each tile
// and adds its share of the sums (with one tile, the first pass's scores are kept).
// Launch: grid (M, heads), block (128); dh <= MAX_HEAD_DIM.
extern "C" __global__ void former_attention(const i8* q, const i8* k, const i8* v, int per,
                                            int D, int dh, const int* softmax, i8* out) {
  __shared__ int w[KEY_TILE];
  __shared__ long long num[MAX_HEAD_DIM];
  __shared__ int imax[32];
  __shared__ long long lsum[32];
  long long base = (long long)blockIdx.x * per * D + (long long)blockIdx.y * dh;
  for (int t = 0; t < per; t++) {
    const i8* qt = q + base + (long long)t * D;
    bool one_tile = t < KEY_TILE;
    int top = -2147483647 - 1;
    for (int c = threadIdx.x; c <= t; c += blockDim.x) {
      int s = head_score(qt, k + base + (long long)c * D, dh);
      if (one_tile) w[c] = s;
      top = max(top, s);
    }
    top = block_max(top, imax);
    for (int j = threadIdx.x; j < dh; j += blockDim.x) num[j] = 0;
    long long den = 0;
    for (int c0 = 0; c0 <= t; c0 += KEY_TILE) {
      int keys = min(KEY_TILE, t + 1 - c0);
      for (int i = threadIdx.x; i < keys; i += blockDim.x) {
        int s = one_tile ? w[i] : head_score(qt, k + base + (long long)(c0 + i) * D, dh);
        int weight = softmax[min((top - s) >> 8, 255)];
        w[i] = weight;
        den += weight;
      }
      __syncthreads();  // the tile's weights are in
      for (int j = threadIdx.x; j < dh; j += blockDim.x) {
        long long sum = 0;
        for (int i = 0; i < keys; i++) sum += (long long)w[i] * v[base + (long long)(c0 + i) * D + j];
        num[j] += sum;
      }
      __syncthreads();  // w is free for the next tile
    }
    den = block_sum(den, lsum);  // >= 2**18: the top key's weight
    for (int j = threadIdx.x; j < dh; j += blockDim.x) {
      long long a = 2 * num[j] + den, b = 2 * den, fq = a / b;
      out[base + (long long)t * D + j] = (i8)(fq - (a % b != 0 && a < 0));  // floor
    }
    __syncthreads();  // w and num are rewritten by the next query
  }
}
