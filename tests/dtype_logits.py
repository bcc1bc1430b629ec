"""The dtype-level logits of camkv.backends.drop's CUDA path (docs/algorithm.md section 8):
how much they widen the score tolerance, and their arithmetic mimicked on the CPU.

On an NVIDIA GPU a chunk's mass comes from logits that are a product in the keys' dtype
(TF32 for float32, whose matmul rounds its inputs to 10 mantissa bits): a logit l is off
by up to |l| 2^-(m+1), a softmax weight by up to twice that relatively (its own logit and
its row's normaliser), so scores get |l| 2^-m more rtol for the call's largest logit.

`emulate(monkeypatch)` makes this process score as that path does, on any device: the
engine's reducer (camkv.backends.merge_ops.reducer, keepkv's votes' bias included, for any
backend, as the CUDA backend's compressions run it) and the drop engine's compute their
logits in the keys' dtype, and drop.on_cuda() answers True (so the tests widen as they
would there). CAMKV_EMULATE_CUDA_LOGITS=1 runs tests/test_merge_ops.py's comparisons that way."""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np

from camkv import mass
from camkv.backends import drop, merge_ops

# Mantissa bits of the logits the CUDA path computes: the storage dtype's, or TF32's.
LOGIT_MANTISSA = {mx.float16: 10, mx.bfloat16: 7, mx.float32: 10}
EMULATE = os.environ.get("CAMKV_EMULATE_CUDA_LOGITS") == "1"


def widening(queries, keys, scale, dtype) -> float:
    """The rtol that dtype-level logits add to section 8's: |l| 2^-m for the largest |l|
    of queries (any layout, its rows first and features last) over keys [R, N, Dk]; 0 where
    the logits are float32 (drop.on_cuda() is False)."""
    if not drop.on_cuda():
        return 0.0
    q = np.array(queries.astype(mx.float32)).reshape(queries.shape[0], -1, queries.shape[-1])
    k = np.array(keys.astype(mx.float32))
    largest = float(np.abs(scale * q @ k.transpose(0, 2, 1)).max())
    return largest * 2.0 ** -LOGIT_MANTISSA[dtype]


def scoring_inputs(new_keys, queries, scale):
    """The queries and scale a compression scored with: the given ones, or for key scoring
    the chunk's keys at 1/sqrt(Dk) (section 2)."""
    return (queries, scale) if queries is not None else drop.key_queries(new_keys)


def _dtype_block(queries, keys, scale, n_before, width, bias=None):
    """One block's mass as the CUDA kernel makes it: logits a product in the keys' dtype,
    softmax and sums in float32, a bias [R, visible] (keepkv's log votes) joining every
    scaled logit of its column. Float32 products stay float32 here: on the H200 the
    engine's float32 cases met the unwidened tolerance, so its matmul did not round them
    to TF32 (the widening still allows it)."""
    rows, groups, s_len, _ = queries.shape
    logits = mass.grouped_logits(queries, keys, keys.dtype).astype(mx.float32)
    if bias is not None:  # scale * (l + b / scale): the kernel's scale * l + b to float32 rounding
        logits = logits + bias[:, None, :] / scale
    return mass.column_mass(logits.reshape(rows, groups, s_len, -1), scale, n_before) / groups


DTYPE_LOGITS = mass.Reducer("emulated-dtype-logits", _dtype_block, lambda keys: keys, lambda dtype: 4 * dtype.size,
                            takes_bias=True)


def emulate(monkeypatch) -> None:
    """Score chunks with dtype-level logits here, as drop.on_cuda()'s path does."""
    monkeypatch.setattr(drop, "on_cuda", lambda: True)
    monkeypatch.setattr(drop, "reducer", lambda kernels=None: DTYPE_LOGITS)
    monkeypatch.setattr(merge_ops, "reducer", lambda bias, preferred=None: DTYPE_LOGITS)
