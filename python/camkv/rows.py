"""RowState: the stored tokens of every row, as every backend takes and returns them."""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx


class RowState(NamedTuple):
    """Stored tokens of every row, oldest first. R = B * H rows, n tokens each."""

    keys: mx.array  # [R, n, Dk], storage dtype
    values: mx.array  # [R, n, Dv], storage dtype
    scores: mx.array  # [R, n] float32, accumulated attention mass
    positions: mx.array  # [R, n] int32, absolute positions, ascending
    # [R, n] float32 with CaMConfig.mass_bias, else None: log of the attention mass a
    # row stands for relative to its own (0 for a row nothing merged into), added to
    # its attention logits by the cache and the scoring alike.
    bias: mx.array | None = None

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
        """The arrays held: keys, values, scores, positions and the bias where there is one."""
        return tuple(a for a in self if a is not None)
