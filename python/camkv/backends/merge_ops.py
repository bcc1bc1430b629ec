"""The merge engine: a compression with a merge rule in MLX operations over the whole
device (camkv.backends.compress picks it for a chunk of several tokens on a GPU).

A compression (docs/algorithm.md sections 4 and 7) scores its chunk, evicts down to the
budget and merges every loser at once. Here each step is a batched operation over all
rows: the chunk's mass and the partition into losers and survivors as in the drop engine
(camkv.backends.drop), the nearest survivor of every loser as one product (losers x
survivors) and an argmax, the gate's draws keyed by the losers' positions (camkv.gate),
and the merges as segment sums: every loser's weighted row scattered into its target
(`x.at[idx].add`), so a target takes all of its losers in one pass, whatever their
number. The shares are the registry's (camkv.merges).

Sums run in the device's own order, and a tie at the eviction boundary or between two
best cosines may go either way, so results match the reference within section 8's
tie-aware tolerances, not bit for bit.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from .. import gate, mass, merges, policy
from ..config import CaMConfig
from ..rows import RowState
from . import compact_cuda, constants, drop, merge_cuda, selfcheck

_INF = float("inf")


def reducer(bias: bool, preferred: mass.Reducer | None = None) -> mass.Reducer:
    """How a chunk's logits become mass here: the backend's preferred reduction (the
    extension's column sums on the CPU), or the drop engine's (on an NVIDIA GPU one kernel
    over logits in the keys' dtype, votes' logs included: section 8's widened score
    tolerance). With votes (bias: their logs join every logit) elsewhere, the float32
    products of the reference's arithmetic."""
    if bias and not drop.on_cuda():
        return mass.EXACT
    return drop.reducer() if preferred is None else preferred


class Rows(NamedTuple):
    """Some rows of every row r, gathered [R, m, ...]: float32 keys and values for the
    arithmetic, the keys as stored too (a survivor's key no merge changes goes back as
    it was, without a cast back), positions, votes where the rule keeps them, and the
    keys' and values' norms [R, m] where asked for."""

    keys: mx.array
    values: mx.array
    scores: mx.array
    positions: mx.array | None
    votes: mx.array | None
    stored_keys: mx.array
    key_norm: mx.array | None = None
    value_norm: mx.array | None = None

    @classmethod
    def of(cls, keys, values, scores, positions, votes, idx) -> "Rows":
        def take(a):
            return None if a is None else mx.take_along_axis(a, idx[:, :, None] if a.ndim == 3 else idx, axis=1)

        stored_keys = take(keys)
        return cls(stored_keys.astype(mx.float32), take(values).astype(mx.float32), take(scores), take(positions),
                   take(votes), stored_keys)

    @classmethod
    def split(cls, keys, values, scores, positions, votes, loser_idx, kept_idx, key_norm: bool = False,
              kernels: bool = False) -> tuple["Rows", "Rows"]:
        """The losers' rows and the survivors': one gather and one cast of each array for
        both (on a GPU each is a launch), and with key_norm one norm of their keys and one
        of their values, then views of its two parts. kernels: all of it in one launch
        (merge_cuda.gather_rows), each part's arrays contiguous (no views: MLX copies a
        strided input of a kernel first, about sixteen copies a compression)."""
        if kernels:
            return tuple(cls(f_keys, f_values, taken_scores, taken_positions, taken_votes, stored,
                             *((k_norm, v_norm) if key_norm else (None, None)))
                         for f_keys, f_values, stored, taken_scores, taken_positions, k_norm, v_norm, taken_votes
                         in merge_cuda.gather_rows(keys, values, scores, positions, votes, loser_idx, kept_idx))
        both = cls.of(keys, values, scores, positions, votes, mx.concatenate([loser_idx, kept_idx], axis=1))
        if key_norm:
            both = both._replace(key_norm=merges.feature_norm(both.keys), value_norm=merges.feature_norm(both.values))
        k = loser_idx.shape[1]
        part = lambda first, last: cls(*(None if a is None else a[:, first:last] for a in both))  # noqa: E731
        return part(0, k), part(k, None)


class Settled(NamedTuple):
    """What a compression reads of the n scored rows besides their keys and values:
    scores and positions [R, n], and the rule's votes [R, n] and threshold [R] (None
    where it keeps none, or before a row's first compression)."""

    scores: mx.array
    positions: mx.array
    votes: mx.array | None = None
    threshold: mx.array | None = None


def compress(keys, values, settled: Settled, queries, first_pending: int, scale: float, cfg, row_ids,
             preferred: mass.Reducer | None = None, kernels: bool | None = None,
             given: mx.array | None = None, capacity: int | None = None,
             merges_so_far: mx.array | None = None) -> tuple[RowState, mx.array, mx.array]:
    """Rows held [R, N, D] whose first n are scored (settled): score the rest, at
    positions first_pending.., as one chunk (queries [R, G, T, Dk], its last T), evict
    down to the budget and merge every loser (section 4). Returns the survivors, the
    merges per row [R] and the merges so far: merges_so_far (a cache's running count, an
    int32 scalar; None: 0) plus this compression's, which the kernels count in their own
    launches. preferred: the backend's reduction of a chunk's logits (see reducer);
    kernels: whether the nearest search and the sums run as camkv.backends.merge_cuda's
    kernels (default: on an NVIDIA GPU); given [R, N]: the chunk's mass handed in, used
    instead of the queries' (which still give keepkv its query). capacity: rows of the
    buffers a decode writes into after the survivors (camkv.buffers.capacity_for); where
    the kernels write the survivors (a nearest rule's blend, keepkv's merge, the window
    rule's sums), the keys and values come back as such buffers [R, capacity, D], the
    survivors their first rows (more rows than the scores: camkv.buffers.RowBuffers.settle
    adopts them as they are, where the other ways' [R, m, D] are copied into new buffers)."""
    rule = merges.rule(cfg.merge)
    rows, n = settled.scores.shape
    s_len = keys.shape[1] - n
    so_far = mx.array(0, mx.int32) if merges_so_far is None else merges_so_far
    merging = n + s_len > cfg.budget and rule.kind != merges.DROP
    if merging:
        kernels = (merge_cuda.available() and kernels_pass_probe()) if kernels is None else kernels
    votes, bias, query = settled.votes, None, None
    if rule.keeps_votes:  # with kernels, one launch (merge_cuda.keep_inputs)
        votes, bias, query = (merge_cuda.keep_inputs if merging and kernels else keep_inputs)(votes, n, s_len, queries)
    threshold = settled.threshold
    if rule.moving_threshold and threshold is None:
        threshold = mx.full((rows,), float("nan"), mx.float32)
    chunk = given if given is not None else mass.chunk_mass(queries, keys, scale, n, cfg, s_len,
                                                            reducer(bias is not None, preferred), bias=bias)
    if merging and kernels and cfg.eviction == "score":  # the partition and the joined rows in one launch
        loser_idx, kept_idx, scores, positions = compact_cuda.partition(
            settled.scores, settled.positions, chunk, constants.ints(first_pending), cfg)
    else:
        positions = mx.concatenate([settled.positions, mx.broadcast_to(
            first_pending + mx.arange(s_len, dtype=mx.int32), (rows, s_len))], axis=1)
        scores = mx.concatenate([settled.scores + chunk[:, :n], chunk[:, n:]], axis=1)
        if n + s_len <= cfg.budget:
            return RowState(keys, values, scores, positions, votes, threshold), mx.zeros((rows,), mx.int32), so_far
        # Losers in any order: a compression's merges are simultaneous (section 4).
        loser_idx, kept_idx = drop.losers_and_survivors(policy.eviction_ranks(scores, cfg), positions,
                                                        first_pending + s_len - 1, cfg.budget, cfg.n_sink, cfg.recent,
                                                        losers_sorted=False)
        if rule.kind == merges.DROP:  # nothing merges (the drop engine's result)
            return (RowState(keys, values, scores, positions, votes, threshold).take(kept_idx),
                    mx.zeros((rows,), mx.int32), so_far)
    losers, kept = Rows.split(keys, values, scores, positions, votes, loser_idx, kept_idx,
                              key_norm=rule.kind == merges.NEAREST, kernels=kernels)
    # Keys stored in half precision are exact in a TF32 product; float32 ones need the split.
    split = drop.on_cuda() and keys.dtype == mx.float32
    merged = merge(losers, loser_idx, kept, kept_idx, threshold, query, scale, cfg, row_ids, split, kernels,
                   values.dtype, capacity, so_far)
    # Survivors no merge changed round back to themselves (they were cast from the storage dtype).
    out_keys = kept.stored_keys if merged.keys is kept.keys else merged.keys.astype(keys.dtype)
    return RowState(out_keys, merged.values.astype(values.dtype), merged.scores, kept.positions, merged.votes,
                    merged.threshold), merged.count, merged.so_far


def keep_inputs(settled, n: int, new: int, queries) -> tuple[mx.array, mx.array, mx.array]:
    """keepkv's inputs of a compression (section 4.6): the votes of the n settled rows
    [R, n] (None before a row's first compression: 1 each) joined with 1 for each of `new`
    rows, their log (the bias its chunk mass adds to each logit), [R, n + new] each, and its
    query, the mean of the last of queries [R, G, T, Dk] over G, [R, Dk] float32."""
    rows = queries.shape[0]
    votes = mx.concatenate([mx.ones((rows, n), mx.float32) if settled is None else settled,
                            mx.ones((rows, new), mx.float32)], axis=1)
    return votes, mx.log(votes), queries[:, :, -1].astype(mx.float32).mean(axis=1)


# On CUDA, the nearest search by merge_cuda.nearest_direct (dot products in one kernel) instead of
# a matrix product and merge_cuda.nearest: off, and timed as bench/merge_speed.py's RULE/direct arms.
NEAREST_WITHOUT_PRODUCT = False

# On CUDA, the nearest search's matrix product evaluated as work of its own (its inputs before
# it, it after), so that MLX's CUDA build records that cuBLAS product in a graph by itself. Inside
# a compression's graph it cost every merging prompt about 1 ms a compression (8B shape, 16k
# tokens: mean's prefill 1.8-2.0x dropping's, 1.2x fenced; bench/results/README.md, "The
# nearest search's product in a graph of its own"). Timed off as bench/merge_speed.py's
# RULE/unfenced arms.
FENCE_NEAREST_PRODUCT = True
# Products of fewer loser-survivor pairs than this are not fenced: a decode compression's
# (at most slack + 1 losers a row; 65 x 512 at a 1B model's budget) cost keepkv's compressing
# decode steps 21.3 ms fenced against 13.4 ms unfenced (H200, bench/results/README.md,
# "keepkv's decode steps on CUDA: where their time goes"), while a prompt chunk's (2048 x 512
# at 1B, 2048 x 2048 at llama-3-8B's shape) keeps the fence that took mean's 16k prompt from
# 1.49x to 1.08x dropping's.
FENCE_FROM_PAIRS = 1 << 19

_probe: dict[str, str | None] = {}  # "failure": None once the kernels passed, else why they did not


def kernels_pass_probe() -> bool:
    """The merge kernels' first use in a process, checked as camkv.backends.selfcheck
    checks the run-time kernels: a small random problem (ties unlikely) through the
    kernels and through the MLX operations. A compile or launch error or a mismatch
    switches them off for the process with one warning; the MLX operations then run
    every compression, as before the kernels. CAMKV_SELF_CHECK=0 skips the check."""
    if "failure" not in _probe:
        _probe["failure"] = _probe_failure() if selfcheck.enabled() else None
        if _probe["failure"]:
            warnings.warn(f"camkv: the merge engine's CUDA kernels are switched off for this process because "
                          f"{_probe['failure']}; its MLX operations compute the same merges, slower. "
                          f"{selfcheck.REPORT[0].upper()}{selfcheck.REPORT[1:]}. CAMKV_SELF_CHECK=0 skips the check.",
                          RuntimeWarning, stacklevel=4)
    return _probe["failure"] is None


def _probe_failure() -> str | None:
    p = _probe_problem()
    try:
        got = _probe_with_kernels(p)
        mx.eval([a for a in got if a is not None])
    except Exception as error:  # a compile or launch error, whatever MLX raises it as
        return f"their first-use check raised: {error}"
    for name, g, w in zip(_PROBED, got, _probe_with_operations(p), strict=True):
        same = g is w if g is None or w is None else np.allclose(_as_numpy(g), _as_numpy(w), rtol=1e-4, atol=1e-4)
        if not same:
            return f"their first-use check's {name} differ from the MLX operations'"
    return None


# What the first-use check compares, in the order _probe_with_kernels gives it.
_PROBED = ("targets", "found", "cosines", "sums", "blends", "blended scores", "blend's merge counts",
           "blend's merges so far",
           *(f"gathered {field}" for field in ("keys", "values", "scores", "positions", "votes", "stored keys",
                                                "key norms", "value norms")),
           "losers", "survivors", "joined scores", "joined positions",
           *(f"keepkv's {way} merged {field}" for way in ("ungated", "gated")
             for field in ("keys", "values", "votes", "scores", "counts", "counts so far")),
           *(f"window's merged {field}" for field in ("values", "scores", "counts", "counts so far")),
           *(f"value_norm's merged {field}" for field in ("values", "scores", "counts", "counts so far")),
           "d2o's merging",
           "d2o's thresholds", *(f"keepkv's {field}" for field in ("joined votes", "log votes", "query")))


def _probe_problem() -> dict:
    """A small random problem for every merge kernel (ties unlikely): 70 losers and 90
    survivors of 64 channels in 2 rows, two target slots each, 160 rows held (60 settled)
    to partition down to 90 (2 sinks, 5 recent)."""
    rng = np.random.default_rng(selfcheck.PROBE_SEED)
    normal = lambda *shape: mx.array(rng.standard_normal(shape).astype(np.float32))  # noqa: E731
    losers, kept = normal(2, 70, 64), normal(2, 90, 64)
    held = mx.concatenate([losers, kept], axis=1).astype(mx.bfloat16)
    p = dict(losers=losers, kept=kept, positions=mx.broadcast_to(mx.arange(90, dtype=mx.int32), (2, 90)),
             targets=mx.array(rng.integers(0, 90, (2, 70, 2)).astype(np.int32)),
             live=mx.array(rng.random((2, 70, 2)) < 0.8), rows=normal(2, 70, 33), own=normal(2, 90, 33),
             scores=normal(2, 90), held=held, held_scores=mx.abs(held[:, :, 0]).astype(mx.float32),
             held_positions=mx.broadcast_to(mx.arange(160, dtype=mx.int32), (2, 160)),
             order=mx.array(np.stack([rng.permutation(160) for _ in range(2)]).astype(np.int32)),
             settled=mx.array(rng.random((2, 60)).astype(np.float32)),
             chunk=mx.array(rng.random((2, 160)).astype(np.float32)),
             cut=CaMConfig(budget=90, n_sink=2, recent=5, merge="mean"))
    p["x"] = losers[:, :, 0]
    p["query"] = normal(2, 64)
    p["cosine"] = mx.array(rng.uniform(-1.0, 1.0, (2, 70)).astype(np.float32))
    p["norms"] = (mx.abs(normal(2, 70)), mx.abs(normal(2, 90)))
    p["threshold"] = mx.array([float("nan"), 0.1], mx.float32)
    p["so_far"] = mx.array(1000, mx.int32)  # a running count the merges add to
    p["votes"], p["queries"] = mx.abs(p["settled"]) * 3.0 + 1.0, normal(2, 3, 5, 64).astype(mx.bfloat16)
    return p


def _probe_keep(p: dict, kernels: bool) -> tuple:
    """keepkv's merges of the probe's losers into its survivors, ungated (with kernels the
    search in the merge's first launch, merge_cuda.keep_search) and gated (the search,
    the gate's draws, then merge_cuda.keep_logits)."""
    def rows(keys, values, scores, n):
        return Rows(keys, values, scores, mx.broadcast_to(mx.arange(n, dtype=mx.int32), scores.shape),
                    mx.abs(scores) + 1.0, keys, merges.feature_norm(keys))
    losers = rows(p["losers"], p["rows"], mx.abs(p["x"]), 70)
    kept = rows(p["kept"], p["own"], mx.abs(p["scores"]), 90)
    out = ()
    for gated in (False, True):
        merged = merge(losers, p["order"][:, :70], kept, p["order"][:, 70:], None, p["query"], 0.125,
                       CaMConfig(budget=90, n_sink=1, recent=1, merge="keepkv", gate=gated),
                       mx.arange(2).astype(mx.uint32), False, kernels, merges_so_far=p["so_far"])
        out += (merged.keys, merged.values, merged.votes, merged.scores, merged.count, merged.so_far)
    return out


def _probe_window(p: dict, kernels: bool) -> tuple:
    """The window rule's merges of the probe's 70 losers into its 90 survivors (the
    survivors' rows ascending, as a partition gives them)."""
    keys = mx.zeros((2, 160, 4), mx.float32)  # the window rule reads no key
    rows = lambda values, scores: Rows(keys[:, :scores.shape[1]], values, scores, None, None,  # noqa: E731
                                       keys[:, :scores.shape[1]])
    merged = merge(rows(p["rows"], mx.abs(p["x"])), p["order"][:, :70], rows(p["own"], mx.abs(p["scores"])),
                   mx.sort(p["order"][:, 70:], axis=1), None, None, 1.0, CaMConfig(budget=90, merge="window"),
                   mx.arange(2).astype(mx.uint32), False, kernels, merges_so_far=p["so_far"])
    return merged.values, merged.scores, merged.count, merged.so_far


def _probe_nearest_rule(p: dict, kernels: bool) -> tuple:
    """value_norm's merges of the probe's losers into its survivors, ungated: with kernels
    its search and blend in two launches (merge_cuda.search_and_blend)."""
    def rows(keys, values, scores):
        return Rows(keys, values, scores, p["positions"][:, :scores.shape[1]], None, keys,
                    merges.feature_norm(keys), merges.feature_norm(values))
    merged = merge(rows(p["losers"], p["rows"], mx.abs(p["x"])), p["order"][:, :70],
                   rows(p["kept"], p["own"], mx.abs(p["scores"])), p["order"][:, 70:], None, None, 1.0,
                   CaMConfig(budget=90, n_sink=1, recent=1, merge="value_norm"), mx.arange(2).astype(mx.uint32), False,
                   kernels, merges_so_far=p["so_far"])
    return merged.values, merged.scores, merged.count, merged.so_far


def _probe_taken(p: dict) -> tuple:
    """Rows.split's inputs for the probe: 70 losers and 90 survivors of the 160 held."""
    held = p["held"]
    return held, held[:, :, :33], p["held_scores"], p["held_positions"], p["held_scores"] + 1.0, \
        p["order"][:, :70], p["order"][:, 70:]


def _probe_with_kernels(p: dict) -> tuple:
    edges = _Edges(p["targets"], p["live"], 90, kernels=True)
    blend = merge_cuda.blend_nearest(p["rows"], None, p["own"], p["own"], p["scores"], p["targets"][:, :, 0],
                                     p["live"][:, :, 0], p["cosine"], mx.abs(p["x"]), p["norms"],
                                     merges.code("value_norm"), p["so_far"])
    gathered = Rows.split(*_probe_taken(p), key_norm=True, kernels=True)[1]
    partition = compact_cuda.partition(p["settled"], p["held_positions"][:, :60], p["chunk"], constants.ints(60),
                                       p["cut"])
    return (*_nearest(p["losers"], p["kept"], p["positions"], 1, True, kernels=True), *edges.sums(p["rows"]),
            blend[0], blend[2], *blend[3:], *_gathered_fields(gathered), *partition, *_probe_keep(p, True),
            *_probe_window(p, True), *_probe_nearest_rule(p, True),
            *merge_cuda.moved_threshold(p["cosine"], p["live"][:, :, 0], p["threshold"]),
            *merge_cuda.keep_inputs(p["votes"], 60, 100, p["queries"]))


def _probe_with_operations(p: dict) -> tuple:
    edges = _Edges(p["targets"], p["live"], 90)
    rule, t, (norm_e, norm_t) = merges.rule("value_norm"), p["targets"][:, :, 0], p["norms"]
    share_in = rule.loser_share(p["cosine"], mx.abs(p["x"]), _at(p["scores"], t), norm_e, _at(norm_t, t))
    blend = _Edges(p["targets"][:, :, :1], p["live"][:, :, :1], 90).blend(
        [(p["own"], p["rows"])], share_in, rule.target_share(p["scores"]), mx.abs(p["x"]))
    gathered = Rows.split(*_probe_taken(p), key_norm=True)[1]
    joined = mx.concatenate([p["settled"] + p["chunk"][:, :60], p["chunk"][:, 60:]], axis=1)
    count = p["live"][:, :, 0].sum(axis=1)
    return (*_nearest(p["losers"], p["kept"], p["positions"], 1, True), *edges.sums(p["rows"]), blend.rows[0],
            p["scores"] + blend.extra[0], count, p["so_far"] + count.sum(), *_gathered_fields(gathered),
            *drop.losers_and_survivors(joined, p["held_positions"], 159, 90, 2, 5), joined, p["held_positions"],
            *_probe_keep(p, False), *_probe_window(p, False), *_probe_nearest_rule(p, False), *_probe_threshold(p),
            *keep_inputs(p["votes"], 60, 100, p["queries"]))


def _probe_threshold(p: dict) -> tuple:
    """d2o's merging losers and moved thresholds of the probe's cosines (one row's first
    compression, one row's later), by the MLX operations."""
    threshold = merges.moved_threshold(p["threshold"], p["cosine"])
    return p["live"][:, :, 0] & (p["cosine"] >= threshold[:, None]), threshold


def _gathered_fields(rows: "Rows") -> tuple:
    return (rows.keys, rows.values, rows.scores, rows.positions, rows.votes, rows.stored_keys, rows.key_norm,
            rows.value_norm)


def _as_numpy(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a)


class Merged(NamedTuple):
    """The survivors after a compression's merges (keys and values float32 [R, m, D], or,
    where the kernels' blend wrote them, buffers [R, capacity, D] in their storage dtypes),
    the rule's state, the merges per row [R] and the merges so far (the count handed in
    plus all of them, an int32 scalar)."""

    keys: mx.array
    values: mx.array
    scores: mx.array
    votes: mx.array | None
    threshold: mx.array | None
    count: mx.array
    so_far: mx.array


class _Targets(NamedTuple):
    """Where each loser [R, k] goes (section 4.1 or 4.2): survivor indices [R, k, w] (w = 1
    for a nearest rule, the window otherwise) where valid [R, k, w], and whether a loser
    has any [R, k]; the gate's s_T and the mass each target receives, s_in [R, k]; a
    nearest rule's target t and cosine [R, k], a window rule's width |W(e)| [R, k] (None
    where the kind has none)."""

    index: mx.array
    valid: mx.array
    any_valid: mx.array
    s_target: mx.array
    s_in: mx.array
    nearest: mx.array | None = None
    cosine: mx.array | None = None
    width: mx.array | None = None


def _targets(losers: Rows, loser_idx, kept: Rows, kept_idx, cfg, split: bool, kernels: bool) -> _Targets:
    if merges.rule(cfg.merge).kind == merges.WINDOW:
        index, width = _window_targets(loser_idx, kept_idx, cfg.window)
        valid = mx.arange(index.shape[2])[None, None, :] < width[:, :, None]
        shared = mx.maximum(width, 1)
        s_target = mx.where(valid, _at(kept.scores, index), 0.0).sum(axis=2) / shared  # the mean score of W(e)
        return _Targets(index, valid, width > 0, s_target, losers.scores / shared, width=shared)
    t, found, cosine = _nearest(losers.keys, kept.keys, kept.positions, cfg.n_sink, split, kernels,
                                (losers.key_norm, kept.key_norm))
    return _Targets(t[:, :, None], found[:, :, None], found, _at(kept.scores, t), losers.scores, t, cosine)


def _merging(targets: _Targets, losers: Rows, threshold, cfg, row_ids, kernels: bool = False):
    """Section 4.3 and 4.5: which losers merge [R, k] bool (those with a target that pass
    the gate and d2o's threshold), and d2o's moved threshold (kernels: both in one launch,
    merge_cuda.moved_threshold)."""
    do = targets.any_valid  # a loser with no target merges nowhere
    if cfg.gate:
        draws = gate.uniform(cfg.seed, row_ids[:, None], losers.positions)
        do = do & (draws < gate.probability(losers.scores, targets.s_target))
    if merges.rule(cfg.merge).moving_threshold:
        if kernels:
            return merge_cuda.moved_threshold(targets.cosine, do, threshold)
        threshold = merges.moved_threshold(threshold, targets.cosine)
        do = do & (targets.cosine >= threshold[:, None])
    return do, threshold


def merge(losers: Rows, loser_idx, kept: Rows, kept_idx, threshold, query, scale: float, cfg, row_ids,
          split: bool, kernels: bool = False, storage=mx.float32, capacity: int | None = None,
          merges_so_far: mx.array | None = None) -> Merged:
    """Sections 4.1-4.6: every loser's targets among the survivors (as they stand before
    any merge), the gate and d2o's threshold, then every target's merges at once. split:
    whether the nearest search's product needs float32_product's split (float32 keys on
    an NVIDIA GPU); kernels: the nearest search and the sums by camkv.backends.merge_cuda,
    whose blend of a nearest rule (and keepkv's merge) rounds the values to storage (the
    values' dtype as stored) and the keys to their stored dtype, into buffers of
    capacity rows (compress's). merges_so_far: the count the merges add to (None: 0);
    with kernels, their own launches count them (no reduction after them)."""
    rule = merges.rule(cfg.merge)
    so_far = mx.array(0, mx.int32) if merges_so_far is None else merges_so_far
    if kernels and rule.kind == merges.WINDOW and not rule.blends and not cfg.gate:
        # Every loser with a survivor after it merges, counted by the same launches.
        values, keys, scores, *counts = merge_cuda.spread_window(losers.values, losers.scores, loser_idx, kept_idx,
                                                                 kept.values, kept.stored_keys, kept.scores,
                                                                 cfg.window, so_far, storage, capacity)
        return Merged(keys, values, scores, kept.votes, threshold, *counts)
    if kernels and _search_fused(rule, cfg):  # the search in the merge's first launch
        products, norm_l, norm_k = _key_products(losers.keys, kept.keys, split, kernels,
                                                 (losers.key_norm, kept.key_norm))
        if rule.keeps_votes:  # keepkv's whole merge in three launches
            incoming = merge_cuda.keep_search(products, norm_l, norm_k, kept.positions, cfg.n_sink, losers.keys,
                                              query, scale)
            keys, values, votes, scores, *counts = merge_cuda.keep_merge(losers, kept, incoming, query, scale,
                                                                         so_far, storage, capacity)
            return Merged(keys, values, scores, votes, threshold, *counts)
        # search, shares, sums and count: two launches
        values, keys, scores, *counts = merge_cuda.search_and_blend(
            products, norm_l, norm_k, kept.positions, cfg.n_sink, losers.values,
            losers.keys if cfg.merge_keys else None, kept.values, kept.stored_keys, kept.scores, losers.scores,
            (losers.value_norm, kept.value_norm), rule.code, so_far, storage, capacity)
        return Merged(keys, values, scores, kept.votes, threshold, *counts)
    targets = _targets(losers, loser_idx, kept, kept_idx, cfg, split, kernels)
    do, threshold = _merging(targets, losers, threshold, cfg, row_ids, kernels)
    keys, values, votes = kept.keys, kept.values, kept.votes
    if rule.blends and not rule.keeps_votes and rule.kind == merges.NEAREST and kernels:
        # One target a loser: the whole blend, the rule's shares with it and the count, in two
        # launches (merge_cuda.blend_nearest; the value norms Rows.split took).
        values, keys, scores, *counts = merge_cuda.blend_nearest(
            losers.values, losers.keys if cfg.merge_keys else None, kept.values, kept.stored_keys, kept.scores,
            targets.nearest, do, targets.cosine, targets.s_in, (losers.value_norm, kept.value_norm), rule.code,
            so_far, storage, capacity)
        return Merged(keys, values, scores, votes, threshold, *counts)
    if rule.keeps_votes and kernels:  # keepkv's whole merge, the gate's draws taken, in three launches
        incoming = merge_cuda.keep_logits(losers.keys, query, targets.nearest, do, scale, kept.keys.shape[1])
        keys, values, votes, scores, *counts = merge_cuda.keep_merge(losers, kept, incoming, query, scale, so_far,
                                                                     storage, capacity)
        return Merged(keys, values, scores, votes, threshold, *counts)
    count = do.sum(axis=1).astype(mx.int32)  # merging losers a row (the kernels count their own)
    edges = _Edges(targets.index, targets.valid & do[:, :, None], kept.scores.shape[1], kernels)
    if rule.keeps_votes:
        keys, values, votes, s_in = _keep_output(rule, losers, kept, targets, edges, query, scale)
    elif rule.blends:
        share_in = _loser_share(rule, losers, kept, targets)
        pairs = [(kept.values, losers.values)] + ([(kept.keys, losers.keys)] if cfg.merge_keys else [])
        blend = edges.blend(pairs, share_in, rule.target_share(kept.scores), targets.s_in)
        values, s_in = blend.rows[0], blend.extra[0]
        if cfg.merge_keys:
            keys = blend.rows[1]
    else:  # additive: each target of W(e) gains V_e / |W(e)|
        added, s_in = edges.sums(losers.values / targets.width[:, :, None], targets.s_in)
        values = kept.values + added
    return Merged(keys, values, kept.scores + s_in, votes, threshold, count, so_far + count.sum())


def _loser_share(rule, losers: Rows, kept: Rows, targets: _Targets):
    """A blending rule's a_e for every loser (section 4.4): [R, k] or a number for all."""
    norm_e = norm_t = None
    if rule.kind == merges.NEAREST:  # the values' norms Rows.split took
        norm_e, norm_t = losers.value_norm, _at(kept.value_norm, targets.nearest)
    return rule.loser_share(targets.cosine, targets.s_in, targets.s_target, norm_e, norm_t)


def _at(x: mx.array, idx: mx.array) -> mx.array:
    """x[r, idx[r, ...]] for x [R, m] and idx [R, k] or [R, k, w]."""
    flat = idx.reshape(idx.shape[0], -1)
    return mx.take_along_axis(x, flat, axis=1).reshape(idx.shape)


def _nearest(loser_keys, kept_keys, kept_positions, n_sink: int, split: bool, kernels: bool = False,
             norms: tuple = (None, None)):
    """Section 4.1 for every loser at once: the non-sink survivor of largest cosine
    (ties to the smaller position: survivors are in position order, and the first
    maximum wins; a device whose argmax broke exact ties otherwise would stay within
    section 8's near-tie of the cosines), among those with a finite cosine, as one product
    of losers [R, k, Dk] by the survivors' keys [R, m, Dk], each column divided by its
    survivor's norm: for one loser a survivor's cosine is that over |K_e|, a positive
    constant, so it ranks them as the cosines do (to rounding: section 8's near-tie). The
    product of the keys themselves, not of unit keys: keys stored in half precision are
    exact inputs of a TF32 product, so it needs no split (split: float32 keys on an NVIDIA
    GPU). Returns t [R, k] (indices into the survivors, 0 where there is none), whether
    there is one [R, k] and cos_t [R, k] as section 4.1 computes it. kernels: the product's
    ranking and argmax in one pass over it (merge_cuda.nearest). norms: the keys' norms
    (losers', survivors'; Rows.split's) where already computed."""
    if kernels and NEAREST_WITHOUT_PRODUCT:
        norm_l, norm_k = _key_norms(loser_keys, kept_keys, norms)
        return merge_cuda.nearest_direct(loser_keys, kept_keys, norm_l, norm_k, kept_positions, n_sink)
    products, norm_l, norm_k = _key_products(loser_keys, kept_keys, split, kernels, norms)
    if kernels:
        return merge_cuda.nearest(products, norm_l, norm_k, kept_positions, n_sink)
    # A NaN or infinite key has no finite cosine: such a survivor is no candidate, such a
    # loser has none. (A norm is finite where it is below infinity: NaN compares false.)
    candidate = (kept_positions >= n_sink) & (norm_k < _INF)
    ranked = products / mx.maximum(norm_k, 1e-12)[:, None, :]
    ranked = mx.where(candidate[:, None, :], ranked, -_INF)
    t = mx.argmax(ranked, axis=2)  # MLX's argmax takes the first of equal maxima
    found = (mx.take_along_axis(ranked, t[:, :, None], axis=2)[:, :, 0] > -_INF) & (norm_l < _INF)
    t = mx.where(found, t, 0).astype(mx.int32)
    k_t = mx.take_along_axis(kept_keys, t[:, :, None], axis=1)
    # The target's norm is its row's of norm_k (the same sum of the same row), read, not summed again.
    cos_t = (loser_keys * k_t).sum(axis=-1) / mx.maximum(norm_l * _at(norm_k, t), 1e-12)
    return t, found, cos_t


def _key_norms(loser_keys, kept_keys, norms: tuple) -> tuple:
    """The losers' and the survivors' key norms: norms where given, else taken here."""
    return tuple(merges.feature_norm(keys) if norm is None else norm
                 for keys, norm in zip((loser_keys, kept_keys), norms))


def _key_products(loser_keys, kept_keys, split: bool, kernels: bool, norms: tuple) -> tuple:
    """The nearest search's dot products of losers [R, k, Dk] and survivors' keys
    [R, m, Dk], [R, k, m] float32 (split as _nearest says), and the two sides' key norms.
    With kernels on CUDA a product of FENCE_FROM_PAIRS pairs or more is fenced
    (FENCE_NEAREST_PRODUCT)."""
    norm_l, norm_k = _key_norms(loser_keys, kept_keys, norms)
    survivors_keys = kept_keys.transpose(0, 2, 1)
    # Read once: both evaluations or neither.
    fenced = kernels and FENCE_NEAREST_PRODUCT and loser_keys.shape[1] * kept_keys.shape[1] >= FENCE_FROM_PAIRS
    if fenced:
        mx.async_eval(loser_keys, survivors_keys)
    products = mass.float32_product(loser_keys, survivors_keys, split)
    if fenced:
        mx.async_eval(products)
    return products, norm_l, norm_k


def _search_fused(rule, cfg) -> bool:
    """Whether the kernels find a nearest rule's targets in the first launch of its merge
    (merge_cuda.search_and_blend, or keepkv's merge_cuda.keep_search): every loser with a
    target merges (no gate, no moving threshold), and the search takes the product."""
    return (rule.kind == merges.NEAREST and rule.blends and not rule.moving_threshold and not cfg.gate
            and not NEAREST_WITHOUT_PRODUCT)


def _window_targets(loser_idx, kept_idx, window: int):
    """Section 4.2: each loser's first `window` survivors after it, as indices into the
    survivors [R, k, window] (clipped where fewer follow), and how many follow [R, k]."""
    first = (kept_idx[:, None, :] < loser_idx[:, :, None]).sum(axis=2)  # survivors before each loser
    m = kept_idx.shape[1]
    width = mx.minimum(m - first, window)
    targets = mx.minimum(first[:, :, None] + mx.arange(window)[None, None, :], m - 1)
    return targets, width


class _Blend(NamedTuple):
    """What _Edges.blend gives: the blended rows [R, m, D] (float32, one per pair), each
    survivor's taken share sum_e a_e and whether a loser gives to it [R, m], and the
    sums of the extra quantities [R, m]."""

    rows: list
    taken: mx.array
    receiving: mx.array
    extra: list


class _Edges:
    """Which survivor each merging loser gives to: targets [R, k, w] (indices into m
    survivors) where live [R, k, w]; sums over a target's losers are scatter-adds into
    the flattened [R * m] survivors, as many quantities as one call is given in one
    scatter (on a GPU each operation is a launch, and a compression's time is mostly
    theirs: bench/profile_merge_engine.py --graph counts them); with kernels, one launch
    of merge_cuda.scatter_rows."""

    def __init__(self, targets, live, m: int, kernels: bool = False):
        self.m, self.kernels = m, kernels
        # The flat [R * m] index MLX's scatter-add takes (the kernel reads targets as they are).
        self.index = None if kernels else (targets + (mx.arange(targets.shape[0]) * m)[:, None, None]).reshape(-1)
        self.live = live
        self.targets = targets

    def sums(self, *columns) -> list[mx.array]:
        """Each survivor's sums over the losers that give to it, of each column: [R, k] (or
        a float for every loser) gives [R, m], [R, k, D] gives [R, m, D]; one scatter-add
        of the columns side by side."""
        R, k, _ = self.live.shape
        parts = [c.reshape(R, k, -1) if isinstance(c, mx.array) else mx.full((R, k, 1), c, mx.float32)
                 for c in columns]
        joined = mx.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]  # [R, k, C]
        if self.kernels:
            total = merge_cuda.scatter_rows(joined, self.targets, self.live, self.m)
        else:
            spread = mx.where(self.live[:, :, :, None], joined[:, :, None, :], 0.0).reshape(-1, joined.shape[-1])
            total = mx.zeros((R * self.m, spread.shape[1]), mx.float32).at[self.index].add(spread)
            total = total.reshape(R, self.m, -1)
        out, first = [], 0
        for column, part in zip(columns, parts):
            width = part.shape[-1]
            per_row = not isinstance(column, mx.array) or column.ndim == 2
            out.append(total[:, :, first] if per_row else total[:, :, first:first + width])
            first += width
        return out

    def blend(self, pairs, share_in, share_t, *extra) -> _Blend:
        """Section 4.4's blend for every target at once, float32: for each (rows [R, m, D],
        sources [R, k, D]) of pairs, each survivor a loser gives to becomes
        (A row + sum_e a_e source_e) / (A + sum_e a_e), A = share_t ([R, m] or a float),
        a_e = share_in ([R, k] or a float); unchanged where that denominator is 0. The
        extra quantities [R, k] are summed per survivor in the same scatter."""
        a_e = share_in[:, :, None] if isinstance(share_in, mx.array) else share_in
        taken, count, *summed = self.sums(share_in, 1.0, *(a_e * sources for _, sources in pairs), *extra)
        incoming, extra_sums = summed[:len(pairs)], summed[len(pairs):]
        receiving = count > 0
        total = share_t + taken
        blending = receiving & (total > 0)
        safe = mx.where(blending, total, 1.0)[:, :, None]
        a_t = share_t[:, :, None] if isinstance(share_t, mx.array) else share_t
        rows = [mx.where(blending[:, :, None], (a_t * own + into) / safe, own)
                for (own, _), into in zip(pairs, incoming)]
        return _Blend(rows, taken, receiving, extra_sums)

    def max(self, x: mx.array) -> mx.array:
        """Each survivor's largest x [R, k] over its merging losers, -inf where none: [R, m].
        A dense masked maximum over (loser, survivor) pairs, as large as the cosines'
        product (MLX has no scatter of maxima; on CUDA keepkv's kernels take atomic maxima
        instead, merge_cuda.keep_merge)."""
        onehot = (self.targets[:, :, :, None] == mx.arange(self.m)) & self.live[:, :, :, None]  # [R, k, w, m]
        return mx.where(onehot, x[:, :, None, None], -_INF).max(axis=(1, 2))


def _keep_output(rule, losers: Rows, kept: Rows, targets: _Targets, edges: _Edges, query, scale: float):
    """Section 4.6 for every target at once: returns (keys float32, values float32, votes,
    the mass each survivor receives [R, m])."""
    t = targets.nearest
    q = query[:, None, :]
    l_t = scale * (kept.keys * q).sum(axis=-1)  # [R, m]
    l_e = scale * (losers.keys * q).sum(axis=-1)  # [R, k]
    finite_e = mx.isfinite(l_e)
    poisoned_in = edges.sums(mx.where(finite_e, 0.0, 1.0))[0] > 0
    finite = mx.isfinite(l_t) & ~poisoned_in
    top = mx.where(finite, mx.maximum(l_t, edges.max(mx.where(finite_e, l_e, -_INF))), 0.0)
    m_t = kept.votes * mx.where(finite, mx.exp(l_t - top), 1.0)
    m_e = losers.votes * mx.where(_at(finite, t), mx.exp(l_e - _at(top, t)), 1.0)
    share_in = rule.loser_share(None, m_e, _at(m_t, t), None, None)
    share_t = rule.target_share(m_t)
    blend = edges.blend([(kept.values, losers.values), (kept.keys, losers.keys)], share_in, share_t, losers.votes,
                        targets.s_in)
    (values, mean_key), (in_votes, s_in) = blend.rows, blend.extra
    receives = blend.receiving
    total_votes = kept.votes + in_votes
    keyed = merges.output_preserving_key(mean_key, q, scale, top, share_t + blend.taken, total_votes, finite)
    keys = mx.where(receives[:, :, None], keyed, kept.keys)
    return keys, values, mx.where(receives, total_votes, kept.votes), s_in


def update(state: RowState, new_keys, new_values, offset: int, cfg, row_ids, queries=None, scale=None,
           preferred: mass.Reducer | None = None) -> tuple[RowState, mx.array]:
    """camkv.reference.update's signature and results (within section 8) by this engine:
    a chunk call is one compression, an exact call one per token (section 7). queries
    [R, S, G, Dk] or None (key scoring); preferred as compress takes it."""
    if queries is None:
        q, scale = drop.key_queries(new_keys)
    else:
        q = queries.transpose(0, 2, 1, 3)
    if cfg.prefill == "chunk":
        keys = mx.concatenate([state.keys, new_keys], axis=1)
        values = mx.concatenate([state.values, new_values], axis=1)
        return compress(keys, values, _settled(state), q, offset, scale, cfg, row_ids, preferred)[:2]
    total = mx.zeros((new_keys.shape[0],), mx.int32)
    for i in range(new_keys.shape[1]):
        keys = mx.concatenate([state.keys, new_keys[:, i:i + 1]], axis=1)
        values = mx.concatenate([state.values, new_values[:, i:i + 1]], axis=1)
        state, merged, _ = compress(keys, values, _settled(state), q[:, :, i:i + 1], offset + i, scale, cfg, row_ids,
                                    preferred)
        total = total + merged
    return state, total


def _settled(state: RowState) -> Settled:
    return Settled(state.scores, state.positions, state.votes, state.threshold)
