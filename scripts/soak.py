#!/usr/bin/env python3
"""Long-run check: many speculative steps in one process, no memory, fd or thread growth.

    python scripts/soak.py                      # 10,000 steps of draft-simple on the tiny models
    python scripts/soak.py --steps 1000 --types draft-eagle3,ngram-mod --engine cpp
    python scripts/soak.py --threads 1,2,4      # throughput against the number of threads

Prints RSS after warm-up and at the end, open file descriptors, threads and
steps/s; exits 1 when RSS grew by more than --max-growth-mb after warm-up or
when fds / threads grew. Each generation uses a new generator (and, every
--recreate-every generations, new contexts), so object churn is exercised too.
Run from the repository root.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pyspec import Context, Model
from pyspec.common import speculative as sp
from pyspec.common.params import CommonParamsSpeculative
from pyspec.common.params import CommonSpeculativeType as T
from pyspec.generation.driver import SpeculativeGenerator, greedy_sampling
from pyspec.testing import models as tm

PROMPTS = [
    "def fib(n):\n    return fib(n - 1) + fib(n - 2)\n" * 2,
    "The quick brown fox jumps over the lazy dog. " * 3,
    "int main() { for (int i = 0; i < 10; i++) { printf(\"%d\", i); } return 0; }",
]


def rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def n_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def n_threads() -> int:
    return len(os.listdir("/proc/self/task"))


class Setup:
    """Models once; contexts and params for one speculative type, recreated on demand."""

    def __init__(self, types: list[T], n_threads_ctx: int) -> None:
        self.types = types
        self.n_threads_ctx = n_threads_ctx
        needs = {T.DRAFT_MTP: "mtp", T.DRAFT_EAGLE3: "eagle3", T.DRAFT_SIMPLE: "draft"}
        self.models = {"target": Model(tm.make_target())}
        for t in types:
            if t in needs:
                maker = {"mtp": tm.make_mtp, "eagle3": tm.make_eagle3, "draft": tm.make_draft}[needs[t]]
                self.models[needs[t]] = Model(maker())
        self.ctx: Context | None = None
        self.ctxd: Context | None = None

    def contexts(self):
        self.close_contexts()
        kw = dict(n_ctx=512, n_batch=64, n_ubatch=32, n_threads=self.n_threads_ctx, n_threads_batch=self.n_threads_ctx)
        p = CommonParamsSpeculative(types=list(self.types))
        p.draft.n_max = 4
        for m in (p.ngram_simple, p.ngram_map_k, p.ngram_map_k4v):
            m.size_n, m.size_m = 2, 6
        p.ngram_mod.n_match, p.ngram_mod.n_min, p.ngram_mod.n_max = 2, 1, 6
        if T.DRAFT_MTP in self.types:
            self.ctx = Context(self.models["mtp"], **kw, n_rs_seq=4)
            self.ctxd = Context(self.models["mtp"], **kw, ctx_type="mtp", ctx_other=self.ctx)
        else:
            self.ctx = Context(self.models["target"], **kw)
            if T.DRAFT_EAGLE3 in self.types:
                self.ctxd = Context(self.models["eagle3"], **kw, ctx_other=self.ctx)
            elif T.DRAFT_SIMPLE in self.types:
                self.ctxd = Context(self.models["draft"], **kw)
        p.draft.ctx_dft = self.ctxd
        return self.ctx, p

    def close_contexts(self) -> None:
        for c in (self.ctxd, self.ctx):
            if c is not None:
                c.close()
        self.ctx = self.ctxd = None

    def close(self) -> None:
        self.close_contexts()
        for m in self.models.values():
            m.close()


def soak(args: argparse.Namespace) -> int:
    types = sp.common_speculative_types_from_names(args.types.split(","))
    setup = Setup(types, args.ctx_threads)
    ctx, p = setup.contexts()
    steps = gens = tokens = drafted = accepted = 0

    def one_generation() -> None:
        nonlocal steps, gens, tokens, drafted, accepted, ctx, p
        if gens and gens % args.recreate_every == 0:
            ctx, p = setup.contexts()
        with SpeculativeGenerator(ctx, p, greedy_sampling(), engine=args.engine) as g:
            (res,) = g.generate([PROMPTS[gens % len(PROMPTS)]], args.n_predict)
            steps += g.stats.n_steps
            tokens += len(res.tokens)
            drafted += g.stats.n_drafted
            accepted += g.stats.n_accepted
        gens += 1

    # warm-up: every prompt a few times, allocators and caches settle
    while steps < args.warmup_steps:
        one_generation()
    gc.collect()
    rss0, fds0, thr0 = rss_kb(), n_fds(), n_threads()
    steps0, t0 = steps, time.perf_counter()
    print(f"warm-up: {steps} steps, {gens} generations; RSS {rss0 / 1024:.1f} MB, fds {fds0}, threads {thr0}",
          flush=True)
    next_report = steps0 + args.steps // 10
    while steps - steps0 < args.steps:
        one_generation()
        if steps >= next_report:
            print(f"  {steps - steps0:6d} steps: RSS {rss_kb() / 1024:.1f} MB, fds {n_fds()}, threads {n_threads()}",
                  flush=True)
            next_report += args.steps // 10
    dt = time.perf_counter() - t0
    gc.collect()
    rss1, fds1, thr1 = rss_kb(), n_fds(), n_threads()  # contexts still open, as during the run
    setup.close_contexts()
    gc.collect()
    rss_closed = rss_kb()
    n = steps - steps0
    growth_mb = (rss1 - rss0) / 1024
    print(f"end:     {n} steps in {dt:.1f} s = {n / dt:.0f} steps/s, {tokens} tokens in all, "
          f"acceptance {accepted / max(drafted, 1):.2f}")
    print(f"RSS {rss0 / 1024:.1f} MB -> {rss1 / 1024:.1f} MB "
          f"(growth {growth_mb:+.2f} MB, limit {args.max_growth_mb} MB); "
          f"fds {fds0} -> {fds1}; threads {thr0} -> {thr1}; RSS after closing the contexts {rss_closed / 1024:.1f} MB")
    setup.close()
    ok = growth_mb < args.max_growth_mb and fds1 <= fds0 and thr1 <= thr0
    print("OK" if ok else "FAIL")
    return 0 if ok else 1


def threads_bench(args: argparse.Namespace) -> int:
    """tokens/s of the tiny target with 1, 2, 4... Python threads, each with its own contexts."""
    types = sp.common_speculative_types_from_names(args.types.split(","))
    setup = Setup(types, args.ctx_threads)
    ctx, p = setup.contexts()
    with SpeculativeGenerator(ctx, p, greedy_sampling(), engine=args.engine) as g:
        expected = g.generate([PROMPTS[0]], args.n_predict)[0].tokens
    setup.close_contexts()
    print(f"types={args.types} engine={args.engine} n_predict={args.n_predict} per generation, "
          f"{args.gens_per_thread} generations per thread, n_threads per context={args.ctx_threads}, "
          f"{os.cpu_count()} CPUs")
    print("threads  tokens  seconds  tokens/s  all outputs equal single-threaded")
    for n in [int(x) for x in args.threads.split(",")]:
        per = [Setup.__new__(Setup) for _ in range(n)]
        ok = [True] * n
        counts = [0] * n

        def work(i: int, per: list[Setup] = per, ok: list[bool] = ok, counts: list[int] = counts) -> None:
            s = per[i]
            s.types, s.n_threads_ctx, s.models = setup.types, setup.n_threads_ctx, setup.models
            s.ctx = s.ctxd = None
            c, pp = s.contexts()
            with SpeculativeGenerator(c, pp, greedy_sampling(), engine=args.engine) as g:
                for _ in range(args.gens_per_thread):
                    toks = g.generate([PROMPTS[0]], args.n_predict)[0].tokens
                    counts[i] += len(toks)
                    ok[i] = ok[i] and toks == expected
            s.close_contexts()

        ths = [threading.Thread(target=work, args=(i,)) for i in range(n)]
        t0 = time.perf_counter()
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        dt = time.perf_counter() - t0
        print(f"{n:7d}  {sum(counts):6d}  {dt:7.2f}  {sum(counts) / dt:8.1f}  {all(ok)}")
    setup.close()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10_000, help="speculative steps after warm-up")
    ap.add_argument("--warmup-steps", type=int, default=500)
    ap.add_argument("--types", default="draft-simple")
    ap.add_argument("--engine", default="python", choices=["python", "cpp"])
    ap.add_argument("--n-predict", type=int, default=64)
    ap.add_argument("--recreate-every", type=int, default=25, help="new contexts every N generations")
    ap.add_argument("--ctx-threads", type=int, default=1, help="llama.cpp threads per context")
    ap.add_argument("--max-growth-mb", type=float, default=5.0)
    ap.add_argument("--threads", default="", help="e.g. 1,2,4: measure throughput against Python threads instead")
    ap.add_argument("--gens-per-thread", type=int, default=8)
    args = ap.parse_args()
    return threads_bench(args) if args.threads else soak(args)


if __name__ == "__main__":
    sys.exit(main())
