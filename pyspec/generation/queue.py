"""The engine's queue and thread: who steps it, and the commands run between steps (tools/server/server-queue.cpp).

:class:`EngineQueue` is the part of :class:`~pyspec.generation.engine.Engine` that
llama.cpp's server_queue is: the waiting requests and commands under one lock, the
loop thread (start), the caller's own stepping (claim / step / run_until_idle /
steps) and commands run between steps (_call). The engine supplies the step, the
contexts' claim and whether there is work.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from pyspec.core.workers import release_cpu_workers
from pyspec.errors import ClosedError, ConcurrentUseError, PyspecError

if TYPE_CHECKING:
    from pyspec.generation.slots import Job

__all__ = ["Command", "EngineQueue"]

_E = TypeVar("_E", bound="EngineQueue")

logger = logging.getLogger("pyspec.engine")  # the engine's logger: one name for the loop's messages


@dataclass
class Command:
    """Work for the loop thread that must not run beside a step (slot files)."""

    fn: Callable[[], Any]
    future: Future


class EngineQueue:
    """The engine's queue and loop thread (the server's server_queue); Engine sets the state in its __init__."""

    _lock: threading.Lock
    _wake: threading.Condition
    _waiting: deque[Job]
    _commands: deque[Command]
    _closed: bool
    _stopping: bool
    _thread: threading.Thread | None
    _claims: contextlib.ExitStack | None
    _holder: int | None  # the thread whose claim() holds the contexts for its steps
    _stepping: int | None  # the thread inside a step now (the loop thread, or a caller's)
    _driven: bool

    def _claim(self) -> contextlib.ExitStack:
        raise NotImplementedError

    def _has_work(self) -> bool:
        raise NotImplementedError

    def _step(self) -> bool:
        raise NotImplementedError

    def _not_in_step(self, what: str) -> None:
        """Raise for ``what`` called from inside a step (an ``on_event`` callback): it would wait for that step's
        end (a deadlock) or run a step inside it."""
        if self._stepping == threading.get_ident():
            raise PyspecError(f"{what} cannot be called from inside a step (an on_event callback); "
                              "call it from another thread, or after the step")

    def _run_step(self) -> bool:
        self._stepping = threading.get_ident()
        try:
            return self._step()
        finally:
            self._stepping = None

    def start(self: _E) -> _E:
        """Run the loop in a thread of its own, which holds the contexts until close()."""
        self._not_in_step("start()")
        if self._closed:
            raise ClosedError("engine is closed")
        if self._thread is not None:
            return self
        self._driven = True
        # the loop thread claims the contexts itself (a claim serves the thread that holds it);
        # start() waits for that, so a context claimed elsewhere raises here
        claimed: Future = Future()
        # from here on the loop thread decodes: the CPU workers of this thread's decodes (the memory
        # probe and the calibration above, or the caller's own) would halve the loop's decode speed
        release_cpu_workers()
        thread = threading.Thread(target=self._loop, args=(claimed,), name="pyspec-engine", daemon=True)
        thread.start()
        try:
            claimed.result()
        except BaseException:
            thread.join()
            raise
        self._thread = thread
        return self

    def _check_driven(self) -> None:
        """Raise for a handle about to wait on an engine nothing steps: that wait would never end."""
        if not self._driven and not self._closed:
            raise PyspecError(
                "the engine is not running, so this request would wait forever: call engine.start() first "
                "(e.g. `with Engine(...).start() as engine:`), or step it in this thread with "
                "engine.run_until_idle() / engine.step()")

    @property
    def running(self) -> bool:
        return self._thread is not None

    def _loop(self, claimed: Future) -> None:
        try:
            self._claims = self._claim()
        except BaseException as e:
            claimed.set_exception(e)
            return
        claimed.set_result(None)
        while True:
            with self._lock:
                while not self._stopping and not self._has_work():
                    self._wake.wait()
                if self._stopping:
                    return
            try:
                self._run_step()
            except Exception:
                logger.exception("engine step failed; its requests were ended with the error")

    @contextlib.contextmanager
    def claim(self) -> Iterator[None]:
        """Hold the contexts for several steps in the caller's thread (not while start()ed).

        Another generator or engine on the same contexts, or another thread, is refused with
        ConcurrentUseError meanwhile; step() inside claims nothing more.
        """
        if self._thread is not None:
            raise PyspecError("the engine runs in its own thread (start()); claim() is for engines not started")
        if self._closed:
            raise ClosedError("engine is closed")
        me = threading.get_ident()
        if self._holder == me:
            yield
            return
        if self._holder is not None:
            raise ConcurrentUseError("the engine is being stepped by another thread (claim, step, run_until_idle "
                                     "or steps); one thread steps it at a time")
        with self._claim():
            with self._lock:
                self._driven = True
                self._holder = me
            try:
                yield
            finally:
                with self._lock:
                    self._holder = None

    def step(self) -> bool:
        """One step in the caller's thread (not while start()ed); False when there was nothing to do."""
        self._not_in_step("step()")
        if self._holder == threading.get_ident() and self._thread is None and not self._closed:
            return self._run_step()  # what claim() checks, when this thread holds it
        with self.claim():
            return self._run_step()

    def run_until_idle(self) -> None:
        """Step in the caller's thread until no request is waiting or running."""
        self._not_in_step("run_until_idle()")
        with self.claim():
            while self._run_step():
                pass

    def steps(self) -> Iterator[None]:
        """Step in the caller's thread while there is work, yielding after each step (contexts held meanwhile)."""
        self._not_in_step("steps()")
        with self.claim():
            while self._run_step():
                yield None

    def _call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` between steps: at once when not started, else on the loop thread (waiting for it)."""
        self._not_in_step("a slot command (save_slot, restore_slot, erase_slot)")
        if self._closed:
            raise ClosedError("engine is closed")
        if self._thread is None:
            with self._claim():
                return fn()
        fut: Future = Future()
        with self._lock:
            self._commands.append(Command(fn, fut))
            self._wake.notify_all()
        return fut.result()

    def _run_commands(self) -> None:
        while True:
            with self._lock:
                if not self._commands:
                    return
                cmd = self._commands.popleft()
            try:
                cmd.future.set_result(cmd.fn())
            except BaseException as e:
                cmd.future.set_exception(e)
