#!/usr/bin/env python3
"""What batch-invariant mode costs: tokens per second in it over the default numerics, plain and per type.

Loads the model twice (default numerics: repacked weights, tiled attention;
batch-invariant mode) and runs plain decoding and each type on both,
interleaved (repeats outermost, then prompts, types, modes), on fresh contexts,
greedy; prints, per type and engine, the median tokens per second of each mode
and their ratio (median over repeats of the paired ratio).

    python scripts/batch_invariant_cost.py --threads 2 -n 128 --repeat 5
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

TYPES = "none,ngram-simple,ngram-map-k,ngram-map-k4v,ngram-mod,ngram-cache,draft-simple"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default=TYPES)
    ap.add_argument("--engines", default="python", help="python (cost-aware draft length) and/or fixed")
    ap.add_argument("--n-predict", "-n", type=int, default=128)
    ap.add_argument("--repeat", "-r", type=int, default=5)
    ap.add_argument("--n-prompts", type=int, default=len(BUILTIN_PROMPTS))
    ap.add_argument("--threads", "-t", type=int, default=2)
    ap.add_argument("--json", help="write the runs to this file")
    args = ap.parse_args(argv)
    logging.getLogger("pyspec").setLevel(logging.ERROR)

    type_sets = [parse_types(x) for x in args.types.split(",")]
    engines = [e for e in args.engines.split(",") if e]
    prompts = list(BUILTIN_PROMPTS[: args.n_prompts])
    spec_kw = {"n_max": 8, "ngram_n": 3, "ngram_m": 8}
    ctx_kw = {"n_ctx": 2048, "n_batch": 512, "n_threads": args.threads}
    all_types = sorted({t for ts in type_sets for t in ts} | {T.DRAFT_SIMPLE})
    runs: list[dict[str, Any]] = []
    with load_models(all_types) as default, load_models(all_types, batch_invariant=True) as invariant:
        modes = {"default": default, "invariant": invariant}
        for ms in modes.values():  # warm-up: page the weights in
            run_once(ms, [T.NONE], "python", prompts[0], 8, spec_kw, ctx_kw)
        for rep in range(args.repeat):
            for ip, prompt in enumerate(prompts):
                for types in type_sets:
                    for engine in engines if types != [T.NONE] else engines[:1]:
                        for mode, ms in modes.items():
                            _res, st = run_once(ms, types, engine, prompt, args.n_predict, spec_kw, ctx_kw)
                            key = "+".join(t.name.lower() for t in types)
                            runs.append({"type": key, "engine": engine, "mode": mode, "prompt": ip, "repeat": rep,
                                         "tps": st.gen_tps, "t_gen_s": st.t_gen_s, "n": st.n_gen_tokens})
                            print(f"repeat {rep + 1} prompt {ip + 1} {key:<14} {engine:<6} {mode:<9} "
                                  f"{st.gen_tps:7.1f} tok/s", file=sys.stderr, flush=True)

    def tps(sel: list[dict[str, Any]]) -> float:
        t = sum(r["t_gen_s"] for r in sel)
        return sum(r["n"] for r in sel) / t if t > 0 else 0.0

    print(f"{args.n_predict} tokens x {len(prompts)} prompts, {args.threads} thread(s), median of {args.repeat}")
    print(f"{'type':<16} {'engine':<7} {'default tok/s':>13} {'invariant tok/s':>15} {'ratio':>6}")
    for types in type_sets:
        key = "+".join(t.name.lower() for t in types)
        for engine in engines if types != [T.NONE] else engines[:1]:
            per = {m: [tps([r for r in runs if r["type"] == key and r["engine"] == engine and r["mode"] == m
                            and r["repeat"] == k]) for k in range(args.repeat)] for m in ("default", "invariant")}
            ratios = [b / a for a, b in zip(per["default"], per["invariant"], strict=True) if a > 0]
            print(f"{key:<16} {engine:<7} {statistics.median(per['default']):13.1f} "
                  f"{statistics.median(per['invariant']):15.1f} {statistics.median(ratios):6.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
