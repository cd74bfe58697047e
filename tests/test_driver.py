"""The generation driver on the tiny models: every type, several sequences, stops, streaming, checkpoints."""

from __future__ import annotations

import pytest

from pyspec import Context, Model, PyspecError
from pyspec.common.params import CommonParamsSampling, CommonParamsSpeculative
from pyspec.common.params import CommonSpeculativeType as T
from pyspec.core.backend import default_offload_devices
from pyspec.generation.contexts import ModelSet, open_contexts
from pyspec.generation.driver import SpeculativeGenerator, generate, greedy_sampling
from pyspec.testing import models as tm

PROMPTS = [
    "def fib(n):\n    return fib(n - 1) + fib(n - 2)\n" * 2,
    "The quick brown fox jumps over the lazy dog.",
    "int main() { return 0; }",
]
NGRAM_TYPES = [T.NGRAM_SIMPLE, T.NGRAM_MAP_K, T.NGRAM_MAP_K4V, T.NGRAM_MOD, T.NGRAM_CACHE]


@pytest.fixture(scope="module")
def models():
    # the cyclic target's greedy output repeats, so every type finds drafts that get accepted
    paths = {
        "target": tm.make_cyclic_target(), "draft": tm.make_cyclic_draft(), "eagle3": tm.make_cyclic_eagle3(),
        "mtp": tm.make_mtp(),
    }
    ms = {k: Model(p) for k, p in paths.items()}
    yield ms
    for m in ms.values():
        m.close()


def on_cpu() -> dict:
    """Model keywords for the CPU backend, whose numerics keep speculation lossless on these models.

    An accelerator build (scripts/vulkan_check.sh) puts the models on the device, where a row's
    logits may depend on its batch (batch-invariant mode covers the CPU backend only);
    test_devices compares each type's run on the device with the CPU's instead."""
    return {"devices": []} if default_offload_devices() else {}


def setup(type_contexts, t: T, n_seq: int, n_max: int = 4, n_rs_seq: int | None = None, model_kw=None):
    """Target context, draft context (or None) and params for one speculative type, by the library's builder
    (open_contexts) on the tiny cyclic models; n_rs_seq=0 gives an MTP target no recurrent states."""
    p = CommonParamsSpeculative(types=[t])
    p.draft.n_max = n_max
    for m in (p.ngram_simple, p.ngram_map_k, p.ngram_map_k4v):
        m.size_n, m.size_m = 2, 6
    p.ngram_mod.n_match, p.ngram_mod.n_min, p.ngram_mod.n_max = 2, 1, 6
    assert n_rs_seq in (None, 0)  # the builder gives an MTP target n_max states, or none (checkpoints)
    cs = type_contexts(p, n_ctx=256, n_batch=64, n_ubatch=32, n_seq=n_seq, mtp_checkpoint=n_rs_seq == 0,
                       model_kw=model_kw)
    return cs.ctx_tgt, p


def plain_greedy(ctx: Context, prompts, n_predict: int):
    with SpeculativeGenerator(ctx, None, greedy_sampling(), n_seq=len(prompts)) as g:
        return [r.tokens for r in g.generate(prompts, n_predict)]


ALL_TYPES = [T.DRAFT_SIMPLE, T.DRAFT_EAGLE3, T.DRAFT_MTP, *NGRAM_TYPES]


@pytest.mark.parametrize("n_seq", [1, 3])
@pytest.mark.parametrize("t", ALL_TYPES, ids=lambda t: t.name.lower())
def test_greedy_speculation_equals_plain_greedy_decoding(type_contexts, t, n_seq):
    ctx, p = setup(type_contexts, t, n_seq, model_kw=on_cpu())
    # prompts that already hold the start of the target's own continuation, as a chat
    # history does: the n-gram types draft from the prompt before their tables fill up
    base = [ctx.model.vocab.tokenize(text) for text in PROMPTS[:n_seq]]
    prompts = [b + w for b, w in zip(base, plain_greedy(ctx, base, 20), strict=False)]
    expected = plain_greedy(ctx, prompts, 32)
    # llama.cpp's fixed draft lengths, so that drafts are verified whatever this machine's costs
    with SpeculativeGenerator(ctx, p, greedy_sampling(), adaptive_draft=False) as g:
        results = g.generate(prompts, 32)
        stats = g.stats
    assert [len(r.tokens) for r in results] == [32] * n_seq
    assert all(r.stop_reason == "n_predict" for r in results)
    assert [r.tokens for r in results] == expected
    assert stats.n_gen_tokens == 32 * n_seq
    assert 0 <= stats.n_accepted <= stats.n_drafted
    assert stats.n_drafted > 0
    if n_seq == 1:
        assert stats.n_accepted > 0


def test_draft_equal_to_target_accepts_every_draft_token(models):
    p = CommonParamsSpeculative(types=[T.DRAFT_SIMPLE])
    p.draft.n_max = 5
    # draft-simple without a draft model: the builder's second context on the target's own weights
    with open_contexts(ModelSet(models["target"]), p, n_ctx=512, n_batch=64) as cs:
        # llama.cpp's fixed draft length (the cost-aware one would see that these drafts cost a decode each)
        _res, stats = generate(cs.ctx_tgt, PROMPTS[0], 48, spec=p, adaptive_draft=False)
    assert stats.n_drafted > 20
    assert stats.n_accepted == stats.n_drafted
    # each step verifies up to 5 drafts and adds the target's own token
    assert stats.n_steps <= 48 // 6 + 2


@pytest.mark.parametrize("t", [T.DRAFT_EAGLE3, T.DRAFT_MTP], ids=["eagle3", "mtp"])
@pytest.mark.parametrize("n_seq", [1, 2])
def test_draft_context_positions_follow_the_target(type_contexts, t, n_seq):
    # EAGLE3 defers the last position of each batch to the next draft; MTP mirrors every position
    lag = 1 if t == T.DRAFT_EAGLE3 else 0
    ctx, p = setup(type_contexts, t, n_seq, n_max=3)
    seen = []

    def on_event(name, data):
        if name == "process":
            for seq, (_, tgt_max) in data["tgt_pos"].items():
                if tgt_max >= 0:
                    seen.append(tgt_max - data["dft_pos"][seq][1])

    with SpeculativeGenerator(ctx, p, greedy_sampling(), on_event=on_event) as g:
        g.generate([PROMPTS[0] * 2, PROMPTS[1]][:n_seq], 40)
        assert g.stats.n_steps >= 10
    assert len(seen) >= 10 * n_seq
    assert set(seen) == {lag}


def test_stochastic_sampling_is_reproducible_with_a_seed(type_contexts):
    sampling = CommonParamsSampling(seed=1234, temp=0.8)
    runs = []
    for _ in range(2):
        ctx, p = setup(type_contexts, T.DRAFT_SIMPLE, 1)
        with SpeculativeGenerator(ctx, p, sampling) as g:
            runs.append(g.generate([PROMPTS[1]], 24)[0].tokens)
    assert runs[0] == runs[1] and len(runs[0]) == 24


def test_stop_string_ends_generation_and_is_not_returned(type_contexts):
    ctx, p = setup(type_contexts, T.NGRAM_SIMPLE, 1)
    with SpeculativeGenerator(ctx, p) as g:
        full = g.generate([PROMPTS[1]], 24)[0].text
        word = full[len(full) // 2 : len(full) // 2 + 3]
        assert word.strip()
        res = g.generate([PROMPTS[1]], 24, stop=[word])[0]
    assert res.stop_reason == "stop"
    assert res.text == full[: full.index(word)]


def test_end_of_generation_token_stops(models, type_contexts):
    ctx, p = setup(type_contexts, T.NGRAM_MOD, 1)
    eos = models["target"].vocab.eos
    sampling = CommonParamsSampling(top_k=1, samplers=[], logit_bias=[(eos, 1000.0)])
    with SpeculativeGenerator(ctx, p, sampling) as g:
        res = g.generate([PROMPTS[2]], 24)[0]
    assert res.stop_reason == "eog"
    assert res.tokens == [eos] and res.text == ""


def test_streamed_pieces_concatenate_to_the_final_text(type_contexts):
    ctx, p = setup(type_contexts, T.DRAFT_SIMPLE, 1)
    with SpeculativeGenerator(ctx, p) as g:
        pieces = list(g.stream(PROMPTS[0], 40))
        text = g.generate([PROMPTS[0]], 40)[0].text
    assert len(pieces) > 5
    assert "".join(pieces) == text


def test_callback_pieces_concatenate_per_sequence(type_contexts):
    ctx, p = setup(type_contexts, T.NGRAM_MAP_K, 2)
    got: dict[int, str] = {0: "", 1: ""}

    def on_piece(seq, text):
        got[seq] += text

    with SpeculativeGenerator(ctx, p) as g:
        results = g.generate(PROMPTS[:2], 30, on_piece=on_piece)
    assert [got[0], got[1]] == [r.text for r in results]


def test_hybrid_target_without_rollback_uses_checkpoints(models, type_contexts):
    # qwen35 is hybrid (recurrent + attention); with n_rs_seq = 0 its memory cannot drop
    # part of a sequence, so partial acceptance is undone through state checkpoints
    ctx, p = setup(type_contexts, T.DRAFT_MTP, 1, n_max=3, n_rs_seq=0)
    # fixed draft lengths: the cost-aware choice depends on the machine's timings, and under
    # load it may verify no draft at all (CI saw 0 restores so)
    with SpeculativeGenerator(ctx, p, greedy_sampling(), adaptive_draft=False) as g:
        assert g.ctx_tgt_seq_rm_type == 2  # COMMON_CONTEXT_SEQ_RM_TYPE_FULL
        res = g.generate([PROMPTS[0]], 40)[0]
        restores = g.stats.n_checkpoint_restores
    assert restores > 0
    plain_ctx = Context(models["mtp"], n_ctx=256, n_batch=64, n_ubatch=32)
    assert res.tokens == plain_greedy(plain_ctx, [PROMPTS[0]], 40)[0]


def test_bad_generation_arguments_raise(type_contexts):
    ctx, p = setup(type_contexts, T.NGRAM_SIMPLE, 1)
    with SpeculativeGenerator(ctx, p) as g:
        with pytest.raises(ValueError, match="n_predict"):
            g.generate(["x"], 0)
        with pytest.raises(ValueError, match="prompts"):
            g.generate(["a", "b"], 4)
        with pytest.raises(ValueError, match="empty prompt"):
            g.generate([[]], 4)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            g.generate([[1, 10**6]], 4)
        with pytest.raises(ValueError, match="does not fit"):
            g.generate([[5] * 300], 4)
    with pytest.raises(PyspecError, match="no implementations"):
        SpeculativeGenerator(ctx, CommonParamsSpeculative(types=[T.DRAFT_EAGLE3]))
