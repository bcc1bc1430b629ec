"""The MLX merge engine (camkv.backends.merge_ops) against the reference, tie-aware as
docs/algorithm.md section 8 says, for every merge rule; and where camkv.backends.compress
sends a compression (the engine for a chunk on a GPU, and for the rules the kernel core
lacks on every kernel backend). The engine is MLX operations, so it runs here, on the
CPU, called directly."""

from __future__ import annotations

import os
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from camkv import CaMConfig, CaMKVCache, gate, merges, reference
from camkv.backends import compress, drop, ext, jit, merge_ops
from camkv.rows import RowState
from test_amortized import RTOL, near_tie_flips

import dtype_logits

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
_MANTISSA = {mx.float32: 23, mx.float16: 10, mx.bfloat16: 7}
MERGING = tuple(name for name in merges.names() if merges.rule(name).kind != merges.DROP)
COSINE_TIE = 1e-3  # section 8: a loser's two best cosines closer than this may pick either
DECISION_TIE = 1e-4  # a gate draw or d2o threshold this close to its bound may fall either way
# (scores and cosines agree to float32 rounding, not bit for bit, between the two)

pytestmark = pytest.mark.filterwarnings("ignore::camkv.VotesWarning")


@pytest.fixture(autouse=True)
def _dtype_logits_on_request(monkeypatch):
    """CAMKV_EMULATE_CUDA_LOGITS=1: the engine scores as on an NVIDIA GPU (tests/dtype_logits.py)."""
    if dtype_logits.EMULATE:
        dtype_logits.emulate(monkeypatch)


def _ulp(scale: np.ndarray, dtype) -> np.ndarray:
    return np.exp2(np.floor(np.log2(np.maximum(scale, 1e-30))) - _MANTISSA[dtype])


def _random(rng, shape, dtype=mx.float32):
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


def _calls(cfg, first: int, s_len: int, rows, k_dim, v_dim, dtype, seed, queries_per_kv):
    """Two chunk calls' inputs: the first builds a state (compressed, with its votes and
    threshold where the rule keeps them) the second compresses from."""
    rng = np.random.default_rng(seed)
    calls = []
    for offset, size in ((0, first), (first, s_len)):
        queries = _random(rng, (rows, size, queries_per_kv, k_dim)) if queries_per_kv else None
        calls.append((_random(rng, (rows, size, k_dim), dtype), _random(rng, (rows, size, v_dim), dtype), offset,
                      queries, 0.35 if queries_per_kv else None))
    return calls


def _undecided(cfg, joined: RowState, kept, row: int, r_id: int, threshold, widen: float = 0.0
               ) -> tuple[list, list]:
    """For one row of a compression (joined: every row before it, scored): each loser's
    candidate targets (positions) and whether its merge is a near-tie decision (its
    cosines within COSINE_TIE, its gate draw or its d2o cosine within DECISION_TIE of the
    bound; a gate's probability, a ratio of two scores, moves by twice their widened rtol
    `widen` too). Float64 from the joined state."""
    rule = merges.rule(cfg.merge)
    positions = np.array(joined.positions[row]).tolist()
    keys = np.array(joined.keys[row].astype(mx.float32)).astype(np.float64)
    scores = np.array(joined.scores[row]).astype(np.float64)
    kept_set = set(np.array(kept).tolist())
    survivors = [j for j, p in enumerate(positions) if p in kept_set]
    candidates, undecided = [], []
    for e, p in enumerate(positions):
        if p in kept_set:
            continue
        if rule.kind == merges.WINDOW:
            chosen = [j for j in survivors if j > e][: cfg.window]
            s_target = scores[chosen].mean() if chosen else 0.0
            cos = None
            tied = False
        else:
            eligible = [j for j in survivors if positions[j] >= cfg.n_sink]
            k = keys[eligible]
            cos_all = k @ keys[e] / np.maximum(np.linalg.norm(k, axis=1) * np.linalg.norm(keys[e]), 1e-12)
            best = cos_all.max()
            chosen = [j for j, c in zip(eligible, cos_all) if c >= best - COSINE_TIE]
            s_target, cos, tied = scores[chosen[0]], best, len(chosen) > 1
        if cfg.gate:
            s_e = scores[e]
            prob = min(max(s_e / s_target, 0.0), 1.0) if s_target > 0 else (1.0 if s_e > 0 else 0.0)
            draw = float(gate.uniform(cfg.seed, r_id, p).item())
            tied = tied or abs(draw - prob) < DECISION_TIE * max(1.0, prob) + 2 * widen * prob
        if rule.moving_threshold and threshold is not None:
            tied = tied or abs(cos - threshold) < DECISION_TIE
        candidates.append([positions[j] for j in chosen])
        undecided.append(tied)
    return candidates, undecided


def check_engine(cfg, first, s_len, *, rows, k_dim, v_dim, dtype, seed, queries_per_kv=0) -> dict:
    """Both calls by the engine and by the reference; the second's results compared
    tie-aware. Returns what it saw (kept-set flips, rows left out, most losers a target took)."""
    calls = _calls(cfg, first, s_len, rows, k_dim, v_dim, dtype, seed, queries_per_kv)
    row_ids = mx.arange(rows).astype(mx.uint32) + 3
    empty = RowState.empty(rows, k_dim, v_dim, dtype)
    with mx.stream(mx.cpu):
        start, _ = reference.update(empty, *calls[0][:3], cfg, row_ids, *calls[0][3:])
        want, want_merged = reference.update(start, *calls[1][:3], cfg, row_ids, *calls[1][3:])
        joined, _ = reference.update(start, *calls[1][:3], cfg.replace(budget=start.length + s_len + 1, n_sink=0,
                                                                          recent=1), row_ids, *calls[1][3:])
    got, got_merged = merge_ops.update(start, *calls[1][:3], cfg, row_ids, *calls[1][3:])
    mx.eval(got, got_merged, want, want_merged, joined)
    context = f"seed={seed} cfg={cfg.to_json()} first={first} s_len={s_len} rows={rows} dims={k_dim},{v_dim}"
    assert got.keys.shape == want.keys.shape and got.keys.dtype == want.keys.dtype, context
    p_last = first + s_len - 1
    protected = (joined.positions < cfg.n_sink) | (joined.positions > p_last - cfg.recent)
    n_losers = joined.length - want.length
    seen = dict(flips=0, left_out=0, most=0)
    if n_losers <= 0:
        np.testing.assert_array_equal(np.array(got.positions), np.array(want.positions), err_msg=context)
        return seen
    widen = _widening(cfg, joined, calls[1])
    seen["flips"] = near_tie_flips(got, want, joined.scores, joined.positions, n_losers, protected, RTOL + widen)
    if seen["flips"]:
        return seen  # another kept set: its merges differ by design (section 8)
    np.testing.assert_array_equal(np.array(got.positions), np.array(want.positions), err_msg=context)
    compare = np.ones(np.array(want.positions).shape, bool)
    for r in range(rows):
        kept = np.array(want.positions[r])
        threshold = None if want.threshold is None else float(want.threshold[r])
        candidates, undecided = _undecided(cfg, joined, kept, r, r + 3, threshold, widen)
        counts = {}
        for chosen in candidates:
            for p in chosen[:1] if merges.rule(cfg.merge).kind == merges.NEAREST else chosen:
                counts[p] = counts.get(p, 0) + 1
        seen["most"] = max([seen["most"], *counts.values()])
        for chosen, tied in zip(candidates, undecided):
            if tied:
                compare[r] &= ~np.isin(kept, chosen)
        assert abs(int(got_merged[r]) - int(want_merged[r])) <= sum(undecided), f"{context}: merges of row {r}"
    seen["left_out"] = int((~compare).sum())
    _assert_close(got, want, compare, cfg, 1 + seen["most"], context, widen)
    return seen


def _widening(cfg, joined: RowState, call) -> float:
    """What the engine's dtype-level logits add to the scores' rtol in this compression
    (tests/dtype_logits.py; 0 on the CPU). keepkv's too: its votes' bias joins logits of
    the keys' dtype there."""
    new_keys, _, _, queries, scale = call
    queries, scale = dtype_logits.scoring_inputs(new_keys, queries, scale)
    return dtype_logits.widening(queries, joined.keys, scale, joined.keys.dtype)


def _assert_close(got: RowState, want: RowState, compare, cfg, terms: int, context: str, widen: float = 0.0
                  ) -> None:
    """Scores rtol 1e-4 (+ widen, dtype-level logits'); votes within float32 rounding;
    thresholds within the cosines' float32 disagreement; keys and values within one ulp
    of the storage dtype at the row's scale, plus `terms` float32 ulps (a target's sum in
    another order), plus 1e-5 + 2 widen of the scale for shares that are scores or masses
    (a weighted mean whose weights are off by rtol e moves by at most 2 e of its
    operands' scale)."""
    rule = merges.rule(cfg.merge)
    np.testing.assert_allclose(np.array(got.scores)[compare], np.array(want.scores)[compare], rtol=1e-4 + widen,
                               atol=1e-6,
                               err_msg=f"{context}: scores")
    if want.votes is not None:
        np.testing.assert_allclose(np.array(got.votes)[compare], np.array(want.votes)[compare], rtol=1e-6,
                                   err_msg=f"{context}: votes")
    if want.threshold is not None:
        np.testing.assert_allclose(np.array(got.threshold), np.array(want.threshold), rtol=1e-4, atol=1e-5,
                                   err_msg=f"{context}: threshold")
    for name in ("values", "keys"):
        g = np.array(getattr(got, name).astype(mx.float32))
        w = np.array(getattr(want, name).astype(mx.float32))
        if name == "keys" and not (cfg.merge_keys or rule.keeps_votes):
            np.testing.assert_array_equal(g, w, err_msg=f"{context}: keys change only with merge_keys")
            continue
        scale = np.maximum(np.abs(g).max(axis=-1, keepdims=True), np.abs(w).max(axis=-1, keepdims=True))
        limit = _ulp(scale, want.keys.dtype) + terms * _ulp(scale, mx.float32)
        if rule.blends and drop.on_cuda():
            # Cosine shares from MLX's CUDA products, float32 as three TF32 products (about
            # 2^-21 relative each, camkv.mass.float32_product): a weighted mean moves by twice that.
            limit = limit + 2 * 2.0**-20 * scale
        if rule.weight_uses_mass:
            limit = limit + (1e-5 + 2 * widen) * scale
        bad = np.argwhere((np.abs(g - w) > limit) & compare[:, :, None])
        assert bad.size == 0, (f"{context}: {name} differ at {bad[:5].tolist()}: got {g[tuple(bad[0])]} "
                               f"want {w[tuple(bad[0])]}")


# ---------------------------------------------------------------- fixed cases, every rule


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("merge", MERGING)
def test_the_engine_matches_the_reference_where_targets_take_several_losers(merge, dtype):
    """A 60-token chunk after a compressed prompt into a budget of 16: about 56 losers for
    at most 13 non-sink survivors, so targets take several at once; gate on, query
    scoring with 3 queries per KV head, merge_keys where the rule allows it."""
    cfg = CaMConfig(budget=16, n_sink=2, recent=3, merge=merge, window=3, prefill="chunk", gate=True, seed=5,
                    scoring="query", merge_keys=merges.rule(merge).keys_allowed)
    seen = check_engine(cfg, 30, 60, rows=3, k_dim=16, v_dim=12, dtype=DTYPES[dtype], seed=3, queries_per_kv=3)
    print(f"{merge} {dtype}: {seen}")
    assert seen["flips"] or seen["most"] >= 3, seen


def _share_off_by_one_percent(monkeypatch):
    real = merge_ops._Edges.blend
    monkeypatch.setattr(merge_ops._Edges, "blend",
                        lambda self, pairs, share_in, share_t, *extra: real(self, pairs, share_in * 1.01, share_t,
                                                                             *extra))


def _gate_keyed_by_the_next_row(monkeypatch):
    monkeypatch.setattr(merge_ops, "gate", SimpleNamespace(
        uniform=lambda seed, row_ids, positions: gate.uniform(seed, row_ids + 1, positions),
        probability=gate.probability))


@pytest.mark.parametrize("defect", [_share_off_by_one_percent, _gate_keyed_by_the_next_row])
@pytest.mark.parametrize("merge", ["mean", "d2o"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_widened_tolerance_still_catches_a_defect(merge, dtype, defect, monkeypatch):
    """With logits in the keys' dtype (as on an NVIDIA GPU, emulated here) the fixed case
    passes under the widened tolerance, and fails once the engine gives each loser 1% too
    much share or keys its gate draws by the wrong row."""
    dtype_logits.emulate(monkeypatch)
    cfg = CaMConfig(budget=16, n_sink=2, recent=3, merge=merge, window=3, prefill="chunk", gate=True, seed=5,
                    scoring="query", merge_keys=True)
    case = dict(rows=3, k_dim=16, v_dim=12, dtype=DTYPES[dtype], seed=3, queries_per_kv=3)
    seen = check_engine(cfg, 30, 60, **case)
    assert not seen["flips"], seen
    defect(monkeypatch)
    with pytest.raises(AssertionError):
        check_engine(cfg, 30, 60, **case)


STATEFUL = tuple(r.name for r in merges.RULES if r.keeps_votes or r.moving_threshold)


@pytest.mark.parametrize("merge", STATEFUL)
@pytest.mark.parametrize("prefill", ["exact", "chunk"])
def test_the_engine_carries_votes_and_thresholds_over_many_calls(merge, prefill):
    """The stateful rules over a prompt and decode steps, the engine's state fed back to
    it, against the reference's: votes sum to the tokens seen (keepkv, gate off), the
    threshold moves, and the two stay within section 8's tolerances."""
    cfg = CaMConfig(budget=12, n_sink=2, recent=3, merge=merge, gate=False, prefill=prefill,
                    slack=0, scoring="query")
    rng = np.random.default_rng(8)
    rows, row_ids = 2, mx.arange(2).astype(mx.uint32)
    ours = theirs = RowState.empty(rows, 8, 6, mx.float32)
    offset = 0
    for size in (20, 1, 1, 1, 7, 1, 1):
        k, v, q = _random(rng, (rows, size, 8)), _random(rng, (rows, size, 6)), _random(rng, (rows, size, 2, 8))
        ours, _ = merge_ops.update(ours, k, v, offset, cfg, row_ids, q, 0.35)
        theirs, _ = reference.update(theirs, k, v, offset, cfg, row_ids, q, 0.35)
        offset += size
    np.testing.assert_array_equal(np.array(ours.positions), np.array(theirs.positions))
    np.testing.assert_allclose(np.array(ours.values), np.array(theirs.values), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.array(ours.keys), np.array(theirs.keys), rtol=1e-4, atol=1e-5)
    if merge == "keepkv":
        np.testing.assert_array_equal(np.array(ours.votes.sum(axis=1)), [offset] * rows)
        np.testing.assert_array_equal(np.array(ours.votes), np.array(theirs.votes))
    else:
        assert np.isfinite(np.array(ours.threshold)).all()
        np.testing.assert_allclose(np.array(ours.threshold), np.array(theirs.threshold), rtol=1e-5)


# ---------------------------------------------------------------- fuzz


@st.composite
def engine_cases(draw):
    merge = draw(st.sampled_from(MERGING))
    n_sink, recent = draw(st.integers(0, 2)), draw(st.integers(1, 4))
    budget = n_sink + recent + draw(st.integers(1, 10))
    cfg = CaMConfig(budget=budget, n_sink=n_sink, recent=recent, merge=merge, window=draw(st.integers(1, 4)),
                    merge_keys=merges.rule(merge).keys_allowed and draw(st.booleans()), gate=draw(st.booleans()),
                    seed=draw(st.integers(0, 2**32 - 1)), prefill="chunk", prefill_scoring="causal",
                    eviction=draw(st.sampled_from(["score", "score", "recency"])))
    first = draw(st.integers(1, 3 * budget))
    s_len = draw(st.integers(2, 4 * budget))
    shape = dict(rows=draw(st.integers(1, 3)), k_dim=draw(st.integers(1, 24)), v_dim=draw(st.integers(1, 24)),
                 dtype=DTYPES[draw(st.sampled_from(sorted(DTYPES)))], seed=draw(st.integers(0, 2**31 - 1)),
                 queries_per_kv=draw(st.sampled_from([0, 1, 3])))
    return cfg, first, s_len, shape


def check_engine_case(case) -> dict:
    """check_engine on one of engine_cases (query scoring where the case has queries), its
    seed and settings noted."""
    cfg, first, s_len, shape = case
    if shape["queries_per_kv"]:
        cfg = cfg.replace(scoring="query")
    note(f"seed={shape['seed']} cfg={cfg.to_json()} first={first} s_len={s_len} shape={shape}")
    return check_engine(cfg, first, s_len, **shape)


ENGINE_EXAMPLES = int(os.environ.get("CAMKV_FUZZ_EXAMPLES", "300")) // 3


def test_the_engine_fuzz_matches_the_reference():
    """Random rules, shapes, dtypes, chunkings and seeds (each example notes its seed)."""
    several = []

    @settings(max_examples=ENGINE_EXAMPLES, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large], print_blob=True)
    @given(engine_cases())
    def run(case):
        seen = check_engine_case(case)
        note(f"seen: {seen}")
        several.append(seen["most"] >= 2)

    run()
    print(f"examples with a target taking several losers: {sum(several)} of {len(several)}")
    assert sum(several) >= len(several) // 3, "many examples must give some target several losers"


# ---------------------------------------------------------------- routing


class _GPUStandIn:
    """A kernel backend as compress.py sees a GPU one (it has a target)."""

    target = "cuda"
    __name__ = "camkv.backends.cuda"


@pytest.mark.parametrize("merge", merges.names())
def test_compressions_go_to_the_engine_on_a_gpu_and_to_the_kernel_core_elsewhere(merge):
    """Every rule, its state carried or not, is routed alike."""
    chunk, exact = CaMConfig(merge=merge, budget=16), CaMConfig(merge=merge, budget=16, prefill="exact")
    assert compress.by_operations(_GPUStandIn(), chunk, 40, 16)  # a chunk on a GPU: MLX operations
    assert not compress.by_operations(_GPUStandIn(), chunk, 17, 16)  # a decode step: the kernel
    assert not compress.by_operations(ext, chunk, 40, 16)  # the CPU: the extension's one pass a row
    assert not compress.by_operations(jit.metal, chunk, 17, 16)
    assert not compress.by_operations(reference, chunk, 40, 16)  # the reference is the reference
    assert not compress.by_operations(_GPUStandIn(), exact, 40, 16)  # exact mode: the backend's own update
    # A decode compression (slack + 1 = 3 pending tokens): a merging rule's in the kernel
    # core, but dropping's (its own engines) and a rule marked decodes_on_engine's (keepkv).
    rule = merges.rule(merge)
    on_engine = rule.kind == merges.DROP or rule.decodes_on_engine
    assert compress.by_operations(_GPUStandIn(), chunk, 16 + chunk.slack + 1, 16) == on_engine
    assert compress.by_operations(_GPUStandIn(), chunk, 16 + chunk.slack + 2, 16)  # one more: a prompt chunk


def test_only_keepkv_decodes_on_the_engine():
    """The registry's one rule whose decode compressions stay on the MLX engine on a GPU
    (its kernel core pass measured slower there: bench/merge_speed.py keepkv/core)."""
    assert merges.names(decodes_on_engine=True) == ("keepkv",)


def test_chunks_below_the_operations_threshold_run_in_the_kernel_core(monkeypatch):
    """With OPERATIONS_FROM_TOKENS raised (the benchmarks' RULE/core arms), a GPU chunk of
    fewer pending tokens goes to the backend's update, a longer one stays on the engine."""
    chunk = CaMConfig(budget=16, merge="mean", prefill="chunk", scoring="query")
    monkeypatch.setattr(compress, "OPERATIONS_FROM_TOKENS", 10)
    assert not compress.by_operations(_GPUStandIn(), chunk, 25, 16)  # 9 pending tokens
    assert compress.by_operations(_GPUStandIn(), chunk, 26, 16)  # 10


@pytest.mark.skipif(ext.unavailable_reason() is not None, reason="needs the extension")
@pytest.mark.parametrize("backend", ["auto", "ext"])
@pytest.mark.parametrize("merge", STATEFUL)
def test_a_cache_on_the_ext_backend_runs_a_rule_with_state_by_the_kernel_core(merge, backend, monkeypatch):
    """backend="ext" (or "auto", which picks it on the CPU) with keepkv or d2o runs its
    compressions by the kernel core, not the engine, its votes or threshold carried
    through the cache's rows: a prompt and decode steps give the reference backend's rows."""
    calls = []
    real = ext._ext.update
    monkeypatch.setattr(merge_ops, "compress", lambda *a, **k: pytest.fail("the engine ran"))
    monkeypatch.setattr(ext._ext, "update", lambda *a, **k: calls.append(1) or real(*a, **k))
    rng = np.random.default_rng(9)
    blocks = [(_random(rng, (1, 2, s, 8)), _random(rng, (1, 2, s, 6))) for s in (30, 1, 1, 1, 1, 1, 1)]
    caches = {}
    for name in (backend, "reference"):
        cache = CaMKVCache(CaMConfig(budget=12, n_sink=2, recent=3, slack=2, scoring="key", merge=merge,
                                     backend=name))
        for keys, values in blocks:
            cache.update_and_fetch(keys, values)
        caches[name] = cache.stored()
        caches[name] += tuple(a for a in cache._rule_state() if a is not None)
        if name == backend:
            assert calls, f"backend {backend!r}'s compressions did not run the kernel core"
    assert len(caches[backend]) == len(caches["reference"]) == 5  # the rows, and the rule's state
    for got, want in zip(caches[backend], caches["reference"]):
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-5)



@pytest.mark.parametrize("update", [reference.update, merge_ops.update], ids=["reference", "engine"])
def test_a_loser_between_two_equally_near_survivors_merges_into_the_older(update):
    """Section 4.1's tie rule, which section 8's tolerance cannot see: K_2 and K_3 point
    exactly the way the loser's K_1 does; "mean" makes V_2 the mean of V_1 and V_2."""
    keys = mx.array([[[1, 0], [0, 1], [0, 2], [0, 3]]], mx.float32)
    values = mx.array([[[0, 0], [4, 4], [2, 0], [0, 2]]], mx.float32)
    state = RowState(keys, values, mx.array([[5.0, 0.01, 5.0, 5.0]]), mx.arange(4, dtype=mx.int32)[None])
    cfg = CaMConfig(budget=4, n_sink=0, recent=1, merge="mean", gate=False, prefill="chunk", scoring="key")
    out, merged = update(state, mx.array([[[1.0, 0.0]]]), mx.zeros((1, 1, 2)), 4, cfg, mx.zeros((1,), mx.uint32))
    assert merged.tolist() == [1] and out.positions.tolist() == [[0, 2, 3, 4]]
    assert out.values[0, 1:3].tolist() == [[3, 2], [0, 2]]


def _kernel_core_update(*args):
    if ext.unavailable_reason() is not None:
        pytest.skip(ext.unavailable_reason())
    return ext.update(*args)


@pytest.mark.parametrize("update", [merge_ops.update, _kernel_core_update], ids=["engine", "kernel-core"])
@pytest.mark.parametrize("merge", MERGING)
def test_a_poisoned_key_or_query_spreads_no_nan_and_both_agree(merge, update):
    """Section 2's poisoned inputs in a compression: a NaN key (no mass, evicted, no finite
    cosine, so no nearest survivor: it merges nowhere) and a query with an infinite
    feature (its logits not finite: keepkv's shares fall back to the votes and its keys
    to K'). The engine (and the kernel core) and the reference keep the same rows, and
    no NaN reaches them."""
    rng = np.random.default_rng(1)
    rows = 2
    keys = rng.standard_normal((rows, 20, 4)).astype(np.float32)
    keys[0, 5] = np.nan
    queries = rng.standard_normal((rows, 20, 1, 4)).astype(np.float32)
    queries[1, -1, 0, 0] = np.inf
    values = rng.standard_normal((rows, 20, 3)).astype(np.float32)
    cfg = CaMConfig(budget=8, n_sink=1, recent=2, merge=merge, gate=False, prefill="chunk", scoring="query")
    args = (RowState.empty(rows, 4, 3, mx.float32), mx.array(keys), mx.array(values), 0, cfg,
            mx.arange(rows).astype(mx.uint32), mx.array(queries), 0.5)
    want, want_merged = reference.update(*args)
    got, got_merged = update(*args)
    assert 5 not in np.array(want.positions[0]).tolist()
    assert got_merged.tolist() == want_merged.tolist()
    np.testing.assert_array_equal(np.array(got.positions), np.array(want.positions))
    for a, b in ((got.values, want.values), (got.keys, want.keys)):
        assert np.isfinite(np.array(a)).all() and np.isfinite(np.array(b)).all()
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-6)
    for a, b in ((got.votes, want.votes), (got.threshold, want.threshold)):  # the rule's state, where it keeps one
        assert (a is None) == (b is None)
        if a is not None:
            np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, equal_nan=True)


def _producer(a: mx.array) -> str:
    """The primitive that makes a (the last node of its graph as MLX draws it), or "input"."""
    import io
    import re

    text = io.StringIO()
    mx.export_to_dot(text, a)
    labels = re.findall(r'label ="([A-Za-z]+)"', text.getvalue())
    return labels[-1] if labels else "input"


@pytest.mark.parametrize("rule", ["mean", "value_norm", "d2o", "keepkv", "window"])
def test_the_merge_kernels_take_no_sliced_rows(rule, monkeypatch):
    """On CUDA, MLX copies a strided input of a custom kernel into a contiguous one before
    the launch: the losers' and survivors' rows a compression's kernels read are arrays of
    their own (merge_cuda.gather_rows), not slices of joined rows (twelve copies a
    compression of mean, counted on an H100, before). The kernels stood in for: each call
    records what makes each of its inputs."""
    from camkv.backends import compact_cuda, mass_cuda, merge_cuda

    made: list[tuple[str, int, str]] = []

    def recording_kernel(name, **_spec):
        def call(inputs, output_shapes, output_dtypes, **_launch):
            made.extend((name, i, _producer(a)) for i, a in enumerate(inputs) if isinstance(a, mx.array) and a.size > 1)
            return [mx.zeros(shape, dtype) for shape, dtype in zip(output_shapes, output_dtypes)]
        return call

    monkeypatch.setattr(mx.fast, "cuda_kernel", recording_kernel)
    monkeypatch.setattr(drop, "on_cuda", lambda: True)
    monkeypatch.setattr(merge_cuda, "available", lambda: True)
    for module in (merge_cuda, compact_cuda, mass_cuda):
        monkeypatch.setattr(module, "_kernels", {})
    monkeypatch.setattr(merge_ops, "_probe", {"failure": None})
    monkeypatch.setattr(merge_ops, "FENCE_NEAREST_PRODUCT", False)
    rng = np.random.default_rng(0)
    R, n, s_len, D = 2, 48, 80, 16
    keys, values = (mx.array(rng.standard_normal((R, n + s_len, D)).astype(np.float32)).astype(mx.bfloat16)
                    for _ in range(2))
    cfg = CaMConfig(budget=n, merge=rule, scoring="query")
    votes = mx.ones((R, n), mx.float32) if merges.rule(rule).keeps_votes else None
    settled = merge_ops.Settled(mx.array(rng.random((R, n)).astype(np.float32)),
                                mx.broadcast_to(mx.arange(n, dtype=mx.int32), (R, n)), votes)
    queries = mx.array(rng.standard_normal((R, 2, cfg.observation_window, D)).astype(np.float32))
    merge_ops.compress(keys, values, settled, queries, n, D ** -0.5, cfg, mx.arange(R).astype(mx.uint32),
                       kernels=True)
    assert any("gather" in name for name, _, _ in made), made  # the kernels' way ran
    assert not [entry for entry in made if entry[2] == "Slice"], made
