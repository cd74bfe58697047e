"""The HTTP server: OpenAI-compatible and llama-server-native endpoints over a pyspec Engine.

    pyspec serve --tiny --types ngram-map-k --parallel 4      # 127.0.0.1:8080

or from Python:

    from pyspec.generation.engine import Engine
    from pyspec.server import serve
    serve(Engine.load("model.gguf", n_parallel=4), port=8080)

Needs the ``server`` extra (starlette, uvicorn).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["SERVER_EXTRA_HINT", "bind_socket", "create_app", "serve"]


def create_app(*args: Any, **kwargs: Any) -> Any:
    """See :func:`pyspec.server.app.create_app` (imported on use: starlette is an optional dependency)."""
    from pyspec.server.app import create_app as make

    return make(*args, **kwargs)


def serve(engine: Any, *, host: str = "127.0.0.1", port: int = 8080, model_name: str = "pyspec",
          api_key: str | Sequence[str] | None = None, defaults: Any = None,
          slot_save_path: str | Path | None = None, log_level: str = "warning",
          on_listening: Callable[[str], None] | None = None, metrics: bool = False, slots: bool = True,
          model_aliases: Sequence[str] = (), model_tags: Sequence[str] = (), props: bool = False,
          template_budget: Any = None, template_workers: int = 2, template_max_workers: int | None = None) -> None:
    """Serve ``engine`` until interrupted (uvicorn), then close it.

    ``api_key``: one key or several (llama-server's comma list); ``metrics``: serve ``/metrics``
    (``--metrics``); ``slots``: serve ``GET /slots`` (``--no-slots`` answers 501 there);
    ``model_aliases`` / ``model_tags``: listed in ``/v1/models`` (``--alias``, ``--tags``); ``props``:
    ``POST /props`` accepted (``--props``); ``template_budget`` (a
    :class:`pyspec.generation.chat.TemplateBudget`) / ``template_workers`` / ``template_max_workers``: the
    time and memory one Jinja chat template render may use, and the worker processes that render, kept
    warm and at most (default 2 s, 256 MiB; 2 and 4).

    The port is bound before anything is announced: a busy port raises OSError naming it (and
    ``on_listening``, called with the address once bound, never runs). Ctrl-C returns normally.
    """
    try:
        import uvicorn
    except ImportError as e:
        engine.close()
        raise ImportError(f"the HTTP server needs the server extra: {SERVER_EXTRA_HINT} ({e})") from None

    sock = bind_socket(host, port)
    try:
        app = create_app(engine, model_name=model_name, api_key=api_key, defaults=defaults,
                         slot_save_path=slot_save_path, metrics=metrics, slots=slots, model_aliases=model_aliases,
                         model_tags=model_tags, props=props, template_budget=template_budget,
                         template_workers=template_workers, template_max_workers=template_max_workers)
        if on_listening is not None:
            on_listening(f"http://{host}:{sock.getsockname()[1]}")
        server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=2))
        quiet = _QuietShutdown()
        logging.getLogger("uvicorn.error").addFilter(quiet)
        try:
            server.run(sockets=[sock])
        except KeyboardInterrupt:
            pass  # uvicorn re-raises the Ctrl-C it shut down for; the shutdown itself is done
        finally:
            logging.getLogger("uvicorn.error").removeFilter(quiet)
    finally:
        sock.close()
        engine.close()


class _QuietShutdown(logging.Filter):
    """Drops uvicorn's report of the streams it cancels at shutdown (a 40-line CancelledError traceback
    each): Ctrl-C during a streaming request is a normal way to stop the server."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, asyncio.CancelledError):
            return False
        return not str(record.msg).startswith("Cancel %s running task(s)")


# the extra's packages by name, so the hint works whatever the distribution is called
SERVER_EXTRA_HINT = 'pip install "llama-pyspec[server]" (or: pip install jinja2 starlette uvicorn)'


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port``; OSError with one line naming the address when it is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: TIME_WAIT is not "busy"
    # inherited by every accepted connection: a response's headers and body leave at once, not 40 ms
    # apart (Nagle waiting for the client's delayed ACK on a kept-alive connection)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror}"
                      " (another server there? choose another --port)") from None
    sock.set_inheritable(True)
    return sock
