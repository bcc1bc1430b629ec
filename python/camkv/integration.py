"""Hand camkv to mlx-lm: build a model's cache list, or make the model build it itself."""

from __future__ import annotations

from contextlib import contextmanager

from mlx_lm.models.cache import KVCache

from . import backends, byte_budget, hook, merges
from .cache import CaMKVCache
from .config import UINT32_MAX, CaMConfig, resolve_config
from .distributed import ShardInfo, kv_bytes, local_kv_heads, shard_info  # kv_bytes: cli.py's name for it

_ORIGINAL = "_camkv_original_make_cache"


def _model_default_cache(model) -> list:
    """The caches the model makes without camkv (its own make_cache, else one KVCache a layer)."""
    maker = getattr(model, _ORIGINAL, None)
    if maker is None and hasattr(model, "make_cache"):
        maker = model.make_cache
    if maker is not None:
        return maker()
    return [KVCache() for _ in model.layers]


def make_prompt_cache(model, config: CaMConfig | None = None, *, kv_bytes: int | str | None = None,
                      **fields) -> list:
    """The model's cache list with each plain full-attention KVCache replaced by a CaMKVCache.

    Layer i gets seed = base seed + i (mod 2^32). On a model sharded over processes
    (model.shard(group), or a pipeline) i and the gate's head indices are global, so
    every rank draws what an unsharded run draws (camkv.distributed). Other cache
    kinds (rotating, arrays / SSM, chunked) are kept as the model makes them. With scoring="query"
    (the default), or a merge rule that weighs rows by their votes (keepkv), the attention hook
    is installed in the model's modules; camkv.remove(model) takes it out again once the caches
    are done with.

    kv_bytes (an int, or a string like "64MiB"): the most one layer may hold, all its KV
    heads together; each layer's budget (and quantization group) is chosen for its head
    shape, rows at 4 bits in groups of 32 unless bits= or config says otherwise
    (camkv.byte_budget, docs/kv-bytes.md). budget= cannot be given with it.
    """
    check_model(model)
    base = usable_config(config, byte_budget.fields_for(config, fields, kv_bytes))
    caches = _model_default_cache(model)
    shards = shard_info(model)
    layer_configs = _layer_configs(model, caches, base, kv_bytes, shards)  # refused here, before the hook
    hooked = hook.install(model) if needs_hook(base) else None
    model_type = getattr(getattr(model, "args", None), "model_type", None)
    for i, layer_config in layer_configs.items():
        caches[i] = _camkv_cache(model, i, layer_config, shards)
        caches[i].model_type = model_type
        caches[i].hook_modules = hooked
    return caches


def _layer_configs(model, caches: list, base: CaMConfig, kv_bytes, shards: ShardInfo) -> dict:
    """Layer index -> the config of each layer camkv takes over (a plain KVCache): base, or
    with kv_bytes the budget chosen for that layer's heads (ValueError when none fits)."""
    return {i: base if kv_bytes is None else byte_budget.for_layer(model, i, base, kv_bytes, shards)
            for i, cache in enumerate(caches) if type(cache) is KVCache}


def check_model(model) -> None:
    """TypeError unless model is an mlx-lm model: something with layers, as mlx_lm.load returns."""
    if not hasattr(model, "layers"):
        raise TypeError(f"model must be an mlx-lm model (with .layers, as mlx_lm.load returns), "
                        f"got {type(model).__name__}")


def needs_hook(config: CaMConfig) -> bool:
    """Whether caches of this config need camkv's attention hook: to score with the model's
    queries, or to weigh each row by its votes in attention (rules with keeps_votes)."""
    return config.scoring == "query" or merges.rule(config.merge).keeps_votes


def usable_config(config: CaMConfig | None = None, fields: dict | None = None) -> CaMConfig:
    """The CaMConfig of config / fields, refused now if its backend cannot run here.

    CaMConfig accepts every backend name (a config may be written on one machine and
    used on another); a cache only resolves its backend at the first update, which
    would fail in the middle of a generation.
    """
    base = resolve_config(config, fields or {})
    backends.require_usable(base.backend)
    return base


def _camkv_cache(model, i: int, base: CaMConfig, shards: ShardInfo) -> CaMKVCache:
    """Layer i of this process's layers, placed among the whole model's layers and heads."""
    seed = (base.seed + shards.layer_offset + i) & UINT32_MAX
    if shards.tensor_size == 1:
        return CaMKVCache(base.replace(seed=seed))
    head_offset, n_heads_global = shards.head_placement(local_kv_heads(model, i))
    return CaMKVCache(
        base.replace(seed=seed), head_offset=head_offset, n_heads_global=n_heads_global
    )


def apply(model, config: CaMConfig | None = None, *, kv_bytes: int | str | None = None, **fields):
    """Make `model.make_cache` build camkv caches, so mlx_lm.generate and friends use them.

    Returns the model. With scoring="query" (the default), or a rule that weighs rows by
    their votes, the attention hook goes in now, so caches built elsewhere
    (camkv.load_prompt_cache) get what it hands over too. Undo both with `camkv.remove(model)`, or use `camkv.applied(...)` as a
    context manager. kv_bytes: a byte budget per layer, as make_prompt_cache's.
    """
    check_model(model)
    base = usable_config(config, byte_budget.fields_for(config, fields, kv_bytes))
    if kv_bytes is not None:  # a byte budget no layer fits fails now, not at each request
        _layer_configs(model, _model_default_cache(model), base, kv_bytes, shard_info(model))
    if needs_hook(base):
        hook.install(model)
    if not hasattr(model, _ORIGINAL):
        object.__setattr__(model, _ORIGINAL, getattr(model, "make_cache", None))
    object.__setattr__(model, "make_cache", lambda: make_prompt_cache(model, base, kv_bytes=kv_bytes))
    return model


def remove(model) -> None:
    """Undo apply (and the attention hook): the model makes its own caches again."""
    hook.uninstall(model)
    if not hasattr(model, _ORIGINAL):
        return
    original = getattr(model, _ORIGINAL)
    object.__delattr__(model, "make_cache")
    object.__delattr__(model, _ORIGINAL)
    # A make_cache the class defines comes back by itself; one set on the
    # instance before apply is put back.
    if original is not None and getattr(model, "make_cache", None) != original:
        object.__setattr__(model, "make_cache", original)


@contextmanager
def applied(model, config: CaMConfig | None = None, **fields):
    """Context manager form of apply / remove."""
    apply(model, config, **fields)
    try:
        yield model
    finally:
        remove(model)
