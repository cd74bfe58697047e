"""A loaded GGUF model (llama_model of llama.h)."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from pyspec.core.backend import Device, default_offload_devices, ensure_backend, find_device, system_info
from pyspec.core.backend import devices as list_devices
from pyspec.core.handle import Handle
from pyspec.core.rpc import RpcLink, RpcServer, connect, device_memory, endpoint_of_device
from pyspec.core.vocab import Vocab
from pyspec.errors import ModelLoadError, RpcConnectionError
from pyspec.ffi import c_enum, ext, ffi, llama

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

    ``batch_invariant`` loads the weights in their file layout (no repacking): the
    model's half of batch-invariant mode, which its contexts then take (see
    :func:`pyspec.core.context.batch_invariant_params`).
    """

    _kind = "model"

    def __init__(
        self,
        path: str | os.PathLike[str],
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
        vocab_only: bool = False,
        check_tensors: bool = False,
        batch_invariant: bool = False,
    ) -> None:
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

        if isinstance(n_gpu_layers, bool) or not isinstance(n_gpu_layers, int) or n_gpu_layers < -1:
            raise ValueError(f"n_gpu_layers must be -1 (all layers) or a count >= 0, not {n_gpu_layers!r}")
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
        params.use_mmap = use_mmap
        params.use_mlock = use_mlock
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

        errors = _ErrorLines()
        llama_log = logging.getLogger("pyspec.llama")
        llama_log.addHandler(errors)
        try:
            if self.rpc is not None:
                ptr = self.rpc.load_model(str(self.path), params)
            else:
                ptr = llama.llama_model_load_from_file(str(self.path).encode(), params)
        finally:
            llama_log.removeHandler(errors)
        if ptr == ffi.NULL:
            raise ModelLoadError(str(self.path),
                                 errors.reason() or "llama.cpp rejected the file (see the pyspec.llama log)")
        self._own(ptr, self.rpc.free(llama.llama_model_free) if self.rpc is not None else llama.llama_model_free)
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
