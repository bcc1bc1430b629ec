"""What the kernel backends (ext, metal, cuda) check and prepare alike before a launch."""

from __future__ import annotations

import mlx.core as mx

from .. import mass
from ..rows import RowState

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


def chunk_mass(state: RowState, new_keys: mx.array, queries, scale: float, split: bool = False,
               cfg=None, reducer: mass.Reducer | None = None) -> mx.array:
    """A chunk call's attention mass [R, n + S] (section 2) as matrix products, for a
    kernel to take instead of scoring the chunk itself (CamParams.prescored):
    camkv.mass.chunk_mass over the stored rows and the new ones.

    queries [R, S, G, Dk] float32 (the kernels' layout), or None for key scoring. split:
    keep float32 accuracy on a matmul that rounds to TF32 (MLX's CUDA one), see
    camkv.mass.float32_product. cfg (a CaMConfig; None scores causally with every query)
    with prefill_scoring="window": only the chunk's last observation_window queries score
    it, their mass max-pooled. reducer: how a block's logits become mass (default: the
    reference's arithmetic, split or not).
    """
    n = state.length
    keys = new_keys if n == 0 else mx.concatenate([state.keys, new_keys], axis=1)  # one dtype: adopt_dtype
    queries = new_keys[:, None] if queries is None else queries.transpose(0, 2, 1, 3)
    if reducer is None:
        reducer = mass.EXACT_SPLIT if split else mass.EXACT
    return mass.chunk_mass(queries, keys, scale, n, cfg, new_keys.shape[1], reducer)
