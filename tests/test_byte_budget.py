"""A byte budget (kv_bytes, --kv-bytes): what it chooses, that the caches keep to it, and refusals."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import camkv
from camkv import CaMConfig, byte_budget, hook
from camkv.quantized import row_bytes
from tiny_models import tiny_llama

DOCS = Path(__file__).resolve().parent.parent / "docs" / "kv-bytes.md"


@pytest.mark.parametrize("value, count", [
    (65536, 65536), ("65536", 65536), ("64KiB", 65536), ("64 KiB", 65536), ("1.5MiB", 3 * 2**19),
    ("2GiB", 2 * 2**30), ("500KB", 500_000), ("3mb", 3_000_000), ("7B", 7),
])
def test_byte_counts_are_read_in_decimal_and_binary_units(value, count):
    assert byte_budget.parse_bytes(value) == count


@pytest.mark.parametrize("value, words", [
    ("64XB", ["'64XB'", "KiB"]), ("-1MiB", ["'-1MiB'"]), ("", ["''"]), (0, ["at least 1", "0"]),
    ("0.1", ["at least 1", "'0.1'"]), (True, ["True"]), (1.5, ["1.5"]), (None, ["None"]),
])
def test_bad_byte_counts_are_refused_naming_the_value(value, words):
    with pytest.raises(ValueError) as err:
        byte_budget.parse_bytes(value)
    for word in ["kv_bytes", *words]:
        assert word in str(err.value)


@pytest.mark.parametrize("bits", [4, 8, None])
@pytest.mark.parametrize("shape", [(3, 64, 64, 2), (1, 256, 256, 2), (8, 128, 128, 2), (2, 32, 32, 4)])
@pytest.mark.parametrize("target", [50_000, 65536, 10**6 + 7])
def test_the_chosen_budget_is_the_largest_whose_rows_fit(bits, shape, target):
    heads, k_dim, v_dim, size = shape
    cfg = byte_budget.choose(target, CaMConfig(bits=bits), *shape)
    per_token = heads * row_bytes(k_dim, v_dim, size, cfg.bits, cfg.group_size)
    assert (cfg.budget + cfg.slack) * per_token <= target
    bigger = cfg.replace(budget=cfg.budget + 1)
    assert (bigger.budget + bigger.slack) * per_token > target
    assert cfg.recent == max(1, cfg.budget // 4) and (cfg.bits is None or k_dim % cfg.group_size == 0)


def test_a_group_that_does_not_divide_the_heads_gives_way_to_one_that_does():
    assert byte_budget.choose("1MiB", CaMConfig(bits=4), 2, 32, 32, 2).group_size == 32
    assert byte_budget.choose("1MiB", CaMConfig(bits=4, group_size=128), 2, 64, 64, 2).group_size == 64
    assert byte_budget.choose("1MiB", CaMConfig(bits=4), 2, 80, 80, 2).bits is None  # no group divides 80


def test_a_fixed_slack_is_kept_and_counted():
    cfg = byte_budget.choose(65536, CaMConfig(bits=4, slack=100), 2, 64, 64, 2)
    assert cfg.slack == 100 and (cfg.budget + 100) * 160 <= 65536 < (cfg.budget + 101) * 160


def test_too_few_bytes_are_refused_naming_the_rows_they_hold():
    with pytest.raises(ValueError, match=r"kv_bytes=800 \(800 bytes\) holds 5 rows .* at least 6"):
        byte_budget.choose(800, CaMConfig(bits=4), 2, 64, 64, 2)


def test_the_documented_table_is_what_the_code_chooses():
    assert byte_budget.measured_table() in DOCS.read_text()


# ------------------------------------------------------------------ through a model
@pytest.fixture
def model(remove_hooks):
    model = tiny_llama(heads=4, kv_heads=2, hidden=256, vocab=128)  # head dim 64, float32
    remove_hooks(model)
    return model


def test_caches_of_a_byte_budget_never_hold_more_than_it(model):
    target = 40_000
    cache = camkv.make_prompt_cache(model, kv_bytes=target)
    config = cache[0].config
    # No bits given: 4-bit rows of group 32 (byte_budget.KV_BYTES_DEFAULTS).
    assert (config.bits, config.group_size) == (4, 32)
    assert config.budget == byte_budget.choose(target, CaMConfig(bits=4, group_size=32), 2, 64, 64, 4).budget
    prompt = np.random.default_rng(0).integers(0, 128, 300).tolist()
    model(mx.array(prompt)[None], cache=cache)
    held = []
    for token in range(120):
        model(mx.array([[token % 128]]), cache=cache)
        held.append(max(c.nbytes for c in cache))
    assert max(held) <= target
    assert max(held) > 0.9 * target  # the budget uses the bytes it was given


def test_bits_given_with_a_byte_budget_are_kept(model):
    assert camkv.make_prompt_cache(model, kv_bytes="64KiB", bits=8)[0].config.group_size == 64  # the config's
    assert camkv.make_prompt_cache(model, kv_bytes="64KiB", bits=4)[0].config.group_size == 64
    assert camkv.make_prompt_cache(model, kv_bytes="64KiB", group_size=64)[0].config.bits == 4
    assert camkv.make_prompt_cache(model, kv_bytes="64KiB", bits=8)[0].config.bits == 8
    assert camkv.make_prompt_cache(model, kv_bytes="64KiB", bits=None)[0].config.bits is None
    assert camkv.make_prompt_cache(model, CaMConfig(), kv_bytes="64KiB")[0].config.bits is None


@pytest.mark.parametrize("fields, message", [
    ({"kv_bytes": "64KiB", "budget": 100}, "chooses the budget"),
    ({"kv_bytes": "lots"}, "'lots'"),
    ({"kv_bytes": 100}, "holds 0 rows"),
])
def test_a_bad_byte_budget_changes_nothing(model, fields, message):
    with pytest.raises(ValueError, match=message):
        camkv.make_prompt_cache(model, **fields)
    assert not hook.is_installed(model)
    with pytest.raises(ValueError, match=message):
        camkv.apply(model, **fields)
    assert not hook.is_installed(model) and not hasattr(model, "_camkv_original_make_cache")


def test_apply_and_the_server_loader_build_caches_of_the_byte_budget(model):
    from camkv.server import _with_camkv

    loaded = _with_camkv(lambda: (model, None), CaMConfig(bits=4), kv_bytes="64KiB")()
    assert loaded[0] is model
    expected = byte_budget.choose("64KiB", CaMConfig(bits=4), 2, 64, 64, 4)
    assert [c.config for c in model.make_cache()] == [expected.replace(seed=i) for i in range(2)]
    camkv.remove(model)


@pytest.mark.parametrize("rank", [0, 1])
def test_tensor_sharded_ranks_choose_the_unsharded_budget(rank, remove_hooks):
    """The bytes are the layer's, all its heads: every rank of a split chooses the budget an
    unsharded run does (the rows then match the unsharded run's), holding half the bytes."""
    from test_distributed import FakeGroup

    whole = tiny_llama(heads=8, kv_heads=4, hidden=512)  # head dim 64
    remove_hooks(whole)
    expected = camkv.make_prompt_cache(whole, kv_bytes="64KiB")[0].config
    sharded = tiny_llama(heads=8, kv_heads=4, hidden=512)
    remove_hooks(sharded)
    sharded.shard(FakeGroup(rank, 2))
    assert camkv.make_prompt_cache(sharded, kv_bytes="64KiB")[0].config == expected


def test_a_tier_takes_its_bytes_out_of_the_byte_budget(model):
    target = 60_000
    cache = camkv.make_prompt_cache(model, kv_bytes=target, tier_budget=64, tier_bits=2)
    config = cache[0].config
    tier = 64 * 2 * row_bytes(64, 64, 4, 2, 64)
    assert (config.budget + config.slack) * 2 * row_bytes(64, 64, 4, 4, 64) <= target - tier
    prompt = np.random.default_rng(0).integers(0, 128, 400).tolist()
    model(mx.array(prompt)[None], cache=cache)
    for token in range(60):
        model(mx.array([[token % 128]]), cache=cache)
        assert max(c.nbytes for c in cache) <= target
    assert cache[0].tier_rows()[3].shape[2] == 64


@pytest.mark.parametrize("flags, expected", [
    ([], (4, 32)),  # KV_BYTES_DEFAULTS
    (["--kv-group-size", "64"], (4, 64)),
    (["--kv-bits", "8"], (8, 64)),  # bits given: the config's group
])
def test_the_command_line_chooses_what_make_prompt_cache_chooses(flags, expected):
    from camkv import cli

    words = ["generate", "--kv-bytes", "1MiB", *flags]
    args = cli.build_parser().parse_args(words)
    args.explicit_kv = cli.explicit_kv_flags(words)
    fields = cli._kv_fields_to_run(args)
    assert (fields["bits"], fields["group_size"]) == expected
