"""Process-wide llama.cpp set-up: backend init, logging; the devices, with their memory and type."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any

from pyspec.core import log
from pyspec.errors import LibraryNotFoundError
from pyspec.ffi import c_enum, ffi, ggml, lib_dir, llama

__all__ = ["Device", "buffer_types", "default_offload_devices", "devices", "ensure_backend", "find_device",
           "load_backends", "local_devices", "numa_init", "system_info"]

_init_lock = threading.Lock()
_initialized = False


def ensure_backend() -> None:
    """Mirrors llama_backend_init (llama.h), after loading the package's ggml backends; once per process.

    Logging is routed first: loading a backend logs.
    """
    global _initialized
    with _init_lock:
        if _initialized:
            return
        log.install()
        load_backends()
        llama.llama_backend_init()
        _initialized = True


def load_backends() -> None:
    """Register the ggml backend modules of the package's library folder (ggml_backend_load_all_from_path).

    A portable build links no backend in: the CPU backend is one module per CPU variant
    (libggml-cpu-<variant>.so), of which ggml loads the best one this CPU runs, and a GPU
    backend is one more module. Left to llama_backend_init, ggml would search the Python
    executable's folder and the working directory instead. A native build has its CPU
    backend linked in (registered already): nothing to load.
    """
    if ggml.ggml_backend_reg_count() > 0:
        return
    folder = lib_dir()
    ggml.ggml_backend_load_all_from_path(os.fsencode(folder))
    # other modules (RPC, a GPU) may load while no CPU variant does: llama.cpp needs the CPU one
    if ggml.ggml_backend_reg_by_name(b"CPU") == ffi.NULL:
        raise LibraryNotFoundError(
            f"pyspec: no ggml backend in {folder} runs on this machine (a CPU backend is libggml-cpu*.so); "
            "reinstall pyspec, or build it here with -DGGML_NATIVE=ON"
        )


_DEV_TYPES = {v: k.upper() for k, v in c_enum("enum ggml_backend_dev_type", "GGML_BACKEND_DEVICE_TYPE_").items()}


@dataclass(frozen=True)
class Device:
    """One ggml backend device: a local CPU or GPU, or a device of a connected rpc-server."""

    index: int  # position in devices(); for local devices also ggml's registry index
    name: str  # unique in the process: "CPU", "Vulkan0", "CUDA0", "RPC0", ...
    description: str
    type: str  # "CPU", "GPU", "IGPU" or "ACCEL" (an RPC device reports GPU)
    memory_free: int  # bytes
    memory_total: int
    backend: str = ""  # the backend it belongs to: "CPU", "Vulkan", "CUDA", "RPC[host:port]", ...
    endpoint: str | None = None  # the rpc-server of an RPC device
    reachable: bool = True  # False for an RPC device whose server does not answer (memory then reads 0)
    handle: Any = field(default=None, repr=False, compare=False)  # ggml_backend_dev_t


def _cstr(p: Any) -> str:
    return ffi.string(p).decode("utf-8", "replace") if p != ffi.NULL else ""


def _local_device(i: int) -> Device:
    dev = ggml.ggml_backend_dev_get(i)
    free = ffi.new("size_t *")
    total = ffi.new("size_t *")
    ggml.ggml_backend_dev_memory(dev, free, total)
    return Device(
        index=i,
        name=_cstr(ggml.ggml_backend_dev_name(dev)),
        description=_cstr(ggml.ggml_backend_dev_description(dev)),
        type=_DEV_TYPES.get(ggml.ggml_backend_dev_type(dev), "?"),
        memory_free=int(free[0]),
        memory_total=int(total[0]),
        backend=_cstr(ggml.ggml_backend_reg_name(ggml.ggml_backend_dev_backend_reg(dev))),
        handle=dev,
    )


def local_devices() -> list[Device]:
    """The devices ggml found on this machine (CPU always; GPUs when built with a GPU backend)."""
    ensure_backend()
    return [_local_device(i) for i in range(ggml.ggml_backend_dev_count())]


def devices(*, rpc_memory: bool = True) -> list[Device]:
    """The devices this process can use, with their memory and type.

    First the local ones ggml found (CPU always; GPUs when built with a GPU backend),
    then the devices of the rpc-servers connected so far (``Model(rpc_servers=...)``
    or :func:`pyspec.core.rpc.connect`). An RPC device's memory is asked of its
    server, and a server that does not answer is listed with ``reachable=False``;
    ``rpc_memory=False`` asks no server (their devices then read 0 bytes).
    """
    from pyspec.core import rpc  # rpc uses ensure_backend from here

    out = local_devices()
    for ep in rpc.connected():
        for dev in ep.devices:
            memory = rpc.device_memory(dev, ep) if rpc_memory else (0, 0)
            free, total = memory or (0, 0)
            out.append(
                Device(
                    index=len(out),
                    name=_cstr(ggml.ggml_backend_dev_name(dev)),
                    description=_cstr(ggml.ggml_backend_dev_description(dev)),
                    type=_DEV_TYPES.get(ggml.ggml_backend_dev_type(dev), "?"),
                    memory_free=free,
                    memory_total=total,
                    backend=f"RPC[{ep.endpoint}]",
                    endpoint=ep.endpoint,
                    reachable=memory is not None,
                    handle=dev,
                )
            )
    return out


def default_offload_devices() -> list[Device]:
    """The devices llama.cpp offloads layers to when a model names none.

    Mirrors the default branch of llama_prepare_model_devices (src/llama.cpp): every
    GPU (one per device id), or the first integrated GPU when there is no GPU; the CPU
    and accelerators are not offload devices. RPC devices are not in ggml's registry
    here (pyspec never registers them), so a model uses them only when it names them.
    """
    gpus: list[Device] = []
    igpus: list[Device] = []
    seen_ids: set[str] = set()
    props = ffi.new("struct ggml_backend_dev_props *")
    for d in local_devices():
        if d.type == "GPU":
            ggml.ggml_backend_dev_get_props(d.handle, props)
            dev_id = _cstr(props.device_id)
            if dev_id and dev_id in seen_ids:
                continue
            if dev_id:
                seen_ids.add(dev_id)
            gpus.append(d)
        elif d.type == "IGPU" and not igpus:
            igpus.append(d)
    return gpus or igpus


def find_device(spec: int | str | Device, among: list[Device] | None = None) -> Device:
    """The device named by an index of devices(), a name ("Vulkan0", "RPC1") or a Device; ValueError if none."""
    devs = devices() if among is None else among
    if isinstance(spec, Device):
        spec = spec.name
    if isinstance(spec, bool) or not isinstance(spec, (int, str)):
        raise TypeError(f"a device is given by index, name or Device, not {type(spec).__name__}")
    for d in devs:
        if (isinstance(spec, int) and d.index == spec) or (isinstance(spec, str) and d.name == spec):
            return d
    names = ", ".join(f"{d.index}: {d.name}" for d in devs)
    raise ValueError(f"no device {spec!r}; the devices are {names}")


def buffer_types() -> dict[str, Any]:
    """{name: ggml_backend_buffer_type_t} of each device's default buffer type ("CPU", "CUDA0", ...).

    These are the names a tensor buffer-type override may use, as llama.cpp's
    ``--override-tensor`` lists them (common/arg.cpp).
    """
    ensure_backend()
    out = {}
    for i in range(ggml.ggml_backend_dev_count()):
        buft = ggml.ggml_backend_dev_buffer_type(ggml.ggml_backend_dev_get(i))
        if buft != ffi.NULL:
            out[ffi.string(ggml.ggml_backend_buft_name(buft)).decode()] = buft
    return out


_DEV_TYPE_CPU = c_enum("enum ggml_backend_dev_type", "GGML_BACKEND_DEVICE_TYPE_")["cpu"]
_NUMA = {k: v for k, v in c_enum("enum ggml_numa_strategy", "GGML_NUMA_STRATEGY_").items() if k != "count"}


def numa_init(strategy: str = "distribute") -> None:
    """Mirrors llama_numa_init (llama.h): NUMA placement, one of "disabled", "distribute",
    "isolate", "numactl", "mirror". Call it once, before loading a model."""
    if strategy not in _NUMA:
        raise ValueError(f"strategy must be one of {sorted(_NUMA)}, not {strategy!r}")
    ensure_backend()
    if strategy != "disabled" and ggml.ggml_backend_dev_by_type(_DEV_TYPE_CPU) == ffi.NULL:
        raise RuntimeError("no CPU backend is loaded")  # llama_numa_init asserts on that
    llama.llama_numa_init(_NUMA[strategy])


def system_info() -> str:
    """Mirrors llama_print_system_info (llama.h)."""
    ensure_backend()
    return ffi.string(llama.llama_print_system_info()).decode()
