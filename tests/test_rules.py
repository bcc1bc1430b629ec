"""docs/algorithm.md made executable: one test (or a few) per rule, on every backend."""

from __future__ import annotations

import numpy as np
import mlx.core as mx
import pytest

import oracle
from camkv import CaMConfig, backends, reference
from camkv import merges as rules
from camkv.rows import RowState
from conftest import random_block, run_calls

MERGES = list(rules.names())


def _update(backend):
    return backends.resolve(backend).update


def _cfg(backend, **fields):
    base = dict(budget=8, n_sink=2, recent=3, gate=True, merge="mass_weighted", backend=backend)
    base.update(fields)
    return CaMConfig(**base)


def _np(state: RowState):
    return [np.array(a.astype(mx.float32)) if a.dtype != mx.int32 else np.array(a) for a in state.arrays()]


# ---------------------------------------------------------------- sections 1, 5, 7: storage


@pytest.mark.parametrize("prefill", ["exact", "chunk"])
def test_storage_is_rectangular_and_holds_min_tokens_budget(backend, prefill):
    cfg = _cfg(backend, prefill=prefill)
    sizes, seen = [3, 1, 5, 1, 1, 9, 2], 0
    rng = np.random.default_rng(1)
    state = RowState.empty(4, 8, 6, mx.float32)
    rows = mx.arange(4).astype(mx.uint32)
    for s_len in sizes:
        k, v = random_block(rng, 4, s_len, 8, 6, mx.float32)
        state, _ = _update(backend)(state, k, v, seen, cfg, rows)
        seen += s_len
        assert state.keys.shape == (4, min(seen, cfg.budget), 8)
        assert state.values.shape == (4, min(seen, cfg.budget), 6)
        assert state.scores.shape == state.positions.shape == (4, min(seen, cfg.budget))


@pytest.mark.parametrize("prefill", ["exact", "chunk"])
@pytest.mark.parametrize("merge", MERGES)
def test_sinks_and_recent_window_are_never_evicted(backend, prefill, merge):
    cfg = _cfg(backend, prefill=prefill, merge=merge, budget=10, n_sink=3, recent=4)
    rng = np.random.default_rng(2)
    state = RowState.empty(3, 8, 8, mx.float16)
    rows = mx.arange(3).astype(mx.uint32)
    seen = 0
    for s_len in [4, 1, 1, 7, 1, 1, 1, 5, 1]:
        k, v = random_block(rng, 3, s_len, 8, 8, mx.float16)
        state, _ = _update(backend)(state, k, v, seen, cfg, rows)
        seen += s_len
        positions = np.array(state.positions)
        for row in positions:
            assert set(range(cfg.n_sink)) <= set(row.tolist())
            assert set(range(seen - cfg.recent, seen)) <= set(row.tolist())


@pytest.mark.parametrize("prefill", ["exact", "chunk"])
def test_positions_ascend_and_are_absolute(backend, prefill):
    cfg = _cfg(backend, prefill=prefill)
    state, _ = run_calls(_update(backend), cfg, [5, 1, 1, 6, 1, 4])
    positions = np.array(state.positions)
    assert (np.diff(positions, axis=1) > 0).all()
    assert positions.max() == 17 and positions.min() == 0


# ---------------------------------------------------------------- section 2: scoring


def test_first_token_scores_one_and_mass_is_one_per_token(backend):
    cfg = _cfg(backend, budget=32)
    state, _ = run_calls(_update(backend), cfg, [1])
    assert np.array(state.scores).tolist() == [[1.0]] * 3
    state, _ = run_calls(_update(backend), cfg, [4, 1, 3, 1])
    # Nothing evicted yet: every token added exactly mass 1 to each row.
    np.testing.assert_allclose(np.array(state.scores).sum(axis=1), 9.0, rtol=1e-5)


def test_scores_are_the_softmax_mass_of_each_key_query(backend):
    """Exact mode below budget: every score against the loop-by-loop NumPy oracle."""
    cfg = _cfg(backend, budget=32, prefill="exact")
    state, _ = run_calls(_update(backend), cfg, [6, 1], seed=5)
    rng = np.random.default_rng(5)
    keys = np.concatenate([np.array(random_block(rng, 3, s, 8, 6, mx.float32)[0]) for s in (6, 1)], axis=1)
    for r in range(3):
        K, S = np.zeros((0, 8), np.float32), np.zeros(0, np.float32)
        for t in range(7):
            K, _, S, _, _ = oracle.step(
                K, np.zeros((t, 1), np.float32), S, np.arange(t), keys[r, t], np.zeros(1, np.float32),
                t, keys[r, t][None], 1 / np.sqrt(8), cfg, r,
            )
        np.testing.assert_allclose(np.array(state.scores[r]), S, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------- sections 3-5 against the oracle


def _empty_rows_and_mirror(rows: int, k_dim: int, v_dim: int):
    """Empty float32 rows (global row ids 5, 6, ...), the oracle's empty mirror of each
    (keys, values, scores, positions) and its per-row rule state (votes, threshold)."""
    mirror = [[np.zeros((0, k_dim), np.float32), np.zeros((0, v_dim), np.float32),
               np.zeros(0, np.float32), np.zeros(0, np.int64)] for _ in range(rows)]
    return (RowState.empty(rows, k_dim, v_dim, mx.float32), mx.arange(rows).astype(mx.uint32) + 5, mirror,
            [{} for _ in range(rows)])


def _every_rule_gated(test):
    """Each rule (and each that may blend keys, with merge_keys), gate on and off, key
    scoring and two queries a KV head."""
    test = pytest.mark.parametrize("queries_per_kv", [0, 2])(test)
    test = pytest.mark.parametrize("gate", [True, False])(test)
    return pytest.mark.parametrize(
        "merge,merge_keys", [(m, False) for m in MERGES] + [(m, True) for m in rules.names(keys_allowed=True)],
    )(test)


@_every_rule_gated
def test_exact_mode_matches_the_numpy_oracle(backend, merge, gate, merge_keys, queries_per_kv):
    cfg = _cfg(backend, merge=merge, gate=gate, merge_keys=merge_keys, prefill="exact", seed=7)
    rows, k_dim, v_dim = 4, 8, 6
    rng = np.random.default_rng(11)
    state, row_ids, mirror, rule_state = _empty_rows_and_mirror(rows, k_dim, v_dim)
    merged_total = np.zeros(rows, int)
    for p in range(20):
        k, v = random_block(rng, rows, 1, k_dim, v_dim, mx.float32)
        q = mx.array(rng.standard_normal((rows, 1, queries_per_kv, k_dim)).astype(np.float32)) if queries_per_kv else None
        scale = 0.4 if queries_per_kv else None
        state, merges = _update(backend)(state, k, v, p, cfg, row_ids, q, scale)
        for r in range(rows):
            qr = np.array(q[r, 0]) if q is not None else np.array(k[r, 0])[None]
            sc = 0.4 if q is not None else 1 / np.sqrt(k_dim)
            *mirror[r], did = oracle.step(*mirror[r], np.array(k[r, 0]), np.array(v[r, 0]), p, qr, sc, cfg, r + 5,
                                          rule_state[r])
            merged_total[r] += did
        _assert_mirrored(state, mirror, rule_state, f"step {p}", rtol=1e-5, atol=1e-6)


def _assert_mirrored(state, mirror, rule_state, where: str, rtol: float, atol: float) -> None:
    """Every row of state equals the oracle's mirror of it: positions exactly, scores
    within rtol 1e-4, keys and values within rtol / atol, and the rule's votes and
    threshold."""
    K, V, S, P = _np(state)[:4]
    for r in range(len(mirror)):
        np.testing.assert_array_equal(P[r], mirror[r][3], err_msg=f"row {r} {where}")
        np.testing.assert_allclose(S[r], mirror[r][2], rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(V[r], mirror[r][1], rtol=rtol, atol=atol)
        np.testing.assert_allclose(K[r], mirror[r][0], rtol=rtol, atol=atol)
        if state.votes is not None:
            np.testing.assert_allclose(np.array(state.votes[r]), rule_state[r]["votes"])
        if state.threshold is not None:
            np.testing.assert_allclose(np.array(state.threshold[r]), rule_state[r].get("threshold", np.nan),
                                       rtol=1e-5)


@_every_rule_gated
def test_chunk_mode_matches_the_numpy_oracle(backend, merge, gate, merge_keys, queries_per_kv):
    """Section 7's chunk calls, their merges simultaneous (section 4.4), against the
    oracle's loop-by-loop reading: several losers a compression, several into one target."""
    cfg = _cfg(backend, merge=merge, gate=gate, merge_keys=merge_keys, prefill="chunk", prefill_scoring="causal",
               seed=7, window=2)
    rows, k_dim, v_dim = 4, 8, 6
    rng = np.random.default_rng(17)
    state, row_ids, mirror, rule_state = _empty_rows_and_mirror(rows, k_dim, v_dim)
    offset, merged_total, want_total = 0, 0, 0
    for s_len in (11, 6, 1, 9, 4):
        k, v = random_block(rng, rows, s_len, k_dim, v_dim, mx.float32)
        q = mx.array(rng.standard_normal((rows, s_len, queries_per_kv, k_dim)).astype(np.float32)) \
            if queries_per_kv else None
        scale = 0.4 if queries_per_kv else None
        state, merged = _update(backend)(state, k, v, offset, cfg, row_ids, q, scale)
        merged_total += int(merged.sum())
        for r in range(rows):
            qr = np.array(q[r]) if q is not None else np.array(k[r])[:, None]
            sc = 0.4 if q is not None else 1 / np.sqrt(k_dim)
            *mirror[r], did = oracle.chunk(*mirror[r], np.array(k[r]), np.array(v[r]), offset, qr, sc, cfg, r + 5,
                                           rule_state[r])
            want_total += did
        offset += s_len
        _assert_mirrored(state, mirror, rule_state, f"at {offset}", rtol=1e-4, atol=1e-5)
    assert merged_total == want_total
    if rules.rule(merge).kind != rules.DROP and not gate:
        assert merged_total > 0


# ---------------------------------------------------------------- section 7: calls


@pytest.mark.parametrize("merge", MERGES)
def test_exact_mode_over_s_tokens_equals_s_single_calls(backend, merge):
    cfg = _cfg(backend, merge=merge, prefill="exact")
    rng = np.random.default_rng(3)
    keys, values = random_block(rng, 3, 21, 8, 6, mx.float16)
    rows = mx.arange(3).astype(mx.uint32)
    a = b = RowState.empty(3, 8, 6, mx.float16)
    start = 0
    for s_len in [7, 9, 1, 4]:
        a, _ = _update(backend)(a, keys[:, start:start + s_len], values[:, start:start + s_len], start, cfg, rows)
        start += s_len
    for t in range(21):
        b, _ = _update(backend)(b, keys[:, t:t + 1], values[:, t:t + 1], t, cfg, rows)
    for x, y in zip(a.arrays(), b.arrays()):
        assert mx.array_equal(x, y).item()


@pytest.mark.parametrize("merge", MERGES)
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_chunk_mode_with_one_token_equals_exact(backend, merge, dtype):
    kwargs = dict(merge=merge, gate=True, seed=3)
    a, ma = run_calls(_update(backend), _cfg(backend, prefill="chunk", **kwargs), [1] * 25, dtype=dtype)
    b, mb = run_calls(_update(backend), _cfg(backend, prefill="exact", **kwargs), [1] * 25, dtype=dtype)
    for x, y in zip(a.arrays(), b.arrays()):
        assert mx.array_equal(x, y).item()
    assert sum(m.sum().item() for m in ma) == sum(m.sum().item() for m in mb)


@pytest.mark.parametrize("prefill", ["exact", "chunk"])
def test_chunk_prefill_evicts_down_to_budget_in_one_call(backend, prefill):
    cfg = _cfg(backend, prefill=prefill, budget=12, n_sink=2, recent=3)
    state, merges = run_calls(_update(backend), cfg, [40])
    assert state.keys.shape[1] == 12
    assert sum(m.sum().item() for m in merges) > 0


# ---------------------------------------------------------------- sections 4.3 and 6: the gate


def test_same_seed_gives_bit_identical_state(backend):
    cfg = _cfg(backend, seed=42)
    a, ma = run_calls(_update(backend), cfg, [5, 1, 1, 8, 1, 1, 1])
    b, mb = run_calls(_update(backend), cfg, [5, 1, 1, 8, 1, 1, 1])
    for x, y in zip(list(a.arrays()) + ma, list(b.arrays()) + mb):
        assert mx.array_equal(x, y).item()


def test_seed_is_irrelevant_without_the_gate(backend):
    a, _ = run_calls(_update(backend), _cfg(backend, gate=False, seed=1), [5, 1, 9, 1, 1])
    b, _ = run_calls(_update(backend), _cfg(backend, gate=False, seed=2), [5, 1, 9, 1, 1])
    for x, y in zip(a.arrays(), b.arrays()):
        assert mx.array_equal(x, y).item()


def test_a_different_seed_changes_only_the_gated_merges(backend):
    """From one full state, one eviction step: same loser and target, only the merge differs."""
    base, _ = run_calls(_update(backend), _cfg(backend, gate=False), [8], rows=64)
    rng = np.random.default_rng(9)
    k, v = random_block(rng, 64, 1, 8, 6, mx.float32)
    rows = mx.arange(64).astype(mx.uint32)
    out = {}
    for seed in (1, 2):
        out[seed] = _update(backend)(base, k, v, 8, _cfg(backend, seed=seed), rows)
    (a, ma), (b, mb) = out[1], out[2]
    assert mx.array_equal(a.positions, b.positions).item()
    same_gate = np.array(ma == mb)
    assert not same_gate.all(), "two seeds drew the same gate outcome on all 64 rows"
    # Rows whose gate agreed are identical; rows whose gate differed differ in values.
    for x, y in zip(a.arrays(), b.arrays()):
        x, y = np.array(x.astype(mx.float32)), np.array(y.astype(mx.float32))
        np.testing.assert_array_equal(x[same_gate], y[same_gate])
    assert not np.array_equal(np.array(a.values)[~same_gate], np.array(b.values)[~same_gate])


def test_drop_equals_a_gate_that_never_opens(monkeypatch):
    """H2O is CaM with the gate always closed: same kept set, scores, keys, values."""
    monkeypatch.setattr(reference, "uniform", lambda seed, row, p: mx.ones(mx.array(row).shape))
    closed, mc = run_calls(reference.update, _cfg("reference", merge="sim_weighted", merge_keys=True), [6, 1, 9, 1, 1, 1])
    dropped, md = run_calls(reference.update, _cfg("reference", merge="drop"), [6, 1, 9, 1, 1, 1])
    for x, y in zip(closed.arrays(), dropped.arrays()):
        assert mx.array_equal(x, y).item()
    assert sum(m.sum().item() for m in mc) == 0


@pytest.mark.parametrize("merge", [m for m in MERGES if rules.rule(m).kind != rules.DROP])
@pytest.mark.parametrize("prefill", ["exact", "chunk"])
def test_gate_merges_at_a_rate_strictly_between_zero_and_one(backend, merge, prefill):
    """The defect docs/algorithm.md fixes (newest token always evicted, gate never open) stays fixed."""
    cfg = CaMConfig(budget=16, n_sink=2, recent=4, merge=merge, prefill=prefill, gate=True, backend=backend)
    state, merges = run_calls(_update(backend), cfg, [1] * 120, rows=4, k_dim=16, v_dim=16)
    evictions = 4 * (120 - 16)
    rate = sum(m.sum().item() for m in merges) / evictions
    assert 0 < rate < 1, rate
    # The cache does not freeze on its first tokens: middle positions keep moving.
    middle = np.array(state.positions)[:, cfg.n_sink:-cfg.recent]
    assert (middle >= cfg.budget).any()


# Values of section 6 computed by hand (Python integers, the formula as written).
HASH_TABLE = [
    # seed, row, position, h
    (0, 0, 0, oracle.mix(oracle.mix(oracle.mix(0x9E3779B9)))),
    (0, 1, 0, oracle.mix(oracle.mix(oracle.mix(0x9E3779B9) ^ 1))),
    (7, 3, 100, oracle.mix(oracle.mix(oracle.mix(100 ^ 0x9E3779B9) ^ 3) ^ 7)),
    (2**32 - 1, 65535, 2**31 - 1, oracle.mix(oracle.mix(oracle.mix((2**31 - 1) ^ 0x9E3779B9) ^ 65535) ^ (2**32 - 1))),
]


def test_hash_matches_the_formula_computed_by_hand():
    for seed, row, position, h in HASH_TABLE:
        assert reference.gate_hash(seed, row, position).item() == h
        assert reference.uniform(seed, row, position).item() == (h >> 8) * 2.0**-24
    # Literal values pin the formula itself, not just two transcriptions of it.
    assert [reference.gate_hash(s, r, p).item() for s, r, p, _ in HASH_TABLE] == [
        2488251732, 3330041933, 818846169, 427457005,
    ]


def test_uniform_is_in_unit_interval_and_roughly_uniform():
    u = np.array(reference.uniform(5, mx.arange(4096) % 7, mx.arange(4096)))
    assert (u >= 0).all() and (u < 1).all()
    assert abs(u.mean() - 0.5) < 0.02


# ---------------------------------------------------------------- section 4.4: merge specifics


def test_window_merge_conserves_mass_and_never_changes_keys(backend):
    cfg = _cfg(backend, merge="window", window=3, gate=False, prefill="exact")
    rng = np.random.default_rng(4)
    keys, values = random_block(rng, 3, 30, 8, 6, mx.float32)
    state, _ = _update(backend)(RowState.empty(3, 8, 6, mx.float32), keys, values, 0, cfg, mx.arange(3).astype(mx.uint32))
    np.testing.assert_allclose(np.array(state.scores).sum(axis=1), 30.0, rtol=1e-4)
    kept = np.array(state.positions)
    for r in range(3):
        np.testing.assert_array_equal(np.array(state.keys[r]), np.array(keys[r])[kept[r]])


def test_nearest_merge_without_merge_keys_keeps_keys(backend):
    cfg = _cfg(backend, merge="sim_weighted", gate=False)
    rng = np.random.default_rng(6)
    keys, values = random_block(rng, 3, 30, 8, 6, mx.float32)
    state, merges = _update(backend)(RowState.empty(3, 8, 6, mx.float32), keys, values, 0, cfg, mx.arange(3).astype(mx.uint32))
    kept = np.array(state.positions)
    assert merges.sum().item() == 3 * 22
    for r in range(3):
        np.testing.assert_array_equal(np.array(state.keys[r]), np.array(keys[r])[kept[r]])
        assert not np.array_equal(np.array(state.values[r]), np.array(values[r])[kept[r]])


def _hand_state():
    """One row at budget 6 (n_sink 1, recent 2) whose next step evicts position 2 into
    position 4: position 2 has by far the lowest score, and its key points the same
    way as position 4's (cos 1) and is orthogonal or opposed to every other key."""
    keys = np.array([[0, 0, 1, 1], [0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 1, 0], [2, 0, 0, 0], [0, 0, 0, 1]],
                    np.float32)
    values = np.random.default_rng(12).standard_normal((6, 3)).astype(np.float32)
    scores = np.array([5.0, 3.0, 0.1, 4.0, 2.0, 2.5], np.float32)
    state = RowState(mx.array(keys)[None], mx.array(values)[None], mx.array(scores)[None],
                     mx.arange(6, dtype=mx.int32)[None])
    new_key = np.array([-1.0, 0.5, 0.0, 0.0], np.float32)
    # Section 2 by hand: the new key's softmax over the stored keys and itself.
    logits = np.concatenate([keys, new_key[None]]) @ new_key / 2.0
    mass = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    return state, new_key, values, scores + mass[:6]


# keepkv's masses are the current query's, not the scores (test_keepkv_* below).
@pytest.mark.parametrize("merge", [r.name for r in rules.RULES if r.target_share is rules.own_mass and not r.keeps_votes])
def test_mass_weighted_merges_make_the_attention_mass_weighted_mean(backend, merge):
    """The survivor's value becomes (s_t V_t + s_e V_e) / (s_t + s_e) (window_mass: with
    s_e / |W| per target), scores after this step's update; keys never change.
    (sim_weighted would have replaced V_4 by V_2 outright: their cosine is 1.)"""
    state, new_key, values, s = _hand_state()
    cfg = _cfg(backend, budget=6, n_sink=1, recent=2, merge=merge, window=2, gate=False, prefill="exact")
    new_value = np.full((1, 1, 3), 0.25, np.float32)
    out, merged = _update(backend)(state, mx.array(new_key)[None, None], mx.array(new_value), 6, cfg,
                                   mx.zeros((1,), mx.uint32))
    assert merged.tolist() == [1]
    assert np.array(out.positions[0]).tolist() == [0, 1, 3, 4, 5, 6]
    # The nearest survivor, or the window: the 2 rows after position 2.
    targets = [4] if rules.rule(merge).kind == rules.NEAREST else [3, 4]
    share = s[2] / len(targets)
    want_v, want_s = values.copy(), s.copy()
    for t in targets:
        want_v[t] = (s[t] * values[t] + share * values[2]) / (s[t] + share)
        want_s[t] = s[t] + share
    kept = [0, 1, 3, 4, 5]
    np.testing.assert_allclose(np.array(out.values[0, :5]), want_v[kept], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.array(out.scores[0, :5]), want_s[kept], rtol=1e-5)
    np.testing.assert_array_equal(np.array(out.keys[0, :5]), np.array(state.keys[0])[kept])


@pytest.mark.parametrize("merge", MERGES)
def test_only_the_additive_window_merge_leaves_the_range_of_the_inputs(backend, merge):
    """Every blend is a convex combination (weights in [0, 1]), so stored values stay
    within each feature's range over the input values; an additive window rule adds
    V_e / |W| to survivors on every merge, and over a long stream its values outgrow
    every input."""
    cfg = _cfg(backend, merge=merge, window=2, gate=False, prefill="exact")
    rng = np.random.default_rng(13)
    keys = mx.array(rng.standard_normal((2, 150, 8)).astype(np.float32))
    values = mx.array(rng.uniform(0.5, 1.0, (2, 150, 6)).astype(np.float32))
    state, _ = _update(backend)(RowState.empty(2, 8, 6, mx.float32), keys, values, 0, cfg,
                                mx.arange(2).astype(mx.uint32))
    stored = np.array(state.values)
    rule = rules.rule(merge)
    if rule.kind == rules.WINDOW and not rule.blends:
        assert stored.max() > 2.0
    else:
        assert stored.min() >= 0.5 - 1e-6 and stored.max() <= 1.0 + 1e-6


# ---------------------------------------------------------------- section 4.1: value_norm, d2o, keepkv


def test_value_norm_merges_one_token_as_kvpress_does(backend):
    """kvpress's MergingPress for one evicted token: V_t <- (V_t + w V_e) / (1 + w) with
    w = clamp(cos, 0, 1) |V_e| / (|V_e| + |V_t|); the score adds s_e; keys stay."""
    state, new_key, values, s = _hand_state()
    cfg = _cfg(backend, budget=6, n_sink=1, recent=2, merge="value_norm", gate=False, prefill="exact")
    out, merged = _update(backend)(state, mx.array(new_key)[None, None], mx.full((1, 1, 3), 0.25), 6, cfg,
                                   mx.zeros((1,), mx.uint32))
    assert merged.tolist() == [1]
    norm_e, norm_t = np.linalg.norm(values[2]), np.linalg.norm(values[4])
    w = 1.0 * norm_e / (norm_e + norm_t)  # cos(K_2, K_4) = 1
    want_v = values.copy()
    want_v[4] = (values[4] + w * values[2]) / (1 + w)
    kept = [0, 1, 3, 4, 5]
    np.testing.assert_allclose(np.array(out.values[0, :5]), want_v[kept], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.array(out.scores[0, 3]), s[4] + s[2], rtol=1e-5)
    np.testing.assert_array_equal(np.array(out.keys[0, :5]), np.array(state.keys[0])[kept])


def _two_losers_state(query=None):
    """One row at budget 6 (n_sink 1, recent 2) and a chunk of two tokens after it whose
    compression evicts positions 1 and 3 (the lowest scores), both into position 4: K_1
    and K_3 point the way K_4 does (cos 1) and no other key does. With window 2 their
    windows overlap: W(1) = {2, 4}, W(3) = {4, 5}. query [Dk]: the last token's one query
    (scale 0.5), or None for key scoring. Returns the state, the chunk's keys [1, 2, 4]
    and queries, the values [6, 5] and the scores after the chunk's mass, by hand."""
    keys = np.array([[0, 0, 1, 1], [1, 0, 0, 0], [0, 1, 0, 0], [3, 0, 0, 0], [2, 0, 0, 0], [0, 0, 1, 0]],
                    np.float32)
    values = np.random.default_rng(14).standard_normal((6, 5)).astype(np.float32)
    scores = np.array([9.0, 0.1, 5.0, 0.2, 4.0, 3.0], np.float32)
    state = RowState(mx.array(keys)[None], mx.array(values)[None], mx.array(scores)[None],
                     mx.arange(6, dtype=mx.int32)[None])
    new_keys = np.array([[0, 0, 0, 1], [0, -1, 0, 0]], np.float32)
    queries = new_keys if query is None else np.stack([new_keys[0], query])
    every_key = np.concatenate([keys, new_keys])
    mass = np.zeros(8, np.float32)
    for i, q in enumerate(queries):  # section 7's causal chunk scoring, by hand
        logits = every_key[:7 + i] @ q * 0.5
        mass[:7 + i] += np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    q_arg = None if query is None else mx.array(queries)[None, :, None, :]
    return state, mx.array(new_keys)[None], q_arg, values, np.concatenate([scores, [0, 0]]) + mass


def _compress_two_losers(backend, merge, query=None, **fields):
    state, new_keys, queries, values, s = _two_losers_state(query)
    cfg = _cfg(backend, budget=6, n_sink=1, recent=2, merge=merge, window=2, gate=False, prefill="chunk",
               prefill_scoring="causal", **fields)
    out, merged = _update(backend)(state, new_keys, mx.zeros((1, 2, 5)), 6, cfg, mx.zeros((1,), mx.uint32),
                                   queries, None if queries is None else 0.5)
    assert merged.tolist() == [2] and np.array(out.positions[0]).tolist() == [0, 2, 4, 5, 6, 7]
    return out, values, s


# Each nearest rule's (A_4, a_1, a_3) for the hand state, cos = 1 for both losers:
# V_4 <- (A_4 V_4 + a_1 V_1 + a_3 V_3) / (A_4 + a_1 + a_3), every a_e from V_4 as it was.
def _hand_shares(merge, values, s):
    norm = np.linalg.norm(values, axis=1)
    odds = (1 - 2.0**-12) / 2.0**-12  # sim_weighted: c / (1 - c), c capped below 1
    return {"mean": (1, 1, 1), "d2o": (1, 1, 1), "sim_weighted": (1, odds, odds),
            "mass_weighted": (s[4], s[1], s[3]),
            "value_norm": (1, norm[1] / (norm[1] + norm[4]), norm[3] / (norm[3] + norm[4]))}[merge]


@pytest.mark.parametrize("merge", [m for m in rules.names(kind=rules.NEAREST) if m != "keepkv"])
def test_several_losers_fold_into_one_survivor_at_once(backend, merge):
    """Section 4.4: two losers of one compression into one survivor merge simultaneously,
    V_t <- (A_t V_t + sum_e a_e V_e) / (A_t + sum_e a_e), each share from the survivor as
    it was before the compression (merging one at a time composes otherwise: value_norm's
    second weight would see the first merge, mean would give V_3 half and V_1 a quarter);
    the score adds both losers' mass; keys stay unless merge_keys."""
    out, values, s = _compress_two_losers(backend, merge)
    a_t, a_1, a_3 = _hand_shares(merge, values, s)
    want = (a_t * values[4] + a_1 * values[1] + a_3 * values[3]) / (a_t + a_1 + a_3)
    np.testing.assert_allclose(np.array(out.values[0, 2]), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.array(out.scores[0, 2]), s[4] + s[1] + s[3], rtol=1e-5)
    np.testing.assert_array_equal(np.array(out.values[0, [0, 1, 3]]), values[[0, 2, 5]])
    np.testing.assert_array_equal(np.array(out.keys[0, 2]), [2, 0, 0, 0])
    if rules.rule(merge).keys_allowed:
        keyed, _, _ = _compress_two_losers(backend, merge, merge_keys=True)
        want_key = (a_t * np.array([2, 0, 0, 0]) + a_1 * np.array([1, 0, 0, 0]) + a_3 * np.array([3, 0, 0, 0]))
        np.testing.assert_allclose(np.array(keyed.keys[0, 2]), want_key / (a_t + a_1 + a_3), rtol=1e-5)


@pytest.mark.parametrize("merge", rules.names(kind=rules.WINDOW))
def test_overlapping_windows_take_every_loser_at_once(backend, merge):
    """Section 4.4's window rules: W(1) = {2, 4} and W(3) = {4, 5}; every target j takes
    each loser's share s_e / 2 at once (window: V_j + sum_e V_e / 2; window_mass: the
    mass-weighted mean (s_j V_j + sum_e (s_e / 2) V_e) / (s_j + sum_e s_e / 2))."""
    out, values, s = _compress_two_losers(backend, merge)
    gives = {2: [1], 4: [1, 3], 5: [3]}
    for row, j in ((1, 2), (2, 4), (3, 5)):  # stored row, position
        shares = [s[e] / 2 for e in gives[j]]
        if rules.rule(merge).blends:
            want = (s[j] * values[j] + sum(a * values[e] for a, e in zip(shares, gives[j]))) / (s[j] + sum(shares))
        else:
            want = values[j] + sum(values[e] / 2 for e in gives[j])
        np.testing.assert_allclose(np.array(out.values[0, row]), want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.array(out.scores[0, row]), s[j] + sum(shares), rtol=1e-5)
    np.testing.assert_array_equal(np.array(out.keys[0, 1:4]), [[0, 1, 0, 0], [2, 0, 0, 0], [0, 0, 1, 0]])


def test_keepkv_folds_two_losers_into_one_row_for_the_query(backend):
    """Section 4.6 with two losers into row 4, votes 1 each: l_i = s q.K_i, M = max,
    m_i = exp(l_i - M); the value is the m-weighted mean, the key K' + d q with K' the
    m-weighted mean key, so that the merged row (3 votes) has the group's mass for q."""
    q = np.array([0.5, -1.0, 0.0, 0.0], np.float32)
    out, values, s = _compress_two_losers(backend, "keepkv", query=q)
    k = {1: np.array([1.0, 0, 0, 0]), 3: np.array([3.0, 0, 0, 0]), 4: np.array([2.0, 0, 0, 0])}
    logit = {i: 0.5 * q @ k[i] for i in k}
    top = max(logit.values())
    m = {i: np.exp(logit[i] - top) for i in k}
    total = sum(m.values())
    want_v = sum(m[i] * values[i] for i in k) / total
    mean_key = sum(m[i] * k[i] for i in k) / total
    d = (top + np.log(total) - np.log(3) - 0.5 * q @ mean_key) / (0.5 * q @ q)
    np.testing.assert_allclose(np.array(out.values[0, 2]), want_v, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.array(out.keys[0, 2]), mean_key + d * q, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.array(out.votes[0]), [1, 1, 3, 1, 1, 1])
    # The merged row's mass for q is the group's: 3 exp(l') = sum_i exp(l_i).
    merged_logit = 0.5 * q @ np.array(out.keys[0, 2])
    np.testing.assert_allclose(3 * np.exp(merged_logit), sum(np.exp(logit[i]) for i in k), rtol=1e-5)
    np.testing.assert_allclose(np.array(out.scores[0, 2]), s[4] + s[1] + s[3], rtol=1e-5)


def _nearest_cosines(keys, kept, losers, n_sink):
    """Each loser's cosine to its most similar non-sink survivor (keys [N, D], by position)."""
    unit = keys / np.linalg.norm(keys, axis=1, keepdims=True)
    targets = [j for j in kept if j >= n_sink]
    return np.array([max(unit[e] @ unit[j] for j in targets) for e in losers])


def test_d2o_merges_above_a_threshold_that_moves_with_each_compression(backend):
    """tau = m after a row's first compression, then tau <- 0.5 tau + 0.5 m, with m the mean
    of the losers' nearest cosines; a loser merges when its cosine reaches the new tau."""
    cfg = CaMConfig(budget=10, n_sink=1, recent=2, merge="d2o", gate=False, prefill="chunk", backend=backend)
    rng = np.random.default_rng(15)
    all_keys = rng.standard_normal((1, 40, 6)).astype(np.float32)
    all_keys[0, 20:] += 1.5  # the later tokens look alike: the second compression's cosines are higher
    state, tau, offset = RowState.empty(1, 6, 4, mx.float32), None, 0
    for s_len in (20, 20):
        keys_before = np.concatenate([np.array(state.keys[0]), all_keys[0, offset:offset + s_len]])
        before = np.array(state.positions[0]).tolist() + list(range(offset, offset + s_len))
        state, merged = _update(backend)(state, mx.array(all_keys[:, offset:offset + s_len]),
                                         mx.zeros((1, s_len, 4)), offset, cfg, mx.zeros((1,), mx.uint32))
        offset += s_len
        kept = np.array(state.positions[0]).tolist()
        losers = [i for i, p in enumerate(before) if p not in kept]
        cosines = _nearest_cosines(keys_before, [before.index(p) for p in kept], losers, cfg.n_sink)
        tau = cosines.mean() if tau is None else 0.5 * tau + 0.5 * cosines.mean()
        np.testing.assert_allclose(np.array(state.threshold), [tau], rtol=1e-5)
        assert merged.tolist() == [int((cosines >= tau).sum())]
        assert 0 < merged.item() < len(losers)


@pytest.mark.parametrize("prefill, sizes", [("exact", [9, 1, 1, 5]), ("chunk", [6, 9, 1, 12])])
def test_keepkv_leaves_the_current_querys_attention_output_unchanged(backend, prefill, sizes):
    """Section 4.6: with one query per KV head and every eviction merging, the last token's
    attention output over the rows (each weighed by its votes) is the same after the
    evictions as over every row before them; the votes add up to the tokens seen."""
    cfg = CaMConfig(budget=10, n_sink=2, recent=3, merge="keepkv", gate=False, prefill=prefill, backend=backend)
    rng = np.random.default_rng(16)
    state, offset, scale = RowState.empty(3, 8, 6, mx.float32), 0, 0.4
    rows = mx.arange(3).astype(mx.uint32)

    def output(keys, values, votes, query):
        weights = mx.softmax(scale * (keys @ query[:, :, None])[:, :, 0] + mx.log(votes), axis=-1)
        return (weights[:, :, None] * values).sum(axis=1)

    for s_len in sizes:
        k, v = random_block(rng, 3, s_len, 8, 6, mx.float32)
        q = mx.array(rng.standard_normal((3, s_len, 1, 8)).astype(np.float32))
        for t in range(1 if prefill == "chunk" else s_len):
            end = s_len if prefill == "chunk" else t + 1
            block = slice(0 if prefill == "chunk" else t, end)
            start = reference._with_rule_state(state, cfg)
            every_row = [mx.concatenate([a, b], axis=1) for a, b in ((start.keys, k[:, block]),
                                                                     (start.values, v[:, block]))]
            votes = mx.concatenate([start.votes, mx.ones((3, end - block.start))], axis=1)
            want = output(*every_row, votes, q[:, end - 1, 0])
            state, _ = _update(backend)(state, k[:, block], v[:, block], offset + block.start, cfg, rows,
                                        q[:, block], scale)
            got = output(state.keys, state.values, state.votes, q[:, end - 1, 0])
            np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-6)
        offset += s_len
    np.testing.assert_array_equal(np.array(state.votes.sum(axis=1)), [offset] * 3)
    assert (np.array(state.votes) > 1).any()
