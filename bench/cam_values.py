"""How far CaM's additive window merge (camkv.config.CAM_STREAMING) grows the values it keeps.

    python bench/cam_values.py [--budget 51] [--recent 12]

Feeds the cpu preset's stream window (one 512-token Austen window, seed 0; 384 tokens
prefilled, then one token a step) through mlx-lm's full cache and through CAM_STREAMING
caches, and prints, over every layer and KV head, the norm of each value a cam cache
holds against the full cache's value at the same position: 1 for a token never merged
into. Three schedules: prefill chunks of 256 (what `camkv eval --preset cpu` runs), the
same with a 16-token window, and token by token without slack (one eviction and merge
per step, the released code's schedule).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

import camkv  # noqa: E402
from camkv.config import CAM_STREAMING  # noqa: E402
from camkv.eval import texts  # noqa: E402
from camkv.eval.loading import load_model  # noqa: E402
from camkv.eval.stream import feed  # noqa: E402
from camkv.models import DEFAULT_MODEL  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

PREFILL, CONTEXT = 384, 512  # the cpu preset's stream window


def run_caches(model, tokens: list[int], caches: list, chunk: int) -> list:
    for _, logits in feed(model, caches, tokens, PREFILL, chunk):
        mx.eval(logits)
    return caches


def norm_ratios(caches: list, full: list) -> np.ndarray:
    """|V| held / |V| of the full cache at the same position, every layer, head and row."""
    ratios = []
    for cache, reference in zip(caches, full):
        _, values, _, positions = cache.stored()
        held, pos, ref = np.array(values[0]), np.array(positions[0]), np.array(reference.values[0])
        for h in range(held.shape[0]):
            ratios.append(np.linalg.norm(held[h], axis=-1) / np.linalg.norm(ref[h, pos[h]], axis=-1))
    return np.concatenate(ratios)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=int, default=51, help="tokens per row (default 51, 10%% of 512)")
    parser.add_argument("--recent", type=int, default=12, help="recent window (default 12, a quarter)")
    args = parser.parse_args()
    model, tokenizer = load_model(DEFAULT_MODEL)
    window = texts.sample_windows("austen", texts.load_source("austen", offline=True), tokenizer, CONTEXT, 1, 0)[0]
    tokens = window.tokens[:-1]
    full = run_caches(model, tokens, make_prompt_cache(model), 256)
    schedules = [("prefill chunks of 256", 256, {}), ("prefill chunks of 256, window 16", 256, {"window": 16}),
                 ("token by token, slack 0", 1, {"slack": 0})]
    for name, chunk, fields in schedules:
        config = {**CAM_STREAMING, **fields}
        caches = camkv.make_prompt_cache(model, budget=args.budget, n_sink=4, recent=args.recent,
                                         scoring="query", **config)
        run_caches(model, tokens, caches, chunk)
        camkv.remove(model)
        r = norm_ratios(caches, full)
        merges = sum(c.stats["merges"] for c in caches)
        print(f"{name}: |V| held / |V| full: median {np.median(r):.2f}, 90th percentile "
              f"{np.percentile(r, 90):.2f}, max {r.max():.1f}; merges {merges}")
    return 0


if __name__ == "__main__":
    from camkv._blas import reexec_with_openblas

    reexec_with_openblas()  # the CPU's float32 matrix products by the system's OpenBLAS, where one exists
    sys.exit(main())
