"""The arms of an evaluation (`camkv eval` and `camkv bench` alike): what each is, the
catalog --methods picks from, and the cache list each makes for a model."""

from __future__ import annotations

import json
from dataclasses import dataclass

from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from .. import byte_budget, hook, merges
from ..config import CAM_STREAMING, CaMConfig, default_recent
from ..distributed import kv_bytes, shard_info
from ..integration import make_prompt_cache as camkv_prompt_cache
from ..quantized import row_bytes


@dataclass(frozen=True)
class Arm:
    """One way of caching, compared with the others on the same tokens: mlx-lm's full
    KVCache ("full"), its RotatingKVCache as StreamingLLM ("streaming"), a camkv
    cache with these settings and the run's ("camkv"), a camkv cache of a whole
    CaMConfig ("config": only the budget, seed and backend come from the run), or
    SnapKV as kvpress runs it ("snapkv": RULER prompts only, see make_cache). The
    budget comes with each run."""

    name: str
    kind: str  # "full", "streaming", "camkv", "config" or "snapkv"
    merge: str = "drop"
    gate: bool = False
    scoring: str = "key"
    merge_keys: bool = False
    eviction: str = "score"
    window: int | None = None  # survivors of a window rule; None: the run's --window
    config: CaMConfig | None = None  # kind "config": the cache's settings but the budget
    prefill_scoring: str | None = None  # kind "camkv": None takes the run's --prefill-scoring
    equal_bytes: bool = False  # kind "config": the bytes camkv's default holds at the budget, not the budget


MERGE_ARMS = merges.names(kind=merges.NEAREST) + merges.names(kind=merges.WINDOW)  # every rule but drop (h2o)
KEY_MERGE_ARMS = merges.names(keys_allowed=True)  # the rules that can blend keys too
DEFAULT_ARM = "camkv"  # the arm of camkv's default CaMConfig, which reports pair with the others


def method_catalog() -> dict[str, Arm]:
    """Every arm, by name, in the order tables and plots list them."""
    methods = [Arm("full", "full"), Arm("streamingllm", "streaming")]
    for scoring in ("key", "query"):
        suffix = "" if scoring == "key" else "-query"
        methods.append(Arm("h2o" + suffix, "camkv", "drop", False, scoring))
        for merge in MERGE_ARMS:
            for gate in (True, False):
                name = merge + ("" if gate else "-nogate") + suffix
                methods.append(Arm(name, "camkv", merge, gate, scoring))
        for merge in KEY_MERGE_ARMS:  # blending the keys too (merge_keys), ungated
            methods.append(Arm(merge + "-keys-nogate" + suffix, "camkv", merge, False, scoring, True))
    # CaM as its authors ran it: StreamingLLM's eviction, the window merge over 32, gated
    # by the accumulated attention of the model's queries.
    methods.append(Arm("cam", "camkv", scoring="query", **CAM_STREAMING))
    # The arms of the RULER suite: SnapKV as kvpress runs it, H2O as published (every
    # prompt query's attention accumulated), camkv's default CaMConfig and that default
    # with each offered merge rule instead of dropping.
    methods.append(Arm("snapkv", "snapkv"))
    # StreamingLLM with its sinks attended: mlx-lm's RotatingKVCache masks its kept sinks
    # from a prompt chunk's queries once the chunk passes its window (its mask counts
    # indices, not positions), so chunked prompts run as a sliding window without sinks;
    # camkv's recency eviction keeps the same tokens and attends to all of them.
    methods.append(Arm("streamingllm-sinks", "camkv", "drop", False, "key", eviction="recency",
                       prefill_scoring="causal"))
    methods.append(Arm("h2o-causal", "camkv", "drop", False, "query", prefill_scoring="causal"))
    methods.append(Arm(DEFAULT_ARM, "config", config=CaMConfig()))
    for merge in (m for m in merges.offered() if merges.rule(m).kind != merges.DROP):
        methods.append(Arm(f"camkv-{merge}", "config", config=CaMConfig(merge=merge)))
    return {m.name: m for m in methods}


def parse_arm_spec(spec: str) -> Arm:
    """An --arm value NAME=JSON: an arm of the CaMConfig whose fields the JSON object
    names (the budget comes with each run)."""
    name, sep, fields = spec.partition("=")
    if not sep or not name.strip() or name.strip() in method_catalog():
        raise ValueError(f"--arm must be NAME={{CaMConfig fields as JSON}} with a NAME that is no "
                         f"method's, got {spec!r}")
    try:
        values = json.loads(fields)
    except json.JSONDecodeError as err:
        raise ValueError(f"--arm {name}: {fields!r} is not JSON ({err.msg})") from None
    if not isinstance(values, dict) or "budget" in values:
        raise ValueError(f"--arm {name}: give a JSON object of CaMConfig fields other than budget, "
                         f"got {fields!r}")
    equal_bytes = values.pop("equal_bytes", False)
    if not isinstance(equal_bytes, bool):
        raise ValueError(f"--arm {name}: equal_bytes must be true or false, got {equal_bytes!r}")
    return Arm(name.strip(), "config", config=CaMConfig(**values), equal_bytes=equal_bytes)


def default_layer_bytes(model, budget: int) -> int:
    """The most one layer of camkv's default cache (unquantized CaMConfig()) holds at this
    budget: budget + slack rows of every KV head (keys, values, scores, positions), for
    the head shape of the model's first layer camkv takes over."""
    base = CaMConfig(budget=budget)
    shards = shard_info(model)
    layer = next(i for i, c in enumerate(make_prompt_cache(model)) if type(c) is KVCache)
    heads, k_dim, v_dim, dtype_size = byte_budget.layer_shape(model, layer, shards)
    return heads * row_bytes(k_dim, v_dim, dtype_size, None, base.group_size) * (base.budget + base.slack)


def is_retired(arm: Arm) -> bool:
    """Whether the arm merges by a retired rule (camkv.merges): named, it still runs; no
    group and no list of the command line offers it."""
    return arm.kind == "camkv" and bool(merges.rule(arm.merge).retired)


def offered_methods() -> list[str]:
    """The arms the command line lists, in catalog order: all but the retired rules'."""
    return [n for n, m in method_catalog().items() if not is_retired(m)]


def _stream_arms() -> list[str]:
    """The offered arms the stream and passkey sweeps group: not the RULER suite's."""
    catalog = method_catalog()
    return [n for n in offered_methods()
            if catalog[n].kind in ("full", "streaming", "camkv") and catalog[n].prefill_scoring is None]


METHOD_GROUPS = {
    "all": _stream_arms(),
    "key": [n for n in _stream_arms() if method_catalog()[n].scoring == "key"],
    "core": ["full", "streamingllm", "h2o", "h2o-query", "mass_weighted-nogate", "window"],
    # How to merge: every offered blend rule against dropping, ungated, both scorings.
    "merge": ["full"] + [name + suffix for suffix in ("", "-query") for name in
                         ("h2o", "mass_weighted-nogate", "value_norm-nogate", "window-nogate")],
    # RULER: the methods the field compares, camkv's default and each merge rule on it.
    "ruler": ["full", "streamingllm", "streamingllm-sinks", "snapkv", "h2o-causal", "camkv"]
             + [n for n in offered_methods() if n.startswith("camkv-")],
}


def expand_names(spec: str, groups: dict[str, list[str]], known, flag: str, what: str) -> list[str]:
    """The names a comma-separated flag value lists, each group replaced by its members,
    in order and once each; a ValueError names an unknown item, the groups and names."""
    names: list[str] = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        if item in groups:
            names += groups[item]
        elif item in known:
            names.append(item)
        else:
            raise ValueError(f"{flag}: unknown {what} {item!r}; known: groups {sorted(groups)} "
                             f"or {', '.join(known)}")
    return list(dict.fromkeys(names))


def parse_methods(spec: str) -> list[Arm]:
    catalog = method_catalog()
    names = expand_names(spec, METHOD_GROUPS, catalog, "--methods", "method")
    if "full" not in names:
        names.insert(0, "full")  # every metric is measured against it
    return [catalog[n] for n in names]


@dataclass(frozen=True)
class CacheSettings:
    n_sink: int
    recent: int | str | None  # tokens, "N%" of each budget, or None: camkv's default share
    window: int
    seed: int
    backend: str
    slack: int | None = None  # camkv's rows over the budget; None: CaMConfig's default
    prefill_scoring: str | None = None  # CaMConfig.prefill_scoring of every camkv arm; None: its default
    observation_window: int = 32
    pool: int = 1

    def recent_for(self, budget: int) -> int:
        """The recent window (tokens) of a cache of this budget."""
        return recent_tokens(self.recent, budget)


def recent_tokens(recent: int | str | None, budget: int) -> int:
    """A --recent value (tokens, or "N%" of the budget, rounded down, at least 1) in tokens;
    None is CaMConfig's default for the budget."""
    if recent is None:
        return default_recent(budget)
    if isinstance(recent, str):
        return max(1, int(budget * float(recent[:-1]) / 100))
    return recent


SNAPKV_WINDOW = 64  # kvpress SnapKVPress: window_size 64, kernel_size 5
SNAPKV_KERNEL = 5


def snapkv_config(budget: int, context: int, after_context: int, settings: CacheSettings) -> CaMConfig:
    """SnapKV as kvpress runs it, in camkv's terms: no eviction until the context's last
    chunk, which compresses the whole context once to the budget, scored by its last 64
    queries (window scoring) pooled over 5 tokens, those 64 kept (recent), no sinks;
    then the slack holds the question and answer with nothing evicted. (kvpress averages
    each head's attention over 5 tokens, then the group's heads; camkv sums the group's
    and takes the maximum over 5 tokens.) The question must then come one token a step:
    a block of several would be compressed with the decode steps (camkv.eval.ruler)."""
    slack = context - budget - 1  # the context's last chunk passes budget + slack
    if slack < after_context:
        raise ValueError(f"snapkv: a budget of {budget} of a {context}-token context leaves "
                         f"{slack} rows of slack, fewer than the {after_context} question and "
                         "answer tokens that must not evict")
    return CaMConfig(budget=budget, n_sink=0, recent=min(SNAPKV_WINDOW, budget - 1), merge="drop",
                     scoring="query", prefill="chunk", slack=slack, prefill_scoring="window",
                     observation_window=SNAPKV_WINDOW, pool=SNAPKV_KERNEL, seed=settings.seed,
                     backend=settings.backend)


def _config_for(arm: Arm, budget: int, settings: CacheSettings) -> CaMConfig:
    """A "config" arm's CaMConfig at this budget, with the run's seed and backend."""
    return arm.config.replace(budget=budget, seed=settings.seed, backend=settings.backend)


def make_cache(model, arm: Arm, budget: int | None, settings: CacheSettings,
               context: int | None = None, after_context: int = 0) -> list:
    """A fresh cache list for one arm (budget is ignored by the full cache). context and
    after_context: the tokens of a RULER prompt's context, and of its question and
    answer after it (the snapkv arm's compression point and slack)."""
    if arm.kind == "snapkv":
        if context is None:
            raise ValueError("the snapkv arm runs on RULER prompts only (--tasks ruler)")
        return camkv_prompt_cache(model, snapkv_config(budget, context, after_context, settings))
    if arm.kind == "config" and arm.equal_bytes:
        return camkv_prompt_cache(model, _config_for(arm, budget, settings),
                                  kv_bytes=default_layer_bytes(model, budget))
    if arm.kind == "config":
        return camkv_prompt_cache(model, _config_for(arm, budget, settings))
    if arm.kind == "full":
        return make_prompt_cache(model)
    if arm.kind == "streaming":
        caches = make_prompt_cache(model)
        return [RotatingKVCache(max_size=budget, keep=settings.n_sink) if type(c) is KVCache
                else c for c in caches]
    return camkv_prompt_cache(
        model, budget=budget, n_sink=settings.n_sink, recent=settings.recent_for(budget),
        merge=arm.merge, gate=arm.gate, scoring=arm.scoring, merge_keys=arm.merge_keys,
        window=settings.window if arm.window is None else arm.window,
        seed=settings.seed, prefill="chunk", backend=settings.backend, slack=settings.slack,
        eviction=arm.eviction, prefill_scoring=arm.prefill_scoring or settings.prefill_scoring,
        observation_window=settings.observation_window, pool=settings.pool,
    )


def release_cache(model, arm: Arm) -> None:
    """Undo what make_cache installed in the model (the attention hook of scoring="query",
    or of a rule that weighs rows by their votes)."""
    if arm.kind in ("snapkv", "config"):
        hook.uninstall(model)  # query scoring (snapkv, the default config) installs it
    elif arm.kind == "camkv" and (arm.scoring == "query" or merges.rule(arm.merge).keeps_votes):
        hook.uninstall(model)


def cache_stats(caches: list) -> dict:
    """KV bytes held (all layers) and camkv's eviction / merge counters."""
    stats = {"kv_bytes": int(kv_bytes(caches))}
    camkv_stats = [c.stats for c in caches if hasattr(c, "stats")]
    if camkv_stats:
        stats["evictions"] = sum(s["evictions"] for s in camkv_stats)
        stats["merges"] = sum(s["merges"] for s in camkv_stats)
    return stats
