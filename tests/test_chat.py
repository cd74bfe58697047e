"""Chat prompts: Jinja rendering of model templates, llama.cpp's built-ins, special tokens, errors."""

from __future__ import annotations

import warnings

import pytest

from pyspec import Model
from pyspec.errors import ChatTemplateError
from pyspec.generation import chat as chat_mod
from pyspec.generation.chat import (
    chat_template,
    fallback_template,
    render_chat,
    render_template,
    tokenize_chat,
)
from pyspec.generation.contexts import default_model_path
from pyspec.testing import models as tm

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Bye"},
]


@pytest.fixture(scope="module")
def chat_model():
    with Model(tm.make_chat_target(), vocab_only=True) as m:
        yield m


def test_the_tiny_models_template_renders_a_conversation(chat_model):
    assert chat_template(chat_model) == tm.CHAT_TEMPLATE
    text = render_chat(chat_model, CONVERSATION)
    assert text == ("<s>[INST] <<SYS>>\nYou are terse.\n<</SYS>>\n\nHi [/INST] Hello. </s>"
                    "<s>[INST] Bye [/INST]")


def test_special_tokens_of_a_rendered_chat_are_parsed(chat_model):
    text = render_chat(chat_model, CONVERSATION)
    vocab = chat_model.vocab
    # the template wrote BOS itself, so none is added
    toks = tokenize_chat(vocab, text)
    assert toks[0] == vocab.bos and toks.count(vocab.bos) == 2 and toks.count(vocab.eos) == 1
    assert vocab.tokenize(text, add_special=False)[0] != vocab.bos  # as plain text "<s>" is not BOS


def test_llama_cpp_builtin_templates_are_the_fallback_by_name(chat_model):
    msgs = [{"role": "user", "content": "Hi"}]
    assert render_chat(chat_model, msgs, template="chatml") == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert render_chat(chat_model, msgs, template="gemma") == (
        "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n")
    assert render_chat(chat_model, msgs, template="chatml", add_generation_prompt=False) == (
        "<|im_start|>user\nHi<|im_end|>\n")


def test_a_jinja_template_given_as_text_renders_with_the_transformers_names():
    tmpl = ("{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}ASSISTANT:{% endif %}{{ payload | tojson }}")
    out = render_template(tmpl, [{"role": "user", "content": "héllo"}], payload={"k": "é"})
    assert out == 'USER: héllo\nASSISTANT:{"k": "é"}'


def test_a_model_without_a_template_falls_back_to_its_architectures_builtin_and_warns_once(monkeypatch):
    monkeypatch.setattr(chat_mod, "_warned", set())
    msgs = [{"role": "user", "content": "Hi"}]
    with Model(tm.make_cyclic_target(), vocab_only=True) as m:
        assert chat_template(m) is None
        name = fallback_template(m)
        with pytest.warns(UserWarning, match=rf"no chat template .*built-in '{name}'.*chat_template="):
            text = render_chat(m, msgs)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the second chat on the same model is quiet
            assert render_chat(m, msgs) == text
            # a named template is used as given, without a warning
            assert render_chat(m, msgs, template="chatml") == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert text == render_chat_builtin(name, msgs)


def render_chat_builtin(name, msgs):
    from pyspec.generation.chat_builtin import apply_builtin_template

    return apply_builtin_template(name, msgs, True)


def test_fallback_templates_by_architecture():
    class Fake:
        def __init__(self, arch):
            self.arch = arch

        def meta(self, key):
            return self.arch if key == "general.architecture" else None

    assert [fallback_template(Fake(a)) for a in ("gemma3", "gemma", "llama", "qwen2", None)] == [  # type: ignore[arg-type]
        "gemma", "gemma", "llama3", "chatml", "chatml"]


def test_a_template_that_raises_gives_a_chat_template_error(chat_model):
    with pytest.raises(ChatTemplateError, match="unknown role: robot"):
        render_chat(chat_model, [{"role": "robot", "content": "beep"}])


def test_the_sandbox_refuses_unsafe_templates():
    with pytest.raises(ChatTemplateError):
        render_template("{{ ''.__class__.__mro__[1].__subclasses__() }}", [{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render_template("{% for %}", [{"role": "user", "content": "x"}])


@pytest.mark.parametrize("messages, match", [
    ([], "empty"),
    ("hi", "list"),
    ([{"content": "x"}], "role"),
    ([{"role": "user", "content": 5}], "content"),
])
def test_malformed_messages_are_refused(chat_model, messages, match):
    with pytest.raises(ValueError, match=match):
        render_chat(chat_model, messages)


@pytest.mark.slow  # the real model's vocabulary (Gemma 3 270M)
def test_gemma_turns_become_special_tokens_not_literal_text():
    with Model(default_model_path(), vocab_only=True) as m:  # the test extra installs the real model
        msgs = [{"role": "user", "content": "Hi"}]
        # this GGUF carries no tokenizer.chat_template: the gemma built-in is its fallback
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert render_chat(m, msgs) == render_chat(m, msgs, template="gemma")
        text = render_chat(m, msgs, template="gemma")
        toks = tokenize_chat(m.vocab, text)
        literal = m.vocab.tokenize(text, add_special=True, parse_special=False)
        start = m.vocab.tokenize("<start_of_turn>", add_special=False, parse_special=True)
        bos = m.vocab.bos
    assert text == "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert len(start) == 1 and toks.count(start[0]) == 2
    assert toks[0] == bos and len(toks) < len(literal)
