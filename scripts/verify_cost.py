#!/usr/bin/env python3
"""The target's verify-cost curve c(b), measured apart from the generation loop, beside the controller's own.

For each numerics mode (default; batch-invariant) and thread count, on a context
that holds a real prompt (as a verify step finds it), it decodes batches of b
tokens with every row's logits requested at the prompt's end and removes them
again: a warm-up of each shape first, then ``--repeat`` rounds that visit the
sizes in turn (so a load change hits every size alike). It prints the median
milliseconds of each b, c(b) / c(1), and beside it the curve the cost-aware
controller calibrates at start-up (``CostCurve.calibrate``: 3 decodes per size on
an empty sequence) on a fresh context of the same settings.

    python scripts/verify_cost.py --threads 1,2 --repeat 30
    python scripts/verify_cost.py --model model.gguf --sizes 1,2,4,8,16 --json curve.json
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

_repo = Path(__file__).resolve().parents[1]
if (_repo / "pyspec" / "lib").is_dir() and any((_repo / "pyspec" / "lib").glob("libllama*")):
    sys.path.insert(0, str(_repo))

from pyspec.cli.bench import BUILTIN_PROMPTS  # noqa: E402
from pyspec.core.batch import Batch  # noqa: E402
from pyspec.core.context import Context  # noqa: E402
from pyspec.core.model import Model  # noqa: E402
from pyspec.generation.contexts import default_model_path  # noqa: E402
from pyspec.generation.draft_length import CALIBRATION_SIZES, CostCurve  # noqa: E402


def measure(ctx: Context, prompt: list[int], sizes: list[int], repeat: int) -> dict[int, list[float]]:
    """Seconds of each decode of b tokens after ``prompt``, ``repeat`` per size, sizes interleaved."""
    batch = Batch(max(len(prompt), max(sizes)), 0, 1)
    for i, tok in enumerate(prompt):
        batch.add(tok, i, 0, i == len(prompt) - 1)
    ctx.decode(batch)
    p0 = len(prompt)
    tok = prompt[-1]
    mem = ctx.memory
    out: dict[int, list[float]] = {b: [] for b in sizes}
    for r in range(repeat + 2):  # two warm-up rounds: each shape's graph and buffers
        for b in sizes:
            batch.clear()
            for i in range(b):
                batch.add(tok, p0 + i, 0, True)
            t0 = time.perf_counter()
            ctx.decode(batch)
            dt = time.perf_counter() - t0
            mem.seq_rm(0, p0, -1)
            if r >= 2:
                out[b].append(dt)
    return out


def run(model: Model, threads: int, sizes: list[int], repeat: int, prompt_text: str) -> dict[str, Any]:
    kw = dict(n_ctx=2048, n_batch=512, n_threads=threads, n_threads_batch=threads)
    with Context(model, **kw) as ctx:
        prompt = model.vocab.tokenize(prompt_text, add_special=True)
        times = measure(ctx, prompt, sizes, repeat)
    with Context(model, **kw) as ctx:
        curve = CostCurve().calibrate(ctx)
    med = {b: statistics.median(v) for b, v in times.items()}
    q = {b: statistics.quantiles(v, n=4) if len(v) >= 2 else [v[0], v[0], v[0]] for b, v in times.items()}
    return {
        "threads": threads,
        "batch_invariant": model.batch_invariant,
        "prompt_tokens": len(prompt),
        "micro_ms": {b: med[b] * 1e3 for b in sizes},
        "micro_iqr_ms": {b: [q[b][0] * 1e3, q[b][2] * 1e3] for b in sizes},
        "micro_relative": {b: med[b] / med[sizes[0]] for b in sizes},
        "controller_relative": curve.relative(),
        "controller_ms": {b: c * 1e3 for b, c in curve.as_dict().items()},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF file (default: the bundled Gemma 3 270M)")
    ap.add_argument("--threads", default="1,2", help="comma list of thread counts")
    ap.add_argument("--sizes", default=",".join(map(str, CALIBRATION_SIZES)), help="batch sizes; the first is the unit")
    ap.add_argument("--repeat", "-r", type=int, default=30)
    ap.add_argument("--modes", default="default,invariant")
    ap.add_argument("--json", help="write the results to this file")
    args = ap.parse_args(argv)
    logging.getLogger("pyspec").setLevel(logging.ERROR)
    path = args.model or default_model_path()
    sizes = sorted({int(s) for s in args.sizes.split(",")})
    results = []
    for mode in args.modes.split(","):
        with Model(path, batch_invariant=(mode == "invariant")) as model:
            for t in (int(x) for x in args.threads.split(",")):
                print(f"verify_cost: {mode}, {t} threads ...", file=sys.stderr, flush=True)
                res = run(model, t, sizes, args.repeat, BUILTIN_PROMPTS[0])
                res["mode"] = mode
                results.append(res)
                print(f"\n{mode} numerics, {t} threads, after a {res['prompt_tokens']}-token prompt "
                      f"({args.repeat} decodes per size; c(1) = {res['micro_ms'][sizes[0]]:.2f} ms)")
                print("   b   median ms   (IQR)            c(b)/c(1)   controller c(b)/c(1)")
                for b in sizes:
                    lo, hi = res["micro_iqr_ms"][b]
                    ctrl = res["controller_relative"].get(b)
                    ctrl_s = f"{ctrl:8.2f}" if ctrl is not None else "       -"
                    print(f"{b:4d}   {res['micro_ms'][b]:8.2f}   ({lo:6.2f}-{hi:6.2f})   "
                          f"{res['micro_relative'][b]:8.2f}    {ctrl_s}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
