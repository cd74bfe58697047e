"""Suffix decoding, the ``suffix`` speculative type (beyond llama.cpp): pyspec.suffix.impl, pyspec.suffix.index.

The names load lazily: ``from pyspec.suffix.names import SUFFIX_TYPE_NAME`` (or this package's
SUFFIX_TYPE_NAME / split_suffix_type) opens no library; the implementation imports the port.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pyspec.suffix.names import SUFFIX_TYPE_NAME, split_suffix_type

if TYPE_CHECKING:
    from pyspec.suffix.impl import (
        SuffixImpl,
        SuffixParams,
        impl_name,
        speculative_init,
        suffix_n_max,
        suffix_params,
    )
    from pyspec.suffix.index import GlobalSuffixIndex, SuffixDraft, SuffixIndex

__all__ = [
    "SUFFIX_TYPE_NAME", "GlobalSuffixIndex", "SuffixDraft", "SuffixImpl", "SuffixIndex", "SuffixParams", "impl_name",
    "speculative_init", "split_suffix_type", "suffix_n_max", "suffix_params",
]

_HOME = {
    "SuffixImpl": "impl", "SuffixParams": "impl", "impl_name": "impl", "speculative_init": "impl",
    "suffix_n_max": "impl", "suffix_params": "impl", "GlobalSuffixIndex": "index", "SuffixDraft": "index",
    "SuffixIndex": "index",
}


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(f"pyspec.suffix.{_HOME[name]}"), name)
    raise AttributeError(f"module 'pyspec.suffix' has no attribute {name!r}")
