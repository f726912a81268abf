// noise.cu (shared/noise.py, perturb.py, window.py): each pair's noise for a forward pass,
// the update's transposed noise and vector sums, and the windows gathered on the device.
// After common.cuh.

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
