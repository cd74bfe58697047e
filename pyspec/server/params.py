"""Request bodies of the HTTP API -> engine Requests: llama-server's native fields and OpenAI's, checked.

The one place where the server reads what a client sent: the JSON body itself
(:func:`parse_json`), the completion and chat fields, /tokenize, /detokenize and
the slot actions and file names. Every field is checked for type and range
before anything is queued or the file system is touched; a bad one raises
:class:`BadRequest` naming it in quotes (the server answers 400 and changes
nothing), so no value a client can send ends as a 500. The names follow llama.cpp's tools/server/server-task.cpp
(``n_predict``, ``temperature``, ``top_k``, ``repeat_penalty``, ``n_probs``,
``cache_prompt``, ``id_slot``, ``speculative.n_max``...) and OpenAI's API
(``max_tokens``, ``logprobs``, ``top_logprobs``, ``logit_bias``...).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable, Mapping
from typing import Any, cast

from pyspec.common.params import LLAMA_DEFAULT_SEED, CommonParamsSampling
from pyspec.core.grammar import check_grammar
from pyspec.errors import BadRequest
from pyspec.generation.requests import Request
from pyspec.server.infill import InfillInput
from pyspec.server.json_schema import json_schema_to_grammar

__all__ = ["MAX_FILENAME_BYTES", "MAX_GRAMMAR_BYTES", "MAX_JSON_DEPTH", "MAX_LOGIT_BIAS", "MAX_N_PROBS",
           "MAX_PROMPTS", "MAX_RESPONSE_FIELDS", "MAX_STOPS", "MAX_STOP_CHARS", "EmbeddingParsed", "Parsed", "Prompt",
           "ServerDefaults", "apply_template_request", "chat_request", "completion_request", "detokenize_request",
           "embedding_request", "infill_request", "native_request",
           "parse_json", "slot_action_request", "slot_filename", "tokenize_request"]


@dataclasses.dataclass
class ServerDefaults:
    """What a request that does not say otherwise gets (from the command line)."""

    sampling: CommonParamsSampling = dataclasses.field(default_factory=CommonParamsSampling)
    n_predict: int = -1
    n_keep: int = 0  # context shift: the first tokens kept (--keep; -1: the prompt)
    n_draft_max: int | None = None  # None: the engine's speculative n_max
    n_draft_min: int = 0
    cache_prompt: bool = True
    chat_template: str | None = None  # chat: a template text or llama.cpp built-in name (--chat-template)
    spm_infill: bool = False  # /infill: suffix, prefix, middle (--spm-infill) instead of prefix, suffix, middle
    # the model's tokenizer (no BOS, no special tokens parsed) for logit_bias keys given as text, which
    # llama-server tokenizes; create_app sets it. None: such keys are refused
    tokenize: Callable[[str], list[int]] | None = None


_MISSING = object()

MAX_JSON_DEPTH = 64  # nesting of a request body: every field is at most a few levels deep

# Fields whose cost is paid on every token (or step) of the engine thread that all clients share:
# bounded so that one request cannot slow the others' steps by more than a small factor (the figures:
# docs/server.md "Limits", scripts/server_hostile_load.py). Stop strings are searched for, and held back
# as partial matches, after every token (Python: about 0.3 ms per token at 16 x 128 characters, 145 ms
# at 1000 x 1000); each top-n log-probability is a token piece looked up per token; each logit bias an
# entry applied per token; a grammar is matched against every candidate token per token.
MAX_STOPS = 16  # stop strings per request
MAX_STOP_CHARS = 128  # characters per stop string
MAX_N_PROBS = 100  # n_probs (llama-server's /completion); OpenAI's logprobs / top_logprobs stay at 20
MAX_LOGIT_BIAS = 1024  # logit_bias entries
MAX_GRAMMAR_BYTES = 32 << 10  # GBNF text (UTF-8 bytes); the C check allows more for the library
# once per request, but on the event loop or as queued work: bounded too
MAX_RESPONSE_FIELDS = 64  # /completion's response_fields
MAX_PROMPTS = 64  # prompts in one completion request (each is a queued request, n times)
# a JSON integer with more digits than this is out of every field's range; reading it as an int
# costs quadratic time and Python refuses more than 4300 digits with an error that names no field
_MAX_INT_DIGITS = 64


def _json_int(text: str) -> int | float:
    if len(text.lstrip("-")) > _MAX_INT_DIGITS:
        return math.copysign(math.inf, -1.0 if text.startswith("-") else 1.0)  # refused by the field's check
    return int(text)


def parse_json(raw: bytes) -> Any:
    """A request body as JSON (an empty body is ``{}``); BadRequest unless it is valid and at most
    MAX_JSON_DEPTH levels deep (deeper values would exhaust the recursion of whatever reads them)."""
    try:
        body = json.loads(raw, parse_int=_json_int) if raw else {}
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise BadRequest(f"the body is not valid JSON: {e}") from None
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise BadRequest(f"the body nests more than {MAX_JSON_DEPTH} levels deep")
        for w in v.values() if isinstance(v, dict) else v if isinstance(v, list) else ():
            if isinstance(w, (list, dict)):
                stack.append((w, depth + 1))
    return body


def _text(name: str, v: str) -> str:
    """v, unless it holds a lone surrogate (JSON's "\\ud800" escape), which has no UTF-8 form."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRequest(f"'{name}' is not valid Unicode: {e.reason} at character {e.start}") from None
    return v


def _get(body: Mapping[str, Any], name: str) -> Any:
    """The body's value of ``name``; _MISSING when it is absent or null (null is unset, as in llama-server)."""
    v = body.get(name)
    return _MISSING if v is None else v


def _present(body: Mapping[str, Any], *names: str) -> list[tuple[str, Any]]:
    """(name, value) of each of ``names`` (a field and its aliases) that the body sets: each is checked,
    the first one given wins."""
    return [(n, body[n]) for n in names if n in body and body[n] is not None]


def _num(body: Mapping[str, Any], name: str, lo: float, hi: float, *aliases: str) -> float | None:
    out = [_check_num(n, v, lo, hi) for n, v in _present(body, name, *aliases)]
    return out[0] if out else None


def _check_num(name: str, v: Any, lo: float, hi: float) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise BadRequest(f"'{name}' must be a number, got {_kind(v)}")
    try:
        f = float(v)  # an int too large for a float overflows here
    except OverflowError:
        f = math.inf
    if not math.isfinite(f):
        raise BadRequest(f"'{name}' must be a finite number in [{lo}, {hi}], got {_kind(v)}")
    if not lo <= f <= hi:
        raise BadRequest(f"'{name}' must be in [{lo}, {hi}], got {_kind(v)}")
    return f


def _kind(v: Any) -> str:
    """v for an error message: numbers as they are, anything else by its JSON type."""
    if v is _MISSING:
        return "nothing"
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return repr(v) if len(repr(v)) <= 40 else f"a number of {len(repr(v))} digits"
    return {bool: "a boolean", str: "a string", list: "a list", dict: "an object", type(None): "null"}.get(
        type(v), type(v).__name__)


def _int(body: Mapping[str, Any], name: str, lo: int, hi: int, *aliases: str, label: str = "") -> int | None:
    # label: the field's full name when body is a nested object
    out = [_check_int(label or n, v, lo, hi) for n, v in _present(body, name, *aliases)]
    return out[0] if out else None


def _check_int(name: str, v: Any, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise BadRequest(f"'{name}' must be an integer in [{lo}, {hi}], got {_kind(v)}")
    if not lo <= v <= hi:
        raise BadRequest(f"'{name}' must be in [{lo}, {hi}], got {_kind(v)}")
    return int(v)


def _bool(body: Mapping[str, Any], name: str, default: bool) -> bool:
    v = _get(body, name)
    if v is _MISSING:
        return default
    if not isinstance(v, bool):
        raise BadRequest(f"'{name}' must be true or false, got {_kind(v)}")
    return v


def _stop(body: Mapping[str, Any]) -> list[str]:
    v = _get(body, "stop")
    if v is _MISSING:
        return []
    if isinstance(v, str):
        v = [v]
    if not (isinstance(v, list) and all(isinstance(w, str) for w in v)):
        raise BadRequest("'stop' must be a string or a list of strings")
    if len(v) > MAX_STOPS:
        raise BadRequest(f"'stop' holds {len(v)} strings, more than the {MAX_STOPS} allowed")
    long = next((w for w in v if len(w) > MAX_STOP_CHARS), None)
    if long is not None:
        raise BadRequest(f"'stop': a string of {len(long)} characters, more than the {MAX_STOP_CHARS} allowed")
    return [_text("stop", w) for w in v]


_TOKEN_ID = re.compile(r"-?[0-9]{1,20}")


def _token_id(tok: Any) -> int | None:
    """A logit_bias key as a token id: an int, an integral float, or a string of decimal digits
    (OpenAI's object keys); None for anything else (an inf, a bool, "1_0", " 1 ")."""
    if isinstance(tok, bool):
        return None
    if isinstance(tok, int):
        return tok
    if isinstance(tok, float):
        return int(tok) if tok.is_integer() else None  # is_integer() is False for inf and nan
    if isinstance(tok, str) and _TOKEN_ID.fullmatch(tok):
        return int(tok)
    return None


def _logit_bias(body: Mapping[str, Any], n_vocab: int,
                tokenize: Callable[[str], list[int]] | None = None) -> list[tuple[int, float]] | None:
    v = _get(body, "logit_bias")
    if v is _MISSING:
        return None
    out: list[tuple[int, float]] = []
    # OpenAI: {"token id": bias}; llama-server also takes [[token, bias | false], ...], and a text in
    # place of a token (server-schema.cpp): each of its tokens gets the bias
    items = v.items() if isinstance(v, Mapping) else v
    if not isinstance(items, (list, type({}.items()))):
        raise BadRequest("'logit_bias' must be an object {token: bias} or a list of [token, bias]")
    if len(items) > MAX_LOGIT_BIAS:
        raise BadRequest(f"'logit_bias' has {len(items)} entries, more than the {MAX_LOGIT_BIAS} allowed")
    item: Any
    for item in items:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise BadRequest("'logit_bias' entries must be [token, bias]")
        tok, bias = item
        name = repr(tok[:40]) if isinstance(tok, str) else _kind(tok)
        t = _token_id(tok)
        if t is None and isinstance(tok, str) and tokenize is not None:
            if len(tok) > MAX_STOP_CHARS:
                raise BadRequest(f"'logit_bias': a text key is {len(tok)} characters long, more than the "
                                 f"{MAX_STOP_CHARS} allowed")
            toks = tokenize(_text("logit_bias", tok))
        elif t is None:
            raise BadRequest(f"'logit_bias': token {name} is not a token id")
        elif not 0 <= t < n_vocab:
            raise BadRequest(f"'logit_bias': token {t} is outside the vocabulary (0..{n_vocab - 1})")
        else:
            toks = [t]
        if bias is False:
            b = -math.inf
        elif isinstance(bias, (int, float)) and not isinstance(bias, bool) and -100 <= bias <= 100:
            b = float(bias)
        else:
            raise BadRequest(f"'logit_bias': bias for token {name} must be a number in [-100, 100] (or false)")
        out += [(t, b) for t in toks]
        if len(out) > MAX_LOGIT_BIAS:  # a text key counts each of its tokens
            raise BadRequest(f"'logit_bias' has more than the {MAX_LOGIT_BIAS} entries allowed "
                             "(a text counts each of its tokens)")
    return out


# GBNF's escapes of a code point (llama-grammar.cpp parse_char): \xHH, \uHHHH, \UHHHHHHHH
_GBNF_ESCAPES = {"x": 2, "u": 4, "U": 8}
_GBNF_SIMPLE = {"t": 9, "r": 13, "n": 10, "\\": 92, '"': 34, "[": 91, "]": 93}
_MAX_CODE_POINT = 0x10FFFF


def _gbnf_char(g: str, i: int) -> tuple[int, int]:
    """The code point of the (possibly escaped) character at g[i], and the index after it."""
    if g[i] == "\\" and i + 1 < len(g):
        e = g[i + 1]
        if e in _GBNF_ESCAPES:
            n = _GBNF_ESCAPES[e]
            digits = g[i + 2 : i + 2 + n]
            if len(digits) == n and all(c in "0123456789abcdefABCDEF" for c in digits):
                return int(digits, 16), i + 2 + n
        return _GBNF_SIMPLE.get(e, ord(e)), i + 2
    return ord(g[i]), i + 1


# what a NUL-only element needs: a NUL escape or character, or (a negated class) an escape or
# character at the top of the code space; a grammar without any is passed over in one search
_MAY_NEED_NUL = re.compile(r"\\x00|\\u0000|\\U|\x00|\U0010ffff")
# a string literal, a character class, a comment (llama-grammar.cpp's parse_sequence / parse_space)
_GBNF_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"?|\[(?:\\.|[^\]\\])*\]?|#[^\r\n]*', re.DOTALL)


_LITERAL_NUL = re.compile(r"\\x00|\\u0000|\\U00000000|\x00")
_GBNF_ESCAPE = re.compile(r"\\(?:x([0-9a-fA-F]{2})|u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8})|.)", re.DOTALL)


def _literal_has_nul(body: str) -> bool:
    if "\0" in body:
        return True
    # escape by escape, left to right: in \\x00 the first escape is a backslash, then comes the text x00
    for m in _GBNF_ESCAPE.finditer(body):
        digits = m.group(1) or m.group(2) or m.group(3)
        if digits is not None and int(digits, 16) == 0:
            return True
    return False


def _grammar_nul(g: str) -> None:
    """BadRequest if a literal or character class of ``g`` can only match NUL.

    llama.cpp's grammar sampler ends every token's code points with a 0, so NUL is never matched:
    such an element rejects every token, the sampler then picks a token the grammar refuses and
    accepting it throws ("Unexpected empty grammar stack"): a 500 after the request was queued.
    Only the element's lexical form is read here; llama.cpp's parser judges the rest.
    """
    if _MAY_NEED_NUL.search(g) is None:
        return
    for m in _GBNF_TOKEN.finditer(g):
        t = m.group()
        if t[0] == "#" or _MAY_NEED_NUL.search(t) is None:
            continue
        body = t[1:-1] if len(t) > 1 and t[-1] == t[0].replace("[", "]") else t[1:]
        if t[0] == '"':
            if _LITERAL_NUL.search(body) is not None and _literal_has_nul(body):
                raise BadRequest("'grammar': a string literal holds NUL (\\x00), which no token can produce")
            continue
        negated = body.startswith("^")
        i = int(negated)
        ranges: list[tuple[int, int]] = []
        while i < len(body):
            lo, i = _gbnf_char(body, i)
            hi = lo
            if i + 1 < len(body) and body[i] == "-":
                hi, i = _gbnf_char(body, i + 1)
            ranges.append((lo, hi))
        if _only_nul(ranges, negated):
            raise BadRequest("'grammar': a character class matches only NUL (\\x00), which no token can produce")


def _only_nul(ranges: list[tuple[int, int]], negated: bool) -> bool:
    """Whether a character class of these ranges matches NUL and nothing else."""
    if not negated:
        return bool(ranges) and all(hi <= 0 for _, hi in ranges) and any(lo <= 0 for lo, _ in ranges)
    covered = 1  # the class leaves out every code point from 1 up to this one (exclusive)
    for lo, hi in sorted(ranges):
        if lo > covered:
            break
        covered = max(covered, hi + 1)
    return covered > _MAX_CODE_POINT and not any(lo <= 0 <= hi for lo, hi in ranges)


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
            raise BadRequest(f"'grammar' must be a string (GBNF), got {_kind(g)}")
        # 4 bytes per character at most: the exact size only when the bound is in doubt
        if len(g) > MAX_GRAMMAR_BYTES // 4 and (n := len(g.encode("utf-8", "surrogatepass"))) > MAX_GRAMMAR_BYTES:
            raise BadRequest(f"'grammar' is {n} bytes, more than the {MAX_GRAMMAR_BYTES} allowed")
        try:
            # the engine checks it again with the vocabulary; this names the field, and bounds the
            # text's size before the scan below
            check_grammar(_text("grammar", g))
        except ValueError as e:
            raise BadRequest(f"'grammar': {e}") from None
        _grammar_nul(g)
        s.grammar = g
    schema = _get(body, "json_schema")
    if schema is not _MISSING and g is _MISSING:  # llama-server: a grammar given wins over a schema
        s.grammar = _schema_grammar("json_schema", schema)
    lb = _logit_bias(body, n_vocab, d.tokenize)
    if lb is not None:
        s.logit_bias = lb
    return s


def _schema_grammar(name: str, schema: Any) -> str:
    """The grammar of a JSON schema (pyspec.server.json_schema), checked as a 'grammar' field is; an empty
    schema is any object, as in llama-server."""
    if isinstance(schema, Mapping) and not schema:
        schema = {"type": "object"}
    _texts(name, schema)
    try:
        g = json_schema_to_grammar(schema, MAX_GRAMMAR_BYTES)
    except (ValueError, RecursionError) as e:
        raise BadRequest(f"'{name}': {e}") from None
    if (n := len(g.encode("utf-8"))) > MAX_GRAMMAR_BYTES:
        raise BadRequest(f"'{name}' makes a grammar of {n} bytes, more than the {MAX_GRAMMAR_BYTES} allowed")
    try:
        check_grammar(g)
    except ValueError as e:
        raise BadRequest(f"'{name}': {e}") from None
    _grammar_nul(g)
    return g


def _response_format(body: Mapping[str, Any]) -> Mapping[str, Any]:
    """A chat body with its response_format / json_schema turned into the json_schema a completion
    takes (server-common.cpp oaicompat_chat_params_parse): json_object (with or without a schema),
    json_schema ({"json_schema": {"schema": ...}}) or text."""
    schema = _get(body, "json_schema")
    if schema is not _MISSING and _get(body, "grammar") is not _MISSING:
        raise BadRequest("Cannot use both json_schema and grammar")
    rf = _get(body, "response_format")
    if rf is _MISSING:
        return body
    if not isinstance(rf, Mapping):
        raise BadRequest(f"'response_format' must be an object, got {_kind(rf)}")
    kind = rf.get("type", "")
    if kind == "json_object":
        if "schema" in rf or schema is _MISSING:
            schema = rf.get("schema", {})
    elif kind == "json_schema":
        wrapper = rf.get("json_schema", {})
        if not isinstance(wrapper, Mapping):
            raise BadRequest(f"'response_format.json_schema' must be an object, got {_kind(wrapper)}")
        schema = wrapper.get("schema", {})
    elif kind not in ("", "text"):
        raise BadRequest('\'response_format\': type must be one of "text", "json_object" or "json_schema", got '
                         f"{repr(kind)[:40] if isinstance(kind, str) else _kind(kind)}")
    if schema is _MISSING:
        return body
    if _get(body, "grammar") is not _MISSING:
        raise BadRequest("Cannot use both json_schema and grammar")
    return {**body, "json_schema": schema}


def _common(body: Mapping[str, Any], d: ServerDefaults, n_vocab: int, n_parallel: int) -> dict[str, Any]:
    body = _object(body)
    n_predict = _int(body, "n_predict", -1, 1 << 30, "max_completion_tokens", "max_tokens")
    # llama-server's "speculative.n_max" / "speculative.n_min", flat or nested
    n_draft = _int(body, "speculative.n_max", 0, 1 << 16)
    n_draft_min = _int(body, "speculative.n_min", 0, 1 << 16)
    spec = _get(body, "speculative")
    if spec is not _MISSING and not isinstance(spec, Mapping):
        raise BadRequest(f"'speculative' must be an object {{\"n_max\": ..., \"n_min\": ...}}, got {_kind(spec)}")
    if isinstance(spec, Mapping):
        n_draft = _int(spec, "n_max", 0, 1 << 16, label="speculative.n_max") if n_draft is None else n_draft
        n_draft_min = _int(spec, "n_min", 0, 1 << 16, label="speculative.n_min") if n_draft_min is None else n_draft_min
    id_slot = _int(body, "id_slot", -1, n_parallel - 1, "slot_id")
    return {
        "n_predict": d.n_predict if n_predict is None else n_predict,
        "sampling": _sampling(body, d, n_vocab),
        "stop": _stop(body),
        "n_draft_max": d.n_draft_max if n_draft is None else n_draft,
        "n_draft_min": d.n_draft_min if n_draft_min is None else n_draft_min,
        "cache_prompt": _bool(body, "cache_prompt", d.cache_prompt),
        "slot_id": -1 if id_slot is None else id_slot,
        # llama-server reports prompt progress to streams only
        "return_progress": _bool(body, "return_progress", False) and _bool(body, "stream", False),
        # probabilities of the sampler's candidates after its chain, not of the logits (answered as "prob")
        "post_sampling_probs": _bool(body, "post_sampling_probs", False),
        # context shift (--context-shift): the first tokens kept (-1: the prompt), how many go (0: half the rest)
        "n_keep": d.n_keep if (k := _int(body, "n_keep", -1, 1 << 30)) is None else k,
        "n_discard": _int(body, "n_discard", 0, 1 << 30) or 0,
    }


# one prompt: a text, token ids, or texts and token ids mixed ([12, 34, "text", 56]: tokenize_mixed)
Prompt = str | list[int | str]


def _is_token(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _prompts(body: Mapping[str, Any], n_vocab: int, name: str = "prompt") -> list[Prompt]:
    """The prompts of a completion body, as llama-server reads them (server-common.cpp
    tokenize_input_prompts): a list without a token id at its top is a list of prompts, each a text,
    token ids, texts and ids mixed, or ``{"prompt": ...}``; anything else is one prompt."""
    p = _get(body, name)
    if p is _MISSING:
        raise BadRequest(f"'{name}' is required")
    if isinstance(p, list) and p and not any(_is_token(t) for t in p):
        if len(p) > MAX_PROMPTS:
            raise BadRequest(f"'{name}' holds {len(p)} prompts, more than the {MAX_PROMPTS} allowed")
        return [_subprompt(f"'{name}' (prompt {i})", q, n_vocab) for i, q in enumerate(p)]
    return [_subprompt(f"'{name}'", p, n_vocab)]


def _subprompt(where: str, p: Any, n_vocab: int) -> Prompt:
    """One prompt (server-common.cpp tokenize_input_subprompt); ``where`` names it in messages."""
    if isinstance(p, Mapping):  # llama-server's {"prompt_string": ..., "multimodal_data": ...} (and pyspec's "prompt")
        if p.get("multimodal_data") is not None:
            raise BadRequest(f"{where}: multimodal data needs a multimodal model, which pyspec does not serve")
        key = "prompt_string" if "prompt_string" in p else "prompt" if "prompt" in p else None
        if key is None:
            raise BadRequest(f"{where}: an object prompt must hold 'prompt_string'")
        p = p[key]
    if isinstance(p, str):
        return _text(where.strip("'"), p)
    # token ids, or ids and texts mixed (json_is_array_of_mixed_numbers_strings: at least one of each)
    if isinstance(p, list) and p and all(_is_token(t) or isinstance(t, str) for t in p) and any(map(_is_token, p)):
        bad = next((t for t in p if _is_token(t) and not 0 <= t < n_vocab), None)
        if bad is not None:
            raise BadRequest(f"{where}: token {_kind(bad)} is outside the vocabulary (0..{n_vocab - 1})")
        for t in p:
            if isinstance(t, str):
                _text(where.strip("'"), t)
        return list(p)
    if isinstance(p, list) and not p:
        raise BadRequest(f"{where} is an empty list of tokens")
    raise BadRequest(f"{where} must be a string, a list of tokens, a JSON object containing a prompt string, "
                     f"or a list of mixed strings & tokens, got {_kind(p)}")


def _token_ids(name: str, toks: list[int], n_vocab: int) -> list[int]:
    if not toks:
        raise BadRequest(f"'{name}' is an empty list of tokens")
    bad = next((t for t in toks if not 0 <= t < n_vocab), None)
    if bad is not None:
        raise BadRequest(f"'{name}': token {_kind(bad)} is outside the vocabulary (0..{n_vocab - 1})")
    return list(toks)


def _texts(name: str, v: Any) -> None:
    """_text over every string (keys too) inside a JSON value (its depth is bounded by parse_json)."""
    if isinstance(v, str):
        _text(name, v)
    elif isinstance(v, Mapping):
        for k, w in v.items():
            _text(name, k)
            _texts(name, w)
    elif isinstance(v, list):
        for w in v:
            _texts(name, w)


def _messages(body: Mapping[str, Any]) -> list[Any]:
    msgs = _get(body, "messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest(f"'messages' must be a non-empty list, got {_kind(msgs)}")
    for i, m in enumerate(msgs):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string 'role'")
        content = m.get("content")
        if isinstance(content, list):
            # OpenAI's content parts: only text reaches a text model's template
            for j, part in enumerate(content):
                if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise BadRequest(f"messages[{i}].content[{j}] must be {{\"type\": \"text\", \"text\": string}}")
        elif not isinstance(content, (str, type(None))):
            raise BadRequest(f"messages[{i}].content must be a string or a list of parts, got {_kind(content)}")
        _texts(f"messages[{i}]", m)
    return msgs


# names the chat renderer passes itself (pyspec.generation.chat.render_chat / render_template):
# a template kwarg of the same name would collide with them
_RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "add_generation_prompt", "template", "bos_token", "eos_token"})


def _template_kwargs(body: Mapping[str, Any]) -> dict[str, Any] | None:
    kwargs = _get(body, "chat_template_kwargs")
    if kwargs is _MISSING:
        return None
    if not isinstance(kwargs, Mapping):
        raise BadRequest(f"'chat_template_kwargs' must be an object, got {_kind(kwargs)}")
    clash = sorted(_RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if clash:
        raise BadRequest(f"'chat_template_kwargs' may not set {', '.join(clash)} (the request's own fields set them)")
    _texts("chat_template_kwargs", kwargs)
    return dict(cast(Mapping[str, Any], kwargs))


def _finish(req: Request) -> Request:
    if req.n_predict == 0:
        raise BadRequest("'n_predict' / 'max_tokens' must be positive (or -1)")
    return req


@dataclasses.dataclass
class Parsed:
    """A completion body read: the request's settings, its prompts and choices per prompt.

    ``request`` carries everything but the prompt (a chat's messages are in it); the server turns
    each of ``prompts`` (none for a chat: its messages are the one prompt) into tokens and submits
    ``n`` requests for each (llama-server's ``n`` / ``n_cmpl``: choice ``i * n + j``)."""

    request: Request
    prompts: list[Prompt]
    n: int
    stream: bool
    response_fields: list[str] = dataclasses.field(default_factory=list)  # /completion: only these ("a/b": nested)
    # /completion's "tokens": llama-server sends them only when asked, pyspec unless told not to
    return_tokens: bool = True
    # chat: the final assistant message is continued, not answered (llama-server's assistant prefill,
    # continue_final_message); its turn stays open in the prompt
    continue_final: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with usage and no choices
    verbose: bool = False  # "verbose": the native answer under "__verbose" (the server's --verbose does too)


def _n_choices(body: Mapping[str, Any], n_parallel: int) -> int:
    # llama-server (server-task.cpp): n_cmpl, else n; at most one per slot
    n = _int(body, "n_cmpl", 1, n_parallel) if "n_cmpl" in body else _int(body, "n", 1, n_parallel)
    return 1 if n is None else n


def native_request(body: Mapping[str, Any], d: ServerDefaults, n_vocab: int, n_parallel: int,
                   prompts: list[Prompt] | None = None) -> Parsed:
    """llama-server's /completion body -> Parsed (``prompts``: these instead of the body's, for /infill)."""
    c = _common(body, d, n_vocab, n_parallel)
    n_probs = _int(body, "n_probs", 0, MAX_N_PROBS) or 0
    req = Request(n_probs=n_probs, add_special=True, parse_special=True, **c)
    fields = _get(body, "response_fields")
    if fields is _MISSING:
        fields = []
    if not isinstance(fields, list) or not all(isinstance(f, str) for f in fields):
        raise BadRequest("'response_fields' must be a list of strings")
    if len(fields) > MAX_RESPONSE_FIELDS:
        raise BadRequest(f"'response_fields' holds {len(fields)} paths, more than the {MAX_RESPONSE_FIELDS} allowed")
    return Parsed(_finish(req), _prompts(body, n_vocab) if prompts is None else prompts, _n_choices(body, n_parallel),
                  _bool(body, "stream", False), [_text("response_fields", f) for f in fields],
                  _bool(body, "return_tokens", True))


def _infill_part(name: str, v: Any, n_vocab: int) -> str | list[int | str]:
    # tokenize_mixed's input: a text, or texts and token ids
    if isinstance(v, str):
        return _text(name, v)
    if isinstance(v, list) and all(_is_token(t) or isinstance(t, str) for t in v):
        bad = next((t for t in v if _is_token(t) and not 0 <= t < n_vocab), None)
        if bad is not None:
            raise BadRequest(f"'{name}': token {_kind(bad)} is outside the vocabulary (0..{n_vocab - 1})")
        for t in v:
            if isinstance(t, str):
                _text(name, t)
        return list(v)
    raise BadRequest(f"'{name}' must be a string or a list of strings and tokens, got {_kind(v)}")


def infill_request(body: Any, d: ServerDefaults, n_vocab: int, n_parallel: int) -> tuple[Parsed, InfillInput]:
    """llama-server's /infill body (server-context.cpp post_infill, its checks in its order) -> the
    completion's settings (its prompt left for the caller: format_prompt_infill) and the text parts."""
    body = _object(body)
    if "prompt" in body and not isinstance(body["prompt"], str):  # the prompt (after the cursor) is optional
        raise BadRequest('"prompt" must be a string')
    for name in ("input_prefix", "input_suffix"):
        if name not in body:
            raise BadRequest(f'"{name}" is required')
    extra = body.get("input_extra", [])
    if not isinstance(extra, list):
        raise BadRequest('"input_extra" must be an array of {"filename": string, "text": string}')
    chunks: list[tuple[str, str]] = []
    for chunk in extra:
        if not isinstance(chunk, Mapping) or not isinstance(chunk.get("text"), str):
            raise BadRequest('extra_context chunk must contain a "text" field with a string value')
        if "filename" in chunk and not isinstance(chunk["filename"], str):  # the file name is optional
            raise BadRequest('extra_context chunk\'s "filename" field must be a string')
        chunks.append((_text("input_extra", chunk.get("filename", "tmp")), _text("input_extra", chunk["text"])))
    inp = InfillInput(_infill_part("input_prefix", body["input_prefix"], n_vocab),
                      _infill_part("input_suffix", body["input_suffix"], n_vocab), chunks,
                      _text("prompt", body.get("prompt", "")))
    return native_request(body, d, n_vocab, n_parallel, prompts=[]), inp


def completion_request(body: Mapping[str, Any], d: ServerDefaults, n_vocab: int, n_parallel: int) -> Parsed:
    """OpenAI's /v1/completions body -> Parsed."""
    c = _common(body, d, n_vocab, n_parallel)
    if _bool(body, "echo", False):
        raise BadRequest("'echo' is not supported")
    n_probs = _int(body, "logprobs", 0, 20) or 0
    req = Request(n_probs=n_probs, add_special=True, parse_special=True, **c)
    return Parsed(_finish(req), _prompts(body, n_vocab), _n_choices(body, n_parallel), _bool(body, "stream", False),
                  include_usage=_stream_options(body), verbose=_bool(body, "verbose", False))


def _turns(body: Mapping[str, Any]) -> tuple[list[Any], bool, bool]:
    """A chat's messages, add_generation_prompt and whether its final assistant message is continued,
    with llama-server's rules (server-common.cpp oaicompat_chat_params_parse): a final assistant
    message is continued unless continue_final_message says otherwise (--prefill-assistant, on by
    default), two assistant messages at the end are refused, and so is continuing with a generation
    prompt asked for."""
    msgs = _messages(body)
    add_generation_prompt = _bool(body, "add_generation_prompt", True)
    cfm = _get(body, "continue_final_message")
    if cfm is not _MISSING and not isinstance(cfm, (bool, str)):
        raise BadRequest(f"'continue_final_message' must be a boolean or \"content\", got {_kind(cfm)}")
    # common_chat_continuation_parse: true, "content" or "reasoning_content" continue; anything else does not
    continue_final = cfm is True or cfm in ("content", "reasoning_content")
    if cfm is _MISSING and msgs[-1].get("role") == "assistant":
        if len(msgs) >= 2 and msgs[-2].get("role") == "assistant":
            raise BadRequest("Cannot have 2 or more assistant messages at the end of the list.")
        continue_final, add_generation_prompt = True, False
    if continue_final and add_generation_prompt:
        raise BadRequest("Cannot set both add_generation_prompt and continue_final_message to true.")
    if continue_final and msgs[-1].get("role") != "assistant":
        raise BadRequest("'continue_final_message': the last message must be the assistant's to continue")
    return msgs, add_generation_prompt, continue_final


def apply_template_request(body: Mapping[str, Any], d: ServerDefaults) -> Parsed:
    """llama-server's /apply-template body (a chat body) -> a Parsed holding its messages and template."""
    body = _object(body)
    msgs, add_generation_prompt, continue_final = _turns(body)
    req = Request(messages=msgs, add_generation_prompt=add_generation_prompt, chat_template=d.chat_template,
                  chat_template_kwargs=_template_kwargs(body))
    return Parsed(req, [], 1, False, continue_final=continue_final)


def _stream_options(body: Mapping[str, Any]) -> bool:
    """stream_options.include_usage (OpenAI's streaming option)."""
    opts = _get(body, "stream_options")
    if opts is _MISSING:
        return False
    if not isinstance(opts, Mapping):
        raise BadRequest(f"'stream_options' must be an object, got {_kind(opts)}")
    v = opts.get("include_usage", False)
    if not isinstance(v, bool):
        raise BadRequest(f"'stream_options.include_usage' must be a boolean, got {_kind(v)}")
    return v


def chat_request(body: Mapping[str, Any], d: ServerDefaults, n_vocab: int, n_parallel: int) -> Parsed:
    """OpenAI's /v1/chat/completions body -> Parsed."""
    body = _response_format(_object(body))
    c = _common(body, d, n_vocab, n_parallel)
    msgs, add_generation_prompt, continue_final = _turns(body)
    n_probs = 0
    if _bool(body, "logprobs", False):
        n_probs = _int(body, "top_logprobs", 0, 20) or 0
        n_probs = max(n_probs, 1)  # the chosen token's log-probability needs the row; top list trimmed later
    req = Request(messages=msgs, n_probs=n_probs, add_generation_prompt=add_generation_prompt,
                  chat_template=d.chat_template, chat_template_kwargs=_template_kwargs(body), **c)
    return Parsed(_finish(req), [], _n_choices(body, n_parallel), _bool(body, "stream", False),
                  continue_final=continue_final, include_usage=_stream_options(body),
                  verbose=_bool(body, "verbose", False))


@dataclasses.dataclass
class EmbeddingParsed:
    """An embeddings body read (server-context.cpp handle_embeddings_impl): the prompts, each tokenized
    with BOS and special tokens parsed; ``content_given``: the body used llama-server's ``content``
    instead of OpenAI's ``input`` (answered in llama-server's shape, even on /v1/embeddings)."""

    prompts: list[Prompt]
    content_given: bool
    base64: bool
    normalize: int | None  # embd_normalize; None: the server's


_MEDIA_PARTS = {"image_url": "image", "input_audio": "audio", "input_video": "video", "video_url": "video"}


def _content_parts(where: str, content: Any) -> str:
    """The text of OpenAI content parts (tokenize_oai_content_array): text parts joined; media refused
    (pyspec serves no multimodal model), and any other type."""
    if not isinstance(content, list):
        raise BadRequest(f"{where}: \"content\" must be an array, got {_kind(content)}")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in _MEDIA_PARTS:
            raise BadRequest(f"{where}.content[{j}]: {_MEDIA_PARTS[kind]} input is not supported "
                             "(pyspec serves text models)")
        if kind != "text":
            raise BadRequest(f"{where}.content[{j}]: unsupported content[].type "
                             f"{repr(kind)[:40] if isinstance(kind, str) else _kind(kind)}")
        text = part.get("text", "")
        if not isinstance(text, str):
            raise BadRequest(f"{where}.content[{j}].text must be a string, got {_kind(text)}")
        out.append(_text(f"{where}.content[{j}]", text))
    return "".join(out)


def embedding_request(body: Any, n_vocab: int) -> EmbeddingParsed:
    """llama-server's /embedding(s) and OpenAI's /v1/embeddings body -> EmbeddingParsed."""
    body = _object(body)
    name = "input" if "input" in body else "content" if "content" in body else None
    if name is None:
        raise BadRequest('"input" or "content" must be provided')
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise BadRequest("'encoding_format': the format to return the embeddings in. Can be either float or base64")
    normalize = _int(body, "embd_normalize", -1, 1000)
    p = body[name]

    def entry(where: str, q: Any) -> Prompt:
        if isinstance(q, Mapping) and "content" in q:
            return _content_parts(where, q["content"])
        return _subprompt(where, q, n_vocab)

    if isinstance(p, list) and not any(_is_token(t) for t in p):
        if not p:
            raise BadRequest(f"'{name}' must not be empty")
        if len(p) > MAX_PROMPTS:
            raise BadRequest(f"'{name}' holds {len(p)} prompts, more than the {MAX_PROMPTS} allowed")
        prompts = [entry(f"'{name}' (prompt {i})", q) for i, q in enumerate(p)]
    else:
        prompts = [entry(f"'{name}'", p)]
    return EmbeddingParsed(prompts, name == "content", fmt == "base64", normalize)


def _object(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise BadRequest(f"the request body must be a JSON object, got {_kind(body)}")
    return body


def tokenize_request(body: Any) -> tuple[str, bool, bool, bool]:
    """llama-server's /tokenize body -> (content, add_special, parse_special, with_pieces)."""
    body = _object(body)
    content = _get(body, "content")
    if not isinstance(content, str):
        raise BadRequest(f"'content' must be a string, got {_kind(content)}")
    return (_text("content", content), _bool(body, "add_special", False), _bool(body, "parse_special", True),
            _bool(body, "with_pieces", False))


def detokenize_request(body: Any, n_vocab: int) -> list[int]:
    """llama-server's /detokenize body -> the token ids (each in the vocabulary)."""
    toks = _get(_object(body), "tokens")
    if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
        raise BadRequest("'tokens' must be a list of token ids")
    return _token_ids("tokens", toks, n_vocab) if toks else []


_SLOT_ID = re.compile(r"[0-9]{1,9}")


def slot_action_request(slot_id: str, action: str, n_parallel: int) -> tuple[int, str]:
    """/slots/{id}?action=... -> (slot id, action), both checked."""
    if not _SLOT_ID.fullmatch(slot_id) or not 0 <= int(slot_id) < n_parallel:
        raise BadRequest(f"the slot id must be an integer in [0, {n_parallel - 1}], got {slot_id[:40]!r}")
    if action not in ("save", "restore", "erase"):
        raise BadRequest(f"'action' must be save, restore or erase, got {action[:40]!r}")
    return int(slot_id), action


# the longest file name of common Linux file systems (NAME_MAX, as fs_validate_filename), less the
# ".tmp" that the slot file writer appends to its temporary file (pyspec/core/slot_file.py)
MAX_FILENAME_BYTES = 255 - len(".tmp")
# what llama.cpp's fs_validate_filename refuses (common.cpp), besides path separators: control
# characters, look-alikes of '.', '/' and '\', surrogates, U+FFFD, the BOM, and : * ? " < > |
_FORBIDDEN_IN_FILENAME = re.compile(r'[\x00-\x1f\x7f-\x9f\uff0e\u2215\u2216\ud800-\udfff\ufffd\ufeff:*?"<>|/\\]')


def slot_filename(body: Any) -> str:
    """The 'filename' of a slot save / restore body: a plain file name in the slot folder.

    Refused before anything touches the file system: an over-long name (the OS error would be a 500),
    path separators and '..' (no escape from the folder), a leading '.', and what llama-server's
    fs_validate_filename refuses.
    """
    name = _get(_object(body), "filename")
    if not isinstance(name, str) or not name:
        raise BadRequest(f"'filename' must be a non-empty string, got {_kind(name)}")
    if (m := _FORBIDDEN_IN_FILENAME.search(name)) is not None:
        raise BadRequest(f"'filename' must be a plain file name: character U+{ord(m.group()):04X} is not allowed")
    n_bytes = len(name.encode("utf-8"))
    if n_bytes > MAX_FILENAME_BYTES:
        raise BadRequest(f"'filename' is {n_bytes} bytes long, more than the {MAX_FILENAME_BYTES} allowed")
    if name.startswith((".", " ")) or name.endswith((".", " ")) or ".." in name:
        raise BadRequest("'filename' must be a plain file name: no leading '.' or ' ', trailing '.' or ' ', or '..'")
    return name
