"""Drop against a merge rule from `camkv eval` folders: passkeys found over the prompts
every arm finished (with the paired counts: prompts only one of the two found), and the
stream KL from the full cache per window and over all windows.

    python bench/merge_verdict.py --passkeys bench/results/quality-cpu-passkeys-MODEL \
        --streams bench/results/quality-cpu-streams-MODEL [--drop h2o-query] [--merge keepkv-nogate-query] \
        [--pair streamingllm:cam]

Prints markdown tables; reads records.jsonl only (no model is loaded).
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path


def read_records(folder: Path) -> list[dict]:
    path = folder / "records.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _label(record: dict) -> str:
    return "full" if record["budget"] is None else "/".join(record.get("labels") or [str(record["budget"])])


def passkey_table(records: list[dict], pairs: list[tuple[str, str]]) -> list[str]:
    """Keys found per method and budget, each budget over the prompts on which the full
    cache and every method at that budget finished; then, per pair (a, b) and budget, the
    prompts only one of the two found and the sign test of those."""
    found: dict[tuple[str, str], dict[str, bool]] = defaultdict(dict)
    seconds: dict[tuple[str, str], list[float]] = defaultdict(list)
    for r in records:
        if r["task"] != "passkey":
            continue
        found[(r["method"], _label(r))][r["sample"]] = bool(r["correct"])
        seconds[(r["method"], _label(r))].append(r.get("seconds", 0.0))
    if not found:
        return ["(no passkey records)"]
    labels = sorted({lab for _, lab in found if lab != "full"}, key=lambda s: float(s.rstrip("%")))
    methods = list(dict.fromkeys(m for m, _ in found))
    common = {lab: set(found.get(("full", "full"), {})).intersection(
        *(set(found.get((m, lab), {})) for m in methods if m != "full")) for lab in labels}
    lines = ["Passkeys found, each budget over the n prompts every arm finished at it:", "",
             "| method | " + " | ".join(f"{lab} (n = {len(common[lab])})" for lab in labels)
             + " | mean seconds per run |",
             "| --- |" + " --- |" * (len(labels) + 1)]
    for m in methods:
        cells = []
        for lab in labels:
            hits = sum(found[(m, "full" if m == "full" else lab)][s] for s in common[lab])
            cells.append(f"{hits} ({100 * hits / max(len(common[lab]), 1):.0f}%)")
        spent = [x for lab in (["full"] if m == "full" else labels) for x in seconds[(m, lab)]]
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {sum(spent) / max(len(spent), 1):.1f} |")
    lines.append("")
    for a, b in pairs:
        for lab in labels:
            if (a, lab) in found and (b, lab) in found:
                only_a = sum(found[(a, lab)][s] and not found[(b, lab)][s] for s in common[lab])
                only_b = sum(found[(b, lab)][s] and not found[(a, lab)][s] for s in common[lab])
                lines.append(f"- {lab}: found by {a} only: {only_a}, by {b} only: {only_b} "
                             f"(two-sided sign test p = {sign_test(only_a, only_b):.2f})")
    return lines


def sign_test(a: int, b: int) -> float:
    """Two-sided exact binomial test of a against b discordant pairs (McNemar's exact test)."""
    n = a + b
    if n == 0:
        return 1.0
    k = min(a, b)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def stream_table(records: list[dict], drop: str, merge: str) -> list[str]:
    """Mean KL (decode steps) per window and over all windows, drop against the merge rule."""
    kl: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
    pos: dict[tuple[str, str], dict[str, int]] = defaultdict(dict)
    for r in records:
        if r["task"] != "stream" or r["method"] not in (drop, merge):
            continue
        cell = r["decode"]
        kl[(r["method"], _label(r))][r["sample"]] = cell["kl_sum"] / max(cell["positions"], 1)
        pos[(r["method"], _label(r))][r["sample"]] = cell["positions"]
    if not kl:
        return ["(no stream records)"]
    labels = sorted({lab for _, lab in kl}, key=lambda s: float(s.rstrip("%")))
    lines = ["| budget | window | " + f"{drop} KL | {merge} KL | change |", "| --- | --- | --- | --- | --- |"]
    for lab in labels:
        windows = sorted(set(kl.get((drop, lab), {})) & set(kl.get((merge, lab), {})))
        for w in windows:
            d, m = kl[(drop, lab)][w], kl[(merge, lab)][w]
            lines.append(f"| {lab} | {w} | {d:.4f} | {m:.4f} | {100 * (m / d - 1):+.0f}% |")
        if windows:
            # Over all windows: the mean over every one-token step (windows weigh by their steps).
            steps = sum(pos[(drop, lab)][w] for w in windows)
            d = sum(kl[(drop, lab)][w] * pos[(drop, lab)][w] for w in windows) / steps
            m = sum(kl[(merge, lab)][w] * pos[(merge, lab)][w] for w in windows) / steps
            below = sum(kl[(merge, lab)][w] < kl[(drop, lab)][w] for w in windows)
            lines.append(f"| {lab} | **all {len(windows)}** | **{d:.4f}** | **{m:.4f}** | "
                         f"**{100 * (m / d - 1):+.0f}%** ({below} of {len(windows)} windows lower) |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--passkeys", type=Path, action="append", default=[])
    p.add_argument("--streams", type=Path, action="append", default=[])
    p.add_argument("--drop", default="h2o-query", help="the dropping arm (default h2o-query)")
    p.add_argument("--merge", default="keepkv-nogate-query", help="the merging arm (default keepkv-nogate-query)")
    p.add_argument("--pair", action="append", default=[], metavar="A:B",
                   help="another pair of arms whose passkeys are compared prompt by prompt (e.g. streamingllm:cam)")
    opts = p.parse_args(argv)
    pairs = [(opts.drop, opts.merge)] + [tuple(pair.split(":", 1)) for pair in opts.pair]
    for folder in opts.passkeys:
        print(f"## {folder}\n")
        print("\n".join(passkey_table(read_records(folder), pairs)) + "\n")
    for folder in opts.streams:
        print(f"## {folder}\n")
        print("\n".join(stream_table(read_records(folder), opts.drop, opts.merge)) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
