"""A prompt fed in chunks, as mlx-lm's prefill does, returning its last position's logits;
with reconstruction scoring (CaMConfig.prefill_scoring="reconstruct") it also runs the
re-reads that score the prompt (camkv.reconstruct)."""

from __future__ import annotations

from contextlib import nullcontext

import mlx.core as mx

from .reconstruct import Reconstruction, reconstructs

# mlx-lm model modules whose Model.__call__ is exactly its output head over self.model(...):
# a prefill needs the head at the last position only (it is most of a small model's
# prefill: Gemma 3 270M's vocabulary of 262144 costs more than its 18 layers).
_HEAD_AFTER_BACKBONE = ("mlx_lm.models.llama", "mlx_lm.models.gemma3_text")


def output_head(model):
    """The output head of an mlx-lm model whose call is head(model.model(inputs, cache)),
    as mlx-lm's llama and gemma3_text models are; None for any other model."""
    if type(model).__module__ not in _HEAD_AFTER_BACKBONE or not hasattr(model, "model"):
        return None
    if "lm_head" in model:
        return model.lm_head
    return model.model.embed_tokens.as_linear


def layers_forward(model, head=None):
    """forward(ids [1, L], caches): the model's layers over ids, without the output head
    where it is known (head, else output_head's), else the whole model."""
    head = output_head(model) if head is None else head

    def forward(ids, caches):
        return model.model(ids, cache=caches) if head is not None else model(ids, cache=caches)

    return forward


def reconstruction(model, caches: list, tokenizer, chunk: int) -> Reconstruction | None:
    """The re-reads' driver of a prompt fed in chunks of `chunk` into caches that score by
    reconstruction (None for any other caches)."""
    return Reconstruction(model, caches, tokenizer, chunk, layers_forward(model)) if reconstructs(caches) else None


def fed_in_chunks(forward, caches: list, tokens: list[int], chunk: int, driver: Reconstruction | None,
                  progress=None):
    """Yield (first position, forward's output) for each chunk of `chunk` tokens fed through
    forward(ids [1, n], caches). Under a re-reads' driver each chunk is fed with the caches
    holding, then evaluated and handed to it, and the driver finishes after the last one;
    progress(done, total) follows each chunk."""
    for position in range(0, len(tokens), chunk):
        block = tokens[position : position + chunk]
        with driver.holding() if driver is not None else nullcontext():
            out = forward(mx.array(block)[None], caches)
        yield position, out
        if driver is not None:
            mx.eval(out)
            driver.fed(block)
        if progress is not None:
            progress(min(position + chunk, len(tokens)), len(tokens))
    if driver is not None:
        driver.finish()


def prefill(model, caches: list, prompt: list[int], chunk: int = 2048, tokenizer=None, progress=None) -> mx.array:
    """Feed the prompt's ids in chunks of `chunk` tokens through the model and its caches
    and return the logits [V] of its last position. Where the model's head is known
    (output_head), only that position goes through it; the caches see the same calls
    either way. Caches with prefill_scoring="reconstruct" (every camkv cache of the model,
    then) are scored by the model's re-read of the prompt, which needs its tokenizer.
    progress(done, total): called after each chunk (mlx-lm's prompt_progress_callback)."""
    head = output_head(model)
    out = None
    for position, out in fed_in_chunks(layers_forward(model, head), caches, prompt, chunk,
                                       reconstruction(model, caches, tokenizer, chunk), progress):
        if position + chunk < len(prompt):
            mx.eval(out)
    logits = (head(out[:, -1:]) if head is not None else out[:, -1:])[0, 0]
    mx.eval(logits)
    return logits
