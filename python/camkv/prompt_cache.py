"""Save and load prompt caches that hold camkv layers, in mlx-lm's safetensors format.

Saving needs nothing new: mlx-lm's ``save_prompt_cache`` writes each layer's
``state`` and class name, and CaMKVCache's state is arrays plus a JSON string,
which it serializes. Loading is the problem: ``mlx_lm.models.cache.load_prompt_cache``
finds each class by name in its own module's globals, so it cannot find
``CaMKVCache`` (a KeyError). ``camkv.load_prompt_cache`` reads the same file and
looks classes up in mlx-lm's cache module and in camkv.
"""

from __future__ import annotations

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

    Like mlx_lm.models.cache.load_prompt_cache, but camkv layers load too.
    """
    arrays, file_metadata = mx.load(str(file_name), return_metadata=True)
    metadata, classes, scalars = tree_unflatten(list(file_metadata.items()))
    _restore_scalars(arrays, scalars)
    states = tree_unflatten(list(arrays.items()))
    prompt_cache = [_cache_class(name).from_state(state) for name, state in zip(classes, states)]
    return (prompt_cache, metadata) if return_metadata else prompt_cache
