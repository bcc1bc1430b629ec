"""A Hugging Face fast tokenizer rebuilt from a GGUF file's tokenizer metadata.

A GGUF file carries no tokenizer.json: llama.cpp stores the vocabulary and how to
split text into it as metadata, under ``tokenizer.ggml.*``. Two kinds are rebuilt:

- ``gpt2``: byte-level BPE with the file's merges (SmolLM2), its pre-tokenizer named
  by ``tokenizer.ggml.pre``;
- ``llama``: SentencePiece BPE with byte fallback (Gemma, Llama 2). The file lists
  no merges, only each token's score: as in llama.cpp, the pair whose merged token
  scores highest merges first, so the merges are every split of a normal token into
  two tokens, best score first. Spaces become "▁" (and one is put in front of the
  text when ``tokenizer.ggml.add_space_prefix`` says so, llama.cpp's default).

In both, control tokens become special tokens and user-defined tokens (Gemma's runs
of spaces, tabs and newlines, its HTML tags) are matched whole before BPE runs, as
spelled in the file, as llama.cpp matches them. When ``tokenizer.ggml.add_bos_token``
is set, encoding puts the BOS token first (Gemma needs it).
"""

from __future__ import annotations

from .gguf import scalar

# GGUF token types (llama.cpp's llama_token_type).
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 3, 4

# llama.cpp pre-tokenizer names of byte-level BPE this module can reproduce; they
# differ only in whether digits are split one by one before BPE runs.
PRE_TOKENIZER_DIGITS = {"smollm": True, "gpt-2": False, "default": False}

SPACE = "\u2581"  # SentencePiece's "▁", which stands for a space in its tokens


def _values(value) -> list:
    """A metadata array (an MLX or numpy array, or a list) as a Python list."""
    return value.tolist() if hasattr(value, "tolist") else list(value)


def _token_id(metadata: dict, key: str) -> int | None:
    full = f"tokenizer.ggml.{key}_token_id"
    if full not in metadata:
        return None
    return int(scalar(metadata[full]))


def _flag(metadata: dict, key: str, default: bool) -> bool:
    return bool(scalar(metadata.get(f"tokenizer.ggml.{key}", default)))


def _byte_level_bpe(metadata: dict, tokens: list[str], types: list[int]):
    """tokenizer.ggml.model "gpt2": GPT-2 byte-level BPE with the file's merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZER_DIGITS:
        raise ValueError(
            f"camkv rebuilds GGUF tokenizers of model 'gpt2' with pre-tokenizer "
            f"{sorted(PRE_TOKENIZER_DIGITS)}, got model 'gpt2' / pre {pre!r}"
        )
    merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                               fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if PRE_TOKENIZER_DIGITS[pre]:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def merges_by_score(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """SentencePiece BPE's merges: each split of a normal token into two tokens, the
    merged token's score deciding the order (highest first; ties by the ids of the parts)."""
    ids = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for token, score, kind in zip(tokens, scores, types):
        if kind != TOKEN_NORMAL:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                ranked.append((-score, ids[left], ids[right], left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def _sentencepiece_bpe(metadata: dict, tokens: list[str], types: list[int]):
    """tokenizer.ggml.model "llama": SentencePiece BPE with byte fallback, merges from scores."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = [float(s) for s in _values(metadata["tokenizer.ggml.scores"])]
    unk = _token_id(metadata, "unknown")
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                               merges=merges_by_score(tokens, scores, types),
                               unk_token=None if unk is None else tokens[unk],
                               fuse_unk=True, byte_fallback=True))
    prefix = _flag(metadata, "add_space_prefix", True)
    steps = [normalizers.Prepend(SPACE)] if prefix else []
    tok.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", SPACE)])
    tok.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok


_BUILDERS = {"gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe}


def _with_bos(tok, metadata: dict, tokens: list[str]) -> None:
    """Make encoding put the BOS token first, when the file says the model wants it."""
    from tokenizers import processors

    bos = _token_id(metadata, "bos")
    if bos is None or not _flag(metadata, "add_bos_token", False):
        return
    template = processors.TemplateProcessing(
        single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B:1", special_tokens=[(tokens[bos], bos)])
    current = tok.post_processor
    tok.post_processor = template if current is None else processors.Sequence([current, template])


def tokenizer_from_gguf_metadata(metadata: dict):
    """A transformers fast tokenizer rebuilt from GGUF tokenizer metadata."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    kind = metadata.get("tokenizer.ggml.model")
    if kind not in _BUILDERS:
        raise ValueError(f"camkv rebuilds GGUF tokenizers of model {sorted(_BUILDERS)} "
                         f"(byte-level BPE, SentencePiece BPE), got model {kind!r}")
    tokens = list(metadata["tokenizer.ggml.tokens"])
    types = [int(t) for t in _values(metadata["tokenizer.ggml.token_type"])]
    tok = _BUILDERS[kind](metadata, tokens, types)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == TOKEN_CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == TOKEN_USER_DEFINED])
    _with_bos(tok, metadata, tokens)

    def token_named(key):
        token_id = _token_id(metadata, key)
        return None if token_id is None else tokens[token_id]

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=token_named("bos"),
        eos_token=token_named("eos"),
        unk_token=token_named("unknown"),
        pad_token=token_named("padding"),
        chat_template=metadata.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )
