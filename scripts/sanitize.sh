#!/usr/bin/env bash
# Run the shim (libpyspec_ext), the reference (libpyspec_ref) and libllama under
# valgrind memcheck on a short driver: every speculative type on the tiny models,
# through the Python port and the C++ reference, plus the hostile calls that used to
# abort. Exits non-zero when memcheck reports an error (invalid access, use of
# uninitialised memory, a definite leak inside our or llama.cpp's libraries).
#
#   scripts/sanitize.sh                  # valgrind on the libraries in pyspec/lib
#   PYSPEC_LIB_DIR=build/asan/... scripts/sanitize.sh --asan   # an ASan build instead (see below)
#
# With --asan the driver runs without valgrind, with libasan preloaded; build the
# libraries with `cmake -S . -B build/asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo
# -DLLAMA_SANITIZE_ADDRESS=ON` first and point PYSPEC_LIB_DIR at them.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# the real interpreter, not a wrapper script (pyenv shims): valgrind must run the binary
PYTHON=$("$PYTHON" -c 'import sys; print(sys.executable)')
work=$(mktemp -d)
trap '[[ -n "${KEEP:-}" ]] || rm -rf "$work"' EXIT

# a private copy of the libraries: a rebuild of pyspec/lib while this runs would
# replace mapped files under the process (and crash it, which is not what we test)
src_lib=${PYSPEC_LIB_DIR:-pyspec/lib}
cp -a "$src_lib" "$work/lib"
export PYSPEC_LIB_DIR="$work/lib"

cat > "$work/driver.py" <<'PY'
import os
import sys
sys.path.insert(0, ".")
from pyspec import Batch, Context, Model, PyspecError
from pyspec.testing import models as tm
from pyspec.generation.driver import SpeculativeGenerator, greedy_sampling
from pyspec.common.params import CommonParamsSpeculative, CommonSpeculativeType as T

paths = tm.make_all()
tgt, dft, e3, mtp = (Model(paths[k]) for k in ("target", "draft", "eagle3", "mtp"))
prompt = "def fib(n): return fib(n-1) + fib(n-2)\n" * 2
kw = dict(n_ctx=256, n_batch=32, n_ubatch=16, n_threads=1, n_threads_batch=1)
runs = [(t, e) for t in (T.DRAFT_SIMPLE, T.DRAFT_EAGLE3, T.DRAFT_MTP, T.NGRAM_MOD, T.NGRAM_MAP_K) for e in ("python", "cpp")]
for t, engine in runs:
    p = CommonParamsSpeculative(types=[t]); p.draft.n_max = 3
    p.ngram_mod.n_match, p.ngram_mod.n_min = 2, 1
    if t == T.DRAFT_MTP:
        ctx = Context(mtp, **kw, n_rs_seq=3); ctxd = Context(mtp, **kw, ctx_type="mtp", ctx_other=ctx)
    elif t == T.DRAFT_EAGLE3:
        # known: the C++ reference's EAGLE3 (upstream speculative.cpp) allocates its decoder
        # batch with n_embd_dec floats per row, llama.cpp reads rows of n_embd_inp (3x):
        # memcheck reports "Invalid read of size 8 ... after a block alloc'd by llama_batch_init"
        # under common_speculative_impl_draft_eagle3::process (engine="cpp" only; the port
        # over-allocates its batch)
        ctx = Context(tgt, **kw); ctxd = Context(e3, **kw, ctx_other=ctx)
    else:
        ctx = Context(tgt, **kw); ctxd = Context(dft, **kw) if t == T.DRAFT_SIMPLE else None
    p.draft.ctx_dft = ctxd
    with SpeculativeGenerator(ctx, p, greedy_sampling(), engine=engine) as g:
        r = g.generate([prompt], 12)[0]
    print(t.name, engine, r.tokens[:6], flush=True)
    # close the target first: the draft context keeps it alive (EAGLE3 / MTP)
    ctx.close()
    if ctxd is not None:
        ctxd.close()

# hostile calls that reach C: each must raise, not touch freed or foreign memory
ctx = Context(tgt, **kw)
b = Batch(4); b.add(1, 0, 0, True); ctx.decode(b)
from pyspec import SamplerChain
import struct
def grammar_accept():  # the checked accept restores the grammar's stacks after a refused token
    with SamplerChain().add_grammar(tgt.vocab, "root ::= [ a]+") as ch:
        ch.accept(tgt.vocab.tokenize("a", add_special=False)[-1])
        ch.accept(tgt.vocab.tokenize("b", add_special=False)[-1])
def chain_outlives_close():  # the context keeps its backend chain alive (then raise to count it)
    c2 = Context(tgt, **kw); chain = SamplerChain().add_top_k(3).add_dist(1)
    c2.set_sampler(0, chain); chain.close(); c2.decode(b); c2.close()
    raise ValueError("chain kept alive")
for call in (lambda: ctx.get_embeddings_layer_inp(1, 1), lambda: ctx.get_logits(1000),
             lambda: ctx.encode(b), lambda: ctx.state_seq_set(0, b"garbage" * 9),
             lambda: ctx.state_seq_set(0, struct.pack("<IiII", 0xAF143CD8, 0, 1, 0xFFFFFFFF) + bytes(64)),
             lambda: Context(tgt, **kw, ctx_type="mtp", ctx_other=ctx), grammar_accept, chain_outlives_close,
             lambda: SamplerChain().add_grammar(tgt.vocab, "root ::= x{4,3}\nx ::= \"b\"")):
    try:
        call()
        raise SystemExit("hostile call did not raise")
    except (ValueError, IndexError, PyspecError) as e:
        print("refused:", type(e).__name__, flush=True)
ctx.close()
for m in (mtp, e3, dft, tgt):
    m.close()
print("driver done", flush=True)
PY

if [[ "${1:-}" == "--asan" ]]; then
    asan=$(gcc -print-file-name=libasan.so)
    LD_PRELOAD="$asan" ASAN_OPTIONS=detect_leaks=0 PYTHONMALLOC=malloc "$PYTHON" "$work/driver.py"
    echo "sanitize (asan): no errors"
    exit 0
fi

# CPython's own allocations (interned strings, module state) stay reachable or are
# "possibly" lost at exit; only definite leaks count, and none inside the interpreter.
# ggml's CPU kernels (flash attention, swiglu, rms_norm, sigmoid) compute on padding
# and masked KV cells that were never written, and then discard those lanes: memcheck
# reports each as a use of uninitialised values. Those two kinds are suppressed inside
# libggml-cpu only; invalid reads/writes and leaks stay reported everywhere.
cat > "$work/python.supp" <<'SUPP'
{
   cpython-definite-leaks-at-exit
   Memcheck:Leak
   match-leak-kinds: definite
   ...
   obj:*/libpython3*
}
{
   cpython-definite-leaks-at-exit-static
   Memcheck:Leak
   match-leak-kinds: definite
   ...
   fun:_Py*
}
{
   cpython-internal-uninit-cond
   Memcheck:Cond
   fun:*Py*
}
{
   cpython-internal-uninit-value8
   Memcheck:Value8
   fun:*Py*
}
{
   cpython-small-int-cond
   Memcheck:Cond
   fun:maybe_small_long
}
{
   cpython-small-int-value8
   Memcheck:Value8
   fun:*small_*
}
{
   glibc-dlopen-rpath-strncmp-overread
   Memcheck:Addr8
   fun:strncmp
   fun:is_dst
}
{
   ggml-cpu-kernels-uninit-cond
   Memcheck:Cond
   ...
   obj:*/libggml-cpu.so*
}
{
   ggml-cpu-kernels-uninit-value8
   Memcheck:Value8
   ...
   obj:*/libggml-cpu.so*
}
{
   cffi-dlopen-leaks
   Memcheck:Leak
   match-leak-kinds: definite
   ...
   fun:_dl_open
}
SUPP

# PYTHONMALLOC=malloc: every Python allocation goes through malloc, which memcheck
# tracks exactly (pymalloc's arenas make false positives)
rc=0
PYTHONMALLOC=malloc valgrind --tool=memcheck --error-exitcode=1 --leak-check=full \
    --show-leak-kinds=definite --errors-for-leak-kinds=definite \
    --suppressions="$work/python.supp" --num-callers=40 ${VALGRIND_OPTS:-} --log-file="$work/valgrind.log" \
    "$PYTHON" "$work/driver.py" || rc=$?
grep -E "ERROR SUMMARY|definitely lost" "$work/valgrind.log"
# each remaining error once: its kind and first three frames
awk '/Invalid|uninitialised|Conditional jump/ {k=$0; getline a; getline b; getline c; print k " |" a " |" b " |" c}' \
    "$work/valgrind.log" | sed -E 's/==[0-9]+==//g; s/0x[0-9A-F]+: //g; s/ +/ /g' | sort | uniq -c | sort -rn | head -20
[[ $rc -eq 0 ]] && echo "sanitize (valgrind memcheck): no errors"
exit $rc
