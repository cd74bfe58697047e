"""The server under hostile input: a chat template that loops or allocates without end fails its own request
with an error naming the template budget, while /health, a completion and a normal chat keep answering.

The server's template is the tiny chat model's with two traps a request springs through
``chat_template_kwargs``: ``spin`` (nested loops of 10^10 iterations) and ``hungry`` (a string of 2 GB).
The render pool is tested on its own too: the in-process and the budgeted render agree, a killed worker
is replaced, and each way out of the budget (time, memory, output size, recursion) has its message.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn

from pyspec import Context, Model
from pyspec.common.params import CommonParamsSpeculative
from pyspec.common.params import CommonSpeculativeType as T
from pyspec.errors import ChatTemplateError
from pyspec.generation.chat import RenderPool, TemplateBudget, render_chat, render_template
from pyspec.generation.engine import Engine, greedy_sampling
from pyspec.server.app import create_app
from pyspec.server.params import ServerDefaults
from pyspec.testing import models as tm

SPIN = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
HUNGRY = "{{ 'x' * 2000000000 }}"
TRAPPED = "{% if spin %}" + SPIN + "{% endif %}{% if hungry %}" + HUNGRY + "{% endif %}" + tm.CHAT_TEMPLATE
BUDGET = TemplateBudget(timeout_s=1.0, memory_mib=64)
MSGS = [{"role": "user", "content": "Hello"}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Server:
    def __init__(self, engine: Engine) -> None:
        self.port = _free_port()
        app = create_app(engine, model_name="tiny", template_budget=BUDGET,
                         defaults=ServerDefaults(sampling=greedy_sampling(), chat_template=TRAPPED))
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
def engine() -> Iterator[Engine]:
    model = Model(tm.make_chat_target())
    ctx = Context(model, n_ctx=256 * 2, n_batch=64, n_ubatch=64, n_seq_max=2, n_threads=1, n_threads_batch=1)
    eng = Engine(ctx, CommonParamsSpeculative(types=[T.NGRAM_SIMPLE]), greedy_sampling(), n_parallel=2,
                 owned=[ctx, model], adaptive_draft=False)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def server(engine: Engine) -> Iterator[_Server]:
    srv = _Server(engine)
    yield srv
    srv.stop()


def _chat(**kwargs: Any) -> dict[str, Any]:
    return {"messages": MSGS, "max_tokens": 4, "chat_template_kwargs": kwargs}


@pytest.mark.slow
@pytest.mark.parametrize("trap, why", [("spin", "ran longer than 1 s"), ("hungry", "more memory than its budget")])
def test_a_hostile_template_fails_its_request_while_the_server_keeps_answering(server, engine, trap, why):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        expected = http.post("/apply-template", json=_chat()).json()["prompt"]
        bad: dict[str, Any] = {}

        def hostile() -> None:
            r = http.post("/v1/chat/completions", json=_chat(**{trap: True}))
            bad["status"], bad["body"] = r.status_code, r.json()

        t = threading.Thread(target=hostile)
        t.start()
        health: list[float] = []
        others: list[int] = []
        while t.is_alive():  # while the hostile render runs
            t0 = time.perf_counter()
            assert http.get("/health").json() == {"status": "ok"}
            health.append(time.perf_counter() - t0)
            if len(others) < 2:
                others.append(http.post("/completion", json={"prompt": "def f", "n_predict": 2}).status_code)
            time.sleep(0.02)
        t.join()
        assert bad["status"] == 400, bad
        msg = bad["body"]["error"]["message"]
        assert "template budget 1 s, 64 MiB" in msg and why in msg, msg
        assert health, "the hostile render ended before /health was asked"
        assert max(health) < 2.0, health  # a hang check, not a timing claim (scripts/server_hostile_load.py)
        assert others and all(s == 200 for s in others), others
        # the worker was replaced: the same chat without the trap renders as before
        assert http.post("/apply-template", json=_chat()).json()["prompt"] == expected
        r = http.post("/v1/chat/completions", json=_chat())
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0
    assert not engine.busy()


def test_the_budgeted_render_is_the_in_process_render():
    model = Model(tm.make_chat_target())
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi \u00e9"},
            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Again"}]
    with RenderPool(BUDGET, size=1) as pool:
        assert render_chat(model, msgs, budget=pool) == render_chat(model, msgs)
        assert render_chat(model, msgs, budget=pool, add_generation_prompt=False) == render_chat(
            model, msgs, add_generation_prompt=False)
        # a template Jinja cannot compile still reaches llama.cpp's built-in ones by its markers
        chatml = "<|im_start|>{{ oops"
        text = render_chat(model, msgs, template=chatml)
        assert "<|im_start|>user" in text and render_chat(model, msgs, template=chatml, budget=pool) == text
        with pytest.raises(ChatTemplateError, match="refused the messages: unknown role: tool"):
            render_chat(model, [{"role": "tool", "content": "x"}], budget=pool)


@pytest.mark.parametrize("template, match", [
    (HUNGRY, "more memory than its budget: template budget 1 s, 64 MiB"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursed too deep"),
    ("{% for i in range(9999) %}{{ 'y' * 1000 }}{% endfor %}", "more than 1000000"),
    ("{{ messages[5].content }}", "failed on these messages: UndefinedError"),
])
def test_each_way_out_of_the_budget_is_named_and_the_worker_goes_on(template, match):
    budget = TemplateBudget(timeout_s=1.0, memory_mib=64, max_output_chars=1_000_000)
    with RenderPool(budget, size=1) as pool:
        with pytest.raises(ChatTemplateError, match=match):
            render_template(template, MSGS, budget=pool)
        assert render_template("{{ messages[0].content }}!", MSGS, budget=pool) == "Hello!"


@pytest.mark.slow
def test_a_template_past_its_time_is_killed_and_its_worker_replaced():
    with RenderPool(TemplateBudget(timeout_s=0.5, memory_mib=64), size=1) as pool:
        with pytest.raises(ChatTemplateError, match=r"ran longer than 0\.5 s: template budget 0\.5 s, 64 MiB"):
            render_template(SPIN, MSGS, budget=pool)
        assert pool.n_killed == 1
        assert render_template("{{ messages[0].role }}", MSGS, budget=pool) == "user"


def test_a_bad_budget_is_refused():
    for kw in ({"timeout_s": 0}, {"timeout_s": float("inf")}, {"memory_mib": 8}, {"memory_mib": 1.5},
               {"max_output_chars": 0}):
        with pytest.raises(ValueError, match=r"template|max_output_chars"):
            TemplateBudget(**kw)
    with pytest.raises(ValueError, match="size"):
        RenderPool(size=0)
    with pytest.raises(ValueError, match="max_size"):
        RenderPool(size=3, max_size=2)


@pytest.mark.slow
def test_a_normal_render_does_not_wait_for_one_that_spins():
    failed: list[BaseException] = []

    def spin(pool: RenderPool) -> None:
        try:
            render_template(SPIN, MSGS, budget=pool)
        except ChatTemplateError as e:
            failed.append(e)

    with RenderPool(TemplateBudget(timeout_s=5.0, memory_mib=64), size=1, max_size=2) as pool:
        pool.warm()
        t = threading.Thread(target=spin, args=(pool,))
        t.start()
        time.sleep(0.2)  # the only warm worker is spinning now
        assert render_template("{{ messages[0].content }}", MSGS, budget=pool) == "Hello"
        assert t.is_alive()  # answered by a second worker, not after the spin's budget ran out
        t.join()
    assert len(failed) == 1 and "ran longer than 5 s" in str(failed[0])
