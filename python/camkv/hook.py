"""The attention hook of scoring="query": hands the model's own queries to its camkv caches.

Almost every mlx-lm model calls `scaled_dot_product_attention(queries, keys, values,
cache=cache, scale=..., mask=...)`, imported from mlx_lm.models.base, right after
`cache.update_and_fetch`. We rebind that name in the model's own modules to a
wrapper that first shows the queries (after RoPE) and the scale to the cache, then
calls the original. A cache that no hook can feed scores with keys and warns once
(CaMKVCache.update_and_fetch asks `can_feed` before it waits for queries), and a
model that bypasses an installed hook is caught by the cache itself (it scores the
block with keys and warns once).

A cache whose merge rule keeps votes (camkv.merges, keeps_votes) also has attention
weigh each row by the tokens it stands for: the hook adds the log of each row's votes
to its logits (docs/algorithm.md section 4.6), which only the hook can do; a decode step
on an NVIDIA GPU goes to camkv's attention with the votes' log as its mask per KV head
(camkv.quantized_attention.attend_weighed: MLX's CUDA attention takes no mask there), and
a prompt block on an NVIDIA GPU or the CPU to an attention over the values the votes weigh
(weighed_block, joined_block) instead of a mask of a logit per query and row.

Quantized rows (CaMConfig.bits): a prompt block attends them dequantized once; a decode
step on the CPU or an NVIDIA GPU goes to camkv's attention over the rows as stored
(camkv.quantized_attention), elsewhere to mlx-lm's quantized attention; rows that
neither reads (MLX's CUDA build, a step camkv's pass does not take) dequantized once.
Where camkv.backends.step_cuda takes them, the short way's decode steps on an NVIDIA GPU
come as a StepRows: the step's write and the attention in one launch, then the queries
to the cache.
"""

from __future__ import annotations

import sys

import mlx.core as mx
from mlx_lm.models import base

from . import quantized, quantized_attention
from .backends import drop, quantized_cuda, votes_cuda

_NAME = "scaled_dot_product_attention"
_ORIGINAL = base.scaled_dot_product_attention
_HOOKED = "_camkv_hooked_modules"
# module name -> number of models that asked for the hook there
_users: dict[str, int] = {}
# module name -> the function it held before the hook, put back by the last uninstall
_saved: dict[str, object] = {}


def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, *args, **kwargs):
    """mlx-lm's attention, after handing the queries to a camkv cache that waits for them."""
    observe = getattr(cache, "observe_queries", None)  # a camkv cache
    if observe is not None:
        if type(keys) is quantized.StepRows:  # a quantized decode step its rows hold for one launch
            if mask is None and not args and not kwargs:
                out = keys.attend(queries, scale)
                observe(queries, scale)
                return out
            keys, values = keys.written()
        if observe(queries, scale):
            # A decode step of rows as held, no bias: straight to mlx-lm's attention (plain
            # rows) or camkv's pass over quantized ones (MLX's CUDA build, shapes it takes),
            # without the checks below (host time, every layer and token).
            if type(keys) is not tuple:
                return _ORIGINAL(queries, keys, values, cache, scale, mask, *args, **kwargs)
            if mask is None and not args and not kwargs:
                bits, group_size = quantized.format_of(keys, queries.shape[3])
                return quantized_cuda.attend(queries, keys, values, scale, None, bits, group_size)
        bias = cache.attention_bias()
        given_mask = mask
        stored = isinstance(keys, tuple)  # quantized rows as stored (codes, scales, biases)
        camkvs_pass = not args and kwargs.get("sinks") is None  # a call camkv's own attention may take
        if stored and queries.shape[2] > 1:
            keys, values = block_rows(keys, values, queries)
            cache, stored = None, False  # arrays: mlx-lm's plain attention
        if bias is not None:
            if not stored and camkvs_pass:
                out = quantized_attention.attend_weighed(queries, keys, values, scale, mask, bias)
                if out is None and queries.shape[2] > 1 and WEIGHED_BLOCKS:
                    out = block_weighed_here(queries, keys, values, scale, mask, bias)
                if out is not None:
                    return out
            mask = weighed_by_votes(mask, bias, queries, keys)
        if stored and camkvs_pass:
            bits, group_size = quantized.format_of(keys, queries.shape[3])
            out = quantized_attention.attend(queries, keys, values, scale, mask, bits, group_size)
            if out is not None:  # a decode step camkv ran; else mlx-lm's attention
                return out
        if stored and not hasattr(cache, "bits"):  # rows mlx-lm cannot read here (MLX's CUDA build)
            keys, values = block_rows(keys, values, queries)
            cache = None
            mask = given_mask if bias is None else weighed_by_votes(given_mask, bias, queries, keys)
    return _ORIGINAL(queries, keys, values, cache, scale, mask, *args, **kwargs)


def block_rows(keys: tuple, values: tuple, queries) -> tuple[mx.array, mx.array]:
    """Quantized rows (codes, scales, biases) that a prompt block attends, dequantized
    once (docs/algorithm.md section 12). MLX's quantized attention would multiply the
    block's queries by the codes with its quantized matrix product, which on the CPU has
    no BLAS behind it (a prompt's prefill took 3.3x the unquantized cache's,
    bench/results/README.md); the rows are bounded, so their dequantized copy is small.
    Also a decode step that neither camkv nor mlx-lm's attention reads as stored."""
    bits, group_size = quantized.format_of(keys, queries.shape[3])
    return tuple(quantized.dequantize(q, bits, group_size) for q in (keys, values))


# Whether a prompt block whose rows votes weigh attends through weighed_block on MLX's
# CUDA build and joined_block on the CPU (else through weighed_by_votes' mask, as on Metal,
# whose fused attention takes the mask and not a value width other than the keys').
WEIGHED_BLOCKS = True


def block_weighed_here(queries, keys, values, scale: float, mask, bias):
    """A prompt block's votes-weighed attention without the votes' mask: weighed_block on
    MLX's CUDA build, joined_block on the CPU; None elsewhere (Metal attends with the mask)."""
    if drop.on_cuda():
        return weighed_block(queries, keys, values, scale, mask, bias)
    if mx.default_device() == mx.cpu:
        return joined_block(queries, keys, values, scale, mask, bias)
    return None


def weighed_block(queries, keys, values, scale: float, mask, bias):
    """softmax(scale q k^T + bias) v for a block of queries [B, Hq, S, D] over rows keys and
    values [B, H, N, D] as arrays, bias [B, H, N] the log of each row's votes (docs/
    algorithm.md section 4.6), on MLX's CUDA build, without the [B, Hq, S, N] mask
    weighed_by_votes builds (at llama-3-8B's shape 512 MiB a layer and chunk, built and
    read by every prompt chunk): the votes scale the rows' values and fill one more
    column, MLX's attention with the given mask attends both, and the first divided by
    the second is the votes-weighed softmax's output (sum_j c_j e^l_j V_j / sum_j c_j
    e^l_j). The votes are divided by each KV head's largest first (no overflow in
    float16; the quotient does not change). One launch before the attention and one
    after it (camkv.backends.votes_cuda)."""
    D = values.shape[3]
    weighed, column = votes_cuda.weigh(values, bias)
    sdpa = mx.fast.scaled_dot_product_attention
    out = sdpa(queries, keys, weighed, scale=scale, mask=mask)
    total = out if column is None else sdpa(queries, keys, column, scale=scale, mask=mask)
    return votes_cuda.divide(out, total, D, queries.dtype)


def joined_block(queries, keys, values, scale: float, mask, bias):
    """weighed_block's output on the CPU, by MLX operations: the weights' column joined to
    the weighed values (Dv + 1 channels, which the CPU's attention takes) and one attention
    with the given mask, then the quotient. The CPU's attention holds a block's logits
    [B, Hq, S, N] in float32 while it runs; weighed_by_votes' mask of that size beside
    them doubled a keepkv prompt chunk's peak (bench/results/README.md). The same
    arithmetic as weighed_block (docs/algorithm.md section 4.6)."""
    D = values.shape[3]
    bias = bias.astype(mx.float32)
    weights = mx.exp(bias - bias.max(axis=-1, keepdims=True)).astype(values.dtype)[..., None]
    joined = mx.concatenate([values * weights, weights], axis=-1)
    out = mx.fast.scaled_dot_product_attention(queries, keys, joined, scale=scale, mask=mask)
    return (out[..., :D].astype(mx.float32) / out[..., D:].astype(mx.float32)).astype(queries.dtype)


def weighed_by_votes(mask, bias, queries, keys):
    """The attention mask with each key's bias added to its logits: an additive array
    [B, Hq, S, N] in the queries' dtype (mask itself when bias is None).

    mask: None, "causal" or an array (boolean: True attends; else additive), as mlx-lm
    passes it; bias [B, H, N]: the log of each row's votes per KV head, shared by the
    Hq / H query heads of its group (query head h * G + g reads KV head h). For quantized
    keys (a triple) the mask stays per KV head [B, H, S, N], as mlx-lm's quantized
    attention reads it.
    """
    if bias is None:
        return mask
    quantized = isinstance(keys, tuple)  # a quantized cache's (codes, scales, biases)
    s_len, n_keys = queries.shape[2], (keys[0] if quantized else keys).shape[2]
    # mlx-lm's quantized attention groups the query heads [B, H, G, S, N] and reads a mask
    # [B, H, S, N] per KV head; the fused one reads one per query head.
    repeats = 1 if quantized else queries.shape[1] // bias.shape[1]
    per_query_head = mx.repeat(bias, repeats, axis=1)[:, :, None, :]
    if isinstance(mask, str):  # "causal": bottom-right aligned, as mx.fast reads it
        mask = base.create_causal_mask(s_len, n_keys - s_len)
    if mask is None:
        additive = per_query_head
    elif mask.dtype == mx.bool_:
        additive = mx.where(mask, per_query_head, -float("inf"))
    else:
        additive = mask + per_query_head
    return additive.astype(queries.dtype)


def _model_modules(model) -> set[str]:
    """Python modules defining the model's layers that use mlx-lm's attention function."""
    names = {type(model).__module__}
    for _, child in model.named_modules() if hasattr(model, "named_modules") else []:
        names.add(type(child).__module__)
    return {n for n in names if getattr(sys.modules.get(n), _NAME, None) in (_ORIGINAL, scaled_dot_product_attention)}


def install(model) -> frozenset[str]:
    """Route the model's attention calls through the hook (idempotent per model).

    Returns the modules hooked for the model: empty when none of its layers calls
    mlx-lm's scaled_dot_product_attention (its queries can never reach camkv).
    """
    if getattr(model, _HOOKED, None) is not None:
        return getattr(model, _HOOKED)
    modules = _model_modules(model)
    for name in modules:
        if name not in _users:
            _saved[name] = getattr(sys.modules[name], _NAME)
        setattr(sys.modules[name], _NAME, scaled_dot_product_attention)
        _users[name] = _users.get(name, 0) + 1
    object.__setattr__(model, _HOOKED, frozenset(modules))
    return frozenset(modules)


def uninstall(model) -> None:
    """Undo install: once no hooked model uses a module, its original function comes back."""
    modules = getattr(model, _HOOKED, None)
    if modules is None:
        return
    for name in modules:
        _users[name] -= 1
        if _users[name] == 0:
            del _users[name]
            setattr(sys.modules[name], _NAME, _saved.pop(name))
    object.__delattr__(model, _HOOKED)


def is_installed(model) -> bool:
    return getattr(model, _HOOKED, None) is not None


def installed_modules() -> dict[str, int]:
    """Module name -> how many models hold the hook there now (empty: no hook anywhere)."""
    return dict(_users)


def can_feed(modules: frozenset[str] | None) -> bool:
    """Whether a hook is installed that can hand a cache its queries.

    modules: those hooked for the cache's model (camkv.make_prompt_cache records
    them), or None for a cache built directly, which any hooked model may feed.
    """
    if modules is None:
        return bool(_users)
    return not modules.isdisjoint(_users)
