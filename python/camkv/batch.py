"""BatchCaMKVCache: several requests' camkv caches batched through mlx-lm's batch protocol.

mlx-lm batches requests (batch_generate, BatchGenerator, the server's continuous
batching) by merging each request's cache into one batch cache (`merge`), feeding it
padded [B, ...] blocks, and taking rows out again (`extract`, `filter`, `extend`).
Its BatchKVCache keeps every token of every row, padding included.

This cache keeps one CaMKVCache (B = 1) per request instead, so each row is compressed
exactly as if its request ran alone (docs/batching.md):

- a block [B, H, S, D] is cut per row to that row's real tokens (the padding mlx-lm
  puts on the right of a prompt chunk, or on the left of a first block, is dropped),
  and each row's tokens go to its own cache;
- attention gets a left-padded rectangle of every row's held keys and values, with a
  mask (make_mask) that hides the padding and keeps each row causal;
- the queries the attention hook hands over (observe_queries) are cut the same way,
  so each row is scored by its own queries only;
- `offset` is each row's own token count, the RoPE position of its next real token.

A row's evictions depend only on its own tokens and queries and on how its tokens
were chunked, never on the other rows. Rows of different budgets may share a batch.
"""

from __future__ import annotations

import copy

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import _BaseCache

from .cache import CaMKVCache

_UNLIMITED = None  # a row's real-token count in the coming block: no right padding


class BatchCaMKVCache(_BaseCache):
    """A batch of requests, one CaMKVCache a row (see the module docstring).

    left_padding: padding tokens that come before each row's first real token in the
    next block, as in mlx-lm's BatchKVCache(left_padding). Those are never held.
    """

    def __init__(self, rows: list[CaMKVCache], left_padding: list[int] | None = None):
        self.rows = list(rows)
        for row in self.rows:
            _check_row(row)
        B = len(self.rows)
        self._left = _padding_list(left_padding, B, "left_padding")
        self._lengths: list[int | None] = [_UNLIMITED] * B  # set by prepare(lengths=...)
        self._consumed = 0  # positions of the padded stream fed since prepare
        self._block: list[tuple[int, int]] | None = None  # last call's per-row real slices
        self._fetched: list[tuple[bool, int]] = []  # last call's rows: (took tokens, rows returned)

    # ------------------------------------------------------------------ batch protocol
    @classmethod
    def merge(cls, caches) -> "BatchCaMKVCache":
        """A batch of copies of the requests' caches (mlx-lm promises not to update the
        caches it is given in place, as BatchKVCache.merge copies them)."""
        caches = list(caches)
        for i, cache in enumerate(caches):
            if not isinstance(cache, CaMKVCache):
                raise ValueError(
                    f"request {i}'s cache is a {type(cache).__name__}; a batch of camkv caches "
                    "can only merge CaMKVCache layers (build every request's caches with "
                    "camkv.make_prompt_cache or a camkv.apply'd model)"
                )
        return cls([copy.deepcopy(c) for c in caches])

    def extract(self, idx: int) -> CaMKVCache:
        """Row idx as a request's own CaMKVCache (a copy: the batch may go on)."""
        self._check_index(idx)
        return copy.deepcopy(self.rows[idx])

    def filter(self, batch_indices) -> None:
        """Keep the rows batch_indices, in that order (in place)."""
        indices = batch_indices.tolist() if isinstance(batch_indices, mx.array) else list(batch_indices)
        for i in indices:
            self._check_index(i)
        self._settle_left_padding()
        self.rows = [self.rows[i] for i in indices]
        self._left = [self._left[i] for i in indices]
        self._lengths = [self._lengths[i] for i in indices]

    def extend(self, other: "BatchCaMKVCache") -> None:
        """Append other's rows after this batch's (in place)."""
        if not isinstance(other, BatchCaMKVCache):
            raise ValueError(
                f"a BatchCaMKVCache can only be extended by another BatchCaMKVCache, got "
                f"{type(other).__name__} (every request of a batch must use camkv caches)"
            )
        if self._in_padded_prompt() or other._in_padded_prompt():
            raise ValueError("cannot extend a batch in the middle of a padded prompt (before finalize)")
        self._settle_left_padding()
        other._settle_left_padding()
        self.rows += other.rows
        self._left += other._left
        self._lengths += other._lengths

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None) -> None:
        """Announce the padding of the coming blocks (as BatchKVCache.prepare).

        left_padding: more padding before each row's first token (empty rows only).
        lengths: each row's real tokens in the coming prompt; the rest of each row's
        blocks (right_padding) is padding until finalize.
        """
        B = len(self.rows)
        if left_padding is not None:
            if not self.empty():
                raise ValueError("Left padding can only be added to an empty BatchCaMKVCache")
            self._settle_left_padding()
            self._left = [a + b for a, b in zip(self._left, _padding_list(left_padding, B, "left_padding"))]
        if lengths is not None:
            self._settle_left_padding()
            self._lengths = _padding_list(lengths, B, "lengths")

    def finalize(self) -> None:
        """The padded prompt is over: every row's blocks are real tokens again."""
        self._settle_left_padding()
        self._lengths = [_UNLIMITED] * len(self.rows)

    # ------------------------------------------------------------------ attention
    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Give each row its real tokens; return the left-padded rectangle of every row's
        held keys and values [B, H, L, D] (L: the most any row holds now)."""
        B = len(self.rows)
        if keys.ndim != 4 or keys.shape[0] != B:
            raise ValueError(
                f"keys {tuple(keys.shape)} do not match this batch of {B} rows; expected [{B}, H, S, D]"
            )
        block = self._real_slices(keys.shape[2])
        self._consumed += keys.shape[2]
        fetched = [self._row_update(b, lo, hi, keys, values) for b, (lo, hi) in enumerate(block)]
        self._block = block
        self._fetched = [(hi > lo, k.shape[2]) for (lo, hi), (k, _) in zip(block, fetched)]
        return _left_padded(fetched)

    def attention_bias(self) -> mx.array | None:
        """Each row's attention bias (CaMKVCache.attention_bias: the log of its rows' votes)
        laid out as the rectangle attention gets [B, H, L], 0 over the left padding (which
        the mask hides) and for rows without votes; None when no row has any."""
        biases = [row.attention_bias() if took else row._votes_bias()
                  for row, (took, _) in zip(self.rows, self._fetched)]
        if all(b is None for b in biases):
            return None
        heads = next(b for b in biases if b is not None).shape[1]
        width = max(n for _, n in self._fetched)
        padded = [mx.pad(mx.zeros((1, heads, n), mx.float32) if b is None else b, [(0, 0), (0, 0), (width - n, 0)])
                  for b, (_, n) in zip(biases, self._fetched)]
        return mx.concatenate(padded, axis=0)

    def observe_queries(self, queries: mx.array, scale: float) -> None:
        """The attention hook's queries [B, Hq, S, Dk]: each row gets those of its real tokens."""
        block, self._block = self._block, None
        if block is None:
            return  # nothing waits: a repeated call
        for b, (row, (lo, hi)) in enumerate(zip(self.rows, block)):
            if hi > lo:
                row.observe_queries(queries[b : b + 1, :, lo:hi], scale)

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **kwargs):
        """The mask of the coming block of N: each real query sees its row's held tokens and
        the block's tokens up to itself; padding columns are hidden from every row."""
        if window_size is not None:
            raise NotImplementedError(
                "BatchCaMKVCache serves full-attention layers only; sliding-window layers keep "
                "mlx-lm's own BatchRotatingKVCache"
            )
        held = [self._held_before_block(row) for row in self.rows]
        block = self._real_slices(N)
        if all(h == held[0] for h in held) and all(s == (0, N) for s in block):
            # Every row alike (decode of rows holding the same count): no padding anywhere.
            if N == 1:
                return None
            return create_causal_mask(N, held[0]) if return_array else "causal"
        return _padded_causal_mask(N, held, block)

    # ------------------------------------------------------------------ protocol
    @property
    def offset(self) -> mx.array:
        """Per-row RoPE offsets [B]: the position of each row's next real token, less the
        left padding before it in the coming block (the model adds a token's index in it)."""
        return mx.array(
            [row.offset - self._left_pending(b) for b, row in enumerate(self.rows)], mx.int32
        )

    @property
    def state(self):
        """Every row's state (reading it scores the rows' pending tokens, as a lone
        CaMKVCache's does, so mlx-lm's mx.eval of it after each prompt chunk runs the same
        compressions as when the request runs alone)."""
        return [row.state for row in self.rows]

    @state.setter
    def state(self, v) -> None:
        raise NotImplementedError(
            "a BatchCaMKVCache is not saved or loaded whole: extract(i) a row's CaMKVCache "
            "and save that (camkv.save_prompt_cache)"
        )

    def size(self) -> int:
        """Width of the rectangle attention gets: the most tokens any row holds."""
        return max((row.size() for row in self.rows), default=0)

    def empty(self) -> bool:
        return all(row.empty() for row in self.rows)

    @property
    def nbytes(self) -> int:
        """Bytes the rows hold (the rectangle handed to attention is transient)."""
        return sum(row.nbytes for row in self.rows)

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n: int) -> int:
        raise NotImplementedError(
            "BatchCaMKVCache cannot be trimmed: evicted and merged tokens cannot be restored"
        )

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        raise NotImplementedError("BatchCaMKVCache cannot be quantized (kv_bits); use it without kv_bits")

    def __len__(self) -> int:
        return len(self.rows)

    # ------------------------------------------------------------------ internals
    def _check_index(self, i) -> None:
        if not isinstance(i, int) or not -len(self.rows) <= i < len(self.rows):
            raise IndexError(f"row {i!r} is not in this batch of {len(self.rows)} rows")

    def _in_padded_prompt(self) -> bool:
        return any(n is not _UNLIMITED for n in self._lengths)

    def _left_pending(self, b: int) -> int:
        return max(0, self._left[b] - self._consumed)

    def _settle_left_padding(self) -> None:
        """Restart the padded stream's count at 0, keeping the left padding still to come."""
        self._left = [self._left_pending(b) for b in range(len(self.rows))]
        self._consumed = 0

    def _real_slices(self, S: int) -> list[tuple[int, int]]:
        """Per row, the [lo, hi) of the coming block of S positions holding its real tokens:
        they start after its left padding and end after `lengths` tokens (right padding)."""
        slices = []
        for b in range(len(self.rows)):
            start = self._left[b] - self._consumed
            n = self._lengths[b]
            end = S if n is _UNLIMITED else start + n
            lo, hi = min(max(start, 0), S), min(max(end, 0), S)
            slices.append((lo, max(lo, hi)))
        return slices

    def _held_before_block(self, row: CaMKVCache) -> int:
        # A block the model never showed its queries for is scored (and maybe evicted)
        # at the row's next update; do it now so the mask is built for what the row holds.
        row._flush_pending_with_keys()
        return row.size()

    def _row_update(self, b: int, lo: int, hi: int, keys, values):
        """Row b's held keys and values [1, H, n, D] after taking its tokens [lo, hi)."""
        row = self.rows[b]
        if hi > lo:
            return row.update_and_fetch(keys[b : b + 1, :, lo:hi], values[b : b + 1, :, lo:hi])
        if row.empty():
            H = keys.shape[1]
            return (mx.zeros((1, H, 0, keys.shape[3]), keys.dtype),
                    mx.zeros((1, H, 0, values.shape[3]), values.dtype))
        return row.keys, row.values


CaMKVCache.batch_class = BatchCaMKVCache


def _check_row(row) -> None:
    if not isinstance(row, CaMKVCache):
        raise ValueError(f"a BatchCaMKVCache row must be a CaMKVCache, got {type(row).__name__}")
    if not row.empty() and row.keys.shape[0] != 1:
        raise ValueError(
            f"a BatchCaMKVCache row must hold one request (B=1), got B={row.keys.shape[0]}"
        )


def _padding_list(values, B: int, name: str) -> list[int]:
    if values is None:
        return [0] * B
    values = values.tolist() if isinstance(values, mx.array) else list(values)
    if len(values) != B or any(not isinstance(v, int) or v < 0 for v in values):
        raise ValueError(f"{name} must be {B} counts >= 0 (one per row), got {values}")
    return values


def _left_padded(fetched: list[tuple[mx.array, mx.array]]):
    """Rows' [1, H, n_b, D] keys and values as [B, H, L, D], each row right-aligned."""
    L = max(k.shape[2] for k, _ in fetched)

    def pad(a):
        n = a.shape[2]
        return a if n == L else mx.pad(a, [(0, 0), (0, 0), (L - n, 0), (0, 0)])

    keys = mx.concatenate([pad(k) for k, _ in fetched], axis=0)
    values = mx.concatenate([pad(v) for _, v in fetched], axis=0)
    return keys, values


def _padded_causal_mask(N: int, held: list[int], block: list[tuple[int, int]]) -> mx.array:
    """[B, 1, N, L] bool: row b's tokens fill columns [L - n_b, L) (n_b = held + real);
    its real query q (lo <= q < hi, token held_b + q - lo of the row) sees the row's
    columns up to itself. Padding queries see every column: their outputs are dropped,
    and a query that sees nothing would give NaNs."""
    held_a = mx.array(held)[:, None, None]
    lo = mx.array([s[0] for s in block])[:, None, None]
    hi = mx.array([s[1] for s in block])[:, None, None]
    n = held_a + hi - lo
    L = max(h + s[1] - s[0] for h, s in zip(held, block))
    q = mx.arange(N)[None, :, None]
    cols = mx.arange(L)[None, None, :]
    first = L - n
    visible = (cols >= first) & (cols <= first + held_a + q - lo)
    real = (q >= lo) & (q < hi)
    return mx.where(real, visible, True)[:, None]
