"""Run code that might crash the interpreter in a worker process, so a signal is a result, not the end.

A :class:`Worker` is a child interpreter that imports a module, calls its ``setup()``
once (loading models is the slow part) and then runs the module's functions by name,
one call per request, reporting back what each returned or raised. When a call kills
the child (SIGSEGV, SIGABRT, ...) or hangs past the timeout, the parent records a
``signal`` / ``hang`` result naming the call and starts a fresh child for the next one.

    with Worker("tests.audit_cases") as w:
        r = w.call("ctx_n_seq_max_above_n_batch")
        assert r.status == "raised" and "ValueError" in r.exc_types

The protocol is one JSON line each way on the child's stdin / stdout; the child's own
stdout is redirected to stderr so that llama.cpp or test output cannot garble it.
"""

from __future__ import annotations

import base64
import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["CallResult", "Worker"]

_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class CallResult:
    """What one call did: ``ok`` (returned), ``raised``, ``signal`` (the child died) or ``hang``."""

    name: str
    status: str
    value: Any = None
    exc_types: list[str] = field(default_factory=list)  # the exception's class and its bases, most derived first
    message: str = ""
    signal: int = 0

    @property
    def crashed(self) -> bool:
        return self.status in ("signal", "hang")

    def describe(self) -> str:
        if self.status == "raised":
            return f"{self.name}: raised {self.exc_types[0]}: {self.message}"
        if self.status == "signal":
            return f"{self.name}: killed by signal {self.signal} ({signal.Signals(self.signal).name})"
        if self.status == "hang":
            return f"{self.name}: no answer (hang)"
        return f"{self.name}: returned {self.value!r}"


class Worker:
    """A child interpreter running functions of ``module`` on request (see the module docstring)."""

    def __init__(self, module: str, *, timeout: float = 120.0, env: dict[str, str] | None = None,
                 setup_timeout: float = 300.0) -> None:
        self.module = module
        self.timeout = timeout
        self.setup_timeout = setup_timeout
        self.env = {**os.environ, **(env or {})}
        self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_ROOT), self.env.get("PYTHONPATH", "")]))
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pyspec.testing.crashsafe", self.module],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=self.env, cwd=str(_ROOT),
        )
        line = self._read_line(self.setup_timeout)
        if line is None or json.loads(line).get("ready") is not True:
            rc = self._kill()
            raise RuntimeError(f"worker for {self.module} did not start (exit {rc})")

    def _read_line(self, timeout: float) -> bytes | None:
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        buf = b""
        while not buf.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            buf += chunk
        return buf

    def _kill(self) -> int:
        proc, self.proc = self.proc, None
        if proc is None:
            return 0
        if proc.poll() is None:
            proc.kill()
        rc = proc.wait()
        for f in (proc.stdin, proc.stdout):
            if f is not None:
                f.close()
        return rc

    def call(self, name: str, *args: Any, data: bytes | None = None, timeout: float | None = None) -> CallResult:
        """Run ``module.name(*args[, data])`` in the child; JSON-able args, optional raw bytes."""
        if self.proc is None:
            self._start()
        assert self.proc is not None and self.proc.stdin is not None
        req = {"name": name, "args": list(args)}
        if data is not None:
            req["data"] = base64.b64encode(data).decode()
        try:
            self.proc.stdin.write(json.dumps(req).encode() + b"\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass
        line = self._read_line(self.timeout if timeout is None else timeout)
        if line is None:
            alive = self.proc.poll() is None
            rc = self._kill()
            self.restarts += 1
            if alive:
                return CallResult(name, "hang")
            return CallResult(name, "signal", signal=-rc if rc < 0 else 0) if rc < 0 else CallResult(
                name, "signal", message=f"worker exited with {rc}")
        rep = json.loads(line)
        return CallResult(name, rep["status"], rep.get("value"), rep.get("exc_types", []), rep.get("message", ""))

    def close(self) -> None:
        if self.proc is not None and self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._kill()


def _serve(module_name: str) -> None:
    import importlib

    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # everything else the child prints goes to stderr
    sys.stdout = sys.stderr
    mod = importlib.import_module(module_name)
    if hasattr(mod, "setup"):
        mod.setup()
    out.write(json.dumps({"ready": True}).encode() + b"\n")
    for line in sys.stdin.buffer:
        req = json.loads(line)
        args = list(req.get("args", []))
        if "data" in req:
            args.append(base64.b64decode(req["data"]))
        try:
            value = getattr(mod, req["name"])(*args)
            try:
                json.dumps(value)
            except TypeError:
                value = repr(value)
            rep: dict[str, Any] = {"status": "ok", "value": value}
        except BaseException as e:
            if isinstance(e, KeyboardInterrupt):
                raise
            rep = {"status": "raised", "exc_types": [c.__name__ for c in type(e).__mro__], "message": str(e)[:2000]}
        out.write(json.dumps(rep).encode() + b"\n")


if __name__ == "__main__":
    _serve(sys.argv[1])
