"""struct CamParams, the kernel core's parameter block, packed in one place.

Every kernel backend hands the core the same block: the GPU kernels (camkv.backends.jit)
as an int32 array input, the CPU extension (camkv.backends.ext) as the bytes that
camkv._ext.update copies into the struct. A knob the core reads is a field of
PARAM_FIELDS and a line of pack_words, nothing more on this side.
"""

from __future__ import annotations

import struct

import mlx.core as mx

from .. import policy
from ..config import CaMConfig
from ..merges import code as merge_code

QUERY_BLOCK = 4  # CAMKV_QUERY_BLOCK of the core: queries scored in one pass over the keys
MAX_GROUP = 1024  # CAMKV_MAX_GROUP of the core: most threads a row's group may have

# struct CamParams (CAMKV_PARAM_FIELDS of csrc/camkv_core.h) field by field, with
# each field's struct code; tests/test_jit.py checks names, order and offsets
# against the compiled struct (camkv._ext.params_layout()).
PARAM_FIELDS = (
    ("rows", "i"), ("n", "i"), ("S", "i"), ("Dk", "i"), ("Dv", "i"), ("G", "i"), ("n_out", "i"),
    ("budget", "i"), ("n_sink", "i"), ("recent", "i"), ("window", "i"), ("merge", "i"), ("merge_keys", "i"),
    ("gate", "i"), ("chunk", "i"), ("key_scoring", "i"), ("in_place", "i"), ("offset", "i"), ("prescored", "i"),
    ("seed", "I"), ("scale", "f"), ("f32_stride", "i"), ("i32_stride", "i"), ("store_stride", "i"),
    ("recency", "i"), ("observe", "i"), ("pool", "i"),
)
PARAM_FORMAT = "<" + "".join(code for _, code in PARAM_FIELDS)
WORDS = struct.calcsize(PARAM_FORMAT) // 4  # sizeof(CamParams) / 4


def scratch_strides(chunk: bool, n: int, s_len: int, n_out: int, k_dim: int, v_dim: int) -> tuple[int, int, int]:
    """Per-row scratch (floats, ints, storage elements): camkv_*_stride of the core, in Python.

    The kernels read the strides from their parameters, so these size the buffers; tests
    check them against the core's own (camkv._ext.scratch_strides).
    """
    runs_chunk = chunk and s_len > 1
    capacity = n + s_len if runs_chunk else n_out + 1
    shadow_columns = (capacity + 7) // 8 * 8 + 8
    shadow = k_dim * shadow_columns if s_len > 1 else 0
    store = (n + s_len) * (k_dim + v_dim) if runs_chunk else k_dim + v_dim
    f32_parts = QUERY_BLOCK + 2  # logits of a query block, mass, scores (CAMKV_F32_SHADOW)
    # Survivors' squared norms and work votes (camkv_merge_scratch), and keepkv's query.
    f32_merge = 2 * capacity if runs_chunk else 0
    query = k_dim
    # Targets, counts, losers by target and starts (one more) of camkv_merge_scratch, and
    # one count per thread (camkv_list_rows, camkv_exclusive_scan).
    i32_merge = 4 * capacity + 1 + MAX_GROUP if runs_chunk else 0
    return f32_parts * capacity + shadow + f32_merge + query, 4 * capacity + i32_merge, store


def pack_words(cfg: CaMConfig, rows, n, s_len, k_dim, v_dim, groups, n_out, offset, scale,
               key_scoring, strides, prescored=False) -> bytes:
    """struct CamParams as little-endian bytes, packed by PARAM_FIELDS (in_place 0:
    whether a call may run inside its stored buffers is known only when it runs)."""
    fields = dict(
        rows=rows, n=n, S=s_len, Dk=k_dim, Dv=v_dim, G=groups, n_out=n_out, budget=cfg.budget,
        n_sink=cfg.n_sink, recent=cfg.recent, window=cfg.window, merge=merge_code(cfg.merge),
        merge_keys=int(cfg.merge_keys), gate=int(cfg.gate), chunk=int(cfg.prefill == "chunk"),
        key_scoring=int(key_scoring), in_place=0, offset=offset, prescored=int(prescored), seed=cfg.seed,
        scale=scale, f32_stride=strides[0], i32_stride=strides[1], store_stride=strides[2],
        recency=int(cfg.eviction == "recency"), observe=policy.observed(cfg, s_len), pool=cfg.pool)
    return struct.pack(PARAM_FORMAT, *(fields[name] for name, _ in PARAM_FIELDS))


def pack_params(cfg: CaMConfig, rows, n, s_len, k_dim, v_dim, groups, n_out, offset, scale,
                key_scoring, strides, prescored=False) -> mx.array:
    """pack_words' block as an int32 array (the GPU kernels' input)."""
    packed = pack_words(cfg, rows, n, s_len, k_dim, v_dim, groups, n_out, offset, scale, key_scoring, strides,
                        prescored)
    return mx.array(list(struct.unpack(f"<{WORDS}i", packed)), dtype=mx.int32)


OFFSETS_PER_TABLE = 64  # decode steps one parameter table serves
# (kind, id of the config, the other parameters but the offset) -> (config, first offset, table).
# Keyed by the config's identity, held in the entry so the id stays its own: hashing a
# CaMConfig's fields costs more than the rest of a decode step's lookup.
_tables: dict[tuple, tuple[CaMConfig, int, object]] = {}


def _table_entry(kind: str, cfg: CaMConfig, rest: tuple, offset: int, make):
    """Entry offset of the table stored for (kind, cfg, rest), made by make(cfg, rest,
    first offset) for OFFSETS_PER_TABLE offsets when none covers it. Layers with one
    configuration share a table."""
    key = (kind, id(cfg)) + rest
    held, first, table = _tables.get(key, (None, None, None))
    if held is not cfg or not first <= offset < first + OFFSETS_PER_TABLE:
        if len(_tables) >= 64:
            _tables.clear()  # shapes of a finished sequence
        first, table = offset, make(cfg, rest, offset)
        _tables[key] = (cfg, first, table)
    return table[offset - first]


def params_for(cfg: CaMConfig, rows, n, s_len, k_dim, v_dim, groups, n_out, offset, scale, key_scoring,
               strides, prescored=False) -> mx.array:
    """pack_params' block as a row of an uploaded table.

    Decode steps differ only in the offset, and a fresh parameter array per layer and
    token is a host-to-device upload each; a row of an uploaded table is a view of it.
    """
    rest = (rows, n, s_len, k_dim, v_dim, groups, n_out, scale, key_scoring, strides, prescored)
    return _table_entry("array", cfg, rest, offset, _params_table)


def _params_table(cfg: CaMConfig, rest: tuple, first: int) -> mx.array:
    rows, n, s_len, k_dim, v_dim, groups, n_out, scale, key_scoring, strides, prescored = rest
    table = mx.stack([pack_params(cfg, rows, n, s_len, k_dim, v_dim, groups, n_out, first + i, scale, key_scoring,
                                  strides, prescored) for i in range(OFFSETS_PER_TABLE)])
    mx.eval(table)
    return table


def decode_words(cfg: CaMConfig, rows, n, k_dim, v_dim, groups, offset, scale, key_scoring) -> bytes:
    """pack_words' block for a decode step of a full cache (one token, n rows before and
    after), from a table: the extension's per-token call looks its block up instead of
    packing it field by field at every layer and token."""
    return _table_entry("bytes", cfg, (rows, n, k_dim, v_dim, groups, scale, key_scoring), offset, _decode_table)


def _decode_table(cfg: CaMConfig, rest: tuple, first: int) -> list[bytes]:
    rows, n, k_dim, v_dim, groups, scale, key_scoring = rest
    strides = scratch_strides(cfg.prefill == "chunk", n, 1, n, k_dim, v_dim)
    return [pack_words(cfg, rows, n, 1, k_dim, v_dim, groups, n, first + i, scale, key_scoring, strides)
            for i in range(OFFSETS_PER_TABLE)]
