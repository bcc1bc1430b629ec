"""Quantized rows side by side: bytes, generation speed and prefill of camkv at 8 and 4 bits.

One run, one process, the same prompts: at each --budgets value B and prompt length,
mlx-lm's RotatingKVCache(max_size=B, keep=4) (StreamingLLM), camkv at B unquantized
(today's rows) and camkv at B with its rows quantized to each of --bits, and, with
--equal-bytes, camkv 4-bit at the byte budget of the unquantized camkv (kv_bytes: a larger
budget in the same bytes), and with --tier-budget N, camkv 4-bit with a 2-bit tier of N
evicted rows a head. Prompts are prefilled in chunks of --prefill-step, then
--gen-tokens tokens generated greedily; arms take turns trial by trial after a warm-up
(camkv.eval.bench's measurement, the one `camkv bench` makes).

Reported per arm: the KV bytes held at the end (nbytes: codes, scales and biases counted)
and their ratio to the unquantized camkv at the same budget; generated tokens/s and its
ratio to RotatingKVCache's; the prompt's time and its ratio to the unquantized camkv's.

On the CPU (2 cores):
    python bench/quant.py --model smollm2-135m-instruct --prompt-lengths 4096 --budgets 512
On an H200:
    python bench/quant.py --model random-1b --prompt-lengths 4096 8192 16384 32768 --budgets 512 2048
    python bench/quant.py --model random-8b --prompt-lengths 32768 --budgets 512 2048
Writes --out/<tag>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

import camkv
from camkv import byte_budget
from camkv.config import CaMConfig
from camkv.distributed import shard_info
from camkv.eval.arms import make_cache, release_cache
from camkv.eval.bench import STREAMING, _device_name, _timed_generation, cache_settings, summarize, weights_bytes
from camkv.eval.loading import load_model


@dataclass(frozen=True)
class QuantArm:
    """One cache of the comparison: RotatingKVCache, or camkv at `bits` (None: unquantized),
    at `budget` or at the byte budget `kv_bytes`."""

    kind: str  # "rotating" or "camkv"
    budget: int
    bits: int | None = None
    kv_bytes: int | None = None
    tier_budget: int = 0  # rows a head of the low-precision tier (2-bit), 0: none

    @property
    def name(self) -> str:
        if self.kind == "rotating":
            return f"rotating-{self.budget}"
        bits = "bf" if self.bits is None else f"q{self.bits}"
        return (f"camkv-{bits}-{self.budget}" + ("" if self.kv_bytes is None else f"-bytes{self.kv_bytes}")
                + (f"-tier{self.tier_budget}" if self.tier_budget else ""))


def arms_for(budget: int, bits_options: list[int], equal_bytes: int | None, tier_budget: int = 0) -> list[QuantArm]:
    arms = [QuantArm("rotating", budget), QuantArm("camkv", budget)]
    arms += [QuantArm("camkv", budget, bits) for bits in bits_options]
    if equal_bytes is not None:
        arms.append(QuantArm("camkv", budget, 4, kv_bytes=equal_bytes))
    if tier_budget:
        arms.append(QuantArm("camkv", budget, 4, tier_budget=tier_budget))
    return arms


def unquantized_bytes(model, budget: int) -> int:
    """The most one layer of the unquantized camkv at this budget holds (budget + slack
    rows): the byte budget of the equal-bytes arm."""
    heads, k_dim, v_dim, size = byte_budget.layer_shape(model, _first_camkv_layer(model), shard_info(model))
    cfg = CaMConfig(budget=budget)
    return (cfg.budget + cfg.slack) * heads * camkv.quantized.row_bytes(k_dim, v_dim, size, None, cfg.group_size)


def _first_camkv_layer(model) -> int:
    from mlx_lm.models.cache import KVCache

    caches = model.make_cache() if hasattr(model, "make_cache") else [KVCache() for _ in model.layers]
    return next(i for i, c in enumerate(caches) if type(c) is KVCache)


def build(model, arm: QuantArm, backend: str) -> list:
    if arm.kind == "rotating":
        return make_cache(model, STREAMING, arm.budget, cache_settings(backend))
    if arm.kv_bytes is not None:
        return camkv.make_prompt_cache(model, kv_bytes=arm.kv_bytes, bits=arm.bits, backend=backend)
    fields = {"budget": arm.budget, "backend": backend, "tier_budget": arm.tier_budget}
    if arm.bits is not None:
        heads, k_dim, v_dim, _ = byte_budget.layer_shape(model, _first_camkv_layer(model), shard_info(model))
        fields.update(bits=arm.bits, group_size=byte_budget.group_for(CaMConfig(bits=arm.bits), k_dim, v_dim))
    return camkv.make_prompt_cache(model, **fields)


def trial(model, arm: QuantArm, prompt: mx.array, args):
    cache = build(model, arm, args.backend)
    try:
        result = _timed_generation(model, cache, prompt, args.gen_tokens, args.prefill_step)
        budget = next((c.config.budget for c in cache if isinstance(c, camkv.CaMKVCache)), arm.budget)
        return result, budget
    finally:
        camkv.remove(model) if arm.kind == "camkv" else release_cache(model, STREAMING)


def run(model, args) -> list[dict]:
    rows = []
    for length in args.prompt_lengths:
        prompt = mx.random.randint(0, model.args.vocab_size, (length,), key=mx.random.key(length))
        for budget in args.budgets:
            arms = arms_for(budget, args.bits, unquantized_bytes(model, budget) if args.equal_bytes else None,
                            args.tier_budget)
            for arm in arms:  # warm-up: compiles what the timed trials run
                trial(model, arm, prompt[: min(length, 2 * args.prefill_step)], args)
            measured = {arm.name: [] for arm in arms}
            budgets = {}
            for _ in range(args.trials):
                for arm in arms:
                    result, budgets[arm.name] = trial(model, arm, prompt, args)
                    measured[arm.name].append(result)
            summaries = {arm.name: summarize(measured[arm.name], length) for arm in arms}
            base, rotating = summaries[arms[1].name], summaries[arms[0].name]
            for arm in arms:
                s = summaries[arm.name]
                rows.append({
                    "arm": arm.name, "kind": arm.kind, "bits": arm.bits, "budget": budgets[arm.name],
                    "prompt_len": length, **s,
                    "kv_bytes_vs_camkv": s["kv_bytes"] / base["kv_bytes"],
                    "gen_vs_rotating": s["gen_tokens_per_s"] / rotating["gen_tokens_per_s"],
                    "prefill_vs_camkv": s["prompt_s"]["median"] / base["prompt_s"]["median"],
                })
                print(_line(rows[-1]), flush=True)
    return rows


def _line(row: dict) -> str:
    return (f"{row['prompt_len']:>6} {row['arm']:<28} budget {row['budget']:>6}  KV {row['kv_bytes'] / 2**20:8.2f} MiB "
            f"({row['kv_bytes_vs_camkv']:.3f}x camkv)  gen {row['gen_tokens_per_s']:8.1f} tok/s "
            f"({row['gen_vs_rotating']:.2f}x rotating)  prefill {row['prompt_s']['median']:.2f} s "
            f"({row['prefill_vs_camkv']:.2f}x camkv)")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random-demo", help="a random llama preset, a packaged model, a path or hub id")
    p.add_argument("--prompt-lengths", type=int, nargs="+", default=[4096])
    p.add_argument("--budgets", type=int, nargs="+", default=[512])
    p.add_argument("--bits", type=int, nargs="+", default=[8, 4], choices=(4, 8))
    p.add_argument("--equal-bytes", action="store_true",
                   help="also camkv 4-bit at the unquantized camkv's bytes (kv_bytes), a larger budget")
    p.add_argument("--tier-budget", type=int, default=0,
                   help="also camkv 4-bit with a 2-bit tier of this many evicted rows a head (0: no such arm)")
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--prefill-step", type=int, default=2048)
    p.add_argument("--backend", default="auto")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--tag", default=None, help="file name stem (default: quant-<device>-<model>)")
    args = p.parse_args(argv)
    for name in ("prompt_lengths", "budgets"):
        if any(v < 1 for v in getattr(args, name)):
            p.error(f"--{name.replace('_', '-')} must be integers >= 1, got {getattr(args, name)}")
    if args.tier_budget < 0:
        p.error(f"--tier-budget must be >= 0, got {args.tier_budget}")
    for name in ("gen_tokens", "trials", "prefill_step"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    model = load_model(args.model)[0]
    device = _device_name()
    record = {"command": " ".join(sys.argv), "model": args.model, "device": device, "mlx": mx.__version__,
              "weights_bytes": weights_bytes(model), "gen_tokens": args.gen_tokens, "trials": args.trials,
              "prefill_step": args.prefill_step, "rows": run(model, args)}
    stem = args.tag or f"quant-{device.split()[0]}-{args.model.replace('/', '_')}"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(record, indent=1))
    print(f"bench/quant.py: wrote {args.out / f'{stem}.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    from camkv._blas import reexec_with_openblas

    reexec_with_openblas()  # the CPU's float32 matrix products by the system's OpenBLAS, where one exists
    raise SystemExit(main())
