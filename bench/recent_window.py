"""How large should the recent window be? KL and passkey accuracy against it.

    python bench/recent_window.py

Reads the quality sweeps that differ only in --recent (bench/results/quality-gpu is
recent 32; quality-gpu-recentN were made by the commands in bench/results/README.md,
"The recent window") and writes bench/results/recent-window.json and .png: for each
query-scored arm and budget, the stream KL from the full cache against the recent
window as a share of the budget, and the passkey accuracy of each sweep paired on the
prompts every sweep ran (so that a sweep cut short is compared on the same keys).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

RESULTS = Path(__file__).resolve().parent / "results"
FOLDERS = ("quality-gpu", "quality-gpu-recent128", "quality-gpu-recent256", "quality-gpu-recent25pct",
           "quality-gpu-recent512", "quality-gpu-recent1024")
METHODS = ("h2o-query", "mass_weighted-nogate-query")
LABELS = ("20%", "50%")
CONTEXT = 4096  # the gpu preset's stream windows


def stream_points(folders) -> list[dict]:
    """One point per (arm, budget label, recent window): the KL, from the sweep with
    the most windows where two sweeps ran the same setting."""
    from camkv.eval.arms import recent_tokens

    points: dict = {}
    for folder in folders:
        summary = json.loads((RESULTS / folder / "summary.json").read_text())
        recent = summary["config"]["recent"]
        for method in METHODS:
            for label, cell in summary["stream"]["decode"].get(method, {}).items():
                if label not in LABELS:
                    continue
                budget = round(float(label[:-1]) / 100 * CONTEXT)
                tokens = recent_tokens(recent, budget)
                point = {"sweep": folder, "method": method, "budget": label, "recent": tokens,
                         "recent_share": tokens / budget, "kl": cell["kl"],
                         "top1": cell["top1"], "windows": cell["windows"]}
                key = (method, label, tokens)
                if key not in points or points[key]["windows"] < point["windows"]:
                    points[key] = point
    return list(points.values())


def paired_passkey(folders) -> list[dict]:
    """Passkey exact match per sweep on the prompts every sweep with passkeys ran."""
    outcomes = defaultdict(dict)  # (method, budget label, sample) -> sweep -> correct
    sweeps = []
    for folder in folders:
        records = [json.loads(line) for line in (RESULTS / folder / "records.jsonl").read_text().splitlines()
                   if line.strip()]
        passkeys = [r for r in records if r["task"] == "passkey" and r["method"] in METHODS]
        if passkeys:
            sweeps.append(folder)
        for r in passkeys:
            for label in r["labels"]:
                if label in LABELS:
                    outcomes[(r["method"], label, r["sample"])][folder] = bool(r["correct"])
    rows = []
    for method in METHODS:
        for label in LABELS:
            common = [by for (m, lb, _), by in outcomes.items()
                      if m == method and lb == label and all(s in by for s in sweeps)]
            for sweep in sweeps:
                rows.append({"method": method, "budget": label, "sweep": sweep, "n": len(common),
                             "correct": sum(by[sweep] for by in common)})
    return rows


def plot(points: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for method in METHODS:
        for label, marker in zip(LABELS, ("o", "s")):
            mine = sorted((p for p in points if p["method"] == method and p["budget"] == label),
                          key=lambda p: p["recent_share"])
            if mine:
                ax.plot([100 * p["recent_share"] for p in mine], [p["kl"] for p in mine],
                        marker=marker, linestyle="-" if method == "h2o-query" else "--",
                        label=f"{method}, budget {label}")
    ax.axvline(25, color="grey", linewidth=0.8, linestyle=":")
    ax.text(26, ax.get_ylim()[1] * 0.92, "default: 25%", color="grey", fontsize=8)
    ax.set_xscale("log")
    ax.set_xticks([2, 5, 10, 25, 50], ["2", "5", "10", "25", "50"])
    ax.minorticks_off()
    ax.set_xlabel("recent window, % of the budget (log scale)")
    ax.set_ylabel("mean KL from the full cache (nats)")
    ax.set_title("SmolLM2-135M, 4k-token windows, H200: the recent window")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(RESULTS / "recent-window"),
                        help="path without suffix for the .json and .png (default: %(default)s)")
    opts = parser.parse_args(argv)
    folders = [f for f in FOLDERS if (RESULTS / f / "summary.json").exists()]
    points, passkey = stream_points(folders), paired_passkey(folders)
    out = Path(opts.out)
    out.with_suffix(".json").write_text(json.dumps({"stream": points, "passkey": passkey}, indent=1))
    plot(points, out.with_suffix(".png"))
    for p in points:
        print(f"{p['method']:28s} budget {p['budget']:>4s} recent {p['recent']:5d} "
              f"({100 * p['recent_share']:5.1f}%): KL {p['kl']:.4f} ({p['windows']} windows)")
    for r in passkey:
        print(f"passkey {r['method']:28s} {r['budget']:>4s} {r['sweep']:26s} {r['correct']}/{r['n']}")
    print(f"wrote {out.with_suffix('.json')} and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
