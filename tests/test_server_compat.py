"""The HTTP server behaves as llama-server where its tests specify it (vendor/llama.cpp/tools/server/tests/unit):
token-list and mixed prompts, several prompts, ``n`` choices, ``usage``, the context-exceeded error,
``/apply-template``, ``/completion``'s fields, ``--no-slots`` and several API keys."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from pyspec import Context, Model
from pyspec.common.params import CommonParamsSpeculative
from pyspec.common.params import CommonSpeculativeType as T
from pyspec.generation.chat import render_chat
from pyspec.generation.engine import Engine, greedy_sampling
from pyspec.server.app import create_app
from pyspec.server.params import ServerDefaults
from pyspec.testing import models as tm

N_PARALLEL = 3
N_CTX = 256  # per slot
PROMPT = "def fib(n):\n    return fib(n - 1) + fib(n - 2)\n"
MESSAGES = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]
# llama-server's test_context_size_exceeded in turns the tiny model's template takes (no system turn but the first)
LONG_CHAT = [{"role": "user", "content": "What is the best book"}, {"role": "assistant", "content": "Book"}] * 100 \
    + [{"role": "user", "content": "And then?"}]


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    model = Model(tm.make_chat_target())
    ctx = Context(model, n_ctx=N_CTX * N_PARALLEL, n_batch=64, n_ubatch=64, n_seq_max=N_PARALLEL, n_threads=1,
                  n_threads_batch=1)
    spec = CommonParamsSpeculative(types=[T.NGRAM_SIMPLE])
    spec.ngram_simple.size_n, spec.ngram_simple.size_m = 2, 6
    eng = Engine(ctx, spec, greedy_sampling(), n_parallel=N_PARALLEL, owned=[ctx, model], adaptive_draft=False)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def http(engine: Engine) -> Iterator[TestClient]:
    app = create_app(engine, model_name="tiny", defaults=ServerDefaults(sampling=greedy_sampling()))
    with TestClient(app) as client:
        yield client


def _tokens(engine: Engine, text: str, bos: bool = True) -> list[int]:
    return engine.vocab.tokenize(text, add_special=bos, parse_special=True)


def _events(r: Any) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in r.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


# --- prompts ----------------------------------------------------------------------------


def test_a_token_list_prompt_is_the_text_prompt(http: TestClient, engine: Engine):
    text = http.post("/completion", json={"prompt": PROMPT, "n_predict": 8}).json()
    toks = http.post("/completion", json={"prompt": _tokens(engine, PROMPT), "n_predict": 8}).json()
    assert toks["tokens"] == text["tokens"] and toks["tokens_evaluated"] == text["tokens_evaluated"]


def test_a_mixed_prompt_is_tokenized_piece_by_piece_with_bos_only_before_a_leading_text(http: TestClient,
                                                                                        engine: Engine):
    ids = _tokens(engine, " x = 1", bos=False)
    r = http.post("/completion", json={"prompt": ["def f():", *ids, "\n    return x"], "n_predict": 4}).json()
    expected = _tokens(engine, "def f():") + ids + _tokens(engine, "\n    return x", bos=False)
    assert r["tokens_evaluated"] == len(expected)
    assert r["prompt"] == engine.vocab.detokenize(expected, unparse_special=True)
    lead = http.post("/completion", json={"prompt": [*ids, "\n    return x"], "n_predict": 4}).json()
    assert lead["tokens_evaluated"] == len(ids + _tokens(engine, "\n    return x", bos=False))  # no BOS


def test_several_prompts_are_several_completions_in_order(http: TestClient):
    one = [http.post("/completion", json={"prompt": p, "n_predict": 6}).json() for p in ("def a():", "class B:")]
    both = http.post("/completion", json={"prompt": ["def a():", "class B:"], "n_predict": 6}).json()
    assert isinstance(both, list) and [r["index"] for r in both] == [0, 1]
    assert [r["content"] for r in both] == [r["content"] for r in one]


def test_several_prompts_in_v1_completions_are_choices(http: TestClient):
    r = http.post("/v1/completions", json={"prompt": ["def a():", [1, 2, 3]], "max_tokens": 4}).json()
    assert [c["index"] for c in r["choices"]] == [0, 1]
    assert r["usage"]["completion_tokens"] == 8


def test_a_prompt_object_holds_its_prompt(http: TestClient):
    a = http.post("/completion", json={"prompt": [{"prompt": "def a():"}], "n_predict": 4}).json()
    b = http.post("/completion", json={"prompt": "def a():", "n_predict": 4}).json()
    assert a["content"] == b["content"]


@pytest.mark.parametrize("prompt", [[], [[]], [1.5], [{"text": "x"}], [[1, {"a": 1}]], [["x"]]])
def test_a_prompt_of_the_wrong_shape_is_400(http: TestClient, prompt: Any):
    r = http.post("/completion", json={"prompt": prompt, "n_predict": 4})
    assert r.status_code == 400 and "'prompt" in r.json()["error"]["message"]


# --- n choices and usage ----------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_in_v1_completions(http: TestClient, stream: bool):
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "n": 2, "stream": stream})
    assert r.status_code == 200, r.text
    if not stream:
        body = r.json()
        assert [c["index"] for c in body["choices"]] == [0, 1]
        assert body["choices"][0]["text"] == body["choices"][1]["text"]  # greedy: the same text twice
        usage = body["usage"]
    else:
        events = _events(r)
        texts = {0: "", 1: ""}
        for e in events:
            for c in e["choices"]:
                texts[c["index"]] += c["text"]
        assert texts[0] == texts[1] != ""
        finishes = [c for e in events for c in e["choices"] if c["finish_reason"]]
        assert sorted(c["index"] for c in finishes) == [0, 1]
        usage = events[-1]["usage"]
    n_prompt = usage["prompt_tokens"]
    assert usage["completion_tokens"] == 10 and usage["total_tokens"] == n_prompt + 10  # the prompt counted once


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_in_chat_completions_with_a_pinned_slot(http: TestClient, stream: bool):
    # llama-server's test_chat_completions_multiple_choices: id_slot pins them, nothing locks up
    for _ in range(2):
        r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 8, "n": 2, "id_slot": 0,
                                                    "stream": stream})
        assert r.status_code == 200, r.text
        if not stream:
            choices = r.json()["choices"]
            assert [c["index"] for c in choices] == [0, 1]
            assert all(c["message"]["role"] == "assistant" and c["finish_reason"] == "length" for c in choices)
        else:
            events = _events(r)
            roles = [c["index"] for e in events for c in e["choices"] if c["delta"].get("role") == "assistant"]
            assert sorted(roles) == [0, 1]
            assert sorted(c["index"] for e in events for c in e["choices"] if c["finish_reason"] == "length") == [0, 1]
            assert events[-1]["usage"]["completion_tokens"] == 16


def test_more_choices_than_slots_is_400_naming_n(http: TestClient):
    r = http.post("/v1/completions", json={"prompt": "x", "n": N_PARALLEL + 1})
    assert r.status_code == 400 and "'n'" in r.json()["error"]["message"]


def test_usage_counts_prompt_and_completion_tokens(http: TestClient, engine: Engine):
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 6}).json()
    n_prompt = len(engine.tokenize_chat(render_chat(engine.model, MESSAGES)))
    assert r["usage"]["prompt_tokens"] == n_prompt
    assert r["usage"]["completion_tokens"] == 6 and r["usage"]["total_tokens"] == n_prompt + 6
    assert "cached_tokens" in r["usage"]["prompt_tokens_details"]
    c = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3}).json()
    assert c["usage"]["prompt_tokens"] == len(_tokens(engine, PROMPT)) and c["usage"]["completion_tokens"] == 3


# --- errors -----------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "body"), [
    ("/completion", {"prompt": "x " * 400}),
    ("/completion", {"prompt": "x " * 400, "stream": True}),
    ("/v1/completions", {"prompt": "x " * 400}),
    ("/v1/chat/completions", {"messages": LONG_CHAT}),
    ("/v1/chat/completions", {"messages": LONG_CHAT, "stream": True}),  # an error before the stream: a 400
])
def test_a_prompt_that_does_not_fit_a_slot_is_llama_servers_exceed_context_size_error(http: TestClient,
                                                                                      engine: Engine, path: str,
                                                                                      body: dict[str, Any]):
    r = http.post(path, json=body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "exceed_context_size_error" and err["code"] == 400
    assert err["n_prompt_tokens"] > N_CTX and err["n_ctx"] == N_CTX
    assert f"({err['n_prompt_tokens']} tokens) exceeds the available context size ({N_CTX} tokens)" in err["message"]
    assert not engine.busy()


def test_a_bad_request_keeps_llama_servers_error_object(http: TestClient):
    r = http.post("/completion", json={"n_predict": 4})
    assert r.status_code == 400
    assert r.json() == {"error": {"code": 400, "message": "'prompt' is required", "type": "invalid_request_error"}}


# --- endpoints and fields ---------------------------------------------------------------


def test_apply_template_returns_the_rendered_chat(http: TestClient, engine: Engine):
    r = http.post("/apply-template", json={"messages": MESSAGES})
    assert r.status_code == 200
    assert r.json() == {"prompt": render_chat(engine.model, MESSAGES)}
    assert http.post("/apply-template", json={"messages": []}).status_code == 400


@pytest.mark.parametrize("path", ["/chat/completions/input_tokens", "/v1/chat/completions/input_tokens"])
def test_chat_input_tokens_counts_the_rendered_prompt(http: TestClient, engine: Engine, path: str):
    r = http.post(path, json={"messages": MESSAGES})
    assert r.json() == {"input_tokens": len(engine.tokenize_chat(render_chat(engine.model, MESSAGES)))}
    chat = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == r.json()["input_tokens"]


# llama-server's server_task_result_cmpl_final::to_json_non_oaicompat
COMPLETION_FIELDS = {"index", "content", "tokens", "id_slot", "stop", "model", "tokens_predicted", "tokens_evaluated",
                     "generation_settings", "prompt", "has_new_line", "truncated", "stop_type", "stopping_word",
                     "tokens_cached", "timings"}


def test_completion_has_llama_servers_fields(http: TestClient, engine: Engine):
    r = http.post("/completion", json={"prompt": PROMPT, "n_predict": 4, "temperature": 0.0, "top_k": 7,
                                       "stop": ["zzz"]}).json()
    assert COMPLETION_FIELDS <= set(r)
    assert r["prompt"] == engine.vocab.detokenize(_tokens(engine, PROMPT), unparse_special=True)  # BOS as text
    assert (r["tokens_predicted"], r["stop_type"], r["truncated"], r["model"]) == (4, "limit", False, "tiny")
    g = r["generation_settings"]
    assert (g["n_predict"], g["temperature"], g["top_k"], g["stop"]) == (4, 0.0, 7, ["zzz"])


def test_response_fields_select_nested_values(http: TestClient):
    # llama-server's test_completion_response_fields
    fields = ["content", "generation_settings/n_predict", "prompt", "no/such"]
    r = http.post("/completion", json={"prompt": PROMPT, "n_predict": 3, "response_fields": fields}).json()
    assert set(r) == {"content", "generation_settings/n_predict", "prompt"}
    assert r["generation_settings/n_predict"] == 3 and isinstance(r["content"], str)
    assert http.post("/completion", json={"prompt": "x", "response_fields": "content"}).status_code == 400


@pytest.mark.parametrize("stream", [False, True])
def test_return_tokens_false_leaves_the_tokens_out(http: TestClient, stream: bool):
    # llama-server's test_completion: "tokens" is [] unless return_tokens (pyspec sends them unless told not)
    body = {"prompt": PROMPT, "n_predict": 4, "stream": stream}
    off = http.post("/completion", json={**body, "return_tokens": False})
    on = http.post("/completion", json=body)
    if stream:
        assert all(e["tokens"] == [] for e in _events(off)) and any(e["tokens"] for e in _events(on))
    else:
        assert off.json()["tokens"] == [] and len(on.json()["tokens"]) == 4


def test_streamed_completion_ends_with_the_fields(http: TestClient):
    events = _events(http.post("/completion", json={"prompt": PROMPT, "n_predict": 4, "stream": True}))
    assert COMPLETION_FIELDS <= set(events[-1]) and events[-1]["stop"] is True
    assert all(e["stop"] is False for e in events[:-1])


def test_chat_uses_the_servers_chat_template(engine: Engine):
    app = create_app(engine, defaults=ServerDefaults(sampling=greedy_sampling(), chat_template="chatml"))
    with TestClient(app) as c:
        assert c.post("/apply-template", json={"messages": MESSAGES}).json()["prompt"] == \
            render_chat(engine.model, MESSAGES, template="chatml")
        r = c.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2}).json()
    expected = engine.tokenize_chat(render_chat(engine.model, MESSAGES, template="chatml"))
    assert r["usage"]["prompt_tokens"] == len(expected)
    assert len(expected) != len(engine.tokenize_chat(render_chat(engine.model, MESSAGES)))


def test_slots_report_each_slots_context(http: TestClient):
    # llama-server's test_server_slots: n_ctx per slot
    slots = http.get("/slots").json()
    assert [s["n_ctx"] for s in slots] == [N_CTX] * N_PARALLEL and [s["id"] for s in slots] == [0, 1, 2]


def test_models_list_the_aliases_and_tags(engine: Engine):
    # llama-server's test_server_model_aliases_and_tags
    with TestClient(create_app(engine, model_name="code", model_aliases=["tinyllama-2", "fim", "code"],
                               model_tags=["chat", "small"])) as c:
        model = c.get("/v1/models").json()["data"][0]
    assert (model["id"], model["aliases"], model["tags"]) == ("code", ["code", "fim", "tinyllama-2"], ["chat", "small"])
    assert model["meta"]["n_ctx"] == N_CTX


def test_post_props_needs_the_props_option(http: TestClient, engine: Engine):
    r = http.post("/props", json={})
    assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error"
    with TestClient(create_app(engine, props=True)) as c:
        assert c.post("/props", json={"n_ctx": 1}).json() == {"success": True}
        assert c.get("/props").json()["default_generation_settings"]["n_ctx"] == N_CTX  # nothing changed


def test_no_slots_answers_501_as_llama_server(engine: Engine):
    with TestClient(create_app(engine, slots=False)) as c:
        r = c.get("/slots")
    assert r.status_code == 501
    assert r.json()["error"] == {"code": 501, "type": "not_supported_error",
                                 "message": "This server does not support slots endpoint. Start it with `--slots`"}


def test_any_of_several_api_keys_is_accepted(engine: Engine):
    with TestClient(create_app(engine, api_key=["k1", "k2"])) as c:
        codes = [c.get("/props", headers={"Authorization": f"Bearer {k}"}).status_code for k in ("k1", "k2", "k3")]
        assert codes == [200, 200, 401]
        assert c.get("/props").status_code == 401


# --- JSON prompts, /infill, CORS, several addresses ------------------------------------------------


def test_a_json_prompt_object_is_its_prompt_string(http: TestClient):
    # llama-server's test_json_prompt_no_mtmd / test_completion_with_tokens_input: {"prompt_string": ...}
    text = http.post("/completion", json={"prompt": PROMPT, "n_predict": 4}).json()
    obj = http.post("/completion", json={"prompt": {"prompt_string": PROMPT}, "n_predict": 4}).json()
    assert obj["tokens"] == text["tokens"] and obj["tokens_evaluated"] == text["tokens_evaluated"]
    r = http.post("/completion", json={"prompt": {"prompt_string": PROMPT, "multimodal_data": "iVBORw0KGgo="},
                                       "n_predict": 4})
    assert r.status_code == 400 and "multimodal" in r.json()["error"]["message"]
    r = http.post("/completion", json={"prompt": {"text": PROMPT}, "n_predict": 4})
    assert r.status_code == 400 and "prompt_string" in r.json()["error"]["message"]


@pytest.fixture(scope="module")
def infill(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, Engine]]:
    from pyspec.testing import derived

    model = Model(derived.make_infill_target(tmp_path_factory.mktemp("infill") / "infill.gguf"))
    ctx = Context(model, n_ctx=N_CTX, n_batch=64, n_ubatch=64, n_seq_max=1, n_threads=1, n_threads_batch=1)
    eng = Engine(ctx, None, greedy_sampling(), n_parallel=1, owned=[ctx, model])
    with TestClient(create_app(eng, defaults=ServerDefaults(sampling=greedy_sampling(), n_predict=4))) as c:
        yield c, eng
    eng.close()


INFILL = {"input_prefix": "int main() {\n", "prompt": "    int n = llama_", "input_suffix": "}\n"}


def test_infill_prompt_is_prefix_suffix_middle_around_the_cursor(infill: tuple[TestClient, Engine]):
    from pyspec.testing.derived import FIM_TOKENS

    client, eng = infill
    v = eng.vocab

    def tok(text: str) -> list[int]:
        return v.tokenize(text, add_special=False, parse_special=False)

    r = client.post("/infill", json=INFILL)
    assert r.status_code == 200
    expected = [v.bos, FIM_TOKENS["pre"], *tok(INFILL["input_prefix"]),
                *v.tokenize(INFILL["prompt"], add_special=False, parse_special=True),
                FIM_TOKENS["suf"], *tok(INFILL["input_suffix"]), FIM_TOKENS["mid"]]
    assert r.json()["tokens_evaluated"] == len(expected)
    assert r.json()["prompt"] == v.detokenize(expected, unparse_special=True)
    # the same prompt as token ids through /completion generates the same tokens
    assert client.post("/completion", json={"prompt": expected}).json()["tokens"] == r.json()["tokens"]
    # an extra file goes before the prefix, behind llama-server's snippet separator (no FIM_SEP token)
    extra = client.post("/infill", json={**INFILL, "input_extra": [{"filename": "llama.h", "text": "int f();\n"}]})
    assert extra.status_code == 200
    assert extra.json()["tokens_evaluated"] == len(expected) + len(tok("\n\n--- snippet ---\n\n") + tok("int f();\n"))


def test_infill_keeps_the_end_of_a_long_prefix_and_the_start_of_the_suffix(infill: tuple[TestClient, Engine]):
    client, _ = infill
    # n_batch 64: the prefix keeps its last 48 tokens, the suffix 16 less the prompt and 2
    r = client.post("/infill", json={"input_prefix": "a b " * 100, "input_suffix": "c d " * 100, "prompt": ""})
    assert r.status_code == 200
    assert r.json()["tokens_evaluated"] == 1 + 1 + 48 + 1 + 14 + 1


@pytest.mark.parametrize("input_extra", [
    {}, {"filename": "ok"}, {"filename": 123}, {"filename": 123, "text": "abc"}, {"filename": 123, "text": 456},
])
def test_infill_refuses_a_bad_input_extra(infill: tuple[TestClient, Engine], input_extra: dict[str, Any]):
    # llama-server's test_invalid_input_extra_req
    r = infill[0].post("/infill", json={**INFILL, "input_extra": [input_extra]})
    assert r.status_code == 400 and "extra_context chunk" in r.json()["error"]["message"]


@pytest.mark.parametrize("body,message", [
    ({"input_suffix": "x"}, '"input_prefix" is required'),
    ({"input_prefix": "x"}, '"input_suffix" is required'),
    ({**INFILL, "prompt": 5}, '"prompt" must be a string'),
    ({**INFILL, "input_extra": {}}, '"input_extra" must be an array'),
    ({**INFILL, "input_prefix": 5}, "'input_prefix' must be a string or a list"),
    ({**INFILL, "input_suffix": [10**9]}, "outside the vocabulary"),
    ({**INFILL, "n_predict": 0}, "'n_predict'"),
])
def test_infill_refuses_bad_bodies(infill: tuple[TestClient, Engine], body: dict[str, Any], message: str):
    r = infill[0].post("/infill", json=body)
    assert r.status_code == 400 and message in r.json()["error"]["message"]


def test_infill_needs_the_models_fim_tokens(http: TestClient):
    r = http.post("/infill", json=INFILL)
    assert r.status_code == 501
    assert r.json()["error"]["message"] == ("Infill is not supported by this model: prefix token is missing. "
                                            "suffix token is missing. middle token is missing. ")


def _preflight(c: TestClient, origin: str) -> Any:
    return c.options("/completions", headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                              "Access-Control-Request-Headers": "Authorization"})


@pytest.mark.parametrize("origin,header,value", [
    ("localhost", "Access-Control-Allow-Origin", "localhost"),
    ("web.mydomain.fr", "Access-Control-Allow-Origin", "web.mydomain.fr"),
    ("origin", "Access-Control-Allow-Credentials", "true"),
    ("web.mydomain.fr", "Access-Control-Allow-Methods", "GET, POST, DELETE, OPTIONS"),
    ("web.mydomain.fr", "Access-Control-Allow-Headers", "*"),
])
def test_cors_preflight_as_llama_server_answers_it(engine: Engine, origin: str, header: str, value: str):
    from pyspec.server.cors import CorsPolicy

    # llama-server's test_cors_options: before the API key, for any origin by default
    with TestClient(create_app(engine, api_key="k", cors=CorsPolicy())) as c:
        r = _preflight(c, origin)
        assert r.status_code == 200 and r.headers[header] == value
        r = c.get("/props", headers={"Origin": origin, "Authorization": "Bearer k"})
        assert r.status_code == 200 and r.headers["Access-Control-Allow-Origin"] == origin
        assert c.get("/props", headers={"Origin": origin}).headers["Access-Control-Allow-Origin"] == origin  # a 401 too


@pytest.mark.parametrize("origin,allowed", [
    ("http://localhost", True), ("http://localhost:8080", True), ("http://127.0.0.1", True),
    ("http://127.0.0.1:3000", True), ("http://[::1]", True), ("http://[::1]:3000", True),
    ("https://user@localhost/x", True), ("http://web.mydomain.fr", False), ("http://evil.com", False),
    ("http://notlocalhost", False), ("http://localhost.evil.com", False), ("localhost", False),
    ("ftp://localhost", False), ("http://localhost:abc", False),
])
def test_cors_origins_localhost_reflects_only_local_origins(engine: Engine, origin: str, allowed: bool):
    from pyspec.server.cors import CorsPolicy

    with TestClient(create_app(engine, cors=CorsPolicy(origins="localhost"))) as c:
        r = _preflight(c, origin)
        assert r.status_code == 200
        assert r.headers.get("Access-Control-Allow-Origin") == (origin if allowed else None)


def test_cors_fixed_origins_and_no_policy(engine: Engine):
    from pyspec.server.cors import CorsPolicy

    with TestClient(create_app(engine, cors=CorsPolicy(origins="https://app.example", credentials=False,
                                                       methods="POST"))) as c:
        r = _preflight(c, "https://other.example")
        assert (r.headers["Access-Control-Allow-Origin"], r.headers["Access-Control-Allow-Credentials"],
                r.headers["Access-Control-Allow-Methods"]) == ("https://app.example", "false", "POST")
    with TestClient(create_app(engine)) as c:  # create_app's default: no CORS answers
        assert _preflight(c, "http://localhost").status_code == 405
        assert "Access-Control-Allow-Origin" not in c.get("/health", headers={"Origin": "http://x"}).headers


def test_several_addresses_are_all_bound():
    import socket

    from pyspec.server import bind_sockets, close_sockets, parse_hosts, socket_url

    assert parse_hosts(" 127.0.0.1, ::1 ,") == ["127.0.0.1", "::1"]
    with pytest.raises(ValueError, match="at least one address"):
        parse_hosts(" , ")
    with pytest.raises(ValueError, match="--port 0 is not supported with multiple TCP addresses"):
        bind_sockets("127.0.0.1,::1", 0)
    (probe,) = bind_sockets("127.0.0.1", 0)
    port = probe.getsockname()[1]
    close_sockets([probe])
    socks = bind_sockets("127.0.0.1,::1", port)
    try:
        assert [socket_url(s) for s in socks] == [f"http://127.0.0.1:{port}", f"http://[::1]:{port}"]
        assert socks[1].getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 1  # llama-server: IPv6 only
        with pytest.raises(OSError, match=rf"cannot listen on \[::1\]:{port}"):
            bind_sockets("127.0.0.2,::1", port)  # ::1 is taken: 127.0.0.2 is let go again
        close_sockets(bind_sockets("127.0.0.2", port))
    finally:
        close_sockets(socks)


class _Target:
    """A local HTTP server that records what reaches it and answers with what a path asks for."""

    def __init__(self) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        seen: list[tuple[str, str, dict[str, str], bytes]] = []

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                seen.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                status = 404 if self.path.startswith("/missing") else 200
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Access-Control-Allow-Origin", "http://target")  # stripped by the relay
                self.send_header("X-Target", "yes")
                self.end_headers()
                self.wfile.write(json.dumps({"path": self.path, "body": body.decode()}).encode())

            do_GET = do_POST = _answer

            def log_message(self, *args: Any) -> None:
                pass

        self.seen = seen
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def target() -> Iterator[_Target]:
    t = _Target()
    yield t
    t.close()


def test_cors_proxy_is_off_unless_asked(http: TestClient):
    for r in (http.get("/cors-proxy", params={"url": "http://127.0.0.1:1/"}), http.post("/cors-proxy")):
        assert r.status_code == 403
        assert r.json() == {"error": {"message": "this feature is disabled", "type": "feature_disabled"}}


def test_cors_proxy_forwards_only_the_headers_named_for_the_target(engine: Engine, target: _Target):
    # llama-server's test_cors_proxy_only_forwards_explicit_proxy_headers
    with TestClient(create_app(engine, api_key="k", cors_proxy=True)) as c:
        r = c.get("/cors-proxy", params={"url": target.url + "/capture?a=1"}, headers={
            "Authorization": "Bearer k", "Proxy-Authorization": "Basic secret", "X-Api-Key": "k",
            "Cookie": "session=secret", "x-llama-server-proxy-header-accept": "application/json",
            "x-llama-server-proxy-header-authorization": "Bearer explicit"})
        assert r.status_code == 200 and r.json() == {"path": "/capture?a=1", "body": ""}
        assert r.headers["X-Target"] == "yes" and "Access-Control-Allow-Origin" not in r.headers
        method, _, seen, _ = target.seen[-1]
        assert method == "GET" and seen["accept"] == "application/json" and seen["authorization"] == "Bearer explicit"
        assert not {"proxy-authorization", "x-api-key", "cookie"} & set(seen)
        # POST carries the body; the target's status comes back as it is
        r = c.post("/cors-proxy", params={"url": target.url + "/missing"}, content=b'{"x": 1}',
                   headers={"Authorization": "Bearer k"})
        assert r.status_code == 404 and r.json()["body"] == '{"x": 1}' and target.seen[-1][0] == "POST"
        assert c.get("/cors-proxy", params={"url": target.url}).status_code == 401  # behind the key


@pytest.mark.parametrize("url,status,message", [
    ("", 400, "'url' is required"),
    ("127.0.0.1/x", 400, "no scheme"),
    ("ftp://127.0.0.1/x", 400, "unsupported URL scheme"),
    ("http://user:pw@127.0.0.1/x", 400, "authentication in target URL is not supported"),
    ("http:///x", 400, "missing host"),
    ("http://127.0.0.1/a b", 400, "spaces or control characters"),
    ("http://127.0.0.1:1/", 502, "the target did not answer"),
])
def test_cors_proxy_refuses_bad_targets(engine: Engine, url: str, status: int, message: str):
    with TestClient(create_app(engine, cors_proxy=True)) as c:
        r = c.get("/cors-proxy", params={"url": url})
        assert r.status_code == status and message in r.json()["error"]["message"]


@pytest.mark.parametrize("openai_style", [False, True])
def test_a_text_logit_bias_key_biases_each_of_its_tokens(http: TestClient, engine: Engine, openai_style: bool):
    # llama-server's test_logit_bias with texts: [[" text ", -100], ...] or {" text ": -100}
    plain = http.post("/completion", json={"prompt": PROMPT, "n_predict": 8}).json()["tokens"]
    text = engine.vocab.detokenize(plain[:2])
    banned = engine.vocab.tokenize(text, add_special=False, parse_special=False)
    bias: Any = {text: False} if openai_style else [[text, False]]
    r = http.post("/completion", json={"prompt": PROMPT, "n_predict": 8, "logit_bias": bias})
    assert r.status_code == 200
    assert banned and not set(banned) & set(r.json()["tokens"])


def test_a_full_shared_kv_cache_fails_with_llama_servers_context_exceeded_error():
    # llama-server's test_completion_unified: four slots sharing 256 cells, each asking for 90 tokens
    import concurrent.futures

    model = Model(tm.make_cyclic_target())
    ctx = Context(model, n_ctx=256, n_batch=64, n_ubatch=64, n_seq_max=4, n_threads=1, n_threads_batch=1,
                  kv_unified=True)
    eng = Engine(ctx, None, greedy_sampling(), n_parallel=4, owned=[ctx, model])
    try:
        with TestClient(create_app(eng)) as c, concurrent.futures.ThreadPoolExecutor(4) as pool:
            rs = list(pool.map(lambda _: c.post("/completion", json={"prompt": "A", "n_predict": 90}), range(4)))
            failed = [r for r in rs if r.status_code != 200]
            assert failed
            for r in failed:
                assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
                assert r.json()["error"]["message"].startswith("Context size has been exceeded.")
            assert c.post("/completion", json={"prompt": "A", "n_predict": 8}).status_code == 200  # serving on
    finally:
        eng.close()


# --- chat turns, streaming chunks, __verbose ------------------------------------------------------------


PREFILLED = [*MESSAGES, {"role": "assistant", "content": "Whill"}]


def test_a_final_assistant_message_is_continued_not_answered(http: TestClient, engine: Engine):
    # llama-server's assistant prefill (test_chat_template_assistant_prefill): the turn stays open
    open_turn = render_chat(engine.model, MESSAGES) + " Whill"  # the tiny template writes " {content} </s>"
    assert http.post("/apply-template", json={"messages": PREFILLED}).json()["prompt"] == open_turn
    explicit = {"messages": PREFILLED, "add_generation_prompt": False, "continue_final_message": True}
    assert http.post("/apply-template", json=explicit).json()["prompt"] == open_turn  # vLLM's name for it
    parts = [*MESSAGES, {"role": "assistant", "content": [{"type": "text", "text": "Wh"},
                                                          {"type": "text", "text": "ill"}]}]
    assert http.post("/apply-template", json={"messages": parts}).json()["prompt"] == \
        render_chat(engine.model, MESSAGES) + " Wh\n\nill"  # text parts joined as llama-server joins them
    r = http.post("/v1/chat/completions", json={"messages": PREFILLED, "max_tokens": 2}).json()
    assert r["usage"]["prompt_tokens"] == len(engine.tokenize_chat(open_turn))
    # asked not to continue, the assistant's turn is closed as the template closes it
    closed = http.post("/apply-template", json={"messages": PREFILLED, "continue_final_message": False}).json()
    assert closed["prompt"] == render_chat(engine.model, PREFILLED)


@pytest.mark.parametrize("body,message", [
    ({"messages": PREFILLED, "continue_final_message": True},
     "Cannot set both add_generation_prompt and continue_final_message to true."),
    ({"messages": [*PREFILLED, {"role": "assistant", "content": "x"}]},
     "Cannot have 2 or more assistant messages at the end of the list."),
    ({"messages": MESSAGES, "continue_final_message": True, "add_generation_prompt": False},
     "the last message must be the assistant's"),
    ({"messages": PREFILLED, "continue_final_message": 1}, "'continue_final_message' must be a boolean"),
    ({"messages": MESSAGES, "stream": True, "stream_options": {"include_usage": 1}},
     "'stream_options.include_usage' must be a boolean"),
    ({"messages": MESSAGES, "stream_options": []}, "'stream_options' must be an object"),
])
def test_chat_turn_rules_of_llama_server(http: TestClient, body: dict[str, Any], message: str):
    r = http.post("/v1/chat/completions", json={**body, "max_tokens": 2})
    assert r.status_code == 400 and message in r.json()["error"]["message"]


def test_streamed_chat_starts_with_the_role_and_ends_with_a_usage_chunk(http: TestClient):
    body = {"messages": MESSAGES, "max_tokens": 4, "stream": True}
    plain = _events(http.post("/v1/chat/completions", json=body))
    assert plain[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert plain[-1]["choices"][0]["finish_reason"] == "length" and "usage" in plain[-1]
    events = _events(http.post("/v1/chat/completions", json={**body, "stream_options": {"include_usage": True}}))
    last, finish = events[-1], events[-2]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4 and last["timings"]["predicted_n"] == 4
    assert finish["choices"][0]["finish_reason"] == "length" and "usage" not in finish
    assert all(e["choices"] for e in events[:-1])


def test_verbose_answers_carry_the_native_answer(http: TestClient, engine: Engine):
    # llama-server's test_verbose_debug (per request) and test_chat_template (--verbose)
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, "verbose": True}).json()
    prompt = render_chat(engine.model, MESSAGES)
    assert r["__verbose"]["prompt"] == engine.vocab.detokenize(engine.tokenize_chat(prompt), unparse_special=True)
    assert r["__verbose"]["tokens_predicted"] == 2
    assert r["__verbose"]["content"] == r["choices"][0]["message"]["content"]
    assert "__verbose" not in http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2}).json()
    with TestClient(create_app(engine, verbose=True)) as c:
        assert "__verbose" in c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).json()


def _progress(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e["prompt_progress"] for e in events if "prompt_progress" in e]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/completion", "/v1/completions"])
def test_return_progress_reports_each_prompt_batch(http: TestClient, engine: Engine, path: str):
    # llama-server's test_return_progress: one report as the prompt starts, one after each batch (n_batch 64)
    text = "This is a test " * 40
    body: dict[str, Any] = {"max_tokens": 2, "stream": True, "return_progress": True, "cache_prompt": False}
    body.update({"messages": [{"role": "user", "content": text}]} if "chat" in path else {"prompt": text})
    reports = _progress(_events(http.post(path, json=body)))
    n_prompt = reports[0]["total"]
    assert n_prompt > 128 and len(reports) == 1 + -(-n_prompt // 64)
    assert reports[0]["cache"] == reports[0]["processed"] == 0
    assert [r["processed"] for r in reports[1:]] == [min(64 * k, n_prompt) for k in range(1, len(reports))]
    assert all(r["total"] == n_prompt and r["cache"] == 0 for r in reports)
    # the same prompt again reuses the slot's memory: it starts there, and one batch reads the rest
    http.post(path, json={**body, "cache_prompt": True, "id_slot": 0})  # slot 0 holds the prompt
    again = _progress(_events(http.post(path, json={**body, "cache_prompt": True, "id_slot": 0})))
    assert again[0]["cache"] == again[0]["processed"] > 0 and again[-1]["processed"] == n_prompt
    assert len(again) == 2
    # not asked, or not streamed: no report
    assert not _progress(_events(http.post(path, json={**body, "return_progress": False})))
    assert "prompt_progress" not in http.post(path, json={**body, "stream": False}).text


# --- post_sampling_probs -------------------------------------------------------------------


def _probs(http: TestClient, stream: bool = False, **body: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """completion_probabilities of a /completion (streamed ones joined) and the final answer."""
    req = {"prompt": PROMPT * 3, "n_predict": 16, "n_probs": 10, "cache_prompt": False, **body}
    if not stream:
        r = http.post("/completion", json=req)
        assert r.status_code == 200, r.text
        return r.json()["completion_probabilities"], r.json()
    r = http.post("/completion", json={**req, "stream": True})
    assert r.status_code == 200, r.text
    events = _events(r)
    return [p for e in events[:-1] for p in e.get("completion_probabilities", [])], events[-1]


@pytest.mark.parametrize("stream", [False, True])
def test_post_sampling_probs_are_the_samplers_candidates_after_its_chain(http: TestClient, stream: bool):
    # llama-server's test_n_probs_post_sampling: top-k 5 leaves 5 candidates, dist gives them p summing to 1
    probs, _final = _probs(http, stream, temperature=1.0, top_k=5, seed=7, post_sampling_probs=True)
    assert len(probs) == 16
    for tok in probs:
        assert "logprob" not in tok and "top_logprobs" not in tok
        top = tok["top_probs"]
        assert 1 <= len(top) <= 5 and all(0.0 < t["prob"] <= 1.0 for t in top)
        assert [t["prob"] for t in top] == sorted((t["prob"] for t in top), reverse=True)
        assert sum(t["prob"] for t in top) == pytest.approx(1.0, abs=1e-5)
        own = [t["prob"] for t in top if t["id"] == tok["id"]]
        assert own == [pytest.approx(tok["prob"])]  # the sampled token is among them, with its p
        assert {"id", "token", "bytes"} <= set(tok) and all({"id", "token", "bytes"} <= set(t) for t in top)
    # the sampled tokens are those of the same request without post-sampling probabilities (the same seed)
    plain, _plain_final = _probs(http, stream, temperature=1.0, top_k=5, seed=7)
    assert [t["id"] for t in probs] == [t["id"] for t in plain]
    assert all(len(t["top_logprobs"]) == 10 for t in plain)  # the logits' log-softmax, ten of them


def test_post_sampling_probs_of_verified_draft_tokens_are_their_own(http: TestClient):
    # greedy, a repeating prompt: ngram-simple drafts and the target verifies; each verified token's
    # candidates are taken after its own sample (the greedy chain leaves one, p 1)
    probs, final = _probs(http, post_sampling_probs=True, temperature=0.0)
    assert final["timings"]["draft_n_accepted"] > 0
    assert all(t["prob"] == 1.0 and [p["id"] for p in t["top_probs"]] == [t["id"]] for t in probs)
    plain, _ = _probs(http, temperature=0.0)
    assert [t["id"] for t in probs] == [t["id"] for t in plain]


def test_post_sampling_probs_in_a_chat_answer_keep_llama_servers_shape(http: TestClient):
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4, "logprobs": True,
                                                "top_logprobs": 3, "post_sampling_probs": True})
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 4 and all(c["prob"] == 1.0 and len(c["top_probs"]) == 1 for c in content)
