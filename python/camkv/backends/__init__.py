"""Backend registry: every backend exposes update(state, new_keys, new_values, offset, cfg, row_ids, queries, scale)."""

from __future__ import annotations

import warnings

import mlx.core as mx

from .. import reference
from . import ext

_warned: set[str] = set()


def available() -> dict[str, str | None]:
    """Each backend name mapped to None when usable here, else the reason it is not."""
    return {"reference": None, "ext": ext.unavailable_reason()}


def _modules():
    return {"reference": reference, "ext": ext}


def _ext_serves_default_device() -> bool:
    """ext runs on the CPU everywhere, and on an Apple GPU only when built with Metal."""
    if mx.default_device() == mx.cpu:
        return True
    return bool(getattr(ext._ext, "HAS_METAL", False)) and mx.metal.is_available()


def _auto():
    reason = ext.unavailable_reason()
    if reason is None and _ext_serves_default_device():
        return ext
    if reason is None:
        reason = f"camkv._ext has no kernel for the default device {mx.default_device()}"
    if "auto" not in _warned:
        _warned.add("auto")
        warnings.warn(
            f"camkv: using the slow pure-MLX reference backend because {reason}",
            RuntimeWarning,
            stacklevel=3,
        )
    return reference


def resolve(name: str):
    """The backend module for a CaMConfig.backend name ('auto' picks the best usable one)."""
    if name == "auto":
        return _auto()
    reasons = available()
    if name not in reasons:
        raise ValueError(f"unknown backend {name!r}; known: {sorted(reasons)}")
    if reasons[name] is not None:
        raise RuntimeError(f"backend {name!r} is not usable here: {reasons[name]}")
    return _modules()[name]


def resolve_name(name: str) -> str:
    """The backend name 'auto' (or a forced name) resolves to here."""
    module = resolve(name)
    return module.__name__.rsplit(".", 1)[-1]
