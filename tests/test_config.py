"""CaMConfig validation: every bad value names the field, the value and what is allowed."""

from __future__ import annotations

import pytest

from camkv import CaMConfig


@pytest.mark.parametrize(
    "fields, words",
    [
        (dict(budget=8, n_sink=4, recent=4), ["budget", "n_sink + recent", "8"]),
        (dict(budget=36, n_sink=4, recent=32), ["budget", "36"]),
        (dict(recent=0), ["recent", ">= 1", "0"]),
        (dict(n_sink=-1), ["n_sink", ">= 0", "-1"]),
        (dict(budget=-5), ["budget", "-5"]),
        (dict(budget=64.0), ["budget", "integer", "64.0"]),
        (dict(budget=True), ["budget", "integer", "True"]),
        (dict(window=0), ["window", "0"]),
        (dict(seed=-1), ["seed", "-1"]),
        (dict(seed=2**32), ["seed", str(2**32)]),
        (dict(merge="avg"), ["merge", "'avg'", "'sim_weighted'", "'drop'"]),
        (dict(prefill="fast"), ["prefill", "'fast'", "'exact'", "'chunk'"]),
        (dict(scoring="value"), ["scoring", "'value'", "'key'", "'query'"]),
        (dict(backend="tpu"), ["backend", "'tpu'", "'reference'"]),
        (dict(merge="window", merge_keys=True), ["merge_keys", "window"]),
        (dict(merge="window_mass", merge_keys=True), ["merge_keys", "'window_mass'"]),
        (dict(merge="avg"), ["'mass_weighted'", "'window_mass'"]),
        (dict(gate="yes"), ["gate", "'yes'"]),
        (dict(merge_keys=1), ["merge_keys", "1"]),
    ],
)
def test_bad_values_raise_value_error_naming_field_value_and_allowed(fields, words):
    with pytest.raises(ValueError) as err:
        CaMConfig(**fields)
    for word in words:
        assert word in str(err.value), (word, str(err.value))


def test_defaults_are_valid_and_documented():
    cfg = CaMConfig()
    for field in ("budget", "n_sink", "merge", "merge_keys", "window", "gate",
                  "seed", "scoring", "prefill", "backend"):
        assert f"- {field} [" in CaMConfig.__doc__, field
        assert repr(getattr(cfg, field)).strip("'") in CaMConfig.__doc__.split(f"- {field} [")[1].split("]")[0]
    assert "- recent [a quarter of the budget]" in CaMConfig.__doc__
    assert cfg.recent == cfg.budget // 4
    assert '- slack [an eighth of the budget with prefill="chunk", else 0]' in CaMConfig.__doc__
    assert cfg.slack == cfg.budget // 8


def test_the_default_recent_window_is_a_quarter_of_the_budget_and_follows_it():
    assert CaMConfig(budget=100).recent == 25
    assert CaMConfig(budget=3, n_sink=0).recent == 1  # at least 1
    assert CaMConfig(budget=512).replace(budget=2048).recent == 512
    assert CaMConfig(budget=512, recent=7).replace(budget=2048).recent == 7  # chosen: kept
    with pytest.raises(ValueError, match="budget must exceed n_sink \\+ recent = 4 \\+ 1 = 5, got budget=5"):
        CaMConfig(budget=5)


def test_replace_validates_and_rejects_unknown_fields():
    cfg = CaMConfig(budget=64, recent=8)
    assert cfg.replace(seed=3).seed == 3
    with pytest.raises(ValueError, match="budget"):
        cfg.replace(budget=10)
    with pytest.raises(ValueError, match="no field"):
        cfg.replace(bugdet=10)


def test_json_round_trip():
    cfg = CaMConfig(budget=100, merge="window", window=2, gate=False, seed=9, prefill="exact")
    assert CaMConfig.from_json(cfg.to_json()) == cfg
