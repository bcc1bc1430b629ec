"""The merge rules: what happens to an evicted token (CaMConfig.merge).

One table, RULES, read by the config's validation, the reference, the kernel
backends' parameter packing, the CLI's help, the evaluation arms and the tests.
csrc/camkv_merges.h holds the same table for the kernel core (codes, kinds and
properties; tests/test_ext.py checks the two against each other through camkv._ext).

A rule's kind says where an evicted token goes:

- "drop": nowhere (H2O eviction).
- "nearest": into its most similar non-sink survivor (largest key cosine).
- "window": spread over the `window` survivors that follow it, s_e / |W| each.

A compression's merges are simultaneous (docs/algorithm.md sections 4 and 7): every
loser picks its target(s) among the compression's survivors, and every target takes all
its merging losers at once. A blending rule makes each target the weighted mean
(A_t V_t + sum_e a_e V_e) / (A_t + sum_e a_e) of itself and its losers, with the shares
its `target_share` and `loser_share` give; a window rule that does not blend adds
sum_e V_e / |W(e)| instead. Every merging rule adds the merged mass to the targets'
scores. Adding a rule: CONTRIBUTING.md.

Every rule runs on every backend, and every rule has its row in the kernel core's table:
the core carries the per-row state of the rules that keep one (keeps_votes: keepkv's
votes; moving_threshold: d2o's threshold) in and out of each call, as the reference and
the MLX merge engine (camkv.backends.merge_ops) do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import mlx.core as mx

DROP, NEAREST, WINDOW = "drop", "nearest", "window"
KINDS = (DROP, NEAREST, WINDOW)  # index = CAMKV_KIND_* of csrc/camkv_merges.h


# Shares (docs/algorithm.md section 4.4). A compression's merging losers M_t of a target
# t replace its value by (A_t V_t + sum_e a_e V_e) / (A_t + sum_e a_e): A_t is the target's
# share, a_e each loser's. A target share takes s_target, the target's score before the
# compression's merges ([R, N] float32, or the masses keepkv feeds it); a loser share
# takes (cosine, s_in, s_target, norm_in, norm_target) over the losers: the cosine of the
# loser's key with its target's (nearest rules; None for window rules), the mass the
# target receives from it (s_e, or s_e / |W| in a window), its target's score, and the L2
# norms of the loser's value and of its target's value before the compression (nearest
# rules; None for window rules). Each returns an array or a float.
Share = Callable[..., "mx.array | float"]

# sim_weighted's cosine is capped below 1 so that its odds c / (1 - c) stay finite.
SIM_ODDS_CAP = 1.0 - 2.0**-12


def _unit(*_) -> float:
    """Share 1: the target, or each loser, counts once."""
    return 1.0


def own_mass(s_target):
    """A target's share is its score: with loser shares s_e, the mass-weighted mean."""
    return s_target


def feature_norm(x: mx.array) -> mx.array:
    """L2 norm along the last axis of float32 x, summed in feature order as the kernels
    do: the norms of the cosines (section 4.1) and of value_norm's values."""
    return mx.sqrt((x * x).sum(axis=-1))


def _loser_mass(cosine, s_in, s_target, norm_in, norm_target):
    return s_in


def _clamped_cosine(cosine, s_in, s_target, norm_in, norm_target):
    """clamp(cos, 0, 1): a loser counts as far as its key agrees with its target's (D2O)."""
    return mx.clip(cosine, 0.0, 1.0)


def _cosine_odds(cosine, s_in, s_target, norm_in, norm_target):
    """c / (1 - c), c = clamp(cos, 0, SIM_ODDS_CAP): with target share 1 and one loser, the
    blend (1 - c) V_t + c V_e (a survivor takes a token in as far as their keys agree)."""
    c = mx.clip(cosine, 0.0, SIM_ODDS_CAP)
    return c / (1.0 - c)


def _value_norm_share(cosine, s_in, s_target, norm_in, norm_target):
    """clamp(cos, 0, 1) |V_e| / (|V_e| + |V_t|) (0 where both norms are 0): kvpress's
    MergingPress, V_t <- (V_t + sum_e u_e V_e) / (1 + sum_e u_e)."""
    total = norm_in + norm_target
    share = mx.where(total > 0, norm_in / mx.where(total > 0, total, 1.0), 0.0)
    return mx.clip(cosine, 0.0, 1.0) * share


@dataclass(frozen=True)
class MergeRule:
    name: str
    code: int  # CAMKV_MERGE codes of csrc/camkv_merges.h: the rule's index in RULES
    kind: str  # DROP, NEAREST or WINDOW
    blends: bool  # values become their shares' weighted mean; a window rule that does not blend adds V_e / |W|
    keys_allowed: bool  # merge_keys may blend keys too (nearest rules only)
    weight_uses_mass: bool  # the shares are scores (backends then agree on the blend to a few ulps only)
    help: str
    target_share: Share | None = None  # A_t of a blending rule
    loser_share: Share | None = None  # a_e of a blending rule
    moving_threshold: bool = False  # merges only above its row's moving similarity threshold (RowState.threshold)
    keeps_votes: bool = False  # each row stands for RowState.votes tokens, which weigh its attention
    # On a GPU a decode compression (at most slack + 1 pending tokens) of a merging rule
    # runs in the kernel core's one launch, which there beats the MLX merge engine's ~70
    # operations, except for the rules marked here, whose core pass is the slower one
    # (camkv.backends.compress.by_operations; bench/merge_speed.py's RULE/core arms).
    decodes_on_engine: bool = False
    # Why the rule is retired (empty: offered): a rule that lost to dropping in every
    # measurement stays an experiment (CaMConfig and the reference accept it, its results
    # stay), but the command line's lists no longer offer it.
    retired: str = ""


_LOST_TO_DROP = ("with the model's queries scoring, it came out farther from the full cache than dropping "
                 "in every measurement (bench/results/README.md, \"Retired merge rules\")")

# Append only: a rule's code is its kernel code, and results name rules by these names.
RULES: tuple[MergeRule, ...] = (
    MergeRule("sim_weighted", 0, NEAREST, True, True, False,
              "blends it into its most similar survivor with weight clamp(cos, 0, 1)", _unit, _cosine_odds,
              retired=_LOST_TO_DROP),
    MergeRule("mean", 1, NEAREST, True, True, False,
              "blends it into its most similar survivor with weight 0.5 (several: their plain mean with it)",
              _unit, _unit),
    MergeRule("window", 2, WINDOW, False, False, False,
              "adds V_e / |W| to each of the `window` survivors after it (the paper's form; values grow "
              "with every merge)"),
    MergeRule("drop", 3, DROP, False, False, False, "discards it (H2O)"),
    MergeRule("mass_weighted", 4, NEAREST, True, True, True,
              "blends it into its most similar survivor with weight s_e / (s_e + s_t), so the survivor "
              "becomes the attention-mass-weighted mean of itself and all it takes in", own_mass, _loser_mass),
    MergeRule("window_mass", 5, WINDOW, True, False, True,
              "makes each of the `window` survivors after it the mass-weighted mean "
              "(s_j V_j + sum_e (s_e/|W|) V_e) / (s_j + sum_e s_e/|W|)", own_mass, _loser_mass,
              retired=_LOST_TO_DROP),
    MergeRule("value_norm", 6, NEAREST, True, True, False,
              "blends the tokens it takes into a survivor as (V_t + sum w V_e) / (1 + sum w) with "
              "w = clamp(cos, 0, 1) |V_e| / (|V_e| + |V_t|) (kvpress's MergingPress)", _unit, _value_norm_share),
    MergeRule("d2o", 7, NEAREST, True, True, False,
              "blends the tokens it takes into a survivor as (V_t + sum c V_e) / (1 + sum c), c = clamp(cos, 0, 1), "
              "each only when c reaches the row's threshold, a moving average of recent compressions' mean "
              "nearest cosine (D2O; with --kv-merge-keys as D2O blends keys too)",
              _unit, _clamped_cosine, moving_threshold=True),
    MergeRule("keepkv", 8, NEAREST, True, False, True,
              "merges it into its most similar survivor so that the attention output of the current query is "
              "unchanged (KeepKV): each row keeps votes, the tokens it stands for, which weigh its attention; "
              "the merged value is the current query's attention-weighted mean and the key is set to match "
              "(merge_keys does not apply)",
              own_mass, _loser_mass, keeps_votes=True, decodes_on_engine=True),
)

_BY_NAME = {r.name: r for r in RULES}

D2O_KEEP = 0.5  # share of D2O's threshold kept at each compression (its alpha; the new mean gets 1 - alpha)


def moved_threshold(threshold: mx.array, cosines: mx.array) -> mx.array:
    """d2o's threshold after one compression (docs/algorithm.md section 4.5): tau <- m at a
    row's first (tau NaN), else D2O_KEEP tau + (1 - D2O_KEEP) m, with m the mean of the
    finite cosines [R, k] of its losers to their nearest survivors; a row with none keeps tau."""
    finite = mx.isfinite(cosines)
    count = finite.sum(axis=1)
    mean = mx.where(finite, cosines, 0.0).sum(axis=1) / mx.maximum(count, 1).astype(mx.float32)
    moved = mx.where(mx.isnan(threshold), mean, D2O_KEEP * threshold + (1.0 - D2O_KEEP) * mean)
    return mx.where(count > 0, moved, threshold)


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



def output_preserving_key(mean_key, query, scale: float, top, total_mass, total_votes, finite):
    """keepkv's merged key (docs/algorithm.md section 4.6): K' + d q with d such that the
    merged row, standing for total_votes tokens, gets the group's mass for q:
    l* = top + log(total_mass) - log(total_votes), d = (l* - s q.K') / (s |q|^2).
    mean_key [..., Dk] float32 (K', the mass-weighted mean key), query broadcastable to it;
    top, total_mass, total_votes and finite over mean_key's leading axes (where not finite,
    or d is not, the key stays K')."""
    want = top + mx.log(total_mass) - mx.log(total_votes)
    shift = (want - scale * (mean_key * query).sum(axis=-1)) / (scale * (query * query).sum(axis=-1))
    moved = finite & mx.isfinite(shift)
    # Where the key stays K', it is not moved by 0 * q either (an infinite q would make it NaN).
    return mx.where(moved[..., None], mean_key + mx.where(moved, shift, 0.0)[..., None] * query, mean_key)
