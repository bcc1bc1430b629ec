"""Functions under mx.compile, one per key (a configuration, a scale, ...), kept for the
most recently used keys only: a process that tries many configurations (a sweep, the
tests) would otherwise keep every compiled graph, while a model's layers share one."""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Hashable

import mlx.core as mx


class CompiledSteps:
    """key -> mx.compile(build()), at most `kept` of them, the most recently used last."""

    def __init__(self, kept: int = 32):
        self.kept = kept
        self._steps: OrderedDict = OrderedDict()

    def get(self, key: Hashable, build: Callable[[], Callable]) -> Callable:
        if key not in self._steps:
            self._steps[key] = mx.compile(build())
            if len(self._steps) > self.kept:
                self._steps.popitem(last=False)
        self._steps.move_to_end(key)
        return self._steps[key]

    def __contains__(self, key: Hashable) -> bool:
        return key in self._steps

    def __len__(self) -> int:
        return len(self._steps)
