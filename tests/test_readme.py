"""The README's examples run as written: its ```python blocks and its `camkv ...` command
lines, on a tiny random llama (the default model's name is swapped for its folder, so
nothing is downloaded; generation is capped at a few tokens)."""

from __future__ import annotations

import ast
import json
import re
import shlex
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from conftest import subprocess_env

from camkv import models

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def command_lines(text: str) -> list[str]:
    """`camkv ...` commands of the README's indented code lines (also after `.venv/bin/`)."""
    commands = []
    for line in text.splitlines():
        if not line.startswith("    "):
            continue
        match = re.search(r"(?:^|\.venv/bin/)(camkv (?:generate|demo|eval|serve|bench)\b.*)$",
                          line.strip())
        if match:
            commands.append(match.group(1))
    return commands


def _run(argv: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, cwd=cwd, timeout=timeout,
                          env=subprocess_env(CAMKV_BLAS="0"))


def test_the_readme_has_the_examples_this_file_runs():
    assert len(python_blocks(README)) >= 2
    commands = command_lines(README)
    for kind in ("generate", "demo", "eval", "serve"):
        assert any(c.startswith(f"camkv {kind}") for c in commands), kind


@pytest.mark.parametrize("index", range(len(python_blocks(README))))
def test_python_example_runs(index, tiny_model_dir, tmp_path):
    code = python_blocks(README)[index].replace(f'"{models.DEFAULT_MODEL}"', repr(tiny_model_dir))
    assert repr(tiny_model_dir) in code, "the example no longer loads the default model"
    result = _run([sys.executable, "-c", code], tmp_path)
    assert result.returncode == 0, result.stderr
    stats = [line for line in result.stdout.splitlines() if line.startswith("{'tokens_seen'")]
    if "make_prompt_cache" in code:  # the example that prints its cache's counters
        counters = ast.literal_eval(stats[-1])
        # It must show compression: more tokens seen than the budget, and evictions.
        assert counters["tokens_seen"] > counters["budget"]
        assert counters["budget"] <= counters["stored"] <= counters["budget"] * 9 // 8  # + the default slack
        assert counters["evictions"] > 0


def _as_test_command(command: str, model_dir: str) -> list[str]:
    words = shlex.split(command)
    argv = [sys.executable, "-m", "camkv", *words[1:]]
    if words[1] == "generate" and "--help" not in words:
        argv += ["--model", model_dir, "--max-tokens", "8"]
    if words[1] == "demo":
        argv += ["--prompt-tokens", "300", "--max-tokens", "8"]
    return argv


def _serve_and_list(argv: list[str], cwd: Path) -> dict:
    """Start the server, read GET /v1/models, stop it."""
    proc = subprocess.Popen(argv, cwd=cwd, env=subprocess_env(CAMKV_BLAS="0"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    port = argv[argv.index("--port") + 1]
    try:
        for _ in range(300):
            assert proc.poll() is None, proc.stderr.read()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
                    return json.loads(r.read())
            except OSError:
                subprocess.run(["sleep", "0.3"])
        raise AssertionError("the server did not come up")
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


@pytest.mark.parametrize("command", command_lines(README))
def test_command_example_runs(command, tiny_model_dir, tmp_path):
    argv = _as_test_command(command, tiny_model_dir)
    if argv[3] == "serve":
        from test_server import _free_port

        argv[argv.index("--port") + 1] = str(_free_port())
        argv += ["--model", tiny_model_dir, "--host", "127.0.0.1"]
        listed = _serve_and_list(argv, tmp_path)
        assert [m["id"] for m in listed["data"]] == [tiny_model_dir]
        return
    result = _run(argv, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    if argv[3] == "generate" and "--help" not in argv:
        assert re.search(r"KV held: .* \| evictions: \d+", result.stderr), result.stderr
    if argv[3] == "eval":
        assert "| method |" in result.stdout  # the summary table, printed at the end
        assert (tmp_path / "camkv-eval-smoke" / "summary.json").is_file()


def test_the_configuration_table_lists_every_camconfig_field_with_its_default():
    import dataclasses

    from camkv import CaMConfig

    table = README[README.index("## Configuration"):]
    rows = re.findall(r"^\| `(\w+)` \| ([^|]+) \|", table, flags=re.M)
    fields = {f.name: f.default for f in dataclasses.fields(CaMConfig)}
    assert [name for name, _ in rows] == list(fields)
    for name, shown in rows:
        if fields[name] is not None:  # recent and slack show what their None means
            assert shown.strip().strip("`") == repr(fields[name]).replace("'", '"'), name
