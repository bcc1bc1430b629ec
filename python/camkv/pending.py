"""PendingChunk: how the tokens a cache holds since its last compression will be scored."""

from __future__ import annotations

import math

import mlx.core as mx

from . import mass, policy
from .backends import drop

KEY_SCORED = "keys"  # the kind of pending tokens scored by their own keys


def every_query(queries: mx.array, s_len: int) -> mx.array:
    """A chunk's queries [R, G, S, Dk] from its last T kept ones [R, G, T, Dk] (window
    scoring keeps only those): zeros in front, which window scoring never reads."""
    kept = queries.shape[2]
    if kept == s_len:
        return queries
    unread = mx.zeros((*queries.shape[:2], s_len - kept, queries.shape[3]), queries.dtype)
    return mx.concatenate([unread, queries], axis=2)


class PendingChunk:
    """The pending tokens' scoring: `kind` is the attention scale of their queries, which
    wait here [B, Hq, k, Dk] (the first k pending rows': a buffer, then one array per
    decode step, joined once, when read: a write per step into a buffer is an array
    operation per layer and token, host time a GPU step pays), or KEY_SCORED; None while
    nothing is pending. With prefill_scoring="window", `windowed` says whether the pending
    tokens came in blocks of several (prompt chunks, scored by their last queries) or one
    at a time (decode steps, scored by every query): the two never share a compression.
    """

    def __init__(self):
        self.kind = None
        self.windowed = False
        self._buffer: mx.array | None = None
        self._steps: list[mx.array] = []
        self._decode_config_for: tuple | None = None  # (config, its decode-step form)

    @property
    def key_scored(self) -> bool:
        return self.kind is KEY_SCORED

    def differs(self, kind, windowed: bool) -> bool:
        """Whether tokens of this kind would be scored otherwise than those pending (keys,
        another scale, or under window scoring prompt blocks against decode steps)."""
        return self.kind is not None and (self.kind != kind or self.windowed != windowed)

    def start(self, kind, windowed: bool) -> None:
        if self.kind is None:
            self.kind, self.windowed = kind, windowed

    def takes_step(self, scale, pending_before: int) -> bool:
        """Whether one decode step's queries under scale only join those kept: decode steps
        of this scale are pending, and each of the pending_before rows kept its queries."""
        if not (type(scale) is float and scale == self.kind and not self.windowed):
            return False
        # kept_rows(), inline: every layer asks at every decode step.
        return (0 if self._buffer is None else self._buffer.shape[2]) + len(self._steps) == pending_before

    def add_step(self, queries: mx.array) -> None:
        self._steps.append(queries)

    def keep(self, queries: mx.array, start: int, window: int) -> None:
        """Keep a block's queries [B, Hq, S, Dk] as those of pending rows start.. (after
        the rows kept so far). Window scoring reads only the last `window` queries of the
        pending span (docs/algorithm.md section 3): a copy of those is kept, not the prompt
        block's, which every layer would otherwise hold until its compression runs (the
        peak memory of a short prompt)."""
        if self.windowed:
            kept = self.kept()
            joined = mx.concatenate([kept, queries], axis=2) if start and kept is not None else queries
            self._buffer = mx.contiguous(joined[:, :, -window:])
        elif queries.shape[2] == 1 and start == self.kept_rows():
            self._steps.append(queries)
        else:
            kept = self.kept()
            self._buffer = mx.concatenate([kept[:, :, :start], queries], axis=2) if start else queries

    def kept_rows(self) -> int:
        buffered = 0 if self._buffer is None else self._buffer.shape[2]
        return buffered + len(self._steps)

    def kept(self) -> mx.array | None:
        """The kept queries as one array [B, Hq, k, Dk] (None when none): the decode
        steps' joined onto the buffer in one operation."""
        if self._steps:
            self._buffer, self._steps = self.peek(), []
        return self._buffer

    def peek(self) -> mx.array | None:
        """What kept() returns, without joining the kept steps (nothing changes)."""
        parts = ([] if self._buffer is None else [self._buffer]) + self._steps
        if len(parts) > 1:
            return mx.concatenate(parts, axis=2)
        return parts[0] if parts else None

    def restore(self, kind, windowed: bool, queries: mx.array | None) -> None:
        """Pending tokens of a saved state: their kind, whether prompt blocks, the kept
        queries [B, Hq, k, Dk] (None when none are kept)."""
        self.kind, self.windowed = kind, windowed
        self._buffer, self._steps = queries, []

    def release(self) -> None:
        """After a compression (or lent to a batch): the kept queries go."""
        self._buffer, self._steps = None, []

    def settled(self) -> None:
        """A compression scored every pending token: nothing is pending."""
        self.kind = None

    def take_back(self, queries: mx.array | None) -> None:
        """Keep again the queries lend handed over [B, Hq, k, Dk]."""
        self._buffer = queries

    def queries(self, pending_keys: mx.array, heads: int):
        """The queries of the s_len pending rows to score [R, G, T, Dk] and their scale:
        T = s_len, every pending row's, except for prompt blocks under window scoring,
        where only the last min(s_len, observation_window) were kept (the only ones that
        add mass). pending_keys [R, s_len, Dk]: with key scoring each is its token's one
        query, scale 1/sqrt(Dk)."""
        if self.kind is KEY_SCORED:
            return pending_keys[:, None], 1.0 / math.sqrt(pending_keys.shape[-1])
        queries = self.kept()[:, :, : pending_keys.shape[1]]
        # Query head h * G + g belongs to KV head h.
        B, Hq, T, Dk = queries.shape
        return queries.reshape(B * heads, Hq // heads, T, Dk), self.kind

    def mass(self, rows, settled: int, heads: int, cfg) -> mx.array:
        """The mass the pending rows' queries give every held row of rows (a RowState
        [B*H, held, ...], the first `settled` scored) [B*H, held]: sections 2 and 3, only
        the observation window's with prefill_scoring="window"; weighed by the rows'
        votes where the rule keeps them. Nothing changes."""
        s_len = rows.length - settled
        queries, scale = self.queries(rows.keys[:, settled:], heads)
        cfg = self.config(cfg)
        if rows.votes is None:
            return mass.chunk_mass(queries, rows.keys, scale, settled, cfg, s_len, drop.reducer())
        # Votes weigh attention (keepkv): the reference's arithmetic, which takes them.
        return mass.chunk_mass(queries, rows.keys, scale, settled, cfg, s_len, mass.EXACT_WHOLE,
                               bias=mx.log(rows.votes))

    def config(self, cfg):
        """The config the pending tokens are compressed under: prefill_scoring="window"
        applies to prompt blocks only; decode steps are scored by every query."""
        if policy.windowed(cfg) and not self.windowed:
            # Made once per config: a decode compression would otherwise validate a new
            # CaMConfig per layer (host time, most of a GPU decode step's cost).
            if self._decode_config_for is None or self._decode_config_for[0] is not cfg:
                self._decode_config_for = (cfg, cfg.replace(prefill_scoring="causal", pool=1))
            return self._decode_config_for[1]
        return cfg

    def copy(self) -> "PendingChunk":
        clone = object.__new__(PendingChunk)
        clone.__dict__.update(self.__dict__)
        clone._buffer = None if self._buffer is None else mx.array(self._buffer)
        clone._steps = list(self._steps)  # never written in place
        return clone
