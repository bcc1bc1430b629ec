"""`python -m camkv.gpu_check`: run a GPU backend's first-use self-check
(camkv.backends.selfcheck) in every launch class and say whether the kernel ran or
camkv fell back to the reference, and why."""

from __future__ import annotations

import argparse
import warnings

import mlx.core as mx

from . import merges
from .backends import jit
from .backends.selfcheck import LaunchClass


def _report_classes():
    """The classes `python -m camkv.backends.selfcheck` probes: every storage dtype, call
    kind, scoring, first or later compression and row count, under each kernel rule."""
    from itertools import product

    for dtype, one_token, key_scoring, first, few_rows, merge in product(
            (mx.float16, mx.bfloat16, mx.float32), (True, False), (True, False), (True, False), (True, False),
            merges.names()):
        yield dtype, one_token, key_scoring, first, few_rows, merge


def main(argv: list[str] | None = None) -> int:
    """Probe a GPU backend's kernel in every launch class and say whether it ran or
    camkv fell back (and why)."""
    parser = argparse.ArgumentParser(prog="python -m camkv.gpu_check", description=main.__doc__)
    parser.add_argument("--backend", choices=("metal", "cuda"), default="metal",
                        help="the GPU backend to probe (default: %(default)s)")
    parser.add_argument("--require-kernel", action="store_true",
                        help="exit with status 1 unless the kernel ran and passed in every class (default: off)")
    args = parser.parse_args(argv)
    reason = jit.unavailable_reason(args.backend)
    if reason is not None:
        print(f"{args.backend}: not usable here ({reason}); camkv uses another backend")
        return 1 if args.require_kernel else 0
    guard = jit.guard(args.backend)
    checked = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for dtype, one_token, key_scoring, first, few_rows, merge in _report_classes():
            launch = LaunchClass(args.backend, dtype, one_token, key_scoring, first, few_rows, "chunk", merge,
                                 "score", "window", (64, 64), 1 if key_scoring else 4)
            guard.probe(launch)
            if guard.failure is not None:
                break
            checked += 1
    if guard.failure is not None:
        print(f"{args.backend}: fell back to the reference backend after {checked} launch classes passed, "
              f"because {guard.failure}")
        return 1 if args.require_kernel else 0
    print(f"{args.backend}: the kernel ran and matched the reference in {checked} launch classes "
          f"(work groups of {guard.threads()} threads)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
