"""End-to-end speed and memory of generation: camkv against mlx-lm's own caches.

One run measures every arm on the same model, machine and prompts: mlx-lm's KVCache
(full), RotatingKVCache(max_size=budget, keep=4) (StreamingLLM) and camkv at each
budget with the default settings (scoring="query", through camkv's attention hook,
which each camkv trial installs and takes out again) on the best backend here.
`camkv bench` and bench/e2e.py are front ends of `main`.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from .. import backends, hook, models
from ..cache import CaMKVCache
from ..config import PREFILL_SCORING_MODES, CaMConfig
from ..distributed import kv_bytes
from .arms import Arm, CacheSettings, make_cache, release_cache
from .loading import load_model

# The arms `camkv bench` times: the full cache, StreamingLLM and camkv with its
# defaults (query scoring, merge "drop"), the same arm model `camkv eval` compares.
FULL = Arm("full", "full")
STREAMING = Arm("streamingllm", "streaming")
CAMKV = Arm("camkv", "camkv", scoring="query")


@dataclass(frozen=True)
class BenchArm:
    """An arm at one budget (None for the full cache), as one row of the results names it."""

    arm: Arm
    budget: int | None = None
    slack: int | None = None  # camkv only; None: CaMConfig's default
    prefill_scoring: str | None = None  # camkv only; None: CaMConfig's default

    @property
    def name(self) -> str:
        name = self.arm.name if self.budget is None else f"{self.arm.name}-{self.budget}"
        name = name if self.slack is None else f"{name}-slack{self.slack}"
        return name if self.prefill_scoring is None else f"{name}-{self.prefill_scoring}"


def default_arms(budgets: list[int], slacks: list[int] = (), prefill_scorings: list[str] = ()) -> list[BenchArm]:
    """The full cache, then StreamingLLM and camkv at each budget, and camkv again with each
    of `slacks` and each of `prefill_scorings`."""
    return ([BenchArm(FULL)] + [BenchArm(a, b) for a in (STREAMING, CAMKV) for b in budgets]
            + [BenchArm(CAMKV, b, slack) for b in budgets for slack in slacks]
            + [BenchArm(CAMKV, b, prefill_scoring=p) for b in budgets for p in prefill_scorings])


def cache_settings(backend: str, slack: int | None = None, prefill_scoring: str | None = None) -> CacheSettings:
    """CaMConfig's defaults (4 sinks, a quarter of the budget recent, an eighth slack and
    prefill scoring unless `slack` / `prefill_scoring` say otherwise), on `backend`;
    the StreamingLLM arm keeps the same 4 sinks."""
    defaults = CaMConfig()
    return CacheSettings(defaults.n_sink, None, defaults.window, defaults.seed, backend, slack,
                         prefill_scoring or defaults.prefill_scoring, defaults.observation_window, defaults.pool)


@dataclass
class Trial:
    prompt_s: float
    step_s: list[float] = field(default_factory=list)
    peak_bytes: int = 0
    peak_above_start: int = 0  # the peak less what was in use when the trial began
    kv_bytes: int = 0


def run_trial(model, arm: BenchArm, prompt: mx.array, gen_tokens: int, prefill_step: int, backend: str) -> Trial:
    """Prefill the prompt in chunks, then generate greedily, timing each part."""
    cache = make_cache(model, arm.arm, arm.budget, cache_settings(backend, arm.slack, arm.prefill_scoring))
    try:
        return _timed_generation(model, cache, prompt, gen_tokens, prefill_step)
    finally:
        release_cache(model, arm.arm)  # camkv's arm installed the hook; the others run without it


def _timed_generation(model, cache: list, prompt: mx.array, gen_tokens: int, prefill_step: int) -> Trial:
    """run_trial's measurement, on a cache list already made."""
    gc.collect()  # what earlier trials left is not this trial's memory
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    in_use = mx.get_active_memory()
    start = time.perf_counter()
    for first in range(0, prompt.size - 1, prefill_step):
        chunk = prompt[first : min(first + prefill_step, prompt.size - 1)]
        model(chunk[None], cache=cache)
        mx.eval([c.state for c in cache])
    logits = model(prompt[-1:][None], cache=cache)
    token = mx.argmax(logits[:, -1], axis=-1)
    mx.eval(token)
    trial = Trial(prompt_s=time.perf_counter() - start)
    for _ in range(gen_tokens):
        tick = time.perf_counter()
        logits = model(token[None], cache=cache)
        token = mx.argmax(logits[:, -1], axis=-1)
        mx.eval(token)
        trial.step_s.append(time.perf_counter() - tick)
    trial.peak_bytes = mx.get_peak_memory()
    trial.peak_above_start = trial.peak_bytes - in_use
    trial.kv_bytes = kv_bytes(cache)
    return trial


def cache_update_seconds(model, budget: int, backend: str, slack: int | None = None, cycles: int = 3) -> float:
    """Mean time of one decode step's cache updates, every layer's, from a full budget
    over `cycles` compression cycles (slack + 1 steps each), compressions included.

    All layers' updates are built lazily and evaluated at once, as inside a model's
    forward pass (no synchronisation per layer). Scored with queries handed over as
    the attention hook does (the default scoring), so the hook is installed while it runs.
    """
    layer = model.layers[0].self_attn
    heads = layer.n_kv_heads
    head_dim = layer.k_proj.weight.shape[0] // heads
    dtype = model.layers[0].self_attn.k_proj.weight.dtype
    dtype = mx.float16 if dtype not in (mx.float16, mx.bfloat16, mx.float32) else dtype
    hook.install(model)
    try:
        caches = [CaMKVCache(CaMConfig(budget=budget, backend=backend, scoring="query", seed=i, slack=slack))
                  for i in range(len(model.layers))]
        for cache in caches:
            _update(cache, layer, mx.random.normal((1, heads, budget, head_dim)).astype(dtype))
        mx.eval([c.state for c in caches])
        step = mx.random.normal((1, heads, 1, head_dim)).astype(dtype)
        steps = cycles * (caches[0].config.slack + 1)
        times = []
        for trial in range(2 * steps):  # the first cycles compile what a compression runs
            tick = time.perf_counter()
            mx.eval([_update(cache, layer, step) for cache in caches])
            if trial >= steps:
                times.append(time.perf_counter() - tick)
    finally:
        hook.uninstall(model)
    return statistics.fmean(times)


def _update(cache: CaMKVCache, attention, block: mx.array) -> tuple:
    """One layer's update as the model makes it: keys and values, then its queries.
    Returns the keys and values the attention would read."""
    fetched = cache.update_and_fetch(block, block)
    queries = mx.repeat(block, attention.n_heads // attention.n_kv_heads, axis=1)
    cache.observe_queries(queries, attention.scale)
    return fetched


def summarize(trials: list[Trial], prompt_len: int) -> dict:
    """Medians and spreads over trials. A trial's step time is its mean (generation time
    over tokens), so the compressions of amortized eviction count where they fall."""
    steps = [statistics.fmean(t.step_s) for t in trials]
    prompts = [t.prompt_s for t in trials]
    return {
        "prompt_tokens_per_s": prompt_len / statistics.median(prompts),
        "prompt_s": {"median": statistics.median(prompts), "min": min(prompts), "max": max(prompts)},
        "gen_tokens_per_s": 1.0 / statistics.median(steps),
        "step_ms": {"median": 1e3 * statistics.median(steps), "min": 1e3 * min(steps), "max": 1e3 * max(steps)},
        "peak_bytes": max(t.peak_bytes for t in trials),
        "peak_above_start": max(t.peak_above_start for t in trials),
        "kv_bytes": trials[-1].kv_bytes,
    }


def weights_bytes(model) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def run(model, arms, prompt_lengths, gen_tokens, trials, prefill_step, backend, progress=None, vocab=None) -> dict:
    """Every arm at every prompt length; returns the JSON-able results."""
    vocab = vocab or model.args.vocab_size
    results = {"rows": []}
    for length in prompt_lengths:
        prompt = mx.random.randint(0, vocab, (length,), key=mx.random.key(length))
        for arm in arms:
            # Warm-up over two prefill steps (a full step and one onto a filled cache) and
            # as many generated tokens as a trial (camkv's compressions among them) compiles
            # what the timed trials run.
            run_trial(model, arm, prompt[: min(length, 2 * prefill_step)], gen_tokens, prefill_step, backend)
        # Arms take turns trial by trial, so a drift of the machine's speed touches them alike.
        measured = {arm.name: [] for arm in arms}
        for _ in range(trials):
            for arm in arms:
                measured[arm.name].append(run_trial(model, arm, prompt, gen_tokens, prefill_step, backend))
        for arm in arms:
            row = {"arm": arm.name, "kind": arm.arm.kind, "budget": arm.budget, "prompt_len": length}
            row.update(summarize(measured[arm.name], length))
            if arm.arm.kind == "camkv":
                update_s = cache_update_seconds(model, arm.budget, backend, arm.slack)
                row["cache_update_ms"] = 1e3 * update_s
                row["model_ms"] = row["step_ms"]["median"] - row["cache_update_ms"]
            results["rows"].append(row)
            if progress:
                progress.update(1)
    return results


def ratios(results: dict) -> list[dict]:
    """Each camkv arm against the full cache at the same prompt length."""
    full = {r["prompt_len"]: r for r in results["rows"] if r["kind"] == "full"}
    out = []
    for row in results["rows"]:
        if row["kind"] != "camkv" or row["prompt_len"] not in full:
            continue
        base = full[row["prompt_len"]]
        out.append({
            "arm": row["arm"],
            "prompt_len": row["prompt_len"],
            "gen_speed_vs_full": row["gen_tokens_per_s"] / base["gen_tokens_per_s"],
            "prefill_time_vs_full": row["prompt_s"]["median"] / base["prompt_s"]["median"],
            # Fastest trial against fastest trial: a one-off stall in one arm's few
            # trials moves a median of two or three, not the minimum.
            "prefill_time_vs_full_best": row["prompt_s"]["min"] / base["prompt_s"]["min"],
            "peak_above_weights_vs_full": (row["peak_bytes"] - results["weights_bytes"])
            / max(1, base["peak_bytes"] - results["weights_bytes"]),
            "peak_above_start_vs_full": row["peak_above_start"] / max(1, base["peak_above_start"]),
            "kv_bytes_vs_full": row["kv_bytes"] / base["kv_bytes"],
        })
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(20, 4.2))
    for arm in dict.fromkeys(r["arm"] for r in results["rows"]):
        rows = [r for r in results["rows"] if r["arm"] == arm]
        lengths = [r["prompt_len"] for r in rows]
        axes[0].plot(lengths, [r["gen_tokens_per_s"] for r in rows], marker="o", label=arm)
        axes[1].plot(lengths, [r["prompt_tokens_per_s"] for r in rows], marker="o", label=arm)
        axes[2].plot(lengths, [r["peak_bytes"] / 2**20 for r in rows], marker="o", label=arm)
    titles = ["generation tokens/s", "prompt tokens/s", "peak memory (MiB)"]
    for ax, title in zip(axes, titles):
        ax.set_title(title)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    _plot_step_split(axes[3], results)
    fig.suptitle(f"camkv end to end: {results['model']} on {results['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_step_split(ax, results: dict) -> None:
    """One decode step of the first camkv arm: the model's time and camkv's updates
    (stacked), against the full cache's whole step, per prompt length."""
    split = [r for r in results["rows"] if "cache_update_ms" in r]
    first_arm = split[0]["arm"] if split else None
    rows = [r for r in split if r["arm"] == first_arm]
    full = {r["prompt_len"]: r["step_ms"]["median"] for r in results["rows"] if r["kind"] == "full"}
    ticks = [str(r["prompt_len"]) for r in rows]
    model_ms = [max(0.0, r["model_ms"]) for r in rows]
    ax.bar(ticks, model_ms, label=f"{first_arm}: model")
    ax.bar(ticks, [r["cache_update_ms"] for r in rows], bottom=model_ms, label=f"{first_arm}: camkv updates")
    ax.plot(ticks, [full.get(r["prompt_len"], float("nan")) for r in rows], "k_", markersize=30,
            markeredgewidth=2, label="full cache: whole step")
    ax.set_title("one decode step (ms)")
    ax.set_xlabel("prompt tokens")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)


def soak(model, budget: int, tokens: int, every: int, backend: str, progress=None) -> dict:
    """Generate `tokens` tokens with camkv; sample KV bytes and peak memory as it goes."""
    cache = make_cache(model, CAMKV, budget, cache_settings(backend))
    try:
        return {"budget": budget, "samples": _soak_samples(model, cache, tokens, every, progress)}
    finally:
        release_cache(model, CAMKV)


def _soak_samples(model, cache: list, tokens: int, every: int, progress) -> list[dict]:
    """Greedy generation from one token, sampling memory every `every` tokens."""
    token = mx.array([1])
    samples = []
    mx.reset_peak_memory()
    start = time.perf_counter()
    for step in range(1, tokens + 1):
        logits = model(token[None], cache=cache)
        token = mx.argmax(logits[:, -1], axis=-1)
        mx.eval(token)
        if step % every == 0 or step == tokens:
            samples.append({
                "tokens": step, "kv_bytes": kv_bytes(cache), "peak_bytes": mx.get_peak_memory(),
                "active_bytes": mx.get_active_memory(), "seconds": time.perf_counter() - start,
            })
        if progress:
            progress.update(1)
    return samples


def plot_soak(soak_result: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = soak_result["samples"]
    x = [s["tokens"] for s in samples]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key in ("kv_bytes", "peak_bytes", "active_bytes"):
        ax.plot(x, [s[key] / 2**20 for s in samples], label=key.replace("_", " "))
    ax.set_xlabel("tokens generated")
    ax.set_ylabel("MiB")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _device_name() -> str:
    device = mx.default_device()
    if device.type == mx.gpu and mx.cuda.is_available():
        return "cuda-gpu"
    if device.type == mx.gpu:
        return "metal-gpu"
    return f"cpu ({platform.machine()})"


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(
        prog="camkv bench", description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default=models.DEFAULT_MODEL,
                        help="a random llama preset (%s), a packaged model (%s), a path or a hub id"
                        % (", ".join(models.RANDOM_LLAMAS), models.PACKAGED_NAMES))
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096],
                        help="prompt lengths in tokens (random token ids)")
    parser.add_argument("--gen-tokens", type=int, default=32, help="tokens generated per trial")
    parser.add_argument("--budgets", type=int, nargs="+", default=[512, 2048],
                        help="camkv and StreamingLLM (rotating-cache) budgets")
    parser.add_argument("--slacks", type=int, nargs="*", default=[],
                        help="also camkv arms with these slack values (rows over the budget between compressions)")
    parser.add_argument("--prefill-scorings", nargs="*", default=[], choices=PREFILL_SCORING_MODES,
                        help="also camkv arms scoring prompt chunks these ways (CaMConfig.prefill_scoring)")
    parser.add_argument("--trials", type=int, default=3, help="measured trials per arm (after a warm-up)")
    parser.add_argument("--prefill-step", type=int, default=2048, help="prompt chunk size, as mlx-lm's prefill_step_size")
    parser.add_argument("--backend", default="auto", help="camkv backend (auto picks the best here)")
    parser.add_argument("--soak", type=int, default=0, metavar="TOKENS",
                        help="also generate this many tokens with camkv at the first budget, sampling memory")
    parser.add_argument("--out", type=Path, default=Path("bench/results"), help="folder for JSON and PNG")
    parser.add_argument("--tag", default=None, help="file name stem (default: e2e-<device>-<model>)")
    return parser


def check_args(args: argparse.Namespace) -> None:
    """ValueError naming the flag, its value and what is allowed, before any model loads."""
    for name, values in (("--prompt-lengths", args.prompt_lengths), ("--budgets", args.budgets)):
        if any(v < 1 for v in values):
            raise ValueError(f"{name} must be integers >= 1, got {values}")
    for name, value in (("--gen-tokens", args.gen_tokens), ("--trials", args.trials),
                        ("--prefill-step", args.prefill_step)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if any(v < 0 for v in args.slacks):
        raise ValueError(f"--slacks must be integers >= 0, got {args.slacks}")
    for budget in args.budgets:
        try:
            CaMConfig(budget=budget, backend=args.backend)
        except ValueError as err:
            raise ValueError(f"--budgets {budget}: {err}") from None


def main(argv: list[str] | None = None, args: argparse.Namespace | None = None) -> dict:
    from tqdm import tqdm

    args = args or build_parser().parse_args(argv)
    try:
        check_args(args)
    except ValueError as err:  # status 2, as argparse gives a bad flag
        print(f"camkv bench: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    model = load_model(args.model)[0]
    arms = default_arms(args.budgets, args.slacks, args.prefill_scorings)
    device = _device_name()
    results = {
        "model": args.model, "device": device, "backend": backends.resolve_name(args.backend),
        "weights_bytes": weights_bytes(model), "gen_tokens": args.gen_tokens, "trials": args.trials,
        "prefill_step": args.prefill_step,
    }
    with tqdm(total=len(arms) * len(args.prompt_lengths), desc="bench arms") as bar:
        results.update(run(model, arms, args.prompt_lengths, args.gen_tokens, args.trials,
                           args.prefill_step, args.backend, bar))
    results["ratios"] = ratios(results)
    stem = args.tag or f"e2e-{device.split()[0]}-{args.model.replace('/', '_')}"
    args.out.mkdir(parents=True, exist_ok=True)
    if args.soak:
        with tqdm(total=args.soak, desc="soak") as bar:
            results["soak"] = soak(model, args.budgets[0], args.soak, max(1, args.soak // 100), args.backend, bar)
    (args.out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    if can_plot():
        if args.soak:
            plot_soak(results["soak"], args.out / f"{stem}-soak.png",
                      f"{args.soak} generated tokens, camkv budget {args.budgets[0]}")
        plot(results, args.out / f"{stem}.png")
    print_table(results)
    print(f"camkv bench: wrote {args.out / f'{stem}.json'}"
          + (" and its plots" if can_plot() else ""), file=sys.stderr)
    return results


def can_plot() -> bool:
    """Whether matplotlib is importable; says once that the plots are skipped if not."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        if not _NOTED:
            _NOTED.append(True)
            print("camkv bench: matplotlib is not installed: no plots, the numbers are in the "
                  "JSON file (pip install matplotlib to draw them)", file=sys.stderr)
        return False
    return True


_NOTED: list = []


def print_table(results: dict) -> None:
    print(f"{'arm':<16}{'prompt':>8}{'prompt tok/s':>14}{'gen tok/s':>11}{'peak MiB':>10}{'KV MiB':>9}")
    for r in results["rows"]:
        print(f"{r['arm']:<16}{r['prompt_len']:>8}{r['prompt_tokens_per_s']:>14.1f}"
              f"{r['gen_tokens_per_s']:>11.1f}{r['peak_bytes'] / 2**20:>10.1f}{r['kv_bytes'] / 2**20:>9.2f}")
    for q in results["ratios"]:
        print(f"{q['arm']} @ {q['prompt_len']}: generation {q['gen_speed_vs_full']:.2f}x full, "
              f"prefill time {q['prefill_time_vs_full']:.2f}x (fastest trials: "
              f"{q['prefill_time_vs_full_best']:.2f}x), peak above the trial's start "
              f"{q['peak_above_start_vs_full']:.2f}x, KV bytes {q['kv_bytes_vs_full']:.3f}x")
