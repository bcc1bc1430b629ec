"""camkv: a bounded-memory KV cache for mlx-lm that merges evicted tokens (CaM)."""

from .cache import CaMKVCache
from .config import CaMConfig
from .integration import applied, apply, make_prompt_cache, remove

__all__ = ["CaMConfig", "CaMKVCache", "apply", "applied", "make_prompt_cache", "remove"]
__version__ = "0.1.0"
