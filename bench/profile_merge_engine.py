"""One compression by the MLX engines, rule by rule: a chunk after a full row of scored
tokens, scored by its last window of queries, evicted back to the budget by the drop
engine (camkv.backends.drop) and by the merge engine (camkv.backends.merge_ops) for every
merge rule. The engines take turns call by call, --repeats calls each after a warm one;
medians, and each rule's median ratio to the drop engine's call of the same turn.

    python bench/profile_merge_engine.py --rows 3 --head-dim 64 --budget 512 --chunk 2048
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
import numpy as np

from camkv import CaMConfig, merges
from camkv.backends import drop, ext, merge_ops


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=3, help="KV heads x batch (default 3: SmolLM2's)")
    parser.add_argument("--head-dim", type=int, default=64, help="key and value dim (default 64)")
    parser.add_argument("--queries-per-kv", type=int, default=3, help="GQA group (default 3)")
    parser.add_argument("--budget", type=int, default=512, help="rows kept (default 512)")
    parser.add_argument("--chunk", type=int, default=2048, help="tokens compressed at once (default 2048)")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per engine (default 7)")
    return parser.parse_args(argv)


def _timed(fn) -> float:
    tick = time.perf_counter()
    mx.eval(fn())
    return time.perf_counter() - tick


def _in_turn(engines: dict, repeats: int) -> dict[str, list[float]]:
    """Seconds of each engine's call, the engines taking turns call by call after one warm
    call each (allocations, and a GPU's kernels compiled), so a drift of the host's speed
    touches all alike."""
    for fn in engines.values():
        _timed(fn)
    times = {name: [] for name in engines}
    for _ in range(repeats):
        for name, fn in engines.items():
            times[name].append(_timed(fn))
    return times


def main(argv=None) -> dict:
    opts = parse_args(argv)
    rows, dim, n, s_len = opts.rows, opts.head_dim, opts.budget, opts.chunk
    rng = np.random.default_rng(0)
    keys = mx.array(rng.standard_normal((rows, n + s_len, dim)).astype(np.float32)).astype(mx.bfloat16)
    values = mx.array(rng.standard_normal((rows, n + s_len, dim)).astype(np.float32)).astype(mx.bfloat16)
    scores = mx.array(rng.uniform(0, 2, (rows, n)).astype(np.float32))
    positions = mx.broadcast_to(mx.arange(n, dtype=mx.int32), (rows, n))
    window = CaMConfig(budget=n).observation_window
    queries = mx.array(rng.standard_normal((rows, opts.queries_per_kv, window, dim)).astype(np.float32))
    row_ids, scale = mx.arange(rows).astype(mx.uint32), dim ** -0.5
    on_cpu_ext = mx.default_device() == mx.cpu and ext.unavailable_reason() is None
    preferred = ext.REDUCER if on_cpu_ext else None  # as backends.compress hands the engine on the CPU

    def cfg(rule):
        return CaMConfig(budget=n, merge=rule, scoring="query")

    engines = {"drop": lambda: drop.compress_drop(keys, values, scores, positions, queries, n, scale, cfg("drop"))}
    for rule in merges.names():
        if merges.rule(rule).kind == merges.DROP:
            continue
        votes = mx.ones((rows, n), mx.float32) if merges.rule(rule).keeps_votes else None
        settled = merge_ops.Settled(scores, positions, votes, None)
        engines[rule] = (lambda c, st: lambda: merge_ops.compress(keys, values, st, queries, n, scale, c, row_ids,
                                                                  preferred))(cfg(rule), settled)
    seconds = _in_turn(engines, opts.repeats)
    times = {}
    for rule, own in seconds.items():
        ratio = statistics.median(a / b for a, b in zip(own, seconds["drop"]))  # paired call by call
        times[rule] = {"median_ms": 1e3 * statistics.median(own), "vs_drop": ratio}
        print(f"{rule:14s} {times[rule]['median_ms']:8.1f} ms  {ratio:5.2f}x drop's (paired)")
    return {"setup": vars(opts), "device": str(mx.default_device()), "ms": times}


if __name__ == "__main__":
    from camkv._blas import reexec_with_openblas

    reexec_with_openblas()
    main()
