"""Shared fixtures: the tiny deterministic models, opened once per session."""

from __future__ import annotations

import pytest

from pyspec import Context, Model
from pyspec.testing import models as tm


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
