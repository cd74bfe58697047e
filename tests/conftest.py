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
