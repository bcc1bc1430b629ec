"""A compression's merges on an NVIDIA GPU, in two kernels where MLX operations take many
launches and passes over large arrays (camkv.backends.merge_ops calls them there).

- **The nearest survivor of every loser** (docs/algorithm.md section 4.1). As MLX
  operations it is a product losers x survivors [R, k, m] in float32, then a division, a
  mask and an argmax: four passes over an array of R x k x m floats (134 MB for eight
  rows of 2048 losers and 2048 survivors). Here one tiled product keeps each dot product
  in registers and ends in the argmax: a work group takes TILE losers of one row, walks
  the survivors TILE at a time through shared memory, and keeps, per loser, the largest
  dot / |K_t| over the candidates (ties to the smaller survivor index, as MLX's argmax)
  and the dot product of that survivor, from which the cosine follows.
- **The losers' rows into their targets** (section 4.4's sums over a target's losers):
  a warp per (loser, target slot) adds the loser's row (its weighted value, key and
  scalars side by side) into the target's float32 sums with atomic additions, every
  loser at once, where MLX's scatter-add first spreads every row over the slots; and
  keepkv's largest logit a target takes in, with atomic maxima, where MLX operations
  would mask a dense [R, k, m] array. The sums run in the device's order (section 8's
  tolerances), as MLX's scatter-add's do.

The products are float32 fused multiply-adds of the float32 keys (exact products of
half-precision keys, as the MLX path's TF32 product is; float32 keys keep float32
accuracy without its split).
"""

from __future__ import annotations

import mlx.core as mx

from . import drop

TILE = 64  # losers, and survivors, per tile of the nearest search
_DEPTH = 32  # features per shared-memory step
_THREADS = 256  # 16 x 16 threads, each TILE / 16 = 4 losers by 4 survivors

_NEAREST = """
  // dims: k losers, m survivors, D features, loser tiles per row.
  const int k = dims[0], m = dims[1], D = dims[2], tiles = dims[3];
  const int r = blockIdx.x / tiles, l0 = (blockIdx.x % tiles) * TILE;
  const int tid = threadIdx.x, ty = tid / 16, tx = tid % 16;
  __shared__ float lose[DEPTH][TILE + 1];
  __shared__ float keep[DEPTH][TILE + 1];
  const float* L = loser_keys + (long)r * k * D;
  const float* K = kept_keys + (long)r * m * D;
  // dot_first: with survivor 0, the target of a loser that has none (as MLX's path reads it).
  float best[4], dot_best[4], dot_first[4];
  int best_at[4];
  for (int i = 0; i < 4; ++i) { best[i] = -INFINITY; dot_best[i] = dot_first[i] = 0.0f; best_at[i] = 0; }
  for (int s0 = 0; s0 < m; s0 += TILE) {
    float acc[4][4];
    for (int i = 0; i < 4; ++i) for (int c = 0; c < 4; ++c) acc[i][c] = 0.0f;
    for (int d0 = 0; d0 < D; d0 += DEPTH) {
      // Each thread loads TILE * DEPTH / 256 elements of each tile, along the features (coalesced).
      for (int e = tid; e < TILE * DEPTH; e += blockDim.x) {
        int row = e / DEPTH, d = e % DEPTH;
        int l = l0 + row, s = s0 + row;
        lose[d][row] = (l < k && d0 + d < D) ? L[(long)l * D + d0 + d] : 0.0f;
        keep[d][row] = (s < m && d0 + d < D) ? K[(long)s * D + d0 + d] : 0.0f;
      }
      __syncthreads();
      for (int d = 0; d < DEPTH; ++d) {
        float a[4], b[4];
        for (int i = 0; i < 4; ++i) a[i] = lose[d][ty * 4 + i];
        for (int c = 0; c < 4; ++c) b[c] = keep[d][tx + 16 * c];
        for (int i = 0; i < 4; ++i) for (int c = 0; c < 4; ++c) acc[i][c] = fmaf(a[i], b[c], acc[i][c]);
      }
      __syncthreads();
    }
    // This thread's survivors rise with c, so a strict comparison keeps the first maximum.
    for (int c = 0; c < 4; ++c) {
      int s = s0 + tx + 16 * c;
      if (s == 0) for (int i = 0; i < 4; ++i) dot_first[i] = acc[i][c];
      if (s >= m || !candidate[(long)r * m + s]) continue;
      float norm = fmaxf(norm_k[(long)r * m + s], 1e-12f);
      for (int i = 0; i < 4; ++i) {
        float ranked = acc[i][c] / norm;
        if (ranked > best[i]) { best[i] = ranked; best_at[i] = s; dot_best[i] = acc[i][c]; }
      }
    }
  }
  // The 16 threads of a loser row (one half warp) agree on its best: larger, else earlier.
  for (int i = 0; i < 4; ++i) {
    for (int o = 8; o > 0; o /= 2) {
      float other = __shfl_xor_sync(0xffffffffu, best[i], o);
      int other_at = __shfl_xor_sync(0xffffffffu, best_at[i], o);
      float other_dot = __shfl_xor_sync(0xffffffffu, dot_best[i], o);
      bool take = other > best[i] || (other == best[i] && other_at < best_at[i] && other != -INFINITY);
      if (take) { best[i] = other; best_at[i] = other_at; dot_best[i] = other_dot; }
    }
    int l = l0 + ty * 4 + i;
    if (tx == 0 && l < k) {
      bool any = best[i] > -INFINITY;
      target[(long)r * k + l] = any ? best_at[i] : 0;
      score[(long)r * k + l] = best[i];
      dot[(long)r * k + l] = any ? dot_best[i] : dot_first[i];  // thread tx 0 holds survivor 0
    }
  }
"""

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

_MAX_HEADER = """
// An atomic maximum of floats (no NaN among them): a float of sign bit 0 orders as its
// int bits, one of sign bit 1 (-0.0 too, which >= 0 would let through) reversed as its
// unsigned bits.
__device__ inline void camkv_atomic_max(float* at, float value) {
  if ((__float_as_uint(value) >> 31) == 0u) atomicMax(reinterpret_cast<int*>(at), __float_as_int(value));
  else atomicMin(reinterpret_cast<unsigned*>(at), __float_as_uint(value));
}
"""

_SCATTER_MAX = """
  // dims: R rows, k losers, w target slots a loser, m survivors. A thread per (loser, slot).
  const long rows = dims[0], k = dims[1], w = dims[2], m = dims[3];
  const long edge = (long)blockIdx.x * blockDim.x + threadIdx.x;
  if (edge >= rows * k * w || !live[edge]) return;
  const long r = edge / (k * w), e = (edge / w) % k;
  camkv_atomic_max(maxima + r * m + targets[edge], x[r * k + e]);
"""

_kernels: dict[str, object] = {}


def available() -> bool:
    """Whether the merge engine's compressions here run these kernels: on an NVIDIA GPU
    (MLX's CUDA build; drop.on_cuda alone is what tests patch to emulate its arithmetic)."""
    return drop.on_cuda() and drop.cuda_build()


def _kernel(name: str):
    if name not in _kernels:
        if name == "nearest":
            source = _NEAREST.replace("DEPTH", str(_DEPTH)).replace("TILE", str(TILE))
            _kernels[name] = mx.fast.cuda_kernel(
                name="camkv_nearest_survivor",
                input_names=["loser_keys", "kept_keys", "norm_k", "candidate", "dims"],
                output_names=["target", "score", "dot"], source=source)
        elif name == "max":
            _kernels[name] = mx.fast.cuda_kernel(
                name="camkv_scatter_max", input_names=["x", "targets", "live", "dims"], output_names=["maxima"],
                source=_SCATTER_MAX, header=_MAX_HEADER)
        else:
            _kernels[name] = mx.fast.cuda_kernel(
                name="camkv_scatter_rows", input_names=["rows_in", "targets", "live", "dims"],
                output_names=["sums"], source=_SCATTER)
    return _kernels[name]


def nearest(loser_keys: mx.array, kept_keys: mx.array, norm_k: mx.array, candidate: mx.array):
    """For losers [R, k, D] and survivors [R, m, D] (float32 keys), norm_k [R, m] the
    survivors' key norms and candidate [R, m] bool which of them a loser may choose:
    each loser's survivor t [R, k] int32 of largest dot / max(|K_t|, 1e-12) among the
    candidates (the first of equal ones; 0 where none has a finite one), that largest
    value [R, k] (-inf where none) and the dot product with t [R, k] (with survivor 0
    where none)."""
    rows, k, depth = loser_keys.shape
    m = kept_keys.shape[1]
    tiles = -(-k // TILE)
    dims = mx.array([k, m, depth, tiles], mx.int32)
    target, score, dot = _kernel("nearest")(
        inputs=[loser_keys, kept_keys, norm_k, candidate, dims],
        grid=(rows * tiles * _THREADS, 1, 1), threadgroup=(_THREADS, 1, 1),
        output_shapes=[(rows, k), (rows, k), (rows, k)], output_dtypes=[mx.int32, mx.float32, mx.float32])
    return target, score, dot


def scatter_rows(rows_in: mx.array, targets: mx.array, live: mx.array, m: int) -> mx.array:
    """sums [R, m, C] float32: for every survivor j, the sum of rows_in[r, e] over the
    losers e and slots s with targets[r, e, s] = j where live[r, e, s]. rows_in [R, k, C]
    float32, targets [R, k, w] (indices into the m survivors), live [R, k, w] bool."""
    rows, k, columns = rows_in.shape
    w = targets.shape[2]
    warps = _THREADS // 32
    edges = rows * k * w
    dims = mx.array([rows, k, w, m, columns], mx.int32)
    return _kernel("scatter")(
        inputs=[rows_in, targets.astype(mx.int32), live, dims],
        grid=(-(-edges // warps) * _THREADS, 1, 1), threadgroup=(_THREADS, 1, 1),
        output_shapes=[(rows, m, columns)], output_dtypes=[mx.float32], init_value=0.0)[0]


def scatter_max(x: mx.array, targets: mx.array, live: mx.array, m: int) -> mx.array:
    """maxima [R, m] float32: for every survivor j, the largest x[r, e] [R, k] (finite or
    -inf, never NaN) over the losers e and slots s with targets[r, e, s] = j where
    live[r, e, s]; -inf where none."""
    rows, k, w = targets.shape
    dims = mx.array([rows, k, w, m], mx.int32)
    return _kernel("max")(
        inputs=[x.astype(mx.float32), targets.astype(mx.int32), live, dims],
        grid=(-(-rows * k * w // _THREADS) * _THREADS, 1, 1), threadgroup=(_THREADS, 1, 1),
        output_shapes=[(rows, m)], output_dtypes=[mx.float32], init_value=-float("inf"))[0]
