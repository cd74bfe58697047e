"""The override lists of llama_model_params (llama.h), built and checked from Python values.

- ``kv_override_array``: struct llama_model_kv_override[], metadata values that
  replace the file's at load (and that llama_model_quantize writes into its output);
- ``tensor_buft_override_array``: struct llama_model_tensor_buft_override[],
  which tensors (a regular expression on the name) go to which buffer type.

Both lists are terminated the way llama.cpp reads them (an empty key, a NULL
pattern); the caller keeps the returned objects alive for as long as the C
side may read them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from pyspec.core.backend import buffer_types
from pyspec.core.cstrings import c_text
from pyspec.ffi import c_const, ffi

__all__ = ["KvValue", "kv_override_array", "tensor_buft_override_array"]

KvValue = bool | int | float | str

# char key[...] and char val_str[...] of struct llama_model_kv_override, read from the declaration
_KV_FIELDS = dict(ffi.typeof("struct llama_model_kv_override").fields)
_KEY_MAX = _KV_FIELDS["key"].type.length - 1
_STR_MAX = _KV_FIELDS["val_str"].type.length - 1


def kv_override_array(overrides: Mapping[str, KvValue]) -> Any:
    """A NULL-terminated struct llama_model_kv_override[] for ``{key: value}``.

    The value's Python type picks the override type: bool, int (int64), float
    (double) or str (at most 127 bytes); llama.cpp refuses the load when it
    does not match the type the model reads the key as.
    """
    if not isinstance(overrides, Mapping):
        raise TypeError("kv_overrides must be a mapping {key: bool | int | float | str}")
    arr = ffi.new("struct llama_model_kv_override[]", len(overrides) + 1)  # zeroed: the last key is ""
    for i, (key, value) in enumerate(overrides.items()):
        item = arr[i]
        raw_key = c_text(key, "kv override key", _KEY_MAX)
        if not raw_key:
            raise ValueError("kv override key is empty")
        item.key = raw_key
        if isinstance(value, bool):
            item.tag = c_const("LLAMA_KV_OVERRIDE_TYPE_BOOL")
            item.val_bool = value
        elif isinstance(value, int):
            if not -(2**63) <= value < 2**63:
                raise ValueError(f"kv override {key!r}: {value} does not fit in int64")
            item.tag = c_const("LLAMA_KV_OVERRIDE_TYPE_INT")
            item.val_i64 = value
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise ValueError(f"kv override {key!r}: {value} is not finite")
            item.tag = c_const("LLAMA_KV_OVERRIDE_TYPE_FLOAT")
            item.val_f64 = value
        elif isinstance(value, str):
            item.tag = c_const("LLAMA_KV_OVERRIDE_TYPE_STR")
            item.val_str = c_text(value, f"kv override {key!r} value", _STR_MAX)
        else:
            raise TypeError(f"kv override {key!r}: a bool, int, float or str, not {type(value).__name__}")
    return arr


def tensor_buft_override_array(overrides: Sequence[tuple[str, str]] | Mapping[str, str]) -> tuple[Any, list[Any]]:
    """A NULL-terminated struct llama_model_tensor_buft_override[] for ``[(pattern, buffer type name)]``.

    ``pattern`` is a regular expression (ECMAScript, std::regex) searched in each
    tensor name; the first matching entry wins. Buffer type names are those of
    :func:`pyspec.core.backend.buffer_types` ("CPU", "CUDA0", ...). Returns the
    array and the pattern strings it points to (keep both alive during the load).
    """
    items = list(overrides.items()) if isinstance(overrides, Mapping) else list(overrides)
    available = buffer_types()
    arr = ffi.new("struct llama_model_tensor_buft_override[]", len(items) + 1)  # zeroed: the last pattern is NULL
    keep = []
    for i, item in enumerate(items):
        if not (isinstance(item, tuple) and len(item) == 2):
            raise TypeError(f"tensor buffer override {item!r} is not a (pattern, buffer type name) pair")
        pattern, name = item
        raw = c_text(pattern, "tensor override pattern")
        if not raw:
            raise ValueError("tensor override pattern is empty")
        if name not in available:
            raise ValueError(f"unknown buffer type {name!r}; this build has {', '.join(sorted(available))}")
        text = ffi.new("char[]", raw)
        keep.append(text)
        arr[i].pattern = text
        arr[i].buft = available[name]
    return arr, keep
