"""The server's API key: ``Authorization: Bearer <key>`` (or llama-server's ``X-Api-Key``), compared in constant
time; everything else gets llama-server's 401 body, and the public endpoints need no key."""

from __future__ import annotations

import hmac
from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from pyspec import Context, Model
from pyspec.common.params import CommonParamsSpeculative
from pyspec.common.params import CommonSpeculativeType as T
from pyspec.generation.engine import Engine, greedy_sampling
from pyspec.server import app as server_app
from pyspec.server.app import create_app
from pyspec.testing import models as tm

KEY = "s3cret-key"
# tools/server/server-http.cpp, middleware_validate_api_key
UNAUTHORIZED = {"error": {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}}


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    model = Model(tm.make_chat_target())
    ctx = Context(model, n_ctx=256, n_batch=64, n_ubatch=64, n_seq_max=1, n_threads=1, n_threads_batch=1)
    engine = Engine(ctx, CommonParamsSpeculative(types=[T.NGRAM_SIMPLE]), greedy_sampling(), n_parallel=1,
                    owned=[ctx, model], adaptive_draft=False)
    with TestClient(create_app(engine, api_key=KEY), raise_server_exceptions=False) as c:
        yield c
    engine.close()


@pytest.mark.parametrize("headers", [
    {"Authorization": f"Bearer {KEY}"},
    {"Authorization": f"bearer {KEY}"},  # the scheme is case-insensitive (RFC 9110)
    {"Authorization": f"  Bearer   {KEY}  "},
    {"X-Api-Key": KEY},  # llama-server's Anthropic-style header, read when there is no Authorization
], ids=["bearer", "lowercase-scheme", "spaces", "x-api-key"])
def test_the_key_is_accepted_with_the_bearer_scheme(client, headers):
    r = client.get("/props", headers=headers)
    assert r.status_code == 200, r.text
    assert r.json()["total_slots"] == 1


@pytest.mark.parametrize("headers", [
    {},
    {"Authorization": KEY},  # the raw key: no scheme
    {"Authorization": f"Basic {KEY}"},
    {"Authorization": f"Token {KEY}"},
    {"Authorization": "Bearer"},
    {"Authorization": "Bearer "},
    {"Authorization": "Bearer wrong"},
    {"Authorization": f"Bearer {KEY}x"},
    {"Authorization": f"Bearer {KEY[:-1]}"},
    {"Authorization": f"Bearer{KEY}"},
    {"Authorization": b"Bearer \xff\xfe"},  # bytes that are not UTF-8: refused, not a 500
    {"X-Api-Key": f"Bearer {KEY}"},
    {"X-Api-Key": "wrong"},
    {"Authorization": "Bearer wrong", "X-Api-Key": KEY},  # as llama-server: Authorization, when given, decides
], ids=["none", "raw-key", "basic", "token", "scheme-only", "scheme-space", "wrong", "longer", "prefix",
        "no-space", "latin1", "x-api-key-bearer", "x-api-key-wrong", "bad-authorization-wins"])
def test_anything_else_gets_llama_servers_401(client, headers):
    for method, path in (("GET", "/props"), ("GET", "/slots"), ("POST", "/completion"), ("POST", "/tokenize")):
        r = client.request(method, path, headers=headers, json={"prompt": "x", "content": "x", "n_predict": 1})
        assert r.status_code == 401, (path, r.text)
        assert r.json() == UNAUTHORIZED


def test_the_public_endpoints_need_no_key(client):
    for path in ("/health", "/v1/health", "/models", "/v1/models"):
        assert client.get(path).status_code == 200, path


def test_the_key_is_compared_with_hmac_compare_digest(client, monkeypatch):
    # constant time: the comparison goes through compare_digest, on bytes (no early exit at the
    # first differing character, and any header bytes are comparable)
    calls: list[tuple[bytes, bytes]] = []
    compare = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return compare(a, b)

    monkeypatch.setattr(server_app.hmac, "compare_digest", spy)
    assert client.get("/props", headers={"Authorization": "Bearer guess"}).status_code == 401
    assert client.get("/props", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert calls == [(b"guess", KEY.encode()), (KEY.encode(), KEY.encode())]
