"""Shared fixtures: the backends to check, random inputs without float near-ties."""

from __future__ import annotations

import os

import numpy as np
import mlx.core as mx
import pytest

from camkv import _blas, backends
from camkv.rows import RowState


def pytest_configure(config):
    """The suite compares every backend with the reference bit for bit or within a few
    ulps of float32 sums taken in feature order, as MLX's own CPU BLAS takes them. An
    OpenBLAS loaded into the process (LD_PRELOAD; camkv's command line loads one for speed,
    the package and these tests do not) sums the reference's products in another order and
    fails those comparisons without a defect, so the run stops here saying why."""
    if _blas.bound():
        raise pytest.UsageError(
            "OpenBLAS is loaded into this process (LD_PRELOAD="
            f"{os.environ.get('LD_PRELOAD', '')!r}): the tests compare backends with the reference under "
            "MLX's own BLAS, whose float32 sums OpenBLAS takes in another order. Run them without it "
            "(unset LD_PRELOAD).")


@pytest.fixture(autouse=True, scope="session")
def _kernel_files_in_a_temporary_folder(tmp_path_factory):
    """The CUDA kernels' text files (camkv.backends.kernel_text) that tests make, emulated
    or on a GPU, go to a folder of the run's, not the user's cache."""
    from camkv.backends import kernel_text

    kernel_text.CACHE_DIR = tmp_path_factory.mktemp("cuda-kernels")
    yield
    kernel_text.CACHE_DIR = None


def _backend_params():
    """Every backend; those not usable here are skipped with the reason, except that
    CAMKV_REQUIRE_METAL=1 (the Metal runner's CI) makes a missing Metal backend fail."""
    params = []
    require_metal = os.environ.get("CAMKV_REQUIRE_METAL") == "1"
    for name, reason in backends.available().items():
        skip = reason is not None and not (require_metal and name == "metal")
        marks = [pytest.mark.skip(reason=f"{name}: {reason}")] if skip else []
        params.append(pytest.param(name, marks=marks, id=name))
    return params


@pytest.fixture(autouse=True, scope="module")
def no_attention_hook_left_installed():
    """Every path that installs camkv's attention hook (make_prompt_cache, apply, the CLI,
    the benches) must take it out again: a test module that leaves it in fails here."""
    from camkv import hook

    before = hook.installed_modules()
    yield
    after = hook.installed_modules()
    leaked = sorted(m for m, n in after.items() if n > before.get(m, 0))
    assert not leaked, f"camkv's attention hook was left installed in {leaked}"


@pytest.fixture
def remove_hooks():
    """remove_hooks(model): camkv.remove(model) when the test ends, pass or fail (the
    attention hook that camkv.make_prompt_cache installs for scoring="query")."""
    import camkv

    models = []
    yield models.append
    for model in models:
        camkv.remove(model)


@pytest.fixture
def on_the_cpu():
    """The test runs on the CPU device even where a GPU is the default
    (tiny_models.exactly_on_the_cpu says why)."""
    from tiny_models import exactly_on_the_cpu

    with exactly_on_the_cpu():
        yield


@pytest.fixture(params=_backend_params())
def backend(request) -> str:
    """Each backend name usable here; the others are reported as skipped with the reason."""
    return request.param


def random_block(rng: np.random.Generator, rows: int, s_len: int, k_dim: int, v_dim: int, dtype):
    """Distinct random keys and values [rows, s_len, D] (ties have probability ~0)."""
    keys = rng.standard_normal((rows, s_len, k_dim)).astype(np.float32)
    values = rng.standard_normal((rows, s_len, v_dim)).astype(np.float32)
    return mx.array(keys).astype(dtype), mx.array(values).astype(dtype)


def run_calls(update, cfg, sizes, *, rows=3, k_dim=8, v_dim=6, dtype=mx.float32, seed=0, queries_per_kv=0):
    """Feed calls of the given sizes through a backend's update; return (state, merges per call)."""
    rng = np.random.default_rng(seed)
    state = RowState.empty(rows, k_dim, v_dim, dtype)
    row_ids = mx.arange(rows).astype(mx.uint32)
    offset, merges = 0, []
    for s_len in sizes:
        keys, values = random_block(rng, rows, s_len, k_dim, v_dim, dtype)
        queries, scale = None, None
        if queries_per_kv:
            queries = mx.array(rng.standard_normal((rows, s_len, queries_per_kv, k_dim)).astype(np.float32))
            scale = 0.3
        state, merged = update(state, keys, values, offset, cfg, row_ids, queries, scale)
        merges.append(merged)
        offset += s_len
    mx.eval(state, merges)
    return state, merges


def assert_config_refused(fields: dict, words: list[str]) -> None:
    """CaMConfig(**fields) raises a ValueError whose message holds each of words (the
    field, the value given and what is allowed)."""
    from camkv import CaMConfig

    with pytest.raises(ValueError) as err:
        CaMConfig(**fields)
    for word in words:
        assert word in str(err.value)


def subprocess_env(*extra_paths: str, **variables: str) -> dict:
    """The environment for a child Python that must import the camkv this process imported
    (installed or from source), plus whatever was already on PYTHONPATH (e.g. mlx's)."""
    import os
    from pathlib import Path

    import camkv

    package_root = str(Path(camkv.__file__).resolve().parent.parent)
    path = os.pathsep.join(p for p in (package_root, *extra_paths, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **variables}


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny random llama with a real (small) BPE tokenizer and chat template, as an mlx-lm folder."""
    from gguf_fixtures import write_tiny_gguf

    from camkv import models

    tmp = tmp_path_factory.mktemp("tiny")
    write_tiny_gguf(tmp / "tiny.gguf")
    return str(models.convert_gguf(tmp / "tiny.gguf", tmp / "model"))
