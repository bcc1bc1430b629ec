"""Cache budgets: --budgets values (shares of the context or token counts) and the
token budgets that evict in a given context."""

from __future__ import annotations

from dataclasses import dataclass

from .arms import CacheSettings


@dataclass(frozen=True)
class Budget:
    label: str  # "10%" or "256"
    fraction: float | None
    tokens: int | None

    def resolve(self, context: int) -> int:
        return round(self.fraction * context) if self.fraction is not None else self.tokens


def _share_or_count(text: str) -> tuple[float | None, int | None]:
    """(fraction, None) for "N%" with 0 < N < 100, (None, tokens) for a count >= 1;
    ValueError otherwise."""
    if text.endswith("%"):
        fraction = float(text[:-1]) / 100
        if not 0 < fraction < 1:
            raise ValueError(text)
        return fraction, None
    tokens = int(text)
    if tokens < 1:
        raise ValueError(text)
    return None, tokens


def parse_budgets(spec: str) -> list[Budget]:
    budgets = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        try:
            budgets.append(Budget(item, *_share_or_count(item)))
        except ValueError:
            raise ValueError(
                f"--budgets: {item!r} is neither a percentage in (0%, 100%) nor a positive "
                "token count"
            ) from None
    if not budgets:
        raise ValueError("--budgets is empty")
    return budgets


def budgets_for(context: int, budgets: list[Budget], settings: CacheSettings,
                notes: set[str]) -> dict[int, list[str]]:
    """Token budgets that evict in a context of `context` tokens, each with its labels.

    A budget at or above the context never evicts (its arm is the full cache) and one
    not above n_sink + recent is invalid for camkv: both are skipped with a note.
    """
    resolved: dict[int, list[str]] = {}
    for budget in budgets:
        tokens = budget.resolve(context)
        if tokens >= context:
            notes.add(f"budget {budget.label} = {tokens} >= context {context}: never evicts, skipped")
        elif tokens <= settings.n_sink + settings.recent_for(tokens):
            notes.add(f"budget {budget.label} = {tokens} of context {context} is not above "
                      f"n_sink + recent = {settings.n_sink + settings.recent_for(tokens)}: skipped")
        else:
            resolved.setdefault(tokens, []).append(budget.label)
    return resolved
