"""The run-time kernels (backends "metal" and "cuda"): their sources parse on Linux,
their host-side layout (parameters, scratch sizes) agrees with the kernel core.
Their results are checked against the reference by tests/test_equivalence.py and
tests/test_rules.py wherever the GPU exists."""

from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from camkv import CaMConfig
from camkv.backends import jit, params

ROOT = Path(__file__).resolve().parents[1]
COMPILER = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")

# What MLX's CUDA backend generates around a body, reduced to the parameters the body uses.
_SIGNATURES = {
    "cuda": (
        "template <typename T>\n__global__ void camkv_update(\n"
        "  const T* in_keys, const T* in_values, const float* in_scores, const int32_t* in_positions,\n"
        "  const T* new_keys, const T* new_values, const float* queries, const float* chunk_mass,\n"
        "  const uint32_t* row_ids, const float* in_votes, const float* in_threshold,\n"
        "  const int32_t* params, T* out_keys, T* out_values, float* out_scores, int32_t* out_positions,\n"
        "  int32_t* merges, float* scratch_f32, int32_t* scratch_i32, T* scratch_store, float* out_votes,\n"
        "  float* out_threshold) {{\n{body}\n}}\n"
        "template void camkv_update<float>(CUDA_ARGS(float));\n"
    ),
}
_ARGS = {
    "cuda": "#define CUDA_ARGS(T) const T*, const T*, const float*, const int32_t*, const T*, const T*, const float*, "
            "const float*, "
            "const uint32_t*, const float*, const float*, const int32_t*, T*, T*, float*, int32_t*, int32_t*, float*, "
            "int32_t*, T*, float*, float*\n",
}
_STUB = {"cuda": '#include "cuda_stub.h"\n'}


def _generated(target: str) -> str:
    header, body = jit.target_source(target)
    return _STUB[target] + _ARGS[target] + header + "\n" + _SIGNATURES[target].format(body=body)


@pytest.mark.skipif(COMPILER is None, reason="no C++ compiler on PATH")
@pytest.mark.parametrize("target", ["cuda"])  # Metal: tests/test_metal_source.py, as MLX writes it
def test_run_time_kernel_source_parses_against_the_stub(tmp_path, target):
    source = tmp_path / f"camkv_jit_{target}.cpp"
    source.write_text(_generated(target))
    stub = ROOT / "tests" / ("metal_stub" if target == "metal" else "cuda_stub")
    result = subprocess.run(
        [COMPILER, "-std=c++17", "-fsyntax-only", "-x", "c++", "-Wall", "-Werror", "-Wno-unused-variable",
         "-Wno-attributes", f"-I{stub}", str(source)],
        capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(COMPILER is None, reason="no C++ compiler on PATH")
def test_every_chunk_ablation_variant_of_the_bench_still_parses(tmp_path):
    """bench/ablate_chunk.py finds its cuts by their text in the core: keep them in step."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ablate_chunk", ROOT / "bench" / "ablate_chunk.py")
    ablate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ablate)
    variants = ablate.variant_headers("cuda")
    assert [phase for phase, _ in variants] == [phase for phase, _, _ in ablate.CUTS]
    _, body = jit.target_source("cuda")
    stub = ROOT / "tests" / "cuda_stub"
    for i, (phase, header) in enumerate(variants):
        assert header.count("return 0;\n") > jit.target_source("cuda")[0].count("return 0;\n"), phase
        source = tmp_path / f"ablate_{i}.cpp"
        source.write_text(_STUB["cuda"] + _ARGS["cuda"] + header + "\n" + _SIGNATURES["cuda"].format(body=body))
        result = subprocess.run([COMPILER, "-std=c++17", "-fsyntax-only", "-x", "c++", "-Wno-attributes",
                                 f"-I{stub}", str(source)], capture_output=True, text=True)
        assert result.returncode == 0, (phase, result.stderr[:2000])
    rows = [{"stops_before": "a", "update_ms": 1.0}, {"stops_before": "b", "update_ms": 3.5},
            {"stops_before": "(whole kernel)", "update_ms": 4.0}]
    assert ablate.phase_times(rows) == [{"phase": "a", "ms": 2.5}, {"phase": "b", "ms": 0.5}]


def test_the_header_inlines_prelude_and_core_without_local_includes():
    for target in ("metal", "cuda"):
        header, body = jit.target_source(target)
        assert "camkv_update_row" in header and "camkv_update_row" in body
        assert '#include "camkv' not in header


@settings(max_examples=60, deadline=None)
@given(chunk=st.booleans(), n=st.integers(0, 300), s_len=st.integers(1, 300), budget=st.integers(8, 300),
       k_dim=st.integers(1, 256), v_dim=st.integers(1, 256))
def test_scratch_sizes_equal_the_cores(chunk, n, s_len, budget, k_dim, v_dim):
    ext = pytest.importorskip("camkv._ext")
    n = min(n, budget)
    n_out = min(n + s_len, budget)
    assert params.scratch_strides(chunk, n, s_len, n_out, k_dim, v_dim) == tuple(
        ext.scratch_strides(chunk, n, s_len, n_out, k_dim, v_dim))


def test_the_parameter_fields_are_the_compiled_structs():
    """params.PARAM_FIELDS lays out struct CamParams as the compiler does: same names,
    order, offsets and size (camkv._ext reports the struct from CAMKV_PARAM_FIELDS)."""
    ext = pytest.importorskip("camkv._ext")
    packed, offset = [], 0
    for name, code in params.PARAM_FIELDS:
        packed.append((name, offset, struct.calcsize("<" + code)))
        offset += packed[-1][2]
    assert packed == [tuple(field) for field in ext.params_layout()]
    assert struct.calcsize(params.PARAM_FORMAT) == ext.PARAMS_SIZE


def test_parameters_pack_in_the_cores_field_order():
    cfg = CaMConfig(budget=64, n_sink=3, recent=5, merge="window", window=2, gate=False, seed=2**32 - 2,
                    prefill="exact", eviction="recency")
    words = params.pack_params(cfg, 6, 10, 1, 32, 16, 2, 11, 77, 0.125, False, (7, 8, 9), True).tolist()
    assert len(words) == 27  # sizeof(CamParams) / 4
    assert words[:19] == [6, 10, 1, 32, 16, 2, 11, 64, 3, 5, 2, 2, 0, 0, 0, 0, 0, 77, 1]
    assert struct.unpack("<I", struct.pack("<i", words[19]))[0] == 2**32 - 2
    assert struct.unpack("<f", struct.pack("<i", words[20]))[0] == 0.125
    assert words[21:] == [7, 8, 9, 1, 1, 1]  # strides; recency, the one token's query, no pooling


def test_window_scoring_packs_the_chunks_observed_queries_and_pool():
    cfg = CaMConfig(budget=64, prefill_scoring="window", observation_window=4, pool=5)
    for s_len, observed in ((10, 4), (3, 3), (1, 1)):
        words = params.pack_params(cfg, 6, 10, s_len, 32, 16, 2, 11, 77, 0.125, False, (7, 8, 9)).tolist()
        assert words[2] == s_len and words[24:] == [0, observed, 5]


def test_a_decode_steps_parameters_are_an_entry_of_a_shared_table():
    cfg = CaMConfig(budget=64, seed=5)
    args = (cfg, 4, 64, 1, 32, 32, 2, 64)
    tail = (0.25, False, (1, 2, 3))
    params._tables.clear()
    for offset in (100, 101, 100 + params.OFFSETS_PER_TABLE - 1, 100 + params.OFFSETS_PER_TABLE, 40):
        row = params.params_for(*args, offset, *tail)
        assert row.tolist() == params.pack_params(*args, offset, *tail).tolist(), offset
        strides = params.scratch_strides(True, 64, 1, 64, 32, 32)
        assert params.decode_words(cfg, 4, 64, 32, 32, 2, offset, 0.25, False) == params.pack_words(
            *args, offset, 0.25, False, strides), offset
    # Two tables of each kind made (offsets 100.. and 164..), then one more for 40: the
    # newest per key, the GPU kernels' arrays and the extension's bytes apart.
    assert len(params._tables) == 2 and all(first == 40 for _, first, _ in params._tables.values())
    # An equal configuration of its own gets a table of its own, with the same words.
    twin = CaMConfig(budget=64, seed=5)
    assert params.params_for(twin, *args[1:], 40, *tail).tolist() == params.params_for(*args, 40, *tail).tolist()
    assert len(params._tables) == 3


def test_forcing_an_absent_gpu_backend_is_a_clear_error():
    from camkv import backends

    for target in ("metal", "cuda"):
        reason = backends.available()[target]
        if reason is None:
            continue
        with pytest.raises(RuntimeError, match=f"backend '{target}' is not usable here: no "):
            backends.resolve(target)


@pytest.mark.parametrize("block", [1, 4, 1000])
def test_chunk_scoring_in_query_blocks_equals_the_whole_chunk(monkeypatch, block):
    # The kernel backends prescore a chunk in blocks of queries to bound memory; any
    # block size must give the reference's mass (split products included).
    from camkv import mass
    from camkv.backends import _common as common
    from camkv.reference import attention_mass_causal
    from camkv.rows import RowState

    mx.random.seed(3)
    rows, n, s_len, dim, groups = 2, 5, 37, 8, 3
    state = RowState(mx.random.normal((rows, n, dim)), mx.random.normal((rows, n, dim)), mx.zeros((rows, n)),
                     mx.zeros((rows, n), mx.int32))
    new_keys, queries = mx.random.normal((rows, s_len, dim)), mx.random.normal((rows, s_len, groups, dim))
    monkeypatch.setattr(mass, "MASS_BYTES", rows * groups * (n + s_len) * 16 * block)
    got = common.chunk_mass(state, new_keys, queries, 0.3, split=True)
    want = attention_mass_causal(queries, mx.concatenate([state.keys, new_keys], axis=1), 0.3, n)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-6)


def test_split_product_survives_a_matmul_that_rounds_its_inputs_to_tf32():
    # Emulate a TF32 tensor core (inputs rounded to 10 mantissa bits): the split
    # product must stay float32-accurate where the plain one loses about 1e-4.
    from camkv import reference

    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((4, 64, 128)).astype(np.float32), rng.standard_normal((4, 128, 64)).astype(np.float32)
    want = a.astype(np.float64) @ b.astype(np.float64)
    tf32 = reference._tf32_high

    def rounded(x, y):
        return tf32(x) @ tf32(y)

    a_hi, b_hi = tf32(mx.array(a)), tf32(mx.array(b))
    # reference._float32_product(split=True), with every product rounding its inputs
    split = rounded(a_hi, b_hi) + (rounded(a_hi, mx.array(b) - b_hi) + rounded(mx.array(a) - a_hi, b_hi))
    scale = np.abs(want).max()
    assert np.abs(np.array(rounded(mx.array(a), mx.array(b))) - want).max() / scale > 1e-5
    assert np.abs(np.array(split) - want).max() / scale < 2e-6


@pytest.mark.parametrize("value", ["100", "0", "2048", "many"])
def test_a_bad_thread_count_is_named_when_a_launch_reads_it(monkeypatch, value):
    monkeypatch.setenv("CAMKV_GPU_THREADS", value)
    with pytest.raises(ValueError, match=f"multiple of 32 from 32 to 1024, got '{value}'"):
        jit.threads_per_row()
    monkeypatch.setenv("CAMKV_GPU_THREADS", "512")
    assert jit.threads_per_row() == 512
