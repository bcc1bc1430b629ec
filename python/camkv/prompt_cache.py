"""Save and load prompt caches that hold camkv layers, in mlx-lm's safetensors format.

mlx-lm's ``save_prompt_cache`` writes each layer's ``state`` and class name, and
CaMKVCache's state is arrays plus a JSON string, which it serializes; the state holds
the rows not scored yet with what scoring them needs, so a file mlx-lm saves loads
into a cache that goes on exactly as the saved one. ``camkv.save_prompt_cache``
compresses those rows first (CaMKVCache.compress_pending), so its files hold at most
budget rows per layer, all scored, and no queries. Loading is the problem: ``mlx_lm.models.cache.load_prompt_cache``
finds each class by name in its own module's globals, so it cannot find
``CaMKVCache`` (a KeyError). ``camkv.load_prompt_cache`` reads the same file and
looks classes up in mlx-lm's cache module and in camkv.
"""

from __future__ import annotations

from pathlib import Path

import os

import mlx.core as mx
from mlx.utils import tree_unflatten
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import save_prompt_cache as _mlx_save_prompt_cache

from .cache import CaMKVCache

__all__ = ["load_prompt_cache", "save_prompt_cache"]

_CAMKV_CLASSES = {"CaMKVCache": CaMKVCache}
SUFFIX = ".safetensors"


def saved_path(file_name: str) -> str:
    """The file save_prompt_cache(file_name, ...) writes: MLX appends .safetensors to a name
    without it."""
    file_name = str(file_name)
    return file_name if file_name.endswith(SUFFIX) else file_name + SUFFIX


def save_prompt_cache(file_name: str, cache: list, metadata: dict | None = None) -> str:
    """mlx-lm's save_prompt_cache, checked first: cache must be a list of cache layers
    (TypeError), metadata a dict of strings (TypeError), and the file's folder must exist
    and be writable (ValueError), so nothing is half written. Then every CaMKVCache layer
    compresses its pending rows (compress_pending: the cache itself changes, as by an
    early compression) and the file holds only scored rows. Returns the path written
    (file_name, with .safetensors appended when it lacks it, as MLX does)."""
    _check_layers(cache)
    if metadata is not None and not (isinstance(metadata, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise TypeError(f"metadata must be a dict of str to str, got {metadata!r}")
    path = Path(saved_path(os.fspath(file_name))).expanduser()
    folder = path.parent
    if path.is_dir():
        raise ValueError(f"cannot save a prompt cache to {path}: it is a folder")
    if not folder.is_dir():
        raise ValueError(f"cannot save a prompt cache to {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"cannot save a prompt cache to {path}: the folder {folder} is not writable")
    for layer in cache:
        if isinstance(layer, CaMKVCache):
            layer.compress_pending()
    try:
        _mlx_save_prompt_cache(str(path), cache, metadata or {})
    except (RuntimeError, OSError) as err:  # what os.access cannot tell (root, /proc, a full disk)
        raise ValueError(f"cannot save a prompt cache to {path}: {err}") from None
    return str(path)


def _check_layers(cache) -> None:
    """A prompt cache is a list of mlx-lm cache layers (what make_prompt_cache returns)."""
    if not isinstance(cache, list):
        raise TypeError(f"cache must be a list of cache layers (camkv.make_prompt_cache's), "
                        f"got {type(cache).__name__}")
    for i, layer in enumerate(cache):
        if not isinstance(layer, mlx_cache._BaseCache):
            raise TypeError(f"cache[{i}] must be a cache layer (CaMKVCache or an mlx-lm cache), "
                            f"got {type(layer).__name__} {layer!r:.40}")


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

    Like mlx_lm.models.cache.load_prompt_cache, but camkv layers load too. A name
    without .safetensors that is not a file is read with it, as save_prompt_cache wrote
    it. A file that is missing, unreadable, truncated or not a prompt cache raises
    ValueError naming the file and what is wrong.
    """
    if not Path(file_name).exists() and Path(saved_path(file_name)).is_file():
        file_name = saved_path(file_name)  # where save_prompt_cache put it
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
