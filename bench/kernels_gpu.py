"""Microbenchmark of one layer's cache update on a GPU: the run-time kernel ("cuda" or
"metal") against the pure-MLX reference on the same GPU, in one process.

Cases (D=128, float16):
  decode_b512     one token into a full state, B=1 H=8, budget 512: microseconds per call,
                  timed two ways: each call evaluated on its own (launch, host work and
                  synchronisation included) and "pipelined" (32 chained steps built lazily
                  and evaluated once, as a layer's update runs inside a model's graph)
  decode_large    one token into a full state, B*H=64, budget 8192: effective bandwidth
                  (the state read once and written once / time) against the bandwidth of
                  an MLX copy of the same bytes, in the same run
  prefill_exact / prefill_chunk
                  4096 prompt tokens into budget 512, H=8, in one call

Writes bench/results/kernels-<backend>.json and .png. Example (on the H200):
    python bench/kernels_gpu.py --backend cuda
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels import full_state, summary, time_decode, time_prefill  # noqa: E402

from camkv import CaMConfig, backends, reference  # noqa: E402

GOALS = {"decode_speedup": 20.0, "bandwidth_fraction": 0.5, "prefill_exact_speedup": 100.0,
         "chunk_over_exact": 10.0}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="cuda", choices=("cuda", "metal"), help="GPU backend to measure")
    parser.add_argument("--prompt", type=int, default=4096, help="prefill length (default 4096)")
    parser.add_argument("--repeats", type=int, default=30, help="timed kernel runs per decode case")
    parser.add_argument("--ref-repeats", type=int, default=10, help="timed reference decode runs")
    parser.add_argument("--prefill-repeats", type=int, default=3, help="timed runs per prefill case and backend")
    parser.add_argument("--out", type=Path, default=Path("bench/results"), help="output folder")
    parser.add_argument("--cases", default="all",
                        help="comma-separated subset of decode_b512,decode_large,prefill_exact,prefill_chunk "
                             "(e.g. for a profiler run); goals and plot need all")
    return parser.parse_args(argv)


def copy_bandwidth(nbytes: int, repeats: int = 20) -> float:
    """Bytes per second MLX reaches copying an array of nbytes (read + write counted)."""
    src = mx.random.normal((nbytes // 2,)).astype(mx.float16)
    mx.eval(src)
    times = []
    for _ in range(repeats + 2):
        start = time.perf_counter()
        dst = src + 0  # an elementwise pass: read once, write once
        mx.eval(dst)
        times.append(time.perf_counter() - start)
    return 2 * nbytes / statistics.median(times[2:])


PIPELINE = 32  # chained decode steps per evaluation in the pipelined timing


def time_decode_pipelined(update, state, cfg, row_ids, trials) -> list[float]:
    """Seconds per decode step when PIPELINE chained steps are evaluated at once."""
    rows, n, dim = state.keys.shape
    tokens = [(mx.random.normal((rows, 1, dim)).astype(state.keys.dtype),
               mx.random.normal((rows, 1, dim)).astype(state.keys.dtype)) for _ in range(PIPELINE)]
    mx.eval(tokens)
    times = []
    for trial in range(trials + 1):  # the first trial warms up
        current, offset = state, n + trial * PIPELINE
        start = time.perf_counter()
        for i, (k, v) in enumerate(tokens):
            current, _ = update(current, k, v, offset + i, cfg, row_ids)
        mx.eval(current)
        if trial:
            times.append((time.perf_counter() - start) / PIPELINE)
    return times


def decode_case(update, rows, budget, repeats, ref_repeats):
    cfg = CaMConfig(budget=budget, prefill="exact")
    row_ids = mx.arange(rows).astype(mx.uint32)
    state = full_state(rows, budget, 128, mx.float16, update=update)
    kernel = time_decode(update, state, cfg, row_ids, repeats, 3)
    ref = time_decode(reference.update, state, cfg, row_ids, ref_repeats, 1) if ref_repeats else None
    piped = {"kernel": summary(time_decode_pipelined(update, state, cfg, row_ids, 5))}
    if ref_repeats:
        piped["reference"] = summary(time_decode_pipelined(reference.update, state, cfg, row_ids, 2))
        piped["ratio_reference_over_kernel"] = piped["reference"]["median_s"] / piped["kernel"]["median_s"]
    return state, kernel, ref, piped


def run(args) -> dict:
    reason = backends.available()[args.backend]
    if reason is not None:
        raise SystemExit(f"backend {args.backend!r} is not usable here: {reason}")
    update = backends.resolve(args.backend).update
    wanted = set(args.cases.split(",")) if args.cases != "all" else None
    cases = {}
    if wanted is None or "decode_b512" in wanted:
        _, kernel, ref, piped = decode_case(update, 8, 512, args.repeats, args.ref_repeats)
        cases["decode_b512"] = {"what": "decode S=1, B=1 H=8 D=128 fp16, budget 512",
                                "kernel": summary(kernel), "reference": summary(ref) if ref else None,
                                "pipelined": piped}
    if wanted is None or "decode_large" in wanted:
        state, kernel, _, piped = decode_case(update, 64, 8192, args.repeats, 0)
        state_bytes = sum(a.nbytes for a in state.arrays())
        copy_bps = copy_bandwidth(state_bytes)
        kernel_bps = 2 * state_bytes / statistics.median(kernel)
        piped_bps = 2 * state_bytes / piped["kernel"]["median_s"]
        cases["decode_large"] = {"what": "decode S=1, B*H=64 D=128 fp16, budget 8192", "kernel": summary(kernel),
                                 "state_bytes": state_bytes, "kernel_bytes_per_s": kernel_bps,
                                 "mlx_copy_bytes_per_s": copy_bps, "fraction_of_copy": kernel_bps / copy_bps,
                                 "pipelined": dict(piped, bytes_per_s=piped_bps, fraction_of_copy=piped_bps / copy_bps)}
    for mode in ("exact", "chunk"):
        if wanted is not None and f"prefill_{mode}" not in wanted:
            continue
        cfg = CaMConfig(budget=512, prefill=mode)
        k_times = time_prefill(update, cfg, 8, args.prompt, 128, mx.float16, args.prefill_repeats, 1)
        r_times = time_prefill(reference.update, cfg, 8, args.prompt, 128, mx.float16, 1, 0) if args.ref_repeats else None
        cases[f"prefill_{mode}"] = {"what": f"{mode} prefill {args.prompt} -> 512, H=8 D=128 fp16",
                                    "kernel": summary(k_times), "reference": summary(r_times) if r_times else None}
    for case in cases.values():
        if case.get("reference"):
            case["ratio_reference_over_kernel"] = case["reference"]["median_s"] / case["kernel"]["median_s"]
    return cases


def goals(cases):
    exact, chunk = cases["prefill_exact"], cases["prefill_chunk"]
    values = {
        "decode_speedup": cases["decode_b512"]["ratio_reference_over_kernel"],
        "decode_speedup_pipelined": cases["decode_b512"]["pipelined"]["ratio_reference_over_kernel"],
        "bandwidth_fraction": cases["decode_large"]["fraction_of_copy"],
        "bandwidth_fraction_pipelined": cases["decode_large"]["pipelined"]["fraction_of_copy"],
        "prefill_exact_speedup": exact["ratio_reference_over_kernel"],
        "chunk_over_exact": exact["kernel"]["median_s"] / chunk["kernel"]["median_s"],
    }
    goal_of = {k: GOALS[k.removesuffix("_pipelined")] for k in values}
    return {k: {"value": v, "goal": goal_of[k], "met": v >= goal_of[k]} for k, v in values.items()}


def plot(cases, path, backend):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in cases if cases[n].get("reference")]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [cases[n]["reference"]["median_s"] * 1e3 for n in names], 0.4, label="reference")
    ax.bar([i + 0.2 for i in x], [cases[n]["kernel"]["median_s"] * 1e3 for n in names], 0.4, label=backend)
    for i, n in enumerate(names):
        ax.annotate(f"{cases[n]['ratio_reference_over_kernel']:.0f}x",
                    (i + 0.2, cases[n]["kernel"]["median_s"] * 1e3), ha="center", va="bottom", fontsize=8)
    ax.set_yscale("log")
    ax.set_xticks(list(x), names)
    ax.set_ylabel("median ms per call (log)")
    big = cases["decode_large"]
    ax.set_title(f"camkv update on {backend}: kernel vs reference; large decode at "
                 f"{big['fraction_of_copy']:.0%} of copy bandwidth", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    cases = run(args)
    if args.cases != "all":  # a partial run (a profiler's): print, keep no files
        print(json.dumps(cases, indent=1))
        return
    result = {"command": "python bench/kernels_gpu.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "machine": {"platform": platform.platform(), "mlx": mx.__version__,
                          "device": str(mx.default_device())},
              "cases": cases, "goals": goals(cases)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"kernels-{args.backend}.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(cases, args.out / f"kernels-{args.backend}.png", args.backend)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
