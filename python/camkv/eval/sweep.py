"""The sweep of `camkv eval`: every arm at every budget over rounds of stream windows
and passkey prompts, under a time budget, into the record store, then the report."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from . import report, ruler, ruler_export, texts
from .arms import DEFAULT_ARM, Arm, CacheSettings, cache_stats, make_cache, parse_arm_spec, parse_methods, release_cache
from .budgets import Budget, budgets_for, parse_budgets
from .loading import cast_model, load_model
from .passkey import PasskeyPrompt, build_passkey, greedy_answer, is_correct, passkey_depths, spread_order
from .records import RecordStore, folder_lock, run_config
from .stream import full_reference, stream_arm, summarize_positions


class OutOfTime(Exception):
    """The --time-budget would be exceeded by the next unit of work."""


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
    methods: list[Arm]
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
                                      self.opts.chunk, ref, self.tokenizer)
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
    if "ruler" in opts.tasks:
        lines.append(ruler.describe_plan(opts, arms, budgets, settings))
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


def run(opts) -> dict:
    """Run (or resume) the sweep the options describe; returns the summary."""
    if opts.report_only:
        return report.write_report(opts.out, versus=opts.versus)
    methods = parse_methods(opts.methods) + [parse_arm_spec(spec) for spec in opts.arms]
    budgets = parse_budgets(opts.budgets)
    settings = CacheSettings(opts.n_sink, opts.recent, opts.window, opts.seed, opts.backend,
                             prefill_scoring=opts.prefill_scoring,
                             observation_window=opts.observation_window, pool=opts.pool)
    _check_versus(opts.versus, methods, opts.out)
    if opts.plan:
        print(describe_plan(opts, methods, budgets, settings))
        return {}
    documents = load_documents(opts.texts, opts.offline)
    if opts.fetch_only:
        print(f"camkv eval: texts cached under {texts.cache_root() / 'texts'}: "
              + ", ".join(f"{s} ({len(d)} documents)" for s, d in documents.items()))
        return {}
    if opts.export_prompts is not None:
        return _export_prompts(opts, documents)
    with folder_lock(opts.out):
        return _sweep(opts, documents, methods, budgets, settings)


def _check_versus(versus: str, methods, out) -> None:
    """--versus names an arm of this run or of the records already in OUT (checked before
    any arm runs)."""
    known = {m.name for m in methods}
    if versus in known or versus == DEFAULT_ARM:
        return
    if out is not None and Path(out, "records.jsonl").exists():
        known |= {r.get("method") for r in RecordStore.read_records(Path(out))}
    if versus not in known:
        raise ValueError(f"--versus must name an arm of the run or of its records, got {versus!r}; "
                         f"the arms are {', '.join(sorted(k for k in known if k))}")


def _export_prompts(opts, documents) -> dict:
    """--export-prompts: the RULER prompts of the plan to a file; no model runs."""
    _, tokenizer = load_model(opts.model)
    count = ruler_export.export_prompts(opts, documents, tokenizer, opts.export_prompts)
    print(f"camkv eval: wrote {count} RULER prompts to {opts.export_prompts}")
    return {}


def _sweep(opts, documents, methods, budgets, settings) -> dict:
    """Every arm not yet in OUT's records, under the time budget; then the report."""
    store = RecordStore(opts.out, run_config(opts), opts.fresh)
    model, tokenizer = load_model(opts.model)
    model = cast_model(model, opts.dtype)
    rounds = plan_rounds(opts, documents, tokenizer)
    ruler_rounds = ruler.plan_rounds(opts, documents, tokenizer) if "ruler" in opts.tasks else []
    progress = _progress_bar(count_units(rounds, methods, budgets, settings)
                             + ruler.count_units(ruler_rounds, methods, budgets, settings),
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
        for samples in ruler_rounds:
            for sample in samples:
                ruler.run_sample(sweep, sample)
    except OutOfTime:
        complete = False
        print(f"\ncamkv eval: stopped at the time budget ({opts.time_budget:.0f} s); rerun the "
              "same command to continue", file=sys.stderr)
    finally:
        progress.close()
    for note in sorted(sweep.notes):
        print(f"camkv eval: {note}", file=sys.stderr)
    return report.write_report(opts.out, complete=complete, notes=sorted(sweep.notes), versus=opts.versus)


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
