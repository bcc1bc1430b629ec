"""RULER's synthetic tasks (Hsieh et al., 2024), generated in-package on the texts camkv
fetches, and scored as RULER scores them.

Tasks (RULER's names and settings; its two QA tasks need SQuAD and HotpotQA, which are
not here):

- niah_single_1/2/3: one needle "One of the special magic numbers for KEY is: VALUE."
  in the repeated-noise haystack (a number), in real text (a number), in real text (a
  UUID); niah_multikey_1: four needles in real text, one asked for (three distractor
  keys); niah_multikey_2/3: the haystack is all needles (every line a distractor, words
  to numbers, UUIDs to UUIDs); niah_multivalue: one key with four values;
  niah_multiquery: four keys, all asked for. Keys are two words of the source's
  vocabulary joined by "-" (RULER: an adjective and a noun), numbers have 7 digits.
- vt: variable tracking, a chain "VAR A = 12345", "VAR B = VAR A", ... (four hops)
  in the noise haystack, after a short worked example; the answer is every name.
- cwe: common words: a numbered list where 10 words appear 30 times and the others 3
  (6 and 1 below 4096 tokens), after one worked example; the answer is the 10.
- fwe: frequent words: coded 6-letter words drawn with Zipf frequencies (alpha 2,
  the most frequent is "..." noise); the answer is the next three.

A prompt is built in token space (pieces tokenized apart and joined, so its length is
exact): the chat template's head (when the tokenizer has one and --chat-template is not
off; RULER's plain template otherwise), the task's instruction, the haystack with the
needles, the question, the template's tail and RULER's answer prefix. Its length plus
the task's answer tokens is at most the target length, as RULER counts it. The context
(head, instruction, haystack) is what kvpress compresses; the question is the rest.

Score of one answer: the fraction of expected strings found in it, case-insensitive,
after RULER's clean-up (control characters to newlines, stripped): RULER's
string_match_all. A task's score is the mean over its prompts; the RULER average is
the mean over tasks (camkv.eval.ruler_report adds the intervals).
"""

from __future__ import annotations

import math
import random
import re
import string
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from ..prefill import prefill
from . import texts
from .arms import cache_stats, expand_names, make_cache, parse_arm_spec, parse_methods, release_cache
from .budgets import budgets_for
from .passkey import _sentence_end_at_or_after
from .ruler_scoring import clean_answer, ruler_score  # noqa: F401 (the suite's scorer, re-exported)

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {kind} for {key} is: {value}."
DEPTHS = [round(100 * i / 39) / 100 for i in range(40)]  # RULER's 40 depths, 0..100%

NIAH_INTRO = ("Some special magic {kind} are hidden within the following text. Make sure to "
              "memorize it. I will quiz you about the {kind} afterwards.\n")
NIAH_QUESTION = "\nWhat are all the special magic {kind} for {query} mentioned in the provided text?"
NIAH_PREFIX = " The special magic {kind} for {query} mentioned in the provided text are"
VT_INTRO = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
VT_QUESTION = "\nQuestion: Find all variables that are assigned the value {value} in the text above."
VT_PREFIX = (" Answer: According to the chain(s) of variable assignment in the text above, {count} "
             "variables are assigned the value {value}, they are: ")
CWE_INTRO = ("Below is a numbered list of words. In these words, some appear more often than "
             "others. Memorize the ones that appear most often.\n")
CWE_QUESTION = "\nQuestion: What are the 10 most common words in the above list?"
CWE_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
FWE_INTRO = ("Read the following coded text and track the frequency of each coded word. Find the "
             "three most frequently appeared coded words. ")
FWE_QUESTION = ("\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What "
                "are the three most frequently appeared words in the above coded text?")
FWE_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"


@dataclass(frozen=True)
class NiahSpec:
    haystack: str  # "noise", "essay" or "needle" (every line a distractor needle)
    key_type: str  # "words", "numbers" or "uuids"
    value_type: str
    keys: int = 1  # needles' keys (the ones not asked for are distractors)
    values: int = 1  # values per key
    queries: int = 1  # keys asked for


NIAH = {
    "niah_single_1": NiahSpec("noise", "words", "numbers"),
    "niah_single_2": NiahSpec("essay", "words", "numbers"),
    "niah_single_3": NiahSpec("essay", "words", "uuids"),
    "niah_multikey_1": NiahSpec("essay", "words", "numbers", keys=4),
    "niah_multikey_2": NiahSpec("needle", "words", "numbers"),
    "niah_multikey_3": NiahSpec("needle", "uuids", "uuids"),
    "niah_multivalue": NiahSpec("essay", "words", "numbers", values=4),
    "niah_multiquery": NiahSpec("essay", "words", "numbers", keys=4, queries=4),
}
# Greedy tokens RULER gives each task's answer.
ANSWER_TOKENS = {**{name: 128 for name in NIAH}, "vt": 30, "cwe": 120, "fwe": 50}
TASK_NAMES = tuple(ANSWER_TOKENS)
TASK_GROUPS = {"all": list(TASK_NAMES), "niah": list(NIAH), "other": ["vt", "cwe", "fwe"]}


@dataclass(frozen=True)
class RulerSample:
    """One prompt: context (compressed by kvpress) then question; the expected strings,
    the token spans of the prompt that state them, the needles' depths in the haystack."""

    sample_id: str
    task: str
    length: int  # the target length: prompt plus answer tokens fit in it
    context: list[int]
    question: list[int]
    answers: tuple[str, ...]
    answer_tokens: int
    spans: tuple[tuple[int, int], ...] = ()  # [start, end) in tokens, one per stated needle
    depths: tuple[float, ...] = ()  # each needle's position in the haystack, 0..1
    counts: dict = field(default_factory=dict)  # cwe / fwe: each listed word's count
    question_text: str = ""  # the texts the question's ids were made of, without the
    answer_prefix: str = ""  # template's tail between them (ruler_export writes them)

    @property
    def tokens(self) -> list[int]:
        return self.context + self.question


# ---------------------------------------------------------------------------- scoring


# clean_answer and ruler_score live in ruler_scoring, which imports no MLX (a PyTorch
# runner of the same prompts scores with it too).


# ---------------------------------------------------------------------------- pieces


class Pieces:
    """Token ids built piece by piece, each piece tokenized apart (so a piece's text is
    the decoded text of its ids), with the spans of the pieces marked as needles."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.spans: list[tuple[int, int]] = []

    def add(self, text: str, needle: bool = False) -> None:
        start = len(self.ids)
        self.ids += plain_ids(self.tokenizer, text)
        if needle:
            self.spans.append((start, len(self.ids)))

    def add_ids(self, ids: list[int]) -> None:
        self.ids += ids


def plain_ids(tokenizer, text: str) -> list[int]:
    """Ids of text inside a prompt: without the BOS a tokenizer puts first."""
    return texts._drop_special_prefix(tokenizer, tokenizer.encode(text)) if text else []


def first_ids(tokenizer, text: str) -> list[int]:
    """Ids of a prompt's first piece: with the BOS the tokenizer adds, once (a chat template
    that writes the BOS text itself would otherwise give two)."""
    bos = getattr(tokenizer, "bos_token", None)
    if bos and text.startswith(bos) and plain_ids(tokenizer, "x") != tokenizer.encode("x"):
        text = text[len(bos):]
    return tokenizer.encode(text)


def chat_parts(tokenizer, mode: str) -> tuple[str, str]:
    """(head, tail) the chat template puts around a user message; ("", "") for RULER's
    plain template (mode "off", or "auto" with a tokenizer that has no template)."""
    has_template = getattr(tokenizer, "chat_template", None) is not None
    if mode == "on" and not has_template:
        raise ValueError("--chat-template on: this model's tokenizer has no chat template")
    if mode == "off" or not has_template:
        return "", ""
    marker = "\u2063camkv-ruler\u2063"
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": marker}],
                                             add_generation_prompt=True, tokenize=False)
    head, tail = rendered.split(marker)
    return head, tail


# ---------------------------------------------------------------------------- values


def random_value(rng: random.Random, kind: str, vocabulary: list[str]) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    return f"{rng.choice(vocabulary)}-{rng.choice(vocabulary)}"


def vocabulary(documents) -> list[str]:
    """The distinct lowercase words (3-10 letters) of a source's first 2 MB of text,
    sorted: RULER's keys and common words come from word lists; ours from the text."""
    seen: set[str] = set()
    budget = 2_000_000
    for doc in documents:
        seen.update(w.lower() for w in re.findall(r"\b[A-Za-z]{3,10}\b", doc.text[:budget]))
        budget -= len(doc.text)
        if budget <= 0:
            break
    return sorted(seen)


def _and_list(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + ", and " + items[-1]


# ---------------------------------------------------------------------------- haystacks


@dataclass
class Haystack:
    """A haystack's ids with needles in it: each needle's span and depth (0..1)."""

    ids: list[int]
    spans: list[tuple[int, int]]
    depths: list[float]


def essay_haystack(tokenizer, source, docs, room: int, needles: list[str], rng) -> Haystack:
    """Real text of `room` tokens (needles included), each needle after a sentence end
    near a depth drawn from RULER's 40 (sorted, so needles keep their order)."""
    needle_ids = [plain_ids(tokenizer, " " + n) for n in needles]
    filler_len = room - sum(map(len, needle_ids))
    if filler_len < 16:
        raise ValueError(f"{room} tokens of haystack cannot hold the {len(needles)} needles")
    # A source shorter than the haystack is repeated, as RULER repeats its essays.
    repeats = 1 + 2 * filler_len // max(1, sum(len(d.text) for d in docs))
    filler = texts.sample_windows(source, list(docs) * repeats, tokenizer, filler_len, 1,
                                  seed=rng.randrange(2**31), keep_bos=False)[0].tokens
    splits = sorted(_sentence_end_at_or_after(tokenizer, filler, round(d * filler_len))
                    for d in sorted(rng.sample(DEPTHS, len(needles))))
    ids, spans, depths, last = [], [], [], 0
    for split, needle in zip(splits, needle_ids):
        ids += filler[last:split]
        spans.append((len(ids), len(ids) + len(needle)))
        depths.append(split / filler_len)
        ids += needle
        last = split
    return Haystack(ids + filler[last:], spans, depths)


def line_haystack(tokenizer, room: int, needles: list[str], rng, line) -> Haystack:
    """Lines of filler (line(rng) gives one, e.g. the noise sentence) with the needles as
    lines at random gaps, RULER's noise and needle haystacks; at most `room` tokens."""
    needle_ids = [plain_ids(tokenizer, n + "\n") for n in needles]
    left = room - sum(map(len, needle_ids))
    lines = []
    while True:
        candidate = plain_ids(tokenizer, line(rng) + "\n")
        if len(candidate) > left:
            break
        lines.append(candidate)
        left -= len(candidate)
    if not lines:
        raise ValueError(f"{room} tokens of haystack cannot hold the {len(needles)} needles and a line")
    gaps = sorted(rng.sample(range(len(lines) + 1), len(needles))) if len(needles) <= len(lines) + 1 \
        else sorted(rng.choices(range(len(lines) + 1), k=len(needles)))
    ids, spans, depths, last = [], [], [], 0
    for gap, needle in zip(gaps, needle_ids):
        for piece in lines[last:gap]:
            ids += piece
        spans.append((len(ids), len(ids) + len(needle)))
        depths.append(gap / len(lines))
        ids += needle
        last = gap
    for piece in lines[last:]:
        ids += piece
    return Haystack(ids, spans, depths)


# ---------------------------------------------------------------------------- the tasks


@dataclass
class Request:
    """What a task generator is handed: where the prompt goes and what it may draw on."""

    tokenizer: object
    rng: random.Random
    source: str
    docs: list
    words: list[str]
    head: str  # the chat template's head ("" for the plain template)
    tail: str
    room: int  # tokens the whole prompt may take (target length minus answer tokens)
    asked: dict = field(default_factory=dict)  # _prompt's question and answer prefix texts


def _prompt(req: Request, before: list[str], middle, question: str, prefix: str):
    """Assemble head + before + middle(room) + question + tail + prefix; returns
    (context ids, question ids, needle spans in the prompt, depths)."""
    context = Pieces(req.tokenizer)
    context.add_ids(first_ids(req.tokenizer, req.head) if req.head else [])
    for i, text in enumerate(before):
        if i == 0 and not req.head:
            context.add_ids(first_ids(req.tokenizer, text))
        else:
            context.add(text)
    asked = plain_ids(req.tokenizer, question) + plain_ids(req.tokenizer, req.tail) + \
        plain_ids(req.tokenizer, prefix)
    req.asked.update(question_text=question, answer_prefix=prefix)
    room = req.room - len(context.ids) - len(asked)
    if room < 1:
        raise ValueError(f"--ruler-lengths: the prompt's fixed parts take {req.room - room} tokens, "
                         f"more than the {req.room} the length leaves")
    hay = middle(room)
    offset = len(context.ids)
    spans = tuple((offset + a, offset + b) for a, b in hay.spans)
    return context.ids + hay.ids, asked, spans, tuple(round(d, 4) for d in hay.depths)


def niah(req: Request, spec: NiahSpec) -> dict:
    rng = req.rng
    keys = []
    while len(keys) < max(spec.keys, spec.queries):
        key = random_value(rng, spec.key_type, req.words)
        if key not in keys:
            keys.append(key)
    values = [[random_value(rng, spec.value_type, req.words) for _ in range(spec.values)] for _ in keys]
    needles = [NEEDLE.format(kind=spec.value_type, key=k, value=v) for k, vs in zip(keys, values) for v in vs]
    rng.shuffle(needles)
    asked = rng.sample(range(len(keys)), spec.queries)
    query = _and_list([keys[i] for i in asked])
    kind = spec.value_type
    intro, question, prefix = NIAH_INTRO, NIAH_QUESTION, NIAH_PREFIX
    if spec.queries * spec.values == 1:  # RULER's singular wording
        intro, question, prefix = (t.replace("Some", "A").replace("are all", "is").replace("are", "is")
                                   for t in (intro, question, prefix))
        kind = kind[:-1]
    if spec.haystack == "essay":
        middle = lambda room: essay_haystack(req.tokenizer, req.source, req.docs, room, needles, rng)
    else:
        distractor = (lambda r: NOISE) if spec.haystack == "noise" else (lambda r: NEEDLE.format(
            kind=spec.value_type, key=random_value(r, spec.key_type, req.words),
            value=random_value(r, spec.value_type, req.words)))
        middle = lambda room: line_haystack(req.tokenizer, room, needles, rng, distractor)
    context, asked_ids, spans, depths = _prompt(
        req, [intro.format(kind=kind)], middle, question.format(kind=kind, query=query),
        prefix.format(kind=kind, query=query))
    # Each expected value's needle (in the answers' order; a distractor's is not expected).
    answers = tuple(v for i in asked for v in values[i])
    needle_values = [n.rsplit(": ", 1)[1][:-1] for n in needles]
    chosen = [needle_values.index(a) for a in answers]
    return dict(context=context, question=asked_ids, answers=answers,
                spans=tuple(spans[j] for j in chosen), depths=tuple(depths[j] for j in chosen))


def _variable_chain(rng, hops: int, taken: set[str]) -> tuple[list[str], list[str], str]:
    """(names, statements, value) of one chain: VAR A = value, VAR B = VAR A, ..."""
    names: list[str] = []
    while len(names) < hops + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        if name not in taken and name not in names:
            names.append(name)
    value = str(rng.randint(10000, 99999))
    statements = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]}" for j in range(hops)]
    return names, statements, value


def vt(req: Request, hops: int = 4) -> dict:
    rng = req.rng
    shot_names, shot_chain, shot_value = _variable_chain(rng, hops, set())
    names, chain, value = _variable_chain(rng, hops, set(shot_names))
    shot_lines = [NOISE] * 3
    for j, statement in enumerate(shot_chain):
        shot_lines.insert(2 * j, statement)
    example = (VT_INTRO + "\n".join(shot_lines) + "\n" + VT_QUESTION.format(value=shot_value)
               + VT_PREFIX.format(count=hops + 1, value=shot_value) + " ".join(shot_names) + "\n")
    middle = lambda room: line_haystack(req.tokenizer, room, chain, rng, lambda r: NOISE)
    context, asked, spans, depths = _prompt(req, [example, VT_INTRO], middle,
                                            VT_QUESTION.format(value=value),
                                            VT_PREFIX.format(count=hops + 1, value=value))
    return dict(context=context, question=asked, answers=tuple(names), spans=spans, depths=depths)


def _word_list(words: list[str], rng, total: int, common: int, repeats: int, rare_repeats: int):
    """A numbered list "1. w 2. w ..." of `total` distinct words: the first `common`
    repeated `repeats` times, the others `rare_repeats` times, shuffled."""
    if total > len(words):
        raise ValueError(f"the source's vocabulary has {len(words)} words, fewer than the {total} "
                         "a common-words list of this length needs")
    chosen = rng.sample(words, total)
    listed = chosen[:common] * repeats + chosen[common:] * rare_repeats
    rng.shuffle(listed)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(listed)), chosen[:common], listed


def _largest_fitting(make, tokenizer, room: int, low: int, high: int):
    """The largest n in [low, high] whose make(n) text tokenizes into at most room tokens
    (binary search; token counts grow with n), and make(n)'s result."""
    best = None
    while low <= high:
        mid = (low + high) // 2
        made = make(mid)
        if len(plain_ids(tokenizer, made[0])) <= room:
            best, low = (mid, made), mid + 1
        else:
            high = mid - 1
    if best is None:
        raise ValueError(f"--ruler-lengths: {room} tokens cannot hold the shortest list")
    return best[1]


def cwe(req: Request, common: int = 10) -> dict:
    rng = req.rng
    long_form = req.room + ANSWER_TOKENS["cwe"] >= 4096  # RULER's two settings
    repeats, rare = (30, 3) if long_form else (6, 1)
    shot_total, shot_repeats, shot_rare = (40, 10, 3) if long_form else (20, 3, 1)
    shot_text, shot_common, _ = _word_list(req.words, random.Random(rng.random()), shot_total, common,
                                           shot_repeats, shot_rare)
    example = (CWE_INTRO + shot_text + CWE_QUESTION + CWE_PREFIX + " "
               + " ".join(f"{i + 1}. {w}" for i, w in enumerate(shot_common)) + "\n")
    seed = rng.random()
    make = lambda n: _word_list(req.words, random.Random(seed), n, common, repeats, rare)
    made = {}

    def middle(room):
        made["list"] = _largest_fitting(make, req.tokenizer, room, common + 1, len(req.words))
        return Haystack(plain_ids(req.tokenizer, made["list"][0]), [], [])

    context, asked, _, _ = _prompt(req, [example, CWE_INTRO], middle, CWE_QUESTION, CWE_PREFIX)
    _, answers, listed = made["list"]
    return dict(context=context, question=asked, answers=tuple(answers), counts=_counts(listed))


def _counts(words) -> dict:
    counts: dict[str, int] = {}
    for w in words:
        counts[w] = counts.get(w, 0) + 1
    return counts


def _coded_text(rng_seed, total: int, vocab_size: int, alpha: float = 2.0):
    """RULER's fwe text: `vocab_size` coded words, the k-th drawn total * k^-alpha / zeta(alpha)
    times (the first is "..."), shuffled; returns (text, the next three words, words)."""
    rng = random.Random(rng_seed)
    vocab: list[str] = []
    while len(vocab) < vocab_size:
        word = "".join(rng.choices(string.ascii_lowercase, k=6))
        if word not in vocab:
            vocab.append(word)
    vocab[0] = "..."
    zeta = math.pi ** 2 / 6 if alpha == 2.0 else sum(k ** -alpha for k in range(1, 100_000))
    words = [w for k, w in enumerate(vocab, start=1) for _ in range(int(total * k ** -alpha / zeta))]
    rng.shuffle(words)
    return " ".join(words), vocab[1:4], words


def fwe(req: Request) -> dict:
    seed = req.rng.random()
    vocab_size = max(20, (req.room + ANSWER_TOKENS["fwe"]) // 50)
    make = lambda n: _coded_text(seed, n, vocab_size)
    made = {}

    def middle(room):
        made["text"] = _largest_fitting(make, req.tokenizer, room, 8, 4 * room)
        return Haystack(plain_ids(req.tokenizer, made["text"][0]), [], [])

    context, asked, _, _ = _prompt(req, [FWE_INTRO], middle, FWE_QUESTION, FWE_PREFIX)
    _, answers, words = made["text"]
    counts = _counts(words)
    rest = [c for w, c in counts.items() if w not in answers and w != "..."]
    if min(counts[a] for a in answers) <= max(rest, default=0):
        raise ValueError(f"--ruler-lengths: the coded text of {req.room} tokens is too short for "
                         "three words more frequent than the others")
    return dict(context=context, question=asked, answers=tuple(answers), counts=counts)


def build_sample(task: str, tokenizer, source: str, docs, words: list[str], length: int, index: int,
                 seed: int, chat: tuple[str, str], max_answer: int | None = None) -> RulerSample:
    """Prompt `index` of a task at a target length (prompt + answer tokens <= length)."""
    answer_tokens = min(ANSWER_TOKENS[task], max_answer or ANSWER_TOKENS[task])
    rng = random.Random(f"{seed}:ruler:{task}:{length}:{index}")
    req = Request(tokenizer, rng, source, docs, words, *chat, room=length - answer_tokens)
    if task in NIAH:
        made = niah(req, NIAH[task])
    else:
        made = {"vt": vt, "cwe": cwe, "fwe": fwe}[task](req)
    return RulerSample(sample_id(task, length, index, source), task, length,
                       answer_tokens=answer_tokens, **made, **req.asked)


def sample_id(task: str, length: int, index: int, source: str) -> str:
    """A prompt's id in the records: task, length, index and (real-text haystacks) source."""
    hay = source if task in NIAH and NIAH[task].haystack == "essay" else "synthetic"
    return f"{task}:L{length}:i{index}:{hay}"


def _require(condition, what) -> None:
    if not condition:
        raise AssertionError(f"RULER prompt does not hold what it states: {what}")


def check_sample(sample: RulerSample, tokenizer) -> None:
    """Raise AssertionError (also under python -O) unless the sample holds what it
    states: the length bound, each needle's value inside its span and nowhere else, the
    chain's names in its statements, the listed words' counts."""
    tokens = sample.tokens
    _require(len(tokens) + sample.answer_tokens <= sample.length, (sample.sample_id, len(tokens)))
    text = tokenizer.decode(tokens)
    if sample.task in NIAH:
        _require(len(sample.spans) == len(sample.answers), sample.sample_id)
        for value, (start, end) in zip(sample.answers, sample.spans):
            _require(value in tokenizer.decode(tokens[start:end]), (sample.sample_id, value))
            _require(text.count(value) == 1, (sample.sample_id, value, text.count(value)))
    if sample.task == "vt":
        stated = " ".join(tokenizer.decode(tokens[a:b]) for a, b in sample.spans)
        _require(all(f"VAR {name} " in stated for name in sample.answers), sample.sample_id)
    if sample.counts:
        others = [c for w, c in sample.counts.items() if w not in sample.answers and w != "..."]
        _require(min(sample.counts[a] for a in sample.answers) > max(others, default=0), sample.sample_id)
    _require(ruler_score(" ".join(sample.answers), sample.answers) == 1.0, sample.sample_id)


# ---------------------------------------------------------------------------- planning


def parse_tasks(spec: str) -> list[str]:
    names = expand_names(spec, TASK_GROUPS, TASK_NAMES, "--ruler-tasks", "task")
    if not names:
        raise ValueError("--ruler-tasks is empty")
    return names


class Planner:
    """Builds and checks the prompts of a run: the chat template's parts and each source's
    vocabulary, made once."""

    def __init__(self, opts, documents, tokenizer):
        self.opts, self.documents, self.tokenizer = opts, documents, tokenizer
        self.chat = chat_parts(tokenizer, opts.chat_template)
        self._words: dict[str, list[str]] = {}

    def build(self, plan: "Planned") -> RulerSample:
        if plan.source not in self._words:
            self._words[plan.source] = vocabulary(self.documents[plan.source])
        sample = build_sample(plan.task, self.tokenizer, plan.source, self.documents[plan.source],
                              self._words[plan.source], plan.length, plan.index, self.opts.seed,
                              self.chat, self.opts.ruler_max_answer)
        check_sample(sample, self.tokenizer)
        return sample


@dataclass(frozen=True)
class Planned:
    """A prompt of the plan, built when its turn comes (a resumed run skips building the
    prompts it has every record of)."""

    task: str
    length: int
    index: int
    source: str
    planner: Planner = field(compare=False, repr=False)

    @property
    def sample_id(self) -> str:
        return sample_id(self.task, self.length, self.index, self.source)

    @property
    def nominal_tokens(self) -> int:
        """The prompt's length to within a line of haystack: what budgets are counted on
        before it is built."""
        return self.length - min(ANSWER_TOKENS[self.task], self.planner.opts.ruler_max_answer or 10**9)


def plan_rounds(opts, documents, tokenizer) -> list[list[Planned]]:
    """Round i = prompt i of every task at every length, so a sweep cut by its time budget
    has every task; the real-text haystacks cycle over the sources. The first round is
    built and checked (check_sample) here, so a length too short for a task, or a
    generator that breaks, stops the run before any model runs; later rounds are built
    as they come."""
    planner = Planner(opts, documents, tokenizer)
    sources = list(documents)
    rounds = [[Planned(task, length, index, sources[index % len(sources)], planner)
               for length in opts.ruler_lengths for task in parse_tasks(opts.ruler_tasks)]
              for index in range(opts.ruler_samples)]
    for plan in rounds[0]:
        planner.build(plan)
    return rounds


def describe_plan(opts, arms: int, budgets, settings) -> str:
    tasks = parse_tasks(opts.ruler_tasks)
    total = sum(opts.ruler_samples * len(tasks) * (1 + arms * len(budgets_for(length, budgets, settings, set())))
                for length in opts.ruler_lengths)
    return (f"ruler: {len(tasks)} tasks x {opts.ruler_samples} prompts x lengths {opts.ruler_lengths} = "
            f"{total} runs, each a chunked prefill and up to {max(ANSWER_TOKENS.values())} greedy steps")


def count_units(rounds, methods, budgets, settings) -> int:
    arms = len(methods) - 1
    return sum(1 + arms * len(budgets_for(p.nominal_tokens, budgets, settings, set()))
               for plan in rounds for p in plan)


# ---------------------------------------------------------------------------- running


def stop_tokens(tokenizer) -> set[int]:
    ids = getattr(tokenizer, "eos_token_ids", None)
    if ids is None:
        one = getattr(tokenizer, "eos_token_id", None)
        ids = [] if one is None else [one]
    return {int(i) for i in ids}


def answer(model, caches, sample: RulerSample, chunk: int, tokenizer, question_by_steps: bool) -> str:
    """Prefill in chunks, then greedy tokens up to the task's count or an end token.

    question_by_steps: the context is prefilled alone and the question fed one token a
    step (the SnapKV arm: its cache compresses the context once, at its last chunk)."""
    if question_by_steps:
        prefill(model, caches, sample.context, chunk, tokenizer)
        for token in sample.question:
            logits = model(mx.array([[token]]), cache=caches)[0, -1]
    else:
        logits = prefill(model, caches, sample.tokens, chunk, tokenizer)
    return greedy_answer(model, caches, logits, sample, tokenizer)


def greedy_answer(model, caches, logits: mx.array, sample: RulerSample, tokenizer) -> str:
    """Greedy tokens from the prompt's last logits [V], up to the task's count or an end token."""
    stops, out = stop_tokens(tokenizer), []
    for _ in range(sample.answer_tokens):
        token = int(mx.argmax(logits))
        if token in stops:
            break
        out.append(token)
        logits = model(mx.array([[token]]), cache=caches)[0, -1]
    return tokenizer.decode(out)


def _has_every_record(sweep, plan: Planned) -> bool:
    """Whether the records hold this prompt's full-cache answer and every other arm's at
    every budget label of the run."""
    if not sweep.store.done("ruler", plan.sample_id, "full", None):
        return False
    wanted = {b.label for b in sweep.budgets}
    covered: dict[str, set] = {}
    for r in sweep.store.records:
        if r["task"] == "ruler" and r["sample"] == plan.sample_id:
            covered.setdefault(r["method"], set()).update(r["labels"])
    return all(wanted <= covered.get(m.name, set()) for m in sweep.methods if m.kind != "full")


def run_sample(sweep, plan: Planned) -> None:
    """Every arm at every budget that evicts in this prompt, not yet in the records."""
    if _has_every_record(sweep, plan):
        sweep.progress.update(1 + (len(sweep.methods) - 1) * len(sweep.budgets))
        return
    sample = plan.planner.build(plan)
    budgets = budgets_for(len(sample.tokens), sweep.budgets, sweep.settings, sweep.notes)
    for method in sweep.methods:
        for budget in [None] if method.kind == "full" else budgets:
            if sweep.store.done("ruler", sample.sample_id, method.name, budget):
                continue
            sweep.progress.set_postfix_str(f"ruler {sample.task} L={sample.length} {method.name} b={budget}")
            record, seconds = sweep._unit("ruler", lambda: _record(sweep, sample, method, budget,
                                                                   budgets.get(budget, [])))
            sweep.store.add({**record, "seconds": round(seconds, 3), **memory_after()})
            # Prompts of many lengths leave MLX's cache buffers of many sizes, which it keeps:
            # on an 80 GB GPU, 8k prompts' cache grew by about 0.2 GB a prompt to 74 GB (active
            # memory 0.5 GB throughout), and sweeps ended out of memory. Each prompt starts clean.
            mx.clear_cache()


def memory_after() -> dict:
    """MLX's memory after a prompt, in MiB: in use, and freed but held in its cache
    (cleared after each record)."""
    return {"active_mib": round(mx.get_active_memory() / 2**20, 1),
            "cached_mib": round(mx.get_cache_memory() / 2**20, 1)}


def _record(sweep, sample: RulerSample, method, budget, labels) -> dict:
    caches = make_cache(sweep.model, method, budget, sweep.settings, context=len(sample.context),
                        after_context=len(sample.question) + sample.answer_tokens)
    try:
        text = answer(sweep.model, caches, sample, sweep.opts.chunk, sweep.tokenizer,
                      question_by_steps=method.kind == "snapkv")
    finally:
        release_cache(sweep.model, method)
    return {
        "task": "ruler", "sample": sample.sample_id, "method": method.name, "budget": budget,
        "labels": labels, "ruler_task": sample.task, "length": sample.length,
        "prompt_tokens": len(sample.tokens), "context_tokens": len(sample.context),
        "depths": list(sample.depths), "expected": list(sample.answers), "answer": text,
        "score": ruler_score(text, sample.answers), **cache_stats(caches),
    }


# ---------------------------------------------------------------------------- options


# The arms a RULER run of each preset compares when --methods is left out.
COMPARED = "full,streamingllm,streamingllm-sinks,snapkv,h2o-causal,camkv"
RULER_METHODS = {"smoke": COMPARED, "cpu": COMPARED, "gpu": COMPARED, "cpu-ruler": COMPARED,
                 "gpu-ruler": COMPARED}
# The RULER values of the general presets (a --tasks ruler run of them), and the two
# presets of the suite itself, built on the cpu and gpu ones.
_PRESET_VALUES = {
    # CI-sized: one prompt of five tasks (each kind of haystack and answer) at 1280 bytes of
    # the tiny model, answers cut to 4 tokens (cwe's worked example alone takes ~700 bytes).
    "smoke": dict(ruler_tasks="niah_single_1,niah_multikey_2,niah_multivalue,vt,fwe",
                  ruler_lengths="1280", ruler_samples=1, ruler_max_answer=4),
    "cpu": dict(ruler_tasks="all", ruler_lengths="4096", ruler_samples=2, ruler_max_answer=None),
    "gpu": dict(ruler_tasks="all", ruler_lengths="4096,8192", ruler_samples=20, ruler_max_answer=None),
}
_SUITE_PRESETS = {
    # SmolLM2 at 4k on a CPU: a few prompts per task, the arms the field compares (chunks
    # of 512: a CPU runs long chunks' attention far slower).
    "cpu-ruler": ("cpu", dict(tasks="ruler", methods=COMPARED, texts="sotu,austen,kjv",
                              budgets="10%,20%,50%", chunk=512, recent="50%", ruler_samples=2)),
    # The suite on a GPU: the arms the field compares at 4k and 8k (add 16k for Gemma 3),
    # prompts in rounds so a sweep cut by --time-budget has every task; resumable, and
    # `--methods ruler` later adds camkv's merge rules to the same folder.
    "gpu-ruler": ("gpu", dict(tasks="ruler", methods=COMPARED, texts="sotu,austen,kjv",
                              budgets="10%,20%,50%", chunk=2048, recent="50%", ruler_samples=20)),
}


def with_ruler_presets(presets: dict) -> dict:
    """The presets of `camkv eval` with the RULER values added and the suite's own presets.
    recent 50% is H2O's split (half heavy hitters, half recent) for the h2o arms; camkv's
    default arm keeps its own quarter. chunk 2048 is mlx-lm's prefill step."""
    merged = {name: {**values, **_PRESET_VALUES.get(name, {})} for name, values in presets.items()}
    for name, (base, values) in _SUITE_PRESETS.items():
        merged[name] = {**merged[base], **values}
    return merged


def add_flags(parser) -> None:
    a = parser.add_argument
    a("--ruler-tasks", help=f"comma-separated RULER tasks or groups ({', '.join(TASK_GROUPS)}): "
      f"{', '.join(TASK_NAMES)}")
    a("--ruler-lengths", help="comma-separated RULER target lengths in tokens (prompt plus answer)")
    a("--ruler-samples", type=int, help="prompts per RULER task and length")
    a("--ruler-max-answer", type=int, help="most greedy tokens of a RULER answer (default: RULER's "
      "per task: niah 128, vt 30, cwe 120, fwe 50)")
    a("--chat-template", choices=["auto", "on", "off"], default="auto",
      help="RULER prompts in the model's chat template: auto (when the tokenizer has one), on, "
      "off (RULER's plain template, for base models) (default %(default)s)")
    a("--export-prompts", type=Path, metavar="FILE",
      help="write the RULER prompts of the run's plan to FILE (JSON lines, gzip-compressed for "
      "a name ending in .gz: ids, texts, expected strings; camkv.eval.ruler_export), then exit")
    a("--arm", action="append", metavar="NAME=JSON",
      help="an arm of any CaMConfig: its fields as a JSON object, the budget per run "
      "(e.g. 'deep={\"merge\": \"keepkv\", \"recent\": 64}'); repeatable")


def pick_methods(opts, preset: dict) -> None:
    """--methods left out of a RULER-only run: the arms RULER compares (RULER_METHODS)."""
    tasks = [t.strip() for t in (opts.tasks or preset["tasks"]).split(",") if t.strip()]
    if opts.methods is None and tasks == ["ruler"]:
        opts.methods = RULER_METHODS.get(opts.preset, COMPARED)


def resolve_options(opts) -> None:
    """Check and parse the RULER flags in place (after the preset filled them in)."""
    opts.arms = list(opts.arm or [])
    arms = parse_methods(opts.methods) + [parse_arm_spec(spec) for spec in opts.arms]
    if any(m.kind == "snapkv" for m in arms) and set(opts.tasks) != {"ruler"}:
        raise ValueError(f"--methods snapkv runs on RULER prompts only (--tasks ruler), got --tasks "
                         f"{','.join(opts.tasks)}")
    if "ruler" not in opts.tasks:
        if opts.export_prompts is not None:
            raise ValueError(f"--export-prompts writes RULER prompts: it needs --tasks ruler, got "
                             f"--tasks {','.join(opts.tasks)}")
        opts.ruler_max_answer, opts.chat_template = None, "auto"  # no meaning without RULER
        return
    parse_tasks(opts.ruler_tasks)
    try:
        opts.ruler_lengths = [int(s) for s in str(opts.ruler_lengths).split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--ruler-lengths must be comma-separated integers, got {opts.ruler_lengths!r}") from None
    if not opts.ruler_lengths or min(opts.ruler_lengths) < 256:
        raise ValueError(f"--ruler-lengths must list lengths >= 256 tokens, got {opts.ruler_lengths}")
    if opts.ruler_samples < 1:
        raise ValueError(f"--ruler-samples must be >= 1, got {opts.ruler_samples}")
    if opts.ruler_max_answer is not None and opts.ruler_max_answer < 1:
        raise ValueError(f"--ruler-max-answer must be >= 1, got {opts.ruler_max_answer}")
