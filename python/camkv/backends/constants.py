"""Small arrays a kernel launch reads (its dims, a scale, a first row), each made once.

An array made from Python values is a copy to the device each time it is made, which at
a decode step's scale costs more than the kernels themselves; these are kept, up to
MAX_HELD of them (a few bytes each).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

_made: dict[tuple, mx.array] = {}
# Values that change with every compression (a first pending position) would grow the
# store without end over a long generation; past this many it starts again.
MAX_HELD = 1024


def ints(*values: int) -> mx.array:
    """An int32 array [len(values)] of these values."""
    return _once(values, mx.int32)


def floats(*values: float, shape: tuple | None = None) -> mx.array:
    """A float32 array of these values, [len(values)] or the given shape."""
    return _once(values, mx.float32, shape)


def _once(values: tuple, dtype, shape: tuple | None = None) -> mx.array:
    key = (values, dtype, shape)
    if key not in _made:
        if len(_made) >= MAX_HELD:
            _made.clear()
        # Born with its data (no operation to evaluate, so no wait for the device).
        _made[key] = mx.array(np.array(values).reshape(shape or (len(values),)), dtype)
    return _made[key]
