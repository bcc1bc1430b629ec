"""Amortized eviction and the whole-device compression (docs/algorithm.md sections 7 and 8).

- camkv.backends.drop's chunk call (merge="drop") against the reference, tie-aware: kept
  positions may differ only where the reference's scores put the row within a near-tie
  of the eviction boundary; scores within rtol 1e-3; kept keys and values bit for bit.
- A cache with slack s: a run of decode steps equals one reference chunk call of the
  tokens since the last compression, and it never holds more than budget + s rows.
- slack=0 is the exact per-token rule.
- Poisoned (NaN / inf) keys and queries: no crash, no effect on other rows, the
  poisoned token gets no mass and is evicted first.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from camkv import CaMConfig, CaMKVCache, hook, mass, reference
from camkv.backends import drop
from camkv.rows import RowState

import cuda_emulation
import dtype_logits

RTOL, ATOL = 1e-3, 1e-5  # section 8's score and near-tie tolerances


def score_rtol(queries, keys, scale, dtype) -> float:
    """Section 8's rtol, widened on the CUDA path by what its logits' rounding allows
    (tests/dtype_logits.py)."""
    return RTOL + dtype_logits.widening(queries, keys, scale, dtype)


def _random_block(rng, rows, s_len, dim, dtype=mx.float32):
    return mx.array(rng.standard_normal((rows, s_len, dim)).astype(np.float32)).astype(dtype)


def near_tie_flips(got: RowState, want: RowState, joined_scores, joined_positions, n_losers: int,
                   protected, rtol: float = RTOL) -> int:
    """Positions kept by one side only, checked to lie at a near-tie of the eviction
    boundary (section 8); returns how many there were, fails on any other."""
    flips = 0
    for r in range(want.positions.shape[0]):
        g, w = set(np.array(got.positions[r]).tolist()), set(np.array(want.positions[r]).tolist())
        if g == w:
            continue
        scores = np.array(joined_scores[r])
        candidates = np.sort(scores[~np.array(protected[r])])
        boundary = candidates[[n_losers - 1, n_losers]]
        positions = np.array(joined_positions[r]).tolist()
        for p in g ^ w:
            s = scores[positions.index(p)]
            margin = np.min(np.abs(boundary - s))
            assert margin <= rtol * abs(s) + ATOL, f"row {r}: position {p} flipped with score {s}, boundary {boundary}"
            flips += 1
    return flips


def check_drop_chunk(rows, n, s_len, budget, recent, groups, dtype, seed):
    rng = np.random.default_rng(seed)
    cfg = CaMConfig(budget=budget, n_sink=2, recent=recent, scoring="query", slack=0)
    start = RowState.empty(rows, 16, 8, dtype)
    if n:  # n scored rows to start from
        start = reference.update(start, _random_block(rng, rows, n, 16, dtype), _random_block(rng, rows, n, 8, dtype),
                                 0, cfg.replace(budget=n + cfg.n_sink + cfg.recent), mx.arange(rows).astype(mx.uint32),
                                 _random_block(rng, rows, n, 16)[:, :, None], 0.3)[0]
    keys, values = _random_block(rng, rows, s_len, 16, dtype), _random_block(rng, rows, s_len, 8, dtype)
    queries = mx.array(rng.standard_normal((rows, s_len, groups, 16)).astype(np.float32)).astype(dtype)
    row_ids = mx.arange(rows).astype(mx.uint32)
    args = (start, keys, values, n, cfg, row_ids, queries, 0.25)
    got, merges = drop.update_drop(*args)
    want, _ = reference.update(*args[:6], queries.astype(mx.float32), 0.25)
    joined, _ = reference.update(*args[:4], cfg.replace(budget=n + s_len + 1, recent=1, n_sink=0), row_ids,
                                 queries.astype(mx.float32), 0.25)
    assert got.keys.shape == want.keys.shape and not np.array(merges).any()
    p_last = n + s_len - 1
    protected = (joined.positions < cfg.n_sink) | (joined.positions > p_last - cfg.recent)
    rtol = score_rtol(queries, joined.keys, 0.25, dtype)
    flips = near_tie_flips(got, want, joined.scores, joined.positions, n + s_len - budget, protected, rtol)
    if flips == 0:
        np.testing.assert_allclose(np.array(got.scores), np.array(want.scores), rtol=rtol, atol=ATOL)
        for name in ("keys", "values"):
            np.testing.assert_array_equal(np.array(getattr(got, name).astype(mx.float32)),
                                          np.array(getattr(want, name).astype(mx.float32)), err_msg=name)
    return flips


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("n, s_len", [(0, 40), (24, 9), (24, 1), (10, 30)])
def test_fast_drop_chunk_matches_reference(n, s_len, dtype):
    flips = check_drop_chunk(rows=3, n=n, s_len=s_len, budget=24, recent=5, groups=2, dtype=dtype,
                             seed=n * 100 + s_len)
    print(f"near-tie flips: {flips}")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True)
@given(st.integers(1, 4), st.integers(0, 40), st.integers(1, 50), st.integers(6, 30), st.integers(1, 4),
       st.integers(0, 2**31))
def test_fast_drop_chunk_fuzz(rows, n, s_len, budget, groups, seed):
    recent = max(1, budget // 4)
    n = min(n, budget)
    note(f"seed={seed}")
    note(f"near-tie flips: {check_drop_chunk(rows, n, s_len, budget, recent, groups, mx.float32, seed)}")


def test_fast_drop_chunk_with_equal_scores_keeps_a_valid_set():
    # Every key equal: every candidate ties, any choice is a near-tie; the result must
    # still hold the budget, sinks and recent window, in position order.
    cfg = CaMConfig(budget=10, n_sink=2, recent=3, scoring="key", slack=0)
    keys = mx.ones((2, 30, 8))
    state, _ = drop.update_drop(RowState.empty(2, 8, 8, mx.float32), keys, keys, 0, cfg, mx.arange(2).astype(mx.uint32))
    positions = np.array(state.positions)
    assert positions.shape == (2, 10)
    assert (np.diff(positions, axis=1) > 0).all()
    assert {0, 1, 27, 28, 29} <= set(positions[0].tolist())


# ----------------------------------------------------------------------------
# The cache's schedule: decode steps under slack s equal chunk calls


@pytest.fixture(autouse=True)
def queries_can_come(monkeypatch):
    """These caches are fed their queries by hand, as camkv's attention hook would."""
    monkeypatch.setattr(hook, "can_feed", lambda modules: True)


def _drive(cache, keys, values, queries, sizes):
    """Feed blocks of the given sizes through the cache with their queries, as a model does."""
    start = 0
    for s_len in sizes:
        cache.update_and_fetch(keys[:, :, start:start + s_len], values[:, :, start:start + s_len])
        cache.observe_queries(queries[:, :, start:start + s_len], 0.3)
        start += s_len
        mx.eval(cache.keys)
    return cache


def _reference_schedule(cfg, keys, values, queries, sizes, slack):
    """The reference run on the schedule section 7 gives: a compression (one chunk call of
    the tokens since the last one) whenever a block takes the rows past budget + slack.
    Returns the state and where the tokens still pending start."""
    B, H, T, Dk = keys.shape
    G = queries.shape[1] // H
    rows = RowState.empty(B * H, Dk, values.shape[3], keys.dtype)
    ids = mx.arange(B * H).astype(mx.uint32)
    q = queries.reshape(B, H, G, T, Dk).transpose(0, 1, 3, 2, 4).reshape(B * H, T, G, Dk)
    done, end = 0, 0
    for s_len in sizes:
        end += s_len
        if rows.length + end - done > cfg.budget + slack:
            chunk = lambda a: a[:, :, done:end].reshape(B * H, end - done, -1)  # noqa: E731
            rows, _ = reference.update(rows, chunk(keys), chunk(values), done, cfg, ids, q[:, done:end], 0.3)
            done = end
    return rows, done


@pytest.mark.parametrize("merge", ["drop", "mass_weighted", "window"])
@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_decode_under_slack_equals_chunk_calls(merge, backend):
    rng = np.random.default_rng(7)
    B, H, G, T, D = 1, 2, 2, 70, 8
    keys = mx.array(rng.standard_normal((B, H, T, D)).astype(np.float32))
    values = mx.array(rng.standard_normal((B, H, T, D)).astype(np.float32))
    queries = mx.array(rng.standard_normal((B, H * G, T, D)).astype(np.float32))
    cfg = CaMConfig(budget=16, n_sink=2, recent=4, slack=5, merge=merge, backend=backend)
    cache = _drive(CaMKVCache(cfg), keys, values, queries, [30] + [1] * (T - 30))
    assert cache.size() <= cfg.budget + cfg.slack
    sizes = [30] + [1] * (T - 30)
    want, done = _reference_schedule(cfg.replace(slack=0), keys, values, queries, sizes, cfg.slack)
    assert done == 66  # 30, then every slack + 1 = 6 steps
    got_keys, got_values, got_scores, got_positions = cache.stored()
    n = want.length
    np.testing.assert_array_equal(np.array(got_positions).reshape(B * H, -1)[:, :n], np.array(want.positions))
    np.testing.assert_array_equal(np.array(got_positions)[0, 0, n:], np.arange(done, T))
    np.testing.assert_allclose(np.array(got_values).reshape(B * H, -1, D)[:, :n], np.array(want.values),
                               rtol=1e-5, atol=1e-6)


def test_slack_zero_is_the_exact_rule():
    rng = np.random.default_rng(3)
    B, H, G, T, D = 1, 2, 1, 40, 8
    keys = mx.array(rng.standard_normal((B, H, T, D)).astype(np.float32))
    queries = mx.array(rng.standard_normal((B, H * G, T, D)).astype(np.float32))
    cfg = CaMConfig(budget=12, n_sink=1, recent=3, slack=0, merge="sim_weighted")
    cache = _drive(CaMKVCache(cfg), keys, keys, queries, [1] * T)
    rows = RowState.empty(H, D, D, mx.float32)
    ids = mx.arange(H).astype(mx.uint32)
    q = queries.reshape(H, T, 1, D)
    for t in range(T):
        rows, _ = reference.update(rows, keys[0, :, t:t + 1], keys[0, :, t:t + 1], t, cfg.replace(prefill="exact"),
                                   ids, q[:, t:t + 1], 0.3)
    got = cache.stored()
    assert cache.size() == cfg.budget
    np.testing.assert_array_equal(np.array(got[3][0]), np.array(rows.positions))
    np.testing.assert_allclose(np.array(got[2][0]), np.array(rows.scores), rtol=1e-4, atol=1e-6)


def test_rows_held_stay_within_budget_plus_slack_and_state_round_trips():
    rng = np.random.default_rng(1)
    cfg = CaMConfig(budget=32, scoring="key")  # slack = budget // 8 = 4
    assert cfg.slack == 4 and cfg.replace(budget=64).slack == 8 and cfg.replace(prefill="exact").slack == 0
    cache = CaMKVCache(cfg)
    block = mx.array(rng.standard_normal((1, 2, 100, 8)).astype(np.float32))
    cache.update_and_fetch(block, block)
    held, fetched = [], []
    for _ in range(40):
        step = mx.array(rng.standard_normal((1, 2, 1, 8)).astype(np.float32))
        keys, _ = cache.update_and_fetch(step, step)
        held.append(cache.size())
        fetched.append(keys.shape[2])
    # Held between calls: budget .. budget + slack; the compressing step attends over one more.
    assert (min(held), max(held), max(fetched)) == (32, 36, 37)
    assert cache.nbytes == 2 * cache.size() * (8 * 4 * 2 + 8)
    cache.compress_pending()  # scores the pending tokens, as camkv.save_prompt_cache does
    assert cache.size() <= cfg.budget
    state = cache.state
    loaded = CaMKVCache()
    loaded.state = state
    for a, b in zip(loaded.stored(), cache.stored()):
        np.testing.assert_array_equal(np.array(a), np.array(b))
    assert loaded.offset == cache.offset == 140


def test_slack_with_exact_prefill_is_refused():
    with pytest.raises(ValueError, match="slack=3 needs prefill='chunk'"):
        CaMConfig(prefill="exact", slack=3)
    with pytest.raises(ValueError, match="CaMConfig.slack must be >= 0, got -1"):
        CaMConfig(slack=-1)


# ----------------------------------------------------------------------------
# Poisoned inputs


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", ["key", "query"])
def test_poisoned_token_is_evicted_first_and_leaves_other_rows_alone(poison, where):
    rng = np.random.default_rng(5)
    B, H, T, D = 1, 2, 40, 8
    keys = rng.standard_normal((B, H, T, D)).astype(np.float32)
    queries = rng.standard_normal((B, H, T, D)).astype(np.float32)
    clean_cfg = CaMConfig(budget=16, n_sink=1, recent=4, slack=0)
    clean = _drive(CaMKVCache(clean_cfg), mx.array(keys), mx.array(keys), mx.array(queries), [T])
    bad = (keys if where == "key" else queries).copy()
    bad[0, 1, 10, 3] = poison
    k, q = (bad, queries) if where == "key" else (keys, bad)
    cache = _drive(CaMKVCache(clean_cfg), mx.array(k), mx.array(keys), mx.array(q), [T])
    got, want = cache.stored(), clean.stored()
    # Row 0 (head 0) never saw the poison: identical.
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.array(a)[0, 0], np.array(b)[0, 0])
    scores = np.array(got[2])[0, 1]
    assert np.isfinite(scores).all()
    if where == "key":
        assert 10 not in np.array(got[3])[0, 1].tolist()  # no mass: evicted first


@pytest.mark.skipif(not cuda_emulation.here(), reason="no NVIDIA GPU, and no C++ compiler to emulate one")
@pytest.mark.parametrize("biased", [False, True])
@pytest.mark.parametrize("n_before, s_len", [(0, 300), (512, 2048), (100, 7), (30, 1)])
def test_cuda_mass_kernels_match_the_mlx_operations(n_before, s_len, biased):
    """(Without an NVIDIA GPU, the kernel's text on CPU threads: tests/cuda_emulation.py.)
    biased: a bias per row and column (keepkv's log votes) joins every scaled logit."""
    from camkv.backends import mass_cuda

    rng = np.random.default_rng(s_len)
    rows, groups, dim = 3, 4, 64
    q = mx.array(rng.standard_normal((rows, groups * s_len, dim)).astype(np.float32))
    k = mx.array(rng.standard_normal((rows, n_before + s_len, dim)).astype(np.float32))
    logits = q @ k.transpose(0, 2, 1)
    logits[0, 5, 3] = float("nan")  # a poisoned logit counts as masked
    width = n_before + s_len + 5  # columns past the logits' come back as zeros
    bias = mx.log(mx.array(rng.integers(1, 9, (rows, n_before + s_len)).astype(np.float32))) if biased else None
    with cuda_emulation.kernels_here(mass_cuda):
        got = mass_cuda.column_mass(logits, 0.2, n_before, s_len, width, 0.5, bias)
    shifted = logits if bias is None else logits + bias[:, None, :] / 0.2  # scale * shifted = scale * logits + bias
    want = 0.5 * mass.column_mass(shifted.reshape(rows, groups, s_len, -1), 0.2, n_before)
    want = mx.pad(want, [(0, 0), (0, 5)])
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-5)
    if biased:
        with pytest.raises(ValueError, match=r"bias must be float32 \[R, N\] = \[3, " + str(n_before + s_len)):
            mass_cuda.column_mass(logits, 0.2, n_before, s_len, width, 0.5, bias[:, 1:])


def test_the_callers_arrays_are_never_written():
    # The cache writes its buffers in place; the keys, values and queries a model hands
    # over stay as they were, whatever the block sizes (one block larger than the buffer).
    rng = np.random.default_rng(11)
    cache = CaMKVCache(budget=16, n_sink=1, recent=4, slack=0)
    blocks = []
    for s_len in (40, 1, 1, 3, 1):
        k = mx.array(rng.standard_normal((1, 2, s_len, 8)).astype(np.float32))
        q = mx.array(rng.standard_normal((1, 4, s_len, 8)).astype(np.float32))
        blocks.append((k, q, np.array(k), np.array(q)))
        cache.update_and_fetch(k, k)
        cache.observe_queries(q, 0.3)
    cache.stored()
    for k, q, k_was, q_was in blocks:
        np.testing.assert_array_equal(np.array(k), k_was)
        np.testing.assert_array_equal(np.array(q), q_was)


def _rank_keys(scores: np.ndarray, protected: np.ndarray) -> np.ndarray:
    """Section 7's ranking as floats: protected rows first, a NaN score last."""
    ranked = np.where(np.isnan(scores), -np.inf, scores)
    return np.where(protected, np.inf, ranked)


@pytest.mark.skipif(not cuda_emulation.here(), reason="no NVIDIA GPU, and no C++ compiler to emulate one")
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True)
@given(st.integers(1, 5), st.integers(0, 700), st.integers(1, 300), st.integers(8, 600),
       st.sampled_from([(128, 128), (12, 20), (64, 8)]), st.sampled_from(["random", "ties", "poisoned"]),
       st.integers(0, 2**31))
def test_cuda_drop_compaction_keeps_a_top_budget_set_in_order(rows, n, s_len, budget, dims, scores_kind, seed):
    # The one-launch eviction (backends.compact_cuda) against section 7's rule: the kept
    # rows are `budget` of the best ranked (any of a tie at the boundary), in row order,
    # with their scores, positions, keys and values copied exactly. (Without an NVIDIA
    # GPU, the kernel's text on CPU threads: tests/cuda_emulation.py.)
    from camkv.backends import compact_cuda

    note(f"seed={seed}")
    rng = np.random.default_rng(seed)
    n = min(n, budget)
    N = n + s_len
    if N <= budget:
        return
    Dk, Dv = dims
    cfg = CaMConfig(budget=budget, n_sink=3, recent=max(1, budget // 4))
    capacity = budget + 7
    keys = mx.array(rng.standard_normal((1, rows, N + 2, Dk)).astype(np.float32)).astype(mx.bfloat16)
    values = mx.array(rng.standard_normal((1, rows, N + 2, Dv)).astype(np.float32)).astype(mx.bfloat16)
    settled = rng.standard_normal((rows, n)).astype(np.float32)
    mass = rng.random((rows, N)).astype(np.float32)
    if scores_kind == "ties":
        settled, mass = np.round(settled), np.round(mass)
    elif scores_kind == "poisoned":
        mass[rng.random((rows, N)) < 0.1] = np.nan
    settled_positions = np.array([np.sort(rng.choice(10 * n + 1, size=n, replace=False)) for _ in range(rows)],
                                 np.int32).reshape(rows, n)
    pending_start = 10 * n + 5
    with cuda_emulation.kernels_here(compact_cuda):
        out = compact_cuda.drop_compact((keys, values), mx.array(settled), mx.array(settled_positions),
                                        mx.array(mass), mx.array([pending_start], mx.int32), cfg, capacity)
    got_keys, got_values, got_scores, got_positions = (np.array(a.astype(mx.float32)) for a in out)
    assert got_keys.shape == (1, rows, capacity, Dk) and got_scores.shape == (rows, budget)
    scores = np.concatenate([settled, np.zeros((rows, s_len), np.float32)], axis=1) + mass
    positions = np.concatenate([settled_positions, np.broadcast_to(pending_start + np.arange(s_len), (rows, s_len))],
                               axis=1)
    p_last = pending_start + s_len - 1
    ranks = _rank_keys(scores, (positions < cfg.n_sink) | (positions > p_last - cfg.recent))
    all_keys, all_values = np.array(keys.astype(mx.float32))[0], np.array(values.astype(mx.float32))[0]
    for r in range(rows):
        kept = np.searchsorted(positions[r], got_positions[r])  # positions are increasing along a row
        assert (np.diff(kept) > 0).all() and (positions[r][kept] == got_positions[r]).all(), f"row {r}"
        dropped = np.setdiff1d(np.arange(N), kept)
        assert ranks[r][kept].min() >= ranks[r][dropped].max(), f"row {r}: a better ranked row was evicted"
        np.testing.assert_array_equal(got_scores[r], scores[r][kept])
        np.testing.assert_array_equal(got_keys[0, r, :budget], all_keys[r][kept])
        np.testing.assert_array_equal(got_values[0, r, :budget], all_values[r][kept])


@pytest.mark.skipif(not cuda_emulation.here(), reason="no NVIDIA GPU, and no C++ compiler to emulate one")
def test_cuda_drop_compaction_of_sequences_at_different_positions_equals_each_alone():
    """A batch's rows compressed together stand at different positions: each sequence's
    survivors are those of the same call for it alone (its own sinks and recent window)."""
    from camkv.backends import compact_cuda

    rng = np.random.default_rng(5)
    B, H, n, s_len, D = 3, 2, 20, 9, 16
    cfg = CaMConfig(budget=16, n_sink=2, recent=6)
    keys = mx.array(rng.standard_normal((B, H, n + s_len, D)).astype(np.float32))
    settled = mx.array(rng.standard_normal((B * H, n)).astype(np.float32))
    positions = mx.array(np.stack([np.sort(rng.choice(100, n, replace=False)) for _ in range(B * H)]).astype(np.int32))
    mass = mx.array(rng.random((B * H, n + s_len)).astype(np.float32))
    starts = [100, 250, 400]
    with cuda_emulation.kernels_here(compact_cuda):
        together = compact_cuda.drop_compact((keys, keys), settled, positions, mass, mx.array(starts, mx.int32), cfg,
                                             20)
        alone = [compact_cuda.drop_compact((keys[b : b + 1], keys[b : b + 1]), settled[b * H:(b + 1) * H],
                                           positions[b * H:(b + 1) * H], mass[b * H:(b + 1) * H],
                                           mx.array([start], mx.int32), cfg, 20) for b, start in enumerate(starts)]
    for b, alone in enumerate(alone):
        rows = slice(b * H, (b + 1) * H)
        assert mx.array_equal(together[0][b : b + 1, :, : cfg.budget], alone[0][:, :, : cfg.budget]).item()
        for got, want in zip(together[2:], alone[2:]):
            assert mx.array_equal(got[rows], want).item()


@pytest.mark.skipif(not cuda_emulation.here(), reason="no NVIDIA GPU, and no C++ compiler to emulate one")
@pytest.mark.parametrize("bits, group_size", [(8, 32), (4, 64)])
def test_a_quantized_caches_one_launch_drop_copies_the_rows_as_stored(monkeypatch, bits, group_size):
    """Quantized rows' drop compressions in one launch (pretended here; the kernel's text
    emulated) copy the survivors' codes, scales and biases as stored, without the gathers
    of survivor_sources: after a prompt and decode steps through several compressions
    the cache holds what its twin holds, whose compressions go the other way (the
    survivors' codes gathered), and every row of the six buffers past the budget is
    written by the steps that follow."""
    from camkv import CaMKVCache, quantized
    from camkv.backends import compact_cuda, compress
    from tiny_models import counted

    def run(one_launch: bool):
        monkeypatch.undo()
        if one_launch:
            monkeypatch.setattr(compress, "one_launch", lambda backend, cfg, end: end > cfg.budget)
        launches = counted(monkeypatch, compact_cuda, "drop_compact")
        gathers = counted(monkeypatch, quantized, "survivor_sources")
        rng = np.random.default_rng(11)
        cache = CaMKVCache(CaMConfig(budget=16, bits=bits, group_size=group_size, scoring="key", n_sink=2,
                                     recent=3, slack=4))
        prompt = mx.array(rng.standard_normal((1, 2, 37, 64)).astype(np.float32)).astype(mx.bfloat16)
        cache.update_and_fetch(prompt, prompt * 0.5)
        for _ in range(23):
            step = mx.array(rng.standard_normal((1, 2, 1, 64)).astype(np.float32)).astype(mx.bfloat16)
            keys, values = cache.update_and_fetch(step, -step)
        rows = cache._rows
        stored = [np.array(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a) for q in rows.quantized_views()
                  for a in q]
        return stored, np.array(rows.scores), np.array(rows.positions), len(launches), len(gathers)

    with cuda_emulation.kernels_here(compact_cuda):
        launched, twin = run(True), run(False)
    assert launched[3] == 5 and launched[4] == 0  # the prompt's compression and four decode ones
    assert twin[3] == 0 and twin[4] == 5
    for got, want in zip(launched[0], twin[0]):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(launched[2], twin[2])
    np.testing.assert_allclose(launched[1], twin[1], rtol=1e-5)


def test_a_short_prompt_under_a_large_budget_gets_room_in_steps_not_the_whole_budget():
    """Buffers grow by at most 256 empty rows at a time (as mlx-lm's KVCache), so a
    short prompt does not pay for budget + slack rows; decoding past a step still holds
    every token in order."""
    cfg = CaMConfig(budget=4096, slack=512, scoring="key", backend="reference")
    cache = CaMKVCache(cfg)
    rng = np.random.default_rng(0)
    block = [mx.array(rng.standard_normal((1, 2, n, 8)).astype(np.float32)) for n in (100, 300)]
    cache.update_and_fetch(block[0], block[0])
    assert cache._rows.keys.shape[2] == 100 + 256
    for t in range(300):
        cache.update_and_fetch(block[1][:, :, t : t + 1], block[1][:, :, t : t + 1])
    assert cache._rows.keys.shape[2] <= 400 + 256
    assert mx.array_equal(cache.keys, mx.concatenate(block, axis=2)).item()


def test_decode_steps_keep_their_queries_as_given_and_join_them_once(monkeypatch):
    """A decode step's queries are kept as the model handed them (a handle of the cache's
    own on the same array, in its layout: no write into a buffer, no copy of the pending
    ones at every step) and joined once when a compression or an
    inspection reads them; reading them at every step instead changes no score."""
    monkeypatch.setattr(CaMKVCache, "_queries_can_come", lambda self: True)
    cfg = CaMConfig(budget=64, slack=8, scoring="query", backend="reference")
    rng = np.random.default_rng(1)
    block = lambda n, heads=2: mx.array(rng.standard_normal((1, heads, n, 8)).astype(np.float32))  # noqa: E731
    prompt = (block(10), block(10), block(10, heads=4))
    steps = [(block(1), block(1), block(1, heads=4)) for _ in range(70)]
    once, every = CaMKVCache(cfg), CaMKVCache(cfg)
    for cache in (once, every):
        cache.update_and_fetch(*prompt[:2])
        cache.observe_queries(prompt[2], 0.5)
    for t, (k, v, q) in enumerate(steps):
        for cache in (once, every):
            cache.update_and_fetch(k, v)
            cache.observe_queries(q, 0.5)
        every.stored()  # joins the kept queries at every step
        if t == 39:
            assert once.size() == 50 and once._pending._buffer is None
            assert len(once._pending._steps) == 40 and all(a.shape == s[2].shape and mx.array_equal(a, s[2]).item()
                                                        for a, s in zip(once._pending._steps, steps))
    assert once.size() == every.size() == 64 + 7  # 80 tokens: compressed at 73 rows to 64, 7 more since
    for got, want in zip(once.stored(), every.stored()):
        assert mx.array_equal(got, want).item()


@pytest.mark.parametrize("prefill_scoring", ["causal", "window"])
@pytest.mark.parametrize("merge", ["drop", "keepkv"])
def test_a_decode_step_that_only_joins_the_kept_queries_skips_the_checks_and_changes_nothing(
        monkeypatch, prefill_scoring, merge):
    """observe_queries takes a short way for a decode step like the last (one token, the
    checked shape, the same scale, every pending token's queries kept): the state after a
    prompt, decode steps and their compressions is that of the full way, and the short
    way is taken for most steps."""
    monkeypatch.setattr(CaMKVCache, "_queries_can_come", lambda self: True)
    cfg = CaMConfig(budget=32, slack=6, recent=8, merge=merge, prefill_scoring=prefill_scoring,
                    observation_window=4, backend="reference")
    rng = np.random.default_rng(5)
    block = lambda n, heads=2: mx.array(rng.standard_normal((1, heads, n, 8)).astype(np.float32))  # noqa: E731
    blocks = [(block(n), block(n), block(n, heads=4)) for n in (20, 20, *[1] * 40)]
    short_ways = []
    full_way = CaMKVCache._continues_decoding

    def counted(self, queries, scale):
        taken = full_way(self, queries, scale)
        short_ways.append(taken)
        return taken

    def run(short_way):
        monkeypatch.setattr(CaMKVCache, "_continues_decoding", short_way)
        cache = CaMKVCache(cfg)
        for k, v, q in blocks:
            cache.update_and_fetch(k, v)
            cache.observe_queries(q, 0.25)
            cache.attention_bias()  # as the hook asks
        return cache

    full, short = run(lambda self, queries, scale: False), run(counted)
    assert sum(short_ways) >= 30
    assert full.size() == short.size() and full.offset == short.offset
    for got, want in zip(short.stored(), full.stored()):
        assert mx.array_equal(got, want).item()


@pytest.mark.parametrize("merge", ["drop", "mass_weighted", "keepkv"])
def test_decode_steps_of_plain_rows_take_a_short_way_that_stores_and_returns_what_the_full_way_does(
        monkeypatch, merge):
    """update_and_fetch takes a short way for a decode step of plain rows after one scored
    with its queries (no quantization or tier; rows that votes weigh too, their log votes
    then read by the hook): through a model and camkv's attention hook, the logits of
    every step and the rows, scores and positions held after a prompt, decode steps and
    their compressions are those of the full way, which the short way skips for most
    steps."""
    from tiny_models import tiny_llama

    from camkv import remove

    model = tiny_llama(layers=2)
    tokens = mx.array(np.random.default_rng(3).integers(0, 128, 90))
    full_calls = []
    full_way = CaMKVCache.update_stored

    def counted(self, keys, values):
        full_calls.append(keys.shape[2])
        return full_way(self, keys, values)

    monkeypatch.setattr(CaMKVCache, "update_stored", counted)

    def run(plain_rows):
        monkeypatch.setattr(CaMKVCache, "_short_way_rows", plain_rows)
        full_calls.clear()
        cache = camkv_cache(model, merge)
        logits = [model(tokens[None, :40], cache=cache)[:, -1]]
        logits += [model(tokens[None, t : t + 1], cache=cache)[:, -1] for t in range(40, 90)]
        remove(model)
        return cache, mx.concatenate(logits), list(full_calls)

    plain_rows = CaMKVCache._short_way_rows
    (full, full_logits, _), (short, short_logits, calls) = run(lambda self, queries: False), run(plain_rows)
    # Decode steps (of two layers) that took the full way: each layer's first two (the
    # second's queries are the first to continue).
    full_steps = sum(1 for s in calls if s == 1)
    assert full_steps <= 2 * 2
    assert mx.array_equal(full_logits, short_logits).item()
    for got_layer, want_layer in zip(short, full):
        assert got_layer.offset == want_layer.offset and got_layer.size() == want_layer.size()
        for got, want in zip(got_layer.stored(), want_layer.stored()):
            assert mx.array_equal(got, want).item()


def test_quantized_rows_that_votes_weigh_take_no_short_way_on_cuda(monkeypatch):
    """On MLX's CUDA build the short way hands quantized rows to camkv's pass as stored,
    which reads no bias: rows that votes weigh (keepkv) keep the full way there, so the
    hook adds their log votes; the same rows without votes take it."""
    from camkv.backends import quantized_cuda

    monkeypatch.setattr(quantized_cuda, "here", lambda: True)
    monkeypatch.setattr(quantized_cuda, "takes", lambda *args: True)
    rng = np.random.default_rng(5)
    ways = {}
    for merge in ("keepkv", "mass_weighted"):
        cache = CaMKVCache(CaMConfig(budget=16, slack=4, bits=8, group_size=32, merge=merge, scoring="key"))
        keys, values = (mx.array(rng.standard_normal((1, 2, 30, 64)).astype(np.float32)) for _ in range(2))
        cache.update_and_fetch(keys, values)
        ways[merge] = cache._short_way_rows(mx.zeros((1, 4, 1, 64)))
    assert ways == {"keepkv": False, "mass_weighted": True}


def camkv_cache(model, merge: str) -> list:
    """make_prompt_cache with the attention hook, budget 24 and slack 4, on the reference."""
    from camkv import make_prompt_cache

    return make_prompt_cache(model, config=CaMConfig(budget=24, slack=4, merge=merge, backend="reference"))
