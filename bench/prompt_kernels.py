"""The GPU kernels of one prompt of one arm, as Nsight Compute (ncu) times them, and
their sums by kernel name: where a merging prompt's GPU time goes beside dropping's.

The run: one warm prompt of the arm (its kernels compiled, the merge kernels' first-use
check done), then one prompt between cuProfilerStart and cuProfilerStop, so that ncu
started with --profile-from-start off times that prompt's kernels only (merge_speed's
arms and their settings; the prompt and budget as merge_speed's):

    ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum \\
        --csv --print-units base --log-file drop.csv \\
        python3 bench/prompt_kernels.py run --arm drop --model random-1b --prompt-length 8192 --budget 512
    python3 bench/prompt_kernels.py sum drop.csv mean.csv

With --decode-steps N the N decode steps after the prompt are profiled instead (the prompt
unprofiled): their kernels against the wall time of a step under the profiler.

`sum` prints, for each CSV, the kernels' count and summed duration (the device's busy
time, kernels one after another as ncu runs them) and the kernels of most time; with two
or more, the first is the base and each other's kernels are listed by how many more
launches they made than the base's.
"""

from __future__ import annotations

import argparse
import collections
import csv
import ctypes
import sys
import time
from pathlib import Path

METRIC = "gpu__time_duration.sum"
SHOWN = 20  # kernels listed by time, and by extra launches


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="one warm prompt, then one prompt between cuProfilerStart and cuProfilerStop")
    run.add_argument("--arm", default="drop", help="a merge_speed arm: full, rotating, drop, a rule, RULE/ops ... "
                                                    "(default drop)")
    run.add_argument("--model", default="random-1b", help="model (default random-1b)")
    run.add_argument("--prompt-length", type=int, default=8192, help="prompt tokens (default 8192)")
    run.add_argument("--budget", type=int, default=512, help="rows kept per KV head (default 512)")
    run.add_argument("--chunk", type=int, default=2048, help="prefill chunk (default 2048)")
    run.add_argument("--decode-steps", type=int, default=0,
                     help="profile this many decode steps after the prompt instead of the prompt (default 0: the prompt)")
    total = sub.add_parser("sum", help="sum ncu CSV logs by kernel name")
    total.add_argument("logs", nargs="+", type=Path, help="ncu --csv --print-units base logs; the first is the base")
    return parser.parse_args(argv)


def launches_in_order(log: Path, program: str = "prompt_kernels") -> list[tuple[str, float]]:
    """(kernel name: its text before the first parenthesis, nanoseconds) of each launch of
    an ncu CSV log, in launch order (lines before its header are ncu's own messages, other
    metrics are left out); a log without the header exits with status 2, program naming
    the script that read it."""
    rows = [r for r in csv.reader(log.read_text().splitlines()) if len(r) > 5]
    if not rows or "Kernel Name" not in rows[0]:
        print(f"{program}: {log} has no ncu CSV header (run ncu with --csv --log-file)", file=sys.stderr)
        raise SystemExit(2)
    head = rows[0]
    name_at, metric_at, value_at = head.index("Kernel Name"), head.index("Metric Name"), head.index("Metric Value")
    return [(row[name_at].split("(")[0], float(row[value_at].replace(",", ""))) for row in rows[1:]
            if row[metric_at] == METRIC]


def kernel_times(log: Path) -> tuple[collections.Counter, collections.Counter]:
    """Launches and nanoseconds per kernel name from an ncu CSV log."""
    launches, nanoseconds = collections.Counter(), collections.Counter()
    for name, spent in launches_in_order(log):
        launches[name] += 1
        nanoseconds[name] += spent
    return launches, nanoseconds


def summarize(logs: list[Path]) -> str:
    lines, base = [], None
    for log in logs:
        launches, ns = kernel_times(log)
        lines.append(f"{log.name}: {sum(launches.values())} kernels, {sum(ns.values()) / 1e6:.2f} ms of kernel time")
        lines += [f"  {ns[k] / 1e6:8.3f} ms {launches[k]:6d}x  {k[:100]}" for k, _ in ns.most_common(SHOWN)]
        if base is None:
            base = (log.name, launches, ns)
            continue
        name, base_launches, base_ns = base
        extra = sorted(launches.keys() | base_launches.keys(), key=lambda k: base_launches[k] - launches[k])
        lines.append(f"  more launches than {name} (count, ms):")
        lines += [f"  {launches[k] - base_launches[k]:+6d} {(ns[k] - base_ns[k]) / 1e6:+8.3f} ms  {k[:100]}"
                  for k in extra[:SHOWN] if launches[k] != base_launches[k]]
    return "\n".join(lines)


def run(opts) -> None:
    import mlx.core as mx

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import merge_speed

    model = merge_speed.load_model(opts.model)
    prompt = merge_speed.random_prompt(model, opts.prompt_length)
    one = argparse.Namespace(budget=opts.budget, chunk=opts.chunk, steps=max(1, opts.decode_steps))
    merge_speed.run_arm(model, opts.arm, prompt, one)  # warm: kernels compiled, first-use check done
    cuda = ctypes.CDLL("libcuda.so.1")
    mx.synchronize()
    if opts.decode_steps:
        # The steps' kernels only; mlx-lm queues each step before it yields the one before,
        # so the first step's kernels may fall before the start.
        step = merge_speed.run_arm(model, opts.arm, prompt, one, (cuda.cuProfilerStart, cuda.cuProfilerStop))[1]
        print(f"{opts.arm}: {opts.decode_steps} decode steps of {1e3 * step:.3f} ms each under the profiler")
        return
    tick = time.perf_counter()
    cuda.cuProfilerStart()
    prefill = merge_speed.run_arm(model, opts.arm, prompt, one)[0]
    mx.synchronize()
    cuda.cuProfilerStop()
    print(f"{opts.arm}: prompt {1e3 * prefill:.1f} ms under the profiler ({time.perf_counter() - tick:.1f} s in all)")


def main(argv=None) -> None:
    opts = parse_args(argv)
    if opts.command == "sum":
        print(summarize(opts.logs))
    else:
        run(opts)


if __name__ == "__main__":
    from camkv._blas import reexec_with_openblas

    reexec_with_openblas()  # as merge_speed: the CPU's float32 matrix products by the system's OpenBLAS
    main()
