"""Route llama.cpp / ggml logging to Python's ``logging`` (logger ``pyspec.llama``).

The logger is quiet by default (ERROR); a user raises verbosity with
``logging.getLogger("pyspec.llama").setLevel(logging.DEBUG)``.
"""

from __future__ import annotations

import logging

from pyspec._abi import ffi, ggml, llama, ref

logger = logging.getLogger("pyspec.llama")

_LEVELS = {
    1: logging.DEBUG,
    2: logging.INFO,
    3: logging.WARNING,
    4: logging.ERROR,
}

# llama.cpp writes one line in several calls; GGML_LOG_LEVEL_CONT continues
# the previous level, so lines are assembled before they reach logging.
_pending: list[str] = []
_pending_level = logging.INFO


@ffi.callback("void(enum ggml_log_level, const char *, void *)")
def _on_log(level: int, text, _user_data) -> None:  # noqa: ANN001 - cffi cdata
    global _pending_level
    try:
        if level != 5:  # not GGML_LOG_LEVEL_CONT
            _pending_level = _LEVELS.get(level, logging.INFO)
        if not logger.isEnabledFor(_pending_level):
            return
        _pending.append(ffi.string(text).decode("utf-8", "replace"))
        if _pending[-1].endswith("\n"):
            line = "".join(_pending).rstrip("\n")
            _pending.clear()
            logger.log(_pending_level, "%s", line)
    except Exception:  # a callback must never raise into C
        pass


def install() -> None:
    """Send llama.cpp and ggml logs to the ``pyspec.llama`` logger; keep the C++ common log quiet."""
    llama.llama_log_set(_on_log, ffi.NULL)
    ggml.ggml_log_set(_on_log, ffi.NULL)
    set_common_log_verbosity(-1)


def set_common_log_verbosity(verbosity: int) -> None:
    """Threshold of llama.cpp's common log, which the C++ reference writes to stderr
    (-1 silences it, 0 shows info, warnings and errors, 1 and up adds debug lines)."""
    ref.pyspec_ref_log_set_verbosity(verbosity)


if logger.level == logging.NOTSET:
    logger.setLevel(logging.ERROR)
