// Metal prelude of the camkv kernel core: one threadgroup per row; reductions
// go through simdgroup intrinsics, then through threadgroup memory across the
// simdgroups (at most 32 of them, so 32 slots suffice).

#ifndef CAMKV_PRELUDE_METAL_H
#define CAMKV_PRELUDE_METAL_H

#include <metal_stdlib>
using namespace metal;

#define CAMKV_DEVICE device
// mx.fast.metal_kernel (camkv.backends.jit) hands the parameter block over as a device
// buffer: it has more than the 8 elements below which MLX declares an input constant.
#define CAMKV_CONSTANT device
#define CAMKV_SHARED threadgroup
#define CAMKV_INLINE inline
#define CAMKV_INF INFINITY
#define CAMKV_SIMD_WIDTH 32
#define CAMKV_THREAD thread
#define CAMKV_DOT_ROWS 1
// Threads that share one loser's nearest-survivor search in a chunk (a team of
// consecutive lanes of a simdgroup).
#define CAMKV_LANES 8
// Element-wide copies: MSL has no portable pointer-to-integer test for 16-byte alignment.
#define CAMKV_WIDE 0

typedef uint camkv_u32;

struct CamGroup {
  uint tid;
  uint size;
  threadgroup float* red_f;  // CAMKV_SIMD_WIDTH floats
  threadgroup int* red_i;    // CAMKV_SIMD_WIDTH ints
};

inline int camkv_tid(CamGroup g) { return (int)g.tid; }
inline int camkv_gsize(CamGroup g) { return (int)g.size; }

inline void camkv_barrier(CamGroup g) {
  threadgroup_barrier(mem_flags::mem_device | mem_flags::mem_threadgroup);
}

inline float camkv_exp(float x) { return precise::exp(x); }
inline float camkv_sqrt(float x) { return precise::sqrt(x); }
inline float camkv_log(float x) { return precise::log(x); }

inline float camkv_mul(float a, float b) { return a * b; }
inline float camkv_madd(float acc, float a, float b) { return acc + a * b; }

template <typename T>
inline float camkv_float(T x) {
  return float(x);
}

// The team's smallest *value, ties to the smaller *index, into every lane's pair.
inline void camkv_lane_best(CamGroup, thread float* value, thread int* index) {
  for (ushort offset = CAMKV_LANES / 2; offset > 0; offset /= 2) {
    float other = simd_shuffle_xor(*value, offset);
    int other_index = simd_shuffle_xor(*index, offset);
    if (other < *value || (other == *value && other_index < *index)) {
      *value = other;
      *index = other_index;
    }
  }
}

// Each simdgroup reduces in registers; lane 0 parks its result; the first
// simdgroup reduces the parked results and parks the total in slot 0.
inline float camkv_group_sum(CamGroup g, float x) {
  uint lane = g.tid % CAMKV_SIMD_WIDTH;
  uint simd = g.tid / CAMKV_SIMD_WIDTH;
  uint n_simd = (g.size + CAMKV_SIMD_WIDTH - 1) / CAMKV_SIMD_WIDTH;
  float part = simd_sum(x);
  camkv_barrier(g);
  if (lane == 0) {
    g.red_f[simd] = part;
  }
  camkv_barrier(g);
  if (simd == 0) {
    float total = simd_sum(lane < n_simd ? g.red_f[lane] : 0.0f);
    if (lane == 0) {
      g.red_f[0] = total;
    }
  }
  camkv_barrier(g);
  return g.red_f[0];
}

inline float camkv_group_max(CamGroup g, float x) {
  uint lane = g.tid % CAMKV_SIMD_WIDTH;
  uint simd = g.tid / CAMKV_SIMD_WIDTH;
  uint n_simd = (g.size + CAMKV_SIMD_WIDTH - 1) / CAMKV_SIMD_WIDTH;
  float part = simd_max(x);
  camkv_barrier(g);
  if (lane == 0) {
    g.red_f[simd] = part;
  }
  camkv_barrier(g);
  if (simd == 0) {
    float total = simd_max(lane < n_simd ? g.red_f[lane] : -INFINITY);
    if (lane == 0) {
      g.red_f[0] = total;
    }
  }
  camkv_barrier(g);
  return g.red_f[0];
}

// Smallest value, ties to the smaller index: the minimum value first, then the
// smallest index among the threads that hold it.
inline int camkv_group_argmin(CamGroup g, float value, int index) {
  float lowest = -camkv_group_max(g, -value);
  uint lane = g.tid % CAMKV_SIMD_WIDTH;
  uint simd = g.tid / CAMKV_SIMD_WIDTH;
  uint n_simd = (g.size + CAMKV_SIMD_WIDTH - 1) / CAMKV_SIMD_WIDTH;
  int candidate = value == lowest ? index : INT_MAX;
  int part = simd_min(candidate);
  camkv_barrier(g);
  if (lane == 0) {
    g.red_i[simd] = part;
  }
  camkv_barrier(g);
  if (simd == 0) {
    int total = simd_min(lane < n_simd ? g.red_i[lane] : INT_MAX);
    if (lane == 0) {
      g.red_i[0] = total;
    }
  }
  camkv_barrier(g);
  return g.red_i[0];
}

#endif  // CAMKV_PRELUDE_METAL_H
