"""Where one chunk-mode prefill call's time goes, per layer: the chunk's attention
mass scored as matrix products before the launch (backends._common.chunk_mass, the
GPU path's "prescoring") against the whole update (prescoring + the kernel).

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


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="auto", help="camkv backend (auto, cuda, metal, ext, reference)")
    parser.add_argument("--heads", type=int, default=8, help="KV heads (default 8)")
    parser.add_argument("--groups", type=int, default=4, help="queries per KV head (default 4)")
    parser.add_argument("--head-dim", type=int, default=128, help="head dim (default 128)")
    parser.add_argument("--budget", type=int, default=512, help="rows kept per head (default 512)")
    parser.add_argument("--chunk", type=int, default=2048, help="prefill chunk (default 2048, e2e's step)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per part (default 5)")
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
                        "rest_ms": 1e3 * (update_s - mass_s)}
    return result


def main(argv=None) -> dict:
    opts = parse_args(argv)
    parts = measure(opts)
    result = {"parts": parts, "setup": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(opts).items()},
              "device": str(mx.default_device()),
              "backend_used": backends.resolve_name(opts.backend)}
    print(f"one chunk call of {opts.chunk} tokens, per layer (ms): whole update / prescoring / the rest")
    for name, t in parts.items():
        print(f"  {name:20s} {t['update_ms']:8.2f} / {t['prescoring_ms']:8.2f} / {t['rest_ms']:8.2f}")
    save_result(result, opts.out, f"profile-prefill-{result['backend_used']}.json")
    return result


if __name__ == "__main__":
    main()
