"""End to end through mlx-lm's own generation loop on a tiny random-weight llama (GQA 4 on 2)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, RotatingKVCache

import camkv
from camkv import CaMKVCache
from tiny_models import tiny_llama

PROMPT = mx.array([(7 * i + 3) % 120 for i in range(150)])


def _greedy(model, cache=None, max_tokens=24, prefill_step_size=64):
    steps = generate_step(PROMPT, model, max_tokens=max_tokens, prompt_cache=cache,
                          prefill_step_size=prefill_step_size)
    return [int(token) for token, _ in steps]


@pytest.fixture(scope="module")
def model():
    model = tiny_llama(heads=4, kv_heads=2, layers=2)
    yield model
    camkv.remove(model)  # the attention hook camkv.make_prompt_cache installs (scoring="query")


@pytest.mark.parametrize("prefill", ["exact", "chunk"])
def test_budget_holding_everything_reproduces_the_full_cache_exactly(model, prefill):
    full = _greedy(model, [KVCache() for _ in model.layers])
    # Prompt of 150 tokens > prefill_step_size 64: chunked prefill goes through the cache too.
    cache = camkv.make_prompt_cache(model, budget=256, recent=8, prefill=prefill)
    assert _greedy(model, cache) == full
    assert all(isinstance(c, CaMKVCache) for c in cache)
    assert cache[0].stats["evictions"] == 0


def test_apply_routes_mlx_lm_generation_through_camkv(model):
    full = _greedy(model)
    with camkv.applied(model, budget=256, recent=8):
        made = model.make_cache()
        assert all(isinstance(c, CaMKVCache) for c in made)
        assert _greedy(model) == full  # generate_step builds its caches via model.make_cache
    assert all(type(c) is KVCache for c in model.make_cache())


def test_small_budget_holds_budget_rows_per_layer_and_reports_evictions(model):
    cache = camkv.make_prompt_cache(model, budget=48, n_sink=4, recent=8)
    tokens = _greedy(model, cache, max_tokens=30)
    assert len(tokens) == 30
    for layer in cache:
        keys, values, scores, positions = layer.stored()
        held = layer.size()
        assert 48 <= held <= 48 + layer.config.slack
        assert keys.shape == (1, 2, held, 16) and positions.shape == (1, 2, held)
        assert layer.stats["evictions"] > 0
        assert layer.offset == layer.stats["tokens_seen"] == 150 + 30  # generate_step runs one step ahead


def test_layers_get_consecutive_seeds(model):
    cache = camkv.make_prompt_cache(model, budget=48, recent=8, seed=10)
    assert [c.config.seed for c in cache] == [10, 11]
    wrap = camkv.make_prompt_cache(model, budget=48, recent=8, seed=2**32 - 1)
    assert [c.config.seed for c in wrap] == [2**32 - 1, 0]


def test_other_cache_kinds_are_kept(model):
    class Hybrid:
        layers = [0, 1, 2]

        def make_cache(self):
            return [KVCache(), RotatingKVCache(max_size=16, keep=4), KVCache()]

    caches = camkv.make_prompt_cache(Hybrid(), budget=48, recent=8)
    assert [type(c).__name__ for c in caches] == ["CaMKVCache", "RotatingKVCache", "CaMKVCache"]


def test_apply_twice_and_remove_restore_the_models_own_make_cache():
    class WithOwn:
        layers = [0]

        def make_cache(self):
            return [KVCache()]

    m = WithOwn()
    camkv.apply(m, budget=48, recent=8)
    camkv.apply(m, budget=64, recent=8)
    assert m.make_cache()[0].config.budget == 64
    camkv.remove(m)
    assert type(m.make_cache()[0]) is KVCache


def test_batch_generation_keeps_camkv_instead_of_dropping_the_compression(model):
    from mlx_lm.generate import BatchGenerator

    from camkv.batch import BatchCaMKVCache

    with camkv.applied(model, budget=48, recent=8):
        generator = BatchGenerator(model, max_tokens=4)
        generator.insert([[1, 2, 3, 4], [5, 6, 7]])
        assert len(generator.next_generated()) == 2
        batch = generator._generation_batch.prompt_cache
        assert len(batch) == 2 and all(isinstance(c, BatchCaMKVCache) for c in batch)
        while generator.next_generated():
            pass
        generator.close()
