"""CaMKVCache: one layer's bounded KV cache, speaking mlx-lm's cache protocol."""

from __future__ import annotations

import json

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import _BaseCache

from . import attention_rows, backends, cache_bytes, cache_input, gate, hook, merges, policy, quantized, tier
from .backends import quantized_cuda, step_cuda
from .backends.compress import Chunk, compress
from .backends.drop import DropLaunch
from .batch_row import BatchRow
from .buffers import capacity_for
from .cache_input import QueryScoringWarning, VotesWarning
from .cache_inspection import CacheInspection
from .cache_state import CacheState
from .config import CaMConfig, resolve_config
from .pending import KEY_SCORED, PendingChunk

__all__ = ["CaMKVCache", "QueryScoringWarning", "VotesWarning"]

_MERGE_BATCH = 64  # compressions whose merge counts may wait unevaluated


class CaMKVCache(BatchRow, CacheState, CacheInspection, _BaseCache):
    """A KV cache that holds at most `budget + slack` tokens per (batch, KV head) row.

    Amortized eviction (docs/algorithm.md section 7): a call writes its keys and values
    in place and returns views of every row held, keeping what scoring them needs. Once
    the rows would pass budget + slack, the tokens since the last compression are scored
    as one chunk and evicted (and merged) back to budget in the same call (slack=0: the
    exact per-token rule). Rows: camkv.buffers.RowBuffers; what scores the pending ones:
    camkv.pending.PendingChunk; a compression: camkv.backends.compress.compress.

    head_offset and n_heads_global place this cache's heads among the model's heads
    when they are sharded over processes, so the gate draws what an unsharded run
    draws (docs/algorithm.md section 1).

    With scoring="query" a block waits for the model's queries, which camkv's attention
    hook hands over right after update_and_fetch (observe_queries). With no hook to feed
    it (none installed, or a model whose attention bypasses mlx-lm's function) a block is
    scored with its keys, with one QueryScoringWarning per cache.

    A merge rule's state (camkv.merges: keepkv's votes, d2o's threshold) follows the rows
    through compressions, copies and the saved state; attention_bias() hands the hook the
    rows' log votes, and attention that never asks is warned once (VotesWarning).

    Parts of its own: what camkv.batch asks of a row (camkv.batch_row), the state mlx-lm
    saves and loads (camkv.cache_state), what a caller reads of the rows and counters
    (camkv.cache_inspection); how rows reach attention is camkv.attention_rows'.
    """

    # camkv.batch.BatchCaMKVCache, set by that module (which imports this one; the
    # package imports it), so merge needs no import back into camkv.batch.
    batch_class = None

    def __init__(self, config: CaMConfig | None = None, *, head_offset: int = 0, n_heads_global: int | None = None,
                 **fields):
        self._use_config(resolve_config(config, fields))
        backends.require_usable(self._config.backend)
        cache_input.check_head_placement(head_offset, n_heads_global)
        self._head_offset = head_offset
        self._n_heads_global = n_heads_global
        self._reset()

    def _reset(self) -> None:
        self._rows = quantized.row_buffers(self._config)
        self._tier = tier.of_config(self._config)
        self._pending = PendingChunk()
        self._waiting = 0  # tokens of the last call that wait for their queries
        self._step_queries: tuple | None = None  # a decode step's queries' shape, once checked
        self._plain_step: tuple | None = None  # (keys shape, values shape, dtype): the short way (_short_way_rows)
        self._layout: tuple | None = None  # (B, H, Dk, Dv, dtype) fixed by the first call
        self._checked_block: tuple | None = None  # (keys shape, values shape, dtype) last checked
        # The log-votes of the rows the last call returned [B, H, n] (attention weighs each
        # row by its votes, section 4.6), and whether attention has not asked for them yet.
        self._fetched_bias: mx.array | None = None
        self._bias_unread = False
        self._merges = mx.array(0, mx.int32)  # the merges so far, each compression's result
        self._merges_unevaluated = 0  # compressions since the count was last evaluated
        self._evictions = 0
        self.offset = 0
        self._query_scored = 0  # tokens scored with the model's queries
        self.model_type: str | None = None  # set by make_prompt_cache, for warnings
        # The modules whose attention hook feeds this cache (set by make_prompt_cache);
        # None for a cache built directly, which any hooked model may feed.
        self.hook_modules: frozenset[str] | None = None
        self._warned: set[str] = set()
        self._row_ids_for: tuple | None = None  # ((B, H), row ids) of _row_ids
        self._backend_for: tuple | None = None  # ((name, device), backend) of _backend
        self._deferred = None  # a one-launch compression held for the batch (deferred_launch)
        self._holding = False  # prompt blocks stay pending past budget + slack (hold_prompt)

    # ------------------------------------------------------------------ config
    @property
    def config(self) -> CaMConfig:
        return self._config

    @config.setter
    def config(self, value: CaMConfig) -> None:
        cache_input.check_new_config(value, self._config, self.empty())
        self._use_config(value)
        self._plain_step = None
        self._rows.steps_fused = False
        self._rows = quantized.row_buffers(value) if self.empty() else self._rows
        self._tier = tier.of_config(value) if self.empty() else self._tier
        self._rows.capacity = capacity_for(value)

    def _use_config(self, config: CaMConfig) -> None:
        """Hold config, and with it `bits` and `group_size` where attention reads the rows
        quantized (camkv.attention_rows.quantized_fields: mlx-lm's attention takes a cache
        that has bits for a quantized one). Plain attributes, absent elsewhere: mlx-lm asks
        hasattr(cache, "bits") at every layer and step, a failed lookup, nothing raised."""
        self._config = config
        # The state's meta reads it after every prompt chunk, per layer: encoded once.
        self._config_fields = json.loads(config.to_json())
        for name in attention_rows.QUANTIZED_FIELDS:
            self.__dict__.pop(name, None)
        self.__dict__.update(attention_rows.quantized_fields(config))

    # ------------------------------------------------------------------ protocol
    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Hold S new tokens per row; return (held ++ new keys, held ++ new values) [B, H, n + S, D]."""
        step, rows = self._plain_step, self._rows
        if (step is not None and not self._waiting and type(keys) is type(values) is mx.array
                and keys.shape == step[0] and values.shape == step[1] and keys.dtype == step[2]
                and rows.has_room() and self._queries_can_come()):
            # A decode step of _short_way_rows after one scored with its queries:
            # update_stored's work, unchecked.
            self.offset += 1
            self._waiting = 1
            fetched = rows.write_in_place(keys, values)
            if rows.votes is not None:  # the log votes of the rows fetched, as _took takes them
                self._warn_if_votes_unread()
                self._take_bias()
            return fetched
        fetched = self.update_stored(keys, values)
        # Plain rows (no quantization, no tier) go to attention as held.
        return fetched if self._config.bits is None and self._tier is None else self._for_attention(fetched)

    def update_stored(self, keys: mx.array, values: mx.array):
        """update_and_fetch's work; returns the rows held before any compression it ran,
        as stored (arrays, or quantized triples): what a batch's rectangle holds."""
        # A decode step repeats the last block's shapes: one comparison stands for the
        # checks (host time is most of a GPU decode step's cost).
        block = (keys.shape, values.shape, keys.dtype) if type(keys) is type(values) is mx.array else None
        if block is None or block != self._checked_block:
            cache_input.check_block(keys, values, self._layout, self._head_offset, self._n_heads_global)
            if self._config.bits is not None or self._config.tier_budget:
                quantized.check_dims(keys.shape[3], values.shape[3], self._config)
            self._layout = (*keys.shape[:2], keys.shape[3], values.shape[3], keys.dtype)
            self._checked_block = block
        if self._waiting:
            self.flush_pending()
        if self._bias_unread:
            self._warn_if_votes_unread()
        fetched = self._rows.append(keys, values)
        self._took(block[0][2])
        return fetched

    def _for_attention(self, fetched):
        """The rows held (fetched: as stored) as attention reads them (camkv.attention_rows)."""
        if hasattr(self, "bits"):  # mlx-lm's attention reads them as stored
            return fetched
        rows, quantized_on_cuda = self._rows, attention_rows.hook_reads_stored(self._config)  # no tier
        if quantized_on_cuda and self._waiting > 1 and rows.held == fetched[0][0].shape[2]:
            # A prompt block on MLX's CUDA build (its tokens wait for their queries: nothing
            # compressed since the write), which attention reads dequantized: dequantized
            # from the whole buffers (MLX's CUDA dequantize copies a view of some rows first).
            return rows.held_arrays(rows.held)
        hook_reads = quantized_on_cuda and self._query_scored > 0 and self._queries_can_come()  # having fed it
        return attention_rows.for_attention(fetched, rows, self._tier, self._layout, hook_reads)

    def _took(self, S: int) -> None:
        """What follows the write of S new tokens after the held rows."""
        if self._rows.votes is not None or self._fetched_bias is not None:
            self._take_bias()  # before a compression this call may run
        # The model computed RoPE from offset before this call; it advances now, even
        # when scoring waits for the queries.
        self.offset += S
        if self._config.scoring == "query" and self._queries_can_come():
            self._waiting = S
        else:
            if self._config.scoring == "query":
                cache_input.warn_once(self._warned, "no_hook", cache_input.no_hook(self.model_type, self.hook_modules))
            self._queue(KEY_SCORED, S)

    def observe_queries(self, queries: mx.array, scale: float, defer_launch: bool = False) -> bool:
        """The model's queries [B, Hq, S, Dk] for the tokens waiting ("query" scoring); whether
        attention may read the rows just fetched as they are (a decode step of _short_way_rows:
        the hook's short way). defer_launch (camkv.batch): hold a one-launch compression due
        now (deferred_launch)."""
        # A copy of its own where mlx-lm's quantized attention reads this cache (it has
        # bits): that attention runs `queries *= scale` on the caller's array, and kept
        # queries scaled so would score the pending tokens at scale squared. No other
        # attention changes its queries, and the copy is a launch per layer and step.
        if "bits" in self.__dict__:  # hasattr(self, "bits"), without a failed lookup's cost
            queries = mx.array(queries)
        if self._continues_decoding(queries, scale):
            # _queue's work for such a step without its checks (host time, every layer and token).
            if self._plain_step is None and self._short_way_rows(queries):
                self._plain_step = self._checked_block
                self._rows.steps_fused = self._fuses_steps(queries)
            self._waiting = 0
            self._query_scored += 1
            self._pending.add_step(queries)
            if self._rows.held >= self._rows.capacity:  # steps_before_compression() < 0
                self._compress(defer_launch=defer_launch)
            # Rows that votes weigh go through the hook's bias (attention_bias), not straight on.
            return self._plain_step is not None and self._rows.votes is None
        if not self._waiting:
            return False  # nothing waits: a model without camkv scoring, or a repeated call
        B, H, Dk = self._layout[:3]
        S = self._waiting
        cache_input.check_queries(queries.shape, B, H, S)
        self._waiting = 0
        self._step_queries = (B, queries.shape[1], 1, Dk)
        if queries.shape[3] != Dk:
            cache_input.warn_once(self._warned, "width", cache_input.other_width(self.model_type, queries.shape[3], Dk))
            self._queue(KEY_SCORED, S)
            return False
        self._query_scored += S
        self._queue(float(scale), S, queries, defer_launch)
        return False

    def _continues_decoding(self, queries, scale) -> bool:
        """Whether one decode step's queries only join those kept: one token waits, queries of the
        checked shape, and the pending tokens are decode steps of this scale that kept theirs."""
        rows = self._rows
        return (self._waiting == 1 and queries.shape == self._step_queries
                and self._pending.takes_step(scale, rows.held - rows.settled - 1))

    def _short_way_rows(self, queries: mx.array) -> bool:
        """Whether a decode step's rows are written and go to attention as held
        (update_and_fetch's and the hook's short way; rows that votes weigh take the
        write's short way, then the hook's bias): no tier, and the rows plain or, on MLX's
        CUDA build, quantized rows without votes that camkv's pass reads as stored
        (camkv.backends.quantized_cuda takes these queries and rows)."""
        cfg, rows = self._config, self._rows
        if self._tier is not None:
            return False
        if cfg.bits is None:
            return True
        return (rows.votes is None and attention_rows.hook_reads_stored(cfg)
                and quantized_cuda.takes(queries, *rows.quantized_views(), cfg.bits, cfg.group_size))

    def _fuses_steps(self, queries: mx.array) -> bool:
        """Whether the short way's decode steps write and attend quantized rows in one
        launch (camkv.backends.step_cuda: MLX's CUDA build, shapes it takes), decided
        once: for buffers of the capacity, up to which decoding grows them."""
        cfg, rows = self._config, self._rows
        return (step_cuda.FUSED_STEPS and cfg.bits is not None and quantized_cuda.here()
                and step_cuda.takes(queries, rows.keys, rows.values, self._layout[4], cfg.bits, cfg.group_size,
                                    rows.capacity))

    def _take_bias(self) -> None:
        """The log votes of the rows just fetched, for attention_bias (None without votes)."""
        self._fetched_bias = self.votes_bias()
        self._bias_unread = self._fetched_bias is not None

    def attention_bias(self) -> mx.array | None:
        """What attention adds to each logit of the rows the last call returned [B, H, n]:
        the log of each row's votes (merge rules with keeps_votes, docs/algorithm.md section
        4.6), or None when every row stands for one token. camkv's attention hook asks."""
        self._bias_unread = False
        return self._fetched_bias

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        self.flush_pending()
        if window_size is not None:
            raise NotImplementedError("CaMKVCache serves full-attention layers only; sliding-window layers keep "
                                      "mlx-lm's own RotatingKVCache")
        if N == 1:
            return None
        return create_causal_mask(N, self.size()) if return_array else "causal"

    def size(self) -> int:
        """Tokens held per row, the rows attention reads (at most budget + slack, plus
        tier_budget in the tier), not the absolute position (see offset)."""
        return self._rows.held + (0 if self._tier is None else self._tier.size)

    def empty(self) -> bool:
        return self._layout is None

    def merge(self, caches):
        """One batch cache of per-request caches (mlx-lm's batch protocol, as KVCache.merge).

        mlx-lm calls `caches[0][i].merge([...])` when it batches requests, and its server
        batches only when every layer's cache has `merge`: a BatchCaMKVCache keeps every
        row compressed (camkv.batch, docs/batching.md).
        """
        return self.batch_class.merge(caches)

    def __deepcopy__(self, memo):
        """An independent copy: mlx-lm copies caches (the server's prompt cache, splitting a
        prompt batch). Slice assignment rebinds an mx.array object in place, so every array
        gets a new object; the backend (which cannot be copied) is resolved again."""
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        for name, value in self.__dict__.items():
            if isinstance(value, mx.array):
                setattr(clone, name, mx.array(value))
        clone._rows, clone._pending = self._rows.copy(), self._pending.copy()
        clone._tier = None if self._tier is None else self._tier.copy()
        clone._warned = set(self._warned)
        clone._row_ids_for = clone._backend_for = None
        memo[id(self)] = clone
        return clone

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n: int) -> int:
        raise NotImplementedError("CaMKVCache cannot be trimmed: evicted and merged tokens cannot be restored")

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        raise NotImplementedError("CaMKVCache is not converted mid-sequence (kv_bits); build it quantized: "
                                  "CaMConfig(bits=..., group_size=...), --kv-bits on the command line")

    @property
    def nbytes(self) -> int:
        """Bytes of the rows held: keys, values (quantized: codes, scales and biases),
        scores and positions, a rule's state, a tier's rows (camkv.cache_bytes.held)."""
        return cache_bytes.held(self._layout, self._config, self._rows, self._tier)

    def bytes_bound(self) -> int:
        """Most bytes the rows may hold between calls: budget + slack main rows and
        tier_budget tier rows a head (0 while empty)."""
        return cache_bytes.bound(self._layout, self._config)

    @property
    def row_bytes(self) -> int:
        """Bytes one stored row (a token of one KV head) takes: key, value, score, position."""
        return cache_bytes.stored_row(self._layout, self._config)

    @property
    def keys(self):
        """Held keys [B, H, n, Dk] (None while empty), as mlx-lm's KVCache.keys; with
        bits set the stored triple (codes, scales, biases), as its QuantizedKVCache.keys.

        Settable (same shapes) because mlx-lm's pipelined models attach their send to
        the last layer's state with `cache[-1].keys = mx.depends(cache[-1].keys, h)`,
        so evaluating the cache states also sends to the next rank.
        """
        return None if self.empty() else self._rows.as_stored()[0]

    @keys.setter
    def keys(self, value) -> None:
        current = self.keys
        if current is None:
            raise ValueError("CaMKVCache.keys cannot be set while the cache is empty")
        self._rows.overwrite_keys(cache_input.keys_replacing(current, value))

    @property
    def values(self):
        """Held values [B, H, n, Dv] (None while empty), as mlx-lm's KVCache.values (with
        bits set the stored triple, as keys)."""
        return None if self.empty() else self._rows.as_stored()[1]

    def attended(self):
        """The held keys and values as attention reads them (what update_and_fetch returns)."""
        return self._for_attention(self._rows.as_stored())

    # ------------------------------------------------------------------ state
    def compress_pending(self, mass: mx.array | None = None) -> None:
        """Score the tokens held since the last compression now, as one chunk (a block that
        waits for its queries is scored with its keys first, with its warning), evicting
        back to the budget when more are held: an early compression (docs/algorithm.md
        section 7). camkv.save_prompt_cache calls it, so a saved file holds at most budget
        rows, all scored, and no queries. mass [B, H, pending]: the pending rows' mass,
        handed in instead of their queries' (camkv.reconstruct's re-read)."""
        self.flush_pending()
        self._compress(mass=None if mass is None else cache_input.given_mass(mass, self._layout, self._rows))

    def hold_prompt(self, on: bool) -> None:
        """While on, a prompt block that takes the rows past budget + slack stays pending
        until compress_pending (camkv.reconstruct re-reads it first); decode steps and
        blocks of another kind compress as always."""
        self._holding = bool(on)

    # ------------------------------------------------------------------ rows
    def votes_bias(self) -> mx.array | None:
        """The log votes of the rows held [B, H, held] (0 for pending rows: one token
        each), or None when the rule keeps no votes."""
        return self._rows.votes_bias(*self._layout[:2]) if self._rows.votes is not None else None

    def steps_before_compression(self) -> int:
        """Tokens the rows held can take before they pass budget + slack and a compression
        is due (docs/algorithm.md section 7); negative once it is. (The buffers' capacity is
        budget + slack + 1, camkv.buffers.capacity_for.)"""
        return self._rows.capacity - 1 - self._rows.held

    def flush_pending(self) -> None:
        """A block the model never showed its queries for: score it with its keys, warn once."""
        if not self._waiting:
            return
        cache_input.warn_once(self._warned, "bypass", cache_input.bypassed(self.model_type))
        block, self._waiting = self._waiting, 0
        self._queue(KEY_SCORED, block)

    # ------------------------------------------------------------------ compression
    def _queue(self, kind, block: int, queries=None, defer_launch: bool = False) -> None:
        """Keep what scoring the last `block` tokens held need (their queries under scale
        kind, or KEY_SCORED), then compress if the rows held passed budget + slack."""
        windowed = policy.windowed(self._config) and block > 1
        if self._pending.differs(kind, windowed):
            # Pending tokens scored another way are scored first.
            self._compress(self._rows.held - block)
        self._pending.start(kind, windowed)
        if queries is not None:
            self._pending.keep(queries, self._rows.pending - block, self._config.observation_window)
        if self.steps_before_compression() < 0 and not (self._holding and block > 1):
            self._compress(defer_launch=defer_launch)

    def _compress(self, end: int | None = None, defer_launch: bool = False, mass: mx.array | None = None) -> None:
        """Score pending rows [settled, end) as one chunk and evict back to the budget
        (docs/algorithm.md section 7). Rows after end (a block not queued yet) stay pending.
        mass [B*H, end]: the chunk's mass handed in (compress_pending)."""
        rows = self._rows
        end = rows.held if end is None else end
        chunk = end - rows.settled
        if self._pending.kind is None or chunk <= 0:
            return
        B, H = self._layout[:2]
        work = rows.for_compression(end)  # rows itself; quantized rows hand over dequantized ones
        before = work.rows(end) if self._tier is not None else None  # the evicted go to the tier
        pending_keys = work.keys[:, :, rows.settled : end].reshape(B * H, chunk, -1)
        queries, scale = self._pending.queries(pending_keys, H)
        self._evictions += max(0, end - self._config.budget) * B * H
        rest = rows.after(end) if end < rows.held else None
        request = Chunk(end, queries, scale, self._pending.key_scored, self._pending.config(self._config),
                        self._row_ids(B, H), mass, self._merges)
        merged = compress(self._backend(), work, request, may_defer=defer_launch and end == rows.held and work is rows)
        if isinstance(merged, DropLaunch):
            self._deferred = merged  # camkv.batch runs it with the other rows due at this step
            return
        rows.compressed(work, may_change_rows=merges.rule(self._config.merge).kind != merges.DROP)
        if before is not None:
            self._tier.absorb_evicted(before, rows.positions)
        self._pending.settled()
        if merged is not None:
            self._count_merges(merged)
        self._pending.release()
        if rest is not None:
            rows.reappend(rest)
        if chunk > self._config.slack + 1:  # a prompt block's (a decode step's waits for the step)
            rows.start_computing()

    def _row_ids(self, B: int, H: int) -> mx.array:
        # Made once per shape: on a GPU every small array op of a decode step costs a
        # launch, and this one would otherwise be five of them per layer and token.
        if self._row_ids_for is None or self._row_ids_for[0] != (B, H):
            self._row_ids_for = ((B, H), gate.row_ids(B, H, self._head_offset, self._n_heads_global))
        return self._row_ids_for[1]

    def _backend(self):
        # Resolved once per backend name and device, not per call: resolving asks
        # every backend whether it is usable, host work a decode step pays per layer.
        key = (self._config.backend, mx.default_device())
        if self._backend_for is None or self._backend_for[0] != key:
            self._backend_for = (key, backends.resolve(self._config.backend))
        return self._backend_for[1]

    def _count_merges(self, so_far: mx.array) -> None:
        """Take a compression's merges so far as the count. mlx-lm evaluates the state after
        each prompt chunk: where the merge kernels ran, the count is their own output and
        reading it costs no launch. Elsewhere each compression adds a sum to it: evaluated
        every _MERGE_BATCH compressions, so an unread count's graph stays short."""
        self._merges = so_far
        self._merges_unevaluated += 1
        if self._merges_unevaluated >= _MERGE_BATCH:
            mx.async_eval(so_far)
            self._merges_unevaluated = 0

    # ------------------------------------------------------------------ warnings
    def _queries_can_come(self) -> bool:
        """Whether an installed attention hook can hand this cache the block's queries."""
        return hook.can_feed(self.hook_modules)

    def _warn_if_votes_unread(self) -> None:
        """Rows that stand for several tokens whose attention never asked for their votes:
        the model attended as if each stood for one (no hook, or a model bypassing it)."""
        if self._bias_unread:
            self._bias_unread = False
            cache_input.warn_once(self._warned, "votes", cache_input.votes_unread(self._config.merge, self.model_type),
                                  category=VotesWarning)
