"""What a new user meets around the main commands: the server under its default model's
name, benches and evals without matplotlib, progress on long prompts, the OpenBLAS note."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request

import pytest

from conftest import subprocess_env
from gguf_fixtures import write_tiny_gguf
from test_server import _free_port, _wait_until_up

from camkv import cli, models
from camkv.eval import bench as benchmarks
from camkv.eval import cli as quality


@pytest.fixture(scope="module")
def cache_dir_with_default_model(tmp_path_factory):
    """A CAMKV_CACHE_DIR whose converted default model is a tiny random llama (no download)."""
    root = tmp_path_factory.mktemp("camkv-cache")
    write_tiny_gguf(root / "tiny.gguf")
    models.convert_gguf(root / "tiny.gguf", root / "models" / f"{models.DEFAULT_MODEL}-float32")
    return root


def _post(port: int, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, {"error": err.read().decode()}


def test_serve_defaults_to_the_default_model_and_answers_to_its_name(cache_dir_with_default_model):
    port = _free_port()
    env = subprocess_env(CAMKV_BLAS="0", CAMKV_CACHE_DIR=str(cache_dir_with_default_model),
                         HF_HUB_OFFLINE="1")
    proc = subprocess.Popen([sys.executable, "-m", "camkv", "serve", "--kv-budget", "32",
                             "--host", "127.0.0.1", "--port", str(port)],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    try:
        _wait_until_up(port, proc)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as r:
            listed = json.loads(r.read())
        assert [m["id"] for m in listed["data"]] == [models.DEFAULT_MODEL]
        message = {"messages": [{"role": "user", "content": "hello " * 30}], "max_tokens": 4}
        for named in ({"model": models.DEFAULT_MODEL}, {}):  # as an OpenAI client sends it, or not
            status, reply = _post(port, {**message, **named})
            assert status == 200, reply
            assert reply["usage"]["completion_tokens"] > 0
    finally:
        proc.terminate()
        log = proc.communicate(timeout=30)[1]
    assert "Traceback" not in log, log
    assert "request cache has 2/2 CaMKVCache layers (budget=32" in log


def _without_matplotlib(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails


def test_bench_without_matplotlib_still_prints_its_table(tmp_path, capsys, monkeypatch):
    _without_matplotlib(monkeypatch)
    monkeypatch.setattr(benchmarks, "_NOTED", [])
    benchmarks.main(["--model", "random-tiny", "--prompt-lengths", "40", "--budgets", "32",
                     "--gen-tokens", "2", "--trials", "1", "--prefill-step", "32", "--soak", "8",
                     "--backend", "reference", "--out", str(tmp_path), "--tag", "t"])
    captured = capsys.readouterr()
    assert "camkv-32 @ 40" in captured.out  # the table
    assert captured.err.count("matplotlib is not installed") == 1
    assert (tmp_path / "t.json").is_file() and not list(tmp_path.glob("*.png"))


def test_eval_without_matplotlib_says_no_plots_and_prints_the_table(tmp_path, capsys, monkeypatch):
    _without_matplotlib(monkeypatch)
    monkeypatch.chdir(tmp_path)
    args = ["--preset", "smoke", "--no-progress", "--tasks", "passkey", "--budgets", "50%",
            "--passkey-placements", "1", "--methods", "h2o"]
    assert quality.main(args) == 0
    captured = capsys.readouterr()
    out = tmp_path / "camkv-eval-smoke"  # the current folder's, not ./bench/results
    assert (out / "summary.json").is_file() and not list(out.glob("*.png"))
    assert "| h2o |" in captured.out
    assert f"camkv eval: wrote {out}/: summary.json, table.md (no plots)" in captured.out
    assert "and plots" not in captured.out + captured.err


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> str:
    tmp = tmp_path_factory.mktemp("long")
    write_tiny_gguf(tmp / "tiny.gguf")  # its config says max_position_embeddings 2048
    return str(models.convert_gguf(tmp / "tiny.gguf", tmp / "model"))


def test_a_prompt_past_the_context_warns_and_shows_prefill_progress(capsys, tiny_model_dir):
    long_prompt = "hello world " * 1100  # over 2200 tokens of the tiny tokenizer
    assert cli.main(["generate", "--model", tiny_model_dir, "--prompt", long_prompt,
                     "--chat-template", "off", "--max-tokens", "2", "--kv-budget", "64"]) == 0
    err = capsys.readouterr().err
    warning = re.search(r"the prompt reaches (\d+) tokens .* past the model's context of 2048", err)
    assert warning, err
    total = warning.group(1)
    assert int(total) > 2200
    steps = re.findall(rf"camkv: prompt (\d+)/{total} tokens processed", err)
    assert steps[0] == "0" and steps[-1] == total and len(steps) >= 3, steps
    assert f"prompt: {total} tokens" in err


def test_a_short_prompt_shows_neither(capsys, tiny_model_dir):
    assert cli.main(["generate", "--model", tiny_model_dir, "--prompt", "hello",
                     "--max-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert "tokens processed" not in err and "past the model's context" not in err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OpenBLAS is looked for on Linux")
def test_the_openblas_note_comes_once_and_only_before_real_work(tmp_path):
    env = subprocess_env(CAMKV_BLAS=str(tmp_path / "no-openblas.so.0"))  # as if none were installed

    def stderr_of(*argv):
        return subprocess.run([sys.executable, "-m", "camkv", *argv], capture_output=True,
                              text=True, env=env, timeout=300).stderr

    for quiet in (["--help"], ["generate", "--help"], ["demo", "--kv-budget", "0"],
                  ["eval", "--plan"]):
        assert "OpenBLAS" not in stderr_of(*quiet), quiet
    # `python -m camkv` re-runs itself when OpenBLAS is found; missing, it says so once.
    err = stderr_of("demo", "--prompt-tokens", "40", "--max-tokens", "2", "--kv-budget", "32")
    assert err.count("no OpenBLAS found") == 1, err
