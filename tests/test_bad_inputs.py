"""Bad input through the CLI and the Python API: each is refused with a message naming the
value and what is allowed, status 2 from the CLI, before any model loads, and nothing
changes (no file written, a cache's state as it was)."""

from __future__ import annotations

import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from conftest import subprocess_env
from gguf_fixtures import write_tiny_gguf
from tiny_models import tiny_llama

import camkv
from camkv import backends, cli, gguf, hook, models

UNAVAILABLE = [name for name, why in backends.available().items() if why is not None]


# --------------------------------------------------------------------------- files


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    """Good and bad files of each kind the CLI reads."""
    tmp = tmp_path_factory.mktemp("bad")
    write_tiny_gguf(tmp / "good.gguf")
    good_gguf = (tmp / "good.gguf").read_bytes()
    (tmp / "random.gguf").write_bytes(np.random.default_rng(0).bytes(4096))
    (tmp / "truncated.gguf").write_bytes(good_gguf[: len(good_gguf) // 2])
    # A valid magic and version, then a tensor count no file could hold: MLX's own reader
    # crashes the process on this one (segmentation fault).
    (tmp / "header.gguf").write_bytes(good_gguf[:8] + struct.pack("<Q", 1 << 40) + good_gguf[16:])
    (tmp / "dims.gguf").write_bytes(good_gguf[:8] + struct.pack("<Q", 1000) + good_gguf[16:])
    cache = camkv.CaMKVCache(budget=24, n_sink=2, recent=4, scoring="key")
    cache.update_and_fetch(mx.ones((1, 2, 40, 8)), mx.ones((1, 2, 40, 8)))
    camkv.save_prompt_cache(str(tmp / "cache.safetensors"), [cache, cache])
    from mlx_lm.models.cache import KVCache

    full = KVCache()
    full.update_and_fetch(mx.ones((1, 2, 40, 8)), mx.ones((1, 2, 40, 8)))
    camkv.save_prompt_cache(str(tmp / "full-cache.safetensors"), [full])
    saved = (tmp / "cache.safetensors").read_bytes()
    (tmp / "cache-truncated.safetensors").write_bytes(saved[: len(saved) // 2])
    (tmp / "cache-random.safetensors").write_bytes(np.random.default_rng(1).bytes(2048))
    mx.save_safetensors(str(tmp / "model.safetensors"), {"w": mx.zeros((4, 4))})
    (tmp / "notes.txt").write_text("not a model")
    (tmp / "empty.txt").write_text("  \n")
    (tmp / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    (tmp / "folder").mkdir()
    (tmp / "nul.txt").write_bytes(b"\0" * 64)
    (tmp / "bad-config").mkdir()
    (tmp / "bad-config" / "config.json").write_text('{model_type: "llama"}')
    weights = models.convert_gguf(tmp / "good.gguf", tmp / "truncated-weights") / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    camkv.save_prompt_cache(str(tmp / "cache-other-model.safetensors"), [cache, cache],
                            metadata={"model": "other-model"})
    camkv.save_prompt_cache(str(tmp / "cache-3-layers.safetensors"), [cache] * 3)
    return {p.name: str(p) for p in tmp.iterdir()} | {"dir": str(tmp)}


def _fill(text: str, files: dict) -> str:
    """'{name}' -> the path of that file ('{dir}': their folder)."""
    return re.sub(r"\{([^}]+)\}", lambda m: files[m.group(1)], text)


def _snapshot(folder: str) -> dict:
    return {p: Path(folder, p).stat().st_size for p in sorted(os.listdir(folder))}


def _refused(capsys, argv: list[str]) -> str:
    """cli.main on argv must exit with status 2 and no traceback; returns stderr."""
    try:
        code = cli.main(argv)
    except SystemExit as exit_info:
        code = exit_info.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and "error:" in err
    assert not hook.installed_modules()
    return err


# --------------------------------------------------------------------------- the CLI

NEVER_LOADED = "/nonexistent/never-loaded-model"

# (argv after `camkv generate --model NEVER_LOADED`, words the message must hold)
GENERATE_CASES = {
    "budget zero": (["--kv-budget", "0"], ["--kv-budget", "0", ">= 1"]),
    "budget word": (["--kv-budget", "many"], ["--kv-budget", "'many'"]),
    "sinks negative": (["--kv-sinks", "-1"], ["--kv-sinks", "-1"]),
    "recent zero": (["--kv-recent", "0"], ["--kv-recent", "0"]),
    "sinks+recent over budget": (["--kv-budget", "10", "--kv-sinks", "4", "--kv-recent", "6"],
                                 ["budget", "4 + 6 = 10"]),
    "merge unknown": (["--kv-merge", "blend"], ["--kv-merge", "'blend'", "'drop'"]),
    "window zero": (["--kv-window", "0"], ["--kv-window", "0"]),
    "seed too big": (["--kv-seed", str(2**32)], ["--kv-seed", str(2**32)]),
    "scoring unknown": (["--kv-scoring", "attention"], ["--kv-scoring", "'attention'", "'query'"]),
    "prefill unknown": (["--kv-prefill", "lazy"], ["--kv-prefill", "'lazy'", "'chunk'"]),
    "backend unknown": (["--kv-backend", "tpu"], ["--kv-backend", "'tpu'", "'reference'"]),
    "merge keys with window": (["--kv-merge", "window", "--kv-merge-keys"], ["--kv-merge-keys", "window"]),
    "sinks and recent fill the budget": (["--kv-budget", "64", "--kv-recent", "64"],
                                         ["--kv-sinks + --kv-recent = 4 + 64 = 68", "--kv-budget=64"]),
    "sampler seed negative": (["--seed", "-1"], ["--seed", "-1", "0..4294967295"]),
    "sampler seed past uint32": (["--seed", str(2**32)], ["--seed", str(2**32), "0..4294967295"]),
    "temp nan": (["--temp", "nan"], ["--temp", "nan", "finite number >= 0"]),
    "temp infinite": (["--temp", "inf"], ["--temp", "inf", "finite number >= 0"]),
    "top-p nan": (["--top-p", "nan"], ["--top-p", "nan", "(0, 1]"]),
    "max tokens zero": (["--max-tokens", "0"], ["--max-tokens", ">= 1", "0"]),
    "max tokens negative": (["--max-tokens", "-5"], ["--max-tokens", "-5"]),
    "temp negative": (["--temp", "-0.5"], ["--temp", ">= 0", "-0.5"]),
    "top-p zero": (["--top-p", "0"], ["--top-p", "(0, 1]", "0"]),
    "top-p above one": (["--top-p", "1.5"], ["--top-p", "(0, 1]", "1.5"]),
    "chat template unknown": (["--chat-template", "maybe"], ["--chat-template", "'maybe'", "'auto'"]),
    "dtype unknown": (["--dtype", "int8"], ["--dtype", "'int8'", "float32"]),
    "empty prompt": (["--prompt", ""], ["--prompt ''", "empty"]),
    "blank prompt": (["--prompt", "  \n "], ["--prompt", "empty"]),
    "prompt and file": (["--prompt", "x", "--prompt-file", "p.txt"], ["--prompt-file", "--prompt"]),
    "full cache with kv flag": (["--full-cache", "--kv-budget", "64"], ["--full-cache", "--kv-budget"]),
    "full cache with kv switch": (["--full-cache", "--no-kv-gate"], ["--full-cache", "--kv-gate"]),
    "unknown flag": (["--kv-bitz", "4"], ["unrecognized arguments: --kv-bitz 4"]),
    "kv bits unknown": (["--kv-bits", "3"], ["--kv-bits", "3", "8, 4"]),
    "kv group size unknown": (["--kv-bits", "4", "--kv-group-size", "48"], ["--kv-group-size", "48", "32, 64, 128"]),
    "kv bytes not a count": (["--kv-bytes", "64XB"], ["--kv-bytes", "'64XB'", "MiB"]),
    "kv tier bits unknown": (["--kv-tier-budget", "64", "--kv-tier-bits", "5"], ["--kv-tier-bits", "5", "2, 3, 4"]),
    "kv tier with a merge": (["--kv-tier-budget", "64", "--kv-merge", "mean"], ["--kv-tier-budget=64", "--kv-merge='drop'"]),
    "kv bytes zero": (["--kv-bytes", "0"], ["--kv-bytes", "at least 1", "'0'"]),
    "kv bytes and budget": (["--kv-bytes", "1MiB", "--kv-budget", "64"], ["--kv-bytes '1MiB'", "--kv-budget"]),
    "kv bytes and full cache": (["--kv-bytes", "1MiB", "--full-cache"], ["--kv-bytes '1MiB'", "--full-cache"]),
}


@pytest.mark.parametrize("case", GENERATE_CASES)
def test_generate_refuses(capsys, case):
    argv, words = GENERATE_CASES[case]
    err = _refused(capsys, ["generate", "--model", NEVER_LOADED, *argv])
    for word in words:
        assert word in err, (word, err)
    # The message names flags, not CaMConfig's fields (n_sink is --kv-sinks).
    assert "CaMConfig." not in err and "n_sink" not in err and "merge_keys" not in err, err


@pytest.mark.parametrize("backend", UNAVAILABLE)
def test_generate_refuses_a_backend_this_machine_lacks_before_loading(capsys, backend):
    err = _refused(capsys, ["generate", "--model", NEVER_LOADED, "--kv-backend", backend])
    reason = backends.available()[backend]
    assert f"--kv-backend '{backend}'" in err and reason in err and "'reference'" in err


# (argv after `camkv generate --model NEVER_LOADED`, with {name} for files; words)
FILE_CASES = {
    "prompt file missing": (["--prompt-file", "{dir}/missing.txt"],
                            ["--prompt-file", "missing.txt", "No such file"]),
    "prompt file not utf-8": (["--prompt-file", "{latin1.txt}"], ["latin1.txt", "not UTF-8"]),
    "prompt file is a folder": (["--prompt-file", "{folder}"], ["--prompt-file", "folder"]),
    "prompt file blank": (["--prompt-file", "{empty.txt}"], ["empty.txt", "empty"]),
    "prompt file endless": (["--prompt-file", "/dev/zero"],
                            ["/dev/zero", f"longer than {cli.PROMPT_MAX_BYTES} bytes"]),
    "prompt file of NUL bytes": (["--prompt-file", "{nul.txt}"], ["nul.txt", "NUL bytes"]),
    "cache of another model": (["--prompt-cache-file", "{cache-other-model.safetensors}"],
                               ["cache-other-model.safetensors", "--model 'other-model'",
                                f"not --model '{NEVER_LOADED}'"]),
    "save to missing folder": (["--save-prompt-cache", "{dir}/no/such/x.safetensors"],
                               ["--save-prompt-cache", "no/such", "does not exist"]),
    "save onto a folder": (["--save-prompt-cache", "{folder}"], ["--save-prompt-cache", "is a folder"]),
    "cache file missing": (["--prompt-cache-file", "{dir}/none.safetensors"],
                           ["none.safetensors", "does not exist"]),
    "cache file is a folder": (["--prompt-cache-file", "{folder}"], ["folder", "a folder"]),
    "cache file truncated": (["--prompt-cache-file", "{cache-truncated.safetensors}"],
                             ["cache-truncated.safetensors", "truncated"]),
    "cache file random": (["--prompt-cache-file", "{cache-random.safetensors}"],
                          ["cache-random.safetensors", "not a readable safetensors"]),
    "cache file of weights": (["--prompt-cache-file", "{model.safetensors}"],
                              ["model.safetensors", "not a prompt cache"]),
    "cache file is a gguf": (["--prompt-cache-file", "{good.gguf}"], ["good.gguf", "safetensors"]),
    "cache with other budget": (["--prompt-cache-file", "{cache.safetensors}", "--kv-budget", "64"],
                                ["--kv-budget 64", "budget=24"]),
    "cache with other merge": (["--prompt-cache-file", "{cache.safetensors}", "--kv-merge", "mean"],
                               ["--kv-merge 'mean'", "merge='drop'"]),
    "kv flag with mlx-lm's cache": (["--prompt-cache-file", "{full-cache.safetensors}",
                                     "--kv-budget", "64"], ["--kv-budget", "mlx-lm's own caches"]),
    "cache with full cache": (["--prompt-cache-file", "{cache.safetensors}", "--full-cache"],
                              ["--full-cache", "camkv layers"]),
}


@pytest.mark.parametrize("case", FILE_CASES)
def test_generate_refuses_bad_files_and_changes_nothing(capsys, files, case):
    argv, words = FILE_CASES[case]
    argv = [_fill(a, files) for a in argv]
    before = _snapshot(files["dir"])
    err = _refused(capsys, ["generate", "--model", NEVER_LOADED, *argv])
    for word in words:
        assert word in err, (word, err)
    assert _snapshot(files["dir"]) == before


def test_kv_flags_that_match_the_prompt_cache_are_accepted(files):
    args = cli.build_parser().parse_args(
        ["generate", "--prompt-cache-file", files["cache.safetensors"], "--kv-budget", "24"])
    args.explicit_kv = ["kv_budget"]
    cli._check_prompt_cache_file(args.command_parser, args)  # noqa: SLF001
    assert args.loaded_cache[0].config.budget == 24


# (--model value with {name} for files; words)
MODEL_CASES = {
    "unknown name": ("smollm3-does-not-exist", ["'smollm3-does-not-exist'", "neither",
                                                models.DEFAULT_MODEL, "owner/name"]),
    "missing gguf": ("{dir}/missing.gguf", ["no model at", "missing.gguf"]),
    "random gguf": ("{random.gguf}", ["random.gguf", "magic 'GGUF'"]),
    "truncated gguf": ("{truncated.gguf}", ["truncated.gguf", "past the end of the file"]),
    "gguf with too many tensors": ("{header.gguf}", ["header.gguf", "tensor count 1099511627776"]),
    "gguf with a bad tensor table": ("{dims.gguf}", ["dims.gguf", "dimensions"]),
    "text file": ("{notes.txt}", ["notes.txt", "not a .gguf file"]),
    "folder without config": ("{folder}", ["folder", "config.json"]),
    "empty": ("", ["--model is empty", "owner/name"]),
    "config.json not JSON": ("{bad-config}", ["bad-config/config.json", "not valid JSON"]),
    "truncated weights": ("{truncated-weights}", ["could not load --model", "truncated-weights",
                                                  "cannot be read", "truncated"]),
}


@pytest.mark.parametrize("case", MODEL_CASES)
def test_generate_refuses_bad_models(capsys, files, case, monkeypatch, tmp_path):
    monkeypatch.setenv("CAMKV_CACHE_DIR", str(tmp_path))  # nothing converted lands elsewhere
    model, words = MODEL_CASES[case]
    err = _refused(capsys, ["generate", "--model", _fill(model, files), "--prompt", "x"])
    for word in words:
        assert word in err, (word, err)
    assert not any(tmp_path.iterdir()), "a refused model left files in the cache folder"


def test_a_corrupt_gguf_header_is_an_error_not_a_crash(files):
    # In a child process: MLX's reader segfaults on this file, which would kill pytest.
    result = subprocess.run(
        [sys.executable, "-m", "camkv", "generate", "--model", files["header.gguf"], "--prompt", "x"],
        capture_output=True, text=True, env=subprocess_env(CAMKV_BLAS="0"), timeout=120)
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "header.gguf is not a valid GGUF file" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("argv,words", [
    (["demo", "--prompt-tokens", "0"], ["--prompt-tokens", ">= 1", "0"]),
    (["demo", "--kv-budget", "2"], ["--kv-budget", "2"]),
    (["serve", "--kv-bits", "5"], ["--kv-bits", "5", "8, 4"]),
    (["serve", "--kv-bytes", "many"], ["--kv-bytes", "'many'"]),
    (["serve", "--kv-bytes", "1MiB", "--kv-budget", "64"], ["--kv-bytes '1MiB'", "--kv-budget"]),
    (["serve", "--kv-bits=8", "--quantized-kv-start", "0"], ["--quantized-kv-start", "from the first token"]),
    (["serve", "--full-cache"], ["--full-cache", "mlx_lm.server"]),
    (["serve", "--kv-merge", "blend"], ["--kv-merge", "'blend'"]),
    (["bench", "--gen-tokens", "x"], ["--gen-tokens", "'x'"]),
    (["bench", "--budgets", "0"], ["--budgets", ">= 1", "[0]"]),
    (["bench", "--prompt-lengths", "0", "512"], ["--prompt-lengths", ">= 1", "[0, 512]"]),
    (["bench", "--trials", "0"], ["--trials", ">= 1", "0"]),
    (["demo", "--seed", "-1"], ["--seed", "-1", "0..4294967295"]),
    (["serve", "--port", "99999"], ["--port", "'99999'", "1..65535"]),
    (["serve", "--port=0"], ["--port", "'0'", "1..65535"]),
    (["serve", "--prefill-round-tokens", "0"], ["--prefill-round-tokens", ">= 1", "0"]),
])
def test_other_commands_refuse(capsys, argv, words):
    err = _refused(capsys, argv)
    for word in words:
        assert word in err, (word, err)


def test_a_prompt_cache_of_another_shape_is_refused_naming_file_and_model(capsys, files, tiny_model_dir):
    # No model named in the file (saved from Python): the layers are compared once it loads.
    assert cli.main(["generate", "--model", tiny_model_dir, "--prompt", "x",
                     "--prompt-cache-file", files["cache-3-layers.safetensors"]]) == 2
    err = capsys.readouterr().err
    assert "cache-3-layers.safetensors holds 3 layers" in err and f"--model {tiny_model_dir!r} has 2 layers" in err
    assert "Traceback" not in err and not hook.installed_modules()


def test_a_prompt_cache_saved_without_its_suffix_is_found_where_it_was_written(capsys, tmp_path,
                                                                              tiny_model_dir):
    base = ["generate", "--model", tiny_model_dir, "--chat-template", "off", "--max-tokens", "2"]
    assert cli.main([*base, "--prompt", "hello " * 10, "--save-prompt-cache", str(tmp_path / "story")]) == 0
    assert f"camkv: prompt cache saved to {tmp_path / 'story.safetensors'}" in capsys.readouterr().err
    assert cli.main([*base, "--prompt", " world", "--prompt-cache-file", str(tmp_path / "story")]) == 0


def test_an_empty_prompt_on_stdin_is_refused(capsys, monkeypatch, files):
    import io

    write_tiny_gguf(Path(files["dir"]) / "stdin.gguf")
    model_dir = models.convert_gguf(Path(files["dir"]) / "stdin.gguf", Path(files["dir"]) / "m")
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n"))
    assert cli.main(["generate", "--model", str(model_dir), "--prompt", "-"]) == 2
    err = capsys.readouterr().err
    assert "--prompt - (stdin) is empty" in err
    assert not hook.installed_modules()


# --------------------------------------------------------------------------- the Python API


@pytest.mark.parametrize("fields,words", [
    ({"budget": 0}, ["budget", "0"]),
    ({"budget": "512"}, ["budget", "'512'"]),
    ({"budget": 2.5}, ["budget", "2.5"]),
    ({"n_sink": -1}, ["n_sink", "-1"]),
    ({"recent": 600}, ["budget", "4 + 600"]),
    ({"merge": "blend"}, ["merge", "'blend'"]),
    ({"gate": "yes"}, ["gate", "'yes'"]),
    ({"seed": -1}, ["seed", "-1"]),
    ({"scoring": "attention"}, ["scoring", "'attention'"]),
    ({"backend": "tpu"}, ["backend", "'tpu'"]),
    ({"slack": -1}, ["slack", ">= 0", "-1"]),
    ({"prefill": "exact", "slack": 8}, ["slack=8", "prefill='chunk'"]),
    ({"budgett": 10}, ["no field", "budgett", "budget"]),
    ({"merge": "window", "merge_keys": True}, ["merge_keys", "'window'"]),
])
def test_configs_are_refused_naming_field_and_value(fields, words):
    with pytest.raises(ValueError) as err:
        camkv.CaMKVCache(**fields)
    for word in words:
        assert word in str(err.value), (word, str(err.value))


def test_a_prompt_cache_saved_for_a_backend_the_machine_lacks_is_refused(capsys, tmp_path,
                                                                         monkeypatch):
    cache = camkv.CaMKVCache(budget=24, recent=4, scoring="key", backend="reference")
    cache.update_and_fetch(mx.ones((1, 2, 30, 8)), mx.ones((1, 2, 30, 8)))
    camkv.save_prompt_cache(str(tmp_path / "saved.safetensors"), [cache])
    # As on a machine where the backend it was saved with cannot run.
    lacking = {**backends.available(), "reference": "not usable in this test"}
    monkeypatch.setattr(backends, "available", lambda: lacking)
    err = _refused(capsys, ["generate", "--model", NEVER_LOADED, "--prompt-cache-file",
                            str(tmp_path / "saved.safetensors")])
    assert "was saved with backend 'reference' cannot run here: not usable in this test" in err


@pytest.mark.parametrize("backend", UNAVAILABLE)
def test_make_prompt_cache_and_apply_refuse_an_unusable_backend(backend):
    model = tiny_llama()
    for call in (camkv.make_prompt_cache, camkv.apply):
        with pytest.raises(ValueError) as err:
            call(model, backend=backend)
        assert f"backend {backend!r} cannot run here" in str(err.value)
        assert backends.available()[backend] in str(err.value)
    # Nothing was changed: no hook, the model's own caches.
    assert not hook.installed_modules()
    assert "_camkv_original_make_cache" not in vars(model)


@pytest.mark.parametrize("name,words", [
    ("cache-truncated.safetensors", ["truncated"]),
    ("cache-random.safetensors", ["not a readable safetensors"]),
    ("model.safetensors", ["not a prompt cache"]),
    ("notes.txt", ["not a readable safetensors"]),
    ("folder", ["a folder"]),
])
def test_load_prompt_cache_refuses_bad_files(files, name, words):
    with pytest.raises(ValueError) as err:
        camkv.load_prompt_cache(files[name])
    assert files[name] in str(err.value)
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize("name", ["random.gguf", "truncated.gguf", "header.gguf", "dims.gguf"])
def test_gguf_check_refuses_bad_files_and_accepts_a_good_one(files, name):
    gguf.check(files["good.gguf"])
    with pytest.raises(ValueError, match=name):
        gguf.check(files[name])


def _state(cache) -> list:
    return [np.array(x) if isinstance(x, mx.array) else x for x in cache.state]


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y for x, y in zip(a, b))


def _block(B=1, H=2, S=3, Dk=8, Dv=6, dtype=mx.float32, seed=0):
    rng = np.random.default_rng(seed)
    return (mx.array(rng.standard_normal((B, H, S, Dk))).astype(dtype),
            mx.array(rng.standard_normal((B, H, S, Dv))).astype(dtype))


MID_SEQUENCE = {
    "keys float16": (lambda: (_block()[0].astype(mx.float16), _block()[1]), ["float16", "float32"]),
    "both float16": (lambda: _block(dtype=mx.float16), ["changed mid-sequence", "float16"]),
    "one head more": (lambda: _block(H=3), ["changed mid-sequence", "3"]),
    "batch of two": (lambda: _block(B=2), ["changed mid-sequence"]),
    "key dim 16": (lambda: _block(Dk=16), ["changed mid-sequence", "16"]),
    "value dim 4": (lambda: _block(Dv=4), ["changed mid-sequence", "4"]),
    "no tokens": (lambda: _block(S=0), ["S >= 1"]),
    "3-D keys": (lambda: (_block()[0][0], _block()[1]), ["4-D", "3-D"]),
    "numpy arrays": (lambda: tuple(np.array(x) for x in _block()), ["mx.array"]),
    "lengths differ": (lambda: (_block(S=3)[0], _block(S=2)[1]), ["differ"]),
}


@pytest.mark.parametrize("case", MID_SEQUENCE)
def test_a_bad_block_mid_sequence_leaves_the_cache_as_it_was(case):
    cache = camkv.CaMKVCache(budget=8, n_sink=1, recent=2, scoring="key")
    for seed in range(4):
        cache.update_and_fetch(*_block(S=5, seed=seed))
    before, stored = _state(cache), [np.array(x) for x in cache.stored()]
    make, words = MID_SEQUENCE[case]
    with pytest.raises(ValueError) as err:
        cache.update_and_fetch(*make())
    for word in words:
        assert word in str(err.value), (word, str(err.value))
    assert _same(_state(cache), before)
    assert all(np.array_equal(a, np.array(b)) for a, b in zip(stored, cache.stored()))
    cache.update_and_fetch(*_block(S=2, seed=9))  # and it still takes a good block
    assert cache.stats["tokens_seen"] == 22


FIRST_BLOCK = {
    "int32": (lambda: tuple(x.astype(mx.int32) for x in _block()), ["int32", "float16, bfloat16 or float32"]),
    "float64": (lambda: tuple(x.astype(mx.float64) for x in _block()), ["float64", "float16, bfloat16 or float32"]),
    "no heads": (lambda: _block(H=0), ["H >= 1", "(1, 0, 3, 8)"]),
    "key dim 0": (lambda: _block(Dk=0), ["Dk >= 1", "(1, 2, 3, 0)"]),
    "value dim 0": (lambda: _block(Dv=0), ["Dv >= 1", "(1, 2, 3, 0)"]),
    "no rows": (lambda: _block(B=0), ["B >= 1", "(0, 2, 3, 8)"]),
}


@pytest.mark.parametrize("case", FIRST_BLOCK)
def test_a_bad_first_block_is_refused_and_good_blocks_follow(case):
    cache = camkv.CaMKVCache(budget=8, n_sink=1, recent=2, scoring="key")
    before = _state(cache)
    make, words = FIRST_BLOCK[case]
    with pytest.raises(ValueError) as err:
        cache.update_and_fetch(*make())
    for word in words:
        assert word in str(err.value), (word, str(err.value))
    assert _same(_state(cache), before) and cache.empty()
    for seed in range(4):  # past budget + slack, so the good blocks are compressed too
        cache.update_and_fetch(*_block(S=5, seed=seed))
    assert cache.stats["tokens_seen"] == 20 and cache.stats["evictions"] > 0
    assert [tuple(x.shape) for x in cache.stored()[:2]] == [(1, 2, cache.size(), 8), (1, 2, cache.size(), 6)]
    _state(cache)  # and its state reads back


def test_kv_bits_trimming_and_quantizing_are_refused():
    from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

    cache = camkv.CaMKVCache(budget=8, n_sink=1, recent=2, scoring="key")
    cache.update_and_fetch(*_block(S=12))
    before = _state(cache)
    with pytest.raises(NotImplementedError, match="cannot be trimmed"):
        cache.trim(2)
    with pytest.raises(NotImplementedError, match="kv_bits.*CaMConfig.bits="):
        cache.to_quantized(bits=4)
    assert not can_trim_prompt_cache([cache]) and trim_prompt_cache([cache], 2) == 0
    assert _same(_state(cache), before)


def test_a_hub_id_that_cannot_be_fetched_is_an_error_naming_it(tmp_path):
    env = subprocess_env(CAMKV_BLAS="0", HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path))
    result = subprocess.run(
        [sys.executable, "-m", "camkv", "generate", "--model", "nobody/no-such-model", "--prompt", "x"],
        capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "could not load --model 'nobody/no-such-model'" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("bad", [None, 3, "model", tiny_llama().layers[0].self_attn])
def test_make_prompt_cache_and_apply_refuse_what_is_not_a_model(bad):
    for call in (camkv.make_prompt_cache, camkv.apply):
        with pytest.raises(TypeError) as err:
            call(bad)
        assert "model must be an mlx-lm model" in str(err.value) and type(bad).__name__ in str(err.value)
    assert not hook.installed_modules()


def _one_layer_cache() -> list:
    cache = camkv.CaMKVCache(budget=8, n_sink=1, recent=2, scoring="key")
    cache.update_and_fetch(*_block(S=12))
    return [cache]


@pytest.mark.parametrize("cache,words", [
    ([1, 2], ["cache[0]", "int"]),
    ("layers", ["cache must be a list", "str"]),
    ({"0": None}, ["cache must be a list", "dict"]),
    (None, ["cache must be a list", "NoneType"]),
])
def test_save_prompt_cache_refuses_what_is_not_a_cache_list_and_writes_nothing(tmp_path, cache, words):
    target = tmp_path / "c.safetensors"
    if isinstance(cache, str):  # a layer where the list should be
        cache = _one_layer_cache()[0]
        words = ["cache must be a list", "CaMKVCache"]
    with pytest.raises(TypeError) as err:
        camkv.save_prompt_cache(str(target), cache)
    for word in words:
        assert word in str(err.value), (word, str(err.value))
    assert not any(tmp_path.iterdir())


def test_save_prompt_cache_refuses_bad_metadata(tmp_path):
    with pytest.raises(TypeError, match="metadata must be a dict of str to str"):
        camkv.save_prompt_cache(str(tmp_path / "c.safetensors"), _one_layer_cache(), metadata={"n": 1})
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("where,words", [
    ("{tmp}/missing/c.safetensors", ["missing", "does not exist"]),
    ("{tmp}/folder", ["folder.safetensors"]),  # the name MLX writes, reported as such
    ("/proc/camkv-cache.safetensors", ["/proc/camkv-cache.safetensors"]),  # not writable, even by root
])
def test_save_prompt_cache_into_a_place_it_cannot_write_is_a_value_error(tmp_path, where, words):
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder.safetensors").mkdir()
    target = where.format(tmp=tmp_path)
    with pytest.raises(ValueError) as err:
        camkv.save_prompt_cache(target, _one_layer_cache())
    for word in words:
        assert word in str(err.value), (word, str(err.value))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_save_prompt_cache_into_a_read_only_folder_is_a_value_error(tmp_path):
    tmp_path.chmod(0o555)
    try:
        with pytest.raises(ValueError, match="not writable"):
            camkv.save_prompt_cache(str(tmp_path / "c.safetensors"), _one_layer_cache())
    finally:
        tmp_path.chmod(0o755)


def test_save_prompt_cache_says_where_it_wrote_and_load_finds_it(tmp_path):
    written = camkv.save_prompt_cache(str(tmp_path / "story"), _one_layer_cache())
    assert written == str(tmp_path / "story.safetensors") and Path(written).is_file()
    loaded = camkv.load_prompt_cache(str(tmp_path / "story"))  # the name as it was given
    assert _same(_state(loaded[0]), _state(_one_layer_cache()[0]))


def test_a_nan_key_is_kept_as_given_until_it_is_evicted_first():
    """docs/algorithm.md section 2: a NaN key gets no attention mass, so it ranks lowest
    and is the first token evicted; until then it is held, and returned, as it came."""
    cache = camkv.CaMKVCache(budget=8, n_sink=1, recent=2, scoring="key", slack=4)
    keys, values = _block(S=8)
    keys[:, :, 3] = float("nan")
    fetched = cache.update_and_fetch(keys, values)[0]  # 8 tokens: within budget + slack
    assert np.isnan(np.array(fetched[:, :, 3])).all()
    cache.update_and_fetch(*_block(S=5, seed=1))  # 13 > 8 + 4: compressed back to 8
    positions = np.array(cache.stored()[3])
    assert 3 not in positions and positions.shape[-1] == 8
    assert not np.isnan(np.array(cache.stored()[0])).any()
