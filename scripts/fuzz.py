#!/usr/bin/env python3
"""Crash-detecting fuzzer: inputs run in worker processes, so a signal is a result.

    python scripts/fuzz.py --target grammar --seconds 600          # one target, 10 minutes
    python scripts/fuzz.py --target all --seconds 60 --atheris     # coverage-guided (pip install .[fuzz])
    python scripts/fuzz.py --target api --seconds 5 --json out.json
    python scripts/fuzz.py --target gguf_doors --inputs 100000 --seconds 86400  # 100,000 mutated files

The targets are in pyspec/testing/fuzz.py. A worker process loads the tiny models once
and runs inputs until its time is up: mutations of seed inputs (or, with --atheris,
libFuzzer's coverage-guided mutations over pyspec's instrumented Python code). Before
each input the worker copies it into a shared memory file, so when the worker dies by a
signal or stops answering, this process saves that input under --out and starts a new
worker for the rest of the time. A target that returns, or refuses its input with a
clean exception, handled it; any other exception, or two engines disagreeing, is a
finding (saved too). The summary counts inputs, signals, hangs and findings per target.
"""

from __future__ import annotations

import argparse
import base64
import json
import mmap
import os
import random
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SLOT = 1 << 20  # the largest input the shared memory file holds (longer inputs are cut there)
_HEAD = 16  # the slot file starts with the input's length and the number of inputs started
# cli runs only when named (a process per input)
ALL = ["grammar", "state", "ngram", "api", "params", "gguf", "gguf_doors", "server"]


# --- the worker ---------------------------------------------------------------------


def _worker(args: argparse.Namespace) -> None:
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # llama.cpp and targets print to stderr; stdout carries our JSON lines
    fd = os.open(args.slot, os.O_RDWR)
    mm = mmap.mmap(fd, _HEAD + SLOT)
    deadline = time.monotonic() + args.seconds
    rng = random.Random(args.seed)
    state: dict[str, Any] = {"n": 0, "t": time.monotonic()}

    if args.atheris:
        import atheris

        with atheris.instrument_imports(include=["pyspec"]):
            from pyspec.testing import fuzz
    else:
        from pyspec.testing import fuzz
    if args.target == "extra":  # a target module from PYSPEC_FUZZ_EXTRA=dir:module (tests of the runner)
        import importlib

        folder, name = os.environ["PYSPEC_FUZZ_EXTRA"].split(":")
        sys.path.insert(0, folder)
        extra = importlib.import_module(name)
        target, seeds = extra.target, list(getattr(extra, "SEEDS", [b""]))
    else:
        fuzz.setup([args.target])
        target, seeds = fuzz.TARGETS[args.target], fuzz.seeds(args.target)

    def run_one(data: bytes) -> None:
        data = data[:SLOT]
        mm[_HEAD : _HEAD + len(data)] = data
        mm[0:8] = len(data).to_bytes(8, "little")
        mm[8:16] = (int(state["n"]) + 1).to_bytes(8, "little")  # inputs started, read back after a crash
        try:
            target(data)
        except fuzz.Finding as e:
            out.write(json.dumps({"finding": str(e)[:2000], "input": base64.b64encode(data).decode()}) + "\n")
        except BaseException as e:
            if isinstance(e, KeyboardInterrupt):
                raise
            out.write(json.dumps({"finding": f"{type(e).__name__}: {e}"[:2000],
                                  "input": base64.b64encode(data).decode()}) + "\n")
        state["n"] += 1
        now = time.monotonic()
        if now - state["t"] > 1.0:
            out.write(json.dumps({"n": state["n"]}) + "\n")
            state["t"] = now

    out.write(json.dumps({"ready": True}) + "\n")
    if args.atheris:
        import atheris

        left = max(1, int(deadline - time.monotonic()))
        corpus_dir = Path(args.out) / f"corpus-{args.target}"
        corpus_dir.mkdir(parents=True, exist_ok=True)
        for i, s in enumerate(seeds):
            (corpus_dir / f"seed-{i}").write_bytes(s)
        argv = [sys.argv[0], f"-max_total_time={left}", f"-timeout={int(args.hang)}", "-rss_limit_mb=6144",
                f"-max_len={min(SLOT, 65536)}", f"-artifact_prefix={args.out}/", "-print_final_stats=1",
                str(corpus_dir)]
        atheris.Setup(argv, run_one)
        atheris.Fuzz()
    else:
        corpus = seeds or [b""]
        for s in corpus:
            run_one(s)
        while time.monotonic() < deadline and (not args.inputs or args.done + state["n"] < args.inputs):
            data = fuzz.mutate(rng.choice(corpus), rng)
            run_one(data)
            if len(corpus) < 512 and rng.random() < 0.01:
                corpus.append(data)
    out.write(json.dumps({"n": state["n"], "done": True}) + "\n")
    out.flush()
    os._exit(0)


# --- the parent ---------------------------------------------------------------------


def _read_lines(proc: subprocess.Popen[bytes], timeout: float, buf: bytearray) -> list[dict] | None:
    """JSON lines the worker printed within timeout ([] when none; None at end of file)."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout.fileno()], [], [], timeout)
    if not ready:
        return []
    chunk = os.read(proc.stdout.fileno(), 65536)
    if not chunk:
        return None
    buf += chunk
    lines = []
    while b"\n" in buf:
        line, _, rest = bytes(buf).partition(b"\n")
        buf[:] = rest
        try:
            lines.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return lines


def fuzz_target(target: str, seconds: float, args: argparse.Namespace) -> dict:
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    slot = out_dir / f".slot-{target}-{os.getpid()}"
    slot.write_bytes(b"\0" * (_HEAD + SLOT))
    res: dict[str, Any] = {"target": target, "inputs": 0, "signals": 0, "hangs": 0, "findings": 0, "restarts": 0,
           "seconds": 0.0, "examples": []}
    t0 = time.monotonic()
    seed = args.seed
    while time.monotonic() - t0 < seconds and not (args.inputs and res["inputs"] >= args.inputs):
        left = seconds - (time.monotonic() - t0)
        cmd = [sys.executable, __file__, "--worker", "--target", target, "--seconds", f"{left:.1f}", "--slot",
               str(slot), "--seed", str(seed), "--out", str(out_dir), "--hang", str(args.hang),
               "--inputs", str(args.inputs), "--done", str(res["inputs"])]
        if args.atheris:
            cmd.append("--atheris")
        seed += 1
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL if not args.verbose else None,
                                stdin=subprocess.DEVNULL, cwd=str(ROOT))
        buf = bytearray()
        n_here, last = 0, time.monotonic()
        ready = killed = False
        while True:
            lines = _read_lines(proc, 1.0, buf)
            if lines is None:
                break
            for d in lines:
                last = time.monotonic()
                ready = ready or bool(d.get("ready"))
                if "n" in d:
                    n_here = d["n"]
                    if args.progress:  # a long run's counts so far, readable before it ends
                        with open(args.progress, "a") as f:
                            f.write(json.dumps({k: res[k] for k in ("target", "signals", "hangs", "findings")}
                                               | {"inputs": res["inputs"] + n_here}) + "\n")
                if "finding" in d:
                    res["findings"] += 1
                    if len(res["examples"]) < 5:
                        res["examples"].append(d["finding"])
                    (out_dir / f"finding-{target}-{res['findings']}").write_bytes(base64.b64decode(d["input"]))
            limit = args.hang + (600 if not ready else 0)  # model loading is slow on a loaded machine
            if time.monotonic() - last > limit:
                proc.kill()
                killed = True
                res["hangs"] += 1
                _save_slot(slot, out_dir / f"hang-{target}-{res['hangs']}")
                break
        rc = proc.wait()
        started = int.from_bytes(slot.read_bytes()[8:16], "little")
        res["inputs"] += max(n_here, started)
        if rc == 70 and args.atheris:  # libFuzzer's -timeout_exitcode: one input ran past --hang
            res["hangs"] += 1
            _save_slot(slot, out_dir / f"hang-{target}-{res['hangs']}")
        elif rc != 0 and not killed:
            # a signal, libFuzzer's deadly-signal exit (77), or the worker failing otherwise
            res["signals"] += 1
            _save_slot(slot, out_dir / f"crash-{target}-{res['signals']}")
        res["restarts"] += 1
    res["restarts"] -= 1
    res["seconds"] = time.monotonic() - t0
    slot.unlink(missing_ok=True)
    return res


def _save_slot(slot: Path, dest: Path) -> None:
    raw = slot.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    dest.write_bytes(raw[_HEAD : _HEAD + n])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="all", help=f"comma-separated, of {', '.join([*ALL, 'cli'])}; or all")
    ap.add_argument("--seconds", type=float, default=60.0, help="per target")
    ap.add_argument("--atheris", action="store_true", help="coverage-guided (libFuzzer through atheris)")
    ap.add_argument("--out", default=str(ROOT / "build" / "fuzz"), help="crash / finding inputs and corpora")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--hang", type=float, default=60.0, help="seconds without progress that count as a hang")
    ap.add_argument("--inputs", type=int, default=0, help="stop a target after this many inputs (0: --seconds only)")
    ap.add_argument("--progress", help="append each worker's progress lines (JSON) to this file")
    ap.add_argument("--json", help="write the summary here")
    ap.add_argument("--verbose", action="store_true", help="show the workers' stderr")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--slot", help=argparse.SUPPRESS)
    ap.add_argument("--done", type=int, default=0, help=argparse.SUPPRESS)  # inputs run by earlier workers
    args = ap.parse_args()
    if args.worker:
        _worker(args)
        return 0
    targets = ALL if args.target == "all" else args.target.split(",")
    known = [*ALL, "cli"] + (["extra"] if os.environ.get("PYSPEC_FUZZ_EXTRA") else [])
    unknown = [t for t in targets if t not in known]
    if unknown:  # a worker would die on each at start-up, and each death would count as a signal
        ap.error(f"unknown target {', '.join(map(repr, unknown))}: choose from {', '.join(known)}, or all")
    results = []
    for t in targets:
        r = fuzz_target(t, args.seconds, args)
        results.append(r)
        rate = r["inputs"] / max(r["seconds"], 1e-9)
        print(f"{t:8s} {r['inputs']:9d} inputs in {r['seconds']:6.0f} s ({rate:7.0f}/s)"
              f"  signals {r['signals']}  hangs {r['hangs']}  findings {r['findings']}  restarts {r['restarts']}",
              flush=True)
        for ex in r["examples"]:
            print(f"    {ex[:300]}")
    total = sum(r["inputs"] for r in results)
    bad = sum(r["signals"] + r["hangs"] + r["findings"] for r in results)
    print(f"total: {total} inputs, {sum(r['signals'] for r in results)} signals, "
          f"{sum(r['hangs'] for r in results)} hangs, {sum(r['findings'] for r in results)} findings")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
