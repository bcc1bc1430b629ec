"""Quantized rows (CaMConfig.bits): keys and values stored as MLX's affine quantization.

A quantized key or value block [B, H, n, D] is the tuple mx.quantize returns: packed
codes uint32 [B, H, n, D * bits / 32], then a scale and a bias per group of group_size
channels, [B, H, n, D / group_size] each, in the model's dtype (docs/algorithm.md
section 12). QuantizedRowBuffers holds such tuples where RowBuffers holds arrays.

Rounding happens once per token: when it is written (a decode step or a prompt block),
and again only for a row whose values a compression changed (a merge). A compression
runs on dequantized rows (the shared engine of camkv.backends.compress, unchanged); a
survivor it did not change keeps its codes, found again by its position, because
quantizing dequantized values again is not the identity in MLX (8-bit codes drift by
one step in a fifth of the channels per round, so rows surviving many compressions
would wander).
"""

from __future__ import annotations

import mlx.core as mx

from .backends import append_cuda, quantized_cuda, step_cuda
from .buffers import RowBuffers, capacity_for, with_room

SCORE_AND_POSITION_BYTES = 8  # float32 score + int32 position per row, quantized or not


def kernels_here() -> bool:
    """Whether attention reads quantized rows as stored on the default device: on the
    CPU and Metal, through MLX's quantized attention. MLX's CUDA build runs it for some
    of a cache's shapes only (not group 64 at head dim 64) and slower than dequantizing
    the bounded rows first (bench/quantized_attention.py), so there a quantized cache
    hands attention its rows dequantized."""
    return mx.default_device() == mx.cpu or mx.metal.is_available()


def stored_bytes(dim: int, dtype_size: int, bits: int | None, group_size: int) -> int:
    """Bytes one head's key (or value) of `dim` channels takes stored: dim x dtype_size
    unquantized; quantized, its packed codes plus a scale and a bias per group."""
    if bits is None:
        return dim * dtype_size
    return dim * bits // 8 + 2 * (dim // group_size) * dtype_size


def row_bytes(k_dim: int, v_dim: int, dtype_size: int, bits: int | None, group_size: int) -> int:
    """Bytes one stored row (one token of one KV head) takes: key, value, score, position."""
    return (stored_bytes(k_dim, dtype_size, bits, group_size) + stored_bytes(v_dim, dtype_size, bits, group_size)
            + SCORE_AND_POSITION_BYTES)


def check_dims(k_dim: int, v_dim: int, cfg) -> None:
    """ValueError unless group_size divides both head dimensions (mx.quantize needs it)."""
    for name, dim in (("key", k_dim), ("value", v_dim)):
        if dim % cfg.group_size:
            raise ValueError(f"CaMConfig.group_size={cfg.group_size} must divide the {name} head dimension "
                             f"{dim} to quantize it (bits={cfg.bits}); use one of "
                             f"{[g for g in (32, 64, 128) if k_dim % g == 0 and v_dim % g == 0] or 'none: bits=None'}")


def survivor_sources(before: mx.array, after: mx.array) -> mx.array:
    """Where each survivor came from: before [R, n] and after [R, m] are positions,
    ascending and distinct per row, after's a subset of before's (a compression keeps or
    drops rows, never adds one); returns int32 [R, m], the index in before of each.

    Two sorts instead of an [R, m, n] comparison (at budget 4096 that would be 150 MB
    per layer): keys 2p for before and 2p + 1 for after put each survivor right after
    its source; the source indices, read at the survivors' places, come out ascending."""
    n, m = before.shape[1], after.shape[1]
    keys = mx.concatenate([before * 2, after * 2 + 1], axis=1)  # positions < 2^30
    order = mx.argsort(keys, axis=1).astype(mx.int32)
    previous = mx.concatenate([mx.zeros_like(order[:, :1]), order[:, :-1]], axis=1)
    at_survivors = mx.where(order >= n, previous, n + m)
    return mx.sort(at_survivors, axis=1)[:, :m]


def _first(q: tuple, end: int) -> tuple:
    return tuple(a[:, :, :end] for a in q)


def quantize(x: mx.array, bits: int, group_size: int) -> tuple:
    """x [..., D] as mx.quantize's (codes, scales, biases) tuple."""
    return tuple(mx.quantize(x, group_size=group_size, bits=bits))


def format_of(keys: tuple, key_dim: int) -> tuple[int, int]:
    """(bits, group_size) of quantized keys (codes, scales, biases) of key_dim channels,
    read from their shapes: codes hold key_dim * bits / 32 words, scales one a group."""
    return keys[0].shape[-1] * 32 // key_dim, key_dim // keys[1].shape[-1]


def dequantize(q: tuple, bits: int, group_size: int) -> mx.array:
    """The values a (codes, scales, biases) tuple of quantize stands for."""
    return mx.dequantize(*q, group_size=group_size, bits=bits)


def _buffers_with_step_written(name: str) -> property:
    """QuantizedRowBuffers' keys or values (held as _keys, _values), a step held for the
    attention's launch written first: whatever reads the buffers sees every held row."""
    held = "_" + name

    def read(self):
        if self._step is not None:
            self._write_step()
        return getattr(self, held)

    def write(self, value) -> None:
        setattr(self, held, value)

    return property(read, write)


class QuantizedRowBuffers(RowBuffers):
    """RowBuffers whose keys and values are quantized tuples (codes, scales, biases), each
    [B, H, size, w]; scores, positions and a rule's state as in RowBuffers. Appending
    quantizes the block once; rows() and for_compression() dequantize; compressed()
    stores a compression's survivors, re-quantizing only the rows it changed."""

    # A decode step's key and value [B, H, 1, D] and their row, written by the attention's
    # launch (attend_step) or, if anything reads the buffers first, by the write alone.
    _step: tuple | None = None
    keys = _buffers_with_step_written("keys")
    values = _buffers_with_step_written("values")

    def __init__(self, capacity: int, bits: int, group_size: int):
        super().__init__(capacity)
        self.bits, self.group_size = bits, group_size
        self._before = None  # what for_compression dequantized, until compressed

    def _write_step(self) -> None:
        keys, values, at = self._step
        self._step = None
        self._keys, self._values = append_cuda.write(self._keys, self._values, keys, values, at, self.bits,
                                                     self.group_size)

    def write_in_place(self, keys: mx.array, values: mx.array):
        """append's write of a block that fits; with steps_fused, a decode step is held
        instead (a StepRows, which camkv's hook hands to attend_step)."""
        if self.steps_fused and keys.shape[2] == 1:
            self._step = (keys, values, self.held)
            self.held += 1
            step = StepRows(self)
            return step, step
        return self.append(keys, values)

    def attend_step(self, queries: mx.array, scale: float) -> mx.array:
        """Write the held decode step and attend the rows with it in one launch
        (camkv.backends.step_cuda): softmax(scale q k^T) v over every held row, [B, Hq, 1, D].
        A step something wrote already (by reading the buffers): the attention alone."""
        if self._step is None:
            return quantized_cuda.attend(queries, *self.quantized_views(), scale, None, self.bits, self.group_size)
        keys, values, at = self._step
        self._step = None
        self._keys, self._values, out = step_cuda.write_and_attend(
            queries, self._keys, self._values, keys, values, at, scale, self.bits, self.group_size)
        return out

    def quantize(self, x: mx.array) -> tuple:
        return quantize(x, self.bits, self.group_size)

    def dequantize(self, q: tuple) -> mx.array:
        return dequantize(q, self.bits, self.group_size)

    def append(self, keys: mx.array, values: mx.array):
        """Quantize the block [B, H, S, D] and write it after the held rows; return the
        quantized views (tuples [B, H, held + S, w]) of keys and values. On MLX's CUDA build
        one launch writes the block into new buffers (camkv.backends.append_cuda), grown
        when it does not fit; elsewhere (and for a first block) mx.quantize and six writes
        in place, or six buffers joined."""
        held, end = self.held, self.held + keys.shape[2]
        rows = None if self.has_room(keys.shape[2]) else end + self.room_after(end)
        if self.keys is not None and append_cuda.takes(self.keys, self.values, keys.dtype, self.bits, rows):
            self.held = end
            self.keys, self.values = append_cuda.write(self.keys, self.values, keys, values, held, self.bits,
                                                       self.group_size, rows)
            return _first(self.keys, end), _first(self.values, end)
        return self._append_quantized(self.quantize(keys), self.quantize(values))

    def has_room(self, rows: int = 1) -> bool:
        return self.keys is not None and self.held + rows <= self.keys[0].shape[2]

    def reappend(self, rest) -> None:
        """Rows after(end) handed out before a compression, written back as they were."""
        self._append_quantized(*rest)

    def _append_quantized(self, keys: tuple, values: tuple):
        end = self.held + keys[0].shape[2]
        if self.scores is None:
            R = keys[0].shape[0] * keys[0].shape[1]
            self.scores, self.positions = mx.zeros((R, 0), mx.float32), mx.zeros((R, 0), mx.int32)
        if self.has_room(keys[0].shape[2]):
            for buffer, block in zip((*self.keys, *self.values), (*keys, *values)):
                buffer[:, :, self.held : end] = block
        else:
            spare = self.room_after(end)
            self.keys, self.values = (
                tuple(self._joined(None if old is None else old[i], block[i], spare) for i in range(3))
                for old, block in ((self.keys, keys), (self.values, values)))
        self.held = end
        return _first(self.keys, end), _first(self.values, end)

    def held_arrays(self, end: int):
        return tuple(a[:, :, :end] for a in self._dequantized_buffers())

    def _dequantized_buffers(self) -> tuple[mx.array, mx.array]:
        """The whole buffers of keys and of values dequantized ([B, H, size, D]; rows past
        the held ones are whatever the buffers hold there). Whole buffers, not views of the
        held rows: MLX's CUDA dequantize copies an input that is not row-contiguous, three
        copies for each of keys and values a view of some rows would cost."""
        return self.dequantize(self.keys), self.dequantize(self.values)

    def quantized_views(self, end: int | None = None):
        """The held rows' quantized keys and values (tuples [B, H, end, w])."""
        end = self.held if end is None else end
        return _first(self.keys, end), _first(self.values, end)

    def as_stored(self) -> tuple:
        return self.quantized_views()

    @staticmethod
    def held_with_room(stored: tuple, spare: int) -> tuple:
        """New buffers of a quantized triple [B, H, n, w] with spare empty rows after each."""
        return tuple(with_room([], a, spare) for a in stored)

    def after(self, end: int):
        """The held rows after row end, still quantized (reappend writes them back)."""
        return tuple(a[:, :, end : self.held] for a in self.keys), tuple(a[:, :, end : self.held] for a in self.values)

    def for_compression(self, end: int) -> RowBuffers:
        """Plain RowBuffers of rows [0, end) dequantized, which the shared compression
        engine compresses in place; compressed(work) then stores what it kept. A one-launch
        drop compression copies the rows as stored instead (DequantizedRows)."""
        work = DequantizedRows(self.capacity, (self.keys, self.values))
        work.keys, work.values = self._dequantized_buffers()  # buffers whose first end rows take part
        work.held, work.settled, work.pending_start = end, self.settled, self.pending_start
        work.scores, work.positions, work.votes, work.threshold = self.scores, self.positions, self.votes, self.threshold
        positions = self.rows_positions(end)
        self._before = (positions, self.quantized_views(end), work.keys, work.values)
        return work

    def rows_positions(self, end: int) -> mx.array:
        """Positions [R, end] of rows [0, end): the settled ones', then the pending ones'."""
        R, pending = self.scores.shape[0], end - self.settled
        new = mx.broadcast_to(self.pending_start + mx.arange(pending, dtype=mx.int32), (R, pending))
        return mx.concatenate([self.positions, new], axis=1)

    def compressed(self, work: RowBuffers, may_change_rows: bool = True) -> None:
        """Hold the rows a compression left in work (all settled), quantized: a survivor
        keeps its codes unless the compression changed its key or value (a merge), whose
        new values are quantized once. may_change_rows=False (merge="drop"): none changed."""
        positions, (q_keys, q_values), plain_keys, plain_values = self._before
        self._before = None
        if work.adopted_stored:  # a one-launch drop copied the survivors' codes (buffers of capacity)
            self.keys, self.values = work.keys, work.values
            self._hold_state_of(work)
            return
        B, H = work.keys.shape[:2]
        R, n = work.scores.shape
        sources = survivor_sources(positions, work.positions)
        kept_keys = tuple(_rows_at(a, sources, B, H) for a in q_keys)
        kept_values = tuple(_rows_at(a, sources, B, H) for a in q_values)
        if may_change_rows:
            out_keys, out_values = work.keys[:, :, :n], work.values[:, :, :n]
            kept_keys = self._where_changed(out_keys, _rows_at(plain_keys, sources, B, H), kept_keys)
            kept_values = self._where_changed(out_values, _rows_at(plain_values, sources, B, H), kept_values)
        spare = self.room_after(n)
        self.keys, self.values = self.held_with_room(kept_keys, spare), self.held_with_room(kept_values, spare)
        self._hold_state_of(work)

    def _hold_state_of(self, work: RowBuffers) -> None:
        """The scores, positions, rule state and counts of a compression's work (all settled)."""
        self.scores, self.positions, self.votes, self.threshold = work.scores, work.positions, work.votes, work.threshold
        self.held = self.settled = work.scores.shape[1]
        self.pending_start = work.pending_start

    def _where_changed(self, out: mx.array, source: mx.array, codes: tuple) -> tuple:
        """codes, with the rows whose value out differs from its source's re-quantized."""
        changed = mx.any(out != source, axis=-1, keepdims=True)
        return tuple(mx.where(changed, new, old) for new, old in zip(self.quantize(out), codes))

    def settle(self, state, next_position: int, B: int, H: int) -> None:
        """Make a plain RowState [B*H, n, ...] the held rows, quantized."""
        n = state.length
        spare = self.room_after(n)
        self.keys, self.values = (self.held_with_room(self.quantize(x.reshape(B, H, n, -1)), spare) for x in state[:2])
        self.scores, self.positions, self.votes, self.threshold = state[2:]
        self.held = self.settled = n
        self.pending_start = next_position

    def load(self, keys: tuple, values: tuple, scores, positions, votes, threshold, next_position: int,
             settled: int | None = None) -> None:
        """Hold saved quantized rows (triples [B, H, n, w], as held_rows gives them) as they
        were, the first `settled` (all by default) scored, the rest pending; the next token
        at next_position."""
        B, H, n, _ = keys[0].shape
        R = B * H
        settled = n if settled is None else settled
        spare = self.room_after(n)
        self.keys, self.values = self.held_with_room(keys, spare), self.held_with_room(values, spare)
        self.scores = scores.reshape(R, n)[:, :settled].astype(mx.float32)
        self.positions = positions.reshape(R, n)[:, :settled].astype(mx.int32)
        self.votes = None if votes is None else votes.reshape(R, n)[:, :settled].astype(mx.float32)
        self.threshold = None if threshold is None else threshold.reshape(R).astype(mx.float32)
        self.held, self.settled = n, settled
        self.pending_start = next_position - (n - settled)

    def held_rows(self, B: int, H: int) -> tuple:
        """(keys, values, scores, positions) of the rows held, keys and values as stored
        (quantized triples: what a saved cache holds), the pending rows' score 0."""
        scores, positions, _ = self._scored(self.held)
        keys, values = self.quantized_views()
        return keys, values, scores.reshape(B, H, -1), positions.reshape(B, H, -1)

    def arrays(self) -> list[mx.array]:
        return [a for a in (*(self.keys or ()), *(self.values or ()), self.scores, self.positions, self.votes)
                if a is not None]

    def copy(self) -> "QuantizedRowBuffers":
        if self._step is not None:
            self._write_step()
        clone = super().copy()
        for name in ("keys", "values"):
            if getattr(self, name) is not None:
                setattr(clone, name, tuple(mx.array(a) for a in getattr(self, name)))
        return clone


class DequantizedRows(RowBuffers):
    """A compression's work (QuantizedRowBuffers.for_compression): rows dequantized,
    which every engine reads and the merge engines change; a one-launch drop reads their
    keys for the mass and copies the rows as stored (stored_for_launch), whose buffers it
    hands back to adopt (adopted_stored)."""

    def __init__(self, capacity: int, stored: tuple):
        super().__init__(capacity)
        self._stored = stored
        self.adopted_stored = False

    def stored_for_launch(self) -> tuple:
        return self._stored

    def adopt(self, keys, values, scores, positions, next_position: int, votes=None, threshold=None) -> None:
        self.adopted_stored = type(keys) is tuple
        super().adopt(keys, values, scores, positions, next_position, votes, threshold)


class StepRows:
    """What update_and_fetch hands attention for a decode step the rows hold for the next
    launch (QuantizedRowBuffers.write_in_place with steps_fused): camkv's hook writes and
    attends them in one launch (attend) or, for an attention call that launch does not
    take, writes the step and reads the rows as stored (written)."""

    __slots__ = ("rows",)

    def __init__(self, rows: QuantizedRowBuffers):
        self.rows = rows

    def attend(self, queries: mx.array, scale: float) -> mx.array:
        return self.rows.attend_step(queries, scale)

    def written(self) -> tuple:
        """The held rows' quantized keys and values, the step written."""
        return self.rows.quantized_views()


def _rows_at(a: mx.array, idx: mx.array, B: int, H: int) -> mx.array:
    """Rows idx [B*H, m] of a [B, H, n, w], as [B, H, m, w]."""
    R, m = idx.shape
    flat = a.reshape(R, a.shape[2], a.shape[3])
    return mx.take_along_axis(flat, idx[:, :, None], axis=1).reshape(B, H, m, -1)


def row_buffers(cfg) -> RowBuffers:
    """The rows of a cache of config cfg: quantized with cfg.bits set, else plain."""
    if cfg.bits is None:
        return RowBuffers(capacity_for(cfg))
    return QuantizedRowBuffers(capacity_for(cfg), cfg.bits, cfg.group_size)


def saved_layout(keys, values, cfg) -> tuple:
    """(B, H, n, Dk, Dv, dtype) of saved keys and values: arrays [B, H, n, D], or with
    cfg.bits the quantized triples (codes, scales, biases) a quantized cache saves."""
    if cfg.bits is None:
        return (*keys.shape, values.shape[3], keys.dtype)
    for name, q in (("keys", keys), ("values", values)):
        if not (isinstance(q, (tuple, list)) and len(q) == 3 and all(isinstance(a, mx.array) for a in q)):
            raise ValueError(f"a saved CaMKVCache with bits={cfg.bits} holds its {name} as (codes, scales, "
                             f"biases), got {type(q).__name__}")
    B, H, n, words = keys[0].shape
    return B, H, n, words * 32 // cfg.bits, values[0].shape[3] * 32 // cfg.bits, keys[1].dtype


def empty_rows(cfg, heads: int, k_dim: int, v_dim: int, dtype) -> tuple:
    """A row holding nothing yet, as attention reads rows [1, heads, 0, ...]: keys and
    values, or with cfg.bits set (and quantized kernels here) the empty triples."""
    def empty(dim: int):
        if cfg.bits is None or not kernels_here():
            return mx.zeros((1, heads, 0, dim), dtype)
        return (mx.zeros((1, heads, 0, dim * cfg.bits // 32), mx.uint32),
                mx.zeros((1, heads, 0, dim // cfg.group_size), dtype), mx.zeros((1, heads, 0, dim // cfg.group_size), dtype))
    return empty(k_dim), empty(v_dim)
