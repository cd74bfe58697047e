"""The port equals upstream's speculative.cpp exactly where upstream is well defined.

The default reference carries the patches listed at the top of csrc/pyspec_ref_speculative.cpp
(pyspec_ref_patches()); the build also installs the reference without any patch,
pyspec/lib/nopatch/libpyspec_ref.so. A child process opens that one (PYSPEC_REF_LIB)
and runs every type with one ubatch per decode (n_ubatch = n_batch), where
upstream's EAGLE3 batch is read within its allocation, and must agree with the port
call by call, drafting and getting drafts accepted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from pyspec.ffi import ffi, lib_dir, ref

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys
from pyspec.common.params import CommonSpeculativeType as T
from pyspec.ffi import ffi, ref
from pyspec.parity.harness import ParityScenario, run_parity
from pyspec.testing import models as tm

print(json.dumps({"patches": ffi.string(ref.pyspec_ref_patches()).decode()}), flush=True)
cycle = list(tm.cyclic_successor()[1][0])
for t in [t for t in T if t not in (T.NONE, T.COUNT)]:
    target, draft = tm.tiny_model_paths([t])
    sc = ParityScenario(target=str(target), draft=str(draft) if draft else None, types=[t], n_seq=2,
                        prompts=[cycle * 3, "def fib(n): return fib(n-1) + fib(n-2)\n" * 2], n_predict=24,
                        n_max=4, n_ctx=192, n_batch=32, n_ubatch=32, n_threads=1,
                        ngram_size_n=2, ngram_size_m=6, ngram_mod_n_match=2, ngram_mod_n_min=1, ngram_mod_n_max=6)
    r = run_parity(sc)
    print(json.dumps({"type": t.name, "passed": r.passed, "verdict": r.verdict()}), flush=True)
"""


def test_the_default_reference_names_its_patches():
    # none at 0c1e57098 (csrc/pyspec_ref_speculative.cpp: eagle3-batch-rows is gone with llama_batch_init)
    assert ffi.string(ref.pyspec_ref_patches()).decode() == ""


def test_the_port_equals_the_unpatched_reference_with_one_ubatch_per_decode():
    nopatch = lib_dir() / "nopatch" / "libpyspec_ref.so"
    assert nopatch.is_file(), f"{nopatch} is missing: the build installs it (CMake target pyspec_ref_nopatch)"
    env = dict(os.environ, PYSPEC_REF_LIB=str(nopatch))
    p = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert lines[0] == {"patches": ""}  # the child really ran upstream's code
    results = lines[1:]
    assert [r["type"] for r in results] == ["DRAFT_SIMPLE", "DRAFT_EAGLE3", "DRAFT_MTP", "DRAFT_DFLASH",
                                            "DRAFT_DSPARK", "NGRAM_SIMPLE", "NGRAM_MAP_K", "NGRAM_MAP_K4V",
                                            "NGRAM_MOD", "NGRAM_CACHE"]
    failed = [r["verdict"] for r in results if not r["passed"]]
    assert not failed, "\n".join(failed)
