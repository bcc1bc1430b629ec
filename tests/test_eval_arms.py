"""An evaluation arm at equal bytes (--arm 'NAME={..., "equal_bytes": true}'): its cache
gets the bytes camkv's default holds at the run's budget, and chooses its own budget."""

from __future__ import annotations

import mlx.core as mx
import pytest

from camkv.eval.arms import CacheSettings, default_layer_bytes, make_cache, parse_arm_spec
from camkv.models import random_llama

BUDGET = 64


def _settings() -> CacheSettings:
    return CacheSettings(n_sink=4, recent=None, window=4, seed=0, backend="reference")


def _filled(caches, tokens: int):
    """Each cache after a prompt of `tokens` random keys and values (and one decode step)."""
    for i, cache in enumerate(caches):
        shape = (1, 2, tokens, 32)
        keys = mx.random.normal(shape, key=mx.random.key(i))
        cache.update_and_fetch(keys, keys * 0.5)
        cache.update_and_fetch(keys[:, :, :1], keys[:, :, :1])
    return caches


def test_equal_bytes_arm_holds_more_rows_in_the_default_arms_bytes():
    model = random_llama("random-demo", dtype=mx.float32)
    default = make_cache(model, parse_arm_spec('d={"scoring": "key"}'), BUDGET, _settings())
    quantized = make_cache(model, parse_arm_spec('q={"scoring": "key", "bits": 4, "equal_bytes": true}'),
                           BUDGET, _settings())
    assert default[0].config.budget == BUDGET
    assert quantized[0].config.bits == 4 and quantized[0].config.budget > 3 * BUDGET
    limit = default_layer_bytes(model, BUDGET)
    _filled(default, 400), _filled(quantized, 400)
    assert default[0].nbytes <= limit and quantized[0].nbytes <= limit
    assert quantized[0].nbytes > 0.8 * default[0].nbytes  # the bytes are used, not left over


def test_equal_bytes_must_be_a_bool():
    with pytest.raises(ValueError, match="equal_bytes must be true or false"):
        parse_arm_spec('q={"bits": 4, "equal_bytes": 1}')
