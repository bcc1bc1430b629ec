"""`camkv eval --tasks ruler --export-prompts FILE`: the RULER suite's prompts as JSON
lines, for running the same prompts through another engine (bench/gpu/kvpress_ruler.py
runs them through kvpress).

One line a prompt, in the suite's order (round by round), built by the suite's own
planner (ruler.plan_rounds, Planner.build, check_sample):

- sample, ruler_task, length, max_new_tokens (RULER's answer tokens, after
  --ruler-max-answer), expected, depths: what the suite's records say of the prompt;
- context_ids, question_ids: the token ids the suite runs (the context is what kvpress
  compresses; the question is the rest: question, template tail, answer prefix);
- template ("chat" or "plain"), chat_head, chat_tail: the chat template's parts around
  the user message ("" for RULER's plain template);
- context, question, answer_prefix: the texts of those parts as kvpress's pipeline takes
  them (context: the user message, instruction and haystack, without the template;
  question: without the tail and the prefix). Each line is checked before it is
  written: the question's ids decode to question + tail + answer prefix, and the
  context's ids to the head's ids followed by the context text.

A FILE ending in .gz is written gzip-compressed.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from . import ruler


def _open(path: Path, mode: str):
    return gzip.open(path, mode + "t", encoding="utf-8") if path.suffix == ".gz" else \
        path.open(mode, encoding="utf-8")


def lead_ids(tokenizer, head: str) -> list[int]:
    """The ids a prompt's context starts with before the user message: the chat head's
    (as the suite tokenizes it), or the BOS the tokenizer adds to a plain prompt."""
    if head:
        return ruler.first_ids(tokenizer, head)
    plain, full = ruler.plain_ids(tokenizer, "x"), tokenizer.encode("x")
    return full[:len(full) - len(plain)]


def prompt_line(sample: ruler.RulerSample, tokenizer, chat: tuple[str, str]) -> dict:
    """One prompt's export line; ValueError if its texts do not give back its ids."""
    head, tail = chat
    lead = lead_ids(tokenizer, head)
    if sample.context[:len(lead)] != lead:
        raise ValueError(f"{sample.sample_id}: the context does not start with the template's "
                         f"{len(lead)} head ids")
    line = {
        "sample": sample.sample_id, "ruler_task": sample.task, "length": sample.length,
        "max_new_tokens": sample.answer_tokens, "expected": list(sample.answers),
        "depths": list(sample.depths), "context_ids": list(sample.context),
        "question_ids": list(sample.question), "template": "chat" if head else "plain",
        "chat_head": head, "chat_tail": tail,
        "context": tokenizer.decode(sample.context[len(lead):]),
        "question": sample.question_text, "answer_prefix": sample.answer_prefix,
    }
    asked = tokenizer.decode(sample.question)
    if asked != line["question"] + tail + line["answer_prefix"]:
        raise ValueError(f"{sample.sample_id}: the question's ids decode to {asked!r}, not its "
                         "texts question + tail + answer prefix")
    return line


def export_prompts(opts, documents, tokenizer, path: Path) -> int:
    """Write every prompt of the run's plan to path (JSON lines); returns how many."""
    rounds = ruler.plan_rounds(opts, documents, tokenizer)
    chat = ruler.chat_parts(tokenizer, opts.chat_template)
    path.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    with _open(path, "w") as out:
        for plans in rounds:
            for plan in plans:
                out.write(json.dumps(prompt_line(plan.planner.build(plan), tokenizer, chat)) + "\n")
                written += 1
    return written


def read_prompts(path: Path) -> list[dict]:
    """The lines of an export, in order."""
    with _open(Path(path), "r") as f:
        return [json.loads(line) for line in f if line.strip()]
