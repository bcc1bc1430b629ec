"""The bytes a CaMKVCache's rows take: held now (nbytes) and at most between calls
(bytes_bound, what the server's memory bound sums). Quantized rows count their codes,
scales and biases, a tier its own rows (docs/algorithm.md sections 12 and 13); layout
is the cache's (B, H, Dk, Dv, dtype), None while it is empty."""

from __future__ import annotations

from .quantized import row_bytes


def stored_row(layout: tuple, cfg) -> int:
    """Bytes one stored row (a token of one KV head) takes: key, value, score, position."""
    _, _, Dk, Dv, dtype = layout
    return row_bytes(Dk, Dv, dtype.size, cfg.bits, cfg.group_size)


def held(layout: tuple | None, cfg, rows, tier) -> int:
    """Bytes of the rows held (a camkv.buffers.RowBuffers, a camkv.tier.Tier or None):
    keys, values, scores and positions (the pending rows' scores counted as the float32
    each will take), a rule's votes and threshold, the tier's rows."""
    if layout is None:
        return 0
    B, H = layout[:2]
    rule_state = (4 * rows.held if rows.votes is not None else 0) + (4 if rows.threshold is not None else 0)
    return B * H * (rows.held * stored_row(layout, cfg) + rule_state) + (0 if tier is None else tier.nbytes)


def bound(layout: tuple | None, cfg) -> int:
    """Most bytes the rows may hold between calls: budget + slack main rows and
    tier_budget tier rows a head (0 while empty)."""
    if layout is None:
        return 0
    B, H, Dk, Dv, dtype = layout
    tier_rows = cfg.tier_budget * row_bytes(Dk, Dv, dtype.size, cfg.tier_bits, cfg.group_size)
    return B * H * ((cfg.budget + cfg.slack) * stored_row(layout, cfg) + tier_rows)
