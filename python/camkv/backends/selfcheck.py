"""First-use self-check of the run-time GPU kernels ("metal", "cuda"), and the fallback.

A kernel compiled at run time can fail where no test ran it: a Metal compiler that
rejects the text, a pipeline that allows fewer threads than asked, a driver that
computes wrong values. The first launch of each launch class (backend, storage dtype,
one-token or chunk call, key or query scoring, first or later compression, few or
many rows, merge rule) in a process first runs a tiny random problem of that class
through the kernel and through the reference and compares them (docs/algorithm.md
section 8; a later compression of keepkv or d2o carries their votes and threshold in
and compares them too). A compile error, a launch error or a mismatch makes camkv warn once (the
error, the backend, what it falls back to, how to report it) and compute that call and
every later one of the backend on the reference backend: the results a user gets with
backend="reference". An error raised by a later launch is caught the same way.
CAMKV_SELF_CHECK=0 skips the probes (errors at launch still fall back).

The probe also finds the work-group size a pipeline allows: MLX refuses a launch whose
group is larger than the compiled pipeline's maximum (the kernel is register-heavy), so
the probe retries with the largest multiple of 32 that the error names, and later
launches of the backend use it.
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Callable, NamedTuple

import mlx.core as mx
import numpy as np

from .. import merges
from ..config import CaMConfig
from ..rows import RowState
from .oracle import reference  # the oracle, loaded by a probe or a fallback only

PROBE_BUDGET = 16  # rows a probe's cache keeps: small enough to be cheap, large enough to evict and merge
PROBE_CHUNK = 24  # tokens of a probe's chunk call: more than its budget, so it evicts
PROBE_SEED = 20240613
# How close a probe's keys and values must be to the reference's, relative to their
# scale. The probe guards against a broken kernel (a compile error, results wrong by
# their own size), not the last ulp: a blend whose weight reads scores inherits the
# scores' tolerance (docs/algorithm.md section 8: rtol 1e-3; a GPU's float32 blends
# were seen 4e-4 off), so 1e-2, plus the rounding of a half-precision dtype.
_VALUE_RTOL = {mx.float32: 1e-2, mx.float16: 1e-2, mx.bfloat16: 4e-2}
_GROUP_LIMIT = re.compile(r"maximum allowed threads per threadgroup \((\d+)\)")
REPORT = ("please report it with this message, your Mac or GPU model, OS and `pip show mlx camkv` "
          "to camkv's issue tracker")


class LaunchClass(NamedTuple):
    """What decides which kernel text MLX compiles and which branches of the core run."""

    target: str
    dtype: object
    one_token: bool
    key_scoring: bool
    first: bool  # no stored rows yet
    few_rows: bool  # fewer than 8 rows: MLX declares such small inputs in another address space
    prefill: str
    merge: str
    eviction: str
    prefill_scoring: str
    head_dims: tuple[int, int]
    groups: int


def enabled() -> bool:
    return os.environ.get("CAMKV_SELF_CHECK", "1") != "0"


def launch_class(target: str, state: RowState, new_keys, new_values, cfg: CaMConfig, queries) -> LaunchClass:
    rows, s_len, k_dim = new_keys.shape
    return LaunchClass(target, new_keys.dtype, s_len == 1, queries is None, state.length == 0, rows < 8,
                       cfg.prefill, cfg.merge, cfg.eviction, cfg.prefill_scoring, (k_dim, new_values.shape[-1]),
                       1 if queries is None else queries.shape[2])


class Guard:
    """One GPU target's kernel update behind the self-check and the fallback."""

    def __init__(self, target: str, check: Callable, update: Callable, group_size: Callable[[], int]):
        self.target = target
        self._check = check  # raises on the caller's errors, which never fall back
        self._update = update
        self._group_size = group_size
        self.passed: set[LaunchClass] = set()
        self.failure: str | None = None  # why this backend is off for the process
        self.group_cap: int | None = None  # the largest group a pipeline allowed, once one refused

    def update(self, state, new_keys, new_values, offset, cfg, row_ids, queries=None, scale=None):
        args = (state, new_keys, new_values, offset, cfg, row_ids, queries, scale)
        self._check(*args)
        if self.failure is None and enabled():
            launch = launch_class(self.target, state, new_keys, new_values, cfg, queries)
            if launch not in self.passed:
                self.probe(launch)
        if self.failure is None:
            try:
                return self._update(*args)
            except (RuntimeError, ValueError) as error:
                self._fail(f"a launch raised: {error}")
        return reference().update(*args)

    def threads(self) -> int:
        """The work-group size of the next launch: the configured one, capped by what a
        pipeline allowed."""
        wanted = self._group_size()
        return wanted if self.group_cap is None else min(wanted, self.group_cap)

    def probe(self, launch: LaunchClass) -> None:
        """Run launch's class once through the kernel and the reference; on a failure
        switch the backend off (self.failure says why), else mark the class passed."""
        problem = probe_problem(launch)
        # The reference on the CPU: on a GPU its many small operations would take most of
        # a second per probe, on the CPU a few milliseconds (memory is shared on both).
        with mx.stream(mx.cpu):
            want = reference().update(*problem)
            mx.eval(want)
        while True:
            try:
                mismatch = compare(self._update(*problem), want, launch.dtype)
            except (RuntimeError, ValueError) as error:
                limit = _GROUP_LIMIT.search(str(error))
                if limit and self._lower_group(int(limit.group(1))):
                    continue
                self._fail(f"its first-use check ({describe(launch)}) raised: {error}")
                return
            break
        if mismatch:
            self._fail(f"its first-use check ({describe(launch)}) differs from the reference: {mismatch}")
        else:
            self.passed.add(launch)

    def _lower_group(self, allowed: int) -> bool:
        """Cap the group at the largest multiple of 32 within `allowed`; False when no
        smaller group is left to try."""
        cap = allowed // 32 * 32
        if cap < 32 or cap >= self.threads():
            return False
        self.group_cap = cap
        return True

    def _fail(self, reason: str) -> None:
        self.failure = reason
        warnings.warn(f"camkv: the {self.target} kernel is switched off for this process because {reason}. "
                      f"camkv continues on the pure-MLX reference backend (the results of backend='reference', "
                      f"slower); {REPORT}. CAMKV_SELF_CHECK=0 skips the first-use check.",
                      RuntimeWarning, stacklevel=4)


def describe(launch: LaunchClass) -> str:
    call = "one-token call" if launch.one_token else "chunk call"
    scoring = "key scoring" if launch.key_scoring else f"query scoring ({launch.groups} per KV head)"
    rows = "fewer than 8 rows" if launch.few_rows else "8 rows or more"
    first = ", first compression" if launch.first else ""
    return (f"{launch.dtype}, {call}, {scoring}, {rows}{first}, merge={launch.merge!r}, "
            f"prefill={launch.prefill!r}, head dims {launch.head_dims}")


def probe_config(launch: LaunchClass) -> CaMConfig:
    chunked = launch.prefill == "chunk"
    return CaMConfig(budget=PROBE_BUDGET, n_sink=1, recent=4, merge=launch.merge, prefill=launch.prefill,
                     slack=2 if chunked else 0, eviction=launch.eviction,
                     prefill_scoring=launch.prefill_scoring if chunked else "causal",
                     observation_window=8, seed=PROBE_SEED)


def probe_problem(launch: LaunchClass) -> tuple:
    """A tiny random update of the launch's class: (state, new_keys, new_values, offset,
    cfg, row_ids, queries, scale), the arguments of a backend's update."""
    rng = np.random.default_rng(PROBE_SEED)
    cfg = probe_config(launch)
    rows = 3 if launch.few_rows else 8
    n = 0 if launch.first else PROBE_BUDGET
    s_len = 1 if launch.one_token else PROBE_CHUNK
    k_dim, v_dim = launch.head_dims

    def normal(*shape, dtype=launch.dtype):
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)

    state = RowState(normal(rows, n, k_dim), normal(rows, n, v_dim),
                     mx.array(rng.uniform(0.0, 2.0, (rows, n)).astype(np.float32)),
                     mx.broadcast_to(mx.arange(n, dtype=mx.int32), (rows, n)), *rule_state(cfg, rows, n, rng))
    queries = None if launch.key_scoring else normal(rows, s_len, launch.groups, k_dim, dtype=mx.float32)
    scale = None if launch.key_scoring else float(k_dim) ** -0.5
    row_ids = mx.arange(rows, dtype=mx.uint32)
    return state, normal(rows, s_len, k_dim), normal(rows, s_len, v_dim), n, cfg, row_ids, queries, scale


def rule_state(cfg: CaMConfig, rows: int, n: int, rng) -> tuple:
    """(votes, threshold) of a later compression for the rules that carry them (camkv.merges:
    keeps_votes, moving_threshold), None for the others and the first: rows that already
    stand for 1-4 tokens and a threshold set by an earlier compression, so the probe reads
    and writes both as a user's later calls do."""
    rule = merges.rule(cfg.merge)
    later = n > 0
    votes = mx.array(rng.integers(1, 5, (rows, n)).astype(np.float32)) if rule.keeps_votes and later else None
    threshold = (mx.array(rng.uniform(-0.5, 0.5, rows).astype(np.float32))
                 if rule.moving_threshold and later else None)
    return votes, threshold


def _rule_state_differs(got: RowState, want: RowState) -> str | None:
    """What differs in the merge rule's own state (votes exactly, threshold within float32
    rounding, NaN where the reference has NaN), else None."""
    for name, a, b, rtol in (("votes", got.votes, want.votes, 0.0), ("threshold", got.threshold, want.threshold, 1e-5)):
        if (a is None) != (b is None):
            return f"the {name} are {'missing' if a is None else 'unexpected'}"
        if a is not None and not np.allclose(np.array(a), np.array(b), rtol=rtol, atol=rtol, equal_nan=True):
            return f"the {name} differ"
    return None


def compare(kernel_result, reference_result, dtype) -> str | None:
    """None when a kernel's (state, merges) match the reference's, else what differs."""
    (got, got_merges), (want, want_merges) = kernel_result, reference_result
    mx.eval(got.arrays(), got_merges, want.arrays(), want_merges)
    if got.keys.shape != want.keys.shape:
        return f"kept {got.keys.shape[1]} rows, the reference {want.keys.shape[1]}"
    if not np.array_equal(np.array(got.positions), np.array(want.positions)):
        return "the kept positions differ"
    if not np.array_equal(np.array(got_merges), np.array(want_merges)):
        return "the merge counts differ"
    if not np.allclose(np.array(got.scores), np.array(want.scores), rtol=1e-3, atol=1e-5):
        return "the scores differ"
    if (rule_mismatch := _rule_state_differs(got, want)) is not None:
        return rule_mismatch
    rtol = _VALUE_RTOL[dtype]
    for name, a, b in (("keys", got.keys, want.keys), ("values", got.values, want.values)):
        a, b = np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))
        if not np.allclose(a, b, rtol=rtol, atol=rtol):
            return f"the {name} differ (largest difference {np.abs(a - b).max():.3g})"
    return None

