"""A loaded GGUF model (llama_model of llama.h)."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from pyspec.core.backend import Device, default_offload_devices, ensure_backend, find_device, system_info
from pyspec.core.backend import devices as list_devices
from pyspec.core.cstrings import c_text, read_meta, read_str
from pyspec.core.ext_error import last_error
from pyspec.core.gguf_keys import model_files_problem
from pyspec.core.handle import Handle
from pyspec.core.log import capture_errors
from pyspec.core.model_params import KvValue, kv_override_array, tensor_buft_override_array
from pyspec.core.rpc import RpcLink, RpcServer, connect, device_memory, endpoint_of_device
from pyspec.core.vocab import Vocab
from pyspec.errors import ModelLoadError, RpcConnectionError
from pyspec.ffi import c_const, c_enum, ext, ffi, llama

__all__ = ["Model", "ModelPath"]

ModelPath = str | os.PathLike[str]

_SPLIT_MODES = c_enum("enum llama_split_mode", "LLAMA_SPLIT_MODE_")
# llama_model_params.load_mode by the names of common's --load-mode (common/arg.cpp)
_LOAD_MODES = {
    "auto": "LLAMA_LOAD_MODE_AUTO", "none": "LLAMA_LOAD_MODE_NONE", "mmap": "LLAMA_LOAD_MODE_MMAP",
    "mlock": "LLAMA_LOAD_MODE_MLOCK", "mmap+mlock": "LLAMA_LOAD_MODE_MMAP_MLOCK", "dio": "LLAMA_LOAD_MODE_DIRECT_IO",
}
_LAZY_MODES = {"off": "LLAMA_LAZY_MODE_OFF", "auto": "LLAMA_LAZY_MODE_AUTO", "on": "LLAMA_LAZY_MODE_ON"}


def load_mode_from_flags(use_mmap: bool, use_mlock: bool) -> str:
    """The load_mode that the previous pin's (use_mmap, use_mlock) pair meant.

    llama.cpp replaced the two flags (and use_direct_io) by llama_model_params.load_mode;
    mmap on is "auto" (mmap unless a device cannot, as mmap was dropped before), so the
    defaults (True, False) keep llama.cpp's default.
    """
    if use_mmap:
        return "mmap+mlock" if use_mlock else "auto"
    return "mlock" if use_mlock else "none"

# general.file_type of GGUFs whose weights are mostly float: all F32, mostly F16, mostly BF16
_FLOAT_FILE_TYPES = {"0", "1", "32"}
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


def _offload_devices(
    devices: Sequence[int | str | Device] | None, rpc_servers: Sequence[str | RpcServer] | None,
) -> tuple[list[Device], RpcLink | None]:
    """The devices a model offloads layers to, in order, and the link to the rpc-servers among them.

    The devices of ``rpc_servers`` come first (llama.cpp's order too: fewer network
    transfers), then ``devices``, or the local devices llama.cpp picks by default.
    """
    names = list(dict.fromkeys(connect(server).endpoint for server in rpc_servers or ()))
    # no server is asked anything here: the memory of the chosen RPC devices is filled in below
    all_devs = list_devices(rpc_memory=False) if rpc_servers or devices is not None else []
    rpc_devs = [d for name in names for d in all_devs if d.endpoint == name]
    if devices is None:
        local = default_offload_devices()
    else:
        if isinstance(devices, (str, int, Device)):
            raise TypeError("devices is a list of devices (indices, names or Device objects)")
        local = [find_device(d, all_devs) for d in devices]
        given = [d.name for d in local]
        twice = sorted({n for n in given if given.count(n) > 1})
        if twice:
            raise ValueError(f"device(s) {', '.join(twice)} given twice")
    chosen: list[Device] = []
    for d in [*rpc_devs, *local]:
        if d.type == "CPU":
            raise ValueError(f"{d.name} is the CPU: devices lists offload devices; the CPU always holds the layers "
                             "that are not offloaded (devices=[] or n_gpu_layers=0 keeps the whole model there)")
        if d.name not in {c.name for c in chosen}:  # an RPC device both in rpc_servers and devices
            chosen.append(d)
    endpoints = []
    for k, d in enumerate(chosen):
        ep = endpoint_of_device(d.handle) if d.endpoint is not None else None
        if ep is None:
            continue
        if ep not in endpoints:
            endpoints.append(ep)
        memory = device_memory(d.handle, ep)
        if memory is None:
            raise RpcConnectionError(f"the rpc-server at {ep.endpoint} does not answer", (ep.endpoint,))
        chosen[k] = dataclasses.replace(d, memory_free=memory[0], memory_total=memory[1])
    return chosen, (RpcLink(endpoints) if endpoints else None)


class Model(Handle):
    r"""Mirrors llama_model_load_from_file / llama_model_load_from_splits / llama_model_free (llama.h).

    ``path`` is one GGUF file, or the first of a split set named
    ``<prefix>-00001-of-0000N.gguf`` (llama.cpp finds the others), or a sequence
    of the split files in order whatever their names. ``kv_overrides`` replaces
    metadata values at load (``{"llama.context_length": 2048}``);
    ``tensor_buft_overrides`` places tensors whose name matches a regular
    expression in a named buffer type (``[(r"blk\.[0-3]\.", "CPU")]``, names
    from :func:`pyspec.core.backend.buffer_types`).

    Where the layers go (the fields of llama_model_params): ``n_gpu_layers``
    layers (-1: all) are offloaded to the offload devices, the rest stay on the
    CPU. The offload devices are the devices of ``rpc_servers`` ("host:port" or
    :class:`~pyspec.core.rpc.RpcServer`), then ``devices`` (indices of
    :func:`~pyspec.core.backend.devices`, names such as "Vulkan0" or "RPC1", or
    Device objects; ``[]`` for none), or by default the local GPUs llama.cpp
    picks. ``split_mode`` "layer" splits layers across them, in proportion to
    ``tensor_split`` (one share per offload device; default: their free memory);
    "none" puts everything offloaded on the offload device number ``main_gpu``;
    "row" and "tensor" split tensors (CUDA). ``use_extra_bufts=False`` turns
    off the CPU backend's weight repacking, which makes a token's logits depend
    on its batch. ``model.devices`` lists the offload devices used.

    How the file is read: ``load_mode`` (llama_model_params.load_mode, by common's
    ``--load-mode`` names: "auto", "none", "mmap", "mlock", "mmap+mlock", "dio"); when
    it is None, ``use_mmap`` / ``use_mlock`` (the fields it replaced) choose it
    (:func:`load_mode_from_flags`); ``model.load_mode`` is the mode used. ``lazy_mode``
    ("off", "auto", "on") reads the tensors the architecture marks on demand;
    ``load_mtp`` (default on) loads the NextN (MTP) layers a file has, which an MTP context needs
    (common sets it only for draft-mtp; off saves their memory).

    ``batch_invariant`` loads the weights in their file layout (no repacking): the
    model's half of batch-invariant mode, which its contexts then take (see
    :func:`pyspec.core.context.batch_invariant_params`).

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
        tensor_split: Sequence[float] | None = None,
        devices: Sequence[int | str | Device] | None = None,
        rpc_servers: Sequence[str | RpcServer] | None = None,
        use_extra_bufts: bool = True,
        use_mmap: bool = True,
        use_mlock: bool = False,
        load_mode: str | None = None,
        lazy_mode: str = "auto",
        load_mtp: bool = True,
        vocab_only: bool = False,
        check_tensors: bool = False,
        batch_invariant: bool = False,
        kv_overrides: Mapping[str, KvValue] | None = None,
        tensor_buft_overrides: Sequence[tuple[str, str]] | Mapping[str, str] | None = None,
    ) -> None:
        super().__init__()
        raw_paths: list[Any] = list(path) if isinstance(path, (list, tuple)) else [path]
        paths: list[Path] = []
        for p in raw_paths:
            if not isinstance(p, (str, os.PathLike)):
                raise TypeError(f"path must be a str or os.PathLike (or a list of them), got {type(p).__name__}")
            if "\0" in os.fsdecode(p):
                raise ValueError("model path contains a NUL character")
            paths.append(Path(p))
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
        # metadata llama.cpp would read past or assert on, in every file it will open: the
        # splits given, or those it finds itself from the first (pyspec/core/gguf_keys.py)
        bad, problem = model_files_problem(paths)
        if problem:
            raise ModelLoadError(str(bad), problem)

        if isinstance(n_gpu_layers, bool) or not isinstance(n_gpu_layers, int) or not -1 <= n_gpu_layers < 2**31:
            raise ValueError(f"n_gpu_layers must be -1 (all layers) or a count >= 0, not {n_gpu_layers!r}")
        if isinstance(main_gpu, bool) or not isinstance(main_gpu, int) or not -(2**31) <= main_gpu < 2**31:
            raise ValueError(f"main_gpu must be an int32, got {main_gpu!r}")
        offload, self.rpc = _offload_devices(devices, rpc_servers)
        self.devices: list[Device] = offload
        if split_mode == "none" and offload and not -1 <= main_gpu < len(offload):
            raise ValueError(f"main_gpu {main_gpu} out of range: {len(offload)} offload device(s) "
                             f"({', '.join(d.name for d in offload)}); -1 keeps the model on the CPU")

        params = llama.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        params.split_mode = _SPLIT_MODES[split_mode]
        # with no offload device there is nothing to choose from (llama.cpp would refuse main_gpu=0)
        params.main_gpu = main_gpu if offload or split_mode != "none" else -1
        mode = load_mode if load_mode is not None else load_mode_from_flags(bool(use_mmap), bool(use_mlock))
        if mode not in _LOAD_MODES:
            raise ValueError(f"load_mode must be one of {sorted(_LOAD_MODES)}, not {load_mode!r}")
        if lazy_mode not in _LAZY_MODES:
            raise ValueError(f"lazy_mode must be one of {sorted(_LAZY_MODES)}, not {lazy_mode!r}")
        self.load_mode = mode
        params.load_mode = c_const(_LOAD_MODES[mode])
        params.lazy_mode = c_const(_LAZY_MODES[lazy_mode])
        # common sets it only when the speculative types name draft-mtp; on by default here, as the
        # previous pin always loaded the NextN layers (an MTP context of a model without them asserts)
        self.load_mtp = bool(load_mtp)
        params.load_mtp = self.load_mtp
        params.vocab_only = vocab_only
        params.check_tensors = check_tensors
        # repacked CPU weights (llama.cpp's "extra buffer types") are multiplied by kernels that
        # change with the batch size, so a row's result would depend on its batch
        params.use_extra_bufts = use_extra_bufts and not batch_invariant
        self.batch_invariant = bool(batch_invariant)
        self._devices_arr = None
        if devices is not None or rpc_servers:
            arr = ffi.new("ggml_backend_dev_t[]", len(offload) + 1)  # NULL-terminated
            for k, d in enumerate(offload):
                arr[k] = d.handle
            params.devices = arr
            self._devices_arr = arr
        self._tensor_split = None
        if tensor_split is not None:
            shares = [float(x) for x in tensor_split]
            if len(shares) > max(len(offload), 1) or any(not math.isfinite(x) or x < 0 for x in shares):
                raise ValueError(f"tensor_split needs one share >= 0 per offload device ({len(offload)}), "
                                 f"got {list(tensor_split)}")
            # llama.cpp reads llama_max_devices() entries
            arr_split = ffi.new("float[]", max(int(llama.llama_max_devices()), len(shares)))
            arr_split[0:len(shares)] = shares
            params.tensor_split = arr_split
            self._tensor_split = arr_split

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
            if self.rpc is not None:
                if len(paths) > 1:
                    raise ValueError("a model split into several files loads only locally, not with rpc_servers")
                ptr = self.rpc.load_model(str(self.path), params)
            else:  # llama_model_load_from_file / _from_splits, a GGML_ASSERT while reading failing the load
                c_paths = [ffi.new("char[]", os.fsencode(p)) for p in paths]
                ptr = ext.pyspec_model_load_checked(ffi.new("const char *[]", c_paths), len(c_paths), params)
        if ptr == ffi.NULL:
            reason = errors.reason("error loading model:") or "llama.cpp rejected the file (see the pyspec.llama log)"
            raise ModelLoadError(str(self.path), reason)
        self.own(ptr, self.rpc.free(llama.llama_model_free) if self.rpc is not None else llama.llama_model_free)
        self.vocab_only = bool(vocab_only)
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
        return read_meta(self.meta_count(), llama.llama_model_meta_key_by_index,
                         llama.llama_model_meta_val_str_by_index, self.ptr)

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

    def dflash_selector_top_k(self) -> int:
        """Mirrors llama_model_dflash_selector_top_k (llama-ext.h)."""
        return int(ext.pyspec_model_dflash_selector_top_k(self.ptr))

    def get_tok_embd(self) -> np.ndarray:
        """Mirrors llama_model_get_tok_embd (llama-ext.h): the token embedding matrix in float32,
        shape (n_vocab, n_embd); a matrix it cannot read raises ValueError (it would abort)."""
        ptr = self.ptr
        n = int(ext.pyspec_model_get_tok_embd(ptr, ffi.NULL))
        if n == 0:
            raise ValueError(last_error() or "this model has no token embedding matrix")
        out = np.empty(n, dtype=np.float32)
        if int(ext.pyspec_model_get_tok_embd(ptr, ffi.cast("float *", ffi.from_buffer(out)))) != n:
            raise ValueError(last_error() or "llama_model_get_tok_embd failed")
        return out.reshape(-1, self.n_embd)

    def __repr__(self) -> str:
        state = "closed" if self.closed else self.desc
        return f"Model({str(self.path)!r}, {state})"
