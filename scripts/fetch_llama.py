#!/usr/bin/env python3
"""Fetch the pinned llama.cpp and extract it into a folder (default: vendor/llama.cpp).

The pins live in pyspec/version.py: llama.cpp at LLAMA_CPP_REVISION is exactly the
tree that the source distribution LLAMA_CPP_SDIST on PyPI carries as vendor/llama.cpp,
and LLAMA_CPP_SDIST_SHA256 is that archive's sha256.

The archive comes from, in this order: the file named by $PYSPEC_LLAMA_CPP_ARCHIVE (for
machines without network), the download cache (``$XDG_CACHE_HOME/pyspec``, default
``~/.cache/pyspec``), or the package index ($PIP_INDEX_URL, default PyPI's simple index,
read as PEP 503 pages). Whatever the source, its sha256 must equal the pin. Only the
standard library is used, so the script runs in a bare venv and inside the isolated
environment of a PEP 517 build (CMakeLists.txt calls it when vendor/llama.cpp is absent,
with --dest in the build tree). A second run finds the tree in place and does nothing.

    python scripts/fetch_llama.py                      # vendor/llama.cpp, for development
    python scripts/fetch_llama.py --dest build/x/llama.cpp
"""

from __future__ import annotations

import argparse
import hashlib
import os
import runpy
import shutil
import sys
import tarfile
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEST = ROOT / "vendor" / "llama.cpp"
STAMP_NAME = ".pyspec-revision"

# the pins: one home, pyspec/version.py (read by path: importing pyspec needs its dependencies)
_PINS = runpy.run_path(str(ROOT / "pyspec" / "version.py"))
REVISION: str = _PINS["LLAMA_CPP_REVISION"]
PACKAGE: str = _PINS["LLAMA_CPP_SDIST"]  # "name==version"
SHA256: str = _PINS["LLAMA_CPP_SDIST_SHA256"]

_NAME, _VERSION = PACKAGE.split("==")
# PEP 625 file name of the sdist; the archive holds one folder named like it
_STEM = f"{_NAME.replace('-', '_')}-{_VERSION}"
ARCHIVE = f"{_STEM}.tar.gz"
INNER = f"{_STEM}/vendor/llama.cpp/"

DEFAULT_INDEX = "https://pypi.org/simple"
ARCHIVE_ENV = "PYSPEC_LLAMA_CPP_ARCHIVE"
TIMEOUT_S = 60


class FetchError(Exception):
    """Why the pinned llama.cpp could not be obtained (printed as one message)."""


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pyspec"


def index_url() -> str:
    return (os.environ.get("PIP_INDEX_URL") or DEFAULT_INDEX).rstrip("/")


class _Links(HTMLParser):
    """The href of every anchor in a PEP 503 project page."""

    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            href = dict(attrs).get("href")
            if href:
                self.hrefs.append(href)


def find_archive_url(index: str, name: str = _NAME, archive: str = ARCHIVE) -> str:
    """The URL of ``archive`` (the pinned one by default) on the project's page of a PEP 503 index."""
    page = f"{index}/{name.lower()}/"
    with urllib.request.urlopen(page, timeout=TIMEOUT_S) as resp:
        text = resp.read().decode("utf-8", "replace")
        base = resp.geturl()
    links = _Links()
    links.feed(text)
    for href in links.hrefs:
        url = urllib.parse.urljoin(base, href)
        if urllib.parse.urlsplit(url).path.rsplit("/", 1)[-1] == archive:
            return url.split("#", 1)[0]
    raise FetchError(f"{page} lists no {archive}")


def download(url: str, target: Path) -> None:
    """Stream url into target, printing progress every 10%."""
    with urllib.request.urlopen(url, timeout=TIMEOUT_S) as resp, target.open("wb") as out:
        total = int(resp.headers.get("Content-Length") or 0)
        done, shown = 0, 0
        while chunk := resp.read(1 << 20):
            out.write(chunk)
            done += len(chunk)
            if total and done * 10 // total > shown:
                shown = done * 10 // total
                say(f"  {done >> 20} of {total >> 20} MB")


def obtain_archive(workdir: Path) -> Path:
    """A verified copy of the pinned archive: from $PYSPEC_LLAMA_CPP_ARCHIVE, the cache, or the index."""
    override = os.environ.get(ARCHIVE_ENV)
    if override:
        path = Path(override)
        if not path.is_file():
            raise FetchError(f"{ARCHIVE_ENV}={override} is not a file")
        check_hash(path, f"{ARCHIVE_ENV}={override}")
        return path

    cached = cache_dir() / ARCHIVE
    if cached.is_file() and sha256_of(cached) == SHA256:
        say(f"using the cached {cached}")
        return cached

    index = index_url()
    try:
        url = find_archive_url(index)
        say(f"downloading {url}")
        part = workdir / (ARCHIVE + ".part")
        download(url, part)
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise FetchError(
            f"could not download {ARCHIVE} ({PACKAGE}, the source of llama.cpp {REVISION}) "
            f"from the package index {index}: {reason}\n"
            "The build needs this archive once. Either reach the index (a mirror: set PIP_INDEX_URL), "
            f"or copy the archive onto this machine and set {ARCHIVE_ENV}=/path/to/{ARCHIVE} "
            f"(its sha256 must be {SHA256})."
        ) from exc
    check_hash(part, url)
    try:  # keep it for the next build; a read-only home only costs a download next time
        cached.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(part, cached.with_suffix(".tmp"))
        os.replace(cached.with_suffix(".tmp"), cached)
    except OSError:
        pass
    return part


def check_hash(path: Path, origin: str) -> None:
    got = sha256_of(path)
    if got != SHA256:
        raise FetchError(f"sha256 mismatch for {ARCHIVE} from {origin}: expected {SHA256}, got {got}")


def extract(archive: Path, into: Path, inner: str = INNER) -> None:
    """Extract the folder ``inner`` (the pinned tree by default), only it, from archive into the folder into."""
    with tarfile.open(archive, "r:gz") as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(inner)]
        if not members:
            raise FetchError(f"{archive.name} holds no {inner}")
        for m in members:
            m.name = m.name[len(inner):]
            if not m.name:
                continue
            if m.name.startswith("/") or ".." in Path(m.name).parts:
                raise FetchError(f"unsafe path in {archive.name}: {m.name}")
            if hasattr(tarfile, "data_filter"):  # Python >= 3.11.4: refuse links leaving the tree
                tar.extract(m, into, filter="data")
            else:
                tar.extract(m, into)


def fetch(dest: Path) -> None:
    """Put llama.cpp REVISION at dest (a no-op when it is there already)."""
    stamp = dest / STAMP_NAME
    if stamp.is_file() and stamp.read_text().strip() == REVISION:
        say(f"{dest} is at {REVISION} already")
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    # staging beside dest: the final move is a rename on one file system
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".fetch-") as td:
        work = Path(td)
        archive = obtain_archive(work)
        say(f"extracting llama.cpp {REVISION} from {archive.name}")
        staging = work / "llama.cpp"
        staging.mkdir()
        extract(archive, staging)
        (staging / STAMP_NAME).write_text(REVISION + "\n")
        if dest.exists():
            shutil.rmtree(dest)
        staging.rename(dest)
    say(f"llama.cpp {REVISION} is in {dest}")


def say(msg: str) -> None:
    print(f"fetch_llama: {msg}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dest", type=Path, default=DEST, help="folder for the llama.cpp tree (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        fetch(args.dest.resolve())
    except FetchError as exc:
        print(f"fetch_llama: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
