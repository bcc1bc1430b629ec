"""The Metal kernel text MLX would compile, checked on Linux with distinct address spaces.

mx.fast.metal_kernel writes each call's signature itself: an input of fewer than 8
elements becomes `const constant T*`, the others `const device T*`, with the dtypes
of that call. The text is taken from MLX's own generator (mx.export_function hands
the custom kernel's source to a callback, no GPU needed) for every launch the caches
make here, and compiled with clang++ -fsyntax-only against tests/metal_stub, where
`device`, `constant` and `threadgroup` are distinct address spaces, so a pointer passed
into the wrong one fails as the Metal compiler fails on it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from camkv import CaMConfig, CaMKVCache, hook, merges, reference
from camkv.backends import jit
from camkv.rows import RowState

ROOT = Path(__file__).resolve().parents[1]
CLANG = shutil.which("clang++")
pytestmark = pytest.mark.skipif(
    CLANG is None and os.environ.get("CAMKV_REQUIRE_CLANG") != "1",
    reason="clang++ not on PATH (the address-space check needs clang's address_space attribute)")

STORAGE = (mx.float16, mx.bfloat16, mx.float32)
# (batch, KV heads): SmolLM2's 3 heads at batch 1 give inputs of fewer than 8 elements.
LAYOUTS = ((1, 3), (2, 8))
CONFIGS = {
    "default": dict(budget=16, n_sink=1, recent=4),
    "key scoring": dict(budget=16, n_sink=1, recent=4, scoring="key"),
    "exact": dict(budget=16, n_sink=1, recent=4, prefill="exact"),
    "slack 0": dict(budget=16, n_sink=1, recent=4, slack=0),
    "causal prompts": dict(budget=16, n_sink=1, recent=4, prefill_scoring="causal"),
    # A merge rule's chunks run as MLX operations on a GPU (backends.merge_ops); its
    # one-token compressions (slack 0) launch the kernel.
    **{f"merge {rule}": dict(budget=16, n_sink=1, recent=4, merge=rule, slack=0)
       for rule in merges.names() if rule != "drop"},
}


class _Capture:
    """Stands in for the compiled kernel: records the source MLX generates for each call
    and the launch's shape of the problem, returns zeros of the output shapes."""

    def __init__(self):
        self.sources: dict[str, str] = {}
        self.launches: list[dict] = []
        self._kernel = jit.make_kernel("metal")

    def __call__(self, *, inputs, output_shapes, output_dtypes, **launch):
        def kernel(*arrays):
            return self._kernel(inputs=list(arrays), output_shapes=output_shapes, output_dtypes=output_dtypes,
                                **launch)

        def keep(entry):
            if entry.get("type") == "primitive" and entry.get("name") == "CustomKernel":
                name, source = entry["arguments"][:2]
                self.sources[name] = source

        mx.export_function(keep, kernel, *inputs)
        return [mx.zeros(shape, dtype) for shape, dtype in zip(output_shapes, output_dtypes)]


@pytest.fixture
def captured(monkeypatch):
    """Caches built with backend="metal" on this machine: each launch's text captured,
    its result taken from the reference so the caches go on as they would on a Mac."""
    capture = _Capture()
    real_update = jit.update

    def update(state, new_keys, new_values, offset, cfg, row_ids, queries=None, scale=None, *, target):
        real_update(state, new_keys, new_values, offset, cfg, row_ids, queries, scale, target=target)
        rows, s_len = new_keys.shape[:2]
        capture.launches.append(dict(dtype=new_keys.dtype, rows=rows, one_token=s_len == 1,
                                     key_scoring=queries is None, first=state.length == 0,
                                     prescored=cfg.prefill == "chunk" and s_len > 1, merge=cfg.merge))
        return reference.update(state, new_keys, new_values, offset, cfg, row_ids, queries, scale)

    monkeypatch.setattr(jit, "unavailable_reason", lambda target: None)
    monkeypatch.setattr(jit, "_kernel", lambda target: capture)
    monkeypatch.setattr(jit, "update", update)
    monkeypatch.setattr(hook, "can_feed", lambda modules: True)
    monkeypatch.setenv("CAMKV_SELF_CHECK", "0")
    return capture


def _drive(cfg: CaMConfig, batch: int, heads: int, dtype, rng) -> None:
    """A multi-turn chat on one layer: a prompt, decode steps past two compressions, a
    one-token prompt, more decode steps, the pending tokens compressed (as saving does)
    and the state read."""
    cache = CaMKVCache(cfg)
    groups, k_dim, v_dim = 2, 16, 16

    def feed(s_len):
        keys, values = (mx.array(rng.standard_normal((batch, heads, s_len, d)).astype(np.float32)).astype(dtype)
                        for d in (k_dim, v_dim))
        cache.update_and_fetch(keys, values)
        if cfg.scoring == "query":
            queries = mx.array(rng.standard_normal((batch, heads * groups, s_len, k_dim)).astype(np.float32))
            cache.observe_queries(queries.astype(dtype), k_dim ** -0.5)

    for s_len in [40] + [1] * (2 * cfg.slack + 4) + [1] + [1] * (cfg.slack + 2):
        feed(s_len)
    cache.compress_pending()
    mx.eval(cache.state)


def _prescored_chunk(dtype, rows: int, rng) -> None:
    """A first chunk through the kernel with its mass prescored: the class a backend's
    update still launches for a chunk, which a cache hands the MLX engines instead."""
    keys, values = (mx.array(rng.standard_normal((rows, 40, 16)).astype(np.float32)).astype(dtype) for _ in range(2))
    queries = mx.array(rng.standard_normal((rows, 40, 2, 16)).astype(np.float32))
    empty = RowState.empty(rows, 16, 16, dtype)
    cfg = CaMConfig(budget=16, n_sink=1, recent=4, merge="mass_weighted", backend="metal")
    mx.eval(jit.metal.update(empty, keys, values, 0, cfg, mx.arange(rows).astype(mx.uint32), queries, 0.25))


def _collect(captured) -> _Capture:
    rng = np.random.default_rng(0)
    for dtype in STORAGE:
        for batch, heads in LAYOUTS:
            for name, fields in CONFIGS.items():
                _drive(CaMConfig(backend="metal", **fields), batch, heads, dtype, rng)
            _prescored_chunk(dtype, batch * heads, rng)
    return captured


def _compile(source: str, tmp_path: Path, name: str) -> subprocess.CompletedProcess:
    """clang++ -fsyntax-only of one generated kernel against the Metal stub. Metal takes
    threadgroup arrays at kernel scope; C++ takes address-space variables only as
    statics, so those declarations become static for the check."""
    text = re.sub(r"(?m)^(\s*)threadgroup (\w+ \w+\[)", r"\1static threadgroup \2", source)
    # MLX's explicit instantiation names the entry point by Metal attributes C++ does not
    # allow there: the instantiation alone stays.
    text = re.sub(r"template \[\[host_name\([^)]*\)\]\] \[\[kernel\]\] ", "template ", text)
    path = tmp_path / f"{name}.cpp"
    path.write_text("#include <metal_stdlib>\n" + text)
    command = [CLANG or "clang++", "-std=c++17", "-fsyntax-only", "-x", "c++", "-Wno-unknown-attributes", "-Xclang", "-fallow-half-arguments-and-returns",
               "-Wno-unused-variable", f"-I{ROOT / 'tests' / 'metal_stub'}", str(path)]
    return subprocess.run(command, capture_output=True, text=True)


# The drive feeds one layer's cache without a model's attention, so keepkv's votes are
# never read; the warning that says so is expected here.
@pytest.mark.filterwarnings("ignore::camkv.cache_input.VotesWarning")
def test_every_launch_class_compiles_with_mlxs_address_spaces(captured, tmp_path):
    launches = _collect(captured)
    seen = {(l["dtype"], l["rows"] < 8, l["one_token"], l["key_scoring"], l["first"], l["prescored"])
            for l in launches.launches}
    # The classes a Mac launches: every dtype, few and many rows, one-token and chunk calls,
    # key and query scoring, first compressions and later ones, prescored chunks.
    for dtype in STORAGE:
        for few in (True, False):
            assert (dtype, few, True, False, False, False) in seen  # a one-token compression, queries
            assert (dtype, few, True, True, False, False) in seen  # a one-token compression, keys
            assert (dtype, few, False, False, True, True) in seen  # a first, prescored chunk
            assert (dtype, few, False, False, True, False) in seen  # a first chunk, exact mode
    assert {l["merge"] for l in launches.launches} == set(merges.names())
    failures = []
    for i, (name, source) in enumerate(sorted(launches.sources.items())):
        result = _compile(source, tmp_path, f"k{i}")
        if result.returncode:
            failures.append(f"{name}:\n{result.stderr[:1500]}")
    print(f"{len(launches.sources)} kernel texts from {len(launches.launches)} launches")
    assert not failures, "\n".join(failures)


def test_the_check_fails_on_a_device_pointer_handed_a_constant_input(captured, tmp_path, monkeypatch):
    """The kernel texts of launches with small inputs left as they are (one-float
    placeholders, nothing padded: the launches before small inputs were padded) must
    fail the check."""
    captured_inputs = []
    one_float = mx.zeros((1,), mx.float32)
    monkeypatch.setattr(jit, "_placeholder", lambda: one_float)
    monkeypatch.setattr(jit, "_device_sized", lambda a: captured_inputs.append(a.size) or a)
    for fields in (dict(slack=0), dict(scoring="key")):
        _drive(CaMConfig(backend="metal", budget=16, n_sink=1, recent=4, **fields), 1, 3, mx.float16,
               np.random.default_rng(1))
    assert min(captured_inputs) < jit.METAL_DEVICE_MIN
    # A one-token call's unused chunk_mass, a key-scored call's unused queries, the
    # scores and positions of 3 rows: inputs the core takes as device pointers.
    constant = [s for s in captured.sources.values()
                if re.search(r"const constant float\* (chunk_mass|queries|in_scores)", s)]
    assert constant, "no kernel text declared a small input constant"
    for i, source in enumerate(constant):
        result = _compile(source, tmp_path, f"unpadded{i}")
        assert result.returncode != 0
        assert "cannot pass pointer to address space '2' as a pointer to address space '1'" in result.stderr


def test_the_stub_keeps_the_address_spaces_apart(tmp_path):
    path = tmp_path / "spaces.cpp"
    path.write_text("#include <metal_stdlib>\n"
                    "inline float first(const device float* p) { return p[0]; }\n"
                    "float f(const constant float* q) { return first(q); }\n")
    result = subprocess.run([CLANG or "clang++", "-std=c++17", "-fsyntax-only", "-x", "c++",
                             f"-I{ROOT / 'tests' / 'metal_stub'}", str(path)], capture_output=True, text=True)
    assert result.returncode != 0 and "address space" in result.stderr
