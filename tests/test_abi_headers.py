"""The cffi declarations (pyspec/decl) equal the vendored llama.cpp headers, checked mechanically."""

from __future__ import annotations

import pytest

from pyspec import decl
from pyspec.testing import abi


@pytest.fixture(scope="module")
def report() -> abi.AbiReport:
    return abi.compare()


def test_declarations_match_the_headers(report):
    assert report.problems == []


def test_every_non_deprecated_llama_function_is_declared(report):
    llama = report.counts["llama.h"]
    assert llama["functions_non_deprecated"] == llama["non_deprecated_declared"]
    assert llama["functions_non_deprecated"] >= 190  # the header parsed whole, not a fragment
    # every struct and enum of llama.h is declared with its body
    assert llama["structs_declared"] == llama["structs_in_header"]
    assert llama["enums_declared"] == llama["enums_in_header"]


def test_deprecated_functions_are_left_out_and_listed_with_their_reason():
    deprecated = abi.deprecated_functions("llama.h")
    assert deprecated["llama_load_model_from_file"] == "use llama_model_load_from_file instead"
    assert deprecated["llama_sampler_init_grammar_lazy"] == "use llama_sampler_init_grammar_lazy_patterns instead"
    assert "llama_model_load_from_file" not in deprecated
    assert not any(name.startswith("__") for name in deprecated)  # the macro's own definition is skipped


def test_the_backend_device_registry_and_loading_api_and_cpu_threadpools_are_declared(report):
    mine = abi.parse_declarations()
    for fn in ("ggml_backend_dev_count", "ggml_backend_reg_by_name", "ggml_backend_load", "ggml_backend_load_all",
               "ggml_backend_dev_get_props", "ggml_backend_reg_get_proc_address"):
        assert fn in mine.functions["ggml-backend.h"]
    for fn in ("ggml_threadpool_new", "ggml_threadpool_free", "ggml_threadpool_pause", "ggml_numa_init"):
        assert fn in mine.functions["ggml-cpu.h"]
    backend = report.counts["ggml-backend.h"]
    assert backend["functions_declared"] == backend["functions_in_header"]


def _replace(text: str, old: str, new: str) -> str:
    assert old in text, old
    return text.replace(old, new, 1)


def test_mutated_declarations_are_caught():
    llama = decl.read("llama.h")
    llama = _replace(llama, "int32_t llama_model_n_layer    (const struct llama_model * model);",
                     "int64_t llama_model_n_layer    (const struct llama_model * model);")
    llama = _replace(llama, "    uint32_t n_batch;\n    uint32_t n_ubatch;",
                     "    uint32_t n_ubatch;\n    uint32_t n_batch;")
    llama = _replace(llama, "LLAMA_FTYPE_MOSTLY_Q8_0          = 7,", "LLAMA_FTYPE_MOSTLY_Q8_0          = 8,")
    llama = _replace(llama, "void llama_detach_threadpool(struct llama_context * ctx);", "")
    llama = _replace(llama, "#define LLAMA_SESSION_VERSION 10", "#define LLAMA_SESSION_VERSION 8")
    backend = _replace(decl.read("ggml-backend.h"),
                       "size_t             ggml_backend_reg_dev_count(ggml_backend_reg_t reg);",
                       "size_t             ggml_backend_reg_dev_count(ggml_backend_reg_t reg, int extra);")
    problems = abi.compare({"llama.h": llama, "ggml-backend.h": backend}).problems
    expected = [
        "llama_model_n_layer is declared as `int64_t (const struct llama_model *)`, the header has `int32_t",
        "struct llama_context_params fields differ: at #1 declared ('n_ubatch', 'uint32_t'), header ('n_batch'",
        "enum llama_ftype differs: at #4 declared ('LLAMA_FTYPE_MOSTLY_Q8_0', 8), "
        "header ('LLAMA_FTYPE_MOSTLY_Q8_0', 7)",
        "function llama_detach_threadpool of the header is not declared",
        "#define LLAMA_SESSION_VERSION is 8, the header has 10",
        "decl/ggml-backend.h: ggml_backend_reg_dev_count is declared as `size_t (ggml_backend_reg_t, int)`",
    ]
    for text in expected:
        assert any(text in p for p in problems), (text, problems)


def test_a_field_type_of_the_same_size_is_caught():
    # the layout probe cannot see this one (same offsets, same sizes): the header check does
    llama = _replace(decl.read("llama.h"), "    float    rope_freq_base;", "    int32_t  rope_freq_base;")
    problems = abi.compare({"llama.h": llama}).problems
    assert len(problems) == 1
    assert "at #14 declared ('rope_freq_base', 'int32_t'), header ('rope_freq_base', 'float')" in problems[0]


def test_a_declaration_out_of_the_header_order_is_caught():
    llama = decl.read("llama.h")
    moved = "void llama_free(struct llama_context * ctx);\n"
    llama = _replace(llama, moved, "")
    llama = _replace(llama, "struct llama_vocab;\n", "struct llama_vocab;\n" + moved)
    problems = abi.compare({"llama.h": llama}).problems
    assert len(problems) == 1 and "llama_free" in problems[0] and "header's order" in problems[0]


def test_a_declaration_the_header_does_not_have_is_caught():
    llama = decl.read("llama.h") + "\nint32_t llama_no_such_function(void);\n"
    problems = abi.compare({"llama.h": llama}).problems
    assert problems == ["decl/llama.h: function llama_no_such_function is not in the header"]
