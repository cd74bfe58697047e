"""Fuzz targets over the public API and over bytes, for scripts/fuzz.py and tests/test_fuzz.py.

Each target takes one input (bytes) and returns normally when pyspec handled it: it may
refuse the input with a *clean* exception (one that names what was wrong: PyspecError,
ValueError, TypeError, IndexError, OSError for files), and every other outcome is a
finding: a signal or a hang (seen by the runner, which runs targets in a worker process),
an exception of another kind (:class:`Finding` is raised with it), or two engines that
disagree about the same input.

Targets:
  grammar   GBNF text into SamplerChain.add_grammar, then accepts, applies and a sample
  state     sequence-state blobs into Context.state_seq_set (KV and hybrid contexts)
  ngram     lookup-cache files: the port's loader, the shared check and the C++ loader agree
  gguf      model files whose header and metadata are mutated, then a context and a decode
  gguf_doors  every tiny model, the LoRA, a control vector and a split set, mutated in their
            structure (types, element types, empty / repeated keys, counts, tensor shapes),
            through every door (Model, split lists, LoraAdapter, load_control_vector, quantize)
  api       call sequences over contexts, batches, memory, outputs, samplers, the port and
            the reference, decoded from the input bytes
  params    speculative and sampling parameters through both engines: same tokens, or the
            same exception and message
  cli       command lines for ``python -m pyspec`` (a subprocess each: exit 0, 1 or 2, no traceback)
  server    request bodies for every endpoint of ``pyspec serve`` that takes one (pyspec.testing.fuzz_server):
            never a 5xx
"""

from __future__ import annotations

import os
import random
import struct
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from pyspec.common.params import LLAMA_DEFAULT_SEED
from pyspec.errors import FuzzFinding as Finding

__all__ = ["CLEAN", "DOORS", "TARGETS", "GgufFile", "Input", "door_sets", "mutate", "mutate_gguf", "open_door",
           "open_door_unguarded", "run_door", "seeds", "setup"]


def _clean_types() -> tuple[type[BaseException], ...]:
    from pyspec.errors import PyspecError

    return (PyspecError, ValueError, TypeError, IndexError, OSError)


CLEAN: tuple[type[BaseException], ...] = ()
S: dict[str, Any] = {}
TMP = Path(tempfile.mkdtemp(prefix="pyspec-fuzz-"))
INTERESTING = [0, 1, 2, 3, 7, 8, 15, 16, 31, 32, 33, 63, 64, 255, 256, 257, 1023, 4096, 32000, 65535, 65536,
               2**31 - 1, 2**31, 2**32 - 1, 2**32, -1, -2, -(2**31), 10**9]


class Input:
    """Reads ints, choices and bytes from a fuzz input, returning defaults once it runs out."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def byte(self) -> int:
        if self.pos >= len(self.data):
            return 0
        b = self.data[self.pos]
        self.pos += 1
        return b

    def num(self, lo: int, hi: int) -> int:
        span = hi - lo + 1
        v = 0
        for _ in range((span.bit_length() + 7) // 8):
            v = (v << 8) | self.byte()
        return lo + v % span

    def choice(self, items: list[Any]) -> Any:
        return items[self.num(0, len(items) - 1)]

    def wild(self, lo: int, hi: int) -> int:
        """Mostly in lo..hi, sometimes an interesting value anywhere."""
        return self.choice(INTERESTING) if self.byte() < 40 else self.num(lo, hi)

    def bytes(self, n: int) -> bytes:
        out = self.data[self.pos : self.pos + n]
        self.pos += len(out)
        return out

    def left(self) -> bool:
        return self.pos < len(self.data)


# --- set-up -------------------------------------------------------------------------


def setup(targets: list[str] | None = None) -> None:
    """Load the tiny models once per worker process."""
    global CLEAN
    from pyspec import Batch, Context, Model
    from pyspec.testing import models as tm

    CLEAN = _clean_types()
    S["target"] = Model(tm.make_target())
    S["vocab"] = S["target"].vocab
    kw = dict(n_ctx=256, n_batch=32, n_ubatch=32, n_seq_max=2, n_threads=1, n_threads_batch=1)
    S["kw"] = kw
    S["ctx"] = Context(S["target"], **kw)
    b = Batch(8)
    b.add_sequence(list(range(20, 28)), 0, 0)
    S["ctx"].decode(b)
    if targets is None or {"state", "api", "params"} & set(targets):
        S["mtp"] = Model(tm.make_mtp())
        S["ctx_mtp"] = Context(S["mtp"], **kw)
        S["ctx_mtp"].decode(b)
        S["draft"] = Model(tm.make_draft())
    for name in ("ctx", "ctx_mtp"):
        if name in S:
            S["whole_" + name] = S[name].state_get()  # restored after each whole-state input
    S["gguf"] = Path(tm.make_target()).read_bytes()


def _clean(e: BaseException) -> bool:
    return isinstance(e, CLEAN)


def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run one API call: a clean exception is an answer, anything else a Finding."""
    try:
        return fn(*args, **kwargs)
    except Finding:
        raise
    except BaseException as e:
        if _clean(e):
            return e
        raise Finding(f"{getattr(fn, '__qualname__', fn)}: {type(e).__name__}: {e}") from e


# --- byte targets ---------------------------------------------------------------------


def target_grammar(data: bytes) -> None:
    from pyspec import SamplerChain

    inp = Input(data)
    n_text = inp.num(0, 255) * 16
    text = inp.bytes(n_text).decode("utf-8", "replace")
    chain = _call(lambda: SamplerChain().add_grammar(S["vocab"], text))
    if isinstance(chain, BaseException):
        return
    try:
        _call(chain.add_greedy)
        n_vocab = S["vocab"].n_tokens
        for _ in range(inp.num(0, 8)):
            op = inp.num(0, 2)
            if op == 0:
                _call(chain.accept, inp.wild(0, n_vocab + 2))
            elif op == 1:
                _call(chain.apply, np.frombuffer(inp.bytes(64).ljust(64, b"\0"), np.float32))
            else:
                _call(chain.sample, S["ctx"], -1)
    finally:
        chain.close()


def target_state(data: bytes) -> None:
    """A state handed to a context: a sequence blob, a whole-context blob, or either as a file."""
    from pyspec import Batch

    inp = Input(data)
    head = inp.byte()
    which = "ctx_mtp" if (head & 1 and "ctx_mtp" in S) else "ctx"
    mode = (head >> 1) & 3  # 0: state_seq_set, 1: state_set, 2: state_seq_load_file, 3: state_load_file
    ctx = S[which]
    flags = inp.byte() & 3
    blob = data[inp.pos :]
    if mode == 0:
        _call(ctx.state_seq_set, 1, blob, flags)
    elif mode == 1:
        _call(ctx.state_set, blob)
    else:
        path = TMP / "state.bin"
        path.write_bytes(blob)
        if mode == 2:
            _call(ctx.state_seq_load_file, path, 1)
        else:
            _call(ctx.state_load_file, path)
    # the context must still work: a token decodes after what sequence 1 holds, and the
    # sequences can be cleared and the saved state restored
    top = ctx.memory.seq_pos_max(1)
    if top + 1 < ctx.n_ctx_seq:
        b = Batch(1)
        b.add(5, top + 1, 1, True)
        _call(ctx.decode, b)
    ctx.memory.seq_rm(1, -1, -1)
    if mode in (1, 3):
        ctx.state_set(S["whole_" + which])


def target_ngram(data: bytes) -> None:
    from pyspec.common.checks import check_ngram_cache_file
    from pyspec.common.ngram_cache import common_ngram_cache_load

    path = TMP / "fuzz.cache"
    path.write_bytes(data)
    try:
        common_ngram_cache_load(str(path))
        port_ok = True
    except ValueError:
        port_ok = False
    check = _call(check_ngram_cache_file, str(path), "static")
    if port_ok != (check is None):
        raise Finding(f"the port's loader {'accepts' if port_ok else 'refuses'} a file the shared check "
                      f"{'refuses' if port_ok else 'accepts'}")
    from pyspec.common.params import CommonParamsSpeculative
    from pyspec.common.params import CommonSpeculativeType as T
    from pyspec.reference.speculative import RefSpeculative

    p = CommonParamsSpeculative(types=[T.NGRAM_CACHE])
    p.ngram_cache.lookup_cache_static = str(path)
    r = _call(RefSpeculative, p, 1)
    if isinstance(r, BaseException) == port_ok:
        raise Finding(f"the C++ reference {'refuses' if port_ok else 'accepts'} a cache file the port "
                      f"{'accepts' if port_ok else 'refuses'}: {r}")
    if not isinstance(r, BaseException):
        r.close()


def target_gguf(data: bytes) -> None:
    from pyspec import Batch, Context, Model

    base = S["gguf"]
    path = TMP / "fuzz.gguf"
    path.write_bytes(data + base[len(data) :])
    m = _call(Model, path)
    if isinstance(m, BaseException):
        return
    try:
        c = _call(Context, m, **S["kw"])
        if isinstance(c, BaseException):
            return
        b = Batch(2)
        b.add_sequence([1, 2], 0, 0)
        _call(c.decode, b)
        _call(c.get_logits_ith, -1)
        c.close()
    finally:
        m.close()


# --- structured GGUF mutations: every door -------------------------------------------------

# GGUF value types (gguf.h) and the byte size of the scalar ones
_GT_ARRAY, _GT_STRING = 9, 8
_GT_SIZE = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


class GgufFile:
    """A GGUF file as lists of metadata and tensor infos, with its tensor data kept as bytes.

    ``kvs``: [key, type, element type (-1 for a scalar), count, payload] where payload is
    the value's encoding after its type / element type / count fields; ``tensors``:
    [name, dims, ggml type, offset]. :meth:`encode` writes the header back and pads to the
    alignment, so a mutation of the header keeps the data where the offsets point.
    """

    def copy(self) -> GgufFile:
        """A copy to mutate (the payloads and the data are shared: bytes do not change)."""
        g = object.__new__(GgufFile)
        g.version, g.data, g.n_kv_delta, g.n_tensors_delta = self.version, self.data, 0, 0
        g.kvs = [list(kv) for kv in self.kvs]
        g.tensors = [[n, list(d), t, o] for n, d, t, o in self.tensors]
        return g

    def __init__(self, data: bytes) -> None:
        self.version, n_tensors, n_kv = struct.unpack_from("<IQQ", data, 4)
        off = 24

        def string() -> bytes:
            nonlocal off
            (n,) = struct.unpack_from("<Q", data, off)
            off += 8 + n
            return data[off - n : off]

        self.kvs: list[list[Any]] = []
        for _ in range(n_kv):
            key = string()
            (t,) = struct.unpack_from("<I", data, off)
            off += 4
            start = off
            if t == _GT_ARRAY:
                elem, n = struct.unpack_from("<IQ", data, off)
                off += 12
                start = off
                if elem == _GT_STRING:
                    for _ in range(n):
                        string()
                else:
                    off += n * _GT_SIZE[elem]
                self.kvs.append([key, t, elem, n, data[start:off]])
            elif t == _GT_STRING:
                string()
                self.kvs.append([key, t, -1, 1, data[start:off]])
            else:
                off += _GT_SIZE[t]
                self.kvs.append([key, t, -1, 1, data[start:off]])
        self.tensors: list[list[Any]] = []
        for _ in range(n_tensors):
            name = string()
            (nd,) = struct.unpack_from("<I", data, off)
            dims = list(struct.unpack_from(f"<{nd}Q", data, off + 4))
            off += 4 + 8 * nd
            ttype, toff = struct.unpack_from("<IQ", data, off)
            off += 12
            self.tensors.append([name, dims, ttype, toff])
        align = self.alignment()
        self.data = data[(off + align - 1) // align * align :]
        self.n_kv_delta = self.n_tensors_delta = 0  # header counts that lie

    def alignment(self) -> int:
        for key, t, _, _, payload in self.kvs:
            if key == b"general.alignment" and t == 4 and len(payload) == 4:  # a mutation may leave another size
                (a,) = struct.unpack("<I", payload)
                if a and a & (a - 1) == 0:
                    return int(a)
        return 32

    def value(self, key: bytes) -> Any:
        for k, t, _, _, payload in self.kvs:
            if k == key and t == _GT_STRING:
                return payload[8:].decode("utf-8", "replace")
        return None

    def encode(self) -> bytes:
        out = bytearray(b"GGUF")
        out += struct.pack("<IQQ", self.version, (len(self.tensors) + self.n_tensors_delta) % 2**64,
                           (len(self.kvs) + self.n_kv_delta) % 2**64)
        for key, t, elem, n, payload in self.kvs:
            out += struct.pack("<Q", len(key)) + key + struct.pack("<I", t)
            if t == _GT_ARRAY:
                out += struct.pack("<IQ", elem & 0xFFFFFFFF, n % 2**64)
            out += payload
        for name, dims, ttype, toff in self.tensors:
            out += struct.pack("<Q", len(name)) + name + struct.pack("<I", len(dims) & 0xFFFFFFFF)
            out += b"".join(struct.pack("<Q", d % 2**64) for d in dims)
            out += struct.pack("<IQ", ttype & 0xFFFFFFFF, toff % 2**64)
        align = self.alignment()
        out += b"\0" * (-len(out) % align)
        return bytes(out) + self.data


def _payload(inp: Input, t: int, n: int = 1) -> bytes:
    """``n`` values of type ``t`` (strings short and printable), from the input."""
    if t == _GT_STRING:
        return b"".join(struct.pack("<Q", len(w)) + w
                        for w in (bytes(97 + inp.num(0, 25) for _ in range(inp.num(0, 6))) for _ in range(n)))
    size = _GT_SIZE.get(t, 4)
    if size == 4 and inp.byte() < 128:
        return b"".join(struct.pack("<I", inp.wild(0, 64) & 0xFFFFFFFF) for _ in range(n))
    return inp.bytes(size * n).ljust(size * n, b"\x01")


def _rule_keys(g: GgufFile) -> list[bytes]:
    """The keys pyspec.core.gguf_keys.RULES names, for this file's architecture."""
    from pyspec.core.gguf_keys import RULES

    arch = g.value(b"general.architecture") or "llama"
    return [r.key.replace("{arch}", arch).encode() for r in RULES] + [b"split.count", b"general.architecture"]


def mutate_gguf(g: GgufFile, inp: Input) -> None:
    """One structured mutation of ``g``, as the input chooses."""
    op = inp.num(0, 13)
    kvs, tensors = g.kvs, g.tensors
    kv = inp.choice(kvs) if kvs else None
    if op == 0 and kv is not None:  # another value type, the payload re-made to fit (or not)
        kv[1] = inp.choice([*_GT_SIZE, _GT_STRING, _GT_ARRAY, 13, 255])
        if kv[1] == _GT_ARRAY:
            kv[2] = inp.choice([*_GT_SIZE, _GT_STRING])
            kv[3] = inp.wild(0, 8)
            kv[4] = _payload(inp, kv[2], min(kv[3], 4096))
        else:
            kv[2], kv[3] = -1, 1
            if inp.byte() < 230:
                kv[4] = _payload(inp, kv[1])
    elif op == 1 and kv is not None and kv[1] == _GT_ARRAY:  # another element type, same count
        kv[2] = inp.choice([*_GT_SIZE, _GT_STRING, _GT_ARRAY, 13])
        if inp.byte() < 230:
            kv[4] = _payload(inp, kv[2], min(kv[3], 1 << 16))
    elif op == 2 and kv is not None:  # an empty key
        kv[0] = b""
    elif op == 3 and kv is not None:  # a key twice
        kvs.insert(inp.num(0, len(kvs)), list(kv))
    elif op == 4 and kv is not None:  # renamed to a key llama.cpp reads with a typed getter
        kv[0] = inp.choice(_rule_keys(g))
    elif op == 5:  # a typed key added, of any type and shape
        t = inp.choice([*_GT_SIZE, _GT_STRING, _GT_ARRAY])
        key = inp.choice(_rule_keys(g))
        if t == _GT_ARRAY:
            elem, n = inp.choice([*_GT_SIZE, _GT_STRING]), inp.wild(0, 8)
            kvs.insert(inp.num(0, len(kvs)), [key, t, elem, n, _payload(inp, elem, min(n, 4096))])
        else:
            kvs.insert(inp.num(0, len(kvs)), [key, t, -1, 1, _payload(inp, t)])
    elif op == 6 and kv is not None and kv[1] == _GT_ARRAY:  # a count that lies, or a fitting one
        n = inp.choice([0, 1, kv[3] - 1, kv[3] + 1, 2**31, 2**32 + 1, 2**63, 2**64 - 1, inp.wild(0, 64)])
        kv[3] = max(n, 0)
        if inp.byte() < 100 and kv[3] <= 1 << 16:
            kv[4] = _payload(inp, kv[2], kv[3])
    elif op == 7 and tensors:  # a tensor shape
        t = inp.choice(tensors)
        dims = t[1]
        k = inp.num(0, 5)
        if k == 0 and dims:
            dims[inp.num(0, len(dims) - 1)] = inp.choice([0, 1, 2, 3, 7, 31, 4096, 2**31, 2**32, 2**62, 2**64 - 1])
        elif k == 1:
            dims.append(inp.wild(1, 4))
        elif k == 2 and dims:
            dims.pop()
        elif k == 3 and len(dims) >= 2:
            dims[0], dims[1] = dims[1], dims[0]
        elif k == 4:
            t[1] = dims * inp.num(2, 3)  # more than GGML_MAX_DIMS
        else:
            dims[:] = [d + inp.num(-1, 1) for d in dims]
    elif op == 8 and tensors:  # a tensor type or offset
        t = inp.choice(tensors)
        if inp.byte() & 1:
            t[2] = inp.wild(0, 41)
        else:
            t[3] = inp.choice([0, 1, 32, t[3] + 32, 2**40, 2**64 - 1, inp.wild(0, 1 << 20)])
    elif op == 9 and tensors:  # a tensor name twice, or empty
        t = inp.choice(tensors)
        if inp.byte() & 1:
            tensors.insert(inp.num(0, len(tensors)), [t[0], list(t[1]), t[2], t[3]])
        else:
            t[0] = b""
    elif op == 10:  # header counts that lie
        if inp.byte() & 1:
            g.n_kv_delta = inp.choice([-1, 1, 2**40])
        else:
            g.n_tensors_delta = inp.choice([-1, 1, 2**40])
    elif op == 11 and kv is not None:  # a key dropped
        kvs.remove(kv)
    elif op == 12 and kv is not None and kv[1] == _GT_STRING and len(kv[4]) >= 8:  # a string value's length lies
        (n,) = struct.unpack_from("<Q", kv[4])
        kv[4] = struct.pack("<Q", inp.choice([0, n + 1, 2**63, inp.wild(0, 256)]) % 2**64) + kv[4][8:]
    elif op == 13:
        g.version = inp.choice([1, 2, 3, 4, 0xFFFFFFFF])


def door_sets() -> dict[str, list[Path]]:
    """The unmutated files of every kind: each tiny model, the LoRA, a control vector, a split set."""
    from pyspec.testing import derived
    from pyspec.testing import models as tm

    if "door_sets" in S:
        return dict(S["door_sets"])
    sets = {name: [path] for name, path in sorted(tm.make_all().items())}
    # the quantized copies the tests make (pyspec.testing.quantize), where they exist already
    for path in sorted(tm.make_target().parent.glob("pyspec-tiny-*-q8_0.gguf")):
        sets[path.stem.removeprefix("pyspec-tiny-")] = [path]
    folder = TMP / "doors"
    folder.mkdir(exist_ok=True)
    sets["lora"] = [derived.make_lora(folder / "lora.gguf").path]
    rng = np.random.default_rng(3)
    n_embd = int(S["target"].n_embd) if "target" in S else 64
    sets["cvec"] = [derived.make_control_vector(folder / "cvec.gguf",
                                                {1: rng.standard_normal(n_embd).astype(np.float32)})]
    sets["split"] = derived.make_split_target(folder, max_tensors=8)
    S["door_sets"] = sets
    S["door_bytes"] = {name: [p.read_bytes() for p in paths] for name, paths in sets.items()}
    return dict(sets)


DOORS = ("model", "vocab", "lora", "cvec", "quantize", "split")


def _door(door: str, paths: list[Path]) -> Any:
    from pyspec import Model
    from pyspec.core.adapters import LoraAdapter, load_control_vector
    from pyspec.core.quantize import quantize

    if door in ("model", "vocab"):  # a vocab_only load reads the tokenizer keys, not the hyperparameters
        return Model(paths[0], vocab_only=door == "vocab")
    if door == "split":
        return Model(paths if len(paths) > 1 else paths[0])
    if door == "lora":
        return LoraAdapter(S["target"], paths[0])
    if door == "cvec":
        return load_control_vector(paths[0])
    if door == "quantize":
        return quantize(paths[0], TMP / "quantized.gguf", "q8_0", nthread=1, dry_run=True)
    raise ValueError(f"door must be one of {DOORS}, not {door!r}")


def run_door(door: str, paths: list[Path]) -> Any:
    """Hand ``paths`` to one door; the object it made (closed) or the clean exception."""
    r = _call(_door, door, paths)
    if hasattr(r, "close"):
        r.close()
    return r


def open_door(door: str, paths: list[str]) -> str:
    """Hand files to one door and raise what it raises (for crash-safe Worker calls)."""
    r = _door(door, [Path(p) for p in paths])
    if hasattr(r, "close"):
        r.close()
    return "opened"


def open_door_unguarded(door: str, paths: list[str]) -> str:
    """:func:`open_door` with pyspec.core.gguf_keys' rules switched off: what llama.cpp does
    with the file (the test that each rule guards a real abort)."""
    from pyspec.core import gguf_keys

    with gguf_keys.rules_off():
        return open_door(door, paths)


def target_gguf_doors(data: bytes) -> None:
    """A tiny model, the LoRA, a control vector or a split set, mutated 1-6 times in its
    structure (value and element types, empty and repeated keys, counts, tensor shapes),
    through a door chosen by the input (any file through any door)."""
    sets = door_sets()
    inp = Input(data)
    names = sorted(sets)
    name = inp.choice(names)
    raw = S["door_bytes"][name]
    which = inp.num(0, len(raw) - 1)
    parsed = S.setdefault("door_parsed", {})
    if (name, which) not in parsed:  # parsing a 32000-token header is the slow part: once per file
        parsed[name, which] = GgufFile(raw[which])
    g = parsed[name, which].copy()
    for _ in range(inp.num(1, 6)):
        mutate_gguf(g, inp)
    folder = TMP / "mutated"
    folder.mkdir(exist_ok=True)
    if name == "split":
        paths = []
        for i, (src, blob) in enumerate(zip(sets[name], raw, strict=True)):
            dst = folder / src.name
            dst.write_bytes(g.encode() if i == which else blob)
            paths.append(dst)
        door = "split" if inp.byte() < 200 else inp.choice(list(DOORS))
    else:
        paths = [folder / "m.gguf"]
        paths[0].write_bytes(g.encode())
        natural = {"lora": "lora", "cvec": "cvec"}.get(name, "model")
        door = natural if inp.byte() < 170 else inp.choice(list(DOORS))
    run_door(door, paths)


# --- call sequences -------------------------------------------------------------------


def target_api(data: bytes) -> None:
    from pyspec import Batch, Context, SamplerChain
    from pyspec.common import sampling as smp
    from pyspec.common import speculative as sp
    from pyspec.common.params import CommonParamsSpeculative
    from pyspec.common.params import CommonSpeculativeType as T
    from pyspec.reference.speculative import RefSpeculative

    inp = Input(data)
    n_vocab = S["vocab"].n_tokens
    contexts: list[Any] = [S["ctx"]]
    chains: list[Any] = []
    specs: list[Any] = []
    owned: list[Any] = []
    try:
        for _ in range(inp.num(1, 24)):
            if not inp.left():
                break
            op = inp.num(0, 19)
            c = inp.choice(contexts)
            if op == 0 and len(contexts) < 4:
                kw = dict(S["kw"])
                for _ in range(inp.num(0, 2)):
                    key = inp.choice(["n_ctx", "n_batch", "n_ubatch", "n_seq_max", "n_outputs_max", "pooling_type",
                                      "attention_type", "embeddings", "kv_unified", "n_rs_seq", "type_k",
                                      "flash_attn_type"])
                    kw[key] = inp.choice(_CHOICES[key]) if key in _CHOICES else inp.wild(0, 300)
                model = S["mtp"] if inp.byte() < 60 and "mtp" in S else S["target"]
                r = _call(Context, model, **kw)
                if not isinstance(r, BaseException):
                    contexts.append(r)
                    owned.append(r)
            elif op in (1, 2, 3):  # decode
                n = inp.num(1, 40)
                b = Batch(max(n, 1), 0, inp.num(1, 3))
                for _ in range(n):
                    seqs = inp.wild(0, 2) if inp.byte() < 230 else [inp.wild(0, 2), inp.wild(0, 2)]
                    _call(b.add, inp.wild(0, n_vocab - 1) if inp.byte() < 250 else inp.wild(0, n_vocab + 9),
                          inp.wild(0, 60) if inp.byte() < 245 else inp.wild(-5, 2**31 - 1), seqs, inp.byte() < 128)
                if len(b):
                    _call(c.decode, b)
            elif op == 4:
                _call(c.get_logits_ith, inp.wild(-3, 40))
            elif op == 5:
                _call(c.get_logits, inp.wild(0, 40))
            elif op == 6:
                _call(inp.choice([c.get_embeddings_ith, c.get_embeddings_nextn_ith]), inp.wild(-3, 40))
            elif op == 7:
                _call(inp.choice([c.get_embeddings_seq, c.get_sampled_token_ith, c.get_sampled_probs_ith]),
                      inp.wild(-1, 3))
            elif op == 8:
                m = c.memory
                f = inp.choice([m.seq_rm, m.seq_cp, m.seq_add, m.seq_div, m.seq_keep, m.seq_pos_max, m.clear])
                if f is m.seq_rm:
                    _call(f, inp.wild(-1, 2), inp.wild(-1, 60), inp.wild(-1, 60))
                elif f is m.seq_cp:
                    _call(f, inp.wild(0, 2), inp.wild(0, 2), inp.wild(-1, 60), inp.wild(-1, 60))
                elif f in (m.seq_add, m.seq_div):
                    _call(f, inp.wild(0, 2), inp.wild(-1, 60), inp.wild(-1, 60), inp.wild(-3, 64))
                elif f is m.clear:
                    _call(f, inp.byte() & 1)
                else:
                    _call(f, inp.wild(-1, 2))
            elif op == 9:  # state round trip, maybe corrupted
                blob = _call(c.state_seq_get, inp.wild(0, 1), inp.wild(0, 1))
                if isinstance(blob, bytes) and blob:
                    blob = bytearray(blob)
                    for _ in range(inp.num(0, 3)):
                        blob[inp.num(0, len(blob) - 1)] = inp.byte()
                    _call(c.state_seq_set, inp.wild(0, 1), bytes(blob), inp.wild(0, 1))
            elif op == 10 and len(chains) < 4:
                ch = SamplerChain()
                owned.append(ch)
                for _ in range(inp.num(0, 3)):
                    _call(_add_sampler, ch, inp)
                chains.append(ch)
            elif op == 11 and chains:
                _call(inp.choice(chains).sample, c, inp.wild(-2, 40))
            elif op == 12 and chains:
                ch = inp.choice(chains)
                k = inp.byte() % 4
                if k == 0:
                    _call(ch.accept, inp.wild(0, n_vocab + 2))
                elif k == 1:
                    _call(ch.reset)
                elif k == 2:
                    twin = _call(ch.clone)
                    if isinstance(twin, SamplerChain):
                        owned.append(twin)
                else:
                    _call(ch.apply, np.arange(inp.num(0, 64), dtype=np.float32))
            elif op == 13 and chains:
                _call(c.set_sampler, inp.wild(0, 2), inp.choice([*chains, None]))
            elif op == 14 and len(specs) < 3:
                t = inp.choice([T.NGRAM_SIMPLE, T.NGRAM_MAP_K, T.NGRAM_MOD, T.NGRAM_CACHE])
                p = CommonParamsSpeculative(types=[t])
                p.ngram_mod.n_match = inp.wild(1, 8)
                p.ngram_simple.size_n = p.ngram_map_k.size_n = inp.wild(0, 6)
                eng = inp.byte() & 1
                n_seq = inp.wild(1, 3)
                r = _call(RefSpeculative, p, n_seq) if eng else _call(sp.common_speculative_init, p, n_seq)
                if r is not None and not isinstance(r, BaseException):
                    specs.append((eng, r))
                    owned.append(r)
            elif op == 15 and specs:
                eng, spec = inp.choice(specs)
                _call(_spec_call, eng, spec, inp)
            elif op == 16:
                s = _call(smp.common_sampler_init, S["target"], _sampling(inp))
                if not isinstance(s, BaseException):
                    try:
                        _call(smp.common_sampler_sample, s, c, inp.wild(-2, 40))
                        _call(smp.common_sampler_accept, s, inp.wild(0, n_vocab + 2), bool(inp.byte() & 1))
                    finally:
                        s.close()
            elif op == 17 and len(owned) > 0:
                obj = inp.choice(owned)
                _call(getattr(obj, "close", lambda: None))
            elif op == 18:
                _call(c.set_n_threads, inp.wild(1, 2), inp.wild(1, 2))
            elif op == 19:
                if inp.byte() & 1:
                    _call(c.set_embeddings, bool(inp.byte() & 1))
                else:
                    _call(c.set_embeddings_nextn, bool(inp.byte() & 1), bool(inp.byte() & 1))
    finally:
        for o in reversed(owned):
            try:
                o.close()
            except BaseException as e:
                if not _clean(e):
                    raise Finding(f"close: {type(e).__name__}: {e}") from e
        # the shared context must stay usable
        S["ctx"].memory.seq_rm(-1, 3, -1)


_CHOICES: dict[str, list[Any]] = {"type_k": ["f16", "q8_0", "q4_0", 99], "flash_attn_type": ["auto", "enabled", 7],
                                  "embeddings": [True, False], "kv_unified": [True, False]}


class _FuzzSampler:
    """A Python sampler (SamplerChain.add_custom) that misbehaves as the input says."""

    name = "fuzz"

    def __init__(self, how: int, arg: int) -> None:
        self.how, self.arg = how, arg

    def apply(self, cur_p: Any) -> None:
        how, arg = self.how, self.arg
        if how == 1:
            raise RuntimeError("fuzz sampler raised")
        if how == 2:
            cur_p.data = cur_p.data[: max(arg % (cur_p.size + 2), 0)]  # may be empty: refused
        elif how == 3:
            cur_p.data = np.concatenate([cur_p.data, cur_p.data[: arg % 4 + 1]])  # grows: refused
        elif how == 4:
            cur_p.selected = arg  # any index, in range or not
        elif how == 5:
            cur_p.data["id"][0] = arg  # an id outside the candidates: refused
        elif how == 6:
            cur_p.data = [1, 2, 3]  # not an array
        elif how == 7:
            cur_p.data["logit"][:] = float("nan")

    def accept(self, token: int) -> None:
        if self.how == 8:
            raise ValueError("fuzz accept raised")

    def reset(self) -> None:
        if self.how == 9:
            raise KeyError("fuzz reset raised")

    def clone(self) -> Any:
        return None if self.how == 10 else _FuzzSampler(self.how, self.arg)


def _add_sampler(ch: Any, inp: Input) -> None:
    k = inp.num(0, 7)
    if k == 7:
        ch.add_custom(_FuzzSampler(inp.num(0, 10), inp.wild(-2, 40)))
        return
    if k == 0:
        ch.add_greedy()
    elif k == 1:
        ch.add_top_k(inp.wild(-1, 50))
    elif k == 2:
        ch.add_dist(inp.wild(0, 99))
    elif k == 3:
        ch.add_temp(inp.num(0, 200) / 50)
    elif k == 4:
        ch.add_penalties(S["vocab"].n_tokens, inp.wild(-1, 64), 1.1, 0.1, 0.1)
    elif k == 5:
        ch.add_dry(S["vocab"], 1.0, 1.75, 2, inp.wild(-2, 64), ["\n"])
    else:
        ch.add_grammar(S["vocab"], 'root ::= [a-z ]+ "."')


def _spec_call(eng: int, spec: Any, inp: Input) -> None:
    """begin / draft / accept on a RefSpeculative (eng) or the port's CommonSpeculative."""
    from pyspec.common import speculative as sp
    from pyspec.common.speculative import DraftRequest

    seq = inp.wild(0, 2)
    hist = [inp.wild(0, 12) for _ in range(inp.num(0, 40))]
    act = inp.num(0, 2)
    n_max, id_last, n_acc = inp.wild(0, 8), inp.wild(0, 12), inp.wild(0, 8)
    if act == 0:
        spec.begin(seq, hist) if eng else sp.common_speculative_begin(spec, seq, hist)
    elif act == 2:
        spec.accept(seq, n_acc) if eng else sp.common_speculative_accept(spec, seq, n_acc)
    elif eng:
        spec.draft([DraftRequest(seq_id=seq, n_max=n_max, n_past=len(hist), id_last=id_last, prompt=hist)])
    else:
        dp = sp.common_speculative_get_draft_params(spec, seq)
        dp.drafting, dp.n_max, dp.n_past, dp.id_last = True, n_max, len(hist), id_last
        dp.prompt, dp.result = hist, []
        sp.common_speculative_draft(spec)


def _sampling(inp: Input) -> Any:
    from pyspec.common.params import CommonParamsSampling, CommonSamplerType

    p = CommonParamsSampling()
    p.seed = inp.wild(0, 100)
    p.top_k = inp.wild(-1, 50)
    p.temp = inp.num(0, 300) / 100
    p.n_prev = inp.wild(0, 64)
    p.penalty_last_n = inp.wild(-1, 64)
    p.dry_multiplier = inp.num(0, 2) / 2
    p.dry_penalty_last_n = inp.wild(-2, 64)
    p.min_keep = inp.wild(0, 4)
    p.mirostat = inp.wild(0, 2)
    p.samplers = [inp.choice([*CommonSamplerType, 99]) for _ in range(inp.num(0, 4))]
    if inp.byte() < 40:
        p.grammar = inp.choice(['root ::= "a"', "root ::= [0-9]+", 'root ::= "x" | ""', "%llguidance {}", "root ::= ("])
    if inp.byte() < 30:
        p.logit_bias = [(inp.wild(0, 32000), 1.0)]
    return p


def target_params(data: bytes) -> None:
    """Both engines on the same parameters: the same tokens, or the same exception and message."""
    import dataclasses

    from pyspec import Context
    from pyspec.common.params import CommonParamsSpeculative
    from pyspec.common.params import CommonSpeculativeType as T
    from pyspec.generation.driver import SpeculativeGenerator

    inp = Input(data)
    t = inp.choice([T.NGRAM_SIMPLE, T.NGRAM_MAP_K, T.NGRAM_MAP_K4V, T.NGRAM_MOD, T.NGRAM_CACHE])
    p = CommonParamsSpeculative(types=[t])
    for m in (p.ngram_simple, p.ngram_map_k, p.ngram_map_k4v):
        m.size_n, m.size_m, m.min_hits = inp.wild(0, 6), inp.wild(0, 12), inp.wild(0, 3)
    p.ngram_mod.n_match, p.ngram_mod.n_min, p.ngram_mod.n_max = inp.wild(0, 6), inp.wild(-1, 8), inp.wild(-1, 12)
    p.draft.n_max, p.draft.n_min = inp.wild(-1, 8), inp.wild(-1, 4)
    sampling = _sampling(inp)
    n_predict = inp.num(1, 12)
    prompt = [inp.num(3, 40) for _ in range(inp.num(1, 24))]
    outcome: dict[str, tuple[Any, ...]] = {}
    for engine in ("python", "cpp"):
        ctx = Context(S["target"], **S["kw"])
        try:
            with SpeculativeGenerator(ctx, dataclasses.replace(p), dataclasses.replace(sampling), engine=engine) as g:
                outcome[engine] = ("tokens", g.generate([prompt], n_predict)[0].tokens)
        except BaseException as e:
            if not _clean(e):
                raise Finding(f"{engine} engine: {type(e).__name__}: {e}") from e
            outcome[engine] = ("raised", str(e), type(e).__name__, {c.__name__ for c in type(e).__mro__})
        finally:
            ctx.close()
    py, cpp = outcome["python"], outcome["cpp"]
    if sampling.seed == LLAMA_DEFAULT_SEED and py[0] == cpp[0] == "tokens":
        return  # each sampler draws its own random seed: the tokens may differ, by design
    # the C++ side may raise a subclass (RefError is a SpeculativeError), never another kind or message
    if py[0] != cpp[0] or py[1] != cpp[1] or (py[0] == "raised" and py[2] not in cpp[3]):
        raise Finding(f"the engines disagree: python {py[:2]} / cpp {cpp[:2]}")


CLI_WORDS = ["run", "bench", "parity", "models", "--tiny", "--types", "ngram-simple", "ngram-mod", "draft-simple",
             "draft-eagle3", "--n-ctx", "--n-batch", "--threads", "-t", "--n-predict", "-n", "--n-seq", "--prompt",
             "--engine", "python", "cpp", "--temp", "--top-k", "--seed", "--stop", "--n-max", "--ngram-n",
             "--ngram-m", "--model", "/nonexistent.gguf", "/dev/null", "0", "-1", "1", "2", "7", "64", "100000",
             "2147483648", "nan", "x", "", "--quiet", "--echo", "-q", "--no-real", "--n-prompts", "--repeat",
             "--engines", "loop", "--json", "/tmp"]


def target_cli(data: bytes) -> None:
    inp = Input(data)
    argv = [inp.choice(CLI_WORDS) for _ in range(inp.num(1, 10))]
    if argv[0] not in ("run", "bench", "parity", "models"):
        argv.insert(0, "run")
    if "--tiny" not in argv and "--model" not in argv:
        argv.append("--tiny")
    if "-n" not in argv and "--n-predict" not in argv:
        argv += ["-n", "4"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    try:
        out = subprocess.run([sys.executable, "-m", "pyspec", *argv], capture_output=True, text=True, timeout=300,
                             env=env, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise Finding(f"pyspec {' '.join(argv)}: no exit within 300 s") from None
    if out.returncode < 0:
        raise Finding(f"pyspec {' '.join(argv)}: killed by signal {-out.returncode}")
    if out.returncode not in (0, 1, 2) or "Traceback" in out.stderr:
        raise Finding(f"pyspec {' '.join(argv)}: exit {out.returncode}: {out.stderr[-800:]}")


def target_server(data: bytes) -> None:
    from pyspec.testing.fuzz_server import target_server as run

    run(data)


TARGETS: dict[str, Callable[[bytes], None]] = {
    "grammar": target_grammar, "state": target_state, "ngram": target_ngram, "gguf": target_gguf,
    "api": target_api, "params": target_params, "cli": target_cli, "gguf_doors": target_gguf_doors,
    "server": target_server,
}


# --- seeds and a plain mutator (the fallback when atheris is not installed) -------------


def seeds(target: str) -> list[bytes]:
    root = Path(__file__).resolve().parents[2]
    if target == "grammar":
        out = [b'root ::= "a"', b'root ::= [a-z]+ ("," [a-z]+)*', b'root ::= x{0,3}\nx ::= "b" | ""']
        gdir = root / "vendor" / "llama.cpp" / "grammars"
        out += [p.read_bytes()[:4000] for p in sorted(gdir.glob("*.gbnf"))] if gdir.exists() else []
        return [bytes([len(s) // 16 + 1]) + s for s in out]
    if target == "state":
        out = []
        for name, flags in (("ctx", 0), ("ctx", 1), ("ctx_mtp", 0), ("ctx_mtp", 1)):
            if name in S:
                out.append(bytes([1 if name == "ctx_mtp" else 0, flags]) + S[name].state_seq_get(0, flags))
        for name in ("ctx", "ctx_mtp"):
            if name not in S:
                continue
            c, bit = S[name], 1 if name == "ctx_mtp" else 0
            out.append(bytes([bit | 2, 0]) + S["whole_" + name])
            c.state_seq_save_file(TMP / "seed-seq.bin", 0, [1, 2, 3])
            out.append(bytes([bit | 4, 0]) + (TMP / "seed-seq.bin").read_bytes())
            c.state_save_file(TMP / "seed-whole.bin", [1, 2, 3])
            out.append(bytes([bit | 6, 0]) + (TMP / "seed-whole.bin").read_bytes())
        return out
    if target == "ngram":
        rec = struct.pack("<4ii", 1, 2, 3, 4, 2) + struct.pack("<iiii", 5, 1, 6, 2)
        return [rec, rec * 3, b"", rec[:-3]]
    if target == "gguf":
        return [S["gguf"][:8192]] if "gguf" in S else []
    if target == "gguf_doors":  # control bytes: one seed per file kind and door, then random ones
        n = len(door_sets())
        return [bytes([k, 0, 3] + [j * 37 % 256 for j in range(40)]) for k in range(n)] + \
            [bytes(random.Random(i).randrange(256) for _ in range(64)) for i in range(16)]
    return [bytes(random.Random(i).randrange(256) for _ in range(256)) for i in range(8)]


def mutate(data: bytes, rng: random.Random, max_len: int = 65536) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        k = rng.randrange(6)
        if k == 0 and b:
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        elif k == 1 and b:
            b[rng.randrange(len(b))] = rng.randrange(256)
        elif k == 2:
            i = rng.randrange(len(b) + 1)
            b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        elif k == 3 and b:
            i = rng.randrange(len(b))
            del b[i : i + rng.randint(1, 16)]
        elif k == 4 and len(b) >= 4:
            i = rng.randrange(len(b) - 3)
            b[i : i + 4] = struct.pack("<I", rng.choice(INTERESTING) & 0xFFFFFFFF)
        elif k == 5 and b:
            i, j = rng.randrange(len(b)), rng.randrange(len(b))
            b[i:i] = b[j : j + rng.randint(1, 32)]
    return bytes(b[:max_len])
