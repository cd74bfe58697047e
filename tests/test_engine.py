"""The serving engine on the tiny models: continuous batching, cancellation, prefix reuse, logprobs, slot files."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pytest

from pyspec import Context, Model
from pyspec.common.params import CommonParamsSpeculative
from pyspec.common.params import CommonSpeculativeType as T
from pyspec.core.vocab import MAX_TEXT_BYTES
from pyspec.errors import ConcurrentUseError, PyspecError
from pyspec.generation.draft_length import CALIBRATION_SIZES
from pyspec.generation.engine import Engine, greedy_sampling
from pyspec.generation.requests import Request
from pyspec.testing import models as tm

PROMPTS = [
    "def fib(n):\n    return fib(n - 1) + fib(n - 2)\n",
    "The quick brown fox jumps over the lazy dog.",
    "int main() { return 0; }",
]
PROMPT_REPEAT = PROMPTS[0] * 2  # the n-gram drafts find matches in it
N_CTX = 256


@pytest.fixture(scope="module")
def chat_model():
    with Model(tm.make_chat_target()) as m:
        yield m


def make_engine(model: Model, n_parallel: int = 3, types: tuple[T, ...] = (T.NGRAM_SIMPLE,), **kw) -> Engine:
    ctx = Context(model, n_ctx=N_CTX * n_parallel, n_batch=64, n_ubatch=64, n_seq_max=n_parallel,
                  n_threads=1, n_threads_batch=1)
    spec = CommonParamsSpeculative(types=list(types))
    for m in (spec.ngram_simple, spec.ngram_map_k):
        m.size_n, m.size_m = 2, 6
    return Engine(ctx, spec, greedy_sampling(), n_parallel=n_parallel, owned=[ctx], **kw)


def alone(model: Model, prompt: str, n_predict: int) -> list[int]:
    """What a prompt generates on a fresh engine with nothing else running (fixed draft lengths)."""
    with make_engine(model, 1, adaptive_draft=False) as eng:
        h = eng.submit(Request(prompt=prompt, n_predict=n_predict))
        eng.run_until_idle()
        return h.result().tokens


@pytest.fixture(scope="module")
def expected(chat_model):
    return [alone(chat_model, p, 24) for p in PROMPTS]


def test_requests_submitted_at_different_moments_generate_what_each_generates_alone(chat_model, expected):
    # fixed draft lengths, so that the drafting this test asserts does not depend on the machine's timings
    with make_engine(chat_model, adaptive_draft=False) as eng:
        steps = eng.steps()
        h0 = eng.submit(Request(prompt=PROMPTS[0], n_predict=24))
        for _ in range(3):
            next(steps)
        h1 = eng.submit(Request(prompt=PROMPTS[1], n_predict=24))
        next(steps)
        # the new prompt shared a target batch with the first request's decoding
        assert eng.slots[0].generating and not eng.slots[1].reading
        h2 = eng.submit(Request(prompt=PROMPTS[2], n_predict=24))
        for _ in steps:
            pass
        results = [h.result() for h in (h0, h1, h2)]
    assert [r.tokens for r in results] == expected
    assert all(r.stop_reason == "n_predict" for r in results)
    assert sum(r.stats.n_drafted for r in results) > 0


def test_a_prompt_longer_than_a_batch_is_read_in_chunks_beside_a_decoding_request(chat_model):
    long_prompt = PROMPTS[0] * 6  # > n_batch 64 tokens
    want = alone(chat_model, long_prompt, 16)
    with make_engine(chat_model, 2) as eng:
        steps = eng.steps()
        h0 = eng.submit(Request(prompt=PROMPTS[1], n_predict=40))
        next(steps)
        next(steps)
        h1 = eng.submit(Request(prompt=long_prompt, n_predict=16))
        n_mixed = 0
        for _ in steps:
            n_mixed += eng.slots[1].reading and eng.slots[0].generating
        assert h1.result().tokens == want
        assert h0.result().stop_reason == "n_predict"
    assert n_mixed >= 1


def test_cancel_stops_one_request_and_the_others_continue(chat_model, expected):
    with make_engine(chat_model, 2).start() as eng:
        long = eng.submit(Request(prompt=PROMPTS[2], n_predict=-1))
        other = eng.submit(Request(prompt=PROMPTS[0], n_predict=24))
        it = iter(long)
        next(it)
        long.cancel()
        res = long.result(timeout=60)
        assert res.stop_reason == "cancelled"
        assert other.result(timeout=60).tokens == expected[0]
        assert not eng.busy()


def test_a_cancelled_request_that_waits_for_a_slot_never_runs(chat_model):
    with make_engine(chat_model, 1) as eng:
        first = eng.submit(Request(prompt=PROMPTS[0], n_predict=4))
        waiting = eng.submit(Request(prompt=PROMPTS[1], n_predict=4))
        waiting.cancel()
        eng.run_until_idle()
        assert first.result().stop_reason == "n_predict"
        res = waiting.result()
    assert res.stop_reason == "cancelled" and res.tokens == [] and res.slot_id == -1


def test_streams_from_threads_and_asyncio_concatenate_to_the_results(chat_model, expected):
    with make_engine(chat_model).start() as eng:
        texts: dict[int, str] = {}

        def consume(i: int) -> None:
            h = eng.submit(Request(prompt=PROMPTS[i], n_predict=24))
            texts[i] = "".join(d.text for d in h)
            assert h.result().text == texts[i]

        threads = [threading.Thread(target=consume, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()

        async def consume_async() -> tuple[list[int], str]:
            h = eng.submit(Request(prompt=PROMPTS[2], n_predict=24))
            toks, text = [], ""
            async for d in h:
                toks += d.tokens
                text += d.text
            res = await h.aresult()
            assert res.text == text
            return toks, text

        toks2, _ = asyncio.run(consume_async())
        for t in threads:
            t.join()
    assert toks2 == expected[2]
    assert set(texts) == {0, 1}


def test_prefix_reuse_decodes_only_the_new_tokens_and_changes_nothing(chat_model):
    base = PROMPTS[0] * 3
    follow = base + " And then"
    want = alone(chat_model, follow, 16)
    with make_engine(chat_model, 2) as eng:
        h = eng.submit(Request(prompt=base, n_predict=8))
        eng.run_until_idle()
        n_base = len(h.result().prompt_tokens)
        h2 = eng.submit(Request(prompt=follow, n_predict=16))
        eng.run_until_idle()
        r2 = h2.result()
        # the slot kept the prompt and the tokens generated after it; the common prefix is the prompt
        assert r2.slot_id == h.result().slot_id
        assert r2.stats.n_cached >= n_base - 1
        assert r2.stats.timings()["prompt_n"] == len(r2.prompt_tokens) - r2.stats.n_cached
        assert r2.tokens == want
        # a request that shares nothing goes to the other (least recently used) slot, nothing cached
        h3 = eng.submit(Request(prompt=PROMPTS[2], n_predict=4))
        eng.run_until_idle()
        r3 = h3.result()
        assert r3.slot_id != r2.slot_id and r3.stats.n_cached == 0
        # cache_prompt off: the whole prompt is decoded again
        h4 = eng.submit(Request(prompt=follow, n_predict=16, cache_prompt=False))
        eng.run_until_idle()
        assert h4.result().stats.n_cached == 0 and h4.result().tokens == want


def test_the_slot_with_the_longest_common_prefix_is_chosen(chat_model):
    with make_engine(chat_model, 3) as eng:
        for p in PROMPTS:
            eng.submit(Request(prompt=p * 2, n_predict=2))
        eng.run_until_idle()
        slot_of = {i: next(s.id for s in eng.slots if s.tokens[: 5] == eng.vocab.tokenize(PROMPTS[i] * 2)[:5])
                   for i in range(3)}
        h = eng.submit(Request(prompt=PROMPTS[1] * 2 + " again", n_predict=2))
        eng.run_until_idle()
    assert h.result().slot_id == slot_of[1]
    assert h.result().stats.n_cached > 10


def test_hybrid_target_resumes_a_shared_prefix_from_a_prompt_checkpoint():
    model = Model(tm.make_mtp())
    try:
        base = PROMPTS[0] * 2
        follow = base + " more"

        def engine() -> Engine:
            ctx = Context(model, n_ctx=N_CTX, n_batch=64, n_ubatch=32, n_seq_max=1, n_threads=1, n_threads_batch=1)
            return Engine(ctx, None, greedy_sampling(), owned=[ctx])

        with engine() as eng:
            h = eng.submit(Request(prompt=follow, n_predict=12))
            eng.run_until_idle()
            want = h.result().tokens
        with engine() as eng:
            assert eng.ctx_tgt_seq_rm_type != 1  # the memory cannot drop part of a sequence
            eng.submit(Request(prompt=base, n_predict=6))
            eng.run_until_idle()
            h2 = eng.submit(Request(prompt=follow, n_predict=12))
            eng.run_until_idle()
            r2 = h2.result()
            assert eng.n_prompt_checkpoint_hits == 1
        assert 0 < r2.stats.n_cached < len(eng.vocab.tokenize(base))
        assert r2.tokens == want
    finally:
        model.close()


def test_logprobs_are_the_log_softmax_of_the_target_logits(chat_model):
    with make_engine(chat_model, 1, types=(T.NGRAM_SIMPLE,), adaptive_draft=False) as eng:  # drafts verified
        h = eng.submit(Request(prompt=PROMPT_REPEAT, n_predict=20, n_probs=3))
        eng.run_until_idle()
        res = h.result()
        assert res.stats.n_accepted > 0  # tokens accepted from drafts carry log-probabilities too
        toks = eng.vocab.tokenize(PROMPT_REPEAT)
    assert len(res.logprobs) == len(res.tokens)
    # recompute: one batch of prompt + generated tokens on a fresh context, logits at every position
    seq = toks + res.tokens[:-1]
    with Context(chat_model, n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=N_CTX, n_threads=1, n_threads_batch=1) as ctx:
        from pyspec.core.batch import Batch

        b = Batch(len(seq))
        for i, t in enumerate(seq):
            b.add(t, i, 0, i >= len(toks) - 1)
        ctx.decode(b)
        rows = ctx.get_logits(len(res.tokens)).astype(np.float64)
    ref = rows - (rows.max(1, keepdims=True) + np.log(np.exp(rows - rows.max(1, keepdims=True)).sum(1, keepdims=True)))
    for k, lp in enumerate(res.logprobs):
        assert lp.id == res.tokens[k]
        assert lp.logprob == pytest.approx(ref[k, lp.id], abs=1e-3)
        assert [i for i, *_ in lp.top] == list(np.argsort(-ref[k], kind="stable")[:3])
        assert [v for *_, v in lp.top] == pytest.approx(np.sort(ref[k])[::-1][:3], abs=1e-3)
        assert lp.top[0][0] == lp.id  # greedy picks the most likely token


def test_stop_strings_are_never_streamed_and_end_the_request(chat_model):
    full = alone(chat_model, PROMPTS[1], 24)
    with make_engine(chat_model, 1) as eng:
        text = eng.vocab.detokenize(full)
        word = text[len(text) // 2 : len(text) // 2 + 3]
        assert word.strip()
        h = eng.submit(Request(prompt=PROMPTS[1], n_predict=24, stop=[word]))
        eng.run_until_idle()
        streamed = "".join(d.text for d in h.pending())
        res = h.result()
    assert res.stop_reason == "stop" and res.stopping_word == word
    assert res.text == text[: text.index(word)] == streamed


def test_a_request_may_turn_speculation_off_while_another_drafts(chat_model):
    # llama.cpp's fixed draft lengths: the cost-aware choice could find these drafts not worth verifying
    with make_engine(chat_model, 2, adaptive_draft=False) as eng:
        a = eng.submit(Request(prompt=PROMPT_REPEAT, n_predict=24, n_draft_max=0))
        b = eng.submit(Request(prompt=PROMPT_REPEAT, n_predict=24))
        eng.run_until_idle()
        ra, rb = a.result(), b.result()
    assert ra.stats.n_drafted == 0 and rb.stats.n_drafted > 0
    assert ra.tokens == rb.tokens


def test_a_request_drops_drafts_shorter_than_its_n_draft_min(chat_model):
    with make_engine(chat_model, 2, adaptive_draft=False) as eng:
        a = eng.submit(Request(prompt=PROMPT_REPEAT, n_predict=24, n_draft_min=1000))
        b = eng.submit(Request(prompt=PROMPT_REPEAT, n_predict=24, n_draft_min=1))
        eng.run_until_idle()
        ra, rb = a.result(), b.result()
    assert ra.stats.n_drafted == 0 and rb.stats.n_drafted > 0
    assert ra.tokens == rb.tokens


def test_bad_requests_raise_and_queue_nothing(chat_model):
    with make_engine(chat_model, 2) as eng:
        bad = [
            (Request(), "exactly one"),
            (Request(prompt="x", messages=[{"role": "user", "content": "x"}]), "exactly one"),
            (Request(prompt=[]), "empty prompt"),
            (Request(prompt="", add_special=False), "empty prompt"),
            (Request(prompt=[1, 10**6]), "outside the vocabulary"),
            (Request(prompt=[5] * 400), "does not fit"),
            # llama.cpp's tokenizer would hold some 50 bytes per byte of it (a failed allocation aborts)
            (Request(prompt="a" * (MAX_TEXT_BYTES + 1)), "too long to tokenize"),
            # longer than the context could hold: refused by its length (the tokenizer is quadratic in the
            # special tokens it parses)
            (Request(prompt="<s>" * 100_000, parse_special=True), "tokens can be"),
            (Request(messages=[{"role": "user", "content": "a" * MAX_TEXT_BYTES}], chat_template="chatml"),
             "too long for a prompt"),
            (Request(prompt="x", n_predict=0), "n_predict"),
            (Request(prompt="x", n_probs=-1), "n_probs"),
            (Request(prompt="x", n_draft_max=-2), "n_draft_max"),
            (Request(prompt="x", n_draft_min=-1), "n_draft_min"),
            (Request(prompt="x", slot_id=5), "slot_id"),
            (Request(prompt="x", sampling=greedy_sampling().__class__(logit_bias=[(10**6, 1.0)])), "vocabulary"),
            (Request(prompt="x", sampling=greedy_sampling().__class__(grammar="root ::= (")), "grammar"),
        ]
        for req, msg in bad:
            with pytest.raises(ValueError, match=msg):
                eng.submit(req)
        wrong_types: list[tuple[Any, str]] = [
            (dict(prompt=5), "prompt must be a str or a sequence"),
            (dict(prompt={"a": 1}), "prompt must be a str or a sequence"),
            (dict(prompt=[1, 2.5]), "token id must be an integer"),
            (dict(prompt=[1, True]), "token id must be an integer"),
            (dict(prompt="x", stop=None), "stop must be a list of strings"),
            (dict(prompt="x", stop="end"), "stop must be a list of strings"),
            (dict(messages=[{"role": "user", "content": "x"}], chat_template_kwargs=[1]), "mapping"),
        ]
        for fields, msg in wrong_types:
            with pytest.raises(TypeError, match=msg):
                eng.submit(Request(**fields))
        with pytest.raises(ValueError, match="may not set messages"):
            eng.submit(Request(messages=[{"role": "user", "content": "x"}], chat_template_kwargs={"messages": 5}))
        with pytest.raises(TypeError, match="takes a Request"):
            eng.submit({"prompt": "x"})  # type: ignore[arg-type]
        assert not eng.busy() and not eng.step()


def test_a_request_changed_after_submit_runs_as_submitted_and_harms_no_other(chat_model, expected):
    with make_engine(chat_model, 1) as eng:
        first = eng.submit(Request(prompt=PROMPTS[0], n_predict=24))
        stops: list[str] = []
        req = Request(prompt=PROMPTS[1], n_predict=24, stop=stops)
        second = eng.submit(req)
        req.slot_id, req.n_predict, req.prompt = 5, 1, "changed"  # a slot that does not exist, among others
        stops.append("e")
        third = eng.submit(Request(prompt=PROMPTS[2], n_predict=24))
        eng.run_until_idle()
        assert [h.result().tokens for h in (first, second, third)] == expected
        assert second.request is req  # the caller's object, unchanged by the engine


def _engine_that_calls_from_its_callback(chat_model, call):
    """An engine whose on_event callback calls ``call(engine)`` once, at the first event; what it raised."""
    raised: list[BaseException] = []
    eng = make_engine(chat_model, 2)

    def on_event(name, data):
        if not raised:
            try:
                call(eng)
                raised.append(AssertionError("no exception"))
            except BaseException as e:
                raised.append(e)
    eng.on_event = on_event
    return eng, raised


@pytest.mark.parametrize("started", [False, True])
@pytest.mark.parametrize("call", ["close", "erase_slot", "step", "run_until_idle", "save_slot", "start"])
def test_a_callback_that_calls_back_into_its_engine_gets_an_error_and_the_engine_goes_on(
        chat_model, expected, started, call, tmp_path):
    """Inside a step (an on_event callback) the engine's blocking calls would wait for that step's end
    (close, slot commands on a started engine: a deadlock) or run a step inside it."""
    calls = {"close": lambda e: e.close(), "erase_slot": lambda e: e.erase_slot(1), "step": lambda e: e.step(),
             "run_until_idle": lambda e: e.run_until_idle(), "save_slot": lambda e: e.save_slot(1, tmp_path / "s"),
             "start": lambda e: e.start()}
    eng, raised = _engine_that_calls_from_its_callback(chat_model, calls[call])
    with eng:
        if started:
            eng.start()
        h = eng.submit(Request(prompt=PROMPTS[0], n_predict=24))
        if not started:
            eng.run_until_idle()
        assert h.result(timeout=60).tokens == expected[0]
        assert len(raised) == 1 and isinstance(raised[0], PyspecError), raised
        assert "inside a step" in str(raised[0])
        eng.on_event = None
        h = eng.submit(Request(prompt=PROMPTS[1], n_predict=24))
        if not started:
            eng.run_until_idle()
        assert h.result(timeout=60).tokens == expected[1]


def test_only_the_thread_that_steps_an_engine_may_step_or_close_it(chat_model, expected):
    with make_engine(chat_model, 2) as eng:
        h = eng.submit(Request(prompt=PROMPTS[0], n_predict=24))
        steps = eng.steps()
        next(steps)  # this thread holds the engine, between two steps
        errors: list[BaseException] = []

        def other() -> None:
            for f in (eng.run_until_idle, eng.step, eng.close):
                try:
                    f()
                except ConcurrentUseError as e:
                    errors.append(e)
        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert len(errors) == 3 and "another thread" in str(errors[2])
        for _ in steps:
            pass
        assert h.result().tokens == expected[0]  # nothing was closed or stepped by the other thread
    assert eng.ctx_tgt.closed


def test_a_slot_saved_to_a_file_is_reused_after_restore(chat_model, tmp_path):
    path = tmp_path / "slot0.bin"
    base = PROMPTS[0] * 3
    with make_engine(chat_model, 1) as eng:
        h = eng.submit(Request(prompt=base, n_predict=4))
        eng.run_until_idle()
        n = eng.save_slot(0, path)
        assert n == len(eng.slots[0].tokens) > 0
        assert eng.erase_slot(0) == n and eng.slots[0].tokens == []
        assert eng.restore_slot(0, path) == n
        h2 = eng.submit(Request(prompt=base + " next", n_predict=4))
        eng.run_until_idle()
        assert h2.result().stats.n_cached >= len(h.result().prompt_tokens) - 1
        (tmp_path / "junk.bin").write_bytes(b"not a slot file")
        with pytest.raises(ValueError, match="not a pyspec slot file"):
            eng.restore_slot(0, tmp_path / "junk.bin")


def test_a_handle_wakes_its_waiting_consumer_and_times_out_alone():
    """A piece wakes a consumer blocked in iteration; result(timeout) gives up on time; with nobody
    waiting, a piece is only queued (the engine skips the notification)."""
    import time

    from pyspec.generation.requests import Completion, Delta, RequestHandle

    h = RequestHandle(1, Request(prompt="x"))
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"did not finish within 0\.2 s"):
        h.result(timeout=0.2)
    assert 0.15 < time.monotonic() - t0 < 5 and h._n_waiting == 0
    h._put(Delta("queued ", [1]))  # nobody waits: queued
    got: list[str] = []
    consumer = threading.Thread(target=lambda: got.extend(d.text for d in h))
    consumer.start()
    deadline = time.monotonic() + 10
    while h._n_waiting == 0 and time.monotonic() < deadline:  # the consumer took "queued" and waits
        time.sleep(0.01)
    assert h._n_waiting == 1
    h._put(Delta("woken", [2]))
    h._finish(Completion(1, [], [1, 2], "queued woken", "n_predict"))
    consumer.join(10)
    assert not consumer.is_alive() and got == ["queued ", "woken"] and h.result(timeout=1).text == "queued woken"


def test_waiting_on_an_engine_nobody_runs_raises_at_once_and_names_the_fix(chat_model, expected):
    """result(), iteration and aresult() on an engine neither started nor stepped raise instead of
    waiting forever; once the caller steps it (run_until_idle) or starts it, the same handles complete."""
    from pyspec.errors import PyspecError

    with make_engine(chat_model, 1, adaptive_draft=False) as eng:
        h = eng.submit(Request(prompt=PROMPTS[0], n_predict=24))
        with pytest.raises(PyspecError, match=r"call engine\.start\(\).*engine\.run_until_idle\(\)"):
            h.result()
        with pytest.raises(PyspecError, match=r"engine\.start\(\)"):
            next(iter(h))
        with pytest.raises(PyspecError, match=r"engine\.start\(\)"):
            asyncio.run(h.aresult())
        eng.run_until_idle()  # manual stepping: the request was kept and runs
        assert h.result().tokens == expected[0]
    with make_engine(chat_model, 1, adaptive_draft=False) as eng:
        h = eng.submit(Request(prompt=PROMPTS[0], n_predict=24))
        eng.start()
        assert h.result(timeout=60).tokens == expected[0]


def test_a_cancelled_request_still_streams_the_text_held_back_for_a_stop_string(chat_model):
    with make_engine(chat_model, 1, adaptive_draft=False) as eng:
        h = eng.submit(Request(prompt=PROMPTS[0], n_predict=24))
        eng.run_until_idle()
        text = h.result().text
    assert text
    with make_engine(chat_model, 1, adaptive_draft=False) as eng:
        # every text the request makes is the start of this stop string: all of it is held back
        h = eng.submit(Request(prompt=PROMPTS[0], n_predict=-1, stop=[text + "\u2603"]))
        for _ in range(3):
            eng.step()
        before = h.pending()
        assert before and 0 < sum(len(d.tokens) for d in before) < 24
        assert "".join(d.text for d in before) == ""
        h.cancel()
        eng.run_until_idle()
        res = h.result()
    assert res.stop_reason == "cancelled" and res.text
    assert "".join(d.text for d in before + h.pending()) == res.text


# --- synthetic acceptance and replays (llama-server 0c1e57098's verification) -----------------------------


def _synth_run(target_model: Model, draft_model: Model, backend: str = "python", seed: int = 7,
               **synth) -> tuple[list[int], int, int]:
    """Tokens, drafted and accepted counts of one request with draft-simple (n_max 4), greedy with ``seed``."""
    ctx = Context(target_model, n_ctx=N_CTX, n_batch=64, n_ubatch=64, n_seq_max=1, n_threads=1, n_threads_batch=1)
    ctxd = Context(draft_model, n_ctx=N_CTX, n_batch=64, n_ubatch=64, n_seq_max=1, n_threads=1, n_threads_batch=1)
    spec = CommonParamsSpeculative(types=[T.DRAFT_SIMPLE], **synth)
    spec.draft.ctx_dft = ctxd
    spec.draft.n_max = 4
    sampling = greedy_sampling()
    sampling.seed = seed
    with Engine(ctx, spec, sampling, backend=backend, owned=[ctxd, ctx], adaptive_draft=False) as eng:
        h = eng.submit(Request(prompt=PROMPTS[0], n_predict=32))
        eng.run_until_idle()
        r = h.result()
    return r.tokens, r.stats.n_drafted, r.stats.n_accepted


def test_synthetic_acceptance_one_accepts_every_draft_and_zero_gives_the_targets_tokens(target_model, draft_model):
    plain, n_drafted, _ = _synth_run(target_model, draft_model)
    assert n_drafted > 0
    tokens, n_drafted, n_accepted = _synth_run(target_model, draft_model, synth_rates=[1.0] * 4)
    assert n_drafted > 0 and n_accepted == n_drafted  # the drafts, whatever the target says
    assert tokens != plain  # so the text is no longer the target's
    tokens, n_drafted, n_accepted = _synth_run(target_model, draft_model, synth_rates=[0.0] * 4)
    assert n_drafted > 0 and n_accepted == 0
    assert tokens == plain  # every draft rejected: the target's tokens


def test_synthetic_acceptance_draws_from_the_requests_seed_on_both_backends(target_model, draft_model):
    a = _synth_run(target_model, draft_model, seed=7, synth_len=2.0)
    assert 0 < a[2] < a[1]  # a mean accepted length of 2 of 4: some drafts accepted, not all
    assert _synth_run(target_model, draft_model, seed=7, synth_len=2.0) == a
    assert _synth_run(target_model, draft_model, backend="cpp", seed=7, synth_len=2.0) == a
    assert _synth_run(target_model, draft_model, seed=8, synth_len=2.0) != a


def test_synthetic_acceptance_without_a_speculative_type_is_refused(target_model):
    ctx = Context(target_model, n_ctx=N_CTX, n_batch=64, n_seq_max=1, n_threads=1, n_threads_batch=1)
    try:
        with pytest.raises(PyspecError, match="synthetic acceptance requires an initialized speculative"):
            Engine(ctx, CommonParamsSpeculative(types=[T.NONE], synth_len=2.0), greedy_sampling())
    finally:
        ctx.close()


def test_a_replay_after_a_checkpoint_restore_counts_only_accepted_draft_tokens():
    # an MTP target whose memory cannot drop part of a sequence (n_rs_seq 0): every partial acceptance is
    # undone through the checkpoint and the accepted part re-verified, ending with the target's own token
    with Model(tm.make_mtp()) as model:
        ctx = Context(model, n_ctx=N_CTX * 4, n_batch=32, n_ubatch=16, n_seq_max=1, n_rs_seq=0,
                      n_threads=1, n_threads_batch=1)
        ctxd = Context(model, n_ctx=N_CTX * 4, n_batch=32, n_ubatch=16, n_seq_max=1, ctx_type="mtp", ctx_other=ctx,
                       n_threads=1, n_threads_batch=1)
        spec = CommonParamsSpeculative(types=[T.DRAFT_MTP])
        spec.draft.ctx_dft = ctxd
        spec.draft.n_max = 3
        with Engine(ctx, spec, greedy_sampling(), owned=[ctxd, ctx], adaptive_draft=False) as eng:
            h = eng.submit(Request(prompt=PROMPTS[0] * 2, n_predict=32))
            eng.run_until_idle()
            st = h.result().stats
            assert eng.n_checkpoint_restores > 0
    # the request's count equals the first verification's (vLLM's counter), the drafts' sizes as made
    assert st.n_accepted == st.spec.n_accepted_tokens
    assert sum(a for _, a in st.drafts) == st.n_accepted
    assert sum(d for d, _ in st.drafts) == st.n_drafted
    assert 0 < st.n_accepted < st.n_drafted


def test_a_slots_context_is_at_most_the_models_training_context(target_model):
    # 8192 cells for one sequence of a model trained on 4096: the server's n_ctx_slot caps the slot at 4096
    n_train = target_model.n_ctx_train
    ctx = Context(target_model, n_ctx=2 * n_train, n_batch=64, n_seq_max=1, n_threads=1, n_threads_batch=1)
    with Engine(ctx, None, greedy_sampling(), owned=[ctx]) as eng:
        assert ctx.n_ctx_seq == 2 * n_train and eng.n_ctx_seq == n_train
        assert len(eng.tokenize_request(Request(prompt=[1] * (n_train - 1)))) == n_train - 1
        with pytest.raises(ValueError, match=f"prompt of {n_train} tokens does not fit the context \\({n_train} per"):
            eng.submit(Request(prompt=[1] * n_train))


def test_the_start_up_probe_holds_the_contexts_against_other_threads(type_contexts, monkeypatch):
    # common_context_can_seq_rm clears the memory and then decodes two tokens: another thread's call in
    # between made the probe fail ("speculative decoding is not supported"); it must be refused instead
    from pyspec.common import common as cm
    from pyspec.errors import ConcurrentUseError

    cs = type_contexts("ngram-simple")
    seen: list[str] = []
    real = cm.llama_process

    def probe(ctx, kind, batch):  # runs between the probe's clear and its decode
        def other() -> None:
            try:
                cs.ctx_tgt.memory.seq_pos_max(0)
                seen.append("ran")
            except ConcurrentUseError:
                seen.append("refused")
        t = threading.Thread(target=other)
        t.start()
        t.join(10)
        return real(ctx, kind, batch)

    monkeypatch.setattr(cm, "llama_process", probe)
    eng = Engine(cs.ctx_tgt, cs.spec, greedy_sampling())
    eng.close()
    assert seen == ["refused"]


def test_an_engine_that_verifies_larger_batches_calibrates_the_sizes_the_shared_curve_lacks():
    # the verify-cost curve is shared by the process's engines on one model and settings; the first is
    # calibrated up to its own output rows (1 + 6), the second may verify up to 17 rows
    def engine(model: Model, size_m: int) -> Engine:
        ctx = Context(model, n_ctx=N_CTX, n_batch=64, n_ubatch=64, n_seq_max=1, n_threads=1, n_threads_batch=1,
                      n_outputs_max=1 + size_m)
        spec = CommonParamsSpeculative(types=[T.NGRAM_SIMPLE])
        spec.ngram_simple.size_n, spec.ngram_simple.size_m = 2, size_m
        return Engine(ctx, spec, greedy_sampling(), n_parallel=1, owned=[ctx])

    with Model(tm.make_chat_target()) as model:
        with engine(model, 6) as small:
            assert small.draft_ctl is not None
            assert small.draft_ctl.curve.sizes() == [n for n in CALIBRATION_SIZES if n <= 7]
        with engine(model, 16) as large:
            assert large.draft_ctl is not None and large.draft_ctl.curve is small.draft_ctl.curve
            assert large.draft_ctl.curve.sizes() == list(CALIBRATION_SIZES)
            h = large.submit(Request(prompt=PROMPT_REPEAT, n_predict=8))
            large.run_until_idle()
            assert len(h.result().tokens) == 8


def test_engine_load_gives_the_target_llama_servers_output_rows(chat_model, expected):
    # server_output_limits: 1 + n_draft rows per slot, not llama.cpp's n_batch (a smaller graph buffer)
    path = chat_model.path
    with Engine.load(path, types="none", n_parallel=3, n_ctx=N_CTX, n_batch=64) as eng:
        assert (eng.ctx_tgt.n_outputs_max, eng.ctx_tgt.n_outputs_max_per_seq) == (3, 1)
    with Engine.load(path, types="ngram-simple", n_parallel=2, n_ctx=N_CTX, n_batch=64, ngram_n=2, ngram_m=6,
                     sampling=greedy_sampling(), adaptive_draft=False) as eng:
        per_seq = 1 + eng.spec_n_max
        assert eng.ctx_tgt.n_outputs_max_per_seq == per_seq > 1
        assert eng.ctx_tgt.n_outputs_max == min(64, 2 * per_seq)
        handles = [eng.submit(Request(prompt=p, n_predict=24)) for p in (PROMPT_REPEAT, PROMPTS[1])]
        eng.run_until_idle()
        results = [h.result() for h in handles]
    assert results[0].stats.n_drafted > 0 and results[0].stats.n_accepted > 0
    assert results[1].tokens == expected[1]
    with Engine.load(path, types="ngram-simple", n_parallel=2, n_ctx=N_CTX, n_batch=64, ngram_n=2, ngram_m=6,
                     sampling=greedy_sampling()) as eng:
        h = eng.submit(Request(prompt=PROMPT_REPEAT, n_predict=8))
        eng.run_until_idle()
        assert h.result().tokens == results[0].tokens[:8]
        assert eng.draft_ctl is not None
        assert max(eng.draft_ctl.curve.sizes()) <= eng.ctx_tgt.n_outputs_max  # calibration batches fit the rows
