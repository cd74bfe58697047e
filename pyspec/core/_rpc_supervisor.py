"""Keeps one rpc-server process tied to the Python process that started it.

Run as a script (``python rpc_supervisor.py BINARY ARGS...``) by
:class:`pyspec.core.rpc.RpcServer`, never imported by the package. It starts the
server, prints its pid, and waits. When its standard input closes (the parent
called stop(), or the parent died in any way, even by SIGKILL) it stops the
server: SIGTERM, then SIGKILL after two seconds. If the supervisor itself is
killed, the kernel kills the server (PR_SET_PDEATHSIG on Linux), so no
rpc-server outlives the process that asked for it.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import subprocess
import sys

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _die_with(parent: int):
    def preexec() -> None:
        if sys.platform.startswith("linux"):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the supervisor died before prctl took effect
            os._exit(1)

    return preexec


def main(argv: list[str]) -> int:
    # the server writes to our stderr (the log file); our stdout carries only its pid
    child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=sys.stderr, stderr=sys.stderr,
                             preexec_fn=_die_with(os.getpid()))
    print(child.pid, flush=True)
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))  # stop as if the parent had gone
    try:
        while child.poll() is None and not stop:
            readable, _, _ = select.select([0], [], [], 0.2)
            if readable and not os.read(0, 4096):
                break
    finally:
        if child.poll() is None:
            child.terminate()
            try:
                child.wait(2)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
    return child.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
