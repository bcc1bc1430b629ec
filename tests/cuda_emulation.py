"""mx.fast.cuda_kernel (and mx.fast.metal_kernel) on the CPU, for tests on machines
without the GPU.

`emulated_cuda_kernel` has cuda_kernel's signature and returns a callable with its call's
(inputs, template, grid, threadgroup, output_shapes, output_dtypes, init_value): the body
is wrapped as MLX wraps it (a function of the named inputs, then outputs, as typed
pointers), compiled with the C++ compiler against tests/cuda_emulator/cuda_emulator.h
and run there, each work group's threads as CPU threads (barriers, shared memory, warp
shuffles and atomics as on the device). Outputs without init_value start as 0xFF bytes
(NaN, -1), so an element a kernel forgets to write shows. An input's shape and strides,
where the body reads `NAME_shape` or `NAME_strides`, come as int64 arrays (a view is
passed as a contiguous copy, with the copy's strides). The kernels' own Python
(grids, parameter blocks, output shapes) runs unchanged: patch mx.fast.cuda_kernel in
the module that calls it.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np

HEADER = Path(__file__).resolve().parent / "cuda_emulator" / "cuda_emulator.h"
METAL_INCLUDE = HEADER.parent / "metal"  # its <metal_stdlib>
COMPILER = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
_BUILD = Path(tempfile.gettempdir()) / "camkv-cuda-emulation"
_C_TYPES = {mx.float32: "float", mx.int32: "int32_t", mx.uint32: "uint32_t", mx.bool_: "bool",
            mx.bfloat16: "camkv_bf16", mx.float16: "camkv_f16"}
_NUMPY = {mx.float32: np.float32, mx.int32: np.int32, mx.uint32: np.uint32, mx.bool_: np.bool_,
          mx.bfloat16: np.uint16, mx.float16: np.uint16}
_libraries: dict[str, ctypes.CDLL] = {}
TIMEOUT_S = 300


@functools.cache
def _compile_command() -> tuple[list[str], str]:
    """The compiler's command and the text every program includes (for the cache's key),
    found once: C++20 where the compiler takes it (std::barrier, whose waits are cheap),
    else C++17."""
    newer = subprocess.run([COMPILER, "-std=c++20", "-fsyntax-only", "-x", "c++", "-"], input="int main() {}",
                           capture_output=True, text=True).returncode == 0
    command = [COMPILER, "-std=c++20" if newer else "-std=c++17", "-O1", "-ffp-contract=off", "-pthread",
               f"-I{METAL_INCLUDE}", "-shared", "-fPIC", "-w"]
    return command, HEADER.read_text() + (METAL_INCLUDE / "metal_stdlib").read_text()


def _c_type(dtype) -> str:
    if dtype not in _C_TYPES:
        raise TypeError(f"the CUDA emulation takes {sorted(map(str, _C_TYPES))}, not {dtype}")
    return _C_TYPES[dtype]


def _program(name, input_names, output_names, source, header, in_types, out_types, template, shaped, strided
             ) -> str:
    aliases = "".join(f"using {alias} = {_c_type(value)};\n" if isinstance(value, mx.Dtype)
                      else f"constexpr auto {alias} = {int(value)};\n" for alias, value in template)
    params = [f"const {t}* {n}" for n, t in zip(input_names, in_types)]
    params += [f"{t}* {n}" for n, t in zip(output_names, out_types)]
    params += [f"const int64_t* {n}_shape" for n in shaped] + [f"Strides {n}_strides" for n in strided]
    types = ([f"const {t}*" for t in in_types] + [f"{t}*" for t in out_types]
             + ["const int64_t*"] * (len(shaped) + len(strided)))
    casts = [f"({t})args[{i}]" for i, t in enumerate(types)]
    return (f'#include "{HEADER}"\n{aliases}{header}\n'
            f"static void {name}({', '.join(params)}) {{\n{source}\n}}\n"
            f'extern "C" void camkv_run(void** args, unsigned blocks, unsigned threads) {{\n'
            f"  camkv_launch(blocks, threads, [&] {{ {name}({', '.join(casts)}); }});\n}}\n")


def _library(program: str) -> ctypes.CDLL:
    command, included = _compile_command()
    digest = hashlib.sha256(" ".join([*command, program, included]).encode()).hexdigest()[:16]
    if digest not in _libraries:
        _BUILD.mkdir(parents=True, exist_ok=True)
        source, library = _BUILD / f"{digest}.cpp", _BUILD / f"{digest}.so"
        if not library.exists():
            source.write_text(program)
            built = subprocess.run([*command, str(source), "-o", str(library)], capture_output=True, text=True)
            if built.returncode != 0:
                raise RuntimeError(f"the emulated kernel does not compile:\n{built.stderr[:4000]}")
        _libraries[digest] = ctypes.CDLL(str(library))
    return _libraries[digest]


def _as_numpy(a: mx.array) -> np.ndarray:
    if a.dtype in (mx.bfloat16, mx.float16):
        a = a.view(mx.uint16)  # their bits (numpy has no bfloat16)
    return np.ascontiguousarray(np.array(a))


def _as_mlx(a: np.ndarray, dtype) -> mx.array:
    out = mx.array(a)
    return out.view(dtype) if dtype in (mx.bfloat16, mx.float16) else out


def emulated_metal_kernel(name, input_names, output_names, source, header="", ensure_row_contiguous=True,
                          atomic_outputs=False):
    """mx.fast.metal_kernel on the CPU: the body's `threadgroup` declarations become the work
    group's static memory, the header's <metal_stdlib> is the emulation's."""
    body = re.sub(r"^(\s*)threadgroup\s", r"\1static ", source, flags=re.M)
    return emulated_cuda_kernel(name, input_names, output_names, body, header)


def emulated_cuda_kernel(name, input_names, output_names, source, header="", ensure_row_contiguous=True,
                         shared_memory=0):
    shaped = [n for n in input_names if f"{n}_shape" in source]
    strided = [n for n in input_names if f"{n}_strides" in source]

    def call(*, inputs, grid, threadgroup, output_shapes, output_dtypes, template=(), init_value=None,
             verbose=False, stream=None):
        arrays = [_as_numpy(a) for a in inputs]
        # Inputs come as contiguous copies (views included), so their strides are the copies'.
        shapes = [np.array(inputs[input_names.index(n)].shape, np.int64) for n in shaped]
        shapes += [np.array(arrays[input_names.index(n)].strides, np.int64) // arrays[input_names.index(n)].itemsize
                   for n in strided]
        in_types = [_c_type(a.dtype) for a in inputs]
        out_types = [_c_type(d) for d in output_dtypes]
        program = _program(name, input_names, output_names, source, header, in_types, out_types, template, shaped,
                           strided)
        outputs = [np.full(shape, init_value, _NUMPY[d]) if init_value is not None
                   else np.frombuffer(b"\xff" * (int(np.prod(shape)) * np.dtype(_NUMPY[d]).itemsize),
                                      _NUMPY[d]).reshape(shape).copy()
                   for shape, d in zip(output_shapes, output_dtypes)]
        pointers = (ctypes.c_void_p * (len(arrays) + len(outputs) + len(shapes)))(
            *[a.ctypes.data_as(ctypes.c_void_p) for a in arrays + outputs + shapes])
        threads = threadgroup[0]
        assert grid[1] == grid[2] == threadgroup[1] == threadgroup[2] == 1 and grid[0] % threads == 0
        # In a thread of its own: a barrier some thread never reaches fails the test, not hangs it.
        run = threading.Thread(target=_library(program).camkv_run, daemon=True,
                               args=(pointers, ctypes.c_uint(grid[0] // threads), ctypes.c_uint(threads)))
        run.start()
        run.join(TIMEOUT_S)
        if run.is_alive():
            raise RuntimeError(f"the emulated kernel {name} did not finish in {TIMEOUT_S} s: a barrier or warp "
                               "exchange that some of its threads never reach")
        return [_as_mlx(o, d) for o, d in zip(outputs, output_dtypes)]

    return call


def here() -> bool:
    """Whether CUDA kernels run where the tests run: on an NVIDIA GPU, or emulated."""
    from camkv.backends import drop

    return drop.cuda_build() or COMPILER is not None


@contextlib.contextmanager
def kernels_here(*modules):
    """Within the block, the CUDA kernels of camkv modules (each caching its kernels as
    `_kernel` or `_kernels`) run here: on an NVIDIA GPU as they are, elsewhere emulated."""
    from camkv.backends import drop

    if drop.cuda_build():
        yield
        return
    with emulating(*modules):
        yield


@contextlib.contextmanager
def emulating(*modules):
    """Within the block, mx.fast.cuda_kernel and mx.fast.metal_kernel are emulated_cuda_kernel
    and emulated_metal_kernel, the modules' kernel caches emptied on the way in and out."""
    saved = [(m, name, getattr(m, name)) for m in modules for name in ("_kernel", "_kernels")
             if isinstance(getattr(m, name, False), (dict, type(None)))]  # caches, not the functions filling them
    real = mx.fast.cuda_kernel, mx.fast.metal_kernel
    try:
        mx.fast.cuda_kernel, mx.fast.metal_kernel = emulated_cuda_kernel, emulated_metal_kernel
        for module, name, value in saved:
            setattr(module, name, {} if isinstance(value, dict) else None)
        yield
    finally:
        mx.fast.cuda_kernel, mx.fast.metal_kernel = real
        for module, name, value in saved:
            setattr(module, name, value)
