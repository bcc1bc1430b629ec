"""The CUDA path, checked on machines without nvcc: the CUDA prelude + core must parse
as C++ against tests/cuda_stub, so a typo in GPU-only code fails CI on Linux too. (The
Metal text is checked as MLX generates it, by tests/test_metal_source.py.)"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMPILER = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")

pytestmark = pytest.mark.skipif(COMPILER is None, reason="no C++ compiler on PATH")


def test_cuda_prelude_and_core_parse_against_the_stub():
    command = [
        COMPILER, "-std=c++17", "-fsyntax-only", "-x", "c++", "-Wall", "-Werror",
        f"-I{ROOT / 'tests' / 'cuda_stub'}", f"-I{ROOT / 'csrc'}", f"-I{ROOT / 'cuda'}",
        str(ROOT / "tests" / "cuda_stub" / "check.cu"),
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_kernel_sources_ship_with_the_package():
    from camkv.backends.sources import KERNEL_FILES, kernel_source

    for name in KERNEL_FILES:
        text = kernel_source(name)
        assert "camkv" in text, name
    assert "camkv_update_row" in kernel_source("camkv_core.h")
