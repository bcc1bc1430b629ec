"""An independent, loop-by-loop NumPy reading of docs/algorithm.md sections 2-7 for one
row (one token in exact mode: step; one chunk call with its simultaneous merges: chunk),
written without looking at the MLX reference, so each can catch the other's mistakes."""

from __future__ import annotations

import numpy as np

from camkv import merges

M32 = 0xFFFFFFFF

# Each blending rule's shares, written again here in plain float arithmetic: the target's
# A(s_t) and each loser's a(cos, s_in, |V_e|, |V_t|) (docs/algorithm.md section 4.4; the
# rules' kinds come from camkv.merges, their arithmetic does not). A target t and its
# merging losers become (A V_t + sum a_e V_e) / (A + sum a_e). keepkv's are the query's
# masses (_keep_output).
_ONE = lambda s_t: 1.0  # noqa: E731
_CAP = 1.0 - 2.0**-12
SHARES = {
    "sim_weighted": (_ONE, lambda cos, s_in, n_e, n_t: min(max(cos, 0.0), _CAP) / (1.0 - min(max(cos, 0.0), _CAP))),
    "mean": (_ONE, lambda cos, s_in, n_e, n_t: 1.0),
    "mass_weighted": (lambda s_t: s_t, lambda cos, s_in, n_e, n_t: s_in),
    "window_mass": (lambda s_t: s_t, lambda cos, s_in, n_e, n_t: s_in),
    # kvpress: V_t <- (V_t + sum u V_e) / (1 + sum u), u = clamp(cos) |V_e| / (|V_e| + |V_t|)
    "value_norm": (_ONE, lambda cos, s_in, n_e, n_t: min(max(cos, 0.0), 1.0) * (n_e / (n_e + n_t) if n_e + n_t > 0
                                                                               else 0.0)),
    # D2O: V_t <- (V_t + sum c V_e) / (1 + sum c), c = clamp(cos)
    "d2o": (_ONE, lambda cos, s_in, n_e, n_t: min(max(cos, 0.0), 1.0)),
}
D2O_KEEP = 0.5  # share of D2O's threshold a compression keeps


def _weighted_mean(row, own_share, incoming):
    """(A row + sum a_e x_e) / (A + sum a_e) for incoming [(a_e, x_e)]; row itself where the
    denominator is 0."""
    total = own_share + sum(a for a, _ in incoming)
    if total <= 0:
        return row
    return (own_share * row + sum(a * x for a, x in incoming)) / total


def mix(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    x ^= x >> 16
    return x


def draw(seed: int, row: int, position: int) -> float:
    h = mix(mix(mix((position ^ 0x9E3779B9) & M32) ^ row) ^ seed)
    return float(np.float32((h >> 8) * 2.0**-24))


def step(K, V, S, P, k, v, p, q, scale, cfg, row, rule_state=None):
    """One exact-mode token for one row. Arrays are float32 NumPy; returns (K, V, S, P, merged).

    rule_state: a dict the rules that carry state read and update in place: "votes"
    (keepkv: one per stored token) and "threshold" (d2o; absent before the first eviction).
    """
    rule = merges.rule(cfg.merge)
    state = {} if rule_state is None else rule_state
    n = len(P)
    K, V = np.vstack([K, k[None]]), np.vstack([V, v[None]])
    votes = np.append(state.get("votes", np.ones(n, np.float32)), np.float32(1))
    mass = np.zeros(n + 1, np.float32)
    for query in q:
        logits = (scale * (K @ query)).astype(np.float32)
        if rule.keeps_votes:  # a row standing for c tokens weighs c times
            logits = logits + np.log(votes)
        e = np.exp(logits - logits.max())
        mass += (e / e.sum()).astype(np.float32) / len(q)
    S = np.append(S, np.float32(0)) + mass
    P = np.append(P, p)
    if rule.keeps_votes:
        state["votes"] = votes
    if n < cfg.budget:
        return K, V, S, P, False

    cands = [j for j in range(n + 1) if not (P[j] < cfg.n_sink or P[j] > p - cfg.recent)]
    recency = cfg.eviction == "recency"  # the oldest candidate goes, whatever its score
    loser = min(cands, key=lambda j: (P[j],) if recency else (S[j], P[j]))
    merged = False
    if rule.kind != merges.DROP:
        if rule.kind == merges.WINDOW:
            W = [j for j in range(n + 1) if j > loser][: cfg.window]
            s_t = np.float32(np.mean(S[W]))
        else:
            best, t = -np.inf, None
            for j in range(n + 1):
                if j == loser or P[j] < cfg.n_sink:
                    continue
                denom = max(np.linalg.norm(K[loser]) * np.linalg.norm(K[j]), 1e-12)
                c = float(K[loser] @ K[j]) / denom
                if c > best:
                    best, t = c, j
            s_t = S[t]
        s_e = S[loser]
        if s_t > 0:
            prob = min(max(s_e / s_t, 0.0), 1.0)
        else:
            prob = 1.0 if s_e > 0 else 0.0
        merged = (draw(cfg.seed, row, int(P[loser])) < prob) if cfg.gate else True
        if rule.moving_threshold:  # one loser: the mean of its compression's cosines is its own
            if np.isfinite(best):
                old = state.get("threshold", np.nan)
                state["threshold"] = best if np.isnan(old) else D2O_KEEP * old + (1 - D2O_KEEP) * best
            merged = merged and best >= state.get("threshold", np.nan)
        if merged and rule.kind == merges.WINDOW and not rule.blends:
            for j in W:
                V[j] = V[j] + V[loser] / len(W)
                S[j] += s_e / len(W)
        elif merged and rule.kind == merges.WINDOW:
            share = s_e / np.float32(len(W))
            own, loser_share = SHARES[cfg.merge]
            for j in W:
                V[j] = _weighted_mean(V[j], own(S[j]), [(loser_share(None, share, None, None), V[loser])])
                S[j] += share
        elif merged and rule.keeps_votes:
            _keep_output(K, V, votes, loser, t, q.mean(axis=0), scale)
            S[t] += s_e
        elif merged:
            own, loser_share = SHARES[cfg.merge]
            a = loser_share(best, s_e, np.linalg.norm(V[loser]), np.linalg.norm(V[t]))
            V[t] = _weighted_mean(V[t], own(S[t]), [(a, V[loser])])
            if cfg.merge_keys:
                K[t] = _weighted_mean(K[t], own(S[t]), [(a, K[loser])])
            S[t] += s_e
    keep = [j for j in range(n + 1) if j != loser]
    if rule.keeps_votes:
        state["votes"] = votes[keep]
    return K[keep], V[keep], S[keep], P[keep], merged


def _keep_output(K, V, votes, e, t, query, scale):
    """keepkv, in place: row t becomes one row for rows e and t with their votes, and the
    attention output of `query` over all rows (each weighed by its votes) stays the same."""
    logit_e, logit_t = scale * float(K[e] @ query), scale * float(K[t] @ query)
    top = max(logit_e, logit_t)
    mass_e, mass_t = votes[e] * np.exp(logit_e - top), votes[t] * np.exp(logit_t - top)
    w = mass_e / (mass_e + mass_t)
    V[t] = (1 - w) * V[t] + w * V[e]
    mean_key = (1 - w) * K[t] + w * K[e]
    # exp(logit of the merged row) * (votes_e + votes_t) = the pair's mass
    want = top + np.log(mass_e + mass_t) - np.log(votes[e] + votes[t])
    K[t] = mean_key + (want - scale * float(mean_key @ query)) / (scale * float(query @ query)) * query
    votes[t] += votes[e]


def _cosine(a, b) -> float:
    return float(a @ b) / max(float(np.linalg.norm(a)) * float(np.linalg.norm(b)), 1e-12)


def chunk(K, V, S, P, new_K, new_V, p0, Q, scale, cfg, row, rule_state=None):
    """One chunk call of section 7 for one row, scored causally by every chunk query
    (prefill_scoring "causal"), its merges simultaneous: every loser picks its target(s)
    among the survivors as they stand before any merge, and every target takes all of
    its merging losers at once (section 4.4). Q [S, G, Dk]. Returns (K, V, S, P, merges)."""
    rule = merges.rule(cfg.merge)
    state = {} if rule_state is None else rule_state
    n, s_len = len(P), len(new_K)
    K, V = np.vstack([K, new_K]), np.vstack([V, new_V])
    P = np.append(P, np.arange(p0, p0 + s_len))
    votes = np.append(state.get("votes", np.ones(n, np.float32)), np.ones(s_len, np.float32))
    S = np.append(S, np.zeros(s_len, np.float32))
    for i in range(s_len):  # chunk token i scores the rows up to itself
        for query in Q[i]:
            logits = (scale * (K[:n + i + 1] @ query)).astype(np.float32)
            if rule.keeps_votes:
                logits = logits + np.log(votes[:n + i + 1])
            e = np.exp(logits - logits.max())
            S[:n + i + 1] += (e / e.sum()).astype(np.float32) / len(Q[i])
    if rule.keeps_votes:
        state["votes"] = votes
    total = n + s_len
    if total <= cfg.budget:
        return K, V, S, P, 0
    p_last = p0 + s_len - 1
    cands = [j for j in range(total) if not (P[j] < cfg.n_sink or P[j] > p_last - cfg.recent)]
    recency = cfg.eviction == "recency"
    losers = sorted(sorted(cands, key=lambda j: (P[j],) if recency else (S[j], P[j]))[:total - cfg.budget])
    survivors = [j for j in range(total) if j not in losers]
    merged = 0
    if rule.kind != merges.DROP:
        merged = _merge_simultaneously(K, V, S, P, votes, losers, survivors, Q[-1].mean(axis=0), scale, cfg, row,
                                       state)
    if rule.keeps_votes:
        state["votes"] = votes[survivors]
    return K[survivors], V[survivors], S[survivors], P[survivors], merged


def _merge_simultaneously(K, V, S, P, votes, losers, survivors, query, scale, cfg, row, state):
    """Sections 4.1-4.6 for one compression, in place: returns the number of losers merged."""
    rule = merges.rule(cfg.merge)
    targets, cosines, s_target = {}, {}, {}
    for e in losers:  # targets against the state before any merge
        if rule.kind == merges.WINDOW:
            targets[e] = [j for j in survivors if j > e][: cfg.window]
            s_target[e] = float(np.mean(S[targets[e]]))
        else:
            best, t = -np.inf, None
            for j in survivors:
                if P[j] >= cfg.n_sink and _cosine(K[e], K[j]) > best:
                    best, t = _cosine(K[e], K[j]), j
            # No finite cosine (a poisoned key): no target, it merges nowhere.
            targets[e], cosines[e], s_target[e] = ([], best, 0.0) if t is None else ([t], best, S[t])
    passing = []
    if rule.moving_threshold:
        finite = [c for c in cosines.values() if np.isfinite(c)]
        if finite:
            old = state.get("threshold", np.nan)
            m = float(np.mean(finite))
            state["threshold"] = m if np.isnan(old) else D2O_KEEP * old + (1 - D2O_KEEP) * m
    for e in losers:
        s_e, s_t = S[e], s_target[e]
        prob = min(max(s_e / s_t, 0.0), 1.0) if s_t > 0 else (1.0 if s_e > 0 else 0.0)
        ok = (draw(cfg.seed, row, int(P[e])) < prob) if cfg.gate else True
        if rule.moving_threshold:
            ok = ok and cosines[e] >= state.get("threshold", np.nan)
        if ok and targets[e]:
            passing.append(e)
    before_V, before_K, before_S = V.copy(), K.copy(), S.copy()
    for j in survivors:
        into = [e for e in passing if j in targets[e]]
        if not into:
            continue
        shares_in = [before_S[e] / len(targets[e]) for e in into]
        if rule.keeps_votes:
            _keep_output_group(K, V, votes, before_K, before_V, j, into, query, scale)
        elif rule.kind == merges.WINDOW and not rule.blends:
            V[j] = before_V[j] + sum(before_V[e] / len(targets[e]) for e in into)
        else:
            own, loser_share = SHARES[cfg.merge]
            a = [loser_share(cosines.get(e), s, np.linalg.norm(before_V[e]), np.linalg.norm(before_V[j]))
                 for e, s in zip(into, shares_in)]
            V[j] = _weighted_mean(before_V[j], own(before_S[j]), list(zip(a, before_V[into])))
            if cfg.merge_keys:
                K[j] = _weighted_mean(before_K[j], own(before_S[j]), list(zip(a, before_K[into])))
        S[j] = before_S[j] + sum(shares_in)
    return len(passing)


def _keep_output_group(K, V, votes, before_K, before_V, t, into, query, scale):
    """keepkv for a target t and its merging losers, in place (section 4.6)."""
    group = [t] + into
    logit = {i: scale * float(before_K[i] @ query) for i in group}
    c = {i: float(votes[i]) for i in group}
    if all(np.isfinite(v) for v in logit.values()):
        top = max(logit.values())
        m = {i: c[i] * np.exp(logit[i] - top) for i in group}
    else:
        top, m = None, c
    total_m, total_c = sum(m.values()), sum(c.values())
    V[t] = sum(m[i] * before_V[i] for i in group) / total_m
    mean_key = sum(m[i] * before_K[i] for i in group) / total_m
    K[t] = mean_key
    if top is not None:
        want = top + np.log(total_m) - np.log(total_c)
        K[t] = mean_key + (want - scale * float(mean_key @ query)) / (scale * float(query @ query)) * query
    votes[t] = total_c
