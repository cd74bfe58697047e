"""The CPU backend's worker threads: one OpenMP pool per thread that has computed with several.

llama.cpp's CPU backend runs a multi-threaded graph on an OpenMP team, and libgomp
keeps the team's workers as a pool of the thread that started it, for as long as that
thread lives. While libgomp manages more threads than there are cores it barely spins
at a barrier and parks each worker in the kernel instead, at every barrier of every
decode: once two threads have decoded with two threads each on two cores, every
decode runs about twice as slow (Gemma 3 270M: 24 -> 49 ms a token), whichever
thread it runs in.

:func:`release_cpu_workers` lets the calling thread's pool go (``Engine.start()``
calls it for the thread that starts the engine). The compute sites report here
(through ``fork.note_compute``), so that a process that ends up with pools in several
threads, more workers than cores, gets one warning that says what to do.
"""

from __future__ import annotations

import logging
import os
import threading

from pyspec.ffi import ext

__all__ = ["check_oversubscription", "free_cores", "pools", "release_cpu_workers"]

_log = logging.getLogger("pyspec")
_lock = threading.Lock()
_pools: dict[int, int] = {}  # thread ident -> the largest team it started (its pool's size)
_warned = False
_warned_oversubscribed = False
_openmp: bool | None = None  # whether the CPU backend runs its graphs on OpenMP teams


def _uses_openmp() -> bool:
    global _openmp
    if _openmp is None:
        from pyspec.core.backend import system_info

        _openmp = "OPENMP = 1" in system_info()
    return _openmp


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _prune() -> None:
    # under _lock: a thread that ended took its pool with it
    alive = {t.ident for t in threading.enumerate()}
    for ident in [i for i in _pools if i not in alive]:
        del _pools[ident]


def note_compute(n_threads: int) -> None:
    """This thread is about to compute with ``n_threads`` threads (an OpenMP team when > 1)."""
    if n_threads <= 1:
        return
    me = threading.get_ident()
    if _pools.get(me, 0) >= n_threads:
        return  # its pool is that large already: the common case, one dict lookup
    global _warned
    with _lock:
        _pools[me] = n_threads
        _prune()
        managed = sum(_pools.values())
        if len(_pools) < 2 or managed <= _cores() or _warned or not _uses_openmp():
            return
        _warned = True
    _log.warning(
        "pyspec: %d threads have decoded with several CPU threads each (%d OpenMP threads on %d cores); "
        "libgomp then parks its workers at every barrier and decodes run about twice as slow. Call "
        "pyspec.core.workers.release_cpu_workers() in a thread that has stopped decoding "
        "(Engine.start() does this for the thread that starts it)", len(_pools), managed, _cores())


def pools() -> dict[int, int]:
    """The threads whose OpenMP pools pyspec knows of, with their sizes (a snapshot)."""
    with _lock:
        _prune()
        return dict(_pools)


def release_cpu_workers() -> bool:
    """Let go of the CPU worker threads that the calling thread's decodes started (OpenMP builds).

    Call it in a thread that is done decoding when another thread decodes from then on.
    A later decode in this thread starts a new pool (a few tens of microseconds).
    Returns False on a build without OpenMP (nothing to release).
    """
    rc = ext.pyspec_cpu_release_workers()
    if rc < 0:
        raise RuntimeError("release_cpu_workers: called inside an OpenMP parallel region")
    with _lock:
        _pools.pop(threading.get_ident(), None)
    return rc == 1


def free_cores() -> int:
    """The cores nothing else is using now, at least 1: this process's cores less the 1-minute load
    average (other processes' runnable threads) and the OpenMP pools of this process's other threads."""
    cores = _cores()
    load = _load()
    me = threading.get_ident()
    others = sum(n for ident, n in pools().items() if ident != me)
    return max(1, min(cores, round(cores - load - others)))


def check_oversubscription(n_threads: int | None) -> int | None:
    """Warn once when ``n_threads`` (None: all cores, llama.cpp's default) exceeds the free cores.

    A decode's threads meet at a barrier after every op, so one thread that waits for a core stalls
    them all: beside two other decoding jobs, plain decoding with all cores fell to 1 tok/s where
    one thread ran at 78. Returns the suggested thread count when it warned, else None.
    The entry points (``pyspec run / serve / bench / demo``) call it before they load a model.
    """
    global _warned_oversubscribed
    n = n_threads or _cores()
    free = free_cores()
    if n <= free or _warned_oversubscribed:
        return None
    _warned_oversubscribed = True
    _log.warning(
        "pyspec: %d CPU threads but only about %d of %d cores are free (load average %.1f, other decoding "
        "threads in this process); every decode would wait for busy cores. Use --threads %d "
        "(n_threads=%d) for steadier, often much faster decoding", n, free, _cores(), _load(), free, free)
    return free


def _load() -> float:
    # the 1-minute load average: runnable threads, including other processes' (0 where there is none)
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0
