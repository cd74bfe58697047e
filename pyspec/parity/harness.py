"""The parity harness: one scenario through the C++ reference and the Python port, compared call by call.

Each side gets its own, identically made set of models and contexts and its own
SpeculativeGenerator (``engine="cpp"`` and ``engine="python"``). The generation
loop reports every call into the implementation (``process``, ``begin``,
``draft``, ``accept``) through ``on_event`` with the drafts, each
implementation's counters, the target and draft contexts' per-sequence
(pos_min, pos_max) and the tokens generated so far. Both loops are
deterministic, so their traces must be equal event for event: the C++ side runs
first and records its trace, then the Python side runs and is stopped at the
first event that differs.

    sc = ParityScenario(target=path, types=["ngram-simple"], prompts=["...", "..."], n_seq=2)
    report = run_parity(sc)  # report.ok, report.divergence (event, field, python, cpp)
    assert_parity(sc)        # the same, raising ParityError at the first divergence

A scenario that drafts nothing, or whose drafts are never accepted, compares
nothing speculative: ``assert_parity`` also fails unless every implementation
on each side drafted and had drafts accepted (``report.idle_impls()``), except
in a scenario made not to draft (``expect_drafts=False``, named so).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pyspec.common.params import CommonParamsSampling, CommonParamsSpeculative
from pyspec.common.params import CommonSpeculativeType as T
from pyspec.common.speculative import common_speculative_type_to_str
from pyspec.core.context import Context
from pyspec.core.model import Model
from pyspec.errors import ParityError
from pyspec.generation.contexts import ContextSet, ModelSet, draft_kind, open_contexts, parse_types
from pyspec.generation.driver import SpeculativeGenerator, greedy_sampling

__all__ = ["Divergence", "ParityReport", "ParityScenario", "assert_parity", "build_contexts",
           "continued_prompt", "run_parity"]

Prompt = str | Sequence[int]


@dataclass
class ParityScenario:
    """One scenario: models, contexts, speculative and sampling parameters, prompts.

    ``types`` go to CommonParamsSpeculative.types together (one dispatcher). The
    prompts are generated ``n_seq`` at a time with one generator per side, so
    later groups also test the state the implementations keep between requests.
    The draft context follows the types (pyspec.generation.contexts): draft-simple
    loads ``draft`` as a separate model (the target itself when ``draft`` is
    None), draft-eagle3 loads ``draft`` as an EAGLE3 head reading the target
    context (ctx_other), draft-mtp opens an MTP context on the target model,
    draft-dflash / draft-dspark load ``draft`` as a DFlash drafter.
    ``n_ctx`` is per sequence.
    """

    target: str
    types: Sequence[T | int | str] = (T.NONE,)
    prompts: Sequence[Prompt] = ("Hello",)
    draft: str | None = None
    n_seq: int = 1
    n_predict: int = 32
    n_ctx: int = 256
    n_batch: int = 32
    n_ubatch: int = 16
    # the draft context's n_ubatch; None: n_ubatch, except for EAGLE3 (see _eagle3_dft_params)
    n_ubatch_dft: int | None = None
    n_threads: int | None = None
    # CommonParamsSpeculative knobs (draft-*, the three n-gram maps alike, ngram-mod, ngram-cache)
    n_max: int = 3
    n_min: int = 0
    p_min: float = 0.0
    ngram_size_n: int = 3
    ngram_size_m: int = 8
    ngram_min_hits: int = 1
    ngram_mod_n_match: int = 4
    ngram_mod_n_min: int = 1
    ngram_mod_n_max: int = 8
    lookup_cache_static: str = ""
    lookup_cache_dynamic: str = ""
    # MTP only: n_rs_seq 0 on the target, so rollbacks go through checkpoints
    mtp_checkpoint: bool = False
    sampling: CommonParamsSampling = field(default_factory=greedy_sampling)
    name: str = ""
    # the scenario is made to draft and get drafts accepted (assert_parity checks it per implementation)
    expect_drafts: bool = True

    def spec_types(self) -> list[T]:
        return parse_types(list(self.types))

    def resolved_draft_kind(self) -> str:
        kind = draft_kind(self.spec_types())
        if kind == "eagle3" and not self.draft:
            raise ValueError("draft-eagle3 needs the EAGLE3 model path in 'draft'")
        if kind == "dflash" and not self.draft:
            raise ValueError("draft-dflash / draft-dspark need the DFlash model path in 'draft'")
        return kind

    def spec_params(self) -> CommonParamsSpeculative:
        """The speculative parameters of the scenario (the draft context is set when contexts are opened)."""
        sp = CommonParamsSpeculative(types=self.spec_types())
        sp.draft.n_max, sp.draft.n_min, sp.draft.p_min = self.n_max, self.n_min, self.p_min
        for m in (sp.ngram_simple, sp.ngram_map_k, sp.ngram_map_k4v):
            m.size_n, m.size_m, m.min_hits = self.ngram_size_n, self.ngram_size_m, self.ngram_min_hits
        sp.ngram_mod.n_match, sp.ngram_mod.n_min, sp.ngram_mod.n_max = (
            self.ngram_mod_n_match, self.ngram_mod_n_min, self.ngram_mod_n_max)
        sp.ngram_cache.lookup_cache_static = self.lookup_cache_static
        sp.ngram_cache.lookup_cache_dynamic = self.lookup_cache_dynamic
        return sp

    def label(self) -> str:
        if self.name:
            return self.name
        s = self.sampling
        smp = "greedy" if s.samplers == greedy_sampling().samplers and s.top_k == 1 else f"temp={s.temp},seed={s.seed}"
        types = "+".join(common_speculative_type_to_str(t) for t in self.spec_types())
        return (f"{types} n_seq={self.n_seq} n_max={self.n_max} n_min={self.n_min} p_min={self.p_min} "
                f"{smp} prompts={len(self.prompts)} n_predict={self.n_predict}")


def build_contexts(sc: ParityScenario) -> ContextSet:
    """A fresh set of models and contexts for the scenario; every call makes an identical one."""
    kind = sc.resolved_draft_kind()
    target = Model(sc.target)
    models = ModelSet(target, owned=[target])
    try:
        if kind in ("draft", "eagle3", "dflash") and sc.draft is not None and sc.draft != sc.target:
            models.draft = Model(sc.draft)  # else draft = target: the same model, a second context
            models.owned.append(models.draft)
        return open_contexts(models, sc.spec_params(), n_ctx=sc.n_ctx, n_batch=sc.n_batch, n_ubatch=sc.n_ubatch,
                             n_ubatch_dft=sc.n_ubatch_dft, n_seq=sc.n_seq, n_threads=sc.n_threads,
                             mtp_checkpoint=sc.mtp_checkpoint, owned=models.owned)
    except BaseException:
        models.close()
        raise


@dataclass
class Divergence:
    """The first event where the two sides differ."""

    index: int  # event number in the trace
    step: int  # target decodes so far (prefill chunks included)
    event: str
    field: str
    python: Any
    cpp: Any

    def __str__(self) -> str:
        return (f"event #{self.index} ({self.event}, after {self.step} target decodes), {self.field}: "
                f"python={self.python!r} cpp={self.cpp!r}")


@dataclass
class ParityReport:
    """The outcome of one scenario."""

    scenario: str
    ok: bool
    n_events: int  # events compared
    divergence: Divergence | None = None
    errors: dict[str, str] = field(default_factory=dict)  # side -> exception, when a side raised
    tokens: list[list[int]] = field(default_factory=list)  # the C++ side's generated tokens, per prompt
    n_drafted: int = 0
    n_accepted: int = 0
    # side ("cpp", "python") -> each implementation's final counters (ImplStats.counters())
    impls: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    expect_drafts: bool = True

    def idle_impls(self) -> list[str]:
        """``side:implementation`` for each implementation that drafted nothing or had no draft accepted."""
        out = []
        for side in ("cpp", "python"):
            if side not in self.impls:
                out.append(f"{side}:<did not finish>")
            for c in self.impls.get(side, []):
                if c["n_gen_drafts"] == 0 or c["n_acc_tokens"] == 0:
                    out.append(f"{side}:{c['name']} (drafts {c['n_gen_drafts']}, accepted tokens {c['n_acc_tokens']})")
        return out

    @property
    def passed(self) -> bool:
        """The sides agree, and (unless the scenario is made not to draft) every implementation speculated."""
        return self.ok and (not self.expect_drafts or not self.idle_impls())

    def verdict(self) -> str:
        if self.ok:
            per_impl = ", ".join(f"{c['name']} {c['n_acc_tokens']}/{c['n_gen_tokens']}"
                                 for c in self.impls.get("cpp", []))
            head = "OK   " if self.passed else "IDLE "
            text = (f"{head} {self.scenario}: {self.n_events} events, {sum(map(len, self.tokens))} tokens, "
                    f"drafted {self.n_drafted}, accepted {self.n_accepted}" + (f" ({per_impl})" if per_impl else ""))
            if not self.passed:
                text += "; compares nothing speculative: " + "; ".join(self.idle_impls())
            return text
        why = str(self.divergence) if self.divergence else "; ".join(f"{k}: {v}" for k, v in self.errors.items())
        return f"DIVERGE {self.scenario}: {why}"


class _Stop(Exception):
    """Stops the Python side's loop at the first divergence."""


def _first_diff(py: Any, cpp: Any, path: str) -> tuple[str, Any, Any] | None:
    """The first (path, python, cpp) where two event payloads differ; lists of scalars compare whole."""
    if isinstance(py, dict) and isinstance(cpp, dict):
        for k in sorted(set(py) | set(cpp), key=str):
            sub = f"{path}[{k}]" if isinstance(k, int) else (f"{path}.{k}" if path else str(k))
            if k not in py or k not in cpp:
                return sub, py.get(k, "<missing>"), cpp.get(k, "<missing>")
            d = _first_diff(py[k], cpp[k], sub)
            if d:
                return d
        return None
    if isinstance(py, list) and isinstance(cpp, list) and py and isinstance(py[0], dict):
        if len(py) != len(cpp):
            return f"{path} (length)", len(py), len(cpp)
        for i, (a, b) in enumerate(zip(py, cpp, strict=False)):
            d = _first_diff(a, b, f"{path}[{i}]")
            if d:
                return d
        return None
    return None if py == cpp else (path, py, cpp)


@dataclass
class _SideResult:
    tokens: list[list[int]] = field(default_factory=list)  # per prompt
    n_drafted: int = 0
    n_accepted: int = 0
    impls: list[dict[str, Any]] = field(default_factory=list)  # final counters per implementation


def _run_side(sc: ParityScenario, engine: str, on_event: Any) -> _SideResult:
    """Run the scenario on one side."""
    out = _SideResult()
    with build_contexts(sc) as cs:
        # llama.cpp's fixed draft lengths: the cost-aware choice depends on timings, which differ between runs
        with SpeculativeGenerator(cs.ctx_tgt, cs.spec, sc.sampling, n_seq=sc.n_seq, engine=engine,
                                  on_event=on_event, adaptive_draft=False) as gen:
            for i in range(0, len(sc.prompts), sc.n_seq):
                for r in gen.generate(list(sc.prompts[i : i + sc.n_seq]), sc.n_predict):
                    out.tokens.append(r.tokens)
                out.n_drafted += gen.stats.n_drafted
                out.n_accepted += gen.stats.n_accepted
            out.impls = [i.counters() for i in gen.engine.backend.impl_stats()]
    return out


def run_parity(sc: ParityScenario) -> ParityReport:
    """Run the scenario through the C++ reference, then the Python port, comparing after every call."""
    label = sc.label()
    trace: list[tuple[str, dict]] = []
    errors: dict[str, str] = {}
    impls: dict[str, list[dict[str, Any]]] = {}
    try:
        cpp = _run_side(sc, "cpp", lambda name, data: trace.append((name, data)))
        impls["cpp"] = cpp.impls
    except Exception as e:  # the reference failed: still see whether the port fails the same way
        errors["cpp"] = f"{type(e).__name__}: {e}"
        cpp = _SideResult()
    tokens = cpp.tokens

    n = 0
    steps = 0
    found: list[Divergence] = []

    def compare(name: str, data: dict) -> None:
        nonlocal n, steps
        if n >= len(trace):
            found.append(Divergence(n, steps, name, "event", name, "<end of trace>"))
            raise _Stop
        cpp_name, cpp_data = trace[n]
        d = ("event", name, cpp_name) if name != cpp_name else _first_diff(data, cpp_data, "")
        if d is not None:
            found.append(Divergence(n, steps, cpp_name, *d))
            raise _Stop
        steps += name == "process"
        n += 1

    try:
        py = _run_side(sc, "python", compare)
        py_tokens: list[list[int]] | None = py.tokens
        impls["python"] = py.impls
    except _Stop:
        py_tokens = None
    except Exception as e:
        errors["python"] = f"{type(e).__name__}: {e}"
        py_tokens = None
    if not found and not errors:
        if n < len(trace):
            found.append(Divergence(n, steps, trace[n][0], "event", "<end of trace>", trace[n][0]))
        elif py_tokens != tokens:
            found.append(Divergence(n, steps, "result", "tokens", py_tokens, tokens))
    div = found[0] if found else None
    if div is None and set(errors) == {"cpp", "python"} and errors["cpp"] != errors["python"]:
        div = Divergence(n, steps, "error", "exception", errors["python"], errors["cpp"])
    return ParityReport(label, ok=div is None and not errors, n_events=n, divergence=div, errors=errors,
                        tokens=tokens, n_drafted=cpp.n_drafted, n_accepted=cpp.n_accepted, impls=impls,
                        expect_drafts=sc.expect_drafts)


def assert_parity(sc: ParityScenario) -> ParityReport:
    """run_parity, raising ParityError unless both sides agree on every event and (for a scenario
    made to draft) every implementation on each side drafted and had drafts accepted."""
    report = run_parity(sc)
    if not report.passed:
        raise ParityError(report)
    return report


@functools.lru_cache(maxsize=32)
def continued_prompt(target: str, text: str, n: int = 24) -> tuple[int, ...]:
    """The tokens of ``text`` followed by the target's own greedy continuation (n tokens).

    Generating after such a prompt carries on where the prompt left off, so the
    n-gram statistics of the prompt (ngram-cache's context cache) already hold
    what comes next, on a target whose output repeats itself.
    """
    with Model(target) as m, Context(m, n_ctx=512, n_batch=128, n_ubatch=128, n_threads=1, n_threads_batch=1) as ctx:
        with SpeculativeGenerator(ctx, None, greedy_sampling(), n_seq=1) as gen:
            (r,) = gen.generate([text], n)
        return tuple(m.vocab.tokenize(text, add_special=True) + r.tokens)
