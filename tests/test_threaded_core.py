"""The kernel core run the way a GPU runs it, on CPU threads: a group of threads per
row with barriers and group reductions, one row per dot, teams of threads sharing a
chunk's nearest-survivor search (CAMKV_LANES) or a thread alone, with the CUDA prelude's 16-byte loads and with the Metal prelude's
element loads, built from tests/threaded/
with the system compiler. The GPU
backends' own host code (camkv.backends.jit and .params: parameter blocks and their table,
scratch sizes, chunk prescoring, placeholders) feeds it through a stand-in for the
mx.fast kernel call, so their multi-thread paths are checked where no GPU exists,
against the reference as every backend is (tests/test_equivalence.py). Float32
storage only (the threaded build has no 16-bit types)."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from camkv import CaMConfig, backends, reference
from camkv.backends import jit, params
from camkv import merges
from test_equivalence import KERNEL_BLENDS, assert_states_match, check_simultaneous_merges, feed

ROOT = Path(__file__).resolve().parents[1]
COMPILER = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
THREADS = 32  # one SIMD group: the smallest GPU work group the host allows
KERNEL_MERGES = merges.names()  # the kernel core runs every rule


# The GPU preludes' loads (CUDA's 16-byte words, Metal's elements) and their teams of
# 8 threads a chunk's nearest-survivor search (CAMKV_LANES), and teams of one thread
# (lanes-1: the CPU's loop, a thread a loser).
BUILDS = {"cuda-loads": (1, 8), "metal-loads": (0, 8), "lanes-1": (1, 1)}


@pytest.fixture(scope="module", params=list(BUILDS))
def library(request, tmp_path_factory):
    if COMPILER is None:
        pytest.skip("no C++ compiler on PATH")
    wide, lanes = BUILDS[request.param]
    built = tmp_path_factory.mktemp("threaded") / f"libcamkv_threaded_{request.param}.so"
    result = subprocess.run(
        [COMPILER, "-std=c++20", "-O1", "-ffp-contract=off", "-pthread", "-shared", "-fPIC",
         f"-DCAMKV_THREADS_WIDE={wide}", f"-DCAMKV_THREADS_LANES={lanes}",
         f"-I{ROOT / 'csrc'}", f"-I{ROOT / 'tests' / 'threaded'}",
         str(ROOT / "tests" / "threaded" / "camkv_threaded.cpp"), "-o", str(built)],
        capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    library = ctypes.CDLL(str(built))
    library.lanes = lanes
    return library


def _pointer(a: np.ndarray):
    return a.ctypes.data_as(ctypes.c_void_p)


def _launcher(library):
    """A stand-in for mx.fast.cuda_kernel's call: the same inputs and outputs, run on threads."""

    def launch(inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        assert template == [("T", mx.float32)], "the threaded build holds float32 rows only"
        threads = threadgroup[0]
        assert grid[0] % threads == 0
        given_arrays = [np.ascontiguousarray(np.array(a)) for a in inputs]
        # A GPU's fresh outputs hold whatever was there: poisoned here, so a read of
        # an entry before the kernel wrote it shows up as NaN or a bad index.
        outputs = [np.full(shape, np.nan, np.float32) if dtype == mx.float32 else np.full(shape, -7, np.int32)
                   for shape, dtype in zip(output_shapes, output_dtypes)]
        block, buffers = given_arrays[-1], given_arrays[:-1]
        assert len(buffers) == 11 and len(outputs) == 10
        library.camkv_threaded_run(ctypes.c_int(threads), _pointer(block), *map(_pointer, buffers),
                                   *map(_pointer, outputs))
        return [mx.array(o) for o in outputs]

    return launch


@pytest.fixture
def threaded_update(library, monkeypatch):
    """jit.update's host path with its kernel launch run by THREADS CPU threads a row."""
    monkeypatch.setattr(jit, "_kernel", lambda target: _launcher(library))
    monkeypatch.setattr(jit, "_usable", {"cuda"})
    monkeypatch.setenv("CAMKV_GPU_THREADS", str(THREADS))
    params._tables.clear()

    def update(state, new_keys, new_values, offset, cfg, row_ids, queries=None, scale=None):
        return jit.update(state, new_keys, new_values, offset, cfg, row_ids, queries, scale, target="cuda")

    return update


def _check(update, cfg, sizes, **shape):
    context = f"threaded core, cfg={cfg.to_json()} sizes={sizes} shape={shape}"
    got = feed(update, cfg, sizes, dtype=mx.float32, **shape)
    with mx.stream(mx.cpu):
        want = feed(reference.update, cfg, sizes, dtype=mx.float32, **shape)
    assert_states_match(got, want, cfg, context)


@pytest.mark.parametrize("prefill", ["exact", "chunk"])
@pytest.mark.parametrize("merge", KERNEL_MERGES)
def test_every_merge_mode_matches_the_reference(threaded_update, merge, prefill):
    cfg = CaMConfig(budget=12, n_sink=2, recent=3, merge=merge, window=3, prefill=prefill, seed=7)
    _check(threaded_update, cfg, [5, 9, 1, 1, 14, 1, 3], rows=3, k_dim=16, v_dim=10, seed=1)


# G = 5 crosses a query block (CAMKV_QUERY_BLOCK = 4) and leaves a block of one;
# k_dim 72 runs two 32-feature key loads and an 8-feature tail, k_dim 12 the
# element-wise path (not a multiple of 8).
@pytest.mark.parametrize("groups, k_dim", [(1, 72), (4, 72), (5, 72), (5, 12), (3, 40)])
@pytest.mark.parametrize("prefill", ["exact", "chunk"])
def test_query_blocks_and_wide_dots_match_the_reference(threaded_update, groups, k_dim, prefill):
    cfg = CaMConfig(budget=40, n_sink=2, recent=4, prefill=prefill, scoring="query", seed=3)
    _check(threaded_update, cfg, [30, 1, 1, 20, 1, 1, 1], rows=2, k_dim=k_dim, v_dim=24, seed=2,
           queries_per_kv=groups)


@pytest.mark.parametrize("merge", merges.names(blends=True))
def test_merge_keys_and_the_gate_match_the_reference(threaded_update, merge):
    cfg = CaMConfig(budget=10, n_sink=1, recent=2, merge=merge, merge_keys=merges.rule(merge).keys_allowed,
                    prefill="chunk", gate=True, seed=11)
    _check(threaded_update, cfg, [8, 7, 1, 9, 1], rows=3, k_dim=16, v_dim=16, seed=4)


# The patches of threaded_update are the same for every example, so sharing the
# function-scoped fixture across them is what is meant.
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), merge=st.sampled_from(KERNEL_MERGES), prefill=st.sampled_from(["exact", "chunk"]),
       sizes=st.lists(st.integers(1, 12), min_size=1, max_size=6), groups=st.integers(0, 6),
       k_dim=st.sampled_from([8, 16, 40, 64]))
def test_fuzz_matches_the_reference(threaded_update, seed, merge, prefill, sizes, groups, k_dim):
    cfg = CaMConfig(budget=9, n_sink=1, recent=2, merge=merge, window=2, prefill=prefill, seed=seed,
                    scoring="query" if groups else "key")
    _check(threaded_update, cfg, sizes, rows=2, k_dim=k_dim, v_dim=8, seed=seed, queries_per_kv=groups)


# Recency eviction (CamParams.recency) and window scoring (the host's prescored mass of
# the last observation_window queries, max-pooled).
@pytest.mark.parametrize("fields", [dict(eviction="recency"), dict(prefill_scoring="window", observation_window=4),
                                    dict(prefill_scoring="window", observation_window=4, pool=3,
                                         eviction="recency")])
@pytest.mark.parametrize("merge", ["window", "drop", "sim_weighted"])
def test_recency_and_window_scoring_match_the_reference(threaded_update, merge, fields):
    cfg = CaMConfig(budget=12, n_sink=2, recent=3, merge=merge, window=3, gate=True, seed=5, scoring="query",
                    **fields)
    _check(threaded_update, cfg, [5, 9, 1, 1, 14, 1, 3], rows=3, k_dim=16, v_dim=10, seed=6, queries_per_kv=2)


def _tied_keys(rows: int, k_dim: int, seed: int):
    """keys_at for feed: 12 random directions, each at scales 2^-2 .. 2^2 (token t:
    direction t % 12, scale 2^((t // 12) % 5 - 2)). Scaling by a power of two is exact,
    so a loser's cosines with the survivors of its own direction tie exactly, while
    their scores (which the scale changes) do not."""
    directions = np.random.default_rng(seed).standard_normal((rows, 12, k_dim)).astype(np.float32)

    def keys_at(tokens):
        scales = np.exp2((tokens // 12) % 5 - 2).astype(np.float32)
        return directions[:, tokens % 12] * scales[None, :, None]

    return keys_at


@pytest.mark.parametrize("merge", merges.names(kind=merges.NEAREST))
def test_nearest_survivor_ties_go_to_the_smaller_column_as_the_cpu_kernel(threaded_update, merge):
    """Section 4.1's tie rule under teams: where a loser's best cosines tie exactly across
    the columns of several lanes, the team keeps the smallest column, as the CPU kernel's
    one-thread search does (the reference's cosines come from matrix products, whose
    rounding may break such ties; the CPU kernel's are the same sums as the threads')."""
    reasons = backends.available()
    if reasons["ext"] is not None:
        pytest.skip(reasons["ext"])
    cfg = CaMConfig(budget=24, n_sink=1, recent=2, merge=merge, prefill="chunk", gate=False, seed=3)
    shape = dict(rows=2, k_dim=16, v_dim=8, dtype=mx.float32, seed=0, queries_per_kv=2, keys_at=_tied_keys(2, 16, 0))
    got = feed(threaded_update, cfg, [48, 9, 1, 1], **shape)
    with mx.stream(mx.cpu):
        want = feed(backends.resolve("ext").update, cfg, [48, 9, 1, 1], **shape)
    assert sum(int(m.sum()) for m in want[1]) > 0, "the case merges nothing"
    assert_states_match(got, want, cfg, f"tied keys, {merge}")


@pytest.mark.parametrize("merge", KERNEL_BLENDS)
def test_targets_taking_several_losers_match_the_reference(threaded_update, merge):
    """A chunk's simultaneous merges by a group of threads (phases over losers, targets
    grouped by their owner threads, blends shared over (target, feature) pairs): 56 losers
    for at most 13 non-sink survivors, the gate on, merge_keys where the rule allows it."""
    cfg = CaMConfig(budget=16, n_sink=2, recent=3, merge=merge, window=3, prefill="chunk", gate=True, seed=5,
                    merge_keys=merges.rule(merge).keys_allowed, scoring="query")
    seen = check_simultaneous_merges(threaded_update, cfg, 12, 60, rows=3, k_dim=16, v_dim=12, dtype=mx.float32,
                                     seed=3, queries_per_kv=2, label="threaded core")
    assert seen["flips"] or seen["most"] >= 3, f"the case must give a target several losers, saw {seen}"


@pytest.mark.parametrize("prefill", ["exact", "chunk"])
@pytest.mark.parametrize("merge", merges.names(kind=merges.NEAREST))
def test_a_loser_with_a_poisoned_key_merges_nowhere(threaded_update, merge, prefill):
    """A loser whose key is NaN has no finite cosine: it merges nowhere, in a group of threads too."""
    def keys_at(tokens):
        keys = np.random.default_rng(3).standard_normal((2, 40, 8)).astype(np.float32)[:, tokens]
        keys[1, tokens == 5, 2] = np.nan  # row 1's token 5
        return keys

    cfg = CaMConfig(budget=8, n_sink=1, recent=2, merge=merge, prefill=prefill, gate=False, slack=0)
    _check(threaded_update, cfg, [6, 1, 1, 1, 9, 1], rows=2, k_dim=8, v_dim=4, seed=2, keys_at=keys_at)
