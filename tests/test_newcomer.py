"""Mistakes a newcomer makes get a clear error naming the fix, or just work (issue 29)."""

from __future__ import annotations

import pytest

from pyspec.common.params import CommonParamsSpeculative, CommonSpeculativeType


def test_speculative_params_accept_the_cli_type_names() -> None:
    p = CommonParamsSpeculative(types=["ngram-map-k", "draft-simple"])
    assert p.types == [CommonSpeculativeType.NGRAM_MAP_K, CommonSpeculativeType.DRAFT_SIMPLE]


def test_speculative_params_accept_one_comma_separated_string() -> None:
    assert CommonParamsSpeculative(types="ngram-mod,ngram-cache").types == [
        CommonSpeculativeType.NGRAM_MOD, CommonSpeculativeType.NGRAM_CACHE]


def test_speculative_params_keep_enum_values() -> None:
    assert CommonParamsSpeculative(types=[CommonSpeculativeType.NGRAM_MOD]).types == [CommonSpeculativeType.NGRAM_MOD]


def test_unknown_speculative_type_name_lists_the_valid_names() -> None:
    with pytest.raises(ValueError, match=r"unknown speculative type: 'ngram-mapk'.*ngram-map-k, ngram-map-k4v"):
        CommonParamsSpeculative(types=["ngram-mapk"])
