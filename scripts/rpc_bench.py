"""Tokens/s with the target local, on one rpc-server and on two (127.0.0.1), the draft always local.

    python scripts/rpc_bench.py                 # Gemma 3 270M (its PyPI package), 64 tokens, median of 3
    python scripts/rpc_bench.py --tiny -n 32    # the tiny test model

Every placement runs the same prompts greedily: plain decoding, then each type of
``--types`` through the speculative driver. Weight repacking is off on both sides
(batch-invariant settings), so all placements must produce the same tokens; the
script says so for each run. The servers and the local contexts get ``--threads``
threads each; on a machine with fewer cores than servers + 1 they compete, which the
figures then include. Rounds alternate the placements, so load drifts hit all alike.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pyspec.core.rpc import RpcServer
from pyspec.errors import MissingModelPackage
from pyspec.generation.contexts import default_model_path, load_models, open_contexts, parse_types, spec_params
from pyspec.generation.driver import generate
from pyspec.testing import models as tm

PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "import numpy as np\n\ndef softmax(x):\n",
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="the tiny test model instead of Gemma 3 270M")
    ap.add_argument("-n", "--n-predict", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="threads of each server and of the local contexts")
    ap.add_argument("--types", default="none,draft-simple", help="comma list; none = plain decoding")
    args = ap.parse_args()

    path: Path
    if args.tiny:
        path = tm.make_cyclic_target()
    else:
        try:
            path = default_model_path()
        except MissingModelPackage as e:
            print(f"rpc_bench: {e}", file=sys.stderr)
            return 1
    t_start = time.time()
    with RpcServer(threads=args.threads) as s1, RpcServer(threads=args.threads) as s2:
        placements: dict[str, dict[str, Any]] = {
            "local": {"devices": []},
            "1 rpc-server": {"rpc_servers": [s1]},
            "2 rpc-servers": {"rpc_servers": [s1, s2]},
        }
        print(f"rpc_bench: {path.name}, greedy, {len(PROMPTS)} prompts x {args.n_predict} tokens, median of "
              f"{args.repeat}, {args.threads} thread(s) per server and per local context; draft local")
        print("| types | placement | tok/s | vs local | tokens identical to local |")
        print("|---|---|---|---|---|")
        for name in args.types.split(","):
            ts = parse_types(name)
            sets = {p: load_models(ts, model=path, use_extra_bufts=False,
                                   draft_kw={"devices": [], "use_extra_bufts": False}, **kw)
                    for p, kw in placements.items()}
            rates: dict[str, list[float]] = {p: [] for p in placements}
            tokens: dict[str, list[list[int]]] = {p: [] for p in placements}
            try:
                for r in range(args.repeat):
                    for p, ms in sets.items():
                        spec = spec_params(ts, n_max=4)
                        with open_contexts(ms, spec, n_ctx=1024, n_batch=256, n_threads=args.threads) as cs:
                            n_tok, t_gen, toks = 0, 0.0, []
                            for prompt in PROMPTS:
                                res, stats = generate(cs.ctx_tgt, prompt, args.n_predict, spec=spec)
                                n_tok += stats.n_gen_tokens
                                t_gen += stats.t_gen_s
                                toks.append(res.tokens)
                            rates[p].append(n_tok / t_gen)
                            if r == 0:
                                tokens[p] = toks
            finally:
                for ms in sets.values():
                    ms.close()
            base = statistics.median(rates["local"])
            for p in placements:
                med = statistics.median(rates[p])
                same = "yes" if tokens[p] == tokens["local"] else "NO"
                print(f"| {name} | {p} | {med:.1f} | {med / base:.2f} | {same} |", flush=True)
    print(f"rpc_bench: {time.time() - t_start:.0f} s; load average {open('/proc/loadavg').read().split()[:3]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
