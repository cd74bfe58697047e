#!/usr/bin/env python3
"""What the safety guards cost on the hot path, measured side by side with another checkout.

    python scripts/bench_guards.py                                  # this checkout alone
    python scripts/bench_guards.py --baseline /path/to/main --baseline-libs /path/to/libs

Reports the median of --repeat runs, each in a fresh process, alternating between the
trees: (1) reading one logits row (this tree copies it, with ``out=`` reusing an array;
older trees returned a view), (2) a context call that only takes the guard
(memory.seq_pos_max), and (3) the Python driver's wall time per speculative step on the
tiny models (ngram-simple and draft-simple, greedy).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
from pyspec import Batch, Context, Model
from pyspec.common.params import CommonParamsSpeculative, CommonSpeculativeType as T
from pyspec.generation.driver import SpeculativeGenerator, greedy_sampling
from pyspec.testing import models as tm
import numpy as np

def per_call(fn, n):
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6

tgt = Model(tm.make_target()); dft = Model(tm.make_draft())
kw = dict(n_ctx=512, n_batch=64, n_ubatch=64, n_threads=1, n_threads_batch=1)
c = Context(tgt, **kw)
b = Batch(4); b.add_sequence([1, 2, 3, 4], 0, 0); c.decode(b)
out = {"row_us": per_call(lambda: c.get_logits_ith(-1), 3000),
       "guard_us": per_call(lambda: c.memory.seq_pos_max(0), 20000)}
try:
    buf = np.empty(c.n_vocab, np.float32)
    out["row_out_us"] = per_call(lambda: c.get_logits_ith(-1, out=buf), 3000)
except TypeError:
    pass
for name, t in (("ngram", T.NGRAM_SIMPLE), ("draft", T.DRAFT_SIMPLE)):
    p = CommonParamsSpeculative(types=[t])
    p.ngram_simple.size_n, p.ngram_simple.size_m = 2, 6
    p.draft.n_max = 4
    ctxd = Context(dft, **kw) if t == T.DRAFT_SIMPLE else None
    p.draft.ctx_dft = ctxd
    steps = 0
    t0 = time.perf_counter()
    with SpeculativeGenerator(c, p, greedy_sampling()) as g:
        for _ in range(6):
            g.generate(["def fib(n):\n    return fib(n - 1) + fib(n - 2)\n"], 64)
            steps += g.stats.n_steps
    out[f"{name}_step_us"] = (time.perf_counter() - t0) / steps * 1e6
    if ctxd is not None:
        ctxd.close()
print(json.dumps(out))
"""


def run(tree: Path, libs: str | None) -> dict[str, float]:
    env = dict(os.environ)
    if libs:
        env["PYSPEC_LIB_DIR"] = libs
    r = subprocess.run([sys.executable, "-c", PROBE, str(tree)], capture_output=True, text=True, env=env,
                       timeout=1800)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if not line:
        raise SystemExit(f"probe failed in {tree}: {r.stderr[-2000:]}")
    return json.loads(line[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", help="another checkout of pyspec (its sources are imported)")
    ap.add_argument("--baseline-libs", help="PYSPEC_LIB_DIR for the baseline")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    trees = [("this", ROOT, None)]
    if args.baseline:
        trees.append(("baseline", Path(args.baseline), args.baseline_libs))
    results: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in trees}
    for _ in range(args.repeat):
        for name, tree, libs in trees:
            results[name].append(run(tree, libs))
    keys = sorted({k for rs in results.values() for r in rs for k in r})
    print(f"median of {args.repeat} runs per tree, alternating (µs)")
    print(f"{'':16s}" + "".join(f"{name:>12s}" for name, _, _ in trees) + ("       ratio" if args.baseline else ""))
    for k in keys:
        med = [statistics.median([r[k] for r in results[name] if k in r]) if any(k in r for r in results[name])
               else float("nan") for name, _, _ in trees]
        ratio = f"{med[0] / med[1]:12.2f}" if args.baseline and med[1] == med[1] else ""
        print(f"{k:16s}" + "".join(f"{m:12.1f}" for m in med) + ratio)
    return 0


if __name__ == "__main__":
    sys.exit(main())
