"""The stream task: a window of real text fed through each arm's cache, prefill chunks
then one token a step, scored against the full cache's next-token distributions."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from ..prefill import fed_in_chunks, reconstruction


def feed(model, caches: list, tokens: list[int], prefill_len: int, chunk: int, tokenizer=None):
    """Yield (first position, logits [n, V]) per model call: prefill chunks, then one token a
    step. Caches that score by reconstruction get their re-reads after each prefill chunk
    (camkv.prefill.fed_in_chunks, whose driver needs the tokenizer)."""
    yield from fed_in_chunks(lambda ids, c: model(ids, cache=c)[0], caches, tokens[:prefill_len], chunk,
                             reconstruction(model, caches, tokenizer, chunk))
    for position in range(prefill_len, len(tokens)):
        yield position, model(mx.array(tokens[position : position + 1])[None], cache=caches)[0]


@dataclass
class Reference:
    """The full cache's next-token log-probabilities at positions start.. of one window."""

    start: int
    logprobs: mx.array  # [positions, V] float32
    argmax: mx.array  # [positions]
    nll: np.ndarray  # [positions]


def _logprobs(logits: mx.array) -> mx.array:
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def full_reference(model, tokens: list[int], prefill_len: int, chunk: int, start: int) -> Reference:
    """Run the full cache over the window once; keep what every arm is compared with."""
    inputs, targets = tokens[:-1], mx.array(tokens[1:])
    blocks = []
    for first, logits in feed(model, make_prompt_cache(model), inputs, prefill_len, chunk):
        keep = max(0, start - first)
        if keep >= logits.shape[0]:
            mx.eval(logits)  # before the first scored position; still bound the lazy graph
            continue
        blocks.append(_logprobs(logits[keep:]))
        mx.eval(blocks[-1])
    logprobs = mx.concatenate(blocks)
    positions = mx.arange(start, len(inputs))
    nll = -mx.take_along_axis(logprobs, targets[positions][:, None], axis=-1)[:, 0]
    argmax = mx.argmax(logprobs, axis=-1)
    mx.eval(nll, argmax)
    return Reference(start, logprobs, argmax, np.array(nll))


def stream_arm(model, caches, tokens, prefill_len, chunk, ref: Reference, tokenizer=None) -> dict:
    """Per-position (kl, nll, top-1 agreement) of one arm against the reference, positions ref.start.."""
    inputs, targets = tokens[:-1], mx.array(tokens[1:])
    rows = []
    for first, logits in feed(model, caches, inputs, prefill_len, chunk, tokenizer):
        keep = max(0, ref.start - first)
        if keep >= logits.shape[0]:
            mx.eval(logits)  # nothing to score yet; still bound the lazy graph
            continue
        logprobs = _logprobs(logits[keep:])
        lo = first + keep - ref.start
        full = ref.logprobs[lo : lo + logprobs.shape[0]]
        kl = mx.sum(mx.exp(full) * (full - logprobs), axis=-1)
        target = targets[first + keep : first + logits.shape[0]]
        nll = -mx.take_along_axis(logprobs, target[:, None], axis=-1)[:, 0]
        agree = mx.argmax(logprobs, axis=-1) == ref.argmax[lo : lo + logprobs.shape[0]]
        rows.append(mx.stack([kl, nll, agree.astype(mx.float32)], axis=-1))
        # Queue this step and build the next one while it runs.
        mx.async_eval(rows[-1])
    metrics = np.array(mx.concatenate(rows))
    return {"kl": metrics[:, 0], "nll": metrics[:, 1], "agree": metrics[:, 2]}


def summarize_positions(per_position: dict, ref: Reference, lowest: int) -> dict:
    """Sums over positions >= lowest (position i predicts token i + 1)."""
    offset = max(0, lowest - ref.start)
    kl, nll, agree = (per_position[k][offset:] for k in ("kl", "nll", "agree"))
    return {
        "positions": int(kl.size),
        "kl_sum": float(kl.sum()),
        "nll_sum": float(nll.sum()),
        "agree_sum": float(agree.sum()),
        "full_nll_sum": float(ref.nll[offset:].sum()),
    }
