"""A quantized cache's decode step on an NVIDIA GPU in one launch: the step's key and value
written into the rows and the attention over them.

As separate calls a quantized step costs its write (camkv.backends.append_cuda), six views
of the held rows and the attention over them (camkv.backends.quantized_cuda), each call
built by the host at every layer and token; at a small model's size the step is bound by
that host work (bench/step_calls.py). Here one launch does both, reading the whole
buffers, with the row count as data:

- work groups [0, heads x stretches) attend rows [0, at] as quantized_cuda's partials do,
  reading rows before `at` from the buffers as stored and row `at` from the step's key
  and value, quantized and dequantized in registers exactly as the write stores it (the
  same scale, bias and codes, the scale and bias rounded to the rows' dtype), so the
  output is the one attention over the written rows would give;
- the work groups after them copy the six buffers into new ones with row `at` replaced
  by the step's codes, scales and biases, as append_cuda's write does.

More rows than quantized_cuda.WHOLE_ROWS a head take quantized_cuda's combine launch
after it (two launches, as there).
"""

from __future__ import annotations

import mlx.core as mx

from . import append_cuda, constants, kernel_text, quantized_cuda

# Row `at` read from the step's key and value (x [B, H, 1, D]): each lane's eight channels
# lie in one group, whose scale and bias it finds as the write does.
_FRESH = """
  auto fresh = [&](const T* x, const Strides& st, float* out) {
    const T* row = x + b * st[0] + h * st[1];
    float s, z;
    group_of(row, st[3], c0 / GS, s, z);
    const float stored_s = static_cast<float>(static_cast<T>(s)), stored_z = static_cast<float>(static_cast<T>(z));
    #pragma unroll
    for (int i = 0; i < 8; ++i) {
      out[i] = stored_s * static_cast<float>(code_of(static_cast<float>(row[(c0 + i) * st[3]]), s, z)) + stored_z;
    }
  };
#undef READ_KEYS
#undef READ_VALUES
#define READ_KEYS(j, out) do { if ((j) == at) fresh(keys, keys_strides, out); \\
  else dequantize(kc, kc_strides, ks, ks_strides, kb, kb_strides, j, out); } while (0)
#define READ_VALUES(j, out) do { if ((j) == at) fresh(values, values_strides, out); \\
  else dequantize(vc, vc_strides, vs, vs_strides, vb, vb_strides, j, out); } while (0)
"""

# dims: [at, stretches a head]. The rows attended are [0, at]: the held ones and the step's.
_EXTENT = """  const int at = dims[0], N = at + 1, splits = dims[1];
"""

_ROLES = """
  const long attend_groups = static_cast<long>(kc_shape[0]) * kc_shape[1] * dims[1];
  if (blockIdx.x >= attend_groups) {  // a copying work group
    const int at = dims[0];
    const long rows_out = kc_shape[2];
    long e = (static_cast<long>(blockIdx.x) - attend_groups) * blockDim.x + threadIdx.x;
@QUANTIZE@
@WRITE@
    return;
  }
  {
@QUANTIZE@
@ATTEND@
  }
"""

# Whether a quantized cache's decode steps take this launch (camkv.cache reads it when its
# steps find the short way, where takes() accepts them). On an H100 at a 1B model's shape
# (512 rows) the launch took 8-bit and 4-bit steps from 0.70x RotatingKVCache's speed to
# 0.85x (bench/results/README.md, "A quantized decode step in one launch").
FUSED_STEPS = True

_kernels: dict[tuple, object] = {}  # kernel_text.key(whole) -> its launch
_INPUTS = ["queries", "kc", "ks", "kb", "vc", "vs", "vb", "keys", "values", "mask", "params", "dims"]
_BUFFERS = ["okc", "oks", "okb", "ovc", "ovs", "ovb"]


def source(whole: bool) -> str:
    reader = quantized_cuda.DEQUANTIZE + _FRESH
    attend = quantized_cuda.partials_source("kc", reader, _EXTENT, whole)
    return (_ROLES.replace("@QUANTIZE@", append_cuda.QUANTIZE).replace("@WRITE@", append_cuda.WRITE)
            .replace("@ATTEND@", attend))


def _kernel(whole: bool):
    outputs = ["output"] if whole else ["partial_top", "partial_total", "partial_out"]
    return kernel_text.built(_kernels, whole, lambda: kernel_text.cuda_kernel(
        name=f"camkv_quantized_step_{'whole' if whole else 'partials'}", input_names=_INPUTS,
        output_names=[*_BUFFERS, *outputs], source=source(whole), ensure_row_contiguous=False))


def takes(queries: mx.array, key_buffers: tuple, value_buffers: tuple, dtype, bits: int, group_size: int,
          rows: int) -> bool:
    """Whether one launch takes decode steps of rows of dtype with these queries into these
    buffers, which decoding grows to at most `rows` rows a head (a cache's capacity): what
    the write (append_cuda.takes) and the attention (quantized_cuda.takes) each take, and
    rows <= quantized_cuda.WHOLE_ROWS, so that every step is one launch. (Beyond, the
    attention's combine is a second launch anyway, and at llama-3-8B's shape with 2048
    rows the fused step measured no faster.)"""
    return (rows <= quantized_cuda.WHOLE_ROWS
            and append_cuda.takes(key_buffers, value_buffers, dtype, bits)
            and quantized_cuda.takes(queries, key_buffers, value_buffers, bits, group_size))


def write_and_attend(queries: mx.array, key_buffers: tuple, value_buffers: tuple, keys: mx.array,
                     values: mx.array, at: int, scale: float, bits: int, group_size: int):
    """(new key buffers, new value buffers, output): the buffers (codes, scales, biases)
    [B, H, C, w] with row `at` holding keys and values [B, H, 1, D] quantized as
    append_cuda.write stores them, and softmax(scale q k^T) v over their rows [0, at]
    dequantized, [B, Hq, 1, D] in the queries' dtype. The caller checks takes() and
    at < C."""
    B, Hq, _, D = queries.shape
    H = key_buffers[0].shape[1]
    G = Hq // H
    whole, warps, per_stretch, splits = quantized_cuda.layout(at + 1, G, D)
    buffers = (*key_buffers, *value_buffers)
    threads = warps * 32
    copy_groups = -(-sum(a.size for a in buffers) // threads)
    attention_shapes = [(B, Hq, 1, D)] if whole else quantized_cuda.partial_shapes(B * H, splits, G, D)
    out = _kernel(whole)(
        inputs=[queries, *buffers, keys, values, quantized_cuda.no_mask(), constants.floats(float(scale)),
                constants.ints(at, splits)],
        template=quantized_cuda.template(queries.dtype, D, G, [("BITS", bits), ("GS", group_size)], warps,
                                         per_stretch, False),
        grid=((B * H * splits + copy_groups) * threads, 1, 1), threadgroup=(threads, 1, 1),
        output_shapes=[*(a.shape for a in buffers), *attention_shapes],
        output_dtypes=[*(a.dtype for a in buffers), *([queries.dtype] if whole else [mx.float32] * 3)])
    attended = out[6] if whole else quantized_cuda.combine(*out[6:], queries)
    return tuple(out[:3]), tuple(out[3:6]), attended
