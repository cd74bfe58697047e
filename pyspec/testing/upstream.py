"""Drift of the upstream sources that pyspec mirrors: their sha256, recorded and checked.

``pyspec/common/UPSTREAM.sha256`` records, for the pinned llama.cpp, the sha256
of every upstream text that a part of pyspec mirrors line for line (the port,
its parameter structs, the cffi declarations), and which pyspec files mirror
it. A text is a whole file (``common/speculative.cpp``) or one definition in a
file (``common/common.h :: struct common_params_speculative``, or every
top-level definition of a function such as ``common/common.cpp ::
common_batch_add``), so that the parts of a large file the port does not
mirror may change without a false alarm.

When the vendored tree differs from the record (a new pin, a local edit),
:func:`check` returns one :class:`Drift` per text that changed, naming the
pyspec files to review; after the review, ``python -m pyspec.testing.upstream
--update`` rewrites the record from the vendored tree.

The C++ in ``csrc/`` compiles against llama.cpp's private headers too (``src/llama-context.h``,
``src/llama-grammar.h``, ``common/sampling.h``, ...), whose structs and functions carry no
API promise: :func:`unrecorded_includes` names every such header that a ``csrc/`` file
includes without a row of the record that names that file, so that a new pin's changes to
them are reviewed in the C++ that reads them. The public C headers (``include/``,
``ggml/include/``) are checked declaration by declaration instead (pyspec.testing.abi).
"""

from __future__ import annotations

import argparse
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CSRC", "RECORD", "Drift", "Source", "check", "digest", "extract", "read_record", "unrecorded_includes",
           "vendor_includes", "write_record"]

RECORD = Path(__file__).resolve().parents[1] / "common" / "UPSTREAM.sha256"
CSRC = Path(__file__).resolve().parents[2] / "csrc"

# llama.cpp's public C API: declared in pyspec/decl and compared with the headers by pyspec.testing.abi
PUBLIC_DIRS = ("include/", "ggml/include/")
# the include directories of the csrc targets in the llama.cpp tree, in the compiler's order
# (CMakeLists.txt: ${LLAMA_DIR}/src, then those llama-common and llama export)
_INCLUDE_DIRS = ("src", "common", "include", "ggml/include")
_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)
_CSRC_SUFFIXES = (".c", ".cpp", ".h")

_HEADER = """\
# sha256 of the upstream llama.cpp texts that pyspec mirrors, at the pinned revision, and of
# the private llama.cpp headers that csrc/ includes (each row names the csrc files that include it).
# Checked by tests/test_upstream_drift.py; rewrite with `python -m pyspec.testing.upstream --update`
# only after the files named on the right were reviewed against the new upstream text.
# <sha256>  <file in vendor/llama.cpp>[ :: <struct NAME | enum NAME | function NAME>]  -> <pyspec files>
"""


@dataclass(frozen=True)
class Source:
    """One recorded upstream text and the pyspec files that mirror it."""

    path: str  # relative to the llama.cpp tree
    block: str  # "" for the whole file, else "struct X", "enum X" or a function name
    sha256: str
    mirrors: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"{self.path} :: {self.block}" if self.block else self.path


@dataclass(frozen=True)
class Drift:
    """A recorded text that differs in the tree checked (``found`` is None when it is gone)."""

    source: Source
    found: str | None

    def __str__(self) -> str:
        what = "is missing" if self.found is None else "changed"
        return f"{self.source.name} {what}: review {', '.join(self.source.mirrors)}"


def _matching_brace(text: str, open_at: int) -> int:
    """Index just past the brace that closes the one at ``open_at`` (comments and strings are not parsed)."""
    depth = 0
    for i in range(open_at, len(text)):
        c = text[i]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i + 1
    raise ValueError("unbalanced braces")


def extract(text: str, block: str) -> str | None:
    """The text of ``block`` in a C/C++ source: a struct or enum definition, every top-level
    definition of a function (all overloads, in file order), or of a class's member functions
    (``"NAME::"``); None when absent."""
    kind, _, name = block.partition(" ")
    if kind in ("struct", "enum") and name:
        m = re.search(rf"^{kind} {re.escape(name)}\s*{{", text, re.MULTILINE)
        if m is None:
            return None
        end = _matching_brace(text, m.end() - 1)
        return text[m.start() : end]
    # a function ("NAME"), or every member function of a class ("NAME::"): a line starting at
    # column 0 that names it (a constructor's name starts the line), followed by its body
    pattern = re.escape(block) + (r"~?\w+" if block.endswith("::") else "")
    parts = []
    for m in re.finditer(rf"^(?=[^\s#/]).*?\b{pattern}\s*\(", text, re.MULTILINE):
        brace = text.find("{", m.end())
        semi = text.find(";", m.end())
        if brace < 0 or (0 <= semi < brace):
            continue  # a declaration, not a definition
        parts.append(text[m.start() : _matching_brace(text, brace)])
    return "\n".join(parts) if parts else None


def digest(tree: Path, path: str, block: str = "") -> str | None:
    """sha256 of the file (or of its block) in the llama.cpp ``tree``; None when absent."""
    f = tree / path
    if not f.is_file():
        return None
    data = f.read_bytes()
    if block:
        part = extract(data.decode("utf-8"), block)
        if part is None:
            return None
        data = part.encode("utf-8")
    return hashlib.sha256(data).hexdigest()


def read_record(record: Path = RECORD) -> list[Source]:
    out = []
    for n, line in enumerate(record.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            left, mirrors = line.split(" -> ")
            sha, where = left.split(None, 1)
        except ValueError:
            raise ValueError(f"{record}:{n}: not '<sha256>  <source>  -> <files>': {line!r}") from None
        path, _, block = (s.strip() for s in where.partition(" :: "))
        out.append(Source(path, block, sha, tuple(m.strip() for m in mirrors.split(","))))
    return out


def check(tree: Path, record: Path = RECORD) -> list[Drift]:
    """Every recorded text whose sha256 in ``tree`` differs from the record."""
    drifts = []
    for src in read_record(record):
        found = digest(tree, src.path, src.block)
        if found != src.sha256:
            drifts.append(Drift(src, found))
    return drifts


def write_record(tree: Path, record: Path = RECORD) -> list[Source]:
    """Rewrite the record's hashes from ``tree`` (same sources, same order)."""
    sources = read_record(record)
    lines = [_HEADER]
    width = max(len(s.name) for s in sources)
    new = []
    for s in sources:
        sha = digest(tree, s.path, s.block)
        if sha is None:
            raise ValueError(f"{s.name} is not in {tree}: edit the record by hand")
        new.append(Source(s.path, s.block, sha, s.mirrors))
        lines.append(f"{sha}  {s.name:<{width}}  -> {', '.join(s.mirrors)}\n")
    record.write_text("".join(lines))
    return new


def vendor_includes(tree: Path, csrc: Path = CSRC) -> dict[str, list[str]]:
    """The llama.cpp files that the ``csrc`` files include, each with the files that include it.

    A quoted ``#include`` that resolves beside the including file is pyspec's own
    (``pyspec_errbuf.h``, ``../pyspec/decl/...``); otherwise it is the first of the build's include
    directories in ``tree`` that holds it (a name found in none, such as a generated file, is skipped).
    Keys are paths in the tree (``src/llama-grammar.h``), values ``csrc/<name>`` in file order.
    """
    found: dict[str, list[str]] = {}
    for f in sorted(csrc.iterdir()):
        if f.suffix not in _CSRC_SUFFIXES or not f.is_file():
            continue
        for name in _INCLUDE.findall(f.read_text(encoding="utf-8")):
            if (f.parent / name).exists():
                continue
            for d in _INCLUDE_DIRS:
                if (tree / d / name).is_file():
                    users = found.setdefault(f"{d}/{name}", [])
                    if f"csrc/{f.name}" not in users:
                        users.append(f"csrc/{f.name}")
                    break
    return found


def unrecorded_includes(tree: Path, csrc: Path = CSRC, record: Path = RECORD) -> list[str]:
    """Every private llama.cpp file (outside :data:`PUBLIC_DIRS`) that a ``csrc`` file includes
    with no row of the record for that file that names the includer, as
    ``"<path> (included by csrc/<name>)"``; [] when each is recorded."""
    mirrors: dict[str, set[str]] = {}
    for src in read_record(record):
        mirrors.setdefault(src.path, set()).update(src.mirrors)
    out = []
    for path, users in vendor_includes(tree, csrc).items():
        if path.startswith(PUBLIC_DIRS):
            continue
        out += [f"{path} (included by {u})" for u in users if u not in mirrors.get(path, set())]
    return out


def main(argv: list[str] | None = None) -> int:
    from pyspec.testing.models import llama_cpp_dir

    ap = argparse.ArgumentParser(prog="python -m pyspec.testing.upstream", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", type=Path, default=None, help="llama.cpp tree (default: the vendored one)")
    ap.add_argument("--update", action="store_true", help="rewrite the record from the tree (after review)")
    args = ap.parse_args(argv)
    tree = args.tree or llama_cpp_dir()
    if args.update:
        write_record(tree)
        print(f"rewrote {RECORD}")
        return 0
    drifts = check(tree)
    for d in drifts:
        print(d)
    unrecorded = unrecorded_includes(tree)
    for u in unrecorded:
        print(f"{u}: a private llama.cpp header with no row naming the includer")
    if not drifts and not unrecorded:
        print(f"{tree}: every recorded upstream text is unchanged, every private header csrc/ includes is recorded")
    return 1 if drifts or unrecorded else 0


if __name__ == "__main__":
    raise SystemExit(main())
