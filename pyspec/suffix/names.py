"""The suffix type's name, importable without opening a library (the CLI's --help lists it)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["SUFFIX_TYPE_NAME", "split_suffix_type"]

# not one of llama.cpp's names (common_speculative_type_from_name_map): no clash
SUFFIX_TYPE_NAME = "suffix"


def split_suffix_type(names: str | Sequence[Any]) -> tuple[list[Any], bool]:
    """``names`` as parse_types takes them, less "suffix": (the rest, whether "suffix" was named).

    A string is split as parse_types splits it ("," and "+"); "none" stays in the rest, and
    "suffix" alone leaves ``["none"]``."""
    if isinstance(names, str):
        names = [n.strip() for n in names.replace("+", ",").split(",") if n.strip()]
    rest = [n for n in names if not (isinstance(n, str) and n == SUFFIX_TYPE_NAME)]
    selected = len(rest) != len(names)
    if selected and not rest:
        rest = ["none"]
    return rest, selected
