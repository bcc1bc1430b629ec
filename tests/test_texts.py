"""Text sources of the quality harness: the R data reader, the cache, windows, missing tools."""

from __future__ import annotations

import gzip
import shutil
import struct
import zlib

import pytest

from camkv.eval import rdata, texts
from camkv.eval.loading import ByteTokenizer
from camkv.eval.sweep import load_documents

# ---------------------------------------------------------------- an independent R serializer
# Written from R's serialize.c layout (XDR, format version 3), to feed the reader bytes
# it did not produce itself.


def _i(x: int) -> bytes:
    return struct.pack(">i", x)


def _flags(sexp: int, attr: bool = False, tag: bool = False, levels: int = 0) -> bytes:
    return _i(sexp | (attr << 9) | (tag << 10) | (levels << 12))


def _char(s):
    if s is None:
        return _flags(9) + _i(-1)
    raw = s.encode("utf-8")
    return _flags(9, levels=8) + _i(len(raw)) + raw  # 8: the UTF-8 encoding bit


def _sym(name: str) -> bytes:
    return _flags(1) + _char(name)


def _ref(index: int) -> bytes:
    return _i((index << 8) | 255)


def _names_attr(names, names_symbol: bytes) -> bytes:
    return _flags(2, tag=True) + names_symbol + _strs(names) + _i(254)


def _strs(items, attr: bytes = b"") -> bytes:
    return _flags(16, attr=bool(attr)) + _i(len(items)) + b"".join(map(_char, items)) + attr


def _ints(values) -> bytes:
    return _flags(13) + _i(len(values)) + b"".join(_i(v) for v in values)


def _lgl(value: bool) -> bytes:
    return _flags(10) + _i(1) + _i(int(value))


def _list(items, attr: bytes = b"") -> bytes:
    return _flags(19, attr=bool(attr)) + _i(len(items)) + b"".join(items) + attr


HEADER = b"X\n" + _i(3) + _i(0x040201) + _i(0x030500) + _i(5) + b"UTF-8"


def test_unserialize_reads_character_vectors_with_na_and_named_lists_with_references():
    # The inner list's names attribute introduces the symbol "names" (reference 1);
    # the outer list's attribute, written after its elements, refers back to it.
    inner = _list([_ints([7, -(2**31)])], _names_attr(["n"], _sym("names")))
    outer = _list([_strs(["It is a truth", None, "é"]), inner], _names_attr(["text", "x"], _ref(1)))
    value = rdata.unserialize(HEADER + outer)
    named = value.named()
    assert named["text"] == ["It is a truth", None, "é"]
    assert named["x"].named() == {"n": [7, None]}


def test_lazy_load_database_gives_each_variable(tmp_path):
    emma = HEADER + _strs(["EMMA", "", "Emma Woodhouse, handsome,", "clever, and rich"])
    persuasion = HEADER + _strs(["Persuasion"])
    rdb = b""
    offsets = {}
    for name, raw in (("emma", emma), ("persuasion", persuasion)):
        blob = struct.pack(">I", len(raw)) + zlib.compress(raw)
        offsets[name] = (len(rdb), len(blob))
        rdb += blob
    variables = _list([_ints(list(offsets["emma"])), _ints(list(offsets["persuasion"]))],
                      _names_attr(["emma", "persuasion"], _sym("names")))
    index = _list([variables, _list([]), _lgl(True)],
                  _names_attr(["variables", "references", "compressed"], _ref(1)))
    (tmp_path / "Rdata.rdx").write_bytes(gzip.compress(HEADER + index))
    (tmp_path / "Rdata.rdb").write_bytes(rdb)
    values = rdata.read_lazyload_db(tmp_path / "Rdata.rdx", tmp_path / "Rdata.rdb")
    assert values == {"emma": ["EMMA", "", "Emma Woodhouse, handsome,", "clever, and rich"],
                      "persuasion": ["Persuasion"]}


def test_unsupported_input_is_refused_by_name():
    with pytest.raises(ValueError, match="XDR"):
        rdata.unserialize(b"A\n" + b"\0" * 20)
    with pytest.raises(ValueError, match="SEXP type 21"):
        rdata.unserialize(HEADER + _flags(21) + _i(0))
    with pytest.raises(ValueError, match="truncated"):
        rdata.unserialize(HEADER + _flags(16) + _i(3))


def test_printed_lines_are_reflowed_into_paragraphs():
    printed = "Chapter 1\n\n\nIt is a truth universally\nacknowledged, that a single man\n\nEnd."
    assert texts._reflow(printed) == (
        "Chapter 1\n\nIt is a truth universally acknowledged, that a single man\n\nEnd.")


# ---------------------------------------------------------------- the cache and windows


def test_windows_are_exact_length_word_aligned_and_seeded():
    tokenizer = ByteTokenizer()
    docs = texts.load_source("builtin")
    first = texts.sample_windows("builtin", docs, tokenizer, 300, 3, seed=5)
    again = texts.sample_windows("builtin", docs, tokenizer, 300, 3, seed=5)
    other = texts.sample_windows("builtin", docs, tokenizer, 300, 3, seed=6)
    assert first == again and first != other
    for window in first:
        assert len(window.tokens) == 300
        start = int(window.sample_id.rsplit("@", 1)[1])
        assert start == 0 or docs[0].text[start - 1] == " "
    # Longer than one document: windows run on into the following ones (wrapping around).
    short = [texts.Document("a", "alpha " * 25), texts.Document("b", "beta " * 30)]
    for window in texts.sample_windows("short", short, tokenizer, 200, 4, seed=0):
        text = tokenizer.decode(window.tokens)
        assert len(window.tokens) == 200 and "alpha" in text and "beta" in text
    with pytest.raises(ValueError, match="fewer than the 9999 tokens"):
        texts.sample_windows("builtin", docs, tokenizer, 9999, 1, seed=0)


class BosByteTokenizer(ByteTokenizer):
    """Bytes as tokens, with a BOS token (256) put first, as Gemma's tokenizer does."""

    bos_token_id = 256

    def encode(self, text: str) -> list[int]:
        return [self.bos_token_id] + super().encode(text)


def test_windows_keep_the_bos_a_tokenizer_puts_first_unless_spliced():
    docs = texts.load_source("builtin")
    plain = texts.sample_windows("builtin", docs, ByteTokenizer(), 200, 2, seed=3)
    with_bos = texts.sample_windows("builtin", docs, BosByteTokenizer(), 200, 2, seed=3)
    spliced = texts.sample_windows("builtin", docs, BosByteTokenizer(), 200, 2, seed=3,
                                   keep_bos=False)
    for p, b, s in zip(plain, with_bos, spliced):
        assert len(b.tokens) == 200 and b.tokens[0] == 256 and b.tokens[1:] == p.tokens[:199]
        assert s.tokens == p.tokens and 256 not in s.tokens


def test_files_and_folders_are_sources(tmp_path):
    (tmp_path / "a.txt").write_text("alpha text")
    (tmp_path / "b.txt").write_text("beta text")
    assert texts.load_source(str(tmp_path / "a.txt")) == [texts.Document("a.txt", "alpha text")]
    assert [d.doc_id for d in texts.load_source(str(tmp_path))] == ["a.txt", "b.txt"]
    with pytest.raises(ValueError, match="neither a known source"):
        texts.load_source(str(tmp_path / "missing.txt"))


def test_a_source_without_its_tool_or_cache_is_skipped_with_a_message(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CAMKV_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(shutil, "which", lambda tool: None)
    with pytest.raises(texts.SourceUnavailable, match="needs npm, which is not installed"):
        texts.load_source("sotu")
    with pytest.raises(texts.SourceUnavailable, match="needs apt-get, dpkg-deb"):
        texts.load_source("austen")
    with pytest.raises(texts.SourceUnavailable, match="--offline forbids"):
        texts.load_source("kjv", offline=True)
    documents = load_documents(["sotu", "builtin"], offline=False)
    assert list(documents) == ["builtin"]
    assert "skipping text source 'sotu'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="none of the text sources"):
        load_documents(["sotu"], offline=False)


def test_a_cached_source_is_read_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("CAMKV_CACHE_DIR", str(tmp_path))
    docs = [texts.Document("1790_george_washington_n", "Fellow-Citizens of the Senate")]
    texts._write_cache("sotu", "test", docs)
    monkeypatch.setattr(shutil, "which", lambda tool: None)
    assert texts.load_source("sotu", offline=True) == docs


def test_the_real_austen_cache_when_present():
    try:
        novels = {d.doc_id: d.text for d in texts.load_source("austen", offline=True)}
    except texts.SourceUnavailable:
        pytest.skip("austen is not cached here (run `camkv eval --fetch-only --texts austen`)")
    assert sorted(novels) == ["emma", "mansfieldpark", "northangerabbey", "persuasion",
                              "prideprejudice", "sensesensibility"]
    assert ("It is a truth universally acknowledged, that a single man in possession of a "
            "good fortune, must be in want of a wife.") in novels["prideprejudice"]
