"""What survives fork(): contexts keep working in a forked child, single-threaded.

ggml's CPU backend runs multi-threaded graphs in an OpenMP team (libgomp). After
fork() the child has one thread but libgomp believes its team still exists, and
the first multi-threaded computation in the child waits forever for workers that
were never copied (checked: a decode hangs, on old and new contexts alike).
A single-threaded computation does not enter OpenMP at all and works.

So once this process has computed with more than one thread, a forked child runs
every context with one thread: the contexts it inherited are switched to one
thread on their first use, new contexts are created with one thread, and
``set_n_threads`` clamps; pyspec logs one warning saying so. A context that
another thread of the parent was using at the moment of the fork holds a
half-done computation; the child refuses it (ConcurrentUseError).
"""

from __future__ import annotations

import logging
import os
import threading

from pyspec.core import workers

__all__ = ["child_generation", "in_single_thread_child", "note_compute"]

_log = logging.getLogger("pyspec")

_multi_threaded = False  # this process (or a parent it was forked from) entered an OpenMP team
_single_thread_child = False  # we are a forked child of such a process
_generation = 0  # incremented in every forked child
_warned = False
_warn_lock = threading.Lock()


def note_compute(n_threads: int) -> None:
    """Record that llama.cpp is about to compute with ``n_threads`` threads in this thread
    (every compute site calls this; the worker-pool tracker hears it too)."""
    global _multi_threaded
    if n_threads > 1:
        _multi_threaded = True
        workers.note_compute(n_threads)


def in_single_thread_child() -> bool:
    """Whether this is a forked child whose contexts must compute with one thread."""
    if _single_thread_child:
        _warn_once()
    return _single_thread_child


def child_generation() -> int:
    """A number that changes in every forked child (objects compare it with the one they were made in)."""
    return _generation


def _warn_once() -> None:
    global _warned
    with _warn_lock:
        if _warned:
            return
        _warned = True
    _log.warning(
        "pyspec: this process was forked after llama.cpp computed with several threads; "
        "ggml's OpenMP thread pool does not survive fork(), so contexts here compute with one thread. "
        "Use the 'spawn' or 'forkserver' start method of multiprocessing for full speed."
    )


def _after_fork_in_child() -> None:
    global _single_thread_child, _generation, _warned, _warn_lock
    _generation += 1
    _warn_lock = threading.Lock()
    _warned = False
    if _multi_threaded:
        _single_thread_child = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
