// CPU prelude of the camkv kernel core: a work group of one thread. Barriers are
// no-ops and group reductions are identities; the host runs rows in parallel
// across cores instead (csrc/camkv_primitive.cpp).

#ifndef CAMKV_PRELUDE_CPU_H
#define CAMKV_PRELUDE_CPU_H

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#define CAMKV_DEVICE
#define CAMKV_CONSTANT
#define CAMKV_SHARED
#define CAMKV_INLINE inline
#define CAMKV_INF (std::numeric_limits<float>::infinity())
#define CAMKV_THREAD
// A lone thread dots 8 rows at once: 8 independent addition chains.
#define CAMKV_DOT_ROWS 8
// One thread a search: teams of one lane (the lane reduction is an identity), whose
// nearest-survivor search dots every column at once (camkv_nearest_alone).
#define CAMKV_LANES 1
#define CAMKV_HOST_SEARCH 1
// Plain element loops: the compiler vectorises them itself.
#define CAMKV_WIDE 0

typedef uint32_t camkv_u32;

struct CamGroup {
  unsigned tid;   // always 0
  unsigned size;  // always 1
};

inline CamGroup camkv_single_thread_group() {
  CamGroup g;
  g.tid = 0;
  g.size = 1;
  return g;
}

// Compile-time 0 and 1, so the core's strided loops become plain (vectorisable) loops.
constexpr int camkv_tid(CamGroup) { return 0; }
constexpr int camkv_gsize(CamGroup) { return 1; }
inline void camkv_barrier(CamGroup) {}
inline float camkv_group_sum(CamGroup, float x) { return x; }
inline float camkv_group_max(CamGroup, float x) { return x; }
inline int camkv_group_argmin(CamGroup, float, int index) { return index; }
inline void camkv_lane_best(CamGroup, float*, int*) {}
inline float camkv_exp(float x) { return std::exp(x); }
inline float camkv_sqrt(float x) { return std::sqrt(x); }
inline float camkv_log(float x) { return std::log(x); }

// Storage dtype -> float32. Hosts may add faster overloads for their 16-bit types
// before including the core (csrc/camkv_primitive.cpp does for float16).
inline float camkv_mul(float a, float b) { return a * b; }
inline float camkv_madd(float acc, float a, float b) { return acc + a * b; }

template <typename T>
inline float camkv_float(T x) {
  return static_cast<float>(x);
}

// Loser selection of one thread a row (camkv_mark_losers): the k lowest of the
// candidates put, ordered by (rank, row) as the pairwise rule orders them, flagged in
// loser[row]. The candidates live in a per-thread vector (rows run on pool threads).
#define CAMKV_HOST_SELECT 1
static inline std::vector<std::pair<float, int>>& camkv_select_buffer() {
  static thread_local std::vector<std::pair<float, int>> buffer;
  return buffer;
}
static inline void camkv_select_put(int i, float rank, int row) {
  auto& buffer = camkv_select_buffer();
  if ((int)buffer.size() <= i) buffer.resize(i + 1);
  buffer[i] = {rank, row};
}
static inline void camkv_select_lowest(int candidates, int k, int* loser) {
  auto& buffer = camkv_select_buffer();
  int losers = k < candidates ? k : candidates;
  if (losers <= 0) return;
  std::nth_element(buffer.begin(), buffer.begin() + (losers - 1), buffer.begin() + candidates);
  for (int i = 0; i < losers; ++i) loser[buffer[i].second] = 1;
}

#endif  // CAMKV_PRELUDE_CPU_H
