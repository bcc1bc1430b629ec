"""A quantized decode step in one launch (camkv.backends.step_cuda, docs/algorithm.md
section 12): its buffers are append_cuda.write's and its output quantized_cuda's
attention over the written rows, bit for bit, and close to a float64 reference. On an
NVIDIA GPU the kernels run there; elsewhere their text runs on CPU threads
(tests/cuda_emulation.py). Random and adversarial steps (the step's key at the edge of a
group's range, constant, all negative), the step as the only row, the last row of the
buffers, one work group a head (4 or 8 warps) and stretches with a combine; a held step
written before anything reads the rows; where the launch does not take a step."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, note, settings
from hypothesis import strategies as st

import cuda_emulation
from camkv.backends import append_cuda, quantized_cuda, step_cuda
from test_append_cuda import _adversarial, _buffers
from test_quantized_attention import DTYPES, EPS, _reference

on_gpu = pytest.mark.skipif(not cuda_emulation.here(), reason="no NVIDIA GPU, and no C++ compiler to emulate one")


@pytest.fixture(autouse=True)
def _kernels_here():
    with cuda_emulation.kernels_here(append_cuda, quantized_cuda, step_cuda):
        yield


@st.composite
def cases(draw):
    D = draw(st.sampled_from([64, 128]))
    C = draw(st.integers(1, 90))
    return dict(B=draw(st.integers(1, 2)), H=draw(st.integers(1, 3)), G=draw(st.integers(1, quantized_cuda.MAX_GROUP)),
                C=C, at=draw(st.integers(0, C - 1)), D=D, bits=draw(st.sampled_from(append_cuda.BITS)),
                group_size=draw(st.sampled_from([g for g in (32, 64, 128) if g <= D])),
                dtype=draw(st.sampled_from(sorted(DTYPES))), strided=draw(st.booleans()),
                kind=draw(st.sampled_from(["random", "negative", "constant", "edge_tie"])),
                scale=draw(st.sampled_from([0.125, 1.0, 20.0])), whole=draw(st.booleans()),
                warps=draw(st.sampled_from([quantized_cuda.MAX_WHOLE_WARPS, 8])),
                seed=draw(st.integers(0, 2**31 - 1)))


def _step(rng, c, dtype) -> mx.array:
    x = _adversarial(rng, (c["B"], 1, c["H"], c["D"]), c["kind"], c["bits"])
    if c["strided"]:  # [B, 1, H, D] transposed, as a model hands it over
        return mx.array(x).astype(dtype).transpose(0, 2, 1, 3)
    return mx.array(np.ascontiguousarray(x.transpose(0, 2, 1, 3))).astype(dtype)


def _arrays(q: tuple) -> list:
    return [np.array(a if a.dtype == mx.uint32 else a.astype(mx.float32)) for a in q]


def _check(c):
    rng = np.random.default_rng(c["seed"])
    dtype = DTYPES[c["dtype"]]
    held_keys, held_values = (_buffers(rng, c["B"], c["H"], c["C"], c["D"], dtype, c["bits"], c["group_size"])
                              for _ in range(2))
    keys, values = _step(rng, c, dtype), _step(rng, c, dtype)
    queries = mx.array(rng.standard_normal((c["B"], c["H"] * c["G"], 1, c["D"])).astype(np.float32)).astype(dtype)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(append_cuda.drop, "on_cuda", lambda: True)  # emulated: as on a GPU
        assert step_cuda.takes(queries, held_keys, held_values, dtype, c["bits"], c["group_size"], c["C"])
    with pytest.MonkeyPatch.context() as patch:  # whole=False: stretches and a combine even for few rows
        patch.setattr(quantized_cuda, "WHOLE_ROWS", quantized_cuda.WHOLE_ROWS if c["whole"] else 0)
        patch.setattr(quantized_cuda, "MAX_WHOLE_WARPS", c.get("warps", quantized_cuda.MAX_WHOLE_WARPS))
        new_keys, new_values, out = step_cuda.write_and_attend(
            queries, held_keys, held_values, keys, values, c["at"], c["scale"], c["bits"], c["group_size"])
        want_keys, want_values = append_cuda.write(held_keys, held_values, keys, values, c["at"], c["bits"],
                                                   c["group_size"])
        rows = [tuple(a[:, :, : c["at"] + 1] for a in q) for q in (want_keys, want_values)]
        separate = quantized_cuda.attend(queries, *rows, c["scale"], None, c["bits"], c["group_size"])
    for got, want in ((new_keys, want_keys), (new_values, want_values)):
        for name, g, w in zip(("codes", "scales", "biases"), _arrays(got), _arrays(want)):
            np.testing.assert_array_equal(g, w, err_msg=name)
    assert out.shape == queries.shape and out.dtype == dtype
    got = np.array(out.astype(mx.float32), np.float64)
    # The same rows in the same order through the same text: the same output, bit for bit.
    np.testing.assert_array_equal(got, np.array(separate.astype(mx.float32), np.float64))
    expected = _reference(queries, *rows, c["scale"], None, c["bits"], c["group_size"])
    np.testing.assert_allclose(got, expected, rtol=0,
                               atol=4 * EPS[c["dtype"]] * np.abs(expected).max() + 2e-4 * max(1.0, c["scale"]))


@on_gpu
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
@example(dict(B=1, H=2, G=4, C=1, at=0, D=64, bits=8, group_size=64, dtype="bfloat16", strided=True, kind="edge_tie",
              scale=20.0, whole=True, warps=8, seed=1))  # the step is the only row
@example(dict(B=2, H=1, G=8, C=70, at=69, D=128, bits=4, group_size=32, dtype="float16", strided=False,
              kind="negative", scale=1.0, whole=False, seed=2))  # the last row, stretches
@example(dict(B=1, H=3, G=1, C=40, at=17, D=64, bits=4, group_size=32, dtype="float32", strided=True,
              kind="constant", scale=0.125, whole=True, seed=3))
def test_writes_as_the_write_and_attends_as_the_attention_over_the_written_rows(case):
    note(f"case={case}")
    _check(case)


def test_refuses_what_either_part_does_not_take():
    """Rows of another dtype than their scales', bits the write does not take, more query
    heads a KV head than the attention holds, buffers past the write's copy limit or of
    more rows a head than one launch attends: not taken (the cache then writes and
    attends as separate calls)."""
    def buffers(n, bits=8, dtype=mx.float16):
        return tuple(mx.quantize(mx.zeros((1, 2, n, 64), dtype), group_size=32, bits=bits))

    rows, q = buffers(8), mx.zeros((1, 4, 1, 64), mx.float16)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(append_cuda.drop, "on_cuda", lambda: True)  # the CPU: as on a GPU
        assert step_cuda.takes(q, rows, rows, mx.float16, 8, 32, 8)
        assert not step_cuda.takes(q, rows, rows, mx.bfloat16, 8, 32, 8)
        assert not step_cuda.takes(mx.zeros((1, 2 * (quantized_cuda.MAX_GROUP + 1), 1, 64), mx.float16), rows, rows,
                                   mx.float16, 8, 32, 8)
        three = buffers(8, bits=3)
        assert not step_cuda.takes(q, three, three, mx.float16, 3, 32, 8)
        patch.setattr(append_cuda, "COPY_LIMIT_BYTES", 10)
        assert not step_cuda.takes(q, rows, rows, mx.float16, 8, 32, 8)
        patch.undo()
        patch.setattr(append_cuda.drop, "on_cuda", lambda: True)
        patch.setattr(quantized_cuda, "WHOLE_ROWS", 7)  # more rows a head than one launch attends
        assert not step_cuda.takes(q, rows, rows, mx.float16, 8, 32, 8)
    assert step_cuda.takes(q, rows, rows, mx.float16, 8, 32, 8) == append_cuda.drop.on_cuda()


@on_gpu
@pytest.mark.parametrize("between", ["state", "mask"])
def test_a_held_step_is_written_before_anything_reads_the_rows(monkeypatch, between):
    """A decode step the rows hold for the attention's launch is written first when
    something reads the rows before that attention (the cache's state), or when the
    attention call is one the launch does not take (a mask array): the output and the
    rows are those of a cache that never holds a step."""
    from camkv import CaMKVCache, hook, quantized
    from tiny_models import random_steps, tiny_llama

    monkeypatch.setattr(quantized_cuda, "here", lambda: True)
    monkeypatch.setattr(append_cuda, "takes", lambda *a: True)
    monkeypatch.setattr(step_cuda, "FUSED_STEPS", True)
    block, query = random_steps(7)
    model = tiny_llama()
    hook.install(model)
    try:
        caches = [CaMKVCache(budget=16, n_sink=1, recent=2, slack=4, bits=8, group_size=32) for _ in range(2)]
        caches[1]._fuses_steps = lambda queries: False
        first, first_queries = (block(30), block(30)), query(30)
        for cache in caches:
            hook.scaled_dot_product_attention(first_queries, *cache.update_and_fetch(*first), cache, 0.125, "causal")
        held = []
        for step in range(4):
            k, v, q = block(1), block(1), query(1)
            fetched = [cache.update_and_fetch(k, v) for cache in caches]
            held.append(isinstance(fetched[0][0], quantized.StepRows))
            if held[-1] and between == "state":  # the held step is in what the state shows
                _same_state(*caches)
            mask = mx.zeros((1, 1, 1, caches[1].size())) if between == "mask" else None
            outs = [hook.scaled_dot_product_attention(q, *f, cache, 0.125, mask) for f, cache in zip(fetched, caches)]
            np.testing.assert_array_equal(np.array(outs[0]), np.array(outs[1]))
        _same_state(*caches)
    finally:
        hook.uninstall(model)
    assert held[-1]  # the short way was taken: the check saw held steps


def _same_state(one, other) -> None:
    for a, b in zip(one.state, other.state):
        for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
            np.testing.assert_array_equal(np.array(x), np.array(y))


@on_gpu
@pytest.mark.parametrize("why", ["switched off", "rows past one launch", "capacity past one launch"])
def test_steps_are_written_and_attended_apart_where_the_launch_does_not_take_them(monkeypatch, why):
    """FUSED_STEPS off, buffers of more rows a head than one work group attends
    (WHOLE_ROWS), or buffers within it that decoding would grow past it (a short prompt
    under a large budget): a quantized cache's decode steps are written by the write and
    attended by the pass, never held for one launch."""
    from camkv import CaMKVCache, hook, quantized
    from tiny_models import random_steps, tiny_llama

    monkeypatch.setattr(quantized_cuda, "here", lambda: True)
    monkeypatch.setattr(append_cuda, "takes", lambda *a: True)
    budget = 16
    if why == "switched off":
        monkeypatch.setattr(step_cuda, "FUSED_STEPS", False)
    elif why == "rows past one launch":
        monkeypatch.setattr(quantized_cuda, "WHOLE_ROWS", 20)  # the buffers hold 16 + 4 + 1 rows
    else:  # 30 rows held with GROWTH_STEP's room: 286 rows, of a capacity of 300 + 4 + 1
        budget = 300
        monkeypatch.setattr(quantized_cuda, "WHOLE_ROWS", 290)
    block, query = random_steps(3)
    model = tiny_llama()
    hook.install(model)
    try:
        cache = CaMKVCache(budget=budget, n_sink=1, recent=2, slack=4, bits=8, group_size=32)
        hook.scaled_dot_product_attention(query(30), *cache.update_and_fetch(block(30), block(30)), cache, 0.125,
                                          "causal")
        if why == "capacity past one launch":
            assert cache._rows._keys[0].shape[2] <= quantized_cuda.WHOLE_ROWS < cache._rows.capacity
        for _ in range(4):
            fetched = cache.update_and_fetch(block(1), block(1))
            assert not isinstance(fetched[0], quantized.StepRows)
            hook.scaled_dot_product_attention(query(1), *fetched, cache, 0.125, None)
    finally:
        hook.uninstall(model)
    assert cache._plain_step is not None  # the short way, unfused
