#!/usr/bin/env python3
"""The draft-length policies on recorded generations and simulated machines: a deterministic, load-free check.

``record`` runs plain greedy decoding once per prompt (the bench's built-in prompts and the
set below: code, prose, repetitive text, chat) and writes each prompt's tokens and the
target's (a trace). ``run`` replays every trace through every policy (plain decoding,
llama.cpp's fixed lengths, fixed lengths capped at 1..8, the cost-aware controller) with
the real n-gram implementations, on each machine profile
(:class:`pyspec.generation.draft_replay.Machine`: a verify-cost curve as measured by
scripts/verify_cost.py, the draft call's and the loop's own costs, what the start-up
calibration reads, a load, a jitter), and prints per prompt the cost-aware controller
against max(plain, fixed) and against the best fixed length in hindsight (the oracle),
then the worst prompt and the median over the prompts where drafting pays.

    python scripts/draft_length_sim.py record --out /tmp/gemma.json -n 128
    python scripts/draft_length_sim.py record --tiny --out /tmp/tiny.json -n 128
    python scripts/draft_length_sim.py run --traces /tmp/gemma.json --machines gemma-2t,gemma-1t
    python scripts/draft_length_sim.py run --traces /tmp/tiny.json --machines tiny-1t --types ngram-mod -v
    python scripts/draft_length_sim.py run --traces /tmp/gemma.json --set GUARD_MARGIN=0.1 --set "PRIOR=(0.6, 0.85)"
    python scripts/draft_length_sim.py prompts --out /tmp/prompts.txt   # the same prompts for pyspec bench -f

Everything here is exact and repeatable: tokens per second on a modelled clock, not a
measured one (what the replay leaves out: pyspec/generation/draft_replay.py's docstring).
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

from pyspec.cli.bench import BUILTIN_PROMPTS, run_once  # noqa: E402
from pyspec.common.params import CommonSpeculativeType as T  # noqa: E402
from pyspec.generation.contexts import load_models, parse_types  # noqa: E402
from pyspec.generation.draft_replay import (  # noqa: E402
    Machine,
    PromptResult,
    Trace,
    compare,
    controller_settings,
    parse_setting,
    policies,
)

TYPES = "ngram-simple,ngram-map-k,ngram-map-k4v,ngram-mod,ngram-cache"
# the bench's n-gram settings (pyspec bench's --ngram-n / --ngram-m defaults)
SPEC_KW: dict[str, Any] = {"ngram_n": 3, "ngram_m": 8}

# ours, made for this check: code, prose, lists, data, and chat turns in Gemma's template
PROMPTS: tuple[str, ...] = (
    "def binary_search(items, target):\n    lo, hi = 0, len(items) - 1\n    while lo <= hi:\n",
    "struct point { int x; int y; };\n\nint dot(struct point a, struct point b) {\n    return a.x * b.x",
    "SELECT id, name FROM customers WHERE country = 'FR';\nSELECT id, name FROM customers WHERE country =",
    "for (let i = 0; i < rows.length; i++) {\n  for (let j = 0; j < rows[i].length; j++) {\n",
    "class Queue:\n    def __init__(self):\n        self.items = []\n\n    def enqueue(self, x):\n"
    "        self.items.append(x)\n\n    def dequeue(self):\n",
    "The river wound slowly through the valley, past farms and orchards, until it reached",
    "In the winter of that year the mountain roads were closed, and the villagers",
    "A good night's sleep matters because",
    "The history of the printing press begins in",
    "Step 1: Open the lid.\nStep 2: Pour the water.\nStep 3: Close the lid.\nStep 4:",
    "red, green, blue, red, green, blue, red, green,",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "- apples: 3\n- pears: 5\n- plums: 2\n- apples: 3\n- pears:",
    "id,value\n1,10\n2,20\n3,30\n4,40\n",
    '[{"id": 1, "ok": true}, {"id": 2, "ok": false}, {"id": 3, "ok":',
    "<start_of_turn>user\nWrite a Python function that reverses a string.<end_of_turn>\n<start_of_turn>model\n",
    "<start_of_turn>user\nWhat is the capital of Spain?<end_of_turn>\n<start_of_turn>model\n",
    "<start_of_turn>user\nList five fruits, one per line.<end_of_turn>\n<start_of_turn>model\n",
    "<start_of_turn>user\nExplain what a hash table is in two sentences.<end_of_turn>\n<start_of_turn>model\n",
    "<start_of_turn>user\nRepeat the word 'hello' ten times.<end_of_turn>\n<start_of_turn>model\n",
)

MS = 1e-3
# Machine profiles: the verify cost, c(1) in ms and c(b) / c(1); the n-gram draft call (per call, per token)
# and the loop's own time (per step, per verified row), in ms.
# gemma-2t: the quiet 2-core machine of issue 28's brief (c(1) 12.2 ms: 2 rows 1.94, 3 3.27, 5 3.93,
#   9 5.24, 17 7.63); gemma-2t-b: docs/performance.md's quiet run (14.4 ms); gemma-2t-slow: its earlier
#   machine, where a decode cost twice as much and a batch relatively less (26.1 ms: 2 rows 1.37, 3 1.62,
#   5 2.67, 9 3.47, 17 5.50); gemma-1t: 1 thread on a loaded machine (scripts/verify_cost.py, 41.1 ms; the
#   step after every 4 rows makes 4 rows cheaper than 3); gemma-2t-flat: a 2-core Xeon with AVX-512 and AMX
#   (scripts/verify_cost.py, 2026-12-07, 20.9 ms), where a decode costs more and a batch much less;
#   gemma-2t-saw: the same machine measured at every size up to 34 (2026-12-07, 23.4 ms): a batch of an even
#   number of rows costs 0.3-0.9 decodes less than the odd one below it (8 rows 2.80, 9 rows 3.65).
#   The loop's own time (0.32 ms a step, 0.067 ms a verified row: sampling a 262k-entry row) and the
#   draft call (8 us a token) are the controller's fits from generation steps (1 thread, loaded).
# tiny-1t: the cyclic tiny model, 1 thread, from generation steps on a loaded machine (c(1) 0.34 ms; a
#   step's own time, 0.02 ms + 0.055 ms a row, is as large as its decode).
_PROFILES = {
    "gemma-2t": (12.2, {1: 1.0, 2: 1.94, 3: 3.27, 5: 3.93, 9: 5.24, 17: 7.63}, (0.0, 0.008), (0.32, 0.067)),
    "gemma-2t-b": (14.4, {1: 1.0, 2: 1.92, 3: 2.46, 4: 2.55, 5: 3.83, 9: 5.28, 17: 7.23}, (0.0, 0.008),
                   (0.32, 0.067)),
    "gemma-2t-slow": (26.1, {1: 1.0, 2: 1.37, 3: 1.62, 5: 2.67, 9: 3.47, 17: 5.50}, (0.0, 0.008), (0.32, 0.067)),
    "gemma-1t": (41.1, {1: 1.0, 2: 2.26, 3: 4.06, 4: 3.33, 5: 4.97, 7: 5.88, 9: 6.70, 13: 8.46, 17: 10.41},
                 (0.0, 0.008), (0.32, 0.067)),
    "gemma-2t-flat": (20.9, {1: 1.0, 2: 1.14, 3: 1.84, 4: 1.59, 5: 2.33, 7: 2.82, 9: 3.32, 13: 4.17, 17: 5.00},
                      (0.0, 0.008), (0.32, 0.067)),
    "gemma-2t-saw": (23.4, {1: 1.0, 2: 1.24, 3: 2.06, 4: 1.81, 5: 2.61, 6: 2.32, 7: 3.07, 8: 2.80, 9: 3.65, 10: 3.21,
                            11: 3.99, 12: 3.70, 13: 4.54, 14: 4.14, 15: 4.94, 16: 4.48, 17: 5.45, 18: 4.97, 19: 5.92,
                            20: 5.45, 21: 6.32, 22: 5.91, 23: 6.69, 24: 6.41, 25: 7.22, 26: 6.74, 27: 7.67, 28: 7.22,
                            29: 7.93, 30: 7.67, 31: 8.43, 32: 8.08, 33: 9.07, 34: 8.56, 40: 9.76, 41: 10.65,
                            48: 11.36, 49: 12.43, 64: 15.73, 65: 17.01},
                    (0.0, 0.008), (0.32, 0.067)),
    "tiny-1t": (0.343, {1: 1.0, 2: 1.02, 3: 1.21, 4: 1.70, 5: 1.95, 6: 4.48, 7: 6.1, 9: 7.67}, (0.0, 0.002),
                (0.02, 0.055)),
}


def machine(name: str) -> Machine:
    """A named profile; suffixes: ``+cal`` (the start-up calibration reads the issue's too-steep curve: 2 rows
    2.55, 3 3.79, 9 5.73), ``+load`` (everything 1.8x slower from the 32nd token on), ``+jitter`` (15% per part)."""
    base, *mods = name.split("+")
    if base not in _PROFILES:
        raise SystemExit(f"unknown machine {base!r} (known: {', '.join(_PROFILES)})")
    c1, rel, (d0, d1), (o0, o1) = _PROFILES[base]
    verify = {b: c1 * r * MS for b, r in rel.items()}
    kw: dict[str, Any] = {}
    for m in mods:
        if m == "cal":
            kw["calibration"] = {b: c1 * r * MS for b, r in {1: 1.0, 2: 2.55, 3: 3.79, 9: 5.73, 17: 8.5}.items()}
        elif m == "load":
            kw["load"] = [(32, 1.8)]
        elif m == "jitter":
            kw["jitter"] = 0.15
        else:
            raise SystemExit(f"unknown machine modifier {m!r} (cal, load, jitter)")
    # the graph built again for another batch shape (scripts: 1 thread, 0.087 ms on the tiny model, 1.3 ms
    # on Gemma: about a quarter and a twentieth of a one-token decode)
    switch = c1 * MS * (0.25 if base.startswith("tiny") else 0.05)
    return Machine(verify, (d0 * MS, d1 * MS), (o0 * MS, o1 * MS), name=name, switch=switch, **kw)


def cmd_record(args: argparse.Namespace) -> int:
    prompts = list(BUILTIN_PROMPTS) + list(PROMPTS)
    model = None
    if args.tiny:
        from pyspec.testing.models import tiny_model_paths

        model = tiny_model_paths([T.NGRAM_SIMPLE])[0]
    traces = []
    ctx_kw = {"n_ctx": 2048, "n_batch": 512, "n_seq": 1, "n_threads": args.threads}
    with load_models([T.NONE], model=args.model or model, batch_invariant=args.batch_invariant) as models:
        for i, p in enumerate(prompts):
            res, _ = run_once(models, [T.NONE], "python", p, args.n_predict, {}, ctx_kw)
            traces.append({"name": f"p{i + 1}", "prompt": list(res.prompt_tokens), "target": list(res.tokens)})
            print(f"recorded p{i + 1}: {len(res.prompt_tokens)} + {len(res.tokens)} tokens", file=sys.stderr)
    Path(args.out).write_text(json.dumps({"model": str(models.target.path), "traces": traces}) + "\n")
    return 0


def cmd_prompts(args: argparse.Namespace) -> int:
    """The prompts as a ``pyspec bench --prompt-file`` (a JSON list: the texts exactly, trailing newlines too)."""
    Path(args.out).write_text(json.dumps([*BUILTIN_PROMPTS, *PROMPTS], indent=1) + "\n")
    return 0


def read_traces(path: str) -> list[Trace]:
    data = json.loads(Path(path).read_text())
    return [Trace(t["prompt"], t["target"], t["name"]) for t in data["traces"]]


def summarise(results: list[PromptResult], verbose: bool) -> tuple[float, float, float, float]:
    """(worst ratio to max(plain, fixed), median of it where drafting pays, worst and median ratio to the oracle)."""
    vs_best = [r.tps["cost-aware"] / r.best_of_plain_fixed for r in results]
    vs_oracle = [r.tps["cost-aware"] / r.oracle[1] for r in results]
    pays = [v for r, v in zip(results, vs_best, strict=True) if r.oracle[1] > r.tps["plain"] * 1.02]
    if verbose:
        for r, vb, vo in zip(results, vs_best, vs_oracle, strict=True):
            on, ov = r.oracle
            flag = "  <" if vb < 0.98 else ""
            print(f"    {r.name:<5} plain {r.tps['plain']:8.1f}  fixed {r.ratio('fixed'):5.2f}x  "
                  f"oracle {on:>5} {ov / r.tps['plain']:5.2f}x  cost-aware {r.ratio('cost-aware'):5.2f}x  "
                  f"vs max(plain, fixed) {vb:5.2f}  vs oracle {vo:5.2f}{flag}")
    return (min(vs_best), statistics.median(pays) if pays else float("nan"), min(vs_oracle),
            statistics.median(vs_oracle))


def cmd_run(args: argparse.Namespace) -> int:
    logging.getLogger("pyspec").setLevel(logging.ERROR)
    traces = read_traces(args.traces)
    if args.n_predict:
        traces = [Trace(t.prompt, t.target[: args.n_predict], t.name) for t in traces]
    try:
        for item in args.set or []:
            parse_setting(item)
    except ValueError as e:
        raise SystemExit(f"--set: {e}") from None
    with controller_settings(args.set or []):  # an experiment: the controller's constants changed
        return _run(args, traces)


def _run(args: argparse.Namespace, traces: list[Trace]) -> int:
    seeds = range(args.seeds)
    print("machine / type: cost-aware tok/s over max(plain, fixed): worst prompt, median where drafting pays; "
          "over the oracle (best fixed length per prompt): worst, median")
    failed = 0
    cells: list[float] = []  # every (machine, type, prompt): cost-aware over max(plain, fixed)
    for mname in args.machines.split(","):
        m = machine(mname)
        for tname in args.types.split(","):
            res = compare(traces, parse_types(tname), m, spec_kw=SPEC_KW, pols=policies(), seeds=seeds)
            worst, med, worst_o, med_o = summarise(res, args.verbose)
            cells += [r.tps["cost-aware"] / r.best_of_plain_fixed for r in res]
            ok = worst >= 0.98 and (med != med or med >= 1.03) and worst_o >= 0.95
            failed += not ok
            print(f"  {mname:<22} {tname:<14} worst {worst:5.2f}  median {med:5.2f}   oracle: worst {worst_o:5.2f}  "
                  f"median {med_o:5.2f}{'' if ok else '   SHORT'}")
    print(f"all {len(cells)} cells: geometric mean {statistics.geometric_mean(cells):.4f}, "
          f"{sum(c < 0.98 for c in cells)} under 0.98, lowest {min(cells):.2f}")
    return 1 if failed and args.strict else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("record", help="plain greedy runs: the traces")
    p.add_argument("--out", required=True)
    p.add_argument("--model", help="GGUF file (default: the bundled Gemma 3 270M)")
    p.add_argument("--tiny", action="store_true", help="the tiny cyclic test model")
    p.add_argument("--n-predict", "-n", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch-invariant", action="store_true")
    p.set_defaults(func=cmd_record)
    p = sub.add_parser("prompts", help="write the prompts as a pyspec bench --prompt-file")
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_prompts)
    p = sub.add_parser("run", help="every policy on every trace and machine")
    p.add_argument("--traces", required=True)
    p.add_argument("--machines", default="gemma-2t,gemma-2t-b,gemma-2t-slow,gemma-1t,gemma-2t+cal,gemma-2t+load+jitter")
    p.add_argument("--types", default=TYPES)
    p.add_argument("--n-predict", "-n", type=int, default=0, help="replay only the first N tokens of each trace")
    p.add_argument("--seeds", type=int, default=1, help="jitter draws per policy (the median is kept)")
    p.add_argument("--verbose", "-v", action="store_true", help="every prompt")
    p.add_argument("--strict", action="store_true", help="exit 1 when a row falls short of the issue's figures")
    p.add_argument("--set", action="append", metavar="NAME=VALUE",
                   help="an experiment: a DraftLengthController constant changed (e.g. GUARD_MIN=1e9, "
                        "PRIOR='(0.6, 0.85)'); repeatable")
    p.set_defaults(func=cmd_run)
    args = ap.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
