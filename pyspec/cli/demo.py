"""``pyspec demo``: plain decoding, an n-gram type and draft-simple on a code prompt, measured in one run."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from pyspec.cli.bench import BUILTIN_PROMPTS, common_log, run_once
from pyspec.common.params import CommonSpeculativeType as T
from pyspec.generation.contexts import load_models, open_contexts, spec_params
from pyspec.generation.driver import SpeculativeGenerator, greedy_sampling

__all__ = ["DEMO_PROMPT", "demo"]

DEMO_PROMPT = BUILTIN_PROMPTS[0]


def demo(
    *,
    model: str | Path | None = None,
    n_predict: int | None = None,
    n_threads: int | None = 1,
    out: Callable[[str], Any] = print,
    verbose: bool = False,
) -> int:
    """Continue a code prompt with plain decoding, an n-gram type and draft-simple; print the text and the speed-ups.

    Everything is measured in this run, on the same model, with greedy
    sampling (so the three texts are the same, and printed once).
    """
    n_predict = n_predict or 160
    configs = [
        ("plain decoding", [T.NONE], {}),
        ("ngram-cache", [T.NGRAM_CACHE], {}),
        ("draft-simple (draft = target)", [T.DRAFT_SIMPLE], {"n_max": 4}),
    ]
    with common_log(verbose), load_models([T.DRAFT_SIMPLE], model=model) as models:
        out(f"model: {models.target.desc} ({models.target.path.name})")
        out(f"prompt ({len(DEMO_PROMPT.splitlines())} lines of Python), {n_predict} tokens, greedy\n")
        ctx_kw: dict[str, Any] = {"n_ctx": 1024, "n_threads": n_threads}
        run_once(models, [T.NONE], "python", DEMO_PROMPT, 8, {}, ctx_kw)  # warm-up
        rows = []
        text = ""
        for label, types, kw in configs:
            spec = spec_params(types, **kw)
            with open_contexts(models, spec, **ctx_kw) as cs, \
                    SpeculativeGenerator(cs.ctx_tgt, spec, greedy_sampling(), n_seq=1) as gen:
                (res,) = gen.generate([DEMO_PROMPT], n_predict)
                st = gen.stats
            if not text:
                text = res.text
                out(DEMO_PROMPT + text)
                out("-" * 60)
            same = "same text" if res.text == text else "TEXT DIFFERS"
            rows.append((label, st.gen_tps, st, same))
    plain = rows[0][1]
    out(f"{'':<31} {'gen tok/s':>9} {'accepted':>12} {'speed-up':>8}")
    for label, tps, st, same in rows:
        acc = f"{st.n_accepted}/{st.n_drafted} {st.acceptance * 100:3.0f}%" if st.n_drafted else "-"
        out(f"{label:<31} {tps:9.1f} {acc:>12} {tps / plain if plain else 0:7.2f}x  {same}")
    out("\nngram-cache drafts from n-grams of the text so far: drafts cost next to nothing, so the speed-up")
    out("is what verifying several tokens in one batch saves; on a CPU the cost of a batch grows with its")
    out("size (Gemma 3 computes 262k-entry logits for every token), so the gain is modest here.")
    out("draft-simple here drafts with the target model itself: greedy drafts are what the target would")
    out("pick (acceptance near 100%), but each draft token costs a full forward pass, so it shows the")
    out("mechanism and its overhead, not a speed-up; a real setup pairs a much smaller draft model.")
    return 0
