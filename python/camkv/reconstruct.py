"""Reconstruction scoring (CaMConfig.prefill_scoring="reconstruct"): a prompt's tokens
scored by the attention each gets while the model re-reads them (KVzip's observation,
arXiv 2505.23416), within camkv's bound (docs/algorithm.md section 7).

A prompt block's own last queries single out what its end attends to, and on small
models that is rarely a needle in its middle (bench/results/README.md, RULER). When the
model is asked to repeat a span of its context, the query that reproduces each token
attends to that token's row: the largest weight a row gets while its span is re-read
says whether anything later could need it.

Reconstruction drives the model, so it runs where camkv feeds the prompt
(camkv.prefill.prefill, which camkv's eval uses): each prompt chunk is held pending
(CaMKVCache.hold_prompt) and, once the rows pass budget + slack, the pending tokens are
re-read after a repeat instruction, in passes of at most `chunk` tokens, through views of
the caches that keep nothing of a pass; each camkv cache then compresses with the mass
the re-reads gave its pending rows (CaMKVCache.compress_pending(mass=...)). Memory stays
bounded: budget + slack rows, one prompt chunk and one pass. Anywhere else a prompt
arrives (mlx-lm's own generate loop) the cache scores it as prefill_scoring="window".
"""

from __future__ import annotations

import copy
from contextlib import contextmanager

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import create_causal_mask

from . import hook
from .cache import CaMKVCache

# The repeat instructions (KVzip's wording): the first span of a sequence, and a later
# span, which the instruction then starts with the BEFORE tokens preceding it.
FIRST = "\n\nRepeat the previous context exactly."
LATER = "\n\nRepeat the part of the previous context exactly, starting with"
BEFORE = 8
# Most bytes one block of a pass's queries holds in float32 logits and the softmax's temporaries.
_LOGIT_BYTES = 64 << 20


def reconstructs(caches) -> bool:
    """Whether any cache of the list scores prompts by reconstruction."""
    return any(isinstance(c, CaMKVCache) and c.config.prefill_scoring == "reconstruct" for c in caches)


class Instruction:
    """The token ids a re-read pass starts with: the repeat instruction, closed as the
    user's turn of the tokenizer's chat template (a base model's: a newline)."""

    MARK = "\u2063camkv-context\u2063"  # a string no template writes itself

    def __init__(self, tokenizer):
        self._encode = lambda text: list(tokenizer.encode(text, add_special_tokens=False))
        self.suffix = self._encode(self._turn_end(tokenizer))
        self.first, self.later = self._encode(FIRST), self._encode(LATER)

    def _turn_end(self, tokenizer) -> str:
        """What the chat template writes after a user's message up to the assistant's answer."""
        if getattr(tokenizer, "chat_template", None) is None:
            return "\n"
        text = tokenizer.apply_chat_template([{"role": "user", "content": self.MARK}], add_generation_prompt=True,
                                             tokenize=False)
        return text.split(self.MARK, 1)[1] if self.MARK in text else "\n"

    def ids(self, before: list[int]) -> list[int]:
        """The instruction for a span after the tokens `before` (the last BEFORE of them
        start it; none: the sequence's first span)."""
        if not before:
            return self.first + self.suffix
        return self.later + list(before[-BEFORE:]) + self.suffix


class Reread:
    """One layer's camkv cache as a re-read pass sees it: the rows it holds (as attention
    reads them, dequantized where stored quantized), then the pass's tokens, which it
    keeps for this pass only. `mass` [B, H, end - start]: the largest softmax weight each
    held row of [start, end) got from any of the pass's queries and query heads of its
    KV head (the votes' log added where the rule keeps votes, as attention adds it)."""

    def __init__(self, cache: CaMKVCache, start: int, end: int):
        self.cache, self.start, self.end = cache, start, end
        self.offset = cache.offset
        self.mass: mx.array | None = None
        self._keys: mx.array | None = None
        self._bias: mx.array | None = None  # the votes' log over held rows and the pass's tokens
        self._held = cache.size()

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        held_keys, held_values = self.cache.attended()
        if isinstance(held_keys, tuple):  # quantized rows as stored
            held_keys, held_values = hook.block_rows(held_keys, held_values, keys)
        self._keys = mx.concatenate([held_keys, keys], axis=2)
        bias = self.cache.votes_bias()  # the held rows' log votes; the pass's tokens stand for one each
        self._bias = None if bias is None else mx.concatenate(
            [bias, mx.zeros((*bias.shape[:2], keys.shape[2]), bias.dtype)], axis=2)
        self.offset += keys.shape[2]
        return self._keys, mx.concatenate([held_values, values], axis=2)

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        if N == 1:
            return None
        return create_causal_mask(N, self._held) if return_array else "causal"

    def attention_bias(self) -> mx.array | None:
        return self._bias

    def observe_queries(self, queries: mx.array, scale: float) -> bool:
        self.mass = span_mass(queries, self._keys, scale, self._held, self.start, self.end, self._bias)
        return False  # attention runs as mlx-lm's, over what update_and_fetch returned


def span_mass(queries: mx.array, keys: mx.array, scale: float, held: int, start: int, end: int,
              bias: mx.array | None = None) -> mx.array:
    """The largest weight rows [start, end) of keys get from any query: [B, H, end - start]
    float32. queries [B, Hq, L, Dk] (query head h * G + g of KV head h), keys [B, H,
    held + L, Dk]: query i sees the held rows and the pass's tokens up to itself; bias
    [B, H, held + L] is added to its rows' logits. A key with a NaN or infinite component
    gets no weight, and a query with one gives none.

    As max_i exp(logit_ij - lse_i): the logsumexp of each query over what it sees (the
    held rows, then its causal part of the pass's tokens), then the span's logits less
    it, the maximum over queries, and one exp of that [B, H, span]. A softmax over every
    logit would pass over the whole [queries, rows] array several times more (on a CPU,
    most of a re-read's time)."""
    B, Hq, L, Dk = queries.shape
    H, N = keys.shape[1], keys.shape[2]
    G = Hq // H
    q = queries.astype(mx.float32).reshape(B, H, G * L, Dk)  # row g * L + i
    q_ok = mx.isfinite(q).all(axis=-1, keepdims=True)
    q = mx.where(q_ok, q, 0.0) * scale
    k = keys.astype(mx.float32)
    k_ok = mx.isfinite(k).all(axis=-1)
    column = None  # what each row's logits get added [B, H, 1, N]; none in the common case (a pass fewer)
    if bias is not None or not k_ok.all().item():
        column = mx.where(k_ok, 0.0, -float("inf"))[:, :, None, :]
        column = column if bias is None else column + bias.astype(mx.float32)[:, :, None, :]
        k = mx.where(k_ok[..., None], k, 0.0)
    kT = k.transpose(0, 1, 3, 2)
    row_of = mx.tile(mx.arange(L), (G,))  # each q row's position in the pass
    causal = mx.where(mx.arange(L)[None, :] <= row_of[:, None], 0.0, -float("inf"))  # [G * L, L]
    block = max(1, _LOGIT_BYTES // (B * H * N * 4 * 2))
    lowest = _lowest_numpy if mx.default_device() == mx.cpu else _lowest_mlx
    parts = []
    for r0 in range(0, G * L, block):
        r1 = min(G * L, r0 + block)
        parts.append(lowest(q[:, :, r0:r1], kT, column, causal[r0:r1], q_ok[:, :, r0:r1, 0], held, start, end))
    best = parts[0]
    for part in parts[1:]:
        best = mx.maximum(best, part)
    return mx.where(mx.isnan(best), 0.0, mx.exp(best))


def _lowest_mlx(q, kT, column, causal, q_ok, held: int, start: int, end: int) -> mx.array:
    """max over the block's queries of logit - lse for rows [start, end): [B, H, span]."""
    logits = q @ kT  # [B, H, rows, N]
    logits = logits if column is None else logits + column
    lse = mx.logaddexp(mx.logsumexp(logits[..., :held], axis=-1),
                       mx.logsumexp(logits[..., held:] + causal, axis=-1))
    lse = mx.where(q_ok, lse, float("inf"))  # a poisoned query gives nothing
    part = (logits[..., start:end] - lse[..., None]).max(axis=2)
    mx.eval(part)
    return part


def _lowest_numpy(q, kT, column, causal, q_ok, held: int, start: int, end: int) -> mx.array:
    """_lowest_mlx's arithmetic in NumPy, on the CPU: MLX's CPU exp takes about 18 ns an
    element, NumPy's vectorised one a fifth of that, and a re-read's exps are most of
    its time there (bench/results/README.md, reconstruction scoring)."""
    logits = np.asarray(q) @ np.asarray(kT)
    if column is not None:
        logits += np.asarray(column)
    top = logits.max(axis=-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        total = np.exp(logits[..., :held] - top).sum(-1) + np.exp(logits[..., held:] + np.asarray(causal) - top).sum(-1)
        lse = np.where(np.asarray(q_ok), np.log(total) + top[..., 0], np.inf)
        return mx.array((logits[..., start:end] - lse[..., None]).max(axis=2))


class Reconstruction:
    """Drives the re-reads of one prompt's prefill over a model's caches (see the module).
    forward(ids [1, L], caches): the model's layers over ids (its output is not read)."""

    def __init__(self, model, caches: list, tokenizer, chunk: int, forward):
        if not hook.is_installed(model):
            raise ValueError("prefill_scoring='reconstruct' needs camkv's attention hook on the model "
                             "(camkv.make_prompt_cache installs it with scoring='query')")
        self.caches, self.chunk, self.forward = caches, chunk, forward
        self.scored = [c for c in caches if isinstance(c, CaMKVCache)]
        if any(c.config.prefill_scoring != "reconstruct" for c in self.scored):
            raise ValueError("prefill_scoring='reconstruct' must be every camkv cache's of the model, got "
                             f"{sorted({c.config.prefill_scoring for c in self.scored})}")
        if tokenizer is None:
            raise ValueError("prefill_scoring='reconstruct' needs the model's tokenizer (its repeat instruction)")
        self.instruction = Instruction(tokenizer)
        self.tokens: list[int] = []  # the ids of the pending rows, oldest first
        self.before: list[int] = []  # the ids fed just before them (the last BEFORE)
        for cache in self.scored:
            if cache.pending_rows():  # rows from before this prompt, whose ids it lacks: scored as they came
                cache.compress_pending()

    @contextmanager
    def holding(self):
        """Prompt blocks fed meanwhile stay pending past budget + slack."""
        for cache in self.scored:
            cache.hold_prompt(True)
        try:
            yield
        finally:
            for cache in self.scored:
                cache.hold_prompt(False)

    def fed(self, tokens: list[int]) -> None:
        """A prompt block of these ids went through the model under holding(): re-read and
        compress once the rows passed budget + slack."""
        self.tokens += list(tokens)
        if self.scored and self.scored[0].steps_before_compression() < 0:
            self.compress()

    def finish(self) -> None:
        """After a prompt's last block: its pending rows, where they pass the budget, are
        re-read and compressed now (later tokens would be scored another way)."""
        if self.scored and self.scored[0].size() > self.scored[0].config.budget:
            self.compress()

    def compress(self) -> None:
        """Re-read the pending tokens and compress every camkv cache with their mass."""
        pending = [c.pending_rows() for c in self.scored]
        if any(p != len(self.tokens) for p in pending):
            raise RuntimeError(f"reconstruct: the caches hold {sorted(set(pending))} pending rows, the prefill fed "
                               f"{len(self.tokens)} since their last compression")
        masses = [[] for _ in self.scored]
        for a in range(0, len(self.tokens), self.chunk):
            span = self.tokens[a : a + self.chunk]
            views = self._pass(self.instruction.ids(self.before + self.tokens[:a]), span, a)
            for got, view in zip(masses, views):
                got.append(view.mass)
        for cache, parts in zip(self.scored, masses):
            cache.compress_pending(mass=mx.concatenate(parts, axis=2))
        self.before = (self.before + self.tokens)[-BEFORE:]
        self.tokens = []

    def _pass(self, instruction: list[int], span: list[int], first: int) -> list[Reread]:
        """One re-read of span (pending rows first.. of every cache) after the instruction;
        nothing of it stays in the caches."""
        views = {}
        for c in self.scored:
            settled = c.size() - c.pending_rows()
            views[id(c)] = Reread(c, settled + first, settled + first + len(span))
        # Other layers' caches (a sliding window's) run the pass on a copy.
        caches = [views[id(c)] if id(c) in views else copy.deepcopy(c) for c in self.caches]
        self.forward(mx.array(instruction + span)[None], caches)  # only the masses are wanted: each view evaluated its own
        return [views[id(c)] for c in self.scored]
