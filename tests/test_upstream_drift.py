"""The upstream texts the port mirrors are recorded by sha256; a changed vendored tree is caught.

pyspec/common/UPSTREAM.sha256 holds the sha256 of every upstream file (or struct,
enum, function) that a part of pyspec mirrors line for line, and names the pyspec
files that mirror it. The enum values the Python side reads from decl/common.h are
checked against the compiled C++ when the reference library opens.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pyspec.testing import upstream
from pyspec.testing.models import llama_cpp_dir


def test_the_vendored_tree_matches_the_recorded_sha256_of_every_mirrored_text():
    drifts = upstream.check(llama_cpp_dir())
    assert not drifts, "upstream changed; review, then `python -m pyspec.testing.upstream --update`:\n" + "\n".join(
        map(str, drifts))


def test_the_record_covers_every_file_the_issue_names():
    names = {s.name for s in upstream.read_record()}
    for path in ("common/speculative.cpp", "common/speculative.h", "common/sampling.cpp", "common/sampling.h",
                 "common/ngram-cache.cpp", "common/ngram-cache.h", "common/ngram-map.cpp", "common/ngram-map.h",
                 "common/ngram-mod.cpp", "common/ngram-mod.h", "include/llama.h"):
        assert path in names
    for struct in ("common_params_speculative", "common_params_speculative_draft",
                   "common_params_speculative_ngram_mod", "common_params_speculative_ngram_map",
                   "common_params_sampling"):
        assert f"common/common.h :: struct {struct}" in names
    assert "common/common.h :: enum common_speculative_type" in names
    # what the C helpers and shortcuts rely on (issue 24): the sampler, context and grammar code csrc/ mirrors
    assert {n for n in names if n.startswith(("src/llama-sampler.cpp ::", "src/llama-context.cpp ::",
                                              "src/llama-grammar.cpp ::"))} >= {
        "src/llama-sampler.cpp :: struct llama_sampler_grammar", "src/llama-sampler.cpp :: llama_sampler_top_k_impl",
        "src/llama-sampler.cpp :: llama_sampler_dist_apply", "src/llama-sampler.cpp :: llama_sampler_infill_apply",
        "src/llama-context.cpp :: llama_context::llama_context",
        "src/llama-context.cpp :: llama_context::graph_max_nodes",
        "src/llama-grammar.cpp :: llama_grammar_parser::parse_sequence",
        "src/llama-grammar.cpp :: llama_grammar_detect_left_recursion",
        "src/llama-grammar.cpp :: llama_grammar_advance_stack", "src/llama-grammar.cpp :: llama_grammar_accept_impl"}
    # the state check's walk follows what the memories write (the cell extension grew at 0c1e57098)
    assert "src/llama-kv-cells.h :: struct llama_kv_cell_ext" in names
    for src in upstream.read_record():
        for mirror in src.mirrors:
            assert (Path(__file__).resolve().parents[1] / mirror).exists(), mirror


def test_the_server_loop_row_names_the_engine_modules_and_the_cpp_loop_that_mirror_it():
    """A change of upstream's server loop is reviewed in the engine split and in its C++ mirror."""
    rows = {s.name: s.mirrors for s in upstream.read_record()}
    server = rows["tools/server/server-context.cpp"]
    for mirror in ("pyspec/generation/engine.py", "pyspec/generation/slots.py", "pyspec/generation/output.py",
                   "pyspec/generation/queue.py", "pyspec/generation/slot_memory.py", "csrc/pyspec_loop.cpp"):
        assert mirror in server
    assert "pyspec/generation/driver.py" not in server  # the driver only steps the engine
    # the C++ loop's checked twins of the two aborting memory helpers
    for helper in ("common_context_seq_rm", "common_prompt_checkpoint::"):
        assert "csrc/pyspec_loop.cpp" in rows[f"common/common.cpp :: {helper}"]


def test_every_private_llama_header_that_csrc_includes_has_a_row_naming_the_includer():
    """The C++ compiles against llama.cpp's private headers: a new pin's change to one is reviewed in its includers."""
    included = upstream.vendor_includes(llama_cpp_dir())
    for header, includer in (("src/llama-context.h", "csrc/pyspec_ext.cpp"),
                             ("src/llama-model.h", "csrc/pyspec_ext.cpp"),
                             ("src/llama-arch.h", "csrc/pyspec_ext.cpp"),
                             ("src/llama-ext.h", "csrc/pyspec_ext.cpp"),
                             ("src/llama-grammar.h", "csrc/pyspec_grammar.cpp"),
                             ("common/speculative.cpp", "csrc/pyspec_ref_speculative.cpp")):
        assert includer in included[header], header  # the scan finds the includes it guards
    assert upstream.unrecorded_includes(llama_cpp_dir()) == []


def test_a_private_header_included_without_a_row_naming_the_includer_is_reported(tmp_path):
    csrc = tmp_path / "csrc"
    shutil.copytree(upstream.CSRC, csrc)
    batch = csrc / "pyspec_batch.cpp"
    text = batch.read_text()
    # a private header with no row, one whose row names another file, and a public header
    batch.write_text(text.replace('#include "llama.h"\n',
                                  '#include "llama.h"\n#include "llama-vocab.h"\n#include "llama-grammar.h"\n'
                                  '#include "ggml-cpu.h"\n', 1))
    assert batch.read_text() != text
    assert upstream.unrecorded_includes(llama_cpp_dir(), csrc) == [
        "src/llama-vocab.h (included by csrc/pyspec_batch.cpp)",
        "src/llama-grammar.h (included by csrc/pyspec_batch.cpp)",
    ]


@pytest.fixture
def tree_copy(tmp_path) -> Path:
    """The recorded files of the vendored tree, copied (so they can be edited)."""
    src = llama_cpp_dir()
    for path in {s.path for s in upstream.read_record()}:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / path, tmp_path / path)
    return tmp_path


def test_a_changed_file_is_reported_with_the_port_modules_to_review(tree_copy):
    f = tree_copy / "common" / "ngram-mod.cpp"
    f.write_text(f.read_text().replace("EMPTY", "EMPTY ", 1))
    drifts = upstream.check(tree_copy)
    assert [d.source.name for d in drifts] == ["common/ngram-mod.cpp"]
    assert str(drifts[0]) == "common/ngram-mod.cpp changed: review pyspec/common/ngram_mod.py"


def test_a_renumbered_enum_is_reported_by_its_block(tree_copy):
    f = tree_copy / "common" / "common.h"
    text = f.read_text()
    edited = text.replace("    COMMON_SPECULATIVE_TYPE_NGRAM_SIMPLE,",
                          "    COMMON_SPECULATIVE_TYPE_DRAFT_NEW,\n    COMMON_SPECULATIVE_TYPE_NGRAM_SIMPLE,", 1)
    assert edited != text
    f.write_text(edited)
    (d,) = upstream.check(tree_copy)
    assert d.source.name == "common/common.h :: enum common_speculative_type"
    assert "pyspec/decl/common.h" in d.source.mirrors and "pyspec/common/params.py" in d.source.mirrors


def test_a_change_outside_the_recorded_blocks_of_a_file_is_not_drift(tree_copy):
    f = tree_copy / "common" / "common.h"
    f.write_text(f.read_text() + "\n// a comment far from the structs the port mirrors\n")
    g = tree_copy / "common" / "common.cpp"
    g.write_text(g.read_text() + "\nstatic int unrelated_helper(int x) { return x; }\n")
    assert upstream.check(tree_copy) == []


def test_a_missing_file_or_block_is_reported(tree_copy):
    (tree_copy / "common" / "ngram-map.h").unlink()
    f = tree_copy / "common" / "common.cpp"
    f.write_text(f.read_text().replace("common_batch::", "common_batch_v2::"))
    drifts = {d.source.name: d for d in upstream.check(tree_copy)}
    assert set(drifts) == {"common/ngram-map.h", "common/common.cpp :: common_batch::"}
    assert all(d.found is None and "is missing" in str(d) for d in drifts.values())


def test_extract_takes_every_overload_of_a_function_and_skips_declarations():
    text = (
        "int f(int x);\n"
        "int f(int x) {\n    if (x) { return 1; }\n    return 0;\n}\n"
        "void g() {\n    f(2);\n}\n"
        "int f(float y) {\n    return 2;\n}\n"
        "struct s {\n    int a = 1;\n};\n"
    )
    assert upstream.extract(text, "f") == (
        "int f(int x) {\n    if (x) { return 1; }\n    return 0;\n}\nint f(float y) {\n    return 2;\n}")
    assert upstream.extract(text, "struct s") == "struct s {\n    int a = 1;\n}"
    # a constructor's name starts its line: it is found too (common_batch::common_batch, llama_context::llama_context)
    ctor = "int c::g() {\n    return 1;\n}\nc::c(int x) : v(x) {\n    v++;\n}\n"
    assert upstream.extract(ctor, "c::c") == "c::c(int x) : v(x) {\n    v++;\n}"
    assert upstream.extract(ctor, "c::") == "int c::g() {\n    return 1;\n}\nc::c(int x) : v(x) {\n    v++;\n}"
    assert upstream.extract(text, "h") is None


def test_update_rewrites_the_hashes_and_keeps_the_sources(tree_copy, tmp_path):
    record = tmp_path / "UPSTREAM.sha256"
    shutil.copyfile(upstream.RECORD, record)
    f = tree_copy / "common" / "speculative.h"
    f.write_text(f.read_text() + "\n")
    assert len(upstream.check(tree_copy, record)) == 1
    upstream.write_record(tree_copy, record)
    assert upstream.check(tree_copy, record) == []
    assert [s.name for s in upstream.read_record(record)] == [s.name for s in upstream.read_record()]


def test_the_compiled_reference_has_the_enum_values_of_the_declarations():
    from pyspec.ffi import c_enum, ffi, ref

    out = ffi.new("int32_t *")
    declared = {**c_enum("enum common_speculative_type", ""), **c_enum("enum common_sampler_type", "")}
    assert len(declared) == 12 + 12  # 11 speculative types and COUNT, 12 sampler types
    for name, value in declared.items():
        assert ref.pyspec_ref_enum_value(name.upper().encode(), out) == 0
        assert out[0] == value, name


def test_a_renumbered_enum_in_the_compiled_reference_is_refused_when_it_opens():
    from pyspec import ffi as ffi_module
    from pyspec.ffi import ref

    class Renumbered:
        """The reference as it would be if upstream inserted a type before the n-gram types."""

        def pyspec_ref_enum_value(self, name: bytes, out):
            rc = ref.pyspec_ref_enum_value(name, out)
            if name.startswith(b"COMMON_SPECULATIVE_TYPE_NGRAM") or name == b"COMMON_SPECULATIVE_TYPE_COUNT":
                out[0] += 1
            return rc

    with pytest.raises(ImportError, match=r"COMMON_SPECULATIVE_TYPE_NGRAM_SIMPLE is 6 in pyspec/decl/common.h but 7"):
        ffi_module._check_ref_enums(Renumbered())
