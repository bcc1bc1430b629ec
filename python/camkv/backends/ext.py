"""Backend "ext": the fused update of the compiled extension camkv._ext.

One MLX primitive per layer per call (scoring, eviction, merge, compaction), on the
CPU. On a GPU the same kernel core runs compiled at run time (backends "metal" and
"cuda", camkv.backends.jit); with the GPU as the default device this backend is
refused when a cache is made. Same signature and results (docs/algorithm.md section 8)
as camkv.reference.update.
"""

from __future__ import annotations

import math

import mlx.core as mx

from .. import mass
from ..config import CaMConfig
from ..rows import RowState
from ._common import adopt_dtype, check_kernel_inputs, chunk_mass, chunk_votes, rule_state
from .params import decode_words, pack_words, scratch_strides

try:  # the package works without the extension (reference backend)
    from .. import _ext
except ImportError as error:  # pragma: no cover - exercised where the build is absent
    _ext = None
    _IMPORT_ERROR = f"camkv._ext is not built or failed to load ({error})"
else:
    _IMPORT_ERROR = None

def unavailable_reason() -> str | None:
    """None when the extension is importable and matches the running mlx, else why not."""
    if _ext is None:
        return _IMPORT_ERROR
    if _ext.MLX_VERSION != mx.__version__:
        return (
            f"camkv._ext was compiled against mlx {_ext.MLX_VERSION} but mlx {mx.__version__} "
            "is installed; reinstall camkv to rebuild it"
        )
    if mx.default_device() != mx.cpu:
        return ("camkv._ext runs on the CPU only and the default device is the GPU; use backend 'auto' "
                "(the GPU kernels), or make the CPU the default device (mx.set_default_device(mx.cpu))")
    return None


def _block_mass(queries: mx.array, keys: mx.array, scale: float, n_before: int, width: int,
                bias: mx.array | None = None) -> mx.array:
    """A block of chunk queries [R, G, t, Dk] over keys [R, visible, Dk] (float32): the
    logits by one matrix product (BLAS), their softmax rows summed down the columns by the
    extension in one pass. bias [R, visible] (log votes) joins each logit after its scale,
    as in the reference's arithmetic (the extension then scales by 1, exactly)."""
    logits = mass.grouped_logits(queries, keys, mx.float32)
    if bias is not None:
        logits, scale = scale * logits + bias[:, None, :], 1.0
    return _ext.column_mass(logits, scale=scale, n_before=n_before, s_len=queries.shape[2], width=keys.shape[1],
                            weight=1.0 / queries.shape[1])


# camkv.mass's reduction of a block by the extension (logits and temporaries as the
# reference's arithmetic holds them).
REDUCER = mass.EXACT._replace(name="ext-columns", block=_block_mass, takes_bias=True)


def _on_cpu(stream) -> bool:
    if stream is None:
        return mx.default_device() == mx.cpu
    return (stream.device if isinstance(stream, mx.Stream) else stream) == mx.cpu


def call_params(state: RowState, new_keys, new_values, offset, cfg: CaMConfig, queries, scale, prescored) -> bytes:
    """The call's struct CamParams as _ext.update takes it (camkv.backends.params), its
    shape, scoring and stride fields from the arrays (queries None: key scoring)."""
    rows, n, k_dim = state.keys.shape
    s_len, v_dim = new_keys.shape[1], new_values.shape[2]
    groups = 1 if queries is None else queries.shape[2]
    n_out = min(n + s_len, cfg.budget)
    if s_len == 1 and n == n_out:  # a full cache's decode step (no slack: one compression a token)
        return decode_words(cfg, rows, n, k_dim, v_dim, groups, int(offset), float(scale), queries is None)
    strides = scratch_strides(cfg.prefill == "chunk", n, s_len, n_out, k_dim, v_dim)
    return pack_words(cfg, rows, n, s_len, k_dim, v_dim, groups, n_out, int(offset), float(scale), queries is None,
                      strides, prescored)


def update(
    state: RowState,
    new_keys: mx.array,
    new_values: mx.array,
    offset: int,
    cfg: CaMConfig,
    row_ids: mx.array,
    queries: mx.array | None = None,
    scale: float | None = None,
    stream=None,
) -> tuple[RowState, mx.array]:
    """Absorb S new tokens per row in one launch; see camkv.reference.update.

    On a CPU stream, when nothing else holds the stored arrays (the caller dropped
    its references before evaluation) and the row count does not change, the
    update runs inside the stored buffers instead of copying them.
    """
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"backend 'ext' is not usable here: {reason}")
    check_kernel_inputs(state, new_keys, queries, scale, _ext.MAX_HEAD_DIM, "the ext backend")
    if queries is None:
        scale = 1.0 / math.sqrt(new_keys.shape[-1])
    else:
        queries = queries.astype(mx.float32)
    votes, threshold = rule_state(state, cfg)
    state = adopt_dtype(state, new_keys)
    # A CPU chunk call is scored by a matrix product and one pass of column sums: the
    # kernel's own scoring dots each query with each row in feature order, one row at a
    # time (section 8 lets a backend sum in its own order).
    prescored = None
    if cfg.prefill == "chunk" and new_keys.shape[1] > 1 and _on_cpu(stream):
        with mx.stream(mx.cpu):
            prescored = chunk_mass(state, new_keys, queries, scale, cfg=cfg, reducer=REDUCER,
                                   votes=chunk_votes(votes, new_keys.shape[1]))
    keys, values, scores, positions, merges, votes, threshold = _ext.update(
        state.keys,
        state.values,
        state.scores,
        state.positions,
        new_keys,
        new_values,
        row_ids if row_ids.dtype == mx.uint32 else row_ids.astype(mx.uint32),
        queries,
        params=call_params(state, new_keys, new_values, offset, cfg, queries, scale, prescored is not None),
        chunk_mass=prescored,
        votes=votes,
        threshold=threshold,
        stream=stream,
    )
    return RowState(keys, values, scores, positions, votes, threshold), merges


def quantized_attention(queries, keys: tuple, values: tuple, *, scale: float, mask, bits: int,
                        group_size: int) -> mx.array:
    """The extension's attention over quantized rows read as stored (_ext.quantized_attention):
    keys and values as mx.quantize's triples, mask None or additive float32 [B, 1 or H, L, N]."""
    return _ext.quantized_attention(queries, *keys, *values, mask=mask, scale=scale, bits=bits,
                                    group_size=group_size)
