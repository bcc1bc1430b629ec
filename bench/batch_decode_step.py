"""A batch's decode step: one BatchGenerator call while N requests decode, per arm.

For each arm and each N, N requests of --context random tokens are admitted one at a
time into one mlx-lm BatchGenerator (each prefilled alone, as a server admits them),
then --warm calls run untimed and --steps calls are timed (wall clock, the device
synchronised after the last): the mean call while every request decodes. Arms:
camkv (bfloat16 rows on a GPU, float32 on the CPU) and camkv-4bit / camkv-8bit
(CaMConfig.bits), budget --budget; BatchKVCache is left out (at long contexts its step
is the attention over every token, another measurement: bench/batch.py).

Run against another checkout of camkv (PYTHONPATH=OTHER/python) to compare code
before and after a change. On the H200:
    python3 bench/batch_decode_step.py --model random-1b --context 16384 --rows 4 16
On the CPU (2 cores):
    python bench/batch_decode_step.py --model random-demo --context 1024 --rows 4 16 --group-size 32
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

import camkv
from camkv.models import random_llama

ARMS = {"camkv": None, "camkv-8bit": 8, "camkv-4bit": 4}  # arm -> CaMConfig.bits


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random-demo", help="a camkv.models.RANDOM_LLAMAS name (default random-demo)")
    p.add_argument("--arms", nargs="+", default=["camkv", "camkv-4bit"], choices=list(ARMS),
                   help="arms to time (default camkv camkv-4bit)")
    p.add_argument("--rows", nargs="+", type=int, default=[4, 16], help="requests decoding together (default 4 16)")
    p.add_argument("--context", type=int, default=1024, help="prompt tokens a request (default 1024)")
    p.add_argument("--budget", type=int, default=512, help="camkv budget (default 512)")
    p.add_argument("--group-size", type=int, default=64, choices=(32, 64, 128),
                   help="quantization group of the quantized arms (default 64)")
    p.add_argument("--warm", type=int, default=3, help="untimed calls first (default 3)")
    p.add_argument("--steps", type=int, default=20, help="timed calls (default 20)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="JSON file to write (default: none)")
    args = p.parse_args(argv)
    if min(args.rows) < 1 or args.steps < 1 or args.context < 1:
        p.error(f"--rows, --steps and --context must be at least 1, got {args.rows}, {args.steps}, {args.context}")
    return args


def one_step_ms(model, arm: str, n: int, args) -> dict:
    """Admit n requests, then the mean BatchGenerator call over args.steps (ms)."""
    rng = random.Random(args.seed + n)
    vocab = model.args.vocab_size
    prompts = [[rng.randrange(min(256, vocab // 2), vocab) for _ in range(args.context)] for _ in range(n)]
    fields = {"budget": args.budget, "bits": ARMS[arm], "group_size": args.group_size}
    with camkv.applied(model, **fields):
        generator = BatchGenerator(model, max_tokens=1 << 30, stop_tokens=[], completion_batch_size=n,
                                   prefill_batch_size=1, prefill_step_size=2048)
        start = time.perf_counter()
        generator.insert(prompts)
        while len(generator._generation_batch) < n:
            generator.next()
        mx.synchronize()
        admitted_s = time.perf_counter() - start
        for _ in range(args.warm):
            generator.next()
        mx.synchronize()
        start = time.perf_counter()
        for _ in range(args.steps):
            generator.next()
        mx.synchronize()
        step_ms = 1e3 * (time.perf_counter() - start) / args.steps
        generator.close()
    return {"arm": arm, "rows": n, "step_ms": step_ms, "admitting_s": admitted_s}


def main(argv=None) -> int:
    args = parse_args(argv)
    model = random_llama(args.model)
    results = []
    for arm in args.arms:
        for n in args.rows:
            r = one_step_ms(model, arm, n, args)
            results.append(r)
            print(f"{arm:11s} {n:3d} rows: decode call {r['step_ms']:.1f} ms (admitting took {r['admitting_s']:.1f} s)",
                  flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        record = {"command": " ".join(sys.argv), "settings": {k: str(v) for k, v in vars(args).items()},
                  "device": str(mx.default_device()), "mlx": mx.__version__, "results": results}
        args.out.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    from camkv._blas import reexec_with_openblas

    reexec_with_openblas()
    sys.exit(main())
