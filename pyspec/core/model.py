"""A loaded GGUF model (llama_model of llama.h)."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from pyspec.core.backend import ensure_backend, system_info
from pyspec.core.handle import Handle
from pyspec.core.vocab import Vocab
from pyspec.errors import ModelLoadError
from pyspec.ffi import c_enum, ext, ffi, ggml, llama

__all__ = ["Model"]

_SPLIT_MODES = c_enum("enum llama_split_mode", "LLAMA_SPLIT_MODE_")
# general.file_type of GGUFs whose weights are mostly float: all F32, mostly F16, mostly BF16
_FLOAT_FILE_TYPES = {"0", "1", "32"}


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


class _ErrorLines(logging.Handler):
    """Collects llama.cpp's error lines while a model loads, so the exception can say why."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def reason(self) -> str:
        # llama_model_load logs "error loading model: <what>"; the line after it is generic
        for line in self.lines:
            if "error loading model:" in line:
                return line.split("error loading model:", 1)[1].strip()
        return "; ".join(self.lines[:2])


class Model(Handle):
    """Mirrors llama_model_load_from_file / llama_model_free (llama.h).

    Closing a model that contexts still use is safe: it is freed when the
    last of them closes.
    """

    _kind = "model"

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        n_gpu_layers: int = -1,
        split_mode: str = "layer",
        main_gpu: int = 0,
        devices: Sequence[int] | None = None,
        use_mmap: bool = True,
        use_mlock: bool = False,
        vocab_only: bool = False,
        check_tensors: bool = False,
        batch_invariant: bool = False,
    ) -> None:
        """``batch_invariant`` keeps the weights in their file layout (no CPU repacking), the
        model-level half of batch-invariant mode (see :class:`pyspec.core.context.Context`)."""
        super().__init__()
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"model file not found: {self.path}")
        if split_mode not in _SPLIT_MODES:
            raise ValueError(f"split_mode must be one of {sorted(_SPLIT_MODES)}, not {split_mode!r}")
        problem = _gguf_problem(self.path)
        if problem:
            raise ModelLoadError(str(self.path), problem)
        ensure_backend()

        params = llama.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        params.split_mode = _SPLIT_MODES[split_mode]
        params.main_gpu = main_gpu
        params.use_mmap = use_mmap
        params.use_mlock = use_mlock
        params.vocab_only = vocab_only
        params.check_tensors = check_tensors
        # repacked CPU weights (llama.cpp's "extra buffer types") are multiplied by kernels that
        # change with the batch size, so a row's result would depend on its batch
        params.use_extra_bufts = not batch_invariant
        self.batch_invariant = bool(batch_invariant)
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

        errors = _ErrorLines()
        llama_log = logging.getLogger("pyspec.llama")
        llama_log.addHandler(errors)
        try:
            ptr = llama.llama_model_load_from_file(str(self.path).encode(), params)
        finally:
            llama_log.removeHandler(errors)
        if ptr == ffi.NULL:
            raise ModelLoadError(str(self.path),
                                 errors.reason() or "llama.cpp rejected the file (see the pyspec.llama log)")
        self._own(ptr, llama.llama_model_free)
        self.vocab = Vocab(self)
        if batch_invariant and self.meta("general.file_type") in _FLOAT_FILE_TYPES \
                and "LLAMAFILE = 1" in system_info():
            # llamafile's tinyBLAS multiplies float weights from two rows on, ggml's dot
            # products below that, and the two sum in different orders
            logging.getLogger("pyspec").warning(
                "batch-invariant mode: %s has float weights and this build has llamafile kernels, whose "
                "results differ in the last bits between one-row and larger batches; build with "
                "CMAKE_ARGS=-DGGML_LLAMAFILE=OFF for rows that are identical in every batch", self.path.name)

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

    def meta(self, key: str) -> str | None:
        """Mirrors llama_model_meta_val_str (llama.h); None when the key is absent."""
        buf = ffi.new("char[]", 1024)
        n = llama.llama_model_meta_val_str(self.ptr, key.encode(), buf, 1024)
        if n < 0:
            return None
        if n >= 1024:
            buf = ffi.new("char[]", n + 1)
            llama.llama_model_meta_val_str(self.ptr, key.encode(), buf, n + 1)
        return ffi.string(buf).decode("utf-8", "replace")

    def meta_dict(self) -> dict[str, str]:
        out = {}
        buf = ffi.new("char[]", 4096)
        for i in range(llama.llama_model_meta_count(self.ptr)):
            llama.llama_model_meta_key_by_index(self.ptr, i, buf, 4096)
            key = ffi.string(buf).decode("utf-8", "replace")
            llama.llama_model_meta_val_str_by_index(self.ptr, i, buf, 4096)
            out[key] = ffi.string(buf).decode("utf-8", "replace")
        return out

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
