"""Stored states after a scripted run, bit for bit as recorded.

One script per scenario (a configuration on the reference or the ext backend): a prompt
prefilled in chunks by mlx-lm's generate_step (which reads every cache's state after
each chunk) and decoded; a save and load of the prompt cache and more tokens on the
loaded one; requests merged into batch caches, decoded, extended by another request,
filtered and extracted; a left-padded batch prompt; mlx-lm's batch_generate. After each
phase every layer's held rows (keys, values, scores, positions, and votes and threshold
where the rule keeps them, as its state holds them), its counters and the tokens
generated are recorded.

tests/data/states-identity.npz holds what the code recorded (regenerate it only for a
deliberate change of behaviour, and say so in docs/algorithm.md), every run, or only the
runs named (NAME-BACKEND, as the test ids), the others kept as recorded:

    python tests/test_state_identity.py --record tests/data/states-identity.npz [RUN ...]
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import mlx.core as mx
import pytest
from mlx_lm.generate import batch_generate, generate_step
from mlx_lm.tokenizer_utils import TokenizerWrapper

import camkv
from camkv import BatchCaMKVCache, CaMConfig, backends

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_models import byte_tokenizer, tiny_llama  # noqa: E402

FIXTURE = Path(__file__).resolve().parent / "data" / "states-identity.npz"
DIGEST_ABOVE = 256  # arrays of more elements are recorded by digest
STEP = 48  # prefill step: the first prompt is prefilled in several chunks
# The state's items about rows not scored yet (none once compress_pending ran); the
# meta recorded is the rest.
PENDING_META = ("settled", "pending", "windowed", "waiting")
# The config fields the fixture records. Fields added since are left out of the recorded
# meta, and each must hold its default in every scenario (so none changes a run unseen).
RECORDED_CONFIG = ("backend", "budget", "eviction", "gate", "merge", "merge_keys", "n_sink", "observation_window",
                   "pool", "prefill", "prefill_scoring", "recent", "scoring", "seed", "slack", "window")

# name -> (config fields, model dtype). Rules the kernels run are recorded on both
# backends; the reference-only rules (votes, thresholds) on the reference.
SCENARIOS = {
    "drop": (dict(budget=32, slack=4, merge="drop"), mx.float32),
    "drop_f16_pool": (dict(budget=32, slack=6, merge="drop", pool=3, observation_window=8), mx.float16),
    "mass_gate_keys": (dict(budget=24, slack=3, merge="mass_weighted", gate=True, merge_keys=True,
                            prefill_scoring="causal"), mx.float32),
    "key_recency": (dict(budget=20, slack=2, merge="mean", scoring="key", eviction="recency"), mx.float32),
    "exact_window": (dict(budget=16, slack=0, merge="window", prefill="exact"), mx.float32),
    "value_norm_bf16": (dict(budget=28, slack=0, merge="value_norm", seed=5), mx.bfloat16),
}
REFERENCE_ONLY = {
    "keepkv": (dict(budget=24, slack=3, merge="keepkv"), mx.float32),
    "d2o": (dict(budget=24, slack=2, merge="d2o", merge_keys=True), mx.float32),
}


def runs() -> list[tuple[str, str]]:
    """(scenario, backend) pairs recorded."""
    pairs = [(name, backend) for name in SCENARIOS for backend in ("reference", "ext")]
    return pairs + [(name, "reference") for name in REFERENCE_ONLY]


def _prompt(n: int, salt: int) -> list[int]:
    return [(7 * i + 13 * salt + 1) % 250 for i in range(n)]


def _as_numpy(a) -> np.ndarray:
    a = mx.array(a)
    return np.array(a.astype(mx.float32) if a.dtype in (mx.float16, mx.bfloat16) else a)


def _put(out: dict, key: str, a) -> None:
    """Record a: in full when small, else (keys and values) its shape and the SHA-256 of
    its bytes, which keeps the fixture small and the comparison bit for bit."""
    a = _as_numpy(a)
    if a.size <= DIGEST_ABOVE:
        out[key] = a
        return
    digest = hashlib.sha256(str((a.dtype, a.shape)).encode() + a.tobytes()).digest()
    out[f"{key}.sha256"] = np.frombuffer(digest, np.uint8)


def _layer_record(cache, prefix: str, out: dict) -> None:
    """One CaMKVCache's held rows and counters under prefix."""
    out[f"{prefix}/counters"] = np.array([cache.offset, cache.size()] + [
        cache.stats[k] for k in ("tokens_seen", "query_scored", "evictions", "merges", "rows", "stored")])
    if cache.empty():
        return
    for name, a in zip(("keys", "values", "scores", "positions"), cache.stored()):
        _put(out, f"{prefix}/{name}", a)


def _state_record(caches, prefix: str, out: dict) -> None:
    """Every layer's saved state (what camkv.save_prompt_cache writes: the pending rows
        compressed first) under prefix."""
    for i, cache in enumerate(caches):
        cache.compress_pending()
        state = cache.state
        meta = json.loads(state[5])
        pending = {k: meta.pop(k) for k in PENDING_META}  # what a compressed cache's say, checked here
        assert pending == {"settled": cache.size(), "pending": None, "windowed": pending["windowed"], "waiting": 0}
        newer = {k: meta["config"].pop(k) for k in list(meta["config"]) if k not in RECORDED_CONFIG}
        defaults = json.loads(CaMConfig().to_json())
        assert newer == {k: defaults[k] for k in newer}
        out[f"{prefix}/{i}/meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
        for name, a in zip(("keys", "values", "scores", "positions", "merges", "", "votes", "threshold"), state):
            if name and a is not None:
                _put(out, f"{prefix}/{i}/{name}", a)


def _generate(model, prompt, max_tokens: int, cache) -> list[int]:
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens, prompt_cache=cache,
                                             prefill_step_size=STEP)]


def _decode(model, batch, tokens: mx.array, steps: int) -> tuple[mx.array, list[list[int]]]:
    """Greedy decode steps over batch caches from tokens [B, 1]."""
    out = []
    for _ in range(steps):
        tokens = mx.argmax(model(tokens, cache=batch)[:, -1:], axis=-1)
        mx.eval(tokens)
        out.append(tokens[:, 0].tolist())
    return tokens, out


def _script(model, cfg: CaMConfig, out: dict, folder: Path) -> None:
    layers = len(model.layers)
    # A lone request, then its prompt cache saved, loaded and continued.
    cache = camkv.make_prompt_cache(model, cfg)
    out["alone/tokens"] = np.array(_generate(model, _prompt(150, 0), 24, cache))
    for i, c in enumerate(cache):
        _layer_record(c, f"alone/{i}", out)
    path = str(folder / "prompt.safetensors")
    camkv.save_prompt_cache(path, cache)
    loaded = camkv.load_prompt_cache(path)
    out["loaded/tokens"] = np.array(_generate(model, _prompt(9, 1), 16, loaded))
    for i, c in enumerate(loaded):
        _layer_record(c, f"loaded/{i}", out)
    _state_record(loaded, "loaded_state", out)

    # Batch joins: two prefilled requests merged, decoded, extended by a third, filtered.
    requests = [camkv.make_prompt_cache(model, cfg) for _ in range(3)]
    firsts = [_generate(model, _prompt(n, 2 + j), 1, c)[0] for j, (n, c) in enumerate(zip((61, 25, 90), requests))]
    batch = [BatchCaMKVCache.merge([requests[0][i], requests[1][i]]) for i in range(layers)]
    tokens, steps = _decode(model, batch, mx.array([[firsts[0]], [firsts[1]]]), 20)
    for i in range(layers):
        batch[i].extend(BatchCaMKVCache.merge([requests[2][i]]))
    tokens, more = _decode(model, batch, mx.concatenate([tokens, mx.array([[firsts[2]]])]), 14)
    for i in range(layers):
        batch[i].filter([2, 0])
    tokens, last = _decode(model, batch, tokens[mx.array([2, 0])], 9)
    out["joined/tokens"] = np.array(sum(steps, []) + sum(more, []) + sum(last, []))
    for b in range(2):
        rows = [batch[i].extract(b) for i in range(layers)]
        for i, c in enumerate(rows):
            _layer_record(c, f"joined/{b}/{i}", out)
        _state_record(rows, f"joined_state/{b}", out)

    # A left-padded batch prompt, then decode steps.
    rows = [camkv.make_prompt_cache(model, cfg) for _ in range(2)]
    padded = [BatchCaMKVCache([rows[0][i], rows[1][i]], left_padding=[3, 0]) for i in range(layers)]
    prompt = mx.array([[0] * 3 + _prompt(40, 5), _prompt(43, 6)])
    first = mx.argmax(model(prompt, cache=padded)[:, -1:], axis=-1)
    _, steps = _decode(model, padded, first, 12)
    out["padded/tokens"] = np.array(sum(steps, []))
    for b in range(2):
        rows = [padded[i].extract(b) for i in range(layers)]
        for i, c in enumerate(rows):
            _layer_record(c, f"padded/{b}/{i}", out)
        _state_record(rows, f"padded_state/{b}", out)

    # mlx-lm's own batching (prompts split, joined and filtered by BatchGenerator), over
    # the caches of a camkv.apply'd model.
    tokenizer = TokenizerWrapper(byte_tokenizer())
    prompts = [_prompt(n, 7 + j) for j, n in enumerate((70, 12, 130))]
    camkv.apply(model, cfg)
    result = batch_generate(model, tokenizer, prompts, max_tokens=10, return_token_ids=True,
                            return_prompt_caches=True, prefill_step_size=STEP)
    out["batch_generate/tokens"] = np.array(sum(result.token_ids, []))
    for b, caches in enumerate(result.caches):
        for i, c in enumerate(caches):
            _layer_record(c, f"batch_generate/{b}/{i}", out)
        _state_record(caches, f"batch_generate_state/{b}", out)


def record_run(name: str, backend: str) -> dict:
    """What the script records for one scenario on one backend (keys without the run's prefix)."""
    fields, dtype = {**SCENARIOS, **REFERENCE_ONLY}[name]
    model = tiny_llama(heads=4, kv_heads=2, layers=2, vocab=258)
    model.set_dtype(dtype)
    out: dict = {}
    try:
        with tempfile.TemporaryDirectory() as folder:
            _script(model, CaMConfig(**fields, backend=backend), out, Path(folder))
    finally:
        camkv.remove(model)
    return out


def _recorded() -> dict:
    with np.load(FIXTURE) as data:
        return {k: data[k] for k in data.files}


@pytest.mark.parametrize(("name", "backend"), runs(), ids=[f"{n}-{b}" for n, b in runs()])
def test_stored_states_are_bit_identical_to_the_recorded_ones(name, backend):
    if backends.available()[backend] is not None:
        pytest.skip(f"{backend}: {backends.available()[backend]}")
    recorded = {k.split("|", 1)[1]: v for k, v in _recorded().items() if k.startswith(f"{name}-{backend}|")}
    assert recorded, f"the fixture has no run {name}-{backend}"
    got = record_run(name, backend)
    assert sorted(got) == sorted(recorded)
    differing = [k for k in sorted(got) if not (got[k].dtype == recorded[k].dtype and got[k].shape == recorded[k].shape
                                                and np.array_equal(got[k], recorded[k], equal_nan=True))]
    assert not differing, f"{name} on {backend}: {len(differing)} records differ, first {differing[:5]}"


def _record(path: Path, only: list[str]) -> None:
    """Record every run into path, or only the runs named, keeping path's other runs."""
    ids = [f"{n}-{b}" for n, b in runs()]
    unknown = sorted(set(only) - set(ids))
    if unknown:
        sys.exit(f"unknown runs {unknown}; known: {ids}")
    everything = {}
    if only:
        with np.load(path) as kept:
            everything = {k: kept[k] for k in kept.files if k.split("|", 1)[0] not in only}
    for (name, backend), run in zip(runs(), ids):
        if only and run not in only:
            continue
        everything.update({f"{run}|{k}": v for k, v in record_run(name, backend).items()})
        print(f"recorded {name} on {backend}", flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, **everything)


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] != "--record":
        sys.exit("usage: python tests/test_state_identity.py --record FILE.npz [NAME-BACKEND ...]")
    _record(Path(sys.argv[2]), sys.argv[3:])
