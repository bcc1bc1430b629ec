// camkv portable kernel core: docs/algorithm.md sections 2 to 7 for ONE row (one
// batch element and KV head), executed by one work group whose threads cooperate
// over the stored rows.
//
// Written once in the common subset of C++, Metal and CUDA: no lambdas, no
// recursion, no dynamic allocation, templates only for the storage dtype, every
// pointer qualified through an address-space macro. A prelude included before
// this file supplies:
//   CAMKV_DEVICE, CAMKV_CONSTANT, CAMKV_SHARED   address-space qualifiers
//   CAMKV_INLINE                                  function qualifier
//   camkv_u32                                     32-bit unsigned integer
//   CamGroup                                      {tid, size, shared scratch}
//   camkv_tid(g), camkv_gsize(g)                  thread index and group size (int)
//   camkv_barrier(g)                              group barrier
//   camkv_group_sum(g, x), camkv_group_max(g, x)  float reductions
//   camkv_group_argmin(g, v, i)                   smallest v, ties to smaller i
//   camkv_exp(x), camkv_log(x), camkv_sqrt(x),
//   CAMKV_INF                                     float32 math
//   camkv_float(x)                                storage dtype -> float32
//   camkv_mul(a, b), camkv_madd(acc, a, b)        a * b and acc + a * b, each product and sum
//                                                 rounded on its own (never fused), so every
//                                                 target rounds dot products and blends alike
//   CAMKV_THREAD                                  qualifier of thread-local arrays
//   CAMKV_DOT_ROWS                                rows one thread dots at once
//   CAMKV_LANES                                   threads of a team that share one
//                                                 nearest-survivor search of a chunk
//   camkv_lane_best(g, &v, &i)                    the team's smallest v, ties to smaller i
// All arithmetic is float32; keys and values are rounded to the storage dtype
// once per merge, exactly as the reference does.
//
// Control flow that contains a barrier or a group reduction depends only on
// values every thread of the group agrees on (loop counts, reduced results).

#ifndef CAMKV_CORE_H
#define CAMKV_CORE_H

#include "camkv_merges.h"

// Largest head dimension the core accepts (the hosts reject larger ones).
#define CAMKV_MAX_HEAD_DIM 256

// Most threads a row's group may have (a chunk call keeps one count per thread).
#define CAMKV_MAX_GROUP 1024

// Queries one scoring pass takes together (a model's G queries per KV head go in
// blocks of this many): each key row is then read once per block, not once per
// query, and a GPU thread has that many independent sums in flight.
#define CAMKV_QUERY_BLOCK 4

// Everything a launch needs besides the buffers. Plain ints so the layout is the
// same on every host and device (camkv_u32 is 32 bits everywhere). One
// X(type, name) per field, in layout order: the GPU hosts pack the block as words
// from a field list of their own (python/camkv/backends/jit.py PARAM_FIELDS), which
// tests check against this one through camkv._ext.params_layout().
#define CAMKV_PARAM_FIELDS(X)                                                     \
  X(int, rows)         /* R = B * H */                                            \
  X(int, n)            /* stored tokens per row before the call */                \
  X(int, S)            /* new tokens per row in this call */                      \
  X(int, Dk)           /* key (and query) dimension */                            \
  X(int, Dv)           /* value dimension */                                      \
  X(int, G)            /* queries per token (1 for key scoring) */                \
  X(int, n_out)        /* stored tokens after the call: min(n + S, budget) */     \
  X(int, budget)                                                                  \
  X(int, n_sink)                                                                  \
  X(int, recent)                                                                  \
  X(int, window)                                                                  \
  X(int, merge)        /* a rule's code in CAMKV_MERGE_RULES (camkv_merges.h) */  \
  X(int, merge_keys)   /* 1: blend keys too (rules with keys_allowed) */          \
  X(int, gate)         /* 1: Bernoulli gate of section 4.3 */                     \
  X(int, chunk)        /* 1: prefill "chunk" (a call with S == 1 runs exact) */   \
  X(int, key_scoring)  /* 1: each new key is its token's one query */             \
  X(int, in_place)     /* 1: out state buffers already hold the stored rows */    \
  X(int, offset)       /* absolute position of the first new token */             \
  X(int, prescored)    /* 1: chunk mode's mass comes precomputed (chunk_mass) */  \
  X(camkv_u32, seed)                                                              \
  X(float, scale)      /* attention scale of the logits */                        \
  X(int, f32_stride)   /* floats of scratch per row */                            \
  X(int, i32_stride)   /* ints of scratch per row */                              \
  X(int, store_stride) /* storage-dtype elements of scratch per row */            \
  X(int, recency)      /* 1: eviction "recency" (the oldest candidate first) */   \
  X(int, observe)      /* a chunk's last queries that score it (1..S) */          \
  X(int, pool)         /* max-pooling width of a chunk's mass (1: none) */

#define CAMKV_PARAM_MEMBER(type, name) type name;
struct CamParams {
  CAMKV_PARAM_FIELDS(CAMKV_PARAM_MEMBER)
};
#undef CAMKV_PARAM_MEMBER

// ----------------------------------------------------------------------------
// Scratch layout (one definition for every host): per row, f32 scratch holds
// [logits (CAMKV_QUERY_BLOCK runs of the capacity; in a chunk's merge phase the losers'
// cosines and shares and the targets' totals and keeps) | mass (in a chunk's merge phase
// keepkv's group maxima per target) | scores (the pending token's, then its vote; or the
// chunk's work scores) | key shadow | (chunk) survivors' squared norms | (chunk) work
// votes | the compression's query, Dk floats (keepkv)],
// i32 scratch [work positions | losers | index list | survivors | (chunk) merge targets |
// (chunk) counts per target | (chunk) losers by target | (chunk) starts per target, one
// more | (chunk) one count per thread], storage scratch the pending token (exact) or the
// work rows (chunk).

#if CAMKV_QUERY_BLOCK < 4
#error "CAMKV_QUERY_BLOCK must be at least 4: a chunk's merge phase keeps four arrays in the logits' scratch"
#endif

// Where a chunk's i32 scratch's per-thread counts start, in capacities (plus one).
#define CAMKV_I32_GROUP_COUNTS 8

CAMKV_INLINE int camkv_runs_chunk(int chunk, int S) { return chunk != 0 && S > 1; }

// Rows the per-row arrays must hold: every row a softmax or a merge can see.
CAMKV_INLINE int camkv_capacity(int chunk, int n, int S, int n_out) {
  return camkv_runs_chunk(chunk, S) ? n + S : n_out + 1;
}

// Columns of the transposed key shadow: the capacity rounded up, plus room for a
// last block of up to 8 rows read past the end (ignored).
#if CAMKV_DOT_ROWS > 8
#error "CAMKV_DOT_ROWS must be at most 8: the shadow pads for blocks of 8 columns"
#endif
CAMKV_INLINE int camkv_shadow_columns(int chunk, int n, int S, int n_out) {
  return (camkv_capacity(chunk, n, S, n_out) + 7) / 8 * 8 + 8;
}

// Where the f32 scratch's parts start, in capacities (see the layout above).
#define CAMKV_F32_MASS CAMKV_QUERY_BLOCK
#define CAMKV_F32_SCORES (CAMKV_QUERY_BLOCK + 1)
#define CAMKV_F32_SHADOW (CAMKV_QUERY_BLOCK + 2)

// A call of one token reads every key once and builds no shadow (see
// camkv_update_exact), so its scratch has none.
// A chunk's merge phase adds two floats per row (squared norms, work votes) and four
// ints per row plus one (camkv_merge_scratch), and one int per thread.

// Where the f32 scratch's query (its last Dk floats) starts; a chunk's work votes are
// the capacity before it.
CAMKV_INLINE int camkv_f32_query_at(int chunk, int n, int S, int n_out, int Dk) {
  int shadow = S > 1 ? Dk * camkv_shadow_columns(chunk, n, S, n_out) : 0;
  int cap = camkv_capacity(chunk, n, S, n_out);
  return CAMKV_F32_SHADOW * cap + shadow + (camkv_runs_chunk(chunk, S) ? 2 * cap : 0);
}

CAMKV_INLINE int camkv_f32_stride(int chunk, int n, int S, int n_out, int Dk) {
  return camkv_f32_query_at(chunk, n, S, n_out, Dk) + Dk;
}

CAMKV_INLINE int camkv_i32_stride(int chunk, int n, int S, int n_out) {
  int cap = camkv_capacity(chunk, n, S, n_out);
  return camkv_runs_chunk(chunk, S) ? CAMKV_I32_GROUP_COUNTS * cap + 1 + CAMKV_MAX_GROUP : 4 * cap;
}

CAMKV_INLINE int camkv_store_stride(int chunk, int n, int S, int n_out, int Dk, int Dv) {
  if (camkv_runs_chunk(chunk, S)) {
    return (n + S) * (Dk + Dv);
  }
  return Dk + Dv;
}

// ----------------------------------------------------------------------------
// Section 6: deterministic draws

CAMKV_INLINE camkv_u32 camkv_mix(camkv_u32 x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

CAMKV_INLINE float camkv_uniform(camkv_u32 seed, camkv_u32 row, int position) {
  camkv_u32 h = camkv_mix(camkv_mix(camkv_mix(((camkv_u32)position) ^ 0x9e3779b9u) ^ row) ^ seed);
  return (float)(h >> 8) * 5.9604644775390625e-08f;  // 2^-24
}

// ----------------------------------------------------------------------------
// Small float32 helpers, one thread each

// Sequential float32 sums in feature order: the order the reference's own
// reductions use on the CPU, so dot products (and the cosines and blend weights
// built from them) come out bit-identical there.
//
// On a GPU one thread owns a row's dot, so its loads are what limit it: with
// 16-byte words (CAMKV_WIDE) it loads 8 features per instruction instead of one,
// still summing them in order.
#if CAMKV_WIDE
// Features [0, 8) of p as float32, through 16-byte loads (p 16-byte aligned).
template <typename T>
CAMKV_INLINE void camkv_load8(const CAMKV_DEVICE T* p, CAMKV_THREAD float* out) {
  alignas(16) T held[8];
  const CAMKV_DEVICE camkv_wide* src = (const CAMKV_DEVICE camkv_wide*)p;
  CAMKV_THREAD camkv_wide* dst = (CAMKV_THREAD camkv_wide*)held;
  for (int w = 0; w < (int)(8 * sizeof(T) / 16); ++w) {
    dst[w] = src[w];
  }
  for (int i = 0; i < 8; ++i) {
    out[i] = camkv_float(held[i]);
  }
}

template <typename A, typename B>
CAMKV_INLINE bool camkv_wide_rows(const CAMKV_DEVICE A* a, const CAMKV_DEVICE B* b, int len) {
  return len % 8 == 0 && camkv_wide_aligned(a) && camkv_wide_aligned(b);
}

// Adds 8 features of a key (kv, already loaded) times the same features of each
// of the nq queries q + k * q_stride into dots[k], in feature order; and the key's
// own squares into *square.
template <typename Q>
CAMKV_INLINE void camkv_madd8(const CAMKV_DEVICE Q* q, int q_stride, int nq, CAMKV_THREAD const float* kv,
                              CAMKV_THREAD float* dots, CAMKV_THREAD float* square, bool with_square) {
  for (int k = 0; k < CAMKV_QUERY_BLOCK; ++k) {
    if (k < nq) {
      float qv[8];
      camkv_load8(q + (long)k * q_stride, qv);
      for (int i = 0; i < 8; ++i) {
        dots[k] = camkv_madd(dots[k], qv[i], kv[i]);
      }
    }
  }
  if (with_square) {
    for (int i = 0; i < 8; ++i) {
      *square = camkv_madd(*square, kv[i], kv[i]);
    }
  }
}

// dots[k] = q_k . key for the nq (<= CAMKV_QUERY_BLOCK) queries q + k * q_stride,
// and key . key, each in feature order (the caller checked camkv_wide_rows and
// q_stride % 8 == 0). The key comes in 32 features at a time, four loads in flight
// together: one load waited for per 8 features left a thread idle most of a dot.
template <typename Q, typename T>
CAMKV_INLINE void camkv_dots_wide(const CAMKV_DEVICE Q* q, int q_stride, int nq, const CAMKV_DEVICE T* key, int len,
                                  CAMKV_THREAD float* dots, CAMKV_THREAD float* square, bool with_square) {
  float sq = 0.0f;
  float kv[32];
  for (int k = 0; k < CAMKV_QUERY_BLOCK; ++k) {
    dots[k] = 0.0f;
  }
  int d0 = 0;
  for (; d0 + 32 <= len; d0 += 32) {
    for (int w = 0; w < 4; ++w) {
      camkv_load8(key + d0 + 8 * w, kv + 8 * w);
    }
    for (int w = 0; w < 4; ++w) {
      camkv_madd8(q + d0 + 8 * w, q_stride, nq, kv + 8 * w, dots, &sq, with_square);
    }
  }
  for (; d0 < len; d0 += 8) {
    camkv_load8(key + d0, kv);
    camkv_madd8(q + d0, q_stride, nq, kv, dots, &sq, with_square);
  }
  *square = sq;
}
#endif

template <typename A, typename B>
CAMKV_INLINE float camkv_dot(const CAMKV_DEVICE A* a, const CAMKV_DEVICE B* b, int len) {
#if CAMKV_WIDE
  if (camkv_wide_rows(a, b, len)) {
    float dots[CAMKV_QUERY_BLOCK], unused;
    camkv_dots_wide(a, 0, 1, b, len, dots, &unused, false);
    return dots[0];
  }
#endif
  float sum = 0.0f;
  for (int d = 0; d < len; ++d) {
    sum = camkv_madd(sum, camkv_float(a[d]), camkv_float(b[d]));
  }
  return sum;
}

// The L2 norm of a row of len elements, its squares summed in feature order (as camkv_dot).
template <typename T>
CAMKV_INLINE float camkv_norm(const CAMKV_DEVICE T* v, int len) {
  return camkv_sqrt(camkv_dot(v, v, len));
}

// Copy one row of len elements, the group's threads striding over columns.
template <typename T>
CAMKV_INLINE void camkv_copy_row(CAMKV_DEVICE T* dst, const CAMKV_DEVICE T* src, int len, CamGroup g) {
  for (int d = camkv_tid(g); d < len; d += camkv_gsize(g)) {
    dst[d] = src[d];
  }
}

// ----------------------------------------------------------------------------
// Bulk data movement (no algorithm here). Every thread of the group strides one
// flat range and keeps CAMKV_UNROLL loads in flight before it stores: copying a
// state one row at a time left a GPU with a row's width of parallelism and one
// dependent step per row. Where the prelude offers 16-byte words (CAMKV_WIDE) and
// the range is aligned to them, the same loops move words instead of elements.

#define CAMKV_UNROLL 8

// dst[i] = src[i] for i < len; the ranges do not overlap.
template <typename T>
CAMKV_INLINE void camkv_copy_elements(CAMKV_DEVICE T* dst, const CAMKV_DEVICE T* src, long len, CamGroup g) {
  long stride = (long)camkv_gsize(g);
  T held[CAMKV_UNROLL];
  for (long base = camkv_tid(g); base < len; base += stride * CAMKV_UNROLL) {
    for (int k = 0; k < CAMKV_UNROLL; ++k) {
      if (base + k * stride < len) {
        held[k] = src[base + k * stride];
      }
    }
    for (int k = 0; k < CAMKV_UNROLL; ++k) {
      if (base + k * stride < len) {
        dst[base + k * stride] = held[k];
      }
    }
  }
}

template <typename T>
CAMKV_INLINE void camkv_copy_flat(CAMKV_DEVICE T* dst, const CAMKV_DEVICE T* src, long len, CamGroup g) {
#if CAMKV_WIDE
  long bytes = len * (long)sizeof(T);
  if (bytes % 16 == 0 && camkv_wide_aligned(dst) && camkv_wide_aligned(src)) {
    camkv_copy_elements((CAMKV_DEVICE camkv_wide*)dst, (const CAMKV_DEVICE camkv_wide*)src, bytes / 16, g);
    return;
  }
#endif
  camkv_copy_elements(dst, src, len, g);
}

// Elements [begin, end) of a move to [begin - by, end - by) (by > 0), in rounds of
// gsize * CAMKV_UNROLL elements: every thread loads its part of a round, one
// barrier, then stores. A store lands below the round's own range or on elements
// this or an earlier round already loaded, and the next round loads above every
// store of this one, so one barrier per round suffices. Ends with a barrier.
template <typename T>
CAMKV_INLINE void camkv_move_elements_down(CAMKV_DEVICE T* a, long begin, long end, long by, CamGroup g) {
  long stride = (long)camkv_gsize(g);
  T held[CAMKV_UNROLL];
  for (long round = begin; round < end; round += stride * CAMKV_UNROLL) {
    long first = round + camkv_tid(g);
    for (int k = 0; k < CAMKV_UNROLL; ++k) {
      if (first + k * stride < end) {
        held[k] = a[first + k * stride];
      }
    }
    camkv_barrier(g);
    for (int k = 0; k < CAMKV_UNROLL; ++k) {
      if (first + k * stride < end) {
        a[first + k * stride - by] = held[k];
      }
    }
  }
  camkv_barrier(g);
}

// Rows [from + 1, to) of row_len elements each move down one row (memmove).
template <typename T>
CAMKV_INLINE void camkv_move_rows_down(CAMKV_DEVICE T* a, int from, int to, int row_len, CamGroup g) {
  long begin = (long)(from + 1) * row_len;
  long end = (long)to * row_len;
#if CAMKV_WIDE
  long unit = 16 / (long)sizeof(T);
  if (((long)row_len * (long)sizeof(T)) % 16 == 0 && camkv_wide_aligned(a)) {
    camkv_move_elements_down((CAMKV_DEVICE camkv_wide*)a, begin / unit, end / unit, (long)row_len / unit, g);
    return;
  }
#endif
  camkv_move_elements_down(a, begin, end, (long)row_len, g);
}

// dst row c := src row rows[c] for c < count (row_len elements each; no overlap).
template <typename T>
CAMKV_INLINE void camkv_gather_elements(CAMKV_DEVICE T* dst, const CAMKV_DEVICE T* src,
                                        const CAMKV_DEVICE int* rows, int count, long row_len, CamGroup g) {
  long len = (long)count * row_len;
  for (long f = camkv_tid(g); f < len; f += camkv_gsize(g)) {
    long c = f / row_len;
    dst[f] = src[(long)rows[c] * row_len + (f - c * row_len)];
  }
}

template <typename T>
CAMKV_INLINE void camkv_gather_rows(CAMKV_DEVICE T* dst, const CAMKV_DEVICE T* src,
                                    const CAMKV_DEVICE int* rows, int count, int row_len, CamGroup g) {
#if CAMKV_WIDE
  long bytes = (long)row_len * (long)sizeof(T);
  if (bytes % 16 == 0 && camkv_wide_aligned(dst) && camkv_wide_aligned(src)) {
    camkv_gather_elements((CAMKV_DEVICE camkv_wide*)dst, (const CAMKV_DEVICE camkv_wide*)src, rows, count, bytes / 16, g);
    return;
  }
#endif
  camkv_gather_elements(dst, src, rows, count, (long)row_len, g);
}

// ----------------------------------------------------------------------------
// A row view: the arrays one merge works on. In exact mode the token being
// absorbed is a "pending" row at index `count` that lives in scratch; in chunk
// mode every row is in the work arrays and `loser` marks rows that receive nothing.

template <typename T>
struct CamRows {
  CAMKV_DEVICE T* keys;        // [count, Dk]
  CAMKV_DEVICE T* values;      // [count, Dv]
  CAMKV_DEVICE float* scores;  // [count]
  CAMKV_DEVICE int* positions; // [count]
  int count;
  int has_pending;
  CAMKV_DEVICE T* pend_key;
  CAMKV_DEVICE T* pend_value;
  CAMKV_DEVICE float* pend_score;
  int pend_position;
  CAMKV_DEVICE int* loser;     // null in exact mode
  CAMKV_DEVICE int* list;      // scratch index list (window members)
  CAMKV_DEVICE float* cosines; // scratch: the nearest search's cosine per search column
  CAMKV_DEVICE int* survivors; // chunk mode: the rows that are not losers, ascending
  CAMKV_DEVICE int* group_counts; // chunk mode: CAMKV_MAX_GROUP ints of scratch (camkv_list_rows)
  int n_survivors;
  // A rule's state (camkv_merges.h): votes [count] (0 unless the rule keeps votes; the
  // pending token's in *pend_vote), the row's threshold (0 unless it moves one).
  CAMKV_DEVICE float* votes;
  CAMKV_DEVICE float* pend_vote;
  CAMKV_DEVICE float* threshold;
  // keepkv: the compression's query (Dk floats of scratch) and where the pending token's
  // G queries are (exact mode with query scoring).
  CAMKV_DEVICE float* query;
  const CAMKV_DEVICE float* pend_queries;
  // Float32 copy of the keys, transposed: shadow[d * columns + c] is feature d of
  // column c (row c, or in a chunk's merge phase the c-th survivor). Dots then read
  // consecutive columns: SIMD lanes on a CPU, coalesced threads on a GPU, and no
  // storage-dtype conversion in the inner loops.
  CAMKV_DEVICE float* shadow;
  int columns;
  int Dk;
  int Dv;
};

template <typename T>
CAMKV_INLINE CAMKV_DEVICE T* camkv_key(CamRows<T> r, int j) {
  return j == r.count ? r.pend_key : r.keys + (long)j * r.Dk;
}

template <typename T>
CAMKV_INLINE CAMKV_DEVICE T* camkv_value(CamRows<T> r, int j) {
  return j == r.count ? r.pend_value : r.values + (long)j * r.Dv;
}

template <typename T>
CAMKV_INLINE CAMKV_DEVICE float* camkv_score(CamRows<T> r, int j) {
  return j == r.count ? r.pend_score : r.scores + j;
}

template <typename T>
CAMKV_INLINE int camkv_position(CamRows<T> r, int j) {
  return j == r.count ? r.pend_position : r.positions[j];
}

// Row j's votes (rules that keep them).
template <typename T>
CAMKV_INLINE CAMKV_DEVICE float* camkv_vote(CamRows<T> r, int j) {
  return j == r.count ? r.pend_vote : r.votes + j;
}

// A float that is neither NaN nor infinite.
CAMKV_INLINE bool camkv_finite(float x) {
  return x - x == 0.0f;
}

// Exact mode's one merge (section 4): every row but the loser e may receive it. (A
// chunk's merges run in camkv_merge_chunk, on its list of survivors.)
CAMKV_INLINE bool camkv_is_survivor(int j, int e) {
  return j != e;
}

// Column c of the shadow := the key of row `row`.
template <typename T>
CAMKV_INLINE void camkv_shadow_store(CamRows<T> r, int c, int row, CamGroup g) {
  const CAMKV_DEVICE T* key = camkv_key(r, row);
  for (int d = camkv_tid(g); d < r.Dk; d += camkv_gsize(g)) {
    r.shadow[(long)d * r.columns + c] = camkv_float(key[d]);
  }
}

// Columns [0, count) from rows [0, count), CAMKV_DOT_ROWS rows per thread at a
// time so each feature's stores are consecutive.
template <typename T>
CAMKV_INLINE void camkv_shadow_build(CamRows<T> r, int count, CamGroup g) {
  const CAMKV_DEVICE T* rows[CAMKV_DOT_ROWS];
  int step = camkv_gsize(g) * CAMKV_DOT_ROWS;
  for (int j0 = camkv_tid(g) * CAMKV_DOT_ROWS; j0 < count; j0 += step) {
    int width = count - j0 < CAMKV_DOT_ROWS ? count - j0 : CAMKV_DOT_ROWS;
    for (int i = 0; i < CAMKV_DOT_ROWS; ++i) {
      rows[i] = camkv_key(r, i < width ? j0 + i : j0);
    }
    for (int d = 0; d < r.Dk; ++d) {
      CAMKV_DEVICE float* column = r.shadow + (long)d * r.columns + j0;
      for (int i = 0; i < width; ++i) {
        column[i] = camkv_float(rows[i][d]);
      }
    }
  }
  camkv_barrier(g);
}

// Shadow columns [from + 1, to] move left by one in every feature. A GPU moves a
// tile of `width` columns of all features per round (one barrier each, the
// argument of camkv_move_elements_down per feature); a group too small for a tile
// (the CPU's lone thread) walks one feature at a time.
CAMKV_INLINE void camkv_shadow_move_left(CAMKV_DEVICE float* shadow, int columns, int Dk, int from, int to, CamGroup g) {
  int width = camkv_gsize(g) * CAMKV_UNROLL / Dk;
  if (width == 0) {
    for (int d = camkv_tid(g); d < Dk; d += camkv_gsize(g)) {
      CAMKV_DEVICE float* feature = shadow + (long)d * columns;
      for (int c = from; c < to; ++c) {
        feature[c] = feature[c + 1];
      }
    }
    camkv_barrier(g);
    return;
  }
  float held[CAMKV_UNROLL];
  for (int c0 = from + 1; c0 <= to; c0 += width) {
    for (int k = 0; k < CAMKV_UNROLL; ++k) {
      int f = camkv_tid(g) + k * camkv_gsize(g);
      int c = c0 + f % width;
      if (f < width * Dk && c <= to) {
        held[k] = shadow[(long)(f / width) * columns + c];
      }
    }
    camkv_barrier(g);
    for (int k = 0; k < CAMKV_UNROLL; ++k) {
      int f = camkv_tid(g) + k * camkv_gsize(g);
      int c = c0 + f % width;
      if (f < width * Dk && c <= to) {
        shadow[(long)(f / width) * columns + c - 1] = held[k];
      }
    }
  }
  camkv_barrier(g);
}

// Without a shadow (a single-token call, where building one would cost as much as
// the one pass that reads it): dots of the nq queries q + k * q_stride with the
// keys of the rows behind search columns c0 .. c0 + CAMKV_DOT_ROWS - 1 read
// straight from storage, several rows at a time for independent addition chains;
// dots[k * CAMKV_DOT_ROWS + i] is query k's with column c0 + i. Same sequential
// order per dot.
template <typename T, typename Q>
CAMKV_INLINE void camkv_dot_keys(CamRows<T> r, const CAMKV_DEVICE Q* q, int q_stride, int nq, int c0, int end,
                                 CAMKV_THREAD float* dots, CAMKV_THREAD float* squares, bool with_norms) {
  const CAMKV_DEVICE T* rows[CAMKV_DOT_ROWS];
  for (int i = 0; i < CAMKV_DOT_ROWS; ++i) {
    rows[i] = camkv_key(r, c0 + i < end ? c0 + i : c0);
    squares[i] = 0.0f;
  }
  for (int k = 0; k < CAMKV_QUERY_BLOCK * CAMKV_DOT_ROWS; ++k) {
    dots[k] = 0.0f;
  }
#if CAMKV_WIDE && CAMKV_DOT_ROWS == 1
  if (camkv_wide_rows(q, rows[0], r.Dk) && q_stride % 8 == 0) {
    camkv_dots_wide(q, q_stride, nq, rows[0], r.Dk, dots, squares, with_norms);
    return;
  }
#endif
  for (int d = 0; d < r.Dk; ++d) {
    float kd[CAMKV_DOT_ROWS];
    for (int i = 0; i < CAMKV_DOT_ROWS; ++i) {
      kd[i] = camkv_float(rows[i][d]);
      if (with_norms) {
        squares[i] = camkv_madd(squares[i], kd[i], kd[i]);
      }
    }
    for (int k = 0; k < CAMKV_QUERY_BLOCK; ++k) {
      if (k < nq) {
        float qd = camkv_float(q[(long)k * q_stride + d]);
        for (int i = 0; i < CAMKV_DOT_ROWS; ++i) {
          dots[k * CAMKV_DOT_ROWS + i] = camkv_madd(dots[k * CAMKV_DOT_ROWS + i], qd, kd[i]);
        }
      }
    }
  }
}

// Dots of the nq queries q + k * q_stride with shadow columns c0 .. c0 +
// CAMKV_DOT_ROWS - 1, laid out as camkv_dot_keys'. Each sum runs over the features
// in order, exactly camkv_dot; the block of columns is what a CPU vectorises
// (columns past the end hold anything; their results are ignored).
template <typename Q>
CAMKV_INLINE void camkv_dot_columns(const CAMKV_DEVICE float* shadow, int columns, const CAMKV_DEVICE Q* q,
                                    int q_stride, int nq, int Dk, int c0, CAMKV_THREAD float* dots) {
  for (int k = 0; k < CAMKV_QUERY_BLOCK * CAMKV_DOT_ROWS; ++k) {
    dots[k] = 0.0f;
  }
  for (int d = 0; d < Dk; ++d) {
    const CAMKV_DEVICE float* column = shadow + (long)d * columns + c0;
    float kd[CAMKV_DOT_ROWS];
    for (int i = 0; i < CAMKV_DOT_ROWS; ++i) {
      kd[i] = column[i];
    }
    for (int k = 0; k < CAMKV_QUERY_BLOCK; ++k) {
      if (k < nq) {
        float qd = camkv_float(q[(long)k * q_stride + d]);
        for (int i = 0; i < CAMKV_DOT_ROWS; ++i) {
          dots[k * CAMKV_DOT_ROWS + i] = camkv_madd(dots[k * CAMKV_DOT_ROWS + i], qd, kd[i]);
        }
      }
    }
  }
}

// As camkv_dot_columns, plus each column's squared norm (for its cosine).
template <typename T>
CAMKV_INLINE void camkv_dot_columns_with_norms(const CAMKV_DEVICE float* shadow, int columns,
                                               const CAMKV_DEVICE T* k_e, int Dk, int c0,
                                               CAMKV_THREAD float* dots, CAMKV_THREAD float* squares) {
  for (int i = 0; i < CAMKV_DOT_ROWS; ++i) {
    dots[i] = 0.0f;
    squares[i] = 0.0f;
  }
  for (int d = 0; d < Dk; ++d) {
    float ed = camkv_float(k_e[d]);
    const CAMKV_DEVICE float* column = shadow + (long)d * columns + c0;
    for (int i = 0; i < CAMKV_DOT_ROWS; ++i) {
      float kd = column[i];
      dots[i] = camkv_madd(dots[i], ed, kd);
      squares[i] = camkv_madd(squares[i], kd, kd);
    }
  }
}

// ----------------------------------------------------------------------------
// Section 2: attention mass of one query over rows [0, visible)

// Adds softmax(scale * q_k . K_j) into mass[j] for the nq (<= CAMKV_QUERY_BLOCK)
// queries q_k = q + k * q_stride, query after query exactly as one call per query
// would; the dots of all nq come from one pass over the keys. logits is scratch of
// CAMKV_QUERY_BLOCK runs of logit_stride (>= visible) floats.
template <typename T, typename Q>
CAMKV_INLINE void camkv_add_attention(
    CamRows<T> r, const CAMKV_DEVICE Q* q, int q_stride, int nq, int visible, float scale,
    CAMKV_DEVICE float* logits, int logit_stride, CAMKV_DEVICE float* mass, CamGroup g) {
  float local_max[CAMKV_QUERY_BLOCK];
  for (int k = 0; k < CAMKV_QUERY_BLOCK; ++k) {
    local_max[k] = -CAMKV_INF;
  }
  float dots[CAMKV_QUERY_BLOCK * CAMKV_DOT_ROWS];
  float unused[CAMKV_DOT_ROWS];
  int step = camkv_gsize(g) * CAMKV_DOT_ROWS;
  for (int j0 = camkv_tid(g) * CAMKV_DOT_ROWS; j0 < visible; j0 += step) {
    if (r.shadow != 0) {
      camkv_dot_columns(r.shadow, r.columns, q, q_stride, nq, r.Dk, j0, dots);
    } else {
      camkv_dot_keys(r, q, q_stride, nq, j0, visible, dots, unused, false);
    }
    for (int k = 0; k < CAMKV_QUERY_BLOCK; ++k) {
      for (int i = 0; k < nq && i < CAMKV_DOT_ROWS && j0 + i < visible; ++i) {
        float l = scale * dots[k * CAMKV_DOT_ROWS + i];
        if (r.votes != 0 && j0 + i < r.count) {
          l = l + camkv_log(r.votes[j0 + i]);  // a row standing for c tokens weighs c times (the pending token: 1)
        }
        l = camkv_finite(l) ? l : -CAMKV_INF;  // a NaN or infinite logit counts as masked
        logits[(long)k * logit_stride + j0 + i] = l;
        local_max[k] = l > local_max[k] ? l : local_max[k];
      }
    }
  }
  for (int k = 0; k < CAMKV_QUERY_BLOCK; ++k) {
    if (k == nq) {
      break;  // nq is the same for the whole group
    }
    CAMKV_DEVICE float* weights = logits + (long)k * logit_stride;
    float row_max = camkv_group_max(g, local_max[k]);
    if (row_max > -CAMKV_INF) {  // a query with every logit masked adds nothing
      float local_sum = 0.0f;
      for (int j = camkv_tid(g); j < visible; j += camkv_gsize(g)) {
        float w = camkv_exp(weights[j] - row_max);
        weights[j] = w;
        local_sum += w;
      }
      float total = camkv_group_sum(g, local_sum);
      for (int j = camkv_tid(g); j < visible; j += camkv_gsize(g)) {
        mass[j] += weights[j] / total;
      }
    }
    camkv_barrier(g);
  }
}

template <typename T>
CAMKV_INLINE void camkv_zero(CAMKV_DEVICE T* a, int len, CamGroup g) {
  for (int j = camkv_tid(g); j < len; j += camkv_gsize(g)) {
    a[j] = (T)0;
  }
  camkv_barrier(g);
}

// ----------------------------------------------------------------------------
// Section 4: merging loser e into the survivors, planned (reading only) and then
// applied.

// Section 4.3, P = clamp(s_e / s_T, 0, 1) if s_T > 0 else (1 if s_e > 0 else 0).
CAMKV_INLINE int camkv_gate_open(float s_e, float s_target, camkv_u32 seed, camkv_u32 row, int p_e) {
  float probability;
  if (s_target > 0.0f) {
    float ratio = s_e / s_target;
    probability = ratio < 0.0f ? 0.0f : (ratio > 1.0f ? 1.0f : ratio);
  } else {
    probability = s_e > 0.0f ? 1.0f : 0.0f;
  }
  return camkv_uniform(seed, row, p_e) < probability ? 1 : 0;
}

// cos(K_e, K_j) = (K_e . K_j) / max(|K_j| |K_e|, 1e-12), as the reference orders it.
CAMKV_INLINE float camkv_cosine_of(float dot, float square_j, float norm_e) {
  float denom = camkv_sqrt(square_j) * norm_e;
  return dot / (denom > 1e-12f ? denom : 1e-12f);
}

// Section 4.1 in exact mode: the non-sink row other than e most similar to e (the
// pending token included); ties to the smaller index (the search visits rows in
// ascending order). r.cosines[j] keeps each searched row's cosine.
template <typename T>
CAMKV_INLINE int camkv_nearest(CamRows<T> r, int e, int n_sink, CamGroup g) {
  int total = r.count + r.has_pending;
  const CAMKV_DEVICE T* k_e = camkv_key(r, e);
  float norm_e = camkv_sqrt(camkv_dot(k_e, k_e, r.Dk));
  float best = CAMKV_INF;  // argmin of -cos
  int best_j = total;
  float dots[CAMKV_QUERY_BLOCK * CAMKV_DOT_ROWS];
  float squares[CAMKV_DOT_ROWS];
  int step = camkv_gsize(g) * CAMKV_DOT_ROWS;
  for (int j0 = camkv_tid(g) * CAMKV_DOT_ROWS; j0 < total; j0 += step) {
    if (r.shadow != 0) {
      camkv_dot_columns_with_norms(r.shadow, r.columns, k_e, r.Dk, j0, dots, squares);
    } else {
      camkv_dot_keys(r, k_e, 0, 1, j0, total, dots, squares, true);
    }
    for (int i = 0; i < CAMKV_DOT_ROWS && j0 + i < total; ++i) {
      int j = j0 + i;
      if (camkv_is_survivor(j, e) && camkv_position(r, j) >= n_sink) {
        // Kept for the blend weight: recomputing the winner's cosine would cost
        // every thread three more dots.
        r.cosines[j0 + i] = camkv_cosine_of(dots[i], squares[i], norm_e);
        float neg = -r.cosines[j0 + i];
        if (neg < best) {
          best = neg;
          best_j = j;
        }
      }
    }
  }
  return camkv_group_argmin(g, best, best_j);
}

// Section 4.2: the first `window` survivors after e, written to r.list[1..|W|] with
// |W| in r.list[0] so every thread reads it after the barrier; returns |W|.
template <typename T>
CAMKV_INLINE int camkv_collect_window(CamRows<T> r, int e, int window, CamGroup g) {
  if (camkv_tid(g) == 0) {
    int width = 0;
    int total = r.count + r.has_pending;
    for (int j = e + 1; j < total && width < window; ++j) {
      if (camkv_is_survivor(j, e)) {
        width += 1;
        r.list[width] = j;
      }
    }
    r.list[0] = width;
  }
  camkv_barrier(g);
  return r.list[0];
}

// Section 4.4 for one feature: (1 - w) * target + w * source, rounded once to the
// storage dtype.
template <typename T>
CAMKV_INLINE void camkv_blend(CAMKV_DEVICE T* target, float source, float w) {
  *target = (T)camkv_madd(camkv_mul(1.0f - w, camkv_float(*target)), w, source);
}

template <typename T>
CAMKV_INLINE void camkv_blend_row(CAMKV_DEVICE T* target, const CAMKV_DEVICE T* source, float w, int len, CamGroup g) {
  for (int d = camkv_tid(g); d < len; d += camkv_gsize(g)) {
    camkv_blend(target + d, camkv_float(source[d]), w);
  }
}

// A merge decided but not yet applied: what camkv_plan_merge reads from the rows,
// so the exact path can move the stored rows (and drop e) between deciding and
// blending. Window members sit in r.list[1..width].
struct CamMergePlan {
  int open;    // 1: merge (gate open, mode not "drop")
  int target;  // nearest modes: the receiving row (r.count: the pending token)
  float w;     // nearest modes: blend weight
  int width;   // window mode: |W|
  // keepkv (section 4.6): the merged key's logit l*, whether the group's logits are
  // finite (else the key stays the weighted mean), and the votes the loser brings.
  float want;
  int finite;
  float vote_in;
};

// keepkv: the compression's query q into r.query (section 4.6): the mean of its token's
// G queries (queries [G, Dk]), or with key scoring its key.
template <typename T>
CAMKV_INLINE void camkv_load_query(CamRows<T> r, const CAMKV_DEVICE T* key, const CAMKV_DEVICE float* queries,
                                   CAMKV_CONSTANT const CamParams* p, CamGroup g) {
  float inverse = 1.0f / (float)p->G;  // as MLX's mean: the sum times 1 / G
  for (int d = camkv_tid(g); d < r.Dk; d += camkv_gsize(g)) {
    if (p->key_scoring) {
      r.query[d] = camkv_float(key[d]);
      continue;
    }
    float sum = 0.0f;
    for (int k = 0; k < p->G; ++k) {
      sum += queries[(long)k * r.Dk + d];
    }
    r.query[d] = sum * inverse;
  }
  camkv_barrier(g);
}

// keepkv: a key's logit for the compression's query, s (q . K).
template <typename T>
CAMKV_INLINE float camkv_query_logit(CamRows<T> r, const CAMKV_DEVICE T* key, float scale) {
  return scale * camkv_dot((const CAMKV_DEVICE float*)r.query, key, r.Dk);
}

// keepkv: how far the merged key moves along q, d = (l* - s q.K') / (s |q|^2), from
// dot = q.K' and square = |q|^2.
CAMKV_INLINE float camkv_key_shift(float want, float dot, float square, float scale) {
  return (want - camkv_mul(scale, dot)) / camkv_mul(scale, square);
}

// keepkv's l* = M + log(sum m) - log(sum c): the logit that gives a row standing for
// votes tokens the group's mass for q.
CAMKV_INLINE float camkv_wanted_logit(float top, float mass, float votes) {
  return top + camkv_log(mass) - camkv_log(votes);
}

// Section 4.6 for exact mode's one loser e into plan->target: the group's masses for the
// pending token's query, m_i = c_i exp(l_i - M), give the blend weight m_e / (m_t + m_e).
template <typename T>
CAMKV_INLINE void camkv_plan_keep_output(CamRows<T> r, int e, CAMKV_CONSTANT const CamParams* p,
                                         CAMKV_THREAD CamMergePlan* plan, CamGroup g) {
  camkv_load_query(r, (const CAMKV_DEVICE T*)camkv_key(r, r.count), r.pend_queries, p, g);
  float l_t = camkv_query_logit(r, (const CAMKV_DEVICE T*)camkv_key(r, plan->target), p->scale);
  float l_e = camkv_query_logit(r, (const CAMKV_DEVICE T*)camkv_key(r, e), p->scale);
  int finite = camkv_finite(l_t) && camkv_finite(l_e) ? 1 : 0;
  float top = finite ? (l_t > l_e ? l_t : l_e) : 0.0f;
  float c_t = *camkv_vote(r, plan->target), c_e = *camkv_vote(r, e);
  float m_t = c_t * (finite ? camkv_exp(l_t - top) : 1.0f);
  float m_e = c_e * (finite ? camkv_exp(l_e - top) : 1.0f);
  plan->w = camkv_merge_weight(p->merge, 0.0f, m_e, m_t, 0.0f, 0.0f);
  plan->finite = finite;
  plan->want = camkv_wanted_logit(top, m_t + m_e, c_t + c_e);
  plan->vote_in = c_e;
}

template <typename T>
CAMKV_INLINE CamMergePlan camkv_plan_nearest(CamRows<T> r, int e, CAMKV_CONSTANT const CamParams* p, camkv_u32 row_id, CamGroup g) {
  CamMergePlan plan;
  plan.target = camkv_nearest(r, e, p->n_sink, g);
  plan.width = 0;
  plan.w = 0.0f;
  plan.want = 0.0f;
  plan.finite = 0;
  plan.vote_in = 0.0f;
  if (plan.target > r.count) {  // no finite cosine (e's key is poisoned): it merges nowhere
    plan.open = 0;
    return plan;
  }
  float s_e = *camkv_score(r, e);
  plan.open = p->gate ? camkv_gate_open(s_e, *camkv_score(r, plan.target), p->seed, row_id, camkv_position(r, e)) : 1;
  plan.w = 0.5f;
  plan.want = 0.0f;
  plan.finite = 0;
  plan.vote_in = 0.0f;
  if (r.threshold != 0) {  // d2o (section 4.5): one loser's cosine is its compression's mean
    float c = r.cosines[plan.target];
    float tau = camkv_moved_threshold(*r.threshold, camkv_finite(c) ? c : 0.0f, camkv_finite(c) ? 1 : 0);
    camkv_barrier(g);  // every thread has read the threshold
    if (camkv_tid(g) == 0) {
      *r.threshold = tau;
    }
    camkv_barrier(g);
    plan.open = plan.open != 0 && c >= tau ? 1 : 0;
  }
  if (plan.open != 0 && r.votes != 0) {
    camkv_plan_keep_output(r, e, p, &plan, g);
  } else if (plan.open != 0) {
    float c = r.cosines[plan.target];  // written by camkv_nearest
    float norm_e = 0.0f, norm_t = 0.0f;
    if (camkv_reads_value_norms(p->merge)) {  // every thread computes the same sums
      norm_e = camkv_norm(camkv_value(r, e), r.Dv);
      norm_t = camkv_norm(camkv_value(r, plan.target), r.Dv);
    }
    plan.w = camkv_merge_weight(p->merge, c, s_e, *camkv_score(r, plan.target), norm_e, norm_t);
  }
  return plan;
}

template <typename T>
CAMKV_INLINE CamMergePlan camkv_plan_window(CamRows<T> r, int e, CAMKV_CONSTANT const CamParams* p, camkv_u32 row_id, CamGroup g) {
  CamMergePlan plan;
  plan.target = 0;
  plan.w = 0.0f;
  plan.want = 0.0f;
  plan.finite = 0;
  plan.vote_in = 0.0f;
  plan.width = camkv_collect_window(r, e, p->window, g);
  float s_e = *camkv_score(r, e);
  float target_sum = 0.0f;
  for (int i = 1; i <= plan.width; ++i) {
    target_sum += *camkv_score(r, r.list[i]);
  }
  float s_target = target_sum / (float)plan.width;
  plan.open = p->gate ? camkv_gate_open(s_e, s_target, p->seed, row_id, camkv_position(r, e)) : 1;
  return plan;
}

// Section 4.1-4.3 for loser e: reads the rows, changes nothing but r.list.
template <typename T>
CAMKV_INLINE CamMergePlan camkv_plan_merge(CamRows<T> r, int e, CAMKV_CONSTANT const CamParams* p, camkv_u32 row_id, CamGroup g) {
  int kind = camkv_merge_rule(p->merge).kind;
  if (kind == CAMKV_KIND_DROP) {
    CamMergePlan none;
    none.open = 0;
    none.target = 0;
    none.w = 0.0f;
    none.width = 0;
    none.want = 0.0f;
    none.finite = 0;
    none.vote_in = 0.0f;
    return none;
  }
  if (kind == CAMKV_KIND_WINDOW) {
    return camkv_plan_window(r, e, p, row_id, g);
  }
  return camkv_plan_nearest(r, e, p, row_id, g);
}

// Row j of the plan's view, in the rows as they are now: rows after `removed` have
// moved down one (removed = r.count + 1 when nothing moved); the pending token
// (j == r.count) has not moved.
CAMKV_INLINE int camkv_moved(int j, int removed, int count) {
  return j != count && j > removed ? j - 1 : j;
}

// Section 4.6's key for exact mode's one loser: K' = (1 - w) K_t + w K_e in float32,
// then K' + d q where the group's logits are finite and d is, rounded once. Every thread
// sums q.K' in feature order, then each writes its features.
template <typename T>
CAMKV_INLINE void camkv_keep_output_key(CAMKV_DEVICE T* k_t, const CAMKV_DEVICE T* k_e, CamMergePlan plan,
                                        const CAMKV_DEVICE float* q, float scale, int Dk, CamGroup g) {
  float dot = 0.0f, square = 0.0f;
  for (int d = 0; d < Dk; ++d) {
    float merged = camkv_madd(camkv_mul(1.0f - plan.w, camkv_float(k_t[d])), plan.w, camkv_float(k_e[d]));
    dot = camkv_madd(dot, merged, q[d]);
    square = camkv_madd(square, q[d], q[d]);
  }
  float shift = camkv_key_shift(plan.want, dot, square, scale);
  bool moved = plan.finite != 0 && camkv_finite(shift);
  camkv_barrier(g);  // every thread has read k_t
  for (int d = camkv_tid(g); d < Dk; d += camkv_gsize(g)) {
    float merged = camkv_madd(camkv_mul(1.0f - plan.w, camkv_float(k_t[d])), plan.w, camkv_float(k_e[d]));
    k_t[d] = (T)(moved ? camkv_madd(merged, shift, q[d]) : merged);
  }
}

// Section 4.4: apply a plan. k_e, v_e, s_e: the loser's key, value and score, read
// where they are now.
template <typename T>
CAMKV_INLINE int camkv_apply_merge(CamRows<T> r, CamMergePlan plan, const CAMKV_DEVICE T* k_e, const CAMKV_DEVICE T* v_e,
                                   float s_e, int removed, CAMKV_CONSTANT const CamParams* p, CamGroup g) {
  // Every thread must have read the plan's r.list before anything rewrites it.
  camkv_barrier(g);
  if (plan.open == 0) {
    return 0;
  }
  CamMergeRule rule = camkv_merge_rule(p->merge);
  if (rule.kind == CAMKV_KIND_WINDOW) {
    float share = s_e / (float)plan.width;
    for (int i = 1; i <= plan.width; ++i) {
      int j = camkv_moved(r.list[i], removed, r.count);
      CAMKV_DEVICE T* v_j = camkv_value(r, j);
      if (rule.blends) {
        // Each target's weight is its own mass against the share it receives.
        camkv_blend_row(v_j, v_e, camkv_merge_weight(p->merge, 0.0f, share, *camkv_score(r, j), 0.0f, 0.0f), r.Dv, g);
        continue;
      }
      for (int d = camkv_tid(g); d < r.Dv; d += camkv_gsize(g)) {
        v_j[d] = (T)(camkv_float(v_j[d]) + camkv_float(v_e[d]) / (float)plan.width);
      }
    }
    camkv_barrier(g);
    if (camkv_tid(g) == 0) {
      for (int i = 1; i <= plan.width; ++i) {
        *camkv_score(r, camkv_moved(r.list[i], removed, r.count)) += s_e / (float)plan.width;
      }
    }
    camkv_barrier(g);
    return 1;
  }
  int t = camkv_moved(plan.target, removed, r.count);
  camkv_blend_row(camkv_value(r, t), v_e, plan.w, r.Dv, g);
  if (r.votes != 0 || p->merge_keys) {
    if (r.votes != 0) {
      camkv_keep_output_key(camkv_key(r, t), k_e, plan, (const CAMKV_DEVICE float*)r.query, p->scale, r.Dk, g);
    } else {
      camkv_blend_row(camkv_key(r, t), k_e, plan.w, r.Dk, g);
    }
    camkv_barrier(g);
    if (r.shadow != 0) {
      camkv_shadow_store(r, t, t, g);
    }
  }
  camkv_barrier(g);
  if (camkv_tid(g) == 0) {
    *camkv_score(r, t) += s_e;
    if (r.votes != 0) {
      *camkv_vote(r, t) += plan.vote_in;
    }
  }
  camkv_barrier(g);
  return 1;
}

// Section 4: merge loser e into the survivors, in place. Returns 1 if it merged
// (the same value on every thread), 0 if the gate closed or merge is "drop".
template <typename T>
CAMKV_INLINE int camkv_merge(CamRows<T> r, int e, CAMKV_CONSTANT const CamParams* p, camkv_u32 row_id, CamGroup g) {
  CamMergePlan plan = camkv_plan_merge(r, e, p, row_id, g);
  return camkv_apply_merge(r, plan, (const CAMKV_DEVICE T*)camkv_key(r, e), (const CAMKV_DEVICE T*)camkv_value(r, e),
                           *camkv_score(r, e), r.count + 1, p, g);
}

CAMKV_INLINE bool camkv_protected(int position, int n_sink, int recent, int p_last) {
  return position < n_sink || position > p_last - recent;
}


// ----------------------------------------------------------------------------
// Exact mode (section 7, "exact"): the S tokens one at a time, in the out arrays.

// Section 2 for token t of the call: its key (key scoring) or its G queries, in
// blocks of CAMKV_QUERY_BLOCK, add their attention over rows [0, visible) into mass.
template <typename T>
CAMKV_INLINE void camkv_token_attention(
    CamRows<T> r, int t, const CAMKV_DEVICE T* key, CAMKV_CONSTANT const CamParams* p,
    const CAMKV_DEVICE float* queries, int visible, CAMKV_DEVICE float* logits, int logit_stride,
    CAMKV_DEVICE float* mass, CamGroup g) {
  if (p->key_scoring) {
    camkv_add_attention(r, key, 0, 1, visible, p->scale, logits, logit_stride, mass, g);
    return;
  }
  const CAMKV_DEVICE float* token_queries = queries + (long)t * p->G * p->Dk;
  for (int q0 = 0; q0 < p->G; q0 += CAMKV_QUERY_BLOCK) {
    int nq = p->G - q0 < CAMKV_QUERY_BLOCK ? p->G - q0 : CAMKV_QUERY_BLOCK;
    camkv_add_attention(r, token_queries + (long)q0 * p->Dk, p->Dk, nq, visible, p->scale, logits, logit_stride,
                        mass, g);
  }
}

// Scores the pending token against rows [0, count] (itself included).
template <typename T>
CAMKV_INLINE void camkv_score_pending(
    CamRows<T> r, int t, CAMKV_CONSTANT const CamParams* p, const CAMKV_DEVICE float* queries,
    CAMKV_DEVICE float* logits, CAMKV_DEVICE float* mass, CamGroup g) {
  int visible = r.count + 1;
  camkv_zero(mass, visible, g);
  camkv_token_attention(r, t, (const CAMKV_DEVICE T*)r.pend_key, p, queries, visible, logits,
                        camkv_capacity(0, p->n, p->S, p->n_out), mass, g);
  float groups = (float)p->G;
  for (int j = camkv_tid(g); j < r.count; j += camkv_gsize(g)) {
    r.scores[j] += mass[j] / groups;
  }
  if (camkv_tid(g) == 0) {
    *r.pend_score = mass[r.count] / groups;
  }
  camkv_barrier(g);
}

// Stores the pending token at row `slot` of the arrays.
template <typename T>
CAMKV_INLINE void camkv_store_pending(CamRows<T> r, int slot, CamGroup g) {
  camkv_copy_row(r.keys + (long)slot * r.Dk, (const CAMKV_DEVICE T*)r.pend_key, r.Dk, g);
  camkv_copy_row(r.values + (long)slot * r.Dv, (const CAMKV_DEVICE T*)r.pend_value, r.Dv, g);
  if (camkv_tid(g) == 0) {
    r.scores[slot] = *r.pend_score;
    r.positions[slot] = r.pend_position;
    if (r.votes != 0) {
      r.votes[slot] = *r.pend_vote;
    }
  }
  camkv_barrier(g);
}

// Section 5: remove row e, shift the later rows down, append the pending token.
template <typename T>
CAMKV_INLINE void camkv_remove_and_append(CamRows<T> r, int e, CamGroup g) {
  camkv_move_rows_down(r.keys, e, r.count, r.Dk, g);
  camkv_move_rows_down(r.values, e, r.count, r.Dv, g);
  camkv_move_rows_down(r.scores, e, r.count, 1, g);
  camkv_move_rows_down(r.positions, e, r.count, 1, g);
  if (r.votes != 0) {
    camkv_move_rows_down(r.votes, e, r.count, 1, g);
  }
  // Shadow columns e+1 .. count (the pending token's included) move down by one.
  if (r.shadow != 0) {
    camkv_shadow_move_left(r.shadow, r.columns, r.Dk, e, r.count, g);
  }
  camkv_store_pending(r, r.count - 1, g);
}

// A score as eviction ranks it: NaN lowest (a poisoned row goes first).
CAMKV_INLINE float camkv_rank(float s) {
  return s == s ? s : -CAMKV_INF;
}

// Row j's eviction rank: its score, or with eviction "recency" its index (rows are
// in position order, so the oldest ranks lowest). Indexes are exact in float32.
template <typename T>
CAMKV_INLINE float camkv_rank_row(CamRows<T> r, int j, CAMKV_CONSTANT const CamParams* p) {
  return p->recency ? (float)j : camkv_rank(r.scores[j]);
}

// Section 3: the unprotected stored row with the lowest rank (ties: smaller index).
template <typename T>
CAMKV_INLINE int camkv_pick_evicted(CamRows<T> r, int p_now, CAMKV_CONSTANT const CamParams* p, CamGroup g) {
  float best = CAMKV_INF;
  int best_j = r.count;
  for (int j = camkv_tid(g); j < r.count; j += camkv_gsize(g)) {
    if (!camkv_protected(r.positions[j], p->n_sink, p->recent, p_now) && camkv_rank_row(r, j, p) < best) {
      best = camkv_rank_row(r, j, p);
      best_j = j;
    }
  }
  return camkv_group_argmin(g, best, best_j);
}

template <typename T>
CAMKV_INLINE void camkv_copy_state_in(
    CAMKV_DEVICE T* keys, CAMKV_DEVICE T* values, CAMKV_DEVICE float* scores, CAMKV_DEVICE int* positions,
    const CAMKV_DEVICE T* in_keys, const CAMKV_DEVICE T* in_values, const CAMKV_DEVICE float* in_scores,
    const CAMKV_DEVICE int* in_positions, int n, int Dk, int Dv, CamGroup g) {
  camkv_copy_flat(keys, in_keys, (long)n * Dk, g);
  camkv_copy_flat(values, in_values, (long)n * Dv, g);
  camkv_copy_flat(scores, in_scores, (long)n, g);
  camkv_copy_flat(positions, in_positions, (long)n, g);
  camkv_barrier(g);
}

// Per-row pointers of a launch (row r's slice of every buffer).
template <typename T>
struct CamRowBuffers {
  const CAMKV_DEVICE T* in_keys;
  const CAMKV_DEVICE T* in_values;
  const CAMKV_DEVICE float* in_scores;
  const CAMKV_DEVICE int* in_positions;
  const CAMKV_DEVICE T* new_keys;
  const CAMKV_DEVICE T* new_values;
  const CAMKV_DEVICE float* queries;  // [S, G, Dk]; unused with key scoring
  const CAMKV_DEVICE float* chunk_mass; // [n + S], summed / G; used only when prescored
  CAMKV_DEVICE T* out_keys;
  CAMKV_DEVICE T* out_values;
  CAMKV_DEVICE float* out_scores;
  CAMKV_DEVICE int* out_positions;
  CAMKV_DEVICE float* f32;            // f32_stride floats
  CAMKV_DEVICE int* i32;              // i32_stride ints
  CAMKV_DEVICE T* store;              // store_stride elements
  // A rule's state (camkv_merges.h), read and written only by the rules that keep it:
  // votes [n] in, [n_out] out; the threshold, one float each.
  const CAMKV_DEVICE float* in_votes;
  const CAMKV_DEVICE float* in_threshold;
  CAMKV_DEVICE float* out_votes;
  CAMKV_DEVICE float* out_threshold;
};

// The rule's state into the work arrays: the threshold (always: its out buffer is its
// own), and the stored rows' votes unless they are there already (in place).
template <typename T>
CAMKV_INLINE void camkv_rule_state_in(CamRows<T> r, CamRowBuffers<T> b, int n, bool votes_too, CamGroup g) {
  if (r.votes != 0 && votes_too) {
    camkv_copy_flat(r.votes, b.in_votes, (long)n, g);
  }
  if (r.threshold != 0 && camkv_tid(g) == 0) {
    *r.threshold = *b.in_threshold;
  }
  camkv_barrier(g);
}

// Pointers of an exact-mode call's rows: the out arrays, a pending token in scratch.
template <typename T>
CAMKV_INLINE CamRows<T> camkv_exact_rows(CamRowBuffers<T> b, CAMKV_CONSTANT const CamParams* p) {
  int cap = camkv_capacity(0, p->n, p->S, p->n_out);
  CamRows<T> r;
  r.keys = b.out_keys;
  r.values = b.out_values;
  r.scores = b.out_scores;
  r.positions = b.out_positions;
  r.count = p->n;
  r.has_pending = 1;
  r.pend_key = b.store;
  r.pend_value = b.store + p->Dk;
  r.pend_score = b.f32 + CAMKV_F32_SCORES * cap;
  r.pend_position = 0;
  r.loser = 0;
  r.list = b.i32;
  r.cosines = b.f32;  // the logits' scratch, free once the token is scored
  r.survivors = 0;
  r.n_survivors = 0;
  r.group_counts = 0;
  r.votes = camkv_keeps_votes(p->merge) ? b.out_votes : 0;
  r.pend_vote = b.f32 + CAMKV_F32_SCORES * cap + 1;
  r.threshold = camkv_moves_threshold(p->merge) ? b.out_threshold : 0;
  r.query = b.f32 + camkv_f32_query_at(0, p->n, p->S, p->n_out, p->Dk);
  r.pend_queries = 0;
  // One token reads every key once: no shadow, whose build would cost as much.
  r.shadow = p->S > 1 ? b.f32 + CAMKV_F32_SHADOW * cap : 0;
  r.columns = camkv_shadow_columns(0, p->n, p->S, p->n_out);
  r.Dk = p->Dk;
  r.Dv = p->Dv;
  return r;
}

// Token t of the call becomes the pending token (and its shadow column).
template <typename T>
CAMKV_INLINE void camkv_load_pending(CAMKV_THREAD CamRows<T>& r, CamRowBuffers<T> b, int t, CAMKV_CONSTANT const CamParams* p, CamGroup g) {
  camkv_copy_row(r.pend_key, b.new_keys + (long)t * p->Dk, p->Dk, g);
  camkv_copy_row(r.pend_value, b.new_values + (long)t * p->Dv, p->Dv, g);
  r.pend_position = p->offset + t;
  r.pend_queries = b.queries + (p->key_scoring ? 0 : (long)t * p->G * p->Dk);
  if (camkv_tid(g) == 0) {
    *r.pend_vote = 1.0f;  // a new token stands for itself
  }
  if (r.shadow != 0) {
    camkv_barrier(g);
    camkv_shadow_store(r, r.count, r.count, g);
  }
  camkv_barrier(g);
}

// One token into a full state whose stored rows are still only in the in arrays
// (a host that could not donate them): score, evict and plan the merge reading the
// in arrays, then write the out arrays once, without row e, and apply the merge
// there. Copying first and shifting after would move most of the state twice.
template <typename T>
CAMKV_INLINE int camkv_decode_copying(CamRowBuffers<T> b, CAMKV_CONSTANT const CamParams* p, camkv_u32 row_id, CamGroup g) {
  CamRows<T> r = camkv_exact_rows(b, p);
  r.keys = (CAMKV_DEVICE T*)b.in_keys;  // read only until the copy below
  r.values = (CAMKV_DEVICE T*)b.in_values;
  CAMKV_DEVICE float* out_votes = r.votes;
  r.votes = r.votes != 0 ? (CAMKV_DEVICE float*)b.in_votes : 0;  // read only until the copy below
  camkv_copy_flat(r.scores, b.in_scores, (long)p->n, g);
  camkv_copy_flat(r.positions, b.in_positions, (long)p->n, g);
  camkv_rule_state_in(r, b, p->n, false, g);
  camkv_load_pending(r, b, 0, p, g);
  CAMKV_DEVICE float* logits = b.f32;
  CAMKV_DEVICE float* mass = b.f32 + CAMKV_F32_MASS * camkv_capacity(0, p->n, p->S, p->n_out);
  camkv_score_pending(r, 0, p, b.queries, logits, mass, g);
  int e = camkv_pick_evicted(r, r.pend_position, p, g);
  CamMergePlan plan = camkv_plan_merge(r, e, p, row_id, g);
  float s_e = r.scores[e];
  long tail = (long)(p->n - 1 - e);
  camkv_copy_flat(b.out_keys, b.in_keys, (long)e * p->Dk, g);
  camkv_copy_flat(b.out_keys + (long)e * p->Dk, b.in_keys + (long)(e + 1) * p->Dk, tail * p->Dk, g);
  camkv_copy_flat(b.out_values, b.in_values, (long)e * p->Dv, g);
  camkv_copy_flat(b.out_values + (long)e * p->Dv, b.in_values + (long)(e + 1) * p->Dv, tail * p->Dv, g);
  if (out_votes != 0) {
    camkv_copy_flat(out_votes, b.in_votes, (long)e, g);
    camkv_copy_flat(out_votes + e, b.in_votes + e + 1, tail, g);
    r.votes = out_votes;
  }
  camkv_barrier(g);  // every thread has read scores[e] before the move overwrites it
  camkv_move_rows_down(r.scores, e, r.count, 1, g);
  camkv_move_rows_down(r.positions, e, r.count, 1, g);
  r.keys = b.out_keys;
  r.values = b.out_values;
  int merged = camkv_apply_merge(r, plan, b.in_keys + (long)e * p->Dk, b.in_values + (long)e * p->Dv, s_e, e, p, g);
  camkv_store_pending(r, r.count - 1, g);
  return merged;
}

template <typename T>
CAMKV_INLINE int camkv_update_exact(CamRowBuffers<T> b, CAMKV_CONSTANT const CamParams* p, camkv_u32 row_id, CamGroup g) {
  if (p->in_place == 0 && p->S == 1 && p->n == p->budget) {
    return camkv_decode_copying(b, p, row_id, g);
  }
  CamRows<T> r = camkv_exact_rows(b, p);
  int cap = camkv_capacity(0, p->n, p->S, p->n_out);
  CAMKV_DEVICE float* logits = b.f32;
  CAMKV_DEVICE float* mass = b.f32 + CAMKV_F32_MASS * cap;

  if (p->in_place == 0) {
    camkv_copy_state_in(r.keys, r.values, r.scores, r.positions, b.in_keys, b.in_values, b.in_scores,
                        b.in_positions, p->n, p->Dk, p->Dv, g);
  }
  camkv_rule_state_in(r, b, p->n, p->in_place == 0, g);
  if (r.shadow != 0) {
    camkv_shadow_build(r, r.count, g);
  }
  int merges = 0;
  for (int t = 0; t < p->S; ++t) {
    camkv_load_pending(r, b, t, p, g);
    camkv_score_pending(r, t, p, b.queries, logits, mass, g);
    if (r.count < p->budget) {
      camkv_store_pending(r, r.count, g);
      r.count += 1;
    } else {
      int e = camkv_pick_evicted(r, r.pend_position, p, g);
      merges += camkv_merge(r, e, p, row_id, g);
      camkv_remove_and_append(r, e, g);
    }
  }
  return merges;
}

// ----------------------------------------------------------------------------
// Chunk mode (section 7, "chunk"): score the whole block causally, evict once.

// Row j of a chunk's mass max-pooled: the largest entry within pool / 2 rows of j.
CAMKV_INLINE float camkv_pooled(const CAMKV_DEVICE float* mass, int j, int count, int pool) {
  int half = pool / 2;
  int i0 = j - half > 0 ? j - half : 0;
  int i1 = j + half < count - 1 ? j + half : count - 1;
  float best = mass[i0];
  for (int i = i0 + 1; i <= i1; ++i) {
    best = mass[i] > best ? mass[i] : best;
  }
  return best;
}

// Every chunk token i queries rows [0, n + i]; the weights are summed, then / G.
// Only the last p->observe tokens' queries count (prefill_scoring "window"), and the
// mass is then max-pooled over p->pool rows.
// A host may compute that mass as a matrix product before the launch (prescored):
// a GPU's few row blocks would otherwise score thousands of queries one by one.
template <typename T>
CAMKV_INLINE void camkv_score_chunk(CamRows<T> r, CAMKV_CONSTANT const CamParams* p, const CAMKV_DEVICE float* queries,
                                    const CAMKV_DEVICE float* chunk_mass,
                                    CAMKV_DEVICE float* logits, CAMKV_DEVICE float* mass, CamGroup g) {
  if (p->prescored) {
    for (int j = camkv_tid(g); j < r.count; j += camkv_gsize(g)) {
      r.scores[j] += chunk_mass[j];
    }
    camkv_barrier(g);
    return;
  }
  camkv_zero(mass, r.count, g);
  for (int i = p->S - p->observe; i < p->S; ++i) {
    camkv_token_attention(r, i, (const CAMKV_DEVICE T*)(r.keys + (long)(p->n + i) * p->Dk), p, queries,
                          p->n + i + 1, logits, r.count, mass, g);
  }
  float groups = (float)p->G;
  for (int j = camkv_tid(g); j < r.count; j += camkv_gsize(g)) {
    // max(mass) / G is max(mass / G): dividing by G keeps the order.
    r.scores[j] += (p->pool > 1 ? camkv_pooled(mass, j, r.count, p->pool) : mass[j]) / groups;
  }
  camkv_barrier(g);
}

// The k lowest-ranked unprotected rows (ties to the smaller index) get loser = 1.
template <typename T>
CAMKV_INLINE void camkv_mark_losers(CamRows<T> r, int k, int p_last, CAMKV_CONSTANT const CamParams* p, CamGroup g) {
#if CAMKV_HOST_SELECT
  // A lone CPU thread: the same set by one partial sort (prelude's camkv_select_lowest),
  // O(n log n) where the parallel form below compares every pair, O(n^2).
  int candidates = 0;
  for (int j = 0; j < r.count; ++j) {
    bool open = !camkv_protected(r.positions[j], p->n_sink, p->recent, p_last);
    r.loser[j] = 0;
    if (open) {
      camkv_select_put(candidates++, camkv_rank_row(r, j, p), j);
    }
  }
  camkv_select_lowest(candidates, k, r.loser);
  return;
#endif
  for (int j = camkv_tid(g); j < r.count; j += camkv_gsize(g)) {
    int is_loser = 0;
    if (!camkv_protected(r.positions[j], p->n_sink, p->recent, p_last)) {
      float s = camkv_rank_row(r, j, p);
      int rank = 0;
      for (int i = 0; i < r.count && rank < k; ++i) {
        if (i != j && !camkv_protected(r.positions[i], p->n_sink, p->recent, p_last)) {
          float s_i = camkv_rank_row(r, i, p);
          if (s_i < s || (s_i == s && i < j)) {
            rank += 1;
          }
        }
      }
      is_loser = rank < k ? 1 : 0;
    }
    r.loser[j] = is_loser;
  }
  camkv_barrier(g);
}

// The rows j whose loser flag is `loser`, ascending, into out; returns how many.
// Each thread lists one contiguous block of rows, after the blocks before it (their
// sizes parked in r.group_counts): one thread walking all rows would leave a GPU's
// block idle for thousands of dependent steps.
template <typename T>
CAMKV_INLINE int camkv_list_rows(CamRows<T> r, int loser, CAMKV_DEVICE int* out, CamGroup g) {
  int per = (r.count + camkv_gsize(g) - 1) / camkv_gsize(g);
  int j0 = camkv_tid(g) * per;
  int j1 = j0 + per < r.count ? j0 + per : r.count;
  int mine = 0;
  for (int j = j0; j < j1; ++j) {
    mine += (r.loser[j] != 0) == (loser != 0) ? 1 : 0;
  }
  r.group_counts[camkv_tid(g)] = mine;
  camkv_barrier(g);
  int at = 0, listed = 0;
  for (int t = 0; t < camkv_gsize(g); ++t) {
    at += t < camkv_tid(g) ? r.group_counts[t] : 0;
    listed += r.group_counts[t];
  }
  for (int j = j0; j < j1; ++j) {
    if ((r.loser[j] != 0) == (loser != 0)) {
      out[at] = j;
      at += 1;
    }
  }
  camkv_barrier(g);  // the list is complete, and the counts free again
  return listed;
}

// Shadow column c := the column of the c-th survivor (c <= survivors[c], and
// each thread walks its own features upward, so in place is safe).
template <typename T>
CAMKV_INLINE void camkv_shadow_keep_survivors(CamRows<T> r, CamGroup g) {
  for (int d = camkv_tid(g); d < r.Dk; d += camkv_gsize(g)) {
    CAMKV_DEVICE float* feature = r.shadow + (long)d * r.columns;
    for (int c = 0; c < r.n_survivors; ++c) {
      feature[c] = feature[r.survivors[c]];
    }
  }
  camkv_barrier(g);
}

// Survivors, in position order, from the work arrays to the out arrays.
template <typename T>
CAMKV_INLINE void camkv_compact_survivors(CamRows<T> r, CamRowBuffers<T> b, CamGroup g) {
  camkv_gather_rows(b.out_keys, (const CAMKV_DEVICE T*)r.keys, r.survivors, r.n_survivors, r.Dk, g);
  camkv_gather_rows(b.out_values, (const CAMKV_DEVICE T*)r.values, r.survivors, r.n_survivors, r.Dv, g);
  camkv_gather_rows(b.out_scores, (const CAMKV_DEVICE float*)r.scores, r.survivors, r.n_survivors, 1, g);
  camkv_gather_rows(b.out_positions, (const CAMKV_DEVICE int*)r.positions, r.survivors, r.n_survivors, 1, g);
  if (r.votes != 0) {
    camkv_gather_rows(b.out_votes, (const CAMKV_DEVICE float*)r.votes, r.survivors, r.n_survivors, 1, g);
  }
  camkv_barrier(g);
}

// ----------------------------------------------------------------------------
// A chunk's merges, all at once (section 7): every loser picks its target among the
// survivors as they stand before any merge, so the targets (phase 1) and the gates and
// shares (phase 2) are independent per loser and run in parallel; each target then
// takes all its merging losers in one closed-form blend (phase 3), in loser order.
// A loser's target is a survivor column: column c is the c-th survivor (r.survivors)
// and the c-th column of the key shadow.

// Per-row scratch of the merge phase (camkv_merge_scratch says where each part lives).
struct CamMergeScratch {
  CAMKV_DEVICE int* losers;     // [n_losers] the losers' rows, ascending
  CAMKV_DEVICE int* targets;    // per loser: its target column (nearest) or first window
                                // column, -1 where it does not merge
  CAMKV_DEVICE float* cosines;  // per loser: cos with its target (nearest; keepkv: after the
                                // gates, its logit for the query); |W| (window)
  CAMKV_DEVICE float* shares;   // per loser: a_e (nearest: then its weight a_e / total)
  CAMKV_DEVICE float* squares;  // per column: the survivor key's squared norm
  CAMKV_DEVICE float* totals;   // per column: A_t + the sum of its merging losers' a_e
  CAMKV_DEVICE float* keep;     // per column: 1 - that sum / the total
  CAMKV_DEVICE int* counts;     // per column: losers whose target it is (nearest) or whose
                                // window may hold it (window)
  CAMKV_DEVICE int* starts;     // per column: its first loser in `order` (nearest) or its
                                // first loser (window); [n_survivors] the end (nearest)
  CAMKV_DEVICE int* order;      // nearest: loser indices grouped by target, ascending in each
  CAMKV_DEVICE float* tops;     // keepkv, per column: its group's largest logit M, +inf where
                                // one of the group's logits is not finite
  int n_losers;
};

// Survivor column c's squared norm, for every c (one per thread).
template <typename T>
CAMKV_INLINE void camkv_survivor_squares(CamRows<T> r, CAMKV_DEVICE float* squares, CamGroup g) {
  for (int c = camkv_tid(g); c < r.n_survivors; c += camkv_gsize(g)) {
    float sq = 0.0f;
    for (int d = 0; d < r.Dk; ++d) {
      float kd = r.shadow[(long)d * r.columns + c];
      sq = camkv_madd(sq, kd, kd);
    }
    squares[c] = sq;
  }
}

// Section 4.1 for loser e by lane `lane` of a team: over the survivor columns of
// its share (blocks of 4, one block in CAMKV_LANES), the non-sink column with the
// largest cosine (ties to the smaller column), as *best = -cosine and *best_c; each
// dot a sequential sum in feature order. The team's best of its lanes' (ties to the
// smaller column) is the search's answer.
template <typename T>
CAMKV_INLINE void camkv_nearest_alone(CamRows<T> r, int e, int n_sink, const CAMKV_DEVICE float* squares, int lane,
                                      CAMKV_DEVICE float* row_dots, CAMKV_THREAD float* best_out,
                                      CAMKV_THREAD int* best_c_out) {
  const CAMKV_DEVICE T* k_e = camkv_key(r, e);
  float norm_e = camkv_sqrt(camkv_dot(k_e, k_e, r.Dk));
  float best = CAMKV_INF;
  int best_c = r.n_survivors;
#if CAMKV_HOST_SEARCH
  // A lone CPU thread: the same dots, feature by feature over every column at once
  // (row_dots, n_survivors floats), a loop the compiler runs as SIMD lanes; each dot
  // is still a sequential sum in feature order, so the cosines are the same bits.
  for (int c = 0; c < r.n_survivors; ++c) {
    row_dots[c] = 0.0f;
  }
  for (int d = 0; d < r.Dk; ++d) {
    float ed = camkv_float(k_e[d]);
    const CAMKV_DEVICE float* feature = r.shadow + (long)d * r.columns;
    for (int c = 0; c < r.n_survivors; ++c) {
      row_dots[c] = camkv_madd(row_dots[c], ed, feature[c]);
    }
  }
  for (int c = 0; c < r.n_survivors; ++c) {
    if (r.positions[r.survivors[c]] >= n_sink) {
      float neg = -camkv_cosine_of(row_dots[c], squares[c], norm_e);
      if (neg < best) {
        best = neg;
        best_c = c;
      }
    }
  }
  *best_out = best;
  *best_c_out = best_c;
  return;
#endif
  float dots[4];
  for (int c0 = 4 * lane; c0 < r.n_survivors; c0 += 4 * CAMKV_LANES) {
    for (int i = 0; i < 4; ++i) {
      dots[i] = 0.0f;
    }
    for (int d = 0; d < r.Dk; ++d) {
      float ed = camkv_float(k_e[d]);
      const CAMKV_DEVICE float* column = r.shadow + (long)d * r.columns + c0;
      for (int i = 0; i < 4; ++i) {
        dots[i] = camkv_madd(dots[i], ed, column[i]);  // columns past the end are padding
      }
    }
    for (int i = 0; i < 4 && c0 + i < r.n_survivors; ++i) {
      if (r.positions[r.survivors[c0 + i]] >= n_sink) {
        float neg = -camkv_cosine_of(dots[i], squares[c0 + i], norm_e);
        if (neg < best) {
          best = neg;
          best_c = c0 + i;
        }
      }
    }
  }
  *best_out = best;
  *best_c_out = best_c;
}

// Phase 1, nearest rules: each loser's target column and cosine, a team of CAMKV_LANES
// threads a loser, its lanes sharing the survivors (a lone CPU thread keeps its dots in
// the totals' scratch, free until phase 3). Every thread runs the same rounds
// (the team's reduction); -1 where no non-sink survivor exists.
template <typename T>
CAMKV_INLINE void camkv_nearest_targets(CamRows<T> r, CamMergeScratch m, int n_sink, CamGroup g) {
  camkv_survivor_squares(r, m.squares, g);
  camkv_barrier(g);
  int lane = camkv_tid(g) % CAMKV_LANES, teams = camkv_gsize(g) / CAMKV_LANES;
  for (int k0 = 0; k0 < m.n_losers; k0 += teams) {
    int k = k0 + camkv_tid(g) / CAMKV_LANES;
    float best = CAMKV_INF;
    int best_c = r.n_survivors;
    if (k < m.n_losers) {
      camkv_nearest_alone(r, m.losers[k], n_sink, m.squares, lane, m.totals, &best, &best_c);
    }
    camkv_lane_best(g, &best, &best_c);
    if (k < m.n_losers && lane == 0) {
      m.cosines[k] = -best;
      m.targets[k] = best_c < r.n_survivors ? best_c : -1;
    }
  }
}

// Loser k's first window column: the survivors before loser e = losers[k] are the e
// rows before it less the k losers before it. Non-decreasing in k.
CAMKV_INLINE int camkv_window_start(CamMergeScratch m, int k) {
  return m.losers[k] - k;
}

// Phase 2, for every loser (one per thread): the gate (section 4.3, on the scores before
// any merge, drawn at the loser's position) and its share; a loser that does not merge
// gets target -1. Returns how many merge (every thread the same).
// d2o (section 4.5), once the losers' targets are known: the row's threshold moved by the
// mean of its losers' finite nearest cosines, written back and returned (every thread).
template <typename T>
CAMKV_INLINE float camkv_move_threshold(CamRows<T> r, CamMergeScratch m, CamGroup g) {
  float sum = 0.0f, count = 0.0f;
  for (int k = camkv_tid(g); k < m.n_losers; k += camkv_gsize(g)) {
    if (camkv_finite(m.cosines[k])) {  // a loser with no target has cosine -inf
      sum += m.cosines[k];
      count += 1.0f;
    }
  }
  float total = camkv_group_sum(g, sum);
  int counted = (int)camkv_group_sum(g, count);  // counts below 2^24 add exactly
  float tau = camkv_moved_threshold(*r.threshold, total, counted);
  camkv_barrier(g);  // every thread has read the threshold
  if (camkv_tid(g) == 0) {
    *r.threshold = tau;
  }
  camkv_barrier(g);
  return tau;
}

template <typename T>
CAMKV_INLINE int camkv_gates_and_shares(CamRows<T> r, CamMergeScratch m, CAMKV_CONSTANT const CamParams* p,
                                        camkv_u32 row_id, int kind, float threshold, CamGroup g) {
  int merging = 0;
  for (int k = camkv_tid(g); k < m.n_losers; k += camkv_gsize(g)) {
    int e = m.losers[k];
    float s_e = r.scores[e];
    float s_target = 0.0f;
    int width = 0;
    if (kind == CAMKV_KIND_WINDOW) {
      int c0 = camkv_window_start(m, k);
      width = r.n_survivors - c0 < p->window ? r.n_survivors - c0 : p->window;
      float target_sum = 0.0f;
      for (int i = 0; i < width; ++i) {
        target_sum += r.scores[r.survivors[c0 + i]];
      }
      s_target = target_sum / (float)width;
      m.targets[k] = width > 0 ? c0 : -1;
    } else if (m.targets[k] >= 0) {
      s_target = r.scores[r.survivors[m.targets[k]]];
    }
    if (m.targets[k] >= 0 && p->gate && camkv_gate_open(s_e, s_target, p->seed, row_id, r.positions[e]) == 0) {
      m.targets[k] = -1;
    }
    if (m.targets[k] >= 0 && r.threshold != 0 && !(m.cosines[k] >= threshold)) {
      m.targets[k] = -1;  // d2o: below the row's threshold, dropped
    }
    if (m.targets[k] < 0) {
      continue;
    }
    merging += 1;
    if (r.votes != 0) {  // keepkv: its shares wait for its group's largest logit (camkv_settle_keeping_output)
      m.cosines[k] = camkv_query_logit(r, (const CAMKV_DEVICE T*)camkv_key(r, e), p->scale);
      m.shares[k] = 0.0f;
      continue;
    }
    if (kind == CAMKV_KIND_WINDOW) {
      m.cosines[k] = (float)width;
      m.shares[k] = s_e / (float)width;
      continue;
    }
    int t = r.survivors[m.targets[k]];
    float norm_e = 0.0f, norm_t = 0.0f;
    if (camkv_reads_value_norms(p->merge)) {
      norm_e = camkv_norm(r.values + (long)e * r.Dv, r.Dv);
      norm_t = camkv_norm(r.values + (long)t * r.Dv, r.Dv);
    }
    m.shares[k] = camkv_loser_share(p->merge, m.cosines[k], s_e, s_target, norm_e, norm_t);
  }
  // Counts below 2^24 add exactly in float32.
  return (int)camkv_group_sum(g, (float)merging);
}

// Exclusive prefix sums of counts[0, n) into starts[0, n], starts[n] the total: each
// thread sums one contiguous block, after the blocks before it (parked in scratch).
CAMKV_INLINE void camkv_exclusive_scan(const CAMKV_DEVICE int* counts, int n, CAMKV_DEVICE int* starts,
                                       CAMKV_DEVICE int* block_sums, CamGroup g) {
  int per = (n + camkv_gsize(g) - 1) / camkv_gsize(g);
  int j0 = camkv_tid(g) * per;
  int j1 = j0 + per < n ? j0 + per : n;
  int mine = 0;
  for (int j = j0; j < j1; ++j) {
    mine += counts[j];
  }
  block_sums[camkv_tid(g)] = mine;
  camkv_barrier(g);
  int at = 0, total = 0;
  for (int t = 0; t < camkv_gsize(g); ++t) {
    at += t < camkv_tid(g) ? block_sums[t] : 0;
    total += block_sums[t];
  }
  for (int j = j0; j < j1; ++j) {
    starts[j] = at;
    at += counts[j];
  }
  if (camkv_tid(g) == 0) {
    starts[n] = total;
  }
  camkv_barrier(g);  // the sums are complete, and the block sums free again
}

// A target column's sums over its merging losers become its blend (section 4.4):
// total = A_t + taken, each loser's weight a_e / total, keep = 1 - taken / total (one
// loser: (1 - w) V_t + w V_e), and its score s_t + the mass it takes. Returns the total.
// Column c's blend from its target share, the sum of its losers' shares and their mass.
template <typename T>
CAMKV_INLINE float camkv_settle_shares(CamRows<T> r, CamMergeScratch m, int c, float share, float taken,
                                       float mass_in) {
  int t = r.survivors[c];
  float total = share + taken;
  r.scores[t] = r.scores[t] + mass_in;
  m.keep[c] = total > 0.0f ? 1.0f - taken / total : 1.0f;
  m.totals[c] = total;
  return total;
}

template <typename T>
CAMKV_INLINE float camkv_settle_target(CamRows<T> r, CamMergeScratch m, CAMKV_CONSTANT const CamParams* p, int c,
                                       float taken, float mass_in) {
  return camkv_settle_shares(r, m, c, camkv_target_share(p->merge, r.scores[r.survivors[c]]), taken, mass_in);
}

// keepkv's column c (section 4.6), by its owner thread over its merging losers (listed in
// `order`): the group's largest logit M for the query, the masses m_i = c_i exp(l_i - M)
// as its shares (the votes alone where a logit is not finite), its votes summed, and the
// blend settled. Returns the total.
template <typename T>
CAMKV_INLINE float camkv_settle_keeping_output(CamRows<T> r, CamMergeScratch m, CAMKV_CONSTANT const CamParams* p,
                                               int c) {
  int t = r.survivors[c];
  float top_in = -CAMKV_INF;
  bool finite = true;
  for (int i = m.starts[c]; i < m.starts[c + 1]; ++i) {
    float l_e = m.cosines[m.order[i]];
    finite = finite && camkv_finite(l_e);
    top_in = l_e > top_in ? l_e : top_in;
  }
  float l_t = camkv_query_logit(r, (const CAMKV_DEVICE T*)(r.keys + (long)t * r.Dk), p->scale);
  finite = finite && camkv_finite(l_t);
  float top = finite ? (l_t > top_in ? l_t : top_in) : 0.0f;
  float m_t = r.votes[t] * (finite ? camkv_exp(l_t - top) : 1.0f);
  float taken = 0.0f, mass_in = 0.0f, votes_in = 0.0f;
  for (int i = m.starts[c]; i < m.starts[c + 1]; ++i) {
    int k = m.order[i], e = m.losers[k];
    m.shares[k] = r.votes[e] * (finite ? camkv_exp(m.cosines[k] - top) : 1.0f);
    taken += m.shares[k];
    mass_in += r.scores[e];
    votes_in += r.votes[e];
  }
  r.votes[t] = r.votes[t] + votes_in;
  m.tops[c] = finite ? top : CAMKV_INF;  // not finite: the key stays the weighted mean
  return camkv_settle_shares(r, m, c, camkv_target_share(p->merge, m_t), taken, mass_in);
}


// Phase 3's bookkeeping, nearest rules: each target column's merging losers listed in
// loser order (a counting sort), their shares and masses summed, and their weights.
// Column c belongs to thread c % group size, which walks the losers in order and keeps
// the ones of its columns: so each column's lists and sums run in loser order, as the
// single-thread loop does, and no two threads write one column.
template <typename T>
CAMKV_INLINE void camkv_group_by_target(CamRows<T> r, CamMergeScratch m, CAMKV_CONSTANT const CamParams* p,
                                        CAMKV_DEVICE int* block_sums, CamGroup g) {
  CAMKV_DEVICE float* taken = m.totals;  // the shares' sums, until settled
  CAMKV_DEVICE float* mass_in = m.keep;  // the masses' sums, until settled
  for (int c = camkv_tid(g); c < r.n_survivors; c += camkv_gsize(g)) {
    m.counts[c] = 0;
    taken[c] = 0.0f;
    mass_in[c] = 0.0f;
  }
  for (int k = 0; k < m.n_losers; ++k) {
    int c = m.targets[k];
    if (c >= 0 && c % camkv_gsize(g) == camkv_tid(g)) {
      m.counts[c] += 1;
      taken[c] += m.shares[k];
      mass_in[c] += r.scores[m.losers[k]];
    }
  }
  camkv_barrier(g);
  camkv_exclusive_scan(m.counts, r.n_survivors, m.starts, block_sums, g);
  for (int c = camkv_tid(g); c < r.n_survivors; c += camkv_gsize(g)) {
    m.counts[c] = 0;  // now the fill of the column's list
  }
  for (int k = 0; k < m.n_losers; ++k) {
    int c = m.targets[k];
    if (c >= 0 && c % camkv_gsize(g) == camkv_tid(g)) {
      m.order[m.starts[c] + m.counts[c]] = k;
      m.counts[c] += 1;
    }
  }
  for (int c = camkv_tid(g); c < r.n_survivors; c += camkv_gsize(g)) {
    if (m.counts[c] == 0) {
      continue;
    }
    float total = r.votes != 0 ? camkv_settle_keeping_output(r, m, p, c)
                               : camkv_settle_target(r, m, p, c, taken[c], mass_in[c]);
    for (int i = m.starts[c]; i < m.starts[c + 1] && total > 0.0f; ++i) {
      m.shares[m.order[i]] = m.shares[m.order[i]] / total;
    }
  }
  camkv_barrier(g);
}

// Feature d of column c's blend of keys, keep K_t + sum_k w_k K_e in float32, before rounding
// (camkv_blend_targets' arithmetic).
template <typename T>
CAMKV_INLINE float camkv_merged_feature(CamRows<T> r, CamMergeScratch m, int c, const CAMKV_DEVICE T* k_t, int d) {
  float incoming = 0.0f;
  for (int i = m.starts[c]; i < m.starts[c + 1]; ++i) {
    int k = m.order[i];
    incoming = camkv_madd(incoming, m.shares[k], camkv_float(r.keys[(long)m.losers[k] * r.Dk + d]));
  }
  return camkv_mul(m.keep[c], camkv_float(k_t[d])) + incoming;
}

// Phase 3, nearest rules, on `len` features of rows `data` (values, or keys with
// merge_keys): each target column that takes losers, with a positive total, becomes
// keep V_t + (sum_k w_k V_e), the sum in loser order, rounded once. The group's threads
// share the (column, feature) pairs.
template <typename T>
CAMKV_INLINE void camkv_blend_targets(CamRows<T> r, CamMergeScratch m, CAMKV_DEVICE T* data, int len, CamGroup g) {
  long pairs = (long)r.n_survivors * len;
  for (long f = camkv_tid(g); f < pairs; f += camkv_gsize(g)) {
    int c = (int)(f / len);
    int d = (int)(f - (long)c * len);
    if (m.counts[c] == 0 || !(m.totals[c] > 0.0f)) {
      continue;
    }
    float incoming = 0.0f;
    for (int i = m.starts[c]; i < m.starts[c + 1]; ++i) {
      int k = m.order[i];
      incoming = camkv_madd(incoming, m.shares[k], camkv_float(data[(long)m.losers[k] * len + d]));
    }
    CAMKV_DEVICE T* target = data + (long)r.survivors[c] * len + d;
    *target = (T)(camkv_mul(m.keep[c], camkv_float(*target)) + incoming);
  }
}

// Section 4.6's keys of a chunk's targets (keepkv): each column c that takes losers, with
// a positive total, gets K' = keep K_t + sum_k w_k K_e (float32, the sum in loser order),
// then K' + d q where its group's logits are finite and d is, rounded once. One thread a
// column: it sums q.K' over the features, then writes them.
template <typename T>
CAMKV_INLINE void camkv_keep_output_keys(CamRows<T> r, CamMergeScratch m, CAMKV_CONSTANT const CamParams* p,
                                         CamGroup g) {
  const CAMKV_DEVICE float* q = r.query;
  float square = 0.0f;
  for (int d = 0; d < r.Dk; ++d) {
    square = camkv_madd(square, q[d], q[d]);
  }
  for (int c = camkv_tid(g); c < r.n_survivors; c += camkv_gsize(g)) {
    if (m.counts[c] == 0 || !(m.totals[c] > 0.0f)) {
      continue;
    }
    CAMKV_DEVICE T* k_t = r.keys + (long)r.survivors[c] * r.Dk;
    float dot = 0.0f;
    for (int d = 0; d < r.Dk; ++d) {
      dot = camkv_madd(dot, camkv_merged_feature(r, m, c, k_t, d), q[d]);
    }
    float want = camkv_wanted_logit(m.tops[c], m.totals[c], r.votes[r.survivors[c]]);
    float shift = camkv_key_shift(want, dot, square, p->scale);
    bool moved = camkv_finite(m.tops[c]) && camkv_finite(shift);
    for (int d = 0; d < r.Dk; ++d) {
      float merged = camkv_merged_feature(r, m, c, k_t, d);
      k_t[d] = (T)(moved ? camkv_madd(merged, shift, q[d]) : merged);
    }
  }
}

// The first loser index in [0, n_losers) whose first window column is >= c (n_losers if none).
CAMKV_INLINE int camkv_first_window_at(CamMergeScratch m, int c) {
  int lo = 0, hi = m.n_losers;
  while (lo < hi) {
    int mid = (lo + hi) / 2;
    if (camkv_window_start(m, mid) < c) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// Phase 3's bookkeeping, window rules: column c lies in the windows of the losers
// whose first column is in [c - window + 1, c], a run of consecutive losers (first
// columns grow with k; a window runs to the last survivor where it is shorter). One
// thread a column: its run, and the sums of its merging losers' shares (s_e / |W(e)|,
// both its mass and, with "window_mass", its share) in loser order.
template <typename T>
CAMKV_INLINE void camkv_window_runs(CamRows<T> r, CamMergeScratch m, CAMKV_CONSTANT const CamParams* p, CamGroup g) {
  for (int c = camkv_tid(g); c < r.n_survivors; c += camkv_gsize(g)) {
    int k0 = camkv_first_window_at(m, c - p->window + 1);
    int k1 = camkv_first_window_at(m, c + 1);
    m.starts[c] = k0;
    m.counts[c] = k1 - k0;
    float taken = 0.0f;
    for (int k = k0; k < k1; ++k) {
      taken += m.targets[k] >= 0 ? m.shares[k] : 0.0f;
    }
    camkv_settle_target(r, m, p, c, taken, taken);
  }
  camkv_barrier(g);
}

// Phase 3, window rules, on the values: each column adds (sum V_e / |W(e)|) over the
// merging losers whose window holds it ("window"), or becomes keep V_j + (sum
// (share_e / total) V_e) ("window_mass", unchanged if its total is not > 0); sums in
// loser order, rounded once.
template <typename T>
CAMKV_INLINE void camkv_blend_windows(CamRows<T> r, CamMergeScratch m, int blends, CamGroup g) {
  long pairs = (long)r.n_survivors * r.Dv;
  for (long f = camkv_tid(g); f < pairs; f += camkv_gsize(g)) {
    int c = (int)(f / r.Dv);
    int d = (int)(f - (long)c * r.Dv);
    float total = m.totals[c];
    if (m.counts[c] == 0 || (blends && !(total > 0.0f))) {
      continue;
    }
    float incoming = 0.0f;
    for (int k = m.starts[c]; k < m.starts[c] + m.counts[c]; ++k) {
      if (m.targets[k] >= 0) {
        float v_e = camkv_float(r.values[(long)m.losers[k] * r.Dv + d]);
        incoming = blends ? camkv_madd(incoming, m.shares[k] / total, v_e) : incoming + v_e / m.cosines[k];
      }
    }
    CAMKV_DEVICE T* target = r.values + (long)r.survivors[c] * r.Dv + d;
    float own = camkv_float(*target);
    *target = (T)((blends ? camkv_mul(m.keep[c], own) : own) + incoming);
  }
}

// Section 7's merges of a chunk whose losers are flagged and survivors listed: returns
// the losers that merged.
template <typename T>
CAMKV_INLINE int camkv_merge_chunk(CamRows<T> r, CamMergeScratch m, CAMKV_CONSTANT const CamParams* p,
                                   camkv_u32 row_id, CamGroup g) {
  CamMergeRule rule = camkv_merge_rule(p->merge);
  m.n_losers = camkv_list_rows(r, 1, m.losers, g);
  if (rule.kind == CAMKV_KIND_NEAREST) {
    camkv_nearest_targets(r, m, p->n_sink, g);
    camkv_barrier(g);
  }
  float threshold = r.threshold != 0 ? camkv_move_threshold(r, m, g) : 0.0f;
  if (r.votes != 0) {  // keepkv's query: the chunk's last token's, its key as it was before any merge
    camkv_load_query(r, (const CAMKV_DEVICE T*)(r.keys + (long)(r.count - 1) * r.Dk), r.pend_queries, p, g);
  }
  int merged = camkv_gates_and_shares(r, m, p, row_id, rule.kind, threshold, g);  // ends with the group sum's barrier
  if (rule.kind == CAMKV_KIND_WINDOW) {
    camkv_window_runs(r, m, p, g);
    camkv_blend_windows(r, m, rule.blends, g);
  } else {
    camkv_group_by_target(r, m, p, r.group_counts, g);
    camkv_blend_targets(r, m, r.values, r.Dv, g);
    if (r.votes != 0) {
      camkv_keep_output_keys(r, m, p, g);
    } else if (p->merge_keys && rule.keys_allowed) {
      camkv_blend_targets(r, m, r.keys, r.Dk, g);
    }
  }
  camkv_barrier(g);
  return merged;
}

// The merge phase's scratch of a chunk call (the layout at the top): the logits' floats,
// free once the chunk is scored, and the ints after the survivors.
template <typename T>
CAMKV_INLINE CamMergeScratch camkv_merge_scratch(CamRowBuffers<T> b, CAMKV_CONSTANT const CamParams* p, CamRows<T> r) {
  int cap = p->n + p->S;
  CamMergeScratch m;
  m.losers = r.list;
  m.cosines = b.f32;
  m.shares = b.f32 + cap;
  m.totals = b.f32 + 2 * cap;
  m.keep = b.f32 + 3 * cap;
  m.squares = r.shadow + (long)p->Dk * r.columns;
  m.targets = b.i32 + 4 * cap;
  m.counts = b.i32 + 5 * cap;
  m.order = b.i32 + 6 * cap;
  m.starts = b.i32 + 7 * cap;  // cap + 1 of them
  m.tops = b.f32 + CAMKV_F32_MASS * cap;  // the mass, free once the chunk is scored
  m.n_losers = 0;
  return m;
}

template <typename T>
CAMKV_INLINE int camkv_update_chunk(CamRowBuffers<T> b, CAMKV_CONSTANT const CamParams* p, camkv_u32 row_id, CamGroup g) {
  int total = p->n + p->S;
  bool evicts = total > p->budget;
  CamRows<T> r;
  // Without eviction the out arrays are the work arrays; with it, scratch is.
  r.keys = evicts ? b.store : b.out_keys;
  r.values = evicts ? b.store + (long)total * p->Dk : b.out_values;
  r.scores = evicts ? b.f32 + CAMKV_F32_SCORES * total : b.out_scores;
  r.positions = evicts ? b.i32 : b.out_positions;
  r.count = total;
  r.has_pending = 0;
  r.pend_key = 0;
  r.pend_value = 0;
  r.pend_score = 0;
  r.pend_position = 0;
  r.loser = b.i32 + total;
  r.list = b.i32 + 2 * total;
  r.cosines = b.f32;  // the logits' scratch, free once the chunk is scored
  r.survivors = 0;
  r.n_survivors = 0;
  r.group_counts = b.i32 + CAMKV_I32_GROUP_COUNTS * total + 1;
  r.shadow = b.f32 + CAMKV_F32_SHADOW * total;
  r.columns = camkv_shadow_columns(1, p->n, p->S, p->n_out);
  r.Dk = p->Dk;
  r.Dv = p->Dv;
  int query_at = camkv_f32_query_at(1, p->n, p->S, p->n_out, p->Dk);
  r.votes = camkv_keeps_votes(p->merge) ? (evicts ? b.f32 + query_at - total : b.out_votes) : 0;
  r.pend_vote = 0;
  r.threshold = camkv_moves_threshold(p->merge) ? b.out_threshold : 0;
  r.query = b.f32 + query_at;
  r.pend_queries = b.queries + (p->key_scoring ? 0 : (long)(p->S - 1) * p->G * p->Dk);  // the last token's

  camkv_copy_state_in(r.keys, r.values, r.scores, r.positions, b.in_keys, b.in_values, b.in_scores,
                      b.in_positions, p->n, p->Dk, p->Dv, g);
  camkv_rule_state_in(r, b, p->n, true, g);
  camkv_copy_flat(r.keys + (long)p->n * p->Dk, b.new_keys, (long)p->S * p->Dk, g);
  camkv_copy_flat(r.values + (long)p->n * p->Dv, b.new_values, (long)p->S * p->Dv, g);
  for (int i = camkv_tid(g); i < p->S; i += camkv_gsize(g)) {
    r.scores[p->n + i] = 0.0f;
    r.positions[p->n + i] = p->offset + i;
    if (r.votes != 0) {
      r.votes[p->n + i] = 1.0f;  // a new token stands for itself
    }
  }
  camkv_barrier(g);
  camkv_shadow_build(r, total, g);
  camkv_score_chunk(r, p, b.queries, b.chunk_mass, b.f32, b.f32 + CAMKV_F32_MASS * total, g);
  if (!evicts) {
    return 0;
  }
  camkv_mark_losers(r, total - p->budget, p->offset + p->S - 1, p, g);
  r.survivors = b.i32 + 3 * total;
  r.n_survivors = camkv_list_rows(r, 0, r.survivors, g);
  camkv_shadow_keep_survivors(r, g);
  int merges = 0;
  if (camkv_merge_rule(p->merge).kind != CAMKV_KIND_DROP) {
    merges = camkv_merge_chunk(r, camkv_merge_scratch(b, p, r), p, row_id, g);
  }
  camkv_compact_survivors(r, b, g);
  return merges;
}

// ----------------------------------------------------------------------------
// The one entry every prelude calls: row `row` of a launch. Returns the merges.

template <typename T>
CAMKV_INLINE int camkv_update_row(CamRowBuffers<T> b, CAMKV_CONSTANT const CamParams* p, camkv_u32 row_id, CamGroup g) {
  if (camkv_runs_chunk(p->chunk, p->S)) {
    return camkv_update_chunk(b, p, row_id, g);
  }
  return camkv_update_exact(b, p, row_id, g);
}

// Row `row`'s slices of the launch buffers (all row-major, contiguous).
template <typename T>
CAMKV_INLINE CamRowBuffers<T> camkv_row_buffers(
    int row, CAMKV_CONSTANT const CamParams* p,
    const CAMKV_DEVICE T* in_keys, const CAMKV_DEVICE T* in_values, const CAMKV_DEVICE float* in_scores,
    const CAMKV_DEVICE int* in_positions, const CAMKV_DEVICE T* new_keys, const CAMKV_DEVICE T* new_values,
    const CAMKV_DEVICE float* queries, const CAMKV_DEVICE float* chunk_mass, CAMKV_DEVICE T* out_keys,
    CAMKV_DEVICE T* out_values, CAMKV_DEVICE float* out_scores, CAMKV_DEVICE int* out_positions, CAMKV_DEVICE float* f32,
    CAMKV_DEVICE int* i32, CAMKV_DEVICE T* store, const CAMKV_DEVICE float* in_votes,
    const CAMKV_DEVICE float* in_threshold, CAMKV_DEVICE float* out_votes, CAMKV_DEVICE float* out_threshold) {
  long r = (long)row;
  CamRowBuffers<T> b;
  b.in_keys = in_keys + r * p->n * p->Dk;
  b.in_values = in_values + r * p->n * p->Dv;
  b.in_scores = in_scores + r * p->n;
  b.in_positions = in_positions + r * p->n;
  b.new_keys = new_keys + r * p->S * p->Dk;
  b.new_values = new_values + r * p->S * p->Dv;
  b.queries = queries + (p->key_scoring ? 0 : r * p->S * p->G * p->Dk);
  b.chunk_mass = chunk_mass + (p->prescored ? r * (p->n + p->S) : 0);
  b.out_keys = out_keys + r * p->n_out * p->Dk;
  b.out_values = out_values + r * p->n_out * p->Dv;
  b.out_scores = out_scores + r * p->n_out;
  b.out_positions = out_positions + r * p->n_out;
  b.f32 = f32 + r * p->f32_stride;
  b.i32 = i32 + r * p->i32_stride;
  b.store = store + r * p->store_stride;
  // The rule state's buffers are placeholders for a rule that keeps none.
  bool votes = camkv_keeps_votes(p->merge) != 0, threshold = camkv_moves_threshold(p->merge) != 0;
  b.in_votes = in_votes + (votes ? r * p->n : 0);
  b.out_votes = out_votes + (votes ? r * p->n_out : 0);
  b.in_threshold = in_threshold + (threshold ? r : 0);
  b.out_threshold = out_threshold + (threshold ? r : 0);
  return b;
}

#endif  // CAMKV_CORE_H
