"""Every field the HTTP server reads, sent each kind of wrong value: 400 with llama-server's error object and a
message that names the field, never a 500, and nothing queued or written.

The table is built per field kind (number, integer, boolean, string, token list, object...) from the
wrong values of that kind: the wrong JSON type, NaN and infinities (JSON's NaN / Infinity and a
literal that overflows a double), integers beyond int32 / int64 and with thousands of digits, values
out of range, empty and over-long strings, lone surrogates, and a nested value where a flat one is
expected. Bodies are raw JSON text, so values Python's json would not write reach the server.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from pyspec import Context, Model
from pyspec.common.params import CommonParamsSpeculative
from pyspec.common.params import CommonSpeculativeType as T
from pyspec.errors import SlotBusyError
from pyspec.generation.engine import Engine, greedy_sampling
from pyspec.server.app import create_app
from pyspec.server.params import (
    MAX_FILENAME_BYTES,
    MAX_GRAMMAR_BYTES,
    MAX_JSON_DEPTH,
    MAX_LOGIT_BIAS,
    MAX_N_PROBS,
    MAX_PROMPTS,
    MAX_RESPONSE_FIELDS,
    MAX_STOP_CHARS,
    MAX_STOPS,
    ServerDefaults,
)
from pyspec.testing import models as tm

N_PARALLEL = 2

# JSON texts of wrong values, by what they break
NOT_FINITE = ["NaN", "Infinity", "-Infinity", "1e400", "-1e400"]
HUGE_INTS = [str(2**63), str(-(2**63) - 1), "1" + "0" * 30, "9" * 5000]
WRONG_TYPES = ['"1"', "true", "[1]", '{"v": 1}']
SURROGATE = '"\\ud800"'

NUMBERS = {  # field: an out-of-range value
    "temperature": "1e7", "top_p": "1.5", "min_p": "-0.5", "typical_p": "2", "repeat_penalty": "-1",
    "presence_penalty": "3", "frequency_penalty": "-3",
}
INTEGERS = {  # field: an out-of-range value
    "n_predict": "-2", "max_tokens": "-5", "max_completion_tokens": "-5", "top_k": "-1", "repeat_last_n": "-2",
    "seed": "-2", "min_keep": "-1", "n_probs": "101", "id_slot": str(N_PARALLEL), "slot_id": "-2",
    "speculative.n_max": "-1", "speculative.n_min": "-1", "n": str(N_PARALLEL + 1),
}
BOOLEANS = ["cache_prompt", "stream"]

# what names the culprit where it is not one quoted field: a message index, the path, the body
UNQUOTED = {"messages", "slot id", "JSON object", "JSON", "levels deep"}

COMPLETION = ('"prompt": "x"', '"n_predict": 2')
CHAT = ('"messages": [{"role": "user", "content": "x"}]', '"max_tokens": 2')


def obj(*members: str) -> str:
    """A JSON object's text from its members' texts ('"name": value')."""
    return "{" + ", ".join(members) + "}"


def _cases() -> Iterator[Any]:
    def case(path: str, body: str, field: str, what: str) -> Any:
        return pytest.param(path, body, field, id=f"{path} {field} {what}"[:120])

    for name, out_of_range in NUMBERS.items():
        for v in [*NOT_FINITE, *WRONG_TYPES, out_of_range, "1" + "0" * 400]:
            yield case("/completion", obj(*COMPLETION, f'"{name}": {v}'), name, v[:12])
    for name, out_of_range in INTEGERS.items():
        beyond = [str(2**32)] if name == "seed" else [str(2**31)]  # seed is a uint32
        for v in [*NOT_FINITE, *HUGE_INTS, *beyond, *WRONG_TYPES, "1.5", out_of_range]:
            yield case("/completion", obj(*COMPLETION, f'"{name}": {v}'), name, v[:12])
    for sub in ("n_max", "n_min"):  # llama-server's nested form
        for v in ["-1", "NaN", "1e400", str(2**63), '"4"']:
            yield case("/completion", obj(*COMPLETION, f'"speculative": {{"{sub}": {v}}}'), f"speculative.{sub}", v)
    for v in ["5", '"x"', "[1]", "true"]:
        yield case("/completion", obj(*COMPLETION, f'"speculative": {v}'), "speculative", v)
    for name in BOOLEANS:
        for v in ['"true"', "1", "0", "[]", "{}"]:
            yield case("/completion", obj(*COMPLETION, f'"{name}": {v}'), name, v)
            yield case("/v1/chat/completions", obj(*CHAT, f'"{name}": {v}'), name, v)

    # prompt: a string or token ids
    for v in ["null", "5", "true", "{}", '{"a": "b"}', "[1.5]", "[true]", "[]", "[[]]", SURROGATE,
              '[["x"]]', "[-1]", "[99999999]", f"[{2**63}]", f"[{'9' * 5000}]", "[NaN]"]:
        yield case("/completion", obj('"n_predict": 2', f'"prompt": {v}'), "prompt", v[:12])
        yield case("/v1/completions", obj('"max_tokens": 2', f'"prompt": {v}'), "prompt", v[:12])
    # stop: a string or a list of strings
    for v in ["5", "[5]", '[["a"]]', '{"a": "b"}', "true", SURROGATE, f"[{SURROGATE}]"]:
        yield case("/completion", obj(*COMPLETION, f'"stop": {v}'), "stop", v)
    # grammar: GBNF text
    for v, what in [("5", "number"), ("[]", "list"), (SURROGATE, "surrogate"), ('"root ::= ("', "parse error"),
                    (json.dumps('root ::= "\\x00"'), "NUL literal"), (json.dumps('root ::= "a" "\\u0000"'), "NUL late"),
                    (json.dumps("root ::= [\\x00]"), "NUL class"),
                    (json.dumps("root ::= [^\\x01-\\U0010FFFF]"), "NUL negated class"),
                    (json.dumps('root ::= "\0"'), "raw NUL")]:
        yield case("/completion", obj(*COMPLETION, f'"grammar": {v}'), "grammar", what)
    # logit_bias: {token: bias} or [[token, bias], ...]
    # (a text key is tokenized, as llama-server does: '{"x": 1}' is good, its neighbours below)
    for v in ['"x"', "5", "true", "[1]", "[[1]]", "[[1, 2, 3]]", "[[1e400, 1]]", "[[Infinity, 1]]", "[[NaN, 1]]",
              "[[-Infinity, 1]]", '[["x", "1"]]', f'[["{"x" * (MAX_STOP_CHARS + 1)}", 1]]', '[["\\ud800", 1]]',
              "[[true, 1]]", "[[1.5, 1]]", "[[-1, 1]]",
              "[[99999999, 1]]", f"[[{'9' * 5000}, 1]]", f'{{"{2**63}": 1}}', '{"1": "x"}',
              '{"1": NaN}', '{"1": Infinity}', '{"1": 1e400}', '{"1": 101}', '{"1": true}', '{"1": [1]}',
              '[[1, {"a": 1}]]', f'{{"{"9" * 5000}": 1}}']:
        yield case("/completion", obj(*COMPLETION, f'"logit_bias": {v}'), "logit_bias", v[:12])

    # the OpenAI completion's own fields
    for v in ["true", "-1", "21", '"x"', "NaN", "1e400", str(2**63)]:
        yield case("/v1/completions", obj('"prompt": "x"', '"max_tokens": 2', f'"logprobs": {v}'), "logprobs", v[:12])
    for v in ['"yes"', "1"]:
        yield case("/v1/completions", obj('"prompt": "x"', '"max_tokens": 2', f'"echo": {v}'), "echo", v)

    # chat: messages, their content parts, logprobs, template kwargs
    for v in ["null", "5", '"x"', "[]", "{}", '{"role": "user"}', "[5]", "[[]]", '[{"content": "x"}]',
              '[{"role": 5, "content": "x"}]', '[{"role": "user", "content": 5}]',
              '[{"role": "user", "content": {"text": "x"}}]', '[{"role": "user", "content": [5]}]',
              '[{"role": "user", "content": [{"type": "text", "text": 5}]}]',
              '[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]',
              '[{"role": "user", "content": [[{"type": "text", "text": "x"}]]}]',
              f'[{{"role": "user", "content": {SURROGATE}}}]', f'[{{"role": {SURROGATE}, "content": "x"}}]',
              f'[{{"role": "user", "content": [{{"type": "text", "text": {SURROGATE}}}]}}]']:
        yield case("/v1/chat/completions", obj('"max_tokens": 2', f'"messages": {v}'), "messages", v[:16])
    for v in ['"x"', "-1", "21", "1.5", "NaN", "1e400", str(2**63), "[1]"]:
        yield case("/v1/chat/completions", obj(*CHAT, f'"logprobs": true, "top_logprobs": {v}'), "top_logprobs", v[:12])
    for v in ['"x"', "1", "[]"]:
        yield case("/v1/chat/completions", obj(*CHAT, f'"logprobs": {v}'), "logprobs", v)
        yield case("/v1/chat/completions", obj(*CHAT, f'"add_generation_prompt": {v}'), "add_generation_prompt", v)
    for v in ["5", '"x"', "[]", '{"add_generation_prompt": false}', '{"messages": []}', '{"bos_token": "x"}',
              f'{{"k": {SURROGATE}}}', f'{{"k": [{{"deep": {SURROGATE}}}]}}']:
        yield case("/v1/chat/completions", obj(*CHAT, f'"chat_template_kwargs": {v}'), "chat_template_kwargs", v[:16])

    # tokenize / detokenize
    for v in ["null", "5", "[]", '["x"]', "{}", "true", SURROGATE]:
        yield case("/tokenize", obj(f'"content": {v}'), "content", v)
    for name in ("add_special", "parse_special", "with_pieces"):
        for v in ['"true"', "1", "[]"]:
            yield case("/tokenize", obj('"content": "x"', f'"{name}": {v}'), name, v)
    for v in ["null", "5", '"x"', "{}", "[1.5]", "[true]", '["1"]', "[[1]]", "[-1]", "[99999999]", f"[{2**63}]",
              f"[{'9' * 5000}]", "[NaN]", "[Infinity]"]:
        yield case("/detokenize", obj(f'"tokens": {v}'), "tokens", v[:12])

    # slot files: the name, the slot id in the path, the action
    for v in ["null", "5", '""', "[]", '{"a": "b"}', json.dumps("a" * (MAX_FILENAME_BYTES + 1)),
              json.dumps("a" * 256), json.dumps("\u00e9" * 126),
              json.dumps("x" * 5000), '"a/b"', '"a\\\\b"', '"../x"', '".."', '".hidden"', '"x."', '" x"', '"a\\u0000b"',
              SURROGATE, '"a:b"', '"a*b"', '"a\\u2215b"', '"a\\nb"']:
        yield case("/slots/0?action=save", obj(f'"filename": {v}'), "filename", v[:12])
        yield case("/slots/0?action=restore", obj(f'"filename": {v}'), "filename", v[:12])
    for sid in ["abc", "-1", str(N_PARALLEL), "99999999999999999999", "1e400", "1.0", "1_0", "%20" + "1"]:
        yield case(f"/slots/{sid}?action=erase", "{}", "slot id", sid)
    for action in ["bogus", "", "SAVE"]:
        yield case(f"/slots/0?action={action}", '{"filename": "x"}', "action", action or "empty")

    # the body itself
    for path in ("/completion", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize",
                 "/slots/0?action=save"):
        for body, what in [("[1]", "list"), ('"x"', "string"), ("5", "number"), ("null", "null")]:
            yield case(path, body, "JSON object", what)
        yield case(path, "{not json", "JSON", "invalid")
        yield case(path, '{"a": ' * (MAX_JSON_DEPTH + 1) + "1" + "}" * (MAX_JSON_DEPTH + 1), "levels deep", "deep")
        yield case(path, "[" * 100_000 + "]" * 100_000, "JSON", "recursion")


CASES = list(_cases())


def _limit_cases() -> Iterator[Any]:
    """(path, body over the limit, body at the limit, field, limit): the fields whose cost grows per token."""
    def stops(n: int, length: int) -> str:
        return f'"stop": {json.dumps([chr(0x41 + i % 26) * length for i in range(n)])}'

    def bias_list(n: int) -> str:
        return f'"logit_bias": {json.dumps([[i % 50, 1] for i in range(n)])}'

    def bias_object(n: int) -> str:  # an object's keys are distinct: ids 0..n-1 (the chat model has more)
        return f'"logit_bias": {json.dumps({str(i): 1 for i in range(n)})}'

    def grammar(n_bytes: int) -> str:
        return f'"grammar": {json.dumps("root ::= " + chr(34) + "a" * (n_bytes - 11) + chr(34))}'

    def prompts(n: int) -> str:
        return f'"prompt": {json.dumps(["x"] * n)}'

    def fields(n: int) -> str:
        return f'"response_fields": {json.dumps([f"f{i}" for i in range(n)])}'

    rows = [
        ("/completion", stops(MAX_STOPS + 1, 1), stops(MAX_STOPS, 1), "stop", MAX_STOPS),
        ("/completion", stops(1, MAX_STOP_CHARS + 1), stops(MAX_STOPS, MAX_STOP_CHARS), "stop", MAX_STOP_CHARS),
        ("/v1/chat/completions", stops(MAX_STOPS + 1, 1), stops(MAX_STOPS, 1), "stop", MAX_STOPS),
        ("/completion", bias_list(MAX_LOGIT_BIAS + 1), bias_list(MAX_LOGIT_BIAS), "logit_bias", MAX_LOGIT_BIAS),
        ("/v1/completions", bias_object(MAX_LOGIT_BIAS + 1), bias_object(MAX_LOGIT_BIAS), "logit_bias",
         MAX_LOGIT_BIAS),
        ("/completion", grammar(MAX_GRAMMAR_BYTES + 1), grammar(MAX_GRAMMAR_BYTES), "grammar", MAX_GRAMMAR_BYTES),
        ("/completion", f'"n_probs": {MAX_N_PROBS + 1}', f'"n_probs": {MAX_N_PROBS}', "n_probs", MAX_N_PROBS),
        ("/completion", fields(MAX_RESPONSE_FIELDS + 1), fields(MAX_RESPONSE_FIELDS), "response_fields",
         MAX_RESPONSE_FIELDS),
    ]
    for path, over, at, field, limit in rows:
        base = CHAT if path == "/v1/chat/completions" else COMPLETION
        yield pytest.param(path, obj(*base, over), obj(*base, at), field, limit, id=f"{path} {field} {limit}")
    over_p, at_p = obj('"n_predict": 1', prompts(MAX_PROMPTS + 1)), obj('"n_predict": 1', prompts(MAX_PROMPTS))
    yield pytest.param("/completion", over_p, at_p, "prompt", MAX_PROMPTS, id=f"/completion prompt {MAX_PROMPTS}")


LIMITS = list(_limit_cases())


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    model = Model(tm.make_chat_target())
    ctx = Context(model, n_ctx=256 * N_PARALLEL, n_batch=64, n_ubatch=64, n_seq_max=N_PARALLEL, n_threads=1,
                  n_threads_batch=1)
    spec = CommonParamsSpeculative(types=[T.NGRAM_SIMPLE])
    eng = Engine(ctx, spec, greedy_sampling(), n_parallel=N_PARALLEL, owned=[ctx, model], adaptive_draft=False)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def slot_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("slots")


@pytest.fixture(scope="module")
def client(engine: Engine, slot_dir: Path) -> Iterator[TestClient]:
    app = create_app(engine, model_name="tiny", defaults=ServerDefaults(sampling=greedy_sampling()),
                     slot_save_path=slot_dir)
    # a server exception comes back as the 500 a client would see, not raised into the test
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def test_the_table_covers_every_endpoint_that_takes_a_body():
    paths = {p.values[0].split("?")[0].rstrip("0123456789").rstrip("/") for p in CASES}
    assert {"/completion", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/slots"} <= paths
    assert len(CASES) > 400


@pytest.mark.parametrize("path, body, field", CASES)
def test_a_bad_field_is_a_400_naming_it(client, engine, slot_dir, path, body, field):
    r = client.post(path, content=body.encode("utf-8"), headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and err["type"] == "invalid_request_error"
    # a field is named in quotes, as the messages do ('n' would occur in any message)
    needle = field if field in UNQUOTED else f"'{field}'"
    assert needle in err["message"], err["message"]
    assert not engine.busy()
    assert list(slot_dir.iterdir()) == []  # nothing written, nothing restored from


@pytest.mark.parametrize("path, over, at, field, limit", LIMITS)
def test_a_field_beyond_its_per_token_limit_is_a_400_naming_the_field_and_the_limit(client, engine, path, over, at,
                                                                                   field, limit):
    r = client.post(path, content=over.encode("utf-8"), headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert f"'{field}'" in err["message"] and str(limit) in err["message"], err["message"]
    assert not engine.busy()
    # the limit itself is served
    r = client.post(path, content=at.encode("utf-8"), headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.text[:300]


# NUL among other characters of a class, and an escaped backslash followed by the text x00: not NUL-only
NOT_NUL_GRAMMAR = r'root ::= [a-z\x00]+ | "\\x00"'


@pytest.mark.parametrize("path, body", [
    ("/completion", obj(*COMPLETION, '"temperature": 0.5', '"top_k": 40', '"seed": 4294967295',
                         '"logit_bias": {"5": false}')),
    ("/completion", obj(*COMPLETION, '"speculative": {"n_max": 0}, "stop": ["\\u0000"], "id_slot": -1')),
    ("/completion", obj(*COMPLETION, '"grammar": "root ::= [^\\"\\\\\\\\\\\\x7F\\\\x00-\\\\x1F]+"')),
    ("/completion", obj(*COMPLETION, '"n_predict": 2.0, "logit_bias": [[5, -1.5], ["6", false]]')),
    ("/completion", obj(*COMPLETION, '"logit_bias": [[" the ", -100], ["1_0", 1]], "temperature": 0')),
    ("/v1/completions", obj('"prompt": "x"', '"max_tokens": 2', '"logit_bias": {" the ": -100, "5": false}')),
    ("/completion", obj(*COMPLETION, f'"grammar": {json.dumps(NOT_NUL_GRAMMAR)}')),
    ("/v1/chat/completions", obj(*CHAT, '"chat_template_kwargs": {"enable_thinking": false}, "logprobs": true')),
    ("/v1/chat/completions", '{"max_tokens": 2, "messages": [{"role": "user", "content": '
                             '[{"type": "text", "text": "hi"}]}]}'),
    ("/tokenize", '{"content": "x", "with_pieces": true}'),
    ("/detokenize", '{"tokens": []}'),
    ("/slots/1?action=erase", "{}"),
])
def test_the_good_neighbours_of_the_bad_values_are_accepted(client, path, body):
    # the table's refusals are about the values, not the shape of the request around them
    r = client.post(path, content=body.encode("utf-8"), headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.text


def test_a_slot_file_name_of_the_longest_allowed_length_is_saved_and_restored(client, slot_dir):
    name = "\u00e9" * ((MAX_FILENAME_BYTES - 4) // 2) + "s" * ((MAX_FILENAME_BYTES - 4) % 2) + ".bin"
    assert len(name.encode()) == MAX_FILENAME_BYTES
    r = client.post("/slots/0?action=save", json={"filename": name})
    assert r.status_code == 200 and r.json()["filename"] == name
    assert client.post("/slots/0?action=restore", json={"filename": name}).status_code == 200
    (slot_dir / name).unlink()


def test_a_slot_file_name_that_is_a_folder_is_refused_and_leaves_nothing(client, slot_dir):
    (slot_dir / "adir").mkdir()
    r = client.post("/slots/0?action=save", json={"filename": "adir"})
    assert r.status_code == 400 and "is a folder" in r.json()["error"]["message"], r.text
    assert sorted(p.name for p in slot_dir.iterdir() if p.name.startswith("adir")) == ["adir"]


def test_a_command_on_a_busy_slot_is_a_conflict_the_client_may_retry(client, engine, monkeypatch):
    def busy(slot_id: int) -> int:
        raise SlotBusyError(f"slot {slot_id} is busy: it is processing a request")
    monkeypatch.setattr(engine, "erase_slot", busy)
    r = client.post("/slots/1?action=erase", json={})
    assert r.status_code == 409 and "is busy" in r.json()["error"]["message"], r.text


def test_log_probabilities_past_the_budget_are_refused_before_anything_runs(client, engine):
    body = {"prompt": [f"p{i}" for i in range(64)], "n": N_PARALLEL, "n_predict": -1, "n_probs": 100}
    r = client.post("/completion", json=body)
    assert r.status_code == 400 and "log-probabilities" in r.json()["error"]["message"], r.text
    assert not engine.busy()
    body.update(prompt="p0", n=1, n_predict=4)
    assert client.post("/completion", json=body).status_code == 200


def test_a_text_of_many_special_tokens_longer_than_a_context_is_refused_before_it_is_tokenized(client, engine):
    """llama.cpp's tokenizer takes time quadratic in the special tokens it parses (100,000 "<s>": 40 s, the
    server's event loop blocked); a text that cannot fit a slot's context is refused by its length first."""
    text = "<s>" * 100_000
    for path, body in (("/tokenize", {"content": text}), ("/completion", {"prompt": text, "n_predict": 1}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": 1})):
        r = client.post(path, json=body)
        assert r.status_code == 400 and "tokens can be" in r.json()["error"]["message"], (path, r.text)
    # special tokens not parsed, the same text is tokenized (in time linear in its length)
    r = client.post("/tokenize", json={"content": text, "parse_special": False})
    assert r.status_code == 200 and len(r.json()["tokens"]) > 100_000
    few = client.post("/tokenize", json={"content": "<s>" * 4})
    assert few.status_code == 200 and few.json()["tokens"] == [engine.vocab.bos] * 4
