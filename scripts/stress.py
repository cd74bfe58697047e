#!/usr/bin/env python3
"""Threads hammering shared and private contexts: no crash, no hang, no wrong output.

    python scripts/stress.py                    # 8 threads, 60 s
    python scripts/stress.py --threads 4 --seconds 10

Every thread loops over a random mix of calls: decode, logits reads, sampling (a
SamplerChain, a chain with a Python sampler, the port's common_sampler, the C++
reference sampler), memory edits, state save / restore (in memory and to files),
a LoRA applied and removed, one ThreadPool attached and detached by every thread,
speculative generation (Python engine and C++ engine), requests submitted to and
cancelled on one running Engine, and close-and-recreate of its own contexts. Half the calls go to contexts shared by all
threads, where a call may be refused with ConcurrentUseError (counted) but must never
crash, hang or return a wrong value (each multi-call operation holds Context.claim,
so another thread's calls are refused rather than interleaved); the other half go to the thread's own contexts,
where nothing may be refused and every generation must equal the single-threaded
reference computed before the threads start. Prints the counts and exits 1 on any
wrong output, unexpected exception or stuck thread.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from pyspec import Batch, ConcurrentUseError, Context, Model, SamplerChain
from pyspec.common import sampling as smp
from pyspec.common.params import CommonParamsSpeculative
from pyspec.common.params import CommonSpeculativeType as T
from pyspec.core import ThreadPool
from pyspec.core.adapters import LoraAdapter
from pyspec.core.sampler import CustomSampler, TokenDataArray
from pyspec.errors import ClosedError
from pyspec.generation.driver import SpeculativeGenerator, greedy_sampling
from pyspec.generation.engine import Engine
from pyspec.generation.requests import Request
from pyspec.reference.sampling import RefSampler
from pyspec.testing import derived
from pyspec.testing import models as tm

PROMPT = "def fib(n):\n    return fib(n - 1) + fib(n - 2)\n"
TOKENS = list(range(100, 116))
KW = dict(n_ctx=256, n_batch=32, n_ubatch=32, n_seq_max=2, n_threads=1, n_threads_batch=1)


class Shared:
    """Models, the single-threaded expectations, and the contexts all threads use."""

    def __init__(self) -> None:
        self.target = Model(tm.make_target())
        self.draft = Model(tm.make_draft())
        self.tmp = tempfile.mkdtemp(prefix="pyspec-stress-")
        self.lora = LoraAdapter(self.target, derived.make_lora(Path(self.tmp) / "lora.gguf").path)
        with Context(self.target, **KW) as c:
            self.logits = self._decode_logits(c)
            self.gen = {e: self._generate(c, e) for e in ("python", "cpp")}
            c.set_lora_adapters({self.lora: 1.0})
            self.lora_logits = self._decode_logits(c)
        if np.array_equal(self.lora_logits, self.logits):
            raise AssertionError("the LoRA does not change the logits: op_lora would prove nothing")
        self.contexts = [Context(self.target, **KW) for _ in range(2)]
        self.pool = ThreadPool(1, poll=0)  # one pool for all threads: it serves one context at a time
        # one running engine for all threads (fixed draft lengths); what a request generates alone
        with self._engine(n_parallel=1) as alone:
            h = alone.submit(Request(prompt=PROMPT, n_predict=12))
            alone.run_until_idle()
            self.engine_tokens = h.result().tokens
        self.engine = self._engine(n_parallel=3).start()

    def _engine(self, n_parallel: int) -> Engine:
        c = Context(self.target, **{**KW, "n_ctx": 256 * n_parallel, "n_seq_max": n_parallel})
        return Engine(c, self.spec(), greedy_sampling(), n_parallel=n_parallel, owned=[c], adaptive_draft=False)

    def close(self) -> None:
        self.engine.close()
        for c in self.contexts:
            c.close()
        self.pool.close()
        self.lora.close()

    @staticmethod
    def _decode_logits(c: Context) -> np.ndarray:
        b = Batch(len(TOKENS))
        b.add_sequence(TOKENS, 0, 0)
        c.memory.seq_rm(-1, -1, -1)
        c.decode(b)
        return c.get_logits_ith(-1)

    def spec(self) -> CommonParamsSpeculative:
        p = CommonParamsSpeculative(types=[T.NGRAM_SIMPLE])
        p.ngram_simple.size_n, p.ngram_simple.size_m = 2, 6
        return p

    def _generate(self, c: Context, engine: str) -> list[int]:
        with SpeculativeGenerator(c, self.spec(), greedy_sampling(), engine=engine) as g:
            return g.generate([PROMPT], 12)[0].tokens


def op_decode(sh: Shared, c: Context) -> None:
    got = sh._decode_logits(c)
    if not np.array_equal(got, sh.logits):
        raise AssertionError("decode: logits differ from the single-threaded ones")


def op_sample_chain(sh: Shared, c: Context) -> None:
    with SamplerChain().add_greedy() as chain:
        sh._decode_logits(c)
        tok = chain.sample(c, -1)
    if tok != int(np.argmax(sh.logits)):
        raise AssertionError(f"chain sampled {tok}")


def op_sample_port(sh: Shared, c: Context) -> None:
    s = smp.common_sampler_init(sh.target, greedy_sampling())
    try:
        sh._decode_logits(c)
        tok = smp.common_sampler_sample(s, c, -1)
    finally:
        s.close()
    if tok != int(np.argmax(sh.logits)):
        raise AssertionError(f"port sampled {tok}")


def op_sample_ref(sh: Shared, c: Context) -> None:
    with RefSampler(sh.target, greedy_sampling()) as s:
        sh._decode_logits(c)
        tok = s.sample(c, -1)
    if tok != int(np.argmax(sh.logits)):
        raise AssertionError(f"reference sampled {tok}")


class _Argmax(CustomSampler):
    name = "stress-argmax"

    def apply(self, cur_p: TokenDataArray) -> None:
        cur_p.selected = int(np.argmax(cur_p.data["logit"]))


def op_sample_custom(sh: Shared, c: Context) -> None:
    with SamplerChain().add_custom(_Argmax()) as chain:
        sh._decode_logits(c)
        tok = chain.sample(c, -1)
    if tok != int(np.argmax(sh.logits)):
        raise AssertionError(f"Python sampler picked {tok}")


def op_lora(sh: Shared, c: Context) -> None:
    c.set_lora_adapters({sh.lora: 1.0})
    try:
        if not np.array_equal(sh._decode_logits(c), sh.lora_logits):
            raise AssertionError("decode under the LoRA: logits differ from the single-threaded ones")
    finally:
        c.clear_lora_adapters()
    if not np.array_equal(sh._decode_logits(c), sh.logits):
        raise AssertionError("the LoRA's effect outlived clear_lora_adapters")


class PoolBusy(Exception):
    """The shared ThreadPool is attached to another thread's context (refused, as it must be)."""


def op_threadpool(sh: Shared, c: Context) -> None:
    try:
        c.attach_threadpool(sh.pool)
    except ValueError as e:
        if "attached to another context" not in str(e):
            raise
        raise PoolBusy(str(e)) from None
    try:
        if not np.array_equal(sh._decode_logits(c), sh.logits):
            raise AssertionError("decode on the shared pool: logits differ")
    finally:
        c.detach_threadpool()


def op_state_file(sh: Shared, c: Context) -> None:
    sh._decode_logits(c)
    path = os.path.join(sh.tmp, f"seq-{threading.get_ident()}.bin")
    c.state_seq_save_file(path, 0, TOKENS)
    c.memory.seq_rm(0, -1, -1)
    if c.state_seq_load_file(path, 0) != TOKENS or c.memory.seq_pos_max(0) != len(TOKENS) - 1:
        raise AssertionError("state file round trip lost tokens or positions")


def op_engine(sh: Shared, c: Context) -> None:
    # c is not used: every thread submits to the one running engine
    h = sh.engine.submit(Request(prompt=PROMPT, n_predict=12))
    if random.random() < 0.3:
        h.cancel()
        h.result(timeout=60)  # ends, with whatever it had
        return
    got = h.result(timeout=60).tokens
    if got != sh.engine_tokens:
        raise AssertionError(f"engine request generated {got}, alone {sh.engine_tokens}")


def op_memory(sh: Shared, c: Context) -> None:
    m = c.memory
    m.seq_rm(1, -1, -1)
    b = Batch(4)
    b.add_sequence(TOKENS[:4], 0, 1)
    c.decode(b)
    if m.seq_pos_max(1) != 3:
        raise AssertionError(f"seq 1 ends at {m.seq_pos_max(1)}")
    m.seq_rm(1, 2, -1)
    if m.seq_pos_max(1) != 1:
        raise AssertionError(f"seq 1 ends at {m.seq_pos_max(1)} after seq_rm")


def op_state(sh: Shared, c: Context) -> None:
    sh._decode_logits(c)
    blob = c.state_seq_get(0)
    c.memory.seq_rm(0, -1, -1)
    c.state_seq_set(0, blob)
    if c.memory.seq_pos_max(0) != len(TOKENS) - 1:
        raise AssertionError("state round trip lost positions")


def op_generate(engine: str):
    def op(sh: Shared, c: Context) -> None:
        got = sh._generate(c, engine)
        if got != sh.gen[engine]:
            raise AssertionError(f"{engine} generation differs: {got} != {sh.gen[engine]}")
    op.__name__ = f"op_generate_{engine}"
    return op


OPS = [op_decode, op_sample_chain, op_sample_custom, op_sample_port, op_sample_ref, op_memory, op_state,
       op_state_file, op_lora, op_threadpool, op_engine, op_generate("python"), op_generate("cpp")]
SELF_CLAIMING = {"op_generate_python", "op_generate_cpp", "op_engine"}  # they claim what they use


def worker(sh: Shared, deadline: float, seed: int, counts: collections.Counter, failures: list[str],
           beats: list[float], i: int) -> None:
    rng = random.Random(seed)
    own = Context(sh.target, **KW)
    try:
        while time.monotonic() < deadline and not failures:
            beats[i] = time.monotonic()
            op = rng.choice(OPS)
            shared = rng.random() < 0.5
            c = rng.choice(sh.contexts) if shared else own
            try:
                if op.__name__ in SELF_CLAIMING:
                    op(sh, c)
                else:
                    with c.claim():  # a sequence of calls no other thread may interleave with
                        op(sh, c)
                counts[f"{op.__name__} ok"] += 1
            except ConcurrentUseError:
                if not shared:
                    raise
                counts[f"{op.__name__} refused"] += 1
            except PoolBusy:
                counts[f"{op.__name__} pool busy"] += 1
            if not shared and rng.random() < 0.05:  # churn: a fresh private context
                own.close()
                own = Context(sh.target, **KW)
                counts["recreate"] += 1
    except ClosedError as e:
        failures.append(f"thread {i}: unexpected {e!r}")
    except BaseException:
        failures.append(f"thread {i}:\n{traceback.format_exc()}")
    finally:
        own.close()
        beats[i] = float("inf")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--stall", type=float, default=120.0, help="a thread silent this long counts as hung")
    args = ap.parse_args()

    sh = Shared()
    counts: collections.Counter[str] = collections.Counter()
    failures: list[str] = []
    beats = [time.monotonic()] * args.threads
    deadline = time.monotonic() + args.seconds
    ths = [threading.Thread(target=worker, args=(sh, deadline, args.seed * 1000 + i, counts, failures, beats, i),
                            daemon=True) for i in range(args.threads)]
    t0 = time.monotonic()
    for th in ths:
        th.start()
    while any(th.is_alive() for th in ths):
        time.sleep(0.5)
        stuck = [i for i, b in enumerate(beats) if time.monotonic() - b > args.stall]
        if stuck:
            failures.append(f"threads {stuck} made no progress for {args.stall:.0f} s (hang)")
            break
    for th in ths:
        th.join(timeout=1)
    dt = time.monotonic() - t0
    sh.close()
    total = sum(v for k, v in counts.items() if k.endswith(" ok"))
    refused = sum(v for k, v in counts.items() if k.endswith(" refused"))
    print(f"{args.threads} threads, {dt:.1f} s: {total} calls completed, {refused} refused (ConcurrentUseError), "
          f"{counts['recreate']} private contexts recreated")
    for k in sorted(counts):
        print(f"  {k:32s} {counts[k]}")
    never = [op.__name__ for op in OPS if not counts[f"{op.__name__} ok"]]
    if never and not failures:
        failures.append(f"never completed (a stress that skips them proves nothing): {', '.join(never)}")
    if failures:
        print("FAIL")
        for f in failures[:5]:
            print(f)
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
