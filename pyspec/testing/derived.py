"""Files derived from the tiny test models, for the wrapper tests: a LoRA adapter,
a control vector, a split copy and a copy with a chat template.

Written with the vendored gguf-py like the models themselves
(:mod:`pyspec.testing.models`), deterministic for a given seed, into a folder
the caller chooses (a test's tmp_path): each is small next to the models.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pyspec.testing import models as tm

__all__ = ["FIM_TOKENS", "TinyLora", "make_chat_model", "make_control_vector", "make_infill_target", "make_lora",
           "make_split_target"]


@dataclass
class TinyLora:
    """A LoRA written by :func:`make_lora`, with its matrices for computing the expected effect.

    For a weight W (numpy shape (n_out, n_in)) the adapted product is
    ``W @ x + scale * alpha / rank * b[name] @ (a[name] @ x)``.
    """

    path: Path
    alpha: float
    rank: int
    a: dict[str, np.ndarray] = field(default_factory=dict)  # (rank, n_in)
    b: dict[str, np.ndarray] = field(default_factory=dict)  # (n_out, rank)


def _target_shapes() -> dict[str, tuple[int, ...]]:
    return {name: data.shape for name, data in tm.llama_tensors()}


def make_lora(
    path: Path,
    targets: Sequence[str] = ("output.weight",),
    *,
    rank: int = 4,
    alpha: float = 8.0,
    seed: int = 7,
    arch: str = "llama",
    alora_invocation_tokens: Sequence[int] | None = None,
    extra_tensors: Sequence[tuple[str, np.ndarray]] = (),
) -> TinyLora:
    """A LoRA adapter GGUF for the tiny target (``tm.make_target``) on the weights ``targets``."""
    gguf = tm.gguf_module()
    shapes = _target_shapes()
    rng = np.random.default_rng(seed)
    lora = TinyLora(Path(path), alpha, rank)
    writer = gguf.GGUFWriter(lora.path, arch)
    writer.add_type("adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", alpha)
    writer.add_name("pyspec-tiny-lora")
    if alora_invocation_tokens is not None:
        writer.add_key_value("adapter.alora.invocation_tokens", list(alora_invocation_tokens),
                             gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT32)
    for name in targets:
        n_out, n_in = shapes[name]
        a = (rng.standard_normal((rank, n_in)) / np.sqrt(n_in)).astype(np.float32)
        b = (rng.standard_normal((n_out, rank)) / np.sqrt(rank)).astype(np.float32)
        lora.a[name], lora.b[name] = a, b
        writer.add_tensor(f"{name}.lora_a", a)
        writer.add_tensor(f"{name}.lora_b", b)
    for name, data in extra_tensors:
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return lora


def make_control_vector(path: Path, directions: dict[int, np.ndarray]) -> Path:
    """A control-vector GGUF (``direction.<layer>`` F32 vectors, as llama.cpp's tools write them)."""
    gguf = tm.gguf_module()
    writer = gguf.GGUFWriter(Path(path), "controlvector")
    writer.add_string("controlvector.model_hint", "llama")
    writer.add_uint32("controlvector.layer_count", len(directions))
    for layer, vector in sorted(directions.items()):
        writer.add_tensor(f"direction.{layer}", np.asarray(vector, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def _write_target_copy(path: Path, name: str, extra_kv: dict[str, Any] | None = None, **writer_kw: Any) -> Any:
    gguf = tm.gguf_module()
    writer = gguf.GGUFWriter(path, "llama", **writer_kw)
    tm._add_common_kv(writer, name, tm.TARGET_LAYERS)
    writer.add_rope_dimension_count(tm.HEAD_DIM)
    for key, value in (extra_kv or {}).items():
        if isinstance(value, int):
            writer.add_uint32(key, value)
        else:
            writer.add_string(key, value)
    for tname, data in tm.llama_tensors():
        writer.add_tensor(tname, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return writer


def make_split_target(folder: Path, max_tensors: int = 16, stem: str = "pyspec-split") -> list[Path]:
    """The tiny target written as split files ``<stem>-0000k-of-0000n.gguf``; returns them in order."""
    path = Path(folder) / f"{stem}.gguf"
    _write_target_copy(path, "pyspec-tiny-target", split_max_tensors=max_tensors)
    files = sorted(Path(folder).glob(f"{stem}-*-of-*.gguf"))
    if len(files) < 2:
        raise AssertionError(f"expected several split files, got {files}")
    return files


def make_chat_model(path: Path, template: str) -> Path:
    """A copy of the tiny target whose tokenizer.chat_template is ``template``."""
    _write_target_copy(Path(path), "pyspec-tiny-chat", {"tokenizer.chat_template": template})
    return Path(path)


# fill-in-the-middle token ids of make_infill_target: byte tokens <0x10>..<0x12>, which no text produces
FIM_TOKENS = {"pre": 19, "suf": 20, "mid": 21}


def make_infill_target(path: Path) -> Path:
    """A copy of the tiny target with fill-in-the-middle tokens (tokenizer.ggml.fim_pre/suf/mid_token_id):
    a model llama-server's /infill takes."""
    _write_target_copy(Path(path), "pyspec-tiny-infill",
                       {f"tokenizer.ggml.fim_{k}_token_id": v for k, v in FIM_TOKENS.items()})
    return Path(path)
