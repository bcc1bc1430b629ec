"""Which quantized attention shapes MLX runs on this device, and what one decode step's
attention costs over bounded rows: quantized (mlx-lm's quantized attention), dequantized
first (what camkv's hook falls back to where neither reads them as stored), unquantized,
and camkv's own pass reading the rows as stored (camkv.quantized_attention: the extension
on the CPU, two CUDA launches on an NVIDIA GPU).

    python bench/quantized_attention.py --rows 512 2048 --head-dim 64 128 --bits 4 8

Each shape prints `ok` with the three times (mean of --repeats steps after a warm-up,
each step evaluated) or the error MLX raised. --out writes the records as JSON.
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx
from mlx_lm.models.base import quantized_scaled_dot_product_attention

from camkv import quantized_attention
from camkv.config import GROUP_SIZES


def _inputs(rows: int, dim: int, kv_heads: int, q_per_kv: int, queries: int, dtype):
    q = mx.random.normal((1, kv_heads * q_per_kv, queries, dim)).astype(dtype)
    k = mx.random.normal((1, kv_heads, rows, dim)).astype(dtype)
    v = mx.random.normal((1, kv_heads, rows, dim)).astype(dtype)
    return q, k, v


def _timed(step, repeats: int) -> float:
    mx.eval(step())
    start = time.perf_counter()
    for _ in range(repeats):
        mx.eval(step())
    return (time.perf_counter() - start) / repeats * 1e3


def probe(rows, dim, bits, group, kv_heads, q_per_kv, queries, dtype, repeats) -> dict:
    """One shape: whether quantized attention runs, and the three step times in ms."""
    q, k, v = _inputs(rows, dim, kv_heads, q_per_kv, queries, dtype)
    qk, qv = mx.quantize(k, group_size=group, bits=bits), mx.quantize(v, group_size=group, bits=bits)
    scale = dim ** -0.5
    record = {"rows": rows, "head_dim": dim, "bits": bits, "group_size": group, "kv_heads": kv_heads,
              "queries_per_kv": q_per_kv, "queries": queries}
    mask = "causal" if queries > 1 else None
    try:  # mlx-lm's quantized attention scales the queries it is given in place: a copy each step
        record["quantized_ms"] = _timed(lambda: quantized_scaled_dot_product_attention(
            mx.array(q), qk, qv, scale=scale, mask=mask, group_size=group, bits=bits), repeats)
        record["ok"] = True
    except Exception as exc:  # MLX raises ValueError / RuntimeError naming the shape
        record["ok"], record["error"] = False, str(exc).splitlines()[0][:200]
    record["dequantized_ms"] = _timed(lambda: mx.fast.scaled_dot_product_attention(
        q, mx.dequantize(*qk, group_size=group, bits=bits), mx.dequantize(*qv, group_size=group, bits=bits),
        scale=scale, mask=mask), repeats)
    record["unquantized_ms"] = _timed(lambda: mx.fast.scaled_dot_product_attention(
        q, k, v, scale=scale, mask=mask), repeats)
    if quantized_attention.runs_here(q) and bits in (4, 8):  # camkv's pass: CPU or CUDA, one query
        record["camkv_ms"] = _timed(lambda: quantized_attention.attend(q, qk, qv, scale, None, bits, group),
                                        repeats)
    return record


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[512, 2048], help="rows attended")
    parser.add_argument("--head-dim", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--bits", type=int, nargs="+", default=[4, 8], choices=[2, 3, 4, 5, 6, 8])
    parser.add_argument("--group-size", type=int, nargs="+", default=[64], choices=GROUP_SIZES)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--queries-per-kv", type=int, default=4)
    parser.add_argument("--queries", type=int, nargs="+", default=[1], help="query tokens a step")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", help="write the records as JSON here")
    args = parser.parse_args(argv)
    dtype = getattr(mx, args.dtype)
    records = []
    print(f"device {mx.default_device()}, dtype {args.dtype}", flush=True)
    for dim in args.head_dim:
        for rows in args.rows:
            for bits in args.bits:
                for group in (g for g in args.group_size if dim % g == 0):  # mx.quantize needs it
                    for queries in args.queries:
                        r = probe(rows, dim, bits, group, args.kv_heads, args.queries_per_kv, queries, dtype,
                                  args.repeats)
                        records.append(r)
                        head = f"D={dim} rows={rows} bits={bits} group={group} L={queries}"
                        tail = (f"quantized {r['quantized_ms']:.3f} ms" if r["ok"] else f"error: {r['error']}")
                        extension = (f"; camkv {r['camkv_ms']:.3f} ms" if "camkv_ms" in r else "")
                        print(f"{head}: {tail}; dequantized {r['dequantized_ms']:.3f} ms; "
                              f"unquantized {r['unquantized_ms']:.3f} ms{extension}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": str(mx.default_device()), "dtype": args.dtype, "records": records}, f, indent=1)


if __name__ == "__main__":
    from camkv._blas import reexec_with_openblas

    reexec_with_openblas()  # the CPU's float32 matrix products by the system's OpenBLAS, where one exists
    main()
