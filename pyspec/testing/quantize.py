"""Q8_0 copies of the tiny test models, for batch-invariance proofs.

The tiny models keep their weights in F16. llama.cpp's CPU backend multiplies
float weights with llamafile's tinyBLAS from two rows on and with ggml's dot
products for one row, and the two sum in different orders: a row's last bits
then depend on its batch even in batch-invariant mode. Q8_0 weights take the
same bits on both paths, so Q8_0 copies of the same models (same metadata, the
2-D F16 matrices quantized with the PyPI ``gguf`` package) show what the mode
guarantees for quantized models, for every type, EAGLE3 and MTP included.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from pyspec.testing.models import cache_dir

__all__ = ["q8_0_copy"]


def q8_0_copy(src: str | os.PathLike[str]) -> Path:
    """A copy of the GGUF ``src`` whose 2-D F16 matrices are Q8_0 (made once, cached beside the tiny models)."""
    import gguf

    src = Path(src)
    dst = cache_dir() / f"{src.stem}-q8_0.gguf"
    if dst.is_file() and dst.stat().st_mtime >= src.stat().st_mtime:
        return dst
    q = gguf.GGMLQuantizationType
    reader = gguf.GGUFReader(src)
    tmp = dst.with_suffix(f".{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(str(tmp), reader.fields["general.architecture"].contents())
    try:
        for key, field in reader.fields.items():
            if key.startswith("GGUF.") or key == "general.architecture":
                continue  # the writer's own
            value: Any = field.contents()
            if key == "general.file_type":
                value = int(gguf.LlamaFileType.MOSTLY_Q8_0)
            kind = field.types[0]
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, value, kind, sub_type=sub)
        for t in reader.tensors:
            data = np.asarray(t.data)
            if t.tensor_type == q.F16 and len(t.shape) == 2 and int(t.shape[0]) % 32 == 0:
                writer.add_tensor(t.name, gguf.quants.quantize(data.astype(np.float32), q.Q8_0), raw_dtype=q.Q8_0)
            else:
                writer.add_tensor(t.name, data, raw_dtype=t.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    tmp.replace(dst)
    return dst
