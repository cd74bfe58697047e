"""Parameter structs of llama.cpp's common/common.h, as dataclasses.

Field names and defaults mirror the C++ structs at the pinned revision so that
the Python port and the C++ reference can be driven from one description.
"""

from __future__ import annotations

import copy
import enum
import numbers
import operator
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, TypeVar

import numpy as np

from pyspec.ffi import c_const

__all__ = [
    "LLAMA_DEFAULT_SEED", "CommonParamsSampling", "CommonParamsSpeculative", "CommonParamsSpeculativeDraft",
    "CommonParamsSpeculativeNgramCache", "CommonParamsSpeculativeNgramMap", "CommonParamsSpeculativeNgramMod",
    "CommonSamplerType", "CommonSpeculativeType", "c_bool", "c_copy", "c_float", "c_int32", "c_size_t", "c_uint16",
    "c_uint32",
]

LLAMA_DEFAULT_SEED = 0xFFFFFFFF


def _c(name: str) -> int:
    # the values come from the declarations of decl/common.h, checked against the C++ reference
    return c_const(name)


def c_int32(x: Any) -> int:
    """``x`` as an int32_t field holds it: an integer, wrapped modulo 2**32 (TypeError for a non-integer)."""
    return ((operator.index(x) + 0x80000000) & 0xFFFFFFFF) - 0x80000000


def c_uint16(x: Any) -> int:
    """``x`` as a uint16_t field holds it: an integer, wrapped modulo 2**16 (TypeError for a non-integer)."""
    return operator.index(x) & 0xFFFF


def c_uint32(x: Any) -> int:
    """``x`` as a uint32_t holds it: an integer, wrapped modulo 2**32 (TypeError for a non-integer)."""
    return operator.index(x) & 0xFFFFFFFF


def c_size_t(x: Any) -> int:
    """``x`` converted to size_t (64-bit): an integer, wrapped modulo 2**64 (a negative one becomes huge)."""
    return operator.index(x) & 0xFFFFFFFFFFFFFFFF


def c_float(x: Any) -> float:
    """``x`` as a float field holds it: rounded to float32 (TypeError for a non-number)."""
    if not isinstance(x, numbers.Real):
        raise TypeError(f"a float field needs a real number, not {type(x).__name__}")
    with np.errstate(over="ignore"):  # a double beyond float32's range becomes inf, as in C++
        return float(np.float32(x))


def c_bool(x: Any) -> bool:
    return bool(x)


def _same(x: Any) -> Any:
    return x  # pointers (the contexts) and strings: the copy refers to the same object


_S = TypeVar("_S")


def c_copy(struct: _S) -> _S:
    """A copy of a parameter dataclass as the C++ struct copy holds it: each field converted
    to its C++ type (``_c_types``: int32_t / uint16_t wrap, float rounds to float32), nested
    parameter structs copied the same way, the contexts kept as the same objects.

    The C++ implementations copy their parameters at init; the port copies them with this,
    so a caller who changes its parameter object later changes neither side, and both read
    the same values (e.g. p_min is compared as a float)."""
    out = copy.copy(struct)
    convert: dict[str, Any] = getattr(struct, "_c_types", {})
    for f in fields(struct):  # type: ignore[arg-type]
        value = getattr(struct, f.name)
        if f.name in convert:
            try:
                value = convert[f.name](value)
            except TypeError as e:
                raise TypeError(f"{type(struct).__name__}.{f.name}: {e}") from None
        elif hasattr(value, "_c_types"):
            value = c_copy(value)
        elif isinstance(value, list):
            value = list(value)
        setattr(out, f.name, value)
    return out


class CommonSpeculativeType(enum.IntEnum):
    """Mirrors enum common_speculative_type (common.h)."""

    NONE = _c("COMMON_SPECULATIVE_TYPE_NONE")
    DRAFT_SIMPLE = _c("COMMON_SPECULATIVE_TYPE_DRAFT_SIMPLE")
    DRAFT_EAGLE3 = _c("COMMON_SPECULATIVE_TYPE_DRAFT_EAGLE3")
    DRAFT_MTP = _c("COMMON_SPECULATIVE_TYPE_DRAFT_MTP")
    DRAFT_DFLASH = _c("COMMON_SPECULATIVE_TYPE_DRAFT_DFLASH")  # DFlash speculative decoding
    DRAFT_DSPARK = _c("COMMON_SPECULATIVE_TYPE_DRAFT_DSPARK")  # DSpark speculative decoding (DFlash + Markov head)
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
    penalty_last_n: int = 64  # last n tokens to penalize (0 = disable penalty)
    penalty_repeat: float = 1.00
    penalty_freq: float = 0.00
    penalty_present: float = 0.00
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = 64  # how many tokens to scan for repetitions (0 = disable penalty)
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

    _c_types: ClassVar[dict[str, Callable[[Any], Any]]] = {
        "n_max": c_int32, "n_min": c_int32, "p_split": c_float, "p_min": c_float,
        "backend_sampling": c_bool, "ctx_tgt": _same, "ctx_dft": _same, "n_gpu_layers": c_int32}


@dataclass
class CommonParamsSpeculativeNgramMod:
    """Mirrors struct common_params_speculative_ngram_mod (common.h)."""

    n_match: int = 24
    n_max: int = 64
    n_min: int = 48

    _c_types: ClassVar[dict[str, Callable[[Any], Any]]] = {"n_match": c_int32, "n_max": c_int32, "n_min": c_int32}


@dataclass
class CommonParamsSpeculativeNgramMap:
    """Mirrors struct common_params_speculative_ngram_map (common.h)."""

    size_n: int = 12
    size_m: int = 48
    min_hits: int = 1

    _c_types: ClassVar[dict[str, Callable[[Any], Any]]] = {"size_n": c_uint16, "size_m": c_uint16, "min_hits": c_uint16}


@dataclass
class CommonParamsSpeculativeNgramCache:
    """Mirrors struct common_params_speculative_ngram_cache (common.h)."""

    lookup_cache_static: str = ""
    lookup_cache_dynamic: str = ""

    _c_types: ClassVar[dict[str, Callable[[Any], Any]]] = {"lookup_cache_static": str, "lookup_cache_dynamic": str}


def _speculative_types(types: Any) -> list[CommonSpeculativeType]:
    """``types`` with each llama.cpp name ("ngram-map-k", or one string "a,b") as its enum value.

    Integers and enum values pass through unchecked (check_speculative_params judges them)."""
    if isinstance(types, str):
        types = [n.strip() for n in types.split(",") if n.strip()]
    if not any(isinstance(t, str) for t in types):
        return types
    # the one name table lives with the dispatcher it mirrors; imported here because it imports us
    from pyspec.common.speculative import common_speculative_type_from_name_map as names

    out: list[CommonSpeculativeType] = []
    for t in types:
        if isinstance(t, str):
            if t not in names:
                raise ValueError(f"unknown speculative type: {t!r} (valid names: {', '.join(names)})")
            t = names[t]
        out.append(t)
    return out


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

    # synthetic acceptance for benchmarking (common_speculative_synth_rates_resolve): a mean
    # acceptance length, or the unconditional acceptance rate of each draft position
    synth_len: float = -1.0
    synth_rates: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        # the names of the CLI's --types ("ngram-map-k") work here too, as in llama.cpp's
        # common_speculative_type_from_name; a Python-side convenience, the C++ struct holds enums
        self.types = _speculative_types(self.types)

    def has_synth(self) -> bool:
        """Mirrors common_params_speculative::has_synth (common.h)."""
        return self.synth_len != -1.0 or len(self.synth_rates) > 0

    def need_n_rs_seq(self) -> int:
        """Mirrors common_params_speculative::need_n_rs_seq (common.h): the int32_t n_max as uint32_t."""
        needs_rs_seq = any(t in (CommonSpeculativeType.DRAFT_MTP, CommonSpeculativeType.DRAFT_EAGLE3,
                                 CommonSpeculativeType.DRAFT_DFLASH, CommonSpeculativeType.DRAFT_DSPARK)
                           for t in self.types)
        return c_uint32(c_int32(self.draft.n_max)) if needs_rs_seq else 0

    def c_copy(self) -> CommonParamsSpeculative:
        """The parameters as the C++ struct holds them (see :func:`c_copy`)."""
        return c_copy(self)
