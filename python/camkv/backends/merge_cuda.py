"""A compression's merges on an NVIDIA GPU, in kernels where MLX operations take many
launches and passes over large arrays (camkv.backends.merge_ops calls them there, after
camkv.backends.compact_cuda.partition has chosen the survivors).

- **The rows a compression merges, gathered once**: losers' and survivors' keys and
  values as float32, the keys as stored, scores, positions, votes and the keys' and
  values' norms, a warp a row in one launch, where the MLX operations take a
  concatenation, five gathers, two casts and two norms' three each.
- **The nearest survivor of every loser** (docs/algorithm.md section 4.1): MLX's matrix
  product makes the dot products losers x survivors [R, k, m] (on the tensor cores), and
  one kernel reads them once: a warp per loser ranks each candidate's dot / |K_t| and
  keeps the largest (ties to the smaller survivor index, as MLX's argmax), then writes
  the target, whether there is one and the cosine. As MLX operations the ranking is a
  division, a mask and an argmax, three more passes over an array of R x k x m floats
  (134 MB for eight rows of 2048 losers and 2048 survivors), and the rest eight more.
- **A nearest rule's blend, whole** (section 4.4 for every target at once): one launch
  adds every merging loser's share-weighted value (and key), its share, a count and its
  mass into its target's float32 sums (a warp per loser, atomic additions), and one
  more writes each survivor's blended row and score from them, straight into buffers
  with room to decode in the rows' storage dtype (as the one-launch drop writes its
  survivors): two launches where the MLX operations take about twenty, and no casts or
  copies into buffers after them. The first counts each row's merging losers, the second
  writes those counts and the count so far it is handed plus them (a cache's merge
  count, with no launch of its own). Where every loser with a target merges (no gate,
  no moving threshold), the nearest search's kernel is the first of them
  (search_and_blend): the warp that finds a loser's target adds it there.
- **d2o's moving threshold** (section 4.5): a work group a row sums its losers' finite
  cosines, moves the threshold and marks the losers that reach it, one launch where the
  MLX operations take about twenty.
- **keepkv's output-preserving merge, whole** (section 4.6): three launches (the
  losers' logits for the query and each target's largest incoming one, by atomic maxima,
  in the nearest search's launch where no gate draws; the losers' masses and their
  weighted rows, votes and scores summed into the targets; each survivor's blended
  value, its key moved to keep the query's attention, and its votes, into buffers with
  room to decode as the blend's; a survivor's own logit, top and mass taken again by
  each launch that reads them) where the MLX operations take about a hundred.
- **keepkv's inputs of a compression**: its votes joined with the chunk's, their log (the
  bias its chunk mass adds to each logit) and its query (the mean of the last queries),
  one launch where the MLX operations take seven.
- **The paper's window rule, whole** (section 4.2, no gate): a warp per loser finds the
  survivors after it by a binary search and adds its share of value and mass into each,
  where the MLX operations compare every loser with every survivor; the blend's second
  launch then writes every survivor into buffers with room to decode.
- **A window rule's sums otherwise** (with the gate, or `window_mass`): a warp per
  (loser, target slot) adds the loser's row and scalars into the target's float32 sums,
  every loser at once, where MLX's scatter-add first spreads every row over the slots.

The sums run in the device's order (section 8's tolerances), as MLX's scatter-add's do.
"""

from __future__ import annotations

import zlib

import mlx.core as mx

from . import drop, kernel_text, sources
from .constants import floats, ints

_THREADS = 256
_WARPS = _THREADS // 32

_NEAREST = """
  // dims: R rows, k losers, m survivors, n_sink. A warp per (row, loser): camkv_nearest_of.
  const long rows = dims[0], k = dims[1], m = dims[2];
  const int n_sink = dims[3];
  const long loser = (long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (loser >= rows * k) return;  // the whole warp: loser is the same for its lanes
  const CamkvNearest best = camkv_nearest_of(products + loser * m, norm_k, positions, loser / k, m, n_sink,
                                             norm_l[loser], lane);
  if (lane == 0) {
    target[loser] = best.t;
    found[loser] = best.has;
    cosine[loser] = best.cosine;
  }
"""

_NEAREST_SPREAD = """
  // dims: R rows, k losers, m survivors, n_sink, Dv value and Dk key columns (Dk 0: keys
  // stay), the rule's code. A nearest rule's search and spread in one launch, where every
  // loser with a target merges (no gate, no moving threshold): a warp per (row, loser),
  // camkv_nearest_of, then camkv_spread_loser into the sums [R, m, Dv + Dk + 3] and the
  // rows' counts after them, as _NEAREST and _SPREAD one after the other.
  const long rows = dims[0], k = dims[1], m = dims[2];
  const int n_sink = dims[3], Dv = dims[4], Dk = dims[5], merge = dims[6];
  const long loser = (long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (loser >= rows * k) return;  // the whole warp
  const long r = loser / k;
  const CamkvNearest best = camkv_nearest_of(products + loser * m, norm_k, positions, r, m, n_sink, norm_l[loser],
                                             lane);
  if (!best.has) return;  // the whole warp: every lane holds the same result
  camkv_spread_loser(sums, rows, m, Dv, Dk, merge, r, r * m + best.t, best.cosine, mass[loser], scores,
                     norm_in[loser], norm_t, values + loser * Dv, keys + loser * Dk, lane);
"""

_NEAREST_DIRECT = """
  // nearest's result without the products in memory: the dot products of a tile of TL
  // losers by a tile of TS survivors at a time, from keys in shared memory (DC channels at
  // a time). dims: R rows, k losers, m survivors, n_sink, D channels. A work group of
  // 256 threads per (row, tile of losers); thread (ty, tx) of 16 x 16 takes losers ty +
  // 16 i and survivors tx + 16 j (i, j < 4) of each tile.
  // TL (losers a work group, the launch's template) = TS = T * PER.
  constexpr int TS = TL, DC = 32, T = 16, PER = 4;
  const int k = dims[1], m = dims[2], n_sink = dims[3], D = dims[4];
  const int tiles = (k + TL - 1) / TL;
  const int r = blockIdx.x / tiles, l0 = (blockIdx.x % tiles) * TL;
  const int tx = threadIdx.x % T, ty = threadIdx.x / T;
  __shared__ float tile_l[TL][DC + 1];
  __shared__ float tile_s[TS][DC + 1];
  const float* keys_l = losers + (long)r * k * D;
  const float* keys_s = kept + (long)r * m * D;
  float best[PER], best_dot[PER], first_dot[PER];
  int best_at[PER];
  #pragma unroll
  for (int i = 0; i < PER; ++i) {
    best[i] = -INFINITY;
    best_dot[i] = first_dot[i] = 0.0f;
    best_at[i] = 0;
  }
  for (int s0 = 0; s0 < m; s0 += TS) {
    float acc[PER][PER];  // in registers: every loop over i and j is unrolled
    #pragma unroll
    for (int i = 0; i < PER; ++i)
      #pragma unroll
      for (int j = 0; j < PER; ++j) acc[i][j] = 0.0f;
    for (int d0 = 0; d0 < D; d0 += DC) {
      for (int e = threadIdx.x; e < TL * DC; e += blockDim.x) {
        const int row = e / DC, d = d0 + e % DC;
        tile_l[row][e % DC] = (l0 + row < k && d < D) ? keys_l[(long)(l0 + row) * D + d] : 0.0f;
        tile_s[row][e % DC] = (s0 + row < m && d < D) ? keys_s[(long)(s0 + row) * D + d] : 0.0f;
      }
      __syncthreads();
      for (int d = 0; d < DC; ++d) {
        float a[PER], b[PER];
        #pragma unroll
        for (int i = 0; i < PER; ++i) a[i] = tile_l[ty + T * i][d];
        #pragma unroll
        for (int j = 0; j < PER; ++j) b[j] = tile_s[tx + T * j][d];
        #pragma unroll
        for (int i = 0; i < PER; ++i)
          #pragma unroll
          for (int j = 0; j < PER; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
      }
      __syncthreads();
    }
    // A thread's survivors rise (j, then tiles), so a strict comparison keeps the first of equals.
    #pragma unroll
    for (int j = 0; j < PER; ++j) {
      const int s = s0 + tx + T * j;
      if (s >= m) break;
      const float norm = norm_k[(long)r * m + s];
      const bool candidate = positions[(long)r * m + s] >= n_sink && norm < INFINITY;
      #pragma unroll
      for (int i = 0; i < PER; ++i) {
        if (s == 0) first_dot[i] = acc[i][j];
        const float ranked = acc[i][j] / fmaxf(norm, 1e-12f);
        if (candidate && ranked > best[i]) {
          best[i] = ranked;
          best_at[i] = s;
          best_dot[i] = acc[i][j];
        }
      }
    }
  }
  // The 16 threads of a loser are 16 neighbouring lanes of one warp.
  #pragma unroll
  for (int i = 0; i < PER; ++i) {
    for (int o = T / 2; o > 0; o /= 2) {
      const float other = __shfl_xor_sync(0xffffffffu, best[i], o);
      const int other_at = __shfl_xor_sync(0xffffffffu, best_at[i], o);
      const float other_dot = __shfl_xor_sync(0xffffffffu, best_dot[i], o);
      if (other > best[i] || (other == best[i] && other != -INFINITY && other_at < best_at[i])) {
        best[i] = other;
        best_at[i] = other_at;
        best_dot[i] = other_dot;
      }
    }
    const int l = l0 + ty + T * i;
    if (tx == 0 && l < k) {  // the thread that holds survivor 0's dot product
      const long loser = (long)r * k + l;
      const float norm_e = norm_l[loser];
      const bool has = best[i] > -INFINITY && norm_e < INFINITY;
      const int t = has ? best_at[i] : 0;
      target[loser] = t;
      found[loser] = has;
      cosine[loser] = (best[i] > -INFINITY ? best_dot[i] : first_dot[i])
                      / fmaxf(__fmul_rn(norm_e, norm_k[(long)r * m + t]), 1e-12f);
    }
  }
"""

# Losers a work group of nearest_direct takes: its 16 x 16 threads hold 4 losers x 4
# survivors each, so 16 * 4 (the kernel's TL, which it reads as a launch template).
_DIRECT_LOSERS = 64

_SCATTER = """
  // dims: R rows, k losers, w target slots a loser, m survivors, C columns. A warp per (loser, slot).
  const long rows = dims[0], k = dims[1], w = dims[2], m = dims[3], C = dims[4];
  const long edge = (long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (edge >= rows * k * w) return;
  const long r = edge / (k * w), e = (edge / w) % k;
  if (!live[edge]) return;
  const float* source = rows_in + (r * k + e) * C;
  float* into = sums + (r * m + targets[edge]) * C;
  for (long c = lane; c < C; c += 32) atomicAdd(into + c, source[c]);
"""

_HEADER = """
// An atomic maximum of floats (no NaN among them): a float of sign bit 0 orders as its
// int bits, one of sign bit 1 (-0.0 too, which >= 0 would let through) reversed as its
// unsigned bits.
__device__ inline void camkv_atomic_max(float* at, float value) {
  if ((__float_as_uint(value) >> 31) == 0u) atomicMax(reinterpret_cast<int*>(at), __float_as_int(value));
  else atomicMin(reinterpret_cast<unsigned*>(at), __float_as_uint(value));
}

// a . b over n floats, summed by a warp: each lane's strided products, then the lanes'.
__device__ inline float camkv_warp_dot(const float* a, const float* b, int n, int lane) {
  float dot = 0.0f;
  for (int c = lane; c < n; c += 32) dot = __fadd_rn(dot, __fmul_rn(a[c], b[c]));
  for (int o = 16; o > 0; o /= 2) dot = __fadd_rn(dot, __shfl_xor_sync(0xffffffffu, dot, o));
  return dot;
}

// keepkv's logit of a row, scale q.K: a warp's dot product (every lane holds it).
__device__ inline float camkv_keep_logit(const float* key, const float* query, const float* scale, int Dk,
                                         int lane) {
  return __fmul_rn(scale[0], camkv_warp_dot(key, query, Dk, lane));
}

// Section 4.1 for one loser from its dot products with the m survivors of row r (dots):
// a warp's lanes rank each candidate (a non-sink survivor, position >= n_sink, of finite
// key norm) by dot / |K_t| and keep the largest (ties to the smaller survivor index, as
// MLX's argmax); every lane ends with the same target t (0 where none), whether there is
// one (a candidate, and a finite norm_e of the loser's own) and the cosine with t (with
// survivor 0 where none ranked), as merge_ops._nearest's operations compute them.
struct CamkvNearest {
  int t;
  bool has;
  float cosine;
};

__device__ inline CamkvNearest camkv_nearest_of(const float* dots, const float* norm_k, const int* positions, long r,
                                                long m, int n_sink, float norm_e, int lane) {
  float best = -INFINITY;
  int best_at = 0;
  // Each lane's survivors rise, so a strict comparison keeps the first of equals.
  for (long s = lane; s < m; s += 32) {
    const float norm = norm_k[r * m + s];
    if (positions[r * m + s] < n_sink || !(norm < INFINITY)) continue;
    const float ranked = dots[s] / fmaxf(norm, 1e-12f);
    if (ranked > best) { best = ranked; best_at = (int)s; }
  }
  for (int o = 16; o > 0; o /= 2) {
    const float other = __shfl_xor_sync(0xffffffffu, best, o);
    const int other_at = __shfl_xor_sync(0xffffffffu, best_at, o);
    if (other > best || (other == best && other != -INFINITY && other_at < best_at)) {
      best = other;
      best_at = other_at;
    }
  }
  CamkvNearest out;
  out.has = best > -INFINITY && norm_e < INFINITY;
  out.t = out.has ? best_at : 0;
  // The dot product read at the ranked best (survivor 0 where none ranked).
  out.cosine = dots[best > -INFINITY ? best_at : 0] / fmaxf(__fmul_rn(norm_e, norm_k[r * m + out.t]), 1e-12f);
  return out;
}

// The merges so far after a compression, by the first warp of its last launch (every
// lane calls it): prior[0] plus the R rows' merges, counted as floats by atomic additions
// after the sums (exact below 2^24 a row).
__device__ inline void camkv_merges_so_far(const float* counts, long rows, const int* prior, int* out_total,
                                           int lane) {
  int total = 0;
  for (long r = lane; r < rows; r += 32) total += (int)counts[r];
  for (int o = 16; o > 0; o /= 2) total += __shfl_xor_sync(0xffffffffu, total, o);
  if (lane == 0) out_total[0] = prior[0] + total;
}

// weight x a loser's value row [Dv] and key row [Dk] added into its target's sums
// (columns [0, Dv) and [Dv, Dv + Dk)), a warp's lanes over the columns.
__device__ inline void camkv_add_rows(float* into, float weight, const float* value, int Dv, const float* key,
                                      int Dk, int lane) {
  for (int c = lane; c < Dv; c += 32) atomicAdd(into + c, __fmul_rn(weight, value[c]));
  for (int c = lane; c < Dk; c += 32) atomicAdd(into + Dv + c, __fmul_rn(weight, key[c]));
}
"""

# After the rules' header (camkv_merges.h): a nearest rule's spread of one loser.
_SPREAD_HEADER = """
// One merging loser of row r into its target t (flat: r m + its survivor): its share
// a_e, the rule's (camkv_merges.h, as the kernel core takes it: from its cosine, its mass
// s_e, its target's score and, where the rule reads them, its value's norm and its
// target's), times its value (and key), then a_e, 1 and s_e, added into t's float32
// sums [R, m, Dv + Dk + 3], and 1 into row r's count after them (R more; the finish
// writes the merges a row and so far).
__device__ inline void camkv_spread_loser(float* sums, long rows, long m, int Dv, int Dk, int merge, long r, long t,
                                          float cosine, float mass_e, const float* scores, float norm_e,
                                          const float* norm_t, const float* value, const float* key, int lane) {
  const int C = Dv + Dk;
  const bool norms = camkv_reads_value_norms(merge);
  const float share = camkv_loser_share(merge, cosine, mass_e, scores[t], norms ? norm_e : 0.0f,
                                        norms ? norm_t[t] : 0.0f);
  float* into = sums + t * (C + 3);
  camkv_add_rows(into, share, value, Dv, key, Dk, lane);
  if (lane == 0) {
    atomicAdd(into + C, share);
    atomicAdd(into + C + 1, 1.0f);
    atomicAdd(into + C + 2, mass_e);
    atomicAdd(sums + rows * m * (C + 3) + r, 1.0f);
  }
}
"""

_GATHER = """
  // dims: R rows, N rows held, k losers, m survivors, Dk, Dv. A warp per (row, j) of the
  // k + m rows taken (the losers, then the survivors): its key and value as float32, its
  // key as stored, its score and position (and votes: VOTES), and its key's and its
  // value's L2 norms (each lane's sum of squares, then the warp's), written to the
  // losers' outputs (l_*, [R, k, ...]) or the survivors' (s_*, [R, m, ...]): each its own
  // contiguous array, so a later kernel takes it without a copy (MLX copies a strided
  // input, such as a slice of joined rows, into a contiguous one first).
  const long rows = dims[0], N = dims[1], k = dims[2], m = dims[3];
  const int Dk = dims[4], Dv = dims[5];
  const long item = (long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (item >= rows * (k + m)) return;  // the whole warp
  const long r = item / (k + m), j = item % (k + m);
  const bool lost = j < k;
  const long at = lost ? r * k + j : r * m + (j - k);
  const long from = r * N + (long)(lost ? loser_idx[r * k + j] : kept_idx[r * m + j - k]);
  float* to_keys = lost ? l_keys : s_keys;
  float* to_values = lost ? l_values : s_values;
  auto* to_stored = lost ? l_stored : s_stored;
  float squares = 0.0f;
  for (int c = lane; c < Dk; c += 32) {
    const auto key = keys[from * Dk + c];
    const float x = static_cast<float>(key);
    to_keys[at * Dk + c] = x;
    to_stored[at * Dk + c] = key;
    squares = __fadd_rn(squares, __fmul_rn(x, x));
  }
  float value_squares = 0.0f;
  for (int c = lane; c < Dv; c += 32) {
    const float x = static_cast<float>(values[from * Dv + c]);
    to_values[at * Dv + c] = x;
    value_squares = __fadd_rn(value_squares, __fmul_rn(x, x));
  }
  for (int o = 16; o > 0; o /= 2) {
    squares = __fadd_rn(squares, __shfl_xor_sync(0xffffffffu, squares, o));
    value_squares = __fadd_rn(value_squares, __shfl_xor_sync(0xffffffffu, value_squares, o));
  }
  if (lane == 0) {
    (lost ? l_scores : s_scores)[at] = scores[from];
    (lost ? l_positions : s_positions)[at] = positions[from];
    (lost ? l_norm : s_norm)[at] = sqrtf(squares);
    (lost ? l_value_norm : s_value_norm)[at] = sqrtf(value_squares);
    if (VOTES) (lost ? l_votes : s_votes)[at] = votes[from];
  }
"""

_SPREAD = """
  // dims: R rows, k losers, m survivors, Dv value and Dk key columns (Dk 0: keys stay),
  // the rule's code (a value, not a template: one build serves every rule). A warp per
  // (row, loser) that merges: camkv_spread_loser into its target's sums.
  const long rows = dims[0], k = dims[1], m = dims[2];
  const int Dv = dims[3], Dk = dims[4], merge = dims[5];
  const long loser = (long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (loser >= rows * k || !merging[loser]) return;  // the whole warp: loser is the same for its lanes
  const long r = loser / k;
  camkv_spread_loser(sums, rows, m, Dv, Dk, merge, r, r * m + target[loser], cosine[loser], mass[loser], scores,
                     norm_in[loser], norm_t, values + loser * Dv, keys + loser * Dk, lane);
"""

_FINISH = """
  // dims: R rows, m survivors, Dv value and Dk key columns, cap rows of the output
  // buffers, Kb key columns in the sums (Dk where keys blend, else 0), the blending rule's
  // code (-1: a window rule's sums, added; a value: one build serves every rule). A
  // thread per (row, survivor, column): a value (and a key where keys blend) becomes
  // (A own + sum share source) / (A + sum share) where a loser gives to the survivor and
  // that denominator is not 0 (else it stays), rounded once to its buffer's dtype (OUT_V,
  // OUT_K); a key that does not blend is copied as stored. Survivor jj of row r goes to
  // row jj of r's buffer of cap rows (rows m.. are left for the decode steps to write).
  // Column 0 also writes the survivor's score plus the mass it took in, and a row's first
  // survivor's column 0 the row's merges (the count after the sums); the first warp the
  // merges so far, prior plus every row's (camkv_merges_so_far). A: the rule's
  // target share of the survivor's score (camkv_merges.h), or 1 for a window rule's sums
  // (whose shares stay 0: own + sum).
  const long rows = dims[0], m = dims[1];
  const int Dv = dims[2], Dk = dims[3], Kb = dims[5], C = Dv + Dk, S = Dv + Kb, merge = dims[6];
  const long cap = dims[4];
  const long at = (long)blockIdx.x * blockDim.x + threadIdx.x;
  if (at < 32) camkv_merges_so_far(sums + rows * m * (S + 3), rows, prior, out_total, (int)at);
  if (at >= rows * m * C) return;
  const long j = at / C;
  const int c = (int)(at % C);
  const long slot = (j / m) * cap + j % m;
  const float* sum = sums + j * (S + 3);
  const float own_share = merge < 0 ? 1.0f : camkv_target_share(merge, scores[j]);
  const float total = __fadd_rn(own_share, sum[S]);
  const bool blending = sum[S + 1] > 0.0f && total > 0.0f;
  auto blended = [&](float own, float into) {
    return blending ? __fadd_rn(__fmul_rn(own_share, own), into) / total : own;
  };
  if (c < Dv) {
    out_values[slot * Dv + c] = static_cast<OUT_V>(blended(own_values[j * Dv + c], sum[c]));
  } else if (Kb > 0) {
    out_keys[slot * Dk + c - Dv] = static_cast<OUT_K>(blended(static_cast<float>(own_keys[j * Dk + c - Dv]), sum[c]));
  } else {
    out_keys[slot * Dk + c - Dv] = static_cast<OUT_K>(own_keys[j * Dk + c - Dv]);
  }
  if (c == 0) out_scores[j] = __fadd_rn(scores[j], sum[S + 2]);
  if (c == 0 && j % m == 0) out_count[j / m] = (int)sums[rows * m * (S + 3) + j / m];
"""

_WINDOW = """
  // dims: R rows, k losers, m survivors, Dv, window. A warp per (row, loser): the first
  // survivor after it (survivors ascending: a binary search), then V_e / |W|, a count and
  // s_e / |W| added into each of the |W| = min(window, survivors after it) survivors
  // from there: float32 sums [R, m, Dv + 3] laid out as the blend's (values, a share
  // that stays 0, the count, the mass), which the blend's finish adds to each survivor,
  // and 1 into its row's count after them (R more) for a loser that merges.
  const long rows = dims[0], k = dims[1], m = dims[2];
  const int Dv = dims[3], window = dims[4];
  const long loser = (long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (loser >= rows * k) return;
  const long r = loser / k, at = (long)loser_idx[loser];
  long low = 0, high = m;
  while (low < high) {
    const long middle = (low + high) / 2;
    if ((long)kept_idx[r * m + middle] < at) low = middle + 1; else high = middle;
  }
  const int width = m - low < window ? (int)(m - low) : window;
  if (width <= 0) return;
  if (lane == 0) atomicAdd(sums + rows * m * (Dv + 3) + r, 1.0f);
  const float shared = (float)width;
  for (int slot = 0; slot < width; ++slot) {
    float* into = sums + (r * m + low + slot) * (Dv + 3);
    for (int c = lane; c < Dv; c += 32) atomicAdd(into + c, values[loser * Dv + c] / shared);
    if (lane == 0) {
      atomicAdd(into + Dv + 1, 1.0f);
      atomicAdd(into + Dv + 2, mass[loser] / shared);
    }
  }
"""

_THRESHOLD = """
  // dims: R rows, k losers. A work group per row (section 4.5): the sum and count of its
  // losers' finite nearest cosines (each thread's, then the group's), its threshold moved
  // by camkv_moved_threshold (camkv_merges.h, the kernel core's), then each loser merges
  // where it may (eligible: a target, the gate passed) and its cosine reaches the moved
  // threshold (never where that is NaN: a row that has seen no finite cosine).
  const long k = dims[1];
  const long r = blockIdx.x;
  __shared__ float sums[32];
  __shared__ int counts[32];
  __shared__ float moved;
  float sum = 0.0f;
  int count = 0;
  for (long e = threadIdx.x; e < k; e += blockDim.x) {
    const float c = cosine[r * k + e];
    if (isfinite(c)) { sum = __fadd_rn(sum, c); ++count; }
  }
  for (int o = 16; o > 0; o /= 2) {
    sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, o));
    count += __shfl_xor_sync(0xffffffffu, count, o);
  }
  const int warp = threadIdx.x / 32, warps = blockDim.x / 32;
  if (threadIdx.x % 32 == 0) { sums[warp] = sum; counts[warp] = count; }
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0.0f;
    int all = 0;
    for (int w = 0; w < warps; ++w) { total = __fadd_rn(total, sums[w]); all += counts[w]; }
    moved = camkv_moved_threshold(threshold[r], total, all);
    threshold_out[r] = moved;
  }
  __syncthreads();
  for (long e = threadIdx.x; e < k; e += blockDim.x) {
    merging[r * k + e] = eligible[r * k + e] && cosine[r * k + e] >= moved;
  }
"""

# keepkv (section 4.6). What its later launches read of each merging loser: its target's
# largest incoming finite logit and whether a non-finite one comes in (atomic maxima into
# [R, m, 2] from -inf), then each loser's target as a float (-1: it does not merge), one
# flat array "incoming" [R m 2 + R k] (MLX fills every output a kernel starts from a value,
# a launch each: hence one output). A survivor's own logit, top and mass are taken again
# by each launch that reads them (camkv_keep_survivor) instead of a launch of their own.
_KEEP_HEADER = """
// A merging loser of row r (flat index loser of R k) with target t and logit l into
// incoming: its target slot, and l raises t's largest finite incoming logit, or a
// non-finite l marks t poisoned; a loser that does not merge writes -1 as its target.
__device__ inline void camkv_keep_incoming(float* incoming, long rows, long k, long m, long loser, int t,
                                           bool merges, float l, int lane) {
  if (lane != 0) return;
  incoming[2 * rows * m + loser] = merges ? (float)t : -1.0f;
  if (!merges) return;
  const long to = (loser / k) * m + t;
  if (isfinite(l)) camkv_atomic_max(incoming + 2 * to, l);
  else camkv_atomic_max(incoming + 2 * to + 1, 1.0f);
}

// A survivor's state in its compression (section 4.6): its logit l_t = scale q.K_t; its
// mass is finite where l_t is and no merging loser's logit is not; top: the larger of
// l_t and its largest incoming logit there (0 elsewhere); m_t = votes exp(l_t - top)
// there (votes elsewhere). Every lane of the warp holds it.
struct CamkvKeepSurvivor {
  float top;
  bool finite;
  float mass;
};

__device__ inline CamkvKeepSurvivor camkv_keep_survivor(const float* key, const float* query, const float* scale,
                                                        int Dk, float votes, const float* incoming_t, int lane) {
  const float l = camkv_keep_logit(key, query, scale, Dk, lane);
  CamkvKeepSurvivor out;
  out.finite = isfinite(l) && !(incoming_t[1] > 0.0f);
  out.top = out.finite ? fmaxf(l, incoming_t[0]) : 0.0f;
  out.mass = __fmul_rn(votes, out.finite ? expf(l - out.top) : 1.0f);
  return out;
}
"""

_KEEP_LOGITS = """
  // dims: R rows, k losers, m survivors, Dk. A warp per (row, loser): its logit
  // l_e = scale q.K_e into incoming (camkv_keep_incoming) where it merges.
  const long rows = dims[0], k = dims[1], m = dims[2];
  const int Dk = dims[3];
  const long loser = (long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (loser >= rows * k) return;
  const long r = loser / k;
  const bool merges = merging[loser];
  const float l = merges ? camkv_keep_logit(keys + loser * Dk, query + r * Dk, scale, Dk, lane) : 0.0f;
  camkv_keep_incoming(incoming, rows, k, m, loser, target[loser], merges, l, lane);
"""

_KEEP_SEARCH = """
  // dims: R rows, k losers, m survivors, n_sink, Dk. keep_logits where every loser with a
  // target merges (no gate): a warp per (row, loser) finds its target from the products
  // (camkv_nearest_of, as _NEAREST) and takes its logit into incoming.
  const long rows = dims[0], k = dims[1], m = dims[2];
  const int n_sink = dims[3], Dk = dims[4];
  const long loser = (long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (loser >= rows * k) return;
  const long r = loser / k;
  const CamkvNearest best = camkv_nearest_of(products + loser * m, norm_k, positions, r, m, n_sink, norm_l[loser],
                                             lane);
  const float l = best.has ? camkv_keep_logit(keys + loser * Dk, query + r * Dk, scale, Dk, lane) : 0.0f;
  camkv_keep_incoming(incoming, rows, k, m, loser, best.t, best.has, l, lane);
"""

_KEEP_SPREAD = """
  // dims: R rows, k losers, m survivors, Dv, Dk. A warp per (row, loser) that merges (its
  // target in incoming): m_e = votes_e exp(l_e - top_t) (votes_e where the target's mass
  // is not finite), then m_e V_e, m_e K_e, m_e, 1, votes_e and s_e added into its
  // target's float32 sums [R, m, Dv + Dk + 4], and 1 into its row's count after them (R
  // more).
  const long rows = dims[0], k = dims[1], m = dims[2];
  const int Dv = dims[3], Dk = dims[4], C = Dv + Dk;
  const long loser = (long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (loser >= rows * k) return;
  const float target = incoming[2 * rows * m + loser];
  if (target < 0.0f) return;  // the whole warp: loser is the same for its lanes
  const long r = loser / k, to = r * m + (long)target;
  const float l = camkv_keep_logit(keys + loser * Dk, query + r * Dk, scale, Dk, lane);
  const CamkvKeepSurvivor t = camkv_keep_survivor(kept_keys + to * Dk, query + r * Dk, scale, Dk, kept_votes[to],
                                                  incoming + 2 * to, lane);
  const float mass_e = __fmul_rn(votes[loser], t.finite ? expf(l - t.top) : 1.0f);
  float* into = sums + to * (C + 4);
  camkv_add_rows(into, mass_e, values + loser * Dv, Dv, keys + loser * Dk, Dk, lane);
  if (lane == 0) {
    atomicAdd(into + C, mass_e);
    atomicAdd(into + C + 1, 1.0f);
    atomicAdd(into + C + 2, votes[loser]);
    atomicAdd(into + C + 3, mass[loser]);
    atomicAdd(sums + rows * m * (C + 4) + r, 1.0f);
  }
"""

_KEEP_FINISH = """
  // dims: R rows, m survivors, Dv, Dk, cap rows of the output buffers. A warp per (row,
  // survivor), its state camkv_keep_survivor's. Where a loser gives to it: its value and
  // mean key (m_t row + sum m_e source) / (m_t + sum m_e) (unchanged where that is 0),
  // the key then moved along q so that the row, standing for all its votes, gets the
  // group's mass (merges.output_preserving_key), its votes summed; elsewhere its row and
  // votes as they were. Value and key rounded once to their buffers' dtypes (OUT_V,
  // OUT_K), survivor jj of row r into row jj of r's buffer of cap rows (rows m.. left
  // unwritten). Its score gains the mass s_e of its losers. A row's first survivor's warp
  // writes the row's merges (the count after the sums), the first warp the merges so far
  // (prior plus every row's).
  const long rows = dims[0], m = dims[1];
  const int Dv = dims[2], Dk = dims[3], C = Dv + Dk;
  const long cap = dims[4];
  const long j = (long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  const float* counts = sums + rows * m * (C + 4);
  if (j == 0) camkv_merges_so_far(counts, rows, prior, out_total, lane);
  if (j >= rows * m) return;
  const long r = j / m, slot = r * cap + j % m;
  const CamkvKeepSurvivor t = camkv_keep_survivor(keys + j * Dk, query + r * Dk, scale, Dk, votes[j],
                                                  incoming + 2 * j, lane);
  const float* sum = sums + j * (C + 4);
  const float taken = sum[C], in_votes = sum[C + 2];
  const bool receiving = sum[C + 1] > 0.0f;
  const float total = __fadd_rn(t.mass, taken);
  const bool blending = receiving && total > 0.0f;
  auto blended = [&](float own, float into) {
    return blending ? __fadd_rn(__fmul_rn(t.mass, own), into) / total : own;
  };
  for (int c = lane; c < Dv; c += 32) out_values[slot * Dv + c] = static_cast<OUT_V>(blended(values[j * Dv + c], sum[c]));
  const float total_votes = __fadd_rn(votes[j], in_votes);
  float along = 0.0f, norm_q = 0.0f;  // mean key . q and q . q
  for (int c = lane; c < Dk; c += 32) {
    const float q = query[r * Dk + c];
    along = __fadd_rn(along, __fmul_rn(blended(keys[j * Dk + c], sum[Dv + c]), q));
    norm_q = __fadd_rn(norm_q, __fmul_rn(q, q));
  }
  for (int o = 16; o > 0; o /= 2) {
    along = __fadd_rn(along, __shfl_xor_sync(0xffffffffu, along, o));
    norm_q = __fadd_rn(norm_q, __shfl_xor_sync(0xffffffffu, norm_q, o));
  }
  const float want = __fadd_rn(t.top, logf(total)) - logf(total_votes);
  const float shift = (want - __fmul_rn(scale[0], along)) / __fmul_rn(scale[0], norm_q);
  const bool moved = receiving && t.finite && isfinite(shift);
  for (int c = lane; c < Dk; c += 32) {
    const float mean = blended(keys[j * Dk + c], sum[Dv + c]);
    out_keys[slot * Dk + c] = static_cast<OUT_K>(!receiving ? keys[j * Dk + c]
                                               : moved ? __fadd_rn(mean, __fmul_rn(shift, query[r * Dk + c])) : mean);
  }
  if (lane == 0) {
    out_votes[j] = receiving ? total_votes : votes[j];
    out_scores[j] = __fadd_rn(scores[j], sum[C + 3]);
    if (j % m == 0) out_count[r] = (int)counts[r];
  }
"""

_KEEP_INPUTS = """
  // dims: R rows, n settled, S new, G queries a row, T of them each, Dk. keepkv's inputs
  // of a compression, a thread per item: for each (row, column) of the n + S joined, the
  // votes (a settled row's, where SETTLED; 1 for a new row, and for every row where none
  // are settled yet) and their log, the bias its chunk mass adds to each logit; for each
  // (row, channel), the query: the mean of the row's G last queries (their sum in order,
  // times 1 / G, as MLX's mean), as float32.
  const long rows = dims[0], n = dims[1], N = n + dims[2];
  const int G = dims[3], T = dims[4], Dk = dims[5];
  const long at = (long)blockIdx.x * blockDim.x + threadIdx.x;
  if (at < rows * N) {
    const long j = at % N;
    const float v = SETTLED && j < n ? settled[at / N * n + j] : 1.0f;
    votes[at] = v;
    log_votes[at] = logf(v);
  }
  if (at < rows * Dk) {
    const long r = at / Dk, c = at % Dk;
    float sum = 0.0f;
    for (int g = 0; g < G; ++g) sum = __fadd_rn(sum, static_cast<float>(queries[((r * G + g) * T + T - 1) * Dk + c]));
    query[at] = __fmul_rn(sum, 1.0f / (float)G);
  }
"""

_kernels: dict[tuple, object] = {}  # kernel_text.key(name) -> the launch


def available() -> bool:
    """Whether the merge engine's compressions here run these kernels: on an NVIDIA GPU
    (MLX's CUDA build; drop.on_cuda alone is what tests patch to emulate its arithmetic)."""
    return drop.on_cuda() and drop.cuda_build()


def _warp_per(items: int) -> tuple[int, int, int]:
    """The grid of a launch with a warp per item (_WARPS items a work group)."""
    return (-(-items // _WARPS) * _THREADS, 1, 1)


def _named(name: str, source: str) -> str:
    """A kernel's name with its text's checksum: MLX keeps compiled kernels by name, so a
    changed text (another version, a test's defect) never reuses another text's build."""
    return f"{name}_{zlib.crc32(source.encode()):08x}"


def _specs() -> dict[str, tuple]:
    """Each kernel's (name, text, inputs, outputs, header), read from the module when a
    kernel is built, so a test's patched text is the one compiled."""
    rules = _rules_header()  # read once for the kernels that take it
    specs = {
        "nearest": ("camkv_nearest_survivor", _NEAREST, ["products", "norm_k", "positions", "norm_l", "dims"],
                    ["target", "found", "cosine"], _HEADER),
        "nearest_spread": ("camkv_nearest_spread", _NEAREST_SPREAD,
                           ["products", "norm_k", "positions", "norm_l", "values", "keys", "mass", "scores", "norm_in",
                            "norm_t", "dims"], ["sums"], _HEADER + rules + _SPREAD_HEADER),
        "nearest_direct": ("camkv_nearest_direct", _NEAREST_DIRECT,
                           ["losers", "kept", "norm_k", "positions", "norm_l", "dims"], ["target", "found", "cosine"],
                           ""),
        "window": ("camkv_window_spread", _WINDOW, ["values", "mass", "loser_idx", "kept_idx", "dims"], ["sums"],
                   ""),
        "gather": ("camkv_merge_gather", _GATHER,
                   ["keys", "values", "scores", "positions", "votes", "loser_idx", "kept_idx", "dims"],
                   [f"{side}_{field}" for side in "ls" for field in _GATHERED], ""),
        "spread": ("camkv_blend_spread", _SPREAD,
                   ["values", "keys", "cosine", "mass", "scores", "norm_in", "norm_t", "target", "merging", "dims"],
                   ["sums"], _HEADER + rules + _SPREAD_HEADER),
        "finish": ("camkv_blend_finish", _FINISH, ["sums", "own_values", "own_keys", "scores", "prior", "dims"],
                   ["out_values", "out_keys", "out_scores", "out_count", "out_total"], _HEADER + rules),
        "keep_inputs": ("camkv_keep_inputs", _KEEP_INPUTS, ["settled", "queries", "dims"],
                        ["votes", "log_votes", "query"], ""),
        "scatter": ("camkv_scatter_rows", _SCATTER, ["rows_in", "targets", "live", "dims"], ["sums"], ""),
        "threshold": ("camkv_moved_threshold", _THRESHOLD, ["cosine", "eligible", "threshold", "dims"],
                      ["merging", "threshold_out"], rules),
    }
    for name, (text, inputs, outputs) in _KEEP.items():
        specs[name] = (f"camkv_{name}", globals()[text], [*inputs, "dims"], outputs, _HEADER + _KEEP_HEADER)
    return specs


def _rules_header() -> str:
    """The merge rules' shares as the kernel core defines them (csrc/camkv_merges.h), for
    the blend's kernels: one definition of each rule's shares for both."""
    return ("#ifndef CAMKV_INLINE\n#define CAMKV_INLINE __device__ __forceinline__\n#endif\n"
            + sources.inlined_source("camkv_merges.h"))


def _kernel(name: str):
    def make():
        kernel_name, source, inputs, outputs, header = _specs()[name]
        return kernel_text.cuda_kernel(name=_named(kernel_name, header + source), input_names=inputs,
                                       output_names=outputs, source=source, header=header)
    return kernel_text.built(_kernels, name, make)


def nearest_direct(losers: mx.array, kept: mx.array, norm_l: mx.array, norm_k: mx.array, positions: mx.array,
                   n_sink: int):
    """nearest's t, found and cosine from the keys themselves, losers [R, k, D] and
    survivors [R, m, D] (float32): the dot products tile by tile in one launch, never the
    [R, k, m] products in memory, and no matrix product (MLX's CUDA build records its
    cuBLAS products in CUDA graphs: bench/results/README.md, "Where a merging prompt's
    extra time goes"). Products summed in float32 in channel order: within section 8's
    near-tie of the matrix product's."""
    rows, k, dim = losers.shape
    m = kept.shape[1]
    tiles = -(-k // _DIRECT_LOSERS)
    return tuple(_kernel("nearest_direct")(
        inputs=[losers, kept, norm_k, positions, norm_l, ints(rows, k, m, n_sink, dim)],
        template=[("TL", _DIRECT_LOSERS)], grid=(rows * tiles * _THREADS, 1, 1), threadgroup=(_THREADS, 1, 1),
        output_shapes=[(rows, k), (rows, k), (rows, k)], output_dtypes=[mx.int32, mx.bool_, mx.float32]))


def nearest(products: mx.array, norm_l: mx.array, norm_k: mx.array, positions: mx.array, n_sink: int):
    """Section 4.1 from the dot products of losers and survivors [R, k, m] (float32), the
    losers' key norms norm_l [R, k], the survivors' norm_k [R, m] and positions [R, m]:
    each loser's survivor t [R, k] int32 of largest dot / max(|K_t|, 1e-12) among the
    candidates (non-sink, finite norm; the first of equal ones), whether it has one [R, k]
    (a candidate, and a finite norm of its own; t = 0 where not) and the cosine dot /
    max(|K_e| |K_t|, 1e-12) [R, k] (with survivor 0 where none), as merge_ops._nearest's
    operations compute them."""
    rows, k, m = products.shape
    dims = ints(rows, k, m, n_sink)
    target, found, cosine = _kernel("nearest")(
        inputs=[products, norm_k, positions, norm_l, dims],
        grid=_warp_per(rows * k), threadgroup=(_THREADS, 1, 1),
        output_shapes=[(rows, k), (rows, k), (rows, k)], output_dtypes=[mx.int32, mx.bool_, mx.float32])
    return target, found, cosine


def scatter_rows(rows_in: mx.array, targets: mx.array, live: mx.array, m: int) -> mx.array:
    """sums [R, m, C] float32: for every survivor j, the sum of rows_in[r, e] over the
    losers e and slots s with targets[r, e, s] = j where live[r, e, s]. rows_in [R, k, C]
    float32, targets [R, k, w] (indices into the m survivors), live [R, k, w] bool."""
    rows, k, columns = rows_in.shape
    w = targets.shape[2]
    edges = rows * k * w
    dims = ints(rows, k, w, m, columns)
    return _kernel("scatter")(
        inputs=[rows_in, targets.astype(mx.int32), live, dims],
        grid=_warp_per(edges), threadgroup=(_THREADS, 1, 1),
        output_shapes=[(rows, m, columns)], output_dtypes=[mx.float32], init_value=0.0)[0]


def moved_threshold(cosine: mx.array, eligible: mx.array, threshold: mx.array) -> tuple[mx.array, mx.array]:
    """d2o's gate of a compression (section 4.5) in one launch: which losers merge [R, k]
    (eligible [R, k]: a target, the gate passed; and a cosine [R, k] that reaches the
    moved threshold) and each row's threshold [R] (NaN before its first compression)
    moved by the mean of its losers' finite nearest cosines: merges.moved_threshold's
    result, its sum in the device's order."""
    rows, k = cosine.shape
    return tuple(_kernel("threshold")(
        inputs=[cosine, eligible, threshold, ints(rows, k)], grid=(rows * _THRESHOLD_THREADS, 1, 1),
        threadgroup=(_THRESHOLD_THREADS, 1, 1), output_shapes=[(rows, k), (rows,)],
        output_dtypes=[mx.bool_, mx.float32]))


_THRESHOLD_THREADS = 256


def keep_inputs(settled: mx.array | None, n: int, new: int, queries: mx.array) -> tuple[mx.array, ...]:
    """keepkv's inputs of a compression in one launch (as operations: a fill or two, a
    concatenation's two copies, a log, a cast, a sum and a product): the votes of the n
    settled rows [R, n] (None before a row's first compression: 1 each) joined with 1 for
    each of `new` rows, and their log, [R, n + new] float32 each; and its query, the mean
    of the last of queries [R, G, T, Dk] over G, [R, Dk] float32."""
    rows, groups, length, dk = queries.shape
    total = rows * max(n + new, dk)
    return tuple(_kernel("keep_inputs")(
        inputs=[floats(1.0) if settled is None else settled, queries, ints(rows, n, new, groups, length, dk)],
        template=[("SETTLED", settled is not None)], grid=(-(-total // _THREADS) * _THREADS, 1, 1),
        threadgroup=(_THREADS, 1, 1), output_shapes=[(rows, n + new), (rows, n + new), (rows, dk)],
        output_dtypes=[mx.float32] * 3))


# What gather_rows writes of each row taken, for the losers and again for the survivors.
_GATHERED = ("keys", "values", "stored", "scores", "positions", "norm", "value_norm", "votes")


def gather_rows(keys, values, scores, positions, votes, loser_idx, kept_idx):
    """Rows k losers and m survivors of every row r, from keys [R, N, Dk] and values
    [R, N, Dv] (their storage dtype), scores [R, N] float32, positions [R, N] int32 and
    votes [R, N] float32 (or None) at loser_idx [R, k] and kept_idx [R, m]: for the losers
    and then for the survivors, keys and values [R, j, D] float32, the keys as stored,
    scores, positions, the keys' and the values' L2 norms [R, j] (sums of squares in the
    device's order) and votes (or None), j = k or m; each a contiguous array of its own."""
    rows, n, dk = keys.shape
    dv, k, m = values.shape[2], loser_idx.shape[1], kept_idx.shape[1]

    def shapes(j):
        return [(rows, j, dk), (rows, j, dv), (rows, j, dk), (rows, j), (rows, j), (rows, j), (rows, j),
                (rows, j if votes is not None else 1)]

    dtypes = [mx.float32, mx.float32, keys.dtype, scores.dtype, positions.dtype, mx.float32, mx.float32, mx.float32]
    out = _kernel("gather")(
        inputs=[keys, values, scores, positions, scores if votes is None else votes, loser_idx, kept_idx,
                ints(rows, n, k, m, dk, dv)],
        template=[("VOTES", votes is not None)],
        grid=_warp_per(rows * (k + m)), threadgroup=(_THREADS, 1, 1),
        output_shapes=shapes(k) + shapes(m), output_dtypes=dtypes * 2)
    per_side = len(_GATHERED)
    return tuple((*side[:7], None if votes is None else side[7]) for side in (out[:per_side], out[per_side:]))


# keepkv's launches: name -> (the module's name of its text, read when it is built so a
# test's patched text is the one compiled; inputs before dims; outputs).
_KEEP = {
    "keep_logits": ("_KEEP_LOGITS", ["keys", "query", "target", "merging", "scale"], ["incoming"]),
    "keep_search": ("_KEEP_SEARCH", ["products", "norm_k", "positions", "norm_l", "keys", "query", "scale"],
                    ["incoming"]),
    "keep_spread": ("_KEEP_SPREAD", ["values", "keys", "votes", "mass", "kept_keys", "kept_votes", "query", "scale",
                                     "incoming"], ["sums"]),
    "keep_finish": ("_KEEP_FINISH", ["values", "keys", "votes", "scores", "query", "sums", "incoming", "scale",
                                     "prior"],
                    ["out_values", "out_keys", "out_votes", "out_scores", "out_count", "out_total"]),
}


def _incoming(name: str, inputs: list, rows: int, k: int, m: int) -> mx.array:
    """keepkv's incoming (flat: [R, m, 2] then [R, k], see _KEEP_HEADER) by launch name,
    a warp per (row, loser), its maxima starting at -inf."""
    return _kernel(name)(inputs=inputs, grid=_warp_per(rows * k), threadgroup=(_THREADS, 1, 1),
                         output_shapes=[(2 * rows * m + rows * k,)], output_dtypes=[mx.float32],
                         init_value=-float("inf"))[0]


def keep_logits(loser_keys, query, target, merging, scale: float, m: int) -> mx.array:
    """keepkv's incoming (flat, see _KEEP_HEADER) of losers with float32 keys [R, k, Dk],
    each loser's survivor target [R, k] int32 and whether it merges [R, k] bool, for
    query [R, Dk] float32 and m survivors: what keep_merge takes."""
    rows, k, dk = loser_keys.shape
    return _incoming("keep_logits", [loser_keys, query, target, merging, floats(scale), ints(rows, k, m, dk)],
                     rows, k, m)


def keep_search(products, norm_l, norm_k, positions, n_sink: int, loser_keys, query, scale: float) -> mx.array:
    """keep_logits where every loser with a target merges (no gate): the targets found from
    the products [R, k, m] (with norm_l, norm_k, positions and n_sink as nearest takes
    them) in the same launch."""
    rows, k, m = products.shape
    dk = loser_keys.shape[2]
    return _incoming("keep_search", [products, norm_k, positions, norm_l, loser_keys, query, floats(scale),
                                     ints(rows, k, m, n_sink, dk)], rows, k, m)


def keep_merge(losers, kept, incoming, query, scale: float, merges_so_far: mx.array, value_dtype=mx.float32,
               capacity: int | None = None):
    """keepkv's merges of a compression (section 4.6, merge_ops._keep_output's results):
    losers and kept are merge_ops.Rows (float32 keys and values, the keys as stored,
    votes, scores), incoming keep_logits' or keep_search's (the targets and their largest
    logits), query [R, Dk] float32. Returns the survivors' keys [R, cap, Dk] in the stored
    keys' dtype and values [R, cap, Dv] in value_dtype (each rounded once; cap =
    capacity, or m; rows past m unwritten, as blend_nearest's), votes and scores plus the
    mass taken in [R, m], and the merges: each row's [R] and merges_so_far (int32, one)
    plus all of them, counted by the same launches as blend_nearest's."""
    rows, k, dk = losers.keys.shape
    m, dv = kept.keys.shape[1], kept.values.shape[2]
    block = (_THREADS, 1, 1)
    scale_ = floats(scale)
    sums = _kernel("keep_spread")(
        inputs=[losers.values, losers.keys, losers.votes, losers.scores, kept.keys, kept.votes, query, scale_,
                incoming, ints(rows, k, m, dv, dk)], grid=_warp_per(rows * k), threadgroup=block,
        output_shapes=[_sums_and_counts(rows, m, dv + dk, 4)], output_dtypes=[mx.float32], init_value=0.0)[0]
    cap, key_dtype = m if capacity is None else capacity, kept.stored_keys.dtype
    values, keys, votes, scores, count, total = _kernel("keep_finish")(
        inputs=[kept.values, kept.keys, kept.votes, kept.scores, query, sums, incoming, scale_, merges_so_far,
                ints(rows, m, dv, dk, cap)], template=[("OUT_V", value_dtype), ("OUT_K", key_dtype)],
        grid=_warp_per(rows * m), threadgroup=block,
        output_shapes=[(rows, cap, dv), (rows, cap, dk), (rows, m), (rows, m), (rows,), ()],
        output_dtypes=[value_dtype, key_dtype, mx.float32, mx.float32, mx.int32, mx.int32])
    return keys, values, votes, scores, count, total


def spread_window(values, mass, loser_idx, kept_idx, own_values, own_keys, scores, window: int,
                  merges_so_far: mx.array, value_dtype=mx.float32, capacity: int | None = None):
    """The paper's window rule for every loser at once (section 4.2, no gate): losers'
    values [R, k, Dv] float32 and mass s_e [R, k] at rows loser_idx [R, k], survivors at
    kept_idx [R, m] (ascending) with own_values [R, m, Dv] float32, own_keys [R, m, Dk] as
    stored and scores [R, m]. Each survivor gains V_e / |W(e)| and s_e / |W(e)| from every
    loser e whose window W(e) (the first `window` survivors after it) holds it. Returns the
    survivors' values rounded once to value_dtype and keys as stored, in buffers of
    capacity rows as blend_nearest's, their scores [R, m] and the merges (the losers with
    a survivor after them) of each row [R] and so far, as blend_nearest's."""
    rows, k, dv = values.shape
    m = kept_idx.shape[1]
    sums = _kernel("window")(
        inputs=[values, mass, loser_idx, kept_idx, ints(rows, k, m, dv, window)],
        grid=_warp_per(rows * k), threadgroup=(_THREADS, 1, 1),
        output_shapes=[_sums_and_counts(rows, m, dv)], output_dtypes=[mx.float32], init_value=0.0)[0]
    # Survivor t becomes (1 V_t + sum) / (1 + 0): V_t plus its window's sum, exactly.
    return _finish(sums, own_values, own_keys, scores, 0, merges_so_far, value_dtype, capacity, None)


def blend_nearest(values, keys, own_values, own_keys, scores, target, merging, cosine, mass, value_norms,
                  merge: int, merges_so_far: mx.array, value_dtype=mx.float32, capacity: int | None = None):
    """Section 4.4's blend for every survivor at once, where each merging loser has one
    target: losers' values [R, k, Dv] (and keys [R, k, Dk], or None: keys stay) float32,
    the survivors' own_values [R, m, Dv] float32, own_keys [R, m, Dk] as stored (their
    dtype is the keys' out) and scores [R, m], each loser's target [R, k] int32 (indices
    into the survivors), whether it merges [R, k] bool, its cosine with its target and
    mass s_e [R, k], and the values' norms (losers' [R, k], survivors' [R, m]; None where
    rule `merge` reads none). Shares are rule merge's (its code: camkv_merges.h's, the
    kernel core's): a_e of each loser, A of each survivor's score. Returns the survivors'
    values [R, cap, Dv] rounded once to value_dtype and keys [R, cap, Dk] (blended keys
    rounded once, the others copied), whose first m rows are the survivors (cap =
    capacity, or m; the rest unwritten: buffers with room to decode, as
    compact_cuda.drop_compact writes them), their scores plus the mass taken in [R, m],
    and the merges (merging losers) of each row [R] int32 and so far: merges_so_far
    (int32, one) plus all of them (counts no launch of their own makes):
    (A V_t + sum a_e V_e) / (A + sum a_e) where a loser gives to t and that denominator
    is not 0, V_t elsewhere, as merge_ops._Edges.blend computes it, its sums in the
    device's order."""
    rows, k, Dv = values.shape
    m = own_values.shape[1]
    blended_keys = 0 if keys is None else keys.shape[2]
    norm_in, norm_t = (mass, scores) if value_norms is None else value_norms  # read only where the rule reads them
    sums = _kernel("spread")(
        inputs=[values, values if keys is None else keys, cosine, mass, scores, norm_in, norm_t, target, merging,
                ints(rows, k, m, Dv, blended_keys, merge)],
        grid=_warp_per(rows * k), threadgroup=(_THREADS, 1, 1),
        output_shapes=[_sums_and_counts(rows, m, Dv + blended_keys)], output_dtypes=[mx.float32], init_value=0.0)[0]
    return _finish(sums, own_values, own_keys, scores, blended_keys, merges_so_far, value_dtype, capacity, merge)


def search_and_blend(products, norm_l, norm_k, positions, n_sink: int, values, keys, own_values, own_keys, scores,
                     mass, value_norms, merge: int, merges_so_far: mx.array, value_dtype=mx.float32,
                     capacity: int | None = None):
    """nearest's search and blend_nearest's blend in two launches where every loser with a
    target merges (no gate, no moving threshold): the first finds each loser's target from
    the products [R, k, m] (with norm_l, norm_k, positions and n_sink as nearest takes
    them) and adds it into the sums at once; the second is blend_nearest's finish. The
    rest of the arguments and the results are blend_nearest's."""
    rows, k, m = products.shape
    Dv = values.shape[2]
    blended_keys = 0 if keys is None else keys.shape[2]
    norm_in, norm_t = (mass, scores) if value_norms is None else value_norms  # read only where the rule reads them
    sums = _kernel("nearest_spread")(
        inputs=[products, norm_k, positions, norm_l, values, values if keys is None else keys, mass, scores, norm_in,
                norm_t, ints(rows, k, m, n_sink, Dv, blended_keys, merge)],
        grid=_warp_per(rows * k), threadgroup=(_THREADS, 1, 1),
        output_shapes=[_sums_and_counts(rows, m, Dv + blended_keys)], output_dtypes=[mx.float32], init_value=0.0)[0]
    return _finish(sums, own_values, own_keys, scores, blended_keys, merges_so_far, value_dtype, capacity, merge)


def _sums_and_counts(rows: int, m: int, columns: int, scalars: int = 3) -> tuple[int]:
    """The shape of a blend's sums (flat): each survivor's columns then its scalars (a
    nearest rule's share, count and mass; keepkv's a fourth, the votes taken in),
    [R, m, columns + scalars], then each row's count of merging losers [R]; the finish
    reads the counts after R m (columns + scalars)."""
    return (rows * m * (columns + scalars) + rows,)


def _finish(sums, own_values, own_keys, scores, blended_keys: int, merges_so_far: mx.array, value_dtype,
            capacity: int | None, merge: int | None) -> tuple:
    """The blend's second launch (_FINISH) over sums [R, m, Dv + blended_keys + 3] and
    each row's count after them [R] (flat): the survivors' values and keys in buffers of
    capacity rows (or m), their scores, the merges of each row [R] int32 and
    merges_so_far plus all of them (int32, one: a cache's running count, so reading it
    costs no launch). merge: the blending rule whose target share each survivor keeps;
    None: a window rule's sums, added to each survivor."""
    rows, m, Dv = own_values.shape
    Dk = own_keys.shape[2]
    cap = m if capacity is None else capacity
    threads = rows * m * (Dv + Dk)
    return tuple(_kernel("finish")(
        inputs=[sums, own_values, own_keys, scores, merges_so_far,
                ints(rows, m, Dv, Dk, cap, blended_keys, -1 if merge is None else merge)],
        template=[("OUT_V", value_dtype), ("OUT_K", own_keys.dtype)],
        grid=(-(-threads // _THREADS) * _THREADS, 1, 1), threadgroup=(_THREADS, 1, 1),
        output_shapes=[(rows, cap, Dv), (rows, cap, Dk), (rows, m), (rows,), ()],
        output_dtypes=[value_dtype, own_keys.dtype, mx.float32, mx.int32, mx.int32]))
