"""Every backend against the reference, per docs/algorithm.md section 8.

positions, n, kept rows and merge counts exactly; with merge="drop" keys and values
bit for bit; scores within rtol 1e-4 / atol 1e-6; blended keys and values within one
unit in the last place of the storage dtype (plus, for the mass-weighted modes, what
the scores' own float32 disagreement does to their blend weights). Parametrised by the `backend` fixture
(tests/conftest.py), which skips a backend that is not usable here with its reason.
"""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from camkv import CaMConfig, backends, merges, reference
from camkv.config import MERGE_MODES
from camkv.rows import RowState

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
_MANTISSA_BITS = {mx.float32: 23, mx.float16: 10, mx.bfloat16: 7}
# Smallest normal exponent of each dtype: below it the spacing stops shrinking.
_MIN_EXPONENT = {mx.float32: -126, mx.float16: -14, mx.bfloat16: -126}


def ulp(x: np.ndarray, dtype) -> np.ndarray:
    """One unit in the last place of the storage dtype at magnitude |x|."""
    magnitude = np.maximum(np.abs(x), np.finfo(np.float32).tiny)
    exponent = np.maximum(np.floor(np.log2(magnitude)), _MIN_EXPONENT[dtype])
    return np.exp2(exponent - _MANTISSA_BITS[dtype])


def _np(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32) if a.dtype in (mx.float16, mx.bfloat16) else a)


# Rules whose blend weight is a ratio of scores, like s_e / (s_e + s_t). Scores agree between
# backends only to a few float32 ulps (exp and summation order differ; section 8 allows
# rtol 1e-4), and w inherits that, so these blends get a relative allowance on top of
# the ulp: 1e-5 of the row's scale, 20x what was seen (about 5e-7) and far below
# the error of any wrong weight.
MASS_MODES = merges.names(weight_uses_mass=True)
MASS_WEIGHT_RTOL = 1e-5


def assert_rows_match(name: str, got: mx.array, want: mx.array, exact: bool, context: str,
                      weight_rtol: float = 0.0) -> None:
    g, w = _np(got), _np(want)
    if exact:
        bad = np.argwhere(g != w)
        assert bad.size == 0, f"{context}: {name} differ bit-wise at {bad[:5].tolist()}"
        return
    # A blend (1 - w) V_t + w V_e is computed at the scale of its operands, and w itself
    # (a cosine) may differ in its last float32 bits between backends (summation order),
    # so one ulp is measured at the magnitude of the row, not of the (possibly
    # cancelled) result: the largest |entry| of that row on either side.
    row_scale = np.maximum(np.abs(g).max(axis=-1, keepdims=True), np.abs(w).max(axis=-1, keepdims=True))
    limit = ulp(np.broadcast_to(row_scale, g.shape), want.dtype) + weight_rtol * row_scale
    bad = np.argwhere(np.abs(g - w) > limit)
    assert bad.size == 0, (
        f"{context}: {name} differ by more than one ulp at {bad[:5].tolist()}: "
        f"got {g[tuple(bad[0])]} want {w[tuple(bad[0])]}"
    )


def assert_states_match(got, want, cfg: CaMConfig, context: str) -> None:
    (g_state, g_merges), (w_state, w_merges) = got, want
    assert g_state.keys.shape == w_state.keys.shape, f"{context}: shapes {g_state.keys.shape} vs {w_state.keys.shape}"
    assert g_state.values.shape == w_state.values.shape, f"{context}: value shapes differ"
    assert g_state.keys.dtype == w_state.keys.dtype, f"{context}: dtype {g_state.keys.dtype} vs {w_state.keys.dtype}"
    np.testing.assert_array_equal(np.array(g_state.positions), np.array(w_state.positions), err_msg=f"{context}: positions")
    for i, (gm, wm) in enumerate(zip(g_merges, w_merges)):
        np.testing.assert_array_equal(np.array(gm), np.array(wm), err_msg=f"{context}: merges of call {i}")
    np.testing.assert_allclose(
        np.array(g_state.scores), np.array(w_state.scores), rtol=1e-4, atol=1e-6, err_msg=f"{context}: scores"
    )
    exact = cfg.merge == "drop"
    rtol = MASS_WEIGHT_RTOL if cfg.merge in MASS_MODES else 0.0
    assert_rows_match("values", g_state.values, w_state.values, exact, context, rtol)
    assert_rows_match("keys", g_state.keys, w_state.keys, exact or not cfg.merge_keys, context, rtol)


def feed(update, cfg, sizes, *, rows, k_dim, v_dim, dtype, seed, queries_per_kv=0, row_base=0, keys_at=None):
    """Run calls of the given sizes through `update`; distinct random keys avoid near-ties.
    keys_at(tokens): the keys [rows, len(tokens), k_dim] float32 of the tokens at those
    positions, instead of random ones."""
    rng = np.random.default_rng(seed)
    state = RowState.empty(rows, k_dim, v_dim, dtype)
    row_ids = (mx.arange(rows) + row_base).astype(mx.uint32)
    offset, merges = 0, []
    for s_len in sizes:
        if keys_at is None:
            keys = mx.array(rng.standard_normal((rows, s_len, k_dim)).astype(np.float32)).astype(dtype)
        else:
            keys = mx.array(keys_at(np.arange(offset, offset + s_len))).astype(dtype)
        values = mx.array(rng.standard_normal((rows, s_len, v_dim)).astype(np.float32)).astype(dtype)
        queries, scale = None, None
        if queries_per_kv:
            shape = (rows, s_len, queries_per_kv, k_dim)
            queries = mx.array(rng.standard_normal(shape).astype(np.float32))
            scale = float(rng.uniform(0.1, 0.6))
        state, merged = update(state, keys, values, offset, cfg, row_ids, queries, scale)
        mx.eval(state, merged)
        merges.append(merged)
        offset += s_len
    return state, merges


def check_backend(backend: str, cfg: CaMConfig, sizes, **shape) -> None:
    """The backend's states after each call match the reference's; a backend that does not
    run cfg's merge rule (a reference-only rule on a kernel backend) must refuse it."""
    if backend == "reference":
        pytest.skip("the reference is the oracle itself")
    context = f"backend={backend} cfg={cfg.to_json()} sizes={sizes} shape={shape}"
    if not merges.rule(cfg.merge).kernels:
        with pytest.raises(ValueError, match=f"merge='{cfg.merge}' runs on backend='reference' only"):
            feed(backends.resolve(backend).update, cfg, sizes, **shape)
        return
    got = feed(backends.resolve(backend).update, cfg, sizes, **shape)
    # The oracle runs on the CPU, whatever the default device: its dot products are
    # sums in feature order there, which every kernel (FMA-free) reproduces.
    with mx.stream(mx.cpu):
        want = feed(reference.update, cfg, sizes, **shape)
    assert_states_match(got, want, cfg, context)


# ----------------------------------------------------------------------------
# Fixed cases: every merge mode, both prefill modes, all dtypes, heavy eviction


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("prefill", ["exact", "chunk"])
@pytest.mark.parametrize("merge", MERGE_MODES)
def test_merge_modes_match_reference(backend, merge, prefill, dtype):
    cfg = CaMConfig(budget=12, n_sink=2, recent=3, merge=merge, window=3, prefill=prefill, seed=7)
    check_backend(backend, cfg, [5, 9, 1, 1, 14, 1, 3], rows=4, k_dim=16, v_dim=10, dtype=DTYPES[dtype], seed=1)


@pytest.mark.parametrize("merge", merges.names(keys_allowed=True))
def test_merge_keys_match_reference(backend, merge):
    cfg = CaMConfig(budget=10, n_sink=1, recent=2, merge=merge, merge_keys=True, prefill="chunk", gate=False)
    check_backend(backend, cfg, [8, 7, 1, 9, 1], rows=3, k_dim=12, v_dim=12, dtype=mx.float16, seed=2)


@pytest.mark.parametrize("prefill", ["exact", "chunk"])
def test_query_scoring_matches_reference(backend, prefill):
    cfg = CaMConfig(budget=16, n_sink=2, recent=4, prefill=prefill, scoring="query", seed=3)
    check_backend(
        backend, cfg, [6, 13, 1, 1, 20], rows=4, k_dim=8, v_dim=6, dtype=mx.bfloat16, seed=4, queries_per_kv=3
    )


def test_gate_off_and_long_decode_match_reference(backend):
    cfg = CaMConfig(budget=20, n_sink=4, recent=4, gate=False, prefill="exact")
    check_backend(backend, cfg, [20] + [1] * 30, rows=2, k_dim=32, v_dim=16, dtype=mx.float32, seed=5)


def test_global_row_ids_change_draws_like_reference(backend):
    cfg = CaMConfig(budget=9, n_sink=1, recent=2, seed=11)
    check_backend(backend, cfg, [9, 6, 1, 1], rows=3, k_dim=8, v_dim=8, dtype=mx.float32, seed=6, row_base=40)


# ----------------------------------------------------------------------------
# Fuzz: random shapes, configs, chunkings; >= 300 examples in total


FUZZ_EXAMPLES = int(os.environ.get("CAMKV_FUZZ_EXAMPLES", "300"))


@st.composite
def fuzz_cases(draw):
    n_sink = draw(st.integers(0, 3))
    recent = draw(st.integers(1, 4))
    budget = n_sink + recent + draw(st.integers(1, 8))
    merge = draw(st.sampled_from(merges.names(kernels=True)))  # check_backend's refusals need no fuzzing
    merge_keys = merges.rule(merge).keys_allowed and draw(st.booleans())
    cfg = CaMConfig(
        budget=budget,
        n_sink=n_sink,
        recent=recent,
        merge=merge,
        merge_keys=merge_keys,
        window=draw(st.integers(1, 4)),
        gate=draw(st.booleans()),
        seed=draw(st.integers(0, 2**32 - 1)),
        prefill=draw(st.sampled_from(["exact", "chunk"])),
    )
    sizes = draw(st.lists(st.integers(1, 2 * budget), min_size=1, max_size=5))
    shape = dict(
        rows=draw(st.integers(1, 4)),
        k_dim=draw(st.integers(1, 20)),
        v_dim=draw(st.integers(1, 20)),
        dtype=DTYPES[draw(st.sampled_from(sorted(DTYPES)))],
        seed=draw(st.integers(0, 2**31 - 1)),
        queries_per_kv=draw(st.sampled_from([0, 0, 1, 2, 4])),
    )
    return cfg, sizes, shape


def test_fuzz_matches_reference(backend):
    if backend == "reference":
        pytest.skip("the reference is the oracle itself")
    examples = []

    @settings(
        max_examples=FUZZ_EXAMPLES,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        print_blob=True,
    )
    @given(fuzz_cases())
    def run(case):
        examples.append(case)
        cfg, sizes, shape = case
        if shape["queries_per_kv"]:
            cfg = cfg.replace(scoring="query")
        note(f"cfg={cfg.to_json()} sizes={sizes} shape={shape}")
        check_backend(backend, cfg, sizes, **shape)

    run()
    assert len(examples) >= FUZZ_EXAMPLES, f"hypothesis ran only {len(examples)} examples"
