"""Batched generation with camkv: mlx-lm's batch_generate / BatchGenerator over BatchCaMKVCache."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator, batch_generate, generate_step
from mlx_lm.models.cache import ChunkedKVCache, KVCache
from mlx_lm.tokenizer_utils import TokenizerWrapper

import camkv
from camkv import CaMKVCache
from camkv.backends import drop
from camkv.backends import compress
from camkv.batch import _ROOM, BatchCaMKVCache
from tiny_models import assert_scores_as_alone, byte_tokenizer, tiny_llama

# Shorter than the small budget, near it, and far longer; more than the prefill step.
LENGTHS = [5, 40, 130, 300, 77, 520]
PROMPTS = [[(7 * i + 13 * j + 1) % 250 for i in range(n)] for j, n in enumerate(LENGTHS)]
STEP = 64  # prefill step: the long prompts are prefilled in several chunks
BUDGET = 32


@pytest.fixture(scope="module")
def model():
    model = tiny_llama(heads=4, kv_heads=2, layers=2, vocab=258)
    yield model
    camkv.remove(model)


@pytest.fixture(scope="module")
def tokenizer():
    return TokenizerWrapper(byte_tokenizer())


def _alone(model, prompt, max_tokens, eos, cache=None):
    """Greedy tokens of the prompt run alone (mlx-lm's generate_step), and its cache."""
    cache = model.make_cache() if cache is None else cache
    tokens = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens,
                                  prompt_cache=cache, prefill_step_size=STEP):
        if int(token) in eos:
            break
        tokens.append(int(token))
    return tokens, cache


def _row_bound(config, layer_cache) -> int:
    """Most bytes one layer of one request may hold: budget + slack rows of every head."""
    keys = layer_cache.keys
    per_row = (keys.shape[3] + layer_cache.values.shape[3]) * keys.dtype.size + 8
    return keys.shape[1] * (config.budget + config.slack) * per_row


def test_budget_holding_everything_gives_batchkvcaches_tokens(model, tokenizer):
    reference = batch_generate(model, tokenizer, PROMPTS, max_tokens=20, return_token_ids=True,
                               prefill_step_size=STEP)
    with camkv.applied(model, budget=1024):
        result = batch_generate(model, tokenizer, PROMPTS, max_tokens=20, return_token_ids=True,
                                return_prompt_caches=True, prefill_step_size=STEP)
    assert result.token_ids == reference.token_ids
    assert all(isinstance(c, CaMKVCache) for caches in result.caches for c in caches)
    assert all(caches[0].stats["evictions"] == 0 for caches in result.caches)


@pytest.mark.parametrize("scoring", ["query", "key"])
def test_small_budget_rows_match_each_prompt_run_alone(model, tokenizer, scoring):
    max_tokens = 40
    with camkv.applied(model, budget=BUDGET, scoring=scoring):
        result = batch_generate(model, tokenizer, PROMPTS, max_tokens=max_tokens, return_token_ids=True,
                                return_prompt_caches=True, prefill_step_size=STEP)
        for prompt, tokens, caches in zip(PROMPTS, result.token_ids, result.caches):
            alone_tokens, alone = _alone(model, prompt, max_tokens, tokenizer.eos_token_ids)
            assert tokens == alone_tokens
            for batched, single in zip(caches, alone):
                _, _, scores, positions = batched.stored()
                _, _, alone_scores, alone_positions = single.stored()
                assert batched.offset == single.offset >= len(prompt) + len(tokens) - 1
                assert mx.array_equal(positions, alone_positions)
                assert_scores_as_alone(scores, alone_scores)
                assert 0 < batched.nbytes <= _row_bound(batched.config, batched)
    # Every prompt plus its answer is longer than the budget: each row evicted.
    assert all(caches[0].stats["evictions"] > 0 for caches in result.caches)


def _generate_batched(model, tokenizer, prompts, max_tokens, watch=None, **generator_args):
    """Each prompt's greedy tokens and finished caches through one BatchGenerator; watch(batch
    caches) runs after every step (before anything reads the rows)."""
    generator = BatchGenerator(model, stop_tokens=[[t] for t in tokenizer.eos_token_ids],
                               prefill_step_size=STEP, **generator_args)
    uids = generator.insert(prompts, max_tokens)
    tokens, caches = {uid: [] for uid in uids}, {}
    while responses := generator.next_generated():
        if watch is not None and generator._generation_batch is not None:
            watch(generator._generation_batch.prompt_cache)
        for r in responses:
            if r.finish_reason != "stop":
                tokens[r.uid].append(r.token)
            if r.finish_reason is not None:
                caches[r.uid] = r.prompt_cache
    generator.close()
    return [tokens[uid] for uid in uids], [caches[uid] for uid in uids]


def _assert_rows_match_alone(model, tokenizer, prompts, max_tokens, tokens, caches,
                             compare_scores: bool = True):
    for prompt, m, row_tokens, row_caches in zip(prompts, max_tokens, tokens, caches):
        alone_tokens, alone = _alone(model, prompt, m, tokenizer.eos_token_ids)
        assert row_tokens == alone_tokens
        for batched, single in zip(row_caches, alone):
            _, _, scores, positions = batched.stored()
            _, _, alone_scores, alone_positions = single.stored()
            assert batched.stats == single.stats  # tokens seen and query-scored, evictions, merges
            assert mx.array_equal(positions, alone_positions)
            if compare_scores:
                assert_scores_as_alone(scores, alone_scores)


def test_decoding_shares_one_rectangle_and_rows_still_match_alone(model, tokenizer):
    """Long answers: each row compresses many times (taking its buffers back, then lending
    them again) and the rectangle is rebuilt as it fills; every row still equals its prompt
    run alone, and while a row is lent it holds no buffers of its own (one copy of the KV)."""
    prompts, max_tokens = [PROMPTS[0], PROMPTS[2], PROMPTS[5]], [150, 140, 150]
    seen = {"all_lent": 0}

    def watch(batch_caches):
        for c in batch_caches:
            assert all(r._rows.keys is None for r, lent in zip(c._rows, c._lent) if lent)
            if c._lent and all(c._lent):
                seen["all_lent"] += 1

    with camkv.applied(model, budget=BUDGET):
        tokens, caches = _generate_batched(model, tokenizer, prompts, max_tokens, watch,
                                           prefill_batch_size=3, completion_batch_size=3)
        _assert_rows_match_alone(model, tokenizer, prompts, max_tokens, tokens, caches)
    assert seen["all_lent"] > 100  # the steps without a compression are the rectangle's
    assert min(len(t) for t in tokens) > 2 * _ROOM  # so the rectangle filled and was rebuilt


def test_rows_weighed_by_votes_decode_as_alone(model, tokenizer):
    """keepkv's rows carry votes after their first compression: they leave the rectangle's
    plain writes (attention weighs them), and the batch's bias pads them like the keys."""
    prompts, max_tokens = [PROMPTS[1], PROMPTS[3], PROMPTS[0]], [30, 24, 36]
    with camkv.applied(model, budget=BUDGET, merge="keepkv"):
        tokens, caches = _generate_batched(model, tokenizer, prompts, max_tokens,
                                           prefill_batch_size=3, completion_batch_size=3)
        # A merged row's score adds its absorbed rows'. On a GPU the batch's masked attention
        # differs from the lone run's in the last bits, and a loser whose two best survivors
        # are that close may go to the other one (section 8 allows the flip within 1e-3 of
        # the cosines), moving mass between rows: there tokens, positions and counts must
        # agree, scores only on the CPU.
        _assert_rows_match_alone(model, tokenizer, prompts, max_tokens, tokens, caches,
                                 compare_scores=not drop.on_cuda())


def test_continuous_batching_rows_join_and_leave_without_changing_each_other(model, tokenizer):
    """Few prompt slots and decode slots: rows are split off, extended into the decode
    batch while others decode, and filtered out as they finish at different lengths."""
    max_tokens = [30, 9, 22, 40, 15, 26]
    with camkv.applied(model, budget=BUDGET):
        generator = BatchGenerator(model, stop_tokens=[[t] for t in tokenizer.eos_token_ids],
                                   prefill_batch_size=2, completion_batch_size=3, prefill_step_size=STEP)
        uids = generator.insert(PROMPTS, max_tokens)
        tokens = {uid: [] for uid in uids}
        saw_batch, bound_ok = False, True
        while responses := generator.next_generated():
            saw_batch |= any(isinstance(c, BatchCaMKVCache) for c in generator._generation_batch.prompt_cache)
            for r in responses:
                if r.finish_reason != "stop":
                    tokens[r.uid].append(r.token)
            rows = len(generator._generation_batch)
            bound_ok &= all(c.nbytes <= rows * _row_bound(c.rows[0].config, c.rows[0])
                            for c in generator._generation_batch.prompt_cache if rows and not c.empty())
        generator.close()
        for uid, prompt, m in zip(uids, PROMPTS, max_tokens):
            assert tokens[uid] == _alone(model, prompt, m, tokenizer.eos_token_ids)[0]
    assert saw_batch and bound_ok


def test_saved_prompt_cache_joins_a_batch_and_a_finished_row_saves(model, tokenizer, tmp_path):
    history, follow_up = PROMPTS[3], [(5 * i + 2) % 250 for i in range(70)]
    with camkv.applied(model, budget=BUDGET):
        _, cache = _alone(model, history, 1, tokenizer.eos_token_ids)
        camkv.save_prompt_cache(str(tmp_path / "history.safetensors"), cache)
        saved = camkv.load_prompt_cache(str(tmp_path / "history.safetensors"))
        offset = saved[0].offset
        result = batch_generate(model, tokenizer, [follow_up, PROMPTS[1], PROMPTS[5]],
                                prompt_caches=[saved, None, None], max_tokens=25,
                                return_token_ids=True, return_prompt_caches=True, prefill_step_size=STEP)
        assert saved[0].offset == offset  # merge copies: the caller's cache is not updated in place
        reloaded = camkv.load_prompt_cache(str(tmp_path / "history.safetensors"))
        alone_tokens, alone = _alone(model, follow_up, 25, tokenizer.eos_token_ids, reloaded)
        assert result.token_ids[0] == alone_tokens

        camkv.save_prompt_cache(str(tmp_path / "row.safetensors"), result.caches[0])
        row = camkv.load_prompt_cache(str(tmp_path / "row.safetensors"))
    for loaded, single in zip(row, alone):
        assert loaded.offset == single.offset
        single.compress_pending()  # as the saved row was
        assert mx.array_equal(loaded.stored()[3], single.state[3])


def _filled_row(n: int, seed: int) -> CaMKVCache:
    row = CaMKVCache(budget=64, scoring="key")
    mx.random.seed(seed)
    row.update_and_fetch(mx.random.normal((1, 2, n, 8)), mx.random.normal((1, 2, n, 8)))
    return row


def test_rectangle_is_left_padded_and_the_mask_hides_the_padding():
    batch = BatchCaMKVCache([_filled_row(3, 0), _filled_row(5, 1)])
    assert batch.offset.tolist() == [3, 5]
    mask = batch.make_mask(1)
    assert mask.shape == (2, 1, 1, 6)
    assert mask[:, 0, 0].tolist() == [[False, False, True, True, True, True], [True] * 6]
    keys, _ = batch.update_and_fetch(mx.ones((2, 2, 1, 8)), mx.ones((2, 2, 1, 8)))
    assert keys.shape == (2, 2, 6, 8)
    assert mx.all(keys[0, :, :2] == 0).item() and mx.all(keys[0, :, -1] == 1).item()
    assert [r.size() for r in batch.rows] == [4, 6]


def test_padding_never_reaches_a_row():
    # Right padding of a prompt chunk (mlx-lm's prompt processing) ...
    batch = BatchCaMKVCache([_filled_row(2, 0), _filled_row(2, 1)])
    batch.prepare(lengths=[1, 4], right_padding=[3, 0])
    mask = batch.make_mask(4, return_array=True)
    batch.update_and_fetch(mx.ones((2, 2, 4, 8)), mx.ones((2, 2, 4, 8)))
    batch.finalize()
    assert [r.size() for r in batch.rows] == [3, 6]
    # Row 0's one real query sees its 2 held tokens and itself; the padding queries see all.
    assert mask[0, 0, 0].tolist() == [False, False, False, True, True, True]
    # ... and left padding before a first block (BatchKVCache(left_padding)).
    empty = BatchCaMKVCache([CaMKVCache(budget=64, scoring="key") for _ in range(2)], left_padding=[3, 0])
    assert empty.offset.tolist() == [-3, 0]  # RoPE: row 0's first real token is at position 0
    empty.update_and_fetch(mx.ones((2, 2, 4, 8)), mx.ones((2, 2, 4, 8)))
    assert [r.size() for r in empty.rows] == [1, 4] and empty.offset.tolist() == [1, 4]


def test_extract_filter_and_extend_keep_rows_independent():
    batch = BatchCaMKVCache([_filled_row(3, 0), _filled_row(5, 1), _filled_row(4, 2)])
    row = batch.extract(1)
    batch.update_and_fetch(mx.ones((3, 2, 1, 8)), mx.ones((3, 2, 1, 8)))
    assert row.size() == 5 and batch.rows[1].size() == 6  # the extracted copy did not move
    batch.filter([2, 0])
    assert [r.size() for r in batch.rows] == [5, 4]
    batch.extend(BatchCaMKVCache.merge([row]))
    assert [r.size() for r in batch.rows] == [5, 4, 5] and len(batch) == 3
    assert batch.nbytes == sum(r.nbytes for r in batch.rows)


def test_bad_batches_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="request 1's cache is a KVCache"):
        BatchCaMKVCache.merge([CaMKVCache(budget=8), KVCache()])
    batch = BatchCaMKVCache([_filled_row(3, 0)])
    with pytest.raises(ValueError, match="only be extended by another BatchCaMKVCache, got KVCache"):
        batch.extend(KVCache())
    with pytest.raises(ValueError, match="do not match this batch of 1 rows"):
        batch.update_and_fetch(mx.ones((2, 2, 1, 8)), mx.ones((2, 2, 1, 8)))
    with pytest.raises(ValueError, match="lengths must be 1 counts"):
        batch.prepare(lengths=[1, 2])
    with pytest.raises(IndexError, match="row 3 is not in this batch of 1 rows"):
        batch.extract(3)


def test_a_layer_mlx_lm_cannot_batch_stops_with_mlx_lms_error(model):
    """camkv keeps other cache kinds as the model makes them; one without batching
    support stops batch generation with mlx-lm's own error, which names it."""
    object.__setattr__(model, "make_cache", lambda: [KVCache(), ChunkedKVCache(16)])
    try:
        with camkv.applied(model, budget=BUDGET):
            generator = BatchGenerator(model, max_tokens=4)
            generator.insert([[1, 2, 3, 4], [5, 6, 7]])
            with pytest.raises(ValueError, match="ChunkedKVCache.*does not yet support batching"):
                while generator.next():
                    pass
            generator.close()
    finally:
        object.__delattr__(model, "make_cache")


def _drop_buffers_on_cpu(keys, values, end, scores, positions, queries, first_pending, scale, cfg, capacity,
                         stored=None):
    """drop.compress_drop_buffers' results from drop.compress_drop, sequence by sequence
    (the one-launch kernel needs an NVIDIA GPU): what a CPU test stands in for it with
    (plain rows: stored is None)."""
    assert stored is None
    B, H = keys.shape[:2]
    starts = [first_pending] * B if isinstance(first_pending, int) else first_pending.tolist()
    parts = []
    for b, start in enumerate(starts):
        heads = slice(b * H, (b + 1) * H)
        kept = drop.compress_drop(keys[b, :, :end], values[b, :, :end], scores[heads], positions[heads],
                                  queries[heads], start, scale, cfg)
        parts.append([mx.pad(a[None], [(0, 0), (0, 0), (0, capacity - kept.length), (0, 0)]) for a in kept[:2]]
                     + [kept.scores, kept.positions])
    return tuple(mx.concatenate([p[i] for p in parts], axis=0) for i in range(4))


def test_rows_due_at_the_same_step_compress_in_one_launch_as_each_alone(model, tokenizer, monkeypatch):
    """Rows whose prompts outgrew the budget reach budget + slack together and share one
    compression launch (at their own positions); each still equals its prompt run alone."""
    launches = []

    def counted(keys, *args):
        launches.append(keys.shape[0])
        return _drop_buffers_on_cpu(keys, *args)

    monkeypatch.setattr(drop, "compress_drop_buffers", counted)
    monkeypatch.setattr(compress, "one_launch", lambda backend, cfg, end: end > cfg.budget)
    # Prompts a token apart: the rows hold the same count after them, at other positions.
    prompts = [[(5 * i + 11 * j + 3) % 250 for i in range(200 + j)] for j in range(3)]
    max_tokens = [40, 40, 40]
    with camkv.applied(model, budget=BUDGET):
        tokens, caches = _generate_batched(model, tokenizer, prompts, max_tokens,
                                           prefill_batch_size=3, completion_batch_size=3)
        _assert_rows_match_alone(model, tokenizer, prompts, max_tokens, tokens, caches)
    assert max(launches) == 3  # the three rows, in one launch
