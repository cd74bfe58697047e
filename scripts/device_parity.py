"""Greedy parity and speed of one device against the CPU: the smoke test of a GPU build.

    python scripts/device_parity.py --device Vulkan0      # on lavapipe (scripts/vulkan_check.sh)
    python scripts/device_parity.py --device CUDA0        # on a GPU (scripts/gpu_check.sh)

Runs the real model (Gemma 3 270M from its PyPI package; the tiny test model with
--tiny or when the package is missing) twice, with every layer on ``--device`` and
with every layer on the CPU, both without weight repacking: plain greedy decoding of
each prompt, then the speculative driver with the types of ``--types`` (llama.cpp's fixed draft
lengths, so both sides verify the same batches). Prints, per
run, whether the tokens are identical, the first position where they differ, and
tokens/s on each side (medians of ``--repeat`` runs, measured side by side).
Exits 1 when a plain greedy run differs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pyspec import Batch, Context, Model
from pyspec.errors import MissingModelPackage
from pyspec.generation.contexts import default_model_path, load_models, open_contexts, parse_types, spec_params
from pyspec.generation.driver import generate
from pyspec.testing import models as tm

PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The three laws of thermodynamics are",
    "import numpy as np\n\ndef softmax(x):\n",
]


def greedy(ctx: Context, prompt: list[int], n: int) -> tuple[list[int], float]:
    """Plain greedy decoding, one token per decode: the tokens and tokens/s after the prompt."""
    import numpy as np

    ctx.memory.clear()
    b = Batch(max(len(prompt), 1), 0, 1)
    for i, t in enumerate(prompt):
        b.add(t, i, 0, i == len(prompt) - 1)
    ctx.decode(b)
    out, pos = [], len(prompt)
    t0 = time.perf_counter()
    for _ in range(n):
        tok = int(np.argmax(ctx.get_logits_ith(-1)))
        out.append(tok)
        b.clear()
        b.add(tok, pos, 0, True)
        ctx.decode(b)
        pos += 1
    return out, n / (time.perf_counter() - t0)


def first_difference(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return -1 if len(a) == len(b) else min(len(a), len(b))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", required=True, help="device name, e.g. Vulkan0, CUDA0")
    ap.add_argument("--n-predict", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--types", default="ngram-cache,draft-simple")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: all)")
    ap.add_argument("--tiny", action="store_true", help="use the tiny test model")
    ap.add_argument("--flash-attn", choices=["auto", "enabled", "disabled"], default="auto",
                    help="both sides (lavapipe: disabled; its compiler takes over 15 minutes on Gemma's "
                         "one-token flash-attention shader)")
    args = ap.parse_args()

    path: Path
    if args.tiny:
        path = tm.make_cyclic_target()
    else:
        try:
            path = default_model_path()
        except MissingModelPackage as e:
            print(f"device_parity: {e}; using the tiny model", file=sys.stderr)
            path = tm.make_cyclic_target()
    sides: dict[str, dict[str, Any]] = {
        "cpu": {"devices": []},
        args.device: {"devices": [args.device], "n_gpu_layers": -1},
    }
    threads: dict[str, int] = {}
    if args.threads is not None:
        threads = {"n_threads": args.threads, "n_threads_batch": args.threads}
    print(f"device_parity: {path.name}, {args.device} against the CPU, greedy, n_predict {args.n_predict}, "
          f"median of {args.repeat}, flash attention {args.flash_attn}", flush=True)
    worst = 0
    models = {k: Model(path, use_extra_bufts=False, **kw) for k, kw in sides.items()}
    try:
        ctxs = {k: Context(m, n_ctx=1024, n_batch=256, flash_attn_type=args.flash_attn, **threads)
                for k, m in models.items()}
        for p_i, text in enumerate(PROMPTS):
            prompt = models["cpu"].vocab.tokenize(text, add_special=True)
            toks: dict[str, list[int]] = {}
            tps: dict[str, list[float]] = {k: [] for k in sides}
            for _ in range(args.repeat):
                for k, c in ctxs.items():  # side by side, alternating
                    toks[k], rate = greedy(c, prompt, args.n_predict)
                    tps[k].append(rate)
            diff = first_difference(toks["cpu"], toks[args.device])
            worst = max(worst, 1 if diff >= 0 else 0)
            print(f"  plain, prompt {p_i}: {'identical' if diff < 0 else f'differs from token {diff}'}; "
                  + ", ".join(f"{k} {statistics.median(v):.1f} tok/s" for k, v in tps.items()), flush=True)
        for c in ctxs.values():
            c.close()
    finally:
        for m in models.values():
            m.close()

    for name in [t for t in args.types.split(",") if t]:
        ts = parse_types(name)
        outs: dict[str, list[int]] = {}
        rates: dict[str, list[float]] = {k: [] for k in sides}
        sets = {k: load_models(ts, model=path, use_extra_bufts=False, **kw) for k, kw in sides.items()}
        try:
            for _ in range(args.repeat):
                for k, ms in sets.items():
                    spec = spec_params(ts, n_max=4)
                    with open_contexts(ms, spec, n_ctx=1024, n_batch=256, n_threads=args.threads,
                                       context_kw={"flash_attn_type": args.flash_attn}) as cs:
                        # llama.cpp's fixed draft lengths: both sides verify the same batches
                        res, stats = generate(cs.ctx_tgt, PROMPTS[0], args.n_predict, spec=spec,
                                              adaptive_draft=False)
                        outs[k] = res.tokens
                        rates[k].append(stats.gen_tps)
        finally:
            for ms in sets.values():
                ms.close()
        diff = first_difference(outs["cpu"], outs[args.device])
        print(f"  {name}: {'identical' if diff < 0 else f'differs from token {diff}'}; "
              + ", ".join(f"{k} {statistics.median(v):.1f} tok/s" for k, v in rates.items()), flush=True)
    return worst


if __name__ == "__main__":
    sys.exit(main())
