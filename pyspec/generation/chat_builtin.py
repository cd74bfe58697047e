"""llama.cpp's built-in chat templates (llama_chat_apply_template): the fallback of pyspec.generation.chat.

Declared here, minimally, until the chat-template wrapper of the ABI layer
(pyspec/core/chat.py, issue 13) lands; then this module becomes a use of it.
llama_chat_apply_template knows a fixed list of templates by name ("chatml",
"llama2", "gemma", ...) and recognises a model's Jinja template by its markers;
it does not run Jinja.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

from pyspec.ffi import ffi, llama

__all__ = ["apply_builtin_template", "builtin_templates"]

_DECL = """
typedef struct llama_chat_message {
    const char * role;
    const char * content;
} llama_chat_message;
int32_t llama_chat_apply_template(const char * tmpl, const struct llama_chat_message * chat, size_t n_msg,
                                  bool add_ass, char * buf, int32_t length);
int32_t llama_chat_builtin_templates(const char ** output, size_t len);
"""
_declared = False
_lock = threading.Lock()


def _declare() -> None:
    global _declared
    with _lock:
        if not _declared:
            try:
                ffi.cdef(_DECL, override=True)
            except Exception:
                pass  # already declared by the ABI layer (decl/llama.h)
            _declared = True


def builtin_templates() -> list[str]:
    """The names llama_chat_apply_template knows (llama_chat_builtin_templates)."""
    _declare()
    n = llama.llama_chat_builtin_templates(ffi.NULL, 0)
    arr = ffi.new("const char *[]", max(n, 1))
    n = llama.llama_chat_builtin_templates(arr, n)
    return [ffi.string(arr[i]).decode() for i in range(n)]


def apply_builtin_template(template: str, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool) -> str:
    """Render ``messages`` with a built-in template (a name, or a model's template text it recognises).

    ValueError when llama.cpp does not know the template.
    """
    _declare()
    keep = []
    chat = ffi.new("llama_chat_message[]", max(len(messages), 1))
    for i, m in enumerate(messages):
        role = ffi.new("char[]", str(m.get("role", "")).encode())
        content = ffi.new("char[]", _content_text(m.get("content")).encode())
        keep += [role, content]
        chat[i].role = role
        chat[i].content = content
    tmpl = template.encode()
    cap = 1024 + 2 * sum(len(_content_text(m.get("content"))) for m in messages)
    buf = ffi.new("char[]", cap)
    n = llama.llama_chat_apply_template(tmpl, chat, len(messages), add_generation_prompt, buf, cap)
    if n < 0:
        raise ValueError(f"llama.cpp does not know this chat template ({template[:40]!r}...); "
                         f"built-in names: {', '.join(builtin_templates())}")
    if n > cap:
        buf = ffi.new("char[]", n)
        n = llama.llama_chat_apply_template(tmpl, chat, len(messages), add_generation_prompt, buf, n)
    return ffi.unpack(buf, n).decode("utf-8", "replace")


def _content_text(content: Any) -> str:
    """A message's content as text (OpenAI-style lists of parts joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type", "text") == "text")
    raise ValueError(f"message content must be a string or a list of text parts, not {type(content).__name__}")
