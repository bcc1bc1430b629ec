"""A prompt chunk's whole update on the CPU extension, per layer: --chunk tokens into a
full cache of --budget rows (window scoring, the default), for merge="drop" and
"mass_weighted", every layer's call evaluated at once. Medians of --repeats.

    python bench/profile_chunk_cpu.py --heads 3 --head-dim 64 --groups 3   # SmolLM2-135M's layer
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_prefill import add_layer_shape_args, median_seconds, random_state  # noqa: E402

from camkv import CaMConfig, backends  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_layer_shape_args(p, groups=2)
    p.add_argument("--layers", type=int, default=4, help="layers evaluated at once (default 4)")
    p.add_argument("--chunk", type=int, default=2048, help="prompt chunk tokens (default 2048)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls after one warm-up (default 3)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    opts = parse_args(argv)
    mx.set_default_device(mx.cpu)
    H, D, n, S = opts.heads, opts.head_dim, opts.budget, opts.chunk
    update = backends.resolve("ext").update
    for merge in ("drop", "mass_weighted"):
        cfg = CaMConfig(budget=n, backend="ext", merge=merge)
        states = [random_state(H, n, D, mx.float32) for _ in range(opts.layers)]
        new = mx.random.normal((H, S, D), key=mx.random.key(99))
        queries = mx.random.normal((H, S, opts.groups, D), key=mx.random.key(98))
        row_ids = mx.arange(H, dtype=mx.uint32)
        mx.eval(states, new, queries)
        seconds = median_seconds(lambda: [update(s, new, new, n, cfg, row_ids, queries, 1 / math.sqrt(D))
                                          for s in states], opts.repeats)
        print(f"{merge:14s} chunk {S} into {n}: {seconds * 1e3 / opts.layers:8.1f} ms a layer", flush=True)


if __name__ == "__main__":
    from camkv._blas import reexec_with_openblas

    reexec_with_openblas()  # the CPU's float32 matrix products by the system's OpenBLAS, where one exists
    main()
