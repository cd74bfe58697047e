"""Bounds on GBNF grammars, checked before llama.cpp parses or runs them.

A grammar is text from the user, and llama.cpp's grammar code trusts it: deep
nesting overflows the parser's C stack, chains and diamonds of rules make its
left-recursion check overflow or take exponential time, a rule that reaches
itself through rules matching the empty string makes it push parse stacks
forever, and nested optional repetitions multiply the stacks of one step into
the millions. ``check_grammar`` refuses all of these with a ValueError that
says which bound was hit (the bounds are PYSPEC_GRAMMAR_* in decl/pyspec_ext.h;
the analysis is csrc/pyspec_grammar.cpp, on llama.cpp's own parse of the text).
"""

from __future__ import annotations

from typing import Any

from pyspec.core.ext_error import last_error
from pyspec.ffi import c_const, ext, ffi

__all__ = ["GRAMMAR_LIMITS", "check_grammar"]

GRAMMAR_LIMITS = {name: c_const(f"PYSPEC_GRAMMAR_{name.upper()}") for name in
                  ("max_bytes", "max_nesting", "max_elements", "max_depth", "max_steps", "max_stacks")}


def check_grammar(grammar: str, root: str = "root", vocab_ptr: Any = None) -> None:
    """Raise ValueError unless llama.cpp can parse and run ``grammar`` within the bounds."""
    if not isinstance(grammar, str) or not isinstance(root, str):
        raise TypeError("grammar and root must be str")
    data = grammar.encode("utf-8", "surrogatepass")
    if len(data) > GRAMMAR_LIMITS["max_bytes"]:
        raise ValueError(f"grammar of {len(data)} bytes exceeds the limit of {GRAMMAR_LIMITS['max_bytes']} bytes")
    if "\0" in root:
        raise ValueError("root contains a NUL character")
    if ext.pyspec_grammar_check(vocab_ptr if vocab_ptr is not None else ffi.NULL, data, len(data), root.encode()) != 0:
        raise ValueError(f"grammar refused: {last_error()}")
