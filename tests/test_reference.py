"""The C++ reference (libpyspec_ref) driven from Python: pyspec.reference.speculative.

Tests named ``test_wrapper_*`` pin the C ABI's own behaviour (csrc/pyspec_ref*.cpp checks
before calling in, where the C++ would assert, abort or silently drop the input), not
upstream's."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from pyspec import Batch, ClosedError, Context, Model
from pyspec.common.params import (
    CommonParamsSampling,
    CommonParamsSpeculative,
    CommonParamsSpeculativeDraft,
    CommonParamsSpeculativeNgramCache,
    CommonParamsSpeculativeNgramMap,
    CommonSamplerType,
    CommonSpeculativeType,
)
from pyspec.common.speculative import DraftRequest
from pyspec.errors import RefError
from pyspec.reference.sampling import RefSampler
from pyspec.reference.speculative import RefSpeculative, spec_type_str
from pyspec.testing import models as testmodels

PATTERN = [101, 102, 103, 104, 105, 106, 107, 108]
PROMPT = PATTERN * 4  # ends with 108: the pattern continues with 101, 102, ...


def ngram_simple_params(size_n: int = 3, size_m: int = 4) -> CommonParamsSpeculative:
    return CommonParamsSpeculative(
        types=[CommonSpeculativeType.NGRAM_SIMPLE],
        ngram_simple=CommonParamsSpeculativeNgramMap(size_n=size_n, size_m=size_m),
    )


@pytest.fixture(scope="module")
def target() -> Iterator[Model]:
    model = Model(testmodels.make_target())
    yield model
    model.close()


@pytest.fixture(scope="module")
def draft_model() -> Iterator[Model]:
    model = Model(testmodels.make_draft())
    yield model
    model.close()


def decode_prompt(ctx: Context, prompt: list[int], seq_id: int = 0) -> Batch:
    batch = Batch(len(prompt), n_seq_max=1)
    batch.add_sequence(prompt, 0, seq_id, logits_last=True)
    ctx.decode(batch)
    return batch


# --- common_speculative ------------------------------------------------------


def test_ngram_simple_drafts_the_continuation_of_a_repetitive_prompt() -> None:
    with RefSpeculative(ngram_simple_params(), n_seq=1) as spec:
        spec.begin(0, PROMPT)
        # id_last is the token the target just sampled: 101 starts the next period
        drafts = spec.draft([DraftRequest(0, -1, len(PROMPT), 101, PROMPT)])
    assert drafts == {0: [102, 103, 104, 105]}


def test_draft_n_max_truncates_the_draft() -> None:
    with RefSpeculative(ngram_simple_params(), n_seq=1) as spec:
        drafts = spec.draft([DraftRequest(0, 2, len(PROMPT), 101, PROMPT)])
    assert drafts == {0: [102, 103]}


def test_no_match_gives_an_empty_draft_and_no_impl_last() -> None:
    prompt = list(range(200, 240))
    with RefSpeculative(ngram_simple_params(), n_seq=1) as spec:
        assert spec.draft([DraftRequest(0, -1, len(prompt), 7, prompt)]) == {0: []}
        assert spec.last_impl_type(0) is None


def test_counters_follow_begin_draft_and_accept() -> None:
    with RefSpeculative(ngram_simple_params(), n_seq=2) as spec:
        assert spec.n_impls() == 1
        (before,) = spec.impl_stats()
        assert before["name"] == "ngram-simple"
        assert before["type"] == CommonSpeculativeType.NGRAM_SIMPLE
        assert before["n_call_draft"] == before["n_gen_drafts"] == before["n_call_accept"] == 0

        spec.begin(1, PROMPT)
        spec.draft([DraftRequest(1, -1, len(PROMPT), 101, PROMPT)])
        assert spec.last_impl_type(1) == CommonSpeculativeType.NGRAM_SIMPLE
        spec.accept(1, 3)

        (after,) = spec.impl_stats()
    assert after["n_call_begin"] == 1
    assert after["n_call_draft"] == 1
    assert after["n_gen_drafts"] == 1
    assert after["n_gen_tokens"] == 4
    assert after["n_call_accept"] == 1
    assert after["n_acc_drafts"] == 1
    assert after["n_acc_tokens"] == 3


def test_implementations_are_listed_in_the_reference_priority_order() -> None:
    params = CommonParamsSpeculative(
        types=[CommonSpeculativeType.NGRAM_MOD, CommonSpeculativeType.NGRAM_MAP_K, CommonSpeculativeType.NGRAM_SIMPLE]
    )
    with RefSpeculative(params, n_seq=1) as spec:
        names = [s["name"] for s in spec.impl_stats()]
    assert names == ["ngram-simple", "ngram-map-k", "ngram-mod"]


def test_ngram_implementations_have_no_state_and_their_own_n_max() -> None:
    # common_speculative_need_embd[_nextn] are gone at this pin; get/set_state are new
    with RefSpeculative(ngram_simple_params(), n_seq=1) as spec:
        assert spec.get_state(0) is None
        spec.set_state(0, b"\x00" * 8)  # no implementation keeps a state: ignored, as upstream
        assert spec.get_state(0) is None
        assert spec.n_max_effective() == spec.n_max


def test_wrapper_refuses_accept_without_a_draft_where_the_cpp_asserts() -> None:
    with RefSpeculative(ngram_simple_params(), n_seq=1) as spec:
        with pytest.raises(RefError, match="impl_last"):
            spec.accept(0, 1)


def test_wrapper_refuses_a_seq_id_out_of_range() -> None:
    with RefSpeculative(ngram_simple_params(), n_seq=1) as spec:
        with pytest.raises(ValueError):
            spec.begin(1, PROMPT)
        with pytest.raises(ValueError):
            spec.draft([DraftRequest(3, -1, 0, 0, [])])


def test_no_implementation_raises_and_init_returns_none() -> None:
    params = CommonParamsSpeculative(types=[CommonSpeculativeType.NONE])
    with pytest.raises(RuntimeError, match="no implementations"):
        RefSpeculative(params, n_seq=1)
    assert RefSpeculative.init(params, n_seq=1) is None


def test_draft_simple_without_a_draft_context_throws_the_cpp_message() -> None:
    # 0c1e57098's constructor throws for a missing ctx_dft itself (the wrapper refused it before)
    params = CommonParamsSpeculative(types=[CommonSpeculativeType.DRAFT_SIMPLE])
    with pytest.raises(RuntimeError, match="draft-simple requires a draft context"):
        RefSpeculative(params, n_seq=1)


def test_wrapper_refuses_a_missing_lookup_cache_with_the_cpp_abort_message() -> None:
    params = CommonParamsSpeculative(
        types=[CommonSpeculativeType.NGRAM_CACHE],
        ngram_cache=CommonParamsSpeculativeNgramCache(lookup_cache_static="/nonexistent/lookup.bin"),
    )
    with pytest.raises(RuntimeError, match="Couldn't read static lookup cache"):
        RefSpeculative(params, n_seq=1)


def test_type_names_match_the_reference() -> None:
    assert spec_type_str(CommonSpeculativeType.DRAFT_MTP) == "draft-mtp"
    assert spec_type_str(CommonSpeculativeType.NGRAM_MAP_K4V) == "ngram-map-k4v"
    assert spec_type_str(99) == ""


def test_every_call_after_close_raises() -> None:
    spec = RefSpeculative(ngram_simple_params(), n_seq=1)
    spec.close()
    with pytest.raises(ClosedError):
        spec.begin(0, PROMPT)
    with pytest.raises(ClosedError):
        spec.impl_stats()


def test_draft_simple_with_a_different_draft_n_seq_raises_the_reference_message(
    target: Model, draft_model: Model
) -> None:
    with Context(target, n_ctx=256, n_batch=64, n_seq_max=2) as ctx_tgt, Context(
        draft_model, n_ctx=256, n_batch=64, n_seq_max=1
    ) as ctx_dft:
        params = CommonParamsSpeculative(
            types=[CommonSpeculativeType.DRAFT_SIMPLE],
            draft=CommonParamsSpeculativeDraft(ctx_tgt=ctx_tgt, ctx_dft=ctx_dft),
        )
        with pytest.raises(
            RuntimeError, match="the draft model number of sequences is incompatible with the speculative n_seq"
        ):
            RefSpeculative(params, n_seq=2)


def test_draft_simple_drafts_n_max_tokens_deterministically(target: Model, draft_model: Model) -> None:
    prompt = PROMPT[:12]
    results = []
    for _ in range(2):
        with Context(target, n_ctx=256, n_batch=64) as ctx_tgt, Context(draft_model, n_ctx=256, n_batch=64) as ctx_dft:
            params = CommonParamsSpeculative(
                types=[CommonSpeculativeType.DRAFT_SIMPLE],
                draft=CommonParamsSpeculativeDraft(n_max=3, ctx_tgt=ctx_tgt, ctx_dft=ctx_dft),
            )
            with RefSpeculative(params, n_seq=1) as spec:
                # the draft context learns the prompt through process(), as in the server
                batch = Batch(len(prompt) - 1)
                batch.add_sequence(prompt[:-1], 0, 0, logits_last=False)
                assert spec.process(batch) is True
                drafts = spec.draft([DraftRequest(0, -1, len(prompt) - 1, prompt[-1], prompt)])
                (stats,) = spec.impl_stats()
        results.append(drafts[0])
        assert len(drafts[0]) == 3
        assert all(0 <= t < target.vocab.n_tokens for t in drafts[0])
        assert stats["n_gen_tokens"] == 3
    assert results[0] == results[1]


# --- common_sampler ----------------------------------------------------------


def greedy_params(seed: int = 42) -> CommonParamsSampling:
    return CommonParamsSampling(seed=seed, top_k=1, samplers=[CommonSamplerType.TOP_K])


def test_sampler_with_top_k_1_picks_the_argmax(target: Model) -> None:
    with Context(target, n_ctx=128, n_batch=64) as ctx, RefSampler(target, greedy_params()) as smpl:
        decode_prompt(ctx, PROMPT[:10])
        token = smpl.sample(ctx, -1)
        assert token == int(np.argmax(ctx.get_logits_ith(-1)))

        cand = smpl.candidates(do_sort=True)
        assert cand.ids[cand.selected] == token
        assert cand.sorted

        smpl.accept(token, True)
        assert smpl.last() == token
        assert smpl.get_seed() == 42


def test_sample_and_accept_n_stops_at_the_first_mismatch(target: Model) -> None:
    with Context(target, n_ctx=128, n_batch=64) as ctx, RefSampler(target, greedy_params()) as smpl:
        batch = Batch(4)
        for i, t in enumerate(PROMPT[:4]):
            batch.add(t, i, 0, True)
        ctx.decode(batch)
        best = [int(np.argmax(ctx.get_logits_ith(i))) for i in range(4)]
        wrong = (best[1] + 1) % target.vocab.n_tokens
        # draft: right, wrong, anything -> the reference keeps best[0], then samples best[1] and stops
        out = smpl.sample_and_accept_n(ctx, [best[0], wrong, 5])
        assert out == [best[0], best[1]]
        smpl.reset()
        assert smpl.sample_and_accept_n(ctx, [best[1]], idxs=[1, 2]) == [best[1], best[2]]


def test_wrapper_sampler_guards_where_the_cpp_aborts(target: Model) -> None:
    with Context(target, n_ctx=128, n_batch=64) as ctx, RefSampler(target, greedy_params()) as smpl:
        with pytest.raises(RefError):
            smpl.last()  # nothing accepted yet: the reference throws
        with pytest.raises(RefError):
            smpl.candidates()  # nothing sampled yet
        decode_prompt(ctx, PROMPT[:4])
        with pytest.raises(RefError, match="no output"):
            smpl.sample(ctx, 2)  # only the last token has logits
        with pytest.raises(RefError):
            smpl.accept(target.vocab.n_tokens, True)


def test_wrapper_refuses_sampler_configurations_the_cpp_would_drop_or_abort_on(target: Model) -> None:
    # the wrapper's checks: common_sampler_init itself drops a grammar that does not parse (and samples
    # without it), and asserts on an unknown sampler type or mirostat version; the grammar check is
    # the one both engines run (a ValueError, as the port's)
    with pytest.raises(ValueError, match="grammar refused: failed to parse"):
        RefSampler(target, CommonParamsSampling(grammar="root ::= ("))
    with pytest.raises(RuntimeError, match="sampler type"):
        RefSampler(target, CommonParamsSampling(samplers=[5]))  # type: ignore[list-item]
    with pytest.raises(RuntimeError, match="mirostat"):
        RefSampler(target, CommonParamsSampling(mirostat=3))


def test_grammar_turns_backend_sampling_off(target: Model) -> None:
    with RefSampler(target, CommonParamsSampling(grammar='root ::= "a"', backend_sampling=True)) as smpl:
        assert smpl.backend_sampling is False



def test_wrapper_refuses_draft_simple_without_a_target_where_the_cpp_would_crash(draft_model: Model) -> None:
    with Context(draft_model, n_ctx=256, n_batch=32, n_ubatch=32, n_seq_max=1) as ctx:
        params = CommonParamsSpeculative(types=[CommonSpeculativeType.DRAFT_SIMPLE])
        params.draft.ctx_dft = ctx  # the constructor reads the target's model (llama_get_model(NULL))
        with pytest.raises(RuntimeError, match="draft-simple requires ctx_tgt and ctx_dft to be set"):
            RefSpeculative(params, n_seq=1)


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_dflash_and_dspark_run_in_the_reference_and_their_asserts_are_refused(kind: str) -> None:
    md = pytest.importorskip("pyspec.testing.models_dflash")
    succ, cycles = testmodels.cyclic_successor()
    typ = CommonSpeculativeType.DRAFT_DFLASH if kind == "dflash" else CommonSpeculativeType.DRAFT_DSPARK
    maker = md.make_cyclic_dflash if kind == "dflash" else md.make_cyclic_dspark
    with Model(testmodels.make_cyclic_target()) as mt, Model(maker()) as mdft:
        for n_ubatch in (64, 8):
            with (Context(mt, n_ctx=512, n_batch=64, n_ubatch=64, n_seq_max=2) as ctx_tgt,
                  Context(mdft, n_ctx=512, n_batch=64, n_ubatch=n_ubatch, n_seq_max=2) as ctx_dft):
                params = CommonParamsSpeculative(types=[typ])
                params.draft.n_max, params.draft.backend_sampling = 8, False
                params.draft.ctx_tgt, params.draft.ctx_dft = ctx_tgt, ctx_dft
                if n_ubatch == 8:  # the non-causal noise batch must fit one ubatch (GGML_ASSERT)
                    with pytest.raises(RuntimeError, match="blocks of 8 tokens exceed the draft context's"):
                        RefSpeculative(params, n_seq=2)
                    continue
                with RefSpeculative(params, n_seq=2) as spec:
                    prompts = [[1] + [cycles[s][i % len(cycles[s])] for i in range(10 + s)] for s in range(2)]
                    batch = Batch(64, 0, 2)
                    for s, prompt in enumerate(prompts):
                        for i, t in enumerate(prompt):
                            batch.add(t, i, s, i == len(prompt) - 1)
                    ctx_tgt.decode(batch)
                    assert spec.process(batch)  # the target features injected into the draft KV cache
                    drafts = spec.draft([DraftRequest(s, 8, len(p), int(succ[p[-1]]), p)
                                         for s, p in enumerate(prompts)])
                    assert all(1 <= len(d) <= 8 for d in drafts.values())


def test_types_from_gguf_agrees_with_the_port(tmp_path) -> None:
    from pyspec.common.speculative import common_speculative_types_from_gguf
    from pyspec.reference.speculative import spec_types_from_gguf

    paths = [testmodels.make_target(), testmodels.make_draft(), testmodels.make_mtp(), testmodels.make_eagle3()]
    md = pytest.importorskip("pyspec.testing.models_dflash")
    paths += [md.make_cyclic_dflash(), md.make_cyclic_dspark()]
    not_gguf = tmp_path / "not.gguf"
    not_gguf.write_bytes(b"not a gguf file")
    for path in [*paths, not_gguf, tmp_path / "missing.gguf"]:
        assert spec_types_from_gguf(path) == [int(t) for t in common_speculative_types_from_gguf(path)], path
    assert spec_types_from_gguf(testmodels.make_mtp()) == [int(CommonSpeculativeType.DRAFT_MTP)]


def test_types_from_gguf_refuses_what_upstream_asserts_on(tmp_path) -> None:
    import gguf

    path = tmp_path / "no-block-count.gguf"
    w = gguf.GGUFWriter(str(path), "llama")  # general.architecture, but no llama.block_count
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    from pyspec.reference.speculative import spec_types_from_gguf

    with pytest.raises(RefError, match=r"GGUF_TYPE_UINT32\) failed: llama.block_count"):
        spec_types_from_gguf(path)


@pytest.mark.parametrize("synth", [{"synth_len": 2.5}, {"synth_rates": [0.9, 0.5, 0.25, 0.1]}, {}])
def test_synthetic_acceptance_probs_agree_with_the_port(synth: dict) -> None:
    from pyspec.common.speculative import common_speculative_init

    params = ngram_simple_params()
    for k, v in synth.items():
        setattr(params, k, v)
    port = common_speculative_init(params, 1)
    assert port is not None
    with RefSpeculative(params, n_seq=1) as spec:
        assert spec.synth_probs() == pytest.approx(list(port.synth_probs), abs=0.0)
        assert bool(spec.synth_probs()) == bool(synth)


def test_synthetic_acceptance_errors_are_the_cpp_exceptions() -> None:
    params = ngram_simple_params()
    params.synth_len, params.synth_rates = 2.0, [0.5]  # mutually exclusive: invalid_argument
    with pytest.raises(RuntimeError, match="mutually exclusive"):
        RefSpeculative(params, n_seq=1)


def test_sampler_copy_restores_a_saved_state_within_its_family(target: Model) -> None:
    # common_sampler_copy (new at 0c1e57098): the server's restore of a sampler saved before a verify
    with RefSampler(target, greedy_params()) as smpl, RefSampler(target, greedy_params()) as other:
        smpl.accept(5, True)
        with smpl.clone() as saved:
            smpl.accept(7, True)
            assert smpl.last() == 7
            smpl.copy_from(saved)
            assert smpl.last() == 5
        with pytest.raises(RefError, match="same structure"):  # another init: the C++ would GGML_ASSERT
            other.copy_from(smpl)
