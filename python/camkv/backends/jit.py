"""Backends "metal" and "cuda": the kernel core compiled at run time by MLX.

mx.fast.metal_kernel (Apple GPUs) and mx.fast.cuda_kernel (NVIDIA GPUs through
MLX's CUDA backend) both take a header and a kernel body. The header is the
target's prelude plus the one kernel core (the files camkv._ext compiles for the
CPU); the body only maps the launch onto the core's entry, camkv_update_row. One
launch per layer per call: one work group of threads_per_row() threads per row.
"""

from __future__ import annotations

import math
import os

import mlx.core as mx

from ..config import CaMConfig
from ..rows import RowState
from ._common import adopt_dtype, check_kernel_inputs, chunk_mass as prescore_chunk, chunk_votes, rule_state
from . import kernel_text, selfcheck
from .params import MAX_GROUP, pack_params, params_for, scratch_strides
from .sources import inlined_source


def threads_per_row() -> int:
    """Threads of a row's work group: 256, or CAMKV_GPU_THREADS (a tuning knob), read
    at each launch so a bad value fails the GPU call that uses it, not `import camkv`.

    A multiple of the 32-wide SIMD group on both targets, at most 1024; the kernel's
    registers per thread times this must fit a GPU core (a launch fails otherwise).
    """
    text = os.environ.get("CAMKV_GPU_THREADS", "256")
    value = int(text) if text.isdigit() else -1
    if value < 32 or value > MAX_GROUP or value % 32:
        raise ValueError(f"CAMKV_GPU_THREADS must be a multiple of 32 from 32 to {MAX_GROUP}, got {text!r}")
    return value

MAX_HEAD_DIM = 256  # CAMKV_MAX_HEAD_DIM of the core
_INPUTS = ["in_keys", "in_values", "in_scores", "in_positions", "new_keys", "new_values",
           "queries", "chunk_mass", "row_ids", "in_votes", "in_threshold", "params"]
_OUTPUTS = ["out_keys", "out_values", "out_scores", "out_positions", "merges",
            "scratch_f32", "scratch_i32", "scratch_store", "out_votes", "out_threshold"]

# The shared body: row buffers, the core's entry, the merge count. Each target
# supplies its group (thread index, size, shared reduction slots) before it.
_BODY = """
  CamRowBuffers<T> b = camkv_row_buffers<T>(
      row, p, in_keys, in_values, in_scores, in_positions, new_keys, new_values, queries, chunk_mass,
      out_keys, out_values, out_scores, out_positions, scratch_f32, scratch_i32, scratch_store, in_votes,
      in_threshold, out_votes, out_threshold);
  int merged = camkv_update_row<T>(b, p, row_ids[row], g);
  if (g.tid == 0) {
    merges[row] = merged;
  }
"""

# Each target's group: the shared reduction slots, the thread index and group size,
# the row (one work group per row) and the parameter block's address space.
_GROUP = """
  {shared} float red_f[32];
  {shared} int red_i[32];
  CamGroup g;
  g.tid = {tid};
  g.size = {size};
  g.red_f = red_f;
  g.red_i = red_i;
  int row = (int){row};
  const {space}CamParams* p = (const {space}CamParams*)params;
"""

_TARGETS = {
    "metal": {
        "header": "{prelude}\n{core}\n",
        "prelude": "camkv_prelude.h",
        "group": _GROUP.format(shared="threadgroup", tid="thread_position_in_threadgroup.x",
                               size="threads_per_threadgroup.x", row="threadgroup_position_in_grid.x",
                               space="device "),
    },
    "cuda": {
        "header": "{prelude}\n{core}\n",
        "prelude": "camkv_prelude.cuh",
        "group": _GROUP.format(shared="__shared__", tid="threadIdx.x", size="blockDim.x", row="blockIdx.x",
                               space=""),
    },
}

_kernels: dict[tuple, object] = {}  # kernel_text.key(target) -> the kernel


def target_source(target: str) -> tuple[str, str]:
    """(header, body) of the run-time kernel for 'metal' or 'cuda'."""
    spec = _TARGETS[target]
    header = spec["header"].format(prelude=inlined_source(spec["prelude"]), core=inlined_source("camkv_core.h"))
    return _compact(header), spec["group"] + _BODY


def _compact(source: str) -> str:
    """The source without // comments, indentation and blank lines. MLX copies a
    custom kernel's whole text into every call's graph node and hashes it at every
    evaluation: a third less text is that much less host work per layer and token.
    (The kernel sources hold no string literal containing //.)"""
    lines = (line.split("//", 1)[0].strip() for line in source.splitlines())
    return "\n".join(line for line in lines if line) + "\n"  # MLX appends its code right after


def unavailable_reason(target: str) -> str | None:
    """None when this MLX can run the target's kernels here, else why not."""
    if target == "metal":
        return None if mx.metal.is_available() else "no Apple GPU (Metal) on this machine"
    if not (hasattr(mx, "cuda") and mx.cuda.is_available()):
        return "no NVIDIA GPU (MLX's CUDA backend) on this machine"
    return None


def make_kernel(target: str, header: str | None = None, name: str = "camkv_update"):
    """The mx.fast kernel of the target's body over `header` (default: its prelude and
    core; bench/ablate_chunk.py passes altered ones under other names)."""
    default_header, body = target_source(target)
    # On CUDA the text (some 67 kB) reaches MLX by file (kernel_text), not copied and hashed at every call.
    make = mx.fast.metal_kernel if target == "metal" else kernel_text.cuda_kernel
    return make(name=name, input_names=_INPUTS, output_names=_OUTPUTS, source=body,
                header=default_header if header is None else header)


def _kernel(target: str):
    """The compiled kernel, built once per process, target and way of passing its text
    (kernel_text.built; MLX caches per template)."""
    return kernel_text.built(_kernels, target, lambda: make_kernel(target))


_placeholders: list[mx.array] = []


def _placeholder() -> mx.array:
    """One float for inputs the core ignores in this call, made once: a decode step's
    fixed cost is mostly such small host-side work."""
    if not _placeholders:
        _placeholders.append(mx.zeros((METAL_DEVICE_MIN,), mx.float32))
        mx.eval(_placeholders[0])
    return _placeholders[0]


def _as_uint32(row_ids: mx.array) -> mx.array:
    return row_ids if row_ids.dtype == mx.uint32 else row_ids.astype(mx.uint32)


_usable: set[str] = set()  # targets found usable: a GPU does not go away mid-process


def check_update(state: RowState, new_keys, new_values, offset: int, cfg: CaMConfig, row_ids,
                 queries=None, scale=None, *, target: str) -> None:
    """Refuse what the caller got wrong (a rule, a dtype, a head dim, a thread count, a
    missing GPU), with a message naming it: such errors reach the caller, where the
    self-check falls back only for the kernel's own failures."""
    if target not in _usable:
        reason = unavailable_reason(target)
        if reason is not None:
            raise RuntimeError(f"backend {target!r} is not usable here: {reason}")
        _usable.add(target)
    check_kernel_inputs(state, new_keys, queries, scale, MAX_HEAD_DIM, "the GPU kernels")
    adopt_dtype(state, new_keys)
    threads_per_row()


def update(state: RowState, new_keys, new_values, offset: int, cfg: CaMConfig, row_ids,
           queries=None, scale=None, *, target: str) -> tuple[RowState, mx.array]:
    """Absorb S new tokens per row in one kernel launch; see camkv.reference.update.
    Inputs checked by check_update."""
    rows, s_len, k_dim = new_keys.shape
    v_dim, n = new_values.shape[-1], state.length
    votes, threshold = rule_state(state, cfg)
    state = adopt_dtype(state, new_keys)
    n_out = min(n + s_len, cfg.budget)
    key_scoring = queries is None
    if key_scoring:
        scale, groups = 1.0 / math.sqrt(k_dim), 1
        queries = _placeholder()  # unused by the core
    else:
        groups = queries.shape[2]
        queries = queries.astype(mx.float32)
    # Scoring S chunk tokens causally is S x (n + S) dot products: as matrix products
    # it fills the GPU, where the kernel's one block per row (8 blocks for 8 KV heads
    # on a 132-SM GPU) would score the queries one at a time.
    chunk_mass = None
    if cfg.prefill == "chunk" and s_len > 1:
        chunk_mass = prescore_chunk(state, new_keys, None if key_scoring else queries, scale,
                                    split=target == "cuda", cfg=cfg, votes=chunk_votes(votes, s_len))
    prescored = chunk_mass is not None
    if not prescored:
        chunk_mass = _placeholder()  # unused by the core
    strides = scratch_strides(cfg.prefill == "chunk", n, s_len, n_out, k_dim, v_dim)
    # A full cache's decode steps (the steady state) take their block from a table.
    pack = params_for if s_len == 1 and n == n_out else pack_params
    params = pack(cfg, rows, n, s_len, k_dim, v_dim, groups, n_out, int(offset), float(scale),
                  key_scoring, strides, prescored)
    # A zero-length stored state still needs a buffer to point at; a rule's state it keeps
    # none of, a placeholder.
    stored = [a if n else mx.zeros((rows, 1) + a.shape[2:], a.dtype) for a in state.arrays()[:4]]
    carried = [_placeholder() if a is None else (a if a.size else _placeholder()) for a in (votes, threshold)]
    outputs = launch(target, [*stored, new_keys, new_values, queries, chunk_mass, _as_uint32(row_ids), *carried,
                              params], n_out, v_dim, strides, votes is not None, threshold is not None)
    keys, values, scores, positions, merges = outputs[:5]
    return RowState(keys, values, scores, positions, outputs[8] if votes is not None else None,
                    outputs[9] if threshold is not None else None), merges


# MLX declares a Metal kernel's input of fewer elements than this in the constant
# address space (`const constant T*`), which the core's `const device T*` parameters
# do not take; such inputs are padded to this size (the core reads only their prefix).
METAL_DEVICE_MIN = 8


def _device_sized(a: mx.array) -> mx.array:
    if a.size >= METAL_DEVICE_MIN:
        return a
    return mx.concatenate([a.reshape(-1), mx.zeros((METAL_DEVICE_MIN - a.size,), a.dtype)])


def launch(target: str, inputs: list, n_out: int, v_dim: int, strides, votes: bool = False,
           threshold: bool = False) -> list[mx.array]:
    """The kernel over _INPUTS (rows and storage dtype from new_keys): _OUTPUTS, one
    work group per row; votes, threshold: whether the rule keeps them (their outputs are
    one float otherwise, which the core never writes)."""
    new_keys = inputs[_INPUTS.index("new_keys")]
    rows, _, k_dim = new_keys.shape
    dtype = new_keys.dtype
    threads = _guards[target].threads()
    if target == "metal":
        inputs = [_device_sized(a) for a in inputs]
    return _kernel(target)(
        inputs=inputs,
        template=[("T", dtype)],
        grid=(rows * threads, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(rows, n_out, k_dim), (rows, n_out, v_dim), (rows, n_out), (rows, n_out), (rows,),
                       (rows, strides[0]), (rows, strides[1]), (rows, strides[2]),
                       (rows, n_out) if votes else (1,), (rows,) if threshold else (1,)],
        output_dtypes=[dtype, dtype, mx.float32, mx.int32, mx.int32, mx.float32, mx.int32, dtype,
                       mx.float32, mx.float32],
    )


def _guarded(target: str) -> selfcheck.Guard:
    def checked(*args):
        check_update(*args, target=target)

    def compute(*args):
        return update(*args, target=target)

    return selfcheck.Guard(target, checked, compute, threads_per_row)


_guards = {target: _guarded(target) for target in _TARGETS}


def guard(target: str) -> selfcheck.Guard:
    """The self-check guarding a target's launches in this process."""
    return _guards[target]


class _Target:
    """A backend module-like object for one target (what camkv.backends.resolve returns):
    its updates go through the first-use self-check (camkv.backends.selfcheck)."""

    def __init__(self, target: str):
        self.__name__ = f"camkv.backends.{target}"
        self.target = target

    def update(self, state, new_keys, new_values, offset, cfg, row_ids, queries=None, scale=None):
        return _guards[self.target].update(state, new_keys, new_values, offset, cfg, row_ids, queries, scale)

    def unavailable_reason(self):
        return unavailable_reason(self.target)


metal = _Target("metal")
cuda = _Target("cuda")
