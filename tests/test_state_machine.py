"""Stateful property test: random legal and illegal sequences of public API calls.

A hypothesis RuleBasedStateMachine creates contexts on the tiny target, builds
batches, decodes, removes sequence ranges, saves and restores sequence state,
runs the speculative port (begin / draft / accept), generates, and closes
things, in random order. The process must never crash; illegal calls raise the
documented exception; legal results agree with a small model of the expected
state (each sequence's last position, closed objects, draft lengths).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, precondition, rule

import pyspec
from pyspec import Batch, ClosedError, Context, DecodeError, Model, SpeculativeError
from pyspec.common import speculative as sp
from pyspec.common.params import CommonParamsSpeculative
from pyspec.common.params import CommonSpeculativeType as T
from pyspec.generation.driver import SpeculativeGenerator, greedy_sampling
from pyspec.testing import models as tm

pytestmark = pytest.mark.slow  # a random walk over the public API (hypothesis, 100 runs of 40 steps), fuzz-like

N_SEQ = 2
N_CTX = 128  # per sequence: N_CTX // N_SEQ = 64 positions
N_BATCH = 16
MAX_POS = 40  # keep every sequence well inside its 64 cells
NGRAM_TYPES = [T.NGRAM_SIMPLE, T.NGRAM_MAP_K, T.NGRAM_MOD, T.NGRAM_CACHE]

_MODELS: dict[str, Model] = {}


def models() -> dict[str, Model]:
    if not _MODELS:
        _MODELS["target"] = Model(tm.make_target())
        _MODELS["draft"] = Model(tm.make_draft())
    return _MODELS


class Ctx:
    """A context and what its memory should hold."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.pos_max = [-1] * N_SEQ
        self.closed = False
        self.n_outputs = 0


class Spec:
    """A speculative state of the port and what it has seen."""

    def __init__(self, spec: sp.CommonSpeculative, n_max: int) -> None:
        self.spec = spec
        self.n_max = n_max
        self.has_drafted = [False] * N_SEQ


tokens_st = st.lists(st.integers(3, 31999), min_size=1, max_size=8)


class ApiMachine(RuleBasedStateMachine):
    contexts = Bundle("contexts")
    specs = Bundle("specs")

    def __init__(self) -> None:
        super().__init__()
        self.vocab = models()["target"].vocab
        self.all: list[Ctx] = []
        self.gens: list[tuple[SpeculativeGenerator, Ctx]] = []

    # --- contexts -------------------------------------------------------------

    @precondition(lambda self: sum(not c.closed for c in self.all) < 3)
    @rule(target=contexts, kv_unified=st.booleans())
    def create_context(self, kv_unified):
        c = Ctx(Context(models()["target"], n_ctx=N_CTX, n_batch=N_BATCH, n_ubatch=N_BATCH, n_seq_max=N_SEQ,
                        kv_unified=kv_unified, n_threads=1, n_threads_batch=1))
        self.all.append(c)
        return c

    @rule(c=contexts, seq=st.integers(0, N_SEQ - 1), toks=tokens_st, all_logits=st.booleans())
    def decode(self, c, seq, toks, all_logits):
        if c.pos_max[seq] + len(toks) > MAX_POS:
            toks = toks[: max(0, MAX_POS - c.pos_max[seq])]
            if not toks:
                return
        b = Batch(len(toks), 0, N_SEQ)
        p0 = c.pos_max[seq] + 1
        for i, t in enumerate(toks):
            b.add(t, p0 + i, seq, all_logits or i == len(toks) - 1)
        if c.closed:
            with pytest.raises(ClosedError):
                c.ctx.decode(b)
            return
        c.ctx.decode(b)
        c.pos_max[seq] += len(toks)
        c.n_outputs = len(toks) if all_logits else 1
        row = c.ctx.get_logits_ith(-1)
        assert row.shape == (self.vocab.n_tokens,) and np.isfinite(row).all()

    @rule(c=contexts, kind=st.sampled_from(["token", "seq", "empty", "too_big", "old_pos", "neg_pos"]))
    def decode_illegal(self, c, kind):
        b = Batch(N_BATCH + 1, 0, N_SEQ)
        expected: type[BaseException] = ValueError
        if kind == "token":
            b.add(self.vocab.n_tokens + 7, c.pos_max[0] + 1, 0, True)
        elif kind == "seq":
            b.add(5, 0, N_SEQ, True)
        elif kind == "too_big":
            for i in range(N_BATCH + 1):
                b.add(5, c.pos_max[0] + 1 + i, 0, i == N_BATCH)
        elif kind == "old_pos":  # a position the sequence already holds
            if c.pos_max[0] < 0:
                return
            b.add(5, c.pos_max[0], 0, True)
            expected = DecodeError
        elif kind == "neg_pos":
            b.add(5, -3, 0, True)
            expected = DecodeError
        if c.closed:
            expected = ClosedError
        before = list(c.pos_max)
        with pytest.raises(expected):
            c.ctx.decode(b)
        if not c.closed:
            c.n_outputs = 0 if expected is DecodeError and c.n_outputs is not None else c.n_outputs
            assert [c.ctx.memory.seq_pos_max(s) for s in range(N_SEQ)] == before

    @rule(c=contexts, n=st.integers(-1, 40))
    def read_logit_rows(self, c, n):
        if c.closed:
            with pytest.raises(ClosedError):
                c.ctx.get_logits(max(n, 0))
            return
        if c.n_outputs is None:
            return
        if 0 <= n <= c.n_outputs:  # the rows the last decode wrote, copied out
            assert c.ctx.get_logits(n).shape == (n, self.vocab.n_tokens)
        else:
            with pytest.raises(IndexError):
                c.ctx.get_logits(n)

    @rule(c=contexts, seq=st.integers(-1, N_SEQ - 1), p0=st.integers(-1, 45), p1=st.sampled_from([-1, 50]))
    def seq_rm(self, c, seq, p0, p1):
        if c.closed:
            with pytest.raises(ClosedError):
                c.ctx.memory.seq_rm(seq, p0, p1)
            return
        assert c.ctx.memory.seq_rm(seq, p0, p1)
        for s in range(N_SEQ) if seq == -1 else [seq]:
            c.pos_max[s] = -1 if p0 <= 0 else min(c.pos_max[s], p0 - 1)

    @rule(c=contexts, seq=st.integers(-3, N_SEQ + 2))
    def bad_seq_id(self, c, seq):
        if 0 <= seq < N_SEQ:
            return
        with pytest.raises(ClosedError if c.closed else ValueError):
            c.ctx.memory.seq_pos_max(seq)

    @rule(c=contexts, seq=st.integers(0, N_SEQ - 1))
    def state_round_trip(self, c, seq):
        if c.closed:
            with pytest.raises(ClosedError):
                c.ctx.state_seq_get(seq)
            return
        data = c.ctx.state_seq_get(seq)
        c.ctx.memory.seq_rm(seq, -1, -1)
        if c.pos_max[seq] >= 0:
            c.ctx.state_seq_set(seq, data)
        else:  # an empty sequence's state restores to empty (or is rejected as empty)
            try:
                c.ctx.state_seq_set(seq, data)
            except (ValueError, pyspec.ContextError):
                pass

    @rule(c=contexts, junk=st.binary(min_size=1, max_size=64))
    def state_garbage(self, c, junk):
        if c.closed:
            return
        with pytest.raises(ValueError, match="state does not fit"):  # refused before llama.cpp reads it
            c.ctx.state_seq_set(0, junk)
        # a rejected state leaves the sequence empty or as it was, never half-written
        assert c.ctx.memory.seq_pos_max(0) in (-1, c.pos_max[0])
        c.pos_max[0] = c.ctx.memory.seq_pos_max(0)

    @rule(c=contexts)
    def close_context(self, c):
        c.ctx.close()
        c.closed = True

    # --- the speculative port -------------------------------------------------

    @rule(target=specs, t=st.sampled_from(NGRAM_TYPES), n_max=st.integers(1, 8))
    def create_spec(self, t, n_max):
        p = CommonParamsSpeculative(types=[t])
        for m in (p.ngram_simple, p.ngram_map_k):
            m.size_n, m.size_m, m.min_hits = 2, 6, 1
        p.ngram_mod.n_match, p.ngram_mod.n_min, p.ngram_mod.n_max = 2, 1, 6
        spec = sp.common_speculative_init(p, N_SEQ)
        assert spec is not None
        return Spec(spec, n_max)

    @rule(s=specs, seq=st.integers(0, N_SEQ - 1), prompt=st.lists(st.integers(0, 9), min_size=0, max_size=40))
    def spec_begin(self, s, seq, prompt):
        sp.common_speculative_begin(s.spec, seq, prompt)

    @rule(s=specs, seq=st.integers(0, N_SEQ - 1), hist=st.lists(st.integers(0, 9), min_size=1, max_size=60),
          last=st.integers(0, 9), n_max=st.integers(1, 12))
    def spec_draft(self, s, seq, hist, last, n_max):
        dp = sp.common_speculative_get_draft_params(s.spec, seq)
        dp.drafting, dp.n_max, dp.n_past, dp.id_last = True, n_max, len(hist), last
        dp.prompt, dp.result = hist, []
        try:
            sp.common_speculative_draft(s.spec)
        except SpeculativeError as e:
            # a history shorter than the one ngram-map last checked (without a begin() that
            # resets it): the C++ aborts (GGML_ABORT); the port must raise instead
            assert "idx_last_check > cur_len" in str(e)
            return
        assert len(dp.result) <= n_max
        assert all(0 <= t <= 9 for t in dp.result)  # n-gram drafts come from the history
        s.has_drafted[seq] = s.has_drafted[seq] or bool(dp.result)

    @rule(s=specs, seq=st.integers(0, N_SEQ - 1), n=st.integers(0, 8))
    def spec_accept(self, s, seq, n):
        if s.has_drafted[seq]:
            try:
                sp.common_speculative_accept(s.spec, seq, n)
            except SpeculativeError as e:  # legal only while begin() has not dropped the drafted key
                assert "no longer exists" in str(e)
        elif n == 0:
            sp.common_speculative_accept(s.spec, seq, n)  # nothing drafted, nothing accepted: a no-op
        else:
            with pytest.raises(SpeculativeError):
                sp.common_speculative_accept(s.spec, seq, n)

    @rule(s=specs, seq=st.sampled_from([-1, N_SEQ, 99]))
    def spec_bad_seq(self, s, seq):
        with pytest.raises(SpeculativeError):
            sp.common_speculative_get_draft_params(s.spec, seq)
        with pytest.raises(SpeculativeError):
            sp.common_speculative_accept(s.spec, seq, 0)

    # --- generation ---------------------------------------------------------------

    @rule(c=contexts, t=st.sampled_from([T.NONE, T.NGRAM_SIMPLE, T.NGRAM_MOD]), n_predict=st.integers(1, 6),
          prompt=st.text(alphabet="ab c(d)", min_size=1, max_size=12))
    def generate(self, c, t, n_predict, prompt):
        p = CommonParamsSpeculative(types=[t])
        p.ngram_simple.size_n, p.ngram_simple.size_m = 2, 4
        p.ngram_mod.n_match, p.ngram_mod.n_min, p.ngram_mod.n_max = 2, 1, 4
        if c.closed:
            with pytest.raises(ClosedError):
                SpeculativeGenerator(c.ctx, p, greedy_sampling(), n_seq=1).generate([prompt], n_predict)
            return
        g = SpeculativeGenerator(c.ctx, p, greedy_sampling(), n_seq=1)
        c.pos_max = [-1] * N_SEQ  # a generator starts from an empty memory, as the server does
        (res,) = g.generate([prompt], n_predict)
        assert 1 <= len(res.tokens) <= n_predict
        assert res.stop_reason in ("n_predict", "eog", "stop", "context")
        # the memory holds the prompt and every generated token but the last
        c.pos_max[0] = len(res.prompt_tokens) + len(res.tokens) - 2
        c.n_outputs = None  # whatever the last step of the loop asked for
        assert c.ctx.memory.seq_pos_max(0) == c.pos_max[0]
        self.gens.append((g, c))
        if c.pos_max[0] > MAX_POS:
            c.ctx.memory.seq_rm(0, -1, -1)
            c.pos_max[0] = -1

    @precondition(lambda self: self.gens)
    @rule(k=st.integers(0, 100))
    def close_generator(self, k):
        g, _c = self.gens.pop(k % len(self.gens))
        g.close()
        with pytest.raises(ClosedError):
            g.generate(["x"], 1)

    # --- invariants and cleanup ---------------------------------------------------

    @invariant()
    def positions_match_the_model(self):
        for c in self.all:
            if not c.closed:
                assert [c.ctx.memory.seq_pos_max(s) for s in range(N_SEQ)] == c.pos_max

    def teardown(self):
        for g, _ in self.gens:
            g.close()
        for c in self.all:
            c.ctx.close()
        for c in self.all:
            assert c.ctx._ptr == pyspec.ffi.ffi.NULL


ApiMachine.TestCase.settings = settings(
    # no shrinking: a failure prints its (long) example at once instead of minutes of shrinking
    max_examples=100, stateful_step_count=40, deadline=None, derandomize=True,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_public_api_state_machine = ApiMachine.TestCase
