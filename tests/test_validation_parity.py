"""The C++ engine refuses exactly what the Python engine refuses, with the same exception and message.

Each row is one bad parameter; both engines of SpeculativeGenerator (and the C++ loop,
cpp_generate) get it, and must raise the same exception type (the C++ side may raise a
subclass: RefError is a SpeculativeError) with the same message. A second table feeds
the same values straight to the C ABI of libpyspec_ref, which must repeat the check
with the same text, for C callers that skip the Python side.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from pyspec import Context
from pyspec.common.params import CommonParamsSampling, CommonParamsSpeculative, CommonSamplerType
from pyspec.common.params import CommonSpeculativeType as T
from pyspec.errors import PyspecError
from pyspec.ffi import ffi, ref
from pyspec.generation.cpp_loop import cpp_generate
from pyspec.generation.driver import SpeculativeGenerator, greedy_sampling
from pyspec.reference.sampling import sampling_params_struct
from pyspec.reference.speculative import spec_params_struct

PROMPT = "def f(x): return f(x) + f(x) + f(x)"


def spec(t: T, **kw: Any) -> CommonParamsSpeculative:
    p = CommonParamsSpeculative(types=[t])
    for k, v in kw.items():
        obj, attr = k.split("__")
        setattr(getattr(p, obj), attr, v)
    return p


def sampling(**kw: Any) -> CommonParamsSampling:
    return dataclasses.replace(greedy_sampling(), **kw)


def cache_file(tmp: Path, name: str, data: bytes) -> str:
    p = tmp / name
    p.write_bytes(data)
    return str(p)


def bad_inputs(tmp: Path) -> dict[str, tuple[CommonParamsSpeculative, CommonParamsSampling]]:
    g = greedy_sampling()
    return {
        "ngram_mod n_match 0": (spec(T.NGRAM_MOD, ngram_mod__n_match=0), g),
        "ngram_mod n_max -1": (spec(T.NGRAM_MOD, ngram_mod__n_max=-1), g),
        "ngram_simple size_n -1": (spec(T.NGRAM_SIMPLE, ngram_simple__size_n=-1), g),
        "ngram_map_k min_hits 70000": (spec(T.NGRAM_MAP_K, ngram_map_k__min_hits=70000), g),
        "cache missing": (spec(T.NGRAM_CACHE, ngram_cache__lookup_cache_static=str(tmp / "nope")), g),
        "cache directory": (spec(T.NGRAM_CACHE, ngram_cache__lookup_cache_static=str(tmp)), g),
        "cache count <= 0": (spec(T.NGRAM_CACHE, ngram_cache__lookup_cache_dynamic=cache_file(
            tmp, "neg.cache", b"\x01" * 16 + b"\xff\xff\xff\xff")), g),
        "cache cut short": (spec(T.NGRAM_CACHE, ngram_cache__lookup_cache_static=cache_file(
            tmp, "short.cache", b"\x01" * 16 + b"\x02\0\0\0" + b"\x05\0\0\0")), g),
        "unknown type": (CommonParamsSpeculative(types=[99]), g),  # type: ignore[list-item]
        "mirostat 3": (spec(T.NGRAM_SIMPLE), sampling(mirostat=3)),
        "unknown sampler": (spec(T.NGRAM_SIMPLE), sampling(samplers=[99])),
        "sampler NONE": (spec(T.NGRAM_SIMPLE), sampling(samplers=[CommonSamplerType.NONE])),
        # llama.cpp's infill sampler is quadratic in the candidates: a whole vocabulary hangs it
        "infill without top-k": (spec(T.NGRAM_SIMPLE), sampling(top_k=40, samplers=[CommonSamplerType.INFILL,
                                                                                     CommonSamplerType.TOP_K])),
        "infill after a large top-k": (spec(T.NGRAM_SIMPLE), sampling(top_k=5000, samplers=[
            CommonSamplerType.TOP_K, CommonSamplerType.INFILL])),
        "n_prev huge": (spec(T.NGRAM_SIMPLE), sampling(n_prev=2**31 - 1)),
        "penalty_last_n huge": (spec(T.NGRAM_SIMPLE), sampling(penalty_last_n=2**30)),
        "dry without window": (spec(T.NGRAM_SIMPLE), sampling(
            dry_multiplier=1.0, dry_penalty_last_n=-7, samplers=[CommonSamplerType.DRY, CommonSamplerType.TOP_K])),
        "logit bias token": (spec(T.NGRAM_SIMPLE), sampling(logit_bias=[(10**6, 1.0)])),
        "grammar unparsable": (spec(T.NGRAM_SIMPLE), sampling(grammar="root ::= (")),
        "grammar nested": (spec(T.NGRAM_SIMPLE), sampling(grammar="root ::= " + "(" * 500 + '"a"' + ")" * 500)),
        "grammar inverted repetition": (spec(T.NGRAM_SIMPLE), sampling(grammar='root ::= "a"{4,3}')),
        "llguidance": (spec(T.NGRAM_SIMPLE), sampling(grammar="%llguidance {}")),
        "seed beyond uint32": (spec(T.NGRAM_SIMPLE), sampling(seed=2**40)),
    }


def outcome(fn: Any) -> tuple[str, str, set[str]]:
    try:
        fn()
    except Exception as e:
        return type(e).__name__, str(e), {c.__name__ for c in type(e).__mro__}
    return "", "no exception", set()


@pytest.fixture(scope="module")
def tmp_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("parity-inputs")


@pytest.mark.parametrize("name", list(bad_inputs(Path("/tmp"))))
def test_both_engines_and_the_cpp_loop_refuse_with_the_same_exception_and_message(target_model, tmp_dir, name):
    p, s = bad_inputs(tmp_dir)[name]
    results: dict[str, tuple[str, str, set[str]]] = {}
    for engine in ("python", "cpp", "loop"):
        with Context(target_model, n_ctx=256, n_batch=32, n_threads=1, n_threads_batch=1) as ctx:
            if engine == "loop":
                results[engine] = outcome(lambda c=ctx: cpp_generate(c, [PROMPT], 4, dataclasses.replace(p), s))
            else:
                def run(c=ctx, e=engine):
                    with SpeculativeGenerator(c, dataclasses.replace(p), dataclasses.replace(s), backend=e) as g:
                        g.generate([PROMPT], 4)
                results[engine] = outcome(run)
    py_type, py_msg, _ = results["python"]
    assert py_type, f"{name}: the Python engine accepted it"
    for engine in ("cpp", "loop"):
        _, msg, mro = results[engine]
        assert py_type in mro, f"{name}: {engine} raised {results[engine][0]}, python {py_type}"
        assert msg == py_msg, f"{name}: {engine} says {msg!r}, python {py_msg!r}"


def _c_spec_init(p: CommonParamsSpeculative) -> str:
    s, _keep = spec_params_struct(p)
    ptr = ref.pyspec_ref_spec_init(s, 1)
    if ptr != ffi.NULL:
        ref.pyspec_ref_spec_free(ptr)
        return ""
    return ffi.string(ref.pyspec_ref_last_error()).decode()


def _c_sampler_init(model: Any, p: CommonParamsSampling) -> str:
    s, _keep = sampling_params_struct(p)
    ptr = ref.pyspec_ref_sampler_init(ffi.cast("struct llama_model *", model.ptr), s)
    if ptr != ffi.NULL:
        ref.pyspec_ref_sampler_free(ptr)
        return ""
    return ffi.string(ref.pyspec_ref_last_error()).decode()


C_ABI_SPEC = ["ngram_mod n_match 0", "ngram_mod n_max -1", "cache missing", "cache directory", "cache count <= 0",
              "cache cut short"]
C_ABI_SAMPLING = ["mirostat 3", "unknown sampler", "sampler NONE", "n_prev huge", "penalty_last_n huge",
                  "dry without window", "infill without top-k", "infill after a large top-k", "logit bias token",
                  "grammar unparsable", "grammar nested", "grammar inverted repetition", "llguidance"]


@pytest.mark.parametrize("name", C_ABI_SPEC + C_ABI_SAMPLING)
def test_the_c_abi_repeats_the_python_checks_with_their_messages(target_model, tmp_dir, name):
    from pyspec.common.checks import check_sampling_params, check_speculative_params

    p, s = bad_inputs(tmp_dir)[name]
    if name in C_ABI_SPEC:
        py_type, py_msg, _ = outcome(lambda: check_speculative_params(p, 1))
        c_msg = _c_spec_init(p)
    else:
        m = target_model
        py_type, py_msg, _ = outcome(lambda: check_sampling_params(s, m.vocab.n_tokens, m.n_ctx_train, m.vocab.ptr))
        c_msg = _c_sampler_init(m, s)
    assert py_type, f"{name}: the Python check accepted it"
    assert c_msg == py_msg, f"{name}: C ABI says {c_msg!r}, Python {py_msg!r}"


def test_a_bad_input_leaves_no_engine_state_behind(target_model, tmp_dir):
    # after a refusal both engines run normally on the same context
    with Context(target_model, n_ctx=256, n_batch=32, n_threads=1, n_threads_batch=1) as ctx:
        for engine in ("python", "cpp"):
            with pytest.raises(PyspecError):
                SpeculativeGenerator(ctx, spec(T.NGRAM_MOD, ngram_mod__n_match=0), backend=engine).generate([PROMPT], 2)
        out = []
        for engine in ("python", "cpp"):
            with SpeculativeGenerator(ctx, spec(T.NGRAM_SIMPLE), greedy_sampling(), backend=engine) as g:
                out.append(g.generate([PROMPT], 6)[0].tokens)
        assert out[0] == out[1] and len(out[0]) == 6


def test_tokens_that_do_not_fit_llama_token_are_refused_alike():
    # found by scripts/fuzz.py --atheris: numpy's OverflowError named no field
    from pyspec.common import speculative as sp
    from pyspec.reference.speculative import RefSpeculative

    p = CommonParamsSpeculative(types=[T.NGRAM_MOD])
    port = sp.common_speculative_init(p, 1)
    with RefSpeculative(p, 1) as cpp:
        messages = []
        for begin in (lambda t: sp.common_speculative_begin(port, 0, t), lambda t: cpp.begin(0, t)):
            with pytest.raises(ValueError, match="fit llama_token") as err:
                begin([1, 2, 2**32 - 1])
            messages.append(str(err.value))
        assert messages[0].replace("prompt", "tokens") == messages[1]
    sp.common_speculative_free(port)


def test_a_speculative_state_for_more_sequences_than_llama_max_seq_is_refused():
    from pyspec.common import speculative as sp
    from pyspec.reference.speculative import RefSpeculative

    p = CommonParamsSpeculative(types=[T.NGRAM_SIMPLE])
    for init in (sp.common_speculative_init, RefSpeculative):
        with pytest.raises(ValueError, match="LLAMA_MAX_SEQ"):
            init(p, 2**31 - 1)


def test_an_accepted_count_outside_uint16_is_refused_alike():
    # found by scripts/fuzz.py --atheris: the reference passed 2^32 - 1 to cffi (OverflowError)
    from pyspec.common import speculative as sp
    from pyspec.reference.speculative import RefSpeculative

    p = CommonParamsSpeculative(types=[T.NGRAM_SIMPLE])
    port = sp.common_speculative_init(p, 1)
    assert port is not None
    with RefSpeculative(p, 1) as cpp:
        for n in (-1, 0x10000, 2**32 - 1):
            errors = []
            for accept in (lambda k: sp.common_speculative_accept(port, 0, k), lambda k: cpp.accept(0, k)):
                with pytest.raises(ValueError) as err:
                    accept(n)
                errors.append(str(err.value))
            assert errors[0] == errors[1] == f"n_accepted must fit in uint16, got {n}"
    sp.common_speculative_free(port)


def test_infill_on_a_piece_longer_than_its_buffer_is_refused_alike(tmp_path):
    # llama.cpp's infill sampler keeps pieces in 512-byte buffers and grows them with
    # resize(negative length): std::length_error through the C API, an abort
    from pyspec import Model, SamplerChain
    from pyspec.common.checks import check_sampling_params
    from pyspec.testing import models as tm

    kv = [(k, [*v[:1000], "\u2581" + "x" * 600, *v[1001:]] if k == "tokenizer.ggml.tokens" else v, t, st)
          for k, v, t, st in tm.llama_vocab_kv()]
    s = sampling(top_k=40, samplers=[CommonSamplerType.TOP_K, CommonSamplerType.INFILL])
    with Model(tm.write_llama(tmp_path / "long-piece.gguf", vocab_kv=kv)) as m:
        py_type, py_msg, _ = outcome(lambda: check_sampling_params(s, m.vocab.n_tokens, m.n_ctx_train, m.vocab.ptr))
        assert py_type == "SpeculativeError" and "this vocabulary has one of 601" in py_msg
        assert _c_sampler_init(m, s) == py_msg
        with pytest.raises(ValueError, match="one of 601"):
            SamplerChain().add_top_k(40).add_infill(m.vocab)
