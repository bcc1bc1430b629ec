"""One compression by the MLX engines, rule by rule: a chunk after a full row of scored
tokens, scored by its last window of queries, evicted back to the budget by the drop
engine (camkv.backends.drop) and by the merge engine (camkv.backends.merge_ops) for every
merge rule. The engines take turns call by call, --repeats calls each after a warm one;
medians, and each rule's median ratio to the drop engine's call of the same turn.

    python bench/profile_merge_engine.py --rows 3 --head-dim 64 --budget 512 --chunk 2048

With --graph, each engine's call is counted instead of timed: the operations of its
MLX graph (each a launch on a GPU, where a compression's time follows their number),
and how many of them are views (reshapes, slices, broadcasts, which copy nothing). Run
it against another checkout (PYTHONPATH=OTHER/python) for the counts before a change.

With --graph --kernel-graph, the merge engine is counted as it runs on an NVIDIA GPU,
anywhere: its CUDA kernels (camkv.backends.merge_cuda) each count as one operation (a
stand-in hangs their outputs on their inputs' graph, one Depends node a call, without
running them), and a kernel's outputs that start from a value (init_value) one Full
each (MLX fills each before the launch). The nearest search's fence is off while
counting (its evaluations would cut the graph; it launches nothing).
--through-cache counts each rule's compression as a cache runs it instead
(camkv.backends.compress.compress on buffers with room to decode, the survivors settled
into the cache's buffers): the launches a prompt's compression makes, copies included.

    python bench/profile_merge_engine.py --rows 8 --head-dim 64 --queries-per-kv 4 --budget 512 --chunk 2048 --graph --kernel-graph --through-cache

With --stages, each call's parts are timed too (mass, ranks, partition, gathers, targets,
gate, blends, sums; each part's inputs evaluated before it starts and its outputs after,
so a part's time is its own device work plus one synchronisation): where a rule's extra
time over dropping goes. llama-3-8B's shape on a GPU:

    python bench/profile_merge_engine.py --rows 8 --head-dim 128 --queries-per-kv 4 --budget 2048 --chunk 2048 --stages

On an NVIDIA GPU the arm drop/launch is what merge="drop" runs there (one launch,
camkv.backends.compact_cuda), and --ops-arms RULE ... adds RULE/ops: the rule without the
merge engine's kernels (camkv.backends.merge_cuda), before and after in one process.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx.utils import tree_flatten

from camkv import CaMConfig, mass, merges, policy
from camkv.backends import compact_cuda, drop, ext, mass_cuda, merge_cuda, merge_ops

# The parts of a compression --stages times: (owner, attribute, label). Parts nest (the
# targets hold the nearest search; a blend holds its sums): each is timed inclusive.
STAGES = (
    (mass, "chunk_mass", "mass"),
    (policy, "eviction_ranks", "ranks"),
    (drop, "losers_and_survivors", "partition"),
    (merge_ops.Rows, "split", "gather"),
    (merge_ops, "_targets", "targets"),
    (merge_ops, "_nearest", "nearest"),
    (merge_ops, "_merging", "gate"),
    (merge_ops, "_keep_output", "keepkv blend"),
    (merge_ops._Edges, "blend", "blend"),
    (merge_ops._Edges, "sums", "sums"),
)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=3, help="KV heads x batch (default 3: SmolLM2's)")
    parser.add_argument("--head-dim", type=int, default=64, help="key and value dim (default 64)")
    parser.add_argument("--queries-per-kv", type=int, default=3, help="GQA group (default 3)")
    parser.add_argument("--budget", type=int, default=512, help="rows kept (default 512)")
    parser.add_argument("--chunk", type=int, default=2048, help="tokens compressed at once (default 2048)")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per engine (default 7)")
    parser.add_argument("--stages", action="store_true", help="time each part of a call too (default off)")
    parser.add_argument("--graph", action="store_true",
                        help="count each call's graph operations instead of timing it (default off)")
    parser.add_argument("--kernel-graph", action="store_true",
                        help="with --graph: the merge engine with its CUDA kernels, each counted as one operation "
                             "(default off: as this device runs it)")
    parser.add_argument("--through-cache", action="store_true",
                        help="with --graph --kernel-graph: count each compression as a cache runs it, its "
                             "survivors settled into buffers with room to decode (default off: the engines' calls)")
    parser.add_argument("--host-build", action="store_true",
                        help="with --kernel-graph: time only building each call's graph (camkv's Python and MLX's "
                             "operations made, nothing evaluated: the host's share of a compression before MLX "
                             "encodes its launches), in turn, median of --repeats (default off)")
    parser.add_argument("--ops-arms", nargs="*", default=[], metavar="RULE",
                        help="on an NVIDIA GPU, also run these rules without camkv.backends.merge_cuda's kernels, "
                             "as arms RULE/ops: before and after in one process (default: none)")
    parser.add_argument("--out", type=Path, default=None, help="write the medians as JSON here (default: none)")
    return parser.parse_args(argv)


# Operations that make a view of their input, copying nothing (no launch on a GPU).
VIEWS = frozenset({"Broadcast", "ExpandDims", "Squeeze", "Reshape", "Slice", "Transpose", "AsStrided"})


def graph_operations(outputs) -> tuple[dict[str, int], int]:
    """The operations of the graph that computes outputs (not evaluated), by primitive
    name: the nodes of MLX's own DOT export of it; and the launches they make on a GPU:
    one an operation that is no view, a concatenation one copy a part (MLX's GPU
    backends copy each part into place)."""
    dot = io.StringIO()
    mx.export_to_dot(dot, *_arrays(outputs))
    text = dot.getvalue()
    counts: dict[str, int] = {}
    nodes = re.findall(r'\{ (\d+) \[label ="([^"]+)", shape=rectangle\]', text)
    for _, name in nodes:
        counts[name] = counts.get(name, 0) + 1
    launches = sum(n for op, n in counts.items() if op not in VIEWS and op != "Concatenate")
    launches += sum(len(re.findall(rf"-> {node}\n", text)) for node, name in nodes if name == "Concatenate")
    return counts, launches


_STAND_IN_SECONDS = [0.0]  # time spent inside the stand-in kernels' calls


def stand_in_kernel(**_spec):
    """mx.fast.cuda_kernel for --kernel-graph: a call's outputs are constants tied to its
    inputs by one Depends node, so each kernel call counts once and what feeds it stays in
    the graph."""
    def call(inputs, output_shapes, output_dtypes, init_value=None, **_launch):
        tick = time.perf_counter()
        # A constant scalar broadcast: a view (no launch), built alike for any size.
        outputs = [mx.broadcast_to(mx.array(0, dtype=dtype), shape) for shape, dtype in zip(output_shapes,
                                                                                           output_dtypes)]
        fills = [] if init_value is None else [mx.full(shape, init_value, dtype)
                                               for shape, dtype in zip(output_shapes, output_dtypes)]
        out = mx.depends(outputs, [a for a in inputs if isinstance(a, mx.array)] + fills)
        _STAND_IN_SECONDS[0] += time.perf_counter() - tick  # not the package's: --host-build leaves it out
        return out
    return call


def _graphs(engines: dict) -> dict[str, dict[str, int]]:
    """Each engine's call counted: operations in all, those that are views, and launches."""
    out = {}
    for name, fn in engines.items():
        counts, launches = graph_operations(fn())
        out[name] = {"operations": sum(counts.values()),
                     "views": sum(n for op, n in counts.items() if op in VIEWS), "launches": launches,
                     "by_primitive": counts}
        print(f"{name:14s} {out[name]['operations']:4d} operations, {out[name]['views']:4d} of them views, "
              f"{launches:4d} launches")
    return out


def _timed(fn) -> float:
    tick = time.perf_counter()
    mx.eval(fn())
    return time.perf_counter() - tick


def _arrays(tree) -> list:
    """Every mx.array in tree (tuples, lists, dicts, objects' attributes)."""
    if isinstance(tree, mx.array):
        return [tree]
    if hasattr(tree, "__dict__") and not isinstance(tree, type):
        tree = vars(tree)
    if isinstance(tree, (list, tuple, dict)):
        return [a for _, a in tree_flatten(tree) if isinstance(a, mx.array)]
    return []


@contextmanager
def stage_timer(spent: dict[str, float]):
    """Within it, every STAGES part adds its seconds to spent[label]: its inputs evaluated
    first, the clock stopped once its outputs are."""
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in STAGES]

    def timed(fn, label, bound):
        def wrapper(*args, **kwargs):
            mx.eval(_arrays(list(args)) + _arrays(kwargs))
            tick = time.perf_counter()
            out = fn(*args, **kwargs)
            mx.eval(_arrays(out))
            spent[label] = spent.get(label, 0.0) + time.perf_counter() - tick
            return out
        return classmethod(lambda cls, *a, **k: wrapper(cls, *a, **k)) if bound else wrapper

    for (owner, name, original), (_, _, label) in zip(saved, STAGES):
        is_classmethod = isinstance(original, classmethod)
        fn = original.__func__ if is_classmethod else original
        setattr(owner, name, timed(fn, label, is_classmethod))
    try:
        yield spent
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def _stages(engines: dict, repeats: int) -> dict[str, dict[str, float]]:
    """Median ms of each part of each engine's call, over repeats calls after a warm one."""
    out = {}
    for name, fn in engines.items():
        _timed(fn)
        runs = []
        for _ in range(repeats):
            spent: dict[str, float] = {}
            with stage_timer(spent):
                spent["whole"] = _timed(fn)
            runs.append(spent)
        labels = sorted({label for run in runs for label in run})
        out[name] = {label: 1e3 * statistics.median(run.get(label, 0.0) for run in runs) for label in labels}
    return out


def _built(fn) -> float:
    """Seconds to build fn's call, nothing evaluated, the stand-in kernels' own time left out."""
    _STAND_IN_SECONDS[0] = 0.0
    tick = time.perf_counter()
    fn()
    return time.perf_counter() - tick - _STAND_IN_SECONDS[0]


def _against_drop(seconds: dict[str, list[float]], unit: str, per_second: float, what: str) -> dict:
    """Each engine's median (in unit) and its calls paired one by one with drop's, printed."""
    out = {}
    for name, own in seconds.items():
        ratio = statistics.median(a / b for a, b in zip(own, seconds["drop"]))  # paired call by call
        out[name] = {f"median_{unit}": per_second * statistics.median(own), "vs_drop": ratio}
        print(f"{name:14s} {out[name][f'median_{unit}']:8.1f} {unit}{what}  {ratio:5.2f}x drop's (paired)")
    return out


def _in_turn(engines: dict, repeats: int, timed=_timed) -> dict[str, list[float]]:
    """Seconds of each engine's call (by timed: evaluated, or _built), the engines taking
    turns call by call after one warm call each (allocations, and a GPU's kernels
    compiled), so a drift of the host's speed touches all alike."""
    for fn in engines.values():
        timed(fn)
    times = {name: [] for name in engines}
    for _ in range(repeats):
        for name, fn in engines.items():
            times[name].append(timed(fn))
    return times


def through_cache(keys, values, scores, positions, queries, scale: float, cfg, row_ids):
    """One compression of rule cfg.merge as a cache on an NVIDIA GPU runs it: the rows
    [R, N, D] held in buffers with room to decode (one sequence, R heads), the first n
    scored, the rest the chunk (camkv.backends.compress.compress: merge="drop" its one
    launch, a merging rule the merge engine), the survivors settled into the buffers.
    Returns a call giving the arrays the cache then holds."""
    from types import SimpleNamespace

    from camkv.backends import compress
    from camkv.buffers import RowBuffers, capacity_for

    rows, held, _ = keys.shape
    settled = scores.shape[1]
    votes = mx.ones((rows, settled), mx.float32) if merges.rule(cfg.merge).keeps_votes else None
    mx.eval([a for a in (keys, values, scores, positions, votes, queries, row_ids) if a is not None])  # held, as in a cache

    def call():
        buffers = RowBuffers(capacity_for(cfg))
        buffers.keys, buffers.values = keys[None], values[None]
        buffers.held, buffers.settled, buffers.pending_start = held, settled, settled
        buffers.scores, buffers.positions, buffers.votes = scores, positions, votes
        chunk = compress.Chunk(held, queries, scale, False, cfg, row_ids)
        compress.compress(SimpleNamespace(target="cuda"), buffers, chunk)
        return buffers.arrays()
    return call


def main(argv=None) -> dict:
    opts = parse_args(argv)
    if opts.kernel_graph:  # every engine as on an NVIDIA GPU, its kernels stood in for
        mx.fast.cuda_kernel = stand_in_kernel
        drop.on_cuda = merge_cuda.available = lambda: True
        for module in (merge_cuda, compact_cuda, mass_cuda):
            module._kernels.clear()
        merge_ops._probe["failure"] = None  # the first-use check is the real kernels' (none run here)
        merge_ops.FENCE_NEAREST_PRODUCT = False  # its evaluations would cut the graph counted
    rows, dim, n, s_len = opts.rows, opts.head_dim, opts.budget, opts.chunk
    rng = np.random.default_rng(0)
    keys = mx.array(rng.standard_normal((rows, n + s_len, dim)).astype(np.float32)).astype(mx.bfloat16)
    values = mx.array(rng.standard_normal((rows, n + s_len, dim)).astype(np.float32)).astype(mx.bfloat16)
    scores = mx.array(rng.uniform(0, 2, (rows, n)).astype(np.float32))
    positions = mx.broadcast_to(mx.arange(n, dtype=mx.int32), (rows, n))
    window = CaMConfig(budget=n).observation_window
    queries = mx.array(rng.standard_normal((rows, opts.queries_per_kv, window, dim)).astype(np.float32))
    row_ids, scale = mx.arange(rows).astype(mx.uint32), dim ** -0.5
    on_cpu_ext = mx.default_device() == mx.cpu and ext.unavailable_reason() is None and not opts.kernel_graph
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
        if rule in opts.ops_arms and drop.on_cuda():
            engines[f"{rule}/ops"] = (lambda c, st: lambda: merge_ops.compress(
                keys, values, st, queries, n, scale, c, row_ids, preferred, kernels=False))(cfg(rule), settled)
    if drop.on_cuda():  # what merge="drop" runs there: one launch (backends.compact_cuda)
        buffers = keys[None], values[None]
        engines["drop/launch"] = lambda: drop.compress_drop_buffers(*buffers, n + s_len, scores, positions, queries,
                                                                    n, scale, cfg("drop"), n + 64)
    if opts.through_cache:
        engines = {rule: through_cache(keys, values, scores, positions, queries, scale, cfg(rule), row_ids)
                   for rule in merges.names() if merges.rule(rule).kind != merges.DROP or rule == "drop"}
    if opts.graph:
        result = {"setup": {k: str(v) for k, v in vars(opts).items()}, "graph": _graphs(engines)}
        _write(opts.out, result)
        return result
    if opts.host_build:
        if not opts.kernel_graph:
            raise SystemExit("profile_merge_engine: --host-build times graphs the stand-in kernels build; "
                             "add --kernel-graph")
        built = _against_drop(_in_turn(engines, opts.repeats, _built), "us", 1e6, " to build")
        result = {"setup": {k: str(v) for k, v in vars(opts).items()}, "host_build_us": built}
        _write(opts.out, result)
        return result
    times = _against_drop(_in_turn(engines, opts.repeats), "ms", 1e3, "")
    result = {"setup": {k: str(v) for k, v in vars(opts).items()}, "device": str(mx.default_device()), "ms": times}
    if opts.stages:
        result["stages_ms"] = _stages(engines, opts.repeats)
        labels = ["whole"] + [label for _, _, label in STAGES]
        print("stages, ms (inclusive; each part synchronised):")
        print(f"{'rule':14s} " + " ".join(f"{label[:9]:>9s}" for label in labels))
        for rule, parts in result["stages_ms"].items():
            print(f"{rule:14s} " + " ".join(f"{parts.get(label, 0.0):9.2f}" for label in labels))
    _write(opts.out, result)
    return result


def _write(out: Path | None, result: dict) -> None:
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    from camkv._blas import reexec_with_openblas

    reexec_with_openblas()
    main()
