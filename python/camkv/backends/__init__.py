"""Backend registry: every backend exposes update(state, new_keys, new_values, offset, cfg, row_ids, queries, scale)."""

from __future__ import annotations

import warnings

from .. import reference

_warned: set[str] = set()


def available() -> dict[str, str | None]:
    """Each backend name mapped to None when usable here, else the reason it is not."""
    return {"reference": None}


def resolve(name: str):
    """The backend module for a CaMConfig.backend name ('auto' picks the best usable one)."""
    reasons = available()
    if name == "auto":
        return reference
    if name not in reasons:
        raise ValueError(f"unknown backend {name!r}; known: {sorted(reasons)}")
    if reasons[name] is not None:
        raise RuntimeError(f"backend {name!r} is not usable here: {reasons[name]}")
    return reference


def resolve_name(name: str) -> str:
    """The backend name 'auto' (or a forced name) resolves to here."""
    module = resolve(name)
    return module.__name__.rsplit(".", 1)[-1]
