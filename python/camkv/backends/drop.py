"""The drop engine: chunk scoring and eviction in plain MLX operations, spread over the
whole device (camkv.backends.compress picks it for merge="drop" on a GPU).

A compression (docs/algorithm.md section 7) scores S chunk tokens causally over the n rows
before them and themselves, then evicts the n + S - budget lowest-scoring candidates.
Here both are a handful of batched operations: the logits as matrix products of the
storage dtype's values cast to float32 (exact for float16 and bfloat16 inputs, and on a
TF32 tensor core too, whose 10-bit mantissa holds theirs), a float32 softmax, a
partition for the losers and a gather for the survivors. merge="drop" needs nothing
else; the merge rules add their merges to the same steps (camkv.backends.merge_ops).

Sums run in the device's own order, so results match the reference within section 8's
tie-aware tolerances, not bit for bit.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import mlx.core as mx

from .. import mass, policy
from ..rows import RowState
from . import compact_cuda, constants, mass_cuda

_INF = float("inf")


def reducer(kernels: bool | None = None) -> mass.Reducer:
    """How a chunk's logits become mass here: one kernel (backends.mass_cuda, the logits a
    product in the keys' dtype with float32 accumulation; section 8 allows it) on an
    NVIDIA GPU, else MLX operations over float32 logits."""
    return mass_cuda.REDUCER if (on_cuda() if kernels is None else kernels) else mass.MLX_OPS


def attention_mass(queries: mx.array, keys: mx.array, scale: float, n_before: int, kernels: bool | None = None
                   ) -> mx.array:
    """Section 2's mass of a chunk, summed per row: [R, N] float32 (camkv.mass.chunk_mass
    with every query). queries [R, G, S, Dk] (any float dtype) are the chunk's queries,
    chunk token i at row index n_before + i; keys [R, N, Dk] with N = n_before + S."""
    return mass.chunk_mass(queries, keys, scale, n_before, None, queries.shape[2], reducer(kernels))


def chunk_mass(queries: mx.array, keys: mx.array, scale: float, n_before: int, cfg, s_len: int | None = None
               ) -> mx.array:
    """camkv.mass.chunk_mass under cfg, reduced as reducer() picks. queries [R, G, T, Dk]
    are the chunk's last T (s_len defaults to T: every query given)."""
    s_len = queries.shape[2] if s_len is None else s_len
    return mass.chunk_mass(queries, keys, scale, n_before, cfg, s_len, reducer())


@functools.cache
def cuda_build() -> bool:
    """Whether the running MLX is its CUDA build with a GPU (fixed for the process)."""
    return not mx.metal.is_available() and hasattr(mx, "cuda") and mx.cuda.is_available()


def on_cuda() -> bool:
    """Whether this computation runs on an NVIDIA GPU (MLX's CUDA backend)."""
    return mx.default_device() == mx.gpu and cuda_build()


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
    return losers_and_survivors(scores, positions, p_last, budget, n_sink, recent)[1]


def losers_and_survivors(scores: mx.array, positions: mx.array, p_last, budget: int, n_sink: int, recent: int,
                         losers_sorted: bool = True) -> tuple[mx.array, mx.array]:
    """losers_and_kept's partition: the loser indices [R, N - budget] (in position order
    where losers_sorted, else in any) and the kept ones [R, budget] in position order."""
    total = scores.shape[1]
    protected = policy.protected(positions, p_last, n_sink, recent)
    ranked = mx.where(protected, _INF, mx.where(mx.isnan(scores), -_INF, scores))
    order = mx.argpartition(ranked, kth=total - budget, axis=1)
    losers = order[:, :total - budget]
    return mx.sort(losers, axis=1) if losers_sorted else losers, mx.sort(order[:, total - budget:], axis=1)


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
                  cfg, given: mx.array | None = None) -> RowState:
    """Rows held [R, N, D] whose first n (= settled_scores' [R, n]) are scored: score the
    rest, at positions first_pending.., as one chunk (queries [R, G, T, Dk]: its last T,
    every one or at least those chunk_mass reads) and evict
    down to the budget without merging. given [R, N]: the chunk's mass handed in, used
    instead of the queries'."""
    rows, n = settled_scores.shape
    s_len = keys.shape[1] - n
    positions = mx.concatenate(
        [settled_positions, mx.broadcast_to(first_pending + mx.arange(s_len, dtype=mx.int32), (rows, s_len))], axis=1)
    mass = chunk_mass(queries, keys, scale, n, cfg, s_len) if given is None else given
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
    stored: tuple | None = None

    ARRAYS = ("keys", "values", "settled_scores", "settled_positions", "queries")


def compress_drop_buffers(keys, values, end: int, settled_scores, settled_positions, queries, first_pending,
                          scale: float, cfg, capacity: int, stored: tuple | None = None):
    """compress_drop for rows [0, end) of the buffers keys [B, H, cap, Dk] and values [B, H, cap, Dv]
    on an NVIDIA GPU, evicting in one launch (backends.compact_cuda): (keys, values) buffers
    [B, H, capacity, D] whose first cfg.budget rows are the survivors, their scores and positions.
    first_pending: the first pending position, an int, or an int32 array [B] when the B
    sequences stand at different positions (a batch's rows compressed together). Only for
    end > cfg.budget (there is something to evict) and eviction="score" (the kernel ranks
    by score). stored: quantized rows' (codes, scales, biases) of keys and of values, whose
    dequantized values keys and values are: the launch copies those (six buffers) instead
    and returns them as two triples."""
    rows, n = settled_scores.shape
    held = keys[:, :, :end].reshape(rows, end, -1)
    mass = chunk_mass(queries, held, scale, n, cfg, end - n)
    if isinstance(first_pending, int):
        first_pending = constants.ints(*(first_pending,) * keys.shape[0])  # data, not a launch
    buffers = (keys, values) if stored is None else (*stored[0], *stored[1])
    *copied, scores, positions = compact_cuda.drop_compact(buffers, settled_scores, settled_positions, mass,
                                                           first_pending, cfg, capacity)
    if stored is None:
        return (*copied, scores, positions)
    return tuple(copied[:3]), tuple(copied[3:]), scores, positions
