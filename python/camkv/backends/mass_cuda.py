"""A chunk's attention mass on an NVIDIA GPU, from logits MLX's matrix product made.

camkv.backends.drop scores a compression chunk as softmax rows over logits [R, M, N] (M = G x S
queries over N rows), summed down each column. As plain MLX operations that is five or
six passes over the logits (mask, softmax, NaN guard, sum); here it is one kernel, in
which a work group takes ROWS_PER_GROUP query rows of one row r: its warps find each
query row's log-sum-exp over the rows it sees (a warp a query row), then each thread sums
one column's weights over the group's query rows (consecutive threads read consecutive
columns, so the reads coalesce, and the group's logits, just read, come from cache). The
groups' column sums are summed by MLX, in a fixed order: the result does not change from
run to run.

Masking is the same as the MLX path's: query m (chunk token i = m mod S) sees rows
j <= n_before + i, a non-finite logit counts as masked, and a query with nothing
visible adds nothing. A bias per row and column (keepkv's log votes, docs/algorithm.md
section 4.6) joins every scaled logit of its column, as the reference adds it.
"""

from __future__ import annotations

import mlx.core as mx

from .. import mass
from . import constants, kernel_text

ROWS_PER_GROUP = 16

_SOURCE = """
  // dims: n_before, S, work groups per row, columns of the output (>= N).
  const long M = logits_shape[1], N = logits_shape[2];
  const long n_before = dims[0], S = dims[1], groups_per_row = dims[2], width = dims[3];
  const long r = blockIdx.x / groups_per_row, part = blockIdx.x % groups_per_row;
  const long m0 = part * ROWS, m1 = min(M, m0 + ROWS);
  const float scale = params[0], weight = params[1];
  const bool biased = params[2] != 0.0f;
  const float* column_bias = bias + r * N;  // read only where biased (else a placeholder)
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  __shared__ float lse[ROWS];
  __shared__ long last_seen[ROWS];  // the last column query row m sees (no division per logit)
  for (long m = m0 + warp; m < m1; m += warps) {
    long visible = min(N, n_before + m % S + 1);
    if (lane == 0) last_seen[m - m0] = visible - 1;
    const T* row = logits + (r * M + m) * N;
    float top = -INFINITY, total = 0.0f;
    for (long j = lane; j < visible; j += 32) {
      float x = static_cast<float>(row[j]) * scale + (biased ? column_bias[j] : 0.0f);
      if (!isfinite(x)) continue;
      if (x > top) { total = total * expf(top - x) + 1.0f; top = x; }
      else { total += expf(x - top); }
    }
    for (int o = 16; o > 0; o /= 2) {
      float other_top = __shfl_xor_sync(0xffffffff, top, o);
      float other_total = __shfl_xor_sync(0xffffffff, total, o);
      float best = fmaxf(top, other_top);
      total = (best == -INFINITY) ? 0.0f : total * expf(top - best) + other_total * expf(other_top - best);
      top = best;
    }
    if (lane == 0) lse[m - m0] = total > 0.0f ? top + logf(total) : -INFINITY;
  }
  __syncthreads();
  float* out = partial + (r * groups_per_row + part) * width;
  const T* rows = logits + (r * M + m0) * N;
  for (long j = threadIdx.x; j < width; j += blockDim.x) {
    float sum = 0.0f;
    for (int k = 0; k < m1 - m0 && j < N; ++k) {
      float l = lse[k];
      if (l == -INFINITY || j > last_seen[k]) continue;
      float x = static_cast<float>(rows[k * N + j]) * scale + (biased ? column_bias[j] : 0.0f);
      if (isfinite(x)) sum += expf(x - l);
    }
    out[j] = sum * weight;
  }
"""

_kernels: dict[tuple, object] = {}  # kernel_text.key("mass") -> the launch
_THREADS = 256


def _kernel():
    return kernel_text.built(_kernels, "mass", lambda: kernel_text.cuda_kernel(
        name="camkv_column_mass", input_names=["logits", "bias", "dims", "params"], output_names=["partial"],
        source=_SOURCE.replace("ROWS", str(ROWS_PER_GROUP))))


def column_mass(logits: mx.array, scale: float, n_before: int, s_len: int, width: int, weight: float = 1.0,
                bias: mx.array | None = None) -> mx.array:
    """weight x the sum over query rows m of softmax_m(scale * logits[r, m, :] + bias[r])[j],
    masked as above: [R, width] float32, zero past logits' N columns (width >= N).

    logits [R, M, N] (float32, float16 or bfloat16), M = G x S with m = g * S + i; bias
    [R, N] float32 or None (no bias)."""
    rows, queries, columns = logits.shape
    groups_per_row = -(-queries // ROWS_PER_GROUP)
    dims = constants.ints(n_before, s_len, groups_per_row, width)
    params = constants.floats(float(scale), float(weight), 0.0 if bias is None else 1.0)
    if bias is None:
        bias = constants.floats(0.0)  # a placeholder the kernel does not read
    elif bias.shape != (rows, columns) or bias.dtype != mx.float32:
        raise ValueError(f"bias must be float32 [R, N] = {[rows, columns]}, got {bias.dtype} {list(bias.shape)}")
    partial = _kernel()(
        inputs=[logits, bias, dims, params], template=[("T", logits.dtype)],
        grid=(rows * groups_per_row * _THREADS, 1, 1), threadgroup=(_THREADS, 1, 1),
        output_shapes=[(rows, groups_per_row, width)], output_dtypes=[mx.float32])[0]
    return partial.sum(axis=1)


def _block(queries, keys, scale, n_before, width, bias=None):
    logits = mass.grouped_logits(queries, keys, keys.dtype)
    return column_mass(logits, scale, n_before, queries.shape[2], width, 1.0 / queries.shape[1], bias)


def _logit_bytes(dtype) -> int:
    return 4 * dtype.size  # the logits in the keys' dtype, in blocks of a quarter of mass.MASS_BYTES


def _as_is(keys):
    return keys


# camkv.mass's reduction of a block of chunk queries by this kernel.
REDUCER = mass.Reducer("cuda-kernel", _block, _as_is, _logit_bytes, takes_bias=True)
