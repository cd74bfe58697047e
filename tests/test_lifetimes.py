"""Interrupts, close orders and threads: objects stay usable, nothing crashes, output stays right."""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest

import pyspec
from pyspec import Batch, ClosedError, ConcurrentUseError, Context, Model
from pyspec.common.params import CommonParamsSpeculative
from pyspec.common.params import CommonSpeculativeType as T
from pyspec.generation.contexts import ModelSet, open_contexts
from pyspec.generation.driver import SpeculativeGenerator, greedy_sampling
from pyspec.testing import models as tm

PROMPT = "def fib(n):\n    return fib(n - 1) + fib(n - 2)\n"
N_PREDICT = 24


@pytest.fixture(scope="module")
def models():
    ms = {"target": Model(tm.make_target()), "draft": Model(tm.make_draft()),
          "eagle3": Model(tm.make_eagle3()), "mtp": Model(tm.make_mtp())}
    yield ms
    for m in ms.values():
        m.close()


def make(models, t: T, engine: str = "python"):
    """(generator, target context, draft context or None) for one speculative type."""
    p = CommonParamsSpeculative(types=[t])
    p.draft.n_max = 4
    p.ngram_mod.n_match, p.ngram_mod.n_min, p.ngram_mod.n_max = 2, 1, 6
    # the library's builder on the test's own models (which it closes itself, in any order)
    ms = ModelSet(models["mtp"]) if t == T.DRAFT_MTP else \
        ModelSet(models["target"], {T.DRAFT_EAGLE3: models["eagle3"], T.DRAFT_SIMPLE: models["draft"]}.get(t))
    cs = open_contexts(ms, p, n_ctx=256, n_batch=64, n_ubatch=32, n_threads=1)
    return SpeculativeGenerator(cs.ctx_tgt, p, greedy_sampling(), backend=engine), cs.ctx_tgt, cs.ctx_dft


def close_all(*objs):
    for o in objs:
        if o is not None:
            o.close()


@pytest.fixture(scope="module")
def fresh_tokens(models):
    """What a fresh generator produces for PROMPT, per type."""
    out = {}
    for t in (T.DRAFT_SIMPLE, T.DRAFT_EAGLE3, T.DRAFT_MTP, T.NGRAM_MOD):
        g, ctx, ctxd = make(models, t)
        out[t] = g.generate([PROMPT], N_PREDICT)[0].tokens
        close_all(g, ctxd, ctx)
    return out


# --- interrupts ---------------------------------------------------------------


class Stop(Exception):
    pass


@pytest.mark.parametrize("exc", [KeyboardInterrupt, Stop])
@pytest.mark.parametrize(
    ("t", "engine"),
    [(T.DRAFT_SIMPLE, "python"), (T.DRAFT_EAGLE3, "python"), (T.DRAFT_MTP, "python"), (T.NGRAM_MOD, "python"),
     (T.DRAFT_SIMPLE, "cpp"), (T.DRAFT_EAGLE3, "cpp")],
    ids=lambda v: getattr(v, "name", v),
)
def test_exception_in_on_piece_leaves_the_generator_usable(models, fresh_tokens, t, engine, exc):
    g, ctx, ctxd = make(models, t, engine)
    seen = []

    def on_piece(_seq, text):
        seen.append(text)
        if len(seen) == 7:  # mid-generation, after some speculative steps
            raise exc("stop here")

    with pytest.raises(exc):
        g.generate([PROMPT], N_PREDICT, on_piece=on_piece)
    # the same objects, the next generation: equal to a fresh generator's
    again = g.generate([PROMPT], N_PREDICT)[0].tokens
    assert again == fresh_tokens[t]
    close_all(g, ctxd, ctx)


@pytest.mark.parametrize("t", [T.DRAFT_SIMPLE, T.DRAFT_EAGLE3], ids=lambda v: v.name)
def test_abandoned_stream_leaves_the_generator_usable(models, fresh_tokens, t):
    g, ctx, ctxd = make(models, t)
    stream = g.stream(PROMPT, N_PREDICT)
    for _ in range(3):
        next(stream)
    stream.close()  # GeneratorExit inside the loop
    assert g.generate([PROMPT], N_PREDICT)[0].tokens == fresh_tokens[t]
    close_all(g, ctxd, ctx)


# --- close orders -----------------------------------------------------------


def _use(obj) -> None:
    """Something that needs the C object alive."""
    if isinstance(obj, Model):
        obj.n_embd  # noqa: B018
    elif isinstance(obj, Context):
        obj.memory.seq_pos_max(0)
    else:
        obj.generate([PROMPT], 4)


ORDERS = list(itertools.permutations(range(5)))[::11]  # 11 of the 120 orders, first and last included


@pytest.mark.parametrize("t", [T.DRAFT_SIMPLE, T.DRAFT_EAGLE3, T.DRAFT_MTP], ids=lambda v: v.name)
def test_closing_in_any_order_is_safe(t):
    for order in [*ORDERS, (4, 3, 2, 1, 0)]:
        m_tgt = Model(tm.make_mtp() if t == T.DRAFT_MTP else tm.make_target())
        m_dft = m_tgt if t == T.DRAFT_MTP else Model(tm.make_eagle3() if t == T.DRAFT_EAGLE3 else tm.make_draft())
        g, ctx, ctxd = make({"target": m_tgt, "draft": m_dft, "eagle3": m_dft, "mtp": m_tgt}, t)
        objs = [g, ctxd, ctx, m_dft, m_tgt]
        closed = set()
        for k in order:
            objs[k].close()
            closed.add(id(objs[k]))
            for o in objs:
                if id(o) in closed and not isinstance(o, SpeculativeGenerator):
                    with pytest.raises(ClosedError):
                        _use(o)
                else:
                    try:
                        _use(o)  # may work or refuse, never crash
                    except pyspec.PyspecError:
                        pass
            objs[k].close()  # idempotent
        for o in (ctx, ctxd, m_tgt, m_dft):
            assert o._ptr == pyspec.ffi.ffi.NULL and o._users == 0  # everything freed at the end


# --- threads ------------------------------------------------------------------


def test_threads_with_their_own_contexts_match_single_threaded_output(models, fresh_tokens):
    n_threads = 3
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            g, ctx, ctxd = make(models, T.DRAFT_SIMPLE)
            for _ in range(2):
                results.setdefault(i, []).append(g.generate([PROMPT], N_PREDICT)[0].tokens)
            close_all(g, ctxd, ctx)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert all(runs == [fresh_tokens[T.DRAFT_SIMPLE]] * 2 for runs in results.values()) and len(results) == n_threads


def test_two_threads_decoding_on_one_context_are_refused_not_interleaved(models):
    ctx = Context(models["target"], n_ctx=512, n_batch=128, n_seq_max=2, n_threads=1, n_threads_batch=1)
    big = Batch(128)
    big.add_sequence(np.arange(1000, 1128, dtype=np.int32), 0, 0)
    ctx.decode(big)
    expected = ctx.get_logits_ith(-1).copy()
    refused = []
    stop = threading.Event()

    def intruder() -> None:
        small = Batch(1)
        small.add(5, 0, 1, True)
        while not stop.is_set():
            try:
                ctx.decode(small)
                ctx.memory.seq_rm(1, -1, -1)
            except ConcurrentUseError as e:
                refused.append(str(e))

    th = threading.Thread(target=intruder)
    th.start()
    try:
        for _ in range(30):
            ctx.memory.seq_rm(0, -1, -1)
            ctx.decode(big)  # may itself be refused while the intruder decodes
            np.testing.assert_array_equal(ctx.get_logits_ith(-1), expected)
    except ConcurrentUseError as e:
        refused.append(str(e))
    finally:
        stop.set()
        th.join()
    assert refused and "another thread" in refused[0]
    ctx.close()


def test_threads_attaching_one_chain_to_their_contexts_at_once_attach_it_once(models):
    # llama.cpp sets a backend chain up for one context: the check and the mark are one step
    from pyspec import SamplerChain

    n = 6
    ctxs = [Context(models["target"], n_ctx=64, n_batch=32, n_threads=1, n_threads_batch=1) for _ in range(n)]
    try:
        for _ in range(5):
            chain = SamplerChain().add_greedy()
            barrier = threading.Barrier(n)
            outcomes: list[str] = []

            def attach(c: Context, chain: SamplerChain = chain, barrier: threading.Barrier = barrier,
                       outcomes: list[str] = outcomes) -> None:
                barrier.wait()
                try:
                    outcomes.append("attached" if c.set_sampler(0, chain) else "not offloaded")
                except ValueError as e:
                    outcomes.append("refused" if "attached" in str(e) else repr(e))

            ths = [threading.Thread(target=attach, args=(c,)) for c in ctxs]
            for th in ths:
                th.start()
            for th in ths:
                th.join()
            assert sorted(outcomes) == ["attached"] + ["refused"] * (n - 1), outcomes
            for c in ctxs:
                c.set_sampler(0, None)
    finally:
        for c in ctxs:
            c.close()


def test_a_second_generation_on_a_busy_context_is_refused_and_the_first_stays_right(models, fresh_tokens):
    g1, ctx, ctxd = make(models, T.DRAFT_SIMPLE)
    g2 = SpeculativeGenerator(ctx, g1.spec_params, greedy_sampling())
    started, tried = threading.Event(), threading.Event()
    refused: list[BaseException] = []

    def on_piece(_seq, _text):
        started.set()
        tried.wait(30)  # the first generation is mid-way while the other thread tries

    def intruder() -> None:
        started.wait(30)
        try:
            g2.generate([PROMPT], N_PREDICT)
        except ConcurrentUseError as e:
            refused.append(e)
        finally:
            tried.set()

    th = threading.Thread(target=intruder)
    th.start()
    first = g1.generate([PROMPT], N_PREDICT, on_piece=on_piece)[0].tokens
    th.join()
    assert refused and "already running" in str(refused[0])
    assert first == fresh_tokens[T.DRAFT_SIMPLE]
    # same thread, from inside a callback: refused too
    with pytest.raises(ConcurrentUseError):
        g1.generate([PROMPT], N_PREDICT, on_piece=lambda *_: g2.generate([PROMPT], 2))
    assert g2.generate([PROMPT], N_PREDICT)[0].tokens == fresh_tokens[T.DRAFT_SIMPLE]
    close_all(g2, g1, ctxd, ctx)


def test_closed_generator_raises_closed_error(models):
    g, ctx, ctxd = make(models, T.NGRAM_MOD)
    g.close()
    with pytest.raises(ClosedError, match="generator is closed"):
        g.generate([PROMPT], 4)
    close_all(ctxd, ctx)


# --- long run (short version of scripts/soak.py) -------------------------------


@pytest.mark.slow  # a soak run in a subprocess
def test_a_thousand_speculative_steps_grow_no_memory_fds_or_threads():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, str(root / "scripts" / "soak.py"), "--steps", "1000", "--warmup-steps", "300",
         "--warmup-cycles", "1", "--max-growth-mb", "5"],
        cwd=root, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    assert "OK" in out.stdout.splitlines()[-1]
