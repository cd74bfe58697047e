"""llama.cpp's RPC backend on 127.0.0.1: rpc-server processes, models split across them, lost servers.

Every server here is a real rpc-server process of this build (pyspec/lib/rpc-server).
The tests that kill or freeze a server run in this process on purpose: the point is
that the process goes on.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import numpy as np
import pytest

from pyspec import Batch, Context, Model
from pyspec.core import rpc
from pyspec.core.backend import devices
from pyspec.errors import RpcConnectionError
from pyspec.generation.contexts import load_models, open_contexts, parse_types, spec_params
from pyspec.generation.driver import generate
from pyspec.testing import models as tm

pytestmark = pytest.mark.slow  # rpc-servers in subprocesses, killed and frozen: not in `pytest -m "not slow"`

try:
    rpc.server_binary()
except rpc.RpcUnavailableError as e:  # a build made with -DGGML_RPC=off
    pytest.skip(str(e), allow_module_level=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its parent) counts as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def _wait_gone(pid: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def server() -> Iterator[rpc.RpcServer]:
    with rpc.RpcServer(threads=1) as s:
        yield s


@pytest.fixture(scope="module")
def server2() -> Iterator[rpc.RpcServer]:
    with rpc.RpcServer(threads=1) as s:
        yield s


@pytest.fixture
def short_timeouts() -> Iterator[rpc.RpcTimeouts]:
    saved = rpc.RpcTimeouts(**vars(rpc.timeouts))
    rpc.timeouts.call = rpc.timeouts.connect = rpc.timeouts.ping = 2.0
    yield rpc.timeouts
    for k, v in vars(saved).items():
        setattr(rpc.timeouts, k, v)


def _ctx(model: Model, n_ctx: int, n_batch: int) -> Context:
    # one thread: two threads spinning at a barrier stall for whole time slices on a loaded 2-core machine
    return Context(model, n_ctx=n_ctx, n_batch=n_batch, n_threads=1, n_threads_batch=1)


def _greedy_tokens(ctx: Context, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """Plain greedy decoding, one token per decode; the tokens and the first logits row."""
    ctx.memory.clear()
    batch = Batch(len(prompt) + 1, 0, 1)
    for i, t in enumerate(prompt):
        batch.add(t, i, 0, i == len(prompt) - 1)
    ctx.decode(batch)
    first = ctx.get_logits_ith(-1).copy()
    out = []
    pos = len(prompt)
    for _ in range(n):
        tok = int(np.argmax(ctx.get_logits_ith(-1)))
        out.append(tok)
        batch.clear()
        batch.add(tok, pos, 0, True)
        ctx.decode(batch)
        pos += 1
    return out, first


# --- server processes -------------------------------------------------------------


def test_server_listens_and_stop_leaves_no_process():
    s = rpc.RpcServer()
    pid = s.pid
    assert pid is not None and _alive(pid) and s.running
    socket.create_connection(("127.0.0.1", s.port), timeout=2).close()
    s.stop()
    assert not s.running
    assert _wait_gone(pid)
    s.stop()  # idempotent


def test_server_dies_with_the_python_process_that_started_it(tmp_path):
    # a child Python starts a server, reports its pid, and is killed with SIGKILL (no atexit, no cleanup)
    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {os.getcwd()!r})
        from pyspec.core.rpc import RpcServer
        s = RpcServer()
        print(s.pid, flush=True)
        time.sleep(60)
    """)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=os.environ.copy())
    assert child.stdout is not None
    pid = int(child.stdout.readline())
    assert _alive(pid)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert _wait_gone(pid), "rpc-server outlived the process that started it"


def test_a_server_can_listen_on_an_explicit_address():
    with rpc.RpcServer(host="0.0.0.0") as s:  # every address of this machine
        assert s.endpoint == f"127.0.0.1:{s.port}"  # reached from here through the loopback
        socket.create_connection(("127.0.0.1", s.port), timeout=2).close()
    with pytest.raises(ValueError, match="IPv4 address"):
        rpc.RpcServer(host="my-laptop")


def test_a_port_in_use_is_reported_with_the_server_output():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        with pytest.raises(rpc.RpcError, match="did not start"):
            rpc.RpcServer(port=port, start_timeout=10)


@pytest.mark.parametrize("bad", ["localhost", "127.0.0.1:0", "127.0.0.1:70000", "a b:1", ":5"])
def test_malformed_endpoints_are_refused(bad):
    with pytest.raises(ValueError, match="host:port"):
        rpc.endpoint_name(bad)


def test_an_unreachable_server_raises_quickly(short_timeouts):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(RpcConnectionError, match="cannot reach") as e:
        rpc.connect(f"127.0.0.1:{port}")
    assert time.monotonic() - t0 < 5
    assert e.value.endpoints == (f"127.0.0.1:{port}",)


def test_a_server_busy_with_another_client_times_out_clearly(short_timeouts):
    with rpc.RpcServer() as s, socket.create_connection(("127.0.0.1", s.port)):
        time.sleep(0.2)  # the server accepted that client and waits for its first request
        t0 = time.monotonic()
        with pytest.raises(RpcConnectionError, match="one client at a time"):
            rpc.connect(s)
        assert time.monotonic() - t0 < 2.0 + 3


# --- devices and models ---------------------------------------------------------------


def test_connected_servers_list_their_devices_with_memory(server):
    ep = rpc.connect(server)
    assert rpc.connect(server.endpoint) is ep  # once per endpoint
    assert rpc.connect(f"localhost:{server.port}") is ep  # one server, however it is spelt
    rpc_devs = [d for d in devices() if d.endpoint == server.endpoint]
    assert len(rpc_devs) == len(ep.devices) == 1
    d = rpc_devs[0]
    assert d.name.startswith("RPC") and d.type == "GPU" and d.backend == f"RPC[{server.endpoint}]"
    assert 0 < d.memory_free <= d.memory_total  # the server's CPU memory


class LlamaLog(logging.Handler):
    """llama.cpp's log lines (logger pyspec.llama) at INFO, while in a with block."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self._logger = logging.getLogger("pyspec.llama")

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def __enter__(self) -> LlamaLog:
        self._level = self._logger.level
        self._logger.setLevel(logging.INFO)
        self._logger.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self._logger.removeHandler(self)
        self._logger.setLevel(self._level)


@pytest.fixture
def llama_log() -> Iterator[LlamaLog]:
    with LlamaLog() as log:
        yield log


def _buffer_sizes(log: LlamaLog) -> dict[str, float]:
    # llama.cpp logs "load_tensors: <buffer> model buffer size = <MiB> MiB" per buffer
    out = {}
    for msg in log.lines:
        if "model buffer size" in msg:
            name = msg.split(":", 1)[1].split("model buffer size")[0].strip()
            out[name] = float(msg.rsplit("=", 1)[1].split()[0])
    return out


def _rpc_buffer_sizes(llama_log) -> dict[str, float]:
    # an RPC buffer is named "RPC<device on the server>[host:port]"
    return {k.split("[", 1)[1].rstrip("]"): v for k, v in _buffer_sizes(llama_log).items() if k.startswith("RPC")}


def test_a_model_split_across_an_rpc_server_and_the_cpu_computes_what_the_cpu_computes(server, llama_log):
    path = tm.make_target()
    prompt = list(range(5, 25))
    with Model(path, devices=[]) as local_m, _ctx(local_m, 256, 64) as local_c:
        want_tokens, want_logits = _greedy_tokens(local_c, prompt, 12)
        n_layer = local_m.n_layer
    llama_log.lines.clear()
    with Model(path, rpc_servers=[server], n_gpu_layers=n_layer // 2) as m, _ctx(m, 256, 64) as c:
        assert [d.endpoint for d in m.devices] == [server.endpoint]
        assert m.rpc is not None and m.rpc.names == (server.endpoint,)
        sizes = _buffer_sizes(llama_log)
        assert _rpc_buffer_sizes(llama_log)[server.endpoint] > 0, sizes
        assert any(k.startswith("CPU") and v > 0 for k, v in sizes.items()), sizes
        got_tokens, got_logits = _greedy_tokens(c, prompt, 12)
    assert got_tokens == want_tokens
    np.testing.assert_allclose(got_logits, want_logits, rtol=1e-4, atol=1e-4)


def test_tensor_split_spreads_a_model_over_two_servers(server, server2, llama_log):
    path = tm.make_target()
    with Model(path, rpc_servers=[server, server2], tensor_split=[1, 3]) as m:
        assert [d.endpoint for d in m.devices] == [server.endpoint, server2.endpoint]
        by_server = _rpc_buffer_sizes(llama_log)
        assert set(by_server) == {server.endpoint, server2.endpoint}, by_server
        assert by_server[server2.endpoint] > 2 * by_server[server.endpoint]  # 3 shares against 1
        with _ctx(m, 128, 32) as c:
            toks, _ = _greedy_tokens(c, [1, 2, 3, 4], 4)
            assert len(toks) == 4


def test_split_mode_none_puts_the_offloaded_layers_on_main_gpu(server, server2, llama_log):
    path = tm.make_target()
    with Model(path, rpc_servers=[server, server2], split_mode="none", main_gpu=1):
        assert list(_rpc_buffer_sizes(llama_log)) == [server2.endpoint]
    with pytest.raises(ValueError, match="main_gpu 2 out of range"):
        Model(path, rpc_servers=[server, server2], split_mode="none", main_gpu=2)


def test_speculative_generation_with_the_target_on_rpc_and_the_draft_local_equals_the_local_run(server, server2):
    types = parse_types("draft-simple")
    prompt = "the quick brown fox"
    results = {}
    for where, kw in (("local", {"devices": []}), ("rpc", {"rpc_servers": [server, server2]})):
        # batch-invariant settings: no weight repacking on the CPU (DESIGN.md, numerics)
        target, draft = tm.tiny_model_paths(types)
        with load_models(types, model=target, draft=draft, draft_kw={"devices": [], "use_extra_bufts": False},
                         use_extra_bufts=False, **kw) as ms:
            assert (ms.target.rpc is not None) == (where == "rpc")
            assert ms.draft is not None and ms.draft.devices == [] and ms.draft.rpc is None
            spec = spec_params(types, n_max=4)
            with open_contexts(ms, spec, n_ctx=256, n_batch=64, n_threads=1) as cs:
                res, stats = generate(cs.ctx_tgt, prompt, 24, spec=spec)
                results[where] = res.tokens
                assert stats.as_dict()  # the run produced statistics
    assert len(results["local"]) == 24
    assert results["rpc"] == results["local"]


def test_the_cpp_loop_runs_a_target_on_rpc_as_the_python_driver_does(server):
    from pyspec.generation.cpp_loop import cpp_generate

    with Model(tm.make_cyclic_target(), rpc_servers=[server], use_extra_bufts=False) as m, _ctx(m, 256, 64) as c:
        res, _ = generate(c, "the quick brown fox", 20)
        (cpp_res,), _ = cpp_generate(c, ["the quick brown fox"], 20)
    assert cpp_res.tokens == res.tokens and len(res.tokens) == 20


def test_the_command_line_places_the_target_on_a_server_and_the_draft_on_the_cpu(server, capsys):
    from pyspec.cli.commands import main

    # fixed draft lengths: the cost-aware choice follows timings, which differ between the placements
    args = ["run", "--tiny", "-q", "-n", "12", "-t", "1", "--types", "draft-simple", "--fixed-draft"]
    assert main([*args, "--device", "none"]) == 0
    local = capsys.readouterr().out
    assert main([*args, "--rpc", server.endpoint, "--draft-device", "none"]) == 0
    remote = capsys.readouterr().out
    # the implementation's counters in the statistics: the same drafts, the same acceptance
    counters = re.compile(r"\bn_\w+=\d+")
    assert counters.findall(local) and counters.findall(local) == counters.findall(remote)
    assert main([*args, "--device", "Nope0"]) == 1
    assert "no device 'Nope0'" in capsys.readouterr().err


# --- lost servers ---------------------------------------------------------------------


def test_a_frozen_server_ends_the_cpp_loop_with_rpc_connection_error(short_timeouts):
    from pyspec.generation.cpp_loop import cpp_generate

    with rpc.RpcServer(threads=1) as s:
        m = Model(tm.make_cyclic_target(), rpc_servers=[s])
        ctx = _ctx(m, 256, 64)
        s.kill(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(RpcConnectionError, match="the C\\+\\+ loop: no answer"):
                cpp_generate(ctx, ["the quick brown fox"], 50)
            assert time.monotonic() - t0 < 2.0 + 3
            assert m.rpc is not None and m.rpc.lost
            ctx.close()
            m.close()
        finally:
            s.kill(signal.SIGCONT)


def test_killing_the_server_mid_generation_raises_and_the_process_goes_on(short_timeouts):
    path = tm.make_cyclic_target()
    s = rpc.RpcServer(threads=1)
    m = Model(path, rpc_servers=[s], use_extra_bufts=False)
    ctx = _ctx(m, 256, 64)
    pieces: list[str] = []

    def on_piece(text: str) -> None:
        pieces.append(text)
        if len(pieces) == 3:
            s.kill()  # SIGKILL: what a crash looks like

    t0 = time.monotonic()
    with pytest.raises(RpcConnectionError, match="lost") as e:
        generate(ctx, "the quick brown fox", 200, on_piece=on_piece)
    assert time.monotonic() - t0 < 10
    assert e.value.endpoints == (s.endpoint,)
    assert m.rpc is not None and m.rpc.lost
    # the model and its context refuse more work, clearly, and close without harm
    with pytest.raises(RpcConnectionError, match="can only be closed"):
        ctx.decode(_one_token_batch())
    ctx.close()
    m.close()
    s.stop()
    # the process goes on: a local model decodes, and a new server serves a new model
    with Model(path, devices=[]) as local_m, _ctx(local_m, 128, 32) as c:
        want, _ = _greedy_tokens(c, [1, 2, 3], 5)
    with rpc.RpcServer(threads=1) as s2, Model(path, rpc_servers=[s2]) as m2, _ctx(m2, 128, 32) as c2:
        got, _ = _greedy_tokens(c2, [1, 2, 3], 5)
    assert got == want


def _one_token_batch(pos: int = 0) -> Batch:
    b = Batch(1, 0, 1)
    b.add(1, pos, 0, True)
    return b


def test_a_frozen_server_times_out_instead_of_hanging(short_timeouts):
    path = tm.make_target()
    with rpc.RpcServer(threads=1) as s:
        m = Model(path, rpc_servers=[s])
        ctx = _ctx(m, 128, 32)
        _greedy_tokens(ctx, [1, 2, 3], 2)
        s.kill(signal.SIGSTOP)  # alive but silent: its kernel still acknowledges our packets
        try:
            t0 = time.monotonic()
            with pytest.raises(RpcConnectionError, match=r"no answer .* within 2 s"):
                ctx.decode(_one_token_batch(ctx.memory.seq_pos_max(0) + 1))
            assert time.monotonic() - t0 < 2.0 + 3
            ctx.close()  # freeing goes through the guard's sink: no request waits for the frozen server
            m.close()
        finally:
            s.kill(signal.SIGCONT)


def test_closing_a_model_whose_server_died_while_idle_is_safe(short_timeouts):
    path = tm.make_target()
    s = rpc.RpcServer(threads=1)
    m = Model(path, rpc_servers=[s])
    ctx = _ctx(m, 128, 32)
    _greedy_tokens(ctx, [1, 2, 3], 2)
    pid = s.pid
    assert pid is not None
    s.kill()
    assert _wait_gone(pid)
    with pytest.raises(RpcConnectionError):
        ctx.memory.clear()
    ctx.close()
    m.close()
    s.stop()


def test_a_server_lost_while_its_models_are_open_is_refused_until_they_close(short_timeouts):
    path = tm.make_target()
    s = rpc.RpcServer(threads=1)
    port = s.port
    m = Model(path, rpc_servers=[s])
    s.kill()
    s.stop()
    with rpc.RpcServer(port=port, threads=1) as again:
        with pytest.raises(RpcConnectionError, match="still open"):
            Model(path, rpc_servers=[again])
        m.close()
        with Model(path, rpc_servers=[again]) as m2, _ctx(m2, 64, 16) as c:
            assert len(_greedy_tokens(c, [1, 2], 2)[0]) == 2
