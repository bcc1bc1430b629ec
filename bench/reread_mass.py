"""What reconstruction scoring gives a needle's tokens: the re-read mass of each token of
a RULER needle's value, in every camkv layer and KV head, and its percentile among the
rows that compression scored (the share of them with less mass: a compression to a
budget of B of N rows evicts the tokens below percentile 1 - B / N, before protection).

Beside each token's percentile among its own head's rows (what camkv's even split of
the budget over heads reads), its percentile among every head's rows of its layer (one
threshold a layer: heads keeping more or fewer rows) and among every row the run's
compressions scored in any layer (one threshold for the model, as kvpress's KVzip evicts
by default: layers and heads keeping more or fewer rows). The summary counts the
needle's (token, layer, head) rows that each would keep at the run's budget.

Prompts come from `camkv eval --export-prompts FILE` (the suite's own generator, with
its template); a needle's tokens are found as the tokenizer writes " VALUE" in the
prompt. Example (2-core CPU):
    camkv eval --preset cpu-ruler --model gemma-3-270m --chat-template off --ruler-lengths 4096 \\
        --ruler-tasks niah_single_2 --ruler-samples 1 --budgets 90% --methods camkv --out /tmp/p \\
        --export-prompts /tmp/p.jsonl
    python bench/reread_mass.py --model gemma-3-270m --prompts /tmp/p.jsonl --budget 3658
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

from camkv import CaMKVCache, make_prompt_cache, remove
from camkv.eval.ruler import greedy_answer
from camkv.models import load
from camkv.prefill import prefill


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="model (default smollm2-135m-instruct)")
    p.add_argument("--prompts", type=Path, required=True, help="a file of camkv eval --export-prompts")
    p.add_argument("--budget", type=int, required=True, help="camkv's budget in tokens")
    p.add_argument("--chunk", type=int, default=2048, help="prefill chunk (default 2048)")
    p.add_argument("--max-prompts", type=int, default=1, help="prompts of the file to probe (default 1)")
    args = p.parse_args(argv)
    if args.budget < 2:
        p.error(f"--budget must be >= 2 tokens, got {args.budget}")
    return args


def needle_positions(ids: list[int], values: list[str], tokenizer) -> dict[str, list[int]]:
    """Each value's token positions in ids, where the prompt writes it after a space."""
    found = {}
    for value in values:
        tokens = list(tokenizer.encode(" " + value, add_special_tokens=False))
        starts = [i for i in range(len(ids) - len(tokens) + 1) if ids[i:i + len(tokens)] == tokens]
        if starts:
            found[value] = list(range(starts[0], starts[0] + len(tokens)))
    return found


def recording(caches: list) -> list[tuple[int, int, np.ndarray]]:
    """Wrap each camkv cache's compress_pending to keep (layer, the position of its first
    pending row, mass): the pending rows are the last tokens fed (offset counts them all)."""
    seen = []
    for layer, cache in enumerate(caches):
        if isinstance(cache, CaMKVCache):
            def record(mass=None, cache=cache, layer=layer, original=cache.compress_pending):
                if mass is not None:
                    seen.append((layer, cache.offset - cache.pending_rows(), np.array(mass[0], np.float32)))
                return original(mass)
            cache.compress_pending = record
    return seen


def percentiles(mass: np.ndarray, head: int, local: list[int], pooled: np.ndarray) -> tuple[list[float], ...]:
    """For the rows `local` of one head of mass [H, S]: the share of that head's rows with
    less mass, the share of the whole layer's (every head's) rows with less, and the share
    of pooled (every scored row of every layer, sorted) with less."""
    own = mass[head]
    return ([round(float((own < own[i]).mean()), 3) for i in local],
            [round(float((mass < own[i]).mean()), 3) for i in local],
            [round(float(np.searchsorted(pooled, own[i], side="left") / pooled.size), 3) for i in local])


def kept_counts(rows: list[dict], budget: int) -> dict[str, int]:
    """How many needle rows (token, layer, head) a compression to `budget` of each
    record's rows_scored keeps (before protection), and in how many (layer, head) records
    it keeps every token of the needle ("whole_..."): split evenly over heads
    (percentile), by one threshold a layer (layer_percentile) and by one threshold for
    the model (model_percentile)."""
    ways = {"even_split": "percentile", "one_threshold_a_layer": "layer_percentile",
            "one_threshold_for_the_model": "model_percentile"}
    counts = {"needle_rows": 0, "needle_heads": 0, **{f"{k}_{way}": 0 for way in ways for k in ("kept", "whole")}}
    for row in rows:
        below = 1.0 - min(1.0, budget / row["rows_scored"])  # the share of rows evicted
        counts["needle_rows"] += len(row["percentile"])
        counts["needle_heads"] += 1
        for way, key in ways.items():
            kept = [q >= below for q in row[key]]
            counts[f"kept_{way}"] += sum(kept)
            counts[f"whole_{way}"] += all(kept)
    return counts


def probe(model, tokenizer, prompt: dict, budget: int, chunk: int) -> dict:
    ids = prompt["context_ids"] + prompt["question_ids"]
    positions = needle_positions(ids, prompt["expected"], tokenizer)
    caches = make_prompt_cache(model, budget=budget, prefill_scoring="reconstruct")
    seen = recording(caches)
    logits = prefill(model, caches, ids, chunk, tokenizer)
    sample = argparse.Namespace(answer_tokens=prompt["max_new_tokens"])
    answer = greedy_answer(model, caches, logits, sample, tokenizer)
    remove(model)
    rows = []
    pooled = np.sort(np.concatenate([mass.ravel() for _, _, mass in seen] or [np.zeros(0, np.float32)]))
    for layer, first, mass in seen:  # mass [H, pending]: positions first.. of the prompt
        for value, where in positions.items():
            local = [p - first for p in where if 0 <= p - first < mass.shape[1]]
            if not local:
                continue
            for head, head_mass in enumerate(mass):
                own, whole, model_wide = percentiles(mass, head, local, pooled)
                rows.append({"layer": layer, "head": head, "value": value, "first_position": first,
                             "rows_scored": int(mass.shape[1]),
                             "mass": [round(float(head_mass[i]), 4) for i in local],
                             "percentile": own, "layer_percentile": whole, "model_percentile": model_wide})
    return {"sample": prompt["sample"], "expected": prompt["expected"], "answer": answer, "needles": rows,
            "kept": kept_counts(rows, budget)}


def main(argv=None) -> int:
    args = parse_args(argv)
    model, tokenizer = load(args.model)
    prompts = [json.loads(line) for line in args.prompts.open()][: args.max_prompts]
    for prompt in prompts:
        got = probe(model, tokenizer, prompt, args.budget, args.chunk)
        print(f"{got['sample']}: expected {got['expected']}, answered {got['answer'][:40]!r}")
        for row in got["needles"]:
            print(f"  layer {row['layer']:2d} head {row['head']} {row['value']}: mass {row['mass']} "
                  f"percentile {row['percentile']} (of {row['rows_scored']} rows), in the layer "
                  f"{row['layer_percentile']}")
        kept = got["kept"]
        for way in ("even_split", "one_threshold_a_layer", "one_threshold_for_the_model"):
            print(f"  {way.replace('_', ' ')} at budget {args.budget}: {kept['kept_' + way]} of "
                  f"{kept['needle_rows']} needle rows kept, the whole needle in {kept['whole_' + way]} of "
                  f"{kept['needle_heads']} (layer, head)")
    return 0


if __name__ == "__main__":
    from camkv._blas import reexec_with_openblas

    reexec_with_openblas()
    sys.exit(main())
