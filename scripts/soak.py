#!/usr/bin/env python3
"""Long-run check: many speculative steps in one process, no memory, fd or thread growth.

    python scripts/soak.py                      # 10,000 steps of draft-simple on the tiny models
    python scripts/soak.py --steps 1000 --types draft-eagle3,ngram-mod --engine cpp
    python scripts/soak.py --each --engine both # every type alone, both engines: one table
    python scripts/soak.py --threads 1,2,4      # throughput against the number of threads

Prints resident memory after warm-up and at the end, open file descriptors,
threads and steps/s; exits 1 when anonymous resident memory (RssAnon: the heap
and every other private allocation, where a leak shows) grew by more than
--max-growth-mb after warm-up, when fds / threads grew, or when nothing was
drafted. Each generation uses a new
generator (and, every --recreate-every generations, new contexts), so object
churn is exercised too; RSS is compared at the same point of that cycle (the
first generation on new contexts), since it moves by a context's size within it,
after malloc_trim, so that it counts live memory rather than the heap's fragmentation.
Warm-up lasts --warmup-steps and at least --warmup-cycles context recreations:
glibc raises its mmap threshold (up to 32 MB) each time a large mmap'd block is
freed, so over the first few recreations the contexts' large buffers move from
mmap into the heap and RSS rises by a few MB, then stays (draft-mtp, whose
contexts are largest, rose 6 MB over 4 cycles and then held for 7,500 steps; with
MALLOC_MMAP_THRESHOLD_=131072, which fixes the threshold, it stays flat from the
first cycle). All of RSS is printed beside it: it adds the pages of the
memory-mapped model files, which the kernel may drop and fault in again as the
page cache needs.
The tiny cyclic models repeat themselves, so every type drafts.
``--each`` runs the soak once per speculative type (the 10 of llama.cpp) and engine,
each in a fresh process so one run's allocator state does not flatter the next,
and prints one row per run. Run from the repository root.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
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
from pyspec.parity.harness import continued_prompt
from pyspec.testing import models as tm
from pyspec.testing.models_dflash import make_cyclic_dflash, make_cyclic_dspark

PROMPTS = [
    "def fib(n):\n    return fib(n - 1) + fib(n - 2)\n" * 2,
    "The quick brown fox jumps over the lazy dog. " * 3,
    "int main() { for (int i = 0; i < 10; i++) { printf(\"%d\", i); } return 0; }",
]


def rss_kb(field: str = "VmRSS") -> int:
    """Resident memory in kB: all of it (VmRSS), or its anonymous part (RssAnon)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _malloc_trim() -> None:
    """Hand the allocator's free memory back to the system (glibc), so RSS counts live memory
    rather than how fragmented the heap is after contexts came and went."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: RSS includes the allocator's free memory


def n_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def n_threads() -> int:
    return len(os.listdir("/proc/self/task"))


class Setup:
    """Models once; contexts and params for one speculative type, recreated on demand."""

    def __init__(self, types: list[T], n_threads_ctx: int) -> None:
        self.types = types
        self.n_threads_ctx = n_threads_ctx
        needs = {T.DRAFT_MTP: "mtp", T.DRAFT_EAGLE3: "eagle3", T.DRAFT_SIMPLE: "draft", T.DRAFT_DFLASH: "dflash",
                 T.DRAFT_DSPARK: "dspark"}
        # the cyclic target repeats itself, so every n-gram type finds matches and drafts (on
        # the random target they never would); its draft and EAGLE3 head are made for it
        self.models = {"target": Model(tm.make_cyclic_target())}
        for t in types:
            if t in needs:
                maker = {"mtp": tm.make_mtp, "eagle3": tm.make_cyclic_eagle3, "draft": tm.make_cyclic_draft,
                         "dflash": make_cyclic_dflash, "dspark": make_cyclic_dspark}[needs[t]]
                self.models[needs[t]] = Model(maker())
        self.ctx: Context | None = None
        self.ctxd: Context | None = None
        # each prompt followed by the cyclic target's own continuation: the generation carries on
        # a cycle the prompt already shows, so ngram-cache (which drafts from the prompt's
        # n-grams) drafts too
        self.prompts = [list(continued_prompt(str(tm.make_cyclic_target()), p, 48)) for p in PROMPTS]

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
            elif T.DRAFT_DFLASH in self.types or T.DRAFT_DSPARK in self.types:
                # the block drafters: a block of n_max + 1 rows per sequence in one ubatch (32 here)
                kind = "dflash" if T.DRAFT_DFLASH in self.types else "dspark"
                per_seq = {"n_outputs_max_per_seq": p.draft.n_max + 1} if p.draft.backend_sampling else {}
                self.ctxd = Context(self.models[kind], **kw, **per_seq, ctx_other=self.ctx)
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


ALL_TYPES = ["draft-simple", "draft-eagle3", "draft-mtp", "draft-dflash", "draft-dspark", "ngram-simple",
             "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache"]


def each(args: argparse.Namespace) -> int:
    """One fresh process per (type, engine); a table of their figures."""
    import subprocess

    engines = ["python", "cpp"] if args.engine == "both" else [args.engine]
    types = ALL_TYPES if args.types in (None, "all") else args.types.split(",")
    rows, ok = [], True
    for t in types:
        for e in engines:
            cmd = [sys.executable, __file__, "--types", t, "--engine", e, "--steps", str(args.steps),
                   "--warmup-steps", str(args.warmup_steps),
                   "--warmup-cycles", str(args.warmup_cycles), "--max-growth-mb", str(args.max_growth_mb),
                   "--n-predict", str(args.n_predict), "--json-line"]
            out = subprocess.run(cmd, capture_output=True, text=True)
            line = next((ln for ln in out.stdout.splitlines() if ln.startswith("{")), None)
            if out.returncode not in (0, 1) or line is None:
                print(f"{t:14s} {e:6s} FAILED (exit {out.returncode}): {out.stderr[-500:]}", flush=True)
                ok = False
                continue
            r = json.loads(line)
            rows.append(r)
            ok = ok and r["ok"]
            print(f"{t:14s} {e:6s} {r['steps']:6d} steps {r['steps_per_s']:7.0f}/s  "
                  f"anonymous RSS {r['anon0_mb']:6.1f} -> {r['anon1_mb']:6.1f} MB "
                  f"({r['growth_mb']:+.2f}, largest {r['peak_growth_mb']:+.2f})  "
                  f"all {r['rss0_mb']:6.1f} -> {r['rss1_mb']:6.1f} MB ({r['rss_growth_mb']:+.2f})  "
                  f"fds {r['fds0']}->{r['fds1']}  threads {r['thr0']}->{r['thr1']}  drafted {r['drafted']}  "
                  f"accept {r['acceptance']:.2f}  {'OK' if r['ok'] else 'FAIL'}",
                  flush=True)
    print("OK" if ok else "FAIL")
    return 0 if ok else 1


def soak(args: argparse.Namespace) -> int:
    types = sp.common_speculative_types_from_names(args.types.split(","))
    setup = Setup(types, args.ctx_threads)
    ctx, p = setup.contexts()
    steps = gens = tokens = drafted = accepted = 0

    def one_generation() -> None:
        nonlocal steps, gens, tokens, drafted, accepted, ctx, p
        if gens and gens % args.recreate_every == 0:
            ctx, p = setup.contexts()
        # fixed draft lengths: the cost-aware controller would skip drafts the tiny draft model
        # cannot pay for, and a soak of speculative steps must draft
        with SpeculativeGenerator(ctx, p, greedy_sampling(), engine=args.engine, adaptive_draft=False) as g:
            (res,) = g.generate([setup.prompts[gens % len(setup.prompts)]], args.n_predict)
            steps += g.stats.n_steps
            tokens += len(res.tokens)
            drafted += g.stats.n_drafted
            accepted += g.stats.n_accepted
        gens += 1

    def rss_at_phase() -> tuple[int, int]:
        # contexts are remade every --recreate-every generations and RSS moves by their size within
        # a cycle, so growth is measured between points at the same phase: the first generation on
        # new contexts
        while True:
            one_generation()
            if (gens - 1) % args.recreate_every == 0:
                gc.collect()
                _malloc_trim()
                return rss_kb(), rss_kb("RssAnon")

    # warm-up: every prompt a few times, and enough context recreations for glibc's mmap
    # threshold to settle (see the docstring)
    while steps < args.warmup_steps or gens < args.warmup_cycles * args.recreate_every:
        one_generation()
    (rss0, anon0), fds0, thr0 = rss_at_phase(), n_fds(), n_threads()
    steps0, drafted0, t0 = steps, drafted, time.perf_counter()
    print(f"warm-up: {steps} steps, {gens} generations; RSS {rss0 / 1024:.1f} MB (anonymous {anon0 / 1024:.1f}), "
          f"fds {fds0}, threads {thr0}", flush=True)
    samples: list[tuple[int, int]] = []
    while steps - steps0 < args.steps:
        samples.append(rss_at_phase())
        rss, anon = samples[-1]
        print(f"  {steps - steps0:6d} steps: RSS {rss / 1024:.1f} MB (anonymous {anon / 1024:.1f}), "
              f"fds {n_fds()}, threads {n_threads()}", flush=True)
    dt = time.perf_counter() - t0
    (rss1, anon1), fds1, thr1 = samples[-1], n_fds(), n_threads()  # contexts still open, as during the run
    setup.close_contexts()
    gc.collect()
    rss_closed = rss_kb()
    n = steps - steps0
    growth_mb = (anon1 - anon0) / 1024
    peak_mb = (max(a for _, a in samples) - anon0) / 1024
    rss_growth_mb = (rss1 - rss0) / 1024
    n_drafted = drafted - drafted0
    print(f"end:     {n} steps in {dt:.1f} s = {n / dt:.0f} steps/s, {tokens} tokens in all, "
          f"{n_drafted} drafted, acceptance {accepted / max(drafted, 1):.2f}")
    print(f"anonymous RSS {anon0 / 1024:.1f} MB -> {anon1 / 1024:.1f} MB "
          f"(growth {growth_mb:+.2f} MB, largest {peak_mb:+.2f} MB, limit {args.max_growth_mb} MB); "
          f"all of RSS {rss0 / 1024:.1f} -> {rss1 / 1024:.1f} MB ({rss_growth_mb:+.2f}); "
          f"fds {fds0} -> {fds1}; threads {thr0} -> {thr1}; RSS after closing the contexts {rss_closed / 1024:.1f} MB")
    setup.close()
    # a soak that never drafts exercises nothing speculative
    ok = growth_mb < args.max_growth_mb and fds1 <= fds0 and thr1 <= thr0 and n_drafted > 0
    if args.json_line:
        print(json.dumps({"types": args.types, "engine": args.engine, "steps": n, "steps_per_s": n / dt,
                          "rss0_mb": rss0 / 1024, "rss1_mb": rss1 / 1024, "rss_growth_mb": rss_growth_mb,
                          "anon0_mb": anon0 / 1024, "anon1_mb": anon1 / 1024, "growth_mb": growth_mb,
                          "peak_growth_mb": peak_mb, "fds0": fds0, "fds1": fds1, "thr0": thr0, "thr1": thr1,
                          "drafted": n_drafted, "acceptance": accepted / max(drafted, 1), "ok": ok}))
    print("OK" if ok else "FAIL")
    return 0 if ok else 1


def threads_bench(args: argparse.Namespace) -> int:
    """tokens/s of the tiny target with 1, 2, 4... Python threads, each with its own contexts."""
    types = sp.common_speculative_types_from_names(args.types.split(","))
    setup = Setup(types, args.ctx_threads)
    ctx, p = setup.contexts()
    with SpeculativeGenerator(ctx, p, greedy_sampling(), engine=args.engine) as g:
        expected = g.generate([setup.prompts[0]], args.n_predict)[0].tokens
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
                    toks = g.generate([setup.prompts[0]], args.n_predict)[0].tokens
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
    ap.add_argument("--warmup-cycles", type=int, default=6, help="context recreations in the warm-up")
    ap.add_argument("--types", default=None, help="comma-separated types (default draft-simple; with --each: all 10)")
    ap.add_argument("--engine", default="python", choices=["python", "cpp", "both"])
    ap.add_argument("--each", action="store_true", help="every type (or those of --types) alone, one process each")
    ap.add_argument("--json-line", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--n-predict", type=int, default=64)
    ap.add_argument("--recreate-every", type=int, default=25, help="new contexts every N generations")
    ap.add_argument("--ctx-threads", type=int, default=1, help="llama.cpp threads per context")
    ap.add_argument("--max-growth-mb", type=float, default=5.0)
    ap.add_argument("--threads", default="", help="e.g. 1,2,4: measure throughput against Python threads instead")
    ap.add_argument("--gens-per-thread", type=int, default=8)
    args = ap.parse_args()
    if args.each:
        return each(args)
    args.types = args.types or "draft-simple"
    if args.engine == "both":
        ap.error("--engine both needs --each")
    return threads_bench(args) if args.threads else soak(args)


if __name__ == "__main__":
    sys.exit(main())
