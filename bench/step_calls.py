"""What each call of a decode step costs, one layer's calls at a time: the host's time to
build the call (no evaluation), and its time in a pipelined step of --layers such calls
chained as a model's layers chain them (each call's output feeds the next call's input,
steps evaluated with mx.async_eval as mlx-lm's generate_step does, so the device runs one
step while the host builds the next).

A small model's GPU decode step is host-bound: its time is the sum of its calls' host
costs. RotatingKVCache's step per layer is two in-place writes and MLX's attention;
camkv's quantized step is its write kernel (camkv.backends.append_cuda), six views of the
stored rows and its attention kernel (camkv.backends.quantized_cuda). The arms:

- `sdpa`: mx.fast.scaled_dot_product_attention of one query a head over the rows;
- `slice_write`: the step's key and value written in place (two slice updates);
- `views`: six slices of the quantized rows (codes, scales, biases of keys and values);
- `copy`: a copy of the queries (one MLX operation, the smallest launch);
- `custom_kernel`: a custom kernel of one input and one output, one thread;
- `quant_write`: camkv's quantized write of the step (NVIDIA GPU only);
- `quant_attend`: camkv's attention over the quantized rows as stored (NVIDIA GPU only);
- `quant_step`: camkv's write of the step and attention over the rows in one launch, as a
  quantized cache's decode step runs (camkv.backends.step_cuda; NVIDIA GPU only);
- `quant_attend_w8`, `quant_step_w8`: the same two with 8 warps reading each head's rows
  (quantized_cuda.MAX_WHOLE_WARPS = 8 for the call) where the default is 4;
- `quant_attend_inline`, `quant_step_inline`: the same two with the kernel's text given
  to MLX inline (camkv.backends.kernel_text.BY_FILE off for the call), where by default it
  is in a file that a one-line source includes by its path. MLX copies a custom kernel's
  whole text into every call and hashes it at every evaluation; these show what that costs.

    python bench/step_calls.py --out bench/results/step-calls.json

Arms that need MLX's CUDA build are left out elsewhere, with the reason in the JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import mlx.core as mx

from camkv import quantized
from camkv.backends import append_cuda, drop, kernel_text, quantized_cuda, step_cuda

ARMS = ("sdpa", "slice_write", "views", "copy", "custom_kernel", "quant_write", "quant_attend", "quant_step",
        "quant_attend_w8", "quant_step_w8", "quant_attend_inline", "quant_step_inline")
CUDA_ONLY = ("custom_kernel", "quant_write", "quant_attend", "quant_step", "quant_attend_w8", "quant_step_w8",
             "quant_attend_inline", "quant_step_inline")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=512, help="rows held per KV head (default 512)")
    parser.add_argument("--kv-heads", type=int, default=8, help="KV heads (default 8)")
    parser.add_argument("--queries-per-kv", type=int, default=4, help="query heads per KV head (default 4)")
    parser.add_argument("--head-dim", type=int, default=64, choices=quantized_cuda.HEAD_DIMS,
                        help="channels a head (default 64)")
    parser.add_argument("--bits", type=int, default=8, choices=append_cuda.BITS,
                        help="quantized rows' bits (default 8)")
    parser.add_argument("--group-size", type=int, default=64, choices=(32, 64, 128),
                        help="quantized rows' group size (default 64)")
    parser.add_argument("--layers", type=int, default=16, help="calls chained a step, as layers (default 16)")
    parser.add_argument("--steps", type=int, default=200, help="timed steps (default 200)")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS, metavar="ARM",
                        help=f"calls timed (default all: {', '.join(ARMS)})")
    parser.add_argument("--out", type=Path, default=None, help="JSON file for the results (default none)")
    opts = parser.parse_args(argv)
    for name in ("rows", "kv_heads", "queries_per_kv", "layers", "steps"):
        if getattr(opts, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(opts, name)}")
    if opts.group_size > opts.head_dim:
        parser.error(f"--group-size {opts.group_size} must be at most --head-dim {opts.head_dim}")
    return opts


_TRIVIAL = "if (threadIdx.x == 0 && blockIdx.x == 0) out[0] = x[0];"
_kernel = None


def _custom_kernel(x: mx.array) -> mx.array:
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(name="camkv_step_calls_trivial", input_names=["x"], output_names=["out"],
                                      source=_TRIVIAL)
    return _kernel(inputs=[x], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[x.shape],
                    output_dtypes=[x.dtype])[0]


def calls(opts) -> dict:
    """arm -> (a call of the arm as a function of the last call's output, its first input):
    each output is what the next layer's call reads, so a chain of them is one step."""
    B, H, D, N = 1, opts.kv_heads, opts.head_dim, opts.rows
    dtype = mx.bfloat16
    queries = mx.random.normal((B, H * opts.queries_per_kv, 1, D)).astype(dtype)
    keys, values = (mx.random.normal((B, H, N + 64, D)).astype(dtype) for _ in range(2))
    step = mx.random.normal((B, H, 1, D)).astype(dtype)
    stored = [quantized.quantize(a, opts.bits, opts.group_size) for a in (keys, values)]
    mx.eval(queries, keys, values, step, stored)
    scale = D ** -0.5

    def slice_write(x):
        keys[:, :, N : N + 1] = x
        values[:, :, N : N + 1] = x
        return keys[:, :, N : N + 1]

    def views(x):
        held = [a[:, :, :N] for q in stored for a in q]
        return mx.depends(x, held)

    def quant_write(x):
        stored[0], stored[1] = append_cuda.write(stored[0], stored[1], x, x, N, opts.bits, opts.group_size)
        return mx.depends(x, [stored[0][0]])

    def quant_attend(q):
        held = [tuple(a[:, :, :N] for a in s) for s in stored]
        return quantized_cuda.attend(q, *held, scale, None, opts.bits, opts.group_size)

    def quant_step(q):
        stored[0], stored[1], out = step_cuda.write_and_attend(q, stored[0], stored[1], step, step, N, scale,
                                                               opts.bits, opts.group_size)
        return out

    def with_setting(call, module, name: str, value):
        """call, with module.name set to value while it builds."""
        def set_for_the_call(x):
            with mock.patch.object(module, name, value):
                return call(x)
        return set_for_the_call

    return {
        "sdpa": (lambda q: mx.fast.scaled_dot_product_attention(q, keys[:, :, :N], values[:, :, :N], scale=scale),
                 queries),
        "slice_write": (slice_write, step),
        "views": (views, step),
        "copy": (mx.array, queries),
        "custom_kernel": (_custom_kernel, queries),
        "quant_write": (quant_write, step),
        "quant_attend": (quant_attend, queries),
        "quant_step": (quant_step, queries),
        "quant_attend_w8": (with_setting(quant_attend, quantized_cuda, "MAX_WHOLE_WARPS", 8), queries),
        "quant_step_w8": (with_setting(quant_step, quantized_cuda, "MAX_WHOLE_WARPS", 8), queries),
        "quant_attend_inline": (with_setting(quant_attend, kernel_text, "BY_FILE", False), queries),
        "quant_step_inline": (with_setting(quant_step, kernel_text, "BY_FILE", False), queries),
    }


def time_arm(call, first: mx.array, opts) -> dict:
    """The host's time to build one call (median), and a call's share of a pipelined step
    of opts.layers chained calls (the whole run's time over steps x layers)."""
    built = []
    for _ in range(opts.steps):
        tick = time.perf_counter()
        out = call(first)
        built.append(time.perf_counter() - tick)
        mx.eval(out)

    def one_step(x):
        for _ in range(opts.layers):
            x = call(x)
        return x

    x = one_step(first)
    mx.eval(x)
    tick = time.perf_counter()
    for _ in range(opts.steps):
        x = one_step(first)
        mx.async_eval(x)
    mx.eval(x)
    pipelined = (time.perf_counter() - tick) / (opts.steps * opts.layers)
    return {"build_us": 1e6 * statistics.median(built), "pipelined_us": 1e6 * pipelined}


def main(argv=None) -> dict:
    opts = parse_args(argv)
    on_cuda = drop.on_cuda()
    table = calls(opts)
    arms, left_out = {}, {}
    for arm in opts.arms:
        if arm in CUDA_ONLY and not on_cuda:
            left_out[arm] = "needs MLX's CUDA build on an NVIDIA GPU"
            continue
        call, first = table[arm]
        arms[arm] = time_arm(call, first, opts)
        print(f"{arm:14s} build {arms[arm]['build_us']:7.1f} us   in a pipelined step "
              f"{arms[arm]['pipelined_us']:7.1f} us a call", flush=True)
    for arm, why in left_out.items():
        print(f"{arm:14s} left out: {why}")
    result = {"setup": {**vars(opts), "out": None if opts.out is None else str(opts.out),
                        "device": str(mx.default_device()), "machine": platform.machine(), "mlx": mx.__version__,
                        "command": " ".join(["python", "bench/step_calls.py", *(argv or sys.argv[1:])])},
              "arms": arms, "left_out": left_out}
    if opts.out is not None:  # the folder made where it is missing
        Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
