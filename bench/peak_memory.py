"""Peak memory of a prefill and a short decode, mlx-lm's full KVCache against camkv,
for several sizes of camkv's chunk-scoring blocks (camkv.mass.MASS_BYTES).

    python bench/peak_memory.py --model random-1b --prompt-lengths 1024 8192 --logit-mb 8 32 128

Each line: the peak above the memory in use before the prompt, in MiB, after the prefill
and after --gen-tokens decode steps. JSON to --out when given.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_prefill import save_result  # noqa: E402

from camkv import make_prompt_cache, mass, models, remove  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache as full_cache  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random-1b", choices=sorted(models.RANDOM_LLAMAS),
                        help="random llama preset (default random-1b)")
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=[1024], help="prompt tokens (default 1024)")
    parser.add_argument("--budget", type=int, default=512, help="camkv budget (default 512)")
    parser.add_argument("--logit-mb", type=int, nargs="+", default=[128], help="scoring block sizes (camkv.mass.MASS_BYTES), MiB (default 128)")
    parser.add_argument("--gen-tokens", type=int, default=70, help="decode steps after the prompt (default 70)")
    parser.add_argument("--prefill-step", type=int, default=2048, help="prompt chunk (default 2048)")
    parser.add_argument("--out", type=Path, default=None, help="folder for peak-memory.json")
    return parser.parse_args(argv)


def peaks(model, cache, prompt, opts) -> tuple[float, float]:
    """(MiB above the start after the prefill, after the decode steps)."""
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    start = mx.get_active_memory()
    for first in range(0, prompt.size - 1, opts.prefill_step):
        model(prompt[first: min(prompt.size - 1, first + opts.prefill_step)][None], cache=cache)
        mx.eval([c.state for c in cache])
    prefill = mx.get_peak_memory() - start
    token = prompt[-1:]
    for _ in range(opts.gen_tokens):
        token = mx.argmax(model(token[None], cache=cache)[:, -1], axis=-1)
        mx.eval(token)
    return prefill / 2**20, (mx.get_peak_memory() - start) / 2**20


def main(argv=None) -> dict:
    opts = parse_args(argv)
    model = models.random_llama(opts.model)
    mx.eval(model.parameters())
    rows = []
    for length in opts.prompt_lengths:
        prompt = mx.random.randint(0, model.args.vocab_size, (length,), key=mx.random.key(length))
        arms = [("full", None)] + [(f"camkv-{opts.budget} blocks {mb} MiB", mb) for mb in opts.logit_mb]
        for name, mb in arms:
            if mb is None:
                cache = full_cache(model)
            else:
                mass.MASS_BYTES = mb << 20
                cache = make_prompt_cache(model, budget=opts.budget)
            prefill, decode = peaks(model, cache, prompt, opts)
            remove(model)
            rows.append({"arm": name, "prompt_len": length, "peak_prefill_mib": prefill, "peak_mib": decode})
            print(f"{name:28s} {length:6d}  prefill {prefill:8.1f} MiB  with decode {decode:8.1f} MiB", flush=True)
    result = {"rows": rows, "device": str(mx.default_device()), "setup": {k: str(v) for k, v in vars(opts).items()}}
    save_result(result, opts.out, "peak-memory.json")
    return result


if __name__ == "__main__":
    from camkv._blas import reexec_with_openblas

    reexec_with_openblas()  # the CPU's float32 matrix products by the system's OpenBLAS, where one exists
    main()
