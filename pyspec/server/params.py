"""Request bodies of the HTTP API -> engine Requests: llama-server's native fields and OpenAI's, checked.

Every field is checked for type and range before anything is queued; a bad
one raises :class:`BadRequest` naming it (the server answers 400 and changes
nothing). The names follow llama.cpp's tools/server/server-task.cpp
(``n_predict``, ``temperature``, ``top_k``, ``repeat_penalty``, ``n_probs``,
``cache_prompt``, ``id_slot``, ``speculative.n_max``...) and OpenAI's API
(``max_tokens``, ``logprobs``, ``top_logprobs``, ``logit_bias``...).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, cast

from pyspec.common.params import LLAMA_DEFAULT_SEED, CommonParamsSampling
from pyspec.errors import BadRequest
from pyspec.generation.requests import Request

__all__ = ["ServerDefaults", "chat_request", "completion_request", "native_request"]


@dataclasses.dataclass
class ServerDefaults:
    """What a request that does not say otherwise gets (from the command line)."""

    sampling: CommonParamsSampling = dataclasses.field(default_factory=CommonParamsSampling)
    n_predict: int = -1
    n_draft_max: int | None = None  # None: the engine's speculative n_max
    n_draft_min: int = 0
    cache_prompt: bool = True


_MISSING = object()


def _get(body: Mapping[str, Any], *names: str) -> Any:
    for n in names:
        if n in body and body[n] is not None:
            return body[n]
    return _MISSING


def _num(body: Mapping[str, Any], name: str, lo: float, hi: float, *aliases: str) -> float | None:
    v = _get(body, name, *aliases)
    if v is _MISSING:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise BadRequest(f"'{name}' must be a number")
    if not lo <= v <= hi:
        raise BadRequest(f"'{name}' must be in [{lo}, {hi}], got {v}")
    return float(v)


def _int(body: Mapping[str, Any], name: str, lo: int, hi: int, *aliases: str) -> int | None:
    v = _get(body, name, *aliases)
    if v is _MISSING:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise BadRequest(f"'{name}' must be an integer")
    if not lo <= v <= hi:
        raise BadRequest(f"'{name}' must be in [{lo}, {hi}], got {v}")
    return int(v)


def _bool(body: Mapping[str, Any], name: str, default: bool) -> bool:
    v = _get(body, name)
    if v is _MISSING:
        return default
    if not isinstance(v, bool):
        raise BadRequest(f"'{name}' must be true or false")
    return v


def _stop(body: Mapping[str, Any]) -> list[str]:
    v = _get(body, "stop")
    if v is _MISSING:
        return []
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and all(isinstance(w, str) for w in v):
        return list(v)
    raise BadRequest("'stop' must be a string or a list of strings")


def _logit_bias(body: Mapping[str, Any], n_vocab: int) -> list[tuple[int, float]] | None:
    v = _get(body, "logit_bias")
    if v is _MISSING:
        return None
    out: list[tuple[int, float]] = []
    # OpenAI: {"token id": bias}; llama-server also takes [[token, bias | false], ...]
    items = v.items() if isinstance(v, Mapping) else v
    if not isinstance(items, (list, type({}.items()))):
        raise BadRequest("'logit_bias' must be an object {token: bias} or a list of [token, bias]")
    item: Any
    for item in items:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise BadRequest("'logit_bias' entries must be [token, bias]")
        tok, bias = item
        try:
            t = int(tok)
        except (TypeError, ValueError):
            raise BadRequest(f"'logit_bias': token {tok!r} is not a token id") from None
        if not 0 <= t < n_vocab:
            raise BadRequest(f"'logit_bias': token {t} is outside the vocabulary (0..{n_vocab - 1})")
        if bias is False:
            b = -math.inf
        elif isinstance(bias, (int, float)) and not isinstance(bias, bool) and -100 <= bias <= 100:
            b = float(bias)
        else:
            raise BadRequest(f"'logit_bias': bias for token {t} must be a number in [-100, 100] (or false)")
        out.append((t, b))
    return out


def _sampling(body: Mapping[str, Any], d: ServerDefaults, n_vocab: int) -> CommonParamsSampling:
    s = dataclasses.replace(d.sampling, samplers=list(d.sampling.samplers), logit_bias=list(d.sampling.logit_bias))
    if (v := _num(body, "temperature", -1e6, 1e6)) is not None:
        s.temp = v
    if (i := _int(body, "top_k", 0, n_vocab)) is not None:
        s.top_k = i
    if (v := _num(body, "top_p", 0.0, 1.0)) is not None:
        s.top_p = v
    if (v := _num(body, "min_p", 0.0, 1.0)) is not None:
        s.min_p = v
    if (v := _num(body, "typical_p", 0.0, 1.0)) is not None:
        s.typ_p = v
    if (v := _num(body, "repeat_penalty", 0.0, 1e3)) is not None:
        s.penalty_repeat = v
    if (i := _int(body, "repeat_last_n", -1, 1 << 20)) is not None:
        s.penalty_last_n = i
    if (v := _num(body, "presence_penalty", -2.0, 2.0)) is not None:
        s.penalty_present = v
    if (v := _num(body, "frequency_penalty", -2.0, 2.0)) is not None:
        s.penalty_freq = v
    if (i := _int(body, "seed", -1, 2**32 - 1)) is not None:
        s.seed = LLAMA_DEFAULT_SEED if i == -1 else i
    if (i := _int(body, "min_keep", 0, n_vocab)) is not None:
        s.min_keep = i
    g = _get(body, "grammar")
    if g is not _MISSING:
        if not isinstance(g, str):
            raise BadRequest("'grammar' must be a string (GBNF)")
        s.grammar = g
    lb = _logit_bias(body, n_vocab)
    if lb is not None:
        s.logit_bias = lb
    return s


def _common(body: Mapping[str, Any], d: ServerDefaults, n_vocab: int, n_parallel: int) -> dict[str, Any]:
    if not isinstance(body, Mapping):
        raise BadRequest("the request body must be a JSON object")
    n = _int(body, "n", 1, 1)  # one choice per request
    del n
    n_predict = _int(body, "n_predict", -1, 1 << 30, "max_completion_tokens", "max_tokens")
    # llama-server's "speculative.n_max" / "speculative.n_min", flat or nested
    n_draft = _int(body, "speculative.n_max", 0, 1 << 16)
    n_draft_min = _int(body, "speculative.n_min", 0, 1 << 16)
    spec = _get(body, "speculative")
    if isinstance(spec, Mapping):
        n_draft = _int(spec, "n_max", 0, 1 << 16) if n_draft is None else n_draft
        n_draft_min = _int(spec, "n_min", 0, 1 << 16) if n_draft_min is None else n_draft_min
    id_slot = _int(body, "id_slot", -1, n_parallel - 1, "slot_id")
    return {
        "n_predict": d.n_predict if n_predict is None else n_predict,
        "sampling": _sampling(body, d, n_vocab),
        "stop": _stop(body),
        "n_draft_max": d.n_draft_max if n_draft is None else n_draft,
        "n_draft_min": d.n_draft_min if n_draft_min is None else n_draft_min,
        "cache_prompt": _bool(body, "cache_prompt", d.cache_prompt),
        "slot_id": -1 if id_slot is None else id_slot,
    }


def _prompt(body: Mapping[str, Any], name: str = "prompt") -> str | list[int]:
    p = _get(body, name)
    if p is _MISSING:
        raise BadRequest(f"'{name}' is required")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        return p
    if isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return list(p)
    raise BadRequest(f"'{name}' must be a string or a list of token ids (one prompt per request)")


def _finish(req: Request) -> Request:
    if req.n_predict == 0:
        raise BadRequest("'n_predict' / 'max_tokens' must be positive (or -1)")
    return req


def native_request(body: Mapping[str, Any], d: ServerDefaults, n_vocab: int, n_parallel: int) -> tuple[Request, bool]:
    """llama-server's /completion body -> (Request, stream)."""
    c = _common(body, d, n_vocab, n_parallel)
    n_probs = _int(body, "n_probs", 0, 100) or 0
    req = Request(prompt=_prompt(body), n_probs=n_probs, add_special=True, parse_special=True, **c)
    return _finish(req), _bool(body, "stream", False)


def completion_request(body: Mapping[str, Any], d: ServerDefaults, n_vocab: int,
                       n_parallel: int) -> tuple[Request, bool]:
    """OpenAI's /v1/completions body -> (Request, stream)."""
    c = _common(body, d, n_vocab, n_parallel)
    if _bool(body, "echo", False):
        raise BadRequest("'echo' is not supported")
    n_probs = _int(body, "logprobs", 0, 20) or 0
    req = Request(prompt=_prompt(body), n_probs=n_probs, add_special=True, parse_special=True, **c)
    return _finish(req), _bool(body, "stream", False)


def chat_request(body: Mapping[str, Any], d: ServerDefaults, n_vocab: int, n_parallel: int) -> tuple[Request, bool]:
    """OpenAI's /v1/chat/completions body -> (Request, stream)."""
    c = _common(body, d, n_vocab, n_parallel)
    msgs = _get(body, "messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("'messages' must be a non-empty list")
    for i, m in enumerate(msgs):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string 'role'")
        if not isinstance(m.get("content", ""), (str, list, type(None))):
            raise BadRequest(f"messages[{i}].content must be a string or a list of parts")
    n_probs = 0
    if _bool(body, "logprobs", False):
        n_probs = _int(body, "top_logprobs", 0, 20) or 0
        n_probs = max(n_probs, 1)  # the chosen token's log-probability needs the row; top list trimmed later
    kwargs = _get(body, "chat_template_kwargs")
    if kwargs is not _MISSING and not isinstance(kwargs, Mapping):
        raise BadRequest("'chat_template_kwargs' must be an object")
    req = Request(messages=msgs, n_probs=n_probs, add_generation_prompt=_bool(body, "add_generation_prompt", True),
                  chat_template_kwargs=None if kwargs is _MISSING else dict(cast(Mapping[str, Any], kwargs)), **c)
    return _finish(req), _bool(body, "stream", False)
