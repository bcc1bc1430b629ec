"""Tiny random-weight mlx-lm models for tests (no downloads)."""

from __future__ import annotations

import contextlib

import mlx.core as mx
import numpy as np
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


def tiny_qwen3(*, layers: int = 2, seed: int = 0):
    """A random qwen3 (q/k norms, GQA 4 on 2, head dim 16), float32."""
    from mlx_lm.models import qwen3

    args = qwen3.ModelArgs(
        model_type="qwen3", hidden_size=64, num_hidden_layers=layers, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=128,
        max_position_embeddings=4096, rope_theta=10000.0, head_dim=16, tie_word_embeddings=True,
    )
    mx.random.seed(seed)
    model = qwen3.Model(args)
    mx.eval(model.parameters())
    return model


def tiny_gemma3(*, layers: int = 4, seed: int = 0, **overrides):
    """A random gemma3 text model: sliding-window layers (RotatingKVCache) and global layers.

    overrides: other gemma3_text.ModelArgs fields (vocab_size, sliding_window, ...)."""
    from mlx_lm.models import gemma3_text

    fields = dict(
        model_type="gemma3_text", hidden_size=64, num_hidden_layers=layers, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6,
        vocab_size=128, sliding_window=32, sliding_window_pattern=2,
    )
    args = gemma3_text.ModelArgs(**{**fields, **overrides})
    mx.random.seed(seed)
    model = gemma3_text.Model(args)
    mx.eval(model.parameters())
    return model


def tiny_gemma2(*, layers: int = 2, seed: int = 0):
    """A random gemma2: its attention computes softmax itself, without mlx-lm's
    scaled_dot_product_attention, so camkv's attention hook never sees its queries."""
    from mlx_lm.models import gemma2

    args = gemma2.ModelArgs(
        model_type="gemma2", hidden_size=64, num_hidden_layers=layers, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
        vocab_size=128,
    )
    mx.random.seed(seed)
    model = gemma2.Model(args)
    mx.eval(model.parameters())
    return model


def tiny_deepseek_v3(*, layers: int = 2, seed: int = 0):
    """A random deepseek_v3 (multi-head latent attention): its cache holds a compressed
    latent of width 32, its prompt queries have width 16 (dense layers only)."""
    from mlx_lm.models import deepseek_v3

    args = deepseek_v3.ModelArgs(
        model_type="deepseek_v3", vocab_size=128, hidden_size=64, intermediate_size=128,
        moe_intermediate_size=32, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=None, kv_lora_rank=32, q_lora_rank=None,
        qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, max_position_embeddings=4096,
        rope_scaling=None, first_k_dense_replace=layers,
    )
    mx.random.seed(seed)
    model = deepseek_v3.Model(args)
    mx.eval(model.parameters())
    return model


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def byte_tokenizer(vocab: int = 256 + 2):
    """A byte-level tokenizer (one token per byte, plus <s> and </s>) with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_map = pre_tokenizers.ByteLevel.alphabet()
    tokens = {ch: i for i, ch in enumerate(sorted(byte_map))}
    tokens["<s>"], tokens["</s>"] = 256, 257
    core = Tokenizer(models.BPE(vocab=tokens, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", chat_template=CHAT_TEMPLATE
    )


def save_tiny_model_dir(path):
    """An mlx-lm model folder (config, weights, tokenizer) of a tiny random llama; mlx_lm.load reads it."""
    import json
    from pathlib import Path

    from mlx.utils import tree_flatten

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = tiny_llama(vocab=258)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    args = model.args
    config = {k: getattr(args, k) for k in (
        "model_type", "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
        "num_key_value_heads", "rms_norm_eps", "vocab_size", "rope_theta", "tie_word_embeddings")}
    (path / "config.json").write_text(json.dumps(config))
    byte_tokenizer().save_pretrained(str(path))
    return path


def assert_as_alone(got: mx.array, alone: mx.array) -> None:
    """A batch row's array against the same request's run alone: equal bit for bit on the
    CPU. On a GPU within float32 rounding (rtol 1e-4, atol 1e-5): its attention kernels
    split the work by the batch's shape, so a row's outputs differ in the last digits
    (an H200: 0.831403 against 0.83144, 5e-5 relatively), while a row mixed up with
    another, or compressed otherwise, differs in the first ones."""
    if mx.default_device() == mx.cpu:
        assert mx.array_equal(got, alone)
    else:
        assert got.shape == alone.shape and mx.allclose(got, alone, rtol=1e-4, atol=1e-5).item()


def assert_quantized_as_alone(got: tuple, alone: tuple, bits: int, group_size: int) -> None:
    """A batch row's quantized keys or values (codes, scales, biases) against the same
    request's run alone: equal bit for bit on the CPU. On a GPU the scales and biases as
    assert_as_alone, and each value within one step of the lone run's (its group's scale,
    5% more for the scales' and biases' own rounding): an input that differs in the last
    digits may round to the next code, while a row mixed up with another is many off."""
    if mx.default_device() == mx.cpu:
        assert all(mx.array_equal(a, c) for a, c in zip(got, alone))
        return
    for a, c in zip(got[1:], alone[1:]):
        assert_as_alone(a, c)
    values = [mx.dequantize(*q, group_size=group_size, bits=bits) for q in (got, alone)]
    step = mx.repeat(mx.abs(alone[1]), group_size, axis=-1)
    assert mx.all(mx.abs(values[0] - values[1]) <= 1.05 * step + 1e-5).item()


def assert_scores_as_alone(got: mx.array, alone: mx.array) -> None:
    """A batch row's scores against the same request's run alone: equal bit for bit on the
    CPU (docs/algorithm.md section 10). On a GPU within section 8's score tolerance (rtol
    1e-3, atol 1e-5): the queries differ there in the last digits (assert_as_alone), and
    a softmax over logits of magnitude l moves a weight by about l times that."""
    if mx.default_device() == mx.cpu:
        assert mx.array_equal(got, alone)
    else:
        assert got.shape == alone.shape and mx.allclose(got, alone, rtol=1e-3, atol=1e-5).item()


def assert_state_as_alone(got: tuple, alone: tuple, config) -> None:
    """Every item of a batch row's CaMKVCache.state against the same request's run alone
    (config: the row's CaMConfig): its meta (offset, counters, what is pending) equal, its
    scores (item 2) as assert_scores_as_alone, quantized keys and values (the rows' at
    config.bits, then a tier's at tier_bits) as assert_quantized_as_alone, every other
    array (positions, merges, a rule's state, the pending queries, a tier's scores and
    positions) as assert_as_alone."""
    assert len(got) == len(alone)
    for i, (a, c) in enumerate(zip(got, alone)):
        if a is None or c is None:
            assert a is c is None, f"state item {i}: one run holds it, the other not"
        elif isinstance(a, str):
            assert a == c, f"state item {i}: {a} != {c}"
        elif isinstance(a, tuple):
            bits = config.bits if i < 2 else config.tier_bits
            assert_quantized_as_alone(a, c, bits=bits, group_size=config.group_size)
        elif i == 2:
            assert_scores_as_alone(a, c)
        else:
            assert_as_alone(a, c)


@contextlib.contextmanager
def exactly_on_the_cpu():
    """Run the block on the CPU device, where a batch row and its lone run agree bit for
    bit. Comparing quantized rows of a batch with their lone runs on a GPU compares
    evictions, not the batch: the GPU's products for two rows differ from one row's in the
    last bits, quantization turns some of those into a whole code step, and a step moves a
    score by more than docs/algorithm.md section 8's tolerance, so near-tied rows may be
    evicted otherwise (an H200: a scale 0.0245 off after 42 steps). camkv's CUDA attention
    over a batch's codes is checked against float64 in tests/test_quantized_cuda.py."""
    device = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        yield
    finally:
        mx.set_default_device(device)


def batch_of_lone_caches(model, prompts: list[list[int]], **fields):
    """Each prompt prefilled alone into camkv caches of these fields, then those caches
    merged into one BatchCaMKVCache list: (the lone cache lists, the batch's)."""
    import camkv
    from camkv.batch import BatchCaMKVCache

    alone = []
    for prompt in prompts:
        cache = camkv.make_prompt_cache(model, **fields)
        model(mx.array(prompt)[None], cache=cache)
        alone.append(cache)
    return alone, [BatchCaMKVCache.merge([c[i] for c in alone]) for i in range(len(alone[0]))]


def feed_with_queries(cache, sizes, *, seed: int, heads: int = 2, groups: int = 2, k_dim: int = 8,
                      v_dim: int = 8, scale: float = 0.5):
    """Feed one random prompt [1, heads, sum(sizes), D] to a cache in blocks of the given
    sizes, each with its queries (query scoring, as camkv's attention hook hands them
    over); keys, values and queries are drawn in that order from one seeded generator."""
    rng = np.random.default_rng(seed)
    total = sum(sizes)
    keys, values, queries = (mx.array(rng.standard_normal((1, h, total, d)).astype(np.float32))
                             for h, d in ((heads, k_dim), (heads, v_dim), (heads * groups, k_dim)))
    first = 0
    for size in sizes:
        block = slice(first, first + size)
        cache.update_and_fetch(keys[:, :, block], values[:, :, block])
        cache.observe_queries(queries[:, :, block], scale)
        first += size
    return cache


def random_steps(seed: int, kv_heads: int = 2, query_heads: int = 4, dim: int = 64):
    """(block, query): functions of s drawing float32 keys or values [1, kv_heads, s, dim]
    and queries [1, query_heads, s, dim] in turn from one generator, as a hooked model
    would hand a cache and its attention."""
    rng = np.random.default_rng(seed)
    return (lambda s: mx.array(rng.standard_normal((1, kv_heads, s, dim)).astype(np.float32)),
            lambda s: mx.array(rng.standard_normal((1, query_heads, s, dim)).astype(np.float32)))


def counted(monkeypatch, module, name: str) -> list:
    """Replace module.name by itself counting its calls: the list grows by one a call."""
    calls, real = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls
