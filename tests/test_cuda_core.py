"""The kernel core as MLX's CUDA build runs it (camkv.backends.jit, target "cuda": the CUDA
prelude cuda/camkv_prelude.cuh and csrc/camkv_core.h, one work group of 256 threads a
row, warp shuffles and shared-memory reductions) against the reference, on
tests/test_equivalence.py's fixed cases. On an NVIDIA GPU the backend fixture runs all
of test_equivalence.py on it; elsewhere this module runs its text on CPU threads
(tests/cuda_emulation.py), so a defect in the CUDA prelude fails on every machine."""

from __future__ import annotations

import functools

import mlx.core as mx
import pytest

from camkv import CaMConfig, merges, reference
from camkv.backends import drop, jit
import cuda_emulation
from test_equivalence import DTYPES, MERGE_MODES, assert_states_match, feed

pytestmark = [
    pytest.mark.skipif(drop.cuda_build(), reason="on an NVIDIA GPU tests/test_equivalence.py runs the CUDA core"),
    pytest.mark.skipif(cuda_emulation.COMPILER is None, reason="no C++ compiler to emulate a GPU"),
    pytest.mark.filterwarnings("ignore::camkv.VotesWarning"),
]


@pytest.fixture(autouse=True)
def _emulated():
    with cuda_emulation.kernels_here(jit):
        yield


def check_cuda_core(cfg: CaMConfig, sizes, **shape) -> None:
    context = f"cuda core (emulated) cfg={cfg.to_json()} sizes={sizes} shape={shape}"
    got = feed(functools.partial(jit.update, target="cuda"), cfg, sizes, **shape)
    want = feed(reference.update, cfg, sizes, **shape)
    assert_states_match(got, want, cfg, context)


@pytest.mark.parametrize("prefill", ["exact", "chunk"])
@pytest.mark.parametrize("merge", MERGE_MODES)
def test_every_rule_matches_the_reference(merge, prefill):
    cfg = CaMConfig(budget=12, n_sink=2, recent=3, merge=merge, window=3, prefill=prefill, seed=7)
    check_cuda_core(cfg, [5, 9, 1, 1, 14, 1, 3], rows=4, k_dim=16, v_dim=10, dtype=mx.float32, seed=1)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("merge", ["mass_weighted", "keepkv"])
def test_half_precision_rows_match_the_reference(merge, dtype):
    cfg = CaMConfig(budget=12, n_sink=2, recent=3, merge=merge, prefill="chunk", seed=7)
    check_cuda_core(cfg, [5, 9, 1, 1, 14], rows=4, k_dim=16, v_dim=10, dtype=DTYPES[dtype], seed=1)


@pytest.mark.parametrize("prefill", ["exact", "chunk"])
def test_query_scoring_and_merged_keys_match_the_reference(prefill):
    cfg = CaMConfig(budget=10, n_sink=1, recent=2, merge="d2o", prefill=prefill, merge_keys=True, seed=3)
    check_cuda_core(cfg, [6, 13, 1, 1, 20], rows=4, k_dim=8, v_dim=6, dtype=mx.bfloat16, seed=4, queries_per_kv=3)


def test_a_defect_in_the_cuda_prelude_fails_here(monkeypatch):
    """The warp sum of the CUDA prelude halved in its last step: the emulated core's
    masses, so its evictions and blends, leave the reference's."""
    real, line = jit.target_source, "x += __shfl_xor_sync(0xffffffffu, x, offset);"
    assert line in real("cuda")[0]

    def broken(target):
        header, body = real(target)
        return header.replace(line, "x += (offset == 1 ? 0.5f : 1.0f) * __shfl_xor_sync(0xffffffffu, x, offset);"), body

    monkeypatch.setattr(jit, "target_source", broken)
    cfg = CaMConfig(budget=12, n_sink=2, recent=3, merge="mass_weighted", prefill="exact", seed=7)
    with pytest.raises(AssertionError):
        check_cuda_core(cfg, [5, 9, 1, 1, 14, 1, 3], rows=4, k_dim=16, v_dim=10, dtype=mx.float32, seed=1)


def test_every_rule_has_a_case():
    assert set(MERGE_MODES) == set(merges.names())
