"""camkv on sharded models: placement read from the model in-process, then two real ranks.

The two-rank tests launch tests/distributed_worker.py with
`mlx.launch --backend ring -n 2` on loopback (see the worker for what each rank runs
and why its comparisons are exact) and assert on what each rank wrote.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import camkv
from camkv import CaMKVCache
from camkv.distributed import (
    ShardInfo, gather_kv_bytes, local_kv_heads, report_kv_bytes, shard_info,
)
from camkv.integration import kv_bytes
from conftest import subprocess_env
from distributed_worker import MAX_TOKENS, save_tiny_repo, tiny_qwen2
from tiny_models import save_tiny_model_dir, tiny_llama

TESTS = Path(__file__).resolve().parent
LAUNCH_TIMEOUT_S = 120  # a job that outlives this is hung: its process group is killed


class FakeGroup:
    """What shard() and pipeline() read of a group (rank, size), without other processes."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


# ---------------------------------------------------------------------- in-process placement


def test_an_unsharded_model_is_placed_at_heads_and_layers_zero(remove_hooks):
    model = tiny_llama(heads=8, kv_heads=4)
    remove_hooks(model)
    assert shard_info(model) == ShardInfo(tensor_rank=0, tensor_size=1, layer_offset=0)
    caches = camkv.make_prompt_cache(model, budget=16, recent=2)
    assert [(c._head_offset, c._n_heads_global) for c in caches] == [(0, None), (0, None)]


@pytest.mark.parametrize("rank", [0, 1])
def test_tensor_sharded_caches_take_the_global_head_offset_and_count(rank, remove_hooks):
    model = tiny_llama(heads=8, kv_heads=4)
    remove_hooks(model)
    model.shard(FakeGroup(rank, 2))  # builds the sharded projections; no forward pass here
    assert shard_info(model) == ShardInfo(tensor_rank=rank, tensor_size=2, layer_offset=0)
    assert local_kv_heads(model, 0) == 2
    caches = camkv.make_prompt_cache(model, budget=16, recent=2, seed=3)
    assert [(c._head_offset, c._n_heads_global) for c in caches] == [(2 * rank, 4)] * 2
    assert [c.config.seed for c in caches] == [3, 4]


@pytest.mark.parametrize("rank, layers", [(0, [2, 3]), (1, [0, 1])])
def test_pipelined_caches_take_the_global_layer_seeds(rank, layers, remove_hooks):
    # mlx-lm's pipeline gives the last layers to rank 0.
    model = tiny_qwen2(layers=4)
    remove_hooks(model)
    model.model.pipeline(FakeGroup(rank, 2))
    assert shard_info(model).layer_offset == layers[0]
    caches = camkv.make_prompt_cache(model, budget=16, recent=2, seed=3)
    assert [c.config.seed for c in caches] == [3 + i for i in layers]
    assert [c._head_offset for c in caches] == [0, 0]


def test_local_kv_heads_names_what_it_could_not_find():
    model = tiny_llama()
    with pytest.raises(ValueError, match="not one of the model's 2 layers"):
        local_kv_heads(model, 2)
    del model.layers[0].self_attn.n_kv_heads
    with pytest.raises(ValueError, match="KV head count of layer 0"):
        local_kv_heads(model, 0)


def test_cache_rejects_heads_that_do_not_fit_the_global_count():
    with pytest.raises(ValueError, match="n_heads_global"):
        CaMKVCache(scoring="key", budget=16, recent=2, head_offset=4, n_heads_global=4)
    cache = CaMKVCache(scoring="key", budget=16, recent=2, head_offset=2, n_heads_global=4)
    keys = mx.zeros((1, 3, 5, 8))
    with pytest.raises(ValueError, match=r"heads 2\.\.4 do not fit in the model's 4 heads"):
        cache.update_and_fetch(keys, keys)
    assert cache.empty()


def test_keys_can_be_replaced_only_by_same_shaped_keys():
    """mlx-lm's pipelines attach their send with cache.keys = mx.depends(cache.keys, h)."""
    cache = CaMKVCache(scoring="key", budget=16, recent=2)
    assert cache.keys is None
    with pytest.raises(ValueError, match="while the cache is empty"):
        cache.keys = mx.zeros((1, 2, 3, 8))
    rng = np.random.default_rng(0)
    keys = mx.array(rng.standard_normal((1, 2, 5, 8)).astype(np.float32))
    cache.update_and_fetch(keys, keys)
    sent = mx.array(1.0)
    cache.keys = mx.depends(cache.keys, sent)
    assert mx.array_equal(cache.keys, keys).item()
    with pytest.raises(ValueError, match=r"\(1, 2, 5, 8\)"):
        cache.keys = mx.zeros((1, 2, 4, 8))


def test_kv_bytes_of_a_single_process_group(remove_hooks):
    model = tiny_llama()
    remove_hooks(model)
    caches = camkv.make_prompt_cache(model, budget=16, recent=2)
    model(mx.array([[1, 2, 3, 4, 5]]), cache=caches)
    held = sum(c.nbytes for c in caches)
    assert held > 0 and kv_bytes(caches) == held
    assert gather_kv_bytes(caches) == [held]
    printed = io.StringIO()
    assert report_kv_bytes(caches, file=printed) == [held]
    assert printed.getvalue() == f"rank 0: KV cache {held} bytes\nall 1 ranks: KV cache {held} bytes\n"


# ---------------------------------------------------------------------- two ranks


def _launcher() -> str | None:
    beside_python = Path(sys.executable).parent / "mlx.launch"
    return str(beside_python) if beside_python.exists() else shutil.which("mlx.launch")


needs_launcher = pytest.mark.skipif(
    _launcher() is None, reason="mlx.launch (MLX's distributed launcher) is not installed"
)


def _free_port_pair() -> int:
    """A port p with p and p + 1 free: the ring backend listens on one port per rank."""
    for _ in range(50):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return port
    raise RuntimeError("no two consecutive free ports on 127.0.0.1")


def _ring_on_loopback(port: int) -> list[str]:
    """mlx.launch arguments: two ranks on this machine."""
    return ["--backend", "ring", "-n", "2", "-p", str(port)]


def _hostfile_on_loopback(directory: Path, port: int) -> list[str]:
    """mlx.launch arguments: a two-host hostfile whose hosts are both this machine.

    The form docs/distributed.md gives for several Macs; a host named 127.0.0.1 is
    started without ssh.
    """
    host = {"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}
    hostfile = directory / "hosts.json"
    hostfile.write_text(json.dumps({"backend": "ring", "hosts": [host, host]}))
    return ["--hostfile", str(hostfile), "-p", str(port)]


def _launch(launcher_args: list[str], out_dir: Path, *worker_args: str) -> str:
    """Run the worker under mlx.launch; return the job's output. Kills and fails when hung."""
    command = [_launcher(), *launcher_args, "--", sys.executable,
               str(TESTS / "distributed_worker.py"), str(out_dir), *worker_args]
    # The ranks import camkv from where this process did (source tree or installed).
    job = subprocess.Popen(command, env=subprocess_env(str(TESTS)), text=True,
                           stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output, _ = job.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)  # the launcher and the ranks it started
        output, _ = job.communicate()
        pytest.fail(f"the two-rank job hung for {LAUNCH_TIMEOUT_S} s; its output:\n{output}")
    return output


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """(each rank's results, the job's output) of one two-rank run of the worker."""
    out_dir = tmp_path_factory.mktemp("ranks")
    repo = save_tiny_repo(tmp_path_factory.mktemp("tiny_qwen2"))
    output = _launch(_hostfile_on_loopback(out_dir, _free_port_pair()), out_dir,
                     "--repo", str(repo))
    # mlx.launch exits 0 even when a rank fails, so a rank's result file is the proof.
    missing = [r for r in (0, 1) if not (out_dir / f"rank{r}.json").exists()]
    assert not missing, f"ranks {missing} wrote no result; the job's output:\n{output}"
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in (0, 1)], output


@needs_launcher
def test_generation_completes_on_both_ranks(two_ranks):
    results, output = two_ranks
    assert [r["rank"] for r in results] == [0, 1] and {r["size"] for r in results} == {2}
    for scenario in ("tensor", "pipeline"):
        tokens = [r[scenario]["generated"] for r in results]
        assert len(tokens[0]) == MAX_TOKENS
        assert tokens[0] == tokens[1]  # every rank ends a step with the same logits
    assert "rank 0: done" in output and "rank 1: done" in output


@needs_launcher
def test_tensor_parallel_ranks_hold_half_the_heads_and_half_the_bytes(two_ranks):
    results, _ = two_ranks
    for rank, result in enumerate(results):
        tensor = result["tensor"]
        assert tensor["reference_kv_heads"] == [4, 4]
        assert tensor["local_kv_heads"] == [2, 2]
        assert tensor["head_offsets"] == [2 * rank, 2 * rank]
        assert tensor["n_heads_global"] == [4, 4]
        assert tensor["kv_bytes"] > 0 and 2 * tensor["kv_bytes"] == tensor["reference_kv_bytes"]
    gathered = [r["tensor"]["kv_bytes"] for r in results]
    assert [r["tensor"]["gathered_kv_bytes"] for r in results] == [gathered, gathered]


@needs_launcher
@pytest.mark.parametrize("scoring", ["key", "query"])
def test_tensor_parallel_first_layer_keeps_the_unsharded_positions(two_ranks, scoring):
    results, _ = two_ranks
    for rank, result in enumerate(results):
        layer0 = result["tensor"]["layer0"][scoring]
        assert 0 < layer0["merges"] < layer0["evictions"]  # the gate chose
        assert layer0["positions"] == layer0["reference_positions"], f"rank {rank}"
        assert layer0["keys_identical"] and layer0["scores_identical"], f"rank {rank}"
    # The comparison can fail: rank 1's heads drawn as heads 0..1 store other keys.
    assert not results[1]["tensor"]["layer0"][scoring]["unplaced_identical"]


@needs_launcher
def test_pipeline_ranks_hold_their_layers_with_the_unsharded_state(two_ranks):
    results, output = two_ranks
    # mlx-lm's pipeline gives the last layers to rank 0.
    assert [r["pipeline"]["layers"] for r in results] == [[2, 3], [0, 1]]
    for rank, result in enumerate(results):
        pipe = result["pipeline"]
        assert pipe["seeds"] == pipe["reference_seeds"]
        assert pipe["positions"] == pipe["reference_positions"], f"rank {rank}"
        assert all(pipe["keys_identical"]), f"rank {rank}"
        assert pipe["kv_bytes"] == sum(pipe["reference_layer_kv_bytes"]) > 0
    per_rank = [r["pipeline"]["kv_bytes"] for r in results]
    assert sum(per_rank) == results[0]["pipeline"]["reference_kv_bytes"]
    assert all(r["pipeline"]["report"] == per_rank for r in results)
    # report_kv_bytes: rank 0 alone prints, one line per rank and the total.
    for rank, nbytes in enumerate(per_rank):
        assert output.count(f"rank {rank}: KV cache {nbytes} bytes\n") == 1
    assert output.count(f"all 2 ranks: KV cache {sum(per_rank)} bytes\n") == 1


@needs_launcher
def test_sharded_load_and_stream_generate_run_with_camkv(two_ranks):
    """docs/distributed.md's script, the path a CLI takes, on a saved tiny qwen2
    (2 KV heads, 4 layers)."""
    results, _ = two_ranks
    recipes = [r["sharded_load"] for r in results]
    for kind in ("tensor", "pipeline"):
        assert len(recipes[0][kind]["tokens"]) == MAX_TOKENS, kind
        assert recipes[0][kind]["tokens"] == recipes[1][kind]["tokens"], kind
        assert recipes[0][kind]["text"] == recipes[1][kind]["text"], kind
        assert recipes[0][kind]["kv_bytes"] == recipes[1][kind]["kv_bytes"], kind
    assert [r["tensor"]["kv_heads"] for r in recipes] == [[1] * 4, [1] * 4]
    assert [r["tensor"]["head_offsets"] for r in recipes] == [[0] * 4, [1] * 4]
    assert [r["pipeline"]["kv_heads"] for r in recipes] == [[2] * 2, [2] * 2]
    assert [r["pipeline"]["seeds"] for r in recipes] == [[7, 8], [5, 6]]  # base seed 5
    tensor_bytes, pipeline_bytes = (recipes[0][k]["kv_bytes"] for k in ("tensor", "pipeline"))
    assert sum(tensor_bytes) == sum(pipeline_bytes) > 0  # the same KV, split two ways


@needs_launcher
def test_a_failing_rank_ends_the_job_with_its_error(tmp_path):
    # _launch fails the test if the job hangs.
    output = _launch(_ring_on_loopback(_free_port_pair()), tmp_path, "--fail-on-rank", "1")
    assert "RuntimeError: rank 1: deliberate failure" in output
    # The launcher names the first rank it sees die: rank 1 (its error) or rank 0 (its
    # collective broke when rank 1 went away); either way it reports a failed node.
    assert re.search(r"Node with rank [01] exited with code 1\b", output), output
    # Rank 0 waited in a collective for rank 1; the launcher stopped it.
    assert not list(tmp_path.glob("rank*.json"))


@needs_launcher
@pytest.mark.parametrize("sharding", ["tensor", "pipeline"])
def test_camkv_generate_runs_under_mlx_launch(tmp_path, sharding):
    """docs/distributed.md's command: every rank generates, rank 0 prints the text and every rank's KV bytes."""
    if sharding == "pipeline":
        model_dir = save_tiny_repo(tmp_path / "qwen2")  # llama has no pipeline() in mlx-lm
        extra = ["--pipeline"]
    else:
        model_dir = save_tiny_model_dir(tmp_path / "llama")
        extra = []
    command = [_launcher(), *_ring_on_loopback(_free_port_pair()), "--", sys.executable, "-m", "camkv",
               "generate", "--model", str(model_dir), "--prompt", "the quick brown fox " * 10, "--max-tokens", "6",
               "--chat-template", "off", "--kv-budget", "48", "--kv-recent", "8", *extra]
    job = subprocess.run(command, env=subprocess_env(CAMKV_BLAS="0"),
                         text=True, capture_output=True, timeout=LAUNCH_TIMEOUT_S, stdin=subprocess.DEVNULL)
    output = job.stdout + job.stderr
    held = re.findall(r"rank (\d): KV cache (\d+) bytes", output)
    assert [rank for rank, _ in held] == ["0", "1"], output
    assert all(int(nbytes) > 0 for _, nbytes in held), output
    assert "all 2 ranks: KV cache" in output and output.count("evictions:") == 1, output
