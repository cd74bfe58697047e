"""The ``server`` fuzz target: request bodies for every endpoint of ``pyspec serve`` that takes one.

An input picks an endpoint and builds a JSON body from it: known request fields (llama-server's
and OpenAI's names) with values of every JSON kind, the wrong kind included (numbers that
overflow a double, NaN, integers of many digits, strings with NUL and lone surrogates, nested
lists and objects), written as raw text so that values Python's json would not write reach the
server; sometimes the text is cut or garbage. Generation is kept short. The server must answer
every body with a status below 500; a 5xx, an exception out of the app, a signal or a hang
(seen by scripts/fuzz.py) is a finding. The app runs in-process on the tiny chat model, two
slots, draft-free n-gram speculation, with an embedder (mean pooling), through starlette's
TestClient; ``/infill`` goes to a second app on a copy of the tiny target with fill-in-the-middle
tokens.
"""

from __future__ import annotations

import json
from typing import Any

from pyspec.errors import FuzzFinding as Finding

__all__ = ["ENDPOINTS", "FIELDS", "body", "setup", "target_server"]

S: dict[str, Any] = {}

ENDPOINTS = ["/completion", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize",
             "/apply-template", "/slots/0?action=save", "/slots/1?action=restore",
             "/slots/0?action=erase", "/props", "/infill", "/embedding", "/embeddings", "/v1/embeddings"]
FIELDS = ["prompt", "n_predict", "max_tokens", "max_completion_tokens", "temperature", "top_k", "top_p", "min_p",
          "typical_p", "stop", "logit_bias", "n_probs", "grammar", "json_schema", "response_format", "seed", "stream",
          "messages", "tokens", "content", "speculative.n_max", "speculative.n_min", "speculative.p_min", "id_slot",
          "cache_prompt", "n", "logprobs", "top_logprobs", "samplers", "dry_multiplier", "dry_sequence_breakers",
          "repeat_last_n", "repeat_penalty", "presence_penalty", "frequency_penalty", "return_tokens",
          "add_special", "with_pieces", "input_prefix", "input_suffix", "input_extra", "filename", "model",
          "chat_template_kwargs", "tools", "tool_choice", "return_progress", "timings_per_token", "ignore_eos",
          "min_keep", "mirostat", "mirostat_tau", "xtc_probability", "post_sampling_probs", "lora", "input",
          "encoding_format", "embd_normalize", "prompt_string", "multimodal_data", "text", "type", "stream_options",
          "continue_final_message", "add_generation_prompt", "verbose", "schema", "properties", "items", "n_keep",
          "n_discard"]
NUMBERS = ["0", "1", "-1", "0.5", "2", "1e400", "-1e400", "NaN", "Infinity", "1e-400", "2147483648",
           "9223372036854775808", "-9223372036854775809", "1" + "0" * 40, "3.4e38", "256", "31999", "32000"]
STRINGS = ["", "a", "hello world", "\\u0000", "\\ud800", "root ::= \\\"a\\\"", "{{ x }}", "x" * 300,
           "../../etc/passwd", "<|im_start|>", "\\n", "top_k;temperature", "\\\"", "🙂"]


def setup() -> None:
    from starlette.testclient import TestClient

    from pyspec import Context, Model
    from pyspec.common.params import CommonParamsSpeculative
    from pyspec.common.params import CommonSpeculativeType as T
    from pyspec.generation.embeddings import Embedder
    from pyspec.generation.engine import Engine, greedy_sampling
    from pyspec.server.app import create_app
    from pyspec.server.params import ServerDefaults
    from pyspec.testing import derived, fuzz
    from pyspec.testing import models as tm

    model = Model(tm.make_chat_target())
    ctx = Context(model, n_ctx=512, n_batch=64, n_ubatch=64, n_seq_max=2, n_threads=1, n_threads_batch=1)
    spec = CommonParamsSpeculative(types=[T.NGRAM_SIMPLE])
    S["engine"] = Engine(ctx, spec, greedy_sampling(), n_parallel=2, owned=[ctx, model], adaptive_draft=False)
    folder = fuzz.TMP / "slots"
    folder.mkdir(exist_ok=True)
    S["embedder"] = Embedder(model, pooling="mean", n_ctx=256, n_ubatch=64, n_threads=1)
    app = create_app(S["engine"], model_name="tiny", defaults=ServerDefaults(sampling=greedy_sampling()),
                     slot_save_path=folder, props=True, metrics=True, embedder=S["embedder"])
    S["client"] = TestClient(app, raise_server_exceptions=False).__enter__()
    # /infill needs fill-in-the-middle tokens, which the chat model lacks: a second app on a model with them
    fim = Model(derived.make_infill_target(fuzz.TMP / "infill.gguf"))
    fctx = Context(fim, n_ctx=256, n_batch=64, n_ubatch=64, n_seq_max=1, n_threads=1, n_threads_batch=1)
    S["infill_engine"] = Engine(fctx, None, greedy_sampling(), n_parallel=1, owned=[fctx, fim])
    S["infill_client"] = TestClient(create_app(S["infill_engine"], defaults=ServerDefaults(
        sampling=greedy_sampling())), raise_server_exceptions=False).__enter__()


def _value(inp: Any, depth: int = 0) -> str:
    """One JSON value as raw text, of a kind the input picks."""
    k = inp.num(0, 9) if depth < 3 else inp.num(0, 5)
    if k <= 1:
        return inp.choice(NUMBERS)
    if k == 2:
        return str(inp.wild(-5, 40000))
    if k == 3:
        return '"' + inp.choice(STRINGS) + '"'
    if k == 4:
        return inp.choice(["true", "false", "null"])
    if k == 5:  # text of the input's own bytes, escaped as JSON would (control bytes, any code point)
        return json.dumps(inp.bytes(inp.num(0, 24)).decode("utf-8", "replace"))
    if k in (6, 7):
        return "[" + ", ".join(_value(inp, depth + 1) for _ in range(inp.num(0, 4))) + "]"
    if k == 8:
        return '[{"role": ' + _value(inp, depth + 1) + ', "content": ' + _value(inp, depth + 1) + "}]"
    return "{" + ", ".join(f'"{inp.choice(FIELDS)}": {_value(inp, depth + 1)}' for _ in range(inp.num(0, 3))) + "}"


def body(inp: Any) -> str:
    """A request body: a short, mostly valid request with 1-6 fields set to what the input picks."""
    fields = {"n_predict": "4", "max_tokens": "4", "prompt": '"hello"',
              "messages": '[{"role": "user", "content": "hi"}]', "tokens": "[5, 6, 7]", "content": '"hello"',
              "input_prefix": '"def f("', "input_suffix": '"\\n"', "input": '"hello"'}
    for _ in range(inp.num(1, 6)):
        fields[inp.choice(FIELDS)] = _value(inp)
    text = "{" + ", ".join(f'"{k}": {v}' for k, v in fields.items()) + "}"
    cut = inp.byte()
    if cut > 245:  # a body cut short, or not JSON at all
        return text[: inp.num(0, len(text))]
    return text


def target_server(data: bytes) -> None:
    from pyspec.testing.fuzz import Input

    if "client" not in S:
        setup()
    inp = Input(data)
    path = inp.choice(ENDPOINTS)
    text = body(inp)
    client = S["infill_client"] if path == "/infill" else S["client"]
    r = client.post(path, content=text.encode("utf-8", "surrogatepass"),
                         headers={"Content-Type": "application/json"})
    if r.status_code >= 500 and r.status_code not in (501, 503):  # 501: off in this server; 503: busy
        raise Finding(f"POST {path} answered {r.status_code}: {r.text[:400]} (body {text[:400]!r})")
