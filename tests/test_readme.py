"""The README's examples run as written: its ```python blocks and its `camkv ...` command
lines, on a tiny random llama (the default model's name is swapped for its folder, so
nothing is downloaded)."""

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

from camkv import CaMConfig, models

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
        # It must show what the text says: compression (more tokens seen than the budget,
        # evictions), and stored within the bound the text states, budget + slack.
        slack = CaMConfig(budget=counters["budget"]).slack
        assert counters["tokens_seen"] > counters["budget"] and counters["evictions"] > 0
        assert counters["budget"] <= counters["stored"] <= counters["budget"] + slack
        bound = f"budget + slack = {counters['budget']} + {slack} = {counters['budget'] + slack}"
        assert bound in " ".join(README.split()), bound  # the text states the bound it shows


def test_the_quick_start_figures_are_a_run_within_its_bound():
    """The counters the README quotes for its first example: compressed, within budget + slack."""
    quoted = re.search(r"`\{'tokens_seen': (\d+), \.\.\., 'evictions': (\d+), \.\.\., "
                       r"'stored': (\d+), 'budget': (\d+)\}`", README)
    assert quoted, "the README no longer quotes the example's counters"
    seen, evictions, stored, budget = map(int, quoted.groups())
    assert seen > budget and evictions > 0
    assert budget <= stored <= budget + CaMConfig(budget=budget).slack


def _as_test_command(command: str, model_dir: str) -> list[str]:
    words = shlex.split(command)
    argv = [sys.executable, "-m", "camkv", *words[1:]]
    if words[1] == "generate" and "--help" not in words:
        # As many tokens as the example generates (the tiny model is fast), so that an
        # example with a --kv-budget compresses here as it does with the real model.
        argv += ["--model", model_dir]
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
        evictions = re.search(r"KV held: .* \| evictions: (\d+)", result.stderr)
        assert evictions, result.stderr
        if "--kv-budget" in argv:  # an example that sets a budget shows it compressing
            assert int(evictions.group(1)) > 0, result.stderr
    if argv[3] == "eval":
        assert "| method |" in result.stdout  # the summary table, printed at the end
        summary = json.loads((tmp_path / "camkv-eval-smoke" / "summary.json").read_text())
        # What the text says it checks: the full cache matches itself, a compressed arm does not.
        decode = summary["stream"]["decode"]
        assert decode["full"]["20%"]["kl"] == 0 and decode["full"]["20%"]["top1"] == 1
        assert decode["streamingllm"]["20%"]["kl"] > 0


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
