"""CaMConfig: every knob of docs/algorithm.md section 1, validated before any state changes."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from . import merges, policy

MERGE_MODES = merges.names()  # the rules of camkv.merges, in kernel-code order
SCORING_MODES = ("key", "query")
PREFILL_MODES = ("exact", "chunk")
BACKENDS = ("auto", "reference", "ext", "metal", "cuda")
EVICTION_MODES = ("score", "recency")
PREFILL_SCORING_MODES = ("causal", "window", "reconstruct")
UINT32_MAX = 2**32 - 1
QUANTIZED_BITS = (8, 4)  # what CaMConfig.bits may be besides None (MLX's affine mx.quantize)
GROUP_SIZES = (32, 64, 128)  # what CaMConfig.group_size may be (mx.quantize's group sizes)
TIER_BITS = (2, 3, 4)  # what CaMConfig.tier_bits may be (the low-precision tier)


def _field(default, flag: str, help_text: str, choices: tuple[str, ...] | None = None):
    """A CaMConfig field with what its command-line flag needs: --kv-<flag>, help, choices."""
    return dataclasses.field(default=default, metadata={"flag": flag, "help": help_text, "choices": choices})


def default_recent(budget: int) -> int:
    """The recent window a budget gets by default: a quarter of it, at least 1."""
    return max(1, budget // 4)


def default_slack(budget: int, prefill: str) -> int:
    """The slack a budget gets by default: an eighth of it with chunk prefill, else 0.

    An eighth: a compression then runs every budget // 8 + 1 decode steps, and its
    cost (scoring those tokens over about 1.1 x budget rows, one partition, one gather)
    spreads over them (bench/results/README.md, "Amortized eviction")."""
    return budget // 8 if prefill == "chunk" else 0


def default_prefill_scoring(prefill: str) -> str:
    """How prompt chunks are scored by default: by their last observation_window queries
    with chunk prefill (cheaper than every query and closer to the full cache on the
    measured models: bench/results/README.md), causally token by token with "exact"."""
    return "window" if prefill == "chunk" else "causal"


def _check_int(name: str, value, minimum: int, maximum: int | None = None) -> None:
    # bool is an int subclass; a True budget is a bug, not a 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"CaMConfig.{name} must be an integer, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        allowed = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"CaMConfig.{name} must be {allowed}, got {value!r}")


def _check_choice(name: str, value, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(
            f"CaMConfig.{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}"
        )


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"CaMConfig.{name} must be True or False, got {value!r}")


@dataclass(frozen=True)
class CaMConfig:
    """Configuration of one CaM cache (one transformer layer).

    Fields (defaults in brackets):

    - budget [512]: most tokens a row (batch element, KV head) keeps.
    - n_sink [4]: the first positions, never evicted (attention sinks).
    - recent [a quarter of the budget]: the newest positions, never evicted
      (p - recent < position). None (the default) means budget // 4 (at least 1), and
      follows the budget through replace(budget=...). A quarter by default: on
      SmolLM2-135M over 4k-token windows of real text it halved the KL divergence from
      the full cache against 32 tokens at a 20% budget (0.173 -> 0.084 with merge="drop")
      with the same passkey accuracy on the same prompts (bench/results/README.md,
      "The recent window").
    - merge ["drop"]: what happens to an evicted token:
      one of the rules of camkv.merges (each described there: merges.help_text()),
      from "drop" (H2O) to blending it into its nearest survivor or a window of the
      survivors after it. drop by default, because merging did not beat it: with the
      model's own queries scoring the cache, every merge rule measured had a higher KL
      divergence from the full cache than dropping (mass_weighted, the best of them,
      4-17% higher at nine of the ten budget and recent-window settings measured) and
      no better passkey accuracy; merging
      beats dropping only with the weaker key-proxy scoring (bench/results/README.md,
      "Does merging beat dropping?"). The merge rules stay one field away.
    - merge_keys [False]: blend keys as well as values (rules with keys_allowed only).
    - window [4]: survivors a token is spread over by a window rule ("window", "window_mass").
    - gate [False]: merge only with probability clamp(s_e / s_target, 0, 1) (CaM Eq. 14).
      Off by default: on SmolLM2-135M over real text the ungated merge had lower KL
      divergence from the full cache at every budget (bench/results/quality-gpu).
    - seed [0]: uint32 seed of the gate's deterministic draws; each layer adds its index.
    - scoring ["query"]: "query" scores with the model's own queries, which camkv's
      attention hook hands over (installed by camkv.apply / camkv.make_prompt_cache);
      "key" uses each new key as a stand-in query. Query by default: on SmolLM2-135M
      over real text it cut the KL divergence from the full cache 3-7x against the key
      proxy (bench/results/README.md, "Key against query scoring"). A cache that gets
      no queries (no hook installed, or a model whose attention bypasses it) scores
      with keys and says so once (camkv.QueryScoringWarning).
    - prefill ["chunk"]: "exact" runs a multi-token call one token at a time;
      "chunk" scores the whole block at once and evicts once (fast prompts).
    - slack [an eighth of the budget with prefill="chunk", else 0]: amortized eviction.
      A row may hold up to budget + slack tokens; a decode step only writes its key and
      value into the cache's buffer and keeps its queries, and once the rows would pass
      budget + slack, the tokens since the last compression are scored and evicted as
      one chunk, back to budget (docs/algorithm.md section 7). slack=0 evicts at every
      step (the exact per-token rule). None (the default) means budget // 8 and follows
      the budget through replace(budget=...); slack > 0 needs prefill="chunk".
    - backend ["auto"]: "auto", "reference", "ext", "metal" or "cuda".
    - eviction ["score"]: which unprotected token goes first. "score": the one with the
      least accumulated attention (H2O); "recency": the oldest, so a row keeps its sinks
      and its newest tokens (StreamingLLM's rule). Scores are kept either way: the gate
      and the mass-weighted rules read them. CAM_STREAMING is CaM as its authors ran it.
    - prefill_scoring ["window" with prefill="chunk", else "causal"]: how a chunk of
      several tokens from prompt calls is scored. "causal": every chunk token's query
      over the rows up to itself; "window": only the chunk's last observation_window
      queries (SnapKV's observation window), their mass then max-pooled over pool rows;
      "reconstruct": where camkv runs the prompt (camkv.reconstruct.prefill, which its
      generate and eval use), by the weight each token gets while the model re-reads it
      (KVzip's observation), window scoring wherever else a prompt arrives. Compressions
      of decode steps keep every query either way (docs/algorithm.md section 7).
    - observation_window [32]: queries that score a chunk with prefill_scoring="window".
    - pool [1]: odd width of the max-pooling of a window-scored chunk's mass along the
      rows (1: none; SnapKV pools over 5 to 7); only with prefill_scoring="window".
    - bits [None]: None keeps the rows in the model's dtype; 8 or 4 stores the kept keys
      and values quantized (mx.quantize: packed codes, a scale and a bias per group of
      group_size channels, docs/algorithm.md section 12). Scores and positions as always.
    - group_size [64]: channels sharing one scale and bias with bits set: 32, 64 or 128
      (it must divide the head dimensions).
    - tier_budget [0]: with tier_budget > 0, the rows a compression evicts move into a
      second pool of at most tier_budget rows a head, stored at tier_bits, and are
      dropped from there, lowest score first; attention reads both (docs/algorithm.md
      section 13). merge="drop" only.
    - tier_bits [2]: bits of the tier's rows: 2, 3 or 4.
    - score_decay [1.0]: what the held rows' scores are multiplied by before each
      compression adds its mass (docs/algorithm.md section 7), in [0, 1]. 1 accumulates
      every compression's mass (H2O); 0 ranks by the latest compression's queries alone
      (SnapKV, per chunk); between, older mass fades geometrically per compression, so a
      prompt's last chunk (where the question is) weighs more against the earlier ones.
      prefill="chunk" only (exact prefill compresses token by token inside one call).

    Requires n_sink + recent < budget. Invalid values raise ValueError naming the
    field, the bad value and what is allowed.
    """

    # Each field's metadata makes its `--kv-<flag>` command-line flag (camkv.cli).
    budget: int = _field(512, "budget", "most tokens each (sequence, KV head) row keeps")
    n_sink: int = _field(4, "sinks", "first positions never evicted, the attention sinks")
    recent: int | None = _field(None, "recent", "newest positions never evicted; sinks + recent must be "
                                "below the budget (default: a quarter of --kv-budget)")
    merge: str = _field("drop", "merge", merges.help_text(), choices=merges.offered())
    merge_keys: bool = _field(False, "merge-keys", "blend keys as well as values (merge rules that "
                              f"may: {', '.join(merges.names(keys_allowed=True))})")
    window: int = _field(4, "window", "survivors an evicted token is spread over by the window rules")
    gate: bool = _field(False, "gate", "merge only with probability growing with the evicted token's "
                        "attention (CaM's gate); --no-kv-gate always merges")
    seed: int = _field(0, "seed", "seed of the gate's draws, 0..2^32-1")
    scoring: str = _field("query", "scoring", "attention scores from the model's own queries ('query', "
                          "through camkv's attention hook) or each new key as a stand-in ('key')",
                          choices=SCORING_MODES)
    prefill: str = _field("chunk", "prefill", "'chunk' scores and evicts once per prompt chunk; 'exact' "
                          "token by token", choices=PREFILL_MODES)
    slack: int | None = _field(None, "slack", "rows a row may hold over the budget between compressions "
                               "(amortized eviction; 0 evicts at every step) (default: an eighth of "
                               "--kv-budget with --kv-prefill chunk, else 0)")
    backend: str = _field("auto", "backend", "kernel backend ('auto' picks the best one available)",
                          choices=BACKENDS)
    eviction: str = _field("score", "eviction", "which unprotected token goes first: 'score' the least "
                           "attended (H2O), 'recency' the oldest (StreamingLLM)", choices=EVICTION_MODES)
    prefill_scoring: str | None = _field(None, "prefill-scoring", "'causal' scores a prompt chunk with every "
                                         "query; 'window' with its last --kv-observation-window queries "
                                         "only (SnapKV); 'reconstruct' by the attention each token gets while "
                                         "the model re-reads the prompt (KVzip; about twice the prefill's "
                                         "work) (default: window with --kv-prefill chunk, else causal)", choices=PREFILL_SCORING_MODES)
    observation_window: int = _field(32, "observation-window", "queries that score a prompt chunk with "
                                     "--kv-prefill-scoring window")
    pool: int = _field(1, "pool", "odd width of the max-pooling of a window-scored chunk's attention "
                       "mass along the tokens (1: none)")
    bits: int | None = _field(None, "bits", "store the kept keys and values quantized to 8 or 4 bits "
                              "(default: unquantized, the model's dtype)")
    group_size: int = _field(64, "group-size", "channels sharing one quantization scale and bias with "
                             "--kv-bits: 32, 64 or 128")
    tier_budget: int = _field(0, "tier-budget", "evicted rows a head keeps at --kv-tier-bits before they are "
                              "dropped, lowest score first (0: none; --kv-merge drop only)")
    tier_bits: int = _field(2, "tier-bits", "bits of the evicted rows --kv-tier-budget keeps: 2, 3 or 4")
    score_decay: float = _field(1.0, "score-decay", "factor in [0, 1] the held rows' scores are multiplied by "
                                "before each compression adds its mass (1: accumulated, H2O; 0: the latest "
                                "compression's queries alone, SnapKV's per chunk); --kv-prefill chunk only")

    def __post_init__(self) -> None:
        _check_int("budget", self.budget, 1)
        _check_int("n_sink", self.n_sink, 0)
        if self.recent is None:
            object.__setattr__(self, "recent", default_recent(self.budget))
        _check_int("recent", self.recent, 1)
        if self.slack is None:
            object.__setattr__(self, "slack", default_slack(self.budget, self.prefill))
        if self.prefill_scoring is None:
            object.__setattr__(self, "prefill_scoring", default_prefill_scoring(self.prefill))
        _check_int("slack", self.slack, 0)
        _check_int("window", self.window, 1)
        _check_int("seed", self.seed, 0, UINT32_MAX)
        _check_choice("merge", self.merge, MERGE_MODES)
        _check_choice("scoring", self.scoring, SCORING_MODES)
        _check_choice("prefill", self.prefill, PREFILL_MODES)
        _check_choice("backend", self.backend, BACKENDS)
        _check_bool("merge_keys", self.merge_keys)
        _check_bool("gate", self.gate)
        self._check_scoring_policy()
        self._check_score_decay()
        self._check_quantization()
        if self.slack and self.prefill != "chunk":
            raise ValueError(
                f"CaMConfig.slack={self.slack} needs prefill='chunk' (the buffered tokens are "
                f"compressed as one chunk), got prefill={self.prefill!r}; use slack=0"
            )
        rule = merges.rule(self.merge)
        # With drop nothing merges, so merge_keys is moot there (and accepted).
        if self.merge_keys and rule.kind != merges.DROP and not rule.keys_allowed:
            raise ValueError(
                f"CaMConfig.merge_keys=True is not allowed with merge={self.merge!r} "
                f"(only {', '.join(merges.names(keys_allowed=True))} blend keys); use merge_keys=False"
            )
        if self.n_sink + self.recent >= self.budget:
            raise ValueError(
                f"CaMConfig.budget must exceed n_sink + recent = {self.n_sink} + "
                f"{self.recent} = {self.n_sink + self.recent}, got budget={self.budget}"
            )

    def _check_scoring_policy(self) -> None:
        """eviction, prefill_scoring, observation_window and pool."""
        _check_choice("eviction", self.eviction, EVICTION_MODES)
        _check_choice("prefill_scoring", self.prefill_scoring, PREFILL_SCORING_MODES)
        _check_int("observation_window", self.observation_window, 1)
        _check_int("pool", self.pool, 1)
        if self.pool % 2 == 0:
            raise ValueError(f"CaMConfig.pool must be odd (a window centred on each token), got {self.pool}")
        if self.pool != 1 and self.prefill_scoring != "window":
            raise ValueError(f"CaMConfig.pool={self.pool} needs prefill_scoring='window', got "
                             f"prefill_scoring={self.prefill_scoring!r}; use pool=1")
        if policy.windowed(self) and self.prefill != "chunk":
            raise ValueError(f"CaMConfig.prefill_scoring={self.prefill_scoring!r} needs prefill='chunk' (it "
                             f"scores a prompt chunk as a whole), got prefill={self.prefill!r}")
        if self.prefill_scoring == "reconstruct" and self.scoring != "query":
            raise ValueError(f"CaMConfig.prefill_scoring='reconstruct' needs scoring='query' (a re-read's "
                             f"queries come through the attention hook), got scoring={self.scoring!r}")

    def _check_score_decay(self) -> None:
        """score_decay: a number in [0, 1] (NaN is neither), other than 1 only with chunk prefill."""
        decay = self.score_decay
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= decay <= 1.0:
            raise ValueError(f"CaMConfig.score_decay must be a number in [0, 1], got {decay!r}")
        object.__setattr__(self, "score_decay", float(decay))  # an int from JSON (0, 1) as the float it means
        if self.score_decay != 1.0 and self.prefill != "chunk":
            raise ValueError(f"CaMConfig.score_decay={self.score_decay} needs prefill='chunk' (exact prefill "
                             f"compresses token by token within one call), got prefill={self.prefill!r}; "
                             f"use score_decay=1.0")

    def _check_quantization(self) -> None:
        """bits and group_size (MLX's affine quantization offers these)."""
        if self.bits is not None and (isinstance(self.bits, bool) or self.bits not in QUANTIZED_BITS):
            raise ValueError(f"CaMConfig.bits must be None (unquantized) or one of "
                             f"{', '.join(map(str, QUANTIZED_BITS))}, got {self.bits!r}")
        if isinstance(self.group_size, bool) or self.group_size not in GROUP_SIZES:
            raise ValueError(f"CaMConfig.group_size must be one of {', '.join(map(str, GROUP_SIZES))}, "
                             f"got {self.group_size!r}")
        _check_int("tier_budget", self.tier_budget, 0)
        if isinstance(self.tier_bits, bool) or self.tier_bits not in TIER_BITS:
            raise ValueError(f"CaMConfig.tier_bits must be one of {', '.join(map(str, TIER_BITS))}, "
                             f"got {self.tier_bits!r}")
        if self.tier_budget and self.merge != "drop":
            raise ValueError(f"CaMConfig.tier_budget={self.tier_budget} keeps evicted rows, which a merge rule "
                             f"blends into the survivors instead: it needs merge='drop', got merge={self.merge!r}")
        if self.tier_budget and self.prefill_scoring == "reconstruct":
            raise ValueError(f"CaMConfig.tier_budget={self.tier_budget} is not offered with "
                             f"prefill_scoring='reconstruct' (a re-read attends the main rows only); use "
                             f"tier_budget=0 or prefill_scoring='window'")

    def replace(self, **changes) -> "CaMConfig":
        """A copy with some fields changed (validated like a new config)."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ValueError(f"CaMConfig has no field(s) {sorted(unknown)}")
        # Default shares follow the fields they are derived from.
        if "budget" in changes and "recent" not in changes and self.recent == default_recent(self.budget):
            changes = {**changes, "recent": None}
        if ({"budget", "prefill"} & set(changes) and "slack" not in changes
                and self.slack == default_slack(self.budget, self.prefill)):
            changes = {**changes, "slack": None}
        if ("prefill" in changes and "prefill_scoring" not in changes
                and self.prefill_scoring == default_prefill_scoring(self.prefill)):
            changes = {**changes, "prefill_scoring": None}
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "CaMConfig":
        return cls(**json.loads(text))


# CaM as its authors ran it, over StreamingLLM (zyxxmu/cam's streaming cache): recency
# eviction keeping the sinks, each evicted token's value added to the 32 tokens after
# it (V += V_e / 32), gated by clamp(s_e / the mean score of those 32, 0, 1); that
# code spreads over 16 (docs/algorithm.md section 11 lists what else differs).
# CaMConfig(**CAM_STREAMING, budget=...) or config.replace(**CAM_STREAMING).
CAM_STREAMING = {"eviction": "recency", "merge": "window", "window": 32, "gate": True}


def resolve_config(config: "CaMConfig | None", fields: dict) -> CaMConfig:
    """A CaMConfig from an optional base config plus field overrides."""
    names = [f.name for f in dataclasses.fields(CaMConfig)]
    unknown = sorted(set(fields) - set(names))
    if unknown:
        raise ValueError(f"CaMConfig has no field(s) {unknown}; its fields: {names}")
    if config is None:
        return CaMConfig(**fields)
    if not isinstance(config, CaMConfig):
        raise ValueError(f"config must be a CaMConfig, got {type(config).__name__}")
    return config.replace(**fields) if fields else config
