"""Compare the cffi declarations (pyspec/decl) with the vendored llama.cpp headers.

Both sides go through the C preprocessor (``cc -E`` over small stand-in system
headers, ``__attribute__`` removed) and pycparser; each declaration is reduced to
a canonical form (types without parameter names, array sizes and enum values
evaluated) and compared:

- every function, struct, enum, typedef and ``#define`` of a declaration file
  must exist in the header it mirrors with the same signature, the same fields
  in the same order with the same types, the same enumerators with the same
  values, and appear in the header's order;
- for the files mirrored whole (COMPLETE), every function, struct, enum and
  typedef of the header must be declared, except the header's DEPRECATED(...)
  functions and the reasoned EXCLUDED entries.

``python -m pyspec.testing.abi`` prints the problems and the counts.
"""

from __future__ import annotations

import copy
import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pycparser import CParser, c_ast, c_generator

from pyspec import decl
from pyspec.testing.models import llama_cpp_dir

__all__ = [
    "COMPLETE",
    "EXCLUDED",
    "AbiReport",
    "Declarations",
    "compare",
    "deprecated_functions",
    "header_declarations",
    "parse_declarations",
]

# Declaration files that mirror their header whole: everything the header declares
# must be declared (the other files declare the part pyspec and llama.h need).
COMPLETE = ("ggml-backend.h", "ggml-cpu.h", "llama.h")

# Non-deprecated entries of a COMPLETE header that are deliberately not declared,
# with the reason. (Nothing is left out today.)
EXCLUDED: dict[str, dict[str, str]] = {name: {} for name in COMPLETE}

# Stand-ins for the C library headers the ggml/llama headers include: only the
# type names matter (declarations are compared by spelling, not resolved).
_STUB_HEADERS = {
    "stdint.h": (
        "typedef signed char int8_t; typedef short int16_t; typedef int int32_t; typedef long int64_t;\n"
        "typedef unsigned char uint8_t; typedef unsigned short uint16_t; typedef unsigned int uint32_t;\n"
        "typedef unsigned long uint64_t; typedef long intptr_t; typedef unsigned long uintptr_t;\n"
    ),
    "stddef.h": "typedef unsigned long size_t; typedef long ptrdiff_t;\n#define NULL ((void *) 0)\n",
    "stdbool.h": "typedef _Bool bool;\n#define true 1\n#define false 0\n",
    "stdio.h": "typedef struct FILE FILE;\n",
}
# sizes for `sizeof(T)` in array bounds (LP64, as the stand-ins above)
_SIZES = {
    "char": 1, "int8_t": 1, "uint8_t": 1, "bool": 1, "int16_t": 2, "uint16_t": 2, "int": 4, "float": 4,
    "int32_t": 4, "uint32_t": 4, "int64_t": 8, "uint64_t": 8, "size_t": 8, "double": 8, "long": 8,
}

_DEPRECATED = re.compile(r"DEPRECATED\(\s*(?:LLAMA_API\s+|GGML_API\s+)?[^;]*?(\w+)\s*\(")
_HINT = re.compile(r'"([^"]*)"\s*\)\s*;')


@dataclass
class Declarations:
    """The canonical declarations of one side, per file (decl file name)."""

    functions: dict[str, dict[str, str]] = field(default_factory=dict)
    structs: dict[str, dict[str, list[tuple[str, str]] | None]] = field(default_factory=dict)
    enums: dict[str, dict[str, list[tuple[str, int]]]] = field(default_factory=dict)
    typedefs: dict[str, dict[str, str]] = field(default_factory=dict)
    defines: dict[str, dict[str, int]] = field(default_factory=dict)
    # (kind, name) in source order, per file
    order: dict[str, list[tuple[str, str]]] = field(default_factory=dict)

    def add_file(self, name: str) -> None:
        for table in (self.functions, self.structs, self.enums, self.typedefs, self.defines, self.order):
            table.setdefault(name, {} if table is not self.order else [])  # type: ignore[arg-type]


@dataclass
class AbiReport:
    """What compare() found: the problems, and the counts for the README and notes."""

    problems: list[str]
    counts: dict[str, Any]


# ---------------------------------------------------------------------------
# preprocessing and parsing
# ---------------------------------------------------------------------------


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise RuntimeError("no C compiler (cc, gcc or clang) to preprocess the headers with; set CC")
    return cc


def _preprocess(source: str, include_dirs: list[Path]) -> str:
    with tempfile.TemporaryDirectory(prefix="pyspec-abi-") as tmp:
        stubs = Path(tmp) / "stubs"
        stubs.mkdir()
        for name, text in _STUB_HEADERS.items():
            (stubs / name).write_text(text)
        src = Path(tmp) / "input.c"
        src.write_text(source)
        cmd = [_compiler(), "-E", "-std=c11", "-nostdinc", f"-I{stubs}", "-D__attribute__(x)="]
        cmd += [f"-I{d}" for d in include_dirs] + [str(src)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"preprocessing failed ({' '.join(cmd)}):\n{done.stderr}")
        return done.stdout


def _strip_defines(text: str) -> str:
    # cffi's integer #defines are compared separately; blank them to keep line numbers
    return re.sub(r"^#define[^\n]*$", "", text, flags=re.M)


def parse_declarations(texts: Mapping[str, str] | None = None) -> Declarations:
    """The canonical declarations of the upstream-mirroring decl files (``texts`` overrides files)."""
    with tempfile.TemporaryDirectory(prefix="pyspec-decl-") as tmp:
        parts = ["#include <stdint.h>", "#include <stddef.h>", "#include <stdbool.h>", "#include <stdio.h>"]
        for name in decl.upstream_files():
            text = texts[name] if texts is not None and name in texts else decl.read(name)
            (Path(tmp) / name).write_text(_strip_defines(text))
            parts.append(f'#include "{name}"')
        pre = _preprocess("\n".join(parts) + "\n", [Path(tmp)])
        out = _collect(pre, {str(Path(tmp) / name): name for name in decl.upstream_files()})
    for name in decl.upstream_files():
        text = texts[name] if texts is not None and name in texts else decl.read(name)
        out.defines[name] = decl.define_values(text)
    return out


@functools.lru_cache(maxsize=2)
def header_declarations(root: Path | None = None) -> Declarations:
    """The canonical declarations of the headers that pyspec/decl mirrors, in the vendored tree or
    ``root`` (a candidate tree at a bump; cached)."""
    root = root or llama_cpp_dir()
    includes = [root / "include", root / "ggml" / "include"]
    headers = {name: root / header for name, header in decl.UPSTREAM.items()}
    defines = {name: sorted(decl.define_values(decl.read(name))) for name in decl.UPSTREAM}
    lines = [f'#include "{path}"' for path in headers.values()]
    # evaluate each #define the declarations carry, as the header defines it
    for names in defines.values():
        lines += [f"long long pyspec_define_{n} = ({n});" for n in names]
    pre = _preprocess("\n".join(lines) + "\n", includes)
    out = _collect(pre, {str(path): name for name, path in headers.items()})
    values = _define_values(pre)
    for name, names in defines.items():
        out.defines[name] = {n: values[n] for n in names if n in values}
    return out


def deprecated_functions(header: str = "llama.h", root: Path | None = None) -> dict[str, str]:
    """{function: deprecation hint} of the DEPRECATED(...) declarations of a mirrored header."""
    text = ((root or llama_cpp_dir()) / decl.UPSTREAM[header]).read_text()
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r"^\s*#.*$", "", text, flags=re.M)  # the macros' own definitions
    out = {}
    for m in _DEPRECATED.finditer(text):
        hint = _HINT.search(text, m.end())
        out[m.group(1)] = hint.group(1) if hint else ""
    return out


def _define_values(pre: str) -> dict[str, int]:
    ast = CParser().parse(pre, "<defines>")
    values = {}
    for node in ast.ext:
        if isinstance(node, c_ast.Decl) and node.name and node.name.startswith("pyspec_define_"):
            values[node.name[len("pyspec_define_"):]] = _eval(node.init, {})
    return values


def _collect(pre: str, files: dict[str, str]) -> Declarations:
    """Canonical declarations of preprocessed text, for the files in ``files`` (path -> name)."""
    ast = CParser().parse(pre, "<input>")
    out = Declarations()
    for name in files.values():
        out.add_file(name)
    enum_values: dict[str, int] = {}
    for node in ast.ext:
        coord = getattr(node, "coord", None)
        fname = files.get(os.path.normpath(coord.file)) if coord is not None else None
        if fname is None:
            _note_enums(node, enum_values)  # values from other headers may feed ours
            continue
        _add(out, fname, node, enum_values)
    return out


def _note_enums(node: Any, values: dict[str, int]) -> None:
    for enum in _enums_in(node):
        _enum_members(enum, values)


def _enums_in(node: Any) -> list[c_ast.Enum]:
    t = getattr(node, "type", None)
    while t is not None and not isinstance(t, c_ast.Enum):
        t = getattr(t, "type", None)
    return [t] if isinstance(t, c_ast.Enum) and t.values is not None else []


def _add(out: Declarations, fname: str, node: Any, enum_values: dict[str, int]) -> None:
    order = out.order[fname]
    if isinstance(node, c_ast.Typedef):
        inner = node.type.type if isinstance(node.type, c_ast.TypeDecl) else None
        if isinstance(inner, c_ast.Struct) and inner.decls is not None and inner.name:
            _add_struct(out, fname, inner, order)
        if isinstance(inner, c_ast.Enum) and inner.values is not None and inner.name:
            _add_enum(out, fname, inner, order, enum_values)
        out.typedefs[fname][node.name] = _type_str(node.type, enum_values)
        order.append(("typedef", node.name))
        return
    if not isinstance(node, c_ast.Decl):
        return
    if isinstance(node.type, c_ast.FuncDecl):
        if "static" in node.storage:
            return
        out.functions[fname][node.name] = _type_str(node.type, enum_values)
        order.append(("function", node.name))
    elif isinstance(node.type, c_ast.Struct):
        _add_struct(out, fname, node.type, order)
    elif isinstance(node.type, c_ast.Enum):
        _add_enum(out, fname, node.type, order, enum_values)
    # variables (static const ... in ggml.h) are not part of the ABI pyspec uses


def _add_struct(out: Declarations, fname: str, st: c_ast.Struct, order: list[tuple[str, str]]) -> None:
    structs = out.structs[fname]
    if st.decls is None:
        if st.name not in structs:
            structs[st.name] = None
            order.append(("struct", st.name))
        return
    fields = [(d.name or "", _type_str(d.type, {})) for d in st.decls]
    if st.name not in structs:
        order.append(("struct", st.name))
    structs[st.name] = fields


def _add_enum(
    out: Declarations, fname: str, en: c_ast.Enum, order: list[tuple[str, str]], values: dict[str, int]
) -> None:
    members = _enum_members(en, values)
    if en.name:
        out.enums[fname][en.name] = members
        order.append(("enum", en.name))


def _enum_members(en: c_ast.Enum, values: dict[str, int]) -> list[tuple[str, int]]:
    members = []
    nxt = 0
    for e in en.values.enumerators:
        value = _eval(e.value, values) if e.value is not None else nxt
        values[e.name] = value
        members.append((e.name, value))
        nxt = value + 1
    return members


# ---------------------------------------------------------------------------
# canonical forms
# ---------------------------------------------------------------------------


def _eval(node: Any, names: dict[str, int]) -> int:
    """The value of a constant expression (enum values, array bounds, #define values)."""
    if isinstance(node, c_ast.Constant):
        text = node.value.rstrip("uUlL")
        if node.type == "char":
            return ord(text.strip("'"))
        return int(text, 0) if not re.fullmatch(r"0[0-7]+", text) else int(text, 8)
    if isinstance(node, c_ast.ID):
        return names[node.name]
    if isinstance(node, c_ast.Cast):
        return _eval(node.expr, names)
    if isinstance(node, c_ast.UnaryOp):
        if node.op == "sizeof":
            return _SIZES[" ".join(node.expr.type.type.names)]
        v = _eval(node.expr, names)
        return {"-": -v, "+": v, "~": ~v, "!": int(not v)}[node.op]
    if isinstance(node, c_ast.BinaryOp):
        a, b = _eval(node.left, names), _eval(node.right, names)
        ops = {
            "+": a + b, "-": a - b, "*": a * b, "<<": a << b, ">>": a >> b, "|": a | b, "&": a & b, "^": a ^ b,
        }
        if node.op in ops:
            return ops[node.op]
        if node.op in ("/", "%"):
            return a // b if node.op == "/" else a % b
    raise ValueError(f"cannot evaluate constant expression {c_generator.CGenerator().visit(node)!r}")


class _Canon(c_ast.NodeVisitor):
    """Rewrites a copied type in place: no names, evaluated bounds, no restrict."""

    def __init__(self, enum_values: dict[str, int]) -> None:
        self.enum_values = enum_values

    def visit_TypeDecl(self, node: c_ast.TypeDecl) -> None:
        node.declname = None
        node.quals = [q for q in node.quals if q != "restrict"]
        self.generic_visit(node)

    def visit_PtrDecl(self, node: c_ast.PtrDecl) -> None:
        node.quals = [q for q in node.quals if q != "restrict"]
        self.generic_visit(node)

    def visit_ArrayDecl(self, node: c_ast.ArrayDecl) -> None:
        if node.dim is not None:
            node.dim = c_ast.Constant("int", str(_eval(node.dim, self.enum_values)))
        node.dim_quals = []
        self.generic_visit(node)

    def visit_Decl(self, node: c_ast.Decl) -> None:
        node.name = None
        node.quals = [q for q in node.quals if q != "restrict"]
        self.generic_visit(node)

    def visit_Typename(self, node: c_ast.Typename) -> None:
        node.name = None
        node.quals = [q for q in node.quals if q != "restrict"]
        self.generic_visit(node)

    def visit_Struct(self, node: c_ast.Struct) -> None:
        if node.name:  # a named struct in a type is a reference: its body is compared on its own
            node.decls = None
        self.generic_visit(node)

    def visit_Enum(self, node: c_ast.Enum) -> None:
        if node.name:
            node.values = None


def _type_str(node: Any, enum_values: dict[str, int]) -> str:
    t = copy.deepcopy(node)
    _Canon(enum_values).visit(t)
    text = c_generator.CGenerator().visit(t)
    return re.sub(r"\s+", " ", text).strip()


# ---------------------------------------------------------------------------
# comparison
# ---------------------------------------------------------------------------


def compare(texts: Mapping[str, str] | None = None, root: Path | None = None) -> AbiReport:
    """Compare the declaration files (``texts`` overrides some, for tests) with the headers
    (of the vendored tree, or of ``root``)."""
    mine = parse_declarations(texts)
    theirs = header_declarations(root)
    problems: list[str] = []
    counts: dict[str, Any] = {}
    for name in decl.upstream_files():
        problems += _compare_file(name, mine, theirs, root)
        deprecated = deprecated_functions(name, root)
        header_funcs = set(theirs.functions[name])
        live = header_funcs - set(deprecated)
        counts[name] = {
            "functions_declared": len(set(mine.functions[name]) & header_funcs),
            "functions_in_header": len(header_funcs),
            "functions_non_deprecated": len(live),
            "non_deprecated_declared": len(set(mine.functions[name]) & live),
            "deprecated": sorted(deprecated),
            "structs_declared": sum(1 for s in mine.structs[name].values() if s is not None),
            "structs_in_header": sum(1 for s in theirs.structs[name].values() if s is not None),
            "enums_declared": len(mine.enums[name]),
            "enums_in_header": len(theirs.enums[name]),
        }
    return AbiReport(problems, counts)


def _compare_file(name: str, mine: Declarations, theirs: Declarations, root: Path | None) -> list[str]:
    problems: list[str] = []
    where = f"decl/{name}"
    deprecated = deprecated_functions(name, root)

    for fn, sig in mine.functions[name].items():
        if fn not in theirs.functions[name]:
            problems.append(f"{where}: function {fn} is not in the header")
        elif theirs.functions[name][fn] != sig:
            problems.append(f"{where}: {fn} is declared as `{sig}`, the header has `{theirs.functions[name][fn]}`")
        elif fn in deprecated:
            problems.append(f"{where}: {fn} is deprecated upstream ({deprecated[fn]}); declare its replacement")

    for st, fields in mine.structs[name].items():
        if st not in theirs.structs[name]:
            problems.append(f"{where}: struct {st} is not in the header")
            continue
        if fields is None:
            continue
        other = theirs.structs[name][st]
        if other is None:
            problems.append(f"{where}: struct {st} has a body, the header declares it opaque")
        elif fields != other:
            problems.append(f"{where}: struct {st} fields differ: {_first_difference(fields, other)}")

    for en, members in mine.enums[name].items():
        if en not in theirs.enums[name]:
            problems.append(f"{where}: enum {en} is not in the header")
        elif members != theirs.enums[name][en]:
            problems.append(f"{where}: enum {en} differs: {_first_difference(members, theirs.enums[name][en])}")

    for td, text in mine.typedefs[name].items():
        if td not in theirs.typedefs[name]:
            problems.append(f"{where}: typedef {td} is not in the header")
        elif theirs.typedefs[name][td] != text:
            problems.append(f"{where}: typedef {td} is `{text}`, the header has `{theirs.typedefs[name][td]}`")

    for define, value in mine.defines[name].items():
        if define not in theirs.defines[name]:
            problems.append(f"{where}: #define {define} is not in the header")
        elif theirs.defines[name][define] != value:
            problems.append(f"{where}: #define {define} is {value}, the header has {theirs.defines[name][define]}")

    problems += _compare_order(where, mine.order[name], theirs.order[name])

    if name in COMPLETE:
        excluded = EXCLUDED[name]
        for fn in theirs.functions[name]:
            if fn not in mine.functions[name] and fn not in deprecated and fn not in excluded:
                problems.append(f"{where}: function {fn} of the header is not declared (nor excluded with a reason)")
        for st, fields in theirs.structs[name].items():
            if st in excluded:
                continue
            if st not in mine.structs[name]:
                problems.append(f"{where}: struct {st} of the header is not declared")
            elif fields is not None and mine.structs[name][st] is None:
                problems.append(f"{where}: struct {st} is declared opaque; the header gives its fields")
        for en in theirs.enums[name]:
            if en not in mine.enums[name] and en not in excluded:
                problems.append(f"{where}: enum {en} of the header is not declared")
        for td in theirs.typedefs[name]:
            if td not in mine.typedefs[name] and td not in excluded:
                problems.append(f"{where}: typedef {td} of the header is not declared")
    return problems


def _first_difference(mine: list[Any], theirs: list[Any]) -> str:
    for i, (a, b) in enumerate(zip(mine, theirs, strict=False)):
        if a != b:
            return f"at #{i} declared {a}, header {b}"
    longer, n = ("declared", len(mine)) if len(mine) > len(theirs) else ("header", len(theirs))
    extra = (mine if longer == "declared" else theirs)[min(len(mine), len(theirs))]
    return f"the {longer} side has {n - min(len(mine), len(theirs))} more, from {extra}"


def _compare_order(where: str, mine: list[tuple[str, str]], theirs: list[tuple[str, str]]) -> list[str]:
    position: dict[tuple[str, str], int] = {}
    for i, item in enumerate(theirs):
        position.setdefault(item, i)
    last, last_item = -1, None
    for item in mine:
        pos = position.get(item)
        if pos is None:
            continue
        if pos < last:
            return [f"{where}: {item[0]} {item[1]} comes before {last_item[1]} in the header; keep the header's order"]  # type: ignore[index]
        last, last_item = pos, item
    return []


def main() -> int:
    report = compare()
    for line in report.problems:
        print("PROBLEM", line)
    for name, c in report.counts.items():
        print(
            f"{name}: functions {c['functions_declared']}/{c['functions_in_header']} declared "
            f"({c['non_deprecated_declared']}/{c['functions_non_deprecated']} of the non-deprecated), "
            f"structs {c['structs_declared']}/{c['structs_in_header']}, "
            f"enums {c['enums_declared']}/{c['enums_in_header']}"
        )
        if c["deprecated"]:
            print(f"  deprecated, not declared: {', '.join(c['deprecated'])}")
    return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(main())
