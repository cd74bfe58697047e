"""Benchmark: plain decoding, each speculative type, and the C++ reference loop on the same models.

Every run gets fresh contexts and greedy sampling. Three engines run each type:

- ``python``: the generation driver over the Python port;
- ``cpp``: the same driver over the C++ reference implementation;
- ``loop``: the whole loop in C++ (:func:`pyspec.reference.loop.cpp_generate`), the baseline.

The report gives, per type and engine, the acceptance rate, the generation
speed (median of the repeats; each repeat sums all prompts), the speed-up over
plain decoding on the same engine, the ratio to the C++ loop, the wall time per
step outside llama_decode / llama_encode, and whether the tokens equal the C++
loop's for every prompt.
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

from pyspec.common.params import CommonSpeculativeType as T
from pyspec.common.speculative import common_speculative_type_to_str
from pyspec.generation.contexts import ModelSet, open_contexts, spec_params
from pyspec.generation.driver import SpeculativeGenerator, greedy_sampling
from pyspec.generation.statistics import GenerationStats, SequenceResult

__all__ = [
    "BUILTIN_PROMPTS", "ENGINES", "Report", "Row", "Run", "common_log", "format_table", "read_prompts", "run_bench",
    "run_once", "write_json", "write_plot",
]

ENGINES = ("python", "cpp", "loop")

# continuations with repeated structure, where n-gram drafts have something to find
BUILTIN_PROMPTS: tuple[str, ...] = (
    "class Vector3:\n"
    "    def __init__(self, x, y, z):\n"
    "        self.x = x\n"
    "        self.y = y\n"
    "        self.z = z\n"
    "\n"
    "    def __add__(self, other):\n"
    "        return Vector3(self.x + other.x, self.y + other.y, self.z + other.z)\n"
    "\n"
    "    def __sub__(self, other):\n"
    "        return Vector3(self.x - other.x, self.y - other.y, self.z - other.z)\n"
    "\n"
    "    def __mul__(self, other):\n",
    "The days of the week are Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday.\n"
    "The months of the year are January, February, March,",
    "import unittest\n"
    "\n"
    "\n"
    "class TestStringMethods(unittest.TestCase):\n"
    "    def test_upper(self):\n"
    "        self.assertEqual('foo'.upper(), 'FOO')\n"
    "\n"
    "    def test_lower(self):\n"
    "        self.assertEqual('FOO'.lower(), 'foo')\n"
    "\n"
    "    def test_isupper(self):\n",
)


def read_prompts(path: str | Path) -> list[str]:
    """Prompts from a file: a JSON list of strings, or texts separated by lines holding only ``---``."""
    text = Path(path).read_text(encoding="utf-8")
    prompts: list[str]
    if text.lstrip().startswith("["):
        prompts = json.loads(text)
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


@dataclass
class Row:
    """The summary of one type on one engine."""

    type: str
    engine: str
    n_gen_tokens: int
    n_drafted: int
    n_accepted: int
    acceptance: float
    gen_tps: float  # median over repeats of (tokens of all prompts / their generation time)
    gen_tps_runs: list[float]
    speedup: float | None  # over plain decoding (type none) on the same engine
    cpp_ratio: float | None  # gen_tps / the C++ loop's gen_tps for the type
    overhead_us_per_step: float
    identical: bool | None  # tokens equal the C++ loop's (or, without it, the other engine's) for every prompt


@dataclass
class Report:
    model: str
    n_predict: int
    repeat: int
    prompts: list[str]
    params: dict[str, Any]
    rows: list[Row] = field(default_factory=list)
    wall_s: float = 0.0

    def row(self, type_name: str, engine: str) -> Row | None:
        for r in self.rows:
            if r.type == type_name and r.engine == engine:
                return r
        return None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_once(
    models: ModelSet,
    types: Sequence[T],
    engine: str,
    prompt: str,
    n_predict: int,
    spec_kw: dict[str, Any],
    ctx_kw: dict[str, Any],
) -> tuple[SequenceResult, GenerationStats]:
    """One greedy generation on fresh contexts; returns the result and the statistics."""
    spec = spec_params(types, **spec_kw)
    with open_contexts(models, spec, **ctx_kw) as cs:
        if engine == "loop":
            from pyspec.reference.loop import cpp_generate

            (res,), st = cpp_generate(cs.ctx_tgt, [prompt], n_predict, spec, greedy_sampling())
            return res, st
        with SpeculativeGenerator(cs.ctx_tgt, spec, greedy_sampling(), n_seq=1, engine=engine) as gen:
            (res,) = gen.generate([prompt], n_predict)
            return res, gen.stats


def _type_key(types: Sequence[T]) -> str:
    return "+".join(common_speculative_type_to_str(t) for t in types)


def run_bench(
    models: ModelSet,
    type_sets: Sequence[Sequence[T]],
    *,
    engines: Sequence[str] = ENGINES,
    prompts: Sequence[str] = BUILTIN_PROMPTS,
    n_predict: int = 96,
    repeat: int = 3,
    spec_kw: dict[str, Any] | None = None,
    ctx_kw: dict[str, Any] | None = None,
    model_name: str = "",
    progress: Callable[[str], Any] | None = None,
) -> Report:
    """Run every type set (plain decoding first) on every engine, ``repeat`` times over all prompts."""
    spec_kw = spec_kw or {}
    ctx_kw = ctx_kw or {}
    t_start = time.perf_counter()
    sets = [[T.NONE]] + [list(ts) for ts in type_sets if list(ts) != [T.NONE]]
    report = Report(model_name, n_predict, repeat, list(prompts), {**spec_kw, **ctx_kw, "engines": list(engines)})

    # warm-up: page the weights in, so the first timed run is not the slowest
    run_once(models, [T.NONE], "python", prompts[0], min(8, n_predict), spec_kw, ctx_kw)

    runs: list[Run] = []
    total = repeat * len(prompts) * len(sets) * len(engines)
    done = 0
    # repeats outermost, so drift in the machine's speed touches every configuration alike
    for rep in range(repeat):
        for ip, prompt in enumerate(prompts):
            for types in sets:
                for engine in engines:
                    res, st = run_once(models, types, engine, prompt, n_predict, spec_kw, ctx_kw)
                    runs.append(Run(_type_key(types), engine, ip, rep, list(res.tokens), st.n_gen_tokens,
                                    st.t_gen_s, st.t_decode_gen_s, st.n_steps, st.n_drafted, st.n_accepted))
                    done += 1
                    if progress is not None:
                        progress(f"[{done}/{total}] repeat {rep + 1} prompt {ip + 1} {_type_key(types):<14} "
                                 f"{engine:<6} {st.gen_tps:7.1f} tok/s  accepted {st.n_accepted}/{st.n_drafted}")

    for types in sets:
        key = _type_key(types)
        for engine in engines:
            mine = [r for r in runs if r.type == key and r.engine == engine]
            per_rep = []
            for rep in range(repeat):
                rr = [r for r in mine if r.repeat == rep]
                t = sum(r.t_gen_s for r in rr)
                per_rep.append(sum(r.n_gen_tokens for r in rr) / t if t > 0 else 0.0)
            n_steps = sum(r.n_steps for r in mine)
            outside = sum(max(0.0, r.t_gen_s - r.t_decode_gen_s) for r in mine)
            n_drafted = sum(r.n_drafted for r in mine) // repeat
            n_accepted = sum(r.n_accepted for r in mine) // repeat
            report.rows.append(Row(
                type=key, engine=engine,
                n_gen_tokens=sum(r.n_gen_tokens for r in mine) // repeat,
                n_drafted=n_drafted, n_accepted=n_accepted,
                acceptance=n_accepted / n_drafted if n_drafted else 0.0,
                gen_tps=statistics.median(per_rep), gen_tps_runs=per_rep,
                speedup=None, cpp_ratio=None,
                overhead_us_per_step=outside / n_steps * 1e6 if n_steps else 0.0,
                identical=None,
            ))

    # speed-ups, ratios to the C++ loop, token identity
    baseline = "loop" if "loop" in engines else ("cpp" if "cpp" in engines else None)
    for row in report.rows:
        plain = report.row("none", row.engine)
        if plain is not None and plain.gen_tps > 0:
            row.speedup = row.gen_tps / plain.gen_tps
        if baseline is None:
            continue
        other = "python" if row.engine == baseline else baseline
        base = report.row(row.type, baseline)
        if row.engine != "loop" and "loop" in engines and base is not None and base.gen_tps > 0:
            row.cpp_ratio = row.gen_tps / base.gen_tps
        if other in engines and other != row.engine:
            mine_toks = {(r.prompt, r.repeat): r.tokens for r in runs if r.type == row.type and r.engine == row.engine}
            theirs = {(r.prompt, r.repeat): r.tokens for r in runs if r.type == row.type and r.engine == other}
            row.identical = all(mine_toks[k] == theirs.get(k) for k in mine_toks)
    report.wall_s = time.perf_counter() - t_start
    return report


def _fmt(x: float | None, spec: str, none: str = "-") -> str:
    return none if x is None else format(x, spec)


def format_table(report: Report) -> str:
    """The report as a text table."""
    head = ("type", "engine", "accept", "drafted", "gen tok/s", "speed-up", "vs C++", "overhead", "same tokens")
    lines = [head, ("", "", "", "", "(median)", "vs plain", "loop", "µs/step", "as C++ loop")]
    for r in report.rows:
        spec = r.type != "none"
        lines.append((
            r.type, r.engine,
            f"{r.acceptance * 100:.1f}%" if spec else "-",
            f"{r.n_accepted}/{r.n_drafted}" if spec else "-",
            f"{r.gen_tps:.1f}",
            _fmt(r.speedup, ".2f") + ("x" if r.speedup is not None else ""),
            _fmt(r.cpp_ratio, ".3f"),
            f"{r.overhead_us_per_step:.0f}",
            {None: "-", True: "yes", False: "NO"}[r.identical],
        ))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
    out = []
    for k, line in enumerate(lines):
        cells = (str(c).ljust(w) if i < 2 else str(c).rjust(w)
                 for i, (c, w) in enumerate(zip(line, widths, strict=False)))
        out.append("  ".join(cells))
        if k == 1:
            out.append("  ".join("-" * w for w in widths))
    if any(r.type != "none" and r.engine != "python" for r in report.rows) and any(
            t in r.type for r in report.rows for t in ("draft-simple", "draft-eagle3", "draft-mtp")):
        out.append("overhead: wall time per target step outside the timed llama_decode/llama_encode calls; "
                   "a draft model's decoding runs\ninside C++ on the cpp and loop engines, so there it counts "
                   "as overhead (on python it does not).")
    return "\n".join(out)


def write_json(report: Report, path: str | Path) -> None:
    Path(path).write_text(json.dumps(report.as_dict(), indent=2) + "\n", encoding="utf-8")


def write_plot(report: Report, path: str | Path) -> None:
    """A PNG with two panels: acceptance per type, and speed-up over plain decoding per type and engine."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("--plot needs matplotlib: pip install matplotlib") from None

    types = [t for t in dict.fromkeys(r.type for r in report.rows) if t != "none"]
    engines = list(dict.fromkeys(r.engine for r in report.rows))
    fig, (ax_acc, ax_spd) = plt.subplots(1, 2, figsize=(11, 4.2))
    xs = list(range(len(types)))
    first = engines[0] if engines else "python"
    acc = [(report.row(t, first) or report.rows[0]).acceptance * 100 for t in types]
    ax_acc.bar(xs, acc, color="tab:blue")
    ax_acc.set_xticks(xs, types, rotation=20, ha="right")
    ax_acc.set_ylabel("draft tokens accepted (%)")
    ax_acc.set_ylim(0, 105)
    ax_acc.set_title("acceptance")
    width = 0.8 / max(1, len(engines))
    for k, eng in enumerate(engines):
        vals = [((report.row(t, eng) or report.rows[0]).speedup or 0.0) for t in types]
        ax_spd.bar([x + (k - (len(engines) - 1) / 2) * width for x in xs], vals, width, label=eng)
    ax_spd.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax_spd.set_xticks(xs, types, rotation=20, ha="right")
    ax_spd.set_ylabel("generation speed / plain decoding")
    ax_spd.set_title("speed-up over plain decoding")
    ax_spd.legend(title="engine", fontsize=8)
    fig.suptitle(f"{Path(report.model).name or 'model'}: {len(report.prompts)} prompts, "
                 f"n_predict {report.n_predict}, median of {report.repeat}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)
