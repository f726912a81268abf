// former_generate.cu (shared/former.py FormerDecoder): the former's generation on the device.
// A step reads one token per row. While a row's history fits the context, the new position
// alone goes through the layers (former.cu's kernels, one row per member) and attends to the
// keys and values each layer keeps in its cache (M, T, D); past the context the window slides,
// every position's RoPE angle moves, and the step reads the window of the last T tokens whole.
// After former.cu (row_word) and generate.cu.
//
// pos (2,) int32 in device memory, so that a captured step replays unchanged: pos[0] is the
// number of tokens read so far, pos[1] the position the current step reads (its column of
// history (M, S)).

#define FGEN_THREADS 128  // threads of former_gen_attend's block
#define FGEN_OUTS 8       // outputs a thread of it sums: dh <= FGEN_THREADS * FGEN_OUTS = 1,024

// The step's start: history[m, p] = cur[m] with p = pos[0], the RoPE row of position p into
// cos_now, sin_now (half,) while p < T (the cached step rotates by them), pos = (p + 1, p).
// Launch: grid (1), block (256): one block, so every thread reads pos before it moves.
extern "C" __global__ void former_gen_begin(const int* cur, int M, int S, int T, int half,
                                            const int* cos, const int* sin, int* pos,
                                            int* history, int* cos_now, int* sin_now) {
  int p = pos[0];
  for (int m = threadIdx.x; m < M; m += blockDim.x) history[(long long)m * S + p] = cur[m];
  for (int i = threadIdx.x; i < half && p < T; i += blockDim.x) {
    cos_now[i] = cos[p * half + i];
    sin_now[i] = sin[p * half + i];
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    pos[0] = p + 1;
    pos[1] = p;
  }
}

// x[r] = clip(EMB[tok] + ((sign * a_emb[pair, tok] * b_emb[pair, :]) >> shift) + bias[m, :]),
// former_embed's arithmetic for row r = m per + t of member m's window of `per` tokens ending
// at column pos[1] of its own history (rows of one pair read different tokens).
// Launch: grid (M per), block (128).
extern "C" __global__ void former_gen_embed(const int* history, int S, const int* pos, int per,
                                            const i8* emb, const i8* a_emb, const i8* b_emb,
                                            const i8* bias, int D, int V, int shift, i8* x) {
  long long r = blockIdx.x;
  long long m = r / per, pair = m >> 1;
  int tok = history[m * S + pos[1] - per + 1 + (r - m * per)];
  int a = a_emb[pair * V + tok];
  if (m & 1) a = -a;
  for (int n = threadIdx.x; n < D; n += blockDim.x) {
    int v = emb[(long long)tok * D + n] + ((a * b_emb[pair * D + n]) >> shift) + bias[m * D + n];
    x[r * D + n] = (i8)CLIP8(v);
  }
}

// q . key for one head (q as words in shared memory, the key's dh bytes at `key`).
__device__ __forceinline__ int fgen_score(const int* qw, const i8* key, int words, int dh,
                                          bool whole) {
  int s = 0;
  for (int w = 0; w < words; w++) s = __dp4a(qw[w], (int)row_word(key, w, dh, whole), s);
  return s;  // |s| <= dh 127**2 < 2**24
}

// The new position p = pos[1] of member m's head h (q, k, v (M, D), renormed): its key and
// value into the layer's cache kc, vc (M, T, D) at position p, then its attention over the
// cached positions 0..p as shared/former.py attention(start=p): s_c = q . k_c,
// e_c = min((max s - s_c) >> 8, 255), w_c = SOFTMAX[e_c],
// out = (2 sum w_c v_c + sum w_c) // (2 sum w_c) in int64.
// Launch: grid (M, heads), block (FGEN_THREADS); dh <= 1,024.
extern "C" __global__ void __launch_bounds__(FGEN_THREADS)
    former_gen_attend(const i8* q, const i8* k, const i8* v, const int* pos, int T, int D,
                      int dh, const int* softmax, i8* kc, i8* vc, i8* out) {
  __shared__ int qw[256];
  __shared__ int table[256];
  __shared__ int top_sh[FGEN_THREADS];
  __shared__ int w_sh[FGEN_THREADS];
  int tid = threadIdx.x, p = pos[1], words = (dh + 3) >> 2;
  long long row = (long long)blockIdx.x * D + (long long)blockIdx.y * dh;
  long long base = (long long)blockIdx.x * T * D + (long long)blockIdx.y * dh;  // key 0
  bool whole = ((D | dh | (int)((u64)q | (u64)kc)) & 3) == 0;
  for (int i = tid; i < dh; i += FGEN_THREADS) {
    kc[base + (long long)p * D + i] = k[row + i];
    vc[base + (long long)p * D + i] = v[row + i];
  }
  for (int w = tid; w < words; w += FGEN_THREADS) qw[w] = (int)row_word(q + row, w, dh, whole);
  for (int i = tid; i < 256; i += FGEN_THREADS) table[i] = softmax[i];
  __syncthreads();  // the new key and value are in the cache for every thread
  int top = -2147483647 - 1;
  for (int c = tid; c <= p; c += FGEN_THREADS)
    top = max(top, fgen_score(qw, kc + base + (long long)c * D, words, dh, whole));
  top_sh[tid] = top;
  __syncthreads();
  for (int half = FGEN_THREADS / 2; half > 0; half >>= 1) {
    if (tid < half) top_sh[tid] = max(top_sh[tid], top_sh[tid + half]);
    __syncthreads();
  }
  top = top_sh[0];
  long long num[FGEN_OUTS] = {}, den = 0;
  for (int c0 = 0; c0 <= p; c0 += FGEN_THREADS) {
    int c = c0 + tid, n = min(FGEN_THREADS, p + 1 - c0);
    int weight = 0;
    if (c <= p) {
      int s = fgen_score(qw, kc + base + (long long)c * D, words, dh, whole);
      weight = table[min((top - s) >> 8, 255)];
    }
    w_sh[tid] = weight;
    __syncthreads();  // the chunk's weights are in
    for (int j = 0; j < n; j++) den += w_sh[j];
#pragma unroll
    for (int u = 0; u < FGEN_OUTS; u++) {  // a guard, not a break: num stays in registers
      int i = tid + u * FGEN_THREADS;
      if (i < dh) {
        const i8* val = vc + base + (long long)c0 * D + i;
        long long acc = 0;  // up to 128 keys * 2**18 * 127: past 32 bits
        for (int j = 0; j < n; j++) acc += (long long)w_sh[j] * val[(long long)j * D];
        num[u] += acc;
      }
    }
    __syncthreads();  // w_sh is free
  }
#pragma unroll
  for (int u = 0; u < FGEN_OUTS; u++) {
    int i = tid + u * FGEN_THREADS;
    // (2 num + den) // (2 den) in [-127, 127]: shifted by 128 to divide non-negatives
    long long x = 2 * num[u] + den + 256 * den;
    if (i < dh) out[row + i] = (i8)(x / (2 * den) - 128);
  }
}

// out[m, :] = x[m per + per - 1, :]: each member's last window position (the one whose
// logits are read). Launch: grid (M), block (128).
extern "C" __global__ void former_gen_last(const i8* x, int per, int D, i8* out) {
  long long m = blockIdx.x, src = (m * per + per - 1) * D;
  for (int n = threadIdx.x; n < D; n += blockDim.x) out[m * D + n] = x[src + n];
}
