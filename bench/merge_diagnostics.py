"""Why merging loses to dropping, measured on a real stream.

    python bench/merge_diagnostics.py --out bench/results/quality-cpu-merge/diagnostics.json

One window of real text (the quality sweep's first stream window: 512 tokens, 384
prefilled in chunks of 256, then one token a step) through the default model, at one
budget, ungated merges:

1. Value norms. After every call, the mean and the largest L2 norm of the stored value
   rows (all layers, heads and rows) for each merge mode, against the full cache's
   over the same tokens. An additive merge ("window": V_j += V_e / |W|) is not a
   convex combination, so its norms can grow with every eviction; the blends cannot.
2. Blend weights. For the nearest-survivor merge, the weight sim_weighted used
   (w = clamp(cos(K_e, K_t), 0, 1)) next to the weight the attention masses give
   (s_e / (s_e + s_t)), over every merge of the stream, with key and query scoring.
   Recorded through the reference backend (the weight is computed there in one place).
3. mass_bias. The logit bias the merged rows carry at the end of the window (query
   scoring, mass_weighted with values only and with keys blended too): per layer its
   mean, its largest value and the share of rows above 0.5 nats. The bias assumes an
   absorbed token draws the survivor's attention in proportion to the masses; these
   sizes show how much extra weight a survivor then gets from every later query.

--parts picks some of them (default: all three).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# Run from a source checkout without installing.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

NORM_MODES = ("drop", "sim_weighted", "mass_weighted", "window", "window_mass")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model (default: camkv's default model)")
    p.add_argument("--text", default="austen", help="text source (default: austen)")
    p.add_argument("--tokens", type=int, default=512, help="window length (default 512)")
    p.add_argument("--prefill", type=int, default=384, help="tokens prefilled in chunks (default 384)")
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk (default 256)")
    p.add_argument("--budget", type=float, default=0.2,
                   help="budget as a fraction of the window (default 0.2)")
    p.add_argument("--parts", default="norms,weights,bias",
                   help="comma-separated: norms, weights, bias (default: all)")
    p.add_argument("--out", type=Path, required=True, help="JSON file to write")
    opts = p.parse_args(argv)
    if not 0 < opts.budget < 1:
        p.error(f"--budget must be a fraction in (0, 1), got {opts.budget}")
    if not 0 < opts.prefill < opts.tokens:
        p.error(f"--prefill must be in (0, --tokens), got {opts.prefill}")
    opts.parts = [x.strip() for x in opts.parts.split(",") if x.strip()]
    unknown = set(opts.parts) - {"norms", "weights", "bias"}
    if unknown or not opts.parts:
        p.error(f"--parts must list norms, weights and/or bias, got {opts.parts}")
    return opts


def value_norms(caches):
    """[mean, max] L2 norm of the value rows held, over every layer (float32)."""
    import mlx.core as mx

    per_layer = []
    for c in caches:
        # mlx-lm's KVCache holds a buffer padded past offset; only the first offset rows are tokens.
        values = c.stored()[1] if hasattr(c, "stored") else c.values[..., : c.offset, :]
        per_layer.append(mx.sqrt(mx.sum(values.astype(mx.float32) ** 2, axis=-1)).reshape(-1))
    norms = mx.concatenate(per_layer)
    return mx.stack([norms.mean(), norms.max()])


def norm_series(model, method, budget, tokens, opts, settings) -> dict:
    """Value norms after every call of one arm over the window."""
    import mlx.core as mx
    from camkv import quality

    caches = quality.make_cache(model, method, budget, settings)
    series, positions = [], []
    try:
        for first, logits in quality.feed(model, caches, tokens[:-1], opts.prefill, opts.chunk):
            stats = value_norms(caches)
            mx.eval(logits, stats)
            series.append(stats.tolist())
            positions.append(first + logits.shape[0])
    finally:
        quality.release_cache(model, method)
    return {"tokens_seen": positions, "mean": [s[0] for s in series], "max": [s[1] for s in series]}


def blend_weights(model, scoring, budget, tokens, opts, settings) -> dict:
    """Both weights at every sim_weighted merge of the window (reference backend, gate off)."""
    import mlx.core as mx
    import numpy as np
    from camkv import quality, reference

    cos_w, mass_w = [], []
    original = reference._nearest_weight

    def recording(merge, cos_t, s_e, s_t):
        cos_w.append(mx.clip(cos_t, 0.0, 1.0))
        mass_w.append(reference._mass_weight(s_e, s_t))
        return original(merge, cos_t, s_e, s_t)

    method = quality.Method(f"sim_weighted-nogate-{scoring}", "camkv", "sim_weighted", False, scoring)
    ref_settings = quality.CacheSettings(settings.n_sink, settings.recent, settings.window,
                                         settings.seed, "reference")
    reference._nearest_weight = recording
    try:
        norm_series(model, method, budget, tokens, opts, ref_settings)
    finally:
        reference._nearest_weight = original
    cos_w, mass_w = np.array(mx.concatenate(cos_w)), np.array(mx.concatenate(mass_w))
    return {
        "merges": int(cos_w.size),
        "cos_weight": _describe(cos_w),
        "mass_weight": _describe(mass_w),
        "cos_weight_above_mass_weight": float((cos_w > mass_w).mean()),
    }


def bias_spread(model, keys_too: bool, budget, tokens, opts, settings) -> dict:
    """Per layer: the stored rows' mass_bias at the end of the window (mass_weighted, query)."""
    import mlx.core as mx
    import numpy as np
    from camkv import quality

    method = quality.Method("mass_weighted-bias", "camkv", "mass_weighted", False, "query",
                            keys_too, mass_bias=True)
    ref_settings = quality.CacheSettings(settings.n_sink, settings.recent, settings.window,
                                         settings.seed, "reference")
    caches = quality.make_cache(model, method, budget, ref_settings)
    try:
        for _, logits in quality.feed(model, caches, tokens[:-1], opts.prefill, opts.chunk):
            mx.eval(logits)  # only the state at the end matters; this bounds the lazy graph
        layers = [np.array(c.stored_bias()) for c in caches]
    finally:
        quality.release_cache(model, method)
    return {
        "merges": int(sum(c.stats["merges"] for c in caches)),
        "mean_per_layer": [float(b.mean()) for b in layers],
        "max_per_layer": [float(b.max()) for b in layers],
        "share_above_half_nat": [float((b > 0.5).mean()) for b in layers],
    }


def _describe(x) -> dict:
    import numpy as np

    return {"mean": float(x.mean()), "median": float(np.median(x)),
            "p90": float(np.quantile(x, 0.9)), "at_least_half": float((x >= 0.5).mean())}


def main(argv=None) -> int:
    try:
        from camkv._blas import reexec_with_openblas
    except ImportError:
        reexec_with_openblas = None
    if reexec_with_openblas is not None:
        reexec_with_openblas()
    opts = parse_args(sys.argv[1:] if argv is None else argv)
    from camkv import quality, texts
    from camkv.models import DEFAULT_MODEL

    started = time.time()
    model_name = opts.model or DEFAULT_MODEL
    model, tokenizer = quality.load_model(model_name)
    quality.cast_model(model, "auto")
    docs = texts.load_source(opts.text, offline=True)
    tokens = texts.sample_windows(opts.text, docs, tokenizer, opts.tokens, 1, seed=0)[0].tokens
    budget = round(opts.budget * opts.tokens)
    settings = quality.CacheSettings(n_sink=4, recent=32, window=4, seed=0, backend="ext")

    result = {"model": model_name, "text": opts.text, "tokens": opts.tokens, "prefill": opts.prefill,
              "chunk": opts.chunk, "budget": budget, "n_sink": 4, "recent": 32, "window": 4,
              "gate": False, "value_norms": {}, "blend_weights": {}}
    if "norms" in opts.parts:
        full = quality.Method("full", "full")
        result["value_norms"]["full"] = norm_series(model, full, budget, tokens, opts, settings)
        for merge in NORM_MODES:
            method = quality.Method(merge, "camkv", merge, False, "key")
            result["value_norms"][merge] = norm_series(model, method, budget, tokens, opts, settings)
            print(f"{merge}: value norm mean {result['value_norms'][merge]['mean'][-1]:.2f}, "
                  f"max {result['value_norms'][merge]['max'][-1]:.2f}", flush=True)
    if "weights" in opts.parts:
        for scoring in ("key", "query"):
            result["blend_weights"][scoring] = blend_weights(model, scoring, budget, tokens, opts, settings)
            print(f"{scoring} scoring: {json.dumps(result['blend_weights'][scoring])}", flush=True)
    if "bias" in opts.parts:
        result["mass_bias"] = {}
        for name, keys_too in (("values", False), ("keys_and_values", True)):
            spread = bias_spread(model, keys_too, budget, tokens, opts, settings)
            result["mass_bias"][name] = spread
            print(f"mass_bias ({name}): mean per layer {min(spread['mean_per_layer']):.2f}.."
                  f"{max(spread['mean_per_layer']):.2f} nats, largest {max(spread['max_per_layer']):.2f}",
                  flush=True)
    result["seconds"] = round(time.time() - started, 1)
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {opts.out} in {result['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
