"""Prefill time and decode step of every merge rule the command line lists, beside
dropping and mlx-lm's KVCache (full) and RotatingKVCache, side by side in one process.

Each arm is tried as a new user would: `camkv.make_prompt_cache(model, budget=B,
merge=RULE)` (every other setting its default), the prompt run through mlx-lm's
generate_step in chunks of --chunk tokens, then --steps greedy tokens. prefill: the time
to the first token; decode step: the mean time of the tokens after it (and each round's
median and slowest step: a step that compresses, once every slack + 1 tokens, shows as
the slowest where it costs more than the others). Arms take turns
round by round (the first arm moves one place each round) and the first round is a warm
round, discarded. Each arm's prefill and decode step are reported against dropping's of
the same round (the median of the paired ratios), with the goals they are held to
(prefill <= 1.25x dropping's, decode step <= 1.05x).

On an NVIDIA GPU, --ops-arms RULE ... adds the arms RULE/ops: the rule with the merge
engine's CUDA kernels (camkv.backends.merge_cuda) switched off, so its MLX operations
run every compression, and keepkv's decode steps attending through mlx-lm's attention
with a mask (not camkv's pass, camkv.quantized_attention.attend_weighed), as before
those kernels; and for a rule with votes, RULE/sdpa: only the attention as before.
Before and after in one process. --core-arms RULE ... adds RULE/core: the rule with the
compressions of its decode steps (the slack's tokens and the step's) run in the backend's
kernel core, one launch (prompt chunks stay on the engine):
camkv.backends.compress.OPERATIONS_FROM_TOKENS raised past the slack. That is where a GPU
runs every merging rule's decode compressions but keepkv's (its registry entry's
decodes_on_engine), so the arm differs from the rule's own for keepkv only.
--engine-arms RULE ... adds RULE/engine: the rule with its decode compressions on the
merge engine's MLX operations, as every rule ran them before that routing.
--unfenced-arms RULE ... adds RULE/unfenced: the rule with the nearest search's product
(losers by survivors) left inside its compression's work, where on CUDA it is otherwise
evaluated as work of its own (camkv.backends.merge_ops.FENCE_NEAREST_PRODUCT: its inputs
before it, it after, so that MLX's CUDA build records that cuBLAS product in a CUDA graph
by itself; bench/results/README.md, "The nearest search's product in a graph of its
own"; only for products of merge_ops.FENCE_FROM_PAIRS pairs or more, a prompt chunk's):
the fence's before and after in one process.
--direct-arms RULE ... adds RULE/direct: the rule with its nearest search on CUDA by
camkv.backends.merge_cuda.nearest_direct (the dot products taken in one kernel, no
matrix product; camkv.backends.merge_ops.NEAREST_WITHOUT_PRODUCT), checked first against
the product's kernel on a small problem (an arm whose check fails is left out, with the
reason, under "left_out" in the JSON).
--masked-arms RULE ... adds RULE/masked for a rule with votes: its prompt chunks attend
with the votes' log in an additive mask [B, query heads, chunk, rows]
(camkv.hook.weighed_by_votes), as before camkv.hook.weighed_block (MLX's CUDA build) and
camkv.hook.joined_block (the CPU) weighed the values instead (camkv.hook.WEIGHED_BLOCKS off).
--heads-arms RULE ... adds RULE/heads for a rule with votes: its decode steps' attention
read by a work group a query head at any row count (camkv.backends.quantized_cuda.
QUERY_HEAD_ROWS past any, QUERY_HEAD_WARPS warps); --stretches-arms RULE ... adds
RULE/stretches: read by a KV head's query heads together in stretches and a combine at any
row count (QUERY_HEAD_ROWS 0), camkv's layout past QUERY_HEAD_ROWS rows.
--profile ARM ... runs, after the timed rounds, one prompt of each arm named (any arm
of the run) under cProfile: the host's calls by their own time, where a prompt's time
goes when the device waits for the host or the host for the device (MLX's evaluations
show as the calls that wait).

    python bench/merge_speed.py --model random-demo --prompt-length 2048 --budget 256 \\
        --steps 32 --rounds 3
    python bench/merge_speed.py --model random-1b --prompt-length 8192 --budget 512 \\
        --out bench/results/merge-speed-1b.json
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import platform
import pstats
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

import camkv
from camkv import CaMConfig, merges
from camkv.eval import loading
from camkv import hook, quantized_attention
from camkv.backends import compress, merge_cuda, merge_ops, quantized_cuda
from camkv.eval.loading import cast_model
from camkv.models import RANDOM_LLAMAS

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_parts import in_turn  # noqa: E402  (the arms' rotating order, one rule for both scripts)

FULL = "full"
ROTATING = "rotating"
DROP = "drop"
MLX_LM_ARMS = (FULL, ROTATING)  # mlx-lm's own caches: no camkv hook to take out after them
OPS = "/ops"  # an arm's suffix: the rule without the merge engine's kernels, nor camkv's weighed attention
SDPA = "/sdpa"  # an arm's suffix: the rule without camkv's weighed attention (mlx-lm's, with a mask)
CORE = "/core"  # an arm's suffix: the rule with its decode compressions in the kernel core
ENGINE = "/engine"  # an arm's suffix: the rule with its decode compressions on the merge engine
UNFENCED = "/unfenced"  # an arm's suffix: the rule with its nearest search's product not evaluated alone
DIRECT = "/direct"  # an arm's suffix: the rule with its nearest search's dot products in one kernel (CUDA)
MASKED = "/masked"  # an arm's suffix: the rule's prompt chunks weighed by votes through a mask (hook.weighed_by_votes)
HEADS = "/heads"  # an arm's suffix: the rule's votes-weighed decode attention a work group a query head
STRETCHES = "/stretches"  # an arm's suffix: that attention in stretches of a KV head's query heads
PREFILL_GOAL, DECODE_GOAL = 1.25, 1.05  # most an arm may take against dropping


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random-1b",
                        help=f"a random llama ({', '.join(RANDOM_LLAMAS)}) or a model camkv.models.load "
                             "loads (default random-1b)")
    parser.add_argument("--prompt-length", type=_positive, default=8192, help="prompt tokens (default 8192)")
    parser.add_argument("--budget", type=_positive, default=512, help="rows kept per KV head (default 512)")
    parser.add_argument("--chunk", type=_positive, default=2048,
                        help="prefill chunk, mlx-lm's prefill_step_size (default 2048)")
    parser.add_argument("--steps", type=_positive, default=160, help="decode steps timed per round (default 160)")
    parser.add_argument("--rounds", type=_positive, default=3,
                        help="timed rounds, after one warm round (default 3)")
    parser.add_argument("--rules", nargs="+", default=list(merges.offered()), choices=merges.names(),
                        metavar="RULE", help="merge rules timed (default every rule the command line lists: "
                                             f"{', '.join(merges.offered())}); drop is always timed")
    parser.add_argument("--ops-arms", nargs="*", default=[], choices=merges.names(), metavar="RULE",
                        help="on an NVIDIA GPU, also time these rules as before the merge engine's CUDA kernels "
                             "and camkv's weighed decode attention (arms RULE/ops) and as before the latter alone "
                             "(RULE/sdpa) (default: none)")
    parser.add_argument("--core-arms", nargs="*", default=[], choices=merges.names(), metavar="RULE",
                        help="also time these rules with their decode compressions in the kernel core "
                             "(arms RULE/core) (default: none)")
    parser.add_argument("--engine-arms", nargs="*", default=[], choices=merges.names(), metavar="RULE",
                        help="also time these rules with their decode compressions on the merge engine's "
                             "operations, as before they moved to the kernel core (arms RULE/engine) "
                             "(default: none)")
    parser.add_argument("--unfenced-arms", nargs="*", default=[], choices=merges.names(), metavar="RULE",
                        help="also time these rules with the nearest search's product left inside their "
                             "compressions' work, not evaluated alone (arms RULE/unfenced) (default: none)")
    parser.add_argument("--direct-arms", nargs="*", default=[], choices=merges.names(), metavar="RULE",
                        help="on an NVIDIA GPU, also time these rules with the nearest search's dot products "
                             "taken in one kernel, no matrix product (arms RULE/direct) (default: none)")
    parser.add_argument("--masked-arms", nargs="*", default=[], choices=merges.names(), metavar="RULE",
                        help="rules with votes (keepkv) to run also with their prompt chunks weighed by a mask "
                             "(arms RULE/masked) (default: none)")
    parser.add_argument("--heads-arms", nargs="*", default=[], choices=merges.names(), metavar="RULE",
                        help="rules with votes (keepkv) to run also with their decode steps' attention read by a "
                             "work group a query head at any row count (quantized_cuda.QUERY_HEAD_ROWS past "
                             "any; arms RULE/heads) (default: none)")
    parser.add_argument("--stretches-arms", nargs="*", default=[], choices=merges.names(), metavar="RULE",
                        help="rules with votes (keepkv) to run also with their decode steps' attention read in "
                             "stretches of a KV head's query heads at any row count (quantized_cuda."
                             "QUERY_HEAD_ROWS 0; arms RULE/stretches) (default: none)")
    parser.add_argument("--profile", nargs="*", default=[], metavar="ARM",
                        help="after the timed rounds, one prompt of each of these arms under cProfile, its "
                             "calls by own time (default: none)")
    parser.add_argument("--out", type=Path, default=None, help="JSON file for the results (default none)")
    opts = parser.parse_args(argv)
    unknown = sorted(set(opts.profile) - set(arms_of(opts)))
    if unknown:
        parser.error(f"--profile {' '.join(unknown)}: not an arm of this run; arms: {', '.join(arms_of(opts))}")
    try:
        CaMConfig(budget=opts.budget)
    except ValueError as err:
        parser.error(f"--budget {opts.budget}: {err}")
    return opts


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def arms_of(opts) -> list[str]:
    """mlx-lm's KVCache and RotatingKVCache, dropping, the merge rules asked for, each once,
    then their arms without kernels (where the kernels run)."""
    rules = [rule for rule in dict.fromkeys(opts.rules) if rule != DROP]
    rules_before = [rule for rule in dict.fromkeys(opts.ops_arms) if rule != DROP] if merge_cuda.available() else []
    without = [rule + OPS for rule in rules_before]
    without += [rule + SDPA for rule in rules_before if merges.rule(rule).keeps_votes]  # only votes weigh attention
    without += [rule + CORE for rule in dict.fromkeys(opts.core_arms) if rule != DROP]
    without += [rule + ENGINE for rule in dict.fromkeys(opts.engine_arms) if rule != DROP]
    without += [rule + UNFENCED for rule in dict.fromkeys(opts.unfenced_arms) if rule != DROP]
    for suffix, chosen in ((MASKED, opts.masked_arms), (HEADS, opts.heads_arms), (STRETCHES, opts.stretches_arms)):
        without += [rule + suffix for rule in dict.fromkeys(chosen) if merges.rule(rule).keeps_votes]
    if merge_cuda.available():
        without += [rule + DIRECT for rule in dict.fromkeys(opts.direct_arms)
                    if merges.rule(rule).kind == merges.NEAREST]
    return [FULL, ROTATING, DROP] + rules + without


def make_cache(model, arm: str, budget: int) -> list:
    if arm == FULL:  # mlx-lm's own cache for the model, unbounded (KVCache)
        return make_prompt_cache(model)
    if arm == ROTATING:  # StreamingLLM as mlx-lm has it, with camkv's default sinks
        return [RotatingKVCache(max_size=budget, keep=CaMConfig(budget=budget).n_sink) for _ in model.layers]
    return camkv.make_prompt_cache(model, budget=budget, merge=arm.split("/")[0])


def run_arm(model, arm: str, prompt: mx.array, opts, around_steps=None, step_seconds: list | None = None
            ) -> tuple[float, float, int]:
    """(seconds to the first token, mean seconds of each decode step after it, the most
    bytes MLX held meanwhile: the model's, the caches' and the work's). around_steps: a
    pair of callables, the first called after the first token, the second after the last
    (bench/prompt_kernels.py profiles the decode steps between them); step_seconds: a list
    that takes each decode step's seconds (from one token to the next)."""
    cache = make_cache(model, arm, opts.budget)
    if merge_cuda.available():
        # The kernels' first-use check, once a process as a user's process runs it, before any
        # arm is timed: restored to "not yet" after each arm, it ran inside every merging
        # arm's timed prompt (about 20 ms at 1B on an H100, none in dropping's).
        merge_ops.kernels_pass_probe()
    switched = contextlib.ExitStack()
    # The kernels' first-use verdict stands for the process; an /ops arm sets it to "off" for its run.
    switched.enter_context(mock.patch.dict(merge_ops._probe))
    if arm.endswith(OPS):
        merge_ops._probe["failure"] = "switched off for this arm"
    for module, name, value in arm_switches(arm, opts):
        switched.enter_context(mock.patch.object(module, name, value))
    try:
        mx.reset_peak_memory()
        tick = time.perf_counter()
        tokens = generate_step(prompt, model, prompt_cache=cache, max_tokens=opts.steps + 1,
                               sampler=lambda logprobs: mx.argmax(logprobs, axis=-1), prefill_step_size=opts.chunk)
        next(tokens)
        prefilled = time.perf_counter()
        if around_steps:
            around_steps[0]()
        ends = [prefilled]
        for _ in tokens:
            ends.append(time.perf_counter())
        if around_steps:
            mx.synchronize()
            around_steps[1]()
        done = time.perf_counter()
        if step_seconds is not None:
            step_seconds += [b - a for a, b in zip(ends, ends[1:])]
    finally:
        switched.close()
        if arm not in MLX_LM_ARMS:
            camkv.remove(model)
    return prefilled - tick, (done - prefilled) / opts.steps, mx.get_peak_memory()


def arm_switches(arm: str, opts) -> list[tuple[object, str, object]]:
    """(module, name, value) of each setting an arm's suffix switches for its run (none for
    an arm without one)."""
    without_weighed = (quantized_attention, "attend_weighed", lambda *args: None)
    by_suffix = {
        OPS: [without_weighed], SDPA: [without_weighed],
        # A decode compression holds slack + 1 pending tokens; a prompt chunk more.
        CORE: [(compress, "OPERATIONS_FROM_TOKENS", CaMConfig(budget=opts.budget).slack + 2)],
        # The routing before decode compressions moved to the kernel core.
        ENGINE: [(compress, "by_operations", compress.gpu_chunk)],
        UNFENCED: [(merge_ops, "FENCE_NEAREST_PRODUCT", False)],
        DIRECT: [(merge_ops, "NEAREST_WITHOUT_PRODUCT", True)],
        MASKED: [(hook, "WEIGHED_BLOCKS", False)],
        HEADS: [(quantized_cuda, "QUERY_HEAD_ROWS", quantized_cuda.ALL_ROWS)],
        STRETCHES: [(quantized_cuda, "QUERY_HEAD_ROWS", 0)],
    }
    return next((switches for suffix, switches in by_suffix.items() if arm.endswith(suffix)), [])


PROFILED_CALLS = 15  # the calls a profile lists, by own time


def profile_prefill(model, arm: str, prompt: mx.array, opts) -> dict:
    """One prompt of arm (to its first token) under cProfile: the seconds it took and
    the PROFILED_CALLS calls of most own time, each with its count and cumulative time."""
    profiler = cProfile.Profile()
    one_step = argparse.Namespace(**{**vars(opts), "steps": 1})
    profiler.enable()
    prefill, _, _ = run_arm(model, arm, prompt, one_step)
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, primitive calls, own s, cumulative s, callers)
    top = sorted(stats.items(), key=lambda item: -item[1][2])[:PROFILED_CALLS]
    calls = [{"function": f"{Path(file).name}:{line}({name})", "calls": n, "own_ms": 1e3 * own,
              "cumulative_ms": 1e3 * cumulative} for (file, line, name), (_, n, own, cumulative, _) in top]
    print(f"{arm}: one prompt under cProfile, {1e3 * prefill:.1f} ms; calls by own time:")
    for call in calls:
        print(f"  {call['own_ms']:9.1f} ms own {call['cumulative_ms']:9.1f} ms cumulative {call['calls']:6d} "
              f"calls  {call['function']}")
    return {"prefill_ms": 1e3 * prefill, "calls": calls}


def direct_check() -> str | None:
    """Why the RULE/direct arms cannot run here (None where they can): the dot-product
    kernel's nearest survivors against the product kernel's, on random keys (no ties)."""
    rng = np.random.default_rng(0)
    losers, kept = (mx.array(rng.standard_normal((2, n, 64)).astype(np.float32)) for n in (70, 90))
    positions = mx.broadcast_to(mx.arange(90, dtype=mx.int32), (2, 90))
    try:
        want = merge_ops._nearest(losers, kept, positions, 4, False, kernels=True)
        got = merge_cuda.nearest_direct(losers, kept, *(merges.feature_norm(k) for k in (losers, kept)), positions, 4)
        same = (mx.array_equal(got[0], want[0]) and mx.array_equal(got[1], want[1])
                and mx.allclose(got[2], want[2], rtol=1e-4, atol=1e-5))
        return None if same.item() else "its nearest survivors differ from the product kernel's"
    except Exception as err:  # a kernel that does not compile here, say
        return f"{type(err).__name__}: {err}"


def runnable_arms(opts) -> tuple[list[str], dict[str, str]]:
    """arms_of(opts) less those whose check fails here, and why each of those is left out."""
    arms = arms_of(opts)
    reason = direct_check() if any(arm.endswith(DIRECT) for arm in arms) else None
    left_out = {arm: reason for arm in arms if reason is not None and arm.endswith(DIRECT)}
    for arm, why in left_out.items():
        print(f"{arm} left out: {why}", flush=True)
    return [arm for arm in arms if arm not in left_out], left_out


def measure(model, prompt: mx.array, opts, arms: list[str] | None = None) -> dict[str, dict[str, list[float]]]:
    """arm -> {"prefill_s": [...], "decode_step_s": [...], "peak_bytes": [...],
    "step_median_s": [...], "step_slowest_s": [...]}, one entry a timed round (arms:
    arms_of(opts) by default)."""
    arms = arms_of(opts) if arms is None else arms
    times = {arm: {"prefill_s": [], "decode_step_s": [], "peak_bytes": [], "step_median_s": [], "step_slowest_s": []}
             for arm in arms}
    for round_index in range(opts.rounds + 1):
        for arm in in_turn(arms, round_index):
            steps = []
            prefill, step, peak = run_arm(model, arm, prompt, opts, step_seconds=steps)
            print(f"round {round_index}{' (warm)' if round_index == 0 else ''} {arm}: prefill "
                  f"{1e3 * prefill:.1f} ms, decode step {1e3 * step:.2f} ms", flush=True)
            if round_index:
                times[arm]["prefill_s"].append(prefill)
                times[arm]["decode_step_s"].append(step)
                times[arm]["peak_bytes"].append(peak)
                times[arm]["step_median_s"].append(statistics.median(steps))
                times[arm]["step_slowest_s"].append(max(steps))
    return times


def summarize(times: dict) -> dict:
    """Medians over rounds, and each arm's paired ratios to dropping (medians over rounds)."""
    drop = times[DROP]
    out = {}
    for arm, t in times.items():
        prefill = statistics.median(a / b for a, b in zip(t["prefill_s"], drop["prefill_s"]))
        decode = statistics.median(a / b for a, b in zip(t["decode_step_s"], drop["decode_step_s"]))
        out[arm] = {"prefill_ms": 1e3 * statistics.median(t["prefill_s"]),
                    "decode_step_ms": 1e3 * statistics.median(t["decode_step_s"]),
                    "peak_mb": statistics.median(t["peak_bytes"]) / 2**20,
                    # A step's own spread: the median step and the slowest (a compression's
                    # step stands out where it costs more than the steps around it).
                    "step_median_ms": 1e3 * statistics.median(t["step_median_s"]),
                    "step_slowest_ms": 1e3 * statistics.median(t["step_slowest_s"]),
                    "prefill_vs_drop": prefill, "decode_vs_drop": decode,
                    "prefill_goal_met": prefill <= PREFILL_GOAL, "decode_goal_met": decode <= DECODE_GOAL,
                    "rounds": t}
    return out


def table(summary: dict) -> str:
    width = max(len("arm"), *map(len, summary))  # the longest arm's name sets the first column
    header = (f"{'arm':{width}s} {'prefill ms':>11s} {'x drop':>7s} {'decode ms':>10s} {'x drop':>7s} "
              f"{'median':>7s} {'slowest':>8s} {'peak MB':>9s}")
    lines = [header, "-" * len(header)]
    for arm, r in summary.items():
        marks = ("" if arm in (*MLX_LM_ARMS, DROP) else
                 f"  prefill {'ok' if r['prefill_goal_met'] else 'over'}, decode "
                 f"{'ok' if r['decode_goal_met'] else 'over'}")
        lines.append(f"{arm:{width}s} {r['prefill_ms']:11.1f} {r['prefill_vs_drop']:7.2f} {r['decode_step_ms']:10.2f} "
                     f"{r['decode_vs_drop']:7.3f} {r['step_median_ms']:7.2f} {r['step_slowest_ms']:8.2f} "
                     f"{r['peak_mb']:9.1f}{marks}")
    lines.append(f"goals against drop: prefill <= {PREFILL_GOAL}x, decode step <= {DECODE_GOAL}x "
                 "(decode ms: the mean step; median, slowest: a round's median and slowest step, ms)")
    return "\n".join(lines)


def load_model(name: str):
    """The model as the evaluation loads it, float32 on the CPU (far faster there)."""
    return cast_model(loading.load_model(name)[0], "auto")


def random_prompt(model, length: int) -> mx.array:
    """The prompt every arm runs: length tokens drawn with a fixed key from the model's
    first 1000 (or its whole vocabulary where smaller)."""
    vocab = getattr(getattr(model, "args", None), "vocab_size", 1000)
    return mx.random.randint(0, min(vocab, 1000), (length,), key=mx.random.key(0))


def main(argv=None) -> dict:
    opts = parse_args(argv)
    model = load_model(opts.model)
    prompt = random_prompt(model, opts.prompt_length)
    arms, left_out = runnable_arms(opts)
    summary = summarize(measure(model, prompt, opts, arms))
    print(table(summary))
    result = {"setup": {**vars(opts), "out": None if opts.out is None else str(opts.out),
                        "device": str(mx.default_device()), "machine": platform.machine(), "mlx": mx.__version__,
                        # MLX's settings from the environment (its CUDA graphs move a merging prompt's time)
                        "mlx_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("MLX_")},
                        "command": " ".join(["python", "bench/merge_speed.py", *(argv or sys.argv[1:])])},
              "arms": summary, "left_out": left_out}
    if opts.profile:
        result["profiles"] = {arm: profile_prefill(model, arm, prompt, opts) for arm in dict.fromkeys(opts.profile)}
    if opts.out is not None:
        opts.out.parent.mkdir(parents=True, exist_ok=True)
        opts.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    from camkv._blas import reexec_with_openblas

    reexec_with_openblas()  # the CPU's float32 matrix products by the system's OpenBLAS, where one exists
    main()
