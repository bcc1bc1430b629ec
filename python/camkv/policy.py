"""What eviction ranks by (CaMConfig.eviction), which queries of a chunk score it
(CaMConfig.prefill_scoring, observation_window, pool) and how much of the held rows' mass
a compression starts from (CaMConfig.score_decay): docs/algorithm.md sections 3 and 7.

One definition for the reference, camkv.backends.drop and the kernels' host code; the kernel
core computes the same in C++ (camkv_rank_row, camkv_score_chunk). Which rows are
protected from eviction (protected) is here too.
"""

from __future__ import annotations

import mlx.core as mx


def eviction_ranks(scores: mx.array, cfg) -> mx.array:
    """What a row's candidates are ranked by, lowest evicted first, [R, N] float32.

    "score": the accumulated attention (a NaN score ranks lowest: a poisoned token goes
    first). "recency": the row index, which orders rows by position (rows are stored in
    ascending position), so the oldest candidate goes first and scores play no part.
    """
    if cfg.eviction == "recency":
        return mx.broadcast_to(mx.arange(scores.shape[1], dtype=mx.float32), scores.shape)
    return mx.where(mx.isnan(scores), -float("inf"), scores)


def decayed(scores: mx.array, cfg) -> mx.array:
    """The held rows' scores [R, n] as a compression starts from them (section 7):
    multiplied by cfg.score_decay before its mass is added, so older compressions'
    mass fades. At the default 1.0 the very array (bit-identical: no operation)."""
    if cfg.score_decay == 1.0:
        return scores
    return scores * cfg.score_decay


def protected(positions: mx.array, p_last, n_sink: int, recent: int) -> mx.array:
    """Which rows no compression evicts [R, N] bool (section 3): the sinks (the first n_sink
    positions) and the recent window, the `recent` newest positions up to p_last (the
    compression's last token: an int or a scalar array). The kernels compute the same in
    their own languages (backends/compact_cuda.py, csrc/camkv_core.h)."""
    return (positions < n_sink) | (positions > p_last - recent)


def windowed(cfg) -> bool:
    """Whether the cache scores prompt blocks by their last observation_window queries:
    prefill_scoring "window", and "reconstruct" wherever no re-read's mass is handed in
    (camkv.reconstruct; docs/algorithm.md section 7)."""
    return cfg.prefill_scoring in ("window", "reconstruct")


def observed(cfg, s_len: int) -> int:
    """How many of a chunk's last queries add mass: the observation window with
    prefill_scoring="window" (all of a chunk shorter than it), every query otherwise.
    A single token's call is never windowed."""
    if windowed(cfg) and s_len > 1:
        return min(s_len, cfg.observation_window)
    return s_len


def pooled(mass: mx.array, cfg, s_len: int) -> mx.array:
    """A chunk's mass [R, N] max-pooled along the rows: each entry becomes the largest
    within pool // 2 rows either side (rows past either end do not count). Only with
    prefill_scoring="window" and a chunk of more than one token; else mass unchanged."""
    half = cfg.pool // 2
    if half == 0 or cfg.prefill_scoring != "window" or s_len <= 1:
        return mass
    padded = mx.pad(mass, [(0, 0), (half, half)], constant_values=-float("inf"))
    width = mass.shape[1]
    out = mass
    for shift in range(2 * half + 1):
        out = mx.maximum(out, padded[:, shift : shift + width])
    return out
