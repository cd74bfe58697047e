"""Model metadata, kv overrides, tensor buffer-type overrides and split files (pyspec.core.model)."""

from __future__ import annotations

import contextlib
import logging
import shutil
from collections.abc import Iterator

import numpy as np
import pytest

from pyspec import Batch, Context, Model
from pyspec.core.backend import buffer_types
from pyspec.core.splits import split_path, split_paths, split_prefix
from pyspec.errors import ModelLoadError
from pyspec.testing import derived


def greedy_tokens(model: Model, n: int = 6) -> list[int]:
    """The first n greedy tokens after a fixed prompt (a fingerprint of the weights)."""
    with Context(model, n_ctx=64, n_batch=32, n_ubatch=32, n_seq_max=1, n_threads=1, n_threads_batch=1) as ctx:
        toks = model.vocab.tokenize("The capital of France")
        out = []
        pos = 0
        for _ in range(n):
            batch = Batch(len(toks), 0, 1)
            batch.add_sequence(toks, pos, 0)
            ctx.decode(batch)
            pos += len(toks)
            toks = [int(np.argmax(ctx.get_logits_ith(-1)))]
            out.append(toks[0])
        return out


@contextlib.contextmanager
def llama_log(level: int) -> Iterator[list[str]]:
    """The lines llama.cpp logs at ``level`` and above while the block runs."""
    lines: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    log = logging.getLogger("pyspec.llama")
    handler, old = Catch(level), log.level
    log.addHandler(handler)
    log.setLevel(level)
    try:
        yield lines
    finally:
        log.removeHandler(handler)
        log.setLevel(old)


def test_metadata_lists_every_scalar_key(target_model):
    meta = target_model.meta_dict()
    assert target_model.meta_count() == len(meta)
    assert meta["general.architecture"] == "llama"
    assert int(meta["llama.block_count"]) == target_model.n_layer
    assert meta["general.name"] == "pyspec-tiny-target"
    assert target_model.metadata == meta
    for key in ("general.architecture", "llama.embedding_length", "tokenizer.ggml.model"):
        assert target_model.meta(key) == meta[key]
    assert "tokenizer.ggml.tokens" not in meta  # arrays are not exposed by llama.cpp's metadata API


def test_long_metadata_values_are_read_whole(tmp_path):
    template = "{% for m in messages %}" + "x" * 5000 + "{% endfor %}"
    with Model(derived.make_chat_model(tmp_path / "chat.gguf", template), vocab_only=True) as m:
        assert m.meta("tokenizer.chat_template") == template
        assert m.meta_dict()["tokenizer.chat_template"] == template
        assert m.chat_template() == template
        assert m.chat_template("tool_use") is None


def test_model_information(target_model):
    assert target_model.rope_type == "norm"
    assert target_model.n_swa == 0
    assert target_model.rope_freq_scale_train == 1.0
    assert not target_model.is_diffusion
    assert target_model.decoder_start_token == -1
    assert target_model.classifier_labels() == []
    assert target_model.sampling_defaults() == {}
    assert target_model.chat_template() is None


def test_kv_overrides_replace_metadata_at_load(target_path):
    with Model(target_path, kv_overrides={"llama.context_length": 1234}) as m:
        assert m.n_ctx_train == 1234
        assert m.meta("llama.context_length") == "4096"  # the file's value: the override feeds the loader
    with Model(target_path, kv_overrides={"llama.attention.layer_norm_rms_epsilon": 0.5}) as m:
        changed = greedy_tokens(m)
    with Model(target_path) as m:
        assert greedy_tokens(m) != changed  # a different epsilon gives a different model


def test_kv_overrides_of_the_wrong_type_are_ignored_with_a_warning(target_path):
    # llama.cpp's loader skips an override whose type is not the key's, and says so
    with llama_log(logging.WARNING) as lines, Model(target_path, kv_overrides={"llama.context_length": "long"}) as m:
        assert m.n_ctx_train == 4096
    assert any("Bad metadata override type for key 'llama.context_length'" in line for line in lines)


@pytest.mark.parametrize(
    "overrides",
    [
        {"x" * 200: 1},
        {"": 1},
        {"general.name": "y" * 200},
        {"general.name": None},
        {"llama.context_length": 2**70},
        {"llama.x": float("inf")},
        {"a\0b": 1},
        [("llama.context_length", 1)],
    ],
)
def test_bad_kv_overrides_are_refused_before_llama_cpp(target_path, overrides):
    with pytest.raises((ValueError, TypeError)):
        Model(target_path, kv_overrides=overrides)


def test_tensor_buft_overrides_place_the_matching_tensors(target_path):
    assert "CPU" in buffer_types()
    with llama_log(logging.DEBUG) as records, \
            Model(target_path, tensor_buft_overrides=[(r"blk\.[12]\.ffn_", "CPU")]) as m:
        tokens = greedy_tokens(m)
    moved = sorted(r.split()[1] for r in records if "buffer type overridden to" in r)
    assert moved == sorted(f"blk.{i}.ffn_{w}.weight" for i in (1, 2) for w in ("down", "gate", "norm", "up"))
    with Model(target_path) as m:
        assert greedy_tokens(m) == tokens  # same device, same results


def test_bad_tensor_buft_overrides_are_refused(target_path):
    with pytest.raises(ValueError, match="unknown buffer type 'GPU9'"):
        Model(target_path, tensor_buft_overrides=[("blk", "GPU9")])
    with pytest.raises(TypeError):
        Model(target_path, tensor_buft_overrides=["blk=CPU"])  # type: ignore[list-item]
    with pytest.raises(ModelLoadError):
        Model(target_path, tensor_buft_overrides={"blk[": "CPU"})  # std::regex refuses the pattern


def test_split_paths_mirror_llama_cpp():
    assert split_path("/models/m", 1, 4) == "/models/m-00002-of-00004.gguf"
    assert split_paths("m", 2) == ["m-00001-of-00002.gguf", "m-00002-of-00002.gguf"]
    assert split_prefix("/models/m-00002-of-00004.gguf", 1, 4) == "/models/m"
    assert split_prefix("/models/m-00002-of-00004.gguf", 2, 4) is None
    for args in ((0, 0), (4, 4), (-1, 3)):
        with pytest.raises(ValueError):
            split_path("m", *args)


def test_split_models_load_from_the_first_file_or_a_list(tmp_path, target_model):
    files = derived.make_split_target(tmp_path, max_tensors=16)
    n = len(files)
    assert [str(f) for f in files] == split_paths(tmp_path / "pyspec-split", n)
    reference = greedy_tokens(target_model)
    with Model(files[0]) as m:  # llama.cpp finds the other files by name
        assert m.n_params == target_model.n_params
        assert greedy_tokens(m) == reference
    renamed = []
    for i, f in enumerate(files):  # names of our own: only the list form can load them
        renamed.append(tmp_path / f"part{i}.gguf")
        shutil.move(f, renamed[-1])
    with Model(renamed) as m:
        assert greedy_tokens(m) == reference
    with pytest.raises(ModelLoadError):
        Model(renamed[0])
    with pytest.raises(ModelLoadError):
        Model(renamed[:-1])  # a split missing
    with pytest.raises(ValueError):
        Model([])


def test_vocab_special_tokens(target_model):
    vocab = target_model.vocab
    fim = vocab.fim_tokens()
    assert set(fim) == {"pre", "suf", "mid", "pad", "rep", "sep"}
    assert all(t == -1 or 0 <= t < vocab.n_tokens for t in fim.values())
    assert vocab.sep == -1 and vocab.mask == -1  # an SPM vocabulary has neither
    assert isinstance(vocab.add_sep, bool)


def test_load_mode_replaces_use_mmap_and_use_mlock(target_path):
    # llama_model_params lost use_mmap / use_mlock / use_direct_io for load_mode at 0c1e57098
    from pyspec.core.model import load_mode_from_flags

    assert load_mode_from_flags(True, False) == "auto"  # the defaults keep llama.cpp's default
    assert load_mode_from_flags(True, True) == "mmap+mlock"
    assert load_mode_from_flags(False, True) == "mlock"
    assert load_mode_from_flags(False, False) == "none"
    want = None
    for kwargs in ({}, {"use_mmap": False}, {"load_mode": "mmap"}, {"load_mode": "none", "use_mmap": True},
                   {"lazy_mode": "off"}):
        with Model(target_path, **kwargs) as m:
            expected = kwargs.get("load_mode", "none" if kwargs.get("use_mmap") is False else "auto")
            assert m.load_mode == expected
            got = greedy_tokens(m)
        want = want or got
        assert got == want  # how the file is read changes no weight
    with pytest.raises(ValueError, match="load_mode must be one of"):
        Model(target_path, load_mode="mmap-ish")
    with pytest.raises(ValueError, match="lazy_mode must be one of"):
        Model(target_path, lazy_mode="sometimes")


def test_an_mtp_context_needs_the_nextn_layers_loaded():
    from pyspec.testing import models as tm

    path = tm.make_mtp()
    with Model(path, load_mtp=False) as m:
        assert m.load_mtp is False
        with pytest.raises(ValueError, match="load_mtp=True"):  # its graph would GGML_ASSERT
            Context(m, n_ctx=64, n_batch=8, n_ubatch=8, n_seq_max=1, ctx_type="mtp")
    with Model(path) as m, Context(m, n_ctx=64, n_batch=8, n_ubatch=8, n_seq_max=1, ctx_type="mtp"):
        assert m.load_mtp is True  # the default: the previous pin always loaded them
