"""What the kernel backends (ext, metal, cuda) check and prepare alike before a launch."""

from __future__ import annotations

import mlx.core as mx

from ..reference import RowState

STORAGE_DTYPES = (mx.float16, mx.bfloat16, mx.float32)


def check_kernel_inputs(state: RowState, new_keys, queries, scale, max_head_dim: int, who: str) -> None:
    """Reject what a kernel cannot take, naming the bad value and what is allowed."""
    if new_keys.dtype not in STORAGE_DTYPES:
        raise ValueError(f"new_keys must be float16, bfloat16 or float32 for {who}, got {new_keys.dtype}")
    if queries is not None and scale is None:
        raise ValueError("query scoring needs the model's attention scale, got scale=None")
    for name, dim in (("Dk", new_keys.shape[-1]), ("Dv", state.values.shape[-1])):
        if dim > max_head_dim:
            raise ValueError(f"{name} = {dim} exceeds {who}'s limit of {max_head_dim}; use backend='reference'")


def adopt_dtype(state: RowState, new_keys) -> RowState:
    """The first call's empty state may carry a default dtype: take the tokens'. A stored
    state of another dtype is an error."""
    if state.keys.dtype == new_keys.dtype:
        return state
    if state.length:
        raise ValueError(f"new_keys dtype {new_keys.dtype} differs from the stored keys' {state.keys.dtype}")
    return RowState.empty(state.keys.shape[0], state.keys.shape[-1], state.values.shape[-1], new_keys.dtype)
