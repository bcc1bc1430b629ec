"""The camkv command: help on every flag, demo, generate on a tiny model, bad values,
and batch generation refusing camkv loudly."""

from __future__ import annotations

import argparse
import io
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from conftest import subprocess_env

import camkv
from camkv import cli, hook, models

SUMMARY = re.compile(
    r"prompt: (\d+) tokens, [\d.]+ tokens/s \| generation: (\d+) tokens, [\d.]+ tokens/s \| "
    r"peak memory: [\d.]+ GB \| KV held: ([\d.]+) MB vs ([\d.]+) MB for a full cache \((\d+)%\) \| "
    r"evictions: (\d+), merges: (\d+)")
SMALL_KV = ["--kv-budget", "24", "--kv-sinks", "2", "--kv-recent", "4"]
ALL_BY_QUERIES = "| scoring: query, 100% of tokens by the model's queries"


def _main_scoring_with_queries(argv) -> int:
    """cli.main, failing on any fallback to key scoring; the hook must be out afterwards."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", camkv.QueryScoringWarning)
        code = cli.main(argv)
    assert not hook.installed_modules(), "the CLI left camkv's attention hook installed"
    return code


def _summary(text: str) -> dict:
    match = SUMMARY.search(text)
    assert match, f"no summary line in:\n{text}"
    keys = ("prompt", "generation", "held_mb", "full_mb", "percent", "evictions", "merges")
    return dict(zip(keys, map(float, match.groups())))


def _subparsers(parser):
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]  # noqa: SLF001
    return actions[0].choices


def test_every_flag_of_every_command_has_help():
    parser = cli.build_parser()
    commands = _subparsers(parser)
    assert set(commands) == {"generate", "demo", "serve", "bench", "eval"}
    for name, sub in [("camkv", parser), *commands.items()]:
        for action in sub._actions:  # noqa: SLF001
            if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
                continue
            assert action.help and len(action.help) > 10, f"{name} {action.option_strings} lacks help"
    flags = {f for a in commands["generate"]._actions for f in a.option_strings}  # noqa: SLF001
    for flag in ("--model", "--prompt", "--prompt-file", "--max-tokens", "--temp", "--top-p",
                 "--seed", "--chat-template", "--kv-budget", "--kv-sinks", "--kv-recent",
                 "--kv-merge", "--kv-gate", "--no-kv-gate", "--kv-prefill", "--kv-backend"):
        assert flag in flags


def test_unknown_flags_are_refused_except_for_serve(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--port", "8080"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --port 8080" in capsys.readouterr().err


def test_python_dash_m_camkv_help_lists_the_commands():
    env = subprocess_env(CAMKV_BLAS="0")
    result = subprocess.run([sys.executable, "-m", "camkv", "--help"], capture_output=True,
                            text=True, env=env, cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0, result.stderr
    assert "generate" in result.stdout and "demo" in result.stdout


def test_demo_compresses_and_reports(capsys):
    assert _main_scoring_with_queries(["demo", "--prompt-tokens", "200", "--max-tokens", "8",
                                       "--kv-budget", "64"]) == 0
    captured = capsys.readouterr()
    summary = _summary(captured.err)  # as generate: the summary on stderr, what was generated on stdout
    assert ALL_BY_QUERIES in captured.err and not SUMMARY.search(captured.out)
    assert summary["prompt"] == 200 and summary["generation"] == 8
    assert summary["held_mb"] < summary["full_mb"] and summary["evictions"] > 0
    assert "generated token ids" in captured.out


def test_demo_with_the_full_cache_holds_everything(capsys):
    assert cli.main(["demo", "--prompt-tokens", "64", "--max-tokens", "4", "--full-cache"]) == 0
    summary = _summary(capsys.readouterr().err)
    assert summary["percent"] == 100 and summary["evictions"] == 0 and summary["merges"] == 0


@pytest.mark.parametrize("argv,named", [
    (["--kv-merge", "blend"], ["--kv-merge", "'blend'", "'sim_weighted'", "'drop'"]),
    (["--kv-budget", "5"], ["--kv-budget", "budget=5"]),
    (["--kv-prefill", "lazy"], ["--kv-prefill", "'lazy'", "'exact'", "'chunk'"]),
    (["--kv-backend", "tpu"], ["--kv-backend", "'tpu'", "'reference'"]),
    (["--kv-seed", "-1"], ["--kv-seed", "-1"]),
    (["--kv-budget", "many"], ["--kv-budget", "'many'"]),
    (["--max-tokens", "0"], ["--max-tokens", ">= 1", "0"]),
])
@pytest.mark.parametrize("command", ["demo", "generate"])
def test_bad_values_exit_2_naming_value_and_allowed(capsys, command, argv, named):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"camkv {command}: error:" in err
    for word in named:
        assert word in err


@pytest.mark.parametrize("argv,named", [
    (["--temp", "-1"], ["--temp", ">= 0", "-1"]),
    (["--top-p", "1.5"], ["--top-p", "(0, 1]", "1.5"]),
    (["--chat-template", "maybe"], ["--chat-template", "'maybe'", "'auto', 'on', 'off'"]),
])
def test_bad_sampling_values_exit_2(capsys, argv, named):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    for word in named:
        assert word in err


def test_generate_streams_and_reports(capsys, tiny_model_dir, remove_hooks):
    argv = ["generate", "--model", tiny_model_dir, "--prompt", "hello world " * 20,
            "--max-tokens", "6", *SMALL_KV]
    assert _main_scoring_with_queries(argv) == 0
    captured = capsys.readouterr()
    summary = _summary(captured.err)
    assert ALL_BY_QUERIES in captured.err  # the default scores with the model's real queries
    assert summary["generation"] == 6 and summary["prompt"] > 24
    assert summary["held_mb"] < summary["full_mb"] and summary["evictions"] > 0
    # The streamed text is what mlx-lm generates with the same camkv cache.
    from mlx_lm import generate, load

    model, tokenizer = load(tiny_model_dir)
    remove_hooks(model)
    cache = camkv.make_prompt_cache(model, budget=24, n_sink=2, recent=4)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hello world " * 20}],
                                           add_generation_prompt=True)
    assert captured.out == generate(model, tokenizer, prompt, max_tokens=6, prompt_cache=cache) + "\n"


def test_a_retired_merge_rule_runs_and_says_it_is_retired(capsys, tiny_model_dir):
    argv = ["generate", "--model", tiny_model_dir, "--prompt", "hello world " * 20, "--max-tokens", "2",
            *SMALL_KV, "--kv-merge", "sim_weighted"]
    assert _main_scoring_with_queries(argv) == 0
    err = capsys.readouterr().err
    assert err.count("--kv-merge 'sim_weighted' is retired") == 1 and "running it as an experiment" in err
    assert "merges: 0" not in err, err.splitlines()[-1]  # it merged


def test_generate_with_key_scoring_says_so(capsys, tiny_model_dir):
    argv = ["generate", "--model", tiny_model_dir, "--prompt", "hello", "--max-tokens", "2",
            *SMALL_KV, "--kv-scoring", "key"]
    assert _main_scoring_with_queries(argv) == 0
    err = capsys.readouterr().err
    assert err.rstrip().endswith("| scoring: key"), err


def test_generate_chat_template_and_prompt_sources(capsys, monkeypatch, tmp_path, tiny_model_dir):
    def prompt_tokens(*extra):
        assert cli.main(["generate", "--model", tiny_model_dir, "--max-tokens", "2", *SMALL_KV,
                         *extra]) == 0
        return _summary(capsys.readouterr().err)["prompt"]

    raw = prompt_tokens("--prompt", "hello", "--chat-template", "off")
    templated = prompt_tokens("--prompt", "hello", "--chat-template", "on")
    assert raw == 1  # "hello" is one merged token
    assert templated > raw  # <|im_start|>user\n...<|im_end|>\n<|im_start|>assistant\n
    (tmp_path / "p.txt").write_text("hello")
    assert prompt_tokens("--prompt-file", str(tmp_path / "p.txt"), "--chat-template", "off") == raw
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello"))
    assert prompt_tokens("--prompt", "-", "--chat-template", "off") == raw


def test_generate_saves_and_continues_a_prompt_cache(capsys, tmp_path, tiny_model_dir):
    saved = tmp_path / "story.safetensors"
    base = ["generate", "--model", tiny_model_dir, "--chat-template", "off", "--max-tokens", "4"]
    assert _main_scoring_with_queries([*base, *SMALL_KV, "--prompt", "hello world " * 20,
                                       "--save-prompt-cache", str(saved)]) == 0
    first = _summary(capsys.readouterr().err)
    # The loaded layers score with queries too (the CLI installs the hook for them).
    assert _main_scoring_with_queries([*base, "--prompt", " world", "--prompt-cache-file",
                                       str(saved)]) == 0
    captured = capsys.readouterr()
    second = _summary(captured.err)
    assert ALL_BY_QUERIES in captured.err
    assert second["prompt"] == 1  # only the new text is processed
    assert second["evictions"] > first["evictions"]  # the loaded counters carry on
    # The text is what mlx-lm generates from the same loaded cache.
    from mlx_lm import generate, load

    model, tokenizer = load(tiny_model_dir)
    with camkv.applied(model):  # the attention hook: the loaded layers score with queries, as in the CLI
        expected = generate(model, tokenizer, " world", max_tokens=4,
                            prompt_cache=camkv.load_prompt_cache(str(saved)))
    assert captured.out == expected + "\n"


def test_generate_with_a_missing_model_is_a_clear_error(capsys, tmp_path):
    for missing in (tmp_path / "nowhere.gguf", tmp_path / "no-folder"):
        assert cli.main(["generate", "--model", str(missing), "--prompt", "x"]) == 2
        err = capsys.readouterr().err
        assert f"camkv: error: no model at {missing}" in err and "Traceback" not in err


def test_batch_generate_keeps_camkv_instead_of_silently_dropping_it(tiny_model_dir):
    # Batching must never fall back to a full cache: every returned layer is camkv's.
    from mlx_lm import batch_generate, load

    model, tokenizer = load(tiny_model_dir)
    prompts = [tokenizer.encode("hello world " * 8), tokenizer.encode("world hello")]
    with camkv.applied(model, budget=24, n_sink=2, recent=4):
        result = batch_generate(model, tokenizer, prompts, max_tokens=4, return_prompt_caches=True)
    assert all(isinstance(c, camkv.CaMKVCache) for caches in result.caches for c in caches)
    assert result.caches[0][0].stats["evictions"] > 0


def test_full_cache_bytes_are_the_keys_and_values_of_the_tokens_seen():
    # camkv's "full cache" figure is the bytes of the keys and values themselves: a
    # KVCache fed the same tokens holds them in its first `tokens` slots (its buffer
    # grows in steps of 256, which must not count, or a short prompt looks compressed).
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    for tokens in (1, 100, 256, 300):
        keys = mx.random.normal((1, 2, tokens, 16))
        values = mx.random.normal((1, 2, tokens, 8))
        full, cam = KVCache(), camkv.CaMKVCache(budget=512, scoring="key")
        full.update_and_fetch(keys, values)
        cam.update_and_fetch(keys, values)
        held = full.keys[..., :tokens, :].nbytes + full.values[..., :tokens, :].nbytes
        assert cli.full_cache_bytes(cam) == held == tokens * 2 * (16 + 8) * 4, tokens


def test_nothing_evicted_reads_as_no_compression(capsys, tiny_model_dir):
    # A short prompt under the budget: the summary must not claim a saving.
    assert cli.main(["generate", "--model", tiny_model_dir, "--prompt", "hello",
                     "--max-tokens", "2", "--kv-budget", "256"]) == 0
    summary = _summary(capsys.readouterr().err)
    assert summary["evictions"] == 0
    assert summary["percent"] >= 100  # keys and values, plus camkv's scores and positions


def test_openblas_choice_follows_camkv_blas(monkeypatch, tmp_path):
    from camkv import _blas

    fake = tmp_path / "libopenblas.so.0"
    fake.write_bytes(b"")
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setenv("CAMKV_BLAS", "0")
    assert _blas.find_openblas() is None
    monkeypatch.setenv("CAMKV_BLAS", str(fake))
    assert _blas.find_openblas() == str(fake)
    monkeypatch.setenv("CAMKV_BLAS", str(tmp_path / "missing.so"))
    assert _blas.find_openblas() is None
    # mlx is imported in this process: too late to swap its BLAS in place.
    monkeypatch.setenv("CAMKV_BLAS", str(fake))
    assert _blas.preload() is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps (Linux)")
def test_bound_tells_whether_openblas_is_mapped_into_the_process():
    """The suite runs only under MLX's own BLAS (tests/conftest.py stops a run where bound()
    is True): bound() must see an OpenBLAS put in place by LD_PRELOAD, and none without it."""
    from camkv import _blas

    library = _blas.find_openblas()
    if library is None:
        pytest.skip("no OpenBLAS installed")
    probe = [sys.executable, "-c", "import mlx.core; from camkv import _blas; print(_blas.bound())"]
    env = {k: v for k, v in subprocess_env().items() if k != "LD_PRELOAD"}
    without = subprocess.run(probe, env=env, capture_output=True, text=True, check=True).stdout.strip()
    with_it = subprocess.run(probe, env={**env, "LD_PRELOAD": library}, capture_output=True, text=True,
                             check=True).stdout.strip()
    assert (without, with_it) == ("False", "True")


def test_a_cpu_command_without_openblas_says_why_it_is_slow(monkeypatch, tmp_path, capsys):
    from camkv import _blas

    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setenv("CAMKV_BLAS", str(tmp_path / "missing.so"))
    monkeypatch.setattr(_blas, "_runs_on_cpu", lambda: True)
    _blas.reexec_with_openblas()  # nothing to load: returns, after the hint
    assert "libopenblas0-pthread" in capsys.readouterr().err
    monkeypatch.setenv("CAMKV_BLAS", "0")  # turned off on purpose: silent
    _blas.reexec_with_openblas()
    assert capsys.readouterr().err == ""


def test_every_camconfig_field_has_its_kv_flag_with_the_fields_default():
    import dataclasses

    from camkv import CaMConfig
    from camkv.cli import _KV_FLAGS, build_parser

    args = build_parser().parse_args(["generate", "--prompt", "x"])
    assert sorted(_KV_FLAGS.values()) == sorted(f.name for f in dataclasses.fields(CaMConfig))
    for dest, field in _KV_FLAGS.items():
        assert getattr(args, dest) == getattr(CaMConfig, field), dest  # the class default (None for derived ones)
    assert build_parser().parse_args(["generate", "--prompt", "x", "--kv-slack", "0"]).kv_slack == 0


def test_the_descriptions_say_the_default_drops():
    """`camkv --help` and the package say what the default does: evicted tokens are dropped."""
    import tomllib

    help_text = cli.build_parser().description
    assert "dropping them (the default" in help_text and "instead of dropping" not in help_text
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    assert "dropping the rest (H2O) or merging them" in project["description"]
