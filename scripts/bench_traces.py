#!/usr/bin/env python3
"""Multi-turn traces where earlier text comes back: code editing and agent tool calls, per speculative type.

Made here, no hub data: a code-edit trace (one Python module, rewritten turn after turn
with one identifier renamed each time: the prompt holds the current file and asks for
the next version) and an agent trace (a tool-calling loop: the prompt holds the tool
list and the calls and results so far, and asks for the next call, a JSON object like
the earlier ones). Each type runs every trace in one Engine (one slot), turn after
turn, so state that lives across requests (the suffix type's global index, the
prompt cache) works as in a server. Greedy, so the tokens are the same for every
type; it prints per trace and type the mean acceptance length (1 + accepted tokens
per verified draft, vLLM's definition), the accepted tokens per draft token, and
generated tokens per second (prompt time left out) relative to plain decoding in the
same run (the speed figures need a quiet machine; the acceptance figures do not).
"= plain" says whether the tokens equal plain decoding's: in the default numerics a
verify batch may round differently from one-token decodes (batch-invariant mode,
``--batch-invariant``, makes them equal).

    python scripts/bench_traces.py --threads 2 --turns 4 -n 96
    python scripts/bench_traces.py --types none,ngram-mod,suffix --json traces.json
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
from pathlib import Path
from typing import Any

_repo = Path(__file__).resolve().parents[1]
if (_repo / "pyspec" / "lib").is_dir() and any((_repo / "pyspec" / "lib").glob("libllama*")):
    sys.path.insert(0, str(_repo))

from pyspec.generation.driver import greedy_sampling  # noqa: E402
from pyspec.generation.engine import Engine  # noqa: E402
from pyspec.generation.requests import Request  # noqa: E402

TYPES = "none,ngram-simple,ngram-map-k,ngram-mod,ngram-cache,suffix,suffix+ngram-mod"

MODULE = '''\
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

RENAMES = [("items", "stock"), ("add_item", "put"), ("remove_item", "take"), ("total_count", "size"),
           ("report", "show"), ("count", "amount"), ("have", "held"), ("Inventory", "Store")]


def code_edit_trace(turns: int) -> list[str]:
    """Prompts of a code-editing session: the file so far and the next rename to make."""
    out, text = [], MODULE
    for old, new in RENAMES[:turns]:
        out.append(f"# inventory.py\n{text}\n# inventory.py, with `{old}` renamed to `{new}` everywhere:\n")
        text = text.replace(old, new)
    return out


TOOLS = ('Tools: read_file(path), write_file(path, content), run_tests(path), search(query).\n'
         'Answer with one JSON object per line: {"tool": NAME, "arguments": {...}}.\n')
CALLS = [
    ('read_file', {"path": "src/inventory.py"}, "class Inventory: ..."),
    ('search', {"query": "remove_item"}, "src/inventory.py:14, tests/test_inventory.py:22"),
    ('read_file', {"path": "tests/test_inventory.py"}, "def test_remove_item(): ..."),
    ('run_tests', {"path": "tests/test_inventory.py"}, "1 failed, 7 passed"),
    ('write_file', {"path": "src/inventory.py", "content": "..."}, "ok"),
    ('run_tests', {"path": "tests/test_inventory.py"}, "8 passed"),
    ('read_file', {"path": "src/report.py"}, "def report(inv): ..."),
    ('run_tests', {"path": "tests"}, "31 passed"),
]


def agent_trace(turns: int) -> list[str]:
    """Prompts of a tool-calling loop: the calls and results so far, then the next call to write."""
    out = []
    for k in range(turns):
        lines = [TOOLS, "Task: fix the failing inventory test.\n"]
        for tool, args, result in CALLS[: k + 1]:
            lines.append(json.dumps({"tool": tool, "arguments": args}) + "\n")
            lines.append(f"Result: {result}\n")
        lines.append("Next calls:\n")
        out.append("".join(lines))
    return out


def run_trace(engine: Engine, prompts: list[str], n_predict: int) -> dict[str, Any]:
    tokens: list[list[int]] = []
    n_drafts = n_drafted = n_accepted = n_gen = 0
    seconds = 0.0  # generation only (first token to the end): the prompts cost every type alike
    for prompt in prompts:
        out = engine.submit(Request(prompt=prompt, n_predict=n_predict)).result()
        st = out.stats
        seconds += st.t_gen_ms / 1e3
        tokens.append(list(out.tokens))
        n_gen += len(out.tokens)
        n_drafts += sum(1 for n, _ in st.drafts if n > 0)
        n_drafted += st.n_drafted
        n_accepted += st.n_accepted
    return {"tokens": tokens, "n_gen": n_gen, "n_drafts": n_drafts, "n_drafted": n_drafted,
            "n_accepted": n_accepted, "seconds": seconds,
            "mean_acceptance_length": 1 + n_accepted / n_drafts if n_drafts else None,
            "accepted_per_draft_token": n_accepted / n_drafted if n_drafted else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF file (default: the bundled Gemma 3 270M)")
    ap.add_argument("--types", default=TYPES, help="comma list; join types of one set with +")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--n-predict", "-n", type=int, default=96)
    ap.add_argument("--threads", "-t", type=int, default=2)
    ap.add_argument("--repeat", "-r", type=int, default=1, help="runs per type (speed: the median)")
    ap.add_argument("--fixed-draft", action="store_true", help="llama.cpp's fixed draft lengths")
    ap.add_argument("--batch-invariant", action="store_true", help="batch-invariant numerics (lossless)")
    ap.add_argument("--json", help="write the results to this file")
    args = ap.parse_args(argv)
    logging.getLogger("pyspec").setLevel(logging.ERROR)
    traces = {"code-edit": code_edit_trace(args.turns), "agent": agent_trace(args.turns)}
    results: dict[str, dict[str, Any]] = {}
    for types in args.types.split(","):
        for name, prompts in traces.items():
            runs = []
            for _ in range(args.repeat):
                print(f"bench_traces: {types} on {name} ...", file=sys.stderr, flush=True)
                with Engine.load(args.model, types=types.replace("+", ","), n_parallel=1, n_ctx=4096,
                                 n_threads=args.threads, n_max=16, adaptive_draft=not args.fixed_draft,
                                 batch_invariant=args.batch_invariant, sampling=greedy_sampling()) as eng:
                    eng.start()
                    runs.append(run_trace(eng, prompts, args.n_predict))
            r = dict(runs[0], seconds=statistics.median(x["seconds"] for x in runs))
            results.setdefault(name, {})[types] = r
    for name, per_type in results.items():
        plain = per_type.get("none")
        print(f"\n{name} ({args.turns} turns, {args.n_predict} tokens each)")
        print("type                  mean acc. length   accepted/drafted   drafts   tok/s   vs plain   = plain")
        for types, r in per_type.items():
            tps = r["n_gen"] / r["seconds"]
            rel = (tps / (plain["n_gen"] / plain["seconds"])) if plain else None
            same = "yes" if plain is None or r["tokens"] == plain["tokens"] else "NO"
            mal = r["mean_acceptance_length"]
            apd = r["accepted_per_draft_token"]
            print(f"{types:20s}  {'-' if mal is None else f'{mal:8.2f}':>16s}   "
                  f"{'-' if apd is None else f'{apd:8.2f}':>16s}   {r['n_drafts']:6d}  {tps:6.1f}   "
                  f"{'-' if rel is None else f'{rel:5.2f}x':>8s}   {same}")
    if args.json:
        Path(args.json).write_text(json.dumps({n: {t: {k: v for k, v in r.items() if k != "tokens"}
                                                   for t, r in pt.items()} for n, pt in results.items()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
