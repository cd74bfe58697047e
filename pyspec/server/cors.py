"""Cross-origin requests answered as llama-server answers them (server-http.cpp's pre-routing handler).

Every response names the allowed origin (``Access-Control-Allow-Origin``), and an ``OPTIONS``
request to any path is a preflight answered 200 at once, before the API key is asked for (browsers
send none with a preflight). The rules are llama-server's, from ``--cors-origins``,
``--cors-methods``, ``--cors-headers`` and ``--cors-credentials``:

- origins ``*`` with credentials (the default): the request's ``Origin`` is echoed back;
- origins ``localhost``: the ``Origin`` is echoed only when its host is ``localhost``,
  ``127.0.0.1`` or ``::1`` (any port), otherwise no header is sent (the request still answers);
- anything else is sent as it is.

Starlette's CORSMiddleware follows the fetch standard instead of llama-server: it refuses a preflight
from an origin it does not allow with a 400, echoes the requested headers for ``*``, and sorts the
methods, so clients and llama.cpp's own tests that expect llama-server's answers would fail.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # starlette is the server extra's: the command line reads a CorsPolicy without it
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["Cors", "CorsPolicy", "origin_is_localhost"]


def origin_is_localhost(origin: str) -> bool:
    """Whether an Origin's host is localhost, 127.0.0.1 or ::1 (server-http.cpp origin_is_localhost,
    which reads it with common_http_parse_url: an http(s) URL, a bracketed IPv6 host, a numeric port)."""
    scheme, sep, rest = origin.partition("://")
    if not sep or scheme not in ("http", "https"):
        return False
    host = rest.split("/", 1)[0].rpartition("@")[2]
    port = ""
    if host.startswith("["):
        close = host.find("]")
        if close < 0:
            return False
        after = host[close + 1:]
        port = after[1:] if after.startswith(":") else ""
        host = host[1:close]
    elif ":" in host:
        host, _, port = host.partition(":")
    if port and not port.lstrip("+-")[:1].isdigit():  # std::stoi refuses a port that does not start with a number
        return False
    return host in ("localhost", "127.0.0.1", "::1")


@dataclasses.dataclass(frozen=True)
class CorsPolicy:
    """llama-server's CORS settings (common.h defaults)."""

    origins: str = "*"
    methods: str = "GET, POST, DELETE, OPTIONS"
    headers: str = "*"
    credentials: bool = True

    def allow_origin(self, origin: str) -> str | None:
        """The Access-Control-Allow-Origin value for a request from ``origin`` ("" when it sent none);
        None: send no such header."""
        if self.credentials and self.origins == "*":
            return origin or None
        if self.origins == "localhost":
            return origin if origin and origin_is_localhost(origin) else None
        return self.origins


class Cors:
    """ASGI middleware applying a CorsPolicy; put it outside the API key check (preflights carry no key)."""

    def __init__(self, app: ASGIApp, policy: CorsPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        origin = next((v for k, v in scope["headers"] if k.lower() == b"origin"), b"").decode("latin-1")
        allow = self.policy.allow_origin(origin)
        # the names as llama-server (cpp-httplib) writes them: clients that keep headers in a plain dict,
        # llama.cpp's own tests among them, look them up in this case
        extra: list[tuple[bytes, bytes]] = []
        if allow is not None:
            extra.append((b"Access-Control-Allow-Origin", allow.encode("latin-1", "replace")))
        if scope["method"] == "OPTIONS":  # a preflight: answered here, for any path, without the key
            p = self.policy
            extra += [(b"Access-Control-Allow-Credentials", b"true" if p.credentials else b"false"),
                      (b"Access-Control-Allow-Methods", p.methods.encode("latin-1", "replace")),
                      (b"Access-Control-Allow-Headers", p.headers.encode("latin-1", "replace")),
                      (b"Content-Type", b"text/html"), (b"Content-Length", b"0")]
            await send({"type": "http.response.start", "status": 200, "headers": extra})
            await send({"type": "http.response.body", "body": b""})
            return

        async def send_with_origin(message: Message) -> None:
            if message["type"] == "http.response.start" and extra:
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_origin)
