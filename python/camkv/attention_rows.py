"""The rows a CaMKVCache hands attention: as stored, dequantized, or after its tier's.

mlx-lm's attention takes a cache that has `bits` for a quantized one
(`quantized_scaled_dot_product_attention`, reading `bits` and `group_size`), so a
cache has them only where attention reads its rows quantized: rows stored quantized
(CaMConfig.bits), no tier attended beside them, and MLX's quantized attention kernels
on the device (camkv.quantized.kernels_here: the CPU and Metal, not its CUDA build).
On MLX's CUDA build the rows go to attention as stored once camkv's attention hook has
fed the cache (it sees every step, and attends them itself: camkv.quantized_attention),
without bits, so that mlx-lm's attention never reads them. Everywhere else attention
gets arrays in the model's dtype: quantized rows dequantized once a step (bounded rows),
the tier's rows dequantized before the main ones, one attention over both pools
(docs/algorithm.md sections 12 and 13).
"""

from __future__ import annotations

import mlx.core as mx

from . import quantized
from .backends import quantized_cuda

# What mlx-lm's attention reads of a cache whose rows it reads quantized.
QUANTIZED_FIELDS = ("bits", "group_size")


def quantized_fields(cfg) -> dict:
    """{"bits": ..., "group_size": ...} of a cache of config cfg whose rows attention
    reads quantized; {} where it reads them as arrays."""
    if cfg.bits is None or cfg.tier_budget or not quantized.kernels_here():
        return {}
    return {"bits": cfg.bits, "group_size": cfg.group_size}


def hook_reads_stored(cfg) -> bool:
    """Whether camkv's hook attends a cache's rows as stored where mlx-lm could not (once
    the hook is seen to feed the cache): rows quantized, no tier, MLX's CUDA build."""
    return cfg.bits is not None and not cfg.tier_budget and quantized_cuda.here()


def for_attention(fetched: tuple, rows, tier, layout: tuple, read_quantized: bool) -> tuple:
    """The held rows fetched (keys and values as stored: arrays, or the triples of
    quantized rows) as attention reads them: as stored where read_quantized (the cache
    has quantized_fields, or hook_reads_stored), else as arrays, a tier's rows (camkv.tier.Tier, or None)
    first. rows: the cache's RowBuffers; layout: its (B, H, Dk, Dv, dtype)."""
    dequantize = isinstance(fetched[0], tuple) and not read_quantized
    main = tuple(rows.dequantize(q) for q in fetched) if dequantize else fetched
    coarse = None if tier is None else tier.attended(layout[0], layout[1], layout[4])
    if coarse is None:
        return main
    return tuple(mx.concatenate([c, m], axis=2) for c, m in zip(coarse, main))
