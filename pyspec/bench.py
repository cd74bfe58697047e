"""Benchmark: plain decoding, each speculative type, and the C++ reference loop on the same models.

Every run gets fresh contexts and greedy sampling. Three engines run each type:

- ``python``: the generation driver over the Python port;
- ``cpp``: the same driver over the C++ reference implementation;
- ``loop``: the whole loop in C++ (:func:`pyspec.cpp_loop.cpp_generate`), the baseline.

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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from pyspec.driver import SpeculativeGenerator, greedy_sampling
from pyspec.models import ModelSet, open_pair, spec_params
from pyspec.params import CommonSpeculativeType as T
from pyspec.speculative import common_speculative_type_to_str

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
    if text.lstrip().startswith("["):
        prompts = json.loads(text)
        if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
            raise ValueError(f"{path}: a JSON prompt file must hold a list of strings")
    else:
        prompts, cur = [], []
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
    from pyspec.log import set_common_log_verbosity

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
) -> tuple[list[int], dict[str, Any]]:
    """One greedy generation on fresh contexts; returns the tokens and the statistics."""
    spec = spec_params(types, **spec_kw)
    with open_pair(models, spec, **ctx_kw) as pair:
        if engine == "loop":
            from pyspec.cpp_loop import cpp_generate

            (toks,), st = cpp_generate(pair.ctx_tgt, [prompt], n_predict, spec, greedy_sampling())
            return toks, st
        with SpeculativeGenerator(pair.ctx_tgt, spec, greedy_sampling(), n_seq=1, engine=engine) as gen:
            (res,) = gen.generate([prompt], n_predict)
            st = gen.stats
            return res.tokens, {
                "n_gen_tokens": st.n_gen_tokens,
                "t_gen_s": st.t_gen_s,
                "t_decode_gen_s": st.t_decode_gen_s,
                "n_steps": st.n_steps,
                "n_drafted": st.n_drafted,
                "n_accepted": st.n_accepted,
            }


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
                    toks, st = run_once(models, types, engine, prompt, n_predict, spec_kw, ctx_kw)
                    runs.append(Run(_type_key(types), engine, ip, rep, list(toks), int(st["n_gen_tokens"]),
                                    float(st["t_gen_s"]), float(st["t_decode_gen_s"]), int(st["n_steps"]),
                                    int(st["n_drafted"]), int(st["n_accepted"])))
                    done += 1
                    if progress is not None:
                        tps = st["n_gen_tokens"] / st["t_gen_s"] if st["t_gen_s"] > 0 else 0.0
                        progress(f"[{done}/{total}] repeat {rep + 1} prompt {ip + 1} {_type_key(types):<14} "
                                 f"{engine:<6} {tps:7.1f} tok/s  accepted {st['n_accepted']}/{st['n_drafted']}")

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
            mine = {(r.prompt, r.repeat): r.tokens for r in runs if r.type == row.type and r.engine == row.engine}
            theirs = {(r.prompt, r.repeat): r.tokens for r in runs if r.type == row.type and r.engine == other}
            row.identical = all(mine[k] == theirs.get(k) for k in mine)
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
        cells = (str(c).ljust(w) if i < 2 else str(c).rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
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


# --------------------------------------------------------------------------- the demo

DEMO_PROMPT = BUILTIN_PROMPTS[0]


def demo(
    *,
    model: str | Path | None = None,
    n_predict: int | None = None,
    n_threads: int | None = 1,
    out: Callable[[str], Any] = print,
    verbose: bool = False,
) -> int:
    """Continue a code prompt with plain decoding, an n-gram type and draft-simple; print the text and the speed-ups.

    Everything is measured in this run, on the same model, with greedy
    sampling (so the three texts are the same, and printed once).
    """
    from pyspec.models import load_models

    n_predict = n_predict or 160
    configs = [
        ("plain decoding", [T.NONE], {}),
        ("ngram-cache", [T.NGRAM_CACHE], {}),
        ("draft-simple (draft = target)", [T.DRAFT_SIMPLE], {"n_max": 4}),
    ]
    with common_log(verbose), load_models([T.DRAFT_SIMPLE], model=model) as models:
        out(f"model: {models.target.desc} ({models.target.path.name})")
        out(f"prompt ({len(DEMO_PROMPT.splitlines())} lines of Python), {n_predict} tokens, greedy\n")
        ctx_kw = {"n_ctx": 1024, "n_threads": n_threads}
        run_once(models, [T.NONE], "python", DEMO_PROMPT, 8, {}, ctx_kw)  # warm-up
        rows = []
        text = ""
        for label, types, kw in configs:
            spec = spec_params(types, **kw)
            with open_pair(models, spec, **ctx_kw) as pair, \
                    SpeculativeGenerator(pair.ctx_tgt, spec, greedy_sampling(), n_seq=1) as gen:
                (res,) = gen.generate([DEMO_PROMPT], n_predict)
                st = gen.stats
            if not text:
                text = res.text
                out(DEMO_PROMPT + text)
                out("-" * 60)
            same = "same text" if res.text == text else "TEXT DIFFERS"
            rows.append((label, st.gen_tps, st, same))
    plain = rows[0][1]
    out(f"{'':<31} {'gen tok/s':>9} {'accepted':>12} {'speed-up':>8}")
    for label, tps, st, same in rows:
        acc = f"{st.n_accepted}/{st.n_drafted} {st.acceptance * 100:3.0f}%" if st.n_drafted else "-"
        out(f"{label:<31} {tps:9.1f} {acc:>12} {tps / plain if plain else 0:7.2f}x  {same}")
    out("\nngram-cache drafts from n-grams of the text so far: drafts cost next to nothing, so the speed-up")
    out("is what verifying several tokens in one batch saves; on a CPU the cost of a batch grows with its")
    out("size (Gemma 3 computes 262k-entry logits for every token), so the gain is modest here.")
    out("draft-simple here drafts with the target model itself: greedy drafts are what the target would")
    out("pick (acceptance near 100%), but each draft token costs a full forward pass, so it shows the")
    out("mechanism and its overhead, not a speed-up; a real setup pairs a much smaller draft model.")
    return 0
