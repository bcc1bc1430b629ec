"""The merge engine's CUDA kernels (camkv.backends.merge_cuda, and the partition of
camkv.backends.compact_cuda) against the MLX operations they stand for, on random and
adversarial inputs: the partition (ties, NaN scores, sinks, recent windows), the rows a
compression gathers (index dtypes, poisoned keys, votes), the nearest survivor of every
loser (ties, sinks, NaN, infinite and overflowing keys, rows with no candidate, sizes off
the tiles), the sums of a window rule's losers into their targets (several slots a
loser, dead slots, many losers on one target), keepkv's merge where logits overflow;
then the whole engine with them against the reference, rule by rule, and their
first-use check. On an NVIDIA GPU the kernels run there; elsewhere their text runs on
CPU threads (tests/cuda_emulation.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from camkv import CaMConfig, merges, policy
from camkv.backends import compact_cuda, constants, drop, merge_cuda, merge_ops
import cuda_emulation
from test_merge_ops import DTYPES, MERGING, check_engine, check_engine_case, engine_cases

on_gpu = pytest.mark.skipif(not cuda_emulation.here(), reason="no NVIDIA GPU, and no C++ compiler to emulate one")


@pytest.fixture(autouse=True)
def _kernels_here(monkeypatch):
    """The merge engine with its kernels; without an NVIDIA GPU, their text on CPU threads
    (compiled once per text)."""
    monkeypatch.setattr(merge_cuda, "available", lambda: True)
    monkeypatch.setattr(merge_ops, "_probe", {"failure": None})  # the tests here check the kernels themselves
    with cuda_emulation.kernels_here(merge_cuda, compact_cuda):
        yield


@st.composite
def nearest_cases(draw):
    return dict(R=draw(st.integers(1, 3)), k=draw(st.one_of(st.integers(1, 70), st.integers(60, 300))),
                m=draw(st.one_of(st.integers(1, 70), st.integers(60, 300))), D=draw(st.sampled_from([8, 33, 64, 128])),
                n_sink=draw(st.sampled_from([0, 1, 4])), dtype=draw(st.sampled_from(["float32", "bfloat16"])),
                duplicates=draw(st.booleans()), poison=draw(st.sampled_from(["none", "nan", "inf", "huge"])),
                seed=draw(st.integers(0, 2**31 - 1)))


def _keys(rng, shape, dtype, duplicates):
    keys = rng.standard_normal(shape).astype(np.float32)
    if duplicates:  # exact ties: survivors repeating one key, losers equal to a survivor
        keys[..., 1::3, :] = keys[..., :1, :]
    return mx.array(keys).astype(getattr(mx, dtype)).astype(mx.float32)


def test_launch_constants_are_made_once_per_value_dtype_and_shape():
    """A launch's small inputs (camkv.backends.constants): one array per value, dtype and
    shape, so 1 as a dim and 1.0 as a scale (equal keys in Python) stay apart."""
    dims = constants.ints(1, 2)
    assert constants.ints(1, 2) is dims and dims.dtype == mx.int32 and dims.tolist() == [1, 2]
    scale = constants.floats(1.0, 2.0)
    assert scale.dtype == mx.float32 and scale is not dims and scale.tolist() == [1.0, 2.0]
    placeholder = constants.floats(0.0, shape=(1, 1, 1, 1))
    assert placeholder.shape == (1, 1, 1, 1) and constants.floats(0.0).shape == (1,)
    for first_pending in range(3 * constants.MAX_HELD):  # a value new at every compression
        assert constants.ints(first_pending).tolist() == [first_pending]
    assert len(constants._made) <= constants.MAX_HELD


@pytest.fixture(params=["product", "direct"])
def nearest_search(request, monkeypatch):
    """The nearest search's kernels: over the matrix product (merge_cuda.nearest), or the
    dot products taken in the kernel (merge_cuda.nearest_direct)."""
    monkeypatch.setattr(merge_ops, "NEAREST_WITHOUT_PRODUCT", request.param == "direct")
    return request.param


@on_gpu
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(nearest_cases())
def test_nearest_survivor_kernel_matches_the_operations(nearest_search, case):
    """t, found and the cosine as merge_ops._nearest's MLX operations give them: the same
    target wherever the best cosine is not a near-tie (section 8), equal found, cosines
    within float32 summation-order rounding."""
    note(f"case={case}")
    c = case
    rng = np.random.default_rng(c["seed"])
    losers = _keys(rng, (c["R"], c["k"], c["D"]), c["dtype"], c["duplicates"])
    kept = _keys(rng, (c["R"], c["m"], c["D"]), c["dtype"], c["duplicates"])
    if c["duplicates"]:
        losers = mx.concatenate([kept[:, :1], losers[:, 1:]], axis=1)
    if c["poison"] != "none":
        # huge: a key whose norm overflows to inf while its dot products stay finite
        bad = mx.array({"nan": np.nan, "inf": np.inf, "huge": 1e30}[c["poison"]], mx.float32)
        losers = mx.concatenate([losers[:, :1] * bad, losers[:, 1:]], axis=1)
        kept = mx.concatenate([kept[:, :-1], kept[:, -1:] * bad], axis=1)
    positions = mx.broadcast_to(mx.arange(c["m"], dtype=mx.int32), (c["R"], c["m"]))
    expected = merge_ops._nearest(losers, kept, positions, c["n_sink"], True, kernels=False)
    got = merge_ops._nearest(losers, kept, positions, c["n_sink"], True, kernels=True)
    t_e, found_e, cos_e = (np.array(a) for a in expected)
    t_g, found_g, cos_g = (np.array(a) for a in got)
    np.testing.assert_array_equal(found_g, found_e)
    # A different target only where the two cosines it stands between are a near-tie.
    norm_k = np.array(merges.feature_norm(kept))
    products = np.einsum("rkd,rmd->rkm", np.array(losers, np.float64), np.array(kept, np.float64))
    with np.errstate(invalid="ignore"):  # poisoned keys
        ranked = products / np.maximum(norm_k, 1e-12)[:, None, :]
    rows, cols = np.nonzero(t_g != t_e)
    for r, e in zip(rows, cols):
        a, b = ranked[r, e, t_g[r, e]], ranked[r, e, t_e[r, e]]
        assert found_e[r, e] and abs(a - b) <= 1e-5 * max(abs(a), abs(b), 1e-6), (r, e, a, b)
    same = (t_g == t_e) & np.isfinite(cos_e)
    np.testing.assert_allclose(cos_g[same], cos_e[same], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.isfinite(cos_g), np.isfinite(cos_e))


@on_gpu
@pytest.mark.parametrize("fence, from_pairs, fenced", [(True, 0, True), (True, 9 * 12, True),
                                                       (True, 9 * 12 + 1, False), (False, 0, False)])
def test_the_nearest_search_evaluates_its_product_alone_with_the_kernels(fence, from_pairs, fenced, monkeypatch):
    """With the kernels (CUDA), the nearest search's product of losers [R, k, D] by
    survivors [R, D, m] is evaluated as work of its own: its inputs before it, the product
    [R, k, m] after (merge_ops.FENCE_NEAREST_PRODUCT), so MLX's CUDA build records it in a
    graph by itself, where it has FENCE_FROM_PAIRS loser-survivor pairs (k m) or more (a
    prompt chunk's; a decode compression's fewer). Unfenced, or by the MLX operations, the
    search evaluates nothing. Same survivors either way."""
    rng = np.random.default_rng(1)
    losers, kept = (mx.array(rng.standard_normal((2, n, 16)).astype(np.float32)) for n in (9, 12))
    positions = mx.broadcast_to(mx.arange(12, dtype=mx.int32), (2, 12))
    want = merge_ops._nearest(losers, kept, positions, 2, False, kernels=False)
    evaluated, real_eval = [], mx.async_eval
    monkeypatch.setattr(merge_ops.mx, "async_eval",
                        lambda *arrays: evaluated.append([a.shape for a in arrays]) or real_eval(*arrays))
    monkeypatch.setattr(merge_ops, "FENCE_NEAREST_PRODUCT", fence)
    monkeypatch.setattr(merge_ops, "FENCE_FROM_PAIRS", from_pairs)
    assert merge_ops._nearest(losers, kept, positions, 2, False, kernels=False) and evaluated == []
    got = merge_ops._nearest(losers, kept, positions, 2, False, kernels=True)
    assert evaluated == ([[(2, 9, 16), (2, 16, 12)], [(2, 9, 12)]] if fenced else [])
    for g, w in zip(got[:2], want[:2]):
        np.testing.assert_array_equal(np.array(g), np.array(w))


@on_gpu
def test_nearest_survivor_kernel_excludes_sinks_and_takes_the_first_of_equals(nearest_search):
    """Adversarial by construction: the best survivor is a sink (excluded); the next best
    appears at 1, 33, 65 and 129 (one lane's survivors in the kernel) and at 2 (another
    lane's), which must give 1, the first; a row whose every survivor is a sink has none."""
    rng = np.random.default_rng(7)
    kept = rng.standard_normal((140, 16)).astype(np.float32)
    kept[:, 0] = -np.abs(kept[:, 0]) - 3.0  # every other survivor points away from the loser
    loser = np.zeros(16, np.float32)
    loser[0] = 1.0
    kept[0] = loser  # the sink: cosine 1
    for j in (1, 2, 33, 65, 129):
        kept[j] = 0.0
        kept[j, :2] = 0.5, 1.0  # cosine 0.447, the best after the sink
    kept, losers = mx.array(kept)[None], mx.array(loser)[None, None]
    positions = mx.arange(140, dtype=mx.int32)[None]
    t, found, cosine = merge_ops._nearest(losers, kept, positions, 1, False, kernels=True)
    assert found.item() and t.item() == 1
    assert abs(cosine.item() - 0.5 / np.sqrt(1.25)) < 1e-6
    t, found, _ = merge_ops._nearest(losers, kept[:, :5], positions[:, :5], 5, False, kernels=True)
    assert not found.item() and t.item() == 0


@st.composite
def gather_cases(draw):
    return dict(R=draw(st.integers(1, 3)), k=draw(st.integers(1, 90)), m=draw(st.integers(1, 90)),
                spare=draw(st.integers(0, 5)), Dk=draw(st.sampled_from([8, 33, 64, 128])),
                Dv=draw(st.sampled_from([8, 33, 64])), dtype=draw(st.sampled_from(sorted(DTYPES))),
                index=draw(st.sampled_from(["int32", "uint32"])), poison=draw(st.sampled_from(["none", "nan", "inf"])),
                votes=draw(st.booleans()), seed=draw(st.integers(0, 2**31 - 1)))


@on_gpu
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(gather_cases())
def test_gather_kernel_takes_the_rows_as_the_operations(case):
    """Rows.split in one launch (merge_cuda.gather_rows) against its MLX operations: the
    same float32 keys and values, keys as stored, scores, positions and votes bit for bit, key
    and value norms within float32 summation-order rounding (NaN and infinite keys included), for
    the losers and the survivors, whatever the index dtype argpartition leaves."""
    note(f"case={case}")
    c = case
    rng = np.random.default_rng(c["seed"])
    n = c["k"] + c["m"] + c["spare"]
    dtype = getattr(mx, c["dtype"])
    keys = rng.standard_normal((c["R"], n, c["Dk"])).astype(np.float32)
    if c["poison"] != "none":
        keys[:, rng.integers(0, n)] = np.nan if c["poison"] == "nan" else np.inf
    keys, values = mx.array(keys).astype(dtype), mx.array(rng.standard_normal((c["R"], n, c["Dv"])).astype(np.float32)).astype(dtype)
    scores = mx.array(rng.random((c["R"], n)).astype(np.float32))
    positions = mx.array(rng.integers(0, 10**6, (c["R"], n)).astype(np.int32))
    order = np.stack([rng.permutation(n)[:c["k"] + c["m"]] for _ in range(c["R"])])
    loser_idx, kept_idx = (mx.array(part.astype(c["index"])) for part in (order[:, :c["k"]], order[:, c["k"]:]))
    votes = mx.array(rng.integers(1, 9, (c["R"], n)).astype(np.float32)) if c["votes"] else None
    got = merge_ops.Rows.split(keys, values, scores, positions, votes, loser_idx, kept_idx, key_norm=True, kernels=True)
    want = merge_ops.Rows.split(keys, values, scores, positions, votes, loser_idx, kept_idx, key_norm=True)
    for g_rows, w_rows in zip(got, want):
        for field, g, w in zip(merge_ops.Rows._fields, g_rows, w_rows):
            if w is None:
                assert g is None, field
                continue
            assert g.dtype == w.dtype and g.shape == w.shape, field
            g, w = np.array(g.astype(mx.float32)), np.array(w.astype(mx.float32))
            if field in ("key_norm", "value_norm"):
                np.testing.assert_allclose(g, w, rtol=1e-5, err_msg=field)
            else:
                np.testing.assert_array_equal(g, w, err_msg=field)


@st.composite
def partition_cases(draw):
    n_sink, recent = draw(st.sampled_from([0, 1, 4])), draw(st.sampled_from([1, 3, 50]))
    budget = n_sink + recent + 1 + draw(st.integers(0, 300))
    N = budget + draw(st.integers(1, 300))
    n = draw(st.integers(0, N - 1))
    return dict(R=draw(st.integers(1, 3)), n=n, s_len=N - n, budget=budget, n_sink=n_sink, recent=recent,
                ties=draw(st.booleans()), nan=draw(st.booleans()), first=n + draw(st.integers(0, 5000)),
                seed=draw(st.integers(0, 2**31 - 1)))


@on_gpu
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(partition_cases())
def test_partition_kernel_chooses_as_the_operations(case):
    """compact_cuda.partition against drop.losers_and_survivors and the joined scores and
    positions: the same joined rows bit for bit; the same survivors where scores are
    distinct; with ties (section 8) a valid choice: every row ranked above the budget-th
    kept, every row below it evicted, losers and survivors ascending and disjoint."""
    note(f"case={case}")
    c = case
    rng = np.random.default_rng(c["seed"])
    R, n, s_len = c["R"], c["n"], c["s_len"]
    N = n + s_len
    draw = (lambda shape: rng.integers(0, 4, shape).astype(np.float32)) if c["ties"] else (
        lambda shape: rng.random(shape).astype(np.float32))
    settled, chunk = draw((R, n)), draw((R, N))
    if c["nan"]:
        chunk[:, rng.integers(0, N)] = np.nan
    # The settled rows' positions: distinct, ascending, below the chunk's first.
    positions = np.stack([np.sort(rng.choice(c["first"], n, replace=False)) for _ in range(R)]).astype(np.int32)
    cfg = CaMConfig(budget=c["budget"], n_sink=c["n_sink"], recent=c["recent"], merge="mean", scoring="query")
    settled_m, positions_m, chunk_m = mx.array(settled), mx.array(positions), mx.array(chunk)
    losers, kept, scores, held_positions = compact_cuda.partition(settled_m, positions_m, chunk_m,
                                                                  constants.ints(c["first"]), cfg)
    want_positions = mx.concatenate([positions_m, mx.broadcast_to(c["first"] + mx.arange(s_len, dtype=mx.int32),
                                                                  (R, s_len))], axis=1)
    want_scores = mx.concatenate([settled_m + chunk_m[:, :n], chunk_m[:, n:]], axis=1)
    np.testing.assert_array_equal(np.array(held_positions), np.array(want_positions))
    np.testing.assert_array_equal(np.array(scores), np.array(want_scores))
    want_losers, want_kept = drop.losers_and_survivors(want_scores, want_positions, c["first"] + s_len - 1, c["budget"],
                                                       c["n_sink"], c["recent"])
    losers, kept = np.array(losers), np.array(kept)
    assert losers.shape == np.array(want_losers).shape and kept.shape == np.array(want_kept).shape
    for r in range(R):
        assert np.all(np.diff(kept[r]) > 0) and np.all(np.diff(losers[r]) > 0)
        assert sorted([*kept[r], *losers[r]]) == list(range(N))
    if not c["ties"]:
        np.testing.assert_array_equal(kept, np.array(want_kept))
        return
    # Ties: rank as drop.losers_and_survivors ranks; the kept rows' lowest rank is at least every loser's.
    protected = np.array(policy.protected(want_positions, c["first"] + s_len - 1, c["n_sink"], c["recent"]))
    ranked = np.where(protected, np.inf, np.where(np.isnan(np.array(want_scores)), -np.inf, np.array(want_scores)))
    for r in range(R):
        if len(losers[r]) and len(kept[r]):
            assert ranked[r, kept[r]].min() >= ranked[r, losers[r]].max()


@on_gpu
@pytest.mark.parametrize("overflow", [False, True])
def test_keepkv_kernels_match_the_operations_where_logits_overflow(overflow):
    """keepkv's four launches (merge_cuda.keep_merge) against merge_ops._keep_output's
    operations, through merge_ops.merge: with overflow, a third of the losers have keys
    of finite norm whose logits for a large query overflow, so their targets' mass is not
    finite (section 4.6: such a target blends by votes and its key stays the mean)."""
    rng = np.random.default_rng(11)
    R, k, m, D = 2, 40, 30, 16
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    loser_keys, kept_keys = normal(R, k, D), normal(R, m, D)
    query = normal(R, D) * (1e21 if overflow else 1.0)
    if overflow:
        loser_keys[:, ::3] *= 1e18
    def rows(keys, n):
        keys = mx.array(keys)
        return merge_ops.Rows(keys, mx.array(normal(R, n, 12)), mx.array(rng.random((R, n)).astype(np.float32)),
                              mx.broadcast_to(mx.arange(n, dtype=mx.int32) + 8, (R, n)),
                              mx.array(rng.integers(1, 5, (R, n)).astype(np.float32)), keys, merges.feature_norm(keys))
    losers, kept = rows(loser_keys, k), rows(kept_keys, m)
    cfg = CaMConfig(budget=m, n_sink=0, recent=1, merge="keepkv", scoring="query")
    args = (losers, mx.zeros((R, k), mx.int32), kept, mx.zeros((R, m), mx.int32), None, mx.array(query), 0.25, cfg,
            mx.arange(R).astype(mx.uint32), False)
    got, want = merge_ops.merge(*args, kernels=True), merge_ops.merge(*args, kernels=False)
    assert np.array(want.count).sum() > 0
    np.testing.assert_array_equal(np.array(got.count), np.array(want.count))
    assert got.so_far.item() == want.so_far.item() == np.array(want.count).sum()
    if overflow:  # the case this test is for: some target's mass is not finite
        l_e = 0.25 * np.einsum("rkd,rd->rk", loser_keys.astype(np.float64), query)
        assert (np.abs(l_e) > np.finfo(np.float32).max).any()
    for field in ("keys", "values", "votes", "scores"):
        np.testing.assert_allclose(np.array(getattr(got, field)), np.array(getattr(want, field)), rtol=1e-4,
                                   atol=1e-5, err_msg=field)


@st.composite
def blend_cases(draw, merge):
    return dict(merge=merge, R=draw(st.integers(1, 2)), k=draw(st.one_of(st.integers(1, 40), st.integers(120, 420))),
                m=draw(st.one_of(st.integers(1, 6), st.integers(20, 90))), Dk=draw(st.sampled_from([8, 33, 64])),
                Dv=draw(st.sampled_from([8, 31, 96])), window=draw(st.integers(2, 5)),
                merge_keys=merges.rule(merge).keys_allowed and draw(st.booleans()),
                gate=merge != "window" and draw(st.booleans()), hub=draw(st.booleans()),
                stored=draw(st.sampled_from(["float32", "bfloat16"])), seed=draw(st.integers(0, 2**31 - 1)))


@on_gpu
@pytest.mark.filterwarnings("ignore::camkv.VotesWarning")
@pytest.mark.parametrize("merge", ["mean", "mass_weighted", "value_norm", "d2o", "keepkv", "window"])
def test_the_merge_kernels_merge_as_the_operations(merge):
    """A compression's merges with the kernels (the nearest search, a nearest rule's blend,
    keepkv's merge, the window rule's sums) against the MLX operations, through
    merge_ops.merge: hundreds of losers, few survivors (targets that take a hundred losers
    each) or many, a hub (most keys near one survivor's), value and key widths off and on
    a warp's 32 lanes, blended keys, the gate, keys stored in bfloat16; to float32
    rounding of sums in another order."""

    @settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True)
    @given(blend_cases(merge))
    def run(case):
        note(f"case={case}")
        _check_blend(case)

    run()


def _check_blend(c: dict):
    rng = np.random.default_rng(c["seed"])
    R, k, m, Dk, Dv = c["R"], c["k"], c["m"], c["Dk"], c["Dv"]
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    keys = normal(R, k + m, Dk)
    if c["hub"]:  # most rows near the first survivor's key: one target takes most losers
        keys[:, :-1] = keys[:, -1:] + 0.3 * keys[:, :-1]
    order = np.stack([rng.permutation(k + m) for _ in range(R)])
    kept_idx = np.sort(order[:, :m], axis=1).astype(np.int32)
    loser_idx = order[:, m:].astype(np.int32)  # in any order, as a compression's
    stored = mx.array(keys).astype(getattr(mx, c["stored"]))
    values, scores = mx.array(normal(R, k + m, Dv)), mx.array(rng.random((R, k + m)).astype(np.float32))
    positions = mx.broadcast_to(mx.arange(k + m, dtype=mx.int32) + 3, (R, k + m))
    votes = mx.array(rng.integers(1, 4, (R, k + m)).astype(np.float32)) if c["merge"] == "keepkv" else None
    losers, kept = merge_ops.Rows.split(stored, values, scores, positions, votes, mx.array(loser_idx),
                                        mx.array(kept_idx), key_norm=True)
    cfg = CaMConfig(budget=m + 3, n_sink=1, recent=1, merge=c["merge"], window=c["window"], gate=c["gate"], seed=7,
                    scoring="query", merge_keys=c["merge_keys"])
    threshold = mx.full((R,), float("nan"), mx.float32) if c["merge"] == "d2o" else None
    split = drop.on_cuda() and c["stored"] == "float32"  # as compress asks: float32 keys exact on a GPU's product
    args = (losers, mx.array(loser_idx), kept, mx.array(kept_idx), threshold, mx.array(normal(R, Dk)), 0.3, cfg,
            mx.arange(R).astype(mx.uint32), split)
    so_far = mx.array(c["seed"] % 1000, mx.int32)  # a cache's running count, which the merges add to
    got = merge_ops.merge(*args, kernels=True, merges_so_far=so_far)
    want = merge_ops.merge(*args, kernels=False, merges_so_far=so_far)
    np.testing.assert_array_equal(np.array(got.count), np.array(want.count))
    assert got.so_far.shape == ()
    assert got.so_far.item() == want.so_far.item() == so_far.item() + np.array(want.count).sum()
    for field in ("keys", "values", "votes", "scores"):
        g, w = getattr(got, field), getattr(want, field)
        if w is None:
            assert g is None, field
            continue
        np.testing.assert_allclose(np.array(g.astype(mx.float32)), np.array(w.astype(g.dtype).astype(mx.float32)),
                                   rtol=2e-2 if g.dtype == mx.bfloat16 else 1e-4, atol=1e-4, err_msg=field)


@st.composite
def scatter_cases(draw):
    return dict(R=draw(st.integers(1, 3)), k=draw(st.integers(1, 200)), m=draw(st.integers(1, 40)),
                w=draw(st.sampled_from([1, 3])), C=draw(st.sampled_from([1, 2, 33, 130])),
                live=draw(st.floats(0.0, 1.0)), seed=draw(st.integers(0, 2**31 - 1)))


@on_gpu
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scatter_cases())
def test_scatter_kernel_sums_as_the_scatter_add(case):
    """_Edges.sums with the kernel equals it without (MLX's scatter-add), to float32 rounding
    of sums in another order; few survivors for many losers, so targets take many each."""
    note(f"case={case}")
    c = case
    rng = np.random.default_rng(c["seed"])
    targets = mx.array(rng.integers(0, c["m"], (c["R"], c["k"], c["w"])).astype(np.int32))
    live = mx.array(rng.random((c["R"], c["k"], c["w"])) < c["live"])
    columns = [mx.array(rng.standard_normal((c["R"], c["k"], c["C"])).astype(np.float32)),
               mx.array(rng.standard_normal((c["R"], c["k"])).astype(np.float32)), 1.0]
    expected = merge_ops._Edges(targets, live, c["m"], kernels=False).sums(*columns)
    got = merge_ops._Edges(targets, live, c["m"], kernels=True).sums(*columns)
    for g, e in zip(got, expected):
        assert g.shape == e.shape
        np.testing.assert_allclose(np.array(g), np.array(e), rtol=1e-5, atol=1e-4)


@st.composite
def threshold_cases(draw):
    return dict(R=draw(st.integers(1, 3)), k=draw(st.one_of(st.integers(1, 40), st.integers(250, 700))),
                poison=draw(st.sampled_from(["none", "some", "all"])), eligible=draw(st.floats(0.0, 1.0)),
                first=draw(st.booleans()), seed=draw(st.integers(0, 2**31 - 1)))


@on_gpu
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(threshold_cases())
def test_moved_threshold_kernel_gates_as_the_operations(case):
    """d2o's gate in one launch (merge_cuda.moved_threshold) against merges.moved_threshold
    and the comparison after it: a row's first compression (NaN before) and a later one,
    NaN and infinite cosines among the finite ones or in place of all (the threshold then
    stays), rows longer than the work group. The thresholds agree to float32 rounding of
    a sum in another order; which losers merge agree except where a cosine lies within
    that rounding of the threshold (section 8's near-tie)."""
    note(f"case={case}")
    c = case
    rng = np.random.default_rng(c["seed"])
    cosine = rng.uniform(-1.0, 1.0, (c["R"], c["k"])).astype(np.float32)
    if c["poison"] != "none":
        poisoned = rng.random(cosine.shape) < (1.0 if c["poison"] == "all" else 0.2)
        cosine[poisoned] = rng.choice([np.nan, np.inf, -np.inf], poisoned.sum())
    before = np.full(c["R"], np.nan if c["first"] else 0.25, np.float32)
    eligible = mx.array(rng.random(cosine.shape) < c["eligible"])
    got_merging, got = merge_cuda.moved_threshold(mx.array(cosine), eligible, mx.array(before))
    want = merges.moved_threshold(mx.array(before), mx.array(cosine))
    want_merging = eligible & (mx.array(cosine) >= want[:, None])
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-6, equal_nan=True)
    near = np.abs(cosine - np.array(want)[:, None]) <= 1e-5
    differ = np.array(got_merging) != np.array(want_merging)
    assert not (differ & ~near).any(), np.argwhere(differ & ~near)[:5]


# ---------------------------------------------------------------- the engine with its kernels


@on_gpu
@pytest.mark.filterwarnings("ignore::camkv.VotesWarning")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("merge", MERGING)
def test_the_engine_with_its_kernels_matches_the_reference(merge, dtype, nearest_search):
    """tests/test_merge_ops.py's fixed case (about 56 losers for at most 13 non-sink
    survivors, gate on, query scoring, merge_keys where allowed) by the engine with its
    kernels (either nearest search), tie-aware against the reference."""
    cfg = CaMConfig(budget=16, n_sink=2, recent=3, merge=merge, window=3, prefill="chunk", gate=True, seed=5,
                    scoring="query", merge_keys=merges.rule(merge).keys_allowed)
    seen = check_engine(cfg, 30, 60, rows=3, k_dim=16, v_dim=12, dtype=DTYPES[dtype], seed=3, queries_per_kv=3)
    assert seen["flips"] or seen["most"] >= 3, seen


@on_gpu
@pytest.mark.filterwarnings("ignore::camkv.VotesWarning")
def test_the_engine_fuzz_with_its_kernels_matches_the_reference():
    """tests/test_merge_ops.py's fuzz cases (random rules, shapes, dtypes, chunkings; each
    example notes its seed) by the engine with its kernels."""

    @settings(max_examples=30, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large], print_blob=True)
    @given(engine_cases())
    def run(case):
        check_engine_case(case)

    run()


@on_gpu
@pytest.mark.filterwarnings("ignore::camkv.VotesWarning")
@pytest.mark.parametrize("merge, bits", [("mean", None), ("value_norm", None), ("keepkv", None), ("window", None),
                                         ("mean", 8)])
def test_the_kernels_blend_writes_the_buffers_a_cache_decodes_into(merge, bits, monkeypatch):
    """A nearest rule's blend, keepkv's merge and the window rule's write the survivors
    straight into buffers with room to decode (merge_ops.compress's capacity), which the
    cache adopts without copying them (no with_room of the survivors); a cache whose chunk
    compressions run the engine with its kernels (a GPU's way, pretended here) then holds
    what its twin holds, whose compressions run the engine's MLX operations and copy their
    survivors into new buffers: after a prompt, decode steps through several compressions
    and a second block, the same positions, rows, scores and rule state."""
    from camkv import CaMKVCache, buffers
    from camkv.backends import compress
    from tiny_models import counted

    def run(kernels: bool):
        monkeypatch.setattr(merge_cuda, "available", lambda: kernels)
        monkeypatch.setattr(compress, "gpu_chunk", lambda backend, cfg, end, settled: end - settled >= 2)
        copied, engine = [], counted(monkeypatch, merge_ops, "compress")
        real = buffers.with_room
        monkeypatch.setattr(buffers, "with_room", lambda before, block, spare: copied.append(block.shape[2])
                            or real(before, block, spare))
        rng = np.random.default_rng(5)
        cfg = CaMConfig(budget=16, n_sink=2, recent=3, slack=4, merge=merge, scoring="key", bits=bits, group_size=32,
                        merge_keys=merges.rule(merge).keys_allowed)
        cache = CaMKVCache(cfg)
        block = lambda n: mx.array(rng.standard_normal((1, 2, n, 32)).astype(np.float32)).astype(mx.bfloat16)  # noqa: E731
        for n in [37] + [1] * 13 + [9]:
            keys = block(n)
            cache.update_and_fetch(keys, keys * 0.5 + 1.0)
        rows = cache._rows
        held = [np.array(a.astype(mx.float32)) for a in rows.held_arrays(rows.held)]
        votes = None if rows.votes is None else np.array(rows.votes)
        return held, np.array(rows.scores), np.array(rows.positions), votes, copied.count(16), len(engine)

    got, want = run(True), run(False)
    # Survivors' keys and values copied into new buffers: by the kernel core's decode
    # compressions alone, none by the engine's (the prompt's, the block's; keepkv's every one).
    assert got[5] == want[5] >= 2 and got[4] == want[4] - 2 * want[5], (got[4:], want[4:])
    np.testing.assert_array_equal(got[2], want[2])
    for g, w in zip(got[0], want[0]):
        np.testing.assert_allclose(g, w, rtol=1e-2, atol=1e-2)  # a bfloat16 rounding of sums in another order
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5)
    if want[3] is not None:
        np.testing.assert_allclose(got[3], want[3], rtol=1e-6)


@on_gpu
@pytest.mark.filterwarnings("ignore::camkv.VotesWarning")
@pytest.mark.parametrize("merge", ["mean", "keepkv", "window"])
def test_a_caches_merge_count_is_the_kernels_own_output(merge, monkeypatch):
    """mlx-lm evaluates every cache's state after each prompt chunk. Where the kernels
    merge a chunk, the state's merge count is their last launch's output: once the rows
    are evaluated it needs no operation of its own (the MLX operations' count takes a sum
    and an addition a chunk, on a GPU a launch each, a layer at a time), and it is the
    operations' count (counted as bench/profile_merge_engine.py counts a compression's)."""
    from camkv import CaMKVCache
    from camkv.backends import compress
    from test_bench import _load_bench_script

    graph_operations = _load_bench_script("profile_merge_engine").graph_operations

    def run(kernels: bool):
        monkeypatch.setattr(merge_cuda, "available", lambda: kernels)
        monkeypatch.setattr(compress, "gpu_chunk", lambda backend, cfg, end, settled: end - settled >= 2)
        rng = np.random.default_rng(3)
        cache = CaMKVCache(CaMConfig(budget=16, n_sink=2, recent=3, slack=4, merge=merge, scoring="key", gate=False))
        launches, counts = [], []
        for _ in range(3):
            keys = mx.array(rng.standard_normal((1, 2, 24, 32)).astype(np.float32)).astype(mx.bfloat16)
            cache.update_and_fetch(keys, keys * 0.5 + 1.0)
            state = cache.state
            mx.eval(state[:4])  # the rows, as attention reads them
            launches.append(graph_operations(state[4])[1])
            counts.append(state[4].item())
        return launches, counts

    (got_launches, got), (want_launches, want) = run(True), run(False)
    assert got == want and want[0] > 0 and want[-1] > want[0], (got, want)
    assert got_launches == [0, 0, 0] and min(want_launches) > 0, (got_launches, want_launches)


# Each defect of a kernel's text: (module, the text's name, the part replaced, its
# replacement); a part None appends the replacement to the text.
_TEXT_DEFECTS = {
    "wrong": (merge_cuda, "_HEADER", "out.cosine = dots[best > -INFINITY ? best_at : 0] /",
              "out.cosine = 1.001f * dots[best > -INFINITY ? best_at : 0] /"),
    "no compile": (merge_cuda, "_SCATTER", None, "\n  this is not C++;"),
    "wrong blend": (merge_cuda, "_FINISH", " / total : own;", " / total * 1.001f : own;"),
    "blend does not compile": (merge_cuda, "_SPREAD", None, "\n  this is not C++;"),
    "wrong gather": (merge_cuda, "_GATHER", "(lost ? l_norm : s_norm)[at] = sqrtf(squares);",
                     "(lost ? l_norm : s_norm)[at] = sqrtf(squares) * 1.001f;"),
    "wrong partition": (compact_cuda, "_SOURCE_SELECT", "positions_out[(long)r * N + j] = position_at(j);",
                        "positions_out[(long)r * N + j] = position_at(j) + 1;"),
    "wrong window": (merge_cuda, "_WINDOW", "atomicAdd(into + Dv + 2, mass[loser] / shared);",
                     "atomicAdd(into + Dv + 2, mass[loser] / shared * 1.01f);"),
    "wrong keepkv query": (merge_cuda, "_KEEP_INPUTS", "__fmul_rn(sum, 1.0f / (float)G)",
                           "__fmul_rn(sum, 1.001f / (float)G)"),
    "wrong fused blend": (merge_cuda, "_NEAREST_SPREAD", "best.cosine, mass[loser]",
                          "best.cosine, 1.01f * mass[loser]"),
    "wrong keepkv search": (merge_cuda, "_KEEP_SEARCH", "best.t, best.has, l, lane);",
                            "best.t, best.has && best.t != 1, l, lane);"),
    "wrong gated keepkv": (merge_cuda, "_KEEP_LOGITS", "loser, target[loser], merges,", "loser, target[loser] / 2, merges,"),
    "wrong keepkv key": (merge_cuda, "_KEEP_FINISH", "__fmul_rn(shift, query[r * Dk + c])",
                         "__fmul_rn(1.01f * shift, query[r * Dk + c])"),
}


@on_gpu
@pytest.mark.parametrize("defect", ["none", *_TEXT_DEFECTS])
def test_a_failing_first_use_check_switches_the_kernels_off_with_one_warning(defect, monkeypatch):
    """The probe passes the kernels as they are; a kernel that computes a cosine, a blend
    or a key norm 0.1% off, a position one off, keepkv's key moved 1% too far, its query
    0.1% off or its losers' targets wrong (found with its search or after the gate), a window's mass or a fused search's losers' mass 1% too large, or whose text
    does not compile, is switched
    off for the process with one warning, and compressions then run the MLX operations
    (kernels=None asks the probe)."""
    if defect in _TEXT_DEFECTS:
        module, name, part, replacement = _TEXT_DEFECTS[defect]
        text = getattr(module, name)
        patched = text + replacement if part is None else text.replace(part, replacement)
        assert patched != text, defect  # the part is in the text
        monkeypatch.setattr(module, name, patched)
        monkeypatch.setattr(module, "_kernels", {})  # built again from the patched text
    monkeypatch.setattr(merge_ops, "_probe", {})
    monkeypatch.setattr(merge_cuda, "_kernels", {})  # built again from the (patched) text
    if defect == "none":
        assert merge_ops.kernels_pass_probe()
        return
    with pytest.warns(RuntimeWarning, match="kernels are switched off for this process because their first-use"):
        assert not merge_ops.kernels_pass_probe()
    called = []
    monkeypatch.setattr(merge_cuda, "nearest", lambda *a: called.append(a))
    cfg = CaMConfig(budget=16, n_sink=2, recent=3, merge="mean", prefill="chunk", scoring="query")
    check_engine(cfg, 30, 60, rows=3, k_dim=16, v_dim=12, dtype=mx.float32, seed=3, queries_per_kv=3)
    assert not called and not merge_ops.kernels_pass_probe()
