"""Quality sweep of camkv against the full cache, StreamingLLM and H2O: `camkv eval` from a checkout.

    python bench/quality.py --preset smoke            # seconds, tiny random model
    python bench/quality.py --preset gpu --time-budget 480   # the full sweep, resumable

Every flag: python bench/quality.py --help. The logic lives in camkv.eval.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run from a source checkout without installing.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))


def main() -> int:
    try:
        # On a Linux CPU, re-run with the system OpenBLAS preloaded (much faster float32 matrix products).
        from camkv._blas import reexec_with_openblas
    except ImportError:  # a checkout without camkv._blas: set LD_PRELOAD yourself
        reexec_with_openblas = None
    if reexec_with_openblas is not None:
        reexec_with_openblas()
    from camkv.eval.cli import main as quality_main

    # From a checkout, results go with the committed ones unless --out says otherwise.
    results = Path(__file__).resolve().parent / "results"
    return quality_main(sys.argv[1:], default_out=str(results / "quality-{preset}"))


if __name__ == "__main__":
    sys.exit(main())
