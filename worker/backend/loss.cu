// loss.cu (shared/loss.py): a forward pass's token loss and the held-out logit counts.

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
