"""CPU threadpools (ggml-cpu.h) that contexts can share: ggml_threadpool_new / _free.

The threadpool functions belong to the CPU backend. A build that loads its
backends at run time (GGML_BACKEND_DL) does not link them into libggml, so they
are fetched from the CPU backend's registry (ggml_backend_reg_get_proc_address),
as llama.cpp's own tools do, and called through the declared types.

    pool = ThreadPool(4)
    ctx.attach_threadpool(pool)      # the context keeps the pool alive until detached
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Sequence
from typing import Any

from pyspec.core.backend import ensure_backend
from pyspec.core.handle import Handle
from pyspec.ffi import c_const, c_enum, ffi, ggml

__all__ = ["THREAD_PRIORITIES", "ThreadPool"]

_PRIORITIES = c_enum("enum ggml_sched_priority", "GGML_SCHED_PRIO_")
THREAD_PRIORITIES = tuple(sorted(_PRIORITIES, key=_PRIORITIES.__getitem__))  # "low" .. "realtime"
_MAX_THREADS = c_const("GGML_MAX_N_THREADS")
# proc address name -> the C function type it has (ggml-cpu.h)
_FUNCTIONS = {
    "ggml_threadpool_new": "struct ggml_threadpool *(*)(struct ggml_threadpool_params *)",
    "ggml_threadpool_free": "void(*)(struct ggml_threadpool *)",
}
_cpu_functions: dict[str, Any] = {}


def _cpu_function(name: str) -> Any:
    fn = _cpu_functions.get(name)
    if fn is None:
        ensure_backend()
        dev = ggml.ggml_backend_dev_by_type(c_const("GGML_BACKEND_DEVICE_TYPE_CPU"))
        if dev == ffi.NULL:
            raise RuntimeError("this build has no CPU backend")
        reg = ggml.ggml_backend_dev_backend_reg(dev)
        addr = ggml.ggml_backend_reg_get_proc_address(reg, name.encode())
        if addr == ffi.NULL:
            raise RuntimeError(f"the CPU backend does not export {name}")
        fn = _cpu_functions[name] = ffi.cast(_FUNCTIONS[name], addr)
    return fn


def _linked(name: str) -> Any:
    # pause / resume have no registry entry: only a build that links the CPU backend has them
    try:
        return getattr(ggml, name)
    except AttributeError:
        raise RuntimeError(f"{name} is not available: this build loads the CPU backend at run time") from None


class ThreadPool(Handle):
    """Mirrors ggml_threadpool_new / ggml_threadpool_free (ggml-cpu.h).

    ``prio`` is one of "low", "normal", "medium", "high", "realtime"; ``poll``
    0 (sleep while idle) .. 100 (spin); ``cpumask`` the CPU numbers the threads
    may run on (None: no affinity); ``paused`` starts the pool paused.
    """

    _kind = "threadpool"

    def __init__(self, n_threads: int, *, prio: str = "normal", poll: int = 50, strict_cpu: bool = False,
                 paused: bool = False, cpumask: Sequence[int] | None = None) -> None:
        super().__init__()
        if isinstance(n_threads, bool) or not isinstance(n_threads, int) or not 1 <= n_threads <= _MAX_THREADS:
            raise ValueError(f"n_threads must be an int in 1..{_MAX_THREADS}, not {n_threads!r}")
        if prio not in _PRIORITIES:
            raise ValueError(f"prio must be one of {sorted(_PRIORITIES)}, not {prio!r}")
        if isinstance(poll, bool) or not isinstance(poll, int) or not 0 <= poll <= 100:
            raise ValueError(f"poll must be an int in 0..100, not {poll!r}")
        params = ffi.new("struct ggml_threadpool_params *")
        ggml.ggml_threadpool_params_init(params, n_threads)
        params.prio = _PRIORITIES[prio]
        params.poll = poll
        params.strict_cpu = bool(strict_cpu)
        params.paused = bool(paused)
        if cpumask is not None:
            n_cpu = min(os.cpu_count() or _MAX_THREADS, _MAX_THREADS)
            for cpu in cpumask:
                if isinstance(cpu, bool) or not isinstance(cpu, int) or not 0 <= cpu < n_cpu:
                    raise ValueError(f"cpumask entry {cpu!r} is not a CPU number in 0..{n_cpu - 1}")
                params.cpumask[cpu] = True
        ptr = _cpu_function("ggml_threadpool_new")(params)
        if ptr == ffi.NULL:
            raise RuntimeError("ggml_threadpool_new failed")
        self.own(ptr, _cpu_function("ggml_threadpool_free"))
        self.n_threads = n_threads
        self._user: weakref.ref[Any] | None = None
        self._user_lock = threading.Lock()

    def user(self) -> Any:
        """The context this pool is attached to, or None."""
        return None if self._user is None else self._user()

    def set_user(self, ctx: Any) -> None:
        with self._user_lock:
            self._user = None if ctx is None else weakref.ref(ctx)

    def take(self, ctx: Any) -> None:
        """Make ``ctx`` this pool's user; ValueError when another open context is (one check-and-set,
        so two threads attaching the pool to two contexts cannot both succeed)."""
        with self._user_lock:
            user = self.user()
            if user is not None and user is not ctx and not user.closed:
                raise ValueError(f"{self!r} is attached to another context; detach it there first")
            self._user = weakref.ref(ctx)

    def pause(self) -> None:
        """Mirrors ggml_threadpool_pause: idle the threads (a decode resumes them)."""
        _linked("ggml_threadpool_pause")(self.ptr)

    def resume(self) -> None:
        """Mirrors ggml_threadpool_resume."""
        _linked("ggml_threadpool_resume")(self.ptr)

    def __repr__(self) -> str:
        return f"ThreadPool({self.n_threads}{', closed' if self.closed else ''})"
