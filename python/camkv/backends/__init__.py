"""Backend registry: every backend exposes update(state, new_keys, new_values, offset, cfg, row_ids, queries, scale).

"reference" (pure MLX, any device), "ext" (the compiled extension: CPU, and Apple
GPUs when built with Metal), "metal" and "cuda" (the same kernel core compiled at
run time by mx.fast). "auto" picks metal on an Apple GPU, cuda on an NVIDIA GPU,
ext on the CPU, and the reference (with one warning naming what is missing) otherwise.
Every backend runs every merge rule (the kernel core has a row for each, csrc/camkv_merges.h).
"""

from __future__ import annotations

import warnings

import mlx.core as mx

from . import ext, jit
from .oracle import reference

_warned: set[str] = set()


def available() -> dict[str, str | None]:
    """Each backend name mapped to None when usable here, else the reason it is not."""
    return {
        "reference": None,
        "ext": ext.unavailable_reason(),
        "metal": jit.metal.unavailable_reason(),
        "cuda": jit.cuda.unavailable_reason(),
    }


def _module(name: str):
    """The module of a usable backend name; the reference is imported on first use."""
    return reference() if name == "reference" else {"ext": ext, "metal": jit.metal, "cuda": jit.cuda}[name]


def _preferred() -> str:
    """The backend made for the default device."""
    if mx.default_device() == mx.cpu:
        return "ext"
    if mx.metal.is_available():
        return "metal"
    return "cuda"


def _auto():
    name = _preferred()
    reason = available()[name]
    if reason is None:
        return _module(name)
    if "auto" not in _warned:
        _warned.add("auto")
        warnings.warn(
            f"camkv: using the slow pure-MLX reference backend because backend {name!r} "
            f"is not usable: {reason}",
            RuntimeWarning,
            stacklevel=3,
        )
    return reference()


def require_usable(name: str) -> None:
    """Refuse now, with a ValueError naming why and what is usable, a backend name that
    cannot run here ('auto' always can)."""
    if name == "auto":
        return
    reasons = available()
    reason = reasons.get(name)
    if reason is not None:
        usable = [n for n, why in reasons.items() if why is None]
        raise ValueError(f"backend {name!r} cannot run here: {reason}; usable "
                         f"here: 'auto', {', '.join(repr(n) for n in usable)}")


def resolve(name: str):
    """The backend module for a CaMConfig.backend name ('auto' picks the best usable one)."""
    if name == "auto":
        return _auto()
    reasons = available()
    if name not in reasons:
        raise ValueError(f"unknown backend {name!r}; known: {sorted(reasons)}")
    if reasons[name] is not None:
        raise RuntimeError(f"backend {name!r} is not usable here: {reasons[name]}")
    return _module(name)


def resolve_name(name: str) -> str:
    """The backend name 'auto' (or a forced name) resolves to here."""
    module = resolve(name)
    return module.__name__.rsplit(".", 1)[-1]
