"""scoring="query" (the default): the model's own queries score the cache, through
mlx-lm's attention call; without them a cache scores with keys and says so once."""

from __future__ import annotations

import sys
import warnings

import numpy as np
import mlx.core as mx
import pytest
from mlx_lm import stream_generate
from mlx_lm.generate import generate_step
from mlx_lm.models import base
from mlx_lm.models.cache import make_prompt_cache

import camkv
from camkv import CaMKVCache, QueryScoringWarning, hook
from tiny_models import (
    byte_tokenizer, tiny_deepseek_v3, tiny_gemma2, tiny_gemma3, tiny_llama, tiny_qwen3,
)

PROMPT = mx.array([(5 * i + 1) % 120 for i in range(90)])
MODELS = {"llama": tiny_llama, "qwen3": tiny_qwen3, "gemma3": tiny_gemma3}


def _greedy(model, cache, max_tokens=12):
    steps = generate_step(PROMPT, model, max_tokens=max_tokens, prompt_cache=cache, prefill_step_size=32)
    return [int(t) for t, _ in steps]


@pytest.mark.parametrize("prefill", ["exact", "chunk"])
def test_scores_equal_the_models_attention_probabilities_divided_by_g(monkeypatch, prefill):
    model = tiny_llama(heads=4, kv_heads=2, layers=1)
    # Every query adds its mass (causal scoring): window scoring would count only a
    # compression's last queries, and the prompt's blocks wait in the slack together.
    cache = camkv.make_prompt_cache(model, budget=256, recent=8, scoring="query", prefill=prefill,
                                    prefill_scoring="causal")
    seen = []

    def recording(queries, keys, values, cache_, scale, mask, *args, **kwargs):
        seen.append((queries, keys, scale))
        return base.scaled_dot_product_attention(queries, keys, values, cache_, scale, mask, *args, **kwargs)

    monkeypatch.setattr(hook, "_ORIGINAL", recording)
    _greedy(model, cache, max_tokens=6)
    camkv.remove(model)
    # Explicitly: softmax over the visible keys of every query head, summed over steps.
    expected = np.zeros((2, cache[0].size()), np.float64)
    for queries, keys, scale in seen:
        q = np.array(queries[0], np.float64)  # [4, S, D]
        k = np.array(keys[0], np.float64)  # [2, N, D]
        s_len, total = q.shape[1], k.shape[1]
        visible = np.arange(total)[None, :] <= (total - s_len + np.arange(s_len))[:, None]
        for head in range(4):
            logits = scale * q[head] @ k[head // 2].T
            logits = np.where(visible, logits, -np.inf)
            w = np.exp(logits - logits.max(axis=1, keepdims=True))
            w /= w.sum(axis=1, keepdims=True)
            expected[head // 2, :total] += w.sum(axis=0) / 2
    np.testing.assert_allclose(np.array(cache[0].stored()[2][0]), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_generation_equals_the_full_cache_when_the_budget_holds_everything(name):
    model = MODELS[name]()
    full = _greedy(model, make_prompt_cache(model))
    cache = camkv.make_prompt_cache(model, budget=256, recent=8, scoring="query")
    try:
        assert _greedy(model, cache) == full
    finally:
        camkv.remove(model)
    camkv_layers = [c for c in cache if isinstance(c, CaMKVCache)]
    assert camkv_layers and all(c.stats["tokens_seen"] > 0 for c in camkv_layers)


def test_small_budget_with_query_scoring_stays_bounded():
    model = tiny_qwen3()
    cache = camkv.make_prompt_cache(model, budget=40, recent=8, scoring="query")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the hook sees every block: no bypass warning
        _greedy(model, cache, max_tokens=20)
    camkv.remove(model)
    assert all(40 <= c.size() <= 40 + c.config.slack and c.stats["evictions"] > 0 for c in cache)


def _block(rng, s_len, heads=2, dim=8):
    return mx.array(rng.standard_normal((1, heads, s_len, dim)).astype(np.float32))


def _assert_same_state(a: CaMKVCache, b: CaMKVCache):
    for x, y in zip(a.stored(), b.stored()):
        assert mx.array_equal(x, y).item()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_default_scores_every_token_with_real_queries_through_mlx_lm(name):
    model = MODELS[name]()
    tokenizer = byte_tokenizer()
    prompt = PROMPT.tolist()

    def tokens(cache):
        return [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=12,
                                                 prompt_cache=cache)]

    full = tokens(make_prompt_cache(model))
    cache = camkv.make_prompt_cache(model, budget=256, recent=8)  # default config
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", QueryScoringWarning)
            assert tokens(cache) == full
    finally:
        camkv.remove(model)
    assert not hook.installed_modules()
    camkv_layers = [c for c in cache if isinstance(c, CaMKVCache)]
    assert camkv_layers and all(c.config.scoring == "query" for c in camkv_layers)
    # Every token, prompt and generated, was scored with the model's queries.
    assert all(0 < c.stats["query_scored"] == c.stats["tokens_seen"] for c in camkv_layers)


def test_apply_installs_the_hook_at_once_and_remove_takes_it_out():
    model = tiny_llama()
    module = sys.modules[type(model).__module__]
    camkv.apply(model, budget=64, recent=8)  # caches built elsewhere (a loaded prompt cache) get queries
    assert module.scaled_dot_product_attention is hook.scaled_dot_product_attention
    camkv.remove(model)
    assert module.scaled_dot_product_attention is base.scaled_dot_product_attention
    camkv.apply(model, budget=64, recent=8, scoring="key")  # nothing to hand over
    assert module.scaled_dot_product_attention is base.scaled_dot_product_attention
    camkv.remove(model)


def test_a_cache_built_directly_without_a_hook_scores_with_keys_at_once_and_says_so_once():
    assert not hook.installed_modules()  # no model's hook anywhere: no queries can come
    rng = np.random.default_rng(0)
    direct = CaMKVCache(budget=12, n_sink=1, recent=2)  # the default: scoring="query"
    keyed = CaMKVCache(budget=12, n_sink=1, recent=2, scoring="key")
    with pytest.warns(QueryScoringWarning) as record:
        for s_len in (5, 1, 9, 1, 3, 1):
            k = _block(rng, s_len)
            direct.update_and_fetch(k, k)
            keyed.update_and_fetch(k, k)
            assert direct._waiting == 0  # never left waiting for queries
    assert len(record) == 1
    message = str(record[0].message)
    assert "camkv.make_prompt_cache(model" in message and "camkv.apply(model" in message
    assert "scoring='key'" in message
    _assert_same_state(direct, keyed)
    assert direct.size() == keyed.size() <= 12 + direct.config.slack and direct.nbytes == keyed.nbytes
    assert direct.stats["query_scored"] == 0 and direct.stats["tokens_seen"] == 20


def test_caches_whose_hook_was_removed_score_with_keys_and_say_why():
    model = tiny_llama()
    cache = camkv.make_prompt_cache(model, budget=64, recent=8)
    model(PROMPT[None, :40], cache=cache)
    camkv.remove(model)
    with pytest.warns(QueryScoringWarning, match=r"hook of model llama was removed \(camkv.remove\)"):
        model(PROMPT[None, 40:41], cache=cache)
    assert all(c.stats["query_scored"] == 40 and c.stats["tokens_seen"] == 41 for c in cache)


def test_a_model_whose_attention_never_calls_the_hook_scores_with_keys_from_the_first_block(remove_hooks):
    model = tiny_gemma2()
    remove_hooks(model)
    cache = camkv.make_prompt_cache(model, budget=40, recent=8)
    keyed = camkv.make_prompt_cache(model, budget=40, recent=8, scoring="key")
    with pytest.warns(QueryScoringWarning, match="gemma2's attention does not call mlx-lm's "
                                                 "scaled_dot_product_attention") as record:
        tokens = _greedy(model, cache, max_tokens=20)
    assert len(record) == len(cache)  # once per layer's cache, not once per step
    assert tokens == _greedy(model, keyed, max_tokens=20)
    for a, b in zip(cache, keyed):
        _assert_same_state(a, b)
        assert 40 <= a.size() <= 40 + a.config.slack and a.stats["query_scored"] == 0


def test_a_model_that_bypasses_an_installed_hook_warns_once_and_stays_bounded(remove_hooks):
    hooked = camkv.apply(tiny_llama())  # some model's hook is in: a direct cache waits for queries
    remove_hooks(hooked)
    rng = np.random.default_rng(0)
    cache = CaMKVCache(budget=12, n_sink=1, recent=2)
    keyed = CaMKVCache(budget=12, n_sink=1, recent=2, scoring="key")
    cache.model_type = "bypassing_model"
    with pytest.warns(QueryScoringWarning, match="bypassing_model") as record:
        for _ in range(10):
            k = _block(rng, 3)
            cache.update_and_fetch(k, k)
            keyed.update_and_fetch(k, k)
        cache.stats  # the last block waits for queries that never come: scored with keys now
    assert len([w for w in record if "bypass" in str(w.message)]) == 1
    assert 12 <= cache.size() <= 12 + cache.config.slack and cache.offset == 30
    _assert_same_state(cache, keyed)


def test_queries_of_another_width_than_the_cached_keys_score_with_keys(remove_hooks):
    # MLA models (deepseek_v3 and kin) cache a latent of another width than their prompt queries.
    remove_hooks(camkv.apply(tiny_llama()))
    rng = np.random.default_rng(1)
    cache = CaMKVCache(budget=12, n_sink=1, recent=2)
    keyed = CaMKVCache(budget=12, n_sink=1, recent=2, scoring="key")
    k = _block(rng, 5, heads=1)
    cache.update_and_fetch(k, k)
    keyed.update_and_fetch(k, k)
    with pytest.warns(QueryScoringWarning, match="queries of width 16 over cached keys of width 8"):
        cache.observe_queries(mx.ones((1, 4, 5, 16)), 0.25)
    _assert_same_state(cache, keyed)
    assert cache.stats["query_scored"] == 0


def test_the_hook_is_removed_cleanly():
    model = tiny_llama()
    module = sys.modules[type(model).__module__]
    camkv.make_prompt_cache(model, budget=64, recent=8, scoring="query")
    assert module.scaled_dot_product_attention is hook.scaled_dot_product_attention
    with camkv.applied(tiny_llama(seed=1), budget=64, recent=8, scoring="query") as other:
        other.make_cache()
        camkv.remove(model)
        # Still hooked: the other model uses the same module.
        assert module.scaled_dot_product_attention is hook.scaled_dot_product_attention
    assert module.scaled_dot_product_attention is base.scaled_dot_product_attention


def test_a_latent_cache_model_scores_its_prompt_with_keys_and_its_steps_with_queries(remove_hooks):
    model = tiny_deepseek_v3()
    remove_hooks(model)
    cache = camkv.make_prompt_cache(model, budget=40, recent=8)
    with pytest.warns(QueryScoringWarning, match="deepseek_v3 attends with queries of width 16 "
                                                 "over cached keys of width 32") as record:
        tokens = _greedy(model, cache, max_tokens=10)
    assert len(tokens) == 10 and len(record) == len(cache)
    for layer in cache:
        # The one-token steps' queries are projected into the latent: those score it.
        assert 0 < layer.stats["query_scored"] < layer.stats["tokens_seen"] == 90 + 10
        assert 40 <= layer.size() <= 40 + layer.config.slack


def test_queries_of_the_wrong_shape_are_rejected_without_change(remove_hooks):
    remove_hooks(camkv.apply(tiny_llama()))  # a hook is in: the block waits for its queries
    cache = CaMKVCache(budget=12, n_sink=1, recent=2, scoring="query")
    k = mx.ones((1, 2, 3, 8))
    cache.update_and_fetch(k, k)
    with pytest.raises(ValueError, match="multiple of the KV heads"):
        cache.observe_queries(mx.ones((1, 3, 3, 8)), 0.5)
    cache.observe_queries(mx.ones((1, 4, 3, 8)), 0.5)
    assert cache.size() == 3
