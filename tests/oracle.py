"""An independent, loop-by-loop NumPy reading of docs/algorithm.md sections 2-6 for one
token of one row, written without looking at the MLX reference, so each can catch
the other's mistakes."""

from __future__ import annotations

import numpy as np

from camkv import merges

M32 = 0xFFFFFFFF

# Each blending rule's weight (cosine, s_in, s_target, |V_e|, |V_t|), written again here
# in plain float arithmetic: the rules' kinds come from camkv.merges, their arithmetic
# does not. keepkv's is in _keep_output.
WEIGHTS = {
    "sim_weighted": lambda cos, s_in, s_t, n_e, n_t: min(max(cos, 0.0), 1.0),
    "mean": lambda cos, s_in, s_t, n_e, n_t: 0.5,
    "mass_weighted": lambda cos, s_in, s_t, n_e, n_t: s_in / (s_in + s_t) if s_in + s_t > 0 else 0.0,
    "window_mass": lambda cos, s_in, s_t, n_e, n_t: s_in / (s_in + s_t) if s_in + s_t > 0 else 0.0,
    # kvpress: V_t <- (V_t + w V_e) / (1 + w), w = clamp(cos) |V_e| / (|V_e| + |V_t|)
    "value_norm": lambda cos, s_in, s_t, n_e, n_t: _pooled(
        min(max(cos, 0.0), 1.0) * (n_e / (n_e + n_t) if n_e + n_t > 0 else 0.0)),
    # D2O: V_t <- (V_t + c V_e) / (1 + c), c = clamp(cos)
    "d2o": lambda cos, s_in, s_t, n_e, n_t: _pooled(min(max(cos, 0.0), 1.0)),
}
D2O_KEEP = 0.5  # share of D2O's threshold a compression keeps


def _pooled(w: float) -> float:
    """The blend weight of (V_t + w V_e) / (1 + w)."""
    return w / (1.0 + w)


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
            for j in W:
                w = WEIGHTS[cfg.merge](None, share, S[j], None, None)
                V[j] = (1 - w) * V[j] + w * V[loser]
                S[j] += share
        elif merged and rule.keeps_votes:
            _keep_output(K, V, votes, loser, t, q.mean(axis=0), scale)
            S[t] += s_e
        elif merged:
            w = WEIGHTS[cfg.merge](best, s_e, S[t], np.linalg.norm(V[loser]), np.linalg.norm(V[t]))
            V[t] = (1 - w) * V[t] + w * V[loser]
            if cfg.merge_keys:
                K[t] = (1 - w) * K[t] + w * K[loser]
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
