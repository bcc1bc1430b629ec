"""The pure-MLX reference of docs/algorithm.md: the oracle every kernel is checked against.

A literal transcription, vectorised over rows (r = b * H + h): no Python loop over
batch or heads. Exact mode loops over the tokens of a call; chunk mode loops over
its losers (each merge must see the state the previous one left). Everything is
float32 arithmetic; keys and values are rounded to the storage dtype once per merge.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import NamedTuple

import mlx.core as mx

from . import mass as _mass, merges, policy
from .config import CaMConfig
# The mass arithmetic the kernels' prescoring shares lives in camkv.mass; the oracle
# reads it from there (tests read these names here too).
from .mass import _tf32_high, attention_mass as _attention_mass, attention_mass_causal  # noqa: F401
from .mass import float32_product as _float32_product  # noqa: F401
from .rows import RowState

_GOLDEN = 0x9E3779B9
_MIX_MUL_1 = 0x7FEB352D
_MIX_MUL_2 = 0x846CA68B
_INF = float("inf")
_D2O_KEEP = 0.5  # share of D2O's threshold kept at each compression (its alpha; the new mean gets 1 - alpha)


# ----------------------------------------------------------------------------
# Section 6: deterministic draws


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


def uniform(seed, row, position) -> mx.array:
    """The gate's draw in [0, 1): (h >> 8) * 2^-24 as float32."""
    return (gate_hash(seed, row, position) >> 8).astype(mx.float32) * (2.0**-24)


# ----------------------------------------------------------------------------
# Small vectorised helpers (all over a row axis 0)


def _first_argmin(x: mx.array) -> mx.array:
    """Index of the smallest entry of each row; ties go to the smaller index."""
    idx = mx.arange(x.shape[-1])
    lowest = mx.min(x, axis=-1, keepdims=True)
    return mx.min(mx.where(x == lowest, idx, x.shape[-1]), axis=-1)


def _first_argmax(x: mx.array) -> mx.array:
    return _first_argmin(-x)


def _take_rows(x: mx.array, idx: mx.array) -> mx.array:
    """x[r, idx[r]] for x [R, N] or [R, N, D]; idx [R]."""
    if x.ndim == 2:
        return mx.take_along_axis(x, idx[:, None], axis=1)[:, 0]
    return mx.take_along_axis(x, idx[:, None, None], axis=1)[:, 0, :]


# ----------------------------------------------------------------------------
# Sections 4.1-4.4: one merge of loser e into the survivors, for every row


def _blend_rows(rows: mx.array, target_mask: mx.array, source: mx.array, weight, do: mx.array):
    """rows [R, N, D] storage dtype; replace each masked row by (1 - w) row + w source.

    weight: a float, one weight per row [R], or one per stored token [R, N].
    """
    f = rows.astype(mx.float32)
    w = weight
    if isinstance(weight, mx.array):
        w = weight[:, None, None] if weight.ndim == 1 else weight[:, :, None]
    blended = ((1.0 - w) * f + w * source[:, None, :]).astype(rows.dtype)
    return mx.where((target_mask & do[:, None])[:, :, None], blended, rows)


class _RuleState(NamedTuple):
    """What the rules that carry state (camkv.merges) need in one compression; None where
    the rule keeps none."""

    votes: mx.array | None  # [R, N] float32: the tokens each row stands for (keeps_votes)
    threshold: mx.array | None  # [R] float32: moved for this compression (moving_threshold)
    query: mx.array | None  # [R, Dk] float32: the compression's last token's mean query (keeps_votes)
    scale: float  # the attention scale of that query


_NO_RULE_STATE = _RuleState(None, None, None, 1.0)


def _nearest(keys, positions, survivor, e, cfg: CaMConfig):
    """Section 4.1: each row's non-sink survivor t most similar to loser e (index [R]).
    Returns t [R], cos(K_e, K_t) [R] and K_e [R, Dk] float32."""
    k_e = _take_rows(keys, e).astype(mx.float32)
    k_f = keys.astype(mx.float32)
    dots = (k_f @ k_e[:, :, None])[:, :, 0]
    norms = mx.sqrt((k_f * k_f).sum(axis=-1)) * mx.sqrt((k_e * k_e).sum(axis=-1))[:, None]
    cos = dots / mx.maximum(norms, 1e-12)
    eligible = survivor & (positions >= cfg.n_sink)
    t = _first_argmax(mx.where(eligible, cos, -_INF))
    return t, _take_rows(cos, t), k_e


def _norm(x: mx.array) -> mx.array:
    """L2 norm of each row of x [R, D] float32, summed in feature order as the kernels do."""
    return mx.sqrt((x * x).sum(axis=-1))


def _merge_one(
    keys, values, scores, positions, survivor, e, row_ids, cfg: CaMConfig, extra: _RuleState = _NO_RULE_STATE
):
    """Merge loser e (index [R]) into the survivors, returning updated arrays and the gate outcome.

    keys [R, N, Dk], values [R, N, Dv], scores [R, N] f32, positions [R, N] i32,
    survivor [R, N] bool (rows that may receive mass; excludes e); extra: the rule's state.
    Returns (keys, values, scores, merged [R] bool, votes [R, N] or None).
    """
    rule = merges.rule(cfg.merge)
    if rule.kind == merges.DROP:
        return keys, values, scores, mx.zeros((keys.shape[0],), mx.bool_), extra.votes
    idx = mx.arange(keys.shape[1])[None, :]
    s_e = _take_rows(scores, e)
    v_e = _take_rows(values, e).astype(mx.float32)
    norm_e = norm_t = None
    if rule.kind == merges.WINDOW:
        after = survivor & (idx > e[:, None])
        targets = after & (mx.cumsum(after.astype(mx.int32), axis=1) <= cfg.window)
        width = targets.sum(axis=1).astype(mx.float32)
        s_target = mx.where(targets, scores, 0.0).sum(axis=1) / width
        s_in = (s_e / width)[:, None]  # each target's share
        cos_t, s_t = None, scores  # each target's weight: its own mass against its share
    else:
        t, cos_t, k_e = _nearest(keys, positions, survivor, e, cfg)
        s_target = _take_rows(scores, t)
        targets = idx == t[:, None]
        s_in, s_t = s_e[:, None], s_target[:, None]
        norm_e, norm_t = _norm(v_e), _norm(_take_rows(values, t).astype(mx.float32))

    do = _gate(s_e, s_target, row_ids, _take_rows(positions, e), cfg)
    if rule.moving_threshold:
        do = do & (cos_t >= extra.threshold)
    votes = extra.votes
    if rule.keeps_votes:
        keys, values, votes = _merge_keeping_output(rule, keys, values, targets, t, e, k_e, v_e, do, extra)
    elif rule.blends:
        weight = _merge_weight(rule, cos_t, s_in, s_t, norm_e, norm_t)
        values = _blend_rows(values, targets, v_e, weight, do)
        if cfg.merge_keys:
            keys = _blend_rows(keys, targets, k_e, weight, do)
    else:  # additive: each target gains its share of the value
        summed = (values.astype(mx.float32) + (v_e / width[:, None])[:, None, :]).astype(values.dtype)
        values = mx.where((targets & do[:, None])[:, :, None], summed, values)
    scores = scores + mx.where(targets & do[:, None], s_in, 0.0)
    return keys, values, scores, do, votes


def _merge_keeping_output(rule, keys, values, targets, t, e, k_e, v_e, do, extra: _RuleState):
    """Section 4.6 (keepkv): merge e into t so that the mean query sees the same attention
    output. Returns (keys, values, votes)."""
    q, scale = extra.query, extra.scale
    k_t = _take_rows(keys, t).astype(mx.float32)
    c_e, c_t = _take_rows(extra.votes, e), _take_rows(extra.votes, t)
    logit_e, logit_t = scale * (k_e * q).sum(axis=-1), scale * (k_t * q).sum(axis=-1)
    finite = mx.isfinite(logit_e) & mx.isfinite(logit_t)
    top = mx.where(finite, mx.maximum(logit_e, logit_t), 0.0)
    # Each row's share of the query's attention, up to the common factor exp(-top); a
    # query with a non-finite logit falls back to the votes alone.
    m_e = c_e * mx.where(finite, mx.exp(logit_e - top), 1.0)
    m_t = c_t * mx.where(finite, mx.exp(logit_t - top), 1.0)
    w = _merge_weight(rule, None, m_e, m_t, None, None)
    values = _blend_rows(values, targets, v_e, w, do)
    mean_key = (1.0 - w)[:, None] * k_t + w[:, None] * k_e
    # The merged row (c_e + c_t votes) must get the pair's mass: its logit is
    # log((m_e + m_t) / (c_e + c_t)) + top. The key moves along q, the least change that does it.
    want = top + mx.log(m_e + m_t) - mx.log(c_e + c_t)
    shift = (want - scale * (mean_key * q).sum(axis=-1)) / (scale * (q * q).sum(axis=-1))
    shift = mx.where(finite & mx.isfinite(shift), shift, 0.0)
    merged_key = (mean_key + shift[:, None] * q).astype(keys.dtype)
    receive = targets & do[:, None]
    keys = mx.where(receive[:, :, None], merged_key[:, None, :], keys)
    return keys, values, extra.votes + mx.where(receive, c_e[:, None], 0.0)


# (config, scale) -> its compiled merge step, the most recently used last. Bounded: a
# process that tries many configurations (a sweep, the tests) would otherwise keep every
# compiled graph; a model's layers share one entry.
_COMPILED_MERGES: OrderedDict = OrderedDict()
_COMPILED_MERGES_KEPT = 32


def _compiled_merge(cfg: CaMConfig, scale: float):
    """_merge_one for one configuration and attention scale under mx.compile: a chunk's
    merges run one after another (each sees the state the previous one left), and
    compiled, each is a few fused kernels rather than some sixty small MLX operations
    (keepkv's prefill on SmolLM2-135M: most of its time). The same arithmetic in the
    same order, float32 throughout."""
    key = (cfg, scale)
    if key not in _COMPILED_MERGES:
        def step(keys, values, scores, positions, survivor, e, row_ids, carried, fixed):
            extra = _RuleState(carried.get("votes"), fixed.get("threshold"), fixed.get("query"), scale)
            keys, values, scores, did, votes = _merge_one(keys, values, scores, positions, survivor, e,
                                                          row_ids, cfg, extra)
            return keys, values, scores, did, ({"votes": votes} if votes is not None else {})

        _COMPILED_MERGES[key] = mx.compile(step)
        if len(_COMPILED_MERGES) > _COMPILED_MERGES_KEPT:
            _COMPILED_MERGES.popitem(last=False)
    _COMPILED_MERGES.move_to_end(key)
    return _COMPILED_MERGES[key]


def _merge_by(step, keys, values, scores, positions, survivor, e, row_ids, votes, fixed):
    """One merge through a compiled step of _compiled_merge: (keys, values, scores, did,
    votes), votes None for a rule that keeps none."""
    carried = {"votes": votes} if votes is not None else {}
    keys, values, scores, did, carried = step(keys, values, scores, positions, survivor, e, row_ids, carried, fixed)
    return keys, values, scores, did, carried.get("votes")


def _fixed_state(extra) -> dict:
    """What a compression's merges read but never change (the compiled step's `fixed`)."""
    return {k: a for k, a in (("threshold", extra.threshold), ("query", extra.query)) if a is not None}


def _merge_weight(rule: merges.MergeRule, cos_t, s_in, s_target, norm_in, norm_target):
    """A blending rule's weight (bench/merge_diagnostics.py records the weights here)."""
    return rule.weight(cos_t, s_in, s_target, norm_in, norm_target)



def _gate(s_e, s_target, row_ids, p_e, cfg: CaMConfig) -> mx.array:
    """Section 4.3: merge or not, per row."""
    if not cfg.gate:
        return mx.ones((s_e.shape[0],), mx.bool_)
    ratio = mx.clip(s_e / mx.where(s_target > 0, s_target, 1.0), 0.0, 1.0)
    fallback = mx.where(s_e > 0, 1.0, 0.0)
    probability = mx.where(s_target > 0, ratio, fallback)
    return uniform(cfg.seed, row_ids, p_e) < probability


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


def _compression_state(state: RowState, votes, keys, positions, survivor, loser_idx, last_queries, scale,
                       cfg: CaMConfig) -> _RuleState:
    """The rule state one compression merges with: the threshold moved by its losers
    (loser_idx [R, L], the survivors as they are before any merge) and the mean of its
    last token's queries (last_queries [R, G, Dk])."""
    rule = merges.rule(cfg.merge)
    threshold = state.threshold
    if rule.moving_threshold:
        threshold = _moved_threshold(threshold, keys, positions, survivor, loser_idx, cfg)
    query = last_queries.mean(axis=1) if rule.keeps_votes else None
    return _RuleState(votes, threshold, query, scale)


def _moved_threshold(threshold, keys, positions, survivor, loser_idx, cfg: CaMConfig):
    """Section 4.5 (d2o): tau <- m at a row's first compression, else
    _D2O_KEEP tau + (1 - _D2O_KEEP) m, with m the mean over the losers of the cosine to
    their nearest survivor. Non-finite cosines are left out; a row with none keeps tau."""
    cosines = mx.stack([_nearest(keys, positions, survivor, loser_idx[:, j], cfg)[1]
                        for j in range(loser_idx.shape[1])], axis=1)
    finite = mx.isfinite(cosines)
    count = finite.sum(axis=1)
    mean = mx.where(finite, cosines, 0.0).sum(axis=1) / mx.maximum(count, 1).astype(mx.float32)
    moved = mx.where(mx.isnan(threshold), mean, _D2O_KEEP * threshold + (1.0 - _D2O_KEEP) * mean)
    return mx.where(count > 0, moved, threshold)


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
    extra = _compression_state(state, votes, keys, positions, survivor, e[:, None], q, scale, cfg)
    # Through the compiled step a chunk's merges take: on a GPU, fused kernels round
    # otherwise than separate ones, and a one-token chunk must equal exact mode (section 7).
    keys, values, scores, did, votes = _merge_by(_compiled_merge(cfg, scale), keys, values, scores, positions,
                                                 survivor, e, row_ids, votes, _fixed_state(extra))
    keep = mx.arange(n)[None, :] + (mx.arange(n)[None, :] >= e[:, None])
    return RowState(keys, values, scores, positions, votes, extra.threshold).take(keep), did


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
    extra = _compression_state(state, votes, keys, positions, survivor, loser_idx, q[:, -1], scale, cfg)
    merge_step, fixed = _compiled_merge(cfg, scale), _fixed_state(extra)
    for j in range(n_losers):
        keys, values, scores, did, votes = _merge_by(merge_step, keys, values, scores, positions, survivor,
                                                     loser_idx[:, j], row_ids, votes, fixed)
        merges = merges + did.astype(mx.int32)
    return RowState(keys, values, scores, positions, votes, extra.threshold).take(keep_idx), merges
