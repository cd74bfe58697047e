"""The struct layout probe: the compiler's sizeof / offsetof of every declared struct equal cffi's."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

from pyspec import decl
from pyspec.ffi import _make_ffi, ext, ffi, layout_mismatches, lib_dir


def test_every_declared_struct_and_field_is_probed_and_matches():
    layouts = decl.struct_layouts(ffi)
    entries = sum(1 + len(fields or ()) for fields in layouts.values())
    assert ext.pyspec_layout_count() == entries
    with_fields = {ctype for ctype, fields in layouts.items() if fields is not None}
    assert {"struct llama_context_params", "struct llama_model_params", "struct llama_model_kv_override",
            "struct llama_sampler_i", "struct ggml_tensor", "struct ggml_threadpool_params", "ggml_bf16_t",
            "struct ggml_opt_optimizer_params"} <= with_fields
    assert layouts["struct llama_model"] is None  # opaque ones are recorded too
    assert "val_str" in (layouts["struct llama_model_kv_override"] or [])  # a member of the anonymous union
    assert "adamw.beta2" in (layouts["struct ggml_opt_optimizer_params"] or [])  # a nested anonymous struct
    assert layout_mismatches(ffi, ext) == []


def _mutated(old: str, new: str, name: str = "llama.h") -> object:
    text = decl.read(name)
    assert old in text
    return _make_ffi({name: text.replace(old, new, 1)})[0]


def test_a_wider_field_is_caught():
    f = _mutated("    int32_t n_gpu_layers;", "    int64_t n_gpu_layers;")
    problems = layout_mismatches(f, ext)
    assert any(p.startswith("struct llama_model_params.n_gpu_layers: offset/size (16, 8) in the declarations, "
                            "(16, 4) in C") for p in problems), problems
    assert any(p.startswith("struct llama_model_params.split_mode: offset/size (24, 4) in the declarations, "
                            "(20, 4) in C") for p in problems), problems


def test_swapped_fields_are_caught():
    f = _mutated("    bool vocab_only;\n    bool check_tensors;", "    bool check_tensors;\n    bool vocab_only;")
    problems = layout_mismatches(f, ext)
    assert sorted(p.split(":")[0] for p in problems) == [
        "struct llama_model_params.check_tensors", "struct llama_model_params.vocab_only"]


def test_a_lost_field_is_caught():
    f = _mutated("    bool kv_unified;\n", "")
    problems = layout_mismatches(f, ext)
    assert "struct llama_context_params.kv_unified is in the layout probe but not declared (the declaration lost it)" \
        in problems


def test_a_mutated_declaration_fails_the_first_library_open(tmp_path: Path):
    # a copy of the package whose llama.h declaration has a field too wide, over the real libraries
    shutil.copytree(Path(__file__).resolve().parents[1] / "pyspec", tmp_path / "pyspec",
                    ignore=shutil.ignore_patterns("lib", "__pycache__"))
    path = tmp_path / "pyspec" / "decl" / "llama.h"
    text = path.read_text()
    assert "    int32_t main_gpu;" in text
    path.write_text(text.replace("    int32_t main_gpu;", "    int64_t main_gpu;", 1))
    # -S: no .pth files, so an editable install's import redirect (scikit-build-core's finder, which
    # comes before PYTHONPATH) cannot send `import pyspec` back to the sources; site-packages by hand
    pythonpath = os.pathsep.join([str(tmp_path), *site.getsitepackages()])
    env = {**os.environ, "PYTHONPATH": pythonpath, "PYSPEC_LIB_DIR": str(lib_dir())}
    code = f"import pyspec; assert pyspec.__file__.startswith({str(tmp_path)!r}), pyspec.__file__\n"
    code += "from pyspec.ffi import llama; llama.llama_max_devices()"
    done = subprocess.run([sys.executable, "-S", "-c", code], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0
    assert "ImportError: pyspec: the declarations in pyspec/decl do not match the libraries" in done.stderr
    assert "struct llama_model_params.main_gpu" in done.stderr


def test_the_prebuilt_ffi_is_used_and_equals_the_parsed_declarations(tmp_path: Path, monkeypatch):
    from pyspec import ffi as ffi_module

    prebuilt = ffi_module._prebuilt_ffi()
    assert prebuilt is not None, "the build installs _pyspec_ffi.py beside the libraries"
    assert ffi is prebuilt or type(ffi) is type(prebuilt)  # the package runs on it
    parsed = _make_ffi()[0]
    layouts = decl.struct_layouts(parsed)
    assert decl.struct_layouts(prebuilt) == layouts
    for ctype, fields in layouts.items():
        if fields is not None:
            mine = decl.field_layout(prebuilt, prebuilt.typeof(ctype))
            assert mine == decl.field_layout(parsed, parsed.typeof(ctype))
    for enum in ("enum llama_ftype", "enum ggml_type", "enum pyspec_ref_status", "enum common_sampler_type"):
        assert prebuilt.typeof(enum).relements == parsed.typeof(enum).relements
    # a module made from other declarations is not used
    stale = (lib_dir() / ffi_module.PREBUILT_MODULE).read_text().replace("DECL_DIGEST = \"", "DECL_DIGEST = \"0")
    (tmp_path / ffi_module.PREBUILT_MODULE).write_text(stale)
    monkeypatch.setenv("PYSPEC_LIB_DIR", str(tmp_path))
    assert ffi_module._prebuilt_ffi() is None



def test_a_declared_symbol_the_library_lacks_is_an_attribute_error_in_either_ffi_mode(monkeypatch):
    # the prebuilt FFI raises ffi.error for it, a parsed one AttributeError; pyspec.ffi makes both
    # AttributeError (pyspec.core.threadpool tells a linked CPU backend from a loaded one this way)
    from pyspec import ffi as ffi_module

    class Missing:
        def __getattr__(self, name):
            raise ffi.error(f"symbol '{name}' not found in library 'libggml.so'")

    monkeypatch.setattr(ffi_module, "open_library", lambda name: Missing())
    with pytest.raises(AttributeError, match="symbol 'ggml_threadpool_pause' not found"):
        ffi_module._Library("ggml").ggml_threadpool_pause  # noqa: B018
