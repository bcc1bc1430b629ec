"""`camkv serve`: mlx-lm's OpenAI-compatible server, every request cached by camkv.

mlx-lm's server builds each request's cache with `make_prompt_cache(model)`, which
honours `model.make_cache`; we load the model through mlx-lm's own loaders and apply
camkv to it, so nothing else in the server changes. CaMKVCache has `merge`, so the
server batches requests (its --decode-concurrency, --prompt-concurrency and
--prefill-step-size apply) into a BatchCaMKVCache that keeps every row compressed
(docs/batching.md). Each finished batched request logs the KV bytes it held.
"""

from __future__ import annotations

import io
import json
import sys

from .batch import BatchCaMKVCache
from .cache import CaMKVCache
from .config import CaMConfig
from .integration import apply
from .models import context_length


def _announce(model, config: CaMConfig) -> None:
    """Log each request's cache to stderr, so an operator (and the tests) can see camkv at work."""
    make = model.make_cache

    def make_and_log():
        caches = make()
        ours = [c for c in caches if isinstance(c, CaMKVCache)]
        first = ours[0].config if ours else config  # a byte budget chooses each layer's budget
        print(f"camkv: request cache has {len(ours)}/{len(caches)} CaMKVCache layers "
              f"(budget={first.budget}, bits={first.bits}, merge={first.merge}, scoring={first.scoring})",
              file=sys.stderr, flush=True)
        return caches

    object.__setattr__(model, "make_cache", make_and_log)


def _with_camkv(loader, config: CaMConfig, kv_bytes=None):
    def load_and_apply(*args, **kwargs):
        loaded = loader(*args, **kwargs)
        apply(loaded[0], config, kv_bytes=kv_bytes)
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
    """Most KV bytes a request's camkv layers may hold: budget + slack rows of every head
    (and a tier's rows)."""
    bound = 0
    for c in caches:
        if isinstance(c, CaMKVCache):
            bound += c.bytes_bound()
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


# Most prompt tokens prefilled in one scheduling round, shared by the prompts prefilling.
PREFILL_ROUND_TOKENS = 512


def prefill_share(round_tokens: int, step_size: int, rows: int) -> int:
    """Prompt tokens each prefilling row gets in one round: the round's tokens shared out
    (rows are right-padded to one length), at most mlx-lm's --prefill-step-size."""
    return max(1, min(step_size, round_tokens // max(1, rows)))


def _bounded_batch_generator(base, round_tokens: int):
    """mlx-lm's BatchGenerator with at most round_tokens prompt tokens prefilled per round.

    Each round (BatchGenerator.next) decodes one token of every generating row, then
    prefills a slice of each prompt. A request arriving behind a long prompt waits for
    three rounds: the one under way, the one that prefills it (padded to the long
    prompt's slice), and the one that decodes its first token; with mlx-lm's slices of
    --prefill-step-size (2048) tokens that was 14-27 s behind a 16k-token prompt on a
    2-core CPU, with slices of a 512-token round 1.3-2.6 s (bench/server_ttft.py)."""

    class BoundedPrefillBatchGenerator(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._step_cap = self.prefill_step_size

        def _next(self):
            joining = min(len(self._unprocessed_sequences), self.prefill_batch_size - len(self._prompt_batch))
            rows = len(self._prompt_batch) + max(0, joining)
            self.prefill_step_size = prefill_share(round_tokens, self._step_cap, rows)
            return super()._next()

    return BoundedPrefillBatchGenerator


def _logging_batch_generator(base):
    class LoggingBatchGenerator(base):
        def next(self):
            prompt_responses, generation_responses = super().next()
            for r in generation_responses:
                if r.finish_reason is not None:
                    _log_finished(self, r)
            return prompt_responses, generation_responses

    return LoggingBatchGenerator


class RefusedRequest(ValueError):
    """A request camkv serve answers with a 400 and this message."""


def check_messages(messages) -> None:
    """A chat request's messages: a non-empty list of {"role": str, "content": ...} objects."""
    if not isinstance(messages, list) or not messages:
        raise RefusedRequest(f"messages must be a non-empty list of {{\"role\", \"content\"}} objects, "
                             f"got {json.dumps(messages)[:80]}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RefusedRequest(f"messages[{i}] must be an object with a string \"role\", got "
                                 f"{json.dumps(message)[:80]}")


def check_context(prompt_tokens: int, context: int | None, allow_past_context: bool) -> None:
    """Refuse a prompt longer than the model's trained context, unless allowed."""
    if context is not None and prompt_tokens > context and not allow_past_context:
        raise RefusedRequest(
            f"the prompt is {prompt_tokens} tokens, past the model's context of {context} tokens "
            "(max_position_embeddings); shorten it, or start camkv serve with --allow-past-context "
            "(camkv's memory stays bounded, but the model sees positions it was not trained on)")


class _NotingRefusals:
    """One request's view of mlx-lm's ResponseGenerator that notes a RefusedRequest, so the
    handler answers it with a 400 (mlx-lm answers every generation error with a 404)."""

    def __init__(self, generator):
        self._generator, self.refused = generator, None

    def generate(self, *args, **kwargs):
        try:
            return self._generator.generate(*args, **kwargs)
        except RefusedRequest as err:
            self.refused = err
            raise

    def __getattr__(self, name):
        return getattr(self._generator, name)


def _checking_handler(handler_class):
    """mlx-lm's APIHandler with camkv's checks: a body that is not UTF-8 and bad messages
    are 400s, and so is a request its tokenizing refused (RefusedRequest)."""
    do_post = handler_class.do_POST
    chat = handler_class.handle_chat_completions
    headers = handler_class._set_completion_headers

    def refuse(self, message: str) -> None:
        headers(self, 400)
        self.end_headers()
        self.wfile.write(json.dumps({"error": message}).encode())

    def checked_post(self):
        self.response_generator = _NotingRefusals(self.response_generator)
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            return do_post(self)  # mlx-lm answers these itself
        raw = self.rfile.read(int(length))
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as err:
            return refuse(self, f"the request body is not UTF-8 text (byte {err.start}): send JSON in UTF-8")
        self.rfile = io.BytesIO(raw)
        return do_post(self)

    def checked_chat(self):
        check_messages(self.body.get("messages"))  # mlx-lm turns the error into a 400
        return chat(self)

    def set_headers(self, status_code: int = 200):
        if status_code == 404 and getattr(self.response_generator, "refused", None) is not None:
            status_code = 400
        headers(self, status_code)

    handler_class.do_POST = checked_post
    handler_class.handle_chat_completions = checked_chat
    handler_class._set_completion_headers = set_headers


def _checking_tokenizer(generator_class, allow_past_context: bool):
    """mlx-lm's ResponseGenerator, refusing a prompt past the model's context as it tokenizes."""
    tokenize = generator_class._tokenize

    def checked_tokenize(self, tokenizer, request, args):
        tokenized = tokenize(self, tokenizer, request, args)
        check_context(len(tokenized[0]), context_length(self.model_provider.model), allow_past_context)
        return tokenized

    generator_class._tokenize = checked_tokenize


def serve(server_argv: list[str], config: CaMConfig, name: str, allow_past_context: bool = False,
          prefill_round_tokens: int = PREFILL_ROUND_TOKENS, kv_bytes=None) -> None:
    """Run mlx_lm.server with the given arguments (see `mlx_lm.server --help`) and camkv caches.

    server_argv holds --model with the model's path; name is what requests and
    GET /v1/models call it. A prompt past the model's context is refused (a 400) unless
    allow_past_context; at most prefill_round_tokens prompt tokens are prefilled per
    scheduling round, between decode steps. kv_bytes: a byte budget per layer
    (camkv.make_prompt_cache's), which chooses each layer's budget.
    """
    from mlx_lm import server

    server.load = _with_camkv(server.load, config, kv_bytes)
    server.sharded_load = _with_camkv(server.sharded_load, config, kv_bytes)
    server.ModelProvider = _serve_under(name, server.ModelProvider)
    server.APIHandler.handle_models_request = _list_served_model(name)
    _checking_handler(server.APIHandler)
    _checking_tokenizer(server.ResponseGenerator, allow_past_context)
    bounded = _bounded_batch_generator(server.BatchGenerator, prefill_round_tokens)
    server.BatchGenerator = _logging_batch_generator(bounded)
    sys.argv = ["camkv serve", *server_argv]
    server.main()
