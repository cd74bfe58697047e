"""scripts/bump_llama.py: the report a llama.cpp bump starts from (hunks, twins, types, declarations)."""

from __future__ import annotations

import functools
import http.server
import sys
import threading
from pathlib import Path

import pytest
from script_modules import load_script

from pyspec.testing.models import llama_cpp_dir


@pytest.fixture(scope="module")
def bump():
    yield load_script("bump_llama")
    del sys.modules["bump_llama"]


CPP = """\
#include "x.h"

struct common_thing_impl : public common_base {
    int n = 0;

    common_thing_impl(int n) : n(n) {
    }

    void draft(int k) override {
        if (k > 0) {
            n += k;
        }
    }
};

static int common_helper(int a) {
    return a + 1;
}
"""

PY = """\
class CommonThingImpl:
    def __init__(self, n):
        self.n = n

    def draft(self, k):
        if k > 0:
            self.n += k


def common_helper(a):
    return a + 1
"""


def test_each_line_knows_the_definition_it_falls_in(bump):
    lines = CPP.splitlines()
    where = bump.definitions(lines)
    at = {line.strip(): where[i] for i, line in enumerate(lines) if line.strip()}
    assert at["n += k;"] == ("common_thing_impl", "draft")
    assert at["common_thing_impl(int n) : n(n) {"] == ("common_thing_impl", "common_thing_impl")
    assert at["return a + 1;"] == ("", "common_helper")
    assert at['#include "x.h"'] == ("", "")


def test_a_hunk_names_its_cpp_definition_and_python_twin(bump, tmp_path):
    twin = tmp_path / "thing.py"
    twin.write_text(PY)
    new = CPP.replace("n += k;", "n += 2 * k;").replace("return a + 1;", "return a + 2;")
    hunks = bump.annotated_diff(CPP, new, [twin])
    places = [(st, fn, tw.split(" ", 1)[1]) for h in hunks for st, fn, tw in h.where]
    assert ("common_thing_impl", "draft", "CommonThingImpl.draft") in places
    assert ("", "common_helper", "def common_helper") in places
    assert all(line[0] in " +-" for h in hunks for line in h.lines)
    assert any(line == "+            n += 2 * k;" for h in hunks for line in h.lines)


def test_a_new_method_points_at_its_class_and_says_it_is_missing(bump, tmp_path):
    twin = tmp_path / "thing.py"
    twin.write_text(PY)
    assert bump.find_twin("common_thing_impl", "get_state", [twin]).endswith("class CommonThingImpl (no get_state yet)")
    assert bump.find_twin("common_other", "", [twin]) == ""


def test_the_revision_comes_from_the_sdists_changelog_section(bump):
    text = (
        "# Changelog\n\n## [0.3.36]\n\n- feat: update llama.cpp to ggml-org/llama.cpp@0c1e57098\n"
        "- fix: x\n\n## [0.3.35]\n\n- feat: update llama.cpp to ggml-org/llama.cpp@abcdef123\n"
    )
    assert bump.revision_from_changelog(text, "0.3.36") == "0c1e57098"
    assert bump.revision_from_changelog(text, "0.3.35") == "abcdef123"
    assert bump.revision_from_changelog("# nothing here\n", "0.3.36") == "?"


def test_new_types_and_parameter_fields_are_listed(bump, tmp_path):
    header = (llama_cpp_dir() / "common" / "common.h").read_text()
    old, new = tmp_path / "old", tmp_path / "new"
    for tree, text in ((old, header), (new, header.replace(
        "COMMON_SPECULATIVE_TYPE_COUNT", "COMMON_SPECULATIVE_TYPE_DRAFT_NEW,\n    COMMON_SPECULATIVE_TYPE_COUNT", 1,
    ))):
        (tree / "common").mkdir(parents=True)
        (tree / "common" / "common.h").write_text(text)
    lines = bump.speculative_section(old, new)
    assert any("added: COMMON_SPECULATIVE_TYPE_DRAFT_NEW" in line for line in lines)


def _tree_with_one_edit(tmp_path: Path) -> Path:
    """A candidate tree: the vendored one (linked), with one line of common/speculative.cpp changed."""
    src, tree = llama_cpp_dir(), tmp_path / "llama.cpp"
    tree.mkdir()
    for entry in src.iterdir():
        if entry.name != "common":
            (tree / entry.name).symlink_to(entry)
    (tree / "common").mkdir()
    for entry in (src / "common").iterdir():
        (tree / "common" / entry.name).symlink_to(entry)
    spec = tree / "common" / "speculative.cpp"
    text = spec.read_text()
    spec.unlink()
    needle = (
        "void common_speculative_begin(common_speculative * spec, llama_seq_id seq_id, const llama_tokens & prompt) {"
    )
    assert needle in text
    spec.write_text(text.replace(needle, needle + "\n    // a change a bump would bring", 1))
    return tree


def test_the_report_on_the_pinned_tree_finds_nothing_to_do(bump, tmp_path):
    cand = bump.Candidate("llama-cpp-python==0", tmp_path / "a.tar.gz", "0" * 64, "abc1234", llama_cpp_dir())
    counts = bump.write_report(cand, llama_cpp_dir(), tmp_path / "REPORT.md", 0.0)
    assert counts == {"drifted_texts": 0, "decl_problems": 0}
    assert "Every recorded text is unchanged." in (tmp_path / "REPORT.md").read_text()


def test_the_report_names_the_changed_function_and_its_twin(bump, tmp_path):
    tree = _tree_with_one_edit(tmp_path)
    cand = bump.Candidate("llama-cpp-python==0", tmp_path / "a.tar.gz", "0" * 64, "abc1234", tree)
    counts = bump.write_report(cand, llama_cpp_dir(), tmp_path / "REPORT.md", 0.0)
    report = (tmp_path / "REPORT.md").read_text()
    assert counts["drifted_texts"] == 1
    assert "### common/speculative.cpp: 1 hunks, +1 -0" in report
    assert "`common_speculative_begin` → pyspec/common/speculative.py:" in report
    assert "+    // a change a bump would bring" in report
    assert 'LLAMA_CPP_REVISION = "abc1234"' in report


def test_the_fetcher_finds_a_candidate_archive_by_name(bump, tmp_path):
    page = tmp_path / "simple" / "llama-cpp-python"
    page.mkdir(parents=True)
    (page / "index.html").write_text(
        '<a href="../../f/llama_cpp_python-0.3.35.tar.gz#sha256=1">x</a>'
        '<a href="../../f/llama_cpp_python-0.3.36.tar.gz#sha256=2">y</a>'
    )
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        index = f"http://127.0.0.1:{server.server_address[1]}/simple"
        try:
            url = bump._fetcher().find_archive_url(
                index, name="llama-cpp-python", archive="llama_cpp_python-0.3.36.tar.gz",
            )
        finally:
            server.shutdown()
    assert url == f"{index.rsplit('/', 1)[0]}/f/llama_cpp_python-0.3.36.tar.gz"
