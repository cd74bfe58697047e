"""The C++ loop (pyspec.generation.cpp_loop) generates what the Python engine generates
(fixed draft lengths, with and without a per-request draft cap)."""

from __future__ import annotations

import pytest

from pyspec import Context, Model
from pyspec.common.params import CommonParamsSampling, CommonParamsSpeculative
from pyspec.common.params import CommonSpeculativeType as T
from pyspec.errors import LoopInputError, RefError
from pyspec.ffi import ffi
from pyspec.ffi import ref as lib
from pyspec.generation.cpp_loop import cpp_generate
from pyspec.generation.engine import Engine, greedy_sampling
from pyspec.generation.requests import Request
from pyspec.generation.statistics import GenerationStats, SequenceResult
from pyspec.testing import models as tm

PROMPT = "def fib(n): return fib(n-1) + fib(n-2)\n" * 3
N_PREDICT = 32
# one thread: deterministic and quick even on a loaded machine
THREADS = {"n_threads": 1, "n_threads_batch": 1}


@pytest.fixture(scope="module")
def eagle3_model():
    with Model(tm.make_eagle3()) as m:
        yield m


@pytest.fixture(scope="module")
def mtp_model():
    with Model(tm.make_mtp()) as m:
        yield m


def _setup(kind: str, n_seq: int, request: pytest.FixtureRequest,
           n_rs_seq: int = 4) -> tuple[Context, CommonParamsSpeculative | None, list]:
    """Target context and speculative params for one kind, as the engine's users set them up
    (``n_rs_seq``: the MTP target's recurrent rollback; 0 restores a checkpoint on every partial acceptance)."""
    n_ctx = 1024 * n_seq
    contexts: list[Context] = []
    if kind == "mtp":
        model = request.getfixturevalue("mtp_model")
        ctx = Context(model, n_ctx=n_ctx, n_batch=32, n_ubatch=16, n_seq_max=n_seq, n_rs_seq=n_rs_seq, **THREADS)
    else:
        model = request.getfixturevalue("target_model")
        # EAGLE3: one ubatch per batch; when the prompt batches are split into several ubatches its
        # drafts (not the tokens) vary from run to run
        n_b, n_ub = (32, 32) if kind == "eagle3" else (128, 64)
        ctx = Context(model, n_ctx=n_ctx, n_batch=n_b, n_ubatch=n_ub, n_seq_max=n_seq, **THREADS)
    contexts.append(ctx)
    spec: CommonParamsSpeculative | None = None
    if kind == "draft-simple":
        ctxd = Context(request.getfixturevalue("draft_model"), n_ctx=n_ctx, n_batch=128, n_ubatch=64,
                       n_seq_max=n_seq, **THREADS)
        contexts.append(ctxd)
        spec = CommonParamsSpeculative(types=[T.DRAFT_SIMPLE])
        spec.draft.ctx_dft = ctxd
    elif kind == "ngram-simple":
        spec = CommonParamsSpeculative(types=[T.NGRAM_SIMPLE])
        spec.ngram_simple.size_n = 1  # the random tiny target rarely repeats longer n-grams
        spec.ngram_simple.size_m = 8
    elif kind == "eagle3":
        ctxd = Context(request.getfixturevalue("eagle3_model"), n_ctx=n_ctx, n_batch=32, n_ubatch=32,
                       n_seq_max=n_seq, ctx_other=ctx, **THREADS)
        contexts.append(ctxd)
        spec = CommonParamsSpeculative(types=[T.DRAFT_EAGLE3])
        spec.draft.ctx_dft = ctxd
        spec.draft.n_max = 4
    elif kind == "mtp":
        ctxd = Context(model, n_ctx=n_ctx, n_batch=32, n_ubatch=16, n_seq_max=n_seq, ctx_type="mtp",
                       ctx_other=ctx, **THREADS)
        contexts.append(ctxd)
        spec = CommonParamsSpeculative(types=[T.DRAFT_MTP])
        spec.draft.ctx_dft = ctxd
        spec.draft.n_max = 3
    return ctx, spec, contexts


def _close(contexts: list[Context]) -> None:
    for c in reversed(contexts):
        c.close()


def _outcome(rs: list[SequenceResult]) -> tuple:
    return ([r.tokens for r in rs], [r.stop_reason for r in rs], [r.n_drafted for r in rs],
            [r.n_accepted for r in rs])


def _engine(ctx: Context, spec: CommonParamsSpeculative | None, prompts: list[str], n_predict: int,
            backend: str = "python", n_draft_max: int | None = None,
            sampling: CommonParamsSampling | None = None) -> tuple:
    """What the engine generates with fixed draft lengths (every request's draft capped at ``n_draft_max``),
    one prompt per slot, as SpeculativeGenerator submits them."""
    with Engine(ctx, spec, sampling or greedy_sampling(), n_parallel=len(prompts), backend=backend,
                adaptive_draft=False) as eng:
        hs = [eng.submit(Request(prompt=p, n_predict=n_predict, n_draft_max=n_draft_max, cache_prompt=False,
                                 slot_id=i)) for i, p in enumerate(prompts)]
        eng.run_until_idle()
        cs = [h.result() for h in hs]
    return ([c.tokens for c in cs], [c.stop_reason for c in cs], [c.stats.n_drafted for c in cs],
            [c.stats.n_accepted for c in cs])


def _compare(kind: str, n_seq: int, engine: str, request: pytest.FixtureRequest) -> GenerationStats:
    """Run the engine and the C++ loop, each on fresh contexts; assert the same outcome; return the loop's stats."""
    prompts = [PROMPT, PROMPT[:50]][:n_seq]
    n_predict = 128 if kind == "ngram-simple" else N_PREDICT  # n-gram drafts need some history
    ctx, spec, contexts = _setup(kind, n_seq, request)
    try:
        expected = _engine(ctx, spec, prompts, n_predict, engine)
    finally:
        _close(contexts)
    ctx, spec, contexts = _setup(kind, n_seq, request)
    try:
        results, st = cpp_generate(ctx, prompts, n_predict, spec)
    finally:
        _close(contexts)
    if kind == "eagle3" and n_seq > 1:
        # the C++ reference's EAGLE3 drafts for two sequences vary from run to run (sequence 0
        # sometimes drafts only rejected tokens); the verified tokens do not
        expected, got = expected[:2], _outcome(results)[:2]
    else:
        got = _outcome(results)
    assert got == expected
    assert all(len(r.tokens) == n_predict for r in results)
    return st


@pytest.mark.parametrize("n_seq", [1, 2])
@pytest.mark.parametrize("kind", ["none", "draft-simple", "ngram-simple", "eagle3", "mtp"])
def test_cpp_loop_generates_the_python_engines_tokens(kind: str, n_seq: int, request: pytest.FixtureRequest) -> None:
    st = _compare(kind, n_seq, "python", request)
    if kind != "none":
        assert st.n_drafted > 0  # the speculative path ran
    assert st.n_steps > 0 and st.t_gen_s > 0 and st.t_decode_s > 0


@pytest.mark.parametrize("n_draft_max", [0, 1, 2])
@pytest.mark.parametrize("n_seq", [1, 2])
@pytest.mark.parametrize("kind", ["draft-simple", "mtp"])
def test_cpp_loop_caps_each_draft_as_the_engines_per_request_n_draft_max(
        kind: str, n_seq: int, n_draft_max: int, request: pytest.FixtureRequest) -> None:
    prompts = [PROMPT, PROMPT[:50]][:n_seq]
    ctx, spec, contexts = _setup(kind, n_seq, request)
    try:
        expected = _engine(ctx, spec, prompts, N_PREDICT, n_draft_max=n_draft_max)
    finally:
        _close(contexts)
    ctx, spec, contexts = _setup(kind, n_seq, request)
    try:
        results, st = cpp_generate(ctx, prompts, N_PREDICT, spec, n_draft_max=n_draft_max)
    finally:
        _close(contexts)
    assert _outcome(results) == expected
    # the cap bites: no step drafts more than it (each step drafts at most n_draft_max per sequence)
    assert st.n_drafted <= n_draft_max * n_seq * st.n_steps
    assert (st.n_drafted > 0) == (n_draft_max > 0)


def test_cpp_loop_draft_cap_changes_the_draft_counts_not_the_tokens(request: pytest.FixtureRequest) -> None:
    ctx, spec, contexts = _setup("draft-simple", 1, request)
    try:
        (free,), _ = cpp_generate(ctx, [PROMPT], N_PREDICT, spec)
        (capped,), _ = cpp_generate(ctx, [PROMPT], N_PREDICT, spec, n_draft_max=1)
    finally:
        _close(contexts)
    assert capped.tokens == free.tokens and capped.n_drafted < free.n_drafted


def test_cpp_loop_refuses_the_cost_aware_controller_and_a_negative_cap(target_ctx: Context) -> None:
    with pytest.raises(LoopInputError, match="fixed draft lengths"):
        cpp_generate(target_ctx, [PROMPT], 4, adaptive_draft=True)
    with pytest.raises(LoopInputError, match="n_draft_max must be in 0"):
        cpp_generate(target_ctx, [PROMPT], 4, n_draft_max=-1)


@pytest.mark.parametrize("kind", ["draft-simple", "mtp"])
def test_cpp_loop_generates_the_cpp_engines_tokens(kind: str, request: pytest.FixtureRequest) -> None:
    _compare(kind, 2, "cpp", request)


def test_cpp_loop_stops_at_n_predict_within_a_draft(request: pytest.FixtureRequest) -> None:
    ctx, spec, contexts = _setup("draft-simple", 1, request)
    try:
        for n in (1, 2, 5):
            (res,), _ = cpp_generate(ctx, [PROMPT], n, spec)
            assert len(res.tokens) == n and res.stop_reason == "n_predict"
    finally:
        _close(contexts)


def _seeded(seed: int) -> CommonParamsSampling:
    s = greedy_sampling()
    s.seed = seed
    return s


@pytest.mark.parametrize("n_seq", [1, 2])
def test_cpp_loop_counts_a_replay_after_a_checkpoint_restore_as_the_engine(
        n_seq: int, request: pytest.FixtureRequest) -> None:
    # n_rs_seq 0: every partial acceptance restores the checkpoint and re-verifies the accepted part; the
    # target's own last token of that replay is no accepted draft token on either side (the server's count)
    prompts = [PROMPT, PROMPT[:50]][:n_seq]
    ctx, spec, contexts = _setup("mtp", n_seq, request, n_rs_seq=0)
    try:
        with Engine(ctx, spec, greedy_sampling(), n_parallel=n_seq, adaptive_draft=False) as eng:
            hs = [eng.submit(Request(prompt=p, n_predict=N_PREDICT, cache_prompt=False, slot_id=i))
                  for i, p in enumerate(prompts)]
            eng.run_until_idle()
            cs = [h.result() for h in hs]
            assert eng.n_checkpoint_restores > 0
    finally:
        _close(contexts)
    assert [c.stats.n_accepted for c in cs] == [c.stats.spec.n_accepted_tokens for c in cs]
    ctx, spec, contexts = _setup("mtp", n_seq, request, n_rs_seq=0)
    try:
        results, _ = cpp_generate(ctx, prompts, N_PREDICT, spec)
    finally:
        _close(contexts)
    assert _outcome(results) == ([c.tokens for c in cs], [c.stop_reason for c in cs],
                                 [c.stats.n_drafted for c in cs], [c.stats.n_accepted for c in cs])


@pytest.mark.parametrize("n_rs_seq", [0, 4])
@pytest.mark.parametrize("kind", ["draft-simple", "mtp"])
def test_cpp_loop_accepts_synthetically_as_the_engine(kind: str, n_rs_seq: int,
                                                      request: pytest.FixtureRequest) -> None:
    # the same std::mt19937 draws per sequence from the same seed: the same decisions, tokens and counts,
    # also on replays after checkpoint restores (n_rs_seq 0)
    prompts = [PROMPT, PROMPT[:50]]
    ctx, spec, contexts = _setup(kind, 2, request, n_rs_seq=n_rs_seq)
    assert spec is not None
    spec.synth_len = 1.5
    try:
        expected = _engine(ctx, spec, prompts, N_PREDICT, sampling=_seeded(11))
    finally:
        _close(contexts)
    ctx, spec, contexts = _setup(kind, 2, request, n_rs_seq=n_rs_seq)
    assert spec is not None
    spec.synth_len = 1.5
    try:
        results, st = cpp_generate(ctx, prompts, N_PREDICT, spec, _seeded(11))
    finally:
        _close(contexts)
    assert _outcome(results) == expected
    assert 0 < st.n_accepted < st.n_drafted


# --- bad input: clear Python errors, no crash --------------------------------


def test_more_prompts_than_the_targets_sequences_is_refused(target_ctx: Context) -> None:
    with pytest.raises(ValueError, match=r"n_seq must be 1\.\.2 .* got 3"):
        cpp_generate(target_ctx, [PROMPT] * 3, 4)


def test_no_prompt_is_refused(target_ctx: Context) -> None:
    with pytest.raises(ValueError, match=r"n_seq must be 1\.\.2 .* got 0"):
        cpp_generate(target_ctx, [], 4)


def test_an_empty_prompt_is_refused(target_ctx: Context) -> None:
    with pytest.raises(LoopInputError, match="prompt 1 is empty"):
        cpp_generate(target_ctx, [[1, 2], []], 4)


def test_a_prompt_longer_than_the_context_is_refused(target_ctx: Context) -> None:
    with pytest.raises(ValueError, match="does not fit the context"):
        cpp_generate(target_ctx, [[1] * 600], 4)


def test_a_token_outside_the_vocabulary_is_refused(target_ctx: Context) -> None:
    with pytest.raises(ValueError, match=r"token 32000 is outside the vocabulary \(0\.\.31999\)"):
        cpp_generate(target_ctx, [[1, 32000]], 4)


def test_a_non_positive_n_predict_is_refused(target_ctx: Context) -> None:
    with pytest.raises(ValueError, match="n_predict must be in 1"):
        cpp_generate(target_ctx, [[1, 2]], 0)


def test_synthetic_acceptance_without_a_speculative_type_is_refused(target_ctx: Context) -> None:
    with pytest.raises(RefError, match="synthetic acceptance requires an initialized speculative"):
        cpp_generate(target_ctx, [PROMPT], 4, CommonParamsSpeculative(types=[T.NONE], synth_len=2.0))


def test_draft_simple_without_a_draft_context_is_refused(target_ctx: Context) -> None:
    spec = CommonParamsSpeculative(types=[T.DRAFT_SIMPLE])
    with pytest.raises(RefError, match="draft-simple requires a draft context"):
        cpp_generate(target_ctx, [[1, 2]], 4, spec)


def test_more_prompts_than_the_drafts_sequences_is_refused(target_ctx: Context, draft_model: Model) -> None:
    with Context(draft_model, n_ctx=512, n_batch=128, n_seq_max=1) as ctxd:
        spec = CommonParamsSpeculative(types=[T.DRAFT_SIMPLE])
        spec.draft.ctx_dft = ctxd
        with pytest.raises(ValueError, match="exceeds the draft context's n_seq_max 1"):
            cpp_generate(target_ctx, [[1, 2], [1, 3]], 4, spec)


def test_null_pointers_are_refused_by_the_c_api(target_ctx: Context) -> None:
    assert lib.pyspec_loop_generate(ffi.NULL, ffi.NULL) == lib.PYSPEC_REF_E_NULL
    assert b"NULL" in ffi.string(lib.pyspec_ref_last_error())
    p = ffi.new("pyspec_loop_params *")
    r = ffi.new("pyspec_loop_result *")
    assert lib.pyspec_loop_generate(p, r) == lib.PYSPEC_REF_E_NULL
    assert ffi.string(lib.pyspec_ref_last_error()) == b"ctx_tgt is NULL"
    p.ctx_tgt = ffi.cast("struct llama_context *", target_ctx.ptr)
    p.n_seq, p.n_predict = 1, 4
    assert lib.pyspec_loop_generate(p, r) == lib.PYSPEC_REF_E_NULL  # no prompts, no output buffers
    p.n_predict = 0
    assert lib.pyspec_loop_generate(p, r) == lib.PYSPEC_REF_E_RANGE
    assert ffi.string(lib.pyspec_ref_last_error()) == b"n_predict must be positive, got 0"


def test_an_output_buffer_smaller_than_n_predict_is_refused_by_the_c_api(target_ctx: Context) -> None:
    prompt = ffi.new("llama_token[]", [1, 2])
    lens = ffi.new("int32_t[]", [2])
    bufs = [ffi.new("int32_t[]", 8) for _ in range(5)]
    p = ffi.new("pyspec_loop_params *", {"ctx_tgt": ffi.cast("struct llama_context *", target_ctx.ptr), "n_seq": 1,
                                         "prompt_tokens": prompt, "prompt_lens": lens, "n_predict": 8})
    r = ffi.new("pyspec_loop_result *", {"tokens": bufs[0], "tokens_cap": 4, "n_tokens": bufs[1],
                                         "n_drafted": bufs[2], "n_accepted": bufs[3], "stop_reason": bufs[4]})
    assert lib.pyspec_loop_generate(p, r) == lib.PYSPEC_REF_E_CAPACITY
    r.tokens_cap = 8
    assert lib.pyspec_loop_generate(p, r) == lib.PYSPEC_REF_OK
    assert bufs[1][0] == 8 and bufs[4][0] == 2  # eight tokens, stopped at n_predict


def test_a_prompt_longer_than_the_models_training_context_is_refused(target_model: Model) -> None:
    # as the engine: a sequence's context is at most n_ctx_train, however many cells the context has
    n_train = target_model.n_ctx_train
    ctx = Context(target_model, n_ctx=2 * n_train, n_batch=64, n_seq_max=1, **THREADS)
    try:
        with pytest.raises(ValueError, match=f"prompt of {n_train} tokens does not fit the context \\({n_train} per"):
            cpp_generate(ctx, [[1] * n_train], 4)
    finally:
        ctx.close()
