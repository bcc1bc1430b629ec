"""CacheState: a CaMKVCache's `state`, as mlx-lm saves and loads it, a part of that class.

mlx-lm's save_prompt_cache writes every layer's state (arrays, and here one JSON string
of the rest) and load_prompt_cache builds a layer from it with `from_state` (the state
set on an object whose __init__ never ran), so setting it makes the whole cache, from
the config on. The items, in order, are docs/algorithm.md section 7's (a tier's after
them, section 13). CaMKVCache inherits the property; it reads and sets the cache's rows
(camkv.buffers.RowBuffers), pending chunk (camkv.pending.PendingChunk) and counters.
"""

from __future__ import annotations

import json

import mlx.core as mx

from . import cache_input, merges, quantized
from .config import CaMConfig
from .pending import KEY_SCORED


class CacheState:
    """The state property of a CaMKVCache (mixed into CaMKVCache; see the module)."""

    @property
    def state(self):
        """(keys, values, scores, positions, merges, meta JSON) of every row held [B, H, n],
        then (votes [B, H, n], threshold [B, H]) for a merge rule that keeps them (None
        where it keeps only one, or while empty), then, while some are kept, the pending
        rows' queries [B, Hq, k, Dk] (with None for the rule's items where it keeps none).

        Reading it changes nothing (mlx-lm evaluates every cache's state after each
        prompt chunk; docs/algorithm.md section 7; the merge count is each compression's
        result, so reading it adds no operation): the
        rows held since the last compression are in it unscored (score 0; meta "settled"
        counts the scored ones, "pending" says how the rest will be scored, "waiting" how
        many wait for their queries), so a cache loaded from it goes on exactly as this one. camkv.save_prompt_cache compresses
        first (compress_pending), so its files hold only scored rows."""
        meta = {"offset": self.offset, "config": self._config_fields,
                "head_offset": self._head_offset, "n_heads_global": self._n_heads_global,
                "evictions": self._evictions, "query_scored": self._query_scored,
                "settled": self._rows.settled, "pending": self._pending.kind,
                "windowed": self._pending.windowed, "waiting": self._waiting}
        arrays = (None,) * 4 if self._rows.keys is None else self._rows.held_rows(*self._layout[:2])
        queries = self._pending.peek()
        rule_state = self._rule_state()
        tail = rule_state if queries is None else (*(rule_state or (None, None)), queries)
        if self._tier is not None:  # the tier's rows after the items above (Nones where absent)
            tail = (*tail, *(None,) * (3 - len(tail)), *self._tier.state(*(self._layout or (0, 0))[:2]))
        return (*arrays, self._merges, json.dumps(meta)) + tail

    def _rule_state(self) -> tuple:
        """The state items of a merge rule that keeps votes or a threshold (none otherwise)."""
        rule = merges.rule(self._config.merge)
        if not (rule.keeps_votes or rule.moving_threshold):
            return ()
        return (None, None) if self._layout is None else self._rows.rule_state(*self._layout[:2])

    @state.setter
    def state(self, v) -> None:
        keys, values, scores, positions, merges_so_far, meta_json = v[:6]
        meta = json.loads(meta_json)
        config = CaMConfig(**meta["config"])
        self._use_config(config)
        self._head_offset = meta["head_offset"]
        self._n_heads_global = meta["n_heads_global"]
        self._reset()
        self.offset = meta["offset"]
        self._evictions = meta["evictions"]
        self._query_scored = meta.get("query_scored", 0)  # absent from older files
        self._merges = mx.array(merges_so_far, mx.int32)
        if keys is None:
            return
        B, H, n, Dk, Dv, dtype = quantized.saved_layout(keys, values, config)
        # Files of older versions hold only scored rows and none of the pending ones' items.
        settled, waiting = meta.get("settled", n), meta.get("waiting", 0)
        cache_input.check_saved_rows(n, settled, waiting, config)
        self._layout = (B, H, Dk, Dv, dtype)
        rule_state = tuple(v[6:8]) + (None,) * (8 - max(6, len(v)))  # absent for most rules
        self._rows.load(keys, values, scores, positions, *rule_state, next_position=self.offset, settled=settled)
        pending = meta.get("pending")
        self._pending.restore(KEY_SCORED if pending == KEY_SCORED else pending, meta.get("windowed", False),
                              v[8] if len(v) > 8 else None)
        if self._tier is not None and len(v) > 9:
            self._tier.load(*v[9:13])
        self._waiting = waiting
