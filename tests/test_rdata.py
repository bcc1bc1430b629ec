"""bench/rdata.py reads R's XDR serialization and lazy-load databases (Jane Austen's text)."""

from __future__ import annotations

import gzip
import struct
import sys
import zlib
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import rdata  # noqa: E402

HEADER = b"X\n" + struct.pack(">iii", 3, 0x040201, 0x030500) + struct.pack(">i", 5) + b"UTF-8"


def _int(v):
    return struct.pack(">i", v)


def _charsxp(text):
    if text is None:
        return _int(rdata.CHARSXP) + _int(-1)
    data = text.encode()
    return _int(rdata.CHARSXP | (1 << 18)) + _int(len(data)) + data  # UTF-8 flag in levels


def _strsxp(items, flags=0):
    return _int(rdata.STRSXP | flags) + _int(len(items)) + b"".join(map(_charsxp, items))


def _symbol(name):
    return _int(rdata.SYMSXP) + _charsxp(name)


def _named_list(names, values, first_symbol=True):
    """A VECSXP with a names attribute: attribute pairlist (tag 'names') then NULL."""
    names_attr = (_int(rdata.LISTSXP | (1 << 10)) + (_symbol("names") if first_symbol else
                  _int(rdata.REFSXP | (1 << 8))) + _strsxp(names) + _int(rdata.NILVALUE_SXP))
    return _int(rdata.VECSXP | (1 << 9)) + _int(len(values)) + b"".join(values) + names_attr


def test_character_vector_with_na_and_unicode():
    lines = ["PRIDE AND PREJUDICE", "", None, "Grüße — “quoted”"]
    assert rdata.unserialize(HEADER + _strsxp(lines)) == lines


def test_lazyload_database_round_trip(tmp_path):
    novels = {"emma": ["Emma Woodhouse,", "handsome"], "persuasion": ["Sir Walter"]}
    records, offsets = b"", []
    for lines in novels.values():
        payload = HEADER + _strsxp(lines)
        record = struct.pack(">I", len(payload)) + zlib.compress(payload)
        offsets.append(_int(rdata.INTSXP) + _int(2) + _int(len(records)) + _int(len(record)))
        records += record
    variables = _named_list(list(novels), offsets)
    compressed = _int(rdata.LGLSXP) + _int(1) + _int(1)
    references = _named_list([], [], first_symbol=False)  # reuses the 'names' symbol: REFSXP
    index = _named_list(["variables", "references", "compressed"],
                        [variables, references, compressed])
    (tmp_path / "Rdata.rdx").write_bytes(gzip.compress(HEADER + index))
    (tmp_path / "Rdata.rdb").write_bytes(records)
    for name, lines in novels.items():
        assert rdata.read_lazyload_variable(tmp_path / "Rdata", name) == lines
    with pytest.raises(KeyError, match="'sanditon' is not in"):
        rdata.read_lazyload_variable(tmp_path / "Rdata", "sanditon")


def test_unsupported_types_and_formats_are_refused():
    with pytest.raises(ValueError, match="object type 3 is not supported"):
        rdata.unserialize(HEADER + _int(3) + _int(0))  # a closure
    with pytest.raises(ValueError, match="not an XDR"):
        rdata.unserialize(b"A\n" + HEADER[2:])
