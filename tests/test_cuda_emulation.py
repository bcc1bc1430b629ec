"""The CUDA emulation the kernel tests run on machines without an NVIDIA GPU
(tests/cuda_emulation.py): its half-precision conversions round as the device does (MLX's
own casts are the reference), its warp exchanges and barriers pair up as on the device,
outputs a kernel forgets to write show, and a kernel that never finishes fails."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import cuda_emulation

pytestmark = pytest.mark.skipif(cuda_emulation.COMPILER is None, reason="no C++ compiler to emulate a GPU")

_ROUND_TRIP = """
  const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < dims[0]) out[i] = static_cast<float>(static_cast<T>(x[i]));
"""


def _run(source, inputs, shapes, dtypes, threads=32, blocks=1, template=(), init_value=None):
    kernel = cuda_emulation.emulated_cuda_kernel("probe", ["x", "dims"][: len(inputs)], ["out"], source)
    return kernel(inputs=inputs, grid=(blocks * threads, 1, 1), threadgroup=(threads, 1, 1), output_shapes=shapes,
                  output_dtypes=dtypes, template=template, init_value=init_value)[0]


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_half_precision_rounds_as_mlx_casts(dtype):
    rng = np.random.default_rng(0)
    edges = [0.0, -0.0, 1.0, -1.0, 65504.0, 65519.0, 65520.0, 1e30, -1e30, 6e-8, 3e-8, 2.9e-8, 1e-40, 5.96e-8,
             1.0009765625, 1.00048828125, 1.000732421875, 1 + 2**-8, 1 + 3 * 2**-9, np.inf, -np.inf]
    x = np.concatenate([np.array(edges, np.float32), rng.standard_normal(4000).astype(np.float32) * 100,
                        rng.standard_normal(1000).astype(np.float32) * 1e-6,
                        (rng.integers(0, 2**32, 2000, dtype=np.uint64).astype(np.uint32)).view(np.float32)])
    x = x[np.isfinite(x) | np.isinf(x)]  # NaNs are compared apart: any NaN stands for one
    got = _run(_ROUND_TRIP, [mx.array(x), mx.array([x.size], mx.int32)], [x.shape], [mx.float32],
               threads=256, blocks=-(-x.size // 256), template=[("T", dtype)])
    want = mx.array(x).astype(dtype).astype(mx.float32)
    np.testing.assert_array_equal(np.array(got).view(np.uint32), np.array(want).view(np.uint32))


def test_warps_exchange_within_themselves_whatever_their_loop_counts():
    """Warp w shuffles w + 1 times (a warp-uniform loop, as mass_cuda's), then the group
    meets at a barrier: no deadlock, and each lane sees its partner's value."""
    source = """
      const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
      float value = threadIdx.x;
      for (int round = 0; round <= warp; ++round) value = __shfl_xor_sync(0xffffffffu, value, 1);
      __syncthreads();
      unsigned ballot = __ballot_sync(0xffffffffu, lane % 3 == warp);
      out[threadIdx.x] = lane == 31 ? float(ballot) : value;
    """
    got = np.array(_run(source, [mx.zeros((1,))], [(96,)], [mx.float32], threads=96))
    tid = np.arange(96)
    want = np.where((tid // 32 + 1) % 2 == 1, tid ^ 1, tid).astype(np.float64)
    for warp in range(3):  # lane 31 of each warp holds its ballot: the lanes l with l % 3 == warp
        want[32 * warp + 31] = sum(1 << lane for lane in range(32) if lane % 3 == warp)
    np.testing.assert_array_equal(got, want.astype(np.float32))


def test_unwritten_outputs_show_and_init_value_fills():
    source = "if (threadIdx.x < 3) out[threadIdx.x] = 1.0f;"
    got = np.array(_run(source, [mx.zeros((1,))], [(5,)], [mx.float32], threads=32))
    assert (got[:3] == 1).all() and np.isnan(got[3:]).all()
    got = np.array(_run(source, [mx.zeros((1,))], [(5,)], [mx.float32], threads=32, init_value=0.0))
    np.testing.assert_array_equal(got, [1, 1, 1, 0, 0])


def test_a_kernel_that_never_finishes_fails(monkeypatch):
    """Thread 0 returns before a barrier the others wait at: the call raises (its threads
    are left waiting), where the test would otherwise hang."""
    monkeypatch.setattr(cuda_emulation, "TIMEOUT_S", 1)
    source = "if (threadIdx.x == 0) return; __syncthreads(); out[threadIdx.x] = 1.0f;"
    with pytest.raises(RuntimeError, match="did not finish"):
        _run(source, [mx.zeros((1,))], [(32,)], [mx.float32], threads=32)
