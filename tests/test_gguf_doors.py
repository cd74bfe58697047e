"""The one pre-load GGUF check (pyspec/core/gguf_keys.py) at every door, and its audit table.

- Every typed metadata read of the vendored llama.cpp (the loader's get_key / get_arr /
  get_arr_n / get_key_or_arr, gguf's gguf_get_val_* / gguf_get_arr_*) has a [[getter]] row
  in docs/audit.toml: a new call site without one fails here.
- Hand-made files that llama.cpp asserts on, through each door (Model and its split files,
  LoraAdapter, load_control_vector, quantize's source), in a crash-safe worker: each is
  refused with the door's exception naming the file, the key and what was expected.
- With the rules switched off the same files end the worker by a signal (slow): each rule
  guards a real abort.
"""

from __future__ import annotations

import re
import struct
import sys
from fnmatch import fnmatch
from pathlib import Path

import pytest

from pyspec.core import gguf_keys
from pyspec.testing import fuzz
from pyspec.testing.crashsafe import Worker

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
VENDOR = ROOT / "vendor" / "llama.cpp"
GETTERS = tomllib.loads((ROOT / "docs" / "audit.toml").read_text())["getter"]

# a call of the loader's typed getters (not their definitions: llama_model_loader::get_key), and
# of gguf's accessors (not their definitions, whose first parameter is the context)
_LOADER = re.compile(r"(?<![:\w.>])(?:ml\.)?(get_key_or_arr|get_arr_n|get_arr|get_key)\s*\(\s*([^,]*?)\s*,")
_GGUF = re.compile(r"\b(gguf_get_(?:val|arr)_\w+)\s*\(\s*[^,()]+(?:\([^()]*\))?\s*,\s*([^,)]+?)\s*[,)]")


def _first_arg(arg: str) -> str:
    m = re.search(r"LLM_KV_\w+", arg)
    return m.group(0) if m else arg


def getter_sites() -> list[tuple[str, int, str, str]]:
    """(file, line, getter, first argument) of every typed metadata read of the vendored source."""
    files = [*sorted((VENDOR / "src").rglob("*.cpp")), VENDOR / "ggml" / "src" / "gguf.cpp"]
    out = []
    for f in files:
        rel = f.relative_to(VENDOR).as_posix()
        for ln, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            code = line.split("//")[0]
            if rel != "ggml/src/gguf.cpp":
                out += [(rel, ln, m.group(1), _first_arg(m.group(2))) for m in _LOADER.finditer(code)]
            if "const struct gguf_context" in code:
                continue  # a definition in gguf.cpp
            out += [(rel, ln, m.group(1), m.group(2)) for m in _GGUF.finditer(code)]
    return out


def _row_for(site: tuple[str, int, str, str]) -> dict | None:
    rel, _, getter, arg = site
    for row in GETTERS:
        if row["getter"] == getter and any(fnmatch(rel, g) for g in row["files"]) \
                and (row["args"] == ["*"] or arg in row["args"]):
            return row
    return None


def test_the_walk_finds_the_known_sites():
    sites = getter_sites()
    assert len(sites) > 500  # 549 get_key calls alone at e3a74b299
    names = {(s[0], s[2], s[3]) for s in sites}
    assert ("src/llama-model.cpp", "get_key_or_arr", "LLM_KV_FEED_FORWARD_LENGTH") in names
    assert ("src/llama-model-loader.cpp", "gguf_get_val_u16", "kid") in names
    assert ("ggml/src/gguf.cpp", "gguf_get_val_u32", "alignment_idx") in names
    assert ("src/llama-adapter.cpp", "gguf_get_val_f32", "id") in names


def test_every_getter_site_has_a_row_and_every_row_a_site():
    sites = getter_sites()
    missing = [f"{rel}:{ln}: {getter}({arg}, ...)" for rel, ln, getter, arg in sites
               if _row_for((rel, ln, getter, arg)) is None]
    assert not missing, "typed metadata reads without a [[getter]] row in docs/audit.toml:\n" + "\n".join(missing)
    used = {_row_for(s)["id"] for s in sites}  # type: ignore[index]
    stale = [r["id"] for r in GETTERS if r["id"] not in used]
    assert not stale, f"[[getter]] rows that match no call site: {stale}"


def test_the_rows_are_complete_and_their_guards_exist():
    ids = [r["id"] for r in GETTERS]
    assert len(ids) == len(set(ids))
    rule_keys = {r.key for r in gguf_keys.RULES}
    for r in GETTERS:
        missing = {"files", "getter", "args", "reads", "rule", "guard"} - set(r)
        assert not missing, f"{r['id']}: missing {missing}"
        guard_file = r["guard"].split(":")[0].split(" ")[0]
        assert (ROOT / guard_file).exists(), f"{r['id']}: guard file {guard_file} does not exist"
        if guard_file == "pyspec/core/gguf_keys.py" and "the callers' keys" not in r["guard"]:
            absent = [k for k in r["reads"] if k not in rule_keys]
            assert not absent, f"{r['id']}: no rule in gguf_keys.RULES for {absent}"


# --- hand-made files through each door -----------------------------------------------------

U16, U32, I32, F32, STRING, ARRAY = 2, 4, 5, 6, 8, 9


def _string(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


def _set(g: fuzz.GgufFile, key: bytes, t: int, payload: bytes, elem: int = -1, n: int = 1) -> None:
    for kv in g.kvs:
        if kv[0] == key:
            kv[1:] = [t, elem, n, payload]
            return
    g.kvs.append([key, t, elem, n, payload])


def _n_layer(g: fuzz.GgufFile, arch: str) -> int:
    for kv in g.kvs:
        if kv[0] == f"{arch}.block_count".encode():
            return int(struct.unpack("<I", kv[4])[0])
    raise AssertionError("no block_count")


@pytest.fixture(scope="module")
def sets(tmp_path_factory) -> dict[str, list[Path]]:
    fuzz.S.pop("door_sets", None)
    fuzz.TMP = tmp_path_factory.mktemp("doors")
    return fuzz.door_sets()


def _edit(name: str, sets: dict[str, list[Path]], out: Path, fn, index: int = 0) -> list[Path]:
    """Copies of set ``name`` in ``out``, file ``index`` edited by ``fn(GgufFile)``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, src in enumerate(sets[name]):
        dst = out / src.name
        if i == index:
            g = fuzz.GgufFile(src.read_bytes())
            fn(g)
            dst.write_bytes(g.encode())
        else:
            dst.write_bytes(src.read_bytes())
        paths.append(dst)
    return paths


def _ff_float_array(g: fuzz.GgufFile) -> None:
    n = _n_layer(g, "llama")
    _set(g, b"llama.feed_forward_length", ARRAY, struct.pack(f"<{n}f", *[64.0] * n), F32, n)


def _head_count_strings(g: fuzz.GgufFile) -> None:
    n = _n_layer(g, "llama")
    _set(g, b"llama.attention.head_count", ARRAY, _string(b"4") * n, STRING, n)


def _split_no_u32(g: fuzz.GgufFile) -> None:
    _set(g, b"split.no", U32, struct.pack("<I", 1))


# (id, file set, door, edit, index of the file edited, exception, key named, crashes without the rule)
CASES = [
    # the last field: llama.cpp aborts without the rule. Five aborts of e3a74b299 are errors of its own at
    # 0c1e57098 (typed array reads and gguf's alignment read throw): the rules stay, for one message first
    ("per-layer-float-array", "target", "model", _ff_float_array, 0, "ModelLoadError",
     "llama.feed_forward_length", False),
    ("per-layer-string-array", "target", "model", _head_count_strings, 0, "ModelLoadError",
     "llama.attention.head_count", False),
    ("alignment-string-model", "target", "model",
     lambda g: _set(g, b"general.alignment", STRING, _string(b"32")), 0, "ModelLoadError", "general.alignment", False),
    ("alignment-string-cvec", "cvec", "cvec",
     lambda g: _set(g, b"general.alignment", STRING, _string(b"32")), 0, "AdapterError", "general.alignment", False),
    ("suppress-tokens-bytes", "target", "model",
     lambda g: _set(g, b"tokenizer.ggml.suppress_tokens", ARRAY, b"\x05" * 3, 0, 3), 0, "ModelLoadError",
     "tokenizer.ggml.suppress_tokens", False),
    ("scores-shorter-than-tokens", "target", "model",
     lambda g: _set(g, b"tokenizer.ggml.scores", ARRAY, struct.pack("<4f", 0, 0, 0, 0), F32, 4), 0,
     "ModelLoadError", "tokenizer.ggml.scores", False),
    ("split-no-u32-given", "split", "split", _split_no_u32, 1, "ModelLoadError", "split.no", True),
    ("split-no-u32-found", "split", "split-first", _split_no_u32, 1, "ModelLoadError", "split.no", True),
    ("lora-alpha-string", "lora", "lora",
     lambda g: _set(g, b"adapter.lora.alpha", STRING, _string(b"8")), 0, "AdapterError", "adapter.lora.alpha", True),
    ("lora-type-empty-array", "lora", "lora",
     lambda g: _set(g, b"general.type", ARRAY, b"", STRING, 0), 0, "AdapterError", "general.type", True),
    ("quantize-per-layer-float-array", "target", "quantize", _ff_float_array, 0, "QuantizeError",
     "llama.feed_forward_length", False),
    ("duplicate-key", "target", "model", lambda g: g.kvs.append(list(g.kvs[1])), 0, "ModelLoadError",
     "appears twice", False),
    ("empty-key-lora", "lora", "lora", lambda g: g.kvs[2].__setitem__(0, b""), 0, "AdapterError", "is empty", False),
    # gguf_init_from_file divides by ne[1..3]: a SIGFPE in every door (found by the gguf_doors target)
    ("tensor-zero-dim-model", "target", "model", lambda g: g.tensors[0][1].__setitem__(1, 0), 0, "ModelLoadError",
     "dimension of 0", False),
    ("tensor-zero-dim-lora", "lora", "lora", lambda g: g.tensors[0][1].__setitem__(1, 0), 0, "AdapterError",
     "dimension of 0", False),
    ("tensor-zero-dim-cvec", "cvec", "cvec", lambda g: g.tensors[0].__setitem__(1, [g.tensors[0][1][0], 1, 0]), 0,
     "AdapterError", "dimension of 0", False),
    ("tensor-zero-dim-split", "split", "split-first", lambda g: g.tensors[0][1].append(0), 1, "ModelLoadError",
     "dimension of 0", False),
    # a model's tensors are mapped in place: an alignment below 32 asserts in ggml_backend_tensor_alloc (the fuzzer)
    ("alignment-16-model", "target", "model", lambda g: _set(g, b"general.alignment", U32, struct.pack("<I", 16)), 0,
     "ModelLoadError", "must be aligned", True),
    # deepseek4.cpp GGML_ASSERTs compress_ratios' length <= LLAMA_MAX_LAYERS (0c1e57098): the rule bounds it everywhere
    ("compress-ratios-past-max-layers", "target", "model",
     lambda g: _set(g, b"llama.attention.compress_ratios", ARRAY, struct.pack("<600I", *[1] * 600), U32, 600), 0,
     "ModelLoadError", "llama.attention.compress_ratios", False),
    # load_control_vector has gguf allocate the data section first: GGML_ASSERT in ggml_init (found by the fuzzer)
    ("tensor-data-past-end-cvec", "cvec", "cvec", lambda g: g.tensors[0].__setitem__(1, [2**40]), 0,
     "AdapterError", "runs past the end of the file", False),
    # values llama.cpp GGML_ASSERTs on while it reads the hyperparameters (found by the 100,000-file fuzz run):
    # no rule, the load guard of csrc/pyspec_rpc.cpp fails the load with llama.cpp's own assert text
    ("block-count-zero", "target", "model", lambda g: _set(g, b"llama.block_count", U32, struct.pack("<I", 0)), 0,
     "ModelLoadError", "GGML_ASSERT(hparams.n_layer_all > 0", False),
    ("experts-used-without-experts", "target", "model",
     lambda g: _set(g, b"llama.expert_used_count", U32, struct.pack("<I", 2)), 0,
     "ModelLoadError", "GGML_ASSERT(n_expert_used_max <= hparams.n_expert)", False),
    ("block-count-zero-split", "split", "split", lambda g: _set(g, b"llama.block_count", U32, struct.pack("<I", 0)), 0,
     "ModelLoadError", "GGML_ASSERT(hparams.n_layer_all > 0", False),
    ("block-count-zero-quantize", "target", "quantize",
     lambda g: _set(g, b"llama.block_count", U32, struct.pack("<I", 100000)), 0, "QuantizeError",
     "GGML_ASSERT(hparams.n_layer_all > 0", False),
]


def _door_args(case: tuple, sets: dict[str, list[Path]], tmp: Path) -> tuple[str, list[str]]:
    cid, name, door, fn, index = case[:5]
    paths = _edit(name, sets, tmp / cid, fn, index)
    if door == "split-first":
        return "split", [str(paths[0])]  # llama.cpp finds the others itself
    return door, [str(p) for p in paths]


@pytest.fixture(scope="module")
def worker():
    with Worker("pyspec.testing.fuzz", timeout=180) as w:
        yield w


@pytest.mark.parametrize("name", ["target", "draft", "eagle3", "mtp", "lora", "cvec", "split"])
def test_the_unmutated_files_open_through_their_door(worker, sets, name):
    door = {"lora": "lora", "cvec": "cvec", "split": "split"}.get(name, "model")
    paths = [str(p) for p in sets[name]]
    if door == "model":
        assert gguf_keys.gguf_problem(paths[0], "model") == ""
    r = worker.call("open_door", door, paths)
    assert r.status == "ok", r.describe()


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_each_door_refuses_what_llama_cpp_would_abort_on(worker, sets, tmp_path, case):
    door, paths = _door_args(case, sets, tmp_path)
    r = worker.call("open_door", door, paths)
    assert not r.crashed, r.describe()
    assert r.status == "raised" and case[5] in r.exc_types, r.describe()
    assert case[6] in r.message, r.describe()
    # the message names the file (the edited one of a split set) and, for a type, what was expected
    edited = Path(paths[0]).parent / sets[case[1]][case[4]].name
    assert str(edited) in r.message or edited.name in r.message, r.describe()
    if not any(w in case[6] for w in ("appears", "empty", "dimension", "past the end", "aligned", "GGML_ASSERT")) \
            and "scores" not in case[0]:
        assert "expected" in r.message, r.describe()


def test_the_quantize_source_is_checked_before_llama_cpp(sets, tmp_path):
    from pyspec.core.quantize import quantize
    from pyspec.errors import QuantizeError

    (src,) = _edit("target", sets, tmp_path, _ff_float_array)
    with pytest.raises(QuantizeError, match=r"llama\.feed_forward_length.*expected a scalar or an array of"):
        quantize(src, tmp_path / "out.gguf", "q8_0", dry_run=True)


@pytest.mark.slow  # each case kills a worker, which reloads the tiny models
@pytest.mark.parametrize("case", [c for c in CASES if c[7]], ids=[c[0] for c in CASES if c[7]])
def test_without_the_rules_llama_cpp_aborts(sets, tmp_path, case):
    door, paths = _door_args(case, sets, tmp_path)
    with Worker("pyspec.testing.fuzz", timeout=180) as w:
        r = w.call("open_door_unguarded", door, paths)
    # a signal, or "hang" when the worker's pipe closed while ggml_abort's backtrace still ran; or, where
    # the assert is on the loading thread, the load guard's error with llama.cpp's assert in it
    assert r.crashed or (r.status == "raised" and "GGML_ASSERT" in r.message), r.describe()


def test_an_assert_while_loading_fails_the_load_and_this_process_goes_on(sets, tmp_path):
    from pyspec import Model
    from pyspec.errors import ModelLoadError

    (src,) = _edit("target", sets, tmp_path, lambda g: _set(g, b"llama.block_count", U32, struct.pack("<I", 0)))
    for _ in range(3):  # the guard is left as it was: each load fails the same way
        with pytest.raises(ModelLoadError, match=r"llama\.cpp refused the file: .*src/llama-model\.cpp:\d+: "
                                                 r"GGML_ASSERT\(hparams\.n_layer_all > 0"):
            Model(src)
    with Model(sets["target"][0]) as good:  # and a good file loads after it
        assert good.n_layer > 0


def test_the_mutator_reads_and_writes_every_file_back_byte_for_byte(sets):
    for name, paths in sets.items():
        for p in paths:
            raw = p.read_bytes()
            g = fuzz.GgufFile(raw)
            assert g.encode() == raw, f"{name}: {p.name}"
            assert g.copy().encode() == raw


def test_each_mutation_class_changes_the_file(sets):
    raw = sets["target"][0].read_bytes()
    base = fuzz.GgufFile(raw)
    changed = set()
    for op in range(14):
        for seed in range(40):
            g = base.copy()
            # Input.num(0, 13) reads one byte: the first byte picks the class
            fuzz.mutate_gguf(g, fuzz.Input(bytes([op]) + bytes((seed * 37 + j * 11) % 256 for j in range(64))))
            if g.encode() != raw:
                changed.add(op)
                break
    assert changed == set(range(14))


def test_a_mutated_alignment_of_the_wrong_size_still_encodes(sets):
    # found by the long run: a type changed to uint32 with the old payload kept (a finding of the mutator itself)
    g = fuzz.GgufFile(sets["cvec"][0].read_bytes())
    _set(g, b"general.alignment", U32, b"\x20")
    assert g.alignment() == 32 and g.encode()[:4] == b"GGUF"


def _int32_scores(g: fuzz.GgufFile) -> None:
    for kv in g.kvs:
        if kv[0] == b"tokenizer.ggml.scores":
            n = kv[3]
            kv[1:] = [ARRAY, I32, n, struct.pack(f"<{n}i", *range(-n, 0))]
            return
    raise AssertionError("no tokenizer.ggml.scores")


def test_int32_scores_pass_the_check_and_load_as_llama_cpp_loads_them(worker, sets, tmp_path):
    # llama_vocab::impl::load takes scores as float32 or int32 since 0c1e57098: neither check may refuse them
    (path,) = _edit("target", sets, tmp_path, _int32_scores)
    assert gguf_keys.gguf_problem(str(path), "model") == ""
    r = worker.call("open_door", "model", [str(path)])
    assert r.status == "ok", r.describe()
