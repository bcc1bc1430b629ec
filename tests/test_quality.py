"""camkv eval: the smoke sweep end to end, the metric's alignment, passkey prompts, resuming."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from camkv import merges
from camkv.eval import sweep, texts
from camkv.eval.arms import CacheSettings, is_retired, make_cache, method_catalog, parse_methods, release_cache
from camkv.eval.budgets import budgets_for, parse_budgets
from camkv.eval.cli import PRESETS, build_parser, main
from camkv.eval.loading import tiny_random_model
from camkv.eval.passkey import (PASSKEY_QUESTION, build_passkey, greedy_answer, is_correct, passkey_depths,
                                spread_order)
from camkv.prefill import output_head, prefill
from camkv.eval.stream import feed
from camkv.eval.records import RecordStore
from camkv.eval.stream import full_reference, stream_arm, summarize_positions
from camkv.eval.sweep import OutOfTime


@pytest.fixture(scope="module")
def tiny():
    return tiny_random_model()


@pytest.fixture(scope="module")
def window_tokens(tiny):
    _, tokenizer = tiny
    docs = texts.load_source("builtin")
    return texts.sample_windows("builtin", docs, tokenizer, 80, 1, seed=3)[0].tokens


SETTINGS = CacheSettings(n_sink=2, recent=4, window=4, seed=0, backend="auto")


def _arm_metrics(model, method_name, budget, tokens, ref, prefill=40, chunk=16):
    method = method_catalog()[method_name]
    caches = make_cache(model, method, budget, SETTINGS)
    try:
        return stream_arm(model, caches, tokens, prefill, chunk, ref), caches
    finally:
        release_cache(model, method)


def test_camkv_that_never_evicts_matches_the_full_cache_position_by_position(tiny, window_tokens):
    # A budget above the window length never evicts, and camkv returns exactly what
    # KVCache returns: any misalignment between the arm's and the reference's
    # positions would show as KL > 0 and disagreements.
    model, _ = tiny
    ref = full_reference(model, window_tokens, 40, 16, start=10)
    metrics, caches = _arm_metrics(model, "sim_weighted", 200, window_tokens, ref)
    assert metrics["kl"].shape == (len(window_tokens) - 1 - 10,)
    assert abs(metrics["kl"]).max() < 1e-4
    assert metrics["agree"].min() == 1.0
    assert abs(metrics["nll"] - ref.nll).max() < 1e-4
    assert caches[0].stats["evictions"] == 0


def test_small_budgets_diverge_from_the_full_cache_and_sums_cover_the_right_positions(tiny, window_tokens):
    model, _ = tiny
    ref = full_reference(model, window_tokens, 40, 16, start=12)
    for name in ("streamingllm", "h2o", "window-nogate"):
        metrics, caches = _arm_metrics(model, name, 12, window_tokens, ref)
        decode = summarize_positions(metrics, ref, 40)
        everything = summarize_positions(metrics, ref, 12)
        assert decode["positions"] == len(window_tokens) - 1 - 40
        assert everything["positions"] == len(window_tokens) - 1 - 12
        assert decode["kl_sum"] > 1e-3, name
        assert 0 <= decode["agree_sum"] <= decode["positions"]
        assert math.isfinite(decode["nll_sum"]) and decode["full_nll_sum"] > 0
        assert all(c.size() <= 12 + 12 // 8 for c in caches)  # budget + the default slack


@pytest.mark.parametrize("count", [1, 2, 3, 5, 8, 20, 33])
def test_placements_run_in_an_order_whose_every_prefix_spans_the_depths(count):
    order = spread_order(count)
    assert sorted(order) == list(range(count))
    for m in range(2, count + 1):  # any cut of the sweep: both ends, no wide hole
        taken = sorted(order[:m])
        assert taken[0] == 0 and taken[-1] == count - 1, (count, m)
        assert max(b - a for a, b in zip(taken, taken[1:])) <= 2 * (count - 1) / (m - 1) + 1, (count, m)


def test_passkey_prompt_has_the_exact_length_and_hides_the_key_once(tiny):
    _, tokenizer = tiny
    docs = texts.load_source("builtin")
    for j, depth in enumerate(passkey_depths(5)):
        prompt = build_passkey(tokenizer, "builtin", docs, 400, depth, j, seed=1)
        text = tokenizer.decode(prompt.tokens)
        assert len(prompt.tokens) == 400
        assert len(prompt.key) == 5 and text.count(prompt.key) == 2  # "key is K ... K is"
        assert text.endswith(PASSKEY_QUESTION)
        assert -0.01 <= prompt.depth - depth <= 0.051  # moved forward to a sentence end, not far
    assert passkey_depths(20)[0] == pytest.approx(0.1)
    assert passkey_depths(20)[-1] == pytest.approx(0.9)
    with pytest.raises(ValueError, match="cannot hold the passkey prompt"):
        build_passkey(tokenizer, "builtin", docs, 100, 0.5, 0, seed=1)


class _OtherModel:
    """A model camkv.eval.passkey does not know the head of: called as a whole."""

    def __init__(self, model):
        self.inner = model

    def __call__(self, inputs, cache=None):
        return self.inner(inputs, cache=cache)


@pytest.mark.parametrize("method_name", ["full", "h2o-query", "keepkv-nogate-query"])
def test_a_passkey_prefill_gives_the_last_logits_and_answer_of_a_whole_model_call(tiny, method_name):
    """The passkey prefill sends only the last position through the output head: the
    logits, the cache it leaves and the greedy answer are those of whole-model calls."""
    model, tokenizer = tiny
    assert output_head(model) is not None and output_head(_OtherModel(model)) is None
    docs = texts.load_source("builtin")
    prompt = build_passkey(tokenizer, "builtin", docs, 360, 0.5, 0, seed=1).tokens
    method = method_catalog()[method_name]
    results = []
    for runner in (model, _OtherModel(model)):
        caches = make_cache(model, method, 48, SETTINGS)
        try:
            if runner is model:
                last = prefill(model, caches, prompt, 64)
            else:
                for _, logits in feed(runner, caches, prompt, len(prompt), 64):
                    pass
                last = logits[-1]
            state = [np.array(a) for c in caches for a in c.state if a is not None]
            caches = make_cache(model, method, 48, SETTINGS)
            answer = greedy_answer(runner, caches, prompt, 64, 6, tokenizer)
        finally:
            release_cache(model, method)
        results.append((np.array(last), state, answer))
    (a, state_a, answer_a), (b, state_b, answer_b) = results
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert len(state_a) == len(state_b) and all(np.array_equal(x, y) for x, y in zip(state_a, state_b))
    assert answer_a == answer_b


@pytest.mark.parametrize("answer,correct", [
    (" 12345. Remember", True), ("12345", True), (" 123456", False), (" 1234", False),
    (" the key", False), (" 54321 12345", False),
])
def test_passkey_answers_are_exact_matches_of_the_first_number(answer, correct):
    assert is_correct(answer, "12345") is correct


def test_budgets_resolve_per_context_and_skip_what_cannot_evict():
    budgets = parse_budgets("10%,20%,50%,256,512")
    notes: set[str] = set()
    resolved = budgets_for(1024, budgets, CacheSettings(4, 32, 4, 0, "auto"), notes)
    assert resolved == {102: ["10%"], 205: ["20%"], 512: ["50%", "512"], 256: ["256"]}
    assert notes == set()
    resolved = budgets_for(300, budgets, CacheSettings(4, 32, 4, 0, "auto"), notes)
    assert resolved == {60: ["20%"], 150: ["50%"], 256: ["256"]}
    assert any("10% = 30" in n for n in notes) and any("512" in n for n in notes)
    for bad in ("0%", "150%", "abc", "-3", ""):
        with pytest.raises(ValueError, match="--budgets"):
            parse_budgets(bad)


def test_a_recent_share_resolves_per_budget_and_decides_which_budgets_can_evict():
    share = CacheSettings(4, "25%", 4, 0, "auto")
    assert [share.recent_for(b) for b in (2, 205, 512, 819)] == [1, 51, 128, 204]
    assert CacheSettings(4, 32, 4, 0, "auto").recent_for(819) == 32
    notes: set[str] = set()
    # 25% of a budget of 6 is 1: 4 + 1 < 6 can evict; with 32 tokens it could not.
    assert budgets_for(24, parse_budgets("25%"), share, notes) == {6: ["25%"]}
    assert budgets_for(24, parse_budgets("25%"), CacheSettings(4, 32, 4, 0, "auto"),
                               notes) == {}


def test_methods_cover_every_arm_of_the_issue_and_reject_unknown_names():
    names = set(method_catalog())
    for merge in (r.name for r in merges.RULES if r.kind != merges.DROP):  # drop: the h2o arms
        for suffix in ("", "-nogate", "-query", "-nogate-query"):
            assert merge + suffix in names
    assert {"full", "streamingllm", "h2o", "h2o-query"} <= names
    assert parse_methods("h2o")[0].name == "full"  # always measured against
    merge_group = [m.name for m in parse_methods("merge")]
    assert "mass_weighted-nogate-query" in merge_group and "value_norm-nogate" in merge_group
    assert all(name in names for name in merge_group)
    # Retired rules: left out of every group, still run when named.
    grouped = {m.name for group in ("all", "key", "core", "merge") for m in parse_methods(group)}
    assert not any(is_retired(method_catalog()[n]) for n in grouped)
    assert parse_methods("sim_weighted-nogate-query")[1].merge == "sim_weighted"
    with pytest.raises(ValueError, match="unknown method 'h20'"):
        parse_methods("h2o,h20")


class _ThreeUnitClock(sweep.Clock):
    """A time budget that runs out after three units of work, on any machine's speed."""

    def check(self, kind: str) -> None:
        if self.budget_s is not None and sum(len(v) for v in self.spent.values()) >= 3:
            raise OutOfTime()


def test_smoke_preset_completes_resumes_and_reports_sane_values(tmp_path, monkeypatch, capsys):
    out = tmp_path / "smoke"
    # A first run cut short by the time budget, then the same command finishing the rest.
    with monkeypatch.context() as patch:
        patch.setattr(sweep, "Clock", _ThreeUnitClock)
        assert main(["--preset", "smoke", "--out", str(out), "--no-progress", "--tasks", "stream,passkey",
                             "--time-budget", "1000"]) == 0
    partial = json.loads((out / "summary.json").read_text())
    assert partial["complete"] is False
    assert (out / "records.jsonl").read_text().splitlines(), "the cut run kept no finished work"
    assert main(["--preset", "smoke", "--out", str(out), "--no-progress", "--tasks", "stream,passkey"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]

    assert summary["complete"] is True
    keys = [(r["task"], r["sample"], r["method"], r["budget"]) for r in records]
    assert len(keys) == len(set(keys)), "a resumed run redid finished work"
    methods = parse_methods(PRESETS["smoke"]["methods"])
    # stream: a 96-token window, budgets 20% = 19 and 50% = 48;
    # passkey: 2 prompts of 320 tokens, budgets 64 and 160, plus the full cache.
    assert len(records) == (len(methods) - 1) * 2 + 2 * (1 + (len(methods) - 1) * 2)

    stream = summary["stream"]["decode"]
    for method in methods:
        for label in ("20%", "50%"):
            cell = stream[method.name][label]
            assert cell["positions"] == 96 - 1 - 48
            assert cell["kl"] >= 0 and 0 <= cell["top1"] <= 1
            assert 1 < cell["ppl"] < 1e4  # a random 256-token model: near uniform, finite
    assert stream["full"]["20%"]["kl"] == 0 and stream["full"]["20%"]["top1"] == 1
    assert stream["streamingllm"]["20%"]["kl"] > 0
    overall = summary["passkey"]["overall"]
    for method in methods:
        for label in ("20%", "50%"):
            assert overall[method.name][label]["n"] == 2
            assert 0 <= overall[method.name][label]["accuracy"] <= 1
    table = (out / "table.md").read_text()
    assert all(f"| {m.name} |" in table for m in methods)
    for png in ("stream_vs_budget.png", "passkey_heatmap.png", "passkey_bars.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"  # matplotlib is in the test extra
    # Redrawn from the records alone (a folder brought back from another machine): nothing
    # says whether the sweep was cut, so the report claims neither.
    (out / "summary.json").unlink()
    capsys.readouterr()
    assert main(["--preset", "smoke", "--out", str(out), "--tasks", "stream,passkey", "--report-only"]) == 0
    assert "partial" not in capsys.readouterr().out
    assert json.loads((out / "summary.json").read_text())["complete"] is None


def test_a_folder_takes_more_arms_but_refuses_records_of_another_setup(tmp_path):
    out = tmp_path / "run"
    args = ["--preset", "smoke", "--out", str(out), "--no-progress", "--tasks", "passkey",
            "--budgets", "50%", "--passkey-placements", "1"]
    assert main(args + ["--methods", "h2o"]) == 0
    assert main(args + ["--methods", "h2o,streamingllm"]) == 0  # adds one arm
    methods = [json.loads(line)["method"] for line in (out / "records.jsonl").open()]
    assert methods == ["full", "h2o", "streamingllm"]
    assert main(args + ["--methods", "h2o", "--chunk", "16"]) == 2  # another setup
    assert main(args + ["--methods", "h2o", "--chunk", "16", "--fresh"]) == 0


@pytest.mark.parametrize("flag,value,message", [
    ("--tasks", "stream,generate", "--tasks"),
    ("--stream-prefill", "96", "--stream-prefill"),
    ("--passkey-lengths", "1k", "--passkey-lengths"),
    ("--chunk", "0", "--chunk"),
    ("--texts", "no-such-source", "neither a known source"),
    ("--recent", "0", "--recent must be a token count >= 1 or a share N% of the budget"),
    ("--recent", "100%", "got '100%'"),
    ("--recent", "quarter", "got 'quarter'"),
])
def test_bad_values_exit_2_naming_the_flag(tmp_path, capsys, flag, value, message):
    assert main(["--preset", "smoke", "--out", str(tmp_path), flag, value]) == 2
    assert message in capsys.readouterr().err


def test_every_flag_has_help():
    for action in build_parser()._actions:
        assert action.help, action.option_strings


def test_plan_counts_the_runs_the_smoke_sweep_makes(capsys):
    assert main(["--preset", "smoke", "--plan", "--tasks", "stream,passkey"]) == 0
    out = capsys.readouterr().out
    # 1 window: the full reference + 5 arms x 2 budgets; 2 prompts x (full + 5 x 2).
    assert "= 11 runs" in out and "= 22 runs" in out


def test_a_folder_in_use_is_refused_and_a_stale_lock_is_taken_over(tmp_path, capsys):
    import os
    import socket

    args = ["--preset", "smoke", "--out", str(tmp_path), "--no-progress", "--tasks", "passkey",
            "--methods", "h2o", "--budgets", "50%", "--passkey-placements", "1"]
    (tmp_path / "run.lock").write_text(f"{socket.gethostname()}:{os.getpid()}")
    assert main(args) == 2
    assert "in use by another camkv eval" in capsys.readouterr().err
    (tmp_path / "run.lock").write_text(f"{socket.gethostname()}:999999999")
    assert main(args) == 0
    assert not (tmp_path / "run.lock").exists()


def test_a_redone_arm_counts_once(tmp_path):
    line = {"task": "passkey", "sample": "s", "method": "h2o", "budget": 5, "correct": False}
    again = {**line, "correct": True}
    (tmp_path / "records.jsonl").write_text(
        json.dumps(line) + "\n" + json.dumps(again) + "\n" + '{"task": "pass')
    assert RecordStore.read_records(tmp_path) == [again]
