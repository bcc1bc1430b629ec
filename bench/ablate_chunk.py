"""Where a chunk-mode call's kernel time goes, phase by phase, on a GPU backend.

Builds variants of the run-time kernel that stop (return) before each phase of
camkv_update_chunk and camkv_merge_chunk, times jit.update with each (same inputs
as bench/profile_prefill.py: a 2048-token chunk into a full cache of 512 rows, 8 KV
heads of dim 128, 4 queries per KV head), and reports each phase's time as the
difference between consecutive cuts. The variants' results are garbage; only their
times mean anything. The cuts are found by their text in the core, so a change to
those lines must update CUTS (tests/test_jit.py builds every variant against the
stub to catch that). Example (on the H200):
    python bench/ablate_chunk.py --backend cuda --out bench/results
    python bench/ablate_chunk.py --backend cuda --merge mass_weighted --chunk 65 --out bench/results
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_prefill import chunk_case, median_seconds, save_result  # noqa: E402

from camkv import CaMConfig  # noqa: E402
from camkv.backends import jit, kernel_text  # noqa: E402

# (phase that the cut leaves out, function it sits in, the line it goes before)
CUTS = [
    ("shadow build", "camkv_update_chunk", "camkv_shadow_build(r, total, g);"),
    ("chunk scores", "camkv_update_chunk", "camkv_score_chunk("),
    ("loser marking", "camkv_update_chunk", "camkv_mark_losers("),
    ("survivor lists", "camkv_update_chunk", "r.survivors = b.i32 + 3 * total;"),
    ("loser list", "camkv_merge_chunk", "m.n_losers = camkv_list_rows(r, 1, m.losers, g);"),
    ("phase 1: nearest searches", "camkv_merge_chunk", "camkv_nearest_targets(r, m, p->n_sink, g);"),
    ("phase 2: gates and shares", "camkv_merge_chunk", "int merged = camkv_gates_and_shares("),
    ("phase 3: losers by target", "camkv_merge_chunk", "camkv_group_by_target(r, m, p, r.group_counts, g);"),
    ("phase 3: blends", "camkv_merge_chunk", "camkv_blend_targets(r, m, r.values, r.Dv, g);"),
    ("compaction", "camkv_update_chunk", "camkv_compact_survivors(r, b, g);"),
]


def variant_headers(target: str) -> list[tuple[str, str]]:
    """(phase left out, kernel header that returns right before it), in kernel order."""
    header, _ = jit.target_source(target)
    variants = []
    for phase, function, anchor in CUTS:
        start = header.index(f"CAMKV_INLINE int {function}(")
        at = header.index(anchor, start)
        variants.append((phase, header[:at] + "return 0;\n" + header[at:]))
    return variants


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="cuda", choices=("cuda", "metal"), help="GPU backend")
    parser.add_argument("--chunk", type=int, default=2048, help="chunk tokens (default 2048)")
    parser.add_argument("--budget", type=int, default=512, help="rows kept per head (default 512)")
    parser.add_argument("--merge", default="drop",
                        help="merge rule (default drop; a nearest rule such as mass_weighted runs the merge phases)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per variant (default 5)")
    parser.add_argument("--out", type=Path, default=None, help="folder for ablate-chunk-<backend>.json")
    return parser.parse_args(argv)


def measure(opts) -> list[dict]:
    D, n = 128, opts.budget
    cfg = CaMConfig(budget=n, backend=opts.backend, prefill="chunk", merge=opts.merge)
    keys, queries, state, row_ids = chunk_case(8, 4, D, n, opts.chunk)
    variants = variant_headers(opts.backend) + [("(whole kernel)", jit.target_source(opts.backend)[0])]
    key = kernel_text.key(opts.backend)  # where jit keeps the backend's kernel
    saved = jit._kernels.pop(key, None)
    rows = []
    try:
        for i, (phase, header) in enumerate(variants):
            jit._kernels[key] = jit.make_kernel(opts.backend, header, name=f"camkv_ablate_{i}")
            seconds = median_seconds(
                lambda: jit.update(state, keys, keys, n, cfg, row_ids, queries, 1.0 / math.sqrt(D),
                                   target=opts.backend), opts.repeats)
            rows.append({"stops_before": phase, "update_ms": 1e3 * seconds})
    finally:
        jit._kernels.pop(key, None)
        if saved is not None:
            jit._kernels[key] = saved
    return rows


def phase_times(rows: list[dict]) -> list[dict]:
    """Each phase's time: the next cut's update time minus the cut that stops before it."""
    return [{"phase": cut["stops_before"], "ms": after["update_ms"] - cut["update_ms"]}
            for cut, after in zip(rows, rows[1:])]


def main(argv=None) -> dict:
    opts = parse_args(argv)
    rows = measure(opts)
    phases = phase_times(rows)
    print(f"jit.update of a {opts.chunk}-token chunk into {opts.budget} rows: "
          f"{rows[0]['update_ms']:.2f} ms up to the shadow build (prescoring, launch, copy-in), then")
    for phase in phases:
        print(f"  {phase['phase']:28s} {phase['ms']:8.2f} ms")
    print(f"  {'whole update':28s} {rows[-1]['update_ms']:8.2f} ms")
    result = {"cuts": rows, "phases": phases, "setup": {k: str(v) for k, v in vars(opts).items()}}
    save_result(result, opts.out, f"ablate-chunk-{opts.backend}-{opts.merge}-{opts.chunk}.json")
    return result


if __name__ == "__main__":
    main()
