"""The safety guarantees beside the audit table: copies, ownership, claims, fork, grammar and state checks."""

from __future__ import annotations

import copy
import os
import pickle
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pyspec
from pyspec import Batch, ConcurrentUseError, Context, Model, SamplerChain
from pyspec.common import sampling as smp
from pyspec.core import fork
from pyspec.core.grammar import GRAMMAR_LIMITS, check_grammar
from pyspec.generation.driver import greedy_sampling
from pyspec.reference.sampling import RefSampler
from pyspec.testing import models as tm

KW = dict(n_ctx=256, n_batch=32, n_ubatch=32, n_threads=1, n_threads_batch=1)
VENDOR = Path(__file__).resolve().parents[1] / "vendor" / "llama.cpp"


def decoded(model: Model, n: int = 4, **kw) -> Context:
    c = Context(model, **{**KW, **kw})
    b = Batch(n)
    b.add_sequence(list(range(10, 10 + n)), 0, 0)
    b.logits[:n] = 1
    c.decode(b)
    return c


# --- outputs are copies --------------------------------------------------------------


def test_a_logits_row_is_a_copy_that_survives_decodes_and_close(target_model):
    c = decoded(target_model)
    row = c.get_logits_ith(-1)
    kept = row.copy()
    b = Batch(32)
    b.add_sequence(list(range(100, 132)), 4, 0)
    b.logits[:] = 1
    c.decode(b)  # more outputs: llama.cpp reallocates its buffer
    c.close()
    np.testing.assert_array_equal(row, kept)
    assert row.flags.owndata or (row.base is not None and row.base.flags.owndata)


def test_out_reuses_the_callers_array_and_checks_it(target_model):
    with decoded(target_model) as c:
        buf = np.empty(c.n_vocab, np.float32)
        got = c.get_logits_ith(2, out=buf)
        assert got is buf
        np.testing.assert_array_equal(buf, c.get_logits_ith(2))
        rows = np.empty((4, c.n_vocab), np.float32)
        assert c.get_logits(4, out=rows) is rows
        np.testing.assert_array_equal(rows[2], buf)
        for bad in (np.empty(3, np.float32), np.empty(c.n_vocab, np.float64), np.empty(c.n_vocab * 2, np.float32)[::2]):
            with pytest.raises(ValueError, match="out must be"):
                c.get_logits_ith(2, out=bad)


def test_rows_are_checked_against_the_last_decode(target_model):
    with decoded(target_model) as c:
        assert c.get_logits(4).shape == (4, c.n_vocab)
        with pytest.raises(IndexError):
            c.get_logits(5)
        with pytest.raises(IndexError):
            c.get_logits_ith(4)
        with pytest.raises(IndexError):
            c.get_logits_ith(-5)
        np.testing.assert_array_equal(c.get_logits_ith(-1), c.get_logits_ith(3))


# --- not copyable ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["model", "context", "chain", "batch", "batch_view", "ref_sampler", "port_sampler",
                                  "threadpool", "lora"])
@pytest.mark.parametrize("how", ["copy", "deepcopy", "pickle"])
def test_handle_owning_objects_refuse_copies_and_pickles(target_model, kind, how, tmp_path):
    from pyspec.core.adapters import LoraAdapter
    from pyspec.core.threadpool import ThreadPool
    from pyspec.testing import derived

    c = Context(target_model, **KW)
    b = Batch(4)
    b.add_sequence([1, 2], 0, 0)
    objs = {"model": target_model, "context": c, "chain": SamplerChain().add_greedy(), "batch": b,
            "batch_view": b.view(0, 1), "ref_sampler": RefSampler(target_model, greedy_sampling()),
            "port_sampler": smp.common_sampler_init(target_model, greedy_sampling())}
    if kind == "threadpool":
        objs[kind] = ThreadPool(1)
    if kind == "lora":
        objs[kind] = LoraAdapter(target_model, derived.make_lora(tmp_path / "lora.gguf").path)
    obj = objs[kind]
    fn: Any = {"copy": copy.copy, "deepcopy": copy.deepcopy, "pickle": pickle.dumps}[how]
    with pytest.raises(TypeError, match="cannot be copied or pickled"):
        fn(obj)
    for o in objs.values():
        if o is not target_model and hasattr(o, "close"):
            o.close()


def test_a_sampler_keeps_its_model_alive(target_path):
    m = Model(target_path)
    s = smp.common_sampler_init(m, greedy_sampling())
    m.close()
    assert m.closed and m._ptr != pyspec.ffi.ffi.NULL  # freed when the sampler lets go
    s.close()
    assert m._ptr == pyspec.ffi.ffi.NULL


# --- claims and threads ------------------------------------------------------------------


def test_a_claimed_context_refuses_other_threads_and_serves_its_own(target_model):
    with Context(target_model, **KW) as c:
        seen: list[BaseException] = []
        with c.claim():
            c.memory.seq_pos_max(0)  # the claiming thread is served

            def other():
                try:
                    c.memory.seq_pos_max(0)
                except BaseException as e:
                    seen.append(e)

            th = threading.Thread(target=other)
            th.start()
            th.join()
        assert len(seen) == 1 and isinstance(seen[0], ConcurrentUseError)
        c.memory.seq_pos_max(0)  # after the claim, anyone


def test_a_context_reading_another_takes_both_guards(target_model, models_e3):
    tgt = Context(target_model, **KW)
    dft = Context(models_e3, **KW, ctx_other=tgt)
    with tgt.held():
        with pytest.raises(ConcurrentUseError, match="ctx_other"):
            dft.memory.seq_pos_max(0)
    dft.memory.seq_pos_max(0)
    dft.close()
    tgt.close()


@pytest.fixture(scope="module")
def models_e3():
    with Model(tm.make_eagle3()) as m:
        yield m


@pytest.mark.slow  # a stress run in a subprocess
def test_the_stress_script_runs_clean_for_a_few_seconds():
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "scripts" / "stress.py"), "--threads", "4", "--seconds", "8"],
                         cwd=root, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[-1] == "OK"
    assert int(lines[0].split(" calls completed")[0].split()[-1]) > 0


# --- fork ---------------------------------------------------------------------------------


def _in_child(fn) -> int:
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = fn()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_a_child_forked_after_multithreaded_compute_decodes_with_one_thread(target_model):
    c = decoded(target_model, n_threads=2, n_threads_batch=2)
    row = c.get_logits_ith(-1)

    def child() -> int:
        b = Batch(1)
        b.add(14, 4, 0, True)
        c.memory.seq_rm(0, 4, -1)
        c.decode(b)
        new = Context(target_model, **{**KW, "n_threads": 2, "n_threads_batch": 2})
        return 0 if fork.in_single_thread_child() and c.n_threads == 1 and new.n_threads == 1 else 3

    assert _in_child(child) == 0
    np.testing.assert_array_equal(c.get_logits_ith(-1), row)  # the parent's context is untouched
    c.close()


def test_a_context_busy_at_the_fork_is_refused_in_the_child(target_model):
    c = Context(target_model, **KW)
    with c.held():  # as if another thread were inside llama.cpp at the fork
        pid = os.fork()
        if pid == 0:
            try:
                c.memory.seq_pos_max(0)
                os._exit(3)
            except ConcurrentUseError as e:
                os._exit(0 if "forked" in str(e) else 4)
            except BaseException:
                os._exit(5)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    c.close()


# --- grammars -----------------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted((VENDOR / "grammars").glob("*.gbnf")), ids=lambda p: p.name)
def test_llama_cpps_own_grammars_pass_the_bounds(target_model, path):
    check_grammar(path.read_text(), "root", target_model.vocab.ptr)
    with SamplerChain().add_grammar(target_model.vocab, path.read_text()) as chain:
        assert len(chain) == 1


def test_grammar_limits_come_from_the_declarations():
    assert GRAMMAR_LIMITS["max_nesting"] == pyspec.ffi.c_const("PYSPEC_GRAMMAR_MAX_NESTING")
    check_grammar("root ::= " + "(" * GRAMMAR_LIMITS["max_nesting"] + '"a"' + ")" * GRAMMAR_LIMITS["max_nesting"])
    with pytest.raises(ValueError, match="nests"):
        check_grammar("root ::= " + "(" * (GRAMMAR_LIMITS["max_nesting"] + 1) + '"a"' + ")" * 200)


def test_a_grammar_chain_accepts_what_the_grammar_allows_and_refuses_the_rest(target_model):
    v = target_model.vocab
    a = v.tokenize("a", add_special=False)[-1]
    with SamplerChain().add_grammar(v, "root ::= [ a]+").add_greedy() as chain:  # SPM pieces: " a"
        chain.accept(a)
        chain.accept(a)
        with pytest.raises(ValueError, match="Unexpected empty grammar stack"):
            chain.accept(v.tokenize("b", add_special=False)[-1])
        chain.accept(a)  # the refused token changed nothing
        chain.accept(v.eos)  # complete: end of generation is allowed


# --- state blobs ----------------------------------------------------------------------------


@pytest.mark.parametrize("flags", [0, 1])
@pytest.mark.parametrize("kind", ["target", "mtp", "mtp_draft", "eagle3"])
def test_real_states_of_every_memory_kind_pass_the_check_and_restore(target_model, models_e3, kind, flags):
    from pyspec.core.state import check_seq_state

    m_mtp = Model(tm.make_mtp()) if kind.startswith("mtp") else None
    tgt = Context(m_mtp or target_model, **KW, n_seq_max=2)
    ctx: Any = {"target": tgt, "mtp": tgt,
           "mtp_draft": Context(m_mtp, **KW, n_seq_max=2, ctx_type="mtp", ctx_other=tgt) if m_mtp else None,
           "eagle3": Context(models_e3, **KW, n_seq_max=2, ctx_other=tgt)}[kind]
    b = Batch(6)
    b.add_sequence(list(range(10, 16)), 0, 0)
    tgt.decode(b)
    blob = ctx.state_seq_get(0, flags)
    with ctx.held():
        check_seq_state(ctx, blob, flags)
    ctx.state_seq_set(1, blob, flags)
    with pytest.raises(ValueError, match="state does not fit"):
        ctx.state_seq_set(1, blob + b"\0" * 4, flags)
    for c in {id(c): c for c in (ctx, tgt)}.values():
        c.close()
    if m_mtp:
        m_mtp.close()


def test_a_state_whose_cell_extension_names_a_token_outside_the_vocabulary_is_refused():
    """At 0c1e57098 an M-RoPE cell stores its token (llama_kv_cell_ext.tok), which the restore puts in a ubatch."""
    m = Model(tm.make_mtp())  # qwen35: IMROPE, so every KV cell carries the extension
    c = Context(m, **KW, n_seq_max=2)
    b = Batch(6)
    b.add_sequence(list(range(10, 16)), 0, 0)
    c.decode(b)
    blob = c.state_seq_get(0, 0)
    # magic, source seq, stream count, cell count; then the first cell: pos, n_seq_id, x, y, tok
    tok_at = 4 * 4 + 4 + 4 + 8
    assert int.from_bytes(blob[tok_at:tok_at + 4], "little") == 10
    c.state_seq_set(1, blob, 0)
    bad = blob[:tok_at] + (10**6).to_bytes(4, "little") + blob[tok_at + 4:]
    with pytest.raises(ValueError, match="KV cell token 1000000 is outside the vocabulary"):
        c.state_seq_set(1, bad, 0)
    c.close()
    m.close()
