"""Parameter structs of llama.cpp's common/common.h, as dataclasses.

Field names and defaults mirror the C++ structs at the pinned revision so that
the Python port and the C++ reference can be driven from one description.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from pyspec.ffi import c_const

__all__ = [
    "LLAMA_DEFAULT_SEED", "CommonParamsSampling", "CommonParamsSpeculative", "CommonParamsSpeculativeDraft",
    "CommonParamsSpeculativeNgramCache", "CommonParamsSpeculativeNgramMap", "CommonParamsSpeculativeNgramMod",
    "CommonSamplerType", "CommonSpeculativeType",
]

LLAMA_DEFAULT_SEED = 0xFFFFFFFF


def _c(name: str) -> int:
    # the values come from the declarations of decl/common.h, checked against the C++ reference
    return c_const(name)


class CommonSpeculativeType(enum.IntEnum):
    """Mirrors enum common_speculative_type (common.h)."""

    NONE = _c("COMMON_SPECULATIVE_TYPE_NONE")
    DRAFT_SIMPLE = _c("COMMON_SPECULATIVE_TYPE_DRAFT_SIMPLE")
    DRAFT_EAGLE3 = _c("COMMON_SPECULATIVE_TYPE_DRAFT_EAGLE3")
    DRAFT_MTP = _c("COMMON_SPECULATIVE_TYPE_DRAFT_MTP")
    NGRAM_SIMPLE = _c("COMMON_SPECULATIVE_TYPE_NGRAM_SIMPLE")
    NGRAM_MAP_K = _c("COMMON_SPECULATIVE_TYPE_NGRAM_MAP_K")
    NGRAM_MAP_K4V = _c("COMMON_SPECULATIVE_TYPE_NGRAM_MAP_K4V")
    NGRAM_MOD = _c("COMMON_SPECULATIVE_TYPE_NGRAM_MOD")
    NGRAM_CACHE = _c("COMMON_SPECULATIVE_TYPE_NGRAM_CACHE")
    COUNT = _c("COMMON_SPECULATIVE_TYPE_COUNT")


class CommonSamplerType(enum.IntEnum):
    """Mirrors enum common_sampler_type (common.h)."""

    NONE = _c("COMMON_SAMPLER_TYPE_NONE")
    DRY = _c("COMMON_SAMPLER_TYPE_DRY")
    TOP_K = _c("COMMON_SAMPLER_TYPE_TOP_K")
    TOP_P = _c("COMMON_SAMPLER_TYPE_TOP_P")
    MIN_P = _c("COMMON_SAMPLER_TYPE_MIN_P")
    TYPICAL_P = _c("COMMON_SAMPLER_TYPE_TYPICAL_P")
    TEMPERATURE = _c("COMMON_SAMPLER_TYPE_TEMPERATURE")
    XTC = _c("COMMON_SAMPLER_TYPE_XTC")
    INFILL = _c("COMMON_SAMPLER_TYPE_INFILL")
    PENALTIES = _c("COMMON_SAMPLER_TYPE_PENALTIES")
    TOP_N_SIGMA = _c("COMMON_SAMPLER_TYPE_TOP_N_SIGMA")
    ADAPTIVE_P = _c("COMMON_SAMPLER_TYPE_ADAPTIVE_P")


def _default_samplers() -> list[CommonSamplerType]:
    return [
        CommonSamplerType.PENALTIES,
        CommonSamplerType.DRY,
        CommonSamplerType.TOP_N_SIGMA,
        CommonSamplerType.TOP_K,
        CommonSamplerType.TYPICAL_P,
        CommonSamplerType.TOP_P,
        CommonSamplerType.MIN_P,
        CommonSamplerType.XTC,
        CommonSamplerType.TEMPERATURE,
    ]


@dataclass
class CommonParamsSampling:
    """Mirrors struct common_params_sampling (common.h).

    The grammar is a plain GBNF string here (user grammar type); lazy grammars,
    triggers and the reasoning budget are not part of speculative decoding.
    """

    seed: int = LLAMA_DEFAULT_SEED
    n_prev: int = 64
    n_probs: int = 0
    min_keep: int = 0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    xtc_probability: float = 0.00
    xtc_threshold: float = 0.10
    typ_p: float = 1.00
    temp: float = 0.80
    dynatemp_range: float = 0.00
    dynatemp_exponent: float = 1.00
    penalty_last_n: int = 64
    penalty_repeat: float = 1.00
    penalty_freq: float = 0.00
    penalty_present: float = 0.00
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    adaptive_target: float = -1.0
    adaptive_decay: float = 0.90
    mirostat: int = 0
    top_n_sigma: float = -1.00
    mirostat_tau: float = 5.00
    mirostat_eta: float = 0.10
    ignore_eos: bool = False
    no_perf: bool = False
    timing_per_token: bool = False
    dry_sequence_breakers: list[str] = field(default_factory=lambda: ["\n", ":", '"', "*"])
    samplers: list[CommonSamplerType] = field(default_factory=_default_samplers)
    grammar: str = ""
    logit_bias: list[tuple[int, float]] = field(default_factory=list)
    backend_sampling: bool = False

    def has_logit_bias(self) -> bool:
        return len(self.logit_bias) > 0


@dataclass
class CommonParamsSpeculativeDraft:
    """Mirrors struct common_params_speculative_draft (common.h).

    ctx_tgt / ctx_dft hold pyspec Context objects (the C++ holds raw pointers).
    Model loading fields (mparams, devices, cache types) belong to whoever
    creates the draft context, so they are not repeated here.
    """

    n_max: int = 3
    n_min: int = 0
    p_split: float = 0.1
    p_min: float = 0.0
    backend_sampling: bool = True
    ctx_tgt: Any = None
    ctx_dft: Any = None
    n_gpu_layers: int = -1


@dataclass
class CommonParamsSpeculativeNgramMod:
    """Mirrors struct common_params_speculative_ngram_mod (common.h)."""

    n_match: int = 24
    n_max: int = 64
    n_min: int = 48


@dataclass
class CommonParamsSpeculativeNgramMap:
    """Mirrors struct common_params_speculative_ngram_map (common.h)."""

    size_n: int = 12
    size_m: int = 48
    min_hits: int = 1


@dataclass
class CommonParamsSpeculativeNgramCache:
    """Mirrors struct common_params_speculative_ngram_cache (common.h)."""

    lookup_cache_static: str = ""
    lookup_cache_dynamic: str = ""


@dataclass
class CommonParamsSpeculative:
    """Mirrors struct common_params_speculative (common.h)."""

    types: list[CommonSpeculativeType] = field(default_factory=lambda: [CommonSpeculativeType.NONE])
    draft: CommonParamsSpeculativeDraft = field(default_factory=CommonParamsSpeculativeDraft)
    ngram_mod: CommonParamsSpeculativeNgramMod = field(default_factory=CommonParamsSpeculativeNgramMod)
    ngram_simple: CommonParamsSpeculativeNgramMap = field(default_factory=CommonParamsSpeculativeNgramMap)
    ngram_map_k: CommonParamsSpeculativeNgramMap = field(default_factory=CommonParamsSpeculativeNgramMap)
    ngram_map_k4v: CommonParamsSpeculativeNgramMap = field(default_factory=CommonParamsSpeculativeNgramMap)
    ngram_cache: CommonParamsSpeculativeNgramCache = field(default_factory=CommonParamsSpeculativeNgramCache)

    def need_n_rs_seq(self) -> int:
        """Mirrors common_params_speculative::need_n_rs_seq (common.h)."""
        needs_rs_seq = any(t == CommonSpeculativeType.DRAFT_MTP for t in self.types)
        return self.draft.n_max if needs_rs_seq else 0
