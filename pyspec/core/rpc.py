"""llama.cpp's RPC backend: rpc-server processes, connections, and guarded calls.

A model can keep some of its layers on other machines. Each of them runs
llama.cpp's ``rpc-server`` (built into this package), and
``Model(path, rpc_servers=["host:port", ...])`` puts layers on their devices
(named RPC0, RPC1, ...) and the rest on the local devices.

- :class:`RpcServer` starts and stops one rpc-server process on this machine,
  listening on 127.0.0.1 or on an explicit address; it never outlives the
  Python process that started it (see ``_rpc_supervisor.py``).
- :func:`connect` makes a server's devices known to this process, without
  registering them with ggml: a model uses them only when it names them.
- :class:`RpcLink` holds the servers one model lives on and makes the llama.cpp
  calls that reach them through the guard of ``csrc/pyspec_rpc.cpp``: a server
  that dies or stops answering raises :class:`~pyspec.errors.RpcConnectionError`
  within :data:`timeouts` instead of ending or hanging the process, and the
  model's objects can still be closed.

An rpc-server serves one client at a time and has no authentication: run it
only on a network you trust.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyspec.core import log
from pyspec.core.backend import ensure_backend
from pyspec.core.ext_error import last_error
from pyspec.errors import RpcConnectionError, RpcError, RpcUnavailableError
from pyspec.ffi import c_const, ext, ffi, ggml, lib_dir

__all__ = [
    "RpcDeviceReport",
    "RpcEndpoint",
    "RpcLink",
    "RpcServer",
    "RpcTimeouts",
    "connect",
    "connected",
    "endpoint_name",
    "probe_peer",
    "server_binary",
    "timeouts",
]

_OK = c_const("PYSPEC_RPC_OK")
_LOST = c_const("PYSPEC_RPC_LOST")
_TIMEOUT = c_const("PYSPEC_RPC_TIMEOUT")
_UNAVAILABLE = c_const("PYSPEC_RPC_UNAVAILABLE")
_REFUSED = c_const("PYSPEC_RPC_REFUSED")
_BAD_ARG = c_const("PYSPEC_RPC_BAD_ARG")


@dataclass
class RpcTimeouts:
    """Seconds one guarded call on rpc-servers may take before it fails with RpcConnectionError."""

    connect: float = 10.0  # reaching a server and its first answer
    call: float = 120.0  # one decode, encode, context creation or memory query
    load: float = 1800.0  # loading a model: its weights cross the network
    ping: float = 5.0  # the check before freeing a model or context


#: the limits every guarded call uses; change the fields to change them
timeouts = RpcTimeouts()


def server_binary() -> Path:
    """The rpc-server executable of this build; RpcUnavailableError if the build has none."""
    path = lib_dir() / "rpc-server"
    if not path.is_file():
        raise RpcUnavailableError(
            f"{path} not found: this build has no RPC backend (rebuild with CMAKE_ARGS=\"-DGGML_RPC=on\")"
        )
    return path


_ENDPOINT = re.compile(r"^(?P<host>[A-Za-z0-9.\-]+):(?P<port>\d{1,5})$")


def endpoint_name(server: str | RpcServer) -> str:
    """``"host:port"`` of a server given as that text or as an :class:`RpcServer`; ValueError if malformed."""
    if isinstance(server, RpcServer):
        return server.endpoint
    if not isinstance(server, str):
        raise TypeError(f"an RPC server is given as 'host:port' or an RpcServer, not {type(server).__name__}")
    m = _ENDPOINT.match(server.strip())
    if m is None or not 0 < int(m["port"]) < 65536:
        raise ValueError(f"RPC server {server!r} is not 'host:port' (an IPv4 address or host name, port 1..65535)")
    return f"{m['host']}:{int(m['port'])}"


def _host_port(name: str) -> tuple[str, int]:
    host, port = name.rsplit(":", 1)
    return host, int(port)


# --- connections -----------------------------------------------------------------


@dataclass(frozen=True)
class RpcEndpoint:
    """One rpc-server this process has connected to: its devices, as ggml device handles."""

    endpoint: str
    ep_id: int  # the guard's id for it (csrc/pyspec_rpc.cpp)
    devices: tuple[Any, ...]  # ggml_backend_dev_t, in the server's order


_lock = threading.Lock()
_connected: dict[str, RpcEndpoint] = {}


def connected() -> list[RpcEndpoint]:
    """The servers :func:`connect` has added, in the order they were added."""
    with _lock:
        return list(_connected.values())


def _raise_for(status: int, what: str, names: Sequence[str], timeout: float) -> None:
    if status == _OK:
        return
    where = ", ".join(names)
    if status == _TIMEOUT:
        raise RpcConnectionError(
            f"{what}: no answer from the rpc-server at {where} within {timeout:g} s; its connection was closed "
            "(an rpc-server serves one client at a time: is another process using it?)",
            tuple(names),
        )
    if status == _LOST:
        detail = last_error()
        because = f" ({detail})" if detail and "RPC server" not in detail else ""
        raise RpcConnectionError(f"{what}: the connection to the rpc-server at {where} was lost{because}",
                                 tuple(names))
    if status == _REFUSED:
        raise RpcConnectionError(
            f"{what}: the rpc-server at {where} refused the connection or speaks another RPC protocol version",
            tuple(names),
        )
    if status == _UNAVAILABLE:
        raise RpcUnavailableError('this build has no RPC backend (rebuild with CMAKE_ARGS="-DGGML_RPC=on")')
    detail = last_error()
    raise RpcError(f"{what} on the rpc-server at {where} failed: {detail or status}")


# --- checking a peer before ggml-rpc talks to it ------------------------------------
#
# ggml-rpc trusts every number a server sends: it makes one device object per
# reported device (a count of 2**32 - 1 exhausts memory), keeps the alignment and
# max size each buffer type reports for ever, and aborts on a wrong version or a
# reply of another size. So connect() first asks the same questions itself, over
# its own socket with a deadline, and refuses a server whose answers are out of
# bounds. The framing is that of ggml/src/ggml-rpc/ggml-rpc.cpp at this revision
# (protocol 7.0.0, tests/test_rpc_peers.py checks these numbers against it):
# request = command (1 byte) | size (u64) | payload, reply = size (u64) | payload,
# little-endian, the structs packed.

#: RPC_PROTO_MAJOR_VERSION / RPC_PROTO_MINOR_VERSION (ggml/include/ggml-rpc.h)
RPC_PROTO_MAJOR = 7
RPC_PROTO_MINOR = 0
#: enum rpc_cmd (ggml-rpc.cpp)
RPC_CMD_GET_ALIGNMENT = 1
RPC_CMD_GET_MAX_SIZE = 2
RPC_CMD_GET_DEVICE_MEMORY = 11
RPC_CMD_HELLO = 14
RPC_CMD_DEVICE_COUNT = 15
RPC_CONN_CAPS_SIZE = 24  # transport.h

#: what a peer may report; past a bound connect() raises RpcError naming the field
MAX_DEVICES = 16  # per server (GGML_RPC_MAX_SERVERS is 16 servers; 16 devices each is plenty)
MAX_MEMORY = 1 << 50  # 1 PiB per device
MAX_ALIGNMENT = 1 << 20  # 1 MiB (CPU 64 bytes, CUDA 128, Vulkan at most a few KiB)
MIN_MAX_SIZE = 1 << 20  # a smaller buffer limit would split a model into a buffer per tensor


@dataclass(frozen=True)
class RpcDeviceReport:
    """What a server reported for one device, within the bounds above."""

    alignment: int
    max_size: int
    free: int
    total: int


def _recv_exact(sock: socket.socket, n: int, name: str, deadline: float, what: str) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        sock.settimeout(left)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise RpcConnectionError(
                f"the rpc-server at {name} closed the connection in the middle of its {what} reply "
                f"({len(buf)} of {n} bytes)", (name,))
        buf += chunk
    return bytes(buf)


def _ask(sock: socket.socket, name: str, deadline: float, cmd: int, payload: bytes, reply_size: int,
         what: str) -> bytes:
    sock.settimeout(max(deadline - time.monotonic(), 0.001))
    sock.sendall(struct.pack("<BQ", cmd, len(payload)) + payload)
    (size,) = struct.unpack("<Q", _recv_exact(sock, 8, name, deadline, what))
    if size != reply_size:
        raise RpcError(f"the rpc-server at {name} announced a {what} reply of {size} bytes, not {reply_size} "
                       f"(protocol {RPC_PROTO_MAJOR}.{RPC_PROTO_MINOR}): not an rpc-server of this llama.cpp")
    return _recv_exact(sock, size, name, deadline, what)


def _bounded(name: str, field: str, value: int, ok: bool, bound: str) -> int:
    if not ok:
        raise RpcError(f"the rpc-server at {name} reports {field} = {value}, {bound}: refused")
    return value


def probe_peer(name: str, timeout: float | None = None) -> tuple[RpcDeviceReport, ...]:
    """Handshake with the rpc-server at ``name`` ("ip:port") and list its devices, checking every number.

    RpcConnectionError if it cannot be reached, closes, or does not answer within
    ``timeout`` (default ``timeouts.connect``); RpcError naming the server, the field
    and the value if it speaks another protocol or reports a value out of bounds.
    """
    limit = timeouts.connect if timeout is None else timeout
    deadline = time.monotonic() + limit
    try:
        with socket.create_connection(_host_port(name), timeout=limit) as sock:
            hello = _ask(sock, name, deadline, RPC_CMD_HELLO, bytes(RPC_CONN_CAPS_SIZE),
                         4 + RPC_CONN_CAPS_SIZE, "HELLO")
            major, minor, patch = hello[0], hello[1], hello[2]
            if major != RPC_PROTO_MAJOR or minor > RPC_PROTO_MINOR:
                raise RpcError(f"the rpc-server at {name} speaks RPC protocol {major}.{minor}.{patch}, this "
                               f"llama.cpp {RPC_PROTO_MAJOR}.{RPC_PROTO_MINOR}.x: refused")
            (n_dev,) = struct.unpack("<I", _ask(sock, name, deadline, RPC_CMD_DEVICE_COUNT, b"", 4, "DEVICE_COUNT"))
            _bounded(name, "device_count", n_dev, 0 < n_dev <= MAX_DEVICES, f"not 1..{MAX_DEVICES}")
            reports = []
            for dev in range(n_dev):
                req = struct.pack("<I", dev)
                (align,) = struct.unpack("<Q", _ask(sock, name, deadline, RPC_CMD_GET_ALIGNMENT, req, 8,
                                                    "GET_ALIGNMENT"))
                _bounded(name, f"alignment of device {dev}", align,
                         0 < align <= MAX_ALIGNMENT and align & (align - 1) == 0,
                         f"not a power of two up to {MAX_ALIGNMENT}")
                (max_size,) = struct.unpack("<Q", _ask(sock, name, deadline, RPC_CMD_GET_MAX_SIZE, req, 8,
                                                       "GET_MAX_SIZE"))
                _bounded(name, f"max_size of device {dev}", max_size, max_size >= MIN_MAX_SIZE,
                         f"below {MIN_MAX_SIZE}")
                free, total = struct.unpack("<QQ", _ask(sock, name, deadline, RPC_CMD_GET_DEVICE_MEMORY, req, 16,
                                                        "GET_DEVICE_MEMORY"))
                _bounded(name, f"total memory of device {dev}", total, total <= MAX_MEMORY,
                         f"above {MAX_MEMORY} (1 PiB)")
                _bounded(name, f"free memory of device {dev}", free, free <= total, f"above its total {total}")
                reports.append(RpcDeviceReport(align, max_size, free, total))
            return tuple(reports)
    except TimeoutError:
        raise RpcConnectionError(
            f"the rpc-server at {name} did not answer the handshake and device listing within {limit:g} s "
            "(an rpc-server serves one client at a time: is another process using it?)", (name,)) from None
    except RpcError:
        raise
    except OSError as e:
        raise RpcConnectionError(f"cannot reach an rpc-server at {name}: {e}", (name,)) from None


def connect(server: str | RpcServer) -> RpcEndpoint:
    """Connect to a running rpc-server and learn its devices (once per endpoint and process).

    The endpoint is known by its IPv4 address from then on (``RpcEndpoint.endpoint``):
    two spellings of one server ("localhost:50052", "127.0.0.1:50052") are one server.
    """
    host, port = _host_port(endpoint_name(server))
    try:
        name = f"{socket.gethostbyname(host)}:{port}"  # as ggml-rpc resolves it
    except OSError:
        raise ValueError(f"RPC server {host}:{port}: its host name does not resolve to an IPv4 address") from None
    ensure_backend()
    with _lock:
        known = _connected.get(name)
        if known is not None:
            _refuse_if_lost_and_held(known)
            return known
        ext.pyspec_rpc_guard_install()
        ep_id = int(ext.pyspec_rpc_watch(name.encode()))
        if ep_id < 0 and ep_id != _BAD_ARG:
            raise RpcError(f"RPC server {name}: the guard could not open its relay on 127.0.0.1")
        if ep_id < 0:
            raise ValueError(f"RPC server {name!r}: its host name does not resolve to an IPv4 address")
        relay = ffi.new("char[64]")
        ext.pyspec_rpc_relay_name(ep_id, relay, 64)  # "127.0.0.1:port" fits
        # llama.cpp's names for the server's devices and buffers carry the relay's address
        log.rename(ffi.string(relay).decode(), name)
        # ggml-rpc's own connect has no timeout, and it trusts what the server reports
        reports = probe_peer(name)
        status = ffi.new("int32_t *")
        reg = ext.pyspec_rpc_add_server(name.encode(), ep_id, timeouts.connect, status)
        _raise_for(int(status[0]), "connecting", (name,), timeouts.connect)
        n_dev = int(ggml.ggml_backend_reg_dev_count(reg))
        if n_dev != len(reports):  # it changed its answer between our look and ggml's
            raise RpcError(f"the rpc-server at {name} reported {len(reports)} devices, then {n_dev}: refused")
        devs = tuple(ggml.ggml_backend_reg_dev_get(reg, i) for i in range(n_dev))
        ep = RpcEndpoint(name, ep_id, devs)
        _connected[name] = ep
        return ep


def _refuse_if_lost_and_held(ep: RpcEndpoint) -> None:
    # ggml-rpc keeps one connection per endpoint while anything uses it, so a lost one
    # would be handed to every new model until the objects holding it are closed
    ext.pyspec_rpc_check(ffi.new("int32_t[]", [ep.ep_id]), 1)
    if ext.pyspec_rpc_connections(ep.ep_id, True) > 0:
        raise RpcConnectionError(
            f"the connection to the rpc-server at {ep.endpoint} was lost and models or contexts loaded on it "
            "are still open: close them before using that server again",
            (ep.endpoint,),
        )


def endpoint_of_device(dev: Any) -> RpcEndpoint | None:
    """The connected server a ggml device belongs to, or None for a local device."""
    with _lock:
        for ep in _connected.values():
            if any(dev == d for d in ep.devices):
                return ep
    return None


def device_memory(dev: Any, ep: RpcEndpoint) -> tuple[int, int] | None:
    """(free, total) bytes of an RPC device, asked of its server through the guard; None if it does not answer."""
    ids = ffi.new("int32_t[]", [ep.ep_id])
    ext.pyspec_rpc_check(ids, 1)
    if ext.pyspec_rpc_connections(ep.ep_id, True) > 0:
        return None  # lost, and still held by open models
    if ext.pyspec_rpc_connections(ep.ep_id, False) == 0:
        # ggml-rpc would open a connection, and its connect has no timeout
        try:
            socket.create_connection(_host_port(ep.endpoint), timeout=timeouts.connect).close()
        except OSError:
            return None
    free, total = ffi.new("size_t *"), ffi.new("size_t *")
    status = ext.pyspec_rpc_dev_memory(dev, free, total, ids, 1, timeouts.call)
    if status != _OK or total[0] == 0:
        return None
    _bounded(ep.endpoint, "total memory", int(total[0]), total[0] <= MAX_MEMORY, f"above {MAX_MEMORY} (1 PiB)")
    _bounded(ep.endpoint, "free memory", int(free[0]), free[0] <= total[0], f"above its total {total[0]}")
    return int(free[0]), int(total[0])


class RpcLink:
    """The rpc-servers one model lives on, and the llama.cpp calls on that model that reach them.

    Every call runs inside the guard with a deadline from :data:`timeouts`. Once a
    connection of the model was lost, the model and its contexts refuse further work
    (their weights and caches were on that server) but can still be closed.
    """

    def __init__(self, endpoints: Sequence[RpcEndpoint]) -> None:
        self.endpoints = tuple(endpoints)
        self.names = tuple(ep.endpoint for ep in self.endpoints)
        self._ids = ffi.new("int32_t[]", [ep.ep_id for ep in self.endpoints])
        self._n = len(self.endpoints)
        self._losses = self._loss_counts()

    def _loss_counts(self) -> list[int]:
        return [int(ext.pyspec_rpc_losses(ep.ep_id)) for ep in self.endpoints]

    @property
    def lost(self) -> bool:
        """Whether a connection to one of the servers was lost since this link was made."""
        return self._loss_counts() != self._losses

    def check_fresh(self) -> None:
        """Refuse to load on a server whose lost connection objects still hold (ggml-rpc would reuse it)."""
        ext.pyspec_rpc_check(self._ids, self._n)
        stale = [ep.endpoint for ep in self.endpoints if ext.pyspec_rpc_connections(ep.ep_id, True) > 0]
        if stale:
            raise RpcConnectionError(
                f"the connection to the rpc-server at {', '.join(stale)} was lost and models or contexts loaded "
                "on it are still open: close them before using that server again",
                tuple(stale),
            )
        self._losses = self._loss_counts()

    def ensure_usable(self, what: str) -> None:
        """RpcConnectionError if a connection of this model was lost (checked without a network call)."""
        ext.pyspec_rpc_check(self._ids, self._n)
        if self.lost:
            raise RpcConnectionError(
                f"{what}: the connection to the rpc-server at {', '.join(self.names)} was lost; this model's "
                "weights were there, so it and its contexts can only be closed now",
                self.names,
            )

    def _status(self, status: int, what: str, timeout: float) -> None:
        _raise_for(status, what, self.names, timeout)

    def load_model(self, path: str, params: Any) -> Any:
        """llama_model_load_from_file, guarded; NULL when llama.cpp refused the file (not a connection problem)."""
        self.check_fresh()
        status = ffi.new("int32_t *")
        ptr = ext.pyspec_rpc_model_load(path.encode(), params, self._ids, self._n, timeouts.load, status)
        self._status(int(status[0]), "loading the model", timeouts.load)
        return ptr

    def init_context(self, model_ptr: Any, cparams: Any) -> Any:
        """llama_init_from_model, guarded."""
        self.ensure_usable("creating a context")
        status = ffi.new("int32_t *")
        ptr = ext.pyspec_rpc_init_from_model(model_ptr, cparams, self._ids, self._n, timeouts.call, status)
        self._status(int(status[0]), "creating a context", timeouts.call)
        return ptr

    def decode(self, ctx_ptr: Any, batch: Any) -> int:
        """llama_decode, guarded: its result, or RpcConnectionError."""
        self.ensure_usable("llama_decode")
        rc = ffi.new("int32_t *")
        self._status(int(ext.pyspec_rpc_decode(ctx_ptr, batch, self._ids, self._n, timeouts.call, rc)),
                     "llama_decode", timeouts.call)
        return int(rc[0])

    def process(self, ctx_ptr: Any, kind: int, batch_ptr: Any) -> int:
        """llama_process (the extended batch), guarded."""
        self.ensure_usable("llama_process")
        rc = ffi.new("int32_t *")
        self._status(int(ext.pyspec_rpc_process(ctx_ptr, kind, batch_ptr, self._ids, self._n, timeouts.call, rc)),
                     "llama_process", timeouts.call)
        return int(rc[0])

    def encode(self, ctx_ptr: Any, batch: Any) -> int:
        """llama_encode, guarded."""
        self.ensure_usable("llama_encode")
        rc = ffi.new("int32_t *")
        self._status(int(ext.pyspec_rpc_encode(ctx_ptr, batch, self._ids, self._n, timeouts.call, rc)),
                     "llama_encode", timeouts.call)
        return int(rc[0])

    @contextlib.contextmanager
    def region(self, what: str) -> Iterator[None]:
        """Guard one call into pyspec's C++ reference or loop (which catch C++ exceptions themselves):
        a lost or silent server ends that call with its error status, and RpcConnectionError follows."""
        self.ensure_usable(what)
        ext.pyspec_rpc_region_begin(self._ids, self._n, timeouts.call)
        try:
            yield
        finally:
            status = int(ext.pyspec_rpc_region_end())
        self._status(status, what, timeouts.call)

    def free(self, free_fn: Callable[[Any], None]) -> Callable[[Any], None]:
        """``free_fn`` (llama_free / llama_model_free) preceded by a check that makes it safe.

        ggml-rpc frees remote buffers with a request whose failure aborts, and a free
        cannot be guarded (it runs in destructors). So each server is asked one cheap
        question first, with a short deadline: a server that is gone or silent has its
        connection handed to the guard's stand-in, which answers the free requests.
        """

        def free(ptr: Any) -> None:
            if not self.lost:
                for ep in self.endpoints:
                    if ep.devices:
                        free_b, total_b = ffi.new("size_t *"), ffi.new("size_t *")
                        ids = ffi.new("int32_t[]", [ep.ep_id])
                        ext.pyspec_rpc_dev_memory(ep.devices[0], free_b, total_b, ids, 1, timeouts.ping)
            ext.pyspec_rpc_check(self._ids, self._n)
            free_fn(ptr)

        return free


# --- rpc-server processes -----------------------------------------------------------


_live_servers: weakref.WeakSet[RpcServer] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for server in list(_live_servers):
        server.stop()


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _listens(pid: int, port: int) -> bool | None:
    """Whether process ``pid`` itself listens on TCP ``port`` (Linux /proc); None where /proc cannot tell.

    A connection test alone could be answered by some other process holding the port.
    """
    if not os.path.exists("/proc/net/tcp"):
        return None
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                for line in f.readlines()[1:]:
                    fields = line.split()  # sl local_address rem_address st ... inode
                    if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                        inodes.add(fields[9])
        except (OSError, IndexError, ValueError):
            continue
    fd_dir = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:  # the process is gone
        return False
    for fd in fds:
        try:
            link = os.readlink(os.path.join(fd_dir, fd))
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:[") and link[8:-1] in inodes:
            return True
    return False


class RpcServer:
    """One llama.cpp rpc-server process on this machine, stopped with this object or this process.

        with RpcServer() as server:                  # 127.0.0.1, a free port
            model = Model(path, rpc_servers=[server])

    ``host`` is the IPv4 address it listens on: 127.0.0.1, or an address of this
    machine (0.0.0.0 for all) so that other machines can use it. ``threads`` sets
    the threads of its CPU device (rpc-server's default is half the cores);
    ``devices`` names the local devices it serves (default: its accelerators, else
    the CPU); ``cache`` enables rpc-server's local file cache of large tensors.
    RpcError if it does not start listening within ``start_timeout`` seconds.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int | None = None,
        *,
        threads: int | None = None,
        devices: Sequence[str] | None = None,
        cache: bool = False,
        start_timeout: float = 30.0,
    ) -> None:
        try:
            socket.inet_aton(host)
        except OSError:
            raise ValueError(f"rpc-server listens on an IPv4 address, not {host!r}") from None
        if port is not None and not 0 < port < 65536:
            raise ValueError(f"port must be 1..65535, not {port}")
        if threads is not None and threads <= 0:
            raise ValueError(f"threads must be positive, not {threads}")
        self.host = host
        self._binary = server_binary()
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_path: Path | None = None
        self._log_text = ""
        self.pid: int | None = None  # the rpc-server's own pid (not its supervisor's)
        args = ["-H", host]
        if threads is not None:
            args += ["-t", str(threads)]
        if devices:
            args += ["-d", ",".join(devices)]
        if cache:
            args.append("-c")
        for _attempt in range(3):
            self.port = port if port is not None else _free_port(host)
            if self._start([*args, "-p", str(self.port)], start_timeout):
                return
            if port is not None or "Failed to create server socket" not in self._log_text:
                break  # a port of our choosing was taken meanwhile: try another; anything else is final
        output = self._log_text.strip()[-2000:] or "no output"
        raise RpcError(f"rpc-server on {host}:{self.port} did not start: {output}")

    @property
    def endpoint(self) -> str:
        """``"host:port"`` to connect to from this machine."""
        host = "127.0.0.1" if self.host == "0.0.0.0" else self.host
        return f"{host}:{self.port}"

    def _start(self, args: list[str], start_timeout: float) -> bool:
        fd, log = tempfile.mkstemp(prefix="pyspec-rpc-server-", suffix=".log")
        self._log_path = Path(log)
        supervisor = Path(__file__).with_name("_rpc_supervisor.py")
        try:
            self._proc = subprocess.Popen(
                [sys.executable, str(supervisor), str(self._binary), *args],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=fd, close_fds=True,
            )
        finally:
            os.close(fd)
        _live_servers.add(self)
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        self.pid = int(line) if line.strip().isdigit() else None
        deadline = time.monotonic() + start_timeout
        host, port = _host_port(self.endpoint)
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                self.stop()
                return False
            listens = _listens(self.pid, port) if self.pid is not None else None
            if listens:
                return True
            if listens is None:  # no /proc: a connection tells (the server takes it for a client that left)
                try:
                    socket.create_connection((host, port), timeout=0.5).close()
                    return True
                except OSError:
                    pass
            time.sleep(0.05)
        self.stop()
        self._log_text += f"\n(not listening after {start_timeout:g} s)"
        return False

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log(self) -> str:
        """What the server has written so far (its stdout is block-buffered: mostly at exit)."""
        if self._log_path is not None and self._log_path.exists():
            return self._log_path.read_text(errors="replace")
        return self._log_text

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the rpc-server itself (not its supervisor): what a crash looks like."""
        if self.pid is not None and self.running:
            os.kill(self.pid, sig)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the server and wait for it (idempotent).

        Models and contexts of this process that use it are lost from then on (they
        raise RpcConnectionError) and can still be closed.
        """
        proc, self._proc = self._proc, None
        if proc is not None:
            with _lock:
                ep = _connected.get(self.endpoint)
            if ep is not None:  # close our connections first: later frees then do not reach for it
                ext.pyspec_rpc_retire(ep.ep_id)
            if proc.stdin is not None:
                proc.stdin.close()  # the supervisor stops the server when its stdin closes
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()  # the kernel then kills the server (PR_SET_PDEATHSIG)
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        if self._log_path is not None:
            self._log_text = self.log()
            self._log_path.unlink(missing_ok=True)
            self._log_path = None
        _live_servers.discard(self)

    def __enter__(self) -> RpcServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __del__(self) -> None:
        try:
            self.stop()
        except Exception:
            pass

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"RpcServer({self.endpoint!r}, {state})"
