"""Model quantization: llama_model_quantize (llama.h).

    from pyspec.core.quantize import quantize
    quantize("model-f16.gguf", "model-q8_0.gguf", "q8_0")

Everything llama_model_quantize_params offers is a keyword argument, checked
before the call; llama.cpp's own refusals (a type that needs an importance
matrix, requantizing a quantized model without ``allow_requantize``, a bad
tensor pattern, ...) become :class:`~pyspec.errors.QuantizeError`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pyspec.core.backend import ensure_backend
from pyspec.core.cstrings import c_text
from pyspec.core.gguf_keys import model_files_problem
from pyspec.core.log import capture_errors
from pyspec.core.model_params import KvValue, kv_override_array
from pyspec.errors import QuantizeError
from pyspec.ffi import c_enum, ext, ffi, llama

__all__ = ["FTYPES", "TENSOR_TYPES", "quantize"]

# target file types by name ("q8_0", "q4_k_m", ...); "guessed" is a read-back value, not a target
FTYPES = {k[len("mostly_"):] if k.startswith("mostly_") else k: v
          for k, v in c_enum("enum llama_ftype", "LLAMA_FTYPE_").items() if k != "guessed"}
FTYPES["f32"] = FTYPES.pop("all_f32")
# tensor types a quantization may write (ggml_quantize_chunk handles them; the integer,
# f64 and intermediate q8_1 / q8_k types are not targets and abort inside ggml)
TENSOR_TYPES = {k: v for k, v in c_enum("enum ggml_type", "GGML_TYPE_").items()
                if k not in ("q8_1", "q8_k", "i8", "i16", "i32", "i64", "f64", "count")}


def _type(value: str, what: str) -> int:
    if value not in TENSOR_TYPES:
        raise ValueError(f"{what} must be one of {sorted(TENSOR_TYPES)}, not {value!r}")
    return TENSOR_TYPES[value]


def quantize(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    ftype: str = "q8_0",
    *,
    nthread: int = 0,
    output_tensor_type: str | None = None,
    token_embedding_type: str | None = None,
    allow_requantize: bool = False,
    quantize_output_tensor: bool = True,
    only_copy: bool = False,
    pure: bool = False,
    keep_split: bool = False,
    dry_run: bool = False,
    kv_overrides: Mapping[str, KvValue] | None = None,
    tensor_types: Sequence[tuple[str, str]] | Mapping[str, str] | None = None,
    prune_layers: Sequence[int] | None = None,
    imatrix: Mapping[str, Any] | None = None,
) -> Path:
    """Mirrors llama_model_quantize: write ``src`` quantized to ``ftype`` into ``dst``; returns ``dst``.

    ``ftype`` is a name of FTYPES ("q8_0", "q4_k_m", "f16", ...); ``nthread`` 0
    uses every core; ``output_tensor_type`` / ``token_embedding_type`` and
    ``tensor_types`` ([(regex on tensor names, type name)]) override the types
    chosen (names of TENSOR_TYPES); ``kv_overrides`` sets metadata in the output;
    ``prune_layers`` drops those layers; ``imatrix`` is {tensor name: importance
    values} (float32, the llama-imatrix output), needed by the low-bit types.
    With ``keep_split`` a split input gives split outputs named after ``dst``.
    """
    src_p, dst_p = Path(src), Path(dst)
    if not src_p.is_file():
        raise FileNotFoundError(f"model file not found: {src_p}")
    with src_p.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise QuantizeError(f"{src_p} is not a GGUF file")
    # the source goes through llama_model_loader, as a model does (pyspec/core/gguf_keys.py)
    bad, problem = model_files_problem([src_p])
    if problem:
        raise QuantizeError(f"{bad}: {problem}")
    if not dst_p.parent.is_dir():
        raise FileNotFoundError(f"folder {dst_p.parent} does not exist")
    if dst_p.exists() and dst_p.resolve() == src_p.resolve():
        raise ValueError("dst is the source file; quantize into another file")
    if ftype not in FTYPES:
        raise ValueError(f"ftype must be one of {sorted(FTYPES)}, not {ftype!r}")
    if isinstance(nthread, bool) or not isinstance(nthread, int) or nthread < 0:
        raise ValueError(f"nthread must be an int >= 0 (0 = every core), not {nthread!r}")

    params = ffi.new("llama_model_quantize_params *", llama.llama_model_quantize_default_params())
    params.nthread = nthread
    params.ftype = FTYPES[ftype]
    if output_tensor_type is not None:
        params.output_tensor_type = _type(output_tensor_type, "output_tensor_type")
    if token_embedding_type is not None:
        params.token_embedding_type = _type(token_embedding_type, "token_embedding_type")
    params.allow_requantize = bool(allow_requantize)
    params.quantize_output_tensor = bool(quantize_output_tensor)
    params.only_copy = bool(only_copy)
    params.pure = bool(pure)
    params.keep_split = bool(keep_split)
    params.dry_run = bool(dry_run)

    keep: list[Any] = []  # C memory the params point at, alive until the call returns
    if kv_overrides:
        kv = kv_override_array(kv_overrides)
        keep.append(kv)
        params.kv_overrides = kv
    if tensor_types:
        items = list(tensor_types.items()) if isinstance(tensor_types, Mapping) else list(tensor_types)
        tt = ffi.new("struct llama_model_tensor_override[]", len(items) + 1)  # zeroed: NULL pattern ends it
        for i, item in enumerate(items):
            if not (isinstance(item, tuple) and len(item) == 2):
                raise TypeError(f"tensor type override {item!r} is not a (pattern, type name) pair")
            pattern = ffi.new("char[]", c_text(item[0], "tensor type pattern"))
            keep.append(pattern)
            tt[i].pattern = pattern
            tt[i].type = _type(item[1], f"the type for {item[0]!r}")
        keep.append(tt)
        params.tt_overrides = tt
    if prune_layers:
        if imatrix:
            # llama.cpp remaps imatrix names of pruned models and aborts on a name it cannot map
            raise ValueError("prune_layers and imatrix cannot be combined")
        layers = sorted(set(prune_layers))
        if any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in layers):
            raise ValueError(f"prune_layers must be layer numbers >= 0, not {list(prune_layers)!r}")
        pl = ffi.new("int32_t[]", [*layers, -1])  # -1 ends the list
        keep.append(pl)
        params.prune_layers = pl
    if imatrix:
        entries = ffi.new("struct llama_model_imatrix_data[]", len(imatrix) + 1)  # NULL name ends it
        for i, (name, values) in enumerate(imatrix.items()):
            arr = np.ascontiguousarray(values, dtype=np.float32)
            if arr.ndim != 1 or arr.size == 0 or not np.all(np.isfinite(arr)):
                raise ValueError(f"imatrix[{name!r}] must be a non-empty finite 1-D float array")
            c_name = ffi.new("char[]", c_text(name, "imatrix tensor name"))
            keep += [c_name, arr]
            entries[i].name = c_name
            entries[i].data = ffi.from_buffer("float[]", arr)
            entries[i].size = arr.size
        keep.append(entries)
        params.imatrix = entries

    ensure_backend()
    with capture_errors() as errors:
        # llama_model_quantize, a GGML_ASSERT while reading the source failing the call
        rc = ext.pyspec_model_quantize_checked(os.fsencode(src_p), os.fsencode(dst_p), params)
    if rc != 0:
        reason = errors.reason("failed to quantize:") or "see the pyspec.llama log"
        raise QuantizeError(f"quantizing {src_p} to {ftype} failed: {reason}")
    return dst_p
