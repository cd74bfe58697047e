#!/usr/bin/env python3
"""The target's verify-cost curve c(b), measured apart from the generation loop, beside the controller's own.

For each numerics mode (default; batch-invariant) and thread count, on a context
that holds a real prompt (as a verify step finds it), it decodes batches of b
tokens with every row's logits requested at the prompt's end and removes them
again: a warm-up of each shape first, then ``--repeat`` rounds that visit the
sizes in turn (so a load change hits every size alike). It prints the median
milliseconds of each b, c(b) / c(1), and beside it the two curves the cost-aware
controller holds: the one it calibrates at start-up (``CostCurve.calibrate``: 5
decodes per size after a 64-token history) on a fresh context of the same settings,
and the one generation steps measure (greedy ngram-simple generations of the first
prompt with llama.cpp's fixed lengths, drafts of at most 1, 2, 4, 8 and 16 tokens:
each verify step's decode, as the controller records it, on a curve of its own).

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
from pyspec.common.params import CommonSpeculativeType as T  # noqa: E402
from pyspec.core.batch import Batch  # noqa: E402
from pyspec.core.context import Context  # noqa: E402
from pyspec.core.model import Model  # noqa: E402
from pyspec.generation.contexts import default_model_path, spec_params  # noqa: E402
from pyspec.generation.draft_length import (  # noqa: E402
    CALIBRATION_SIZES,
    CostCurve,
    DraftLengthController,
)
from pyspec.generation.driver import SpeculativeGenerator, greedy_sampling  # noqa: E402


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
    used = used_curve(model, kw, prompt_text)
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
        "steps_relative": used.relative() if used.ready else {},
        "steps_n": {b: used.n_used(b) for b in used.sizes()},
    }


def used_curve(model: Model, kw: dict[str, Any], prompt_text: str, n_predict: int = 48) -> CostCurve:
    """The verify cost as generation steps measure it: fixed-length ngram-simple generations with drafts of at
    most 1, 2, 4, 8 and 16 tokens record each step's decode on one fresh curve (no start-up calibration)."""
    import warnings

    curve = CostCurve()
    for m in (1, 2, 4, 8, 16):
        spec = spec_params([T.NGRAM_SIMPLE], ngram_n=2, ngram_m=m)
        ctl = DraftLengthController(fixed=True, curve=curve)
        with Context(model, **kw) as ctx, warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            with SpeculativeGenerator(ctx, spec, greedy_sampling(), draft_controller=ctl) as gen:
                gen.generate([prompt_text], n_predict)
    return curve


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
                print("   b   median ms   (IQR)            c(b)/c(1)   controller c(b)/c(1):  calibrated  "
                      "generation steps (n)")
                for b in sorted(set(sizes) | set(res["steps_relative"])):
                    ctrl = res["controller_relative"].get(b)
                    ctrl_s = f"{ctrl:8.2f}" if ctrl is not None else "       -"
                    step = res["steps_relative"].get(b)
                    step_s = f"{step:8.2f} ({res['steps_n'][b]})" if step is not None else "       -"
                    if b in res["micro_ms"]:
                        lo, hi = res["micro_iqr_ms"][b]
                        micro = f"{res['micro_ms'][b]:8.2f}   ({lo:6.2f}-{hi:6.2f})   {res['micro_relative'][b]:8.2f}"
                    else:
                        micro = f"{'-':>8}   {'':15}   {'-':>8}"
                    print(f"{b:4d}   {micro}                 {ctrl_s}   {step_s}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
