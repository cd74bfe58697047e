"""The chat template API of llama.h (pyspec.core.chat): built-in templates, a model's own, refusals."""

from __future__ import annotations

from typing import Any

import pytest

from pyspec import Model
from pyspec.core.chat import apply_chat_template, builtin_chat_templates
from pyspec.errors import ChatTemplateError, NoChatTemplateError
from pyspec.testing import derived

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Bye"},
]

CHATML_JINJA = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_builtin_templates_are_listed():
    names = builtin_chat_templates()
    assert len(names) > 30 and len(set(names)) == len(names)
    assert {"chatml", "llama3", "gemma", "mistral-v7"} <= set(names)


def test_chatml_by_name_formats_each_turn():
    text = apply_chat_template("chatml", MESSAGES, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    without = apply_chat_template("chatml", MESSAGES, add_generation_prompt=False)
    assert without == text[: -len("<|im_start|>assistant\n")]


def test_llama3_by_name():
    text = apply_chat_template("llama3", [("user", "Hi")])
    assert text == ("<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_a_models_own_template_is_used(tmp_path):
    with Model(derived.make_chat_model(tmp_path / "chat.gguf", CHATML_JINJA), vocab_only=True) as model:
        assert model.chat_template() == CHATML_JINJA
        # llama.cpp recognises the Jinja source as chatml and formats it itself
        assert apply_chat_template(model, MESSAGES) == apply_chat_template("chatml", MESSAGES)


def test_long_and_unicode_content_is_returned_whole():
    content = "é✓ " * 3000
    text = apply_chat_template("chatml", [{"role": "user", "content": content}], add_generation_prompt=False)
    assert text == f"<|im_start|>user\n{content}<|im_end|>\n"


def test_every_builtin_template_formats_every_shape_of_chat():
    # no template may crash or refuse on an empty chat, a lone user turn, or roles it does not know
    chats: list[list[Any]] = [[], [("user", "x")], MESSAGES, [("tool", "t"), ("user", "u"), ("user", "v")]]
    for name in builtin_chat_templates():
        for chat in chats:
            for add in (True, False):
                text = apply_chat_template(name, chat, add)
                # (templates may drop roles they do not know; none drops a user turn)
                users = [m["content"] if isinstance(m, dict) else m[1] for m in chat
                         if (m["role"] if isinstance(m, dict) else m[0]) == "user"]
                assert all(content in text for content in users), (name, chat)


def test_refusals(target_model):
    with pytest.raises(ChatTemplateError, match="does not support the chat template 'no-such-template'"):
        apply_chat_template("no-such-template", MESSAGES)
    with pytest.raises(NoChatTemplateError, match="has no chat template"):
        apply_chat_template(target_model, MESSAGES)
    with pytest.raises(ValueError, match="NUL"):
        apply_chat_template("chatml", [{"role": "user", "content": "a\0b"}])
    with pytest.raises(ValueError, match="needs 'role' and 'content'"):
        apply_chat_template("chatml", [{"role": "user"}])
    with pytest.raises(TypeError):
        apply_chat_template("chatml", [{"role": "user", "content": 3}])  # type: ignore[dict-item]
    with pytest.raises(TypeError):
        apply_chat_template("chatml", "hello")  # type: ignore[arg-type]
