"""Tiny random-weight mlx-lm models for tests (no downloads)."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import llama


def tiny_llama(
    *, heads: int = 4, kv_heads: int = 2, layers: int = 2, hidden: int = 64, vocab: int = 128,
    seed: int = 0,
):
    """A random llama with GQA (heads query heads on kv_heads KV heads), float32."""
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=2 * hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        rms_norm_eps=1e-5,
        vocab_size=vocab,
        rope_theta=10000.0,
        tie_word_embeddings=True,
    )
    mx.random.seed(seed)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model
