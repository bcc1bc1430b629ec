"""camkv eval --export-prompts: the RULER suite's prompts for another engine, and
bench/gpu/kvpress_ruler.py's records (the parts that need no PyTorch) in camkv's report."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from camkv.eval import report, ruler, ruler_export, ruler_scoring, texts
from camkv.eval.cli import main
from camkv.eval.loading import ByteTokenizer

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ["--preset", "smoke", "--tasks", "ruler", "--no-progress"]


def _kvpress_script():
    spec = importlib.util.spec_from_file_location("kvpress_ruler", ROOT / "bench/gpu/kvpress_ruler.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_export_holds_the_prompts_the_suite_runs(tmp_path, monkeypatch):
    exported = tmp_path / "prompts.jsonl.gz"
    assert main(SMOKE + ["--out", str(tmp_path / "unused"), "--export-prompts", str(exported)]) == 0
    assert not (tmp_path / "unused").exists()  # nothing ran
    lines = ruler_export.read_prompts(exported)

    ran = []  # what the suite itself hands the model, arm by arm
    real_answer = ruler.answer

    def answer(model, caches, sample, *args, **kwargs):
        ran.append(sample)
        return real_answer(model, caches, sample, *args, **kwargs)

    monkeypatch.setattr(ruler, "answer", answer)
    assert main(SMOKE + ["--out", str(tmp_path / "run")]) == 0
    suite = {s.sample_id: s for s in ran}
    assert [line["sample"] for line in lines] == list(suite)  # every prompt, in the suite's order
    for line in lines:
        sample = suite[line["sample"]]
        assert line["context_ids"] == sample.context and line["question_ids"] == sample.question
        assert line["expected"] == list(sample.answers) and line["depths"] == list(sample.depths)
        assert (line["ruler_task"], line["length"], line["max_new_tokens"]) == \
            (sample.task, sample.length, sample.answer_tokens)
        # The plain template (the byte tokenizer has no chat template): the texts are the ids.
        assert line["template"] == "plain" and line["chat_head"] == line["chat_tail"] == ""
        assert ByteTokenizer().decode(sample.tokens) == \
            line["context"] + line["question"] + line["answer_prefix"]


class ChatTokenizer(ByteTokenizer):
    """Bytes with a chat template (one that writes its own BOS text, like Gemma's)."""

    bos_token = "<s>"
    chat_template = "<s>[user] {content} [assistant]"

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return f"<s>[user] {messages[0]['content']} [assistant]"


DOCS = [texts.Document(f"g{i}", texts.GETTYSBURG) for i in range(8)]


@pytest.mark.parametrize("task", ["niah_multikey_1", "vt", "fwe"])
def test_a_chat_prompt_splits_into_the_texts_kvpress_takes(task):
    tok = ChatTokenizer()
    chat = ruler.chat_parts(tok, "auto")
    sample = ruler.build_sample(task, tok, "g", DOCS, ruler.vocabulary(DOCS) * 20, 1536, 0, 0, chat)
    line = ruler_export.prompt_line(sample, tok, chat)
    assert line["template"] == "chat" and (line["chat_head"], line["chat_tail"]) == chat
    # kvpress's pipeline: the template around the context, then question + tail + prefix.
    assert tok.decode(sample.tokens) == (line["chat_head"] + line["context"] + line["question"]
                                         + line["chat_tail"] + line["answer_prefix"])
    assert line["question"].startswith("\n") and line["answer_prefix"].startswith(" ")
    assert not line["context"].startswith("<s>")


def test_an_export_line_whose_texts_do_not_give_back_its_ids_is_refused():
    tok = ChatTokenizer()
    chat = ruler.chat_parts(tok, "auto")
    sample = ruler.build_sample("niah_single_1", tok, "g", DOCS, ruler.vocabulary(DOCS), 1024, 0, 0, chat)
    from dataclasses import replace

    with pytest.raises(ValueError, match="decode to"):
        ruler_export.prompt_line(replace(sample, answer_prefix=" Answer:"), tok, chat)
    with pytest.raises(ValueError, match="head ids"):
        ruler_export.prompt_line(replace(sample, context=sample.context[3:]), tok, chat)


def test_export_prompts_needs_the_ruler_task(tmp_path, capsys):
    args = ["--preset", "smoke", "--tasks", "stream", "--export-prompts", str(tmp_path / "p.jsonl")]
    assert main(args) == 2
    assert "--export-prompts" in capsys.readouterr().err
    assert not (tmp_path / "p.jsonl").exists()


# ---------------------------------------------------------------------------- kvpress records


def test_the_kvpress_runner_scores_with_the_suites_scorer():
    script = _kvpress_script()
    score = script.load_scorer()
    cases = [(" 1234567 and 7654321.", ["1234567", "7654321"]), ("nothing", ["1234567"]),
             ("VAR ABCDE, fghij", ["abcde", "FGHIJ", "KLMNO"]), ("12345\x0067", ["1234567"])]
    assert [score(a, e) for a, e in cases] == [ruler.ruler_score(a, e) for a, e in cases] == \
        [1.0, 0.0, pytest.approx(2 / 3), 0.0]
    assert ruler.ruler_score is ruler_scoring.ruler_score  # one scorer, re-exported by the suite
    assert [script.label_of(r) for r in (0.5, 0.8, 0.9)] == ["50%", "20%", "10%"]


def test_kvpress_records_join_a_camkv_folder_and_pair_with_kvpress_full(tmp_path):
    script = _kvpress_script()
    out = tmp_path / "ruler"
    assert main(SMOKE + ["--out", str(out)]) == 0
    camkv_records = [json.loads(line) for line in (out / "records.jsonl").open()]
    exported = tmp_path / "p.jsonl"
    assert main(SMOKE + ["--out", str(out), "--export-prompts", str(exported)]) == 0
    prompts = ruler_export.read_prompts(exported)
    # Answers standing in for kvpress's: the full cache finds every string, each press half.
    added = []
    for prompt in prompts:
        for press, ratio in script.arms(["none", "snapkv"], [0.5, 0.8]):
            found = prompt["expected"] if press == "none" else prompt["expected"][:1]
            added.append(script.record(prompt, press, ratio, " ".join(found), script.load_scorer()))
    with (out / "records.jsonl").open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in added)
    assert main(["--out", str(out), "--report-only"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    cells = summary["ruler"]["cells"]
    length = prompts[0]["length"]
    assert summary["methods"][-2:] == ["kvpress-full", "kvpress-snapkv"]
    # The full caches count under each label their prompts ran at; snapkv at its own two.
    assert {f"kvpress-full|{length}|{lb}" for lb in ("20%", "50%")} <= set(cells)
    assert f"kvpress-snapkv|{length}|50%" in cells and f"kvpress-snapkv|{length}|20%" in cells
    full = cells[f"kvpress-full|{length}|50%"]
    assert full["ruler"]["average"]["mean"] == 1.0 and "vs_full" not in full["ruler"]
    snap = cells[f"kvpress-snapkv|{length}|50%"]
    expected_mean = sum(r["score"] for r in added if r["method"] == "kvpress-snapkv"
                        and r["budget"] == 0.5) / len(prompts)
    assert snap["ruler"]["average"]["mean"] == pytest.approx(expected_mean)
    # Paired with kvpress's own full cache, not camkv's.
    assert snap["ruler"]["vs_full"]["mean"] == pytest.approx(expected_mean - 1.0)
    camkv_snap = cells[f"snapkv|{length}|50%"]
    camkv_full = summary["ruler"]["cells"][f"full|{length}|50%"]
    assert camkv_snap["ruler"]["vs_full"]["mean"] == pytest.approx(
        camkv_snap["ruler"]["average"]["mean"] - camkv_full["ruler"]["average"]["mean"])
    table = (out / "table.md").read_text()
    assert "| kvpress-snapkv |" in table and "| kvpress-full |" in table
    assert len(report.RecordStore.read_records(out)) == len(camkv_records) + len(added)
