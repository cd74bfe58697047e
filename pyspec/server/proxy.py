"""llama-server's CORS proxy (``--ui-mcp-proxy``, experimental there too): ``GET|POST /cors-proxy?url=URL``
relays the request to URL so that a browser page can reach a server that sends no CORS headers.

As in server-cors-proxy.h, only the headers a client names for the target are forwarded
(``X-Llama-Server-Proxy-Header-Accept: v`` becomes ``Accept: v``): the request's own Authorization,
X-Api-Key, cookies and proxy credentials never leave. The target must be an http(s) URL without a
password; redirects are followed, the answer's status, body and headers come back (less the
hop-by-hop ones and the target's own CORS headers). Off (the default), ``/cors-proxy`` answers 403.

Unlike llama-server, a bad target URL is a 400 and an unreachable target a 502 (llama-server's
exception handler answers 500 for both), and an answer larger than MAX_BODY is cut off with a 502
rather than held in memory.
"""

from __future__ import annotations

import http.client
import urllib.error
import urllib.request
from dataclasses import dataclass

from pyspec.errors import BadRequest

__all__ = ["HEADER_PREFIX", "MAX_BODY", "ProxyAnswer", "proxy_request", "target_url"]

HEADER_PREFIX = "x-llama-server-proxy-header-"
MAX_BODY = 64 << 20  # bytes of the target's answer relayed at most
TIMEOUT_S = 600  # llama-server's read / write timeouts (10 minutes)
# server-models.cpp should_strip_proxy_header, and what urllib has already undone
_STRIP = {"server", "transfer-encoding", "content-length", "keep-alive", "connection"}


@dataclass(frozen=True)
class ProxyAnswer:
    status: int
    headers: list[tuple[str, str]]
    body: bytes


def target_url(url: str | None) -> str:
    """The ``url`` parameter checked as llama-server checks it (common_http_parse_url, proxy_request)."""
    if not url:
        raise BadRequest("'url' is required: /cors-proxy?url=http://host/path")
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise BadRequest("invalid URL: no scheme")
    if scheme not in ("http", "https"):
        raise BadRequest(f"unsupported URL scheme in target URL: {scheme[:20]}")
    authority = rest.split("/", 1)[0]
    userinfo, at, host = authority.rpartition("@")
    if at and ":" in userinfo:
        raise BadRequest("authentication in target URL is not supported")
    if not host or host.startswith(":"):
        raise BadRequest("invalid target URL: missing host")
    if any(ord(c) <= 0x20 or ord(c) == 0x7F for c in url):
        raise BadRequest("invalid target URL: it holds spaces or control characters")
    return url


def forwarded_headers(headers: list[tuple[str, str]]) -> dict[str, str]:
    """The headers the client named for the target, without their prefix (the others stay here)."""
    out: dict[str, str] = {}
    for key, value in headers:
        if key.lower().startswith(HEADER_PREFIX) and key[len(HEADER_PREFIX):]:
            out[key[len(HEADER_PREFIX):]] = value
    return out


def proxy_request(method: str, url: str, headers: list[tuple[str, str]], body: bytes) -> ProxyAnswer:
    """Relays one request (blocking: run it in a worker thread); BadRequest for a bad URL, OSError when
    the target cannot be reached or answers more than MAX_BODY bytes."""
    req = urllib.request.Request(target_url(url), data=body if method == "POST" else None, method=method,
                                 headers=forwarded_headers(headers))
    # no proxy from the environment: the target is reached directly, as llama-server's client does
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        resp = opener.open(req, timeout=TIMEOUT_S)
    except urllib.error.HTTPError as e:  # an answer all the same: relayed with its status
        resp = e
    except ValueError as e:  # urllib's own refusal of the URL
        raise BadRequest(f"invalid target URL: {e}") from None
    except (urllib.error.URLError, http.client.HTTPException) as e:
        raise OSError(f"the target did not answer: {getattr(e, 'reason', e)}") from None
    with resp:
        data = resp.read(MAX_BODY + 1)
        if len(data) > MAX_BODY:
            raise OSError(f"the target's answer is larger than {MAX_BODY} bytes")
        kept = [(k, v) for k, v in resp.headers.items()
                if k.lower() not in _STRIP and not k.lower().startswith("access-control-")]
        return ProxyAnswer(resp.status, kept, data)
