"""scoring="query": the model's own queries score the cache, through mlx-lm's attention call."""

from __future__ import annotations

import sys
import warnings

import numpy as np
import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models import base
from mlx_lm.models.cache import make_prompt_cache

import camkv
from camkv import CaMKVCache, hook
from tiny_models import tiny_gemma3, tiny_llama, tiny_qwen3

PROMPT = mx.array([(5 * i + 1) % 120 for i in range(90)])
MODELS = {"llama": tiny_llama, "qwen3": tiny_qwen3, "gemma3": tiny_gemma3}


def _greedy(model, cache, max_tokens=12):
    steps = generate_step(PROMPT, model, max_tokens=max_tokens, prompt_cache=cache, prefill_step_size=32)
    return [int(t) for t, _ in steps]


@pytest.mark.parametrize("prefill", ["exact", "chunk"])
def test_scores_equal_the_models_attention_probabilities_divided_by_g(monkeypatch, prefill):
    model = tiny_llama(heads=4, kv_heads=2, layers=1)
    cache = camkv.make_prompt_cache(model, budget=256, recent=8, scoring="query", prefill=prefill)
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
    assert all(c.size() == 40 and c.stats["evictions"] > 0 for c in cache)


def test_a_model_that_bypasses_the_hook_warns_once_and_stays_bounded():
    rng = np.random.default_rng(0)
    cache = CaMKVCache(budget=12, n_sink=1, recent=2, scoring="query")
    cache.model_type = "bypassing_model"
    with pytest.warns(RuntimeWarning, match="bypassing_model") as record:
        for _ in range(10):
            k = mx.array(rng.standard_normal((1, 2, 3, 8)).astype(np.float32))
            cache.update_and_fetch(k, k)
        cache.size()
    assert len([w for w in record if "bypass" in str(w.message)]) == 1
    assert cache.size() == 12 and cache.offset == 30


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


def test_queries_of_the_wrong_shape_are_rejected_without_change():
    cache = CaMKVCache(budget=12, n_sink=1, recent=2, scoring="query")
    k = mx.ones((1, 2, 3, 8))
    cache.update_and_fetch(k, k)
    with pytest.raises(ValueError, match="multiple of the KV heads"):
        cache.observe_queries(mx.ones((1, 3, 3, 8)), 0.5)
    cache.observe_queries(mx.ones((1, 4, 3, 8)), 0.5)
    assert cache.size() == 3
