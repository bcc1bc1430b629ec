"""BatchRow: what camkv.batch asks of one request's CaMKVCache, a part of that class.

camkv.batch decodes rows that only append in one shared rectangle: it writes every such
row's key, value and query itself and tells the row later (decoded_elsewhere, and
appended_elsewhere for a step whose queries have not come); the row's buffers live in
the rectangle meanwhile (lend_buffers) and come back before the row does anything else
(take_back_buffers). Rows due at one decode step may compress in one launch together
(observe_queries(defer_launch=True), deferred_launch, finish_deferred). CaMKVCache
inherits these methods; they read its rows (camkv.buffers.RowBuffers) and pending
chunk (camkv.pending.PendingChunk).
"""

from __future__ import annotations


class BatchRow:
    """The batch's view of a CaMKVCache row (mixed into CaMKVCache; see the module)."""

    @property
    def layout(self) -> tuple | None:
        """(B, H, Dk, Dv, dtype), fixed by the first call (None before it)."""
        return self._layout

    @property
    def pending_scale(self):
        """The attention scale of the pending tokens' queries, KEY_SCORED, or None."""
        return self._pending.kind

    def decodes_plainly(self) -> bool:
        """Whether a one-token step would only write its key, value and query after the
        held rows: no compression due, no block waiting, scored by the model's queries
        like the pending rows, no votes to weigh attention by."""
        pending = self._pending
        return (self._layout is not None and not self._waiting and self._rows.votes is None
                and self._config.scoring == "query" and self.steps_before_compression() >= 1
                and (pending.kind is None or (not pending.key_scored and not pending.windowed))
                and self._queries_can_come())

    def appended_elsewhere(self) -> None:
        """A one-token step whose key and value a batch wrote (decodes_plainly was true):
        what update_and_fetch does besides the write."""
        self._rows.appended_elsewhere(1)
        self._took(1)

    def decoded_elsewhere(self, steps: int, scale: float) -> None:
        """`steps` one-token steps whose keys, values and queries (under scale) a batch
        wrote, each allowed by decodes_plainly: what their update_and_fetch and
        observe_queries calls would have counted, at once."""
        if not steps:
            return
        self._rows.appended_elsewhere(steps)
        self.offset += steps
        self._query_scored += steps
        self._pending.start(scale, False)
        self._fetched_bias, self._bias_unread = None, False

    def pending_queries(self) -> int:
        """Pending rows whose queries are kept (the buffer's, then the steps')."""
        if self._pending.kind is None or self._pending.key_scored:
            return 0
        return self._rows.pending - self._waiting

    def lend_buffers(self):
        """(held keys [B, H, held, Dk], values, the pending rows' queries [B, Hq, p, Dk] or
        None), keys and values as stored (arrays, or quantized triples); this cache holds no buffers
        until take_back_buffers."""
        p = self.pending_queries()
        queries = self._pending.kept()[:, :, :p] if p else None
        self._pending.release()
        return (*self._rows.lend(), queries)

    def take_back_buffers(self, keys, values, queries) -> None:
        """Hold again what lend_buffers handed over (the same rows, maybe moved), keys and
        values with room to decode in place."""
        self._rows.take_back(keys, values)
        self._pending.take_back(queries)

    @property
    def deferred_launch(self):
        """The one-launch compression (a backends.drop.DropLaunch) observe_queries(defer_launch=True)
        held, or None; finish_deferred takes its outputs."""
        return self._deferred

    def finish_deferred(self, outputs) -> None:
        """Adopt what the deferred one-launch compression returned (keys, values, scores,
        positions: backends.drop.compress_drop_buffers' outputs for this row)."""
        launch, self._deferred = self._deferred, None
        self._rows.adopt(*outputs, self._rows.pending_start + launch.end - self._rows.settled)
        self._pending.settled()
        self._pending.release()

