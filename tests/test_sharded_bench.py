"""bench/gpu/sharded.sh's dry run: two CPU ranks over the ring backend, a tiny random llama.

The same rank script runs on two GPUs with --backend nccl (bench/gpu/README.md); here it
runs every check and every timed arm at a size that takes seconds, and the test reads
the JSON rank 0 wrote. A second run with a wrong head placement patched into camkv
(tests/sharded_defects/sitecustomize.py) shows the checks catch it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from conftest import subprocess_env
from test_distributed import _free_port_pair, needs_launcher

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu" / "sharded.sh"
DEFECTS = Path(__file__).resolve().parent / "sharded_defects"
TIMEOUT_S = 240  # the job is ended by sharded.sh's --timeout first
# Four KV heads (two a rank), head dim 8; the checks' sequence evicts and merges.
TINY = ["--shape", "64,2,8,4,128,256", "--check-prompt", "48", "--check-chunk", "16", "--check-steps", "12",
        "--check-budget", "24", "--check-gen", "8", "--budget", "32", "--prompt-lengths", "64", "96",
        "--gen-tokens", "6", "--prefill-step", "32"]
VERDICTS = {
    f"1_{s}_{name}" for s in ("key", "query")
    for name in ("positions_equal_unsharded", "keys_scores_identical", "gate_chose", "global_heads")
} | {"3_key_kv_bytes_per_rank", "3_query_kv_bytes_per_rank", "1_control_unplaced_differs",
     "2_holds_everything", "2_sharded_camkv_tokens_equal_sharded_full",
     "2_unsharded_camkv_tokens_equal_unsharded_full", "2_ranks_generate_the_same_tokens",
     "3_holds_everything_kv_bytes_per_rank"}


def run_script(*args: str, extra_path: str | None = None) -> subprocess.CompletedProcess:
    env = subprocess_env(*([extra_path] if extra_path else []), PYTHON=sys.executable, CAMKV_BLAS="0")
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, text=True, capture_output=True,
                          stdin=subprocess.DEVNULL, timeout=TIMEOUT_S)


def dry_run(out: Path, *extra: str, extra_path: str | None = None) -> subprocess.CompletedProcess:
    return run_script("--backend", "ring", "--port", str(_free_port_pair()), "--timeout", "200",
                      "--out", str(out), *TINY, *extra, extra_path=extra_path)


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded") / "dry.json"
    job = dry_run(out)
    output = job.stdout + job.stderr
    assert out.exists(), f"rank 0 wrote no result; the job's output:\n{output}"
    return job.returncode, json.loads(out.read_text()), output


@needs_launcher
def test_the_dry_run_passes_every_check(dry):
    status, result, output = dry
    assert set(result["checks"]["verdicts"]) == VERDICTS
    failed = [name for name, ok in result["checks"]["verdicts"].items() if not ok]
    assert not failed and result["passed"] and status == 0, output
    assert "every check passed" in output
    assert result["checks"]["camkv_gather_kv_bytes"]["ok"], result["checks"]["camkv_gather_kv_bytes"]


@needs_launcher
def test_each_rank_holds_its_heads_and_half_the_bytes(dry):
    _, result, _ = dry
    ranks = result["checks"]["ranks"]
    assert [(r["layer0_key_head_offset"], r["layer0_key_local_heads"]) for r in ranks] == [(0, 2), (2, 2)]
    for r in ranks:
        for scoring in ("key", "query"):
            f = f"layer0_{scoring}_"
            assert r[f + "positions_equal"] and r[f + "keys_identical"] and r[f + "scores_identical"]
            assert 0 < r[f + "merges"] < r[f + "evictions"]  # the gate chose, so placement mattered
            assert r[f + "kv_bytes"] > 0 and 2 * r[f + "kv_bytes"] == r[f + "reference_kv_bytes"]
        assert r["camkv_evictions"] == 0 and 2 * r["camkv_kv_bytes"] == r["reference_camkv_kv_bytes"] > 0
    assert not ranks[0]["unplaced_state_differs"] and ranks[1]["unplaced_state_differs"]
    gathered = result["checks"]["camkv_gather_kv_bytes"]
    assert gathered["got"] == gathered["expected"] and len(set(gathered["got"])) == 1


@needs_launcher
def test_camkv_generates_the_full_caches_tokens_when_it_holds_everything(dry):
    _, result, _ = dry
    tokens = result["checks"]["tokens"]
    assert len(tokens["sharded_camkv"]) == 8
    assert tokens["sharded_camkv"] == tokens["sharded_full"]
    assert tokens["unsharded_camkv"] == tokens["unsharded_full"]
    assert 0 <= tokens["sharded_unsharded_leading_equal"] <= 8


@needs_launcher
def test_the_arms_are_timed_side_by_side_on_the_sharded_model(dry):
    _, result, _ = dry
    rows = result["measure"]["rows"]
    assert [(r["arm"], r["prompt_len"]) for r in rows] == [
        (arm, n) for n in (64, 96) for arm in ("camkv", "full", "rotating")]
    for row in rows:
        assert row["prefill_s"] > 0 and row["gen_tokens_per_s"] > 0
        assert len(row["per_rank"]) == 2 and all(r["kv_bytes"] > 0 for r in row["per_rank"])
        # The job's time is its slowest rank's.
        assert row["prefill_s"] == max(r["prefill_s"][0] for r in row["per_rank"])
    by = {(r["arm"], r["prompt_len"]): r for r in rows}
    for arm in ("camkv", "rotating"):  # 96 tokens pass the budget of 32: bounded caches hold less
        assert by[(arm, 96)]["per_rank"][0]["kv_bytes"] < by[("full", 96)]["per_rank"][0]["kv_bytes"]
    assert by[("full", 96)]["gen_speed_vs_full"] == 1.0


@needs_launcher
def test_the_result_names_its_command_versions_and_devices(dry):
    _, result, _ = dry
    assert result["mlx"] == mx.__version__ and result["backend"] == "ring" and result["ranks"] == 2
    assert len(result["devices"]) == 2 and all(result["devices"])
    assert "sharded.py --backend ring --ranks 2" in result["command"]
    assert result["launcher"].startswith("bash bench/gpu/sharded.sh --backend ring --ranks 2")
    assert result["shape"] == {"hidden": 64, "layers": 2, "heads": 8, "kv_heads": 4, "intermediate": 128,
                               "vocab": 256}


@needs_launcher
def test_a_wrong_head_placement_fails_the_first_layer_check(tmp_path):
    """The defect check 1 guards against: every rank's gate drawing as heads 0.. ."""
    out = tmp_path / "defect.json"
    job = dry_run(out, "--prompt-lengths", extra_path=str(DEFECTS))
    result = json.loads(out.read_text())
    verdicts = result["checks"]["verdicts"]
    assert job.returncode == 1, job.stdout + job.stderr
    assert not verdicts["1_key_keys_scores_identical"] and not verdicts["1_query_keys_scores_identical"]
    assert not verdicts["1_key_global_heads"]
    assert verdicts["2_sharded_camkv_tokens_equal_sharded_full"]  # nothing evicted: the gate never drew
    assert "FAILED: " in job.stdout and result["measure"]["rows"] == []


@pytest.mark.parametrize("args, message", [
    (["--backend", "tcp"], "--backend must be nccl or ring, got 'tcp'"),
    (["--backend", "ring", "--ranks", "0"], "--ranks must be an integer >= 1, got '0'"),
    (["--backend", "ring", "--ranks", "3"], "--ranks 3: the ranks must divide the KV heads (8)"),
    (["--backend", "ring", "--port", "70000"], "--port must be a port number 1-65535"),
    (["--backend", "ring", "--shape", "64,2,8"], "--shape must be six positive integers"),
    (["--backend", "ring", "--shape", "64,2,6,4,128,256"], "must be a multiple of the KV heads"),
    (["--backend", "ring", "--prompt-lengths", "1"], "--prompt-lengths must be integers >= 2, got [1]"),
    (["--backend", "ring", "--check-budget", "2048"], "--check-budget 2048 must be below --check-prompt 1024"),
    (["--backend", "ring", "--budget", "4"], "--budget must exceed RotatingKVCache's 4 kept tokens"),
    (["--backend", "ring", "--check-budget", "2"], "--check-budget: "),
    (["--backend", "ring", "--trials", "0"], "--trials must be >= 1, got 0"),
    (["--backend", "ring", "--timeout", "soon"], "--timeout must be a number of seconds >= 1"),
    (["--backend"], "--backend needs a value"),
    (["--backend", "ring", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
])
def test_bad_values_end_with_status_2_before_any_rank_starts(args, message):
    job = run_script(*args)
    assert job.returncode == 2, job.stdout + job.stderr
    assert message in job.stderr
    assert "mlx.launch" not in job.stdout  # no job was started


@pytest.mark.skipif(mx.is_available(mx.gpu), reason="this host has a GPU")
def test_gpus_that_are_not_there_are_refused():
    job = run_script("--backend", "nccl", "--ranks", "2")
    assert job.returncode == 2
    assert "--backend nccl --ranks 2 needs 2 CUDA GPUs, this host has 0" in job.stderr
    job = run_script("--backend", "ring", "--device", "gpu")
    assert job.returncode == 2 and "--device gpu: this MLX has no GPU here" in job.stderr


def test_nccl_install_refuses_parts_that_do_not_make_the_pinned_wheel(tmp_path):
    parts = tmp_path / "parts"
    parts.mkdir()
    (parts / "part_00").write_bytes(b"not the wheel")
    job = subprocess.run(["bash", str(ROOT / "bench" / "gpu" / "nccl.sh"), "install"], text=True,
                         capture_output=True, env={**os.environ, "NCCL_PARTS": str(parts)})
    assert job.returncode == 1
    assert "does not have the sha256 1459723080ac889d" in job.stderr
    usage = subprocess.run(["bash", str(ROOT / "bench" / "gpu" / "nccl.sh")], text=True, capture_output=True)
    assert usage.returncode == 2 and "stage" in usage.stderr and "install" in usage.stderr
