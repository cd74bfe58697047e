"""The slot file: one engine slot's tokens and sequence states on disk (Engine.save_slot / restore_slot).

The server's slot save/restore (tools/server/server-context.cpp) writes llama.cpp's
sequence-state file; a pyspec slot holds a target and an optional draft state, so its
file is ours::

    SLOT_FILE_MAGIC | u64 little-endian header length | JSON header | target state | draft state

The JSON header carries ``model`` (the model description), ``n_vocab``, ``tokens`` and the
two state sizes ``n_tgt`` / ``n_dft``. The states are ``llama_state_seq_get_data`` blobs;
Context.state_seq_set walks each one (state.check_seq_state) before llama.cpp reads it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["SLOT_FILE_MAGIC", "read_slot_file", "write_slot_file"]

SLOT_FILE_MAGIC = b"PYSPEC-SLOT\x00"


def write_slot_file(path: Path, head: dict[str, Any], tgt: bytes, dft: bytes) -> None:
    """Write the header and the two states; through a temporary file, so a failed write leaves ``path`` as it was
    (and no temporary file). ValueError where ``path`` is a folder."""
    if path.is_dir():
        raise ValueError(f"{path} is a folder, not a slot file")
    data = json.dumps(head).encode()
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("wb") as f:
            f.write(SLOT_FILE_MAGIC + len(data).to_bytes(8, "little") + data + tgt + dft)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_slot_file(path: Path) -> tuple[Any, bytes]:
    """The parsed JSON header (not yet checked) and the state bytes after it; ValueError if it is no slot file."""
    data = path.read_bytes()
    m = len(SLOT_FILE_MAGIC)
    if data[:m] != SLOT_FILE_MAGIC or len(data) < m + 8:
        raise ValueError(f"{path} is not a pyspec slot file")
    n_head = int.from_bytes(data[m : m + 8], "little")
    try:
        head = json.loads(data[m + 8 : m + 8 + n_head])
    except ValueError as e:
        raise ValueError(f"{path}: bad slot file header ({e})") from None
    return head, data[m + 8 + n_head :]
