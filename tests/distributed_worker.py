"""One rank of the distributed tests: `mlx.launch --backend ring -n 2 -- python THIS OUT_DIR`.

Every rank builds the same tiny random models (same seeds), runs them unsharded as
the reference, then sharded over the launch's group with camkv caches:

- tensor parallel: a llama with 4 KV heads after model.shard(group), 2 heads a rank;
- pipeline: a qwen2 (mlx-lm's PipelineMixin) after model.model.pipeline(group), 2 layers a rank.

Each scenario runs twice: once through mlx-lm's generate_step (generation completes,
KV bytes), once teacher-forced over a fixed token sequence with the same call sizes
as the reference, so the caches see the same keys as the reference's caches:

- tensor parallel, first layer only, with scoring "key" and "query": its keys (and
  queries) come straight from the sharded k_proj (q_proj), a slice of the same
  weights applied to the same embeddings with no all-reduce before it, so they are
  the reference's bit for bit; later layers follow an all-reduce whose summation
  order changes float bits, so they are not compared.
- pipeline, every layer: the hidden state travels by send/recv, unchanged.

With --repo (a save_tiny_repo folder) it also runs docs/distributed.md's script,
the path a CLI takes: mlx_lm.utils.sharded_load (tensor, then pipeline) and
mlx_lm.stream_generate with camkv caches.

The worker writes what it saw to OUT_DIR/rank<r>.json; tests/test_distributed.py
asserts on it. --fail-on-rank R makes rank R raise after joining the group, while the
other ranks wait in a collective: the launcher must end the job, not hang.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step

import camkv
from camkv.distributed import (
    gather_kv_bytes, kv_bytes, report_kv_bytes, shard_info, wait_for_generation,
)
from tiny_models import tiny_llama

# Small budget against a longer sequence, gate on: evictions, merges and gate draws
# all shape the kept positions, so a wrong head or layer index shows in them.
# merge_keys: a merge changes the survivor's key, hence later scores and evictions.
CAM = dict(budget=24, n_sink=2, recent=4, merge="sim_weighted", merge_keys=True, gate=True,
           seed=5)
PROMPT = [(7 * i + 3) % 120 for i in range(48)]
FORCED = PROMPT + [(11 * i + 5) % 120 for i in range(12)]
CALL_SIZES = [32, 16] + [1] * 12  # chunked prompt, then one token a step
MAX_TOKENS = 8


def tiny_qwen2(*, layers: int = 4, seed: int = 1):
    """A random qwen2 (PipelineMixin: model.model.pipeline(group)), GQA 4 on 2, float32."""
    from mlx_lm.models import qwen2

    args = qwen2.ModelArgs(
        model_type="qwen2", hidden_size=64, num_hidden_layers=layers, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=258,
        rope_theta=10000.0, tie_word_embeddings=True,
    )
    mx.random.seed(seed)
    model = qwen2.Model(args)
    mx.eval(model.parameters())
    return model


def save_tiny_repo(directory: Path) -> Path:
    """tiny_qwen2 saved as an mlx-lm model folder (weights, config, a byte-level
    tokenizer), for mlx_lm.utils.sharded_load."""
    from mlx_lm.utils import save_config, save_model

    from tiny_models import byte_tokenizer

    model = tiny_qwen2()
    save_model(directory, model)  # also writes the weight index a pipeline load reads
    save_config(dict(vars(model.args)), directory / "config.json")
    byte_tokenizer().save_pretrained(directory)
    return directory


def generate(model, caches) -> list[int]:
    steps = generate_step(mx.array(PROMPT), model, max_tokens=MAX_TOKENS, prompt_cache=caches,
                          prefill_step_size=32)
    # generate_step leaves its last step in flight, collectives included: the next
    # collective must wait_for_generation (gather_kv_bytes does).
    return [int(token) for token, _ in steps]


def forced(model, caches) -> None:
    """Feed FORCED through the model in CALL_SIZES calls (the same on every run)."""
    tokens = mx.array(FORCED)
    start = 0
    for size in CALL_SIZES:
        logits = model(tokens[None, start:start + size], cache=caches)
        mx.eval(logits, [c.state for c in caches])
        start += size
    assert start == len(FORCED)


def stored(cache) -> dict:
    keys, _, scores, positions = cache.stored()
    return {"positions": np.array(positions[0]).tolist(), "keys": np.array(keys[0]),
            "scores": np.array(scores[0])}


def first_layer_against_reference(reference, model, config: dict) -> dict:
    """Teacher-forced runs of both models; this rank's first-layer heads next to the reference's."""
    reference_caches = camkv.make_prompt_cache(reference, **config)
    forced(reference, reference_caches)
    caches = camkv.make_prompt_cache(model, **config)
    forced(model, caches)
    camkv.remove(reference)  # the attention hook of scoring="query"
    camkv.remove(model)
    mine, ref = stored(caches[0]), stored(reference_caches[0])
    offset = caches[0]._head_offset
    heads = slice(offset, offset + mine["keys"].shape[0])
    # Control: the same sharded run with its caches drawing as heads 0.. (sharding
    # ignored) must not store what the reference's heads store.
    unplaced_caches = [camkv.CaMKVCache(c.config) for c in camkv.make_prompt_cache(model, **config)]
    forced(model, unplaced_caches)
    camkv.remove(model)
    unplaced = stored(unplaced_caches[0])
    return {
        "unplaced_identical": bool(unplaced["positions"] == ref["positions"][heads]
                                   and np.array_equal(unplaced["keys"], ref["keys"][heads])),
        "positions": mine["positions"],
        "reference_positions": ref["positions"][heads],
        # With merge_keys the stored keys and scores carry every merge: equal only
        # when the inputs and every gate outcome were the reference's.
        "keys_identical": bool(np.array_equal(mine["keys"], ref["keys"][heads])),
        "scores_identical": bool(np.array_equal(mine["scores"], ref["scores"][heads])),
        "merges": caches[0].stats["merges"],
        "evictions": caches[0].stats["evictions"],
    }


def tensor_parallel(group) -> dict:
    reference = tiny_llama(heads=8, kv_heads=4, layers=2)
    reference_caches = camkv.make_prompt_cache(reference, **CAM)
    generate(reference, reference_caches)

    model = tiny_llama(heads=8, kv_heads=4, layers=2)
    model.shard(group)
    caches = camkv.make_prompt_cache(model, **CAM)
    tokens = generate(model, caches)
    gathered = gather_kv_bytes(caches, group)  # right after generation: it must wait
    return {
        "generated": tokens,
        "local_kv_heads": [c.stored()[0].shape[1] for c in caches],
        "reference_kv_heads": [c.stored()[0].shape[1] for c in reference_caches],
        "head_offsets": [c._head_offset for c in caches],
        "n_heads_global": [c._n_heads_global for c in caches],
        "kv_bytes": kv_bytes(caches),
        "reference_kv_bytes": kv_bytes(reference_caches),
        "gathered_kv_bytes": gathered,
        "layer0": {scoring: first_layer_against_reference(reference, model, dict(CAM, scoring=scoring))
                   for scoring in ("key", "query")},
    }


def pipeline(group) -> dict:
    reference = tiny_qwen2()
    reference_gen = camkv.make_prompt_cache(reference, **CAM)
    generate(reference, reference_gen)
    reference_forced = camkv.make_prompt_cache(reference, **CAM)
    forced(reference, reference_forced)

    model = tiny_qwen2()
    model.model.pipeline(group)
    first = shard_info(model).layer_offset
    caches_gen = camkv.make_prompt_cache(model, **CAM)
    tokens = generate(model, caches_gen)
    wait_for_generation()
    caches_forced = camkv.make_prompt_cache(model, **CAM)
    forced(model, caches_forced)

    layers = list(range(first, first + len(caches_forced)))
    mine = [stored(c) for c in caches_forced]
    ref = [stored(reference_forced[i]) for i in layers]
    return {
        "generated": tokens,
        "layers": layers,
        "seeds": [c.config.seed for c in caches_gen],
        "reference_seeds": [reference_gen[i].config.seed for i in layers],
        "kv_bytes": kv_bytes(caches_gen),
        "reference_layer_kv_bytes": [reference_gen[i].nbytes for i in layers],
        "reference_kv_bytes": kv_bytes(reference_gen),
        "positions": [m["positions"] for m in mine],
        "reference_positions": [r["positions"] for r in ref],
        "keys_identical": [bool(np.array_equal(m["keys"], r["keys"])) for m, r in zip(mine, ref)],
        "report": report_kv_bytes(caches_gen, group),
    }


def sharded_load_recipe(repo: Path, group) -> dict:
    """docs/distributed.md's script (the path a CLI takes): sharded_load, then
    stream_generate with camkv caches, for both kinds of sharding."""
    from mlx_lm import stream_generate
    from mlx_lm.utils import sharded_load

    result = {}
    for kind in ("tensor", "pipeline"):
        model, tokenizer = sharded_load(str(repo), **{f"{kind}_group": group})
        caches = camkv.make_prompt_cache(model, **CAM)
        responses = stream_generate(model, tokenizer, PROMPT, max_tokens=MAX_TOKENS,
                                    prompt_cache=caches)
        responses = list(responses)
        result[kind] = {
            "tokens": [r.token for r in responses],
            "text": "".join(r.text for r in responses),
            "kv_heads": [c.stored()[0].shape[1] for c in caches],
            "head_offsets": [c._head_offset for c in caches],
            "seeds": [c.config.seed for c in caches],
            "kv_bytes": gather_kv_bytes(caches, group),
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--fail-on-rank", type=int, default=None)
    parser.add_argument("--repo", type=Path, default=None,
                        help="a save_tiny_repo folder: also run the sharded_load recipe")
    args = parser.parse_args()

    group = mx.distributed.init(strict=True, backend="ring")
    rank = group.rank()
    if rank == args.fail_on_rank:
        raise RuntimeError(f"rank {rank}: deliberate failure (--fail-on-rank {rank})")
    result = {"rank": rank, "size": group.size(), "tensor": tensor_parallel(group),
              "pipeline": pipeline(group)}
    if args.repo is not None:
        result["sharded_load"] = sharded_load_recipe(args.repo, group)
    (args.out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    print(f"rank {rank}: done", flush=True)


if __name__ == "__main__":
    sys.exit(main())
