"""The arms of an evaluation (`camkv eval` and `camkv bench` alike): what each is, the
catalog --methods picks from, and the cache list each makes for a model."""

from __future__ import annotations

from dataclasses import dataclass

from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from .. import hook, merges
from ..config import CAM_STREAMING, default_recent
from ..distributed import kv_bytes
from ..integration import make_prompt_cache as camkv_prompt_cache


@dataclass(frozen=True)
class Arm:
    """One way of caching, compared with the others on the same tokens: mlx-lm's full
    KVCache ("full"), its RotatingKVCache as StreamingLLM ("streaming"), or a camkv
    cache with these settings ("camkv"). The budget comes with each run."""

    name: str
    kind: str  # "full", "streaming" or "camkv"
    merge: str = "drop"
    gate: bool = False
    scoring: str = "key"
    merge_keys: bool = False
    eviction: str = "score"
    window: int | None = None  # survivors of a window rule; None: the run's --window


MERGE_ARMS = merges.names(kind=merges.NEAREST) + merges.names(kind=merges.WINDOW)  # every rule but drop (h2o)
KEY_MERGE_ARMS = merges.names(keys_allowed=True)  # the rules that can blend keys too


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
    return {m.name: m for m in methods}


def is_retired(arm: Arm) -> bool:
    """Whether the arm merges by a retired rule (camkv.merges): named, it still runs; no
    group and no list of the command line offers it."""
    return arm.kind == "camkv" and bool(merges.rule(arm.merge).retired)


def offered_methods() -> list[str]:
    """The arms the command line lists, in catalog order: all but the retired rules'."""
    return [n for n, m in method_catalog().items() if not is_retired(m)]


METHOD_GROUPS = {
    "all": offered_methods(),
    "key": [n for n in offered_methods() if method_catalog()[n].scoring == "key"],
    "core": ["full", "streamingllm", "h2o", "h2o-query", "mass_weighted-nogate", "window"],
    # How to merge: every offered blend rule against dropping, ungated, both scorings.
    "merge": ["full"] + [name + suffix for suffix in ("", "-query") for name in
                         ("h2o", "mass_weighted-nogate", "value_norm-nogate", "window-nogate")],
}


def parse_methods(spec: str) -> list[Arm]:
    catalog = method_catalog()
    names: list[str] = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        if item in METHOD_GROUPS:
            names += METHOD_GROUPS[item]
        elif item in catalog:
            names.append(item)
        else:
            raise ValueError(
                f"--methods: unknown method {item!r}; known: groups {sorted(METHOD_GROUPS)} "
                f"or {', '.join(catalog)}"
            )
    if "full" not in names:
        names.insert(0, "full")  # every metric is measured against it
    return [catalog[n] for n in dict.fromkeys(names)]


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


def make_cache(model, arm: Arm, budget: int | None, settings: CacheSettings) -> list:
    """A fresh cache list for one arm (budget is ignored by the full cache)."""
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
        eviction=arm.eviction, prefill_scoring=settings.prefill_scoring,
        observation_window=settings.observation_window, pool=settings.pool,
    )


def release_cache(model, arm: Arm) -> None:
    """Undo what make_cache installed in the model (the attention hook of scoring="query",
    or of a rule that weighs rows by their votes)."""
    if arm.kind == "camkv" and (arm.scoring == "query" or merges.rule(arm.merge).keeps_votes):
        hook.uninstall(model)


def cache_stats(caches: list) -> dict:
    """KV bytes held (all layers) and camkv's eviction / merge counters."""
    stats = {"kv_bytes": int(kv_bytes(caches))}
    camkv_stats = [c.stats for c in caches if hasattr(c, "stats")]
    if camkv_stats:
        stats["evictions"] = sum(s["evictions"] for s in camkv_stats)
        stats["merges"] = sum(s["merges"] for s in camkv_stats)
    return stats
