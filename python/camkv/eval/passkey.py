"""The passkey task: a 5-digit key hidden at a depth of real filler text, answered
greedily through each arm's cache."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

import mlx.core as mx

from . import texts
from ..prefill import prefill


PASSKEY_INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about the important information there.\n\n"
)
PASSKEY_NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
PASSKEY_QUESTION = "\n\nWhat is the pass key? The pass key is"
SENTENCE_SEARCH = 64  # most tokens to look ahead for a sentence end to hide the key after


@dataclass(frozen=True)
class PasskeyPrompt:
    sample_id: str
    length: int
    depth: float
    key: str
    tokens: list[int]


def _plain_ids(tokenizer, text: str) -> list[int]:
    return texts._drop_special_prefix(tokenizer, tokenizer.encode(text))


def _sentence_end_at_or_after(tokenizer, filler: list[int], index: int) -> int:
    """The first split point at or after index that follows a sentence end (else index).

    The look-ahead is at most 5% of the filler, so the key's depth moves by <= 0.05.
    """
    reach = min(SENTENCE_SEARCH, len(filler) // 20)
    for k in range(max(1, index), min(len(filler), index + reach + 1)):
        if tokenizer.decode([filler[k - 1]]).rstrip().endswith((".", "!", "?", '"')):
            return k
    return index


def passkey_depths(placements: int) -> list[float]:
    if placements == 1:
        return [0.5]
    return [0.1 + 0.8 * j / (placements - 1) for j in range(placements)]


def spread_order(count: int) -> list[int]:
    """0 .. count - 1 ordered so every prefix spreads over the whole range: both ends,
    then the middle, then the quarters, ... (van der Corput). Placements run in this
    order, so a sweep cut by its time budget has keys at every depth, not only the
    shallow ones (a recency cache finds deep keys and misses shallow ones)."""
    order = [0, count - 1][:count]
    k = 1
    while len(set(order)) < count and k < 64 * count:
        x, bit, rest = 0.0, 0.5, k
        while rest:
            x, rest, bit = x + bit * (rest & 1), rest >> 1, bit / 2
        order.append(round(x * (count - 1)))
        k += 1
    seen: set[int] = set()
    unique = [i for i in order if not (i in seen or seen.add(i))]
    return unique + [i for i in range(count) if i not in seen]


def build_passkey(tokenizer, source: str, docs, length: int, depth: float, placement: int,
                  seed: int) -> PasskeyPrompt:
    """Exactly `length` tokens: intro, filler with the key sentence at `depth`, question."""
    rng = random.Random(f"{seed}:passkey:{length}:{placement}")
    key = str(rng.randrange(10000, 100000))
    intro = tokenizer.encode(PASSKEY_INTRO)  # keeps a BOS the tokenizer adds
    needle = _plain_ids(tokenizer, PASSKEY_NEEDLE.format(key=key))
    question = _plain_ids(tokenizer, PASSKEY_QUESTION)
    filler_len = length - len(intro) - len(needle) - len(question)
    if filler_len < 16:
        raise ValueError(
            f"--passkey-lengths: {length} tokens cannot hold the passkey prompt "
            f"({length - filler_len} tokens without filler)"
        )
    window = texts.sample_windows(source, docs, tokenizer, filler_len, 1,
                                  seed=rng.randrange(2**31), keep_bos=False)[0]
    split = _sentence_end_at_or_after(tokenizer, window.tokens, round(depth * filler_len))
    tokens = intro + window.tokens[:split] + needle + window.tokens[split:] + question
    # Unique whatever --passkey-placements is, so runs with different counts can share a folder.
    sample_id = f"L{length}:d{depth:.3f}:k{key}:{window.sample_id}"
    return PasskeyPrompt(sample_id, length, split / filler_len, key, tokens)


def greedy_answer(model, caches, prompt: list[int], chunk: int, answer_tokens: int, tokenizer) -> str:
    """Prefill the prompt in chunks, then decode greedily through the same cache."""
    logits = prefill(model, caches, prompt, chunk, tokenizer)
    answer = []
    for _ in range(answer_tokens):
        token = mx.argmax(logits)
        answer.append(int(token))
        logits = model(token.reshape(1, 1), cache=caches)[0, -1]
    return tokenizer.decode(answer)


def is_correct(answer: str, key: str) -> bool:
    """Exact match: the first run of digits in the answer is the key."""
    digits = re.search(r"\d+", answer)
    return digits is not None and digits.group() == key
