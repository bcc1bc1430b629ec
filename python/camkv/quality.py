"""camkv eval: how close bounded KV caches stay to the full cache, on real text.

Arms (all fed the same tokens with the same prefill chunking, since chunking alone
changes results on some MLX models):

- full: mlx-lm's KVCache, the reference every metric is measured against;
- streamingllm: mlx-lm's RotatingKVCache(max_size=budget, keep=n_sink);
- h2o: camkv with merge="drop" (attention-mass eviction, sinks, recent window);
- camkv with merge = sim_weighted / mean / mass_weighted / window / window_mass, each
  with the gate on and off;
- the camkv arms again with scoring="query" (suffix "-query");
- the blending arms with mass_bias (suffix "-bias-query"; reference backend, slow).

Tasks:

- stream: a window of real text is prefilled in chunks, then the rest is fed one token
  per step through the cache (teacher forcing). Per arm: perplexity, mean KL divergence
  of its next-token distribution from the full cache's, top-1 agreement with the full
  cache, over the positions at or past the budget ("decode": the one-token steps only;
  "all": prefill chunks too). The full cache's log-probabilities are computed once per
  window and shared by every arm.
- passkey: a 5-digit key hidden at depths 10%..90% of real filler text, greedy answer,
  exact match.

Results go to OUT/records.jsonl as each arm finishes (a rerun of the same command
skips what is there, so a sweep cut by --time-budget resumes), then OUT/summary.json,
OUT/table.md and the PNG plots (camkv.quality_report).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import socket
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from . import hook, texts
from .integration import kv_bytes, make_prompt_cache as camkv_prompt_cache
from .models import DEFAULT_MODEL, random_llama

TINY_MODEL = "tiny-random"
ALL_BUDGETS = "10%,20%,50%,256,512"

PRESETS = {
    # CI-sized: a tiny random llama on the built-in text, a few arms; seconds on a CPU.
    "smoke": dict(model=TINY_MODEL, texts="builtin", tasks="stream,passkey",
                  methods="full,streamingllm,h2o,sim_weighted,window-nogate,sim_weighted-query",
                  budgets="20%,50%", stream_tokens=96, stream_prefill=48, stream_samples=1,
                  chunk=48, passkey_lengths="320", passkey_placements=2, answer_tokens=6,
                  n_sink=2, recent=4),
    # The real model on a CPU (with OpenBLAS): one 512-token window, passkeys at 1k, 2k, 4k.
    "cpu": dict(model=DEFAULT_MODEL, texts="austen", tasks="stream,passkey", methods="core",
                budgets=ALL_BUDGETS, stream_tokens=512, stream_prefill=384, stream_samples=1,
                chunk=256, passkey_lengths="1024,2048,4096", passkey_placements=20, answer_tokens=8,
                n_sink=4, recent=32),
    # The full sweep for a GPU machine: a 4k-token window per source (3840 prefilled, 255
    # one-token steps), passkeys up to 8k. Resumable; cut it into runs with --time-budget.
    "gpu": dict(model=DEFAULT_MODEL, texts="sotu,austen,kjv", tasks="stream,passkey",
                methods="all", budgets=ALL_BUDGETS, stream_tokens=4096, stream_prefill=3840,
                stream_samples=1, chunk=512, passkey_lengths="1024,2048,4096,8192",
                passkey_placements=20, answer_tokens=8, n_sink=4, recent=32),
}

# ---------------------------------------------------------------------------- models


class ByteTokenizer:
    """UTF-8 bytes as token ids (vocabulary 256): the tokenizer of the tiny random model."""

    bos_token_id = None
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


def tiny_random_model(seed: int = 0):
    """camkv.models' "random-tiny" llama (2 layers, GQA 4 on 2, vocabulary 256, float32)
    with the byte tokenizer."""
    return random_llama("random-tiny", mx.float32, seed=seed), ByteTokenizer()


def load_model(spec: str):
    """(model, tokenizer) for a --model value: the one place models are loaded.

    "tiny-random" is built here; anything else goes to camkv.models.load (the default
    SmolLM2 GGUF, a .gguf file, an mlx-lm folder or a Hugging Face id).
    """
    if spec == TINY_MODEL:
        return tiny_random_model()
    from . import models

    return models.load(spec)


def cast_model(model, dtype_name: str):
    """Cast floating weights: "auto" is float32 on the CPU (far faster there) and as-is elsewhere."""
    if dtype_name == "auto":
        if mx.default_device().type != mx.DeviceType.cpu:
            return model
        dtype_name = "float32"
    dtype = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}[dtype_name]
    from mlx.utils import tree_map

    floating = (mx.float32, mx.float16, mx.bfloat16)
    model.update(tree_map(lambda a: a.astype(dtype) if a.dtype in floating else a,
                          model.parameters()))
    mx.eval(model.parameters())
    return model


# ---------------------------------------------------------------------------- methods


@dataclass(frozen=True)
class Method:
    name: str
    kind: str  # "full", "streaming" or "camkv"
    merge: str = "drop"
    gate: bool = False
    scoring: str = "key"
    merge_keys: bool = False
    mass_bias: bool = False


MERGE_ARMS = ("sim_weighted", "mean", "mass_weighted", "window", "window_mass")
KEY_MERGE_ARMS = ("sim_weighted", "mass_weighted")  # nearest-survivor rules that can blend keys
BIAS_MERGE_ARMS = ("sim_weighted", "mean", "mass_weighted", "window_mass")  # blending rules


def method_catalog() -> dict[str, Method]:
    """Every arm, by name, in the order tables and plots list them."""
    methods = [Method("full", "full"), Method("streamingllm", "streaming")]
    for scoring in ("key", "query"):
        suffix = "" if scoring == "key" else "-query"
        methods.append(Method("h2o" + suffix, "camkv", "drop", False, scoring))
        for merge in MERGE_ARMS:
            for gate in (True, False):
                name = merge + ("" if gate else "-nogate") + suffix
                methods.append(Method(name, "camkv", merge, gate, scoring))
        for merge in KEY_MERGE_ARMS:  # blending the keys too (merge_keys), ungated
            methods.append(Method(merge + "-keys-nogate" + suffix, "camkv", merge, False, scoring, True))
    for merge in BIAS_MERGE_ARMS:  # merged rows attend with their mass (mass_bias), ungated
        methods.append(Method(merge + "-nogate-bias-query", "camkv", merge, False, "query", mass_bias=True))
    for merge in KEY_MERGE_ARMS:  # ... and with their keys blended too (token merging's form)
        methods.append(Method(merge + "-keys-nogate-bias-query", "camkv", merge, False, "query", True, True))
    return {m.name: m for m in methods}


METHOD_GROUPS = {
    "all": list(method_catalog()),
    "key": [n for n, m in method_catalog().items() if m.scoring == "key"],
    "core": ["full", "streamingllm", "h2o", "sim_weighted", "sim_weighted-nogate",
             "mass_weighted-nogate", "window"],
    # How to merge: every blend rule against dropping, ungated, both scorings.
    "merge": ["full"] + [name + suffix for suffix in ("", "-query") for name in
                         ("h2o", "sim_weighted-nogate", "mass_weighted-nogate", "window-nogate",
                          "window_mass-nogate")],
}


def parse_methods(spec: str) -> list[Method]:
    catalog = method_catalog()
    names: list[str] = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        if item in METHOD_GROUPS:
            names += METHOD_GROUPS[item]
        elif item in catalog:
            names.append(item)
        else:
            raise ValueError(
                f"--methods: unknown method {item!r}; known: groups {sorted(METHOD_GROUPS)} "
                f"or {', '.join(catalog)}"
            )
    if "full" not in names:
        names.insert(0, "full")  # every metric is measured against it
    return [catalog[n] for n in dict.fromkeys(names)]


@dataclass(frozen=True)
class CacheSettings:
    n_sink: int
    recent: int | str  # tokens, or "N%" of each budget
    window: int
    seed: int
    backend: str

    def recent_for(self, budget: int) -> int:
        """The recent window (tokens) of a cache of this budget."""
        return recent_tokens(self.recent, budget)


def recent_tokens(recent: int | str, budget: int) -> int:
    """A --recent value (tokens, or "N%" of the budget, rounded down, at least 1) in tokens."""
    if isinstance(recent, str):
        return max(1, int(budget * float(recent[:-1]) / 100))
    return recent


def make_cache(model, method: Method, budget: int | None, settings: CacheSettings) -> list:
    """A fresh cache list for one arm (budget is ignored by the full cache)."""
    if method.kind == "full":
        return make_prompt_cache(model)
    if method.kind == "streaming":
        caches = make_prompt_cache(model)
        return [RotatingKVCache(max_size=budget, keep=settings.n_sink) if type(c) is KVCache
                else c for c in caches]
    return camkv_prompt_cache(
        model, budget=budget, n_sink=settings.n_sink, recent=settings.recent_for(budget),
        merge=method.merge, gate=method.gate, scoring=method.scoring, merge_keys=method.merge_keys,
        window=settings.window, mass_bias=method.mass_bias,
        seed=settings.seed, prefill="chunk", backend=settings.backend,
    )


def release_cache(model, method: Method) -> None:
    """Undo what make_cache installed in the model (the attention hook of scoring="query")."""
    if method.kind == "camkv" and method.scoring == "query":
        hook.uninstall(model)


def cache_stats(caches: list) -> dict:
    """KV bytes held (all layers) and camkv's eviction / merge counters."""
    stats = {"kv_bytes": int(kv_bytes(caches))}
    camkv_stats = [c.stats for c in caches if hasattr(c, "stats")]
    if camkv_stats:
        stats["evictions"] = sum(s["evictions"] for s in camkv_stats)
        stats["merges"] = sum(s["merges"] for s in camkv_stats)
    return stats


# ---------------------------------------------------------------------------- budgets


@dataclass(frozen=True)
class Budget:
    label: str  # "10%" or "256"
    fraction: float | None
    tokens: int | None

    def resolve(self, context: int) -> int:
        return round(self.fraction * context) if self.fraction is not None else self.tokens


def _share_or_count(text: str) -> tuple[float | None, int | None]:
    """(fraction, None) for "N%" with 0 < N < 100, (None, tokens) for a count >= 1;
    ValueError otherwise."""
    if text.endswith("%"):
        fraction = float(text[:-1]) / 100
        if not 0 < fraction < 1:
            raise ValueError(text)
        return fraction, None
    tokens = int(text)
    if tokens < 1:
        raise ValueError(text)
    return None, tokens


def parse_budgets(spec: str) -> list[Budget]:
    budgets = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        try:
            budgets.append(Budget(item, *_share_or_count(item)))
        except ValueError:
            raise ValueError(
                f"--budgets: {item!r} is neither a percentage in (0%, 100%) nor a positive "
                "token count"
            ) from None
    if not budgets:
        raise ValueError("--budgets is empty")
    return budgets


def budgets_for(context: int, budgets: list[Budget], settings: CacheSettings,
                notes: set[str]) -> dict[int, list[str]]:
    """Token budgets that evict in a context of `context` tokens, each with its labels.

    A budget at or above the context never evicts (its arm is the full cache) and one
    not above n_sink + recent is invalid for camkv: both are skipped with a note.
    """
    resolved: dict[int, list[str]] = {}
    for budget in budgets:
        tokens = budget.resolve(context)
        if tokens >= context:
            notes.add(f"budget {budget.label} = {tokens} >= context {context}: never evicts, skipped")
        elif tokens <= settings.n_sink + settings.recent_for(tokens):
            notes.add(f"budget {budget.label} = {tokens} of context {context} is not above "
                      f"n_sink + recent = {settings.n_sink + settings.recent_for(tokens)}: skipped")
        else:
            resolved.setdefault(tokens, []).append(budget.label)
    return resolved


# ---------------------------------------------------------------------------- feeding


def feed(model, caches: list, tokens: list[int], prefill_len: int, chunk: int):
    """Yield (first position, logits [n, V]) per model call: prefill chunks, then one token a step."""
    position = 0
    while position < prefill_len:
        n = min(chunk, prefill_len - position)
        yield position, model(mx.array(tokens[position : position + n])[None], cache=caches)[0]
        position += n
    for position in range(prefill_len, len(tokens)):
        yield position, model(mx.array(tokens[position : position + 1])[None], cache=caches)[0]


@dataclass
class Reference:
    """The full cache's next-token log-probabilities at positions start.. of one window."""

    start: int
    logprobs: mx.array  # [positions, V] float32
    argmax: mx.array  # [positions]
    nll: np.ndarray  # [positions]


def _logprobs(logits: mx.array) -> mx.array:
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def full_reference(model, tokens: list[int], prefill_len: int, chunk: int, start: int) -> Reference:
    """Run the full cache over the window once; keep what every arm is compared with."""
    inputs, targets = tokens[:-1], mx.array(tokens[1:])
    blocks = []
    for first, logits in feed(model, make_prompt_cache(model), inputs, prefill_len, chunk):
        keep = max(0, start - first)
        if keep >= logits.shape[0]:
            mx.eval(logits)  # before the first scored position; still bound the lazy graph
            continue
        blocks.append(_logprobs(logits[keep:]))
        mx.eval(blocks[-1])
    logprobs = mx.concatenate(blocks)
    positions = mx.arange(start, len(inputs))
    nll = -mx.take_along_axis(logprobs, targets[positions][:, None], axis=-1)[:, 0]
    argmax = mx.argmax(logprobs, axis=-1)
    mx.eval(nll, argmax)
    return Reference(start, logprobs, argmax, np.array(nll))


def stream_arm(model, caches, tokens, prefill_len, chunk, ref: Reference) -> dict:
    """Per-position (kl, nll, top-1 agreement) of one arm against the reference, positions ref.start.."""
    inputs, targets = tokens[:-1], mx.array(tokens[1:])
    rows = []
    for first, logits in feed(model, caches, inputs, prefill_len, chunk):
        keep = max(0, ref.start - first)
        if keep >= logits.shape[0]:
            mx.eval(logits)  # nothing to score yet; still bound the lazy graph
            continue
        logprobs = _logprobs(logits[keep:])
        lo = first + keep - ref.start
        full = ref.logprobs[lo : lo + logprobs.shape[0]]
        kl = mx.sum(mx.exp(full) * (full - logprobs), axis=-1)
        target = targets[first + keep : first + logits.shape[0]]
        nll = -mx.take_along_axis(logprobs, target[:, None], axis=-1)[:, 0]
        agree = mx.argmax(logprobs, axis=-1) == ref.argmax[lo : lo + logprobs.shape[0]]
        rows.append(mx.stack([kl, nll, agree.astype(mx.float32)], axis=-1))
        # Queue this step and build the next one while it runs.
        mx.async_eval(rows[-1])
    metrics = np.array(mx.concatenate(rows))
    return {"kl": metrics[:, 0], "nll": metrics[:, 1], "agree": metrics[:, 2]}


def summarize_positions(per_position: dict, ref: Reference, lowest: int) -> dict:
    """Sums over positions >= lowest (position i predicts token i + 1)."""
    offset = max(0, lowest - ref.start)
    kl, nll, agree = (per_position[k][offset:] for k in ("kl", "nll", "agree"))
    return {
        "positions": int(kl.size),
        "kl_sum": float(kl.sum()),
        "nll_sum": float(nll.sum()),
        "agree_sum": float(agree.sum()),
        "full_nll_sum": float(ref.nll[offset:].sum()),
    }


# ---------------------------------------------------------------------------- passkey

PASSKEY_INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about the important information there.\n\n"
)
PASSKEY_NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
PASSKEY_QUESTION = "\n\nWhat is the pass key? The pass key is"
SENTENCE_SEARCH = 64  # most tokens to look ahead for a sentence end to hide the key after


@dataclass(frozen=True)
class PasskeyPrompt:
    sample_id: str
    length: int
    depth: float
    key: str
    tokens: list[int]


def _plain_ids(tokenizer, text: str) -> list[int]:
    return texts._drop_special_prefix(tokenizer, tokenizer.encode(text))


def _sentence_end_at_or_after(tokenizer, filler: list[int], index: int) -> int:
    """The first split point at or after index that follows a sentence end (else index).

    The look-ahead is at most 5% of the filler, so the key's depth moves by <= 0.05.
    """
    reach = min(SENTENCE_SEARCH, len(filler) // 20)
    for k in range(max(1, index), min(len(filler), index + reach + 1)):
        if tokenizer.decode([filler[k - 1]]).rstrip().endswith((".", "!", "?", '"')):
            return k
    return index


def passkey_depths(placements: int) -> list[float]:
    if placements == 1:
        return [0.5]
    return [0.1 + 0.8 * j / (placements - 1) for j in range(placements)]


def spread_order(count: int) -> list[int]:
    """0 .. count - 1 ordered so every prefix spreads over the whole range: both ends,
    then the middle, then the quarters, ... (van der Corput). Placements run in this
    order, so a sweep cut by its time budget has keys at every depth, not only the
    shallow ones (a recency cache finds deep keys and misses shallow ones)."""
    order = [0, count - 1][:count]
    k = 1
    while len(set(order)) < count and k < 64 * count:
        x, bit, rest = 0.0, 0.5, k
        while rest:
            x, rest, bit = x + bit * (rest & 1), rest >> 1, bit / 2
        order.append(round(x * (count - 1)))
        k += 1
    seen: set[int] = set()
    unique = [i for i in order if not (i in seen or seen.add(i))]
    return unique + [i for i in range(count) if i not in seen]


def build_passkey(tokenizer, source: str, docs, length: int, depth: float, placement: int,
                  seed: int) -> PasskeyPrompt:
    """Exactly `length` tokens: intro, filler with the key sentence at `depth`, question."""
    rng = random.Random(f"{seed}:passkey:{length}:{placement}")
    key = str(rng.randrange(10000, 100000))
    intro = tokenizer.encode(PASSKEY_INTRO)  # keeps a BOS the tokenizer adds
    needle = _plain_ids(tokenizer, PASSKEY_NEEDLE.format(key=key))
    question = _plain_ids(tokenizer, PASSKEY_QUESTION)
    filler_len = length - len(intro) - len(needle) - len(question)
    if filler_len < 16:
        raise ValueError(
            f"--passkey-lengths: {length} tokens cannot hold the passkey prompt "
            f"({length - filler_len} tokens without filler)"
        )
    window = texts.sample_windows(source, docs, tokenizer, filler_len, 1,
                                  seed=rng.randrange(2**31))[0]
    split = _sentence_end_at_or_after(tokenizer, window.tokens, round(depth * filler_len))
    tokens = intro + window.tokens[:split] + needle + window.tokens[split:] + question
    # Unique whatever --passkey-placements is, so runs with different counts can share a folder.
    sample_id = f"L{length}:d{depth:.3f}:k{key}:{window.sample_id}"
    return PasskeyPrompt(sample_id, length, split / filler_len, key, tokens)


def greedy_answer(model, caches, prompt: list[int], chunk: int, answer_tokens: int, tokenizer) -> str:
    """Prefill the prompt in chunks, then decode greedily through the same cache."""
    logits = None
    for _, logits in feed(model, caches, prompt, len(prompt), chunk):
        mx.eval(logits)
    answer = []
    for _ in range(answer_tokens):
        token = mx.argmax(logits[-1])
        answer.append(int(token))
        logits = model(token.reshape(1, 1), cache=caches)[0]
    return tokenizer.decode(answer)


def is_correct(answer: str, key: str) -> bool:
    """Exact match: the first run of digits in the answer is the key."""
    digits = re.search(r"\d+", answer)
    return digits is not None and digits.group() == key


# ---------------------------------------------------------------------------- the sweep


class OutOfTime(Exception):
    """The --time-budget would be exceeded by the next unit of work."""


class RecordStore:
    """records.jsonl (one finished arm a line, appended as it finishes) and run.json."""

    def __init__(self, out_dir: Path, run_config: dict, fresh: bool):
        self.out_dir = out_dir
        self.records_path = out_dir / "records.jsonl"
        self.config_path = out_dir / "run.json"
        out_dir.mkdir(parents=True, exist_ok=True)
        if fresh:
            self.records_path.unlink(missing_ok=True)
        self._check_same_run(run_config)
        self.config_path.write_text(json.dumps(run_config, indent=1))
        self.records = self.read_records(out_dir)
        self._done = {self.key(r) for r in self.records}

    def _check_same_run(self, run_config: dict) -> None:
        if not (self.records_path.exists() and self.config_path.exists()):
            return
        before = json.loads(self.config_path.read_text())
        differ = [k for k in IDENTITY_KEYS if before.get(k) != run_config.get(k)]
        if differ:
            details = ", ".join(f"{k}: {before.get(k)!r} -> {run_config.get(k)!r}" for k in differ)
            raise ValueError(
                f"{self.out_dir} holds records of a different run ({details}); pass another "
                "--out, or --fresh to discard them"
            )

    @staticmethod
    def read_records(out_dir: Path) -> list[dict]:
        path = out_dir / "records.jsonl"
        if not path.exists():
            return []
        by_key = {}
        for line in path.read_text().splitlines():
            # A run killed mid-write leaves at most one torn last line; it is redone.
            if line.strip().endswith("}"):
                record = json.loads(line)
                by_key[RecordStore.key(record)] = record  # a redone arm counts once
        return list(by_key.values())

    @staticmethod
    def key(record: dict) -> tuple:
        return (record["task"], record["sample"], record["method"], record["budget"])

    def done(self, task: str, sample: str, method: str, budget) -> bool:
        return (task, sample, method, budget) in self._done

    def add(self, record: dict) -> None:
        with self.records_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        self.records.append(record)
        self._done.add(self.key(record))


@contextmanager
def folder_lock(out_dir: Path):
    """One run at a time per folder: two would redo each other's work and interleave records."""
    out_dir.mkdir(parents=True, exist_ok=True)
    lock = out_dir / "run.lock"
    me = f"{socket.gethostname()}:{os.getpid()}"
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        holder = lock.read_text().strip()
        if _lock_holder_alive(holder):
            raise ValueError(f"{out_dir} is in use by another camkv eval ({holder}); wait for "
                             "it or pass another --out") from None
        lock.unlink(missing_ok=True)  # left by a run that was killed
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    os.write(fd, me.encode())
    os.close(fd)
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)


def _lock_holder_alive(holder: str) -> bool:
    host, _, pid = holder.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False  # a lock carried from another machine is stale here
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Clock:
    """Stops the sweep before a unit that would overrun the time budget (mean of past units)."""

    def __init__(self, budget_s: float | None):
        self.start = time.monotonic()
        self.budget_s = budget_s
        self.spent: dict[str, list[float]] = {}

    def check(self, kind: str) -> None:
        if self.budget_s is None:
            return
        past = self.spent.get(kind, [])
        estimate = sum(past) / len(past) if past else 0.0
        if time.monotonic() - self.start + estimate > self.budget_s:
            raise OutOfTime()

    def record(self, kind: str, seconds: float) -> None:
        self.spent.setdefault(kind, []).append(seconds)


@dataclass
class Sweep:
    model: object
    tokenizer: object
    opts: argparse.Namespace
    methods: list[Method]
    budgets: list[Budget]
    settings: CacheSettings
    store: RecordStore
    clock: Clock
    progress: object
    notes: set

    def _unit(self, kind: str, work):
        """Run one unit of work under the clock; returns its result and seconds."""
        self.clock.check(kind)
        started = time.perf_counter()
        result = work()
        seconds = time.perf_counter() - started
        self.clock.record(kind, seconds)
        self.progress.update(1)
        return result, seconds

    def run_stream_window(self, window: texts.Window) -> None:
        opts, tokens = self.opts, window.tokens
        budgets = budgets_for(len(tokens), self.budgets, self.settings, self.notes)
        arms = [(m, b) for m in self.methods if m.kind != "full" for b in budgets
                if not self.store.done("stream", window.sample_id, m.name, b)]
        if not arms:
            return
        start = min(budgets)
        self.progress.set_postfix_str(f"stream {window.sample_id} full")
        ref, _ = self._unit("stream-full", lambda: full_reference(
            self.model, tokens, opts.stream_prefill, opts.chunk, start))
        for method, budget in arms:
            self.progress.set_postfix_str(f"stream {method.name} b={budget}")
            record, seconds = self._unit("stream", lambda: self._stream_record(
                window, method, budget, budgets[budget], ref))
            self.store.add({**record, "seconds": round(seconds, 3)})

    def _stream_record(self, window, method, budget, labels, ref) -> dict:
        caches = make_cache(self.model, method, budget, self.settings)
        try:
            per_position = stream_arm(self.model, caches, window.tokens, self.opts.stream_prefill,
                                      self.opts.chunk, ref)
        finally:
            release_cache(self.model, method)
        return {
            "task": "stream", "sample": window.sample_id, "method": method.name,
            "budget": budget, "labels": labels, "context": len(window.tokens),
            "prefill": self.opts.stream_prefill,
            "decode": summarize_positions(per_position, ref, max(budget, self.opts.stream_prefill)),
            "all": summarize_positions(per_position, ref, budget),
            **cache_stats(caches),
        }

    def run_passkey_prompt(self, prompt: PasskeyPrompt) -> None:
        budgets = budgets_for(prompt.length, self.budgets, self.settings, self.notes)
        arms = [(m, None if m.kind == "full" else b) for m in self.methods
                for b in ([None] if m.kind == "full" else budgets)]
        for method, budget in arms:
            if self.store.done("passkey", prompt.sample_id, method.name, budget):
                continue
            self.progress.set_postfix_str(f"passkey L={prompt.length} {method.name} b={budget}")
            record, seconds = self._unit("passkey", lambda: self._passkey_record(
                prompt, method, budget, budgets.get(budget, [])))
            self.store.add({**record, "seconds": round(seconds, 3)})

    def _passkey_record(self, prompt, method, budget, labels) -> dict:
        caches = make_cache(self.model, method, budget, self.settings)
        try:
            answer = greedy_answer(self.model, caches, prompt.tokens, self.opts.chunk,
                                   self.opts.answer_tokens, self.tokenizer)
        finally:
            release_cache(self.model, method)
        return {
            "task": "passkey", "sample": prompt.sample_id, "method": method.name,
            "budget": budget, "labels": labels, "length": prompt.length,
            "depth": round(prompt.depth, 4), "key": prompt.key, "answer": answer,
            "correct": is_correct(answer, prompt.key), **cache_stats(caches),
        }


# ---------------------------------------------------------------------------- planning


def load_documents(sources: list[str], offline: bool) -> dict[str, list]:
    """The documents of each source that is available; the others are reported and skipped."""
    documents = {}
    for source in sources:
        try:
            documents[source] = texts.load_source(source, offline=offline)
        except texts.SourceUnavailable as err:
            print(f"camkv eval: skipping text source {source!r}: {err}", file=sys.stderr)
    if not documents:
        raise ValueError(f"none of the text sources {sources} is available (see messages above)")
    return documents


def plan_rounds(opts, documents, tokenizer) -> list[tuple[list, list]]:
    """Work in rounds: round r = stream window r of every source + passkey placement r of every length.

    Interleaving keeps a sweep cut by the time budget balanced across tasks, methods
    and lengths: fewer samples everywhere rather than a missing task.
    """
    tasks = set(opts.tasks)
    windows = []
    if "stream" in tasks:
        per_source = [texts.sample_windows(src, docs, tokenizer, opts.stream_tokens,
                                           opts.stream_samples, opts.seed)
                      for src, docs in documents.items()]
        windows = [[w[r] for w in per_source] for r in range(opts.stream_samples)]
    prompts = []
    if "passkey" in tasks:
        sources = list(documents)
        depths = passkey_depths(opts.passkey_placements)
        for j in spread_order(len(depths)):
            src, depth = sources[j % len(sources)], depths[j]
            prompts.append([build_passkey(tokenizer, src, documents[src], length, depth, j,
                                          opts.seed) for length in opts.passkey_lengths])
    rounds = max(len(windows), len(prompts))
    return [(windows[r] if r < len(windows) else [], prompts[r] if r < len(prompts) else [])
            for r in range(rounds)]


def describe_plan(opts, methods, budgets, settings) -> str:
    """How much work the options ask for, before any model or text is loaded."""
    arms = len(methods) - 1
    lines = [f"{len(methods)} arms: {', '.join(m.name for m in methods)}"]
    if "stream" in opts.tasks:
        per_window = budgets_for(opts.stream_tokens, budgets, settings, set())
        windows = len(opts.texts) * opts.stream_samples
        lines.append(
            f"stream: {windows} windows of {opts.stream_tokens} tokens x (1 full + {arms} arms x "
            f"{len(per_window)} budgets {sorted(per_window)}) = {windows * (1 + arms * len(per_window))} "
            f"runs, each {opts.stream_prefill} tokens prefilled in chunks of {opts.chunk} then "
            f"{opts.stream_tokens - 1 - opts.stream_prefill} one-token steps")
    if "passkey" in opts.tasks:
        total = 0
        for length in opts.passkey_lengths:
            per_prompt = 1 + arms * len(budgets_for(length, budgets, settings, set()))
            total += opts.passkey_placements * per_prompt
        lines.append(
            f"passkey: {opts.passkey_placements} placements x lengths {opts.passkey_lengths} = "
            f"{total} runs, each a chunked prefill and {opts.answer_tokens} greedy steps")
    return "\n".join(lines)


def count_units(rounds, methods, budgets, settings) -> int:
    arms = len(methods) - 1
    total = 0
    for windows, prompts in rounds:
        for w in windows:
            total += 1 + arms * len(budgets_for(len(w.tokens), budgets, settings, set()))
        for p in prompts:
            total += 1 + arms * len(budgets_for(p.length, budgets, settings, set()))
    return total


# ---------------------------------------------------------------------------- CLI


def _int_list(flag: str, spec: str) -> list[int]:
    try:
        values = [int(s) for s in spec.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {spec!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag} must list positive integers, got {spec!r}")
    return values


def _preset_defaults() -> str:
    """The help's list of each preset's values: the defaults of the flags that show none."""
    return "Defaults of the flags above that show none, by --preset: " + "; ".join(
        f"{name}: " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in values.items())
        for name, values in PRESETS.items())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="camkv eval",
        description="Quality of bounded KV caches (StreamingLLM, H2O, camkv merge modes) against "
        "the full cache: streaming KL / top-1 / perplexity and passkey retrieval, on real text. "
        "Writes OUT/records.jsonl as it goes (rerun the same command to resume), then "
        "OUT/summary.json, OUT/table.md and PNG plots.",
        epilog=_preset_defaults(),
    )
    a = p.add_argument
    a("--preset", choices=sorted(PRESETS), default="smoke",
      help="defaults for every flag below: smoke (tiny random model, seconds), cpu (the real "
      "model, one window, 1k passkeys), gpu (the full sweep); default smoke")
    a("--model", help=f"{TINY_MODEL} (smoke), {DEFAULT_MODEL} (SmolLM2-135M-Instruct, loaded by "
      "camkv.models; cpu and gpu presets), or an mlx-lm model folder / Hugging Face id")
    a("--dtype", choices=["auto", "float32", "float16", "bfloat16"], default="auto",
      help="weights' dtype; auto = float32 on the CPU (far faster there), as loaded elsewhere")
    a("--texts", help="comma-separated text sources: builtin, sotu, austen, kjv, or file / "
      "folder paths (cached under $CAMKV_CACHE_DIR/texts, default ~/.cache/camkv/texts)")
    a("--offline", action="store_true", help="never fetch texts: use the cache only")
    a("--fetch-only", action="store_true", help="fetch and cache the texts, then exit")
    a("--tasks", help="comma-separated: stream, passkey")
    a("--methods", help="comma-separated method names or groups (all, key, core, merge); full is "
      f"always included. Methods: {', '.join(method_catalog())}")
    a("--budgets", help="comma-separated budgets: percentages of the context (10%%) or token "
      "counts (256)")
    a("--stream-tokens", type=int, help="tokens per streaming window (the context)")
    a("--stream-prefill", type=int, help="tokens of each window prefilled in chunks before "
      "one-token steps")
    a("--stream-samples", type=int, help="streaming windows per text source")
    a("--chunk", type=int, help="prefill chunk size, the same for every arm")
    a("--passkey-lengths", help="comma-separated passkey prompt lengths in tokens")
    a("--passkey-placements", type=int, help="passkey placements (depths 10%%..90%%, a new key "
      "and filler each) per length")
    a("--answer-tokens", type=int, help="greedy tokens decoded for a passkey answer")
    a("--n-sink", type=int, help="sink tokens kept by camkv, H2O and StreamingLLM (keep)")
    a("--recent", help="recent window protected by camkv and H2O: tokens, or N%% of each budget")
    a("--window", type=int, default=4, help="survivors per eviction in merge=window (default 4)")
    a("--seed", type=int, default=0, help="seed of text windows, passkeys and camkv's gate")
    a("--backend", default="auto", help="camkv backend (auto, reference, ext, metal, cuda)")
    a("--out", help="output folder (default ./camkv-eval-PRESET, in the current folder)")
    a("--time-budget", type=float, help="seconds; stop before a unit of work that would "
      "overrun them (rerun the same command to continue)")
    a("--fresh", action="store_true", help="discard the records already in --out")
    a("--plan", action="store_true", help="print how many runs the options ask for, then exit")
    a("--report-only", action="store_true", help="only rewrite summary, table and plots from "
      "the records in --out")
    a("--no-progress", action="store_true", help="no progress bars")
    return p


def _parse_recent(value) -> int | str:
    """--recent: a token count >= 1, or a share of each budget "N%" with 0 < N < 100."""
    text = str(value).strip()
    try:
        fraction, tokens = _share_or_count(text)
    except ValueError:
        raise ValueError(f"--recent must be a token count >= 1 or a share N% of the budget "
                         f"(0 < N < 100), got {value!r}") from None
    return text if fraction is not None else tokens


def resolve_options(argv, default_out: str = "camkv-eval-{preset}") -> argparse.Namespace:
    """Parsed flags with the preset's values filled in, lists parsed, values checked.

    default_out: the --out folder when none is given ({preset} is filled in).
    """
    opts = build_parser().parse_args(argv)
    for field, value in PRESETS[opts.preset].items():
        if getattr(opts, field) is None:
            setattr(opts, field, value)
    opts.texts = [s.strip() for s in opts.texts.split(",") if s.strip()]
    opts.tasks = [s.strip() for s in opts.tasks.split(",") if s.strip()]
    bad = set(opts.tasks) - {"stream", "passkey"}
    if bad or not opts.tasks:
        raise ValueError(f"--tasks must list stream and/or passkey, got {sorted(bad) or 'nothing'}")
    opts.passkey_lengths = _int_list("--passkey-lengths", opts.passkey_lengths)
    opts.recent = _parse_recent(opts.recent)
    for flag in ("stream_tokens", "stream_samples", "chunk", "passkey_placements",
                 "answer_tokens", "window"):
        if getattr(opts, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(opts, flag)}")
    if opts.n_sink < 0:
        raise ValueError(f"--n-sink must be >= 0, got {opts.n_sink}")
    if not 1 <= opts.stream_prefill < opts.stream_tokens:
        raise ValueError(f"--stream-prefill must be in [1, --stream-tokens), got "
                         f"{opts.stream_prefill} with --stream-tokens {opts.stream_tokens}")
    opts.out = Path(opts.out or default_out.format(preset=opts.preset))
    return opts


# Flags that change what a record means: a folder's records must all share them.
IDENTITY_KEYS = ("model", "dtype", "stream_tokens", "stream_prefill", "chunk", "answer_tokens",
                 "n_sink", "recent", "window", "seed", "backend")
# Flags that only pick which records to make: they may change between runs into one
# folder (e.g. --methods core first, then --methods all adds the other arms).
SELECTION_KEYS = ("texts", "tasks", "methods", "budgets", "stream_samples", "passkey_lengths",
                  "passkey_placements")


def run_config(opts) -> dict:
    """The options a run writes to OUT/run.json."""
    return {k: getattr(opts, k) for k in IDENTITY_KEYS + SELECTION_KEYS}


class _NoProgress:
    def update(self, n=1): ...
    def set_postfix_str(self, text): ...
    def close(self): ...


def _progress_bar(total: int, done: int, disable: bool):
    try:
        from tqdm import tqdm
    except ImportError:
        print("camkv eval: tqdm is not installed: no progress bar", file=sys.stderr)
        return _NoProgress()

    return tqdm(total=total, initial=min(done, total), desc="camkv eval", unit="arm",
                disable=disable, dynamic_ncols=True)


def run(opts) -> dict:
    """Run (or resume) the sweep the options describe; returns the summary."""
    from . import quality_report

    if opts.report_only:
        return quality_report.write_report(opts.out)
    methods, budgets = parse_methods(opts.methods), parse_budgets(opts.budgets)
    settings = CacheSettings(opts.n_sink, opts.recent, opts.window, opts.seed, opts.backend)
    if opts.plan:
        print(describe_plan(opts, methods, budgets, settings))
        return {}
    documents = load_documents(opts.texts, opts.offline)
    if opts.fetch_only:
        print(f"camkv eval: texts cached under {texts.cache_root() / 'texts'}: "
              + ", ".join(f"{s} ({len(d)} documents)" for s, d in documents.items()))
        return {}
    with folder_lock(opts.out):
        return _sweep(opts, documents, methods, budgets, settings)


def _sweep(opts, documents, methods, budgets, settings) -> dict:
    """Every arm not yet in OUT's records, under the time budget; then the report."""
    from . import quality_report

    store = RecordStore(opts.out, run_config(opts), opts.fresh)
    model, tokenizer = load_model(opts.model)
    model = cast_model(model, opts.dtype)
    rounds = plan_rounds(opts, documents, tokenizer)
    progress = _progress_bar(count_units(rounds, methods, budgets, settings),
                             len(store.records), opts.no_progress)
    sweep = Sweep(model, tokenizer, opts, methods, budgets, settings, store,
                  Clock(opts.time_budget), progress, set())
    complete = True
    try:
        for windows, prompts in rounds:
            for window in windows:
                sweep.run_stream_window(window)
            for prompt in prompts:
                sweep.run_passkey_prompt(prompt)
    except OutOfTime:
        complete = False
        print(f"\ncamkv eval: stopped at the time budget ({opts.time_budget:.0f} s); rerun the "
              "same command to continue", file=sys.stderr)
    finally:
        progress.close()
    for note in sorted(sweep.notes):
        print(f"camkv eval: {note}", file=sys.stderr)
    return quality_report.write_report(opts.out, complete=complete, notes=sorted(sweep.notes))


def main(argv=None, default_out: str = "camkv-eval-{preset}") -> int:
    """Entry point of `camkv eval` (argv without the subcommand)."""
    try:
        opts = resolve_options(argv, default_out)
        summary = run(opts)
    except ValueError as err:
        print(f"camkv eval: error: {err}", file=sys.stderr)
        return 2
    if summary:
        print((opts.out / "table.md").read_text())
        drawn = summary.get("plots", [])
        print(f"camkv eval: wrote {opts.out.resolve()}/: summary.json, table.md"
              + (f", {', '.join(drawn)}" if drawn else " (no plots)")
              + ("" if summary.get("complete", True) else " (partial: rerun to continue)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
