"""Deterministic ownership of C handles.

Every wrapper owns one C pointer and frees it exactly once. Objects that other
objects depend on (a model under its contexts, a target context under its MTP
context) are *retained* by their dependents: close() on them marks them closed
at once, and the C free happens when the last dependent lets go, so closing in
any order is safe.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from pyspec.errors import ClosedError
from pyspec.ffi import ffi

__all__ = ["Handle"]


class Handle:
    """Owner of one C pointer; subclasses call ``_own(ptr, free)``."""

    _kind = "object"

    def __init__(self) -> None:
        self._ptr: Any = ffi.NULL
        self._free: Callable[[Any], None] | None = None
        self._closed = True
        self._users = 0
        self._deps: list[Handle] = []
        self._lock = threading.Lock()

    def _own(self, ptr: Any, free: Callable[[Any], None], deps: tuple[Handle, ...] = ()) -> None:
        self._ptr = ptr
        self._free = free
        self._closed = False
        for dep in deps:
            dep._retain()
        self._deps = list(deps)

    @property
    def ptr(self) -> Any:
        """The C pointer; raises ClosedError after close()."""
        if self._closed:
            raise ClosedError(f"{self._kind} is closed")
        return self._ptr

    def check_open(self) -> None:
        """Raise ClosedError after close()."""
        if self._closed:
            raise ClosedError(f"{self._kind} is closed")

    @property
    def closed(self) -> bool:
        return self._closed

    def _retain(self) -> None:
        with self._lock:
            if self._closed:
                raise ClosedError(f"{self._kind} is closed")
            self._users += 1

    def _release(self) -> None:
        with self._lock:
            self._users -= 1
            free_now = self._closed and self._users == 0
        if free_now:
            self._destroy()

    def _hold(self, dep: Handle) -> None:
        """Keep ``dep`` alive while this object may use it (a C pointer to it was handed over
        after creation: an attached LoRA adapter, a threadpool); released by _unhold or the free."""
        dep._retain()
        self._deps.append(dep)

    def _unhold(self, dep: Handle) -> None:
        """Undo one _hold(dep): the C side no longer points at it."""
        for i, d in enumerate(self._deps):
            if d is dep:
                del self._deps[i]
                dep._release()
                return
        raise ValueError(f"{dep._kind} is not held by this {self._kind}")

    def _destroy(self) -> None:
        ptr, free = self._ptr, self._free
        self._ptr, self._free = ffi.NULL, None
        if free is not None and ptr != ffi.NULL:
            free(ptr)
        deps, self._deps = self._deps, []
        for dep in deps:
            dep._release()

    def close(self) -> None:
        """Free the C object (deferred while dependents still use it). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            free_now = self._users == 0
        if free_now:
            self._destroy()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
