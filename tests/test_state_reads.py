"""Reading a CaMKVCache's state changes nothing, and the state holds the rows not scored
yet, so a prompt cache saved by mlx-lm's own save_prompt_cache goes on exactly as the
cache it was saved from (docs/algorithm.md section 7)."""

from __future__ import annotations

import copy
import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import save_prompt_cache as mlx_save_prompt_cache

import camkv
from camkv import CaMConfig, CaMKVCache
from tiny_models import tiny_llama

# Budget 24 with slack 6: a prompt block of 40 compresses; a block of 3 and two decode
# steps after it stay pending.
CONFIGS = {
    "query-window": dict(budget=24, slack=6, observation_window=4),
    "query-causal": dict(budget=24, slack=6, prefill_scoring="causal", merge="mass_weighted"),
    "key": dict(budget=24, slack=6, scoring="key", merge="mean"),
    "keepkv": dict(budget=24, slack=6, merge="keepkv"),
}


def _prompt(n: int, salt: int = 0) -> mx.array:
    return mx.array([[(5 * i + 11 * salt + 3) % 120 for i in range(n)]])


def _step(model, cache, tokens) -> mx.array:
    """One forward pass; the greedy next token [1, 1]."""
    logits = model(tokens, cache=cache)
    token = mx.argmax(logits[:, -1:], axis=-1)
    mx.eval(token)
    return token


def _with_pending(model, cfg: CaMConfig):
    """Caches that hold pending rows: a prompt block that compressed, a short block, and
    decode steps after it (none of them compressing), and the next token."""
    cache = camkv.make_prompt_cache(model, cfg)
    _step(model, cache, _prompt(40))
    token = _step(model, cache, _prompt(3, salt=1))
    for _ in range(2):
        token = _step(model, cache, token)
    assert 0 < cache[0].steps_before_compression() < cfg.slack  # pending rows, no compression due
    return cache, token


def _snapshot(cache: list) -> list:
    """What every layer holds, as NumPy: stored rows (pending scores with their mass so
    far), counters, size."""
    out = []
    for c in cache:
        out += [np.array(a.astype(mx.float32)) for a in c.stored()]
        out.append(np.array([c.size(), c.offset, *c.stats.values()]))
    return out


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and np.array_equal(x, y, equal_nan=True) for x, y in zip(a, b))


def _decode(model, cache, token, steps: int = 12) -> tuple[list[int], list]:
    """Greedy tokens over enough steps to compress, then what the cache holds."""
    tokens = []
    for _ in range(steps):
        token = _step(model, cache, token)
        tokens.append(int(token.item()))
    return tokens, _snapshot(cache)


def _same_run(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and _same(a[1], b[1])


@pytest.fixture
def model(remove_hooks):
    m = tiny_llama(vocab=128)
    remove_hooks(m)
    return m


@pytest.mark.parametrize("fields", CONFIGS.values(), ids=CONFIGS.keys())
def test_reading_state_changes_nothing(model, fields):
    cache, token = _with_pending(model, CaMConfig(**fields))
    untouched = copy.deepcopy(cache)
    before = _snapshot(cache)
    for _ in range(3):  # as mlx-lm does after every prompt chunk
        mx.eval([c.state for c in cache])
    assert _same(_snapshot(cache), before)
    # And the rest of the sequence is the one a cache whose state was never read runs.
    assert _same_run(_decode(model, cache, token), _decode(model, untouched, token))


def test_the_state_holds_the_pending_rows_unscored(model):
    cfg = CaMConfig(**CONFIGS["query-causal"])
    cache, _ = _with_pending(model, cfg)
    layer = cache[0]
    keys, values, scores, positions, _, meta_json = layer.state[:6]
    meta = json.loads(meta_json)
    held = layer.size()
    pending = held - meta["settled"]
    assert keys.shape[2] == values.shape[2] == scores.shape[2] == positions.shape[2] == held
    assert meta["settled"] == cfg.budget and pending == held - cfg.budget > 0
    assert meta["pending"] == pytest.approx(model.layers[0].self_attn.scale) and meta["waiting"] == 0
    assert np.all(np.array(scores[..., meta["settled"]:]) == 0)
    np.testing.assert_array_equal(np.array(positions[0, 0, meta["settled"]:]), np.arange(layer.offset - pending, layer.offset))
    assert layer.state[8].shape == (1, 4, pending, 16)  # the pending rows' queries [B, Hq, k, Dk]


@pytest.mark.parametrize("fields", CONFIGS.values(), ids=CONFIGS.keys())
def test_mlx_lms_own_save_round_trips_the_pending_rows(model, fields, tmp_path):
    cache, token = _with_pending(model, CaMConfig(**fields))
    path = str(tmp_path / "cache.safetensors")
    mlx_save_prompt_cache(path, cache)  # reads state as it is: pending rows and all
    loaded = camkv.load_prompt_cache(path)
    assert _same(_snapshot(loaded), _snapshot(cache))
    assert _same_run(_decode(model, loaded, token), _decode(model, cache, token))


def test_camkvs_save_compresses_first(model, tmp_path):
    cfg = CaMConfig(**CONFIGS["query-window"])
    cache, _ = _with_pending(model, cfg)
    path = camkv.save_prompt_cache(str(tmp_path / "cache"), cache)
    for c in (*cache, *camkv.load_prompt_cache(path)):
        state = c.state
        meta = json.loads(state[5])
        assert state[0].shape[2] == meta["settled"] == cfg.budget and meta["pending"] is None
        assert len(state) == 6  # no pending queries saved


def test_a_state_with_more_rows_than_it_can_hold_is_refused():
    cfg = CaMConfig(budget=8, slack=2, scoring="key")
    cache = CaMKVCache(cfg)
    cache.update_and_fetch(*(mx.zeros((1, 2, 9, 4)),) * 2)
    state = list(cache.state)
    meta = json.loads(state[5])
    for change, message in ((dict(settled=9), "9 scored rows; it can hold 0 to its budget 8"),
                            (dict(waiting=10), "10 rows waiting for their queries; it holds 9 pending rows")):
        state[5] = json.dumps({**meta, **change})
        with pytest.raises(ValueError, match=message):
            CaMKVCache.from_state(state)
    grown = [mx.zeros((1, 2, 11, 4))] * 2 + [mx.zeros((1, 2, 11))] * 2 + state[4:5] + [json.dumps(meta)]
    with pytest.raises(ValueError, match=r"holds 11 rows .* budget \+ slack = 8 \+ 2"):
        CaMKVCache.from_state(grown)
