// rules.cu (shared/rules/): each update rule's apply kernel (ztest, momentum, adamw) and
// the adaptive-noise overlays' step (perturb.py).

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
