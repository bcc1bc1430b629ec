"""The low-precision tier (CaMConfig.tier_budget, tier_bits): evicted rows kept coarsely.

MiKV's idea with camkv's scores: the rows a compression evicts from the main rows are
not dropped but move into a second pool of at most tier_budget rows a head, quantized to
tier_bits (2, 3 or 4; MLX's affine quantization, groups of group_size channels); when
the pool is over tier_budget its lowest-scored rows are dropped (docs/algorithm.md
section 13). Attention reads the pool's rows dequantized before the main rows.
"""

from __future__ import annotations

import mlx.core as mx

from .quantized import dequantize, quantize, survivor_sources


def losers(before_positions: mx.array, after_positions: mx.array) -> mx.array:
    """int32 [R, n - m]: the indices, ascending, of the rows of before [R, n] that a
    compression did not keep (after [R, m], a subset, as survivor_sources takes them)."""
    n, m = before_positions.shape[1], after_positions.shape[1]
    R = before_positions.shape[0]
    kept = mx.zeros((R, n), mx.bool_)
    kept = mx.put_along_axis(kept, survivor_sources(before_positions, after_positions), mx.array(True), axis=1)
    index = mx.broadcast_to(mx.arange(n, dtype=mx.int32), (R, n))
    return mx.sort(mx.where(kept, n, index), axis=1)[:, : n - m]


def of_config(cfg) -> "Tier | None":
    """The tier of a cache of config cfg: tier_budget > 0 keeps one (None without)."""
    return Tier(cfg.tier_budget, cfg.tier_bits, cfg.group_size) if cfg.tier_budget else None


def _rows(a: mx.array, idx: mx.array) -> mx.array:
    """Rows idx [R, m] of a [R, n, ...] (an index per row)."""
    return mx.take_along_axis(a, idx.reshape(*idx.shape, *([1] * (a.ndim - 2))), axis=1)


class Tier:
    """Evicted rows of one cache: codes, scales and biases of keys and values [R, t, w]
    (R = B * H), their scores and positions [R, t], ascending by position."""

    def __init__(self, budget: int, bits: int, group_size: int):
        self.budget, self.bits, self.group_size = budget, bits, group_size
        self.keys: tuple | None = None
        self.values: tuple | None = None
        self.scores: mx.array | None = None
        self.positions: mx.array | None = None

    @property
    def size(self) -> int:
        return 0 if self.scores is None else self.scores.shape[1]

    def absorb(self, keys: mx.array, values: mx.array, scores: mx.array, positions: mx.array) -> None:
        """Take evicted rows (keys, values [R, l, D] in the model's dtype, scores, positions
        [R, l]), quantized once; past the budget, keep the best-scored rows (the newer of
        two alike), in position order."""
        if keys.shape[1] == 0:
            return
        new = (quantize(keys, self.bits, self.group_size), quantize(values, self.bits, self.group_size),
               scores.astype(mx.float32), positions)
        if self.scores is None:
            joined = new
        else:
            joined = (tuple(mx.concatenate([a, b], axis=1) for a, b in zip(self.keys, new[0])),
                      tuple(mx.concatenate([a, b], axis=1) for a, b in zip(self.values, new[1])),
                      mx.concatenate([self.scores, new[2]], axis=1), mx.concatenate([self.positions, new[3]], axis=1))
        self.keys, self.values, self.scores, self.positions = joined
        self._in_position_order()
        keys_q, values_q, scores, positions = self.keys, self.values, self.scores, self.positions
        if scores.shape[1] > self.budget:
            # Best score first; of rows alike, the newer (the rows are in position order and
            # a stable sort of the reversed rows puts the later one first).
            t = scores.shape[1]
            order = t - 1 - mx.argsort(-scores[:, ::-1], axis=1)
            keep = mx.sort(order[:, : self.budget], axis=1)
            keys_q = tuple(_rows(a, keep) for a in keys_q)
            values_q = tuple(_rows(a, keep) for a in values_q)
            scores, positions = _rows(scores, keep), _rows(positions, keep)
        self.keys, self.values, self.scores, self.positions = keys_q, values_q, scores, positions

    def absorb_evicted(self, before, kept_positions: mx.array) -> None:
        """The rows of before (a RowState [R, n, ...] of the rows a compression took) whose
        position is not among kept_positions [R, m] (the survivors'), each with its score
        before the compression (0 for a token it scored first)."""
        lost = losers(before.positions, kept_positions)
        self.absorb(*(_rows(a, lost) for a in before[:4]))

    def _in_position_order(self) -> None:
        order = mx.argsort(self.positions, axis=1)
        self.keys = tuple(_rows(a, order) for a in self.keys)
        self.values = tuple(_rows(a, order) for a in self.values)
        self.scores, self.positions = _rows(self.scores, order), _rows(self.positions, order)

    def attended(self, B: int, H: int, dtype) -> tuple[mx.array, mx.array] | None:
        """The rows dequantized [B, H, t, D] in dtype, as attention reads them (None: empty)."""
        if self.scores is None:
            return None
        t = self.size
        return tuple(dequantize(q, self.bits, self.group_size).astype(dtype).reshape(B, H, t, -1)
                     for q in (self.keys, self.values))

    def rows(self, B: int, H: int, dtype) -> tuple:
        """(keys, values [B, H, t, D] dequantized in dtype, scores, positions [B, H, t])."""
        return *self.attended(B, H, dtype), *(a.reshape(B, H, -1) for a in (self.scores, self.positions))

    @property
    def nbytes(self) -> int:
        if self.scores is None:
            return 0
        return sum(a.nbytes for a in (*self.keys, *self.values, self.scores, self.positions))

    def state(self, B: int, H: int) -> tuple:
        """(keys triple, values triple, scores, positions) [B, H, t, ...] to save (Nones: empty)."""
        if self.scores is None:
            return (None, None, None, None)
        t = self.size
        shaped = lambda a: a.reshape(B, H, t, *a.shape[2:])
        return (tuple(shaped(a) for a in self.keys), tuple(shaped(a) for a in self.values),
                shaped(self.scores), shaped(self.positions))

    def load(self, keys, values, scores, positions) -> None:
        """Hold saved rows (state's items, triples as lists too), as they were."""
        if scores is None:
            return
        B, H, t = scores.shape
        flat = lambda a: a.reshape(B * H, t, *a.shape[3:])
        self.keys, self.values = tuple(flat(a) for a in keys), tuple(flat(a) for a in values)
        self.scores, self.positions = flat(scores).astype(mx.float32), flat(positions).astype(mx.int32)

    def copy(self) -> "Tier":
        clone = Tier(self.budget, self.bits, self.group_size)
        if self.scores is not None:
            clone.keys = tuple(mx.array(a) for a in self.keys)
            clone.values = tuple(mx.array(a) for a in self.values)
            clone.scores, clone.positions = mx.array(self.scores), mx.array(self.positions)
        return clone
