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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import mlx.core as mx

DROP, NEAREST, WINDOW = "drop", "nearest", "window"
KINDS = (DROP, NEAREST, WINDOW)  # index = CAMKV_KIND_* of csrc/camkv_merges.h


def _cosine_weight(cosine, s_in, s_target):
    """clamp(cos, 0, 1): a survivor takes a token in as far as their keys agree."""
    return mx.clip(cosine, 0.0, 1.0)


def _half_weight(cosine, s_in, s_target):
    return 0.5


def mass_weight(cosine, s_in, s_target):
    """s_in / (s_in + s_target), 0 where both are 0: the blend that makes a target the
    attention-mass-weighted mean of itself and what merges into it."""
    total = s_in + s_target
    return mx.where(total > 0, s_in / mx.where(total > 0, total, 1.0), 0.0)


# A weight function takes (cosine, s_in, s_target), float32 arrays over rows (or
# rows and stored tokens): the cosine of the evicted key with the target's (nearest
# rules; None for window rules), the mass the target receives (s_e, or s_e / |W| in
# a window) and the target's own score before the merge. It returns w (an array or
# a float).
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


# Append only: a rule's code is its kernel code, and results name rules by these names.
RULES: tuple[MergeRule, ...] = (
    MergeRule("sim_weighted", 0, NEAREST, True, True, False,
              "blends it into its most similar survivor with weight clamp(cos, 0, 1)", _cosine_weight),
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
              "(s_j V_j + (s_e/|W|) V_e) / (s_j + s_e/|W|)", mass_weight),
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


def help_text() -> str:
    """One sentence per rule, for a command line's --merge help."""
    return "what happens to an evicted token: " + "; ".join(f"'{r.name}' {r.help}" for r in RULES) + \
        ". Every merging rule adds the evicted mass to the targets' scores."

