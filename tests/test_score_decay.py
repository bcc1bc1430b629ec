"""CaMConfig.score_decay (docs/algorithm.md section 7): before a compression adds its mass,
the settled rows' scores are multiplied by the decay; the rule against a hand-computed
case, every backend against the reference, the values refused, and the command-line flag.
(The default 1.0 leaves every run bit for bit as recorded: tests/test_state_identity.py.)"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from camkv import CaMConfig, CaMKVCache
from camkv.cli import build_parser, kv_fields
from conftest import assert_config_refused
from tiny_models import feed_with_queries

# One row (B = H = 1), keys of two features. A and B form the first block, C, D and E the
# second; every key is 0 but C's and E's, so every logit of E's query is 0 but C's and E's own.
E_KEY, C_KEY = 1.25, 1.57
SCALE = 1 / math.sqrt(2)  # key scoring's 1/sqrt(Dk)


def _hand_cfg(decay: float) -> CaMConfig:
    """Key scoring by each block's last query alone; 2 of the 5 tokens go, E is recent."""
    return CaMConfig(budget=3, n_sink=0, recent=1, slack=0, scoring="key", prefill_scoring="window",
                     observation_window=1, score_decay=decay, backend="reference")


def _block(first: list[float]) -> mx.array:
    """Keys (and values) [1, 1, S, 2] whose first features are `first`, the second 0."""
    return mx.array([[[[x, 0.0] for x in first]]], mx.float32)


def _hand_scores(decay: float) -> dict[int, float]:
    """Section 7 by hand: B's query gives A and B 1/2 each; the compression of C, D, E
    multiplies those by the decay, then adds E's softmax weights over A..E."""
    logits = [0.0, 0.0, SCALE * E_KEY * C_KEY, 0.0, SCALE * E_KEY * E_KEY]
    total = sum(math.exp(x) for x in logits)
    weights = [math.exp(x) / total for x in logits]
    return {p: (decay * 0.5 if p < 2 else 0.0) + weights[p] for p in range(5)}


def _hand_run(decay: float, backend: str = "reference") -> CaMKVCache:
    cache = CaMKVCache(_hand_cfg(decay).replace(backend=backend))
    cache.update_and_fetch(_block([0.0, 0.0]), _block([0.0, 0.0]))
    cache.compress_pending()
    cache.update_and_fetch(_block([C_KEY, 0.0, E_KEY]), _block([C_KEY, 0.0, E_KEY]))
    return cache


@pytest.mark.parametrize("decay, kept", [
    (1.0, [0, 1, 4]),  # A and B carry 1/2 each: C (about 0.39) and D go
    (0.5, [1, 2, 4]),  # A and B carry 1/4 each, below C: D and then A (the tie of A and B to the older) go
    (0.0, [2, 3, 4]),  # E's weights alone: A, B and D tie at the lowest, the two oldest go
])
def test_the_settled_scores_are_decayed_before_the_compression_adds_its_mass(decay, kept):
    cache = _hand_run(decay)
    _, _, scores, positions = cache.stored()
    assert positions[0, 0].tolist() == kept
    want = _hand_scores(decay)
    np.testing.assert_allclose(np.array(scores[0, 0]), [want[p] for p in kept], rtol=1e-6)


def test_stored_shows_the_settled_scores_as_the_next_compression_will_decay_them():
    cache = CaMKVCache(_hand_cfg(0.25).replace(budget=8, recent=2))
    cache.update_and_fetch(_block([0.0, 0.0]), _block([0.0, 0.0]))
    cache.compress_pending()
    cache.update_and_fetch(_block([0.0, 0.0]), _block([0.0, 0.0]))
    shown = cache.stored()[2]
    cache.compress_pending()  # all four fit: nothing is evicted
    assert mx.array_equal(shown, cache.stored()[2]).item()
    np.testing.assert_allclose(np.array(shown[0, 0]), [0.25 * 0.5 + 0.25] * 2 + [0.25] * 2, rtol=1e-6)


def _feed(cache: CaMKVCache, sizes, seed: int = 5, heads: int = 2, groups: int = 2, dim: int = 8) -> CaMKVCache:
    """A random prompt fed in blocks of the given sizes with their queries, as camkv's
    attention hook hands them over (tiny_models.feed_with_queries)."""
    return feed_with_queries(cache, sizes, seed=seed, heads=heads, groups=groups, k_dim=dim, v_dim=dim, scale=0.4)


SIZES = [9, 10, 7] + [1] * 9  # three prompt blocks (two compressions), then decode steps under slack


def _decay_cfg(merge: str, decay: float) -> CaMConfig:
    return CaMConfig(budget=12, n_sink=1, recent=3, slack=2, merge=merge, scoring="query", observation_window=4,
                     score_decay=decay)


def _check_as_reference(cfg: CaMConfig, monkeypatch, engine=None) -> None:
    """The cache's rows after SIZES on cfg's backend (or on engine, a backend object)
    equal the reference's run: kept positions exactly, scores and values within section
    8's tolerances (random keys: no near-ties)."""
    monkeypatch.setattr(CaMKVCache, "_queries_can_come", lambda self: True)
    cache = CaMKVCache(cfg)
    if engine is not None:
        cache._backend = lambda: engine
    got = _feed(cache, SIZES).stored()
    want = _feed(CaMKVCache(cfg.replace(backend="reference")), SIZES).stored()
    undecayed = _feed(CaMKVCache(cfg.replace(backend="reference", score_decay=1.0)), SIZES).stored()
    assert not mx.array_equal(want[2], undecayed[2]).item()  # the decay took part
    np.testing.assert_array_equal(np.array(got[3]), np.array(want[3]))
    np.testing.assert_allclose(np.array(got[2]), np.array(want[2]), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.array(got[1]), np.array(want[1]), rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore::camkv.VotesWarning")  # keepkv's votes: no model attends here
@pytest.mark.parametrize("merge", ["drop", "mass_weighted", "keepkv"])
@pytest.mark.parametrize("decay", [0.0, 0.3])
def test_every_backend_decays_as_the_reference(backend, merge, decay, monkeypatch):
    """Prompt blocks and decode steps under slack, compressed by each backend, against
    the reference's run."""
    if backend == "reference":
        pytest.skip("the reference is the oracle itself")
    _check_as_reference(_decay_cfg(merge, decay).replace(backend=backend), monkeypatch)


class _ReferenceAsGpu:
    """The reference dressed as a GPU backend: the cache then compresses a chunk of several
    tokens by the whole-device MLX engines (camkv.backends.drop, merge_ops), which run on
    the CPU too, and a decode step's compression by this update."""

    __name__ = "camkv.backends.cuda"
    target = "cuda"

    def update(self, *args, **kwargs):
        from camkv import reference

        return reference.update(*args, **kwargs)


@pytest.mark.filterwarnings("ignore::camkv.VotesWarning")
@pytest.mark.parametrize("merge", ["drop", "mass_weighted", "keepkv"])
def test_the_whole_device_engines_decay_as_the_reference(merge, monkeypatch):
    _check_as_reference(_decay_cfg(merge, 0.3), monkeypatch, engine=_ReferenceAsGpu())


@pytest.mark.parametrize("fields, words", [
    (dict(score_decay=-0.5), ["score_decay", "-0.5", "[0, 1]"]),
    (dict(score_decay=1.5), ["score_decay", "1.5", "[0, 1]"]),
    (dict(score_decay=float("nan")), ["score_decay", "nan", "[0, 1]"]),
    (dict(score_decay="0.5"), ["score_decay", "'0.5'", "[0, 1]"]),
    (dict(score_decay=True), ["score_decay", "True", "[0, 1]"]),
    (dict(score_decay=0.5, prefill="exact", slack=0, prefill_scoring="causal"),
     ["score_decay=0.5", "prefill='chunk'", "'exact'"]),
])
def test_bad_decays_are_refused_naming_the_value(fields, words):
    assert_config_refused(fields, words)


def test_the_flag_sets_the_decay_as_a_number():
    args = build_parser().parse_args(["generate", "--prompt", "x", "--kv-score-decay", "0.25"])
    assert CaMConfig(**kv_fields(args)).score_decay == 0.25
    assert CaMConfig(score_decay=0).score_decay == 0.0 and CaMConfig().score_decay == 1.0
