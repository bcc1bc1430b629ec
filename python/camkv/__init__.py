"""camkv: a bounded-memory KV cache for mlx-lm that merges evicted tokens (CaM)."""

from .config import CaMConfig

__all__ = ["CaMConfig"]
__version__ = "0.1.0"
