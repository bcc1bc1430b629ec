"""Every bench script that runs a model re-runs itself with the system's OpenBLAS on a
Linux CPU, as the camkv CLI does (camkv._blas): they import mlx before camkv, so without
it MLX's reference BLAS would time the model's matrix products 8-10x slower."""

from __future__ import annotations

import re
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
# The scripts that only read records or time kernels without a model's matrix products.
NO_MODEL = {"kernels.py", "kernels_gpu.py", "merge_verdict.py", "recent_window.py", "server_ttft.py",
            "ablate_chunk.py", "profile_compress.py", "profile_prefill.py", "step_calls.py", "decode_attention.py"}


def test_every_model_script_reexecs_with_openblas():
    missing = []
    for script in sorted(BENCH.glob("*.py")):
        text = script.read_text()
        main_block = text.partition('\nif __name__ == "__main__":\n')[2]
        if not main_block or script.name in NO_MODEL:
            continue
        if not re.search(r"^\s+reexec_with_openblas\(\)", text, re.MULTILINE):  # in main or before it
            missing.append(script.name)
    assert not missing, f"bench scripts that run a model without OpenBLAS on a Linux CPU: {missing}"
