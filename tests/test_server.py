"""The HTTP server on the tiny chat model: every endpoint through the openai client and raw HTTP, bad input, keys."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx  # the test extra brings the server extra, openai and httpx
import openai
import pytest
import uvicorn

from pyspec import Context, Model
from pyspec.common.params import CommonParamsSpeculative
from pyspec.common.params import CommonSpeculativeType as T
from pyspec.generation.engine import Engine, greedy_sampling
from pyspec.generation.requests import Completion, Request
from pyspec.server.app import create_app
from pyspec.server.params import ServerDefaults
from pyspec.testing import models as tm

PROMPT = "def fib(n):\n    return fib(n - 1) + fib(n - 2)\n" * 2
KEY = "secret-key"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Server:
    def __init__(self, engine: Engine, api_key: str | None) -> None:
        self.engine = engine
        self.port = _free_port()
        defaults = ServerDefaults(sampling=greedy_sampling())
        app = create_app(engine, model_name="tiny", api_key=api_key, defaults=defaults)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        t0 = time.time()
        while not self.server.started:
            assert time.time() - t0 < 30, "server did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def server() -> Iterator[_Server]:
    model = Model(tm.make_chat_target())
    ctx = Context(model, n_ctx=256 * 3, n_batch=64, n_ubatch=64, n_seq_max=3, n_threads=1, n_threads_batch=1)
    spec = CommonParamsSpeculative(types=[T.NGRAM_SIMPLE])
    spec.ngram_simple.size_n, spec.ngram_simple.size_m = 2, 6
    # fixed draft lengths: whether the cost-aware choice drafts depends on the machine's timings
    engine = Engine(ctx, spec, greedy_sampling(), n_parallel=3, owned=[ctx, model], adaptive_draft=False)
    srv = _Server(engine, KEY)
    yield srv
    srv.stop()
    engine.close()


@pytest.fixture(scope="module")
def client(server: _Server) -> Any:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def http(server: _Server) -> Iterator[Any]:
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def expected(server: _Server) -> Completion:
    """What the engine generates for PROMPT, greedy, 16 tokens, asked directly."""
    h = server.engine.submit(Request(prompt=PROMPT, n_predict=16, sampling=greedy_sampling(), cache_prompt=False))
    return h.result(timeout=60)


# --- OpenAI client -----------------------------------------------------------------------


def test_openai_completion_returns_the_engines_text_with_usage_and_timings(client, server, expected):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0)
    assert r.choices[0].text == expected.text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 16 and r.usage.prompt_tokens > 10
    timings = r.model_extra["timings"]
    assert timings["predicted_n"] == 16 and timings["draft_n"] >= timings["draft_n_accepted"] >= 0


def test_openai_completion_stream_concatenates_to_the_same_text(client, server, expected):
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_openai_completion_logprobs(client):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(len(t) == 2 for t in lp.top_logprobs)


def test_openai_chat_completion_uses_the_models_template(client, server):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0,
                                       logprobs=True, top_logprobs=2)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    # the same text as a completion of the rendered template (special tokens parsed)
    from pyspec.generation.chat import render_chat

    rendered = render_chat(server.engine.model, msgs)
    assert rendered.startswith("<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHello there [/INST]")
    h = server.engine.submit(Request(prompt=server.engine.tokenize_chat(rendered), n_predict=8,
                                     sampling=greedy_sampling(), cache_prompt=False))
    assert choice.message.content == h.result(timeout=60).text
    assert r.usage.prompt_tokens == len(server.engine.tokenize_chat(rendered))
    assert len(choice.logprobs.content) == 8 and all(len(c.top_logprobs) == 2 for c in choice.logprobs.content)


def test_openai_chat_stream(client):
    msgs = [{"role": "user", "content": "Count"}]
    full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_openai_models_lists_the_model(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_concurrent_openai_clients_each_get_their_own_answer(client, server, expected):
    prompts = [PROMPT, "The quick brown fox", "int main() {", PROMPT]
    out: dict[int, str] = {}

    def ask(i: int) -> None:
        r = client.completions.create(model="tiny", prompt=prompts[i], max_tokens=16, temperature=0)
        out[i] = r.choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out[0] == out[3] == expected.text
    assert len(set(out.values())) == 3


def test_openai_client_sees_a_bad_request_error(client):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="tiny", prompt="x", max_tokens=4, temperature="hot")
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], logprobs=True,
                                       top_logprobs=99)


def test_wrong_api_key_is_refused(server):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="tiny", prompt="x", max_tokens=2)
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}  # public


# --- raw HTTP: llama-server's native endpoints -----------------------------------------


def test_native_completion_has_llama_server_fields(http, server, expected):
    r = http.post("/completion", json={"prompt": PROMPT, "n_predict": 16, "temperature": 0, "n_probs": 2})
    assert r.status_code == 200
    body = r.json()
    assert body["content"] == expected.text and body["tokens"] == expected.tokens
    assert body["stop"] is True and body["stop_type"] == "limit" and body["tokens_predicted"] == 16
    t = body["timings"]
    assert {"prompt_n", "prompt_ms", "predicted_n", "predicted_per_second", "cache_n", "draft_n",
            "draft_n_accepted"} <= set(t)
    assert len(body["completion_probabilities"]) == 16
    assert len(body["completion_probabilities"][0]["top_logprobs"]) == 2


def test_per_request_speculative_settings_flat_and_nested(http, server, expected):
    # llama-server's speculative.n_max / speculative.n_min: no draft is verified under either,
    # and the text stays the engine's
    for spec in ({"speculative.n_max": 0}, {"speculative.n_min": 1000}, {"speculative": {"n_min": 1000}}):
        body = http.post("/completion", json={"prompt": PROMPT, "n_predict": 16, "temperature": 0, **spec}).json()
        assert body["content"] == expected.text, spec
        assert body["timings"]["draft_n"] == 0, spec
    assert expected.stats.n_drafted > 0  # ... where the engine's own settings draft


def test_native_completion_stream_is_server_sent_events(http, server, expected):
    events = []
    with http.stream("POST", "/completion", json={"prompt": PROMPT, "n_predict": 16, "temperature": 0,
                                                  "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    assert "".join(e["content"] for e in events) == expected.text
    assert [t for e in events for t in e["tokens"]] == expected.tokens
    assert events[-1]["stop"] is True and "timings" in events[-1]


def test_tokenize_and_detokenize(http, server):
    toks = http.post("/tokenize", json={"content": "Hello world"}).json()["tokens"]
    assert toks == server.engine.vocab.tokenize("Hello world", add_special=False, parse_special=True)
    assert http.post("/detokenize", json={"tokens": toks}).json()["content"] == "Hello world"
    pieces = http.post("/tokenize", json={"content": "Hello", "with_pieces": True}).json()["tokens"]
    assert all(set(p) == {"id", "piece"} for p in pieces)


def test_health_props_and_slots(http, server):
    assert http.get("/health").json() == {"status": "ok"}
    props = http.get("/props").json()
    assert props["total_slots"] == 3
    assert props["default_generation_settings"]["n_ctx"] == 256
    assert "[INST]" in props["chat_template"]
    slots = http.get("/slots").json()
    assert [s["id"] for s in slots] == [0, 1, 2]


@pytest.mark.parametrize("path, body, match", [
    ("/completion", b"{not json", "not valid JSON"),
    ("/completion", {"n_predict": 4}, "'prompt' is required"),
    ("/completion", {"prompt": "x", "n_predict": "many"}, "n_predict"),
    ("/completion", {"prompt": "x", "top_p": 1.5}, "top_p"),
    ("/completion", {"prompt": "x", "n_probs": -1}, "n_probs"),
    ("/completion", {"prompt": [1, 99999999]}, "outside the vocabulary"),
    ("/completion", {"prompt": "x", "logit_bias": [[99999999, 1.0]]}, "logit_bias"),
    ("/completion", {"prompt": "x", "grammar": "root ::= ("}, "grammar"),
    ("/completion", {"prompt": "x", "id_slot": 7}, "id_slot"),
    ("/completion", {"prompt": "x", "speculative.n_min": -1}, "n_min"),
    ("/v1/completions", {"prompt": "x", "n": 4}, "'n'"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "role"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "unknown role"),
    ("/detokenize", {"tokens": [1, -5]}, "outside the vocabulary"),
    ("/tokenize", {"content": 5}, "content"),
])
def test_bad_requests_get_400_with_an_error_body_and_change_nothing(http, server, path, body, match):
    before = http.get("/slots").json()
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = http.post(path, **kw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and err["type"] == "invalid_request_error"
    assert match in err["message"]
    assert http.get("/slots").json() == before
    assert not server.engine.busy()


def test_a_body_too_large_is_refused_without_being_read_whole(http):
    r = http.post("/completion", content=b" " * (17 << 20))
    assert r.status_code == 413 and r.json()["error"]["code"] == 413


def test_unknown_path_is_404_with_an_error_body(http):
    r = http.get("/nowhere")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404


def test_a_client_that_disconnects_cancels_its_request(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        with c.stream("POST", "/completion", json={"prompt": "int main() {", "n_predict": -1, "stream": True,
                                                   "temperature": 0}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break  # one piece, then hang up
    t0 = time.time()
    while server.engine.busy():
        assert time.time() - t0 < 30, "the request kept running after its client left"
        time.sleep(0.05)


# --- the command -----------------------------------------------------------------------


def test_pyspec_serve_answers_on_the_port_it_was_given(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pyspec", "serve", "--tiny", "--port", str(port), "--parallel", "2", "--n-ctx", "256",
         "--threads", "1", "--types", "ngram-simple", "--temp", "0", "--slot-save-path", str(tmp_path)],
        cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        t0 = time.time()
        while True:
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() - t0 < 120, "pyspec serve did not come up"
            time.sleep(0.2)
        r = httpx.post(url + "/completion", json={"prompt": PROMPT, "n_predict": 8}, timeout=60).json()
        assert r["tokens_predicted"] == 8 and r["timings"]["draft_n"] >= 0
        saved = httpx.post(url + "/slots/" + str(r["id_slot"]) + "?action=save", json={"filename": "s.bin"},
                           timeout=60).json()
        assert saved["n_saved"] > 0 and (tmp_path / "s.bin").is_file()
        props = httpx.get(url + "/props").json()
        assert props["total_slots"] == 2 and props["speculative"] is True
    finally:
        proc.terminate()
        proc.wait(30)


def test_pyspec_serve_refuses_bad_options():
    from pyspec import cli

    assert cli.main(["serve", "--tiny", "--parallel", "0"]) == 1
