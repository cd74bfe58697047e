"""CPU threadpools shared by contexts (pyspec.core.threadpool, llama_attach_threadpool)."""

from __future__ import annotations

import logging
import os
import threading
import time

import numpy as np
import pytest

from pyspec import Batch, Context
from pyspec.core.threadpool import ThreadPool
from pyspec.core.workers import release_cpu_workers
from pyspec.errors import ClosedError
from pyspec.ffi import ggml


def _cpu_backend_linked() -> bool:
    try:
        return bool(ggml.ggml_threadpool_pause)
    except AttributeError:
        return False


def last_logits(ctx: Context, tokens: list[int]) -> np.ndarray:
    ctx.memory.clear()
    batch = Batch(len(tokens), 0, 1)
    batch.add_sequence(tokens, 0, 0)
    ctx.decode(batch)
    return ctx.get_logits_ith(-1).copy()


def test_decoding_on_an_attached_pool_gives_the_same_logits(target_model):
    tokens = target_model.vocab.tokenize("Shall I compare thee to a summer's day")
    with Context(target_model, n_ctx=64, n_batch=64, n_ubatch=64, n_seq_max=1, n_threads=2,
                 n_threads_batch=2) as ctx:
        base = last_logits(ctx, tokens)
        with ThreadPool(2, poll=0) as pool, ThreadPool(1) as batch_pool:
            ctx.attach_threadpool(pool, batch_pool)
            assert (ctx.n_threads, ctx.n_threads_batch) == (2, 1)  # the pools' sizes
            with pytest.raises(ValueError, match="overrun"):
                ctx.set_n_threads(4)  # more threads than the pool has workers: ggml would crash
            np.testing.assert_array_equal(last_logits(ctx, tokens), base)
            if _cpu_backend_linked():
                pool.pause()
                pool.resume()
            else:  # the CPU backend is a loaded module: its registry has no pause / resume
                with pytest.raises(RuntimeError, match="loads the CPU backend at run time"):
                    pool.pause()
            ctx.attach_threadpool(pool)  # replaces both
            np.testing.assert_array_equal(last_logits(ctx, tokens), base)
            ctx.detach_threadpool()
            ctx.detach_threadpool()  # twice is fine
        np.testing.assert_array_equal(last_logits(ctx, tokens), base)


def test_a_pool_closed_while_attached_lives_until_detached(target_model):
    tokens = target_model.vocab.tokenize("hello")
    with Context(target_model, n_ctx=64, n_batch=32, n_ubatch=32, n_seq_max=1, n_threads=1, n_threads_batch=1) as ctx:
        pool = ThreadPool(2)
        ctx.attach_threadpool(pool)
        pool.close()
        assert pool.closed
        assert np.isfinite(last_logits(ctx, tokens)).all()  # still running on the pool
        with pytest.raises(ClosedError):
            ctx.attach_threadpool(pool)
        ctx.detach_threadpool()  # the pool is freed here
        assert np.isfinite(last_logits(ctx, tokens)).all()


def test_a_pool_serves_one_context_at_a_time(target_model):
    with Context(target_model, n_ctx=64, n_batch=64, n_seq_max=1) as a, \
            Context(target_model, n_ctx=64, n_batch=64, n_seq_max=1) as b, ThreadPool(2) as pool:
        a.attach_threadpool(pool)
        with pytest.raises(ValueError, match="attached to another context"):
            b.attach_threadpool(pool)
        a.detach_threadpool()
        b.attach_threadpool(pool)
        b.detach_threadpool()


def test_a_refused_attach_keeps_the_pool_the_context_had(target_model):
    tokens = target_model.vocab.tokenize("hello")
    kw = dict(n_ctx=64, n_batch=64, n_seq_max=1)
    with Context(target_model, **kw) as a, Context(target_model, **kw) as b, \
            ThreadPool(1) as mine, ThreadPool(2) as theirs:
        b.attach_threadpool(theirs)
        a.attach_threadpool(mine)
        with pytest.raises(ValueError, match="attached to another context"):
            a.attach_threadpool(mine, theirs)  # the batch pool is b's: nothing changes on a
        assert mine.user() is a and theirs.user() is b and a.n_threads == 1
        a.attach_threadpool(mine)  # the same pool again: still a's
        assert mine.user() is a
        assert np.isfinite(last_logits(a, tokens)).all()
        a.detach_threadpool()
        assert mine.user() is None and theirs.user() is b


def test_bad_threadpool_arguments_are_refused(target_model):
    for kwargs in ({"n_threads": 0}, {"n_threads": 10_000}, {"n_threads": 2, "prio": "urgent"},
                   {"n_threads": 2, "poll": 101}, {"n_threads": 2, "cpumask": [-1]}, {"n_threads": 2.0}):
        with pytest.raises(ValueError):
            ThreadPool(**kwargs)
    with Context(target_model, n_ctx=64, n_batch=64, n_seq_max=1) as ctx, pytest.raises(TypeError):
        ctx.attach_threadpool(object())


def test_numa_init_checks_the_strategy():
    from pyspec.core.backend import numa_init

    numa_init("disabled")  # the one strategy that leaves the process's thread placement alone
    with pytest.raises(ValueError, match="strategy must be one of"):
        numa_init("everywhere")


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def settled_threads(quiet_s: float = 0.5, timeout_s: float = 10.0) -> int:
    """The process's thread count once it has not changed for quiet_s: threads an earlier test left
    (a server's, a worker's) may still be ending, and one that ends mid-test would read as a missing worker."""
    deadline = time.monotonic() + timeout_s
    seen, since = os_threads(), time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - since < quiet_s:
        time.sleep(0.02)
        if (now := os_threads()) != seen:
            seen, since = now, time.monotonic()
    return seen


def wait_for_threads(n: int, timeout_s: float = 10.0) -> int:
    """The process's thread count once it is n (workers leave a moment after they are let go), or the last seen."""
    deadline = time.monotonic() + timeout_s
    while (seen := os_threads()) != n and time.monotonic() < deadline:
        time.sleep(0.01)
    return seen


needs_openmp = pytest.mark.skipif(not os.path.isdir("/proc/self/task") or not release_cpu_workers(),
                                  reason="counts OpenMP workers: needs /proc and a CPU backend built with OpenMP")


@needs_openmp
def test_release_cpu_workers_lets_this_threads_openmp_pool_go(target_model):
    tokens = target_model.vocab.tokenize("Shall I compare thee to a summer's day")
    with Context(target_model, n_ctx=64, n_batch=64, n_ubatch=64, n_seq_max=1, n_threads=3,
                 n_threads_batch=3) as ctx:
        release_cpu_workers()
        base = settled_threads()
        logits = last_logits(ctx, tokens)
        assert os_threads() == base + 2  # a 3-thread team: this thread and two workers that stay
        assert release_cpu_workers()
        assert wait_for_threads(base) == base
        np.testing.assert_array_equal(last_logits(ctx, tokens), logits)  # a new pool, the same result
        assert os_threads() == base + 2
        release_cpu_workers()


@needs_openmp
def test_engine_start_releases_the_starting_threads_cpu_workers(target_model):
    # with the starter's pool alive, libgomp would manage more threads than cores and park every
    # worker at every barrier of the engine thread's decodes (about twice as slow on 2 cores)
    from pyspec.generation.engine import Engine
    from pyspec.generation.requests import Request

    ctx = Context(target_model, n_ctx=128, n_batch=64, n_ubatch=64, n_seq_max=1, n_threads=3, n_threads_batch=3)
    release_cpu_workers()
    base = settled_threads()
    with Engine(ctx, None, None, owned=[ctx]) as eng:
        assert os_threads() == base + 2  # the memory probe decoded in this thread
        eng.start()
        assert wait_for_threads(base + 1) == base + 1  # the loop thread; this thread's workers gone
        eng.submit(Request(prompt="hello", n_predict=2)).result()
        assert os_threads() == base + 3  # the loop thread's own team
    assert wait_for_threads(base) == base  # the loop thread and its workers ended with the engine


@needs_openmp
def test_decoding_from_a_second_thread_with_a_live_pool_warns_once(target_model):
    # pools in two threads, more OpenMP threads than cores: libgomp parks its workers at every barrier
    from pyspec.core import workers

    class Records(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.WARNING)
            self.messages: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.messages.append(record.getMessage())

    def warnings() -> list[str]:
        return [m for m in seen.messages if "release_cpu_workers" in m]

    def decode_in_a_thread() -> None:
        t = threading.Thread(target=last_logits, args=(ctx, tokens))
        t.start()
        t.join()

    tokens = target_model.vocab.tokenize("hello there")
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    seen = Records()
    log = logging.getLogger("pyspec")
    log.addHandler(seen)
    try:
        with Context(target_model, n_ctx=64, n_batch=64, n_ubatch=64, n_seq_max=1, n_threads=n,
                     n_threads_batch=n) as ctx:
            workers.release_cpu_workers()
            workers._warned = False
            last_logits(ctx, tokens)
            assert threading.get_ident() in workers.pools()
            assert not warnings()  # one pool: no more threads than cores
            decode_in_a_thread()
            assert len(warnings()) == 1
            decode_in_a_thread()
            assert len(warnings()) == 1  # once
            workers.release_cpu_workers()
            assert threading.get_ident() not in workers.pools()
    finally:
        log.removeHandler(seen)


def _fake_machine(monkeypatch: pytest.MonkeyPatch, cores: int, load: float) -> None:
    from pyspec.core import workers

    monkeypatch.setattr(workers, "_cores", lambda: cores)
    monkeypatch.setattr(workers.os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(workers, "_warned_oversubscribed", False)


def test_oversubscription_warns_once_with_the_free_core_count(monkeypatch, caplog):
    from pyspec.core.workers import check_oversubscription

    _fake_machine(monkeypatch, cores=8, load=5.0)  # two other jobs busy on 5 of 8 cores
    with caplog.at_level(logging.WARNING, logger="pyspec"):
        assert check_oversubscription(None) == 3  # the default: all 8 cores
        assert check_oversubscription(8) is None  # once
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "--threads 3" in warnings[0] and "8 CPU threads" in warnings[0]


def test_threads_within_the_free_cores_do_not_warn(monkeypatch, caplog):
    from pyspec.core.workers import check_oversubscription

    _fake_machine(monkeypatch, cores=8, load=5.0)
    with caplog.at_level(logging.WARNING, logger="pyspec"):
        assert check_oversubscription(3) is None
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_a_fully_loaded_machine_suggests_one_thread(monkeypatch):
    from pyspec.core.workers import check_oversubscription

    _fake_machine(monkeypatch, cores=2, load=7.5)
    assert check_oversubscription(2) == 1


def test_other_threads_openmp_pools_count_as_busy_cores(monkeypatch):
    from pyspec.core import workers

    _fake_machine(monkeypatch, cores=8, load=0.0)
    other = threading.Thread(target=time.sleep, args=(5,), daemon=True)
    other.start()
    monkeypatch.setitem(workers._pools, other.ident, 6)  # another thread decodes with 6 threads
    assert workers.free_cores() == 2
    assert workers.check_oversubscription(4) == 2


def test_engine_load_attaches_a_pool_to_the_target_as_common_init_does(target_model):
    # common_init_result attaches common_threadpools to the context it makes (llama-server, the examples)
    from pyspec.generation.engine import Engine, greedy_sampling
    from pyspec.generation.requests import Request

    with Engine.load(target_model.path, types="ngram-simple", n_parallel=2, n_ctx=256, n_threads=2,
                     sampling=greedy_sampling()).start() as eng:
        pools = eng.ctx_tgt._threadpools
        assert [p.n_threads for p in pools] == [2]
        assert eng.ctx_tgt.n_threads == eng.ctx_tgt.n_threads_batch == 2
        with_pool = eng.submit(Request(prompt="one two three one two three one", n_predict=12)).result().tokens
    assert pools[0].closed  # closed with the engine, after its context
    with Engine.load(target_model.path, types="ngram-simple", n_parallel=2, n_ctx=256, n_threads=2,
                     sampling=greedy_sampling(), cpuparams=None).start() as eng:
        assert not getattr(eng.ctx_tgt, "_threadpools", [])
        without = eng.submit(Request(prompt="one two three one two three one", n_predict=12)).result().tokens
    assert with_pool == without


def test_batch_cpu_params_that_differ_make_a_second_pool(target_model):
    from pyspec.common.common import CommonCpuParams
    from pyspec.generation.engine import Engine

    with Engine.load(target_model.path, n_ctx=256, n_threads=2, cpuparams=CommonCpuParams(poll=0),
                     cpuparams_batch=CommonCpuParams(n_threads=1)) as eng:
        one, batch = eng.ctx_tgt._threadpools
        assert (one.n_threads, batch.n_threads) == (2, 1)
        assert (eng.ctx_tgt.n_threads, eng.ctx_tgt.n_threads_batch) == (2, 1)


def test_bad_cpu_params_are_refused_where_they_are_made():
    from pyspec.common.common import CommonCpuParams

    for kw, field in ((dict(poll=101), "poll"), (dict(priority="urgent"), "priority"), (dict(n_threads=0), "n_threads"),
                      (dict(poll=True), "poll")):
        with pytest.raises(ValueError, match=field):
            CommonCpuParams(**kw)


def test_a_pool_that_cannot_be_made_leaves_llama_cpps_threads(target_model, caplog, monkeypatch):
    # common_threadpools::init logs a failed ggml_threadpool_new and goes on without a pool
    from pyspec.common import common
    from pyspec.generation.engine import Engine
    from pyspec.generation.requests import Request

    def fail(*a, **k):
        raise RuntimeError("ggml_threadpool_new failed")

    monkeypatch.setattr(common, "ThreadPool", fail)
    with caplog.at_level(logging.WARNING, logger="pyspec"), \
            Engine.load(target_model.path, n_ctx=256, n_threads=2).start() as eng:
        assert not getattr(eng.ctx_tgt, "_threadpools", [])
        assert len(eng.submit(Request(prompt="hi", n_predict=2)).result().tokens) == 2
    assert any("threadpool create failed" in r.getMessage() for r in caplog.records)
