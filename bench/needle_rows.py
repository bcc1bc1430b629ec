"""Which rows of a RULER needle a cache keeps through a prompt's prefill, per arm.

For RULER needle prompts (the suite's own generator, camkv eval --tasks ruler), each arm
prefills the whole prompt (context and question) in chunks, as the suite does; then, in
every layer and KV head, the needle's token positions still held are counted, and the
greedy answer is scored as RULER scores it. Reported per arm: the share of the needles'
(token, layer, head) rows kept, the share of (layer, head) rows that kept every token of
a needle, both by needle depth (first, middle and last third of the haystack), and the
answers' RULER score. Arms: camkv configurations as JSON over CaMConfig's defaults at the
budget (--arm NAME=JSON, repeatable; default: camkv's default and max-pooled window
scoring over 5 and 7 rows). Example (2-core CPU, chunks of 2048 as the GPU preset):
    python bench/needle_rows.py --model smollm2-135m-instruct --tasks niah_single_2,niah_multikey_1 \\
        --samples 3 --budget 50% --out bench/results/needle-rows-cpu/smollm2-4k-50.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from tqdm import tqdm

from camkv import make_prompt_cache, remove
from camkv.eval import arms, budgets, ruler, ruler_scoring, sweep
from camkv.models import load
from camkv.prefill import prefill

DEFAULT_ARMS = ('default={}', 'pool5={"pool": 5}', 'pool7={"pool": 7}')
THIRDS = ("first", "middle", "last")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="model (default smollm2-135m-instruct)")
    p.add_argument("--tasks", default="niah_single_2,niah_multikey_1",
                   help="RULER needle tasks, comma-separated (default niah_single_2,niah_multikey_1)")
    p.add_argument("--length", type=int, default=4096, help="prompt length in tokens (default 4096)")
    p.add_argument("--samples", type=int, default=3, help="prompts a task (default 3)")
    p.add_argument("--budget", default="50%", help="cache budget: N%% of the context or tokens (default 50%%)")
    p.add_argument("--chunk", type=int, default=2048, help="prefill chunk (default 2048, mlx-lm's step)")
    p.add_argument("--texts", default="sotu,austen,kjv", help="haystack sources (default sotu,austen,kjv)")
    p.add_argument("--chat-template", default="auto", choices=("auto", "on", "off"),
                   help="the model's chat template around the prompt (default auto)")
    p.add_argument("--arm", action="append", default=[], metavar="NAME=JSON",
                   help="an arm: CaMConfig fields as JSON (repeatable; default: default, pool5, pool7)")
    p.add_argument("--seed", type=int, default=0, help="prompt seed (default 0)")
    p.add_argument("--out", type=Path, default=None, help="JSON file to write (default: none)")
    args = p.parse_args(argv)
    try:  # camkv eval's own readings of --arm and --budgets
        args.arms = {arm.name: arm for arm in map(arms.parse_arm_spec, args.arm or DEFAULT_ARMS)}
        shares = budgets.parse_budgets(args.budget)
    except ValueError as error:
        p.error(str(error))
    if len(shares) != 1:
        p.error(f"--budget takes one share or count, got {args.budget!r}")
    args.budget_share = shares[0]
    if any(arm.equal_bytes for arm in args.arms.values()):
        p.error("--arm: equal_bytes is camkv eval's (it needs the default cache's bytes); give a budget share")
    args.task_list = [t for t in args.tasks.split(",") if t]
    unknown = [t for t in args.task_list if t not in ruler.NIAH]
    if unknown or args.samples < 1:
        p.error(f"--tasks takes needle tasks ({', '.join(ruler.NIAH)}), got {unknown}; --samples >= 1, "
                f"got {args.samples}")
    return args


def needle_rows(caches, spans) -> list[dict]:
    """Per needle span [start, end): rows kept of its (token, layer, head) rows, and the
    (layer, head) rows that hold all of its tokens."""
    held = [c.stored()[3][0] for c in caches if hasattr(c, "stored")]  # [H, n] positions a layer
    counts = []
    for start, end in spans:
        tokens = end - start
        kept = whole = heads = 0
        for positions in held:
            inside = ((positions >= start) & (positions < end)).sum(axis=1)  # [H]
            kept += int(inside.sum())
            whole += int((inside == tokens).sum())
            heads += positions.shape[0]
        counts.append({"kept": kept / (tokens * heads), "whole": whole / heads})
    return counts


def run_arm(model, tokenizer, sample, arm, args) -> dict:
    budget = args.budget_share.resolve(len(sample.context))
    config = arm.config.replace(budget=budget)
    caches = make_prompt_cache(model, config=config)
    try:
        logits = prefill(model, caches, sample.tokens, args.chunk, tokenizer)
        needles = needle_rows(caches, sample.spans)
        text = ruler.greedy_answer(model, caches, logits, sample, tokenizer)
    finally:
        remove(model)
    return {"budget": budget, "config": repr(config), "needles": needles, "answer": text,
            "score": ruler_scoring.ruler_score(text, sample.answers)}


def third(depth: float) -> str:
    return THIRDS[min(2, int(depth * 3))]


def summary(records: list[dict], arms) -> dict:
    """Per arm: mean kept / whole shares by third of depth, and the mean score."""
    out = {}
    for arm in arms:
        rows = [r for r in records if r["arm"] == arm]
        by_third = {t: {"kept": [], "whole": []} for t in THIRDS}
        for r in rows:
            for depth, needle in zip(r["depths"], r["needles"]):
                for key in ("kept", "whole"):
                    by_third[third(depth)][key].append(needle[key])
        out[arm] = {"score": statistics.mean(r["score"] for r in rows),
                    **{f"{key}_{t}": (statistics.mean(v[key]) if v[key] else None)
                       for t, v in by_third.items() for key in ("kept", "whole")}}
    return out


def print_summary(table: dict) -> None:
    def cell(v):
        return "-" if v is None else f"{100 * v:5.1f}"
    print("arm          score   rows kept % (first / middle / last)   heads with the whole needle %")
    for arm, s in table.items():
        kept = " / ".join(cell(s[f"kept_{t}"]) for t in THIRDS)
        whole = " / ".join(cell(s[f"whole_{t}"]) for t in THIRDS)
        print(f"{arm:12s} {100 * s['score']:5.1f}   {kept}          {whole}")


def main(argv=None) -> int:
    args = parse_args(argv)
    model, tokenizer = load(args.model)
    documents = sweep.load_documents([s for s in args.texts.split(",") if s], offline=False)
    chat = ruler.chat_parts(tokenizer, args.chat_template)
    sources = list(documents)
    records, started = [], time.perf_counter()
    plan = [(task, i) for task in args.task_list for i in range(args.samples)]
    for task, i in tqdm(plan, desc="needle prompts"):
        source = sources[i % len(sources)]
        sample = ruler.build_sample(task, tokenizer, source, documents[source], ruler.vocabulary(documents[source]),
                                    args.length, i, args.seed, chat)
        for name, arm in args.arms.items():
            r = run_arm(model, tokenizer, sample, arm, args)
            records.append({"sample": sample.sample_id, "task": task, "arm": name,
                            "depths": list(sample.depths), "expected": list(sample.answers), **r})
    table = summary(records, args.arms)
    print_summary(table)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"command": " ".join(sys.argv), "settings": {
            k: str(v) for k, v in vars(args).items()}, "seconds": time.perf_counter() - started,
            "summary": table, "records": records}, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    from camkv._blas import reexec_with_openblas

    reexec_with_openblas()
    sys.exit(main())
