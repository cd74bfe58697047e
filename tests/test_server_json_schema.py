"""JSON schemas as llama-server takes them (``json_schema``, chat's ``response_format``): the converter's
grammar makes the tiny model write documents valid under the schema, sampled at temperature 1 with many
seeds; what it cannot enforce is refused with a 400 naming the keyword."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from pyspec import Context, Model
from pyspec.common.params import CommonParamsSampling
from pyspec.core.grammar import check_grammar
from pyspec.generation.engine import Engine
from pyspec.server.app import create_app
from pyspec.server.json_schema import json_schema_to_grammar
from pyspec.server.params import ServerDefaults
from pyspec.testing import models as tm

MESSAGES = [{"role": "user", "content": "Write an example"}]


def _valid(doc: Any, schema: Any, root: Any) -> bool:
    """Whether ``doc`` is valid under ``schema``, for the keywords these tests use (an independent check)."""
    if schema is True or schema == {}:
        return True
    if "$ref" in schema:
        return _valid(doc, root["$defs"][schema["$ref"].rpartition("/")[2]], root)
    if "const" in schema:
        return bool(doc == schema["const"])
    if "enum" in schema:
        return doc in schema["enum"]
    if "anyOf" in schema:
        return any(_valid(doc, s, root) for s in schema["anyOf"])
    t = schema.get("type")
    if isinstance(t, list):
        return any(_valid(doc, {**schema, "type": x}, root) for x in t)
    checks = {"object": lambda: isinstance(doc, dict)
              and all(k in doc for k in schema.get("required", []))
              and all(k in schema.get("properties", {}) or "properties" not in schema for k in doc)
              and all(_valid(v, schema.get("properties", {}).get(k, schema.get("additionalProperties", True)), root)
                      for k, v in doc.items()),
              "array": lambda: isinstance(doc, list)
              and schema.get("minItems", 0) <= len(doc) <= schema.get("maxItems", len(doc))
              and all(_valid(v, schema.get("items", True), root) for v in doc),
              "string": lambda: isinstance(doc, str)
              and schema.get("minLength", 0) <= len(doc) <= schema.get("maxLength", len(doc)),
              "integer": lambda: isinstance(doc, int) and not isinstance(doc, bool)
              and doc >= schema.get("minimum", doc),
              "number": lambda: isinstance(doc, (int, float)) and not isinstance(doc, bool),
              "boolean": lambda: isinstance(doc, bool), "null": lambda: doc is None}
    return bool(checks[t]())


# each keeps its documents short: bounded strings and arrays, so that a random model ends them
SCHEMAS = [
    {"const": "42"},
    {"enum": ["red", 7, None, {"a": [1]}]},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                      "age": {"type": "integer", "minimum": 0},
                                      "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
     "required": ["name", "tags"]},
    {"type": "array", "items": {"type": ["number", "null"]}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"x": {"anyOf": [{"type": "string", "minLength": 1, "maxLength": 3},
                                                       {"type": "boolean"}]}}},
    {"$defs": {"pair": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2}},
     "type": "object", "properties": {"p": {"$ref": "#/$defs/pair"}, "q": {"$ref": "#/$defs/pair"}},
     "required": ["p"]},
    {"type": "string", "minLength": 2, "maxLength": 5},
]


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    model = Model(tm.make_chat_target())
    ctx = Context(model, n_ctx=512, n_batch=64, n_ubatch=64, n_seq_max=1, n_threads=1, n_threads_batch=1)
    eng = Engine(ctx, None, CommonParamsSampling(temp=1.0, top_k=0, top_p=1.0, min_p=0.0), n_parallel=1,
                 owned=[ctx, model])
    with TestClient(create_app(eng, defaults=ServerDefaults(sampling=eng.sampling))) as c:
        yield c
    eng.close()


@pytest.mark.parametrize("schema", SCHEMAS, ids=[json.dumps(s)[:40] for s in SCHEMAS])
def test_the_grammar_only_lets_valid_documents_out(client: TestClient, schema: dict[str, Any]):
    check_grammar(json_schema_to_grammar(schema))  # llama.cpp parses it
    seen = set()
    for seed in range(6):
        r = client.post("/completion", json={"prompt": "x", "n_predict": 160, "seed": seed, "json_schema": schema})
        assert r.status_code == 200, r.text
        assert r.json()["stop_type"] == "eos", r.json()["content"]  # the grammar ended the document
        doc = json.loads(r.json()["content"])
        assert _valid(doc, schema, schema), (schema, doc)
        seen.add(json.dumps(doc))
    if "const" not in schema:
        assert len(seen) > 1  # sampled, not one fixed answer


@pytest.mark.parametrize("response_format,expected", [
    ({"type": "json_object", "schema": {"const": "42"}}, '"42"'),
    ({"type": "json_schema", "json_schema": {"schema": {"const": "foooooo"}}}, '"foooooo"'),
])
def test_response_format_constrains_the_chat(client: TestClient, response_format: dict[str, Any], expected: str):
    # llama-server's test_completion_with_response_format
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 10,
                                                  "response_format": response_format})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"].strip() == expected  # and space
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 10,
                                                  "json_schema": response_format.get("schema", {"const": "x"})})
    assert r.status_code == 200


def test_json_object_without_a_schema_is_an_object(client: TestClient):
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4, "seed": 3,
                                                  "response_format": {"type": "json_object"}})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"].startswith("{")
    assert client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4,
                                                     "response_format": {"type": "text"}}).status_code == 200


def test_a_grammar_given_wins_over_a_schema_in_completion(client: TestClient):
    r = client.post("/completion", json={"prompt": "x", "n_predict": 6, "grammar": 'root ::= "a"{5,5}',
                                         "json_schema": {"const": "42"}})
    assert r.json()["content"] == "aaaaa"


def _nested_type_lists(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": ["array", "array"], "items": schema}
    return schema


@pytest.mark.parametrize("body,message", [
    ({"response_format": {"type": "sound"}}, "'response_format': type must be one of"),
    ({"response_format": {"type": "json_object", "schema": 123}}, "a schema must be an object"),
    ({"response_format": {"type": "json_object", "schema": {"type": 123}}}, "'type' must be a type name"),
    ({"response_format": {"type": "json_object", "schema": {"type": "hiccup"}}}, "unrecognized type 'hiccup'"),
    ({"response_format": "json"}, "'response_format' must be an object"),
    ({"json_schema": {"const": 1}, "grammar": 'root ::= "a"'}, "Cannot use both json_schema and grammar"),
    ({"json_schema": {"type": "string", "pattern": "a+"}}, "unsupported keyword 'pattern'"),
    ({"json_schema": {"type": "integer", "maximum": 3}}, "unsupported keyword 'maximum'"),
    ({"json_schema": {"type": "integer", "minimum": 5}}, "'minimum' other than 0"),
    ({"json_schema": {"$ref": "https://example.com/s.json"}}, "only local references"),
    ({"json_schema": {"$ref": "#/$defs/missing"}}, "names no definition"),
    ({"json_schema": {"properties": {"a": {}}, "required": ["b"]}}, "required property 'b'"),
    ({"json_schema": {"type": "array", "minItems": 3, "maxItems": 2}}, "'maxItems' is less than 'minItems'"),
    ({"json_schema": {"type": "array", "maxItems": 10**9}}, "'maxItems' must be an integer"),
    ({"json_schema": {"enum": []}}, "'enum' must be a non-empty list"),
    ({"json_schema": {"const": "\ud800"}}, "not valid Unicode"),
    ({"json_schema": {"enum": ["x" * 200] * 400}}, "more than the"),
    ({"json_schema": {"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}, {"type": "null"}]}}, "$ref": "#/$defs/a"}},
     "left-recursive"),
    # each level doubles the item twice: 690 bytes asked for gigabytes before the size was checked
    ({"json_schema": _nested_type_lists(16)}, "more than the 32768 characters allowed"),
    ({"json_schema": {"allOf": [{"$ref": "#/definitions/a"}], "definitions": [1]}}, "names no definition"),
    ({"json_schema": {"allOf": [{"$ref": 5}]}}, "only local references"),
    ({"json_schema": {"allOf": [{"type": "object"}], "properties": [1, 2]}}, "'properties' must be an object"),
    ({"json_schema": {"allOf": [{"type": "object"}], "required": 5}}, "'required' a list of names"),
    ({"json_schema": {"type": "object", "properties": {"a": {}}, "required": [[1]]}}, "'required' a list of names"),
    ({"json_schema": {"const": float("nan")}}, "no NaN or infinity"),
    ({"json_schema": {"type": "array", "minItems": 2001}}, "'minItems' must be an integer in [0, 2000]"),
])
def test_schemas_that_cannot_be_enforced_are_refused(client: TestClient, body: dict[str, Any], message: str):
    r = client.post("/v1/chat/completions", content=json.dumps({"messages": MESSAGES, "max_tokens": 2, **body}),
                    headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text


def test_a_self_referring_schema_is_a_recursive_grammar(client: TestClient):
    schema = {"$defs": {"node": {"type": "object", "properties": {
        "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}}, "required": ["next"]}},
        "$ref": "#/$defs/node"}
    g = json_schema_to_grammar(schema)
    check_grammar(g)
    assert g.count("ref-node ::=") == 1
    r = client.post("/completion", json={"prompt": "x", "n_predict": 400, "seed": 1, "json_schema": schema})
    assert r.json()["stop_type"] == "eos", r.json()["content"]
    doc = json.loads(r.json()["content"])
    while doc is not None:  # a chain of nodes ending in null
        assert set(doc) == {"next"}
        doc = doc["next"]


def _schemas() -> Any:
    from hypothesis import strategies as st

    leaf = st.one_of(st.sampled_from([True, {}, {"type": "string"}, {"type": "integer", "minimum": 0},
                                      {"type": "number"}, {"type": "null"}, {"type": "boolean"},
                                      {"type": "hiccup"}, {"pattern": "x"}, 5, None]),
                     st.builds(lambda v: {"const": v}, st.one_of(st.text(max_size=5), st.integers(), st.none())),
                     st.builds(lambda v: {"enum": v}, st.lists(st.text(max_size=3), max_size=3)))

    def extend(inner: Any) -> Any:
        props = st.dictionaries(st.text(max_size=4), inner, max_size=3)
        return st.one_of(
            st.builds(lambda p, r: {"type": "object", "properties": p, "required": r}, props,
                      st.lists(st.text(max_size=4), max_size=2)),
            st.builds(lambda i, lo, hi: {"type": "array", "items": i, "minItems": lo, "maxItems": hi}, inner,
                      st.integers(-1, 3), st.integers(-1, 4)),
            st.builds(lambda xs: {"anyOf": xs}, st.lists(inner, max_size=3)),
            st.builds(lambda xs: {"allOf": xs}, st.lists(inner, max_size=2)),
            st.builds(lambda t, s: {**s, "type": t} if isinstance(s, dict) else s,
                      st.lists(st.sampled_from(["string", "null", "object"]), max_size=2), inner),
            st.builds(lambda d: {"$defs": {"a": d}, "$ref": "#/$defs/a"}, inner),
        )
    return st.recursive(leaf, extend, max_leaves=12)


def test_any_schema_is_refused_with_a_reason_or_turned_into_a_grammar_llama_cpp_parses():
    from hypothesis import HealthCheck, given, settings

    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(_schemas())
    def check(schema: Any) -> None:
        try:
            g = json_schema_to_grammar(schema)
        except ValueError as e:
            assert str(e).startswith(("schema", "#/"))  # names where in the schema
            return
        try:
            check_grammar(g)
        except ValueError as e:  # a definition that reaches itself first: llama.cpp's check refuses it (a 400)
            assert "left-recursive" in str(e), g

    check()
