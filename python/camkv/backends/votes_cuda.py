"""A prompt block's attention over rows weighed by their votes (keepkv, docs/algorithm.md
section 4.6) on MLX's CUDA build: the two launches around MLX's attention.

camkv.hook.weighed_block has MLX's attention read the values scaled by each row's weight
and one more column of the weights, and divides the first output by the second. As MLX
operations that is a maximum, a subtraction, an exponential, a cast, a product and a
concatenation before the attention and two casts, a division and a cast after it, each a
launch a layer and prompt chunk, and the division's float32 copies of the output. Here
`weigh` writes the weighed values and the weights' column in one launch and `divide`
the output in one, with the operations' arithmetic: w = exp(bias - max bias) in float32
rounded to the values' dtype, each value times w rounded once, and the quotient of the
two outputs in float32 rounded once to the output dtype.
"""

from __future__ import annotations

import math

import mlx.core as mx

from . import kernel_text
from .constants import ints

# Columns the weights fill after the values: MLX's CUDA attention (cuDNN) reads value
# rows of a multiple of 8 channels, up to JOINED_WIDTH, so the weights' column joins the
# values' rows where they fit, else goes to rows of its own (a second attention).
COLUMN = 8
JOINED_WIDTH = 128
_THREADS = 256
# Rows a work group of weigh writes: a work group per (batch, KV head) alone left most of
# an H100 idle (eight groups for a 1B model's heads: 0.75 ms a launch).
_ROWS = 32

_WEIGH = """
  // dims: N rows a (batch, KV head), D value channels, W the width of rows_out (D +
  // COLUMN where the weights join the values, else D; then column_out takes them), ROWS
  // rows a work group. Work group (head, tile): the largest of the head's N log votes
  // (each group reads them all: a few kB, where a launch of its own would cost more),
  // then for each of its ROWS rows the weight w = exp(bias - largest) rounded to T, its
  // values times w (each rounded to T) and w in COLUMN columns (the launch's template).
  const long N = dims[0];
  const int D = dims[1], W = dims[2], ROWS = dims[3];
  const long tiles = (N + ROWS - 1) / ROWS;
  const long head = blockIdx.x / tiles, first = (blockIdx.x % tiles) * ROWS;
  const float* log_votes = bias + head * N;
  __shared__ float partial[32];
  float top = -INFINITY;
  for (long j = threadIdx.x; j < N; j += blockDim.x) top = fmaxf(top, log_votes[j]);
  for (int o = 16; o > 0; o /= 2) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, o));
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = top;
  __syncthreads();
  top = partial[0];
  for (int w = 1; w < (int)(blockDim.x / 32); ++w) top = fmaxf(top, partial[w]);
  const long last = first + ROWS < N ? first + ROWS : N;
  for (long e = threadIdx.x; e < (last - first) * (D + COLUMN); e += blockDim.x) {
    const long j = first + e / (D + COLUMN), row = head * N + j;
    const int c = (int)(e % (D + COLUMN));
    const T weight = static_cast<T>(expf(log_votes[j] - top));
    if (c < D) {
      rows_out[row * W + c] = static_cast<T>(static_cast<float>(values[row * D + c]) * static_cast<float>(weight));
    } else if (W > D) {
      rows_out[row * W + c] = weight;
    } else {
      column_out[row * COLUMN + c - D] = weight;
    }
  }
"""

_DIVIDE = """
  // dims: R output rows, D channels, Wn and Wt the row widths of weighed and total, t0
  // the total's column. A thread per output element: weighed / total in float32,
  // rounded once to T.
  const long rows = dims[0];
  const int D = dims[1], Wn = dims[2], Wt = dims[3], t0 = dims[4];
  const long at = (long)blockIdx.x * blockDim.x + threadIdx.x;
  if (at >= rows * D) return;
  const long row = at / D;
  const int c = (int)(at % D);
  out[at] = static_cast<T>(static_cast<float>(weighed[row * Wn + c]) / static_cast<float>(total[row * Wt + t0]));
"""

_kernels: dict[tuple, object] = {}  # kernel_text.key(name) -> the launch


def _kernel(name: str):
    def make():
        source, inputs, outputs = {"weigh": (_WEIGH, ["values", "bias", "dims"], ["rows_out", "column_out"]),
                                   "divide": (_DIVIDE, ["weighed", "total", "dims"], ["out"])}[name]
        return kernel_text.cuda_kernel(name=f"camkv_votes_{name}", input_names=inputs, output_names=outputs,
                                       source=source)
    return kernel_text.built(_kernels, name, make)


def joined(value_width: int) -> bool:
    """Whether the weights' column joins value rows of value_width channels."""
    return value_width + COLUMN <= JOINED_WIDTH


def weigh(values: mx.array, bias: mx.array) -> tuple[mx.array, mx.array | None]:
    """values [B, H, N, D] weighed by their rows' votes, bias [B, H, N] float32 (the log
    votes): each row's weight w = exp(bias - its head's largest) in values' dtype. Returns
    (the weighed values and w in COLUMN more columns [B, H, N, D + COLUMN], None) where
    they join (joined(D)), else (the weighed values [B, H, N, D], w [B, H, N, COLUMN])."""
    B, H, N, D = values.shape
    width = D + COLUMN if joined(D) else D
    rows, column = _kernel("weigh")(
        inputs=[values, bias.astype(mx.float32), ints(N, D, width, _ROWS)],
        template=[("T", values.dtype), ("COLUMN", COLUMN)],
        grid=(B * H * -(-N // _ROWS) * _THREADS, 1, 1), threadgroup=(_THREADS, 1, 1),
        output_shapes=[(B, H, N, width), (B, H, N, COLUMN) if width == D else (1,)],
        output_dtypes=[values.dtype] * 2)
    return rows, (column if width == D else None)


def divide(weighed: mx.array, total: mx.array, channels: int, dtype) -> mx.array:
    """weighed[..., :channels] / total[..., t0] in float32, rounded once to dtype, where
    t0 = channels if total is weighed (the weights' column joined), else 0: the attention
    outputs [B, Hq, S, *] of weigh's rows."""
    *lead, width = weighed.shape
    rows = math.prod(lead)
    t0 = channels if total is weighed else 0
    threads = rows * channels
    return _kernel("divide")(
        inputs=[weighed, total, ints(rows, channels, width, total.shape[-1], t0)], template=[("T", dtype)],
        grid=(-(-threads // _THREADS) * _THREADS, 1, 1), threadgroup=(_THREADS, 1, 1),
        output_shapes=[(*lead, channels)], output_dtypes=[dtype])[0]
