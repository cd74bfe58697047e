#!/usr/bin/env python3
"""Agentic and code-edit traces where the model meets its own earlier text again, per speculative type.

Made here, no hub data. Speculative decoding gains on such serving when the model's output copies
material it has seen; a 270M base model asked in plain words to rewrite a file writes something
else, so each trace is built the way such prompts are built in practice, and then *recorded*
with plain greedy decoding, so that its prompts carry the model's own earlier outputs:

- ``code-edit``: a file-editing session (two files, ``--turns`` edits each). The prompt holds one
  worked example (a small file before and after an edit), the current file and the next
  instruction; the model writes the file after the edit. The next turn's prompt holds the file
  *as the model wrote it* (an editing agent re-sends the file it wrote).
- ``agent``: tool-calling loops (two tasks, ``--turns`` calls each). The prompt holds the tool list,
  one worked episode, the task, and the history: the model's own earlier calls (JSON, one per
  line) with each call's result (scripted); the model writes the next call.
- ``structured``: independent requests (one per product record) for the same JSON schema, one
  worked example in each prompt: the outputs repeat their keys and layout across requests,
  which only a cross-request index (the suffix type's global one) sees before the request.
- ``prompts``: pyspec bench's built-in prompts (continuations with repeated structure).

The recording (plain decoding, greedy) fixes every prompt; each type then runs the same prompts
in one Engine (one slot) in order, so state that lives across requests (the suffix type's global
index, the prompt cache) works as in a server. ``--record FILE`` keeps the recorded prompts, and a
later run with ``--trace-file FILE`` replays exactly those (so that a rerun on a quiet machine
measures the same work). It prints per trace and type: the mean accepted length (1 + accepted
tokens per verified draft, vLLM's), accepted tokens per drafted token, verified drafts, generated tokens per
target decode (tokens/step: what speed follows; the mean accepted length favours types that draft rarely), generated
tokens per second (prompt time left out; the median over ``--repeat`` runs), its ratio to plain decoding
and to the fastest n-gram type in the same repeat (repeats are interleaved: each runs every trace and type;
the median and the spread of the paired ratios), the lowest per-request ratio to plain (the issue's "never
below 0.97x plain on any prompt"), and whether the tokens equal plain decoding's (batch-invariant mode,
``--batch-invariant``, makes them equal; by default a verify batch may round differently from one-token
decodes).
Speed figures need a quiet machine; the acceptance figures do not.

    python scripts/bench_traces.py --threads 2 --repeat 3
    python scripts/bench_traces.py --types none,ngram-mod,suffix --record traces.json --json out.json
    python scripts/bench_traces.py --trace-file traces.json --repeat 3
    python scripts/bench_traces.py --trace-file traces.json --replay gemma-2t-b --set PRIOR_WEIGHT_POS=1.0
    python scripts/bench_traces.py --trace-file traces.json --replay gemma-2t --types suffix --suffix max_spec_factor=2
"""

from __future__ import annotations

import argparse
import ast
import json
import logging
import statistics
import sys
from pathlib import Path
from typing import Any

_repo = Path(__file__).resolve().parents[1]
if (_repo / "pyspec" / "lib").is_dir() and any((_repo / "pyspec" / "lib").glob("libllama*")):
    sys.path.insert(0, str(_repo))

from pyspec.cli.bench import BUILTIN_PROMPTS  # noqa: E402
from pyspec.common import speculative as sp  # noqa: E402
from pyspec.generation.contexts import parse_types, spec_params  # noqa: E402
from pyspec.generation.draft_replay import (  # noqa: E402
    Trace,
    controller_settings,
    copy_bound,
    parse_setting,
    policies,
    replay_session,
)
from pyspec.generation.driver import greedy_sampling  # noqa: E402
from pyspec.generation.engine import Engine  # noqa: E402
from pyspec.generation.requests import Request  # noqa: E402
from pyspec.suffix.impl import SuffixParams, speculative_init, split_suffix_type, suffix_params  # noqa: E402

TYPES = "none,ngram-simple,ngram-map-k,ngram-mod,ngram-cache,suffix,suffix+ngram-mod"

# --- code-edit ----------------------------------------------------------------------------

EDIT_EXAMPLE = '''\
### File: shapes.py
class Circle:
    def __init__(self, radius):
        self.radius = radius

    def area(self):
        return 3.14159 * self.radius * self.radius

### Edit: rename `radius` to `r`
### File after the edit: shapes.py
class Circle:
    def __init__(self, r):
        self.r = r

    def area(self):
        return 3.14159 * self.r * self.r

'''

INVENTORY = '''\
class Inventory:
    """Items in stock, by name."""

    def __init__(self):
        self.items = {}

    def add_item(self, name, count):
        if count <= 0:
            raise ValueError("count must be positive")
        self.items[name] = self.items.get(name, 0) + count

    def remove_item(self, name, count):
        have = self.items.get(name, 0)
        if count > have:
            raise ValueError("not enough items")
        self.items[name] = have - count

    def total_count(self):
        return sum(self.items.values())

    def report(self):
        for name, count in sorted(self.items.items()):
            print(name, count)
'''

SETTINGS = '''\
import json
import os


def load_settings(path):
    """Read the settings file, falling back to the defaults."""
    defaults = {"host": "localhost", "port": 8080, "debug": False}
    if not os.path.exists(path):
        return defaults
    with open(path) as f:
        data = json.load(f)
    settings = dict(defaults)
    settings.update(data)
    return settings


def save_settings(path, settings):
    with open(path, "w") as f:
        json.dump(settings, f, indent=2)
'''

EDITS = {
    "inventory.py": (INVENTORY, ["rename `items` to `stock`", "rename `count` to `amount`",
                                 "add a method `clear` that empties the stock", "rename `report` to `show`",
                                 "rename `have` to `held`", "rename `Inventory` to `Store`"]),
    "settings.py": (SETTINGS, ["rename `defaults` to `DEFAULTS`", "rename `data` to `loaded`",
                               "add `timeout: 30` to the defaults", "rename `path` to `filename`",
                               "rename `settings` to `config`", "add a docstring to `save_settings`"]),
}


def edit_prompt(name: str, text: str, instruction: str) -> str:
    return (f"{EDIT_EXAMPLE}### File: {name}\n{text.rstrip()}\n\n### Edit: {instruction}\n"
            f"### File after the edit: {name}\n")


# --- agent --------------------------------------------------------------------------------

AGENT_HEADER = '''\
Tools: read_file(path), write_file(path, content), run_tests(path), search(query), done(answer).
Answer with one JSON object per line: {"tool": NAME, "arguments": {...}}.

Task: find where `parse_date` is defined.
{"tool": "search", "arguments": {"query": "def parse_date"}}
Result: src/dates.py:12
{"tool": "read_file", "arguments": {"path": "src/dates.py"}}
Result: def parse_date(text): ...
{"tool": "done", "arguments": {"answer": "src/dates.py, line 12"}}

'''

AGENT_TASKS = ["fix the failing inventory test", "add a `timeout` setting to the server"]
# each call's result, by the tool the model called (scripted: the tools do not run)
TOOL_RESULTS = {"read_file": "class Inventory: ...", "write_file": "ok", "run_tests": "1 failed, 7 passed",
                "search": "src/inventory.py:14, tests/test_inventory.py:22", "done": "ok"}


def tool_result(call: str) -> str:
    """The scripted result of the call the model wrote (an error for a line that is no call)."""
    try:
        return TOOL_RESULTS.get(json.loads(call.strip().splitlines()[0])["tool"], "error: unknown tool")
    except (ValueError, KeyError, TypeError, IndexError):
        return "error: expected one JSON object"


def agent_prompt(task: str, history: list[tuple[str, str]]) -> str:
    lines = [AGENT_HEADER, f"Task: {task}\n"]
    for call, result in history:
        lines.append(f"{call.strip()}\nResult: {result}\n")
    return "".join(lines)


# --- structured ---------------------------------------------------------------------------

RECORD_EXAMPLE = ('Convert each product record to JSON.\n'
                  'Record: name=Desk Lamp; price=24.99; stock=12; tags=lighting,office\n'
                  'JSON: {"name": "Desk Lamp", "price": 24.99, "stock": 12, "tags": ["lighting", "office"]}\n')
RECORDS = [
    "name=Coffee Mug; price=8.50; stock=140; tags=kitchen,gift",
    "name=USB Cable; price=5.99; stock=320; tags=electronics,office",
    "name=Yoga Mat; price=19.00; stock=45; tags=sport,home",
    "name=Notebook; price=3.25; stock=500; tags=office,school",
    "name=Water Bottle; price=12.75; stock=80; tags=sport,kitchen",
    "name=Wall Clock; price=29.90; stock=18; tags=home,gift",
    "name=Backpack; price=39.99; stock=60; tags=school,travel",
    "name=Desk Fan; price=22.00; stock=33; tags=home,office",
]


def record_prompt(record: str) -> str:
    return f"{RECORD_EXAMPLE}Record: {record}\nJSON:"


# --- recording and replay -----------------------------------------------------------------

Step = dict[str, Any]  # {"prompt": str, "n_predict": int, "stop": [str]}


def _generate(eng: Engine, step: Step) -> str:
    """Run one step with plain decoding; its tokens go into the step (for --offline), its text is returned."""
    out = eng.submit(Request(prompt=step["prompt"], n_predict=step["n_predict"], stop=step["stop"])).result()
    step["prompt_tokens"], step["plain_tokens"] = list(out.prompt_tokens), list(out.tokens)
    return out.text


def record_traces(eng: Engine, turns: int, n_predict: int) -> dict[str, list[Step]]:
    """Every trace's prompts, built turn after turn from plain greedy decoding's outputs on ``eng``."""
    traces: dict[str, list[Step]] = {"code-edit": [], "agent": [], "structured": [], "prompts": []}
    for name, (text, edits) in EDITS.items():
        for instruction in edits[:turns]:
            step = {"prompt": edit_prompt(name, text, instruction), "n_predict": 4 * n_predict, "stop": ["\n###"]}
            traces["code-edit"].append(step)
            out = _generate(eng, step)
            text = out if out.strip() else text  # the file as the model wrote it goes into the next prompt
    for task in AGENT_TASKS:
        history: list[tuple[str, str]] = []
        for _ in range(turns):
            step = {"prompt": agent_prompt(task, history), "n_predict": n_predict, "stop": ["\nResult:"]}
            traces["agent"].append(step)
            out = _generate(eng, step)
            history.append((out, tool_result(out)))
    for record in RECORDS:
        traces["structured"].append({"prompt": record_prompt(record), "n_predict": n_predict, "stop": ["\n"]})
    for prompt in BUILTIN_PROMPTS:
        traces["prompts"].append({"prompt": prompt, "n_predict": n_predict, "stop": []})
    for step in traces["structured"] + traces["prompts"]:
        _generate(eng, step)
    return traces


# --- offline: acceptance without the model ----------------------------------------------------

DEFAULT_SUFFIX = SuffixParams()


def suffix_field(item: str) -> tuple[str, Any]:
    """``NAME=VALUE`` for a SuffixParams field (a Python literal; SuffixParams checks the rest)."""
    name, eq, text = item.partition("=")
    try:
        if not eq:
            raise ValueError
        return name.strip(), ast.literal_eval(text.strip())
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        raise ValueError(f"{item!r}: not NAME=VALUE with a Python literal") from None


def _offline_spec(types: str, n_max: int, suffix: SuffixParams) -> Any:
    """One sequence's speculative state for ``types`` (the suffix type with ``suffix``)."""
    rest, wants_suffix = split_suffix_type(types.replace("+", ","))
    return speculative_init(spec_params(parse_types(rest), n_max=n_max), 1, suffix=suffix if wants_suffix else None)


def tokens_per_step(n_gen: int, n_accepted: int) -> float:
    """Generated tokens per target decode (plain steps and verified drafts) where every accepted token is
    kept (offline: a draft is matched up to the recorded output's end): what speed follows, unlike the mean
    accepted length, which counts only the steps with a draft (a type that drafts rarely but long wins it).
    The timed runs count their decodes (RequestStats.n_steps)."""
    return n_gen / max(1, n_gen - n_accepted)


def offline_trace(types: str, steps: list[Step], n_max: int, suffix: SuffixParams = DEFAULT_SUFFIX) -> dict[str, Any]:
    """Acceptance of ``types`` on the recorded plain outputs: each request's draft calls as the Engine makes
    them (one state across the requests, the whole draft verified, no draft-length control), a draft's
    accepted tokens the longest prefix the recorded output continues with (greedy: what verification keeps)."""
    spec = _offline_spec(types, n_max, suffix)
    n_drafts = n_drafted = n_accepted = 0
    per_request: list[float | None] = []
    try:
        cap = sp.common_speculative_n_max(spec)
        for step in steps:
            history, target = list(step["prompt_tokens"]), step["plain_tokens"]
            if not target:
                per_request.append(None)
                continue
            sp.common_speculative_begin(spec, 0, history)
            d0, a0 = n_drafts, n_accepted
            sampled, g = target[0], 1
            while g < len(target):
                dp = sp.common_speculative_get_draft_params(spec, 0)
                dp.drafting, dp.n_max, dp.pos0, dp.id_last, dp.prompt = True, min(cap, len(target) - g - 1), \
                    len(history), sampled, history
                draft: list[int] = []
                dp.result = draft
                if dp.n_max > 0:
                    sp.common_speculative_draft(spec)
                j = 0
                while j < len(draft) and g + j < len(target) and draft[j] == target[g + j]:
                    j += 1
                if draft:
                    sp.common_speculative_accept(spec, 0, j)
                    n_drafts, n_drafted, n_accepted = n_drafts + 1, n_drafted + len(draft), n_accepted + j
                history.append(sampled)
                history.extend(target[g : g + j])
                sampled = target[g + j]
                g += j + 1
            per_request.append(1 + (n_accepted - a0) / (n_drafts - d0) if n_drafts > d0 else None)
    finally:
        spec.close()
    n_gen = sum(len(step["plain_tokens"]) for step in steps)
    return {"n_drafts": n_drafts, "n_drafted": n_drafted, "n_accepted": n_accepted, "per_request": per_request,
            "tokens_per_step": tokens_per_step(n_gen, n_accepted),
            "mean_acceptance_length": 1 + n_accepted / n_drafts if n_drafts else None,
            "accepted_per_draft_token": n_accepted / n_drafted if n_drafted else None}


def offline(traces: dict[str, list[Step]], types: list[str], n_max: int,
            suffix: SuffixParams = DEFAULT_SUFFIX) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    for name, steps in traces.items():
        if any("plain_tokens" not in s for s in steps):
            raise SystemExit(f"bench_traces: --offline needs a --record file with the plain tokens ({name} has none)")
        print(f"\n{name} ({len(steps)} requests, {sum(len(s['plain_tokens']) for s in steps)} tokens), offline")
        print("type                  mean acc. length   accepted/drafted   drafts   tokens/step")
        for t in types:
            if t == "none":
                continue
            r = results.setdefault(name, {})[t] = offline_trace(t, steps, n_max, suffix)
            mal, apd = r["mean_acceptance_length"], r["accepted_per_draft_token"]
            print(f"{t:20s}  {'-' if mal is None else f'{mal:8.2f}':>16s}   "
                  f"{'-' if apd is None else f'{apd:8.2f}':>16s}   {r['n_drafts']:6d}   {r['tokens_per_step']:11.2f}")
    return results


# --- replay: speed on a modelled clock ----------------------------------------------------------

def replay_traces(traces: dict[str, list[Step]], types: list[str], machine_name: str, n_max: int,
                  suffix: SuffixParams = DEFAULT_SUFFIX) -> None:
    """Each trace's requests in order through one speculative state and one controller per policy (plain,
    llama.cpp's fixed lengths, cost-aware) on a machine profile of scripts/draft_length_sim.py: tokens per
    second on the modelled clock (exact and repeatable; no checkpoint restores, no prompt time)."""
    from draft_length_sim import machine  # the profiles live beside the replay's other script

    m = machine(machine_name)
    for name, steps in traces.items():
        if any(not s.get("plain_tokens") for s in steps):
            raise SystemExit(f"bench_traces: --replay needs a --record file with the plain tokens ({name} has none)")
        session = [Trace(list(s["prompt_tokens"]), list(s["plain_tokens"]), f"{name}#{i}") for i, s in enumerate(steps)]
        plain = replay_session(session, [], None, m)
        print(f"\n{name} ({len(steps)} requests, {sum(len(t.target) for t in session)} tokens) on {machine_name}: "
              f"a perfect copier would reach {copy_bound(session, m):.2f}x plain (copy_bound)")
        print("type                  policy       mean acc. length   drafts   tokens/step   vs plain   lowest request")
        for t in types:
            if t == "none":
                continue
            rest, wants_suffix = split_suffix_type(t.replace("+", ","))
            for pol in ("fixed", "cost-aware"):
                ctl = policies()[pol](m)
                runs = replay_session(session, parse_types(rest), ctl, m, spec_kw={"n_max": n_max},
                                      suffix=suffix if wants_suffix else None)
                drafts = [d for r in runs for d in r.drafts]
                n_gen = sum(r.n_tokens for r in runs)
                rel = n_gen / sum(r.seconds for r in runs) / (sum(r.n_tokens for r in plain) /
                                                              sum(r.seconds for r in plain))
                low = min(r.tps / q.tps for r, q in zip(runs, plain, strict=True))
                mal = 1 + sum(a for _, a in drafts) / len(drafts) if drafts else None
                print(f"{t:20s}  {pol:10s}  {'-' if mal is None else f'{mal:8.2f}':>16s}   {len(drafts):6d}   "
                      f"{n_gen / sum(r.n_steps for r in runs):11.2f}   {rel:7.2f}x   {low:13.2f}x")


def run_trace(engine: Engine, steps: list[Step]) -> dict[str, Any]:
    tokens: list[list[int]] = []
    per_request: list[float] = []  # generation tokens/s of each request
    n_drafts = n_drafted = n_accepted = n_gen = n_decodes = 0
    restores0 = engine.n_checkpoint_restores
    seconds = 0.0  # generation only (first token to the end): the prompts cost every type alike
    for step in steps:
        out = engine.submit(Request(prompt=step["prompt"], n_predict=step["n_predict"], stop=step["stop"])).result()
        st = out.stats
        seconds += st.t_gen_ms / 1e3
        tokens.append(list(out.tokens))
        per_request.append(len(out.tokens) / max(1e-9, st.t_gen_ms / 1e3))
        n_gen += len(out.tokens)
        n_decodes += st.n_steps + 1  # the prompt's last decode gave the first token
        # vLLM's counters: a draft counted once, when first verified (llama-server's draft_n_accepted counts
        # the accepted tokens of a draft re-verified after a checkpoint restore a second time)
        n_drafts += st.spec.n_drafts
        n_drafted += st.spec.n_draft_tokens
        n_accepted += st.spec.n_accepted_tokens
    # a partial acceptance the target's memory cannot roll back (Gemma 3's sliding window) restores a
    # checkpoint and verifies the accepted tokens again: one more target decode each (in n_steps)
    n_restores = engine.n_checkpoint_restores - restores0
    return {"tokens": tokens, "n_gen": n_gen, "n_drafts": n_drafts, "n_drafted": n_drafted,
            "n_accepted": n_accepted, "n_restores": n_restores, "seconds": seconds, "per_request": per_request,
            # counted, not n_gen - n_accepted: a draft accepted past a stop string counts tokens not returned
            "tokens_per_step": n_gen / max(1, n_decodes),
            "mean_acceptance_length": 1 + n_accepted / n_drafts if n_drafts else None,
            "accepted_per_draft_token": n_accepted / n_drafted if n_drafted else None}


def _load(args: argparse.Namespace, types: str) -> Engine:
    # n_max is the draft models' option (the n-gram types draft up to their own sizes); suffix keeps its own too
    suffix = args.suffix if split_suffix_type(types.replace("+", ","))[1] else None
    eng = Engine.load(args.model, types=types.replace("+", ","), n_parallel=1, n_ctx=4096, n_threads=args.threads,
                      n_max=16, suffix=suffix, adaptive_draft=not args.fixed_draft,
                      batch_invariant=args.batch_invariant, sampling=greedy_sampling())
    eng.start()
    return eng


def _is_ngram(types: str) -> bool:
    return all(t.startswith("ngram-") for t in types.split("+"))


def _spread(xs: list[float]) -> str:
    return "-" if not xs else f"{statistics.median(xs):.2f}x [{min(xs):.2f}-{max(xs):.2f}]"


def timed(traces: dict[str, list[Step]], type_list: list[str], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Each type on each trace, ``args.repeat`` times, a fresh Engine each run; interleaved (repeats outermost,
    then traces, then types) so that a change in the machine's speed touches every type alike. The results
    are :func:`summarise`'s."""
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for rep in range(args.repeat):
        for name, steps in traces.items():
            for types in type_list:
                print(f"bench_traces: repeat {rep + 1}/{args.repeat}: {types} on {name} ...", file=sys.stderr,
                      flush=True)
                with _load(args, types) as eng:
                    runs.setdefault((name, types), []).append(run_trace(eng, steps))
    return summarise(runs, {name: len(steps) for name, steps in traces.items()}, type_list)


def summarise(runs: dict[tuple[str, str], list[dict[str, Any]]], n_requests: dict[str, int],
              type_list: list[str]) -> dict[str, dict[str, Any]]:
    """Per trace and type, from ``runs[(trace, type)]`` (:func:`run_trace`'s results, repeat k at index k):
    the first run's counts and tokens, the median seconds and per-request speed, and the paired ratios of
    each repeat: ``vs_plain_runs`` (tok/s over plain decoding's in the same repeat; needs "none" among the
    types), ``vs_best_ngram_runs`` (over the fastest n-gram type other than this one in the same repeat), and
    ``lowest_request_vs_plain`` (the lowest, over requests, of each request's median ratio to plain)."""
    results: dict[str, dict[str, Any]] = {}
    for name, n_req in n_requests.items():
        tps = {t: [x["n_gen"] / x["seconds"] for x in runs[(name, t)]] for t in type_list}
        plain = runs.get((name, "none"))
        for types in type_list:
            rr = runs[(name, types)]
            others = [t for t in type_list if _is_ngram(t) and t != types]
            r = dict(rr[0], seconds=statistics.median(x["seconds"] for x in rr),
                     per_request=[statistics.median(x["per_request"][i] for x in rr) for i in range(n_req)])
            r["vs_plain_runs"] = [a / b for a, b in zip(tps[types], tps["none"], strict=True)] if plain else []
            r["vs_best_ngram_runs"] = [tps[types][k] / max(tps[t][k] for t in others)
                                       for k in range(len(rr))] if others else []
            r["vs_plain"] = statistics.median(r["vs_plain_runs"]) if plain else None
            r["lowest_request_vs_plain"] = min(
                statistics.median(x["per_request"][i] / p["per_request"][i] for x, p in zip(rr, plain, strict=True))
                for i in range(n_req)) if plain else None
            results.setdefault(name, {})[types] = r
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF file (default: the bundled Gemma 3 270M)")
    ap.add_argument("--types", default=TYPES, help="comma list; join types of one set with +")
    ap.add_argument("--traces", default="code-edit,agent,structured,prompts")
    ap.add_argument("--turns", type=int, default=4, help="edits per file, calls per agent task")
    ap.add_argument("--n-predict", "-n", type=int, default=64, help="per request (code-edit: 4x)")
    ap.add_argument("--threads", "-t", type=int, default=2)
    ap.add_argument("--repeat", "-r", type=int, default=1,
                    help="runs per type, interleaved (speed: the median of the paired ratios)")
    ap.add_argument("--fixed-draft", action="store_true", help="llama.cpp's fixed draft lengths")
    ap.add_argument("--batch-invariant", action="store_true", help="batch-invariant numerics (lossless)")
    ap.add_argument("--record", help="write the recorded prompts to this file")
    ap.add_argument("--trace-file", help="replay the prompts recorded in this file (no recording run)")
    ap.add_argument("--offline", action="store_true",
                    help="acceptance only, without the model, from a --trace-file's recorded plain tokens")
    ap.add_argument("--replay", metavar="MACHINE",
                    help="speed on a modelled clock, without the model, from a --trace-file's recorded plain tokens: "
                         "a machine profile of scripts/draft_length_sim.py (gemma-2t, gemma-1t, ...)")
    ap.add_argument("--json", help="write the results to this file")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="an experiment: a DraftLengthController constant changed for the timed runs and the "
                         "replay (e.g. MARGIN=1.05, PRIOR='(0.6, 0.85)'); repeatable")
    ap.add_argument("--suffix", action="append", default=[], metavar="NAME=VALUE",
                    help="a SuffixParams field of the suffix type for every mode (e.g. max_spec_factor=2, "
                         "min_token_prob=0.8); repeatable")
    args = ap.parse_args(argv)
    try:
        for item in args.set:
            parse_setting(item)
    except ValueError as e:
        raise SystemExit(f"bench_traces: --set: {e}") from None
    try:
        args.suffix = suffix_params(**dict(suffix_field(item) for item in args.suffix))
    except (TypeError, ValueError) as e:
        raise SystemExit(f"bench_traces: --suffix: {e}") from None
    with controller_settings(args.set):
        return _main(args)


def _main(args: argparse.Namespace) -> int:
    logging.getLogger("pyspec").setLevel(logging.ERROR)
    if args.trace_file:
        traces = json.loads(Path(args.trace_file).read_text())
    else:
        print("bench_traces: recording the traces (plain, greedy) ...", file=sys.stderr, flush=True)
        with _load(args, "none") as eng:
            traces = record_traces(eng, args.turns, args.n_predict)
        if args.record:
            Path(args.record).write_text(json.dumps(traces, indent=1))
    traces = {name: traces[name] for name in args.traces.split(",")}
    if args.replay:
        replay_traces(traces, args.types.split(","), args.replay, 16, args.suffix)
        return 0
    if args.offline:
        res = offline(traces, args.types.split(","), 16, args.suffix)
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1))
        return 0
    results = timed(traces, args.types.split(","), args)
    for name, per_type in results.items():
        plain = per_type.get("none")
        print(f"\n{name} ({len(traces[name])} requests, {plain['n_gen'] if plain else '?'} tokens generated; "
              f"paired ratios: median [min-max] over {args.repeat} interleaved repeats)")
        print("type                  mean acc. length   accepted/drafted   drafts   tokens/step   tok/s   "
              "vs plain            vs best n-gram      lowest request   = plain")
        for types, r in per_type.items():
            mal, apd = r["mean_acceptance_length"], r["accepted_per_draft_token"]
            low = r["lowest_request_vs_plain"]
            same = "yes" if plain is None or r["tokens"] == plain["tokens"] else "NO"
            print(f"{types:20s}  {'-' if mal is None else f'{mal:8.2f}':>16s}   "
                  f"{'-' if apd is None else f'{apd:8.2f}':>16s}   {r['n_drafts']:6d}   {r['tokens_per_step']:11.2f}"
                  f"  {r['n_gen'] / r['seconds']:6.1f}   {_spread(r['vs_plain_runs']):18s}  "
                  f"{_spread(r['vs_best_ngram_runs']):18s}  {'-' if low is None else f'{low:5.2f}x':>14s}   {same}")
    if args.json:
        Path(args.json).write_text(json.dumps({n: {t: {k: v for k, v in r.items() if k != "tokens"}
                                                   for t, r in pt.items()} for n, pt in results.items()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
