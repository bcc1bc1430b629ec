"""The GPU paths, checked on machines without Metal or nvcc: the Metal prelude + kernel
core + entry points must parse as C++ against the minimal Metal stdlib stub in
tests/metal_stub, and the CUDA prelude + core against tests/cuda_stub, so a typo in
GPU-only code fails CI on Linux too."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMPILER = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")

pytestmark = pytest.mark.skipif(COMPILER is None, reason="no C++ compiler on PATH")


def _syntax_check(source: Path) -> subprocess.CompletedProcess:
    command = [
        COMPILER, "-std=c++17", "-fsyntax-only", "-x", "c++", "-Wall", "-Werror",
        "-Wno-attributes",  # [[kernel]], [[buffer(n)]], [[host_name]] are Metal's
        "-Wno-unknown-pragmas",
        f"-I{ROOT / 'tests' / 'metal_stub'}", f"-I{ROOT / 'csrc'}", f"-I{ROOT / 'metal'}",
        str(source),
    ]
    return subprocess.run(command, capture_output=True, text=True)


def test_metal_entry_points_parse_against_the_stub():
    result = _syntax_check(ROOT / "metal" / "camkv.metal")
    assert result.returncode == 0, result.stderr


def test_the_check_catches_a_typo(tmp_path):
    """A misspelt Metal builtin in a copy of the entry file must fail the check."""
    broken = (ROOT / "metal" / "camkv.metal").read_text().replace("threadgroup float red_f", "threadgrup float red_f")
    assert "threadgrup" in broken
    copy = tmp_path / "camkv.metal"
    copy.write_text(broken)
    result = _syntax_check(copy)
    assert result.returncode != 0


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
