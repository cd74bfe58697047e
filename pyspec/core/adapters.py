"""LoRA adapters and control vectors (the Adapters API of llama.h).

- :class:`LoraAdapter` mirrors llama_adapter_lora_init / llama_adapter_lora_free;
  ``Context.set_lora_adapters({adapter: scale})`` applies adapters with their
  scales (llama_set_adapters_lora), ``Context.clear_lora_adapters()`` removes them.
- A control vector adds a direction to the residual stream after chosen layers:
  ``Context.set_control_vector({layer: vector})`` (llama_set_adapter_cvec), with
  :func:`load_control_vector` reading llama.cpp's control-vector GGUF files.

Lifetimes: an adapter keeps its model alive (llama.cpp frees an adapter with its
model), and a context keeps the adapters applied to it alive (it points at their
tensors until they are removed), so closing in any order is safe.
"""

from __future__ import annotations

import math
import os
import weakref
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pyspec.core.backend import ensure_backend
from pyspec.core.cstrings import c_text, read_meta, read_str
from pyspec.core.gguf_keys import gguf_problem
from pyspec.core.handle import Handle
from pyspec.core.log import capture_errors
from pyspec.core.model import Model
from pyspec.errors import AdapterError
from pyspec.ffi import c_const, ext, ffi, ggml, llama

if TYPE_CHECKING:
    from pyspec.core.context import Context

__all__ = ["LoraAdapter", "LoraScales", "applied_lora_adapters", "control_vector_data", "load_control_vector",
           "set_control_vector", "set_lora_adapters"]

LoraScales = Mapping["LoraAdapter", float] | Sequence[tuple["LoraAdapter", float]]


def _gguf_file(path: str | os.PathLike[str], what: str) -> Path:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{what} file not found: {p}")
    with p.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise AdapterError(f"{what} {p} is not a GGUF file (magic {magic!r})")
    # metadata llama.cpp (or gguf's parser) would assert on (pyspec/core/gguf_keys.py)
    problem = gguf_problem(p, "lora" if what == "LoRA adapter" else "cvec")
    if problem:
        raise AdapterError(f"{what} {p}: {problem}")
    return p


class LoraAdapter(Handle):
    """Mirrors llama_adapter_lora_init / llama_adapter_lora_free (llama.h): a LoRA for ``model``.

    The file is a llama.cpp LoRA GGUF (general.type "adapter", adapter.type
    "lora", ``<tensor>.lora_a`` / ``.lora_b`` pairs for tensors of the model).
    """

    _kind = "LoRA adapter"

    def __init__(self, model: Model, path: str | os.PathLike[str]) -> None:
        super().__init__()
        if not isinstance(model, Model):
            raise TypeError("model must be a pyspec Model")
        self.path = _gguf_file(path, "LoRA adapter")
        ensure_backend()
        with capture_errors() as errors:
            # llama_adapter_lora_init, a GGML_ASSERT while reading failing the load
            ptr = ext.pyspec_adapter_lora_init_checked(model.ptr, os.fsencode(self.path))
        if ptr == ffi.NULL:
            reason = errors.reason("failed to apply lora adapter:") or "see the pyspec.llama log"
            raise AdapterError(f"cannot load the LoRA adapter {str(self.path)!r}: {reason}")
        # the model frees its adapters: keep it until this adapter is freed
        self.own(ptr, llama.llama_adapter_lora_free, (model,))
        self.model = model

    def meta(self, key: str) -> str | None:
        """Mirrors llama_adapter_meta_val_str: a scalar metadata value as text; None when absent."""
        raw = c_text(key, "metadata key")
        return read_str(partial(llama.llama_adapter_meta_val_str, self.ptr, raw))

    def meta_dict(self) -> dict[str, str]:
        """Every scalar metadata pair of the adapter file {key: value as text}."""
        return read_meta(int(llama.llama_adapter_meta_count(self.ptr)), llama.llama_adapter_meta_key_by_index,
                         llama.llama_adapter_meta_val_str_by_index, self.ptr)

    @property
    def alora_invocation_tokens(self) -> list[int]:
        """The invocation tokens of an activated LoRA (aLoRA); [] for a plain LoRA."""
        n = int(llama.llama_adapter_get_alora_n_invocation_tokens(self.ptr))
        if n == 0:
            return []
        return list(ffi.unpack(llama.llama_adapter_get_alora_invocation_tokens(self.ptr), n))

    def __repr__(self) -> str:
        return f"LoraAdapter({str(self.path)!r}{', closed' if self.closed else ''})"


def _scales(adapters: LoraScales) -> list[tuple[LoraAdapter, float]]:
    items = list(adapters.items()) if isinstance(adapters, Mapping) else list(adapters)
    seen: set[int] = set()
    out = []
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise TypeError(f"{item!r} is not an (adapter, scale) pair")
        adapter, scale = item
        if not isinstance(adapter, LoraAdapter):
            raise TypeError(f"{adapter!r} is not a LoraAdapter")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise ValueError(f"the scale of {adapter!r} must be a finite number, not {scale!r}")
        if id(adapter) in seen:
            raise ValueError(f"{adapter!r} is listed twice")
        seen.add(id(adapter))
        out.append((adapter, float(scale)))
    return out


# context -> the adapters applied to it (the context holds them: see set_lora_adapters)
_applied: weakref.WeakKeyDictionary[Context, dict[LoraAdapter, float]] = weakref.WeakKeyDictionary()


def set_lora_adapters(ctx: Context, adapters: LoraScales) -> None:
    """Mirrors llama_set_adapters_lora: make ``adapters`` ({adapter: scale}) the context's set.

    Adapters not listed are removed; a scale of 0 is the same as not listed.
    """
    items = [(a, s) for a, s in _scales(adapters) if s != 0.0]
    for adapter, _ in items:
        _ = adapter.ptr  # raises ClosedError first
        if adapter.model is not ctx.model:
            raise AdapterError(f"{adapter!r} was loaded for another model than this context's")
    old = applied_lora_adapters(ctx)
    new = dict(items)
    added = [a for a in new if a not in old]
    held: list[LoraAdapter] = []
    try:
        for a in added:
            ctx._hold(a)
            held.append(a)
        arr = ffi.new("struct llama_adapter_lora *[]", [a.ptr for a in new]) if new else ffi.NULL
        scales = ffi.new("float[]", list(new.values())) if new else ffi.NULL
        with ctx.in_use() as ptr:
            llama.llama_set_adapters_lora(ptr, arr, len(new), scales)
    except BaseException:
        for a in held:
            ctx._unhold(a)
        raise
    for a in old:
        if a not in new:
            ctx._unhold(a)
    _applied[ctx] = new


def applied_lora_adapters(ctx: Context) -> dict[LoraAdapter, float]:
    """The adapters set_lora_adapters applied to ``ctx``, with their scales."""
    return dict(_applied.get(ctx, {}))


def control_vector_data(directions: Mapping[int, Any], n_layer: int, n_embd: int) -> np.ndarray:
    """The buffer llama_set_adapter_cvec reads: rows for layers 1..n_layer-1, zeros where none is given."""
    if not isinstance(directions, Mapping):
        raise TypeError("directions must be a mapping {layer: vector}")
    data = np.zeros((max(n_layer - 1, 0), n_embd), dtype=np.float32)
    for layer, vector in directions.items():
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
            raise TypeError(f"layer {layer!r} must be an int")
        if not 1 <= layer < n_layer:
            raise ValueError(f"layer {layer} out of range 1..{n_layer - 1} (llama.cpp never steers layer 0)")
        v = np.asarray(vector, dtype=np.float32)
        if v.shape != (n_embd,):
            raise ValueError(f"the vector for layer {layer} has shape {v.shape}, the model needs ({n_embd},)")
        if not np.all(np.isfinite(v)):
            raise ValueError(f"the vector for layer {layer} is not finite")
        data[layer - 1] = v
    return data


def set_control_vector(ctx: Context, directions: Mapping[int, Any] | None,
                       il_start: int | None = None, il_end: int | None = None) -> None:
    """Mirrors llama_set_adapter_cvec: add ``directions[layer]`` after each listed layer.

    ``il_start``..``il_end`` (inclusive) bound the layers that get a vector
    (default: the listed ones). ``None`` removes the control vector.
    """
    model = ctx.model
    n_layer, n_embd = model.n_layer, model.n_embd
    if directions is None:
        data, n, lo, hi = ffi.NULL, 0, -1, -1
    else:
        arr = control_vector_data(directions, n_layer, n_embd)
        layers = sorted(int(k) for k in directions)
        lo = layers[0] if il_start is None else int(il_start)
        hi = layers[-1] if il_end is None else int(il_end)
        if not layers and (il_start is None or il_end is None):
            lo, hi = 1, n_layer - 1
        if not (0 <= lo <= hi < n_layer):
            raise ValueError(f"layer range {lo}..{hi} is not within 0..{n_layer - 1}")
        data, n = ffi.from_buffer("float[]", arr), arr.size
    with ctx.in_use() as ptr:
        with capture_errors() as errors:
            rc = llama.llama_set_adapter_cvec(ptr, data, n, n_embd, lo, hi)
    if rc != 0:
        raise AdapterError(f"llama_set_adapter_cvec failed: {errors.reason() or 'see the pyspec.llama log'}")


def load_control_vector(path: str | os.PathLike[str], strength: float = 1.0) -> dict[int, np.ndarray]:
    """Read a llama.cpp control-vector GGUF (``direction.<layer>`` F32 vectors) as {layer: vector * strength}.

    Mirrors the checks of common_control_vector_load_one (common/common.cpp).
    """
    p = _gguf_file(path, "control vector")
    if not math.isfinite(strength):
        raise ValueError(f"strength must be finite, not {strength!r}")
    ensure_backend()
    ctx_out = ffi.new("struct ggml_context **")
    params = ffi.new("struct gguf_init_params *", {"no_alloc": False, "ctx": ctx_out})
    with capture_errors() as errors:
        gguf = ggml.gguf_init_from_file(os.fsencode(p), params[0])
    if gguf == ffi.NULL:
        raise AdapterError(f"cannot read the control vector {str(p)!r}: {errors.reason() or 'not a valid GGUF'}")
    try:
        out: dict[int, np.ndarray] = {}
        n_embd = -1
        for i in range(int(ggml.gguf_get_n_tensors(gguf))):
            name = ffi.string(ggml.gguf_get_tensor_name(gguf, i)).decode("utf-8", "replace")
            head, _, index = name.partition(".")
            if head != "direction" or not index.isdigit() or int(index) == 0:
                raise AdapterError(f"{p}: tensor {name!r} is not a direction.<layer> vector (layer >= 1)")
            t = ggml.ggml_get_tensor(ctx_out[0], name.encode())
            if t == ffi.NULL:
                raise AdapterError(f"{p}: tensor {name!r} has no data")
            if t.type != c_const("GGML_TYPE_F32") or ggml.ggml_n_dims(t) != 1:
                raise AdapterError(f"{p}: direction tensor {name!r} must be a 1-D F32 vector")
            n = int(ggml.ggml_nelements(t))
            if n_embd not in (-1, n):
                raise AdapterError(f"{p}: direction tensor {name!r} has {n} values, the others {n_embd}")
            n_embd = n
            v = np.frombuffer(ffi.buffer(t.data, 4 * n), dtype=np.float32) * np.float32(strength)
            layer = int(index)
            out[layer] = out[layer] + v if layer in out else v.copy()
        return out
    finally:
        ggml.gguf_free(gguf)
        if ctx_out[0] != ffi.NULL:
            ggml.ggml_free(ctx_out[0])
