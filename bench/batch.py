"""Batched serving: camkv's BatchCaMKVCache against mlx-lm's BatchKVCache, side by side.

Two measurements, each arm in the same process on the same prompts:

throughput  --batch conversations of --context prompt tokens each go through mlx-lm's
            BatchGenerator at once (as `mlx_lm.server` batches them), each generating
            --gen tokens. Reports wall time, tokens per second (prompt + generated, and
            generated alone), and the KV bytes the batch holds (mlx-lm's
            prompt_cache_nbytes, the peak over the run). Arms take turns trial by trial
            after one warm-up each.

capacity    (--capacity) the largest number of concurrent requests of --capacity-context
            tokens that fit in --limit-gb of MLX memory above the loaded model: requests
            are admitted one at a time into one BatchGenerator (each prefilled alone, as
            a server admits them, then all decode together) until the run's peak memory
            (mx.get_peak_memory, prefill transients included) passes the limit
            (mx.set_memory_limit is set to it too, so MLX frees its buffer cache).

--kv-bits 4 (or 8) adds a third arm, camkv with its rows quantized (CaMConfig.bits, group
--kv-group-size), measured the same way; the JSON gives its ratios to unquantized camkv
(throughput's and capacity's camkv-4bit_vs_camkv).

Each throughput trial also reports the median wall time of a BatchGenerator step (decode
steps far outnumber prompt calls) and, with --profile, the host time spent in the batch
caches' methods per step (on a GPU, graph building the device waits for).

Slack 16 keeps camkv's peak KV within 1/8 of BatchKVCache's at 4096 tokens (the default,
budget // 8 = 64, gives 0.134; docs/batching.md, "Memory").

Prompts are random token ids (seeded): throughput and memory do not depend on the text.
Writes --out (JSON: settings, machine, every trial) and a PNG next to it.

On this repository's CPU machine (2 cores):
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python bench/batch.py --slack 16 --profile --out bench/results/batch-cpu-smollm2.json
    LD_PRELOAD=... python bench/batch.py --no-warmup --capacity-only --capacity \
        --capacity-model random-demo --limit-gb 1.5 --out bench/results/batch-cpu-capacity.json
On a GPU (meant to finish within 100 s on an H200):
    python bench/batch.py --model random-1b --slack 16 --profile --capacity --out bench/results/batch-h200.json
    python bench/batch.py --model random-1b --capacity-only --capacity --kv-bits 4 \
        --out bench/results/batch-h200-quant.json      # 16k-token requests in 2 GiB, three arms
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

import camkv
from camkv.models import load, random_llama

ARMS = ("batchkv", "camkv")


def arms_of(settings: dict) -> tuple[str, ...]:
    """The arms a run measures: ARMS, then camkv with quantized rows when --kv-bits is set,
    less those --only-arms leaves out (records without it measured all)."""
    bits = settings.get("kv_bits")
    every = ARMS + ((f"camkv-{bits}bit",) if bits else ())
    only = settings.get("only_arms")
    return tuple(arm for arm in every if not only or arm in only)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="camkv.models.load name or path, or random-tiny / random-demo / random-1b")
    p.add_argument("--batch", type=int, default=8, help="concurrent conversations (default 8)")
    p.add_argument("--context", type=int, default=4096, help="prompt tokens each (default 4096)")
    p.add_argument("--gen", type=int, default=128, help="tokens generated each (default 128)")
    p.add_argument("--budget", type=int, default=512, help="camkv budget (default 512)")
    p.add_argument("--slack", type=int, default=None, help="camkv slack (default budget // 8)")
    p.add_argument("--kv-bits", type=int, default=None, choices=(4, 8),
                   help="also an arm of camkv with its rows quantized to these bits (CaMConfig.bits)")
    p.add_argument("--kv-group-size", type=int, default=64, choices=(32, 64, 128),
                   help="quantization group of that arm (default 64)")
    p.add_argument("--only-arms", nargs="+", default=None, metavar="ARM",
                   help="measure only these of batchkv, camkv, camkv-4bit / camkv-8bit (default all; "
                        "ratios between arms are reported where both ran)")
    p.add_argument("--prefill-step", type=int, default=2048, help="prefill chunk (default 2048)")
    p.add_argument("--trials", type=int, default=1, help="timed trials per arm (default 1)")
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up runs")
    p.add_argument("--capacity", action="store_true", help="also measure the capacity (see above)")
    p.add_argument("--capacity-only", action="store_true", help="skip the throughput measurement")
    p.add_argument("--capacity-model", default=None, help="model for the capacity runs (default --model)")
    p.add_argument("--capacity-context", type=int, default=16384, help="tokens per request (default 16384)")
    p.add_argument("--limit-gb", type=float, default=2.0, help="memory limit above the model (default 2)")
    p.add_argument("--max-n", type=int, default=64,
                   help="most requests admitted (default 64; a count that reaches it is a lower bound)")
    p.add_argument("--profile", action="store_true",
                   help="also time the batch caches' methods (host clock) per decode step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True, help="JSON file to write (PNG next to it)")
    args = p.parse_args(argv)
    known = arms_of({"kv_bits": args.kv_bits})
    unknown = [arm for arm in args.only_arms or () if arm not in known]
    if unknown:
        p.error(f"--only-arms: {', '.join(unknown)} not among this run's arms {', '.join(known)} "
                "(a quantized arm needs --kv-bits)")
    return args


def load_model(name: str):
    if name.startswith("random-"):
        return random_llama(name)  # float32 on a CPU, bfloat16 on a GPU
    return load(name)[0]


def prompts_for(model, n: int, length: int, seed: int) -> list[list[int]]:
    vocab = model.args.vocab_size
    rng = random.Random(seed)
    # Token ids past the first 256 avoid byte / special tokens of real vocabularies.
    low = 256 if vocab > 512 else 0
    return [[rng.randrange(low, vocab) for _ in range(length)] for _ in range(n)]


def run_batch(model, prompts, gen: int, prefill_step: int, completion_batch: int | None = None,
              prefill_batch: int = 8) -> dict:
    """Every prompt through one BatchGenerator; wall time, tokens, peak KV bytes and memory."""
    mx.clear_cache()
    mx.reset_peak_memory()
    generator = BatchGenerator(
        model, max_tokens=gen, stop_tokens=[],
        completion_batch_size=completion_batch or len(prompts),
        prefill_batch_size=min(prefill_batch, len(prompts)), prefill_step_size=prefill_step,
    )
    start = time.perf_counter()
    generator.insert(prompts, [gen] * len(prompts))
    generated, peak_kv, kv_row_max = 0, 0, 0
    step_s, cache_s = [], []  # each call's wall time, and the cache methods' host time in it
    with generator.stats() as stats:
        while True:
            step_start, cache_before = time.perf_counter(), _CACHE_HOST_S[0]
            responses = generator.next_generated()
            if not responses:
                break
            step_s.append(time.perf_counter() - step_start)
            cache_s.append(_CACHE_HOST_S[0] - cache_before)
            generated += len(responses)
            peak_kv = max(peak_kv, generator.prompt_cache_nbytes)
            for r in responses:
                if r.finish_reason is not None:
                    kv_row_max = max(kv_row_max, sum(c.nbytes for c in r.prompt_cache))
    wall = time.perf_counter() - start
    generator.close()
    prompt_tokens = sum(len(p) for p in prompts)
    return {
        "wall_s": wall,
        "prompt_tokens": prompt_tokens,
        "generated_tokens": generated,
        "tokens_per_s": (prompt_tokens + generated) / wall,
        "prompt_tps": stats.prompt_tps,
        "generation_tps": stats.generation_tps,
        "peak_kv_bytes": peak_kv,
        "max_request_kv_bytes": kv_row_max,
        "peak_memory_bytes": mx.get_peak_memory(),
        # Median over calls: decode steps far outnumber the prompt calls.
        "decode_step_ms": 1e3 * _median(step_s),
        "cache_host_ms_per_step": 1e3 * _median(cache_s) if _PROFILING[0] else None,
        # Every call's wall time: the slow calls (prompts, compressions) beside the median.
        "call_ms": [round(1e3 * s, 3) for s in step_s],
    }


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2] if values else float("nan")


_CACHE_HOST_S = [0.0]  # host seconds spent in the batch caches' methods (--profile)
_PROFILING = [False]


def profile_caches() -> None:
    """Time (host clock) every call of the batch caches' per-layer methods: on a GPU, the
    graph building a decode step pays before the device runs (--profile)."""
    import functools

    from mlx_lm.models.cache import BatchKVCache

    from camkv.batch import BatchCaMKVCache

    def timed(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                _CACHE_HOST_S[0] += time.perf_counter() - start
        return wrapper

    for cls, names in ((BatchKVCache, ("update_and_fetch", "make_mask")),
                       (BatchCaMKVCache, ("update_and_fetch", "make_mask", "observe_queries", "attention_bias"))):
        for name in names:
            setattr(cls, name, timed(getattr(cls, name)))
    _PROFILING[0] = True


def with_arm(model, arm: str, args):
    """A context manager: the model's caches for the arm (camkv applied, or mlx-lm's own)."""
    if arm.startswith("camkv"):
        fields = {"budget": args.budget} if args.slack is None else {"budget": args.budget, "slack": args.slack}
        if arm != "camkv":  # the quantized arm
            fields.update(bits=args.kv_bits, group_size=args.kv_group_size)
        return camkv.applied(model, **fields)
    import contextlib

    return contextlib.nullcontext(model)


def throughput(model, args) -> dict:
    prompts = prompts_for(model, args.batch, args.context, args.seed)
    arms = arms_of(vars(args))
    trials = {arm: [] for arm in arms}
    if not args.no_warmup:
        warm = prompts_for(model, min(args.batch, 2), min(args.context, 2 * args.budget), args.seed + 1)
        for arm in arms:
            with with_arm(model, arm, args):
                run_batch(model, warm, min(args.gen, 8), args.prefill_step)
    for t in range(args.trials):
        for arm in arms if t % 2 == 0 else arms[::-1]:
            with with_arm(model, arm, args):
                result = run_batch(model, prompts, args.gen, args.prefill_step)
            host = result["cache_host_ms_per_step"]
            print(f"[throughput] trial {t} {arm}: {result['wall_s']:.1f} s, "
                  f"{result['tokens_per_s']:.0f} tok/s (prompt {result['prompt_tps']:.0f}, generation "
                  f"{result['generation_tps']:.1f}), decode step {result['decode_step_ms']:.1f} ms"
                  + ("" if host is None else f" ({host:.1f} ms host in the cache)")
                  + f", peak KV {result['peak_kv_bytes'] / 2**20:.1f} MiB", flush=True)
            trials[arm].append(result)
    best = {arm: max(trials[arm], key=lambda r: r["tokens_per_s"]) for arm in arms}
    quantized = {f"{arm}_vs_camkv": {key: best[arm][key] / best["camkv"][key]
                                     for key in ("tokens_per_s", "generation_tps", "peak_kv_bytes")}
                 for arm in best if arm not in ARMS and "camkv" in best}
    pair = {}
    if {"camkv", "batchkv"} <= best.keys():
        pair = {"speedup": best["camkv"]["tokens_per_s"] / best["batchkv"]["tokens_per_s"],
                "generation_speedup": best["camkv"]["generation_tps"] / best["batchkv"]["generation_tps"],
                "kv_ratio": best["camkv"]["peak_kv_bytes"] / best["batchkv"]["peak_kv_bytes"]}
    return {**quantized, **pair,
        "trials": trials,
    }


def admitted(model, arm: str, args, base: int, limit: int, log: list) -> int:
    """Admit --capacity-context-token requests one at a time into one BatchGenerator (as a
    server admits them), each decoding until the end; stop at the first request whose
    admission takes the run's peak memory past the limit. Returns how many fit."""
    prompts = prompts_for(model, args.max_n, args.capacity_context, args.seed + 2)
    mx.clear_cache()
    mx.reset_peak_memory()
    with with_arm(model, arm, args):
        generator = BatchGenerator(model, max_tokens=1 << 30, stop_tokens=[],
                                   completion_batch_size=args.max_n, prefill_batch_size=1,
                                   prefill_step_size=args.prefill_step)
        start, fitting = time.perf_counter(), 0
        for n, prompt in enumerate(prompts, start=1):
            generator.insert([prompt])
            while len(generator._generation_batch) < n:
                generator.next()
            mx.synchronize()
            used = mx.get_peak_memory() - base
            kv = generator.prompt_cache_nbytes
            log.append({"arm": arm, "n": n, "used_bytes": used, "kv_bytes": kv,
                        "elapsed_s": time.perf_counter() - start})
            print(f"[capacity] {arm} N={n}: peak {used / 2**30:.3f} GiB, KV {kv / 2**20:.1f} MiB", flush=True)
            if used > limit:
                break
            fitting = n
        generator.close()
    return fitting


def capacity(args) -> dict:
    model = load_model(args.capacity_model or args.model)
    mx.eval(model.parameters())
    mx.clear_cache()
    base = mx.get_active_memory()  # the weights
    limit = int(args.limit_gb * 2**30)
    mx.set_memory_limit(base + limit)  # MLX frees its buffer cache to stay under it
    log: list = []
    arms = arms_of(vars(args))
    result = {arm: admitted(model, arm, args, base, limit, log) for arm in arms}
    ratios = {f"{arm}_vs_camkv": result[arm] / max(result["camkv"], 1)
              for arm in arms if arm not in ARMS and "camkv" in result}
    if {"camkv", "batchkv"} <= result.keys():
        ratios["ratio"] = result["camkv"] / max(result["batchkv"], 1)
    return {"max_concurrent": result, **ratios, "runs": log,
            "model": args.capacity_model or args.model, "context": args.capacity_context,
            "limit_gb": args.limit_gb, "capped": [arm for arm, n in result.items() if n == args.max_n]}


def machine() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(),
            "mlx": mx.__version__, "device": str(mx.default_device())}
    try:
        info["device_info"] = {k: v for k, v in mx.device_info().items() if isinstance(v, (int, float, str))}
    except Exception:  # older MLX: no device_info
        pass
    return info


def _panels(record: dict) -> list[tuple[str, str, list[float]]]:
    """(title, y label, [BatchKVCache value, camkv value]) for each bar chart."""
    panels = []
    if "throughput" in record:
        t, st = record["throughput"]["trials"], record["settings"]
        best = {a: max(t[a], key=lambda r: r["tokens_per_s"]) for a in arms_of(st)}
        title = f"{st['batch']} x {st['context']} + {st['gen']} tokens"
        panels.append((title, "tokens / s (prompt + generated)", [best[a]["tokens_per_s"] for a in arms_of(st)]))
        panels.append((title, "generated tokens / s", [best[a]["generation_tps"] for a in arms_of(st)]))
        kv_ratio = record["throughput"].get("kv_ratio")
        panels.append(("peak KV" if kv_ratio is None else f"KV ratio {kv_ratio:.3f}", "peak KV MiB (batch)",
                       [best[a]["peak_kv_bytes"] / 2**20 for a in arms_of(st)]))
    if "capacity" in record:
        c = record["capacity"]
        panels.append((f"{c['model']}, {c['context']} tokens, {c['limit_gb']:g} GiB",
                       "max concurrent requests", [c["max_concurrent"][a] for a in arms_of(record["settings"])]))
    return panels


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = _panels(record)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False)
    budget, arms = record["settings"]["budget"], arms_of(record["settings"])
    names = {"batchkv": "BatchKVCache", "camkv": f"camkv {budget}"}
    labels = [names.get(a, f"camkv {budget}, {a.split('-')[-1]}") for a in arms]
    colors = [{"batchkv": "grey", "camkv": "tab:blue"}.get(a, "tab:green") for a in arms]
    for ax, (title, ylabel, values) in zip(axes[0], panels):
        ax.bar(labels, values, color=colors)
        ax.set_title(title, fontsize=9)
        ax.set_ylabel(ylabel)
    fig.suptitle(f"{record['settings']['model']} on {record['machine']['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    args = parse_args(argv)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    settings["slack"] = args.slack if args.slack is not None else args.budget // 8
    record = {"command": " ".join(sys.argv), "settings": settings, "machine": machine()}
    if args.profile:
        profile_caches()
    if not args.capacity_only:
        model = load_model(args.model)
        record["throughput"] = throughput(model, args)
        del model
    if args.capacity:
        record["capacity"] = capacity(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    plot(record, args.out.with_suffix(".png"))
    tp = record.get("throughput")
    if tp and "speedup" in tp:
        print(f"throughput camkv / BatchKVCache: {tp['speedup']:.2f}x (generation {tp['generation_speedup']:.2f}x), "
              f"KV {tp['kv_ratio']:.3f} of BatchKVCache's")
    if args.capacity:
        c = record["capacity"]
        quantized = "".join(f", {k} {v:.2f}x" for k, v in c.items() if k.endswith("_vs_camkv"))
        versus = f"camkv / BatchKVCache {c['ratio']:.1f}x" if "ratio" in c else "ratios"
        print(f"capacity: {c['max_concurrent']} ({versus}{quantized})")
    return 0


if __name__ == "__main__":
    from camkv._blas import reexec_with_openblas

    reexec_with_openblas()  # the CPU's float32 matrix products by the system's OpenBLAS, where one exists
    sys.exit(main())
