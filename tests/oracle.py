"""An independent, loop-by-loop NumPy reading of ALGORITHM.md sections 2-6 for one
token of one row, written without looking at the MLX reference, so each can catch
the other's mistakes."""

from __future__ import annotations

import numpy as np

M32 = 0xFFFFFFFF


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
    loser = min(cands, key=lambda j: (S[j], P[j]))
    merged = False
    if cfg.merge != "drop":
        if cfg.merge in ("window", "window_mass"):
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
        if merged and cfg.merge == "window":
            for j in W:
                V[j] = V[j] + V[loser] / len(W)
                S[j] += s_e / len(W)
        elif merged and cfg.merge == "window_mass":
            share = s_e / np.float32(len(W))
            for j in W:
                # (s_j V_j + share V_e) / (s_j + share), written as that weighted mean
                if S[j] + share > 0:
                    V[j] = (S[j] * V[j] + share * V[loser]) / (S[j] + share)
                S[j] += share
        elif merged:
            if cfg.merge == "sim_weighted":
                w = min(max(best, 0.0), 1.0)
            elif cfg.merge == "mass_weighted":
                w = s_e / (s_e + S[t]) if s_e + S[t] > 0 else 0.0
            else:
                w = 0.5
            V[t] = (1 - w) * V[t] + w * V[loser]
            if cfg.merge_keys:
                K[t] = (1 - w) * K[t] + w * K[loser]
            S[t] += s_e
    keep = [j for j in range(n + 1) if j != loser]
    return K[keep], V[keep], S[keep], P[keep], merged
