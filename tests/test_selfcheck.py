"""The first-use self-check of the GPU kernels and the fallback to the reference
(camkv.backends.selfcheck), exercised on a machine without a GPU: backend "metal" is
made to look usable, and its kernel is replaced by ones that fail in the ways a Mac's
can (MLX raising, a pipeline refusing the group size, wrong values)."""

from __future__ import annotations

import itertools
from pathlib import Path
import subprocess
import sys
import warnings

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

import camkv
from camkv import CaMConfig, merges, reference
from camkv.backends import ext, jit, selfcheck
from conftest import subprocess_env
from tiny_models import tiny_llama

PROMPT = mx.array([(7 * i + 3) % 120 for i in range(150)])
SWITCHED_OFF = "the metal kernel is switched off for this process"


NO_METAL = "[metal_kernel] No Metal back-end."  # what MLX raises launching a Metal kernel without one


def _raising_kernel(target):
    def launch(**_):
        raise RuntimeError(NO_METAL)

    return launch


@pytest.fixture
def metal_here(monkeypatch):
    """Backend "metal" usable here, with a fresh guard (no class checked yet)."""
    monkeypatch.setattr(jit, "unavailable_reason", lambda target: None)
    monkeypatch.setitem(jit._guards, "metal", jit._guarded("metal"))
    monkeypatch.delenv("CAMKV_SELF_CHECK", raising=False)
    return jit._guards["metal"]


def _greedy(model, **cache_fields):
    cache = camkv.make_prompt_cache(model, budget=48, n_sink=2, recent=8, **cache_fields)
    steps = generate_step(PROMPT, model, max_tokens=20, prompt_cache=cache, prefill_step_size=64)
    tokens = [int(token) for token, _ in steps]
    camkv.remove(model)
    return tokens


@pytest.fixture(scope="module")
def model():
    return tiny_llama(heads=4, kv_heads=2, layers=2)


def _switch_off_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if SWITCHED_OFF in str(w.message)]


# Chunks of several tokens run no kernel on a GPU (camkv.backends.drop and merge_ops); exact
# mode and a merge rule's one-token compressions (slack 0) do.
@pytest.mark.parametrize("fields", [dict(prefill="exact"), dict(merge="mass_weighted", slack=0)])
def test_a_kernel_that_raises_falls_back_once_with_the_references_tokens(metal_here, model, fields, monkeypatch):
    monkeypatch.setattr(jit, "_kernel", _raising_kernel)
    want = _greedy(model, backend="reference", **fields)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _greedy(model, backend="metal", **fields)
    messages = _switch_off_warnings(caught)
    assert got == want
    assert len(messages) == 1, messages
    assert "No Metal back-end" in messages[0] and "reference backend" in messages[0]
    assert "report it" in messages[0] and "CAMKV_SELF_CHECK=0" in messages[0]
    assert metal_here.failure is not None


def _wrong_values_kernel(monkeypatch):
    """A kernel that keeps the reference's rows but returns their values off by 10%."""
    def update(state, new_keys, new_values, offset, cfg, row_ids, queries=None, scale=None, *, target):
        kept, count = reference.update(state, new_keys, new_values, offset, cfg, row_ids, queries, scale)
        return kept._replace(values=kept.values * 1.1), count

    monkeypatch.setattr(jit, "update", update)


def test_a_kernel_with_wrong_values_is_caught_by_the_check(metal_here, model, monkeypatch):
    want = _greedy(model, merge="mass_weighted", slack=0, backend="reference")
    _wrong_values_kernel(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _greedy(model, merge="mass_weighted", slack=0, backend="metal")
    messages = _switch_off_warnings(caught)
    assert got == want
    assert len(messages) == 1 and "the values differ" in messages[0], messages


def test_without_the_check_the_wrong_values_reach_the_cache(metal_here, monkeypatch):
    """CAMKV_SELF_CHECK=0 skips the probe: the same wrong kernel then goes unnoticed."""
    monkeypatch.setenv("CAMKV_SELF_CHECK", "0")
    _wrong_values_kernel(monkeypatch)
    launch = selfcheck.LaunchClass("metal", mx.float32, False, True, True, False, "chunk", "drop", "score",
                                   "window", (16, 16), 1)
    problem = selfcheck.probe_problem(launch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = jit.metal.update(*problem)
    assert selfcheck.compare(got, reference.update(*problem), mx.float32) is not None
    assert metal_here.failure is None and not metal_here.passed


def test_a_launch_that_raises_after_the_check_falls_back_too(metal_here, monkeypatch):
    calls = []

    def update(*args, target):
        calls.append(target)
        if len(calls) > 1:  # the probe's launch works, the caller's raises
            raise RuntimeError("[metal::Device] Unable to build metal library from source")
        return reference.update(*args)

    monkeypatch.setattr(jit, "update", update)
    launch = selfcheck.LaunchClass("metal", mx.float16, False, True, True, True, "chunk", "drop", "score",
                                   "window", (16, 16), 1)
    problem = selfcheck.probe_problem(launch)
    with pytest.warns(RuntimeWarning, match="a launch raised: .*Unable to build metal library"):
        got = jit.metal.update(*problem)
    assert selfcheck.compare(got, reference.update(*problem), mx.float16) is None
    assert len(calls) == 2
    jit.metal.update(*problem)  # off for the process: no third launch, no second warning
    assert len(calls) == 2


def test_a_pipeline_that_allows_fewer_threads_gets_a_smaller_group(metal_here, monkeypatch):
    """MLX refuses a launch whose group exceeds the pipeline's maximum, naming it: the
    probe retries with the largest multiple of 32 within it, and later launches use it."""
    groups = []

    def update(*args, target):
        threads = jit._guards[target].threads()
        groups.append(threads)
        if threads > 200:
            raise ValueError(f"[metal_kernel] Thread group size ({threads}) is greater than  the maximum "
                             f"allowed threads per threadgroup (200).")
        return reference.update(*args)

    monkeypatch.setattr(jit, "update", update)
    launch = selfcheck.LaunchClass("metal", mx.float32, True, False, False, True, "chunk", "drop", "score",
                                   "window", (16, 16), 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jit.metal.update(*selfcheck.probe_problem(launch))
    assert groups == [256, 192, 192] and metal_here.threads() == 192 and metal_here.failure is None


def test_the_callers_errors_are_raised_not_fallen_back_from(metal_here):
    launch = selfcheck.LaunchClass("metal", mx.float32, True, True, False, True, "chunk", "drop", "score",
                                   "window", (16, 16), 1)
    state, keys, values, offset, cfg, rows, queries, scale = selfcheck.probe_problem(launch)
    with pytest.raises(ValueError, match="new_keys must be float16, bfloat16 or float32"):
        jit.metal.update(state, keys.astype(mx.int32), values, offset, cfg, rows, queries, scale)
    assert metal_here.failure is None


# A correct kernel must pass its first-use check in every class, or users would be
# switched to the slow reference for nothing: the CPU extension runs the same core.
CLASSES = list(itertools.product((mx.float16, mx.bfloat16, mx.float32), (True, False), (True, False),
                                 (True, False), (True, False), ("chunk", "exact")))


def _kernel_backends():
    """The kernel core wherever it runs here: the extension on the CPU, the GPU kernels."""
    found = {}
    if ext.unavailable_reason() is None:
        found["ext"] = ext.update
    for target in ("metal", "cuda"):
        if jit.unavailable_reason(target) is None:
            found[target] = lambda *args, target=target: jit.update(*args, target=target)
    return found


@pytest.mark.parametrize("merge", merges.names())
@pytest.mark.parametrize("name", ["ext", "metal", "cuda"])
def test_the_kernel_core_passes_the_check_in_every_class(merge, name):
    kernel = _kernel_backends().get(name)
    if kernel is None:
        pytest.skip(f"{name} does not run here")
    for dtype, one_token, key_scoring, first, few_rows, prefill in CLASSES:
        launch = selfcheck.LaunchClass("cpu", dtype, one_token, key_scoring, first, few_rows, prefill, merge,
                                       "score", "window" if prefill == "chunk" else "causal", (16, 12),
                                       1 if key_scoring else 3)
        problem = selfcheck.probe_problem(launch)
        with mx.stream(mx.cpu):
            want = reference.update(*problem)
        assert selfcheck.compare(kernel(*problem), want, dtype) is None, selfcheck.describe(launch)


def test_the_comparison_sees_each_kind_of_difference():
    launch = selfcheck.LaunchClass("cpu", mx.float16, False, False, False, False, "chunk", "mass_weighted",
                                   "score", "window", (16, 16), 2)
    problem = selfcheck.probe_problem(launch)
    state, count = reference.update(*problem)
    assert selfcheck.compare((state, count), (state, count), mx.float16) is None
    positions = np.array(state.positions)
    positions[0, 0] += 1
    cases = {
        "kept positions": state._replace(positions=mx.array(positions)),
        "scores": state._replace(scores=state.scores * 1.01),
        "keys": state._replace(keys=state.keys * 1.1),
        "rows": state.first(state.length - 1),
    }
    for name, wrong in cases.items():
        assert name in selfcheck.compare((wrong, count), (state, count), mx.float16), name
    assert "merge counts" in selfcheck.compare((state, count + 1), (state, count), mx.float16)


@pytest.mark.parametrize("merge, field", [("keepkv", "votes"), ("d2o", "threshold")])
def test_a_later_probe_of_a_stateful_rule_carries_its_state_and_the_comparison_sees_it(merge, field):
    """keepkv's votes and d2o's threshold go into a later compression's probe (rows standing
    for several tokens, a threshold already set) and come out compared: a kernel that loses
    or miscounts them fails the probe."""
    launch = selfcheck.LaunchClass("cpu", mx.float32, True, False, False, False, "chunk", merge,
                                   "score", "window", (16, 16), 2)
    problem = selfcheck.probe_problem(launch)
    given = getattr(problem[0], field)
    assert given is not None and (field == "threshold" or float(mx.max(given)) > 1)
    state, count = reference.update(*problem)
    assert selfcheck.compare((state, count), (state, count), mx.float32) is None
    kept = getattr(state, field)
    for wrong in (None, kept + 1):
        assert field in selfcheck.compare((state._replace(**{field: wrong}), count), (state, count), mx.float32)


def test_camkv_generate_with_a_failing_metal_kernel_finishes_with_one_warning(tiny_model_dir):
    """The command as a user runs it, backend "metal" made usable on a machine whose Metal
    kernel cannot launch: the answer comes, one warning says why, no traceback."""
    script = ("import sys; from camkv.backends import jit; from test_selfcheck import _raising_kernel; "
              "jit.unavailable_reason = lambda target: None; jit._kernel = _raising_kernel; "
              "from camkv.cli import main; sys.exit(main(sys.argv[1:]))")
    argv = ["generate", "--model", tiny_model_dir, "--prompt", "hello world " * 20, "--max-tokens", "6",
            "--kv-budget", "24", "--kv-sinks", "2", "--kv-recent", "4", "--kv-backend", "metal",
            "--kv-merge", "mass_weighted", "--kv-slack", "0"]
    result = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True,
                            env=subprocess_env(str(Path(__file__).parent), CAMKV_BLAS="0"), timeout=600)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count(SWITCHED_OFF) == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert "generation: 6 tokens" in result.stderr


def test_gpu_check_says_the_kernel_ran_when_it_matches(metal_here, monkeypatch, capsys):
    from camkv import gpu_check

    monkeypatch.setattr(jit, "update", lambda *args, target: reference.update(*args))
    assert gpu_check.main(["--backend", "metal", "--require-kernel"]) == 0
    classes = len(list(gpu_check._report_classes()))
    assert f"metal: the kernel ran and matched the reference in {classes} launch classes" in capsys.readouterr().out


def test_gpu_check_says_it_fell_back_and_why(metal_here, monkeypatch, capsys):
    from camkv import gpu_check

    monkeypatch.setattr(jit, "_kernel", _raising_kernel)
    assert gpu_check.main(["--backend", "metal"]) == 0
    out = capsys.readouterr().out
    assert "metal: fell back to the reference backend after 0 launch classes passed" in out and NO_METAL in out
    assert gpu_check.main(["--backend", "metal", "--require-kernel"]) == 1
