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


_TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(mlx_name: str, layer_names: dict = _LAYER_NAMES) -> str:
    """'model.layers.3.self_attn.q_proj.weight' -> 'blk.3.attn_q.weight' (llama.cpp's names,
    a layer's modules named by layer_names)."""
    if mlx_name.startswith("model.layers."):
        _, _, layer, rest = mlx_name.split(".", 3)
        module, leaf = rest.rsplit(".", 1)
        return f"blk.{layer}.{layer_names[module]}.{leaf}"
    module, leaf = mlx_name.rsplit(".", 1)
    return _TOP_NAMES[module] + f".{leaf}"


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


# ---------------------------------------------------------------------------
# Gemma 3: a SentencePiece vocabulary, RMSNorm weights stored as 1 + w
# ---------------------------------------------------------------------------

SPACE = "\u2581"
# (token, llama.cpp token type): control 3, unknown 2, user-defined 4, byte 6, normal 1.
SPM_SPECIALS = [("<pad>", 3), ("<eos>", 3), ("<bos>", 3), ("<unk>", 2), ("<start_of_turn>", 3)]
SPM_USER_DEFINED = ["  ", "\n\n"]  # spelled with real spaces, as llama.cpp's GGUF files spell them
SPM_PIECES = (
    [SPACE] + list("abcdefghijklmnopqrstuvwxyz,.")
    + ["he", "ll", "hell", "hello", SPACE + "w", "or", SPACE + "wor", "ld", SPACE + "world",
       SPACE + "t", "th", SPACE + "th", SPACE + "the", "in", SPACE + "in"]
)
BOS_ID, EOS_ID = 2, 1

# mlx-lm gemma3 module path (after model.layers.N.) -> GGUF tensor name (after blk.N.)
_GEMMA3_LAYER_NAMES = {
    **{k: v for k, v in _LAYER_NAMES.items() if k != "post_attention_layernorm"},
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, types) of a tiny SentencePiece BPE vocabulary laid out like Gemma's:
    specials, user-defined tokens, the 256 byte tokens, then normal pieces by falling score."""
    tokens = [t for t, _ in SPM_SPECIALS] + SPM_USER_DEFINED + [f"<0x{b:02X}>" for b in range(256)]
    types = [ty for _, ty in SPM_SPECIALS] + [4] * len(SPM_USER_DEFINED) + [6] * 256
    scores = [0.0] * len(tokens)
    tokens += SPM_PIECES
    types += [1] * len(SPM_PIECES)
    scores += [-float(i) for i in range(len(SPM_PIECES))]
    return tokens, scores, types


def tiny_gguf_gemma3(seed: int = 0):
    """A random Gemma 3 as llama.cpp lays one out: a global layer after five sliding-window
    ones (window 8), queries scaled by 1/sqrt(head dim), random RMSNorm weights."""
    from mlx.utils import tree_flatten

    from tiny_models import tiny_gemma3

    model = tiny_gemma3(layers=6, seed=seed, vocab_size=len(spm_vocab()[0]), sliding_window=8,
                        sliding_window_pattern=6, query_pre_attn_scalar=16)
    model.sanitize({})  # no lm_head: the embedding is tied, as in every Gemma 3
    rng = np.random.default_rng(seed)
    model.load_weights([(name, mx.array(rng.normal(0.0, 0.5, w.shape).astype(np.float32)))
                        for name, w in tree_flatten(model.parameters()) if "norm" in name],
                       strict=False)
    mx.eval(model.parameters())
    return model


def gemma3_gguf_name(mlx_name: str) -> str:
    """'model.layers.3.pre_feedforward_layernorm.weight' -> 'blk.3.ffn_norm.weight'."""
    return gguf_name(mlx_name, _GEMMA3_LAYER_NAMES)


def write_tiny_gemma3_gguf(path, seed: int = 0, quant: str = "F32"):
    """Write a tiny Gemma 3 GGUF with llama.cpp's conventions (norms stored as 1 + w, no
    Q/K permutation, tied embedding) through the gguf package; matrices of type `quant`
    ("F32", or "Q5_0", which MLX cannot read, so the file is dequantized on conversion).

    Returns the model the converted file must reproduce: the original, its matrices
    rounded through `quant` as the file holds them."""
    from gguf import GGMLQuantizationType, GGUFWriter, quants
    from mlx.utils import tree_flatten

    model = tiny_gguf_gemma3(seed)
    qtype = GGMLQuantizationType[quant]
    writer = GGUFWriter(str(path), "gemma3")
    _gemma3_metadata(writer, model.args)
    stored = []
    for name, w in tree_flatten(model.parameters()):
        values = np.array(w, dtype=np.float32)
        if "norm" in name:
            writer.add_tensor(gemma3_gguf_name(name), values + 1.0)  # llama.cpp's Gemma norms
        elif quant != "F32":
            packed = quants.quantize(values, qtype)
            writer.add_tensor(gemma3_gguf_name(name), packed, raw_dtype=qtype)
            values = quants.dequantize(packed, qtype)
        else:
            writer.add_tensor(gemma3_gguf_name(name), values)
        stored.append((name, mx.array(values)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model.load_weights(stored)
    return model


def _gemma3_metadata(writer, a) -> None:
    tokens, scores, types = spm_vocab()
    for key, value in {
        "context_length": 4096, "embedding_length": a.hidden_size, "block_count": a.num_hidden_layers,
        "feed_forward_length": a.intermediate_size, "attention.head_count": a.num_attention_heads,
        "attention.head_count_kv": a.num_key_value_heads, "attention.key_length": a.head_dim,
        "attention.value_length": a.head_dim, "attention.sliding_window": a.sliding_window,
    }.items():
        writer.add_uint32(f"gemma3.{key}", value)
    writer.add_float32("gemma3.attention.layer_norm_rms_epsilon", a.rms_norm_eps)
    writer.add_float32("gemma3.rope.freq_base", a.rope_theta)
    writer.add_string("tokenizer.ggml.model", "llama")
    writer.add_string("tokenizer.ggml.pre", "default")
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.scores", scores)
    writer.add_array("tokenizer.ggml.token_type", types)
    for key, value in {"bos": BOS_ID, "eos": EOS_ID, "unknown": 3, "padding": 0}.items():
        writer.add_uint32(f"tokenizer.ggml.{key}_token_id", value)
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_bool("tokenizer.ggml.add_space_prefix", False)
