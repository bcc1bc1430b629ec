"""The merge-rule registry: one table per language, the same table in both, and the
properties every rule must have for the kernel core to run it."""

from __future__ import annotations

import dataclasses

import pytest

from camkv import CaMConfig, backends, merges, reference
from camkv.config import MERGE_MODES


@pytest.mark.parametrize("rule", merges.RULES, ids=lambda r: r.name)
def test_every_rule_is_one_the_kernel_can_run(rule):
    assert rule.code == merges.RULES.index(rule), "codes are indices: append rules, never reorder"
    assert rule.kind in merges.KINDS
    assert rule.blends == (rule.target_share is not None) == (rule.loser_share is not None), \
        "a blending rule needs both shares, and only a blending rule has them"
    assert not rule.keys_allowed or rule.kind == merges.NEAREST, "only nearest rules blend keys"
    assert rule.kind != merges.NEAREST or rule.blends, "the kernel has no additive nearest merge"
    assert not rule.weight_uses_mass or rule.blends
    assert rule.help and rule.name in merges.help_text()


@pytest.mark.parametrize("rule", merges.RULES, ids=lambda r: r.name)
def test_a_rule_with_state_is_a_nearest_merge(rule):
    """The per-row state (votes, a threshold) belongs to nearest-survivor merges: the
    kernel core keeps it for those only."""
    if rule.moving_threshold or rule.keeps_votes:
        assert rule.kind == merges.NEAREST, "the stateful merges are nearest-survivor merges"
        assert not (rule.moving_threshold and rule.keeps_votes), "a rule keeps one kind of state"


def test_the_kernels_table_is_the_registrys():
    """Every rule has its row in the kernel core's table, its state columns included."""
    ext = pytest.importorskip("camkv._ext")
    kernel = [tuple(r) for r in ext.merge_rules()]
    assert kernel == [(r.name, r.code, r.kind, r.blends, r.keys_allowed, r.keeps_votes, r.moving_threshold)
                      for r in merges.RULES]


def test_retired_rules_say_why_and_stay_experiments_the_lists_leave_out():
    """A retired rule keeps running (CaMConfig and the reference accept it) but no list of
    the command line offers it: not --kv-merge's choices, not its help's descriptions."""
    assert set(merges.retired()) == {"sim_weighted", "window_mass"}
    assert set(merges.offered()) | set(merges.retired()) == set(merges.names())
    choices = {f.name: f for f in dataclasses.fields(CaMConfig)}["merge"].metadata["choices"]
    assert choices == merges.offered()
    described = merges.help_text().split("Retired")[0]
    for name in merges.retired():
        rule = merges.rule(name)
        assert "every measurement" in rule.retired and rule.help not in described
        assert CaMConfig(merge=name).merge == name


def test_the_config_accepts_exactly_the_registrys_rules():
    assert MERGE_MODES == merges.names()
    for rule in merges.RULES:
        assert CaMConfig(merge=rule.name).merge == rule.name
        if rule.keys_allowed or rule.kind == merges.DROP:  # drop merges nothing: merge_keys is moot
            assert CaMConfig(merge=rule.name, merge_keys=True).merge_keys
        else:
            with pytest.raises(ValueError, match="merge_keys"):
                CaMConfig(merge=rule.name, merge_keys=True)


@pytest.mark.parametrize("merge", [r.name for r in merges.RULES if r.keeps_votes or r.moving_threshold])
def test_a_rule_with_state_is_accepted_by_every_backend(merge):
    for backend in ("auto", "reference", "ext", "metal", "cuda"):
        assert CaMConfig(merge=merge, backend=backend).backend == backend
    assert backends.resolve("reference") is reference


def test_queries_filter_by_property_and_unknown_names_are_named():
    assert merges.names(kind=merges.DROP) == ("drop",)
    assert set(merges.names(kind=merges.WINDOW)) == {"window", "window_mass"}
    assert all(merges.rule(n).blends for n in merges.names(blends=True))
    with pytest.raises(ValueError, match="'avg'.*sim_weighted"):
        merges.rule("avg")
