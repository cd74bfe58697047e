"""Shared fixtures: the tiny deterministic models, opened once per session, and the contexts of each
speculative type on them, built by the library's own builder (pyspec.generation.contexts).

Test tiers: ``pytest -m "not slow"`` runs the unit, port and engine tests on the tiny models; the
slow tier is the real model, builds, fuzz, soak, subprocess-heavy and integration tests (the
command line, the server, rpc-servers). A file marks itself (``pytestmark = pytest.mark.slow``)
or its slow tests; SLOW_FILES and SLOW_TESTS mark those of files that carry no marker of their own.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from pyspec import Context, Model
from pyspec.common.params import CommonParamsSpeculative
from pyspec.generation.contexts import ContextSet, ModelSet, load_models, open_contexts, parse_types, spec_params
from pyspec.testing import models as tm

# integration files: the HTTP server end to end (its routes, fields and keys over HTTP, uvicorn in subprocesses)
SLOW_FILES = ("test_server*.py",)
# packaging checks that start a fresh interpreter per command or make every tiny model afresh
SLOW_TESTS = ("test_layout.py::test_help_works_without_the_libraries",
              "test_layout.py::test_the_tiny_models_are_made_outside_the_clone")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        name = Path(str(item.fspath)).name
        test = f"{name}::{getattr(item, 'originalname', item.name)}"
        if any(fnmatch.fnmatch(name, f) for f in SLOW_FILES) or test in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def target_path():
    return tm.make_target()


@pytest.fixture(scope="session")
def draft_path():
    return tm.make_draft()


@pytest.fixture(scope="session")
def target_model(target_path):
    with Model(target_path) as m:
        yield m


@pytest.fixture(scope="session")
def draft_model(draft_path):
    with Model(draft_path) as m:
        yield m


@pytest.fixture
def target_ctx(target_model):
    with Context(target_model, n_ctx=512, n_batch=128, n_ubatch=128, n_seq_max=2) as ctx:
        yield ctx


TypeSet = str | Sequence[Any]  # what parse_types takes: "ngram-map-k,draft-simple", [T.DRAFT_MTP], ...


@pytest.fixture(scope="session")
def tiny_model_set() -> Iterator[Callable[..., ModelSet]]:
    """``tiny_model_set(types, **model_kw)``: the tiny models ``types`` need (tiny_model_paths), loaded by
    load_models once per session for each set of files and Model keywords; closed at the end."""
    loaded: dict[tuple[Any, ...], ModelSet] = {}

    def get(types: TypeSet, **model_kw: Any) -> ModelSet:
        ts = parse_types(types) if isinstance(types, str) else list(types)
        target, draft = tm.tiny_model_paths(ts)
        key = (target, draft, repr(sorted(model_kw.items())))
        if key not in loaded:
            loaded[key] = load_models(ts, model=target, draft=draft, **model_kw)
        return loaded[key]

    yield get
    for ms in loaded.values():
        ms.close()


@pytest.fixture
def type_contexts(tiny_model_set: Callable[..., ModelSet]) -> Iterator[Callable[..., ContextSet]]:
    """``type_contexts(types_or_spec, *, model_kw=None, **open_kw)``: fresh contexts for a set of speculative
    types on the session's tiny models, through open_contexts (the builder the CLI, the engine and the server
    use). ``types_or_spec`` is what parse_types takes (the spec is then spec_params' defaults) or a
    CommonParamsSpeculative of the test's own; ``open_kw`` are open_contexts' keywords (n_ctx per sequence,
    n_batch, n_seq, ...). The spec's ``draft.ctx_dft`` is set; the contexts close when the test ends."""
    opened: list[ContextSet] = []

    def make(types_or_spec: TypeSet | CommonParamsSpeculative, *, model_kw: dict[str, Any] | None = None,
             **open_kw: Any) -> ContextSet:
        if isinstance(types_or_spec, CommonParamsSpeculative):
            spec = types_or_spec
        else:
            ts = parse_types(types_or_spec) if isinstance(types_or_spec, str) else list(types_or_spec)
            spec = spec_params(ts)
        cs = open_contexts(tiny_model_set(spec.types, **(model_kw or {})), spec, **open_kw)
        opened.append(cs)
        return cs

    yield make
    for cs in reversed(opened):
        cs.close()


# lines a test leaves for the end of the run (figures such as the parity property's counts)
_SUMMARY = pytest.StashKey[list]()


@pytest.fixture(scope="session")
def run_summary(request) -> list[str]:
    """Append lines here; they are printed after the test results."""
    return request.config.stash.setdefault(_SUMMARY, [])


def pytest_terminal_summary(terminalreporter, config) -> None:
    lines = config.stash.get(_SUMMARY, [])
    if lines:
        terminalreporter.write_sep("-", "pyspec figures")
        for line in lines:
            terminalreporter.write_line(line)
