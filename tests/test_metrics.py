"""Speculative metrics: vLLM's counters per request and per engine, their sums, and /metrics in Prometheus format."""

from __future__ import annotations

import re
import threading

import pytest
from starlette.testclient import TestClient

from pyspec import Context, Model
from pyspec.common.params import CommonParamsSpeculative
from pyspec.common.params import CommonSpeculativeType as T
from pyspec.generation.engine import Engine, greedy_sampling
from pyspec.generation.requests import Completion, Request
from pyspec.generation.statistics import SpecDecodeCounters
from pyspec.server.app import create_app
from pyspec.server.params import ServerDefaults
from pyspec.testing import models as tm

PROMPTS = [
    "def fib(n):\n    return fib(n - 1) + fib(n - 2)\n" * 2,
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "int main() { return 0; } int main() { return 0; }",
]
_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@pytest.fixture(scope="module")
def chat_model():
    with Model(tm.make_chat_target()) as m:
        yield m


def make_engine(model: Model, n_parallel: int) -> Engine:
    ctx = Context(model, n_ctx=256 * n_parallel, n_batch=64, n_ubatch=64, n_seq_max=n_parallel,
                  n_threads=1, n_threads_batch=1)
    spec = CommonParamsSpeculative(types=[T.NGRAM_SIMPLE])
    spec.ngram_simple.size_n, spec.ngram_simple.size_m = 2, 6
    # fixed draft lengths: the cost-aware choice depends on the machine's timings
    return Engine(ctx, spec, greedy_sampling(), n_parallel=n_parallel, owned=[ctx], adaptive_draft=False)


def summed(results: list[Completion]) -> SpecDecodeCounters:
    total = SpecDecodeCounters()
    for r in results:
        total.add(r.stats.spec)
    return total


def parse(text: str) -> dict[tuple[str, frozenset], float]:
    """{(name, labels): value} of an exposition text; every line a comment or a sample."""
    out: dict[tuple[str, frozenset], float] = {}
    for line in text.splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            continue
        m = _LINE.match(line)
        assert m, f"not a Prometheus sample line: {line!r}"
        labels = frozenset(_LABEL.findall(m.group(2) or ""))
        out[(m.group(1), labels)] = float(m.group(3))
    return out


def by_label(samples: dict, name: str, label: str) -> dict[int, float]:
    return {int(dict(lab)[label]): v for (n, lab), v in samples.items() if n == name and label in dict(lab)}


def one(samples: dict, name: str) -> float:
    (v,) = [v for (n, _), v in samples.items() if n == name]
    return v


# --- the counters ---------------------------------------------------------------------------------------


def test_a_draft_counts_its_positions_and_its_length():
    c = SpecDecodeCounters()
    c.record(4, 2)
    c.record(2, 2)
    c.record(3, 0)
    assert (c.n_drafts, c.n_draft_tokens, c.n_accepted_tokens) == (3, 9, 4)
    assert c.accepted_per_pos == [2, 2, 0, 0]
    assert c.drafts_by_length == {4: 1, 2: 1, 3: 1}
    assert c.accepted_by_length == {4: 2, 2: 2, 3: 0}
    assert c.mean_acceptance_length == pytest.approx(1 + 4 / 3)
    assert c.acceptance_rate == pytest.approx(4 / 9)
    assert c.as_dict()["draft_length_histogram"] == {"2": 1, "3": 1, "4": 1}


def test_more_accepted_than_drafted_is_refused():
    with pytest.raises(ValueError, match="accepted 3 of a draft of 2"):
        SpecDecodeCounters().record(2, 3)


def test_a_draft_of_the_wrong_type_or_size_is_refused_and_counts_nothing():
    c = SpecDecodeCounters()
    for n, a, exc in ((2.5, 1, TypeError), (3, True, TypeError), (10**9, 0, ValueError)):
        with pytest.raises(exc):
            c.record(n, a)  # type: ignore[arg-type]
    assert c == SpecDecodeCounters()


def test_nothing_drafted_has_no_acceptance_length():
    assert SpecDecodeCounters().mean_acceptance_length == 0.0


# --- the engine: per-request sums are the engine's counters --------------------------------------------


@pytest.mark.parametrize("n_parallel", [1, 3])
def test_the_requests_counters_sum_to_the_engines(chat_model, n_parallel):
    with make_engine(chat_model, n_parallel) as eng:
        steps = eng.steps()
        handles = [eng.submit(Request(prompt=PROMPTS[0], n_predict=24))]
        for _ in range(2):
            next(steps)  # the others join a running batch (continuous batching)
        handles += [eng.submit(Request(prompt=p, n_predict=20)) for p in PROMPTS[1:]]
        for _ in steps:
            pass
        results = [h.result() for h in handles]
        snap = eng.metrics.snapshot()
        (impl,) = eng.backend.impl_stats()
    total = summed(results)
    assert total.n_drafts > 0 and total.n_accepted_tokens > 0
    assert total == snap.spec
    # llama-server's per-request fields and the implementation's own counters agree with them
    assert total.n_draft_tokens == sum(r.stats.n_drafted for r in results) == impl.n_gen_tokens
    assert total.n_accepted_tokens == sum(r.stats.n_accepted for r in results) == impl.n_acc_tokens
    assert total.n_drafts == sum(len(r.stats.drafts) for r in results) == impl.n_gen_drafts
    for r in results:
        s = r.stats.spec
        assert s.accepted_per_pos[0] == sum(1 for _, a in r.stats.drafts if a > 0)
        assert sum(s.accepted_per_pos) == s.n_accepted_tokens
        assert sum(k * n for k, n in s.drafts_by_length.items()) == s.n_draft_tokens
    # llama-server's server_metrics
    assert snap.n_tokens_predicted == sum(r.stats.n_gen for r in results) == 24 + 20 * 2
    assert snap.n_prompt_tokens_processed == sum(r.stats.n_prompt - r.stats.n_cached for r in results)
    assert snap.n_decode == eng.n_steps
    assert snap.n_requests_finished == {"n_predict": 3}


# --- /metrics and the HTTP responses -------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(chat_model):
    eng = make_engine(chat_model, 3)
    app = create_app(eng, model_name="tiny", metrics=True, defaults=ServerDefaults(sampling=greedy_sampling()))
    with TestClient(app) as client:
        yield eng, client
    eng.close()


def test_metrics_report_the_sums_of_the_responses_speculative_objects(served):
    eng, client = served
    bodies: list[dict] = []
    lock = threading.Lock()

    def post(i: int) -> None:
        if i % 2:
            r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": PROMPTS[i]}],
                                                           "max_tokens": 16})
        else:
            r = client.post("/completion", json={"prompt": PROMPTS[i], "n_predict": 16})
        assert r.status_code == 200, r.text
        with lock:
            bodies.append(r.json())

    threads = [threading.Thread(target=post, args=(i,)) for i in range(3)]  # three slots at once
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(bodies) == 3
    for b in bodies:
        sp, tm_ = b["speculative"], b["timings"]
        assert tm_["draft_n"] == sp["num_draft_tokens"] and tm_["draft_n_accepted"] == sp["num_accepted_tokens"]
        assert sum(sp["num_accepted_tokens_per_pos"]) == sp["num_accepted_tokens"]

    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert "# TYPE vllm:spec_decode_num_drafts_total counter" in r.text
    samples = parse(r.text)
    snap = eng.metrics.snapshot()
    assert one(samples, "vllm:spec_decode_num_drafts_total") == snap.spec.n_drafts \
        == sum(b["speculative"]["num_drafts"] for b in bodies) > 0
    assert one(samples, "vllm:spec_decode_num_draft_tokens_total") == snap.spec.n_draft_tokens \
        == sum(b["speculative"]["num_draft_tokens"] for b in bodies)
    assert one(samples, "vllm:spec_decode_num_accepted_tokens_total") == snap.spec.n_accepted_tokens \
        == sum(b["speculative"]["num_accepted_tokens"] for b in bodies)
    per_pos = by_label(samples, "vllm:spec_decode_num_accepted_tokens_per_pos_total", "position")
    want = [0] * max(len(b["speculative"]["num_accepted_tokens_per_pos"]) for b in bodies)
    for b in bodies:
        for i, v in enumerate(b["speculative"]["num_accepted_tokens_per_pos"]):
            want[i] += v
    assert [per_pos[i] for i in range(len(per_pos))] == want == snap.spec.accepted_per_pos
    by_len = by_label(samples, "pyspec:spec_decode_num_drafts_by_length_total", "draft_length")
    assert by_len == snap.spec.drafts_by_length
    assert one(samples, "pyspec:spec_decode_mean_acceptance_length") == pytest.approx(
        1 + snap.spec.n_accepted_tokens / snap.spec.n_drafts)
    buckets = {dict(lab)["le"]: v for (n, lab), v in samples.items() if n == "pyspec:spec_decode_draft_length_bucket"}
    assert buckets["+Inf"] == snap.spec.n_drafts
    assert list(buckets.values()) == sorted(buckets.values())  # cumulative
    # llama-server's names
    assert one(samples, "llamacpp:tokens_predicted_total") == snap.n_tokens_predicted
    assert one(samples, "llamacpp:n_decode_total") == snap.n_decode > 0
    assert one(samples, "llamacpp:prompt_tokens_total") == snap.n_prompt_tokens_processed
    assert ("vllm:num_requests_running", frozenset({("engine", "0"), ("model_name", "tiny")})) in samples


def test_metrics_are_off_unless_asked_for(chat_model):
    with make_engine(chat_model, 1) as eng, TestClient(create_app(eng)) as client:
        r = client.get("/metrics")
    assert r.status_code == 501
    assert "--metrics" in r.json()["error"]["message"]


def test_a_label_value_is_escaped():
    from pyspec.generation.statistics import EngineMetrics
    from pyspec.server.metrics import render_metrics

    text = render_metrics(EngineMetrics().snapshot(), model_name='a"b\\c\nd', n_processing=0, n_waiting=0)
    assert 'model_name="a\\"b\\\\c\\nd"' in text
    assert all(_LINE.match(line) for line in text.splitlines() if not line.startswith("#"))
