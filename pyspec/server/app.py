"""The HTTP API over an Engine: OpenAI-compatible endpoints and llama-server's native ones (Starlette, SSE).

- ``/v1/completions``, ``/v1/chat/completions`` (streaming and not), ``/v1/models``:
  what the official ``openai`` client calls;
- ``/completion``, ``/tokenize``, ``/detokenize``, ``/health``, ``/props``,
  ``/slots``, ``/apply-template``, ``/chat/completions/input_tokens``: llama-server's native API
  with its field names (``content``, ``tokens``, ``stop_type``, ``generation_settings``,
  ``timings`` with ``draft_n`` / ``draft_n_accepted``...).

Prompts are read as llama-server reads them (a text, token ids, both mixed, or a list of prompts),
tokenized here and submitted as token ids, ``n`` choices each; a prompt that does not fit a slot
gets llama-server's ``exceed_context_size_error`` before anything is queued.

Every completion reports the request's speculative statistics in ``timings`` (llama-server's
``draft_n`` / ``draft_n_accepted``) and in a ``speculative`` object (vLLM's counters: drafts, draft
tokens, accepted tokens, acceptance per position, mean acceptance length, histogram by draft
length). With ``metrics=True``, ``/metrics`` serves the engine's counters in Prometheus text
format under llama-server's and vLLM's names (pyspec.server.metrics); off, it answers 501 as
llama-server does without ``--metrics``.
A bad request gets a 4xx with ``{"error": {"code", "message", "type"}}`` and
queues nothing; a client that disconnects cancels its request; with an API key
every endpoint but ``/health`` and the model list wants ``Authorization: Bearer KEY``.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import dataclasses
import errno
import functools
import hmac
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from pyspec.errors import BadRequest, DecodeError, PyspecError, SlotBusyError
from pyspec.generation.chat import RenderPool, TemplateBudget
from pyspec.generation.embeddings import Embedder, Embedding
from pyspec.generation.engine import Engine
from pyspec.generation.requests import Completion, Delta, Request, RequestHandle, TokenLogprob
from pyspec.server.cors import Cors, CorsPolicy
from pyspec.server.infill import fim_missing, format_prompt_infill
from pyspec.server.metrics import CONTENT_TYPE, render_metrics
from pyspec.server.params import (
    EmbeddingParsed,
    Parsed,
    Prompt,
    ServerDefaults,
    apply_template_request,
    chat_request,
    completion_request,
    detokenize_request,
    embedding_request,
    infill_request,
    native_request,
    parse_json,
    slot_action_request,
    slot_filename,
    tokenize_request,
)
from pyspec.server.proxy import proxy_request

__all__ = ["create_app"]

_PUBLIC = {"/health", "/v1/health", "/models", "/v1/models"}
_FINISH = {"eog": "stop", "stop": "stop", "n_predict": "length", "context": "length", "cancelled": "stop"}
_STOP_TYPE = {"eog": "eos", "stop": "word", "n_predict": "limit", "context": "limit", "cancelled": "none"}


def _error(status: int, message: str, kind: str = "invalid_request_error", **extra: Any) -> JSONResponse:
    # llama-server's error body, which the openai client reads as well
    return JSONResponse({"error": {"code": status, "message": message, "type": kind, **extra}}, status_code=status)


class _ContextExceeded(Exception):
    """A prompt as long as a slot's context, or longer: llama-server's exceed_context_size_error."""

    def __init__(self, n_prompt: int, n_ctx: int) -> None:
        # server-context.cpp's message, and its fields (server-common.cpp format_error_response)
        super().__init__(f"request ({n_prompt} tokens) exceeds the available context size ({n_ctx} tokens), "
                         "try increasing it")
        self.n_prompt, self.n_ctx = n_prompt, n_ctx


class _ApiKey:
    """Refuses requests without the key, except to the public endpoints, with llama-server's 401 body.

    The key comes as ``Authorization: Bearer <key>`` (the scheme is required: a bare key there is
    refused) or, when there is no Authorization header, as ``X-Api-Key: <key>`` (llama-server's
    Anthropic-style header). It is compared in constant time (hmac.compare_digest), so the time a
    refusal takes says nothing about how much of a guess was right.
    """

    def __init__(self, app: ASGIApp, key: str | Sequence[str] | None) -> None:
        self.app = app
        keys = [key] if isinstance(key, str) else list(key or ())
        self.keys = [k.encode("utf-8") for k in keys if k]  # several: llama-server's --api-key a,b / --api-key-file

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.keys and scope["type"] == "http" and scope["path"] not in _PUBLIC:
            given = _presented_key(scope["headers"])
            # compare_digest on bytes: constant time for equal lengths, and any bytes are allowed; every
            # key is compared, so the time says nothing about which one came close
            if given is None or not sum(hmac.compare_digest(given, k) for k in self.keys):
                await _error(401, "Invalid API Key", "authentication_error")(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _presented_key(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The key a request presents: the credentials of ``Authorization: Bearer ...``, else ``X-Api-Key``."""
    auth = next((v for k, v in headers if k.lower() == b"authorization"), None)
    if auth is not None:
        scheme, _, credentials = auth.strip().partition(b" ")
        # RFC 9110: the scheme is case-insensitive; anything but Bearer (or no scheme at all) is refused
        return credentials.strip() if scheme.lower() == b"bearer" and credentials.strip() else None
    return next((v.strip() for k, v in headers if k.lower() == b"x-api-key"), None)


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


_MAX_BODY = 16 << 20  # bytes: a request body larger than this is refused, not read into memory
# log-probabilities one request may ask for (choices x tokens x (n_probs + 1)): each is kept until the request
# ends and written to its answer (some 100 bytes of JSON each; 128 choices of 1000 tokens x 100 took 7 GB)
_MAX_PROB_ENTRIES = 1 << 20


class _TooLarge(Exception):
    pass


async def _raw_body(req: HttpRequest) -> bytes:
    """The request's body, read chunk by chunk so that one over _MAX_BODY is refused before it is all held."""
    chunks, n = [], 0
    async for chunk in req.stream():
        n += len(chunk)
        if n > _MAX_BODY:
            raise _TooLarge
        chunks.append(chunk)
    return b"".join(chunks)


async def _body(req: HttpRequest) -> Any:
    # parsing and checking run in a worker thread: a large body costs that thread, not the event loop
    return await asyncio.to_thread(parse_json, await _raw_body(req))


def _nested_values(paths: list[str], obj: dict[str, Any]) -> dict[str, Any]:
    """Only ``paths`` of ``obj``, each under its path ("generation_settings/n_predict"); all of it when
    none is asked (llama-server's response_fields, server-common.cpp json_get_nested_values)."""
    if not paths:
        return obj
    out: dict[str, Any] = {}
    for path in paths:
        cur: Any = obj
        for key in path.split("/"):
            if not isinstance(cur, dict) or key not in cur:
                break
            cur = cur[key]
        else:
            out[path] = cur
    return out


def _progress_json(d: Delta) -> dict[str, Any]:
    """llama-server's prompt_progress object (result_prompt_progress::to_json)."""
    p = d.progress
    assert p is not None
    return {"total": p.total, "cache": p.cache, "processed": p.processed, "time_ms": round(p.time_ms, 3)}


def _lp_json(lp: TokenLogprob, n_top: int, post_sampling: bool = False) -> dict[str, Any]:
    # llama-server's probs_vector_to_json: post-sampling probabilities are answered as p, under "prob" / "top_probs"
    if post_sampling:
        return {"id": lp.id, "token": lp.text, "bytes": list(lp.token_bytes), "prob": math.exp(lp.logprob),
                "top_probs": [{"id": i, "token": t, "bytes": list(b), "prob": math.exp(v)}
                              for i, t, b, v in lp.top[:n_top]]}
    return {"id": lp.id, "token": lp.text, "bytes": list(lp.token_bytes), "logprob": lp.logprob,
            "top_logprobs": [{"id": i, "token": t, "bytes": list(b), "logprob": v} for i, t, b, v in lp.top[:n_top]]}


class _Api:
    """The handlers, over one started engine."""

    def __init__(self, engine: Engine, model_name: str, defaults: ServerDefaults, slot_save_path: Path | None,
                 metrics: bool = False, slots: bool = True, aliases: Sequence[str] = (),
                 tags: Sequence[str] = (), props: bool = False, templates: RenderPool | None = None,
                 embedder: Embedder | None = None, embd_normalize: int = 2, cors_proxy: bool = False,
                 verbose: bool = False) -> None:
        self.engine = engine
        self.verbose = verbose
        self.cors_proxy_on = cors_proxy
        self.embedder = embedder
        self.embd_normalize = embd_normalize
        # Jinja chat templates render in these worker processes, within their budget (a template is
        # untrusted code: it could loop or allocate without end)
        self.templates = templates or RenderPool()
        # renders waiting for a worker wait here, on the loop, and run in threads of their own: a render
        # that uses its whole budget holds none of the threads that read the other requests
        self._render_slots = asyncio.Semaphore(self.templates.max_size)
        self._render_threads = concurrent.futures.ThreadPoolExecutor(self.templates.max_size, "pyspec-template")
        self.model_name = model_name
        self.aliases, self.tags = sorted(set(aliases)), sorted(set(tags))  # llama-server keeps them in std::sets
        self.defaults = defaults
        self.slot_save_path = slot_save_path
        self.metrics_on = metrics
        self.slots_on = slots
        self.props_on = props
        self.created = int(time.time())

    # --- helpers ----------------------------------------------------------------

    async def _request(self, build: Callable[[Any, ServerDefaults, int, int], Parsed],
                       body: Any) -> tuple[Parsed, list[Request]]:
        """The body read and checked, and one Request of token ids per choice, in a worker thread (a long
        grammar or prompt is scanned there, and the prompts are tokenized there); a chat's messages
        rendered by the template workers."""
        parsed = await asyncio.to_thread(build, body, self.defaults, self.engine.n_vocab, self.engine.n_parallel)
        chat = await self._render(parsed.request, parsed.continue_final) \
            if parsed.request.messages is not None else None
        return parsed, await asyncio.to_thread(self._choices, parsed, chat)

    async def _render(self, r: Request, continue_final: bool = False) -> str:
        """The chat's prompt text: its messages through the template, in a template worker within the budget.

        ``continue_final``: the final (assistant) message is left open, its text the end of the prompt, so
        that the model continues it (llama-server's assistant prefill). The template renders it with a
        marker after its content, and the prompt is cut at the marker: whatever the template writes to
        close a turn is dropped, whatever it writes before the content is kept."""
        from pyspec.generation.chat import render_chat

        assert r.messages is not None
        messages = list(r.messages)
        marker = f"\u2063pyspec-continue-{uuid.uuid4().hex}\u2063"
        if continue_final:
            last = dict(messages[-1])
            content = last.get("content")
            if isinstance(content, list):  # text parts, continued as one text (llama-server joins them so)
                content = "\n\n".join(part["text"] for part in content)
            last["content"] = (content or "") + marker
            messages[-1] = last
        run = functools.partial(render_chat, self.engine.model, messages,
                                add_generation_prompt=r.add_generation_prompt, template=r.chat_template,
                                budget=self.templates, **dict(r.chat_template_kwargs or {}))
        async with self._render_slots:
            text = await asyncio.get_running_loop().run_in_executor(self._render_threads, run)
        if not continue_final:
            return text
        cut = text.find(marker)
        if cut < 0:
            raise BadRequest("the chat template does not show the final assistant message's content: "
                             "it cannot be continued")
        return text[:cut]

    def _prompt_tokens(self, r: Request, prompt: Prompt | None, chat: str | None = None) -> list[int]:
        """One prompt's tokens, as llama-server makes them: a chat rendered with its template, a text
        tokenized with BOS, a mixed list piece by piece (server-common.cpp tokenize_mixed: only a
        leading text gets BOS). _ContextExceeded when it leaves no room in a slot."""
        e = self.engine
        if prompt is None:
            assert chat is not None  # the chat's rendered messages
            toks = e.tokenize_chat(chat)
        else:
            toks = self._mixed_tokens(prompt, r.add_special, r.parse_special)
        if len(toks) >= e.n_ctx_seq:  # the engine needs room for one token more (server-context.cpp: >= n_ctx)
            raise _ContextExceeded(len(toks), e.n_ctx_seq)
        return toks

    def _mixed_tokens(self, prompt: Prompt, add_special: bool, parse_special: bool) -> list[int]:
        """A text, or texts and token ids mixed, as tokens (server-common.cpp tokenize_mixed: BOS only before
        a leading text)."""
        toks: list[int] = []
        for k, part in enumerate([prompt] if isinstance(prompt, str) else prompt):
            if isinstance(part, str):
                toks += self.engine.tokenize_text(part, add_special and k == 0, parse_special)
            else:
                toks.append(part)
        return toks

    def _choices(self, parsed: Parsed, chat: str | None = None) -> list[Request]:
        """One Request per choice: choice i * n + j is the j-th of prompt i (a chat's messages: one prompt)."""
        r = parsed.request
        prompts: list[Prompt | None] = list(parsed.prompts) if r.messages is None else [None]
        if r.n_probs:
            n_ctx = self.engine.n_ctx_seq
            each = (n_ctx if r.n_predict < 0 else min(r.n_predict, n_ctx)) * (r.n_probs + 1)
            n_choices = len(prompts) * parsed.n
            if n_choices * each > _MAX_PROB_ENTRIES:
                raise BadRequest(f"{n_choices} choice(s) of up to {each} log-probabilities each: {n_choices * each} "
                                 f"in all, more than the {_MAX_PROB_ENTRIES} a request may ask for (fewer choices, "
                                 "tokens or n_probs)")
        out: list[Request] = []
        for p in prompts:
            toks = self._prompt_tokens(r, p, chat)
            out += [dataclasses.replace(r, prompt=toks, messages=None) for _ in range(parsed.n)]
        return out

    def _submit(self, reqs: list[Request]) -> list[RequestHandle]:
        """Every choice queued, or none (a refused one cancels those queued before it)."""
        handles: list[RequestHandle] = []
        try:
            for req in reqs:
                handles.append(self.engine.submit(req))
        except (ValueError, TypeError) as e:
            for h in handles:
                h.cancel()
            raise BadRequest(str(e)) from None
        except BaseException:
            for h in handles:
                h.cancel()
            raise
        return handles

    async def _wait(self, http: HttpRequest, handles: list[RequestHandle]) -> list[Completion]:
        """The completions, cancelling every request if the client goes away first."""
        results = [asyncio.ensure_future(h.aresult()) for h in handles]
        try:
            while True:
                done, _ = await asyncio.wait(results, timeout=0.25)
                if len(done) == len(results):
                    return [f.result() for f in results]
                if any(f.exception() is not None for f in done):
                    next(f for f in done if f.exception() is not None).result()  # raise the first failure
                if await http.is_disconnected():
                    for h in handles:
                        h.cancel()
        finally:
            for h, f in zip(handles, results, strict=True):
                if not f.done():
                    h.cancel()
                    f.cancel()

    def _stream(self, handles: list[RequestHandle], first: list[bytes],
                piece: Callable[[int, Delta], dict[str, Any] | None],
                final: Callable[[list[Completion]], list[dict[str, Any]]], done_marker: bool) -> StreamingResponse:
        """SSE of the choices' pieces as they come (``piece(choice, delta)``), then ``final``'s objects."""
        async def pump(i: int, h: RequestHandle, queue: asyncio.Queue[tuple[int, Delta | None]]) -> None:
            try:
                async for d in h:
                    await queue.put((i, d))
            except Exception:
                pass  # the failure is raised again by aresult() below
            finally:
                await queue.put((i, None))

        async def gen() -> AsyncIterator[bytes]:
            queue: asyncio.Queue[tuple[int, Delta | None]] = asyncio.Queue()
            pumps = [asyncio.ensure_future(pump(i, h, queue)) for i, h in enumerate(handles)]
            try:
                for b in first:
                    yield b
                left = len(handles)
                while left:
                    i, d = await queue.get()
                    if d is None:
                        left -= 1
                        continue
                    obj = piece(i, d)
                    if obj is not None:
                        yield _sse(obj)
                comps = [await h.aresult() for h in handles]
                for obj in final(comps):
                    yield _sse(obj)
                if done_marker:
                    yield b"data: [DONE]\n\n"
            except Exception as e:  # the request failed inside the engine: say so in the stream
                yield _sse({"error": {"code": 500, "message": str(e), "type": "server_error"}})
            finally:
                for h in handles:
                    h.cancel()  # a client that went away (the generator is closed) stops the requests
                for t in pumps:
                    t.cancel()

        return StreamingResponse(gen(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def _totals(self, out: dict[str, Any], comps: list[Completion], n: int) -> dict[str, Any]:
        """``out`` with the response's usage (over the choices), timings and speculative counters."""
        out["usage"] = self._usage(comps, n)
        out["timings"] = comps[0].stats.timings()
        out["speculative"] = comps[0].stats.speculative()
        return out

    def _usage(self, comps: list[Completion], n: int = 1) -> dict[str, Any]:
        # OpenAI's totals over the choices: each prompt counted once (n choices share it)
        n_prompt = sum(len(c.prompt_tokens) for c in comps[::n])
        n_gen = sum(len(c.tokens) for c in comps)
        return {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen,
                "prompt_tokens_details": {"cached_tokens": sum(c.stats.n_cached for c in comps[::n])}}

    def _verbose(self, out: dict[str, Any], parsed: Parsed, comps: list[Completion],
                 reqs: list[Request]) -> dict[str, Any]:
        """``out`` with llama-server's debugging copy of the native answer under "__verbose" (the first
        choice's), when the server runs with --verbose or the request asks for it."""
        if self.verbose or parsed.verbose:
            out["__verbose"] = self._native_final(comps[0], reqs[0], False)
        return out

    def _generation_settings(self, r: Request) -> dict[str, Any]:
        """The settings a completion ran with (llama-server's generation_settings, task_params::to_json)."""
        s = r.sampling or self.engine.sampling
        return {"n_predict": r.n_predict, "seed": s.seed, "temperature": s.temp, "dynatemp_range": s.dynatemp_range,
                "dynatemp_exponent": s.dynatemp_exponent, "top_k": s.top_k, "top_p": s.top_p, "min_p": s.min_p,
                "top_n_sigma": s.top_n_sigma, "xtc_probability": s.xtc_probability,
                "xtc_threshold": s.xtc_threshold, "typical_p": s.typ_p, "repeat_last_n": s.penalty_last_n,
                "repeat_penalty": s.penalty_repeat, "presence_penalty": s.penalty_present,
                "frequency_penalty": s.penalty_freq, "mirostat": s.mirostat, "mirostat_tau": s.mirostat_tau,
                "mirostat_eta": s.mirostat_eta, "stop": list(r.stop), "n_probs": r.n_probs,
                "min_keep": s.min_keep, "grammar": s.grammar, "ignore_eos": s.ignore_eos,
                "cache_prompt": r.cache_prompt, "id_slot": r.slot_id,
                "speculative.n_max": r.n_draft_max, "speculative.n_min": r.n_draft_min}

    # --- llama-server's native endpoints ------------------------------------------

    async def health(self, _: HttpRequest) -> Response:
        return JSONResponse({"status": "ok"})

    async def models(self, _: HttpRequest) -> Response:
        m = self.engine.model
        return JSONResponse({
            "object": "list",
            "data": [{"id": self.model_name, "aliases": self.aliases, "tags": self.tags, "object": "model",
                      "created": self.created, "owned_by": "pyspec",
                      "meta": {"n_vocab": self.engine.n_vocab, "n_ctx": self.engine.n_ctx_seq,
                               "n_ctx_train": m.n_ctx_train, "n_embd": m.n_embd, "n_params": m.n_params,
                               "size": m.size}}],
        })

    async def props(self, _: HttpRequest) -> Response:
        from pyspec.generation.chat import chat_template
        from pyspec.version import LLAMA_CPP_REVISION, __version__

        e, s = self.engine, self.defaults.sampling
        return JSONResponse({
            "default_generation_settings": {
                "n_ctx": e.n_ctx_seq,
                "params": {"n_predict": self.defaults.n_predict, "temperature": s.temp, "top_k": s.top_k,
                           "top_p": s.top_p, "min_p": s.min_p, "seed": s.seed, "repeat_penalty": s.penalty_repeat,
                           "cache_prompt": self.defaults.cache_prompt,
                           "speculative.n_max": self.defaults.n_draft_max,
                           "speculative.n_min": self.defaults.n_draft_min},
            },
            "total_slots": e.n_parallel,
            "model_path": str(e.model.path),
            "model_alias": self.model_name,
            "chat_template": chat_template(e.model) or "",
            "speculative": e.backend.has_spec,
            "build_info": f"pyspec {__version__}, llama.cpp {LLAMA_CPP_REVISION}",
        })

    async def props_change(self, req: HttpRequest) -> Response:
        # llama-server's POST /props (server-context.cpp): 501 without --props; with it, a success that
        # changes nothing (no property is writable there either)
        if not self.props_on:
            return _error(501, "This server does not support changing global properties. Start it with `--props`",
                          "not_supported_error")
        await _body(req)  # a body that is not JSON is still a 400
        return JSONResponse({"success": True})

    async def metrics(self, _: HttpRequest) -> Response:
        if not self.metrics_on:
            return _error(501, "This server does not support metrics endpoint. Start it with `--metrics`",
                          "not_supported_error")
        e = self.engine
        snap = e.metrics.snapshot()
        n_processing, n_waiting = e.load_counts()
        text = render_metrics(snap, model_name=self.model_name, n_processing=n_processing, n_waiting=n_waiting)
        return Response(text, media_type=CONTENT_TYPE,
                        headers={"Process-Start-Time-Unix": str(int(snap.t_start))})

    async def slots(self, _: HttpRequest) -> Response:
        if not self.slots_on:  # llama-server's answer under --no-slots (server-context.cpp)
            return _error(501, "This server does not support slots endpoint. Start it with `--slots`",
                          "not_supported_error")
        # each slot's context as llama-server reports it (n_ctx, per slot)
        return JSONResponse([{"id": i["id"], "n_ctx": self.engine.n_ctx_seq, **i} for i in self.engine.slot_info()])

    async def slot_action(self, req: HttpRequest) -> Response:
        slot_id, action = slot_action_request(req.path_params["id"], req.query_params.get("action", ""),
                                              self.engine.n_parallel)
        loop = asyncio.get_running_loop()
        if action == "erase":
            n = await loop.run_in_executor(None, self.engine.erase_slot, slot_id)
            return JSONResponse({"id_slot": slot_id, "n_erased": n})
        if self.slot_save_path is None:
            return _error(501, "slot files are off: start the server with --slot-save-path DIR", "not_supported_error")
        name = slot_filename(await _body(req))
        path = self.slot_save_path / name
        try:
            if action == "save":
                n = await loop.run_in_executor(None, self.engine.save_slot, slot_id, path)
                return JSONResponse({"id_slot": slot_id, "filename": name, "n_saved": n})
            if not path.is_file():
                return _error(404, f"no slot file {name!r}", "not_found_error")
            n = await loop.run_in_executor(None, self.engine.restore_slot, slot_id, path)
            return JSONResponse({"id_slot": slot_id, "filename": name, "n_restored": n})
        except OSError as e:
            if e.errno != errno.ENAMETOOLONG:
                raise
            # a file system with a shorter limit than slot_filename's (or a long --slot-save-path)
            raise BadRequest(f"'filename' is too long for the slot folder's file system: {e.strerror}") from None

    async def tokenize(self, req: HttpRequest) -> Response:
        content, add_special, parse_special, with_pieces = tokenize_request(await _body(req))
        vocab = self.engine.vocab

        def run() -> list[Any]:
            # special tokens parsed: at most what a slot's context holds (llama.cpp's tokenizer takes time
            # quadratic in the special tokens it finds); in a worker thread, as a prompt is tokenized
            toks = vocab.tokenize(content, add_special=add_special, parse_special=parse_special,
                                  max_tokens=self.engine.n_ctx_seq if parse_special else None)
            if not with_pieces:
                return toks
            out: list[Any] = []
            for t in toks:
                b = vocab.token_to_piece_bytes(t, special=True)
                try:
                    piece: Any = b.decode("utf-8")
                except UnicodeDecodeError:
                    piece = list(b)
                out.append({"id": t, "piece": piece})
            return out
        return JSONResponse({"tokens": await asyncio.to_thread(run)})

    async def detokenize(self, req: HttpRequest) -> Response:
        toks = detokenize_request(await _body(req), self.engine.n_vocab)
        return JSONResponse({"content": self.engine.vocab.detokenize(toks)})

    def _native_final(self, c: Completion, r: Request, stream: bool, index: int = 0,
                      return_tokens: bool = True) -> dict[str, Any]:
        n_probs = r.n_probs
        out: dict[str, Any] = {
            "index": index,
            "content": "" if stream else c.text,
            "tokens": c.tokens if return_tokens and not stream else [],
            "id_slot": c.slot_id,
            "stop": True,
            "model": self.model_name,
            "tokens_predicted": len(c.tokens),
            "tokens_evaluated": len(c.prompt_tokens),
            "generation_settings": self._generation_settings(r),
            "prompt": self.engine.vocab.detokenize(c.prompt_tokens, unparse_special=True),  # BOS as text too
            "tokens_cached": c.stats.n_cached,
            "has_new_line": "\n" in c.text,
            "truncated": c.truncated,  # the context cut the generation short, or was shifted
            "stop_type": _STOP_TYPE.get(c.stop_reason, "none"),
            "stopping_word": c.stopping_word,
            "timings": c.stats.timings(),
            "speculative": c.stats.speculative(),
        }
        if n_probs and not stream:
            out["completion_probabilities"] = [_lp_json(lp, n_probs, r.post_sampling_probs) for lp in c.logprobs]
        return out

    async def infill(self, req: HttpRequest) -> Response:
        """llama-server's /infill: a /completion whose prompt is built around the cursor (format_prompt_infill)."""
        vocab = self.engine.vocab
        missing = fim_missing(vocab.fim_tokens())
        if missing:
            return _error(501, f"Infill is not supported by this model: {missing}", "not_supported_error")
        body = await _body(req)

        def build(body: Any, d: ServerDefaults, n_vocab: int, n_parallel: int) -> Parsed:
            parsed, inp = infill_request(body, d, n_vocab, n_parallel)
            tokens_prompt = self.engine.tokenize_text(inp.prompt, False, True)
            n_batch = self.engine.ctx_tgt.n_batch
            parsed.prompts = [format_prompt_infill(vocab, inp, n_batch, d.n_predict, self.engine.n_ctx_seq,
                                                   d.spm_infill, tokens_prompt)]
            return parsed

        return await self._completion(req, build, body)

    async def completion(self, req: HttpRequest) -> Response:
        return await self._completion(req, native_request, await _body(req))

    async def _completion(self, req: HttpRequest, build: Callable[[Any, ServerDefaults, int, int], Parsed],
                          body: Any) -> Response:
        parsed, reqs = await self._request(build, body)
        hs = self._submit(reqs)
        if not parsed.stream:
            comps = await self._wait(req, hs)
            outs = [_nested_values(parsed.response_fields, self._native_final(c, r, False, i, parsed.return_tokens))
                    for i, (c, r) in enumerate(zip(comps, reqs, strict=True))]
            return await _json_answer(outs[0] if len(outs) == 1 else outs)  # several prompts or n: a list

        def piece(i: int, d: Delta) -> dict[str, Any]:
            out: dict[str, Any] = {"index": i, "content": d.text, "tokens": d.tokens if parsed.return_tokens else [],
                                   "stop": False, "id_slot": -1}
            if d.progress is not None:
                out["prompt_progress"] = _progress_json(d)
            r = parsed.request
            if r.n_probs:
                out["completion_probabilities"] = [_lp_json(lp, r.n_probs, r.post_sampling_probs) for lp in d.logprobs]
            return out

        return self._stream(hs, [], piece, lambda cs: [self._native_final(c, r, True, i)
                                                       for i, (c, r) in enumerate(zip(cs, reqs, strict=True))],
                            False)

    async def apply_template(self, req: HttpRequest) -> Response:
        """llama-server's /apply-template: the chat rendered as the prompt it would be ({"prompt": text})."""
        body = await _body(req)
        parsed = await asyncio.to_thread(apply_template_request, body, self.defaults)
        return JSONResponse({"prompt": await self._render(parsed.request, parsed.continue_final)})

    async def chat_input_tokens(self, req: HttpRequest) -> Response:
        """llama-server's /chat/completions/input_tokens: how many tokens the chat's prompt would be."""
        body = await _body(req)
        parsed = await asyncio.to_thread(apply_template_request, body, self.defaults)
        text = await self._render(parsed.request, parsed.continue_final)
        return JSONResponse({"input_tokens": len(await asyncio.to_thread(self.engine.tokenize_chat, text))})

    async def embeddings(self, req: HttpRequest) -> Response:
        """llama-server's /embedding and /embeddings: a list of {"index", "embedding": [vector, ...]}."""
        return await self._embeddings(req, oai=False)

    async def v1_embeddings(self, req: HttpRequest) -> Response:
        """OpenAI's /v1/embeddings: {"data": [{"embedding", "index", "object"}], "usage", ...}."""
        return await self._embeddings(req, oai=True)

    async def _embeddings(self, req: HttpRequest, oai: bool) -> Response:
        # server-context.cpp handle_embeddings_impl, its checks in its order
        embedder = self.embedder
        if embedder is None:
            return _error(501, "This server does not support embeddings. Start it with `--embeddings`",
                          "not_supported_error")
        if oai and embedder.pooling == "none":
            return _error(400, "Pooling type 'none' is not OAI compatible. Please use a different pooling type")
        body = await _body(req)
        parsed: EmbeddingParsed = await asyncio.to_thread(embedding_request, body, self.engine.n_vocab)
        norm = self.embd_normalize if parsed.normalize is None else parsed.normalize

        def run() -> list[Embedding]:
            prompts = [self._mixed_tokens(p, True, True) for p in parsed.prompts]
            for toks in prompts:  # every prompt checked before any is computed
                embedder.check(toks)
            return [embedder.embed(toks, norm) for toks in prompts]

        results = await asyncio.to_thread(run)
        if not oai or parsed.content_given:  # llama-server answers "content" in its own shape
            return JSONResponse([{"index": i, "embedding": [v.tolist() for v in r.vectors]}
                                 for i, r in enumerate(results)])
        data = []
        for i, r in enumerate(results):
            item: dict[str, Any] = {"embedding": r.vectors[0].tolist(), "index": i, "object": "embedding"}
            if parsed.base64:  # the float32 bytes, as llama-server's format_embeddings_response_oaicompat
                item["embedding"] = base64.b64encode(r.vectors[0].astype("<f4").tobytes()).decode("ascii")
                item["encoding_format"] = "base64"
            data.append(item)
        n_tokens = sum(r.n_tokens for r in results)
        model = body.get("model") if isinstance(body.get("model"), str) else self.model_name
        return JSONResponse({"model": model, "object": "list",
                             "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}, "data": data})

    async def cors_proxy(self, req: HttpRequest) -> Response:
        """llama-server's /cors-proxy?url=... (--ui-mcp-proxy): the request relayed (pyspec.server.proxy)."""
        if not self.cors_proxy_on:  # llama-server's res_403
            return JSONResponse({"error": {"message": "this feature is disabled", "type": "feature_disabled"}},
                                status_code=403)
        body = await _raw_body(req)
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in req.headers.raw]
        try:
            ans = await asyncio.to_thread(proxy_request, req.method, req.query_params.get("url", ""), headers, body)
        except OSError as e:
            return _error(502, str(e), "server_error")
        kind = next((v for k, v in ans.headers if k.lower() == "content-type"), None)
        out = Response(ans.body, status_code=ans.status, media_type=kind)
        out.raw_headers += [(k.encode("latin-1", "replace"), v.encode("latin-1", "replace"))
                            for k, v in ans.headers if k.lower() != "content-type"]
        return out

    # --- OpenAI-compatible endpoints -----------------------------------------------

    async def v1_completions(self, req: HttpRequest) -> Response:
        body = await _body(req)
        parsed, reqs = await self._request(completion_request, body)
        n_probs = parsed.request.n_probs
        hs = self._submit(reqs)
        cid = f"cmpl-{uuid.uuid4().hex}"

        def logprobs(lps: list[TokenLogprob], offset: int) -> dict[str, Any] | None:
            if not n_probs:
                return None
            offs, pos = [], offset
            for lp in lps:
                offs.append(pos)
                pos += len(lp.text)
            return {"tokens": [lp.text for lp in lps], "token_logprobs": [lp.logprob for lp in lps],
                    "top_logprobs": [{t: v for _, t, _, v in lp.top[:n_probs]} for lp in lps],
                    "text_offset": offs}

        def choice(i: int, text: str, finish: str | None, lps: list[TokenLogprob], offset: int) -> dict[str, Any]:
            return {"text": text, "index": i, "logprobs": logprobs(lps, offset), "finish_reason": finish}

        def envelope(choices: list[dict[str, Any]]) -> dict[str, Any]:
            return {"id": cid, "object": "text_completion", "created": int(time.time()), "model": self.model_name,
                    "choices": choices}

        if not parsed.stream:
            comps = await self._wait(req, hs)
            choices = [choice(i, c.text, _FINISH.get(c.stop_reason, "stop"), c.logprobs, 0)
                       for i, c in enumerate(comps)]
            return await _json_answer(self._verbose(self._totals(envelope(choices), comps, parsed.n), parsed, comps,
                                                    reqs))

        sent = [0] * len(hs)

        def piece(i: int, d: Delta) -> dict[str, Any] | None:
            if d.progress is not None:
                return {**envelope([choice(i, "", None, [], sent[i])]), "prompt_progress": _progress_json(d)}
            if not d.text and not d.logprobs:
                return None
            out = envelope([choice(i, d.text, None, d.logprobs, sent[i])])
            sent[i] += len(d.text)
            return out

        def final(comps: list[Completion]) -> list[dict[str, Any]]:
            outs = [envelope([choice(i, "", _FINISH.get(c.stop_reason, "stop"), [], sent[i])])
                    for i, c in enumerate(comps)]
            self._totals(outs[-1], comps, parsed.n)
            return outs

        return self._stream(hs, [], piece, final, True)

    async def v1_chat(self, req: HttpRequest) -> Response:
        body = await _body(req)
        parsed, reqs = await self._request(chat_request, body)
        n_probs = parsed.request.n_probs
        n_top = int(body.get("top_logprobs") or 0) if body.get("logprobs") else 0
        hs = self._submit(reqs)
        cid = f"chatcmpl-{uuid.uuid4().hex}"

        def logprobs(lps: list[TokenLogprob]) -> dict[str, Any] | None:
            if not n_probs:
                return None
            if parsed.request.post_sampling_probs:  # llama-server answers these in its own shape, with p
                return {"content": [_lp_json(lp, n_top, True) for lp in lps]}
            return {"content": [{"token": lp.text, "logprob": lp.logprob, "bytes": list(lp.token_bytes),
                                 "top_logprobs": [{"token": t, "logprob": v, "bytes": list(b)}
                                                  for _, t, b, v in lp.top[:n_top]]} for lp in lps]}

        def chunk(i: int, delta: dict[str, Any], finish: str | None, lps: list[TokenLogprob]) -> dict[str, Any]:
            return {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()),
                    "model": self.model_name,
                    "choices": [{"index": i, "delta": delta, "logprobs": logprobs(lps), "finish_reason": finish}]}

        if not parsed.stream:
            comps = await self._wait(req, hs)
            return await _json_answer(self._verbose(self._totals({
                "id": cid, "object": "chat.completion", "created": int(time.time()), "model": self.model_name,
                "choices": [{"index": i, "message": {"role": "assistant", "content": c.text},
                             "logprobs": logprobs(c.logprobs), "finish_reason": _FINISH.get(c.stop_reason, "stop")}
                            for i, c in enumerate(comps)],
            }, comps, parsed.n), parsed, comps, reqs))

        def piece(i: int, d: Delta) -> dict[str, Any] | None:
            if d.progress is not None:  # llama-server sends the role again with each progress report
                return {**chunk(i, {"role": "assistant", "content": None}, None, []),
                        "prompt_progress": _progress_json(d)}
            if not d.text and not d.logprobs:
                return None
            return chunk(i, {"content": d.text}, None, d.logprobs)

        def final(comps: list[Completion]) -> list[dict[str, Any]]:
            outs = [chunk(i, {}, _FINISH.get(c.stop_reason, "stop"), []) for i, c in enumerate(comps)]
            if parsed.include_usage:  # OpenAI's last chunk: no choices, the usage (llama-server adds the timings)
                outs.append({"id": cid, "object": "chat.completion.chunk", "created": int(time.time()),
                             "model": self.model_name, "choices": []})
            self._totals(outs[-1], comps, parsed.n)
            self._verbose(outs[0], parsed, comps, reqs)
            return outs

        # the role first, with no content yet (null, as llama-server and OpenAI send it)
        first = [_sse(chunk(i, {"role": "assistant", "content": None}, None, [])) for i in range(len(hs))]
        return self._stream(hs, first, piece, final, True)


async def _json_answer(content: Any) -> Response:
    """A completion's answer as JSONResponse writes it, encoded in a worker thread: with log-probabilities it
    may be tens of megabytes, and the event loop serves every other client meanwhile."""
    return await asyncio.to_thread(JSONResponse, content)  # it renders its body as it is made


def _guard(handler: Callable[[HttpRequest], Awaitable[Response]]) -> Callable[[HttpRequest], Awaitable[Response]]:
    async def run(req: HttpRequest) -> Response:
        try:
            return await handler(req)
        except BadRequest as e:
            return _error(400, str(e))
        except _ContextExceeded as e:
            return _error(400, str(e), "exceed_context_size_error", n_prompt_tokens=e.n_prompt, n_ctx=e.n_ctx)
        except _TooLarge:
            return _error(413, f"the request body is larger than {_MAX_BODY} bytes")
        except DecodeError as e:
            if e.code == 1:  # no room in the KV cache for the step: llama-server's words (server-context.cpp)
                return _error(500, f"Context size has been exceeded. ({e})", "server_error")
            return _error(500, str(e), "server_error")
        except SlotBusyError as e:  # llama-server queues the command until the slot is free; the client retries
            return _error(409, str(e), "unavailable_error")
        except PyspecError as e:
            return _error(400 if isinstance(e, ValueError) else 500, str(e),
                          "invalid_request_error" if isinstance(e, ValueError) else "server_error")
        except (ValueError, TypeError) as e:
            return _error(400, str(e))
    return run


def create_app(engine: Engine, *, model_name: str = "pyspec", api_key: str | Sequence[str] | None = None,
               defaults: ServerDefaults | None = None, slot_save_path: str | Path | None = None,
               metrics: bool = False, slots: bool = True, model_aliases: Sequence[str] = (),
               model_tags: Sequence[str] = (), props: bool = False, template_budget: TemplateBudget | None = None,
               template_workers: int = 2, template_max_workers: int | None = None,
               embedder: Embedder | None = None, embd_normalize: int = 2, cors: CorsPolicy | None = None,
               cors_proxy: bool = False, verbose: bool = False) -> Starlette:
    """The ASGI app serving ``engine`` (started here if it is not running; closing it is the caller's job).

    ``metrics``: serve ``/metrics`` (llama-server's ``--metrics``; behind the API key like llama-server's).
    ``api_key``: one key or several, any of which is accepted. ``slots=False``: ``GET /slots`` answers
    501 (llama-server's ``--no-slots``). ``model_aliases`` / ``model_tags``: the model list's
    ``aliases`` and ``tags`` (``--alias a,b`` / ``--tags``). ``props``: ``POST /props`` answers as
    llama-server's under ``--props`` (501 without). ``template_budget``: the time and memory one Jinja chat
    template render may use, in one of ``template_workers`` worker processes kept warm, up to
    ``template_max_workers`` while renders overlap (default TemplateBudget(): 2 s, 256 MiB; 2 and 4
    workers); a render beyond it fails its request with a 400 naming the budget, and the worker is
    replaced. ``embedder``: serve ``/embedding``, ``/embeddings`` and ``/v1/embeddings`` with it
    (llama-server's ``--embedding``; without one they answer 501), pooled vectors normalised by
    ``embd_normalize`` unless a request says otherwise (closing it is the caller's job). ``cors``: answer
    cross-origin requests and preflights as llama-server does under that policy (pyspec.server.cors;
    ``pyspec serve`` passes llama-server's default, CorsPolicy()); None: no CORS headers. ``cors_proxy``:
    relay ``/cors-proxy?url=...`` (llama-server's experimental ``--ui-mcp-proxy``; off, it answers 403).
    ``verbose``: OpenAI answers carry the native answer under ``__verbose`` (llama-server's ``--verbose``;
    a request's ``"verbose": true`` asks for it too)."""
    templates = RenderPool(template_budget or TemplateBudget(), template_workers, template_max_workers)
    if not engine.running:
        engine.start()
    defaults = defaults or ServerDefaults()
    if defaults.tokenize is None:  # logit_bias keys given as text are tokenized as llama-server does
        vocab = engine.vocab
        defaults = dataclasses.replace(
            defaults, tokenize=lambda text: vocab.tokenize(text, add_special=False, parse_special=False))
    api = _Api(engine, model_name, defaults, Path(slot_save_path) if slot_save_path else None,
               metrics, slots, model_aliases, model_tags, props, templates, embedder, embd_normalize, cors_proxy,
               verbose)
    routes = [
        Route("/health", _guard(api.health), methods=["GET"]),
        Route("/v1/health", _guard(api.health), methods=["GET"]),
        Route("/models", _guard(api.models), methods=["GET"]),
        Route("/v1/models", _guard(api.models), methods=["GET"]),
        Route("/props", _guard(api.props), methods=["GET"]),
        Route("/props", _guard(api.props_change), methods=["POST"]),
        Route("/slots", _guard(api.slots), methods=["GET"]),
        Route("/metrics", _guard(api.metrics), methods=["GET"]),
        Route("/slots/{id}", _guard(api.slot_action), methods=["POST"]),
        Route("/tokenize", _guard(api.tokenize), methods=["POST"]),
        Route("/detokenize", _guard(api.detokenize), methods=["POST"]),
        Route("/apply-template", _guard(api.apply_template), methods=["POST"]),
        Route("/chat/completions/input_tokens", _guard(api.chat_input_tokens), methods=["POST"]),
        Route("/v1/chat/completions/input_tokens", _guard(api.chat_input_tokens), methods=["POST"]),
        Route("/completion", _guard(api.completion), methods=["POST"]),
        Route("/completions", _guard(api.completion), methods=["POST"]),
        Route("/v1/completions", _guard(api.v1_completions), methods=["POST"]),
        Route("/v1/chat/completions", _guard(api.v1_chat), methods=["POST"]),
        Route("/chat/completions", _guard(api.v1_chat), methods=["POST"]),
        Route("/infill", _guard(api.infill), methods=["POST"]),
        Route("/cors-proxy", _guard(api.cors_proxy), methods=["GET", "POST"]),
        Route("/embedding", _guard(api.embeddings), methods=["POST"]),
        Route("/embeddings", _guard(api.embeddings), methods=["POST"]),
        Route("/v1/embeddings", _guard(api.v1_embeddings), methods=["POST"]),
    ]

    async def http_error(_: HttpRequest, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(exc.status_code, str(exc.detail), kind)

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        await asyncio.to_thread(templates.warm)  # the first chat does not wait for a worker to start
        try:
            yield
        finally:
            templates.close()
            api._render_threads.shutdown(wait=False, cancel_futures=True)

    # the CORS layer first: a preflight is answered before the API key is asked for
    middleware = ([Middleware(Cors, policy=cors)] if cors is not None else []) + [Middleware(_ApiKey, key=api_key)]
    return Starlette(routes=routes, middleware=middleware,
                     exception_handlers={HTTPException: http_error}, lifespan=lifespan)
