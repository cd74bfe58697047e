"""pyspec.testing.models_dflash writes the tiny DFlash / DSpark drafters: cached, with the metadata and
tensors llama.cpp's ``dflash`` architecture reads, classified as draft-dflash / draft-dspark, and loaded
by the pinned llama.cpp.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pyspec.testing import models as testmodels
from pyspec.testing import models_dflash as md


def _have_llama_cpp() -> bool:
    try:
        testmodels.llama_cpp_dir()
    except FileNotFoundError:
        return False
    return True


pytestmark = pytest.mark.skipif(
    not _have_llama_cpp(), reason="vendored llama.cpp missing: run scripts/fetch_llama.py"
)

N_VOCAB = 32000  # ggml-vocab-llama-spm.gguf


def _have_libraries() -> bool:
    from pyspec.ffi import lib_path

    return lib_path("llama").is_file()


needs_libraries = pytest.mark.skipif(not _have_libraries(), reason="pyspec's libraries are not built")


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module")
def models(cache: Path) -> dict[str, Path]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYSPEC_MODEL_CACHE", str(cache))
        out = md.make_all_dflash()
        out["cyclic-target"] = testmodels.make_cyclic_target()
        out["cyclic-eagle3"] = testmodels.make_cyclic_eagle3()
        out["mtp"] = testmodels.make_mtp()
        return out


@pytest.fixture(scope="module")
def readers(models: dict[str, Path]) -> dict[str, Any]:
    gguf = testmodels.gguf_module()
    return {name: gguf.GGUFReader(path) for name, path in models.items()}


def kv(reader: Any, key: str) -> Any:
    field = reader.get_field(key)
    assert field is not None, f"missing key {key}"
    return field.contents()


def tensor_ne(reader: Any) -> dict[str, list[int]]:
    """{name: ggml ne} of every tensor."""
    return {t.name: [int(n) for n in t.shape] for t in reader.tensors}


def types_from_gguf(reader: Any) -> list[str]:
    """common_speculative_types_from_gguf (speculative.cpp) over gguf-py's reader, statement for statement."""
    field = reader.get_field("general.architecture")
    if field is None or field.types != [testmodels.gguf_module().GGUFValueType.STRING]:
        return []
    arch = field.contents()
    names = set(tensor_ne(reader))
    if arch != "dflash":
        block_count = kv(reader, f"{arch}.block_count")
        if f"blk.{block_count - 1}.nextn.eh_proj.weight" in names:
            return ["draft-mtp"]
        return []
    # the Markov head distinguishes draft-dspark from draft-dflash
    return ["draft-dspark" if "markov_w1.weight" in names else "draft-dflash"]


# --- files and cache -------------------------------------------------------


DRAFTERS = ("cyclic-dflash", "cyclic-dspark", "cyclic-dspark-bonus", "cyclic-dflash-shared")
DSPARKS = ("cyclic-dspark", "cyclic-dspark-bonus")


def test_makers_write_into_the_cache_folder_once(models: dict[str, Path], cache: Path) -> None:
    for name in DRAFTERS:
        path = models[name]
        assert path.parent == cache and path.is_file()
        assert name in path.name and md.DFLASH_GENERATOR_VERSION in path.name
        assert testmodels.GENERATOR_VERSION in path.name
    stamps = {name: models[name].stat().st_mtime_ns for name in DRAFTERS}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYSPEC_MODEL_CACHE", str(cache))
        again = md.make_all_dflash()
    assert {name: again[name].stat().st_mtime_ns for name in stamps} == stamps


def test_makers_are_deterministic(models: dict[str, Path], tmp_path: Path) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYSPEC_MODEL_CACHE", str(tmp_path))
        md._dflash_tensors.cache_clear()
        fresh = md.make_all_dflash()
    for name, path in fresh.items():
        assert path.read_bytes() == models[name].read_bytes(), name


# --- what llama_model_dflash::load_arch_hparams / load_arch_tensors read ------


@pytest.mark.parametrize("name", DRAFTERS)
def test_metadata_the_dflash_loader_reads(readers: dict[str, Any], name: str) -> None:
    r = readers[name]
    assert kv(r, "general.architecture") == md.DFLASH_ARCH == "dflash"
    assert kv(r, "dflash.target_layers") == list(md.DFLASH_TARGET_LAYERS)
    assert r.get_field("dflash.target_layers").types[-1] == testmodels.gguf_module().GGUFValueType.INT32
    assert kv(r, "dflash.block_size") == md.DFLASH_BLOCK_SIZE
    assert kv(r, "tokenizer.ggml.mask_token_id") == md.DFLASH_MASK_TOKEN
    assert kv(r, "dflash.attention.layer_norm_rms_epsilon") > 0
    # the draft's n_embd must be the target's: the encoder input is n_layers * n_embd of the draft,
    # the rows speculative.cpp sends are n_layers * n_embd of the target
    assert kv(r, "dflash.embedding_length") == kv(readers["cyclic-target"], "llama.embedding_length")
    assert all(0 <= il < kv(readers["cyclic-target"], "llama.block_count") for il in md.DFLASH_TARGET_LAYERS)


def test_every_model_shares_the_target_vocabulary(readers: dict[str, Any]) -> None:
    tokens = kv(readers["cyclic-target"], "tokenizer.ggml.tokens")
    for name in DRAFTERS:
        assert kv(readers[name], "tokenizer.ggml.tokens") == tokens
        assert kv(readers[name], "dflash.vocab_size") == len(tokens) == N_VOCAB


def test_mask_token_is_a_byte_token_outside_the_cycles(readers: dict[str, Any]) -> None:
    token_type = kv(readers["cyclic-dflash"], "tokenizer.ggml.token_type")
    assert token_type[md.DFLASH_MASK_TOKEN] == 6  # LLAMA_TOKEN_TYPE_BYTE
    _, cycles = testmodels.cyclic_successor()
    assert all(md.DFLASH_MASK_TOKEN not in cyc for cyc in cycles)


@pytest.mark.parametrize("name", ["cyclic-dflash", *DSPARKS])
def test_dflash_tensors_and_shapes(readers: dict[str, Any], name: str) -> None:
    ne = tensor_ne(readers[name])
    n_embd, n_enc = 64, len(md.DFLASH_TARGET_LAYERS) * 64
    assert ne["token_embd.weight"] == [n_embd, N_VOCAB]
    assert ne["output.weight"] == [n_embd, N_VOCAB]
    assert ne["fc.weight"] == [n_enc, n_embd]
    assert ne["enc.output_norm.weight"] == [n_embd]
    assert ne["output_norm.weight"] == [n_embd]
    for t in ("attn_q", "attn_k", "attn_v", "attn_output"):
        assert ne[f"blk.0.{t}.weight"] == [n_embd, n_embd]
    assert ne["blk.0.attn_q_norm.weight"] == ne["blk.0.attn_k_norm.weight"] == [n_embd // 4]
    assert "d2t" not in ne and "selector_hidden.weight" not in ne  # neither reduced vocab nor DFlash2
    assert not any(k.startswith("hc_") for k in ne)  # not the DSV4 DSpark backbone


def test_the_shared_drafter_borrows_embeddings_and_head(readers: dict[str, Any]) -> None:
    ne = tensor_ne(readers["cyclic-dflash-shared"])
    assert "token_embd.weight" not in ne and "output.weight" not in ne
    assert set(tensor_ne(readers["cyclic-dflash"])) - set(ne) == {"token_embd.weight", "output.weight"}


def test_dspark_heads_and_shapes(readers: dict[str, Any]) -> None:
    ne = tensor_ne(readers["cyclic-dspark"])
    r = md.DSPARK_MARKOV_RANK
    assert ne["markov_w1.weight"] == [r, N_VOCAB]
    assert ne["markov_w2.weight"] == [r, N_VOCAB]
    assert ne["conf_proj.weight"] == [64 + r, 1]
    assert ne["conf_proj.bias"] == [1]
    assert kv(readers["cyclic-dspark"], "dflash.sample_from_anchor") is True
    assert kv(readers["cyclic-dspark"], "dflash.has_confidence_head") is True
    assert not any(k.startswith(("markov_", "conf_proj")) for k in tensor_ne(readers["cyclic-dflash"]))


def test_the_mask_rows_of_the_embedding_are_zero(readers: dict[str, Any]) -> None:
    # the wiring: a mask position's residual is its attention output alone
    t = next(t for t in readers["cyclic-dflash"].tensors if t.name == "token_embd.weight")
    rows = np.asarray(t.data).reshape(N_VOCAB, 64)
    assert not rows[md.DFLASH_MASK_TOKEN].any()
    assert rows[md.DFLASH_MASK_TOKEN + 1].any()


# --- common_speculative_types_from_gguf ------------------------------------


@pytest.mark.parametrize(
    ("name", "types"),
    [("cyclic-dflash", ["draft-dflash"]), ("cyclic-dspark", ["draft-dspark"]),
     ("cyclic-dspark-bonus", ["draft-dspark"]), ("cyclic-dflash-shared", ["draft-dflash"]), ("mtp", ["draft-mtp"]),
     ("cyclic-target", []), ("cyclic-eagle3", [])],
)
def test_types_from_gguf_logic_classifies_the_file(readers: dict[str, Any], name: str, types: list[str]) -> None:
    assert types_from_gguf(readers[name]) == types


@pytest.mark.parametrize(("name", "types"), [("cyclic-dflash", ["draft-dflash"]), ("cyclic-dspark", ["draft-dspark"]),
                                             ("cyclic-dspark-bonus", ["draft-dspark"]),
                                             ("cyclic-dflash-shared", ["draft-dflash"])])
def test_the_ported_types_from_gguf_agrees(models: dict[str, Path], name: str, types: list[str]) -> None:
    from pyspec.common import speculative

    found = speculative.common_speculative_types_from_gguf(str(models[name]))
    assert [speculative.common_speculative_type_to_str(t) for t in found] == types


# --- the pinned llama.cpp loads them ----------------------------------------


@pytest.fixture(scope="module")
def loaded(models: dict[str, Path]) -> Any:
    from pyspec import Model

    opened = {name: Model(models[name]) for name in (*DRAFTERS, "cyclic-target")}
    yield opened
    for m in opened.values():
        m.close()


@needs_libraries
@pytest.mark.parametrize("name", DRAFTERS)
def test_llama_cpp_loads_the_drafter(loaded: dict[str, Any], name: str) -> None:
    m = loaded[name]
    assert m.meta("general.architecture") == "dflash"
    assert m.n_embd == loaded["cyclic-target"].n_embd
    assert m.target_layer_ids().tolist() == list(md.DFLASH_TARGET_LAYERS)
    assert m.has_encoder  # llama_model_has_encoder: n_outputs_max defaults to n_batch
    assert m.vocab.mask == md.DFLASH_MASK_TOKEN  # llama_vocab_mask: the draft's mask_token_id
    # what the constructor of common_speculative_impl_draft_dflash reads through llama_model_meta_val_str
    assert m.meta("dflash.block_size") == str(md.DFLASH_BLOCK_SIZE)
    assert m.rope_type == "neox"  # not M-RoPE: the injection batch carries one position row
    want_anchor = {"cyclic-dspark": "true", "cyclic-dspark-bonus": "false"}.get(name)
    assert m.meta("dflash.sample_from_anchor") == want_anchor
    assert m.meta("dflash.attention.causal") is None  # non-causal block attention


@needs_libraries
@pytest.mark.parametrize("name", ["cyclic-dflash", *DSPARKS])
def test_a_context_opens_without_ctx_other(loaded: dict[str, Any], name: str) -> None:
    from pyspec import Context

    # own token_embd and output: llama_context does not require ctx_other for this drafter
    with Context(loaded[name], n_ctx=256, n_batch=64, n_ubatch=64, n_seq_max=1) as ctx:
        assert ctx.n_ctx >= 256


@needs_libraries
def test_the_shared_drafter_needs_the_target_as_ctx_other(loaded: dict[str, Any],
                                                          caplog: pytest.LogCaptureFixture) -> None:
    from pyspec import Context
    from pyspec.errors import ContextError

    # llama_context's constructor throws "dflash requires ctx_other to be set" (logged by llama.cpp)
    with caplog.at_level("ERROR", logger="pyspec.llama"), pytest.raises(ContextError):
        Context(loaded["cyclic-dflash-shared"], n_ctx=256, n_batch=64, n_ubatch=64, n_seq_max=1)
    assert "dflash requires ctx_other to be set" in caplog.text
    with (Context(loaded["cyclic-target"], n_ctx=256, n_batch=64, n_ubatch=64, n_seq_max=1) as ctx_tgt,
          Context(loaded["cyclic-dflash-shared"], n_ctx=256, n_batch=64, n_ubatch=64, n_seq_max=1,
                  ctx_other=ctx_tgt) as ctx):
        assert ctx.get_ctx_other_ptr() == ctx_tgt.ptr


# --- what the drafters draft (the port of common_speculative_impl_draft_dflash) ---------


@pytest.fixture
def drafting(loaded: dict[str, Any]) -> Any:
    """``drafting(name, p_min=0.0, n_ubatch=64)``: (impl, ctx_dft, dparams, successor map) after a two-sequence
    prefill of the cyclic target, process() and draft() with n_max 8."""
    from pyspec import Context
    from pyspec.common.common import LLAMA_PROCESS_TYPE_DECODE, CommonBatch, llama_process
    from pyspec.common.params import CommonParamsSpeculative
    from pyspec.common.params import CommonSpeculativeType as T
    from pyspec.common.speculative import CommonSpeculativeDraftParams, CommonSpeculativeImplDraftDflash

    opened: list[Any] = []

    def run(name: str, p_min: float = 0.0, n_ubatch: int = 64) -> tuple[Any, Any, list[Any], np.ndarray]:
        succ, cycles = testmodels.cyclic_successor()
        ctx_tgt = Context(loaded["cyclic-target"], n_ctx=512, n_batch=64, n_ubatch=64, n_seq_max=2)
        other = {"ctx_other": ctx_tgt} if name == "cyclic-dflash-shared" else {}
        ctx_dft = Context(loaded[name], n_ctx=512, n_batch=64, n_ubatch=n_ubatch, n_seq_max=2, **other)
        opened.extend((ctx_tgt, ctx_dft))
        params = CommonParamsSpeculative()
        params.draft.n_max = 8
        params.draft.p_min = p_min
        params.draft.backend_sampling = False
        params.draft.ctx_tgt, params.draft.ctx_dft = ctx_tgt, ctx_dft
        impl = CommonSpeculativeImplDraftDflash(params, 2, type=T.DRAFT_DSPARK if name in DSPARKS else T.DRAFT_DFLASH)
        opened.append(impl)
        prompts = [[1] + [cycles[s][i % len(cycles[s])] for i in range(10 + s)] for s in range(2)]
        batch = CommonBatch(ctx_tgt)
        opened.append(batch)
        for s, prompt in enumerate(prompts):
            for i, t in enumerate(prompt):
                batch.add(t, i, s, i == len(prompt) - 1)
        assert llama_process(ctx_tgt, LLAMA_PROCESS_TYPE_DECODE, batch.get()) == 0
        assert impl.process(batch)
        dparams = [CommonSpeculativeDraftParams(drafting=True, pos0=len(p), id_last=int(succ[p[-1]]), prompt=p)
                   for p in prompts]
        impl.draft(dparams)
        return impl, ctx_dft, dparams, succ

    yield run
    for obj in reversed(opened):
        obj.close()


def _cycle_from(succ: np.ndarray, token: int, n: int) -> list[int]:
    out = []
    for _ in range(n):
        token = int(succ[token])
        out.append(token)
    return out


@needs_libraries
@pytest.mark.parametrize("name", ["cyclic-dflash", "cyclic-dflash-shared"])
def test_dflash_drafts_the_successor_of_the_last_token_first(drafting: Any, name: str) -> None:
    impl, _, dparams, succ = drafting(name)
    assert impl.n_max == md.DFLASH_BLOCK_SIZE - 1  # n_max 8 clamped to block_size - 1
    for dp in dparams:
        assert len(dp.result) == impl.n_max
        assert dp.result[0] == succ[dp.id_last]
        assert dp.result != _cycle_from(succ, dp.id_last, impl.n_max)  # the later tokens repeat the first


@needs_libraries
def test_dspark_drafts_the_whole_cycle(drafting: Any) -> None:
    impl, _, dparams, succ = drafting("cyclic-dspark")
    assert impl.n_max == md.DFLASH_BLOCK_SIZE  # anchor-first: a full block of draft tokens
    for dp in dparams:
        assert dp.result == _cycle_from(succ, dp.id_last, md.DFLASH_BLOCK_SIZE)


@needs_libraries
def test_bonus_anchor_dspark_drafts_the_cycle_after_the_anchor_slot(drafting: Any) -> None:
    impl, _, dparams, succ = drafting("cyclic-dspark-bonus")
    assert impl.n_max == md.DFLASH_BLOCK_SIZE - 1  # the anchor slot is no prediction
    for dp in dparams:
        assert dp.result == _cycle_from(succ, dp.id_last, impl.n_max)


@needs_libraries
def test_dspark_p_min_cuts_each_block_at_its_first_low_confidence(drafting: Any) -> None:
    impl, ctx_dft, dparams, succ = drafting("cyclic-dspark", p_min=0.75)
    conf = ctx_dft.get_embeddings_nextn(2 * impl.n_max)[:, 0].reshape(2, impl.n_max)
    for s, dp in enumerate(dparams):
        below = np.flatnonzero(conf[s] < np.float32(0.75))
        n = int(below[0]) if below.size else impl.n_max
        assert dp.result == _cycle_from(succ, dp.id_last, n)
    assert {len(dp.result) for dp in dparams} != {impl.n_max}  # the threshold cut at least one block


@needs_libraries
def test_a_draft_context_whose_ubatch_cannot_hold_the_blocks_is_refused(drafting: Any) -> None:
    from pyspec.errors import SpeculativeError

    # non-causal attention computes all blocks (2 x 8 tokens) in one ubatch: llama.cpp would abort
    with pytest.raises(SpeculativeError, match="n_ubatch"):
        drafting("cyclic-dflash", n_ubatch=8)


def _twin_and_reference(loaded: dict[str, Any], name: str, p_min: float, n_max: int,
                        seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """The drafts of the port and of the C++ reference (libpyspec_ref), each on its own pair of
    contexts, after the same two-sequence prefill."""
    from pyspec import Context
    from pyspec.common.common import LLAMA_PROCESS_TYPE_DECODE, CommonBatch, llama_process
    from pyspec.common.params import CommonParamsSpeculative
    from pyspec.common.params import CommonSpeculativeType as T
    from pyspec.common.speculative import CommonSpeculativeDraftParams, CommonSpeculativeImplDraftDflash, DraftRequest
    from pyspec.core.batch import Batch
    from pyspec.reference.speculative import RefSpeculative

    typ = T.DRAFT_DSPARK if name in DSPARKS else T.DRAFT_DFLASH
    succ, cycles = testmodels.cyclic_successor()
    rng = np.random.default_rng(seed)
    prompts = [[1] + [int(t) for t in rng.choice(cycles[s], 6 + 3 * s)] for s in range(2)]
    opened: list[Any] = []

    def setup() -> tuple[Any, Any, CommonParamsSpeculative]:
        ctx_tgt = Context(loaded["cyclic-target"], n_ctx=512, n_batch=64, n_ubatch=64, n_seq_max=2)
        other = {"ctx_other": ctx_tgt} if name == "cyclic-dflash-shared" else {}
        ctx_dft = Context(loaded[name], n_ctx=512, n_batch=64, n_ubatch=64, n_seq_max=2, **other)
        opened.extend((ctx_tgt, ctx_dft))
        params = CommonParamsSpeculative()
        params.types = [typ]
        params.draft.n_max, params.draft.p_min, params.draft.backend_sampling = n_max, p_min, False
        params.draft.ctx_tgt, params.draft.ctx_dft = ctx_tgt, ctx_dft
        return ctx_tgt, ctx_dft, params

    try:
        ctx_tgt, _ctx_dft, params = setup()
        impl = CommonSpeculativeImplDraftDflash(params, 2, type=typ)
        opened.append(impl)
        batch = CommonBatch(ctx_tgt)
        opened.append(batch)
        for s, prompt in enumerate(prompts):
            for i, t in enumerate(prompt):
                batch.add(t, i, s, i == len(prompt) - 1)
        assert llama_process(ctx_tgt, LLAMA_PROCESS_TYPE_DECODE, batch.get()) == 0
        assert impl.process(batch)
        dparams = [CommonSpeculativeDraftParams(drafting=True, pos0=len(p), id_last=int(succ[p[-1]]), prompt=p)
                   for p in prompts]
        impl.draft(dparams)

        ctx_tgt, _, params = setup()
        ref = RefSpeculative(params, 2)
        opened.append(ref)
        lbatch = Batch(64, 0, 2)
        for s, prompt in enumerate(prompts):
            for i, t in enumerate(prompt):
                lbatch.add(t, i, s, i == len(prompt) - 1)
        ctx_tgt.decode(lbatch)
        assert ref.process(lbatch)
        out = ref.draft([DraftRequest(s, -1, len(p), int(succ[p[-1]]), p) for s, p in enumerate(prompts)])
        return [dp.result for dp in dparams], [out[s] for s in range(2)]
    finally:
        for obj in reversed(opened):
            obj.close()


@needs_libraries
@pytest.mark.parametrize(
    ("name", "p_min", "n_max", "seed"),
    [("cyclic-dflash", 0.0, 8, 0), ("cyclic-dflash", 0.6, 5, 3), ("cyclic-dflash-shared", 0.0, 8, 1),
     ("cyclic-dspark", 0.0, 8, 0),
     ("cyclic-dspark", 0.75, 8, 0), ("cyclic-dspark", 0.78, 6, 5), ("cyclic-dspark-bonus", 0.0, 8, 2),
     ("cyclic-dspark-bonus", 0.75, 8, 0)],
)
def test_the_port_drafts_what_the_reference_drafts(loaded: dict[str, Any], name: str, p_min: float, n_max: int,
                                                   seed: int) -> None:
    port, reference = _twin_and_reference(loaded, name, p_min, n_max, seed)
    assert port == reference
    assert any(port)  # the case drafts something
