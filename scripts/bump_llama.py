#!/usr/bin/env python3
"""Prepare a llama.cpp bump: fetch a candidate revision and write what it changes for pyspec.

    python scripts/bump_llama.py llama-cpp-python==0.3.36
    python scripts/bump_llama.py llama-cpp-python==0.3.36 --archive ~/Downloads/llama_cpp_python-0.3.36.tar.gz

The candidate is the llama.cpp tree that a llama-cpp-python sdist on the package index
vendors (as for the pin in pyspec/version.py). The script extracts it under
build/bump/<version>/llama.cpp and writes build/bump/<version>/REPORT.md:

- the pin lines for pyspec/version.py (revision from the sdist's CHANGELOG, sha256);
- every text of the drift record (pyspec/common/UPSTREAM.sha256) that changed, as a
  unified diff whose hunks name the C++ function they fall in and the Python twin
  (``def``/``class`` of the same name in the mirroring files) to review;
- the speculative types and parameter fields added or removed;
- the declaration changes of the mirrored headers (functions, structs, enums), and
  the problems the current pyspec/decl files have against the new headers (what the
  header tests will report after the move).

Nothing in the checkout changes: moving the pin is the reviewed step after this report
(CONTRIBUTING.md, "Moving the llama.cpp pin"). Needs the test environment (pycparser).
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import re
import shutil
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pyspec.testing import abi, upstream  # noqa: E402
from pyspec.testing.models import llama_cpp_dir  # noqa: E402


def _fetcher() -> ModuleType:
    """scripts/fetch_llama.py as a module: one downloader for the pin and for candidates."""
    spec = importlib.util.spec_from_file_location("fetch_llama", ROOT / "scripts" / "fetch_llama.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# --- the candidate tree ---------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    package: str  # "llama-cpp-python==X"
    archive: Path
    sha256: str
    revision: str  # llama.cpp commit the sdist's CHANGELOG names ("?" when it names none)
    tree: Path


_REV = re.compile(r"llama\.cpp to ggml-org/llama\.cpp@([0-9a-f]{7,40})")


def revision_from_changelog(text: str, version: str) -> str:
    """The llama.cpp commit of ``version``'s CHANGELOG section: its first "update llama.cpp to" line."""
    section = re.search(rf"^## \[{re.escape(version)}\].*?(?=^## \[|\Z)", text, re.MULTILINE | re.DOTALL)
    m = _REV.search(section.group(0) if section else text)
    return m.group(1) if m else "?"


def obtain(package: str, archive: Path | None, workdir: Path) -> Candidate:
    fl = _fetcher()
    name, _, version = package.partition("==")
    if not version:
        raise SystemExit(f"bump_llama: name the candidate as NAME==VERSION, not {package!r}")
    stem = f"{name.replace('-', '_')}-{version}"
    if archive is None:
        archive = workdir / f"{stem}.tar.gz"
        if not archive.is_file():
            url = fl.find_archive_url(fl.index_url(), name=name, archive=archive.name)
            print(f"bump_llama: downloading {url}", flush=True)
            part = archive.with_suffix(".part")
            fl.download(url, part)
            part.rename(archive)
    sha = fl.sha256_of(archive)
    tree = workdir / "llama.cpp"
    if not (tree / "common" / "speculative.cpp").is_file():
        with tempfile.TemporaryDirectory(dir=workdir, prefix=".extract-") as td:
            staging = Path(td) / "llama.cpp"
            staging.mkdir()
            fl.extract(archive, staging, inner=f"{stem}/vendor/llama.cpp/")
            if tree.exists():
                shutil.rmtree(tree)
            staging.rename(tree)
    changelog = _member_text(archive, f"{stem}/CHANGELOG.md")
    return Candidate(package, archive, sha, revision_from_changelog(changelog, version), tree)


def _member_text(archive: Path, member: str) -> str:
    with tarfile.open(archive, "r:gz") as tar:
        try:
            f = tar.extractfile(member)
        except KeyError:
            return ""
        return f.read().decode("utf-8", "replace") if f is not None else ""


# --- hunks and their twins ------------------------------------------------------

# a definition line at column 0 (function or struct), or a member function indented once
_TOP_DEF = re.compile(r"^(?:struct\s+(\w+)\s*(?::[^{]*)?\{|[A-Za-z_][\w:<>,\*&\s]*?\b(~?[\w:]+)\s*\([^;]*$)")
_MEMBER_DEF = re.compile(r"^ {4}(?:[\w:<>,\*&]+\s+)*?(~?\w+)\s*\([^;]*\)\s*(?:const\s*)?(?:override\s*)?\{?\s*$")
_KEYWORDS = {"if", "for", "while", "switch", "return", "sizeof", "catch"}


def definitions(lines: list[str]) -> list[tuple[str, str]]:
    """For each line of a C++ file, the (struct, function) it falls in; "" where none (one forward pass)."""
    out = []
    struct = function = ""
    for line in lines:
        top = _TOP_DEF.match(line)
        if top and not line.startswith(("#", "//", " ", "}")):
            if top.group(1):
                struct, function = top.group(1), ""
            elif (name := top.group(2).split("::")[-1]) not in _KEYWORDS:
                owner = top.group(2).split("::")[0] if "::" in top.group(2) else ""
                struct, function = owner, name
        elif struct and (member := _MEMBER_DEF.match(line)) and member.group(1) not in _KEYWORDS:
            function = member.group(1)
        out.append((struct, function))
    return out


def camel(name: str) -> str:
    """The Python class of a C++ struct: common_speculative_impl_draft_simple -> CommonSpeculativeImplDraftSimple."""
    return "".join(part.capitalize() for part in name.split("_"))


def find_twin(struct: str, function: str, mirrors: Iterable[Path]) -> str:
    """"file:line name" of the Python twin of a C++ definition in the mirroring files; "" if none."""
    if struct and function:
        py_fn = "__init__" if function == struct else ("close" if function.startswith("~") else function)
        cls = camel(struct)
        for path in mirrors:
            text = path.read_text().splitlines()
            for n, line in enumerate(text):
                if re.match(rf"class {cls}\b", line):
                    for k in range(n + 1, len(text)):
                        if re.match(r"(class |def )", text[k]):
                            break
                        if re.match(rf"\s+def {re.escape(py_fn)}\(", text[k]):
                            return f"{_rel(path)}:{k + 1} {cls}.{py_fn}"
                    return f"{_rel(path)}:{n + 1} class {cls} (no {py_fn} yet)"
    names = [(rf"class {camel(struct)}\b", f"class {camel(struct)}")] if struct else []
    if function:
        names.insert(0, (rf"def {re.escape(function)}\(", f"def {function}"))
    for pattern, label in names:
        for path in mirrors:
            for n, line in enumerate(path.read_text().splitlines()):
                if re.match(pattern, line):
                    return f"{_rel(path)}:{n + 1} {label}"
    return ""


def _rel(path: Path) -> str:
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


@dataclass
class Hunk:
    header: str  # "@@ -a,b +c,d @@"
    where: list[tuple[str, str, str]]  # (struct, function, Python twin) of each definition the hunk changes
    lines: list[str]


def annotated_diff(old: str, new: str, mirrors: list[Path]) -> list[Hunk]:
    """The unified diff of two texts, each hunk with the C++ definition it falls in and its Python twin."""
    a, b = old.splitlines(), new.splitlines()
    in_a, in_b = definitions(a), definitions(b)
    py = [m for m in mirrors if m.suffix == ".py"]
    out = []
    for group in difflib.SequenceMatcher(None, a, b, autojunk=False).get_grouped_opcodes(3):
        i1, i2, j1, j2 = group[0][1], group[-1][2], group[0][3], group[-1][4]
        body = []
        for tag, a1, a2, b1, b2 in group:
            if tag == "equal":
                body += [" " + s for s in a[a1:a2]]
            if tag in ("replace", "delete"):
                body += ["-" + s for s in a[a1:a2]]
            if tag in ("replace", "insert"):
                body += ["+" + s for s in b[b1:b2]]
        # the definitions the changed lines fall in (new side; the old side for pure deletions)
        seen: dict[tuple[str, str], None] = {}
        for tag, a1, a2, b1, b2 in group:
            if tag != "equal":
                for d in in_b[b1:b2] if b2 > b1 else in_a[a1:a2]:
                    seen.setdefault(d, None)
        where = [(st, fn, find_twin(st, fn, py)) for st, fn in seen]
        out.append(Hunk(f"@@ -{i1 + 1},{i2 - i1} +{j1 + 1},{j2 - j1} @@", where, body))
    return out


# --- the report's sections ------------------------------------------------------


def drift_section(old_tree: Path, new_tree: Path) -> tuple[list[str], int]:
    """The changed texts of the drift record; returns (markdown lines, number changed)."""
    out = ["## Mirrored upstream texts (drift record)", ""]
    changed = 0
    for src in upstream.read_record():
        old = _text(old_tree, src.path, src.block)
        new = _text(new_tree, src.path, src.block)
        if old == new:
            continue
        changed += 1
        mirrors = [ROOT / m for m in src.mirrors]
        if new is None:
            out += [f"### {src.name}: gone", "", f"Review: {', '.join(src.mirrors)}.", ""]
            continue
        diff = annotated_diff(old or "", new, [p for p in mirrors if p.is_file()])
        plus = sum(1 for h in diff for s in h.lines if s.startswith("+"))
        minus = sum(1 for h in diff for s in h.lines if s.startswith("-"))
        out += [f"### {src.name}: {len(diff)} hunks, +{plus} -{minus}", "", f"Review: {', '.join(src.mirrors)}.", ""]
        for h in diff:
            places = [
                f"`{'::'.join(x for x in (st, fn) if x) or '(top level)'}` → {twin or 'no Python twin found'}"
                for st, fn, twin in h.where
            ]
            out += [f"- `{h.header}`: " + "; ".join(places)]
        out += ["", "<details><summary>diff</summary>", "", "```diff"]
        for h in diff:
            out += [h.header, *h.lines]
        out += ["```", "", "</details>", ""]
    if not changed:
        out += ["Every recorded text is unchanged.", ""]
    return out, changed


def _text(tree: Path, path: str, block: str) -> str | None:
    f = tree / path
    if not f.is_file():
        return None
    text = f.read_text(encoding="utf-8", errors="replace")
    return upstream.extract(text, block) if block else text


def enum_members(text: str, name: str) -> list[str]:
    block = upstream.extract(text, f"enum {name}") or ""
    return re.findall(r"^\s*([A-Z][A-Z0-9_]+)\b", block, re.MULTILINE)


def struct_fields(text: str, name: str) -> list[str]:
    """The member declarations of a C++ struct, one per line, comments and whitespace dropped."""
    block = upstream.extract(text, f"struct {name}") or ""
    body = block[block.find("{") + 1 : block.rfind("}")]
    body = re.sub(r"//[^\n]*", "", body)
    return [" ".join(s.split()) for s in body.split(";") if s.strip() and "(" not in s]


def speculative_section(old_tree: Path, new_tree: Path) -> list[str]:
    old_h = (old_tree / "common" / "common.h").read_text()
    new_h = (new_tree / "common" / "common.h").read_text()
    out = ["## Speculative types and parameters", ""]
    old_t, new_t = enum_members(old_h, "common_speculative_type"), enum_members(new_h, "common_speculative_type")
    added = [t for t in new_t if t not in old_t]
    removed = [t for t in old_t if t not in new_t]
    out += [f"- types: {len(old_t)} → {len(new_t)}; added: {', '.join(added) or 'none'}; "
            f"removed: {', '.join(removed) or 'none'}"]
    structs = sorted(set(re.findall(r"^struct (common_params_speculative\w*)\s*\{", new_h + old_h, re.MULTILINE)))
    for s in structs:
        a, b = struct_fields(old_h, s), struct_fields(new_h, s)
        if a == b:
            continue
        plus = [f for f in b if f not in a]
        minus = [f for f in a if f not in b]
        out += [f"- `struct {s}`: added {_code(plus)}; removed {_code(minus)}"]
    return [*out, ""]


def _code(items: list[str]) -> str:
    return ", ".join(f"`{i}`" for i in items) or "none"


def declarations_section(old_tree: Path, new_tree: Path) -> tuple[list[str], int]:
    """Header changes (functions, structs, enums) and the decl problems against the new headers."""
    old, new = abi.header_declarations(old_tree), abi.header_declarations(new_tree)
    out = ["## Declarations (the mirrored headers)", ""]
    for name in sorted(new.functions):
        fo, fn = old.functions.get(name, {}), new.functions[name]
        so, sn = old.structs.get(name, {}), new.structs[name]
        eo, en = old.enums.get(name, {}), new.enums[name]
        rows = []
        rows += [f"- function added: `{f}` `{fn[f]}`" for f in fn if f not in fo]
        rows += [f"- function removed: `{f}`" for f in fo if f not in fn]
        rows += [f"- function changed: `{f}`: `{fo[f]}` → `{fn[f]}`" for f in fn if f in fo and fo[f] != fn[f]]
        rows += [f"- struct added: `{s}`" for s in sn if s not in so]
        rows += [f"- struct removed: `{s}`" for s in so if s not in sn]
        rows += [f"- struct changed: `{s}`" for s in sn if s in so and so[s] != sn[s]]
        rows += [f"- enum added: `{e}`" for e in en if e not in eo]
        rows += [f"- enum changed: `{e}`" for e in en if e in eo and eo[e] != en[e]]
        if rows:
            out += [f"### {name}", "", *rows, ""]
    report = abi.compare(root=new_tree)
    out += ["### What pyspec/decl reports against the new headers", ""]
    out += [f"- {p}" for p in report.problems] or ["- nothing: the declarations match the new headers"]
    return [*out, ""], len(report.problems)


def write_report(cand: Candidate, old_tree: Path, out: Path, seconds: float) -> dict[str, int]:
    lines = [f"# llama.cpp bump candidate: {cand.revision} ({cand.package})", ""]
    lines += [
        "Pin lines for pyspec/version.py:",
        "",
        "```python",
        f'LLAMA_CPP_REVISION = "{cand.revision}"',
        f'LLAMA_CPP_SDIST = "{cand.package}"',
        f'LLAMA_CPP_SDIST_SHA256 = "{cand.sha256}"',
        "```",
        "",
        f"Candidate tree: `{_rel(cand.tree)}`. Then: CONTRIBUTING.md, \"Moving the llama.cpp pin\".",
        "",
    ]
    drift, n_drift = drift_section(old_tree, cand.tree)
    decls, n_decl = declarations_section(old_tree, cand.tree)
    lines += speculative_section(old_tree, cand.tree) + decls + drift
    lines += [f"Report written in {seconds + 0.0:.0f} s (fetch included)."]
    out.write_text("\n".join(lines) + "\n")
    return {"drifted_texts": n_drift, "decl_problems": n_decl}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/bump_llama.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("package", help="the candidate sdist, e.g. llama-cpp-python==0.3.36")
    ap.add_argument("--archive", type=Path, help="a local copy of the sdist (no download)")
    ap.add_argument("--out", type=Path, help="folder for the tree and REPORT.md (default build/bump/<version>)")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    version = args.package.partition("==")[2] or "candidate"
    work = (args.out or ROOT / "build" / "bump" / version).resolve()
    work.mkdir(parents=True, exist_ok=True)
    cand = obtain(args.package, args.archive, work)
    report = work / "REPORT.md"
    counts = write_report(cand, llama_cpp_dir(), report, time.monotonic() - t0)
    print(f"bump_llama: {cand.package} is llama.cpp {cand.revision} (sha256 {cand.sha256})")
    print(f"bump_llama: {counts['drifted_texts']} mirrored texts changed, "
          f"{counts['decl_problems']} declaration problems against the new headers")
    print(f"bump_llama: report in {report}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
