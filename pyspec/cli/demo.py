"""``pyspec demo``: speculative decoding on a code prompt, lossless, with the speed-up measured in the same run.

The model is loaded in batch-invariant mode, so every speculative text is the
plain-decoding text (checked, and printed once). Plain decoding, an n-gram type
and draft-simple (the target as its own draft) run interleaved, each with
llama.cpp's fixed draft length and with pyspec's cost-aware one; the table shows
the median speed of each, and the demo states the verify cost curve it measured
on this machine, which is what decides whether speculation pays.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pyspec.cli.bench import BUILTIN_PROMPTS, common_log, run_once
from pyspec.common.params import CommonSpeculativeType as T
from pyspec.generation.contexts import load_models
from pyspec.generation.draft_length import CostCurve, oracle_speedup

__all__ = ["DEMO_NGRAM", "DEMO_PROMPT", "batch_cost_words", "demo"]

DEMO_PROMPT = BUILTIN_PROMPTS[0]
DEMO_NGRAM = T.NGRAM_MAP_K4V  # the n-gram type with the highest bound on the code prompts of `pyspec bench`


def demo(
    *,
    model: str | Path | None = None,
    n_predict: int | None = None,
    n_threads: int | None = 2,
    repeat: int = 3,
    out: Callable[[str], Any] = print,
    verbose: bool = False,
    progress: Callable[[str], Any] | None = None,
) -> int:
    """Continue a code prompt with plain decoding, an n-gram type and draft-simple; print the text and the speed-ups.

    ``progress`` gets a line before each measured run (default: stderr), so the tens of seconds of
    measuring are not silent; the results go to ``out``.
    """
    if progress is None:
        def progress(line: str) -> None:
            print(line, file=sys.stderr, flush=True)
    n_predict = n_predict or 160
    configs = [  # (label, types, engine)
        ("plain decoding", [T.NONE], "python"),
        (f"{DEMO_NGRAM.name.lower().replace('_', '-')}, llama.cpp's draft length", [DEMO_NGRAM], "fixed"),
        (f"{DEMO_NGRAM.name.lower().replace('_', '-')}, cost-aware draft length", [DEMO_NGRAM], "python"),
        ("draft-simple (draft = target), llama.cpp's", [T.DRAFT_SIMPLE], "fixed"),
        ("draft-simple (draft = target), cost-aware", [T.DRAFT_SIMPLE], "python"),
    ]
    spec_kw = {"n_max": 8, "ngram_n": 3, "ngram_m": 8}
    ctx_kw = {"n_ctx": 1024, "n_threads": n_threads}
    curve = CostCurve(window=999)
    progress("loading the model...")
    with common_log(verbose), load_models([T.DRAFT_SIMPLE], model=model, batch_invariant=True) as models:
        out(f"model: {models.target.desc} ({models.target.path.name}), batch-invariant mode, "
            f"{n_threads or 'all'} thread(s)")
        out(f"prompt ({len(DEMO_PROMPT.splitlines())} lines of Python), {n_predict} tokens, greedy, "
            f"median of {repeat} interleaved runs\n")
        progress("warming up...")
        run_once(models, [T.NONE], "python", DEMO_PROMPT, 8, spec_kw, ctx_kw)  # warm-up
        tps: dict[int, list[float]] = {k: [] for k in range(len(configs))}
        last: dict[int, Any] = {}
        total = repeat * len(configs)
        for rep in range(repeat):
            for k, (label, types, engine) in enumerate(configs):
                progress(f"measuring {label} ({rep * len(configs) + k + 1}/{total})...")
                res, st = run_once(models, types, engine, DEMO_PROMPT, n_predict, spec_kw, ctx_kw, curve)
                tps[k].append(st.gen_tps)
                last[k] = (res, st)
    text = last[0][0].text
    out(DEMO_PROMPT + text)
    out("-" * 72)
    plain = statistics.median(tps[0])
    out(f"{'':<46} {'tok/s':>7} {'accepted':>12} {'speed-up':>8} {'bound':>6}  text")
    for k, (label, types, engine) in enumerate(configs):
        res, st = last[k]
        med = statistics.median(tps[k])
        acc = f"{st.n_accepted}/{st.n_drafted}" if types != [T.NONE] else "-"
        bound = ""
        if engine == "fixed" and curve.ready:
            bound = f"{oracle_speedup(curve, st.drafts, st.n_steps, st.n_gen_tokens, st.t_draft_s):.2f}x"
        same = "same" if res.text == text else "DIFFERS"
        out(f"{label:<46} {med:7.1f} {acc:>12} {med / plain if plain else 0:7.2f}x {bound:>6}  {same}")
    rel = curve.relative() if curve.ready else {}
    if rel:
        pts = ", ".join(f"c({n})={v:.1f}" for n, v in rel.items() if n <= 17)
        out(f"\nmeasured verify cost of a batch of n tokens, in one-token decodes ({curve.cost(1) * 1e3:.1f} ms): "
            f"{pts}")
    out(batch_cost_words(rel) + ".")
    out("A draft pays when enough of it is accepted, and the cheaper the batch, the less is enough: the")
    out("cost-aware length verifies long n-gram drafts where they keep being accepted and none where they would")
    out("not be. A draft model as large as the target can never pay (each draft token costs a decode): the")
    out("cost-aware choice notices and decodes plainly. bound: the speed-up of verifying exactly the accepted")
    out("tokens of each fixed-length draft. Batch-invariant mode makes every text equal plain decoding's, token")
    out("for token.")
    return 0


def batch_cost_words(rel: dict[int, float]) -> str:
    """What the measured verify-cost curve (c(n) / c(1) by batch size) says of a batch, in words. Machines
    differ by a factor of two here (2 tokens cost 1.9 one-token decodes on one 2-core CPU, 1.1 on another),
    so the demo says what it measured: the mean over the sizes of what each token past the first added."""
    extra = [(c - 1.0) / (n - 1) for n, c in rel.items() if 1 < n <= 17]
    if not extra:
        return "A verify batch was not measured on this CPU"
    share = sum(extra) / len(extra)
    if share >= 0.5:
        return (f"On this CPU each token a verify batch adds costs {share:.0%} of a one-token decode (Gemma 3\n"
                f"computes 262k logits for every verified token)")
    return f"On this CPU each token a verify batch adds costs only {share:.0%} of a one-token decode"
