"""The low-precision tier (CaMConfig.tier_budget, tier_bits): evicted rows kept at low bits."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

import camkv
from camkv import CaMConfig, CaMKVCache, tier
from camkv.batch import BatchCaMKVCache
from conftest import assert_config_refused
from tiny_models import assert_state_as_alone, batch_of_lone_caches, tiny_llama

H, D = 2, 64


def _fed(cache, n: int = 200, prompt: int = 40, seed: int = 0):
    """A prompt block then one-token steps; returns the keys fed [1, H, n, D]."""
    mx.random.seed(seed)
    keys, values = mx.random.normal((1, H, n, D)), mx.random.normal((1, H, n, D))
    cache.update_and_fetch(keys[:, :, :prompt], values[:, :, :prompt])
    for t in range(prompt, n):
        cache.update_and_fetch(keys[:, :, t : t + 1], values[:, :, t : t + 1])
    return keys, values


@pytest.mark.parametrize("fields, words", [
    ({"tier_budget": -1}, ["tier_budget", ">= 0", "-1"]),
    ({"tier_bits": 5}, ["tier_bits", "2, 3, 4", "5"]),
    ({"tier_budget": 8, "merge": "mean"}, ["tier_budget=8", "merge='drop'", "'mean'"]),
])
def test_bad_tier_settings_are_refused(fields, words):
    assert_config_refused(fields, words)


def test_losers_are_the_rows_not_kept():
    before = mx.array([[0, 1, 5, 6, 9, 12], [0, 2, 3, 4, 8, 10]], mx.int32)
    after = mx.array([[0, 6, 12], [3, 4, 10]], mx.int32)
    assert tier.losers(before, after).tolist() == [[1, 2, 4], [0, 1, 4]]


@pytest.mark.parametrize("bits", [None, 4])
def test_evicted_rows_move_to_the_tier_and_the_best_scored_stay(bits):
    fields = dict(budget=32, scoring="key", bits=bits, backend="reference")
    cache = CaMKVCache(**fields, tier_budget=16, tier_bits=2)
    keys, _ = _fed(cache)
    plain = CaMKVCache(**fields)
    _fed(plain)
    # The main rows are those of the cache without a tier: the tier only catches what leaves.
    assert mx.array_equal(cache.stored()[3], plain.stored()[3])
    t_keys, _, t_scores, t_positions = cache.tier_rows()
    assert t_positions.shape == (1, H, 16) and cache.size() == plain.size() + 16
    main = set(cache.stored()[3][0, 0].tolist())
    kept = t_positions[0, 0].tolist()
    assert kept == sorted(kept) and not main & set(kept)
    # Each is its token's key as the main rows held it (rounded to 4 bits there, with
    # bits=4), rounded once to 2 bits.
    rounded = lambda x, b: mx.dequantize(*mx.quantize(x, group_size=64, bits=b), group_size=64, bits=b)
    held = keys[0, 0][t_positions[0, 0]]
    assert mx.array_equal(t_keys[0, 0], rounded(held if bits is None else rounded(held, bits), 2))
    # The tier keeps, of every row ever evicted, the 16 best-scored (the newer of two alike):
    # a tier with room for all of them shows them all.
    every = CaMKVCache(**fields, tier_budget=10**6, tier_bits=2)
    _fed(every)
    _, _, all_scores, all_positions = every.tier_rows()
    assert all_positions.shape[2] == cache.stats["evictions"] // H > 16
    for h in range(H):
        ranked = sorted(zip(all_scores[0, h].tolist(), all_positions[0, h].tolist()), reverse=True)[:16]
        assert t_positions[0, h].tolist() == sorted(p for _, p in ranked)
        assert mx.array_equal(t_scores[0, h], all_scores[0, h][mx.array([all_positions[0, h].tolist().index(p)
                                                                          for p in t_positions[0, h].tolist()])])


def test_attention_reads_the_tier_before_the_main_rows():
    cache = CaMKVCache(budget=32, scoring="key", tier_budget=16, backend="reference")
    _fed(cache)
    mx.random.seed(9)
    k, v = cache.update_and_fetch(mx.random.normal((1, H, 1, D)), mx.random.normal((1, H, 1, D)))
    t_keys = cache.tier_rows()[0]
    assert k.shape[2] == 16 + 33 and not hasattr(cache, "bits")
    assert mx.array_equal(k[:, :, :16], t_keys)


def test_tier_bytes_are_counted():
    cache = CaMKVCache(budget=32, scoring="key", tier_budget=16, backend="reference")
    _fed(cache)
    plain = CaMKVCache(budget=32, scoring="key", backend="reference")
    _fed(plain)
    # 16 rows a head of 2-bit codes (64 channels: 4 words), a float32 scale and bias, score, position.
    per_row = 2 * (4 * 4 + 2 * 4) + 8
    assert cache.nbytes - plain.nbytes == H * 16 * per_row
    assert cache.bytes_bound() - plain.bytes_bound() == H * 16 * per_row  # the server's bound


@pytest.fixture
def model(remove_hooks):
    model = tiny_llama(heads=4, kv_heads=2, hidden=256, vocab=128)
    remove_hooks(model)
    return model


def _logprobs(model, cache, prompt, n: int = 8):
    steps = list(generate_step(mx.array(prompt), model, max_tokens=n, prompt_cache=cache))
    return np.stack([np.array(lp) for _, lp in steps])


def test_a_model_with_a_tier_attends_closer_to_the_full_cache(model):
    prompt = np.random.default_rng(0).integers(0, 128, 200).tolist()
    full = _logprobs(model, model.make_cache() if hasattr(model, "make_cache") else None, prompt)
    without = _logprobs(model, camkv.make_prompt_cache(model, budget=32), prompt)
    cache = camkv.make_prompt_cache(model, budget=32, tier_budget=64, tier_bits=4)
    with_tier = _logprobs(model, cache, prompt)
    assert cache[0].tier_rows()[3].shape[2] == 64
    assert np.abs(with_tier - full).mean() < np.abs(without - full).mean()


def test_a_saved_tier_loads_as_it_was(model, tmp_path):
    prompt = np.random.default_rng(1).integers(0, 128, 150).tolist()
    cache = camkv.make_prompt_cache(model, budget=32, tier_budget=24, bits=4)
    model(mx.array(prompt[:-1])[None], cache=cache)
    path = camkv.save_prompt_cache(str(tmp_path / "tier"), cache)
    loaded = camkv.load_prompt_cache(path)
    for before, after in zip(cache, loaded):
        assert after.nbytes == before.nbytes
        for a, b in zip(before.tier_rows(), after.tier_rows()):
            assert mx.array_equal(a, b)
    np.testing.assert_allclose(_logprobs(model, loaded, prompt[-1:]), _logprobs(model, cache, prompt[-1:]), atol=1e-6)


def test_a_batch_of_rows_with_tiers_decodes_each_row_as_alone(model, on_the_cpu):
    """Each row's whole state (main rows, their scores, the tier's rows, the pending
    queries) is the lone run's."""
    prompts = [np.random.default_rng(s).integers(0, 128, n).tolist() for s, n in ((2, 130), (3, 60))]
    alone, batch = batch_of_lone_caches(model, prompts, budget=32, tier_budget=16)
    steps = 32  # compressions every 5 steps: the last 2 steps' queries are pending
    token = mx.array([[5], [9]])
    for _ in range(steps):
        token = mx.argmax(model(token, cache=batch)[:, -1:], axis=-1)
    for b, cache in enumerate(alone):
        row_token = mx.array([[[5, 9][b]]])
        for _ in range(steps):
            row_token = mx.argmax(model(row_token.reshape(1, 1), cache=cache)[:, -1:], axis=-1)
        for layer, single in zip(batch, cache):
            row = layer.extract(b)
            assert row.tier_rows()[3].shape[2] == 16
            assert_state_as_alone(row.state, single.state, row.config)
    with pytest.raises(ValueError, match="a tier or none"):
        BatchCaMKVCache([CaMKVCache(tier_budget=8), CaMKVCache()])
