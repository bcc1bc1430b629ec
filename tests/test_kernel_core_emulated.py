"""The kernel core as MLX's GPU builds run it (camkv.backends.jit: the CUDA prelude
cuda/camkv_prelude.cuh or the Metal prelude metal/camkv_prelude.h, then
csrc/camkv_core.h; one work group of 256 threads a row, warp or simdgroup reductions,
shared memory) against the reference, on tests/test_equivalence.py's fixed cases, the
text run on CPU threads (tests/cuda_emulation.py). Where the GPU itself is present,
the backend fixture runs all of test_equivalence.py on it instead; elsewhere (CI) this
is where a defect in a prelude fails."""

from __future__ import annotations

import functools

import mlx.core as mx
import pytest

from camkv import CaMConfig, merges, reference
from camkv.backends import drop, jit
import cuda_emulation
from test_equivalence import DTYPES, MERGE_MODES, assert_states_match, feed

pytestmark = [
    pytest.mark.skipif(cuda_emulation.COMPILER is None, reason="no C++ compiler to emulate a GPU"),
    pytest.mark.filterwarnings("ignore::camkv.VotesWarning"),
]
NATIVE = {"cuda": drop.cuda_build(), "metal": mx.metal.is_available()}
TARGETS = [pytest.param(t, marks=pytest.mark.skipif(NATIVE[t], reason=f"{t} runs natively here: "
                                                    "tests/test_equivalence.py checks it"), id=t)
           for t in ("cuda", "metal")]
# The line of each prelude that sums a warp or simdgroup: halved in its last step, a defect.
_SUM = {"cuda": ("x += __shfl_xor_sync(0xffffffffu, x, offset);",
                 "x += (offset == 1 ? 0.5f : 1.0f) * __shfl_xor_sync(0xffffffffu, x, offset);"),
        "metal": ("float part = simd_sum(x);", "float part = 0.999f * simd_sum(x);")}


@pytest.fixture(autouse=True)
def _emulated():
    with cuda_emulation.emulating(jit):
        yield


def check_core(target: str, cfg: CaMConfig, sizes, **shape) -> None:
    context = f"{target} core (emulated) cfg={cfg.to_json()} sizes={sizes} shape={shape}"
    got = feed(functools.partial(jit.update, target=target), cfg, sizes, **shape)
    want = feed(reference.update, cfg, sizes, **shape)
    assert_states_match(got, want, cfg, context)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("prefill", ["exact", "chunk"])
@pytest.mark.parametrize("merge", MERGE_MODES)
def test_every_rule_matches_the_reference(target, merge, prefill):
    cfg = CaMConfig(budget=12, n_sink=2, recent=3, merge=merge, window=3, prefill=prefill, seed=7)
    check_core(target, cfg, [5, 9, 1, 1, 14, 1, 3], rows=4, k_dim=16, v_dim=10, dtype=mx.float32, seed=1)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("merge", ["mass_weighted", "keepkv"])
def test_half_precision_rows_match_the_reference(target, merge, dtype):
    cfg = CaMConfig(budget=12, n_sink=2, recent=3, merge=merge, prefill="chunk", seed=7)
    check_core(target, cfg, [5, 9, 1, 1, 14], rows=4, k_dim=16, v_dim=10, dtype=DTYPES[dtype], seed=1)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("prefill", ["exact", "chunk"])
def test_query_scoring_and_merged_keys_match_the_reference(target, prefill):
    cfg = CaMConfig(budget=10, n_sink=1, recent=2, merge="d2o", prefill=prefill, merge_keys=True, seed=3)
    check_core(target, cfg, [6, 13, 1, 1, 20], rows=4, k_dim=8, v_dim=6, dtype=mx.bfloat16, seed=4, queries_per_kv=3)


@pytest.mark.parametrize("target", TARGETS)
def test_a_defect_in_the_prelude_fails_here(target, monkeypatch):
    """The prelude's warp (simdgroup) sum made slightly wrong: the emulated core's masses,
    so its evictions and blends, leave the reference's."""
    real, (line, wrong) = jit.target_source, _SUM[target]
    assert line in real(target)[0]

    def broken(name):
        header, body = real(name)
        return header.replace(line, wrong), body

    monkeypatch.setattr(jit, "target_source", broken)
    cfg = CaMConfig(budget=12, n_sink=2, recent=3, merge="mass_weighted", prefill="exact", seed=7)
    with pytest.raises(AssertionError):
        check_core(target, cfg, [5, 9, 1, 1, 14, 1, 3], rows=4, k_dim=16, v_dim=10, dtype=mx.float32, seed=1)


def test_every_rule_has_a_case():
    assert set(MERGE_MODES) == set(merges.names())
