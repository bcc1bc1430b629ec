"""Recency eviction (CaMConfig.eviction; CAM_STREAMING, CaM as its authors ran it) and
window scoring of prompt chunks (CaMConfig.prefill_scoring, observation_window, pool):
docs/algorithm.md sections 3, 7 and 11, on every backend."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

import oracle
from camkv import CaMConfig, CaMKVCache, backends, reference
from camkv.backends import drop
from camkv.config import CAM_STREAMING
from camkv.eval.arms import CacheSettings, make_cache, parse_methods
from camkv.rows import RowState
from conftest import random_block, run_calls
from test_equivalence import check_backend
from tiny_models import feed_with_queries

ROWS, K_DIM, V_DIM = 3, 8, 6


def _update(backend):
    return backends.resolve(backend).update


def _row_ids(rows=ROWS):
    return mx.arange(rows).astype(mx.uint32)


def _expected_positions(offset: int, budget: int, n_sink: int) -> list[int]:
    """What recency eviction keeps: every token while they fit, else the sinks and the newest."""
    if offset <= budget:
        return list(range(offset))
    return list(range(n_sink)) + list(range(offset - (budget - n_sink), offset))


def _softmax_mass(queries, keys, scale, first_index):
    """NumPy: query i (row index first_index + i) sees rows [0, first_index + i]; weights
    summed over queries and divided by the queries per token. queries [S, G, Dk]."""
    mass = np.zeros(keys.shape[0], np.float64)
    for i, per_token in enumerate(queries):
        visible = keys[: first_index + i + 1].astype(np.float64)
        for q in per_token:
            logits = scale * visible @ q.astype(np.float64)
            w = np.exp(logits - logits.max())
            mass[: len(w)] += w / w.sum() / len(per_token)
    return mass


# ---------------------------------------------------------------- section 3: recency eviction


@pytest.mark.parametrize("prefill", ["exact", "chunk"])
@pytest.mark.parametrize("merge", ["drop", "window", "mass_weighted"])
def test_recency_eviction_keeps_the_sinks_and_the_newest_tokens(backend, prefill, merge):
    cfg = CaMConfig(budget=10, n_sink=3, recent=2, eviction="recency", merge=merge, window=3, gate=True,
                    prefill=prefill, backend=backend)
    rng = np.random.default_rng(4)
    state, offset = RowState.empty(ROWS, K_DIM, V_DIM, mx.float32), 0
    for s_len in [4, 1, 7, 1, 1, 12, 1, 3]:
        keys, values = random_block(rng, ROWS, s_len, K_DIM, V_DIM, mx.float32)
        state, _ = _update(backend)(state, keys, values, offset, cfg, _row_ids())
        offset += s_len
        want = _expected_positions(offset, cfg.budget, cfg.n_sink)
        assert np.array(state.positions).tolist() == [want] * ROWS, f"after {offset} tokens"


@pytest.mark.parametrize("gate", [True, False])
@pytest.mark.parametrize("merge", ["window", "drop", "sim_weighted"])
def test_exact_recency_eviction_matches_the_numpy_oracle(backend, merge, gate):
    cfg = CaMConfig(budget=8, n_sink=2, recent=3, eviction="recency", merge=merge, window=3, gate=gate,
                    prefill="exact", seed=7, backend=backend)
    rng = np.random.default_rng(11)
    state = RowState.empty(ROWS, K_DIM, V_DIM, mx.float32)
    mirror = [[np.zeros((0, K_DIM), np.float32), np.zeros((0, V_DIM), np.float32), np.zeros(0, np.float32),
               np.zeros(0, np.int64)] for _ in range(ROWS)]
    merged = np.zeros(ROWS, int)
    for p in range(20):
        k, v = random_block(rng, ROWS, 1, K_DIM, V_DIM, mx.float32)
        state, did = _update(backend)(state, k, v, p, cfg, _row_ids())
        merged += np.array(did)
        for r in range(ROWS):
            *mirror[r], _ = oracle.step(*mirror[r], np.array(k[r, 0]), np.array(v[r, 0]), p,
                                        np.array(k[r, 0])[None], 1 / np.sqrt(K_DIM), cfg, r)
        for r in range(ROWS):
            np.testing.assert_array_equal(np.array(state.positions[r]), mirror[r][3], err_msg=f"step {p}")
            np.testing.assert_allclose(np.array(state.scores[r]), mirror[r][2], rtol=1e-4, atol=1e-6)
            np.testing.assert_allclose(np.array(state.values[r]), mirror[r][1], rtol=1e-5, atol=1e-6)
    if merge != "drop":
        assert merged.sum() > 0


# ---------------------------------------------------------------- sections 4.2-4.4 under recency


def _full_state(backend, cfg, rng):
    """A state of exactly budget tokens (nothing evicted or merged yet) and its values."""
    keys, values = random_block(rng, ROWS, cfg.budget, K_DIM, V_DIM, mx.float32)
    state, _ = _update(backend)(RowState.empty(ROWS, K_DIM, V_DIM, mx.float32), keys, values, 0, cfg, _row_ids())
    return state, np.array(values)


@pytest.mark.parametrize("losers", [1, 5])
def test_each_evicted_token_adds_its_share_to_the_window_survivors_after_it(backend, losers):
    """Recency evicts the `losers` oldest non-sinks; each adds V_e / window to the `window`
    survivors after it in position order (the same ones for a block of losers); keys and
    every other row stay as they were."""
    cfg = CaMConfig(budget=12, n_sink=2, recent=2, eviction="recency", merge="window", window=4, gate=False,
                    backend=backend)
    rng = np.random.default_rng(8)
    state, values = _full_state(backend, cfg, rng)
    keys, new_values = random_block(rng, ROWS, losers, K_DIM, V_DIM, mx.float32)
    before_keys = np.concatenate([np.array(state.keys), np.array(keys)], axis=1)
    out, merged = _update(backend)(state, keys, new_values, cfg.budget, cfg, _row_ids())
    assert np.array(merged).tolist() == [losers] * ROWS
    evicted = list(range(cfg.n_sink, cfg.n_sink + losers))
    kept = [j for j in range(cfg.budget + losers) if j not in evicted]
    assert np.array(out.positions).tolist() == [kept] * ROWS
    want = np.concatenate([values, np.array(new_values)], axis=1)
    share = want[:, evicted].sum(axis=1) / cfg.window
    receivers = kept[cfg.n_sink : cfg.n_sink + cfg.window]
    want[:, receivers] += share[:, None, :]
    np.testing.assert_allclose(np.array(out.values), want[:, kept], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.array(out.keys), before_keys[:, kept])


def test_cam_streaming_gate_opens_with_probability_s_e_over_the_receivers_mean(backend):
    """One eviction per row, 64 rows: each merges exactly when its draw falls below
    clamp(s_e / mean score of the window receivers, 0, 1), scores after the step's update."""
    rows = 64
    cfg = CaMConfig(budget=40, n_sink=2, recent=4, backend=backend, scoring="key", prefill="exact",
                    **CAM_STREAMING)
    rng = np.random.default_rng(3)
    keys, values = random_block(rng, rows, cfg.budget + 1, K_DIM, V_DIM, mx.float32)
    ids = _row_ids(rows)
    # Scores as a long sequence may leave them (a fresh one gives its oldest tokens the most).
    scores = mx.array(rng.uniform(0.0, 2.0, (rows, cfg.budget)).astype(np.float32))
    positions = mx.broadcast_to(mx.arange(cfg.budget, dtype=mx.int32), (rows, cfg.budget))
    state = RowState(keys[:, :-1], values[:, :-1], scores, positions)
    # The same token into a roomier cache: the scores after this step's update, nothing evicted.
    roomy, _ = _update(backend)(state, keys[:, -1:], values[:, -1:], cfg.budget, cfg.replace(budget=cfg.budget + 1),
                                ids)
    _, merged = _update(backend)(state, keys[:, -1:], values[:, -1:], cfg.budget, cfg, ids)
    scores = np.array(roomy.scores)
    e = cfg.n_sink  # the oldest non-sink
    probability = np.clip(scores[:, e] / scores[:, e + 1 : e + 1 + cfg.window].mean(axis=1), 0, 1)
    draws = np.array(reference.uniform(cfg.seed, ids, e))
    opened = np.array(merged).astype(bool)
    np.testing.assert_array_equal(opened, draws < probability)
    assert 0 < opened.sum() < rows  # both outcomes occur: the gate decides


def test_cam_streaming_is_deterministic_and_its_seed_changes_only_the_merges(backend):
    cfg = CaMConfig(budget=10, n_sink=2, recent=2, backend=backend, seed=5, **CAM_STREAMING)
    sizes = [6, 1, 9, 1, 1, 1, 14, 1]
    a, ma = run_calls(_update(backend), cfg, sizes)
    b, mb = run_calls(_update(backend), cfg, sizes)
    for x, y in zip(list(a.arrays()) + ma, list(b.arrays()) + mb):
        assert mx.array_equal(x, y).item()
    c, mc = run_calls(_update(backend), cfg.replace(seed=6), sizes)
    assert mx.array_equal(a.positions, c.positions).item()  # recency: the seed cannot move a token
    assert not all(mx.array_equal(x, y).item() for x, y in zip(ma, mc))


# ---------------------------------------------------------------- section 7: window scoring


def _window_call(backend, cfg, queries_first=None, n=5, s_len=20, groups=2, seed=0):
    """A causal call of n tokens, then one chunk call of s_len tokens under cfg. Returns
    (state after, keys of all n + s_len rows, the chunk's queries, scores before the chunk)."""
    rng = np.random.default_rng(seed)
    update = _update(backend)
    k0, v0 = random_block(rng, ROWS, n, K_DIM, V_DIM, mx.float32)
    q0 = mx.array(rng.standard_normal((ROWS, n, groups, K_DIM)).astype(np.float32))
    start, _ = update(RowState.empty(ROWS, K_DIM, V_DIM, mx.float32), k0, v0, 0,
                      cfg.replace(prefill_scoring="causal", pool=1), _row_ids(), q0, 0.4)
    k, v = random_block(rng, ROWS, s_len, K_DIM, V_DIM, mx.float32)
    q = rng.standard_normal((ROWS, s_len, groups, K_DIM)).astype(np.float32)
    if queries_first is not None:
        q[:, : len(queries_first)] = queries_first
    out, merged = update(start, k, v, n, cfg, _row_ids(), mx.array(q), 0.4)
    mx.eval(out, merged)
    return out, merged, np.concatenate([np.array(k0), np.array(k)], axis=1), q, np.array(start.scores)


@pytest.mark.parametrize("observation_window", [1, 6, 20, 50])
def test_window_scoring_adds_the_causal_mass_of_the_last_w_queries_only(backend, observation_window):
    cfg = CaMConfig(budget=64, n_sink=1, recent=4, scoring="query", prefill_scoring="window",
                    observation_window=observation_window, backend=backend)
    out, _, keys, q, before = _window_call(backend, cfg)
    n, s_len = 5, 20
    w = min(observation_window, s_len)
    for r in range(ROWS):
        mass = _softmax_mass(q[r, s_len - w :], keys[r], 0.4, n + s_len - w)
        want = np.concatenate([before[r], np.zeros(s_len)]) + mass
        np.testing.assert_allclose(np.array(out.scores[r]), want, rtol=1e-4, atol=1e-6)


def test_window_scoring_ignores_the_queries_before_the_window(backend):
    cfg = CaMConfig(budget=16, n_sink=1, recent=3, scoring="query", prefill_scoring="window",
                    observation_window=6, merge="mass_weighted", backend=backend)
    a = _window_call(backend, cfg)
    b = _window_call(backend, cfg, queries_first=np.full((14, 2, K_DIM), 3.0, np.float32))
    for x, y in zip(list(a[0].arrays()) + [a[1]], list(b[0].arrays()) + [b[1]]):
        assert mx.array_equal(x, y).item()
    c = _window_call(backend, cfg.replace(observation_window=7),
                     queries_first=np.full((14, 2, K_DIM), 3.0, np.float32))
    assert not mx.array_equal(a[0].scores, c[0].scores).item()  # the 14th query is in a window of 7


@pytest.mark.parametrize("merge", ["drop", "window", "sim_weighted"])
def test_window_scoring_equals_causal_scoring_where_the_other_queries_add_nothing(backend, merge):
    """Evicting and merging included: a window-scored chunk equals the causal rule of
    section 7 with the queries before the window poisoned (section 2: a query whose
    every logit is masked adds nothing)."""
    window = CaMConfig(budget=14, n_sink=2, recent=3, scoring="query", merge=merge, window=3, gate=True,
                       prefill_scoring="window", observation_window=5, backend=backend)
    a = _window_call(backend, window, s_len=20)
    poisoned = np.full((15, 2, K_DIM), np.nan, np.float32)
    b = _window_call(backend, window.replace(prefill_scoring="causal"), queries_first=poisoned, s_len=20)
    np.testing.assert_array_equal(np.array(a[0].positions), np.array(b[0].positions))
    np.testing.assert_allclose(np.array(a[0].scores), np.array(b[0].scores), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.array(a[0].values), np.array(b[0].values), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.array(a[1]), np.array(b[1]))


@pytest.mark.parametrize("pool", [3, 7])
def test_pooling_gives_each_row_the_largest_window_mass_within_half_the_pool(backend, pool):
    cfg = CaMConfig(budget=64, n_sink=1, recent=4, scoring="query", prefill_scoring="window",
                    observation_window=6, pool=pool, backend=backend)
    out, _, keys, q, before = _window_call(backend, cfg)
    n, s_len, half = 5, 20, pool // 2
    for r in range(ROWS):
        mass = _softmax_mass(q[r, s_len - 6 :], keys[r], 0.4, n + s_len - 6)
        pooled = np.array([mass[max(0, j - half) : j + half + 1].max() for j in range(len(mass))])
        want = np.concatenate([before[r], np.zeros(s_len)]) + pooled
        np.testing.assert_allclose(np.array(out.scores[r]), want, rtol=1e-4, atol=1e-6)


def test_a_single_token_call_is_scored_the_same_under_either_prefill_scoring(backend):
    causal = CaMConfig(budget=8, n_sink=1, recent=2, merge="window", gate=True, backend=backend)
    window = causal.replace(prefill_scoring="window", observation_window=2, pool=3)
    a, ma = run_calls(_update(backend), causal, [1] * 20, queries_per_kv=2)
    b, mb = run_calls(_update(backend), window, [1] * 20, queries_per_kv=2)
    for x, y in zip(list(a.arrays()) + ma, list(b.arrays()) + mb):
        assert mx.array_equal(x, y).item()


# ---------------------------------------------------------------- the cache: prompt blocks vs decode steps


def _blocks(sizes, seed=2, heads=2):
    """Random key and value blocks [1, heads, S, D], one per size."""
    rng = np.random.default_rng(seed)
    return [(mx.array(rng.standard_normal((1, heads, s_len, K_DIM)).astype(np.float32)),
             mx.array(rng.standard_normal((1, heads, s_len, V_DIM)).astype(np.float32))) for s_len in sizes]


def _feed_cache(cache, blocks):
    for keys, values in blocks:
        cache.update_and_fetch(keys, values)
    return cache


@pytest.mark.parametrize("prompt", [10, 30])
def test_the_cache_scores_prompt_blocks_by_the_window_and_decode_steps_by_every_query(prompt):
    """Under window scoring a prompt block is compressed on its own (by its last queries)
    and the decode steps after it exactly as causal scoring compresses them."""
    window = CaMConfig(budget=16, n_sink=2, recent=3, slack=4, scoring="key", prefill_scoring="window",
                       observation_window=4, pool=3, merge="window", gate=True, backend="reference")
    blocks = _blocks([prompt] + [1] * 23)
    whole = _feed_cache(CaMKVCache(window), blocks)
    # The prompt alone, compressed, then continued causally.
    prompt_only = _feed_cache(CaMKVCache(window), blocks[:1])
    prompt_only.compress_pending()
    saved = prompt_only.state
    meta = json.loads(saved[5])
    meta["config"].update(prefill_scoring="causal", pool=1)
    causal = CaMKVCache()
    causal.state = (*saved[:5], json.dumps(meta))
    _feed_cache(causal, blocks[1:])
    for x, y in zip(whole.stored(), causal.stored()):
        assert mx.array_equal(x, y).item()
    # And the window mattered: causal scoring of the prompt ends elsewhere.
    plain = _feed_cache(CaMKVCache(window.replace(prefill_scoring="causal", pool=1)), blocks)
    assert not mx.array_equal(plain.stored()[2], whole.stored()[2]).item()


def _feed_with_queries(cache, sizes, seed=3, heads=2, groups=2):
    """One random prompt fed in blocks with its queries (tiny_models.feed_with_queries)."""
    return feed_with_queries(cache, sizes, seed=seed, heads=heads, groups=groups, k_dim=K_DIM, v_dim=V_DIM)


@pytest.mark.parametrize("observation_window", [4, 9, 40])
def test_a_pending_span_of_several_prompt_blocks_is_scored_by_its_last_queries(
        backend, observation_window, monkeypatch):
    """The window may span blocks shorter than it: the cache keeps only the window's
    queries, and scores the span as one block of it is scored."""
    monkeypatch.setattr(CaMKVCache, "_queries_can_come", lambda self: True)
    cfg = CaMConfig(budget=12, n_sink=1, recent=2, slack=20, scoring="query", prefill_scoring="window",
                    observation_window=observation_window, pool=3, backend=backend)
    sizes = [3, 5, 2, 7, 4]
    pieces = _feed_with_queries(CaMKVCache(cfg), sizes)
    assert pieces._pending.kept().shape[2] == min(observation_window, sum(sizes))
    whole = _feed_with_queries(CaMKVCache(cfg), [sum(sizes)])
    pieces.compress_pending()
    whole.compress_pending()
    for x, y in zip(pieces.state[:4], whole.state[:4]):
        assert mx.allclose(x, y, rtol=1e-5, atol=1e-6).item()
    assert pieces.size() == whole.size() == cfg.budget


def test_decode_steps_alone_are_untouched_by_window_scoring():
    causal = CaMConfig(budget=16, n_sink=2, recent=3, slack=4, scoring="key", backend="reference")
    blocks = _blocks([1] * 40)
    a = _feed_cache(CaMKVCache(causal), blocks)
    b = _feed_cache(CaMKVCache(causal.replace(prefill_scoring="window", observation_window=2, pool=5)), blocks)
    for x, y in zip(a.stored(), b.stored()):
        assert mx.array_equal(x, y).item()


# ---------------------------------------------------------------- camkv.backends.drop and the kernels


@pytest.mark.parametrize("fields", [
    dict(eviction="recency"),
    dict(prefill_scoring="window", observation_window=5),
    dict(prefill_scoring="window", observation_window=5, pool=3, eviction="recency"),
])
@pytest.mark.parametrize("n, s_len", [(0, 40), (20, 9), (10, 30)])
def test_fast_drop_chunk_matches_the_reference(fields, n, s_len):
    cfg = CaMConfig(budget=20, n_sink=2, recent=4, scoring="query", slack=0, **fields)
    rng = np.random.default_rng(n + s_len)
    start = RowState.empty(ROWS, K_DIM, V_DIM, mx.float32)
    if n:
        k, v = random_block(rng, ROWS, n, K_DIM, V_DIM, mx.float32)
        start, _ = reference.update(start, k, v, 0, cfg.replace(budget=n + 7), _row_ids(), k[:, :, None], 0.3)
    k, v = random_block(rng, ROWS, s_len, K_DIM, V_DIM, mx.float32)
    q = mx.array(rng.standard_normal((ROWS, s_len, 2, K_DIM)).astype(np.float32))
    got, _ = drop.update_drop(start, k, v, n, cfg, _row_ids(), q, 0.25)
    want, _ = reference.update(start, k, v, n, cfg, _row_ids(), q, 0.25)
    np.testing.assert_array_equal(np.array(got.positions), np.array(want.positions))
    np.testing.assert_allclose(np.array(got.scores), np.array(want.scores), rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(np.array(got.values), np.array(want.values))


@pytest.mark.parametrize("prefill", ["exact", "chunk"])
@pytest.mark.parametrize("merge", ["window", "drop", "mass_weighted"])
def test_recency_eviction_matches_the_reference(backend, merge, prefill):
    cfg = CaMConfig(budget=12, n_sink=2, recent=3, merge=merge, window=3, prefill=prefill, seed=7, gate=True,
                    eviction="recency")
    check_backend(backend, cfg, [5, 9, 1, 1, 14, 1, 3], rows=4, k_dim=16, v_dim=10, dtype=mx.float16, seed=1)


@pytest.mark.parametrize("pool", [1, 5])
@pytest.mark.parametrize("merge", ["window", "drop", "sim_weighted"])
def test_window_scoring_matches_the_reference(backend, merge, pool):
    cfg = CaMConfig(budget=12, n_sink=2, recent=3, merge=merge, window=3, seed=7, scoring="query",
                    prefill_scoring="window", observation_window=4, pool=pool)
    check_backend(backend, cfg, [5, 9, 1, 1, 14, 1, 3, 20], rows=4, k_dim=16, v_dim=10, dtype=mx.float32, seed=2,
                  queries_per_kv=3)


# ---------------------------------------------------------------- configuration and the eval arm


@pytest.mark.parametrize("fields, words", [
    (dict(eviction="lru"), ["eviction", "'lru'", "'score'", "'recency'"]),
    (dict(prefill_scoring="snap"), ["prefill_scoring", "'snap'", "'causal'", "'window'"]),
    (dict(prefill_scoring="window", observation_window=0), ["observation_window", ">= 1", "0"]),
    (dict(prefill_scoring="window", pool=4), ["pool", "odd", "4"]),
    (dict(prefill_scoring="window", pool=0), ["pool", ">= 1", "0"]),
    (dict(pool=3, prefill_scoring="causal"), ["pool=3", "prefill_scoring='window'", "'causal'"]),
    (dict(prefill_scoring="window", prefill="exact", slack=0), ["prefill_scoring='window'", "prefill='chunk'",
                                                                 "'exact'"]),
])
def test_bad_values_are_refused_naming_the_field_the_value_and_what_is_allowed(fields, words):
    with pytest.raises(ValueError) as err:
        CaMConfig(**fields)
    for word in words:
        assert word in str(err.value), (word, str(err.value))


def test_the_cam_arm_is_cam_streaming_with_the_models_queries(tmp_path):
    arms = {a.name: a for a in parse_methods("streamingllm,cam")}
    assert list(arms) == ["full", "streamingllm", "cam"]
    from tiny_models import tiny_llama

    from camkv import hook

    model = tiny_llama(heads=4, kv_heads=2, layers=2)
    settings = CacheSettings(n_sink=4, recent="25%", window=4, seed=0, backend="reference",
                             prefill_scoring="window", observation_window=8, pool=3)
    caches = make_cache(model, arms["cam"], 64, settings)
    hook.uninstall(model)
    for i, cache in enumerate(caches):
        want = CaMConfig(budget=64, n_sink=4, recent=16, scoring="query", seed=i, backend="reference",
                         prefill_scoring="window", observation_window=8, pool=3, **CAM_STREAMING)
        assert cache.config == want


@pytest.mark.parametrize("s_len", [3, 12])
def test_fast_scores_a_window_chunk_from_its_last_queries_alone(s_len):
    """camkv.backends.drop takes the chunk's length from its keys: the window's queries alone (what
    a cache keeps of a prompt block) score it as all of them do."""
    cfg = CaMConfig(budget=10, n_sink=1, recent=2, prefill_scoring="window", observation_window=5, pool=3)
    rng = np.random.default_rng(4)
    R, n, G = 3, 8, 2
    keys, values = (mx.array(rng.standard_normal((R, n + s_len, d)).astype(np.float32)) for d in (K_DIM, V_DIM))
    scores = mx.array(rng.uniform(0, 3, (R, n)).astype(np.float32))
    positions = mx.broadcast_to(mx.arange(n, dtype=mx.int32), (R, n))
    queries = mx.array(rng.standard_normal((R, G, s_len, K_DIM)).astype(np.float32))
    every = drop.compress_drop(keys, values, scores, positions, queries, n, 0.5, cfg)
    window = drop.compress_drop(keys, values, scores, positions, queries[:, :, -5:], n, 0.5, cfg)
    for a, b in zip(every[:4], window[:4]):
        assert mx.array_equal(a, b).item()
