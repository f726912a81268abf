// egg.cu (shared/egg.py): the EGG model's layers: the embedding, the norm with its rank-1
// dots, rowdot, and the gate and the candidate on gemm.cu's core and epilogue helpers.

// --------------------------------------------------------------- the forward pass

// Row m of embed: token tok's embedding with the member's rank-1 noise, its state rows reset
// where tok == 0 (embed, and gen_embed's token per row).
__device__ __forceinline__ void embed_row(int m, int tok, const i8* emb, const i8* a_emb,
                                          const i8* b_emb, int M, int D, int V, int shift,
                                          i8* states, int n_layer, i8* x) {
  long long pair = m >> 1;
  int a = a_emb[pair * V + tok];
  if (m & 1) a = -a;
  for (int n = threadIdx.x; n < D; n += blockDim.x) {
    int v = emb[(long long)tok * D + n] + ((a * b_emb[pair * D + n]) >> shift);
    x[(long long)m * D + n] = (i8)CLIP8(v);
    if (tok == 0)
      for (int l = 0; l < n_layer; l++) states[((long long)l * M + m) * D + n] = 0;
  }
}

// x[m] = clip(EMB[tok] + ((sign * a_emb[pair, tok] * b_emb[pair, :]) >> shift)) for the token
// at column t (+ *pos where given: a replayed held-out step's device-side position) of the
// member's pair window, and every layer's state row reset where tok == 0.
// tokens (P, t_cols) int32; a_emb (P, V); b_emb (P, D); states (L, M, D).
// Launch: grid (M), block (128).
extern "C" __global__ void embed(const int* tokens, int t_cols, int t, const int* pos,
                                 const i8* emb, const i8* a_emb, const i8* b_emb, int M, int D,
                                 int V, int shift, i8* states, int n_layer, i8* x) {
  int m = blockIdx.x;
  if (pos) t += *pos;
  embed_row(m, tokens[(long long)(m >> 1) * t_cols + t], emb, a_emb, b_emb, M, D, V, shift,
            states, n_layer, x);
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

// The gate's and the candidate's kernels: a tensor-core one (_tc) and its __dp4a twin
// each, as gemm.cu's (same arguments, launch shape and results; 256 threads, no spills).
#define GATE_PARAMS                                                                   \
  const i8 *h, const i8 *wf, const int *xbh, const i8 *af, const i8 *s, const i8 *uf, \
      const int *xbs, const i8 *au, int M, int D, int shift, int div, const i8 *bias,  \
      i8 *f, i8 *g
#define CAND_PARAMS                                                                   \
  const i8 *h, const i8 *wh, const int *xbh, const i8 *ah, const i8 *g, const i8 *uh, \
      const int *xbg, const i8 *au, int M, int D, int shift, int div, const i8 *bias,  \
      const i8 *f, i8 *s, i8 *x

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
