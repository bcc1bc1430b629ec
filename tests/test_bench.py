"""`camkv bench` end to end on a tiny random llama: figures, files, and the KV bytes it reports."""

from __future__ import annotations

import json
import re

import mlx.core as mx
import numpy as np
import pytest

from camkv.eval import bench


def test_bench_writes_json_and_plots_with_budget_rows_held(tmp_path, capsys):
    results = bench.main([
        "--model", "random-tiny", "--prompt-lengths", "40", "120", "--budgets", "64",
        "--gen-tokens", "4", "--trials", "1", "--prefill-step", "32", "--soak", "30",
        "--backend", "reference", "--out", str(tmp_path), "--tag", "t",
    ])
    saved = json.loads((tmp_path / "t.json").read_text())
    assert saved["rows"] == results["rows"]
    assert (tmp_path / "t.png").stat().st_size > 0 and (tmp_path / "t-soak.png").stat().st_size > 0
    arms = {(r["arm"], r["prompt_len"]): r for r in saved["rows"]}
    assert set(arms) == {(a, n) for a in ("full", "streamingllm-64", "camkv-64") for n in (40, 120)}
    # random-tiny: 2 layers, 2 KV heads of dim 16, float32 on the CPU (bfloat16 on a GPU);
    # camkv also holds float32 scores and int32 positions.
    itemsize = 4 if mx.default_device() == mx.cpu else 2
    per_token = (16 + 16) * itemsize + 4 + 4
    held, rest = divmod(arms[("camkv-64", 120)]["kv_bytes"], 2 * 2 * per_token)
    assert rest == 0 and 64 <= held <= 64 + 64 // 8  # budget .. budget + slack rows
    assert arms[("camkv-64", 40)]["kv_bytes"] < arms[("camkv-64", 120)]["kv_bytes"]
    for row in saved["rows"]:
        assert row["gen_tokens_per_s"] > 0 and row["prompt_tokens_per_s"] > 0
    assert {q["prompt_len"] for q in saved["ratios"]} == {40, 120}
    for q in saved["ratios"]:
        row, full = arms[(q["arm"], q["prompt_len"])], arms[("full", q["prompt_len"])]
        assert q["prefill_time_vs_full_best"] == row["prompt_s"]["min"] / full["prompt_s"]["min"]
    samples = saved["soak"]["samples"]
    assert samples[-1]["tokens"] == 30 and samples[-1]["kv_bytes"] <= 2 * 2 * (64 + 64 // 8) * per_token
    assert "camkv-64 @ 120" in capsys.readouterr().out


def test_bench_rejects_a_budget_the_config_cannot_hold(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:  # status 2, as for any bad flag
        bench.main(["--model", "random-tiny", "--budgets", "5", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert re.search("--budgets 5.*n_sink \\+ recent", capsys.readouterr().err)


def _load_bench_script(name: str):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sweep(folder, recent, kl, passkeys):
    """A quality folder with one stream cell and some passkey outcomes (sample -> correct)."""
    folder.mkdir()
    summary = {"config": {"recent": recent},
               "stream": {"decode": {"h2o-query": {"20%": {"kl": kl, "top1": 0.8, "windows": 3}}}}}
    (folder / "summary.json").write_text(json.dumps(summary))
    records = [{"task": "passkey", "method": "h2o-query", "labels": ["20%"], "sample": s, "correct": c}
               for s, c in passkeys.items()]
    (folder / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_recent_window_reads_the_window_per_budget_and_pairs_passkeys_on_shared_prompts(tmp_path, monkeypatch):
    script = _load_bench_script("recent_window")
    monkeypatch.setattr(script, "RESULTS", tmp_path)
    _sweep(tmp_path / "a", 32, 0.17, {"p1": True, "p2": False, "p3": True})
    _sweep(tmp_path / "b", "25%", 0.08, {"p1": False, "p2": True})  # cut short: no p3
    points = {p["sweep"]: p for p in script.stream_points(["a", "b"])}
    assert points["a"]["recent"] == 32 and points["b"]["recent"] == 204  # 25% of 819
    assert points["b"]["recent_share"] == pytest.approx(204 / 819)
    passkey = {r["sweep"]: r for r in script.paired_passkey(["a", "b"]) if r["budget"] == "20%"
               and r["method"] == "h2o-query"}
    assert passkey["a"] == {"method": "h2o-query", "budget": "20%", "sweep": "a", "n": 2, "correct": 1}
    assert passkey["b"]["n"] == 2 and passkey["b"]["correct"] == 1


def test_decode_parts_interleaved_pairs_every_arm_with_rotating_steps(tmp_path, capsys):
    """decode_parts --interleave takes every arm's steps in turn and reports each arm's
    paired speed against RotatingKVCache's (1 for RotatingKVCache itself); the hook it
    installed for camkv's arm is gone afterwards."""
    from camkv import hook

    script = _load_bench_script("decode_parts")
    result = script.main(["--model", "random-tiny", "--prompt-length", "80", "--budget", "40", "--steps", "4",
                          "--trials", "1", "--arms", "rotating", "buffer", "camkv", "--interleave",
                          "--out", str(tmp_path)])
    arms = result["arms"]
    assert set(arms) == {"rotating", "buffer", "camkv"} and arms["rotating"]["speed_vs_rotating"] == 1.0
    assert all(r["speed_vs_rotating"] > 0 and 0 < r["build_median_ms"] <= r["median_ms"] for r in arms.values())
    assert json.loads((tmp_path / "decode-parts.json").read_text())["setup"]["interleave"] is True
    assert "speed vs rotating (paired)" in capsys.readouterr().out
    assert not hook.installed_modules()


def test_decode_parts_fullway_arm_decodes_every_step_through_the_checks(tmp_path, monkeypatch):
    """decode_parts' camkv-fullway arm is camkv with update_and_fetch's short way off:
    its decode steps all go through update_stored, the camkv arm's nearly none."""
    from camkv import CaMKVCache

    full_way, calls = CaMKVCache.update_stored, {}

    def counted(self, keys, values):
        short = self._short_way_rows(None)  # plain rows need no queries to say so
        calls[short] = calls.get(short, 0) + (keys.shape[2] == 1)
        return full_way(self, keys, values)

    monkeypatch.setattr(CaMKVCache, "update_stored", counted)
    script = _load_bench_script("decode_parts")
    script.main(["--model", "random-tiny", "--prompt-length", "80", "--budget", "40", "--steps", "12",
                 "--trials", "1", "--arms", "camkv", "camkv-fullway", "--out", str(tmp_path)])
    # Every run's 12 steps a layer the full way, against at most each layer's first two.
    assert calls[False] >= 2 * 12 and calls[True] * 6 <= calls[False]


def test_decode_parts_pipelined_times_blocks_of_generate_step_tokens(tmp_path, capsys):
    """decode_parts --pipelined N decodes through mlx-lm's generate_step, the arms taking
    turns N tokens at a time: one time a block per arm and round, paired with
    RotatingKVCache's block, no graph-building time; the hook is gone afterwards."""
    from camkv import hook

    script = _load_bench_script("decode_parts")
    result = script.main(["--model", "random-tiny", "--prompt-length", "80", "--budget", "40", "--steps", "9",
                          "--trials", "1", "--arms", "rotating", "camkv", "--pipelined", "3",
                          "--out", str(tmp_path)])
    arms = result["arms"]
    assert arms["rotating"]["speed_vs_rotating"] == 1.0 and arms["camkv"]["speed_vs_rotating"] > 0
    assert all(r["build_median_ms"] is None and r["median_ms"] > 0 for r in arms.values())
    assert "graph built" not in capsys.readouterr().out
    assert not hook.installed_modules()


def test_merge_speed_times_every_arm_in_turn_against_dropping(tmp_path, capsys):
    """merge_speed: RotatingKVCache, drop and the rules asked for, the warm round dropped,
    each arm's prefill and decode step paired with dropping's of the same round (drop's own
    ratio 1), the table printed and the JSON written; no hook left on the model."""
    from camkv import hook

    script = _load_bench_script("merge_speed")
    out = tmp_path / "speed.json"
    result = script.main(["--model", "random-tiny", "--prompt-length", "120", "--budget", "40", "--chunk", "48",
                          "--steps", "3", "--rounds", "2", "--rules", "mass_weighted", "keepkv", "--out", str(out)])
    arms = result["arms"]
    assert list(arms) == ["full", "rotating", "drop", "mass_weighted", "keepkv"]
    model = script.load_model("random-tiny")
    assert {type(c).__name__ for c in script.make_cache(model, "full", 40)} == {"KVCache"}
    assert arms["drop"]["prefill_vs_drop"] == arms["drop"]["decode_vs_drop"] == 1.0
    for arm in arms.values():
        assert len(arm["rounds"]["prefill_s"]) == len(arm["rounds"]["decode_step_s"]) == 2
        assert arm["prefill_ms"] > 0 and arm["decode_step_ms"] > 0 and arm["peak_mb"] > 0
        for mean, median, slowest in zip(*(arm["rounds"][k] for k in ("decode_step_s", "step_median_s",
                                                                      "step_slowest_s"))):
            assert 0 < median <= slowest and mean <= slowest and slowest <= 3 * mean  # three steps a round
    printed = capsys.readouterr().out
    assert "round 0 (warm)" in printed and "goals against drop" in printed
    assert json.loads(out.read_text())["setup"]["rounds"] == 2
    assert not hook.installed_modules()


def test_merge_speed_takes_each_decode_steps_seconds_from_token_to_token():
    """run_arm's step_seconds: one entry a decode step (the prompt's time to the first token
    not among them), which add up to the steps' mean times their count."""
    import argparse

    from camkv import hook

    script = _load_bench_script("merge_speed")
    model = script.load_model("random-tiny")
    steps = []
    opts = argparse.Namespace(budget=40, chunk=48, steps=4)
    prefill, mean, _ = script.run_arm(model, "drop", script.random_prompt(model, 120), opts, step_seconds=steps)
    assert len(steps) == 4 and min(steps) > 0
    assert sum(steps) == pytest.approx(4 * mean, rel=0.05)
    assert not hook.installed_modules()


def test_merge_speed_profile_lists_each_named_arms_calls_by_own_time(capsys):
    """--profile drop mean: after the rounds, one prompt of each under cProfile, the calls
    of most own time first (camkv's compressions among them for a merging arm); an arm
    the run does not have is refused with status 2, naming it and the run's arms."""
    script = _load_bench_script("merge_speed")
    base = ["--model", "random-tiny", "--prompt-length", "120", "--budget", "40", "--chunk", "48",
            "--steps", "2", "--rounds", "1", "--rules", "mean"]
    result = script.main([*base, "--profile", "drop", "mean"])
    assert list(result["profiles"]) == ["drop", "mean"]
    for profile in result["profiles"].values():
        own = [call["own_ms"] for call in profile["calls"]]
        assert len(own) == script.PROFILED_CALLS and own == sorted(own, reverse=True)
        assert profile["prefill_ms"] > 0 and all(c["cumulative_ms"] >= c["own_ms"] for c in profile["calls"])
    assert "mean: one prompt under cProfile" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stop:
        script.main([*base, "--profile", "keepkv"])
    assert stop.value.code == 2
    assert "--profile keepkv: not an arm of this run; arms: full, rotating, drop, mean" in capsys.readouterr().err


def test_merge_speed_core_arm_runs_decode_compressions_below_the_engine_threshold(monkeypatch):
    """--core-arms mean adds mean/core, during which the GPU engine's threshold is the
    slack + 2 (a decode compression's slack + 1 tokens go to the kernel core), restored
    after; the other arms keep the default 2."""
    from camkv import CaMConfig
    from camkv.backends import compress

    script = _load_bench_script("merge_speed")
    seen = set()
    real = compress.by_operations
    monkeypatch.setattr(compress, "by_operations",
                        lambda *a: seen.add(compress.OPERATIONS_FROM_TOKENS) or real(*a))
    result = script.main(["--model", "random-tiny", "--prompt-length", "120", "--budget", "40", "--chunk", "48",
                          "--steps", "12", "--rounds", "1", "--rules", "mean", "--core-arms", "mean"])
    assert list(result["arms"]) == ["full", "rotating", "drop", "mean", "mean/core"]
    assert seen == {2, CaMConfig(budget=40).slack + 2}
    assert compress.OPERATIONS_FROM_TOKENS == 2


def test_merge_speed_engine_arm_runs_decode_compressions_on_the_engine(monkeypatch):
    """--engine-arms mean adds mean/engine, during which a GPU's decode compression of
    mean (slack + 1 tokens) goes to the merge engine, as before it moved to the kernel
    core; the routing is restored after."""
    from camkv import CaMConfig
    from camkv.backends import compress

    script = _load_bench_script("merge_speed")
    real, routed = compress.by_operations, []
    gpu = type("GPU", (), {"target": "cuda"})()
    decode = CaMConfig(budget=40, merge="mean")
    monkeypatch.setattr(script, "generate_step",
                        lambda *a, real_step=script.generate_step, **k:
                        routed.append(compress.by_operations(gpu, decode, 40 + decode.slack + 1, 40))
                        or real_step(*a, **k))
    result = script.main(["--model", "random-tiny", "--prompt-length", "120", "--budget", "40", "--chunk", "48",
                          "--steps", "12", "--rounds", "1", "--rules", "mean", "--engine-arms", "mean"])
    assert list(result["arms"]) == ["full", "rotating", "drop", "mean", "mean/engine"]
    assert True in routed and False in routed  # mean/engine's caches on the engine, mean's in the core
    assert compress.by_operations is real


def test_merge_speed_runs_the_kernels_first_use_check_once_and_before_any_timed_prompt(monkeypatch):
    """Where the merge kernels are available, their first-use check runs once in the
    process, before the first arm's prompt, not inside every merging arm's timed prompt
    (here the check fails, so the merges run as MLX operations on this CPU)."""
    from camkv.backends import merge_cuda, merge_ops

    script = _load_bench_script("merge_speed")
    checks, prompts = [], []
    monkeypatch.setattr(merge_cuda, "available", lambda: True)
    monkeypatch.setattr(merge_ops, "_probe", {})
    monkeypatch.setattr(merge_ops, "_probe_failure", lambda: checks.append(len(prompts)) or "a stand-in failure")
    monkeypatch.setattr(script, "generate_step", lambda *a, real_step=script.generate_step, **k:
                        prompts.append(1) or real_step(*a, **k))
    with pytest.warns(RuntimeWarning, match="switched off"):
        script.main(["--model", "random-tiny", "--prompt-length", "120", "--budget", "40", "--chunk", "48",
                     "--steps", "2", "--rounds", "2", "--rules", "mean", "keepkv"])
    assert checks == [0]


@pytest.mark.parametrize("flag, rule, other, module, setting, during", [
    ("--unfenced-arms", "mean", "drop", "camkv.backends.merge_ops", "FENCE_NEAREST_PRODUCT", False),
    ("--masked-arms", "keepkv", "mean", "camkv.hook", "WEIGHED_BLOCKS", False),
    ("--heads-arms", "keepkv", "mean", "camkv.backends.quantized_cuda", "QUERY_HEAD_ROWS", 1 << 30),
    ("--stretches-arms", "keepkv", "mean", "camkv.backends.quantized_cuda", "QUERY_HEAD_ROWS", 0),
])
def test_merge_speed_switch_arms_turn_their_setting_off_for_their_run(monkeypatch, flag, rule, other, module,
                                                                      setting, during):
    """--unfenced-arms mean adds mean/unfenced (merge_ops.FENCE_NEAREST_PRODUCT off for its
    run), --masked-arms keepkv adds keepkv/masked (hook.WEIGHED_BLOCKS off), --heads-arms
    keepkv adds keepkv/heads (quantized_cuda.QUERY_HEAD_ROWS past any row count),
    --stretches-arms keepkv adds keepkv/stretches (QUERY_HEAD_ROWS 0): the setting is
    switched during the arm's warm and timed round and back after, the other arms run with
    it as it was, and a rule it does not apply to gets no arm (drop: no nearest search;
    mean: no votes)."""
    import importlib

    switched = importlib.import_module(module)
    otherwise = getattr(switched, setting)
    assert otherwise != during
    script = _load_bench_script("merge_speed")
    seen = []
    monkeypatch.setattr(script, "generate_step", lambda *a, real_step=script.generate_step, **k:
                        seen.append(getattr(switched, setting)) or real_step(*a, **k))
    result = script.main(["--model", "random-tiny", "--prompt-length", "120", "--budget", "40", "--chunk", "48",
                          "--steps", "4", "--rounds", "1", "--rules", rule, flag, rule, other])
    assert list(result["arms"]) == ["full", "rotating", "drop", rule, rule + "/" + flag[2:].split("-")[0]]
    assert seen.count(during) == 2 and seen.count(otherwise) == 8 and getattr(switched, setting) == otherwise


def test_merge_speed_direct_arm_turns_the_dot_product_kernel_on_for_its_run_or_is_left_out(monkeypatch):
    """Where the merge kernels run (pretended, their text emulated), --direct-arms mean
    adds mean/direct, during which merge_ops.NEAREST_WITHOUT_PRODUCT is on, off again
    after; a dot-product kernel that fails its check leaves the arm out, with the reason
    in the JSON. Elsewhere there is no such arm."""
    import cuda_emulation
    from camkv.backends import merge_cuda, merge_ops

    if not cuda_emulation.here():
        pytest.skip("no NVIDIA GPU, and no C++ compiler to emulate one")
    script = _load_bench_script("merge_speed")
    argv = ["--model", "random-tiny", "--prompt-length", "120", "--budget", "40", "--chunk", "48", "--steps", "4",
            "--rounds", "1", "--rules", "mean", "--direct-arms", "mean"]
    assert "mean/direct" not in script.arms_of(script.parse_args(argv))  # no kernels here
    monkeypatch.setattr(merge_cuda, "available", lambda: True)
    seen = []
    monkeypatch.setattr(script, "generate_step", lambda *a, real_step=script.generate_step, **k:
                        seen.append(merge_ops.NEAREST_WITHOUT_PRODUCT) or real_step(*a, **k))
    with cuda_emulation.kernels_here(merge_cuda):
        result = script.main(argv)
        assert list(result["arms"]) == ["full", "rotating", "drop", "mean", "mean/direct"] and result["left_out"] == {}
        assert seen.count(True) == 2 and merge_ops.NEAREST_WITHOUT_PRODUCT is False  # warm and timed rounds
        monkeypatch.setattr(merge_cuda, "nearest_direct", lambda *a: (a[0][..., 0].astype(mx.int32),) * 3)
        result = script.main(argv)
    assert list(result["arms"]) == ["full", "rotating", "drop", "mean"]
    assert "differ" in result["left_out"]["mean/direct"] or "Error" in result["left_out"]["mean/direct"]


def test_step_calls_times_each_call_and_leaves_out_what_needs_cuda(tmp_path, capsys):
    """bench/step_calls.py: every arm that runs here has a build time and a pipelined
    time; without an NVIDIA GPU the CUDA-only arms are left out with the reason; bad
    arguments stop with status 2, naming the value."""
    from camkv.backends import drop

    script = _load_bench_script("step_calls")
    out = tmp_path / "calls.json"
    result = script.main(["--rows", "64", "--layers", "3", "--steps", "4", "--out", str(out)])
    assert json.loads(out.read_text())["arms"] == result["arms"]
    missing = [] if drop.on_cuda() else list(script.CUDA_ONLY)
    assert list(result["arms"]) == [arm for arm in script.ARMS if arm not in missing]
    assert all(t["build_us"] > 0 and t["pipelined_us"] > 0 for t in result["arms"].values())
    assert sorted(result["left_out"]) == sorted(missing)
    assert all("CUDA" in why for why in result["left_out"].values())
    with pytest.raises(SystemExit) as stop:
        script.main(["--group-size", "128", "--head-dim", "64"])
    assert stop.value.code == 2 and "--group-size 128" in capsys.readouterr().err


def test_step_calls_cuda_arms_run_their_kernels(monkeypatch):
    """The CUDA-only arms of bench/step_calls.py as on an NVIDIA GPU (there, or their
    kernels' text emulated): each arm's chain of calls runs and is timed."""
    import cuda_emulation
    from camkv.backends import append_cuda, drop, quantized_cuda, step_cuda

    if not cuda_emulation.here():
        pytest.skip("no NVIDIA GPU, and no C++ compiler to emulate one")
    script = _load_bench_script("step_calls")
    monkeypatch.setattr(drop, "on_cuda", lambda: True)
    with cuda_emulation.kernels_here(append_cuda, quantized_cuda, step_cuda, script):
        result = script.main(["--rows", "40", "--layers", "2", "--steps", "2", "--arms", *script.CUDA_ONLY])
    assert list(result["arms"]) == list(script.CUDA_ONLY) and result["left_out"] == {}


def test_merge_speed_refuses_a_budget_the_config_cannot_hold(capsys):
    script = _load_bench_script("merge_speed")
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--model", "random-tiny", "--budget", "4"])
    assert exit_info.value.code == 2 and "--budget 4" in capsys.readouterr().err


def test_profile_merge_engine_pairs_every_rule_with_the_drop_engine(capsys):
    script = _load_bench_script("profile_merge_engine")
    result = script.main(["--rows", "2", "--head-dim", "8", "--budget", "16", "--chunk", "40", "--repeats", "2"])
    from camkv import merges

    assert set(result["ms"]) == {"drop"} | {r for r in merges.names() if merges.rule(r).kind != merges.DROP}
    assert result["ms"]["drop"]["vs_drop"] == 1.0
    assert all(r["median_ms"] > 0 and r["vs_drop"] > 0 for r in result["ms"].values())
    assert "x drop's (paired)" in capsys.readouterr().out


def test_profile_merge_engine_times_building_a_compression_on_cuda(tmp_path):
    """--host-build (with the stand-in kernels, in a process of its own) times building
    each rule's compression through the cache, nothing evaluated, paired with drop's; it
    refuses to run without --kernel-graph (the real kernels would run on the CPU's
    device, or not at all)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "bench" / "profile_merge_engine.py"
    flags = ["--rows", "2", "--head-dim", "8", "--budget", "16", "--chunk", "40", "--through-cache", "--host-build",
             "--repeats", "3"]
    out = tmp_path / "build.json"
    done = subprocess.run([sys.executable, str(script), *flags, "--kernel-graph", "--out", str(out)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    built = json.loads(out.read_text())["host_build_us"]
    from camkv import merges

    assert set(built) == {"drop"} | {r for r in merges.names() if merges.rule(r).kind != merges.DROP}
    assert built["drop"]["vs_drop"] == 1.0 and all(r["median_us"] > 0 for r in built.values())
    assert "us to build" in done.stdout
    refused = subprocess.run([sys.executable, str(script), *flags], capture_output=True, text=True)
    assert refused.returncode != 0 and "add --kernel-graph" in refused.stderr


def test_a_merging_compression_on_cuda_launches_its_kernels_and_no_copies_after_them(tmp_path):
    """profile_merge_engine --graph --kernel-graph --through-cache (in a process of its
    own: it stands in for MLX's CUDA kernels) counts each rule's compression as a cache on
    an NVIDIA GPU runs it. A nearest rule's blend and the window rule's write the
    survivors into the cache's buffers and take the rule's shares themselves: beyond
    dropping's launches, only the merge kernels, the nearest search's product and the
    sums' one fill; an ungated nearest rule's search and spread share one launch;
    value_norm's shares add nothing to mean's, d2o's threshold one launch and its search
    one of its own (and its NaN start); keepkv's inputs (votes joined, their log, its
    query) one launch, its search in its merge's first launch of three;
    no concatenation (the copies into buffers with room to decode) follows any rule with
    a kernel blend."""
    import subprocess
    import sys
    from pathlib import Path

    views = _load_bench_script("profile_merge_engine").VIEWS
    out = tmp_path / "graph.json"
    subprocess.run([sys.executable, str(Path(__file__).resolve().parents[1] / "bench" / "profile_merge_engine.py"), "--rows", "2", "--head-dim", "8",
                    "--budget", "16", "--chunk", "40", "--graph", "--kernel-graph", "--through-cache", "--out",
                    str(out)], check=True, capture_output=True, text=True)
    graph = json.loads(out.read_text())["graph"]
    drop = graph["drop"]["by_primitive"]
    for rule in ("mean", "mass_weighted", "value_norm", "window", "keepkv"):
        ops = graph[rule]["by_primitive"]
        assert "Concatenate" not in ops, (rule, ops)
    for rule in ("mean", "mass_weighted", "value_norm"):
        ops = graph[rule]["by_primitive"]
        extra = {op: n - drop.get(op, 0) for op, n in ops.items() if op not in views and n != drop.get(op, 0)}
        # partition, gather, nearest and spread, finish for drop's one launch; the product; the sums' fill
        assert extra == {"Depends": 3, "Matmul": 1, "Full": 1}, (rule, extra)
    # the window rule: partition, gather, its spread and the finish; its sums' fill; no product
    window = {op: n - drop.get(op, 0) for op, n in graph["window"]["by_primitive"].items()
              if op not in views and n != drop.get(op, 0)}
    assert window == {"Depends": 3, "Full": 1}, window
    assert graph["value_norm"]["launches"] == graph["mean"]["launches"]
    # keepkv: its inputs in one launch; its search and merge in three and two fills (the fused blend's two and one)
    assert graph["keepkv"]["launches"] == graph["mean"]["launches"] + 3
    # d2o: its search, its threshold's one launch, and its NaN start at a row's first compression
    assert graph["d2o"]["launches"] == graph["mean"]["launches"] + 3


def test_decode_parts_times_quantized_rows_beside_the_others(tmp_path):
    """decode_parts' camkv-q8 / camkv-q4 arms decode with 8- and 4-bit rows (group 32)."""
    script = _load_bench_script("decode_parts")
    result = script.main(["--model", "random-demo", "--prompt-length", "80", "--budget", "40", "--steps", "3",
                          "--trials", "1", "--arms", "rotating", "camkv-q8", "camkv-q4", "--interleave",
                          "--cache-host", "--out", str(tmp_path)])
    arms = result["arms"]
    assert set(arms) == {"rotating", "camkv-q8", "camkv-q4"}
    assert all(r["cache_host_us_per_layer"] > 0 for r in arms.values())
    import camkv

    model = script.random_llama("random-demo")
    quantized = script.make_arm(model, "camkv-q4", 40)
    camkv.remove(model)  # the attention hook make_prompt_cache installed
    assert {c.config.bits for c in quantized} == {4} and {c.config.group_size for c in quantized} == {32}


@pytest.mark.parametrize("interleave", [["--interleave"], ["--pipelined", "2"]])
def test_decode_parts_arm_settings_hold_while_the_arm_runs(tmp_path, monkeypatch, interleave):
    """decode_parts' camkv-q8-fused-w8 arm runs (prefill and every step) with
    quantized_cuda.MAX_WHOLE_WARPS = 8 and kernel_text.BY_FILE off, the other arms with the
    defaults (4 warps, text by file), which are back after the run."""
    from camkv.backends import kernel_text, quantized_cuda

    script = _load_bench_script("decode_parts")
    seen = {}
    import camkv

    real = camkv.CaMKVCache.update_and_fetch

    def noting(cache, keys, values):
        arm = "q8" if cache.config.bits else "plain"
        seen.setdefault(arm, set()).add((quantized_cuda.MAX_WHOLE_WARPS, kernel_text.BY_FILE))
        return real(cache, keys, values)

    monkeypatch.setattr(camkv.CaMKVCache, "update_and_fetch", noting)
    defaults = (quantized_cuda.MAX_WHOLE_WARPS, kernel_text.BY_FILE)
    assert defaults == (4, True)
    script.main(["--model", "random-demo", "--prompt-length", "80", "--budget", "40", "--steps", "4",
                 "--trials", "1", "--arms", "camkv", "camkv-q8-fused-w8", *interleave, "--out", str(tmp_path)])
    assert seen == {"q8": {(8, False)}, "plain": {defaults}}
    assert (quantized_cuda.MAX_WHOLE_WARPS, kernel_text.BY_FILE) == defaults


def test_quantized_attention_probe_records_every_valid_shape(tmp_path, capsys):
    """bench/quantized_attention.py: a record per shape whose group divides the head
    dimension (group 128 at head dim 64 is skipped, as mx.quantize refuses it), each with
    the three times, or the error MLX raised for quantized attention."""
    script = _load_bench_script("quantized_attention")
    out = tmp_path / "probe.json"
    script.main(["--rows", "16", "--head-dim", "64", "--bits", "4", "--group-size", "32", "128", "--kv-heads", "2",
                 "--repeats", "1", "--dtype", "float32", "--out", str(out)])
    records = json.loads(out.read_text())["records"]
    assert [(r["head_dim"], r["group_size"]) for r in records] == [(64, 32)]
    assert records[0]["ok"] and all(records[0][k] > 0 for k in ("quantized_ms", "dequantized_ms", "unquantized_ms"))
    assert "D=64 rows=16 bits=4 group=32" in capsys.readouterr().out


def test_batch_decode_step_times_each_arm_at_each_row_count(tmp_path, capsys):
    """bench/batch_decode_step.py: one record per arm and row count, every request
    admitted before the timed calls."""
    script = _load_bench_script("batch_decode_step")
    out = tmp_path / "steps.json"
    script.main(["--model", "random-demo", "--context", "40", "--budget", "16", "--rows", "1", "2",
                 "--group-size", "32", "--warm", "1", "--steps", "2", "--out", str(out)])
    results = json.loads(out.read_text())["results"]
    assert [(r["arm"], r["rows"]) for r in results] == [("camkv", 1), ("camkv", 2), ("camkv-4bit", 1), ("camkv-4bit", 2)]
    assert all(r["step_ms"] > 0 and r["admitting_s"] > 0 for r in results)
    assert "camkv-4bit    2 rows: decode call" in capsys.readouterr().out


def test_needle_rows_counts_the_needle_positions_each_head_holds():
    """needle_rows: the share of a needle's (token, layer, head) rows held, and of (layer,
    head) rows holding every token of it ([start, end) positions, end excluded)."""
    script = _load_bench_script("needle_rows")

    class Held:
        def __init__(self, positions):
            self.positions = mx.array([positions], mx.int32)  # [1, H, n]

        def stored(self):
            return None, None, None, self.positions

    layers = [Held([[0, 5, 6, 7, 9], [5, 6, 10, 11, 12]]), Held([[5, 6, 7, 8, 20], [1, 2, 3, 4, 5]])]
    (needle,) = script.needle_rows(layers, [(5, 8)])
    assert needle == {"kept": 9 / 12, "whole": 2 / 4}


@pytest.mark.parametrize("argv", [["--arm", "pool5"], ["--arm", "x=[1]"], ["--arm", "x={bad"], ["--tasks", "vt"],
                                  ["--samples", "0"], ["--budget", "150%"], ["--budget", "20%,50%"]])
def test_needle_rows_refuses_bad_arguments_with_status_2(argv, capsys):
    script = _load_bench_script("needle_rows")
    with pytest.raises(SystemExit) as exit_info:
        script.parse_args(argv)
    assert exit_info.value.code == 2 and "error:" in capsys.readouterr().err


class _CharTokenizer:
    """One id per character (mod 128), no chat template, no end token."""

    chat_template = None

    def encode(self, text, add_special_tokens=False):
        return [ord(c) % 128 for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def test_reread_mass_reports_each_needle_token_in_the_compression_that_scored_it():
    """reread_mass: a needle's tokens are found where the prompt writes " VALUE", and each
    camkv layer and KV head reports them once, in the compression whose pending rows held
    them (positions first_position.. of the prompt), with their mass and percentile there."""
    import numpy as np
    from tiny_models import tiny_llama

    script = _load_bench_script("reread_mass")
    tokenizer = _CharTokenizer()
    ids = [int(t) for t in np.random.default_rng(0).integers(97, 123, 100)]  # lower-case letters
    needle = tokenizer.encode(" Q7")
    ids[60:63] = needle
    assert script.needle_positions(ids, ["Q7", "Z9"], tokenizer) == {"Q7": [60, 61, 62]}
    prompt = {"sample": "s", "expected": ["Q7"], "max_new_tokens": 2, "context_ids": ids[:90],
              "question_ids": ids[90:]}
    got = script.probe(tiny_llama(), tokenizer, prompt, budget=24, chunk=16)
    rows = got["needles"]
    assert sorted((r["layer"], r["head"]) for r in rows) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in rows:
        assert r["first_position"] <= 60 and 62 < r["first_position"] + r["rows_scored"]
        assert len(r["mass"]) == 3 and all(0 <= m <= 1 for m in r["mass"])
        assert all(0 <= q <= 1 for q in r["percentile"] + r["layer_percentile"] + r["model_percentile"])
    assert len(got["answer"]) == 2
    assert got["kept"]["needle_rows"] == 12 and got["kept"]["needle_heads"] == 4  # three tokens, four heads


def test_reread_mass_counts_what_one_threshold_a_layer_keeps_against_an_even_split():
    """Head 0's rows all outweigh head 1's: at half the rows, an even split keeps each
    head's top half (head 1's needle row among them), one threshold for the layer keeps
    head 0's rows only; beside a layer whose rows all weigh less, one threshold for the
    model keeps the needle row again (7 of 12 rows weigh less)."""
    import numpy as np

    script = _load_bench_script("reread_mass")
    mass = np.array([[0.9, 0.8, 0.7, 0.6], [0.4, 0.3, 0.2, 0.1]], np.float32)
    other_layer = np.array([[0.05, 0.02, 0.01, 0.03]], np.float32)  # a layer whose rows weigh less
    pooled = np.sort(np.concatenate([mass.ravel(), other_layer.ravel()]))
    own, whole, model_wide = script.percentiles(mass, 1, [0], pooled)
    assert own == [0.75] and whole == [0.375]
    assert model_wide == [round(7 / 12, 3)]
    rows = [{"rows_scored": 4, "percentile": own, "layer_percentile": whole, "model_percentile": model_wide}]
    assert script.kept_counts(rows, budget=2) == {
        "needle_rows": 1, "needle_heads": 1, "kept_even_split": 1, "whole_even_split": 1,
        "kept_one_threshold_a_layer": 0, "whole_one_threshold_a_layer": 0,
        "kept_one_threshold_for_the_model": 1, "whole_one_threshold_for_the_model": 1}
    assert script.kept_counts(rows, budget=4)["kept_one_threshold_a_layer"] == 1
    two_tokens = [{"rows_scored": 4, "percentile": [0.75, 0.25], "layer_percentile": [0.9, 0.6],
                   "model_percentile": [0.9, 0.1]}]
    counts = script.kept_counts(two_tokens, budget=2)  # half evicted: the second token only in the layer's way
    assert (counts["kept_even_split"], counts["whole_even_split"]) == (1, 0)
    assert (counts["kept_one_threshold_a_layer"], counts["whole_one_threshold_a_layer"]) == (2, 1)


def test_reread_mass_refuses_a_budget_below_two(capsys):
    script = _load_bench_script("reread_mass")
    with pytest.raises(SystemExit) as exit_info:
        script.parse_args(["--prompts", "p.jsonl", "--budget", "1"])
    assert exit_info.value.code == 2 and "--budget must be >= 2" in capsys.readouterr().err


def test_merge_speed_table_aligns_its_columns_under_the_longest_arm():
    """Every line of merge_speed's table puts its numbers in the same columns, the first
    as wide as the longest arm's name (mass_weighted/unfenced is 22 characters)."""
    script = _load_bench_script("merge_speed")
    row = dict(prefill_ms=12.5, prefill_vs_drop=1.0, decode_step_ms=2.0, decode_vs_drop=1.0, peak_mb=3.5,
               step_median_ms=1.75, step_slowest_ms=9.25, prefill_goal_met=True, decode_goal_met=True)
    lines = script.table({"drop": row, "mass_weighted/unfenced": row}).splitlines()
    header, rows = lines[0], lines[2:4]
    for value, column in (("12.5", "prefill ms"), ("1.75", "median"), ("9.25", "slowest"), ("3.5", "peak MB")):
        assert all(line.index(value) + len(value) == header.index(column) + len(column) for line in rows)
    assert rows[1].startswith("mass_weighted/unfenced ")


def test_decode_parts_trials_that_take_turns_prefill_the_arms_in_rotated_order(tmp_path, monkeypatch):
    """decode_parts --pipelined (and --interleave): trial t prefills the arms from the t-th
    on, so no arm is always the first prefilled (which read slower on an H100)."""
    script = _load_bench_script("decode_parts")
    real, firsts = script.prefilled, []

    def recorded(model, arm, prompt, budget):
        firsts.append(arm)
        return real(model, arm, prompt, budget)

    monkeypatch.setattr(script, "prefilled", recorded)
    monkeypatch.setattr(script, "trial", lambda *a, **k: ([], [], []))  # no warm-up trials
    script.main(["--model", "random-tiny", "--prompt-length", "40", "--budget", "20", "--steps", "2",
                 "--trials", "3", "--arms", "rotating", "camkv", "buffer", "--pipelined", "1",
                 "--out", str(tmp_path)])
    assert firsts == ["rotating", "camkv", "buffer", "camkv", "buffer", "rotating", "buffer", "rotating", "camkv"]


def test_prompt_kernels_sums_ncu_logs_by_kernel_and_lists_extra_launches(tmp_path, capsys):
    """prompt_kernels sum: each log's kernels counted and their durations summed by name
    (ncu's own lines before the CSV header skipped, other metrics ignored), and the second
    log's kernels listed by the launches they add to the first's."""
    script = _load_bench_script("prompt_kernels")
    header = '"ID","Kernel Name","Block Size","Grid Size","Metric Name","Metric Unit","Metric Value"'

    def log(name, rows):
        lines = ["==PROF== Connected to process 1", header]
        lines += [f'"{i}","{kernel}(float*)","(256,1,1)","(8,1,1)","{metric}","ns","{ns:,}"'
                  for i, (kernel, metric, ns) in enumerate(rows)]
        (tmp_path / name).write_text("\n".join(lines) + "\n")
        return tmp_path / name

    time = script.METRIC
    base = log("drop.csv", [("gemm", time, 1000), ("compact", time, 3000), ("gemm", "other", 99)])
    other = log("mean.csv", [("gemm", time, 1000), ("copy", time, 2000), ("copy", time, 2500)])
    script.main(["sum", str(base), str(other)])
    out = capsys.readouterr().out
    assert "drop.csv: 2 kernels, 0.00 ms" in out and "mean.csv: 3 kernels" in out
    assert "   +2   +0.004 ms  copy" in out and "   -1   -0.003 ms  compact" in out
    assert "gemm" not in out.split("more launches")[1]


def test_decode_attention_layouts_compute_the_default_layouts_output_and_restore_the_settings(monkeypatch):
    """bench/decode_attention.py's layouts (their kernels' text emulated off a GPU): each
    computes the default layout's output over the biased rows, and the settings it sets
    hold for its call only; a malformed layout is refused with what is allowed."""
    import cuda_emulation
    from camkv.backends import quantized_cuda

    if not cuda_emulation.here():
        pytest.skip("no NVIDIA GPU, and no C++ compiler to emulate one")
    script = _load_bench_script("decode_attention")
    opts = script.parse_args(["--rows", "150", "--kv-heads", "2", "--queries-per-kv", "3", "--layouts", "heads:4"])
    assert list(opts.settings) == ["heads:4"]
    before = {name: getattr(quantized_cuda, name) for name in ("PLAIN_STRETCHES", "WARPS", "STEPS", "MAX_WHOLE_WARPS",
                                                                "QUERY_HEAD_ROWS", "QUERY_HEAD_DIMS",
                                                                "QUERY_HEAD_STEPS")}
    with cuda_emulation.kernels_here(quantized_cuda):
        arrays = script.inputs(opts)
        default = script.call_of({}, *arrays)()
        for layout in ("stretches:2:1", "stretches:1:3", "whole:2", "heads:4", "heads:2:1"):
            plans = len(quantized_cuda._plans)
            got = script.call_of(script.layout_settings(layout), *arrays)()
            assert len(quantized_cuda._plans) == plans + 1, layout  # a launch of its own layout
            np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(default.astype(mx.float32)),
                                       atol=2e-2, err_msg=layout)
            assert {name: getattr(quantized_cuda, name) for name in before} == before, layout
    assert script.layout_settings("sdpa") is None
    assert script.layout_settings("whole:8")["MAX_WHOLE_WARPS"] == 8
    assert script.layout_settings("heads:16")["QUERY_HEAD_STEPS"] is None
    for bad in ("stretches:4", "whole:0", "sdpa:1", "rows:4:4", "stretches:a:b", "heads:4:2:1", "heads:64"):
        with pytest.raises(ValueError, match="stretches:WARPS:STEPS"):
            script.layout_settings(bad)


def test_decode_attention_sums_each_layouts_calls_in_launch_order(tmp_path, capsys):
    """decode_attention --sum: a call is its first kernel and the launches that continue it
    (camkv's combine, MLX's second attention pass), layouts one after another; other
    metrics and a combine before any call are left out; a log without ncu's header is
    refused with status 2."""
    script = _load_bench_script("decode_attention")
    header = '"ID","Kernel Name","Block Size","Grid Size","Metric Name","Metric Unit","Metric Value"'
    kernels = [("attention_combine", 50), ("kernel_sdpav_2pass_1", 1000), ("kernel_sdpav_2pass_2", 200),
               ("kernel_sdpav_2pass_1", 1100), ("kernel_sdpav_2pass_2", 300),
               ("partials_64", 2000), ("quantized_attention_combine", 500), ("partials_64", 2100),
               ("quantized_attention_combine", 400), ("partials_whole", 1500)]
    lines = ["==PROF== Connected to process 1", header]
    lines += [f'"{i}","{name}(float*)","(256,1,1)","(8,1,1)","gpu__time_duration.sum","ns","{ns:,}"'
              for i, (name, ns) in enumerate(kernels)]
    lines.append(f'"99","partials_whole(float*)","(256,1,1)","(8,1,1)","other","ns","7"')
    (tmp_path / "l.csv").write_text("\n".join(lines) + "\n")
    assert script.by_layout(tmp_path / "l.csv") == [("kernel_sdpav_2pass_1", 2, 1300.0), ("partials_64", 2, 2500.0),
                                                   ("partials_whole", 1, 1500.0)]
    script.main(["--sum", str(tmp_path / "l.csv")])
    assert "    2.50 us a call     2 calls  partials_64" in capsys.readouterr().out
    (tmp_path / "bad.csv").write_text("no header\n")
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--sum", str(tmp_path / "bad.csv")])
    assert exit_info.value.code == 2
