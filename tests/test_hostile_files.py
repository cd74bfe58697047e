"""Hostile model files and pairings: each raises a clear exception naming the problem.

Broken files, an unknown architecture, a draft whose vocabulary differs from
the target's, an EAGLE3 head with the wrong number of extract layers, MTP asked
of a model without NextN layers, EAGLE3 on a target whose graph cannot export
layer inputs. None of them may crash the process or leave memory or file
descriptors behind.
"""

from __future__ import annotations

import os

import pytest

import pyspec
from pyspec import Context, Model, SpeculativeError
from pyspec.common import speculative as sp
from pyspec.common.params import CommonParamsSpeculative
from pyspec.common.params import CommonSpeculativeType as T
from pyspec.generation.driver import SpeculativeGenerator
from pyspec.testing import models as tm


def n_open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


# --- small GGUF writers (the vendored gguf-py, through testmodels' helpers) ---


write_tiny_llama = tm.write_llama


def vocab_with_swapped_tokens(a: int = 1000, b: int = 1001) -> list:
    """The test vocabulary with the texts of tokens a and b swapped: same size and type, other content."""
    out = []
    for key, value, vtype, sub_type in tm.llama_vocab_kv():
        if key == "tokenizer.ggml.tokens":
            value = list(value)
            value[a], value[b] = value[b], value[a]
        out.append((key, value, vtype, sub_type))
    return out




# --- broken files -----------------------------------------------------------


BROKEN = {
    "empty": (tm.write_empty, "empty"),
    "truncated": (tm.write_truncated, "truncated|data is not within the file bounds|tensor"),
    "random": (tm.write_random_bytes, "not a GGUF"),
}


@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_broken_file_raises_model_load_error_naming_path_and_problem(tmp_path, kind):
    writer, problem = BROKEN[kind]
    path = writer(tmp_path / f"{kind}.gguf")
    with pytest.raises(pyspec.ModelLoadError, match=problem) as err:
        Model(path)
    assert str(path) in str(err.value) and err.value.path == str(path)


def test_unknown_architecture_raises_naming_it(tmp_path):
    path = write_tiny_llama(tmp_path / "arch.gguf", arch="nonexistent")
    with pytest.raises(pyspec.ModelLoadError, match="nonexistent") as err:
        Model(path)
    assert "architecture" in str(err.value)


def test_failed_loads_leave_no_file_descriptors_or_memory_behind(tmp_path):
    paths = [tm.write_truncated(tmp_path / "t.gguf"), write_tiny_llama(tmp_path / "a.gguf", arch="nonexistent"),
             tm.write_random_bytes(tmp_path / "r.gguf"), tm.write_empty(tmp_path / "e.gguf")]
    for p in paths:  # warm-up: the first failures allocate logging / backend state once
        with pytest.raises(pyspec.ModelLoadError):
            Model(p)
    fds, rss = n_open_fds(), rss_kb()
    for _ in range(10):
        for p in paths:
            with pytest.raises(pyspec.ModelLoadError):
                Model(p)
    assert n_open_fds() == fds
    assert rss_kb() - rss < 4096  # 40 failed loads of a 9 MB file: well under 4 MB growth


# --- pairings ----------------------------------------------------------------


@pytest.fixture(scope="module")
def target():
    with Model(tm.make_target()) as m:
        yield m


@pytest.mark.parametrize("engine", ["python", "cpp"])
def test_draft_with_a_different_vocabulary_is_refused(tmp_path, target, engine):
    path = write_tiny_llama(tmp_path / "vocab.gguf", vocab_kv=vocab_with_swapped_tokens())
    with Model(path) as draft:
        assert not sp.common_speculative_are_compatible(target, draft)
        ctx = Context(target, n_ctx=128, n_batch=32)
        ctxd = Context(draft, n_ctx=128, n_batch=32)
        p = CommonParamsSpeculative(types=[T.DRAFT_SIMPLE])
        p.draft.ctx_dft = ctxd
        with pytest.raises(SpeculativeError, match="vocab"):
            SpeculativeGenerator(ctx, p, backend=engine)
        ctxd.close()
        ctx.close()


def test_eagle3_with_two_extract_layers_is_refused_at_load(tmp_path):
    path = tm.write_eagle3_with_layers(tmp_path / "e2.gguf", (1, 2))
    with pytest.raises(pyspec.ModelLoadError, match="exactly 3 entries"):
        Model(path)


@pytest.mark.parametrize("engine", ["python", "cpp"])
def test_eagle3_reading_a_layer_the_target_lacks_is_refused(tmp_path, target, engine):
    path = tm.write_eagle3_with_layers(tmp_path / "e9.gguf", (1, 2, 9))
    with Model(path) as head:
        assert list(head.target_layer_ids()) == [1, 2, 9]
        ctx = Context(target, n_ctx=128, n_batch=32)
        ctxd = Context(head, n_ctx=128, n_batch=32, ctx_other=ctx)
        p = CommonParamsSpeculative(types=[T.DRAFT_EAGLE3])
        p.draft.ctx_dft = ctxd
        # the port raises the C++'s GGML_ABORT message where the constructor aborts, before anything is
        # set; before the C++ engine's constructor, Context.check_layer_inp refuses the layer
        expected = {"python": r"^EAGLE3: target layer id 9 exceeds target n_layer 4$",
                    "cpp": r"layer 9 (is not a layer of the target|out of range)"}[engine]
        with pytest.raises((SpeculativeError, ValueError), match=expected):
            SpeculativeGenerator(ctx, p, backend=engine)
        ctxd.close()
        ctx.close()


@pytest.mark.parametrize("engine", ["python", "cpp"])
def test_eagle3_on_a_target_without_layer_input_export_is_refused(engine):
    # qwen35's graph does not record layer inputs: llama.cpp would abort at the next decode
    with Model(tm.make_mtp()) as qwen, Model(tm.make_eagle3()) as head:
        ctx = Context(qwen, n_ctx=128, n_batch=32)
        ctxd = Context(head, n_ctx=128, n_batch=32, ctx_other=ctx)
        p = CommonParamsSpeculative(types=[T.DRAFT_EAGLE3])
        p.draft.ctx_dft = ctxd
        with pytest.raises(ValueError, match="'qwen35' architecture"):
            SpeculativeGenerator(ctx, p, backend=engine)
        with pytest.raises(ValueError, match="layer input extraction"):
            ctx.set_embeddings_layer_inp(1, True)
        ctxd.close()
        ctx.close()


def test_mtp_context_on_a_model_without_nextn_layers_is_refused(target):
    ctx = Context(target, n_ctx=128, n_batch=32)
    with pytest.raises(ValueError, match="nextn_predict_layers"):
        Context(target, n_ctx=128, n_batch=32, ctx_type="mtp", ctx_other=ctx)
    ctx.close()


@pytest.mark.parametrize("engine", ["python", "cpp"])
def test_mtp_type_with_a_plain_draft_context_does_not_crash(target, engine):
    # DRAFT_MTP given an ordinary context of a model without NextN layers: no MTP head to
    # read, so the port must either refuse or produce nothing; the target's output stays right
    ctx = Context(target, n_ctx=256, n_batch=32)
    ctxd = Context(target, n_ctx=256, n_batch=32)
    p = CommonParamsSpeculative(types=[T.DRAFT_MTP])
    p.draft.ctx_dft = ctxd
    try:
        with SpeculativeGenerator(ctx, p, backend=engine) as g:
            got = g.generate(["hello world"], 8)[0].tokens
    except pyspec.PyspecError:
        return
    with SpeculativeGenerator(ctx, None) as g:
        assert got == g.generate(["hello world"], 8)[0].tokens


def test_model_closed_after_a_failed_pairing_frees_everything(tmp_path, target):
    # a refused pairing must not keep its model or contexts retained: closing frees them now
    path = write_tiny_llama(tmp_path / "vocab.gguf", vocab_kv=vocab_with_swapped_tokens())
    draft = Model(path)
    ctx = Context(target, n_ctx=128, n_batch=32)
    ctxd = Context(draft, n_ctx=128, n_batch=32)
    p = CommonParamsSpeculative(types=[T.DRAFT_SIMPLE])
    p.draft.ctx_dft = ctxd
    with pytest.raises(SpeculativeError):
        SpeculativeGenerator(ctx, p)
    ctxd.close()
    ctx.close()
    draft.close()
    assert draft._users == 0 and draft._ptr == pyspec.ffi.ffi.NULL
