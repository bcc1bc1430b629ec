"""Save and load prompt caches that hold camkv layers, in mlx-lm's safetensors format.

Saving needs nothing new: mlx-lm's ``save_prompt_cache`` writes each layer's
``state`` and class name, and CaMKVCache's state is arrays plus a JSON string,
which it serializes. Loading is the problem: ``mlx_lm.models.cache.load_prompt_cache``
finds each class by name in its own module's globals, so it cannot find
``CaMKVCache`` (a KeyError). ``camkv.load_prompt_cache`` reads the same file and
looks classes up in mlx-lm's cache module and in camkv.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_unflatten
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import save_prompt_cache

from .cache import CaMKVCache

__all__ = ["load_prompt_cache", "save_prompt_cache"]

_CAMKV_CLASSES = {"CaMKVCache": CaMKVCache}


def _cache_class(name: str):
    if name in _CAMKV_CLASSES:
        return _CAMKV_CLASSES[name]
    cls = getattr(mlx_cache, name, None)
    if not (isinstance(cls, type) and hasattr(cls, "from_state")):
        raise ValueError(f"prompt cache layer class {name!r} is neither camkv's nor mlx-lm's")
    return cls


def _restore_scalars(arrays: dict, scalars: list) -> None:
    """Undo save_prompt_cache's encoding of ints, strings and None as arrays."""
    decoders = {
        "scalar": lambda a: a.item(),
        "string": lambda a: "".join(chr(c) for c in a.tolist()),
        "none": lambda a: None,
    }
    for position, kind in scalars[1:]:  # scalars[0] is a placeholder mlx-lm writes
        if kind not in decoders:
            raise ValueError(f"unknown scalar kind {kind!r} in the prompt cache file")
        arrays[position] = decoders[kind](arrays[position])


def load_prompt_cache(file_name: str, return_metadata: bool = False):
    """Load a prompt cache saved with (mlx-lm's or camkv's) save_prompt_cache.

    Like mlx_lm.models.cache.load_prompt_cache, but camkv layers load too. A file
    that is missing, unreadable, truncated or not a prompt cache raises ValueError
    naming the file and what is wrong.
    """
    arrays, file_metadata = _read_file(file_name)
    try:
        metadata, classes, scalars = tree_unflatten(list(file_metadata.items()))
    except (ValueError, TypeError, IndexError):
        raise ValueError(f"{file_name} is a safetensors file but not a prompt cache: its metadata "
                         "lacks the layer classes save_prompt_cache writes (a model's weights?)"
                         ) from None
    _restore_scalars(arrays, scalars)
    states = tree_unflatten(list(arrays.items()))
    if not isinstance(states, list) or len(states) != len(classes):
        raise ValueError(f"{file_name} is not a complete prompt cache: {len(classes)} layer classes "
                         f"but {len(states) if isinstance(states, list) else 'no'} layer states")
    prompt_cache = [_layer(name, state, file_name) for name, state in zip(classes, states)]
    return (prompt_cache, metadata) if return_metadata else prompt_cache


def _read_file(file_name: str):
    path = Path(file_name)
    if not path.is_file():
        raise ValueError(f"no prompt cache file at {file_name} "
                         f"({'a folder' if path.is_dir() else 'it does not exist'})")
    try:
        return mx.load(str(path), format="safetensors", return_metadata=True)
    except (RuntimeError, ValueError, OSError) as err:
        raise ValueError(f"{file_name} is not a readable safetensors prompt cache (truncated or "
                         f"another format?): {err}") from None


def _layer(name: str, state, file_name: str):
    cls = _cache_class(name)
    try:
        return cls.from_state(state)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as err:
        raise ValueError(f"{file_name}: a {name} layer cannot be restored from its saved state "
                         f"({type(err).__name__}: {err})") from None
