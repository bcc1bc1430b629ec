"""Where a model's decode step loses time to camkv, end to end: the median step of a real
model (default random-1b) after a prompt, for caches that each add one part of camkv's
work to mlx-lm's plain caches.

  full           mlx-lm's KVCache
  rotating       mlx-lm's RotatingKVCache(budget, keep=sinks): StreamingLLM, the floor
  buffer         a bare cache that writes each step into a preallocated buffer in place and
                 returns views of the rows held, dropping back to budget rows every slack + 1
                 steps without any work (camkv's memory layout, none of its scoring)
  camkv-key      CaMKVCache scoring with keys (no attention hook, no query buffer)
  camkv-nocomp   CaMKVCache (queries, the hook) with a slack so large that no compression
                 falls in the timed steps
  camkv          CaMKVCache as configured by default
  camkv-fullway  the same with update_and_fetch's short way for decode steps of plain rows
                 turned off (every step through its checks): that way's gain, in one run
  camkv-fullhook the same with the attention hook's short way for such steps turned off
                 (every step through the hook's bias and quantized-row checks)
  camkv-q8       the same with 8-bit rows (CaMConfig.bits=8, group 32)
  camkv-q4       the same with 4-bit rows (CaMConfig.bits=4, group 32)
  camkv-q8-fused, camkv-q4-fused
                 the same with each decode step's write and attention in one launch
                 (camkv.backends.step_cuda.FUSED_STEPS on while they run; NVIDIA GPU)
  camkv-q8-fused-inline, camkv-q8-fused-w8, camkv-q8-fused-file, camkv-q8-fused-w8-file
                 camkv-q8-fused with the kernels' text inline (kernel_text.BY_FILE off;
                 by file is the default), with 8 warps reading each head's rows
                 (quantized_cuda.MAX_WHOLE_WARPS = 8) and the text inline, with the text
                 by file, or with both, in force while the arm runs
  camkv-keepkv   the same with merge="keepkv" (votes: attention weighs each row by them)

Arms take turns trial by trial (or, with --interleave, step by step within a trial); each
trial prefills the prompt, then times --steps steps: the whole step (built, evaluated,
the token read) and the time to build its graph alone. With --pipelined TOKENS the steps
run as mlx_lm.generate runs them (the next step's graph built while the device runs
this one), the arms taking turns in blocks of TOKENS tokens. With either, trial t
prefills the arms starting from the t-th (an arm prefilled first can read slower
throughout), so give as many trials as arms where the order may matter.
With --cache-host each step's calls into the caches are timed too (update_and_fetch,
observe_queries, attention_bias, make_mask): the cache's own host work per step and layer.
Run against another checkout of camkv (PYTHONPATH=OTHER/python) to compare code before
and after a change with the same script. Examples (on the H200):
    python bench/decode_parts.py --out bench/results
    python bench/decode_parts.py --model random-8b --prompt-length 65536 --budget 2048 \
        --arms rotating camkv --interleave --cache-host
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache, _BaseCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_prefill import save_result  # noqa: E402

from camkv import CaMConfig, hook, make_prompt_cache  # noqa: E402
try:  # the code before camkv.buffers (a before/after run with the old code on PYTHONPATH)
    from camkv.buffers import with_room as _with_room  # noqa: E402
except ImportError:
    from camkv.cache import _with_room  # noqa: E402
from camkv.models import random_llama  # noqa: E402

QUANTIZED_ARMS = {"camkv-q8": 8, "camkv-q4": 4}  # arm -> CaMConfig.bits (group 32)
FUSED_ARMS = {"camkv-q8-fused": 8, "camkv-q4-fused": 4,  # the same, steps in one launch
              "camkv-q8-fused-inline": 8, "camkv-q8-fused-w8": 8, "camkv-q8-fused-file": 8,
              "camkv-q8-fused-w8-file": 8}
# An arm's settings of camkv's CUDA kernels, in force while it prefills and steps:
# (module name in camkv.backends, attribute) -> value. Every fused arm's steps fuse where
# the launch takes them, whatever step_cuda.FUSED_STEPS's default.
_FUSED = {("step_cuda", "FUSED_STEPS"): True}
_INLINE, _FILE = {("kernel_text", "BY_FILE"): False}, {("kernel_text", "BY_FILE"): True}
_W8 = {("quantized_cuda", "MAX_WHOLE_WARPS"): 8}
ARM_SETTINGS = {
    "camkv-q8-fused": _FUSED, "camkv-q4-fused": _FUSED,
    "camkv-q8-fused-inline": {**_FUSED, **_INLINE},
    "camkv-q8-fused-w8": {**_FUSED, **_W8, **_INLINE},
    "camkv-q8-fused-file": {**_FUSED, **_FILE},
    "camkv-q8-fused-w8-file": {**_FUSED, **_W8, **_FILE},
}
ARMS = ("full", "rotating", "buffer", "camkv-key", "camkv-nocomp", "camkv", "camkv-fullway", "camkv-fullhook",
        *QUANTIZED_ARMS, *FUSED_ARMS, "camkv-keepkv")
# arms that run only when named
ASKED_FOR_ONLY = (*QUANTIZED_ARMS, *FUSED_ARMS, "camkv-fullway", "camkv-fullhook", "camkv-keepkv")


class BufferCache(_BaseCache):
    """camkv's decode-time memory layout without its scoring: rows written in place into a
    [B, H, budget + slack + 1, D] buffer, views of the rows held returned, and every
    slack + 1 steps the count of rows held reset to the budget (no copy, no scoring)."""

    def __init__(self, budget: int, slack: int):
        self.budget, self.slack = budget, slack
        self.keys = self.values = None
        self.held = self.offset = 0

    def update_and_fetch(self, keys, values):
        S, capacity = keys.shape[2], self.budget + self.slack + 1
        self.offset += S
        if S > 1 or self.keys is None:  # a prompt chunk: attend over all, keep the newest budget rows
            held = [keys, values] if self.keys is None else [
                mx.concatenate([old[:, :, : self.held], new], axis=2)
                for old, new in ((self.keys, keys), (self.values, values))]
            self.held = min(self.budget, held[0].shape[2])
            self.keys, self.values = (_with_room([], a[:, :, -self.held:], capacity - self.held) for a in held)
            return held
        if self.held == capacity:
            self.held = self.budget  # a "compression" that does no work
        self.keys[:, :, self.held: self.held + 1] = keys
        self.values[:, :, self.held: self.held + 1] = values
        self.held += 1
        return self.keys[:, :, : self.held], self.values[:, :, : self.held]

    @property
    def state(self):
        return self.keys[:, :, : self.held], self.values[:, :, : self.held]

    def make_mask(self, N, return_array=False, window_size=None):
        return None if N == 1 else "causal"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random-1b", help="random llama shape (default random-1b)")
    parser.add_argument("--prompt-length", type=int, default=4096, help="prompt tokens (default 4096)")
    parser.add_argument("--budget", type=int, default=512, help="rows kept per head (default 512)")
    parser.add_argument("--steps", type=int, default=130, help="timed decode steps per trial (default 130)")
    parser.add_argument("--trials", type=int, default=3, help="trials per arm (default 3)")
    parser.add_argument("--arms", nargs="+", default=[a for a in ARMS if a not in ASKED_FOR_ONLY],
                        choices=ARMS,
                        help=f"arms (default all but {', '.join(ASKED_FOR_ONLY)})")
    parser.add_argument("--interleave", action="store_true",
                        help="take the arms' steps in turn within each trial, step by step, instead "
                             "of one arm's trial after another, and report each arm's speed against "
                             "RotatingKVCache's step of the same round (paired median); arms without "
                             "camkv then run through camkv's attention hook, one attribute lookup a "
                             "layer (default off)")
    parser.add_argument("--pipelined", type=int, default=0, metavar="TOKENS",
                        help="decode through mlx-lm's generate_step instead (each step's graph built "
                             "while the previous one runs on the device, as mlx_lm.generate does), the "
                             "arms taking turns TOKENS tokens at a time; each arm's speed is then paired "
                             "with RotatingKVCache's block of the same round and no graph-building time "
                             "is reported (default 0: steps one at a time, synchronously)")
    parser.add_argument("--host-profile", nargs="*", default=[], choices=ARMS, metavar="ARM",
                        help="after the timing, run one more trial of each ARM under cProfile and "
                             "write its steps' Python functions by own time to "
                             "decode-parts-profile-ARM.txt under --out (default none)")
    parser.add_argument("--cache-host", action="store_true",
                        help="also time each step's calls into the caches (update_and_fetch, "
                             "observe_queries, attention_bias, make_mask): the cache's own host work, "
                             "reported per step and layer (a clock around each call; default off)")
    parser.add_argument("--out", type=Path, default=None, help="folder for decode-parts.json")
    return parser.parse_args(argv)


CACHE_CALLS = ("update_and_fetch", "observe_queries", "attention_bias", "make_mask")


class CacheClock:
    """Seconds spent inside the caches' calls (CACHE_CALLS), each cache's methods wrapped
    on the instance (so the attention hook, which looks them up on the cache, is timed
    too). What a cache does there is host work: the graph is evaluated after the step."""

    def __init__(self):
        self.seconds = 0.0

    def wrap(self, caches: list) -> None:
        for cache in caches:
            for name in CACHE_CALLS:
                method = getattr(cache, name, None)
                if method is not None:
                    setattr(cache, name, self._timed(method))

    def _timed(self, method):
        def timed(*args, **kwargs):
            tick = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - tick
        return timed


def make_arm(model, arm: str, budget: int) -> list:
    cfg = CaMConfig(budget=budget)
    layers = len(model.layers)
    if arm == "full":
        return [KVCache() for _ in range(layers)]
    if arm == "rotating":
        return [RotatingKVCache(max_size=budget, keep=cfg.n_sink) for _ in range(layers)]
    if arm == "buffer":
        return [BufferCache(budget, cfg.slack) for _ in range(layers)]
    if arm == "camkv-key":
        return make_prompt_cache(model, config=cfg.replace(scoring="key"))
    if arm in QUANTIZED_ARMS:
        return make_prompt_cache(model, config=cfg.replace(bits=QUANTIZED_ARMS[arm], group_size=32))
    if arm in FUSED_ARMS:  # step_cuda.FUSED_STEPS on while it runs (ARM_SETTINGS)
        return make_prompt_cache(model, config=cfg.replace(bits=FUSED_ARMS[arm], group_size=32))
    if arm == "camkv-fullway":
        caches = make_prompt_cache(model, config=cfg)
        for cache in caches:
            cache._short_way_rows = lambda queries: False  # never a short way (an instance's own method)
        return caches
    if arm == "camkv-fullhook":
        caches = make_prompt_cache(model, config=cfg)
        for cache in caches:  # the hook never hears that a step may go straight to attention
            observe = cache.observe_queries
            cache.observe_queries = lambda queries, scale, defer_launch=False, observe=observe: (
                observe(queries, scale, defer_launch) and False)
        return caches
    if arm == "camkv-nocomp":
        return make_prompt_cache(model, config=cfg.replace(slack=1 << 16))
    if arm == "camkv-keepkv":
        return make_prompt_cache(model, config=cfg.replace(merge="keepkv"))
    return make_prompt_cache(model, config=cfg)


@contextlib.contextmanager
def arm_settings(arm: str):
    """Within the block, the arm's settings of camkv's kernels (ARM_SETTINGS), the
    defaults back after."""
    import importlib

    with contextlib.ExitStack() as held:
        for (module, name), value in ARM_SETTINGS.get(arm, {}).items():
            held.enter_context(mock.patch.object(importlib.import_module(f"camkv.backends.{module}"), name, value))
        yield


def prefilled(model, arm: str, prompt: mx.array, budget: int) -> tuple[list, mx.array]:
    """The arm's caches after all of the prompt but its last token, and that token."""
    cache = make_arm(model, arm, budget)
    for first in range(0, prompt.size - 1, 2048):
        model(prompt[first: min(first + 2048, prompt.size - 1)][None], cache=cache)
        mx.eval([c.state for c in cache])
    return cache, prompt[-1:]


def clocked(cache: list, opts) -> CacheClock | None:
    """A clock around the caches' calls, with --cache-host (else None)."""
    if not opts.cache_host:
        return None
    clock = CacheClock()
    clock.wrap(cache)
    return clock


def timed_step(model, cache: list, token: mx.array) -> tuple[mx.array, float, float]:
    """One greedy decode step: (next token, seconds in all, seconds building its graph)."""
    tick = time.perf_counter()
    token = mx.argmax(model(token[None], cache=cache)[:, -1], axis=-1)
    built = time.perf_counter()
    mx.eval(token)
    return token, time.perf_counter() - tick, built - tick


def trial(model, arm: str, prompt: mx.array, opts, profiler=None) -> tuple[list[float], list[float], list[float]]:
    """(seconds of each step, seconds of building each step's graph, seconds in the caches'
    calls each step (with --cache-host, else empty)); the steps run under profiler (a
    cProfile.Profile) when one is given."""
    try:
        with arm_settings(arm):
            cache, token = prefilled(model, arm, prompt, opts.budget)
        clock = clocked(cache, opts)
        steps, builds, hosts = [], [], []
        if profiler is not None:
            profiler.enable()
        for _ in range(opts.steps):
            before = clock.seconds if clock else 0.0
            with arm_settings(arm):
                token, step_s, build_s = timed_step(model, cache, token)
            steps.append(step_s)
            builds.append(build_s)
            if clock:
                hosts.append(clock.seconds - before)
        if profiler is not None:
            profiler.disable()
        return steps, builds, hosts
    finally:
        hook.uninstall(model)


def in_turn(arms: list[str], round_index: int) -> list[str]:
    """The arms in the order they take round round_index: the first moves one place a round."""
    first = round_index % len(arms)
    return arms[first:] + arms[:first]


def interleaved_trial(model, arms: list[str], prompt: mx.array, opts) -> dict[str, tuple[list, list, list]]:
    """Every arm prefilled, then their steps in turn, step by step (the first arm of a
    round moves one place each step), so a drift of the host's speed touches all alike.
    arm -> (seconds of each step, seconds building each step's graph, seconds in the
    caches' calls each step (with --cache-host, else empty))."""
    try:
        state = {}
        for arm in arms:
            with arm_settings(arm):
                state[arm] = list(prefilled(model, arm, prompt, opts.budget))
        clocks = {arm: clocked(state[arm][0], opts) for arm in arms}
        timed = {arm: ([], [], []) for arm in arms}
        for step in range(opts.steps):
            for arm in in_turn(arms, step):
                clock = clocks[arm]
                before = clock.seconds if clock else 0.0
                with arm_settings(arm):
                    state[arm][1], step_s, build_s = timed_step(model, state[arm][0], state[arm][1])
                timed[arm][0].append(step_s)
                timed[arm][1].append(build_s)
                if clock:
                    timed[arm][2].append(clock.seconds - before)
        return timed
    finally:
        hook.uninstall(model)


def pipelined_trial(model, arms: list[str], prompt: mx.array, opts) -> dict[str, tuple[list, list]]:
    """Every arm prefilled, then mlx-lm's generate_step for each (asynchronous, one step
    ahead), the arms taking turns opts.pipelined tokens at a time (the first arm of a round
    moving one place each round). arm -> (seconds a step of each block, [], [])."""
    from mlx_lm.generate import generate_step

    streams = {}
    try:
        for arm in arms:
            with arm_settings(arm):
                cache, token = prefilled(model, arm, prompt, opts.budget)
                streams[arm] = generate_step(token, model, prompt_cache=cache, max_tokens=-1,
                                             sampler=lambda logprobs: mx.argmax(logprobs, axis=-1))
                next(streams[arm])  # the prompt's last token: not a decode step
        timed = {arm: ([], [], []) for arm in arms}
        for block in range(max(1, opts.steps // opts.pipelined)):
            for arm in in_turn(arms, block):
                with arm_settings(arm):
                    tick = time.perf_counter()
                    for _ in range(opts.pipelined):
                        next(streams[arm])
                    timed[arm][0].append((time.perf_counter() - tick) / opts.pipelined)
        return timed
    finally:
        for stream in streams.values():
            stream.close()
        hook.uninstall(model)


def main(argv=None) -> dict:
    opts = parse_args(argv)
    model = random_llama(opts.model)
    prompt = mx.random.randint(0, 1000, (opts.prompt_length,))
    steps = {arm: [] for arm in opts.arms}
    builds = {arm: [] for arm in opts.arms}
    hosts = {arm: [] for arm in opts.arms}
    for arm in opts.arms:  # warm-up: compiles and allocates what each arm runs
        trial(model, arm, prompt, opts)
    for trial_index in range(opts.trials):
        if opts.interleave or opts.pipelined:
            take_turns = pipelined_trial if opts.pipelined else interleaved_trial
            # Trial t prefills the arms from the t-th on: the arm prefilled first read slower
            # through its steps (an H100 at llama-3-8B's shape, 32k tokens: 8-bit rows 0.83x
            # RotatingKVCache's prefilled after it, 0.70x before it).
            order = in_turn(opts.arms, trial_index)
            for arm, (timed, built, host) in take_turns(model, order, prompt, opts).items():
                steps[arm].extend(timed)
                builds[arm].extend(built)
                hosts[arm].extend(host)
            continue
        for arm in opts.arms:
            timed, built, host = trial(model, arm, prompt, opts)
            steps[arm].extend(timed)
            builds[arm].extend(built)
            hosts[arm].extend(host)
    layers = len(model.layers)
    result = {"setup": {**vars(opts), "out": str(opts.out), "device": str(mx.default_device()),
                        "machine": platform.machine(), "mlx": mx.__version__},
              "arms": {arm: {"median_ms": 1e3 * statistics.median(s), "mean_ms": 1e3 * statistics.fmean(s),
                             "build_median_ms": 1e3 * statistics.median(builds[arm]) if builds[arm] else None,
                             # The caches' own calls, per step and layer (--cache-host).
                             "cache_host_us_per_layer": (1e6 * statistics.median(hosts[arm]) / layers
                                                         if hosts[arm] else None)}
                       for arm, s in steps.items()}}
    if (opts.interleave or opts.pipelined) and "rotating" in steps:
        for arm, r in result["arms"].items():
            # Paired: each step (or block) against RotatingKVCache's of the same round.
            r["speed_vs_rotating"] = statistics.median(
                rot / own for rot, own in zip(steps["rotating"], steps[arm]))
    for arm, r in result["arms"].items():
        paired = f"  speed vs rotating (paired) {r['speed_vs_rotating']:.3f}" if "speed_vs_rotating" in r else ""
        built = "" if r["build_median_ms"] is None else f"  graph built in {r['build_median_ms']:.3f} ms"
        host = r["cache_host_us_per_layer"]
        host = "" if host is None else f"  cache calls {host:.1f} us a layer"
        print(f"{arm:16s} median {r['median_ms']:.3f} ms  mean {r['mean_ms']:.3f} ms{built}{host}{paired}")
    save_result(result, opts.out, "decode-parts.json")
    for arm in opts.host_profile:
        print(host_profile(model, arm, prompt, opts))
    return result


def host_profile(model, arm: str, prompt: mx.array, opts) -> str:
    """The Python functions of one trial's steps by their own time (cProfile), as text;
    written to decode-parts-profile-ARM.txt under opts.out when given."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    timed = trial(model, arm, prompt, opts, profiler)[0]
    text = io.StringIO()
    text.write(f"{arm}: {opts.steps} steps, median {1e3 * statistics.median(timed):.3f} ms (under cProfile)\n")
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    if opts.out is not None:
        opts.out.mkdir(parents=True, exist_ok=True)
        (opts.out / f"decode-parts-profile-{arm}.txt").write_text(text.getvalue())
    return text.getvalue()


if __name__ == "__main__":
    from camkv._blas import reexec_with_openblas

    reexec_with_openblas()  # the CPU's float32 matrix products by the system's OpenBLAS, where one exists
    main()
