"""What one drop compression costs, per layer, and what each of its parts costs.

A compression (docs/algorithm.md section 7) scores the S pending tokens of a row over the
n + S rows held and evicts back to the budget. For chunks of --chunks tokens into
--budget scored rows (decode compressions are slack + 1 tokens, prefill chunks 2048), with
--layers layers built lazily and evaluated at once (as a model's step does), this times:

  mass_ops        camkv.backends.drop.attention_mass with MLX operations (float32 logits, softmax)
  mass_kernels    the same with the logits in the keys' dtype reduced by
                  backends.mass_cuda's kernel (NVIDIA GPUs)
  mass            what camkv.backends.drop.attention_mass picks here
  evict_ops       eviction as MLX operations: scores and positions joined, a partition,
                  a sort and four gathers (camkv.backends.drop.compress_drop less the mass)
  evict_kernel    eviction in one launch (backends.compact_cuda, NVIDIA GPUs)
  compress_ops    camkv.backends.drop.compress_drop: mass + evict_ops, the rows re-buffered with
                  room to decode as the cache does
  compress_kernel camkv.backends.drop.compress_drop_buffers: mass + evict_kernel (NVIDIA GPUs)

and, for a decode step's attention over the rows held (one query a head): the fused
attention over a view of a buffer with spare rows (what the caches hand the model)
against the same rows contiguous.

Example (on the H200):
    python bench/profile_compress.py --out bench/results
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_prefill import add_layer_shape_args, median_seconds, save_result  # noqa: E402

from camkv import CaMConfig  # noqa: E402
from camkv.backends import drop  # noqa: E402
from camkv.buffers import with_room as _with_room  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16, help="layers evaluated at once (default 16)")
    add_layer_shape_args(parser, groups=2)  # random-1b's layer
    parser.add_argument("--chunks", type=int, nargs="+", default=[65, 129, 257, 2048],
                        help="pending tokens per compression (default 65 129 257 2048)")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per part (default 20)")
    parser.add_argument("--out", type=Path, default=None, help="folder for profile-compress.json")
    return parser.parse_args(argv)


def _layer_case(opts, s_len: int):
    """One layer's compression inputs: buffers [1, H, n + S + 1, D] (bfloat16) of n scored
    and S pending rows, the scored rows' scores and positions, the pending queries."""
    H, D, n = opts.heads, opts.head_dim, opts.budget
    end = n + s_len
    keys = _with_room([], mx.random.normal((1, H, end, D)).astype(mx.bfloat16), 1)
    values = _with_room([], mx.random.normal((1, H, end, D)).astype(mx.bfloat16), 1)
    scores = mx.random.uniform(shape=(H, n))
    positions = mx.broadcast_to(mx.arange(n, dtype=mx.int32), (H, n))
    queries = mx.random.normal((H, opts.groups, s_len, D)).astype(mx.bfloat16)
    mx.eval(keys, values, scores, positions, queries)
    return keys, values, scores, positions, queries, end


def _per_layer(opts, one_layer) -> float:
    """Median milliseconds per layer of one_layer(i) for every layer, evaluated at once."""
    return 1e3 * median_seconds(lambda: [one_layer(i) for i in range(opts.layers)], opts.repeats) / opts.layers


def measure_chunk(opts, s_len: int) -> dict:
    cfg = CaMConfig(budget=opts.budget)
    layers = [_layer_case(opts, s_len) for _ in range(opts.layers)]
    scale = 1.0 / math.sqrt(opts.head_dim)
    n, H = opts.budget, opts.heads
    capacity = cfg.budget + cfg.slack + 1

    def held(i):
        keys, values, _, _, _, end = layers[i]
        return keys[:, :, :end].reshape(H, end, -1), values[:, :, :end].reshape(H, end, -1)

    def mass(i, kernels=None):
        return drop.attention_mass(layers[i][4], held(i)[0], scale, n, kernels=kernels)

    masses = [mass(i) for i in range(opts.layers)]
    mx.eval(masses)

    def evict_ops(i):
        keys, values, scores, positions, _, end = layers[i]
        k, v = held(i)
        all_scores = mx.concatenate([scores + masses[i][:, :n], masses[i][:, n:]], axis=1)
        all_positions = mx.concatenate([positions, mx.broadcast_to(n + mx.arange(s_len, dtype=mx.int32), (H, s_len))],
                                       axis=1)
        kept = drop.losers_and_kept(all_scores, all_positions, end - 1, cfg.budget, cfg.n_sink, cfg.recent)
        return [mx.take_along_axis(a, kept[..., None], axis=1) for a in (k, v)] + \
            [mx.take_along_axis(a, kept, axis=1) for a in (all_scores, all_positions)]

    def compress_ops(i):
        keys, values, scores, positions, queries, end = layers[i]
        state = drop.compress_drop(*held(i), scores, positions, queries, n, scale, cfg)
        spare = capacity - state.length
        return [_with_room([], a.reshape(1, H, state.length, -1), spare) for a in state[:2]] + list(state[2:])

    result = {"chunk": s_len, "rows": n + s_len,
              "mass_ops_ms": _per_layer(opts, lambda i: mass(i, kernels=False)),
              "mass_ms": _per_layer(opts, mass),
              "evict_ops_ms": _per_layer(opts, evict_ops),
              "compress_ops_ms": _per_layer(opts, compress_ops)}
    if drop.on_cuda():
        from camkv.backends import compact_cuda

        def evict_kernel(i):
            keys, values, scores, positions, _, end = layers[i]
            return compact_cuda.drop_compact(keys, values, scores, positions, masses[i], mx.array([n], mx.int32), cfg,
                                             capacity)

        def compress_kernel(i):
            keys, values, scores, positions, queries, end = layers[i]
            return drop.compress_drop_buffers(keys, values, end, scores, positions, queries, n, scale, cfg, capacity)

        result.update({"mass_kernels_ms": _per_layer(opts, lambda i: mass(i, kernels=True)),
                       "evict_kernel_ms": _per_layer(opts, evict_kernel),
                       "compress_kernel_ms": _per_layer(opts, compress_kernel)})
    return result


def measure_attention(opts, rows: int) -> dict:
    """A decode step's fused attention over `rows` rows: a view of a buffer with spare rows
    against the same rows contiguous, milliseconds per layer."""
    H, G, D = opts.heads, opts.groups, opts.head_dim
    buffers = [mx.random.normal((1, H, rows + 64, D)).astype(mx.bfloat16) for _ in range(opts.layers)]
    contiguous = [mx.contiguous(b[:, :, :rows]) for b in buffers]
    query = mx.random.normal((1, H * G, 1, D)).astype(mx.bfloat16)
    mx.eval(buffers, contiguous, query)
    scale = 1.0 / math.sqrt(D)

    def attend(keys):
        return mx.fast.scaled_dot_product_attention(query, keys, keys, scale=scale)

    return {"rows": rows,
            "view_ms": _per_layer(opts, lambda i: attend(buffers[i][:, :, :rows])),
            "contiguous_ms": _per_layer(opts, lambda i: attend(contiguous[i]))}


def main(argv=None) -> dict:
    opts = parse_args(argv)
    result = {"setup": {"layers": opts.layers, "heads": opts.heads, "groups": opts.groups, "head_dim": opts.head_dim,
                        "budget": opts.budget, "repeats": opts.repeats, "device": str(mx.default_device()),
                        "machine": platform.machine(), "mlx": mx.__version__},
              "chunks": [], "attention": []}
    for s_len in opts.chunks:
        result["chunks"].append(measure_chunk(opts, s_len))
        print({k: round(v, 4) if isinstance(v, float) else v for k, v in result["chunks"][-1].items()}, flush=True)
    for rows in (opts.budget, opts.budget + opts.budget // 8 + 1):
        result["attention"].append(measure_attention(opts, rows))
        print(result["attention"][-1], flush=True)
    save_result(result, opts.out, "profile-compress.json")
    return result


if __name__ == "__main__":
    main()
