"""Check a GGUF file's header and tensor table against its size, then read it.

MLX's GGUF reader trusts the file: a valid magic followed by a corrupt header can
make it read past the end and crash the process (a segmentation fault), and random
or truncated files give errors that do not say which file is wrong. ``check`` walks
the header (magic, version, counts), every metadata entry and every tensor entry,
and checks that each tensor's data lies inside the file; it raises ValueError
naming the file, what is wrong and at which byte. It reads only the header.

Layout (GGUF version 2 and 3; version 1 used 32-bit counts and lengths):
magic "GGUF", uint32 version, uint64 tensor count, uint64 metadata count, the
metadata entries (string key, uint32 type, value), the tensor entries (string
name, uint32 dimension count, uint64 dimensions, uint32 ggml type, uint64 offset),
padding to the alignment (metadata "general.alignment", default 32), tensor data.

``read`` returns the tensors and metadata as ``mx.load`` does. MLX reads F32 and F16
tensors and keeps Q4_0, Q4_1 and Q8_0 blocks packed (as MLX affine triplets); a file
with any other type (the K-quants, Q5_0, BF16, ...) is read with llama.cpp's ``gguf``
package instead, every tensor dequantized to float32.
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

MAGIC = b"GGUF"
VERSIONS = (1, 2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4

# GGUF metadata value types: type id -> struct format of a scalar.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9

# ggml tensor types: id -> (name, elements per block, bytes per block).
GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8),
    28: ("F64", 1, 8), 30: ("BF16", 1, 2),
}


# The tensor types mx.load reads exactly (the quantized ones as MLX triplets).
MLX_TYPES = frozenset({"F32", "F16", "Q4_0", "Q4_1", "Q8_0"})


class _Reader:
    """Bounds-checked little-endian reads from the start of a file."""

    def __init__(self, path: Path, size: int, version: int):
        self.path, self.size, self.pos = path, size, 0
        self.handle = open(path, "rb")
        self.wide = version >= 2  # 64-bit counts and string lengths

    def fail(self, what: str) -> ValueError:
        return ValueError(f"{self.path} is not a valid GGUF file: {what} (at byte {self.pos} "
                          f"of {self.size})")

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"{what} needs {n} bytes but the file ends first (truncated or corrupt)")
        data = self.handle.read(n)
        self.pos += n
        return data

    def scalar(self, fmt: str, what: str):
        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt), what))[0]

    def count(self, what: str) -> int:
        return self.scalar("Q" if self.wide else "I", what)

    def string(self, what: str) -> str:
        raw = self.take(self.count(f"{what}'s length"), what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8") from None


def check(path) -> dict[str, str]:
    """Each tensor's ggml type name ("Q4_K", ...), by tensor name; ValueError if the file
    is not a GGUF file whose tensors all lie inside it."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
    if len(head) < 8 or head[:4] != MAGIC:
        raise ValueError(f"{path} is not a GGUF file: it does not start with the magic "
                         f"'GGUF' (starts with {head[:4]!r}, {size} bytes)")
    version = struct.unpack("<I", head[4:8])[0]
    if version not in VERSIONS:
        raise ValueError(f"{path}: GGUF version {version} is not one of {VERSIONS}")
    reader = _Reader(path, size, version)
    try:
        reader.take(8, "magic and version")
        return _check_body(reader)
    finally:
        reader.handle.close()


def _check_body(reader: _Reader) -> dict[str, str]:
    n_tensors = reader.count("tensor count")
    n_metadata = reader.count("metadata count")
    # Every entry takes at least 8 bytes: larger counts cannot fit in the file.
    for what, n in (("tensor count", n_tensors), ("metadata count", n_metadata)):
        if n * 8 > reader.size:
            raise reader.fail(f"{what} {n} cannot fit in a file of {reader.size} bytes")
    alignment = DEFAULT_ALIGNMENT
    for _ in range(n_metadata):
        key = reader.string("metadata key")
        value = _value(reader, reader.scalar("I", f"type of {key!r}"), key)
        if key == "general.alignment":
            alignment = _alignment(reader, value)
    tensors = [_tensor_entry(reader) for _ in range(n_tensors)]
    data_start = -(-reader.pos // alignment) * alignment
    for name, _, nbytes, offset in tensors:
        end = data_start + offset + nbytes
        if end > reader.size:
            raise reader.fail(f"tensor {name!r} ({nbytes} bytes at data offset {offset}) "
                              f"ends at byte {end}, past the end of the file (truncated?)")
    return {name: type_name for name, type_name, _, _ in tensors}


def _alignment(reader: _Reader, value) -> int:
    if not isinstance(value, int) or value <= 0 or value & (value - 1):
        raise reader.fail(f"general.alignment must be a power of two, got {value!r}")
    return value


def _value(reader: _Reader, kind: int, key: str):
    if kind in _SCALARS:
        return reader.scalar(_SCALARS[kind], f"value of {key!r}")
    if kind == _STRING:
        return reader.string(f"value of {key!r}")
    if kind == _ARRAY:
        item_kind = reader.scalar("I", f"item type of {key!r}")
        n = reader.count(f"length of {key!r}")
        if n > reader.size - reader.pos:  # every item takes at least one byte
            raise reader.fail(f"array {key!r} claims {n} items, more than the file holds")
        for _ in range(n):
            _value(reader, item_kind, key)
        return None
    raise reader.fail(f"metadata {key!r} has unknown value type {kind} (allowed: 0-12)")


def _tensor_entry(reader: _Reader) -> tuple[str, str, int, int]:
    """(name, ggml type name, bytes of data, offset from the data section) of one tensor entry."""
    name = reader.string("tensor name")
    n_dims = reader.scalar("I", f"dimension count of {name!r}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise reader.fail(f"tensor {name!r} has {n_dims} dimensions (allowed: 1-{MAX_DIMS})")
    dims = [reader.scalar("Q", f"dimension of {name!r}") for _ in range(n_dims)]
    kind = reader.scalar("I", f"type of {name!r}")
    offset = reader.scalar("Q", f"data offset of {name!r}")
    if kind not in GGML_TYPES:
        raise reader.fail(f"tensor {name!r} has unknown ggml type {kind} "
                          f"(known: {', '.join(t[0] for t in GGML_TYPES.values())})")
    type_name, block, block_bytes = GGML_TYPES[kind]
    elements = 1
    for d in dims:
        elements *= d
    if elements == 0 or dims[0] % block:
        raise reader.fail(f"tensor {name!r} of type {type_name} has dimensions {dims}: "
                          f"none may be 0 and the first must be a multiple of {block}")
    return name, type_name, elements // block * block_bytes, offset


def read(path, types: dict[str, str]) -> tuple[dict, dict]:
    """(tensors, metadata) of a GGUF file that ``check`` passed, with the types it gave."""
    import mlx.core as mx

    if set(types.values()) <= MLX_TYPES:
        return mx.load(str(path), return_metadata=True)
    return _read_dequantized(Path(path))


def _read_dequantized(path: Path) -> tuple[dict, dict]:
    """Every tensor dequantized to float32 by llama.cpp's gguf package, and the metadata."""
    import mlx.core as mx
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from tqdm import tqdm

    reader = GGUFReader(path)
    metadata = {name: _field_value(field) for name, field in reader.fields.items()
                if not name.startswith("GGUF.")}  # the reader's own header entries
    tensors = {}
    for t in tqdm(reader.tensors, desc="dequantizing tensors", unit="tensor", file=sys.stderr,
                  leave=False):
        try:
            values = dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise ValueError(f"{path}: tensor {t.name!r} is of type {t.tensor_type.name}, which "
                             f"the gguf package cannot dequantize") from None
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists the fastest dimension first
        tensors[t.name] = mx.array(np.ascontiguousarray(values, dtype=np.float32).reshape(shape))
    return tensors, metadata


def scalar(value):
    """A metadata number or flag as a Python value (mx.load gives 0-d arrays)."""
    return value.item() if hasattr(value, "item") else value


def _field_value(field):
    """A metadata value as mx.load gives it: a str, a list of str, a number or an array."""
    import numpy as np

    value = field.contents()
    if isinstance(value, list) and not all(isinstance(v, str) for v in value):
        return np.array(value)
    return value
