"""Kernel text by file (camkv.backends.kernel_text): camkv's CUDA kernels (the decode
step's, a compression's and the kernel core's) made with their text in a file that a
one-line #include names compute what the kernels with the text inline compute, bit for
bit (sums by atomic adds, whose order varies run to run, within float32 rounding; on an
NVIDIA GPU, or the text emulated on CPU threads: tests/cuda_emulation.py), carry the
short text to MLX, and keep the text inline where no file can be written."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import cuda_emulation
from camkv import CaMConfig, quantized
from camkv.backends import (append_cuda, compact_cuda, drop, jit, kernel_text, mass_cuda, merge_cuda,
                            merge_ops, quantized_cuda, step_cuda)

pytestmark = pytest.mark.skipif(not cuda_emulation.here(), reason="no NVIDIA GPU, and no C++ compiler to emulate one")


@pytest.fixture
def sources(monkeypatch, tmp_path):
    """The kernels' files in tmp_path; the list of texts (source, then header) handed to mx.fast.cuda_kernel."""
    monkeypatch.setattr(kernel_text, "CACHE_DIR", tmp_path / "kernels")
    monkeypatch.setattr(kernel_text, "BY_FILE", False)
    monkeypatch.setattr(drop, "on_cuda", lambda: True)
    seen = []
    modules = (append_cuda, quantized_cuda, step_cuda, compact_cuda, mass_cuda, merge_cuda, jit)
    for module in modules:  # every kernel made anew in the test
        monkeypatch.setattr(module, "_kernels", {})
    with cuda_emulation.kernels_here(*modules):
        made = mx.fast.cuda_kernel
        monkeypatch.setattr(mx.fast, "cuda_kernel",
                            lambda **kw: seen.append(kw["source"] + kw.get("header", "")) or made(**kw))
        yield seen


def _step_inputs(rows: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    queries = mx.array(rng.standard_normal((1, 4, 1, 64)).astype(np.float32))
    buffers = [quantized.quantize(mx.array(rng.standard_normal((1, 2, rows + 8, 64)).astype(np.float32)), 8, 32)
               for _ in range(2)]
    step = mx.array(rng.standard_normal((1, 2, 1, 64)).astype(np.float32))
    return queries, buffers, step


def _launches(rows: int) -> list[np.ndarray]:
    """The step's launch, the attention alone and the write alone, outputs as arrays."""
    queries, (keys, values), step = _step_inputs(rows)
    new_keys, new_values, out = step_cuda.write_and_attend(queries, keys, values, step, -step, rows, 0.125, 8, 32)
    held = [tuple(a[:, :, :rows] for a in q) for q in (keys, values)]
    attended = quantized_cuda.attend(queries, *held, 0.125, None, 8, 32)
    written = append_cuda.write(keys, values, step, -step, rows, 8, 32)
    return [np.array(a) for a in (*new_keys, *new_values, out, attended, *written[0], *written[1])]


@pytest.mark.parametrize("rows", [40, quantized_cuda.WHOLE_ROWS + 60])  # one launch; stretches and a combine
def test_kernels_by_file_compute_what_the_inline_text_computes(sources, rows):
    inline = _launches(rows)
    inline_texts = list(sources)
    kernel_text.BY_FILE = True
    try:
        by_file = _launches(rows)
    finally:
        kernel_text.BY_FILE = False
    for got, want in zip(by_file, inline):
        np.testing.assert_array_equal(got, want)
    file_texts = sources[len(inline_texts):]
    assert file_texts and all(text.startswith('#include "') for text in file_texts)
    assert sum(map(len, file_texts)) * 5 < sum(map(len, inline_texts))
    written = sorted(p.name for p in kernel_text.CACHE_DIR.iterdir())
    assert len(written) == len(file_texts) and not any(name.endswith(".part") for name in written)


def _compression_launches() -> list[np.ndarray]:
    """A compression's kernels on small random problems: the merge engine's (merge_ops'
    first-use check: nearest search, sums, blends, gathers, partition, keepkv's and
    window's merges), the chunk's column mass and the one-launch drop, outputs as arrays."""
    p = merge_ops._probe_problem()
    merged = [a for a in merge_ops._probe_with_kernels(p) if a is not None]
    logits = p["held"][:, :70, :].astype(mx.float32) @ p["held"].astype(mx.float32).transpose(0, 2, 1)
    column = mass_cuda.column_mass(logits, 0.125, 90, 70, 160)
    keys = p["held"][None]
    dropped = compact_cuda.drop_compact((keys, keys[..., :33]), p["settled"], p["held_positions"][:, :60],
                                        p["chunk"], mx.array([60], mx.int32), p["cut"], 96)
    # Rows past the budget (90) of the buffers it writes are left unwritten: compared are the survivors'.
    dropped = [a[:, :, :90] if a.ndim == 4 else a for a in dropped]
    return [np.array(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a) for a in (*merged, column, *dropped)]


def test_a_compressions_kernels_by_file_compute_what_the_inline_text_computes(sources):
    inline = _compression_launches()
    inline_count = len(sources)
    kernel_text.BY_FILE = True
    try:
        by_file = _compression_launches()
    finally:
        kernel_text.BY_FILE = False
    assert len(by_file) == len(inline) > 20
    for got, want in zip(by_file, inline):
        if np.issubdtype(want.dtype, np.floating):  # sums by atomic adds land in any order, run to run
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        else:
            np.testing.assert_array_equal(got, want)
    file_texts = sources[inline_count:]
    assert len(file_texts) == inline_count and all(text.startswith('#include "') for text in file_texts)


def test_the_kernel_cores_text_reaches_mlx_by_file(sources):
    """The kernel core on CUDA (its 60-odd kB) by file computes what it computes inline."""
    rng = np.random.default_rng(3)
    cfg = CaMConfig(budget=24, n_sink=2, recent=4, merge="mean", backend="cuda")
    keys = [mx.array(rng.standard_normal((2, 40, 64)).astype(np.float32)) for _ in range(2)]
    scores = mx.array(rng.random((2, 30)).astype(np.float32))

    def update():
        state = jit.RowState(keys[0][:, :30], keys[1][:, :30], scores,
                             mx.broadcast_to(mx.arange(30, dtype=mx.int32), (2, 30)))
        out = jit.update(state, keys[0][:, 30:], keys[1][:, 30:], 30, cfg, mx.arange(2).astype(mx.uint32),
                         target="cuda")
        return [np.array(a) for a in (*out[0][:4], out[1])]

    inline = update()
    kernel_text.BY_FILE = True
    try:
        by_file = update()
    finally:
        kernel_text.BY_FILE = False
    for got, want in zip(by_file, inline):
        np.testing.assert_array_equal(got, want)
    assert len(sources) == 2 and len(sources[0]) > 50 * len(sources[1]) and sources[1].startswith('#include "')


def test_a_file_names_the_shapes_and_strides_its_text_reads(sources):
    kernel_text.BY_FILE = True
    try:
        queries, (keys, values), step = _step_inputs(24)
        step_cuda.write_and_attend(queries, keys, values, step, step, 24, 0.125, 8, 32)
    finally:
        kernel_text.BY_FILE = False
    comment = sources[-1].splitlines()[1]
    assert "kc_shape" in comment and "keys_strides" in comment and "queries_shape" not in comment.split()[1:2]


def test_where_no_file_can_be_written_the_text_stays_inline(sources, tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setattr(kernel_text, "CACHE_DIR", blocker / "kernels")
    kernel_text.BY_FILE = True
    try:
        inline = kernel_text.cuda_kernel(name="camkv_inline_check", input_names=["x"], output_names=["y"],
                                         source="y[0] = x[0];")
        x = mx.array([3.0])
        out = inline(inputs=[x], grid=(1, 1, 1), threadgroup=(1, 1, 1), output_shapes=[(1,)],
                     output_dtypes=[mx.float32])[0]
    finally:
        kernel_text.BY_FILE = False
    assert sources[-1] == "y[0] = x[0];" and out.item() == 3.0
