"""What the kernel backends (ext, metal, cuda) check and prepare alike before a launch."""

from __future__ import annotations

import mlx.core as mx

from .. import mass
from ..merges import rule as merge_rule
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
               cfg=None, reducer: mass.Reducer | None = None, votes: mx.array | None = None) -> mx.array:
    """A chunk call's attention mass [R, n + S] (section 2) as matrix products, for a
    kernel to take instead of scoring the chunk itself (CamParams.prescored):
    camkv.mass.chunk_mass over the stored rows and the new ones.

    queries [R, S, G, Dk] float32 (the kernels' layout), or None for key scoring. split:
    keep float32 accuracy on a matmul that rounds to TF32 (MLX's CUDA one), see
    camkv.mass.float32_product. cfg (a CaMConfig; None scores causally with every query)
    with prefill_scoring="window": only the chunk's last observation_window queries score
    it, their mass max-pooled. reducer: how a block's logits become mass (default: the
    reference's arithmetic, split or not). votes [R, n + S] (a rule that keeps them): their
    logs join every logit (section 4.6), through the reference's arithmetic (a reducer that
    takes no bias gives way to it).
    """
    n = state.length
    keys = new_keys if n == 0 else mx.concatenate([state.keys, new_keys], axis=1)  # one dtype: adopt_dtype
    queries = new_keys[:, None] if queries is None else queries.transpose(0, 2, 1, 3)
    if reducer is None or (votes is not None and not reducer.takes_bias):
        reducer = mass.EXACT_SPLIT if split else mass.EXACT
    bias = None if votes is None else mx.log(votes)
    return mass.chunk_mass(queries, keys, scale, n, cfg, new_keys.shape[1], reducer, bias=bias)


def rule_state(state: RowState, cfg) -> tuple[mx.array | None, mx.array | None]:
    """The votes [R, n] and threshold [R] (float32) a kernel call of cfg's rule carries in
    (None where the rule keeps none): the state's, or one vote per stored token and a
    threshold of NaN (no compression yet) where it has none yet."""
    rule = merge_rule(cfg.merge)
    rows, n = state.scores.shape
    votes = threshold = None
    if rule.keeps_votes:
        votes = mx.ones((rows, n), mx.float32) if state.votes is None else _float32(state.votes)
    if rule.moving_threshold:
        threshold = mx.full((rows,), float("nan"), mx.float32) if state.threshold is None else _float32(state.threshold)
    return votes, threshold


def _float32(a: mx.array) -> mx.array:
    """a as float32, the same array where it is (an update may then work inside it)."""
    return a if a.dtype == mx.float32 else a.astype(mx.float32)


def chunk_votes(votes: mx.array | None, s_len: int) -> mx.array | None:
    """The stored rows' votes then one for each of a chunk's s_len tokens (None: none kept)."""
    if votes is None:
        return None
    return mx.concatenate([votes, mx.ones((votes.shape[0], s_len), mx.float32)], axis=1)
