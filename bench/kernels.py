"""Microbenchmark of one layer's cache update: the fused ext kernel against the
pure-MLX reference, on the CPU, in one process (warm-up, then medians).

Cases (B=1, H=8 KV heads, D=128):
  decode    one token into a full state (budget 512 and 2048), the state made by
            a prompt of `budget` random tokens (so the loser is where H2O finds it)
  decode_in_place / decode_copied
            the ext decode step when nothing else holds the state (donated, updated
            inside its buffers) and when the previous state is still held (copied)
  prefill_exact / prefill_chunk
            2048 prompt tokens into budget 512, in one call

Writes bench/results/kernels.json and bench/results/kernels.png.
Example: python bench/kernels.py --repeats 20 --ref-repeats 5
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from tqdm import tqdm

from camkv import CaMConfig, reference
from camkv.backends import ext
from camkv.rows import RowState

RESULTS = Path(__file__).resolve().parent / "results"
GOALS = {"decode_speedup": 20.0, "prefill_exact_speedup": 100.0, "chunk_over_exact": 10.0}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=8, help="KV heads H (B = 1), default 8")
    parser.add_argument("--dim", type=int, default=128, help="head dimension Dk = Dv, default 128")
    parser.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default="float16")
    parser.add_argument("--budgets", type=int, nargs="+", default=[512, 2048], help="decode budgets")
    parser.add_argument("--prompt", type=int, default=2048, help="prefill length, default 2048")
    parser.add_argument("--prefill-budget", type=int, default=512, help="budget of the prefill cases")
    parser.add_argument("--merge", default="sim_weighted", help="merge mode, default sim_weighted")
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs before each timing")
    parser.add_argument("--repeats", type=int, default=30, help="timed ext runs per case (median)")
    parser.add_argument("--ref-repeats", type=int, default=5, help="timed reference decode runs per case")
    parser.add_argument("--ref-prefill-repeats", type=int, default=1,
                        help="timed reference prefill runs (each can take minutes), default 1")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for kernels.json and kernels.png")
    return parser.parse_args(argv)


def random_rows(rng, rows, length, dim, dtype) -> mx.array:
    return mx.array(rng.standard_normal((rows, length, dim)).astype(np.float32)).astype(dtype)


def full_state(rows, n, dim, dtype, seed=0, update=None) -> RowState:
    """A state already at budget, as a real prompt leaves it: n random tokens absorbed
    in one call (scored causally, nothing evicted yet), so older tokens carry more
    attention mass and the next evictions fall just outside the recent window."""
    rng = np.random.default_rng(seed)
    cfg = CaMConfig(budget=n, prefill="chunk")
    keys, values = random_rows(rng, rows, n, dim, dtype), random_rows(rng, rows, n, dim, dtype)
    state, _ = (update or ext.update)(RowState.empty(rows, dim, dim, dtype), keys, values, 0, cfg,
                                      mx.arange(rows).astype(mx.uint32))
    state = RowState(*(mx.array(np.array(a)) if a.dtype != mx.bfloat16 else a + 0 for a in state.arrays()))
    mx.eval(state)
    return state


def time_decode(update, state, cfg, row_ids, steps, warmup, hold_previous=False) -> list[float]:
    """Seconds per decode step (each step's result feeds the next, as in generation)."""
    rows, n, dim = state.keys.shape
    rng = np.random.default_rng(1)
    tokens = [(random_rows(rng, rows, 1, dim, state.keys.dtype), random_rows(rng, rows, 1, dim, state.keys.dtype))
              for _ in range(warmup + steps)]
    mx.eval(tokens)
    times, held = [], None
    offset = n
    for i, (k, v) in enumerate(tokens):
        held = state if hold_previous else None  # a live reference blocks donation
        start = time.perf_counter()
        state, merges = update(state, k, v, offset, cfg, row_ids)
        mx.eval(state, merges)
        elapsed = time.perf_counter() - start
        offset += 1
        if i >= warmup:
            times.append(elapsed)
    del held
    return times


def time_prefill(update, cfg, rows, prompt, dim, dtype, repeats, warmup) -> list[float]:
    rng = np.random.default_rng(2)
    keys, values = random_rows(rng, rows, prompt, dim, dtype), random_rows(rng, rows, prompt, dim, dtype)
    row_ids = mx.arange(rows).astype(mx.uint32)
    times = []
    for i in range(warmup + repeats):
        state = RowState.empty(rows, dim, dim, dtype)
        start = time.perf_counter()
        state, merges = update(state, keys, values, 0, cfg, row_ids)
        mx.eval(state, merges)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def summary(times: list[float]) -> dict:
    return {"median_s": statistics.median(times), "min_s": min(times), "runs": len(times)}


def run(args) -> dict:
    mx.set_default_device(mx.cpu)
    reason = ext.unavailable_reason()
    if reason is not None:
        raise SystemExit(f"the ext backend is not usable here: {reason}")
    dtype = getattr(mx, args.dtype)
    rows = args.heads
    row_ids = mx.arange(rows).astype(mx.uint32)
    cases: dict[str, dict] = {}
    plan = [("decode", b) for b in args.budgets] + [("prefill_exact", None), ("prefill_chunk", None)]
    for kind, budget in tqdm(plan, desc="cases"):
        if kind == "decode":
            cfg = CaMConfig(budget=budget, merge=args.merge, prefill="exact")
            state = lambda: full_state(rows, budget, args.dim, dtype)  # noqa: E731
            donated = time_decode(ext.update, state(), cfg, row_ids, args.repeats, args.warmup)
            copied = time_decode(ext.update, state(), cfg, row_ids, args.repeats, args.warmup, hold_previous=True)
            ref = time_decode(reference.update, state(), cfg, row_ids, args.ref_repeats, 1)
            cases[f"decode_b{budget}"] = {
                "what": f"decode step S=1, B=1 H={rows} D={args.dim}, budget {budget} (full)",
                "ext": summary(donated),
                "ext_copied": summary(copied),
                "reference": summary(ref),
            }
        else:
            mode = kind.split("_")[1]
            cfg = CaMConfig(budget=args.prefill_budget, merge=args.merge, prefill=mode)
            ext_times = time_prefill(ext.update, cfg, rows, args.prompt, args.dim, dtype, max(3, args.repeats // 10), 1)
            ref_times = time_prefill(reference.update, cfg, rows, args.prompt, args.dim, dtype,
                                     args.ref_prefill_repeats, 0)
            cases[kind] = {
                "what": f"{mode} prefill of {args.prompt} tokens into budget {args.prefill_budget}, "
                        f"B=1 H={rows} D={args.dim}",
                "ext": summary(ext_times),
                "reference": summary(ref_times),
            }
    for case in cases.values():
        case["ratio_reference_over_ext"] = case["reference"]["median_s"] / case["ext"]["median_s"]
        if "ext_copied" in case:
            case["ratio_copied_over_in_place"] = case["ext_copied"]["median_s"] / case["ext"]["median_s"]
    return cases


def goals(cases: dict) -> dict:
    decode = min(c["ratio_reference_over_ext"] for k, c in cases.items() if k.startswith("decode"))
    exact = cases["prefill_exact"]
    chunk = cases["prefill_chunk"]
    chunk_over_exact = {
        backend: exact[backend]["median_s"] / chunk[backend]["median_s"] for backend in ("ext", "reference")
    }
    return {
        "decode_ext_speedup_min": {"value": decode, "goal": GOALS["decode_speedup"],
                                   "met": decode >= GOALS["decode_speedup"]},
        "prefill_exact_ext_speedup": {"value": exact["ratio_reference_over_ext"],
                                      "goal": GOALS["prefill_exact_speedup"],
                                      "met": exact["ratio_reference_over_ext"] >= GOALS["prefill_exact_speedup"]},
        "chunk_over_exact_same_backend": {
            "value": chunk_over_exact, "goal": GOALS["chunk_over_exact"],
            "met": {b: v >= GOALS["chunk_over_exact"] for b, v in chunk_over_exact.items()},
        },
    }


def plot(cases: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(cases)
    x = np.arange(len(names))
    ext_ms = [cases[n]["ext"]["median_s"] * 1e3 for n in names]
    ref_ms = [cases[n]["reference"]["median_s"] * 1e3 for n in names]
    copied_ms = [cases[n]["ext_copied"]["median_s"] * 1e3 if "ext_copied" in cases[n] else math.nan for n in names]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.27
    ax.bar(x - width, ref_ms, width, label="reference (pure MLX)")
    ax.bar(x, copied_ms, width, label="ext, state copied")
    ax.bar(x + width, ext_ms, width, label="ext (in place when donated)")
    for i, n in enumerate(names):
        ax.annotate(f"{cases[n]['ratio_reference_over_ext']:.0f}x", (x[i] + width, ext_ms[i]),
                    ha="center", va="bottom", fontsize=8)
    ax.set_yscale("log")
    ax.set_xticks(x, names, rotation=15)
    ax.set_ylabel("median time per call (ms, log)")
    ax.set_title("camkv update on the CPU: ext kernel vs reference")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    args = parse_args(argv)
    cases = run(args)
    result = {
        "command": "python bench/kernels.py " + " ".join(argv if argv is not None else __import__("sys").argv[1:]),
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "mlx": mx.__version__, "cpu_count": __import__("os").cpu_count()},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "cases": cases,
        "goals": goals(cases),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kernels.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(cases, args.out / "kernels.png")
    for name, case in cases.items():
        extra = f", copied {case['ext_copied']['median_s'] * 1e3:.3f} ms" if "ext_copied" in case else ""
        print(f"{name:16s} ext {case['ext']['median_s'] * 1e3:10.3f} ms{extra}, "
              f"reference {case['reference']['median_s'] * 1e3:10.1f} ms, "
              f"ratio {case['ratio_reference_over_ext']:.1f}x")
    print(json.dumps(result["goals"], indent=2))


if __name__ == "__main__":
    main()
