"""The merge rules: what happens to an evicted token (CaMConfig.merge).

One table, RULES, read by the config's validation, the reference, the kernel
backends' parameter packing, the CLI's help, the evaluation arms and the tests.
csrc/camkv_merges.h holds the same table for the kernel core (codes, kinds and
properties; tests/test_ext.py checks the two against each other through camkv._ext).

A rule's kind says where an evicted token goes:

- "drop": nowhere (H2O eviction).
- "nearest": into its most similar non-sink survivor (largest key cosine).
- "window": spread over the `window` survivors that follow it, s_e / |W| each.

A blending rule replaces each target's value by (1 - w) V_t + w V_e with the
weight its `weight` function returns; a window rule that does not blend adds
V_e / |W| instead. Every merging rule adds the evicted mass to the targets'
scores. Adding a rule: CONTRIBUTING.md.

Most rules run on every backend. A rule with kernels=False runs on the reference
backend only (experimental): it carries per-row state the kernel core does not
have (a moving similarity threshold, or each row's votes), and the kernel backends
refuse it with an error that names the rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import mlx.core as mx

DROP, NEAREST, WINDOW = "drop", "nearest", "window"
KINDS = (DROP, NEAREST, WINDOW)  # index = CAMKV_KIND_* of csrc/camkv_merges.h


def _cosine_weight(cosine, s_in, s_target, norm_in, norm_target):
    """clamp(cos, 0, 1): a survivor takes a token in as far as their keys agree."""
    return mx.clip(cosine, 0.0, 1.0)


def _half_weight(cosine, s_in, s_target, norm_in, norm_target):
    return 0.5


def mass_weight(cosine, s_in, s_target, norm_in, norm_target):
    """s_in / (s_in + s_target), 0 where both are 0: the blend that makes a target the
    attention-mass-weighted mean of itself and what merges into it."""
    total = s_in + s_target
    return mx.where(total > 0, s_in / mx.where(total > 0, total, 1.0), 0.0)


def _value_norm_weight(cosine, s_in, s_target, norm_in, norm_target):
    """w / (1 + w) with w = clamp(cos, 0, 1) |V_e| / (|V_e| + |V_t|) (0 where both norms
    are 0): one merge of kvpress's MergingPress, V_t <- (V_t + w V_e) / (1 + w), as a
    blend (docs/algorithm.md section 4.1)."""
    total = norm_in + norm_target
    share = mx.where(total > 0, norm_in / mx.where(total > 0, total, 1.0), 0.0)
    w = mx.clip(cosine, 0.0, 1.0) * share
    return w / (1.0 + w)


def _similarity_mean_weight(cosine, s_in, s_target, norm_in, norm_target):
    """c / (1 + c) with c = clamp(cos, 0, 1): V_t <- (V_t + c V_e) / (1 + c), D2O's
    similarity-weighted mean of the survivor (weight 1) and the evicted token (weight c)."""
    c = mx.clip(cosine, 0.0, 1.0)
    return c / (1.0 + c)


# A weight function takes (cosine, s_in, s_target, norm_in, norm_target), float32
# arrays over rows (or rows and stored tokens): the cosine of the evicted key with the
# target's (nearest rules; None for window rules), the mass the target receives (s_e,
# or s_e / |W| in a window), the target's own score before the merge, and the L2 norms
# of the evicted value and of the target's value before the merge (nearest rules; None
# for window rules). It returns w (an array or a float).
Weight = Callable[..., "mx.array | float"]


@dataclass(frozen=True)
class MergeRule:
    name: str
    code: int  # CAMKV_MERGE codes of csrc/camkv_merges.h: the rule's index in RULES
    kind: str  # DROP, NEAREST or WINDOW
    blends: bool  # values become (1 - w) V_t + w V_e; a window rule that does not blend adds V_e / |W|
    keys_allowed: bool  # merge_keys may blend keys too (nearest rules only)
    weight_uses_mass: bool  # w is a ratio of scores (backends then agree on it to a few ulps only)
    help: str
    weight: Weight | None = None  # the blend weight of a blending rule
    kernels: bool = True  # the kernel core runs it (a row in csrc/camkv_merges.h); False: reference only
    moving_threshold: bool = False  # merges only above its row's moving similarity threshold (RowState.threshold)
    keeps_votes: bool = False  # each row stands for RowState.votes tokens, which weigh its attention
    # Why the rule is retired (empty: offered): a rule that lost to dropping in every
    # measurement stays an experiment (CaMConfig and the reference accept it, its results
    # stay), but the command line's lists no longer offer it.
    retired: str = ""


_LOST_TO_DROP = ("with the model's queries scoring, it came out farther from the full cache than dropping "
                 "in every measurement (bench/results/README.md, \"Retired merge rules\")")

# Append only: a rule's code is its kernel code, and results name rules by these names.
RULES: tuple[MergeRule, ...] = (
    MergeRule("sim_weighted", 0, NEAREST, True, True, False,
              "blends it into its most similar survivor with weight clamp(cos, 0, 1)", _cosine_weight,
              retired=_LOST_TO_DROP),
    MergeRule("mean", 1, NEAREST, True, True, False,
              "blends it into its most similar survivor with weight 0.5", _half_weight),
    MergeRule("window", 2, WINDOW, False, False, False,
              "adds V_e / |W| to each of the `window` survivors after it (the paper's form; values grow "
              "with every merge)"),
    MergeRule("drop", 3, DROP, False, False, False, "discards it (H2O)"),
    MergeRule("mass_weighted", 4, NEAREST, True, True, True,
              "blends it into its most similar survivor with weight s_e / (s_e + s_t), so the survivor "
              "becomes the attention-mass-weighted mean of the two", mass_weight),
    MergeRule("window_mass", 5, WINDOW, True, False, True,
              "makes each of the `window` survivors after it the mass-weighted mean "
              "(s_j V_j + (s_e/|W|) V_e) / (s_j + s_e/|W|)", mass_weight, retired=_LOST_TO_DROP),
    MergeRule("value_norm", 6, NEAREST, True, True, False,
              "blends it into its most similar survivor as (V_t + w V_e) / (1 + w) with w = clamp(cos, 0, 1) "
              "|V_e| / (|V_e| + |V_t|) (kvpress's MergingPress, one merge at a time)", _value_norm_weight),
    MergeRule("d2o", 7, NEAREST, True, True, False,
              "blends it into its most similar survivor as (V_t + c V_e) / (1 + c), c = clamp(cos, 0, 1), only "
              "when c reaches the row's threshold, a moving average of recent compressions' mean nearest "
              "cosine (D2O; with --kv-merge-keys as D2O blends keys too). Experimental: reference backend only",
              _similarity_mean_weight, kernels=False, moving_threshold=True),
    MergeRule("keepkv", 8, NEAREST, True, False, True,
              "merges it into its most similar survivor so that the attention output of the current query is "
              "unchanged (KeepKV): each row keeps votes, the tokens it stands for, which weigh its attention; "
              "the merged value is the current query's attention-weighted mean and the key is set to match "
              "(merge_keys does not apply). Experimental: reference backend only",
              mass_weight, kernels=False, keeps_votes=True),
)

_BY_NAME = {r.name: r for r in RULES}


def names(**properties) -> tuple[str, ...]:
    """Names of the rules, in code order, that have every given property:
    names(kind=WINDOW), names(blends=True, keys_allowed=True)."""
    return tuple(r.name for r in RULES if all(getattr(r, k) == v for k, v in properties.items()))


def rule(name: str) -> MergeRule:
    """The rule called name; ValueError naming the known ones otherwise."""
    if name not in _BY_NAME:
        raise ValueError(f"unknown merge rule {name!r}; known: {', '.join(_BY_NAME)}")
    return _BY_NAME[name]


def code(name: str) -> int:
    """The rule's kernel code (CamParams.merge)."""
    return rule(name).code


def offered() -> tuple[str, ...]:
    """The rules a command line lists: every rule not retired."""
    return names(retired="")


def retired() -> tuple[str, ...]:
    """The retired rules (experiments the command line no longer lists)."""
    return tuple(r.name for r in RULES if r.retired)


def help_text() -> str:
    """One sentence per offered rule, for a command line's --merge help, then the retired ones."""
    return ("what happens to an evicted token: " + "; ".join(f"'{r.name}' {r.help}" for r in RULES if not r.retired)
            + ". Every merging rule adds the evicted mass to the targets' scores. Retired, kept as experiments "
            + "(CaMConfig accepts them): " + ", ".join(f"'{name}'" for name in retired()))

