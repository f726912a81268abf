// generate.cu (shared/sample.py): a reward run's generation on the device: each row's token
// read through the model, the prompts fed, and the next token chosen exactly as
// sample.next_tokens does, in 64-bit integers. After noise.cu (combine) and egg.cu.

#define GEN_THREADS 256  // threads of a sampling block: one row per block
#define GEN_MIN (-0x7fffffffffffffffLL - 1)

// x[m] = clip(EMB[tok] + ((sign * a_emb[pair, tok] * b_emb[pair, :]) >> shift)) for the
// row's own token tok = cur[m] (rows of one pair write different tokens), every layer's
// state row reset where tok == 0: embed's arithmetic with a token per row.
// Launch: grid (M), block (128).
extern "C" __global__ void gen_embed(const int* cur, const i8* emb, const i8* a_emb,
                                     const i8* b_emb, int M, int D, int V, int shift,
                                     i8* states, int n_layer, i8* x) {
  int m = blockIdx.x;
  embed_row(m, cur[m], emb, a_emb, b_emb, M, D, V, shift, states, n_layer, x);
}

// cur[m] = prompts[m, t] (prompts (M, L)), counted in the row's context counts (M, V).
// Launch: grid (ceil(M / 256)), block (256).
extern "C" __global__ void gen_feed(const int* prompts, int L, int t, int M, int V, int* counts,
                                    int* cur) {
  int m = blockIdx.x * blockDim.x + threadIdx.x;
  if (m >= M) return;
  int tok = prompts[(long long)m * L + t];
  cur[m] = tok;
  counts[(long long)m * V + tok] += 1;
}

// Block-wide maximum and inclusive prefix sum over GEN_THREADS threads (sh: GEN_THREADS
// words of shared memory, free again on return). Every thread must call them.
__device__ __forceinline__ long long gen_block_max(long long v, long long* sh) {
  int t = threadIdx.x;
  sh[t] = v;
  __syncthreads();
  for (int half = GEN_THREADS / 2; half > 0; half >>= 1) {
    if (t < half && sh[t + half] > sh[t]) sh[t] = sh[t + half];
    __syncthreads();
  }
  long long out = sh[0];
  __syncthreads();
  return out;
}

struct GenScan {
  long long incl, total;  // this thread's inclusive prefix sum, the block's total
};

__device__ __forceinline__ GenScan gen_block_scan(long long v, long long* sh) {
  int t = threadIdx.x;
  sh[t] = v;
  __syncthreads();
  for (int off = 1; off < GEN_THREADS; off <<= 1) {
    long long add = t >= off ? sh[t - off] : 0;
    __syncthreads();
    sh[t] += add;
    __syncthreads();
  }
  GenScan out = {sh[t], sh[GEN_THREADS - 1]};
  __syncthreads();
  return out;
}

// L[v] = 1000 l[v] - 16 presence (c[v] > 0) - 16 frequency c[v] (sample.penalized).
__device__ __forceinline__ long long gen_big(const i8* logits, const int* counts, int v,
                                             long long presence, long long frequency) {
  long long c = counts[v];
  return 1000LL * logits[v] - 16 * presence * (c > 0) - 16 * frequency * c;
}

// The weight of token v before top-k (sample.next_tokens): e = (16 (top - L)) // temperature,
// w = EXP[e & 255] >> min(e >> 8, 31), 0 where 1000 w < min_p 2**30.
__device__ __forceinline__ long long gen_weight(long long big, long long top, long long temp,
                                                long long min_p, const long long* exp_table) {
  long long e = (16 * (top - big)) / temp;  // top >= big: floor
  long long shift = e >> 8;
  long long w = exp_table[e & 255] >> (shift < 31 ? shift : 31);
  return 1000 * w < min_p * (1LL << 30) ? 0 : w;
}

// How many of the row's tokens have L >= x (every thread gets it).
__device__ __forceinline__ long long gen_count_at_least(const i8* lr, const int* cr, int V, long long x,
                                        long long pres, long long freq, long long* sh) {
  long long n = 0;
  for (int v = threadIdx.x; v < V; v += GEN_THREADS) n += gen_big(lr, cr, v, pres, freq) >= x;
  return gen_block_scan(n, sh).total;
}

// One sampling pass over the row in chunks of GEN_THREADS tokens, in id order: each token's
// weight after top-k (kept: L > kth, or L == kth among the first `ties` such ids), and the
// running sum before its chunk. find < 0: returns the row's total weight; else the first
// token whose inclusive prefix sum exceeds `find`.
__device__ __forceinline__ long long gen_pass(const i8* lr, const int* cr, int V, long long top, long long kth,
                              long long ties, const long long* s, const long long* exp_table,
                              long long find, long long* sh) {
  __shared__ long long found;
  long long carry = 0, tie_carry = 0;
  if (threadIdx.x == 0) found = -1;
  __syncthreads();
  for (int base = 0; base < V; base += GEN_THREADS) {
    int v = base + threadIdx.x;
    long long big = v < V ? gen_big(lr, cr, v, s[3], s[4]) : GEN_MIN;
    long long tie = v < V && big == kth;
    GenScan ties_so_far = gen_block_scan(tie, sh);
    long long w = 0;
    if (v < V && (big > kth || (tie && tie_carry + ties_so_far.incl - tie < ties)))
      w = gen_weight(big, top, s[0], s[1], exp_table);
    GenScan weights = gen_block_scan(w, sh);
    long long incl = carry + weights.incl;
    if (find >= 0 && w > 0 && incl > find && incl - w <= find) found = v;
    carry += weights.total;
    tie_carry += ties_so_far.total;
    __syncthreads();
    if (found >= 0) break;  // uniform: every thread reads it after the barrier
  }
  long long out = find < 0 ? carry : found;
  __syncthreads();
  return out;
}

// The token at `position` of every row (sample.next_tokens), from its logits (M, V) and
// context counts (M, V); settings: temperature, min_p, top_k, presence, frequency. key is
// key(SAMPLE, seed); row m's draw is combine(combine(key, samples[m]), position). The token
// goes to cur[m] and out[m, position] (out (M, n_out)) and is counted.
// Launch: grid (M), block (GEN_THREADS). (Bounds with one block: without it ptxas for
// sm_90 caps the kernel at 32 registers and spills.)
extern "C" __global__ void __launch_bounds__(GEN_THREADS, 1)
    sample_tokens(const i8* logits, int V, const long long* s, u64 key, const long long* samples,
                  int position, const long long* exp_table, int* counts, int* cur, int* out,
                  int n_out) {
  __shared__ long long sh[GEN_THREADS];
  int m = blockIdx.x;
  const i8* lr = logits + (long long)m * V;
  int* cr = counts + (long long)m * V;
  long long top = GEN_MIN;
  for (int v = threadIdx.x; v < V; v += GEN_THREADS) {
    long long big = gen_big(lr, cr, v, s[3], s[4]);
    top = big > top ? big : top;
  }
  top = gen_block_max(top, sh);
  long long tok;
  if (s[0] == 0) {  // greedy: the first id of the largest L
    long long first = GEN_MIN;
    for (int v = threadIdx.x; v < V; v += GEN_THREADS)
      if (gen_big(lr, cr, v, s[3], s[4]) == top && -(long long)v > first) first = -(long long)v;
    tok = -gen_block_max(first, sh);
  } else {
    long long kth = GEN_MIN, ties = 0;  // top-k off: every token has L > kth
    if (s[2] && s[2] < V) {
      // kth = the largest x with at least k tokens of L >= x, by bisection
      long long lo = -top;
      for (int v = threadIdx.x; v < V; v += GEN_THREADS) {
        long long neg = -gen_big(lr, cr, v, s[3], s[4]);
        lo = neg > lo ? neg : lo;
      }
      lo = -gen_block_max(lo, sh);
      long long hi = top;
      while (lo < hi) {
        long long mid = lo + (hi - lo + 1) / 2;
        if (gen_count_at_least(lr, cr, V, mid, s[3], s[4], sh) >= s[2]) lo = mid;
        else hi = mid - 1;
      }
      kth = lo;
      ties = s[2] - (kth == top ? 0 : gen_count_at_least(lr, cr, V, kth + 1, s[3], s[4], sh));
    }
    long long total = gen_pass(lr, cr, V, top, kth, ties, s, exp_table, -1, sh);
    u64 r = combine(combine(key, (u64)samples[m]), (u64)position);
    long long threshold = (long long)(r % (u64)total);
    tok = gen_pass(lr, cr, V, top, kth, ties, s, exp_table, threshold, sh);
  }
  if (threadIdx.x == 0) {
    cur[m] = (int)tok;
    out[(long long)m * n_out + position] = (int)tok;
    cr[tok] += 1;
  }
}
