"""The MLX operations of one decode step's graph, per merge rule: a random llama's
forward pass for one token after a prompt, its caches camkv's with each rule (and
mlx-lm's RotatingKVCache), counted from MLX's own DOT export of the step's logits
without evaluating them (bench/profile_merge_engine.py's count). On a GPU each
operation that is not a view is a launch; the step's own count, not its time, so it
reads the same on any machine. Run against another checkout (PYTHONPATH=OTHER/python)
for the counts before a change.

    python bench/decode_graph.py --model random-demo --prompt-length 1200 --budget 256 --rules drop keepkv
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import RotatingKVCache

from profile_merge_engine import VIEWS, graph_operations

from camkv import CaMConfig, make_prompt_cache, merges
from camkv.models import random_llama


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random-demo", help="random llama shape (default random-demo)")
    parser.add_argument("--prompt-length", type=int, default=1200, help="prompt tokens first (default 1200)")
    parser.add_argument("--budget", type=int, default=256, help="camkv budget and RotatingKVCache size (default 256)")
    parser.add_argument("--rules", nargs="+", default=["drop", "keepkv"], choices=merges.names(),
                        help="merge rules to count (default drop keepkv)")
    parser.add_argument("--steps", type=int, default=4, help="decode steps counted after the prompt (default 4)")
    parser.add_argument("--out", type=Path, default=None, help="write the counts as JSON here (default: none)")
    return parser.parse_args(argv)


def step_counts(model, cache, prompt: mx.array, steps: int) -> list[dict]:
    """The prompt prefilled in chunks of 512, then each decode step's operations counted."""
    for first in range(0, prompt.shape[1] - 1, 512):
        model(prompt[:, first:min(first + 512, prompt.shape[1] - 1)], cache=cache)
        mx.eval([c.state for c in cache])
    token, counts = prompt[:, -1:], []
    for _ in range(steps):
        logits = model(token, cache=cache)
        ops, _ = graph_operations(logits)
        counts.append({"operations": sum(ops.values()), "launching": sum(n for op, n in ops.items() if op not in VIEWS)})
        token = mx.argmax(logits[:, -1], axis=-1)[None]
        mx.eval(token)
    return counts


def main(argv=None) -> dict:
    opts = parse_args(argv)
    model = random_llama(opts.model)
    prompt = mx.random.randint(0, model.args.vocab_size, (1, opts.prompt_length), key=mx.random.key(0))
    arms = {"rotating": lambda: [RotatingKVCache(max_size=opts.budget, keep=4) for _ in model.layers]}
    for rule in opts.rules:
        arms[rule] = (lambda r: lambda: make_prompt_cache(model, config=CaMConfig(budget=opts.budget, merge=r)))(rule)
    result = {"setup": {k: str(v) for k, v in vars(opts).items()}, "layers": len(model.layers), "steps": {}}
    for name, make in arms.items():
        counts = step_counts(model, make(), prompt, opts.steps)
        result["steps"][name] = counts
        last = counts[-1]
        print(f"{name:12s} {last['operations']:5d} operations a step, {last['launching']:5d} not views "
              f"({len(model.layers)} layers; first step {counts[0]['launching']})")
    if opts.out is not None:
        opts.out.parent.mkdir(parents=True, exist_ok=True)
        opts.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    from camkv._blas import reexec_with_openblas

    reexec_with_openblas()
    main()
