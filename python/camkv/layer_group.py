"""LayerGroup: one model's layer caches, whose prompt-chunk compressions run together.

A prompt chunk reaches every layer's cache in turn, within one forward pass, and each
compresses once its rows pass budget + slack. On a GPU a compression is a handful of
launches, each of a few rows (a layer's KV heads), and a small model's prompt waits for
the host to build them (bench/results/README.md, "Where a merging prompt's time goes at
1B"). So a layer's compression of a prompt chunk that may wait
(camkv.backends.compress.may_wait) is held here until one of the group's caches is read
again (the next chunk's first layer, or mlx-lm evaluating the caches' state after the
chunk), then all that are held run at once, those alike as one compression over all
their rows (camkv.backends.compress.compress_alike): a layer's rows come out as its own
compression would leave them; only when it runs changes. Held rows cost memory until then:
every layer's rows and queries of the chunk, not one layer's at a time (docs/backends.md).
"""

from __future__ import annotations

import mlx.core as mx

from .backends.compress import compress_alike

# Whether make_prompt_cache's caches hold their prompt compressions for the group
# (bench/merge_speed.py's RULE/ungrouped arms switch it off, to time both in one process).
GROUPED = True


class LayerGroup:
    """The caches of one model's layers that hold compressions for each other."""

    def __init__(self):
        self._owing: list = []

    def owe(self, cache) -> None:
        """cache holds a compression due now (CaMKVCache.owed_compression) until settle."""
        self._owing.append(cache)

    def settle(self) -> None:
        """Run every compression held, those alike (one backend, and compress_alike's
        likeness) together, and start computing all their rows at once."""
        owing, self._owing = self._owing, []
        held = [(cache, cache.owed_compression()) for cache in owing]
        held = [(cache, owed) for cache, owed in held if owed is not None]  # a cache reset since
        backends = []
        for _, (backend, _, _) in held:
            if all(backend is not seen for seen in backends):
                backends.append(backend)
        for backend in backends:
            mine = [(cache, rows, chunk) for cache, (b, rows, chunk) in held if b is backend]
            merged = compress_alike(backend, [(rows, chunk) for _, rows, chunk in mine])
            for (cache, _, _), count in zip(mine, merged):
                cache.finish_owed(count)
        mx.async_eval(*(a for _, (_, rows, _) in held for a in rows.arrays()))
