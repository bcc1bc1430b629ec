"""Reconstruction scoring (CaMConfig.prefill_scoring="reconstruct", docs/algorithm.md
section 7): a re-read's mass against float64 arithmetic, the re-read views against the
model's own attention over the same tokens, compressions with a handed-in mass against
those scoring the same mass from queries, the held prompt blocks, the bound the prefill
keeps, the fallback to window scoring, and the refusals."""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import KVCache

import camkv
from camkv import CaMConfig, CaMKVCache
from camkv.prefill import prefill
from camkv import reconstruct
from camkv.reconstruct import FIRST, LATER, Instruction, Reread, span_mass
from conftest import assert_config_refused
from tiny_models import feed_with_queries, tiny_gemma3, tiny_llama


@pytest.fixture(autouse=True)
def queries_come(monkeypatch):
    """Caches fed here directly take the queries they are shown, as from camkv's hook."""
    monkeypatch.setattr(CaMKVCache, "_queries_can_come", lambda self: True)


class CharTokenizer:
    """A tokenizer of one id per character (mod vocab), without a chat template."""

    chat_template = None

    def __init__(self, vocab: int = 128):
        self.vocab = vocab

    def encode(self, text, add_special_tokens=False):
        return [ord(c) % self.vocab for c in text]


class TemplateTokenizer(CharTokenizer):
    chat_template = "a template"

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return f"<user>{messages[0]['content']}</user><assistant>"


def _prompt(n: int, seed: int = 0, vocab: int = 128) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab, n)]


# ---------------------------------------------------------------------------- the mass of a re-read


def _span_mass_f64(queries, keys, scale, held, start, end, bias):
    q, k = np.asarray(queries, np.float64), np.asarray(keys, np.float64)
    B, Hq, L, _ = q.shape
    H, N = k.shape[1], k.shape[2]
    G = Hq // H
    out = np.zeros((B, H, end - start))
    for b in range(B):
        for h in range(H):
            for g in range(G):
                for i in range(L):
                    logits = scale * (k[b, h] @ q[b, h * G + g, i])
                    if bias is not None:
                        logits = logits + np.asarray(bias, np.float64)[b, h]
                    usable = np.isfinite(logits) & (np.arange(N) <= held + i)
                    if not usable.any():
                        continue
                    e = np.where(usable, np.exp(np.where(usable, logits, 0) - logits[usable].max()), 0.0)
                    out[b, h] = np.maximum(out[b, h], (e / e.sum())[start:end])
    return out


@st.composite
def mass_cases(draw):
    held = draw(st.integers(1, 40))
    start = draw(st.integers(0, held - 1))
    return dict(B=draw(st.integers(1, 2)), H=draw(st.integers(1, 3)), G=draw(st.integers(1, 3)), held=held,
                L=draw(st.integers(1, 12)), start=start, end=draw(st.integers(start + 1, held)),
                bias=draw(st.booleans()), poisoned=draw(st.booleans()), seed=draw(st.integers(0, 2**31 - 1)))


@pytest.fixture(params=["numpy", "mlx"])
def arithmetic(request, monkeypatch):
    """span_mass's two ways to a block (NumPy on the CPU, MLX operations elsewhere), both here."""
    if request.param == "mlx":
        monkeypatch.setattr(reconstruct, "_lowest_numpy", reconstruct._lowest_mlx)
    return request.param


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(c=mass_cases())
def test_a_rereads_mass_is_each_rows_largest_weight_from_any_query(arithmetic, c):
    note(f"seed {c['seed']}")
    rng = np.random.default_rng(c["seed"])
    B, H, G, held, L = c["B"], c["H"], c["G"], c["held"], c["L"]
    keys = rng.standard_normal((B, H, held + L, 8)).astype(np.float32) * 2
    queries = rng.standard_normal((B, H * G, L, 8)).astype(np.float32)
    if c["poisoned"]:  # a poisoned key gets nothing, a poisoned query gives nothing, the rest as before
        keys[0, 0, rng.integers(0, held), 0] = np.nan
        queries[0, 0, rng.integers(0, L), 1] = np.inf
    bias = np.log(rng.integers(1, 4, (B, H, held + L))).astype(np.float32) if c["bias"] else None
    got = span_mass(mx.array(queries), mx.array(keys), 0.4, held, c["start"], c["end"],
                    None if bias is None else mx.array(bias))
    want = _span_mass_f64(queries, keys, 0.4, held, c["start"], c["end"], bias)
    np.testing.assert_allclose(np.array(got), want, rtol=2e-5, atol=1e-6)


def test_the_mass_is_a_maximum_not_a_sum_over_queries(arithmetic):
    """Two queries that each give a row one half: the row's mass is 1/2 (a sum says 1)."""
    keys = mx.array([[[[0.0], [0.0], [50.0]]]])  # held rows 0 and 1, then the pass's token
    queries = mx.array([[[[0.0]]]])  # one query, logit 0 everywhere it sees: rows 0, 1 and itself
    got = span_mass(queries, keys, 1.0, 2, 0, 2)
    np.testing.assert_allclose(np.array(got), [[[1 / 3, 1 / 3]]], rtol=1e-6)
    two = mx.array([[[[0.0], [0.0]]]])
    got = span_mass(two, mx.array([[[[0.0], [0.0], [0.0], [0.0]]]]), 1.0, 2, 0, 2)
    np.testing.assert_allclose(np.array(got), [[[1 / 3, 1 / 3]]], rtol=1e-6)


# ---------------------------------------------------------------------------- the re-read views


def test_a_reread_attends_as_the_model_over_the_prompt_and_keeps_nothing():
    """The re-read's logits equal the model's over prompt + re-read ids with a full cache,
    and the cache holds what it held before, bit for bit."""
    model = tiny_llama(layers=2)
    prompt, reread = _prompt(40), _prompt(12, seed=1)
    caches = camkv.make_prompt_cache(model, budget=64, prefill_scoring="reconstruct")
    model(mx.array(prompt)[None], cache=caches)
    before = [copy.deepcopy(c) for c in caches]
    views = [Reread(c, 0, 40) for c in caches]
    got = model(mx.array(reread)[None], cache=views)
    full = [KVCache() for _ in model.layers]
    want = model(mx.array(prompt + reread)[None], cache=full)[:, 40:]
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)
    for c, b in zip(caches, before):
        assert c.offset == b.offset == 40 and c.size() == b.size()
        assert mx.array_equal(c.keys, b.keys) and mx.array_equal(c.values, b.values)
    assert all(v.mass.shape == (1, 2, 40) for v in views)
    camkv.remove(model)


def test_the_instruction_closes_the_users_turn_and_starts_a_later_span_with_the_tokens_before_it():
    tok = TemplateTokenizer()
    inst = Instruction(tok)
    assert inst.ids([]) == tok.encode(FIRST + "</user><assistant>")
    assert inst.ids(list(range(20))) == tok.encode(LATER) + list(range(12, 20)) + tok.encode("</user><assistant>")
    assert Instruction(CharTokenizer()).ids([]) == CharTokenizer().encode(FIRST + "\n")


# ---------------------------------------------------------------------------- compressions with a given mass


def _held_block(cfg, sizes=(24,), seed=0):
    cache = CaMKVCache(cfg)
    cache.hold_prompt(True)
    feed_with_queries(cache, list(sizes), seed=seed)
    cache.hold_prompt(False)
    return cache


@pytest.mark.filterwarnings("ignore::camkv.VotesWarning")  # keepkv's votes: no model attends here
@pytest.mark.parametrize("merge", ["drop", "mass_weighted", "value_norm", "keepkv", "window"])
@pytest.mark.parametrize("backend", ["reference", "ext"])
def test_a_given_mass_compresses_as_the_same_mass_from_queries(merge, backend):
    """compress_pending(mass=m), m the mass the pending queries give (stored()'s scores),
    keeps and merges what compress_pending() does."""
    cfg = CaMConfig(budget=12, n_sink=1, recent=3, merge=merge, backend=backend, prefill_scoring="reconstruct")
    given, own = _held_block(cfg), _held_block(cfg)
    assert given.pending_rows() == 24
    mass = given.stored()[2][:, :, given.size() - given.pending_rows():]
    given.compress_pending(mass=mass)
    own.compress_pending()
    for a, b in zip(given.stored(), own.stored()):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=2e-5, atol=2e-6)
    assert given.size() == own.size() == 12


def test_a_given_mass_decides_who_goes():
    """Rows ranked by the handed-in mass alone: the highest scored of the unprotected stay."""
    cfg = CaMConfig(budget=8, n_sink=1, recent=2, prefill_scoring="reconstruct", backend="reference")
    cache = _held_block(cfg, sizes=(20,))
    mass = np.zeros((1, 2, 20), np.float32)
    favoured = [3, 7, 11, 13, 15]
    mass[:, :, favoured] = np.arange(1, 6, dtype=np.float32)
    cache.compress_pending(mass=mx.array(mass))
    positions = np.array(cache.stored()[3])[0]
    for row in positions:
        assert sorted(row.tolist()) == [0, *favoured, 18, 19]


def test_a_given_mass_of_the_wrong_shape_is_refused_and_nothing_changes():
    cfg = CaMConfig(budget=8, n_sink=1, recent=2, prefill_scoring="reconstruct", backend="reference")
    cache = _held_block(cfg, sizes=(20,))
    before = [np.array(a) for a in cache.stored()]
    with pytest.raises(ValueError, match=r"\[B, H, pending\] = \[1, 2, 20\].*got \(1, 2, 19\)"):
        cache.compress_pending(mass=mx.zeros((1, 2, 19)))
    with pytest.raises(ValueError, match="got list"):
        cache.compress_pending(mass=[0.0])
    assert cache.pending_rows() == 20
    for a, b in zip(before, cache.stored()):
        assert np.array_equal(a, np.array(b))


# ---------------------------------------------------------------------------- holding and the prefill


def test_held_prompt_blocks_stay_pending_and_decode_steps_still_compress():
    cfg = CaMConfig(budget=8, n_sink=1, recent=2, prefill_scoring="reconstruct", backend="reference")
    cache = CaMKVCache(cfg)
    cache.hold_prompt(True)
    feed_with_queries(cache, [10, 10], seed=0)
    assert cache.size() == 20 and cache.pending_rows() == 20  # past budget + slack (9)
    cache.compress_pending()
    feed_with_queries(cache, [1] * 3, seed=1)  # decode steps compress past budget + slack, held or not
    assert cache.size() <= cfg.budget + cfg.slack
    cache.hold_prompt(False)
    unheld = feed_with_queries(CaMKVCache(cfg), [10, 10], seed=0)
    assert unheld.size() == cfg.budget and unheld.pending_rows() == 0


def test_without_the_driver_reconstruct_scores_as_window():
    """Fed by mlx-lm's own loop, a reconstruct cache ends bit for bit as a window cache."""
    window, recon = (CaMKVCache(CaMConfig(budget=10, n_sink=1, recent=2, prefill_scoring=p, backend="reference"))
                     for p in ("window", "reconstruct"))
    for cache in (window, recon):
        feed_with_queries(cache, [9, 9, 1, 1, 1, 9], seed=4)
    for a, b in zip(window.stored(), recon.stored()):
        assert np.array_equal(np.array(a), np.array(b))


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3])
def test_the_prefill_rereads_every_compressed_token_and_stays_bounded(make, monkeypatch):
    """Every compression of the prompt takes its mass from re-reads covering each pending
    row once, the rows held never pass budget + slack + a chunk, the prompt ends at
    most budget rows, and the logits of its last position are the model's over what it held."""
    model = make()
    budget, chunk = 24, 16
    caches = camkv.make_prompt_cache(model, budget=budget, prefill_scoring="reconstruct")
    handed = []
    real = CaMKVCache.compress_pending

    def recording(self, mass=None):
        handed.append((self.pending_rows(), None if mass is None else mass.shape[2]))
        return real(self, mass)

    monkeypatch.setattr(CaMKVCache, "compress_pending", recording)
    logits = prefill(model, caches, _prompt(100), chunk, CharTokenizer())
    assert logits.shape == (128,) and bool(mx.isfinite(logits).all())
    compressions = [h for h in handed if h[1] is not None]
    assert compressions and all(pending == given for pending, given in compressions)
    layers = sum(isinstance(c, CaMKVCache) for c in caches)
    assert sum(given for _, given in compressions) == layers * 100  # every prompt token re-read once
    assert all(c.size() <= budget for c in caches if isinstance(c, CaMKVCache))
    camkv.remove(model)


def test_a_prompt_that_ends_between_budget_and_budget_plus_slack_is_reread_at_its_end(monkeypatch):
    """34 tokens in chunks of 16 under budget 24 + slack 3: the last chunk leaves 26 rows,
    no compression due; the prefill's end re-reads its 2 pending tokens and compresses."""
    model = tiny_llama()
    caches = camkv.make_prompt_cache(model, budget=24, prefill_scoring="reconstruct")
    handed = []
    real = CaMKVCache.compress_pending
    monkeypatch.setattr(CaMKVCache, "compress_pending",
                        lambda self, mass=None: handed.append(None if mass is None else mass.shape[2])
                        or real(self, mass))
    prefill(model, caches, _prompt(34), 16, CharTokenizer())
    assert handed[-len(caches):] == [2] * len(caches)
    assert all(c.size() == 24 and c.pending_rows() == 0 for c in caches)
    camkv.remove(model)


def test_the_prefill_holds_at_most_budget_slack_and_a_chunk(monkeypatch):
    """The prompt's calls (re-reads go to views) never see more rows than budget + slack
    and one chunk; with a chunk past budget + slack they see more than budget + slack."""
    model = tiny_llama()
    caches = camkv.make_prompt_cache(model, budget=24, prefill_scoring="reconstruct")
    seen: list[int] = []
    real = CaMKVCache.update_and_fetch

    def recording(self, keys, values):
        out = real(self, keys, values)
        seen.append(out[0].shape[2])
        return out

    monkeypatch.setattr(CaMKVCache, "update_and_fetch", recording)
    prefill(model, caches, _prompt(120), 16, CharTokenizer())
    cfg = caches[0].config
    assert cfg.budget + cfg.slack < max(seen) <= cfg.budget + cfg.slack + 16
    camkv.remove(model)


def test_the_prefill_of_other_caches_is_unchanged():
    """Window-scored caches and mlx-lm's own are fed as the eval always fed them."""
    model = tiny_llama()
    prompt = _prompt(70)
    logits = prefill(model, [KVCache() for _ in model.layers], prompt, 16)
    want = model(mx.array(prompt)[None], cache=[KVCache() for _ in model.layers])[0, -1]
    np.testing.assert_allclose(np.array(logits), np.array(want), rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------- refusals


def test_reconstruct_is_refused_where_it_cannot_run():
    assert_config_refused({"prefill_scoring": "reconstruct", "prefill": "exact", "slack": 0},
                          ["prefill_scoring='reconstruct'", "prefill='chunk'", "'exact'"])
    assert_config_refused({"prefill_scoring": "reconstruct", "tier_budget": 8, "budget": 64},
                          ["tier_budget=8", "prefill_scoring='reconstruct'", "tier_budget=0"])
    assert_config_refused({"prefill_scoring": "reconstruct", "scoring": "key"},
                          ["prefill_scoring='reconstruct'", "scoring='query'", "scoring='key'"])
    with pytest.raises(ValueError, match="pool=3 needs prefill_scoring='window'"):
        CaMConfig(prefill_scoring="reconstruct", pool=3)


def test_the_prefill_names_what_reconstruction_needs():
    model = tiny_llama()
    caches = camkv.make_prompt_cache(model, budget=24, prefill_scoring="reconstruct")
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        prefill(model, caches, _prompt(40), 16)
    mixed = caches[:1] + camkv.make_prompt_cache(model, budget=24)[1:]
    with pytest.raises(ValueError, match="every camkv cache's"):
        prefill(model, mixed, _prompt(40), 16, CharTokenizer())
    camkv.remove(model)
    bare = [CaMKVCache(CaMConfig(budget=24, prefill_scoring="reconstruct")) for _ in model.layers]
    with pytest.raises(ValueError, match="attention hook"):
        prefill(model, bare, _prompt(40), 16, CharTokenizer())


# ---------------------------------------------------------------------------- the command line


def test_generate_rereads_the_prompt_and_counts_all_of_it(capsys, tiny_model_dir, remove_hooks, monkeypatch):
    """camkv generate --kv-prefill-scoring reconstruct: camkv's prefill re-reads the prompt
    (all but its last token), mlx-lm generates from there, and the summary counts every
    prompt token; the text is what that sequence of calls generates."""
    import re

    from mlx_lm import generate, load

    from camkv import cli

    runs = []
    real = reconstruct.Reconstruction.compress
    monkeypatch.setattr(reconstruct.Reconstruction, "compress", lambda self: runs.append(1) or real(self))
    text = "hello world " * 20
    argv = ["generate", "--model", tiny_model_dir, "--prompt", text, "--max-tokens", "5", "--kv-budget", "24",
            "--kv-sinks", "2", "--kv-recent", "4", "--kv-prefill-scoring", "reconstruct"]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    assert runs, "no re-read ran"
    model, tokenizer = load(tiny_model_dir)
    remove_hooks(model)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    assert re.search(rf"prompt: {len(ids)} tokens", captured.err), captured.err
    cache = camkv.make_prompt_cache(model, budget=24, n_sink=2, recent=4, prefill_scoring="reconstruct")
    prefill(model, cache, ids[:-1], 2048, tokenizer)
    assert captured.out == generate(model, tokenizer, ids[-1:], max_tokens=5, prompt_cache=cache) + "\n"


@pytest.mark.parametrize("command", ["serve", "demo"])
def test_commands_that_cannot_reread_refuse_reconstruct(capsys, command):
    from camkv import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--kv-prefill-scoring", "reconstruct"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--kv-prefill-scoring reconstruct is not offered here" in err and "window" in err


def test_the_stream_task_rereads_its_prefill(monkeypatch):
    """camkv eval's stream windows prefill a reconstruct arm through the re-reads too."""
    from camkv.eval.stream import feed

    runs = []
    real = reconstruct.Reconstruction.compress
    monkeypatch.setattr(reconstruct.Reconstruction, "compress", lambda self: runs.append(1) or real(self))
    model = tiny_llama()
    caches = camkv.make_prompt_cache(model, budget=24, prefill_scoring="reconstruct")
    steps = list(feed(model, caches, _prompt(70), 60, 16, CharTokenizer()))
    assert [first for first, _ in steps] == [0, 16, 32, 48, *range(60, 70)]
    assert runs and caches[0].pending_rows() <= caches[0].config.slack + 10
    camkv.remove(model)


@pytest.mark.filterwarnings("ignore::camkv.VotesWarning")
@pytest.mark.parametrize("fields", [{"bits": 8, "group_size": 32}, {"merge": "keepkv"}, {"merge": "mass_weighted"}])
def test_the_prefill_rereads_quantized_rows_and_rows_with_votes(fields, monkeypatch):
    """A re-read attends quantized rows dequantized and weighs rows by their votes, as the
    model's attention over them does: its logits equal a plain pass over the same rows."""
    model = tiny_llama(hidden=128, heads=4, kv_heads=2)  # head dim 32: a quantization group
    try:
        caches = camkv.make_prompt_cache(model, budget=24, prefill_scoring="reconstruct", **fields)
        prefill(model, caches, _prompt(90), 16, CharTokenizer())
        assert all(c.size() <= 24 for c in caches)
        views = [Reread(c, 0, c.size()) for c in caches]
        reread = mx.array(_prompt(10, seed=3))[None]
        got = model(reread, cache=views)
        # The caches' own call over the same rows: it attends every row held and its tokens
        # (what it evicts shows from the next call on); quantized caches also round the
        # call's own tokens, which a re-read keeps as they are (a few thousandths here).
        want = model(reread, cache=[copy.deepcopy(c) for c in caches])
        tolerance = 2e-2 if "bits" in fields else 2e-4
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=tolerance, atol=tolerance)
        assert all(v.mass.shape[2] == c.size() for v, c in zip(views, caches))
    finally:
        camkv.remove(model)
