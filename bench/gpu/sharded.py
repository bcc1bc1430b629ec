"""camkv on a llama sharded by mlx-lm's tensor parallelism: one rank of an mlx.launch job.

bench/gpu/sharded.sh starts the ranks: MLX's NCCL backend on a host with two GPUs, or
two CPU ranks over the ring backend for a dry run. Every rank builds the same random
llama (--shape, llama-3-8B's by default; same seed everywhere), runs the unsharded
references, shards the model in place (`model.shard(group)`: each rank computes
KV heads / ranks heads of every layer) and builds its camkv caches with
`camkv.make_prompt_cache` on the sharded model. Then, as tests/test_distributed.py
does at a tiny size:

1. first layer, teacher-forced (the same call sizes as the reference, gate on,
   merging keys): each rank's kept positions, keys and scores equal the unsharded
   run's for its heads (global head indices for the gate), with key and with query
   scoring. The first layer's keys and queries come from a slice of the same
   projections applied to the same embeddings, with no all-reduce before them. A
   control keeps the comparison honest: caches that ignore the sharding (drawing as
   heads 0..) keep other positions, keys or scores on every rank but the first.
2. tokens, at a budget that holds everything: camkv generates the full cache's tokens,
   sharded against sharded and unsharded against unsharded, and every rank generates
   the same ones. Sharded against unsharded is reported, not required: the all-reduces
   after the first layer sum in another order, which changes float bits
   (docs/distributed.md).
3. KV bytes: each rank holds 1 / ranks of the unsharded run's bytes.

Then, side by side in the same job, for each --prompt-lengths: prefill time and
generation tokens/s of camkv (CaMConfig's defaults at --budget), mlx-lm's KVCache and
RotatingKVCache(max_size=--budget, keep=4), all on the sharded model.

Rank 0 writes one JSON (--out): the command, versions, each rank's device, the checks
and the figures. Every rank exits 1 when a check failed, 2 for a bad option.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import statistics
import sys
import time
from dataclasses import asdict, astuple, dataclass
from importlib import metadata
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, RotatingKVCache

import camkv
from camkv.distributed import gather_kv_bytes, kv_bytes
from camkv.models import RANDOM_LLAMAS, random_llama_of_shape

LLAMA_3_8B = ",".join(map(str, RANDOM_LLAMAS["random-8b"]))  # hidden, layers, heads, KV heads, intermediate, vocab
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
BACKENDS = ("nccl", "ring")
ARMS = ("camkv", "full", "rotating")
ROTATING_KEEP = 4  # RotatingKVCache's kept first tokens, as camkv's sinks (CaMConfig's n_sink)
NAME_BYTES = 64  # a device name travels between ranks as this many bytes


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int


def parse_shape(text: str) -> Shape:
    """--shape: six positive integers, a llama's hidden, layers, heads, KV heads,
    intermediate and vocab sizes."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if len(values) != 6 or min(values) < 1:
        raise ValueError(f"--shape must be six positive integers HIDDEN,LAYERS,HEADS,KV_HEADS,"
                         f"INTERMEDIATE,VOCAB, got {text!r}")
    shape = Shape(*values)
    if shape.heads % shape.kv_heads or shape.hidden % shape.heads:
        raise ValueError(f"--shape {text}: the heads ({shape.heads}) must be a multiple of the KV heads "
                         f"({shape.kv_heads}) and divide the hidden size ({shape.hidden})")
    return shape


# ---------------------------------------------------------------------- options


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a default unless it is None or False (those options say theirs in words)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=_Help)
    parser.add_argument("--backend", choices=BACKENDS, default="nccl",
                        help="MLX distributed backend the ranks join (mlx.launch started them with it)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks the job must have")
    parser.add_argument("--device", choices=("gpu", "cpu"), default=None,
                        help="where each rank computes (default: the GPU where there is one)")
    parser.add_argument("--shape", default=LLAMA_3_8B,
                        help="the random llama: HIDDEN,LAYERS,HEADS,KV_HEADS,INTERMEDIATE,VOCAB; "
                             "the default is llama-3-8B's")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="weights and caches (default: bfloat16 on a GPU, float32 on the CPU)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the token ids")
    checks = parser.add_argument_group("checks")
    checks.add_argument("--check-prompt", type=int, default=1024, help="prompt tokens of the checks")
    checks.add_argument("--check-chunk", type=int, default=256, help="tokens per call of the teacher-forced prompt")
    checks.add_argument("--check-steps", type=int, default=32,
                        help="single-token calls after the teacher-forced prompt")
    checks.add_argument("--check-budget", type=int, default=128,
                        help="camkv budget of the kept-positions check (below --check-prompt: it evicts)")
    checks.add_argument("--check-gen", type=int, default=32, help="tokens generated by the tokens check")
    measure = parser.add_argument_group("measurement")
    measure.add_argument("--prompt-lengths", type=int, nargs="*", default=[32768, 131072],
                         help="prompt lengths timed (random token ids); none: checks only")
    measure.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS),
                         help="caches timed: camkv (CaMConfig's defaults), full (mlx-lm's KVCache), "
                              "rotating (RotatingKVCache, keep=4)")
    measure.add_argument("--budget", type=int, default=2048, help="camkv and RotatingKVCache budget")
    measure.add_argument("--gen-tokens", type=int, default=64, help="tokens generated per trial")
    measure.add_argument("--trials", type=int, default=1, help="timed trials per arm and length (after a warm-up)")
    measure.add_argument("--prefill-step", type=int, default=2048, help="prompt tokens per call")
    measure.add_argument("--camkv-backend", default="auto", help="camkv kernel backend (auto: the best here)")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON rank 0 writes (default: bench/results/sharded-<backend>.json)")
    parser.add_argument("--check-only", action="store_true",
                        help="check the options and exit (sharded.sh does so before it starts the ranks)")
    return parser


def check_args(args: argparse.Namespace) -> Shape:
    """The shape; ValueError naming the option, its value and what is allowed."""
    shape = parse_shape(args.shape)
    if args.ranks < 1 or shape.kv_heads % args.ranks:
        raise ValueError(f"--ranks {args.ranks}: the ranks must divide the KV heads ({shape.kv_heads}), "
                         "as mlx-lm's shard() requires")
    for name in ("check_prompt", "check_chunk", "check_steps", "check_budget", "check_gen", "budget",
                 "gen_tokens", "trials", "prefill_step"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.device == "gpu" and not mx.is_available(mx.gpu):
        raise ValueError("--device gpu: this MLX has no GPU here (--device cpu computes on the CPU)")
    if any(length < 2 for length in args.prompt_lengths):
        raise ValueError(f"--prompt-lengths must be integers >= 2, got {args.prompt_lengths}")
    if args.check_budget >= args.check_prompt:
        raise ValueError(f"--check-budget {args.check_budget} must be below --check-prompt "
                         f"{args.check_prompt}, or the kept-positions check evicts nothing")
    if args.budget <= ROTATING_KEEP:
        raise ValueError(f"--budget must exceed RotatingKVCache's {ROTATING_KEEP} kept tokens, got {args.budget}")
    for option, config in (("--check-budget", lambda: forced_config(args.check_budget, "key")),
                           ("--budget", lambda: camkv.CaMConfig(budget=args.budget, backend=args.camkv_backend))):
        try:
            config()
        except ValueError as err:
            raise ValueError(f"{option}: {err}") from None
    return shape


# ---------------------------------------------------------------------- model and runs


def random_llama(shape: Shape, dtype, seed: int):
    return random_llama_of_shape(astuple(shape), dtype, seed)


def forced_config(budget: int, scoring: str) -> camkv.CaMConfig:
    """The kept-positions check's caches: evicting, gated merges that blend keys too, so a
    wrong head index changes the gate's draws, hence merges, keys, scores and evictions."""
    return camkv.CaMConfig(budget=budget, n_sink=2, recent=max(1, budget // 6), merge="sim_weighted",
                           merge_keys=True, gate=True, seed=5, scoring=scoring)


def random_tokens(count: int, vocab: int, seed: int) -> mx.array:
    return mx.random.randint(0, vocab, (count,), key=mx.random.key(seed))


def teacher_forced(model, caches, tokens: mx.array, call_sizes: list[int]) -> None:
    """Feed `tokens` in calls of `call_sizes` tokens (the same on every run)."""
    start = 0
    for size in call_sizes:
        logits = model(tokens[None, start:start + size], cache=caches)
        mx.eval(logits, [c.state for c in caches])
        start += size


def first_layer_projections(model, tokens: mx.array) -> dict:
    """The first layer's keys and queries before RoPE, [T, heads * head dim], of this
    process's heads: what its caches are fed. Were they not bit-identical to the
    unsharded model's (a matrix product of another width summing in another order),
    check 1 would compare caches fed different inputs."""
    layer = model.layers[0]
    x = layer.input_layernorm(model.model.embed_tokens(tokens[None]))
    keys, queries = layer.self_attn.k_proj(x), layer.self_attn.q_proj(x)
    mx.eval(keys, queries)
    return {"keys": np.array(keys[0].astype(mx.float32)), "queries": np.array(queries[0].astype(mx.float32))}


def projections_identical(mine: dict, reference: dict, rank: int) -> dict[str, bool]:
    """Whether this rank's projections are its slice of the reference's, bit for bit."""
    result = {}
    for name, local in mine.items():
        width = local.shape[1]
        result[f"layer0_{name}_inputs_identical"] = bool(
            np.array_equal(local, reference[name][:, rank * width:(rank + 1) * width]))
    return result


def first_layer(caches) -> dict:
    keys, _, scores, positions = caches[0].stored()
    return {"positions": np.array(positions[0]), "keys": np.array(keys[0].astype(mx.float32)),
            "scores": np.array(scores[0])}


class Clock:
    """Rank 0's progress lines through a long prefill (mlx.launch forwards them)."""

    def __init__(self, label: str, total: int):
        self.label, self.total = label, total
        self.start = time.perf_counter()
        self.every = max(1, total // 8)  # about eight lines a prefill
        self.next = self.every

    def tick(self, done: int) -> None:
        if done < self.next or done >= self.total:
            return
        while self.next <= done:
            self.next += self.every
        say(f"  {self.label}: {done}/{self.total} prompt tokens, {time.perf_counter() - self.start:.1f} s")


def generation(model, caches, prompt: mx.array, gen_tokens: int, step: int, clock: Clock | None = None) -> dict:
    """Prefill `prompt` in calls of `step` tokens, then generate greedily; the tokens and
    the times (a rank's own: its collectives wait for the other ranks)."""
    mx.synchronize()
    mx.reset_peak_memory()
    start = time.perf_counter()
    length = prompt.size
    for first in range(0, length - 1, step):
        last = min(first + step, length - 1)
        model(prompt[None, first:last], cache=caches)
        mx.eval([c.state for c in caches])
        if clock:
            clock.tick(last)
    logits = model(prompt[None, -1:], cache=caches)
    token = mx.argmax(logits[:, -1], axis=-1)
    mx.eval(token)
    prefill_s = time.perf_counter() - start
    tokens, step_s = [int(token.item())], []
    for _ in range(gen_tokens - 1):
        tick = time.perf_counter()
        logits = model(token[None], cache=caches)
        token = mx.argmax(logits[:, -1], axis=-1)
        mx.eval(token)
        step_s.append(time.perf_counter() - tick)
        tokens.append(int(token.item()))
    return {"tokens": tokens, "prefill_s": prefill_s, "step_s": step_s, "kv_bytes": kv_bytes(caches),
            "peak_bytes": mx.get_peak_memory()}


def make_caches(model, arm: str, budget: int, camkv_backend: str = "auto") -> list:
    """A fresh cache list of one arm; camkv's (query scoring) installs the attention hook,
    which release() takes out."""
    if arm == "camkv":
        return camkv.make_prompt_cache(model, budget=budget, backend=camkv_backend)
    caches = model.make_cache()
    if arm == "rotating":
        return [RotatingKVCache(max_size=budget, keep=ROTATING_KEEP) if type(c) is KVCache else c for c in caches]
    return caches


def release(model) -> None:
    camkv.remove(model)
    gc.collect()
    mx.clear_cache()


def camkv_stats(caches) -> dict:
    return {k: sum(c.stats[k] for c in caches) for k in ("evictions", "merges")}


# ---------------------------------------------------------------------- between ranks


def gather(values: list[int], group) -> list[list[int]]:
    """Every rank's `values` (as many on every rank), in rank order, on every rank.

    On the backend's own stream (the GPU's for NCCL, the CPU's for the ring), the
    stream the model's all-reduces take.
    """
    mine = mx.array([values], dtype=mx.int64)
    return mx.distributed.all_gather(mine, group=group).tolist()


def gather_fields(fields: dict[str, int], group) -> list[dict[str, int]]:
    """Every rank's `fields` (the same names on every rank, integers or booleans)."""
    names = list(fields)
    kinds = [bool if isinstance(fields[n], bool) else int for n in names]
    rows = gather([int(fields[n]) for n in names], group)
    return [{n: kind(v) for n, kind, v in zip(names, kinds, row)} for row in rows]


def device_names(group) -> list[str]:
    """Each rank's device (the GPU's name, or the CPU's), in rank order."""
    info = mx.device_info()
    name = info.get("device_name", "") or info.get("architecture", "")
    raw = list(name.encode()[:NAME_BYTES].ljust(NAME_BYTES, b"\0"))
    return [bytes(row).rstrip(b"\0").decode(errors="replace") for row in gather(raw, group)]


def nccl_library() -> dict | None:
    """The libnccl this process loaded (through MLX's CUDA build) and its version, or None."""
    import ctypes

    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libnccl.so" in line}
    if not paths:
        return None
    path = sorted(paths)[0]
    version = ctypes.c_int()
    ctypes.CDLL(path).ncclGetVersion(ctypes.byref(version))
    code = version.value  # major * 10000 + minor * 100 + patch
    return {"path": path, "version": f"{code // 10000}.{code // 100 % 100}.{code % 100}"}


# ---------------------------------------------------------------------- the checks


def unsharded_references(model, args) -> dict:
    """What the checks compare with, from the whole model on this rank alone."""
    forced_tokens, sizes = check_sequence(args, model.args.vocab_size)
    layer0, forced_bytes = {}, {}
    for scoring in ("key", "query"):
        caches = camkv.make_prompt_cache(model, forced_config(args.check_budget, scoring))
        teacher_forced(model, caches, forced_tokens, sizes)
        layer0[scoring], forced_bytes[scoring] = first_layer(caches), kv_bytes(caches)
        release(model)
    runs = holds_all_runs(model, args)
    return {"layer0": layer0, "forced_kv_bytes": forced_bytes, **runs,
            "projections": first_layer_projections(model, forced_tokens)}


def check_sequence(args, vocab: int) -> tuple[mx.array, list[int]]:
    """The teacher-forced tokens and call sizes: the prompt in chunks, then single tokens."""
    chunks = [min(args.check_chunk, args.check_prompt - s) for s in range(0, args.check_prompt, args.check_chunk)]
    sizes = chunks + [1] * args.check_steps
    return random_tokens(sum(sizes), vocab, args.seed + 1), sizes


def holds_all_runs(model, args) -> dict:
    """Greedy generations of the full cache and of camkv at a budget that holds the prompt
    and every generated token."""
    prompt = random_tokens(args.check_prompt, model.args.vocab_size, args.seed + 2)
    budget = args.check_prompt + args.check_gen
    full = generation(model, make_caches(model, "full", budget), prompt, args.check_gen, args.check_chunk)
    release(model)
    caches = make_caches(model, "camkv", budget, args.camkv_backend)
    held = generation(model, caches, prompt, args.check_gen, args.check_chunk)
    held["evictions"] = camkv_stats(caches)["evictions"]
    release(model)
    return {"full": full, "camkv": held}


def sharded_layer0(model, args, reference: dict) -> dict:
    """This rank's first-layer heads after teacher forcing, against the reference's."""
    tokens, sizes = check_sequence(args, model.args.vocab_size)
    result = {}
    for scoring in ("key", "query"):
        caches = camkv.make_prompt_cache(model, forced_config(args.check_budget, scoring))
        teacher_forced(model, caches, tokens, sizes)
        mine, ref = first_layer(caches), reference["layer0"][scoring]
        offset = caches[0]._head_offset
        heads = slice(offset, offset + mine["keys"].shape[0])
        stats = caches[0].stats
        result[scoring] = {
            "head_offset": offset, "local_heads": mine["keys"].shape[0],
            "positions_equal": bool(np.array_equal(mine["positions"], ref["positions"][heads])),
            # With merge_keys the keys and scores carry every merge: equal only when the
            # inputs and every gate outcome were the reference's.
            "keys_identical": bool(np.array_equal(mine["keys"], ref["keys"][heads])),
            "scores_identical": bool(np.array_equal(mine["scores"], ref["scores"][heads])),
            "merges": stats["merges"], "evictions": stats["evictions"],
            "kv_bytes": kv_bytes(caches), "reference_kv_bytes": reference["forced_kv_bytes"][scoring],
        }
        release(model)
    # Control: the same run with caches that ignore the sharding (heads drawn as 0..).
    placed = camkv.make_prompt_cache(model, forced_config(args.check_budget, "key"))
    caches = [camkv.CaMKVCache(c.config) for c in placed]
    teacher_forced(model, caches, tokens, sizes)
    offset = result["key"]["head_offset"]
    unplaced, ref = first_layer(caches), reference["layer0"]["key"]
    heads = slice(offset, offset + unplaced["keys"].shape[0])
    result["unplaced_state_differs"] = not all(np.array_equal(unplaced[k], ref[k][heads]) for k in unplaced)
    release(model)
    return result


def leading_equal(a: list[int], b: list[int]) -> int:
    """How many tokens two generations share before they first differ."""
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count


def run_checks(model, args, group, reference: dict) -> dict:
    """The three checks on the sharded model; every rank's findings, gathered."""
    rank, size = group.rank(), group.size()
    say("check 1: first layer, teacher-forced, against the unsharded run")
    layer0 = sharded_layer0(model, args, reference)
    say("check 2: tokens at a budget that holds everything")
    runs = holds_all_runs(model, args)
    fields = {}
    for scoring in ("key", "query"):
        for name, value in layer0[scoring].items():
            fields[f"layer0_{scoring}_{name}"] = value
    fields["unplaced_state_differs"] = layer0["unplaced_state_differs"]
    tokens_forced, _ = check_sequence(args, model.args.vocab_size)
    fields |= projections_identical(first_layer_projections(model, tokens_forced), reference["projections"], rank)
    fields["camkv_evictions"] = runs["camkv"]["evictions"]
    fields["reference_camkv_evictions"] = reference["camkv"]["evictions"]
    for arm in ("camkv", "full"):
        fields[f"{arm}_kv_bytes"] = runs[arm]["kv_bytes"]
        fields[f"reference_{arm}_kv_bytes"] = reference[arm]["kv_bytes"]
    per_rank = gather_fields(fields, group)
    tokens = {name: gather(runs[name]["tokens"], group) for name in ("camkv", "full")}
    verdicts = check_verdicts(per_rank, tokens, reference, size)
    return {"ranks": per_rank, "tokens": {
        "sharded_camkv": tokens["camkv"][0], "sharded_full": tokens["full"][0],
        "unsharded_camkv": reference["camkv"]["tokens"], "unsharded_full": reference["full"]["tokens"],
        # Reported, not required: the all-reduces after the first layer change float bits.
        "sharded_unsharded_leading_equal": leading_equal(tokens["full"][0], reference["full"]["tokens"]),
    }, "verdicts": verdicts, "passed": all(verdicts.values()), "rank_checked": rank}


def check_verdicts(per_rank: list[dict], tokens: dict, reference: dict, size: int) -> dict[str, bool]:
    """Each check's pass or fail, over every rank."""
    verdicts = {}
    for scoring in ("key", "query"):
        f = f"layer0_{scoring}_"
        verdicts[f"1_{scoring}_positions_equal_unsharded"] = all(r[f + "positions_equal"] for r in per_rank)
        verdicts[f"1_{scoring}_keys_scores_identical"] = all(
            r[f + "keys_identical"] and r[f + "scores_identical"] for r in per_rank)
        verdicts[f"1_{scoring}_gate_chose"] = all(0 < r[f + "merges"] < r[f + "evictions"] for r in per_rank)
        verdicts[f"1_{scoring}_global_heads"] = [(r[f + "head_offset"], r[f + "local_heads"]) for r in per_rank] == [
            (rank * per_rank[0][f + "local_heads"], per_rank[0][f + "local_heads"]) for rank in range(size)]
        verdicts[f"3_{scoring}_kv_bytes_per_rank"] = all(
            0 < r[f + "kv_bytes"] and size * r[f + "kv_bytes"] == r[f + "reference_kv_bytes"] for r in per_rank)
    # The comparison can fail: on every rank but the first, caches that ignore the sharding
    # keep other positions, keys or scores.
    verdicts["1_control_unplaced_differs"] = all(r["unplaced_state_differs"] for r in per_rank[1:])
    verdicts["2_holds_everything"] = all(r["camkv_evictions"] == 0 == r["reference_camkv_evictions"] for r in per_rank)
    verdicts["2_sharded_camkv_tokens_equal_sharded_full"] = tokens["camkv"][0] == tokens["full"][0]
    verdicts["2_unsharded_camkv_tokens_equal_unsharded_full"] = (
        reference["camkv"]["tokens"] == reference["full"]["tokens"])
    verdicts["2_ranks_generate_the_same_tokens"] = all(
        t == tokens[name][0] for name in tokens for t in tokens[name])
    verdicts["3_holds_everything_kv_bytes_per_rank"] = all(
        0 < r["camkv_kv_bytes"] and size * r["camkv_kv_bytes"] == r["reference_camkv_kv_bytes"]
        and size * r["full_kv_bytes"] == r["reference_full_kv_bytes"] for r in per_rank)
    return verdicts


# ---------------------------------------------------------------------- the measurement


def measure(model, args, group) -> list[dict]:
    """Every arm at every prompt length on the sharded model; arms take turns trial by
    trial, so a drift of the machines' speed touches them alike."""
    rows = []
    vocab = model.args.vocab_size
    for length in args.prompt_lengths:
        prompt = random_tokens(length, vocab, args.seed + length)
        for arm in args.arms:  # warm-up: two prompt calls and a trial's tokens compile what the trials run
            generation(model, make_caches(model, arm, args.budget, args.camkv_backend),
                       prompt[: min(length, 2 * args.prefill_step)], args.gen_tokens, args.prefill_step)
            release(model)
        trials = {arm: [] for arm in args.arms}
        for trial in range(args.trials):
            for arm in args.arms:
                clock = Clock(f"{arm} {length} trial {trial + 1}", length)
                caches = make_caches(model, arm, args.budget, args.camkv_backend)
                run = generation(model, caches, prompt, args.gen_tokens, args.prefill_step, clock)
                release(model)
                trials[arm].append(run)
                say(f"{arm:8s} {length:7d} tokens: prefill {run['prefill_s']:.2f} s, "
                    f"{len(run['step_s']) / max(sum(run['step_s']), 1e-9):.1f} tokens/s")
        rows += [summarize(arm, length, trials[arm], args.budget, group) for arm in args.arms]
    add_ratios(rows)
    return rows


def summarize(arm: str, length: int, runs: list[dict], budget: int, group) -> dict:
    """One arm at one length: every rank's times, and the job's (the slowest rank's)."""
    fields = {}
    for i, run in enumerate(runs):
        fields[f"prefill_us_{i}"] = round(1e6 * run["prefill_s"])
        fields[f"gen_us_{i}"] = round(1e6 * sum(run["step_s"]))
    fields["kv_bytes"], fields["peak_bytes"] = runs[-1]["kv_bytes"], runs[-1]["peak_bytes"]
    per_rank = gather_fields(fields, group)
    steps = len(runs[0]["step_s"])
    prefill = [max(r[f"prefill_us_{i}"] for r in per_rank) / 1e6 for i in range(len(runs))]
    gen = [max(r[f"gen_us_{i}"] for r in per_rank) / 1e6 for i in range(len(runs))]
    return {
        "arm": arm, "budget": None if arm == "full" else budget, "prompt_len": length,
        "prefill_s": statistics.median(prefill), "prefill_s_trials": prefill,
        # Tokens after the first (which the prefill's last call gives) over their time.
        "gen_tokens_per_s": steps / max(statistics.median(gen), 1e-9), "gen_s_trials": gen,
        "per_rank": [{"prefill_s": [r[f"prefill_us_{i}"] / 1e6 for i in range(len(runs))],
                      "gen_s": [r[f"gen_us_{i}"] / 1e6 for i in range(len(runs))],
                      "kv_bytes": r["kv_bytes"], "peak_bytes": r["peak_bytes"]} for r in per_rank],
    }


def add_ratios(rows: list[dict]) -> None:
    """Each row against the full cache's at its length (when the full cache was timed)."""
    full = {r["prompt_len"]: r for r in rows if r["arm"] == "full"}
    for row in rows:
        base = full.get(row["prompt_len"])
        if base is None:
            continue
        row["gen_speed_vs_full"] = row["gen_tokens_per_s"] / base["gen_tokens_per_s"]
        row["prefill_time_vs_full"] = row["prefill_s"] / base["prefill_s"]


# ---------------------------------------------------------------------- main

_RANK = 0


def say(message: str) -> None:
    if _RANK == 0:
        print(f"[sharded] {message}", flush=True)


def fail(message: str, status: int = 2):
    if _RANK == 0:
        print(f"sharded.py: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(status)


def versions() -> dict:
    return {name: metadata.version(name) for name in ("mlx", "mlx-lm")} | {"camkv": camkv.__version__}


def main(argv: list[str] | None = None) -> int:
    global _RANK
    args = build_parser().parse_args(argv)
    _RANK = int(os.environ.get("MLX_RANK", "0"))  # before init: only rank 0 prints an error
    try:
        shape = check_args(args)
    except ValueError as err:
        fail(str(err))
    if args.check_only:
        return 0
    device = args.device or ("gpu" if mx.default_device() == mx.gpu else "cpu")
    mx.set_default_device(mx.gpu if device == "gpu" else mx.cpu)
    dtype = DTYPES[args.dtype or ("bfloat16" if device == "gpu" else "float32")]
    out = args.out or Path(f"bench/results/sharded-{args.backend}.json")
    group = mx.distributed.init(strict=True, backend=args.backend)
    _RANK = group.rank()
    if group.size() != args.ranks:
        fail(f"--ranks {args.ranks}, but the job has {group.size()} ranks")
    dtype_name = str(dtype).removeprefix("mlx.core.")
    say(f"{group.size()} ranks ({args.backend}), a random llama {args.shape} in {dtype_name}, on the {device}")
    started = time.perf_counter()
    model = random_llama(shape, dtype, args.seed)
    say(f"model built in {time.perf_counter() - started:.1f} s; unsharded references")
    reference = unsharded_references(model, args)
    model.shard(group)
    gc.collect()
    mx.clear_cache()
    checks = run_checks(model, args, group, reference)
    for name, ok in checks["verdicts"].items():
        say(f"  {'ok  ' if ok else 'FAIL'} {name}")
    inputs = {name: all(r[f"layer0_{name}_inputs_identical"] for r in checks["ranks"]) for name in ("keys", "queries")}
    say(f"  (first-layer keys and queries fed to the caches, bit-identical to the unsharded model's: "
        f"keys {inputs['keys']}, queries {inputs['queries']})")
    rows = measure(model, args, group) if args.prompt_lengths else []
    for row in rows:
        against = (f" ({row['prefill_time_vs_full']:.2f}x and {row['gen_speed_vs_full']:.2f}x full's)"
                   if "gen_speed_vs_full" in row else "")
        say(f"{row['arm']:8s} {row['prompt_len']:7d} tokens: prefill {row['prefill_s']:.2f} s, "
            f"{row['gen_tokens_per_s']:.1f} tokens/s{against}")
    result = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "launcher": os.environ.get("CAMKV_SHARDED_LAUNCH"),
        **versions(), "backend": args.backend, "ranks": group.size(), "devices": device_names(group),
        "device_kind": device, "nccl": nccl_library() if args.backend == "nccl" else None,
        "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE"),
        "shape": asdict(shape), "dtype": dtype_name, "seed": args.seed,
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "checks": checks, "passed": checks["passed"],
        "measure": {"budget": args.budget, "gen_tokens": args.gen_tokens, "trials": args.trials,
                    "prefill_step": args.prefill_step, "rows": rows},
        "seconds": time.perf_counter() - started,
    }
    write(out, result, group)
    # Last, once the figures are on disk: camkv's own gathering of KV bytes (it runs its
    # collective on the CPU stream) under this backend, against this script's.
    say("check 3: camkv.distributed.gather_kv_bytes under this backend")
    result["checks"]["camkv_gather_kv_bytes"] = camkv_gather_check(model, args, group)
    result["passed"] = result["checks"]["passed"] = checks["passed"] and result["checks"]["camkv_gather_kv_bytes"]["ok"]
    write(out, result, group)
    return 0 if result["passed"] else 1


def camkv_gather_check(model, args, group) -> dict:
    """camkv.distributed.gather_kv_bytes on fresh caches after one prompt call, against
    the bytes this script gathers; the error, if it raised."""
    caches = camkv.make_prompt_cache(model, budget=args.check_budget, backend=args.camkv_backend)
    tokens, _ = check_sequence(args, model.args.vocab_size)
    teacher_forced(model, caches, tokens, [args.check_prompt])
    expected = [row[0] for row in gather([kv_bytes(caches)], group)]
    try:
        got = gather_kv_bytes(caches, group)
    except Exception as err:  # noqa: BLE001 - recorded in the results, the check fails
        return {"ok": False, "error": f"{type(err).__name__}: {err}", "expected": expected}
    finally:
        release(model)
    return {"ok": got == expected, "got": got, "expected": expected}


def write(out: Path, result: dict, group) -> None:
    """Rank 0 writes the results; every rank waits for the file before it goes on."""
    if _RANK == 0:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        say(f"wrote {out}; checks {'passed' if result['passed'] else 'FAILED'}")
    gather([1], group)


if __name__ == "__main__":
    sys.exit(main())
