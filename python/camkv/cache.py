"""CaMKVCache: one layer's bounded KV cache, speaking mlx-lm's cache protocol."""

from __future__ import annotations

import json
import warnings

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import _BaseCache

from . import backends
from .backends._common import concatenate_rows
from .config import CaMConfig, resolve_config
from .reference import RowState, bias_with_new_rows


class QueryScoringWarning(RuntimeWarning):
    """scoring="query" scored a block with keys: the model's queries did not reach the cache."""


_MERGE_BATCH = 64  # calls whose merge counts are summed at once


class CaMKVCache(_BaseCache):
    """A KV cache that holds at most `budget` tokens per (batch, KV head) row.

    update_and_fetch returns the rows stored before the call followed by the new
    tokens (what the model's mask was built for); the eviction and merging of
    ALGORITHM.md happen in the same call and show from the next call on.

    head_offset and n_heads_global place this cache's heads among the model's
    heads when they are sharded over processes, so the gate draws what an
    unsharded run draws (ALGORITHM.md section 1).

    With scoring="query" a block waits in update_and_fetch for the model's queries,
    which camkv's attention hook hands over right after (observe_queries). When no
    hook can feed the cache (it was built directly and no hook is installed, its
    model's attention does not call mlx-lm's scaled_dot_product_attention, or the
    hook was removed) the block is scored with its keys at once, with one
    QueryScoringWarning per cache. A model that bypasses an installed hook is
    caught at the next call: the waiting block is scored with keys, and it warns once.
    """

    def __init__(
        self,
        config: CaMConfig | None = None,
        *,
        head_offset: int = 0,
        n_heads_global: int | None = None,
        **fields,
    ):
        self._config = resolve_config(config, fields)
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
        self._rows: RowState | None = None
        self._layout: tuple | None = None  # (B, H, Dk, Dv, dtype) fixed by the first call
        self._pending: tuple | None = None  # (keys, values) waiting for queries ("query" scoring)
        self._merges = mx.zeros((), mx.int32)
        self._merge_counts: list[mx.array] = []  # per-call [rows] counts not yet summed in
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
        # mass_bias: the logit bias [B, H, L] of the rows the last update_and_fetch
        # returned, which the attention hook adds (None: nothing to add).
        self._fetched_bias: mx.array | None = None

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
        """Store S new tokens per row; return (stored ++ new keys, stored ++ new values)."""
        self._check_block(keys, values)
        self._flush_pending_with_keys()
        fetched = self._fetch(keys, values)
        start = self.offset
        if self._config.scoring == "query" and self._queries_can_come():
            self._pending = (keys, values, start)
        else:
            if self._config.scoring == "query":
                self._warn_once("no_hook", self._no_hook_message(), stacklevel=3)
            self._absorb(keys, values, start, None, None)
        # The model computed RoPE from offset before this call; it advances now, even
        # when the update itself waits for the queries.
        self._layout = (*keys.shape[:2], keys.shape[3], values.shape[3], keys.dtype)
        self.offset = start + keys.shape[2]
        return fetched

    def observe_queries(self, queries: mx.array, scale: float) -> None:
        """The model's queries [B, Hq, S, Dk] for the pending block ("query" scoring)."""
        if self._pending is None:
            return
        keys, values, start = self._pending
        B, H, S, _ = keys.shape
        if queries.ndim != 4 or queries.shape[0] != B or queries.shape[2] != S:
            raise ValueError(
                f"queries must be [B={B}, Hq, S={S}, Dk], got {tuple(queries.shape)}"
            )
        if queries.shape[1] % H != 0:
            raise ValueError(
                f"query heads {queries.shape[1]} are not a multiple of the KV heads {H}"
            )
        self._pending = None
        if queries.shape[3] != keys.shape[3]:
            # MLA models (deepseek_v3 and kin) cache a compressed latent, and their
            # prompt queries do not live in its space: there is nothing to score with.
            self._warn_once("width", (
                f"camkv: model {self.model_type or '(unknown type)'} attends with queries "
                f"of width {queries.shape[3]} over cached keys of width {keys.shape[3]} "
                "(a compressed latent cache); scoring those blocks with keys instead. Pass "
                "scoring='key' to score all blocks the same way."))
            self._absorb(keys, values, start, None, None)
            return
        groups = queries.shape[1] // H
        # [B, H*G, S, D] -> [B*H, S, G, D]: query head h*G + g belongs to KV head h. A
        # decode step (S = 1) has that layout already: a reshape, not a transposed copy.
        if S == 1:
            q = queries.reshape(B * H, 1, groups, -1)
        else:
            q = queries.reshape(B, H, groups, S, -1).transpose(0, 1, 3, 2, 4).reshape(B * H, S, groups, -1)
        self._absorb(keys, values, start, q, scale)
        self._query_scored += S

    def attention_mask(self, mask, queries: mx.array):
        """The mask for attention over the rows the last update_and_fetch returned:
        mlx-lm's mask (None, "causal" or an array) plus, with mass_bias, each row's
        logit bias, as one additive array [B, Hq, S or 1, L] in the queries' dtype."""
        bias = self._fetched_bias
        if bias is None:
            return mask
        B, H, L = bias.shape
        groups = queries.shape[1] // H
        # Query head h * G + g attends over KV head h's rows.
        bias = mx.repeat(bias, groups, axis=1)[:, :, None, :]
        if isinstance(mask, str):
            if mask != "causal":
                raise ValueError(f"camkv's attention bias cannot join mask {mask!r}")
            mask = create_causal_mask(queries.shape[2], L - queries.shape[2])
        if mask is not None:
            if mask.dtype == mx.bool_:
                bias = mx.where(mask, bias, -float("inf"))
            else:
                bias = bias + mask
        return bias.astype(queries.dtype)

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
        """Tokens held per row (at most budget), not the absolute position (see offset)."""
        self._flush_pending_with_keys()
        return 0 if self._rows is None else self._rows.length

    def empty(self) -> bool:
        return self._layout is None

    # No `merge` method on purpose: mlx-lm takes its presence to mean "batchable"
    # (the server would then batch requests), and without it batch generation stops
    # with mlx-lm's own error naming this class instead of losing the compression.

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
        """Bytes really held: keys, values, scores and positions."""
        self._flush_pending_with_keys()
        if self._rows is None:
            return 0
        return sum(a.nbytes for a in self._rows.arrays())

    @property
    def keys(self):
        """Stored keys [B, H, n, Dk] (None while empty), as mlx-lm's KVCache.keys.

        Settable (same shape) because mlx-lm's pipelined models attach their send to
        the last layer's state with `cache[-1].keys = mx.depends(cache[-1].keys, h)`,
        so evaluating the cache states also sends to the next rank.
        """
        return None if self.empty() else self.stored()[0]

    @keys.setter
    def keys(self, value) -> None:
        current = self.keys
        if current is None:
            raise ValueError("CaMKVCache.keys cannot be set while the cache is empty")
        if not isinstance(value, mx.array) or value.shape != current.shape:
            raise ValueError(
                "CaMKVCache.keys can only be replaced by an array of the stored keys' shape "
                f"{tuple(current.shape)}"
            )
        self._rows = self._rows._replace(keys=value.reshape(self._rows.keys.shape))

    # ------------------------------------------------------------------ inspection
    def stored(self):
        """(keys [B,H,n,Dk], values [B,H,n,Dv], scores [B,H,n] f32, positions [B,H,n] i32)."""
        self._flush_pending_with_keys()
        if self._rows is None:
            raise ValueError("the cache is empty: nothing stored yet")
        B, H = self._layout[:2]
        n = self._rows.length
        return (
            self._rows.keys.reshape(B, H, n, -1),
            self._rows.values.reshape(B, H, n, -1),
            self._rows.scores.reshape(B, H, n),
            self._rows.positions.reshape(B, H, n),
        )

    def stored_bias(self):
        """mass_bias: each stored row's logit bias [B, H, n] float32; None without it."""
        self._flush_pending_with_keys()
        if self._rows is None or self._rows.bias is None:
            return None
        B, H = self._layout[:2]
        return self._rows.bias.reshape(B, H, -1)

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
        self._flush_pending_with_keys()
        meta = {
            "offset": self.offset,
            "config": json.loads(self._config.to_json()),
            "head_offset": self._head_offset,
            "n_heads_global": self._n_heads_global,
            "evictions": self._evictions,
            "query_scored": self._query_scored,
        }
        if self._rows is None:
            return (None, None, None, None, self._total_merges(), json.dumps(meta))
        keys, values, scores, positions = self.stored()
        state = (keys, values, scores, positions, self._total_merges(), json.dumps(meta))
        if self._rows.bias is not None:
            state += (self._rows.bias.reshape(scores.shape),)  # mass_bias only
        return state

    @state.setter
    def state(self, v) -> None:
        keys, values, scores, positions, merges, meta_json = v[:6]
        bias = v[6] if len(v) > 6 else None  # mass_bias caches only
        meta = json.loads(meta_json)
        self._config = CaMConfig(**meta["config"])
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
        self._layout = (B, H, Dk, values.shape[3], keys.dtype)
        self._rows = RowState(
            keys.reshape(B * H, n, Dk),
            values.reshape(B * H, n, -1),
            scores.reshape(B * H, n).astype(mx.float32),
            positions.reshape(B * H, n).astype(mx.int32),
            None if bias is None else bias.reshape(B * H, n).astype(mx.float32),
        )

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

    def _fetch(self, keys, values):
        self._fetched_bias = self._bias_for_fetch(keys.shape[2])
        if self._rows is None:
            return keys, values
        # The kernel backends join keys and values in one operation of their own;
        # the reference (and a block of another dtype, which its update rejects) concatenates.
        fetch = getattr(self._backend(), "fetch", concatenate_rows)
        if keys.dtype != self._rows.keys.dtype:
            fetch = concatenate_rows
        B, H, S, _ = keys.shape
        fetched = fetch(self._rows.keys, self._rows.values, keys.reshape(B * H, S, -1), values.reshape(B * H, S, -1))
        return tuple(a.reshape(B, H, a.shape[1], -1) for a in fetched)

    def _bias_for_fetch(self, new_tokens: int):
        """mass_bias: the stored rows' bias followed by 0 for each new token, [B, H, L];
        None when no bias is held."""
        if self._rows is None or self._rows.bias is None:
            return None
        B, H = self._layout[:2]
        return bias_with_new_rows(self._rows.bias, new_tokens).reshape(B, H, -1)

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

    def _absorb(self, keys, values, start, queries, scale) -> None:
        """Run the backend's fused update on the block at positions start..; keys/values [B, H, S, D]."""
        B, H, S, Dk = keys.shape
        rows = self._rows or RowState.empty(B * H, Dk, values.shape[3], keys.dtype)
        self._rows, merges = self._backend().update(
            rows,
            keys.reshape(B * H, S, Dk),
            values.reshape(B * H, S, -1),
            start,
            self._config,
            self._row_ids(B, H),
            queries,
            scale,
        )
        # Summed in batches: two more small operations per layer and token are two
        # more launches on a GPU.
        self._merge_counts.append(merges)
        if len(self._merge_counts) >= _MERGE_BATCH:
            self._total_merges()
        self._evictions += max(0, rows.length + S - self._config.budget) * B * H

    def _backend(self):
        # Resolved once per backend name and device, not per call: resolving asks
        # every backend whether it is usable, host work a decode step pays per layer.
        key = (self._config.backend, mx.default_device())
        if self._backend_for is None or self._backend_for[0] != key:
            # Only the reference carries mass_bias so far (CaMConfig allows "auto" with it).
            name = "reference" if self._config.mass_bias else self._config.backend
            self._backend_for = (key, backends.resolve(name))
        return self._backend_for[1]

    def _total_merges(self) -> mx.array:
        """Merges so far (a scalar), folding in the per-call counts."""
        if self._merge_counts:
            self._merges = self._merges + mx.concatenate(self._merge_counts).sum()
            self._merge_counts = []
        return self._merges

    def _queries_can_come(self) -> bool:
        """Whether an installed attention hook can hand this cache the block's queries."""
        from . import hook  # imported here: hook imports this module

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

    def _warn_once(self, kind: str, message: str, stacklevel: int = 4) -> None:
        # Once per cache and kind. Every layer's cache warns with the same text from the
        # same line of the model's attention (stacklevel points there), so Python's
        # default filter shows it once per model, not once per layer.
        if kind in self._warned:
            return
        self._warned.add(kind)
        warnings.warn(message, QueryScoringWarning, stacklevel=stacklevel)

    def _flush_pending_with_keys(self) -> None:
        """A block the model never showed its queries for: score it with its keys, warn once."""
        if self._pending is None:
            return
        self._warn_once("bypass", (
            f"camkv: model {self.model_type or '(unknown type)'} computed attention without "
            "passing its queries to the cache (it bypasses mlx-lm's "
            "scaled_dot_product_attention); scoring that block with keys instead. Pass "
            "scoring='key' to score all blocks the same way."))
        keys, values, start = self._pending
        self._pending = None
        self._absorb(keys, values, start, None, None)
