"""mass_bias: a merged row attends (and scores) with log of the mass it stands for.

Defined in CaMConfig's docstring: every merge of s_in into a target of score s_t
multiplies the target's attention weight by (s_t + s_in) / s_t (a logit bias of
log1p(s_in / s_t)); the attention hook adds the bias to the model's attention.
"""

from __future__ import annotations

import numpy as np
import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache as full_prompt_cache

import camkv
from camkv import CaMConfig, CaMKVCache, reference
from camkv.reference import RowState
from tiny_models import tiny_llama

BLENDING = ["sim_weighted", "mean", "mass_weighted", "window_mass"]


def _cfg(**fields):
    base = dict(budget=8, n_sink=1, recent=2, merge="mass_weighted", scoring="query",
                mass_bias=True, backend="reference")
    base.update(fields)
    return CaMConfig(**base)


@pytest.mark.parametrize("fields, match", [
    (dict(merge="window"), "blending merge mode.*'window'"),
    (dict(merge="drop"), "blending merge mode.*'drop'"),
    (dict(scoring="key"), "scoring='query'.*'key'"),
    (dict(backend="ext"), "reference backend only.*'ext'"),
    (dict(backend="cuda"), "reference backend only.*'cuda'"),
])
def test_mass_bias_rejects_what_cannot_carry_it(fields, match):
    with pytest.raises(ValueError, match=match):
        _cfg(**fields)


def test_mass_bias_must_be_a_bool():
    with pytest.raises(ValueError, match="mass_bias must be True or False"):
        _cfg(mass_bias=1)


def _full_state(rng, rows, n, dim, scores):
    keys = mx.array(rng.standard_normal((rows, n, dim)).astype(np.float32))
    values = mx.array(rng.standard_normal((rows, n, dim)).astype(np.float32))
    positions = mx.broadcast_to(mx.arange(n, dtype=mx.int32), (rows, n))
    return RowState(keys, values, mx.array(scores, mx.float32), positions,
                    mx.zeros((rows, n), mx.float32))


def _one_token(state, rng, dim):
    rows = state.keys.shape[0]
    k = mx.array(rng.standard_normal((rows, 1, dim)).astype(np.float32))
    v = mx.array(rng.standard_normal((rows, 1, dim)).astype(np.float32))
    q = mx.array(rng.standard_normal((rows, 1, 2, dim)).astype(np.float32))
    ids = mx.arange(rows).astype(mx.uint32)
    return k, v, q, ids


@pytest.mark.parametrize("merge", ["sim_weighted", "mean", "mass_weighted"])
def test_a_nearest_merge_grows_the_targets_bias_by_log1p_of_the_mass_ratio(merge):
    rng = np.random.default_rng(0)
    dim, n = 8, 8
    cfg = _cfg(merge=merge)
    state = _full_state(rng, 3, n, dim, rng.uniform(1.0, 3.0, (3, n)))
    state = state._replace(bias=mx.array(rng.uniform(0.0, 0.5, (3, n)), mx.float32))
    k, v, q, ids = _one_token(state, rng, dim)
    after, merges = reference.update(state, k, v, n, cfg, ids, q, 0.3)
    # The same step without merging (drop) gives the scores each row had before the
    # merge; the bias then grew only at the target, which received the loser's score.
    dropped, _ = reference.update(state._replace(bias=state.bias), k, v, n,
                                  cfg.replace(mass_bias=False, merge="drop"), ids, q, 0.3)
    assert merges.tolist() == [1, 1, 1]
    kept = np.array(dropped.positions)
    assert (np.array(after.positions) == kept).all()
    for r in range(3):
        old_bias = {int(p): float(b) for p, b in zip(np.array(state.positions)[r], np.array(state.bias)[r])}
        base_scores = np.array(dropped.scores)[r]
        grown = np.array(after.scores)[r] - base_scores
        t = int(np.argmax(np.abs(grown) > 1e-6))
        s_in = grown[t]
        assert np.count_nonzero(np.abs(grown) > 1e-6) == 1
        bias = np.array(after.bias)[r]
        before = np.array([old_bias.get(int(p), 0.0) for p in kept[r]], np.float32)
        expected = before.copy()
        expected[t] += np.log1p(s_in / base_scores[t])
        np.testing.assert_allclose(bias, expected, rtol=1e-5, atol=1e-6)


def test_window_mass_grows_each_window_targets_bias_by_its_share():
    rng = np.random.default_rng(1)
    dim, n = 8, 8
    cfg = _cfg(merge="window_mass", window=3)
    scores = rng.uniform(1.0, 3.0, (2, n))
    scores[:, 1] = 0.05  # position 1 is the clear loser, so the window is positions 2, 3, 4
    state = _full_state(rng, 2, n, dim, scores)
    k, v, q, ids = _one_token(state, rng, dim)
    after, _ = reference.update(state, k, v, n, cfg, ids, q, 0.3)
    dropped, _ = reference.update(state, k, v, n, cfg.replace(mass_bias=False, merge="drop"), ids, q, 0.3)
    assert np.array(after.positions)[0].tolist() == [0, 2, 3, 4, 5, 6, 7, 8]
    share = (np.array(after.scores) - np.array(dropped.scores))[:, 1:4]
    expected = np.log1p(share / np.array(dropped.scores)[:, 1:4])
    np.testing.assert_allclose(np.array(after.bias)[:, 1:4], expected, rtol=1e-5, atol=1e-6)
    assert (np.array(after.bias)[:, 4:] == 0).all() and (np.array(after.bias)[:, 0] == 0).all()


@pytest.mark.parametrize("merge", BLENDING)
def test_chunk_of_one_token_equals_exact_with_the_bias(merge):
    rng = np.random.default_rng(2)
    dim = 8
    states = {}
    for prefill in ("exact", "chunk"):
        cfg = _cfg(merge=merge, prefill=prefill)
        state = RowState.empty(2, dim, dim, mx.float32)
        rng = np.random.default_rng(2)
        for p in range(20):
            k, v, q, ids = _one_token(state, rng, dim)
            state, _ = reference.update(state, k, v, p, cfg, ids, q, 0.4)
        states[prefill] = state
    for a, b in zip(states["exact"].arrays(), states["chunk"].arrays()):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-6)
    assert np.array(states["exact"].bias).max() > 0  # something merged and grew


def test_merging_a_twin_token_changes_no_attention_output():
    """Two rows with equal keys and equal mass: after one folds into the other
    (mass_weighted blends the values half and half, the bias adds log 2), every query
    attends to exactly what it attended to with both rows."""
    rng = np.random.default_rng(3)
    dim, n = 16, 8
    cfg = _cfg(budget=n, n_sink=1, recent=2)
    state = _full_state(rng, 1, n, dim, [[9.0, 9.0, 9.0, 0.5, 9.0, 0.5, 9.0, 9.0]])
    keys = np.array(state.keys)
    keys[0, 5] = keys[0, 3]  # rows 3 and 5: the two lowest scores, the same key
    state = state._replace(keys=mx.array(keys))
    k, v, q, ids = _one_token(state, rng, dim)
    after, merges = reference.update(state, k, v, n, cfg, ids, q, 0.25)
    assert merges.tolist() == [1]
    assert 3 not in np.array(after.positions)[0].tolist()
    np.testing.assert_allclose(np.array(after.bias)[0, 4], np.log(2.0), rtol=1e-6)
    every = mx.concatenate([state.keys, k], axis=1), mx.concatenate([state.values, v], axis=1)
    probes = mx.array(rng.standard_normal((1, 4, 1, dim)).astype(np.float32))

    def attend(keys, values, mask):
        return mx.fast.scaled_dot_product_attention(probes, keys[:, None], values[:, None],
                                                    scale=0.25, mask=mask)

    bias = after.bias[:, None, None, :].astype(mx.float32)
    np.testing.assert_allclose(np.array(attend(after.keys, after.values, bias)),
                               np.array(attend(*every, None)), rtol=1e-5, atol=1e-6)


@pytest.fixture
def fed(monkeypatch):
    """Caches built directly wait for queries as if camkv's hook were installed."""
    monkeypatch.setattr(CaMKVCache, "_queries_can_come", lambda self: True)


def _cache_with_bias(groups=2):
    cache = CaMKVCache(_cfg(budget=6, n_sink=1, recent=1))
    rng = np.random.default_rng(4)
    for step, s_len in enumerate([5, 1, 1, 1]):
        k = mx.array(rng.standard_normal((1, 2, s_len, 8)).astype(np.float32))
        cache.update_and_fetch(k, k)
        cache.observe_queries(mx.array(rng.standard_normal((1, 2 * groups, s_len, 8)).astype(np.float32)), 0.35)
    return cache, rng


@pytest.mark.parametrize("mask", [None, "causal", "bool", "additive"])
def test_attention_mask_adds_each_rows_bias_to_mlx_lms_mask(fed, mask):
    cache, rng = _cache_with_bias()
    stored = np.array(cache.stored_bias())  # [1, 2, n]
    assert stored.max() > 0
    S = 1 if mask is None else 3
    k = mx.array(rng.standard_normal((1, 2, S, 8)).astype(np.float32))
    cache.update_and_fetch(k, k)
    queries = mx.zeros((1, 4, S, 8), mx.float16)
    L = stored.shape[2] + S
    causal = np.tril(np.ones((S, L), bool), L - S)
    given = {None: None, "causal": "causal", "bool": mx.array(causal),
             "additive": mx.array(np.where(causal, 0.5, -np.inf).astype(np.float32))}[mask]
    got = cache.attention_mask(given, queries)
    bias = np.concatenate([stored, np.zeros((1, 2, S), np.float32)], axis=2)
    expected = np.repeat(bias, 2, axis=1)[:, :, None, :] + np.zeros((1, 4, S, L), np.float32)
    if mask is not None:
        expected = np.where(causal, expected + (0.5 if mask == "additive" else 0.0), -np.inf)
    assert got.dtype == mx.float16 and got.shape == expected.shape
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), expected, rtol=1e-3)
    cache.observe_queries(mx.zeros((1, 4, S, 8)), 0.35)


def test_a_cache_without_bias_leaves_the_mask_alone(fed):
    cache = CaMKVCache(budget=6, n_sink=1, recent=1, scoring="query")
    k = mx.ones((1, 2, 3, 8))
    cache.update_and_fetch(k, k)
    cache.observe_queries(mx.zeros((1, 2, 3, 8)), 0.35)
    assert cache.attention_mask("causal", mx.zeros((1, 2, 3, 8))) == "causal"
    assert cache.stored_bias() is None


def test_state_round_trip_keeps_the_bias(fed):
    cache, _ = _cache_with_bias()
    copy = CaMKVCache()
    copy.state = cache.state
    np.testing.assert_array_equal(np.array(copy.stored_bias()), np.array(cache.stored_bias()))
    assert copy.config.mass_bias


def _generate(model, caches, prompt, max_tokens=10):
    steps = generate_step(prompt, model, max_tokens=max_tokens, prompt_cache=caches, prefill_step_size=16)
    out = [int(t) for t, _ in steps]
    camkv.remove(model)
    return out


def test_with_room_for_every_token_the_bias_changes_nothing():
    model = tiny_llama(heads=4, kv_heads=2, layers=2)
    prompt = mx.array([(7 * i + 3) % 120 for i in range(40)])
    full = _generate(model, full_prompt_cache(model), prompt)
    biased = _generate(model, camkv.make_prompt_cache(model, budget=64, merge="mass_weighted", mass_bias=True), prompt)
    assert biased == full


def test_the_model_attends_with_the_bias_once_rows_merged():
    model = tiny_llama(heads=4, kv_heads=2, layers=2)
    prompt = mx.array([(7 * i + 3) % 120 for i in range(60)])
    caches = camkv.make_prompt_cache(model, budget=24, n_sink=2, recent=4, merge="mass_weighted", mass_bias=True)
    seen = []
    original = CaMKVCache.attention_mask

    def recording(self, mask, queries):
        out = original(self, mask, queries)
        seen.append(out is not None and not isinstance(out, str))
        return out

    CaMKVCache.attention_mask = recording
    try:
        _generate(model, caches, prompt, max_tokens=6)
    finally:
        CaMKVCache.attention_mask = original
    assert caches[0].stats["merges"] > 0
    assert np.array(caches[0].stored_bias()).max() > 0
    assert seen[-1]  # a decode step attended with an additive bias array
