"""The models an evaluation runs: one loader for `camkv eval` and `camkv bench`."""

from __future__ import annotations

import mlx.core as mx

from .. import models

TINY_MODEL = "tiny-random"


class ByteTokenizer:
    """UTF-8 bytes as token ids (vocabulary 256): the tokenizer of the tiny random model."""

    bos_token_id = None
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


def tiny_random_model(seed: int = 0):
    """camkv.models' "random-tiny" llama (2 layers, GQA 4 on 2, vocabulary 256, float32)
    with the byte tokenizer."""
    return models.random_llama("random-tiny", mx.float32, seed=seed), ByteTokenizer()


def load_model(spec: str):
    """(model, tokenizer) for a --model value of `camkv eval` or `camkv bench`: the one
    place the evaluation loads models.

    "tiny-random" is built here with the byte tokenizer; a random llama preset of
    camkv.models (random-tiny, random-demo, random-1b: speed only) comes without a
    tokenizer (None); anything else goes to camkv.models.load (a packaged model such as
    the default SmolLM2 or Gemma 3 270M, a .gguf file, an mlx-lm folder or a Hugging Face id).
    """
    if spec == TINY_MODEL:
        return tiny_random_model()
    if spec in models.RANDOM_LLAMAS:
        return models.random_llama(spec), None
    return models.load(spec)


def cast_model(model, dtype_name: str):
    """Cast floating weights: "auto" is float32 on the CPU (far faster there) and as-is elsewhere."""
    if dtype_name == "auto":
        if mx.default_device().type != mx.DeviceType.cpu:
            return model
        dtype_name = "float32"
    dtype = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}[dtype_name]
    from mlx.utils import tree_map

    floating = (mx.float32, mx.float16, mx.bfloat16)
    model.update(tree_map(lambda a: a.astype(dtype) if a.dtype in floating else a,
                          model.parameters()))
    mx.eval(model.parameters())
    return model
