"""Jinja chat templates with a time and memory budget: the sandbox, and a pool of worker processes that render in it.

jinja2's ImmutableSandboxedEnvironment limits what a template may touch, not how long it runs or how
much it allocates: ``{% for i in range(99999) %}{% for j in range(99999) %}...`` runs for hours and
``{{ 'x' * 10**10 }}`` asks for 10 GB. A thread cannot be stopped, so a budgeted render runs in a
worker process (:class:`RenderPool`): the worker's address space is capped at what it uses idle plus
the budget's memory (RLIMIT_AS, a MemoryError inside the worker), its CPU time at the budget's time
per render (RLIMIT_CPU, a safety net should the parent be gone) and its priority lowered (nice 10: a
template that spins takes CPU time from the engine only when it is idle), and the parent kills a worker that
has not answered after the budget's wall-clock time and starts a new one. The failed render raises
:class:`pyspec.errors.ChatTemplateError` naming the budget ("template budget 2 s, 256 MiB"); the
other workers, and the process that asked, go on.

This module imports no part of pyspec at the top: the worker runs it as a script (``python -I
chat_sandbox.py``), so a worker costs a Python interpreter with jinja2 (about 25 MB, 0.1 s to start),
not the whole library.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import math
import os
import queue
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["RenderPool", "TemplateBudget", "compile_template", "default_pool"]


@dataclasses.dataclass(frozen=True)
class TemplateBudget:
    """What one render may use: wall-clock seconds, MiB of memory beyond the worker's idle size, and
    characters of output (the rendered prompt must fit a context anyway)."""

    timeout_s: float = 2.0
    memory_mib: int = 256
    max_output_chars: int = 16 << 20

    def __post_init__(self) -> None:
        if not (isinstance(self.timeout_s, (int, float)) and math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"template timeout must be a positive number of seconds, got {self.timeout_s!r}")
        if isinstance(self.memory_mib, bool) or not isinstance(self.memory_mib, int) or self.memory_mib < 16:
            raise ValueError(f"template memory budget must be an integer of at least 16 MiB, got {self.memory_mib!r}")
        if isinstance(self.max_output_chars, bool) or not isinstance(self.max_output_chars, int) \
                or self.max_output_chars < 1:
            raise ValueError(f"max_output_chars must be a positive integer, got {self.max_output_chars!r}")

    def describe(self) -> str:
        return f"{self.timeout_s:g} s, {self.memory_mib} MiB"


# --- the sandbox (also what the worker runs) -------------------------------------------------------

def _tojson(value: Any, indent: int | None = None, separators: tuple[str, str] | None = None,
            sort_keys: bool = False, ensure_ascii: bool = False) -> str:
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def compile_template(template: str, raise_exception: Callable[[str], None]) -> Any:
    """The template compiled in an ImmutableSandboxedEnvironment with transformers' names; jinja2's
    TemplateError when it does not compile. ``raise_exception`` is the template's raise_exception()."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


class _Refused(Exception):
    """raise_exception() in the worker: the template refused the messages."""


def _worker_raise(message: str) -> None:
    raise _Refused(message)


def _vm_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _worker_main(memory_mib: int, timeout_s: float, max_output: int) -> None:
    """The worker: one JSON request per line on stdin, one JSON answer per line on stdout."""
    import resource

    from jinja2 import TemplateError

    os.nice(10)  # a template that spins yields the CPU to the server it renders for

    compile_template("{{ x }}", _worker_raise).render(x=1)  # jinja2 loaded and warm before the size is taken
    vm = _vm_bytes()
    if vm is not None:
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = vm + (memory_mib << 20)
        resource.setrlimit(resource.RLIMIT_AS, (limit if hard < 0 else min(limit, hard), hard))
    out = sys.stdout
    for line in sys.stdin:
        try:
            req = json.loads(line)
            # the CPU time this render may reach: the parent kills on wall-clock time first, this stops a
            # worker whose parent is gone
            used = resource.getrusage(resource.RUSAGE_SELF).ru_utime + resource.getrusage(resource.RUSAGE_SELF).ru_stime
            _, hard_cpu = resource.getrlimit(resource.RLIMIT_CPU)
            soft_cpu = int(used + timeout_s) + 2
            resource.setrlimit(resource.RLIMIT_CPU, (soft_cpu if hard_cpu < 0 else min(soft_cpu, hard_cpu), hard_cpu))
            try:
                tpl = compile_template(req["template"], _worker_raise)
            except TemplateError as e:
                answer: dict[str, Any] = {"error": str(e), "kind": "compile"}
            else:
                text = tpl.render(**req["vars"])
                answer = ({"text": text} if len(text) <= max_output else
                          {"error": f"the rendered prompt is {len(text)} characters, more than {max_output}",
                           "kind": "output"})
        except MemoryError:
            answer = {"error": "it needed more memory than its budget", "kind": "memory"}
        except _Refused as e:
            answer = {"error": str(e), "kind": "refused"}
        except RecursionError:
            answer = {"error": "it recursed too deep", "kind": "memory"}
        except Exception as e:  # the template failed: the parent maps it to ChatTemplateError
            answer = {"error": f"{type(e).__name__}: {e}", "kind": "render"}
        try:
            data = json.dumps(answer, ensure_ascii=False)
        except MemoryError:
            data = json.dumps({"error": "its answer needed more memory than the budget", "kind": "memory"})
        out.write(data + "\n")
        out.flush()


# --- the parent side --------------------------------------------------------------------------------

class _Worker:
    """One worker process and the bytes read from it so far."""

    def __init__(self, budget: TemplateBudget) -> None:
        cmd = [sys.executable, "-I", os.path.abspath(__file__), str(budget.memory_mib), repr(float(budget.timeout_s)),
               str(budget.max_output_chars)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     close_fds=True)
        self.buf = b""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()

    def ask(self, line: bytes, deadline: float) -> dict[str, Any] | None:
        """The answer to ``line``, or None when the worker died or the deadline passed (the caller kills it)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(line)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return None
        fd = self.proc.stdout.fileno()
        chunks = [self.buf]
        while True:
            if b"\n" in chunks[-1]:
                data = b"".join(chunks)
                head, _, self.buf = data.partition(b"\n")
                return dict(json.loads(head))
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                return None
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return None  # the worker is gone (its CPU or memory limit, or killed)
            chunks.append(chunk)


class RenderPool:
    """Worker processes rendering Jinja chat templates within ``budget``, for any number of threads:
    ``size`` of them kept warm, up to ``max_size`` while renders overlap (so renders that use their
    whole budget hold up a normal one only when ``max_size`` of them run at once).

    :meth:`render` blocks the calling thread (not a process: call it from a worker thread of an event
    loop) for at most the budget's time plus the wait for a free worker (``wait_s``). Workers start on
    first use and again after one is killed; :meth:`close` stops them.
    """

    def __init__(self, budget: TemplateBudget | None = None, size: int = 2, max_size: int | None = None,
                 wait_s: float = 30.0) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"size must be a positive integer, got {size!r}")
        max_size = max(size, 4) if max_size is None else max_size
        if isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < size:
            raise ValueError(f"max_size must be an integer of at least size ({size}), got {max_size!r}")
        self.budget = budget or TemplateBudget()
        self.size, self.max_size = size, max_size
        self._n_slots = size  # workers (started or not) the pool holds: grows up to max_size
        self.wait_s = wait_s
        self._idle: queue.LifoQueue[_Worker | None] = queue.LifoQueue()
        for _ in range(size):
            self._idle.put(None)  # a slot: the worker starts when it is first needed
        self._lock = threading.Lock()
        self._all: set[_Worker] = set()
        self._closed = False
        self.n_killed = 0  # workers replaced after a budget was exceeded (for tests and reports)

    def _start(self) -> _Worker:
        w = _Worker(self.budget)
        with self._lock:
            self._all.add(w)
        return w

    def _drop(self, w: _Worker) -> None:
        w.kill()
        with self._lock:
            self._all.discard(w)

    def warm(self) -> None:
        """Start every worker now (a server calls this at start, so the first request does not wait)."""
        got = []
        for _ in range(self.size):
            w = self._idle.get()
            got.append(w if w is not None and w.alive() else self._start())
        for w in got:
            self._idle.put(w)

    def render(self, template: str, variables: dict[str, Any]) -> str:
        """The template rendered with ``variables`` (JSON values), within the budget.

        ChatTemplateError naming the template budget when the budget is exceeded (the worker is
        replaced) or no worker is free within ``wait_s``; ChatTemplateError as in-process when the
        template does not compile ("does not compile" in the message), refuses the messages or fails
        on them."""
        from pyspec.errors import ChatTemplateError

        if self._closed:
            raise ChatTemplateError("the chat template workers are stopped")
        line = (json.dumps({"template": template, "vars": variables}, ensure_ascii=False) + "\n").encode("utf-8")
        try:
            w = self._idle.get_nowait()
        except queue.Empty:
            with self._lock:  # every worker busy: one more, up to max_size
                grow = self._n_slots < self.max_size
                self._n_slots += grow
            try:
                w = None if grow else self._idle.get(timeout=self.wait_s)
            except queue.Empty:
                raise ChatTemplateError(f"every chat template worker stayed busy for {self.wait_s:g} s "
                                        f"(template budget {self.budget.describe()} each)") from None
        keep: _Worker | None = w
        try:
            if w is None or not w.alive():
                w = self._start()
            keep = w
            t0 = time.monotonic()
            answer = w.ask(line, t0 + self.budget.timeout_s)
            if answer is None:
                timed_out = w.alive()
                self._drop(w)
                self.n_killed += 1
                keep = None if self._closed else self._start()  # the new one loads while the pool is idle
                why = (f"ran longer than {self.budget.timeout_s:g} s" if timed_out else
                       "stopped (it exceeded its CPU time or memory)")
                raise ChatTemplateError(f"the chat template {why}: template budget {self.budget.describe()}")
        finally:
            self._idle.put(keep)
        if "text" in answer:
            return str(answer["text"])
        kind, msg = answer.get("kind"), str(answer.get("error"))
        if kind == "memory":
            raise ChatTemplateError(f"the chat template failed: {msg}: template budget {self.budget.describe()}")
        if kind == "output":
            raise ChatTemplateError(f"the chat template failed: {msg}")
        if kind == "compile":
            raise ChatTemplateError(f"the chat template does not compile: {msg}")
        if kind == "refused":
            raise ChatTemplateError(f"the chat template refused the messages: {msg}")
        raise ChatTemplateError(f"the chat template failed on these messages: {msg}")

    def close(self) -> None:
        """Stop every worker (a render in progress fails)."""
        self._closed = True
        with self._lock:
            workers = list(self._all)
            self._all.clear()
        for w in workers:
            w.kill()

    def __enter__(self) -> RenderPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_default_pools: dict[TemplateBudget, RenderPool] = {}
_default_lock = threading.Lock()


def default_pool(budget: TemplateBudget) -> RenderPool:
    """A process-wide pool for ``budget`` (render_chat(budget=...)); its workers end with the process."""
    with _default_lock:
        pool = _default_pools.get(budget)
        if pool is None:
            pool = _default_pools[budget] = RenderPool(budget)
            import atexit

            atexit.register(pool.close)
        return pool


if __name__ == "__main__":
    _worker_main(int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]))
