"""`camkv serve`: mlx-lm's OpenAI-compatible server, every request cached by camkv.

mlx-lm's server builds each request's cache with `make_prompt_cache(model)`, which
honours `model.make_cache`; we load the model through mlx-lm's own loaders and apply
camkv to it, so nothing else in the server changes. CaMKVCache has no `merge`, so
the server serves requests one at a time instead of batching them into an
uncompressed BatchKVCache.
"""

from __future__ import annotations

import sys

from .cache import CaMKVCache
from .config import CaMConfig
from .integration import apply


def _announce(model, config: CaMConfig) -> None:
    """Log each request's cache to stderr, so an operator (and the tests) can see camkv at work."""
    make = model.make_cache

    def make_and_log():
        caches = make()
        ours = sum(isinstance(c, CaMKVCache) for c in caches)
        print(f"camkv: request cache has {ours}/{len(caches)} CaMKVCache layers "
              f"(budget={config.budget}, merge={config.merge}, scoring={config.scoring})", file=sys.stderr, flush=True)
        return caches

    object.__setattr__(model, "make_cache", make_and_log)


def _with_camkv(loader, config: CaMConfig):
    def load_and_apply(*args, **kwargs):
        loaded = loader(*args, **kwargs)
        apply(loaded[0], config)
        _announce(loaded[0], config)
        return loaded

    return load_and_apply


def serve(server_argv: list[str], config: CaMConfig) -> None:
    """Run mlx_lm.server with the given arguments (see `mlx_lm.server --help`) and camkv caches."""
    from mlx_lm import server

    server.load = _with_camkv(server.load, config)
    server.sharded_load = _with_camkv(server.sharded_load, config)
    sys.argv = ["camkv serve", *server_argv]
    server.main()
