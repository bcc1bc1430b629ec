"""The RULER part of `camkv eval`'s report: scores per task and averaged, with 95%
intervals, by method, length and budget, from the records alone.

- A cell is one method at one budget label of one length. A full cache (a record with no
  budget: camkv's full, or kvpress-full from bench/gpu/kvpress_ruler.py) has no budget:
  its record of a prompt counts under every label that prompt was run at.
- RULER average: the mean over tasks of each task's mean score; niah average: the same
  over the niah tasks.
- Intervals: percentile bootstrap (2000 draws, fixed seed), prompts redrawn within each
  task, so an average's interval reflects every task's own spread; none when a task
  has a single prompt. "vs full" is paired:
  each prompt's score minus the full cache's on the same prompt, bootstrapped the same way;
  the full cache of the arm's own engine: a record's full_method (kvpress-full for the
  kvpress arms), "full" when it names none. "default minus" is paired the same way:
  camkv's default ("camkv"), or the arm `camkv eval --versus` names, minus the arm on the
  prompts both ran, at the same budget label, so "is it ahead of this arm" is read off
  one interval.
- Depths: the niah score by where the needles sit in the haystack (first, middle, last
  third; a prompt with needles in several thirds counts in each).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from .arms import DEFAULT_ARM
from .ruler import NIAH, TASK_NAMES

DRAWS = 2000
THIRDS = ("first third", "middle third", "last third")


def _cells(records: list[dict]) -> dict:
    """(method, length, label) -> task -> {sample: record}."""
    ruler = [r for r in records if r["task"] == "ruler"]
    labels_of = defaultdict(set)
    for r in ruler:
        labels_of[r["sample"]].update(r["labels"])
    cells: dict = defaultdict(lambda: defaultdict(dict))
    for r in ruler:
        for label in labels_of[r["sample"]] if r["budget"] is None else r["labels"]:
            cells[(r["method"], r["length"], label)][r["ruler_task"]][r["sample"]] = r
    return cells


def _stratified(scores_by_task: dict[str, np.ndarray], rng) -> dict:
    """Mean over tasks of the task means, and its bootstrap 95% interval."""
    tasks = [t for t, s in scores_by_task.items() if len(s)]
    if not tasks:
        return {}
    mean = float(np.mean([scores_by_task[t].mean() for t in tasks]))
    n = int(sum(len(scores_by_task[t]) for t in tasks))
    if min(len(scores_by_task[t]) for t in tasks) < 2:  # one prompt shows no spread
        return {"mean": mean, "lo": None, "hi": None, "n": n, "tasks": len(tasks)}
    draws = np.zeros(DRAWS)
    for t in tasks:
        s = scores_by_task[t]
        draws += s[rng.integers(0, len(s), size=(DRAWS, len(s)))].mean(axis=1)
    draws /= len(tasks)
    lo, hi = np.percentile(draws, [2.5, 97.5])
    return {"mean": mean, "lo": float(lo), "hi": float(hi), "n": n, "tasks": len(tasks)}


def _paired(minuend: dict, subtrahend: dict, rng, keep) -> dict:
    """The average over tasks of minuend's score minus subtrahend's on the same prompts."""
    diffs = {t: np.array([r["score"] - subtrahend[t][s]["score"] for s, r in recs.items()
                          if s in subtrahend.get(t, {})])
             for t, recs in minuend.items() if keep(t)}
    return _stratified(diffs, rng)


def _group_stats(by_task: dict, full_by_task: dict | None, default_by_task: dict | None, rng,
                 keep) -> dict:
    """The average of the tasks `keep` accepts and, given the full cache's cell or the
    default's, the paired differences from them."""
    scores = {t: np.array([r["score"] for r in recs.values()]) for t, recs in by_task.items() if keep(t)}
    stats = {"average": _stratified(scores, rng)}
    if full_by_task is not None:
        stats["vs_full"] = _paired(by_task, full_by_task, rng, keep)
    if default_by_task is not None:  # draws of its own: the other intervals stay as they were
        stats["default_minus"] = _paired(default_by_task, by_task, np.random.default_rng(1), keep)
    return stats


def _depth_scores(by_task: dict) -> dict:
    """niah score by the third of the haystack each needle sits in."""
    sums = defaultdict(list)
    for task, recs in by_task.items():
        if task not in NIAH:
            continue
        for r in recs.values():
            for third in {min(2, int(3 * d)) for d in r["depths"]}:
                sums[THIRDS[third]].append(r["score"])
    return {k: {"mean": float(np.mean(v)), "n": len(v)} for k, v in sums.items()}


def _full_method(by_task: dict) -> str:
    """The full-cache arm a cell's records are paired with."""
    first = next(r for recs in by_task.values() for r in recs.values())
    return first.get("full_method", "full")


def summarize_ruler(records: list[dict], versus: str = DEFAULT_ARM) -> dict:
    """{"cells": "method|length|label" -> {ruler, niah, tasks, depths}, "tasks": [...],
    "versus": the arm each cell's "default_minus" is paired with (camkv's default)}."""
    cells = _cells(records)
    # Any task's records name the arms: a run of other tasks pairs nothing, and refuses nothing.
    ran = {r["method"] for r in records}
    if records and versus != DEFAULT_ARM and versus not in ran:
        raise ValueError(f"--versus names an arm with no records here: {versus!r}; the arms are "
                         f"{', '.join(sorted(ran))}")
    out = {}
    for (method, length, label), by_task in sorted(cells.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        rng = np.random.default_rng(0)  # the same draws for every cell: paired across methods
        reference = _full_method(by_task)
        full = cells.get((reference, length, label)) if method != reference else None
        default = cells.get((versus, length, label)) if method != versus else None
        out[f"{method}|{length}|{label}"] = {
            "method": method, "length": length, "label": label,
            "ruler": _group_stats(by_task, full, default, rng, lambda t: True),
            "niah": _group_stats(by_task, full, default, rng, lambda t: t in NIAH),
            "tasks": {t: {"mean": float(np.mean([r["score"] for r in recs.values()])), "n": len(recs)}
                      for t, recs in by_task.items()},
            "depths": _depth_scores(by_task),
        }
    tasks = [t for t in TASK_NAMES if any(t in c["tasks"] for c in out.values())]
    return {"cells": out, "tasks": tasks, "versus": versus}


# ---------------------------------------------------------------------------- tables


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _pct(stats: dict) -> str:
    if not stats:
        return "–"
    if stats["lo"] is None:
        return f"{100 * stats['mean']:.1f} (1 prompt a task: no interval)"
    return f"{100 * stats['mean']:.1f} [{100 * stats['lo']:.1f}, {100 * stats['hi']:.1f}]"


def _columns(summary: dict, labels: list[str]) -> list[tuple[int, str]]:
    present = {(c["length"], c["label"]) for c in summary["cells"].values()}
    lengths = sorted({length for length, _ in present})
    return [(length, lb) for length in lengths for lb in labels if (length, lb) in present]


def _grid(title: str, summary: dict, methods, columns, cell) -> list[str]:
    cells = summary["cells"]
    header = [f"{length} @ {label}" for length, label in columns]
    rows = [f"**{title}**", "", _row(["method"] + header), _row(["---"] * (len(header) + 1))]
    for method in methods:
        values = [cells.get(f"{method}|{length}|{label}") for length, label in columns]
        if any(values):
            rows.append(_row([method] + [cell(v) if v else "–" for v in values]))
    return rows + [""]


def _methods_with(summary: dict, methods: list[str], key: str) -> list[str]:
    """The methods some cell of which has this paired difference in its RULER average."""
    return [m for m in methods if any(key in c["ruler"] for c in summary["cells"].values()
                                      if c["method"] == m)]


def ruler_tables(summary: dict, methods: list[str], labels: list[str]) -> list[str]:
    """Markdown: the RULER and niah averages, their paired differences from the full cache
    and from camkv's default, each task's score, and niah by needle depth; columns are
    length @ budget."""
    if not summary["cells"]:
        return []
    columns = _columns(summary, labels)
    n = max(c["ruler"]["average"]["n"] for c in summary["cells"].values() if c["ruler"]["average"])
    lines = _grid(f"RULER average (% of expected strings found; mean over {len(summary['tasks'])} tasks "
                  f"[95% bootstrap interval]; up to {n} prompts a cell; columns: length @ budget)",
                  summary, methods, columns, lambda c: _pct(c["ruler"]["average"]))
    niah = sum(t in NIAH for t in summary["tasks"])
    lines += _grid(f"niah average ({niah} needle tasks)", summary, methods, columns,
                   lambda c: _pct(c["niah"]["average"]))
    lines += _grid("RULER average minus the full cache's on the same prompts (the arm's own "
                   "engine's: kvpress arms minus kvpress-full; paired, points [95% interval])",
                   summary, _methods_with(summary, methods, "vs_full"), columns,
                   lambda c: _pct(c["ruler"].get("vs_full", {})))
    versus = summary.get("versus", DEFAULT_ARM)
    who, it = (f"camkv's default ({DEFAULT_ARM})", "the default") if versus == DEFAULT_ARM else (versus, versus)
    lines += _grid(f"RULER average: {who} minus each arm on the same "
                   f"prompts (paired, points [95% interval]; above 0: {it} is ahead)",
                   summary, _methods_with(summary, methods, "default_minus"), columns,
                   lambda c: _pct(c["ruler"].get("default_minus", {})))
    for length, label in columns:
        tasks = summary["tasks"]
        lines += [f"**Per task at {length} tokens @ {label} (%; n prompts)**", "",
                  _row(["method"] + tasks), _row(["---"] * (len(tasks) + 1))]
        for method in methods:
            cell = summary["cells"].get(f"{method}|{length}|{label}")
            if cell:
                lines.append(_row([method] + [
                    f"{100 * cell['tasks'][t]['mean']:.0f} ({cell['tasks'][t]['n']})" if t in cell["tasks"]
                    else "–" for t in tasks]))
        lines.append("")
    lines += _grid("niah by needle depth in the haystack (% : first / middle / last third)",
                   summary, methods, columns, _depth_cell)
    return lines


def _depth_cell(cell: dict) -> str:
    depths = cell["depths"]
    return " / ".join(f"{100 * depths[t]['mean']:.0f}" if t in depths else "–" for t in THIRDS)


# ---------------------------------------------------------------------------- plot


def plot_ruler(summary: dict, methods: list[str], labels: list[str], path, style) -> bool:
    """RULER average against the budget with its interval, one panel per length."""
    if not summary["cells"]:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = _columns(summary, labels)
    lengths = sorted({length for length, _ in columns})
    fig, axes = plt.subplots(1, len(lengths), figsize=(6 * len(lengths), 4.5), squeeze=False)
    for ax, length in zip(axes[0], lengths):
        budget_labels = [lb for ln, lb in columns if ln == length]
        for k, method in enumerate(methods):
            points = [(i, summary["cells"][f"{method}|{length}|{lb}"]["ruler"]["average"])
                      for i, lb in enumerate(budget_labels) if f"{method}|{length}|{lb}" in summary["cells"]]
            points = [(i + 0.03 * (k - len(methods) / 2), s) for i, s in points if s]
            if not points:
                continue
            xs, ys = [p[0] for p in points], [100 * p[1]["mean"] for p in points]
            err = [[0 if p[1]["lo"] is None else y - 100 * p[1]["lo"] for y, p in zip(ys, points)],
                   [0 if p[1]["hi"] is None else 100 * p[1]["hi"] - y for y, p in zip(ys, points)]]
            ax.errorbar(xs, ys, yerr=err, label=method, capsize=2, **style(method))
        ax.set_xticks(range(len(budget_labels)), budget_labels)
        ax.set_xlabel("budget (% of the prompt)")
        ax.set_ylabel("RULER average (%)")
        ax.set_title(f"{length} tokens")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
