"""The two StreamingLLM arms of an evaluation on a chunked prompt: mlx-lm's
RotatingKVCache ("streamingllm") masks the sinks it keeps from a prompt chunk's later
queries, camkv's recency eviction ("streamingllm-sinks") keeps the same tokens and lets
every query see them."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import RotatingKVCache

from camkv.eval.arms import CacheSettings, make_cache, parse_methods

BUDGET, N_SINK, HEADS, DIM = 8, 2, 1, 4


class _OneLayer:
    """The least a model needs for make_prompt_cache: one plain attention layer."""

    def __init__(self):
        self.layers = [object()]

    def make_cache(self):
        from mlx_lm.models.cache import KVCache
        return [KVCache()]


def _chunk(start: int, length: int):
    rng = np.random.default_rng(start)
    shape = (1, HEADS, length, DIM)
    return (mx.array(rng.standard_normal(shape).astype(np.float32)),
            mx.array(rng.standard_normal(shape).astype(np.float32)))


def _sink_columns_seen(cache, first: int, second: int) -> np.ndarray:
    """For each query of the second chunk: whether it may attend to the sinks' columns."""
    cache.update_and_fetch(*_chunk(0, first))
    mask = cache.make_mask(second, return_array=True)
    cache.update_and_fetch(*_chunk(first, second))
    return np.array(mask)[..., :N_SINK].reshape(second, N_SINK).all(axis=1)


def _settings() -> CacheSettings:
    return CacheSettings(n_sink=N_SINK, recent=None, window=4, seed=0, backend="reference")


def test_rotating_cache_hides_its_sinks_from_a_later_prompt_chunk():
    seen = _sink_columns_seen(RotatingKVCache(max_size=BUDGET, keep=N_SINK), BUDGET, 6)
    assert not seen[1:].any()  # only the chunk's first query still sees them


def test_recency_arm_keeps_the_same_tokens_and_shows_them_to_every_query():
    arms = {a.name: a for a in parse_methods("streamingllm,streamingllm-sinks")}
    (cache,) = make_cache(_OneLayer(), arms["streamingllm-sinks"], BUDGET, _settings())
    cache.update_and_fetch(*_chunk(0, BUDGET))
    mask = cache.make_mask(6, return_array=True)
    assert mask is None or isinstance(mask, str) or np.array(mask)[..., :N_SINK].all()
    cache.update_and_fetch(*_chunk(BUDGET, 6))
    kept = sorted(int(p) for p in np.array(cache.stored()[3]).reshape(-1))
    newest = BUDGET + 6
    assert kept == list(range(N_SINK)) + list(range(newest - (BUDGET - N_SINK), newest))
