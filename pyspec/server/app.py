"""The HTTP API over an Engine: OpenAI-compatible endpoints and llama-server's native ones (Starlette, SSE).

- ``/v1/completions``, ``/v1/chat/completions`` (streaming and not), ``/v1/models``:
  what the official ``openai`` client calls;
- ``/completion``, ``/tokenize``, ``/detokenize``, ``/health``, ``/props``,
  ``/slots``: llama-server's native API with its field names (``content``,
  ``tokens``, ``stop_type``, ``timings`` with ``draft_n`` / ``draft_n_accepted``...).

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
import errno
import hmac
import json
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

from pyspec.errors import BadRequest, PyspecError
from pyspec.generation.engine import Engine
from pyspec.generation.requests import Completion, Delta, Request, RequestHandle, TokenLogprob
from pyspec.server.metrics import CONTENT_TYPE, render_metrics
from pyspec.server.params import (
    ServerDefaults,
    chat_request,
    completion_request,
    detokenize_request,
    native_request,
    parse_json,
    slot_action_request,
    slot_filename,
    tokenize_request,
)

__all__ = ["create_app"]

_PUBLIC = {"/health", "/v1/health", "/models", "/v1/models"}
_FINISH = {"eog": "stop", "stop": "stop", "n_predict": "length", "context": "length", "cancelled": "stop"}
_STOP_TYPE = {"eog": "eos", "stop": "word", "n_predict": "limit", "context": "limit", "cancelled": "none"}


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    # llama-server's error body, which the openai client reads as well
    return JSONResponse({"error": {"code": status, "message": message, "type": kind}}, status_code=status)


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


class _TooLarge(Exception):
    pass


async def _body(req: HttpRequest) -> Any:
    chunks, n = [], 0
    async for chunk in req.stream():
        n += len(chunk)
        if n > _MAX_BODY:
            raise _TooLarge
        chunks.append(chunk)
    # parsing and checking run in a worker thread: a large body costs that thread, not the event loop
    return await asyncio.to_thread(parse_json, b"".join(chunks))


def _lp_json(lp: TokenLogprob, n_top: int) -> dict[str, Any]:
    return {"id": lp.id, "token": lp.text, "bytes": list(lp.token_bytes), "logprob": lp.logprob,
            "top_logprobs": [{"id": i, "token": t, "bytes": list(b), "logprob": v} for i, t, b, v in lp.top[:n_top]]}


class _Api:
    """The handlers, over one started engine."""

    def __init__(self, engine: Engine, model_name: str, defaults: ServerDefaults, slot_save_path: Path | None,
                 metrics: bool = False, slots: bool = True) -> None:
        self.engine = engine
        self.model_name = model_name
        self.defaults = defaults
        self.slot_save_path = slot_save_path
        self.metrics_on = metrics
        self.slots_on = slots
        self.created = int(time.time())

    # --- helpers ----------------------------------------------------------------

    async def _request(self, build: Callable[[Any, ServerDefaults, int, int], tuple[Request, bool]],
                       body: Any) -> tuple[Request, bool]:
        """(Request, stream) from a body, checked in a worker thread (a long grammar or prompt is scanned there)."""
        return await asyncio.to_thread(build, body, self.defaults, self.engine.n_vocab, self.engine.n_parallel)

    def _submit(self, req: Request) -> RequestHandle:
        try:
            return self.engine.submit(req)
        except (ValueError, TypeError) as e:
            raise BadRequest(str(e)) from None

    async def _wait(self, http: HttpRequest, handle: RequestHandle) -> Completion:
        """The completion, cancelling the request if the client goes away first."""
        result = asyncio.ensure_future(handle.aresult())
        try:
            while True:
                done, _ = await asyncio.wait({result}, timeout=0.25)
                if done:
                    return result.result()
                if await http.is_disconnected():
                    handle.cancel()
        finally:
            if not result.done():
                handle.cancel()
                result.cancel()

    def _stream(self, handle: RequestHandle, first: list[bytes],
                piece: Callable[[Delta], dict[str, Any] | None],
                final: Callable[[Completion], list[dict[str, Any]]], done_marker: bool) -> StreamingResponse:
        async def gen() -> AsyncIterator[bytes]:
            try:
                for b in first:
                    yield b
                async for d in handle:
                    obj = piece(d)
                    if obj is not None:
                        yield _sse(obj)
                comp = await handle.aresult()
                for obj in final(comp):
                    yield _sse(obj)
                if done_marker:
                    yield b"data: [DONE]\n\n"
            except Exception as e:  # the request failed inside the engine: say so in the stream
                yield _sse({"error": {"code": 500, "message": str(e), "type": "server_error"}})
            finally:
                handle.cancel()  # a client that went away (the generator is closed) stops the request

        return StreamingResponse(gen(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def _usage(self, c: Completion) -> dict[str, int]:
        return {"prompt_tokens": len(c.prompt_tokens), "completion_tokens": len(c.tokens),
                "total_tokens": len(c.prompt_tokens) + len(c.tokens)}

    # --- llama-server's native endpoints ------------------------------------------

    async def health(self, _: HttpRequest) -> Response:
        return JSONResponse({"status": "ok"})

    async def models(self, _: HttpRequest) -> Response:
        m = self.engine.model
        return JSONResponse({
            "object": "list",
            "data": [{"id": self.model_name, "object": "model", "created": self.created, "owned_by": "pyspec",
                      "meta": {"n_vocab": self.engine.n_vocab, "n_ctx_train": m.n_ctx_train, "n_embd": m.n_embd,
                               "n_params": m.n_params, "size": m.size}}],
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
        return JSONResponse(self.engine.slot_info())

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
        toks = vocab.tokenize(content, add_special=add_special, parse_special=parse_special)
        if not with_pieces:
            return JSONResponse({"tokens": toks})
        out = []
        for t in toks:
            b = vocab.token_to_piece_bytes(t, special=True)
            try:
                piece: Any = b.decode("utf-8")
            except UnicodeDecodeError:
                piece = list(b)
            out.append({"id": t, "piece": piece})
        return JSONResponse({"tokens": out})

    async def detokenize(self, req: HttpRequest) -> Response:
        toks = detokenize_request(await _body(req), self.engine.n_vocab)
        return JSONResponse({"content": self.engine.vocab.detokenize(toks)})

    def _native_final(self, c: Completion, n_probs: int, stream: bool) -> dict[str, Any]:
        out: dict[str, Any] = {
            "index": 0,
            "content": "" if stream else c.text,
            "tokens": [] if stream else c.tokens,
            "id_slot": c.slot_id,
            "stop": True,
            "model": self.model_name,
            "tokens_predicted": len(c.tokens),
            "tokens_evaluated": len(c.prompt_tokens),
            "tokens_cached": c.stats.n_cached,
            "has_new_line": "\n" in c.text,
            "truncated": False,
            "stop_type": _STOP_TYPE.get(c.stop_reason, "none"),
            "stopping_word": c.stopping_word,
            "timings": c.stats.timings(),
            "speculative": c.stats.speculative(),
        }
        if n_probs and not stream:
            out["completion_probabilities"] = [_lp_json(lp, n_probs) for lp in c.logprobs]
        return out

    async def completion(self, req: HttpRequest) -> Response:
        body = await _body(req)
        r, stream = await self._request(native_request, body)
        h = self._submit(r)
        if not stream:
            return JSONResponse(self._native_final(await self._wait(req, h), r.n_probs, False))

        def piece(d: Delta) -> dict[str, Any]:
            out: dict[str, Any] = {"index": 0, "content": d.text, "tokens": d.tokens, "stop": False,
                                   "id_slot": -1}
            if r.n_probs:
                out["completion_probabilities"] = [_lp_json(lp, r.n_probs) for lp in d.logprobs]
            return out

        return self._stream(h, [], piece, lambda c: [self._native_final(c, r.n_probs, True)], False)

    # --- OpenAI-compatible endpoints -----------------------------------------------

    async def v1_completions(self, req: HttpRequest) -> Response:
        body = await _body(req)
        r, stream = await self._request(completion_request, body)
        h = self._submit(r)
        cid = f"cmpl-{uuid.uuid4().hex}"

        def logprobs(lps: list[TokenLogprob], offset: int) -> dict[str, Any] | None:
            if not r.n_probs:
                return None
            offs, pos = [], offset
            for lp in lps:
                offs.append(pos)
                pos += len(lp.text)
            return {"tokens": [lp.text for lp in lps], "token_logprobs": [lp.logprob for lp in lps],
                    "top_logprobs": [{t: v for _, t, _, v in lp.top[: r.n_probs]} for lp in lps],
                    "text_offset": offs}

        def chunk(text: str, finish: str | None, lps: list[TokenLogprob], offset: int) -> dict[str, Any]:
            return {"id": cid, "object": "text_completion", "created": int(time.time()), "model": self.model_name,
                    "choices": [{"text": text, "index": 0, "logprobs": logprobs(lps, offset),
                                 "finish_reason": finish}]}

        if not stream:
            c = await self._wait(req, h)
            out = chunk(c.text, _FINISH.get(c.stop_reason, "stop"), c.logprobs, 0)
            out["usage"] = self._usage(c)
            out["timings"] = c.stats.timings()
            out["speculative"] = c.stats.speculative()
            return JSONResponse(out)

        sent = [0]

        def piece(d: Delta) -> dict[str, Any] | None:
            if not d.text and not d.logprobs:
                return None
            out = chunk(d.text, None, d.logprobs, sent[0])
            sent[0] += len(d.text)
            return out

        def final(c: Completion) -> list[dict[str, Any]]:
            out = chunk("", _FINISH.get(c.stop_reason, "stop"), [], sent[0])
            out["usage"] = self._usage(c)
            out["timings"] = c.stats.timings()
            out["speculative"] = c.stats.speculative()
            return [out]

        return self._stream(h, [], piece, final, True)

    async def v1_chat(self, req: HttpRequest) -> Response:
        body = await _body(req)
        r, stream = await self._request(chat_request, body)
        n_top = int(body.get("top_logprobs") or 0) if body.get("logprobs") else 0
        h = self._submit(r)
        cid = f"chatcmpl-{uuid.uuid4().hex}"

        def logprobs(lps: list[TokenLogprob]) -> dict[str, Any] | None:
            if not r.n_probs:
                return None
            return {"content": [{"token": lp.text, "logprob": lp.logprob, "bytes": list(lp.token_bytes),
                                 "top_logprobs": [{"token": t, "logprob": v, "bytes": list(b)}
                                                  for _, t, b, v in lp.top[:n_top]]} for lp in lps]}

        def chunk(delta: dict[str, Any], finish: str | None, lps: list[TokenLogprob]) -> dict[str, Any]:
            return {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()),
                    "model": self.model_name,
                    "choices": [{"index": 0, "delta": delta, "logprobs": logprobs(lps), "finish_reason": finish}]}

        if not stream:
            c = await self._wait(req, h)
            return JSONResponse({
                "id": cid, "object": "chat.completion", "created": int(time.time()), "model": self.model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": c.text},
                             "logprobs": logprobs(c.logprobs), "finish_reason": _FINISH.get(c.stop_reason, "stop")}],
                "usage": self._usage(c),
                "timings": c.stats.timings(),
                "speculative": c.stats.speculative(),
            })

        def piece(d: Delta) -> dict[str, Any] | None:
            if not d.text and not d.logprobs:
                return None
            return chunk({"content": d.text}, None, d.logprobs)

        def final(c: Completion) -> list[dict[str, Any]]:
            out = chunk({}, _FINISH.get(c.stop_reason, "stop"), [])
            out["usage"] = self._usage(c)
            out["timings"] = c.stats.timings()
            out["speculative"] = c.stats.speculative()
            return [out]

        first = [_sse(chunk({"role": "assistant", "content": ""}, None, []))]
        return self._stream(h, first, piece, final, True)


def _guard(handler: Callable[[HttpRequest], Awaitable[Response]]) -> Callable[[HttpRequest], Awaitable[Response]]:
    async def run(req: HttpRequest) -> Response:
        try:
            return await handler(req)
        except BadRequest as e:
            return _error(400, str(e))
        except _TooLarge:
            return _error(413, f"the request body is larger than {_MAX_BODY} bytes")
        except PyspecError as e:
            return _error(400 if isinstance(e, ValueError) else 500, str(e),
                          "invalid_request_error" if isinstance(e, ValueError) else "server_error")
        except (ValueError, TypeError) as e:
            return _error(400, str(e))
    return run


def create_app(engine: Engine, *, model_name: str = "pyspec", api_key: str | Sequence[str] | None = None,
               defaults: ServerDefaults | None = None, slot_save_path: str | Path | None = None,
               metrics: bool = False, slots: bool = True) -> Starlette:
    """The ASGI app serving ``engine`` (started here if it is not running; closing it is the caller's job).

    ``metrics``: serve ``/metrics`` (llama-server's ``--metrics``; behind the API key like llama-server's).
    ``api_key``: one key or several, any of which is accepted. ``slots=False``: ``GET /slots`` answers
    501 (llama-server's ``--no-slots``)."""
    if not engine.running:
        engine.start()
    api = _Api(engine, model_name, defaults or ServerDefaults(), Path(slot_save_path) if slot_save_path else None,
               metrics, slots)
    routes = [
        Route("/health", _guard(api.health), methods=["GET"]),
        Route("/v1/health", _guard(api.health), methods=["GET"]),
        Route("/models", _guard(api.models), methods=["GET"]),
        Route("/v1/models", _guard(api.models), methods=["GET"]),
        Route("/props", _guard(api.props), methods=["GET"]),
        Route("/slots", _guard(api.slots), methods=["GET"]),
        Route("/metrics", _guard(api.metrics), methods=["GET"]),
        Route("/slots/{id}", _guard(api.slot_action), methods=["POST"]),
        Route("/tokenize", _guard(api.tokenize), methods=["POST"]),
        Route("/detokenize", _guard(api.detokenize), methods=["POST"]),
        Route("/completion", _guard(api.completion), methods=["POST"]),
        Route("/completions", _guard(api.completion), methods=["POST"]),
        Route("/v1/completions", _guard(api.v1_completions), methods=["POST"]),
        Route("/v1/chat/completions", _guard(api.v1_chat), methods=["POST"]),
        Route("/chat/completions", _guard(api.v1_chat), methods=["POST"]),
    ]

    async def http_error(_: HttpRequest, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(exc.status_code, str(exc.detail), kind)

    return Starlette(routes=routes, middleware=[Middleware(_ApiKey, key=api_key)],
                     exception_handlers={HTTPException: http_error})
