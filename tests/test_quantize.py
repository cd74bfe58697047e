"""Model quantization (pyspec.core.quantize) on the tiny f16 target."""

from __future__ import annotations

import os

import numpy as np
import pytest

from pyspec import Batch, Context, Model
from pyspec.core.quantize import FTYPES, quantize
from pyspec.errors import QuantizeError
from pyspec.ffi import c_const, ffi, ggml

PROMPT = "It was the best of times, it was the worst of times"


def tensor_types(path) -> dict[str, str]:
    """{tensor name: ggml type name} of a GGUF file, read with the gguf C API (metadata only)."""
    params = ffi.new("struct gguf_init_params *", {"no_alloc": True, "ctx": ffi.NULL})
    g = ggml.gguf_init_from_file(os.fsencode(path), params[0])
    assert g != ffi.NULL
    try:
        return {
            ffi.string(ggml.gguf_get_tensor_name(g, i)).decode():
                ffi.string(ggml.ggml_type_name(ggml.gguf_get_tensor_type(g, i))).decode()
            for i in range(ggml.gguf_get_n_tensors(g))
        }
    finally:
        ggml.gguf_free(g)


def logits_of(model: Model, tokens: list[int]) -> np.ndarray:
    with Context(model, n_ctx=64, n_batch=32, n_ubatch=32, n_seq_max=1, n_threads=1, n_threads_batch=1) as ctx:
        batch = Batch(len(tokens), 0, 1)
        batch.add_sequence(tokens, 0, 0)
        ctx.decode(batch)
        return ctx.get_logits_ith(-1).copy()


def test_q8_0_quantization_is_close_to_the_f16_model(target_path, target_model, tmp_path):
    out = quantize(target_path, tmp_path / "q8.gguf", "q8_0", nthread=2)
    assert out.stat().st_size < 0.6 * target_path.stat().st_size
    types = tensor_types(out)
    assert types["blk.0.attn_q.weight"] == "q8_0" and types["output.weight"] == "q8_0"
    assert types["blk.0.attn_norm.weight"] == "f32"  # 1-d tensors stay
    tokens = target_model.vocab.tokenize(PROMPT)
    with Model(out) as q:
        assert q.meta("general.file_type") == str(c_const("LLAMA_FTYPE_MOSTLY_Q8_0"))
        assert "Q8_0" in q.desc
        want, got = logits_of(target_model, tokens), logits_of(q, tokens)
    assert np.corrcoef(want, got)[0, 1] > 0.999
    assert not np.array_equal(want, got)


def test_type_overrides_metadata_and_pruning_reach_the_output(target_path, tmp_path):
    out = quantize(
        target_path, tmp_path / "mixed.gguf", "q8_0",
        output_tensor_type="f16", token_embedding_type="q4_0",
        tensor_types=[(r"blk\.1\.ffn_down", "q5_0")],
        kv_overrides={"general.name": "pyspec-quantized"},
        prune_layers=[3],
    )
    types = tensor_types(out)
    assert types["output.weight"] == "f16"
    assert types["token_embd.weight"] == "q4_0"
    assert types["blk.1.ffn_down.weight"] == "q5_0"
    assert types["blk.1.ffn_up.weight"] == "q8_0"
    assert not any(name.startswith("blk.3.") for name in types)
    with Model(out) as m:
        assert m.meta("general.name") == "pyspec-quantized"
        assert m.n_layer == 3


def test_a_dry_run_writes_nothing(target_path, tmp_path):
    quantize(target_path, tmp_path / "dry.gguf", "q4_0", dry_run=True)
    assert not (tmp_path / "dry.gguf").exists()


def test_llama_cpp_refusals_raise(target_path, tmp_path):
    q8 = quantize(target_path, tmp_path / "q8.gguf", "q8_0")
    with pytest.raises(QuantizeError, match="requantizing from type q8_0 is disabled"):
        quantize(q8, tmp_path / "q4.gguf", "q4_0")
    quantize(q8, tmp_path / "q4.gguf", "q4_0", allow_requantize=True)
    with pytest.raises(QuantizeError):
        quantize(target_path, tmp_path / "bad.gguf", "q8_0", tensor_types=[("blk[", "f16")])


def test_bad_arguments_are_refused(target_path, tmp_path):
    assert "q4_k_m" in FTYPES and "f16" in FTYPES and "guessed" not in FTYPES
    with pytest.raises(ValueError, match="ftype"):
        quantize(target_path, tmp_path / "x.gguf", "q9_9")
    with pytest.raises(ValueError, match="output_tensor_type"):
        quantize(target_path, tmp_path / "x.gguf", output_tensor_type="i32")
    with pytest.raises(FileNotFoundError):
        quantize(tmp_path / "missing.gguf", tmp_path / "x.gguf")
    with pytest.raises(FileNotFoundError):
        quantize(target_path, tmp_path / "no" / "x.gguf")
    with pytest.raises(ValueError, match="is the source"):
        quantize(target_path, target_path)
    with pytest.raises(ValueError, match="cannot be combined"):
        quantize(target_path, tmp_path / "x.gguf", prune_layers=[1], imatrix={"output.weight": np.ones(64)})
    with pytest.raises(ValueError, match="finite"):
        quantize(target_path, tmp_path / "x.gguf", imatrix={"output.weight": np.full(64, np.nan)})
    assert not (tmp_path / "x.gguf").exists()
