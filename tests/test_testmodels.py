"""pyspec.testing.models writes tiny GGUF models: cached, deterministic, with the metadata llama.cpp reads."""

from __future__ import annotations

import hashlib
import itertools
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import pyspec.testing
from pyspec.testing import models as testmodels

MODELS = ("target", "draft", "eagle3", "mtp", "cyclic-target", "cyclic-draft", "cyclic-eagle3", "chat-target")
ARCH = {
    "target": "llama",
    "draft": "llama",
    "eagle3": "eagle3",
    "mtp": "qwen35",
    "cyclic-target": "llama",
    "cyclic-draft": "llama",
    "cyclic-eagle3": "eagle3",
    "chat-target": "llama",
}


def _have_llama_cpp() -> bool:
    try:
        testmodels.llama_cpp_dir()
    except FileNotFoundError:
        return False
    return True


pytestmark = [
    pytest.mark.skipif(not _have_llama_cpp(), reason="vendored llama.cpp missing: run scripts/fetch_llama.py"),
    # the generators write every model afresh into an empty cache, and once more in a subprocess
    pytest.mark.slow,
]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module")
def models(cache: Path) -> dict[str, Path]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYSPEC_MODEL_CACHE", str(cache))
        return testmodels.make_all()


@pytest.fixture(scope="module")
def readers(models: dict[str, Path]) -> dict[str, Any]:
    gguf = testmodels.gguf_module()
    return {name: gguf.GGUFReader(path) for name, path in models.items()}


def kv(reader: Any, key: str) -> Any:
    field = reader.get_field(key)
    assert field is not None, f"missing key {key}"
    return field.contents()


# --- files and cache -------------------------------------------------------


def test_make_all_writes_every_model_into_the_cache_folder(models: dict[str, Path], cache: Path) -> None:
    assert set(models) == set(MODELS)
    for name, path in models.items():
        assert path.parent == cache
        assert path.is_file() and path.stat().st_size > 0
        assert name in path.name and testmodels.GENERATOR_VERSION in path.name


def test_cache_folder_holds_no_leftover_temp_files(models: dict[str, Path], cache: Path) -> None:
    assert sorted(p.name for p in cache.iterdir()) == sorted(p.name for p in models.values())


def test_cached_models_are_returned_without_rewriting(
    models: dict[str, Path], cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = {name: path.stat().st_mtime_ns for name, path in models.items()}

    def no_write(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a cached model was written again")

    monkeypatch.setenv("PYSPEC_MODEL_CACHE", str(cache))
    monkeypatch.setattr(testmodels, "_write_atomic", no_write)
    assert testmodels.make_all() == models
    assert {name: path.stat().st_mtime_ns for name, path in models.items()} == before


def test_a_fresh_process_writes_byte_identical_models(models: dict[str, Path], tmp_path: Path) -> None:
    env = dict(os.environ, PYSPEC_MODEL_CACHE=str(tmp_path))
    repo = Path(testmodels.__file__).resolve().parents[2]  # the checkout (or site-packages) that holds pyspec
    code = "from pyspec.testing import models; print(models.make_all())"
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=repo, capture_output=True)
    for path in models.values():
        assert sha256(tmp_path / path.name) == sha256(path), path.name


def test_cache_dir_follows_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYSPEC_MODEL_CACHE", str(tmp_path / "sub"))
    assert testmodels.cache_dir() == tmp_path / "sub"
    assert (tmp_path / "sub").is_dir()


def test_missing_llama_cpp_tree_says_how_to_fetch_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYSPEC_LLAMA_CPP", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"scripts/fetch_llama\.py"):
        testmodels.llama_cpp_dir()


def test_vocab_source_is_the_vendored_vocab_file_or_its_packaged_copy() -> None:
    # the build installs the file into pyspec/testing/data: beside the module after
    # scripts/dev_build.sh, in the install tree of an editable install (a folder of the
    # package __path__); without it, the fetched tree's file is used
    path = testmodels.vocab_source()
    vendored = testmodels.llama_cpp_dir() / "models" / path.name
    packaged = [Path(folder) / "data" for folder in pyspec.testing.__path__]
    assert path.parent in (vendored.parent, *packaged)
    assert path.name.startswith("ggml-vocab-") and path.suffix == ".gguf"
    assert path.read_bytes() == vendored.read_bytes()


# --- metadata --------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_architecture(readers: dict[str, Any], name: str) -> None:
    assert kv(readers[name], "general.architecture") == ARCH[name]


def test_all_models_share_the_vocabulary_of_the_source(readers: dict[str, Any]) -> None:
    source = testmodels.gguf_module().GGUFReader(testmodels.vocab_source())
    tokens = kv(source, "tokenizer.ggml.tokens")
    assert len(tokens) == 32000
    for name, reader in readers.items():
        assert kv(reader, "tokenizer.ggml.tokens") == tokens, name
        for key in ("tokenizer.ggml.model", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
            assert kv(reader, key) == kv(source, key), (name, key)
        assert kv(reader, f"{ARCH[name]}.vocab_size") == len(tokens)


def test_draft_is_smaller_than_target(readers: dict[str, Any]) -> None:
    assert kv(readers["draft"], "llama.block_count") < kv(readers["target"], "llama.block_count")


def test_eagle3_reads_three_target_layers(readers: dict[str, Any]) -> None:
    e3 = readers["eagle3"]
    layers = kv(e3, "eagle3.target_layers")
    assert len(layers) == 3
    assert all(0 <= il < kv(readers["target"], "llama.block_count") for il in layers)
    assert kv(e3, "eagle3.target_hidden_size") == kv(readers["target"], "llama.embedding_length")
    assert kv(e3, "eagle3.block_count") == 1
    names = {t.name for t in e3.tensors}
    assert {"fc.weight", "d2t", "blk.0.attn_norm_2.weight"} <= names
    assert "token_embd.weight" not in names  # borrowed from the target through ctx_other


def test_mtp_has_one_nextn_layer_after_the_trunk(readers: dict[str, Any]) -> None:
    mtp = readers["mtp"]
    assert kv(mtp, "qwen35.nextn_predict_layers") == 1
    last = kv(mtp, "qwen35.block_count") - 1
    names = {t.name for t in mtp.tensors}
    assert f"blk.{last}.nextn.eh_proj.weight" in names
    nextn_blocks = {n.split(".")[1] for n in names if ".nextn." in n}
    assert nextn_blocks == {str(last)}


def test_cyclic_models_have_the_target_shapes(readers: dict[str, Any]) -> None:
    tgt, dft, e3 = readers["cyclic-target"], readers["cyclic-draft"], readers["cyclic-eagle3"]
    assert kv(tgt, "llama.block_count") == kv(readers["target"], "llama.block_count")
    assert kv(dft, "llama.block_count") < kv(tgt, "llama.block_count")
    for key in ("llama.embedding_length", "llama.attention.head_count", "llama.attention.head_count_kv"):
        assert kv(tgt, key) == kv(readers["target"], key) == kv(dft, key), key
    assert kv(e3, "eagle3.target_hidden_size") == kv(tgt, "llama.embedding_length")
    assert kv(tgt, "general.name") == "pyspec-tiny-cyclic-target"
    # the draft shares the target's embeddings and head
    t_tensors = {t.name: t for t in tgt.tensors}
    for t in dft.tensors:
        if not t.name.startswith("blk.") or int(t.name.split(".")[1]) < kv(dft, "llama.block_count"):
            assert bytes(t.data) == bytes(t_tensors[t.name].data), t.name


def test_cyclic_successor_is_a_set_of_short_cycles() -> None:
    succ, cycles = testmodels.cyclic_successor()
    gguf_types = dict((k, v) for k, v, _, _ in testmodels.llama_vocab_kv())["tokenizer.ggml.token_type"]
    assert succ.shape == (len(gguf_types),)
    members = [t for cyc in cycles for t in cyc]
    assert len(members) == len(set(members)) == testmodels.CYCLIC_N_STATES
    assert set(succ.tolist()) == set(members)  # every token leads into a cycle
    for cyc in cycles:
        assert testmodels.CYCLIC_MIN_LEN <= len(cyc) <= testmodels.CYCLIC_MAX_LEN
        assert [int(succ[t]) for t in cyc] == [*list(cyc[1:]), cyc[0]]
        assert all(gguf_types[t] == 1 for t in cyc)  # ordinary tokens: no eos, no bytes
    succ[0] = -1  # a copy: the generator's map is not touched
    assert testmodels.cyclic_successor()[0][0] != -1


# --- behaviour of the cyclic models ----------------------------------------


def _period(tokens: list[int]) -> int | None:
    """The smallest p such that the last 3p tokens repeat with period p."""
    for p in range(1, len(tokens) // 3 + 1):
        tail = tokens[-3 * p :]
        if all(tail[i] == tail[i + p] for i in range(2 * p)):
            return p
    return None


@pytest.fixture(scope="module")
def cyclic_model(models: dict[str, Path]) -> Any:
    from pyspec import Model

    with Model(models["cyclic-target"]) as m:
        yield m


def _greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    from pyspec import Batch, Context, SamplerChain

    with Context(model, n_ctx=256, n_batch=64, n_ubatch=64, n_threads=1) as ctx, SamplerChain().add_greedy() as smpl:
        batch = Batch(64)
        batch.add_sequence(prompt, 0, 0, True)
        ctx.decode(batch)
        out: list[int] = []
        for _ in range(n):
            tok = smpl.sample(ctx, -1)
            smpl.accept(tok)
            out.append(tok)
            batch.clear()
            batch.add(tok, len(prompt) + len(out) - 1, 0, True)
            ctx.decode(batch)
        return out


@pytest.mark.parametrize("text", ["def fib(n): return fib(n-1) + fib(n-2)", "Hello"])
def test_cyclic_target_greedy_output_repeats(cyclic_model: Any, text: str) -> None:
    succ, cycles = testmodels.cyclic_successor()
    out = _greedy(cyclic_model, cyclic_model.vocab.tokenize(text, True, False), 40)
    period = _period(out)
    assert period is not None and 2 <= period <= 20, out
    assert period in {len(c) for c in cycles}
    assert all(int(succ[a]) == b for a, b in itertools.pairwise(out)), out  # the map, from the first token on


def test_cyclic_target_sampling_is_not_degenerate(cyclic_model: Any) -> None:
    from pyspec import Batch, Context, SamplerChain

    prompt = cyclic_model.vocab.tokenize("Hello", True, False)
    runs = []
    for seed in (1, 2):
        with Context(cyclic_model, n_ctx=256, n_batch=64, n_ubatch=64, n_threads=1) as ctx:
            smpl = SamplerChain().add_top_k(40).add_temp(0.8).add_dist(seed)
            batch = Batch(64)
            batch.add_sequence(prompt, 0, 0, True)
            ctx.decode(batch)
            out: list[int] = []
            for _ in range(64):
                tok = smpl.sample(ctx, -1)
                smpl.accept(tok)
                out.append(tok)
                batch.clear()
                batch.add(tok, len(prompt) + len(out) - 1, 0, True)
                ctx.decode(batch)
            smpl.close()
        runs.append(out)
        assert len(set(out)) >= 10, out
    assert runs[0] != runs[1]


def _spec_run(model: Any, spec_type: Any, prompt: Any, engine: str = "python") -> tuple[int, int, list[int]]:
    from pyspec import Context
    from pyspec.common.params import CommonParamsSpeculative
    from pyspec.generation.driver import SpeculativeGenerator

    with Context(model, n_ctx=512, n_batch=128, n_ubatch=128, n_threads=1) as ctx:
        spec = CommonParamsSpeculative(types=[spec_type])
        spec.ngram_simple.size_n = 3
        spec.ngram_simple.size_m = 8
        with SpeculativeGenerator(ctx, spec, backend=engine, adaptive_draft=False) as gen:  # every draft verified
            (res,) = gen.generate([prompt], n_predict=64, add_special=not isinstance(prompt, list))
            return gen.stats.n_drafted, gen.stats.n_accepted, list(res.tokens)


def test_ngram_simple_drafts_are_accepted_on_the_cyclic_target(cyclic_model: Any) -> None:
    from pyspec.common.params import CommonSpeculativeType as T

    text = "def fib(n): return fib(n-1) + fib(n-2)\n"
    n_drafted, n_accepted, tokens = _spec_run(cyclic_model, T.NGRAM_SIMPLE, text)
    prompt = cyclic_model.vocab.tokenize(text, True, False)
    assert tokens == _greedy(cyclic_model, prompt, 64)  # speculation does not change greedy output
    assert n_drafted >= 32
    assert n_accepted > 0.5 * n_drafted


def test_ngram_cache_drafts_from_a_cyclic_prompt(cyclic_model: Any) -> None:
    # ngram-cache learns the n-grams of the prompt (new tokens arrive one or two at a
    # time, too few to add n-grams): the prompt must hold the cycle
    from pyspec.common.params import CommonSpeculativeType as T

    _, cycles = testmodels.cyclic_successor()
    prompt = [cyclic_model.vocab.bos] + list(cycles[0]) * 3
    n_drafted, n_accepted, _ = _spec_run(cyclic_model, T.NGRAM_CACHE, prompt)
    assert n_drafted >= 32
    assert n_accepted > 0.5 * n_drafted


# --- broken files ----------------------------------------------------------


def test_write_empty(tmp_path: Path) -> None:
    path = testmodels.write_empty(tmp_path / "empty.gguf")
    assert path.stat().st_size == 0


def test_write_truncated_keeps_the_header_and_half_the_bytes(
    models: dict[str, Path], cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYSPEC_MODEL_CACHE", str(cache))
    path = testmodels.write_truncated(tmp_path / "half.gguf")
    full = models["target"].read_bytes()
    assert path.read_bytes() == full[: len(full) // 2]
    assert path.read_bytes()[:4] == b"GGUF"


def test_write_random_bytes_is_deterministic_and_not_gguf(tmp_path: Path) -> None:
    a = testmodels.write_random_bytes(tmp_path / "a.gguf")
    b = testmodels.write_random_bytes(tmp_path / "b.gguf")
    assert a.read_bytes() == b.read_bytes()
    assert a.stat().st_size == 4096
    assert a.read_bytes()[:4] != b"GGUF"
