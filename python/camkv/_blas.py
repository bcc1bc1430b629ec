"""Make MLX's CPU matmuls use the system's OpenBLAS when one is installed.

MLX's Linux CPU wheel links a reference BLAS; with OpenBLAS loaded first, float32
matrix products run far faster (a 512x576 @ 576x1536 product: 330 ms -> 17 ms on a
2-core x86 CPU). End to end on that CPU, the default model processed a 1021-token
prompt at 58-65 tokens/s with OpenBLAS against 5-8 without (README, "OpenBLAS on Linux").
MLX binds its BLAS symbols when it is imported, so OpenBLAS has to be in the
process's global symbol scope before that: either loaded here before mlx is
imported, or put in LD_PRELOAD by re-executing the command (what the CLI does,
because importing camkv already imports mlx).

CAMKV_BLAS=/path/to/libopenblas.so.0 picks a library; CAMKV_BLAS=0 turns this off.
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)
_REEXEC_MARK = "_CAMKV_BLAS_REEXEC"


def find_openblas() -> str | None:
    """Path of the OpenBLAS to use, or None (not Linux, turned off, none found)."""
    if not sys.platform.startswith("linux"):
        return None
    chosen = os.environ.get("CAMKV_BLAS", "")
    if _turned_off():
        return None
    if chosen:
        return chosen if Path(chosen).is_file() else None
    return next((c for c in _CANDIDATES if Path(c).is_file()), None)


def _already_loaded(library: str) -> bool:
    return Path(library).name in os.environ.get("LD_PRELOAD", "") or bool(os.environ.get(_REEXEC_MARK))


def _runs_on_cpu() -> bool:
    import mlx.core as mx

    return mx.default_device() == mx.cpu


def preload() -> str | None:
    """Load OpenBLAS into the global symbol scope if mlx is not imported yet."""
    library = find_openblas()
    if library is None or "mlx.core" in sys.modules or _already_loaded(library):
        return None
    try:
        ctypes.CDLL(library, mode=os.RTLD_GLOBAL | os.RTLD_NOW)
    except OSError:
        return None  # e.g. its libgfortran is missing: keep MLX's own BLAS
    return library


def bound() -> bool:
    """Whether an OpenBLAS is mapped into this process (Linux; False elsewhere): MLX's CPU
    matrix products then run through it, whose blocking follows the matrices' shapes, so a
    batch's products may differ in the last digits from one row's (docs/algorithm.md
    section 10)."""
    try:
        return "libopenblas" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def _turned_off() -> bool:
    return os.environ.get("CAMKV_BLAS", "").lower() in ("0", "off", "no", "false")


def reexec_with_openblas() -> None:
    """Re-run this command with OpenBLAS in LD_PRELOAD (Linux CPU only; returns if not needed)."""
    library = find_openblas()
    if library is None and sys.platform.startswith("linux") and not _turned_off() and _runs_on_cpu():
        # Without it, long prompts are processed about 8-10x slower, without a word why.
        print("camkv: no OpenBLAS found (CAMKV_BLAS or the system's libopenblas.so.0); MLX's CPU "
              "matrix products use its reference BLAS, which processes long prompts about 8-10x "
              "slower. Install libopenblas0-pthread "
              "(Debian/Ubuntu) or set CAMKV_BLAS=/path/to/libopenblas.so.0; CAMKV_BLAS=0 silences this.",
              file=sys.stderr)
        return
    if library is None or _already_loaded(library) or not _runs_on_cpu():
        return
    try:
        ctypes.CDLL(library, mode=os.RTLD_LOCAL | os.RTLD_NOW)  # does it load at all?
    except OSError:
        return
    env = dict(os.environ, **{_REEXEC_MARK: library})
    env["LD_PRELOAD"] = ":".join(p for p in (library, os.environ.get("LD_PRELOAD")) if p)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, list(sys.orig_argv), env)
