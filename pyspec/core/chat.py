"""Chat templates: llama_chat_apply_template, llama_chat_builtin_templates and
llama_model_chat_template (llama.h).

llama.cpp's C API has no Jinja engine: it recognises a fixed list of templates,
by name ("chatml", "llama3", ...) or by telltale substrings of a model's Jinja
source, and formats the messages itself. A template it does not recognise
raises :class:`~pyspec.errors.ChatTemplateError`.

    from pyspec.core.chat import apply_chat_template
    prompt = apply_chat_template(model, [{"role": "user", "content": "Hi"}])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from pyspec.core.cstrings import c_text
from pyspec.errors import ChatTemplateError, NoChatTemplateError
from pyspec.ffi import ffi, llama

if TYPE_CHECKING:
    from pyspec.core.model import Model

__all__ = ["Message", "apply_chat_template", "builtin_chat_templates"]

# {"role": ..., "content": ...} (extra keys are ignored), or a (role, content) pair
Message = Mapping[str, str] | tuple[str, str]


def builtin_chat_templates() -> list[str]:
    """Mirrors llama_chat_builtin_templates: the names llama.cpp formats itself."""
    n = llama.llama_chat_builtin_templates(ffi.NULL, 0)
    out = ffi.new("const char *[]", n)
    n = min(n, llama.llama_chat_builtin_templates(out, n))
    return [ffi.string(out[i]).decode() for i in range(n)]


def _role_content(i: int, message: Message) -> tuple[bytes, bytes]:
    if isinstance(message, tuple) and len(message) == 2:
        role, content = message
    elif isinstance(message, Mapping):
        if "role" not in message or "content" not in message:
            raise ValueError(f"message {i} needs 'role' and 'content'")
        role, content = message["role"], message["content"]
    else:
        raise TypeError(f"message {i} must be a mapping with 'role' and 'content' or a (role, content) pair")
    return c_text(role, f"message {i} role"), c_text(content, f"message {i} content")


def apply_chat_template(
    model_or_template: Model | str,
    messages: Sequence[Message],
    add_generation_prompt: bool = True,
) -> str:
    """Mirrors llama_chat_apply_template: the prompt text for ``messages``.

    ``model_or_template`` is a Model (its own template, llama_model_chat_template)
    or a template: a built-in name (see :func:`builtin_chat_templates`) or a
    Jinja source that llama.cpp recognises. ``add_generation_prompt`` ends the
    text with the opening of an assistant turn.
    """
    if isinstance(model_or_template, str):
        template = model_or_template
    else:
        found = model_or_template.chat_template()
        if found is None:
            raise NoChatTemplateError(
                "the model has no chat template (tokenizer.chat_template); pass a template name "
                "such as 'chatml' instead"
            )
        template = found
    tmpl = c_text(template, "chat template")
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError("messages must be a sequence of messages")
    pairs = [_role_content(i, m) for i, m in enumerate(messages)]
    # the C strings must outlive the call: keep them in this list
    keep = [(ffi.new("char[]", r), ffi.new("char[]", c)) for r, c in pairs]
    chat = ffi.new("struct llama_chat_message[]", max(len(keep), 1))
    for i, (r, c) in enumerate(keep):
        chat[i].role = r
        chat[i].content = c
    size = 2 * sum(len(r) + len(c) for r, c in pairs) + 256
    for _ in range(2):
        if size >= 2**31:
            raise ValueError("the formatted chat would exceed 2 GiB")
        buf = ffi.new("char[]", size)
        n = llama.llama_chat_apply_template(tmpl, chat, len(pairs), bool(add_generation_prompt), buf, size)
        if n < 0:
            shown = template if len(template) <= 60 else template[:57] + "..."
            raise ChatTemplateError(
                f"llama.cpp does not support the chat template {shown!r} (llama_chat_apply_template returned {n}); "
                f"built-in names: {', '.join(builtin_chat_templates())}"
            )
        if n < size:  # it fitted (the copy is not NUL-terminated when it fills the buffer)
            return ffi.unpack(buf, n).decode("utf-8", "replace")
        size = n + 1
    raise AssertionError("unreachable: the second call had room for the whole result")
