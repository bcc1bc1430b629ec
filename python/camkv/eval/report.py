"""Summaries, markdown tables and PNG plots of `camkv eval` records (OUT/records.jsonl).

Everything here is recomputed from the records, so `camkv eval --report-only --out OUT`
redraws every figure and table of a run without touching a model.
"""

from __future__ import annotations

import json
import math
import sys
from collections import defaultdict
from pathlib import Path

from .. import merges
from .arms import DEFAULT_ARM, method_catalog
from .budgets import parse_budgets
from .records import RecordStore
from .ruler_report import plot_ruler, ruler_tables, summarize_ruler

SUBSETS = ("decode", "all")


def _label_order(config: dict, records: list[dict]) -> list[str]:
    """This run's budget labels, then any others earlier runs into the folder used."""
    labels = [b.label for b in parse_budgets(config["budgets"])]
    for r in records:
        labels += [lb for lb in r["labels"] if lb not in labels]
    return labels


def _method_order(records: list[dict]) -> list[str]:
    present = {r["method"] for r in records}
    named = [m for m in method_catalog() if m in present or m == "full"]
    # Then the arms of --arm and of other engines, each engine's full cache (kvpress-full) first.
    return named + sorted(sorted(present - set(named)), key=lambda m: not m.endswith("-full"))


def summarize_stream(records: list[dict], subset: str) -> dict:
    """method -> budget label -> token-weighted KL, top-1 agreement, perplexities."""
    sums = defaultdict(lambda: defaultdict(float))
    full_sums: dict = defaultdict(lambda: defaultdict(float))
    full_seen = set()
    for r in (r for r in records if r["task"] == "stream"):
        part = r[subset]
        for label in r["labels"]:
            cell = sums[(r["method"], label)]
            for key in ("positions", "kl_sum", "nll_sum", "agree_sum"):
                cell[key] += part[key]
            cell["windows"] += 1
            # The full cache's loss over the same positions, once per (window, budget).
            if (r["sample"], r["budget"], label) not in full_seen:
                full_seen.add((r["sample"], r["budget"], label))
                full = full_sums[("full", label)]
                full["positions"] += part["positions"]
                full["nll_sum"] += part["full_nll_sum"]
                full["windows"] += 1
    table: dict = defaultdict(dict)
    for (method, label), cell in sums.items():
        n = max(cell["positions"], 1)
        table[method][label] = {
            "kl": cell["kl_sum"] / n, "top1": cell["agree_sum"] / n,
            "ppl": math.exp(cell["nll_sum"] / n), "positions": int(cell["positions"]),
            "windows": int(cell["windows"]),
        }
    for (method, label), cell in full_sums.items():
        n = max(cell["positions"], 1)
        table[method][label] = {"kl": 0.0, "top1": 1.0, "ppl": math.exp(cell["nll_sum"] / n),
                                "positions": int(cell["positions"]), "windows": int(cell["windows"])}
    return dict(table)


def summarize_passkey(records: list[dict]) -> dict:
    """{"overall": method -> label -> {accuracy, n}, "by_length": method -> length -> label -> ...}."""
    passkey = [r for r in records if r["task"] == "passkey"]
    labels_at_length = defaultdict(set)
    for r in passkey:
        labels_at_length[r["length"]].update(r["labels"])
    cells = defaultdict(list)  # (method, length, label) -> [correct]
    for r in passkey:
        # The full cache has no budget: it is the same arm under every label of its length.
        for label in (labels_at_length[r["length"]] if r["method"] == "full" else r["labels"]):
            cells[(r["method"], r["length"], label)].append(bool(r["correct"]))
    by_length: dict = defaultdict(lambda: defaultdict(dict))
    overall_cells = defaultdict(list)
    for (method, length, label), hits in cells.items():
        by_length[method][str(length)][label] = {"accuracy": sum(hits) / len(hits), "n": len(hits)}
        overall_cells[(method, label)] += hits
    overall: dict = defaultdict(dict)
    for (method, label), hits in overall_cells.items():
        overall[method][label] = {"accuracy": sum(hits) / len(hits), "n": len(hits)}
    return {"overall": _plain(overall), "by_length": _plain(by_length)}


def _plain(tree):
    return {k: _plain(v) for k, v in tree.items()} if isinstance(tree, dict) else tree


def summarize(records: list[dict], config: dict, versus: str = DEFAULT_ARM) -> dict:
    return {
        "config": config,
        "budget_labels": _label_order(config, records),
        "methods": _method_order(records),
        "passkey_lengths": sorted({r["length"] for r in records if r["task"] == "passkey"}),
        "stream": {subset: summarize_stream(records, subset) for subset in SUBSETS},
        "passkey": summarize_passkey(records),
        "ruler": summarize_ruler(records, versus),
        "records": len(records),
    }


# ---------------------------------------------------------------------------- tables


def _labels_with_data(table: dict, labels: list[str]) -> list[str]:
    """The budget labels some method has a value for (a budget skipped everywhere is no column)."""
    return [lb for lb in labels if any(lb in cells for cells in table.values())]


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _metric_table(title: str, table: dict, methods, labels, fmt) -> list[str]:
    labels = _labels_with_data(table, labels)
    rows = [f"**{title}**", "", _row(["method"] + labels), _row(["---"] * (len(labels) + 1))]
    for method in methods:
        if method in table:
            values = [fmt(table[method][lb]) if lb in table[method] else "–" for lb in labels]
            rows.append(_row([method] + values))
    return rows + [""]


def _prefill_scoring_note(config: dict) -> str:
    """How the camkv arms scored prompt chunks, when not causally (older runs: causally)."""
    if config.get("prefill_scoring", "causal") == "causal":
        return ""
    pool = f", their mass max-pooled over {config['pool']} tokens" if config["pool"] > 1 else ""
    return (f" camkv arms score a prompt chunk by its last {config['observation_window']} "
            f"queries{pool} (prefill_scoring {config['prefill_scoring']}).")


def markdown_tables(summary: dict) -> str:
    """Markdown tables to embed in a page: one table per metric, methods by budget."""
    methods, labels = summary["methods"], summary["budget_labels"]
    stream = summary["stream"]["decode"]
    config = summary["config"]
    lines = [
        f"Model `{config['model']}`, texts {', '.join(config['texts'])}, prefill chunk "
        f"{config['chunk']}, n_sink {config['n_sink']}, recent {config['recent']}, seed "
        f"{config['seed']}. Budgets in % are of the context.{_prefill_scoring_note(config)}",
        "",
    ]
    if stream:
        context = f"{config['stream_tokens']}-token windows, {config['stream_prefill']} prefilled"
        most = max(c["windows"] for cells in stream.values() for c in cells.values())

        def kl_cell(c):  # a cell over fewer windows than the others says so
            fewer = f" ({c['windows']} of {most} windows)" if c["windows"] < most else ""
            return f"{c['kl']:.4f}{fewer}"

        lines += _metric_table(f"Streaming ({context}; one-token steps at or past the budget): "
                               "mean KL from the full cache (nats, lower is better)",
                               stream, methods, labels, kl_cell)
        lines += _metric_table("Top-1 agreement with the full cache",
                               stream, methods, labels, lambda c: f"{100 * c['top1']:.1f}%")
        lines += _metric_table("Perplexity", stream, methods, labels, lambda c: f"{c['ppl']:.2f}")
    overall = summary["passkey"]["overall"]
    if overall:
        lengths = ", ".join(map(str, summary["passkey_lengths"]))
        lines += _metric_table(f"Passkey exact match (lengths {lengths}; n = prompts)",
                               overall, methods, labels,
                               lambda c: f"{100 * c['accuracy']:.0f}% (n={c['n']})")
    lines += ruler_tables(summary["ruler"], methods, labels)
    return "\n".join(lines)


# ---------------------------------------------------------------------------- plots


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# A merge rule's colour, by its code (drop's red is h2o's); later rules cycle.
_RULE_COLORS = ("tab:blue", "tab:green", "tab:purple", "tab:red", "tab:cyan", "tab:pink", "tab:olive", "tab:brown")


def _style(method: str) -> dict:
    colors = {"full": "black", "streamingllm": "tab:gray", "h2o": _RULE_COLORS[merges.code("drop")]}
    colors.update({r.name: _RULE_COLORS[r.code % len(_RULE_COLORS)] for r in merges.RULES})
    base = method.split("-")[0]
    return {
        "color": colors.get(base, "tab:orange"),
        "linestyle": "--" if "nogate" in method else (":" if base == "full" else "-"),
        "marker": "s" if method.endswith("-query") else "o",
    }


def plot_stream(summary: dict, path: Path) -> bool:
    """KL, top-1 agreement and perplexity against the budget, one line per method."""
    plt = _pyplot()
    table = summary["stream"]["decode"]
    labels = _labels_with_data(table, summary["budget_labels"])
    if not table:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    panels = [("kl", "mean KL from full (nats)", True), ("top1", "top-1 agreement", False),
              ("ppl", "perplexity", True)]
    for ax, (metric, title, log) in zip(axes, panels):
        for method in summary["methods"]:
            cells = table.get(method, {})
            xs = [i for i, lb in enumerate(labels) if lb in cells]
            if not xs or (metric == "kl" and method == "full"):
                continue
            ys = [cells[labels[i]][metric] for i in xs]
            ax.plot(xs, ys, label=method, **_style(method))
        ax.set_xticks(range(len(labels)), labels)
        ax.set_xlabel("budget (% of context or tokens)")
        ax.set_title(title)
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[-1].legend(fontsize=7, ncol=2)
    model = Path(summary["config"]["model"]).name  # a folder's name, not its whole path
    fig.suptitle(f"Streaming vs the full cache: {model}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _passkey_grid(cells: dict, lengths: list[str], labels: list[str]):
    """Accuracy [length, budget label] of one method (NaN where not run)."""
    import numpy as np

    grid = np.full((len(lengths), len(labels)), np.nan)
    for i, length in enumerate(lengths):
        for j, label in enumerate(labels):
            cell = cells.get(length, {}).get(label)
            if cell:
                grid[i, j] = cell["accuracy"]
    return grid


def plot_passkey_heatmap(summary: dict, path: Path) -> bool:
    """One panel per method: accuracy by context length (rows) and budget (columns)."""
    import numpy as np

    plt = _pyplot()
    by_length = summary["passkey"]["by_length"]
    labels = _labels_with_data(summary["passkey"]["overall"], summary["budget_labels"])
    lengths = [str(n) for n in summary["passkey_lengths"]]
    methods = [m for m in summary["methods"] if m in by_length]
    if not methods:
        return False
    cols = min(4, len(methods))
    rows = math.ceil(len(methods) / cols)
    fig, axes = plt.subplots(rows, cols, squeeze=False,
                             figsize=(3.6 * cols, (0.6 * len(lengths) + 1.6) * rows))
    for ax, method in zip(axes.flat, methods):
        grid = _passkey_grid(by_length[method], lengths, labels)
        ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        for (i, j), value in np.ndenumerate(grid):
            if not np.isnan(value):
                ax.text(j, i, f"{100 * value:.0f}", ha="center", va="center",
                        color="white" if value < 0.6 else "black", fontsize=8)
        ax.set_xticks(range(len(labels)), labels, fontsize=8)
        ax.set_yticks(range(len(lengths)), lengths, fontsize=8)
        ax.set_title(method, fontsize=9)
    for ax in list(axes.flat)[len(methods):]:
        ax.axis("off")
    fig.suptitle("Passkey exact match (%) by context length (rows) and budget (columns)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_passkey_bars(summary: dict, path: Path) -> bool:
    """Accuracy over all lengths, one group of bars per method, one bar per budget."""
    import numpy as np

    plt = _pyplot()
    overall = summary["passkey"]["overall"]
    labels = _labels_with_data(overall, summary["budget_labels"])
    methods = [m for m in summary["methods"] if m in overall]
    if not methods:
        return False
    fig, ax = plt.subplots(figsize=(max(8, 0.3 * len(methods) * len(labels)), 4.5))
    width = 0.8 / len(labels)
    for j, label in enumerate(labels):
        values = [overall[m].get(label, {}).get("accuracy", np.nan) for m in methods]
        ax.bar(np.arange(len(methods)) + j * width, values, width, label=label)
    ax.set_xticks(np.arange(len(methods)) + 0.4 - width / 2, methods, rotation=45, ha="right",
                  fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_ylabel("exact match (all lengths)")
    ax.legend(title="budget", fontsize=8)
    ax.set_title("Passkey retrieval per method")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------- all of it


def write_report(out_dir: Path, complete: bool | None = None, notes=(), versus: str = DEFAULT_ARM) -> dict:
    """summary.json, table.md and the plots from OUT/records.jsonl and OUT/run.json; versus:
    the arm RULER's paired "minus each arm" grid subtracts from (camkv's default)."""
    out_dir = Path(out_dir)
    config_path = out_dir / "run.json"
    if not config_path.exists():
        raise ValueError(f"{out_dir} holds no run.json: nothing to report")
    config = json.loads(config_path.read_text())
    records = RecordStore.read_records(out_dir)
    summary = summarize(records, config, versus)
    previous = out_dir / "summary.json"
    if complete is None and previous.exists():  # --report-only keeps what the run said
        old = json.loads(previous.read_text())
        complete, notes = old.get("complete"), old.get("notes", [])
    summary["complete"] = complete
    summary["notes"] = list(notes)
    previous.write_text(json.dumps(summary, indent=1))
    (out_dir / "table.md").write_text(markdown_tables(summary) + "\n")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        # A bare machine still keeps every number; `--report-only` elsewhere draws them.
        print("camkv eval: matplotlib is not installed: no plots (rerun with --report-only "
              "where it is)", file=sys.stderr)
        summary["plots"] = []
        return summary
    plots = {"stream_vs_budget.png": plot_stream, "passkey_heatmap.png": plot_passkey_heatmap,
             "passkey_bars.png": plot_passkey_bars,
             "ruler_vs_budget.png": lambda s, path: plot_ruler(s["ruler"], s["methods"],
                                                               s["budget_labels"], path, _style)}
    # Not saved in summary.json: which files this run drew (a plot with no data is skipped).
    summary["plots"] = [name for name, draw in plots.items() if draw(summary, out_dir / name)]
    return summary
