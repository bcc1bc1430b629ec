"""Where one decode step's cache updates spend their time: every layer's update built
lazily and evaluated at once (as inside a model's forward pass), split into its parts.

For L layers of a full budget (default: the random-1b llama of bench/e2e.py, 16 layers,
8 KV heads of dim 128, 4 queries per KV head, float16), each part is timed alone,
per layer: "build" is the host time spent constructing the graph, "step" the wall time
of build + evaluation, medians over --repeats steps.

  cache          CaMKVCache.update_and_fetch + observe_queries (what a model pays), with
                 the default slack: the median is a step that only writes its row, the
                 mean ("cache_mean", over --cycles compression cycles) includes the
                 compressions
  cache_slack0   the same with slack=0 (an eviction at every step)
  kvcache        mlx-lm's KVCache.update_and_fetch at the same rows (the floor)
  update         the backend's update() on prepared rows (no cache bookkeeping)
  kernel         (GPU backends) the bare kernel launch, parameters prepared once
  kernel+params  the bare kernel launch with its parameter block made per call
  kernel+table   the bare kernel launch with its block a row of params.params_for's table
  queries_cast   the queries' cast to float32
  nothing        an empty evaluation (the floor)

Plus a cProfile of the host side of "cache". Example (on the H200):
    python bench/profile_decode.py --backend cuda --out bench/results
    python bench/profile_decode.py --backend cuda --merge mass_weighted --slacks 0 --out bench/results
"""

from __future__ import annotations

import argparse
import cProfile
import io
import math
import platform
import pstats
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_prefill import add_layer_shape_args, random_state, save_result  # noqa: E402

from camkv import CaMConfig, CaMKVCache, backends  # noqa: E402
from camkv.backends import jit, params  # noqa: E402
from camkv.rows import RowState  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="auto", help="camkv backend (auto, cuda, metal, ext, reference)")
    parser.add_argument("--merge", default="drop",
                        help="merge rule of every part (default drop; the kernel parts run the core with it)")
    parser.add_argument("--layers", type=int, default=16, help="layers updated per step (default 16)")
    add_layer_shape_args(parser, groups=4)
    parser.add_argument("--repeats", type=int, default=30, help="timed steps per part (default 30)")
    parser.add_argument("--cycles", type=int, default=4, help="compression cycles cache_mean spans (default 4)")
    parser.add_argument("--slacks", type=int, nargs="*", default=[],
                        help="also time the mean step with these slack values")
    parser.add_argument("--out", type=Path, default=None, help="folder for profile-decode-<backend>.json")
    return parser.parse_args(argv)


def _timed(build, repeats: int, warmups: int = 3) -> dict:
    """Median and mean host-build and wall seconds of one step made by build() (returns arrays)."""
    builds, walls = [], []
    for trial in range(repeats + warmups):
        start = time.perf_counter()
        outputs = build()
        built = time.perf_counter()
        mx.eval(outputs)
        done = time.perf_counter()
        if trial >= warmups:
            builds.append(built - start)
            walls.append(done - start)
    return {"build_s": statistics.median(builds), "step_s": statistics.median(walls),
            "step_mean_s": statistics.fmean(walls)}


def measure(opts) -> dict:
    dtype = mx.float16
    H, G, D, L = opts.heads, opts.groups, opts.head_dim, opts.layers
    cfg = CaMConfig(budget=opts.budget, backend=opts.backend, merge=opts.merge)
    backend = backends.resolve(opts.backend, opts.merge)
    token = mx.random.normal((1, H, 1, D)).astype(dtype)
    queries = mx.random.normal((1, H * G, 1, D)).astype(dtype)
    scale = 1.0 / math.sqrt(D)
    mx.eval(token, queries)
    parts = {}

    # cache: the whole per-layer path a model pays, queries handed over as the hook does
    caches = _filled_caches(cfg, opts, token, scale)

    def cache_step(layers=caches):
        fetched = []
        for cache in layers:
            fetched.extend(cache.update_and_fetch(token, token))
            cache.observe_queries(queries, scale)
        return fetched

    parts["cache"] = _timed(cache_step, opts.repeats)
    # A first cycle compiles what a compression runs.
    parts["cache_mean"] = _timed(cache_step, opts.cycles * (cfg.slack + 1), warmups=cfg.slack + 1)
    for slack in opts.slacks:
        other = _filled_caches(cfg.replace(slack=slack), opts, token, scale)
        parts[f"cache_mean_slack{slack}"] = _timed(lambda: cache_step(other), opts.cycles * (slack + 1),
                                                   warmups=slack + 1)
    exact = _filled_caches(cfg.replace(slack=0), opts, token, scale)
    parts["cache_slack0"] = _timed(lambda: cache_step(exact), opts.repeats)
    full = [KVCache() for _ in range(L)]
    for c in full:
        c.update_and_fetch(*_random_block(opts, opts.budget, dtype))
    parts["kvcache"] = _timed(lambda: [a for c in full for a in c.update_and_fetch(token, token)], opts.repeats)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(cfg.slack + 1):
        mx.eval(cache_step())
    profile.disable()
    listing = io.StringIO()
    pstats.Stats(profile, stream=listing).sort_stats("tottime").print_stats(14)

    states = [random_state(H, opts.budget, D, dtype) for _ in range(L)]
    row_ids = mx.arange(H, dtype=mx.uint32)
    step_keys = token.reshape(H, 1, D)
    q_rows = queries.reshape(H, 1, G, D)
    mx.eval(states, row_ids)

    def update_step():
        out = []
        for i, state in enumerate(states):
            states[i], merges = backend.update(state, step_keys, step_keys, opts.budget, cfg, row_ids, q_rows, scale)
            out.extend([states[i].keys, merges])
        return out

    parts["update"] = _timed(update_step, opts.repeats)
    parts["queries_cast"] = _timed(lambda: [q_rows.astype(mx.float32) for _ in range(L)], opts.repeats)
    parts["nothing"] = _timed(lambda: [], opts.repeats)
    target = getattr(backend, "target", None)
    if target is not None:
        parts.update(_kernel_parts(opts, cfg, target, states, step_keys, q_rows.astype(mx.float32), row_ids, scale))
    per_layer = {name: {k: v / L for k, v in t.items()} for name, t in parts.items()}
    return {"per_layer": per_layer, "cprofile_cache": listing.getvalue()}


def _random_block(opts, rows: int, dtype):
    shape = (1, opts.heads, rows, opts.head_dim)
    return mx.random.normal(shape).astype(dtype), mx.random.normal(shape).astype(dtype)


def _filled_caches(cfg, opts, token, scale) -> list:
    """One cache a layer holding a budget of scored rows, fed queries by hand (no model here,
    so no attention hook: they are handed over as it would)."""
    caches = [CaMKVCache(cfg) for _ in range(opts.layers)]
    for cache in caches:
        cache._queries_can_come = lambda: True  # noqa: SLF001
        cache.update_and_fetch(*_random_block(opts, opts.budget, token.dtype))
        cache.observe_queries(mx.random.normal((1, opts.heads * opts.groups, opts.budget, opts.head_dim))
                              .astype(token.dtype), scale)
    mx.eval([c.state[:4] for c in caches])
    return caches


def _kernel_parts(opts, cfg, target, states, step_keys, q32, row_ids, scale) -> dict:
    """The bare launch, with the parameter block made once or per call."""
    rows, n, D = states[0].keys.shape
    strides = params.scratch_strides(False, n, 1, n, D, D)

    def fresh_block():
        return params.pack_params(cfg, rows, n, 1, D, D, opts.groups, n, opts.budget, float(scale), False, strides)

    fixed = fresh_block()
    placeholder = jit._placeholder()  # noqa: SLF001
    mx.eval(q32, fixed)

    def launch(param_block):
        out = []
        for i, s in enumerate(states):
            res = jit.launch(target, [*s.arrays(), step_keys, step_keys, q32, placeholder, row_ids, param_block], n, D,
                             strides)
            states[i] = RowState(*res[:4])
            out.extend(res[:5])
        return out

    def table_row():
        return params.params_for(cfg, rows, n, 1, D, D, opts.groups, n, opts.budget, float(scale), False, strides)

    return {"kernel": _timed(lambda: launch(fixed), opts.repeats),
            "kernel+params": _timed(lambda: launch(fresh_block()), opts.repeats),
            "kernel+table": _timed(lambda: launch(table_row()), opts.repeats)}


def main(argv=None) -> dict:
    opts = parse_args(argv)
    result = measure(opts)
    result["setup"] = {"backend": opts.backend, "layers": opts.layers, "heads": opts.heads, "groups": opts.groups,
                       "head_dim": opts.head_dim, "budget": opts.budget, "repeats": opts.repeats,
                       "device": str(mx.default_device()), "machine": platform.machine(),
                       "threads_per_row": jit.threads_per_row(),
                       "command": "python bench/profile_decode.py " + " ".join(
                           f"--{k.replace('_', '-')} {v}" for k, v in vars(opts).items() if v is not None)}
    print(f"per layer, {opts.layers} layers evaluated at once (us): build / step median / step mean")
    for name, t in result["per_layer"].items():
        print(f"  {name:14s} {1e6 * t['build_s']:8.1f} / {1e6 * t['step_s']:8.1f} / {1e6 * t['step_mean_s']:8.1f}")
    print(result["cprofile_cache"])
    save_result(result, opts.out, f"profile-decode-{opts.backend}"
                + ("" if opts.merge == "drop" else f"-{opts.merge}") + ".json")
    return result


if __name__ == "__main__":
    from camkv._blas import reexec_with_openblas

    reexec_with_openblas()  # the CPU's float32 matrix products by the system's OpenBLAS, where one exists
    main()
