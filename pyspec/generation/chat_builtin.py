"""llama.cpp's built-in chat templates (llama_chat_apply_template): the fallback of pyspec.generation.chat.

A use of the ABI layer's chat-template wrapper (pyspec.core.chat) for OpenAI-style
messages: llama_chat_apply_template knows a fixed list of templates by name
("chatml", "llama2", "gemma", ...) and recognises a model's Jinja template by
its markers; it does not run Jinja.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pyspec.core.chat import apply_chat_template, builtin_chat_templates
from pyspec.core.vocab import MAX_TEXT_BYTES

__all__ = ["apply_builtin_template", "builtin_templates"]


def builtin_templates() -> list[str]:
    """The names llama_chat_apply_template knows (llama_chat_builtin_templates)."""
    return builtin_chat_templates()


def apply_builtin_template(template: str, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool) -> str:
    """Render ``messages`` with a built-in template (a name, or a model's template text it recognises).

    ChatTemplateError (a ValueError) when llama.cpp does not know the template.
    """
    pairs = [(str(m.get("role", "")), _content_text(m.get("content"))) for m in messages]
    n = sum(len(r) + len(c) for r, c in pairs)
    if n > MAX_TEXT_BYTES:  # the prompt could not be tokenized; llama.cpp would build it in memory first
        raise ValueError(f"messages of {n} characters are too long for a prompt (at most {MAX_TEXT_BYTES})")
    return apply_chat_template(template, pairs, add_generation_prompt)


def _content_text(content: Any) -> str:
    """A message's content as text (OpenAI-style lists of parts joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type", "text") == "text")
    raise ValueError(f"message content must be a string or a list of text parts, not {type(content).__name__}")
