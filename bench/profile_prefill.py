"""Where one chunk-mode prefill call's time goes, per layer: the chunk's attention
mass scored as matrix products before the launch (backends._common.chunk_mass, the
GPU path's "prescoring") against the whole update (prescoring + the kernel); and the
whole-device path of merge="drop" (camkv.backends.drop): its mass alone, the whole compression
(mass, partition, gather), the mass by plain MLX operations in float32 for comparison,
and the full cache's own attention of the chunk (mx.fast.scaled_dot_product_attention).

Shapes of bench/e2e.py's random-1b llama at its prefill step: 8 KV heads of dim 128,
4 queries per KV head, float16, a chunk of --chunk tokens into a cache of --budget
rows, once into an empty cache and once into a full one. Medians of --repeats
evaluated calls. Example (on the H200):
    python bench/profile_prefill.py --backend cuda --out bench/results
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import mlx.core as mx

from camkv import CaMConfig, backends
from camkv.backends._common import chunk_mass
from camkv.rows import RowState


def add_layer_shape_args(parser: argparse.ArgumentParser, groups: int) -> None:
    """The flags the profiles share: one layer's KV heads, queries per KV head, head dim
    and rows kept per head."""
    parser.add_argument("--heads", type=int, default=8, help="KV heads (default 8)")
    parser.add_argument("--groups", type=int, default=groups, help=f"queries per KV head (default {groups})")
    parser.add_argument("--head-dim", type=int, default=128, help="head dim (default 128)")
    parser.add_argument("--budget", type=int, default=512, help="rows kept per head (default 512)")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="auto", help="camkv backend (auto, cuda, metal, ext, reference)")
    add_layer_shape_args(parser, groups=4)
    parser.add_argument("--chunk", type=int, default=2048, help="prefill chunk (default 2048, e2e's step)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per part (default 5)")
    parser.add_argument("--logit-mb", type=int, nargs="*", default=[],
                        help="also time camkv.backends.drop's mass with these logit block sizes (MiB)")
    parser.add_argument("--out", type=Path, default=None, help="folder for profile-prefill-<backend>.json")
    return parser.parse_args(argv)


def save_result(result: dict, out: Path | None, name: str) -> None:
    """Write result as out/name (JSON) and say so; nothing when out is None."""
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(json.dumps(result, indent=1))
    print("wrote", path)


def median_seconds(call, repeats: int) -> float:
    """Median wall time of an evaluated call, after one untimed call (which compiles)."""
    times = []
    for trial in range(repeats + 1):  # the first call compiles
        start = time.perf_counter()
        mx.eval(call())
        if trial:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def random_state(rows: int, n: int, dim: int, dtype) -> RowState:
    """n random stored tokens a row (keys and values of dim features, uniform scores)."""
    return RowState(mx.random.normal((rows, n, dim)).astype(dtype), mx.random.normal((rows, n, dim)).astype(dtype),
                    mx.random.uniform(shape=(rows, n)), mx.broadcast_to(mx.arange(n, dtype=mx.int32), (rows, n)))


def chunk_case(heads: int, groups: int, head_dim: int, budget: int, chunk: int):
    """(keys [H, chunk, D] float16, queries [H, chunk, G, D], a full state of budget rows,
    row ids): one layer's chunk call, evaluated."""
    keys = mx.random.normal((heads, chunk, head_dim)).astype(mx.float16)
    queries = mx.random.normal((heads, chunk, groups, head_dim))
    full = random_state(heads, budget, head_dim, mx.float16)
    row_ids = mx.arange(heads, dtype=mx.uint32)
    mx.eval(keys, queries, full, row_ids)
    return keys, queries, full, row_ids


def measure(opts) -> dict:
    H, D = opts.heads, opts.head_dim
    cfg = CaMConfig(budget=opts.budget, backend=opts.backend, prefill="chunk")
    backend = backends.resolve(opts.backend)
    scale = 1.0 / math.sqrt(D)
    keys, queries, full, row_ids = chunk_case(H, opts.groups, D, opts.budget, opts.chunk)
    states = {"into an empty cache": RowState.empty(H, D, D, mx.float16), "into a full cache": full}
    target = getattr(backend, "target", None)  # only the GPU backends prescore
    if target is None:
        raise SystemExit(f"backend {backends.resolve_name(opts.backend)!r} scores chunks inside its kernel: "
                         "nothing to split; use --backend cuda or metal")
    split = target == "cuda"
    result = {}
    for name, state in states.items():
        offset = state.length
        update_s = median_seconds(
            lambda: backend.update(state, keys, keys, offset, cfg, row_ids, queries, scale), opts.repeats)
        mass_s = median_seconds(lambda: chunk_mass(state, keys, queries, scale, split=split), opts.repeats)
        result[name] = {"update_ms": 1e3 * update_s, "prescoring_ms": 1e3 * mass_s,
                        "rest_ms": 1e3 * (update_s - mass_s), **_fast_parts(state, keys, queries, scale, cfg, opts)}
    return result


def _fast_parts(state, keys, queries, scale, cfg, opts) -> dict:
    """camkv.backends.drop on the same call (ms): mass, whole drop compression, mass by MLX ops, and sdpa."""
    # Imported here, not at the top: decode_parts imports this file and runs on older code too.
    from camkv import mass
    from camkv.backends import drop
    n, rows = state.length, keys.shape[0]
    q = queries.astype(keys.dtype).transpose(0, 2, 1, 3)  # [R, G, S, D] as the cache hands them over
    joined = mx.concatenate([state.keys, keys], axis=1)
    mx.eval(q, joined)
    drop_cfg = cfg.replace(merge="drop")
    row_ids = mx.arange(rows, dtype=mx.uint32)
    mlx_ops = lambda: mass.column_mass(  # noqa: E731
        (q.astype(mx.float32).reshape(rows, -1, q.shape[-1]) @ joined.astype(mx.float32).transpose(0, 2, 1))
        .reshape(rows, q.shape[1], q.shape[2], -1), scale, n)
    sdpa = lambda: mx.fast.scaled_dot_product_attention(  # noqa: E731
        q.reshape(1, -1, q.shape[2], q.shape[3]), joined[None], joined[None], scale=scale, mask="causal")
    parts = {}
    for mb in opts.logit_mb:  # the block size camkv.mass scores in (MASS_BYTES)
        default, mass.MASS_BYTES = mass.MASS_BYTES, mb << 20
        parts[f"fast_mass_{mb}mb_ms"] = 1e3 * median_seconds(lambda: drop.attention_mass(q, joined, scale, n),
                                                           opts.repeats)
        mass.MASS_BYTES = default
    if drop.on_cuda():
        parts.update(_cuda_mass_parts(q, joined, scale, n, opts))
    return {
        **parts,
        "fast_mass_ms": 1e3 * median_seconds(lambda: drop.attention_mass(q, joined, scale, n), opts.repeats),
        "fast_drop_ms": 1e3 * median_seconds(
            lambda: drop.update_drop(state, keys, keys, n, drop_cfg, row_ids, queries.astype(keys.dtype), scale),
            opts.repeats),
        "mass_mlx_ops_f32_ms": 1e3 * median_seconds(mlx_ops, opts.repeats),
        "sdpa_ms": 1e3 * median_seconds(sdpa, opts.repeats),
    }


def _cuda_mass_parts(q, joined, scale, n, opts) -> dict:
    """The CUDA mass of the whole chunk in one block, step by step (ms): the product, then
    the kernel (log-sum-exp and column sums)."""
    from camkv.backends import mass_cuda

    rows, groups, s_len, dim = q.shape
    logits = q.reshape(rows, groups * s_len, dim) @ joined.transpose(0, 2, 1)
    mx.eval(logits)
    return {
        "cuda_logits_ms": 1e3 * median_seconds(lambda: q.reshape(rows, groups * s_len, dim) @ joined.transpose(0, 2, 1),
                                               opts.repeats),
        "cuda_columns_ms": 1e3 * median_seconds(lambda: mass_cuda.column_mass(logits, scale, n, s_len, logits.shape[2]), opts.repeats),
    }


def main(argv=None) -> dict:
    opts = parse_args(argv)
    parts = measure(opts)
    result = {"parts": parts, "setup": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(opts).items()},
              "device": str(mx.default_device()),
              "backend_used": backends.resolve_name(opts.backend)}
    print(f"one chunk call of {opts.chunk} tokens, per layer (ms): whole update / prescoring / the rest")
    for name, t in parts.items():
        print(f"  {name:20s} {t['update_ms']:8.2f} / {t['prescoring_ms']:8.2f} / {t['rest_ms']:8.2f}")
        print("  " + ", ".join(f"{k} {v:.2f}" for k, v in t.items() if k.startswith(("fast", "mass", "sdpa", "cuda"))))
    save_result(result, opts.out, f"profile-prefill-{result['backend_used']}.json")
    return result


if __name__ == "__main__":
    main()
