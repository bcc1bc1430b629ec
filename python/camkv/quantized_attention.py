"""A decode step's attention over quantized rows, read as stored: the CPU and CUDA.

mlx-lm reads a quantized cache's rows through `quantized_scaled_dot_product_attention`:
two of MLX's quantized matrix products, which on the CPU are plain loops (at SmolLM2's
shape, 512 rows, 8-bit, several times an unquantized attention) and on MLX's CUDA build
missing for most of a cache's shapes. camkv's hook hands a quantized decode step to its
own pass instead (docs/algorithm.md section 12): on the CPU the extension's, on an
NVIDIA GPU camkv.backends.quantized_cuda's two launches; the same softmax over the same
dequantized rows, summed in float32. Anything neither takes (a prompt block, attention
sinks, a mask it cannot read per KV head, Metal) is not taken here: None.

The same CUDA pass reads rows held as the model's dtype too (attend_weighed): a decode
step whose rows a merge rule's votes weigh (docs/algorithm.md section 4.6) needs a mask,
which MLX's CUDA attention does not take for one query (its fallback is a chain of
launches a layer and step); camkv's pass reads the votes' log as a mask per KV head.
"""

from __future__ import annotations

import mlx.core as mx

from .backends import ext, quantized_cuda


def runs_here(queries: mx.array) -> bool:
    """Whether camkv can run this step: a single query position, and the extension built
    for the running mlx with the CPU the default device, or MLX's CUDA build."""
    return queries.shape[2] == 1 and (quantized_cuda.here() or ext.unavailable_reason() is None)


def additive_mask(mask, B: int, H: int, L: int, N: int):
    """mlx-lm's mask as the extension reads it: None, or additive float32 [B, 1 or H, L, N]
    (a boolean False becomes float32's lowest value, as mlx-lm's quantized attention puts
    it in the logits); False where the mask has no such form (then mlx-lm attends)."""
    if mask is None or isinstance(mask, str):  # "causal" over one query: every row visible
        return None
    if mask.ndim == 2:
        mask = mask[None, None]
    if mask.ndim != 4 or mask.shape[1] not in (1, H):
        return False
    if mask.dtype == mx.bool_:
        mask = mx.where(mask, 0.0, mx.finfo(mx.float32).min)
    return mx.broadcast_to(mask.astype(mx.float32), (B, mask.shape[1], L, N))


def attend(queries: mx.array, keys: tuple, values: tuple, scale: float, mask, bits: int, group_size: int):
    """softmax(scale q k^T + mask) v over quantized rows by the extension, [B, Hq, L, Dv] in
    the queries' dtype; None where it does not apply (the caller attends as mlx-lm does)."""
    if not runs_here(queries):
        return None
    B, H, N = keys[0].shape[:3]
    if N == 0:
        return None
    added = additive_mask(mask, B, H, queries.shape[2], N)
    if added is False:
        return None
    if quantized_cuda.here():
        if not quantized_cuda.takes(queries, keys, values, bits, group_size):
            return None
        return quantized_cuda.attend(queries, keys, values, scale, added, bits, group_size)
    return ext.quantized_attention(queries, keys, values, scale=scale, mask=added, bits=bits,
                                   group_size=group_size)


def attend_weighed(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask, bias: mx.array):
    """softmax(scale q k^T + bias) v over rows held as the model's dtype, [B, Hq, 1, D], on an
    NVIDIA GPU by camkv's pass; bias [B, H, N]: the log of each row's votes per KV head.
    None where it does not apply (another mask, a prompt block, shapes the pass does not
    take, another device): the caller attends as mlx-lm does."""
    if not (quantized_cuda.here() and (mask is None or isinstance(mask, str)) and keys.shape[2] > 0
            and quantized_cuda.takes_rows(queries, keys, values)):
        return None
    # expand_dims: a third of the host time of the same view by indexing, every layer and step.
    return quantized_cuda.attend_rows(queries, keys, values, scale, mx.expand_dims(bias, 2).astype(mx.float32))
