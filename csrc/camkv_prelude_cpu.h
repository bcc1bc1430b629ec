// CPU prelude of the camkv kernel core: a work group of one thread. Barriers are
// no-ops and group reductions are identities; the host runs rows in parallel
// across cores instead (csrc/camkv_primitive.cpp).

#ifndef CAMKV_PRELUDE_CPU_H
#define CAMKV_PRELUDE_CPU_H

#include <cmath>
#include <cstdint>
#include <limits>

#define CAMKV_DEVICE
#define CAMKV_CONSTANT
#define CAMKV_SHARED
#define CAMKV_INLINE inline
#define CAMKV_INF (std::numeric_limits<float>::infinity())
#define CAMKV_THREAD
// A lone thread dots 8 rows at once: 8 independent addition chains.
#define CAMKV_DOT_ROWS 8
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
inline float camkv_exp(float x) { return std::exp(x); }
inline float camkv_sqrt(float x) { return std::sqrt(x); }

// Storage dtype -> float32. Hosts may add faster overloads for their 16-bit types
// before including the core (csrc/camkv_primitive.cpp does for float16).
inline float camkv_mul(float a, float b) { return a * b; }
inline float camkv_madd(float acc, float a, float b) { return acc + a * b; }

template <typename T>
inline float camkv_float(T x) {
  return static_cast<float>(x);
}

#endif  // CAMKV_PRELUDE_CPU_H
