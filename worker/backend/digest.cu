// The replica digest's leaves on the device (shared/replica.py): BLAKE2b-256 of each
// DIGEST_LEAF-byte piece of every tensor, so that the digest of a step needs no copy of
// the weights and the rule's state back to the host, only 32 bytes a leaf. BLAKE2b as
// RFC 7693 specifies it (no key, no salt, no personalisation), checked against hashlib.

__device__ __constant__ u64 BLAKE2B_IV[8] = {
    0x6a09e667f3bcc908ull, 0xbb67ae8584caa73bull, 0x3c6ef372fe94f82bull, 0xa54ff53a5f1d36f1ull,
    0x510e527fade682d1ull, 0x9b05688c2b3e6c1full, 0x1f83d9abfb41bd6bull, 0x5be0cd19137e2179ull};

__device__ __constant__ unsigned char BLAKE2B_SIGMA[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3}};

__device__ __forceinline__ u64 rotr64(u64 x, int n) { return (x >> n) | (x << (64 - n)); }

__device__ __forceinline__ void blake2b_g(u64* v, int a, int b, int c, int d, u64 x, u64 y) {
  v[a] += v[b] + x;
  v[d] = rotr64(v[d] ^ v[a], 32);
  v[c] += v[d];
  v[b] = rotr64(v[b] ^ v[c], 24);
  v[a] += v[b] + y;
  v[d] = rotr64(v[d] ^ v[a], 16);
  v[c] += v[d];
  v[b] = rotr64(v[b] ^ v[c], 63);
}

// One 128-byte block m into h; t bytes hashed so far including this block, last block.
__device__ void blake2b_compress(u64* h, const u64* m, u64 t, bool last) {
  u64 v[16];
  for (int i = 0; i < 8; i++) {
    v[i] = h[i];
    v[i + 8] = BLAKE2B_IV[i];
  }
  v[12] ^= t;  // messages are far below 2**64 bytes: the high counter word stays 0
  if (last) v[14] = ~v[14];
  for (int r = 0; r < 12; r++) {
    const unsigned char* s = BLAKE2B_SIGMA[r];
    blake2b_g(v, 0, 4, 8, 12, m[s[0]], m[s[1]]);
    blake2b_g(v, 1, 5, 9, 13, m[s[2]], m[s[3]]);
    blake2b_g(v, 2, 6, 10, 14, m[s[4]], m[s[5]]);
    blake2b_g(v, 3, 7, 11, 15, m[s[6]], m[s[7]]);
    blake2b_g(v, 0, 5, 10, 15, m[s[8]], m[s[9]]);
    blake2b_g(v, 1, 6, 11, 12, m[s[10]], m[s[11]]);
    blake2b_g(v, 2, 7, 8, 13, m[s[12]], m[s[13]]);
    blake2b_g(v, 3, 4, 9, 14, m[s[14]], m[s[15]]);
  }
  for (int i = 0; i < 8; i++) h[i] ^= v[i] ^ v[i + 8];
}

// out[i] (4 words, little-endian: the 32 digest bytes) = BLAKE2b-256 of the length[i]
// bytes at address[i] (device addresses, 8-byte aligned). Launch: grid (ceil(leaves / 64)),
// block (64): a thread per leaf.
extern "C" __global__ void digest_leaves(const u64* address, const long long* length,
                                         int leaves, u64* out) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= leaves) return;
  const unsigned char* data = (const unsigned char*)address[i];
  long long n = length[i];
  u64 h[8], m[16];
  for (int j = 0; j < 8; j++) h[j] = BLAKE2B_IV[j];
  h[0] ^= 0x01010000ull ^ 32;  // digest length 32, no key, fanout and depth 1
  long long done = 0;
  while (n - done > 128) {  // every block but the last, whole
    const u64* words = (const u64*)(data + done);
    for (int j = 0; j < 16; j++) m[j] = words[j];
    done += 128;
    blake2b_compress(h, m, (u64)done, false);
  }
  for (int j = 0; j < 16; j++) m[j] = 0;  // the last block, zero-padded, byte by byte
  for (long long k = done; k < n; k++) m[(k - done) >> 3] |= (u64)data[k] << (8 * ((k - done) & 7));
  blake2b_compress(h, m, (u64)n, true);
  for (int j = 0; j < 4; j++) out[4 * i + j] = h[j];
}
