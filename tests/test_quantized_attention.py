"""The extension's attention over quantized rows read as stored (camkv.quantized_attention,
docs/algorithm.md section 12): the softmax attention over the rows the codes stand for,
against a float64 reference on random and adversarial inputs, its refusals, and the hook
handing it a quantized cache's decode steps on the CPU."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from mlx_lm.models.base import quantized_scaled_dot_product_attention

import camkv
from camkv import quantized_attention
from camkv.backends import ext

pytestmark = pytest.mark.skipif(ext.unavailable_reason() is not None,
                                reason=f"the extension does not run here: {ext.unavailable_reason()}")

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
EPS = {"float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}


def _rows(rng, B, H, N, D, dtype, bits, group_size, spare, lead=0):
    """Quantized rows [B, H, N, ...] as a cache holds them: views of N rows of buffers with
    `spare` rows of room after them (not contiguous where spare > 0), starting `lead` rows
    in (a batch's rectangle of rows ends at a column and starts where the widest row does)."""
    block = mx.array(rng.standard_normal((B, H, lead + N + spare, D)).astype(np.float32)).astype(dtype)
    q = mx.quantize(block, group_size=group_size, bits=bits)
    return tuple(a[:, :, lead : lead + N] for a in q)


def _dequantized(q, bits, group_size):
    """scale * code + bias in float32 (what the codes stand for, before any rounding to
    the model's dtype)."""
    codes, scales, biases = q
    return mx.dequantize(codes, scales.astype(mx.float32), biases.astype(mx.float32), group_size=group_size,
                         bits=bits)


def _reference(queries, keys, values, scale, mask, bits, group_size):
    """float64 softmax attention over the dequantized rows; query head h * G + g reads KV
    head h; mask additive [B, 1 or H, L, N] or None."""
    k, v = (np.array(_dequantized(q, bits, group_size), np.float64) for q in (keys, values))
    q = np.array(queries.astype(mx.float32), np.float64)
    B, Hq, L, _ = q.shape
    H = k.shape[1]
    G = Hq // H
    k, v = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)
    logits = scale * q @ k.transpose(0, 1, 3, 2)
    if mask is not None:
        logits = logits + np.repeat(np.array(mask, np.float64), Hq // mask.shape[1], axis=1)
    logits -= logits.max(axis=-1, keepdims=True)
    weights = np.exp(logits)
    return (weights / weights.sum(axis=-1, keepdims=True)) @ v


@st.composite
def cases(draw):
    D = draw(st.sampled_from([32, 64, 128]))
    return dict(
        B=draw(st.integers(1, 2)), H=draw(st.integers(1, 3)), G=draw(st.integers(1, 4)), L=draw(st.integers(1, 2)),
        N=draw(st.integers(1, 70)), D=D, Dv=draw(st.sampled_from([d for d in (32, 64, 128) if d >= 32])),
        bits=draw(st.sampled_from([4, 8])), group_size=draw(st.sampled_from([g for g in (32, 64, 128) if g <= D])),
        dtype=draw(st.sampled_from(sorted(DTYPES))), mask=draw(st.sampled_from(["none", "shared", "per_head"])),
        spare=draw(st.sampled_from([0, 5])), lead=draw(st.sampled_from([0, 3])), strided_queries=draw(st.booleans()),
        scale=draw(st.sampled_from([0.125, 1.0, 40.0])), seed=draw(st.integers(0, 2**31 - 1)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_matches_float64_attention_over_the_dequantized_rows(case):
    """Random shapes, dtypes, masks (some logits -inf), strided views (some starting past
    their buffer's first row) and scales up to logits in the hundreds (the softmax must
    subtract its maximum)."""
    note(f"case={case}")
    c = case
    if c["Dv"] % c["group_size"]:
        c["Dv"] = c["D"]
    rng = np.random.default_rng(c["seed"])
    dtype = DTYPES[c["dtype"]]
    Hq = c["H"] * c["G"]
    if c["strided_queries"]:  # [B, L, Hq, D] transposed, as a model's queries come
        queries = mx.array(rng.standard_normal((c["B"], c["L"], Hq, c["D"])).astype(np.float32)).astype(dtype)
        queries = queries.transpose(0, 2, 1, 3)
    else:
        queries = mx.array(rng.standard_normal((c["B"], Hq, c["L"], c["D"])).astype(np.float32)).astype(dtype)
    keys = _rows(rng, c["B"], c["H"], c["N"], c["D"], dtype, c["bits"], c["group_size"], c["spare"], c["lead"])
    values = _rows(rng, c["B"], c["H"], c["N"], c["Dv"], dtype, c["bits"], c["group_size"], c["spare"], c["lead"])
    mask = None
    if c["mask"] != "none":
        heads = 1 if c["mask"] == "shared" else c["H"]
        m = rng.standard_normal((c["B"], heads, c["L"], c["N"])).astype(np.float32)
        m[..., 1:][rng.random(m[..., 1:].shape) < 0.3] = -np.inf  # row 0 stays visible
        mask = mx.array(m)
    got = ext.quantized_attention(queries, keys, values, scale=c["scale"], mask=mask, bits=c["bits"],
                                  group_size=c["group_size"])
    assert got.dtype == dtype and got.shape == (c["B"], Hq, c["L"], c["Dv"])
    expected = _reference(queries, keys, values, c["scale"], mask, c["bits"], c["group_size"])
    got = np.array(got.astype(mx.float32), np.float64)
    # the output's rounding to its dtype, plus float32 sums over N rows of logits up to ~500
    tolerance = 4 * EPS[c["dtype"]] * np.abs(expected).max() + 2e-4 * max(1.0, c["scale"])
    np.testing.assert_allclose(got, expected, atol=tolerance, rtol=0)


def test_rows_alike_and_one_row():
    """Every row the same: the output is that row's value; one row: its value exactly as
    dequantized."""
    rng = np.random.default_rng(3)
    row = mx.array(rng.standard_normal((1, 1, 1, 64)).astype(np.float32))
    for n in (1, 33):
        keys = mx.quantize(mx.broadcast_to(row, (1, 1, n, 64)), group_size=32, bits=8)
        values = keys
        queries = mx.array(rng.standard_normal((1, 2, 1, 64)).astype(np.float32))
        got = ext.quantized_attention(queries, keys, values, scale=0.125, mask=None, bits=8, group_size=32)
        value = mx.dequantize(*[a[:, :, :1] for a in values], group_size=32, bits=8)
        np.testing.assert_allclose(np.array(got), np.broadcast_to(np.array(value), (1, 2, 1, 64)), atol=1e-5)


def test_matches_mlx_lms_quantized_attention_with_a_boolean_mask():
    """quantized_attention.attend reads mlx-lm's masks as mlx-lm's quantized attention does:
    a boolean mask per KV head [B, H, 1, N] (False: not attended), None, "causal"."""
    rng = np.random.default_rng(5)
    B, H, G, N, D = 2, 2, 3, 40, 64
    queries = mx.array(rng.standard_normal((B, H * G, 1, D)).astype(np.float32))
    keys, values = (_rows(rng, B, H, N, D, mx.float32, 4, 64, 0) for _ in range(2))
    boolean = mx.array(rng.random((B, H, 1, N)) < 0.7)
    for mask in (boolean, None, "causal"):
        # mlx-lm scales the queries it is given in place (queries *= scale): hand it a copy
        expected = quantized_scaled_dot_product_attention(mx.array(queries), keys, values, scale=0.125, mask=mask,
                                                          group_size=64, bits=4)
        got = quantized_attention.attend(queries, keys, values, 0.125, mask, 4, 64)
        np.testing.assert_allclose(np.array(got), np.array(expected), atol=2e-5)


def test_masks_it_cannot_read_per_kv_head_are_left_to_mlx_lm():
    queries = mx.zeros((1, 4, 1, 32))
    keys = mx.quantize(mx.ones((1, 2, 8, 32)), group_size=32, bits=8)
    assert quantized_attention.attend(queries, keys, keys, 1.0, mx.zeros((1, 4, 1, 8)), 8, 32) is None
    assert quantized_attention.attend(mx.zeros((1, 4, 2, 32)), keys, keys, 1.0, None, 8, 32) is None  # a block


@pytest.mark.parametrize("change, message", [
    (dict(bits=3), "bits must be 4 or 8, got 3"),
    (dict(group_size=16), "group_size must be 32, 64 or 128, got 16"),
    (dict(queries=mx.zeros((1, 4, 1, 64), mx.int32)), "queries must have dtype float16, bfloat16 or float32"),
    (dict(queries=mx.zeros((1, 3, 1, 64))), "queries' 3 heads must be a multiple of the keys' 2"),
    (dict(queries=mx.zeros((1, 4, 1, 32))), "keys' codes hold 64 channels at bits=8 but the queries have 32"),
    (dict(key_scales=mx.zeros((1, 2, 8, 2), mx.float16)), "keys scales must have the queries' dtype"),
    (dict(value_codes=mx.zeros((1, 2, 7, 16), mx.uint32)), "values.*7 rows"),
    (dict(key_codes=mx.zeros((1, 2, 8, 16), mx.int32)), "keys codes must have dtype uint32"),
    (dict(value_codes=mx.zeros((2, 8, 16), mx.uint32)), r"values codes must be \[B, H, N, D \* bits / 32\]"),
    (dict(mask=mx.zeros((1, 3, 1, 8))), r"mask must be \[B, 1 or H, L, N\] = \[1, 1 or 2, 1, 8\]"),
    (dict(mask=mx.zeros((1, 2, 1, 8), mx.float16)), "mask must have dtype float32"),
])
def test_refuses_bad_input_naming_it(change, message):
    k = mx.quantize(mx.ones((1, 2, 8, 64)), group_size=32, bits=8)
    args = dict(queries=mx.zeros((1, 4, 1, 64)), key_codes=k[0], key_scales=k[1], key_biases=k[2],
                value_codes=k[0], value_scales=k[1], value_biases=k[2], mask=None, bits=8, group_size=32)
    args.update(change)
    from camkv import _ext

    with pytest.raises(ValueError, match=message):
        _ext.quantized_attention(args.pop("queries"), args.pop("key_codes"), args.pop("key_scales"),
                                 args.pop("key_biases"), args.pop("value_codes"), args.pop("value_scales"),
                                 args.pop("value_biases"), scale=1.0, **args)


def test_a_quantized_caches_decode_steps_go_to_the_extension(monkeypatch, remove_hooks):
    """With the hook on the CPU every layer's decode step over quantized rows runs the
    extension's attention (mlx-lm's quantized attention none), and the tokens match those
    of mlx-lm's quantized attention over the same rows."""
    from mlx_lm.generate import generate_step

    from camkv import hook
    from tiny_models import tiny_llama

    model = tiny_llama(hidden=128)  # head dimension 32: one group of 32
    remove_hooks(model)
    prompt = mx.array(np.random.default_rng(0).integers(0, 100, 120).tolist())

    def tokens(cache, steps=12):
        return [int(t) for t, _ in zip((tok for tok, _ in generate_step(prompt, model, prompt_cache=cache,
                                                                         max_tokens=steps)), range(steps))]

    calls = {"extension": 0, "mlx-lm quantized": 0}
    fused, original = ext.quantized_attention, hook._ORIGINAL

    def extension(*args, **kwargs):
        calls["extension"] += 1
        return fused(*args, **kwargs)

    def mlx_lm(queries, keys, values, cache, *rest, **kwargs):
        calls["mlx-lm quantized"] += isinstance(keys, tuple)
        return original(queries, keys, values, cache, *rest, **kwargs)

    fused_cache, plain_cache = (camkv.make_prompt_cache(model, budget=48, bits=8, group_size=32) for _ in range(2))
    monkeypatch.setattr(ext, "quantized_attention", extension)  # the hook is installed by now
    monkeypatch.setattr(hook, "_ORIGINAL", mlx_lm)
    got = tokens(fused_cache)
    layers = len(model.layers)
    steps = calls["extension"]
    assert steps >= 11 * layers and steps % layers == 0 and calls["mlx-lm quantized"] == 0
    monkeypatch.setattr(quantized_attention, "runs_here", lambda queries: False)
    assert tokens(plain_cache) == got
    assert calls == {"extension": steps, "mlx-lm quantized": steps}
