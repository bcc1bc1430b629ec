"""camkv on models sharded with MLX's distributed engine (mx.distributed, mlx.launch).

CaM needs no cross-head or cross-layer coordination, so every rank keeps the caches
of the heads and layers it computes. Two things must still be global so that a
sharded run makes the decisions an unsharded run makes (docs/algorithm.md sections 1, 6):

- the gate's row id r = b * H + h uses the global KV head index h and count H
  (tensor parallelism, `model.shard(group)`): head_offset = tensor rank * local heads;
- each layer's seed is the base seed plus the global layer index (pipelines,
  `model.model.pipeline(group)`): this rank's first layer is `model.model.start_idx`.

Both are read from the sharded model itself (the sharded linear layers carry their
group; pipelined models carry their layer range), so `camkv.make_prompt_cache` and
`camkv.apply` need no extra argument.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generation_stream

# The sharded projections mlx-lm's shard() methods build (mlx.nn.layers.distributed).
_HEAD_SHARDING_LAYERS = (nn.AllToShardedLinear, nn.QuantizedAllToShardedLinear)
_ATTENTION_NAMES = ("self_attn", "attention", "attn")
_KV_HEAD_NAMES = ("n_kv_heads", "num_key_value_heads", "num_kv_heads")


@dataclass(frozen=True)
class ShardInfo:
    """Where this process's part of a model sits in the whole model."""

    tensor_rank: int  # rank in the group the heads are sharded over (0 when not sharded)
    tensor_size: int  # size of that group (1 when the heads are not sharded)
    layer_offset: int  # global index of this process's first layer (0 without a pipeline)

    def head_placement(self, local_heads: int) -> tuple[int, int]:
        """(head_offset, n_heads_global) of a layer whose cache holds local_heads KV heads.

        shard_linear gives rank r the r-th of tensor_size equal slices of each
        projection's heads, so this rank's heads start at r * local_heads.
        """
        return self.tensor_rank * local_heads, self.tensor_size * local_heads


def shard_info(model) -> ShardInfo:
    """How `model` is sharded on this process: tensor group (from its sharded
    projections) and pipeline layer range (from model.model.start_idx)."""
    group = _tensor_group(model)
    tensor_rank, tensor_size = (0, 1) if group is None else (group.rank(), group.size())
    inner = getattr(model, "model", None)
    layer_offset = getattr(inner, "start_idx", 0) or 0
    return ShardInfo(tensor_rank, tensor_size, layer_offset)


def local_kv_heads(model, layer_index: int) -> int:
    """KV heads this process computes in layer `layer_index` of model.layers (its own layers).

    mlx-lm's shard() divides the attention's head count by the group size, so
    after sharding the attention module holds this process's count.
    """
    layers = model.layers
    if not 0 <= layer_index < len(layers):
        raise ValueError(f"layer {layer_index} is not one of the model's {len(layers)} layers")
    attention = _attention(layers[layer_index])
    for name in _KV_HEAD_NAMES:
        count = getattr(attention, name, None)
        if isinstance(count, int):
            return count
    raise ValueError(
        f"camkv cannot find the KV head count of layer {layer_index} "
        f"({type(layers[layer_index]).__name__}: no attention attribute "
        f"{' / '.join(_ATTENTION_NAMES)} with {' / '.join(_KV_HEAD_NAMES)}); "
        "it needs it to place a tensor-sharded layer's heads among the model's heads"
    )


def wait_for_generation() -> None:
    """Wait until the work mlx-lm's generate loop left in flight is done.

    generate_step evaluates one step ahead, asynchronously, on its own stream; that
    step's collectives (a sharded model's all-reduces) share the connections with
    any collective issued next on another stream, and interleaved they exchange
    garbage. Call this before a collective that follows a generation.
    """
    mx.synchronize(generation_stream)
    mx.synchronize()


def kv_bytes(caches) -> int:
    """Bytes a model's cache list really holds, all layers and cache kinds (empty ones hold none)."""
    return sum(cache.nbytes for cache in caches if not cache.empty())


def gather_kv_bytes(caches, group: mx.distributed.Group | None = None) -> list[int]:
    """Every rank's KV bytes, in rank order, on every rank (a collective: all ranks call it)."""
    group = group or mx.distributed.init()
    wait_for_generation()
    mine = mx.array([kv_bytes(caches)], dtype=mx.int64)
    # On the CPU stream, like mlx-lm's own synchronising all_sum in sharded_load:
    # a few bytes, and every distributed backend implements its collectives there.
    every = mx.distributed.all_gather(mine, group=group, stream=mx.cpu)
    return [int(b) for b in every.tolist()]


def report_kv_bytes(caches, group: mx.distributed.Group | None = None, file=None) -> list[int]:
    """Gather every rank's KV bytes; rank 0 prints one line per rank and the total.

    A collective: every rank must call it. Returns the per-rank list on every rank.
    """
    group = group or mx.distributed.init()
    per_rank = gather_kv_bytes(caches, group)
    if group.rank() == 0:
        lines = [f"rank {rank}: KV cache {nbytes} bytes" for rank, nbytes in enumerate(per_rank)]
        lines.append(f"all {len(per_rank)} ranks: KV cache {sum(per_rank)} bytes")
        out = file or sys.stdout
        # One write, flushed: the launcher interleaves the ranks' output by chunks.
        out.write("\n".join(lines) + "\n")
        out.flush()
    return per_rank


def _tensor_group(model):
    """The group the model's attention heads are sharded over, or None when they are not."""
    for layer in getattr(model, "layers", []):
        attention = _attention(layer)
        if not isinstance(attention, nn.Module):
            continue  # not an mlx module (a stand-in): nothing of it can be sharded
        for _, module in attention.named_modules():
            if isinstance(module, _HEAD_SHARDING_LAYERS):
                return module.group if module.group.size() > 1 else None
    return None


def _attention(layer):
    for name in _ATTENTION_NAMES:
        attention = getattr(layer, name, None)
        if attention is not None:
            return attention
    return layer  # models whose layer is the attention module itself
