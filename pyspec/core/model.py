"""A loaded GGUF model (llama_model of llama.h)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from pyspec.core.backend import ensure_backend
from pyspec.core.cstrings import c_text, read_str
from pyspec.core.handle import Handle
from pyspec.core.log import capture_errors
from pyspec.core.model_params import KvValue, kv_override_array, tensor_buft_override_array
from pyspec.core.vocab import Vocab
from pyspec.errors import ModelLoadError
from pyspec.ffi import c_enum, ext, ffi, ggml, llama

__all__ = ["Model", "ModelPath"]

ModelPath = str | os.PathLike[str]

_SPLIT_MODES = c_enum("enum llama_split_mode", "LLAMA_SPLIT_MODE_")
_ROPE_TYPES = {v: k for k, v in c_enum("enum llama_rope_type", "LLAMA_ROPE_TYPE_").items()}
_META_KEYS = c_enum("enum llama_model_meta_key", "LLAMA_MODEL_META_KEY_")
_RANK_POOLING = c_enum("enum llama_pooling_type", "LLAMA_POOLING_TYPE_")["rank"]


def _gguf_problem(path: Path) -> str:
    """A short reason why a file cannot be a GGUF model, or '' if its header looks fine."""
    size = path.stat().st_size
    if size == 0:
        return "the file is empty"
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        return f"not a GGUF file (magic {magic!r})"
    return ""


class Model(Handle):
    r"""Mirrors llama_model_load_from_file / llama_model_load_from_splits / llama_model_free (llama.h).

    ``path`` is one GGUF file, or the first of a split set named
    ``<prefix>-00001-of-0000N.gguf`` (llama.cpp finds the others), or a sequence
    of the split files in order whatever their names. ``kv_overrides`` replaces
    metadata values at load (``{"llama.context_length": 2048}``);
    ``tensor_buft_overrides`` places tensors whose name matches a regular
    expression in a named buffer type (``[(r"blk\.[0-3]\.", "CPU")]``, names
    from :func:`pyspec.core.backend.buffer_types`); ``use_extra_bufts=False``
    turns off the CPU's repacked weight layouts.

    Closing a model that contexts or adapters still use is safe: it is freed
    when the last of them closes.
    """

    _kind = "model"

    def __init__(
        self,
        path: ModelPath | Sequence[ModelPath],
        *,
        n_gpu_layers: int = -1,
        split_mode: str = "layer",
        main_gpu: int = 0,
        devices: Sequence[int] | None = None,
        use_mmap: bool = True,
        use_mlock: bool = False,
        vocab_only: bool = False,
        check_tensors: bool = False,
        use_extra_bufts: bool = True,
        kv_overrides: Mapping[str, KvValue] | None = None,
        tensor_buft_overrides: Sequence[tuple[str, str]] | Mapping[str, str] | None = None,
    ) -> None:
        super().__init__()
        paths = [Path(p) for p in path] if isinstance(path, (list, tuple)) else [Path(path)]  # type: ignore[arg-type]
        if not paths:
            raise ValueError("no model file given (an empty list of splits)")
        self.path = paths[0]
        self.paths = paths
        for p in paths:
            if not p.is_file():
                raise FileNotFoundError(f"model file not found: {p}")
        if split_mode not in _SPLIT_MODES:
            raise ValueError(f"split_mode must be one of {sorted(_SPLIT_MODES)}, not {split_mode!r}")
        for p in paths:
            problem = _gguf_problem(p)
            if problem:
                raise ModelLoadError(str(p), problem)
        ensure_backend()

        params = llama.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        params.split_mode = _SPLIT_MODES[split_mode]
        params.main_gpu = main_gpu
        params.use_mmap = use_mmap
        params.use_mlock = use_mlock
        params.vocab_only = vocab_only
        params.check_tensors = check_tensors
        params.use_extra_bufts = use_extra_bufts
        self._devices_arr = None
        if devices is not None:
            n_dev = ggml.ggml_backend_dev_count()
            arr = ffi.new("ggml_backend_dev_t[]", len(devices) + 1)  # NULL-terminated
            for k, idx in enumerate(devices):
                if not 0 <= idx < n_dev:
                    raise ValueError(f"device index {idx} out of range (0..{n_dev - 1})")
                arr[k] = ggml.ggml_backend_dev_get(idx)
            params.devices = arr
            self._devices_arr = arr
        # the C side reads these during the load; kept for the model's life all the same
        self._keep: list[Any] = []
        if kv_overrides:
            kv = kv_override_array(kv_overrides)
            params.kv_overrides = kv
            self._keep.append(kv)
        if tensor_buft_overrides:
            tb, patterns = tensor_buft_override_array(tensor_buft_overrides)
            params.tensor_buft_overrides = tb
            self._keep += [tb, patterns]

        with capture_errors() as errors:
            if len(paths) == 1:
                ptr = llama.llama_model_load_from_file(os.fsencode(paths[0]), params)
            else:
                c_paths = [ffi.new("char[]", os.fsencode(p)) for p in paths]
                ptr = llama.llama_model_load_from_splits(ffi.new("const char *[]", c_paths), len(c_paths), params)
        if ptr == ffi.NULL:
            reason = errors.reason("error loading model:") or "llama.cpp rejected the file (see the pyspec.llama log)"
            raise ModelLoadError(str(self.path), reason)
        self._own(ptr, llama.llama_model_free)
        self.vocab = Vocab(self)

    # --- information -------------------------------------------------------

    @property
    def n_embd(self) -> int:
        return llama.llama_model_n_embd(self.ptr)

    @property
    def n_embd_out(self) -> int:
        return llama.llama_model_n_embd_out(self.ptr)

    @property
    def n_embd_inp(self) -> int:
        return llama.llama_model_n_embd_inp(self.ptr)

    def n_embd_inp_or_embd(self) -> int:
        """Width of input embeddings a batch may carry."""
        return self.n_embd_inp or self.n_embd

    @property
    def n_layer(self) -> int:
        return llama.llama_model_n_layer(self.ptr)

    @property
    def n_head(self) -> int:
        return llama.llama_model_n_head(self.ptr)

    @property
    def n_head_kv(self) -> int:
        return llama.llama_model_n_head_kv(self.ptr)

    @property
    def n_ctx_train(self) -> int:
        return llama.llama_model_n_ctx_train(self.ptr)

    @property
    def n_params(self) -> int:
        return int(llama.llama_model_n_params(self.ptr))

    @property
    def size(self) -> int:
        return int(llama.llama_model_size(self.ptr))

    @property
    def desc(self) -> str:
        buf = ffi.new("char[]", 256)
        n = llama.llama_model_desc(self.ptr, buf, 256)
        return ffi.string(buf, max(n, 0)).decode("utf-8", "replace")

    @property
    def has_encoder(self) -> bool:
        return bool(llama.llama_model_has_encoder(self.ptr))

    @property
    def has_decoder(self) -> bool:
        return bool(llama.llama_model_has_decoder(self.ptr))

    @property
    def is_recurrent(self) -> bool:
        return bool(llama.llama_model_is_recurrent(self.ptr))

    @property
    def is_hybrid(self) -> bool:
        return bool(llama.llama_model_is_hybrid(self.ptr))

    # --- metadata (the GGUF key/values, as llama.cpp reads them) -------------

    def meta(self, key: str) -> str | None:
        """Mirrors llama_model_meta_val_str (llama.h): a scalar value as text; None when absent.

        (Arrays are not exposed by llama.cpp's metadata API.)
        """
        raw = c_text(key, "metadata key")
        return read_str(partial(llama.llama_model_meta_val_str, self.ptr, raw))

    def meta_count(self) -> int:
        """Mirrors llama_model_meta_count: the number of scalar key/value pairs."""
        return int(llama.llama_model_meta_count(self.ptr))

    def meta_dict(self) -> dict[str, str]:
        """Every scalar metadata pair {key: value as text}, in llama.cpp's order."""
        out = {}
        for i in range(self.meta_count()):
            key = read_str(partial(llama.llama_model_meta_key_by_index, self.ptr, i))
            value = read_str(partial(llama.llama_model_meta_val_str_by_index, self.ptr, i))
            if key is not None:
                out[key] = value if value is not None else ""
        return out

    @property
    def metadata(self) -> dict[str, str]:
        """The scalar metadata as {key: text} (see meta_dict)."""
        return self.meta_dict()

    def sampling_defaults(self) -> dict[str, str]:
        """The model's recommended sampling values (general.sampling.* keys it has), by name.

        Mirrors llama_model_meta_key_str over enum llama_model_meta_key.
        """
        out = {}
        for name, value in _META_KEYS.items():
            key = ffi.string(llama.llama_model_meta_key_str(value)).decode()
            text = self.meta(key)
            if text is not None:
                out[name] = text
        return out

    def chat_template(self, name: str | None = None) -> str | None:
        """Mirrors llama_model_chat_template: the model's (named) chat template source, or None."""
        raw = ffi.NULL if name is None else ffi.new("char[]", c_text(name, "template name"))
        p = llama.llama_model_chat_template(self.ptr, raw)
        return None if p == ffi.NULL else ffi.string(p).decode("utf-8", "replace")

    @property
    def n_swa(self) -> int:
        return int(llama.llama_model_n_swa(self.ptr))

    @property
    def rope_type(self) -> str:
        """Mirrors llama_model_rope_type: "none", "norm", "neox", "mrope", "imrope" or "vision"."""
        return _ROPE_TYPES.get(int(llama.llama_model_rope_type(self.ptr)), "?")

    @property
    def rope_freq_scale_train(self) -> float:
        return float(llama.llama_model_rope_freq_scale_train(self.ptr))

    @property
    def is_diffusion(self) -> bool:
        return bool(llama.llama_model_is_diffusion(self.ptr))

    @property
    def decoder_start_token(self) -> int:
        """Mirrors llama_model_decoder_start_token: the decoder's first token (encoder-decoder models), else -1."""
        return int(llama.llama_model_decoder_start_token(self.ptr))

    def classifier_labels(self) -> list[str]:
        """The labels of a classifier's outputs (llama_model_cls_label); [] for other models.

        llama_model_n_cls_out is only defined for classifier models, so it is read
        only when the model pools with RANK (the classifier head).
        """
        if self.meta(f"{self.meta('general.architecture')}.pooling_type") != str(_RANK_POOLING):
            return []
        labels = []
        for i in range(int(llama.llama_model_n_cls_out(self.ptr))):
            p = llama.llama_model_cls_label(self.ptr, i)
            labels.append("" if p == ffi.NULL else ffi.string(p).decode("utf-8", "replace"))
        return labels

    def target_layer_ids(self) -> np.ndarray:
        """Mirrors llama_model_target_layer_ids[_n] (llama-ext.h): EAGLE3 extract layers."""
        n = ext.pyspec_model_target_layer_ids_n(self.ptr)
        if n == 0:
            return np.zeros(0, dtype=np.int32)
        ids = ext.pyspec_model_target_layer_ids(self.ptr)
        return np.array(ffi.unpack(ids, n), dtype=np.int32)

    def __repr__(self) -> str:
        state = "closed" if self.closed else self.desc
        return f"Model({str(self.path)!r}, {state})"
