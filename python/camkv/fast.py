"""Chunk scoring and eviction in plain MLX operations, spread over the whole device.

A compression (docs/algorithm.md section 7) scores S chunk tokens causally over the n rows
before them and themselves, then evicts the n + S - budget lowest-scoring candidates.
Here both are a handful of batched operations: the logits as matrix products of the
storage dtype's values cast to float32 (exact for float16 and bfloat16 inputs, and on a
TF32 tensor core too, whose 10-bit mantissa holds theirs), a float32 softmax, a
partition for the losers and a gather for the survivors. merge="drop" needs nothing
else; the merge rules keep their ordered merges in the kernels.

Sums run in the device's own order, so results match the reference within section 8's
tie-aware tolerances, not bit for bit.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import mlx.core as mx

from . import policy
from .backends import compact_cuda, mass_cuda
from .rows import RowState

_INF = float("inf")
# Most float32 logits (and the softmax temporaries beside them) one block of chunk
# queries holds: a 2048-token chunk with 4 queries per KV head over 2.5k rows would
# hold about a gigabyte at once, where a bounded cache must not spike memory.
LOGIT_BYTES = 32 << 20


def attention_mass(queries: mx.array, keys: mx.array, scale: float, n_before: int, kernels: bool | None = None
                   ) -> mx.array:
    """Section 2's mass of a chunk, summed per row: [R, N] float32.

    queries [R, G, S, Dk] (any float dtype) are the chunk's queries, chunk token i at
    row index n_before + i; keys [R, N, Dk] with N = n_before + S. Token i sees every
    row up to and including itself. A logit that is NaN or infinite counts as masked
    and a query whose every logit is masked adds nothing, so a poisoned key gets no
    mass (it is evicted first) and a poisoned query leaves the other rows' scores alone.

    With kernels (default: on an NVIDIA GPU) the logits are a product in the keys' dtype
    (float32 accumulation; section 8 allows it) reduced by one kernel
    (backends.mass_cuda); otherwise a float32 product reduced by MLX operations. In
    blocks of queries of at most LOGIT_BYTES of logits.
    """
    rows, groups, s_len, k_dim = queries.shape
    total = keys.shape[1]
    kernels = on_cuda() if kernels is None else kernels
    dtype = keys.dtype if kernels else mx.float32
    keys_t = keys.astype(dtype).transpose(0, 2, 1)
    block = max(1, LOGIT_BYTES // (rows * groups * total * (dtype.size if kernels else 12)))
    mass = None
    for i0 in range(0, s_len, block):
        i1 = min(s_len, i0 + block)
        visible = total - s_len + i1  # token i1 - 1 sees no further
        q = queries[:, :, i0:i1].astype(dtype).reshape(rows, groups * (i1 - i0), k_dim)
        logits = q @ keys_t[:, :, :visible]
        if kernels:
            part = mass_cuda.column_mass(logits, scale, n_before + i0, i1 - i0, total, 1.0 / groups)
        else:
            part = _column_mass(logits.reshape(rows, groups, i1 - i0, visible), scale, n_before + i0) / groups
            if visible < total:
                part = mx.pad(part, [(0, 0), (0, total - visible)])
        mass = part if mass is None else mass + part
    return mass


def chunk_mass(queries: mx.array, keys: mx.array, scale: float, n_before: int, cfg, s_len: int | None = None
               ) -> mx.array:
    """attention_mass of a chunk of s_len tokens under cfg.prefill_scoring: with "window"
    only the chunk's last observation_window queries add mass, which is then max-pooled
    (camkv.policy). queries [R, G, T, Dk] are the chunk's last T (T >= the queries that
    add mass; s_len defaults to T: every query given)."""
    s_len = queries.shape[2] if s_len is None else s_len
    observed = policy.observed(cfg, s_len)
    queries = queries[:, :, queries.shape[2] - observed :]
    return policy.pooled(attention_mass(queries, keys, scale, n_before + s_len - observed), cfg, s_len)


def _column_mass(logits: mx.array, scale: float, n_before: int) -> mx.array:
    """Softmax of each query row of logits [R, G, S, N] (chunk token i sees rows up to
    n_before + i), summed over G and S: [R, N] float32."""
    s_len, visible = logits.shape[2:]
    causal = mx.arange(visible)[None, :] <= (n_before + mx.arange(s_len))[:, None]
    logits = logits * scale
    logits = mx.where(causal & mx.isfinite(logits), logits, -_INF)
    weights = mx.softmax(logits, axis=-1, precise=True)
    return mx.where(mx.isnan(weights), 0.0, weights).sum(axis=(1, 2))


def on_cuda() -> bool:
    """Whether this computation runs on an NVIDIA GPU (MLX's CUDA backend)."""
    return (mx.default_device() == mx.gpu and not mx.metal.is_available()
            and hasattr(mx, "cuda") and mx.cuda.is_available())


def key_queries(keys: mx.array) -> tuple[mx.array, float]:
    """Key scoring: each chunk key [R, S, Dk] is its token's one query, scale 1/sqrt(Dk)."""
    return keys[:, None], 1.0 / math.sqrt(keys.shape[-1])


def losers_and_kept(scores: mx.array, positions: mx.array, p_last, budget: int, n_sink: int, recent: int
                    ) -> mx.array:
    """The kept row indices [R, budget] in position order (section 7's survivors).

    Protected rows (sinks and the recent window before p_last, an int or a scalar array)
    rank as +inf; a NaN score ranks lowest. Rows tied at the boundary may go either way
    (section 8).
    """
    total = scores.shape[1]
    protected = (positions < n_sink) | (positions > p_last - recent)
    ranked = mx.where(protected, _INF, mx.where(mx.isnan(scores), -_INF, scores))
    kept = mx.argpartition(ranked, kth=total - budget, axis=1)[:, total - budget:]
    return mx.sort(kept, axis=1)


def update_drop(state: RowState, new_keys, new_values, offset: int, cfg, row_ids,
                queries=None, scale=None) -> tuple[RowState, mx.array]:
    """A chunk call with merge="drop" (same signature and results, within section 8, as
    camkv.reference.update). queries [R, S, G, Dk] or None (key scoring)."""
    if queries is None:
        q, scale = key_queries(new_keys)
    else:
        q = queries.transpose(0, 2, 1, 3)
    keys = mx.concatenate([state.keys, new_keys], axis=1)
    values = mx.concatenate([state.values, new_values], axis=1)
    kept = compress_drop(keys, values, state.scores, state.positions, q, offset, scale, cfg)
    return kept, mx.zeros((new_keys.shape[0],), mx.int32)


def compress_drop(keys, values, settled_scores, settled_positions, queries, first_pending: int, scale: float,
                  cfg) -> RowState:
    """Rows held [R, N, D] whose first n (= settled_scores' [R, n]) are scored: score the
    rest, at positions first_pending.., as one chunk (queries [R, G, T, Dk]: its last T,
    every one or at least those chunk_mass reads) and evict
    down to the budget without merging."""
    rows, n = settled_scores.shape
    s_len = keys.shape[1] - n
    positions = mx.concatenate(
        [settled_positions, mx.broadcast_to(first_pending + mx.arange(s_len, dtype=mx.int32), (rows, s_len))], axis=1)
    mass = chunk_mass(queries, keys, scale, n, cfg, s_len)
    scores = mx.concatenate([settled_scores + mass[:, :n], mass[:, n:]], axis=1)
    joined = RowState(keys, values, scores, positions)
    if n + s_len <= cfg.budget:
        return joined
    p_last = first_pending + s_len - 1
    ranks = policy.eviction_ranks(scores, cfg)
    return joined.take(losers_and_kept(ranks, positions, p_last, cfg.budget, cfg.n_sink, cfg.recent))


class DropLaunch(NamedTuple):
    """compress_drop_buffers' arguments, in its order: a compression a cache may hand to
    camkv.batch, which runs the ones alike (ARRAYS of one shape and dtype, the rest equal)
    in one launch with each sequence's first_pending."""

    keys: mx.array
    values: mx.array
    end: int
    settled_scores: mx.array
    settled_positions: mx.array
    queries: mx.array
    first_pending: int
    scale: float
    cfg: object
    capacity: int

    ARRAYS = ("keys", "values", "settled_scores", "settled_positions", "queries")


def compress_drop_buffers(keys, values, end: int, settled_scores, settled_positions, queries, first_pending,
                          scale: float, cfg, capacity: int):
    """compress_drop for rows [0, end) of the buffers keys [B, H, cap, Dk] and values [B, H, cap, Dv]
    on an NVIDIA GPU, evicting in one launch (backends.compact_cuda): (keys, values) buffers
    [B, H, capacity, D] whose first cfg.budget rows are the survivors, their scores and positions.
    first_pending: the first pending position, an int, or an int32 array [B] when the B
    sequences stand at different positions (a batch's rows compressed together). Only for
    end > cfg.budget (there is something to evict) and eviction="score" (the kernel ranks
    by score)."""
    rows, n = settled_scores.shape
    held = keys[:, :, :end].reshape(rows, end, -1)
    mass = chunk_mass(queries, held, scale, n, cfg, end - n)
    if isinstance(first_pending, int):
        first_pending = mx.full((keys.shape[0],), first_pending, mx.int32)
    return compact_cuda.drop_compact(keys, values, settled_scores, settled_positions, mass, first_pending, cfg,
                                     capacity)
