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

from typing import NamedTuple

import mlx.core as mx

from .. import gate, mass, merges, policy
from ..rows import RowState
from . import drop

_INF = float("inf")


def reducer(bias: bool, preferred: mass.Reducer | None = None) -> mass.Reducer:
    """How a chunk's logits become mass here. With votes (bias: their logs join every
    logit) the float32 products of the reference's arithmetic (split on an NVIDIA GPU,
    whose matmul rounds to TF32); otherwise the backend's preferred reduction (the
    extension's column sums on the CPU), or the drop engine's."""
    if bias:
        return mass.EXACT_SPLIT if drop.on_cuda() else mass.EXACT
    return drop.reducer() if preferred is None else preferred


class Rows(NamedTuple):
    """Some rows of every row r, gathered [R, m, ...] (float32 keys and values for the
    arithmetic)."""

    keys: mx.array
    values: mx.array
    scores: mx.array
    positions: mx.array
    votes: mx.array | None

    @classmethod
    def of(cls, keys, values, scores, positions, votes, idx) -> "Rows":
        def take(a):
            return mx.take_along_axis(a, idx[:, :, None] if a.ndim == 3 else idx, axis=1)

        return cls(take(keys).astype(mx.float32), take(values).astype(mx.float32), take(scores), take(positions),
                   None if votes is None else take(votes))


class Settled(NamedTuple):
    """What a compression reads of the n scored rows besides their keys and values:
    scores and positions [R, n], and the rule's votes [R, n] and threshold [R] (None
    where it keeps none, or before a row's first compression)."""

    scores: mx.array
    positions: mx.array
    votes: mx.array | None = None
    threshold: mx.array | None = None


def compress(keys, values, settled: Settled, queries, first_pending: int, scale: float, cfg, row_ids,
             preferred: mass.Reducer | None = None) -> tuple[RowState, mx.array]:
    """Rows held [R, N, D] whose first n are scored (settled): score the rest, at
    positions first_pending.., as one chunk (queries [R, G, T, Dk], its last T), evict
    down to the budget and merge every loser (section 4). Returns the survivors and the
    merges per row. preferred: the backend's reduction of a chunk's logits (see reducer)."""
    rule = merges.rule(cfg.merge)
    rows, n = settled.scores.shape
    s_len = keys.shape[1] - n
    positions = mx.concatenate(
        [settled.positions, mx.broadcast_to(first_pending + mx.arange(s_len, dtype=mx.int32), (rows, s_len))], axis=1)
    votes = settled.votes
    if rule.keeps_votes:
        votes = mx.concatenate([mx.ones((rows, n), mx.float32) if votes is None else votes,
                                mx.ones((rows, s_len), mx.float32)], axis=1)
    threshold = settled.threshold
    if rule.moving_threshold and threshold is None:
        threshold = mx.full((rows,), float("nan"), mx.float32)
    bias = None if votes is None else mx.log(votes)
    chunk = mass.chunk_mass(queries, keys, scale, n, cfg, s_len, reducer(bias is not None, preferred), bias=bias)
    scores = mx.concatenate([settled.scores + chunk[:, :n], chunk[:, n:]], axis=1)
    if n + s_len <= cfg.budget:
        return RowState(keys, values, scores, positions, votes, threshold), mx.zeros((rows,), mx.int32)
    loser_idx, kept_idx = drop.losers_and_survivors(policy.eviction_ranks(scores, cfg), positions,
                                                    first_pending + s_len - 1, cfg.budget, cfg.n_sink, cfg.recent)
    if rule.kind == merges.DROP:  # nothing merges (the drop engine's result)
        return RowState(keys, values, scores, positions, votes, threshold).take(kept_idx), mx.zeros((rows,), mx.int32)
    losers = Rows.of(keys, values, scores, positions, votes, loser_idx)
    kept = Rows.of(keys, values, scores, positions, votes, kept_idx)
    query = queries[:, :, -1].astype(mx.float32).mean(axis=1) if rule.keeps_votes else None
    # Keys stored in half precision are exact in a TF32 product; float32 ones need the split.
    split = drop.on_cuda() and keys.dtype == mx.float32
    merged = merge(losers, loser_idx, kept, kept_idx, threshold, query, scale, cfg, row_ids, split)
    # Survivors no merge changed round back to themselves (they were cast from the storage dtype).
    return RowState(merged.keys.astype(keys.dtype), merged.values.astype(values.dtype), merged.scores,
                    kept.positions, merged.votes, merged.threshold), merged.count


class Merged(NamedTuple):
    """The survivors after a compression's merges (keys and values float32), the rule's
    state and the merges per row."""

    keys: mx.array
    values: mx.array
    scores: mx.array
    votes: mx.array | None
    threshold: mx.array | None
    count: mx.array


class _Targets(NamedTuple):
    """Where each loser [R, k] goes (section 4.1 or 4.2): survivor indices [R, k, w] (w = 1
    for a nearest rule, the window otherwise) where valid [R, k, w]; the gate's s_T and the
    mass each target receives, s_in [R, k]; a nearest rule's target t and cosine [R, k], a
    window rule's width |W(e)| [R, k] (None where the kind has none)."""

    index: mx.array
    valid: mx.array
    s_target: mx.array
    s_in: mx.array
    nearest: mx.array | None = None
    cosine: mx.array | None = None
    width: mx.array | None = None


def _targets(losers: Rows, loser_idx, kept: Rows, kept_idx, cfg, split: bool) -> _Targets:
    if merges.rule(cfg.merge).kind == merges.WINDOW:
        index, width = _window_targets(loser_idx, kept_idx, cfg.window)
        valid = mx.arange(index.shape[2])[None, None, :] < width[:, :, None]
        shared = mx.maximum(width, 1)
        s_target = mx.where(valid, _at(kept.scores, index), 0.0).sum(axis=2) / shared  # the mean score of W(e)
        return _Targets(index, valid, s_target, losers.scores / shared, width=shared)
    t, found, cosine = _nearest(losers.keys, kept.keys, kept.positions, cfg.n_sink, split)
    return _Targets(t[:, :, None], found[:, :, None], _at(kept.scores, t), losers.scores, t, cosine)


def _merging(targets: _Targets, losers: Rows, threshold, cfg, row_ids):
    """Section 4.3 and 4.5: which losers merge [R, k] bool, and d2o's moved threshold."""
    do = mx.ones(targets.s_in.shape, mx.bool_)
    if cfg.gate:
        draws = gate.uniform(cfg.seed, row_ids[:, None], losers.positions)
        do = draws < gate.probability(losers.scores, targets.s_target)
    if merges.rule(cfg.merge).moving_threshold:
        threshold = merges.moved_threshold(threshold, targets.cosine)
        do = do & (targets.cosine >= threshold[:, None])
    return do, threshold


def merge(losers: Rows, loser_idx, kept: Rows, kept_idx, threshold, query, scale: float, cfg, row_ids,
          split: bool) -> Merged:
    """Sections 4.1-4.6: every loser's targets among the survivors (as they stand before
    any merge), the gate and d2o's threshold, then every target's merges at once. split:
    whether the nearest search's product needs float32_product's split (float32 keys on
    an NVIDIA GPU)."""
    rule = merges.rule(cfg.merge)
    targets = _targets(losers, loser_idx, kept, kept_idx, cfg, split)
    do, threshold = _merging(targets, losers, threshold, cfg, row_ids)
    do = do & targets.valid.any(axis=2)  # a loser with no target merges nowhere
    edges = _Edges(targets.index, targets.valid & do[:, :, None], kept.scores.shape[1])
    keys, values, votes = kept.keys, kept.values, kept.votes
    if rule.keeps_votes:
        keys, values, votes = _keep_output(rule, losers, kept, targets.nearest, edges, query, scale)
    elif rule.blends:
        norm_e = norm_t = None
        if rule.kind == merges.NEAREST:
            norm_e, norm_t = merges.feature_norm(losers.values), _at(merges.feature_norm(kept.values), targets.nearest)
        share_in = rule.loser_share(targets.cosine, targets.s_in, targets.s_target, norm_e, norm_t)
        share_t = rule.target_share(kept.scores)
        values = edges.weighted_mean(kept.values, losers.values, share_in, share_t)
        if cfg.merge_keys:
            keys = edges.weighted_mean(kept.keys, losers.keys, share_in, share_t)
    else:  # additive: each target of W(e) gains V_e / |W(e)|
        values = kept.values + edges.sum(losers.values / targets.width[:, :, None])
    scores = kept.scores + edges.sum(targets.s_in)
    return Merged(keys, values, scores, votes, threshold, do.sum(axis=1).astype(mx.int32))


def _at(x: mx.array, idx: mx.array) -> mx.array:
    """x[r, idx[r, ...]] for x [R, m] and idx [R, k] or [R, k, w]."""
    flat = idx.reshape(idx.shape[0], -1)
    return mx.take_along_axis(x, flat, axis=1).reshape(idx.shape)


def _nearest(loser_keys, kept_keys, kept_positions, n_sink: int, split: bool):
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
    there is one [R, k] and cos_t [R, k] as section 4.1 computes it."""
    norm_l, norm_k = merges.feature_norm(loser_keys), merges.feature_norm(kept_keys)
    products = mass.float32_product(loser_keys, kept_keys.transpose(0, 2, 1), split)
    ranked = products / mx.maximum(norm_k, 1e-12)[:, None, :]
    # A NaN or infinite key has no finite cosine: such a survivor is no candidate, such a
    # loser has none.
    candidate = (kept_positions >= n_sink) & mx.isfinite(norm_k)
    ranked = mx.where(candidate[:, None, :], ranked, -_INF)
    t = mx.argmax(ranked, axis=2)  # MLX's argmax takes the first of equal maxima
    found = (mx.take_along_axis(ranked, t[:, :, None], axis=2)[:, :, 0] > -_INF) & mx.isfinite(norm_l)
    t = mx.where(found, t, 0).astype(mx.int32)
    k_t = mx.take_along_axis(kept_keys, t[:, :, None], axis=1)
    cos_t = (loser_keys * k_t).sum(axis=-1) / mx.maximum(norm_l * merges.feature_norm(k_t), 1e-12)
    return t, found, cos_t


def _window_targets(loser_idx, kept_idx, window: int):
    """Section 4.2: each loser's first `window` survivors after it, as indices into the
    survivors [R, k, window] (clipped where fewer follow), and how many follow [R, k]."""
    first = (kept_idx[:, None, :] < loser_idx[:, :, None]).sum(axis=2)  # survivors before each loser
    m = kept_idx.shape[1]
    width = mx.minimum(m - first, window)
    targets = mx.minimum(first[:, :, None] + mx.arange(window)[None, None, :], m - 1)
    return targets, width


class _Edges:
    """Which survivor each merging loser gives to: targets [R, k, w] (indices into m
    survivors) where live [R, k, w]; sums over a target's losers are scatter-adds into
    the flattened [R * m] survivors."""

    def __init__(self, targets, live, m: int):
        rows = targets.shape[0]
        self.rows, self.m, self.width = rows, m, targets.shape[2]
        self.index = (targets + (mx.arange(rows) * m)[:, None, None]).reshape(-1)
        self.live = live
        self.targets = targets
        self.receiving = self.sum(mx.ones(live.shape[:2], mx.float32)) > 0  # [R, m]: some loser gives to it

    def _spread(self, x: mx.array) -> mx.array:
        """x [R, k] (or a float for every loser) or [R, k, D] onto the edges [R * k * w, ...],
        0 where not live."""
        if not isinstance(x, mx.array) or x.ndim == 0:
            x = mx.full(self.live.shape[:2], x, mx.float32)
        if x.ndim == 2:
            return mx.where(self.live, x[:, :, None], 0.0).reshape(-1)
        live = self.live[:, :, :, None]
        return mx.where(live, x[:, :, None, :], 0.0).reshape(-1, x.shape[-1])

    def sum(self, x: mx.array) -> mx.array:
        """Each survivor's sum of x over the losers that give to it: [R, m] or [R, m, D]."""
        spread = self._spread(x)
        out = mx.zeros((self.rows * self.m,) + spread.shape[1:], mx.float32).at[self.index].add(spread)
        return out.reshape((self.rows, self.m) + spread.shape[1:])

    def weighted_mean(self, rows, sources, share_in, share_t) -> mx.array:
        """Section 4.4's blend, float32 [R, m, D]: each survivor with merging losers
        becomes (1 - W) row + sum_e w_e source_e, D = A + sum a_e, w_e = a_e / D,
        W = (sum a_e) / D; unchanged where D = 0 or nothing merges into it."""
        if not isinstance(share_in, mx.array):
            share_in = mx.full(self.live.shape[:2], share_in, mx.float32)
        taken = self.sum(share_in)
        total = share_t + taken
        positive = total > 0
        safe = mx.where(positive, total, 1.0)
        w = share_in[:, :, None] / _at(safe, self.targets)  # each edge's weight, its target's D
        w = mx.where(_at(positive, self.targets), w, 0.0)
        kept = 1.0 - mx.where(positive, taken / safe, 0.0)
        spread = mx.where(self.live[:, :, :, None], w[:, :, :, None] * sources[:, :, None, :], 0.0)
        incoming = mx.zeros((self.rows * self.m, sources.shape[-1]), mx.float32).at[self.index].add(
            spread.reshape(-1, sources.shape[-1])).reshape(self.rows, self.m, -1)
        blended = kept[:, :, None] * rows + incoming
        return mx.where(self.receiving[:, :, None], blended, rows)

    def max(self, x: mx.array) -> mx.array:
        """Each survivor's largest x [R, k] over its merging losers, -inf where none: [R, m].
        A dense masked maximum over (loser, survivor) pairs, as large as the cosines'
        product, where a scatter of maxima would need an atomic maximum of floats."""
        onehot = (self.targets[:, :, :, None] == mx.arange(self.m)) & self.live[:, :, :, None]  # [R, k, w, m]
        return mx.where(onehot, x[:, :, None, None], -_INF).max(axis=(1, 2))


def _keep_output(rule, losers: Rows, kept: Rows, t, edges: _Edges, query, scale: float):
    """Section 4.6 for every target at once: returns (keys float32, values float32, votes)."""
    q = query[:, None, :]
    l_t = scale * (kept.keys * q).sum(axis=-1)  # [R, m]
    l_e = scale * (losers.keys * q).sum(axis=-1)  # [R, k]
    poisoned_in = edges.sum(mx.where(mx.isfinite(l_e), 0.0, 1.0)) > 0
    finite = mx.isfinite(l_t) & ~poisoned_in
    top = mx.where(finite, mx.maximum(l_t, edges.max(mx.where(mx.isfinite(l_e), l_e, -_INF))), 0.0)
    m_t = kept.votes * mx.where(finite, mx.exp(l_t - top), 1.0)
    m_e = losers.votes * mx.where(_at(finite, t), mx.exp(l_e - _at(top, t)), 1.0)
    share_in = rule.loser_share(None, m_e, _at(m_t, t), None, None)
    share_t = rule.target_share(m_t)
    values = edges.weighted_mean(kept.values, losers.values, share_in, share_t)
    mean_key = edges.weighted_mean(kept.keys, losers.keys, share_in, share_t)
    receives = edges.receiving
    total_votes = kept.votes + edges.sum(losers.votes)
    keyed = merges.output_preserving_key(mean_key, q, scale, top, share_t + edges.sum(share_in), total_votes, finite)
    keys = mx.where(receives[:, :, None], keyed, kept.keys)
    return keys, values, mx.where(receives, total_votes, kept.votes)


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
        return compress(keys, values, _settled(state), q, offset, scale, cfg, row_ids, preferred)
    total = mx.zeros((new_keys.shape[0],), mx.int32)
    for i in range(new_keys.shape[1]):
        keys = mx.concatenate([state.keys, new_keys[:, i:i + 1]], axis=1)
        values = mx.concatenate([state.values, new_values[:, i:i + 1]], axis=1)
        state, merged = compress(keys, values, _settled(state), q[:, :, i:i + 1], offset + i, scale, cfg, row_ids,
                                 preferred)
        total = total + merged
    return state, total


def _settled(state: RowState) -> Settled:
    return Settled(state.scores, state.positions, state.votes, state.threshold)
