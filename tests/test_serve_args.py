"""`pyspec serve` takes llama-server's command line: the option table, the mapping, what is dropped and said."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

import pytest

from pyspec.cli import commands
from pyspec.cli.llama_server_args import (
    LLAMA_SERVER_ENV,
    LLAMA_SERVER_OPTIONS,
    MAPPED,
    PRIORITY_NAMES,
    ServeOptions,
    _table,
    env_argv,
    parse_arg_cpp,
    resolve,
    server_options,
    table_lines,
)
from pyspec.common.common import COMMON_CPU_PARAMS_DEFAULT, CommonCpuParams
from pyspec.errors import CliError
from pyspec.server.cors import CorsPolicy
from pyspec.testing.models import llama_cpp_dir


def _parse(*argv: str) -> tuple[argparse.Namespace, ServeOptions]:
    rest, dropped = commands._serve_argv(list(argv))
    args = commands.build_parser().parse_args(["serve", *rest])
    return args, resolve(args, dropped)


def test_the_table_is_llama_servers_option_list_at_the_vendored_revision():
    text = (llama_cpp_dir() / "common" / "arg.cpp").read_text(encoding="utf-8")
    options = parse_arg_cpp(text)
    assert server_options(options) == LLAMA_SERVER_OPTIONS
    assert _table("\n".join(table_lines(options))) == (LLAMA_SERVER_OPTIONS, LLAMA_SERVER_ENV)
    assert len(LLAMA_SERVER_OPTIONS) > 300 and LLAMA_SERVER_ENV["LLAMA_ARG_CTX_SIZE"] == ("--ctx-size", None, 1)


def test_arg_cpp_reader_tells_flags_negations_and_values_apart():
    text = '''
    static std::initializer_list<enum llama_example> ex_list = { LLAMA_EXAMPLE_MTMD, LLAMA_EXAMPLE_SERVER };
    add_opt(common_arg({"-x", "--ex"}, "print (a, b) \\"quoted\\"", [](common_params & p) { p.x = 1; }));
    add_opt(common_arg({"--on"}, {"--no-on"}, string_format("x %s", "y, z"),
        [](common_params & p, bool v) { /* , ) */ p.on = v; })
        .set_examples({LLAMA_EXAMPLE_SERVER}).set_env("LLAMA_ARG_ON"));
    add_opt(common_arg({"-v"}, "N", "help", [](common_params & p, int v) { p.v = v; }).set_examples(ex_list));
    add_opt(common_arg({"--two"}, "A", "B", "help", [](common_params &, const std::string &, const std::string &) {})
        .set_excludes({LLAMA_EXAMPLE_SERVER}));
    '''
    opts = parse_arg_cpp(text)
    assert [(o.names, o.negations, o.n_values) for o in opts] == [
        (("-x", "--ex"), (), 0), (("--on",), ("--no-on",), 0), (("-v",), (), 1), (("--two",), (), 2)]
    assert opts[2].examples == {"LLAMA_EXAMPLE_MTMD", "LLAMA_EXAMPLE_SERVER"}
    assert (opts[1].env, opts[0].env) == ("LLAMA_ARG_ON", None)
    assert server_options(opts) == {"-x": 0, "--ex": 0, "--on": 0, "--no-on": 0, "-v": 1}
    assert table_lines(opts) == ["0 -x --ex", "0 --on !--no-on env=LLAMA_ARG_ON", "1 -v"]


@pytest.mark.parametrize(("environ", "argv"), [
    ({}, []),
    ({"LLAMA_ARG_CTX_SIZE": "4096", "LLAMA_ARG_N_PARALLEL": "2"}, ["--ctx-size", "4096", "--parallel", "2"]),
    ({"LLAMA_ARG_CONT_BATCHING": "0"}, ["--no-cont-batching"]),
    ({"LLAMA_ARG_CONT_BATCHING": "on"}, ["--cont-batching"]),
    ({"LLAMA_ARG_NO_CONT_BATCHING": "1"}, ["--no-cont-batching"]),
    ({"LLAMA_ARG_ENDPOINT_METRICS": "1"}, ["--metrics"]),
    ({"LLAMA_ARG_ENDPOINT_METRICS": "0"}, []),
    ({"HOME": "/root", "LLAMA_ARG_NOT_AN_OPTION": "1"}, []),
])
def test_llama_servers_environment_variables_become_options(environ: dict[str, str], argv: list[str]):
    assert sorted(env_argv(environ)) == sorted(argv)


def test_the_command_line_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch):
    seen: list[Any] = []
    monkeypatch.setenv("LLAMA_ARG_CTX_SIZE", "4096")
    monkeypatch.setenv("LLAMA_ARG_ALIAS", "from-env")

    def cmd_serve(args: argparse.Namespace) -> int:
        seen.append(resolve(args, args.llama_dropped))
        return 0

    monkeypatch.setattr(commands, "cmd_serve", cmd_serve)
    assert commands.main(["serve", "-c", "2048", "-np", "2"]) == 0
    assert seen[0].n_ctx == 1024 and seen[0].model_alias == "from-env"


def test_every_mapped_name_is_a_llama_server_option():
    # pyspec's own names are added by commands.py; MAPPED holds llama-server's only
    assert [n for m in MAPPED for n in m.names if n not in LLAMA_SERVER_OPTIONS] == []


def test_every_mapped_option_reaches_the_serve_parser():
    p = argparse.ArgumentParser()
    commands._add_serve_args(p)  # what build_parser gives the serve command
    assert [n for m in MAPPED for n in m.names if n not in p._option_string_actions] == []


# (command line, ServeOptions field, value)
CASES: list[tuple[list[str], str, Any]] = [
    ([], "n_ctx", 2048),  # pyspec's default: 2048 per slot
    (["--n-ctx", "512"], "n_ctx", 512),
    (["-c", "8192", "-np", "4"], "n_ctx", 2048),  # llama-server: the total over the slots
    (["--ctx-size", "4096", "--parallel", "2"], "n_ctx", 2048),
    (["--ctx_size=1000", "-np", "3"], "n_ctx", 333),  # llama.cpp reads --a_b as --a-b; --x=v
    (["-c", "0"], "n_ctx", 0),  # the model's training context
    (["-np", "-1"], "parallel", 4),  # llama-server's auto
    (["-b", "1024"], "n_batch", 1024),
    (["--n-batch", "256"], "n_batch", 256),
    (["-ub", "128"], "n_ubatch", 128),
    ([], "n_ubatch", None),
    (["-fa", "off"], "context_kw", {"flash_attn_type": "disabled"}),
    (["--flash-attn", "on"], "context_kw", {"flash_attn_type": "enabled"}),
    (["-fa", "auto", "-ctk", "q8_0", "-ctv", "q4_0"], "context_kw",
     {"flash_attn_type": "auto", "type_k": "q8_0", "type_v": "q4_0"}),
    (["-kvu"], "context_kw", {"kv_unified": True}),
    (["--no-kv-unified"], "context_kw", {"kv_unified": False}),
    ([], "context_kw", {}),
    (["--spec-type", "ngram-mod"], "types", "ngram-mod"),
    (["--spec-type", "ngram-simple", "--spec-type", "ngram-map-k"], "types", "ngram-simple,ngram-map-k"),
    (["--spec-type", "suffix", "--spec-type", "ngram-mod"], "types", "suffix,ngram-mod"),  # pyspec's own type too
    (["--types", "ngram-map-k"], "types", "ngram-map-k"),
    (["-md", "d.gguf"], "types", "draft-simple"),  # a draft model asks for draft-simple
    (["--model-draft", "d.gguf", "--spec-type", "draft-eagle3"], "types", "draft-eagle3"),
    (["--model-draft", "d.gguf", "--spec-type", "none"], "types", "none"),  # said so: the draft stays unused
    (["--spec-draft-n-max", "8", "--spec-draft-n-min", "2", "--spec-draft-p-min", "0.5"], "spec_kw",
     {"n_max": 8, "n_min": 2, "p_min": 0.5, "ngram_n": 3, "ngram_m": 8}),
    (["--draft-max", "6", "--draft-min", "1", "--draft-p-min", "0.2"], "spec_kw",
     {"n_max": 6, "n_min": 1, "p_min": 0.2, "ngram_n": 3, "ngram_m": 8}),
    (["--draft", "5"], "spec_kw", {"n_max": 5, "n_min": None, "p_min": None, "ngram_n": 3, "ngram_m": 8}),
    (["--n-max", "4"], "spec_kw", {"n_max": 4, "n_min": None, "p_min": None, "ngram_n": 3, "ngram_m": 8}),
    (["--spec-ngram-mod-n-match", "24", "--spec-ngram-mod-n-max", "64"], "spec_kw",
     {"n_max": None, "n_min": None, "p_min": None, "ngram_n": 24, "ngram_m": 64}),
    (["--spec-ngram-map-k-size-n", "12", "--spec-ngram-map-k-size-m", "48"], "spec_kw",
     {"n_max": None, "n_min": None, "p_min": None, "ngram_n": 12, "ngram_m": 48}),
    (["-ngld", "all"], "draft_n_gpu_layers", -1),
    (["--n-gpu-layers-draft", "7"], "draft_n_gpu_layers", 7),
    (["--load-mode", "mlock", "-lzm", "off"], "model_kw", {"load_mode": "mlock", "lazy_mode": "off"}),
    (["-lm", "mmap+mlock"], "model_kw", {"load_mode": "mmap+mlock"}),
    ([], "model_kw", {}),
    (["--chat-template", "chatml"], "chat_template", "chatml"),
    (["--api-key", "k1"], "api_keys", ["k1"]),
    (["--api-key", "k1,k2"], "api_keys", ["k1", "k2"]),
    ([], "api_keys", []),
    (["-a", "m2,m1"], "model_alias", "m1"),  # llama-server's std::set: the first in sorted order
    (["--alias", "tinyllama-2,fim,code"], "model_aliases", ["code", "fim", "tinyllama-2"]),
    (["--tags", "chat, small,"], "model_tags", ["chat", "small"]),
    (["--alias", "tiny"], "model_alias", "tiny"),
    (["--metrics"], "metrics", True),
    ([], "metrics", False),
    (["--no-slots"], "slots", False),
    (["--slots"], "slots", True),
    ([], "slots", True),
    (["--temperature", "0.5", "--top-k", "10", "--top-p", "0.8", "--min-p", "0.1", "-s", "7"], "sampling_kw",
     {"temp": 0.5, "top_k": 10, "top_p": 0.8, "min_p": 0.1, "seed": 7}),
    (["--seed", "-1"], "sampling_kw", {"temp": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "seed": 0xFFFFFFFF}),
    (["--repeat-penalty", "1.1", "--repeat-last-n", "32", "--presence-penalty", "0.5", "--frequency-penalty", "0.25",
      "--typical-p", "0.9", "--top-nsigma", "1.5", "--dry-multiplier", "0.8", "--mirostat", "2", "--mirostat-lr",
      "0.2", "--mirostat-ent", "4", "--xtc-probability", "0.1", "--dynatemp-range", "0.3",
      "--ignore-eos"], "sampling_kw",
     {"temp": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "seed": 0xFFFFFFFF, "penalty_repeat": 1.1,
      "penalty_last_n": 32, "penalty_present": 0.5, "penalty_freq": 0.25, "typ_p": 0.9, "top_n_sigma": 1.5,
      "dry_multiplier": 0.8, "mirostat": 2, "mirostat_eta": 0.2, "mirostat_tau": 4.0,
      "xtc_probability": 0.1, "dynatemp_range": 0.3, "ignore_eos": True}),
    # accepted as they are: pyspec always does what they ask
    (["--jinja", "--no-webui", "-cb", "--no-context-shift", "--cache-prompt", "--slots"], "not_applied", []),
    # accepted, named in the warning: pyspec does not do what they ask
    (["--no-jinja", "--webui", "-nocb", "--context-shift", "-tb", "4"], "not_applied",
     ["--no-jinja", "--webui", "--no-cont-batching"]),
    # context shift (the engine's context_shift) and what a shift keeps by default
    (["--context-shift"], "context_shift", True),
    (["--context-shift", "--no-context-shift"], "context_shift", False),
    ([], "context_shift", False),
    (["--keep", "-1"], "n_keep", -1),
    (["--keep", "32"], "n_keep", 32),
    ([], "n_keep", 0),
    (["--props"], "props", True),
    ([], "props", False),
    # llama-server options pyspec has no use for: dropped with their values, named once
    (["--lora", "a.gguf", "--rerank", "-to", "600", "--cache-reuse", "256", "--lora", "b.gguf"], "not_applied",
     ["--lora", "--rerank", "-to", "--cache-reuse"]),
    # embeddings (llama-server's --embedding, --pooling, --embd-normalize)
    (["--embedding"], "embedding", True),
    (["--embeddings", "--pooling", "last", "--embd-normalize", "-1"], "pooling", "last"),
    (["--embd-normalize", "1"], "embd_normalize", 1),
    ([], "embd_normalize", 2),
    ([], "embedding", False),
    ([], "pooling", None),
    (["--embedding", "--pooling", "rank"], "not_applied", ["--pooling rank"]),
    # CORS: llama-server's defaults; localhost by default once server tools are asked for
    ([], "cors", CorsPolicy()),
    (["--cors-origins", "localhost", "--cors-methods", "GET", "--cors-headers", "Authorization",
      "--no-cors-credentials"], "cors", CorsPolicy("localhost", "GET", "Authorization", False)),
    (["--tools", "all"], "cors", CorsPolicy(origins="localhost")),
    (["--tools", "all", "--cors-origins", "*"], "cors", CorsPolicy()),
    (["--spm-infill"], "not_applied", []),
]


@pytest.mark.parametrize(("argv", "field", "expected"), CASES, ids=[" ".join(c[0]) or "(none)" for c in CASES])
def test_serve_option(argv: list[str], field: str, expected: Any):
    _, opts = _parse(*argv)
    assert getattr(opts, field) == expected


# (command line, argparse dest, value): what reaches the parsed namespace unchanged
ARGS_CASES: list[tuple[list[str], str, Any]] = [
    (["-m", "t.gguf"], "model", "t.gguf"),
    (["--ui-mcp-proxy"], "ui_mcp_proxy", True),
    (["--webui-mcp-proxy", "--no-ui-mcp-proxy"], "ui_mcp_proxy", False),
    (["--spm-infill"], "spm_infill", True),
    (["--model", "t.gguf"], "model", "t.gguf"),
    (["-md", "d.gguf"], "draft", "d.gguf"),
    (["--spec-draft-model", "d.gguf"], "draft", "d.gguf"),
    (["--draft", "d.gguf"], "draft", "d.gguf"),  # pyspec's --draft PATH stays
    (["-ngl", "auto"], "n_gpu_layers", -1),
    (["--n-gpu-layers", "all"], "n_gpu_layers", -1),
    (["--gpu-layers", "12"], "n_gpu_layers", 12),
    (["-ngl", "0"], "n_gpu_layers", 0),
    (["-dev", "none"], "device", "none"),
    (["--device-draft", "CPU"], "draft_device", "CPU"),
    (["-t", "3"], "threads", 3),
    (["-n", "64"], "n_predict", 64),
    (["--predict", "32"], "n_predict", 32),
    (["--n-predict", "16"], "n_predict", 16),
    (["-sps", "0.5"], "slot_prompt_similarity", 0.5),
    (["--no-cache-prompt"], "no_cache_prompt", True),
    (["--host", "0.0.0.0", "--port", "9000"], "port", 9000),
    (["-v"], "serve_verbose", True),
    (["--slot-save-path", "/tmp"], "slot_save_path", "/tmp"),
]


@pytest.mark.parametrize(("argv", "dest", "expected"), ARGS_CASES, ids=[" ".join(c[0]) for c in ARGS_CASES])
def test_serve_namespace(argv: list[str], dest: str, expected: Any):
    args, _ = _parse(*argv)
    assert getattr(args, dest) == expected


REAL_WORLD = (
    "-m /models/target.gguf --ctx-size 16384 -np 4 -fa off --model-draft /models/draft.gguf --spec-draft-n-max 8 "
    "--spec-draft-n-min 2 --draft-p-min 0.6 -ngl 99 -ngld 99 -ctk q8_0 -ctv q8_0 -b 2048 -ub 512 -t 8 -tb 8 "
    "--chat-template chatml --jinja --host 0.0.0.0 --port 8081 --api-key sk-1,sk-2 --alias coder,coder-latest "
    "-n 1024 --metrics --slots --no-webui -cb -kvu --no-context-shift -s 42 --temp 0.2 --top-k 20 --top-p 0.9 "
    "--min-p 0.01 --repeat-penalty 1.05 --log-disable --log-prefix --log-timestamps --timeout 600 "
    "--cache-reuse 256 --threads-http 8 --reasoning-format none -lm mlock -sps 0.5 --slot-save-path /tmp"
).split()


def test_a_real_world_llama_server_command_line():
    args, opts = _parse(*REAL_WORLD)
    assert args.model == "/models/target.gguf" and args.draft == "/models/draft.gguf"
    assert (opts.n_ctx, opts.parallel, opts.n_batch, opts.n_ubatch) == (4096, 4, 2048, 512)
    assert opts.types == "draft-simple"
    assert opts.spec_kw == {"n_max": 8, "n_min": 2, "p_min": 0.6, "ngram_n": 3, "ngram_m": 8}
    assert opts.context_kw == {"flash_attn_type": "disabled", "type_k": "q8_0", "type_v": "q8_0", "kv_unified": True,
                               "n_threads_batch": 8}
    assert opts.cpuparams_batch == CommonCpuParams(n_threads=8)
    assert (args.n_gpu_layers, opts.draft_n_gpu_layers, args.threads) == (99, 99, 8)
    assert (args.host, args.port, args.n_predict, args.slot_save_path) == ("0.0.0.0", 8081, 1024, "/tmp")
    assert opts.api_keys == ["sk-1", "sk-2"] and opts.model_alias == "coder"
    assert opts.model_aliases == ["coder", "coder-latest"]
    assert opts.chat_template == "chatml" and opts.metrics and opts.slots
    assert opts.sampling_kw == {"temp": 0.2, "top_k": 20, "top_p": 0.9, "min_p": 0.01, "seed": 42,
                                "penalty_repeat": 1.05}
    assert opts.model_kw == {"load_mode": "mlock"}
    assert opts.not_applied == ["--log-disable", "--log-prefix", "--log-timestamps", "--timeout", "--cache-reuse",
                                "--threads-http", "--reasoning-format"]


def test_the_llama_server_tests_harness_command_line():
    # what vendor/llama.cpp/tools/server/tests/utils.py starts (its ServerProcess.start)
    argv = ("--host 127.0.0.1 --port 8080 --temp 0.8 --seed 42 --model m.gguf --model-draft d.gguf --batch-size 512 "
            "--n-gpu-layers 99 --ctx-size 512 --parallel 2 --n-predict 64 --spec-draft-n-max 8 --spec-draft-n-min 4 "
            "--no-webui --jinja --cont-batching --kv-unified --metrics --slots --alias tinyllama-2 "
            "--no-models-autoload --offline --batch-size 32").split()
    _, opts = _parse(*argv)
    assert (opts.n_ctx, opts.parallel, opts.n_batch, opts.types) == (256, 2, 32, "draft-simple")
    assert opts.not_applied == ["--no-models-autoload", "--offline"]


def test_an_option_neither_pyspec_nor_llama_server_knows_is_refused(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit):
        _parse("--no-such-option")
    assert "--no-such-option" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["-fa", "maybe"], "flash-attn"),
    (["-ctk", "q3_k"], "cache type"),
    (["-ngl", "some"], "n-gpu-layers"),
    # the threadpool options name themselves and what they take
    (["-C", "0xg1"], "-C/--cpu-mask: '0xg1' (a hexadecimal CPU mask)"),
    (["-Cb", "1 2"], "-Cb/--cpu-mask-batch"),
    (["-Cr", "3"], "-Cr/--cpu-range: '3' (a CPU range lo-hi)"),
    (["-Cr", "0-512"], "CPUs go up to 511"),
    (["-Crb", "a-b"], "-Crb/--cpu-range-batch"),
    (["--prio", "4"], "--prio: '4' (-1 .. 3)"),
    (["--prio", "-2"], "--prio: '-2'"),
    (["--prio-batch", "-1"], "--prio-batch: '-1' (0 .. 3)"),  # arg.cpp: no low priority for batches
    (["--prio", "high"], "--prio: 'high' (an integer)"),
    (["--poll", "101"], "--poll: '101' (a polling level 0 .. 100)"),
    (["--poll-batch", "-1"], "--poll-batch"),
    (["--cpu-strict", "yes"], "--cpu-strict: 'yes'"),
    (["--cpu-strict-batch", "1.5"], "--cpu-strict-batch"),
])
def test_a_bad_llama_server_value_is_refused_by_argparse(argv: list[str], message: str,
                                                         capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit):
        _parse(*argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["-c", "3", "-np", "4"], "--ctx-size 3 leaves no context"),
    (["-np", "0"], "--parallel must be positive"),
    (["--spec-type", "ngram-nope"], "--spec-type"),
    (["--chat-template-file", "/nonexistent/t.jinja"], "cannot read the chat template file"),
    (["--api-key-file", "/nonexistent/keys"], "cannot read the API key file"),
    (["--keep", "-2"], "--keep must be -1"),
])
def test_a_bad_value_is_one_cli_error(argv: list[str], message: str):
    with pytest.raises(CliError, match=message):
        _parse(*argv)


def test_key_and_template_files(tmp_path: Path):
    (tmp_path / "keys").write_text("# the team's keys\nk1\n\nk2\n", encoding="utf-8")
    (tmp_path / "t.jinja").write_text("{{ messages[0].content }}", encoding="utf-8")
    _, opts = _parse("--api-key", "k0", "--api-key-file", str(tmp_path / "keys"),
                     "--chat-template-file", str(tmp_path / "t.jinja"))
    assert opts.api_keys == ["k0", "k1", "k2"]
    assert opts.chat_template == "{{ messages[0].content }}"


class _Loaded(Exception):
    pass


def test_cmd_serve_passes_the_options_on_and_warns_once(monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture):
    from pyspec.generation.engine import Engine

    seen: dict[str, Any] = {}

    def load(model: Any = None, **kw: Any) -> Any:
        seen.update(kw, model=model)
        raise _Loaded

    monkeypatch.setattr(Engine, "load", staticmethod(load))
    argv = ["serve", "--port", "0", "-m", "t.gguf", "-c", "1024", "-np", "2", "-ub", "64", "--lora", "x.gguf",
            "--rerank", "--load-mode", "none", "-ngld", "3", "--spec-draft-n-max", "5"]
    rest, dropped = commands._serve_argv(argv[1:])
    args = commands.build_parser().parse_args(["serve", *rest])
    args.llama_dropped = dropped
    with caplog.at_level(logging.WARNING, logger="pyspec"), pytest.raises(_Loaded):
        commands.cmd_serve(args)
    assert (seen["n_ctx"], seen["n_parallel"], seen["n_ubatch"], seen["n_max"]) == (512, 2, 64, 5)
    assert seen["model"] == "t.gguf" and seen["load_mode"] == "none"
    assert seen["draft_kw"] == {"devices": None, "n_gpu_layers": 3}
    warnings = [r.getMessage() for r in caplog.records if "llama-server options" in r.getMessage()]
    # the context options too when this Engine.load cannot take them: either way one warning
    assert len(warnings) == 1 and "--lora --rerank" in warnings[0]


def test_spm_infill_and_a_header_breaking_cors_value():
    args, _ = _parse("--spm-infill")
    assert args.spm_infill is True
    with pytest.raises(CliError, match="--cors-origins holds a control character"):
        _parse("--cors-origins", "a\r\nX-Evil: 1")


def test_the_suffix_type_is_a_type_name_for_serve_and_refused_by_run():
    assert commands._types_arg("suffix,ngram-mod") == "suffix,ngram-mod"
    assert "suffix" in commands._known_types()
    with pytest.raises(CliError, match="suffix type runs in the Engine"):
        commands._no_suffix("ngram-mod+suffix", "run")
    commands._no_suffix("ngram-mod", "run")  # llama.cpp's types pass


def _serve_load_kw(monkeypatch: pytest.MonkeyPatch, *argv: str) -> dict[str, Any]:
    """What cmd_serve hands Engine.load for ``argv`` (the load itself replaced)."""
    from pyspec.generation.engine import Engine

    seen: dict[str, Any] = {}

    def load(model: Any = None, **kw: Any) -> Any:
        seen.update(kw)
        raise _Loaded

    monkeypatch.setattr(Engine, "load", staticmethod(load))
    rest, dropped = commands._serve_argv(["--port", "0", "-m", "t.gguf", *argv])
    args = commands.build_parser().parse_args(["serve", *rest])
    args.llama_dropped = dropped
    with pytest.raises(_Loaded):
        commands.cmd_serve(args)
    return seen


def test_the_suffix_options_reach_the_engine_with_the_runs_n_max(monkeypatch: pytest.MonkeyPatch):
    from pyspec.suffix import SuffixParams

    seen = _serve_load_kw(monkeypatch, "--spec-type", "suffix", "--spec-draft-n-max", "24",
                          "--suffix-max-spec-factor", "2", "--suffix-min-token-prob", "0.5",
                          "--suffix-max-depth", "32", "--suffix-max-global-tokens", "0")
    assert seen["types"] == "suffix"
    assert seen["suffix"] == SuffixParams(max_depth=32, max_spec_factor=2.0, min_token_prob=0.5,
                                          max_global_tokens=0, n_max=24)
    # none given: the defaults, as Engine.load would choose them
    assert _serve_load_kw(monkeypatch, "--types", "suffix,ngram-mod")["suffix"] == SuffixParams()
    assert _serve_load_kw(monkeypatch, "--types", "ngram-mod")["suffix"] is None


@pytest.mark.parametrize("argv, message", [
    (["--types", "ngram-mod", "--suffix-max-spec-factor", "2"], "--suffix-max-spec-factor: the suffix type is not"),
    (["--types", "suffix", "--suffix-max-depth", "100000"], "max_depth"),  # SuffixParams' own bound
    (["--types", "suffix", "--n-max", "0"], "n_max"),  # a drafter that may draft nothing
])
def test_a_suffix_option_that_changes_nothing_or_is_out_of_range_is_a_usage_error(monkeypatch: pytest.MonkeyPatch,
                                                                                 argv: list[str], message: str):
    with pytest.raises(CliError, match=message):
        _serve_load_kw(monkeypatch, *argv)


@pytest.mark.parametrize("option, value", [("--suffix-max-spec-factor", "0"), ("--suffix-max-spec-factor", "nan"),
                                           ("--suffix-min-token-prob", "1.5"), ("--suffix-max-depth", "0"),
                                           ("--suffix-max-global-tokens", "-1")])
def test_a_suffix_option_out_of_its_range_is_refused_by_the_parser(option: str, value: str,
                                                                   capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit):
        commands.build_parser().parse_args(["serve", "--types", "suffix", option, value])
    assert option in capsys.readouterr().err


@pytest.mark.parametrize("argv, named", [(["--template-timeout", "0"], "template timeout"),
                                         (["--template-memory", "8"], "at least 16 MiB")])
def test_a_bad_template_budget_is_a_one_line_error_before_any_model_loads(argv, named, capsys):
    from pyspec.cli import main

    assert main(["serve", "--tiny", *argv]) == 1
    err = capsys.readouterr().err
    assert "--template-timeout / --template-memory" in err and named in err


def test_serve_acceptance_reaches_the_engine(capsys):
    from pyspec.cli import main

    # the engine's own refusal proves the option reached Engine.load (rejection sampling takes no draft minimum)
    assert main(["serve", "--tiny", "--types", "draft-simple", "--draft-min", "2", "--acceptance", "rejection",
                 "--port", "0"]) == 1
    assert "needs spec.draft.n_min 0" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "expected"), [
    (["--spec-synth-len", " 2.5 "], {"synth_len": 2.5}),
    (["--spec-synth-rates", "0.9, 0.5,0.25"], {"synth_rates": [0.9, 0.5, 0.25]}),
    ([], {}),
])
def test_synthetic_acceptance_options_reach_the_engine_keywords(argv: list[str], expected: dict[str, Any]):
    _, opts = _parse(*argv)
    assert {k: v for k, v in opts.spec_kw.items() if k.startswith("synth")} == expected
    assert not {"--spec-synth-len", "--spec-synth-rates"} & set(opts.not_applied)


@pytest.mark.parametrize("argv", [
    ["--spec-synth-len", "-1"],  # arg.cpp: -1 is "not set", refused
    ["--spec-synth-len", "2x"],
    ["--spec-synth-len", "1_0"],  # std::stod reads no digit separators
    ["--spec-synth-rates", "0.5,,0.25"],
    ["--spec-synth-rates", "0.5,high"],
])
def test_a_bad_synthetic_acceptance_value_is_refused(argv: list[str], capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit):
        _parse(*argv)
    assert argv[0] in capsys.readouterr().err


def test_synthetic_acceptance_rates_through_engine_load_accept_every_draft():
    from pyspec.generation.engine import Engine, Request
    from pyspec.testing.models import tiny_model_paths

    target, draft = tiny_model_paths("draft-simple")
    with Engine.load(target, types="draft-simple", draft=draft, n_ctx=256, n_batch=64, n_threads=1, n_max=4,
                     synth_rates=[1.0] * 4, adaptive_draft=False) as eng:
        h = eng.submit(Request(prompt="one two three", n_predict=24))
        eng.run_until_idle()
        st = h.result().stats
    assert st.n_drafted > 0 and st.n_accepted == st.n_drafted


@pytest.mark.parametrize(("argv", "adaptive"), [
    ([], True),
    (["--fixed-draft"], False),
    (["--spec-synth-rates", "1.0,1.0"], False),  # benchmarking: chance decides acceptance, not the tokens
    (["--spec-synth-len", "2.5"], False),
])
def test_synthetic_acceptance_runs_llama_cpps_fixed_draft_lengths(monkeypatch: pytest.MonkeyPatch,
                                                                  argv: list[str], adaptive: bool):
    from pyspec.generation.engine import Engine

    seen: dict[str, Any] = {}

    def load(model: Any = None, **kw: Any) -> Any:
        seen.update(kw)
        raise _Loaded

    monkeypatch.setattr(Engine, "load", staticmethod(load))
    rest, dropped = commands._serve_argv(["--port", "0", "-m", "t.gguf", "-md", "d.gguf", *argv])
    args = commands.build_parser().parse_args(["serve", *rest])
    args.llama_dropped = dropped
    with pytest.raises(_Loaded):
        commands.cmd_serve(args)
    assert seen["adaptive_draft"] is adaptive


# --------------------------------------------------------------------------- the threadpools' options


@pytest.fixture
def eight_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    monkeypatch.setattr(os, "cpu_count", lambda: 8)


def test_the_priority_numbers_are_ggmls():
    from pyspec.core.threadpool import THREAD_PRIORITIES

    assert [PRIORITY_NAMES[n] for n in sorted(PRIORITY_NAMES)] == list(THREAD_PRIORITIES)


@pytest.mark.parametrize(("argv", "cpus"), [
    (["-C", "5"], (0, 2)),
    (["--cpu-mask", "0xA"], (1, 3)),
    (["-C", "f0"], (4, 5, 6, 7)),
    (["-C", "0x0001"], (0,)),
    (["-Cr", "2-4"], (2, 3, 4)),
    (["--cpu-range", "-1"], (0, 1)),
    (["-Cr", "6-"], (6, 7)),  # no hi: every CPU ggml knows, this machine's kept
    (["-C", "1", "-Cr", "4-5", "-C", "0x8"], (0, 3, 4, 5)),  # arg.cpp: each adds to the one mask
    (["-Cr", "3-1", "-C", "4"], (2,)),  # lo > hi sets nothing (parse_cpu_range's loop)
])
def test_cpu_masks_and_ranges_read_as_llama_cpp_reads_them(eight_cpus: None, argv: list[str],
                                                            cpus: tuple[int, ...]):
    _, opts = _parse(*argv)
    assert opts.cpuparams == CommonCpuParams(cpumask=cpus)
    assert opts.cpuparams_batch is None and opts.not_applied == []


def test_a_long_mask_reads_its_first_128_digits(eight_cpus: None):
    # parse_cpu_mask reads at most 128 digits (512 CPUs), the first of them the highest
    _, opts = _parse("-C", "0" * 127 + "3" + "f" * 10)
    assert opts.cpuparams.cpumask == (0, 1)


def test_cpus_this_machine_lacks_are_dropped_with_a_warning(eight_cpus: None, caplog: pytest.LogCaptureFixture):
    with caplog.at_level(logging.WARNING, logger="pyspec"):
        _, opts = _parse("-C", "0x301")
    assert opts.cpuparams.cpumask == (0,)
    assert any("CPUs 8,9 are not on this machine" in r.getMessage() for r in caplog.records)
    with pytest.raises(CliError, match="-C/--cpu-mask and -Cr/--cpu-range name no CPU of this machine"):
        _parse("-C", "0x300")
    with pytest.raises(CliError, match="name no CPU"):
        _parse("-C", "0")


@pytest.mark.parametrize(("argv", "expected"), [
    ([], COMMON_CPU_PARAMS_DEFAULT),
    (["-t", "2"], COMMON_CPU_PARAMS_DEFAULT),  # the pool takes the context's count
    (["--prio", "-1"], CommonCpuParams(priority="low")),
    (["--prio", "2", "--poll", "0", "--cpu-strict", "1"], CommonCpuParams(priority="high", poll=0, strict_cpu=True)),
    (["--poll", "100", "--cpu-strict", "0"], CommonCpuParams(poll=100)),
    (["--cpu-strict", "7"], CommonCpuParams(strict_cpu=True)),  # std::stoul: any but 0
])
def test_generation_pool_options(argv: list[str], expected: CommonCpuParams):
    _, opts = _parse(*argv)
    assert opts.cpuparams == expected
    assert opts.cpuparams_batch is None  # postprocess_cpu_params: no -tb, the batch pool copies it


def test_the_batch_pool_has_its_own_options_only_with_threads_batch(eight_cpus: None):
    _, opts = _parse("-t", "2", "-tb", "4", "--prio", "2", "-Cb", "f0", "-Crb", "0-1", "--prio-batch", "1",
                     "--poll-batch", "0", "--cpu-strict-batch", "1")
    assert opts.cpuparams == CommonCpuParams(priority="high")
    assert opts.cpuparams_batch == CommonCpuParams(n_threads=4, cpumask=(0, 1, 4, 5, 6, 7), priority="medium",
                                                   strict_cpu=True, poll=0)
    assert opts.context_kw == {"n_threads_batch": 4} and opts.not_applied == []
    # -tb alone: a batch pool of that size with common_cpu_params' defaults, --prio not copied (as llama-server)
    _, opts = _parse("--prio", "1", "-tb", "3")
    assert opts.cpuparams_batch == CommonCpuParams(n_threads=3)
    # -tb 0 (or less): every core, as std::thread::hardware_concurrency()
    _, opts = _parse("-tb", "0")
    assert opts.cpuparams_batch == CommonCpuParams(n_threads=8) and opts.context_kw == {"n_threads_batch": 8}


def test_batch_options_without_threads_batch_are_named_as_having_no_effect():
    _, opts = _parse("--prio", "1", "--prio-batch", "2", "--poll-batch", "0", "-Crb", "0-0")
    assert opts.cpuparams == CommonCpuParams(priority="medium") and opts.cpuparams_batch is None
    assert opts.not_applied == ["-Cb/-Crb (without -tb)", "--prio-batch (without -tb)", "--poll-batch (without -tb)"]


def test_too_many_batch_threads_is_one_cli_error():
    with pytest.raises(CliError, match="-tb/--threads-batch 513 is more than ggml's 512 threads"):
        _parse("-tb", "513")


def test_cmd_serve_hands_the_threadpools_to_engine_load(monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture):
    from pyspec.generation.engine import Engine

    seen: dict[str, Any] = {}

    def load(model: Any = None, **kw: Any) -> Any:
        seen.update(kw)
        raise _Loaded

    monkeypatch.setattr(Engine, "load", staticmethod(load))
    rest, dropped = commands._serve_argv(["--port", "0", "-m", "t.gguf", "-t", "1", "-tb", "2", "--poll", "0",
                                          "--prio", "0", "-Cr", "0-0"])
    args = commands.build_parser().parse_args(["serve", *rest])
    args.llama_dropped = dropped
    with caplog.at_level(logging.WARNING, logger="pyspec"), pytest.raises(_Loaded):
        commands.cmd_serve(args)
    assert seen["cpuparams"] == CommonCpuParams(cpumask=(0,), poll=0)
    assert seen["cpuparams_batch"] == CommonCpuParams(n_threads=2)
    assert seen["context_kw"] == {"n_threads_batch": 2} and seen["n_threads"] == 1
    assert seen["context_shift"] is False
    assert not [r for r in caplog.records if "llama-server options" in r.getMessage()]


def test_threadpool_options_through_engine_load_give_the_contexts_their_threads():
    from pyspec.generation.engine import Engine, Request
    from pyspec.testing.models import tiny_model_paths

    _, opts = _parse("-t", "1", "-tb", "2", "--poll", "0", "-Cr", "0-0", "--cpu-strict", "1")
    target, draft = tiny_model_paths("draft-simple")
    with Engine.load(target, types="draft-simple", draft=draft, n_ctx=256, n_batch=64, n_threads=1,
                     context_kw=opts.context_kw, cpuparams=opts.cpuparams,
                     cpuparams_batch=opts.cpuparams_batch) as eng:
        # the target decodes on two pools (1 thread, 2 for batches); the draft context gets -tb's count too
        assert [p.n_threads for p in eng.ctx_tgt._threadpools] == [1, 2]
        assert (eng.ctx_tgt.n_threads, eng.ctx_tgt.n_threads_batch) == (1, 2)
        assert eng.ctx_dft is not None and (eng.ctx_dft.n_threads, eng.ctx_dft.n_threads_batch) == (1, 2)
        h = eng.submit(Request(prompt="one two three", n_predict=8))
        eng.run_until_idle()
        assert h.result().stats.n_gen == 8


def test_cmd_serve_hands_context_shift_and_keep_on(monkeypatch: pytest.MonkeyPatch):
    from pyspec.generation.engine import Engine

    seen: dict[str, Any] = {}

    def load(model: Any = None, **kw: Any) -> Any:
        seen.update(kw)
        raise _Loaded

    monkeypatch.setattr(Engine, "load", staticmethod(load))
    rest, dropped = commands._serve_argv(["--port", "0", "-m", "t.gguf", "--context-shift", "--keep", "-1"])
    args = commands.build_parser().parse_args(["serve", *rest])
    args.llama_dropped = dropped
    with pytest.raises(_Loaded):
        commands.cmd_serve(args)
    assert seen["context_shift"] is True
