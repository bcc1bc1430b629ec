"""A chunk's attention mass (docs/algorithm.md sections 2 and 3): one function, the
reduction of its logits passed in.

A compression scores its chunk of S tokens causally: chunk token i (row index
n_before + i) sees every row up to and including itself; a logit that is NaN or
infinite counts as masked, and a query whose every logit is masked adds nothing (a
poisoned key gets no mass, a poisoned query leaves the other rows' scores alone). The
mass of a row is the sum of its softmax weights over the chunk's queries, divided by
the G queries per KV head. With prefill_scoring="window" only the chunk's last
observation_window queries add mass, which is then max-pooled (camkv.policy).

chunk_mass holds the parts every backend shares: the window of queries that add mass,
blocks of queries whose logits stay under MASS_BYTES (a bounded cache must not spike
memory while it fills), each block seeing only the rows up to its last token, the
blocks' sum and the pooling. A Reducer makes one block's mass from its queries and
rows, its own way:

  EXACT, EXACT_SPLIT  float32 products and an MLX softmax, in the reference's order
                      (the kernels' prescoring); SPLIT keeps float32 accuracy on a
                      matmul that rounds to TF32 (MLX's CUDA one); EXACT_WHOLE the
                      same in one block (the oracle, camkv.reference)
  MLX_OPS             float32 products and MLX operations over the whole device
  backends.mass_cuda.REDUCER, backends.ext.REDUCER   one kernel over a product's logits

Queries come in one layout, the model's: [R, G, T, Dk] (query head h * G + g of KV
head h is row r's g), T the chunk's last T tokens (at least those that add mass).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import mlx.core as mx

from . import policy

_INF = float("inf")
# Most bytes one block of chunk queries holds in logits and the temporaries beside them
# (a Reducer says how many bytes a logit costs it): a 2048-token chunk with 4 queries
# per KV head over 2.5k rows would otherwise hold gigabytes at once.
MASS_BYTES = 128 << 20


class Reducer(NamedTuple):
    """How one block of chunk queries becomes mass.

    block(queries [R, G, t, Dk], keys [R, visible, Dk] (as prepare left them), scale,
    n_before, width) -> [R, visible] or [R, width] float32: the block's mass, its token j
    at row index n_before + j. prepare(keys) casts all rows once. logit_bytes(dtype of
    the prepared keys): what a logit costs in memory (logits and temporaries); 0 scores a
    chunk in one block.
    """

    name: str
    block: Callable
    prepare: Callable
    logit_bytes: Callable
    takes_bias: bool = False


def chunk_mass(queries: mx.array, keys: mx.array, scale: float, n_before: int, cfg, s_len: int,
               reducer: Reducer, bias: mx.array | None = None) -> mx.array:
    """The mass [R, N] that a chunk of s_len tokens after n_before rows gives every row.

    queries [R, G, T, Dk] are the chunk's last T; keys [R, N, Dk] every row, N =
    n_before + s_len; cfg None scores with every query and pools nothing. bias [R, N]
    (the log of each row's votes, section 4.6) is added to every logit of its row, for
    a reducer that takes one.
    """
    if bias is not None and not reducer.takes_bias:
        raise ValueError(f"the {reducer.name} mass reduction takes no attention bias")
    observed = s_len if cfg is None else policy.observed(cfg, s_len)
    queries = queries[:, :, queries.shape[2] - observed :]
    first = n_before + s_len - observed  # row index of the first query that adds mass
    rows, groups, _, _ = queries.shape
    total = keys.shape[1]
    keys = reducer.prepare(keys)
    per_logit = reducer.logit_bytes(keys.dtype)
    block = observed if per_logit == 0 else max(1, MASS_BYTES // (rows * groups * total * per_logit))
    mass = None
    for i0 in range(0, observed, block):
        i1 = min(observed, i0 + block)
        visible = first + i1  # token i1 - 1 sees no further
        extra = {} if bias is None else {"bias": bias[:, :visible]}
        part = reducer.block(queries[:, :, i0:i1], keys[:, :visible], scale, first + i0, total, **extra)
        if part.shape[1] < total:
            part = mx.pad(part, [(0, 0), (0, total - part.shape[1])])
        mass = part if mass is None else mass + part
        if i1 < observed:
            mx.eval(mass)  # one block's logits at a time
    return mass if cfg is None else policy.pooled(mass, cfg, s_len)


# ---------------------------------------------------------------------------- the reference's arithmetic


def _tf32_high(x: mx.array) -> mx.array:
    """x with the mantissa bits a TF32 tensor core drops cleared (exactly representable)."""
    return mx.view(mx.view(x, mx.uint32) & mx.array(0xFFFFE000, mx.uint32), mx.float32)


def float32_product(a: mx.array, b: mx.array, split: bool) -> mx.array:
    """a @ b. With split, as three products of TF32-exact halves (hi.hi + hi.lo + lo.hi),
    which keeps float32 accuracy where the matmul rounds its inputs to TF32 (MLX's
    CUDA backend does: about 3e-4 relative error otherwise)."""
    if not split:
        return a @ b
    a_hi, b_hi = _tf32_high(a), _tf32_high(b)
    return a_hi @ b_hi + (a_hi @ (b - b_hi) + (a - a_hi) @ b_hi)


def attention_mass(queries: mx.array, keys: mx.array, scale: float, visible, split: bool = False,
                   bias: mx.array | None = None) -> mx.array:
    """Section 2: softmax weights of each query over keys, summed over queries / G.

    queries [R, S, G, Dk] float32, keys [R, N, Dk] float32, visible [S, N] bool or None,
    bias [R, N] float32 or None: added to every logit of its key (the log of its votes,
    section 4.6). Returns [R, N] float32. A NaN or infinite logit counts as masked, and a
    query whose every logit is masked adds nothing (section 2's rule for poisoned inputs).
    """
    rows, s_len, groups, k_dim = queries.shape
    q = queries.reshape(rows, s_len * groups, k_dim)
    logits = scale * float32_product(q, keys.transpose(0, 2, 1), split)  # [R, S*G, N]
    logits = logits.reshape(rows, s_len, groups, -1)
    if bias is not None:
        logits = logits + bias[:, None, None, :]
    usable = mx.isfinite(logits)
    if visible is not None:
        usable = usable & visible[None, :, None, :]
    weights = mx.softmax(mx.where(usable, logits, -_INF), axis=-1, precise=True)
    return mx.where(mx.isnan(weights), 0.0, weights).sum(axis=(1, 2)) / groups


def attention_mass_causal(queries: mx.array, keys: mx.array, scale: float, n: int, split: bool = False,
                          bias: mx.array | None = None) -> mx.array:
    """A chunk's mass: chunk token i (absolute index n + i) sees every stored row and
    the chunk tokens up to itself. queries [R, S, G, Dk], keys [R, n + S, Dk] float32.
    split: keep float32 accuracy on a TF32 matmul (see float32_product); bias [R, n + S]:
    the log of each row's votes (section 4.6), or None."""
    s_len, total = queries.shape[1], keys.shape[1]
    visible = mx.arange(total)[None, :] <= (n + mx.arange(s_len))[:, None]
    return attention_mass(queries, keys, scale, visible, split, bias)


def _as_float32(keys: mx.array) -> mx.array:
    return keys.astype(mx.float32)


def _exact_block(split: bool):
    def block(queries, keys, scale, n_before, width, bias=None):
        q = queries.astype(mx.float32).transpose(0, 2, 1, 3)  # the reference's [R, S, G, Dk]
        return attention_mass_causal(q, keys, scale, n_before, split=split, bias=bias)
    return block


def _four_floats(dtype) -> int:
    return 16  # logits, mask, weights and the split parts: four float32 arrays per logit


def _one_block(dtype) -> int:
    return 0


EXACT = Reducer("exact", _exact_block(False), _as_float32, _four_floats, takes_bias=True)
EXACT_SPLIT = Reducer("exact-split", _exact_block(True), _as_float32, _four_floats, takes_bias=True)
# The oracle's own: a whole chunk in one block (a literal transcription, for tests).
EXACT_WHOLE = Reducer("exact-whole", _exact_block(False), _as_float32, _one_block, takes_bias=True)


# ---------------------------------------------------------------------------- MLX operations


def column_mass(logits: mx.array, scale: float, n_before: int) -> mx.array:
    """Softmax of each query row of logits [R, G, S, N] (chunk token i sees rows up to
    n_before + i), summed over G and S: [R, N] float32."""
    s_len, visible = logits.shape[2:]
    causal = mx.arange(visible)[None, :] <= (n_before + mx.arange(s_len))[:, None]
    logits = logits * scale
    logits = mx.where(causal & mx.isfinite(logits), logits, -_INF)
    weights = mx.softmax(logits, axis=-1, precise=True)
    return mx.where(mx.isnan(weights), 0.0, weights).sum(axis=(1, 2))


def _mlx_block(queries, keys, scale, n_before, width):
    rows, groups, s_len, k_dim = queries.shape
    q = queries.astype(mx.float32).reshape(rows, groups * s_len, k_dim)
    logits = q @ keys.transpose(0, 2, 1)
    return column_mass(logits.reshape(rows, groups, s_len, -1), scale, n_before) / groups


def _twelve_floats(dtype) -> int:
    # A float32 logit and the two softmax temporaries beside it, in blocks of a quarter
    # of MASS_BYTES: the MLX operations' passes each hold the whole block.
    return 48


MLX_OPS = Reducer("mlx-ops", _mlx_block, _as_float32, _twelve_floats)


def grouped_logits(queries: mx.array, keys: mx.array, dtype) -> mx.array:
    """The logits [R, G x t, visible] of queries [R, G, t, Dk] over keys [R, visible, Dk]
    as one product in dtype (row m = g * t + i): what a column-mass kernel reduces."""
    rows, groups, s_len, k_dim = queries.shape
    q = queries.astype(dtype).reshape(rows, groups * s_len, k_dim)
    return q @ keys.astype(dtype).transpose(0, 2, 1)
