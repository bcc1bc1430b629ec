"""The pure-MLX reference of docs/algorithm.md: the oracle every kernel is checked against.

A literal transcription, vectorised over rows (r = b * H + h): no Python loop over
batch or heads. Exact mode loops over the tokens of a call; a compression's merges are
simultaneous (section 7), every loser against the survivors as they stand before any of
them, so they are one vectorised step over losers and rows ([R, k, N] choices and one
weighted sum per target). Everything is float32 arithmetic; keys and values are rounded
to the storage dtype once per compression.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import mlx.core as mx

from . import mass as _mass, merges, policy
from .compiled import CompiledSteps
from .config import CaMConfig
# The mass arithmetic the kernels' prescoring shares lives in camkv.mass; the oracle
# reads it from there (tests read these names here too).
from .mass import _tf32_high, attention_mass as _attention_mass, attention_mass_causal  # noqa: F401
from .mass import float32_product as _float32_product  # noqa: F401
from .gate import gate_hash, probability, uniform  # noqa: F401  (tests read them here)
from .rows import RowState

_INF = float("inf")


# ----------------------------------------------------------------------------
# Small vectorised helpers (all over a row axis 0)


def _first_argmin(x: mx.array) -> mx.array:
    """Index of the smallest entry along the last axis; ties go to the smaller index."""
    idx = mx.arange(x.shape[-1])
    lowest = mx.min(x, axis=-1, keepdims=True)
    return mx.min(mx.where(x == lowest, idx, x.shape[-1]), axis=-1)


def _first_argmax(x: mx.array) -> mx.array:
    return _first_argmin(-x)


def _gathered(x: mx.array, idx: mx.array) -> mx.array:
    """x[r, idx[r, j]] for x [R, N] or [R, N, D]; idx [R, k]: [R, k] or [R, k, D]."""
    if x.ndim == 2:
        return mx.take_along_axis(x, idx, axis=1)
    return mx.take_along_axis(x, idx[:, :, None], axis=1)


# ----------------------------------------------------------------------------
# Sections 4.1-4.6: one compression's merges, all at once


class _RuleState(NamedTuple):
    """What the rules that carry state (camkv.merges) need in one compression; None where
    the rule keeps none."""

    votes: mx.array | None  # [R, N] float32: the tokens each row stands for (keeps_votes)
    threshold: mx.array | None  # [R] float32: before this compression (moving_threshold)
    query: mx.array | None  # [R, Dk] float32: the compression's last token's mean query (keeps_votes)
    scale: float  # the attention scale of that query


_NO_RULE_STATE = _RuleState(None, None, None, 1.0)


def _nearest(keys, positions, survivor, loser_idx, cfg: CaMConfig):
    """Section 4.1: each loser's (loser_idx [R, k]) non-sink survivor t most similar to it,
    against the keys before any merge, among those with a finite cosine. Returns t [R, k]
    (0 where there is none), whether there is one [R, k], cos(K_e, K_t) [R, k] and the
    losers' keys [R, k, Dk] float32."""
    k_f = keys.astype(mx.float32)
    k_l = _gathered(k_f, loser_idx)
    dots = k_l @ k_f.transpose(0, 2, 1)
    norms = merges.feature_norm(k_l)[:, :, None] * merges.feature_norm(k_f)[:, None, :]
    cos = dots / mx.maximum(norms, 1e-12)
    eligible = (survivor & (positions >= cfg.n_sink))[:, None, :] & mx.isfinite(cos)
    ranked = mx.where(eligible, cos, -_INF)
    found = ranked.max(axis=2) > -_INF
    t = mx.where(found, _first_argmax(ranked), 0)
    return t, found, mx.take_along_axis(cos, t[:, :, None], axis=2)[:, :, 0], k_l


def _window_members(survivor, loser_idx, window: int) -> mx.array:
    """Section 4.2: [R, k, N] bool, the `window` survivors that follow each loser."""
    idx = mx.arange(survivor.shape[1])
    after = survivor[:, None, :] & (idx[None, None, :] > loser_idx[:, :, None])
    return after & (mx.cumsum(after.astype(mx.int32), axis=2) <= window)


def _merge_all(keys, values, scores, positions, survivor, loser_idx, row_ids, cfg: CaMConfig,
               extra: _RuleState = _NO_RULE_STATE):
    """Sections 4.1-4.6 for one compression: every loser (loser_idx [R, k]) picks its
    targets among the survivors (survivor [R, N] bool) as the state stands before any
    merge, the gate (and d2o's threshold) decides which losers merge, and every target
    takes all of its merging losers at once.

    keys [R, N, Dk], values [R, N, Dv] (storage dtype), scores [R, N] float32 with the
    compression's mass added, positions [R, N] int32. Returns (keys, values, scores,
    merged [R] int32, votes, threshold), votes and threshold None where the rule keeps none.
    """
    rule = merges.rule(cfg.merge)
    if rule.kind == merges.DROP:
        return keys, values, scores, mx.zeros((keys.shape[0],), mx.int32), extra.votes, extra.threshold
    s_e = _gathered(scores, loser_idx)
    v_l = _gathered(values, loser_idx).astype(mx.float32)
    t = cos_t = k_l = None
    if rule.kind == merges.WINDOW:
        member = _window_members(survivor, loser_idx, cfg.window)
        width = mx.maximum(member.sum(axis=2), 1).astype(mx.float32)
        s_target = mx.where(member, scores[:, None, :], 0.0).sum(axis=2) / width  # the mean score of W(e)
        s_in = s_e / width  # what each target of W(e) receives
    else:
        t, found, cos_t, k_l = _nearest(keys, positions, survivor, loser_idx, cfg)
        member = (t[:, :, None] == mx.arange(keys.shape[1])[None, None, :]) & found[:, :, None]
        s_target, s_in = _gathered(scores, t), s_e

    do = _gate(s_e, s_target, row_ids[:, None], _gathered(positions, loser_idx), cfg) & member.any(axis=2)
    threshold = extra.threshold
    if rule.moving_threshold:
        threshold = merges.moved_threshold(threshold, cos_t)
        do = do & (cos_t >= threshold[:, None])
    gives = member & do[:, :, None]  # [R, k, N]: loser j merges into row i
    votes = extra.votes
    if rule.keeps_votes:
        keys, values, votes = _merge_keeping_output(rule, keys, values, gives, t, loser_idx, k_l, v_l, extra)
    elif rule.blends:
        norm_e = norm_t = None
        if rule.kind == merges.NEAREST:
            norm_e, norm_t = merges.feature_norm(v_l), _gathered(merges.feature_norm(values.astype(mx.float32)), t)
        share_in = _loser_shares(rule, cos_t, s_in, s_target, norm_e, norm_t)
        share_t = rule.target_share(scores)
        values = _received(values, gives, _weighted_mean(values, gives, share_in, share_t, v_l))
        if cfg.merge_keys:
            keys = _received(keys, gives, _weighted_mean(keys, gives, share_in, share_t, k_l))
    else:  # additive: each target of W(e) gains V_e / |W(e)|
        values = _received(values, gives, values.astype(mx.float32) + _incoming(gives, 1.0) @ (v_l / width[:, :, None]))
    scores = scores + mx.where(gives, s_in[:, :, None], 0.0).sum(axis=1)
    return keys, values, scores, do.sum(axis=1).astype(mx.int32), votes, threshold


def _incoming(gives, share) -> mx.array:
    """[R, N, k] float32: what each row takes from each loser (share [R, k] or a float)."""
    if isinstance(share, mx.array):
        share = share[:, :, None]
    return mx.where(gives, share, 0.0).transpose(0, 2, 1)


def _weighted_mean(rows, gives, share_in, share_t, sources) -> mx.array:
    """Section 4.4's blend, float32 [R, N, D]: each row i becomes
    (A_i row_i + sum_e a_e source_e) / (A_i + sum_e a_e), computed as
    (1 - W_i) row_i + sum_e w_e source_e with D_i = A_i + sum_e a_e, w_e = a_e / D_i and
    W_i = (sum_e a_e) / D_i (so one loser gives (1 - w) V_t + w V_e); where D_i = 0 the row
    stays. rows [R, N, D]; gives [R, k, N]; share_in [R, k]; share_t [R, N] or a float;
    sources [R, k, D] float32."""
    incoming = _incoming(gives, share_in)
    taken = incoming.sum(axis=2)
    total = share_t + taken
    positive = total > 0
    safe = mx.where(positive, total, 1.0)
    weights = mx.where(positive[:, :, None], incoming / safe[:, :, None], 0.0)
    kept = 1.0 - mx.where(positive, taken / safe, 0.0)
    # A loser that gives nothing adds nothing, not even 0 * NaN (a poisoned key, which
    # has no nearest survivor) through the product.
    sources = mx.where(gives.any(axis=2)[:, :, None], sources, 0.0)
    return kept[:, :, None] * rows.astype(mx.float32) + weights @ sources


def _received(rows, gives, merged) -> mx.array:
    """rows with each row that takes a merge replaced by merged (float32), rounded once."""
    return mx.where(gives.any(axis=1)[:, :, None], merged.astype(rows.dtype), rows)


def _merge_keeping_output(rule, keys, values, gives, t, loser_idx, k_l, v_l, extra: _RuleState):
    """Section 4.6 (keepkv): every target t and its merging losers M_t become one row that
    gives the compression's query q the group's mass and attention-weighted value.
    Returns (keys, values, votes)."""
    q, scale, votes = extra.query, extra.scale, extra.votes
    k_f = keys.astype(mx.float32)
    logits = scale * (k_f * q[:, None, :]).sum(axis=-1)  # [R, N]
    l_e, c_e = _gathered(logits, loser_idx), _gathered(votes, loser_idx)
    poisoned_in = mx.where(gives, ~mx.isfinite(l_e)[:, :, None], False).any(axis=1)
    finite = mx.isfinite(logits) & ~poisoned_in
    top_in = mx.where(gives, l_e[:, :, None], -_INF).max(axis=1)
    top = mx.where(finite, mx.maximum(logits, top_in), 0.0)  # M over {t} and M_t
    # Each row's share of the query's attention, up to the group's common factor exp(-M);
    # a group with a non-finite logit falls back to the votes alone.
    m_t = votes * mx.where(finite, mx.exp(logits - top), 1.0)
    m_e = c_e * mx.where(_gathered(finite, t), mx.exp(l_e - _gathered(top, t)), 1.0)
    share_in = _loser_shares(rule, None, m_e, _gathered(m_t, t), None, None)
    share_t = rule.target_share(m_t)
    values = _received(values, gives, _weighted_mean(values, gives, share_in, share_t, v_l))
    mean_key = _weighted_mean(k_f, gives, share_in, share_t, k_l)
    total_mass = share_t + _incoming(gives, share_in).sum(axis=2)
    total_votes = votes + _incoming(gives, c_e).sum(axis=2)
    merged_key = merges.output_preserving_key(mean_key, q[:, None, :], scale, top, total_mass, total_votes, finite)
    return _received(keys, gives, merged_key), values, mx.where(gives.any(axis=1), total_votes, votes)


def _loser_shares(rule: merges.MergeRule, cos_t, s_in, s_target, norm_in, norm_target):
    """A blending rule's loser shares a_e (bench/merge_diagnostics.py records them here)."""
    return rule.loser_share(cos_t, s_in, s_target, norm_in, norm_target)


# (config, scale) -> its compiled compression merge; a model's layers share one entry.
_COMPILED_MERGES = CompiledSteps()


def _compiled_merge(cfg: CaMConfig, scale: float):
    """_merge_all for one configuration and attention scale under mx.compile: a few fused
    kernels rather than some hundred small MLX operations. The same arithmetic in the same
    order, float32 throughout; exact mode and chunks take the same compiled step (on a GPU,
    fused kernels round otherwise than separate ones, and a one-token chunk must equal
    exact mode, section 7)."""
    def build():
        def step(keys, values, scores, positions, survivor, loser_idx, row_ids, carried, fixed):
            extra = _RuleState(carried.get("votes"), carried.get("threshold"), fixed.get("query"), scale)
            keys, values, scores, did, votes, threshold = _merge_all(keys, values, scores, positions, survivor,
                                                                     loser_idx, row_ids, cfg, extra)
            return keys, values, scores, did, _carried(votes, threshold)
        return step

    return _COMPILED_MERGES.get((cfg, scale), build)


def _carried(votes, threshold) -> dict:
    """The rule state a compression reads and writes (the compiled step's `carried`)."""
    return {k: a for k, a in (("votes", votes), ("threshold", threshold)) if a is not None}


def _merge_compression(cfg: CaMConfig, scale: float, keys, values, scores, positions, survivor, loser_idx, row_ids,
                       extra: _RuleState):
    """One compression's merges through its compiled step: (keys, values, scores, merged
    [R] int32, votes, threshold)."""
    fixed = {} if extra.query is None else {"query": extra.query}
    keys, values, scores, did, carried = _compiled_merge(cfg, scale)(
        keys, values, scores, positions, survivor, loser_idx, row_ids, _carried(extra.votes, extra.threshold), fixed)
    return keys, values, scores, did, carried.get("votes"), carried.get("threshold")


def _gate(s_e, s_target, row_ids, p_e, cfg: CaMConfig) -> mx.array:
    """Section 4.3: merge or not, per loser (the draw keyed by its position p_e)."""
    if not cfg.gate:
        return mx.ones(s_e.shape, mx.bool_)
    return uniform(cfg.seed, row_ids, p_e) < probability(s_e, s_target)


# ----------------------------------------------------------------------------
# Section 7: one call


def _key_queries(new_keys: mx.array) -> mx.array:
    """Key scoring: each new key is the one query of its own token (G = 1)."""
    return new_keys[:, :, None, :]


def _prepare(new_keys, queries, scale):
    if queries is None:
        return _key_queries(new_keys).astype(mx.float32), 1.0 / math.sqrt(new_keys.shape[-1])
    if scale is None:
        raise ValueError("query scoring needs the model's attention scale")
    return queries.astype(mx.float32), float(scale)


def update(
    state: RowState,
    new_keys: mx.array,
    new_values: mx.array,
    offset: int,
    cfg: CaMConfig,
    row_ids: mx.array,
    queries: mx.array | None = None,
    scale: float | None = None,
) -> tuple[RowState, mx.array]:
    """Absorb S new tokens per row (docs/algorithm.md sections 2 to 7).

    new_keys [R, S, Dk], new_values [R, S, Dv] in the storage dtype; offset is the
    absolute position of the first new token; row_ids [R] uint32 are the rows'
    global indices for the gate's draws; queries [R, S, G, Dk] (query scoring) or
    None (key scoring, scale 1/sqrt(Dk)). Returns the new state and the number of
    merges per row [R] int32.
    """
    q, s = _prepare(new_keys, queries, scale)
    state = _with_rule_state(state, cfg)
    if cfg.prefill == "chunk":
        return _update_chunk(state, new_keys, new_values, offset, cfg, row_ids, q, s)
    merges = mx.zeros((new_keys.shape[0],), mx.int32)
    for t in range(new_keys.shape[1]):
        state, did = _update_one(
            state, new_keys[:, t], new_values[:, t], offset + t, cfg, row_ids, q[:, t], s
        )
        merges = merges + did.astype(mx.int32)
    return state, merges


def _with_rule_state(state: RowState, cfg: CaMConfig) -> RowState:
    """state with the arrays its merge rule keeps, made where missing: one vote per
    stored token, a threshold of NaN (no compression yet)."""
    rule = merges.rule(cfg.merge)
    rows, n = state.scores.shape
    if rule.keeps_votes and state.votes is None:
        state = state._replace(votes=mx.ones((rows, n), mx.float32))
    if rule.moving_threshold and state.threshold is None:
        state = state._replace(threshold=mx.full((rows,), float("nan"), mx.float32))
    return state


def _appended_votes(votes, s_len: int):
    """The stored rows' votes followed by one for each of s_len new tokens (None: no votes kept)."""
    if votes is None:
        return None
    return mx.concatenate([votes, mx.ones((votes.shape[0], s_len), mx.float32)], axis=1)


def chunk_mass(queries: mx.array, keys: mx.array, scale: float, n: int, cfg: CaMConfig,
               bias: mx.array | None = None, s_len: int | None = None) -> mx.array:
    """camkv.mass.chunk_mass of a chunk of s_len tokens after n stored rows, in one block
    of the reference's arithmetic. queries [R, T, G, Dk] are the chunk's last T (at
    least the queries that add mass; s_len defaults to T)."""
    s_len = queries.shape[1] if s_len is None else s_len
    return _mass.chunk_mass(queries.transpose(0, 2, 1, 3), keys, scale, n, cfg, s_len, _mass.EXACT_WHOLE,
                            bias=bias)


def _log_votes(votes):
    """Each row's attention bias, the log of its votes (section 4.6), or None."""
    return None if votes is None else mx.log(votes)


def _compression_state(state: RowState, votes, last_queries, scale, cfg: CaMConfig) -> _RuleState:
    """The rule state one compression merges with: the votes of its rows, the threshold
    before it and the mean of its last token's queries (last_queries [R, G, Dk])."""
    query = last_queries.mean(axis=1) if merges.rule(cfg.merge).keeps_votes else None
    return _RuleState(votes, state.threshold, query, scale)


def _update_one(state: RowState, k, v, p, cfg, row_ids, q, scale):
    """Exact mode, one token at position p: k [R, Dk], v [R, Dv], q [R, G, Dk]."""
    rows, n = k.shape[0], state.length
    keys = mx.concatenate([state.keys, k[:, None, :]], axis=1)
    values = mx.concatenate([state.values, v[:, None, :]], axis=1)
    votes = _appended_votes(state.votes, 1)
    mass = _attention_mass(q[:, None], keys.astype(mx.float32), scale, None, bias=_log_votes(votes))
    scores = mx.concatenate([state.scores, mx.zeros((rows, 1), mx.float32)], axis=1) + mass
    positions = mx.concatenate(
        [state.positions, mx.full((rows, 1), p, mx.int32)], axis=1
    )
    if n < cfg.budget:
        return RowState(keys, values, scores, positions, votes, state.threshold), mx.zeros((rows,), mx.bool_)

    e = _first_argmin(_ranked(scores, positions, p, cfg))
    idx = mx.arange(n + 1)[None, :]
    survivor = idx != e[:, None]
    extra = _compression_state(state, votes, q, scale, cfg)
    keys, values, scores, did, votes, threshold = _merge_compression(cfg, scale, keys, values, scores, positions,
                                                                     survivor, e[:, None], row_ids, extra)
    keep = mx.arange(n)[None, :] + (mx.arange(n)[None, :] >= e[:, None])
    return RowState(keys, values, scores, positions, votes, threshold).take(keep), did > 0


def _ranked(scores, positions, p_last: int, cfg) -> mx.array:
    """Eviction ranks (section 3): protected rows (sinks, and the recent window before
    p_last) +inf, else the score (a NaN score -inf: a poisoned token goes first), or
    with eviction="recency" the row index (the oldest goes first)."""
    protected = policy.protected(positions, p_last, cfg.n_sink, cfg.recent)
    return mx.where(protected, _INF, policy.eviction_ranks(scores, cfg))


def _chunk_losers(scores, positions, p_last, n_losers, cfg) -> mx.array:
    """The n_losers lowest-scoring candidates of each row ([R, N] bool); ties to smaller position."""
    ranked = _ranked(scores, positions, p_last, cfg)
    idx = mx.arange(scores.shape[1])
    before = (ranked[:, None, :] < ranked[:, :, None]) | (
        (ranked[:, None, :] == ranked[:, :, None]) & (idx[None, :] < idx[:, None])[None]
    )
    rank = before.sum(axis=2)
    return (rank < n_losers) & (ranked < _INF)


def _update_chunk(state: RowState, new_keys, new_values, offset, cfg, row_ids, q, scale):
    """Chunk mode: score all S tokens at once (with prefill_scoring="window" by the last
    observation_window queries, their mass max-pooled), then evict and merge once."""
    rows, s_len = new_keys.shape[:2]
    n = state.length
    total = n + s_len
    keys = mx.concatenate([state.keys, new_keys], axis=1)
    values = mx.concatenate([state.values, new_values], axis=1)
    votes = _appended_votes(state.votes, s_len)
    mass = chunk_mass(q, keys.astype(mx.float32), scale, n, cfg, bias=_log_votes(votes))
    scores = mx.concatenate([state.scores, mx.zeros((rows, s_len), mx.float32)], axis=1) + mass
    new_positions = mx.broadcast_to(offset + mx.arange(s_len, dtype=mx.int32), (rows, s_len))
    positions = mx.concatenate([state.positions, new_positions], axis=1)
    merges = mx.zeros((rows,), mx.int32)
    if total <= cfg.budget:
        return RowState(keys, values, scores, positions, votes, state.threshold), merges

    n_losers = total - cfg.budget
    loser = _chunk_losers(scores, positions, offset + s_len - 1, n_losers, cfg)
    idx = mx.arange(total)[None, :]
    # Loser indices in ascending position, then the survivors in position order.
    order = mx.argsort(mx.where(loser, idx, idx + total), axis=1)
    loser_idx, keep_idx = order[:, :n_losers], mx.sort(order[:, n_losers:], axis=1)
    survivor = ~loser
    extra = _compression_state(state, votes, q[:, -1], scale, cfg)
    keys, values, scores, merged, votes, threshold = _merge_compression(cfg, scale, keys, values, scores, positions,
                                                                        survivor, loser_idx, row_ids, extra)
    return RowState(keys, values, scores, positions, votes, threshold).take(keep_idx), merged
