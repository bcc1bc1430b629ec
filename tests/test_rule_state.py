"""Merge rules that carry per-row state (camkv.merges: d2o's moving threshold, keepkv's
votes) through the cache: compressions, prompt-cache save and load, batching, and the
attention hook that weighs each row by its votes (docs/algorithm.md sections 4.5, 4.6)."""

from __future__ import annotations

import math
import warnings

import mlx.core as mx
import numpy as np
import pytest

import camkv
from camkv import CaMConfig, CaMKVCache, VotesWarning, hook, merges, reference
from camkv.backends import votes_cuda
from camkv.batch import BatchCaMKVCache
from camkv.rows import RowState
import cuda_emulation
from test_prompt_cache import _continue, _prefill
from tiny_models import tiny_llama

STATEFUL = [r.name for r in merges.RULES if r.keeps_votes or r.moving_threshold]
# These tests drive caches without a model, so no attention asks for the votes.
pytestmark = pytest.mark.filterwarnings("ignore::camkv.VotesWarning")


def _block(rng, B=1, H=2, S=4, Dk=8, Dv=6):
    keys = mx.array(rng.standard_normal((B, H, S, Dk)).astype(np.float32))
    values = mx.array(rng.standard_normal((B, H, S, Dv)).astype(np.float32))
    return keys, values


def _rule_arrays(cache: CaMKVCache):
    """(votes [B*H, n] or None, threshold [B*H] or None) from the cache's saved state."""
    votes, threshold = cache.state[6:8]
    rows = cache.keys.shape[0] * cache.keys.shape[1]
    return (None if votes is None else votes.reshape(rows, -1),
            None if threshold is None else threshold.reshape(rows))


@pytest.mark.parametrize("merge", STATEFUL)
def test_the_cache_carries_the_rule_state_as_chunk_calls_do(merge):
    """slack=0: every call over the budget is one compression, so the cache must hold what
    the reference computes from the same calls, votes and threshold included."""
    cfg = CaMConfig(budget=8, n_sink=1, recent=2, slack=0, scoring="key", merge=merge, backend="reference")
    cache, rng = CaMKVCache(cfg), np.random.default_rng(1)
    state, offset = RowState.empty(2, 8, 6, mx.float32), 0
    for s_len in (10, 1, 1, 6, 1, 3):
        keys, values = _block(rng, S=s_len)
        cache.update_and_fetch(keys, values)
        state, _ = reference.update(state, keys[0], values[0], offset, cfg, mx.arange(2).astype(mx.uint32))
        offset += s_len
    votes, threshold = _rule_arrays(cache)
    for got, want in ((votes, state.votes), (threshold, state.threshold)):
        assert (got is None) == (want is None)
        if want is not None:
            np.testing.assert_array_equal(np.array(got), np.array(want))
    np.testing.assert_array_equal(np.array(cache.stored()[3][0]), np.array(state.positions))


def test_votes_count_every_token_seen_when_every_eviction_merges():
    cfg = CaMConfig(budget=12, n_sink=2, recent=3, slack=4, scoring="key", merge="keepkv")
    cache, rng = CaMKVCache(cfg), np.random.default_rng(2)
    for s_len in (20, 1, 1, 1, 1, 1, 1, 7, 1):
        cache.update_and_fetch(*_block(rng, S=s_len))
    votes, _ = _rule_arrays(cache)
    assert cache.stats["merges"] == cache.stats["evictions"] > 0
    np.testing.assert_array_equal(np.array(votes.sum(axis=1)), [cache.offset] * 2)
    assert (np.array(votes) > 1).any()


def test_the_threshold_is_nan_until_a_rows_first_compression_then_moves():
    cfg = CaMConfig(budget=8, n_sink=1, recent=2, slack=0, scoring="key", merge="d2o")
    cache, rng = CaMKVCache(cfg), np.random.default_rng(3)
    cache.update_and_fetch(*_block(rng, S=6))
    assert _rule_arrays(cache) == (None, None)  # nothing compressed yet: no rule state
    cache.compress_pending()  # a compression that evicts nothing
    assert np.isnan(np.array(_rule_arrays(cache)[1])).all()
    seen = []
    for _ in range(4):
        cache.update_and_fetch(*_block(rng, S=3))
        seen.append(np.array(_rule_arrays(cache)[1]))
    assert np.isfinite(seen).all() and not np.array_equal(seen[0], seen[-1])


def test_nbytes_counts_the_votes_and_the_threshold():
    rng = np.random.default_rng(4)
    sizes = {}
    for merge in ("mass_weighted", "keepkv", "d2o"):
        cache = CaMKVCache(budget=8, n_sink=1, recent=2, slack=0, scoring="key", merge=merge)
        cache.update_and_fetch(*_block(rng, S=12))
        sizes[merge] = cache.nbytes
    rows, held = 2, 8
    assert sizes["keepkv"] - sizes["mass_weighted"] == rows * held * 4  # a float32 vote a row
    assert sizes["d2o"] - sizes["mass_weighted"] == rows * 4  # a float32 threshold per (batch, head)


@pytest.mark.parametrize("merge", STATEFUL)
def test_a_saved_and_loaded_cache_keeps_the_rule_state_and_continues_identically(tmp_path, merge, remove_hooks):
    model = tiny_llama()
    remove_hooks(model)
    prompt = np.random.default_rng(5).integers(0, 128, 100).tolist()
    cache = camkv.make_prompt_cache(model, budget=40, n_sink=2, recent=8, merge=merge)
    _prefill(model, cache, prompt[:-1])
    path = tmp_path / "prompt.safetensors"
    camkv.save_prompt_cache(str(path), cache)
    loaded = camkv.load_prompt_cache(str(path))
    for before, after in zip(cache, loaded):
        for a, b in zip(_rule_arrays(before), _rule_arrays(after)):
            assert (a is None) == (b is None)
            if a is not None:
                np.testing.assert_array_equal(np.array(a), np.array(b))
    tokens, logprobs = _continue(model, cache, prompt[-1])
    tokens_loaded, logprobs_loaded = _continue(model, loaded, prompt[-1])
    assert tokens_loaded == tokens
    np.testing.assert_allclose(logprobs_loaded, logprobs, atol=1e-6)


def _manual_attention(q, k, v, scale, votes, allowed):
    """softmax(scale q.k + log votes) v over the allowed keys, in float64 NumPy.
    q [B, Hq, S, D], k and v [B, H, N, D], votes [B, H, N], allowed [S, N] bool."""
    q, k, v, votes = (np.array(a, np.float64) for a in (q, k, v, votes))
    group = q.shape[1] // k.shape[1]
    k, v, votes = (np.repeat(a, group, axis=1) for a in (k, v, votes))
    logits = scale * q @ k.transpose(0, 1, 3, 2) + np.log(votes)[:, :, None, :]
    logits = np.where(allowed, logits, -np.inf)
    weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return (weights / weights.sum(axis=-1, keepdims=True)) @ v


on_gpu = pytest.mark.skipif(not cuda_emulation.here(), reason="no NVIDIA GPU, and no C++ compiler to emulate one")


@pytest.mark.parametrize("mask_kind", ["none", "causal", "boolean", "additive"])
@pytest.mark.parametrize("way, D", [("mask", 8), ("block", 8), ("block", 128), ("joined", 8), ("joined", 128)])
def test_the_hook_weighs_each_key_by_its_votes_whatever_the_mask(mask_kind, way, D):
    """weighed_by_votes' mask, weighed_block (the votes weighing the values and one more
    column: one attention where the two fit 128 channels, D = 8, else two, D = 128) and
    joined_block (the CPU's: the column joined to the values, one attention), each
    against the float64 attention with log(votes) added to the logits."""
    rng = np.random.default_rng(6)
    B, Hq, H, S, N = 2, 4, 2, 3 if mask_kind != "none" else 1, 7
    q = mx.array(rng.standard_normal((B, Hq, S, D)).astype(np.float32) * (8 / D) ** 0.5)
    k, v = (mx.array(rng.standard_normal((B, H, N, D)).astype(np.float32)) for _ in range(2))
    votes = mx.array(rng.integers(1, 6, (B, H, N)).astype(np.float32))
    causal = np.arange(N)[None, :] <= (N - S + np.arange(S))[:, None]
    mask = {"none": None, "causal": "causal", "boolean": mx.array(causal),
            "additive": mx.where(mx.array(causal), 0.0, -math.inf)}[mask_kind]
    if way == "mask":
        weighed = hook.weighed_by_votes(mask, mx.log(votes), q, k)
        got = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=weighed)
    elif way == "joined":
        got = hook.joined_block(q, k, v, 0.3, mask, mx.log(votes))
    else:
        if not cuda_emulation.here():
            pytest.skip("no NVIDIA GPU, and no C++ compiler to emulate one")
        with cuda_emulation.kernels_here(votes_cuda):
            got = hook.weighed_block(q, k, v, 0.3, mask, mx.log(votes))
    allowed = causal if mask_kind != "none" else np.ones((S, N), bool)
    np.testing.assert_allclose(np.array(got), _manual_attention(q, k, v, 0.3, votes, allowed), atol=1e-5)
    assert hook.weighed_by_votes(mask, None, q, k) is mask  # no votes: the mask as it was


@pytest.mark.parametrize("block", ["weighed", "joined"])
def test_a_block_weighed_by_many_votes_stays_finite_in_float16(block):
    """weighed_block and joined_block divide the votes by each KV head's largest before they
    scale the values: rows standing for 10^6 tokens would overflow float16 (65504)
    otherwise. More rows than a work group's threads, the largest votes none of its first
    warp's rows (so a maximum that missed a warp's rows overflows)."""
    if block == "weighed" and not cuda_emulation.here():
        pytest.skip("no NVIDIA GPU, and no C++ compiler to emulate one")
    rng = np.random.default_rng(8)
    B, Hq, H, S, N, D = 1, 4, 2, 3, 300, 64
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for shape in ((B, Hq, S, D), (B, H, N, D), (B, H, N, D)))
    v *= 50
    votes = rng.integers(10**5, 10**6, (B, H, N)).astype(np.float32)
    votes[:, :, np.arange(N) % 256 < 32] = 1.0  # a first warp's rows (threads 0-31 of 256 take j, j + 256)
    half = [mx.array(a).astype(mx.float16) for a in (q, k, v)]
    if block == "joined":
        got = hook.joined_block(*half, 0.125, "causal", mx.log(mx.array(votes)))
    else:
        with cuda_emulation.kernels_here(votes_cuda):
            got = hook.weighed_block(*half, 0.125, "causal", mx.log(mx.array(votes)))
    causal = np.arange(N)[None, :] <= (N - S + np.arange(S))[:, None]
    want = _manual_attention(*(np.array(a.astype(mx.float32)) for a in half), 0.125, votes, causal)
    assert np.isfinite(np.array(got.astype(mx.float32))).all()
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), want, rtol=0.02, atol=0.1)


@on_gpu
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_a_prompt_block_weighed_by_votes_goes_through_a_block_of_its_device(monkeypatch, device):
    """On MLX's CUDA build (pretended here) the hook attends a keepkv cache's prompt block
    through weighed_block, on the CPU through joined_block, neither through weighed_by_votes'
    mask; the output is the mask's."""
    from tiny_models import counted

    rng = np.random.default_rng(13)
    model = tiny_llama()
    hook.install(model)
    cache = CaMKVCache(budget=8, n_sink=1, recent=2, slack=2, merge="keepkv")
    query = lambda s_len: mx.array(rng.standard_normal((1, 4, s_len, 8)).astype(np.float32))  # noqa: E731
    device_before = mx.default_device()
    try:
        keys, values = cache.update_and_fetch(*_block(rng, S=12))
        hook.scaled_dot_product_attention(query(12), keys, values, cache, 0.35, "causal")
        keys, values = cache.update_and_fetch(*_block(rng, S=5))
        bias = cache.votes_bias()
        assert (np.array(bias) > 0).any()
        q = query(5)
        want = mx.fast.scaled_dot_product_attention(
            q, keys, values, scale=0.35, mask=hook.weighed_by_votes("causal", bias, q, keys))
        masks = counted(monkeypatch, hook, "weighed_by_votes")
        if device == "cuda":
            monkeypatch.setattr(hook.drop, "on_cuda", lambda: True)
            blocks = counted(monkeypatch, hook, "weighed_block")
            with cuda_emulation.kernels_here(votes_cuda):
                got = hook.scaled_dot_product_attention(q, keys, values, cache, 0.35, "causal")
        else:
            mx.set_default_device(mx.cpu)
            blocks = counted(monkeypatch, hook, "joined_block")
            got = hook.scaled_dot_product_attention(q, keys, values, cache, 0.35, "causal")
        monkeypatch.undo()
    finally:
        mx.set_default_device(device_before)
        hook.uninstall(model)
    assert len(blocks) == 1 and not masks
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-6)


def test_attention_gets_the_votes_of_the_rows_it_was_handed_before_they_compress():
    """With scoring="query" a block's compression runs when its queries arrive, before
    attention: the bias must still be the returned rows', not the compressed ones'."""
    cfg = CaMConfig(budget=8, n_sink=1, recent=2, slack=2, merge="keepkv")
    cache, rng = CaMKVCache(cfg), np.random.default_rng(7)
    model = tiny_llama()
    hook.install(model)  # some model's hook: a cache built directly then waits for queries
    queries = lambda s_len: mx.array(rng.standard_normal((1, 4, s_len, 8)).astype(np.float32))  # noqa: E731
    try:
        cache.update_and_fetch(*_block(rng, S=12))
        cache.observe_queries(queries(12), 0.35)
        assert cache.attention_bias() is None  # no compression yet: every row is one token
        for _ in range(3):
            fetched, _ = cache.update_and_fetch(*_block(rng, S=1))
            want = cache.votes_bias()
            cache.observe_queries(queries(1), 0.35)
            bias = cache.attention_bias()
            assert bias.shape[2] == fetched.shape[2]
            np.testing.assert_array_equal(np.array(bias), np.array(want))
        assert cache.size() < fetched.shape[2]  # the last queries compressed the rows
        assert (np.array(bias) > 0).any()  # and the rows attention got stood for several tokens
    finally:
        hook.uninstall(model)


def test_decode_steps_through_the_hook_attend_with_the_votes_bias_and_plain_rows_without():
    """The hook sends a decode step of plain rows straight to mlx-lm's attention
    (observe_queries says so); a rule's rows that stand for several tokens never go that
    way: every step's output is attention weighed by the votes of the rows handed over."""
    rng = np.random.default_rng(12)
    model = tiny_llama()
    hook.install(model)
    try:
        for merge in ("drop", "keepkv"):
            cache = CaMKVCache(budget=8, n_sink=1, recent=2, slack=2, merge=merge)
            query = lambda s_len: mx.array(rng.standard_normal((1, 4, s_len, 8)).astype(np.float32))  # noqa: E731
            keys, values = cache.update_and_fetch(*_block(rng, S=12))
            hook.scaled_dot_product_attention(query(12), keys, values, cache, 0.35, "causal")
            for _ in range(12):
                keys, values = cache.update_and_fetch(*_block(rng, S=1))
                bias = cache.votes_bias()
                q = query(1)
                got = hook.scaled_dot_product_attention(q, keys, values, cache, 0.35, None)
                want = mx.fast.scaled_dot_product_attention(
                    q, keys, values, scale=0.35, mask=hook.weighed_by_votes(None, bias, q, keys))
                np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-6)
            assert (bias is None) == (merge == "drop")
            assert merge == "drop" or (np.array(bias) > 0).any()  # rows standing for several tokens
    finally:
        hook.uninstall(model)


def test_the_votes_bias_is_the_log_of_the_held_rows_votes_after_every_compression():
    """The bias attention adds is log(votes) of exactly the rows held, pending rows 0,
    through compressions that change the votes (the bias is made once per votes array
    and read as a view between them: a stale one would weigh the rows by old votes)."""
    cache, rng = CaMKVCache(budget=8, n_sink=1, recent=2, slack=2, scoring="key", merge="keepkv"), \
        np.random.default_rng(11)
    cache.update_and_fetch(*_block(rng, S=12))
    seen = []
    for _ in range(24):
        cache.update_and_fetch(*_block(rng, S=1))
        cache.attention_bias()
        votes = np.array(cache.state[6])
        np.testing.assert_allclose(np.array(cache.votes_bias()), np.log(votes), rtol=1e-6, atol=1e-7)
        if not seen or seen[-1].shape != votes.shape or (seen[-1] != votes).any():
            seen.append(votes)
    assert len(seen) >= 4 and (seen[-1] > 1).any()  # several compressions, rows standing for several tokens


def test_a_model_that_attends_without_the_votes_is_warned_once():
    cache, rng = CaMKVCache(budget=8, n_sink=1, recent=2, slack=0, scoring="key", merge="keepkv"), \
        np.random.default_rng(8)
    cache.update_and_fetch(*_block(rng, S=12))  # compressed: rows now stand for several tokens
    cache.update_and_fetch(*_block(rng, S=1))  # attention did not ask for the votes of these
    with pytest.warns(VotesWarning, match="merge='keepkv' weighs each row by its votes"):
        cache.update_and_fetch(*_block(rng, S=1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cache.attention_bias()
        cache.update_and_fetch(*_block(rng, S=1))  # asked for this time
        cache.update_and_fetch(*_block(rng, S=1))  # and once per cache only


def test_a_batch_lays_each_rows_votes_out_like_its_keys():
    rng = np.random.default_rng(9)
    rows = [CaMKVCache(budget=8, n_sink=1, recent=2, slack=0, scoring="key", merge="keepkv") for _ in range(2)]
    rows[0].update_and_fetch(*_block(rng, S=14))  # compressed: votes above one
    rows[1].update_and_fetch(*_block(rng, S=3))  # below budget: one each
    batch = BatchCaMKVCache(rows)
    keys, values = _block(rng, B=2, S=1)
    fetched, _ = batch.update_and_fetch(keys, values)
    bias = batch.attention_bias()
    assert bias.shape == (2, 2, fetched.shape[2])
    own = rows[0].attention_bias()  # the rows it returned, before this call's compression
    np.testing.assert_array_equal(np.array(bias[0]), np.array(own[0]))
    assert (np.array(own) > 0).any() and not np.array(bias[1]).any()  # row 1: no votes, and padding


@pytest.mark.parametrize("gate", [False, True])
@pytest.mark.parametrize("merge", [r.name for r in merges.RULES if r.kind != merges.DROP])
def test_a_compiled_compression_merge_is_the_plain_merge_bit_for_bit(merge, gate):
    """A compression's merges run _merge_all under mx.compile: over twenty compressions in
    a row, each of fifteen losers into what the one before left, the compiled step gives
    the same keys, values, scores, merge counts, votes and thresholds."""
    rng = np.random.default_rng(7)
    rows, n, dim, k = 3, 40, 8, 15
    cfg = CaMConfig(budget=16, recent=4, merge=merge, gate=gate, scoring="query")
    rule = merges.rule(merge)

    def arr(shape, low=None):
        a = rng.standard_normal(shape) if low is None else rng.uniform(low, low + 2, shape)
        return mx.array(a.astype(np.float32))

    keys, values, scores = arr((rows, n, dim)), arr((rows, n, dim)), arr((rows, n), 0.0)
    positions = mx.broadcast_to(mx.arange(n, dtype=mx.int32), (rows, n))
    row_ids = mx.arange(rows, dtype=mx.uint32)
    extra = reference._RuleState(arr((rows, n), 1.0) if rule.keeps_votes else None,
                                 mx.full((rows,), float("nan")) if rule.moving_threshold else None,
                                 arr((rows, dim)) if rule.keeps_votes else None, 0.3)
    plain = compiled = (keys, values, scores, extra)
    merged = 0
    for _ in range(20):
        loser_idx = mx.sort(mx.array(np.stack([rng.permutation(n)[:k] for _ in range(rows)])), axis=1)
        survivor = ~mx.any(loser_idx[:, :, None] == mx.arange(n)[None, None, :], axis=1)
        k1, v1, s1, did1, votes1, tau1 = reference._merge_all(*plain[:3], positions, survivor, loser_idx, row_ids,
                                                              cfg, plain[3])
        k2, v2, s2, did2, votes2, tau2 = reference._merge_compression(cfg, 0.3, *compiled[:3], positions, survivor,
                                                                      loser_idx, row_ids, compiled[3])
        for a, b in [(k1, k2), (v1, v2), (s1, s2), (did1, did2), (votes1, votes2), (tau1, tau2)]:
            assert (a is None) == (b is None)
            assert a is None or np.array_equal(np.array(a), np.array(b), equal_nan=True)
        merged += int(did1.sum())
        plain = (k1, v1, s1, extra._replace(votes=votes1, threshold=tau1))
        compiled = (k2, v2, s2, extra._replace(votes=votes2, threshold=tau2))
    assert merged > 0


def test_compiled_merges_are_kept_for_the_most_recent_configurations_only():
    """One compiled step per (config, scale), reused while it is among the last
    `kept` used (camkv.compiled.CompiledSteps): a sweep over many configurations keeps a bounded number."""
    first = CaMConfig(budget=16, recent=4, merge="mean")
    step = reference._compiled_merge(first, 0.3)
    assert reference._compiled_merge(first, 0.3) is step
    for budget in range(17, 17 + reference._COMPILED_MERGES.kept + 5):
        reference._compiled_merge(CaMConfig(budget=budget, recent=4, merge="mean"), 0.3)
    assert len(reference._COMPILED_MERGES) == reference._COMPILED_MERGES.kept
    assert (first, 0.3) not in reference._COMPILED_MERGES
