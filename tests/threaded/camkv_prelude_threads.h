// Test-only prelude: the kernel core run by a group of real CPU threads, the way a
// GPU runs it (several threads per row, barriers, group reductions, teams of
// CAMKV_THREADS_LANES threads per nearest-survivor search), so the core's multi-thread code paths are
// checked on machines without a GPU (tests/test_threaded_core.py).
// CAMKV_THREADS_WIDE=1 takes the CUDA prelude's 16-byte loads, 0 the Metal
// prelude's element loads.
// Reductions combine per-thread values in thread order: deterministic, but not the
// GPU's tree order, so sums may differ from a GPU's in the last bits.

#ifndef CAMKV_PRELUDE_THREADS_H
#define CAMKV_PRELUDE_THREADS_H

#include <barrier>
#include <cmath>
#include <cstdint>
#include <limits>

#define CAMKV_DEVICE
#define CAMKV_CONSTANT
#define CAMKV_SHARED
#define CAMKV_INLINE inline
#define CAMKV_INF (std::numeric_limits<float>::infinity())
#define CAMKV_THREAD
#define CAMKV_DOT_ROWS 1
#define CAMKV_WIDE CAMKV_THREADS_WIDE
// Threads sharing one nearest-survivor search (a GPU prelude's team); CAMKV_THREADS_LANES picks it.
#ifndef CAMKV_THREADS_LANES
#define CAMKV_THREADS_LANES 1
#endif
#define CAMKV_LANES CAMKV_THREADS_LANES

typedef uint32_t camkv_u32;

struct alignas(16) camkv_wide {
  uint32_t x, y, z, w;
};

template <typename P>
inline bool camkv_wide_aligned(const P* p) {
  return ((uintptr_t)p & 15u) == 0;
}

struct CamGroup {
  unsigned tid;
  unsigned size;
  std::barrier<>* sync;  // shared by the group
  float* red_f;          // size floats, shared
  int* red_i;            // size ints, shared
};

inline int camkv_tid(CamGroup g) { return (int)g.tid; }
inline int camkv_gsize(CamGroup g) { return (int)g.size; }
inline void camkv_barrier(CamGroup g) { g.sync->arrive_and_wait(); }
inline float camkv_exp(float x) { return std::exp(x); }
inline float camkv_sqrt(float x) { return std::sqrt(x); }
inline float camkv_log(float x) { return std::log(x); }
inline float camkv_mul(float a, float b) { return a * b; }
inline float camkv_madd(float acc, float a, float b) { return acc + a * b; }

template <typename T>
inline float camkv_float(T x) {
  return static_cast<float>(x);
}

// Every thread parks its value, then every thread folds them all in thread order.
inline float camkv_group_sum(CamGroup g, float x) {
  g.red_f[g.tid] = x;
  camkv_barrier(g);
  float total = 0.0f;
  for (unsigned t = 0; t < g.size; ++t) total += g.red_f[t];
  camkv_barrier(g);  // the slots are free again
  return total;
}

inline float camkv_group_max(CamGroup g, float x) {
  g.red_f[g.tid] = x;
  camkv_barrier(g);
  float best = -CAMKV_INF;
  for (unsigned t = 0; t < g.size; ++t) best = g.red_f[t] > best ? g.red_f[t] : best;
  camkv_barrier(g);
  return best;
}

// The team's smallest *value, ties to the smaller *index, into every member's pair.
inline void camkv_lane_best(CamGroup g, float* value, int* index) {
  g.red_f[g.tid] = *value;
  g.red_i[g.tid] = *index;
  camkv_barrier(g);
  unsigned first = g.tid - g.tid % CAMKV_LANES;
  for (unsigned t = first; t < first + CAMKV_LANES; ++t) {
    if (g.red_f[t] < *value || (g.red_f[t] == *value && g.red_i[t] < *index)) {
      *value = g.red_f[t];
      *index = g.red_i[t];
    }
  }
  camkv_barrier(g);
}

// Smallest value, ties to the smaller index.
inline int camkv_group_argmin(CamGroup g, float value, int index) {
  g.red_f[g.tid] = value;
  g.red_i[g.tid] = index;
  camkv_barrier(g);
  float best = CAMKV_INF;
  int best_i = std::numeric_limits<int>::max();
  for (unsigned t = 0; t < g.size; ++t) {
    float v = g.red_f[t];
    if (v < best || (v == best && g.red_i[t] < best_i)) {
      best = v;
      best_i = g.red_i[t];
    }
  }
  camkv_barrier(g);
  return best_i;
}

#endif  // CAMKV_PRELUDE_THREADS_H
