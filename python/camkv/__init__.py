"""camkv: a bounded-memory KV cache for mlx-lm: evicts the tokens its queries attend to least (H2O), or merges them into the survivors (CaM)."""

from .batch import BatchCaMKVCache  # also lets CaMKVCache.merge build batches
from .cache import CaMKVCache, QueryScoringWarning, VotesWarning
from .config import CaMConfig
from .integration import applied, apply, make_prompt_cache, remove
from .prompt_cache import load_prompt_cache, save_prompt_cache

__all__ = [
    "BatchCaMKVCache", "CaMConfig", "CaMKVCache", "QueryScoringWarning", "apply", "applied", "load_prompt_cache",
    "make_prompt_cache", "remove", "save_prompt_cache", "VotesWarning",
]
__version__ = "0.1.0"
