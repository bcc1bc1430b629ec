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


def layers_forward(model):
    """forward(ids [1, L], caches): the model's layers over ids, without the output head
    where it is known (output_head), else the whole model."""
    head = output_head(model)

    def forward(ids, caches):
        return model.model(ids, cache=caches) if head is not None else model(ids, cache=caches)

    return forward


def reconstruction(model, caches: list, tokenizer, chunk: int) -> Reconstruction | None:
    """The re-reads' driver of a prompt fed in chunks of `chunk` into caches that score by
    reconstruction (None for any other caches)."""
    return Reconstruction(model, caches, tokenizer, chunk, layers_forward(model)) if reconstructs(caches) else None


def prefill(model, caches: list, prompt: list[int], chunk: int = 2048, tokenizer=None, progress=None) -> mx.array:
    """Feed the prompt's ids in chunks of `chunk` tokens through the model and its caches
    and return the logits [V] of its last position. Where the model's head is known
    (output_head), only that position goes through it; the caches see the same calls
    either way. Caches with prefill_scoring="reconstruct" (every camkv cache of the model,
    then) are scored by the model's re-read of the prompt, which needs its tokenizer.
    progress(done, total): called after each chunk (mlx-lm's prompt_progress_callback)."""
    head = output_head(model)
    forward = layers_forward(model)
    driver = reconstruction(model, caches, tokenizer, chunk)
    out = None
    for position in range(0, len(prompt), chunk):
        block = prompt[position : position + chunk]
        with driver.holding() if driver is not None else nullcontext():
            out = forward(mx.array(block)[None], caches)
        if position + chunk < len(prompt) or driver is not None:
            mx.eval(out)
        if driver is not None:
            driver.fed(block)
        if progress is not None:
            progress(min(position + chunk, len(prompt)), len(prompt))
    logits = (head(out[:, -1:]) if head is not None else out[:, -1:])[0, 0]
    mx.eval(logits)
    if driver is not None:
        driver.finish()
    return logits
