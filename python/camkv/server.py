"""`camkv serve`: mlx-lm's OpenAI-compatible server, every request cached by camkv.

mlx-lm's server builds each request's cache with `make_prompt_cache(model)`, which
honours `model.make_cache`; we load the model through mlx-lm's own loaders and apply
camkv to it, so nothing else in the server changes. CaMKVCache has `merge`, so the
server batches requests (its --decode-concurrency, --prompt-concurrency and
--prefill-step-size apply) into a BatchCaMKVCache that keeps every row compressed
(docs/batching.md). Each finished batched request logs the KV bytes it held.
"""

from __future__ import annotations

import sys

from .batch import BatchCaMKVCache
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


def kv_bound(caches) -> int:
    """Most KV bytes a request's camkv layers may hold: budget + slack rows of every head."""
    bound = 0
    for c in caches:
        if isinstance(c, CaMKVCache) and not c.empty():
            keys, values = c.keys, c.values
            per_row = (keys.shape[3] + values.shape[3]) * keys.dtype.size + 8
            bound += keys.shape[0] * keys.shape[1] * (c.config.budget + c.config.slack) * per_row
    return bound


def _log_finished(generator, response) -> None:
    """One stderr line per finished request: its KV bytes (and their bound), and what the
    batch still holds, so an operator (and the tests) can see memory stay bounded."""
    caches = response.prompt_cache or []
    kv = sum(c.nbytes for c in caches)
    rows = len(generator._generation_batch)
    batch = sum(c.nbytes for c in generator._generation_batch.prompt_cache
                if isinstance(c, BatchCaMKVCache))
    print(f"camkv: request {response.uid} done ({response.finish_reason}): "
          f"{len(response.all_tokens or [])} tokens, KV {kv} bytes (bound {kv_bound(caches)}); "
          f"batch KV {batch} bytes in {rows} rows", file=sys.stderr, flush=True)


def _logging_batch_generator(base):
    class LoggingBatchGenerator(base):
        def next(self):
            prompt_responses, generation_responses = super().next()
            for r in generation_responses:
                if r.finish_reason is not None:
                    _log_finished(self, r)
            return prompt_responses, generation_responses

    return LoggingBatchGenerator


def serve(server_argv: list[str], config: CaMConfig) -> None:
    """Run mlx_lm.server with the given arguments (see `mlx_lm.server --help`) and camkv caches."""
    from mlx_lm import server

    server.load = _with_camkv(server.load, config)
    server.sharded_load = _with_camkv(server.sharded_load, config)
    server.BatchGenerator = _logging_batch_generator(server.BatchGenerator)
    sys.argv = ["camkv serve", *server_argv]
    server.main()
