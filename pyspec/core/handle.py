"""Deterministic ownership of C handles.

Every wrapper owns one C pointer and frees it exactly once. Objects that other
objects depend on (a model under its contexts, a target context under its MTP
context, a sampler chain attached to a context) are *retained* by their
dependents: close() on them marks them closed at once, and the C free happens
when the last dependent lets go, so closing in any order is safe.

A handle-owning object cannot be copied or pickled: a shallow copy would free
the same pointer twice, and a C pointer means nothing in another process.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, TypeVar, cast

from pyspec.errors import ClosedError, ConcurrentUseError
from pyspec.ffi import ffi

__all__ = ["Handle", "NotCopyable", "serialized"]

F = TypeVar("F", bound=Callable[..., Any])


def serialized(method: F) -> F:
    """Run a Handle method inside ``self.in_use()``: one thread at a time on the C object."""

    @functools.wraps(method)
    def wrapper(self: Handle, *args: Any, **kwargs: Any) -> Any:
        with self.in_use():
            return method(self, *args, **kwargs)

    return cast(F, wrapper)


class NotCopyable:
    """Refuses copy.copy, copy.deepcopy and pickle with a TypeError that says why."""

    def _refuse_copy(self) -> NoReturn:
        name = type(self).__name__
        raise TypeError(
            f"{name} owns C memory and cannot be copied or pickled (a copy would free it twice; "
            f"a pointer means nothing in another process): create a new {name} instead"
        )

    def __copy__(self) -> NoReturn:
        self._refuse_copy()

    def __deepcopy__(self, memo: Any) -> NoReturn:
        self._refuse_copy()

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        self._refuse_copy()


class Handle(NotCopyable):
    """Owner of one C pointer; subclasses call ``own(ptr, free)``."""

    _kind = "object"

    def __init__(self) -> None:
        self._ptr: Any = ffi.NULL
        self._free: Callable[[Any], None] | None = None
        self._closed = True
        self._users = 0
        self._deps: list[Handle] = []
        self._lock = threading.Lock()
        # held by the one thread inside a C call on this object (see in_use); re-entrant for that thread
        self._calls = threading.RLock()

    def own(self, ptr: Any, free: Callable[[Any], None], deps: tuple[Handle, ...] = ()) -> None:
        taken: list[Handle] = []
        try:
            for dep in deps:
                dep.retain()
                taken.append(dep)
        except BaseException:
            free(ptr)
            for dep in taken:
                dep.release()
            raise
        self._ptr = ptr
        self._free = free
        self._closed = False
        self._deps = taken

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

    def in_use(self) -> contextlib.AbstractContextManager[Any]:
        """The public guard: hold this object for one C call, ``with h.in_use() as ptr: ...``.

        A second thread is refused (ConcurrentUseError), not interleaved (C objects such as sampler
        chains keep state no two threads may change at once); a closed object raises ClosedError.
        Subclasses with a richer guard (Context) override it and keep this contract."""
        return self._calls_guard()

    @contextlib.contextmanager
    def _calls_guard(self) -> Iterator[Any]:
        if not self._calls.acquire(blocking=False):
            raise ConcurrentUseError(f"this {self._kind} is in use by another thread")
        try:
            yield self.ptr
        finally:
            self._calls.release()

    @property
    def closed(self) -> bool:
        return self._closed

    def retain(self) -> None:
        """Keep this handle's C object alive for a dependent (a sampler over a model); pair with release()."""
        with self._lock:
            if self._closed:
                raise ClosedError(f"{self._kind} is closed")
            self._users += 1

    def release(self) -> None:
        """A dependent lets go; the C free happens here once the handle is closed and unused."""
        with self._lock:
            self._users -= 1
            free_now = self._closed and self._users == 0
        if free_now:
            self._destroy()

    def _hold(self, dep: Handle) -> None:
        """Keep ``dep`` alive while this object may use it (a C pointer to it was handed over
        after creation: an attached LoRA adapter, a threadpool); released by _unhold or the free."""
        dep.retain()
        self._deps.append(dep)

    def _unhold(self, dep: Handle) -> None:
        """Undo one _hold(dep): the C side no longer points at it."""
        for i, d in enumerate(self._deps):
            if d is dep:
                del self._deps[i]
                dep.release()
                return
        raise ValueError(f"{dep._kind} is not held by this {self._kind}")

    def _destroy(self) -> None:
        ptr, free = self._ptr, self._free
        self._ptr, self._free = ffi.NULL, None
        if free is not None and ptr != ffi.NULL:
            free(ptr)
        deps, self._deps = self._deps, []
        for dep in deps:
            dep.release()

    def close(self) -> None:
        """Free the C object (deferred while dependents still use it). Idempotent; refused mid-call."""
        if not self._calls.acquire(blocking=False):
            raise ConcurrentUseError(f"cannot close this {self._kind} while another thread is using it")
        try:
            with self._lock:
                if self._closed:
                    return
                self._closed = True
                free_now = self._users == 0
        finally:
            self._calls.release()
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
