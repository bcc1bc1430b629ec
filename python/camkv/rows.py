"""RowState: the stored tokens of every row, the one record the cache and every backend pass."""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx


class RowState(NamedTuple):
    """Stored tokens of every row, oldest first. R = B * H rows, n tokens each.

    The last two fields are the state of the merge rules that carry one (camkv.merges:
    keeps_votes, moving_threshold); every other rule leaves them None and ignores them.
    """

    keys: mx.array  # [R, n, Dk], storage dtype
    values: mx.array  # [R, n, Dv], storage dtype
    scores: mx.array  # [R, n] float32, accumulated attention mass
    positions: mx.array  # [R, n] int32, absolute positions, ascending
    votes: mx.array | None = None  # [R, n] float32, the tokens each stored row stands for
    threshold: mx.array | None = None  # [R] float32, a row's moving similarity threshold; NaN before the first

    @classmethod
    def empty(cls, rows: int, k_dim: int, v_dim: int, dtype) -> "RowState":
        return cls(
            mx.zeros((rows, 0, k_dim), dtype),
            mx.zeros((rows, 0, v_dim), dtype),
            mx.zeros((rows, 0), mx.float32),
            mx.zeros((rows, 0), mx.int32),
        )

    @property
    def length(self) -> int:
        return self.keys.shape[1]

    def arrays(self) -> tuple:
        """The arrays held: keys, values, scores and positions, then votes and threshold
        where a rule keeps them."""
        return tuple(a for a in self if a is not None)

    def take(self, idx: mx.array) -> "RowState":
        """The rows idx [R, m] of every array, in that order (threshold, one per row, as is)."""
        return RowState(
            mx.take_along_axis(self.keys, idx[:, :, None], axis=1),
            mx.take_along_axis(self.values, idx[:, :, None], axis=1),
            mx.take_along_axis(self.scores, idx, axis=1),
            mx.take_along_axis(self.positions, idx, axis=1),
            None if self.votes is None else mx.take_along_axis(self.votes, idx, axis=1),
            self.threshold,
        )

    def first(self, n: int) -> "RowState":
        """The first n stored tokens of every row (threshold as is)."""
        return RowState(self.keys[:, :n], self.values[:, :n], self.scores[:, :n], self.positions[:, :n],
                        None if self.votes is None else self.votes[:, :n], self.threshold)
