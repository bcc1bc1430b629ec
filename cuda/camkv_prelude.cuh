// CUDA prelude of the camkv kernel core: one thread block per row; reductions
// go through warp shuffles, then through shared memory across the warps (at most
// 32 of them, so 32 slots suffice). Empty address-space qualifiers.

#ifndef CAMKV_PRELUDE_CUDA_H
#define CAMKV_PRELUDE_CUDA_H

#define CAMKV_DEVICE
#define CAMKV_CONSTANT
#define CAMKV_SHARED
#define CAMKV_INLINE __device__ __forceinline__
#define CAMKV_INF __int_as_float(0x7f800000)
#define CAMKV_WARP 32
#define CAMKV_INT_MAX 2147483647
#define CAMKV_THREAD
#define CAMKV_DOT_ROWS 1
// Threads that share one loser's nearest-survivor search in a chunk (a team of
// consecutive lanes of a warp, each taking every 8th block of survivor columns): a
// compression of 65 losers then keeps 8x as many threads busy as one thread a loser.
#define CAMKV_LANES 8
// Bulk copies move 16-byte words where the range is aligned to them: a block of
// 256 threads then keeps 32 KiB of loads in flight instead of 4 KiB of halves.
#define CAMKV_WIDE 1

typedef unsigned int camkv_u32;

struct __align__(16) camkv_wide {
  unsigned int x, y, z, w;
};

template <typename P>
__device__ __forceinline__ bool camkv_wide_aligned(const P* p) {
  return ((unsigned long long)p & 15ull) == 0;
}

struct CamGroup {
  unsigned tid;
  unsigned size;
  float* red_f;  // CAMKV_WARP floats of __shared__ memory
  int* red_i;    // CAMKV_WARP ints of __shared__ memory
};

__device__ __forceinline__ int camkv_tid(CamGroup g) { return (int)g.tid; }
__device__ __forceinline__ int camkv_gsize(CamGroup g) { return (int)g.size; }
__device__ __forceinline__ void camkv_barrier(CamGroup) { __syncthreads(); }
__device__ __forceinline__ float camkv_exp(float x) { return expf(x); }
__device__ __forceinline__ float camkv_sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ float camkv_log(float x) { return logf(x); }

// Explicitly rounded: nvrtc would otherwise fuse a * b + c into one FMA and round
// differently from the CPU build.
__device__ __forceinline__ float camkv_mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float camkv_madd(float acc, float a, float b) { return __fadd_rn(acc, __fmul_rn(a, b)); }

template <typename T>
__device__ __forceinline__ float camkv_float(T x) {
  return static_cast<float>(x);
}

__device__ __forceinline__ float camkv_warp_sum(float x) {
  for (int offset = CAMKV_WARP / 2; offset > 0; offset /= 2) {
    x += __shfl_xor_sync(0xffffffffu, x, offset);
  }
  return x;
}

__device__ __forceinline__ float camkv_warp_max(float x) {
  for (int offset = CAMKV_WARP / 2; offset > 0; offset /= 2) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  }
  return x;
}

__device__ __forceinline__ int camkv_warp_min_int(int x) {
  for (int offset = CAMKV_WARP / 2; offset > 0; offset /= 2) {
    x = min(x, __shfl_xor_sync(0xffffffffu, x, offset));
  }
  return x;
}

// The team's smallest *value, ties to the smaller *index, into every lane's pair.
__device__ __forceinline__ void camkv_lane_best(CamGroup, float* value, int* index) {
  for (int offset = CAMKV_LANES / 2; offset > 0; offset /= 2) {
    float other = __shfl_xor_sync(0xffffffffu, *value, offset);
    int other_index = __shfl_xor_sync(0xffffffffu, *index, offset);
    if (other < *value || (other == *value && other_index < *index)) {
      *value = other;
      *index = other_index;
    }
  }
}

// Each warp reduces in registers; lane 0 parks its result; warp 0 reduces the
// parked results and parks the total in slot 0. Block size: a multiple of 32.
__device__ __forceinline__ float camkv_group_sum(CamGroup g, float x) {
  unsigned lane = g.tid % CAMKV_WARP;
  unsigned warp = g.tid / CAMKV_WARP;
  unsigned n_warps = (g.size + CAMKV_WARP - 1) / CAMKV_WARP;
  float part = camkv_warp_sum(x);
  __syncthreads();
  if (lane == 0) g.red_f[warp] = part;
  __syncthreads();
  if (warp == 0) {
    float total = camkv_warp_sum(lane < n_warps ? g.red_f[lane] : 0.0f);
    if (lane == 0) g.red_f[0] = total;
  }
  __syncthreads();
  return g.red_f[0];
}

__device__ __forceinline__ float camkv_group_max(CamGroup g, float x) {
  unsigned lane = g.tid % CAMKV_WARP;
  unsigned warp = g.tid / CAMKV_WARP;
  unsigned n_warps = (g.size + CAMKV_WARP - 1) / CAMKV_WARP;
  float part = camkv_warp_max(x);
  __syncthreads();
  if (lane == 0) g.red_f[warp] = part;
  __syncthreads();
  if (warp == 0) {
    float total = camkv_warp_max(lane < n_warps ? g.red_f[lane] : -CAMKV_INF);
    if (lane == 0) g.red_f[0] = total;
  }
  __syncthreads();
  return g.red_f[0];
}

// Smallest value, ties to the smaller index.
__device__ __forceinline__ int camkv_group_argmin(CamGroup g, float value, int index) {
  float lowest = -camkv_group_max(g, -value);
  unsigned lane = g.tid % CAMKV_WARP;
  unsigned warp = g.tid / CAMKV_WARP;
  unsigned n_warps = (g.size + CAMKV_WARP - 1) / CAMKV_WARP;
  int part = camkv_warp_min_int(value == lowest ? index : CAMKV_INT_MAX);
  __syncthreads();
  if (lane == 0) g.red_i[warp] = part;
  __syncthreads();
  if (warp == 0) {
    int total = camkv_warp_min_int(lane < n_warps ? g.red_i[lane] : CAMKV_INT_MAX);
    if (lane == 0) g.red_i[0] = total;
  }
  __syncthreads();
  return g.red_i[0];
}

#endif  // CAMKV_PRELUDE_CUDA_H
