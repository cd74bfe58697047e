#!/usr/bin/env python3
"""Normal clients' latency against one ``pyspec serve`` on the tiny model, without and with hostile clients (not CI).

One server (``pyspec serve --tiny``, its chat template the tiny model's with two traps a request springs
through ``chat_template_kwargs``: ``spin``, nested loops of 10^10 iterations, and ``hungry``, a 2 GB
string). First /health is asked every 20 ms while one looping template renders. Then phases of
``--seconds`` each: N normal clients, each alternating a /completion and a /v1/chat/completions of
``--n-predict`` tokens, back to back; alone, then with M more clients sending plain completions (the
same load, nothing hostile), then with M clients of each hostile kind at the limits of params.py (16
stop strings of 128 characters, 1024 logit_bias entries, n_probs 100, a 32 KiB grammar and the same
language in 26 bytes, the two template traps), then all kinds mixed. A prober asks /health every
50 ms. Printed per phase: the normal requests' median / p95 latency per endpoint, the median over
the "+ plain" phase's (what the hostile fields cost beyond the load), /health's median and max; then
the hostile requests' answers.

Also, before the server starts: the median time of one render of the tiny model's template in this
process and through a template worker (pyspec.generation.chat_sandbox.RenderPool).

    .venv/bin/python scripts/server_hostile_load.py                     # N=4, M=2, 8 s per phase
    .venv/bin/python scripts/server_hostile_load.py --normal 2 --hostile 4 --seconds 10
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pyspec.server.params import MAX_GRAMMAR_BYTES, MAX_LOGIT_BIAS, MAX_N_PROBS, MAX_STOP_CHARS, MAX_STOPS  # noqa: E402
from pyspec.testing import models as tm  # noqa: E402

SPIN = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
HUNGRY = "{{ 'x' * 2000000000 }}"
TRAPPED = "{% if spin %}" + SPIN + "{% endif %}{% if hungry %}" + HUNGRY + "{% endif %}" + tm.CHAT_TEMPLATE
PROMPT = "def fib(n):\n    return fib(n - 1) + fib(n - 2)\n"
MSGS = [{"role": "user", "content": "Write a function that adds two numbers."}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] if xs else float("nan")


def render_latency(n: int) -> tuple[float, float]:
    """Median seconds per render of the tiny model's template: in this process, through a worker."""
    from pyspec import Model
    from pyspec.generation.chat import RenderPool, render_chat

    model = Model(tm.make_chat_target())
    msgs = [{"role": "system", "content": "Be brief."}, *MSGS * 4]
    render_chat(model, msgs)
    inproc, worker = [], []
    with RenderPool(size=1) as pool:
        pool.warm()
        render_chat(model, msgs, budget=pool)
        for _ in range(n):
            t0 = time.perf_counter()
            render_chat(model, msgs)
            t1 = time.perf_counter()
            render_chat(model, msgs, budget=pool)
            t2 = time.perf_counter()
            inproc.append(t1 - t0)
            worker.append(t2 - t1)
    model.close()
    return statistics.median(inproc), statistics.median(worker)


def hostile_bodies(n_predict: int) -> list[tuple[str, str, dict[str, Any]]]:
    """(kind, path, body) of each hostile request; "plain" is a normal completion (the same load, no field)."""
    stops = ["".join(chr(0x41 + (i + k) % 26) for k in range(MAX_STOP_CHARS)) for i in range(MAX_STOPS)]
    grammar = 'root ::= [a-z ]* | "' + "q" * (MAX_GRAMMAR_BYTES - 40) + '"'
    return [
        ("plain", "/completion", {"prompt": PROMPT, "n_predict": n_predict}),
        ("stops", "/completion", {"prompt": PROMPT, "n_predict": n_predict, "stop": stops}),
        ("logit_bias", "/completion", {"prompt": PROMPT, "n_predict": n_predict,
                                       "logit_bias": [[i % 200, 0.5] for i in range(MAX_LOGIT_BIAS)]}),
        ("n_probs", "/completion", {"prompt": PROMPT, "n_predict": n_predict, "n_probs": MAX_N_PROBS}),
        ("grammar", "/completion", {"prompt": PROMPT, "n_predict": n_predict, "grammar": grammar}),
        # the same language in 26 bytes: what any grammar costs per token, whatever its size
        ("small_grammar", "/completion", {"prompt": PROMPT, "n_predict": n_predict, "grammar": "root ::= [a-z ]*"}),
        ("spin", "/v1/chat/completions", {"messages": MSGS, "max_tokens": n_predict,
                                          "chat_template_kwargs": {"spin": True}}),
        ("hungry", "/v1/chat/completions", {"messages": MSGS, "max_tokens": n_predict,
                                            "chat_template_kwargs": {"hungry": True}}),
    ]


def run_phase(url: str, n_normal: int, n_hostile: int, seconds: float, n_predict: int,
              kinds: tuple[str, ...] = ()) -> dict[str, Any]:
    """N normal clients, and ``n_hostile`` clients cycling through the hostile requests of ``kinds``."""
    stop_at = time.monotonic() + seconds
    lat: dict[str, list[float]] = defaultdict(list)
    health: list[float] = []
    answers: Counter[str] = Counter()
    errors: list[str] = []
    lock = threading.Lock()

    def normal(i: int) -> None:
        with httpx.Client(base_url=url, timeout=120) as c:
            k = i
            while time.monotonic() < stop_at:
                if k % 2 == 0:
                    path, body = "/completion", {"prompt": PROMPT + f"# {k}\n", "n_predict": n_predict,
                                                 "cache_prompt": False}
                else:
                    path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": f"Task {k}"}],
                                                          "max_tokens": n_predict}
                t0 = time.perf_counter()
                r = c.post(path, json=body)
                dt = time.perf_counter() - t0
                with lock:
                    if r.status_code == 200:
                        lat[path].append(dt)
                    else:
                        errors.append(f"{path} {r.status_code} {r.text[:120]}")
                k += 1

    def hostile(i: int) -> None:
        bodies = [b for b in hostile_bodies(n_predict) if b[0] in kinds]
        with httpx.Client(base_url=url, timeout=120) as c:
            k = i
            while time.monotonic() < stop_at:
                name, path, body = bodies[k % len(bodies)]
                r = c.post(path, json=body)
                msg = r.json().get("error", {}).get("message", "") if r.status_code != 200 else ""
                with lock:
                    answers[f"{name}: {r.status_code} {msg[:80]}"] += 1
                k += 1

    def prober() -> None:
        with httpx.Client(base_url=url, timeout=120) as c:
            while time.monotonic() < stop_at:
                t0 = time.perf_counter()
                c.get("/health")
                health.append(time.perf_counter() - t0)
                time.sleep(0.05)

    threads = [threading.Thread(target=normal, args=(i,)) for i in range(n_normal)]
    threads += [threading.Thread(target=hostile, args=(i,)) for i in range(n_hostile)]
    threads.append(threading.Thread(target=prober))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"lat": dict(lat), "health": health, "answers": answers, "errors": errors}


def health_during(url: str, spin: bool) -> list[float]:
    """/health's answer times, asked every 20 ms while one chat with a looping template renders (``spin``),
    or for as long on an idle server."""
    out: list[float] = []
    with httpx.Client(base_url=url, timeout=120) as c, httpx.Client(base_url=url, timeout=120) as bad:
        body = {"messages": MSGS, "max_tokens": 4, "chat_template_kwargs": {"spin": True}}
        t = threading.Thread(target=bad.post if spin else lambda *_, **__: time.sleep(2.0),
                             args=("/v1/chat/completions",), kwargs={"json": body})
        t.start()
        time.sleep(0.1)  # the render has begun
        while t.is_alive():
            t0 = time.perf_counter()
            c.get("/health")
            out.append(time.perf_counter() - t0)
            time.sleep(0.02)
        t.join()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--normal", type=int, default=4, help="normal clients (default 4)")
    ap.add_argument("--hostile", type=int, default=2, help="hostile clients (default 2)")
    ap.add_argument("--seconds", type=float, default=8.0, help="seconds per phase (default 8)")
    ap.add_argument("--n-predict", type=int, default=16, help="tokens per request (default 16)")
    ap.add_argument("--renders", type=int, default=200, help="renders timed for the render latency (default 200)")
    args = ap.parse_args()

    t_in, t_worker = render_latency(args.renders)
    print(f"render of the tiny chat template, median of {args.renders}: in-process {t_in * 1e3:.3f} ms, "
          f"through a template worker {t_worker * 1e3:.3f} ms")

    port = _free_port()
    cmd = [sys.executable, "-m", "pyspec", "serve", "--tiny", "--port", str(port), "--parallel", str(args.normal),
           "--n-ctx", str(512 * args.normal), "--threads", "1", "--types", "ngram-simple", "--temp", "0",
           "--chat-template", TRAPPED]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.time()
        while True:
            if proc.poll() is not None:
                raise SystemExit("pyspec serve exited")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() - t0 > 120:
                raise SystemExit("pyspec serve did not come up")
            time.sleep(0.2)
        run_phase(url, args.normal, 0, 2.0, args.n_predict)  # warm-up: slots, caches, template workers
        health_idle, health_spin = health_during(url, False), health_during(url, True)
        every = tuple(k for k, _, _ in hostile_bodies(1) if k != "plain")
        phases = [("normal only", 0, ()), ("+ plain", args.hostile, ("plain",))]
        phases += [(f"+ {k}", args.hostile, (k,)) for k in every] + [("+ all hostile", args.hostile, every)]
        results = [(name, run_phase(url, args.normal, m, args.seconds, args.n_predict, kinds))
                   for name, m, kinds in phases]
    finally:
        proc.terminate()
        proc.wait(30)

    for what, h in (("on the idle server", health_idle),
                    ("while one looping template renders (default budget 2 s)", health_spin)):
        print(f"/health {what}: {len(h)} probes, median {_pct(h, 0.5) * 1e3:.1f} ms, max {max(h) * 1e3:.1f} ms")
    print(f"\n{args.normal} normal clients (alternating /completion and chat, {args.n_predict} tokens, greedy), "
          f"{args.seconds:g} s per phase; each phase but the first adds {args.hostile} clients of that kind, "
          "back to back. Latency of the normal requests; x plain: the median over that with as many plain clients")
    print(f"{'phase':<16} {'compl n':>7} {'median':>8} {'p95':>8} {'x plain':>7}   {'chat n':>6} {'median':>8} "
          f"{'p95':>8} {'x plain':>7}   {'/health med':>11} {'max':>7}")
    plain = dict(results)["+ plain"]["lat"]
    for name, ph in results:
        row = f"{name:<16}"
        for path in ("/completion", "/v1/chat/completions"):
            xs, ps = ph["lat"].get(path, []), plain.get(path, [])
            ratio = _pct(xs, 0.5) / _pct(ps, 0.5) if xs and ps else float("nan")
            row += (f" {len(xs):>7} {_pct(xs, 0.5) * 1e3:>8.1f} {_pct(xs, 0.95) * 1e3:>8.1f} {ratio:>7.2f}  ")
        h = ph["health"]
        row += f" {_pct(h, 0.5) * 1e3:>11.1f} {max(h) * 1e3:>7.1f}"
        print(row)
    print("(ms; n: requests answered in the phase)\nhostile requests' answers:")
    answers: Counter[str] = Counter()
    for _, ph in results:
        answers.update(ph["answers"])
    for k, v in sorted(answers.items()):
        print(f"  {v:>4} x {k}")
    errs = [e for _, ph in results for e in ph["errors"]]
    print(f"normal requests that failed: {len(errs)}" + (f" (first: {errs[0]})" if errs else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
