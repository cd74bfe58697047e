"""CPU threadpools shared by contexts (pyspec.core.threadpool, llama_attach_threadpool)."""

from __future__ import annotations

import numpy as np
import pytest

from pyspec import Batch, Context
from pyspec.core.threadpool import ThreadPool
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
