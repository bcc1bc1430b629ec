"""A chunk's attention mass on an NVIDIA GPU, from logits MLX's matrix product made.

camkv.fast scores a compression chunk as softmax rows over logits [R, M, N] (M = G x S
queries over N rows), summed down each column. As plain MLX operations that is five or
six passes over the logits (mask, softmax, NaN guard, sum); here it is two reads: one
warp a query row finds its log-sum-exp over the rows it sees, then each thread sums one
column's weights over a slice of the chunk's tokens, every query of each (consecutive
threads read consecutive columns of a query row, so the reads coalesce, and a thread
starts at the first token that sees its column). The slices are summed by MLX.

Masking is the same as the MLX path's: query m (chunk token i = m mod S) sees rows
j <= n_before + i, a non-finite logit counts as masked, and a query with nothing
visible adds nothing.
"""

from __future__ import annotations

import mlx.core as mx

_LSE = """
  long warp = (long)(blockIdx.x * blockDim.x + threadIdx.x) / 32;
  int lane = threadIdx.x % 32;
  long R = logits_shape[0], M = logits_shape[1], N = logits_shape[2];
  if (warp >= R * M) return;
  long m = warp % M;
  long visible = min((long)N, (long)dims[0] + m % dims[1] + 1);
  const T* row = logits + warp * N;
  float scale = scale_in[0];
  float top = -INFINITY, total = 0.0f;
  for (long j = lane; j < visible; j += 32) {
    float x = static_cast<float>(row[j]) * scale;
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
  if (lane == 0) lse[warp] = total > 0.0f ? top + logf(total) : -INFINITY;
"""

_COLUMNS = """
  long t = (long)blockIdx.x * blockDim.x + threadIdx.x;
  long R = logits_shape[0], M = logits_shape[1], N = logits_shape[2];
  long n_before = dims[0], S = dims[1], parts = dims[2];
  if (t >= R * parts * N) return;
  long j = t % N, p = (t / N) % parts, r = t / (N * parts);
  long G = M / S, per = (S + parts - 1) / parts;
  // Chunk token i sees row j once n_before + i >= j: start there, skip the masked triangle.
  long i0 = max(p * per, j - n_before), i1 = min(S, p * per + per);
  float scale = scale_in[0];
  float sum = 0.0f;
  for (long g = 0; g < G; ++g) {
    const T* column = logits + (r * M + g * S) * N + j;
    const float* row_lse = lse + r * M + g * S;
    for (long i = i0; i < i1; ++i) {
      float l = row_lse[i];
      float x = static_cast<float>(column[i * N]) * scale;
      if (l != -INFINITY && isfinite(x)) sum += expf(x - l);
    }
  }
  partial[t] = sum;
"""

_kernels: dict[str, object] = {}
_THREADS = 256
_COLUMN_THREADS = 1 << 18  # enough threads in flight to stream the logits at full bandwidth


def _kernel(name: str, source: str, inputs: list[str], outputs: list[str]):
    if name not in _kernels:
        _kernels[name] = mx.fast.cuda_kernel(name=name, input_names=inputs, output_names=outputs, source=source)
    return _kernels[name]


def column_mass(logits: mx.array, scale: float, n_before: int, s_len: int) -> mx.array:
    """sum over query rows m of softmax_m(scale * logits[r, m, :])[j], masked as above: [R, N] float32.

    logits [R, M, N] (float32, float16 or bfloat16), M = G x S with m = g * S + i."""
    rows, queries, total = logits.shape
    parts = max(1, min(s_len, _COLUMN_THREADS // max(1, rows * total)))
    dims = mx.array([n_before, s_len, parts], mx.int32)
    scale_in = mx.array([scale], mx.float32)
    lse = _kernel("camkv_mass_lse", _LSE, ["logits", "dims", "scale_in"], ["lse"])(
        inputs=[logits, dims, scale_in], template=[("T", logits.dtype)],
        grid=(rows * queries * 32, 1, 1), threadgroup=(_THREADS, 1, 1),
        output_shapes=[(rows, queries)], output_dtypes=[mx.float32])[0]
    partial = _kernel("camkv_mass_columns", _COLUMNS, ["logits", "lse", "dims", "scale_in"], ["partial"])(
        inputs=[logits, lse, dims, scale_in], template=[("T", logits.dtype)],
        grid=(rows * parts * total, 1, 1), threadgroup=(_THREADS, 1, 1),
        output_shapes=[(rows, parts, total)], output_dtypes=[mx.float32])[0]
    return partial.sum(axis=1)
