"""What the kernel backends (ext, metal, cuda) check and prepare alike before a launch."""

from __future__ import annotations

import mlx.core as mx

from .. import merges
from .. import policy
from ..reference import attention_mass_causal
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


def check_kernel_rule(merge: str, who: str) -> None:
    """Refuse a merge rule the kernel core does not run (camkv.merges, kernels=False)."""
    if not merges.rule(merge).kernels:
        raise ValueError(f"merge={merge!r} runs on backend='reference' only (experimental), not on {who}; "
                         f"the kernels run {', '.join(merges.names(kernels=True))}")


def adopt_dtype(state: RowState, new_keys) -> RowState:
    """The first call's empty state may carry a default dtype: take the tokens'. A stored
    state of another dtype is an error."""
    if state.keys.dtype == new_keys.dtype:
        return state
    if state.length:
        raise ValueError(f"new_keys dtype {new_keys.dtype} differs from the stored keys' {state.keys.dtype}")
    return RowState.empty(state.keys.shape[0], state.keys.shape[-1], state.values.shape[-1], new_keys.dtype)


SCORE_BYTES = 128 << 20  # most logits (and temporaries) one block of chunk scoring holds


def chunk_mass(state: RowState, new_keys: mx.array, queries, scale: float, split: bool = False,
               cfg=None, mass_of=None) -> mx.array:
    """A chunk call's attention mass [R, n + S] (section 2) as matrix products, for a
    kernel to take instead of scoring the chunk itself (CamParams.prescored).

    queries [R, S, G, Dk] float32, or None for key scoring. In blocks of chunk queries,
    so the logits held at once stay under SCORE_BYTES: a whole 2048-token chunk with 4
    queries per KV head would hold gigabytes, and a bounded cache must not spike memory
    while it fills (block i0..i1 sees only the first n + i1 keys). split: keep float32
    accuracy on a matmul that rounds to TF32 (MLX's CUDA one), see
    reference._float32_product. cfg (a CaMConfig; None scores causally) with
    prefill_scoring="window": only the chunk's last observation_window queries score it,
    their mass max-pooled (camkv.policy). mass_of(queries, keys, scale, n_before): a block's
    mass as reference.attention_mass_causal computes it (the default), made another way.
    """
    rows, s_len, _ = new_keys.shape
    n = state.length
    keys = new_keys if n == 0 else mx.concatenate([state.keys, new_keys], axis=1)  # one dtype: adopt_dtype
    keys = keys.astype(mx.float32)
    if queries is None:
        queries = new_keys.astype(mx.float32)[:, :, None, :]
    total, groups = n + s_len, queries.shape[2]
    block = max(1, SCORE_BYTES // (rows * groups * total * 4 * 4))  # logits, mask, weights, split parts
    mass = None
    first = 0 if cfg is None else s_len - policy.observed(cfg, s_len)
    for i0 in range(first, s_len, block):
        i1 = min(s_len, i0 + block)
        if mass_of is None:
            part = attention_mass_causal(queries[:, i0:i1], keys[:, : n + i1], scale, n + i0, split=split)
        else:
            part = mass_of(queries[:, i0:i1], keys[:, : n + i1], scale, n + i0)
        part = mx.pad(part, [(0, 0), (0, s_len - i1)])
        mass = part if mass is None else mass + part
        if i1 < s_len:
            mx.eval(mass)
    return mass if cfg is None else policy.pooled(mass, cfg, s_len)
