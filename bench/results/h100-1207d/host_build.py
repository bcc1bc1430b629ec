"""The script behind host-build-*.txt: after an 8k prompt (random 1B llama, budget 512,
chunks of 2048), STEPS greedy decode steps one at a time; for each, the host's time to
build the step's graph (the model's call and the argmax, nothing evaluated) and the whole
synchronous step (built, then evaluated). Arms in turn in one process (ARMS, default
"drop keepkv rotating drop keepkv keepkv-prof"; -prof: the build under cProfile, its
calls by own time appended). Run from the repository root on MLX's CUDA build:

    ARMS="drop keepkv drop keepkv" N=160 python3 bench/results/h100-1207d/host_build.py OUT.txt

bench/decode_parts.py is the maintained tool for the same two times (its arms camkv and
camkv-keepkv); this script is kept because these records came from it.
"""
import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import mlx.core as mx
from mlx_lm.generate import generate_step

sys.path.insert(0, "bench")
import merge_speed  # noqa: E402

import camkv  # noqa: E402
from camkv.backends import merge_ops  # noqa: E402


def timed_steps(model, cache, prompt, steps: int, profile) -> tuple[float, float]:
    """(seconds building, seconds in all) over the steps after the prompt's first token."""
    tokens = generate_step(prompt, model, prompt_cache=cache, max_tokens=1,
                           sampler=lambda logprobs: mx.argmax(logprobs, axis=-1), prefill_step_size=2048)
    y = mx.array([next(tokens)[0]])
    mx.eval(y)
    build = total = 0.0
    for _ in range(steps):
        tick = time.perf_counter()
        if profile:
            profile.enable()
        y = mx.argmax(model(y[None], cache=cache)[:, -1, :], axis=-1)
        if profile:
            profile.disable()
        built = time.perf_counter()
        mx.eval(y)
        build, total = build + built - tick, total + time.perf_counter() - tick
    return build, total


def main(out: str) -> None:
    model = merge_speed.load_model(os.environ.get("M", "random-1b"))
    prompt = merge_speed.random_prompt(model, int(os.environ.get("L", 8192)))
    steps = int(os.environ.get("N", 192))
    report = []
    for arm in os.environ.get("ARMS", "drop keepkv rotating drop keepkv keepkv-prof").split():
        name = arm.split("-")[0]
        merge_speed.run_arm(model, name, prompt, argparse.Namespace(budget=512, chunk=2048, steps=1))  # warm
        cache = merge_speed.make_cache(model, name, 512)
        if name != "rotating":
            merge_ops.kernels_pass_probe()
        profile = cProfile.Profile() if arm.endswith("prof") else None
        build, total = timed_steps(model, cache, prompt, steps, profile)
        report.append(f"{arm}: build {1e3 * build / steps:.3f} ms/step, synchronous step {1e3 * total / steps:.3f} ms")
        print(report[-1], flush=True)
        if profile:
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(30)
            report.append(text.getvalue())
        if name != "rotating":
            camkv.remove(model)
    with open(out, "w") as f:
        f.write("\n".join(report))


if __name__ == "__main__":
    main(sys.argv[1])
