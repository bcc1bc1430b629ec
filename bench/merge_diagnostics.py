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
--parts picks some of them (default: both). (The mass_bias part of the records in
bench/results/quality-cpu-bias/ came from an earlier version with that experiment.)

"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# Run from a source checkout without installing.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model (default: camkv's default model)")
    p.add_argument("--text", default="austen", help="text source (default: austen)")
    p.add_argument("--tokens", type=int, default=512, help="window length (default 512)")
    p.add_argument("--prefill", type=int, default=384, help="tokens prefilled in chunks (default 384)")
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk (default 256)")
    p.add_argument("--budget", type=float, default=0.2,
                   help="budget as a fraction of the window (default 0.2)")
    p.add_argument("--parts", default="norms,weights",
                   help="comma-separated: norms, weights (default: both)")
    p.add_argument("--out", type=Path, required=True, help="JSON file to write")
    opts = p.parse_args(argv)
    if not 0 < opts.budget < 1:
        p.error(f"--budget must be a fraction in (0, 1), got {opts.budget}")
    if not 0 < opts.prefill < opts.tokens:
        p.error(f"--prefill must be in (0, --tokens), got {opts.prefill}")
    opts.parts = [x.strip() for x in opts.parts.split(",") if x.strip()]
    unknown = set(opts.parts) - {"norms", "weights"}
    if unknown or not opts.parts:
        p.error(f"--parts must list norms and/or weights, got {opts.parts}")
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
    from camkv.eval import arms, stream

    caches = arms.make_cache(model, method, budget, settings)
    series, positions = [], []
    try:
        for first, logits in stream.feed(model, caches, tokens[:-1], opts.prefill, opts.chunk):
            stats = value_norms(caches)
            mx.eval(logits, stats)
            series.append(stats.tolist())
            positions.append(first + logits.shape[0])
    finally:
        arms.release_cache(model, method)
    return {"tokens_seen": positions, "mean": [s[0] for s in series], "max": [s[1] for s in series]}


def blend_weights(model, scoring, budget, tokens, opts, settings) -> dict:
    """Both weights at every sim_weighted merge of the window (reference backend, gate off)."""
    import mlx.core as mx
    import numpy as np
    from camkv import reference
    from camkv.eval import arms

    cos_w, mass_w = [], []
    original = reference._loser_shares

    def recording(rule, cos_t, s_in, s_t, *norms):
        # The one-loser blend weights: sim_weighted's clamp(cos) and mass_weighted's s_e / (s_e + s_t).
        cos_w.append(mx.clip(cos_t, 0.0, 1.0).reshape(-1))
        total = s_in + s_t
        mass_w.append(mx.where(total > 0, s_in / mx.where(total > 0, total, 1.0), 0.0).reshape(-1))
        return original(rule, cos_t, s_in, s_t, *norms)

    method = arms.Arm(f"sim_weighted-nogate-{scoring}", "camkv", "sim_weighted", False, scoring)
    ref_settings = arms.CacheSettings(settings.n_sink, settings.recent, settings.window,
                                         settings.seed, "reference")
    reference._loser_shares = recording
    try:
        norm_series(model, method, budget, tokens, opts, ref_settings)
    finally:
        reference._loser_shares = original
    cos_w, mass_w = np.array(mx.concatenate(cos_w)), np.array(mx.concatenate(mass_w))
    return {
        "merges": int(cos_w.size),
        "cos_weight": _describe(cos_w),
        "mass_weight": _describe(mass_w),
        "cos_weight_above_mass_weight": float((cos_w > mass_w).mean()),
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
    from camkv import merges
    from camkv.eval import arms, loading, texts
    from camkv.models import DEFAULT_MODEL

    started = time.time()
    model_name = opts.model or DEFAULT_MODEL
    model, tokenizer = loading.load_model(model_name)
    loading.cast_model(model, "auto")
    docs = texts.load_source(opts.text, offline=True)
    tokens = texts.sample_windows(opts.text, docs, tokenizer, opts.tokens, 1, seed=0)[0].tokens
    budget = round(opts.budget * opts.tokens)
    settings = arms.CacheSettings(n_sink=4, recent=32, window=4, seed=0, backend="ext")

    result = {"model": model_name, "text": opts.text, "tokens": opts.tokens, "prefill": opts.prefill,
              "chunk": opts.chunk, "budget": budget, "n_sink": 4, "recent": 32, "window": 4,
              "gate": False, "value_norms": {}, "blend_weights": {}}
    if "norms" in opts.parts:
        full = arms.Arm("full", "full")
        result["value_norms"]["full"] = norm_series(model, full, budget, tokens, opts, settings)
        for merge in merges.names():  # every rule, drop included
            method = arms.Arm(merge, "camkv", merge, False, "key")
            result["value_norms"][merge] = norm_series(model, method, budget, tokens, opts, settings)
            print(f"{merge}: value norm mean {result['value_norms'][merge]['mean'][-1]:.2f}, "
                  f"max {result['value_norms'][merge]['max'][-1]:.2f}", flush=True)
    if "weights" in opts.parts:
        for scoring in ("key", "query"):
            result["blend_weights"][scoring] = blend_weights(model, scoring, budget, tokens, opts, settings)
            print(f"{scoring} scoring: {json.dumps(result['blend_weights'][scoring])}", flush=True)
    result["seconds"] = round(time.time() - started, 1)
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {opts.out} in {result['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
