#!/usr/bin/env python3
"""Mean accepted length: rejection sampling against exact match (pyspec.generation.rejection; not part of CI).

For each speculative type, temperature and acceptance, the same prompts are generated with the same seeds
through the Engine (fixed draft lengths, so that the lengths compare), and the table gives per type and
temperature the mean accepted length (vLLM's: 1 + accepted draft tokens per verified draft) and the share of
drafted tokens accepted, for "exact" (llama.cpp's rule) and "rejection".

Types: draft-simple, draft-eagle3 and draft-mtp on the tiny models (pyspec.testing.models) by default;
``--real`` adds draft-simple on Gemma 3 270M (contexts.default_model_path()) with the model as its own draft
(draft = target: the upper bound, where rejection sampling accepts every token).

    .venv/bin/python scripts/rejection_bench.py
    .venv/bin/python scripts/rejection_bench.py --temps 0.5,0.8,1.0 --n-predict 64 --prompts 6 --real
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pyspec.common.params import CommonParamsSampling
from pyspec.generation.contexts import default_model_path, parse_types
from pyspec.generation.engine import Engine
from pyspec.generation.requests import Request
from pyspec.testing import models as tm

PROMPTS = [
    "The quick brown fox jumps over the lazy dog because",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "Q: What is the capital of France?\nA:",
    "import numpy as np\nx = np.arange(10)\n",
    "In 1969, the first humans landed on",
    "List of fruits: apple, banana,",
]


def run(types: str, target: Path, draft: Path | None, temp: float, acceptance: str, prompts: list[str],
        n_predict: int, n_max: int) -> tuple[int, int, int]:
    """(drafts verified, drafted tokens, accepted tokens) over the prompts."""
    with Engine.load(target, types=types, draft=draft, n_ctx=512, n_max=n_max, adaptive_draft=False,
                     acceptance=acceptance, n_threads=2) as eng:
        n_drafts = n_drafted = n_acc = 0
        for i, prompt in enumerate(prompts):
            h = eng.submit(Request(prompt=prompt, n_predict=n_predict,
                                   sampling=CommonParamsSampling(temp=temp, seed=1000 + i)))
            eng.run_until_idle()
            st = h.result().stats
            n_drafts += sum(1 for n, _ in st.drafts if n > 0)
            n_drafted += st.n_drafted
            n_acc += st.n_accepted
    return n_drafts, n_drafted, n_acc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--temps", default="0.5,0.8,1.0")
    ap.add_argument("--types", default="draft-simple,draft-eagle3,draft-mtp")
    ap.add_argument("--n-predict", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n-max", type=int, default=4, help="draft length (fixed)")
    ap.add_argument("--real", action="store_true", help="also draft-simple on Gemma 3 270M, draft = target")
    args = ap.parse_args()
    temps = [float(t) for t in args.temps.split(",")]
    prompts = PROMPTS[: args.prompts]
    setups: list[tuple[str, str, Path, Path | None]] = []
    for types in args.types.split(","):
        target, draft = tm.tiny_model_paths(parse_types(types))
        setups.append((f"{types} (tiny)", types, target, draft))
    if args.real:
        real = default_model_path()
        setups.append(("draft-simple (270M, draft = target)", "draft-simple", real, real))

    print(f"n_max {args.n_max}, {len(prompts)} prompts x {args.n_predict} tokens, seeds fixed")
    print(f"{'type':38} {'T':>4} | {'exact: mean len':>15} {'acc %':>6} | {'rejection: mean len':>19} "
          f"{'acc %':>6} | {'gain':>6}")
    for label, types, target, draft in setups:
        for temp in temps:
            row = []
            for acceptance in ("exact", "rejection"):
                n_drafts, n_drafted, n_acc = run(types, target, draft, temp, acceptance, prompts, args.n_predict,
                                                 args.n_max)
                row.append((1 + n_acc / max(1, n_drafts), 100 * n_acc / max(1, n_drafted)))
            (le, ae), (lr, ar) = row
            print(f"{label:38} {temp:4.1f} | {le:15.3f} {ae:6.1f} | {lr:19.3f} {ar:6.1f} | {lr / le:5.2f}x",
                  flush=True)


if __name__ == "__main__":
    main()
