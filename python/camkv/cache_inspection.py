"""CacheInspection: what a caller reads of a CaMKVCache's rows and counters, a part of that class.

stored() and tier_rows() give the rows held (scores as the next compression would see
them), stats the counters; none changes the cache beyond scoring a block that waited
for queries that never came (flush_pending, with its warning). CaMKVCache inherits
these; they read its rows (camkv.buffers.RowBuffers), pending chunk
(camkv.pending.PendingChunk), tier (camkv.tier.Tier) and counters.
"""

from __future__ import annotations

from . import policy


class CacheInspection:
    """The read-only views of a CaMKVCache (mixed into CaMKVCache; see the module)."""

    def stored(self):
        """(keys [B,H,n,Dk], values [B,H,n,Dv], scores [B,H,n] f32, positions [B,H,n] i32)
        of every row held; a pending row's score includes its chunk's mass so far (what
        the next compression will add, to the settled rows' scores as it decays them:
        CaMConfig.score_decay), without changing the cache."""
        self.flush_pending()
        if self._rows.keys is None:
            raise ValueError("the cache is empty: nothing stored yet")
        B, H = self._layout[:2]
        rows = self._rows.rows()
        if self._pending.kind is not None:
            mass = self._pending.mass(rows, self._rows.settled, self._layout[1], self._config)
            rows = rows._replace(scores=policy.decayed(rows.scores, self._config) + mass)
        return tuple(a.reshape(B, H, self._rows.held, *a.shape[2:]) for a in rows[:4])

    def pending_rows(self) -> int:
        """Rows held since the last compression (scored at the next one)."""
        return self._rows.pending

    def tier_rows(self):
        """(keys, values [B, H, t, D] dequantized, scores, positions [B, H, t]) of the
        low-precision tier's rows (tier_budget > 0), ascending by position."""
        if self._tier is None or self._tier.scores is None:
            raise ValueError("no tier rows: tier_budget is 0, or nothing was evicted yet")
        return self._tier.rows(*self._layout[:2], self._layout[4])

    @property
    def stats(self) -> dict:
        """Counters: tokens_seen, query_scored (tokens scored with the model's queries),
        evictions and merges (summed over rows); plus rows, stored and budget."""
        self.flush_pending()
        rows = 0 if self._layout is None else self._layout[0] * self._layout[1]
        return {"tokens_seen": self.offset, "query_scored": self._query_scored, "evictions": self._evictions,
                "merges": int(self._merges.item()), "rows": rows, "stored": self.size(),
                "budget": self._config.budget}
