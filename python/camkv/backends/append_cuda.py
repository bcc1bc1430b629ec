"""A decode step's key and value written into quantized rows on an NVIDIA GPU in one launch.

A quantized cache's decode step as MLX operations quantizes the step's key and value (two
launches) and writes six arrays in place (codes, scales and biases of each: six more).
On MLX's CUDA build each launch costs the host about as much as a small attention, and a
decode step at a small model's size is bound by that host work (bench/decode_parts.py:
8-bit rows at 0.62x RotatingKVCache's speed on llama-3-8B's shape, an H100). Here one
launch writes all six: a thread an element of the six buffers copies it, except the
elements of the new rows, which it quantizes as MLX's CUDA `mx.quantize` does (its
affine_quantize: a group's range from a minimum and a maximum that starts at 0, the edge
of larger magnitude made exact, codes rounded half away from zero), so the stored codes
are the ones the operations would store (docs/algorithm.md section 12).

Copying the buffers costs GPU time (their bytes, read and written) where the operations write
one row; `takes` sends only buffers up to COPY_LIMIT_BYTES here, where that copy is a few
microseconds of an H100's bandwidth, well under the launches it saves.
"""

from __future__ import annotations

import mlx.core as mx

from . import constants, drop, kernel_text

BITS = (4, 8)
COPY_LIMIT_BYTES = 32 << 20  # the six buffers of one layer, in bytes, that a step may copy
_THREADS = 256

# The scale and bias of one group of GS channels of a row (MLX's CUDA affine_quantize: a
# range from a minimum and a maximum that starts at 0, the edge of larger magnitude made
# exact), and the code of one value in it; row points at the row, step is its channel
# stride. Shared by the write below and by camkv.backends.step_cuda's fresh row.
QUANTIZE = """
  constexpr float N_BINS = (1 << BITS) - 1;
  auto group_of = [&](const T* row, long step, long g, float& scale, float& bias) {
    float lo = 3.40282347e38f, hi = 0.0f;  // MLX's maximum starts at 0, its minimum at FLT_MAX
    for (int i = 0; i < GS; ++i) {
      const float v = static_cast<float>(row[(g * GS + i) * step]);
      lo = fminf(lo, v);
      hi = fmaxf(hi, v);
    }
    float s0 = fmaxf((hi - lo) / N_BINS, 1e-7f);
    const bool side = fabsf(lo) > fabsf(hi);
    s0 = side ? s0 : -s0;
    const float edge = side ? lo : hi;
    const float q0 = roundf(edge / s0);
    const bool at_zero = q0 == 0.0f;
    scale = at_zero ? s0 : edge / q0;
    bias = at_zero ? 0.0f : edge;
  };
  auto code_of = [&](float v, float scale, float bias) -> uint32_t {
    return static_cast<uint32_t>(fmaxf(fminf(roundf((v - bias) / scale), N_BINS), 0.0f));
  };
"""

# Element e of the six outputs o* (codes, scales, biases of keys and values, [B, H, C, w],
# C = rows_out): the inputs k*/v* ([B, H, C_in, w], C_in <= C), with rows [at, at + S)
# replaced by keys / values [B, H, S, D] quantized; output rows past both are left
# unwritten (rows to grow into, written by later steps). Needs e, at, rows_out and
# QUANTIZE before it.
WRITE = """
  constexpr int PER_WORD = 32 / BITS;
  const long B = kc_shape[0], H = kc_shape[1], C = rows_out, C_in = kc_shape[2];
  const int S = keys_shape[2];
  const long widths[6] = {kc_shape[3], ks_shape[3], kb_shape[3], vc_shape[3], vs_shape[3], vb_shape[3]};
  int a = 0;
  for (; a < 6 && e >= B * H * C * widths[a]; ++a) e -= B * H * C * widths[a];
  if (a == 6) return;
  const long w = e % widths[a], j = (e / widths[a]) % C, h = (e / widths[a] / C) % H, b = e / widths[a] / C / H;
  const bool fresh = j >= at && j < at + S;
  if (!fresh && j >= C_in) return;
  const long s = j - at;

  auto word_of = [&](const T* x, const Strides& st) -> uint32_t {
    const T* row = x + b * st[0] + h * st[1] + s * st[2];
    float scale, bias;
    group_of(row, st[3], w * PER_WORD / GS, scale, bias);
    uint32_t word = 0u;
    for (int i = 0; i < PER_WORD; ++i) {
      word |= code_of(static_cast<float>(row[(w * PER_WORD + i) * st[3]]), scale, bias) << (i * BITS);
    }
    return word;
  };
  auto scale_or_bias = [&](const T* x, const Strides& st, bool want_bias) -> T {
    float scale, bias;
    group_of(x + b * st[0] + h * st[1] + s * st[2], st[3], w, scale, bias);
    return static_cast<T>(want_bias ? bias : scale);
  };

  // Outputs are new and contiguous; inputs are read through their strides.
  const long out_at = ((b * H + h) * C + j) * widths[a] + w;
  auto held = [&](const auto* x, const Strides& st) { return x[b * st[0] + h * st[1] + j * st[2] + w * st[3]]; };
  switch (a) {
    case 0: okc[out_at] = fresh ? word_of(keys, keys_strides) : held(kc, kc_strides); break;
    case 1: oks[out_at] = fresh ? scale_or_bias(keys, keys_strides, false) : held(ks, ks_strides); break;
    case 2: okb[out_at] = fresh ? scale_or_bias(keys, keys_strides, true) : held(kb, kb_strides); break;
    case 3: ovc[out_at] = fresh ? word_of(values, values_strides) : held(vc, vc_strides); break;
    case 4: ovs[out_at] = fresh ? scale_or_bias(values, values_strides, false) : held(vs, vs_strides); break;
    default: ovb[out_at] = fresh ? scale_or_bias(values, values_strides, true) : held(vb, vb_strides); break;
  }
"""

_SOURCE = QUANTIZE + """
  long e = static_cast<long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int at = first[0];
  const long rows_out = first[1];
""" + WRITE

_kernels: dict[tuple, object] = {}  # kernel_text.key("append") -> the launch


def _append_kernel():
    return kernel_text.built(_kernels, "append", lambda: kernel_text.cuda_kernel(
        name="camkv_quantized_append",
        input_names=["kc", "ks", "kb", "vc", "vs", "vb", "keys", "values", "first"],
        output_names=["okc", "oks", "okb", "ovc", "ovs", "ovb"],
        source=_SOURCE, ensure_row_contiguous=False))


def buffer_bytes(buffers: tuple) -> int:
    return sum(a.nbytes for a in buffers)


def takes(key_buffers: tuple, value_buffers: tuple, dtype, bits: int, rows: int | None = None) -> bool:
    """Whether one launch writes a step of rows of dtype here: MLX's CUDA build on the
    default device, bits in BITS, the rows' dtype the scales', buffers of at most
    COPY_LIMIT_BYTES in all (grown to `rows` rows where given)."""
    grown = 1.0 if rows is None else rows / key_buffers[0].shape[2]
    return (drop.on_cuda() and bits in BITS and dtype == key_buffers[1].dtype == value_buffers[1].dtype
            and (buffer_bytes(key_buffers) + buffer_bytes(value_buffers)) * max(grown, 1.0) <= COPY_LIMIT_BYTES)


def write(key_buffers: tuple, value_buffers: tuple, keys: mx.array, values: mx.array, at: int, bits: int,
          group_size: int, rows: int | None = None) -> tuple[tuple, tuple]:
    """The buffers (codes, scales, biases) [B, H, C, w] of keys and of values with rows
    [at, at + S) holding keys and values [B, H, S, D] quantized as mx.quantize(x,
    group_size, bits) on MLX's CUDA build; new arrays (the caller rebinds its buffers) of
    `rows` rows (C, the buffers' own by default; more: the buffers grown, the rows past
    at + S unwritten). The caller checks takes() and at + S <= rows."""
    buffers = (*key_buffers, *value_buffers)
    rows = buffers[0].shape[2] if rows is None else rows
    shapes = [(*a.shape[:2], rows, a.shape[3]) for a in buffers]
    count = sum(b * h * c * w for b, h, c, w in shapes)
    out = _append_kernel()(
        inputs=[*buffers, keys, values, constants.ints(at, rows)],
        template=[("T", keys.dtype), ("BITS", bits), ("GS", group_size)],
        grid=(-(-count // _THREADS) * _THREADS, 1, 1), threadgroup=(_THREADS, 1, 1),
        output_shapes=shapes, output_dtypes=[a.dtype for a in buffers])
    return tuple(out[:3]), tuple(out[3:])
