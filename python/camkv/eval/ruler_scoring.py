"""RULER's score of one answer, string_match_all, in a module that imports nothing but
the standard library: the suite (camkv.eval.ruler) and bench/gpu/kvpress_ruler.py,
which runs under PyTorch without MLX and loads this file by its path, score with the
same two functions."""

from __future__ import annotations

import re

CONTROL = re.compile(r"[\x00-\x1f]")


def clean_answer(answer: str) -> str:
    """RULER's clean-up of a prediction: control characters become newlines, stripped."""
    return CONTROL.sub("\n", answer.strip()).strip()


def ruler_score(answer: str, expected) -> float:
    """RULER's string_match_all for one answer: the fraction of expected strings in it
    (case-insensitive)."""
    if not expected:
        raise ValueError("ruler_score needs at least one expected string")
    found = clean_answer(answer).lower()
    return sum(e.lower() in found for e in expected) / len(expected)
