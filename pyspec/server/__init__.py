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
import contextlib
import logging
import os
import socket
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["SERVER_EXTRA_HINT", "bind_socket", "bind_sockets", "close_sockets", "create_app", "parse_hosts", "serve",
           "socket_url"]


def create_app(*args: Any, **kwargs: Any) -> Any:
    """See :func:`pyspec.server.app.create_app` (imported on use: starlette is an optional dependency)."""
    from pyspec.server.app import create_app as make

    return make(*args, **kwargs)


def serve(engine: Any, *, host: str = "127.0.0.1", port: int = 8080, model_name: str = "pyspec",
          api_key: str | Sequence[str] | None = None, defaults: Any = None,
          slot_save_path: str | Path | None = None, log_level: str = "warning",
          on_listening: Callable[[str], None] | None = None, metrics: bool = False, slots: bool = True,
          model_aliases: Sequence[str] = (), model_tags: Sequence[str] = (), props: bool = False,
          template_budget: Any = None, template_workers: int = 2, template_max_workers: int | None = None,
          embedder: Any = None, embd_normalize: int = 2, cors: Any = None, cors_proxy: bool = False,
          verbose: bool = False) -> None:
    """Serve ``engine`` until interrupted (uvicorn), then close it.

    ``api_key``: one key or several (llama-server's comma list); ``metrics``: serve ``/metrics``
    (``--metrics``); ``slots``: serve ``GET /slots`` (``--no-slots`` answers 501 there);
    ``model_aliases`` / ``model_tags``: listed in ``/v1/models`` (``--alias``, ``--tags``); ``props``:
    ``POST /props`` accepted (``--props``); ``template_budget`` (a
    :class:`pyspec.generation.chat.TemplateBudget`) / ``template_workers`` / ``template_max_workers``: the
    time and memory one Jinja chat template render may use, and the worker processes that render, kept
    warm and at most (default 2 s, 256 MiB; 2 and 4). ``embedder`` (a
    :class:`pyspec.generation.embeddings.Embedder` of the engine's model): serve the embedding endpoints
    (``--embedding``), pooled vectors normalised by ``embd_normalize``; closed with the engine. ``cors``
    (a :class:`pyspec.server.cors.CorsPolicy`): answer cross-origin requests as llama-server does;
    ``cors_proxy``: relay ``/cors-proxy?url=...`` (``--ui-mcp-proxy``); ``verbose``: the native answer
    under ``__verbose`` in OpenAI answers (llama-server's ``--verbose``).

    ``host``: one address or several, comma-separated (llama-server's ``--host 127.0.0.1,::1``; a path
    ending in ``.sock`` is a UNIX socket). The port is bound before anything is announced: a busy port
    raises OSError naming it (and
    ``on_listening``, called with the address once bound, never runs). Ctrl-C returns normally.
    """
    try:
        import uvicorn
    except ImportError as e:
        engine.close()
        raise ImportError(f"the HTTP server needs the server extra: {SERVER_EXTRA_HINT} ({e})") from None

    socks = bind_sockets(host, port)
    try:
        app = create_app(engine, model_name=model_name, api_key=api_key, defaults=defaults,
                         slot_save_path=slot_save_path, metrics=metrics, slots=slots, model_aliases=model_aliases,
                         model_tags=model_tags, props=props, template_budget=template_budget,
                         template_workers=template_workers, template_max_workers=template_max_workers,
                         embedder=embedder, embd_normalize=embd_normalize, cors=cors, cors_proxy=cors_proxy,
                         verbose=verbose)
        if on_listening is not None:
            on_listening(", ".join(socket_url(s) for s in socks))
        server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=2))
        quiet = _QuietShutdown()
        logging.getLogger("uvicorn.error").addFilter(quiet)
        try:
            server.run(sockets=socks)
        except KeyboardInterrupt:
            pass  # uvicorn re-raises the Ctrl-C it shut down for; the shutdown itself is done
        finally:
            logging.getLogger("uvicorn.error").removeFilter(quiet)
    finally:
        close_sockets(socks)
        if embedder is not None:
            embedder.close()
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


def parse_hosts(host: str) -> list[str]:
    """llama-server's --host: addresses (or UNIX socket paths ending in ``.sock``), comma-separated;
    ValueError when none is left."""
    hosts = [h.strip() for h in host.split(",") if h.strip()]
    if not hosts:
        raise ValueError("--host requires at least one address")
    return hosts


def bind_socket(host: str, port: int, v6_only: bool = False) -> socket.socket:
    """A listening socket on ``host:port`` (a path ending in ``.sock``: a UNIX socket there, the port
    unused); OSError with one line naming the address when it is taken. ``v6_only``: an IPv6 address
    takes no IPv4 connections (llama-server's rule when it listens on several addresses)."""
    if host.endswith(".sock"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        where = host
    else:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: TIME_WAIT is not "busy"
        # inherited by every accepted connection: a response's headers and body leave at once, not 40 ms
        # apart (Nagle waiting for the client's delayed ACK on a kept-alive connection)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if family == socket.AF_INET6 and v6_only:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        where = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
    try:
        sock.bind(host if sock.family == socket.AF_UNIX else (host, port))
        sock.listen(2048)
    except (OSError, UnicodeError) as e:  # UnicodeError: a host name that IDNA cannot encode
        sock.close()
        errno_ = getattr(e, "errno", None)
        raise OSError(errno_, f"cannot listen on {where}: {getattr(e, 'strerror', None) or e}"
                      " (another server there? choose another --port)") from None
    sock.set_inheritable(True)
    return sock


def bind_sockets(host: str, port: int) -> list[socket.socket]:
    """One listening socket per address of ``host`` (see parse_hosts), all on ``port``; with several
    TCP addresses an IPv6 one takes IPv6 only, and port 0 is refused (llama-server's rules). Nothing
    stays bound when one fails."""
    hosts = parse_hosts(host)
    n_tcp = sum(not h.endswith(".sock") for h in hosts)
    if port == 0 and n_tcp > 1:
        raise ValueError("--port 0 is not supported with multiple TCP addresses")
    out: list[socket.socket] = []
    try:
        for h in hosts:
            out.append(bind_socket(h, port, v6_only=n_tcp > 1))
    except BaseException:
        close_sockets(out)
        raise
    return out


def close_sockets(socks: list[socket.socket]) -> None:
    """Closes listening sockets; a UNIX socket's file goes with it (else the next bind finds it taken)."""
    for s in socks:
        if s.family == socket.AF_UNIX:
            with contextlib.suppress(OSError):
                os.unlink(s.getsockname())
        s.close()


def socket_url(sock: socket.socket) -> str:
    """The address a listening socket serves, as a URL (``unix://PATH`` for a UNIX socket)."""
    if sock.family == socket.AF_UNIX:
        return f"unix://{sock.getsockname()}"
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if sock.family == socket.AF_INET6 else f"http://{host}:{port}"
