"""A keepkv decode step's attention on an NVIDIA GPU, one layer's call at a time, in each
launch layout camkv's pass can take, beside MLX's own attention over the same rows.

keepkv's rows are weighed by their votes: a decode step attends with the log votes added
to each row's logit, a bias per KV head that MLX's CUDA attention does not take, so camkv
reads the rows itself (camkv.backends.quantized_cuda.attend_rows). How it is launched:

- `stretches:W:S`: work groups of W warps each read a stretch of W * (32 / (D / 8)) * S
  rows of one KV head and write partial sums, and a second launch combines them
  (quantized_cuda.WARPS = W, STEPS = S; QUERY_HEAD_ROWS = 0);
- `whole:W`: one work group of W warps a KV head reads all its rows and writes the output,
  one launch (quantized_cuda.PLAIN_STRETCHES off, MAX_WHOLE_WARPS = W; QUERY_HEAD_ROWS = 0);
- `heads:W`: one work group of W warps a query head reads all its KV head's rows and
  writes its output, one launch (quantized_cuda.QUERY_HEAD_ROWS past any row count,
  QUERY_HEAD_WARPS = W); `heads:W:S`: a query head's rows in stretches of
  W * (32 / (D / 8)) * S rows, combined (QUERY_HEAD_STEPS = S);
- `sdpa`: MLX's mx.fast.scaled_dot_product_attention over the same rows without the bias
  (what dropping's decode step runs: the time to reach).

The default layout (camkv's, no setting changed) is heads:32 up to QUERY_HEAD_ROWS (1280)
rows a head of dim 64 or 128, stretches:4:4 past them.

The rows are a view of a buffer with room to decode (as a cache holds them), the bias a
float32 [1, H, 1, N]. Each layout named is checked against the default layout (the
largest difference of its output is printed) and warmed; then --calls calls of each, in
the order named, run between cuProfilerStart and cuProfilerStop, each evaluated, so
Nsight Compute started with --profile-from-start off times those kernels only, and the
wall time of a call (evaluated alone: launch and wait included; under the profiler, the
profiler's) is printed. --sum reads
that log in launch order: each layout's first kernel (sdpa's, or camkv's partials, whose
name holds the layout's template) with the combine launches after it, a call's device
time each.

    ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum \\
        --csv --print-units base --log-file layouts.csv \\
        python3 bench/decode_attention.py --rows 577 --layouts sdpa stretches:4:4 heads:32
    python3 bench/decode_attention.py --sum layouts.csv
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import sys
import time
from pathlib import Path
from unittest import mock

import mlx.core as mx

from camkv.backends import quantized_cuda

sys.path.insert(0, str(Path(__file__).resolve().parent))
import prompt_kernels  # noqa: E402  (the ncu log's reading, beside this script)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=577, help="rows held per KV head (default 577: budget 512 "
                                                               "and a full slack of 64, and one more)")
    parser.add_argument("--kv-heads", type=int, default=8, help="KV heads (default 8)")
    parser.add_argument("--queries-per-kv", type=int, default=2, help="query heads per KV head (default 2)")
    parser.add_argument("--head-dim", type=int, default=128, choices=quantized_cuda.HEAD_DIMS,
                        help="key and value dim (default 128: with the defaults above, random-1b's attention)")
    parser.add_argument("--layouts", nargs="+", default=["sdpa", "stretches:4:4", "heads:32"],
                        help="each stretches:WARPS:STEPS, whole:WARPS, heads:WARPS[:STEPS] or sdpa "
                             "(default sdpa stretches:4:4 heads:32)")
    parser.add_argument("--calls", type=int, default=32, help="profiled calls of each layout (default 32)")
    parser.add_argument("--sum", type=Path, metavar="CSV",
                        help="summarize this ncu log (--csv --print-units base) by layout instead of running")
    opts = parser.parse_args(argv)
    try:
        opts.settings = {layout: layout_settings(layout) for layout in opts.layouts}
    except ValueError as error:
        parser.error(str(error))
    return opts


def layout_settings(layout: str) -> dict | None:
    """quantized_cuda's settings for a layout (None: sdpa); ValueError naming what is allowed."""
    kind, *numbers = layout.split(":")
    allowed = "stretches:WARPS:STEPS, whole:WARPS, heads:WARPS[:STEPS] or sdpa, WARPS 1-32, STEPS 1-64"
    try:
        values = [int(n) for n in numbers]
    except ValueError:
        raise ValueError(f"--layout {layout!r}: expected {allowed}") from None
    if kind == "sdpa" and not values:
        return None
    if kind == "stretches" and len(values) == 2 and 1 <= values[0] <= 32 and 1 <= values[1] <= 64:
        return {"PLAIN_STRETCHES": True, "WARPS": values[0], "STEPS": values[1], "QUERY_HEAD_ROWS": 0}
    if kind == "whole" and len(values) == 1 and 1 <= values[0] <= 32:
        return {"PLAIN_STRETCHES": False, "MAX_WHOLE_WARPS": values[0], "WARPS_SHARED_BYTES": 1 << 30,
                "QUERY_HEAD_ROWS": 0}
    if kind == "heads" and len(values) in (1, 2) and 1 <= values[0] <= 32 and 1 <= values[-1] <= 64:
        return {"QUERY_HEAD_ROWS": quantized_cuda.ALL_ROWS, "QUERY_HEAD_DIMS": quantized_cuda.HEAD_DIMS,
                "QUERY_HEAD_WARPS": values[0],
                "QUERY_HEAD_STEPS": values[1] if len(values) == 2 else None}
    raise ValueError(f"--layout {layout!r}: expected {allowed}")


def inputs(opts) -> tuple:
    """Queries [1, Hq, 1, D], keys and values [1, H, rows, D] (views of buffers 64 rows
    longer), the bias [1, H, 1, rows] float32 (log votes of 1-8 tokens a row)."""
    H, D, N = opts.kv_heads, opts.head_dim, opts.rows
    queries = mx.random.normal((1, H * opts.queries_per_kv, 1, D)).astype(mx.bfloat16)
    keys, values = (mx.random.normal((1, H, N + 64, D)).astype(mx.bfloat16)[:, :, :N] for _ in range(2))
    bias = mx.log(mx.random.randint(1, 9, (1, H, 1, N)).astype(mx.float32))
    mx.eval(queries, keys, values, bias)
    return queries, keys, values, bias


def call_of(settings: dict | None, queries, keys, values, bias):
    """One call of the layout (settings applied for its duration)."""
    scale = queries.shape[-1] ** -0.5
    if settings is None:
        return lambda: mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale)

    def call():
        with contextlib.ExitStack() as held:
            for name, value in settings.items():
                held.enter_context(mock.patch.object(quantized_cuda, name, value))
            return quantized_cuda.attend_rows(queries, keys, values, scale, bias)
    return call


# Kernels that finish a call another kernel started: camkv's combine, the second pass of
# MLX's attention over many rows.
CONTINUES = ("combine", "2pass_2")


def by_layout(log: Path) -> list[tuple[str, int, float]]:
    """(a layout's first kernel name, its calls, nanoseconds a call) from an ncu log, in
    launch order: each kernel but those that continue a call (CONTINUES) starts a call;
    calls of the same first kernel one after another are one layout's."""
    layouts: list[list] = []  # [first kernel, calls, nanoseconds]
    for name, nanoseconds in prompt_kernels.launches_in_order(log, "decode_attention"):
        if not any(part in name for part in CONTINUES):
            if not layouts or layouts[-1][0] != name:
                layouts.append([name, 0, 0.0])
            layouts[-1][1] += 1
        elif not layouts:
            continue  # the end of a call that started before the log
        layouts[-1][2] += nanoseconds
    return [(name, calls, total / calls) for name, calls, total in layouts]


def main(argv=None) -> None:
    opts = parse_args(argv)
    if opts.sum is not None:
        for name, calls, nanoseconds in by_layout(opts.sum):
            print(f"{nanoseconds / 1e3:8.2f} us a call  {calls:4d} calls  {name}")
        return
    if not quantized_cuda.here():
        print("decode_attention: needs MLX's CUDA build on an NVIDIA GPU", file=sys.stderr)
        raise SystemExit(2)
    queries, keys, values, bias = inputs(opts)
    default = call_of({}, queries, keys, values, bias)()
    calls = {}
    for layout, settings in opts.settings.items():
        call = call_of(settings, queries, keys, values, bias)
        try:  # a layout the device cannot launch (registers, shared memory) is left out
            difference = mx.abs(call().astype(mx.float32) - default.astype(mx.float32)).max().item()
            for _ in range(8):  # warm: the kernel built, the launch plan made
                mx.eval(call())
        except (RuntimeError, ValueError) as error:
            print(f"{layout}: left out: {str(error).splitlines()[0]}")
            continue
        calls[layout] = call
        print(f"{layout}: largest difference from the default layout {difference:.3g}")
    cuda = ctypes.CDLL("libcuda.so.1")
    mx.synchronize()
    cuda.cuProfilerStart()
    for layout, call in calls.items():
        tick = time.perf_counter()
        for _ in range(opts.calls):
            mx.eval(call())
        seconds = (time.perf_counter() - tick) / opts.calls
        print(f"{layout}: {opts.calls} calls, {1e6 * seconds:.1f} us each evaluated alone (rows {opts.rows}, "
              f"{opts.kv_heads} KV heads of {opts.queries_per_kv} queries, D {opts.head_dim})")
    cuda.cuProfilerStop()


if __name__ == "__main__":
    main()
