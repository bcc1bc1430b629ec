"""What CaMKVCache refuses and what it warns about, in words (docs/algorithm.md section 7)."""

from __future__ import annotations

import warnings

import mlx.core as mx

from .backends._common import STORAGE_DTYPES
from .config import CaMConfig


class QueryScoringWarning(RuntimeWarning):
    """scoring="query" scored a block with keys: the model's queries did not reach the cache."""


class VotesWarning(RuntimeWarning):
    """A merge rule that keeps votes (keepkv): the model attended without weighing rows by them."""


def warn_once(warned: set, kind: str, message: str, stacklevel: int = 4, category=QueryScoringWarning) -> None:
    """Warn once per cache (its `warned` set) and kind. Every layer's cache warns with the
    same text from the same line of the model's attention (stacklevel, counted from this
    function, points there), so Python's default filter shows it once per model, not once
    per layer."""
    if kind in warned:
        return
    warned.add(kind)
    warnings.warn(message, category, stacklevel=stacklevel)


def check_new_config(value, current, empty: bool) -> None:
    """ValueError unless value is a CaMConfig, and current (the config held) while the
    cache holds rows."""
    if not isinstance(value, CaMConfig):
        raise ValueError(f"config must be a CaMConfig, got {type(value).__name__}")
    if not empty and value != current:
        raise ValueError("cannot change a CaMKVCache's config mid-sequence; make a new cache")


def check_head_placement(head_offset: int, n_heads_global: int | None) -> None:
    """ValueError unless head_offset >= 0 and n_heads_global (None: unsharded) exceeds it."""
    if head_offset < 0:
        raise ValueError(f"head_offset must be >= 0, got {head_offset}")
    if n_heads_global is not None and n_heads_global <= head_offset:
        raise ValueError(f"n_heads_global ({n_heads_global}) must exceed head_offset ({head_offset})")


def check_block(keys, values, layout: tuple | None, head_offset: int, n_heads_global: int | None) -> None:
    """Reject a bad block of keys and values before anything changes; layout (B, H, Dk,
    Dv, dtype) is the one the first block fixed (None before it)."""
    if not isinstance(keys, mx.array) or not isinstance(values, mx.array):
        raise ValueError("keys and values must be mx.array")
    if keys.ndim != 4 or values.ndim != 4:
        raise ValueError(f"keys and values must be 4-D [B, H, S, D], got {keys.ndim}-D and {values.ndim}-D")
    if keys.shape[:3] != values.shape[:3]:
        raise ValueError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)} differ in B, H or S")
    if keys.shape[2] == 0:
        raise ValueError("update_and_fetch needs at least one token (S >= 1)")
    if keys.dtype != values.dtype:
        raise ValueError(f"keys are {keys.dtype} but values are {values.dtype}")
    # The first block fixes the layout every later block is held to, so it is held to
    # what a compression can take before anything is stored.
    if keys.dtype not in STORAGE_DTYPES:
        raise ValueError(f"keys and values must be float16, bfloat16 or float32, got {keys.dtype}")
    sizes = {"B": keys.shape[0], "H": keys.shape[1], "Dk": keys.shape[3], "Dv": values.shape[3]}
    for name, size in sizes.items():
        if size == 0:
            raise ValueError(f"keys and values must have {name} >= 1, got keys "
                             f"{tuple(keys.shape)} and values {tuple(values.shape)}")
    heads_end = head_offset + keys.shape[1]
    if n_heads_global is not None and heads_end > n_heads_global:
        raise ValueError(
            f"this cache's heads {head_offset}..{heads_end - 1} do not fit in "
            f"the model's {n_heads_global} heads (head_offset, n_heads_global)"
        )
    got = (keys.shape[0], keys.shape[1], keys.shape[3], values.shape[3], keys.dtype)
    if layout is not None and got != layout:
        raise ValueError(
            f"(B, H, Dk, Dv, dtype) changed mid-sequence: the cache holds {layout}, the call has {got}"
        )


def check_saved_rows(held: int, settled: int, waiting: int, cfg) -> None:
    """A saved state's row counts: at most budget scored rows, then pending ones (those a
    call left within budget + slack, and a block waiting for its queries after them)."""
    if not 0 <= settled <= cfg.budget:
        raise ValueError(f"a saved CaMKVCache has {settled} scored rows; it can hold 0 to its budget "
                         f"{cfg.budget}")
    if not 0 <= waiting <= held - settled:
        raise ValueError(f"a saved CaMKVCache has {waiting} rows waiting for their queries; it holds "
                         f"{held - settled} pending rows")
    if held - waiting > cfg.budget + cfg.slack:
        raise ValueError(f"a saved CaMKVCache holds {held - waiting} rows besides those waiting for their "
                         f"queries, more than its budget + slack = {cfg.budget} + {cfg.slack}")


def keys_replacing(current, value) -> tuple:
    """value, replacing the held keys current (an array, or a quantized triple), as a
    tuple of arrays; ValueError unless it is what they hold, shape for shape."""
    parts, given = (current, value) if isinstance(current, tuple) else ((current,), (value,))
    if (not isinstance(given, (tuple, list)) or len(given) != len(parts)
            or any(not isinstance(v, mx.array) or v.shape != c.shape for v, c in zip(given, parts))):
        raise ValueError("CaMKVCache.keys can only be replaced by what it holds: "
                         f"{'arrays' if len(parts) > 1 else 'an array'} of the held keys' shape "
                         f"{', '.join(str(tuple(c.shape)) for c in parts)}")
    return tuple(given)


def check_queries(shape, B: int, H: int, S: int) -> None:
    """Reject queries [B, Hq, S, Dk] that do not belong to the block waiting for them."""
    if len(shape) != 4 or shape[0] != B or shape[2] != S:
        raise ValueError(
            f"queries {tuple(shape)} do not match the block waiting for them "
            f"(B={B}, S={S}); expected [B, query heads, S, Dk]"
        )
    if shape[1] % H != 0:
        raise ValueError(f"query heads {shape[1]} are not a multiple of the KV heads {H}")


def _model(model_type) -> str:
    return model_type or "(unknown type)"


def no_hook(model_type, hook_modules) -> str:
    """Why scoring="query" gets no queries: no hook, a model the hook cannot see, or removed."""
    model = _model(model_type)
    if hook_modules is None:
        why = ("no camkv attention hook is installed (the cache was built directly); "
               "build the caches with camkv.make_prompt_cache(model, ...) or call "
               "camkv.apply(model, ...) to score with the model's queries")
    elif not hook_modules:
        why = (f"model {model}'s attention does not call mlx-lm's "
               "scaled_dot_product_attention, so the hook cannot see its queries")
    else:
        why = f"the attention hook of model {model} was removed (camkv.remove)"
    return (f"camkv: CaMKVCache(scoring='query') gets no queries: {why}. Scoring with "
            "keys instead; pass scoring='key' to choose that and silence this warning.")


def other_width(model_type, query_width: int, key_width: int) -> str:
    # MLA models (deepseek_v3 and kin) cache a compressed latent, and their prompt
    # queries do not live in its space: there is nothing to score with.
    return (f"camkv: model {_model(model_type)} attends with queries of width {query_width} over cached keys "
            f"of width {key_width} (a compressed latent cache); scoring those blocks with keys instead. Pass "
            "scoring='key' to score all blocks the same way.")


def bypassed(model_type) -> str:
    return (f"camkv: model {_model(model_type)} computed attention without passing its queries to the cache "
            "(it bypasses mlx-lm's scaled_dot_product_attention); scoring that block with keys instead. Pass "
            "scoring='key' to score all blocks the same way.")


def votes_unread(merge: str, model_type) -> str:
    return (f"camkv: merge={merge!r} weighs each row by its votes in attention, but model {_model(model_type)} "
            "attended without asking for them (no camkv attention hook, or its attention bypasses mlx-lm's "
            "scaled_dot_product_attention); its merged rows counted as one token each. Build the caches with "
            "camkv.make_prompt_cache(model, ...) or call camkv.apply(model, ...).")


def given_mass(mass, layout: tuple | None, rows) -> mx.array:
    """The mass handed to compress_pending, as the compression reads it: [B*H, held]
    float32, zeros for the settled rows. mass: [B, H, pending] (ValueError naming the
    shapes otherwise; nothing changes)."""
    pending = rows.pending
    if layout is None or not isinstance(mass, mx.array) or tuple(mass.shape) != (*layout[:2], pending):
        expected = "nothing (the cache is empty)" if layout is None else f"[B, H, pending] = {[*layout[:2], pending]}"
        got = tuple(mass.shape) if isinstance(mass, mx.array) else type(mass).__name__
        raise ValueError(f"compress_pending: mass must be an mx.array of shape {expected}, got {got}")
    R = layout[0] * layout[1]
    return mx.concatenate([mx.zeros((R, rows.settled), mx.float32),
                           mass.reshape(R, pending).astype(mx.float32)], axis=1)
