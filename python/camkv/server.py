"""`camkv serve`: mlx-lm's OpenAI-compatible server, every request cached by camkv.

mlx-lm's server builds each request's cache with `make_prompt_cache(model)`, which
honours `model.make_cache`; we load the model through mlx-lm's own loaders and apply
camkv to it, so nothing else in the server changes. CaMKVCache has `merge`, so the
server batches requests (its --decode-concurrency, --prompt-concurrency and
--prefill-step-size apply) into a BatchCaMKVCache that keeps every row compressed
(docs/batching.md). Each finished batched request logs the KV bytes it held.
"""

from __future__ import annotations

import json
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


def _serve_under(name: str, provider_class):
    """mlx-lm's ModelProvider that also knows the served model by the name it was started with.

    mlx-lm maps only "default_model" (a request without "model") to --model; a request
    naming the model as the user did (what an OpenAI client sends) would otherwise be
    taken for a Hugging Face id.
    """

    class NamedModelProvider(provider_class):
        def __init__(self, cli_args):
            super().__init__(cli_args)
            for alias in {name, cli_args.model}:
                self._model_map[alias] = cli_args.model

    return NamedModelProvider


def _list_served_model(name: str):
    """GET /v1/models: the served model, by its name (mlx-lm's scans the Hugging Face cache)."""

    def handle_models_request(self):
        self._set_completion_headers(200)
        self.end_headers()
        model = {"id": name, "object": "model", "created": self.created, "owned_by": "camkv"}
        self.wfile.write(json.dumps({"object": "list", "data": [model]}).encode())
        self.wfile.flush()

    return handle_models_request


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


def serve(server_argv: list[str], config: CaMConfig, name: str) -> None:
    """Run mlx_lm.server with the given arguments (see `mlx_lm.server --help`) and camkv caches.

    server_argv holds --model with the model's path; name is what requests and
    GET /v1/models call it.
    """
    from mlx_lm import server

    server.load = _with_camkv(server.load, config)
    server.sharded_load = _with_camkv(server.sharded_load, config)
    server.ModelProvider = _serve_under(name, server.ModelProvider)
    server.APIHandler.handle_models_request = _list_served_model(name)
    server.BatchGenerator = _logging_batch_generator(server.BatchGenerator)
    sys.argv = ["camkv serve", *server_argv]
    server.main()
