"""Embeddings as llama-server serves them under ``--embedding``: the Embedder (pooling, normalisation, the
length rules) against the model's own context outputs, and ``/embedding``, ``/embeddings`` and
``/v1/embeddings`` (llama-server's and OpenAI's shapes, the input forms of llama.cpp's test_embedding,
the errors) on the tiny target."""

from __future__ import annotations

import base64
import json
import math
import struct
from collections.abc import Iterator
from typing import Any

import numpy as np
import openai
import pytest
from starlette.testclient import TestClient

from pyspec import Context, Model
from pyspec.core.batch import Batch
from pyspec.errors import EmbeddingTooLarge
from pyspec.generation.embeddings import Embedder, embd_normalize
from pyspec.generation.engine import Engine, greedy_sampling
from pyspec.server.app import create_app
from pyspec.testing import models as tm

N_CTX = 256
N_UBATCH = 64
TEXT = "I believe the meaning of life is"


@pytest.fixture(scope="module")
def model() -> Iterator[Model]:
    m = Model(tm.make_target())
    yield m
    m.close()


def _reference(model: Model, tokens: list[int], pooling: str) -> np.ndarray:
    """What llama.cpp gives for ``tokens`` in a fresh context of its own: the pooled row, or every token's."""
    ctx = Context(model, n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=N_CTX, n_seq_max=1, embeddings=True,
                  pooling_type=pooling, n_threads=1, n_threads_batch=1)
    try:
        b = Batch(N_CTX, 0, 1)
        b.add_sequence(tokens, 0, 0)
        b.logits[: len(tokens)] = 1
        ctx.decode(b)
        return ctx.get_embeddings(len(tokens)).copy() if pooling == "none" else ctx.get_embeddings_seq(0).copy()
    finally:
        ctx.close()


# --- the Embedder ---------------------------------------------------------------------------


def test_embd_normalize_follows_common_embd_normalize():
    v = np.array([3.0, -4.0], dtype=np.float32)
    assert embd_normalize(v, 2).tolist() == pytest.approx([0.6, -0.8])
    assert embd_normalize(v, -1).tolist() == [3.0, -4.0]
    assert embd_normalize(v, 0).tolist() == pytest.approx([3 * 32760 / 4, -32760.0])  # int16's range
    assert embd_normalize(v, 1).tolist() == pytest.approx([3 / 7, -4 / 7])  # taxicab
    p3 = (27 + 64) ** (1 / 3)
    assert embd_normalize(v, 3).tolist() == pytest.approx([3 / p3, -4 / p3], rel=1e-6)
    assert embd_normalize(np.zeros(4, np.float32), 2).tolist() == [0.0] * 4  # no division by zero


@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_a_pooled_embedding_is_the_contexts_pooled_row_normalised(model: Model, pooling: str):
    toks = model.vocab.tokenize(TEXT, add_special=True)
    with Embedder(model, pooling=pooling, n_ctx=N_CTX, n_ubatch=N_UBATCH, n_threads=1) as e:
        assert e.pooling == pooling
        out = e.embed(toks)
        raw = e.embed(toks, normalize=-1)
    ref = _reference(model, toks, pooling)
    assert out.n_tokens == len(toks) and len(out.vectors) == 1
    np.testing.assert_allclose(raw.vectors[0], ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out.vectors[0], ref / np.linalg.norm(ref.astype(np.float64)), rtol=1e-5, atol=1e-6)
    assert abs(float(np.linalg.norm(out.vectors[0])) - 1.0) < 1e-5


def test_pooling_none_gives_each_tokens_row_unnormalised(model: Model):
    toks = model.vocab.tokenize("hello hello hello", add_special=True)
    with Embedder(model, pooling="none", n_ctx=N_CTX, n_ubatch=N_UBATCH, n_threads=1) as e:
        out = e.embed(toks)
    ref = _reference(model, toks, "none")
    assert len(out.vectors) == len(toks)
    np.testing.assert_allclose(np.stack(out.vectors), ref, rtol=1e-5, atol=1e-6)
    assert all(abs(float(np.linalg.norm(v)) - 1.0) > 1e-3 for v in out.vectors)


def test_the_model_pooling_is_used_when_none_is_asked(model: Model):
    with Embedder(model, n_ctx=N_CTX, n_ubatch=N_UBATCH, n_threads=1) as e:
        assert e.pooling == "none"  # the tiny llama target declares no pooling type


def test_last_pooling_splits_a_long_prompt_over_ubatches_with_the_same_result(model: Model):
    toks = list(range(5, 5 + 3 * N_UBATCH + 7))  # four ubatches
    with Embedder(model, pooling="last", n_ctx=N_CTX, n_ubatch=N_UBATCH, n_threads=1) as e:
        split = e.embed(toks, normalize=-1).vectors[0].astype(np.float64)
        first = e.embed(toks[:N_UBATCH], normalize=-1).vectors[0].astype(np.float64)
    ref = _reference(model, toks, "last").astype(np.float64)

    def cos(a: np.ndarray, b: np.ndarray) -> float:
        return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))

    # attention over a cache filled in several ubatches rounds differently from one pass (about 1e-3 here)
    assert cos(split, ref) > 0.99999
    assert cos(first, ref) < 0.999  # the last ubatch's last row, not the first's, is what pools


def test_prompts_that_cannot_be_embedded_are_refused_with_llama_servers_words(model: Model):
    with Embedder(model, pooling="mean", n_ctx=N_CTX, n_ubatch=N_UBATCH, n_threads=1) as e:
        with pytest.raises(EmbeddingTooLarge, match=r"input \(65 tokens\) is too large to process. increase the "
                                                    r"physical batch size \(current batch size: 64\)"):
            e.embed(list(range(5, 5 + N_UBATCH + 1)))
        with pytest.raises(ValueError, match="Input content cannot be empty"):
            e.embed([])
        with pytest.raises(ValueError, match="outside the vocabulary"):
            e.embed([10**9])
    with Embedder(model, pooling="last", n_ctx=N_CTX, n_ubatch=N_UBATCH, n_threads=1) as e:
        with pytest.raises(EmbeddingTooLarge, match="too large"):
            e.embed(list(range(5, 5 + e.n_ctx)))  # splittable, but not beyond the context


def test_bad_settings_are_refused(model: Model):
    with pytest.raises(ValueError, match="pooling must be one of"):
        Embedder(model, pooling="rank")
    with pytest.raises(ValueError, match="n_ubatch must be a positive int"):
        Embedder(model, n_ubatch=0)


# --- the endpoints -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(model: Model) -> Iterator[Engine]:
    ctx = Context(model, n_ctx=N_CTX * 2, n_batch=64, n_ubatch=64, n_seq_max=2, n_threads=1, n_threads_batch=1)
    eng = Engine(ctx, None, greedy_sampling(), n_parallel=2, owned=[ctx])
    yield eng
    eng.close()


def _client(engine: Engine, pooling: str | None) -> Iterator[tuple[TestClient, Embedder | None]]:
    emb = None if pooling is None else Embedder(engine.model, pooling=pooling, n_ctx=N_CTX, n_ubatch=N_UBATCH,
                                                n_threads=1)
    with TestClient(create_app(engine, model_name="tiny", embedder=emb)) as client:
        yield client, emb
    if emb is not None:
        emb.close()


@pytest.fixture(scope="module")
def mean(engine: Engine) -> Iterator[tuple[TestClient, Embedder | None]]:
    yield from _client(engine, "mean")


@pytest.fixture(scope="module")
def none(engine: Engine) -> Iterator[tuple[TestClient, Embedder | None]]:
    yield from _client(engine, "none")


def _vec(client: TestClient, body: dict[str, Any]) -> list[list[float]]:
    r = client.post("/v1/embeddings", json=body)
    assert r.status_code == 200, r.text
    return [d["embedding"] for d in r.json()["data"]]


def test_v1_embeddings_answers_openais_shape(mean: tuple[TestClient, Any], engine: Engine):
    client, emb = mean
    r = client.post("/v1/embeddings", json={"input": TEXT, "model": "text-embedding-3-small"})
    assert r.status_code == 200
    body = r.json()
    n = len(engine.vocab.tokenize(TEXT, add_special=True, parse_special=True))
    assert body["object"] == "list" and body["model"] == "text-embedding-3-small"
    assert body["usage"] == {"prompt_tokens": n, "total_tokens": n}
    (d,) = body["data"]
    assert d["index"] == 0 and d["object"] == "embedding" and len(d["embedding"]) == engine.model.n_embd_out
    expected = emb.embed(engine.vocab.tokenize(TEXT, add_special=True, parse_special=True)).vectors[0]
    np.testing.assert_allclose(d["embedding"], expected, rtol=1e-6)
    assert abs(math.fsum(x * x for x in d["embedding"]) - 1) < 1e-3
    assert client.post("/v1/embeddings", json={"input": TEXT}).json()["model"] == "tiny"  # the server's name


def test_native_endpoints_answer_llama_servers_list(mean: tuple[TestClient, Any]):
    client, _ = mean
    v1 = _vec(client, {"input": TEXT})[0]
    for path in ("/embedding", "/embeddings"):
        r = client.post(path, json={"input": [TEXT, "x"]})
        assert r.status_code == 200
        assert [d["index"] for d in r.json()] == [0, 1]
        assert r.json()[0]["embedding"] == [v1]  # a list of vectors: one when pooled
    # "content" instead of "input": llama-server's shape even on /v1/embeddings
    assert client.post("/v1/embeddings", json={"content": TEXT}).json() == [{"index": 0, "embedding": [v1]}]


@pytest.mark.parametrize("inp,n", [
    ("", 1), ("string", 1), ([12, 34, 56], 1), ([12, 34, "string", 56, 78], 1),
    (["string1", "string2"], 2), (["string1", [12, 34, 56]], 2), ([[12, 34, 56], [12, 34, 56]], 2),
    ([[12, 34, 56], [12, "string", 34, 56]], 2), ({"prompt_string": "string"}, 1),
    ({"content": [{"type": "text", "text": "string"}]}, 1),
    (["string1", {"prompt_string": "string2"}, {"content": [{"type": "text", "text": "string3"}]}], 3),
])
def test_every_input_form_of_llama_servers_tests_is_read(mean: tuple[TestClient, Any], inp: Any, n: int):
    vecs = _vec(mean[0], {"input": inp})
    assert len(vecs) == n and all(len(v) > 1 for v in vecs)
    if inp == [[12, 34, 56], [12, 34, 56]]:
        assert vecs[0] == vecs[1]


def test_input_forms_give_the_embedding_of_their_tokens(mean: tuple[TestClient, Any], engine: Engine):
    client, emb = mean
    v = engine.vocab
    mixed = [12, 34, "string", 56]
    expected = emb.embed([12, 34, *v.tokenize("string", add_special=False, parse_special=True), 56]).vectors[0]
    np.testing.assert_allclose(_vec(client, {"input": mixed})[0], expected, rtol=1e-6)  # no BOS before ids
    a, b = _vec(client, {"input": ["hello world", {"content": [{"type": "text", "text": "hello "},
                                                               {"type": "text", "text": "world"}]}]})
    assert a == b
    assert _vec(client, {"input": {"prompt_string": TEXT}}) == _vec(client, {"input": TEXT})


def test_base64_is_the_float32_bytes_of_the_vector(mean: tuple[TestClient, Any]):
    client, _ = mean
    vec = _vec(client, {"input": TEXT})[0]
    r = client.post("/v1/embeddings", json={"input": TEXT, "encoding_format": "base64"}).json()
    d = r["data"][0]
    assert d["encoding_format"] == "base64"
    raw = base64.b64decode(d["embedding"])
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(vec, rel=1e-7)


def test_embd_normalize_per_request(mean: tuple[TestClient, Any], engine: Engine):
    client, _ = mean
    toks = engine.vocab.tokenize(TEXT, add_special=True, parse_special=True)
    ref = _reference(engine.model, toks, "mean")
    np.testing.assert_allclose(_vec(client, {"input": TEXT, "embd_normalize": -1})[0], ref, rtol=1e-5, atol=1e-6)
    taxicab = _vec(client, {"input": TEXT, "embd_normalize": 1})[0]
    assert math.fsum(abs(x) for x in taxicab) == pytest.approx(1.0, rel=1e-5)


def test_usage_counts_every_prompts_tokens(mean: tuple[TestClient, Any], engine: Engine):
    n = len(engine.vocab.tokenize(TEXT, add_special=True, parse_special=True))
    r = mean[0].post("/v1/embeddings", json={"input": [TEXT, TEXT]}).json()
    assert r["usage"] == {"prompt_tokens": 2 * n, "total_tokens": 2 * n}


def test_pooling_none(none: tuple[TestClient, Any], engine: Engine):
    client, _ = none
    toks = engine.vocab.tokenize("hello hello hello", add_special=True, parse_special=True)
    r = client.post("/embeddings", json={"input": "hello hello hello"})
    assert r.status_code == 200
    rows = r.json()[0]["embedding"]
    assert len(rows) == len(toks)
    assert all(abs(math.fsum(x * x for x in row) - 1) > 1e-3 for row in rows)  # not normalised
    r = client.post("/v1/embeddings", json={"input": "hello hello hello"})
    assert r.status_code == 400 and "Pooling type 'none' is not OAI compatible" in r.json()["error"]["message"]


@pytest.mark.parametrize("body,message", [
    ({"input": []}, "must not be empty"),
    ({"input": {"content": "string"}}, '"content" must be an array'),
    ({"input": {"content": [{"type": "unknown"}]}}, "unsupported content[].type 'unknown'"),
    ({"input": {"content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}},
     "image input is not supported"),
    ({"input": {"content": [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}},
     "audio input is not supported"),
    ({"input": {"content": [{"type": "input_video", "input_video": {"url": "data:video/mp4;base64,AAAA"}}]}},
     "video input is not supported"),
    ({"input": "This is a test " * 64}, "too large"),
    ({}, '"input" or "content" must be provided'),
    ({"input": "x", "encoding_format": "hex"}, "Can be either float or base64"),
    ({"input": "x", "embd_normalize": "2"}, "'embd_normalize' must be an integer"),
    ({"input": [10**9]}, "outside the vocabulary"),
    ({"input": {"prompt_string": "x", "multimodal_data": ["AAAA"]}}, "multimodal"),
    ({"input": ["\ud800"]}, "not valid Unicode"),
    ({"input": 5}, "must be a string, a list of tokens"),
])
def test_bad_inputs_get_400_with_the_reason(mean: tuple[TestClient, Any], body: dict[str, Any], message: str):
    # written by json.dumps (ASCII escapes): a lone surrogate reaches the server as JSON's "\ud800"
    r = mean[0].post("/v1/embeddings", content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    assert message in r.json()["error"]["message"]


def test_a_body_that_is_not_an_object_gets_400(mean: tuple[TestClient, Any]):
    for raw in (b"[1, 2]", b"not json", b'"x"'):
        r = mean[0].post("/embeddings", content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_without_an_embedder_the_endpoints_answer_501(engine: Engine):
    for client, _ in _client(engine, None):
        for path in ("/embedding", "/embeddings", "/v1/embeddings"):
            r = client.post(path, json={"input": "x"})
            assert r.status_code == 501
            assert r.json()["error"] == {"code": 501, "type": "not_supported_error",
                                         "message": "This server does not support embeddings. "
                                                    "Start it with `--embeddings`"}


def test_the_openai_client_reads_the_answer(mean: tuple[TestClient, Any]):
    client, _ = mean
    oai = openai.OpenAI(api_key="dummy", base_url="http://testserver/v1", http_client=client)
    res = oai.embeddings.create(model="text-embedding-3-small", input=[TEXT, "This is a test"])
    assert [d.index for d in res.data] == [0, 1] and all(len(d.embedding) > 1 for d in res.data)
    assert res.data[0].embedding == pytest.approx(_vec(client, {"input": TEXT})[0], rel=1e-6)
