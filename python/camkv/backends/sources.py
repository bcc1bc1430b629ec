"""The kernel sources shipped as package data, for run-time compilation
(mx.fast.metal_kernel / mx.fast.cuda_kernel): one copy of each file lives in the
repository (csrc/, metal/, cuda/); CMake installs them under camkv/kernels/."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

# Installed file name -> its folder in a source checkout.
KERNEL_FILES = {
    "camkv_core.h": "csrc",
    "camkv_merges.h": "csrc",
    "camkv_prelude_cpu.h": "csrc",
    "camkv_prelude.h": "metal",
    "camkv_prelude.cuh": "cuda",
}


def _candidates(name: str) -> list[Path]:
    places = []
    # The installed package (also where an editable install put its built files).
    spec = importlib.util.find_spec("camkv")
    for root in (spec.submodule_search_locations or []) if spec else []:
        places.append(Path(root) / "kernels" / name)
    # A source checkout: python/camkv/backends/sources.py -> repository root.
    places.append(Path(__file__).resolve().parents[3] / KERNEL_FILES[name] / name)
    return places


def kernel_source(name: str) -> str:
    """Text of one kernel source file (see KERNEL_FILES)."""
    if name not in KERNEL_FILES:
        raise ValueError(f"unknown kernel source {name!r}; known: {sorted(KERNEL_FILES)}")
    for path in _candidates(name):
        if path.is_file():
            return path.read_text()
    raise FileNotFoundError(f"kernel source {name} not found in {[str(p) for p in _candidates(name)]}")


_INCLUDE = re.compile(r'^#include "(camkv[^"]*)"[ \t]*$', re.MULTILINE)


def inlined_source(name: str) -> str:
    """Text of one kernel source with the kernel files it includes by name inlined
    where they are included, each once: for a compiler that gets one text (mx.fast
    kernels) instead of a folder to include from."""
    seen: set[str] = set()

    def expand(file: str) -> str:
        if file in seen:
            return ""
        seen.add(file)
        return _INCLUDE.sub(lambda match: expand(match.group(1)), kernel_source(file))

    return expand(name)
