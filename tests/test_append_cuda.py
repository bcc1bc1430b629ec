"""A decode step's rows written quantized in one launch (camkv.backends.append_cuda,
docs/algorithm.md section 12) against the codes MLX's CUDA build stores: on an NVIDIA
GPU against mx.quantize there; elsewhere the kernel's text runs on CPU threads
(tests/cuda_emulation.py) against a float32 model of MLX's CUDA affine_quantize
(mlx/backend/cuda/quantized/affine_quantize.cu), whose range starts its maximum at 0 and
rounds half away from zero (the CPU's mx.quantize takes the true maximum and rounds half
to even). Random and adversarial rows: all-negative groups, constant groups, zeros,
values on exact halves of a step (the codes' and the edge's), strided keys, several rows."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, note, settings
from hypothesis import strategies as st

import cuda_emulation
from camkv import quantized
from camkv.backends import append_cuda, drop

on_gpu = pytest.mark.skipif(not cuda_emulation.here(), reason="no NVIDIA GPU, and no C++ compiler to emulate one")
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


@pytest.fixture(autouse=True)
def _kernels_here():
    with cuda_emulation.kernels_here(append_cuda):
        yield


def _round_half_away(x: np.ndarray) -> np.ndarray:
    """C's roundf on float32: exact halves away from zero (np.rint takes them to even)."""
    r = np.rint(x)
    halves = np.abs(x - np.trunc(x)) == np.float32(0.5)
    return np.where(halves, np.trunc(x) + np.sign(x), r).astype(np.float32)


def cuda_quantize(x: np.ndarray, bits: int, group_size: int, dtype) -> tuple:
    """MLX's CUDA mx.quantize of float32 rows [..., D] in float32 arithmetic: codes uint32,
    scales and biases rounded to dtype."""
    f = np.float32
    n_bins = f(2**bits - 1)
    groups = x.astype(f).reshape(*x.shape[:-1], -1, group_size)
    lo = groups.min(axis=-1)
    hi = np.maximum(groups.max(axis=-1), f(0))
    scale = np.maximum((hi - lo) / n_bins, f(1e-7)).astype(f)
    side = np.abs(lo) > np.abs(hi)
    scale = np.where(side, scale, -scale).astype(f)
    edge = np.where(side, lo, hi).astype(f)
    q0 = _round_half_away((edge / scale).astype(f))
    at_zero = q0 == 0
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(at_zero, scale, edge / q0).astype(f)
    bias = np.where(at_zero, f(0), edge).astype(f)
    codes = _round_half_away(((groups - bias[..., None]) / scale[..., None]).astype(f))
    codes = np.clip(codes, 0, n_bins).astype(np.uint32).reshape(*x.shape[:-1], -1, 32 // bits)
    words = (codes << (np.arange(32 // bits, dtype=np.uint32) * bits)).sum(axis=-1, dtype=np.uint32)
    as_dtype = lambda a: np.array(mx.array(a).astype(dtype).astype(mx.float32))  # noqa: E731
    return words, as_dtype(scale), as_dtype(bias)


def _expected(block: mx.array, bits: int, group_size: int) -> tuple:
    """The stored (codes, scales, biases) of block as numpy: mx.quantize on MLX's CUDA
    build, else the float32 model of it."""
    if drop.cuda_build():
        q = mx.quantize(block, group_size=group_size, bits=bits)
        return np.array(q[0]), np.array(q[1].astype(mx.float32)), np.array(q[2].astype(mx.float32))
    return cuda_quantize(np.array(block.astype(mx.float32)), bits, group_size, block.dtype)


def _adversarial(rng, shape, kind: str, bits: int = 4) -> np.ndarray:
    x = rng.standard_normal(shape).astype(np.float32)
    if kind == "edge_tie":  # groups spanning [-(2^bits - 1.5), 0.5]: the edge at an exact half step
        top = 2.0**bits - 1.5
        x = rng.uniform(-top, 0.5, shape).astype(np.float32)
        x[..., 0::32], x[..., 1::32] = -top, 0.5
        return x * np.float32(2.0 ** rng.integers(-3, 3))
    if kind == "negative":  # every group below zero: MLX's CUDA range still reaches 0
        return -np.abs(x) - 0.25
    if kind == "constant":
        return np.broadcast_to(x[..., :1], shape).copy()
    if kind == "zeros":
        return np.zeros(shape, np.float32)
    if kind == "halves":  # a group from 0 to 15 in steps of a half: codes on exact halves
        return (rng.integers(0, 31, shape) / 2).astype(np.float32)
    return x


@st.composite
def cases(draw):
    D = draw(st.sampled_from([64, 128]))
    C = draw(st.integers(1, 40))
    S = draw(st.integers(1, min(3, C)))
    return dict(B=draw(st.integers(1, 2)), H=draw(st.integers(1, 3)), C=C, S=S, at=draw(st.integers(0, C - S)),
                D=D, bits=draw(st.sampled_from(append_cuda.BITS)),
                group_size=draw(st.sampled_from([g for g in (32, 64, 128) if g <= D])),
                dtype=draw(st.sampled_from(sorted(DTYPES))), strided=draw(st.booleans()),
                kind=draw(st.sampled_from(["random", "negative", "constant", "zeros", "halves", "edge_tie"])),
                seed=draw(st.integers(0, 2**31 - 1)))


def _buffers(rng, B, H, C, D, dtype, bits, group_size) -> tuple:
    block = mx.array(rng.standard_normal((B, H, C, D)).astype(np.float32)).astype(dtype)
    return tuple(mx.quantize(block, group_size=group_size, bits=bits))


def _step(rng, c, dtype) -> mx.array:
    x = _adversarial(rng, (c["B"], c["S"], c["H"], c["D"]), c["kind"], c["bits"])
    # As a model hands it over: [B, S, H, D] transposed (strided), or contiguous.
    if c["strided"]:
        return mx.array(x).astype(dtype).transpose(0, 2, 1, 3)
    return mx.array(np.ascontiguousarray(x.transpose(0, 2, 1, 3))).astype(dtype)


@on_gpu
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
@example(dict(B=1, H=2, C=5, S=1, at=3, D=64, bits=4, group_size=32, dtype="float32", strided=True, kind="edge_tie",
              seed=1))
@example(dict(B=2, H=1, C=9, S=2, at=0, D=128, bits=8, group_size=64, dtype="float16", strided=False,
              kind="edge_tie", seed=2))
@example(dict(B=1, H=1, C=3, S=1, at=2, D=64, bits=8, group_size=32, dtype="bfloat16", strided=True, kind="negative",
              seed=3))
def test_writes_the_new_rows_as_mlx_cuda_quantizes_them_and_copies_the_rest(case):
    note(f"case={case}")
    c = case
    rng = np.random.default_rng(c["seed"])
    dtype = DTYPES[c["dtype"]]
    held_keys, held_values = (_buffers(rng, c["B"], c["H"], c["C"], c["D"], dtype, c["bits"], c["group_size"])
                              for _ in range(2))
    keys, values = _step(rng, c, dtype), _step(rng, c, dtype)
    new_keys, new_values = append_cuda.write(held_keys, held_values, keys, values, c["at"], c["bits"],
                                             c["group_size"])
    fresh = slice(c["at"], c["at"] + c["S"])
    for held, new, block in ((held_keys, new_keys, keys), (held_values, new_values, values)):
        for before, after in zip(held, new):
            assert after.shape == before.shape and after.dtype == before.dtype
            kept = np.ones(before.shape[2], bool)
            kept[fresh] = False
            np.testing.assert_array_equal(np.array(after.astype(mx.float32) if after.dtype != mx.uint32 else after)[:, :, kept],
                                          np.array(before.astype(mx.float32) if before.dtype != mx.uint32 else before)[:, :, kept])
        want = _expected(block, c["bits"], c["group_size"])
        got = (np.array(new[0]), *(np.array(a.astype(mx.float32)) for a in new[1:]))
        for name, g, w in zip(("codes", "scales", "biases"), got, want):
            np.testing.assert_array_equal(g[:, :, fresh], w, err_msg=name)


def test_the_model_of_mlx_cuda_quantize_is_mlx_s_affine_quantization():
    """The float32 model the emulated kernel is checked against quantizes as MLX does:
    each group's value of largest magnitude comes back exactly, every value whose code is
    not clipped at the far end within half a step, and groups all below zero are
    quantized over [min, 0], as MLX's CUDA kernel does."""
    rng = np.random.default_rng(0)
    for bits in append_cuda.BITS:
        for kind in ("random", "negative", "halves"):
            x = _adversarial(rng, (4, 128), kind)
            codes, scales, biases = cuda_quantize(x, bits, 32, mx.float32)
            back = np.array(mx.dequantize(mx.array(codes), mx.array(scales), mx.array(biases), group_size=32,
                                          bits=bits)).reshape(4, 4, 32)
            groups, step = x.reshape(4, 4, 32), np.abs(scales)[..., None]
            edge = np.abs(groups).argmax(axis=-1)[..., None]
            np.testing.assert_allclose(np.take_along_axis(back, edge, -1), np.take_along_axis(groups, edge, -1),
                                       rtol=1e-6, atol=1e-7)
            at = (groups - biases[..., None]) / scales[..., None]  # in steps from the bias
            unclipped = (at > -0.5) & (at < 2**bits - 0.5)
            within = step / 2 + 1e-6 * (1 + np.abs(groups))  # float32's rounding of scale * code + bias
            assert np.all((np.abs(back - groups) <= within)[unclipped])
            assert unclipped.mean() > 0.9
            if kind == "negative":
                np.testing.assert_allclose(step[..., 0] * (2**bits - 1), -groups.min(axis=-1), rtol=1e-5)


def test_takes_only_what_it_writes():
    """Bits other than 4 and 8, scales of another dtype than the step's, buffers past
    COPY_LIMIT_BYTES, and any device but MLX's CUDA build: not taken (six writes instead)."""
    rng = np.random.default_rng(1)
    buffers = _buffers(rng, 1, 2, 8, 64, mx.float16, 8, 32)
    assert append_cuda.takes(buffers, buffers, mx.float16, 8) is drop.on_cuda()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(drop, "on_cuda", lambda: True)  # the CPU: as on a GPU
        assert append_cuda.takes(buffers, buffers, mx.float16, 8)
        assert not append_cuda.takes(buffers, buffers, mx.float16, 3)
        assert not append_cuda.takes(buffers, buffers, mx.bfloat16, 8)
        big = tuple(mx.zeros((1, 8, append_cuda.COPY_LIMIT_BYTES // (8 * 64), 16), a.dtype) for a in buffers)
        assert not append_cuda.takes(big, big, mx.float16, 8)
        limit_rows = append_cuda.COPY_LIMIT_BYTES * 8 // (2 * append_cuda.buffer_bytes(buffers))
        assert append_cuda.takes(buffers, buffers, mx.float16, 8, rows=limit_rows)
        assert not append_cuda.takes(buffers, buffers, mx.float16, 8, rows=limit_rows + 1)  # grown past the limit


@on_gpu
def test_a_quantized_caches_decode_steps_through_the_launch_store_what_six_writes_store(monkeypatch):
    """A quantized cache decoding with the one-launch write (pretended here where the
    device is not MLX's CUDA build) holds, after prompt, compressions and decode steps, the
    same rows as the same cache writing each step with mx.quantize and six writes, up to
    the two quantizations' documented differences (none arise on these values: float32
    rows, whose groups straddle zero and hold no value on an exact half; bfloat16 rows
    meet the roundings' differences in a prompt block's many groups, and the kernel's
    bfloat16 codes are checked against the CUDA model above). The prompt's second block
    does not fit the buffers: the launch writes it into grown ones."""
    from camkv import CaMConfig, CaMKVCache

    def run(one_launch: bool):
        if one_launch and not drop.on_cuda():
            monkeypatch.setattr(append_cuda, "takes", lambda *a: True)
        else:
            monkeypatch.undo()
        rng = np.random.default_rng(7)
        cache = CaMKVCache(CaMConfig(budget=16, bits=8, group_size=32, scoring="key", n_sink=2, recent=2))
        for length in (24, 20):
            prompt = mx.array(rng.standard_normal((1, 2, length, 64)).astype(np.float32))
            cache.update_and_fetch(prompt, prompt * 0.5)
        for _ in range(30):
            step = mx.array(rng.standard_normal((1, 2, 1, 64)).astype(np.float32))
            keys, values = cache.update_and_fetch(step, -step)
        mx.eval(keys, values)
        rows = cache._rows.quantized_views()
        return [np.array(a.astype(mx.float32) if a.dtype != mx.uint32 else a) for q in rows for a in q]

    with_launch, with_writes = run(True), run(False)
    for a, b in zip(with_launch, with_writes):
        np.testing.assert_array_equal(a, b)


@on_gpu
def test_quantized_decode_steps_take_the_short_way_on_an_nvidia_gpu(monkeypatch):
    """On MLX's CUDA build (pretended here, kernels emulated) a quantized cache's decode
    steps go the short way (but the first and the one after a compression): update_and_fetch
    holds the step and the hook writes and attends it in one launch (camkv.backends.
    step_cuda), through compressions. A twin cache whose steps are not fused writes each
    step in one launch and hands the rows as stored straight to camkv's pass (both
    counted); the two give the same output, which equals attention over the dequantized
    rows."""
    from camkv import CaMKVCache, hook, quantized_attention
    from camkv.backends import quantized_cuda, step_cuda
    from tiny_models import counted, random_steps, tiny_llama

    monkeypatch.setattr(quantized_cuda, "here", lambda: True)
    monkeypatch.setattr(append_cuda, "takes", lambda *a: True)
    monkeypatch.setattr(step_cuda, "FUSED_STEPS", True)
    writes = counted(monkeypatch, append_cuda, "write")
    passes = counted(monkeypatch, quantized_cuda, "attend")
    fused = counted(monkeypatch, step_cuda, "write_and_attend")
    long_way = counted(monkeypatch, quantized_attention, "attend")  # steps through the hook's checks
    block, query = random_steps(5)
    model = tiny_llama()
    hook.install(model)
    try:
        with cuda_emulation.emulating(quantized_cuda, step_cuda):
            caches = [CaMKVCache(budget=16, n_sink=1, recent=2, slack=4, bits=8, group_size=32) for _ in range(2)]
            caches[1]._fuses_steps = lambda queries: False  # the twin: steps written, then attended
            first, first_queries = (block(40), block(40)), query(40)
            for cache in caches:
                keys, values = cache.update_and_fetch(*first)
                hook.scaled_dot_product_attention(first_queries, keys, values, cache, 0.125, "causal")
            for _ in range(12):
                k, v, q = block(1), block(1), query(1)
                fetched = [cache.update_and_fetch(k, v) for cache in caches]
                assert isinstance(fetched[1][0], tuple)
                fused_out, separate = (hook.scaled_dot_product_attention(q, *f, cache, 0.125, None)
                                       for f, cache in zip(fetched, caches))
                np.testing.assert_array_equal(np.array(fused_out), np.array(separate))
                plain = [quantized.dequantize(r, 8, 32) for r in fetched[1]]
                want = mx.fast.scaled_dot_product_attention(q, *plain, scale=0.125)
                np.testing.assert_allclose(np.array(separate), np.array(want), rtol=1e-4, atol=1e-5)
    finally:
        hook.uninstall(model)
    assert all(cache._plain_step is not None for cache in caches) and caches[0].stats["evictions"] > 0
    # The twin's long way: the first decode step and the step after each of the two
    # compressions (12 writes and passes in all). The fused cache's: the first decode
    # step, then one more written and passed while the short way is found; its other ten
    # steps in one launch each, a compression's next step too (its rows stay plain).
    assert len(long_way) == 3 + 1 and len(fused) == 10
    assert len(writes) == 12 + 2 and len(passes) == 12 + 2


@on_gpu
def test_a_prompt_block_on_an_nvidia_gpu_is_dequantized_from_whole_buffers(monkeypatch):
    """On MLX's CUDA build (pretended here) a quantized cache hands a prompt block's rows
    to attention dequantized (the first block too), and its compression reads them
    dequantized, both from the whole buffers (MLX's CUDA dequantize copies an input that is
    not row-contiguous, as a view of the held rows is): every dequantization of the block
    reads buffers of all their rows, and the hook dequantizes nothing. The rows handed out
    are the stored rows dequantized; the attention's output is the one over those rows."""
    from camkv import CaMKVCache, hook
    from camkv.backends import quantized_cuda
    from tiny_models import counted, random_steps, tiny_llama

    monkeypatch.setattr(quantized_cuda, "here", lambda: True)
    monkeypatch.setattr(quantized, "kernels_here", lambda: False)  # MLX's CUDA build: no bits for mlx-lm
    monkeypatch.setattr(append_cuda, "takes", lambda *a: True)
    block, query = random_steps(9)
    model = tiny_llama()
    hook.install(model)
    try:
        cache = CaMKVCache(budget=16, n_sink=1, recent=2, slack=4, bits=8, group_size=32)
        keys, values = cache.update_and_fetch(block(40), block(40))
        assert type(keys) is mx.array and keys.shape[2] == 40
        hook.scaled_dot_product_attention(query(40), keys, values, cache, 0.125, "causal")
        read, real = [], mx.dequantize
        monkeypatch.setattr(mx, "dequantize", lambda w, *a, **k: read.append(w.shape[2]) or real(w, *a, **k))
        by_hook = counted(monkeypatch, hook, "block_rows")
        for length in (3, 24):  # a block into buffers with room, then one past the budget and slack
            keys, values = cache.update_and_fetch(block(length), block(length))
            rows, stored = cache._rows.keys[0].shape[2], cache._rows.quantized_views()
            out = hook.scaled_dot_product_attention(q := query(length), keys, values, cache, 0.125, "causal")
            if length == 3:
                assert set(read) == {rows} and rows > keys.shape[2]  # whole buffers, not the held rows
                read.clear()
        monkeypatch.setattr(mx, "dequantize", real)
    finally:
        hook.uninstall(model)
    assert type(keys) is mx.array and type(values) is mx.array
    assert set(read) == {rows} and len(read) >= 3 and by_hook == []  # attention's two and the compression's
    want_keys, want_values = (quantized.dequantize(s, 8, 32) for s in stored)
    np.testing.assert_array_equal(np.array(keys), np.array(want_keys))
    np.testing.assert_array_equal(np.array(values), np.array(want_values))
    want = mx.fast.scaled_dot_product_attention(q, want_keys, want_values, scale=0.125, mask="causal")
    np.testing.assert_allclose(np.array(out), np.array(want), rtol=1e-5, atol=1e-6)
