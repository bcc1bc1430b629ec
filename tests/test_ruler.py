"""camkv eval --tasks ruler: RULER's generators, its scoring, the SnapKV arm, the report."""

from __future__ import annotations

import json
import random
import re
import string
from dataclasses import replace

import numpy as np
import pytest

from camkv.eval import ruler, ruler_report, texts
from camkv.eval.arms import CacheSettings, make_cache, method_catalog, parse_arm_spec, parse_methods, release_cache
from camkv.eval.cli import PRESETS, main
from camkv.eval.loading import ByteTokenizer, tiny_random_model

# A long real text (the Gettysburg Address, repeated apart into documents) so prompts of
# several thousand bytes need no download.
DOCS = [texts.Document(f"g{i}", texts.GETTYSBURG) for i in range(8)]
# Its 121 words and made-up ones: the common-words lists of long prompts need more.
WORDS = sorted(set(ruler.vocabulary(DOCS)) | {"".join(random.Random(i).choices(string.ascii_lowercase, k=7))
                                              for i in range(2000)})
TOKENIZER = ByteTokenizer()


def _sample(task, length=2048, index=0, chat=("", ""), tokenizer=TOKENIZER, max_answer=None):
    return ruler.build_sample(task, tokenizer, "gettysburg", DOCS, WORDS, length, index, 0, chat, max_answer)


# ---------------------------------------------------------------------------- scoring


def test_score_is_the_fraction_of_expected_strings_found_case_insensitive():
    assert ruler.ruler_score(" 1234567 and 7654321.", ["1234567", "7654321"]) == 1.0
    assert ruler.ruler_score("The numbers are 1234567, I think", ["1234567", "7654321"]) == 0.5
    assert ruler.ruler_score("nothing here", ["1234567"]) == 0.0
    assert ruler.ruler_score("VAR ABCDE, fghij", ["abcde", "FGHIJ", "KLMNO"]) == pytest.approx(2 / 3)
    # RULER matches substrings: a longer number that contains the value counts.
    assert ruler.ruler_score("91234567", ["1234567"]) == 1.0
    # Control characters become newlines, so a value split by one is not found.
    assert ruler.ruler_score("12345\x0067", ["1234567"]) == 0.0
    assert ruler.clean_answer("\x01 honest-abe \n") == "honest-abe"
    with pytest.raises(ValueError, match="at least one expected"):
        ruler.ruler_score("x", [])


# ---------------------------------------------------------------------------- generators


@pytest.mark.parametrize("task", ruler.TASK_NAMES)
@pytest.mark.parametrize("length", [2048, 8192])  # bytes: RULER's two settings of cwe
def test_each_task_states_its_answers_where_it_says_within_the_length(task, length):
    sample = _sample(task, length)
    tokens = sample.tokens
    assert len(tokens) + sample.answer_tokens <= length
    assert len(tokens) + sample.answer_tokens >= 0.9 * length  # filled, not a short prompt
    assert sample.answer_tokens == ruler.ANSWER_TOKENS[task]
    text = TOKENIZER.decode(tokens)
    if task in ruler.NIAH:
        spec = ruler.NIAH[task]
        assert len(sample.answers) == spec.values * spec.queries
        assert len(sample.spans) == len(sample.answers) == len(sample.depths)
        for value, (start, end) in zip(sample.answers, sample.spans):
            needle = TOKENIZER.decode(tokens[start:end])
            assert re.fullmatch(r" ?One of the special magic \w+ for \S+ is: " + re.escape(value) + r"\.\n?", needle)
            assert text.count(value) == 1
        # The question names the asked keys; distractor keys are never asked.
        question = TOKENIZER.decode(sample.question)
        for value, (start, end) in zip(sample.answers, sample.spans):
            key = TOKENIZER.decode(tokens[start:end]).split(" for ")[1].split(" is: ")[0]
            assert key in question
        assert all(0 <= d <= 1 for d in sample.depths)
    elif task == "vt":
        statements = [TOKENIZER.decode(tokens[a:b]).strip() for a, b in sample.spans]
        names = sample.answers
        assert re.fullmatch(rf"VAR {names[0]} = \d{{5}}", statements[0])
        value = statements[0].split(" = ")[1]
        for j in range(1, len(names)):
            assert statements[j] == f"VAR {names[j]} = VAR {names[j - 1]}"
        assert f"assigned the value {value}" in TOKENIZER.decode(sample.question)
    elif task == "cwe":
        listed = re.findall(r"\d+\. (\w+)", TOKENIZER.decode(sample.context).rsplit("\n", 1)[1])
        repeats = 30 if length >= 4096 else 6
        assert all(listed.count(w) == repeats for w in sample.answers)
        assert max(listed.count(w) for w in set(listed) - set(sample.answers)) == (3 if length >= 4096 else 1)
    else:  # fwe
        words = TOKENIZER.decode(sample.context).split(ruler.FWE_INTRO)[1].split()
        counts = {w: words.count(w) for w in set(words)}
        top = sorted((c, w) for w, c in counts.items() if w != "...")[-3:]
        assert {w for _, w in top} == set(sample.answers)
        assert sorted(c for c, _ in top)[0] > sorted(counts.values())[-5]  # a strict top three
    ruler.check_sample(sample, TOKENIZER)


def test_check_sample_refuses_a_sample_that_does_not_hold_what_it_states():
    sample = _sample("niah_multivalue")
    ruler.check_sample(sample, TOKENIZER)
    wrong = replace(sample, answers=(sample.answers[1], sample.answers[0], *sample.answers[2:]))
    with pytest.raises(AssertionError):
        ruler.check_sample(wrong, TOKENIZER)  # the first span states another value
    with pytest.raises(AssertionError):
        ruler.check_sample(replace(sample, length=len(sample.tokens)), TOKENIZER)  # no room to answer
    cwe = _sample("cwe")
    counts = {**cwe.counts, "intruder": 99}
    with pytest.raises(AssertionError):
        ruler.check_sample(replace(cwe, counts=counts), TOKENIZER)


def test_prompts_differ_by_index_and_repeat_by_seed():
    a, b = _sample("niah_single_3", index=0), _sample("niah_single_3", index=1)
    assert a.answers != b.answers and a.sample_id != b.sample_id
    assert _sample("niah_single_3", index=1).tokens == b.tokens


def test_niah_singular_wording_and_the_multi_query_list_follow_ruler():
    single = TOKENIZER.decode(_sample("niah_single_1").tokens)
    assert single.startswith("A special magic number is hidden within the following text.")
    assert "What is the special magic number for " in single
    assert single.endswith("mentioned in the provided text is")
    multi = TOKENIZER.decode(_sample("niah_multiquery").question)
    assert re.search(r"special magic numbers for \S+, \S+, \S+, and \S+ mentioned", multi)


class ChatTokenizer(ByteTokenizer):
    """Bytes with a chat template that writes its own BOS text, like Gemma's."""

    bos_token = "<s>"
    chat_template = "<s>[user] {content} [assistant]"

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return f"<s>[user] {messages[0]['content']} [assistant]"


def test_the_chat_template_wraps_the_task_and_the_answer_prefix_follows_it():
    tok = ChatTokenizer()
    head, tail = ruler.chat_parts(tok, "auto")
    assert (head, tail) == ("<s>[user] ", " [assistant]")
    sample = _sample("niah_single_2", chat=(head, tail), tokenizer=tok)
    text = tok.decode(sample.tokens)
    assert text.startswith("<s>[user] A special magic number is hidden")  # one BOS text
    assert " [assistant] The special magic number for " in text
    assert text.endswith("mentioned in the provided text is")
    assert tok.decode(sample.question).startswith("\nWhat is the special magic number for ")
    assert ruler.chat_parts(tok, "off") == ("", "")
    with pytest.raises(ValueError, match="no chat template"):
        ruler.chat_parts(ByteTokenizer(), "on")


def test_a_length_too_short_for_the_task_is_a_clear_error():
    with pytest.raises(ValueError, match="--ruler-lengths"):
        _sample("cwe", 512)


# ---------------------------------------------------------------------------- arms


SETTINGS = CacheSettings(n_sink=2, recent=4, window=4, seed=0, backend="auto")


@pytest.fixture(scope="module")
def tiny():
    return tiny_random_model()


def _evictions(caches) -> int:
    return sum(c.stats["evictions"] for c in caches if hasattr(c, "stats"))


def test_snapkv_compresses_the_context_once_and_evicts_nothing_after(tiny):
    model, tok = tiny
    sample = _sample("niah_single_1", 1024, max_answer=6)
    budget, arm = 200, method_catalog()["snapkv"]
    rows = 2  # the tiny llama: 2 KV heads in each layer

    def answered(question_by_steps):
        caches = make_cache(model, arm, budget, SETTINGS, context=len(sample.context),
                            after_context=len(sample.question) + sample.answer_tokens)
        try:
            ruler.answer(model, caches, sample, 64, tok, question_by_steps=question_by_steps)
        finally:
            release_cache(model, arm)
        return caches

    caches = answered(question_by_steps=True)
    assert _evictions(caches) == (len(sample.context) - budget) * rows * len(caches)
    assert all(c.size() == budget + len(sample.question) + sample.answer_tokens for c in caches)
    # The question as one block would be compressed with the first decode step: evictions
    # after the context, which kvpress never makes (why answer() feeds it step by step).
    caches = answered(question_by_steps=False)
    assert _evictions(caches) > (len(sample.context) - budget) * rows * len(caches)


def test_snapkv_refuses_what_it_cannot_run(tiny):
    model, _ = tiny
    arm = method_catalog()["snapkv"]
    with pytest.raises(ValueError, match="RULER prompts only"):
        make_cache(model, arm, 100, SETTINGS)
    with pytest.raises(ValueError, match="slack"):
        make_cache(model, arm, 100, SETTINGS, context=150, after_context=60)


def test_any_camkv_config_is_an_arm():
    arm = parse_arm_spec('deep={"merge": "mass_weighted", "recent": 16}')
    assert arm.kind == "config" and arm.config.merge == "mass_weighted" and arm.config.recent == 16
    default = method_catalog()["camkv"]
    assert default.config.merge == "drop" and default.config.scoring == "query"
    assert {f"camkv-{m}" for m in ("mean", "mass_weighted", "keepkv")} <= set(method_catalog())
    suite = [m.name for m in parse_methods("ruler")]
    assert suite[:6] == ["full", "streamingllm", "streamingllm-sinks", "snapkv", "h2o-causal", "camkv"] and "camkv-keepkv" in suite
    assert method_catalog()["h2o-causal"].prefill_scoring == "causal"
    # The stream and passkey groups keep their arms (snapkv cannot run there).
    assert not {"snapkv", "streamingllm-sinks", "h2o-causal", "camkv"} & {m.name for m in parse_methods("all")}
    for bad, message in [("deep", "NAME="), ("camkv={}", "no method's"), ("x={nope", "not JSON"),
                         ('x={"budget": 9}', "other than budget"), ('x={"merge": "smash"}', "merge")]:
        with pytest.raises(ValueError, match=message):
            parse_arm_spec(bad)


# ---------------------------------------------------------------------------- report


def _record(method, task, sample, score, labels=("20%",), budget=10, depths=(0.5,)):
    return {"task": "ruler", "sample": sample, "method": method, "budget": None if method == "full" else budget,
            "labels": [] if method == "full" else list(labels), "ruler_task": task, "length": 4096,
            "depths": list(depths), "score": score}


def test_summary_averages_task_means_with_intervals_and_pairs_with_the_full_cache():
    records = []
    for i in range(4):
        records.append(_record("full", "niah_single_1", f"a{i}", 1.0))
        records.append(_record("camkv", "niah_single_1", f"a{i}", [1.0, 1.0, 0.0, 1.0][i]))
        records.append(_record("camkv", "niah_single_1", f"a{i}", 0.0, labels=("10%",), budget=5))
    for i in range(2):  # a task with fewer prompts weighs as much as the other
        records.append(_record("full", "fwe", f"b{i}", 0.0, depths=()))
        records.append(_record("camkv", "fwe", f"b{i}", 1 / 3, depths=()))
    summary = ruler_report.summarize_ruler(records)
    cell = summary["cells"]["camkv|4096|20%"]
    assert cell["ruler"]["average"]["mean"] == pytest.approx((0.75 + 1 / 3) / 2)
    assert cell["niah"]["average"]["mean"] == pytest.approx(0.75)
    assert cell["ruler"]["average"]["lo"] <= cell["ruler"]["average"]["mean"] <= cell["ruler"]["average"]["hi"]
    assert cell["ruler"]["average"]["hi"] - cell["ruler"]["average"]["lo"] > 0.05  # a spread, not a point
    assert cell["ruler"]["vs_full"]["mean"] == pytest.approx(((0.75 - 1) + (1 / 3 - 0)) / 2)
    # The full cache has no budget: its prompts count under every label they ran at.
    assert summary["cells"]["full|4096|10%"]["tasks"]["niah_single_1"]["n"] == 4
    assert summary["cells"]["full|4096|20%"]["ruler"]["average"]["mean"] == pytest.approx(0.5)
    assert cell["depths"]["middle third"]["mean"] == pytest.approx(0.75)
    assert summary["tasks"] == ["niah_single_1", "fwe"]
    lines = "\n".join(ruler_report.ruler_tables(summary, ["full", "camkv"], ["10%", "20%"]))
    assert "| camkv | 0.0 [0.0, 0.0] | 54.2 [" in lines


def _four_prompts(**scores) -> list[dict]:
    """niah_single_1 records of four prompts: the full cache's score 1, and each named
    arm's scores of the four."""
    return [_record(method, "niah_single_1", f"a{i}", score)
            for method, arm_scores in {"full": [1.0] * 4, **scores}.items() for i, score in enumerate(arm_scores)]


def test_the_default_is_paired_with_every_other_arm_on_the_prompts_both_ran():
    records = _four_prompts(camkv=[1.0, 1.0, 0.0, 1.0], snapkv=[0.0, 1.0, 0.0, 0.0])
    records.append(_record("snapkv", "niah_single_1", "a9", 1.0))  # a prompt camkv did not run
    summary = ruler_report.summarize_ruler(records)
    snap = summary["cells"]["snapkv|4096|20%"]["ruler"]
    assert snap["default_minus"]["mean"] == pytest.approx((1 + 0 + 0 + 1) / 4)
    assert snap["default_minus"]["lo"] <= 0.5 <= snap["default_minus"]["hi"]
    assert "default_minus" not in summary["cells"]["camkv|4096|20%"]["ruler"]
    assert summary["cells"]["full|4096|20%"]["ruler"]["default_minus"]["mean"] == pytest.approx(-0.25)
    lines = "\n".join(ruler_report.ruler_tables(summary, ["full", "snapkv", "camkv"], ["20%"]))
    assert "minus each arm" in lines and "| snapkv | 50.0 [" in lines.split("minus each arm")[1]


def test_versus_pairs_another_arm_with_every_other_and_names_it():
    records = _four_prompts(camkv=[1.0, 0.0, 0.0, 1.0], recon=[1.0, 1.0, 0.0, 1.0])
    summary = ruler_report.summarize_ruler(records, versus="recon")
    assert summary["versus"] == "recon"
    assert summary["cells"]["camkv|4096|20%"]["ruler"]["default_minus"]["mean"] == pytest.approx(0.25)
    assert "default_minus" not in summary["cells"]["recon|4096|20%"]["ruler"]
    lines = "\n".join(ruler_report.ruler_tables(summary, ["full", "camkv", "recon"], ["20%"]))
    assert "RULER average: recon minus each arm" in lines and "recon is ahead" in lines
    assert "| camkv | 25.0 [" in lines.split("minus each arm")[1]
    with pytest.raises(ValueError, match="'nope'.*camkv, full, recon"):
        ruler_report.summarize_ruler(records, versus="nope")


def test_versus_of_an_arm_without_ruler_records_pairs_nothing_and_refuses_nothing():
    records = [{"task": "stream", "method": "recon", "sample": "w0"}]
    summary = ruler_report.summarize_ruler(records, versus="recon")
    assert summary["cells"] == {} and summary["versus"] == "recon"


def test_versus_naming_no_arm_is_refused_before_anything_runs(tmp_path, capsys):
    out = tmp_path / "ruler"
    args = ["--preset", "smoke", "--tasks", "ruler", "--out", str(out), "--no-progress", "--plan"]
    assert main(args + ["--versus", "nope"]) == 2
    assert "--versus must name an arm" in capsys.readouterr().err and not out.exists()
    assert main(args + ["--versus", "streamingllm"]) == 0


def test_a_constant_score_has_a_zero_width_interval_and_one_prompt_none():
    stats = ruler_report._stratified({"t": np.ones(5)}, np.random.default_rng(0))
    assert stats == {"mean": 1.0, "lo": 1.0, "hi": 1.0, "n": 5, "tasks": 1}
    single = ruler_report._stratified({"t": np.ones(5), "u": np.zeros(1)}, np.random.default_rng(0))
    assert single == {"mean": 0.5, "lo": None, "hi": None, "n": 6, "tasks": 2}
    assert ruler_report._pct(single) == "50.0 (1 prompt a task: no interval)"


# ---------------------------------------------------------------------------- the command


def test_the_smoke_preset_runs_ruler_and_writes_records_and_tables(tmp_path, monkeypatch):
    out = tmp_path / "ruler"
    args = ["--preset", "smoke", "--tasks", "ruler", "--out", str(out), "--no-progress"]
    clears = []
    clear = ruler.mx.clear_cache
    monkeypatch.setattr(ruler.mx, "clear_cache", lambda: clears.append(1) or clear())
    assert main(args) == 0
    monkeypatch.undo()
    records = [json.loads(line) for line in (out / "records.jsonl").open()]
    assert len(clears) >= len(records)  # MLX's cache emptied after every prompt
    values = PRESETS["smoke"]
    tasks, arms = values["ruler_tasks"].split(","), ruler.RULER_METHODS["smoke"].split(",")
    assert len(records) == len(tasks) * (1 + (len(arms) - 1) * 2)  # two budgets each
    assert {r["ruler_task"] for r in records} == set(tasks)
    assert {r["method"] for r in records} == set(arms)
    for r in records:
        assert 0 <= r["score"] <= 1 and r["score"] == ruler.ruler_score(r["answer"], r["expected"])
        assert r["prompt_tokens"] + 4 <= r["length"]
        assert r["active_mib"] > 0 and r["cached_mib"] >= 0  # MLX's memory after the prompt
    table = (out / "table.md").read_text()
    assert "**RULER average" in table and all(f"| {m} |" in table for m in arms)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ruler"]["cells"] and summary["complete"] is True
    assert main(args) == 0  # a rerun finds everything done
    assert sum(1 for _ in (out / "records.jsonl").open()) == len(records)


@pytest.mark.parametrize("flags, message", [
    (["--ruler-lengths", "4k"], "--ruler-lengths"),
    (["--ruler-lengths", "100"], ">= 256"),
    (["--ruler-tasks", "niah_single_9"], "unknown task"),
    (["--ruler-samples", "0"], "--ruler-samples"),
    (["--arm", "x=[1]"], "JSON object"),
    (["--tasks", "stream", "--methods", "snapkv"], "RULER prompts only"),
])
def test_bad_ruler_flags_exit_2_naming_the_value(tmp_path, capsys, flags, message):
    base = ["--preset", "smoke", "--tasks", "ruler", "--out", str(tmp_path / "o"), "--plan"]
    assert main(base + flags) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
