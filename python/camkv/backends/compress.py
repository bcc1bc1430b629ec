"""One compression: a cache's pending chunk scored and evicted back to the budget
(docs/algorithm.md section 7), by the engine that suits its backend and rule.

The cache hands over its rows (camkv.buffers.RowBuffers, rows [0, end) taking part) and
the chunk's queries [R, G, T, Dk] (one layout: the model's), and never asks which
backend it has. The settled rows' scores are decayed here (CaMConfig.score_decay,
camkv.policy.decayed), before any engine reads them. The engines:

- on an NVIDIA GPU, merge="drop" with score eviction: one launch chooses, compacts and
  copies the survivors (camkv.backends.drop.compress_drop_buffers over backends.compact_cuda;
  quantized rows' as stored, RowBuffers.stored_for_launch);
  a batch may collect such launches of its rows and run the ones alike together;
- on a GPU, a chunk of several tokens (a merging rule's: a prompt chunk, longer than
  the slack + 1 tokens of a decode compression): batched MLX operations use the whole device,
  where the kernel core runs one work group per row: for merge="drop" a product, a
  partition and a gather (camkv.backends.drop.compress_drop), for a merge rule those
  and its merges as one product of losers by survivors and segment sums
  (camkv.backends.merge_ops.compress); on the CPU the extension's one pass per row is
  faster;
- otherwise the backend's update (the kernel core, or the reference): the settled rows
  and the pending ones handed over as a RowState and new blocks.

Either way a rule's state (keepkv's votes, d2o's threshold) is read from the rows and
written back with them.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx

from .. import merges, policy
from ..buffers import RowBuffers
from ..pending import every_query
from . import drop, merge_ops


class Chunk(NamedTuple):
    """What one compression scores: rows [settled, end) of the buffers, by queries
    [R, G, T, Dk] under scale (key queries with key scoring, then key_scored), under cfg
    (the pending tokens' config). row_ids [R] uint32: the rows' global indices. mass
    [R, end] float32 or None: the chunk's mass handed in (camkv.reconstruct's re-read),
    which then scores it instead of the queries (they still give keepkv its query).
    merges: the cache's merges so far (an int32 scalar; None: 0), which the
    compression's add to."""

    end: int
    queries: mx.array
    scale: float
    key_scored: bool
    cfg: object
    row_ids: mx.array
    mass: mx.array | None = None
    merges: mx.array | None = None


def one_launch(backend, cfg, end: int) -> bool:
    """Whether this compression evicts with merge="drop" on an NVIDIA GPU, where one
    kernel launch (backends.compact_cuda) chooses, compacts and copies the survivors."""
    return (end > cfg.budget and cfg.prefill == "chunk" and merges.rule(cfg.merge).kind == merges.DROP
            and cfg.eviction == "score" and getattr(backend, "target", None) == "cuda" and drop.on_cuda())


def compress(backend, rows: RowBuffers, chunk: Chunk, may_defer: bool = False):
    """Compress rows [settled, chunk.end) of rows in place (its held rows after end stay
    as they are for the caller to append again). Returns the merges so far (chunk.merges
    plus this compression's, an int32 scalar: where the merge kernels run, their own
    output, so reading it costs no launch), None where the engine is the one-launch drop
    (no merges), or a drop.DropLaunch not run yet when may_defer and it is (the caller
    runs it, maybe with others alike, and hands the outputs to rows.adopt)."""
    next_position = rows.pending_start + chunk.end - rows.settled
    # Here, before the engines part ways, so every engine starts from the same decayed scores.
    rows.scores = policy.decayed(rows.scores, chunk.cfg)
    if chunk.mass is None and one_launch(backend, chunk.cfg, chunk.end):
        launch = drop.DropLaunch(rows.keys, rows.values, chunk.end, rows.scores, rows.positions, chunk.queries,
                                 rows.pending_start, chunk.scale, chunk.cfg, rows.capacity, rows.stored_for_launch())
        if may_defer:
            return launch
        rows.adopt(*drop.compress_drop_buffers(*launch), next_position)
        return None
    B, H = rows.keys.shape[:2]
    so_far = mx.array(0, mx.int32) if chunk.merges is None else chunk.merges
    state, merged = _by_operations(backend, rows, chunk, so_far) or _by_update(backend, rows, chunk, so_far)
    rows.settle(state, next_position, B, H)
    return merged


# The fewest pending tokens a GPU compression runs as batched MLX operations (the drop or
# merge engine: a chunk's); fewer run in the backend's update, the kernel core's one
# launch. bench/merge_speed.py's RULE/core arms raise it past the slack, to time a merge
# rule's decode compressions in the kernel core beside the engine.
OPERATIONS_FROM_TOKENS = 2


def gpu_chunk(backend, cfg, end: int, settled: int) -> bool:
    """Whether rows [settled, end) are a chunk the GPU engines could take: chunk prefill
    (exact prefill scores token by token, docs/algorithm.md section 2), a GPU backend, and
    OPERATIONS_FROM_TOKENS pending tokens or more."""
    return (cfg.prefill == "chunk" and bool(getattr(backend, "target", None))
            and end - settled >= OPERATIONS_FROM_TOKENS)


def by_operations(backend, cfg, end: int, settled: int) -> bool:
    """Whether a compression of rows [settled, end) runs as batched MLX operations: a
    gpu_chunk, but a merging rule's decode compression (at most slack + 1 tokens) in the
    kernel core's one launch unless its registry entry says decodes_on_engine
    (bench/merge_speed.py: mean's decode step 1.17x drop's on the engine, 0.91x in the
    core, on an H100). Elsewhere the backend's update."""
    if not gpu_chunk(backend, cfg, end, settled):
        return False
    rule = merges.rule(cfg.merge)
    return end - settled > cfg.slack + 1 or rule.kind == merges.DROP or rule.decodes_on_engine


def _by_operations(backend, rows: RowBuffers, chunk: Chunk, so_far: mx.array):
    """The compression as batched MLX operations where by_operations says so, and wherever
    its mass is handed in (the kernel core scores a chunk itself): its rows and the merges
    so far; None elsewhere."""
    cfg, end = chunk.cfg, chunk.end
    if chunk.mass is None and not by_operations(backend, cfg, end, rows.settled):
        return None
    R = rows.scores.shape[0]
    keys, values = rows.keys[:, :, :end].reshape(R, end, -1), rows.values[:, :, :end].reshape(R, end, -1)
    if merges.rule(cfg.merge).kind == merges.DROP:
        kept = drop.compress_drop(keys, values, rows.scores, rows.positions, chunk.queries, rows.pending_start,
                                  chunk.scale, cfg, given=chunk.mass)
        return kept, so_far
    settled = merge_ops.Settled(rows.scores, rows.positions, rows.votes, rows.threshold)
    # The backend's own reduction of a chunk's logits where it has one (the extension's column sums).
    state, _, merged = merge_ops.compress(keys, values, settled, chunk.queries, rows.pending_start, chunk.scale, cfg,
                                          chunk.row_ids, getattr(backend, "REDUCER", None), given=chunk.mass,
                                          capacity=rows.capacity, merges_so_far=so_far)
    return state, merged


def _by_update(backend, rows: RowBuffers, chunk: Chunk, so_far: mx.array):
    """The backend's update over the settled rows and the pending ones as new tokens
    (queries in the kernels' layout [R, S, G, Dk], every pending token's): its rows and
    the merges so far."""
    n, end = rows.settled, chunk.end
    held = rows.rows(end)
    new = [a[:, n:end] for a in held[:2]]
    q = None if chunk.key_scored else every_query(chunk.queries, end - n).transpose(0, 2, 1, 3)
    state, per_row = backend.update(held.first(n), *new, rows.pending_start, chunk.cfg, chunk.row_ids, q,
                                    None if chunk.key_scored else chunk.scale)
    dropping = merges.rule(chunk.cfg.merge).kind == merges.DROP  # its count is 0: no operations for it
    return state, so_far if dropping else so_far + per_row.sum()
