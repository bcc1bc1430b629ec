"""Tiny GGUF files made the way llama.cpp makes them, from random mlx-lm llamas.

The tokenizer is a small GPT-2 byte-level BPE: three control tokens, the 256
byte symbols, and a few merges, with a ChatML template like SmolLM2's.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from tokenizers import pre_tokenizers

from camkv.models import permute_rope_rows
from tiny_models import tiny_llama

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "1 2"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# GGUF tensor name (after blk.N.) for each mlx-lm llama module path.
_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def tiny_tokens() -> list[str]:
    merged = [m.replace(" ", "") for m in MERGES]
    return SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()) + merged


def tiny_gguf_llama(seed: int = 0):
    """A random GQA llama (4 query heads on 2 KV heads, head dim 16) sized to tiny_tokens()."""
    return tiny_llama(vocab=len(tiny_tokens()), seed=seed)


def gguf_name(mlx_name: str) -> str:
    """'model.layers.3.self_attn.q_proj.weight' -> 'blk.3.attn_q.weight'."""
    if mlx_name.startswith("model.layers."):
        _, _, layer, rest = mlx_name.split(".", 3)
        module, leaf = rest.rsplit(".", 1)
        return f"blk.{layer}.{_LAYER_NAMES[module]}.{leaf}"
    module, leaf = mlx_name.rsplit(".", 1)
    return {"model.embed_tokens": "token_embd", "model.norm": "output_norm",
            "lm_head": "output"}[module] + f".{leaf}"


def gguf_tensors(model, quantize: bool = False) -> dict:
    """The model's weights as mx.load would return them from a llama.cpp GGUF.

    Q and K rows are permuted the way llama.cpp's converter does. With quantize,
    linear weights become 4-bit triplets and the embedding 8-bit (group size 32),
    the shapes mx.load gives for Q4_1 / Q8_0 tensors.
    """
    from mlx.utils import tree_flatten

    heads = {"attn_q": model.args.num_attention_heads, "attn_k": model.args.num_key_value_heads}
    out = {}
    for name, w in tree_flatten(model.parameters()):
        gname = gguf_name(name)
        kind = gname.split(".")[-2]
        if kind in heads:
            w = permute_rope_rows(w, heads[kind])
        if quantize and w.ndim == 2:
            bits = 8 if kind == "token_embd" else 4
            packed, scales, biases = mx.quantize(w, group_size=32, bits=bits)
            stem = gname.rsplit(".", 1)[0]
            out.update({f"{stem}.weight": packed, f"{stem}.scales": scales.astype(mx.float16),
                        f"{stem}.biases": biases.astype(mx.float16)})
        else:
            out[gname] = w
    return out


def gguf_metadata(model) -> dict:
    a = model.args
    tokens = tiny_tokens()
    u32 = lambda v: mx.array(v, dtype=mx.uint32)  # noqa: E731
    return {
        "general.architecture": "llama",
        "llama.embedding_length": u32(a.hidden_size),
        "llama.block_count": u32(a.num_hidden_layers),
        "llama.feed_forward_length": u32(a.intermediate_size),
        "llama.attention.head_count": u32(a.num_attention_heads),
        "llama.attention.head_count_kv": u32(a.num_key_value_heads),
        "llama.rope.dimension_count": u32(a.hidden_size // a.num_attention_heads),
        "llama.attention.layer_norm_rms_epsilon": mx.array(a.rms_norm_eps, dtype=mx.float32),
        "llama.rope.freq_base": mx.array(a.rope_theta, dtype=mx.float32),
        "llama.context_length": u32(2048),
        "llama.vocab_size": u32(len(tokens)),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": list(MERGES),
        "tokenizer.ggml.token_type": mx.array(
            [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)), dtype=mx.int32),
        "tokenizer.ggml.bos_token_id": u32(1),
        "tokenizer.ggml.eos_token_id": u32(2),
        "tokenizer.ggml.unknown_token_id": u32(0),
        "tokenizer.ggml.padding_token_id": u32(2),
        "tokenizer.ggml.add_bos_token": mx.array(False),
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }


def write_tiny_gguf(path, seed: int = 0):
    """Write a float32 tiny llama as a GGUF file; return the original model."""
    model = tiny_gguf_llama(seed)
    mx.save_gguf(str(path), gguf_tensors(model), gguf_metadata(model))
    return model


def quantize_like_gguf(model):
    """The model quantized as the GGUF triplets are: linears 4-bit, embedding 8-bit, group 32."""
    def params(path, module):
        if isinstance(module, nn.Embedding):
            return {"group_size": 32, "bits": 8}
        return isinstance(module, nn.Linear)

    nn.quantize(model, group_size=32, bits=4, class_predicate=params)
    # GGUF stores scales and biases as float16.
    from mlx.utils import tree_flatten

    model.load_weights([(name, w.astype(mx.float16).astype(w.dtype) if name.endswith(("scales", "biases")) else w)
                        for name, w in tree_flatten(model.parameters())])
    return model


def logits(model, tokens) -> np.ndarray:
    out = model(mx.array(tokens)[None])
    return np.array(out.astype(mx.float32))
