"""A prompt chunk's compressions of every layer, held by the layer group and run together
(camkv.layer_group, camkv.backends.compress.compress_alike), leave every layer's cache as
its own compression would: the same rows, scores, positions, rule state, merges and
counters, before any read and after decode steps."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from test_batch import _drop_buffers_on_cpu
from tiny_models import assert_state_as_alone, tiny_llama

import camkv
from camkv import CaMConfig, layer_group, merges
from camkv.backends import compress, drop

LAYERS = 3
PROMPT = [(7 * i + 3) % 120 for i in range(150)]


@pytest.fixture(scope="module")
def model():
    model = tiny_llama(heads=4, kv_heads=2, layers=LAYERS, vocab=128)
    yield model
    camkv.remove(model)


@pytest.fixture
def on_the_gpu_engines(monkeypatch):
    """A GPU's compressions, pretended on the CPU: prompt chunks on the batched engines
    (compress.gpu_chunk) and merge="drop" in one launch (compress.one_launch, the launch
    stood in for by the drop engine, sequence by sequence); the joined compressions are
    counted by their rows."""
    joined = []
    real_engine = compress._engine

    def engine(backend, inputs, *rest):
        joined.append(inputs.keys.shape[0])
        return real_engine(backend, inputs, *rest)

    def launch(keys, *rest):
        joined.append(keys.shape[0] * keys.shape[1])
        return _drop_buffers_on_cpu(keys, *rest)

    monkeypatch.setattr(compress, "gpu_chunk", lambda backend, cfg, end, settled: end - settled >= 2)
    monkeypatch.setattr(compress, "one_launch", lambda backend, cfg, end: end > cfg.budget and cfg.merge == "drop")
    monkeypatch.setattr(compress, "_engine", engine)
    monkeypatch.setattr(drop, "compress_drop_buffers", launch)
    return joined


def _run(model, cfg: CaMConfig, grouped: bool, monkeypatch) -> tuple[list, list]:
    """The prompt in chunks of 40 through mlx-lm's generate_step, then 12 tokens: each
    layer's state after the prompt's first chunk (read before anything else), and at the
    end, with the merges counted and the cache's own stats."""
    monkeypatch.setattr(layer_group, "GROUPED", grouped)
    cache = camkv.make_prompt_cache(model, cfg)
    model(mx.array(PROMPT[:40])[None], cache=cache)  # one chunk, nothing evaluated yet
    first = [c.state for c in cache]
    cache = camkv.make_prompt_cache(model, cfg)
    steps = generate_step(mx.array(PROMPT), model, prompt_cache=cache, max_tokens=12, prefill_step_size=40)
    tokens = [int(token) for token, _ in steps]
    last = [(c.state, c.stats) for c in cache]
    return first, last, tokens


@pytest.mark.parametrize("merge", ["drop", "drop-engine", *[m for m in merges.offered() if m != "drop"]])
def test_a_chunks_compressions_of_every_layer_run_together_as_each_alone(merge, model, on_the_gpu_engines,
                                                                         monkeypatch):
    """Every layer's cache, grouped, as when each layer compresses alone: after the first
    chunk (read before any other layer's next call) and after the prompt and 12 tokens;
    the grouped compressions took every layer's rows at once."""
    if merge == "drop-engine":  # merge="drop" on the drop engine's operations (a GPU without CUDA)
        monkeypatch.setattr(compress, "one_launch", lambda backend, cfg, end: False)
    rule = "drop" if merge == "drop-engine" else merge
    cfg = CaMConfig(budget=24, recent=4, n_sink=2, merge=rule, merge_keys=merges.rule(rule).keys_allowed)
    got = _run(model, cfg, True, monkeypatch)
    rows_joined = list(on_the_gpu_engines)
    on_the_gpu_engines.clear()
    want = _run(model, cfg, False, monkeypatch)
    one_layer = 2  # KV heads of one layer's one sequence
    assert max(rows_joined) == LAYERS * one_layer and max(on_the_gpu_engines) == one_layer, (rows_joined,)
    assert got[2] == want[2]
    for g, w in zip(got[0], want[0]):
        assert_state_as_alone(g, w, cfg)
    for (g, g_stats), (w, w_stats) in zip(got[1], want[1]):
        assert_state_as_alone(g, w, cfg)
        assert g_stats == w_stats


def test_layers_whose_gate_draws_apart_compress_apart(model, on_the_gpu_engines, monkeypatch):
    """With the merge gate on, each layer's draws are its own seed's (make_prompt_cache
    seeds layers apart): their compressions are not joined, and come out as alone."""
    cfg = CaMConfig(budget=24, recent=4, n_sink=2, merge="mean", gate=True)
    got = _run(model, cfg, True, monkeypatch)
    assert max(on_the_gpu_engines) == 2
    want = _run(model, cfg, False, monkeypatch)
    for (g, _), (w, _) in zip(got[1], want[1]):
        assert_state_as_alone(g, w, cfg)


def test_configs_alike_but_for_the_seed_share_a_compression_only_where_no_gate_draws():
    a, b = CaMConfig(merge="mean"), CaMConfig(merge="mean", seed=7)
    assert a.alike(a) and a.alike(b) and b.alike(a)
    gated = a.replace(gate=True)
    assert not gated.alike(gated.replace(seed=7)) and gated.alike(gated.replace(seed=7), draws=False)
    assert not a.alike(a.replace(budget=600)) and not a.alike(b.replace(budget=600))


def test_a_held_compression_is_the_cache_s_before_any_read(model, on_the_gpu_engines, monkeypatch):
    """A layer's compression held for the group runs before the cache is read or copied:
    what is pending, size, the merges so far and a deep copy see the compressed rows, and
    the copy does not run the original's held compression again."""
    import copy

    cfg = CaMConfig(budget=24, recent=4, n_sink=2, merge="mean")
    cache = camkv.make_prompt_cache(model, cfg)
    model(mx.array(PROMPT[:40])[None], cache=cache)
    assert all(c._owed is not None for c in cache)  # held, all three
    assert cache[1].pending_scale is None and all(c._owed is None for c in cache)  # all scored
    assert cache[1].size() == 24
    model(mx.array(PROMPT[40:80])[None], cache=cache)
    clone = copy.deepcopy(cache[2])
    assert clone._owed is None and cache[2]._owed is None and clone.size() == cache[2].size() == 24
    assert int(cache[0].stats["merges"]) > 0
    np.testing.assert_array_equal(np.array(clone.state[3]), np.array(cache[2].state[3]))



@pytest.mark.skipif(not (drop.on_cuda() or mx.metal.is_available()), reason="no GPU: its engines run only there")
@pytest.mark.parametrize("merge", ["drop", "mean", "keepkv", "window"])
def test_on_this_gpu_a_chunks_compressions_run_together_as_each_alone(merge, model, monkeypatch):
    """The same on a GPU's own engines and kernels (drop's one launch on CUDA, the merge
    kernels): grouped as alone, within a GPU's rounding (products over more rows)."""
    cfg = CaMConfig(budget=24, recent=4, n_sink=2, merge=merge, merge_keys=merges.rule(merge).keys_allowed)
    got, want = _run(model, cfg, True, monkeypatch), _run(model, cfg, False, monkeypatch)
    assert got[2] == want[2]
    for (g, _), (w, _) in zip(got[1], want[1]):
        assert_state_as_alone(g, w, cfg)


@pytest.mark.parametrize("merge", ["drop", "mean"])
def test_a_chunks_compressions_join_no_more_layers_than_one_block_of_logits_holds(merge, model, on_the_gpu_engines,
                                                                                   monkeypatch):
    """Where only two layers' logits fit one block of camkv.mass (compress.joinable), the
    three layers' compressions run as two (two layers, then one), still as each alone."""
    monkeypatch.setattr(compress, "joinable", lambda backend, rows, chunk: 2)
    cfg = CaMConfig(budget=24, recent=4, n_sink=2, merge=merge)
    got = _run(model, cfg, True, monkeypatch)
    assert max(on_the_gpu_engines) == 2 * 2 and 2 in on_the_gpu_engines, on_the_gpu_engines
    want = _run(model, cfg, False, monkeypatch)
    for (g, _), (w, _) in zip(got[1], want[1]):
        assert_state_as_alone(g, w, cfg)


def test_joined_logits_stay_within_one_block_of_the_mass():
    """compress.joinable: the joined chunk's logits (rows x query groups x observed queries
    x rows held, at the reducer's bytes a logit) fit mass.MASS_BYTES, and one more would not."""
    from types import SimpleNamespace

    from camkv import mass, policy
    from camkv.buffers import RowBuffers

    cfg = CaMConfig(budget=512)
    rows = RowBuffers(cfg.budget + 1)
    rows.keys, rows.settled = mx.zeros((1, 8, 2560, 64), mx.bfloat16), 512
    chunk = compress.Chunk(2560, mx.zeros((8, 4, 32, 64)), 0.125, False, cfg, mx.zeros((8,), mx.uint32))
    joined = compress.joinable(SimpleNamespace(target="cuda"), rows, chunk)
    per_logit = drop.reducer().logit_bytes(mx.float32 if not drop.on_cuda() else mx.bfloat16)
    one = 8 * 4 * policy.observed(cfg, 2048) * 2560 * per_logit
    assert joined * one <= mass.MASS_BYTES < (joined + 1) * one
