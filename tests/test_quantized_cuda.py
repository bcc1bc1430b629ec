"""camkv's CUDA attention over quantized rows read as stored (camkv.backends.quantized_cuda,
docs/algorithm.md section 12) against a float64 reference on random and adversarial
inputs: views of a cache's buffers, masks, several stretches of rows, ties. On an NVIDIA
GPU the kernels run there; elsewhere their text runs on CPU threads
(tests/cuda_emulation.py, which hands views over as contiguous copies); the refusals are
checked everywhere."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from camkv.backends import quantized_cuda
import cuda_emulation
from test_quantized_attention import DTYPES, EPS, _reference, _rows

on_gpu = pytest.mark.skipif(not cuda_emulation.here(), reason="no NVIDIA GPU, and no C++ compiler to emulate one")


@pytest.fixture(autouse=True)
def _kernels_here():
    with cuda_emulation.kernels_here(quantized_cuda):
        yield


@st.composite
def cases(draw):
    D = draw(st.sampled_from(quantized_cuda.HEAD_DIMS[:2]))
    return dict(
        B=draw(st.integers(1, 2)), H=draw(st.integers(1, 3)), G=draw(st.integers(1, quantized_cuda.MAX_GROUP)),
        N=draw(st.one_of(st.integers(1, 70), st.integers(70, 700))), D=D,
        bits=draw(st.sampled_from(quantized_cuda.BITS)), group_size=draw(st.sampled_from([32, 64, 128][:D // 64 + 1])),
        dtype=draw(st.sampled_from(sorted(DTYPES))), mask=draw(st.sampled_from(["none", "shared", "per_head"])),
        spare=draw(st.sampled_from([0, 5])), lead=draw(st.sampled_from([0, 3])), strided_queries=draw(st.booleans()),
        scale=draw(st.sampled_from([0.125, 1.0, 40.0])), seed=draw(st.integers(0, 2**31 - 1)),
        whole=draw(st.booleans()), query_heads=draw(st.booleans()))


def _queries(rng, B, Hq, D, dtype, strided):
    if strided:  # [B, 1, Hq, D] transposed, as a model's queries come
        return mx.array(rng.standard_normal((B, 1, Hq, D)).astype(np.float32)).astype(dtype).transpose(0, 2, 1, 3)
    return mx.array(rng.standard_normal((B, Hq, 1, D)).astype(np.float32)).astype(dtype)


def _check(queries, keys, values, scale, mask, bits, group_size, dtype_name, whole=True):
    """camkv's pass against the float64 reference; whole=False: in stretches and a combine
    launch even where one work group a head would read every row (WHOLE_ROWS)."""
    assert quantized_cuda.takes(queries, keys, values, bits, group_size)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(quantized_cuda, "WHOLE_ROWS", quantized_cuda.WHOLE_ROWS if whole else 0)
        got = quantized_cuda.attend(queries, keys, values, scale, mask, bits, group_size)
    assert got.dtype == queries.dtype and got.shape == queries.shape
    expected = _reference(queries, keys, values, scale, mask, bits, group_size)
    got = np.array(got.astype(mx.float32), np.float64)
    tolerance = 4 * EPS[dtype_name] * np.abs(expected).max() + 2e-4 * max(1.0, scale)
    np.testing.assert_allclose(got, expected, atol=tolerance, rtol=0)


@on_gpu
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_matches_float64_attention_over_the_dequantized_rows(case):
    """Random shapes, dtypes, masks (some logits -inf), strided views (some starting past
    their buffer's first row), up to eleven stretches of rows, and scales up to logits in
    the hundreds."""
    note(f"case={case}")
    c = case
    rng = np.random.default_rng(c["seed"])
    dtype = DTYPES[c["dtype"]]
    queries = _queries(rng, c["B"], c["H"] * c["G"], c["D"], dtype, c["strided_queries"])
    keys, values = (_rows(rng, c["B"], c["H"], c["N"], c["D"], dtype, c["bits"], c["group_size"], c["spare"],
                          c["lead"]) for _ in range(2))
    mask = None
    if c["mask"] != "none":
        m = rng.standard_normal((c["B"], 1 if c["mask"] == "shared" else c["H"], 1, c["N"])).astype(np.float32)
        m[..., 1:][rng.random(m[..., 1:].shape) < 0.3] = -np.inf  # row 0 stays visible
        mask = mx.array(m)
    _check(queries, keys, values, c["scale"], mask, c["bits"], c["group_size"], c["dtype"], c["whole"])


@on_gpu
@pytest.mark.parametrize("n", [1, 63, 64, 65, 2048])
def test_rows_alike_and_one_visible_row(n):
    """Every row the same (every logit tied): the output is that row's value, whichever
    stretch a row falls in; a mask hiding all rows but the last: that row's value."""
    rng = np.random.default_rng(n)
    row = mx.array(rng.standard_normal((1, 2, 1, 128)).astype(np.float32))
    keys = tuple(mx.quantize(mx.broadcast_to(row, (1, 2, n, 128)), group_size=64, bits=8))
    queries = _queries(rng, 1, 8, 128, mx.float32, False)
    _check(queries, keys, keys, 0.1, None, 8, 64, "float32")
    mask = np.full((1, 1, 1, n), -np.inf, np.float32)
    mask[..., -1] = 0.0
    values = _rows(rng, 1, 2, n, 128, mx.float32, 4, 32, 0)
    _check(queries, _rows(rng, 1, 2, n, 128, mx.float32, 4, 32, 0), values, 1.0, mx.array(mask), 4, 32, "float32")


def test_refuses_what_it_does_not_compute():
    """A prompt block, head dims outside HEAD_DIMS or unequal, bits other than 4 and 8,
    more than MAX_GROUP query heads a KV head, scales of another dtype: not taken (the
    hook then attends the rows dequantized)."""
    def q(shape, dtype=mx.float16):
        return mx.zeros(shape, dtype)

    def rows(n, dim, bits, group, dtype=mx.float16):
        return tuple(mx.quantize(mx.zeros((1, 2, n, dim), dtype), group_size=group, bits=bits))

    keys = rows(8, 64, 8, 32)
    assert quantized_cuda.takes(q((1, 4, 1, 64)), keys, keys, 8, 32)
    assert not quantized_cuda.takes(q((1, 4, 2, 64)), keys, keys, 8, 32)  # a block
    assert not quantized_cuda.takes(q((1, 4, 1, 64)), keys, rows(8, 128, 8, 32), 8, 32)  # Dv != Dk
    small = rows(8, 32, 8, 32)
    assert not quantized_cuda.takes(q((1, 4, 1, 32)), small, small, 8, 32)
    three = rows(8, 64, 3, 32)
    assert not quantized_cuda.takes(q((1, 4, 1, 64)), three, three, 3, 32)
    assert not quantized_cuda.takes(q((1, 2 * (quantized_cuda.MAX_GROUP + 1), 1, 64)), keys, keys, 8, 32)
    assert not quantized_cuda.takes(q((1, 4, 1, 64), mx.bfloat16), keys, keys, 8, 32)


# ---------------------------------------------------------------- rows as the model's dtype


def _plain_reference(queries, keys, values, scale, mask):
    """softmax(scale q k^T + mask) v in float64, mask [B, 1 or H, 1, N] per KV head."""
    q, k, v = (np.array(a.astype(mx.float32), np.float64) for a in (queries, keys, values))
    B, Hq, _, D = q.shape
    H = k.shape[1]
    out = np.zeros((B, Hq, 1, D))
    for b in range(B):
        for hq in range(Hq):
            h = hq // (Hq // H)
            logits = scale * k[b, h] @ q[b, hq, 0]
            if mask is not None:
                logits = logits + np.array(mask, np.float64)[b, 0 if mask.shape[1] == 1 else h, 0]
            if np.isfinite(logits).any():
                weights = np.exp(logits - logits.max())
                out[b, hq, 0] = weights @ v[b, h] / weights.sum()
    return out


@on_gpu
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_plain_rows_match_float64_attention(case):
    """attend_rows over rows as the model's dtype (views with a spare row after them where
    asked), masks per KV head or shared with -inf entries, several stretches of rows."""
    note(f"case={case}")
    c = case
    rng = np.random.default_rng(c["seed"])
    dtype = DTYPES[c["dtype"]]
    B, H, N, D = c["B"], c["H"], c["N"], c["D"]
    queries = _queries(rng, B, H * c["G"], D, dtype, c["strided_queries"])
    held = N + c["spare"]
    keys, values = (mx.array(rng.standard_normal((B, H, held, D)).astype(np.float32)).astype(dtype)[:, :, :N]
                    for _ in range(2))
    mask = None
    if c["mask"] != "none":
        heads = 1 if c["mask"] == "shared" else H
        bias = rng.standard_normal((B, heads, 1, N)).astype(np.float32)
        bias[rng.random(bias.shape) < 0.2] = -np.inf
        mask = mx.array(bias)
    assert quantized_cuda.takes_rows(queries, keys, values)
    with pytest.MonkeyPatch.context() as patch:  # one launch a head, or stretches and a combine
        patch.setattr(quantized_cuda, "PLAIN_STRETCHES", False)
        patch.setattr(quantized_cuda, "WHOLE_ROWS", quantized_cuda.WHOLE_ROWS if c["whole"] else 0)
        # A work group a query head (its rows whole, or in stretches of 2 warps' 3 steps).
        patch.setattr(quantized_cuda, "QUERY_HEAD_ROWS", quantized_cuda.ALL_ROWS if c["query_heads"] else 0)
        patch.setattr(quantized_cuda, "QUERY_HEAD_DIMS", quantized_cuda.HEAD_DIMS)
        patch.setattr(quantized_cuda, "QUERY_HEAD_WARPS", 4 if c["whole"] else 2)
        patch.setattr(quantized_cuda, "QUERY_HEAD_STEPS", None if c["whole"] else 3)
        got = np.array(quantized_cuda.attend_rows(queries, keys, values, c["scale"], mask).astype(mx.float32))
    expected = _plain_reference(queries, keys, values, c["scale"], mask)
    tolerance = 4 * EPS[c["dtype"]] * np.abs(expected).max() + 2e-4 * max(1.0, c["scale"])
    np.testing.assert_allclose(got, expected, atol=tolerance, rtol=0)


@on_gpu
@pytest.mark.parametrize("rows, stretched", [(577, True), (20, False)])
def test_plain_rows_past_one_stretch_are_read_in_stretches(rows, stretched, monkeypatch):
    """A keepkv decode step's rows (PLAIN_STRETCHES): past one stretch a head they are read
    in stretches and combined, many work groups a head where one a head would leave the
    device idle; within one stretch one launch reads them. Either way the float64
    attention's output."""
    from tiny_models import counted

    rng = np.random.default_rng(rows)
    queries = mx.array(rng.standard_normal((1, 16, 1, 128)).astype(np.float32)).astype(mx.bfloat16)
    keys, values = (mx.array(rng.standard_normal((1, 8, rows, 128)).astype(np.float32)).astype(mx.bfloat16)
                    for _ in range(2))
    mask = mx.array(rng.standard_normal((1, 8, 1, rows)).astype(np.float32))
    monkeypatch.setattr(quantized_cuda, "QUERY_HEAD_ROWS", 0)  # a KV head's query heads together
    combined = counted(monkeypatch, quantized_cuda, "combine")
    got = np.array(quantized_cuda.attend_rows(queries, keys, values, 0.088, mask).astype(mx.float32))
    assert len(combined) == int(stretched)
    expected = _plain_reference(queries, keys, values, 0.088, mask)
    np.testing.assert_allclose(got, expected, atol=4 * EPS["bfloat16"] * np.abs(expected).max() + 2e-4, rtol=0)


def test_a_step_shapes_launch_plan_is_made_once_and_follows_the_layout_settings(monkeypatch):
    """A decode step repeats its layers' shapes, so its launch plan is made once per shape
    (host time every layer and step), yet a setting that changes the layout (WHOLE_ROWS,
    WARPS, MAX_WHOLE_WARPS, WARPS_SHARED_BYTES) gives a plan of its own."""
    args = ("plain", (1, 16, 1, 128), mx.bfloat16, 8, 577, True, ())
    first = quantized_cuda._plan(*args, 1024)
    assert quantized_cuda._plan(*args, 1024) is first
    assert first[0] and first[2] == [(1, 16, 1, 128)]
    stretched = quantized_cuda._plan(*args, 0)
    splits = -(-577 // quantized_cuda.rows_per_stretch(128))
    assert not stretched[0] and stretched[2] == quantized_cuda.partial_shapes(8, splits, 2, 128)
    with monkeypatch.context() as patch:
        patch.setattr(quantized_cuda, "WARPS", 2 * quantized_cuda.WARPS)
        assert quantized_cuda._plan(*args, 0)[1]["threadgroup"] == (2 * stretched[1]["threadgroup"][0], 1, 1)
    for setting, value in (("MAX_WHOLE_WARPS", 1), ("WARPS_SHARED_BYTES", 4 * 2 * 128)):  # a whole head's warps
        with monkeypatch.context() as patch:
            patch.setattr(quantized_cuda, setting, value)
            assert quantized_cuda._plan(*args, 1024)[1]["threadgroup"] == (32, 1, 1)
    assert quantized_cuda._plan(*args, 1024) is first


@pytest.mark.parametrize("rows, dim, by_query_head", [
    (1, 128, True), (577, 128, True), (577, 64, True), (quantized_cuda.QUERY_HEAD_ROWS, 128, True),
    (quantized_cuda.QUERY_HEAD_ROWS + 1, 128, False), (2112, 128, False), (577, 256, False)])
def test_plain_rows_up_to_query_head_rows_are_read_by_a_work_group_a_query_head(rows, dim, by_query_head,
                                                                                 monkeypatch):
    """A decode step over rows as the model's dtype: up to QUERY_HEAD_ROWS rows a head of a
    dim in QUERY_HEAD_DIMS, one launch of a work group a query head (as many work groups as
    query heads, QUERY_HEAD_WARPS warps each, one query head's sums); past them, or at head
    dim 256, a KV head's query heads together (its stretches and a combine past one stretch)."""
    plans = []
    monkeypatch.setattr(quantized_cuda, "_attend", lambda *args: plans.append(quantized_cuda._plan(
        args[0], args[1].shape, args[1].dtype, args[3][1], args[3][2], True, (), args[7], args[8])))
    queries, rows_of = mx.zeros((1, 16, 1, dim), mx.bfloat16), mx.zeros((1, 8, rows, dim), mx.bfloat16)
    quantized_cuda.attend_rows(queries, rows_of, rows_of, 0.1, mx.zeros((1, 8, 1, rows)))
    whole, launch, shapes = plans[0]
    template = dict(launch["template"])
    if by_query_head:
        warps = quantized_cuda.QUERY_HEAD_WARPS
        assert whole and shapes == [(1, 16, 1, dim)] and template["G"] == 1 and template["SLICES"] == 2
        assert launch["grid"] == (16 * warps * 32, 1, 1) and launch["threadgroup"] == (warps * 32, 1, 1)
    else:
        assert template["G"] == 2 and template["SLICES"] == 1
        assert launch["threadgroup"][0] < quantized_cuda.QUERY_HEAD_WARPS * 32


def test_plain_rows_refusals():
    q = mx.zeros((1, 4, 1, 64))
    rows = mx.zeros((1, 2, 10, 64))
    assert quantized_cuda.takes_rows(q, rows, rows)
    assert not quantized_cuda.takes_rows(mx.zeros((1, 4, 2, 64)), rows, rows)  # a prompt block
    assert not quantized_cuda.takes_rows(mx.zeros((1, 4, 1, 32)), mx.zeros((1, 2, 10, 32)), mx.zeros((1, 2, 10, 32)))
    assert not quantized_cuda.takes_rows(q.astype(mx.bfloat16), rows, rows)  # dtypes differ
    assert not quantized_cuda.takes_rows(mx.zeros((1, 36, 1, 64)), rows, rows)  # 18 query heads a KV head


@on_gpu
def test_keepkv_decode_steps_through_the_hook_take_camkvs_pass_and_equal_mlx_lms_attention(monkeypatch):
    """keepkv's rows stand for several tokens; on an NVIDIA GPU the hook hands a decode step
    and the votes' log to camkv's pass (counted), whose output equals mlx-lm's attention
    with weighed_by_votes' mask."""
    from camkv import CaMKVCache, hook
    from tiny_models import counted, random_steps, tiny_llama

    monkeypatch.setattr(quantized_cuda, "here", lambda: True)
    taken = counted(monkeypatch, quantized_cuda, "attend_rows")
    block, query = random_steps(3)
    model = tiny_llama()
    hook.install(model)  # a hooked model: the cache waits for the queries the hook hands it
    try:
        cache = CaMKVCache(budget=16, n_sink=1, recent=2, slack=4, merge="keepkv")
        keys, values = cache.update_and_fetch(block(40), block(40))
        hook.scaled_dot_product_attention(query(40), keys, values, cache, 0.125, "causal")
        votes_seen = False
        for _ in range(10):
            keys, values = cache.update_and_fetch(block(1), block(1))
            bias = cache.votes_bias()
            votes_seen = votes_seen or bool((np.array(bias) > 0).any())
            q = query(1)
            got = hook.scaled_dot_product_attention(q, keys, values, cache, 0.125, None)
            want = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.125,
                                                        mask=hook.weighed_by_votes(None, bias, q, keys))
            np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)
    finally:
        hook.uninstall(model)
    assert len(taken) == 10 and votes_seen
