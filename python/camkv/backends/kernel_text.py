"""Custom CUDA kernels whose text may reach MLX through a file: mx.fast.cuda_kernel with
the source (and header) written once to a file that a one-line `#include` names.

MLX's CUDA build keeps a custom kernel's whole text and handles it again at each call
(copied into the call and hashed when the graph is evaluated), so a long text costs host
time at every launch; a decode step at a small model's size is bound by that host work
(bench/step_calls.py: camkv's quantized step builds in about 19 us against 6 for MLX's
own attention). NVRTC, which compiles the kernels, reads an absolute `#include` path, so
the text can live in a file and each call carries one short line. The files are
content-addressed (a digest of the text in the name) in folder() (camkv's cache folder,
camkv.models.cache_dir), written atomically; where that fails, the kernel keeps its text
inline.

BY_FILE switches it (read when a kernel is made: each module keeps the kernel made under
each setting apart, so an arm of a benchmark can switch it for its run). On by default:
on an H100 at a 1B model's shape, 8-bit rows' decode steps in one launch ran at 0.899x
RotatingKVCache's speed with the text by file and 0.853x with it inline, in one run
(bench/results/README.md, "The one-launch quantized step with 8 warps a head and its
text by file").
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from pathlib import Path

import mlx.core as mx

# Whether camkv's CUDA kernels reach MLX by file: the decode step's (camkv.backends.step_cuda,
# quantized_cuda, append_cuda), a compression's (compact_cuda, mass_cuda, merge_cuda) and the
# kernel core's (jit, on CUDA).
BY_FILE = True
# The files' folder where set (tests); else folder()'s default.
CACHE_DIR: Path | None = None


def folder() -> Path:
    """Where the kernels' files are written: CACHE_DIR, else camkv's cache folder's cuda-kernels."""
    from ..models import cache_dir

    return CACHE_DIR if CACHE_DIR is not None else cache_dir() / "cuda-kernels"


def key(name) -> tuple:
    """Where a module keeps its kernel `name` (any hashable): one for each BY_FILE, which
    a benchmark's arm may switch within a process."""
    return name, BY_FILE


def built(made: dict, name, make):
    """The module's kernel `name` from its dict `made`, made by make() the first time
    under the current BY_FILE (each module keeps its own dict, which tests replace to
    build its kernels anew)."""
    at = key(name)
    if at not in made:
        made[at] = make()
    return made[at]


def cuda_kernel(name: str, input_names: list, output_names: list, source: str, header: str = "", **kwargs):
    """mx.fast.cuda_kernel(name, input_names, output_names, source, header, **kwargs), the
    text by file where BY_FILE and the file can be written."""
    if BY_FILE:
        included = _included(name, input_names, source, header)
        if included is not None:
            source, header = included
    return mx.fast.cuda_kernel(name=name, input_names=input_names, output_names=output_names, source=source,
                               header=header, **kwargs)


def _included(name: str, input_names: list, source: str, header: str) -> tuple[str, str] | None:
    """(source, header) as `#include` lines of files holding them, the source's line
    followed by a comment naming the input shapes and strides it reads (MLX passes those
    only where a kernel's source names them); None where a file cannot be written."""
    try:
        body = _written(name, source)
        head = _written(name + "_header", header) if header else None
    except OSError:
        return None
    named = " ".join(f"{n}_{part}" for n in input_names for part in ("shape", "strides")
                     if re.search(rf"\b{n}_{part}\b", source))
    return f'#include "{body}"\n// {named}\n', (f'#include "{head}"\n' if head else "")


def _written(name: str, text: str) -> Path:
    """The file holding text, written once (to a temporary name, then moved into place, so
    another process never reads half a file)."""
    where = folder()
    path = where / f"{name}_{hashlib.sha256(text.encode()).hexdigest()[:16]}.cuh"
    if not path.exists():
        where.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=where, suffix=".part")
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.replace(temporary, path)
    return path
