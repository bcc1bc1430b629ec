"""The merge gate (docs/algorithm.md sections 4.3 and 6): a deterministic draw per
(seed, row, loser position) and the probability it is compared with. One definition
for the reference and the MLX merge engine (the kernel core states it in C++)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

_GOLDEN = 0x9E3779B9
_MIX_MUL_1 = 0x7FEB352D
_MIX_MUL_2 = 0x846CA68B


def _mix(x: mx.array) -> mx.array:
    x = x ^ (x >> 16)
    x = x * mx.array(_MIX_MUL_1, mx.uint32)
    x = x ^ (x >> 15)
    x = x * mx.array(_MIX_MUL_2, mx.uint32)
    return x ^ (x >> 16)


def gate_hash(seed, row, position) -> mx.array:
    """h = mix(mix(mix(p ^ 0x9e3779b9) ^ r) ^ seed) on uint32 with wrap-around."""
    p = mx.array(position).astype(mx.uint32)
    r = mx.array(row).astype(mx.uint32)
    s = mx.array(seed).astype(mx.uint32)
    return _mix(_mix(_mix(p ^ mx.array(_GOLDEN, mx.uint32)) ^ r) ^ s)


def row_ids(B: int, H: int, head_offset: int = 0, n_heads_global: int | None = None) -> mx.array:
    """The gate's row id of each (batch, KV head) row of a cache, uint32 [B * H]:
    b * heads + head_offset + h, heads the model's KV heads (n_heads_global; H where
    unsharded), so a cache holding some of the heads draws what an unsharded one draws
    (section 1)."""
    heads = n_heads_global or H
    # Built on the host: an array born with its data needs no evaluation, where MLX
    # operations would need one (a wait for the device, once per cache in a prompt).
    ids = np.arange(B, dtype=np.uint32)[:, None] * heads + (np.arange(H, dtype=np.uint32) + head_offset)[None, :]
    return mx.array(ids.reshape(-1).astype(np.uint32))


def uniform(seed, row, position) -> mx.array:
    """The gate's draw in [0, 1): (h >> 8) * 2^-24 as float32."""
    return (gate_hash(seed, row, position) >> 8).astype(mx.float32) * (2.0**-24)


def probability(s_in: mx.array, s_target: mx.array) -> mx.array:
    """P = clamp(s_e / s_T, 0, 1) where s_T > 0, else 1 if s_e > 0 else 0."""
    ratio = mx.clip(s_in / mx.where(s_target > 0, s_target, 1.0), 0.0, 1.0)
    return mx.where(s_target > 0, ratio, mx.where(s_in > 0, 1.0, 0.0))
