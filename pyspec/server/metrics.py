"""The ``/metrics`` endpoint's text: Prometheus exposition format 0.0.4, from an engine's counters.

Three families, each under the name its home server uses, so existing dashboards read them:

- llama-server's (tools/server/server-context.cpp, ``llamacpp:``): prompt_tokens_total,
  prompt_seconds_total, tokens_predicted_total, tokens_predicted_seconds_total, n_decode_total,
  n_tokens_max, and the gauges prompt_tokens_seconds, predicted_tokens_seconds,
  requests_processing, requests_deferred, n_busy_slots_per_decode (the throughput gauges are
  averages since start: pyspec keeps no per-scrape bucket);
- vLLM's (``vllm:``): spec_decode_num_drafts_total, spec_decode_num_draft_tokens_total,
  spec_decode_num_accepted_tokens_total, spec_decode_num_accepted_tokens_per_pos_total with a
  ``position`` label, prompt_tokens_total, generation_tokens_total, request_success_total with a
  ``finished_reason`` label, num_requests_running, num_requests_waiting; labelled
  ``model_name`` (and ``engine="0"``) as vLLM labels them;
- pyspec's, where neither has a name: spec_decode_mean_acceptance_length (vLLM logs it, exports
  no gauge), spec_decode_draft_length (a histogram of the verified drafts' lengths) and the exact
  counts by draft length, spec_decode_num_drafts_by_length_total /
  spec_decode_num_accepted_tokens_by_length_total with a ``draft_length`` label.

llama-server has no speculative counters in /metrics at this revision (only draft_n /
draft_n_accepted per response).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pyspec.generation.statistics import MetricsSnapshot

__all__ = ["CONTENT_TYPE", "DRAFT_LENGTH_BUCKETS", "render_metrics"]

CONTENT_TYPE = "text/plain; version=0.0.4"

# the draft-length histogram's upper bounds (tokens); +Inf closes it
DRAFT_LENGTH_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64)

# the engine's stop reasons as vLLM's finished_reason values
_FINISHED_REASON = {"eog": "stop", "stop": "stop", "n_predict": "length", "context": "length",
                    "cancelled": "abort"}


def _label_value(v: str) -> str:
    # the exposition format's escapes inside a label value
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(labels: Mapping[str, Any]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_label_value(str(v))}"' for k, v in labels.items()) + "}"


def _num(v: float) -> str:
    if isinstance(v, int):
        return str(v)
    return repr(float(v))


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")

    def sample(self, name: str, value: float, labels: Mapping[str, Any] | None = None) -> None:
        self.lines.append(f"{name}{_labels(labels or {})} {_num(value)}")

    def one(self, name: str, kind: str, help_text: str, value: float,
            labels: Mapping[str, Any] | None = None) -> None:
        self.family(name, kind, help_text)
        self.sample(name, value, labels)


def render_metrics(m: MetricsSnapshot, *, model_name: str, n_processing: int, n_waiting: int) -> str:
    """The exposition text of one snapshot (``n_processing`` busy slots, ``n_waiting`` queued requests)."""
    w = _Writer()

    # llama-server's, in its order and with its types
    w.one("llamacpp:prompt_tokens_total", "counter", "Number of prompt tokens processed.",
          m.n_prompt_tokens_processed)
    w.one("llamacpp:prompt_seconds_total", "counter", "Prompt process time", m.t_prompt_processing_ms / 1e3)
    w.one("llamacpp:tokens_predicted_total", "counter", "Number of generation tokens processed.",
          m.n_tokens_predicted)
    w.one("llamacpp:tokens_predicted_seconds_total", "counter", "Predict process time",
          m.t_tokens_generation_ms / 1e3)
    w.one("llamacpp:n_decode_total", "counter", "Total number of llama_decode() calls", m.n_decode)
    w.one("llamacpp:n_tokens_max", "counter", "Largest observed n_tokens.", m.n_tokens_max)
    w.one("llamacpp:prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s.",
          1e3 * m.n_prompt_tokens_processed / m.t_prompt_processing_ms if m.t_prompt_processing_ms > 0 else 0.0)
    w.one("llamacpp:predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s.",
          1e3 * m.n_tokens_predicted / m.t_tokens_generation_ms if m.t_tokens_generation_ms > 0 else 0.0)
    w.one("llamacpp:requests_processing", "gauge", "Number of requests processing.", n_processing)
    w.one("llamacpp:requests_deferred", "gauge", "Number of requests deferred.", n_waiting)
    w.one("llamacpp:n_busy_slots_per_decode", "gauge", "Average number of busy slots per llama_decode() call",
          m.n_busy_slots / max(m.n_decode, 1))

    # vLLM's
    lab = {"engine": "0", "model_name": model_name}
    s = m.spec
    w.one("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", n_processing, lab)
    w.one("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", n_waiting, lab)
    w.one("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
          m.n_prompt_tokens_processed, lab)
    w.one("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.",
          m.n_tokens_predicted, lab)
    by_reason: dict[str, int] = {"stop": 0, "length": 0, "abort": 0}
    for reason, n in m.n_requests_finished.items():
        key = _FINISHED_REASON.get(reason, "abort")
        by_reason[key] += n
    w.family("vllm:request_success_total", "counter", "Count of successfully processed requests.")
    for reason, n in by_reason.items():
        w.sample("vllm:request_success_total", n, {**lab, "finished_reason": reason})
    w.one("vllm:spec_decode_num_drafts_total", "counter", "Number of spec decoding drafts.", s.n_drafts, lab)
    w.one("vllm:spec_decode_num_draft_tokens_total", "counter", "Number of draft tokens.", s.n_draft_tokens, lab)
    w.one("vllm:spec_decode_num_accepted_tokens_total", "counter", "Number of accepted tokens.",
          s.n_accepted_tokens, lab)
    w.family("vllm:spec_decode_num_accepted_tokens_per_pos_total", "counter",
             "Accepted tokens per draft position.")
    for i, n in enumerate(s.accepted_per_pos):
        w.sample("vllm:spec_decode_num_accepted_tokens_per_pos_total", n, {**lab, "position": i})

    # pyspec's: what neither server exports
    w.one("pyspec:spec_decode_mean_acceptance_length", "gauge",
          "Mean tokens per verified draft, the target's own included (1 + accepted / drafts; 0 before any draft).",
          s.mean_acceptance_length, lab)
    w.family("pyspec:spec_decode_draft_length", "histogram", "Lengths of the verified drafts (tokens).")
    n_le = 0
    lengths = sorted(s.drafts_by_length.items())
    for le in DRAFT_LENGTH_BUCKETS:
        n_le = sum(n for k, n in lengths if k <= le)
        w.sample("pyspec:spec_decode_draft_length_bucket", n_le, {**lab, "le": le})
    w.sample("pyspec:spec_decode_draft_length_bucket", s.n_drafts, {**lab, "le": "+Inf"})
    w.sample("pyspec:spec_decode_draft_length_sum", s.n_draft_tokens, lab)
    w.sample("pyspec:spec_decode_draft_length_count", s.n_drafts, lab)
    w.family("pyspec:spec_decode_num_drafts_by_length_total", "counter", "Verified drafts by their length.")
    for k, n in lengths:
        w.sample("pyspec:spec_decode_num_drafts_by_length_total", n, {**lab, "draft_length": k})
    w.family("pyspec:spec_decode_num_accepted_tokens_by_length_total", "counter",
             "Accepted tokens by the length of their draft.")
    for k, n in sorted(s.accepted_by_length.items()):
        w.sample("pyspec:spec_decode_num_accepted_tokens_by_length_total", n, {**lab, "draft_length": k})
    return "\n".join(w.lines) + "\n"
