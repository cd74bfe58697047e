"""Benchmark: plain decoding, each speculative type, and the C++ reference loop on the same models.

Every run gets fresh contexts and greedy sampling. The engines:

- ``python``: the generation driver over the Python port, with the cost-aware
  draft length (:mod:`pyspec.generation.draft_length`), as pyspec runs by default;
- ``fixed``: the same driver with llama.cpp's fixed draft lengths;
- ``cpp``: the driver over the C++ reference implementation (fixed draft lengths);
- ``loop``: the whole loop in C++ (:func:`pyspec.generation.cpp_loop.cpp_generate`,
  fixed draft lengths), the baseline of the Python layer's cost.

Configurations are interleaved (repeats outermost, then prompts, types, engines),
so a change in the machine's speed touches all of them alike. The report gives,
per type and engine: the acceptance; the generation speed (median over repeats;
each repeat sums all prompts); the speed-up over plain decoding on the same
engine, over all prompts and for the worst prompt (median over repeats of the
paired ratio); the **bound**, the most any choice of draft lengths could gain
with the drafts the implementation made (from a fixed-length run, on the verify
cost curve measured in this run: :func:`~pyspec.generation.draft_length.oracle_speedup`);
the ratio to the C++ loop (median over prompts and repeats of the paired ratio);
the wall time per step outside llama_decode /
llama_encode; whether the tokens equal plain decoding's, and the C++ loop's, for
every prompt and repeat; and, from the drafts each run verified, vLLM's mean
accepted length (1 + accepted / drafts: tokens per verified draft) and the
acceptance per draft position (the share of drafts whose token i was accepted;
it cannot rise with i, since a token is accepted only after every token before it).

The ``suffix`` type (pyspec's own, :mod:`pyspec.suffix`; ``"suffix"`` in a type set, as
``Engine.load`` takes it) runs through the same driver, so on the ``python`` and
``fixed`` engines only: it has no C++ twin, and the report names the ``cpp`` and
``loop`` runs it did not make (:attr:`Report.skipped`).

With ``oracle=(2, 4, 8, ...)`` each type also runs with llama.cpp's fixed draft
lengths capped at each of those lengths (:class:`~pyspec.generation.draft_length.CappedDraftLength`);
per prompt, the best of them and of the ``fixed`` engine, chosen in hindsight,
is the **oracle**, and each row says how close it comes (its paired speed-up
over the oracle's, per prompt, with the spread over repeats).
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pyspec.cli.bench_prompts import BUILTIN_PROMPTS, Prompt, prompt_inputs
from pyspec.common.params import CommonSpeculativeType as T
from pyspec.common.speculative import common_speculative_type_to_str
from pyspec.generation.contexts import ModelSet, open_contexts, parse_types, spec_params
from pyspec.generation.draft_length import CappedDraftLength, CostCurve, oracle_speedup
from pyspec.generation.driver import SpeculativeGenerator, greedy_sampling
from pyspec.generation.statistics import GenerationStats, SequenceResult, SpecDecodeCounters
from pyspec.suffix.impl import SuffixParams, suffix_params
from pyspec.suffix.names import SUFFIX_TYPE_NAME, split_suffix_type

__all__ = [
    "BUILTIN_PROMPTS", "ENGINES", "NO_CPP_TWIN", "Report", "Row", "Run", "common_log", "format_oracle",
    "format_table", "parse_bench_types", "read_prompts", "run_bench", "run_once", "runs_on", "split_types",
    "write_json", "write_plot",
]

ENGINES = ("python", "fixed", "cpp", "loop")
# engines that run the port with llama.cpp's fixed draft lengths, whose drafts give the bound
_FIXED = ("fixed", "cpp")
# engines that run the C++ reference, where a type of pyspec's own has no twin
_CPP = ("cpp", "loop")
NO_CPP_TWIN = "the suffix type is pyspec's own, with no C++ twin; it runs on the port only (engines python, fixed)"
# the draft positions the table shows (the JSON and the plot have them all)
_TABLE_POSITIONS = 8

def read_prompts(path: str | Path) -> list[str]:
    """Prompts from a file: a JSON list of strings, or texts separated by lines holding only ``---``."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    prompts: list[str]
    if text.lstrip().startswith(("[", "{")):
        try:
            prompts = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
            raise ValueError(f"{path}: a JSON prompt file must hold a list of strings")
    else:
        prompts = []
        cur: list[str] = []
        for line in text.splitlines(keepends=True):
            if line.strip() == "---":
                prompts.append("".join(cur))
                cur = []
            else:
                cur.append(line)
        prompts.append("".join(cur))
    prompts = [p for p in prompts if p.strip()]
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def parse_bench_types(item: str) -> list[Any]:
    """One ``--types`` item (``"ngram-mod"``, ``"suffix+ngram-mod"``) as :func:`run_bench` takes a type set:
    llama.cpp's types, after ``"suffix"`` (SUFFIX_TYPE_NAME) when the item names it."""
    rest, suffix = split_suffix_type(item)
    types: list[Any] = parse_types(rest)
    if suffix:
        return [SUFFIX_TYPE_NAME] + ([] if types == [T.NONE] else types)
    return types


def split_types(types: Sequence[Any]) -> tuple[list[T], bool]:
    """A type set's llama.cpp types ([NONE] when it has none) and whether it holds the suffix type."""
    rest, suffix = split_suffix_type(list(types))
    return parse_types(rest), suffix


def runs_on(types: Sequence[Any], engine: str) -> bool:
    """Whether the type set runs on the engine (``fixed@N`` is the fixed engine): not the suffix type in C++."""
    return not (split_types(types)[1] and engine.partition("@")[0] in _CPP)


@contextlib.contextmanager
def common_log(verbose: bool) -> Iterator[None]:
    """The C++ reference's common log on stderr only with --verbose."""
    from pyspec.core.log import set_common_log_verbosity

    set_common_log_verbosity(0 if verbose else -1)
    try:
        yield
    finally:
        set_common_log_verbosity(-1)


@dataclass
class Run:
    """One generation: a type on an engine for one prompt, one repeat."""

    type: str
    engine: str
    prompt: int
    repeat: int
    tokens: list[int]
    n_gen_tokens: int
    t_gen_s: float
    t_decode_gen_s: float
    n_steps: int
    n_drafted: int
    n_accepted: int
    t_draft_s: float = 0.0
    drafts: list[tuple[int, int]] = field(default_factory=list)

    @property
    def tps(self) -> float:
        return self.n_gen_tokens / self.t_gen_s if self.t_gen_s > 0 else 0.0


@dataclass
class Row:
    """The summary of one type on one engine."""

    type: str
    engine: str
    n_gen_tokens: int
    n_drafted: int
    n_accepted: int
    acceptance: float
    # vLLM's mean acceptance length: 1 + accepted / verified drafts, over every run of the row (None: no
    # draft verified, or the C++ loop, which reports totals only); n_drafts: verified drafts (per repeat)
    mean_accepted_length: float | None
    # [i]: the share of the verified drafts whose token i (from 0) was accepted (vLLM's per-position rate)
    accepted_per_pos: list[float]
    n_drafts: int
    gen_tps: float  # median over repeats of (tokens of all prompts / their generation time)
    gen_tps_runs: list[float]
    speedup: float | None  # over plain decoding (type none) on the same engine, all prompts
    speedup_prompts: list[float]  # per prompt: median over repeats of the paired ratio to plain decoding
    bound: float | None  # the most draft lengths chosen with foresight could gain (all prompts)
    bound_prompts: list[float]
    cpp_ratio: float | None  # tok/s / the C++ loop's tok/s for the type (median of the paired runs' ratios)
    overhead_us_per_step: float
    same_as_plain: bool | None  # tokens equal plain decoding's for every prompt and repeat
    identical: bool | None  # tokens equal the C++ loop's (or, without it, the other engine's) for every prompt
    # with --oracle, per prompt: the best fixed draft length in hindsight (x plain), that length (0: the
    # fixed engine's own), and this row's paired speed-up over it (median over repeats, and the range)
    oracle_prompts: list[float] = field(default_factory=list)
    oracle_n_prompts: list[int] = field(default_factory=list)
    vs_oracle_prompts: list[float] = field(default_factory=list)
    vs_oracle_range: list[tuple[float, float]] = field(default_factory=list)
    # per prompt (rows other than the fixed engine's, where it ran the type): the paired ratio of this row's
    # tok/s to the better of plain decoding's and the fixed engine's in the same repeat, median and range
    vs_best_prompts: list[float] = field(default_factory=list)
    vs_best_range: list[tuple[float, float]] = field(default_factory=list)
    # per prompt, with vs_best_prompts: whether this row, plain decoding and the fixed engine generated the
    # same tokens in every repeat (in the default numerics a verify batch's shape can change a token's logits,
    # and from there the text: the ratio then compares different generations)
    same_text_prompts: list[bool] = field(default_factory=list)

    @property
    def speedup_min(self) -> float | None:
        return min(self.speedup_prompts) if self.speedup_prompts else None

    @property
    def vs_best_min(self) -> float | None:
        """The worst prompt's ratio to max(plain, fixed) (issue 28: at least 0.98)."""
        return min(self.vs_best_prompts) if self.vs_best_prompts else None

    @property
    def vs_oracle(self) -> float | None:
        """The median over prompts of the speed-up over the oracle (1.0: as good as the best fixed length)."""
        return statistics.median(self.vs_oracle_prompts) if self.vs_oracle_prompts else None


@dataclass
class Report:
    model: str
    n_predict: int
    repeat: int
    prompts: list[str]
    params: dict[str, Any]
    rows: list[Row] = field(default_factory=list)
    cost_curve: dict[int, float] = field(default_factory=dict)  # verify seconds per batch size (medians)
    oracle: list[int] = field(default_factory=list)  # the draft-length caps tried (--oracle)
    # per prompt: the best (type, cap, speed-up over plain) over every type and cap, in hindsight
    oracle_best: list[tuple[str, int, float]] = field(default_factory=list)
    # (type, engine, why): the configurations asked for and not run (the suffix type on cpp and loop)
    skipped: list[tuple[str, str, str]] = field(default_factory=list)
    wall_s: float = 0.0

    def row(self, type_name: str, engine: str) -> Row | None:
        for r in self.rows:
            if r.type == type_name and r.engine == engine:
                return r
        return None

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for row, out in zip(self.rows, d["rows"], strict=True):
            out["speedup_min"] = row.speedup_min
            out["vs_oracle"] = row.vs_oracle
            out["vs_best_min"] = row.vs_best_min
        return d


def run_once(
    models: ModelSet,
    types: Sequence[Any],
    engine: str,
    prompt: str | Sequence[int],
    n_predict: int,
    spec_kw: dict[str, Any],
    ctx_kw: dict[str, Any],
    curve: CostCurve | None = None,
    limit: int | None = None,
    suffix: SuffixParams | None = None,
) -> tuple[SequenceResult, GenerationStats]:
    """One greedy generation on fresh contexts; returns the result and the statistics.

    ``curve``, when given, receives the verify cost curve the run measured (or shared);
    ``limit`` caps llama.cpp's fixed draft lengths (an oracle candidate; python engine only).
    ``types`` may hold ``"suffix"`` (the Engine's suffix type with ``suffix``, by default its n_max from
    ``spec_kw``'s as in Engine.load); ValueError on the cpp and loop engines, which have no suffix type.
    """
    llama, wants_suffix = split_types(types)
    if wants_suffix and not runs_on(types, engine):
        raise ValueError(f"engine {engine}: {NO_CPP_TWIN}")
    spec = spec_params(llama, **spec_kw)
    with open_contexts(models, spec, **ctx_kw) as cs:
        if engine == "loop":
            from pyspec.generation.cpp_loop import cpp_generate

            (res,), st = cpp_generate(cs.ctx_tgt, [prompt], n_predict, spec, greedy_sampling())
            return res, st
        # the suffix type alone: no llama.cpp spec, as Engine.load passes it
        with SpeculativeGenerator(cs.ctx_tgt, None if wants_suffix and llama == [T.NONE] else spec, greedy_sampling(),
                                  n_seq=1, backend="cpp" if engine == "cpp" else "python",
                                  adaptive_draft=engine == "python",
                                  draft_controller=None if limit is None else CappedDraftLength(limit),
                                  suffix=(suffix or suffix_params(spec_kw.get("n_max"))) if wants_suffix else None
                                  ) as gen:
            (res,) = gen.generate([prompt], n_predict)
            if curve is not None and gen.draft_ctl is not None:
                for n, c in gen.draft_ctl.curve.as_dict().items():
                    curve.record(n, c)
            return res, gen.stats


def _type_key(types: Sequence[Any]) -> str:
    llama, suffix = split_types(types)
    names = [common_speculative_type_to_str(t) for t in llama if not (suffix and t == T.NONE)]
    return "+".join(([SUFFIX_TYPE_NAME] if suffix else []) + names)


def _spec_counters(runs: Sequence[Run]) -> SpecDecodeCounters | None:
    """vLLM's counters over the runs' verified drafts; None when a run drafted without reporting its
    drafts (the C++ loop gives totals only)."""
    counters = SpecDecodeCounters()
    for r in runs:
        if r.n_drafted and not r.drafts:
            return None
        for n, a in r.drafts:
            counters.record(n, a)
    return counters


def run_bench(
    models: ModelSet,
    type_sets: Sequence[Sequence[Any]],
    *,
    engines: Sequence[str] = ("python", "fixed", "loop"),
    prompts: Sequence[Prompt] = BUILTIN_PROMPTS,
    n_predict: int = 96,
    repeat: int = 3,
    spec_kw: dict[str, Any] | None = None,
    ctx_kw: dict[str, Any] | None = None,
    model_name: str = "",
    progress: Callable[[str], Any] | None = None,
    oracle: Sequence[int] = (),
    suffix: SuffixParams | None = None,
) -> Report:
    """Run every type set (plain decoding first) on every engine, ``repeat`` times over all prompts.

    ``oracle``: draft-length caps; each speculative type also runs with llama.cpp's fixed
    lengths capped at each (engine name ``fixed@N``), for the oracle columns. A type set may hold
    ``"suffix"`` (:func:`parse_bench_types`); it runs on the python and fixed engines only, and the
    others are listed in :attr:`Report.skipped`. ``suffix``: its parameters (default: as Engine.load's).
    """
    if any(n <= 0 for n in oracle):
        raise ValueError(f"oracle caps must be positive, got {list(oracle)}")
    if not prompts:
        raise ValueError("no prompts to run")
    spec_kw = spec_kw or {}
    ctx_kw = ctx_kw or {}
    t_start = time.perf_counter()
    sets: list[list[Any]] = [[T.NONE]] + [list(ts) for ts in type_sets if list(ts) != [T.NONE]]
    params = {**spec_kw, **ctx_kw, "engines": list(engines)}
    if suffix is not None:
        params["suffix"] = asdict(suffix)
    texts, inputs = prompt_inputs(models.target, prompts)  # a chat prompt rendered with the target's template
    report = Report(model_name, n_predict, repeat, texts, params, oracle=sorted(set(oracle)))
    curve = CostCurve(window=999)

    # warm-up: page the weights in, so the first timed run is not the slowest
    if progress is not None:
        progress("warming up (one short plain run)...")
    run_once(models, [T.NONE], "python", inputs[0], min(8, n_predict), spec_kw, ctx_kw)

    def plan(types: list[Any]) -> list[str]:
        # plain decoding is the same for python and fixed: run it once
        if types == [T.NONE]:
            return [e for e in engines if e != "fixed"] if "python" in engines else list(engines)
        return [e for e in [*engines, *(f"fixed@{n}" for n in report.oracle)] if runs_on(types, e)]

    report.skipped = [(_type_key(ts), e, NO_CPP_TWIN) for ts in sets for e in engines if not runs_on(ts, e)]

    runs: list[Run] = []
    total = repeat * len(inputs) * sum(len(plan(ts)) for ts in sets)
    done = 0
    # repeats outermost, so drift in the machine's speed touches every configuration alike
    for rep in range(repeat):
        for ip, prompt in enumerate(inputs):
            for types in sets:
                for engine in plan(types):
                    if progress is not None:  # a run can take many seconds: say what is being measured
                        progress(f"measuring {_type_key(types)} on {engine} ({done + 1}/{total})...")
                    base, _, cap = engine.partition("@")
                    res, st = run_once(models, types, "python" if cap else base, prompt, n_predict, spec_kw, ctx_kw,
                                       curve, int(cap) if cap else None, suffix)
                    runs.append(Run(_type_key(types), engine, ip, rep, list(res.tokens), st.n_gen_tokens,
                                    st.t_gen_s, st.t_decode_gen_s, st.n_steps, st.n_drafted, st.n_accepted,
                                    st.t_draft_s, list(st.drafts)))
                    done += 1
                    if progress is not None:
                        progress(f"[{done}/{total}] repeat {rep + 1} prompt {ip + 1} {_type_key(types):<14} "
                                 f"{engine:<6} {st.gen_tps:7.1f} tok/s  accepted {st.n_accepted}/{st.n_drafted}")
    if "fixed" in engines and "python" in engines:  # the plain runs stand for both
        runs += [Run(**{**asdict(r), "engine": "fixed"}) for r in runs if r.type == "none" and r.engine == "python"]
    report.cost_curve = curve.as_dict()
    _summarise(report, runs, sets, engines, repeat, len(prompts), curve)
    if report.oracle:
        _oracle(report, runs, repeat, len(prompts), "python" if "python" in engines else engines[0])
    report.wall_s = time.perf_counter() - t_start
    return report


def _summarise(report: Report, runs: list[Run], sets: Sequence[Sequence[Any]], engines: Sequence[str], repeat: int,
               n_prompts: int, curve: CostCurve) -> None:
    def select(type_key: str, engine: str, prompt: int | None = None, rep: int | None = None) -> list[Run]:
        return [r for r in runs if r.type == type_key and r.engine == engine
                and (prompt is None or r.prompt == prompt) and (rep is None or r.repeat == rep)]

    def tps(rr: list[Run]) -> float:
        t = sum(r.t_gen_s for r in rr)
        return sum(r.n_gen_tokens for r in rr) / t if t > 0 else 0.0

    def bound(rr: list[Run]) -> float | None:
        if not rr or not curve.ready:
            return None
        return oracle_speedup(curve, [d for r in rr for d in r.drafts], sum(r.n_steps for r in rr),
                              sum(r.n_gen_tokens for r in rr), sum(r.t_draft_s for r in rr))

    for types in sets:
        key = _type_key(types)
        fixed_engine = next((e for e in _FIXED if e in engines and runs_on(types, e)), None)
        for engine in engines:
            if not runs_on(types, engine):
                continue
            mine = select(key, engine)
            per_rep = [tps(select(key, engine, rep=k)) for k in range(repeat)]
            plain_rep = [tps(select("none", engine, rep=k)) for k in range(repeat)]
            per_prompt = []
            for ip in range(n_prompts):
                ratios = [tps(select(key, engine, ip, k)) / p for k in range(repeat)
                          if (p := tps(select("none", engine, ip, k))) > 0]
                per_prompt.append(statistics.median(ratios) if ratios else 0.0)
            spec = key != "none"
            src = select(key, fixed_engine) if spec and fixed_engine else []
            n_steps = sum(r.n_steps for r in mine)
            outside = sum(max(0.0, r.t_gen_s - r.t_decode_gen_s) for r in mine)
            n_drafted = sum(r.n_drafted for r in mine) // repeat
            n_accepted = sum(r.n_accepted for r in mine) // repeat
            plains = {(r.prompt, r.repeat): r.tokens for r in select("none", engine)}
            counters = _spec_counters(mine) if spec else None
            report.rows.append(Row(
                type=key, engine=engine,
                n_gen_tokens=sum(r.n_gen_tokens for r in mine) // repeat,
                n_drafted=n_drafted, n_accepted=n_accepted,
                acceptance=n_accepted / n_drafted if n_drafted else 0.0,
                mean_accepted_length=counters.mean_acceptance_length if counters and counters.n_drafts else None,
                accepted_per_pos=[v / counters.n_drafts for v in counters.accepted_per_pos]
                if counters and counters.n_drafts else [],
                n_drafts=counters.n_drafts // repeat if counters else 0,
                gen_tps=statistics.median(per_rep), gen_tps_runs=per_rep,
                speedup=statistics.median([a / b for a, b in zip(per_rep, plain_rep, strict=True) if b > 0] or [0.0]),
                speedup_prompts=per_prompt,
                bound=bound(src) if spec else None,
                bound_prompts=[b for ip in range(n_prompts) if (b := bound([r for r in src if r.prompt == ip]))]
                if spec else [],
                cpp_ratio=None,
                overhead_us_per_step=outside / n_steps * 1e6 if n_steps else 0.0,
                same_as_plain=all(plains.get((r.prompt, r.repeat)) == r.tokens for r in mine) if spec else None,
                identical=None,
            ))
            if spec and engine != "fixed" and select(key, "fixed"):
                row = report.rows[-1]
                for ip in range(n_prompts):
                    bests = [max(tps(select("none", engine, ip, k)), tps(select(key, "fixed", ip, k)))
                             for k in range(repeat)]
                    ratios = [tps(select(key, engine, ip, k)) / b for k, b in enumerate(bests) if b > 0]
                    row.vs_best_prompts.append(statistics.median(ratios) if ratios else 0.0)
                    row.vs_best_range.append((min(ratios), max(ratios)) if ratios else (0.0, 0.0))
                    row.same_text_prompts.append(all(
                        _tokens(select(key, engine, ip, k)) == _tokens(select("none", engine, ip, k))
                        == _tokens(select(key, "fixed", ip, k)) for k in range(repeat)))

    # ratios to the C++ loop (same draft lengths for fixed and cpp), token identity with it
    baseline = "loop" if "loop" in engines else ("cpp" if "cpp" in engines else None)
    for row in report.rows:
        if baseline is None:
            continue
        if row.engine != "loop" and "loop" in engines:
            # paired: each run against the loop's run of the same prompt and repeat, made just before
            # or after it, so that the machine's drift (a decode's time moves by several percent
            # between runs here) falls out of the ratio
            loops = {(r.prompt, r.repeat): r for r in select(row.type, "loop")}
            pairs = [tps([r]) / t_loop for r in select(row.type, row.engine)
                     if (lr := loops.get((r.prompt, r.repeat))) is not None and (t_loop := tps([lr])) > 0]
            row.cpp_ratio = statistics.median(pairs) if pairs else None
        other = baseline if row.engine != baseline else next((e for e in engines if e != baseline), None)
        if other is not None and select(row.type, other):  # the suffix type has no loop run to compare
            mine_t = {(r.prompt, r.repeat): r.tokens for r in select(row.type, row.engine)}
            theirs = {(r.prompt, r.repeat): r.tokens for r in select(row.type, other)}
            row.identical = all(mine_t[k] == theirs.get(k) for k in mine_t)


def _tokens(runs: list[Run]) -> list[int] | None:
    """The tokens of a configuration's one run for a prompt and repeat (None: it did not run)."""
    return runs[0].tokens if runs else None


def _oracle(report: Report, runs: list[Run], repeat: int, n_prompts: int, plain_engine: str) -> None:
    """The oracle columns: per prompt, the best fixed draft length in hindsight, and each row against it."""
    def tps(type_key: str, engine: str, ip: int, k: int) -> float:
        rr = [r for r in runs if r.type == type_key and r.engine == engine and r.prompt == ip and r.repeat == k]
        t = sum(r.t_gen_s for r in rr)
        return sum(r.n_gen_tokens for r in rr) / t if t > 0 else 0.0

    cands = [("fixed", 0)] + [(f"fixed@{n}", n) for n in report.oracle]
    best_all: list[tuple[str, int, float]] = [("none", 0, 1.0)] * n_prompts
    for row in report.rows:
        if row.type == "none":
            continue
        for ip in range(n_prompts):
            plain = [tps("none", plain_engine, ip, k) for k in range(repeat)]
            # each candidate's paired speed-up over plain decoding, median over repeats
            ratio = {n: statistics.median([tps(row.type, e, ip, k) / p if p > 0 else 0.0
                                           for k, p in enumerate(plain)])
                     for e, n in cands if any(r.engine == e and r.type == row.type for r in runs)}
            if not ratio:
                continue
            n_best = max(ratio, key=lambda n: ratio[n])
            row.oracle_prompts.append(ratio[n_best])
            row.oracle_n_prompts.append(n_best)
            e_best = "fixed" if n_best == 0 else f"fixed@{n_best}"
            mine = [tps(row.type, row.engine, ip, k) / b for k in range(repeat)
                    if (b := tps(row.type, e_best, ip, k)) > 0]
            row.vs_oracle_prompts.append(statistics.median(mine) if mine else 0.0)
            row.vs_oracle_range.append((min(mine), max(mine)) if mine else (0.0, 0.0))
            if row.engine == plain_engine and ratio[n_best] > best_all[ip][2]:
                best_all[ip] = (row.type, n_best, ratio[n_best])
    report.oracle_best = best_all


def format_oracle(report: Report) -> str:
    """Per prompt and row: the speed-up over the oracle (the best fixed length in hindsight), its spread over
    repeats, and the oracle's length and speed-up over plain decoding."""
    rows = [r for r in report.rows if r.vs_oracle_prompts]
    if not rows:
        return ""
    out = [f"vs oracle: each prompt's paired speed-up over the best fixed draft length in hindsight (caps "
           f"{', '.join(map(str, report.oracle))} and the fixed engine's own), median [min-max] of "
           f"{report.repeat} repeats; the oracle's cap and its speed-up over plain in ()"]
    for r in rows:
        cells = [f"{v:.2f} [{lo:.2f}-{hi:.2f}] ({'own' if n == 0 else n}: {o:.2f}x)"
                 for v, (lo, hi), n, o in zip(r.vs_oracle_prompts, r.vs_oracle_range, r.oracle_n_prompts,
                                              r.oracle_prompts, strict=True)]
        out.append(f"  {r.type:<14} {r.engine:<7} " + "  ".join(f"p{i + 1} {c}" for i, c in enumerate(cells)))
    out.append("best (type, cap) per prompt over every type: " + "  ".join(
        f"p{i + 1} {t} {'own' if n == 0 else n} {x:.2f}x" for i, (t, n, x) in enumerate(report.oracle_best)))
    return "\n".join(out)


def _fmt(x: float | None, spec: str, none: str = "-") -> str:
    return none if x is None else format(x, spec)


def format_table(report: Report) -> str:
    """The report as a text table, then the measured verify cost curve."""
    yn = {None: "-", True: "yes", False: "NO"}
    head = ("type", "engine", "accept", "drafted", "mean acc", "gen tok/s", "speed-up", "worst", "bound", "vs",
            "vs C++", "overhead", "same as", "same as")
    lines = [head, ("", "", "", "", "length", "(median)", "vs plain", "prompt", "", "oracle", "loop", "µs/step",
                    "plain", "C++ loop")]
    for r in report.rows:
        spec = r.type != "none"
        lines.append((
            r.type, r.engine,
            f"{r.acceptance * 100:.1f}%" if spec else "-",
            f"{r.n_accepted}/{r.n_drafted}" if spec else "-",
            _fmt(r.mean_accepted_length, ".2f"),
            f"{r.gen_tps:.1f}",
            _fmt(r.speedup, ".2f") + ("x" if r.speedup is not None else ""),
            _fmt(r.speedup_min, ".2f") + ("x" if r.speedup_min is not None else "") if spec else "-",
            _fmt(r.bound, ".2f") + ("x" if r.bound is not None else ""),
            _fmt(r.vs_oracle, ".2f"),
            _fmt(r.cpp_ratio, ".3f"),
            f"{r.overhead_us_per_step:.0f}",
            yn[r.same_as_plain], yn[r.identical],
        ))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
    out = []
    for k, line in enumerate(lines):
        cells = (str(c).ljust(w) if i < 2 else str(c).rjust(w)
                 for i, (c, w) in enumerate(zip(line, widths, strict=True)))
        out.append("  ".join(cells))
        if k == 1:
            out.append("  ".join("-" * w for w in widths))
    out.append("bound: the speed-up if every step verified exactly the draft tokens that get accepted (the drafts "
               "of the fixed-length run,\non the verify cost curve below); worst prompt: the lowest per-prompt "
               "speed-up (median over repeats of the paired ratio);\nmean acc length: 1 + accepted / verified "
               "drafts (tokens per verified draft, vLLM's mean acceptance length).")
    engine = _plot_engine(report)
    pos_rows = [r for r in report.rows if r.engine == engine and r.accepted_per_pos]
    if pos_rows:
        out.append(f"acceptance per draft position ({engine}): the share of verified drafts whose token i was "
                   "accepted")
        w = max(len(r.type) for r in pos_rows)
        for r in pos_rows:
            shares = "  ".join(f"{i + 1}:{v:.2f}" for i, v in enumerate(r.accepted_per_pos[:_TABLE_POSITIONS]))
            more = f"  ... ({len(r.accepted_per_pos)} positions)" if len(r.accepted_per_pos) > _TABLE_POSITIONS else ""
            out.append(f"  {r.type:<{w}}  {shares}{more}")
    best_rows = [r for r in report.rows if r.vs_best_prompts]
    if best_rows:
        out.append(f"vs max(plain, fixed): each prompt's tok/s over the better of plain decoding's and the fixed "
                   f"engine's in the same repeat, median [min-max] of {report.repeat}")
        for r in best_rows:
            same = r.same_text_prompts or [True] * len(r.vs_best_prompts)
            text = "  ".join(f"p{i + 1} {v:.2f}{'' if eq else '*'} [{lo:.2f}-{hi:.2f}]"
                             for i, (v, (lo, hi), eq) in enumerate(zip(r.vs_best_prompts, r.vs_best_range, same,
                                                                       strict=True)))
            out.append(f"  {r.type:<14} {r.engine:<7} {text}")
        if not all(eq for r in best_rows for eq in r.same_text_prompts):
            out.append("  *: the three generated different texts in some repeat (a verify batch's shape moved a "
                       "token's logits; --batch-invariant compares the same text)")
    skipped: dict[tuple[str, str], list[str]] = {}
    for t, e, why in report.skipped:
        skipped.setdefault((t, why), []).append(e)
    for (t, why), es in skipped.items():
        out.append(f"not run: {t} on {', '.join(es)}: {why}")
    if report.oracle:
        out.append(format_oracle(report))
    if report.cost_curve:
        c1 = report.cost_curve.get(1) or min(report.cost_curve.values())
        pts = "  ".join(f"{n}:{v / c1:.2f}" for n, v in sorted(report.cost_curve.items()))
        out.append(f"verify cost per batch size, x one-token decode ({c1 * 1e3:.2f} ms): {pts}")
    if any(r.engine in ("cpp", "loop") for r in report.rows) and any(
            t in r.type for r in report.rows for t in ("draft-simple", "draft-eagle3", "draft-mtp")):
        out.append("overhead: a draft model's decoding runs inside C++ on the cpp and loop engines, so there it "
                   "counts as overhead (on python and fixed it does not).")
    return "\n".join(out)


def write_json(report: Report, path: str | Path) -> None:
    Path(path).write_text(json.dumps(report.as_dict(), indent=2) + "\n", encoding="utf-8")


def _plot_engine(report: Report) -> str:
    """The engine whose rows the plot and the per-position lines show: python when it ran."""
    if report.row("none", "python") or not report.rows:
        return "python"
    return report.rows[0].engine


def write_plot(report: Report, path: str | Path) -> None:
    """A PNG, one engine's rows (python when it ran), every type side by side in three panels: the speed-up
    over plain decoding (with its bound from the measured verify cost curve, and each prompt's speed-up),
    the mean accepted length, and the acceptance per draft position."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("--plot needs matplotlib: pip install matplotlib") from None

    engine = _plot_engine(report)
    rows = [r for r in report.rows if r.engine == engine and r.type != "none"]
    colors = [f"C{k % 10}" for k in range(len(rows))]  # one colour per type in every panel
    xs = list(range(len(rows)))
    names = [r.type for r in rows]
    fig, (ax_s, ax_l, ax_p) = plt.subplots(1, 3, figsize=(16, 4.8))

    ax_s.bar(xs, [r.speedup or 0.0 for r in rows], 0.6, color=colors)
    for x, r in zip(xs, rows, strict=True):
        if r.bound is not None:
            ax_s.scatter([x], [r.bound], marker="_", s=600, color="black", zorder=3)
        if len(r.speedup_prompts) > 1:
            ax_s.scatter([x] * len(r.speedup_prompts), r.speedup_prompts, s=10, color="dimgrey", zorder=3)
    ax_s.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax_s.set_xticks(xs, names, rotation=20, ha="right")
    ax_s.set_ylabel("x plain decoding")
    ax_s.set_title("speed-up (black: bound; dots: per prompt)", fontsize=10)

    ax_l.bar(xs, [r.mean_accepted_length or 0.0 for r in rows], 0.6, color=colors)
    for x, r in zip(xs, rows, strict=True):
        if r.mean_accepted_length is not None:
            ax_l.annotate(f"{r.mean_accepted_length:.2f}", (x, r.mean_accepted_length), ha="center",
                          textcoords="offset points", xytext=(0, 3), fontsize=8)
    ax_l.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax_l.set_xticks(xs, names, rotation=20, ha="right")
    ax_l.set_ylabel("tokens per verified draft")
    ax_l.set_title("mean accepted length (1 + accepted / drafts)", fontsize=10)

    for r, c in zip(rows, colors, strict=True):
        if r.accepted_per_pos:
            ax_p.plot(range(1, len(r.accepted_per_pos) + 1), r.accepted_per_pos, marker="o", markersize=3,
                      color=c, label=r.type)
    ax_p.set_ylim(0, 1.02)
    ax_p.set_xlabel("draft position")
    ax_p.set_ylabel("share of drafts with that token accepted")
    ax_p.set_title("acceptance per draft position", fontsize=10)
    if any(r.accepted_per_pos for r in rows):
        ax_p.legend(fontsize=8)
    skipped = sorted({f"{t} on {e}" for t, e, _ in report.skipped})
    fig.suptitle(f"{Path(report.model).name or 'model'}, engine {engine}: {len(report.prompts)} prompts, "
                 f"n_predict {report.n_predict}, median of {report.repeat}"
                 + (f" (not run: {', '.join(skipped)}: no C++ twin)" if skipped else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)
