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

Decoding (every row takes one real token a call) runs in one shared rectangle per
layer instead: keys and values [B, H, capacity, D] and queries [B, Hq, capacity, Dk],
every row's columns ending at one shared column (its left padding before them, hidden
by make_mask). A row whose step only appends (CaMKVCache.decodes_plainly) lends its
buffers to the rectangle: the batch writes every such row's key, value and query at
once (one write each, as BatchKVCache) and tells the row. A row that must do more
(compress, score a waiting block, weigh by votes) takes its buffers back and runs its
own code, exactly as alone; its rows go back into the rectangle at the next step. Any
other call (a prompt block, extract, filter, extend, state, reading `rows`) first
hands every row its buffers back.
"""

from __future__ import annotations

import copy

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import _BaseCache

from . import attention_rows, quantized
from .backends import drop
from .cache import CaMKVCache

_UNLIMITED = None  # a row's real-token count in the coming block: no right padding
_ROOM = 64  # free columns a rectangle gets when it is (re)built: steps between copies


class BatchCaMKVCache(_BaseCache):
    """A batch of requests, one CaMKVCache a row (see the module docstring).

    left_padding: padding tokens that come before each row's first real token in the
    next block, as in mlx-lm's BatchKVCache(left_padding). Those are never held.
    """

    def __init__(self, rows: list[CaMKVCache], left_padding: list[int] | None = None):
        self._rows = list(rows)
        for row in self._rows:
            _check_row(row)
        _check_quantization(self._rows)
        self._read_as_rows()
        B = len(self._rows)
        self._left = _padding_list(left_padding, B, "left_padding")
        self._lengths: list[int | None] = [_UNLIMITED] * B  # set by prepare(lengths=...)
        self._consumed = 0  # positions of the padded stream fed since prepare
        self._block: list[tuple[int, int]] | None = None  # last call's per-row real slices
        self._fetched: list[tuple[bool, int]] = []  # last call's rows: (took tokens, rows returned)
        # Decoding: the rectangles of keys and values and of queries (None outside decoding),
        # and which rows have lent them their buffers.
        self._kv: _RightAligned | None = None
        self._queries: _RightAligned | None = None
        self._lent: list[bool] = []
        # Lent rows are told their plain steps only when something reads them (_tell_rows):
        # steps written since, whether a step's queries are still to come, how many more
        # steps every lent row can take plainly, the most rows and pending queries a lent row
        # holds, and the scale of the lent rows' pending queries.
        self._untold = 0
        self._in_step = False
        self._plain_left = 0
        self._lent_held = 0
        self._lent_queries = 0
        self._scale: float | None = None
        # offset as an array, kept between calls (the model reads it in every layer), or
        # None when it must be built again from the rows.
        self._offsets: mx.array | None = None

    @property
    def rows(self) -> list[CaMKVCache]:
        """The requests' caches, each whole (holding its own buffers)."""
        self._make_whole()
        self._offsets = None  # the caller may update a row itself
        return self._rows

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
        self._make_whole()
        return copy.deepcopy(self._rows[idx])

    def filter(self, batch_indices) -> None:
        """Keep the rows batch_indices, in that order (in place)."""
        indices = batch_indices.tolist() if isinstance(batch_indices, mx.array) else list(batch_indices)
        for i in indices:
            self._check_index(i)
        self._settle_left_padding()
        self._make_whole()
        self._rows = [self._rows[i] for i in indices]
        self._read_as_rows()
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
        _check_quantization(self._rows + other._rows)
        self._make_whole()
        self._rows += other.rows
        self._read_as_rows()
        self._left += other._left
        self._lengths += other._lengths

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None) -> None:
        """Announce the padding of the coming blocks (as BatchKVCache.prepare).

        left_padding: more padding before each row's first token (empty rows only).
        lengths: each row's real tokens in the coming prompt; the rest of each row's
        blocks (right_padding) is padding until finalize.
        """
        B = len(self._rows)
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
        self._lengths = [_UNLIMITED] * len(self._rows)

    # ------------------------------------------------------------------ attention
    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Give each row its real tokens; return the left-padded rectangle of every row's
        held keys and values [B, H, L, D] (L: the most any row holds now)."""
        B = len(self._rows)
        if keys.ndim != 4 or keys.shape[0] != B:
            raise ValueError(
                f"keys {tuple(keys.shape)} do not match this batch of {B} rows; expected [{B}, H, S, D]"
            )
        if self._is_decode_step(keys.shape[2]):
            return self._decode_update(keys, values)
        self._make_whole()
        self._offsets = None
        block = self._real_slices(keys.shape[2])
        self._consumed += keys.shape[2]
        fetched = [self._row_update(b, lo, hi, keys, values) for b, (lo, hi) in enumerate(block)]
        self._block = block
        self._fetched = [(hi > lo, _tokens(k)) for (lo, hi), (k, _) in zip(block, fetched)]
        return _left_padded(fetched)

    def attention_bias(self) -> mx.array | None:
        """Each row's attention bias (CaMKVCache.attention_bias: the log of its rows' votes)
        laid out as the rectangle attention gets [B, H, L], 0 over the left padding (which
        the mask hides) and for rows without votes; None when no row has any."""
        if self._lent and all(self._lent):
            return None  # lent rows have no votes (CaMKVCache.decodes_plainly)
        biases = [row.attention_bias() if took else row.votes_bias()
                  for row, (took, _) in zip(self._rows, self._fetched)]
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
        if self._kv is not None:
            self._decode_observe(queries, float(scale))
            return
        for b, (row, (lo, hi)) in enumerate(zip(self._rows, block)):
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
        self._tell_rows()
        held = [self._held_before_block(b) for b in range(len(self._rows))]
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
        if self._offsets is None:
            self._tell_rows()
            self._offsets = mx.array(
                [row.offset - self._left_pending(b) for b, row in enumerate(self._rows)], mx.int32)
        return self._offsets

    @property
    def state(self):
        """Every row's state (CaMKVCache.state: reading it compresses nothing, so mlx-lm's
        mx.eval of it after each prompt chunk leaves every row's schedule as when its
        request runs alone). Rows lent to the decode rectangles take their buffers back
        first (their rows and pending queries unchanged)."""
        return [row.state for row in self.rows]

    def __deepcopy__(self, memo):
        """An independent copy, its rows whole (the rectangles are not copied)."""
        self._make_whole()
        clone = object.__new__(type(self))
        memo[id(self)] = clone
        clone.__dict__.update({k: copy.deepcopy(v, memo) for k, v in self.__dict__.items()})
        return clone

    @state.setter
    def state(self, v) -> None:
        raise NotImplementedError(
            "a BatchCaMKVCache is not saved or loaded whole: extract(i) a row's CaMKVCache "
            "and save that (camkv.save_prompt_cache)"
        )

    def size(self) -> int:
        """Width of the rectangle attention gets: the most tokens any row holds."""
        self._tell_rows()
        return max((row.size() for row in self._rows), default=0)

    def empty(self) -> bool:
        return all(row.empty() for row in self._rows)

    @property
    def nbytes(self) -> int:
        """Bytes the rows hold (the rectangle handed to attention is transient)."""
        self._tell_rows()
        return sum(row.nbytes for row in self._rows)

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n: int) -> int:
        raise NotImplementedError(
            "BatchCaMKVCache cannot be trimmed: evicted and merged tokens cannot be restored"
        )

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        raise NotImplementedError("BatchCaMKVCache cannot be quantized (kv_bits); use it without kv_bits")

    def __len__(self) -> int:
        return len(self._rows)

    # ------------------------------------------------------------------ internals
    def _read_as_rows(self) -> None:
        """bits and group_size as the rows have them (they share them, and a tier or none):
        attributes present where attention reads the rows quantized, as CaMKVCache's, so
        mlx-lm's hasattr(cache, "bits") at every layer and step raises nothing."""
        for name in attention_rows.QUANTIZED_FIELDS:
            self.__dict__.pop(name, None)
            if self._rows and hasattr(self._rows[0], name):
                setattr(self, name, getattr(self._rows[0], name))

    def _tiered(self) -> bool:
        """Rows with a tier, whose decode steps each row runs itself (two pools to attend)."""
        return bool(self._rows) and self._rows[0].config.tier_budget > 0

    def _columns(self, keys, values) -> list[mx.array]:
        """The step's keys and values [B, H, 1, D] as the rectangle stores them: the arrays,
        or for quantized rows the codes, scales and biases of each, quantized for the whole
        batch at once (mx.quantize groups channels only: each row's are what it would store)."""
        cfg = self._rows[0].config
        if cfg.bits is None:
            return [keys, values]
        return [*quantized.quantize(keys, cfg.bits, cfg.group_size), *quantized.quantize(values, cfg.bits, cfg.group_size)]

    def _check_index(self, i) -> None:
        if not isinstance(i, int) or not -len(self._rows) <= i < len(self._rows):
            raise IndexError(f"row {i!r} is not in this batch of {len(self._rows)} rows")

    def _in_padded_prompt(self) -> bool:
        return any(n is not _UNLIMITED for n in self._lengths)

    def _left_pending(self, b: int) -> int:
        return max(0, self._left[b] - self._consumed)

    def _settle_left_padding(self) -> None:
        """Restart the padded stream's count at 0, keeping the left padding still to come
        (every change of the rows or their padding comes through here)."""
        self._offsets = None
        self._left = [self._left_pending(b) for b in range(len(self._rows))]
        self._consumed = 0

    def _real_slices(self, S: int) -> list[tuple[int, int]]:
        """Per row, the [lo, hi) of the coming block of S positions holding its real tokens:
        they start after its left padding and end after `lengths` tokens (right padding)."""
        slices = []
        for b in range(len(self._rows)):
            start = self._left[b] - self._consumed
            n = self._lengths[b]
            end = S if n is _UNLIMITED else start + n
            lo, hi = min(max(start, 0), S), min(max(end, 0), S)
            slices.append((lo, max(lo, hi)))
        return slices

    def _held_before_block(self, b: int) -> int:
        # A block the model never showed its queries for is scored (and maybe evicted)
        # at the row's next update; do it now so the mask is built for what the row holds.
        row = self._rows[b]
        row.flush_pending()
        return row.size()

    def _row_update(self, b: int, lo: int, hi: int, keys, values):
        """Row b's held keys and values [1, H, n, D] after taking its tokens [lo, hi)."""
        row = self._rows[b]
        if hi > lo:
            return row.update_and_fetch(keys[b : b + 1, :, lo:hi], values[b : b + 1, :, lo:hi])
        if row.empty():
            return quantized.empty_rows(row.config, keys.shape[1], keys.shape[3], values.shape[3], keys.dtype)
        return row.attended()

    # ------------------------------------------------------------------ decoding
    def _is_decode_step(self, S: int) -> bool:
        """Every row takes one real token (no padding to cut): the rectangle's work. Rows
        with a tier decode as prompt blocks do, each row on its own."""
        return S == 1 and not self._in_padded_prompt() and not self._tiered() and all(
            self._left_pending(b) == 0 for b in range(len(self._rows)))

    def _decode_update(self, keys, values):
        """One token a row: lent rows get theirs in one write each of keys and values, the
        other rows update themselves; returns views [B, H, L, D] of the rectangle's last
        columns (L: the most rows any row holds now)."""
        rows = self._rows
        if self._in_step:
            # The model attended without handing over the last step's queries (it bypasses
            # the hook): each row scores that step with its keys, as when alone.
            self._make_whole()
        if self._kv is None:
            B = len(rows)
            self._kv, self._queries, self._lent = _RightAligned(B), _RightAligned(B), [False] * B
        columns = self._columns(keys, values)
        if self._plain_left <= 0 or not all(self._lent):
            self._regroup(columns)
        owning = [b for b, lent in enumerate(self._lent) if not lent]
        self._kv.fit(columns, keep=self._lent_held,
                     before=max([self._lent_held] + [rows[b].size() for b in owning]))
        self._kv.write_column(columns)
        self._in_step = True
        self._plain_left -= 1
        if len(owning) < len(rows):
            self._lent_held += 1
        # An owning row returns at most held + 1 rows; they end at the rectangle's end too.
        fetched = [(True, self._lent_held)] * len(rows)
        for b in owning:
            self._kv.write_row(b, _flat(*rows[b].update_stored(keys[b : b + 1], values[b : b + 1])))
            fetched[b] = (True, self._kv.last_written)
        if owning:  # the lent rows were told this step (_regroup): their exact widths, for the bias
            fetched = [(True, row.size() + 1) if lent else f for row, lent, f in zip(rows, self._lent, fetched)]
        self._consumed += 1
        if self._offsets is not None:
            self._offsets = self._offsets + 1  # every row's next token is one further on
        self._block = [(0, 1)] * len(rows)
        self._fetched = fetched
        return self._as_attended(self._kv.view(max(n for _, n in fetched)))

    def _as_attended(self, view: tuple):
        """The rectangle's keys and values as attention reads them: as stored where mlx-lm's
        attention (the batch has bits) or camkv's hook (attention_rows.hook_reads_stored)
        reads codes, as for a lone row, else dequantized once for the whole batch."""
        keys, values = _as_pair(view)
        cfg = self._rows[0].config
        if isinstance(keys, tuple) and not (hasattr(self, "bits") or attention_rows.hook_reads_stored(cfg)):
            return tuple(quantized.dequantize(q, cfg.bits, cfg.group_size) for q in (keys, values))
        return keys, values

    def _decode_observe(self, queries, scale: float) -> None:
        """The step's queries [B, Hq, 1, Dk]: lent rows keep theirs in the query rectangle
        (one write); if the lent rows' pending queries cannot take them (another scale or
        shape), the lent rows take their buffers back. Owning rows observe their own."""
        rows = self._rows
        if self._in_step and not self._queries_join(queries, scale):
            self._tell_rows()  # the lent rows, told the step in flight, take their buffers back
        if self._in_step:
            if any(self._lent):
                self._queries.fit([queries], keep=self._lent_queries, before=self._lent_queries)
                self._queries.write_column([queries])
                self._lent_queries += 1
                self._scale = scale
                self._untold += 1
            self._in_step = False
        owning = [rows[b] for b, lent in enumerate(self._lent) if not lent]
        for b, row in enumerate(rows):
            if not self._lent[b]:
                # A one-launch compression due now waits, to run with the other rows due.
                row.observe_queries(queries[b : b + 1], scale, defer_launch=True)
        _compress_together([row for row in owning if row.deferred_launch is not None])

    def _queries_join(self, queries, scale: float) -> bool:
        """Whether the step's queries can join the lent rows' pending ones: their shape, the
        same scale (or none pending)."""
        lent = next((row for row, on in zip(self._rows, self._lent) if on), None)
        if lent is None:
            return True
        H, Dk = lent.layout[1], lent.layout[2]
        return (queries.shape[3] == Dk and queries.shape[1] % H == 0
                and (self._scale is None or self._scale == scale))

    def _regroup(self, columns: list[mx.array]) -> None:
        """Between steps: tell the lent rows their steps; a lent row whose next step does more
        than append takes its buffers back, an owning row whose next step only appends lends
        them; count the steps every lent row can now take without a look at each."""
        self._tell_rows()
        rows = self._rows
        for b, row in enumerate(rows):
            if self._lent[b] and not row.decodes_plainly():
                self._take_back(b)
        lent = [row for row, on in zip(rows, self._lent) if on]
        self._scale = next((row.pending_scale for row in lent if row.pending_scale is not None), None)
        lending = []
        for b, row in enumerate(rows):
            scale = row.pending_scale
            if not self._lent[b] and row.decodes_plainly() and scale in (None, self._scale or scale):
                lending.append(b)
                self._scale = scale if scale is not None else self._scale
        held = max((row.size() for row in lent), default=0)
        self._kv.fit(columns, keep=held, before=max([held] + [rows[b].size() for b in lending]))
        self._lend(lending)
        lent = [row for row, on in zip(rows, self._lent) if on]
        self._lent_held = max((row.size() for row in lent), default=0)
        self._lent_queries = max((row.pending_queries() for row in lent), default=0)
        self._plain_left = min((row.steps_before_compression() for row in lent), default=0)

    def _tell_rows(self) -> None:
        """Tell every lent row the steps written for it since it was last told. A step in
        flight (its queries not come) is told too, and then the lent rows, waiting for those
        queries, take their buffers back and observe them themselves."""
        steps, in_step = self._untold, self._in_step
        self._untold = 0
        for b, (row, lent) in enumerate(zip(self._rows, self._lent)):
            if lent:
                row.decoded_elsewhere(steps, self._scale)
                if in_step:
                    row.appended_elsewhere()
                    self._take_back(b)
        if in_step:
            self._lent_held = self._lent_queries = self._plain_left = 0

    def _lend(self, indices: list[int]) -> None:
        """Rows `indices` (whose next step only appends) hand their buffers to the rectangles,
        whose room the caller made."""
        lent = [(b, *self._rows[b].lend_buffers()) for b in indices]
        queries = [q for *_, q in lent if q is not None]
        if queries:
            kept = max((r.pending_queries() for r, on in zip(self._rows, self._lent) if on), default=0)
            self._queries.fit([queries[0]], keep=kept, before=max(kept, *(q.shape[2] for q in queries)))
        for b, keys, values, q in lent:
            self._kv.write_row(b, _flat(keys, values), end=self._kv.end)
            if q is not None:
                self._queries.write_row(b, (q,), end=self._queries.end)
            self._lent[b] = True

    def _take_back(self, b: int) -> None:
        """Row b (told its steps) holds its own buffers again: its rows of the rectangles."""
        row = self._rows[b]
        p = row.pending_queries()
        row.take_back_buffers(*_as_pair(self._kv.row(b, row.size())), self._queries.row(b, p)[0] if p else None)
        self._lent[b] = False

    def _make_whole(self) -> None:
        """Leave decoding: every row holds its own buffers; the rectangles are freed."""
        if self._kv is None:
            return
        self._tell_rows()
        for b, lent in enumerate(self._lent):
            if lent:
                self._take_back(b)
        self._kv = self._queries = None
        self._lent = []
        self._in_step = False
        self._plain_left = self._lent_held = self._lent_queries = 0
        self._scale = None


CaMKVCache.batch_class = BatchCaMKVCache


class _RightAligned:
    """Rows of a batch in shared buffers [B, H, capacity, D] (keys and values, or queries):
    each row's columns end at column `end`, its left padding before them."""

    def __init__(self, B: int):
        self.B = B
        self.buffers: list[mx.array] | None = None
        self.end = 0
        self.last_written = 0  # rows of the last write_row

    def fit(self, templates: list[mx.array], keep: int, before: int) -> None:
        """Make at least `before` columns before end and one after it, keeping the last
        `keep` columns (rows still lent); a new buffer (templates give H, D and dtype of
        each) only when they do not fit, with _ROOM free columns after end."""
        if self.buffers is not None and before <= self.end < self.buffers[0].shape[2]:
            return
        end = max(before, keep)
        new = []
        for i, template in enumerate(templates):
            parts = [self.buffers[i][:, :, self.end - keep : self.end]] if keep else []
            shape = (self.B, template.shape[1], 0, template.shape[3])
            parts = ([_zeros(shape, end - keep, template.dtype)] + parts + [_zeros(shape, _ROOM, template.dtype)])
            new.append(mx.concatenate(parts, axis=2))
        self.buffers, self.end = new, end

    def write_column(self, arrays) -> None:
        """Each buffer's one new column [B, H, 1, D] at end; end moves past it."""
        for buffer, a in zip(self.buffers, arrays):
            buffer[:, :, self.end : self.end + 1] = a
        self.end += 1

    def write_row(self, b: int, arrays, end: int | None = None) -> None:
        """Row b's columns [1, H, n, D] of each buffer, ending at end (default: self.end)."""
        end = self.end if end is None else end
        n = arrays[0].shape[2]
        for buffer, a in zip(self.buffers, arrays):
            buffer[b : b + 1, :, end - n : end] = a
        self.last_written = n

    def row(self, b: int, n: int) -> list[mx.array]:
        """Row b's last n columns of each buffer [1, H, n, D]."""
        return [buffer[b : b + 1, :, self.end - n : self.end] for buffer in self.buffers]

    def view(self, width: int):
        """Every row's last `width` columns of each buffer [B, H, width, D]."""
        return tuple(buffer[:, :, self.end - width : self.end] for buffer in self.buffers)


def _zeros(shape: tuple, n: int, dtype) -> mx.array:
    return mx.zeros((shape[0], shape[1], n, shape[3]), dtype)


def _compress_together(rows: list[CaMKVCache]) -> None:
    """Run the one-launch compressions these rows deferred at this step, one launch for
    each set of rows alike in shapes, config and scale. Rows of a batch whose prompts
    outgrew the budget hold the same count afterwards and reach budget + slack at the same
    step; each row's survivors are those of its own call (rows are evicted independently,
    each at its own positions)."""
    while rows:
        first = rows[0].deferred_launch
        group = [row for row in rows if _launches_alike(row.deferred_launch, first)]
        rows = [row for row in rows if all(row is not other for other in group)]
        launches = [row.deferred_launch for row in group]
        if len(group) == 1:
            group[0].finish_deferred(drop.compress_drop_buffers(*first))
            continue
        joined = first._replace(
            first_pending=mx.array([launch.first_pending for launch in launches], mx.int32),
            **{name: mx.concatenate([getattr(launch, name) for launch in launches], axis=0)
               for name in drop.DropLaunch.ARRAYS})
        keys, values, scores, positions = drop.compress_drop_buffers(*joined)
        H = first.keys.shape[1]
        for g, row in enumerate(group):
            heads = slice(g * H, (g + 1) * H)
            row.finish_deferred((keys[g : g + 1], values[g : g + 1], scores[heads], positions[heads]))


def _launches_alike(a: drop.DropLaunch, b: drop.DropLaunch) -> bool:
    """Whether two deferred compressions can share a launch: the same array shapes and
    dtypes, end, scale, config and capacity (first_pending may differ)."""
    arrays = drop.DropLaunch.ARRAYS
    same_arrays = all(getattr(a, n).shape == getattr(b, n).shape and getattr(a, n).dtype == getattr(b, n).dtype
                      for n in arrays)
    return same_arrays and (a.end, a.scale, a.cfg, a.capacity) == (b.end, b.scale, b.cfg, b.capacity)


def _check_row(row) -> None:
    if not isinstance(row, CaMKVCache):
        raise ValueError(f"a BatchCaMKVCache row must be a CaMKVCache, got {type(row).__name__}")
    if not row.empty() and row.layout[0] != 1:
        raise ValueError(
            f"a BatchCaMKVCache row must hold one request (B=1), got B={row.layout[0]}"
        )


def _check_quantization(rows: list) -> None:
    """A batch's rows share bits and group_size, and a tier or none: attention reads them
    as one rectangle, and every row's decode steps the same way."""
    kinds = sorted({(row.config.bits or 0, row.config.group_size if row.config.bits else 0,
                     row.config.tier_budget > 0) for row in rows})
    if len(kinds) > 1:
        described = ", ".join(f"bits={b or None}" + (f" group_size={g}" if b else "") + (" with a tier" if t else "")
                              for b, g, t in kinds)
        raise ValueError(f"a BatchCaMKVCache's rows must share bits and group_size, and a tier or none "
                         f"(attention reads them as one rectangle), got {described}")


def _padding_list(values, B: int, name: str) -> list[int]:
    if values is None:
        return [0] * B
    values = values.tolist() if isinstance(values, mx.array) else list(values)
    if len(values) != B or any(not isinstance(v, int) or v < 0 for v in values):
        raise ValueError(f"{name} must be {B} counts >= 0 (one per row), got {values}")
    return values


def _flat(keys, values) -> list[mx.array]:
    """A row's keys and values as the rectangle's buffers hold them: two arrays, or the
    three of each quantized triple."""
    return [*keys, *values] if isinstance(keys, tuple) else [keys, values]


def _as_pair(buffers) -> tuple:
    """(keys, values) of the rectangle's buffers (_flat's inverse)."""
    if len(buffers) == 2:
        return buffers[0], buffers[1]
    return tuple(buffers[:3]), tuple(buffers[3:])


def _tokens(keys) -> int:
    """Tokens of a row's keys [1, H, n, D], or of its quantized triple's."""
    return (keys[0] if isinstance(keys, tuple) else keys).shape[2]


def _left_padded(fetched: list[tuple[mx.array, mx.array]]):
    """Rows' [1, H, n_b, D] keys and values as [B, H, L, D], each row right-aligned
    (quantized rows: each of their triples' arrays so; the padding's zeros are masked)."""
    L = max(_tokens(k) for k, _ in fetched)

    def pad(a):
        n = a.shape[2]
        return a if n == L else mx.pad(a, [(0, 0), (0, 0), (L - n, 0), (0, 0)])

    def stacked(parts: list):
        if isinstance(parts[0], tuple):
            return tuple(stacked([p[i] for p in parts]) for i in range(len(parts[0])))
        return mx.concatenate([pad(p) for p in parts], axis=0)

    return stacked([k for k, _ in fetched]), stacked([v for _, v in fetched])


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
