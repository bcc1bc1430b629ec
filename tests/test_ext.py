"""camkv._ext called directly with real mx.arrays: results, in-place updates, bad input."""

from __future__ import annotations

import math
import struct
import warnings

import mlx.core as mx
import numpy as np
import pytest

from camkv import CaMConfig, CaMKVCache, backends, reference
from camkv.backends import ext, params
from camkv.rows import RowState

pytestmark = pytest.mark.skipif(ext.unavailable_reason() is not None, reason=str(ext.unavailable_reason()))


def _full_state(rows, n, k_dim, v_dim, dtype, seed=0):
    rng = np.random.default_rng(seed)
    keys = mx.array(rng.standard_normal((rows, n, k_dim)).astype(np.float32)).astype(dtype)
    values = mx.array(rng.standard_normal((rows, n, v_dim)).astype(np.float32)).astype(dtype)
    scores = mx.array(rng.uniform(0.0, 2.0, (rows, n)).astype(np.float32))
    positions = mx.broadcast_to(mx.arange(n, dtype=mx.int32), (rows, n)) + 0
    state = RowState(keys, values, scores, positions)
    mx.eval(state)
    return state


_CFG = CaMConfig(budget=8, n_sink=1, recent=2, window=2, merge="sim_weighted", gate=True, prefill="chunk", seed=0)


def _call(state, new_keys, new_values, cfg=_CFG, offset=None, scale=0.25, params=None, chunk_mass=None):
    """_ext.update with the parameter block ext.update would pack (or the given one)."""
    offset = state.length if offset is None else offset
    if params is None:
        params = ext.call_params(state, new_keys, new_values, offset, cfg, None, scale, chunk_mass is not None)
    rows = state.keys.shape[0]
    return ext._ext.update(state.keys, state.values, state.scores, state.positions, new_keys, new_values,
                           mx.arange(rows).astype(mx.uint32), params=params, chunk_mass=chunk_mass)[:5]


def test_extension_runs_on_mx_arrays_and_matches_reference():
    state = _full_state(3, 8, 16, 12, mx.float16)
    new_keys = mx.random.normal((3, 1, 16), key=mx.random.key(1)).astype(mx.float16)
    new_values = mx.random.normal((3, 1, 12), key=mx.random.key(2)).astype(mx.float16)
    keys, values, scores, positions, merges = _call(state, new_keys, new_values, scale=1 / math.sqrt(16))
    mx.eval(keys, values, scores, positions, merges)
    assert keys.shape == (3, 8, 16) and values.shape == (3, 8, 12) and merges.dtype == mx.int32
    cfg = CaMConfig(budget=8, n_sink=1, recent=2, window=2, gate=True, merge="sim_weighted")
    want, want_merges = reference.update(state, new_keys, new_values, 8, cfg, mx.arange(3).astype(mx.uint32))
    np.testing.assert_array_equal(np.array(positions), np.array(want.positions))
    np.testing.assert_array_equal(np.array(merges), np.array(want_merges))
    np.testing.assert_allclose(np.array(scores), np.array(want.scores), rtol=1e-4, atol=1e-6)


def _address(a: mx.array) -> int:
    """Where a's data lives (the numpy view is dropped at once so it holds nothing)."""
    view = np.asarray(a)
    address = view.__array_interface__["data"][0]
    del view
    return address


def _decode(state, keep_old: bool, steps: int = 6):
    """Full-budget decode steps; keep_old holds the previous state so it cannot be donated.

    Returns the final state, the held states and, per step after the first, whether
    the new keys live where the previous ones did (the update ran in place).
    """
    cfg = CaMConfig(budget=state.length, n_sink=1, recent=2, prefill="exact")
    rows, k_dim = state.keys.shape[0], state.keys.shape[2]
    rng = np.random.default_rng(3)
    held, reused = [], []
    for step in range(steps):
        before = _address(state.keys)
        k = mx.array(rng.standard_normal((rows, 1, k_dim)).astype(np.float32))
        v = mx.array(rng.standard_normal((rows, 1, state.values.shape[2])).astype(np.float32))
        if keep_old:
            held.append(state)
        state, _ = ext.update(state, k, v, cfg.budget + step, cfg, mx.arange(rows).astype(mx.uint32))
        mx.eval(state)
        reused.append(_address(state.keys) == before)
    return state, held, reused[1:]


def test_donated_state_is_updated_in_place_and_matches_a_copy():
    copied, held, copied_reused = _decode(_full_state(2, 16, 8, 8, mx.float32, seed=4), keep_old=True)
    in_place, _, in_place_reused = _decode(_full_state(2, 16, 8, 8, mx.float32, seed=4), keep_old=False)
    assert all(in_place_reused), "an unshared full state should be updated inside its own buffers"
    assert not any(copied_reused), "a state someone still holds must be copied, not overwritten"
    for a, b in zip(in_place, copied):
        np.testing.assert_array_equal(np.array(a), np.array(b))
    # The held states were not clobbered by the copies made for them.
    first = _full_state(2, 16, 8, 8, mx.float32, seed=4)
    for a, b in zip(held[0], first):
        np.testing.assert_array_equal(np.array(a), np.array(b))


def _words(state, new_keys, **fields) -> bytes:
    """The block ext.update packs for a decode step on state, with fields replaced."""
    words = bytearray(ext.call_params(state, new_keys, new_keys, state.length, _CFG, None, 0.25, False))
    for name, value in fields.items():
        index = [field for field, _ in params.PARAM_FIELDS].index(name)
        words[4 * index: 4 * index + 4] = struct.pack("<i", value)
    return bytes(words)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(n=3), "params.n = 3 but the arrays give 4"),
        (dict(Dk=4), "params.Dk = 4 but the arrays give 8"),
        (dict(G=2), "params.G = 2 but the arrays give 1"),
        (dict(n_out=4), "params.n_out = 4 but the arrays give 5"),
        (dict(key_scoring=0), "params.key_scoring = 0 but the arrays give 1"),
        (dict(prescored=1), "params.prescored = 1 but the arrays give 0"),
        (dict(f32_stride=1), "params.f32_stride = 1 but the arrays give"),
        (dict(store_stride=0), "params.store_stride = 0 but the arrays give 16"),
        (dict(budget=3), "the state holds n=4 tokens; need 1 <= n <= budget, got budget=3"),
        (dict(budget=0), "got budget=0"),
    ],
)
def test_a_block_the_arrays_contradict_raises_value_error(fields, message):
    state = _full_state(2, 4, 8, 8, mx.float32)
    keys = mx.zeros((2, 1, 8))
    with pytest.raises(ValueError, match=message):
        _call(state, keys, keys, params=_words(state, keys, **fields))


@pytest.mark.parametrize("size", [0, 4 * params.WORDS - 4, 4 * params.WORDS + 4])
def test_a_block_of_the_wrong_size_raises_value_error(size):
    state = _full_state(2, 4, 8, 8, mx.float32)
    keys = mx.zeros((2, 1, 8))
    assert ext._ext.PARAMS_SIZE == 4 * params.WORDS
    with pytest.raises(ValueError, match=f"params must be struct CamParams's {params.WORDS} int32 words "
                                         rf"\({4 * params.WORDS} bytes, .*got {size} bytes"):
        _call(state, keys, keys, params=bytes(size))


def test_compile_merges_no_two_calls_whose_blocks_differ():
    """The primitive's equivalence compares the words: mx.compile may merge two calls on
    the same inputs only when every field agrees (here the offset, the one field a
    decode step changes)."""
    state = _full_state(2, 4, 8, 8, mx.float32)
    keys = mx.random.normal((2, 1, 8), key=mx.random.key(7))
    cfg = CaMConfig(budget=4, n_sink=1, recent=2, prefill="exact")

    row_ids = mx.arange(2).astype(mx.uint32)  # the same inputs in both calls, so only the blocks differ

    def step(offset):
        block = ext.call_params(state, keys, keys, offset, cfg, None, 0.25, False)
        return ext._ext.update(*state.arrays(), keys, keys, row_ids, params=block)[3]

    apart = mx.compile(lambda: mx.stack([step(9), step(10)]))()
    assert np.array(apart[0]).max() == 9 and np.array(apart[1]).max() == 10


def test_bad_shapes_and_dtypes_raise_value_error():
    state = _full_state(2, 4, 8, 8, mx.float32)
    with pytest.raises(ValueError, match="new_keys has 5 key features"):
        _call(state, mx.zeros((2, 1, 5)), mx.zeros((2, 1, 8)), params=_words(state, mx.zeros((2, 1, 8))))
    with pytest.raises(ValueError, match="new_values must have dtype equal to the keys' dtype"):
        _call(state, mx.zeros((2, 1, 8)), mx.zeros((2, 1, 8), mx.float16))
    with pytest.raises(ValueError, match="scores must be"):
        ext._ext.update(state.keys, state.values, state.scores[0], state.positions, mx.zeros((2, 1, 8)),
                        mx.zeros((2, 1, 8)), mx.arange(2).astype(mx.uint32),
                        params=_words(state, mx.zeros((2, 1, 8))))


def test_head_dimension_above_256_is_a_clear_error():
    state = RowState.empty(1, 257, 8, mx.float32)
    cfg = CaMConfig(budget=8, n_sink=1, recent=2)
    with pytest.raises(ValueError, match="Dk = 257 exceeds"):
        ext.update(state, mx.zeros((1, 1, 257)), mx.zeros((1, 1, 8)), 0, cfg, mx.arange(1).astype(mx.uint32))
    with pytest.raises(ValueError, match=r"Dv = 300 is not supported.*\[1, 256\]"):
        _call(RowState.empty(1, 8, 300, mx.float32), mx.zeros((1, 1, 8)), mx.zeros((1, 1, 300)), offset=0)


def test_strided_inputs_give_the_same_result_as_contiguous_ones():
    state = _full_state(2, 8, 8, 8, mx.float32)
    block = mx.random.normal((2, 8, 3), key=mx.random.key(5))
    strided = block.transpose(0, 2, 1)  # [2, 3, 8], not row-contiguous
    contiguous = mx.array(np.array(strided))
    a = _call(state, strided, strided)
    b = _call(state, contiguous, contiguous)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.array(x), np.array(y))


def test_auto_falls_back_to_reference_with_one_warning(monkeypatch):
    monkeypatch.setattr(ext, "unavailable_reason", lambda: "camkv._ext is not built (test)")
    monkeypatch.setattr(backends, "_warned", set())
    with pytest.warns(RuntimeWarning, match="camkv._ext is not built"):
        assert backends.resolve("auto") is reference
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert backends.resolve("auto") is reference  # no second warning
    with pytest.raises(RuntimeError, match="backend 'ext' is not usable here"):
        backends.resolve("ext")


def test_auto_picks_ext_on_the_cpu():
    with mx.stream(mx.cpu):
        if mx.default_device() == mx.cpu:
            assert backends.resolve("auto") is ext


def test_ext_is_refused_when_a_cache_is_made_with_the_gpu_as_default_device(monkeypatch):
    """The extension runs on the CPU only: with the GPU as the default device a cache that
    asks for it is refused when it is made, saying what to use instead."""
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    assert "runs on the CPU only" in ext.unavailable_reason()
    with pytest.raises(ValueError, match="backend 'ext' cannot run here: camkv._ext runs on the CPU only"):
        CaMKVCache(backend="ext")


def test_column_mass_matches_the_masked_softmax_and_masks_what_section_2_says():
    """_ext.column_mass: each query row's softmax over the columns its chunk token sees,
    summed down the columns and weighted; a NaN or infinite logit is masked, a row with
    nothing visible adds nothing, and columns past the logits' are zero."""
    from camkv.mass import column_mass as _column_mass

    rng = np.random.default_rng(5)
    rows, groups, s_len, n_before = 3, 2, 4, 6
    logits = rng.standard_normal((rows, groups * s_len, n_before + s_len)).astype(np.float32) * 4
    logits[0, 1, 2] = np.nan
    logits[1, 3, 0] = np.inf
    logits[2, 5, : n_before + 1] = -np.inf  # chunk token 1 of query group 1 sees nothing usable
    got = ext._ext.column_mass(mx.array(logits), scale=0.7, n_before=n_before, s_len=s_len,
                               width=n_before + s_len + 3, weight=1.0 / groups)
    want = _column_mass(mx.array(logits).reshape(rows, groups, s_len, -1), 0.7, n_before) / groups
    np.testing.assert_allclose(np.array(got[:, : n_before + s_len]), np.array(want), rtol=1e-5, atol=1e-6)
    assert not np.array(got[:, n_before + s_len:]).any()
    assert np.isfinite(np.array(got)).all()


@pytest.mark.parametrize("change, message", [
    (dict(s_len=3), "s_len must be >= 1 and divide the logits' M = 8"),
    (dict(width=5), "width >= the logits' N = 10"),
    (dict(n_before=-1), "n_before >= 0"),
])
def test_column_mass_rejects_bad_arguments_by_name(change, message):
    args = dict(scale=1.0, n_before=6, s_len=4, width=10, weight=0.5)
    args.update(change)
    with pytest.raises(ValueError, match=message):
        ext._ext.column_mass(mx.zeros((2, 8, 10)), **args)


def test_a_given_chunk_mass_replaces_the_kernels_scoring_and_is_checked():
    """chunk_mass (a chunk call's mass, pooled and / G) is what the call adds to the scores:
    the kernel's own scoring gives the same scores within float32 rounding, and a mass of
    the wrong shape, or given to a call that is not a chunk, is a ValueError."""
    state = _full_state(2, 8, 4, 3, mx.float32)
    new_keys = mx.random.normal((2, 5, 4), key=mx.random.key(1))
    new_values = mx.random.normal((2, 5, 3), key=mx.random.key(2))
    drop = _CFG.replace(merge="drop", budget=13)
    own = _call(state, new_keys, new_values, cfg=drop)
    mass = reference.attention_mass_causal(new_keys[:, :, None, :].astype(mx.float32),
                                           mx.concatenate([state.keys, new_keys], axis=1), 0.25, 8)
    given = _call(state, new_keys, new_values, cfg=drop, chunk_mass=mass)
    np.testing.assert_allclose(np.array(given[2]), np.array(own[2]), rtol=1e-5, atol=1e-6)
    doubled = _call(state, new_keys, new_values, cfg=drop, chunk_mass=2 * mass)
    np.testing.assert_allclose(np.array(doubled[2]) - np.array(given[2]), np.array(mass), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"chunk_mass has 12 tokens \(axis 1\) but 13"):
        _call(state, new_keys, new_values, chunk_mass=mass[:, :12])
    with pytest.raises(ValueError, match="chunk_mass is a chunk call's mass"):
        _call(state, new_keys, new_values, cfg=_CFG.replace(prefill="exact"), chunk_mass=mass)


def test_the_kernels_shares_are_the_registrys_bit_for_bit():
    """csrc/camkv_merges.h's target and loser shares (camkv._ext.merge_shares) give the same
    float32 values as camkv.merges' for every blending kernel rule, over cosines, masses and
    value norms at the edges (negative, 0, the odds' cap, 1, above 1): one table per
    language, the same arithmetic in both."""
    from camkv import merges

    cosines = [-0.5, 0.0, 0.3, 0.9997, 1.0 - 2.0**-12, 0.99999, 1.0, 1.2]
    masses = [0.0, 0.7, 3.25]
    norms = [0.0, 1.5]
    grid = [(c, s_in, s_t, n_in, n_t) for c in cosines for s_in in masses for s_t in masses for n_in in norms
            for n_t in norms]
    columns = [mx.array(np.array(column, np.float32)) for column in zip(*grid)]
    for rule in merges.RULES:
        if not rule.blends:
            continue
        want_target = np.broadcast_to(np.array(rule.target_share(columns[2]), np.float32), (len(grid),))
        want_loser = np.broadcast_to(np.array(rule.loser_share(*columns), np.float32), (len(grid),))
        for i, point in enumerate(grid):
            got = ext._ext.merge_shares(rule.code, *point)
            assert np.float32(got[0]) == want_target[i] and np.float32(got[1]) == want_loser[i], (
                f"{rule.name} at (cos, s_in, s_target, |V_e|, |V_t|) = {point}: kernel {got}, "
                f"registry ({want_target[i]}, {want_loser[i]})")
