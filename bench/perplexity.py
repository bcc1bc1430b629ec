"""Perplexity of a model on the opening of Pride and Prejudice: a check that a model loads correctly.

The text comes from Debian's r-cran-janeaustenr package (fetched with
``apt-get download``, unpacked with ``dpkg -x``, read with camkv.eval.rdata), so the
check needs only a Debian package mirror, no dataset hub. SmolLM2-135M-Instruct
loaded correctly scores about 16 on the first 512 tokens; a broken load (for
example Q/K rows left in llama.cpp's order) scores in the thousands.

    PYTHONPATH=python python bench/perplexity.py                  # default model, full cache
    PYTHONPATH=python python bench/perplexity.py --chunk 64 --kv-budget 128   # through camkv

With --chunk the tokens go through the model in chunks with a prompt cache (a plain
mlx-lm cache, or camkv's with --kv-budget), which is how generation sees them.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

from camkv.eval.rdata import read_lazyload_db

JANEAUSTENR_DATA = "usr/lib/R/site-library/janeaustenr/data/Rdata"


def pride_and_prejudice(cache: Path) -> str:
    """The novel's text, lines joined by newlines; downloads the Debian package once."""
    unpacked = cache / "r-cran-janeaustenr"
    if not Path(f"{unpacked / JANEAUSTENR_DATA}.rdb").exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            print("fetching r-cran-janeaustenr with apt-get download", file=sys.stderr)
            subprocess.run(["apt-get", "download", "r-cran-janeaustenr"], cwd=tmp, check=True)
            deb = next(Path(tmp).glob("r-cran-janeaustenr_*.deb"))
            subprocess.run(["dpkg", "-x", str(deb), str(unpacked)], check=True)
    data = unpacked / JANEAUSTENR_DATA
    lines = read_lazyload_db(f"{data}.rdx", f"{data}.rdb")["prideprejudice"]
    return "\n".join(line or "" for line in lines)


def token_nlls(model, tokens, chunk: int | None, cache) -> list[float]:
    """Negative log-likelihood of each token after the first, given all before it."""
    import mlx.core as mx
    from tqdm import tqdm

    inputs = mx.array(tokens)[None]
    step = chunk or len(tokens)
    nlls = []
    for start in tqdm(range(0, len(tokens) - 1, step), desc="scoring", unit="chunk",
                      file=sys.stderr, leave=False):
        stop = min(start + step, len(tokens) - 1)
        logits = model(inputs[:, start:stop], cache=cache).astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        targets = inputs[:, start + 1 : stop + 1]
        picked = mx.take_along_axis(logprobs, targets[..., None], axis=-1)
        nlls.extend((-picked).reshape(-1).tolist())
    return nlls


def make_cache(model, kv_budget: int | None):
    from mlx_lm.models.cache import make_prompt_cache

    if kv_budget is None:
        return make_prompt_cache(model)
    import camkv

    if not hasattr(camkv, "make_prompt_cache"):
        raise SystemExit("--kv-budget needs camkv.make_prompt_cache (camkv/integration.py)")
    return camkv.make_prompt_cache(model, budget=kv_budget)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="camkv's default model name, a .gguf file, or any mlx_lm.load path / hub id")
    parser.add_argument("--tokens", type=int, default=512, help="how many tokens of the novel to score")
    parser.add_argument("--chunk", type=int, default=None,
                        help="feed the tokens in chunks of this size through a prompt cache "
                             "(default: one pass, no cache)")
    parser.add_argument("--kv-budget", type=int, default=None,
                        help="use camkv's cache with this budget (needs --chunk)")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="where the Debian package is kept (default: camkv's cache folder/bench)")
    parser.add_argument("--out", type=Path, default=None, help="also write the result as JSON here")
    args = parser.parse_args(argv)
    if args.kv_budget is not None and args.chunk is None:
        parser.error("--kv-budget needs --chunk (a cache only matters when tokens arrive in steps)")

    from camkv import models

    text = pride_and_prejudice(args.cache_dir or models.cache_dir() / "bench")
    model, tokenizer = models.load(args.model)
    tokens = tokenizer.encode(text)[: args.tokens]
    cache = make_cache(model, args.kv_budget) if args.chunk else None
    nlls = token_nlls(model, tokens, args.chunk, cache)
    result = {
        "model": args.model, "text": "Pride and Prejudice (janeaustenr)", "tokens": len(tokens),
        "chunk": args.chunk, "kv_budget": args.kv_budget,
        "perplexity": math.exp(sum(nlls) / len(nlls)),
    }
    print(f"perplexity {result['perplexity']:.3f} over the first {len(tokens)} tokens "
          f"(model {args.model}, chunk {args.chunk}, kv budget {args.kv_budget})")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    from camkv._blas import reexec_with_openblas

    reexec_with_openblas()  # much faster float32 CPU matrix products where a system OpenBLAS exists
    main()
