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

inline void camkv_barrier(CamGroup) {}
inline float camkv_group_sum(CamGroup, float x) { return x; }
inline float camkv_group_max(CamGroup, float x) { return x; }
inline int camkv_group_argmin(CamGroup, float, int index) { return index; }
inline float camkv_exp(float x) { return std::exp(x); }
inline float camkv_sqrt(float x) { return std::sqrt(x); }

#endif  // CAMKV_PRELUDE_CPU_H
