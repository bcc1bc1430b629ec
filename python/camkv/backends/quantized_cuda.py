"""A decode step's attention over quantized rows on an NVIDIA GPU, read as stored (and
over rows held as the model's dtype, with a mask per KV head: attend_rows).

MLX's CUDA build has no quantized attention for most of a cache's shapes, and
dequantizing the bounded rows before a bfloat16 attention costs ten or so small
launches a layer and step (copies of the row views, two dequantizations, the attention).
Here it is two launches that read the codes, scales and biases where the cache holds
them (views into its buffers, read through their strides: nothing copied):

1. Partials: a work group takes one KV head (b, h) and a stretch of ROWS rows; a row is
   read by D / 8 lanes (eight channels each), so a warp reads 32 / (D / 8) rows at once.
   Each lane dequantizes its channels (`scale * code + bias`, section 12 of
   docs/algorithm.md), the row's logit for every query head of the group is summed
   over the row's lanes, and each (lane, query head) keeps a running softmax: the
   largest logit so far, the sum of exponentials under it and the weighted values.
   The row slots of a warp, then the warps, are merged by their maxima; the group writes
   its stretch's maximum, sum and unnormalized output for each query head.
2. Combine: one thread an output channel merges the stretches of its (b, h, g) by their
   maxima and divides by the sum, rounding once to the queries' dtype.

Up to WHOLE_ROWS rows a head (a small model's bounded rows), one work group a KV head
reads every row and writes the output itself: one launch, whose host work (MLX builds a
custom kernel's call on the host each time) a decode step pays per layer. Rows as the
model's dtype, up to QUERY_HEAD_ROWS a head, are read by one work group a query head (the
text's SLICES splits a KV head's query heads over work groups), all its rows in one
launch.

Sums are float32; a row whose logit is -inf (masked) adds nothing, and a query head that
sees no row gets zeros. The additive mask is read per KV head, [B, 1 or H, 1, N] (zero
strides broadcast), as the CPU extension reads it.
"""

from __future__ import annotations

import mlx.core as mx

from . import constants, drop, kernel_text

WARPS = 4  # warps a work group of stretches
# Warps of a work group that reads all its head's rows: at most 8 (256 threads launch at
# any register count; 16 did not launch on an H100).
MAX_WHOLE_WARPS = 4
WARPS_SHARED_BYTES = 32 << 10  # shared memory for those warps' partial outputs
STEPS = 4  # row slots each warp slot reads in a stretch
HEAD_DIMS = (64, 128, 256)  # D / 8 lanes a row must divide a warp
BITS = (4, 8)
MAX_GROUP = 8  # query heads a KV head, held in registers
# Rows up to which one work group a KV head attends them all and writes the output (one
# launch); more rows are read in stretches by many work groups, then combined (two).
WHOLE_ROWS = 1024

# How a lane reads its eight channels [c0, c0 + 8) of row j as floats: quantized rows
# (codes, scales, biases) or rows as the model's dtype. The partials' text reads the keys
# and values through READ_KEYS(j, out) and READ_VALUES(j, out) (after b, h and c0), their
# count from the shape of the first of them (@ROWS@: kc, or keys).
DEQUANTIZE = """
  constexpr int PER_WORD = 32 / BITS;
  constexpr uint32_t CODE_MASK = (1u << BITS) - 1u;
  auto dequantize = [&](const uint32_t* codes, const Strides& cs, const T* scales, const Strides& ss,
                        const T* biases, const Strides& bs, int j, float* out) {
    const uint32_t* row = codes + b * cs[0] + h * cs[1] + j * cs[2];
    const int group = c0 / GS;
    const float s = static_cast<float>(scales[b * ss[0] + h * ss[1] + j * ss[2] + group * ss[3]]);
    const float z = static_cast<float>(biases[b * bs[0] + h * bs[1] + j * bs[2] + group * bs[3]]);
    #pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int c = c0 + i;
      const uint32_t word = row[(c / PER_WORD) * cs[3]];
      out[i] = s * static_cast<float>((word >> ((c % PER_WORD) * BITS)) & CODE_MASK) + z;
    }
  };
#define READ_KEYS(j, out) dequantize(kc, kc_strides, ks, ks_strides, kb, kb_strides, j, out)
#define READ_VALUES(j, out) dequantize(vc, vc_strides, vs, vs_strides, vb, vb_strides, j, out)
"""

_READ = """
  auto read = [&](const T* rows, const Strides& st, int j, float* out) {
    const T* row = rows + b * st[0] + h * st[1] + j * st[2];
    #pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = static_cast<float>(row[(c0 + i) * st[3]]);
  };
#define READ_KEYS(j, out) read(keys, keys_strides, j, out)
#define READ_VALUES(j, out) read(values, values_strides, j, out)
"""

_PARTIALS = """
  constexpr int LPR = D / 8;          // lanes a row
  constexpr int RPW = 32 / LPR;       // rows a warp reads at once
  const int H = @ROWS@_shape[1];
@EXTENT@  // A work group takes G of a KV head's G * SLICES query heads (slice g0 / G) and one stretch.
  const int item = blockIdx.x / splits, stretch = blockIdx.x % splits;
  const int bh = item / SLICES, g0 = (item % SLICES) * G;
  const int b = bh / H, h = bh % H;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int slot = lane / LPR, c0 = (lane % LPR) * 8;
  const float scale = params[0];
@READER@
  float q[G][8], top[G], total[G], acc[G][8];
  #pragma unroll
  for (int g = 0; g < G; ++g) {
    const T* qrow = queries + b * queries_strides[0] + (h * G * SLICES + g0 + g) * queries_strides[1];
    #pragma unroll
    for (int i = 0; i < 8; ++i) {
      q[g][i] = static_cast<float>(qrow[(c0 + i) * queries_strides[3]]) * scale;
      acc[g][i] = 0.0f;
    }
    top[g] = -INFINITY;
    total[g] = 0.0f;
  }
  const int n0 = stretch * ROWS, n1 = min(N, n0 + ROWS);
  // The loop's bounds are the warp's, so every lane takes part in each shuffle.
  for (int first = n0 + warp * RPW; first < n1; first += WARPS * RPW) {
    const int j = first + slot;
    const bool live = j < n1;
    float k[8], v[8];
    if (live) {
      READ_KEYS(j, k);
      READ_VALUES(j, v);
    }
    #pragma unroll
    for (int g = 0; g < G; ++g) {
      float dot = 0.0f;
      if (live) {
        #pragma unroll
        for (int i = 0; i < 8; ++i) dot += q[g][i] * k[i];
      }
      #pragma unroll
      for (int o = LPR / 2; o > 0; o /= 2) dot += __shfl_xor_sync(0xffffffff, dot, o);
      float x = live ? dot : -INFINITY;
      if (HAS_MASK && live) {
        const int mh = mask_shape[1] == 1 ? 0 : h;
        x += mask[b * mask_strides[0] + mh * mask_strides[1] + j * mask_strides[3]];
      }
      if (x > -INFINITY) {
        const float best = fmaxf(top[g], x);
        const float kept = expf(top[g] - best), p = expf(x - best);
        total[g] = total[g] * kept + p;
        #pragma unroll
        for (int i = 0; i < 8; ++i) acc[g][i] = acc[g][i] * kept + p * v[i];
        top[g] = best;
      }
    }
  }
  // Merge the warp's row slots (lanes LPR apart hold the same channels).
  #pragma unroll
  for (int g = 0; g < G; ++g) {
    for (int o = LPR; o < 32; o *= 2) {
      const float other_top = __shfl_xor_sync(0xffffffff, top[g], o);
      const float other_total = __shfl_xor_sync(0xffffffff, total[g], o);
      const float best = fmaxf(top[g], other_top);
      const float mine = top[g] == -INFINITY ? 0.0f : expf(top[g] - best);
      const float theirs = other_top == -INFINITY ? 0.0f : expf(other_top - best);
      total[g] = total[g] * mine + other_total * theirs;
      #pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float other = __shfl_xor_sync(0xffffffff, acc[g][i], o);
        acc[g][i] = acc[g][i] * mine + other * theirs;
      }
      top[g] = best;
    }
  }
  __shared__ float warp_top[WARPS][G], warp_total[WARPS][G], warp_acc[WARPS][G][D];
  if (slot == 0) {
    #pragma unroll
    for (int g = 0; g < G; ++g) {
      if (c0 == 0) { warp_top[warp][g] = top[g]; warp_total[warp][g] = total[g]; }
      #pragma unroll
      for (int i = 0; i < 8; ++i) warp_acc[warp][g][c0 + i] = acc[g][i];
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < G * D; e += blockDim.x) {
    const int g = e / D, c = e % D;
    float best = -INFINITY;
    for (int w = 0; w < WARPS; ++w) best = fmaxf(best, warp_top[w][g]);
    float sum = 0.0f, out = 0.0f;
    for (int w = 0; w < WARPS; ++w) {
      if (warp_top[w][g] == -INFINITY) continue;
      const float weight = expf(warp_top[w][g] - best);
      sum += warp_total[w][g] * weight;
      out += warp_acc[w][g][c] * weight;
    }
@WRITE@
  }
"""

# What a work group writes of its stretch: its maximum, sum and unnormalized output for
# the combine launch, or (one stretch a head: every row) the output itself, rounded once.
_WRITE_PARTIALS = """
    partial_out[(blockIdx.x * G + g) * D + c] = out;
    if (c == 0) {
      partial_top[blockIdx.x * G + g] = best;
      partial_total[blockIdx.x * G + g] = sum;
    }"""
_WRITE_OUTPUT = """
    output[(blockIdx.x * G + g) * D + c] = static_cast<T>(sum > 0.0f ? out / sum : 0.0f);"""

_COMBINE = """
  // partial_top [B * H, splits, G]: its shape says how many stretches (no array to copy).
  const long e = static_cast<long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const long heads = partial_top_shape[0], splits = partial_top_shape[1];
  if (e >= heads * G * D) return;
  const long c = e % D, bhg = e / D, g = bhg % G, bh = bhg / G;
  float best = -INFINITY;
  for (long s = 0; s < splits; ++s) best = fmaxf(best, partial_top[(bh * splits + s) * G + g]);
  float sum = 0.0f, out = 0.0f;
  for (long s = 0; s < splits; ++s) {
    const long at = (bh * splits + s) * G + g;
    if (partial_top[at] == -INFINITY) continue;
    const float weight = expf(partial_top[at] - best);
    sum += partial_total[at] * weight;
    out += partial_out[at * D + c] * weight;
  }
  output[e] = static_cast<T>(sum > 0.0f ? out / sum : 0.0f);
"""

# How many rows a head has and how many stretches they are read in: the rows' shape and the
# grid, or (camkv.backends.step_cuda) a launch's data.
EXTENT = """  const int N = @ROWS@_shape[2];
  const int splits = gridDim.x / (@ROWS@_shape[0] * H * SLICES);
"""

_kernels: dict[tuple, object] = {}  # kernel_text.key((kind, whole)) -> its launch
_ROW_INPUTS = {"quantized": ("kc", "ks", "kb", "vc", "vs", "vb"), "plain": ("keys", "values")}


def no_mask() -> mx.array:
    """The placeholder the kernel reads where there is no mask (has_mask false)."""
    return constants.floats(0.0, shape=(1, 1, 1, 1))


def here() -> bool:
    """Whether the default device is an NVIDIA GPU (MLX's CUDA build), as drop.on_cuda;
    a name of its own, so that tests which pretend drop's kernels run here do not route
    quantized attention to these."""
    return mx.default_device() == mx.gpu and drop.cuda_build()


def _kernel(kind: str, whole: bool = False):
    """The launch of kind (a key of _ROW_INPUTS, or "combine"); whole: the one-launch
    variant that attends every row of a head and writes the output."""
    def make():
        if kind in _ROW_INPUTS:  # the partials over quantized rows, or over rows as the model's dtype
            rows = _ROW_INPUTS[kind]
            return kernel_text.cuda_kernel(
                name=f"camkv_{kind}_attention_{'whole' if whole else 'partials'}",
                input_names=["queries", *rows, "mask", "params"],
                output_names=["output"] if whole else ["partial_top", "partial_total", "partial_out"],
                source=partials_source(rows[0], DEQUANTIZE if kind == "quantized" else _READ, EXTENT, whole),
                ensure_row_contiguous=False)
        return kernel_text.cuda_kernel(
            name="camkv_quantized_attention_combine",
            input_names=["partial_top", "partial_total", "partial_out"], output_names=["output"],
            source=_COMBINE)
    return kernel_text.built(_kernels, (kind, whole), make)


def partials_source(first_rows: str, reader: str, extent: str, whole: bool) -> str:
    """The text of the attention over rows: first_rows names the input whose shape gives
    B and H, reader defines READ_KEYS and READ_VALUES, extent N and splits; whole: the
    work group writes its head's output (one stretch a head), else its partials."""
    return (_PARTIALS.replace("@EXTENT@", extent).replace("@READER@", reader)
            .replace("@WRITE@", _WRITE_OUTPUT if whole else _WRITE_PARTIALS).replace("@ROWS@", first_rows))


def whole_warps(G: int, D: int) -> int:
    """Warps of a work group that reads every row of a head (WHOLE_ROWS): as many as keep
    its partial sums (WARPS_SHARED_BYTES) in shared memory, up to MAX_WHOLE_WARPS. A
    decode step's heads are few (8 at a 1B model's shape), so each head's rows are split
    over more warps, not over more work groups (which would need a combine launch)."""
    return max(1, min(MAX_WHOLE_WARPS, WARPS_SHARED_BYTES // (4 * G * D)))


def takes(queries: mx.array, keys: tuple, values: tuple, bits: int, group_size: int) -> bool:
    """Whether the kernels take this step: one query a head, keys and values of one head
    dim in HEAD_DIMS, bits in BITS, at most MAX_GROUP query heads a KV head."""
    D = queries.shape[3]
    return (bits in BITS and group_size <= D
            and _fits(queries, keys[0].shape[1], values[1].shape[-1] * group_size, keys[1].dtype, values[1].dtype))


def _fits(queries: mx.array, H: int, v_dim: int, key_dtype, value_dtype) -> bool:
    """What both kinds of rows need: one query a head, one head dim in HEAD_DIMS for the
    queries and the values, at most MAX_GROUP query heads a KV head, and the rows' dtype
    (quantized: their scales') the queries'."""
    _, Hq, L, D = queries.shape
    return (L == 1 and D in HEAD_DIMS and v_dim == D and Hq % H == 0 and Hq // H <= MAX_GROUP
            and key_dtype == value_dtype == queries.dtype)


def rows_per_stretch(head_dim: int, warps: int | None = None, steps: int | None = None) -> int:
    """Rows one work group reads: warps (None: WARPS) of 32 / (D / 8) row slots, steps
    (None: STEPS) times."""
    return (WARPS if warps is None else warps) * (32 // (head_dim // 8)) * (STEPS if steps is None else steps)


def _stretch_count(N: int, per_stretch: int) -> int:
    """Stretches of per_stretch rows that N rows a head are read in (at least one)."""
    return max(1, -(-N // per_stretch))


def takes_rows(queries: mx.array, keys: mx.array, values: mx.array) -> bool:
    """Whether the kernels take this step over rows held as the model's dtype: one query a
    head, keys and values of one head dim in HEAD_DIMS and of the queries' dtype, at most
    MAX_GROUP query heads a KV head."""
    return (keys.shape[-1] == queries.shape[3]
            and _fits(queries, keys.shape[1], values.shape[-1], keys.dtype, values.dtype))


def attend(queries: mx.array, keys: tuple, values: tuple, scale: float, mask, bits: int, group_size: int
           ) -> mx.array:
    """softmax(scale q k^T + mask) v over quantized rows, [B, Hq, 1, D] in the queries'
    dtype. keys, values: (codes, scales, biases) [B, H, N, ...] as mx.quantize lays them
    out (views are read through their strides); mask: None or additive float32
    [B, 1 or H, 1, N]. The caller checks takes() first."""
    return _attend("quantized", queries, (*keys, *values), keys[0].shape, scale, mask,
                   [("BITS", bits), ("GS", group_size)])


# Rows as the model's dtype are read in stretches (partials, then the combine launch)
# past one stretch a head (True), not by one work group a head up to WHOLE_ROWS: a keepkv
# decode step's heads are few (8 at a 1B model's shape), and 8 work groups reading 577
# rows each took 80 us of an H100 a layer (Nsight Compute), more than the step's host work.
PLAIN_STRETCHES = True


# Rows as the model's dtype, up to QUERY_HEAD_ROWS a head of a dim in QUERY_HEAD_DIMS, are
# read by a work group a query head (QUERY_HEAD_WARPS warps reading all its rows, one
# launch), past that by a KV head's query heads together in stretches and a combine: as
# many work groups as query heads (16 at a 1B model's shape), each with few registers (one
# query head's sums), so many warps each; a KV head's rows are read once a query head,
# from the device's cache after the first. On an H100 (Nsight Compute, bench/results/
# README.md, "keepkv's decode attention by a work group a query head") 32 warps a query
# head took 24.0 us a call over 577 rows of dim 128 against the stretches' 35.4 (their
# combine included), 36.5 against 40.4 over 1089 rows and 61.9 against 53.0 over 2112:
# the two cross near 1400 rows. Head dim 256 was not timed, so its rows keep the stretches.
QUERY_HEAD_ROWS = 1280
QUERY_HEAD_DIMS = (64, 128)
QUERY_HEAD_WARPS = 32
# With QUERY_HEAD_STEPS set, a query head's rows are read in stretches of QUERY_HEAD_WARPS
# warps of 32 / (D / 8) row slots, QUERY_HEAD_STEPS times, and combined (two launches).
QUERY_HEAD_STEPS: int | None = None
# A work group that reads every row of its head: its stretch holds any row count.
ALL_ROWS = 1 << 30


def attend_rows(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask) -> mx.array:
    """attend over rows held as the model's dtype, keys and values [B, H, N, D] (views
    read through their strides): a decode step that needs a mask per KV head, which MLX's
    CUDA attention does not take (its fallback is a chain of launches). The caller checks
    takes_rows() first."""
    whole_rows = rows_per_stretch(queries.shape[3]) if PLAIN_STRETCHES else WHOLE_ROWS
    return _attend("plain", queries, (keys, values), keys.shape, scale, mask, [], whole_rows,
                   by_query_head(keys.shape[2], queries.shape[3]))


def by_query_head(N: int, D: int) -> bool:
    """Whether N rows a head of dim D are read by a work group a query head (QUERY_HEAD_ROWS)."""
    return N <= QUERY_HEAD_ROWS and D in QUERY_HEAD_DIMS


def query_head_layout(N: int, D: int) -> tuple[bool, int, int, int]:
    """layout() of a work group a query head: (whole, warps, rows a stretch, stretches)."""
    if QUERY_HEAD_STEPS is None:
        return True, QUERY_HEAD_WARPS, ALL_ROWS, 1
    per_stretch = rows_per_stretch(D, QUERY_HEAD_WARPS, QUERY_HEAD_STEPS)
    return False, QUERY_HEAD_WARPS, per_stretch, _stretch_count(N, per_stretch)


def layout(N: int, G: int, D: int, whole_rows: int | None = None) -> tuple[bool, int, int, int]:
    """How a step over N rows a head is launched: (whole, warps a work group, rows a
    stretch, stretches a head). Up to whole_rows (None: WHOLE_ROWS) rows one work group
    of whole_warps a head reads them all and writes the output; more are read in
    stretches by WARPS-warp groups, whose partials a combine launch merges."""
    if N <= (WHOLE_ROWS if whole_rows is None else whole_rows):
        return True, whole_warps(G, D), WHOLE_ROWS, 1
    per_stretch = rows_per_stretch(D)
    return False, WARPS, per_stretch, _stretch_count(N, per_stretch)


def template(dtype, D: int, G: int, extra, warps: int, rows: int, has_mask: bool, slices: int = 1) -> list:
    """The partials' template: G query heads a work group, of a KV head's G * slices."""
    return [("T", dtype), ("D", D), ("G", G), *extra, ("WARPS", warps), ("ROWS", rows), ("HAS_MASK", has_mask),
            ("SLICES", slices)]


def partial_shapes(heads: int, splits: int, G: int, D: int) -> list:
    """Shapes of the partials (maximum, sum, unnormalized output) of heads x splits stretches."""
    return [(heads, splits, G), (heads, splits, G), (heads, splits, G, D)]


def combine(top: mx.array, total: mx.array, out: mx.array, queries: mx.array) -> mx.array:
    """The output [B, Hq, 1, D] of the stretches' partials (the second launch)."""
    B, Hq, _, D = queries.shape
    G = top.shape[2]
    threads = 128
    count = B * Hq * D
    return _kernel("combine")(
        inputs=[top, total, out], template=[("T", queries.dtype), ("D", D), ("G", G)],
        grid=(-(-count // threads) * threads, 1, 1), threadgroup=(threads, 1, 1),
        output_shapes=[(B, Hq, 1, D)], output_dtypes=[queries.dtype])[0]


def _attend(kind: str, queries: mx.array, rows: tuple, rows_shape, scale: float, mask, extra,
            whole_rows: int | None = None, per_query_head: bool = False) -> mx.array:
    has_mask = mask is not None
    whole, launch, output_shapes = _plan(kind, queries.shape, queries.dtype, rows_shape[1], rows_shape[2], has_mask,
                                         tuple(extra), WHOLE_ROWS if whole_rows is None else whole_rows,
                                         per_query_head)
    inputs = [queries, *rows, mask if has_mask else no_mask(), constants.floats(float(scale))]
    if whole:  # one work group a KV head reads all its rows and writes the output: one launch
        return _kernel(kind, whole=True)(inputs=inputs, **launch, output_shapes=output_shapes,
                                         output_dtypes=[queries.dtype])[0]
    top, total, out = _kernel(kind)(inputs=inputs, **launch, output_shapes=output_shapes,
                                    output_dtypes=[mx.float32] * 3)
    return combine(top, total, out, queries)


def _plan(kind: str, queries_shape, dtype, H: int, N: int, has_mask: bool, extra: tuple, whole_rows: int,
          per_query_head: bool = False) -> tuple[bool, dict, list]:
    """(whole, the launch's template, grid and threadgroup, its output shapes) of a step,
    made once per step shape and held: every layer of a decode step has the same shape,
    and the host builds the launch at every layer and step. per_query_head: a work group
    a query head (query_head_layout), else a KV head's query heads together (layout)."""
    # Every setting the layouts read is in the key (tests and benchmarks change them).
    key = (kind, queries_shape, dtype, H, N, has_mask, extra, whole_rows, WARPS, STEPS, MAX_WHOLE_WARPS,
           WARPS_SHARED_BYTES, per_query_head, QUERY_HEAD_WARPS, QUERY_HEAD_STEPS)
    plan = _plans.get(key)
    if plan is None:
        B, Hq, _, D = queries_shape
        G, heads = Hq // H, B * H
        slices = G if per_query_head else 1  # work groups a KV head's query heads are split over
        per_group = G // slices  # query heads a work group takes
        whole, warps, per_stretch, splits = query_head_layout(N, D) if per_query_head else layout(N, G, D, whole_rows)
        launch = dict(template=template(dtype, D, per_group, extra, warps, per_stretch, has_mask, slices),
                      grid=(heads * slices * splits * warps * 32, 1, 1), threadgroup=(warps * 32, 1, 1))
        shapes = [(B, Hq, 1, D)] if whole else partial_shapes(heads * slices, splits, per_group, D)
        if len(_plans) >= MAX_PLANS:
            _plans.clear()
        plan = _plans[key] = (whole, launch, shapes)
    return plan


# Step shapes whose launch plan is held (a decode step's rows grow by one a step between
# compressions: budget + slack shapes a model, so a few hundred at most).
MAX_PLANS = 4096
_plans: dict = {}
