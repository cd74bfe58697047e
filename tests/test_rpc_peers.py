"""Peers that lie: every number an rpc-server reports is bounded before llama.cpp allocates for it.

A fake peer (a socket server in a thread, speaking protocol 7.0.0 as
vendor/llama.cpp/ggml/src/ggml-rpc/ggml-rpc.cpp frames it) answers the handshake
and the device listing, lying in one field at a time. ``rpc.probe_peer`` must refuse
each lie with RpcError naming the server, the field and the value; ``rpc.connect``
must refuse before ggml-rpc ever connects (run in a child with RLIMIT_AS, so a
regression is a failed assertion, not an OOM kill of the test process). The honest
peer, a real rpc-server, still lists its device and serves a tiny model's layers.
"""

from __future__ import annotations

import re
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from pyspec import Batch, Context, Model
from pyspec.core import rpc
from pyspec.errors import RpcConnectionError, RpcError
from pyspec.testing import models as tm

_VENDOR_RPC = Path(__file__).resolve().parents[1] / "vendor/llama.cpp/ggml"


# --- the fake peer ----------------------------------------------------------------------


@dataclass
class Lies:
    """What the fake peer answers; the defaults are an honest one-device CPU server."""

    version: tuple[int, int, int] = (7, 0, 0)
    device_count: int = 1
    alignment: int = 64
    max_size: int = (1 << 64) - 1  # a CPU buffer type has no limit (SIZE_MAX)
    free: int = 8 << 30
    total: int = 16 << 30
    # a reply to this command number is rewritten by this function (None: sent as is)
    tamper: dict[int, Callable[[socket.socket, bytes], bool]] = field(default_factory=dict)


def _recv(conn: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise ConnectionError
        buf += chunk
    return buf


class FakePeer:
    """One thread accepting clients on 127.0.0.1 and answering them from a :class:`Lies`."""

    def __init__(self, lies: Lies) -> None:
        self.lies = lies
        self.commands: list[int] = []  # every command received, in order
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(4)
        self.endpoint = f"127.0.0.1:{self._sock.getsockname()[1]}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _reply(self, cmd: int, payload: bytes) -> bytes:
        lie = self.lies
        if cmd == rpc.RPC_CMD_HELLO:
            return bytes(lie.version) + b"\0" + bytes(rpc.RPC_CONN_CAPS_SIZE)
        if cmd == rpc.RPC_CMD_DEVICE_COUNT:
            return struct.pack("<I", lie.device_count)
        if cmd == rpc.RPC_CMD_GET_ALIGNMENT:
            return struct.pack("<Q", lie.alignment)
        if cmd == rpc.RPC_CMD_GET_MAX_SIZE:
            return struct.pack("<Q", lie.max_size)
        if cmd == rpc.RPC_CMD_GET_DEVICE_MEMORY:
            return struct.pack("<QQ", lie.free, lie.total)
        raise ConnectionError  # anything else: hang up

    def _client(self, conn: socket.socket) -> None:
        with conn:
            while not self._stop.is_set():
                cmd, size = struct.unpack("<BQ", _recv(conn, 9))
                payload = _recv(conn, size)
                self.commands.append(cmd)
                reply = self._reply(cmd, payload)
                tamper = self.lies.tamper.get(cmd)
                if tamper is not None:
                    if not tamper(conn, reply):
                        return
                    continue
                conn.sendall(struct.pack("<Q", len(reply)) + reply)

    def _serve(self) -> None:
        self._sock.settimeout(0.1)
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                continue
            try:
                self._client(conn)
            except (ConnectionError, OSError):
                pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()


@pytest.fixture
def peer() -> Iterator[Callable[[Lies], FakePeer]]:
    made: list[FakePeer] = []

    def make(lies: Lies) -> FakePeer:
        made.append(FakePeer(lies))
        return made[-1]

    yield make
    for p in made:
        p.close()


def _stall(conn: socket.socket, reply: bytes) -> bool:
    conn.sendall(struct.pack("<Q", len(reply)) + reply[:2])  # half a reply, then silence
    time.sleep(3)
    return False


def _hang_up(conn: socket.socket, reply: bytes) -> bool:
    conn.sendall(struct.pack("<Q", len(reply)) + reply[:2])
    return False


def _longer(conn: socket.socket, reply: bytes) -> bool:
    conn.sendall(struct.pack("<Q", len(reply) + 8) + reply + bytes(8))
    return True


def _shorter(conn: socket.socket, reply: bytes) -> bool:
    conn.sendall(struct.pack("<Q", len(reply) - 1) + reply[:-1])
    return True


# --- the framing is the vendored source's -------------------------------------------------


def test_the_probe_speaks_the_vendored_protocol():
    header = (_VENDOR_RPC / "include/ggml-rpc.h").read_text()
    major = re.search(r"#define RPC_PROTO_MAJOR_VERSION\s+(\d+)", header)
    minor = re.search(r"#define RPC_PROTO_MINOR_VERSION\s+(\d+)", header)
    assert major and minor and (int(major[1]), int(minor[1])) == (rpc.RPC_PROTO_MAJOR, rpc.RPC_PROTO_MINOR)
    src = (_VENDOR_RPC / "src/ggml-rpc/ggml-rpc.cpp").read_text()
    enum = re.search(r"enum rpc_cmd \{(.*?)\};", src, re.S)
    assert enum is not None
    names = [n.split("=")[0].strip() for n in enum[1].split(",") if n.strip()]
    assert enum[1].split(",")[0].split() == ["RPC_CMD_ALLOC_BUFFER", "=", "0"]  # the rest count from 0
    for name in ("RPC_CMD_GET_ALIGNMENT", "RPC_CMD_GET_MAX_SIZE", "RPC_CMD_GET_DEVICE_MEMORY", "RPC_CMD_HELLO",
                 "RPC_CMD_DEVICE_COUNT"):
        assert names.index(name) == getattr(rpc, name), name
    transport = (_VENDOR_RPC / "src/ggml-rpc/transport.h").read_text()
    caps = re.search(r"RPC_CONN_CAPS_SIZE = (\d+);", transport)
    assert caps and int(caps[1]) == rpc.RPC_CONN_CAPS_SIZE


_C_SIZES = {"uint8_t": 1, "uint32_t": 4, "uint64_t": 8, "int32_t": 4}


def _struct_size(src: str, name: str) -> int:
    body = re.search(rf"struct {name} \{{(.*?)\}};", src, re.S)
    assert body is not None, name
    size = 0
    for field_ in body[1].split(";"):
        m = re.match(r"\s*(\w+)\s+\w+(?:\[(\w+)\])?\s*$", field_)
        if m is None:
            assert not field_.strip(), (name, field_)
            continue
        n = 1 if not m[2] else rpc.RPC_CONN_CAPS_SIZE if m[2] == "RPC_CONN_CAPS_SIZE" else int(m[2])
        size += _C_SIZES[m[1]] * n
    return size


def test_the_relay_knows_the_answer_of_every_vendored_command():
    # ggml-rpc aborts on an answer of another size, and the relay answers for a lost server:
    # its table must be the client's (csrc/pyspec_rpc.cpp answer_size)
    from pyspec.ffi import ext

    src = (_VENDOR_RPC / "src/ggml-rpc/ggml-rpc.cpp").read_text()
    enum = re.search(r"enum rpc_cmd \{(.*?)\};", src, re.S)
    assert enum is not None
    names = [n.split("=")[0].strip() for n in enum[1].split(",") if n.strip()]
    asked = dict(re.findall(r"send(?:_async)?\(RPC_CMD_(\w+), [^;]*?, &response, sizeof\((\w+)\)\)", src))
    asked |= dict(re.findall(r"send_rpc_cmd\(sock, RPC_CMD_(\w+), &request, sizeof\(request\), &(response), ", src))
    sent = set(re.findall(r"send(?:_async)?\(RPC_CMD_(\w+),", src))
    assert {"HELLO", "DEVICE_COUNT", "GET_TENSOR", "GRAPH_COMPUTE", "SET_TENSOR"} <= sent | set(asked)
    for cmd, name in enumerate(names):
        short = name.removeprefix("RPC_CMD_")
        got = int(ext.pyspec_rpc_answer_size(cmd, 12345))
        if short == "GET_TENSOR":  # its answer is the size the request asks for
            assert re.search(r"send(?:_async)?\(RPC_CMD_GET_TENSOR, request, sizeof\(\*request\), data, size\)", src)
            assert got == 12345
        elif short in asked:
            want = _struct_size(src, f"rpc_msg_{short.lower()}_rsp")
            assert got == want, (short, got, want)
        else:  # sent without an answer, or never sent by the client (NONE, COUNT)
            assert got == -1, (short, got)


def test_an_honest_fake_peer_passes_the_probe(peer):
    p = peer(Lies(device_count=2))
    reports = rpc.probe_peer(p.endpoint, timeout=5)
    assert reports == (rpc.RpcDeviceReport(64, (1 << 64) - 1, 8 << 30, 16 << 30),) * 2
    assert p.commands == [14, 15, 1, 2, 11, 1, 2, 11]


# --- each lie is refused, naming the field and the value -----------------------------------


@pytest.mark.parametrize(("lies", "message"), [
    (Lies(device_count=(1 << 32) - 1), r"device_count = 4294967295, not 1\.\.16"),
    (Lies(device_count=17), r"device_count = 17"),
    (Lies(device_count=0), r"device_count = 0"),
    (Lies(alignment=0), r"alignment of device 0 = 0, not a power of two"),
    (Lies(alignment=48), r"alignment of device 0 = 48, not a power of two"),
    (Lies(alignment=1 << 40), r"alignment of device 0 = 1099511627776"),
    (Lies(max_size=0), r"max_size of device 0 = 0, below"),
    (Lies(total=1 << 60, free=1), r"total memory of device 0 = 1152921504606846976, above"),
    (Lies(free=17 << 30), r"free memory of device 0 = 18253611008, above its total 17179869184"),
    (Lies(version=(6, 0, 0)), r"speaks RPC protocol 6\.0\.0"),
    (Lies(version=(7, 1, 0)), r"speaks RPC protocol 7\.1\.0"),
    (Lies(tamper={rpc.RPC_CMD_HELLO: _longer}), r"announced a HELLO reply of 36 bytes, not 28"),
    (Lies(tamper={rpc.RPC_CMD_DEVICE_COUNT: _shorter}), r"announced a DEVICE_COUNT reply of 3 bytes, not 4"),
    (Lies(tamper={rpc.RPC_CMD_GET_DEVICE_MEMORY: _longer}), r"GET_DEVICE_MEMORY reply of 24 bytes"),
])
def test_a_lie_is_refused_with_the_field_and_the_value(peer, lies, message):
    p = peer(lies)
    with pytest.raises(RpcError, match=message) as e:
        rpc.probe_peer(p.endpoint, timeout=5)
    assert p.endpoint in str(e.value)
    assert not isinstance(e.value, RpcConnectionError)


def test_a_peer_that_stops_answering_mid_reply_times_out(peer):
    # the peer hangs up 3 s after its half reply: "did not answer" means the 1 s deadline came first
    p = peer(Lies(tamper={rpc.RPC_CMD_DEVICE_COUNT: _stall}))
    with pytest.raises(RpcConnectionError, match=r"did not answer .* within 1 s") as e:
        rpc.probe_peer(p.endpoint, timeout=1)
    assert e.value.endpoints == (p.endpoint,)


def test_a_peer_that_hangs_up_mid_reply_is_a_lost_connection(peer):
    p = peer(Lies(tamper={rpc.RPC_CMD_GET_ALIGNMENT: _hang_up}))
    with pytest.raises(RpcConnectionError, match=r"closed the connection .* GET_ALIGNMENT reply \(2 of 8 bytes\)"):
        rpc.probe_peer(p.endpoint, timeout=5)


def test_a_peer_that_accepts_and_never_answers_times_out():
    with socket.socket() as s:  # listens, never accepts: the kernel completes the connection
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        with pytest.raises(RpcConnectionError, match="one client at a time"):
            rpc.probe_peer(f"127.0.0.1:{s.getsockname()[1]}", timeout=0.5)


# --- connect() refuses before ggml-rpc connects ---------------------------------------------

_CHILD = textwrap.dedent("""
    import resource, sys
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # a runaway allocation fails, not the machine
    from pyspec.core import rpc
    from pyspec.errors import RpcError
    try:
        rpc.connect(sys.argv[1])
    except RpcError as e:
        print(type(e).__name__, e)
    else:
        print("connected")
""")


@pytest.mark.slow
@pytest.mark.parametrize(("lies", "message"), [
    (Lies(device_count=(1 << 32) - 1), "device_count = 4294967295"),
    (Lies(version=(8, 0, 0)), "speaks RPC protocol 8.0.0"),
    (Lies(alignment=3), "alignment of device 0 = 3"),
])
def test_connect_refuses_a_lying_peer_before_ggml_talks_to_it(peer, lies, message):
    p = peer(lies)
    out = subprocess.run([sys.executable, "-c", _CHILD, p.endpoint], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("RpcError") and message in out.stdout, out.stdout
    assert p.commands[0] == rpc.RPC_CMD_HELLO  # one connection, ours: ggml-rpc never sent its own HELLO
    assert p.commands.count(rpc.RPC_CMD_HELLO) == 1


class _SecondTime:
    """A reply rewritten from the second connection on: honest to the probe, lying to ggml-rpc."""

    def __init__(self, lie: bytes) -> None:
        self.lie = lie
        self.seen = 0

    def __call__(self, conn: socket.socket, reply: bytes) -> bool:
        self.seen += 1
        out = reply if self.seen == 1 else self.lie
        conn.sendall(struct.pack("<Q", len(out)) + out)
        return True


@pytest.mark.slow
def test_a_peer_that_changes_its_version_for_ggml_is_refused_without_an_abort(peer):
    p = peer(Lies(tamper={rpc.RPC_CMD_HELLO: _SecondTime(bytes((6, 0, 0, 0)) + bytes(rpc.RPC_CONN_CAPS_SIZE))}))
    out = subprocess.run([sys.executable, "-c", _CHILD, p.endpoint], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("RpcConnectionError") and "another RPC protocol version" in out.stdout, out.stdout
    assert p.commands.count(rpc.RPC_CMD_HELLO) == 2  # ours, then ggml-rpc's


@pytest.mark.slow
def test_a_peer_that_changes_its_device_count_for_ggml_is_refused(peer):
    p = peer(Lies(tamper={rpc.RPC_CMD_DEVICE_COUNT: _SecondTime(struct.pack("<I", 2))}))
    out = subprocess.run([sys.executable, "-c", _CHILD, p.endpoint], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("RpcError") and "reported 1 devices, then 2" in out.stdout, out.stdout


@pytest.mark.slow
def test_an_absurd_device_count_for_ggml_is_stopped_at_the_relay(peer):
    # ggml-rpc makes one device object per reported device: 2**32 - 1 of them exhausted memory
    p = peer(Lies(tamper={rpc.RPC_CMD_DEVICE_COUNT: _SecondTime(struct.pack("<I", (1 << 32) - 1))}))
    out = subprocess.run([sys.executable, "-c", _CHILD, p.endpoint], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("RpcConnectionError") and "out of bounds" in out.stdout, out.stdout
    assert p.commands.count(rpc.RPC_CMD_DEVICE_COUNT) == 2  # ours, then ggml-rpc's


_MEMORY_CHILD = textwrap.dedent("""
    import sys, time
    from pyspec.core import rpc
    from pyspec.ffi import ext
    ep = rpc.connect(sys.argv[1])
    mem = rpc.device_memory(ep.devices[0], ep)
    # the relay's thread sees ggml-rpc's close on its own time: wait for it (bounded) on a loaded machine
    deadline = time.monotonic() + 20
    while int(ext.pyspec_rpc_connections(ep.ep_id, True)) and time.monotonic() < deadline:
        time.sleep(0.01)
    print(mem, int(ext.pyspec_rpc_losses(ep.ep_id)), int(ext.pyspec_rpc_connections(ep.ep_id, True)))
""")


@pytest.mark.slow
@pytest.mark.parametrize("lie", [bytes(24), struct.pack("<QQ", 2 << 50, 1 << 50)], ids=["size", "bounds"])
def test_a_reply_of_another_size_or_out_of_bounds_on_ggmls_connection_is_a_lost_connection(peer, lie):
    # was GGML_ABORT on ggml-rpc's dispatcher thread (RPC_STATUS_ASSERT): the process ended
    p = peer(Lies(tamper={rpc.RPC_CMD_GET_DEVICE_MEMORY: _SecondTime(lie)}))
    out = subprocess.run([sys.executable, "-c", _MEMORY_CHILD, p.endpoint], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    # no memory figure, one loss, and nothing holds the lost connection (ggml-rpc closed it after the call)
    assert out.stdout.split() == ["None", "1", "0"], out.stdout
    assert p.commands.count(rpc.RPC_CMD_GET_DEVICE_MEMORY) == 2


# --- the honest peer: a real rpc-server -----------------------------------------------------


@pytest.mark.slow
def test_a_real_rpc_server_passes_the_probe_and_serves_a_model():
    try:
        rpc.server_binary()
    except rpc.RpcUnavailableError as e:
        pytest.skip(str(e))
    path = tm.make_target()
    prompt = list(range(5, 15))
    with rpc.RpcServer(threads=1) as server:
        (report,) = rpc.probe_peer(server.endpoint)
        assert report.alignment & (report.alignment - 1) == 0 and 0 < report.free <= report.total
        with Model(path, devices=[]) as local_m, Context(local_m, n_ctx=64, n_batch=16, n_threads=1,
                                                         n_threads_batch=1) as local_c:
            want = _logits(local_c, prompt)
            n_layer = local_m.n_layer
        with Model(path, rpc_servers=[server], n_gpu_layers=n_layer) as m, Context(
                m, n_ctx=64, n_batch=16, n_threads=1, n_threads_batch=1) as c:
            assert [d.endpoint for d in m.devices] == [server.endpoint]
            got = _logits(c, prompt)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def _logits(ctx: Context, prompt: list[int]) -> np.ndarray:
    batch = Batch(len(prompt), 0, 1)
    for i, t in enumerate(prompt):
        batch.add(t, i, 0, i == len(prompt) - 1)
    ctx.decode(batch)
    return ctx.get_logits_ith(-1).copy()
