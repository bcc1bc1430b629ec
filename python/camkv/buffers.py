"""RowBuffers: the rows one layer's cache holds, in buffers that decode steps write in place."""

from __future__ import annotations

import mlx.core as mx

from .rows import RowState

GROWTH_STEP = 256  # most empty rows a buffer is given at once (mlx-lm KVCache's step)


def with_room(before: list, block: mx.array, spare: int) -> mx.array:
    """A buffer [B, H, n, D]: the arrays `before`, then block, then `spare` empty rows
    (none when spare <= 0), joined along the token axis. Always a new array object, even
    for block alone: later writes into the buffer must not reach the caller's array
    (MLX's slice assignment rebinds the object it is given)."""
    parts = [*before, block]
    if spare > 0:
        parts.append(mx.zeros((*block.shape[:2], spare, block.shape[3]), block.dtype))
    return mx.concatenate(parts, axis=2) if len(parts) > 1 else mx.array(block)


def capacity_for(cfg) -> int:
    """Rows a decode of config cfg needs in place: budget + slack held, plus the step
    that compresses."""
    return cfg.budget + cfg.slack + 1


class RowBuffers:
    """Keys and values [B, H, size, D] whose first `held` rows are in use: the first
    `settled` of them scored (scores and positions [B*H, settled], and a merge rule's
    votes [B*H, settled] and threshold [B*H] where it keeps them), the rest pending at
    positions pending_start.., scored at the next compression (docs/algorithm.md
    section 7). A block is written after the held rows in place when it fits; a buffer
    grows by at most GROWTH_STEP rows, up to `capacity` (budget + slack + 1: the rows a
    decode holds in place, plus the step that compresses).

    A batch may borrow the buffers (lend, take_back): meanwhile the rows live in the
    batch's shared rectangle and only the counts stay here.
    """

    # Whether a decode step's write waits for the attention's launch (quantized rows on an
    # NVIDIA GPU: camkv.quantized.QuantizedRowBuffers); plain rows write in place.
    steps_fused = False

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.held = 0
        self.settled = 0
        self.scores: mx.array | None = None
        self.positions: mx.array | None = None
        self.votes: mx.array | None = None
        self.threshold: mx.array | None = None
        self.pending_start = 0

    @property
    def pending(self) -> int:
        return self.held - self.settled

    def room_after(self, held: int) -> int:
        """Empty rows a new buffer gets after `held` rows: up to the capacity, at most
        GROWTH_STEP (a short prompt under a large budget would otherwise allocate the
        whole budget + slack at once; mlx-lm's KVCache grows in the same steps)."""
        return max(0, min(self.capacity - held, GROWTH_STEP))

    def append(self, keys: mx.array, values: mx.array):
        """Write the block [B, H, S, D] after the held rows (in place when it fits); return
        the views [B, H, held + S, D] of keys and values."""
        end = self.held + keys.shape[2]
        if self.scores is None:
            R = keys.shape[0] * keys.shape[1]
            self.scores, self.positions = mx.zeros((R, 0), mx.float32), mx.zeros((R, 0), mx.int32)
        if self.has_room(keys.shape[2]):
            return self.write_in_place(keys, values)
        # A first call or a long block: one new buffer, with room for decoding after.
        spare = self.room_after(end)
        self.keys = self._joined(self.keys, keys, spare)
        self.values = self._joined(self.values, values, spare)
        self.held = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def has_room(self, rows: int = 1) -> bool:
        """Whether the buffers have `rows` empty rows after the held ones (by default a
        decode step's one)."""
        return self.keys is not None and self.held + rows <= self.keys.shape[2]

    def write_in_place(self, keys: mx.array, values: mx.array):
        """append's write of a block [B, H, S, D] that fits in the buffers after the held
        rows (held + S <= their size); the views [B, H, held + S, D]."""
        held = self.held
        self.held = end = held + keys.shape[2]
        self.keys[:, :, held:end] = keys
        self.values[:, :, held:end] = values
        return self.keys[:, :, :end], self.values[:, :, :end]

    def _joined(self, buffer, block, spare: int):
        """The held rows of buffer (if any), then block, then spare empty rows."""
        return with_room([] if buffer is None else [buffer[:, :, : self.held]], block, spare)

    def appended_elsewhere(self, steps: int) -> None:
        """Count `steps` rows a batch wrote after the held ones (into the lent buffers)."""
        self.held += steps

    def rows(self, end: int | None = None) -> RowState:
        """Rows [0, end) held as a RowState [B*H, end, ...]; pending rows score 0 (and
        stand for one token each)."""
        end = self.held if end is None else end
        R = self.scores.shape[0]
        keys, values = self.held_arrays(end)
        return RowState(keys.reshape(R, end, -1), values.reshape(R, end, -1), *self._scored(end), self.threshold)

    def _scored(self, end: int) -> tuple:
        """Scores, positions and votes (None where the rule keeps none) [B*H, end] of rows
        [0, end): a pending row scores 0, sits at its position after pending_start and
        stands for one token. Without the rows' keys and values (for quantized rows a
        dequantization)."""
        R, pending = self.scores.shape[0], end - self.settled
        positions = self.pending_start + mx.arange(pending, dtype=mx.int32)
        votes = None if self.votes is None else mx.concatenate([self.votes, mx.ones((R, pending), mx.float32)],
                                                                axis=1)
        return (mx.concatenate([self.scores, mx.zeros((R, pending), mx.float32)], axis=1),
                mx.concatenate([self.positions, mx.broadcast_to(positions, (R, pending))], axis=1), votes)

    def held_arrays(self, end: int) -> tuple[mx.array, mx.array]:
        """Keys and values [B, H, end, D] of rows [0, end), in the model's dtype."""
        return self.keys[:, :, :end], self.values[:, :, :end]

    def as_stored(self) -> tuple:
        """The held keys and values as stored [B, H, held, D] (camkv.quantized's: triples)."""
        return self.held_arrays(self.held)

    def overwrite_keys(self, given: tuple) -> None:
        """Write given (one array, or a quantized triple's three, each of the held keys'
        shape) over the held keys."""
        for buffer, v in zip(self.keys if isinstance(self.keys, tuple) else (self.keys,), given):
            buffer[:, :, : self.held] = v

    def for_compression(self, end: int) -> "RowBuffers":
        """The buffers a compression of rows [0, end) works on (these; camkv.quantized's
        hands over dequantized copies); compressed(work) takes the result back."""
        return self

    def compressed(self, work: "RowBuffers", may_change_rows: bool = True) -> None:
        """The compression of for_compression's buffers is done (here: in place already)."""

    def reappend(self, rest) -> None:
        """Rows after(end) handed out before a compression, written back after the kept ones."""
        self.append(*rest)

    def after(self, end: int) -> tuple[mx.array, mx.array]:
        """The held keys and values after row end [B, H, held - end, D]."""
        return self.keys[:, :, end : self.held], self.values[:, :, end : self.held]

    def settle(self, state: RowState, next_position: int, B: int, H: int) -> None:
        """Make state [B*H, n, ...] the held rows, all scored, in buffers [B, H, ...] with
        room to decode; the next token held will be at next_position. Keys and values of
        more rows than the scores' n are such buffers already (the merge engine's kernels
        write the survivors into them, camkv.backends.merge_ops.compress) and are adopted
        as they are; others are copied into new ones."""
        n = state.scores.shape[1]
        if state.keys.shape[1] > n:
            keys, values = (a.reshape(B, H, a.shape[1], -1) for a in state[:2])
        else:
            spare = self.room_after(n)
            keys, values = (with_room([], a.reshape(B, H, n, -1), spare) for a in state[:2])
        self.adopt(keys, values, state.scores, state.positions, next_position, state.votes, state.threshold)

    def stored_for_launch(self) -> tuple | None:
        """What a one-launch drop compression copies in place of keys and values: None,
        the rows themselves (quantized rows' compression hands over their codes, scales and
        biases: camkv.quantized)."""
        return None

    def adopt(self, keys, values, scores, positions, next_position: int, votes=None, threshold=None) -> None:
        """Make buffers keys, values [B, H, size, D], whose first n rows (n = scores' [B*H, n])
        are scored, the held rows, all settled; the next token held will be at next_position."""
        self.keys, self.values, self.scores, self.positions = keys, values, scores, positions
        self.votes, self.threshold = votes, threshold
        self.held = self.settled = scores.shape[1]
        self.pending_start = next_position

    def load(self, keys, values, scores, positions, votes, threshold, next_position: int,
             settled: int | None = None) -> None:
        """Hold saved rows (keys [B, H, n, Dk], values, scores, positions, votes [B, H, n]
        and threshold [B, H] or None, as held_rows and rule_state give them), the first
        `settled` (all by default) scored and the rest pending (the scores, positions and
        votes pending rows have); the next token at next_position."""
        B, H, n, _ = keys.shape
        R = B * H
        settled = n if settled is None else settled
        self.settle(RowState(
            keys.reshape(R, n, -1), values.reshape(R, n, -1),
            scores.reshape(R, n)[:, :settled].astype(mx.float32),
            positions.reshape(R, n)[:, :settled].astype(mx.int32),
            None if votes is None else votes.reshape(R, n)[:, :settled].astype(mx.float32),
            None if threshold is None else threshold.reshape(R).astype(mx.float32),
        ), next_position - (n - settled), B, H)
        self.appended_elsewhere(n - settled)

    def held_rows(self, B: int, H: int) -> tuple:
        """(keys, values, scores, positions) of the rows held [B, H, held, ...], the pending
        rows' score 0 (nothing changes)."""
        scores, positions, _ = self._scored(self.held)
        keys, values = self.held_arrays(self.held)
        return keys, values, scores.reshape(B, H, -1), positions.reshape(B, H, -1)

    def rule_state(self, B: int, H: int) -> tuple:
        """(votes [B, H, held], threshold [B, H]) of a rule that keeps them (None where not);
        a pending row's vote is 1 (it stands for its own token)."""
        votes = None if self.votes is None else self._scored(self.held)[2]
        return (None if votes is None else votes.reshape(B, H, -1),
                None if self.threshold is None else self.threshold.reshape(B, H))

    def arrays(self) -> list[mx.array]:
        """The arrays a compression writes (to start computing them)."""
        return [a for a in (self.keys, self.values, self.scores, self.positions, self.votes) if a is not None]

    def start_computing(self) -> None:
        """Start computing the arrays a compression wrote now, not when the caller evaluates.

        A prompt chunk is evaluated once for all layers (mlx-lm evaluates every cache's
        state after a chunk), and MLX then ran the compressions last: every layer's
        uncompressed rows and scoring inputs were alive at once, the whole peak memory of
        a short prompt (random llama, 16 layers, 1k prompt on the CPU: 1.20x the full
        cache's peak, 0.75x with this). Queued, not waited for: the model's next layers
        are built meanwhile.
        """
        mx.async_eval(*self.arrays())

    def lend(self) -> tuple:
        """The held keys and values as stored (as_stored); these buffers hold nothing until
        take_back."""
        lent = self.as_stored()
        self.keys = self.values = None
        return lent

    def take_back(self, keys, values) -> None:
        """Hold again what lend handed over (the same rows, maybe moved), with room to
        decode in place."""
        spare = self.room_after(self.held)
        self.keys, self.values = self.held_with_room(keys, spare), self.held_with_room(values, spare)

    @staticmethod
    def held_with_room(stored: mx.array, spare: int) -> mx.array:
        """A new buffer of stored keys or values [B, H, n, D] with spare empty rows after."""
        return with_room([], stored, spare)

    def votes_bias(self, B: int, H: int) -> mx.array | None:
        """The log votes of the rows held [B, H, held] (0 for pending rows: one token each),
        or None when the rule keeps no votes. Votes change only when they are replaced (a
        compression, a load), so the log votes of the settled rows, zeros after them, are
        made once per votes array, and a decode step takes a view of them instead of three
        operations (a launch each on a GPU) at every layer."""
        if self.votes is None:
            return None
        made = self.__dict__.get("_votes_bias")  # (the votes it was made of, [B, H, length])
        if made is None or made[0] is not self.votes or made[1].shape[2] < self.held:
            length = max(self.capacity, self.held)
            pending = mx.zeros((B * H, length - self.votes.shape[1]), mx.float32)
            made = (self.votes, mx.concatenate([mx.log(self.votes), pending], axis=1).reshape(B, H, length))
            self._votes_bias = made
        return made[1][:, :, : self.held]

    def copy(self) -> "RowBuffers":
        """An independent copy: slice assignment rebinds an mx.array object in place, so
        every array gets a new object."""
        clone = object.__new__(type(self))
        clone.__dict__.update({k: mx.array(v) if isinstance(v, mx.array) else v for k, v in self.__dict__.items()})
        return clone
