"""Process-wide llama.cpp set-up: backend init, logging, device listing."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from pyspec.core import log
from pyspec.ffi import c_enum, ffi, ggml, llama

__all__ = ["Device", "devices", "ensure_backend", "system_info"]

_init_lock = threading.Lock()
_initialized = False


def ensure_backend() -> None:
    """Mirrors llama_backend_init (llama.h); runs once per process, with logging routed."""
    global _initialized
    with _init_lock:
        if _initialized:
            return
        log.install()
        llama.llama_backend_init()
        _initialized = True


_DEV_TYPES = {v: k.upper() for k, v in c_enum("enum ggml_backend_dev_type", "GGML_BACKEND_DEVICE_TYPE_").items()}


@dataclass(frozen=True)
class Device:
    """One ggml backend device."""

    index: int
    name: str
    description: str
    type: str
    memory_free: int
    memory_total: int


def devices() -> list[Device]:
    """The ggml devices this build sees (CPU always; GPUs when built with a GPU backend)."""
    ensure_backend()
    out = []
    free = ffi.new("size_t *")
    total = ffi.new("size_t *")
    for i in range(ggml.ggml_backend_dev_count()):
        dev = ggml.ggml_backend_dev_get(i)
        ggml.ggml_backend_dev_memory(dev, free, total)
        out.append(
            Device(
                index=i,
                name=ffi.string(ggml.ggml_backend_dev_name(dev)).decode(),
                description=ffi.string(ggml.ggml_backend_dev_description(dev)).decode(),
                type=_DEV_TYPES.get(ggml.ggml_backend_dev_type(dev), "?"),
                memory_free=int(free[0]),
                memory_total=int(total[0]),
            )
        )
    return out


def system_info() -> str:
    """Mirrors llama_print_system_info (llama.h)."""
    ensure_backend()
    return ffi.string(llama.llama_print_system_info()).decode()
