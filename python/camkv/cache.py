"""CaMKVCache: one layer's bounded KV cache, speaking mlx-lm's cache protocol."""

from __future__ import annotations

import json
import warnings

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import _BaseCache

from . import backends, fast, hook, mass, merges
from .backends._common import STORAGE_DTYPES
from .config import CaMConfig, resolve_config
from .rows import RowState


class QueryScoringWarning(RuntimeWarning):
    """scoring="query" scored a block with keys: the model's queries did not reach the cache."""


class VotesWarning(RuntimeWarning):
    """A merge rule that keeps votes (keepkv): the model attended without weighing rows by them."""


_MERGE_BATCH = 64  # compressions whose merge counts are summed at once
_KEY_SCORED = "keys"  # how pending tokens scored by their own keys are queued
_GROWTH_STEP = 256  # most empty rows a buffer is given at once (mlx-lm KVCache's step)


def _every_query(queries: mx.array, s_len: int) -> mx.array:
    """A chunk's queries [R, G, S, Dk] from its last T kept ones [R, G, T, Dk] (window
    scoring keeps only those): zeros in front, which window scoring never reads."""
    kept = queries.shape[2]
    if kept == s_len:
        return queries
    unread = mx.zeros((*queries.shape[:2], s_len - kept, queries.shape[3]), queries.dtype)
    return mx.concatenate([unread, queries], axis=2)


def _with_room(before: list, block: mx.array, spare: int) -> mx.array:
    """A buffer [B, H, n, D]: the arrays `before`, then block, then `spare` empty rows
    (none when spare <= 0), joined along the token axis. Always a new array object, even
    for block alone: later writes into the buffer must not reach the caller's array
    (MLX's slice assignment rebinds the object it is given)."""
    parts = [*before, block]
    if spare > 0:
        parts.append(mx.zeros((*block.shape[:2], spare, block.shape[3]), block.dtype))
    return mx.concatenate(parts, axis=2) if len(parts) > 1 else mx.array(block)


class CaMKVCache(_BaseCache):
    """A KV cache that holds at most `budget + slack` tokens per (batch, KV head) row.

    Amortized eviction (docs/algorithm.md section 7): a call writes its keys and values
    into a preallocated buffer in place and returns views of every row held (what the
    model's mask was built for), keeping what scoring the new tokens needs (their
    queries, or nothing with key scoring). Once the rows would pass budget + slack, the
    tokens since the last compression are scored as one chunk and evicted (and merged)
    back to budget, in the same call. With slack=0 that happens at every call over the
    budget: the exact per-token rule.

    head_offset and n_heads_global place this cache's heads among the model's heads
    when they are sharded over processes, so the gate draws what an unsharded run
    draws (docs/algorithm.md section 1).

    With scoring="query" a block waits for the model's queries, which camkv's attention
    hook hands over right after update_and_fetch (observe_queries). When no hook can
    feed the cache (it was built directly and no hook is installed, its model's
    attention does not call mlx-lm's scaled_dot_product_attention, or the hook was
    removed) the block is scored with its keys, with one QueryScoringWarning per cache.
    A model that bypasses an installed hook is caught at the next call: the waiting
    block is scored with keys, and it warns once.

    A merge rule that carries state (camkv.merges: keepkv's votes, d2o's threshold)
    keeps it beside the rows, through compressions, copies and the saved state; with
    votes, attention_bias() hands the hook each returned row's log votes, and a model
    that attends without asking for them is warned once (VotesWarning).
    """

    # camkv.batch.BatchCaMKVCache, set by that module (which imports this one; the
    # package imports it), so merge needs no import back into camkv.batch.
    batch_class = None

    def __init__(
        self,
        config: CaMConfig | None = None,
        *,
        head_offset: int = 0,
        n_heads_global: int | None = None,
        **fields,
    ):
        self._config = resolve_config(config, fields)
        backends.require_usable(self._config.backend)
        if head_offset < 0:
            raise ValueError(f"head_offset must be >= 0, got {head_offset}")
        if n_heads_global is not None and n_heads_global <= head_offset:
            raise ValueError(
                f"n_heads_global ({n_heads_global}) must exceed head_offset ({head_offset})"
            )
        self._head_offset = head_offset
        self._n_heads_global = n_heads_global
        self._reset()

    def _reset(self) -> None:
        # Rows held: [B, H, capacity, D] buffers, the first _held rows in use. The first
        # _settled of them are scored (scores, positions [B*H, _settled]); the rest are
        # pending: positions _pending_start.., scored at the next compression.
        self._keys: mx.array | None = None
        self._values: mx.array | None = None
        self._held = 0
        self._settled = 0
        self._scores: mx.array | None = None
        self._positions: mx.array | None = None
        self._pending_start = 0
        # How the pending tokens are scored: the attention scale of their queries, which
        # wait in _query_buffer [B, Hq, k, Dk] (the first k pending rows') and then one per
        # decode step in _query_steps (joined once, when read: a write per step into a
        # buffer is an array operation per layer and token, host time a GPU step pays),
        # or _KEY_SCORED; None while nothing is pending.
        self._queued = None
        # With prefill_scoring="window": whether the pending tokens came in blocks of
        # several (prompt chunks, scored by their last queries) or one at a time (decode
        # steps, scored by every query). The two never share a compression.
        self._windowed = False
        self._query_buffer: mx.array | None = None
        self._query_steps: list[mx.array] = []
        self._waiting = 0  # tokens of the last call that wait for their queries
        self._step_queries: tuple | None = None  # a decode step's queries' shape, once checked
        self._layout: tuple | None = None  # (B, H, Dk, Dv, dtype) fixed by the first call
        self._checked_block: tuple | None = None  # (keys shape, values shape, dtype) last checked
        # The state of a merge rule that keeps one (camkv.merges): each settled row's votes
        # [B*H, _settled] (pending rows stand for one token each) and each row's moving
        # similarity threshold [B*H]; None for the other rules.
        self._votes: mx.array | None = None
        self._threshold: mx.array | None = None
        # The log-votes of the rows the last call returned [B, H, n] (attention weighs each
        # row by its votes, section 4.6), and whether attention has not asked for them yet.
        self._fetched_bias: mx.array | None = None
        self._bias_unread = False
        self._merges = mx.zeros((), mx.int32)
        self._merge_counts: list[mx.array] = []  # per-compression [rows] counts not yet summed
        self._evictions = 0
        self.offset = 0
        self._query_scored = 0  # tokens scored with the model's queries
        self.model_type: str | None = None  # set by make_prompt_cache, for warnings
        # The modules whose attention hook feeds this cache (set by make_prompt_cache);
        # None for a cache built directly, which any hooked model may feed.
        self.hook_modules: frozenset[str] | None = None
        self._warned: set[str] = set()
        self._row_ids_for: tuple | None = None  # ((B, H), row ids) of _row_ids
        self._backend_for: tuple | None = None  # ((name, device), module) of _backend
        self._decode_config_for: tuple | None = None  # (config, its decode-step form) of _chunk_config
        # camkv.batch sets _defer_one_launch around a decode step's observe_queries so that
        # rows due at the same step compress in one launch together: a one-launch
        # compression then waits in _deferred ((its fast.DropLaunch, next position)) for
        # _finish_deferred.
        self._defer_one_launch = False
        self._deferred: tuple | None = None

    # ------------------------------------------------------------------ config
    @property
    def config(self) -> CaMConfig:
        return self._config

    @config.setter
    def config(self, value: CaMConfig) -> None:
        if not isinstance(value, CaMConfig):
            raise ValueError(f"config must be a CaMConfig, got {type(value).__name__}")
        if not self.empty() and value != self._config:
            raise ValueError(
                "cannot change a CaMKVCache's config mid-sequence; make a new cache"
            )
        self._config = value

    # ------------------------------------------------------------------ protocol
    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Hold S new tokens per row; return (held ++ new keys, held ++ new values) [B, H, n + S, D]."""
        # A decode step repeats the last block's shapes: one comparison stands for the
        # checks (host time is most of a GPU decode step's cost).
        block = (keys.shape, values.shape, keys.dtype) if type(keys) is type(values) is mx.array else None
        if block is None or block != self._checked_block:
            self._check_block(keys, values)
            self._layout = (*keys.shape[:2], keys.shape[3], values.shape[3], keys.dtype)
            self._checked_block = block
        if self._waiting:
            self._flush_pending_with_keys()
        self._warn_if_votes_unread()
        fetched = self._append(keys, values)
        self._took(keys.shape[2])
        return fetched

    def _took(self, S: int) -> None:
        """What follows the write of S new tokens after the held rows."""
        if self._votes is not None or self._fetched_bias is not None:
            self._keep_fetched_bias()
        # The model computed RoPE from offset before this call; it advances now, even
        # when scoring waits for the queries.
        self.offset += S
        if self._config.scoring == "query" and self._queries_can_come():
            self._waiting = S
        else:
            if self._config.scoring == "query":
                self._warn_once("no_hook", self._no_hook_message(), stacklevel=4)
            self._queue(_KEY_SCORED, S)

    def observe_queries(self, queries: mx.array, scale: float) -> None:
        """The model's queries [B, Hq, S, Dk] for the tokens waiting ("query" scoring)."""
        if self._continues_decoding(queries, scale):
            # What _queue does for such a step, without its checks (host time is most of
            # a GPU decode step's cost, and every layer pays this at every token).
            self._waiting = 0
            self._query_scored += 1
            self._query_steps.append(queries)
            if self._compression_due():
                self._compress()
            return
        if not self._waiting:
            return  # nothing waits: a model without camkv scoring, or a repeated call
        B, H, Dk = self._layout[:3]
        S, shape = self._waiting, queries.shape
        if len(shape) != 4 or shape[0] != B or shape[2] != S:
            raise ValueError(
                f"queries {tuple(shape)} do not match the block waiting for them "
                f"(B={B}, S={S}); expected [B, query heads, S, Dk]"
            )
        if shape[1] % H != 0:
            raise ValueError(
                f"query heads {shape[1]} are not a multiple of the KV heads {H}"
            )
        self._waiting = 0
        self._step_queries = (B, shape[1], 1, Dk)
        if shape[3] != Dk:
            # MLA models (deepseek_v3 and kin) cache a compressed latent, and their
            # prompt queries do not live in its space: there is nothing to score with.
            self._warn_once("width", (
                f"camkv: model {self.model_type or '(unknown type)'} attends with queries "
                f"of width {queries.shape[3]} over cached keys of width {Dk} "
                "(a compressed latent cache); scoring those blocks with keys instead. Pass "
                "scoring='key' to score all blocks the same way."))
            self._queue(_KEY_SCORED, S)
            return
        self._query_scored += S
        self._queue(float(scale), S, queries)

    def _continues_decoding(self, queries, scale) -> bool:
        """Whether these are one decode step's queries that only join those kept: one token
        waits, its queries have the shape the checks passed before, the pending tokens were
        decode steps queued under this scale, and each kept its queries."""
        return (self._waiting == 1 and type(scale) is float and scale == self._queued and not self._windowed
                and queries.shape == self._step_queries
                and self._kept_query_rows() == self._held - self._settled - 1)

    def attention_bias(self) -> mx.array | None:
        """What attention adds to each logit of the rows the last call returned [B, H, n]:
        the log of each row's votes (merge rules with keeps_votes, docs/algorithm.md section
        4.6), or None when every row stands for one token. camkv's attention hook asks."""
        self._bias_unread = False
        return self._fetched_bias

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        self._flush_pending_with_keys()
        if window_size is not None:
            raise NotImplementedError(
                "CaMKVCache serves full-attention layers only; sliding-window layers keep "
                "mlx-lm's own RotatingKVCache"
            )
        if N == 1:
            return None
        if return_array:
            return create_causal_mask(N, self.size())
        return "causal"

    def size(self) -> int:
        """Tokens held per row (at most budget + slack), not the absolute position (see offset)."""
        return self._held

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
        gets a new object; the backend module (which cannot be copied) is resolved again."""
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        for name, value in self.__dict__.items():
            if isinstance(value, mx.array):
                setattr(clone, name, mx.array(value))
        clone._merge_counts = list(self._merge_counts)
        clone._query_steps = list(self._query_steps)
        clone._warned = set(self._warned)
        clone._row_ids_for = None
        clone._backend_for = None
        memo[id(self)] = clone
        return clone

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n: int) -> int:
        raise NotImplementedError(
            "CaMKVCache cannot be trimmed: evicted and merged tokens cannot be restored"
        )

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        raise NotImplementedError(
            "CaMKVCache cannot be quantized (kv_bits); use it without kv_bits"
        )

    @property
    def nbytes(self) -> int:
        """Bytes of the rows held: keys, values, scores and positions (the pending rows'
        scores counted as the float32 each will take)."""
        if self._layout is None:
            return 0
        B, H, Dk, Dv, dtype = self._layout
        rule_state = (4 * self._held if self._votes is not None else 0) + (4 if self._threshold is not None else 0)
        return B * H * (self._held * ((Dk + Dv) * dtype.size + 8) + rule_state)

    @property
    def keys(self):
        """Held keys [B, H, n, Dk] (None while empty), as mlx-lm's KVCache.keys.

        Settable (same shape) because mlx-lm's pipelined models attach their send to
        the last layer's state with `cache[-1].keys = mx.depends(cache[-1].keys, h)`,
        so evaluating the cache states also sends to the next rank.
        """
        return None if self.empty() else self._keys[:, :, : self._held]

    @keys.setter
    def keys(self, value) -> None:
        current = self.keys
        if current is None:
            raise ValueError("CaMKVCache.keys cannot be set while the cache is empty")
        if not isinstance(value, mx.array) or value.shape != current.shape:
            raise ValueError(
                "CaMKVCache.keys can only be replaced by an array of the held keys' shape "
                f"{tuple(current.shape)}"
            )
        self._keys[:, :, : self._held] = value

    @property
    def values(self):
        """Held values [B, H, n, Dv] (None while empty), as mlx-lm's KVCache.values."""
        return None if self.empty() else self._values[:, :, : self._held]

    # ------------------------------------------------------------------ inspection
    def stored(self):
        """(keys [B,H,n,Dk], values [B,H,n,Dv], scores [B,H,n] f32, positions [B,H,n] i32)
        of every row held; a pending row's score includes its chunk's mass so far (what
        the next compression will add), without changing the cache."""
        self._flush_pending_with_keys()
        if self._keys is None:
            raise ValueError("the cache is empty: nothing stored yet")
        B, H = self._layout[:2]
        rows = self._held_rows()
        if self._queued is not None:
            rows = rows._replace(scores=rows.scores + self._pending_mass(rows))
        return tuple(a.reshape(B, H, self._held, *a.shape[2:]) for a in rows[:4])

    def _pending_mass(self, rows: RowState) -> mx.array:
        """The mass the pending rows' queries give every held row [B*H, held] (sections 2
        and 3: only the observation window's with prefill_scoring="window"; weighed by the
        rows' votes where the rule keeps them)."""
        queries, scale = self._chunk_queries(self._held)
        cfg = self._chunk_config()
        s_len = self._held - self._settled
        if rows.votes is None:
            return mass.chunk_mass(queries, rows.keys, scale, self._settled, cfg, s_len, fast.reducer())
        # Votes weigh attention (a reference-only rule): the reference's arithmetic.
        return mass.chunk_mass(queries, rows.keys, scale, self._settled, cfg, s_len, mass.EXACT_WHOLE,
                               bias=mx.log(rows.votes))

    @property
    def stats(self) -> dict:
        """Counters: tokens_seen, query_scored (tokens scored with the model's queries),
        evictions and merges (summed over rows); plus rows, stored and budget."""
        self._flush_pending_with_keys()
        rows = 0 if self._layout is None else self._layout[0] * self._layout[1]
        return {
            "tokens_seen": self.offset,
            "query_scored": self._query_scored,
            "evictions": self._evictions,
            "merges": int(self._total_merges().item()),
            "rows": rows,
            "stored": self.size(),
            "budget": self._config.budget,
        }

    # ------------------------------------------------------------------ state
    @property
    def state(self):
        """(keys, values, scores, positions, merges, meta JSON), then (votes [B, H, n],
        threshold [B, H]) for a merge rule that keeps them (None where it keeps only one, or
        while empty). Reading it first scores the pending tokens (a compression, evicting
        back to the budget when more are held), so a saved cache holds only scored rows."""
        self._flush_pending_with_keys()
        self._compress()
        meta = {
            "offset": self.offset,
            "config": json.loads(self._config.to_json()),
            "head_offset": self._head_offset,
            "n_heads_global": self._n_heads_global,
            "evictions": self._evictions,
            "query_scored": self._query_scored,
        }
        if self._keys is None:
            return (None, None, None, None, self._total_merges(), json.dumps(meta)) + self._rule_state()
        keys, values, scores, positions = self.stored()
        return (keys, values, scores, positions, self._total_merges(), json.dumps(meta)) + self._rule_state()

    def _rule_state(self) -> tuple:
        """The state items of a merge rule that keeps votes or a threshold (none otherwise)."""
        rule = merges.rule(self._config.merge)
        if not (rule.keeps_votes or rule.moving_threshold):
            return ()
        if self._layout is None:
            return (None, None)
        B, H = self._layout[:2]
        votes = None if self._votes is None else self._votes.reshape(B, H, -1)
        threshold = None if self._threshold is None else self._threshold.reshape(B, H)
        return (votes, threshold)

    @state.setter
    def state(self, v) -> None:
        keys, values, scores, positions, merges, meta_json = v[:6]
        meta = json.loads(meta_json)
        config = CaMConfig(**meta["config"])
        self._config = config
        self._head_offset = meta["head_offset"]
        self._n_heads_global = meta["n_heads_global"]
        self._reset()
        self.offset = meta["offset"]
        self._evictions = meta["evictions"]
        self._query_scored = meta.get("query_scored", 0)  # absent from older files
        self._merges = mx.array(merges, mx.int32)
        if keys is None:
            return
        B, H, n, Dk = keys.shape
        if n > config.budget:
            raise ValueError(f"a saved CaMKVCache holds {n} rows, more than its budget {config.budget}")
        self._layout = (B, H, Dk, values.shape[3], keys.dtype)
        votes, threshold = tuple(v[6:8]) + (None,) * (8 - max(6, len(v)))  # absent for most rules
        self._settle_rows(RowState(
            keys.reshape(B * H, n, Dk),
            values.reshape(B * H, n, -1),
            scores.reshape(B * H, n).astype(mx.float32),
            positions.reshape(B * H, n).astype(mx.int32),
            None if votes is None else votes.reshape(B * H, n).astype(mx.float32),
            None if threshold is None else threshold.reshape(B * H).astype(mx.float32),
        ), self.offset)

    # ------------------------------------------------------------------ batch hooks
    # camkv.batch decodes rows that only append in one shared rectangle: it writes every
    # such row's key, value and query itself and tells the row later (_decoded_elsewhere,
    # and _appended_elsewhere for a step whose queries have not come); the row's buffers
    # live in the rectangle meanwhile (_lend_buffers) and come back before the row does
    # anything else (_take_back_buffers).

    def _decodes_plainly(self) -> bool:
        """Whether a one-token step would only write its key, value and query after the
        held rows: no compression due, no block waiting, scored by the model's queries
        like the pending rows, no votes to weigh attention by."""
        cfg = self._config
        return (self._layout is not None and not self._waiting and self._votes is None
                and cfg.scoring == "query" and self._steps_before_compression() >= 1
                and (self._queued is None or (self._queued is not _KEY_SCORED and not self._windowed))
                and self._queries_can_come())

    def _appended_elsewhere(self) -> None:
        """A one-token step whose key and value a batch wrote (_decodes_plainly was true):
        what update_and_fetch does besides the write."""
        self._held += 1
        self._took(1)

    def _decoded_elsewhere(self, steps: int, scale: float) -> None:
        """`steps` one-token steps whose keys, values and queries (under scale) a batch
        wrote, each allowed by _decodes_plainly: what their update_and_fetch and
        observe_queries calls would have counted, at once."""
        if not steps:
            return
        self._held += steps
        self.offset += steps
        self._query_scored += steps
        if self._queued is None:
            self._queued, self._windowed = scale, False
        self._fetched_bias, self._bias_unread = None, False

    def _pending_queries(self) -> int:
        """Pending rows whose queries are kept (_kept_queries: the buffer's, then the steps')."""
        if self._queued is None or self._queued is _KEY_SCORED:
            return 0
        return self._held - self._settled - self._waiting

    def _lend_buffers(self):
        """(held keys [B, H, held, Dk], values, the pending rows' queries [B, Hq, p, Dk] or
        None); this cache holds no buffers until _take_back_buffers."""
        p = self._pending_queries()
        lent = (self.keys, self.values, self._kept_queries()[:, :, :p] if p else None)
        self._keys = self._values = None
        self._release_queries()
        return lent

    def _take_back_buffers(self, keys, values, queries) -> None:
        """Hold again what _lend_buffers handed over (the same rows, maybe moved), keys and
        values with room to decode in place."""
        spare = self._room_after(self._held)
        self._keys, self._values = _with_room([], keys, spare), _with_room([], values, spare)
        self._query_buffer = queries

    # ------------------------------------------------------------------ internals
    def _check_block(self, keys, values) -> None:
        """Reject bad input before anything changes."""
        if not isinstance(keys, mx.array) or not isinstance(values, mx.array):
            raise ValueError("keys and values must be mx.array")
        if keys.ndim != 4 or values.ndim != 4:
            raise ValueError(
                f"keys and values must be 4-D [B, H, S, D], got {keys.ndim}-D and {values.ndim}-D"
            )
        if keys.shape[:3] != values.shape[:3]:
            raise ValueError(
                f"keys {tuple(keys.shape)} and values {tuple(values.shape)} differ in B, H or S"
            )
        if keys.shape[2] == 0:
            raise ValueError("update_and_fetch needs at least one token (S >= 1)")
        if keys.dtype != values.dtype:
            raise ValueError(f"keys are {keys.dtype} but values are {values.dtype}")
        # The first block fixes the layout every later block is held to, so it is held to
        # what a compression can take before anything is stored.
        if keys.dtype not in STORAGE_DTYPES:
            raise ValueError(f"keys and values must be float16, bfloat16 or float32, got {keys.dtype}")
        sizes = {"B": keys.shape[0], "H": keys.shape[1], "Dk": keys.shape[3], "Dv": values.shape[3]}
        for name, size in sizes.items():
            if size == 0:
                raise ValueError(f"keys and values must have {name} >= 1, got keys "
                                 f"{tuple(keys.shape)} and values {tuple(values.shape)}")
        heads_end = self._head_offset + keys.shape[1]
        if self._n_heads_global is not None and heads_end > self._n_heads_global:
            raise ValueError(
                f"this cache's heads {self._head_offset}..{heads_end - 1} do not fit in "
                f"the model's {self._n_heads_global} heads (head_offset, n_heads_global)"
            )
        if self._layout is not None:
            B, H, Dk, Dv, dtype = self._layout
            got = (keys.shape[0], keys.shape[1], keys.shape[3], values.shape[3], keys.dtype)
            if got != self._layout:
                raise ValueError(
                    f"(B, H, Dk, Dv, dtype) changed mid-sequence: the cache holds "
                    f"{(B, H, Dk, Dv, dtype)}, the call has {got}"
                )

    def _steps_before_compression(self) -> int:
        """Tokens the rows held can take before they pass budget + slack and a compression
        is due (docs/algorithm.md section 7); negative once it is."""
        return self._config.budget + self._config.slack - self._held

    def _compression_due(self) -> bool:
        return self._steps_before_compression() < 0

    def _capacity(self) -> int:
        """Rows a decode needs in place: budget + slack held, plus the step that compresses."""
        return self._config.budget + self._config.slack + 1

    def _room_after(self, held: int) -> int:
        """Empty rows a new buffer gets after `held` rows: up to the capacity, at most
        _GROWTH_STEP (a short prompt under a large budget would otherwise allocate the
        whole budget + slack at once; mlx-lm's KVCache grows in the same steps)."""
        return max(0, min(self._capacity() - held, _GROWTH_STEP))

    def _append(self, keys, values):
        """Write the block after the held rows (in place when it fits); return the views
        [B, H, held + S, D] of keys and values."""
        S = keys.shape[2]
        end = self._held + S
        if self._scores is None:
            R = keys.shape[0] * keys.shape[1]
            self._scores, self._positions = mx.zeros((R, 0), mx.float32), mx.zeros((R, 0), mx.int32)
        if self._keys is not None and end <= self._keys.shape[2]:
            self._keys[:, :, self._held : end] = keys
            self._values[:, :, self._held : end] = values
        else:
            # A first call or a long block: one new buffer, with room for decoding after.
            spare = self._room_after(end)
            self._keys = self._joined(self._keys, keys, spare)
            self._values = self._joined(self._values, values, spare)
        self._held = end
        return self._keys[:, :, :end], self._values[:, :, :end]

    def _joined(self, buffer, block, spare: int):
        """The held rows of buffer (if any), then block, then spare empty rows."""
        return _with_room([] if buffer is None else [buffer[:, :, : self._held]], block, spare)

    def _queue(self, scale, block: int, queries=None) -> None:
        """Keep what scoring the last `block` tokens held need (their queries under scale,
        or _KEY_SCORED), then compress if the rows held passed budget + slack."""
        windowed = self._config.prefill_scoring == "window" and block > 1
        if self._queued is not None and (self._queued != scale or self._windowed != windowed):
            # Pending tokens scored another way (keys, another scale, or under window
            # scoring prompt blocks against decode steps) are scored first.
            self._compress(self._held - block)
        if self._queued is None:
            self._queued, self._windowed = scale, windowed
        if queries is not None:
            self._keep_queries(queries, self._held - self._settled - block)
        if self._compression_due():
            self._compress()

    def _keep_queries(self, queries, start: int) -> None:
        """Keep a block's queries [B, Hq, S, Dk] as those of pending rows start.. (after the
        rows kept so far)."""
        if self._windowed:
            self._keep_window_queries(queries, start)
        elif queries.shape[2] == 1 and start == self._kept_query_rows():
            self._query_steps.append(queries)
        else:
            kept = self._kept_queries()
            self._query_buffer = mx.concatenate([kept[:, :, :start], queries], axis=2) if start else queries

    def _kept_query_rows(self) -> int:
        buffered = 0 if self._query_buffer is None else self._query_buffer.shape[2]
        return buffered + len(self._query_steps)

    def _kept_queries(self) -> mx.array | None:
        """The pending rows' kept queries as one array [B, Hq, k, Dk] (None when none):
        the decode steps' joined onto the buffer in one operation."""
        if self._query_steps:
            parts = ([] if self._query_buffer is None else [self._query_buffer]) + self._query_steps
            self._query_buffer = mx.concatenate(parts, axis=2) if len(parts) > 1 else parts[0]
            self._query_steps = []
        return self._query_buffer

    def _keep_window_queries(self, queries, start: int) -> None:
        """Window scoring reads only the last observation_window queries of the pending
        span (docs/algorithm.md section 3): keep a copy of those, not the prompt block's
        [B, Hq, S, Dk], which every layer would otherwise hold until its compression runs
        (the peak memory of a short prompt)."""
        kept = self._kept_queries()
        joined = mx.concatenate([kept, queries], axis=2) if start and kept is not None else queries
        self._query_buffer = mx.contiguous(joined[:, :, -self._config.observation_window :])

    def _held_rows(self, end: int | None = None) -> RowState:
        """Rows [0, end) held as a RowState [B*H, end, ...]; pending rows score 0."""
        end = self._held if end is None else end
        B, H = self._layout[:2]
        R, pending = B * H, end - self._settled
        positions = self._pending_start + mx.arange(pending, dtype=mx.int32)
        return RowState(
            self._keys[:, :, :end].reshape(R, end, -1),
            self._values[:, :, :end].reshape(R, end, -1),
            mx.concatenate([self._scores, mx.zeros((R, pending), mx.float32)], axis=1),
            mx.concatenate([self._positions, mx.broadcast_to(positions, (R, pending))], axis=1),
            None if self._votes is None else mx.concatenate([self._votes, mx.ones((R, pending), mx.float32)],
                                                            axis=1),
            self._threshold,
        )

    def _chunk_queries(self, end: int):
        """The queries of pending rows [settled, end) as [B*H, G, T, Dk] and their scale:
        T = S, every pending row's, except for prompt blocks under window scoring, where
        only the last min(S, observation_window) were kept (the only ones that add mass;
        camkv.fast takes the chunk's length apart from its queries, _every_query pads
        them for the backends that take one query block per token)."""
        B, H = self._layout[:2]
        S = end - self._settled
        if self._queued is _KEY_SCORED:
            keys = self._keys[:, :, self._settled : end]
            return fast.key_queries(keys.reshape(B * H, S, -1))
        queries = self._kept_queries()[:, :, :S]
        # Query head h * G + g belongs to KV head h.
        return queries.reshape(B * H, queries.shape[1] // H, queries.shape[2], -1), self._queued

    def _compress(self, end: int | None = None) -> None:
        """Score pending rows [settled, end) as one chunk and evict back to the budget
        (docs/algorithm.md section 7). Rows after end (a block not queued yet) stay pending."""
        end = self._held if end is None else end
        chunk = end - self._settled
        if self._queued is None or chunk <= 0:
            return
        queries, scale = self._chunk_queries(end)
        self._evictions += max(0, end - self._config.budget) * queries.shape[0]
        rest = (self._keys[:, :, end : self._held], self._values[:, :, end : self._held])
        if self._drops_in_one_launch(end):
            launch = fast.DropLaunch(self._keys, self._values, end, self._scores, self._positions, queries,
                                     self._pending_start, scale, self._chunk_config(), self._capacity())
            if self._defer_one_launch and end == self._held:
                # camkv.batch runs it with the other rows due at this step (_finish_deferred).
                self._deferred = (launch, self._pending_start + chunk)
                return
            self._adopt_buffers(*fast.compress_drop_buffers(*launch), self._pending_start + chunk)
        else:
            state, merges = self._run_backend(queries, scale, end)
            self._merge_counts.append(merges)
            if len(self._merge_counts) >= _MERGE_BATCH:
                self._total_merges()
            self._settle_rows(state, self._pending_start + chunk)
        self._release_queries()
        if rest[0].shape[2]:
            self._append(*rest)
        if chunk > self._config.slack + 1:
            self._start_prompt_compression()

    def _start_prompt_compression(self) -> None:
        """Start computing a prompt block's compression now, not when the caller evaluates.

        A prompt chunk is evaluated once for all layers (mlx-lm evaluates every cache's
        state after a chunk), and MLX then ran the compressions last: every layer's
        uncompressed rows and scoring inputs were alive at once, the whole peak memory of
        a short prompt (random llama, 16 layers, 1k prompt on the CPU: 1.20x the full
        cache's peak, 0.75x with this). Queued, not waited for: the model's next layers
        are built meanwhile. A decode step's compression is left to the step's evaluation.
        """
        arrays = [a for a in (self._keys, self._values, self._scores, self._positions, self._votes) if a is not None]
        mx.async_eval(*arrays)

    def _release_queries(self) -> None:
        """After a compression: the queries of the rows it scored go (every kept one: a
        block not queued yet keeps its queries after the compression)."""
        self._query_buffer, self._query_steps = None, []

    def _finish_deferred(self, outputs) -> None:
        """Adopt what the one-launch compression deferred under _defer_one_launch returned
        (keys, values, scores, positions: compress_drop_buffers' outputs for this row)."""
        next_position = self._deferred[1]
        self._deferred = None
        self._adopt_buffers(*outputs, next_position)
        self._release_queries()

    def _drops_in_one_launch(self, end: int) -> bool:
        """Whether this compression evicts with merge="drop" on an NVIDIA GPU, where one
        kernel launch (backends.compact_cuda) chooses, compacts and copies the survivors."""
        return (end > self._config.budget and self._config.prefill == "chunk"
                and merges.rule(self._config.merge).kind == merges.DROP
                and self._config.eviction == "score" and getattr(self._backend(), "target", None) == "cuda" and fast.on_cuda())

    def _adopt_buffers(self, keys, values, scores, positions, next_position: int, votes=None, threshold=None
                       ) -> None:
        """Make buffers keys, values [B, H, capacity, D], whose first n rows (n = scores' [B*H, n])
        are scored, the held rows, all settled; the next token held will be at next_position."""
        self._keys, self._values, self._scores, self._positions = keys, values, scores, positions
        self._votes, self._threshold = votes, threshold
        self._held = self._settled = scores.shape[1]
        self._queued = None
        self._pending_start = next_position

    def _run_backend(self, queries, scale, end: int):
        """The compression of rows [settled, end) by the configured backend."""
        cfg = self._chunk_config()
        backend = self._backend()
        n, R = self._settled, queries.shape[0]
        if (merges.rule(cfg.merge).kind == merges.DROP and getattr(backend, "target", None) and end - n > 1
                and cfg.prefill == "chunk"):
            # On a GPU dropping a chunk needs no kernel: batched products, a partition and a
            # gather use the whole device, where the kernel core runs one work group per row.
            # (On the CPU the extension's one pass per row is faster than MLX's operations.)
            # Exact mode scores token by token (docs/algorithm.md section 2): the kernel.
            kept = fast.compress_drop(self._keys[:, :, :end].reshape(R, end, -1),
                                      self._values[:, :, :end].reshape(R, end, -1), self._scores,
                                      self._positions, queries, self._pending_start, scale, cfg)
            return kept, mx.zeros((R,), mx.int32)
        rows = self._held_rows(end)
        before = rows.first(n)
        new = [a[:, n:end] for a in rows[:2]]
        key_scored = self._queued is _KEY_SCORED
        q = None if key_scored else _every_query(queries, end - n).transpose(0, 2, 1, 3)
        return backend.update(before, *new, self._pending_start, cfg, self._row_ids(*self._layout[:2]),
                              q, None if key_scored else scale)

    def _chunk_config(self) -> CaMConfig:
        """The config the pending tokens are compressed under: prefill_scoring="window"
        applies to prompt blocks only; decode steps are scored by every query."""
        if self._config.prefill_scoring == "window" and not self._windowed:
            # Made once per config: a decode compression would otherwise validate a new
            # CaMConfig per layer (host time, most of a GPU decode step's cost).
            if self._decode_config_for is None or self._decode_config_for[0] is not self._config:
                self._decode_config_for = (self._config, self._config.replace(prefill_scoring="causal", pool=1))
            return self._decode_config_for[1]
        return self._config

    def _settle_rows(self, state: RowState, next_position: int) -> None:
        """Make state [B*H, n, ...] the held rows, all scored, in a buffer with room to
        decode; the next token held will be at next_position."""
        B, H = self._layout[:2]
        n = state.length
        spare = self._room_after(n)
        keys, values = (_with_room([], a.reshape(B, H, n, -1), spare) for a in state[:2])
        self._adopt_buffers(keys, values, state.scores, state.positions, next_position, state.votes, state.threshold)

    def _row_ids(self, B: int, H: int) -> mx.array:
        # Made once per shape: on a GPU every small array op of a decode step costs a
        # launch, and this one would otherwise be five of them per layer and token.
        if self._row_ids_for is None or self._row_ids_for[0] != (B, H):
            heads = self._n_heads_global or H
            b = mx.arange(B, dtype=mx.uint32)[:, None]
            h = mx.arange(H, dtype=mx.uint32)[None, :] + self._head_offset
            ids = (b * heads + h).reshape(-1)
            mx.eval(ids)
            self._row_ids_for = ((B, H), ids)
        return self._row_ids_for[1]

    def _backend(self):
        # Resolved once per backend name and device, not per call: resolving asks
        # every backend whether it is usable, host work a decode step pays per layer.
        key = (self._config.backend, mx.default_device())
        if self._backend_for is None or self._backend_for[0] != key:
            self._backend_for = (key, backends.resolve(self._config.backend, self._config.merge))
        return self._backend_for[1]

    def _total_merges(self) -> mx.array:
        """Merges so far (a scalar), folding in the per-call counts."""
        if self._merge_counts:
            self._merges = self._merges + mx.concatenate(self._merge_counts).sum()
            self._merge_counts = []
        return self._merges

    def _queries_can_come(self) -> bool:
        """Whether an installed attention hook can hand this cache the block's queries."""
        return hook.can_feed(self.hook_modules)

    def _no_hook_message(self) -> str:
        model = self.model_type or "(unknown type)"
        if self.hook_modules is None:
            why = ("no camkv attention hook is installed (the cache was built directly); "
                   "build the caches with camkv.make_prompt_cache(model, ...) or call "
                   "camkv.apply(model, ...) to score with the model's queries")
        elif not self.hook_modules:
            why = (f"model {model}'s attention does not call mlx-lm's "
                   "scaled_dot_product_attention, so the hook cannot see its queries")
        else:
            why = f"the attention hook of model {model} was removed (camkv.remove)"
        return (f"camkv: CaMKVCache(scoring='query') gets no queries: {why}. Scoring with "
                "keys instead; pass scoring='key' to choose that and silence this warning.")

    def _warn_once(self, kind: str, message: str, stacklevel: int = 4, category=QueryScoringWarning) -> None:
        # Once per cache and kind. Every layer's cache warns with the same text from the
        # same line of the model's attention (stacklevel points there), so Python's
        # default filter shows it once per model, not once per layer.
        if kind in self._warned:
            return
        self._warned.add(kind)
        warnings.warn(message, category, stacklevel=stacklevel)

    def _keep_fetched_bias(self) -> None:
        """Record the attention bias of the rows just returned, before a compression this
        call may run changes the rows."""
        self._fetched_bias = self._votes_bias()
        self._bias_unread = self._fetched_bias is not None

    def _votes_bias(self) -> mx.array | None:
        """The log votes of the rows held [B, H, held] (0 for pending rows: one token each),
        or None when the rule keeps no votes."""
        if self._votes is None:
            return None
        B, H = self._layout[:2]
        pending = mx.zeros((B * H, self._held - self._settled), mx.float32)
        return mx.concatenate([mx.log(self._votes), pending], axis=1).reshape(B, H, self._held)

    def _warn_if_votes_unread(self) -> None:
        """Rows that stand for several tokens whose attention never asked for their votes:
        the model attended as if each stood for one (no hook, or a model bypassing it)."""
        if self._bias_unread:
            self._bias_unread = False
            self._warn_once("votes", (
                f"camkv: merge={self._config.merge!r} weighs each row by its votes in attention, "
                f"but model {self.model_type or '(unknown type)'} attended without asking for them (no "
                "camkv attention hook, or its attention bypasses mlx-lm's scaled_dot_product_attention); "
                "its merged rows counted as one token each. Build the caches with "
                "camkv.make_prompt_cache(model, ...) or call camkv.apply(model, ...)."), category=VotesWarning)

    def _flush_pending_with_keys(self) -> None:
        """A block the model never showed its queries for: score it with its keys, warn once."""
        if not self._waiting:
            return
        self._warn_once("bypass", (
            f"camkv: model {self.model_type or '(unknown type)'} computed attention without "
            "passing its queries to the cache (it bypasses mlx-lm's "
            "scaled_dot_product_attention); scoring that block with keys instead. Pass "
            "scoring='key' to score all blocks the same way."))
        block, self._waiting = self._waiting, 0
        self._queue(_KEY_SCORED, block)
