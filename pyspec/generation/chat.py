"""Chat prompts: a model's ``tokenizer.chat_template`` rendered with Jinja2, as Hugging Face transformers renders it.

The template runs in jinja2's ImmutableSandboxedEnvironment (a template from
a model file is untrusted input) with the names transformers gives it:
``messages``, ``add_generation_prompt``, ``bos_token`` / ``eos_token`` (the
vocabulary's texts), ``raise_exception``, ``strftime_now`` and a ``tojson``
that keeps non-ASCII text. A template given by name, or one that Jinja2
cannot compile, goes to llama.cpp's built-in templates
(llama_chat_apply_template), which know a fixed list by name and by marker.
A model without a template (a base model such as Gemma 3 270M) gets the
built-in template of its architecture (:func:`fallback_template`: gemma ->
"gemma", llama -> "llama3", any other -> "chatml") and one warning naming it;
``template=`` (a built-in name or a Jinja template) chooses another.

    text = render_chat(model, [{"role": "user", "content": "Hi"}])
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from pyspec.core.model import Model
from pyspec.core.vocab import Vocab
from pyspec.errors import ChatTemplateError
from pyspec.generation.chat_sandbox import RenderPool, TemplateBudget, compile_template, default_pool

__all__ = ["CHAT_TEMPLATE_KEY", "FALLBACK_TEMPLATES", "RenderPool", "TemplateBudget",
           "chat_template", "fallback_template", "render_chat", "render_template", "tokenize_chat"]

CHAT_TEMPLATE_KEY = "tokenizer.chat_template"

# general.architecture prefix -> the llama.cpp built-in template for a model that brings none;
# the first match wins, "chatml" is the default (the most widely trained turn format)
FALLBACK_TEMPLATES: tuple[tuple[str, str], ...] = (("gemma", "gemma"), ("llama", "llama3"))
_FALLBACK_DEFAULT = "chatml"
_warned_lock = threading.Lock()
_warned: set[str] = set()  # model paths already warned about: one warning per model file


def fallback_template(model: Model) -> str:
    """The built-in template name for a model without a chat template, from its architecture."""
    arch = str(model.meta("general.architecture") or "")
    for prefix, name in FALLBACK_TEMPLATES:
        if arch.startswith(prefix):
            return name
    return _FALLBACK_DEFAULT


def _fallback_for(model: Model) -> str:
    """fallback_template(model), with a warning the first time a model file falls back."""
    name = fallback_template(model)
    key = str(model.path)
    with _warned_lock:
        first = key not in _warned
        _warned.add(key)
    if first:
        warnings.warn(
            f"{model.path.name} has no chat template ({CHAT_TEMPLATE_KEY}): using the built-in {name!r} template "
            f"for its architecture; pass chat_template= (a built-in name or a Jinja template) to choose another",
            UserWarning, stacklevel=3)
    return name


def chat_template(model: Model) -> str | None:
    """The model's chat template text (GGUF key tokenizer.chat_template), or None."""
    return model.meta(CHAT_TEMPLATE_KEY)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"the chat template refused the messages: {message}")


def _jinja() -> Any:
    try:
        import jinja2.sandbox
    except ImportError:
        raise ImportError("chat templates need jinja2: pip install 'llama-pyspec[server]' (or jinja2)") from None
    return jinja2


def _compile(template: str) -> Any:
    _jinja()
    from jinja2 import TemplateError

    try:
        return compile_template(template, _raise_exception)
    except TemplateError as e:
        raise ChatTemplateError(f"the chat template does not compile: {e}") from None


def _check_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError("messages must be a list of {'role': ..., 'content': ...} objects")
    if not messages:
        raise ValueError("messages is empty")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise ValueError(f"message {i} must be an object with a string 'role'")
        c = m.get("content")
        if c is not None and not isinstance(c, (str, list)):
            raise ValueError(f"message {i}: content must be a string or a list of parts")
        out.append(dict(m))
    return out


def render_template(template: str, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                    bos_token: str = "", eos_token: str = "", budget: TemplateBudget | RenderPool | None = None,
                    **kwargs: Any) -> str:
    """Render a Jinja chat template in the sandbox, with the names transformers passes.

    ``budget``: None renders in this thread (no bound on time or memory: for trusted templates); a
    TemplateBudget or a RenderPool renders in a worker process within that budget (ChatTemplateError
    naming the budget when it is exceeded; the messages and kwargs must then be JSON values)."""
    from jinja2 import TemplateError

    msgs = _check_messages(messages)
    if budget is not None:
        pool = budget if isinstance(budget, RenderPool) else default_pool(budget)
        return pool.render(template, {"messages": msgs, "add_generation_prompt": add_generation_prompt,
                                      "bos_token": bos_token, "eos_token": eos_token, **kwargs})
    try:
        out: str = _compile(template).render(messages=msgs, add_generation_prompt=add_generation_prompt,
                                             bos_token=bos_token, eos_token=eos_token, **kwargs)
    except ChatTemplateError:
        raise
    except (TemplateError, TypeError, KeyError, IndexError, AttributeError) as e:
        raise ChatTemplateError(f"the chat template failed on these messages: {type(e).__name__}: {e}") from None
    return out


def render_chat(model: Model, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                template: str | None = None, budget: TemplateBudget | RenderPool | None = None,
                **kwargs: Any) -> str:
    """The prompt text of ``messages`` for ``model``.

    ``template`` None uses the model's own template, or for a model without one
    the built-in template of its architecture (:func:`fallback_template`, with a
    warning once per model file); a llama.cpp built-in name ("chatml",
    "llama2", "gemma", ...) uses llama_chat_apply_template; any other string is
    a Jinja template. ``kwargs`` reach the template (e.g.
    ``enable_thinking``). ``budget``: as :func:`render_template` (a Jinja template then renders in a
    worker process within it; a built-in template is llama.cpp's fixed code and renders here).
    """
    from pyspec.generation.chat_builtin import apply_builtin_template, builtin_templates

    msgs = _check_messages(messages)
    if template is None:
        template = chat_template(model) or _fallback_for(model)
    if template in builtin_templates():
        return apply_builtin_template(template, msgs, add_generation_prompt)
    vocab = model.vocab
    specials = {name: (vocab.token_to_piece(tok, special=True) if tok >= 0 else "")
                for name, tok in (("bos_token", vocab.bos), ("eos_token", vocab.eos))}
    try:
        return render_template(template, msgs, add_generation_prompt=add_generation_prompt, budget=budget,
                               **specials, **kwargs)
    except ChatTemplateError as e:
        if "does not compile" not in str(e):
            raise
        # Jinja2 cannot read it: llama.cpp may still recognise the template by its markers
        try:
            return apply_builtin_template(template, msgs, add_generation_prompt)
        except ValueError:
            raise e from None


def tokenize_chat(vocab: Vocab, text: str, max_tokens: int | None = None) -> list[int]:
    """Tokens of a rendered chat: special-token text parsed (a template writes "<s>", "<start_of_turn>"...);
    BOS added only when the template did not write it. ``max_tokens``: as :meth:`Vocab.tokenize`'s."""
    bos = vocab.bos
    starts_with_bos = bos >= 0 and text.startswith(vocab.token_to_piece(bos, special=True))
    return vocab.tokenize(text, add_special=not starts_with_bos, parse_special=True, max_tokens=max_tokens)
