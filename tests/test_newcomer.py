"""Mistakes a newcomer makes get a clear error naming the fix, or just work (issue 29)."""

from __future__ import annotations

import http.client
import io
import json
import logging
import signal
import socket
import subprocess
import sys
from typing import Any

import pytest

from pyspec.common.params import CommonParamsSpeculative, CommonSpeculativeType


def test_speculative_params_accept_the_cli_type_names() -> None:
    # the field is typed as the enum list the C++ struct holds; names are a run-time convenience
    names: Any = ["ngram-map-k", "draft-simple"]
    p = CommonParamsSpeculative(types=names)
    assert p.types == [CommonSpeculativeType.NGRAM_MAP_K, CommonSpeculativeType.DRAFT_SIMPLE]


def test_speculative_params_accept_one_comma_separated_string() -> None:
    names: Any = "ngram-mod,ngram-cache"
    assert CommonParamsSpeculative(types=names).types == [
        CommonSpeculativeType.NGRAM_MOD, CommonSpeculativeType.NGRAM_CACHE]


def test_speculative_params_keep_enum_values() -> None:
    assert CommonParamsSpeculative(types=[CommonSpeculativeType.NGRAM_MOD]).types == [CommonSpeculativeType.NGRAM_MOD]


def test_unknown_speculative_type_name_lists_the_valid_names() -> None:
    with pytest.raises(ValueError, match=r"unknown speculative type: 'ngram-mapk'.*ngram-map-k, ngram-map-k4v"):
        CommonParamsSpeculative(types=_names("ngram-mapk"))


# --------------------------------------------------------------------------- pyspec serve


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(port: int) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "pyspec", "serve", "--tiny", "--host", "127.0.0.1",
                             "--port", str(port), "--threads", "1"], stderr=subprocess.PIPE, text=True)


@pytest.mark.slow  # pyspec serve in a subprocess
def test_serve_on_a_busy_port_says_so_in_one_line_without_an_address() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        p = _serve(port)
        _, err = p.communicate(timeout=120)
    assert p.returncode != 0
    assert "Traceback" not in err
    assert "on http://" not in err  # nothing announced before the bind
    lines = [ln for ln in err.splitlines() if f"127.0.0.1:{port}" in ln]
    assert len(lines) == 1 and "cannot listen" in lines[0] and "--port" in lines[0]


@pytest.mark.slow  # pyspec serve in a subprocess
def test_ctrl_c_during_a_streaming_request_stops_the_server_with_one_line() -> None:
    port = _free_port()
    p = _serve(port)
    try:
        assert p.stderr is not None
        banner = ""
        while "on http://" not in banner and p.poll() is None:  # a warning may come first on a loaded machine
            banner = p.stderr.readline()
        assert f"on http://127.0.0.1:{port}" in banner
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        body = json.dumps({"prompt": "hello", "max_tokens": 100000, "stream": True})
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200 and r.read1(64).startswith(b"data: ")  # the stream is running
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0
    assert "Traceback" not in err
    assert err.strip().splitlines() == ["pyspec serve: stopped"]


def test_serve_without_the_server_extra_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from pyspec.cli.commands import main

    monkeypatch.setitem(sys.modules, "uvicorn", None)  # import uvicorn now raises ImportError
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    assert main(["serve", "--tiny"]) != 0
    assert "server extra" in err.getvalue() and "[server]" in err.getvalue()
    assert "starlette uvicorn" in err.getvalue()


# --------------------------------------------------------------------------- threads


def test_run_warns_once_when_the_default_threads_oversubscribe(monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    from pyspec.cli.commands import main
    from pyspec.core import workers

    monkeypatch.setattr(workers, "_cores", lambda: 2)
    monkeypatch.setattr(workers.os, "getloadavg", lambda: (6.0, 6.0, 6.0))  # two other jobs at work
    monkeypatch.setattr(workers, "_warned_oversubscribed", False)
    with caplog.at_level(logging.WARNING, logger="pyspec"):
        assert main(["run", "--tiny", "-n", "2", "--quiet"]) == 0
    said = [r.getMessage() for r in caplog.records if "CPU threads but only" in r.getMessage()]
    assert len(said) == 1 and "--threads 1" in said[0] and "2 CPU threads" in said[0]


def test_run_warns_that_a_small_n_ctx_is_padded_to_256(caplog: pytest.LogCaptureFixture) -> None:
    from pyspec.cli.commands import main

    with caplog.at_level(logging.WARNING, logger="pyspec"):
        assert main(["run", "--tiny", "--n-ctx", "64", "-n", "2", "--quiet", "--threads", "1"]) == 0
    said = [r.getMessage() for r in caplog.records if "--n-ctx" in r.getMessage()]
    assert len(said) == 1 and "--n-ctx 64 becomes 256 tokens per sequence" in said[0] and "multiple of 256" in said[0]


def test_the_padded_n_ctx_the_warning_names_is_what_llama_cpp_gives() -> None:
    from pyspec.cli.commands import _n_ctx_seq_used
    from pyspec.generation.engine import Engine
    from pyspec.testing.models import tiny_model_paths

    with Engine.load(tiny_model_paths()[0], n_ctx=100, n_parallel=3, n_threads=1) as engine:
        assert engine.n_ctx_seq == _n_ctx_seq_used(100, 3) == 256


# --------------------------------------------------------------------------- demo and bench progress


def test_demo_prints_progress_while_it_measures(target_path: Any) -> None:
    from pyspec.cli.demo import demo

    lines: list[str] = []
    said: list[str] = []
    assert demo(model=target_path, n_predict=4, n_threads=1, repeat=1, out=said.append, progress=lines.append) == 0
    assert lines[0] == "loading the model..." and lines[1] == "warming up..."
    measured = [ln for ln in lines if ln.startswith("measuring ")]
    assert measured[0] == "measuring plain decoding (1/5)..." and measured[-1].endswith("(5/5)...")
    assert not any(ln.startswith("measuring") for ln in said)  # progress apart from the results


def test_the_demo_says_what_the_batch_cost_on_this_machine_not_on_another() -> None:
    from pyspec.cli.demo import batch_cost_words

    # scripts/verify_cost.py's curves on two 2-core machines (docs/performance.md)
    steep = {1: 1.0, 2: 1.94, 3: 3.27, 5: 3.93, 9: 5.24, 17: 7.63}
    flat = {1: 1.0, 2: 1.14, 3: 1.84, 4: 1.59, 9: 3.32, 13: 4.17}
    assert batch_cost_words(steep) == ("On this CPU each token a verify batch adds costs 75% of a one-token "
                                       "decode (Gemma 3\ncomputes 262k logits for every verified token)")
    assert batch_cost_words(flat) == "On this CPU each token a verify batch adds costs only 26% of a one-token decode"
    assert "not measured" in batch_cost_words({}) and "not measured" in batch_cost_words({1: 1.0})


def test_bench_says_what_it_measures_before_each_run(capsys: pytest.CaptureFixture[str]) -> None:
    from pyspec.cli.commands import main

    assert main(["bench", "--tiny", "--types", "ngram-simple", "--engines", "python", "--n-predict", "4",
                 "--repeat", "1", "--n-prompts", "1"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert "warming up (one short plain run)..." in err
    assert err.index("measuring none on python (1/2)...") < err.index("measuring ngram-simple on python (2/2)...")


def _names(*names: str) -> Any:
    return list(names)  # typed Any: the field's static type is the enum list
