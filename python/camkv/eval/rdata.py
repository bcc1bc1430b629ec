"""A minimal reader of R's serialization format, enough for the character vectors of a data package.

R packages installed with LazyData keep their data sets in a lazy-load database:
`data/Rdata.rdx` is a gzip-compressed RDS (XDR binary) index, a named list whose
`variables` entry maps each data set's name to (offset, length) in `data/Rdata.rdb`;
each .rdb entry is a 4-byte big-endian uncompressed length, (for compression types
2 and 3) one byte naming the compressor, then the compressed serialization of the
value. `.rda` / `.RData` files are the same serialization, compressed, after an
"RDX2\n"/"RDX3\n" magic line. No R is needed to read either.

Supported: vectors (logical, integer, double, character, list, raw), pairlists,
symbols, attributes, references, environments and the compact ALTREP sequences.
Anything else raises ValueError naming the SEXP type, rather than guessing.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import struct
import zlib

# SEXP type codes (R's Rinternals.h and serialize.c).
NILSXP, SYMSXP, LISTSXP, CLOSXP, ENVSXP, PROMSXP, LANGSXP = 0, 1, 2, 3, 4, 5, 6
CHARSXP, LGLSXP, INTSXP, REALSXP, CPLXSXP, STRSXP, DOTSXP = 9, 10, 13, 14, 15, 16, 17
VECSXP, EXPRSXP, RAWSXP = 19, 20, 24
ALTREP_SXP, ATTRLISTSXP, ATTRLANGSXP = 238, 239, 240
BASEENV_SXP, EMPTYENV_SXP = 241, 242
PERSISTSXP, PACKAGESXP, NAMESPACESXP, BASENAMESPACE_SXP = 247, 248, 249, 250
MISSINGARG_SXP, UNBOUNDVALUE_SXP, GLOBALENV_SXP, NILVALUE_SXP, REFSXP = 251, 252, 253, 254, 255

NA_INTEGER = -(2**31)
_PAIRLIST_TYPES = (LISTSXP, LANGSXP, CLOSXP, PROMSXP, DOTSXP, ATTRLISTSXP, ATTRLANGSXP)
_SINGLETONS = {
    NILVALUE_SXP: None, EMPTYENV_SXP: "<emptyenv>", BASEENV_SXP: "<baseenv>",
    GLOBALENV_SXP: "<globalenv>", UNBOUNDVALUE_SXP: "<unbound>",
    MISSINGARG_SXP: "<missing>", BASENAMESPACE_SXP: "<base namespace>",
}


class RSymbol(str):
    """An R symbol (a name), kept apart from character data."""


class RVector(list):
    """An R vector: its elements, plus its attributes (names, class, ...) by name."""

    def __init__(self, items=(), attributes: dict | None = None):
        super().__init__(items)
        self.attributes = attributes or {}

    def named(self) -> dict:
        """The elements by their `names` attribute."""
        names = self.attributes.get("names")
        if names is None or len(names) != len(self):
            raise ValueError("this R vector has no names attribute matching its length")
        return dict(zip(names, self))


class _Reader:
    """Reads one XDR-serialized R object from bytes."""

    def __init__(self, data: bytes):
        self.data = data
        self.pos = 0
        self.refs: list = []

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise ValueError(f"R serialization truncated at byte {self.pos} (wanted {n} more)")
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def int(self) -> int:
        return struct.unpack(">i", self.take(4))[0]

    def length(self) -> int:
        n = self.int()
        if n == -1:  # long vector: two more ints
            upper, lower = self.int(), self.int()
            n = (upper << 32) + (lower & 0xFFFFFFFF)
        return n

    def header(self) -> None:
        magic = self.take(2)
        if magic != b"X\n":
            raise ValueError(
                f"only R's XDR binary serialization is supported, got format marker {magic!r}"
            )
        version = self.int()
        self.int(), self.int()  # writer's R version, minimal reader version
        if version == 3:
            self.take(self.int())  # native encoding name
        elif version != 2:
            raise ValueError(f"unsupported R serialization version {version}")

    def item(self):
        flags = self.int()
        sexp = flags & 0xFF
        has_attr, has_tag = bool(flags & (1 << 9)), bool(flags & (1 << 10))
        if sexp in _SINGLETONS:
            return _SINGLETONS[sexp]
        if sexp == REFSXP:
            index = flags >> 8 or self.int()
            return self.refs[index - 1]
        if sexp in (PERSISTSXP, PACKAGESXP, NAMESPACESXP):
            return self._named_ref(sexp)
        if sexp == SYMSXP:
            symbol = RSymbol(self.item())
            self.refs.append(symbol)
            return symbol
        if sexp == ENVSXP:
            return self._environment()
        if sexp in _PAIRLIST_TYPES:
            return self._pairlist(has_attr, has_tag)
        if sexp == CHARSXP:
            return self._charsxp()
        if sexp == ALTREP_SXP:
            return self._altrep()
        value = self._vector(sexp)
        if has_attr:
            value.attributes = self._attributes()
        return value

    def _named_ref(self, sexp: int):
        if self.int() != 0:
            raise ValueError(f"unexpected flags in R reference item (SEXP type {sexp})")
        names = RVector(self.item() for _ in range(self.int()))
        self.refs.append(names)
        return names

    def _environment(self):
        env = {}
        self.refs.append(env)  # registered first: the frame may refer to it
        self.int()  # locked
        enclosure, frame, hashtab, attributes = self.item(), self.item(), self.item(), self.item()
        for bindings in [frame] + list(hashtab or []):
            if isinstance(bindings, dict):
                env.update(bindings)
        return env

    def _pairlist(self, has_attr: bool, has_tag: bool) -> dict:
        """A pairlist as {tag: value}; untagged cells get their index as key."""
        cells, index = {}, 0
        while True:
            if has_attr:
                self.item()
            tag = self.item() if has_tag else None
            cells[str(tag) if tag is not None else index] = self.item()
            index += 1
            flags = self.int()  # the CDR: another cell, or the end
            sexp = flags & 0xFF
            if sexp not in _PAIRLIST_TYPES:
                self.pos -= 4
                self.item()
                return cells
            has_attr, has_tag = bool(flags & (1 << 9)), bool(flags & (1 << 10))

    def _attributes(self) -> dict:
        attrs = self.item()
        if not isinstance(attrs, dict):
            raise ValueError(f"R attributes must be a pairlist, got {type(attrs).__name__}")
        return attrs

    def _charsxp(self):
        n = self.int()
        if n == -1:
            return None  # NA_character_
        return self.take(n).decode("utf-8", errors="replace")

    def _vector(self, sexp: int) -> RVector:
        n = self.length()
        if sexp in (LGLSXP, INTSXP):
            values = struct.unpack(f">{n}i", self.take(4 * n))
            return RVector(None if v == NA_INTEGER else v for v in values)
        if sexp == REALSXP:
            return RVector(struct.unpack(f">{n}d", self.take(8 * n)))
        if sexp == CPLXSXP:
            raw = struct.unpack(f">{2 * n}d", self.take(16 * n))
            return RVector(complex(raw[i], raw[i + 1]) for i in range(0, 2 * n, 2))
        if sexp in (STRSXP, VECSXP, EXPRSXP):
            return RVector(self.item() for _ in range(n))
        if sexp == RAWSXP:
            return RVector(self.take(n))
        raise ValueError(f"unsupported R SEXP type {sexp} at byte {self.pos - 4}")

    def _altrep(self):
        info, state, attributes = self.item(), self.item(), self.item()
        class_name = str(info.get(0)) if isinstance(info, dict) else "?"
        if class_name in ("compact_intseq", "compact_realseq"):
            length, start, step = (int(x) if class_name == "compact_intseq" else x for x in state)
            value = RVector(start + i * step for i in range(int(length)))
        elif class_name.startswith("wrap_"):
            value = state[0]
        elif class_name == "deferred_string":
            value = RVector(str(x) for x in state[0])
        else:
            raise ValueError(f"unsupported ALTREP class {class_name!r} in R serialization")
        if isinstance(attributes, dict):
            value.attributes = attributes
        return value


def unserialize(data: bytes):
    """The R object serialized in `data` (XDR binary, with its 'X\\n' header)."""
    reader = _Reader(data)
    reader.header()
    return reader.item()


def read_rds(path) -> object:
    """An .rds file (gzip-compressed or plain)."""
    with open(path, "rb") as f:
        data = f.read()
    return unserialize(gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data)


def _decompress_rdb_entry(blob: bytes, compressed) -> bytes:
    if compressed in (2, 3):
        kind, body = blob[4:5], blob[5:]
        decoders = {b"Z": zlib.decompress, b"2": bz2.decompress, b"X": lzma.decompress,
                    b"0": lambda x: x}
        if kind not in decoders:
            raise ValueError(f"unknown lazy-load compression marker {kind!r}")
        return decoders[kind](body)
    return zlib.decompress(blob[4:])


def read_lazyload_db(rdx_path, rdb_path) -> dict:
    """Every variable of an R lazy-load database (Rdata.rdx + Rdata.rdb), by name."""
    index = read_rds(rdx_path).named()
    compressed = index.get("compressed", RVector([True]))[0]
    with open(rdb_path, "rb") as f:
        rdb = f.read()
    values = {}
    for name, (offset, length) in index["variables"].named().items():
        blob = rdb[int(offset) : int(offset) + int(length)]
        values[name] = unserialize(_decompress_rdb_entry(blob, compressed))
    return values
