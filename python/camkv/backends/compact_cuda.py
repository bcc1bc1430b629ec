"""A drop compression's eviction on an NVIDIA GPU in one launch.

Given a compression chunk's mass (camkv.backends.drop.attention_mass), dropping down to the budget
is a choice of survivors and a copy of their rows. As MLX operations that is some twenty
launches (scores and positions joined, protected rows masked, a partition, a sort, four
gathers, the survivors copied into a buffer with room to decode); a decode step's
compression pays each launch's fixed cost. Here one work group per (sequence, KV head)
row does all of it:

1. ranks rows by an order-preserving 32-bit key of their score (protected rows above
   every score, a NaN score below every other) and finds the budget-th largest key
   with a 4-pass radix select over 8-bit digits;
2. keeps every row above that key and, of the rows equal to it, the first ones in row
   order until the budget is full (section 8 lets a tie at the boundary go either way);
3. writes the survivors' scores and positions, and copies their rows of every buffer
   (keys and values; quantized rows' codes, scales and biases, six buffers) in row (=
   position) order into new buffers of `capacity` rows whose rows past the budget are
   left unwritten (the next decode steps write them).

A merging compression (camkv.backends.merge_ops) takes steps 1 and 2 alone as
`partition`: the survivors' and the losers' row indices, and every held row's score and
position, which the merge engine's kernels gather from.
"""

from __future__ import annotations

import mlx.core as mx

from . import constants, kernel_text

_HEADER = """
// Larger key = ranks higher. Protected rows outrank every score; a NaN ranks lowest.
__device__ inline unsigned camkv_rank_key(float score, bool is_protected) {
  if (is_protected) return 0xFFFFFFFFu;
  if (isnan(score)) return 0u;
  unsigned bits = __float_as_uint(score);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// How many threads of the work group before this one have flag set; *total: how many in all.
// Every thread of the group must call it (it holds two barriers).
__device__ inline int camkv_count_before(bool flag, int* warp_counts, int* total) {
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  unsigned ballot = __ballot_sync(0xffffffffu, flag);
  if (lane == 0) warp_counts[warp] = __popc(ballot);
  __syncthreads();
  int before = __popc(ballot & ((1u << lane) - 1u)), all = 0;
  for (int w = 0; w < warps; ++w) {
    before += (w < warp) ? warp_counts[w] : 0;
    all += warp_counts[w];
  }
  __syncthreads();
  *total = all;
  return before;
}

template <typename T>
__device__ inline void camkv_copy_rows(const T* source, T* dest, const int* kept, int budget, long width) {
  // Rows of 16-byte words when they are whole words (the usual head dims), else elements.
  if ((width * sizeof(T)) % 16 == 0) {
    long words = width * sizeof(T) / 16;
    const uint4* from = reinterpret_cast<const uint4*>(source);
    uint4* to = reinterpret_cast<uint4*>(dest);
    for (long e = threadIdx.x; e < (long)budget * words; e += blockDim.x) {
      long i = e / words;
      to[e] = from[(long)kept[i] * words + e % words];
    }
  } else {
    for (long e = threadIdx.x; e < (long)budget * width; e += blockDim.x) {
      long i = e / width;
      dest[e] = source[(long)kept[i] * width + e % width];
    }
  }
}
"""

_SELECT = """
  // dims: n settled rows, N rows held, budget, sinks, recent, KV heads, rows of the
  // input buffers, rows of the output buffers, then each copied buffer's row width.
  // starts: each sequence's first pending position (its pending rows n.. are at
  // starts[b], starts[b] + 1, ...).
  const int r = blockIdx.x;
  const int n = dims[0], N = dims[1], budget = dims[2], n_sink = dims[3], recent = dims[4];
  const int pending_start = starts[r / dims[5]], p_last = pending_start + (N - n) - 1;
  const long cap_in = dims[6], cap_out = dims[7];
  auto score_at = [&](int j) -> float {
    float m = mass[(long)r * N + j];
    return j < n ? settled_scores[(long)r * n + j] + m : m;
  };
  auto position_at = [&](int j) -> int {
    return j < n ? settled_positions[(long)r * n + j] : pending_start + (j - n);
  };
  auto key_at = [&](int j) -> unsigned {
    int p = position_at(j);
    return camkv_rank_key(score_at(j), p < n_sink || p > p_last - recent);
  };

  // 1. The budget-th largest key, a digit at a time from the top.
  __shared__ unsigned histogram[256];
  __shared__ unsigned found_prefix, found_mask;
  __shared__ int still_needed;
  if (threadIdx.x == 0) { found_prefix = 0u; found_mask = 0u; still_needed = budget; }
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < 256; b += blockDim.x) histogram[b] = 0u;
    __syncthreads();
    const unsigned prefix = found_prefix, mask = found_mask;
    for (int j = threadIdx.x; j < N; j += blockDim.x) {
      unsigned u = key_at(j);
      if ((u & mask) == prefix) atomicAdd(&histogram[(u >> shift) & 0xFFu], 1u);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int needed = still_needed, digit = 255;
      unsigned above = 0u;
      for (; digit > 0; --digit) {
        if (above + histogram[digit] >= (unsigned)needed) break;
        above += histogram[digit];
      }
      still_needed = needed - (int)above;
      found_prefix = prefix | ((unsigned)digit << shift);
      found_mask = mask | (0xFFu << shift);
    }
    __syncthreads();
  }
  const unsigned threshold = found_prefix;
  const int equal_kept = still_needed;  // rows equal to the threshold that are kept

  // 2. Survivors in row order: a running count over tiles of the work group's size.
  __shared__ int warp_counts[32];
  int equal_so_far = 0, kept_so_far = 0;
  int* kept_rows = kept + (long)r * budget;
  for (int base = 0; base < N; base += blockDim.x) {
    int j = base + threadIdx.x;
    unsigned u = j < N ? key_at(j) : 0u;
    bool equal = j < N && u == threshold;
    int equal_total, kept_total;
    int equal_before = equal_so_far + camkv_count_before(equal, warp_counts, &equal_total);
    bool keep = j < N && (u > threshold || (equal && equal_before < equal_kept));
    int slot = kept_so_far + camkv_count_before(keep, warp_counts, &kept_total);
    if (keep) {
      kept_rows[slot] = j;
@KEPT@
    }
@EVICTED@
    equal_so_far += equal_total;
    kept_so_far += kept_total;
  }
  __syncthreads();
"""

# The drop compression: the survivors' scores and positions, then their rows of each
# buffer (_copies).
_SOURCE = _SELECT.replace("@KEPT@", """      scores_out[(long)r * budget + slot] = score_at(j);
      positions_out[(long)r * budget + slot] = position_at(j);""").replace("@EVICTED@\n", "")


def _copies(count: int) -> str:
    """Step 3 for `count` buffers rows0.. into out0.. (row widths dims[8]..)."""
    return "".join(f"""
  camkv_copy_rows(rows{i} + r * cap_in * dims[{8 + i}], out{i} + r * cap_out * dims[{8 + i}], kept_rows, budget,
                  (long)dims[{8 + i}]);""" for i in range(count)) + "\n"


# A merging compression's partition: the losers too (j minus the survivors before it), and
# every held row's score and position, which the merge engine gathers from.
_SOURCE_SELECT = _SELECT.replace("@KEPT@\n", "").replace(
    "@EVICTED@", """    if (j < N && !keep) losers[(long)r * (N - budget) + (j - slot)] = j;""") + """
  for (int j = threadIdx.x; j < N; j += blockDim.x) {
    scores_out[(long)r * N + j] = score_at(j);
    positions_out[(long)r * N + j] = position_at(j);
  }
"""

_THREADS = 512
_kernels: dict[tuple, object] = {}  # kernel_text.key(name) -> the launch


def _compact_kernel(count: int):
    """The drop compression copying `count` buffers (2: keys and values; 6: quantized rows)."""
    return kernel_text.built(_kernels, f"compact{count}", lambda: kernel_text.cuda_kernel(
        name=f"camkv_drop_compact{count}",
        input_names=[*(f"rows{i}" for i in range(count)), "settled_scores", "settled_positions", "mass", "dims",
                     "starts"],
        output_names=[*(f"out{i}" for i in range(count)), "scores_out", "positions_out", "kept"],
        source=_SOURCE + _copies(count), header=_HEADER))


def _partition_kernel():
    return kernel_text.built(_kernels, "partition", lambda: kernel_text.cuda_kernel(
        name="camkv_merge_partition", input_names=["settled_scores", "settled_positions", "mass", "dims", "starts"],
        output_names=["scores_out", "positions_out", "kept", "losers"], source=_SOURCE_SELECT, header=_HEADER))


def partition(settled_scores, settled_positions, mass, first_pending: mx.array, cfg):
    """A merging compression's choice of survivors by score (eviction="score"), as
    drop_compact chooses them: rows n.. of every row r pending at positions
    first_pending[0].. (int32 [1]), settled_scores / settled_positions [R, n], mass [R, N]
    every held row's new mass. Returns the losers' row indices [R, N - budget] and the
    survivors' [R, budget] (int32, both ascending), and every held row's score [R, N]
    float32 and position [R, N] int32: what camkv.backends.drop.losers_and_survivors and
    the joined scores and positions give, in one launch."""
    rows, n = settled_scores.shape
    N, budget = mass.shape[1], cfg.budget
    dims = constants.ints(n, N, budget, cfg.n_sink, cfg.recent, rows, 0, 0, 0, 0)
    scores, positions, kept, losers = _partition_kernel()(
        inputs=[settled_scores, settled_positions, mass, dims, first_pending],
        grid=(rows * _THREADS, 1, 1), threadgroup=(_THREADS, 1, 1),
        output_shapes=[(rows, N), (rows, N), (rows, budget), (rows, N - budget)],
        output_dtypes=[mx.float32, mx.int32, mx.int32, mx.int32])
    return losers, kept, scores, positions


def drop_compact(buffers: tuple, settled_scores, settled_positions, mass, pending_starts, cfg, capacity: int):
    """Evict rows [0, N) of the buffers [B, H, cap, w] (keys and values, or a quantized
    cache's codes, scales and biases of each) down to cfg.budget. settled_scores /
    settled_positions [R, n] are the scored rows' (R = B x H), mass [R, N] float32 every
    held row's new mass; sequence b's rows n.. are pending at positions
    pending_starts[b].. (an int32 array [B]; the sequences of one call may stand at
    different positions). Returns a buffer [B, H, capacity, w] for each given, whose first
    budget rows are the survivors (the rest unwritten), then their scores [R, budget]
    float32 and positions [R, budget] int32."""
    B, H, cap_in = buffers[0].shape[:3]
    rows, n = settled_scores.shape
    N, budget = mass.shape[1], cfg.budget
    widths = [a.shape[3] for a in buffers]
    dims = constants.ints(n, N, budget, cfg.n_sink, cfg.recent, H, cap_in, capacity, *widths)
    outputs = _compact_kernel(len(buffers))(
        inputs=[*buffers, settled_scores, settled_positions, mass, dims, pending_starts],
        grid=(rows * _THREADS, 1, 1), threadgroup=(_THREADS, 1, 1),
        output_shapes=[*((B, H, capacity, w) for w in widths), (rows, budget), (rows, budget), (rows, budget)],
        output_dtypes=[*(a.dtype for a in buffers), mx.float32, mx.int32, mx.int32])
    return outputs[:-1]
