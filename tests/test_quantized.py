"""Quantized rows (CaMConfig.bits): storage, compression, attention, bytes, save/load, batches."""

from __future__ import annotations

import copy
import inspect

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.base import quantized_scaled_dot_product_attention

import camkv
from camkv import CaMConfig, CaMKVCache, quantized
from camkv.batch import BatchCaMKVCache
from conftest import assert_config_refused
from tiny_models import assert_state_as_alone, batch_of_lone_caches, tiny_llama

B, H, D = 1, 2, 64


def _blocks(n: int, seed: int, dtype=mx.float32):
    mx.random.seed(seed)
    return mx.random.normal((B, H, n, D)).astype(dtype), mx.random.normal((B, H, n, D)).astype(dtype)


def _decoded(cache, steps: int, seed: int = 1, prompt: int = 40):
    """Feed a prompt block, then `steps` one-token steps; return each step's attention output
    [B, H, steps, D] (one random query a step) and the tokens fed, in order."""
    keys, values = _blocks(prompt + steps, seed)
    queries = mx.random.normal((B, H, steps, D))
    cache.update_and_fetch(keys[:, :, :prompt], values[:, :, :prompt])
    outputs = []
    for t in range(steps):
        k, v = cache.update_and_fetch(keys[:, :, prompt + t : prompt + t + 1], values[:, :, prompt + t : prompt + t + 1])
        q = queries[:, :, t : t + 1]
        if isinstance(k, tuple):
            o = quantized_scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask=None,
                                                       group_size=cache.group_size, bits=cache.bits)
        else:
            o = mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask=None)
        outputs.append(o)
    return mx.concatenate(outputs, axis=2), keys, values


def _cache(**fields):
    return CaMKVCache(**{"budget": 32, "scoring": "key", **fields})


# ------------------------------------------------------------------ config
@pytest.mark.parametrize("fields, words", [
    ({"bits": 3}, ["bits", "3", "8, 4"]),
    ({"bits": 16}, ["bits", "16"]),
    ({"bits": True}, ["bits", "True"]),
    ({"bits": "4"}, ["bits", "'4'"]),
    ({"bits": 4, "group_size": 48}, ["group_size", "48", "32, 64, 128"]),
    ({"group_size": 0}, ["group_size", "0"]),
])
def test_bad_bits_and_group_sizes_are_refused_naming_the_value(fields, words):
    assert_config_refused(fields, words)


def test_a_group_that_does_not_divide_the_head_dimension_is_refused_before_anything_is_held():
    cache = _cache(bits=4, group_size=128)
    keys, values = _blocks(8, 0)
    with pytest.raises(ValueError, match="group_size=128 must divide the key head dimension 64"):
        cache.update_and_fetch(keys, values)
    assert cache.empty() and cache.offset == 0 and cache.nbytes == 0


def _read_quantized(cache) -> tuple | None:
    """(bits, group_size) the cache tells attention to read its rows with, None without;
    asserting they are plain instance attributes, no class attribute (a property)."""
    for name in ("bits", "group_size"):
        # mlx-lm asks hasattr(cache, "bits") at every layer and step: a property there
        # would be called, and raise AttributeError, for every unquantized cache.
        assert inspect.getattr_static(type(cache), name, None) is None
    if not hasattr(cache, "bits"):
        assert not hasattr(cache, "group_size")
        return None
    assert cache.__dict__["bits"] == cache.bits and cache.__dict__["group_size"] == cache.group_size
    return cache.bits, cache.group_size


def test_bits_are_attributes_present_only_where_attention_reads_the_rows_quantized(monkeypatch):
    quantized_here = (4, 32) if quantized.kernels_here() else None
    assert _read_quantized(_cache()) is None
    assert _read_quantized(_cache(bits=4, tier_budget=8)) is None  # a tier: arrays, the tier's first
    cache = _cache(bits=4, group_size=32)
    assert _read_quantized(cache) == quantized_here
    # Wherever the config is set: a new config, a copy, a loaded state.
    cache.config = CaMConfig(budget=32, scoring="key")
    assert _read_quantized(cache) is None
    cache.config = CaMConfig(budget=32, scoring="key", bits=8)
    assert _read_quantized(cache) == (None if quantized_here is None else (8, 64))
    cache.update_and_fetch(*_blocks(40, 0))
    assert _read_quantized(copy.deepcopy(cache)) == _read_quantized(cache)
    assert _read_quantized(CaMKVCache.from_state(cache.state)) == _read_quantized(cache)
    assert _read_quantized(CaMKVCache.from_state(_cache().state)) is None
    # A batch reads its rows as they are read alone (they share bits and group_size).
    batch = BatchCaMKVCache([_cache(bits=4, group_size=32), _cache(bits=4, group_size=32)])
    assert _read_quantized(batch) == quantized_here
    batch.filter([])
    assert _read_quantized(batch) is None
    batch.extend(BatchCaMKVCache([_cache(bits=4, group_size=32)]))
    assert _read_quantized(batch) == quantized_here
    assert _read_quantized(BatchCaMKVCache([_cache(), _cache()])) is None
    monkeypatch.setattr(quantized, "kernels_here", lambda: False)  # MLX's CUDA build
    assert _read_quantized(_cache(bits=4)) is None


def test_config_round_trips_through_json():
    config = CaMConfig(bits=4, group_size=32)
    assert CaMConfig.from_json(config.to_json()) == config


# ------------------------------------------------------------------ storage and compression
@pytest.mark.parametrize("bits", [8, 4])
def test_decode_attends_within_quantization_error_of_the_unquantized_cache(bits):
    # Recency eviction keeps the same positions either way: what differs is only rounding.
    plain_out, *_ = _decoded(_cache(eviction="recency", backend="reference"), 90)
    quant_cache = _cache(eviction="recency", bits=bits, backend="reference")
    quant_out, *_ = _decoded(quant_cache, 90)
    assert quant_cache.stats["evictions"] > 0
    error = mx.abs(quant_out - plain_out).max().item()
    # One quantization step of a unit normal's range (about 8 / 2^bits) bounds each
    # channel's rounding; an attention output averages rounded values.
    assert 0 < error < 8 / 2**bits


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("merge", ["drop", "mass_weighted"])
def test_a_survivor_keeps_the_codes_it_was_written_with(bits, merge):
    """Rows that outlive many compressions are the ones rounded once: each held key (and a
    value no merge touched) dequantizes to its token's key quantized once."""
    cache = _cache(bits=bits, merge=merge, backend="reference")
    _, keys, values = _decoded(cache, 200)
    assert cache.stats["evictions"] > 0
    held_keys, held_values, _, positions = cache.stored()
    once = lambda x: mx.dequantize(*mx.quantize(x, group_size=64, bits=bits), group_size=64, bits=bits)
    p = positions[0, 0]
    assert mx.array_equal(held_keys[0, 0], once(keys[0, 0][p]))
    if merge == "drop":
        assert mx.array_equal(held_values[0, 0], once(values[0, 0][p]))
    else:
        assert cache.stats["merges"] > 0
        # A merged value is its blend quantized once: it is on a quantization grid again.
        again = once(held_values)
        assert mx.array_equal(again, held_values) or mx.abs(again - held_values).max().item() < 8 / 2**bits


def test_survivor_sources_finds_each_survivor_in_the_rows_before():
    before = mx.array([[0, 1, 5, 6, 9, 12], [0, 2, 3, 4, 8, 10]], mx.int32)
    after = mx.array([[0, 6, 12], [3, 4, 10]], mx.int32)
    assert quantized.survivor_sources(before, after).tolist() == [[0, 3, 5], [2, 3, 5]]


# ------------------------------------------------------------------ bytes
@pytest.mark.parametrize("bits, most", [(4, 0.32), (8, 0.55)])
def test_quantized_rows_hold_at_most_their_share_of_bf16_rows_at_budget_512(bits, most):
    held = {}
    for b in (None, bits):
        cache = CaMKVCache(budget=512, bits=b, scoring="key", eviction="recency", backend="reference")
        keys, values = _blocks(600, 0, mx.bfloat16)
        cache.update_and_fetch(keys, values)
        cache.stored()
        assert cache.size() == 512
        held[b] = cache.nbytes
        if b is not None:  # nbytes is what the buffers really hold for those rows
            codes_k, codes_v = cache.keys, cache.values
            real = sum(a.nbytes for a in (*codes_k, *codes_v)) + 8 * H * cache.size()
            assert cache.nbytes == real
    assert held[bits] <= most * held[None]


# ------------------------------------------------------------------ attention through a model
@pytest.fixture
def model(remove_hooks):
    model = tiny_llama(heads=4, kv_heads=2, hidden=256, vocab=128)  # head dim 64
    remove_hooks(model)
    return model


def _prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 128, n).tolist()


def _logprobs(model, cache, prompt, n: int = 12):
    steps = list(generate_step(mx.array(prompt), model, max_tokens=n, prompt_cache=cache))
    return [int(t) for t, _ in steps], np.stack([np.array(lp) for _, lp in steps])


@pytest.mark.parametrize("bits", [8, 4])
def test_a_model_attends_quantized_rows_scored_by_its_own_queries(model, bits):
    prompt = _prompt(150)
    plain = camkv.make_prompt_cache(model, budget=48, eviction="recency")
    _, expected = _logprobs(model, plain, prompt)
    cache = camkv.make_prompt_cache(model, budget=48, eviction="recency", bits=bits)
    # mlx-lm's quantized attention reads bits and group_size where MLX has its quantized
    # kernels; elsewhere (its CUDA build) the cache hands attention dequantized rows.
    assert all(hasattr(c, "bits") == hasattr(c, "group_size") == quantized.kernels_here() for c in cache)
    _, got = _logprobs(model, cache, prompt)
    stats = cache[0].stats
    assert stats["query_scored"] == stats["tokens_seen"] and stats["evictions"] > 0
    gap = np.abs(got - expected).max()
    assert 0 < gap < {8: 0.05, 4: 1.0}[bits]


def test_without_quantized_kernels_rows_are_dequantized_for_attention(model, monkeypatch):
    """Neither MLX's quantized attention nor camkv's pass over the rows as stored: the
    cache hands attention its rows dequantized (forced here), which attends as the
    quantized kernels do."""
    from camkv.backends import quantized_cuda

    prompt = _prompt(150)
    cache = camkv.make_prompt_cache(model, budget=48, bits=8)
    _, expected = _logprobs(model, cache, prompt)
    monkeypatch.setattr(quantized, "kernels_here", lambda: False)
    monkeypatch.setattr(quantized_cuda, "here", lambda: False)
    cache = camkv.make_prompt_cache(model, budget=48, bits=8)
    assert not hasattr(cache[0], "bits")
    _, got = _logprobs(model, cache, prompt)
    keys, values = cache[0].attended()
    assert isinstance(keys, mx.array) and keys.dtype == mx.float32
    assert mx.array_equal(keys, mx.dequantize(*cache[0].keys, group_size=64, bits=8))
    np.testing.assert_allclose(got, expected, atol=1e-3)


def test_generate_summary_counts_quantized_bytes(model):
    from camkv.cli import kv_summary

    prompt = _prompt(150)
    caches = {bits: camkv.make_prompt_cache(model, budget=48, bits=bits) for bits in (None, 4)}
    for cache in caches.values():
        _logprobs(model, cache, prompt, n=2)
    summary = {bits: kv_summary(cache) for bits, cache in caches.items()}
    assert summary[4]["full"] == summary[None]["full"]  # a full cache is the model's dtype either way
    assert summary[4]["held"] == sum(c.nbytes for c in caches[4]) < summary[None]["held"] / 3


# ------------------------------------------------------------------ save and load
def test_saved_quantized_cache_loads_the_same_codes_and_continues_identically(model, tmp_path):
    prompt = _prompt(121)
    cache = camkv.make_prompt_cache(model, budget=48, bits=4, group_size=32)
    model(mx.array(prompt[:-1])[None], cache=cache)
    path = camkv.save_prompt_cache(str(tmp_path / "q"), cache)
    loaded = camkv.load_prompt_cache(path)
    for before, after in zip(cache, loaded):
        assert after.config == before.config and after.nbytes == before.nbytes
        for a, b in zip((*before.keys, *before.values), (*after.keys, *after.values)):
            assert a.dtype == b.dtype and mx.array_equal(a, b)
    tokens, logprobs = _logprobs(model, cache, prompt[-1:])
    tokens_loaded, logprobs_loaded = _logprobs(model, loaded, prompt[-1:])
    assert tokens_loaded == tokens
    np.testing.assert_allclose(logprobs_loaded, logprobs, atol=1e-6)


# ------------------------------------------------------------------ batches
@pytest.mark.parametrize("bits", [8, 4])
def test_a_batch_of_quantized_rows_decodes_each_row_as_alone(model, bits, on_the_cpu):
    """Each row's whole state (codes, scales and biases, scores, positions, counters, the
    pending queries) is the lone run's: the batch writes every row's quantized key, value
    and query into its shared rectangle (a row compressing takes its codes back), and
    attention reads the rectangle as a lone row's attention reads its codes."""
    prompts = [_prompt(130, 1), _prompt(70, 2)]
    alone, batch = batch_of_lone_caches(model, prompts, budget=32, bits=bits)
    # Attention reads the rows quantized where MLX has its quantized kernels.
    assert all(_read_quantized(layer) == ((bits, 64) if quantized.kernels_here() else None) for layer in batch)
    token = mx.array([[5], [9]])
    steps = 42  # past budget + slack: each row compresses inside the batch, then keeps 2 steps' queries
    shared = 0  # steps every row decoded in the batch's shared rectangle of codes
    for _ in range(steps):
        logits = model(token, cache=batch)
        token = mx.argmax(logits[:, -1:], axis=-1)
        lent = batch[0]._lent
        shared += bool(lent) and all(lent)
        # A lent row holds no buffers of its own: one copy of its codes.
        assert all(row._rows.keys is None for row, on in zip(batch[0]._rows, lent or []) if on)
    assert shared > steps // 2  # the steps without a compression are the rectangle's
    for b, cache in enumerate(alone):
        row_token = mx.array([[5, 9][b]])[None]
        for _ in range(steps):
            logits = model(row_token.reshape(1, 1), cache=cache)
            row_token = mx.argmax(logits[:, -1:], axis=-1)
        for layer, single in zip(batch, cache):
            row = layer.extract(b)
            assert row.stats["evictions"] == single.stats["evictions"] > 0
            assert row.state[-1].shape[2] == 2  # the pending steps' queries are compared too
            assert_state_as_alone(row.state, single.state, row.config)


def test_the_queries_a_quantized_row_keeps_are_the_models(model):
    """mlx-lm's quantized attention scales its queries in place (`queries *= scale`) after
    the hook handed them over: the cache keeps them as handed over. The first layer's
    queries do not depend on the cache, so the quantized rows keep the plain rows' queries."""
    prompt, steps = _prompt(130), [5, 9]
    kept = {}
    for bits in (None, 8):
        cache = camkv.make_prompt_cache(model, budget=32, bits=bits)
        model(mx.array(prompt)[None], cache=cache)
        for token in steps:
            model(mx.array([[token]]), cache=cache)
        kept[bits] = cache[0].state[-1]
    assert hasattr(cache[0], "bits") == quantized.kernels_here()
    assert kept[8].shape[2] == len(steps)
    assert mx.array_equal(kept[8], kept[None])


def test_a_batch_refuses_rows_of_different_bits():
    rows = [CaMKVCache(bits=8), CaMKVCache(bits=4)]
    with pytest.raises(ValueError, match="share bits and group_size.*bits=4.*bits=8"):
        BatchCaMKVCache(rows)
    batch = BatchCaMKVCache([CaMKVCache(bits=8)])
    with pytest.raises(ValueError, match="share bits"):
        batch.extend(BatchCaMKVCache([CaMKVCache()]))
    assert len(batch) == 1


@pytest.mark.parametrize("merge", ["drop", "keepkv"])
def test_a_prompt_block_attends_quantized_rows_dequantized_once(model, monkeypatch, merge):
    """A block of several queries attends quantized rows dequantized, through mlx-lm's
    plain attention (MLX's quantized product has no BLAS on the CPU); a decode step
    reads them as stored (on the CPU through the extension's attention). Both attend the
    values the codes stand for: the logits match those of a cache whose rows attention
    always gets dequantized (with keepkv's votes, whose mask then is per query head)."""
    from camkv import hook
    from camkv.backends import ext, quantized_cuda

    seen = []
    original, fused = hook._ORIGINAL, ext.quantized_attention

    def attention(queries, keys, values, cache, *rest, **kwargs):  # plain: mlx-lm reads arrays
        seen.append((queries.shape[2], isinstance(keys, tuple), not hasattr(cache, "bits")))
        return original(queries, keys, values, cache, *rest, **kwargs)

    def extension(queries, keys, values, **kwargs):
        seen.append((queries.shape[2], isinstance(keys, tuple), False))
        return fused(queries, keys, values, **kwargs)

    def cuda_pass(queries, keys, *rest):
        seen.append((queries.shape[2], isinstance(keys, tuple), False))
        return cuda_fused(queries, keys, *rest)

    prompt = _prompt(150)
    cache = camkv.make_prompt_cache(model, budget=48, merge=merge, bits=8)  # installs the hook
    cuda_fused = quantized_cuda.attend
    with monkeypatch.context() as m:
        m.setattr(hook, "_ORIGINAL", attention)
        m.setattr(ext, "quantized_attention", extension)
        m.setattr(quantized_cuda, "attend", cuda_pass)
        _, got = _logprobs(model, cache, prompt)
    assert cache[0].stats["query_scored"] == cache[0].stats["tokens_seen"]
    blocks, steps = [s for s in seen if s[0] > 1], [s for s in seen if s[0] == 1]
    assert blocks and all(not quantized_keys and plain for _, quantized_keys, plain in blocks)
    as_stored = quantized.kernels_here() or quantized_cuda.here()
    assert steps and all(quantized_keys == as_stored for _, quantized_keys, _ in steps)
    monkeypatch.setattr(quantized, "kernels_here", lambda: False)
    _, expected = _logprobs(model, camkv.make_prompt_cache(model, budget=48, merge=merge, bits=8), prompt)
    np.testing.assert_allclose(got, expected, atol=1e-3)


def _attend_dequantized(queries, keys, values, scale, mask, bits, group_size):
    """What camkv's CUDA pass computes (tests/test_quantized_cuda.py holds it to this on a
    GPU): softmax attention over the dequantized rows, mask additive per KV head."""
    k, v = (quantized.dequantize(q, bits, group_size).astype(mx.float32) for q in (keys, values))
    G = queries.shape[1] // k.shape[1]
    logits = scale * queries.astype(mx.float32) @ mx.repeat(k, G, axis=1).swapaxes(2, 3)
    if mask is not None:
        logits = logits + mx.repeat(mask, queries.shape[1] // mask.shape[1], axis=1)
    return (mx.softmax(logits, axis=-1) @ mx.repeat(v, G, axis=1)).astype(queries.dtype)


@pytest.mark.parametrize("takes", [True, False])
@pytest.mark.parametrize("merge", ["drop", "keepkv"])
def test_on_cuda_the_hook_attends_decode_steps_over_the_rows_as_stored(model, monkeypatch, merge, takes):
    """On MLX's CUDA build (no quantized attention for a cache's shapes) a cache the hook
    has fed hands attention its rows as stored, without bits, and the hook runs each
    decode step through camkv's CUDA pass (stood in for here by the computation it is
    held to), or, where that pass does not take the step, attends the rows dequantized:
    the logits of a cache that hands attention its rows dequantized either way."""
    from camkv import hook
    from camkv.backends import quantized_cuda

    monkeypatch.setattr(quantized, "kernels_here", lambda: False)  # MLX's CUDA build
    prompt = _prompt(150)
    _, expected = _logprobs(model, camkv.make_prompt_cache(model, budget=48, merge=merge, bits=8), prompt)
    seen, original = [], hook._ORIGINAL

    def attention(queries, keys, values, cache, *rest, **kwargs):
        seen.append(("mlx-lm", queries.shape[2], isinstance(keys, tuple), cache is None))
        return original(queries, keys, values, cache, *rest, **kwargs)

    def kernel(queries, keys, values, *rest):
        seen.append(("camkv", queries.shape[2], isinstance(keys, tuple), True))
        return _attend_dequantized(queries, keys, values, *rest)

    cache = camkv.make_prompt_cache(model, budget=48, merge=merge, bits=8)
    assert not hasattr(cache[0], "bits")
    with monkeypatch.context() as m:
        m.setattr(quantized_cuda, "here", lambda: True)
        m.setattr(quantized_cuda, "takes", lambda *a: takes)
        m.setattr(quantized_cuda, "attend", kernel)
        m.setattr(hook, "_ORIGINAL", attention)
        _, got = _logprobs(model, cache, prompt)
    steps = [s for s in seen if s[1] == 1]
    assert steps and all(s == (("camkv" if takes else "mlx-lm"), 1, takes, True) for s in steps), set(steps)
    assert all(not quantized_rows for who, _, quantized_rows, _ in seen if who == "mlx-lm")  # arrays only
    np.testing.assert_allclose(got, expected, atol=1e-3)


@pytest.mark.parametrize("where", ["here", "cuda"])
def test_a_batch_attends_its_rectangle_of_codes_as_each_row_alone(model, monkeypatch, where):
    """A batch of quantized rows decodes in one rectangle of codes: each step's attention
    reads every row's codes at once (one call with B = 2: camkv's pass on the CPU, its CUDA
    pass on MLX's CUDA build, stood in for on "cuda" by the computation it is held to), and
    each row's logits are its lone run's (steps before any row compresses): equal to float32
    rounding on the CPU; on a GPU within 0.05, the 8-bit rows' own reach (the GPU's products
    for two rows differ from one row's in the last bits, which may round a value to the
    next code; tiny_models.exactly_on_the_cpu)."""
    from camkv import quantized_attention
    from camkv.backends import quantized_cuda

    if where == "cuda":
        monkeypatch.setattr(quantized, "kernels_here", lambda: False)
        monkeypatch.setattr(quantized_cuda, "here", lambda: True)
        monkeypatch.setattr(quantized_cuda, "takes", lambda *a: True)
        monkeypatch.setattr(quantized_cuda, "attend", _attend_dequantized)
    batches, original = [], quantized_attention.attend

    def attend(queries, keys, *rest):
        batches.append(keys[0].shape[0])
        return original(queries, keys, *rest)

    monkeypatch.setattr(quantized_attention, "attend", attend)
    alone, batch = batch_of_lone_caches(model, [_prompt(130, 1), _prompt(70, 2)], budget=32, bits=8)
    steps = [[5, 9], [17, 3], [40, 41]]  # fewer than the slack: no row compresses
    got = [model(mx.array(tokens)[:, None], cache=batch)[:, -1] for tokens in steps]
    assert batches.count(2) == len(steps) * len(batch)  # every layer, every step: one call for both rows
    for b, cache in enumerate(alone):
        for tokens, logits in zip(steps, got):
            expected = model(mx.array([[tokens[b]]]), cache=cache)[0, -1]
            np.testing.assert_allclose(np.array(logits[b]), np.array(expected),
                                       atol=1e-5 if mx.default_device() == mx.cpu else 0.05)


def test_votes_weigh_quantized_attention_per_kv_head(model):
    """A rule whose rows stand for several tokens (keepkv) has the hook add their log votes
    to the logits; mlx-lm's quantized attention reads that mask per KV head (GQA 4 on 2)."""
    prompt = _prompt(150)
    plain = camkv.make_prompt_cache(model, budget=48, merge="keepkv")
    _, expected = _logprobs(model, plain, prompt)
    cache = camkv.make_prompt_cache(model, budget=48, merge="keepkv", bits=8)
    _, got = _logprobs(model, cache, prompt)
    assert cache[0].stats["merges"] > 0
    assert np.abs(got - expected).max() < 0.1  # rounding, and the evictions it moves


# ------------------------------------------------------------------ sharding
def test_a_shard_of_the_heads_stores_what_the_whole_cache_stores_for_them():
    """Tensor sharding splits the KV heads over ranks; a row is quantized on its own (groups
    run along a head's channels), so a rank holding heads 2..3 of 4 holds their codes."""
    mx.random.seed(3)
    keys, values = mx.random.normal((1, 4, 90, D)), mx.random.normal((1, 4, 90, D))
    fields = dict(budget=32, scoring="key", bits=4, merge="mass_weighted", gate=True, backend="reference")
    whole, half = CaMKVCache(**fields), CaMKVCache(**fields, head_offset=2, n_heads_global=4)
    for t in range(0, 90, 10):
        whole.update_and_fetch(keys[:, :, t : t + 10], values[:, :, t : t + 10])
        half.update_and_fetch(keys[:, 2:, t : t + 10], values[:, 2:, t : t + 10])
    assert whole.stats["merges"] > 0
    for a, b in zip((*whole.keys, *whole.values), (*half.keys, *half.values)):
        assert mx.array_equal(a[:, 2:], b)
    assert half.nbytes * 2 == whole.nbytes


def test_a_pipeline_send_attaches_to_the_quantized_keys():
    """mlx-lm's pipelined models send with cache.keys = mx.depends(cache.keys, h)."""
    cache = _cache(bits=8)
    keys, values = _blocks(5, 0)
    cache.update_and_fetch(keys, values)
    before = cache.keys
    cache.keys = mx.depends(cache.keys, mx.array(1.0))
    assert all(mx.array_equal(a, b) for a, b in zip(cache.keys, before))
    with pytest.raises(ValueError, match=r"\(1, 2, 5, 16\), \(1, 2, 5, 1\), \(1, 2, 5, 1\)"):
        cache.keys = keys


@pytest.mark.parametrize("merge", ["drop", "keepkv"])
def test_reading_a_quantized_caches_state_dequantizes_nothing(merge, monkeypatch):
    """A quantized cache's state hands its rows out as stored (codes, scales, biases) with
    the scores, positions and a rule's votes: reading it (mlx-lm does after every prompt
    chunk, and a save does) builds no dequantization of the rows, which it would not use."""
    cache = CaMKVCache(CaMConfig(budget=16, bits=8, group_size=32, scoring="key", merge=merge))
    keys, values = _blocks(37, 3)
    cache.update_and_fetch(keys, values)
    calls = []
    real = quantized.QuantizedRowBuffers.dequantize
    monkeypatch.setattr(quantized.QuantizedRowBuffers, "dequantize", lambda self, x: calls.append(1) or real(self, x))
    state = cache.state
    assert not calls
    assert isinstance(state[0], tuple) and state[2].shape == (B, H, cache._rows.held)
