"""Suffix decoding, the ``suffix`` speculative type (beyond llama.cpp): pyspec.suffix.impl, pyspec.suffix.index."""

from pyspec.suffix.impl import (
    SUFFIX_TYPE_NAME,
    SuffixImpl,
    SuffixParams,
    impl_name,
    speculative_init,
    split_suffix_type,
    suffix_n_max,
)
from pyspec.suffix.index import GlobalSuffixIndex, SuffixDraft, SuffixIndex

__all__ = [
    "SUFFIX_TYPE_NAME", "GlobalSuffixIndex", "SuffixDraft", "SuffixImpl", "SuffixIndex", "SuffixParams", "impl_name",
    "speculative_init", "split_suffix_type", "suffix_n_max",
]
