"""The one pre-load check of a GGUF file, for every door that hands a file to llama.cpp.

llama.cpp (revision 0c1e57098) reads metadata with typed getters that throw on a wrong type
(llama_model_loader::get_key, and at this revision get_arr / get_key_or_arr on an array of
the wrong element type: a std::runtime_error, which llama_model_load catches) or assert
(GGML_ASSERT: the process ends): gguf's accessors gguf_get_val_* / gguf_get_arr_* assert on
a wrong type or on a scalar where an array is expected (llama-vocab.cpp checks its arrays'
types itself at this revision), and a few loaders assert on an array's length. :data:`RULES` lists every
key read at such a site, with the type, element type and count llama.cpp needs there;
:func:`gguf_problem` walks the file's metadata (a Python walk over the header, no tensor
data: the tiny models' header with its 32000-token list takes a few milliseconds) and then
runs csrc/pyspec_gguf.cpp (gguf's own parser: the tokenizer checks, repeated tokens), so a
door calls one function. docs/audit.toml's [[getter]] rows list every typed read site of
the vendored source and the rule here that guards it; tests/test_gguf_doors.py walks the
source so a new site without a row fails.

Why a Python walk: the rules are a table that the audit test reads, the walk must refuse
what gguf's own parser asserts on *before* that parser runs (an empty key, a
general.alignment of another type), and the header is small; the C check stays for what
needs gguf's parsed context.

What the rules do not cover, the values llama.cpp asserts on while it reads the file (a layer
count of 0, more experts used than there are), is caught by the doors' load itself:
csrc/pyspec_rpc.cpp's pyspec_model_load_checked (and its LoRA and quantize siblings) turn a
GGML_ASSERT on the loading thread into a failed load.

Doors: "model" (Model, each split file of it, quantize's source: llama_model_loader reads
the same keys), "lora" (llama_adapter_lora_init), "cvec" (load_control_vector: gguf's
parser only).
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DOORS", "RULES", "Rule", "gguf_problem", "model_files_problem", "rules_off", "split_files"]

# GGUF value types (gguf.h)
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
TYPE_NAMES = {U8: "uint8", I8: "int8", U16: "uint16", I16: "int16", U32: "uint32", I32: "int32", F32: "float32",
              BOOL: "bool", STRING: "string", ARRAY: "array", U64: "uint64", I64: "int64", F64: "float64"}
_SIZE = {U8: 1, I8: 1, BOOL: 1, U16: 2, I16: 2, U32: 4, I32: 4, F32: 4, U64: 8, I64: 8, F64: 8}
DOORS = ("model", "lora", "cvec")

# what get_arr / get_key_or_arr accept for an std::array<int32_t | uint32_t, N> / vector<int32_t>,
# float and std::string: another of U32 / I32 / F32 / STRING (/ BOOL) asserts
_INTS = frozenset({BOOL, U32, I32})
_VEC_INTS = frozenset({U32, I32})


@dataclass(frozen=True)
class Rule:
    """One key llama.cpp reads at a typed site, and what it must be there.

    ``shape``: "scalar" (a single value of one of ``types``), "array" (an array whose
    element type is one of ``types``) or "either" (get_key_or_arr: a scalar is read by the
    throwing get_key; an array must have one of the element ``types``). ``key`` holds
    ``{arch}`` for the keys named after general.architecture. ``min_count``: another key
    whose array length this array must reach (llama.cpp reads that many elements).
    """

    key: str
    shape: str
    types: frozenset[int]
    doors: tuple[str, ...]
    site: str
    min_count: str = ""
    split_only: bool = False  # read only from the files of a split model (split.count > 1)
    max_count: int = 0  # the most elements llama.cpp takes (0: no bound of its own)

    def expected(self) -> str:
        names = "/".join(TYPE_NAMES[t] for t in sorted(self.types))
        if self.shape == "scalar":
            return f"a single {names}"
        most = f" of at most {self.max_count} elements" if self.max_count else ""
        if self.shape == "array":
            return f"an array{most} of {names}"
        return f"a scalar or an array{most} of {names}"


_ALL = DOORS
_M = ("model",)
RULES: tuple[Rule, ...] = (
    # gguf's own parser (every door): gguf_init_from_file reads it with gguf_get_val_u32
    Rule("general.alignment", "scalar", frozenset({U32}), _ALL, "ggml/src/gguf.cpp gguf_init_from_impl"),
    # llama-vocab.cpp, with gguf's accessors (gguf_get_arr_n / _str / _data assert, the data is cast)
    Rule("tokenizer.ggml.tokens", "array", frozenset({STRING}), _M, "src/llama-vocab.cpp load"),
    # float32 or (since 0c1e57098) int32, as csrc/pyspec_gguf.cpp checks too
    Rule("tokenizer.ggml.scores", "array", frozenset({F32, I32}), _M, "src/llama-vocab.cpp load",
         "tokenizer.ggml.tokens"),
    Rule("tokenizer.ggml.token_type", "array", frozenset({I32}), _M, "src/llama-vocab.cpp load",
         "tokenizer.ggml.tokens"),
    Rule("tokenizer.ggml.merges", "array", frozenset({STRING}), _M, "src/llama-vocab.cpp load"),
    Rule("tokenizer.ggml.precompiled_charsmap", "array", frozenset({I8, U8}), _M, "src/llama-vocab.cpp load"),
    Rule("tokenizer.ggml.suppress_tokens", "array", frozenset({I32, U32}), _M, "src/llama-vocab.cpp load"),
    # llama_model_loader::get_arr (vector<string>, vector<int32_t>, array<int32_t, 512>)
    Rule("{arch}.classifier.output_labels", "array", frozenset({STRING}), _M, "src/llama-model.cpp load_hparams"),
    Rule("{arch}.target_layers", "array", _VEC_INTS, _M, "src/models/eagle3.cpp"),
    Rule("{arch}.deepstack_mapping", "array", _INTS, _M, "src/models/granite.cpp"),
    # get_key_or_arr (array<uint32_t | int | float, N>): per-layer hyperparameters
    Rule("{arch}.feed_forward_length", "either", _INTS, _M, "src/llama-model.cpp load_hparams"),
    Rule("{arch}.attention.head_count", "either", _INTS, _M, "src/llama-model.cpp load_hparams"),
    Rule("{arch}.attention.head_count_kv", "either", _INTS, _M, "src/llama-model.cpp load_hparams"),
    Rule("{arch}.attention.sliding_window_pattern", "either", _INTS, _M, "src/models/*.cpp"),
    Rule("{arch}.attention.recurrent_layers", "either", _INTS, _M, "src/models/qwen3next.cpp, qwen35*.cpp"),
    Rule("{arch}.rope.dimension_sections", "either", _INTS, _M, "src/models/*.cpp"),
    Rule("{arch}.swiglu_clamp_exp", "either", frozenset({F32}), _M, "src/models/step35.cpp"),
    Rule("{arch}.swiglu_clamp_shexp", "either", frozenset({F32}), _M, "src/models/step35.cpp"),
    Rule("xielu.alpha_n", "either", frozenset({F32}), _M, "src/models/apertus.cpp"),
    Rule("xielu.alpha_p", "either", frozenset({F32}), _M, "src/models/apertus.cpp"),
    Rule("xielu.beta", "either", frozenset({F32}), _M, "src/models/apertus.cpp"),
    Rule("xielu.eps", "either", frozenset({F32}), _M, "src/models/apertus.cpp"),
    # keys first read at 0c1e57098 (the loader throws on a wrong element type; checked first for one message)
    Rule("{arch}.expert_feed_forward_length", "either", _INTS, _M, "src/models/*.cpp load_arch_hparams"),
    Rule("{arch}.expert_used_count", "either", _INTS, _M, "src/llama-model.cpp load_hparams, granite-swa.cpp"),
    Rule("{arch}.attention.indexer.types", "either", _INTS, _M, "src/models/dots3note.cpp, glm-dsa.cpp, ..."),
    # deepseek4.cpp GGML_ASSERTs n_compress_ratios <= LLAMA_MAX_LAYERS before get_arr's own length check
    Rule("{arch}.attention.compress_ratios", "either", _INTS, _M, "src/models/deepseek4.cpp, dflash.cpp, qwen4exp.cpp",
         max_count=512),
    Rule("{arch}.attention.rope_pattern", "array", _INTS, _M, "src/models/granite-swa.cpp"),
    Rule("{arch}.adapters.token_ids_activate", "array", _VEC_INTS, _M, "src/models/granite-switch.cpp"),
    Rule("{arch}.adapters.token_ids_substitute", "array", _VEC_INTS, _M, "src/models/granite-switch.cpp"),
    Rule("{arch}.ple.layers", "array", _VEC_INTS, _M, "src/models/qwen4exp.cpp"),
    Rule("{arch}.ple.layer_multipliers", "array", frozenset({U64}), _M, "src/models/qwen4exp.cpp"),
    Rule("{arch}.ple.head_offsets", "array", frozenset({U64}), _M, "src/models/qwen4exp.cpp"),
    Rule("{arch}.ple.head_vocab_sizes", "array", frozenset({U64}), _M, "src/models/qwen4exp.cpp"),
    Rule("general.tensor_extra.name", "array", frozenset({STRING}), _M, "src/llama-model.cpp llama_prec_policy::load"),
    # the loader reads split.no of the second and later files with gguf_get_val_u16
    Rule("split.no", "scalar", frozenset({U16}), _M, "src/llama-model-loader.cpp llama_model_loader",
         split_only=True),
    # llama-adapter.cpp's get_kv_str / get_kv_f32 (gguf_get_val_str / _f32 assert)
    Rule("general.type", "scalar", frozenset({STRING}), ("lora",),
         "src/llama-adapter.cpp llama_adapter_lora_init_impl"),
    Rule("general.architecture", "scalar", frozenset({STRING}), ("lora",),
         "src/llama-adapter.cpp llama_adapter_lora_init_impl"),
    Rule("adapter.type", "scalar", frozenset({STRING}), ("lora",),
         "src/llama-adapter.cpp llama_adapter_lora_init_impl"),
    Rule("adapter.lora.alpha", "scalar", frozenset({F32}), ("lora",),
         "src/llama-adapter.cpp llama_adapter_lora_init_impl"),
)


@dataclass
class _Value:
    index: int
    type: int  # the scalar type, or ARRAY
    elem: int = -1  # the element type of an array
    count: int = 1
    text: str | None = None  # a scalar string's value (general.architecture, split.count)
    number: int | None = None  # a scalar integer's value


class _Stop(Exception):
    """The walk cannot go on: a short or malformed file, which gguf's own parser refuses."""


def _walk(path: Path) -> tuple[dict[str, _Value], str]:
    """Every metadata key's type and count, or a problem (an empty or repeated key, a tensor
    dimension gguf's parser divides by that is 0)."""
    with path.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            return {}, ""
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        if mm[:4] != b"GGUF":
            return {}, ""
        _, n_tensors, n_kv = struct.unpack_from("<Iqq", mm, 4)
        off = 24
        out: dict[str, _Value] = {}

        def take(fmt: str) -> tuple[int, ...]:
            nonlocal off
            n = struct.calcsize(fmt)
            if off + n > size:
                raise _Stop
            v = struct.unpack_from(fmt, mm, off)
            off += n
            return v

        def string() -> bytes:
            nonlocal off
            (n,) = take("<Q")
            if n > size - off:
                raise _Stop
            off += n
            return mm[off - n : off]

        def skip_strings(n: int) -> None:
            nonlocal off
            unpack = struct.Struct("<Q").unpack_from
            for _ in range(n):
                if off + 8 > size:
                    raise _Stop
                (m,) = unpack(mm, off)
                off += 8 + m
                if off > size:
                    raise _Stop

        try:
            for i in range(max(n_kv, 0)):
                raw = string()
                if not raw:
                    return out, f"metadata key #{i} is empty"
                key = raw.decode("utf-8", "replace")
                (t,) = take("<I")
                if key in out:
                    return out, f"metadata key {key!r} appears twice (#{out[key].index} and #{i})"
                if t == ARRAY:
                    elem, n = take("<IQ")
                    if elem == STRING:
                        skip_strings(n)
                    elif elem in _SIZE:
                        if n > (size - off) // _SIZE[elem]:
                            raise _Stop
                        off += n * _SIZE[elem]
                    else:
                        raise _Stop  # gguf refuses an unknown (or nested array) element type
                    out[key] = _Value(i, ARRAY, elem, n)
                elif t == STRING:
                    out[key] = _Value(i, STRING, text=string().decode("utf-8", "replace"))
                elif t in _SIZE:
                    if off + _SIZE[t] > size:
                        raise _Stop
                    number = None
                    if t in (U8, I8, U16, I16, U32, I32, U64, I64):
                        fmt = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", U64: "<Q", I64: "<q"}[t]
                        (number,) = struct.unpack_from(fmt, mm, off)
                    off += _SIZE[t]
                    out[key] = _Value(i, t, number=number)
                else:
                    raise _Stop
            # the tensor infos: gguf_init_from_file divides INT64_MAX by ne[1], ne[2] and ne[3]
            # (the element count check), so a dimension of 0 past the first is a SIGFPE
            # (found by scripts/fuzz.py, gguf_doors target)
            infos = []
            for _ in range(max(n_tensors, 0)):
                name = string()
                (n_dims,) = take("<I")
                if n_dims > 4:
                    raise _Stop  # refused by gguf (GGML_MAX_DIMS)
                dims = take(f"<{n_dims}q")
                if any(d < 0 for d in dims):
                    raise _Stop  # refused by gguf
                if 0 in dims[1:]:
                    tname = name.decode("utf-8", "replace")
                    return out, f"tensor {tname!r} has a dimension of 0 past the first (shape {list(dims)})"
                (ttype, _offset) = take("<IQ")
                infos.append((dims, ttype))
            data = _data_size(infos, _alignment(out))
            if data is not None and (off + _alignment(out) - 1) // _alignment(out) * _alignment(out) + data > size:
                out[_DATA_PAST_END] = _Value(-1, U64, number=data)
        except _Stop:
            pass  # what was read is checked; gguf's parser refuses the rest with an error
        return out, ""
    finally:
        mm.close()


# ggml-cpu's tensor alignment (TENSOR_ALIGNMENT in ggml-cpu): mapped tensor data must honour it
_CPU_ALIGNMENT = 32

# set by _walk when the tensors' data (as gguf sums it) runs past the end of the file
_DATA_PAST_END = "\0data past the end"


def _alignment(kv: dict[str, _Value]) -> int:
    a = kv.get("general.alignment")
    n = a.number if a is not None and a.type == U32 else None
    return n if n and n & (n - 1) == 0 else 32


def _data_size(infos: list[tuple[tuple[int, ...], int]], align: int) -> int | None:
    """The data section's size as gguf_init_from_file sums it (each tensor padded to the
    alignment); None when gguf refuses a tensor type or shape first."""
    from pyspec.ffi import ggml

    total = 0
    for dims, ttype in infos:
        if ttype >= int(ggml.GGML_TYPE_COUNT):
            return None
        blck, tsize = int(ggml.ggml_blck_size(ttype)), int(ggml.ggml_type_size(ttype))
        ne = [*dims, 1, 1, 1, 1][:4]
        if blck <= 0 or tsize <= 0 or ne[0] % blck:
            return None
        nbytes = tsize * (ne[0] // blck) * ne[1] * ne[2] * ne[3]
        total += (nbytes + align - 1) // align * align
    return total


def _describe(v: _Value) -> str:
    if v.type == ARRAY:
        return f"an array of {v.count} {TYPE_NAMES.get(v.elem, str(v.elem))}"
    return f"a {TYPE_NAMES.get(v.type, str(v.type))}"


_rules_on = True


@contextmanager
def rules_off() -> Iterator[None]:
    """The walk without :data:`RULES` (and the alignment rule), for the tests that show each rule
    guards a real abort of llama.cpp (``pyspec.testing.fuzz.open_door_unguarded``); not thread-safe."""
    global _rules_on
    _rules_on = False
    try:
        yield
    finally:
        _rules_on = True


def _check_rules(kv: dict[str, _Value], door: str, in_split: bool) -> str:
    align = kv.get("general.alignment")
    if door == "model" and align is not None and align.type == U32 and align.number is not None \
            and align.number % _CPU_ALIGNMENT:
        # a model's tensor data is mapped in place: an alignment below the CPU backend's puts
        # tensors at addresses ggml_backend_tensor_alloc asserts on ("buffer pointer must be
        # aligned"; found by the gguf_doors fuzz target)
        return (f"general.alignment is {align.number}: a model's tensor data must be aligned to a "
                f"multiple of {_CPU_ALIGNMENT} bytes (the CPU backend's alignment)")
    arch = kv.get("general.architecture")
    arch_name = arch.text if arch is not None and arch.type == STRING else None
    for r in RULES:
        if door not in r.doors or (r.split_only and not in_split):
            continue
        if "{arch}" in r.key:
            if arch_name is None:
                continue  # no architecture: llama.cpp refuses the file before these reads
            key = r.key.replace("{arch}", arch_name)
        else:
            key = r.key
        v = kv.get(key)
        if v is None:
            continue
        if r.shape == "scalar":
            ok = v.type in r.types
        elif r.shape == "array":
            ok = v.type == ARRAY and v.elem in r.types
        else:  # either: a scalar goes through the throwing get_key
            ok = v.type != ARRAY or v.elem in r.types
        if not ok or (r.max_count and v.type == ARRAY and v.count > r.max_count):
            return f"metadata key {key!r} is {_describe(v)}, expected {r.expected()} (read by {r.site})"
        if r.min_count:
            base = kv.get(r.min_count)
            if base is not None and base.type == ARRAY and v.count < base.count:
                return (f"metadata key {key!r} has {v.count} elements, expected at least {base.count} "
                        f"(one per {r.min_count} entry)")
    return ""


def model_files_problem(paths: list[Path]) -> tuple[Path, str]:
    """The first of a model's files that llama.cpp must not see, and why; (path, "") if none.

    ``paths``: the files given (one, or the splits in order). For one file the split files
    that llama.cpp finds from its split.count are checked too (those that exist: a missing
    one is llama.cpp's own error).
    """
    if len(paths) > 1:
        files = paths
    else:  # one walk of the first file tells its problem and its split files
        walked = _walk(paths[0])
        files = split_files(paths[0], walked[0])
        problem = _problem(paths[0], walked, "model", len(files) > 1)
        if problem:
            return paths[0], problem
        files = files[1:]
    for p in files:
        problem = gguf_problem(p, "model", in_split=True) if p.is_file() else ""
        if problem:
            return p, problem
    return paths[0], ""


def split_files(path: Path, kv: dict[str, _Value] | None = None) -> list[Path]:
    """The files llama.cpp loads with ``path`` as the first split (``[path]`` for one file)."""
    from pyspec.core.splits import split_paths, split_prefix

    if kv is None:
        kv, _ = _walk(path)
    count = kv.get("split.count")
    n = count.number if count is not None and count.type == U16 else None
    if not n or n <= 1:
        return [path]
    prefix = split_prefix(str(path), 0, n)
    if prefix is None:
        return [path]  # llama.cpp refuses a first split it cannot name the others from
    return [Path(p) for p in split_paths(prefix, n)]


def gguf_problem(path: str | os.PathLike[str], door: str, *, in_split: bool = False) -> str:
    """Why llama.cpp must not see ``path`` through ``door`` ("model", "lora", "cvec"), or "".

    The metadata walk first (empty and repeated keys, every rule of :data:`RULES` for the
    door), then csrc/pyspec_gguf.cpp's check (gguf's parser: the tokenizer arrays, repeated
    tokens). ``in_split``: the file belongs to a model of several files (split.no is read).
    """
    if door not in DOORS:
        raise ValueError(f"door must be one of {DOORS}, not {door!r}")
    p = Path(path)
    return _problem(p, _walk(p), door, in_split)


def _problem(p: Path, walked: tuple[dict[str, _Value], str], door: str, in_split: bool) -> str:
    kv, problem = walked
    if not problem and door == "cvec" and _DATA_PAST_END in kv:
        # load_control_vector has gguf allocate the data section before reading it: a size
        # past the end of the file is a failed malloc, GGML_ASSERT in ggml_init (found by the
        # gguf_doors fuzz target)
        problem = (f"the tensor data ({kv[_DATA_PAST_END].number} bytes as the tensor infos give it) "
                   "runs past the end of the file")
    if not problem:
        count = kv.get("split.count")
        split = in_split or (count is not None and count.number is not None and count.number > 1)
        problem = _check_rules(kv, door, split) if _rules_on else ""
    if problem:
        return problem
    from pyspec.core.backend import ensure_backend
    from pyspec.core.ext_error import last_error
    from pyspec.ffi import ext

    ensure_backend()
    if ext.pyspec_gguf_check(os.fsencode(p)) != 0:
        return last_error()
    return ""
