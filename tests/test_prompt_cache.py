"""Saving a prompt cache with camkv layers and loading it back continues generation identically."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import RotatingKVCache

import camkv
from tiny_models import tiny_gemma3, tiny_llama


def _prefill(model, cache, tokens):
    model(mx.array(tokens)[None], cache=cache)
    mx.eval([c.state for c in cache])


def _continue(model, cache, last_token, n=12):
    """Greedy tokens and each step's log-probabilities (tiny random models repeat tokens,
    so the log-probabilities are what tells two caches apart)."""
    steps = list(generate_step(mx.array([last_token]), model, max_tokens=n, prompt_cache=cache))
    return [token for token, _ in steps], np.stack([np.array(lp) for _, lp in steps])


@pytest.mark.parametrize("make_model", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3"])
def test_saved_and_loaded_cache_continues_generation_identically(tmp_path, make_model, remove_hooks):
    model = make_model()
    remove_hooks(model)
    prompt = np.random.default_rng(0).integers(0, 128, 120).tolist()
    cache = camkv.make_prompt_cache(model, budget=48, n_sink=2, recent=8, merge_keys=True)
    _prefill(model, cache, prompt[:-1])
    assert cache[-1].stats["evictions"] > 0  # the saved state is a compressed one

    path = tmp_path / "prompt.safetensors"
    camkv.save_prompt_cache(str(path), cache, metadata={"model": "tiny"})
    loaded, metadata = camkv.load_prompt_cache(str(path), return_metadata=True)

    assert metadata == {"model": "tiny"}
    assert [type(c) for c in loaded] == [type(c) for c in cache]
    for before, after in zip(cache, loaded):
        if isinstance(before, camkv.CaMKVCache):
            assert after.config == before.config and after.stats == before.stats
            for a, b in zip(before.stored(), after.stored()):
                assert mx.array_equal(a, b)
    if make_model is tiny_gemma3:
        assert any(isinstance(c, RotatingKVCache) for c in loaded)  # mlx-lm classes load too
    tokens, logprobs = _continue(model, cache, prompt[-1])
    tokens_loaded, logprobs_loaded = _continue(model, loaded, prompt[-1])
    assert tokens_loaded == tokens
    np.testing.assert_allclose(logprobs_loaded, logprobs, atol=1e-6)
    # The comparison can tell caches apart: one missing the first 30 prompt tokens differs.
    other = camkv.make_prompt_cache(model, budget=48, n_sink=2, recent=8, merge_keys=True)
    _prefill(model, other, prompt[30:-1])
    assert np.abs(_continue(model, other, prompt[-1])[1] - logprobs).max() > 1e-3


def test_unknown_layer_class_is_refused(tmp_path):
    from mlx_lm.models.cache import KVCache, save_prompt_cache

    class NotACache(KVCache):
        pass

    cache = [NotACache()]
    cache[0].update_and_fetch(mx.zeros((1, 1, 2, 4)), mx.zeros((1, 1, 2, 4)))
    save_prompt_cache(str(tmp_path / "p.safetensors"), cache)
    with pytest.raises(ValueError, match="'NotACache' is neither camkv's nor mlx-lm's"):
        camkv.load_prompt_cache(str(tmp_path / "p.safetensors"))
