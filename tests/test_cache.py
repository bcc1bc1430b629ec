"""CaMKVCache: mlx-lm's cache protocol, inspection, state round trip, bad input.

The caches here are fed directly, with no model and so no queries: they score with keys.
"""

from __future__ import annotations

import numpy as np
import mlx.core as mx
import pytest

from camkv import CaMConfig, CaMKVCache


def _block(rng, B=2, H=3, S=4, Dk=8, Dv=6, dtype=mx.float16):
    k = mx.array(rng.standard_normal((B, H, S, Dk)).astype(np.float32)).astype(dtype)
    v = mx.array(rng.standard_normal((B, H, S, Dv)).astype(np.float32)).astype(dtype)
    return k, v


def _snapshot(cache: CaMKVCache):
    return (cache.offset, cache.size(), cache.empty(), cache.stats,
            [np.array(a.astype(mx.float32)) for a in cache.stored()] if not cache.empty() else None)


def _same(a, b):
    assert a[:4] == b[:4]
    if a[4] is None:
        assert b[4] is None
    else:
        for x, y in zip(a[4], b[4]):
            np.testing.assert_array_equal(x, y)


def test_update_and_fetch_returns_stored_rows_then_the_new_tokens():
    rng = np.random.default_rng(0)
    cache = CaMKVCache(scoring="key", budget=10, n_sink=1, recent=2)
    k1, v1 = _block(rng, S=7)
    keys, values = cache.update_and_fetch(k1, v1)
    assert mx.array_equal(keys, k1).item() and mx.array_equal(values, v1).item()
    k2, v2 = _block(rng, S=6)
    stored_k, stored_v = cache.stored()[:2]
    keys, values = cache.update_and_fetch(k2, v2)
    assert keys.shape == (2, 3, 13, 8)
    assert mx.array_equal(keys[:, :, 7:], k2).item()
    # The rows stored before the call (nothing of this call evicted yet).
    assert mx.array_equal(keys[:, :, :7], stored_k).item()
    assert mx.array_equal(values[:, :, :7], stored_v).item()
    assert cache.size() == 10 and cache.offset == 13


def test_offset_is_the_absolute_position_not_the_row_count():
    rng = np.random.default_rng(1)
    cache = CaMKVCache(scoring="key", budget=6, n_sink=1, recent=2)
    for s_len in (5, 1, 1, 9, 1):
        cache.update_and_fetch(*_block(rng, S=s_len))
    assert cache.offset == 17 and cache.size() == 6
    assert cache.stats["tokens_seen"] == 17
    assert cache.stats["evictions"] == (17 - 6) * 6


def test_make_mask_is_none_for_one_query_and_causal_otherwise():
    rng = np.random.default_rng(2)
    cache = CaMKVCache(scoring="key", budget=10, n_sink=1, recent=2)
    assert cache.make_mask(1) is None
    assert cache.make_mask(5) == "causal"
    cache.update_and_fetch(*_block(rng, S=12))
    mask = cache.make_mask(3, return_array=True)
    # 10 stored rows then 3 new: bottom-right causal over 13 keys.
    expected = np.tril(np.ones((3, 13), bool), k=10)
    np.testing.assert_array_equal(np.array(mask), expected)
    with pytest.raises(NotImplementedError, match="sliding-window"):
        cache.make_mask(3, window_size=4)


def test_stored_shapes_dtypes_and_stats():
    rng = np.random.default_rng(3)
    cache = CaMKVCache(scoring="key", budget=9, n_sink=1, recent=2, gate=False, merge="mass_weighted")
    cache.update_and_fetch(*_block(rng, S=20, dtype=mx.bfloat16))
    keys, values, scores, positions = cache.stored()
    assert keys.shape == (2, 3, 9, 8) and keys.dtype == mx.bfloat16
    assert values.shape == (2, 3, 9, 6) and values.dtype == mx.bfloat16
    assert scores.shape == (2, 3, 9) and scores.dtype == mx.float32
    assert positions.shape == (2, 3, 9) and positions.dtype == mx.int32
    stats = cache.stats
    assert stats["evictions"] == 11 * 6 and stats["merges"] == 11 * 6  # gate off: every loser merges
    assert cache.nbytes == keys.nbytes + values.nbytes + scores.nbytes + positions.nbytes


def test_empty_cache_protocol():
    cache = CaMKVCache(scoring="key", budget=10, n_sink=1, recent=2)
    assert cache.empty() and cache.size() == 0 and cache.nbytes == 0 and cache.offset == 0
    assert not cache.is_trimmable()
    with pytest.raises(ValueError, match="empty"):
        cache.stored()


def test_state_round_trip_restores_an_identical_cache_and_continues_identically():
    rng = np.random.default_rng(4)
    cfg = CaMConfig(scoring="key", budget=10, n_sink=1, recent=2, merge="window", window=2, seed=5)
    cache = CaMKVCache(cfg)
    for s_len in (8, 1, 6):
        cache.update_and_fetch(*_block(rng, S=s_len))
    clone = CaMKVCache.from_state(cache.state)
    assert clone.config == cfg
    _same(_snapshot(clone), _snapshot(cache))
    nxt = _block(rng, S=3)
    cache.update_and_fetch(*nxt)
    clone.update_and_fetch(*nxt)
    _same(_snapshot(clone), _snapshot(cache))
    empty = CaMKVCache.from_state(CaMKVCache(cfg).state)
    assert empty.empty() and empty.config == cfg


def test_trim_and_quantize_raise_clear_errors_and_batching_keeps_camkv():
    from camkv.batch import BatchCaMKVCache

    cache = CaMKVCache(scoring="key", budget=10, n_sink=1, recent=2)
    with pytest.raises(NotImplementedError, match="trimmed"):
        cache.trim(1)
    # mlx-lm batches (server, BatchGenerator) caches through their `merge`.
    assert isinstance(cache.merge([cache, CaMKVCache(budget=10)]), BatchCaMKVCache)
    with pytest.raises(NotImplementedError, match="quantized"):
        cache.to_quantized()


@pytest.mark.parametrize(
    "bad, match",
    [
        (lambda k, v: (k[0], v[0]), "4-D"),
        (lambda k, v: (k, v[:, :, :1]), "differ"),
        (lambda k, v: (k[:1], v[:1]), "changed mid-sequence"),
        (lambda k, v: (k[:, :2], v[:, :2]), "changed mid-sequence"),
        (lambda k, v: (k[..., :4], v), "changed mid-sequence"),
        (lambda k, v: (k.astype(mx.float32), v.astype(mx.float32)), "changed mid-sequence"),
        (lambda k, v: (k, v.astype(mx.float32)), "values are"),
        (lambda k, v: (k[:, :, :0], v[:, :, :0]), "at least one token"),
        (lambda k, v: (np.array(k), v), "mx.array"),
    ],
)
def test_bad_input_raises_and_leaves_the_cache_unchanged(bad, match):
    rng = np.random.default_rng(5)
    cache = CaMKVCache(scoring="key", budget=10, n_sink=1, recent=2)
    cache.update_and_fetch(*_block(rng, S=12))
    before = _snapshot(cache)
    with pytest.raises(ValueError, match=match):
        cache.update_and_fetch(*bad(*_block(rng, S=2)))
    _same(_snapshot(cache), before)


def test_config_cannot_change_mid_sequence():
    rng = np.random.default_rng(6)
    cache = CaMKVCache(scoring="key", budget=10, n_sink=1, recent=2)
    cache.config = CaMConfig(scoring="key", budget=12, n_sink=1, recent=2)  # allowed while empty
    cache.update_and_fetch(*_block(rng, S=3))
    before = _snapshot(cache)
    with pytest.raises(ValueError, match="mid-sequence"):
        cache.config = CaMConfig(scoring="key", budget=20, n_sink=1, recent=2)
    assert cache.config.budget == 12
    _same(_snapshot(cache), before)


def test_bad_config_raises_before_any_state_exists():
    with pytest.raises(ValueError, match="recent"):
        CaMKVCache(scoring="key", budget=10, recent=0)
    with pytest.raises(ValueError, match="head_offset"):
        CaMKVCache(scoring="key", budget=10, n_sink=1, recent=2, head_offset=-1)


def test_global_head_placement_changes_the_draws():
    """Row r = b * H_global + h_global: a cache of heads 2..3 of 4 draws like those heads."""
    rng = np.random.default_rng(7)
    k, v = _block(rng, B=1, H=4, S=30, dtype=mx.float32)
    full = CaMKVCache(scoring="key", budget=8, n_sink=1, recent=2, gate=True, merge="mass_weighted")
    full.update_and_fetch(k, v)
    half = CaMKVCache(scoring="key", budget=8, n_sink=1, recent=2, gate=True, merge="mass_weighted", head_offset=2, n_heads_global=4)
    half.update_and_fetch(k[:, 2:], v[:, 2:])
    for a, b in zip(full.stored(), half.stored()):
        assert mx.array_equal(a[:, 2:], b).item()
    wrong = CaMKVCache(scoring="key", budget=8, n_sink=1, recent=2, gate=True, merge="mass_weighted")
    wrong.update_and_fetch(k[:, 2:], v[:, 2:])
    assert not all(mx.array_equal(a[:, 2:], b).item() for a, b in zip(full.stored(), wrong.stored()))


def test_gate_row_ids_are_global_and_uint32():
    """Section 1's row id b * H_global + head_offset + h for every (batch, KV head) row."""
    from camkv import gate

    ids = gate.row_ids(2, 3, head_offset=4, n_heads_global=8)
    assert ids.dtype == mx.uint32
    assert ids.tolist() == [4, 5, 6, 12, 13, 14]
    assert gate.row_ids(2, 2).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("merge", ["drop", "mass_weighted", "keepkv"])
def test_compressions_never_wait_for_the_device(monkeypatch, merge):
    """A model's calls through camkv caches (query scoring: prompt chunks, then decode
    steps) only queue work: an mx.eval inside a compression makes the host wait for the
    device where it could build the model's next layers."""
    import camkv
    from tiny_models import tiny_llama

    model = tiny_llama(layers=2)
    cache = camkv.make_prompt_cache(model, budget=16, merge=merge)
    prompt, steps = mx.random.randint(0, 128, (4, 1, 24)), mx.random.randint(0, 128, (10, 1, 1))
    waits = []
    real_eval = mx.eval
    monkeypatch.setattr(mx, "eval", lambda *a, **k: (waits.append(len(a)), real_eval(*a, **k)))
    try:
        for tokens in [*prompt, *steps]:
            model(tokens, cache=cache)
    finally:
        monkeypatch.undo()
        camkv.hook.uninstall(model)
    assert cache[0].stats["evictions"] > 0 and waits == []


def test_merge_count_adds_up_over_many_calls():
    # Per-call merge counts are summed in batches; stats and state must see them all,
    # before and after a batch boundary. Ungated merging merges every eviction.
    from camkv import cache as cache_module

    cache = CaMKVCache(CaMConfig(budget=8, n_sink=1, recent=2, gate=False, scoring="key", merge="mass_weighted", slack=0))
    rng = np.random.default_rng(0)
    calls = cache_module._MERGE_BATCH + 37
    for step in range(calls):
        block = mx.array(rng.standard_normal((1, 2, 1, 4)).astype(np.float32))
        cache.update_and_fetch(block, block)
        if step in (20, cache_module._MERGE_BATCH - 1):
            assert cache.stats["merges"] == cache.stats["evictions"] > 0
    stats = cache.stats
    assert stats["evictions"] == (calls - 8) * 2
    assert stats["merges"] == stats["evictions"]
    assert int(cache.state[4].item()) == stats["merges"]


def test_an_unread_merge_count_keeps_a_short_graph():
    # Each compression adds its merges to the count as an operation (where no kernel
    # counts them); a count nobody reads is evaluated every _MERGE_BATCH compressions,
    # so its graph never holds more than that many compressions' operations.
    from camkv import cache as cache_module
    from test_bench import _load_bench_script

    graph_operations = _load_bench_script("profile_merge_engine").graph_operations
    cache = CaMKVCache(CaMConfig(budget=8, n_sink=1, recent=2, gate=False, scoring="key", merge="mean", slack=0))
    rng = np.random.default_rng(0)
    operations = []
    for _ in range(8 + 3 * cache_module._MERGE_BATCH + 5):
        block = mx.array(rng.standard_normal((1, 2, 1, 4)).astype(np.float32))
        mx.eval(cache.update_and_fetch(block, block))  # the rows, as attention reads them
        operations.append(sum(graph_operations(cache._merges)[0].values()))
    assert max(operations) <= 5 * cache_module._MERGE_BATCH, max(operations)  # about 3 a compression
    assert cache.stats["merges"] == cache.stats["evictions"] > 2 * cache_module._MERGE_BATCH


def test_reading_the_state_after_each_prompt_chunk_costs_the_same_few_launches():
    # mlx-lm evaluates every cache's state after each prompt chunk. The merge count in it
    # was the running total plus every chunk's count so far, concatenated anew at each
    # read: one more copy a chunk, on a GPU one launch each, a layer at a time. Read as a
    # prompt's chunks read it, the count costs the same few launches at every chunk
    # (counted as bench/profile_merge_engine.py counts a compression's).
    from test_bench import _load_bench_script

    graph_operations = _load_bench_script("profile_merge_engine").graph_operations
    cache = CaMKVCache(CaMConfig(budget=16, n_sink=1, recent=2, gate=False, scoring="key", merge="mean"))
    rng = np.random.default_rng(0)
    launches = []
    for _ in range(6):
        block = mx.array(rng.standard_normal((1, 2, 24, 8)).astype(np.float32))
        cache.update_and_fetch(block, block)
        merges = cache.state[4]
        launches.append(graph_operations(merges)[1])
        mx.eval(merges)
    assert cache.stats["merges"] == cache.stats["evictions"] > 0
    assert len(set(launches[1:])) == 1, launches  # the first read also makes the zero it adds to


class _ReferenceAsGpu:
    """The reference backend dressed as a GPU target: the cache takes its GPU-only
    shortcuts (a dropping chunk compressed by camkv.backends.drop) only for such a backend."""

    __name__ = "camkv.backends.cuda"
    target = "cuda"

    def update(self, *args, **kwargs):
        from camkv import reference

        return reference.update(*args, **kwargs)


def test_exact_prefill_scores_a_multi_token_call_token_by_token_on_a_gpu_backend(monkeypatch):
    """docs/algorithm.md section 2: in exact mode every token of a prompt is scored and
    evicted one at a time, on every backend; a GPU backend's chunk shortcut would keep
    other positions than the reference for the same prompt."""
    from camkv import backends

    rng = np.random.default_rng(0)
    # Keys at 3x scale: peaked attention, so scoring a prompt as one chunk keeps other
    # tokens than scoring it token by token (23 of 48 kept positions differ).
    blocks = [(3 * k, v) for k, v in (_block(rng, B=1, H=3, S=s, dtype=mx.float32) for s in (40, 1, 1, 17))]
    kept = {}
    for name in ("reference", "gpu"):
        if name == "gpu":
            monkeypatch.setattr(backends, "resolve", lambda *a, **k: _ReferenceAsGpu())
        cache = CaMKVCache(scoring="key", budget=16, n_sink=1, recent=4, prefill="exact", backend="reference")
        for k, v in blocks:
            cache.update_and_fetch(k, v)
        kept[name] = np.array(cache.stored()[3])
    np.testing.assert_array_equal(kept["gpu"], kept["reference"])
