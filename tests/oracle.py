"""An independent, loop-by-loop NumPy reading of docs/algorithm.md sections 2-6 for one
token of one row, written without looking at the MLX reference, so each can catch
the other's mistakes."""

from __future__ import annotations

import numpy as np

from camkv import merges

M32 = 0xFFFFFFFF

# Each blending rule's weight (cosine, s_in, s_target), written again here in plain
# float arithmetic: the rules' kinds come from camkv.merges, their arithmetic does not.
WEIGHTS = {
    "sim_weighted": lambda cos, s_in, s_t: min(max(cos, 0.0), 1.0),
    "mean": lambda cos, s_in, s_t: 0.5,
    "mass_weighted": lambda cos, s_in, s_t: s_in / (s_in + s_t) if s_in + s_t > 0 else 0.0,
    "window_mass": lambda cos, s_in, s_t: s_in / (s_in + s_t) if s_in + s_t > 0 else 0.0,
}


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


def step(K, V, S, P, k, v, p, q, scale, cfg, row):
    """One exact-mode token for one row. Arrays are float32 NumPy; returns (K, V, S, P, merged)."""
    n = len(P)
    K, V = np.vstack([K, k[None]]), np.vstack([V, v[None]])
    mass = np.zeros(n + 1, np.float32)
    for query in q:
        logits = (scale * (K @ query)).astype(np.float32)
        e = np.exp(logits - logits.max())
        mass += (e / e.sum()).astype(np.float32) / len(q)
    S = np.append(S, np.float32(0)) + mass
    P = np.append(P, p)
    if n < cfg.budget:
        return K, V, S, P, False

    cands = [j for j in range(n + 1) if not (P[j] < cfg.n_sink or P[j] > p - cfg.recent)]
    recency = cfg.eviction == "recency"  # the oldest candidate goes, whatever its score
    loser = min(cands, key=lambda j: (P[j],) if recency else (S[j], P[j]))
    merged = False
    rule = merges.rule(cfg.merge)
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
        if merged and rule.kind == merges.WINDOW and not rule.blends:
            for j in W:
                V[j] = V[j] + V[loser] / len(W)
                S[j] += s_e / len(W)
        elif merged and rule.kind == merges.WINDOW:
            share = s_e / np.float32(len(W))
            for j in W:
                w = WEIGHTS[cfg.merge](None, share, S[j])
                V[j] = (1 - w) * V[j] + w * V[loser]
                S[j] += share
        elif merged:
            w = WEIGHTS[cfg.merge](best, s_e, S[t])
            V[t] = (1 - w) * V[t] + w * V[loser]
            if cfg.merge_keys:
                K[t] = (1 - w) * K[t] + w * K[loser]
            S[t] += s_e
    keep = [j for j in range(n + 1) if j != loser]
    return K[keep], V[keep], S[keep], P[keep], merged
