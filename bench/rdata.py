"""A minimal reader of R's serialization format, enough to get Jane Austen's novels.

Debian's r-cran-janeaustenr package stores each novel as a character vector (one
element per line of text) in an R lazy-load database: ``data/Rdata.rdx`` is a
gzip-compressed serialized index (variable name -> byte offset and length in
``Rdata.rdb``), and each record in ``Rdata.rdb`` is a 4-byte big-endian length
followed by a zlib stream (or, for compress=2/3, one type byte then bzip2/xz/zlib/raw)
holding one serialized object. Everything is XDR (big-endian) format version 2 or 3.

Only the object types these files use are read: NULL, symbols, pairlists
(attribute lists), character / integer / logical / double vectors and lists.
Anything else raises ValueError naming the type, rather than guessing.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import struct
import zlib
from pathlib import Path

NILSXP, SYMSXP, LISTSXP, CHARSXP = 0, 1, 2, 9
LGLSXP, INTSXP, REALSXP, STRSXP, VECSXP = 10, 13, 14, 16, 19
REFSXP, NILVALUE_SXP = 255, 254
NA_STRING_LENGTH = -1


class _Reader:
    def __init__(self, data: bytes):
        self.data, self.pos = data, 0
        self.refs: list = []  # symbols, in order of first appearance (REFSXP indexes them)

    def take(self, n: int) -> bytes:
        chunk = self.data[self.pos : self.pos + n]
        if len(chunk) != n:
            raise ValueError("truncated R serialization")
        self.pos += n
        return chunk

    def int(self) -> int:
        return struct.unpack(">i", self.take(4))[0]

    def header(self) -> None:
        if self.take(2) != b"X\n":
            raise ValueError("not an XDR R serialization (expected 'X\\n')")
        version = self.int()
        self.int(), self.int()  # the writer's R version, the minimal reader version
        if version == 3:
            self.take(self.int())  # native encoding name
        elif version != 2:
            raise ValueError(f"R serialization version {version} is not supported")

    def item(self):
        flags = self.int()
        sexp_type = flags & 0xFF
        has_attr, has_tag = bool(flags & (1 << 9)), bool(flags & (1 << 10))
        if sexp_type in (NILVALUE_SXP, NILSXP):
            return None
        if sexp_type == REFSXP:
            index = flags >> 8 or self.int()  # packed index, or 0 and the index follows
            return self.refs[index - 1]
        if sexp_type == SYMSXP:
            name = self.item()
            self.refs.append(name)
            return name
        if sexp_type == CHARSXP:
            length = self.int()
            return None if length == NA_STRING_LENGTH else self.take(length).decode("utf-8", "replace")
        if sexp_type == LISTSXP:
            return self.pairlist(has_attr, has_tag)
        value = self.vector(sexp_type)
        if has_attr:
            attributes = self.item()
            if isinstance(value, list) and "names" in attributes:
                return dict(zip(attributes["names"], value))
        return value

    def pairlist(self, has_attr: bool, has_tag: bool) -> dict:
        # A pairlist (used for attributes) becomes a dict tag -> value.
        if has_attr:
            self.item()
        tag = self.item() if has_tag else None
        out = {tag: self.item()}
        rest = self.item()  # the cdr: another pairlist node or NULL
        if isinstance(rest, dict):
            out.update(rest)
        return out

    def vector(self, sexp_type: int):
        length = self.int()
        if sexp_type == STRSXP:
            return [self.item() for _ in range(length)]
        if sexp_type == VECSXP:
            return [self.item() for _ in range(length)]
        if sexp_type in (INTSXP, LGLSXP):
            return list(struct.unpack(f">{length}i", self.take(4 * length)))
        if sexp_type == REALSXP:
            return list(struct.unpack(f">{length}d", self.take(8 * length)))
        raise ValueError(f"R object type {sexp_type} is not supported by this reader")


def unserialize(data: bytes):
    """One serialized R object (XDR format) as Python values."""
    reader = _Reader(data)
    reader.header()
    return reader.item()


def _decompress_record(record: bytes, compressed: int) -> bytes:
    body = record[4:]  # the first 4 bytes hold the uncompressed length
    if compressed in (0, 1):
        return zlib.decompress(body) if compressed else body
    kind, payload = body[:1], body[1:]
    decoders = {b"Z": zlib.decompress, b"2": bz2.decompress, b"X": lzma.decompress,
                b"0": lambda b: b}
    if kind not in decoders:
        raise ValueError(f"unknown lazy-load record compression {kind!r}")
    return decoders[kind](payload)


def read_lazyload_variable(db_stem: Path, name: str):
    """Variable `name` from an R lazy-load database (db_stem.rdx + db_stem.rdb)."""
    index = unserialize(gzip.decompress(Path(f"{db_stem}.rdx").read_bytes()))
    variables = index["variables"]
    if name not in variables:
        raise KeyError(f"{name!r} is not in {db_stem}.rdx; it holds {sorted(variables)}")
    offset, length = variables[name]
    compressed = int(index["compressed"][0])
    with open(f"{db_stem}.rdb", "rb") as f:
        f.seek(offset)
        record = f.read(length)
    return unserialize(_decompress_record(record, compressed))
