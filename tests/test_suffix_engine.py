"""The suffix type in the Engine: lossless in batch-invariant mode, drafts on repeated text, the global index
shared across requests, Engine.load's type names, and the C++ side's refusal."""

from __future__ import annotations

import pytest
from test_lossless import SAMPLINGS, tiny, tiny_plain  # noqa: F401  (the fixtures, shared)

from pyspec import Context, Model
from pyspec.common.params import CommonParamsSpeculative
from pyspec.common.params import CommonSpeculativeType as T
from pyspec.generation.backends import PortBackend
from pyspec.generation.contexts import ModelSet, open_contexts, spec_params
from pyspec.generation.engine import Engine, greedy_sampling
from pyspec.generation.requests import Request
from pyspec.suffix import SuffixImpl, SuffixParams
from pyspec.testing import models as tm

REPEAT = "def fib(n):\n    return fib(n - 1) + fib(n - 2)\n" * 3


@pytest.fixture(scope="module")
def chat_model():
    with Model(tm.make_chat_target()) as m:
        yield m


def suffix_engine(model: Model, n_parallel: int = 2, spec: CommonParamsSpeculative | None = None,
                  suffix: SuffixParams | None = None, **kw) -> Engine:
    ctx = Context(model, n_ctx=256 * n_parallel, n_batch=64, n_ubatch=64, n_seq_max=n_parallel,
                  n_threads=1, n_threads_batch=1)
    return Engine(ctx, spec, greedy_sampling(), n_parallel=n_parallel, owned=[ctx], adaptive_draft=False,
                  suffix=suffix or SuffixParams(), **kw)


def suffix_impl(eng: Engine) -> SuffixImpl:
    backend = eng.backend
    assert isinstance(backend, PortBackend) and backend.spec is not None
    impl = backend.spec.impls[0]
    assert isinstance(impl, SuffixImpl)
    return impl


def run(eng: Engine, prompts, n_predict: int):
    hs = [eng.submit(Request(prompt=p, n_predict=n_predict)) for p in prompts]
    eng.run_until_idle()
    return [h.result() for h in hs]


# --- lossless: the grid of test_lossless.py, on the Engine with the suffix type ------------------------


@pytest.mark.parametrize("sampling", sorted(SAMPLINGS))
@pytest.mark.parametrize("n_seq", [1, 3])
@pytest.mark.parametrize("with_ngram", [False, True], ids=["suffix", "suffix_ngram_mod"])
def test_suffix_output_is_plain_decoding_on_the_tiny_models(tiny, tiny_plain, n_seq, sampling, with_ngram):  # noqa: F811
    prompts, expected = tiny_plain("target", sampling)
    spec = spec_params([T.NGRAM_MOD] if with_ngram else [T.NONE], n_max=5)
    spec.ngram_mod.n_min = 1
    with open_contexts(ModelSet(tiny["target"]), spec, n_ctx=256, n_batch=96, n_ubatch=32, n_seq=n_seq) as cs, \
            Engine(cs.ctx_tgt, spec if with_ngram else None, SAMPLINGS[sampling](), n_parallel=n_seq,
                   adaptive_draft=False, suffix=SuffixParams(n_max=5)) as eng:
        results = run(eng, prompts[:n_seq], 24)
        names = [i.name for i in eng.backend.impl_stats()]
    assert [r.tokens for r in results] == expected[:n_seq]
    assert sum(r.stats.spec.n_drafts for r in results) > 0  # verification ran on drafts
    assert names == (["suffix", "ngram-mod"] if with_ngram else ["suffix"])


# --- drafting ----------------------------------------------------------------------------------------


def test_a_repeated_text_prompt_gets_suffix_drafts_accepted(chat_model):
    with suffix_engine(chat_model, 1) as eng:
        (r,) = run(eng, [REPEAT], 24)
        (st,) = eng.backend.impl_stats()
    assert st.name == "suffix"
    assert r.stats.spec.n_accepted_tokens > 0 and st.n_acc_tokens == r.stats.spec.n_accepted_tokens


def test_a_requests_decodes_are_counted(chat_model):
    with suffix_engine(chat_model, 1) as eng:
        n0 = eng.n_steps
        h = eng.submit(Request(prompt=REPEAT, n_predict=40))
        eng.run_until_idle()
        r = h.result()
        # the engine's decodes: the prompt's (n_batch 64 a decode), then the request's generation
        assert eng.n_steps - n0 == -(-r.stats.n_prompt // 64) + r.stats.n_steps
        assert eng.n_checkpoint_restores == 0
    st = r.stats
    assert r.stop_reason == "n_predict" and st.spec.n_drafts > 0
    # each decode gave its accepted tokens and one of its own; the prompt's last decode the first token
    assert st.n_steps + 1 == st.n_gen - st.spec.n_accepted_tokens


def test_a_second_request_drafts_from_the_global_index_of_the_first_ones_output(chat_model):
    with suffix_engine(chat_model, 2) as eng:
        (first,) = run(eng, ["The quick brown fox jumps over the lazy dog."], 32)
        # the finished request's output is in the engine's global index now, not at its slot's next request
        assert eng.suffix_index is not None and len(eng.suffix_index) > 0
        impl = suffix_impl(eng)
        assert impl.stats()["n_draft_global"] == 0
        # another prompt that ends with the start of that output: only the global index has its continuation
        prompt = chat_model.vocab.tokenize("int main() { return 0; }") + first.tokens[:6]
        (second,) = run(eng, [prompt], 16)
        assert impl.stats()["n_draft_global"] > 0
    assert second.stats.spec.n_accepted_tokens > 0


def test_the_global_index_is_one_per_engine_and_off_at_zero_tokens(chat_model):
    with suffix_engine(chat_model, 2) as a, suffix_engine(chat_model, 1) as b:
        assert a.suffix_index is not b.suffix_index
        assert suffix_impl(a).shared is a.suffix_index
    with suffix_engine(chat_model, 1, suffix=SuffixParams(max_global_tokens=0)) as eng:
        assert eng.suffix_index is None
        (r,) = run(eng, [REPEAT], 16)
    assert r.stats.spec.n_drafts > 0  # the local index drafts alone


def test_the_engines_draft_length_covers_the_suffix_types_n_max(chat_model):
    spec = CommonParamsSpeculative(types=[T.NGRAM_SIMPLE])
    spec.ngram_simple.size_n, spec.ngram_simple.size_m = 2, 6
    with suffix_engine(chat_model, 1, spec=spec, suffix=SuffixParams(n_max=20)) as eng:
        assert eng.spec_n_max == 20
        assert [i.name for i in eng.backend.impl_stats()] == ["suffix", "ngram-simple"]


# --- construction --------------------------------------------------------------------------------------


def test_the_cpp_backend_refuses_the_suffix_type(chat_model):
    ctx = Context(chat_model, n_ctx=256, n_batch=64)
    try:
        with pytest.raises(ValueError, match="the suffix type has no C\\+\\+ reference; use backend='python'"):
            Engine(ctx, None, greedy_sampling(), backend="cpp", suffix=SuffixParams())
    finally:
        ctx.close()


def test_engine_load_takes_suffix_among_the_type_names():
    path = tm.make_chat_target()
    with Engine.load(path, types="suffix,ngram-simple", n_ctx=256, n_batch=64, n_max=7, n_threads=1,
                     adaptive_draft=False) as eng:
        assert eng.suffix == SuffixParams(n_max=7)
        assert [i.name for i in eng.backend.impl_stats()] == ["suffix", "ngram-simple"]
    with Engine.load(path, types="suffix", n_ctx=256, n_batch=64, n_threads=1) as eng:
        assert eng.spec_params is None and eng.suffix == SuffixParams()
        assert [i.name for i in eng.backend.impl_stats()] == ["suffix"]
        (r,) = run(eng, [REPEAT], 16)
    assert r.stats.n_gen == 16


def test_engine_refuses_suffix_parameters_of_another_type(chat_model):
    ctx = Context(chat_model, n_ctx=256, n_batch=64)
    try:
        with pytest.raises(TypeError, match="SuffixParams"):
            Engine(ctx, None, greedy_sampling(), suffix={"n_max": 4})  # type: ignore[arg-type]
    finally:
        ctx.close()


def test_the_cost_aware_length_keeps_the_suffix_types_acceptance_per_match_length(chat_model):
    # the controller is told each suffix draft's class (its match length) and learns each class apart
    ctx = Context(chat_model, n_ctx=512, n_batch=64, n_ubatch=64, n_seq_max=1, n_threads=1, n_threads_batch=1)
    with Engine(ctx, None, greedy_sampling(), n_parallel=1, owned=[ctx], adaptive_draft=True,
                suffix=SuffixParams()) as eng:
        run(eng, [REPEAT], 48)
        assert eng.draft_ctl is not None
        impls = eng.draft_ctl.summary()["impls"]
    classes = {k.split()[1] for k in impls if k.startswith("suffix ")}
    assert classes and classes <= {"m1", "m2", "m4", "m8", "m16"}
    assert sum(v["drafts"] for k, v in impls.items() if k.startswith("suffix ")) > 0
